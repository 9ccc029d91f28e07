//! `sluice bench collective`: allreduce (float32, sum), allgather, broadcast and reduce-scatter
//! of 4 KiB to 64 MiB on 2 and 4 processes of this host through `sluice-collective`, against
//! PyTorch's Gloo in the same run (when torch is installed for `$SLUICE_BENCH_PYTHON`) and
//! OpenMPI's `MPI_Allreduce` (when installed; allreduce only): the same sizes and call counts,
//! each call timed on rank 0. A size is the whole buffer: allgather's output, reduce-scatter's
//! input (each rank's piece is size / world). Bandwidth is that size over the call's p50 (what
//! PyTorch calls algbw).
//!
//! This process is rank 0 (it serves the group's store); it starts the others with `sluice
//! bench --collective-worker STORE,RANK,WORLD,QUICK`.

use std::time::{Duration, Instant};

use sluice_collective::{DType, Group, GroupOptions, ReduceOp};

use crate::report::Record;
use crate::run::BenchOptions;

/// The group sizes measured.
pub const WORLDS: [u32; 2] = [2, 4];

fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 << 10, 1 << 20]
    } else {
        vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    }
}

/// Calls per size (the Gloo script uses the same formula): fewer for larger buffers.
fn iterations(size: usize, quick: bool) -> usize {
    let n = ((256usize << 20) / size.max(1)).clamp(5, 200);
    if quick {
        (n / 4).max(5)
    } else {
        n
    }
}

fn group_options(store: &str, rank: u32, world: u32) -> GroupOptions {
    GroupOptions {
        name: format!("bench-{world}"),
        rank,
        world_size: world,
        store: store.to_owned(),
        serve_store: rank == 0,
        host: "127.0.0.1".into(),
        timeout: Duration::from_secs(120),
        pipe: Default::default(),
    }
}

/// The collectives measured, as the rows name them.
pub const OPS: [&str; 4] = ["allreduce", "allgather", "broadcast", "reducescatter"];

/// One call of collective `op` on `size` bytes (`buf` is the whole buffer, `piece` a rank's
/// share of it).
async fn call(group: &Group, op: &str, buf: &mut [u8], piece: &mut [u8]) -> anyhow::Result<()> {
    match op {
        "allreduce" => group.all_reduce(buf, DType::F32, ReduceOp::Sum).await?,
        "allgather" => group.all_gather(piece, buf).await?,
        "broadcast" => group.broadcast(0, buf).await?,
        _ => group.reduce_scatter(buf, piece, DType::F32, ReduceOp::Sum).await?,
    }
    Ok(())
}

/// Every rank's loop: per collective and size, two warm-up calls then the timed ones; rank 0
/// returns the times (ns) per collective and size.
async fn measure(group: &Group, quick: bool) -> anyhow::Result<Vec<(&'static str, usize, Vec<f64>)>> {
    let world = group.world_size() as usize;
    let mut out = Vec::new();
    for op in OPS {
        for size in sizes(quick) {
            let mut buf: Vec<u8> = (0..size / 4).flat_map(|i| ((i % 7) as f32).to_ne_bytes()).collect();
            let mut piece = vec![0u8; size / world];
            for _ in 0..2 {
                call(group, op, &mut buf, &mut piece).await?;
            }
            let mut samples = Vec::new();
            for _ in 0..iterations(size, quick) {
                let t0 = Instant::now();
                call(group, op, &mut buf, &mut piece).await?;
                samples.push(t0.elapsed().as_nanos() as f64);
            }
            out.push((op, size, samples));
        }
    }
    Ok(out)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// A rank other than 0: `spec` is `STORE,RANK,WORLD,QUICK`.
pub fn worker(spec: &str) -> anyhow::Result<()> {
    let parts: Vec<&str> = spec.split(',').collect();
    let [store, rank, world, quick] = parts.as_slice() else {
        anyhow::bail!("--collective-worker STORE,RANK,WORLD,QUICK, got {spec}");
    };
    let (rank, world, quick): (u32, u32, bool) = (rank.parse()?, world.parse()?, *quick == "1");
    runtime()?.block_on(async {
        let group = Group::new(group_options(store, rank, world)).await?;
        measure(&group, quick).await?;
        group.close().await?;
        Ok(())
    })
}

/// Runs the suite; `spawn_worker(spec)` starts one other rank.
pub fn run(
    options: &BenchOptions,
    spawn_worker: impl Fn(&str) -> anyhow::Result<Box<dyn std::any::Any>>,
) -> anyhow::Result<(Vec<Record>, Vec<String>)> {
    let quick = options.quick;
    let mut records = Vec::new();
    for world in WORLDS {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let store = format!("127.0.0.1:{port}");
        let workers: Vec<_> = (1..world)
            .map(|r| spawn_worker(&format!("{store},{r},{world},{}", u8::from(quick))))
            .collect::<anyhow::Result<_>>()?;
        let measured = runtime()?.block_on(async {
            let group = Group::new(group_options(&store, 0, world)).await?;
            let m = measure(&group, quick).await?;
            group.close().await?;
            anyhow::Ok(m)
        })?;
        drop(workers);
        for (op, size, samples) in measured {
            let n = samples.len() as u64;
            let rtt = Record::rtt("collective", format!("{op}-f32-{world}p"), size, samples);
            let gbps = size as f64 / rtt.p50_ns.unwrap_or(f64::NAN);
            records.push(rtt);
            records.push(Record::bw("collective", format!("{op}-f32-{world}p"), size, gbps, n));
        }
    }
    let (torch, note) = crate::peers::torch_collectives(&sizes(quick), &WORLDS, quick);
    let gloo: Vec<Record> = torch
        .iter()
        .filter(|r| r.backend.starts_with("gloo-"))
        .cloned()
        .collect();
    let (mpi, mpi_notes) = crate::peers::mpi_allreduce(&sizes(quick), &WORLDS, quick);
    // Each of our rows against Gloo's (the baseline the targets name); OpenMPI's rows stand
    // beside them in the table and the figure.
    for theirs in &gloo {
        let Some(ours) = theirs.backend.strip_prefix("gloo-") else {
            continue;
        };
        let gloo_bw = Record::bw(
            "peer",
            theirs.backend.clone(),
            theirs.bytes as usize,
            theirs.bytes as f64 / theirs.p50_ns.unwrap_or(f64::NAN),
            theirs.iterations,
        );
        for r in records
            .iter_mut()
            .filter(|r| r.backend == ours && r.bytes == theirs.bytes)
        {
            if r.metric == "rtt" {
                r.against(theirs);
            } else {
                r.against(&gloo_bw);
            }
        }
    }
    let mut notes = Vec::new();
    for n in note.into_iter().chain(mpi_notes) {
        eprintln!("collective: {n}");
        notes.push(n);
    }
    for theirs in &mpi {
        let Some(ours) = theirs.backend.strip_prefix("openmpi-") else {
            continue;
        };
        if let Some(r) = records
            .iter()
            .find(|r| r.backend == ours && r.bytes == theirs.bytes && r.metric == "rtt")
        {
            eprintln!(
                "collective: {ours} {} B: Sluice {:.1} µs, OpenMPI {:.1} µs ({:.2}x)",
                theirs.bytes,
                r.p50_ns.unwrap_or(f64::NAN) / 1e3,
                theirs.p50_ns.unwrap_or(f64::NAN) / 1e3,
                r.p50_ns.unwrap_or(f64::NAN) / theirs.p50_ns.unwrap_or(f64::NAN)
            );
        }
    }
    records.extend(torch_rows(torch));
    records.extend(mpi);
    Ok((records, notes))
}

/// torch.distributed's rows: Gloo's as they are; the "sluice" process group's allreduce against
/// Gloo's at the same size and world; each DDP step against the same step without DDP.
fn torch_rows(mut rows: Vec<Record>) -> Vec<Record> {
    let find = |rows: &[Record], backend: &str, bytes: u64| {
        rows.iter()
            .find(|r| r.backend == backend && r.bytes == bytes && r.metric == "rtt")
            .cloned()
    };
    let all = rows.clone();
    for r in rows.iter_mut() {
        let base = if let Some(rest) = r.backend.strip_prefix("torch-sluice-") {
            find(&all, &format!("gloo-{rest}"), r.bytes)
        } else if r.backend.starts_with("ddp-step-") && r.backend != "ddp-step-none" {
            find(&all, "ddp-step-none", r.bytes)
        } else {
            None
        };
        if let Some(b) = base {
            r.against(&b);
            eprintln!(
                "collective: {} {} B: {:.1} µs against {} {:.1} µs ({:.2}x)",
                r.backend,
                r.bytes,
                r.p50_ns.unwrap_or(f64::NAN) / 1e3,
                b.backend,
                b.p50_ns.unwrap_or(f64::NAN) / 1e3,
                r.ratio.unwrap_or(f64::NAN)
            );
        }
    }
    rows
}
