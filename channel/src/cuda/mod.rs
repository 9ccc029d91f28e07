//! The CUDA channels' machinery, on top of the CUDA runtime (`sluice-cuda`, re-exported here
//! so `sluice_channel::cuda::…` keeps naming it): [`descriptor`] is the pure negotiation logic
//! (GPU descriptors and which pairs each CUDA channel connects), `ipc` the opened IPC handles
//! (cached and bounded per process, closed with the peer's last pipe), and [`staged`] the chunk
//! plan and pinned slot pools of cuda_staged. The pipe uses all three.
#![allow(unsafe_code)]

pub use sluice_cuda::*;

pub mod descriptor;
pub(crate) mod ipc;
pub mod staged;
