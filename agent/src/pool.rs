//! The handler pool: threads that run synchronous handlers.
//!
//! A handler may block (a nested `rpc_sync`, `to_here`, waiting on a future). A pool thread
//! that is about to block hands its slot over: if fewer than `size` threads would be left
//! runnable, a new thread starts first. So however small the pool, blocked handlers never keep
//! new requests (for instance the nested call that would unblock them) from running. Extra
//! threads leave once the pool is back above its size and they are idle.

use std::cell::RefCell;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};

type Job = Box<dyn FnOnce() + Send>;

/// Idle threads above the pool size leave after this long without work.
const SURPLUS_IDLE: Duration = Duration::from_millis(500);
/// A thread that finished a job looks for the next one this long before sleeping.
const SPIN: Duration = Duration::from_micros(20);

thread_local! {
    static CURRENT: RefCell<Option<Weak<Inner>>> = const { RefCell::new(None) };
    /// Set while a handler may run inline on the runtime thread that read its request: what
    /// to do before that handler blocks (hand the pipe's read role to a new reader).
    static HAND_OFF: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
    /// Whether this (runtime worker) thread is inside [`inline`].
    static INLINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether the job running on this thread has blocked (see [`blocking`]).
    static BLOCKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `work` on a runtime worker thread that is reading a pipe, with `hand_off` to run
/// first if a handler inside blocks (through [`blocking`]): then the read role goes to a new
/// reader, and the runtime moves this worker's other tasks to another thread while this one
/// waits. Returns `work`'s result and whether the hand-off ran.
pub(crate) fn inline<R>(hand_off: impl FnOnce() + 'static, work: impl FnOnce() -> R) -> (R, bool) {
    HAND_OFF.with(|h| *h.borrow_mut() = Some(Box::new(hand_off)));
    let outer = INLINE.replace(true);
    let r = work();
    INLINE.set(outer);
    let handed = HAND_OFF.with(|h| h.borrow_mut().take()).is_none();
    (r, handed)
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

struct Inner {
    name: String,
    size: usize,
    jobs: Receiver<Job>,
    counts: Mutex<Counts>,
}

/// A pool of handler threads. Dropping the last handle stops the threads once the queue is
/// empty.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
    sender: Sender<Job>,
}

impl Pool {
    pub fn new(name: &str, size: usize) -> Pool {
        let size = size.max(1);
        let (sender, jobs) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            name: name.to_owned(),
            size,
            jobs,
            counts: Mutex::new(Counts::default()),
        });
        for _ in 0..size {
            spawn_thread(&inner);
        }
        Pool { inner, sender }
    }

    /// Queues `job`.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) {
        // The receiver lives in `inner`, which we hold, so sending cannot fail.
        let _ = self.sender.send(Box::new(job));
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

fn run(weak: Weak<Inner>, jobs: Receiver<Job>) {
    CURRENT.with(|c| *c.borrow_mut() = Some(weak.clone()));
    loop {
        let job = match next_job(&weak, &jobs) {
            Some(j) => j,
            None => break,
        };
        job();
    }
    if let Some(inner) = weak.upgrade() {
        inner.counts.lock().unwrap().threads -= 1;
    }
}

/// The next job, or `None` when this thread should leave.
fn next_job(weak: &Weak<Inner>, jobs: &Receiver<Job>) -> Option<Job> {
    let start = Instant::now();
    loop {
        match jobs.try_recv() {
            Ok(j) => return Some(j),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) if start.elapsed() < SPIN => std::hint::spin_loop(),
            Err(TryRecvError::Empty) => break,
        }
    }
    loop {
        match jobs.recv_timeout(SURPLUS_IDLE) {
            Ok(j) => return Some(j),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return None,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                let inner = weak.upgrade()?;
                let c = inner.counts.lock().unwrap();
                if c.stopped || c.threads - c.blocked > inner.size {
                    return None;
                }
            }
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
            hand_off();
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
}
