//! The read role of one outgoing pipe: who reads the replies.
//!
//! A thread blocked in `rpc_sync` (or [`Completion::wait`](crate::Completion::wait)) reads its
//! own reply when no one else is reading that pipe: it takes the role, reads (delivering every
//! reply that arrives meanwhile, its own included) until its result is in, and hands the role
//! on. So a call from a plain thread costs no thread hand-off: the thread that wrote the
//! request is the one that spins on the reply. Threads that find the role taken queue as
//! followers and sleep until their result arrives (read by the leader) or the role is handed
//! to them. A background task reads only while no thread does: it listens when the role is
//! free and a task awaits a reply (or on its idle tick, which also reads replies nobody waits
//! for, pongs and goodbyes), and gives way between messages to a thread that asks for the role.
//! A thread that leaves does not wake it unless a task awaits a reply: the thread is likely to
//! come back for its next reply at once, and a wake-up per call costs more than the call. That relies on
//! the wait for the next message ([`Replies::read_ready`], over `Pipe::read_message_ready`)
//! being cancel-safe: it can be abandoned without harming the pipe (the transport's
//! `readable` is, part of its contract, tested by the conformance suite; nothing is awaited
//! once a message is taken).
//!
//! The role's state is a small table behind one lock (held for a few instructions, never
//! across a wait); the reading itself happens outside it. `Replies` is the narrow interface
//! to the agent: read one message and deliver it, report a failed pipe, say whether replies
//! are wanted.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use sluice_channel::Pipe;

use crate::completion::Driver;
use crate::role::{Ask, Pass, Role};

/// A dormant background reader looks again this often (a pipe that failed or a peer's goodbye
/// on an idle pipe is noticed within it).
const IDLE_TICK: Duration = Duration::from_millis(50);
/// A follower spins this long on its result before sleeping.
const FOLLOWER_SPIN: Duration = Duration::from_micros(10);

/// What the reader needs from the agent.
pub(crate) trait Replies: Send + Sync + 'static {
    /// Reads one whole message from `pipe` and delivers it (a reply completes its call). An
    /// error means the pipe is unusable; the reader then ends it with [`failed`](Self::failed).
    fn read_one<'a>(&'a self, pipe: &'a Pipe) -> impl Future<Output = Result<(), String>> + Send + 'a;
    /// Waits until the next message begins to arrive, then reads and delivers it at once if it
    /// is here whole and small (`true`); `false` (nothing read) when it needs
    /// [`read_one`](Self::read_one). **Cancel-safe:** the wait consumes nothing, and nothing is
    /// awaited once a message is taken. An error means the pipe is unusable, as for `read_one`.
    fn read_ready<'a>(&'a self, pipe: &'a Pipe) -> impl Future<Output = Result<bool, String>> + Send + 'a;
    /// The pipe failed: fail what depended on it (declare the peer lost).
    fn failed(&self, detail: String);
    /// Whether replies are expected (calls are pending to the peer).
    fn wanted(&self) -> bool;
    /// The runtime that drives the pipe's I/O (a leading thread blocks on it).
    fn runtime(&self) -> &tokio::runtime::Handle;
}

/// A waiting thread, compared by identity.
#[derive(Clone)]
struct WaiterRef(Arc<Waiter>);

impl PartialEq for WaiterRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A thread waiting for the role.
struct Waiter {
    thread: Thread,
    /// Set (under the role lock) when the role was handed to this waiter.
    promoted: AtomicBool,
}

/// The read role of one pipe, and its background reader.
pub(crate) struct ReplyReader<R> {
    replies: R,
    pipe: Pipe,
    role: Mutex<Role<WaiterRef>>,
    /// Tells a dormant background task to listen.
    resume: tokio::sync::Notify,
    /// Tells a listening background task to give the role to a waiting thread.
    give_way: tokio::sync::Notify,
}

/// Tells the waiter the role was handed to that it holds it. Called under the role's lock:
/// a waiter reads its flag under that lock too, so it either sees the promotion, or leaves the
/// queue before the role can be handed to it. (Set after the lock was dropped, a waiter whose
/// result had just come in could leave without seeing it, and the role stayed with a thread
/// that was gone: every later caller queued behind it, and nothing read the pipe until the
/// heartbeat declared the peer lost.)
fn promote(pass: &Pass<WaiterRef>) {
    if let Pass::To(w) = pass {
        w.0.promoted.store(true, Ordering::Release);
    }
}

struct ThreadWaker(Thread);

/// A new waiter for this thread, and the waker that wakes it.
fn new_waiter() -> (WaiterRef, Waker) {
    let me = WaiterRef(Arc::new(Waiter {
        thread: std::thread::current(),
        promoted: AtomicBool::new(false),
    }));
    let waker = Waker::from(Arc::new(ThreadWaker(me.0.thread.clone())));
    (me, waker)
}

thread_local! {
    /// This thread's waiter, made once rather than per call: a blocked thread waits for one
    /// result at a time and leaves the role's queue before it returns.
    static THIS_THREAD: std::cell::RefCell<Option<(WaiterRef, Waker)>> = const { std::cell::RefCell::new(None) };
}

/// This thread's waiter: the kept one, or a new one (kept for next time).
fn this_thread() -> (WaiterRef, Waker) {
    THIS_THREAD
        .try_with(|t| t.borrow_mut().get_or_insert_with(new_waiter).clone())
        .unwrap_or_else(|_| new_waiter())
}

/// Forgets the kept waiter when `drive` unwinds: it may still sit in a role's queue, where a
/// later promotion must not reach this thread's next wait on another pipe.
struct ForgetOnUnwind;

impl Drop for ForgetOnUnwind {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = THIS_THREAD.try_with(|t| t.borrow_mut().take());
        }
    }
}

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

impl<R: Replies> ReplyReader<R> {
    /// A reader for `pipe`. Start [`background`](Self::background) on the pipe's runtime.
    pub(crate) fn new(replies: R, pipe: Pipe) -> Arc<Self> {
        Arc::new(ReplyReader {
            replies,
            pipe,
            role: Mutex::new(Role::new()),
            resume: tokio::sync::Notify::new(),
            give_way: tokio::sync::Notify::new(),
        })
    }

    /// The reader's end: the pipe failed. Every waiter wakes (their calls are failed by
    /// `failed`, which declares the peer lost).
    fn end(&self, detail: String) {
        let Some(waiting) = self.role.lock().unwrap().end() else {
            return;
        };
        self.replies.failed(detail);
        for w in waiting {
            w.0.thread.unpark();
        }
        self.resume.notify_one();
    }

    /// Gives the role up: to the first waiting thread, else to the background task if a task
    /// awaits a reply. Otherwise the background task stays dormant: the thread that left is
    /// likely to come back for its next reply at once (a wake-up per call would cost more
    /// than the call), and calls nobody waits for are read on its tick.
    fn release(&self) {
        let pass = {
            let mut role = self.role.lock().unwrap();
            let pass = role.release(|| self.replies.wanted());
            promote(&pass);
            pass
        };
        self.pass(pass);
    }

    /// Wakes whoever the role went to (after [`promote`], outside the role's lock).
    fn pass(&self, pass: Pass<WaiterRef>) {
        match pass {
            Pass::To(w) => w.0.thread.unpark(),
            Pass::Resume => self.resume.notify_one(),
            Pass::Nothing => {}
        }
    }

    /// The background reader: reads while no thread does. Ends with the pipe.
    pub(crate) async fn background(self: Arc<Self>) {
        loop {
            let Some(listen) = self.role.lock().unwrap().background_take() else {
                return;
            };
            if !listen {
                let _ = tokio::time::timeout(IDLE_TICK, self.resume.notified()).await;
                continue;
            }
            // Holding the role: read until a thread asks for it or nothing is wanted.
            loop {
                let ready = tokio::select! {
                    biased;
                    _ = self.give_way.notified() => None,
                    r = self.replies.read_ready(&self.pipe) => Some(r),
                };
                match ready {
                    None => break,
                    Some(read) => {
                        if let Err(detail) = self.finish_read(read).await {
                            return self.end(detail);
                        }
                    }
                }
                if !self.role.lock().unwrap().background_keeps() {
                    break;
                }
            }
            self.release();
            if !self.replies.wanted() {
                // Sleep until asked (or the tick), rather than listen on an idle pipe that the
                // next caller would have to take back from us.
                self.role.lock().unwrap().go_dormant();
                let _ = tokio::time::timeout(IDLE_TICK, self.resume.notified()).await;
            }
        }
    }

    /// Reads messages on this thread until `poll_done` is ready, the deadline passes, or the
    /// pipe fails (false).
    async fn lead(&self, poll_done: &mut dyn FnMut(&mut Context<'_>) -> Poll<()>, deadline: Option<Instant>) -> bool {
        let expiry = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expiry);
        loop {
            let ready = tokio::select! {
                biased;
                _ = std::future::poll_fn(&mut *poll_done) => return true,
                _ = &mut expiry => return true,
                r = self.replies.read_ready(&self.pipe) => r,
            };
            if let Err(detail) = self.finish_read(ready).await {
                self.end(detail);
                return false;
            }
        }
    }

    /// Finishes what [`Replies::read_ready`] began: a message it left (one not here whole, or
    /// not small) is read through the general path (boxed: rare, and its future is large).
    /// Committed: a message is read whole, never abandoned halfway.
    async fn finish_read(&self, ready: Result<bool, String>) -> Result<(), String> {
        match ready? {
            true => Ok(()),
            false => Box::pin(self.replies.read_one(&self.pipe)).await,
        }
    }
}

impl<R: Replies> Driver for ReplyReader<R> {
    fn drive(&self, poll_done: &mut dyn FnMut(&mut Context<'_>) -> Poll<()>, deadline: Option<Instant>) {
        let (me, waker) = this_thread();
        let _forget = ForgetOnUnwind;
        me.0.promoted.store(false, Ordering::Release);
        let mut cx = Context::from_waker(&waker);
        let mut queued = false;
        loop {
            let done = poll_done(&mut cx).is_ready();
            let expired = deadline.is_some_and(|d| Instant::now() >= d);
            // Take the role, queue for it, or leave.
            let lead = {
                let mut r = self.role.lock().unwrap();
                let promoted = me.0.promoted.swap(false, Ordering::AcqRel);
                if done || expired || r.ended() {
                    let pass = r.leave(&me, promoted, queued, || self.replies.wanted());
                    promote(&pass);
                    drop(r);
                    // Handed the role as our result came in: it went on to the next.
                    self.pass(pass);
                    return;
                }
                match r.ask(me.clone(), promoted, &mut queued) {
                    Ask::Lead => true,
                    Ask::Queued { give_way } => {
                        if give_way {
                            self.give_way.notify_one();
                        }
                        false
                    }
                    Ask::Ended => return,
                }
            };
            if lead {
                // A pool thread that leads counts as blocked (it may wait long for the peer),
                // so nested calls back into this worker still find a handler thread.
                let alive =
                    crate::pool::blocking(|| self.replies.runtime().block_on(self.lead(&mut *poll_done, deadline)));
                if !alive {
                    return;
                }
                self.release();
                // A leader is not queued, so no promotion can be on its way to it: with the
                // result in, there is no queue to leave (the common case: one lock fewer).
                if poll_done(&mut cx).is_ready() {
                    return;
                }
                continue;
            }
            // A follower: the leader delivers our reply, or hands us the role.
            let start = Instant::now();
            while start.elapsed() < FOLLOWER_SPIN {
                if me.0.promoted.load(Ordering::Acquire) || poll_done(&mut cx).is_ready() {
                    break;
                }
                std::hint::spin_loop();
            }
            if !me.0.promoted.load(Ordering::Acquire) && poll_done(&mut cx).is_pending() {
                let nap = deadline.map_or(IDLE_TICK, |d| {
                    d.saturating_duration_since(Instant::now()).min(IDLE_TICK)
                });
                crate::pool::blocking(|| std::thread::park_timeout(nap));
            }
        }
    }

    fn debug_state(&self) -> String {
        self.role.lock().unwrap().describe()
    }

    fn awaited(&self) {
        // While a thread reads, the background task takes over when it leaves.
        if self.role.lock().unwrap().awaited() {
            self.resume.notify_one();
        }
    }
}
