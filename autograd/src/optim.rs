//! Parameters, optimizers and the distributed optimizer.
//!
//! A [`Parameter`] is a named leaf whose *data* is replaced by each optimizer step while its
//! gradient identity ([`LeafId`]) stays, so the gradients of any context find it. Reading a
//! parameter (`tensor()`) takes a snapshot: an optimizer step never changes a tensor someone
//! holds.
//!
//! Two update modes, for several trainers sharing one parameter server:
//! - [`UpdateMode::Locked`]: a step holds this worker's optimizer lock, so concurrent steps
//!   (from any trainer) are applied one at a time, each whole. Simple and exact; trainers queue
//!   behind each other's updates.
//! - [`UpdateMode::Hogwild`]: no lock. Each parameter's new value is computed from the
//!   snapshot the step read and published with a compare-and-swap; if another trainer
//!   published in between, the update is recomputed against the newer value. Nothing blocks
//!   and no update is lost, but a step is no longer applied atomically across parameters
//!   (trainers' updates interleave parameter by parameter), and under heavy contention work is
//!   redone. That is the Hogwild bargain: consistency traded for never waiting.
//!
//! Optimizer state (momentum, Adam moments) belongs to one optimizer instance, so each trainer's
//! [`DistributedOptimizer`] keeps its own, as in PyTorch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use sluice_agent::{Agent, HandlerError, RRef, Registry, RpcError};

use crate::cpu::dispatch;
use crate::dist::Context;
use crate::dtype::Float;
use crate::error::{Error, Result};
use crate::graph::LeafState;
use crate::tensor::{LeafId, Tensor};

struct ParamInner {
    name: String,
    leaf: Arc<LeafState>,
    data: ArcSwap<Tensor>,
}

/// A trainable tensor with a stable gradient identity. Clones share it.
#[derive(Clone)]
pub struct Parameter(Arc<ParamInner>);

impl std::fmt::Debug for Parameter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Parameter({}, {:?})", self.0.name, self.data())
    }
}

impl Parameter {
    pub fn new(name: impl Into<String>, value: Tensor) -> Parameter {
        Parameter(Arc::new(ParamInner {
            name: name.into(),
            leaf: Arc::new(LeafState::new(LeafId::fresh())),
            data: ArcSwap::from_pointee(value.detach()),
        }))
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }

    pub fn id(&self) -> LeafId {
        self.0.leaf.id
    }

    /// The current value as a leaf that requires grad (use it in forward passes).
    pub fn tensor(&self) -> Tensor {
        self.data().with_leaf(self.0.leaf.clone())
    }

    /// An earlier value of this parameter (one [`data`](Self::data) returned) as a leaf of
    /// *this* parameter: gradients through it accumulate for this parameter. What weight
    /// stashing uses to run a forward on the version a micro-batch started with.
    pub fn tensor_of(&self, value: &Tensor) -> Tensor {
        value.detach().with_leaf(self.0.leaf.clone())
    }

    /// The current value, detached.
    pub fn data(&self) -> Tensor {
        (**self.0.data.load()).clone()
    }

    /// Replaces the value (same identity).
    pub fn set(&self, value: Tensor) {
        self.0.data.store(Arc::new(value.detach()));
    }

    /// The gradient a *local* backward accumulated.
    pub fn grad(&self) -> Option<Tensor> {
        self.0.leaf.grad.lock().unwrap().clone()
    }

    pub fn zero_grad(&self) {
        *self.0.leaf.grad.lock().unwrap() = None;
    }
}

impl Serialize for Parameter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        (&self.0.name, self.data()).serialize(s)
    }
}

impl<'de> Deserialize<'de> for Parameter {
    /// A copy with a fresh identity (what `RRef::to_here` gives).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let (name, data) = <(String, Tensor)>::deserialize(d)?;
        Ok(Parameter::new(name, data))
    }
}

/// The update rule.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub enum OptimizerKind {
    Sgd { lr: f64, momentum: f64 },
    Adam { lr: f64, beta1: f64, beta2: f64, eps: f64 },
}

impl OptimizerKind {
    pub fn sgd(lr: f64) -> Self {
        OptimizerKind::Sgd { lr, momentum: 0.0 }
    }

    pub fn adam(lr: f64) -> Self {
        OptimizerKind::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UpdateMode {
    Locked,
    Hogwild,
}

/// One parameter's optimizer state, as checkpoints keep it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamState {
    pub momentum: Option<Vec<f64>>,
    /// Adam's first and second moments and its step count.
    pub adam: Option<(Vec<f64>, Vec<f64>, u64)>,
}

#[derive(Default)]
struct Slot {
    momentum: Option<Vec<f64>>,
    adam: Option<(Vec<f64>, Vec<f64>, u64)>,
    /// The same state for a parameter on a GPU, kept there.
    gpu_momentum: Option<Tensor>,
    gpu_adam: Option<(Tensor, Tensor, u64)>,
}

/// An optimizer over local parameters.
pub struct Optimizer {
    kind: OptimizerKind,
    mode: UpdateMode,
    params: Vec<Parameter>,
    state: Mutex<HashMap<LeafId, Slot>>,
}

/// Serializes `Locked` steps on this worker.
static STEP_LOCK: Mutex<()> = Mutex::new(());

impl Optimizer {
    pub fn new(kind: OptimizerKind, params: Vec<Parameter>, mode: UpdateMode) -> Optimizer {
        Optimizer {
            kind,
            mode,
            params,
            state: Mutex::default(),
        }
    }

    pub fn params(&self) -> &[Parameter] {
        &self.params
    }

    /// Steps with the gradients a local backward accumulated in the parameters, then clears
    /// them.
    pub fn step(&self) -> Result<()> {
        let grads: HashMap<LeafId, Tensor> = self
            .params
            .iter()
            .filter_map(|p| p.grad().map(|g| (p.id(), g)))
            .collect();
        self.step_with(&grads)?;
        self.params.iter().for_each(Parameter::zero_grad);
        Ok(())
    }

    /// Steps with `grads` (e.g. a distributed context's); a parameter without a gradient
    /// stays unchanged.
    pub fn step_with(&self, grads: &HashMap<LeafId, Tensor>) -> Result<()> {
        let _lock = match self.mode {
            UpdateMode::Locked => Some(STEP_LOCK.lock().unwrap_or_else(|p| p.into_inner())),
            UpdateMode::Hogwild => None,
        };
        let mut state = self.state.lock().unwrap();
        for p in &self.params {
            let Some(g) = grads.get(&p.id()) else { continue };
            let slot = state.entry(p.id()).or_default();
            loop {
                let current = p.0.data.load_full();
                let updated = self.update(&current, g, slot)?;
                match self.mode {
                    UpdateMode::Locked => {
                        p.0.data.store(Arc::new(updated.0));
                        *slot = updated.1;
                        break;
                    }
                    UpdateMode::Hogwild => {
                        let previous = p.0.data.compare_and_swap(&current, Arc::new(updated.0));
                        if Arc::ptr_eq(&previous, &current) {
                            *slot = updated.1;
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Each parameter's update state (momentum, Adam's moments and step), by parameter name,
    /// for checkpoints. CPU state only: a parameter whose state lives on a GPU is an error.
    pub fn export_state(&self) -> Result<Vec<(String, ParamState)>> {
        let state = self.state.lock().unwrap();
        let mut out = Vec::new();
        for p in &self.params {
            let Some(slot) = state.get(&p.id()) else { continue };
            if slot.gpu_momentum.is_some() || slot.gpu_adam.is_some() {
                return Err(Error::Optimizer(format!(
                    "{}: exporting optimizer state kept on a GPU is not supported",
                    p.name()
                )));
            }
            out.push((
                p.name().to_owned(),
                ParamState {
                    momentum: slot.momentum.clone(),
                    adam: slot.adam.clone(),
                },
            ));
        }
        Ok(out)
    }

    /// Restores state saved by [`export_state`](Self::export_state) (matched by parameter
    /// name; a length that does not match its parameter is an error).
    pub fn import_state(&self, saved: &[(String, ParamState)]) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        // Everything is checked before anything is applied.
        let mut checked = Vec::with_capacity(saved.len());
        for (name, s) in saved {
            let p = self
                .params
                .iter()
                .find(|p| p.name() == name)
                .ok_or_else(|| Error::Optimizer(format!("optimizer state for unknown parameter {name}")))?;
            let n = p.data().numel();
            let lens = [
                s.momentum.as_ref().map(Vec::len),
                s.adam.as_ref().map(|a| a.0.len()),
                s.adam.as_ref().map(|a| a.1.len()),
            ];
            if lens.iter().flatten().any(|&l| l != n) {
                return Err(Error::Optimizer(format!(
                    "{name}: saved state does not match its {n} elements"
                )));
            }
            checked.push((p.id(), s));
        }
        for (id, s) in checked {
            let slot = state.entry(id).or_default();
            slot.momentum = s.momentum.clone();
            slot.adam = s.adam.clone();
        }
        Ok(())
    }

    /// The new value and state for one parameter (pure: retried freely in Hogwild mode).
    fn update(&self, p: &Tensor, g: &Tensor, slot: &Slot) -> Result<(Tensor, Slot)> {
        if g.shape() != p.shape() {
            return Err(Error::Optimizer(format!(
                "gradient {:?} for a parameter {:?}",
                g.shape(),
                p.shape()
            )));
        }
        if p.device() != sluice_channel::Device::Cpu {
            return self.update_gpu(p, g, slot);
        }
        match self.kind {
            OptimizerKind::Sgd { lr, momentum: 0.0 } => {
                if let Some(idx) = g.sparse_indices() {
                    // Sparse SGD touches only the rows that were used.
                    let rows = crate::cpu::scale(&g.sparse_values(), -lr)?;
                    return Ok((crate::cpu::index_add_rows(p, idx, &rows)?, Slot::default()));
                }
                let out = dispatch!(p, "sgd", T => {
                    let lr = T::from_f64(lr);
                    crate::cpu::zip_map::<T>("sgd", p, &g.to_dtype(p.dtype())?, |w, g| w - lr * g)
                })?;
                Ok((out, Slot::default()))
            }
            OptimizerKind::Sgd { lr, momentum } => {
                let g = g.to_dense()?.to_f64_vec()?;
                let mut buf = slot.momentum.clone().unwrap_or_else(|| vec![0.0; g.len()]);
                for (b, g) in buf.iter_mut().zip(&g) {
                    *b = momentum * *b + g;
                }
                let out = apply(p, |i, w| w - lr * buf[i])?;
                Ok((
                    out,
                    Slot {
                        momentum: Some(buf),
                        ..Slot::default()
                    },
                ))
            }
            OptimizerKind::Adam { lr, beta1, beta2, eps } => {
                let g = g.to_dense()?.to_f64_vec()?;
                let (mut m, mut v, t) = slot
                    .adam
                    .clone()
                    .unwrap_or_else(|| (vec![0.0; g.len()], vec![0.0; g.len()], 0));
                let t = t + 1;
                for ((m, v), g) in m.iter_mut().zip(v.iter_mut()).zip(&g) {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                }
                let (c1, c2) = (1.0 - beta1.powi(t as i32), 1.0 - beta2.powi(t as i32));
                let out = apply(p, |i, w| w - lr * (m[i] / c1) / ((v[i] / c2).sqrt() + eps))?;
                Ok((
                    out,
                    Slot {
                        adam: Some((m, v, t)),
                        ..Slot::default()
                    },
                ))
            }
        }
    }

    /// [`update`](Self::update) for a parameter on a GPU: fused kernels, state kept on the
    /// parameter's device, the gradient moved there first if it landed elsewhere.
    fn update_gpu(&self, p: &Tensor, g: &Tensor, slot: &Slot) -> Result<(Tensor, Slot)> {
        use crate::cuda::optim;
        if g.is_sparse() {
            return Err(Error::Optimizer(
                "sparse gradients are CPU-only; keep embedding tables on the CPU".into(),
            ));
        }
        Ok(match self.kind {
            OptimizerKind::Sgd { lr, momentum: 0.0 } => (optim::sgd(p, g, lr)?, Slot::default()),
            OptimizerKind::Sgd { lr, momentum } => {
                let (out, buf) = optim::momentum(p, g, slot.gpu_momentum.as_ref(), lr, momentum)?;
                (
                    out,
                    Slot {
                        gpu_momentum: Some(buf),
                        ..Slot::default()
                    },
                )
            }
            OptimizerKind::Adam { lr, beta1, beta2, eps } => {
                let (state, t) = match &slot.gpu_adam {
                    Some((m, v, t)) => (Some((m, v)), *t),
                    None => (None, 0),
                };
                let (out, m, v) = optim::adam(p, g, state, lr, beta1, beta2, eps, t + 1)?;
                (
                    out,
                    Slot {
                        gpu_adam: Some((m, v, t + 1)),
                        ..Slot::default()
                    },
                )
            }
        })
    }
}

/// `f(index, value)` over a parameter's elements, in its dtype.
fn apply(p: &Tensor, f: impl Fn(usize, f64) -> f64) -> Result<Tensor> {
    dispatch!(p, "optimizer", T => {
        let v = p.values::<T>()?;
        let out: Vec<T> = v.iter().enumerate().map(|(i, &w)| T::from_f64(f(i, w.to_f64()))).collect();
        Ok(Tensor::from_vec_unchecked(out, p.shape().to_vec()))
    })
}

const H_CREATE: &str = "sluice.optim.create";
const H_STEP: &str = "sluice.optim.step";
const H_DROP: &str = "sluice.optim.drop";

static NEXT_OPTIMIZER: AtomicU64 = AtomicU64::new(1);

fn optimizers() -> &'static Mutex<HashMap<u64, Arc<Optimizer>>> {
    static T: OnceLock<Mutex<HashMap<u64, Arc<Optimizer>>>> = OnceLock::new();
    T.get_or_init(Mutex::default)
}

#[derive(Serialize, Deserialize)]
struct CreateRequest {
    kind: OptimizerKind,
    mode: UpdateMode,
    params: Vec<RRef<Parameter>>,
}

fn create_local(kind: OptimizerKind, mode: UpdateMode, params: &[RRef<Parameter>]) -> Result<u64> {
    let params = params
        .iter()
        .map(|r| r.local_value().map(|p| (*p).clone()))
        .collect::<std::result::Result<Vec<_>, RpcError>>()?;
    let id = NEXT_OPTIMIZER.fetch_add(1, Ordering::Relaxed);
    optimizers()
        .lock()
        .unwrap()
        .insert(id, Arc::new(Optimizer::new(kind, params, mode)));
    Ok(id)
}

/// Steps run here inside a backward's answer (see [`DistributedOptimizer::backward_and_step`]).
static STEPS_IN_BACKWARD: AtomicU64 = AtomicU64::new(0);

/// How many optimizer steps this process ran inside a distributed backward's answer instead
/// of on a call of their own (see [`DistributedOptimizer::backward_and_step`]); for tests and
/// diagnostics.
pub fn steps_in_backward() -> u64 {
    STEPS_IN_BACKWARD.load(Ordering::Relaxed)
}

/// Steps optimizer `id` with context `context`'s gradients, for the backward's handler.
pub(crate) fn step_in_backward(id: u64, context: u64) -> Result<()> {
    step_local(id, context)?;
    STEPS_IN_BACKWARD.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn step_local(id: u64, context: u64) -> Result<()> {
    let opt = optimizers()
        .lock()
        .unwrap()
        .get(&id)
        .cloned()
        .ok_or_else(|| Error::Optimizer(format!("no optimizer {id} on this worker")))?;
    let grads = crate::dist::get_gradients(context)?;
    opt.step_with(&grads)
}

pub(crate) fn install(registry: &mut Registry) {
    registry
        .handler(H_CREATE, |_cx, req: CreateRequest| {
            create_local(req.kind, req.mode, &req.params)
                .map_err(|e| HandlerError::new("OptimizerError", e.to_string()))
        })
        .handler(H_STEP, |cx, (id, context): (u64, u64)| {
            step_local(id, context).map_err(|e| {
                HandlerError::new("OptimizerError", format!("error on worker {}: {e}", cx.agent.info().id))
            })
        })
        .handler(H_DROP, |_cx, id: u64| {
            optimizers().lock().unwrap().remove(&id);
            Ok(())
        });
}

/// One optimizer per owner of the given remote parameters; `step(context)` has every owner
/// update its parameters with that context's gradients, concurrently.
pub struct DistributedOptimizer {
    agent: Agent,
    remotes: Vec<(u32, u64)>,
}

impl DistributedOptimizer {
    pub fn new(agent: &Agent, kind: OptimizerKind, params: &[RRef<Parameter>], mode: UpdateMode) -> Result<Self> {
        let mut by_owner: Vec<(u32, Vec<RRef<Parameter>>)> = Vec::new();
        for p in params {
            let owner = p.owner().id;
            match by_owner.iter_mut().find(|(o, _)| *o == owner) {
                Some((_, v)) => v.push(p.clone()),
                None => by_owner.push((owner, vec![p.clone()])),
            }
        }
        let me = agent.info().id;
        let mut remotes = Vec::new();
        for (owner, params) in by_owner {
            let id = if owner == me {
                create_local(kind, mode, &params)?
            } else {
                agent.call::<_, u64>(owner, H_CREATE, &CreateRequest { kind, mode, params })?
            };
            remotes.push((owner, id));
        }
        Ok(DistributedOptimizer {
            agent: agent.clone(),
            remotes,
        })
    }

    /// Every owner steps with context `context`'s gradients; the first failure is returned
    /// after all have finished.
    pub fn step(&self, context: u64) -> Result<()> {
        self.step_except(context, &[])
    }

    /// `context.backward(roots, false)` and then [`step`](Self::step), in fewer round trips:
    /// the backward's message to an owner asks it to step before it answers, which it does
    /// when that message is the only way gradients reach it in the context (the usual case:
    /// one forward call to each owner). Owners that could not tell, and this worker's own
    /// parameters, step after the backward as `step` does. On an error nothing more steps,
    /// but an owner that stepped before the error was known stays stepped.
    pub fn backward_and_step(&self, context: &Context, roots: &[Tensor]) -> Result<()> {
        self.backward_and_step_by_id(context.id(), roots)
    }

    /// [`backward_and_step`](Self::backward_and_step) in context `context` by id (live on this
    /// worker), as [`crate::dist::backward`] is to `Context::backward`.
    pub fn backward_and_step_by_id(&self, context: u64, roots: &[Tensor]) -> Result<()> {
        let me = self.agent.info().id;
        let remote: Vec<(u32, u64)> = self.remotes.iter().copied().filter(|(owner, _)| *owner != me).collect();
        let stepped = crate::dist::backward_stepping(&self.agent, context, roots, &remote)?;
        self.step_except(context, &stepped)
    }

    /// `step`, except on the owners in `done`.
    fn step_except(&self, context: u64, done: &[u32]) -> Result<()> {
        let me = self.agent.info().id;
        let pending: Vec<_> = self
            .remotes
            .iter()
            .filter(|(owner, _)| *owner != me && !done.contains(owner))
            .map(|&(owner, id)| self.agent.call_async(owner, H_STEP, &(id, context)))
            .collect();
        let mut first = None;
        for &(owner, id) in &self.remotes {
            if owner == me && !done.contains(&owner) {
                if let Err(e) = step_local(id, context) {
                    first.get_or_insert(Error::OnWorker {
                        worker: me,
                        detail: e.to_string(),
                    });
                }
            }
        }
        for fut in pending {
            if let Err(e) = fut.wait() {
                let e = crate::dist::remote_error(e);
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for DistributedOptimizer {
    fn drop(&mut self) {
        let me = self.agent.info().id;
        for &(owner, id) in &self.remotes {
            if owner == me {
                optimizers().lock().unwrap().remove(&id);
            } else {
                // Best effort: the owner forgets the optimizer's state.
                drop(self.agent.call_async(owner, H_DROP, &id));
            }
        }
    }
}
