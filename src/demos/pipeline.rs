//! Pipeline parallelism: the MLP split into two stages on workers 1 and 2; the driver (rank 0)
//! cuts each batch into micro-batches and keeps them all in flight (stage 1 of micro-batch k+1
//! runs while stage 2 works on k), then runs one distributed backward over every micro-batch
//! and steps both stages with the distributed optimizer.

use std::sync::OnceLock;
use std::time::Instant;

use sluice_agent::{Agent, CallContext, RRef, Registry};
use sluice_autograd::dist::{self, Context, DistFuture};
use sluice_autograd::{
    accuracy, cross_entropy, linear, DistributedOptimizer, OptimizerKind, Parameter, Tensor, UpdateMode,
};

use super::data::{mlp_init, spirals};
use super::{agent_options, handler_error, Demo};

const HIDDEN: usize = 64;
const BATCH: usize = 64;

fn stage() -> &'static [Parameter] {
    static S: OnceLock<Vec<Parameter>> = OnceLock::new();
    S.get_or_init(|| {
        let init = mlp_init(HIDDEN, 11);
        let rank: u32 = std::env::var("RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(1);
        let (w, b) = if rank == 1 { (0, 1) } else { (2, 3) };
        vec![
            Parameter::new("w", init[w].clone()),
            Parameter::new("b", init[b].clone()),
        ]
    })
}

fn registry() -> Registry {
    let mut r = Registry::new();
    dist::install(&mut r);
    dist::function(&mut r, "stage1", |_cx: &CallContext, x: Tensor| {
        let p = stage();
        linear(&x, &p[0].tensor(), Some(&p[1].tensor()))
            .and_then(|h| h.relu())
            .map_err(handler_error)
    });
    dist::function(&mut r, "stage2", |_cx: &CallContext, h: Tensor| {
        let p = stage();
        linear(&h, &p[0].tensor(), Some(&p[1].tensor())).map_err(handler_error)
    });
    r.handler("param_rrefs", |cx: &CallContext, (): ()| {
        Ok(stage()
            .iter()
            .map(|p| cx.agent.rref(p.clone()))
            .collect::<Vec<RRef<Parameter>>>())
    });
    r
}

/// Forward of one batch through both stages with `micro` micro-batches in flight.
fn forward(agent: &Agent, x: &Tensor, micro: usize) -> anyhow::Result<Tensor> {
    let n = x.shape()[0];
    let sizes: Vec<usize> = (0..micro).map(|i| n / micro + usize::from(i < n % micro)).collect();
    let pieces = x.split(&sizes, 0)?;
    let first: Vec<DistFuture<Tensor>> = pieces
        .iter()
        .map(|p| dist::rpc_async(agent, 1u32, "stage1", p))
        .collect::<Result<_, _>>()?;
    let second: Vec<DistFuture<Tensor>> = first
        .into_iter()
        .map(|f| dist::rpc_async(agent, 2u32, "stage2", &f.wait()?).map_err(anyhow::Error::from))
        .collect::<anyhow::Result<_>>()?;
    let outs: Vec<Tensor> = second.into_iter().map(|f| f.wait()).collect::<Result<_, _>>()?;
    Ok(sluice_autograd::cat(&outs, 0)?)
}

pub fn run(demo: &Demo, rank: u32) -> anyhow::Result<()> {
    let Demo::Pipeline { micro_batches, epochs } = *demo else {
        unreachable!()
    };
    let name = ["driver", "stage1", "stage2"][rank as usize].to_owned();
    let agent = Agent::init(agent_options(name), registry())?;
    if rank == 0 {
        let (train, test) = spirals(300, 2);
        let mut rrefs: Vec<RRef<Parameter>> = agent.call(1u32, "param_rrefs", &())?;
        rrefs.extend(agent.call::<_, Vec<RRef<Parameter>>>(2u32, "param_rrefs", &())?);
        let opt = DistributedOptimizer::new(&agent, OptimizerKind::adam(0.01), &rrefs, UpdateMode::Locked)?;
        let eval = |agent: &Agent| -> anyhow::Result<f64> {
            let (x, y) = test.batch(0..test.len());
            Ok(accuracy(&forward(agent, &x, 1)?, &y)?)
        };
        let before = eval(&agent)?;
        let start = Instant::now();
        let mut loss_first = 0.0;
        let mut loss_last = 0.0;
        for epoch in 0..epochs {
            let mut total = 0.0;
            let batches = train.len() / BATCH;
            for b in 0..batches {
                let (x, y) = train.batch(b * BATCH..(b + 1) * BATCH);
                let ctx = Context::new(&agent)?;
                let logits = forward(&agent, &x, micro_batches as usize)?;
                let loss = cross_entropy(&logits, &y)?;
                total += loss.item()?;
                ctx.backward(&[loss], false)?;
                opt.step(ctx.id())?;
            }
            let mean = total / batches as f64;
            if epoch == 0 {
                loss_first = mean;
            }
            loss_last = mean;
        }
        println!(
            "pipeline, 2 stages, {micro_batches} micro-batches in flight: {epochs} epochs in {:.1} s; loss {loss_first:.3} → {loss_last:.3}; held-out accuracy {:.1}% → {:.1}%",
            start.elapsed().as_secs_f64(),
            before * 100.0,
            eval(&agent)? * 100.0
        );
    }
    agent.shutdown()?;
    Ok(())
}
