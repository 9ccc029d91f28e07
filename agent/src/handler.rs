//! Handlers: Rust functions registered by name before init.
//!
//! - **Synchronous** handlers run on the handler pool; they may block (nested calls included).
//! - **Async** handlers return a future and run on the agent's runtime, holding no thread while
//!   they wait (PyTorch's `@async_execution`).
//! - **Methods** run on an RRef's value on its owner (the target of RRef proxies).
//!
//! Typed forms decode the argument and encode the result with serde; raw forms take and return
//! a [`Payload`] (bytes, tensors, RRefs).

use rustc_hash::FxHashMap as HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::HandlerError;
use crate::payload::{Payload, Value};

pub type HandlerResult = Result<Value, HandlerError>;
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

type SyncFn<C> = dyn Fn(&C, Payload) -> HandlerResult + Send + Sync;
type AsyncFn<C> = dyn Fn(C, Payload) -> BoxFuture<HandlerResult> + Send + Sync;
type MethodFn<C> = dyn Fn(&C, &Value, Payload) -> HandlerResult + Send + Sync;

pub(crate) enum Handler<C> {
    Sync(Arc<SyncFn<C>>, Arc<Pace>),
    Async(Arc<AsyncFn<C>>),
}

impl<C> Clone for Handler<C> {
    fn clone(&self) -> Self {
        match self {
            Handler::Sync(f, pace) => Handler::Sync(f.clone(), pace.clone()),
            Handler::Async(f) => Handler::Async(f.clone()),
        }
    }
}

/// A synchronous handler runs inline, on the thread that read its request, only after it
/// showed it is quick: its last run took less than this and never blocked.
const INLINE_MAX: std::time::Duration = std::time::Duration::from_micros(200);

/// Of the runs of a handler allowed inline, one in this many is timed: reading the clock twice
/// costs about as much as a no-op handler's whole run. A handler that turns slow is moved off
/// the reading thread within this many runs; one that blocks, at once (blocking is seen on
/// every run).
const TIMED_EVERY: u32 = 16;

/// How a synchronous handler behaved when it last ran: whether it may run inline.
#[derive(Debug)]
pub(crate) struct Pace {
    inline: std::sync::atomic::AtomicBool,
    /// Its last run blocked (a nested call, a wait); true before the first run.
    blocked: std::sync::atomic::AtomicBool,
    /// Runs while inline, for choosing the ones timed.
    runs: std::sync::atomic::AtomicU32,
}

impl Default for Pace {
    fn default() -> Pace {
        Pace {
            inline: false.into(),
            blocked: true.into(),
            runs: 0.into(),
        }
    }
}

impl Pace {
    pub(crate) fn inline(&self) -> bool {
        self.inline.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether its last run computed for long without blocking: it will likely keep a core
    /// busy (see `sluice_transport::shm::occupy_core`).
    pub(crate) fn computes(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        !self.inline.load(Relaxed) && !self.blocked.load(Relaxed)
    }

    /// Runs the handler's `job` and records how it went: quick (when timed) and never blocked
    /// lets the next run be inline. Every run of a handler not inline is timed, so one that
    /// became quick again is seen at once.
    pub(crate) fn run<R>(&self, job: impl FnOnce() -> R) -> R {
        use std::sync::atomic::Ordering::Relaxed;
        let timed = !self.inline() || self.runs.fetch_add(1, Relaxed).is_multiple_of(TIMED_EVERY);
        if !timed {
            let (r, blocked) = crate::pool::measured(job);
            if blocked {
                self.inline.store(false, Relaxed);
                self.blocked.store(true, Relaxed);
            }
            return r;
        }
        let start = std::time::Instant::now();
        let (r, blocked) = crate::pool::measured(job);
        self.inline.store(!blocked && start.elapsed() < INLINE_MAX, Relaxed);
        self.blocked.store(blocked, Relaxed);
        r
    }
}

/// Every handler and method of a worker, fixed at init. `C` is what a handler sees besides its
/// argument (the agent's [`crate::CallContext`]; this module knows nothing of agents).
pub struct Handlers<C> {
    pub(crate) handlers: HashMap<String, Handler<C>>,
    pub(crate) methods: HashMap<String, Arc<MethodFn<C>>>,
}

impl<C> Clone for Handlers<C> {
    fn clone(&self) -> Self {
        Handlers {
            handlers: self.handlers.clone(),
            methods: self.methods.clone(),
        }
    }
}

impl<C> Default for Handlers<C> {
    fn default() -> Self {
        Handlers {
            handlers: HashMap::default(),
            methods: HashMap::default(),
        }
    }
}

fn decode_arg<A: DeserializeOwned>(payload: &Payload) -> Result<A, HandlerError> {
    payload
        .decode::<A>()
        .map_err(|e| HandlerError::new("DecodeError", e.to_string()))
}

impl<C: Send + 'static> Handlers<C> {
    pub fn new() -> Handlers<C> {
        Handlers::default()
    }

    /// A synchronous handler taking `A` and returning `R`.
    pub fn handler<A, R, F>(&mut self, name: &str, f: F) -> &mut Self
    where
        A: DeserializeOwned,
        R: Serialize + Send + Sync + 'static,
        F: Fn(&C, A) -> Result<R, HandlerError> + Send + Sync + 'static,
    {
        let f: Arc<SyncFn<C>> = Arc::new(move |ctx, payload| {
            let arg = decode_arg::<A>(&payload)?;
            f(ctx, arg).map(Value::object)
        });
        self.handlers.insert(name.to_owned(), Handler::Sync(f, Arc::default()));
        self
    }

    /// A synchronous handler over raw payloads (tensors in, tensors out).
    pub fn raw_handler<F>(&mut self, name: &str, f: F) -> &mut Self
    where
        F: Fn(&C, Payload) -> Result<Payload, HandlerError> + Send + Sync + 'static,
    {
        let f: Arc<SyncFn<C>> = Arc::new(move |ctx, payload| f(ctx, payload).map(Value::Payload));
        self.handlers.insert(name.to_owned(), Handler::Sync(f, Arc::default()));
        self
    }

    /// A synchronous handler returning a [`Value`] as it is: an object stays unencoded on this
    /// worker when it becomes an RRef's value (`remote`), and is encoded only to travel.
    pub fn value_handler<F>(&mut self, name: &str, f: F) -> &mut Self
    where
        F: Fn(&C, Payload) -> Result<Value, HandlerError> + Send + Sync + 'static,
    {
        self.handlers
            .insert(name.to_owned(), Handler::Sync(Arc::new(f), Arc::default()));
        self
    }

    /// The async form of [`value_handler`](Self::value_handler).
    pub fn value_async_handler<F, Fut>(&mut self, name: &str, f: F) -> &mut Self
    where
        F: Fn(C, Payload) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, HandlerError>> + Send + 'static,
    {
        let h: Arc<AsyncFn<C>> = Arc::new(move |ctx, payload| Box::pin(f(ctx, payload)));
        self.handlers.insert(name.to_owned(), Handler::Async(h));
        self
    }

    /// A method over whatever value the RRef holds (a payload or an object of any type), for
    /// values the caller's type system does not describe (the Python binding's objects).
    pub fn value_method<F>(&mut self, name: &str, f: F) -> &mut Self
    where
        F: Fn(&C, &Value, Payload) -> Result<Value, HandlerError> + Send + Sync + 'static,
    {
        self.methods.insert(name.to_owned(), Arc::new(f));
        self
    }

    /// An async handler: the future runs on the agent's runtime and holds no thread while it
    /// waits.
    pub fn async_handler<A, R, F, Fut>(&mut self, name: &str, f: F) -> &mut Self
    where
        A: DeserializeOwned,
        R: Serialize + Send + Sync + 'static,
        F: Fn(C, A) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<R, HandlerError>> + Send + 'static,
    {
        let f = Arc::new(f);
        let h: Arc<AsyncFn<C>> = Arc::new(move |ctx, payload| {
            let f = f.clone();
            Box::pin(async move {
                let arg = decode_arg::<A>(&payload)?;
                f(ctx, arg).await.map(Value::object)
            })
        });
        self.handlers.insert(name.to_owned(), Handler::Async(h));
        self
    }

    /// An async handler over raw payloads.
    pub fn raw_async_handler<F, Fut>(&mut self, name: &str, f: F) -> &mut Self
    where
        F: Fn(C, Payload) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Payload, HandlerError>> + Send + 'static,
    {
        let h: Arc<AsyncFn<C>> = Arc::new(move |ctx, payload| {
            let fut = f(ctx, payload);
            Box::pin(async move { fut.await.map(Value::Payload) })
        });
        self.handlers.insert(name.to_owned(), Handler::Async(h));
        self
    }

    /// A method on RRef values of type `T`: `rref.rpc_sync(name, arg)` runs `f(value, arg)` on
    /// the owner.
    pub fn method<T, A, R, F>(&mut self, name: &str, f: F) -> &mut Self
    where
        T: DeserializeOwned + Send + Sync + 'static,
        A: DeserializeOwned,
        R: Serialize + Send + Sync + 'static,
        F: Fn(&C, &T, A) -> Result<R, HandlerError> + Send + Sync + 'static,
    {
        self.typed_method(name, move |ctx, target: &T, payload| {
            let arg = decode_arg::<A>(&payload)?;
            f(ctx, target, arg).map(Value::object)
        })
    }

    /// A method on RRef values of type `T` that takes and returns whole payloads (tensors
    /// included), as [`raw_handler`](Self::raw_handler) does for calls; proxies reach it with
    /// [`RRef::rpc_async_raw`](crate::RRef::rpc_async_raw).
    pub fn raw_method<T, F>(&mut self, name: &str, f: F) -> &mut Self
    where
        T: DeserializeOwned + Send + Sync + 'static,
        F: Fn(&C, &T, Payload) -> Result<Payload, HandlerError> + Send + Sync + 'static,
    {
        self.typed_method(name, move |ctx, target: &T, payload| {
            f(ctx, target, payload).map(Value::Payload)
        })
    }

    /// Registers a method whose value must be a `T` (else a `TypeError` for the caller).
    fn typed_method<T, F>(&mut self, name: &str, f: F) -> &mut Self
    where
        T: DeserializeOwned + Send + Sync + 'static,
        F: Fn(&C, &T, Payload) -> Result<Value, HandlerError> + Send + Sync + 'static,
    {
        let m: Arc<MethodFn<C>> = Arc::new(move |ctx, value, payload| {
            let target = value
                .get::<T>()
                .map_err(|e| HandlerError::new("TypeError", e.to_string()))?;
            f(ctx, &target, payload)
        });
        self.methods.insert(name.to_owned(), m);
        self
    }
}

#[cfg(test)]
mod pace_tests {
    use super::*;

    #[test]
    fn only_a_handler_that_computed_long_without_blocking_claims_a_core() {
        let pace = Pace::default();
        assert!(!pace.computes(), "nothing known before the first run");
        pace.run(|| std::thread::sleep(INLINE_MAX * 2));
        assert!(pace.computes(), "slow, never blocked");
        pace.run(|| crate::pool::blocking(|| std::thread::sleep(INLINE_MAX * 2)));
        assert!(!pace.computes(), "slow because it waited");
        pace.run(|| ());
        assert!(!pace.computes(), "quick: runs inline, claims nothing");
    }

    /// A quick handler goes inline after one run; once it turns slow it leaves within
    /// `TIMED_EVERY` runs, and one that blocks leaves at once.
    #[test]
    fn a_handler_leaves_the_reading_thread_once_slow_or_blocking() {
        let pace = Pace::default();
        assert!(!pace.inline(), "unknown handlers start on the pool");
        pace.run(|| ());
        assert!(pace.inline(), "one quick run lets it inline");
        // Part-way through a cycle of untimed runs, so the slow runs below start untimed.
        for _ in 0..5 {
            pace.run(|| ());
        }
        let mut runs = 0;
        while pace.inline() {
            pace.run(|| std::thread::sleep(INLINE_MAX * 2));
            runs += 1;
            assert!(runs <= TIMED_EVERY, "still inline after {runs} slow runs");
        }
        assert!(runs > 1, "the first slow run was untimed, yet it left at once");
        pace.run(|| ());
        assert!(pace.inline(), "quick again: inline again after one run");
        pace.run(|| crate::pool::blocking(|| ()));
        assert!(!pace.inline(), "a run that blocked leaves at once, timed or not");
    }
}
