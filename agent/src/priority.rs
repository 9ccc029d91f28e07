//! Call priorities: which request a busy callee serves first, and which lane a request and
//! its reply travel on.
//!
//! A [`Priority`] is a small integer from [`Priority::LOWEST`] (-8) to [`Priority::HIGHEST`]
//! (7); calls are [`Priority::NORMAL`] (0) unless said otherwise. Every call form takes the
//! priority in force on the calling thread: set it for a block with [`with_priority`] (which
//! covers `rpc_sync`/`rpc_async`/`remote`, the RRef proxies, `to_here`, and everything built on
//! them, such as distributed autograd), or give a handle one with
//! [`Agent::with_priority`](crate::Agent::with_priority). A synchronous handler runs at its
//! request's priority, so the calls it makes inherit it.
//!
//! What a priority changes:
//! - **On the callee**, requests waiting for a handler slot are taken highest first, first in
//!   first out within a priority, with aging: once a request is the first waiting at its
//!   priority, at most [`AGING_PASSES`] requests that arrived after it are served before it
//!   (see [`crate::pool`]); so nothing starves under a flood of higher priorities. Control
//!   messages of the RRef protocol and heartbeats never wait for a slot. A quick handler that
//!   would run inline on the reading thread (taking no slot) does so only while no request of
//!   a higher priority waits for one; it may overtake waiting requests of its own priority.
//! - **On the wire**, a call above normal travels on the peer pair's *express pipe*, a second
//!   pipe opened on first use, and its reply comes back on it: a small urgent call never waits
//!   behind a bulk tensor on the normal pipe. Calls at or below normal share the normal pipe.
//!   Order is kept among calls on one pipe (all priorities up to normal; all above it), not
//!   across the two.

use std::cell::Cell;

use serde::{Deserialize, Serialize};

/// How urgent a call is (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Priority(i8);

/// The first request waiting at a priority is passed over by at most this many requests that
/// arrived after it; then it is served before any request newer than it.
pub const AGING_PASSES: u64 = 32;

impl Priority {
    pub const LOWEST: Priority = Priority(-8);
    pub const LOW: Priority = Priority(-4);
    pub const NORMAL: Priority = Priority(0);
    pub const HIGH: Priority = Priority(4);
    pub const HIGHEST: Priority = Priority(7);
    /// How many priorities there are.
    pub const LEVELS: usize = 16;

    /// The priority `level`, if it lies in `LOWEST..=HIGHEST`.
    pub const fn new(level: i8) -> Option<Priority> {
        if level >= Self::LOWEST.0 && level <= Self::HIGHEST.0 {
            Some(Priority(level))
        } else {
            None
        }
    }

    pub const fn level(self) -> i8 {
        self.0
    }

    /// 0 for the lowest priority, `LEVELS - 1` for the highest.
    pub(crate) const fn index(self) -> usize {
        (self.0 - Self::LOWEST.0) as usize
    }

    /// Whether calls at this priority take the express pipe.
    pub(crate) const fn express(self) -> bool {
        self.0 > Self::NORMAL.0
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

thread_local! {
    static CURRENT: Cell<Priority> = const { Cell::new(Priority::NORMAL) };
}

/// The priority calls made on this thread get now.
pub fn current() -> Priority {
    CURRENT.get()
}

/// Sets the priority of calls made on this thread from now on and returns the previous one
/// (for bindings whose scopes are not Rust closures; prefer [`with_priority`]).
pub fn set_current(priority: Priority) -> Priority {
    CURRENT.replace(priority)
}

/// Runs `f` with calls made on this thread at `priority`; the previous priority comes back
/// afterwards, even if `f` panics.
pub fn with_priority<R>(priority: Priority, f: impl FnOnce() -> R) -> R {
    let _restore = Restore(CURRENT.replace(priority));
    f()
}

struct Restore(Priority);

impl Drop for Restore {
    fn drop(&mut self) {
        CURRENT.set(self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_and_scope() {
        assert_eq!(Priority::new(-8), Some(Priority::LOWEST));
        assert_eq!(Priority::new(7), Some(Priority::HIGHEST));
        assert_eq!(Priority::new(8), None);
        assert_eq!(Priority::new(-9), None);
        assert_eq!(Priority::LOWEST.index(), 0);
        assert_eq!(Priority::HIGHEST.index(), Priority::LEVELS - 1);
        assert!(Priority::HIGH.express() && !Priority::NORMAL.express() && !Priority::LOW.express());
        assert_eq!(current(), Priority::NORMAL);
        let inner = with_priority(Priority::HIGH, || {
            let nested = with_priority(Priority::LOW, current);
            (current(), nested)
        });
        assert_eq!(inner, (Priority::HIGH, Priority::LOW));
        assert_eq!(current(), Priority::NORMAL);
        let _ = std::panic::catch_unwind(|| with_priority(Priority::HIGHEST, || panic!("boom")));
        assert_eq!(current(), Priority::NORMAL);
    }
}
