//! The agent: one per process. [`Agent`] is the public handle; [`AgentInner`] composes the
//! parts, each of which owns its state as a struct of its own:
//!
//! - [`crate::client::Client`]: the call core ([`crate::calls::Outstanding`], which owns the
//!   pending calls, their deadlines' timer and the clock), ids, the default timeout, control
//!   messages in flight. A call becomes an entry there, a request on this worker's own pipe to
//!   the peer, and a reply read by the waiting thread or the background reader
//!   ([`crate::reader`]).
//! - [`crate::server::Server`]: the handlers, the pool that runs the slow ones, the budget
//!   held by requests being served, receive buffers and CUDA streams. Requests read from
//!   incoming pipes are dispatched to handlers (inline on the reading thread when quick, on
//!   the pool, or polled as futures) and answered on the same pipe.
//! - [`crate::peers::Peers`]: the members as applied from the store, the store itself, and
//!   membership subscribers; each [`crate::peers::Peer`] owns its lanes (pipes and read
//!   roles), heartbeats, loss and reconnection.
//! - [`crate::lifecycle`]: init, the group barrier, leave with the store hand-off, shutdown.
//!
//! What a part does with its own state alone is a method of its struct (`Peers::peer`,
//! `Client::next_id`, `Server::allocate`, ...). What crosses parts (a call needs a peer's pipe,
//! a loss fails calls and releases RRefs, a request is dispatched and answered) is an
//! `impl AgentInner` in the module of the part that starts it; the hub holds only what every
//! part shares: this worker's name, the options, the runtime, the pipe context, the
//! running state and the RRef table.
//!
//! Dependencies: those cross-part methods are why client, server, peers and lifecycle still
//! import this module while it imports their structs. A part's struct uses leaf modules
//! (wire, payload, calls, reader, store, ...) only.
//!
//! Pipes: each worker opens its own pipe to each peer it calls (lazily by default) and sends
//! its requests there; the callee answers on the same pipe. So a pipe carries requests one way
//! and responses the other, and a failed pipe fails exactly the calls that used it.
//!
//! Failure detection: a peer is declared lost when its pipe fails, when a pipe to it hears
//! nothing for `heartbeat_misses` heartbeat intervals (a pipe that has heard no reply for an
//! interval sends a ping, so pings cost nothing while replies flow), or when its membership
//! vanishes without a graceful leave. Then its pending calls fail with `PeerLost`, the RRef
//! forks it held are released here, subscribers hear [`MembershipEvent::Lost`], and while it
//! is still a member a background task tries to reconnect (a restored link).
//!
//! Threads: a tokio runtime (`io_threads`) drives pipes, timers and async handlers; a pool
//! (`pool_threads`) runs synchronous handlers that have shown they block or take long.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_channel::Context;

use crate::client::Client;
use crate::completion::Completion;
use crate::error::{InitError, RpcError, ShutdownError};
use crate::membership::MembershipEvent;
use crate::name::{Dest, WorkerInfo};
use crate::options::AgentOptions;
use crate::payload::{Payload, Value};
use crate::peers::Peers;
use crate::priority::Priority;
use crate::rref::{RRef, RRefHost, RRefTable};
use crate::server::CallContext;
use crate::server::Server;
use crate::wire::Body;

pub use crate::completion::RpcFuture;

/// Every handler and method of a worker, fixed at init.
pub type Registry = crate::handler::Handlers<CallContext>;

/// Only one agent runs in a process at a time.
pub(crate) static RUNNING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) const RUNNING_STATE: u8 = 0;
pub(crate) const DOWN: u8 = 2;

/// Received buffers at least this large are recycled once every user has dropped them.
pub(crate) const POOL_MIN: usize = 256 << 10;
pub(crate) const POOL_KEEP: usize = 8;

/// The internal handler that takes over the embedded store from a leaving host.
pub(crate) const H_TAKEOVER: &str = "sluice.store.takeover";

pub(crate) struct AgentInner {
    pub(crate) me: WorkerInfo,
    pub(crate) options: AgentOptions,
    pub(crate) runtime: Mutex<Option<tokio::runtime::Runtime>>,
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) context: Context,
    pub(crate) state: AtomicU8,
    /// Requests and replies seen since the last shutdown round.
    pub(crate) activity: AtomicU64,
    pub(crate) rrefs: RRefTable,
    /// The calls this worker makes: the call table and its ids.
    pub(crate) client: Client,
    /// The requests this worker serves: handlers, their pool and what they hold.
    pub(crate) server: Server,
    /// The group and the pipes to it: members, the store, membership events.
    pub(crate) peers: Peers,
}

/// A handle to this process's agent. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
    /// The priority of this handle's calls; `None`: the calling thread's (see
    /// [`crate::priority`]).
    pub(crate) priority: Option<Priority>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("me", &self.inner.me).finish()
    }
}

impl Agent {
    /// Joins the group: starts the store (on the store rank of a fixed group), publishes this
    /// worker, waits for the fixed group to be complete (an elastic join waits for nobody),
    /// validates names and device maps, and starts serving. Blocks; call it from a plain thread.
    pub fn init(options: AgentOptions, registry: Registry) -> Result<Agent, InitError> {
        if RUNNING.swap(true, Ordering::AcqRel) {
            return Err(InitError::AlreadyInitialized);
        }
        let result = crate::lifecycle::init(options, registry);
        if result.is_err() {
            RUNNING.store(false, Ordering::Release);
        }
        result
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.inner.me
    }

    /// A handle to the same agent whose calls (`rpc_sync`, `rpc_async`, `call`, `remote` and
    /// their forms) go at `priority`: see [`crate::priority`]. For the RRef proxies and
    /// everything else, wrap the calls in [`with_priority`](crate::with_priority).
    pub fn with_priority(&self, priority: Priority) -> Agent {
        Agent {
            inner: self.inner.clone(),
            priority: Some(priority),
        }
    }

    /// The priority this handle's calls go at now.
    pub fn priority(&self) -> Priority {
        self.priority.unwrap_or_else(crate::priority::current)
    }

    /// Runs `f` at this handle's priority.
    fn prioritized<R>(&self, f: impl FnOnce() -> R) -> R {
        match self.priority {
            Some(p) => crate::priority::with_priority(p, f),
            None => f(),
        }
    }

    /// The workers of the group now, by id.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let m = self.inner.peers.members.read().unwrap();
        let mut w: Vec<WorkerInfo> = m.by_id.values().map(|p| p.info.clone()).collect();
        w.sort_by_key(|w| w.id);
        w
    }

    /// The worker `dest` names.
    pub fn worker(&self, dest: impl Into<Dest>) -> Result<WorkerInfo, RpcError> {
        let id = self.inner.resolve(&dest.into())?;
        self.inner.peers.peer(id).map(|p| p.info.clone())
    }

    /// Membership changes from now on, as a channel (each call makes a new subscriber).
    pub fn membership_events(&self) -> crossbeam_channel::Receiver<MembershipEvent> {
        self.inner.peers.subscribers.channel()
    }

    /// Calls `f` on every membership change from now on. It runs on the agent's I/O threads:
    /// keep it short and never block in it.
    pub fn on_membership(&self, f: impl Fn(&MembershipEvent) + Send + Sync + 'static) {
        self.inner.peers.subscribers.callback(Arc::new(f));
    }

    /// The store's address now (it moves when its host leaves).
    pub fn store_address(&self) -> String {
        self.inner.peers.store.address()
    }

    /// Calls `handler` on `dest` and returns the reply's future at once. The deadline is the
    /// default timeout from now.
    pub fn rpc_async(&self, dest: impl Into<Dest>, handler: &str, payload: Payload) -> RpcFuture {
        self.rpc_async_timeout(dest, handler, payload, self.inner.client.default_timeout())
    }

    /// [`rpc_async`](Self::rpc_async) with its own timeout (zero: none).
    pub fn rpc_async_timeout(
        &self,
        dest: impl Into<Dest>,
        handler: &str,
        payload: Payload,
        timeout: Duration,
    ) -> RpcFuture {
        let body = Body::Call {
            handler: handler.into(),
        };
        match self.inner.resolve(&dest.into()) {
            Ok(rank) => self.prioritized(|| self.inner.start_call(rank, body, payload, timeout)),
            Err(e) => Completion::ready(Err(e)),
        }
    }

    /// Calls `handler` on `dest` and waits for the reply.
    pub fn rpc_sync(&self, dest: impl Into<Dest>, handler: &str, payload: Payload) -> Result<Payload, RpcError> {
        self.rpc_async(dest, handler, payload).wait()
    }

    /// [`rpc_sync`](Self::rpc_sync) with its own timeout (zero: none).
    pub fn rpc_sync_timeout(
        &self,
        dest: impl Into<Dest>,
        handler: &str,
        payload: Payload,
        timeout: Duration,
    ) -> Result<Payload, RpcError> {
        self.rpc_async_timeout(dest, handler, payload, timeout).wait()
    }

    /// Typed `rpc_sync`: encodes `arg`, decodes the reply as `R`.
    pub fn call<A: Serialize + ?Sized, R: DeserializeOwned>(
        &self,
        dest: impl Into<Dest>,
        handler: &str,
        arg: &A,
    ) -> Result<R, RpcError> {
        self.rpc_sync(dest, handler, Payload::encode(arg)?)?.decode()
    }

    /// Typed `rpc_async`.
    pub fn call_async<A: Serialize + ?Sized>(&self, dest: impl Into<Dest>, handler: &str, arg: &A) -> RpcFuture {
        match Payload::encode(arg) {
            Ok(p) => self.rpc_async(dest, handler, p),
            Err(e) => Completion::ready(Err(e)),
        }
    }

    /// Runs `handler` on `dest`, which keeps the result and becomes its owner; returns a
    /// reference at once. A failed creation surfaces on the reference's next use.
    pub fn remote<T>(&self, dest: impl Into<Dest>, handler: &str, payload: Payload) -> Result<RRef<T>, RpcError> {
        self.remote_timeout(dest, handler, payload, self.inner.client.default_timeout())
    }

    pub fn remote_timeout<T>(
        &self,
        dest: impl Into<Dest>,
        handler: &str,
        payload: Payload,
        timeout: Duration,
    ) -> Result<RRef<T>, RpcError> {
        let inner = &self.inner;
        let owner = inner.resolve(&dest.into())?;
        inner.check_running()?;
        let handler = crate::wire::HandlerName::from(handler);
        let state = self.prioritized(|| {
            crate::rref::create_remote(&inner.host(), owner, payload, timeout, |rref, fork| Body::Remote {
                handler,
                rref,
                fork,
            })
        });
        Ok(RRef::from_state(state))
    }

    /// A reference owned by this worker, holding `value`.
    pub fn rref<T: Serialize + Send + Sync + 'static>(&self, value: T) -> RRef<T> {
        let id = self.inner.client.global_id();
        let host = self.inner.host();
        let state = self.inner.rrefs.owner_handle(&host, id);
        self.inner.rrefs.set_value(id, Ok(Value::object(value)));
        RRef::from_state(state)
    }

    /// A reference owned by this worker holding `value` as it is (an object with its own
    /// encoding, see [`Value::encodable`], or a payload).
    pub fn rref_value<T>(&self, value: Value) -> RRef<T> {
        let id = self.inner.client.global_id();
        let host = self.inner.host();
        let state = self.inner.rrefs.owner_handle(&host, id);
        self.inner.rrefs.set_value(id, Ok(value));
        RRef::from_state(state)
    }

    /// Changes the timeout of calls started from now on that give none (`rpc_sync`,
    /// `rpc_async`, `remote`, `to_here`, the proxies); zero means none. Calls already sent
    /// keep the deadline they were sent with.
    pub fn set_default_timeout(&self, timeout: Duration) {
        self.inner.client.set_default_timeout(timeout);
    }

    /// The timeout calls get when none is given.
    pub fn default_timeout(&self) -> Duration {
        self.inner.client.default_timeout()
    }

    /// Waits until every worker of the group has called `barrier` with the same `key` (each key
    /// once). The group is the members at each check: a fixed group's ranks that are still
    /// here, and every worker that joined later. Call it from a plain thread.
    pub fn barrier(&self, key: &str) -> Result<(), RpcError> {
        let inner = &self.inner;
        inner.check_running()?;
        let timeout = Duration::from_secs(365 * 24 * 3600);
        inner
            .handle
            .block_on(inner.group_barrier(&format!("user/{key}"), timeout))
            .map_err(|e| RpcError::Store(e.to_string()))
    }

    /// Requests waiting here for a handler slot now.
    pub fn queued_requests(&self) -> usize {
        self.inner.server.pool.waiting()
    }

    /// RRef values this worker owns and still keeps.
    pub fn owned_rrefs(&self) -> usize {
        self.inner.rrefs.owned_count()
    }

    /// User references to other workers' values alive in this process.
    pub fn user_rrefs(&self) -> usize {
        self.inner.rrefs.users_alive()
    }

    /// Graceful shutdown without a time limit: waits until no worker of the group has work
    /// outstanding (calls, handlers, RRef control messages), then leaves. Every worker must call
    /// it. Call it from a plain thread.
    pub fn shutdown(&self) -> Result<(), ShutdownError> {
        self.inner.shutdown(None)
    }

    /// Graceful shutdown that gives up after `timeout`, then shuts down at once.
    pub fn shutdown_timeout(&self, timeout: Duration) -> Result<(), ShutdownError> {
        self.inner.shutdown(Some(timeout))
    }

    /// Leaves the group alone, while the others go on: announces the leave (peers see
    /// [`MembershipEvent::Left`] and stop routing calls here), waits up to `timeout` for this
    /// worker's own calls, handlers and control messages to finish, hands the embedded store to
    /// another member if this worker serves it, says goodbye on every pipe and stops.
    pub fn leave(&self, timeout: Duration) -> Result<(), ShutdownError> {
        self.inner.leave(timeout)
    }

    /// Ungraceful shutdown: fails pending calls, closes every pipe, stops at once.
    pub fn shutdown_now(&self) {
        self.inner.teardown();
    }

    /// Where this worker listens for pipes.
    pub fn address(&self) -> &str {
        &self.inner.peers.announce.address
    }

    /// The pipe info of this worker's pipe to `dest`, if one is open.
    pub fn pipe_info(&self, dest: impl Into<Dest>) -> Option<sluice_channel::PipeInfo> {
        let id = self.inner.resolve(&dest.into()).ok()?;
        let peer = self.inner.peers.peer(id).ok()?;
        let open = peer.lanes[crate::peers::NORMAL_LANE].open.lock().unwrap();
        open.as_ref().map(|o| o.pipe.info().clone())
    }
}

impl AgentInner {
    pub(crate) fn is_down(&self) -> bool {
        self.state.load(Ordering::Acquire) == DOWN
    }

    pub(crate) fn check_running(&self) -> Result<(), RpcError> {
        if self.is_down() {
            Err(RpcError::Shutdown)
        } else {
            Ok(())
        }
    }

    /// Milliseconds since this agent started, to a scheduler tick.
    pub(crate) fn now_ms(&self) -> u64 {
        self.client.calls.clock().now_ms()
    }

    /// This agent as the RRef layer sees it.
    pub(crate) fn host(self: &Arc<Self>) -> Arc<dyn RRefHost> {
        self.clone()
    }
}
