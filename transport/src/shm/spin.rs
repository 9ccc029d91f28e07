//! Whether a waiter may spin: only while spinning pays.
//!
//! On this machine kind a wake-up across cores costs tens of microseconds, so a waiter whose
//! peer answers sooner should spin (up to [`ShmOptions::spin`](super::ShmOptions::spin), which
//! should sit near that wake-up cost). But a spinner occupies a core: two of them on a
//! two-core host are a ping-pong at memory speed, a third preempts one of the first two (and
//! with it the peer it was waiting for). So the processes of this user on the host (sharing
//! `/dev/shm`) share one slot per core this process may use
//! ([`std::thread::available_parallelism`], which honours affinity and cgroup quotas; at most
//! 16), and a waiter spins only in a free slot, which holds its pid while it spins; the others
//! park at once. Sixteen or sixty-four workers on two cores then make progress instead of
//! spinning against each other, while one busy pair keeps its spinning latency.
//!
//! A process killed while it spins leaves its pid in a slot: when every slot is taken, a waiter
//! (at most once per [`RECLAIM_PERIOD`] per process) frees the slots of processes that no
//! longer exist. Where the slots cannot be mapped, waiters spin as configured.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{stats, sys};

/// How often one process looks for slots left by dead processes.
pub(crate) const RECLAIM_PERIOD: Duration = Duration::from_millis(100);

/// Permission to spin, given back on drop.
pub(crate) struct SpinSlot(Option<&'static AtomicU32>);

impl Drop for SpinSlot {
    fn drop(&mut self) {
        if let Some(slot) = self.0 {
            slot.store(0, Ordering::Release);
        }
    }
}

fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(16))
}

/// This process's id, asked of the kernel once (it is a system call, and waiters ask often).
/// A child forked from this process that goes on waiting would mark slots with its parent's
/// pid: they are still given back when its waits end, and only the reclaiming of a crashed
/// child's slots waits for the parent too.
fn pid() -> u32 {
    static PID: OnceLock<u32> = OnceLock::new();
    *PID.get_or_init(std::process::id)
}

/// How long a `sched_yield` in a spin takes when another spinner shares the core: that one's
/// turn until its own yield, 10–40 µs here (a yield that returns at once takes about a
/// microsecond). A thread that computes rather than spins keeps the core it was yielded for
/// its whole time slice (0.75 ms and up): a spinner sharing a core with work does not move
/// (it would only move next to other work; the distributed step lost 4–6% when it did).
pub(crate) const SPINNER_TURN: std::ops::Range<Duration> = Duration::from_micros(5)..Duration::from_micros(300);

/// How many spinning waits in a row of one thread must each have yielded its core to another
/// spinner before the thread moves (see [`step_aside`]): two spinners on one core do so at
/// every wait, while a short-lived thread woken on a spinner's core does so once.
const SHARED_WAITS: u32 = 8;

/// A spinning wait of this thread ended; `shared`: one of its yields ran another spinner on
/// this core (it took [`SPINNER_TURN`]). After [`SHARED_WAITS`] such waits in a row the thread
/// may step aside: the two spinners of one core count alike and reach the mark a turn apart,
/// so only one of them must move (both moving would share the next core). Each mover tosses a
/// coin (a per-thread xorshift, not the clock: a clock that counts in even steps would always
/// say tails) and then yields once more: only if that yield still gives the core away for a
/// spinner's turn is the other one still here, and it moves.
#[inline]
pub(crate) fn wait_ended(shared: bool) {
    thread_local! {
        static RUN: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    if !shared {
        RUN.set(0);
        return;
    }
    let run = RUN.get() + 1;
    if run < SHARED_WAITS {
        RUN.set(run);
        return;
    }
    RUN.set(0);
    if coin() {
        let now = Instant::now();
        std::thread::yield_now();
        if SPINNER_TURN.contains(&now.elapsed()) {
            step_aside();
        }
    }
}

/// A fair coin of this thread's own: xorshift64, seeded from the address of the thread's
/// state (distinct per live thread) and the clock.
fn coin() -> bool {
    thread_local! {
        static STATE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    STATE.with(|s| {
        let mut x = s.get();
        if x == 0 {
            let nanos = Instant::now()
                .duration_since(*BASE.get_or_init(Instant::now))
                .as_nanos() as u64;
            x = (s as *const _ as u64) ^ nanos.rotate_left(32) | 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x >> 63 == 1
    })
}

/// The clock's origin for [`coin`]'s seed.
static BASE: OnceLock<Instant> = OnceLock::new();

/// Moves the calling thread, found sharing its core with another spinner, to the
/// next core it may run on, then gives it back the cores it had (it stays where it moved). Two
/// spinners the scheduler left on one core stay there: each is always runnable and neither
/// ever sleeps, so neither is placed again, while another core may sit idle; they then take
/// turns at each yield, a whole turn per message (33 µs round trips on this machine kind
/// instead of 0.9). At most once per millisecond per thread; nothing where the thread may run
/// on one core only, or where the calls fail. Returns the core it moved to.
///
/// The mask given back is the one in effect before the move (the cpuset and the online cores
/// applied), and only if the thread's mask is still the one-core mask of the move: a mask
/// someone else set meanwhile is left alone. A failed give-back is retried once, then logged
/// (the thread would stay on the one core).
fn step_aside() -> Option<usize> {
    use nix::sched::{sched_getaffinity, sched_getcpu, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    thread_local! {
        static LAST: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    }
    let now = Instant::now();
    if LAST
        .get()
        .is_some_and(|t| now.duration_since(t) < Duration::from_millis(1))
    {
        return None;
    }
    LAST.set(Some(now));
    let me = Pid::from_raw(0);
    let (Ok(allowed), Ok(here)) = (sched_getaffinity(me), sched_getcpu()) else {
        return None;
    };
    let n = CpuSet::count();
    let there = (1..n)
        .map(|k| (here + k) % n)
        .find(|&c| allowed.is_set(c).unwrap_or(false))?;
    let mut only = CpuSet::new();
    only.set(there).ok()?;
    sched_setaffinity(me, &only).ok()?;
    stats::moved();
    let give_back = || match sched_getaffinity(me) {
        Ok(mask) if mask == only => sched_setaffinity(me, &allowed),
        // Changed meanwhile by someone else: theirs stands.
        _ => Ok(()),
    };
    if let Err(e) = give_back().or_else(|_| give_back()) {
        tracing::warn!(cpu = there, error = %e, "a spinning thread moved off a shared core could not get its cores back");
    }
    Some(there)
}

/// A slot to spin in, if one of this host's is free.
pub(crate) fn try_spin() -> Option<SpinSlot> {
    let Some(slots) = sys::host_spin_slots() else {
        return Some(SpinSlot(None));
    };
    let slots = &slots[..cores()];
    let me = pid();
    if let Some(s) = take(slots, me) {
        return Some(s);
    }
    if reclaim_due() && reclaim(slots, |pid| pid != me && !alive(pid)) > 0 {
        return take(slots, me);
    }
    None
}

/// One of the host's spin slots held by a thread that computes rather than waits (see
/// [`occupy_core`]); given back on drop.
pub struct CoreClaim(#[allow(dead_code)] SpinSlot);

/// Claims a free spin slot for a thread about to compute for long (a slow handler), if one is
/// free; never waits. While the claim lives, waiters on this host see one core fewer to spin
/// on, so they park rather than spin on the core the work runs on: on a two-core host, a
/// caller spinning for a reply and a callee's reader spinning for the next request would
/// otherwise leave the callee's handler one core to share with a spinner. Where the slots
/// cannot be mapped, claims nothing.
pub fn occupy_core() -> Option<CoreClaim> {
    let slots = sys::host_spin_slots()?;
    take(&slots[..cores()], pid()).map(CoreClaim)
}

fn take(slots: &'static [AtomicU32], me: u32) -> Option<SpinSlot> {
    slots.iter().find_map(|s| {
        (s.load(Ordering::Relaxed) == 0 && s.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed).is_ok())
            .then(|| SpinSlot(Some(s)))
    })
}

/// Frees the slots whose holder `dead` says is gone; how many.
fn reclaim(slots: &[AtomicU32], dead: impl Fn(u32) -> bool) -> usize {
    slots
        .iter()
        .filter(|s| {
            let pid = s.load(Ordering::Relaxed);
            pid != 0 && dead(pid) && s.compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed).is_ok()
        })
        .count()
}

fn reclaim_due() -> bool {
    static BASE: OnceLock<Instant> = OnceLock::new();
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = BASE.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1;
    let last = LAST.load(Ordering::Relaxed);
    (last == 0 || now.saturating_sub(last) >= RECLAIM_PERIOD.as_millis() as u64)
        && LAST
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Whether process `pid` exists (signal 0 checks without sending; EPERM means it exists).
fn alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(e) => e != nix::errno::Errno::ESRCH,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(n: usize) -> &'static [AtomicU32] {
        Box::leak((0..n).map(|_| AtomicU32::new(0)).collect::<Vec<_>>().into_boxed_slice())
    }

    /// A thread stepping aside moves to another core it may run on and keeps the cores it
    /// had; a second step within the millisecond does nothing; a thread allowed one core stays.
    #[test]
    fn stepping_aside_moves_the_thread_and_keeps_its_cores() {
        use nix::sched::{sched_getaffinity, sched_getcpu, sched_setaffinity, CpuSet};
        use nix::unistd::Pid;
        let me = Pid::from_raw(0);
        // Both faces of every thread's coin come up.
        let tosses: Vec<bool> = (0..64).map(|_| coin()).collect();
        assert!(tosses.contains(&true) && tosses.contains(&false), "{tosses:?}");
        let allowed = sched_getaffinity(me).expect("affinity");
        let cores: Vec<usize> = (0..CpuSet::count())
            .filter(|&c| allowed.is_set(c).unwrap_or(false))
            .collect();
        std::thread::spawn(move || {
            if cores.len() < 2 {
                eprintln!("skipped the move: this thread may run on one core only");
            } else {
                let start = Instant::now();
                let there = step_aside().expect("a second core to move to");
                assert!(cores.contains(&there), "moved to core {there}, one it may run on");
                assert_eq!(sched_getaffinity(me).expect("affinity"), allowed, "cores kept");
                let again = step_aside();
                // (Unless this thread lost its core for the whole millisecond meanwhile.)
                if start.elapsed() < Duration::from_millis(1) {
                    assert_eq!(again, None, "at most one move a millisecond");
                }
            }
            // Allowed one core: nothing to move to, and that core is kept.
            std::thread::sleep(Duration::from_millis(2));
            let mut one = CpuSet::new();
            one.set(cores[0]).expect("set");
            sched_setaffinity(me, &one).expect("pin");
            assert_eq!(step_aside(), None, "nowhere to move");
            assert_eq!(sched_getcpu().expect("cpu"), cores[0]);
            assert_eq!(sched_getaffinity(me).expect("affinity"), one);
        })
        .join()
        .expect("the stepping thread");
    }

    #[test]
    fn at_most_one_spinner_per_slot() {
        let s = slots(2);
        let a = take(s, 7).expect("first");
        let b = take(s, 7).expect("second");
        assert!(take(s, 7).is_none(), "a third would take a busy core");
        drop(a);
        let again = take(s, 8).expect("a slot freed");
        drop((b, again));
        assert!(s.iter().all(|x| x.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn slots_of_dead_processes_are_reclaimed() {
        let s = slots(2);
        // Two processes died mid-spin; one of them is still alive.
        s[0].store(1111, Ordering::Relaxed);
        s[1].store(2222, Ordering::Relaxed);
        assert!(take(s, 7).is_none());
        assert_eq!(reclaim(s, |pid| pid == 1111), 1);
        assert_eq!(s[1].load(Ordering::Relaxed), 2222, "a live holder keeps its slot");
        let slot = take(s, 7).expect("the dead one's slot");
        drop(slot);
        // This process is alive; a pid far beyond pid_max is not.
        assert!(alive(std::process::id()));
        assert!(!alive(u32::MAX - 1));
    }

    #[test]
    fn the_host_slots_are_mapped() {
        if let Some(host) = sys::host_spin_slots() {
            assert_eq!(host.len(), 16);
            if let Some(slot) = try_spin() {
                drop(slot);
            }
        }
    }
}
