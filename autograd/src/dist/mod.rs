//! Distributed autograd: contexts, recorded RPCs, the distributed backward and cleanup.
//!
//! - A [`Context`] is one training step on its driving worker; its id is
//!   `worker << 48 | counter`. A thread has at most one (entering a second is an error).
//! - [`rpc_sync`] / [`rpc_async`] call functions registered with [`function`]. Inside a
//!   context, the tensors that need grad get a *send* node on the sender and a *recv* node on the
//!   receiver, tied by (context id, message id); results come back the same way, so a remote
//!   result is part of the caller's graph.
//! - [`Context::backward`] runs the local graph. Reaching a recv node sends its gradients to the
//!   sender, whose send node starts a pass there; every worker's part runs as soon as its
//!   gradients arrive, and the call returns when every part (transitively) is done.
//!
//! **Unlike PyTorch's FAST mode, a pass never waits for a send node.** Each arriving gradient
//! runs its own pass, and backward functions are linear in their incoming gradient, so the
//! sums at the leaves are the same as one merged pass. This is why an RPC result that needs
//! grad but is unused in the loss cannot hang the backward: no pass waits for it. Its send node
//! simply receives nothing, and [`Context::unused_sends`] reports it. The cost is that a
//! subgraph fed by several sends runs once per arriving gradient.
//!
//! Gradients accumulate in the context (keyed by [`LeafId`]), never in a tensor's own grad.
//! Releasing a context releases it on every worker that took part, forwarding along the call
//! tree with retried, idempotent messages. A reaper reclaims contexts whose driver died (or
//! whose release never arrived): it asks the driver whether the context is still alive.

pub mod remote;
pub mod wire;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sluice_agent::{
    Agent, CallContext, Dest, HandlerError, MembershipEvent, Payload, RRef, Registry, RpcError, RpcFuture,
};

use crate::engine::{self, add_grads, Sink};
use crate::error::{Error, Result};
use crate::graph::{edge_of, Edge, LeafState, Node, NodeKind};
use crate::tensor::{LeafId, Tensor};
use wire::{from_wire, to_wire, WireTensor};

const H_BACKWARD: &str = "sluice.autograd.backward";
const H_RELEASE: &str = "sluice.autograd.release";
const H_ALIVE: &str = "sluice.autograd.alive";
const ERROR_KIND: &str = "DistAutogradError";

/// Tuning and fault injection for the distributed layer (process-wide; see [`configure`]).
#[derive(Debug, Clone)]
pub struct DistOptions {
    /// Attempts per release message before giving up (logged).
    pub release_attempts: u32,
    /// Timeout of one release attempt.
    pub release_timeout: Duration,
    /// First pause between release attempts (then ×1.5 each time).
    pub release_backoff: Duration,
    /// How often the reaper looks for contexts whose driver may be gone.
    pub reap_interval: Duration,
    /// A context untouched this long is checked with its driver.
    pub reap_idle: Duration,
    /// Fault injection: this worker ignores (answers with an error) its first N release
    /// messages, as if they were lost.
    pub drop_releases: u32,
}

impl Default for DistOptions {
    fn default() -> Self {
        DistOptions {
            release_attempts: 10,
            release_timeout: Duration::from_secs(10),
            release_backoff: Duration::from_millis(50),
            reap_interval: Duration::from_secs(10),
            reap_idle: Duration::from_secs(60),
            drop_releases: 0,
        }
    }
}

/// Sets the process-wide options (call before `Agent::init`, or at any time for the reaper
/// and release settings to apply from then on).
pub fn configure(options: DistOptions) {
    let c = container();
    c.dropped_releases.store(options.drop_releases, Ordering::Relaxed);
    *c.options.lock().unwrap() = options;
}

/// The sending end of a recorded RPC.
pub struct SendInfo {
    /// How many gradients arrived for it (0 at the end of a backward: an unused result).
    pub(crate) received: AtomicU32,
}

/// The receiving end of a recorded RPC.
pub struct RecvInfo {
    pub(crate) context: u64,
    pub(crate) message: u64,
    pub(crate) from: u32,
}

/// One recorded RPC of a context on this worker, for debugging (see [`Context::rpc_points`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RpcPoint {
    pub kind: PointKind,
    /// The message id that ties the send node on one worker to the recv node on the other.
    pub message: u64,
    /// The worker on the other end (the destination of a send, the source of a recv).
    pub peer: u32,
}

/// Which end of a recorded RPC a point is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PointKind {
    /// A send node: gradients for it arrive from `peer`.
    Send,
    /// A recv node: gradients from it go back to `peer`.
    Recv,
}

pub(crate) struct ContextState {
    id: u64,
    sends: Mutex<HashMap<u64, Arc<Node>>>,
    /// Every send and recv node recorded here, in order.
    points: Mutex<Vec<RpcPoint>>,
    grads: Mutex<HashMap<LeafId, Tensor>>,
    known: Mutex<BTreeSet<u32>>,
    last_used: Mutex<Instant>,
    graph_freed: AtomicBool,
    /// A worker this context involves was lost: its backward cannot complete.
    lost: Mutex<Option<String>>,
}

impl ContextState {
    fn new(id: u64) -> ContextState {
        ContextState {
            id,
            sends: Mutex::default(),
            points: Mutex::default(),
            grads: Mutex::default(),
            known: Mutex::default(),
            last_used: Mutex::new(Instant::now()),
            graph_freed: AtomicBool::new(false),
            lost: Mutex::new(None),
        }
    }

    fn touch(&self) {
        *self.last_used.lock().unwrap() = Instant::now();
    }
}

struct Container {
    worker: OnceLock<u32>,
    agent: Mutex<Option<Agent>>,
    next_context: AtomicU64,
    next_message: AtomicU64,
    contexts: Mutex<HashMap<u64, Arc<ContextState>>>,
    released: Mutex<HashSet<u64>>,
    options: Mutex<DistOptions>,
    dropped_releases: AtomicU32,
    reaper: OnceLock<()>,
    release_jobs: OnceLock<Mutex<std::sync::mpsc::Sender<ReleaseJob>>>,
}

fn container() -> &'static Container {
    static C: OnceLock<Container> = OnceLock::new();
    C.get_or_init(|| Container {
        worker: OnceLock::new(),
        agent: Mutex::new(None),
        next_context: AtomicU64::new(0),
        next_message: AtomicU64::new(0),
        contexts: Mutex::default(),
        released: Mutex::default(),
        options: Mutex::new(DistOptions::default()),
        dropped_releases: AtomicU32::new(0),
        reaper: OnceLock::new(),
        release_jobs: OnceLock::new(),
    })
}

const ID_BITS: u32 = 48;
const ID_MASK: u64 = (1 << ID_BITS) - 1;

impl Container {
    /// Binds the container to this process's agent (first use) and starts the reaper.
    fn bind(&self, agent: &Agent) -> u32 {
        let me = *self.worker.get_or_init(|| agent.info().id);
        {
            let mut a = self.agent.lock().unwrap();
            if a.is_none() {
                *a = Some(agent.clone());
            }
        }
        self.reaper.get_or_init(|| {
            let _ = std::thread::Builder::new()
                .name("sluice-autograd-reaper".into())
                .spawn(reap_loop);
            agent.on_membership(|e| match e {
                MembershipEvent::Lost { worker, detail } => {
                    container().worker_lost(worker.id, &format!("{worker} was lost: {detail}"))
                }
                MembershipEvent::Left(worker) => {
                    container().worker_lost(worker.id, &format!("{worker} left the group"))
                }
                _ => {}
            });
        });
        me
    }

    fn next_id(counter: &AtomicU64, worker: u32) -> u64 {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        assert!(n < ID_MASK, "autograd ids exhausted on worker {worker}");
        ((worker as u64) << ID_BITS) | n
    }

    fn get(&self, id: u64) -> Result<Arc<ContextState>> {
        self.contexts
            .lock()
            .unwrap()
            .get(&id)
            .cloned()
            .ok_or(Error::UnknownContext(id))
    }

    /// The context a message names, created on first sight (unless already released here).
    fn get_or_create(&self, id: u64) -> Result<Arc<ContextState>> {
        if self.released.lock().unwrap().contains(&id) {
            return Err(Error::UnknownContext(id));
        }
        let ctx = self
            .contexts
            .lock()
            .unwrap()
            .entry(id)
            .or_insert_with(|| Arc::new(ContextState::new(id)))
            .clone();
        ctx.touch();
        Ok(ctx)
    }

    /// A worker is gone: contexts it drove are reclaimed now (nobody will release them), and
    /// contexts it took part in are marked so their backward fails at once, naming it. Those
    /// are released by their driver as usual (a release to the lost worker fails fast).
    fn worker_lost(&self, worker: u32, detail: &str) {
        remote::forget_caller(worker);
        let (driven, involved): (Vec<u64>, Vec<Arc<ContextState>>) = {
            let contexts = self.contexts.lock().unwrap();
            let driven = contexts
                .keys()
                .filter(|id| (*id >> ID_BITS) as u32 == worker)
                .copied()
                .collect();
            let involved = contexts
                .values()
                .filter(|c| c.known.lock().unwrap().contains(&worker))
                .cloned()
                .collect();
            (driven, involved)
        };
        for c in involved {
            c.lost.lock().unwrap().get_or_insert_with(|| detail.to_owned());
        }
        let reclaimed = driven.into_iter().filter(|id| self.remove(*id).is_some()).count();
        if reclaimed > 0 {
            tracing::info!(worker, reclaimed, "reclaimed the autograd contexts a lost worker drove");
        }
    }

    fn remove(&self, id: u64) -> Option<Arc<ContextState>> {
        self.released.lock().unwrap().insert(id);
        self.contexts.lock().unwrap().remove(&id)
    }
}

thread_local! {
    static CURRENT: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// The id of this thread's context, if any.
pub fn current_context() -> Option<u64> {
    CURRENT.with(|c| c.get())
}

fn with_current<R>(id: Option<u64>, f: impl FnOnce() -> R) -> R {
    let previous = CURRENT.with(|c| c.replace(id));
    struct Restore(Option<u64>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set(self.0));
        }
    }
    let _r = Restore(previous);
    f()
}

/// Time this process spent computing backward passes (local work only, not the waits for
/// the parts they sent to other workers): how busy a pipeline stage was, for its bubble.
pub fn backward_busy() -> Duration {
    Duration::from_nanos(BACKWARD_BUSY_NS.load(Ordering::Relaxed))
}

static BACKWARD_BUSY_NS: AtomicU64 = AtomicU64::new(0);

/// Ids of every context this worker currently holds (for tests and diagnostics).
pub fn live_contexts() -> Vec<u64> {
    let mut v: Vec<u64> = container().contexts.lock().unwrap().keys().copied().collect();
    v.sort();
    v
}

/// One distributed training step, entered on the driving thread. Dropping it releases the
/// context here at once and sends the release to every worker that took part without waiting
/// (retried in the background); [`Context::release`] does the same and waits for every answer.
pub struct Context {
    state: Arc<ContextState>,
    agent: Agent,
    released: bool,
    // A context belongs to the thread that entered it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Context {
    /// Enters a new context on this thread.
    pub fn new(agent: &Agent) -> Result<Context> {
        if let Some(id) = current_context() {
            return Err(Error::NestedContext(id));
        }
        let c = container();
        let me = c.bind(agent);
        let id = Container::next_id(&c.next_context, me);
        let state = Arc::new(ContextState::new(id));
        c.contexts.lock().unwrap().insert(id, state.clone());
        CURRENT.with(|cur| cur.set(Some(id)));
        Ok(Context {
            state,
            agent: agent.clone(),
            released: false,
            _not_send: std::marker::PhantomData,
        })
    }

    /// A new context that is not entered on this thread: several can be alive at once and
    /// driven from one thread, each entered around its own work with [`run`](Self::run) (a
    /// pipeline's micro-batches, each in its own context, for updates per micro-batch).
    pub fn detached(agent: &Agent) -> Result<Context> {
        let c = container();
        let me = c.bind(agent);
        let id = Container::next_id(&c.next_context, me);
        let state = Arc::new(ContextState::new(id));
        c.contexts.lock().unwrap().insert(id, state.clone());
        Ok(Context {
            state,
            agent: agent.clone(),
            released: false,
            _not_send: std::marker::PhantomData,
        })
    }

    /// Runs `f` with this context current on this thread (RPCs it makes are recorded here),
    /// then restores whichever context was current before.
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        with_current(Some(self.state.id), f)
    }

    pub fn id(&self) -> u64 {
        self.state.id
    }

    /// Runs the distributed backward from one-element `roots` (see [`backward`]).
    pub fn backward(&self, roots: &[Tensor], retain_graph: bool) -> Result<()> {
        backward_in(&self.agent, &self.state, roots, retain_graph, &[]).map(drop)
    }

    /// The gradients accumulated in this context on this worker, by leaf.
    pub fn gradients(&self) -> HashMap<LeafId, Tensor> {
        self.state.grads.lock().unwrap().clone()
    }

    /// The gradient of one leaf (a parameter's tensor or any leaf that requires grad).
    pub fn gradient(&self, leaf: &Tensor) -> Option<Tensor> {
        let id = leaf.leaf_id()?;
        self.state.grads.lock().unwrap().get(&id).cloned()
    }

    /// Message ids of this worker's send nodes in the context that received no gradient.
    pub fn unused_sends(&self) -> Vec<u64> {
        unused_sends(&self.state)
    }

    /// The RPCs recorded in this context on this worker, in order: each send node (with the
    /// worker its gradients come from) and recv node (with the worker its gradients go to),
    /// tied across workers by message id. For debugging a graph that spans workers.
    pub fn rpc_points(&self) -> Vec<RpcPoint> {
        self.state.points.lock().unwrap().clone()
    }

    /// Releases the context everywhere now, reporting workers that could not be told.
    pub fn release(mut self) -> Result<()> {
        self.released = true;
        CURRENT.with(|c| {
            if c.get() == Some(self.state.id) {
                c.set(None)
            }
        });
        release_everywhere(&self.agent, self.state.id, None, true)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        CURRENT.with(|c| {
            if c.get() == Some(self.state.id) {
                c.set(None)
            }
        });
        if let Err(e) = release_everywhere(&self.agent, self.state.id, None, false) {
            tracing::warn!(context = self.state.id, error = %e, "could not release a distributed autograd context everywhere");
        }
    }
}

fn unused_sends(state: &ContextState) -> Vec<u64> {
    let sends = state.sends.lock().unwrap();
    let mut v: Vec<u64> = sends
        .iter()
        .filter(|(_, n)| matches!(&n.kind, NodeKind::Send(s) if s.received.load(Ordering::Relaxed) == 0))
        .map(|(&m, _)| m)
        .collect();
    v.sort();
    v
}

/// [`Context::rpc_points`] of context `id` on this worker (from a handler, say).
pub fn rpc_points(id: u64) -> Result<Vec<RpcPoint>> {
    Ok(container().get(id)?.points.lock().unwrap().clone())
}

/// The gradients accumulated in context `id` on this worker.
pub fn get_gradients(id: u64) -> Result<HashMap<LeafId, Tensor>> {
    Ok(container().get(id)?.grads.lock().unwrap().clone())
}

/// Runs the distributed backward of context `id` (which must be live on this worker).
pub fn backward(agent: &Agent, id: u64, roots: &[Tensor], retain_graph: bool) -> Result<()> {
    let state = container().get(id)?;
    backward_in(agent, &state, roots, retain_graph, &[]).map(drop)
}

/// The backward of context `id` (live on this worker; graph freed), asking each worker in
/// `steps` (worker, optimizer id on it) that the backward reaches to step that optimizer before
/// it answers, where it can tell that its gradients are final by then; returns the workers that
/// did.
pub(crate) fn backward_stepping(agent: &Agent, id: u64, roots: &[Tensor], steps: &[(u32, u64)]) -> Result<Vec<u32>> {
    let state = container().get(id)?;
    backward_in(agent, &state, roots, false, steps)
}

/// The backward of `state` from `roots`; `steps` as in [`backward_stepping`], whose result
/// this is.
fn backward_in(
    agent: &Agent,
    state: &Arc<ContextState>,
    roots: &[Tensor],
    retain_graph: bool,
    steps: &[(u32, u64)],
) -> Result<Vec<u32>> {
    if roots.is_empty() {
        return Err(Error::Backward("no tensors provided for gradient computation".into()));
    }
    if state.graph_freed.load(Ordering::Acquire) {
        return Err(Error::GraphFreed("an earlier distributed backward in this context"));
    }
    if let Some(detail) = state.lost.lock().unwrap().clone() {
        return Err(Error::Backward(format!("context {} cannot run: {detail}", state.id)));
    }
    let starts = roots
        .iter()
        .map(|r| engine::root_start(r, None))
        .collect::<Result<Vec<_>>>()?;
    state.touch();
    let me = container().bind(agent);
    // A worker may step in its answer only if this pass sends it one message. A receive
    // function here sends on one message per pass that reaches it, but:
    // - a send function here (a tensor this worker sent on that needs its gradient) starts a
    //   pass of its own when that gradient comes back, and it may reach the same receive
    //   function again: only with no send functions here is this pass the only one;
    // - several receive functions may stand for one send function there (every `to_here` of
    //   one `remote` result is a receive function of its own): only a worker this context
    //   received from once gets the request.
    let steps: Vec<(u32, u64)> = if state.sends.lock().unwrap().is_empty() {
        let points = state.points.lock().unwrap();
        let received_from = |w: u32| {
            points
                .iter()
                .filter(|p| p.kind == PointKind::Recv && p.peer == w)
                .count()
        };
        steps.iter().copied().filter(|&(w, _)| received_from(w) == 1).collect()
    } else {
        Vec::new()
    };
    let result = run_pass(agent, state, starts, retain_graph, &steps).map_err(|e| on_worker(me, e));
    if result.is_ok() && !retain_graph {
        state.graph_freed.store(true, Ordering::Release);
    }
    result
}

/// Wraps a local failure as "error on worker N"; remote failures keep their own worker.
fn on_worker(me: u32, e: Error) -> Error {
    match e {
        e @ (Error::OnWorker { .. } | Error::Rpc(_)) => e,
        other => Error::OnWorker {
            worker: me,
            detail: other.to_string(),
        },
    }
}

struct DistSink<'a> {
    agent: &'a Agent,
    state: &'a Arc<ContextState>,
    retain: bool,
    /// Optimizers to step where the gradients go (worker, optimizer id there).
    steps: &'a [(u32, u64)],
    pending: Mutex<Vec<(u32, RpcFuture)>>,
}

impl Sink for DistSink<'_> {
    fn accumulate(&self, leaf: &Arc<LeafState>, grad: Tensor) -> Result<()> {
        let mut grads = self.state.grads.lock().unwrap();
        let merged = match grads.remove(&leaf.id) {
            Some(prev) => add_grads(prev, grad)?,
            None => grad,
        };
        grads.insert(leaf.id, merged);
        Ok(())
    }

    fn recv(&self, _: &Node, info: &RecvInfo, grads: Vec<Option<Tensor>>) -> Result<()> {
        let mut tensors = Vec::new();
        let metas: Vec<Option<WireTensor>> = grads
            .iter()
            .map(|g| {
                g.as_ref()
                    .map(|g| {
                        let (w, data) = to_wire(g, tensors.len() as u32)?;
                        tensors.push(pipe_tensor(data));
                        Ok(w)
                    })
                    .transpose()
            })
            .collect::<Result<_>>()?;
        let header = BackwardHeader {
            context: info.context,
            message: info.message,
            retain_graph: self.retain,
            grads: metas,
            step: self.steps.iter().find(|(w, _)| *w == info.from).map(|&(_, id)| id),
        };
        let payload = Payload::encode(&header)?.with_tensors(tensors);
        let fut = self.agent.rpc_async(info.from, H_BACKWARD, payload);
        self.pending.lock().unwrap().push((info.from, fut));
        Ok(())
    }
}

/// Runs a local pass and waits for every gradient it sent on to be processed downstream;
/// returns the workers that answered that they stepped their optimizer (see `steps` in
/// [`backward_stepping`]).
fn run_pass(
    agent: &Agent,
    state: &Arc<ContextState>,
    starts: Vec<(Arc<Node>, Vec<Option<Tensor>>)>,
    retain: bool,
    steps: &[(u32, u64)],
) -> Result<Vec<u32>> {
    let sink = DistSink {
        agent,
        state,
        retain,
        steps,
        pending: Mutex::new(Vec::new()),
    };
    let started = Instant::now();
    let local = engine::run(starts, &sink, true);
    BACKWARD_BUSY_NS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    // Wait for everything sent, even after a local error, so no part is left running unseen.
    let mut first: Option<Error> = local.err();
    let mut stepped = Vec::new();
    for (worker, fut) in sink.pending.into_inner().unwrap() {
        match fut.wait() {
            // The answer says whether the worker stepped; one that cannot be read is an error
            // (counting it as "did not step" could step that worker twice).
            Ok(reply) => match reply.decode::<bool>() {
                Ok(true) => stepped.push(worker),
                Ok(false) => {}
                Err(e) => {
                    first.get_or_insert(Error::Wire(format!(
                        "worker {worker}'s answer to a backward message: {e}"
                    )));
                }
            },
            Err(e) => {
                first.get_or_insert(remote_error(e));
            }
        }
    }
    first.map_or(Ok(stepped), Err)
}

/// An RPC failure as an error: a worker's own "error on worker N: …" report keeps its number.
pub(crate) fn remote_error(e: RpcError) -> Error {
    if let RpcError::Remote { message, .. } = &e {
        let report = message
            .strip_prefix("error on worker ")
            .and_then(|m| m.split_once(": "));
        if let Some((worker, detail)) = report.and_then(|(n, d)| Some((n.parse().ok()?, d))) {
            return Error::OnWorker {
                worker,
                detail: detail.to_string(),
            };
        }
    }
    Error::Rpc(e)
}

fn to_handler_error(me: u32, e: Error) -> HandlerError {
    match on_worker(me, e) {
        e @ Error::OnWorker { .. } => HandlerError::new(ERROR_KIND, e.to_string()),
        other => HandlerError::new(ERROR_KIND, format!("error on worker {me}: {other}")),
    }
}

#[derive(Serialize, Deserialize)]
struct BackwardHeader {
    context: u64,
    message: u64,
    retain_graph: bool,
    grads: Vec<Option<WireTensor>>,
    /// An optimizer (its id on the receiver) to step once this message's pass is done, if
    /// the receiver can tell its gradients are final then; the answer says whether it did.
    step: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct CallHeader {
    context: Option<u64>,
    message: u64,
    tensors: Vec<WireTensor>,
    value: Bytes,
}

#[derive(Serialize, Deserialize)]
struct ReplyHeader {
    /// Set when the reply's tensors need grad: the message id of the callee's send node.
    message: Option<u64>,
    tensors: Vec<WireTensor>,
    value: Bytes,
}

/// A pipe tensor over `data`; the agent places it by the device map to its destination.
fn pipe_tensor(data: sluice_channel::SendBuffer) -> sluice_agent::Tensor {
    sluice_agent::Tensor {
        buffer: data,
        metadata: Bytes::new(),
        target_device: None,
    }
}

/// Encodes a value and its tensors; inside a context with tensors that need grad, records a
/// send node and returns its message id.
fn send_side<T: Serialize + ?Sized>(
    value: &T,
    ctx: Option<&Arc<ContextState>>,
    me: u32,
    to: u32,
) -> Result<(Payload, Vec<WireTensor>, Bytes, Option<u64>)> {
    let (bytes, tensors) = wire::encode(value)?;
    let mut metas = Vec::with_capacity(tensors.len());
    let mut buffers = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let (w, data) = to_wire(t, i as u32)?;
        metas.push(w);
        buffers.push(pipe_tensor(data));
    }
    let message = match ctx {
        Some(ctx) if tensors.iter().any(Tensor::requires_grad) => {
            let message = Container::next_id(&container().next_message, me);
            let next: Vec<Option<Edge>> = tensors.iter().map(edge_of).collect();
            let outputs = next.len();
            let node = Node::new(
                "SendRpcBackward",
                NodeKind::Send(SendInfo {
                    received: AtomicU32::new(0),
                }),
                next,
                outputs,
            );
            ctx.sends.lock().unwrap().insert(message, node);
            ctx.points.lock().unwrap().push(RpcPoint {
                kind: PointKind::Send,
                message,
                peer: to,
            });
            Some(message)
        }
        _ => None,
    };
    let payload = Payload::empty().with_tensors(buffers);
    Ok((payload, metas, Bytes::from(bytes), message))
}

/// Rebuilds received tensors; those that need grad become outputs of one recv node.
fn recv_side(
    metas: &[WireTensor],
    buffers: Vec<sluice_agent::Tensor>,
    ctx: Option<&Arc<ContextState>>,
    message: Option<u64>,
    from: u32,
) -> Result<Vec<Tensor>> {
    if metas.len() != buffers.len() {
        return Err(Error::Wire(format!(
            "{} tensor descriptions for {} buffers",
            metas.len(),
            buffers.len()
        )));
    }
    let mut out = Vec::with_capacity(metas.len());
    for (i, (w, b)) in metas.iter().zip(buffers).enumerate() {
        if w.buffer as usize != i {
            return Err(Error::Wire(format!("tensor {i} names buffer {}", w.buffer)));
        }
        out.push(from_wire(w, b.buffer)?);
    }
    if let (Some(ctx), Some(message)) = (ctx, message) {
        if metas.iter().any(|w| w.requires_grad) {
            let node = Node::new(
                "RecvRpcBackward",
                NodeKind::Recv(RecvInfo {
                    context: ctx.id,
                    message,
                    from,
                }),
                Vec::new(),
                out.len(),
            );
            ctx.points.lock().unwrap().push(RpcPoint {
                kind: PointKind::Recv,
                message,
                peer: from,
            });
            for (slot, (t, w)) in out.iter_mut().zip(metas).enumerate() {
                if w.requires_grad {
                    *t = t.with_edge(Edge {
                        node: node.clone(),
                        slot,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Registers `f` as a function callable with [`rpc_sync`] / [`rpc_async`]. Its argument and
/// result are any serde values; the tensors inside them travel as pipe tensors, and inside a
/// context the caller's graph continues through `f` and back.
pub fn function<A, R, F>(registry: &mut Registry, name: &str, f: F)
where
    A: DeserializeOwned,
    R: Serialize,
    F: Fn(&CallContext, A) -> std::result::Result<R, HandlerError> + Send + Sync + 'static,
{
    registry.raw_handler(name, move |cx, payload| serve_call(cx, payload, |arg| f(cx, arg)));
}

/// Registers `f` as a method on RRef values of type `T`, callable through the proxy forms
/// [`rref_rpc_sync`] / [`rref_rpc_async`]: like [`function`], inside a context the caller's
/// graph continues through `f` (and the value's own parameters) and back.
pub fn method<T, A, R, F>(registry: &mut Registry, name: &str, f: F)
where
    T: DeserializeOwned + Send + Sync + 'static,
    A: DeserializeOwned,
    R: Serialize,
    F: Fn(&CallContext, &T, A) -> std::result::Result<R, HandlerError> + Send + Sync + 'static,
{
    registry.raw_method(name, move |cx, value: &T, payload| {
        serve_call(cx, payload, |arg| f(cx, value, arg))
    });
}

/// The callee's half of a recorded call: a recv node for the arguments' tensors (inside the
/// caller's context), `run` with the context current, and a send node for the result's.
fn serve_call<A: DeserializeOwned, R: Serialize>(
    cx: &CallContext,
    mut payload: Payload,
    run: impl FnOnce(A) -> std::result::Result<R, HandlerError>,
) -> std::result::Result<Payload, HandlerError> {
    let header: CallHeader = payload
        .decode()
        .map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
    let buffers = payload.take_tensors();
    let (ctx, inputs) = serve_inputs(cx, &header, buffers)?;
    let arg: A = wire::decode(&header.value, inputs).map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
    let result = with_current(header.context, || run(arg))?;
    serve_reply(cx, &result, ctx.as_ref())
}

/// The first half of serving a recorded call: the caller's context (created here on first
/// sight) and the arguments' tensors, tied to the caller's send node by a recv node.
fn serve_inputs(
    cx: &CallContext,
    header: &CallHeader,
    buffers: Vec<sluice_agent::Tensor>,
) -> std::result::Result<(Option<Arc<ContextState>>, Vec<Tensor>), HandlerError> {
    let ctx = caller_context(cx, header.context)?;
    let inputs = recv_side(
        &header.tensors,
        buffers,
        ctx.as_ref(),
        Some(header.message),
        cx.caller.id,
    )
    .map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
    Ok((ctx, inputs))
}

/// The caller's context `id` names, created here on first sight, knowing the caller.
fn caller_context(cx: &CallContext, id: Option<u64>) -> std::result::Result<Option<Arc<ContextState>>, HandlerError> {
    let c = container();
    let me = c.bind(&cx.agent);
    let Some(id) = id else { return Ok(None) };
    let ctx = c.get_or_create(id).map_err(|e| to_handler_error(me, e))?;
    ctx.known.lock().unwrap().insert(cx.caller.id);
    Ok(Some(ctx))
}

/// The second half: the result as a recorded reply (a send node for its tensors that need
/// grad, inside `ctx`).
fn serve_reply<R: Serialize + ?Sized>(
    cx: &CallContext,
    result: &R,
    ctx: Option<&Arc<ContextState>>,
) -> std::result::Result<Payload, HandlerError> {
    let me = container().bind(&cx.agent);
    let (mut payload, metas, value, message) =
        send_side(result, ctx, me, cx.caller.id).map_err(|e| HandlerError::new("EncodeError", e.to_string()))?;
    let tensors = payload.take_tensors();
    let reply = ReplyHeader {
        message,
        tensors: metas,
        value,
    };
    Ok(Payload::encode(&reply)?.with_tensors(tensors))
}

/// A call in flight (see [`rpc_async`]).
pub struct DistFuture<R> {
    fut: RpcFuture,
    ctx: Option<Arc<ContextState>>,
    to: u32,
    _r: std::marker::PhantomData<fn() -> R>,
}

impl<R: DeserializeOwned> DistFuture<R> {
    /// Waits for the result; inside a context its tensors are part of the caller's graph.
    pub fn wait(self) -> Result<R> {
        receive_reply(self.fut.wait()?, self.ctx.as_ref(), self.to)
    }
}

/// The caller's half of a recorded reply: a recv node for the result's tensors, tied to the
/// callee's send node.
fn receive_reply<R: DeserializeOwned>(mut payload: Payload, ctx: Option<&Arc<ContextState>>, from: u32) -> Result<R> {
    let reply: ReplyHeader = payload.decode()?;
    let buffers = payload.take_tensors();
    let tensors = recv_side(&reply.tensors, buffers, ctx, reply.message, from)?;
    wire::decode(&reply.value, tensors)
}

/// This thread's context (known to involve `to` from now on), if it is in one.
fn current_for(agent: &Agent, to: u32) -> Result<Option<Arc<ContextState>>> {
    let c = container();
    c.bind(agent);
    match current_context() {
        Some(id) => {
            let ctx = c.get(id)?;
            ctx.known.lock().unwrap().insert(to);
            ctx.touch();
            Ok(Some(ctx))
        }
        None => Ok(None),
    }
}

/// The caller's half of a recorded call to `to`: the argument's payload, with a send node for
/// its tensors inside `ctx`.
fn outgoing<A: Serialize + ?Sized>(
    agent: &Agent,
    ctx: Option<&Arc<ContextState>>,
    to: u32,
    arg: &A,
) -> Result<Payload> {
    let c = container();
    let me = c.bind(agent);
    let (payload, metas, value, message) = send_side(arg, ctx, me, to)?;
    let header = CallHeader {
        context: ctx.map(|c| c.id),
        message: message.unwrap_or_else(|| Container::next_id(&c.next_message, me)),
        tensors: metas,
        value,
    };
    Ok(Payload::encode(&header)?.with_tensors(payload.tensors))
}

/// Both steps of a recorded call's start: this thread's context (if any) and the payload.
fn prepare<A: Serialize + ?Sized>(agent: &Agent, to: u32, arg: &A) -> Result<(Option<Arc<ContextState>>, Payload)> {
    let ctx = current_for(agent, to)?;
    let payload = outgoing(agent, ctx.as_ref(), to, arg)?;
    Ok((ctx, payload))
}

impl<R> DistFuture<R> {
    fn new(fut: RpcFuture, ctx: Option<Arc<ContextState>>, to: u32) -> Self {
        DistFuture {
            fut,
            ctx,
            to,
            _r: std::marker::PhantomData,
        }
    }
}

/// Calls function `name` (registered with [`function`]) on `to`. Inside a context (of this
/// thread) the call is recorded for the distributed backward.
pub fn rpc_async<A: Serialize + ?Sized, R: DeserializeOwned>(
    agent: &Agent,
    to: impl Into<Dest>,
    name: &str,
    arg: &A,
) -> Result<DistFuture<R>> {
    let to = agent.worker(to)?.id;
    let (ctx, payload) = prepare(agent, to, arg)?;
    Ok(DistFuture::new(agent.rpc_async(to, name, payload), ctx, to))
}

/// Proxy form: calls method `name` (registered with [`method`]) on `rref`'s value, on its
/// owner. Inside a context the call is recorded like [`rpc_async`] (PyTorch's
/// `rref.rpc_async().name(arg)` inside a dist-autograd context).
pub fn rref_rpc_async<T: DeserializeOwned + Send + Sync + 'static, A: Serialize + ?Sized, R: DeserializeOwned>(
    agent: &Agent,
    rref: &RRef<T>,
    name: &str,
    arg: &A,
) -> Result<DistFuture<R>> {
    let to = rref.owner().id;
    let (ctx, payload) = prepare(agent, to, arg)?;
    let fut = rref.rpc_async_raw(name, payload, rref.default_timeout()?);
    Ok(DistFuture::new(fut, ctx, to))
}

/// [`rref_rpc_async`] and wait.
pub fn rref_rpc_sync<T: DeserializeOwned + Send + Sync + 'static, A: Serialize + ?Sized, R: DeserializeOwned>(
    agent: &Agent,
    rref: &RRef<T>,
    name: &str,
    arg: &A,
) -> Result<R> {
    rref_rpc_async(agent, rref, name, arg)?.wait()
}

/// Runs function `name` (registered with [`function`]) on `to`, which keeps the result as a
/// reference's value. Inside a context the call is recorded, and so is every
/// [`DistRRef::to_here`] of the result in that context: gradients flow from where the value is
/// used, through the owner's graph, back to this call's arguments (PyTorch's `rpc.remote`
/// followed by `to_here`).
pub fn remote<A: Serialize + ?Sized, R>(
    agent: &Agent,
    to: impl Into<Dest>,
    name: &str,
    arg: &A,
) -> Result<DistRRef<R>> {
    let to = agent.worker(to)?.id;
    let (_, payload) = prepare(agent, to, arg)?;
    Ok(DistRRef {
        rref: agent.remote(to, name, payload)?,
        agent: agent.clone(),
        _r: std::marker::PhantomData,
    })
}

/// Proxy, `remote` form: runs method `name` (registered with [`method`]) on `rref`'s value;
/// its owner keeps the result. Recorded like [`remote`], and so is its `to_here` (PyTorch's
/// `rref.remote().name(arg)` inside a dist-autograd context).
pub fn rref_remote<T: DeserializeOwned + Send + Sync + 'static, A: Serialize + ?Sized, R>(
    agent: &Agent,
    rref: &RRef<T>,
    name: &str,
    arg: &A,
) -> Result<DistRRef<R>> {
    let to = rref.owner().id;
    let (_, payload) = prepare(agent, to, arg)?;
    Ok(DistRRef {
        rref: rref.remote_raw(name, payload, rref.default_timeout()?)?,
        agent: agent.clone(),
        _r: std::marker::PhantomData,
    })
}

/// A value made by [`remote`] or [`rref_remote`], kept on its owner; [`to_here`](Self::to_here)
/// fetches it.
pub struct DistRRef<R> {
    /// The value as kept on the owner: the function's recorded reply.
    rref: RRef<()>,
    agent: Agent,
    _r: std::marker::PhantomData<fn() -> R>,
}

impl<R: DeserializeOwned> DistRRef<R> {
    /// Where the value lives.
    pub fn owner(&self) -> &sluice_agent::WorkerInfo {
        self.rref.owner()
    }

    /// A copy of the value. Inside a context its tensors are part of the caller's graph: a
    /// recv node tied to the send node the owner recorded when it made the value (so fetch it
    /// in the context it was made in).
    pub fn to_here(&self) -> Result<R> {
        let from = self.rref.owner().id;
        let ctx = current_for(&self.agent, from)?;
        let payload = self.rref.fetch(self.rref.default_timeout()?).wait()?;
        receive_reply(payload, ctx.as_ref(), from)
    }
}

/// [`rpc_async`] and wait.
pub fn rpc_sync<A: Serialize + ?Sized, R: DeserializeOwned>(
    agent: &Agent,
    to: impl Into<Dest>,
    name: &str,
    arg: &A,
) -> Result<R> {
    rpc_async(agent, to, name, arg)?.wait()
}

/// Registers the handlers distributed autograd and the distributed optimizer need. Call on
/// the registry of every worker before `Agent::init`.
pub fn install(registry: &mut Registry) {
    remote::install(registry);
    registry.raw_handler(H_BACKWARD, |cx, mut payload| {
        let c = container();
        let me = c.bind(&cx.agent);
        let header: BackwardHeader = payload
            .decode()
            .map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
        let buffers = payload.take_tensors();
        let run = || -> Result<bool> {
            let ctx = c.get(header.context)?;
            ctx.touch();
            let node = ctx.sends.lock().unwrap().get(&header.message).cloned().ok_or_else(|| {
                Error::Backward(format!(
                    "context {} has no send function for message {}",
                    header.context, header.message
                ))
            })?;
            let mut buffers = buffers.into_iter();
            let mut grads = Vec::with_capacity(header.grads.len());
            for (i, g) in header.grads.iter().enumerate() {
                grads.push(match g {
                    None => None,
                    Some(w) => {
                        let b = buffers
                            .next()
                            .ok_or_else(|| Error::Wire(format!("gradient {i} has no buffer")))?;
                        let mut w = w.clone();
                        w.buffer = 0;
                        Some(from_wire(&w, b.buffer)?)
                    }
                });
            }
            if grads.len() != node.outputs {
                return Err(Error::Wire(format!(
                    "{} gradients for {} sent tensors",
                    grads.len(),
                    node.outputs
                )));
            }
            run_pass(&cx.agent, &ctx, vec![(node, grads)], header.retain_graph, &[])?;
            // Gradients reach this worker only through the send functions its context
            // recorded. With one, its messages come from one receive function on the caller,
            // which asks for a step only when its pass is the only one there (see
            // `backward_in`): this message is the only one, and the pass above (downstream
            // included) has finished. This worker's gradients are final, so its optimizer
            // steps now instead of on a call of its own. With more, another message may
            // still bring some: the caller steps it.
            let step = match header.step {
                Some(optimizer) if ctx.sends.lock().unwrap().len() == 1 => {
                    crate::optim::step_in_backward(optimizer, header.context)?;
                    true
                }
                _ => false,
            };
            Ok(step)
        };
        let stepped = run().map_err(|e| to_handler_error(me, e))?;
        Payload::encode(&stepped).map_err(|e| HandlerError::new("EncodeError", e.to_string()))
    });
    registry.handler(H_RELEASE, |cx, context: u64| {
        let c = container();
        c.bind(&cx.agent);
        let drop_it = c
            .dropped_releases
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if drop_it {
            return Err(HandlerError::new("Dropped", "release dropped by fault injection"));
        }
        release_everywhere(&cx.agent, context, Some(cx.caller.id), true)
            .map_err(|e| HandlerError::new(ERROR_KIND, e.to_string()))
    });
    registry.handler(H_ALIVE, |_cx, context: u64| {
        Ok(container().contexts.lock().unwrap().contains_key(&context))
    });
    crate::optim::install(registry);
}

/// Releases `id` here and tells every worker it reached (except `from`): all first attempts
/// go out at once, and each failed one is retried with backoff. With `wait`, returns once every
/// worker answered (or gave up); without, the retries run on the release thread.
fn release_everywhere(agent: &Agent, id: u64, from: Option<u32>, wait: bool) -> Result<()> {
    let c = container();
    let me = c.bind(agent);
    let Some(state) = c.remove(id) else {
        return Ok(());
    };
    let targets: Vec<u32> = state
        .known
        .lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|&w| Some(w) != from && w != me)
        .collect();
    let options = c.options.lock().unwrap().clone();
    let message = Payload::encode(&id)?;
    let first: Vec<(u32, RpcFuture)> = targets
        .into_iter()
        .map(|w| {
            (
                w,
                agent.rpc_async_timeout(w, H_RELEASE, message.clone(), options.release_timeout),
            )
        })
        .collect();
    let job = ReleaseJob {
        agent: agent.clone(),
        id,
        first,
        options,
    };
    if wait {
        return job.finish();
    }
    let sender = c.release_jobs.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<ReleaseJob>();
        let _ = std::thread::Builder::new()
            .name("sluice-autograd-release".into())
            .spawn(move || {
                for job in rx {
                    if let Err(e) = job.finish() {
                        tracing::warn!(error = %e, "could not release a distributed autograd context everywhere");
                    }
                }
            });
        Mutex::new(tx)
    });
    let _ = sender.lock().unwrap().send(job);
    Ok(())
}

struct ReleaseJob {
    agent: Agent,
    id: u64,
    first: Vec<(u32, RpcFuture)>,
    options: DistOptions,
}

impl ReleaseJob {
    fn finish(self) -> Result<()> {
        let mut failed = Vec::new();
        for (w, fut) in self.first {
            let outcome = match fut.wait() {
                Ok(_) => Ok(()),
                Err(e @ (RpcError::Shutdown | RpcError::PeerLost { .. })) => Err(Error::Rpc(e)),
                Err(_) => send_release(&self.agent, w, self.id, &self.options),
            };
            if let Err(e) = outcome {
                failed.push(format!("worker {w}: {e}"));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Error::Backward(format!(
                "context {} not released on {}",
                self.id,
                failed.join("; ")
            )))
        }
    }
}

fn send_release(agent: &Agent, worker: u32, id: u64, options: &DistOptions) -> Result<()> {
    let mut pause = options.release_backoff;
    let mut last = None;
    // The first attempt already failed (see `ReleaseJob::finish`).
    for attempt in 1..options.release_attempts.max(2) {
        std::thread::sleep(pause);
        pause = pause.mul_f64(1.5).min(Duration::from_secs(2));
        match agent.rpc_sync_timeout(worker, H_RELEASE, Payload::encode(&id)?, options.release_timeout) {
            Ok(_) => return Ok(()),
            Err(e @ (RpcError::Shutdown | RpcError::PeerLost { .. })) => return Err(e.into()),
            Err(e) => {
                tracing::debug!(context = id, worker, attempt, error = %e, "release attempt failed; retrying");
                last = Some(e);
            }
        }
    }
    Err(last.map(Error::Rpc).unwrap_or(Error::NoContext))
}

/// Reclaims contexts whose driver is gone or no longer knows them.
fn reap_loop() {
    loop {
        let options = container().options.lock().unwrap().clone();
        std::thread::sleep(options.reap_interval);
        let Some(agent) = container().agent.lock().unwrap().clone() else {
            continue;
        };
        if reap(&agent, options.reap_idle).is_err() {
            return; // The agent has shut down.
        }
    }
}

/// One reaper round: returns `Err` once the agent has shut down.
fn reap(agent: &Agent, idle: Duration) -> std::result::Result<usize, ()> {
    let c = container();
    let me = c.bind(agent);
    let candidates: Vec<u64> = c
        .contexts
        .lock()
        .unwrap()
        .values()
        .filter(|s| (s.id >> ID_BITS) as u32 != me && s.last_used.lock().unwrap().elapsed() >= idle)
        .map(|s| s.id)
        .collect();
    let mut reclaimed = 0;
    for id in candidates {
        let driver = (id >> ID_BITS) as u32;
        let alive = match agent.call::<u64, bool>(driver, H_ALIVE, &id) {
            Ok(alive) => alive,
            Err(RpcError::Shutdown) => return Err(()),
            Err(e) => {
                tracing::info!(context = id, driver, error = %e, "driver unreachable; reclaiming its context");
                false
            }
        };
        if !alive && c.remove(id).is_some() {
            reclaimed += 1;
        }
    }
    Ok(reclaimed)
}

/// Runs one reaper round now with the given idle threshold; returns how many contexts were
/// reclaimed (for tests and operators).
pub fn reap_now(agent: &Agent, idle: Duration) -> usize {
    reap(agent, idle).unwrap_or(0)
}
