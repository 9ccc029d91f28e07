//! Errors: the last error message and status names.

use std::ffi::{c_char, c_int};

use super::guard_or;
use crate::status::{last_error_ptr, status_name};

/// The message of the last error on the calling thread, naming the peer where there is one
/// (an empty string when there has been none). Valid until the next call into the library
/// on this thread. Inside a `sluice_done_fn` callback: the message of the callback's status.
#[no_mangle]
pub extern "C" fn sluice_last_error() -> *const c_char {
    guard_or("sluice_last_error", |_| c"".as_ptr(), || Ok(last_error_ptr()))
}

/// The name of a status code (`"SLUICE_OK"`, `"SLUICE_CLOSED"`, ...): a static string.
#[no_mangle]
pub extern "C" fn sluice_status_name(status: c_int) -> *const c_char {
    guard_or(
        "sluice_status_name",
        |_| c"".as_ptr(),
        || Ok(status_name(status).as_ptr()),
    )
}
