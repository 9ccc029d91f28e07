//! Pending operations.

use std::ffi::c_int;
use std::time::Duration;

use super::{guard, guard_or, handle, out_handle, take};
use crate::op::SluiceOp;
use crate::received::SluiceReceived;
use crate::status::{Error, SLUICE_OK};

/// Whether the op has finished, without waiting: `SLUICE_PENDING`, `SLUICE_OK`, or the op's
/// error (its message in `sluice_last_error()`). Asking again gives the same answer.
#[no_mangle]
pub unsafe extern "C" fn sluice_op_test(op: *const SluiceOp) -> c_int {
    guard("sluice_op_test", || {
        // SAFETY: the caller passes a live op or NULL.
        unsafe { handle(op, "op") }?.test()
    })
}

/// Waits until the op has finished, at most `timeout_ms` milliseconds (negative: no limit;
/// 0: do not wait). Returns as `sluice_op_test` does: `SLUICE_PENDING` if the time passed
/// first. Waiting from a completion callback is `SLUICE_MISUSE`.
#[no_mangle]
pub unsafe extern "C" fn sluice_op_wait(op: *const SluiceOp, timeout_ms: i64) -> c_int {
    guard("sluice_op_wait", || {
        // SAFETY: the caller passes a live op or NULL.
        let op = unsafe { handle(op, "op") }?;
        if timeout_ms != 0 && tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::misuse("waiting on an op from a completion callback"));
        }
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        op.wait(timeout)
    })
}

/// An eventfd that becomes readable once the op has finished, and stays readable: add it to
/// an epoll or poll set, then call `sluice_op_test`. Reading it is allowed but not needed. The
/// descriptor belongs to the op (do not close it); it is valid until `sluice_op_free`.
/// Returns -1 on error (`sluice_last_error()` says why).
#[no_mangle]
pub unsafe extern "C" fn sluice_op_fd(op: *const SluiceOp) -> c_int {
    guard_or(
        "sluice_op_fd",
        |_| -1,
        || {
            // SAFETY: the caller passes a live op or NULL.
            unsafe { handle(op, "op") }?.fd()
        },
    )
}

/// Takes the message a finished read op received: `*out` is the message (free it with
/// `sluice_received_free`) or NULL. Returns `SLUICE_PENDING` while the read runs, the read's
/// error if it failed, and `SLUICE_MISUSE` for a write op or a message already taken.
#[no_mangle]
pub unsafe extern "C" fn sluice_op_take_received(op: *const SluiceOp, out: *mut *mut SluiceReceived) -> c_int {
    guard("sluice_op_take_received", || {
        // SAFETY: the caller passes a writable `sluice_received*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live op or NULL.
        let op = unsafe { handle(op, "op") }?;
        let received = op.take_received()?;
        out.set(Box::into_raw(received));
        Ok(SLUICE_OK)
    })
}

/// Frees an op (NULL: nothing) and closes its eventfd. Freeing an op that has not finished does
/// not cancel the operation: it runs to its end and its result (a read's message too) is
/// dropped.
#[no_mangle]
pub unsafe extern "C" fn sluice_op_free(op: *mut SluiceOp) {
    guard("sluice_op_free", || {
        // SAFETY: the caller gives up an op handle (or NULL).
        drop(unsafe { take(op) });
        Ok(SLUICE_OK)
    });
}
