//! The tokio runtime the library owns, made on first use and kept for the life of the process
//! (two worker threads, named `sluice-capi`), and the three ways C code uses it:
//!
//! - [`block_on`]: a blocking call from a C thread. Refused on the runtime's own threads
//!   (a completion callback), where it would stall or deadlock the runtime.
//! - [`start`]: an operation that completes later. It is polled once on the calling thread
//!   before it is handed to the runtime, so operations a thread starts one after another queue
//!   on the pipe's fair locks in that order (a freshly spawned task could run after one spawned
//!   later). Its completion runs on a runtime thread, never inside the call that started it.
//! - [`enter`]: a guard for code that makes or drops runtime resources (contexts, pipes).
//!
//! Panics inside an operation are caught ([`CatchUnwind`]) and become `SLUICE_PANIC`, so a
//! completion always runs.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};

use tokio::runtime::{EnterGuard, Handle, Runtime};

use crate::status::{Error, Result, SLUICE_IO, SLUICE_PANIC};

static RUNTIME: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();

/// The library's runtime, made on first use.
pub fn runtime() -> Result<&'static Runtime> {
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("sluice-capi")
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start the runtime: {e}"))
        })
        .as_ref()
        .map_err(|e| Error::new(SLUICE_IO, e.clone()))
}

/// Enters the runtime's context (for making or dropping pipes, listeners, contexts).
pub fn enter() -> Result<EnterGuard<'static>> {
    Ok(runtime()?.enter())
}

/// Runs `fut` to completion on the calling thread. Refused on a runtime thread (inside a
/// completion callback), where blocking would stall the runtime that has to finish it.
pub fn block_on<F: Future>(fut: F) -> Result<F::Output> {
    if Handle::try_current().is_ok() {
        return Err(Error::misuse(
            "a blocking call from a completion callback (or another async runtime's thread); \
             use the callback or op forms there",
        ));
    }
    runtime()?.block_on(CatchUnwind(Box::pin(fut)))
}

/// Starts `op` and hands its output to `done` on a runtime thread. `op` is polled once here,
/// on the calling thread, so that it takes its place in the pipe's queues now.
pub fn start<F, D>(op: F, done: D) -> Result<()>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
    D: FnOnce(Result<F::Output>) + Send + 'static,
{
    let rt = runtime()?;
    let _entered = rt.enter();
    let mut op = CatchUnwind(Box::pin(op));
    let waker = Waker::from(Arc::new(Noop));
    let first = Pin::new(&mut op).poll(&mut Context::from_waker(&waker));
    match first {
        Poll::Ready(out) => drop(rt.spawn(async move { done(out) })),
        // The task polls it again with its own waker, so nothing that became ready meanwhile
        // is missed (a future checks its state on every poll).
        Poll::Pending => drop(rt.spawn(async move { done(op.await) })),
    }
    Ok(())
}

/// Starts `op` with nobody waiting for its output. Polled once here, on the calling thread (so it
/// takes its place in the pipe's queues now); only if it has not finished does a runtime task
/// take it over, so an operation that finishes at once wakes no library thread. A panic inside
/// it is caught and dropped with its output.
pub fn start_detached<F>(op: F) -> Result<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let rt = runtime()?;
    let _entered = rt.enter();
    let mut op = CatchUnwind(Box::pin(op));
    let waker = Waker::from(Arc::new(Noop));
    if Pin::new(&mut op).poll(&mut Context::from_waker(&waker)).is_pending() {
        drop(rt.spawn(async move {
            let _ = op.await;
        }));
    }
    Ok(())
}

/// A waker for the first poll in [`start`]: the task that takes over polls again.
struct Noop;

impl Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// A future whose panic is caught and turned into `SLUICE_PANIC`.
pub struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(panic) => Poll::Ready(Err(Error::new(
                SLUICE_PANIC,
                format!("internal panic: {}", panic_message(&*panic)),
            ))),
        }
    }
}

/// What a panic said, if it said it with a string.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(|s| s.as_str()))
        .unwrap_or("(no message)")
}
