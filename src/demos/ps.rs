//! Parameter server: rank 0 holds an MLP's parameters; trainers run its forward on the server
//! through RPC, compute the loss locally, and run the distributed backward, so gradients for
//! the parameters accumulate on the server in each trainer's context.
//!
//! - **Hogwild** (no reducer): each trainer's [`DistributedOptimizer`] steps the shared
//!   parameters as soon as its backward is done, lock-free.
//! - **Synchronous** (a reducer): each round, every trainer hands its context to the server,
//!   which combines the gradients of all trainers with the reducer (mean or elementwise
//!   median), applies one SGD step, and releases everyone into the next round.
//!
//! With `--gpu` the server keeps its parameters on `cuda:0` and runs the forward, the
//! backward and every optimizer step there (cuBLAS and NVRTC kernels). Trainers stay on the
//! CPU: their inputs are moved onto the GPU inside the server's forward and the logits back
//! off it, both recorded, so the distributed backward crosses the host boundary on its own
//! and the gradients land on the GPU beside the parameters. No device map is needed.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use sluice_agent::{with_priority, Agent, CallContext, Priority, RRef, Registry};
use sluice_autograd::dist::{self, Context};
use sluice_autograd::{
    accuracy, cross_entropy, linear, DistributedOptimizer, LeafId, Optimizer, OptimizerKind, Parameter, Tensor,
    UpdateMode,
};
use sluice_channel::Device;

use super::data::{mlp_init, spirals, Split};
use super::{agent_options, handler_error, Demo};

pub(crate) const HIDDEN: usize = 64;
pub(crate) const BATCH: usize = 32;
pub(crate) const LR: f64 = 0.3;

/// How the synchronous mode combines the trainers' gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reducer {
    Mean,
    Median,
}

impl std::str::FromStr for Reducer {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mean" => Ok(Reducer::Mean),
            "median" => Ok(Reducer::Median),
            _ => Err(format!("unknown reducer `{s}`: mean or median")),
        }
    }
}

impl Reducer {
    /// Combines one gradient per trainer, elementwise.
    pub fn reduce(self, grads: &[Tensor]) -> sluice_autograd::Result<Tensor> {
        let values: Vec<Vec<f64>> = grads
            .iter()
            .map(|g| g.to_dense()?.to_f64_vec())
            .collect::<Result<_, _>>()?;
        let n = values[0].len();
        let out: Vec<f32> = (0..n)
            .map(|i| {
                let mut column: Vec<f64> = values.iter().map(|v| v[i]).collect();
                (match self {
                    Reducer::Mean => column.iter().sum::<f64>() / column.len() as f64,
                    Reducer::Median => {
                        column.sort_by(f64::total_cmp);
                        let m = column.len() / 2;
                        if column.len() % 2 == 1 {
                            column[m]
                        } else {
                            (column[m - 1] + column[m]) / 2.0
                        }
                    }
                }) as f32
            })
            .collect();
        Tensor::from_vec(out, grads[0].shape())
    }
}

/// Where the server keeps its parameters (set once, before the model is made).
static DEVICE: OnceLock<Device> = OnceLock::new();

fn device() -> Device {
    *DEVICE.get().unwrap_or(&Device::Cpu)
}

fn model() -> &'static [Parameter] {
    static M: OnceLock<Vec<Parameter>> = OnceLock::new();
    M.get_or_init(|| {
        let names = ["w1", "b1", "w2", "b2"];
        mlp_init(HIDDEN, 7)
            .into_iter()
            .zip(names)
            .map(|(t, n)| {
                // `run` checked that the device works before anything calls `model`.
                let t = t.to_device(device()).expect("parameters move to the checked device");
                Parameter::new(n, t)
            })
            .collect()
    })
}

pub(crate) fn mlp(x: &Tensor, p: &[Tensor]) -> sluice_autograd::Result<Tensor> {
    let h = linear(x, &p[0], Some(&p[1]))?.relu()?;
    linear(&h, &p[2], Some(&p[3]))
}

/// One synchronous round on the server.
#[derive(Default)]
struct Round {
    grads: Vec<HashMap<LeafId, Tensor>>,
    generation: u64,
}

static ROUND: Mutex<Round> = Mutex::new(Round {
    grads: Vec::new(),
    generation: 0,
});
static ROUND_DONE: Condvar = Condvar::new();

fn sync_step(trainers: usize, context: u64, reducer: Reducer) -> sluice_autograd::Result<()> {
    let grads = dist::get_gradients(context)?;
    let mut round = ROUND.lock().unwrap();
    round.grads.push(grads);
    if round.grads.len() < trainers {
        let generation = round.generation;
        // Hand this pool thread's slot over while it waits for the other trainers.
        let _round =
            sluice_agent::pool::blocking(|| ROUND_DONE.wait_while(round, |r| r.generation == generation).unwrap());
        return Ok(());
    }
    let all = std::mem::take(&mut round.grads);
    let mut reduced = HashMap::new();
    for p in model() {
        let per_trainer: Vec<Tensor> = all.iter().filter_map(|g| g.get(&p.id()).cloned()).collect();
        if !per_trainer.is_empty() {
            reduced.insert(p.id(), reducer.reduce(&per_trainer)?);
        }
    }
    Optimizer::new(OptimizerKind::sgd(LR), model().to_vec(), UpdateMode::Locked).step_with(&reduced)?;
    round.generation += 1;
    ROUND_DONE.notify_all();
    Ok(())
}

fn registry(trainers: usize) -> Registry {
    let mut r = Registry::new();
    dist::install(&mut r);
    dist::function(&mut r, "forward", |_cx: &CallContext, x: Tensor| {
        let params: Vec<Tensor> = model().iter().map(Parameter::tensor).collect();
        // On a GPU server: in and out through the host, recorded for the backward.
        x.to_device(device())
            .and_then(|x| mlp(&x, &params))
            .and_then(|y| y.to_device(Device::Cpu))
            .map_err(handler_error)
    });
    r.handler("param_rrefs", |cx: &CallContext, (): ()| {
        Ok(model()
            .iter()
            .map(|p| cx.agent.rref(p.clone()))
            .collect::<Vec<RRef<Parameter>>>())
    })
    .handler(
        "sync_step",
        move |_cx: &CallContext, (context, reducer): (u64, Reducer)| {
            sync_step(trainers, context, reducer).map_err(handler_error)
        },
    );
    r
}

fn evaluate(test: &Split) -> sluice_autograd::Result<f64> {
    let params: Vec<Tensor> = model().iter().map(Parameter::data).collect();
    let (x, y) = test.batch(0..test.len());
    accuracy(&mlp(&x.to_device(device())?, &params)?, &y)
}

fn train(
    agent: &Agent,
    rank: u32,
    trainers: u32,
    epochs: u32,
    reducer: Option<Reducer>,
    pull: Priority,
) -> anyhow::Result<f64> {
    let (train, _) = spirals(300, 1);
    let shard = train.shard(rank as usize - 1, trainers as usize);
    let rrefs: Vec<RRef<Parameter>> = agent.call(0u32, "param_rrefs", &())?;
    let opt = DistributedOptimizer::new(agent, OptimizerKind::sgd(LR), &rrefs, UpdateMode::Hogwild)?;
    let batches = shard.len() / BATCH;
    let mut last = 0.0;
    for _ in 0..epochs {
        let mut total = 0.0;
        for b in 0..batches {
            let (x, y) = shard.batch(b * BATCH..(b + 1) * BATCH);
            let ctx = Context::new(agent)?;
            let logits: Tensor = with_priority(pull, || dist::rpc_sync(agent, 0u32, "forward", &x))?;
            let loss = cross_entropy(&logits, &y)?;
            total += loss.item()?;
            ctx.backward(&[loss], false)?;
            match reducer {
                None => opt.step(ctx.id())?,
                Some(reducer) => agent.call::<_, ()>(0u32, "sync_step", &(ctx.id(), reducer))?,
            }
        }
        last = total / batches.max(1) as f64;
    }
    Ok(last)
}

pub fn run(demo: &Demo, rank: u32) -> anyhow::Result<()> {
    let Demo::Ps {
        trainers,
        epochs,
        reducer,
        gpu,
        urgent_pulls,
    } = *demo
    else {
        unreachable!()
    };
    if gpu && rank == 0 {
        sluice_autograd::cuda::available().map_err(|e| anyhow::anyhow!("--gpu needs CUDA, NVRTC and cuBLAS: {e}"))?;
        let _ = DEVICE.set(Device::Cuda(0));
    }
    let agent = Agent::init(agent_options(demo.worker_name(rank)), registry(trainers as usize))?;
    if rank == 0 {
        let (train, test) = spirals(300, 1);
        let before = evaluate(&test)?;
        let start = Instant::now();
        agent.barrier("trained")?;
        let after = evaluate(&test)?;
        let mode = match reducer {
            None => "Hogwild (asynchronous)".to_owned(),
            Some(r) => format!("synchronous, {r:?} reducer"),
        };
        let mut mode = format!("{mode}, parameters on {}", device());
        if urgent_pulls {
            mode += ", urgent pulls";
        }
        if let (Device::Cuda(_), Some(model)) = (device(), sluice_channel::cuda::driver::model()) {
            // Timings there are the model's, not a GPU's.
            mode += &format!(" [the CUDA driver model {model}, not a GPU: times are not a GPU's]");
        }
        // Each trainer's steps (the smallest shard's count, as every trainer takes its own).
        let per_trainer = (0..trainers as usize)
            .map(|t| train.shard(t, trainers as usize).len() / BATCH)
            .min()
            .unwrap_or(0);
        let steps = (epochs as usize * per_trainer).max(1);
        let elapsed = start.elapsed().as_secs_f64();
        println!(
            "parameter server, {mode}: {trainers} trainers × {epochs} epochs in {elapsed:.1} s ({:.2} ms a step); held-out accuracy {:.1}% → {:.1}%",
            elapsed * 1e3 / steps as f64,
            before * 100.0,
            after * 100.0
        );
    } else {
        let pull = if urgent_pulls { Priority::HIGH } else { Priority::NORMAL };
        let loss = train(&agent, rank, trainers, epochs, reducer, pull)?;
        println!("trainer{rank}: final epoch mean loss {loss:.4}");
        agent.barrier("trained")?;
    }
    agent.shutdown()?;
    Ok(())
}
