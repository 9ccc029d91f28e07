//! Data parallelism: the parameter-server demo's model, data, batch and learning rate, trained
//! the other way. Every worker holds a whole replica; each step it computes gradients on a batch
//! of its own shard locally, averages them with every other worker by one allreduce
//! (`sluice-collective`: the gradients flattened into one buffer; up to 64 KiB they go straight to
//! every rank, above that around a ring), and applies the same SGD step, so the replicas stay
//! bitwise identical (checked at the end). The update is the synchronous parameter server's with
//! the mean reducer (the average of one batch's gradient per worker), so the two differ only in
//! how gradients travel: one round of point-to-point messages through the server there, one
//! collective among peers here.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::Context as _;
use sluice_autograd::{accuracy, cross_entropy, Optimizer, OptimizerKind, Parameter, Tensor, UpdateMode};
use sluice_collective::{DType, Group, GroupOptions, ReduceOp};

use super::data::{mlp_init, spirals};
use super::ps::{mlp, BATCH, HIDDEN, LR};
use super::Demo;

pub fn run(demo: &Demo, rank: u32) -> anyhow::Result<()> {
    let Demo::Ddp { workers, epochs } = *demo else {
        unreachable!()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let group = rt
        .block_on(async { Group::new(GroupOptions::from_env("demo-ddp")?).await })
        .context("forming the data-parallel group")?;
    // The same initial parameters on every worker (seeded).
    let names = ["w1", "b1", "w2", "b2"];
    let params: Vec<Parameter> = mlp_init(HIDDEN, 7)
        .into_iter()
        .zip(names)
        .map(|(t, n)| Parameter::new(n, t))
        .collect();
    let sizes: Vec<usize> = params.iter().map(|p| p.data().shape().iter().product()).collect();
    let (train, test) = spirals(300, 1);
    let evaluate = || -> anyhow::Result<f64> {
        let p: Vec<Tensor> = params.iter().map(Parameter::data).collect();
        let (x, y) = test.batch(0..test.len());
        Ok(accuracy(&mlp(&x, &p)?, &y)?)
    };
    let before = evaluate()?;
    let shard = train.shard(rank as usize, workers as usize);
    // Every worker takes as many steps as the smallest shard allows.
    let mut batches = [(shard.len() / BATCH) as u32];
    rt.block_on(group.all_reduce(bytemuck::cast_slice_mut(&mut batches), DType::U32, ReduceOp::Min))?;
    let batches = batches[0] as usize;
    let optimizer = Optimizer::new(OptimizerKind::sgd(LR), params.clone(), UpdateMode::Locked);
    let mut flat: Vec<f32> = Vec::with_capacity(sizes.iter().sum());
    let mut last = 0.0;
    let start = Instant::now();
    for _ in 0..epochs {
        let mut total = 0.0;
        for b in 0..batches {
            let (x, y) = shard.batch(b * BATCH..(b + 1) * BATCH);
            let p: Vec<Tensor> = params.iter().map(Parameter::tensor).collect();
            let loss = cross_entropy(&mlp(&x, &p)?, &y)?;
            total += loss.item()?;
            loss.backward()?;
            flat.clear();
            for param in &params {
                let g = param.grad().context("a parameter without a gradient")?;
                flat.extend(g.to_vec::<f32>()?);
                param.zero_grad();
            }
            rt.block_on(group.all_reduce(bytemuck::cast_slice_mut(&mut flat), DType::F32, ReduceOp::Avg))?;
            let mut grads = HashMap::new();
            let mut at = 0;
            for (param, &n) in params.iter().zip(&sizes) {
                grads.insert(
                    param.id(),
                    Tensor::from_vec(flat[at..at + n].to_vec(), param.data().shape())?,
                );
                at += n;
            }
            optimizer.step_with(&grads)?;
        }
        last = total / batches.max(1) as f64;
    }
    let elapsed = start.elapsed();
    let steps = (epochs as usize * batches).max(1);
    // The replicas must be the same bytes everywhere: gather every worker's and compare.
    let mine: Vec<f32> = params
        .iter()
        .map(|p| p.data().to_vec::<f32>())
        .collect::<Result<Vec<_>, _>>()?
        .concat();
    let mut all = vec![0f32; mine.len() * workers as usize];
    rt.block_on(group.all_gather(bytemuck::cast_slice(&mine), bytemuck::cast_slice_mut(&mut all)))?;
    for (r, replica) in all.chunks(mine.len()).enumerate() {
        anyhow::ensure!(
            replica == mine.as_slice(),
            "worker{r}'s replica differs from worker{rank}'s"
        );
    }
    println!("worker{rank}: final epoch mean loss {last:.4}");
    if rank == 0 {
        let after = evaluate()?;
        println!(
            "data parallel, allreduce: {workers} workers × {epochs} epochs in {:.1} s ({:.2} ms a step); held-out accuracy {:.1}% → {:.1}%; replicas identical",
            elapsed.as_secs_f64(),
            elapsed.as_secs_f64() * 1e3 / steps as f64,
            before * 100.0,
            after * 100.0
        );
    }
    rt.block_on(group.close())?;
    Ok(())
}
