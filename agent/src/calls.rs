//! The pending-call table: every call this worker started and has not completed, its peer and
//! its deadline. IO-free and clock-free: the caller passes `now` and acts on what comes back
//! (complete these, wake the timer at that instant), so the whole policy is unit-tested on a
//! fake clock below. The agent keeps one table behind one lock and drives it from the call path,
//! the reply readers, the deadline timer and failure handling.
//!
//! Rules it holds:
//! - a call completes exactly once: whichever of reply, deadline, peer loss or shutdown comes
//!   first takes it out of the table, and the others find nothing;
//! - a late reply (after its deadline) finds no entry and is dropped by the caller;
//! - a peer's calls can be counted and failed without touching anyone else's.

use std::collections::BTreeSet;

use rustc_hash::FxHashMap as HashMap;
use std::time::{Duration, Instant};

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
