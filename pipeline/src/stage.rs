//! The worker side: stages built from their description, a micro-batch's forward hop (recorded
//! in the distributed-autograd context, then passed straight to the next stage), the optimizer
//! step with a context's gradients, checkpoint shards, and a profile of each layer.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sluice_agent::{CallContext, Device, HandlerError, Registry};
use sluice_autograd::{dist, DType, Optimizer, OptimizerKind, Parameter, Tensor, UpdateMode};

use crate::checkpoint::{self, SavedTensor, Shard, ShardEntry};
use crate::nn::{self, Layer};
use crate::partition::LayerCost;

pub(crate) const H_CREATE: &str = "sluice.pipeline.create";
pub(crate) const H_HOP: &str = "sluice.pipeline.hop";
pub(crate) const H_STEP: &str = "sluice.pipeline.step";
pub(crate) const H_GRADS: &str = "sluice.pipeline.grads";
pub(crate) const H_SAVE: &str = "sluice.pipeline.save";
pub(crate) const H_LOAD: &str = "sluice.pipeline.load";
pub(crate) const H_DROP: &str = "sluice.pipeline.drop";
pub(crate) const H_PROFILE: &str = "sluice.pipeline.profile";
pub(crate) const H_FAULT: &str = "sluice.pipeline.fault";
pub(crate) const H_PID: &str = "sluice.pipeline.pid";
pub(crate) const H_PARAMS: &str = "sluice.pipeline.params";
pub(crate) const H_BUSY: &str = "sluice.pipeline.busy";
pub(crate) const H_MEMORY: &str = "sluice.pipeline.memory";
pub(crate) const H_VALUES: &str = "sluice.pipeline.values";

/// This process's peak and current resident memory, in bytes (`VmHWM`, `VmRSS`).
fn memory() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map_or(0, |kib| kib * 1024)
    };
    (field("VmHWM:"), field("VmRSS:"))
}
pub(crate) const H_MODULE: &str = "sluice.pipeline.module";
/// The method remote modules answer through their RRef (`rref_rpc_sync(.., "forward", x)`).
pub const FORWARD: &str = "forward";

/// What an RRef to a remote module holds: the stage that is the module, on its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleRef {
    pub id: u64,
}

/// What a worker needs to build a stage.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StageSpec {
    pub id: u64,
    pub model: Vec<Layer>,
    pub layers: Range<usize>,
    pub seed: u64,
    pub dtype: DType,
    pub optimizer: OptimizerKind,
    /// Rematerialization: keep only the stage's input per micro-batch and recompute its
    /// activations in the backward.
    pub remat: bool,
    /// Where the stage's parameters live and its layers run. A CUDA stage takes its input to
    /// the GPU and hands its output on in host memory (recorded moves: gradients go back the
    /// same way), so stages of any devices chain.
    pub device: Device,
}

struct Stage {
    spec: StageSpec,
    /// Per layer of the stage.
    params: Vec<Vec<Parameter>>,
    optimizer: Optimizer,
    /// One micro-batch's forward at a time: a stage is one device.
    compute: Mutex<()>,
    /// Fault injection for tests: a pause before each shard written.
    save_pause_ms: AtomicU64,
    /// Nanoseconds spent computing forwards.
    forward_busy_ns: AtomicU64,
    /// Weight versions: the current one (steps taken) and, under the asynchronous schedule,
    /// the earlier values forwards still in flight were issued on (weight stashing).
    versions: Mutex<Versions>,
}

#[derive(Default)]
struct Versions {
    current: u64,
    /// Version → every parameter's value then (flat, in parameter order).
    stash: std::collections::BTreeMap<u64, Vec<Tensor>>,
}

impl Stage {
    /// The stage's parameters as forward inputs: their current values, or those of
    /// `version` (stashed) for a forward issued on it.
    fn tensors(&self, version: Option<u64>) -> Result<Vec<Tensor>, HandlerError> {
        let flat = self.params.iter().flatten();
        let versions = self.versions.lock().unwrap();
        match version {
            None => Ok(flat.map(Parameter::tensor).collect()),
            Some(v) if v == versions.current => Ok(flat.map(Parameter::tensor).collect()),
            Some(v) => {
                let values = versions.stash.get(&v).ok_or_else(|| {
                    err(format!(
                        "weight version {v} is not stashed (current {}, stashed {:?})",
                        versions.current,
                        versions.stash.keys().collect::<Vec<_>>()
                    ))
                })?;
                Ok(flat.zip(values).map(|(p, t)| p.tensor_of(t)).collect())
            }
        }
    }

    /// One optimizer step with context `context`'s gradients. `keep_from`: the oldest version
    /// a forward still in flight was issued on (asynchronous schedule: the current values are
    /// stashed first, and versions older than it dropped); `None` keeps nothing. Returns the
    /// new version.
    fn step(&self, context: u64, keep_from: Option<u64>) -> Result<u64, HandlerError> {
        let grads = dist::get_gradients(context).map_err(err)?;
        // A stage's update is whole with respect to its forwards.
        let _device = self.compute.lock().unwrap();
        let mut v = self.versions.lock().unwrap();
        if let Some(k) = keep_from {
            if k <= v.current {
                let values = self.params.iter().flatten().map(Parameter::data).collect();
                let current = v.current;
                v.stash.insert(current, values);
            }
        }
        self.optimizer.step_with(&grads).map_err(err)?;
        v.current += 1;
        let keep = keep_from.unwrap_or(v.current);
        v.stash.retain(|&version, _| version >= keep);
        Ok(v.current)
    }
}

fn stages() -> &'static Mutex<HashMap<u64, Arc<Stage>>> {
    static S: OnceLock<Mutex<HashMap<u64, Arc<Stage>>>> = OnceLock::new();
    S.get_or_init(Mutex::default)
}

fn err(e: impl std::fmt::Display) -> HandlerError {
    HandlerError::new("PipelineError", e.to_string())
}

fn get(id: u64) -> Result<Arc<Stage>, HandlerError> {
    stages()
        .lock()
        .unwrap()
        .get(&id)
        .cloned()
        .ok_or_else(|| err(format!("no pipeline stage {id} on this worker")))
}

fn create(spec: StageSpec) -> Result<usize, HandlerError> {
    if spec.layers.end > spec.model.len() || spec.layers.is_empty() {
        return Err(err(format!(
            "layers {:?} of a {}-layer model",
            spec.layers,
            spec.model.len()
        )));
    }
    let params = nn::build(&spec.model, spec.layers.clone(), spec.seed, spec.dtype).map_err(err)?;
    if spec.device != Device::Cpu {
        // Initialised on the host (the same values whatever the device), then moved.
        for p in params.iter().flatten() {
            let moved = p
                .data()
                .to_device(spec.device)
                .map_err(|e| err(format!("{} is not usable on this worker: {e}", spec.device)))?;
            p.set(moved);
        }
    }
    let flat: Vec<Parameter> = params.iter().flatten().cloned().collect();
    let count = flat.len();
    let stage = Stage {
        optimizer: Optimizer::new(spec.optimizer, flat, UpdateMode::Locked),
        params,
        spec: spec.clone(),
        compute: Mutex::new(()),
        save_pause_ms: AtomicU64::new(0),
        forward_busy_ns: AtomicU64::new(0),
        versions: Mutex::default(),
    };
    stages().lock().unwrap().insert(spec.id, Arc::new(stage));
    Ok(count)
}

/// What a forward hop carries: the stages left to run, the activation, and the weight version
/// to run on (asynchronous schedule; `None`: the current weights).
pub(crate) type HopArgs = (Vec<(u32, u64)>, Tensor, Option<u64>);

/// This stage's layers on `x`, then the rest of `route` (nested: the next stage is called
/// from here, so activations go stage to stage).
fn hop(cx: &CallContext, (route, x, version): HopArgs) -> Result<Tensor, HandlerError> {
    let (&(_, id), rest) = route.split_first().ok_or_else(|| err("an empty route"))?;
    let stage = get(id)?;
    let layers = &stage.spec.model[stage.spec.layers.clone()];
    let h = {
        let _device = stage.compute.lock().unwrap();
        let started = Instant::now();
        let params = stage.tensors(version)?;
        let x = x.to_device(stage.spec.device).map_err(err)?;
        let h = if stage.spec.remat {
            let mut inputs = vec![x];
            inputs.extend(params);
            let layers = layers.to_vec();
            sluice_autograd::checkpoint(&inputs, move |t| nn::forward_tensors(&layers, &t[1..], &t[0]))
        } else {
            nn::forward_tensors(layers, &params, &x)
        }
        .and_then(|h| h.to_device(Device::Cpu))
        .map_err(err)?;
        stage
            .forward_busy_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        h
    };
    match rest.first() {
        None => Ok(h),
        Some(&(next, _)) => dist::rpc_sync(&cx.agent, next, H_HOP, &(rest.to_vec(), h, version)).map_err(err),
    }
}

fn save(id: u64, dir: &str, step: u64, worker: &str) -> Result<Vec<ShardEntry>, HandlerError> {
    let stage = get(id)?;
    let state = stage.optimizer.export_state().map_err(err)?;
    let mut entries = Vec::new();
    for (i, layer) in stage.spec.layers.clone().enumerate() {
        let pause = stage.save_pause_ms.load(Ordering::Relaxed);
        if pause > 0 {
            std::thread::sleep(Duration::from_millis(pause));
        }
        let params = stage.params[i]
            .iter()
            .map(checkpoint::save_tensor)
            .collect::<Result<Vec<SavedTensor>, _>>()
            .map_err(err)?;
        let prefix = format!("layer{layer}.");
        let shard = Shard {
            format: checkpoint::FORMAT,
            layer,
            params,
            optimizer: state.iter().filter(|(n, _)| n.starts_with(&prefix)).cloned().collect(),
        };
        entries.push(checkpoint::write_shard(Path::new(dir), step, &shard, worker).map_err(err)?);
    }
    Ok(entries)
}

fn load(id: u64, dir: &str, manifest: checkpoint::Manifest) -> Result<(), HandlerError> {
    let stage = get(id)?;
    let dir = Path::new(dir);
    let mut state = Vec::new();
    for (i, layer) in stage.spec.layers.clone().enumerate() {
        let shard = checkpoint::read_shard(dir, &manifest, layer).map_err(err)?;
        let params = &stage.params[i];
        if shard.params.len() != params.len() {
            return Err(err(format!(
                "layer {layer}: {} saved tensors for {} parameters",
                shard.params.len(),
                params.len()
            )));
        }
        for (p, saved) in params.iter().zip(&shard.params) {
            let t = checkpoint::load_tensor(saved).map_err(err)?;
            if saved.name != p.name() || t.shape() != p.data().shape() {
                return Err(err(format!(
                    "layer {layer}: saved {} {:?} for parameter {} {:?}",
                    saved.name,
                    t.shape(),
                    p.name(),
                    p.data().shape()
                )));
            }
            p.set(
                t.to_dtype(p.data().dtype())
                    .and_then(|t| t.to_device(stage.spec.device))
                    .map_err(err)?,
            );
        }
        state.extend(shard.optimizer);
    }
    stage.optimizer.import_state(&state).map_err(err)
}

/// Each layer's cost on this worker: forward and backward of a batch of `batch`, timed (median
/// of `rounds`).
pub(crate) fn profile(
    model: &[Layer],
    batch: usize,
    dtype: DType,
    rounds: usize,
) -> sluice_autograd::Result<Vec<LayerCost>> {
    let mut width = model
        .iter()
        .find_map(|l| match l {
            Layer::Linear { inputs, .. } => Some(*inputs),
            _ => None,
        })
        .unwrap_or(1);
    let mut out = Vec::with_capacity(model.len());
    for (i, layer) in model.iter().enumerate() {
        let params = layer.init(i, 0, dtype)?;
        let mut fw = Vec::new();
        let mut bw = Vec::new();
        for r in 0..rounds.max(1) {
            let x = Tensor::randn(&[batch, width], 1.0, r as u64, dtype)?.requires_grad_();
            let t0 = Instant::now();
            let y = layer.forward(&params, &x)?;
            fw.push(t0.elapsed().as_secs_f64());
            let t1 = Instant::now();
            y.sum()?.backward()?;
            bw.push(t1.elapsed().as_secs_f64());
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let next = layer.output_width(width);
        out.push(LayerCost {
            forward: median(&mut fw),
            backward: median(&mut bw),
            param_bytes: (layer.param_count() * dtype.size()) as u64,
            activation_bytes: (batch * next * dtype.size()) as u64,
        });
        width = next;
    }
    Ok(out)
}

/// Registers the stage handlers (every worker that may hold a stage needs them, with
/// `sluice_autograd::dist::install` and `optim::install`).
pub fn install(r: &mut Registry) {
    r.handler(H_CREATE, |_cx: &CallContext, spec: StageSpec| create(spec));
    dist::function(r, H_HOP, hop);
    r.handler(
        H_STEP,
        |_cx: &CallContext, (id, context, keep_from): (u64, u64, Option<u64>)| get(id)?.step(context, keep_from),
    );
    r.handler(H_VALUES, |_cx: &CallContext, id: u64| {
        let stage = get(id)?;
        stage
            .params
            .iter()
            .flatten()
            .map(|p| Ok((p.name().to_owned(), p.data().to_f64_vec().map_err(err)?)))
            .collect::<Result<Vec<(String, Vec<f64>)>, HandlerError>>()
    });
    r.handler(H_GRADS, |_cx: &CallContext, (id, context): (u64, u64)| {
        let stage = get(id)?;
        let grads = dist::get_gradients(context).map_err(err)?;
        stage
            .params
            .iter()
            .flatten()
            .map(|p| {
                let g = grads
                    .get(&p.id())
                    .ok_or_else(|| err(format!("no gradient for {}", p.name())))?;
                Ok((p.name().to_owned(), g.to_f64_vec().map_err(err)?))
            })
            .collect::<Result<Vec<(String, Vec<f64>)>, HandlerError>>()
    });
    r.handler(H_SAVE, |cx: &CallContext, (id, dir, step): (u64, String, u64)| {
        save(id, &dir, step, &cx.agent.info().name)
    });
    r.handler(
        H_LOAD,
        // The manifest travels as its JSON (its driver state is free-form JSON, which
        // postcard cannot carry).
        |_cx: &CallContext, (id, dir, manifest): (u64, String, String)| {
            let manifest: checkpoint::Manifest = serde_json::from_str(&manifest).map_err(err)?;
            load(id, &dir, manifest)
        },
    );
    r.handler(H_DROP, |_cx: &CallContext, id: u64| {
        stages().lock().unwrap().remove(&id);
        Ok(())
    });
    r.handler(
        H_PROFILE,
        |_cx: &CallContext, (model, batch, dtype, rounds): (Vec<Layer>, usize, DType, usize)| {
            profile(&model, batch, dtype, rounds).map_err(err)
        },
    );
    r.handler(H_FAULT, |_cx: &CallContext, (id, pause_ms): (u64, u64)| {
        get(id)?.save_pause_ms.store(pause_ms, Ordering::Relaxed);
        Ok(())
    });
    r.handler(H_PID, |_cx: &CallContext, (): ()| Ok(std::process::id()));
    r.handler(H_MEMORY, |_cx: &CallContext, (): ()| Ok(memory()));
    r.handler(H_BUSY, |_cx: &CallContext, id: u64| {
        let fwd = get(id)?.forward_busy_ns.load(Ordering::Relaxed);
        Ok((fwd, dist::backward_busy().as_nanos() as u64))
    });
    r.handler(H_PARAMS, |cx: &CallContext, id: u64| {
        let stage = get(id)?;
        Ok(stage
            .params
            .iter()
            .flatten()
            .map(|p| cx.agent.rref(p.clone()))
            .collect::<Vec<sluice_agent::RRef<Parameter>>>())
    });
    r.handler(H_MODULE, |cx: &CallContext, id: u64| {
        get(id)?;
        Ok(cx.agent.rref(ModuleRef { id }))
    });
    dist::method(r, FORWARD, |cx: &CallContext, m: &ModuleRef, x: Tensor| {
        hop(cx, (vec![(cx.agent.info().id, m.id)], x, None))
    });
}
