//! Sluice's C ABI: the pipe level (contexts, listeners, pipes, messages with DLPack tensors)
//! for framework authors writing C or C++. The header is `include/sluice.h`, written by
//! cbindgen from the exported functions and their doc comments (see `build.rs`).
//!
//! Layout:
//! - [`status`]: the status codes, the error type every entry point returns, and the
//!   thread-local last-error message.
//! - [`runtime`]: the tokio runtime the library owns (made once per process), blocking on it
//!   from a C thread, and starting operations in issue order.
//! - [`context`], [`message`], [`pipe`], [`received`], [`op`]: the handles behind the C API's
//!   opaque types, in safe Rust.
//! - [`borrowed`]: the caller's memory and callbacks as Rust values (`unsafe`, small).
//! - [`api`]: the `extern "C"` functions, thin: check and convert the C arguments, call the
//!   safe handles, catch panics (`unsafe`, every block with its `// SAFETY:`).
//!
//! Rules every function keeps: it never unwinds into C (a panic is `SLUICE_PANIC`), it checks
//! every pointer for NULL (`SLUICE_INVALID_ARGUMENT`), and an error leaves a message naming the
//! peer, where there is one, in `sluice_last_error()`.
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod api;
mod borrowed;
pub mod context;
pub mod group;
pub mod message;
pub mod op;
pub mod pipe;
pub mod pool;
pub mod received;
pub mod runtime;
pub mod status;

pub use api::*;
pub use context::{SluiceContext, SluiceListener};
pub use group::{
    SluiceGroup, SluiceGroupBound, SLUICE_REDUCE_AVG, SLUICE_REDUCE_MAX, SLUICE_REDUCE_MIN, SLUICE_REDUCE_PRODUCT,
    SLUICE_REDUCE_SUM,
};
pub use message::SluiceMessage;
pub use op::SluiceOp;
pub use pipe::SluicePipe;
pub use received::{SluiceBuffer, SluiceReceived};
pub use sluice_dlpack::ffi::{DLDataType, DLDevice, DLTensor};
pub use status::{
    SLUICE_CLOSED, SLUICE_INVALID_ARGUMENT, SLUICE_IO, SLUICE_MISUSE, SLUICE_OK, SLUICE_PANIC, SLUICE_PEER,
    SLUICE_PEER_LOST, SLUICE_PENDING, SLUICE_TIMEOUT, SLUICE_UNSUPPORTED,
};
