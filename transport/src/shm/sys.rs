//! The system calls behind the shared-memory transport: memfd segments, mappings, eventfds and
//! descriptor passing. All of this module's `unsafe` is here or in `ring.rs`.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

fn errno(e: nix::errno::Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Creates an anonymous memory file of `len` bytes (freed when its last descriptor closes).
pub(crate) fn memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    let name = CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let fd = nix::sys::memfd::memfd_create(&name, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC).map_err(errno)?;
    nix::unistd::ftruncate(&fd, len as i64).map_err(errno)?;
    Ok(fd)
}

/// Size in bytes of the file behind `fd`.
pub(crate) fn file_len(fd: &OwnedFd) -> io::Result<u64> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(errno)?;
    u64::try_from(st.st_size).map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "negative file size"))
}

/// Frees the pages of `offset..offset + len` of a memory file (a hole punched, the size kept):
/// they read as zeros afterwards, and every process that maps the file loses them from its
/// page tables; a later write allocates a fresh page.
pub(crate) fn punch_hole(fd: &OwnedFd, offset: usize, len: usize) -> io::Result<()> {
    use nix::fcntl::FallocateFlags as F;
    let (offset, len) = (
        i64::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        i64::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
    );
    nix::fcntl::fallocate(
        fd.as_raw_fd(),
        F::FALLOC_FL_PUNCH_HOLE | F::FALLOC_FL_KEEP_SIZE,
        offset,
        len,
    )
    .map_err(errno)
}

/// Bytes of a file backed by memory now (`st_blocks`, in 512-byte units).
pub(crate) fn file_allocated(fd: &OwnedFd) -> io::Result<u64> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(errno)?;
    Ok(u64::try_from(st.st_blocks).unwrap_or(0) * 512)
}

/// A shared, read-write mapping of a whole memory file. Unmapped on drop.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access to its contents goes through atomics
// or through the ring's single-producer/single-consumer protocol, which confines each byte range
// to one thread at a time.
unsafe impl Send for Mapping {}
// SAFETY: as above: shared access is mediated by atomics in the ring header.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` shared and read-write.
    pub(crate) fn new(fd: &OwnedFd, len: usize) -> io::Result<Self> {
        let size = std::num::NonZeroUsize::new(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty mapping"))?;
        // SAFETY: a fresh mapping at an address the kernel chooses aliases no Rust object; the
        // file is at least `len` bytes long (checked by our callers with `file_len`, or sized by
        // `memfd`), so every page of the mapping is backed.
        let ptr = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd,
                0,
            )
        }
        .map_err(errno)?;
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Maps the pages of `offset..offset + len` (clamped to the mapping, widened to whole
    /// pages) writable in this process's page tables now, allocating any the file lacks: one
    /// system call instead of a page fault per page on first write (`MADV_POPULATE_WRITE`,
    /// Linux 5.14). An older kernel refuses it (`EINVAL`), and the pages fault in as before.
    pub(crate) fn populate_write(&self, offset: usize, len: usize) -> io::Result<()> {
        let page = page_size();
        let start = offset.min(self.len) / page * page;
        let end = offset.saturating_add(len).min(self.len);
        if end <= start {
            return Ok(());
        }
        // SAFETY: `start..end` lies inside this mapping (clamped above, `start` page-aligned
        // inside it); the mapping is MAP_SHARED (see `new`), so MADV_POPULATE_WRITE only faults
        // the file's pages in as a write would, changing no contents (no private copy is
        // made), and memory other threads or processes use at the same time is unaffected.
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(start).cast(),
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// The host's page size (asked of the kernel once).
pub fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .map_or(4096, |p| p as usize)
    })
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe exactly the mapping created in `new`, and no reference
        // into it outlives `self` (rings hold an `Arc<Mapping>`).
        unsafe {
            let _ = munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Spin slots shared by every process of this user that sees the same `/dev/shm` (one host,
/// one mount namespace): each holds the pid of a process one of whose threads spins on a
/// shared-memory ring right now, or 0. Mapped once per process and never unmapped. `None` where
/// the file cannot be made or mapped.
pub(crate) fn host_spin_slots() -> Option<&'static [AtomicU32; 16]> {
    static SLOTS: std::sync::OnceLock<Option<Mapping>> = std::sync::OnceLock::new();
    let map = SLOTS.get_or_init(|| {
        use std::os::unix::fs::OpenOptionsExt;
        let path = format!("/dev/shm/sluice-spin-slots-{}", nix::unistd::getuid());
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .ok()?;
        if file.metadata().ok()?.len() < 64 {
            file.set_len(64).ok()?;
        }
        Mapping::new(&OwnedFd::from(file), 64).ok()
    });
    let map = map.as_ref()?;
    // SAFETY: the mapping is page-aligned (so aligned for AtomicU32), 64 bytes long (16 words),
    // lives for the rest of the process (held by the static and never dropped), and its words
    // are only ever accessed atomically, here and in the other processes that map the file.
    Some(unsafe { &*(map.as_ptr() as *const [AtomicU32; 16]) })
}

/// Creates a non-blocking eventfd (counter semantics).
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    let efd = nix::sys::eventfd::EventFd::from_flags(
        nix::sys::eventfd::EfdFlags::EFD_CLOEXEC | nix::sys::eventfd::EfdFlags::EFD_NONBLOCK,
    )
    .map_err(errno)?;
    Ok(OwnedFd::from(efd))
}

/// Adds one to an eventfd's counter, waking whoever waits on it. Never blocks: a saturated
/// counter (EAGAIN) already means "wake up".
pub(crate) fn eventfd_signal(fd: BorrowedFd<'_>) {
    let _ = nix::unistd::write(fd, &1u64.to_ne_bytes());
}

/// Sends `data` with `fds` attached (SCM_RIGHTS) on a Unix stream socket.
pub(crate) fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let iov = [io::IoSlice::new(data)];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    sendmsg::<()>(sock.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None).map_err(errno)
}

/// Receives up to `buf.len()` bytes and any descriptors attached to them. Descriptors beyond
/// `max_fds` are closed and reported as an error, so a peer cannot make us leak descriptors.
pub(crate) fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], max_fds: usize) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!([RawFd; 8]);
    let msg = recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC).map_err(errno)?;
    let mut fds = Vec::new();
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
    for cmsg in msg.cmsgs().map_err(errno)? {
        if let ControlMessageOwned::ScmRights(raw) = cmsg {
            for fd in raw {
                // SAFETY: the kernel just installed `fd` in our table for this message; nothing
                // else refers to it, so taking ownership is sound (and closes it on drop).
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    let n = msg.bytes;
    if truncated || fds.len() > max_fds {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("peer sent {} descriptors (at most {max_fds} expected)", fds.len()),
        ));
    }
    Ok((n, fds))
}

/// Peeks one byte without consuming it: `Ok(0)` means the peer hung up.
pub(crate) fn peek_hangup(sock: BorrowedFd<'_>) -> io::Result<usize> {
    let mut b = [0u8; 1];
    nix::sys::socket::recv(sock.as_raw_fd(), &mut b, MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT).map_err(errno)
}

/// Shuts a socket down in both directions (the peer sees EOF).
pub(crate) fn shutdown(sock: BorrowedFd<'_>) {
    let _ = nix::sys::socket::shutdown(sock.as_raw_fd(), nix::sys::socket::Shutdown::Both);
}

/// The process id of the peer of a Unix socket.
pub(crate) fn peer_pid(sock: impl AsFd) -> Option<i32> {
    nix::sys::socket::getsockopt(&sock, nix::sys::socket::sockopt::PeerCredentials)
        .ok()
        .map(|c| c.pid())
}

/// Registers an owned descriptor with the current tokio reactor for readability.
pub(crate) fn register_readable(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    // SAFETY: an `OwnedFd` is open and stays open, referring to the same description, until it
    // is dropped, which happens only when the `AsyncFd` owning it is dropped; its `as_raw_fd`
    // always returns that same descriptor.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }.map_err(|e| e.into())
}
