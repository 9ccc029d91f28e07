//! Drives the suites against a peer and collects [`Record`]s.

use std::time::{Duration, Instant};

use bytes::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use sluice_channel::{Allocation, ChannelKind, Context, ContextOptions, Message, Pipe, Tensor, TransportKind};
use sluice_transport::shm::{ShmOptions, ShmTransport};
use sluice_transport::tcp::TcpTransport;
use sluice_transport::{Connection, FrameReader, FrameWriter, Transport};

use crate::raw;
use crate::report::{Record, StageMeter};

/// What to measure and how long.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// A short smoke run: few sizes, short budgets.
    pub quick: bool,
    /// Suites to run: `raw`, `transport`, `pipe`, `idle`.
    pub suites: Vec<String>,
    /// Seconds over which the idle pipe's CPU use is measured.
    pub idle_seconds: f64,
}

impl BenchOptions {
    pub(crate) fn sizes(&self) -> Vec<usize> {
        if self.quick {
            vec![64, 64 << 10, 64 << 20]
        } else {
            vec![
                8,
                64,
                1 << 10,
                16 << 10,
                256 << 10,
                1 << 20,
                4 << 20,
                16 << 20,
                64 << 20,
            ]
        }
    }

    pub(crate) fn budget(&self) -> Duration {
        if self.quick {
            Duration::from_millis(20)
        } else {
            Duration::from_millis(300)
        }
    }

    pub(crate) fn wants(&self, suite: &str) -> bool {
        self.suites.iter().any(|s| s == suite)
    }
}

pub(crate) const MAX_RTT_SAMPLES: usize = 200_000;

struct Directory {
    tcp: String,
    shm: String,
    raw: String,
    /// The peer's busy-polling pipe listener and shm transport listener (empty from an older
    /// peer).
    busy: String,
    shm_busy: String,
}

/// Shared-memory options with busy polling on (see [`ShmOptions::busy_poll`]).
pub fn busy_shm() -> ShmOptions {
    ShmOptions {
        busy_poll: true,
        ..ShmOptions::default()
    }
}

/// Sizes at which busy polling is measured: the small ones, where waiting is the cost.
const BUSY_MAX: usize = 1 << 10;

/// The bench peer's shared-memory transport addresses, adaptive and busy-polling.
pub async fn shm_addresses(peer: &str) -> anyhow::Result<(String, String)> {
    let d = directory(peer).await?;
    Ok((d.shm, d.shm_busy))
}

async fn directory(addr: &str) -> anyhow::Result<Directory> {
    let pipe = Context::new(ContextOptions::default())?.connect(addr).await?;
    pipe.write(&Message {
        metadata: Bytes::from_static(b"dir"),
        ..Message::default()
    })
    .await?;
    let d = pipe.read_descriptor().await?;
    pipe.read(Allocation::for_descriptor(&d)).await?;
    let text = String::from_utf8_lossy(&d.metadata).into_owned();
    let field = |k: &str| {
        text.split(';')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .map(str::to_owned)
            .unwrap_or_default()
    };
    // A peer listening on a wildcard address reports it; dial the host we reached instead.
    let host = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or("127.0.0.1");
    let fix = |a: String| match a.rsplit_once(':') {
        Some((h, p)) if h == "0.0.0.0" || h == "[::]" => format!("{host}:{p}"),
        _ => a,
    };
    Ok(Directory {
        tcp: fix(field("tcp")),
        shm: field("shm"),
        raw: fix(field("raw")),
        busy: fix(field("busy")),
        shm_busy: field("shmbusy"),
    })
}

/// Runs the selected suites against the peer whose pipe listener is at `addr`.
pub async fn run(options: &BenchOptions, addr: &str) -> anyhow::Result<Vec<Record>> {
    let dir = directory(addr).await?;
    let sizes = options.sizes();
    let budget = options.budget();
    let points = sizes.len()
        * (4 * options.wants("raw") as usize
            + 4 * options.wants("transport") as usize
            + 6 * options.wants("pipe") as usize)
        + options.wants("idle") as usize;
    let bar = ProgressBar::new(points as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}").expect("template"),
    );
    let step = |msg: String| {
        bar.set_message(msg);
        bar.inc(1);
    };
    let mut out = Vec::new();

    // Baselines first, one per size and medium; every later record points at one of them.
    let mut shm_rtt = Vec::new();
    let mut raw_rtt = Vec::new();
    let mut raw_bw = Vec::new();
    let mut memcpy = Vec::new();
    let shm_used = !dir.shm.is_empty() && (options.wants("transport") || options.wants("pipe"));
    for &size in &sizes {
        step(format!("raw {}", crate::report::human_bytes(size as u64)));
        let (g, n) = tokio::task::spawn_blocking(move || raw::memcpy_gbps(size, budget)).await?;
        memcpy.push(Record::bw("raw", "memcpy", size, g, n));
        if options.wants("raw") || shm_used {
            let samples =
                tokio::task::spawn_blocking(move || raw::shm_copy_pingpong(size, budget, MAX_RTT_SAMPLES)).await?;
            shm_rtt.push(Record::rtt("raw", "shm-pingpong", size, samples));
        }
        if options.wants("raw") || options.wants("transport") || options.wants("pipe") {
            raw_rtt.push(Record::rtt(
                "raw",
                "tcp-pingpong",
                size,
                raw::tcp_pingpong(&dir.raw, size, budget, MAX_RTT_SAMPLES).await?,
            ));
            let (g, n) = raw::tcp_stream(&dir.raw, size, budget).await?;
            raw_bw.push(Record::bw("raw", "tcp-stream", size, g, n));
        }
    }
    out.extend(shm_rtt.iter().cloned());
    out.extend(memcpy.iter().cloned());
    out.extend(raw_rtt.iter().cloned());
    out.extend(raw_bw.iter().cloned());

    if options.wants("transport") {
        for (i, &size) in sizes.iter().enumerate() {
            step(format!("transport tcp {}", crate::report::human_bytes(size as u64)));
            let tcp = TcpTransport::default();
            // Loopback round trips on a shared VM drift by tens of percent within seconds, more
            // than the difference being measured: ours and the raw ping-pong take turns in four
            // slices each, and the ratio compares the two interleaved halves.
            let (mut ours, mut raw_turns) = (Vec::new(), Vec::new());
            for _ in 0..4 {
                raw_turns.extend(raw::tcp_pingpong(&dir.raw, size, budget / 4, MAX_RTT_SAMPLES).await?);
                ours.extend(transport_rtt(&tcp, &dir.tcp, size, budget / 4).await?);
            }
            let base = Record::rtt("raw", "tcp-pingpong-interleaved", size, raw_turns);
            let mut r = Record::rtt("transport", "tcp", size, ours);
            r.against(&base);
            out.push(base);
            out.push(r);
            let (g, n) = transport_bw(&tcp, &dir.tcp, size, budget).await?;
            let mut r = Record::bw("transport", "tcp", size, g, n);
            r.against(&raw_bw[i]);
            out.push(r);
            if !dir.shm.is_empty() {
                step(format!("transport shm {}", crate::report::human_bytes(size as u64)));
                let shm = ShmTransport::default();
                let meter = StageMeter::start();
                let mut r = Record::rtt(
                    "transport",
                    "shm",
                    size,
                    transport_rtt(&shm, &dir.shm, size, budget).await?,
                );
                r.against(&shm_rtt[i]);
                r.stages = Some(meter.stop());
                out.push(r);
                // A stream's rate through shared memory swings from run to run with the host (a
                // raw cross-core stream alone: 2.4 GB/s in one run, 30 in another): ours and the
                // raw stream take turns in four slices each.
                let mut stages = crate::report::Stages::default();
                let (mut ours, mut raw_turns) = ((0.0, 0), (0.0, 0));
                let add = |acc: &mut (f64, u64), (g, n): (f64, u64)| {
                    acc.0 += size.max(1) as f64 * n as f64 / (g * 1e9);
                    acc.1 += n;
                };
                for _ in 0..4 {
                    add(
                        &mut raw_turns,
                        tokio::task::spawn_blocking(move || raw::shm_copy_stream(size.max(1), budget / 4)).await?,
                    );
                    // The wait counts are the transport's slices' alone.
                    let meter = StageMeter::start();
                    add(&mut ours, transport_bw(&shm, &dir.shm, size, budget / 4).await?);
                    stages = stages.plus(&meter.stop());
                }
                let rate = |(secs, n): (f64, u64)| size.max(1) as f64 * n as f64 / secs / 1e9;
                let base = Record::bw("raw", "shm-stream-interleaved", size, rate(raw_turns), raw_turns.1);
                let mut r = Record::bw("transport", "shm", size, rate(ours), ours.1);
                r.against(&base);
                r.stages = Some(stages);
                out.push(base);
                out.push(r);
                if !dir.shm_busy.is_empty() && size <= BUSY_MAX {
                    let shm = ShmTransport::new(busy_shm());
                    let samples = transport_rtt(&shm, &dir.shm_busy, size, budget).await?;
                    let mut r = Record::rtt("transport", "shm+busy", size, samples);
                    r.against(&shm_rtt[i]);
                    out.push(r);
                    let (g, n) = transport_bw(&shm, &dir.shm_busy, size, budget).await?;
                    let mut r = Record::bw("transport", "shm+busy", size, g, n);
                    r.against(&memcpy[i]);
                    out.push(r);
                }
            }
        }
    }

    if options.wants("pipe") {
        // rdma only where the pipe runs over ibverbs (across hosts with RDMA devices); elsewhere
        // negotiation finds no channel for it and it is skipped with the reason.
        for channel in [
            ChannelKind::Basic,
            ChannelKind::Cma,
            ChannelKind::MultiLane,
            ChannelKind::Rdma,
        ] {
            let ctx = match Context::new(ContextOptions {
                channels: vec![channel],
                ..ContextOptions::default()
            }) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("pipe with channel {channel}: {e} (skipped)");
                    continue;
                }
            };
            let pipe = match ctx.connect(addr).await {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("pipe with channel {channel}: {e} (skipped)");
                    continue;
                }
            };
            let backend = format!("{}/{}", channel, pipe.info().transport);
            for (i, &size) in sizes.iter().enumerate() {
                step(format!("pipe {backend} {}", crate::report::human_bytes(size as u64)));
                let meter = StageMeter::start();
                let mut r = Record::rtt("pipe", backend.clone(), size, pipe_rtt(&pipe, size, budget).await?);
                r.stages = Some(meter.stop());
                // Like with like: a round trip whose bytes cross shared memory against the raw
                // shared-memory ping-pong, one that crosses TCP (any pipe over TCP, and
                // multilane's lanes from a lane piece up) against raw TCP, both of this size.
                let over_tcp = pipe.info().transport != "shm"
                    || (channel == ChannelKind::MultiLane && size >= sluice_channel::channel::multilane::MIN_PIECE);
                r.against(if over_tcp { &raw_rtt[i] } else { &shm_rtt[i] });
                out.push(r);
                let meter = StageMeter::start();
                let (g, n) = pipe_bw(&pipe, size, budget).await?;
                let mut r = Record::bw("pipe", backend.clone(), size, g, n);
                r.stages = Some(meter.stop());
                let over_tcp = pipe.info().transport != "shm"
                    || (channel == ChannelKind::MultiLane && size >= sluice_channel::channel::multilane::MIN_PIECE);
                r.against(if over_tcp { &raw_bw[i] } else { &memcpy[i] });
                out.push(r);
            }
        }
    }

    if options.wants("pipe") && !dir.busy.is_empty() && !dir.shm.is_empty() {
        // Busy polling, both sides: the same round trips with no side ever parking.
        for channel in [ChannelKind::Basic, ChannelKind::Cma] {
            let ctx = Context::new(ContextOptions {
                transports: vec![TransportKind::Shm],
                channels: vec![channel],
                shm: busy_shm(),
                ..ContextOptions::default()
            })?;
            let pipe = ctx.connect(&dir.busy).await?;
            let backend = format!("{}/{}+busy", channel, pipe.info().transport);
            for (i, &size) in sizes.iter().enumerate().filter(|(_, &s)| s <= BUSY_MAX) {
                step(format!("pipe {backend} {}", crate::report::human_bytes(size as u64)));
                let mut r = Record::rtt("pipe", backend.clone(), size, pipe_rtt(&pipe, size, budget).await?);
                r.against(&shm_rtt[i]);
                out.push(r);
            }
        }
    }

    if options.wants("idle") {
        step("idle pipe".into());
        out.push(idle_cpu(addr, options.idle_seconds, false).await?);
        if !dir.busy.is_empty() && !dir.shm.is_empty() {
            // What busy polling costs: a core while a receive waits.
            out.push(idle_cpu(&dir.busy, options.idle_seconds, true).await?);
        }
    }
    bar.finish_and_clear();
    Ok(out)
}

pub async fn transport_rtt<T: Transport>(t: &T, addr: &str, size: usize, budget: Duration) -> anyhow::Result<Vec<f64>> {
    let (mut r, mut w) = t.connect(addr).await?.split();
    w.write(&[b"echo"]).await?;
    let out = vec![7u8; size];
    let mut back = vec![0u8; size];
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < MAX_RTT_SAMPLES && (start.elapsed() < budget || samples.len() < 3) {
        let t0 = Instant::now();
        w.write(&[&out]).await?;
        r.read(&mut back).await?;
        samples.push(t0.elapsed().as_nanos() as f64);
    }
    Ok(samples)
}

pub async fn transport_bw<T: Transport>(
    t: &T,
    addr: &str,
    size: usize,
    budget: Duration,
) -> anyhow::Result<(f64, u64)> {
    let (mut r, mut w) = t.connect(addr).await?.split();
    w.write(&[b"sink"]).await?;
    let out = vec![7u8; size.max(1)];
    let batch = raw::batch_for(size);
    let mut ack = [0u8; 1];
    // One empty round trip first, so the sink's setup is not timed.
    w.write(&[]).await?;
    r.read(&mut ack).await?;
    let start = Instant::now();
    let mut n = 0u64;
    while n < 3 || start.elapsed() < budget {
        for _ in 0..batch {
            w.write(&[&out]).await?;
        }
        w.write(&[]).await?;
        r.read(&mut ack).await?;
        n += batch as u64;
    }
    Ok((size.max(1) as f64 * n as f64 / start.elapsed().as_secs_f64() / 1e9, n))
}

fn tensor_message(tag: &'static [u8], data: &Bytes) -> Message {
    Message {
        metadata: Bytes::from_static(tag),
        payloads: Vec::new(),
        tensors: vec![Tensor::cpu(data.clone())],
    }
}

pub async fn pipe_rtt(pipe: &Pipe, size: usize, budget: Duration) -> anyhow::Result<Vec<f64>> {
    let data = Bytes::from(vec![7u8; size]);
    message_rtt(pipe, &tensor_message(b"echo", &data), budget).await
}

/// Round trips of `message` through the peer's echo, receiving into reused memory.
pub async fn message_rtt(pipe: &Pipe, message: &Message, budget: Duration) -> anyhow::Result<Vec<f64>> {
    let mut alloc: Option<Allocation> = None;
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < MAX_RTT_SAMPLES && (start.elapsed() < budget || samples.len() < 3) {
        let t0 = Instant::now();
        pipe.write(message).await?;
        let (_, got) = pipe
            .read_message(|d| Ok(alloc.take().unwrap_or_else(|| Allocation::for_descriptor(d))))
            .await?;
        // Private memory is reused; memory the pipe lent (a shared segment) goes back to the
        // sender now, as a caller done with its reply gives it back (the agent's echo drops
        // each reply too): held until the next reply, it would keep the sender off its
        // segment's warm memory.
        if got
            .tensors
            .iter()
            .all(|t| matches!(t, sluice_channel::RecvBuffer::Cpu(_)))
        {
            alloc = Some(got);
        }
        samples.push(t0.elapsed().as_nanos() as f64);
    }
    Ok(samples)
}

async fn pipe_bw(pipe: &Pipe, size: usize, budget: Duration) -> anyhow::Result<(f64, u64)> {
    let data = Bytes::from(vec![7u8; size]);
    let message = tensor_message(b"bw", &data);
    let ack = Message {
        metadata: Bytes::from_static(b"ack"),
        ..Message::default()
    };
    let batch = raw::batch_for(size);
    let start = Instant::now();
    let mut n = 0u64;
    while n < 3 || start.elapsed() < budget {
        for _ in 0..batch {
            pipe.write(&message).await?;
        }
        pipe.write(&ack).await?;
        let d = pipe.read_descriptor().await?;
        pipe.read(Allocation::for_descriptor(&d)).await?;
        n += batch as u64;
    }
    Ok((size as f64 * n as f64 / start.elapsed().as_secs_f64() / 1e9, n))
}

fn cpu_seconds() -> f64 {
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).expect("getrusage");
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(usage.user_time()) + t(usage.system_time())
}

/// CPU used by this process while one pipe (default negotiation) sits idle with a receive
/// pending, as a percentage of one core; `busy`: with busy polling (shared memory only).
async fn idle_cpu(addr: &str, seconds: f64, busy: bool) -> anyhow::Result<Record> {
    let ctx = Context::new(ContextOptions {
        transports: if busy {
            vec![TransportKind::Shm]
        } else {
            vec![TransportKind::Shm, TransportKind::Tcp]
        },
        shm: if busy { busy_shm() } else { ShmOptions::default() },
        ..ContextOptions::default()
    })?;
    let pipe = ctx.connect(addr).await?;
    let busy = if busy { "+busy" } else { "" };
    let backend = format!("{}/{}{busy}", pipe.info().cpu_channel, pipe.info().transport);
    let waiter = tokio::spawn({
        let pipe = pipe.clone();
        async move { pipe.read_descriptor().await }
    });
    // Let the spin budget run out first.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (c0, t0) = (cpu_seconds(), Instant::now());
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let percent = 100.0 * (cpu_seconds() - c0) / t0.elapsed().as_secs_f64();
    waiter.abort();
    pipe.close();
    Ok(Record {
        suite: "idle",
        backend,
        metric: "cpu",
        bytes: 0,
        p50_ns: None,
        p99_ns: None,
        gbps: None,
        cpu_percent: Some(percent),
        per_second: None,
        iterations: 1,
        baseline: String::new(),
        ratio: None,
        stages: None,
    })
}
