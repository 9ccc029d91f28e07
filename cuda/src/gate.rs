//! The one gate every test that needs hardware or an optional library passes first, in every
//! crate (this is the lowest crate that knows about GPUs).
//!
//! Without what it needs, a test *skips*: it prints `SKIPPED: <test>: <why>` and returns. The
//! line is written straight to the process's stderr, past libtest's output capture, so a
//! passing run shows it beside the test's `ok`; with `SLUICE_SKIP_LOG=FILE` it is also appended
//! to FILE, which CI counts and prints at the end of its run. Where the hardware is supposed to
//! be, a requirement variable turns the skip into a failure: `SLUICE_REQUIRE_GPU=1` (set by
//! `scripts/gpu-check.sh`) for the GPU and CUDA compute (NVRTC, cuBLAS), `SLUICE_REQUIRE_NVRTC=1`
//! for NVRTC alone, `SLUICE_REQUIRE_RDMA=1` for an RDMA device. A check that silently skipped
//! there would prove nothing.

use std::fmt::Display;
use std::io::Write;

/// The file skip lines are appended to, when set.
pub const SKIP_LOG: &str = "SLUICE_SKIP_LOG";

/// Whether the requirement variable `var` is set (to anything but `0` or empty).
pub fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Reports that `test` skipped because of `why`: on stderr, past the test harness's capture,
/// and in `SLUICE_SKIP_LOG` when set.
pub fn skipped(test: &str, why: impl Display) {
    report(&format!("SKIPPED: {test}: {why}"));
}

/// Reports a skip line as it stands (a line a worker process printed, passed through).
pub fn report(line: &str) {
    let line = format!("{}\n", line.trim_end());
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os(SKIP_LOG) {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Whether `test` may go on, given what it needs (`probe`): `Ok` goes on; an error skips it
/// (see [`skipped`]), or fails it with the reason when the requirement variable `var` is set.
pub fn require<E: Display>(test: &str, var: &str, probe: Result<(), E>) -> bool {
    match verdict(test, var, probe) {
        None => true,
        Some(why) => {
            skipped(test, why);
            false
        }
    }
}

/// `None` to go on, `Some(why)` to skip; panics when the probe failed and `var` is set.
fn verdict<E: Display>(test: &str, var: &str, probe: Result<(), E>) -> Option<String> {
    match probe {
        Ok(()) => None,
        Err(why) if required(var) => panic!("{test}: required here ({var} is set) but {why}"),
        Err(why) => Some(why.to_string()),
    }
}

/// Whether `test` can use a GPU (fails under `SLUICE_REQUIRE_GPU=1` when it cannot).
pub fn gpu_or_skip(test: &str) -> bool {
    require(test, "SLUICE_REQUIRE_GPU", crate::runtime().map(|_| ()))
}

/// Whether `test` can compute on a GPU: a GPU, NVRTC and cuBLAS (fails under
/// `SLUICE_REQUIRE_GPU=1` when any is missing).
pub fn compute_or_skip(test: &str) -> bool {
    require(test, "SLUICE_REQUIRE_GPU", crate::compute::available())
}

/// Whether `test` can compile kernels (NVRTC alone, no driver needed): fails under
/// `SLUICE_REQUIRE_NVRTC=1` or `SLUICE_REQUIRE_GPU=1` when it cannot.
pub fn nvrtc_or_skip(test: &str) -> bool {
    let probe = crate::compute::nvrtc_present();
    if probe.is_err() && required("SLUICE_REQUIRE_GPU") {
        return require(test, "SLUICE_REQUIRE_GPU", probe);
    }
    require(test, "SLUICE_REQUIRE_NVRTC", probe)
}

/// Whether `test`, a check for machines *without* a CUDA driver, applies here: on a machine
/// with one it skips (and never fails: the GPU checks cover that machine).
pub fn without_driver_or_skip(test: &str) -> bool {
    if crate::driver::library_present() {
        skipped(
            test,
            "this machine has a CUDA driver library (the check is for machines without one)",
        );
        return false;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requirement_turns_a_skip_into_a_failure() {
        // Variables of this test's own, so no other test's gate is touched.
        let var = "SLUICE_REQUIRE_GATE_SELF_TEST";
        assert_eq!(verdict::<String>("gate", var, Ok(())), None);
        assert_eq!(
            verdict("gate", var, Err("nothing here")).as_deref(),
            Some("nothing here")
        );
        std::env::set_var(var, "1");
        assert_eq!(verdict::<String>("gate", var, Ok(())), None);
        let failed = std::panic::catch_unwind(|| verdict("gate", var, Err("nothing here")));
        std::env::remove_var(var);
        let msg = failed.expect_err("a required probe that fails must fail the test");
        let msg = msg.downcast_ref::<String>().expect("a formatted panic");
        assert!(msg.contains("nothing here") && msg.contains(var), "{msg}");
        assert!(!required(var));
    }
}
