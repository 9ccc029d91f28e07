//! System calls the channel crate makes itself: one `prctl` (the rest of its `unsafe` is CUDA, RDMA
//! and the shared segment, each in its own module).
#![allow(unsafe_code)]

use std::io;

/// Lets any process of ours ptrace (and so `process_vm_readv`) this one, as Yama scope 1
/// otherwise allows only ancestors.
pub(crate) fn allow_any_ptracer() -> io::Result<()> {
    // SAFETY: PR_SET_PTRACER takes one integer argument and touches no memory of ours; the
    // remaining variadic arguments are ignored by the kernel for this option.
    let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
