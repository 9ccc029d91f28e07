//! `sluice bench rpc`: the RPC agent between two processes on this host, next to the bare pipe
//! measured in the same run.
//!
//! - `rpc_sync` no-op round trip (a synchronous handler on the pool, and an async handler),
//!   called from a plain thread, against an empty message echoed on a bare pipe;
//! - `rpc_async` no-op throughput with 64 calls in flight;
//! - the same two over TCP (a second group whose caller offers only TCP), against an empty
//!   message echoed on a bare TCP pipe: where replies batched into one write save system calls;
//! - tensor echo (1 MiB, 64 MiB by default) through `rpc_sync`, against the same echo on a bare
//!   pipe, the two measured in alternating turns (a slow phase of this shared machine falls on
//!   both). Bandwidth here is tensor bytes per round trip over the round trip's time.
//!
//! With a GPU (both processes on `cuda:0`, mapped `cuda:0 → cuda:0` both ways):
//! - `rpc_sync` echo of a 4 KiB CUDA tensor (request mapped, response reverse-mapped, no host
//!   staging: cuda_ipc carries it), against the CPU no-op round trip of the same run;
//! - `rpc_sync` of a 256 MiB CUDA tensor to a handler that keeps it, against a raw
//!   device-to-device copy of the same size on the same GPU in the same run (the cuda_ipc
//!   channel's ceiling: it is one such copy).
//!
//! This process is rank 0 (it hosts the store); it starts rank 1 with `sluice bench
//! --rpc-worker STORE`.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;
use sluice_agent::{Agent, AgentOptions, Payload, Priority, Registry, Tensor};
use sluice_channel::cuda::{self, CudaBuffer, RawCopy, Stream};
use sluice_channel::{Context, ContextOptions, Device, Message, SendBuffer, TransportKind};

use crate::report::Record;
use crate::run::{message_rtt, pipe_rtt, BenchOptions, MAX_RTT_SAMPLES};

const IN_FLIGHT: usize = 64;

/// How long the `work` handler holds its slot.
const WORK: std::time::Duration = std::time::Duration::from_micros(500);
/// Requests queued ahead of the urgent one in the callee-queue rows.
const QUEUED: usize = 1000;
/// The bulk tensor streamed in the head-of-line rows.
const BULK: usize = 64 << 20;

/// Turns of the echo comparison: bare pipe, then agent, this many times.
const ECHO_TURNS: u32 = 5;

/// The handlers of the benchmark's peer.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    r.handler("noop", |_, (): ()| Ok(()))
        .async_handler("noop_async", |_, (): ()| async { Ok(()) })
        .raw_handler("echo", |_, payload| Ok(payload))
        // Takes the tensors and answers empty: a one-way transfer plus a small reply.
        .raw_handler("sink", |_, _payload| Ok(Payload::empty()))
        // A request that keeps its handler slot busy for WORK (the callee-queue rows).
        .handler("work", |_, (): ()| {
            let start = Instant::now();
            while start.elapsed() < WORK {
                std::hint::spin_loop();
            }
            Ok(())
        })
        .async_handler("queued", |ctx: sluice_agent::CallContext, (): ()| async move {
            Ok(ctx.agent.queued_requests())
        });
    crate::autograd::serve(&mut r);
    r
}

/// The GPU both bench processes use, when CUDA works here (never under the CUDA driver model:
/// its figures would read as a GPU's).
pub fn gpu() -> Option<Device> {
    (cuda::available() && cuda::driver::model().is_none()).then_some(Device::Cuda(0))
}

/// Options for a bench process: with a GPU, `cuda:0` maps to the peer's `cuda:0`.
pub fn agent_options(name: &str, peer: &str, rank: u32, store: &str) -> AgentOptions {
    let o = AgentOptions::new(name).rank(rank, 2).store(store);
    match gpu() {
        Some(g) => o.map_device(peer, g, g),
        None => o,
    }
}

/// Rank 1: serves until rank 0 shuts the group down.
pub fn worker(store: &str) -> anyhow::Result<()> {
    let agent = Agent::init(agent_options("bench-peer", "bench", 1, store), registry())?;
    agent.shutdown()?;
    Ok(())
}

fn echo_sizes(options: &BenchOptions) -> Vec<usize> {
    if options.quick {
        vec![1 << 20]
    } else {
        vec![1 << 20, 64 << 20]
    }
}

/// Echo bandwidth: bytes per round trip over the mean round trip.
fn echo_gbps(size: usize, samples: &[f64]) -> f64 {
    let mean = samples.iter().sum::<f64>() / samples.len().max(1) as f64;
    size as f64 / mean
}

/// Runs the suite; `pipe_addr` is the bench peer's pipe listener (for the bare-pipe baselines)
/// and `spawn_worker` starts rank 1 given the store address.
pub fn run(
    options: &BenchOptions,
    pipe_addr: &str,
    spawn_worker: impl Fn(&str) -> anyhow::Result<Box<dyn std::any::Any>>,
) -> anyhow::Result<Vec<Record>> {
    let budget = options.budget() * 3;
    let empty_rtt = |pipe_options: ContextOptions| -> anyhow::Result<(Record, String)> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let pipe = Context::new(pipe_options)?.connect(pipe_addr).await?;
            let transport = format!("{}/{}", pipe.info().cpu_channel, pipe.info().transport);
            let empty = Message {
                metadata: Bytes::from_static(b"echo"),
                ..Message::default()
            };
            let samples = message_rtt(&pipe, &empty, budget).await?;
            pipe.close();
            Ok((
                Record::rtt("rpc", format!("pipe-empty/{transport}"), 0, samples),
                transport,
            ))
        })
    };
    let mut out = Vec::new();

    // Baselines on a bare pipe, same negotiation as the agent's pipes. The pipe stays open:
    // the echo baseline is measured in turns with the agent's echo below.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (pipe, noop_base, transport) = rt.block_on(async {
        let pipe = Context::new(ContextOptions::default())?.connect(pipe_addr).await?;
        let transport = format!("{}/{}", pipe.info().cpu_channel, pipe.info().transport);
        let empty = Message {
            metadata: Bytes::from_static(b"echo"),
            ..Message::default()
        };
        let noop = Record::rtt(
            "rpc",
            format!("pipe-empty/{transport}"),
            0,
            message_rtt(&pipe, &empty, budget).await?,
        );
        Ok::<_, anyhow::Error>((pipe, noop, transport))
    })?;
    out.push(noop_base.clone());

    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let store = format!("127.0.0.1:{port}");
    let _worker = spawn_worker(&store)?;
    let agent = Agent::init(agent_options("bench", "bench-peer", 0, &store), registry())?;

    let calls = call_records(&agent, &transport, &noop_base, budget)?;
    out.extend(calls);
    out.extend(priority_records(&agent, &transport, options, budget)?);

    for size in echo_sizes(options) {
        let data = Bytes::from(vec![7u8; size]);
        let payload = Payload::empty().with_tensors(vec![Tensor::cpu(data)]);
        let (mut base, mut ours) = (Vec::new(), Vec::new());
        for _ in 0..ECHO_TURNS {
            base.extend(rt.block_on(pipe_rtt(&pipe, size, budget / ECHO_TURNS))?);
            let start = Instant::now();
            while start.elapsed() < budget / ECHO_TURNS || ours.len() < 3 {
                let t0 = Instant::now();
                let reply = agent.rpc_sync(1u32, "echo", payload.clone())?;
                ours.push(t0.elapsed().as_nanos() as f64);
                drop(reply);
            }
        }
        let base = Record::bw(
            "rpc",
            format!("pipe-echo/{transport}"),
            size,
            echo_gbps(size, &base),
            base.len() as u64,
        );
        let mut r = Record::bw(
            "rpc",
            format!("rpc-echo/{transport}"),
            size,
            echo_gbps(size, &ours),
            ours.len() as u64,
        );
        r.against(&base);
        out.push(base);
        out.push(r);
    }
    pipe.close();
    drop(rt);
    if gpu().is_some() {
        out.extend(cuda_records(&agent, options, budget)?);
    }
    agent.shutdown()?;
    drop(_worker);

    // The calls again over TCP: a group whose caller offers only TCP (its pipe to rank 1 is
    // the one both directions use), against a bare TCP pipe's empty round trip.
    let tcp_only = || ContextOptions {
        transports: vec![TransportKind::Tcp],
        ..ContextOptions::default()
    };
    let (tcp_base, tcp_transport) = empty_rtt(tcp_only())?;
    out.push(tcp_base.clone());
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let store = format!("127.0.0.1:{port}");
    let _worker = spawn_worker(&store)?;
    let mut tcp_options = agent_options("bench", "bench-peer", 0, &store);
    tcp_options.pipe = tcp_only();
    let agent = Agent::init(tcp_options, registry())?;
    out.extend(call_records(&agent, &tcp_transport, &tcp_base, budget)?);
    out.extend(priority_records(&agent, &tcp_transport, options, budget)?);
    agent.shutdown()?;
    Ok(out)
}

/// Round trips of a 64 B echo at `priority`, from this thread, for `budget` (at least 3), each
/// after a pseudo-random pause of up to 2 ms, so that the samples fall at every phase of a
/// stream running beside them, not in one gap of it.
fn echo_64(agent: &Agent, priority: Priority, budget: std::time::Duration) -> anyhow::Result<Vec<f64>> {
    let at = agent.with_priority(priority);
    let payload = Payload::empty().with_tensors(vec![Tensor::cpu(Bytes::from(vec![1u8; 64]))]);
    let mut samples = Vec::new();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let start = Instant::now();
    while samples.len() < MAX_RTT_SAMPLES && (start.elapsed() < budget || samples.len() < 3) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(std::time::Duration::from_micros(x % 2000));
        let t0 = Instant::now();
        at.rpc_sync(1u32, "echo", payload.clone())?;
        samples.push(t0.elapsed().as_nanos() as f64);
    }
    Ok(samples)
}

/// Priorities (`priority-…` rows), each against its idle baseline of the same run:
/// - head of line: a 64 B echo while the same peer pair streams 64 MiB tensors back to back
///   (four in flight), at normal priority (`priority-hol-normal`: what every call got before
///   priorities) and high (`priority-hol`), against the idle echo (`priority-idle`);
/// - callee queue: a high-priority `work` call (500 µs of handler time) made while 1,000
///   normal ones wait for the callee's handler slots (`priority-queue`), and a normal one made
///   the same way (`priority-queue-normal`), against one `work` call on an idle callee
///   (`priority-queue-idle`: one service time plus the round trip).
fn priority_records(
    agent: &Agent,
    transport: &str,
    options: &BenchOptions,
    budget: std::time::Duration,
) -> anyhow::Result<Vec<Record>> {
    let mut out = Vec::new();
    let idle = Record::rtt(
        "rpc",
        format!("priority-idle/{transport}"),
        64,
        echo_64(agent, Priority::HIGH, budget)?,
    );
    out.push(idle.clone());

    // Bulk tensors back to back on the normal pipe, from another thread.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let streamer = {
        let (agent, stop) = (agent.clone(), stop.clone());
        std::thread::spawn(move || -> anyhow::Result<u64> {
            let bulk = Payload::empty().with_tensors(vec![Tensor::cpu(Bytes::from(vec![3u8; BULK]))]);
            let mut window = VecDeque::new();
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                while window.len() < 4 {
                    window.push_back(agent.rpc_async(1u32, "sink", bulk.clone()));
                    sent += 1;
                }
                window.pop_front().expect("a bulk call in flight").wait()?;
            }
            for f in window {
                f.wait()?;
            }
            Ok(sent)
        })
    };
    // Let the stream fill the pipe before measuring.
    std::thread::sleep(std::time::Duration::from_millis(50));
    let loaded = (|| -> anyhow::Result<_> {
        let normal = echo_64(agent, Priority::NORMAL, budget)?;
        let high = echo_64(agent, Priority::HIGH, budget)?;
        Ok((normal, high))
    })();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = streamer
        .join()
        .map_err(|_| anyhow::anyhow!("the bulk streamer panicked"))??;
    let (normal, high) = loaded?;

    for (name, samples) in [("priority-hol-normal", normal), ("priority-hol", high)] {
        let mut r = Record::rtt("rpc", format!("{name}/{transport}"), 64, samples);
        r.against(&idle);
        out.push(r);
    }
    anyhow::ensure!(sent > 0, "no bulk tensor was streamed during the head-of-line rows");

    // The callee queue.
    let empty = Payload::encode(&())?;
    let mut alone = Vec::new();
    let start = Instant::now();
    while alone.len() < 200 && (start.elapsed() < budget || alone.len() < 3) {
        let t0 = Instant::now();
        agent.rpc_sync(1u32, "work", empty.clone())?;
        alone.push(t0.elapsed().as_nanos() as f64);
    }
    let alone = Record::rtt("rpc", format!("priority-queue-idle/{transport}"), 0, alone);
    out.push(alone.clone());
    let rounds = if options.quick { 3 } else { 12 };
    let (mut high, mut normal) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let queued: Vec<_> = (0..QUEUED)
            .map(|_| agent.rpc_async(1u32, "work", empty.clone()))
            .collect();
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        // Measure once most of them wait on the callee (some have already run).
        while agent.call::<_, usize>(1u32, "queued", &())? < QUEUED / 2 {
            anyhow::ensure!(Instant::now() < deadline, "the callee never queued the requests");
        }
        // Every third round a normal call, for the comparison (a few are enough: each waits
        // for the whole queue).
        let (priority, into) = if round % 3 != 2 {
            (Priority::HIGH, &mut high)
        } else {
            (Priority::NORMAL, &mut normal)
        };
        let t0 = Instant::now();
        agent.with_priority(priority).rpc_sync(1u32, "work", empty.clone())?;
        into.push(t0.elapsed().as_nanos() as f64);
        for f in queued {
            f.wait()?;
        }
    }
    for (name, samples) in [("priority-queue", high), ("priority-queue-normal", normal)] {
        let mut r = Record::rtt("rpc", format!("{name}/{transport}"), 0, samples);
        r.against(&alone);
        out.push(r);
    }
    Ok(out)
}

/// `rpc_sync` no-op round trips (sync and async handler) against `base`, then the `rpc_async`
/// no-op rate with 64 calls in flight, all to rank 1.
fn call_records(
    agent: &Agent,
    transport: &str,
    base: &Record,
    budget: std::time::Duration,
) -> anyhow::Result<Vec<Record>> {
    let mut out = Vec::new();
    let empty = Payload::encode(&())?;
    for handler in ["noop", "noop_async"] {
        let mut samples = Vec::new();
        let start = Instant::now();
        while samples.len() < MAX_RTT_SAMPLES && (start.elapsed() < budget || samples.len() < 3) {
            let t0 = Instant::now();
            agent.rpc_sync(1u32, handler, empty.clone())?;
            samples.push(t0.elapsed().as_nanos() as f64);
        }
        let mut r = Record::rtt("rpc", format!("rpc_sync-{handler}/{transport}"), 0, samples);
        r.against(base);
        out.push(r);
    }
    let mut window = VecDeque::with_capacity(IN_FLIGHT);
    let mut done = 0u64;
    let start = Instant::now();
    while start.elapsed() < budget || done < 3 {
        while window.len() < IN_FLIGHT {
            window.push_back(agent.rpc_async(1u32, "noop", empty.clone()));
        }
        window.pop_front().expect("a call in flight").wait()?;
        done += 1;
    }
    for f in window {
        f.wait()?;
    }
    let per_second = done as f64 / start.elapsed().as_secs_f64();
    out.push(Record::rate(
        "rpc",
        format!("rpc_async-64/{transport}"),
        0,
        per_second,
        done,
    ));
    Ok(out)
}

/// The CUDA half of the suite (see the module doc).
fn cuda_records(agent: &Agent, options: &BenchOptions, budget: std::time::Duration) -> anyhow::Result<Vec<Record>> {
    let mut out = Vec::new();
    let stream = Stream::new(0)?;
    let small = CudaBuffer::alloc(4 << 10, &stream)?;
    small.fill(3)?;
    let payload = Payload::empty().with_tensors(vec![Tensor::cuda(small, Device::Cuda(0))]);
    eprintln!("rpc: CUDA 4 KiB echo");
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < MAX_RTT_SAMPLES && (start.elapsed() < budget || samples.len() < 3) {
        let t0 = Instant::now();
        let reply = agent.rpc_sync(1u32, "echo", payload.clone())?;
        samples.push(t0.elapsed().as_nanos() as f64);
        if !matches!(reply.tensors.first().map(|t| &t.buffer), Some(SendBuffer::Cuda(_))) {
            anyhow::bail!("the CUDA echo came back off the GPU");
        }
    }
    // No baseline of the same size and kind exists here (the no-op call carries nothing):
    // the row stands alone.
    out.push(Record::rtt("rpc", "rpc_sync-cuda-echo/cuda:0", 4 << 10, samples));

    let size = if options.quick { 64 << 20 } else { 256 << 20 };
    let iterations = if options.quick { 5 } else { 20 };
    eprintln!("rpc: CUDA {} MiB send, and the raw copy", size >> 20);
    let raw = cuda::time_raw_copies(0, RawCopy::DeviceToDevice, size, iterations)?;
    let raw_gbps = size as f64 * iterations as f64 / raw.as_nanos() as f64;
    let base = Record::bw("rpc", "raw-dtod-copy/cuda:0", size, raw_gbps, iterations as u64);
    let big = CudaBuffer::alloc(size, &stream)?;
    big.fill(5)?;
    let payload = Payload::empty().with_tensors(vec![Tensor::cuda(big, Device::Cuda(0))]);
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 3 {
        let t0 = Instant::now();
        agent.rpc_sync(1u32, "sink", payload.clone())?;
        samples.push(t0.elapsed().as_nanos() as f64);
    }
    let gbps = echo_gbps(size, &samples);
    let mut r = Record::bw("rpc", "rpc_sync-cuda-send/cuda:0", size, gbps, samples.len() as u64);
    r.against(&base);
    out.push(base);
    out.push(r);
    Ok(out)
}
