//! Where a small message's time goes in the pipe: 64 B tensor and empty-message round trips
//! through the bench peer's echo (a second process: this binary with `peer`), for a fixed time,
//! so a profiler (`perf record -g --call-graph dwarf`) sees the steady state only.
//!
//! `cargo run --release -p sluice-benches --example pipe_small -- [SECONDS] [basic|cma] [tensor|empty]`
//!
//! `... --example pipe_small -- transport [SECONDS]` runs 64 B round trips on the shared-memory
//! transport itself instead (adaptive, then busy-polling), against the same echo.
//!
//! `... --example pipe_small -- stream [SECONDS] [MIB]` streams MIB-sized frames (default 1)
//! through the shared-memory transport into the peer's sink, in runs of 300 ms (the bench's
//! `shm bw` row), each after a run of the raw cross-core stream of the same size, printing both
//! rates and where the transport's waiting went.
//!
//! `... --example pipe_small -- cost [SECONDS] [tensor|empty]` measures instead the CPU cost of
//! one write and one read with nothing to wait for: a pipe to itself in this process, 64
//! messages written, then read (for SECONDS each, default 1; one kind only if named).
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use sluice_channel::{ChannelKind, Context, ContextOptions, Message};

fn p50(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("peer") {
        return sluice_benches::peer::serve("127.0.0.1:0", |a| println!("{a}")).await;
    }
    if args.get(1).map(String::as_str) == Some("cost") {
        let seconds: f64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1.0);
        return cost(seconds, args.get(3).map(String::as_str)).await;
    }
    let transport_only = args.get(1).map(String::as_str) == Some("transport");
    let stream_only = args.get(1).map(String::as_str) == Some("stream");
    let args: Vec<String> = if transport_only || stream_only {
        args[1..].to_vec()
    } else {
        args
    };
    let seconds: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let channel = match args.get(2).map(String::as_str) {
        Some("cma") => ChannelKind::Cma,
        _ => ChannelKind::Basic,
    };
    // `tensor` or `empty` runs only that half (for counting calls per round trip).
    let only = args.get(3).map(String::as_str);
    let mut child = Command::new(std::env::current_exe()?)
        .arg("peer")
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    if transport_only {
        return transport(line.trim(), seconds, child).await;
    }
    if stream_only {
        let mib: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
        return stream(line.trim(), seconds, mib << 20, child).await;
    }
    let ctx = Context::new(ContextOptions {
        channels: vec![channel],
        ..ContextOptions::default()
    })?;
    let pipe = ctx.connect(line.trim()).await?;
    let budget = Duration::from_secs_f64(seconds / 2.0);
    // Each call stops at the bench's sample cap: repeat until the budget is spent.
    let mut tensor = Vec::new();
    let start = std::time::Instant::now();
    while start.elapsed() < budget && only != Some("empty") {
        tensor.extend(sluice_benches::run::pipe_rtt(&pipe, 64, budget).await?);
    }
    let empty = Message {
        metadata: Bytes::from_static(b"echo"),
        ..Message::default()
    };
    let mut bare = Vec::new();
    let start = std::time::Instant::now();
    while start.elapsed() < budget && only != Some("tensor") {
        bare.extend(sluice_benches::run::message_rtt(&pipe, &empty, budget).await?);
    }
    println!(
        "{channel}/{}: 64 B tensor p50 {:.2} µs ({} samples), empty message p50 {:.2} µs ({} samples)",
        pipe.info().transport,
        p50(tensor.clone()).max(0.0) / 1e3,
        tensor.len(),
        p50(bare.clone()) / 1e3,
        bare.len()
    );
    child.kill()?;
    Ok(())
}

/// 64 B round trips on the shm transport, adaptive then busy-polling, for `seconds` in all.
async fn transport(peer: &str, seconds: f64, mut child: std::process::Child) -> anyhow::Result<()> {
    use sluice_transport::shm::ShmTransport;
    let (shm, shm_busy) = sluice_benches::run::shm_addresses(peer).await?;
    let budget = Duration::from_secs_f64(seconds / 2.0);
    for (name, options, addr) in [
        ("shm", sluice_transport::shm::ShmOptions::default(), shm),
        ("shm+busy", sluice_benches::run::busy_shm(), shm_busy),
    ] {
        let t = ShmTransport::new(options);
        let mut samples = Vec::new();
        let start = std::time::Instant::now();
        while start.elapsed() < budget {
            samples.extend(sluice_benches::run::transport_rtt(&t, &addr, 64, budget).await?);
        }
        println!(
            "{name}: 64 B p50 {:.3} µs ({} samples)",
            p50(samples.clone()) / 1e3,
            samples.len()
        );
    }
    child.kill()?;
    Ok(())
}

async fn stream(peer: &str, seconds: f64, size: usize, mut child: std::process::Child) -> anyhow::Result<()> {
    use sluice_transport::shm::ShmTransport;
    let (shm, _) = sluice_benches::run::shm_addresses(peer).await?;
    let t = ShmTransport::default();
    let start = std::time::Instant::now();
    while start.elapsed().as_secs_f64() < seconds {
        let (raw, _) =
            tokio::task::spawn_blocking(move || sluice_benches::raw::shm_copy_stream(size, Duration::from_millis(300)))
                .await?;
        let meter = sluice_benches::report::StageMeter::start();
        let (gbps, n) = sluice_benches::run::transport_bw(&t, &shm, size, Duration::from_millis(300)).await?;
        println!(
            "{gbps:6.2} GB/s ({:.2}x the raw stream's {raw:.2} just before), {n} frames, {:?}",
            gbps / raw,
            meter.stop()
        );
    }
    child.kill()?;
    Ok(())
}

/// Nanoseconds per write and per read of a 64 B tensor message and of an empty one, with the
/// ring holding a batch (nothing waits), on a basic/shm pipe within this process.
async fn cost(seconds: f64, only: Option<&str>) -> anyhow::Result<()> {
    use sluice_channel::{Allocation, Tensor, TransportKind};
    let options = ContextOptions {
        transports: vec![TransportKind::Shm],
        channels: vec![ChannelKind::Basic],
        ..ContextOptions::default()
    };
    let server = Context::new(options.clone())?;
    let client = Context::new(options)?;
    let mut listener = server.listen("").await?;
    let addr = listener.address().to_owned();
    let (a, b) = tokio::join!(client.connect(&addr), listener.accept());
    let (a, b) = (a?, b?);
    let tensor = Message {
        metadata: Bytes::from_static(b"echo"),
        payloads: Vec::new(),
        tensors: vec![Tensor::cpu(Bytes::from(vec![7u8; 64]))],
    };
    let empty = Message {
        metadata: Bytes::from_static(b"echo"),
        ..Message::default()
    };
    for (name, message) in [("64 B tensor", &tensor), ("empty", &empty)] {
        if only.is_some_and(|o| !name.contains(o)) {
            continue;
        }
        const BATCH: usize = 64;
        let (mut write_ns, mut read_ns, mut n) = (0u128, 0u128, 0usize);
        let mut alloc: Option<Allocation> = None;
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs_f64(seconds) {
            let t = std::time::Instant::now();
            for _ in 0..BATCH {
                a.write(message).await?;
            }
            write_ns += t.elapsed().as_nanos();
            let t = std::time::Instant::now();
            for _ in 0..BATCH {
                let (_, got) = b
                    .read_message(|d| Ok(alloc.take().unwrap_or_else(|| Allocation::for_descriptor(d))))
                    .await?;
                alloc = Some(got);
            }
            read_ns += t.elapsed().as_nanos();
            n += BATCH;
        }
        println!(
            "{name}: write {:.0} ns, read {:.0} ns ({n} messages)",
            write_ns as f64 / n as f64,
            read_ns as f64 / n as f64
        );
    }
    Ok(())
}
