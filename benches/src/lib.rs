//! The benchmark behind `sluice bench`: round-trip latency and one-way bandwidth of every
//! transport and pipe channel, next to raw baselines measured in the same run, so each result
//! is reported as a ratio that survives a noisy, shared machine.
//!
//! Layout: [`peer`] is the other side (a process this one spawns on localhost, or `--listen` on
//! another host); [`raw`] holds the baselines (busy-poll ping-pong over a shared atomic, raw TCP
//! ping-pong and stream with the same tokio waiting strategy as the TCP transport, memcpy);
//! [`run`] drives the suites, [`rpc`] the RPC agent suite (two agent processes), [`autograd`]
//! the training-step suite (same two processes), [`cuda`] the CUDA channels against the
//! device's own copies (with its own peer process), [`ibverbs`] the ibverbs transport and rdma
//! channel against raw verbs (on the verbs model where there is no RDMA hardware), and [`report`]
//! prints the table and the JSON lines.
//!
//! Nothing here asserts a speed: targets are checked by reading the ratios.

// `raw` alone allows unsafe (the shared buffers of its same-size shared-memory baseline).
#![deny(unsafe_code)]

pub mod autograd;
pub mod collective;
pub mod compare;
pub mod cuda;
pub mod ibverbs;
pub mod page;
pub mod peer;
pub mod peers;
pub mod raw;
pub mod report;
pub mod rpc;
pub mod run;
pub mod soak;

pub use report::Record;
pub use run::{run, BenchOptions};
