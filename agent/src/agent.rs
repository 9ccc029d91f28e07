//! The agent: one per process. It joins the group through the store, opens pipes to peers,
//! sends requests, serves them, and keeps every pending call's bookkeeping.
//!
//! Pipes: each worker opens its own pipe to each peer it calls (lazily by default) and sends
//! its requests there; the callee answers on the same pipe. So a pipe carries requests one way
//! and responses the other, and a failed pipe fails exactly the calls that used it.
//!
//! Threads: a tokio runtime (`io_threads`) drives pipes, timers and async handlers; a pool
//! (`pool_threads`) runs synchronous handlers. Callers on plain threads send on their own
//! thread and wait for the reply by spinning briefly, then sleeping.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sluice_channel::{Allocation, Context, Descriptor, Device, Message, Pipe, PipeError, RecvBuffer, Tensor};

use crate::completion::{Completion, Slot};
use crate::device_map::{self, DeviceMap, WorkerDevices};
use crate::error::{HandlerError, InitError, RpcError, ShutdownError};
use crate::handler::{BoxFuture, CallContext, Handler, Registry};
use crate::name::{validate_name, Dest, WorkerInfo};
use crate::options::{self, AgentOptions, Connect};
use crate::payload::{Payload, Value};
use crate::pool::Pool;
use crate::rref::{RRef, RRefState, RRefTable};
use crate::store::{StoreClient, StoreServer};
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

/// What each worker publishes at rendezvous.
#[derive(Serialize, Deserialize)]
struct Announce {
    version: u16,
    name: String,
    address: String,
    devices: WorkerDevices,
}

struct Peer {
    info: WorkerInfo,
    address: String,
    pipe: tokio::sync::OnceCell<Pipe>,
    /// Set once the peer is known to be gone; new calls fail at once with this detail.
    lost: OnceLock<String>,
    /// My device map to this peer, and its map to me (for responses).
    map_to: Option<DeviceMap>,
    map_from: Option<DeviceMap>,
}

struct Pending {
    slot: Arc<Slot<Result<Payload, RpcError>>>,
    peer: u32,
    timeout: Duration,
    deadline: Option<Instant>,
}

#[derive(Default)]
struct Calls {
    map: HashMap<u64, Pending>,
    deadlines: BTreeSet<(Instant, u64)>,
}

pub(crate) struct AgentInner {
    pub(crate) me: WorkerInfo,
    peers: Vec<Peer>,
    by_name: HashMap<String, u32>,
    pub(crate) options: AgentOptions,
    world_size: u32,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    pub(crate) handle: tokio::runtime::Handle,
    context: Context,
    registry: Registry,
    pool: Pool,
    store: StoreClient,
    store_server: Mutex<Option<StoreServer>>,
    counter: AtomicU64,
    calls: Mutex<Calls>,
    timer: tokio::sync::Notify,
    state: AtomicU8,
    /// Handlers running, control messages in flight: outstanding work for shutdown.
    handlers_running: AtomicI64,
    pub(crate) control_in_flight: AtomicI64,
    /// Requests and replies seen since the last shutdown round.
    activity: AtomicU64,
    pub(crate) rrefs: RRefTable,
    incoming: Mutex<Vec<Pipe>>,
    drop_control: AtomicUsize,
    recv_pool: Mutex<Vec<Bytes>>,
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
    /// Joins the group: starts the store (on the store rank), publishes this worker, waits for
    /// every other worker, validates names and device maps, and starts serving. Blocks; call it
    /// from a plain thread.
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

    /// Every worker of the group, by rank.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.inner.peers.iter().map(|p| p.info.clone()).collect()
    }

    /// The worker `dest` names.
    pub fn worker(&self, dest: impl Into<Dest>) -> Result<WorkerInfo, RpcError> {
        let rank = self.inner.resolve(&dest.into())?;
        Ok(self.inner.peers[rank as usize].info.clone())
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
    /// once). Call it from a plain thread.
    pub fn barrier(&self, key: &str) -> Result<(), RpcError> {
        let inner = &self.inner;
        inner.check_running()?;
        let timeout = Duration::from_secs(365 * 24 * 3600);
        inner
            .handle
            .block_on(inner.store.barrier(&format!("user/{key}"), inner.world_size, timeout))
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

    /// Ungraceful shutdown: fails pending calls, closes every pipe, stops at once.
    pub fn shutdown_now(&self) {
        self.inner.teardown();
    }

    /// Where this worker listens for pipes.
    pub fn address(&self) -> &str {
        &self.inner.peers[self.inner.me.id as usize].address
    }

    /// The pipe info of this worker's pipe to `dest`, if one is open.
    pub fn pipe_info(&self, dest: impl Into<Dest>) -> Option<sluice_channel::PipeInfo> {
        let rank = self.inner.resolve(&dest.into()).ok()?;
        self.inner.peers[rank as usize].pipe.get().map(|p| p.info().clone())
    }
}

fn init(options: AgentOptions, registry: Registry) -> Result<Agent, InitError> {
    validate_name(&options.name)?;
    let resolved = options::resolve(&options)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.io_threads)
        .thread_name(format!("sluice-io-{}", options.name))
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    let deadline = Instant::now() + options.init_timeout;
    let left = move || deadline.saturating_duration_since(Instant::now());
    let store_error = |e: crate::store::StoreError| match e {
        crate::store::StoreError::Timeout { key, timeout } => InitError::Timeout {
            timeout,
            waiting_for: format!("store key `{key}` (is every worker started?)"),
        },
        other => InitError::Store(other.to_string()),
    };

    let (store_server, store, context, mut listener, announces) = runtime.block_on(async {
        let server = if resolved.rank == options.store_rank {
            Some(
                StoreServer::start(&resolved.store_addr)
                    .await
                    .map_err(|e| InitError::Store(e.to_string()))?,
            )
        } else {
            None
        };
        let store = StoreClient::connect(&resolved.store_addr, left())
            .await
            .map_err(store_error)?;
        let mut pipe_options = options.pipe.clone();
        pipe_options.name = options.name.clone();
        let context = Context::new(pipe_options)?;
        let listener = context.listen(&options.listen).await?;
        let announce = Announce {
            version: wire::AGENT_VERSION,
            name: options.name.clone(),
            address: listener.address().to_owned(),
            devices: WorkerDevices {
                name: options.name.clone(),
                devices: options.devices.clone().unwrap_or_else(|| vec![Device::Cpu]),
                maps: options.device_maps.clone(),
            },
        };
        let bytes = postcard::to_allocvec(&announce).map_err(|e| InitError::Config(e.to_string()))?;
        store
            .set(&format!("worker/{}", resolved.rank), bytes)
            .await
            .map_err(store_error)?;
        let mut announces = Vec::with_capacity(resolved.world_size as usize);
        for rank in 0..resolved.world_size {
            let bytes = store
                .get(&format!("worker/{rank}"), left())
                .await
                .map_err(store_error)?;
            let a: Announce = postcard::from_bytes(&bytes)
                .map_err(|e| InitError::Store(format!("rank {rank} published garbage: {e}")))?;
            announces.push(a);
        }
        // The store's host stays until everyone has read everything, even when validation is
        // about to fail (all workers then report the same error).
        store.add("init/read", 1).await.map_err(store_error)?;
        if resolved.rank == options.store_rank {
            store
                .wait_count("init/read", resolved.world_size as i64, left())
                .await
                .map_err(store_error)?;
        }
        Ok::<_, InitError>((server, store, context, listener, announces))
    })?;

    for (rank, a) in announces.iter().enumerate() {
        if a.version != wire::AGENT_VERSION {
            return Err(InitError::Config(format!(
                "rank {rank} ({}) speaks agent protocol version {}, this worker speaks {}",
                a.name,
                a.version,
                wire::AGENT_VERSION
            )));
        }
        validate_name(&a.name)?;
    }
    let mut by_name = HashMap::new();
    for (rank, a) in announces.iter().enumerate() {
        if let Some(first) = by_name.insert(a.name.clone(), rank as u32) {
            return Err(InitError::DuplicateName {
                name: a.name.clone(),
                first,
                second: rank as u32,
            });
        }
    }
    let devices: Vec<WorkerDevices> = announces.iter().map(|a| a.devices.clone()).collect();
    device_map::validate(&devices)?;

    let me = WorkerInfo {
        name: options.name.clone(),
        id: resolved.rank,
    };
    let peers = announces
        .iter()
        .enumerate()
        .map(|(rank, a)| Peer {
            info: WorkerInfo {
                name: a.name.clone(),
                id: rank as u32,
            },
            address: a.address.clone(),
            pipe: tokio::sync::OnceCell::new(),
            lost: OnceLock::new(),
            map_to: options.device_maps.get(&a.name).cloned(),
            map_from: a.devices.maps.get(&me.name).cloned(),
        })
        .collect();
    let pool = Pool::new(&format!("sluice-handler-{}", options.name), options.pool_threads);
    let inner = Arc::new(AgentInner {
        me,
        peers,
        by_name,
        world_size: resolved.world_size,
        runtime: Mutex::new(None),
        handle: handle.clone(),
        context,
        registry,
        pool,
        store,
        store_server: Mutex::new(store_server),
        counter: AtomicU64::new(0),
        calls: Mutex::new(Calls::default()),
        timer: tokio::sync::Notify::new(),
        state: AtomicU8::new(RUNNING_STATE),
        handlers_running: AtomicI64::new(0),
        control_in_flight: AtomicI64::new(0),
        activity: AtomicU64::new(0),
        rrefs: RRefTable::default(),
        incoming: Mutex::new(Vec::new()),
        drop_control: AtomicUsize::new(options.faults.drop_control),
        recv_pool: Mutex::new(Vec::new()),
        options,
    });

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
    *inner.runtime.lock().unwrap() = Some(runtime);

    let agent = Agent { inner };
    let inner = &agent.inner;
    let result = handle.block_on(async {
        inner
            .store
            .barrier("init", inner.world_size, left())
            .await
            .map_err(store_error)?;
        if inner.options.connect == Connect::Eager {
            for rank in 0..inner.world_size {
                inner
                    .pipe_to(rank)
                    .await
                    .map_err(|e| InitError::Config(e.to_string()))?;
            }
        }
        Ok::<_, InitError>(())
    });
    if let Err(e) = result {
        agent.inner.teardown();
        return Err(e);
    }
    tracing::debug!(worker = %agent.inner.me, "agent ready");
    Ok(agent)
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

    pub(crate) fn resolve(&self, dest: &Dest) -> Result<u32, RpcError> {
        let rank = match dest {
            Dest::Name(n) => self.by_name.get(n).copied(),
            Dest::Rank(r) => (*r < self.world_size).then_some(*r),
        };
        rank.ok_or_else(|| RpcError::UnknownWorker {
            dest: dest.to_string(),
            world_size: self.world_size,
        })
    }

    pub(crate) fn name_of(&self, rank: u32) -> &str {
        &self.peers[rank as usize].info.name
    }

    pub(crate) fn worker_info(&self, rank: u32) -> WorkerInfo {
        self.peers[rank as usize].info.clone()
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
        let peer = &self.peers[dest as usize];
        if let Some(detail) = peer.lost.get() {
            return Completion::ready(Err(RpcError::PeerLost {
                worker: peer.info.name.clone(),
                detail: detail.clone(),
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
        let deadline = (!timeout.is_zero()).then(|| Instant::now() + timeout);
        {
            let mut calls = self.calls.lock().unwrap();
            calls.map.insert(
                id,
                Pending {
                    slot: slot.clone(),
                    peer: dest,
                    timeout,
                    deadline,
                },
            );
            if let Some(d) = deadline {
                let earliest = calls.deadlines.first().map(|(t, _)| *t);
                calls.deadlines.insert((d, id));
                if earliest.is_none_or(|e| d < e) {
                    self.timer.notify_one();
                }
            }
        }
        self.activity.fetch_add(1, Ordering::Relaxed);
        if control && self.drop_control.load(Ordering::Relaxed) > 0 && self.take_drop() {
            tracing::debug!(id, "fault injection: dropping a control message");
            return Completion::new(slot);
        }
        let duplicate = control && self.options.faults.duplicate_control;
        let inner = self.clone();
        let send = async move {
            let result = async {
                let pipe = inner.pipe_to(dest).await?;
                pipe.write(&message)
                    .await
                    .map_err(|e| RpcError::from_pipe(inner.name_of(dest), e))?;
                if duplicate {
                    // Same id: the second reply finds no pending call and is dropped.
                    pipe.write(&message)
                        .await
                        .map_err(|e| RpcError::from_pipe(inner.name_of(dest), e))?;
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
        Completion::new(slot)
    }

    fn take_drop(&self) -> bool {
        self.drop_control
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Completes a pending call (once). A call already completed (timed out) is ignored, and so
    /// is its late reply.
    fn finish_call(&self, id: u64, result: Result<Payload, RpcError>) -> bool {
        let pending = {
            let mut calls = self.calls.lock().unwrap();
            let p = calls.map.remove(&id);
            if let Some(Pending { deadline: Some(d), .. }) = &p {
                calls.deadlines.remove(&(*d, id));
            }
            p
        };
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
        let failed: Vec<(u32, Pending)> = {
            let mut calls = self.calls.lock().unwrap();
            let ids: Vec<u64> = calls
                .map
                .iter()
                .filter(|(_, p)| rank.is_none_or(|r| p.peer == r))
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| {
                    let p = calls.map.remove(&id)?;
                    if let Some(d) = p.deadline {
                        calls.deadlines.remove(&(d, id));
                    }
                    Some((p.peer, p))
                })
                .collect()
        };
        for (peer, p) in failed {
            p.slot.complete(Err(error(peer)));
        }
    }

    /// The pipe to `rank`, opened on first use; its reader task delivers replies.
    async fn pipe_to(self: &Arc<Self>, rank: u32) -> Result<Pipe, RpcError> {
        let peer = &self.peers[rank as usize];
        if let Some(p) = peer.pipe.get() {
            return Ok(p.clone());
        }
        let name = peer.info.name.clone();
        let pipe = peer
            .pipe
            .get_or_try_init(|| async {
                let pipe = self.context.connect(&peer.address).await.map_err(|e| match e {
                    PipeError::Transport(_) | PipeError::Timeout { .. } => RpcError::PeerLost {
                        worker: name.clone(),
                        detail: format!("cannot open a pipe to {}: {e}", peer.address),
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
                    }),
                    ..Message::default()
                };
                pipe.write(&hello).await.map_err(|e| RpcError::from_pipe(&name, e))?;
                tokio::spawn(read_replies(self.clone(), rank, pipe.clone()));
                Ok::<_, RpcError>(pipe)
            })
            .await?;
        Ok(pipe.clone())
    }

    /// Prepares a value for `dest`: RRef forks, tensor placement (`reverse` for replies).
    fn outgoing_value(
        self: &Arc<Self>,
        payload: &Payload,
        dest: u32,
        map: Option<&DeviceMap>,
        reverse: bool,
    ) -> Result<Outgoing, RpcError> {
        let dest_name = self.name_of(dest);
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

    /// Memory for an incoming message: recycled for large tensors when possible.
    fn allocate(&self, d: &Descriptor) -> Allocation {
        Allocation {
            payloads: d
                .payload_lengths
                .iter()
                .map(|&l| BytesMut::zeroed(l as usize))
                .collect(),
            tensors: d
                .tensors
                .iter()
                .map(|t| RecvBuffer::Cpu(self.recv_buffer(t.length as usize)))
                .collect(),
        }
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
                Some(Payload { bytes, tensors, rrefs })
            }
        };
        Ok((envelope, payload))
    }

    fn mark_lost(&self, rank: u32, detail: String) {
        let peer = &self.peers[rank as usize];
        let _ = peer.lost.set(detail.clone());
        let name = peer.info.name.clone();
        self.fail_calls(Some(rank), |_| RpcError::PeerLost {
            worker: name.clone(),
            detail: detail.clone(),
        });
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
        };
        let id = request.id;
        match request.body {
            Body::Call { handler } => self.run_handler(ctx, pipe, id, &handler, payload, None),
            Body::Remote { handler, rref, fork } => {
                if let Some(fork) = fork {
                    self.rrefs.add_fork(rref, fork);
                }
                self.run_handler(ctx, pipe, id, &handler, payload, Some(rref))
            }
            Body::Fetch { rref } => {
                let value = self.rrefs.value(rref);
                let inner = self.clone();
                self.handlers_running.fetch_add(1, Ordering::AcqRel);
                Some(Box::pin(async move {
                    let result = match value.await {
                        Ok(v) => v.to_payload().map_err(|e| WireError::Failed(e.to_string())),
                        Err(e) => Err(WireError::Failed(format!("RRef creation failed: {e}"))),
                    };
                    inner.reply(&pipe, caller, id, result).await;
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
                                pool_inner.handle.block_on(pool_inner.reply(&pipe, caller, id, result));
                                pool_inner.handlers_running.fetch_sub(1, Ordering::AcqRel);
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
            Body::ForkRequest { rref, fork } => {
                self.rrefs.add_fork(rref, fork);
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
            Handler::Sync(f) => {
                self.pool.submit(move || {
                    let result = f(&ctx, payload);
                    let reply = finish(&inner, result);
                    inner.handle.block_on(inner.reply(&pipe, caller, id, reply));
                    inner.handlers_running.fetch_sub(1, Ordering::AcqRel);
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

    /// Sends the reply to request `id` back on `pipe`.
    async fn reply(self: &Arc<Self>, pipe: &Pipe, caller: u32, id: u64, result: Result<Payload, WireError>) {
        let map = self.peers[caller as usize].map_from.as_ref();
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
        let worker = self.name_of(rank).to_owned();
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
    pub(crate) fn send_control(
        self: &Arc<Self>,
        dest: u32,
        body: Body,
        then: impl FnOnce(&Arc<AgentInner>) + Send + 'static,
    ) {
        self.control_in_flight.fetch_add(1, Ordering::AcqRel);
        let inner = self.clone();
        self.handle.spawn(async move {
            let mut delay = Duration::from_millis(10);
            loop {
                let attempt = inner.start_call(dest, body.clone(), Payload::empty(), inner.options.control_retry);
                match attempt.await {
                    Ok(_) => {
                        then(&inner);
                        break;
                    }
                    Err(RpcError::Timeout { .. }) => {
                        tracing::debug!(worker = %inner.me, ?body, "control message unacknowledged; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                    Err(e) => {
                        tracing::debug!(worker = %inner.me, ?body, error = %e, "control message abandoned");
                        break;
                    }
                }
            }
            inner.control_in_flight.fetch_sub(1, Ordering::AcqRel);
        });
    }

    fn outstanding(&self) -> u64 {
        let calls = self.calls.lock().unwrap().map.len() as i64;
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
        let world = self.world_size;
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
                    self.store
                        .barrier(&format!("shutdown/{round}/arrive"), world, left())
                        .await?;
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
            if self.me.id == self.options.store_rank {
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
        for p in &self.peers {
            if let Some(pipe) = p.pipe.get() {
                pipe.close();
            }
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

/// Reads one whole message from `pipe`.
async fn read_message(pipe: &Pipe, inner: &AgentInner) -> Result<(Descriptor, Allocation), PipeError> {
    let d = pipe.read_descriptor().await?;
    let allocation = inner.allocate(&d);
    let allocation = pipe.read(allocation).await.map_err(|e| e.error)?;
    Ok((d, allocation))
}

/// Serves one incoming pipe: requests in, replies out.
async fn serve_pipe(inner: Arc<AgentInner>, pipe: Pipe) {
    let caller = match read_message(&pipe, &inner).await {
        Ok((d, _)) => match wire::decode(&d.metadata) {
            Ok(Envelope::Hello { rank, version }) if rank < inner.world_size && version == wire::AGENT_VERSION => rank,
            Ok(other) => {
                tracing::warn!(worker = %inner.me, peer = %pipe.info().peer, ?other, "pipe did not start with a valid hello; closing it");
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
    loop {
        let (d, allocation) = match read_message(&pipe, &inner).await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(worker = %inner.me, caller, error = %e, "incoming pipe ended");
                return;
            }
        };
        match inner.receive(caller, &d, allocation) {
            Ok((Envelope::Request(request), Some(payload))) => {
                inner.activity.fetch_add(1, Ordering::Relaxed);
                if let Some(mut work) = inner.dispatch(caller, pipe.clone(), request, payload) {
                    // Poll once here; what must wait continues as its own task (which polls it
                    // again at once, so its waker is the task's own).
                    let done = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx).is_ready())).await;
                    if !done {
                        tokio::spawn(work);
                    }
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

/// Reads the replies on this worker's pipe to `rank`.
async fn read_replies(inner: Arc<AgentInner>, rank: u32, pipe: Pipe) {
    loop {
        let (d, allocation) = match read_message(&pipe, &inner).await {
            Ok(m) => m,
            Err(e) => {
                let detail = e.to_string();
                tracing::debug!(worker = %inner.me, peer = rank, error = %detail, "pipe to peer failed");
                inner.mark_lost(rank, detail);
                return;
            }
        };
        match inner.receive(rank, &d, allocation) {
            Ok((Envelope::Response(Response { id, result }), payload)) => {
                inner.activity.fetch_add(1, Ordering::Relaxed);
                let result = match result {
                    Ok(_) => Ok(payload.unwrap_or_default()),
                    Err(e) => Err(inner.rpc_error(rank, e)),
                };
                inner.finish_call(id, result);
            }
            Ok((other, _)) => {
                let detail = format!("protocol error: unexpected {other:?} on a reply pipe");
                pipe.close();
                inner.mark_lost(rank, detail);
                return;
            }
            Err(e) => {
                pipe.close();
                inner.mark_lost(rank, format!("protocol error: {e}"));
                return;
            }
        }
        tokio::task::yield_now().await;
    }
}

/// Fails calls whose deadline passed.
async fn run_timer(weak: std::sync::Weak<AgentInner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down() {
            return;
        }
        let now = Instant::now();
        let mut expired = Vec::new();
        let next = {
            let mut calls = inner.calls.lock().unwrap();
            while let Some(&(d, id)) = calls.deadlines.first() {
                if d > now {
                    break;
                }
                calls.deadlines.pop_first();
                if let Some(p) = calls.map.remove(&id) {
                    expired.push(p);
                }
            }
            calls.deadlines.first().map(|(d, _)| *d)
        };
        for p in expired {
            let worker = inner.name_of(p.peer).to_owned();
            p.slot.complete(Err(RpcError::Timeout {
                worker,
                timeout: p.timeout,
            }));
        }
        // The runtime's shutdown at teardown ends this task (and drops `inner`).
        let notified = inner.timer.notified();
        match next {
            Some(d) => {
                let _ = tokio::time::timeout_at(d.into(), notified).await;
            }
            None => {
                // Re-check now and then so a dropped agent lets this task end.
                let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
            }
        }
    }
}
