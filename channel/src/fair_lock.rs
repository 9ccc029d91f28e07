//! The pipe's fair async lock: first come, first served, as `tokio::sync::Mutex` is, with an
//! uncontended take and release of one atomic read-modify-write each.
//!
//! Each side of a pipe runs under one of these, taken at least once per message on each side
//! of every round trip. tokio's mutex pays for its fairness on every release (its semaphore
//! takes an inner lock to look for waiters even when there are none), about a tenth of the
//! pipe's own CPU per small message. Here the waiters announce themselves in a counter
//! instead, and only a release that sees one pays for a wake-up.
//!
//! - [`try_lock`](FairLock::try_lock) fails while anyone waits in [`lock`](FairLock::lock): it
//!   never overtakes a queued waiter (the pipe's `try_write` and `try_read_message` rely on it
//!   to keep issue order).
//! - Waiters queue in order on a tokio mutex (taken only on this slow path); the first of them
//!   waits for the holder's release. The lock's state is one word (held, and how many wait),
//!   so a release learns in the same atomic step whether anyone must be woken.
//! - A waiter that gives up (its future dropped) leaves the queue, and a wake-up it was given
//!   passes on: the next waiter finds the lock free when its turn comes.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use tokio::sync::Notify;

/// `state`'s low bit: someone holds the lock.
const HELD: usize = 1;
/// `state` counts waiters above the low bit.
const WAITER: usize = 2;

pub(crate) struct FairLock<T> {
    /// [`HELD`], plus [`WAITER`] for each `lock` call that found the lock taken and has not
    /// yet taken it or given up. One word, so that a release learns atomically whether to
    /// wake anyone.
    state: AtomicUsize,
    /// Orders the waiters: the one holding it is next.
    queue: tokio::sync::Mutex<()>,
    /// Signalled by a release that saw waiters.
    released: Notify,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a `Guard`, and at most one guard exists at a time
// (`HELD` is set by a compare-exchange from a state without it, and cleared only by the
// guard's drop), so sharing the lock between threads shares no `&mut T`; the value itself
// moves between threads with the guard, hence `T: Send`.
unsafe impl<T: Send> Sync for FairLock<T> {}

impl<T> FairLock<T> {
    pub(crate) fn new(value: T) -> Self {
        FairLock {
            state: AtomicUsize::new(0),
            queue: tokio::sync::Mutex::new(()),
            released: Notify::new(),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock if it is free and nobody waits for it.
    pub(crate) fn try_lock(&self) -> Option<Guard<'_, T>> {
        self.state
            .compare_exchange(0, HELD, Acquire, Relaxed)
            .ok()
            .map(|_| Guard { lock: self })
    }

    /// Takes the lock once every earlier waiter has had it. Cancel-safe: dropped while
    /// waiting, it leaves the lock as if it had never asked.
    pub(crate) async fn lock(&self) -> Guard<'_, T> {
        if let Some(guard) = self.try_lock() {
            return guard;
        }
        // Counted before looking again: a release after this sees the waiter and signals;
        // a release before it leaves the lock free for the look below.
        self.state.fetch_add(WAITER, Relaxed);
        let mut announced = Announced(Some(&self.state));
        let _turn = self.queue.lock().await;
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Registered before looking, so a release between the two is not missed.
            released.as_mut().enable();
            let mut s = self.state.load(Relaxed);
            while s & HELD == 0 {
                // Taken, and this waiter no longer counted, in one step.
                match self
                    .state
                    .compare_exchange_weak(s, (s - WAITER) | HELD, Acquire, Relaxed)
                {
                    Ok(_) => {
                        announced.0 = None;
                        return Guard { lock: self };
                    }
                    Err(now) => s = now,
                }
            }
            released.await;
        }
    }
}

/// A waiter's count in `state`, taken back if its wait ends without the lock.
struct Announced<'a>(Option<&'a AtomicUsize>);

impl Drop for Announced<'_> {
    fn drop(&mut self) {
        if let Some(state) = self.0 {
            state.fetch_sub(WAITER, Relaxed);
        }
    }
}

pub(crate) struct Guard<'a, T> {
    lock: &'a FairLock<T>,
}

impl<T> Deref for Guard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `FairLock`'s `Sync`), and it borrows the
        // lock for its whole life.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        if self.lock.state.fetch_and(!HELD, Release) >= WAITER {
            self.lock.released.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    /// Waiters take the lock in the order they asked, and `try_lock` never overtakes one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn first_come_first_served() {
        let lock = Arc::new(FairLock::new(Vec::new()));
        let held = lock.lock().await;
        let mut tasks = Vec::new();
        for i in 0..8 {
            let mine = lock.clone();
            tasks.push(tokio::spawn(async move { mine.lock().await.push(i) }));
            // Each waiter is queued before the next one is started.
            while lock.state.load(Relaxed) / WAITER != i + 1 {
                tokio::task::yield_now().await;
            }
        }
        assert!(lock.try_lock().is_none(), "held");
        drop(held);
        assert!(
            lock.try_lock().is_none() || lock.state.load(Relaxed) < WAITER,
            "overtook a waiter"
        );
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*lock.lock().await, (0..8).collect::<Vec<_>>());
        assert!(lock.try_lock().is_some());
    }

    /// A waiter that gives up, even one already woken, leaves the lock to the next.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cancelled_waiters_pass_on() {
        let lock = Arc::new(FairLock::new(0u64));
        for _ in 0..200 {
            let held = lock.lock().await;
            let quitter = {
                let lock = lock.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(Duration::from_micros(50), lock.lock()).await;
                })
            };
            let waiter = {
                let lock = lock.clone();
                tokio::spawn(async move { *lock.lock().await += 1 })
            };
            tokio::time::sleep(Duration::from_micros(30)).await;
            drop(held);
            quitter.await.unwrap();
            tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .expect("a waiter was left behind after another gave up")
                .unwrap();
        }
        assert_eq!(*lock.lock().await, 200);
        assert_eq!(lock.state.load(Relaxed), 0);
    }

    /// Many tasks on many threads, each adding under the lock: nothing lost, nobody stuck.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn exclusive_under_contention() {
        let lock = Arc::new(FairLock::new((0u64, 0u64)));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let lock = lock.clone();
                tokio::spawn(async move {
                    for n in 0..2_000u64 {
                        let mut g = if (i + n) % 3 == 0 {
                            match lock.try_lock() {
                                Some(g) => g,
                                None => lock.lock().await,
                            }
                        } else {
                            lock.lock().await
                        };
                        // A torn update would show as a mismatch.
                        let (a, b) = *g;
                        if n % 64 == 0 {
                            tokio::task::yield_now().await;
                        }
                        *g = (a + 1, b + 1);
                    }
                })
            })
            .collect();
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("stuck")
                .unwrap();
        }
        assert_eq!(*lock.lock().await, (32_000, 32_000));
    }
}
