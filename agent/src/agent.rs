//! The agent: one per process. It joins the group through the store, opens pipes to peers,
//! sends requests, serves them, and keeps every pending call's bookkeeping.
//!
//! Pipes: each worker opens its own pipe to each peer it calls (lazily by default) and sends
//! its requests there; the callee answers on the same pipe. So a pipe carries requests one way
//! and responses the other, and a failed pipe fails exactly the calls that used it.
//!
//! Membership ([`crate::membership`]): the group is what the store says it is. A watcher task
//! applies joins, leaves and losses as they happen; a worker restarted under its name gets a
//! new id and is reached by name.
//!
//! Failure detection: a peer is declared lost when its pipe fails, when a pipe to it hears
//! nothing for `heartbeat_misses` heartbeat intervals (a pipe that has heard no reply for an
//! interval sends a ping, so pings cost nothing while replies flow), or when its membership
//! vanishes without a graceful leave. Then its pending calls fail with `PeerLost`, the RRef
//! forks it held are released here, subscribers hear [`MembershipEvent::Lost`], and while it
//! is still a member a background task tries to reconnect (a restored link).
//!
//! Threads: a tokio runtime (`io_threads`) drives pipes, timers and async handlers; a pool
//! (`pool_threads`) runs synchronous handlers. Callers on plain threads send on their own
//! thread and wait for the reply by spinning briefly, then sleeping.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_channel::{Allocation, Context, Descriptor, Device, Message, Pipe, PipeError, RecvBuffer, Tensor};

use crate::budget::Budget;
use crate::calls::Calls;
use crate::completion::{Completion, Driver, Slot};
use crate::device_map::{self, DeviceMap, WorkerDevices};
use crate::error::{HandlerError, InitError, RpcError, ShutdownError};
use crate::gpu::{self, StreamPool};
use crate::handler::{BoxFuture, CallContext, Handler, Registry};
use crate::membership::{self, Announce, MembershipEvent, Subscribers};
use crate::name::{validate_name, Dest, WorkerInfo};
use crate::options::{self, AgentOptions, Connect};
use crate::payload::{Payload, Value};
use crate::pool::Pool;
use crate::reader::{Replies, ReplyReader};
use crate::rref::{RRef, RRefState, RRefTable};
use crate::store::{Listing, Snapshot, Store, StoreError, StoreServer, StoreUrl};
use crate::wire::{self, Body, Envelope, GlobalId, Request, Response, WireError, WireRRef, WireValue};

/// The result of a call, awaitable or waitable any number of times.
pub type RpcFuture = Completion<Result<Payload, RpcError>>;

/// Only one agent runs in a process at a time.
static RUNNING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

const RUNNING_STATE: u8 = 0;
const DOWN: u8 = 2;

/// Received buffers at least this large are recycled once every user has dropped them.
const POOL_MIN: usize = 256 << 10;
const POOL_KEEP: usize = 8;

/// The internal handler that takes over the embedded store from a leaving host.
const H_TAKEOVER: &str = "sluice.store.takeover";

struct Peer {
    info: WorkerInfo,
    announce: Announce,
    /// The open pipe: `None` before the first call and after a failure.
    pipe: Mutex<Option<(u64, Pipe)>>,
    /// The read role of the open pipe: who reads its replies (see [`crate::reader`]).
    reader: Mutex<Option<Arc<dyn Driver>>>,
    /// Serializes opening a pipe.
    connecting: tokio::sync::Mutex<()>,
    /// Bumped for every new pipe, so a stale pipe's failure is not blamed on the new one.
    generation: AtomicU64,
    /// Set while the peer is lost and not reconnected; new calls fail at once with it.
    down: Mutex<Option<String>>,
    /// The peer said goodbye: its pipes closing is a leave, not a loss.
    leaving: AtomicBool,
    /// When a message last arrived on our pipe to it, and when we last wrote one (ms on the
    /// agent's clock). Either silent for an interval sends a ping: the callee judges us by
    /// what we send, we judge it by what it answers.
    last_heard: AtomicU64,
    last_sent: AtomicU64,
    /// My device map to this peer, and its map to me (for responses).
    map_to: Option<DeviceMap>,
    map_from: Option<DeviceMap>,
}

/// The group as this worker knows it.
#[derive(Default)]
struct Members {
    by_id: HashMap<u32, Arc<Peer>>,
    by_name: HashMap<String, u32>,
    /// Ids that are gone, and why: errors about them still name the worker.
    gone: HashMap<u32, (WorkerInfo, String)>,
}

type ResultSlot = Arc<Slot<Result<Payload, RpcError>>>;

pub(crate) struct AgentInner {
    pub(crate) me: WorkerInfo,
    announce: Announce,
    members: RwLock<Members>,
    /// The fixed group's size (zero for an elastic join).
    static_world: u32,
    pub(crate) options: AgentOptions,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    pub(crate) handle: tokio::runtime::Handle,
    context: Context,
    registry: Registry,
    pool: Pool,
    store: Store,
    store_url: StoreUrl,
    secret: Option<sluice_channel::Secret>,
    store_server: Mutex<Option<StoreServer>>,
    subscribers: Subscribers,
    clock: Instant,
    counter: AtomicU64,
    calls: Mutex<Calls<ResultSlot>>,
    timer: tokio::sync::Notify,
    /// When the deadline timer looks next (ms on the agent's clock): a call whose deadline is
    /// later needs no wake-up (one per call would cost a runtime thread's wake-up each).
    timer_due: AtomicU64,
    state: AtomicU8,
    /// Handlers running, control messages in flight: outstanding work for shutdown.
    handlers_running: AtomicI64,
    pub(crate) control_in_flight: AtomicI64,
    /// Requests and replies seen since the last shutdown round.
    activity: AtomicU64,
    pub(crate) rrefs: RRefTable,
    incoming: Mutex<Vec<Pipe>>,
    /// Requests being served: their caller's budget and size, released by the reply.
    held: Mutex<HashMap<(u32, u64), Held>>,
    drop_control: AtomicUsize,
    recv_pool: Mutex<Vec<Bytes>>,
    /// Streams incoming CUDA tensors land on, and fetched RRef values leave from.
    streams: StreamPool,
}

/// A handle to this process's agent. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
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
        let result = init(options, registry);
        if result.is_err() {
            RUNNING.store(false, Ordering::Release);
        }
        result
    }

    pub fn info(&self) -> &WorkerInfo {
        &self.inner.me
    }

    /// The workers of the group now, by id.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let m = self.inner.members.read().unwrap();
        let mut w: Vec<WorkerInfo> = m.by_id.values().map(|p| p.info.clone()).collect();
        w.sort_by_key(|w| w.id);
        w
    }

    /// The worker `dest` names.
    pub fn worker(&self, dest: impl Into<Dest>) -> Result<WorkerInfo, RpcError> {
        let id = self.inner.resolve(&dest.into())?;
        self.inner.peer(id).map(|p| p.info.clone())
    }

    /// Membership changes from now on, as a channel (each call makes a new subscriber).
    pub fn membership_events(&self) -> crossbeam_channel::Receiver<MembershipEvent> {
        self.inner.subscribers.channel()
    }

    /// Calls `f` on every membership change from now on. It runs on the agent's I/O threads:
    /// keep it short and never block in it.
    pub fn on_membership(&self, f: impl Fn(&MembershipEvent) + Send + Sync + 'static) {
        self.inner.subscribers.callback(Arc::new(f));
    }

    /// The store's address now (it moves when its host leaves).
    pub fn store_address(&self) -> String {
        self.inner.store.address()
    }

    /// Calls `handler` on `dest` and returns the reply's future at once. The deadline is the
    /// default timeout from now.
    pub fn rpc_async(&self, dest: impl Into<Dest>, handler: &str, payload: Payload) -> RpcFuture {
        self.rpc_async_timeout(dest, handler, payload, self.inner.options.default_timeout)
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
            handler: handler.to_owned(),
        };
        match self.inner.resolve(&dest.into()) {
            Ok(rank) => self.inner.start_call(rank, body, payload, timeout),
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
        self.remote_timeout(dest, handler, payload, self.inner.options.default_timeout)
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
        let id = inner.global_id();
        let (state, fork) = if owner == inner.me.id {
            inner.rrefs.owner_created(id);
            (RRefState::owner(inner, id), None)
        } else {
            let fork = inner.global_id();
            (RRefState::user(inner, owner, id, fork, true), Some(fork))
        };
        let body = Body::Remote {
            handler: handler.to_owned(),
            rref: id,
            fork,
        };
        let created = inner.start_call(owner, body, payload, timeout);
        state.set_creation(created);
        Ok(RRef::from_state(state))
    }

    /// A reference owned by this worker, holding `value`.
    pub fn rref<T: Serialize + Send + Sync + 'static>(&self, value: T) -> RRef<T> {
        let id = self.inner.global_id();
        self.inner.rrefs.owner_created(id);
        self.inner.rrefs.set_value(id, Ok(Value::object(value)));
        RRef::from_state(RRefState::owner(&self.inner, id))
    }

    /// Waits until every worker of the group has called `barrier` with the same `key` (each key
    /// once). The group is the fixed world for a fixed group, else the members at each check.
    /// Call it from a plain thread.
    pub fn barrier(&self, key: &str) -> Result<(), RpcError> {
        let inner = &self.inner;
        inner.check_running()?;
        let timeout = Duration::from_secs(365 * 24 * 3600);
        inner
            .handle
            .block_on(inner.group_barrier(&format!("user/{key}"), timeout))
            .map_err(|e| RpcError::Store(e.to_string()))
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
        &self.inner.announce.address
    }

    /// The pipe info of this worker's pipe to `dest`, if one is open.
    pub fn pipe_info(&self, dest: impl Into<Dest>) -> Option<sluice_channel::PipeInfo> {
        let id = self.inner.resolve(&dest.into()).ok()?;
        let peer = self.inner.peer(id).ok()?;
        let pipe = peer.pipe.lock().unwrap();
        pipe.as_ref().map(|(_, p)| p.info().clone())
    }
}

fn store_error(e: StoreError) -> InitError {
    match e {
        StoreError::Timeout { key, timeout } => InitError::Timeout {
            timeout,
            waiting_for: format!("store key `{key}` (is every worker started?)"),
        },
        other => InitError::Store(other.to_string()),
    }
}

fn init(options: AgentOptions, mut registry: Registry) -> Result<Agent, InitError> {
    validate_name(&options.name)?;
    if let Some(devices) = &options.devices {
        gpu::check_local(&options.name, devices)?;
    }
    let resolved = options::resolve(&options)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.io_threads)
        .thread_name(format!("sluice-io-{}", options.name))
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    let deadline = Instant::now() + options.init_timeout;
    let left = move || deadline.saturating_duration_since(Instant::now());
    registry.handler(H_TAKEOVER, |ctx: &CallContext, snapshot: Snapshot| {
        ctx.agent
            .inner
            .take_over_store(snapshot)
            .map_err(|e| HandlerError::new("StoreTakeover", e.to_string()))
    });

    let (store_server, store, context, mut listener, announce, listing, restart) = runtime.block_on(async {
        // A launcher that serves the store itself says so (`SLUICE_STORE_SERVED`).
        let serves = matches!(resolved.store, StoreUrl::Tcp(_))
            && resolved.rank == Some(options.store_rank)
            && std::env::var_os("SLUICE_STORE_SERVED").is_none();
        let server = match (&resolved.store, serves) {
            (StoreUrl::Tcp(addr), true) => {
                match StoreServer::start_with(addr, Snapshot::default(), resolved.secret.clone()).await {
                    Ok(s) => Some(s),
                    Err(e) => return Err(InitError::Store(e.to_string())),
                }
            }
            _ => None,
        };
        let store = Store::connect(&resolved.store, left(), resolved.secret.clone())
            .await
            .map_err(store_error)?;
        // A name seen before means a restart: this incarnation gets a fresh id.
        let name_key = membership::name_key(&options.name);
        let name_seen = store
            .list(&name_key)
            .await
            .map_err(store_error)?
            .entries
            .iter()
            .any(|(k, _)| *k == name_key);
        // In a fixed group a seen name is a restart only once the group has formed; before
        // that it is a duplicate, which validation reports.
        let restart = match resolved.rank {
            Some(_) if name_seen => store.add("init", 0).await.map_err(store_error)? >= resolved.world_size as i64,
            _ => name_seen,
        };
        let id = match resolved.rank {
            Some(rank) if !restart => rank,
            _ => {
                let n = store.add("ids/next", 1).await.map_err(store_error)?;
                let id = membership::ELASTIC_BASE as i64 + n - 1;
                if id > membership::MAX_ID as i64 {
                    return Err(InitError::Config(format!(
                        "the group has handed out every worker id ({} joins)",
                        n
                    )));
                }
                id as u32
            }
        };
        let mut pipe_options = options.pipe.clone();
        pipe_options.name = options.name.clone();
        pipe_options.secret = resolved.secret.clone();
        let context = Context::new(pipe_options)?;
        let listener = context.listen(&options.listen).await?;
        let announce = Announce {
            version: wire::AGENT_VERSION,
            name: options.name.clone(),
            id,
            address: listener.address().to_owned(),
            devices: WorkerDevices {
                name: options.name.clone(),
                devices: options.devices.clone().unwrap_or_else(gpu::local_devices),
                maps: options.device_maps.clone(),
            },
        };
        // A live member with our name is either a duplicate or our own crashed incarnation
        // whose membership has not expired yet: wait for it to go.
        let mut listing = store.list("m/").await.map_err(store_error)?;
        while restart || resolved.rank.is_none() {
            let (live, _) = membership::parse_listing(&listing.entries);
            let Some(other) = live.values().find(|a| a.name == options.name) else {
                break;
            };
            if left().is_zero() {
                return Err(InitError::DuplicateName {
                    name: options.name.clone(),
                    first: other.id,
                    second: id,
                });
            }
            if let Some(l) = store.watch("m/", listing.revision, left()).await.map_err(store_error)? {
                listing = l;
            }
        }
        let bytes = postcard::to_allocvec(&announce).map_err(|e| InitError::Config(e.to_string()))?;
        store
            .set_ephemeral(&membership::live_key(id), bytes)
            .await
            .map_err(store_error)?;
        store
            .set(&name_key, id.to_string().into_bytes())
            .await
            .map_err(store_error)?;
        // A fixed group's first start waits for every rank.
        let mut listing = store.list("m/").await.map_err(store_error)?;
        if resolved.rank.is_some() && !restart {
            loop {
                let (live, _) = membership::parse_listing(&listing.entries);
                if (0..resolved.world_size).all(|r| live.contains_key(&r)) {
                    break;
                }
                let missing: Vec<u32> = (0..resolved.world_size).filter(|r| !live.contains_key(r)).collect();
                match store.watch("m/", listing.revision, left()).await.map_err(store_error)? {
                    Some(l) => listing = l,
                    None => {
                        return Err(InitError::Timeout {
                            timeout: options.init_timeout,
                            waiting_for: format!("ranks {missing:?} to join (is every worker started?)"),
                        })
                    }
                }
            }
        }
        if resolved.rank.is_some() && !restart {
            // The store's host stays until everyone has read the complete group, even when
            // validation is about to fail (all workers then report the same error).
            store.add("init/read", 1).await.map_err(store_error)?;
            if server.is_some() {
                store
                    .wait_count("init/read", resolved.world_size as i64, left())
                    .await
                    .map_err(store_error)?;
            }
        }
        Ok::<_, InitError>((server, store, context, listener, announce, listing, restart))
    })?;

    let (live, _) = membership::parse_listing(&listing.entries);
    for a in live.values() {
        if a.version != wire::AGENT_VERSION {
            return Err(InitError::Config(format!(
                "worker {} ({}) speaks agent protocol version {}, this worker speaks {}",
                a.id,
                a.name,
                a.version,
                wire::AGENT_VERSION
            )));
        }
        validate_name(&a.name)?;
    }
    let mut names = HashMap::new();
    for a in live.values() {
        if let Some(first) = names.insert(a.name.clone(), a.id) {
            return Err(InitError::DuplicateName {
                name: a.name.clone(),
                first,
                second: a.id,
            });
        }
    }
    let devices: Vec<WorkerDevices> = live.values().map(|a| a.devices.clone()).collect();
    if resolved.rank.is_some() && !restart {
        device_map::validate(&devices)?;
    } else {
        // Peers named in maps may join later; what is here must still be consistent.
        device_map::validate_present(&devices)?;
    }

    let me = WorkerInfo {
        name: options.name.clone(),
        id: announce.id,
    };
    let pool = Pool::new(&format!("sluice-handler-{}", options.name), options.pool_threads);
    let inner = Arc::new(AgentInner {
        me,
        announce: announce.clone(),
        members: RwLock::new(Members::default()),
        static_world: resolved.world_size,
        runtime: Mutex::new(None),
        handle: handle.clone(),
        context,
        registry,
        pool,
        store,
        store_url: resolved.store.clone(),
        secret: resolved.secret.clone(),
        store_server: Mutex::new(store_server),
        subscribers: Subscribers::default(),
        clock: Instant::now(),
        counter: AtomicU64::new(0),
        calls: Mutex::new(Calls::default()),
        timer: tokio::sync::Notify::new(),
        timer_due: AtomicU64::new(0),
        state: AtomicU8::new(RUNNING_STATE),
        handlers_running: AtomicI64::new(0),
        control_in_flight: AtomicI64::new(0),
        activity: AtomicU64::new(0),
        rrefs: RRefTable::default(),
        incoming: Mutex::new(Vec::new()),
        held: Mutex::new(HashMap::new()),
        drop_control: AtomicUsize::new(options.faults.drop_control),
        recv_pool: Mutex::new(Vec::new()),
        streams: StreamPool::default(),
        options,
    });
    {
        let mut m = inner.members.write().unwrap();
        for a in live.values() {
            inner.add_member(&mut m, a.clone());
        }
    }

    let weak = Arc::downgrade(&inner);
    handle.spawn(async move {
        loop {
            let accepted = listener.accept().await;
            let Some(inner) = weak.upgrade() else { return };
            if inner.is_down() {
                return;
            }
            match accepted {
                Ok(pipe) => {
                    inner.incoming.lock().unwrap().push(pipe.clone());
                    tokio::spawn(serve_pipe(inner, pipe));
                }
                Err(e) => tracing::warn!(worker = %inner.me, error = %e, "refused an incoming pipe"),
            }
        }
    });
    handle.spawn(run_timer(Arc::downgrade(&inner)));
    handle.spawn(watch_members(Arc::downgrade(&inner), listing.revision));
    *inner.runtime.lock().unwrap() = Some(runtime);

    let agent = Agent { inner };
    let inner = &agent.inner;
    let fixed_start = resolved.rank.is_some() && !restart;
    let result = handle.block_on(async {
        if fixed_start {
            inner
                .store
                .barrier("init", inner.static_world, left())
                .await
                .map_err(store_error)?;
        }
        if inner.options.connect == Connect::Eager {
            let ids: Vec<u32> = inner.members.read().unwrap().by_id.keys().copied().collect();
            for id in ids {
                inner.pipe_to(id).await.map_err(|e| InitError::Config(e.to_string()))?;
            }
        }
        Ok::<_, InitError>(())
    });
    if let Err(e) = result {
        agent.inner.teardown();
        return Err(e);
    }
    tracing::debug!(worker = %agent.inner.me, restart, "agent ready");
    Ok(agent)
}

/// Applies membership changes from the store as they happen.
async fn watch_members(weak: std::sync::Weak<AgentInner>, mut revision: u64) {
    let (url, secret) = match weak.upgrade() {
        Some(inner) => (inner.store_url.clone(), inner.secret.clone()),
        None => return,
    };
    // Its own connection: a watch is a long poll.
    let mut watcher: Option<Store> = None;
    let mut pause = Duration::from_millis(50);
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down() {
            return;
        }
        drop(inner);
        if watcher.is_none() {
            let Some(inner) = weak.upgrade() else { return };
            // Follow the main client's view of where the store is.
            let url = match &url {
                StoreUrl::Tcp(_) => StoreUrl::Tcp(inner.store.address()),
                other => other.clone(),
            };
            drop(inner);
            match Store::connect(&url, Duration::from_secs(2), secret.clone()).await {
                Ok(s) => watcher = Some(s),
                Err(e) => {
                    tracing::debug!(error = %e, "membership watcher cannot reach the store; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                    continue;
                }
            }
        }
        let w = watcher.as_ref().expect("connected above");
        match w.watch("m/", revision, Duration::from_secs(5)).await {
            Ok(Some(listing)) => {
                pause = Duration::from_millis(50);
                revision = listing.revision;
                let Some(inner) = weak.upgrade() else { return };
                if w.address() != inner.store.address() {
                    // The store moved (hand-off): take the main client along and re-assert
                    // our membership there at once.
                    inner.store.follow(&w.address()).await;
                    let _ = inner.store.list("m/live/").await;
                }
                inner.apply_listing(&listing).await;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e, "membership watch failed; reconnecting");
                watcher = None;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

impl AgentInner {
    fn is_down(&self) -> bool {
        self.state.load(Ordering::Acquire) == DOWN
    }

    pub(crate) fn check_running(&self) -> Result<(), RpcError> {
        if self.is_down() {
            Err(RpcError::Shutdown)
        } else {
            Ok(())
        }
    }

    fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    fn member_count(&self) -> u32 {
        self.members.read().unwrap().by_id.len() as u32
    }

    fn add_member(&self, m: &mut Members, a: Announce) -> Arc<Peer> {
        let info = WorkerInfo {
            name: a.name.clone(),
            id: a.id,
        };
        let peer = Arc::new(Peer {
            info: info.clone(),
            pipe: Mutex::new(None),
            reader: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            generation: AtomicU64::new(0),
            down: Mutex::new(None),
            leaving: AtomicBool::new(false),
            last_heard: AtomicU64::new(0),
            last_sent: AtomicU64::new(0),
            map_to: self.options.device_maps.get(&a.name).cloned(),
            map_from: a.devices.maps.get(&self.me.name).cloned(),
            announce: a,
        });
        // The newest incarnation owns the name.
        let newer = m.by_name.get(&info.name).is_none_or(|&old| old <= info.id);
        if newer {
            m.by_name.insert(info.name.clone(), info.id);
        }
        m.by_id.insert(info.id, peer.clone());
        peer
    }

    /// Diffs a listing of `m/` against the members known here and applies the changes.
    async fn apply_listing(self: &Arc<Self>, listing: &Listing) {
        let (live, left) = membership::parse_listing(&listing.entries);
        let known: HashMap<u32, Announce> = self
            .members
            .read()
            .unwrap()
            .by_id
            .iter()
            .map(|(id, p)| (*id, p.announce.clone()))
            .collect();
        let changes = membership::diff(&known, &live, &left);
        for a in changes.joined {
            if a.version != wire::AGENT_VERSION {
                tracing::warn!(worker = %a.name, version = a.version, "a worker with another protocol version joined; ignored");
                continue;
            }
            let info = {
                let mut m = self.members.write().unwrap();
                self.add_member(&mut m, a).info.clone()
            };
            self.subscribers.publish(MembershipEvent::Joined(info));
        }
        for (id, graceful) in changes.removed {
            if id == self.me.id {
                if self.is_down() {
                    continue;
                }
                // Our own membership vanished (an expired lease, a store that moved without
                // us): we are still here, so say so again.
                tracing::warn!(worker = %self.me, "this worker's membership vanished from the store; re-announcing");
                if let Ok(bytes) = postcard::to_allocvec(&self.announce) {
                    let _ = self.store.set_ephemeral(&membership::live_key(id), bytes).await;
                }
                continue;
            }
            let detail = if graceful {
                "left the group".to_owned()
            } else {
                "its membership expired without a goodbye (crashed, killed or cut off)".to_owned()
            };
            self.remove_member(id, graceful, detail);
        }
    }

    /// A member is gone for good (left, or its membership expired).
    fn remove_member(self: &Arc<Self>, id: u32, graceful: bool, detail: String) {
        let peer = {
            let mut m = self.members.write().unwrap();
            let Some(peer) = m.by_id.remove(&id) else { return };
            if m.by_name.get(&peer.info.name) == Some(&id) {
                m.by_name.remove(&peer.info.name);
                // An older incarnation still listed takes the name back only if it is alive.
                if let Some(other) = m
                    .by_id
                    .values()
                    .filter(|p| p.info.name == peer.info.name)
                    .map(|p| p.info.id)
                    .max()
                {
                    m.by_name.insert(peer.info.name.clone(), other);
                }
            }
            m.gone.insert(id, (peer.info.clone(), detail.clone()));
            peer
        };
        let was_down = peer.down.lock().unwrap().replace(detail.clone()).is_some();
        self.drop_peer_state(&peer, &detail);
        if graceful || peer.leaving.load(Ordering::Acquire) {
            self.subscribers.publish(MembershipEvent::Left(peer.info.clone()));
        } else if !was_down {
            self.subscribers.publish(MembershipEvent::Lost {
                worker: peer.info.clone(),
                detail,
            });
        }
    }

    /// Closes the peer's pipe, fails its calls and releases what it held here.
    fn drop_peer_state(&self, peer: &Peer, detail: &str) {
        if let Some((_, pipe)) = peer.pipe.lock().unwrap().take() {
            pipe.close();
        }
        peer.reader.lock().unwrap().take();
        let name = peer.info.name.clone();
        self.fail_calls(Some(peer.info.id), |_| RpcError::PeerLost {
            worker: name.clone(),
            detail: detail.to_owned(),
        });
        self.rrefs.peer_lost(peer.info.id);
    }

    /// Declares `id` lost (if `generation` is still its pipe's, or always with `None`). While
    /// it stays a member, a background task tries to reconnect.
    fn declare_lost(self: &Arc<Self>, id: u32, generation: Option<u64>, detail: String) {
        if self.is_down() {
            return;
        }
        let Ok(peer) = self.peer(id) else { return };
        if generation.is_some_and(|g| g != peer.generation.load(Ordering::Acquire)) {
            return;
        }
        {
            let mut down = peer.down.lock().unwrap();
            if down.is_some() {
                return;
            }
            *down = Some(detail.clone());
        }
        let leaving = peer.leaving.load(Ordering::Acquire);
        let detail = if leaving {
            format!("{detail} (it is leaving the group)")
        } else {
            detail
        };
        tracing::info!(worker = %self.me, peer = %peer.info, %detail, "peer lost");
        self.drop_peer_state(&peer, &detail);
        if leaving {
            return;
        }
        self.subscribers.publish(MembershipEvent::Lost {
            worker: peer.info.clone(),
            detail,
        });
        if id != self.me.id {
            self.handle.spawn(reconnect(Arc::downgrade(self), peer));
        }
    }

    pub(crate) fn resolve(&self, dest: &Dest) -> Result<u32, RpcError> {
        let find = |m: &Members| match dest {
            Dest::Name(n) => m.by_name.get(n).copied(),
            Dest::Rank(r) => (m.by_id.contains_key(r) || m.gone.contains_key(r)).then_some(*r),
        };
        if let Some(id) = find(&self.members.read().unwrap()) {
            return Ok(id);
        }
        // The watcher may not have seen a fresh join yet: ask the store (from plain threads).
        if tokio::runtime::Handle::try_current().is_err()
            && !self.is_down()
            && self.handle.block_on(self.absorb_joins())
        {
            if let Some(id) = find(&self.members.read().unwrap()) {
                return Ok(id);
            }
        }
        Err(RpcError::UnknownWorker {
            dest: dest.to_string(),
            world_size: self.member_count(),
        })
    }

    /// The live member `id`, or the error that says why there is none.
    fn peer(&self, id: u32) -> Result<Arc<Peer>, RpcError> {
        let m = self.members.read().unwrap();
        if let Some(p) = m.by_id.get(&id) {
            return Ok(p.clone());
        }
        match m.gone.get(&id) {
            Some((info, detail)) => Err(RpcError::PeerLost {
                worker: info.name.clone(),
                detail: format!("{} {detail}", info),
            }),
            None => Err(RpcError::UnknownWorker {
                dest: format!("id {id}"),
                world_size: m.by_id.len() as u32,
            }),
        }
    }

    pub(crate) fn name_of(&self, id: u32) -> String {
        self.worker_info(id).name
    }

    pub(crate) fn worker_info(&self, id: u32) -> WorkerInfo {
        let m = self.members.read().unwrap();
        if let Some(p) = m.by_id.get(&id) {
            return p.info.clone();
        }
        match m.gone.get(&id) {
            Some((info, _)) => info.clone(),
            None => WorkerInfo {
                name: format!("worker-{id}"),
                id,
            },
        }
    }

    /// A fresh `worker << 48 | counter` id.
    fn next_id(&self) -> u64 {
        (self.me.id as u64) << 48 | self.counter.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn global_id(&self) -> GlobalId {
        GlobalId {
            worker: self.me.id,
            local: self.counter.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A barrier over the group: the fixed world, or (elastic) the members at each check.
    async fn group_barrier(&self, key: &str, timeout: Duration) -> Result<(), StoreError> {
        let start = Instant::now();
        self.store.add(key, 1).await?;
        loop {
            let world = if self.static_world > 0 {
                self.static_world.min(self.member_count())
            } else {
                self.member_count()
            };
            let step = Duration::from_millis(250).min(timeout.saturating_sub(start.elapsed()));
            match self.store.wait_count(key, world as i64, step).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Timeout { .. }) if start.elapsed() < timeout => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Serves the embedded store from here, from a leaving host's snapshot.
    fn take_over_store(&self, snapshot: Snapshot) -> Result<String, StoreError> {
        let addr = match &self.options.store_listen {
            Some(a) => a.clone(),
            None => {
                let host = self.announce.address.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
                format!("{host}:0")
            }
        };
        let server = self
            .handle
            .block_on(StoreServer::start_with(&addr, snapshot, self.secret.clone()))?;
        let address = server.address().to_owned();
        tracing::info!(worker = %self.me, %address, "took over the store");
        *self.store_server.lock().unwrap() = Some(server);
        Ok(address)
    }

    fn leave(self: &Arc<Self>, timeout: Duration) -> Result<(), ShutdownError> {
        if self.is_down() {
            return Err(ShutdownError::AlreadyShutDown);
        }
        let start = Instant::now();
        let id = self.me.id;
        // The marker first: whoever sees our key go also sees that we left. The store moves
        // (if we serve it) before our key goes, so the successor hears of the leave as a leave.
        if let Err(e) = self
            .handle
            .block_on(self.store.set(&membership::left_key(id), Vec::new()))
        {
            self.teardown();
            return Err(ShutdownError::Store(e.to_string()));
        }
        let handed = self.hand_off_store();
        if let Err(e) = self.handle.block_on(self.store.delete(&membership::live_key(id))) {
            self.teardown();
            return Err(ShutdownError::Store(e.to_string()));
        }
        // Our own work drains (replies to us, handlers we run, control messages).
        let mut last = self.outstanding();
        while last > 0 && start.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(2));
            last = self.outstanding();
        }
        // Goodbye on every pipe, so peers take the closing for a leave.
        let goodbye = Message {
            metadata: wire::encode(&Envelope::Goodbye),
            ..Message::default()
        };
        let pipes: Vec<Pipe> = {
            let m = self.members.read().unwrap();
            let mut p: Vec<Pipe> = m
                .by_id
                .values()
                .filter_map(|peer| peer.pipe.lock().unwrap().as_ref().map(|(_, p)| p.clone()))
                .collect();
            p.extend(self.incoming.lock().unwrap().iter().cloned());
            p
        };
        self.handle.block_on(async {
            for p in pipes {
                let _ = tokio::time::timeout(Duration::from_millis(500), p.write(&goodbye)).await;
            }
        });
        self.handle.block_on(self.store.close());
        self.teardown();
        handed?;
        if last > 0 {
            return Err(ShutdownError::Timeout {
                timeout,
                outstanding: last,
            });
        }
        Ok(())
    }

    /// If this worker serves the embedded store, hands it to the member with the lowest id.
    fn hand_off_store(self: &Arc<Self>) -> Result<(), ShutdownError> {
        let guard = self.store_server.lock().unwrap();
        let Some(server) = guard.as_ref() else { return Ok(()) };
        let successor = {
            let m = self.members.read().unwrap();
            m.by_id
                .values()
                .filter(|p| p.info.id != self.me.id && p.down.lock().unwrap().is_none())
                .map(|p| p.info.id)
                .min()
        };
        let Some(successor) = successor else {
            tracing::info!(worker = %self.me, "last member leaving; the store goes with it");
            return Ok(());
        };
        server.freeze();
        let snapshot = server.snapshot();
        let payload = match Payload::encode(&snapshot) {
            Ok(p) => p,
            Err(e) => return Err(ShutdownError::Store(e.to_string())),
        };
        let body = Body::Call {
            handler: H_TAKEOVER.to_owned(),
        };
        let reply = self
            .start_call(successor, body, payload, Duration::from_secs(30))
            .wait();
        match reply.and_then(|p| p.decode::<String>()) {
            Ok(addr) => {
                server.moved_to(&addr);
                tracing::info!(worker = %self.me, to = successor, %addr, "store handed off");
                drop(guard);
                // Long polls hear `Moved` at once; give them a moment to read it.
                std::thread::sleep(Duration::from_millis(200));
                Ok(())
            }
            Err(e) => {
                server.unfreeze();
                Err(ShutdownError::Store(format!(
                    "could not hand the store to worker {successor}: {e}"
                )))
            }
        }
    }

    /// True if `id` is (or was: a leaving worker finishing its work) a member, asking the
    /// store when the watcher has not seen it yet.
    async fn known_or_refreshed(&self, id: u32) -> bool {
        {
            let m = self.members.read().unwrap();
            if m.by_id.contains_key(&id) || m.gone.contains_key(&id) {
                return true;
            }
        }
        self.absorb_joins().await && self.members.read().unwrap().by_id.contains_key(&id)
    }

    /// Reads the membership from the store now and adds the live workers not known here (the
    /// watcher may lag behind a fresh join), publishing their joins. False if the store did
    /// not answer within 5 s.
    async fn absorb_joins(&self) -> bool {
        let Ok(Ok(listing)) = tokio::time::timeout(Duration::from_secs(5), self.store.list("m/")).await else {
            return false;
        };
        let (live, _) = membership::parse_listing(&listing.entries);
        let mut joined = Vec::new();
        {
            let mut m = self.members.write().unwrap();
            for a in live.into_values() {
                if !m.by_id.contains_key(&a.id) && !m.gone.contains_key(&a.id) && a.version == wire::AGENT_VERSION {
                    joined.push(self.add_member(&mut m, a).info.clone());
                }
            }
        }
        for info in joined {
            self.subscribers.publish(MembershipEvent::Joined(info));
        }
        true
    }

    /// Registers a call and sends it; the returned completion gets the reply or an error.
    pub(crate) fn start_call(
        self: &Arc<Self>,
        dest: u32,
        body: Body,
        payload: Payload,
        timeout: Duration,
    ) -> RpcFuture {
        if let Err(e) = self.check_running() {
            return Completion::ready(Err(e));
        }
        let peer = match self.peer(dest) {
            Ok(p) => p,
            Err(e) => return Completion::ready(Err(e)),
        };
        if let Some(detail) = peer.down.lock().unwrap().clone() {
            return Completion::ready(Err(RpcError::PeerLost {
                worker: peer.info.name.clone(),
                detail,
            }));
        }
        let control = body.is_control();
        let id = self.next_id();
        let Outgoing {
            value,
            frames,
            tensors,
            forks,
        } = match self.outgoing_value(&payload, dest, peer.map_to.as_ref(), false) {
            Ok(v) => v,
            Err(e) => return Completion::ready(Err(e)),
        };
        let message = build_message(Envelope::Request(Request { id, body, value }), frames, tensors);
        let slot = Slot::new();
        let sooner = self
            .calls
            .lock()
            .unwrap()
            .register(id, dest, timeout, Instant::now(), slot.clone());
        if let Some(d) = sooner {
            let due_ms = d.saturating_duration_since(self.clock).as_millis() as u64;
            if due_ms < self.timer_due.load(Ordering::Acquire) {
                self.timer.notify_one();
            }
        }
        self.activity.fetch_add(1, Ordering::Relaxed);
        if control && self.drop_control.load(Ordering::Relaxed) > 0 && self.take_drop() {
            tracing::debug!(id, "fault injection: dropping a control message");
            return Completion::new(slot);
        }
        let duplicate = control && self.options.faults.duplicate_control;
        let peer_for_driver = peer.clone();
        let inner = self.clone();
        let send = async move {
            let result = async {
                let pipe = inner.pipe_for(&peer).await?;
                pipe.write(&message)
                    .await
                    .map_err(|e| RpcError::from_pipe(&peer.info.name, e))?;
                // The heartbeat pings only pipes quiet both ways.
                peer.last_sent.store(inner.now_ms(), Ordering::Relaxed);
                if duplicate {
                    // Same id: the second reply finds no pending call and is dropped.
                    pipe.write(&message)
                        .await
                        .map_err(|e| RpcError::from_pipe(&inner.name_of(dest), e))?;
                }
                Ok::<_, RpcError>(())
            }
            .await;
            if let Err(e) = result {
                inner.rrefs.undo_forks(&forks);
                inner.finish_call(id, Err(e));
            }
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            self.handle.spawn(send);
        } else {
            self.handle.block_on(send);
        }
        // Whoever waits for the reply may read it itself (the pipe is open by now when the
        // request was written on this thread).
        let driver = peer_for_driver.reader.lock().unwrap().clone();
        Completion::driven(slot, driver)
    }

    fn take_drop(&self) -> bool {
        self.drop_control
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Completes a pending call (once). A call already completed (timed out) is ignored, and so
    /// is its late reply.
    fn finish_call(&self, id: u64, result: Result<Payload, RpcError>) -> bool {
        let pending = self.calls.lock().unwrap().complete(id);
        match pending {
            Some(p) => {
                p.slot.complete(result);
                true
            }
            None => {
                tracing::debug!(id, "reply for a call that already finished (timed out); discarded");
                false
            }
        }
    }

    /// Fails every pending call to `rank` (or to everyone) with `error`.
    fn fail_calls(&self, rank: Option<u32>, error: impl Fn(u32) -> RpcError) {
        let failed = self.calls.lock().unwrap().fail(rank);
        for p in failed {
            p.slot.complete(Err(error(p.peer)));
        }
    }

    /// The pipe to `id`, opened on first use; its reader task delivers replies and its
    /// heartbeat task watches it.
    async fn pipe_to(self: &Arc<Self>, id: u32) -> Result<Pipe, RpcError> {
        self.pipe_for(&self.peer(id)?).await
    }

    /// [`pipe_to`](Self::pipe_to) for a peer already looked up.
    async fn pipe_for(self: &Arc<Self>, peer: &Arc<Peer>) -> Result<Pipe, RpcError> {
        if let Some((_, p)) = peer.pipe.lock().unwrap().as_ref() {
            return Ok(p.clone());
        }
        let _connecting = peer.connecting.lock().await;
        if let Some(detail) = peer.down.lock().unwrap().clone() {
            return Err(RpcError::PeerLost {
                worker: peer.info.name.clone(),
                detail,
            });
        }
        if let Some((_, p)) = peer.pipe.lock().unwrap().as_ref() {
            return Ok(p.clone());
        }
        self.open_pipe(peer).await
    }

    /// Opens a new pipe to `peer` and starts its reader and heartbeat.
    async fn open_pipe(self: &Arc<Self>, peer: &Arc<Peer>) -> Result<Pipe, RpcError> {
        let name = peer.info.name.clone();
        let address = &peer.announce.address;
        let pipe = self.context.connect(address).await.map_err(|e| match e {
            PipeError::Transport(_) | PipeError::Timeout { .. } => RpcError::PeerLost {
                worker: name.clone(),
                detail: format!("cannot open a pipe to {address}: {e}"),
            },
            other => RpcError::Pipe {
                worker: name.clone(),
                error: other,
            },
        })?;
        let hello = Message {
            metadata: wire::encode(&Envelope::Hello {
                rank: self.me.id,
                version: wire::AGENT_VERSION,
                heartbeat_ms: self.options.heartbeat_interval.as_millis() as u64,
            }),
            ..Message::default()
        };
        pipe.write(&hello).await.map_err(|e| RpcError::from_pipe(&name, e))?;
        let generation = peer.generation.fetch_add(1, Ordering::AcqRel) + 1;
        peer.last_heard.store(self.now_ms(), Ordering::Release);
        peer.last_sent.store(self.now_ms(), Ordering::Release);
        *peer.pipe.lock().unwrap() = Some((generation, pipe.clone()));
        let replies = PeerReplies {
            inner: Arc::downgrade(self),
            peer: peer.clone(),
            generation,
            handle: self.handle.clone(),
        };
        let reader = ReplyReader::new(replies, pipe.clone());
        *peer.reader.lock().unwrap() = Some(reader.clone());
        tokio::spawn(reader.background());
        if !self.options.heartbeat_interval.is_zero() {
            tokio::spawn(heartbeat(Arc::downgrade(self), peer.clone(), generation, pipe.clone()));
        }
        Ok(pipe)
    }

    /// Prepares a value for `dest`: RRef forks, tensor placement (`reverse` for replies).
    fn outgoing_value(
        self: &Arc<Self>,
        payload: &Payload,
        dest: u32,
        map: Option<&DeviceMap>,
        reverse: bool,
    ) -> Result<Outgoing, RpcError> {
        let dest_name = &self.name_of(dest);
        let mut tensors = Vec::with_capacity(payload.tensors.len());
        for t in &payload.tensors {
            let device = t.buffer.device();
            let target = if reverse {
                device_map::reverse(map, device, dest_name)?
            } else {
                device_map::forward(map, device, dest_name)?
            };
            let mut t = t.clone();
            t.target_device = Some(target);
            tensors.push(t);
        }
        let mut forks = Vec::new();
        let rrefs = payload
            .rrefs
            .iter()
            .map(|r| {
                let fork = self.rrefs.fork_for(self, r, dest);
                forks.push(fork);
                WireRRef {
                    owner: r.owner,
                    id: r.id,
                    fork,
                    parent: self.me.id,
                }
            })
            .collect();
        let inline = payload.bytes.len() <= wire::INLINE_LIMIT;
        let value = WireValue {
            inline: if inline { payload.bytes.clone() } else { Bytes::new() },
            in_payload: !inline,
            rrefs,
        };
        let frames = if inline {
            Vec::new()
        } else {
            vec![payload.bytes.clone()]
        };
        Ok(Outgoing {
            value,
            frames,
            tensors,
            forks,
        })
    }

    /// Memory for an incoming message: recycled CPU buffers for large tensors when possible;
    /// CUDA tensors on their target device, one pooled stream per device. A target this
    /// worker does not have (a peer's stale or hostile map) or a failed device allocation is
    /// an error: the message cannot be placed.
    fn allocate(&self, d: &Descriptor) -> Result<Allocation, String> {
        let mut streams: Vec<(u32, sluice_channel::Stream)> = Vec::new();
        let mut tensors = Vec::with_capacity(d.tensors.len());
        for t in &d.tensors {
            let len = t.length as usize;
            tensors.push(match t.target_device.unwrap_or(Device::Cpu) {
                Device::Cuda(i) => {
                    let stream = match streams.iter().find(|(d, _)| *d == i) {
                        Some((_, s)) => s.clone(),
                        None => {
                            let s = self
                                .streams
                                .next(i)
                                .map_err(|e| format!("cannot place a tensor on cuda:{i}: {e}"))?;
                            streams.push((i, s.clone()));
                            s
                        }
                    };
                    RecvBuffer::Cuda(
                        sluice_channel::CudaBuffer::alloc_cached(len, &stream)
                            .map_err(|e| format!("cannot allocate {len} bytes on cuda:{i}: {e}"))?,
                    )
                }
                _ => RecvBuffer::Cpu(self.recv_buffer(len)),
            });
        }
        Ok(Allocation {
            payloads: d
                .payload_lengths
                .iter()
                .map(|&l| BytesMut::zeroed(l as usize))
                .collect(),
            tensors,
        })
    }

    fn recv_buffer(&self, len: usize) -> BytesMut {
        if len >= POOL_MIN {
            let mut pool = self.recv_pool.lock().unwrap();
            let mut i = 0;
            while i < pool.len() {
                if pool[i].len() == len && pool[i].is_unique() {
                    let b = pool.swap_remove(i);
                    if let Ok(m) = b.try_into_mut() {
                        return m;
                    }
                } else {
                    i += 1;
                }
            }
        }
        BytesMut::zeroed(len)
    }

    fn keep_for_reuse(&self, b: &Bytes) {
        if b.len() >= POOL_MIN {
            let mut pool = self.recv_pool.lock().unwrap();
            if pool.len() >= POOL_KEEP {
                // Forget the oldest; it is freed when its user drops it.
                pool.remove(0);
            }
            pool.push(b.clone());
        }
    }

    /// Turns a received message into its envelope and value.
    fn receive(
        self: &Arc<Self>,
        sender: u32,
        d: &Descriptor,
        allocation: Allocation,
    ) -> Result<(Envelope, Option<Payload>), String> {
        let envelope = wire::decode(&d.metadata)?;
        let mut payloads = allocation.payloads.into_iter();
        let tensors = allocation
            .tensors
            .into_iter()
            .zip(&d.tensors)
            .map(|(b, td)| {
                let buffer = b.freeze();
                if let Some(bytes) = buffer.as_cpu() {
                    self.keep_for_reuse(bytes);
                }
                Tensor {
                    buffer,
                    metadata: td.metadata.clone(),
                    target_device: None,
                }
            })
            .collect::<Vec<_>>();
        let value = match &envelope {
            Envelope::Request(r) => Some(&r.value),
            Envelope::Response(Response { result: Ok(v), .. }) => Some(v),
            _ => None,
        };
        let payload = match value {
            None => None,
            Some(v) => {
                let bytes = if v.in_payload {
                    payloads
                        .next()
                        .ok_or("the value announced a payload that the message lacks")?
                        .freeze()
                } else {
                    v.inline.clone()
                };
                let rrefs = v
                    .rrefs
                    .iter()
                    .map(|w| self.rrefs.materialize(self, w, sender))
                    .collect();
                let mut payload = Payload {
                    bytes,
                    tensors,
                    rrefs,
                    events: Vec::new(),
                };
                // The copies into CUDA tensors are queued, not done: mark them.
                gpu::record_events(&mut payload).map_err(|e| format!("recording arrival events: {e}"))?;
                Some(payload)
            }
        };
        Ok((envelope, payload))
    }

    /// Starts the request's work. Work that runs on this task (async handlers, RRef fetches,
    /// control replies) comes back as a future for the reader to poll at once, so a handler
    /// that finishes without waiting replies with no task switch; the reader spawns whatever is
    /// still pending.
    fn dispatch(
        self: &Arc<Self>,
        caller: u32,
        pipe: Pipe,
        request: Request,
        payload: Payload,
    ) -> Option<BoxFuture<()>> {
        let ctx = CallContext {
            agent: Agent { inner: self.clone() },
            caller: self.worker_info(caller),
            streams: payload.streams(),
        };
        let id = request.id;
        match request.body {
            Body::Call { handler } => self.run_handler(ctx, pipe, id, &handler, payload, None),
            Body::Remote { handler, rref, fork } => {
                if let Some(fork) = fork {
                    self.rrefs.add_fork_held(rref, fork, caller);
                }
                self.run_handler(ctx, pipe, id, &handler, payload, Some(rref))
            }
            Body::Fetch { rref } => {
                let value = self.rrefs.value(rref);
                let inner = self.clone();
                self.handlers_running.fetch_add(1, Ordering::AcqRel);
                Some(Box::pin(async move {
                    let mut pairs = Vec::new();
                    let result = match value.await {
                        Ok(v) => v
                            .to_payload()
                            .and_then(|mut p| {
                                // Send from a stream that waits for the value's own events.
                                pairs = gpu::restream(&mut p, &inner.streams)
                                    .map_err(|e| RpcError::Encode(format!("ordering the value's CUDA tensors: {e}")))?;
                                Ok(p)
                            })
                            .map_err(|e| WireError::Failed(e.to_string())),
                        Err(e) => Err(WireError::Failed(format!("RRef creation failed: {e}"))),
                    };
                    inner.reply(&pipe, caller, id, result).await;
                    gpu::rejoin(&pairs);
                    inner.handlers_running.fetch_sub(1, Ordering::AcqRel);
                }))
            }
            Body::Method { rref, handler } => {
                let Some(method) = self.registry.methods.get(&handler).cloned() else {
                    return Some(self.reply_later(pipe, caller, id, Err(WireError::UnknownHandler(handler))));
                };
                let value = self.rrefs.value(rref);
                let inner = self.clone();
                self.handlers_running.fetch_add(1, Ordering::AcqRel);
                Some(Box::pin(async move {
                    match value.await {
                        Ok(v) => {
                            let pool_inner = inner.clone();
                            inner.pool.submit(move || {
                                let result = method(&ctx, &v, payload);
                                let result = pool_inner.encode_result(result);
                                pool_inner.reply_from_pool(pipe, caller, id, result);
                            });
                        }
                        Err(e) => {
                            let err = Err(WireError::Failed(format!("RRef creation failed: {e}")));
                            inner.reply(&pipe, caller, id, err).await;
                            inner.handlers_running.fetch_sub(1, Ordering::AcqRel);
                        }
                    }
                }))
            }
            Body::Ping => Some(self.reply_later(pipe, caller, id, Ok(Payload::empty()))),
            Body::ForkRequest { rref, fork } => {
                self.rrefs.add_fork_held(rref, fork, caller);
                Some(self.reply_later(pipe, caller, id, Ok(Payload::empty())))
            }
            Body::ChildAccept { fork } => {
                self.rrefs.child_accepted(fork);
                Some(self.reply_later(pipe, caller, id, Ok(Payload::empty())))
            }
            Body::Delete { rref, fork } => {
                self.rrefs.delete_fork(rref, fork);
                Some(self.reply_later(pipe, caller, id, Ok(Payload::empty())))
            }
        }
    }

    fn reply_later(
        self: &Arc<Self>,
        pipe: Pipe,
        caller: u32,
        id: u64,
        result: Result<Payload, WireError>,
    ) -> BoxFuture<()> {
        let inner = self.clone();
        Box::pin(async move { inner.reply(&pipe, caller, id, result).await })
    }

    fn encode_result(&self, result: Result<Value, HandlerError>) -> Result<Payload, WireError> {
        match result {
            Ok(v) => v.to_payload().map_err(|e| WireError::Failed(e.to_string())),
            Err(e) => Err(WireError::Handler(e)),
        }
    }

    /// Runs a registered handler; with `rref`, keeps the value as that RRef's and replies
    /// empty.
    fn run_handler(
        self: &Arc<Self>,
        ctx: CallContext,
        pipe: Pipe,
        id: u64,
        name: &str,
        payload: Payload,
        rref: Option<GlobalId>,
    ) -> Option<BoxFuture<()>> {
        let caller = ctx.caller.id;
        let Some(handler) = self.registry.handlers.get(name).cloned() else {
            if let Some(r) = rref {
                self.rrefs.set_value(
                    r,
                    Err(RpcError::UnknownHandler {
                        worker: self.me.name.clone(),
                        handler: name.to_owned(),
                    }),
                );
            }
            return Some(self.reply_later(pipe, caller, id, Err(WireError::UnknownHandler(name.to_owned()))));
        };
        self.handlers_running.fetch_add(1, Ordering::AcqRel);
        let inner = self.clone();
        let finish = move |inner: &Arc<AgentInner>, result: Result<Value, HandlerError>| match rref {
            None => inner.encode_result(result),
            Some(r) => {
                let reply = match &result {
                    Ok(_) => Ok(Payload::empty()),
                    Err(e) => Err(WireError::Handler(e.clone())),
                };
                let me = inner.me.name.clone();
                // A value on a GPU keeps events marking the work that made it, for fetches.
                let result = result.and_then(|v| match v {
                    Value::Payload(mut p) => match gpu::record_events(&mut p) {
                        Ok(()) => Ok(Value::Payload(p)),
                        Err(e) => Err(HandlerError::new("CudaError", e.to_string())),
                    },
                    other => Ok(other),
                });
                inner.rrefs.set_value(
                    r,
                    result.map_err(|e| RpcError::Remote {
                        worker: me,
                        kind: e.kind,
                        message: e.message,
                    }),
                );
                reply
            }
        };
        match handler {
            // Quick last time and never blocked: run right here, on the thread that read the
            // request (the serve loop hands its read role on if the handler blocks after all).
            Handler::Sync(f, pace) if pace.inline() && crate::pool::may_inline() => Some(Box::pin(async move {
                let result = pace.run(|| f(&ctx, payload));
                let reply = finish(&inner, result);
                inner.reply(&pipe, caller, id, reply).await;
                inner.handlers_running.fetch_sub(1, Ordering::AcqRel);
            })),
            Handler::Sync(f, pace) => {
                self.pool.submit(move || {
                    let result = pace.run(|| f(&ctx, payload));
                    let reply = finish(&inner, result);
                    inner.reply_from_pool(pipe, caller, id, reply);
                });
                None
            }
            Handler::Async(f) => Some(Box::pin(async move {
                let result = f(ctx, payload).await;
                let reply = finish(&inner, result);
                inner.reply(&pipe, caller, id, reply).await;
                inner.handlers_running.fetch_sub(1, Ordering::AcqRel);
            })),
        }
    }

    /// Replies from a handler thread, then counts the handler done. A reply without tensors is
    /// written right here (its write completes at once); one with tensors is handed to the I/O
    /// runtime, because its write may wait for the receiver (a CMA write completes when the
    /// caller has pulled the bytes), and a pool thread must not wait a round trip for that.
    fn reply_from_pool(self: &Arc<Self>, pipe: Pipe, caller: u32, id: u64, result: Result<Payload, WireError>) {
        let has_tensors = result.as_ref().is_ok_and(|p| !p.tensors.is_empty());
        if has_tensors {
            let inner = self.clone();
            self.handle.spawn(async move {
                inner.reply(&pipe, caller, id, result).await;
                inner.handlers_running.fetch_sub(1, Ordering::AcqRel);
            });
        } else {
            self.handle.block_on(self.reply(&pipe, caller, id, result));
            self.handlers_running.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Sends the reply to request `id` back on `pipe`.
    async fn reply(self: &Arc<Self>, pipe: &Pipe, caller: u32, id: u64, result: Result<Payload, WireError>) {
        let held = self.held.lock().unwrap().remove(&(caller, id));
        if let Some((budget, size)) = held {
            budget.release(size);
        }
        // The caller's map matters only for tensors; skip the lookup otherwise.
        let needs_map = result.as_ref().is_ok_and(|p| !p.tensors.is_empty());
        let peer = if needs_map { self.peer(caller).ok() } else { None };
        let map = peer.as_ref().and_then(|p| p.map_from.as_ref());
        let (result, frames, tensors, forks) = match result {
            Ok(payload) => match self.outgoing_value(&payload, caller, map, true) {
                Ok(o) => (Ok(o.value), o.frames, o.tensors, o.forks),
                Err(e) => (
                    Err(WireError::Failed(e.to_string())),
                    Vec::new(),
                    Vec::new(),
                    Vec::new(),
                ),
            },
            Err(e) => (Err(e), Vec::new(), Vec::new(), Vec::new()),
        };
        let message = build_message(Envelope::Response(Response { id, result }), frames, tensors);
        if let Err(e) = pipe.write(&message).await {
            self.rrefs.undo_forks(&forks);
            tracing::debug!(worker = %self.me, caller, error = %e, "could not send a reply");
        }
    }

    pub(crate) fn rpc_error(&self, rank: u32, e: WireError) -> RpcError {
        let worker = self.name_of(rank);
        match e {
            WireError::Handler(h) => RpcError::Remote {
                worker,
                kind: h.kind,
                message: h.message,
            },
            WireError::UnknownHandler(handler) => RpcError::UnknownHandler { worker, handler },
            WireError::Failed(detail) => RpcError::Remote {
                worker,
                kind: "Failed".into(),
                message: detail,
            },
        }
    }

    /// Sends a control message and retries it until it is acknowledged (or the peer is gone).
    /// `then` runs once with the outcome: acknowledged, or abandoned with the error (the peer
    /// is gone).
    pub(crate) fn send_control(
        self: &Arc<Self>,
        dest: u32,
        body: Body,
        then: impl FnOnce(&Arc<AgentInner>, Result<(), RpcError>) + Send + 'static,
    ) {
        self.control_in_flight.fetch_add(1, Ordering::AcqRel);
        let inner = self.clone();
        self.handle.spawn(async move {
            let mut delay = Duration::from_millis(10);
            loop {
                let attempt = inner.start_call(dest, body.clone(), Payload::empty(), inner.options.control_retry);
                match attempt.await {
                    Ok(_) => {
                        then(&inner, Ok(()));
                        break;
                    }
                    Err(RpcError::Timeout { .. }) => {
                        tracing::debug!(worker = %inner.me, ?body, "control message unacknowledged; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                    Err(e) => {
                        tracing::debug!(worker = %inner.me, ?body, error = %e, "control message abandoned");
                        then(&inner, Err(e));
                        break;
                    }
                }
            }
            inner.control_in_flight.fetch_sub(1, Ordering::AcqRel);
        });
    }

    fn outstanding(&self) -> u64 {
        let calls = self.calls.lock().unwrap().len() as i64;
        let n = calls + self.handlers_running.load(Ordering::Acquire) + self.control_in_flight.load(Ordering::Acquire);
        n.max(0) as u64
    }

    fn shutdown(&self, timeout: Option<Duration>) -> Result<(), ShutdownError> {
        if self.is_down() {
            return Err(ShutdownError::AlreadyShutDown);
        }
        let start = Instant::now();
        let left = || match timeout {
            None => Duration::from_secs(365 * 24 * 3600),
            Some(t) => t.saturating_sub(start.elapsed()),
        };
        let world_at_start = match self.static_world {
            0 => self.member_count(),
            fixed => fixed.min(self.member_count()),
        };
        let result = self.handle.block_on(async {
            let mut round = 0u64;
            let mut last = 0;
            loop {
                if timeout.is_some() && left().is_zero() {
                    return Err(ShutdownError::Timeout {
                        timeout: timeout.unwrap_or_default(),
                        outstanding: last,
                    });
                }
                let report = self.outstanding() + self.activity.swap(0, Ordering::AcqRel);
                let sum_key = format!("shutdown/{round}/sum");
                let r = async {
                    self.store.add(&sum_key, report as i64).await?;
                    self.group_barrier(&format!("shutdown/{round}/arrive"), left()).await?;
                    self.store.add(&sum_key, 0).await
                }
                .await;
                let sum = match r {
                    Ok(s) => s as u64,
                    Err(crate::store::StoreError::Timeout { .. }) => {
                        return Err(ShutdownError::Timeout {
                            timeout: timeout.unwrap_or_default(),
                            outstanding: last,
                        })
                    }
                    Err(e) => return Err(ShutdownError::Store(e.to_string())),
                };
                if sum == 0 {
                    break;
                }
                last = sum;
                round += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // Everyone saw the quiet round; the store's host waits until all have read it.
            let _ = self.store.add("shutdown/left", 1).await;
            if self.store_server.lock().unwrap().is_some() {
                // The group as it was when shutdown began: members that finish first leave the
                // membership, and must not make the host stop waiting for the slower ones.
                let world = world_at_start;
                let _ = self
                    .store
                    .wait_count("shutdown/left", world as i64, left().min(Duration::from_secs(10)))
                    .await;
            }
            Ok(())
        });
        let users = self.rrefs.users_alive();
        self.teardown();
        result?;
        if self.options.leak_check && users > 0 {
            return Err(ShutdownError::LeakedRRefs {
                count: users,
                detail: format!("{} still holds {users} user references", self.me),
            });
        }
        Ok(())
    }

    /// Stops everything at once.
    pub(crate) fn teardown(&self) {
        if self.state.swap(DOWN, Ordering::AcqRel) == DOWN {
            return;
        }
        self.fail_calls(None, |_| RpcError::Shutdown);
        let peers: Vec<Arc<Peer>> = self.members.read().unwrap().by_id.values().cloned().collect();
        for p in peers {
            if let Some((_, pipe)) = p.pipe.lock().unwrap().take() {
                pipe.close();
            }
            p.reader.lock().unwrap().take();
        }
        for p in self.incoming.lock().unwrap().drain(..) {
            p.close();
        }
        self.pool.stop();
        self.store_server.lock().unwrap().take();
        if let Some(rt) = self.runtime.lock().unwrap().take() {
            rt.shutdown_background();
        }
        self.rrefs.clear();
        RUNNING.store(false, Ordering::Release);
        tracing::debug!(worker = %self.me, "agent down");
    }
}

/// A value made ready for one destination: the wire value, the frames of its bytes, its
/// tensors with their target devices, and the RRef forks made for it (undone if the send fails).
struct Outgoing {
    value: WireValue,
    frames: Vec<Bytes>,
    tensors: Vec<Tensor>,
    forks: Vec<GlobalId>,
}

fn build_message(envelope: Envelope, payloads: Vec<Bytes>, tensors: Vec<Tensor>) -> Message {
    Message {
        metadata: wire::encode(&envelope),
        payloads,
        tensors,
    }
}

/// A request being served: its caller's budget and its size.
type Held = (Arc<Budget>, u64);

/// Bytes a message will occupy once received.
fn message_bytes(d: &Descriptor) -> u64 {
    let payloads: u64 = d.payload_lengths.iter().fold(0u64, |a, &l| a.saturating_add(l));
    d.tensors
        .iter()
        .fold(payloads, |a, t| a.saturating_add(t.length))
        .saturating_add(d.metadata.len() as u64)
}

/// Reads one whole message from `pipe`, refusing one larger than `max_message_bytes` before
/// allocating anything for it.
async fn read_message(pipe: &Pipe, inner: &AgentInner) -> Result<(Descriptor, Allocation), PipeError> {
    let d = pipe.read_descriptor().await?;
    finish_read(pipe, inner, d, None).await
}

async fn finish_read(
    pipe: &Pipe,
    inner: &AgentInner,
    d: Descriptor,
    budget: Option<(&Budget, u64)>,
) -> Result<(Descriptor, Allocation), PipeError> {
    let size = message_bytes(&d);
    if size > inner.options.max_message_bytes {
        pipe.close();
        return Err(PipeError::Protocol {
            peer: pipe.info().peer.clone(),
            detail: format!(
                "a message of {size} bytes exceeds this worker's limit of {} bytes (max_message_bytes)",
                inner.options.max_message_bytes
            ),
        });
    }
    if let Some((b, size)) = budget {
        b.acquire(size).await;
    }
    let allocation = match inner.allocate(&d) {
        Ok(a) => a,
        Err(detail) => {
            if let Some((b, size)) = budget {
                b.release(size);
            }
            pipe.close();
            return Err(PipeError::Protocol {
                peer: pipe.info().peer.clone(),
                detail,
            });
        }
    };
    let allocation = match pipe.read(allocation).await {
        Ok(a) => a,
        Err(e) => {
            if let Some((b, size)) = budget {
                b.release(size);
            }
            return Err(e.error);
        }
    };
    Ok((d, allocation))
}

/// Serves one incoming pipe: requests in, replies out. A caller that heartbeats and then
/// falls silent for `heartbeat_misses` of its intervals is declared lost.
async fn serve_pipe(inner: Arc<AgentInner>, pipe: Pipe) {
    let (caller, silence) = match read_message(&pipe, &inner).await {
        Ok((d, _)) => match wire::decode(&d.metadata) {
            Ok(Envelope::Hello {
                rank,
                version,
                heartbeat_ms,
            }) if version == wire::AGENT_VERSION && inner.known_or_refreshed(rank).await => {
                let silence = (heartbeat_ms > 0).then(|| {
                    Duration::from_millis(heartbeat_ms.min(3_600_000)) * inner.options.heartbeat_misses.max(1)
                });
                (rank, silence)
            }
            Ok(other) => {
                tracing::warn!(worker = %inner.me, peer = %pipe.info().peer, ?other, "pipe did not start with a valid hello from a member; closing it");
                pipe.close();
                return;
            }
            Err(e) => {
                tracing::warn!(worker = %inner.me, peer = %pipe.info().peer, error = %e, "closing pipe");
                pipe.close();
                return;
            }
        },
        Err(_) => return,
    };
    let budget = Arc::new(Budget::new(inner.options.max_in_flight_bytes));
    // Silence is watched by a separate task, so reading costs no timer per message.
    let heard = Arc::new(AtomicU64::new(inner.now_ms()));
    if let Some(limit) = silence {
        tokio::spawn(watch_silence(
            Arc::downgrade(&inner),
            pipe.clone(),
            caller,
            heard.clone(),
            limit,
        ));
    }
    serve_requests(Arc::new(Served {
        inner,
        pipe,
        caller,
        budget,
        heard,
    }))
    .await
}

/// An incoming pipe being served: whoever holds its read role runs [`serve_requests`].
struct Served {
    inner: Arc<AgentInner>,
    pipe: Pipe,
    caller: u32,
    budget: Arc<Budget>,
    heard: Arc<AtomicU64>,
}

/// Reads requests from one caller and dispatches them, until the pipe ends or the read role
/// is handed to a new reader (a handler running inline blocked).
fn serve_requests(served: Arc<Served>) -> BoxFuture<()> {
    Box::pin(serve_loop(served))
}

async fn serve_loop(served: Arc<Served>) {
    let Served {
        inner,
        pipe,
        caller,
        budget,
        heard,
    } = &*served;
    let (inner, pipe, caller) = (inner, pipe, *caller);
    loop {
        let descriptor = pipe.read_descriptor().await;
        heard.store(inner.now_ms(), Ordering::Relaxed);
        let size = descriptor.as_ref().map_or(0, message_bytes);
        let message = match descriptor {
            Ok(d) => finish_read(pipe, inner, d, Some((budget, size))).await,
            Err(e) => Err(e),
        };
        let (d, allocation) = match message {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(worker = %inner.me, caller, error = %e, "incoming pipe ended");
                return;
            }
        };
        let received = inner.receive(caller, &d, allocation);
        if !matches!(&received, Ok((Envelope::Request(_), Some(_)))) {
            budget.release(size);
        }
        match received {
            Ok((Envelope::Request(request), Some(payload))) => {
                if !matches!(request.body, Body::Ping) {
                    inner.activity.fetch_add(1, Ordering::Relaxed);
                }
                // Held until the reply goes out (`reply` releases it).
                inner
                    .held
                    .lock()
                    .unwrap()
                    .insert((caller, request.id), (budget.clone(), size));
                // Should a handler run here block, a new reader takes the pipe over first.
                let hand_off = {
                    let served = served.clone();
                    move || {
                        tokio::spawn(serve_requests(served));
                    }
                };
                let mut once = Some((hand_off, request, payload));
                let (pending, handed) = std::future::poll_fn(|cx| {
                    let (hand_off, request, payload) = once.take().expect("polled once");
                    Poll::Ready(crate::pool::inline(hand_off, || {
                        let mut work = inner.dispatch(caller, pipe.clone(), request, payload)?;
                        // Poll once here, so work that finishes without waiting replies with
                        // no task switch; what must wait continues as its own task (which
                        // polls it again at once, so its waker is the task's own).
                        work.as_mut().poll(cx).is_pending().then_some(work)
                    }))
                })
                .await;
                if let Some(work) = pending {
                    tokio::spawn(work);
                }
                if handed {
                    return;
                }
            }
            Ok((Envelope::Goodbye, _)) => {
                if let Ok(p) = inner.peer(caller) {
                    p.leaving.store(true, Ordering::Release);
                }
            }
            Ok((other, _)) => {
                tracing::warn!(worker = %inner.me, caller, ?other, "unexpected message on an incoming pipe; closing it");
                pipe.close();
                return;
            }
            Err(e) => {
                tracing::warn!(worker = %inner.me, caller, error = %e, "closing incoming pipe");
                pipe.close();
                return;
            }
        }
    }
}

/// Declares the caller of an incoming pipe lost once the pipe has heard nothing for `limit`;
/// ends with the pipe.
async fn watch_silence(
    weak: std::sync::Weak<AgentInner>,
    pipe: Pipe,
    caller: u32,
    heard: Arc<AtomicU64>,
    limit: Duration,
) {
    loop {
        tokio::time::sleep(limit / 4).await;
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down() || pipe.error().is_some() {
            return;
        }
        let silent = Duration::from_millis(inner.now_ms().saturating_sub(heard.load(Ordering::Relaxed)));
        if silent >= limit {
            pipe.close();
            inner.declare_lost(
                caller,
                None,
                format!("its pipe to this worker was silent for {silent:?}"),
            );
            return;
        }
    }
}

/// The agent's side of an outgoing pipe's read role: what one reply does when it arrives.
struct PeerReplies {
    inner: std::sync::Weak<AgentInner>,
    peer: Arc<Peer>,
    generation: u64,
    handle: tokio::runtime::Handle,
}

impl Replies for PeerReplies {
    async fn read_one(&self, pipe: &Pipe) -> Result<(), String> {
        let inner = self.inner.upgrade().ok_or("the agent is down")?;
        let id = self.peer.info.id;
        let (d, allocation) = read_message(pipe, &inner).await.map_err(|e| e.to_string())?;
        self.peer.last_heard.store(inner.now_ms(), Ordering::Release);
        match inner.receive(id, &d, allocation) {
            Ok((Envelope::Response(Response { id: call, result }), payload)) => {
                let result = match result {
                    Ok(_) => Ok(payload.unwrap_or_default()),
                    Err(e) => Err(inner.rpc_error(id, e)),
                };
                if inner.finish_call(call, result) {
                    inner.activity.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
            Ok((Envelope::Goodbye, _)) => {
                self.peer.leaving.store(true, Ordering::Release);
                Ok(())
            }
            Ok((other, _)) => Err(format!("protocol error: unexpected {other:?} on a reply pipe")),
            Err(e) => Err(format!("protocol error: {e}")),
        }
    }

    fn failed(&self, detail: String) {
        let Some(inner) = self.inner.upgrade() else { return };
        if let Some((g, pipe)) = self.peer.pipe.lock().unwrap().as_ref() {
            if *g == self.generation {
                pipe.close();
            }
        }
        tracing::debug!(worker = %inner.me, peer = self.peer.info.id, error = %detail, "pipe to peer failed");
        inner.declare_lost(self.peer.info.id, Some(self.generation), detail);
    }

    fn wanted(&self) -> bool {
        self.inner
            .upgrade()
            .is_some_and(|inner| inner.calls.lock().unwrap().pending_to(self.peer.info.id) > 0)
    }

    fn runtime(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

/// Pings `peer` on `pipe` whenever the pipe has heard nothing for an interval, and declares the
/// peer lost after `heartbeat_misses` silent intervals. Ends with the pipe.
async fn heartbeat(weak: std::sync::Weak<AgentInner>, peer: Arc<Peer>, generation: u64, pipe: Pipe) {
    let (interval, misses) = match weak.upgrade() {
        Some(inner) => (inner.options.heartbeat_interval, inner.options.heartbeat_misses.max(1)),
        None => return,
    };
    let limit = interval * misses;
    loop {
        tokio::time::sleep(interval / 2).await;
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down()
            || peer.generation.load(Ordering::Acquire) != generation
            || peer.down.lock().unwrap().is_some()
        {
            return;
        }
        let now = inner.now_ms();
        let silent = Duration::from_millis(now.saturating_sub(peer.last_heard.load(Ordering::Acquire)));
        let quiet = Duration::from_millis(now.saturating_sub(peer.last_sent.load(Ordering::Acquire)));
        if silent >= limit {
            pipe.close();
            inner.declare_lost(
                peer.info.id,
                Some(generation),
                format!("no reply to heartbeats for {silent:?}"),
            );
            return;
        }
        if silent >= interval || quiet >= interval {
            peer.last_sent.store(now, Ordering::Release);
            let ping = Message {
                metadata: wire::encode(&Envelope::Request(Request {
                    id: inner.next_id(),
                    body: Body::Ping,
                    value: WireValue::default(),
                })),
                ..Message::default()
            };
            let write = tokio::time::timeout(limit, pipe.write(&ping));
            if let Ok(Err(e)) = write.await {
                inner.declare_lost(peer.info.id, Some(generation), format!("heartbeat failed: {e}"));
                return;
            }
        }
    }
}

/// While `peer` is lost but still a member, tries to open a new pipe to it now and then.
async fn reconnect(weak: std::sync::Weak<AgentInner>, peer: Arc<Peer>) {
    let mut pause = Duration::from_millis(200);
    loop {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down()
            || !inner
                .members
                .read()
                .unwrap()
                .by_id
                .get(&peer.info.id)
                .is_some_and(|p| Arc::ptr_eq(p, &peer))
        {
            return;
        }
        let _connecting = peer.connecting.lock().await;
        let attempt = tokio::time::timeout(Duration::from_secs(5), inner.open_pipe(&peer)).await;
        if let Ok(Ok(_)) = attempt {
            *peer.down.lock().unwrap() = None;
            tracing::info!(worker = %inner.me, peer = %peer.info, "reconnected");
            inner
                .subscribers
                .publish(MembershipEvent::Reconnected(peer.info.clone()));
            return;
        }
    }
}

/// Fails calls whose deadline passed.
async fn run_timer(weak: std::sync::Weak<AgentInner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down() {
            return;
        }
        let (expired, next) = inner.calls.lock().unwrap().expire(Instant::now());
        for p in expired {
            let worker = inner.name_of(p.peer);
            p.slot.complete(Err(RpcError::Timeout {
                worker,
                timeout: p.timeout,
            }));
        }
        // The runtime's shutdown at teardown ends this task (and drops `inner`). Without a
        // deadline it looks again now and then, so a dropped agent lets this task end; a call
        // whose deadline falls before the next look wakes it (see `start_call`).
        let notified = inner.timer.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let until = next.unwrap_or_else(|| Instant::now() + Duration::from_millis(200));
        inner.timer_due.store(
            until.saturating_duration_since(inner.clock).as_millis() as u64,
            Ordering::Release,
        );
        // A call registered between `expire` and publishing `timer_due` may have seen the old
        // value and not woken us: look again before sleeping.
        if inner.calls.lock().unwrap().next_deadline().is_some_and(|d| d < until) {
            continue;
        }
        let _ = tokio::time::timeout_at(until.into(), notified).await;
    }
}
