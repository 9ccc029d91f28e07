//! The handler pool: threads that run synchronous handlers, taking waiting requests by
//! priority (first in, first out within one) with aging (see [`crate::priority`]).
//!
//! A handler may block (a nested `rpc_sync`, `to_here`, waiting on a future). A pool thread
//! that is about to block hands its slot over: if fewer than `size` threads would be left
//! runnable, a new thread starts first. So however small the pool, blocked handlers never keep
//! new requests (for instance the nested call that would unblock them) from running. Extra
//! threads leave once the pool is back above its size and they are idle.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::priority::{Priority, AGING_PASSES};

type Job = Box<dyn FnOnce() + Send>;

/// Idle threads above the pool size leave after this long without work.
const SURPLUS_IDLE: Duration = Duration::from_millis(500);
/// A thread that finished a job looks for the next one this long before sleeping.
const SPIN: Duration = Duration::from_micros(20);

thread_local! {
    static CURRENT: RefCell<Option<Weak<Inner>>> = const { RefCell::new(None) };
    /// Set while a handler may run inline on the runtime thread that read its request: what
    /// to do before that handler blocks (hand the pipe's read role to a new reader).
    static HAND_OFF: RefCell<Option<Arc<dyn HandOff>>> = const { RefCell::new(None) };
    /// Whether this (runtime worker) thread is inside [`inline`].
    static INLINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether the job running on this thread has blocked (see [`blocking`]).
    static BLOCKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `work` on a runtime worker thread that is reading a pipe, with `hand_off` to run
/// first if a handler inside blocks (through [`blocking`]): then the read role goes to a new
/// reader, and the runtime moves this worker's other tasks to another thread while this one
/// waits. Returns `work`'s result and whether the hand-off ran.
pub(crate) fn inline<R>(hand_off: Arc<dyn HandOff>, work: impl FnOnce() -> R) -> (R, bool) {
    HAND_OFF.with(|h| *h.borrow_mut() = Some(hand_off));
    let outer = INLINE.replace(true);
    let r = work();
    INLINE.set(outer);
    let handed = HAND_OFF.with(|h| h.borrow_mut().take()).is_none();
    (r, handed)
}

/// What a handler running [`inline`] does before it blocks: hand its pipe to a new reader.
/// A shared object rather than a closure, so that setting it up per request allocates nothing.
pub(crate) trait HandOff: Send + Sync {
    fn hand_off(self: Arc<Self>);
}

/// Whether this thread is inside [`inline`]: a synchronous handler may run right here.
pub(crate) fn may_inline() -> bool {
    INLINE.get()
}

/// Runs `job`, telling whether it blocked (called [`blocking`]).
pub(crate) fn measured<R>(job: impl FnOnce() -> R) -> (R, bool) {
    let outer = BLOCKED.replace(false);
    let r = job();
    let blocked = BLOCKED.get();
    BLOCKED.set(outer || blocked);
    (r, blocked)
}

#[derive(Default)]
struct Counts {
    threads: usize,
    blocked: usize,
    stopped: bool,
}

/// A job waiting for a thread, and when it arrived.
struct Waiting {
    job: Job,
    seq: u64,
}

/// The jobs waiting for a thread, one first-in first-out queue per priority.
struct Queue {
    levels: [VecDeque<Waiting>; Priority::LEVELS],
    /// Per priority: how many jobs that arrived after its first waiting job were taken before
    /// it (reset when that job is taken).
    passed: [u64; Priority::LEVELS],
    /// Jobs queued so far (arrival numbers).
    arrived: u64,
    /// Bit `i` set: `levels[i]` is not empty.
    occupied: u32,
    /// Threads asleep on `ready`.
    sleepers: usize,
    /// Every pool handle is gone: threads leave once the queue is empty.
    closed: bool,
}

impl Queue {
    fn new() -> Queue {
        Queue {
            levels: Default::default(),
            passed: [0; Priority::LEVELS],
            arrived: 0,
            occupied: 0,
            sleepers: 0,
            closed: false,
        }
    }

    fn push(&mut self, priority: Priority, job: Job) {
        let seq = self.arrived;
        self.arrived += 1;
        self.levels[priority.index()].push_back(Waiting { job, seq });
        self.occupied |= 1 << priority.index();
    }

    /// The next job: the first of the highest priority, unless the first job of some priority
    /// has been passed over by [`AGING_PASSES`] newer jobs; then the oldest such job.
    fn pop(&mut self) -> Option<Job> {
        let heads = || {
            self.levels
                .iter()
                .enumerate()
                .filter_map(|(i, q)| q.front().map(|w| (i, w.seq)))
        };
        let overdue = heads()
            .filter(|&(i, _)| self.passed[i] >= AGING_PASSES)
            .min_by_key(|&(_, seq)| seq)
            .map(|(i, _)| i);
        let level = overdue.or_else(|| self.levels.iter().rposition(|q| !q.is_empty()))?;
        let taken = self.levels[level].pop_front()?;
        if self.levels[level].is_empty() {
            self.occupied &= !(1 << level);
        }
        self.passed[level] = 0;
        for (i, q) in self.levels.iter().enumerate() {
            if q.front().is_some_and(|w| w.seq < taken.seq) {
                self.passed[i] += 1;
            }
        }
        Some(taken.job)
    }
}

/// What the threads share: the queue and its counters.
struct Jobs {
    queue: Mutex<Queue>,
    ready: Condvar,
    /// Jobs waiting (read without the lock by spinning threads and by [`Pool::waiting`]).
    len: AtomicUsize,
    /// Bit `i` set: jobs of priority index `i` are waiting (for [`Pool::waiting_above`]).
    levels: std::sync::atomic::AtomicU32,
}

impl Jobs {
    /// Queues `job` in `q` (locked) and publishes the counters.
    fn push(&self, q: &mut Queue, priority: Priority, job: Job) {
        q.push(priority, job);
        self.len.fetch_add(1, Ordering::AcqRel);
        self.levels.store(q.occupied, Ordering::Release);
    }

    /// Takes the next job from `q` (locked) and publishes the counters.
    fn pop(&self, q: &mut Queue) -> Option<Job> {
        let job = q.pop()?;
        self.len.fetch_sub(1, Ordering::AcqRel);
        self.levels.store(q.occupied, Ordering::Release);
        Some(job)
    }

    /// The next job, looking under the lock only when the counter says there is one.
    fn try_pop(&self) -> Option<Job> {
        if self.len.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.pop(&mut self.queue.lock().unwrap())
    }
}

struct Inner {
    name: String,
    size: usize,
    jobs: Arc<Jobs>,
    counts: Mutex<Counts>,
}

impl Drop for Inner {
    /// The last handle is gone: threads finish the queue and leave.
    fn drop(&mut self) {
        self.jobs.queue.lock().unwrap().closed = true;
        self.jobs.ready.notify_all();
    }
}

/// A pool of handler threads taking jobs by priority (see [`crate::priority`]). Dropping the
/// last handle stops the threads once the queue is empty.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

impl Pool {
    pub fn new(name: &str, size: usize) -> Pool {
        let size = size.max(1);
        let jobs = Arc::new(Jobs {
            queue: Mutex::new(Queue::new()),
            ready: Condvar::new(),
            len: AtomicUsize::new(0),
            levels: std::sync::atomic::AtomicU32::new(0),
        });
        let inner = Arc::new(Inner {
            name: name.to_owned(),
            size,
            jobs,
            counts: Mutex::new(Counts::default()),
        });
        for _ in 0..size {
            spawn_thread(&inner);
        }
        Pool { inner }
    }

    /// Queues `job` at normal priority.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) {
        self.submit_at(Priority::NORMAL, job)
    }

    /// Queues `job` at `priority`: it runs before jobs of lower priority queued earlier or
    /// later, after those of its own priority queued earlier (but see aging, in
    /// [`crate::priority`]).
    pub fn submit_at(&self, priority: Priority, job: impl FnOnce() + Send + 'static) {
        let jobs = &self.inner.jobs;
        let wake = {
            let mut q = jobs.queue.lock().unwrap();
            jobs.push(&mut q, priority, Box::new(job));
            q.sleepers > 0
        };
        if wake {
            jobs.ready.notify_one();
        }
    }

    /// Jobs waiting for a thread now.
    pub fn waiting(&self) -> usize {
        self.inner.jobs.len.load(Ordering::Acquire)
    }

    /// Whether jobs of a priority above `priority` are waiting now.
    pub fn waiting_above(&self, priority: Priority) -> bool {
        let above = !((2u32 << priority.index()) - 1);
        self.inner.jobs.levels.load(Ordering::Acquire) & above != 0
    }

    /// Threads now running (including those blocked in a handler).
    pub fn threads(&self) -> usize {
        self.inner.counts.lock().unwrap().threads
    }

    /// Stops the threads after the jobs already queued.
    pub fn stop(&self) {
        self.inner.counts.lock().unwrap().stopped = true;
    }
}

fn spawn_thread(inner: &Arc<Inner>) {
    inner.counts.lock().unwrap().threads += 1;
    let weak = Arc::downgrade(inner);
    let jobs = inner.jobs.clone();
    let name = inner.name.clone();
    let spawned = std::thread::Builder::new().name(name).spawn(move || run(weak, jobs));
    if spawned.is_err() {
        inner.counts.lock().unwrap().threads -= 1;
        tracing::error!("could not start a handler thread");
    }
}

fn run(weak: Weak<Inner>, jobs: Arc<Jobs>) {
    CURRENT.with(|c| *c.borrow_mut() = Some(weak.clone()));
    while let Some(job) = next_job(&weak, &jobs) {
        job();
    }
    if let Some(inner) = weak.upgrade() {
        inner.counts.lock().unwrap().threads -= 1;
    }
}

/// The next job, or `None` when this thread should leave.
fn next_job(weak: &Weak<Inner>, jobs: &Jobs) -> Option<Job> {
    let start = Instant::now();
    while start.elapsed() < SPIN {
        if let Some(j) = jobs.try_pop() {
            return Some(j);
        }
        std::hint::spin_loop();
    }
    let mut q = jobs.queue.lock().unwrap();
    loop {
        if let Some(j) = jobs.pop(&mut q) {
            return Some(j);
        }
        if q.closed {
            return None;
        }
        q.sleepers += 1;
        let (guard, wait) = jobs.ready.wait_timeout(q, SURPLUS_IDLE).unwrap();
        q = guard;
        q.sleepers -= 1;
        if wait.timed_out() && q.occupied == 0 {
            // Not holding the queue: dropping the last handle to `Inner` (teardown) locks it.
            drop(q);
            let inner = weak.upgrade()?;
            let leave = {
                let c = inner.counts.lock().unwrap();
                c.stopped || c.threads - c.blocked > inner.size
            };
            drop(inner);
            if leave {
                return None;
            }
            q = jobs.queue.lock().unwrap();
        }
    }
}

/// Runs `f`, which may block for long. Wrap waits on your own primitives in it inside a
/// handler. On a pool thread, a replacement thread starts first if the pool would otherwise
/// drop below its size of runnable threads. In a handler running inline on the thread that
/// read its request, the pipe's read role goes to a new reader first (so later requests from
/// the same caller are served meanwhile) and the runtime's other work moves to another thread.
/// Anywhere else it just runs `f`.
pub fn blocking<R>(f: impl FnOnce() -> R) -> R {
    BLOCKED.set(true);
    if INLINE.get() {
        // A handler inline on a runtime thread: another reader takes the pipe (once), and the
        // runtime moves this worker's other tasks elsewhere while we wait.
        if let Some(hand_off) = HAND_OFF.with(|h| h.borrow_mut().take()) {
            hand_off.hand_off();
        }
        return tokio::task::block_in_place(f);
    }
    let inner = CURRENT.with(|c| c.borrow().as_ref().and_then(Weak::upgrade));
    let Some(inner) = inner else { return f() };
    let spawn = {
        let mut c = inner.counts.lock().unwrap();
        c.blocked += 1;
        !c.stopped && c.threads - c.blocked < inner.size
    };
    if spawn {
        spawn_thread(&inner);
    }
    let r = f();
    inner.counts.lock().unwrap().blocked -= 1;
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn blocked_jobs_do_not_starve_the_pool() {
        // Pool of one: the first job blocks until the second has run. Without hand-over this
        // deadlocks.
        let pool = Pool::new("test-pool", 1);
        let (tx, rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel();
        let d1 = done_tx.clone();
        pool.submit(move || {
            blocking(|| rx.recv().unwrap());
            d1.send(1).unwrap();
        });
        pool.submit(move || {
            tx.send(()).unwrap();
            done_tx.send(2).unwrap();
        });
        let mut got = vec![
            done_rx.recv_timeout(Duration::from_secs(10)).unwrap(),
            done_rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        ];
        got.sort();
        assert_eq!(got, vec![1, 2]);
        assert!(pool.threads() >= 1);
    }

    /// One thread, held busy while jobs of mixed priorities queue: they run highest first,
    /// in arrival order within a priority.
    #[test]
    fn jobs_run_by_priority_then_arrival() {
        let pool = Pool::new("test-pool", 1);
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (started_tx, started_rx) = mpsc::channel::<()>();
        pool.submit(move || {
            started_tx.send(()).unwrap();
            go_rx.recv().unwrap();
        });
        started_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let (done_tx, done_rx) = mpsc::channel();
        let levels = [0i8, 4, -4, 4, 0, 7, -8, 0];
        for (i, &level) in levels.iter().enumerate() {
            let (order, done) = (order.clone(), done_tx.clone());
            pool.submit_at(Priority::new(level).unwrap(), move || {
                order.lock().unwrap().push((level, i));
                done.send(()).unwrap();
            });
        }
        assert_eq!(pool.waiting(), levels.len());
        assert!(pool.waiting_above(Priority::HIGH) && !pool.waiting_above(Priority::HIGHEST));
        assert!(pool.waiting_above(Priority::LOWEST));
        go_tx.send(()).unwrap();
        for _ in &levels {
            done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        let got = order.lock().unwrap().clone();
        assert_eq!(
            got,
            vec![(7, 5), (4, 1), (4, 3), (0, 0), (0, 4), (0, 7), (-4, 2), (-8, 6)]
        );
    }

    /// Aging: under a steady flood of high-priority jobs, a low one queued first runs once
    /// AGING_PASSES jobs that came after it have run, not after the flood.
    #[test]
    fn a_low_job_is_not_starved_by_a_flood() {
        let mut q = Queue::new();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let job = |name: u64| -> Job {
            let ran = ran.clone();
            Box::new(move || ran.lock().unwrap().push(name))
        };
        q.push(Priority::LOWEST, job(u64::MAX));
        // Keep two high-priority jobs queued at every step, as a flood would.
        let mut next = 0;
        for _ in 0..2 {
            q.push(Priority::HIGHEST, job(next));
            next += 1;
        }
        for _ in 0..(AGING_PASSES as usize + 10) {
            q.pop().unwrap()();
            q.push(Priority::HIGHEST, job(next));
            next += 1;
        }
        let ran = ran.lock().unwrap();
        let low_at = ran
            .iter()
            .position(|&n| n == u64::MAX)
            .expect("the low job ran under the flood");
        assert_eq!(low_at as u64, AGING_PASSES, "{ran:?}");
    }

    /// Aging counts only being overtaken: a long first-in first-out backlog of one priority
    /// does not make its jobs overdue, so a new urgent job still goes first.
    #[test]
    fn a_backlog_does_not_age_past_an_urgent_job() {
        let mut q = Queue::new();
        let ran = Arc::new(Mutex::new(Vec::new()));
        for i in 0..1000u64 {
            let ran = ran.clone();
            q.push(Priority::NORMAL, Box::new(move || ran.lock().unwrap().push(i)));
        }
        for _ in 0..100 {
            q.pop().unwrap()();
        }
        let r = ran.clone();
        q.push(Priority::HIGH, Box::new(move || r.lock().unwrap().push(u64::MAX)));
        q.pop().unwrap()();
        assert_eq!(ran.lock().unwrap().last(), Some(&u64::MAX));
    }
}
