//! A pending operation (`sluice_op`): a write or a read started on a pipe, finished once by
//! its [`Completer`] on a library thread. The caller tests it, waits on it (with a timeout),
//! or polls an eventfd that becomes readable once it has finished, and takes a read's message.
//!
//! Freeing an op does not cancel it: the operation runs to its end and its result is dropped.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::received::SluiceReceived;
use crate::status::{Error, Result, SLUICE_OK, SLUICE_PANIC, SLUICE_PENDING};

/// What an operation produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Write,
    Read,
}

/// A started write or read (`sluice_pipe_write_start`, `sluice_pipe_read_start`): test it,
/// wait on it or poll its eventfd.
pub struct SluiceOp {
    kind: OpKind,
    state: Arc<State>,
}

struct State {
    slot: Mutex<Slot>,
    finished: Condvar,
}

#[derive(Default)]
struct Slot {
    /// `None` while pending.
    status: Option<Result<()>>,
    /// A read's message until taken.
    received: Option<Box<SluiceReceived>>,
    taken: bool,
    /// Made on first request; written once the op has finished.
    fd: Option<EventFd>,
}

/// Finishes an op, exactly once (dropping it unfinished finishes it with `SLUICE_PANIC`).
pub struct Completer {
    state: Option<Arc<State>>,
}

impl SluiceOp {
    pub fn new(kind: OpKind) -> (SluiceOp, Completer) {
        let state = Arc::new(State {
            slot: Mutex::new(Slot::default()),
            finished: Condvar::new(),
        });
        (
            SluiceOp {
                kind,
                state: state.clone(),
            },
            Completer { state: Some(state) },
        )
    }

    pub fn kind(&self) -> OpKind {
        self.kind
    }

    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.state.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `SLUICE_PENDING`, `SLUICE_OK`, or the op's error. Never waits.
    pub fn test(&self) -> Result<c_int> {
        outcome(&self.slot())
    }

    /// Waits until the op has finished, or `timeout` (forever when `None`) has passed: then
    /// `SLUICE_PENDING`.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<c_int> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut slot = self.slot();
        while slot.status.is_none() {
            slot = match deadline {
                None => self.state.finished.wait(slot).unwrap_or_else(|p| p.into_inner()),
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    let (slot, _) = self
                        .state
                        .finished
                        .wait_timeout(slot, left)
                        .unwrap_or_else(|p| p.into_inner());
                    slot
                }
            };
        }
        outcome(&slot)
    }

    /// An eventfd that becomes readable once the op has finished (and stays so). Owned by the
    /// op: valid until it is freed.
    pub fn fd(&self) -> Result<RawFd> {
        let mut slot = self.slot();
        if slot.fd.is_none() {
            let fd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| Error::new(crate::status::SLUICE_IO, format!("eventfd: {e}")))?;
            if slot.status.is_some() {
                signal(&fd);
            }
            slot.fd = Some(fd);
        }
        Ok(slot.fd.as_ref().map_or(-1, |fd| fd.as_raw_fd()))
    }

    /// A finished read's message (once). `SLUICE_PENDING` as an error while the read runs.
    pub fn take_received(&self) -> Result<Box<SluiceReceived>> {
        if self.kind != OpKind::Read {
            return Err(Error::misuse("this op is a write: it has no received message"));
        }
        let mut slot = self.slot();
        match outcome(&slot)? {
            SLUICE_PENDING => Err(Error::new(SLUICE_PENDING, "the read has not finished")),
            _ if slot.taken => Err(Error::misuse("the received message was already taken")),
            _ => {
                slot.taken = true;
                slot.received
                    .take()
                    .ok_or_else(|| Error::misuse("the read finished without a message"))
            }
        }
    }
}

fn outcome(slot: &Slot) -> Result<c_int> {
    match &slot.status {
        None => Ok(SLUICE_PENDING),
        Some(Ok(())) => Ok(SLUICE_OK),
        Some(Err(e)) => Err(e.clone()),
    }
}

fn signal(fd: &EventFd) {
    // Cannot fail: the counter is written once, far below its limit.
    let _ = fd.write(1);
}

impl Completer {
    /// Finishes the op with `result` (a read's message, or nothing for a write).
    pub fn complete(mut self, result: Result<Option<SluiceReceived>>) {
        self.finish(result);
    }

    fn finish(&mut self, result: Result<Option<SluiceReceived>>) {
        let Some(state) = self.state.take() else { return };
        let mut slot = state.slot.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(received) => {
                slot.received = received.map(Box::new);
                slot.status = Some(Ok(()));
            }
            Err(e) => slot.status = Some(Err(e)),
        }
        if let Some(fd) = &slot.fd {
            signal(fd);
        }
        drop(slot);
        state.finished.notify_all();
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        self.finish(Err(Error::new(SLUICE_PANIC, "the operation ended without a result")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_then_finished_with_the_fd_signalled() {
        let (op, done) = SluiceOp::new(OpKind::Write);
        assert_eq!(op.test(), Ok(SLUICE_PENDING));
        assert_eq!(op.wait(Some(Duration::from_millis(1))), Ok(SLUICE_PENDING));
        let fd = op.fd().unwrap();
        assert_eq!(op.fd().unwrap(), fd, "one eventfd per op");
        let t = std::thread::spawn(move || done.complete(Ok(None)));
        assert_eq!(op.wait(None), Ok(SLUICE_OK));
        t.join().unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(nix::unistd::read(fd, &mut buf), Ok(8));
        assert!(op.take_received().is_err(), "a write has no message");
    }

    #[test]
    fn errors_repeat_and_a_dropped_completer_is_a_panic_status() {
        let (op, done) = SluiceOp::new(OpKind::Read);
        done.complete(Err(Error::new(crate::status::SLUICE_CLOSED, "closed")));
        assert_eq!(op.test().unwrap_err().code, crate::status::SLUICE_CLOSED);
        assert_eq!(op.wait(None).unwrap_err().code, crate::status::SLUICE_CLOSED);
        let (op, done) = SluiceOp::new(OpKind::Read);
        drop(done);
        assert_eq!(op.test().unwrap_err().code, SLUICE_PANIC);
        // The fd of an op that finished before it was asked for is readable at once.
        let fd = op.fd().unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(nix::unistd::read(fd, &mut buf), Ok(8));
    }
}
