//! Remote tensors: a tensor whose value lives on another worker, with operations recorded and
//! run there as one call.
//!
//! - [`Tensor::to`] / [`Tensor::to_remote`] place a tensor on `"worker/device"`;
//!   [`RemoteTensor::parameter`] makes a trainable [`Parameter`] there (the distributed
//!   optimizer updates it through [`RemoteTensor::param_rref`]).
//! - Operations on remote tensors of one owner are **recorded**, not run: shapes and dtypes are
//!   checked as each is recorded, so a mistake fails where it was written. The owner's open
//!   recording is **flushed** (sent as one call, `remote`, whose value the owner keeps) when a
//!   value is needed ([`to_here`](RemoteTensor::to_here), [`item`](RemoteTensor::item), a
//!   print), when an operation mixes owners, on [`sync`](RemoteTensor::sync), or when it holds
//!   [`FLUSH_OPS`] operations or [`FLUSH_BYTES`] of local inputs.
//! - A flush keeps only what is still referenced: the recorded tensors the program still holds
//!   become the call's outputs, stored on the owner; intermediates dropped unflushed are
//!   computed there and never stored, and a recording nobody references any more is never
//!   sent.
//! - **Caching.** A graph is identified by a hash of its operations. The first flush of a
//!   graph sends it whole; once the owner has run it, later flushes of the same graph send its
//!   hash only ([`stats`] counts both). An owner keeps at most [`CACHE_GRAPHS`] graphs per
//!   caller, forgets a caller's graphs when it is lost or leaves, and a caller never refers to
//!   a graph it has not seen the owner run.
//! - **Owners talk to each other directly.** An operation on worker A's tensor that reads a
//!   tensor stored on worker B makes A fetch it from B (owner to owner, never through the
//!   caller).
//! - **Autograd.** A flush inside a distributed autograd context is a recorded RPC: the local
//!   tensors it takes get a send node here and a recv node on the owner, the stored results keep
//!   their graph on the owner, and fetching a value (`to_here`) records the reply. A backward
//!   therefore crosses one send/recv pair per fused call, not per operation, and gradients of
//!   remote parameters accumulate in the context on their owner. Flush and fetch inside the
//!   context the values belong to.
//! - **Lifetime.** Stored values are RRef values (the owner keeps a call's outputs together
//!   until every remote tensor referring to one of them is dropped, anywhere); a lost owner fails
//!   every flush and fetch with an error naming it.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use serde::{Deserialize, Serialize};
use sluice_agent::{Agent, CallContext, Encode, HandlerError, Payload, RRef, Registry, RpcError, RpcFuture, Value};
use sluice_channel::Device;

use super::{
    caller_context, container, current_for, receive_reply, remote_error, send_side, serve_inputs, serve_reply,
    to_handler_error, with_current, CallHeader, Container, ContextState, ReplyHeader,
};
use crate::cpu::broadcast_shape;
use crate::dtype::DType;
use crate::error::{shape_err, Error, Result};
use crate::optim::Parameter;
use crate::tensor::{numel, Tensor};

const H_RUN: &str = "sluice.remote.run";
const H_PARAM: &str = "sluice.remote.param";
const H_FETCH: &str = "sluice.remote.fetch";
const H_GRAD: &str = "sluice.remote.grad";

/// An owner's open recording is flushed when it holds this many operations.
pub const FLUSH_OPS: usize = 1024;
/// ... or when the local tensors it will send reach this many bytes.
pub const FLUSH_BYTES: usize = 64 << 20;
/// Graphs an owner keeps per caller.
pub const CACHE_GRAPHS: usize = 4096;
/// The largest value `to_here` reads in the flush's own reply (one round trip instead of two).
/// A value read so stays referenced by its call's completion for as long as the flush's
/// results are referenced, so only small ones (losses, logits, statistics) go this way.
pub const FETCH_WITH_FLUSH_MAX: usize = 1 << 20;
/// The largest tensor an operation may be recorded to produce, in elements.
const MAX_ELEMENTS: usize = 1 << 40;

/// Elementwise functions of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
enum Unary {
    Neg,
    Exp,
    Log,
    Tanh,
    Sigmoid,
    Relu,
    Sin,
    Cos,
}

/// Functions of two tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    MatMul,
    MseLoss,
    /// Logits (N × C) against class indices (N, i64): the mean cross-entropy.
    CrossEntropy,
}

/// One recorded operation; operands are indices of earlier operations of the same graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Op {
    /// The call's input `k` (a local tensor sent with the call, or a stored value).
    Input(u32),
    Unary(Unary, u32),
    Binary(Binary, u32, u32),
    MulScalar(u32, f64),
    AddScalar(u32, f64),
    Transpose(u32, u32, u32),
    Reshape(u32, Vec<usize>),
    Sum(u32),
    Mean(u32),
    SumDim(u32, i64, bool),
    MeanDim(u32, i64, bool),
    Softmax(u32, i64),
    LogSoftmax(u32, i64),
    ToDevice(u32, Device),
    /// `x · wᵀ (+ b)`, as [`crate::ops::linear`] (gradients as contiguous as the weight).
    Linear(u32, u32, Option<u32>),
    /// Elements `start..start + len` along a dimension, as [`Tensor::narrow`].
    Narrow(u32, u32, u64, u64),
    /// Concatenation along a dimension, as [`crate::ops::cat`].
    Cat(Vec<u32>, u32),
    /// Rows of a weight picked by i64 indices, as [`crate::ops::embedding`].
    Embedding(u32, u32),
    /// Slices along a dimension picked by 1-d i64 indices, as [`Tensor::index_select`]:
    /// (tensor, indices, dimension).
    IndexSelect(u32, u32, u32),
    /// Elements along a dimension picked by an i64 index tensor, as [`Tensor::gather`]:
    /// (tensor, index, dimension).
    Gather(u32, u32, u32),
}

impl Op {
    /// The operand indices, to read or renumber.
    fn slots(&mut self) -> Vec<&mut u32> {
        match self {
            Op::Input(_) => vec![],
            Op::Binary(_, a, b) => vec![a, b],
            Op::Linear(x, w, b) => [x, w].into_iter().chain(b.as_mut()).collect(),
            Op::Cat(parts, _) => parts.iter_mut().collect(),
            Op::Embedding(w, i) => vec![w, i],
            Op::IndexSelect(a, i, _) | Op::Gather(a, i, _) => vec![a, i],
            Op::Unary(_, a)
            | Op::MulScalar(a, _)
            | Op::AddScalar(a, _)
            | Op::Transpose(a, _, _)
            | Op::Reshape(a, _)
            | Op::Sum(a)
            | Op::Mean(a)
            | Op::SumDim(a, _, _)
            | Op::MeanDim(a, _, _)
            | Op::Softmax(a, _)
            | Op::LogSoftmax(a, _)
            | Op::Narrow(a, ..)
            | Op::ToDevice(a, _) => vec![a],
        }
    }

    fn operands(&self) -> Vec<u32> {
        self.clone().slots().into_iter().map(|i| *i).collect()
    }

    fn remap(&mut self, map: &[u32]) {
        for i in self.slots() {
            *i = map[*i as usize];
        }
    }
}

/// What a flush asks the owner to run: the operations, and which results to keep.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Graph {
    ops: Vec<Op>,
    outputs: Vec<u32>,
}

impl Graph {
    /// A stable identity: the hash of its encoding.
    fn key(&self) -> u64 {
        let bytes = postcard::to_allocvec(self).expect("a graph encodes");
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        h.finish()
    }

    /// Runs the graph on the owner. Operands are checked, never trusted: the graph came from a
    /// peer. Each intermediate is dropped after its last use, so a chain of operations works in
    /// a few buffers the allocator reuses (hot in cache) instead of one fresh buffer per step.
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let n = self.ops.len();
        // The last operation reading each value (outputs: never dropped).
        let mut last = vec![0usize; n];
        for (j, op) in self.ops.iter().enumerate() {
            for i in op.operands() {
                if (i as usize) < j {
                    last[i as usize] = j;
                }
            }
        }
        for &o in &self.outputs {
            if let Some(l) = last.get_mut(o as usize) {
                *l = usize::MAX;
            }
        }
        let mut v: Vec<Option<Tensor>> = Vec::with_capacity(n);
        fn at(v: &[Option<Tensor>], i: u32) -> Result<&Tensor> {
            v.get(i as usize)
                .and_then(Option::as_ref)
                .ok_or_else(|| Error::Wire(format!("an operation reads value {i} before it exists")))
        }
        for (j, op) in self.ops.iter().enumerate() {
            let out = match op {
                Op::Input(k) => inputs
                    .get(*k as usize)
                    .cloned()
                    .ok_or_else(|| Error::Wire(format!("input {k} of {}", inputs.len())))?,
                Op::Unary(f, a) => {
                    let a = at(&v, *a)?;
                    match f {
                        Unary::Neg => a.neg(),
                        Unary::Exp => a.exp(),
                        Unary::Log => a.log(),
                        Unary::Tanh => a.tanh(),
                        Unary::Sigmoid => a.sigmoid(),
                        Unary::Relu => a.relu(),
                        Unary::Sin => a.sin(),
                        Unary::Cos => a.cos(),
                    }?
                }
                Op::Binary(f, a, b) => {
                    let (a, b) = (at(&v, *a)?, at(&v, *b)?);
                    match f {
                        Binary::Add => a.add(b),
                        Binary::Sub => a.sub(b),
                        Binary::Mul => a.mul(b),
                        Binary::Div => a.div(b),
                        Binary::MatMul => a.matmul(b),
                        Binary::MseLoss => crate::ops::mse_loss(a, b),
                        Binary::CrossEntropy => crate::ops::cross_entropy(a, b),
                    }?
                }
                Op::MulScalar(a, s) => at(&v, *a)?.mul_scalar(*s)?,
                Op::AddScalar(a, s) => at(&v, *a)?.add_scalar(*s)?,
                Op::Transpose(a, d0, d1) => at(&v, *a)?.transpose(*d0 as usize, *d1 as usize)?,
                Op::Reshape(a, shape) => {
                    checked_numel(shape)?;
                    at(&v, *a)?.reshape(shape)?
                }
                Op::Sum(a) => at(&v, *a)?.sum()?,
                Op::Mean(a) => at(&v, *a)?.mean()?,
                Op::SumDim(a, d, keep) => at(&v, *a)?.sum_dim(*d as isize, *keep)?,
                Op::MeanDim(a, d, keep) => at(&v, *a)?.mean_dim(*d as isize, *keep)?,
                Op::Softmax(a, d) => at(&v, *a)?.softmax(*d as isize)?,
                Op::LogSoftmax(a, d) => at(&v, *a)?.log_softmax(*d as isize)?,
                Op::ToDevice(a, d) => at(&v, *a)?.to_device(*d)?,
                Op::Linear(x, w, b) => {
                    let b = match b {
                        Some(b) => Some(at(&v, *b)?),
                        None => None,
                    };
                    crate::ops::linear(at(&v, *x)?, at(&v, *w)?, b)?
                }
                Op::Narrow(a, d, start, len) => {
                    let a = at(&v, *a)?;
                    let (start, len) = (usize::try_from(*start), usize::try_from(*len));
                    match (start, len) {
                        (Ok(start), Ok(len)) if start.checked_add(len).is_some() => {
                            a.narrow(*d as usize, start, len)?
                        }
                        _ => return Err(shape_err("narrow", "a range past the end of memory")),
                    }
                }
                Op::Cat(parts, d) => {
                    let parts = parts.iter().map(|&i| at(&v, i).cloned()).collect::<Result<Vec<_>>>()?;
                    if parts.is_empty() || parts.iter().any(|t| *d as usize >= t.dims()) {
                        return Err(shape_err("cat", format!("dimension {d} of {} tensors", parts.len())));
                    }
                    crate::ops::cat(&parts, *d as usize)?
                }
                Op::Embedding(w, i) => crate::ops::embedding(at(&v, *w)?, at(&v, *i)?)?,
                Op::IndexSelect(a, i, d) => at(&v, *a)?.index_select(*d as isize, at(&v, *i)?)?,
                Op::Gather(a, i, d) => at(&v, *a)?.gather(*d as isize, at(&v, *i)?)?,
            };
            for i in op.operands() {
                if last.get(i as usize) == Some(&j) {
                    v[i as usize] = None;
                }
            }
            v.push(Some(out));
        }
        self.outputs.iter().map(|&i| at(&v, i).cloned()).collect()
    }
}

/// How a flush names its graph.
#[derive(Serialize, Deserialize)]
enum GraphRef {
    /// The whole graph; `cache`: the owner keeps it under `key`.
    Full { key: u64, graph: Graph, cache: bool },
    /// A graph this caller sent before and the owner ran.
    Cached(u64),
}

/// One input of a flush, in the order of the graph's `Input` operations.
#[derive(Serialize, Deserialize)]
enum InputRef {
    /// The next of the local tensors sent with the call.
    Local,
    /// Output `k` of an earlier flush (on this owner or another: then fetched from there).
    Stored(RRef<Bundle>, u32),
    /// A parameter's current value.
    Param(RRef<Parameter>),
}

#[derive(Serialize, Deserialize)]
struct RunHeader {
    call: CallHeader,
    graph: GraphRef,
    inputs: Vec<InputRef>,
    /// Outputs whose values the owner also sends back in the reply to this call.
    fetch: Vec<u32>,
}

#[derive(Serialize, Deserialize)]
struct ParamHeader {
    call: CallHeader,
    name: String,
}

#[derive(Serialize, Deserialize)]
struct FetchHeader {
    context: Option<u64>,
    indices: Vec<u32>,
}

/// The outputs of one flush, kept on the owner as an RRef's value.
pub struct Bundle(Vec<Tensor>);

impl Encode for Bundle {
    /// Fetched as a whole (`RRef::to_here`): the tensors as a recorded reply outside any context.
    fn encode(&self) -> std::result::Result<Payload, RpcError> {
        let (mut payload, metas, value, message) =
            send_side(&self.0, None, 0, 0).map_err(|e| RpcError::Encode(e.to_string()))?;
        let tensors = payload.take_tensors();
        Ok(Payload::encode(&ReplyHeader {
            message,
            tensors: metas,
            value,
        })?
        .with_tensors(tensors))
    }
}

/// Process-wide counters of the remote-tensor layer (for tests and benchmarks).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Operations recorded on this worker.
    pub ops_recorded: u64,
    /// Flushes sent from this worker.
    pub flushes: u64,
    /// Of those, how many carried their whole graph, and how many named a cached one.
    pub graphs_sent: u64,
    pub graphs_by_reference: u64,
    /// Values fetched by this worker (to_here, item, a print, an owner reading another's).
    pub fetches: u64,
    /// Graphs run on this worker as an owner.
    pub graphs_run: u64,
    /// Bytes of local tensors this worker sent with its flushes.
    pub bytes_sent: u64,
    /// Bytes of tensors this worker fetched.
    pub bytes_fetched: u64,
}

#[derive(Default)]
struct Counters {
    ops_recorded: AtomicU64,
    flushes: AtomicU64,
    graphs_sent: AtomicU64,
    graphs_by_reference: AtomicU64,
    fetches: AtomicU64,
    graphs_run: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_fetched: AtomicU64,
}

fn counters() -> &'static Counters {
    static C: OnceLock<Counters> = OnceLock::new();
    C.get_or_init(Counters::default)
}

/// This process's counters.
pub fn stats() -> Stats {
    let c = counters();
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Stats {
        ops_recorded: l(&c.ops_recorded),
        flushes: l(&c.flushes),
        graphs_sent: l(&c.graphs_sent),
        graphs_by_reference: l(&c.graphs_by_reference),
        fetches: l(&c.fetches),
        graphs_run: l(&c.graphs_run),
        bytes_sent: l(&c.bytes_sent),
        bytes_fetched: l(&c.bytes_fetched),
    }
}

/// Where a value is kept.
#[derive(Clone)]
enum Stored {
    Output(RRef<Bundle>, u32),
    Param(RRef<Parameter>),
}

enum State {
    /// Recorded as operation `index` of its owner's open recording.
    Pending {
        index: u32,
    },
    Stored(Stored),
    /// The flush that was to make it could not be sent.
    Failed(String),
}

struct Node {
    agent: Agent,
    owner: sluice_agent::WorkerInfo,
    device: Device,
    shape: Vec<usize>,
    dtype: DType,
    requires_grad: bool,
    state: Mutex<State>,
}

enum Input {
    Local(Tensor),
    Stored(Stored),
}

/// An owner's open recording.
#[derive(Default)]
struct Recording {
    ops: Vec<Op>,
    inputs: Vec<Input>,
    /// Which operation reads a stored node already (one input per stored value).
    stored_inputs: HashMap<usize, u32>,
    local_bytes: usize,
    /// Every node recorded here, by operation.
    members: Vec<(u32, Weak<Node>)>,
}

/// What this worker knows of one owner.
#[derive(Default)]
struct OwnerState {
    open: Recording,
    /// Graphs the owner has run and keeps (by key).
    known: HashSet<u64>,
    /// Graphs sent whole for caching, with the flush that carries them.
    caching: Vec<(u64, RpcFuture)>,
}

fn recorder() -> &'static Mutex<HashMap<u32, OwnerState>> {
    static R: OnceLock<Mutex<HashMap<u32, OwnerState>>> = OnceLock::new();
    R.get_or_init(Mutex::default)
}

/// Graphs an owner keeps, by caller and key.
type GraphCache = HashMap<u32, HashMap<u64, Arc<Graph>>>;

/// The owner's side: graphs cached per caller.
fn graphs() -> &'static Mutex<GraphCache> {
    static G: OnceLock<Mutex<GraphCache>> = OnceLock::new();
    G.get_or_init(Mutex::default)
}

/// A caller is gone: its cached graphs go (and so does what this worker recorded for it as
/// an owner: nothing will run).
pub(crate) fn forget_caller(worker: u32) {
    graphs().lock().unwrap().remove(&worker);
    recorder().lock().unwrap().remove(&worker);
}

/// A tensor whose value lives on another worker (or this one's other device). Clones share
/// it. Operations record; see the [module docs](self).
#[derive(Clone)]
pub struct RemoteTensor {
    node: Arc<Node>,
}

impl std::fmt::Debug for RemoteTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RemoteTensor({}/{}, {:?}, {}{})",
            self.node.owner.name,
            self.node.device,
            self.node.shape,
            self.node.dtype,
            if self.node.requires_grad { ", requires_grad" } else { "" }
        )
    }
}

/// Printing a remote tensor fetches it (a flush point).
impl std::fmt::Display for RemoteTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.to_here() {
            Ok(t) => write!(f, "{t:?} (from {})", self.node.owner.name),
            Err(e) => write!(f, "{self:?}: {e}"),
        }
    }
}

fn remote_err(detail: impl Into<String>) -> Error {
    Error::Remote(detail.into())
}

/// `"worker/device"` → the worker and the device.
fn parse_placement(agent: &Agent, placement: &str) -> Result<(sluice_agent::WorkerInfo, Device)> {
    let (worker, device) = placement
        .split_once('/')
        .filter(|(w, d)| !w.is_empty() && !d.is_empty())
        .ok_or_else(|| {
            remote_err(format!(
                "placement {placement:?}: expected \"worker/device\", e.g. \"worker1/cpu\""
            ))
        })?;
    let device: Device = device
        .parse()
        .map_err(|e| remote_err(format!("placement {placement:?}: {e}")))?;
    let info = agent.worker(worker).map_err(Error::Rpc)?;
    Ok((info, device))
}

/// Elements of `shape`, or an error when they cannot be counted.
fn checked_numel(shape: &[usize]) -> Result<usize> {
    // Each dimension is bounded too: an empty tensor with a huge dimension would make loops
    // over its other dimensions (cat's, say) run for ever.
    shape
        .iter()
        .try_fold(1usize, |n, &d| if d > MAX_ELEMENTS { None } else { n.checked_mul(d) })
        .filter(|&n| n <= MAX_ELEMENTS)
        .ok_or_else(|| shape_err("reshape", format!("{shape:?} has too many elements")))
}

fn computable(op: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 => Ok(()),
        other => Err(Error::DType {
            op,
            dtype: other,
            hint: " (remote tensors compute in f32 or f64)",
        }),
    }
}

/// What index_select and gather need of the tensor they pick from, checked where they are
/// written: the CPU (their kernels are CPU-only), and f32 or f64 if it needs a gradient (the
/// gradient's kernel computes in those).
fn picks(op: &'static str, a: &Node) -> Result<()> {
    if a.device != Device::Cpu {
        return Err(remote_err(format!(
            "{op} runs on the CPU only; this tensor is on {}",
            a.device
        )));
    }
    if a.requires_grad {
        computable(op, a.dtype)?;
    }
    Ok(())
}

fn dim_of(op: &'static str, shape: &[usize], dim: i64) -> Result<usize> {
    let n = shape.len() as i64;
    let d = if dim < 0 { dim + n } else { dim };
    if d < 0 || d >= n.max(1) {
        return Err(shape_err(op, format!("dimension {dim} of a {n}-d tensor")));
    }
    Ok(d as usize)
}

/// The shape an operation produces from its operands' shapes (the rules of [`crate::ops`]),
/// checked when it is recorded.
fn infer(op: &Op, operands: &[&Node]) -> Result<Vec<usize>> {
    let a = operands[0];
    let b = operands.get(1).copied();
    let s = &a.shape;
    Ok(match op {
        Op::Input(_) | Op::ToDevice(..) => s.clone(),
        Op::Unary(..) | Op::MulScalar(..) | Op::AddScalar(..) => {
            computable("elementwise", a.dtype)?;
            s.clone()
        }
        Op::Binary(Binary::CrossEntropy, _, _) => {
            let t = b.expect("cross-entropy has targets");
            computable("cross_entropy", a.dtype)?;
            if s.len() != 2 || t.dtype != DType::I64 || t.shape != [s[0]] {
                return Err(shape_err(
                    "cross_entropy",
                    format!("logits {s:?} against {} targets {:?}", t.dtype, t.shape),
                ));
            }
            vec![]
        }
        Op::Binary(f, _, _) => {
            let b = b.expect("a binary operation has two operands");
            computable("binary", a.dtype)?;
            if a.dtype != b.dtype {
                return Err(shape_err(
                    "binary",
                    format!("dtypes {} and {} differ", a.dtype, b.dtype),
                ));
            }
            match f {
                Binary::MatMul => {
                    if s.len() != 2 || b.shape.len() != 2 || s[1] != b.shape[0] {
                        return Err(shape_err("matmul", format!("{:?} · {:?}", s, b.shape)));
                    }
                    vec![s[0], b.shape[1]]
                }
                Binary::MseLoss => {
                    broadcast_shape("mse_loss", s, &b.shape)?;
                    vec![]
                }
                _ => broadcast_shape("binary", s, &b.shape)?,
            }
        }
        Op::Transpose(_, d0, d1) => {
            let (d0, d1) = (*d0 as usize, *d1 as usize);
            if d0 >= s.len() || d1 >= s.len() {
                return Err(shape_err("transpose", format!("dimensions {d0}, {d1} of {s:?}")));
            }
            let mut out = s.clone();
            out.swap(d0, d1);
            out
        }
        Op::Reshape(_, shape) => {
            if checked_numel(shape)? != numel(s) {
                return Err(shape_err("reshape", format!("{s:?} into {shape:?}")));
            }
            shape.clone()
        }
        Op::Sum(_) | Op::Mean(_) => {
            computable("sum", a.dtype)?;
            vec![]
        }
        Op::SumDim(_, d, keep) | Op::MeanDim(_, d, keep) => {
            computable("sum_dim", a.dtype)?;
            let d = dim_of("sum_dim", s, *d)?;
            let mut out = s.clone();
            if *keep {
                out[d] = 1;
            } else {
                out.remove(d);
            }
            out
        }
        Op::Linear(..) => {
            let w = b.expect("linear has a weight");
            computable("linear", a.dtype)?;
            let bias_ok = operands
                .get(2)
                .is_none_or(|bias| bias.shape == [w.shape[0]] && bias.dtype == a.dtype);
            if s.len() != 2 || w.shape.len() != 2 || s[1] != w.shape[1] || a.dtype != w.dtype || !bias_ok {
                let bias = operands.get(2).map(|b| b.shape.clone());
                return Err(shape_err(
                    "linear",
                    format!("input {s:?}, weight {:?}, bias {bias:?}", w.shape),
                ));
            }
            vec![s[0], w.shape[0]]
        }
        Op::Narrow(_, d, start, len) => {
            let d = *d as usize;
            let end = start.checked_add(*len);
            if d >= s.len() || end.is_none_or(|e| e > s[d] as u64) {
                return Err(shape_err(
                    "narrow",
                    format!("{start} + {len} along dimension {d} of {s:?}"),
                ));
            }
            let mut out = s.clone();
            out[d] = *len as usize;
            out
        }
        Op::Cat(_, d) => {
            let d = *d as usize;
            let fits = |n: &Node| {
                n.dtype == a.dtype
                    && n.shape.len() == s.len()
                    && d < s.len()
                    && n.shape.iter().zip(s).enumerate().all(|(k, (x, y))| k == d || x == y)
            };
            if !operands.iter().all(|n| fits(n)) {
                let shapes: Vec<_> = operands.iter().map(|n| (n.dtype, n.shape.clone())).collect();
                return Err(shape_err("cat", format!("along dimension {d}: {shapes:?}")));
            }
            let mut out = s.clone();
            out[d] = operands
                .iter()
                .try_fold(0usize, |n, o| n.checked_add(o.shape[d]))
                .ok_or_else(|| shape_err("cat", format!("dimension {d} overflows")))?;
            out
        }
        Op::Embedding(..) => {
            let idx = b.expect("embedding has indices");
            computable("embedding", a.dtype)?;
            if s.len() != 2 || idx.dtype != DType::I64 {
                return Err(shape_err(
                    "embedding",
                    format!("weight {s:?} with {} indices {:?}", idx.dtype, idx.shape),
                ));
            }
            let mut out = idx.shape.clone();
            out.push(s[1]);
            out
        }
        Op::IndexSelect(_, _, d) => {
            picks("index_select", a)?;
            let idx = b.expect("index_select has indices");
            let d = *d as usize;
            if d >= s.len() || idx.dtype != DType::I64 || idx.shape.len() != 1 {
                return Err(shape_err(
                    "index_select",
                    format!("{} indices {:?} along dimension {d} of {s:?}", idx.dtype, idx.shape),
                ));
            }
            let mut out = s.clone();
            out[d] = idx.shape[0];
            out
        }
        Op::Gather(_, _, d) => {
            picks("gather", a)?;
            let idx = b.expect("gather has an index");
            let d = *d as usize;
            if idx.dtype != DType::I64 || !crate::ops::gather_fits(s, d, &idx.shape) {
                return Err(shape_err(
                    "gather",
                    format!("{} index {:?} along dimension {d} of {s:?}", idx.dtype, idx.shape),
                ));
            }
            idx.shape.clone()
        }
        Op::Softmax(_, d) | Op::LogSoftmax(_, d) => {
            computable("softmax", a.dtype)?;
            dim_of("softmax", s, *d)?;
            s.clone()
        }
    })
}

impl Tensor {
    /// This tensor placed on `placement` (`"worker1/cpu"`, `"worker1/cuda:0"`), through the
    /// agent [`attach`]ed to this process (or the one distributed autograd already uses). The
    /// value travels with the owner's next flush.
    pub fn to(&self, placement: &str) -> Result<RemoteTensor> {
        let agent = container()
            .agent
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| remote_err("no agent: call sluice_autograd::dist::remote::attach(&agent) first"))?;
        self.to_remote(&agent, placement)
    }

    /// [`to`](Self::to) through `agent`.
    pub fn to_remote(&self, agent: &Agent, placement: &str) -> Result<RemoteTensor> {
        container().bind(agent);
        let (owner, device) = parse_placement(agent, placement)?;
        let source = Arc::new(Node {
            agent: agent.clone(),
            owner,
            device: self.device(),
            shape: self.shape().to_vec(),
            dtype: self.dtype(),
            requires_grad: self.requires_grad(),
            state: Mutex::new(State::Failed(String::new())),
        });
        record_input(source, Input::Local(self.clone()), device)
    }
}

/// Makes `agent` the one [`Tensor::to`] uses.
pub fn attach(agent: &Agent) {
    container().bind(agent);
}

/// Records `input` as a new input of its owner's recording, moved to `device` there.
fn record_input(meta: Arc<Node>, input: Input, device: Device) -> Result<RemoteTensor> {
    let mut map = recorder().lock().unwrap();
    let owner = meta.owner.id;
    let state = map.entry(owner).or_default();
    let rec = &mut state.open;
    if let Input::Local(t) = &input {
        rec.local_bytes += t.numel() * t.dtype().size();
    }
    let k = rec.inputs.len() as u32;
    rec.inputs.push(input);
    rec.ops.push(Op::Input(k));
    let mut index = (rec.ops.len() - 1) as u32;
    if meta.device != device {
        rec.ops.push(Op::ToDevice(index, device));
        index += 1;
    }
    let node = Arc::new(Node {
        agent: meta.agent.clone(),
        owner: meta.owner.clone(),
        device,
        shape: meta.shape.clone(),
        dtype: meta.dtype,
        requires_grad: meta.requires_grad,
        state: Mutex::new(State::Pending { index }),
    });
    admit(&mut map, node)
}

/// Makes `node` (just recorded as an operation of its owner's open recording) a member of that
/// recording, and flushes it once it reaches the size bound.
fn admit(map: &mut HashMap<u32, OwnerState>, node: Arc<Node>) -> Result<RemoteTensor> {
    let owner = node.owner.id;
    let rec = &mut map.entry(owner).or_default().open;
    let State::Pending { index } = *node.state.lock().unwrap() else {
        unreachable!("a node is admitted as it is recorded")
    };
    rec.members.push((index, Arc::downgrade(&node)));
    counters().ops_recorded.fetch_add(1, Ordering::Relaxed);
    if rec.ops.len() >= FLUSH_OPS || rec.local_bytes >= FLUSH_BYTES {
        flush_locked(map, &node.agent, owner, None)?;
    }
    Ok(RemoteTensor { node })
}

/// The elementwise and binary operations, each recorded as one `Op`.
macro_rules! methods {
    ($($(#[$doc:meta])* $kind:ident $name:ident $op:ident),* $(,)?) => {
        $( methods!(@one $(#[$doc])* $kind $name $op); )*
    };
    (@one $(#[$doc:meta])* binary $name:ident $op:ident) => {
        $(#[$doc])*
        pub fn $name(&self, other: &RemoteTensor) -> Result<RemoteTensor> {
            self.binary(Binary::$op, other)
        }
    };
    (@one $(#[$doc:meta])* unary $name:ident $op:ident) => {
        $(#[$doc])*
        pub fn $name(&self) -> Result<RemoteTensor> {
            self.unary(Unary::$op)
        }
    };
}

impl RemoteTensor {
    /// A trainable parameter made on `placement` from `value` (copied there): a leaf whose
    /// gradients accumulate in the distributed autograd context on its owner. Pass
    /// [`param_rref`](Self::param_rref) to a [`crate::DistributedOptimizer`].
    pub fn parameter(agent: &Agent, placement: &str, name: &str, value: &Tensor) -> Result<RemoteTensor> {
        let me = container().bind(agent);
        let (owner, device) = parse_placement(agent, placement)?;
        let value = value.detach();
        let (mut payload, metas, bytes, _) = send_side(&vec![value.clone()], None, me, owner.id)?;
        let tensors = payload.take_tensors();
        let header = ParamHeader {
            call: CallHeader {
                context: None,
                message: Container::next_id(&container().next_message, me),
                tensors: metas,
                value: bytes,
            },
            name: format!("{name}@{device}"),
        };
        let payload = Payload::encode(&header)?.with_tensors(tensors);
        let rref: RRef<Parameter> = agent.remote(owner.id, H_PARAM, payload).map_err(remote_error)?;
        Ok(RemoteTensor {
            node: Arc::new(Node {
                agent: agent.clone(),
                owner,
                device,
                shape: value.shape().to_vec(),
                dtype: value.dtype(),
                requires_grad: true,
                state: Mutex::new(State::Stored(Stored::Param(rref))),
            }),
        })
    }

    /// The parameter behind a remote tensor made by [`parameter`](Self::parameter).
    pub fn param_rref(&self) -> Option<RRef<Parameter>> {
        match &*self.node.state.lock().unwrap() {
            State::Stored(Stored::Param(r)) => Some(r.clone()),
            _ => None,
        }
    }

    /// A remote tensor over a parameter another API put in an RRef (its owner's device: CPU
    /// unless `device` says otherwise).
    pub fn from_param(
        agent: &Agent,
        rref: RRef<Parameter>,
        shape: &[usize],
        dtype: DType,
        device: Device,
    ) -> RemoteTensor {
        container().bind(agent);
        RemoteTensor {
            node: Arc::new(Node {
                agent: agent.clone(),
                owner: rref.owner().clone(),
                device,
                shape: shape.to_vec(),
                dtype,
                requires_grad: true,
                state: Mutex::new(State::Stored(Stored::Param(rref))),
            }),
        }
    }

    pub fn owner(&self) -> &sluice_agent::WorkerInfo {
        &self.node.owner
    }

    pub fn device(&self) -> Device {
        self.node.device
    }

    pub fn shape(&self) -> &[usize] {
        &self.node.shape
    }

    pub fn dtype(&self) -> DType {
        self.node.dtype
    }

    pub fn numel(&self) -> usize {
        numel(&self.node.shape)
    }

    /// Whether gradients flow to it (a parameter, or computed from something that needs grad).
    pub fn requires_grad(&self) -> bool {
        self.node.requires_grad
    }

    /// Whether it is still only recorded (no flush has carried it yet).
    pub fn is_pending(&self) -> bool {
        matches!(*self.node.state.lock().unwrap(), State::Pending { .. })
    }

    /// Records the operation `make` builds from its operands' indices, over `self` and
    /// `others`, on `self`'s owner.
    fn record(&self, others: &[&RemoteTensor], make: impl Fn(&[u32]) -> Op) -> Result<RemoteTensor> {
        let a = &self.node;
        let nodes: Vec<&Node> = std::iter::once(&**a).chain(others.iter().map(|o| &*o.node)).collect();
        // Shapes first, with placeholders: the operands' indices are not known yet.
        let probe = make(&vec![0; nodes.len()]);
        let shape = infer(&probe, &nodes)?;
        if numel(&shape) > MAX_ELEMENTS {
            return Err(remote_err(format!(
                "{probe:?} would make a tensor of shape {shape:?}: too large"
            )));
        }
        for o in others {
            if o.node.owner.id == a.owner.id && o.node.device != a.device {
                return Err(remote_err(format!(
                    "operands on {}/{} and {}/{}: move one with to() first",
                    a.owner.name, a.device, o.node.owner.name, o.node.device
                )));
            }
        }
        let mut map = recorder().lock().unwrap();
        let owner = a.owner.id;
        let mut indices = vec![operand(&mut map, &self.node, owner, a.device)?];
        for o in others {
            indices.push(operand(&mut map, &o.node, owner, a.device)?);
        }
        let rec = &mut map.entry(owner).or_default().open;
        rec.ops.push(make(&indices));
        let index = (rec.ops.len() - 1) as u32;
        let node = Arc::new(Node {
            agent: a.agent.clone(),
            owner: a.owner.clone(),
            device: a.device,
            shape,
            dtype: a.dtype,
            requires_grad: nodes.iter().any(|n| n.requires_grad),
            state: Mutex::new(State::Pending { index }),
        });
        admit(&mut map, node)
    }

    fn unary(&self, f: Unary) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::Unary(f, i[0]))
    }

    fn binary(&self, f: Binary, other: &RemoteTensor) -> Result<RemoteTensor> {
        self.record(&[other], |i| Op::Binary(f, i[0], i[1]))
    }

    methods! {
        binary add Add, binary sub Sub, binary mul Mul, binary div Div,
        /// Matrix product of 2-D tensors.
        binary matmul MatMul,
        /// Mean squared error against the other tensor (a 0-d tensor).
        binary mse_loss MseLoss,
        /// Mean cross-entropy of these logits (N × C) against class indices (N, i64).
        binary cross_entropy CrossEntropy,
        unary neg Neg, unary exp Exp, unary log Log, unary tanh Tanh,
        unary sigmoid Sigmoid, unary relu Relu, unary sin Sin, unary cos Cos,
    }

    pub fn mul_scalar(&self, s: f64) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::MulScalar(i[0], s))
    }
    pub fn add_scalar(&self, s: f64) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::AddScalar(i[0], s))
    }
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<RemoteTensor> {
        let (d0, d1) = (
            u32::try_from(d0).unwrap_or(u32::MAX),
            u32::try_from(d1).unwrap_or(u32::MAX),
        );
        self.record(&[], |i| Op::Transpose(i[0], d0, d1))
    }
    /// Transpose of a 2-D tensor.
    pub fn t(&self) -> Result<RemoteTensor> {
        if self.node.shape.len() != 2 {
            return Err(shape_err("t", format!("{:?} is not 2-d", self.node.shape)));
        }
        self.transpose(0, 1)
    }
    pub fn reshape(&self, shape: &[usize]) -> Result<RemoteTensor> {
        let shape = shape.to_vec();
        self.record(&[], move |i| Op::Reshape(i[0], shape.clone()))
    }
    pub fn sum(&self) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::Sum(i[0]))
    }
    pub fn mean(&self) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::Mean(i[0]))
    }
    pub fn sum_dim(&self, dim: isize, keepdim: bool) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::SumDim(i[0], dim as i64, keepdim))
    }
    pub fn mean_dim(&self, dim: isize, keepdim: bool) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::MeanDim(i[0], dim as i64, keepdim))
    }
    pub fn softmax(&self, dim: isize) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::Softmax(i[0], dim as i64))
    }
    pub fn log_softmax(&self, dim: isize) -> Result<RemoteTensor> {
        self.record(&[], |i| Op::LogSoftmax(i[0], dim as i64))
    }

    /// Elements `start..start + len` along `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<RemoteTensor> {
        let dim = u32::try_from(dim).unwrap_or(u32::MAX);
        self.record(&[], |i| Op::Narrow(i[0], dim, start as u64, len as u64))
    }

    /// Concatenation along `dim` of tensors of one owner and device (recorded there; a tensor
    /// of another owner is moved there first, owner to owner).
    pub fn cat(tensors: &[&RemoteTensor], dim: usize) -> Result<RemoteTensor> {
        let (first, rest) = tensors.split_first().ok_or_else(|| shape_err("cat", "no tensors"))?;
        let dim = u32::try_from(dim).unwrap_or(u32::MAX);
        first.record(rest, |i| Op::Cat(i.to_vec(), dim))
    }

    /// Rows of this weight (`[vocab, dim]`) picked by `indices` (i64, any shape):
    /// `[indices…, dim]`. Indices are checked against the vocabulary when the owner runs it.
    pub fn embedding(&self, indices: &RemoteTensor) -> Result<RemoteTensor> {
        self.record(&[indices], |i| Op::Embedding(i[0], i[1]))
    }

    /// The slices `indices` (1-d, i64) along `dim`, as [`Tensor::index_select`]. Indices are
    /// checked against the dimension's length when the owner runs it.
    pub fn index_select(&self, dim: isize, indices: &RemoteTensor) -> Result<RemoteTensor> {
        let dim = dim_of("index_select", self.shape(), dim as i64)? as u32;
        self.record(&[indices], |i| Op::IndexSelect(i[0], i[1], dim))
    }

    /// Elements picked along `dim` by `index` (i64, this tensor's number of dimensions), as
    /// [`Tensor::gather`]: `index`'s shape. Values are checked when the owner runs it.
    pub fn gather(&self, dim: isize, index: &RemoteTensor) -> Result<RemoteTensor> {
        let dim = dim_of("gather", self.shape(), dim as i64)? as u32;
        self.record(&[index], |i| Op::Gather(i[0], i[1], dim))
    }

    /// `x · wᵀ + b` with `x` this tensor.
    pub fn linear(&self, w: &RemoteTensor, b: Option<&RemoteTensor>) -> Result<RemoteTensor> {
        match b {
            Some(b) => self.record(&[w, b], |i| Op::Linear(i[0], i[1], Some(i[2]))),
            None => self.record(&[w], |i| Op::Linear(i[0], i[1], None)),
        }
    }

    /// This value placed on another worker or device (`"worker2/cpu"`): recorded there, the
    /// bytes moving owner to owner at that owner's next flush.
    pub fn to(&self, placement: &str) -> Result<RemoteTensor> {
        let (owner, device) = parse_placement(&self.node.agent, placement)?;
        if owner.id == self.node.owner.id {
            return self.record(&[], |i| Op::ToDevice(i[0], device));
        }
        let stored = self.stored()?;
        let meta = Arc::new(Node {
            agent: self.node.agent.clone(),
            owner,
            device: Device::Cpu,
            shape: self.node.shape.clone(),
            dtype: self.node.dtype,
            requires_grad: self.node.requires_grad,
            state: Mutex::new(State::Failed(String::new())),
        });
        record_input(meta, Input::Stored(stored), device)
    }

    /// Flushes the owner's recording if this tensor is in it, and waits until the owner holds
    /// the value (errors of the flush surface here).
    pub fn sync(&self) -> Result<()> {
        match self.stored()? {
            Stored::Output(r, _) => r.created().wait().map(drop).map_err(remote_error),
            Stored::Param(r) => r.created().wait().map(drop).map_err(remote_error),
        }
    }

    /// The value, here (a flush point). Inside a distributed autograd context the fetch is
    /// recorded: gradients of a loss computed from it reach the owner's graph.
    ///
    /// A small value still only recorded is read in the reply of the flush that computes it
    /// (one round trip; see [`FETCH_WITH_FLUSH_MAX`]).
    pub fn to_here(&self) -> Result<Tensor> {
        let small = self.numel().saturating_mul(self.dtype().size()) <= FETCH_WITH_FLUSH_MAX;
        let flushed = if small { self.flush_if_pending(true)? } else { None };
        let mut values = match flushed {
            Some(rref) => {
                let (agent, owner) = (&self.node.agent, self.node.owner.id);
                let payload = rref.created().wait().map_err(remote_error)?;
                receive_values(payload, current_for(agent, owner)?.as_ref(), owner)?
            }
            None => fetch(&self.node.agent, &self.stored()?)?,
        };
        values.pop().ok_or_else(|| remote_err("the owner sent no value"))
    }

    fn is_recorded(&self) -> bool {
        matches!(*self.node.state.lock().unwrap(), State::Pending { .. })
    }

    /// Sends the owner's recording if this tensor is still only recorded in it; with `fetch`,
    /// asking for its value in the reply (then the call's reference is returned to read it).
    fn flush_if_pending(&self, fetch: bool) -> Result<Option<RRef<Bundle>>> {
        if !self.is_recorded() {
            return Ok(None);
        }
        let mut map = recorder().lock().unwrap();
        if !self.is_recorded() {
            return Ok(None);
        }
        let node = fetch.then_some(&self.node);
        flush_locked(&mut map, &self.node.agent, self.node.owner.id, node)
    }

    /// The gradient a remote parameter accumulated in distributed autograd context
    /// `context` on its owner, read from there (`None` when the backwards run in that context
    /// reached no use of it, or the context is unknown to the owner). One call; not recorded.
    /// Only a parameter has one: any other remote tensor is an error, as its gradient is
    /// never kept.
    pub fn gradient(&self, context: u64) -> Result<Option<Tensor>> {
        let Some(rref) = self.param_rref() else {
            return Err(remote_err(
                "only a parameter (RemoteTensor::parameter) keeps a gradient on its owner",
            ));
        };
        let payload = Payload::encode(&context)?;
        let reply = rref
            .rpc_async_raw(H_GRAD, payload, rref.default_timeout()?)
            .wait()
            .map_err(remote_error)?;
        let mut values = receive_values(reply, None, self.node.owner.id)?;
        match values.len() {
            0 => Ok(None),
            1 => Ok(values.pop()),
            n => Err(remote_err(format!("the owner sent {n} gradients for one parameter"))),
        }
    }

    /// The single value of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        self.to_here()?.item()
    }

    /// Where the value is kept, flushing the owner's recording first if it is only recorded.
    fn stored(&self) -> Result<Stored> {
        self.flush_if_pending(false)?;
        match &*self.node.state.lock().unwrap() {
            State::Stored(s) => Ok(s.clone()),
            State::Failed(e) => Err(remote_err(e.clone())),
            State::Pending { .. } => Err(remote_err("a flush left a recorded tensor unstored")),
        }
    }
}

/// Flushes every owner's open recording (what this worker recorded is sent).
pub fn flush_all(agent: &Agent) -> Result<()> {
    let mut map = recorder().lock().unwrap();
    let owners: Vec<u32> = map.keys().copied().collect();
    let mut first = None;
    for owner in owners {
        if let Err(e) = flush_locked(&mut map, agent, owner, None) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// The index, in `owner`'s open recording, of `node`'s value: its own operation when it is
/// recorded there; otherwise (stored, or recorded for another owner, which is flushed first)
/// an input reading where it is kept, moved to `device`.
fn operand(map: &mut HashMap<u32, OwnerState>, node: &Arc<Node>, owner: u32, device: Device) -> Result<u32> {
    if node.owner.id != owner && matches!(*node.state.lock().unwrap(), State::Pending { .. }) {
        flush_locked(map, &node.agent, node.owner.id, None)?;
    }
    let stored = match &*node.state.lock().unwrap() {
        State::Pending { index } => return Ok(*index),
        State::Stored(s) => s.clone(),
        State::Failed(e) => return Err(remote_err(e.clone())),
    };
    let rec = &mut map.entry(owner).or_default().open;
    let key = Arc::as_ptr(node) as usize;
    if let Some(&i) = rec.stored_inputs.get(&key) {
        return Ok(i);
    }
    let k = rec.inputs.len() as u32;
    rec.inputs.push(Input::Stored(stored));
    rec.ops.push(Op::Input(k));
    let mut index = (rec.ops.len() - 1) as u32;
    // A value fetched from another owner arrives on its CPU.
    let arrives = if node.owner.id == owner {
        node.device
    } else {
        Device::Cpu
    };
    if arrives != device {
        rec.ops.push(Op::ToDevice(index, device));
        index += 1;
    }
    rec.stored_inputs.insert(key, index);
    Ok(index)
}

/// Sends `owner`'s open recording as one call (nothing when no recorded tensor is still
/// referenced). With `fetch`, a recorded tensor of it, the owner also sends that tensor's value
/// back in the call's reply, and the call's reference is returned to read it from. Called with
/// the recorder locked.
fn flush_locked(
    map: &mut HashMap<u32, OwnerState>,
    agent: &Agent,
    owner: u32,
    fetch: Option<&Arc<Node>>,
) -> Result<Option<RRef<Bundle>>> {
    let Some(state) = map.get_mut(&owner) else {
        return Ok(None);
    };
    let rec = std::mem::take(&mut state.open);
    let live: Vec<(u32, Arc<Node>)> = rec
        .members
        .iter()
        .filter_map(|(i, w)| w.upgrade().map(|n| (*i, n)))
        .filter(|(_, n)| matches!(*n.state.lock().unwrap(), State::Pending { .. }))
        .collect();
    if live.is_empty() {
        return Ok(None);
    }
    let fetch: Vec<u32> = fetch
        .and_then(|f| live.iter().position(|(_, n)| Arc::ptr_eq(n, f)))
        .map(|k| k as u32)
        .into_iter()
        .collect();
    // Keep only the operations the live tensors need; renumber them and the inputs.
    let mut needed = vec![false; rec.ops.len()];
    for (i, _) in &live {
        needed[*i as usize] = true;
    }
    for i in (0..rec.ops.len()).rev() {
        if needed[i] {
            for o in rec.ops[i].operands() {
                needed[o as usize] = true;
            }
        }
    }
    let mut map_ops = vec![u32::MAX; rec.ops.len()];
    let mut ops = Vec::new();
    let mut inputs = Vec::new();
    let mut rec_inputs: Vec<Option<Input>> = rec.inputs.into_iter().map(Some).collect();
    for (i, op) in rec.ops.into_iter().enumerate() {
        if !needed[i] {
            continue;
        }
        let mut op = op;
        if let Op::Input(k) = op {
            let input = rec_inputs[k as usize]
                .take()
                .expect("each input is read by one operation");
            op = Op::Input(inputs.len() as u32);
            inputs.push(input);
        } else {
            op.remap(&map_ops);
        }
        map_ops[i] = ops.len() as u32;
        ops.push(op);
    }
    let graph = Graph {
        ops,
        outputs: live.iter().map(|(i, _)| map_ops[*i as usize]).collect(),
    };
    // Graphs whose caching flush has completed are known to the owner.
    let mut done = Vec::new();
    state.caching.retain(|(key, f)| match f.try_get() {
        Some(Ok(_)) => {
            done.push(*key);
            false
        }
        Some(Err(_)) => false,
        None => true,
    });
    state.known.extend(done);
    let key = graph.key();
    let graph_ref = if state.known.contains(&key) {
        GraphRef::Cached(key)
    } else {
        let cache =
            state.known.len() + state.caching.len() < CACHE_GRAPHS && !state.caching.iter().any(|(k, _)| *k == key);
        GraphRef::Full { key, graph, cache }
    };
    let fetching = !fetch.is_empty();
    let sent = send_run(agent, owner, graph_ref, inputs, fetch);
    let c = counters();
    c.flushes.fetch_add(1, Ordering::Relaxed);
    match sent {
        Ok((rref, cached)) => {
            match cached {
                Some(true) => {
                    c.graphs_sent.fetch_add(1, Ordering::Relaxed);
                    state.caching.push((key, rref.created()));
                }
                Some(false) => {
                    c.graphs_sent.fetch_add(1, Ordering::Relaxed);
                }
                None => {
                    c.graphs_by_reference.fetch_add(1, Ordering::Relaxed);
                }
            }
            for (k, (_, n)) in live.iter().enumerate() {
                *n.state.lock().unwrap() = State::Stored(Stored::Output(rref.clone(), k as u32));
            }
            Ok(fetching.then_some(rref))
        }
        Err(e) => {
            let detail = format!("flushing the operations recorded for worker {owner}: {e}");
            for (_, n) in &live {
                *n.state.lock().unwrap() = State::Failed(detail.clone());
            }
            Err(remote_err(detail))
        }
    }
}

/// Issues one flush: `remote` on the owner, whose value is the graph's outputs. Returns the
/// reference and whether the graph went whole (and was to be cached).
fn send_run(
    agent: &Agent,
    owner: u32,
    graph: GraphRef,
    inputs: Vec<Input>,
    fetch: Vec<u32>,
) -> Result<(RRef<Bundle>, Option<bool>)> {
    let ctx = current_for(agent, owner)?;
    let me = container().bind(agent);
    let mut locals = Vec::new();
    let refs: Vec<InputRef> = inputs
        .into_iter()
        .map(|i| match i {
            Input::Local(t) => {
                locals.push(t);
                InputRef::Local
            }
            Input::Stored(Stored::Output(r, k)) => InputRef::Stored(r, k),
            Input::Stored(Stored::Param(r)) => InputRef::Param(r),
        })
        .collect();
    let bytes: usize = locals.iter().map(|t| t.numel() * t.dtype().size()).sum();
    counters().bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    let (mut payload, metas, value, message) = send_side(&locals, ctx.as_ref(), me, owner)?;
    let tensors = payload.take_tensors();
    let cached = match &graph {
        GraphRef::Full { cache, .. } => Some(*cache),
        GraphRef::Cached(_) => None,
    };
    let header = RunHeader {
        call: CallHeader {
            context: ctx.as_ref().map(|c| c.id),
            message: message.unwrap_or_else(|| Container::next_id(&container().next_message, me)),
            tensors: metas,
            value,
        },
        graph,
        inputs: refs,
        fetch,
    };
    let payload = Payload::encode(&header)?.with_tensors(tensors);
    let rref = agent.remote::<Bundle>(owner, H_RUN, payload).map_err(remote_error)?;
    Ok((rref, cached))
}

/// Fetches stored values (recorded inside this thread's context, if any).
fn fetch(agent: &Agent, stored: &Stored) -> Result<Vec<Tensor>> {
    counters().fetches.fetch_add(1, Ordering::Relaxed);
    let (owner, index) = match stored {
        Stored::Output(r, k) => (r.owner().id, *k),
        Stored::Param(r) => (r.owner().id, 0),
    };
    let ctx = current_for(agent, owner)?;
    let payload = Payload::encode(&FetchHeader {
        context: ctx.as_ref().map(|c| c.id),
        indices: vec![index],
    })?;
    let fut = match stored {
        Stored::Output(r, _) => r.rpc_async_raw(H_FETCH, payload, r.default_timeout()?),
        Stored::Param(r) => r.rpc_async_raw(H_FETCH, payload, r.default_timeout()?),
    };
    receive_values(fut.wait().map_err(remote_error)?, ctx.as_ref(), owner)
}

/// Values read back from `owner` (a fetch's reply, or a flush's), recorded in `ctx` and counted.
fn receive_values(payload: Payload, ctx: Option<&Arc<ContextState>>, owner: u32) -> Result<Vec<Tensor>> {
    let values: Vec<Tensor> = receive_reply(payload, ctx, owner)?;
    let bytes: usize = values.iter().map(|t| t.numel() * t.dtype().size()).sum();
    counters().bytes_fetched.fetch_add(bytes as u64, Ordering::Relaxed);
    Ok(values)
}

/// A stored value as the owner running a graph reads it: its own (no copy), or fetched from
/// the worker that keeps it.
fn resolve(agent: &Agent, stored: Stored) -> Result<Tensor> {
    match &stored {
        Stored::Output(r, k) if r.is_owner() => {
            let value = r.local().map_err(remote_error)?;
            let bundle = value
                .object_ref::<Bundle>()
                .ok_or_else(|| Error::Wire("a stored input is not a remote tensor's value".into()))?;
            bundle
                .0
                .get(*k as usize)
                .cloned()
                .ok_or_else(|| Error::Wire(format!("output {k} of a call that kept {}", bundle.0.len())))
        }
        Stored::Param(r) if r.is_owner() => Ok(r.local_value().map_err(remote_error)?.tensor()),
        _ => fetch(agent, &stored)?
            .pop()
            .ok_or_else(|| remote_err("the owner sent no value")),
    }
}

fn cached_graph(caller: u32, graph: GraphRef) -> std::result::Result<Arc<Graph>, HandlerError> {
    match graph {
        GraphRef::Full { key, graph, cache } => {
            let graph = Arc::new(graph);
            if cache {
                let mut all = graphs().lock().unwrap();
                let mine = all.entry(caller).or_default();
                if mine.len() >= CACHE_GRAPHS && !mine.contains_key(&key) {
                    return Err(HandlerError::new(
                        "RemoteTensorError",
                        format!("worker {caller} asked to cache more than {CACHE_GRAPHS} graphs"),
                    ));
                }
                mine.insert(key, graph.clone());
            }
            Ok(graph)
        }
        GraphRef::Cached(key) => graphs()
            .lock()
            .unwrap()
            .get(&caller)
            .and_then(|m| m.get(&key).cloned())
            .ok_or_else(|| {
                HandlerError::new(
                    "RemoteTensorError",
                    format!("worker {caller} named graph {key:#x}, which this worker does not keep"),
                )
            }),
    }
}

/// Registers the owner's side (part of [`super::install`]).
pub(crate) fn install(registry: &mut Registry) {
    registry.value_handler(H_RUN, |cx: &CallContext, mut payload: Payload| {
        let header: RunHeader = payload
            .decode()
            .map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
        let buffers = payload.take_tensors();
        let (ctx, locals) = serve_inputs(cx, &header.call, buffers)?;
        let me = container().bind(&cx.agent);
        let graph = cached_graph(cx.caller.id, header.graph)?;
        counters().graphs_run.fetch_add(1, Ordering::Relaxed);
        let outputs = with_current(header.call.context, || -> Result<Vec<Tensor>> {
            let mut locals = locals.into_iter();
            let mut inputs = Vec::with_capacity(header.inputs.len());
            for i in header.inputs {
                inputs.push(match i {
                    InputRef::Local => locals
                        .next()
                        .ok_or_else(|| Error::Wire("more local inputs named than sent".into()))?,
                    InputRef::Stored(r, k) => resolve(&cx.agent, Stored::Output(r, k))?,
                    InputRef::Param(r) => resolve(&cx.agent, Stored::Param(r))?,
                });
            }
            graph.run(&inputs)
        })
        .map_err(|e| to_handler_error(me, e))?;
        if header.fetch.is_empty() {
            return Ok(Value::encodable(Bundle(outputs)));
        }
        let fetched = header
            .fetch
            .iter()
            .map(|&k| {
                outputs.get(k as usize).cloned().ok_or_else(|| {
                    HandlerError::new(
                        "IndexError",
                        format!("output {k} of a call that keeps {}", outputs.len()),
                    )
                })
            })
            .collect::<std::result::Result<Vec<Tensor>, _>>()?;
        let reply = serve_reply(cx, &receivable(cx, fetched)?, ctx.as_ref())?;
        Ok(Value::kept_with_reply(Value::encodable(Bundle(outputs)), reply))
    });
    registry.value_handler(H_PARAM, |cx: &CallContext, mut payload: Payload| {
        let header: ParamHeader = payload
            .decode()
            .map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
        let buffers = payload.take_tensors();
        let (_, mut values) = serve_inputs(cx, &header.call, buffers)?;
        let value = values
            .pop()
            .filter(|_| values.is_empty())
            .ok_or_else(|| HandlerError::new("DecodeError", "a parameter is one tensor"))?;
        let device = header
            .name
            .rsplit_once('@')
            .and_then(|(_, d)| d.parse::<Device>().ok())
            .unwrap_or(Device::Cpu);
        let me = container().bind(&cx.agent);
        let value = value.to_device(device).map_err(|e| to_handler_error(me, e))?;
        let name = header.name.rsplit_once('@').map_or(header.name.as_str(), |(n, _)| n);
        Ok(Value::object(Parameter::new(name, value)))
    });
    registry.value_method(H_GRAD, |cx: &CallContext, value: &Value, payload: Payload| {
        let context: u64 = payload
            .decode()
            .map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
        let Some(p) = value.object_ref::<Parameter>() else {
            return Err(HandlerError::new("TypeError", "not a remote parameter"));
        };
        // A context the owner never saw (or already released) holds no gradient of it.
        let grad = super::get_gradients(context).ok().and_then(|g| g.get(&p.id()).cloned());
        serve_reply(cx, &receivable(cx, grad.into_iter().collect())?, None).map(Value::Payload)
    });
    registry.value_method(H_FETCH, |cx: &CallContext, value: &Value, payload: Payload| {
        let header: FetchHeader = payload
            .decode()
            .map_err(|e| HandlerError::new("DecodeError", e.to_string()))?;
        let tensors: Vec<Tensor> = if let Some(b) = value.object_ref::<Bundle>() {
            header
                .indices
                .iter()
                .map(|&k| {
                    b.0.get(k as usize).cloned().ok_or_else(|| {
                        HandlerError::new("IndexError", format!("output {k} of a call that kept {}", b.0.len()))
                    })
                })
                .collect::<std::result::Result<_, _>>()?
        } else if let Some(p) = value.object_ref::<Parameter>() {
            vec![p.tensor()]
        } else {
            return Err(HandlerError::new("TypeError", "not a remote tensor's value"));
        };
        let ctx = caller_context(cx, header.context)?;
        serve_reply(cx, &receivable(cx, tensors)?, ctx.as_ref()).map(Value::Payload)
    });
}

/// `tensors` as the caller can receive them: one on a device the caller's device map does not
/// cover (a value on this worker's GPU, fetched by a worker that set no map) goes to the CPU
/// first, recorded, so its gradient comes back to the GPU the same way.
fn receivable(cx: &CallContext, tensors: Vec<Tensor>) -> std::result::Result<Vec<Tensor>, HandlerError> {
    tensors
        .into_iter()
        .map(|t| {
            let device = t.device();
            if device == Device::Cpu || cx.agent.reply_device(cx.caller.id, device).is_some() {
                return Ok(t);
            }
            t.to_device(Device::Cpu).map_err(|e| {
                HandlerError::new(
                    "CudaError",
                    format!("{device} to the CPU for worker {}: {e}", cx.caller.name),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph() -> Graph {
        Graph {
            ops: vec![
                Op::Input(0),
                Op::Unary(Unary::Tanh, 0),
                Op::MulScalar(1, 2.0),
                Op::Input(1),
                Op::Binary(Binary::MatMul, 2, 3),
            ],
            outputs: vec![4, 1],
        }
    }

    #[test]
    fn a_graph_runs_like_the_ops_it_records() {
        let x = Tensor::randn(&[3, 4], 1.0, 1, DType::F64).unwrap();
        let w = Tensor::randn(&[4, 2], 1.0, 2, DType::F64).unwrap();
        let out = graph().run(&[x.clone(), w.clone()]).unwrap();
        let y = x.tanh().unwrap().mul_scalar(2.0).unwrap().matmul(&w).unwrap();
        assert_eq!(out[0].to_f64_vec().unwrap(), y.to_f64_vec().unwrap());
        assert_eq!(out[1].to_f64_vec().unwrap(), x.tanh().unwrap().to_f64_vec().unwrap());
    }

    #[test]
    fn a_malformed_graph_is_an_error_not_a_panic() {
        let x = Tensor::ones(&[2], DType::F64).unwrap();
        for ops in [
            vec![Op::Unary(Unary::Exp, 0)],
            vec![Op::Input(3)],
            vec![Op::Input(0), Op::Binary(Binary::Add, 0, 7)],
            vec![Op::Input(0), Op::Reshape(0, vec![usize::MAX, 2])],
            vec![Op::Input(0), Op::Reshape(0, vec![0, 1 << 62])],
            vec![Op::Input(0), Op::Transpose(0, 9, 0)],
            vec![Op::Input(0), Op::SumDim(0, i64::MIN, false)],
            vec![Op::Input(0), Op::Narrow(0, 0, u64::MAX, 2)],
            vec![Op::Input(0), Op::Narrow(0, 5, 0, 1)],
            vec![Op::Input(0), Op::Cat(vec![], 0)],
            vec![Op::Input(0), Op::Cat(vec![0, 0], 3)],
            vec![Op::Input(0), Op::Embedding(0, 0)],
            vec![Op::Input(0), Op::Gather(0, 0, 0)],
            vec![Op::Input(0), Op::IndexSelect(0, 0, u32::MAX)],
            vec![Op::Input(0), Op::Gather(0, 7, 0)],
        ] {
            let g = Graph { ops, outputs: vec![0] };
            assert!(g.run(std::slice::from_ref(&x)).is_err(), "{g:?}");
        }
        let g = Graph {
            ops: vec![Op::Input(0)],
            outputs: vec![5],
        };
        assert!(g.run(&[x]).is_err());
    }

    #[test]
    fn keys_tell_graphs_apart() {
        let a = graph();
        let mut b = graph();
        assert_eq!(a.key(), b.key());
        b.ops[2] = Op::MulScalar(1, 3.0);
        assert_ne!(a.key(), b.key());
    }
}
