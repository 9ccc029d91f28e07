//! The first error of a connection, shared by its two halves, and the guard that stops a
//! connection whose operation was cancelled part-way through a frame.
//!
//! Errors are sticky: once a connection failed (or was closed), every later operation on either
//! half fails with that same first error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::error::TransportError;

#[derive(Default)]
pub(crate) struct Stopped {
    stopped: AtomicBool,
    first: OnceLock<TransportError>,
}

impl Stopped {
    /// Records `error` unless an earlier one is recorded; returns true the first time.
    pub(crate) fn stop(&self, error: TransportError) -> bool {
        let first = self.first.set(error).is_ok();
        self.stopped.store(true, Ordering::Release);
        first
    }

    #[inline]
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// The first error, once the connection has stopped.
    pub(crate) fn error(&self) -> Option<TransportError> {
        if self.is_stopped() {
            self.first.get().cloned()
        } else {
            None
        }
    }

    #[inline]
    pub(crate) fn check(&self) -> Result<(), TransportError> {
        if !self.is_stopped() {
            return Ok(());
        }
        match self.error() {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// Armed for the duration of one read or write. Dropped without [`finish`](Self::finish) (the
/// future was cancelled, or the operation failed), it runs `on_abort`, which records an error
/// and closes the connection so both ends learn promptly that the stream is no longer aligned
/// on frame boundaries.
pub(crate) struct OpGuard<F: FnMut()> {
    on_abort: Option<F>,
}

impl<F: FnMut()> OpGuard<F> {
    pub(crate) fn new(on_abort: F) -> Self {
        OpGuard {
            on_abort: Some(on_abort),
        }
    }

    pub(crate) fn finish(mut self) {
        self.on_abort = None;
    }
}

impl<F: FnMut()> Drop for OpGuard<F> {
    fn drop(&mut self) {
        if let Some(mut f) = self.on_abort.take() {
            f();
        }
    }
}
