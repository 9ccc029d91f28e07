//! The `cuda` suite: latency and bandwidth of every CUDA channel from 4 KiB to 1 GiB, next to the
//! device's own copies measured in the same run.
//!
//! - Baselines (this process, GPU 0): device-to-device copy bandwidth, and pinned host-to-device
//!   and device-to-host copy bandwidth.
//! - cuda_ipc and cuda_staged: between this process and a second one it starts (the peer
//!   receives into GPU memory and echoes every tensor back, reusing its buffers). cuda_p2p:
//!   within this process in loopback (one GPU: the peer-copy path, not NVLink).
//! - A round trip is measured until the echoed data has *landed* (our stream synchronized),
//!   not merely been queued. Bandwidth is the echo's bytes (two copies of the tensor per round
//!   trip) over its time: the same memory traffic as one device-to-device copy of the tensor
//!   in each direction, so it compares directly with the copy baselines.
//!
//! Without a GPU the suite says why and returns nothing.

use std::any::Any;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice_channel::cuda::{self, CudaBuffer, RawCopy, Stream};
use sluice_channel::{Allocation, ChannelKind, Context, ContextOptions, Device, Message, Pipe, Tensor};

use crate::report::Record;
use crate::run::BenchOptions;

const SUITE: &str = "cuda";
const GPU: Device = Device::Cuda(0);

fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 << 10, 1 << 20, 64 << 20]
    } else {
        vec![4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
    }
}

fn budget(quick: bool) -> Duration {
    Duration::from_millis(if quick { 50 } else { 400 })
}

/// Starts the peer process for one channel: `spawn(address to connect to, channel list)`.
pub type SpawnPeer<'a> = &'a dyn Fn(&str, &str) -> anyhow::Result<Box<dyn Any>>;

/// Runs the suite. Without a GPU it prints why and returns no records.
pub fn run(options: &BenchOptions, spawn: SpawnPeer<'_>) -> anyhow::Result<Vec<Record>> {
    if let Some(model) = cuda::driver::model() {
        eprintln!(
            "cuda suite skipped: {model} is the CUDA driver model (SLUICE_CUDA_DRIVER), not a GPU: nothing to measure"
        );
        return Ok(Vec::new());
    }
    let cuda = match cuda::runtime() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cuda suite skipped: {e}");
            return Ok(Vec::new());
        }
    };
    for g in &cuda.gpus {
        eprintln!("cuda:{} {} {} (peers: {:?})", g.index, g.uuid, g.name, g.peers);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let quick = options.quick;
    let mut records = Vec::new();
    let mut d2d = Vec::new();
    let mut pinned = Vec::new();
    for &size in &sizes(quick) {
        let d = copy_record("device d2d", RawCopy::DeviceToDevice, size, quick)?;
        let h2d = copy_record("pinned h2d", RawCopy::HostToDevice, size, quick)?;
        let d2h = copy_record("pinned d2h", RawCopy::DeviceToHost, size, quick)?;
        // Staging is bounded by the slower of its two copies.
        let slower = if h2d.gbps <= d2h.gbps { h2d.clone() } else { d2h.clone() };
        d2d.push(d.clone());
        pinned.push(slower);
        records.extend([d, h2d, d2h]);
    }
    for channel in [ChannelKind::CudaIpc, ChannelKind::CudaStaged, ChannelKind::CudaP2p] {
        let measured = runtime.block_on(measure_channel(channel, quick, spawn));
        match measured {
            Ok(mut rs) => {
                for r in rs.iter_mut().filter(|r| r.metric == "bw") {
                    let baselines = if channel == ChannelKind::CudaStaged {
                        &pinned
                    } else {
                        &d2d
                    };
                    if let Some(b) = baselines.iter().find(|b| b.bytes == r.bytes) {
                        r.against(b);
                    }
                }
                records.extend(rs);
            }
            Err(e) => eprintln!("cuda suite: {channel} not measured: {e:#}"),
        }
    }
    Ok(records)
}

fn copy_record(name: &str, kind: RawCopy, size: usize, quick: bool) -> anyhow::Result<Record> {
    // Enough copies to fill the budget, estimated from one.
    let one = cuda::time_raw_copies(0, kind, size, 1)?;
    let n = (budget(quick).as_secs_f64() / one.as_secs_f64().max(1e-6)).clamp(3.0, 10_000.0) as u32;
    let t = cuda::time_raw_copies(0, kind, size, n)?;
    Ok(Record::bw(
        SUITE,
        name,
        size,
        size as f64 * n as f64 / t.as_secs_f64() / 1e9,
        n as u64,
    ))
}

/// The pipe pair for one channel: to a peer process, or within this process for p2p.
async fn connect(channel: ChannelKind, spawn: SpawnPeer<'_>) -> anyhow::Result<(Pipe, Box<dyn Any>)> {
    let options = ContextOptions {
        channels: vec![ChannelKind::Cma, ChannelKind::Basic, channel],
        cuda_p2p_loopback: channel == ChannelKind::CudaP2p,
        ..ContextOptions::default()
    };
    let ctx = Context::new(options.clone())?;
    let mut listener = ctx.listen("").await?;
    let keep: Box<dyn Any> = if channel == ChannelKind::CudaP2p {
        let other = Context::new(options)?;
        let addr = listener.address().to_owned();
        let client = other.connect(&addr).await?;
        tokio::spawn(async move {
            let _ = echo(client).await;
        });
        Box::new(other)
    } else {
        spawn(listener.address(), &format!("cma,basic,{}", channel.name()))?
    };
    let pipe = listener.accept().await?;
    anyhow::ensure!(
        pipe.info().channel(GPU, GPU) == Some(channel),
        "negotiation chose {:?} for GPU to GPU, not {channel}",
        pipe.info().channel(GPU, GPU)
    );
    Ok((pipe, keep))
}

async fn measure_channel(channel: ChannelKind, quick: bool, spawn: SpawnPeer<'_>) -> anyhow::Result<Vec<Record>> {
    let (pipe, _keep) = connect(channel, spawn).await?;
    let stream = Stream::new(0)?;
    let backend = if channel == ChannelKind::CudaP2p {
        "cuda_p2p loopback".to_owned()
    } else {
        channel.name().to_owned()
    };
    let mut records = Vec::new();
    for &size in &sizes(quick) {
        let send = CudaBuffer::alloc(size, &stream)?;
        send.fill(0x5a)?;
        let mut recv: Option<Allocation> = None;
        let mut samples = Vec::new();
        let deadline = Instant::now() + budget(quick);
        // One warm-up round trip (opens handles, allocates the peer's buffers).
        for i in 0.. {
            let start = Instant::now();
            let message = Message {
                metadata: Bytes::from_static(b"echo"),
                payloads: Vec::new(),
                tensors: vec![Tensor::cuda(send.clone(), GPU)],
            };
            cuda::trace::mark("bench: write");
            pipe.write(&message).await?;
            cuda::trace::mark("bench: written");
            let d = pipe.read_descriptor().await?;
            let alloc = match recv.take() {
                Some(a) => a,
                None => Allocation::try_for_descriptor(&d, |_| Ok(stream.clone()))?,
            };
            let got = pipe.read(alloc).await?;
            // Landed, not just queued.
            cuda::trace::mark("bench: synchronize");
            stream.synchronize()?;
            cuda::trace::mark("bench: landed");
            if i > 0 {
                samples.push(start.elapsed().as_nanos() as f64);
            }
            recv = Some(got);
            if i >= 3 && Instant::now() >= deadline {
                break;
            }
        }
        let total: f64 = samples.iter().sum();
        let n = samples.len() as u64;
        records.push(Record::rtt(SUITE, backend.clone(), size, samples));
        if size >= 1 << 20 {
            records.push(Record::bw(
                SUITE,
                backend.clone(),
                size,
                2.0 * size as f64 * n as f64 / (total / 1e9) / 1e9,
                n,
            ));
        }
    }
    pipe.close();
    Ok(records)
}

/// Receives every message into GPU memory on this process's streams (reusing the memory when
/// the shape repeats) and sends it straight back to the devices it came from.
async fn echo(pipe: Pipe) -> anyhow::Result<()> {
    let stream = Stream::new(0)?;
    let mut spare: Option<Allocation> = None;
    loop {
        let d = pipe.read_descriptor().await?;
        let fits = |a: &Allocation| {
            a.tensors.len() == d.tensors.len()
                && a.tensors
                    .iter()
                    .zip(&d.tensors)
                    .all(|(b, t)| b.len() as u64 == t.length && Some(b.device()) == t.target_device)
        };
        let alloc = match spare.take() {
            Some(a) if fits(&a) => a,
            _ => Allocation::try_for_descriptor(&d, |i| if i == 0 { Ok(stream.clone()) } else { Stream::new(i) })?,
        };
        let got = pipe.read(alloc).await?;
        cuda::trace::mark("echo: read");
        let tensors: Vec<Tensor> = got
            .tensors
            .iter()
            .zip(&d.tensors)
            .map(|(t, desc)| Tensor {
                buffer: match t.as_cuda() {
                    Some(b) => b.clone().into(),
                    None => Bytes::copy_from_slice(t.as_cpu().expect("cpu or cuda")).into(),
                },
                metadata: Bytes::new(),
                target_device: Some(desc.source_device),
            })
            .collect();
        pipe.write(&Message {
            metadata: d.metadata.clone(),
            payloads: Vec::new(),
            tensors,
        })
        .await?;
        spare = Some(got);
    }
}

/// The peer process's side: connect to `addr` offering `channels`, echo until the pipe closes.
pub fn peer(addr: &str, channels: &str) -> anyhow::Result<()> {
    let channels = channels
        .split(',')
        .map(|c| ChannelKind::from_name(c).ok_or_else(|| anyhow::anyhow!("unknown channel {c}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let ctx = Context::new(ContextOptions {
            channels,
            ..ContextOptions::default()
        })?;
        let pipe = ctx.connect(addr).await?;
        // The bench closes the pipe when it is done; that ends the echo.
        let _ = echo(pipe).await;
        Ok(())
    })
}
