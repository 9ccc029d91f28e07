//! Pipeline parallelism over RPC, and distributed checkpoints.
//!
//! A sequential model ([`nn::Layer`]s) is split into contiguous stages ([`partition`]: by
//! hints, or automatically from a profile), each built on the worker its placement string
//! names (`"worker1/cpu"`). A mini-batch is cut into micro-batches; each micro-batch's forward
//! is one RPC chain through the stages (stage to stage, recorded in a distributed-autograd
//! context), and the driver runs the backwards in the order of the [`schedule`] (GPipe or
//! 1F1B), then every stage steps its own optimizer with the context's gradients. Gradients over
//! a mini-batch equal the unpipelined model's (the micro-batch losses are weighted so they sum
//! to the mini-batch mean).
//!
//! [`Pipeline::save`] writes a [`checkpoint`]: every stage writes its layers' shards, the
//! driver commits the manifest; [`Pipeline::restore`] rebuilds on any placement and partition.
//!
//! Rematerialization is a switch per pipeline or per stage ([`Remat`]): a stage keeps only its
//! input per micro-batch and recomputes its activations in the backward
//! (`sluice_autograd::checkpoint`).
//!
//! Asynchronous 1F1B with weight stashing (PipeDream, [`Schedule::AsyncOneFOneB`]) updates once
//! per micro-batch; stages may live on `cuda:N` (placement strings name the device).
//!
//! Failures: every call returns an error, never hangs: a lost stage's worker fails the calls
//! that need it with an error naming it, bad input with an error naming the shapes.

#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod nn;
pub mod partition;
pub mod remote;
pub mod schedule;
pub mod stage;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sluice_agent::{with_priority, Agent, Device, Priority, Registry};
use sluice_autograd::dist::{self, Context, DistFuture};
use sluice_autograd::{cross_entropy, DType, OptimizerKind, Tensor};

pub use checkpoint::{CheckpointError, Manifest};
pub use nn::Layer;
pub use partition::{LayerCost, Partition, PartitionError};
pub use remote::RemoteModule;
pub use schedule::{Op, Schedule};

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("placement {0:?}: expected WORKER/DEVICE, e.g. \"worker1/cpu\"")]
    Placement(String),
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Autograd(#[from] sluice_autograd::Error),
    #[error("{0}")]
    Rpc(#[from] sluice_agent::RpcError),
}

pub type Result<T> = std::result::Result<T, PipelineError>;

/// Registers what a worker holding stages needs (the stage handlers, distributed autograd).
pub fn install(r: &mut Registry) {
    dist::install(r);
    stage::install(r);
}

/// A stage's home: a worker and a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub worker: String,
    pub device: String,
}

impl std::str::FromStr for Placement {
    type Err = PipelineError;
    fn from_str(s: &str) -> Result<Placement> {
        match s.split_once('/') {
            Some((w, d)) if !w.is_empty() && !d.is_empty() => Ok(Placement {
                worker: w.to_owned(),
                device: d.to_owned(),
            }),
            _ => Err(PipelineError::Placement(s.to_owned())),
        }
    }
}

impl Placement {
    /// The device named: `cpu` or `cuda:N`.
    pub fn device(&self) -> Result<Device> {
        match self.device.as_str() {
            "cpu" => Ok(Device::Cpu),
            d => d
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<u32>().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    PipelineError::Unsupported(format!("{}/{d}: unknown device (cpu or cuda:N)", self.worker))
                }),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct PipelineOptions {
    pub seed: u64,
    pub dtype: DType,
    pub optimizer: OptimizerKind,
    pub schedule: Schedule,
    pub micro_batches: usize,
    /// Stages that rematerialize (by index; empty: none): they keep only their input per
    /// micro-batch and recompute activations in the backward.
    pub remat: Remat,
    /// The priority of the backward passes' calls (and of the handlers they run on the
    /// stages): above forwards by default (1F1B's rule: a stage with a backward and a
    /// forward waiting runs the backward first, which frees its activations sooner).
    pub backward_priority: Priority,
}

/// Which stages rematerialize.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Remat {
    #[default]
    None,
    All,
    /// Stages whose bit is set (stage i: bit i).
    Stages(u64),
}

impl Remat {
    pub fn stage(self, i: usize) -> bool {
        match self {
            Remat::None => false,
            Remat::All => true,
            Remat::Stages(bits) => i < 64 && bits & (1 << i) != 0,
        }
    }
}

/// Every placement names a device Sluice knows (whether the worker has it is its own check,
/// when the stage is built).
pub(crate) fn check_devices(placements: &[Placement]) -> Result<()> {
    placements.iter().try_for_each(|p| p.device().map(|_| ()))
}

pub(crate) fn next_stage_id(agent: &Agent) -> u64 {
    (u64::from(agent.info().id) << 40) | NEXT_STAGE.fetch_add(1, Ordering::Relaxed)
}

/// Each layer's measured cost on `worker` for micro-batches of `batch` rows.
pub fn profile(agent: &Agent, worker: &str, model: &[Layer], batch: usize, dtype: DType) -> Result<Vec<LayerCost>> {
    Ok(agent.call(worker, stage::H_PROFILE, &(model.to_vec(), batch, dtype, 5usize))?)
}

/// Every parameter's gradient, by name, in stage order.
pub type Gradients = Vec<(String, Vec<f64>)>;

/// What one training step did.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The mini-batch's mean loss.
    pub loss: f64,
    pub seconds: f64,
}

/// A model split over workers.
pub struct Pipeline {
    agent: Agent,
    model: Vec<Layer>,
    partition: Partition,
    placements: Vec<Placement>,
    /// (worker id, stage id) in order.
    route: Vec<(u32, u64)>,
    options: PipelineOptions,
    /// The stages' weight version (optimizer steps taken), which forwards of the
    /// asynchronous schedule are issued on.
    version: AtomicU64,
}

static NEXT_STAGE: AtomicU64 = AtomicU64::new(1);

impl Pipeline {
    /// Builds stage `i` (layers `partition.stages[i]`) on `placements[i]`.
    pub fn new(
        agent: &Agent,
        model: Vec<Layer>,
        placements: &[&str],
        partition: Partition,
        options: PipelineOptions,
    ) -> Result<Pipeline> {
        let placements = placements
            .iter()
            .map(|p| p.parse())
            .collect::<Result<Vec<Placement>>>()?;
        check_devices(&placements)?;
        // Contiguous, non-empty stages covering every layer once.
        let mut next = 0;
        for r in &partition.stages {
            if r.start != next || r.is_empty() {
                return Err(PipelineError::Unsupported(format!(
                    "partition {:?}: stages must be non-empty and contiguous from layer 0",
                    partition.stages
                )));
            }
            next = r.end;
        }
        if placements.len() != partition.stages.len() {
            return Err(PipelineError::Unsupported(format!(
                "{} placements for {} stages",
                placements.len(),
                partition.stages.len()
            )));
        }
        if partition.stages.last().map(|r| r.end) != Some(model.len()) {
            return Err(PipelineError::Unsupported(format!(
                "a partition that does not cover the {} layers",
                model.len()
            )));
        }
        if options.micro_batches == 0 {
            return Err(PipelineError::Unsupported("zero micro-batches".into()));
        }
        let mut route: Vec<(u32, u64)> = Vec::new();
        // Stages already built are dropped again if a later one fails.
        let undo = |route: &[(u32, u64)]| {
            for &(w, id) in route {
                drop(agent.call_async(w, stage::H_DROP, &id));
            }
        };
        for (i, (p, layers)) in placements.iter().zip(&partition.stages).enumerate() {
            let id = next_stage_id(agent);
            let spec = stage::StageSpec {
                id,
                model: model.clone(),
                layers: layers.clone(),
                seed: options.seed,
                dtype: options.dtype,
                optimizer: options.optimizer,
                remat: options.remat.stage(i),
                device: p.device()?,
            };
            let built = agent
                .call::<_, usize>(p.worker.as_str(), stage::H_CREATE, &spec)
                .map_err(PipelineError::from)
                .and_then(|_| Ok(agent.worker(p.worker.as_str())?.id));
            match built {
                Ok(w) => route.push((w, id)),
                Err(e) => {
                    undo(&route);
                    return Err(e);
                }
            }
        }
        Ok(Pipeline {
            agent: agent.clone(),
            model,
            partition,
            placements,
            route,
            options,
            version: AtomicU64::new(0),
        })
    }

    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    pub fn model(&self) -> &[Layer] {
        &self.model
    }

    /// Rows of each micro-batch of a mini-batch of `n` rows.
    fn sizes(&self, n: usize) -> Vec<usize> {
        let m = self.options.micro_batches.min(n).max(1);
        (0..m).map(|i| n / m + usize::from(i < n % m)).collect()
    }

    /// Starts a micro-batch's forward through every stage, on the current weights or on
    /// weight version `version`.
    fn start(&self, x: &Tensor, version: Option<u64>) -> Result<DistFuture<Tensor>> {
        let args: stage::HopArgs = (self.route.clone(), x.clone(), version);
        Ok(dist::rpc_async(&self.agent, self.route[0].0, stage::H_HOP, &args)?)
    }

    /// Every stage's optimizer step with `context`'s gradients (in parallel); see
    /// `Stage::step` for `keep_from`. Returns the stages' new weight version.
    fn step_all(&self, context: u64, keep_from: Option<u64>) -> Result<u64> {
        let steps: Vec<_> = self
            .route
            .iter()
            .map(|&(w, id)| self.agent.call_async(w, stage::H_STEP, &(id, context, keep_from)))
            .collect();
        let mut versions = Vec::new();
        for s in steps {
            versions.push(s.wait()?.decode::<u64>()?);
        }
        let v = versions[0];
        if versions.iter().any(|&x| x != v) {
            return Err(PipelineError::Unsupported(format!(
                "stages disagree on their weight version: {versions:?}"
            )));
        }
        self.version.store(v, Ordering::SeqCst);
        Ok(v)
    }

    /// Forward and backward of one mini-batch in `context`, micro-batch by micro-batch in the
    /// schedule's order; returns the mean loss.
    fn forward_backward(&self, context: &Context, x: &Tensor, y: &Tensor) -> Result<f64> {
        let n = x.shape()[0];
        let sizes = self.sizes(n);
        let xs = x.split(&sizes, 0)?;
        let ys = y.split(&sizes, 0)?;
        let mut pending: Vec<Option<DistFuture<Tensor>>> = (0..sizes.len()).map(|_| None).collect();
        let mut total = 0.0;
        let order = schedule::driver_order(self.options.schedule, self.route.len(), sizes.len());
        let mut backwards_left = sizes.len();
        for op in order {
            match op {
                Op::Forward(m) => pending[m] = Some(self.start(&xs[m], None)?),
                Op::Backward(m) => {
                    let out = pending[m].take().expect("forward before backward").wait()?;
                    let loss = cross_entropy(&out, &ys[m])?.mul_scalar(sizes[m] as f64 / n as f64)?;
                    total += loss.item()?;
                    // A context takes one non-retaining backward (its graph is then closed);
                    // each micro-batch's is over its own part of the graph, so all but the
                    // last retain (nothing more is kept: a context's graph lives until it is
                    // released either way).
                    backwards_left -= 1;
                    let retain = backwards_left > 0;
                    with_priority(self.options.backward_priority, || context.backward(&[loss], retain))?;
                }
            }
        }
        Ok(total)
    }

    /// One training step over a mini-batch.
    ///
    /// GPipe and 1F1B: forward and backward over the micro-batches in one context, then every
    /// stage's optimizer step with the mini-batch's gradients (the same update as the
    /// unpipelined model).
    ///
    /// Asynchronous 1F1B (PipeDream): every micro-batch is an update of its own. Each has its
    /// own context; as soon as its backward is done every stage steps with its gradients
    /// (mean loss over the micro-batch) and the next forward is issued on the new weights,
    /// while the forwards already in flight keep running on the weights they were issued on
    /// (weight stashing: each stage keeps those versions, and a backward always differentiates
    /// the values its forward used). So in the steady state a micro-batch's gradient is
    /// computed on weights `stages − 1` updates older than those it is applied to
    /// ([`schedule::async_versions`]), the same on every stage (one version per forward
    /// throughout, PipeDream's "vertical sync"). The pipeline drains at the end of each call;
    /// the reported loss is the mini-batch's mean.
    pub fn train_step(&self, x: &Tensor, y: &Tensor) -> Result<StepReport> {
        let start = std::time::Instant::now();
        let loss = if self.options.schedule == Schedule::AsyncOneFOneB {
            self.async_steps(x, y)?
        } else {
            let context = Context::new(&self.agent)?;
            let loss = self.forward_backward(&context, x, y)?;
            self.step_all(context.id(), None)?;
            context.release()?;
            loss
        };
        Ok(StepReport {
            loss,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// The asynchronous schedule's mini-batch: one context and one update per micro-batch.
    fn async_steps(&self, x: &Tensor, y: &Tensor) -> Result<f64> {
        let n = x.shape()[0];
        let sizes = self.sizes(n);
        let xs = x.split(&sizes, 0)?;
        let ys = y.split(&sizes, 0)?;
        let m = sizes.len();
        let mut version = self.version.load(Ordering::SeqCst);
        let mut contexts: Vec<Option<Context>> = (0..m).map(|_| None).collect();
        let mut pending: Vec<Option<DistFuture<Tensor>>> = (0..m).map(|_| None).collect();
        let mut issued_on: Vec<Option<u64>> = vec![None; m];
        let mut total = 0.0;
        for op in schedule::driver_order(Schedule::AsyncOneFOneB, self.route.len(), m) {
            match op {
                Op::Forward(k) => {
                    let context = Context::detached(&self.agent)?;
                    pending[k] = Some(context.run(|| self.start(&xs[k], Some(version)))?);
                    contexts[k] = Some(context);
                    issued_on[k] = Some(version);
                }
                Op::Backward(k) => {
                    let context = contexts[k].take().expect("forward before backward");
                    let out = pending[k].take().expect("forward before backward").wait()?;
                    let loss = context.run(|| cross_entropy(&out, &ys[k]))?;
                    total += loss.item()? * sizes[k] as f64 / n as f64;
                    with_priority(self.options.backward_priority, || context.backward(&[loss], false))?;
                    issued_on[k] = None;
                    // The oldest version a forward still in flight was issued on.
                    let keep_from = issued_on.iter().flatten().min().copied().unwrap_or(version + 1);
                    version = self.step_all(context.id(), Some(keep_from))?;
                    context.release()?;
                }
            }
        }
        Ok(total)
    }

    /// The gradients one mini-batch gives every parameter (by name), without stepping.
    pub fn gradients(&self, x: &Tensor, y: &Tensor) -> Result<(f64, Gradients)> {
        let context = Context::new(&self.agent)?;
        let loss = self.forward_backward(&context, x, y)?;
        let mut out = Vec::new();
        for &(w, id) in &self.route {
            let g: Vec<(String, Vec<f64>)> = self.agent.call(w, stage::H_GRADS, &(id, context.id()))?;
            out.extend(g);
        }
        context.release()?;
        Ok((loss, out))
    }

    /// Every parameter's current value (by name, in model order), as `f64`s.
    pub fn parameters(&self) -> Result<Gradients> {
        let mut out = Vec::new();
        for &(w, id) in &self.route {
            let v: Vec<(String, Vec<f64>)> = self.agent.call(w, stage::H_VALUES, &id)?;
            out.extend(v);
        }
        Ok(out)
    }

    /// The model's output (no gradients), micro-batches pipelined.
    pub fn predict(&self, x: &Tensor) -> Result<Tensor> {
        let sizes = self.sizes(x.shape()[0]);
        let futures = x
            .split(&sizes, 0)?
            .iter()
            .map(|m| self.start(m, None))
            .collect::<Result<Vec<_>>>()?;
        let outs = futures
            .into_iter()
            .map(|f| f.wait())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(sluice_autograd::cat(&outs, 0)?)
    }

    /// Saves a checkpoint of step `step` into `dir`: every stage writes its shards (in
    /// parallel), then the manifest (with `driver`, the caller's own state) makes it exist.
    /// A step that already has a checkpoint is refused (overwriting its shards under its
    /// manifest could leave it torn). Workers write into the same directory: give a path they
    /// all see (a relative one is made absolute here, for workers started elsewhere).
    pub fn save(&self, dir: &Path, step: u64, driver: serde_json::Value) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).map_err(|source| CheckpointError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let dir = &std::path::absolute(dir).map_err(|source| CheckpointError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let existing = checkpoint::step_dir(dir, step).join("MANIFEST.json");
        if existing.exists() {
            return Err(CheckpointError::Exists(existing).into());
        }
        let dir_s = dir.to_string_lossy().into_owned();
        let writes: Vec<_> = self
            .route
            .iter()
            .map(|&(w, id)| self.agent.call_async(w, stage::H_SAVE, &(id, dir_s.clone(), step)))
            .collect();
        let mut shards = Vec::new();
        let mut first_error = None;
        for w in writes {
            match w.wait().and_then(|p| p.decode::<Vec<checkpoint::ShardEntry>>()) {
                Ok(s) => shards.extend(s),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e.into());
        }
        let manifest = Manifest {
            format: checkpoint::FORMAT,
            step,
            model: self.model.clone(),
            seed: self.options.seed,
            dtype: self.options.dtype,
            optimizer: self.options.optimizer,
            shards,
            driver,
        };
        Ok(checkpoint::commit(dir, &manifest)?)
    }

    /// Rebuilds a pipeline from the newest complete checkpoint in `dir`, on `placements` with
    /// `partition` (any: shards are per layer). Every shard is checked before any is loaded.
    pub fn restore(
        agent: &Agent,
        dir: &Path,
        placements: &[&str],
        partition: Partition,
        options: PipelineOptions,
    ) -> Result<(Pipeline, Manifest)> {
        let dir = &std::path::absolute(dir).map_err(|source| CheckpointError::Io {
            path: dir.to_owned(),
            source,
        })?;
        let manifest = checkpoint::latest(dir)?;
        checkpoint::verify(dir, &manifest)?;
        if manifest.dtype != options.dtype || !same_optimizer(&manifest.optimizer, &options.optimizer) {
            return Err(PipelineError::Unsupported(format!(
                "the checkpoint was saved with {:?} and {:?}; restoring asks for {:?} and {:?}",
                manifest.dtype, manifest.optimizer, options.dtype, options.optimizer
            )));
        }
        let options = PipelineOptions {
            seed: manifest.seed,
            ..options
        };
        let p = Pipeline::new(agent, manifest.model.clone(), placements, partition, options)?;
        let dir_s = dir.to_string_lossy().into_owned();
        // Every stage loads what the driver verified: the manifest travels with the request.
        let json = serde_json::to_string(&manifest).map_err(|e| CheckpointError::Tensor(e.to_string()))?;
        for &(w, id) in &p.route {
            let () = agent.call(w, stage::H_LOAD, &(id, dir_s.clone(), json.clone()))?;
        }
        Ok((p, manifest))
    }

    /// Fault injection for tests: stage `i` pauses before each shard it writes.
    pub fn pause_saves(&self, stage: usize, pause_ms: u64) -> Result<()> {
        let (w, id) = self.route[stage];
        Ok(self.agent.call(w, stage::H_FAULT, &(id, pause_ms))?)
    }

    /// Seconds each stage has spent computing so far (forward, backward). A worker's backward
    /// time counts every backward it ran, so give each stage a worker of its own (the driver's
    /// share of the loss's backward is small). Differences over a run give the stages' busy
    /// time, and [`measured_bubble`] the idle fraction.
    pub fn busy(&self) -> Result<Vec<(f64, f64)>> {
        let mut out = Vec::with_capacity(self.route.len());
        for &(w, id) in &self.route {
            let (f, b): (u64, u64) = self.agent.call(w, stage::H_BUSY, &id)?;
            out.push((f as f64 * 1e-9, b as f64 * 1e-9));
        }
        Ok(out)
    }

    /// What one mini-batch's activations hold on each stage: every forward runs first (as in
    /// GPipe) and each stage's resident memory is read before them and again once all are done,
    /// before any backward; then the backward runs and nothing is stepped. Large tensors are
    /// mapped and unmapped as whole pages, so the difference is the saved tensors' bytes
    /// (tensors of a few KiB may hide in the allocator's free lists).
    pub fn activation_memory(&self, x: &Tensor, y: &Tensor) -> Result<Vec<i64>> {
        let n = x.shape()[0];
        let sizes = self.sizes(n);
        let xs = x.split(&sizes, 0)?;
        let ys = y.split(&sizes, 0)?;
        let context = Context::new(&self.agent)?;
        let before = self.memory()?;
        let futures = xs.iter().map(|m| self.start(m, None)).collect::<Result<Vec<_>>>()?;
        let outs = futures
            .into_iter()
            .map(|f| f.wait())
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let after = self.memory()?;
        let losses = outs
            .iter()
            .zip(&ys)
            .zip(&sizes)
            .map(|((o, y), &k)| cross_entropy(o, y)?.mul_scalar(k as f64 / n as f64))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        context.backward(&losses, false)?;
        context.release()?;
        Ok(before
            .iter()
            .zip(&after)
            .map(|(b, a)| a.1 as i64 - b.1 as i64)
            .collect())
    }

    /// Each stage's worker process: (peak, current) resident memory in bytes.
    pub fn memory(&self) -> Result<Vec<(u64, u64)>> {
        let mut out = Vec::with_capacity(self.route.len());
        for &(w, _) in &self.route {
            out.push(self.agent.call(w, stage::H_MEMORY, &())?);
        }
        Ok(out)
    }

    /// The placements, in stage order.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        for &(w, id) in &self.route {
            drop(self.agent.call_async(w, stage::H_DROP, &id));
        }
    }
}

/// Whether two optimizer settings are the same rule (the saved state means the same thing).
fn same_optimizer(a: &OptimizerKind, b: &OptimizerKind) -> bool {
    match (a, b) {
        (OptimizerKind::Sgd { momentum: m1, .. }, OptimizerKind::Sgd { momentum: m2, .. }) => {
            (m1 == &0.0) == (m2 == &0.0)
        }
        (OptimizerKind::Adam { .. }, OptimizerKind::Adam { .. }) => true,
        _ => false,
    }
}

/// The idle fraction of a pipeline over `seconds` of wall time, from each stage's busy time
/// at the start and the end ([`Pipeline::busy`]): 1 − Σ busy / (stages × seconds).
pub fn measured_bubble(before: &[(f64, f64)], after: &[(f64, f64)], seconds: f64) -> f64 {
    let busy: f64 = before.iter().zip(after).map(|(b, a)| (a.0 - b.0) + (a.1 - b.1)).sum();
    1.0 - busy / (after.len() as f64 * seconds)
}

/// The process id of `worker` (tests that kill a worker mid-save need it).
pub fn worker_pid(agent: &Agent, worker: &str) -> Result<u32> {
    Ok(agent.call(worker, stage::H_PID, &())?)
}
