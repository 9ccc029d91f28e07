//! The CUDA channels' machinery, on top of the CUDA runtime (`sluice-cuda`, re-exported here
//! so `sluice_channel::cuda::…` keeps naming it): [`descriptor`] is the pure negotiation logic
//! (GPU descriptors and which pairs each CUDA channel connects), `ipc` the opened IPC handles
//! (cached and bounded per process, closed with the peer's last pipe), `direct` the data path
//! of cuda_ipc and cuda_p2p, and [`staged`] the data path of cuda_staged (its chunk plan and
//! pinned slot pools). The channels' dispatch (`channel::path`) calls the last two.
#![allow(unsafe_code)]

pub use sluice_cuda::*;

pub mod descriptor;
pub(crate) mod direct;
pub(crate) mod ipc;
pub mod staged;
pub mod trace;
