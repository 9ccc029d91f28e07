//! Shared memory files another local process can map: a memfd this process creates, and the
//! same file opened by a peer through `/proc/PID/fd/N` (which needs the same permission as
//! reading the peer's memory, so it works wherever cross-memory attach does).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use super::sys::{self, Mapping};

/// A whole memory file mapped shared and read-write in this process.
pub struct SharedFile {
    /// For a file this process created: kept open so a peer can open it through `/proc`. A
    /// peer's file needs no descriptor once mapped.
    fd: Option<OwnedFd>,
    map: Arc<Mapping>,
    len: usize,
}

impl std::fmt::Debug for SharedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedFile")
            .field("fd", &self.raw_fd())
            .field("len", &self.len)
            .finish()
    }
}

impl SharedFile {
    /// A fresh file of `len` bytes (zero-filled; pages are allocated when first touched).
    pub fn create(name: &str, len: usize) -> io::Result<SharedFile> {
        let fd = sys::memfd(name, len)?;
        let map = Arc::new(Mapping::new(&fd, len)?);
        Ok(SharedFile { fd: Some(fd), map, len })
    }

    /// Process `pid`'s file descriptor `fd`, which must be a file of exactly `len` bytes.
    pub fn open_peer(pid: u32, fd: i32, len: usize) -> io::Result<SharedFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/fd/{fd}"))?;
        let fd = OwnedFd::from(file);
        let actual = sys::file_len(&fd)?;
        if actual != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("process {pid}'s file {fd:?} holds {actual} bytes, not the {len} announced"),
            ));
        }
        let map = Arc::new(Mapping::new(&fd, len)?);
        Ok(SharedFile { fd: None, map, len })
    }

    /// The descriptor number a peer opens (see [`SharedFile::open_peer`]); -1 for a file opened
    /// from a peer.
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start of the mapping; valid for `len()` bytes while `self` lives. Other processes
    /// may write it at any time: callers coordinate access through atomics in the file.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// Makes `offset..offset + len` of the mapping present and writable in this process now,
    /// in one system call, rather than one page fault per page on first write (see
    /// `Mapping::populate_write`). Clamped to the file; fails only where the kernel lacks the
    /// call or memory runs out, and then the pages simply fault in when written.
    pub fn populate_write(&self, offset: usize, len: usize) -> io::Result<()> {
        self.map.populate_write(offset, len)
    }

    /// Gives the pages of `offset..offset + len` back to the kernel (a file this process
    /// created only): they read as zeros afterwards, leave every mapping's page tables, and are
    /// allocated afresh when next written. The caller makes sure nobody uses the range meanwhile.
    pub fn release_pages(&self, offset: usize, len: usize) -> io::Result<()> {
        debug_assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "pages {offset}+{len} outside a file of {} bytes",
            self.len
        );
        let fd = self
            .fd
            .as_ref()
            .ok_or_else(|| io::Error::new(io::ErrorKind::Unsupported, "only the file's creator releases its pages"))?;
        let offset = offset.min(self.len);
        sys::punch_hole(fd, offset, len.min(self.len - offset))
    }

    /// Bytes of the file backed by memory now (a file this process created; 0 for a peer's).
    pub fn resident_bytes(&self) -> u64 {
        self.fd
            .as_ref()
            .and_then(|fd| sys::file_allocated(fd).ok())
            .unwrap_or(0)
    }
}
