//! The `ibverbs` suite: the ibverbs transport and the rdma channel next to raw verbs on the same
//! device, in one process.
//!
//! On a machine without RDMA hardware (CI, every developer's) it runs against the in-process
//! verbs model. The model's "NIC" is a thread doing memcpy, so its absolute figures say nothing
//! about a link; what they do measure is the transport's own cost: its CPU time per message and
//! its round trip over the raw verbs round trip of the same model. Where a real device is viable
//! (`rdma` feature, `SLUICE_IB_DEVICE` etc.), the same measurements run on it too.
//!
//! - `verbs raw`: two queue pairs bouncing a write-with-immediate (busy-polled), and a queue
//!   pair streaming writes with its send queue full: the `ib_write_lat` / `ib_write_bw` patterns.
//! - `ibv`: the transport's 64 B ping-pong (with its CPU time per message), and one-way frames.
//! - `pipe rdma`: a pipe over the transport moving 64 MiB CPU tensors by RDMA read.

use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice_channel::{Allocation, ChannelKind, Context, ContextOptions, Message, Pipe, Tensor, TransportKind};
use sluice_transport::ibv::{baseline, DeviceChoice, IbvOptions, IbvTransport, VerbsDevice};
use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport};

use crate::report::Record;
use crate::run::BenchOptions;

const SUITE: &str = "ibverbs";

fn budget(quick: bool) -> Duration {
    Duration::from_millis(if quick { 150 } else { 1000 })
}

/// CPU time (user + system) of this process so far.
fn cpu_time() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(u) => {
            let t = |tv: nix::sys::time::TimeVal| Duration::new(tv.tv_sec() as u64, tv.tv_usec() as u32 * 1000);
            t(u.user_time()) + t(u.system_time())
        }
        Err(_) => Duration::ZERO,
    }
}

/// A "cpu/msg" record: CPU nanoseconds per message (in `p50_ns`) over `iterations` messages.
fn cpu_record(backend: String, bytes: usize, ns: f64, iterations: u64) -> Record {
    Record {
        metric: "cpu/msg",
        p99_ns: None,
        iterations,
        ..Record::rtt(SUITE, backend, bytes, vec![ns])
    }
}

fn options_for(device: DeviceChoice) -> IbvOptions {
    IbvOptions {
        device,
        ..IbvOptions::default()
    }
}

/// Runs the suite on the model, and on a real device where one is viable.
pub fn run(options: &BenchOptions) -> anyhow::Result<Vec<Record>> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut targets = vec![("model", IbvTransport::new(options_for(DeviceChoice::Model)))];
    let hw = IbvTransport::new(options_for(DeviceChoice::from_env()));
    match hw.viability() {
        Ok(()) => {
            eprintln!("ibverbs suite: device {}", hw.device().expect("viable").name());
            targets.push(("hw", hw));
        }
        Err(e) => eprintln!("ibverbs suite: no RDMA hardware here ({e}); measuring against the verbs model"),
    }
    let mut records = Vec::new();
    for (label, transport) in targets {
        let device = transport.device().expect("viable");
        records.extend(measure(&runtime, label, &transport, device.as_ref(), options.quick)?);
    }
    Ok(records)
}

fn measure(
    runtime: &tokio::runtime::Runtime,
    label: &str,
    transport: &IbvTransport,
    device: &dyn VerbsDevice,
    quick: bool,
) -> anyhow::Result<Vec<Record>> {
    let mut out = Vec::new();
    let b = budget(quick);
    // Round trips, 64 B: raw verbs, then the transport; CPU time per one-way message of each.
    let before = cpu_time();
    let samples = baseline::ping_pong(device, 64, b)?;
    let raw_cpu = (cpu_time() - before).as_nanos() as f64 / (2.0 * samples.len() as f64);
    let raw_n = samples.len() as u64;
    let raw = Record::rtt(SUITE, format!("verbs raw/{label}"), 64, samples);
    let raw_cpu = cpu_record(format!("verbs raw/{label}"), 64, raw_cpu, raw_n);
    let (samples, cpu) = runtime.block_on(transport_ping_pong(transport, 64, b))?;
    let n = samples.len() as u64;
    let mut rtt = Record::rtt(SUITE, format!("ibv/{label}"), 64, samples);
    rtt.against(&raw);
    let mut cpu = cpu_record(format!("ibv/{label}"), 64, cpu, n);
    cpu.against(&raw_cpu);
    out.extend([raw, rtt, raw_cpu, cpu]);
    // One-way bandwidth.
    let sizes: &[usize] = if quick { &[1 << 20] } else { &[1 << 20, 64 << 20] };
    for &size in sizes {
        let (bps, n) = baseline::write_bandwidth(device, size, b)?;
        let raw = Record::bw(SUITE, format!("verbs raw/{label}"), size, bps / 1e9, n);
        let (gbps, n) = runtime.block_on(transport_stream(transport, size, b))?;
        let mut r = Record::bw(SUITE, format!("ibv/{label}"), size, gbps, n);
        r.against(&raw);
        out.extend([raw.clone(), r]);
        if size >= 64 << 20 || quick {
            let (gbps, n) = runtime.block_on(pipe_rdma(label, size.max(64 << 20), b))?;
            let mut r = Record::bw(SUITE, format!("pipe rdma/{label}"), size.max(64 << 20), gbps, n);
            r.against(&raw);
            out.push(r);
        }
    }
    Ok(out)
}

async fn connected(
    t: &IbvTransport,
) -> anyhow::Result<(
    sluice_transport::ibv::IbvConnection,
    sluice_transport::ibv::IbvConnection,
)> {
    let mut l = t.listen("").await?;
    let addr = l.address();
    let (c, s) = tokio::join!(t.connect(&addr), l.accept());
    Ok((c?, s?))
}

/// 64 B frames bounced between two connections; returns round trips (ns) and CPU ns per
/// one-way message.
async fn transport_ping_pong(t: &IbvTransport, size: usize, budget: Duration) -> anyhow::Result<(Vec<f64>, f64)> {
    let (a, b) = connected(t).await?;
    let (mut ar, mut aw) = a.split();
    let (mut br, mut bw) = b.split();
    let echo = tokio::spawn(async move {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = br.read(&mut buf).await {
            if bw.write(&[&buf[..n]]).await.is_err() {
                break;
            }
        }
    });
    let msg = vec![7u8; size];
    let mut buf = vec![0u8; size.max(1)];
    for _ in 0..100 {
        aw.write(&[&msg]).await?;
        ar.read(&mut buf).await?;
    }
    let mut samples = Vec::new();
    let before = cpu_time();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 100 {
        let t0 = Instant::now();
        aw.write(&[&msg]).await?;
        ar.read(&mut buf).await?;
        samples.push(t0.elapsed().as_nanos() as f64);
    }
    let cpu = (cpu_time() - before).as_nanos() as f64 / (2.0 * samples.len() as f64);
    aw.close();
    let _ = echo.await;
    Ok((samples, cpu))
}

/// Frames of `size` bytes streamed one way for about `budget`: GB/s and frames moved.
async fn transport_stream(t: &IbvTransport, size: usize, budget: Duration) -> anyhow::Result<(f64, u64)> {
    let (a, b) = connected(t).await?;
    let (_ar, mut aw) = a.split();
    let (mut br, _bw) = b.split();
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; size];
        let mut n = 0u64;
        while br.read(&mut buf).await.is_ok() {
            n += 1;
        }
        n
    });
    let data = vec![1u8; size];
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < budget || sent < 4 {
        aw.write(&[&data]).await?;
        sent += 1;
    }
    aw.close();
    let received = reader.await?;
    let secs = start.elapsed().as_secs_f64();
    Ok((received as f64 * size as f64 / secs / 1e9, received))
}

/// A pipe over the transport (on the model, or the configured device) moving `size`-byte CPU
/// tensors with the rdma channel; GB/s of tensor bytes.
async fn pipe_rdma(label: &str, size: usize, budget: Duration) -> anyhow::Result<(f64, u64)> {
    let device = if label == "model" {
        DeviceChoice::Model
    } else {
        DeviceChoice::from_env()
    };
    let opts = ContextOptions {
        transports: vec![TransportKind::Ibv],
        channels: vec![ChannelKind::Rdma],
        ibv: options_for(device),
        ..ContextOptions::default()
    };
    let server = Context::new(opts.clone())?;
    let client = Context::new(opts)?;
    let mut l = server.listen("127.0.0.1:0").await?;
    let addr = l.address().to_owned();
    let (c, s) = tokio::join!(client.connect(&addr), l.accept());
    let (a, b): (Pipe, Pipe) = (c?, s?);
    anyhow::ensure!(a.info().cpu_channel == ChannelKind::Rdma, "rdma was not negotiated");
    let tensor = Bytes::from(vec![5u8; size]);
    let receiver = tokio::spawn(async move {
        let mut alloc: Option<Allocation> = None;
        let mut n = 0u64;
        while let Ok(d) = b.read_descriptor().await {
            let given = alloc.take().unwrap_or_else(|| Allocation::for_descriptor(&d));
            match b.read(given).await {
                Ok(a) => alloc = Some(a),
                Err(_) => break,
            }
            n += 1;
        }
        n
    });
    let message = Message {
        metadata: Bytes::new(),
        payloads: Vec::new(),
        tensors: vec![Tensor::cpu(tensor)],
    };
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < budget || sent < 4 {
        a.write(&message).await?;
        sent += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    a.close();
    let _ = receiver.await;
    Ok((sent as f64 * size as f64 / secs / 1e9, sent))
}
