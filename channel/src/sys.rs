//! System calls the channel crate makes itself: one `prctl` and one `madvise` (the rest of its `unsafe` is CUDA, RDMA
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

/// Asks the kernel to back `[address, address + len)` (whole 2 MiB pages of this process's
/// memory) with transparent huge pages now (`MADV_COLLAPSE`, Linux 6.1 and later). The contents
/// stay as they are; only the physical pages behind them change.
pub(crate) fn collapse_huge(address: usize, len: usize) -> io::Result<()> {
    // SAFETY: MADV_COLLAPSE copies the range's existing pages into huge pages and remaps them
    // atomically with respect to other threads; it never changes what the memory holds (unlike
    // MADV_DONTNEED or MADV_FREE) and fails with an error, touching nothing, where it cannot.
    // The caller passes a range inside memory it borrows.
    let rc = unsafe { libc::madvise(address as *mut libc::c_void, len, libc::MADV_COLLAPSE) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
