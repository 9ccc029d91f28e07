//! Pipes: writing, reading, closing.

use std::ffi::{c_char, c_int, c_void};

use super::{
    give, guard, guard_or, handle, out_handle, take, SluiceDeviceAllocFn, SluiceDeviceReleaseFn, SluiceDoneFn,
    SluiceReadFn,
};
use crate::borrowed::{DeviceAllocator, Done, ReadDone};
use crate::message::SluiceMessage;
use crate::op::{OpKind, SluiceOp};
use crate::pipe::SluicePipe;
use crate::received::SluiceReceived;
use crate::runtime;
use crate::status::{set_last_error, Error, SLUICE_OK};

/// Hands a read's outcome to the caller's callback: the message (the callee owns it from
/// there) or the error's status, with the last error set for the callback to read.
fn deliver(done: ReadDone) -> impl FnOnce(crate::status::Result<SluiceReceived>) + Send + 'static {
    move |result| match result {
        Ok(received) => {
            set_last_error("");
            done.call(SLUICE_OK, Box::into_raw(Box::new(received)))
        }
        Err(e) => {
            set_last_error(&format!("sluice_pipe_read: {}", e.message));
            done.call(e.code, std::ptr::null_mut());
        }
    }
}

/// Takes the message a write consumes, whatever else goes wrong.
///
/// # Safety
/// `message` is NULL or a live message handle the caller gives up.
unsafe fn consume(message: *mut SluiceMessage) -> crate::status::Result<SluiceMessage> {
    // SAFETY: forwarded contract.
    unsafe { take(message) }
        .map(|m| *m)
        .ok_or_else(|| Error::invalid("message is NULL"))
}

/// Starts writing `message` and returns at once; `done(status, user)` is called once, on a
/// library thread, when the write has finished: `SLUICE_OK` once every buffer of the message
/// may be reused (for a tensor read in place by a peer on this host, after the peer has read
/// it), or the error, whose message `sluice_last_error()` returns inside `done`. `done` may be
/// NULL: then nobody hears of the write's end (a failed write fails the pipe, so later reads
/// and writes on it fail), and a write that finishes at once costs no library thread a wake-up.
/// Tensors' `release` callbacks may run before or after `done`.
///
/// The message is consumed (also on error, whenever it is not NULL). If this function returns
/// an error, `done` is not called. Writes a thread starts on a pipe leave in that order.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_write(
    pipe: *mut SluicePipe,
    message: *mut SluiceMessage,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_pipe_write", || {
        // SAFETY: the caller gives up a message handle (or NULL).
        let message = unsafe { consume(message) }?;
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        // SAFETY: the caller's callback, documented to run once on a library thread.
        let done = unsafe { Done::new(done, user) };
        if done.is_none() {
            pipe.write_detached(message)?;
            return Ok(SLUICE_OK);
        }
        pipe.write_then(message, move |result| match result {
            Ok(()) => {
                // Inside the callback the last error is its status's: none (this library
                // thread may have run a failed callback before).
                set_last_error("");
                done.call(SLUICE_OK)
            }
            Err(e) => {
                set_last_error(&format!("sluice_pipe_write: {}", e.message));
                done.call(e.code);
            }
        })?;
        Ok(SLUICE_OK)
    })
}

/// Starts writing `message` and returns at once with an op handle in `*out` (NULL on error):
/// test it, wait on it, or poll its eventfd (`sluice_op_test`, `sluice_op_wait`,
/// `sluice_op_fd`), then free it with `sluice_op_free`. The message is consumed (also on
/// error, whenever it is not NULL).
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_write_start(
    pipe: *mut SluicePipe,
    message: *mut SluiceMessage,
    out: *mut *mut SluiceOp,
) -> c_int {
    guard("sluice_pipe_write_start", || {
        // SAFETY: the caller gives up a message handle (or NULL).
        let message = unsafe { consume(message) }?;
        // SAFETY: the caller passes a writable `sluice_op*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        let (op, completer) = SluiceOp::new(OpKind::Write);
        pipe.write_then(message, move |result| {
            completer.complete(result.map(|()| None).map_err(|e| e.context("sluice_pipe_write")))
        })?;
        give(out, op);
        Ok(SLUICE_OK)
    })
}

/// Writes `message` and waits until the write has finished (see `sluice_pipe_write`). The
/// message is consumed (also on error, whenever it is not NULL). Must not be called from a
/// completion callback (`SLUICE_MISUSE`).
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_write_sync(pipe: *mut SluicePipe, message: *mut SluiceMessage) -> c_int {
    guard("sluice_pipe_write_sync", || {
        // SAFETY: the caller gives up a message handle (or NULL).
        let message = unsafe { consume(message) }?;
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        pipe.write_sync(message)?;
        Ok(SLUICE_OK)
    })
}

/// Receives the next message (blocking): its descriptor, then its data into fresh CPU memory.
/// On success `*out` is the message (read it with the `sluice_received_*` functions, free it
/// with `sluice_received_free`); on error it is NULL. When the peer closes the pipe this is
/// `SLUICE_PEER_LOST` (or `SLUICE_CLOSED` after this side closed it). A message with a tensor
/// sent for a GPU cannot be received here: `SLUICE_UNSUPPORTED`, and the pipe is closed. Must
/// not be called from a completion callback (`SLUICE_MISUSE`).
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_read(pipe: *mut SluicePipe, out: *mut *mut SluiceReceived) -> c_int {
    guard("sluice_pipe_read", || {
        // SAFETY: the caller passes a writable `sluice_received*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        give(out, pipe.read_sync()?);
        Ok(SLUICE_OK)
    })
}

/// Starts receiving the next message and returns at once; `done(status, received, user)` is
/// called once, on a library thread, when it has arrived (`SLUICE_OK` and the message, which the
/// callback owns) or the read failed (the error, `received` NULL). The callback may start the
/// next read, so a reader needs no thread of its own. If this function returns an error, `done`
/// is not called. Reads a thread starts on a pipe take messages in that order.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_read_then(pipe: *mut SluicePipe, done: SluiceReadFn, user: *mut c_void) -> c_int {
    guard("sluice_pipe_read_then", || {
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        // SAFETY: the caller's callback, documented to run once on a library thread.
        let done = unsafe { ReadDone::new(done, user) };
        pipe.read_then(None, deliver(done))?;
        Ok(SLUICE_OK)
    })
}

/// `sluice_pipe_read_then`, for messages that may carry tensors bound for this process's GPUs:
/// each such tensor goes into device memory `alloc(alloc_user, device, len, ...)` gives (see
/// `sluice_device_alloc_fn`; called during the read, one tensor at a time, in order;
/// `alloc_user` must outlive every message received this way), and the
/// incoming copy is queued on the stream it names. The received message then describes the
/// tensor as `kDLCUDA` memory (`sluice_received_tensor`), and
/// `sluice_received_tensor_device` gives the stream and the caller's handle. Each handle goes
/// back through `release(alloc_user, handle)` once the library holds no reference to its
/// memory (when the received message is freed, or when the read fails). Tensors bound for the
/// CPU arrive as with `sluice_pipe_read_then`. If this function returns an error, neither
/// `done` nor the allocator is called.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_read_then_with(
    pipe: *mut SluicePipe,
    alloc: SluiceDeviceAllocFn,
    release: SluiceDeviceReleaseFn,
    alloc_user: *mut c_void,
    done: SluiceReadFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_pipe_read_then_with", || {
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        if alloc.is_none() {
            return Err(Error::invalid("alloc is NULL"));
        }
        // SAFETY: the caller's allocator, documented to be called on library threads.
        let devices = unsafe { DeviceAllocator::new(alloc, release, alloc_user) };
        // SAFETY: the caller's callback, documented to run once on a library thread.
        let done = unsafe { ReadDone::new(done, user) };
        pipe.read_then(Some(devices), deliver(done))?;
        Ok(SLUICE_OK)
    })
}

/// Starts receiving the next message and returns at once with an op handle in `*out` (NULL on
/// error). Once the op has finished, `sluice_op_take_received` hands out the message. Reads a
/// thread starts on a pipe take messages in that order.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_read_start(pipe: *mut SluicePipe, out: *mut *mut SluiceOp) -> c_int {
    guard("sluice_pipe_read_start", || {
        // SAFETY: the caller passes a writable `sluice_op*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        let (op, completer) = SluiceOp::new(OpKind::Read);
        pipe.read_then(None, move |result| {
            completer.complete(result.map(Some).map_err(|e| e.context("sluice_pipe_read")))
        })?;
        give(out, op);
        Ok(SLUICE_OK)
    })
}

/// Closes the pipe: pending and later operations on it fail with `SLUICE_CLOSED`, and the
/// peer sees the pipe end. The handle stays valid until `sluice_pipe_free`.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_close(pipe: *mut SluicePipe) -> c_int {
    guard("sluice_pipe_close", || {
        // SAFETY: the caller passes a live pipe or NULL.
        let pipe = unsafe { handle(pipe, "pipe") }?;
        let _entered = runtime::enter()?;
        pipe.close();
        Ok(SLUICE_OK)
    })
}

/// Closes (see `sluice_pipe_close`) and frees the pipe (NULL: nothing). Operations still
/// running finish with `SLUICE_CLOSED`; their ops and callbacks stay valid.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_free(pipe: *mut SluicePipe) {
    guard("sluice_pipe_free", || {
        let _entered = runtime::enter()?;
        // SAFETY: the caller gives up a pipe handle (or NULL).
        drop(unsafe { take(pipe) });
        Ok(SLUICE_OK)
    });
}

/// The peer's name as errors name it (the address connected to, or the peer's process name
/// on the accepting side). Valid as long as the pipe; NULL if `pipe` is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_peer(pipe: *const SluicePipe) -> *const c_char {
    guard_or(
        "sluice_pipe_peer",
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller passes a live pipe or NULL.
            Ok(unsafe { handle(pipe, "pipe") }?.peer().as_ptr())
        },
    )
}

/// The transport negotiated for the pipe (`shm`, `tcp`, `ibv`). Valid as long as the pipe;
/// NULL if `pipe` is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_transport(pipe: *const SluicePipe) -> *const c_char {
    guard_or(
        "sluice_pipe_transport",
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller passes a live pipe or NULL.
            Ok(unsafe { handle(pipe, "pipe") }?.transport().as_ptr())
        },
    )
}

/// The channel negotiated for CPU tensors (`cma`, `basic`, `multilane`, `rdma`). Valid as long
/// as the pipe; NULL if `pipe` is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_pipe_channel(pipe: *const SluicePipe) -> *const c_char {
    guard_or(
        "sluice_pipe_channel",
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller passes a live pipe or NULL.
            Ok(unsafe { handle(pipe, "pipe") }?.cpu_channel().as_ptr())
        },
    )
}
