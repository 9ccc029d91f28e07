//! The agent's public API: [`Agent`] (defined in `crate::hub` with the state it shares) is
//! one per process. How the agent is put together:
//!
//! - `crate::parts`: each part's own state as a struct of its own, with what it does alone:
//!   - `Client`: the call core
//!     (`crate::calls::Outstanding`, which owns the pending calls, their deadlines' timer and
//!     the clock), ids, the default timeout, control messages in flight;
//!   - `Server`: the budget held by requests being served,
//!     the pool that runs slow handlers, receive buffers and CUDA streams, and reading a
//!     request within the worker's limits;
//!   - `Peers`: the members as applied from the store, the
//!     store, membership subscribers; each `Peer` owns its lanes
//!     (pipes and read roles) and whether it is down.
//! - `crate::hub`: `AgentInner` composes the parts with what every
//!   part shares (name, options, runtime, pipe context, running state, handlers, RRef table).
//! - The drivers, which work across parts as `impl AgentInner` blocks: `crate::client` (a
//!   call becomes an entry in the call table, a request on this worker's own pipe to the peer,
//!   and a reply read by the waiting thread or the background reader, `crate::reader`; RRef
//!   control messages), `crate::server` (requests read from incoming pipes, dispatched to
//!   handlers inline on the reading thread when quick, on the pool, or polled as futures, and
//!   answered on the same pipe), `crate::peers` (membership applied from the store, opening
//!   pipes, heartbeats, loss and reconnection), `crate::lifecycle` (init, the group barrier,
//!   leave with the store hand-off, shutdown).
//!
//! Dependencies point one way: this module uses the hub and the drivers; the drivers use the
//! hub, the parts and leaf modules; the hub uses the parts; the parts use leaf modules only.
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

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::completion::Completion;
use crate::error::{InitError, RpcError, ShutdownError};
use crate::membership::MembershipEvent;
use crate::name::{Dest, WorkerInfo};
use crate::options::AgentOptions;
use crate::payload::{Payload, Value};
use crate::priority::Priority;
use crate::rref::RRef;
use crate::wire::Body;

pub use crate::completion::RpcFuture;
use crate::hub::RUNNING;
pub use crate::hub::{Agent, Registry};

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

    /// Where a tensor on `device` in a reply to `caller` lands there: the reverse of the
    /// caller's device map to this worker (the CPU stays the CPU), or `None` when that map
    /// does not cover `device` (such a reply fails with [`RpcError::MissingDeviceMap`]; move
    /// the tensor to the CPU first).
    pub fn reply_device(
        &self,
        caller: impl Into<Dest>,
        device: sluice_channel::Device,
    ) -> Option<sluice_channel::Device> {
        let id = self.inner.resolve(&caller.into()).ok()?;
        let peer = self.inner.peers.peer(id).ok()?;
        crate::device_map::reverse(peer.map_from.as_ref(), device, "").ok()
    }

    /// The pipe info of this worker's pipe to `dest`, if one is open.
    pub fn pipe_info(&self, dest: impl Into<Dest>) -> Option<sluice_channel::PipeInfo> {
        let id = self.inner.resolve(&dest.into()).ok()?;
        let peer = self.inner.peers.peer(id).ok()?;
        let open = peer.lanes[crate::parts::peers::NORMAL_LANE].open.lock().unwrap();
        open.as_ref().map(|o| o.pipe.info().clone())
    }
}
