//! `sluice bench autograd`: one training step of a remote Linear(1024, 1024) at batch 32
//! (forward through RPC, distributed backward, distributed optimizer step, context release)
//! against the same step run locally in this process; and CPU matmul throughput through
//! `Tensor::matmul` against `matrixmultiply`'s own GEMM on the same buffers.
//!
//! With a GPU (and NVRTC and cuBLAS) the same step runs again with the layer's parameters on
//! `cuda:0` in both processes and the input on this process's `cuda:0` (mapped `cuda:0 →
//! cuda:0`), against the same step run locally on the GPU. Each step ends by reading the loss
//! back, so GPU work is finished, not just queued, when a step is timed.
//!
//! Remote tensors placed on the peer: a chain of 100 elementwise ops and a matmul on a 1 MiB
//! tensor, fused into one call (`remote-fused-…`) and with one call per op (`remote-per-op-…`),
//! both against the chain run locally plus one no-op round trip (`local+rtt-…`); and the same
//! training step written with remote tensors (`remote-step-…`) against the local step.
//!
//! The remote side is the rpc suite's second process (its registry includes [`serve`]).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sluice_agent::{Agent, CallContext, HandlerError, RRef, Registry};
use sluice_autograd::dist::{self, Context};
use sluice_autograd::{
    linear, DType, DistributedOptimizer, Optimizer, OptimizerKind, Parameter, RemoteTensor, Tensor, UpdateMode,
};

use crate::report::Record;
use crate::run::BenchOptions;

const IN: usize = 1024;
const OUT: usize = 1024;
const BATCH: usize = 32;
const LR: f64 = 1e-3;

fn layer() -> &'static [Parameter] {
    static P: OnceLock<Vec<Parameter>> = OnceLock::new();
    P.get_or_init(|| {
        let scale = 1.0 / (IN as f64).sqrt();
        vec![
            Parameter::new(
                "weight",
                Tensor::uniform(&[OUT, IN], -scale, scale, 1, DType::F32).expect("init"),
            ),
            Parameter::new(
                "bias",
                Tensor::uniform(&[OUT], -scale, scale, 2, DType::F32).expect("init"),
            ),
        ]
    })
}

/// The same layer with its parameters on the GPU (one copy per process).
fn gpu_layer() -> sluice_autograd::Result<&'static [Parameter]> {
    static P: OnceLock<Vec<Parameter>> = OnceLock::new();
    if let Some(p) = P.get() {
        return Ok(p);
    }
    let moved = layer()
        .iter()
        .map(|p| {
            Ok(Parameter::new(
                p.name(),
                p.data().to_device(sluice_channel::Device::Cuda(0))?,
            ))
        })
        .collect::<sluice_autograd::Result<Vec<_>>>()?;
    Ok(P.get_or_init(|| moved))
}

fn forward(x: &Tensor, p: &[Parameter]) -> sluice_autograd::Result<Tensor> {
    linear(x, &p[0].tensor(), Some(&p[1].tensor()))
}

/// The remote layer's functions, added to the bench peer's registry.
pub fn serve(r: &mut Registry) {
    dist::install(r);
    dist::function(r, "bench.linear", |_cx: &CallContext, x: Tensor| {
        forward(&x, layer()).map_err(|e| HandlerError::new("Error", e.to_string()))
    });
    r.handler("bench.linear_params", |cx: &CallContext, (): ()| {
        Ok(layer()
            .iter()
            .map(|p| cx.agent.rref(p.clone()))
            .collect::<Vec<RRef<Parameter>>>())
    });
    let he = |e: sluice_autograd::Error| HandlerError::new("Error", e.to_string());
    dist::function(r, "bench.linear_gpu", move |_cx: &CallContext, x: Tensor| {
        forward(&x, gpu_layer().map_err(he)?).map_err(he)
    });
    r.handler("bench.linear_gpu_params", move |cx: &CallContext, (): ()| {
        Ok(gpu_layer()
            .map_err(he)?
            .iter()
            .map(|p| cx.agent.rref(p.clone()))
            .collect::<Vec<RRef<Parameter>>>())
    });
}

fn loss(y: &Tensor) -> sluice_autograd::Result<Tensor> {
    y.mul(y)?.mean()
}

fn samples(budget: Duration, mut step: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Vec<f64>> {
    for _ in 0..3 {
        step()?; // warm-up: allocator, page faults, pipes
    }
    let mut out = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || out.len() < 5 {
        let t0 = Instant::now();
        step()?;
        out.push(t0.elapsed().as_nanos() as f64);
    }
    Ok(out)
}

fn matmul_gflops(n: usize, budget: Duration) -> anyhow::Result<(Record, Record)> {
    let a = Tensor::randn(&[n, n], 1.0, 3, DType::F32)?;
    let b = Tensor::randn(&[n, n], 1.0, 4, DType::F32)?;
    let flops = 2.0 * (n * n * n) as f64;
    let (av, bv) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    let raw = samples(budget, || {
        std::hint::black_box(sluice_autograd::cpu::gemm::sgemm(
            n,
            n,
            n,
            (&av, 0, n as isize, 1),
            (&bv, 0, n as isize, 1),
        ));
        Ok(())
    })?;
    let ours = samples(budget, || {
        std::hint::black_box(a.matmul(&b)?);
        Ok(())
    })?;
    let best = |s: &[f64]| s.iter().copied().fold(f64::INFINITY, f64::min);
    let base = Record::gflops(
        "autograd",
        format!("matrixmultiply-sgemm-{n}"),
        flops / best(&raw),
        raw.len() as u64,
    );
    let mut mine = Record::gflops(
        "autograd",
        format!("tensor-matmul-{n}"),
        flops / best(&ours),
        ours.len() as u64,
    );
    mine.against(&base);
    Ok((base, mine))
}

/// Runs the suite against the bench peer (rank 1) given the store address it joined.
pub fn run(
    options: &BenchOptions,
    spawn_worker: impl FnOnce(&str) -> anyhow::Result<Box<dyn std::any::Any>>,
) -> anyhow::Result<Vec<Record>> {
    let budget = options.budget() * 3;
    let mut out = Vec::new();
    for n in if options.quick { vec![256] } else { vec![256, 1024] } {
        let (base, mine) = matmul_gflops(n, budget)?;
        out.push(base);
        out.push(mine);
    }

    // Local step: same layer, same loss, same optimizer, in this process.
    let local: Vec<Parameter> = layer().iter().map(|p| Parameter::new(p.name(), p.data())).collect();
    let opt = Optimizer::new(OptimizerKind::sgd(LR), local.clone(), UpdateMode::Locked);
    let x = Tensor::randn(&[BATCH, IN], 1.0, 5, DType::F32)?;
    let local_samples = samples(budget, || {
        loss(&forward(&x, &local)?)?.backward()?;
        opt.step()?;
        Ok(())
    })?;
    let base = Record::rtt("autograd", "local-step-linear1024-b32", 0, local_samples);

    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let store = format!("127.0.0.1:{port}");
    let _worker = spawn_worker(&store)?;
    let agent = Agent::init(
        crate::rpc::agent_options("bench", "bench-peer", 0, &store),
        crate::rpc::registry(),
    )?;
    let rrefs: Vec<RRef<Parameter>> = agent.call(1u32, "bench.linear_params", &())?;
    let dopt = DistributedOptimizer::new(&agent, OptimizerKind::sgd(LR), &rrefs, UpdateMode::Locked)?;
    let dist_samples = samples(budget, || {
        let ctx = Context::new(&agent)?;
        let y: Tensor = dist::rpc_sync(&agent, 1u32, "bench.linear", &x)?;
        ctx.backward(&[loss(&y)?], false)?;
        dopt.step(ctx.id())?;
        // Leaving the context sends its release without waiting for the answer (as PyTorch's
        // `with dist_autograd.context()` does).
        drop(ctx);
        Ok(())
    })?;
    let mut r = Record::rtt("autograd", "dist-step-linear1024-b32", 0, dist_samples);
    r.against(&base);
    // The same step with the optimizer's step taken in the backward's answer.
    let fused_samples = samples(budget, || {
        let ctx = Context::new(&agent)?;
        let y: Tensor = dist::rpc_sync(&agent, 1u32, "bench.linear", &x)?;
        dopt.backward_and_step(&ctx, &[loss(&y)?])?;
        drop(ctx);
        Ok(())
    })?;
    let mut fused = Record::rtt("autograd", "dist-step-fused-linear1024-b32", 0, fused_samples);
    fused.against(&base);
    drop(dopt);
    let remote = remote_rows(&agent, &x, &base, budget)?;
    out.push(base);
    out.push(r);
    out.push(fused);
    out.extend(remote);
    if crate::rpc::gpu().is_some() {
        match sluice_autograd::cuda::available() {
            Ok(()) => out.extend(gpu_steps(&agent, budget)?),
            Err(e) => eprintln!("autograd on CUDA skipped: {e}"),
        }
    }
    agent.shutdown()?;
    Ok(out)
}

/// Elementwise operations in the remote-tensor chain (then one matmul and a sum).
const CHAIN: usize = 100;
/// The chain's tensor: 512 × 512 f32, 1 MiB.
const SIDE: usize = 512;

/// Operation `i` of the chain, for either kind of tensor.
macro_rules! chain_op {
    ($t:expr, $i:expr) => {
        match $i % 4 {
            0 => $t.mul_scalar(0.999),
            1 => $t.add_scalar(0.001),
            2 => $t.relu(),
            _ => $t.mul_scalar(1.001),
        }
    };
}

/// Remote tensors on the peer (`to("bench-peer/cpu")`): a chain of 100 elementwise ops and a
/// matmul on a 1 MiB tensor, fused into one call against one call per op, both against the
/// same chain run locally plus one no-op round trip; and the Linear(1024, 1024) training step
/// written with remote tensors against the local step (`base`).
fn remote_rows(agent: &Agent, x: &Tensor, base: &Record, budget: Duration) -> anyhow::Result<Vec<Record>> {
    let a = Tensor::uniform(&[SIDE, SIDE], -1.0, 1.0, 6, DType::F32)?;
    let m = Tensor::uniform(&[SIDE, SIDE], -0.05, 0.05, 7, DType::F32)?;
    let local = samples(budget, || {
        let mut t = a.clone();
        for i in 0..CHAIN {
            t = chain_op!(t, i)?;
        }
        std::hint::black_box(t.matmul(&m)?.sum()?.item()?);
        Ok(())
    })?;
    let rtt = samples(budget, || {
        agent.call::<_, ()>(1u32, "noop", &())?;
        Ok(())
    })?;
    let mut sorted = rtt.clone();
    sorted.sort_by(f64::total_cmp);
    let rtt_p50 = sorted[sorted.len() / 2];
    let name = |kind: &str| format!("{kind}-chain{CHAIN}-mm-{SIDE}");
    let plus_rtt: Vec<f64> = local.iter().map(|t| t + rtt_p50).collect();
    let chain_base = Record::rtt("autograd", name("local+rtt"), SIDE * SIDE * 4, plus_rtt);
    let (ra, rm) = (
        a.to_remote(agent, "bench-peer/cpu")?,
        m.to_remote(agent, "bench-peer/cpu")?,
    );
    ra.sync()?;
    rm.sync()?;
    let run = |per_op: bool| {
        samples(budget, || {
            let mut t = ra.clone();
            for i in 0..CHAIN {
                t = chain_op!(t, i)?;
                if per_op {
                    t.sync()?;
                }
            }
            std::hint::black_box(t.matmul(&rm)?.sum()?.item()?);
            Ok(())
        })
    };
    let mut fused = Record::rtt("autograd", name("remote-fused"), SIDE * SIDE * 4, run(false)?);
    let mut per_op = Record::rtt("autograd", name("remote-per-op"), SIDE * SIDE * 4, run(true)?);
    fused.against(&chain_base);
    per_op.against(&chain_base);

    // The training step, written with remote tensors.
    let w = RemoteTensor::parameter(agent, "bench-peer/cpu", "weight", &layer()[0].data())?;
    let b = RemoteTensor::parameter(agent, "bench-peer/cpu", "bias", &layer()[1].data())?;
    let dopt = DistributedOptimizer::new(
        agent,
        OptimizerKind::sgd(LR),
        &[
            w.param_rref().expect("a parameter"),
            b.param_rref().expect("a parameter"),
        ],
        UpdateMode::Locked,
    )?;
    let steps = samples(budget, || {
        let ctx = Context::new(agent)?;
        let loss = ctx.run(|| -> anyhow::Result<Tensor> {
            let y = x.to_remote(agent, "bench-peer/cpu")?.linear(&w, Some(&b))?;
            Ok(y.mul(&y)?.mean()?.to_here()?)
        })?;
        ctx.backward(&[loss], false)?;
        dopt.step(ctx.id())?;
        drop(ctx);
        Ok(())
    })?;
    let mut step = Record::rtt("autograd", "remote-step-linear1024-b32", 0, steps);
    step.against(base);
    Ok(vec![chain_base, per_op, fused, step])
}

/// The step with CUDA parameters, locally and through the peer.
fn gpu_steps(agent: &Agent, budget: Duration) -> anyhow::Result<Vec<Record>> {
    let gpu = sluice_channel::Device::Cuda(0);
    eprintln!("autograd: the Linear(1024,1024) step on cuda:0, locally then through the peer");
    let local: Vec<Parameter> = gpu_layer()?
        .iter()
        .map(|p| Parameter::new(p.name(), p.data()))
        .collect();
    let opt = Optimizer::new(OptimizerKind::sgd(LR), local.clone(), UpdateMode::Locked);
    let x = Tensor::randn(&[BATCH, IN], 1.0, 5, DType::F32)?.to_device(gpu)?;
    let local_samples = samples(budget, || {
        let l = loss(&forward(&x, &local)?)?;
        l.backward()?;
        opt.step()?;
        l.item()?;
        Ok(())
    })?;
    let base = Record::rtt("autograd", "local-step-linear1024-b32/cuda:0", 0, local_samples);
    let rrefs: Vec<RRef<Parameter>> = agent.call(1u32, "bench.linear_gpu_params", &())?;
    let dopt = DistributedOptimizer::new(agent, OptimizerKind::sgd(LR), &rrefs, UpdateMode::Locked)?;
    let dist_samples = samples(budget, || {
        let ctx = Context::new(agent)?;
        let y: Tensor = dist::rpc_sync(agent, 1u32, "bench.linear_gpu", &x)?;
        let l = loss(&y)?;
        ctx.backward(std::slice::from_ref(&l), false)?;
        dopt.step(ctx.id())?;
        l.item()?;
        drop(ctx);
        Ok(())
    })?;
    let mut r = Record::rtt("autograd", "dist-step-linear1024-b32/cuda:0", 0, dist_samples);
    r.against(&base);
    Ok(vec![base, r])
}
