//! `SLUICE_CUDA_TRACE=N`: the first `N` steps of the direct CUDA path (cuda_ipc, cuda_p2p) in
//! this process, printed to stderr as `cuda-trace <pid> <µs> <step>`. The clock is
//! `CLOCK_MONOTONIC`, one clock for every process of a host, so the lines of a sender and its
//! receiver interleave correctly when sorted by time. Unset (the default), a step costs one
//! atomic load.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

fn limit() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        std::env::var("SLUICE_CUDA_TRACE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// Prints `step` with the time, while this process has printed fewer than the limit.
pub fn mark(step: &str) {
    static PRINTED: AtomicUsize = AtomicUsize::new(0);
    let limit = limit();
    if limit == 0 || PRINTED.fetch_add(1, Ordering::Relaxed) >= limit {
        return;
    }
    if let Ok(t) = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        let us = t.tv_sec() as f64 * 1e6 + t.tv_nsec() as f64 / 1e3;
        eprintln!("cuda-trace {} {us:.1} {step}", std::process::id());
    }
}
