//! Where a no-op `rpc_sync`'s time goes: round trips to a second agent process (this binary
//! with `peer STORE`) for a fixed time, for a profiler (`perf record -g`) to see the steady
//! state only.
//!
//! `cargo run --release -p sluice-benches --example rpc_small -- [SECONDS] [async]`: with
//! `async`, `rpc_async` no-ops with 64 in flight from a plain thread (the bench's
//! `rpc_async-64` row) instead of one `rpc_sync` at a time.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice_agent::{Agent, Payload};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("peer") {
        return sluice_benches::rpc::worker(&args[2]);
    }
    let seconds: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let store = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.to_string()
    };
    let mut child = Command::new(std::env::current_exe()?)
        .args(["peer", &store])
        .stdin(Stdio::null())
        .spawn()?;
    let options = sluice_benches::rpc::agent_options("bench", "bench-peer", 0, &store);
    let agent = Agent::init(options, sluice_benches::rpc::registry())?;
    let empty = Payload::empty();
    for _ in 0..10_000 {
        agent.rpc_sync(1u32, "noop", empty.clone())?;
    }
    if args.get(2).map(String::as_str) == Some("async") {
        let mut window = std::collections::VecDeque::with_capacity(64);
        let mut done = 0u64;
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs_f64(seconds) {
            while window.len() < 64 {
                window.push_back(agent.rpc_async(1u32, "noop", empty.clone()));
            }
            window.pop_front().expect("a call in flight").wait()?;
            done += 1;
        }
        for f in window {
            f.wait()?;
        }
        println!(
            "rpc_async no-op, 64 in flight: {:.0} calls/s",
            done as f64 / start.elapsed().as_secs_f64()
        );
        agent.shutdown()?;
        child.wait()?;
        return Ok(());
    }
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        let t = Instant::now();
        agent.rpc_sync(1u32, "noop", empty.clone())?;
        samples.push(t.elapsed().as_nanos() as f64);
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    println!(
        "rpc_sync no-op p50 {:.2} µs ({} calls)",
        samples[samples.len() / 2] / 1e3,
        samples.len()
    );
    agent.shutdown()?;
    child.wait()?;
    Ok(())
}
