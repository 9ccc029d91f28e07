//! The `extern "C"` functions. Each one runs inside [`guard`] (a panic becomes `SLUICE_PANIC`,
//! an error sets this thread's last error) and only converts its arguments (through the
//! helpers below) before calling the safe handles of the crate.
//!
//! Safety contract of every function here (stated once rather than on each; the header's
//! documentation says it to C callers): every pointer argument is NULL (refused with
//! `SLUICE_INVALID_ARGUMENT` unless documented as optional) or valid for what its type says;
//! handles are ones this library returned and that have not been freed; strings are
//! NUL-terminated; `(pointer, length)` pairs name readable memory.
#![allow(unsafe_code)]
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::AssertUnwindSafe;

use crate::runtime::panic_message;
use crate::status::{set_last_error, Error, Result, SLUICE_PANIC};

mod context;
mod group;
mod message;
mod op;
mod pipe;
mod received;
mod status;

pub use context::*;
pub use group::*;
pub use message::*;
pub use op::*;
pub use pipe::*;
pub use received::*;
pub use status::*;

/// Called when a write started with `sluice_pipe_write` has finished: `status` is `SLUICE_OK`
/// or the error (its message is `sluice_last_error()` inside the callback). Runs on a library
/// thread; it must not block, and must not call the blocking functions (they return
/// `SLUICE_MISUSE` there).
pub type SluiceDoneFn = Option<unsafe extern "C" fn(status: c_int, user: *mut c_void)>;

/// Called once when a read started with `sluice_pipe_read_then` has finished, on a library
/// thread: `status` is `SLUICE_OK` and `received` the message (the callee owns it: free it with
/// `sluice_received_free`), or the error with `received` NULL (its message is
/// `sluice_last_error()` inside the callback). It must not block, and must not call the blocking
/// functions (they return `SLUICE_MISUSE` there); it may start the next read.
pub type SluiceReadFn =
    Option<unsafe extern "C" fn(status: c_int, received: *mut crate::received::SluiceReceived, user: *mut c_void)>;

/// Called once, from any thread, when the library no longer needs memory a message borrowed
/// (`sluice_message_add_tensor`).
pub type SluiceReleaseFn = Option<unsafe extern "C" fn(user: *mut c_void)>;

/// Gives device memory for one received tensor bound for a GPU (`sluice_pipe_read_then_with`):
/// `len` bytes on CUDA device `device` (an index in this process), in `*data`, and in `*stream`
/// a stream of that device (`cudaStream_t` as an integer; 0: the legacy default stream) that
/// the incoming copy is queued on: work queued on it after the read completes sees the data.
/// Work already queued on that stream is finished before the copy writes. `*handle` is the
/// caller's own token for this memory, handed back to `release` and readable with
/// `sluice_received_tensor_device`. Returns 0, or a nonzero status to refuse (the read then
/// fails with `SLUICE_UNSUPPORTED` and the pipe is closed: the message cannot be skipped;
/// memory that is not device memory of `device`, or a stream of another device, fails it with
/// `SLUICE_INVALID_ARGUMENT`). Called on a library thread, during the read; it must not block
/// on the pipe.
pub type SluiceDeviceAllocFn = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        device: i32,
        len: usize,
        data: *mut *mut c_void,
        stream: *mut usize,
        handle: *mut *mut c_void,
    ) -> c_int,
>;

/// Gives back memory a `sluice_device_alloc_fn` gave (`handle`), once, from any thread, when
/// the library holds no more references to it: when the received message is freed, or when
/// the read failed after allocating. The copy into it may still be queued on its stream then:
/// free it in that stream's order (as a caching allocator does), or synchronize it first. The
/// stream must stay alive until this call.
pub type SluiceDeviceReleaseFn = Option<unsafe extern "C" fn(user: *mut c_void, handle: *mut c_void)>;

/// Runs the body of entry point `name`: its status, or its error's code with the message
/// recorded as this thread's last error; a panic is `SLUICE_PANIC`.
fn guard(name: &str, body: impl FnOnce() -> Result<c_int>) -> c_int {
    guard_or(name, |e| e.code, body)
}

/// [`guard`] for functions that return a value: `fallback(error)` on failure.
fn guard_or<T>(name: &str, fallback: impl FnOnce(&Error) -> T, body: impl FnOnce() -> Result<T>) -> T {
    let result = std::panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        Err(Error::new(
            SLUICE_PANIC,
            format!("internal panic: {}", panic_message(&*panic)),
        ))
    });
    match result {
        Ok(v) => v,
        Err(e) => {
            set_last_error(&format!("{name}: {}", e.message));
            fallback(&e)
        }
    }
}

/// A handle argument.
///
/// # Safety
/// `p` is NULL or a live handle of this type.
unsafe fn handle<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    // SAFETY: per the contract, a non-NULL `p` is a live `T` that outlives the call.
    unsafe { p.as_ref() }.ok_or_else(|| Error::invalid(format!("{what} is NULL")))
}

/// A handle argument the call may modify.
///
/// # Safety
/// `p` is NULL or a live handle of this type, not used by another thread during the call.
unsafe fn handle_mut<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T> {
    // SAFETY: per the contract, a non-NULL `p` is a live `T` nobody else uses meanwhile.
    unsafe { p.as_mut() }.ok_or_else(|| Error::invalid(format!("{what} is NULL")))
}

/// Takes back a handle the library gave out (NULL: `None`).
///
/// # Safety
/// `p` is NULL or a live handle of this type, made by `Box::into_raw`, not used afterwards.
unsafe fn take<T>(p: *mut T) -> Option<Box<T>> {
    if p.is_null() {
        None
    } else {
        // SAFETY: per the contract, `p` came from `Box::into_raw` and is given up here.
        Some(unsafe { Box::from_raw(p) })
    }
}

/// An optional string argument (NULL: `None`).
///
/// # Safety
/// `p` is NULL or a NUL-terminated string readable during the call.
unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: per the contract, a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| Error::invalid(format!("{what} is not UTF-8")))
}

/// A `(pointer, length)` argument; NULL is allowed with length 0.
///
/// # Safety
/// `p` is NULL or points at `len` bytes readable during the call.
unsafe fn bytes<'a>(p: *const u8, len: usize, what: &str) -> Result<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::invalid(format!("{what} is NULL with length {len}")));
    }
    // SAFETY: per the contract, `len` readable bytes at `p`.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// An output argument: a place for one value.
struct Out<'a, T>(&'a mut T);

impl<T> Out<'_, T> {
    fn set(self, value: T) {
        *self.0 = value;
    }
}

/// An output argument, set to `empty` at once so that it holds something defined on error.
///
/// # Safety
/// `p` is NULL or valid for writing a `T`, and not read by anyone else during the call.
unsafe fn out<'a, T>(p: *mut T, what: &str, empty: T) -> Result<Out<'a, T>> {
    // SAFETY: per the contract, writable (and `T`'s are plain C values: pointers, sizes).
    let place = unsafe { p.as_mut() }.ok_or_else(|| Error::invalid(format!("{what} is NULL")))?;
    *place = empty;
    Ok(Out(place))
}

/// A handle out-argument (`T**`), set to NULL at once.
///
/// # Safety
/// As [`out`].
unsafe fn out_handle<'a, T>(p: *mut *mut T, what: &str) -> Result<Out<'a, *mut T>> {
    // SAFETY: forwarded contract.
    unsafe { out(p, what, std::ptr::null_mut()) }
}

/// Hands a new handle out to C.
fn give<T>(out: Out<'_, *mut T>, value: T) {
    out.set(Box::into_raw(Box::new(value)));
}
