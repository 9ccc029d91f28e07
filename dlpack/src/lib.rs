//! DLPack at Sluice's edges: the bindings (Python, C) take tensors described by DLPack's
//! `DLTensor` and hand received ones back the same way.
//!
//! - [`ffi`]: DLPack's C structures (the legacy, unversioned ABI every framework speaks).
//! - [`Meta`]: what travels beside a tensor's bytes (dtype, shape, strides), parsed and checked
//!   on arrival, never trusted; the same encoding from Python and C, so they interoperate.
//! - [`Imported`]: a producer's `DLManagedTensor` we took ownership of (sending without a
//!   copy); [`export`]: received bytes handed out as a `DLManagedTensor` (receiving without a
//!   copy).

pub mod ffi;
mod managed;
mod meta;

pub use managed::{export, export_versioned, Imported};
pub use meta::{DType, Meta, MetaError, MAX_RANK};
