//! Devices, buffers, channels and the pipe.
//!
//! A [`Pipe`] is the per-peer-pair link: opened by a [`Context`] with one round trip of
//! negotiation that picks a transport (TCP for bootstrap, shared memory when both ends share a
//! host and its namespaces) and a channel for every (local device, remote device) pair, then
//! carries [`Message`]s with the two-step receive (descriptor, then receiver-chosen memory).
//!
//! Start with [`context`] (setup and negotiation), then [`pipe`] (the data path), then
//! [`channel`] (how tensor bytes move) and [`negotiation`] (the pure choice functions).
//!
//! CUDA tensors are [`SendBuffer::Cuda`] and [`RecvBuffer::Cuda`] ([`cuda::CudaBuffer`]: device
//! memory plus the stream that orders it); [`cuda`] says when CUDA is usable and what each CUDA
//! channel's completion means.
//!
//! What this crate does not do: reconnect a failed pipe, retry, or order messages across
//! pipes.
#![deny(unsafe_code)]

pub mod channel;
pub mod context;
pub mod cuda;
pub mod device;
pub mod error;
pub mod message;
pub mod negotiation;
pub mod pipe;
mod sys;
pub mod wire;

pub use channel::ChannelKind;
pub use context::{Context, ContextOptions, PipeListener, TransportKind};
pub use cuda::{CudaBuffer, CudaError, Stream};
pub use device::{BadDevice, Device, RecvBuffer, SendBuffer};
pub use error::PipeError;
pub use message::{Allocation, Descriptor, Message, Tensor, TensorDescriptor};
pub use pipe::{Pipe, PipeInfo, ReadError};
pub use sluice_transport::auth::Secret;
