//! Sluice: moves tensors between processes over the fastest path each pair of peers shares,
//! with an RPC agent on top. This crate re-exports the layers; `sluice bench` is its CLI.
//!
//! - [`transport`]: ordered, reliable connections (TCP, shared memory).
//! - [`channel`]: devices, buffers, channels and the negotiated pipe.
//! - [`agent`]: RPC over pipes (workers, calls, RRefs, timeouts, device maps, shutdown).
//! - [`autograd`]: tensors, ops with backward, distributed autograd, the distributed optimizer.
//! - [`demos`]: the training demos behind `sluice demo` and the examples.

#![deny(unsafe_code)]

pub mod demos;
pub mod launch;
mod orphan;

pub use sluice_agent as agent;
pub use sluice_autograd as autograd;
pub use sluice_channel as channel;
pub use sluice_collective as collective;
pub use sluice_transport as transport;
