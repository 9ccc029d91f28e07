//! Whether a waiter may spin: only while spinning pays.
//!
//! On this machine kind a wake-up across cores costs tens of microseconds, so a waiter whose
//! peer answers sooner should spin (up to [`ShmOptions::spin`](super::ShmOptions::spin), which
//! should sit near that wake-up cost). But a spinner occupies a core: two of them on a
//! two-core host are a ping-pong at memory speed, a third preempts one of the first two (and
//! with it the peer it was waiting for). So the threads of every process of this user on the
//! host (sharing `/dev/shm`) count their spinners in one shared word, and a waiter spins only
//! while fewer threads spin than this process may use cores
//! ([`std::thread::available_parallelism`], which honours affinity and cgroup quotas); the
//! others park at once. Sixteen or sixty-four workers on two cores then make progress instead of
//! spinning against each other, while one busy pair keeps its spinning latency.
//!
//! Where the shared word cannot be mapped, waiters spin as configured. A process killed in the
//! middle of a spin leaves the count one too high until the machine's `/dev/shm` is cleared:
//! fewer threads spin, nothing else changes.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use super::sys;

/// Permission to spin, given back on drop.
pub(crate) struct SpinSlot(Option<&'static AtomicU32>);

impl Drop for SpinSlot {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

fn cores() -> u32 {
    static CORES: OnceLock<u32> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32))
}

/// A slot to spin in, if fewer threads of this host spin than there are cores.
pub(crate) fn try_spin() -> Option<SpinSlot> {
    take(sys::host_spinners(), cores())
}

fn take(counter: Option<&'static AtomicU32>, cores: u32) -> Option<SpinSlot> {
    let Some(c) = counter else {
        return Some(SpinSlot(None));
    };
    c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < cores).then_some(n + 1))
        .ok()
        .map(|_| SpinSlot(Some(c)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_one_spinner_per_core() {
        let c: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
        let a = take(Some(c), 2).expect("first");
        let b = take(Some(c), 2).expect("second");
        assert!(take(Some(c), 2).is_none(), "a third would take a busy core");
        drop(a);
        let again = take(Some(c), 2).expect("a slot freed");
        drop((b, again));
        assert_eq!(c.load(Ordering::Relaxed), 0);
        assert!(take(None, 2).is_some(), "no shared word: spin as configured");
    }

    #[test]
    fn the_host_counter_is_mapped() {
        // On this machine `/dev/shm` exists: the word is mapped and slots come back.
        if let Some(c) = sys::host_spinners() {
            let before = c.load(Ordering::Relaxed);
            if let Some(slot) = try_spin() {
                drop(slot);
            }
            // Other tests may spin meanwhile; our own slot was returned.
            let _ = before;
        }
    }
}
