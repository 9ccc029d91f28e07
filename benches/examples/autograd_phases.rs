//! Where a distributed training step's time goes beyond the local step: the step of `sluice
//! bench autograd` (Linear 1024², batch 32, SGD, the layer on a second process), timed phase by
//! phase (forward call, distributed backward, optimizer step, context release), next to the
//! local step's phases, medians over a fixed time; then the same step with the optimizer's
//! step taken in the backward's answer (`DistributedOptimizer::backward_and_step`).
//!
//! `cargo run --release -p sluice-benches --example autograd_phases -- [SECONDS] [dist]`: with
//! `dist`, only the distributed step runs after the local one (for a profiler).
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice_agent::{Agent, RRef};
use sluice_autograd::dist::{self, Context};
use sluice_autograd::{linear, DType, DistributedOptimizer, Optimizer, OptimizerKind, Parameter, Tensor, UpdateMode};

const LR: f64 = 1e-3;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `phases` repeatedly for `seconds`, each phase timed; prints the medians (µs).
fn timed<const N: usize>(label: &str, names: [&str; N], seconds: f64, mut step: impl FnMut(&mut [Instant; N])) {
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); N + 1];
    for _ in 0..20 {
        step(&mut [Instant::now(); N]);
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        let t0 = Instant::now();
        let mut marks = [t0; N];
        step(&mut marks);
        let end = Instant::now();
        let mut prev = t0;
        for (i, m) in marks.iter().enumerate() {
            samples[i].push(m.duration_since(prev).as_secs_f64() * 1e6);
            prev = *m;
        }
        samples[N].push(end.duration_since(t0).as_secs_f64() * 1e6);
    }
    let mut line = format!("{label}: {:.1} µs", median(&mut samples[N]));
    for (i, n) in names.iter().enumerate() {
        line += &format!(", {n} {:.0}", median(&mut samples[i]));
    }
    println!("{line} ({} steps)", samples[N].len());
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("peer") {
        return sluice_benches::rpc::worker(&args[2]);
    }
    let seconds: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let only_dist = args.get(2).map(String::as_str) == Some("dist");
    let scale = 1.0 / 32.0;
    let local = [
        Parameter::new("weight", Tensor::uniform(&[1024, 1024], -scale, scale, 1, DType::F32)?),
        Parameter::new("bias", Tensor::uniform(&[1024], -scale, scale, 2, DType::F32)?),
    ];
    let x = Tensor::randn(&[32, 1024], 1.0, 5, DType::F32)?;
    let opt = Optimizer::new(OptimizerKind::sgd(LR), local.to_vec(), UpdateMode::Locked);
    let loss = |y: &Tensor| y.mul(y).and_then(|z| z.mean());
    timed("local", ["forward", "backward", "step"], seconds, |m| {
        let y = linear(&x, &local[0].tensor(), Some(&local[1].tensor())).unwrap();
        m[0] = Instant::now();
        loss(&y).unwrap().backward().unwrap();
        m[1] = Instant::now();
        opt.step().unwrap();
        m[2] = Instant::now();
    });

    let store = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.to_string();
    let mut child = Command::new(std::env::current_exe()?)
        .args(["peer", &store])
        .stdin(Stdio::null())
        .spawn()?;
    let agent = Agent::init(
        sluice_benches::rpc::agent_options("bench", "bench-peer", 0, &store),
        sluice_benches::rpc::registry(),
    )?;
    // The calls the step is made of, on their own: an empty one, and the forward's 128 KiB
    // each way (the batch, the activations) through a handler that only echoes.
    let batch = sluice_agent::Payload::empty().with_tensors(vec![sluice_channel::Tensor::cpu(bytes::Bytes::from(
        vec![1u8; 128 << 10],
    ))]);
    if !only_dist {
        timed("rpc_sync no-op", [], seconds, |_| {
            agent.rpc_sync(1u32, "noop", sluice_agent::Payload::empty()).unwrap();
        });
        timed("rpc_sync echo 128 KiB", [], seconds, |_| {
            agent.rpc_sync(1u32, "echo", batch.clone()).unwrap();
        });
        timed("rpc_sync of a handler that spins 500 µs", [], seconds, |_| {
            agent.rpc_sync(1u32, "work", sluice_agent::Payload::empty()).unwrap();
        });
    }
    let rrefs: Vec<RRef<Parameter>> = agent.call(1u32, "bench.linear_params", &())?;
    let dopt = DistributedOptimizer::new(&agent, OptimizerKind::sgd(LR), &rrefs, UpdateMode::Locked)?;
    timed(
        "distributed",
        ["forward", "loss", "backward", "step", "release"],
        seconds,
        |m| {
            let ctx = Context::new(&agent).unwrap();
            let y: Tensor = dist::rpc_sync(&agent, 1u32, "bench.linear", &x).unwrap();
            m[0] = Instant::now();
            let l = loss(&y).unwrap();
            m[1] = Instant::now();
            ctx.backward(&[l], false).unwrap();
            m[2] = Instant::now();
            dopt.step(ctx.id()).unwrap();
            m[3] = Instant::now();
            drop(ctx);
            m[4] = Instant::now();
        },
    );
    if !only_dist {
        in_turns(&agent, &dopt, &x, seconds);
    }
    drop(dopt);
    agent.shutdown()?;
    child.wait()?;
    Ok(())
}

fn in_turns(agent: &Agent, dopt: &DistributedOptimizer, x: &Tensor, seconds: f64) {
    let loss = |y: &Tensor| y.mul(y).and_then(|z| z.mean());
    // The same step with the optimizer's step in the backward's answer, in turns with the
    // two-call step, so that a slow spell of the host falls on both alike.
    let step = |fused: bool| {
        let t0 = Instant::now();
        let ctx = Context::new(agent).unwrap();
        let y: Tensor = dist::rpc_sync(agent, 1u32, "bench.linear", x).unwrap();
        let l = loss(&y).unwrap();
        if fused {
            dopt.backward_and_step(&ctx, &[l]).unwrap();
        } else {
            ctx.backward(&[l], false).unwrap();
            dopt.step(ctx.id()).unwrap();
        }
        drop(ctx);
        t0.elapsed().as_secs_f64() * 1e6
    };
    let (mut apart, mut fused) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        apart.push(step(false));
        fused.push(step(true));
    }
    println!(
        "in turns: backward then step {:.1} µs, step in the backward's answer {:.1} µs ({} each)",
        median(&mut apart),
        median(&mut fused),
        fused.len()
    );
}
