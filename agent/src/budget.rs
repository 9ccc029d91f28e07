//! The in-flight budget of one caller: bytes of its requests this worker holds in memory
//! (received, not yet answered). Reading from that caller waits while a new request would push
//! it past the limit, so a peer cannot make this worker hold more than that. One request over
//! the limit is let through when nothing else is held (the message limit already bounds it), so
//! a single large request never waits forever.
//!
//! The admission rule is a pure function, tested below; the budget itself is lock-free
//! accounting plus a notifier that readers wait on only when they must.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Whether `n` more bytes may be held when `used` are held under `limit`.
pub(crate) fn admits(used: u64, n: u64, limit: u64) -> bool {
    used == 0 || used.saturating_add(n) <= limit
}

pub(crate) struct Budget {
    limit: u64,
    used: AtomicU64,
    /// Readers waiting for bytes to be released (so a release notifies only when needed).
    waiting: AtomicUsize,
    freed: tokio::sync::Notify,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Budget {
        Budget {
            limit,
            used: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            freed: tokio::sync::Notify::new(),
        }
    }

    pub(crate) fn try_acquire(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                admits(used, n, self.limit).then(|| used + n)
            })
            .is_ok()
    }

    /// Waits until `n` bytes are admitted, then holds them.
    pub(crate) async fn acquire(&self, n: u64) {
        if self.try_acquire(n) {
            return;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.try_acquire(n) {
                break;
            }
            freed.await;
        }
        self.waiting.fetch_sub(1, Ordering::AcqRel);
    }

    /// Gives `n` bytes back (saturating: a double release cannot wrap the count).
    pub(crate) fn release(&self, n: u64) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| Some(used.saturating_sub(n)));
        if self.waiting.load(Ordering::Acquire) > 0 {
            self.freed.notify_waiters();
        }
    }

    #[cfg(test)]
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_admission_rule() {
        assert!(admits(0, 10, 100));
        assert!(admits(90, 10, 100), "up to the limit exactly");
        assert!(!admits(91, 10, 100));
        assert!(
            admits(0, 1_000, 100),
            "one request over the limit passes when nothing is held"
        );
        assert!(!admits(1, 1_000, 100));
        assert!(!admits(u64::MAX, 1, u64::MAX - 1), "no overflow");
    }

    #[tokio::test]
    async fn a_reader_waits_until_enough_is_released() {
        let b = Arc::new(Budget::new(100));
        b.acquire(60).await;
        b.acquire(40).await;
        assert_eq!(b.used(), 100);
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.acquire(30).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "100 held: 30 more must wait");
        b.release(20);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "80 held: 30 more still exceed 100");
        b.release(40);
        waiter.await.unwrap();
        assert_eq!(b.used(), 70);
        b.release(1_000);
        assert_eq!(b.used(), 0, "saturates");
    }
}
