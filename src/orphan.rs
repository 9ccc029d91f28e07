//! Workers die with their supervisor: a worker started by `sluice launch` or a demo gets the
//! parent-death signal (SIGKILL), so killing the supervisor (which may serve the group's
//! store) never leaves workers waiting on a store or a peer that is gone.
//!
//! The one `unsafe` block of the crate: a `pre_exec` hook.

#![allow(unsafe_code)]

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Arranges for `command`'s process to be killed when the thread that spawns it exits (Linux
/// ties the parent-death signal to the spawning thread: spawn from a thread that lives as
/// long as the job). If the parent is already gone when the child starts, the spawn fails.
pub fn die_with_parent(command: &mut Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the hook runs in the forked child before exec. It calls only prctl(2) and
    // getppid(2), both async-signal-safe; it allocates nothing, takes no lock and touches no
    // state shared with other threads of the parent (`parent` is a copied integer, and
    // `io::Error::from_raw_os_error` stores the code without allocating).
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
            // The parent may have died between fork and prctl: then no signal will come.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            Ok(())
        });
    }
}
