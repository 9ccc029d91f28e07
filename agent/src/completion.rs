//! One-shot results that can be awaited (as a future) or waited for (blocking a thread), any
//! number of times: every waiter gets a clone of the result.
//!
//! Blocking waits spin briefly before sleeping: on this machine kind a futex wake-up across
//! cores costs tens of microseconds, more than a fast round trip. A pool thread that blocks
//! hands its slot to a new thread first (see [`crate::pool`]), so nested calls cannot starve
//! the pool.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

// The slot's synchronization, swapped for loom's models under `--cfg sluice_loom` (the
// `loom` tests below explore every interleaving of completing, waiting and polling).
#[cfg(sluice_loom)]
use loom::sync::{atomic::AtomicBool, Condvar, Mutex};
#[cfg(not(sluice_loom))]
use std::sync::{atomic::AtomicBool, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::RpcError;
use crate::payload::Payload;

/// The result of a call, awaitable or waitable any number of times.
pub type RpcFuture = Completion<Result<Payload, RpcError>>;

/// How long a blocking wait spins before it sleeps (not at all under the model checker, where
/// every spin would be a branch to explore).
#[cfg(not(sluice_loom))]
const SPIN: Duration = Duration::from_micros(30);
#[cfg(sluice_loom)]
const SPIN: Duration = Duration::ZERO;

struct State<T> {
    value: Option<T>,
    /// Usually one or two (a waiting thread, and the runtime it reads replies on): kept
    /// inline, no allocation per call.
    wakers: smallvec::SmallVec<[Waker; 2]>,
    /// Threads asleep on `ready` (a notify with none costs a system call for nothing).
    sleepers: usize,
}

/// The shared cell behind a [`Completion`].
pub(crate) struct Slot<T> {
    done: AtomicBool,
    state: Mutex<State<T>>,
    ready: Condvar,
}

impl<T: Clone> Slot<T> {
    pub(crate) fn new() -> Arc<Slot<T>> {
        Arc::new(Slot {
            done: AtomicBool::new(false),
            state: Mutex::new(State {
                value: None,
                wakers: smallvec::SmallVec::new(),
                sleepers: 0,
            }),
            ready: Condvar::new(),
        })
    }

    /// Sets the result. Only the first call has an effect; returns whether it was this one.
    pub(crate) fn complete(&self, value: T) -> bool {
        let (wakers, sleepers) = {
            let mut s = self.state.lock().unwrap();
            if s.value.is_some() {
                return false;
            }
            s.value = Some(value);
            self.done.store(true, Ordering::Release);
            (std::mem::take(&mut s.wakers), s.sleepers)
        };
        if sleepers > 0 {
            self.ready.notify_all();
        }
        for w in wakers {
            w.wake();
        }
        true
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    pub(crate) fn peek(&self) -> Option<T> {
        if !self.is_done() {
            return None;
        }
        self.state.lock().unwrap().value.clone()
    }

    /// Blocks this thread until the result is set or `timeout` passes.
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> Option<T> {
        // Usually done by now (its waiter read the reply itself): no clock read then.
        if self.is_done() {
            return self.peek();
        }
        let start = Instant::now();
        while start.elapsed() < SPIN {
            if self.is_done() {
                return self.peek();
            }
            std::hint::spin_loop();
        }
        crate::pool::blocking(|| {
            let mut s = self.state.lock().unwrap();
            loop {
                if let Some(v) = &s.value {
                    return Some(v.clone());
                }
                s.sleepers += 1;
                match timeout {
                    None => s = self.ready.wait(s).unwrap(),
                    Some(t) => {
                        let Some(left) = t.checked_sub(start.elapsed()) else {
                            s.sleepers -= 1;
                            return None;
                        };
                        s = self.ready.wait_timeout(s, left).unwrap().0;
                    }
                }
                s.sleepers -= 1;
            }
        })
    }

    /// Whether the result is there; if not, `cx`'s waker is woken when it is.
    pub(crate) fn poll_done(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_done() {
            return Poll::Ready(());
        }
        let mut s = self.state.lock().unwrap();
        if s.value.is_some() {
            return Poll::Ready(());
        }
        if !s.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            s.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<T> {
        let mut s = self.state.lock().unwrap();
        if let Some(v) = &s.value {
            return Poll::Ready(v.clone());
        }
        if !s.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            s.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// What a blocked waiter can do besides sleeping: produce the result itself, by reading the
/// replies of the pipe it will arrive on (the agent's read role, [`crate::reader`]). A leaf
/// trait: completions know nothing of pipes, and the agent knows nothing of slots' insides.
pub(crate) trait Driver: Send + Sync {
    /// Called on a plain thread (never a runtime's) that waits for a result. Returns once
    /// `poll_done` is ready, `deadline` passed, or this thread cannot help any more (the pipe
    /// failed); the caller then waits on the slot as usual.
    fn drive(&self, poll_done: &mut dyn FnMut(&mut Context<'_>) -> Poll<()>, deadline: Option<Instant>);

    /// A task awaits the result asynchronously: someone must be reading.
    fn awaited(&self);

    /// Who holds the read role and who waits for it, for diagnostics.
    fn debug_state(&self) -> String {
        String::new()
    }
}

/// A result that arrives later. Clone it to wait in several places; each gets the same result.
pub struct Completion<T> {
    slot: Arc<Slot<T>>,
    driver: Option<Arc<dyn Driver>>,
}

impl<T> Clone for Completion<T> {
    fn clone(&self) -> Self {
        Completion {
            slot: self.slot.clone(),
            driver: self.driver.clone(),
        }
    }
}

impl<T: Clone> Completion<T> {
    pub(crate) fn new(slot: Arc<Slot<T>>) -> Self {
        Completion { slot, driver: None }
    }

    /// A completion whose waiters may produce the result with `driver`.
    pub(crate) fn driven(slot: Arc<Slot<T>>, driver: Option<Arc<dyn Driver>>) -> Self {
        Completion { slot, driver }
    }

    /// A completion that is already done.
    pub fn ready(value: T) -> Self {
        let slot = Slot::new();
        slot.complete(value);
        Completion { slot, driver: None }
    }

    /// Blocks the calling thread until the result is there. Do not call it on an async
    /// runtime's thread; `.await` the completion there instead. A thread that waits for a
    /// reply reads it itself when no one else is reading that pipe (no hand-off to another
    /// thread in the common case).
    pub fn wait(&self) -> T {
        self.drive(None);
        self.slot.wait(None).expect("waits without a timeout return a value")
    }

    /// Like [`wait`](Self::wait), giving up after `timeout` (the operation itself goes on).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<T> {
        let start = Instant::now();
        self.drive(Some(start + timeout));
        self.slot.wait(Some(timeout.saturating_sub(start.elapsed())))
    }

    fn drive(&self, deadline: Option<Instant>) {
        let Some(driver) = &self.driver else { return };
        if self.slot.is_done() {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            // Inside a runtime this thread must not read (it cannot block on the runtime):
            // make sure someone does.
            driver.awaited();
            return;
        }
        driver.drive(&mut |cx| self.slot.poll_done(cx), deadline);
    }

    /// The result if it is already there.
    pub fn try_get(&self) -> Option<T> {
        self.slot.peek()
    }

    pub fn is_done(&self) -> bool {
        self.slot.is_done()
    }
}

impl<T: Clone> Future for Completion<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let p = self.slot.poll(cx);
        if p.is_pending() {
            if let Some(d) = &self.driver {
                d.awaited();
            }
        }
        p
    }
}

/// Waits for every future in turn and returns their payloads in order, or the first error met
/// (as PyTorch's `wait_all`: it returns at once, without waiting for the futures after it,
/// which run on).
pub fn wait_all(futures: impl IntoIterator<Item = RpcFuture>) -> Result<Vec<Payload>, RpcError> {
    futures.into_iter().map(|f| f.wait()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_waiter_gets_the_result() {
        let slot = Slot::<Result<u32, String>>::new();
        let c = Completion::new(slot.clone());
        let c2 = c.clone();
        let t = std::thread::spawn(move || c2.wait());
        std::thread::sleep(Duration::from_millis(5));
        assert!(slot.complete(Err("boom".into())));
        assert!(!slot.complete(Ok(1)), "only the first result counts");
        assert_eq!(t.join().unwrap(), Err("boom".into()));
        assert_eq!(c.wait(), Err("boom".into()));
        assert_eq!(c.wait(), Err("boom".into()));
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(rt.block_on(c.clone()), Err("boom".into()));
    }

    #[test]
    fn wait_timeout_gives_up() {
        let c = Completion::new(Slot::<u8>::new());
        assert_eq!(c.wait_timeout(Duration::from_millis(10)), None);
    }
}

/// Model checks (run with `RUSTFLAGS="--cfg sluice_loom"`): every interleaving of a completer
/// and blocked or polling waiters ends with each waiter holding the value exactly once set.
#[cfg(all(test, sluice_loom))]
mod loom_tests {
    use super::*;
    use loom::thread;

    #[test]
    fn loom_two_sleepers_and_a_completer() {
        loom::model(|| {
            let slot = Slot::<u32>::new();
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let slot = slot.clone();
                    thread::spawn(move || slot.wait(None))
                })
                .collect();
            assert!(slot.complete(7));
            assert!(!slot.complete(8), "a second result must not replace the first");
            for w in waiters {
                assert_eq!(w.join().unwrap(), Some(7));
            }
        });
    }

    #[test]
    fn loom_racing_completers_and_a_poller() {
        loom::model(|| {
            let slot = Slot::<u32>::new();
            let other = {
                let slot = slot.clone();
                thread::spawn(move || slot.complete(2))
            };
            let poller = {
                let slot = slot.clone();
                thread::spawn(move || {
                    let woken = Arc::new(std::sync::atomic::AtomicBool::new(false));
                    let waker = Waker::from(Arc::new(Flag(woken.clone())));
                    let mut cx = Context::from_waker(&waker);
                    match slot.poll_done(&mut cx) {
                        // Pending now: the completion must wake this waker.
                        Poll::Pending => Some(woken),
                        Poll::Ready(()) => None,
                    }
                })
            };
            let mine = slot.complete(1);
            let theirs = other.join().unwrap();
            assert!(mine ^ theirs, "exactly one completion takes effect");
            if let Some(woken) = poller.join().unwrap() {
                assert!(
                    woken.load(std::sync::atomic::Ordering::SeqCst),
                    "a pending poller was never woken"
                );
            }
            assert_eq!(slot.peek(), Some(if mine { 1 } else { 2 }));
        });
    }

    struct Flag(Arc<std::sync::atomic::AtomicBool>);

    impl std::task::Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
