//! The calls this worker started and has not completed: [`Outstanding`], the call core, owns
//! them with their result slots, their deadlines' timer and the clock deadlines are set on. It
//! is driven by the caller (register), whoever reads a reply (finish), the deadline timer
//! ([`Outstanding::run_timer`]) and failure handling (fail); it knows nothing of pipes, peers or
//! the agent.
//!
//! Inside it, [`Calls`] is the table itself: IO-free and clock-free (the caller passes the
//! deadline and `now`, and acts on what comes back), so its whole policy is unit-tested on a
//! fake clock below.
//!
//! Rules it holds:
//! - a call completes exactly once: whichever of reply, deadline, peer loss or shutdown comes
//!   first takes it out of the table, and the others find nothing;
//! - a late reply (after its deadline) finds no entry and is dropped by the caller;
//! - a peer's calls can be counted and failed without touching anyone else's.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap as HashMap;

use crate::clock::Clock;
use crate::completion::Slot;
use crate::error::RpcError;
use crate::payload::Payload;

/// Where a call's result goes.
pub(crate) type ResultSlot = Arc<Slot<Result<Payload, RpcError>>>;

/// The call core: the table behind one lock, the deadline timer's wake-ups, the clock.
pub(crate) struct Outstanding {
    table: Mutex<Calls<ResultSlot>>,
    clock: Clock,
    timer: tokio::sync::Notify,
    /// When the deadline timer looks next (ms on the clock): a call whose deadline is later
    /// needs no wake-up (one per call would cost a runtime thread's wake-up each).
    timer_due: AtomicU64,
    /// Closed at teardown: the timer ends.
    closed: AtomicBool,
}

impl Outstanding {
    pub(crate) fn new() -> Outstanding {
        Outstanding {
            table: Mutex::new(Calls::default()),
            clock: Clock::new(),
            timer: tokio::sync::Notify::new(),
            timer_due: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        }
    }

    /// The agent's clock (deadlines, heartbeats).
    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Registers call `id` to `peer`, due in `timeout` (zero: never); returns its result slot.
    pub(crate) fn register(&self, id: u64, peer: u32, timeout: Duration) -> ResultSlot {
        let slot = Slot::new();
        let deadline = (!timeout.is_zero()).then(|| self.clock.deadline_in(timeout));
        let sooner = {
            let mut table = self.table.lock().unwrap();
            // A call that slipped past the agent's running check as it shut down: `close`
            // has failed the table already, so nothing else would complete this one.
            if self.closed.load(Ordering::Acquire) {
                drop(table);
                slot.complete(Err(RpcError::Shutdown));
                return slot;
            }
            table.register(id, peer, timeout, deadline, slot.clone())
        };
        if let Some(d) = sooner {
            if self.ms(d) < self.timer_due.load(Ordering::Acquire) {
                self.timer.notify_one();
            }
        }
        slot
    }

    fn ms(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.clock.start()).as_millis() as u64
    }

    /// Completes call `id` (once). A call already completed (timed out, failed) is ignored, and
    /// so is its late reply: returns whether this completed it.
    pub(crate) fn finish(&self, id: u64, result: Result<Payload, RpcError>) -> bool {
        let pending = self.table.lock().unwrap().complete(id);
        match pending {
            Some(p) => {
                p.slot.complete(result);
                true
            }
            None => {
                tracing::debug!(id, "reply for a call that already finished (timed out); discarded");
                false
            }
        }
    }

    /// Fails every pending call to `peer` (`None`: to everyone) with `error`.
    pub(crate) fn fail(&self, peer: Option<u32>, error: impl Fn(u32) -> RpcError) {
        let failed = self.table.lock().unwrap().fail(peer);
        for p in failed {
            p.slot.complete(Err(error(p.peer)));
        }
    }

    /// Fails everything with [`RpcError::Shutdown`] and stops the timer (teardown); calls
    /// registered later fail the same way at once.
    pub(crate) fn close(&self) {
        // Before `fail` takes the table's lock: a concurrent `register` either lands in the
        // table before `fail` empties it, or takes the lock after and sees it closed.
        self.closed.store(true, Ordering::Release);
        self.fail(None, |_| RpcError::Shutdown);
        self.timer.notify_one();
    }

    /// Calls pending in all.
    pub(crate) fn len(&self) -> usize {
        self.table.lock().unwrap().len()
    }

    /// Calls pending to `peer`.
    pub(crate) fn pending_to(&self, peer: u32) -> usize {
        self.table.lock().unwrap().pending_to(peer)
    }

    /// Fails calls whose deadline passed, naming their peer with `name_of`, until the core is
    /// closed or dropped (or the runtime shuts down).
    pub(crate) async fn run_timer(weak: Weak<Outstanding>, name_of: impl Fn(u32) -> String) {
        loop {
            let Some(core) = weak.upgrade() else { return };
            if core.closed.load(Ordering::Acquire) {
                return;
            }
            let (expired, next) = core.table.lock().unwrap().expire(Instant::now());
            for p in expired {
                p.slot.complete(Err(RpcError::Timeout {
                    worker: name_of(p.peer),
                    timeout: p.timeout,
                }));
            }
            // Without a deadline it looks again now and then, so a dropped core lets this task
            // end; a call whose deadline falls before the next look wakes it (`register`).
            let notified = core.timer.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let until = next.unwrap_or_else(|| Instant::now() + Duration::from_millis(200));
            core.timer_due.store(core.ms(until), Ordering::Release);
            // A call registered between `expire` and publishing `timer_due` may have seen the
            // old value and not woken us: look again before sleeping.
            if core.table.lock().unwrap().next_deadline().is_some_and(|d| d < until) {
                continue;
            }
            let _ = tokio::time::timeout_at(until.into(), notified).await;
        }
    }
}

/// One pending call; `S` is whatever completes it (the agent's result slot).
#[derive(Debug)]
pub(crate) struct Pending<S> {
    pub slot: S,
    pub peer: u32,
    pub timeout: Duration,
    pub deadline: Option<Instant>,
}

/// The table. `S` is the completion slot, kept opaque so tests can use plain values.
#[derive(Debug)]
pub(crate) struct Calls<S> {
    map: HashMap<u64, Pending<S>>,
    deadlines: BTreeSet<(Instant, u64)>,
    per_peer: HashMap<u32, usize>,
}

impl<S> Default for Calls<S> {
    fn default() -> Self {
        Calls {
            map: HashMap::default(),
            deadlines: BTreeSet::new(),
            per_peer: HashMap::default(),
        }
    }
}

impl<S> Calls<S> {
    /// Registers call `id` to `peer`, due at `deadline` (`None`: never; `timeout` is what the
    /// caller asked for, for its error). Returns the deadline when it is earlier than every
    /// other one, so the timer must wake sooner.
    pub fn register(
        &mut self,
        id: u64,
        peer: u32,
        timeout: Duration,
        deadline: Option<Instant>,
        slot: S,
    ) -> Option<Instant> {
        let earliest = self.deadlines.first().map(|(t, _)| *t);
        if let Some(d) = deadline {
            self.deadlines.insert((d, id));
        }
        if let Some(old) = self.map.insert(
            id,
            Pending {
                slot,
                peer,
                timeout,
                deadline,
            },
        ) {
            // Ids are unique per incarnation; a reused one replaces the stale entry cleanly.
            self.forget(id, &old);
        }
        *self.per_peer.entry(peer).or_default() += 1;
        deadline.filter(|d| earliest.is_none_or(|e| *d < e))
    }

    fn forget(&mut self, id: u64, p: &Pending<S>) {
        if let Some(d) = p.deadline {
            self.deadlines.remove(&(d, id));
        }
        if let Some(n) = self.per_peer.get_mut(&p.peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&p.peer);
            }
        }
    }

    /// Takes call `id` out for completion (its reply arrived); `None` when it already finished
    /// (timed out, failed): the reply is late and must be dropped.
    pub fn complete(&mut self, id: u64) -> Option<Pending<S>> {
        let p = self.map.remove(&id)?;
        self.forget(id, &p);
        Some(p)
    }

    /// Takes out every call whose deadline is at or before `now`, and returns them with the
    /// next deadline still ahead (when the timer should wake next).
    pub fn expire(&mut self, now: Instant) -> (Vec<Pending<S>>, Option<Instant>) {
        let mut expired = Vec::new();
        while let Some(&(d, id)) = self.deadlines.first() {
            if d > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(p) = self.map.remove(&id) {
                self.forget(id, &p);
                expired.push(p);
            }
        }
        (expired, self.next_deadline())
    }

    /// Takes out every call to `peer` (`None`: to everyone).
    pub fn fail(&mut self, peer: Option<u32>) -> Vec<Pending<S>> {
        let ids: Vec<u64> = self
            .map
            .iter()
            .filter(|(_, p)| peer.is_none_or(|r| p.peer == r))
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter().filter_map(|id| self.complete(id)).collect()
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Calls pending in all.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Calls pending to `peer`.
    pub fn pending_to(&self, peer: u32) -> usize {
        self.per_peer.get(&peer).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A deadline `timeout` after `now`, as the agent sets them (zero: none).
    fn due(now: Instant, timeout: Duration) -> Option<Instant> {
        (!timeout.is_zero()).then(|| now + timeout)
    }

    /// A fake clock: instants are offsets from one base, advanced by hand.
    fn at(base: Instant, ms: u64) -> Instant {
        base + MS * ms as u32
    }

    /// The core end to end on a real runtime: a deadline fails its call with a timeout naming
    /// the peer, a reply completes exactly once, and closing fails the rest and ends the timer.
    #[test]
    fn the_core_times_out_finishes_once_and_closes() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let core = Arc::new(Outstanding::new());
        let timer = rt.spawn(Outstanding::run_timer(Arc::downgrade(&core), |id| format!("w{id}")));
        let late = core.register(1, 7, MS * 20);
        let answered = core.register(2, 7, Duration::from_secs(60));
        let open = core.register(3, 8, Duration::ZERO);
        assert_eq!(core.pending_to(7), 2);
        rt.block_on(async {
            // Watchdog: the deadline must fire well within this.
            tokio::time::timeout(Duration::from_secs(10), async {
                while !late.is_done() {
                    tokio::time::sleep(MS).await;
                }
            })
            .await
            .expect("the 20 ms deadline fired");
        });
        match late.peek() {
            Some(Err(RpcError::Timeout { worker, timeout })) => {
                assert_eq!(worker, "w7");
                assert_eq!(timeout, MS * 20);
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(!core.finish(1, Ok(Payload::empty())), "a late reply finds nothing");
        assert!(core.finish(2, Ok(Payload::empty())));
        assert!(!core.finish(2, Ok(Payload::empty())), "exactly once");
        assert!(matches!(answered.peek(), Some(Ok(_))));
        core.close();
        assert!(matches!(open.peek(), Some(Err(RpcError::Shutdown))));
        assert_eq!(core.len(), 0);
        let after = core.register(4, 7, Duration::from_secs(60));
        assert!(
            matches!(after.peek(), Some(Err(RpcError::Shutdown))),
            "a call after close fails at once"
        );
        assert_eq!(core.len(), 0);
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), timer)
                .await
                .expect("closing ends the timer")
                .unwrap();
        });
    }

    #[test]
    fn a_call_completes_once_and_a_late_reply_finds_nothing() {
        let t0 = Instant::now();
        let mut calls = Calls::default();
        assert_eq!(
            calls.register(1, 7, MS * 100, due(t0, MS * 100), "a"),
            Some(at(t0, 100))
        );
        assert_eq!(calls.pending_to(7), 1);
        let (expired, next) = calls.expire(at(t0, 99));
        assert!(expired.is_empty());
        assert_eq!(next, Some(at(t0, 100)));
        let (expired, next) = calls.expire(at(t0, 100));
        assert_eq!(expired.len(), 1, "the deadline is inclusive");
        assert_eq!(expired[0].slot, "a");
        assert_eq!(next, None);
        assert!(calls.complete(1).is_none(), "a reply after the timeout is late");
        assert_eq!(calls.pending_to(7), 0);
        assert_eq!(calls.len(), 0);
    }

    #[test]
    fn a_reply_before_the_deadline_cancels_it() {
        let t0 = Instant::now();
        let mut calls = Calls::default();
        calls.register(1, 7, MS * 10, due(t0, MS * 10), ());
        assert!(calls.complete(1).is_some());
        assert!(calls.complete(1).is_none(), "exactly once");
        let (expired, next) = calls.expire(at(t0, 1000));
        assert!(expired.is_empty());
        assert_eq!(next, None);
    }

    #[test]
    fn the_timer_is_told_only_about_an_earlier_deadline() {
        let t0 = Instant::now();
        let mut calls = Calls::default();
        assert_eq!(calls.register(1, 1, MS * 50, due(t0, MS * 50), ()), Some(at(t0, 50)));
        assert_eq!(
            calls.register(2, 1, MS * 80, due(t0, MS * 80), ()),
            None,
            "later than the earliest"
        );
        assert_eq!(
            calls.register(3, 1, Duration::ZERO, due(t0, Duration::ZERO), ()),
            None,
            "no timeout"
        );
        assert_eq!(calls.register(4, 1, MS * 20, due(t0, MS * 20), ()), Some(at(t0, 20)));
        let (expired, next) = calls.expire(at(t0, 60));
        assert_eq!(expired.len(), 2);
        assert_eq!(next, Some(at(t0, 80)));
        // The call without a timeout never expires.
        let (expired, next) = calls.expire(at(t0, 1_000_000));
        assert_eq!(expired.len(), 1);
        assert_eq!(next, None);
        assert_eq!(calls.len(), 1);
        assert!(calls.complete(3).is_some());
    }

    #[test]
    fn failing_a_peer_takes_exactly_its_calls() {
        let t0 = Instant::now();
        let mut calls = Calls::default();
        for id in 0..10u64 {
            calls.register(id, (id % 3) as u32, MS * 100, due(t0, MS * 100), id);
        }
        let mut failed: Vec<u64> = calls.fail(Some(1)).into_iter().map(|p| p.slot).collect();
        failed.sort();
        assert_eq!(failed, vec![1, 4, 7]);
        assert_eq!(calls.pending_to(1), 0);
        assert_eq!(calls.pending_to(0), 4);
        assert_eq!(calls.pending_to(2), 3);
        // Their deadlines went with them: only the others expire.
        let (expired, _) = calls.expire(at(t0, 100));
        assert_eq!(expired.len(), 7);
        assert!(calls.fail(None).is_empty());
    }

    #[test]
    fn shutdown_fails_everything_once() {
        let t0 = Instant::now();
        let mut calls = Calls::default();
        calls.register(1, 1, MS, due(t0, MS), ());
        calls.register(2, 2, Duration::ZERO, due(t0, Duration::ZERO), ());
        assert_eq!(calls.fail(None).len(), 2);
        assert_eq!(calls.len(), 0);
        assert_eq!(calls.next_deadline(), None);
        assert!(calls.expire(at(t0, 5)).0.is_empty());
    }
}
