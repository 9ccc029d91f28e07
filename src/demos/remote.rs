//! Remote tensors: the parameter server's model written once against tensors placed with
//! `to("worker1/cpu")` and trained from rank 0, while every operation runs on worker 1.
//!
//! Rank 0 holds only the data. Each step places the batch on worker 1, records the forward
//! (two linear layers and a cross-entropy) and fetches the loss: one fused call; the backward
//! runs on worker 1 inside distributed autograd and the distributed optimizer updates the
//! parameters there. With `--per-op` each operation is its own call (a flush and a wait after
//! every op), which is what a remote tensor without fusion costs.

use std::time::Instant;

use sluice_agent::{Agent, Registry};
use sluice_autograd::dist::{self, remote, Context};
use sluice_autograd::{accuracy, DistributedOptimizer, OptimizerKind, RemoteTensor, UpdateMode};

use super::data::{mlp_init, spirals};
use super::{agent_options, Demo};

const HIDDEN: usize = 64;
const BATCH: usize = 32;
const LR: f64 = 0.01;

/// The model, written once: `x` and the parameters live on the same worker.
fn mlp(x: &RemoteTensor, p: &[RemoteTensor], per_op: bool) -> sluice_autograd::Result<RemoteTensor> {
    let step = |t: RemoteTensor| -> sluice_autograd::Result<RemoteTensor> {
        if per_op {
            t.sync()?;
        }
        Ok(t)
    };
    let h = step(x.linear(&p[0], Some(&p[1]))?)?;
    let h = step(h.tanh()?)?;
    step(h.linear(&p[2], Some(&p[3]))?)
}

pub fn run(demo: &Demo, rank: u32) -> anyhow::Result<()> {
    let Demo::Remote { epochs, per_op } = *demo else {
        unreachable!()
    };
    let mut registry = Registry::new();
    dist::install(&mut registry);
    let agent = Agent::init(agent_options(demo.worker_name(rank)), registry)?;
    if rank == 0 {
        train(&agent, epochs, per_op)?;
    }
    agent.shutdown()?;
    Ok(())
}

fn train(agent: &Agent, epochs: u32, per_op: bool) -> anyhow::Result<()> {
    let owner = "worker1/cpu";
    let names = ["w1", "b1", "w2", "b2"];
    let params = mlp_init(HIDDEN, 7)
        .iter()
        .zip(names)
        .map(|(t, n)| RemoteTensor::parameter(agent, owner, n, t))
        .collect::<sluice_autograd::Result<Vec<_>>>()?;
    let rrefs: Vec<_> = params.iter().filter_map(RemoteTensor::param_rref).collect();
    let optimizer = DistributedOptimizer::new(agent, OptimizerKind::adam(LR), &rrefs, UpdateMode::Locked)?;
    let (train, test) = spirals(300, 1);
    let evaluate = || -> anyhow::Result<f64> {
        let (x, y) = test.batch(0..test.len());
        let logits = mlp(&x.to_remote(agent, owner)?, &params, false)?.to_here()?;
        Ok(accuracy(&logits, &y)?)
    };
    let before = evaluate()?;
    let batches = train.len() / BATCH;
    let start = Instant::now();
    let stats = remote::stats();
    let mut last = 0.0;
    for epoch in 0..epochs {
        let mut total = 0.0;
        for b in 0..batches {
            let (x, y) = train.batch(b * BATCH..(b + 1) * BATCH);
            let ctx = Context::new(agent)?;
            let loss = ctx.run(|| -> anyhow::Result<_> {
                let logits = mlp(&x.to_remote(agent, owner)?, &params, per_op)?;
                Ok(logits.cross_entropy(&y.to_remote(agent, owner)?)?.to_here()?)
            })?;
            total += loss.item()?;
            ctx.backward(&[loss], false)?;
            optimizer.step(ctx.id())?;
        }
        last = total / batches as f64;
        if epoch % 10 == 0 || epoch + 1 == epochs {
            println!("epoch {epoch:>3}: mean loss {last:.4}");
        }
    }
    let elapsed = start.elapsed();
    let steps = (epochs as usize * batches).max(1);
    let after = evaluate()?;
    let s = remote::stats();
    println!(
        "remote tensors on {owner} ({}): {steps} steps, {:.2} ms per step; {} calls carried the forwards ({} graphs sent whole, {} by reference)",
        if per_op { "one call per op" } else { "fused" },
        elapsed.as_secs_f64() * 1e3 / steps as f64,
        s.flushes - stats.flushes,
        s.graphs_sent - stats.graphs_sent,
        s.graphs_by_reference - stats.graphs_by_reference,
    );
    println!(
        "test accuracy {:.1}% before, {:.1}% after (final mean loss {last:.4})",
        before * 100.0,
        after * 100.0
    );
    anyhow::ensure!(after > before, "training did not improve the test accuracy");
    Ok(())
}
