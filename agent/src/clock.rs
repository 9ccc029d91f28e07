//! The agent's clock for the per-call path. A precise clock read (`Instant::now`) costs tens
//! of nanoseconds on a virtual machine, and a call made several; the kernel's coarse monotonic
//! clock is a plain memory read, exact to a scheduler tick (1–10 ms). Heartbeats and long
//! deadlines need no more than that; short deadlines keep the precise clock.
//!
//! Both clocks are `CLOCK_MONOTONIC`, one read at tick granularity, so a coarse reading
//! converts to an [`Instant`] through one pair of readings taken together at the start.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::time::{clock_getres, clock_gettime, ClockId};

/// Deadlines at least this far off are set on the coarse clock (late by at most two ticks,
/// never early); nearer ones on the precise clock.
const COARSE_FROM: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub(crate) struct Clock {
    /// The agent's start on the precise clock.
    base: Instant,
    /// The coarse clock, where the kernel has one (else everything reads the precise one).
    coarse: Option<Coarse>,
}

#[derive(Debug)]
struct Coarse {
    /// Its reading at the agent's start, taken just before `Clock::base`.
    base: Duration,
    tick: Duration,
}

fn coarse() -> Option<Duration> {
    clock_gettime(ClockId::CLOCK_MONOTONIC_COARSE).ok().map(Duration::from)
}

impl Clock {
    pub(crate) fn new() -> Clock {
        let tick = clock_getres(ClockId::CLOCK_MONOTONIC_COARSE)
            .ok()
            .map(Duration::from)
            .filter(|t| !t.is_zero() && *t <= Duration::from_millis(100));
        // Coarse first: a pause between the two reads then makes readings late, never early.
        let coarse = tick.and_then(|tick| Some(Coarse { base: coarse()?, tick }));
        Clock {
            base: Instant::now(),
            coarse,
        }
    }

    /// The coarse clock's tick (zero without one).
    fn tick(&self) -> Duration {
        self.coarse.as_ref().map_or(Duration::ZERO, |c| c.tick)
    }

    /// Time since the agent started, to a tick.
    pub(crate) fn elapsed(&self) -> Duration {
        match self
            .coarse
            .as_ref()
            .and_then(|c| Some(coarse()?.saturating_sub(c.base)))
        {
            Some(elapsed) => elapsed,
            None => self.base.elapsed(),
        }
    }

    /// Milliseconds since the agent started, to a tick (heartbeats, silence).
    pub(crate) fn now_ms(&self) -> u64 {
        self.elapsed().as_millis() as u64
    }

    /// The instant `timeout` from now: exact when the timeout is short; when it is long, late
    /// by at most two ticks and never early, unless the kernel's coarse clock lags by more
    /// than a tick (its timekeeper descheduled on a busy virtual machine), and then early by
    /// no more than that extra lag: milliseconds on a timeout of a second or more.
    pub(crate) fn deadline_in(&self, timeout: Duration) -> Instant {
        let tick = self.tick();
        if timeout < COARSE_FROM || tick.is_zero() {
            return Instant::now() + timeout;
        }
        // The coarse reading is up to a tick behind, and the base pair up to a tick apart:
        // two ticks make it never early.
        self.base + self.elapsed() + 2 * tick + timeout
    }

    /// The agent's start, on the precise clock.
    pub(crate) fn start(&self) -> Instant {
        self.base
    }
}

/// Whether a pipe saw traffic since its watcher last looked. The per-message side is a plain
/// flag (no clock read, and no store at all while the flag is already up, so the threads that
/// mark it do not take its cache line from each other); the watcher, which wakes a few times
/// an interval anyway, turns it into a time with its own clock reads. A time taken that way is
/// never earlier than the traffic, so silence is under-counted by at most one watch period:
/// a ping or a loss comes that much later, never sooner.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    seen: AtomicBool,
}

impl Activity {
    /// Something was sent or received now.
    #[inline]
    pub(crate) fn mark(&self) {
        if !self.seen.load(Ordering::Relaxed) {
            self.seen.store(true, Ordering::Relaxed);
        }
    }

    /// The watcher's look at `now_ms`: moves `last` (the watcher's own record of the last
    /// traffic, in ms) to now if there was traffic since the previous look, and returns how
    /// long it has been quiet.
    pub(crate) fn quiet_for(&self, last: &mut u64, now_ms: u64) -> Duration {
        if self.seen.swap(false, Ordering::Relaxed) {
            *last = now_ms;
        }
        Duration::from_millis(now_ms.saturating_sub(*last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_are_never_early_and_late_by_at_most_a_few_ticks() {
        let clock = Clock::new();
        for timeout in [
            Duration::from_millis(5),
            Duration::from_secs(1),
            Duration::from_secs(60),
        ] {
            for _ in 0..1000 {
                let before = Instant::now();
                let d = clock.deadline_in(timeout);
                let after = Instant::now();
                assert!(
                    d >= before + timeout,
                    "{timeout:?}: early by {:?}",
                    before + timeout - d
                );
                let slack = if timeout < COARSE_FROM {
                    Duration::ZERO
                } else {
                    4 * clock.tick()
                };
                assert!(
                    d <= after + timeout + slack,
                    "{timeout:?}: late by {:?} (tick {:?})",
                    d - (after + timeout),
                    clock.tick()
                );
            }
        }
    }

    #[test]
    fn elapsed_follows_the_precise_clock_to_a_tick() {
        let clock = Clock::new();
        std::thread::sleep(Duration::from_millis(30));
        let precise = clock.start().elapsed();
        let coarse = clock.elapsed();
        let tick = clock.tick().max(Duration::from_millis(1));
        assert!(
            coarse <= precise + tick,
            "coarse {coarse:?} ahead of precise {precise:?}"
        );
        assert!(
            coarse + 2 * tick >= precise,
            "coarse {coarse:?} behind precise {precise:?}"
        );
    }

    #[test]
    fn activity_counts_quiet_from_the_last_look_that_saw_traffic() {
        let a = Activity::default();
        let mut last = 100;
        assert_eq!(a.quiet_for(&mut last, 150), Duration::from_millis(50));
        a.mark();
        a.mark();
        // Traffic since the last look: quiet from this look on.
        assert_eq!(a.quiet_for(&mut last, 400), Duration::ZERO);
        assert_eq!(last, 400);
        // None since: quiet grows again.
        assert_eq!(a.quiet_for(&mut last, 1_400), Duration::from_millis(1_000));
        // A clock read older than the record never counts as negative quiet.
        assert_eq!(a.quiet_for(&mut last, 300), Duration::ZERO);
    }
}
