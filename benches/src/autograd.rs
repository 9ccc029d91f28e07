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
//! The remote side is the rpc suite's second process (its registry includes [`serve`]).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sluice_agent::{Agent, CallContext, HandlerError, RRef, Registry};
use sluice_autograd::dist::{self, Context};
use sluice_autograd::{linear, DType, DistributedOptimizer, Optimizer, OptimizerKind, Parameter, Tensor, UpdateMode};

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
    let mut c = vec![0f32; n * n];
    let raw = samples(budget, || {
        sluice_autograd::cpu::gemm::sgemm(n, n, n, (&av, 0, n as isize, 1), (&bv, 0, n as isize, 1), &mut c);
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
    out.push(base);
    out.push(r);
    drop(dopt);
    if crate::rpc::gpu().is_some() {
        match sluice_autograd::cuda::available() {
            Ok(()) => out.extend(gpu_steps(&agent, budget)?),
            Err(e) => eprintln!("autograd on CUDA skipped: {e}"),
        }
    }
    agent.shutdown()?;
    Ok(out)
}

/// The step with CUDA parameters, locally and through the peer.
fn gpu_steps(agent: &Agent, budget: Duration) -> anyhow::Result<Vec<Record>> {
    let gpu = sluice_channel::Device::Cuda(0);
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
