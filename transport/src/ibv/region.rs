//! Page-aligned memory the NIC reads or writes behind the compiler's back (ring inboxes and
//! outboxes). Accessed only through raw copies whose callers state why the range is theirs.
#![allow(unsafe_code)]

use std::alloc::Layout;

pub(crate) struct Region {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the region is plain memory; who may touch which bytes when is decided by the ring
// protocol (under the connection's lock), not by the type.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// Zeroed, page-aligned memory of `len` bytes (at least one page).
    pub(crate) fn new(len: usize) -> std::io::Result<Region> {
        let layout = Layout::from_size_align(len.max(4096), 4096)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(std::io::Error::new(std::io::ErrorKind::OutOfMemory, "ring allocation"));
        }
        Ok(Region { ptr, layout })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    /// Copies `dst.len()` bytes starting at `off` out of the region.
    ///
    /// # Safety
    /// `off + dst.len()` is within the region, and nobody (the NIC included) writes those
    /// bytes during the copy.
    pub(crate) unsafe fn read(&self, off: usize, dst: &mut [u8]) {
        debug_assert!(off + dst.len() <= self.layout.size());
        std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len());
    }

    /// Copies `src` into the region at `off`.
    ///
    /// # Safety
    /// `off + src.len()` is within the region, and nobody (the NIC included) reads or writes
    /// those bytes during the copy.
    pub(crate) unsafe fn write(&self, off: usize, src: &[u8]) {
        debug_assert!(off + src.len() <= self.layout.size());
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len());
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout. Owners drop the region only after its
        // registration and every work request on it are gone (field order in `Conn`).
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}
