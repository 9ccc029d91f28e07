//! Where a shared-memory connection's waiting goes, counted per process when asked for
//! ([`enable`]; off by default, when counting costs one relaxed load per wait): waits that
//! found their ring not ready, those that ended while spinning, those that parked (and for how
//! long), the time spent spinning, the wake-ups signalled to a parked peer, and the spinners
//! moved off a core they shared with another spinner. The benchmark
//! reads them around each shared-memory row, to tell a slow run that waited on wake-ups from
//! one that moved bytes slowly.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

static ON: AtomicBool = AtomicBool::new(false);
static WAITS: AtomicU64 = AtomicU64::new(0);
static SPUN: AtomicU64 = AtomicU64::new(0);
static PARKED: AtomicU64 = AtomicU64::new(0);
static SPIN_NS: AtomicU64 = AtomicU64::new(0);
static PARK_NS: AtomicU64 = AtomicU64::new(0);
static WAKES: AtomicU64 = AtomicU64::new(0);
static MOVED: AtomicU64 = AtomicU64::new(0);

/// Counts of this process's shared-memory waits since it started counting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct WaitStats {
    /// Waits that found the ring not ready (empty for a reader, full for a writer).
    pub waits: u64,
    /// Of those, the waits that ended while spinning.
    pub spun: u64,
    /// Of those, the waits that parked on their eventfd.
    pub parked: u64,
    /// Time spent spinning and parked, in µs.
    pub spin_us: u64,
    pub park_us: u64,
    /// Wake-ups signalled to a parked peer.
    pub wakes: u64,
    /// Spinning threads moved off a core they shared with another spinner.
    pub moved: u64,
}

impl WaitStats {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &WaitStats) -> WaitStats {
        WaitStats {
            waits: self.waits.saturating_sub(earlier.waits),
            spun: self.spun.saturating_sub(earlier.spun),
            parked: self.parked.saturating_sub(earlier.parked),
            spin_us: self.spin_us.saturating_sub(earlier.spin_us),
            park_us: self.park_us.saturating_sub(earlier.park_us),
            wakes: self.wakes.saturating_sub(earlier.wakes),
            moved: self.moved.saturating_sub(earlier.moved),
        }
    }

    /// `self` and `other` together (counts taken in slices).
    pub fn plus(&self, other: &WaitStats) -> WaitStats {
        WaitStats {
            waits: self.waits + other.waits,
            spun: self.spun + other.spun,
            parked: self.parked + other.parked,
            spin_us: self.spin_us + other.spin_us,
            park_us: self.park_us + other.park_us,
            wakes: self.wakes + other.wakes,
            moved: self.moved + other.moved,
        }
    }
}

/// Starts counting (for the rest of the process's life).
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

/// The counts so far (zero unless [`enable`]d).
pub fn snapshot() -> WaitStats {
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    WaitStats {
        waits: get(&WAITS),
        spun: get(&SPUN),
        parked: get(&PARKED),
        spin_us: get(&SPIN_NS) / 1000,
        park_us: get(&PARK_NS) / 1000,
        wakes: get(&WAKES),
        moved: get(&MOVED),
    }
}

#[inline]
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A wait that found its ring not ready ended while spinning (`spun`) or after parking, having
/// spun for `spin` and been parked for `park`.
pub(crate) fn wait(spun: bool, spin: Duration, park: Duration) {
    if !on() {
        return;
    }
    add(&WAITS, 1);
    add(if spun { &SPUN } else { &PARKED }, 1);
    add(&SPIN_NS, spin.as_nanos() as u64);
    add(&PARK_NS, park.as_nanos() as u64);
}

/// A parked peer was signalled.
pub(crate) fn woke() {
    if on() {
        add(&WAKES, 1);
    }
}

/// A spinning thread moved off a core it shared with another spinner.
pub(crate) fn moved() {
    if on() {
        add(&MOVED, 1);
    }
}
