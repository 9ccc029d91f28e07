//! The caller's memory and callbacks as Rust values: [`Lent`] (tensor memory a message
//! borrows, released through the caller's callback when the last reference goes) and [`Done`]
//! (a completion callback). The only `unsafe` outside [`crate::api`].
#![allow(unsafe_code)]

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use bytes::Bytes;
use sluice_channel::{CudaBuffer, Stream};

use crate::api::{SluiceDoneFn, SluiceReadFn, SluiceReleaseFn};

/// Memory lent by the caller: `len` bytes at `ptr`, read by the pipe until the last `Bytes`
/// that views it drops, which calls `release(user)` (once, from whatever thread drops it).
struct Lent {
    ptr: *const u8,
    len: usize,
    release: SluiceReleaseFn,
    user: *mut c_void,
}

// SAFETY: the memory is only read, and the caller promised (`lend`'s contract) that it stays
// valid from any thread until `release`, which it made callable from any thread.
unsafe impl Send for Lent {}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `lend`'s caller guarantees `len` readable bytes at `ptr` until `release`
        // runs, which is not before this value drops.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            // SAFETY: the caller's own callback with its own argument, called exactly once
            // (drop runs once), from any thread as its contract allows.
            unsafe { release(self.user) }
        }
    }
}

/// The caller's memory as `Bytes` without copying; `release(user)` runs when the last
/// reference drops (at once if nothing keeps one).
///
/// # Safety
/// `len` bytes at `ptr` (which may be dangling or NULL when `len` is 0) must stay readable and
/// unchanged until `release` is called (forever when `release` is NULL), and `release` must be
/// callable from any thread.
pub(crate) unsafe fn lend(ptr: *const u8, len: usize, release: SluiceReleaseFn, user: *mut c_void) -> Bytes {
    Bytes::from_owner(Lent {
        ptr,
        len,
        release,
        user,
    })
}

/// A completion callback and its argument, to be called once from a library thread.
pub(crate) struct Done {
    f: SluiceDoneFn,
    user: *mut c_void,
}

// SAFETY: the C API documents that completion callbacks run on library threads; the caller
// made `f` and `user` fit for that.
unsafe impl Send for Done {}

impl Done {
    /// # Safety
    /// `f`, when not NULL, must be callable once with `user` from any thread.
    pub(crate) unsafe fn new(f: SluiceDoneFn, user: *mut c_void) -> Done {
        Done { f, user }
    }

    /// Whether there is no callback to call.
    pub(crate) fn is_none(&self) -> bool {
        self.f.is_none()
    }

    pub(crate) fn call(self, status: c_int) {
        if let Some(f) = self.f {
            // SAFETY: `new`'s contract; `self` is consumed, so this runs once.
            unsafe { f(status, self.user) }
        }
    }
}

/// A read's completion callback and its argument, to be called once from a library thread.
pub(crate) struct ReadDone {
    f: SluiceReadFn,
    user: *mut c_void,
}

// SAFETY: as for `Done`: the C API documents that read callbacks run on library threads.
unsafe impl Send for ReadDone {}

impl ReadDone {
    /// # Safety
    /// `f`, when not NULL, must be callable once with `user` from any thread.
    pub(crate) unsafe fn new(f: SluiceReadFn, user: *mut c_void) -> ReadDone {
        ReadDone { f, user }
    }

    /// Hands `received` (owned by the callee from here on) or the error's status to the callback.
    pub(crate) fn call(self, status: c_int, received: *mut crate::received::SluiceReceived) {
        match self.f {
            // SAFETY: `new`'s contract; `self` is consumed, so this runs once.
            Some(f) => unsafe { f(status, received, self.user) },
            None if !received.is_null() => {
                // SAFETY: nobody took the message: it was made by Box::into_raw just now.
                drop(unsafe { Box::from_raw(received) });
            }
            None => {}
        }
    }
}

/// Caller memory an operation reads or writes in place until its completion callback runs
/// (a collective's buffers).
pub(crate) struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: `Region::new`'s caller lends the memory to the operation alone, from any thread,
// until the operation's completion callback has run.
unsafe impl Send for Region {}

impl Region {
    /// # Safety
    /// `len` bytes at `ptr` (which may be dangling or NULL when `len` is 0) must stay readable,
    /// and writable if [`bytes_mut`](Self::bytes_mut) is used, and must not be touched by
    /// anyone else, until the completion callback of the operation that holds this region has
    /// been called.
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize) -> Region {
        Region { ptr, len }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether these bytes and `other`'s share any byte.
    pub(crate) fn overlaps(&self, other: &Region) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        self.len > 0 && other.len > 0 && a < b.saturating_add(other.len) && b < a.saturating_add(self.len)
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `new`'s contract: `len` readable bytes, nobody else's until completion.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `new`'s contract: `len` writable bytes nobody else touches until completion;
        // `&mut self` keeps this the only view through this region.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// The caller's release callback for memory it lent, as a value that calls it (once, from
/// whatever thread drops the last reference). What keeps a lent GPU tensor's memory alive for
/// the pipe ([`sluice_channel::CudaBuffer::from_raw`]'s `keep`).
struct Released {
    release: SluiceReleaseFn,
    user: *mut c_void,
    /// The caller's stream, fenced before the callback runs (see [`Stream::retire`]).
    stream: Stream,
}

// SAFETY: the value is never read; its only use is the drop, which calls the caller's callback
// as its contract allows (once, from any thread).
unsafe impl Send for Released {}
// SAFETY: as above: no method reads it through a shared reference.
unsafe impl Sync for Released {}

impl Released {
    /// # Safety
    /// `release`, when not NULL, must be callable once with `user` from any thread.
    unsafe fn new(release: SluiceReleaseFn, user: *mut c_void, stream: Stream) -> Released {
        Released { release, user, stream }
    }

    /// Forgets the callback: for memory that was not taken after all.
    fn disarm(&mut self) {
        self.release = None;
    }
}

impl Drop for Released {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            // The caller may destroy its stream once called back: a copy still held elsewhere
            // (an abandoned staging copy) must not record on it afterwards.
            self.stream.retire();
            // SAFETY: `new`'s contract; drop runs once.
            unsafe { release(self.user) }
        }
    }
}

/// The caller's device memory as a buffer without copying, ordered by its stream `stream` (a
/// raw handle; 0: the legacy default stream); `release(user)` runs when the last reference
/// drops, after the stream was fenced. If this fails, nothing was taken and `release` never
/// runs.
///
/// # Safety
/// `len` bytes of device memory at `ptr` and the stream must stay allocated, unchanged and
/// alive until `release` is called (forever when it is NULL), and `release` must be callable
/// from any thread.
pub(crate) unsafe fn lend_cuda(
    device: u32,
    stream: usize,
    ptr: u64,
    len: usize,
    release: SluiceReleaseFn,
    user: *mut c_void,
) -> Result<CudaBuffer, sluice_channel::CudaError> {
    // SAFETY: the caller's contract: a live stream of `device`; `from_raw` checks its device.
    let stream = unsafe { Stream::from_raw(device, stream) }?;
    // SAFETY: the caller's contract for `release`.
    let keep = Arc::new(unsafe { Released::new(release, user, stream.clone()) });
    // SAFETY: the caller's contract: `len` bytes of device memory kept until `release`, which
    // `keep` calls once the last reference drops; `from_raw` checks that they are device memory
    // of `device` lying inside one allocation.
    match unsafe { CudaBuffer::from_raw(ptr, len, &stream, keep.clone()) } {
        Ok(buffer) => Ok(buffer),
        Err(e) => {
            // Not taken: the callback must not run (the refused buffer dropped its clone).
            if let Ok(mut k) = Arc::try_unwrap(keep) {
                k.disarm();
            }
            Err(e)
        }
    }
}

/// The caller's allocator for received tensors bound for a GPU (`sluice_pipe_read_then_with`).
#[derive(Clone, Copy)]
pub(crate) struct DeviceAllocator {
    alloc: crate::api::SluiceDeviceAllocFn,
    release: crate::api::SluiceDeviceReleaseFn,
    user: *mut c_void,
}

// SAFETY: the C API documents that the allocator's functions are called on library threads,
// any of them, and the caller made them and `user` fit for that.
unsafe impl Send for DeviceAllocator {}
// SAFETY: as above; the fields are only copied and passed back to the caller's functions.
unsafe impl Sync for DeviceAllocator {}

/// Why a grant gave no buffer.
pub(crate) enum GrantError {
    /// The allocator returned this nonzero status (nothing was given).
    Refused(c_int),
    /// What it gave is not usable (the handle went back already).
    Unusable(sluice_channel::CudaError),
}

/// Calls the caller's `release(user, handle)` once, when dropped, after fencing its stream.
struct GrantGuard {
    allocator: DeviceAllocator,
    handle: *mut c_void,
    stream: Option<Stream>,
}

// SAFETY: never read through a shared reference; the drop calls the caller's release, which
// its contract makes callable from any thread.
unsafe impl Send for GrantGuard {}
// SAFETY: as above.
unsafe impl Sync for GrantGuard {}

impl Drop for GrantGuard {
    fn drop(&mut self) {
        if let Some(s) = &self.stream {
            s.retire();
        }
        if let Some(release) = self.allocator.release {
            // SAFETY: the allocator's contract: `release` takes each handle `alloc` gave once,
            // from any thread; drop runs once.
            unsafe { release(self.allocator.user, self.handle) }
        }
    }
}

impl DeviceAllocator {
    /// # Safety
    /// `alloc` and `release`, when not NULL, must be callable with `user` from any library
    /// thread, as `sluice_pipe_read_then_with` documents.
    pub(crate) unsafe fn new(
        alloc: crate::api::SluiceDeviceAllocFn,
        release: crate::api::SluiceDeviceReleaseFn,
        user: *mut c_void,
    ) -> DeviceAllocator {
        DeviceAllocator { alloc, release, user }
    }

    /// `len` bytes on CUDA device `device` from the caller, as a buffer ordered by the stream
    /// it named, with the caller's handle; the caller's `release` runs when the buffer's last
    /// clone drops (or at once, when what it gave is unusable).
    pub(crate) fn grant(&self, device: u32, len: usize) -> Result<(CudaBuffer, *mut c_void), GrantError> {
        let Some(alloc) = self.alloc else {
            return Err(GrantError::Refused(crate::status::SLUICE_UNSUPPORTED));
        };
        let (mut data, mut stream, mut handle) = (std::ptr::null_mut(), 0usize, std::ptr::null_mut());
        // SAFETY: `new`'s contract; the out-pointers are live locals.
        let status = unsafe { alloc(self.user, device as i32, len, &mut data, &mut stream, &mut handle) };
        if status != 0 {
            return Err(GrantError::Refused(status));
        }
        let mut guard = GrantGuard {
            allocator: *self,
            handle,
            stream: None,
        };
        // SAFETY: the allocator's contract: a live stream of `device` (or 0) kept until
        // `release(handle)`, which the guard calls after fencing it; `from_raw` checks its device.
        let wrapped = unsafe { Stream::from_raw(device, stream) }.map_err(GrantError::Unusable)?;
        guard.stream = Some(wrapped.clone());
        let keep: Arc<dyn std::any::Any + Send + Sync> = Arc::new(guard);
        // SAFETY: the allocator's contract: `len` bytes of `device`'s memory kept until
        // `release(handle)`, which `keep` calls once the last reference drops; `from_raw`
        // checks that they are device memory of `device` inside one allocation.
        let buffer = unsafe { CudaBuffer::from_raw(data as u64, len, &wrapped, keep) }.map_err(GrantError::Unusable)?;
        Ok((buffer, handle))
    }
}
