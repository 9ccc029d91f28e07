//! Status codes, the error every entry point returns, and the thread-local last-error message.

use std::cell::RefCell;
use std::ffi::{c_int, CString};

use sluice_channel::PipeError;
use sluice_dlpack::MetaError;
use sluice_transport::TransportError;

/// Success.
pub const SLUICE_OK: c_int = 0;
/// The operation has not finished yet (`sluice_op_test`, `sluice_op_wait` when its timeout
/// passes). Not an error: ask again later.
pub const SLUICE_PENDING: c_int = 1;
/// A NULL pointer, an index out of range, a string that is not UTF-8, an unknown transport
/// or channel name, or a tensor description that does not hold together.
pub const SLUICE_INVALID_ARGUMENT: c_int = 2;
/// The API was used out of order: a blocking call from a completion callback, the received
/// message of an op taken twice or taken from a write op.
pub const SLUICE_MISUSE: c_int = 3;
/// The pipe (or listener) was closed on this side.
pub const SLUICE_CLOSED: c_int = 4;
/// The peer went away: it closed the pipe, its process died, or the connection reset.
pub const SLUICE_PEER_LOST: c_int = 5;
/// The peer sent something bad: bytes that do not parse, a protocol violation, a tensor
/// description that does not match its data, or it refused the pipe.
pub const SLUICE_PEER: c_int = 6;
/// Pipe setup did not finish in time.
pub const SLUICE_TIMEOUT: c_int = 7;
/// A system call failed (for example, connection refused).
pub const SLUICE_IO: c_int = 8;
/// Something this build or this host cannot do: a tensor that is not on the CPU, a dtype
/// DLPack has but Sluice does not carry, no transport or channel shared with the peer.
pub const SLUICE_UNSUPPORTED: c_int = 9;
/// A bug in Sluice: a panic was caught at the C boundary. The message says where.
pub const SLUICE_PANIC: c_int = 10;

/// The name of a status code (`"SLUICE_OK"`, ...), or `"unknown status"`.
pub(crate) fn status_name(code: c_int) -> &'static std::ffi::CStr {
    match code {
        SLUICE_OK => c"SLUICE_OK",
        SLUICE_PENDING => c"SLUICE_PENDING",
        SLUICE_INVALID_ARGUMENT => c"SLUICE_INVALID_ARGUMENT",
        SLUICE_MISUSE => c"SLUICE_MISUSE",
        SLUICE_CLOSED => c"SLUICE_CLOSED",
        SLUICE_PEER_LOST => c"SLUICE_PEER_LOST",
        SLUICE_PEER => c"SLUICE_PEER",
        SLUICE_TIMEOUT => c"SLUICE_TIMEOUT",
        SLUICE_IO => c"SLUICE_IO",
        SLUICE_UNSUPPORTED => c"SLUICE_UNSUPPORTED",
        SLUICE_PANIC => c"SLUICE_PANIC",
        _ => c"unknown status",
    }
}

/// Why a call failed: a status code and a message for `sluice_last_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub code: c_int,
    pub message: String,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(code: c_int, message: impl Into<String>) -> Error {
        Error {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(SLUICE_INVALID_ARGUMENT, message)
    }

    pub fn misuse(message: impl Into<String>) -> Error {
        Error::new(SLUICE_MISUSE, message)
    }

    pub fn unsupported(message: impl Into<String>) -> Error {
        Error::new(SLUICE_UNSUPPORTED, message)
    }

    /// The message with `context` in front (`"context: message"`).
    pub fn context(self, context: &str) -> Error {
        Error {
            code: self.code,
            message: format!("{context}: {}", self.message),
        }
    }
}

impl From<PipeError> for Error {
    fn from(e: PipeError) -> Error {
        let code = match &e {
            PipeError::Closed { .. } => SLUICE_CLOSED,
            PipeError::Timeout { .. } => SLUICE_TIMEOUT,
            PipeError::Protocol { .. } | PipeError::VersionMismatch { .. } | PipeError::Rejected { .. } => SLUICE_PEER,
            PipeError::Negotiation { .. } => SLUICE_UNSUPPORTED,
            PipeError::Misuse(_) | PipeError::Config(_) => SLUICE_INVALID_ARGUMENT,
            PipeError::Transport(t) => transport_code(t),
            _ => SLUICE_IO,
        };
        Error::new(code, e.to_string())
    }
}

impl From<sluice_channel::CudaError> for Error {
    fn from(e: sluice_channel::CudaError) -> Error {
        let code = match &e {
            sluice_channel::CudaError::Unavailable(_) => SLUICE_UNSUPPORTED,
            sluice_channel::CudaError::Invalid(_) => SLUICE_INVALID_ARGUMENT,
            _ => SLUICE_IO,
        };
        Error::new(code, format!("CUDA: {e}"))
    }
}

fn transport_code(e: &TransportError) -> c_int {
    match e {
        TransportError::Closed { .. } => SLUICE_CLOSED,
        TransportError::PeerLost { .. } => SLUICE_PEER_LOST,
        TransportError::FrameTooLarge { .. } | TransportError::Auth { .. } | TransportError::Handshake { .. } => {
            SLUICE_PEER
        }
        TransportError::BadAddress { .. } => SLUICE_INVALID_ARGUMENT,
        TransportError::NotViable { .. } => SLUICE_UNSUPPORTED,
        _ => SLUICE_IO,
    }
}

/// A tensor description that does not hold together, from the caller (`received` false) or
/// from the peer (`received` true, always [`SLUICE_PEER`]).
pub fn meta_error(e: &MetaError, received: bool) -> Error {
    let code = if received {
        SLUICE_PEER
    } else {
        match e {
            MetaError::DType { .. } => SLUICE_UNSUPPORTED,
            MetaError::Negative { size, .. } if *size >= 0 => SLUICE_UNSUPPORTED,
            _ => SLUICE_INVALID_ARGUMENT,
        }
    };
    let what = if received {
        "the peer sent a bad tensor description"
    } else {
        "bad tensor"
    };
    let hint = match e {
        MetaError::Negative { size, .. } if *size >= 0 && !received => " (negative strides are not supported)",
        _ => "",
    };
    Error::new(code, format!("{what}: {e}{hint}"))
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error (interior NULs become spaces).
pub(crate) fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// This thread's last error message: valid until the next call into the library on this thread.
pub(crate) fn last_error_ptr() -> *const std::ffi::c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}
