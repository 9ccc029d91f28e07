//! The soak: many workers on this host, every one calling random others with a fixed number of
//! calls in flight, mixed sizes, for a fixed time. A load benchmark, not a test; it proves with
//! sequence accounting that no reply was lost, duplicated or misdelivered, and samples every
//! worker's resident memory to show it stays flat.
//!
//! Each call carries (caller, sequence number, destination, a checksum of its bytes); the
//! handler echoes them with its own name and the bytes. The caller checks that the reply
//! belongs to the very call it completes (same sequence, same destination, same checksum) and
//! that each sequence number completes exactly once. At the end every worker reports to rank 0:
//! calls sent and completed, errors, bad replies, latencies, and its memory over time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sluice_agent::{Agent, AgentOptions, CallContext, HandlerError, Payload, Registry, Tensor};

/// What to run.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    pub workers: u32,
    pub in_flight: u32,
    pub seconds: f64,
    /// How long the two-process baseline runs before the load.
    pub baseline_seconds: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WorkerReport {
    pub name: String,
    pub sent: u64,
    pub completed: u64,
    pub errors: u64,
    pub bad_replies: u64,
    pub duplicates: u64,
    pub outstanding_at_end: u64,
    pub bytes: u64,
    /// A uniform sample of the calls: (tensor size, round trip, request leg, resume), in
    /// microseconds. The request leg runs from the call's start to its handler's start (the
    /// host's monotonic clock, read in both processes); the rest of the round trip is the
    /// reply leg, whose last part, the resume, runs from the agent completing the call (its
    /// wake-up of the waiting task) to that task running again: the load's own queue.
    pub latencies_us: Vec<Sample>,
    /// Private resident memory (`RssAnon`) in KiB, sampled about every second.
    pub rss_kib: Vec<u64>,
    /// Resident shared memory (`RssShmem`, the rings) in KiB, sampled with it.
    pub shm_kib: Vec<u64>,
}

/// One sampled call: (tensor size, round trip, request leg, resume) in µs (see
/// [`WorkerReport::latencies_us`]).
pub type Sample = (u32, u32, u32, u32);

/// Records the moment a call's task is woken: the agent completing the call, which wakes the
/// task that awaits it. The wrapped future is polled with a waker that stamps the host's
/// monotonic clock (the first wake-up only) before it wakes the task.
struct WakeStamped<F> {
    inner: F,
    woken_ns: Arc<AtomicU64>,
}

struct StampingWaker {
    woken_ns: Arc<AtomicU64>,
    task: std::task::Waker,
}

impl std::task::Wake for StampingWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let _ = self
            .woken_ns
            .compare_exchange(0, now_ns(), Ordering::Relaxed, Ordering::Relaxed);
        self.task.wake_by_ref();
    }
}

impl<F: std::future::Future + Unpin> std::future::Future for WakeStamped<F> {
    type Output = F::Output;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        let waker = std::task::Waker::from(Arc::new(StampingWaker {
            woken_ns: self.woken_ns.clone(),
            task: cx.waker().clone(),
        }));
        std::pin::Pin::new(&mut self.inner).poll(&mut std::task::Context::from_waker(&waker))
    }
}

#[derive(Serialize, Deserialize)]
struct Call {
    caller: u32,
    seq: u64,
    dest: String,
    checksum: u64,
    /// The caller's monotonic clock when the call started, in ns.
    sent_ns: u64,
}

#[derive(Serialize, Deserialize)]
struct Echo {
    caller: u32,
    seq: u64,
    responder: String,
    checksum: u64,
    /// The responder's monotonic clock when its handler started, in ns.
    served_ns: u64,
}

/// The host's monotonic clock in ns: one clock for every process here, so one process's
/// reading can be subtracted from another's.
fn now_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map_or(0, |t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
}

fn checksum(b: &[u8]) -> u64 {
    // FNV-1a over a stride of the bytes (every byte for small messages).
    let step = (b.len() / 4096).max(1);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in b.iter().step_by(step) {
        h ^= *x as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^ b.len() as u64
}

/// 70% 64 B, 20% 4 KiB, 9% 64 KiB, 1% 1 MiB.
fn size_for(r: u64) -> usize {
    match r % 100 {
        0 => 1 << 20,
        1..=9 => 64 << 10,
        10..=29 => 4 << 10,
        _ => 64,
    }
}

/// Resident memory in KiB: private (`RssAnon`, the heap) and shared (`RssShmem`: the rings and
/// the tensor segments, as far as this process has them mapped in). Shared pages are counted in
/// every process that maps them, so the sum over workers overstates the memory; its growth is
/// still the growth of what the workers map in (each receiver's segment holds its recent bursts
/// of bytes in flight, giving idle blocks back after some seconds, and every sender maps in
/// what it writes).
fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (kib_field(&status, "RssAnon:"), kib_field(&status, "RssShmem:"))
}

/// The host's shared memory in KiB (`Shmem:` in `/proc/meminfo`: memory files and tmpfs, each
/// page once); 0 where it cannot be read.
fn host_shmem_kib() -> u64 {
    kib_field(&std::fs::read_to_string("/proc/meminfo").unwrap_or_default(), "Shmem:")
}

/// The number after `name` in a `/proc` file of `name value kB` lines; 0 when absent.
fn kib_field(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

fn registry(reports: Arc<Mutex<Vec<WorkerReport>>>) -> Registry {
    let mut r = Registry::new();
    r.raw_handler("soak.echo", |cx: &CallContext, mut payload: Payload| {
        let served_ns = now_ns();
        let call: Call = payload
            .decode()
            .map_err(|e| HandlerError::new("Decode", e.to_string()))?;
        let data = payload.take_tensors();
        let echo = Echo {
            caller: call.caller,
            seq: call.seq,
            responder: cx.agent.info().name.clone(),
            checksum: call.checksum,
            served_ns,
        };
        let reply = Payload::encode(&echo).map_err(|e| HandlerError::new("Encode", e.to_string()))?;
        Ok(reply.with_tensors(data))
    });
    r.handler("soak.noop", |_, (): ()| Ok(()));
    r.handler("soak.report", move |_, report: WorkerReport| {
        reports.lock().unwrap().push(report);
        Ok(())
    });
    r
}

/// What one call loop saw. Each loop owns its own: the loops share no lock (a blocking lock
/// inside an async task stalls the runtime thread under it, which is how an earlier version of
/// this soak measured its own sampler instead of the agent).
#[derive(Default)]
struct LaneStats {
    sent: u64,
    completed: u64,
    errors: u64,
    bad_replies: u64,
    duplicates: u64,
    bytes: u64,
    latencies_us: Vec<Sample>,
}

/// Latency samples kept per worker, shared out over its call loops; each loop keeps a uniform
/// sample of its calls (reservoir sampling). The reservoirs are allocated and touched before
/// the first call, so the soak's own bookkeeping adds nothing to the memory growth it reports
/// (filling 1 Mi samples as calls came in grew a 16-worker run's sum by ~2.5 MiB a worker).
const LATENCIES_PER_WORKER: usize = 1 << 16;

/// One worker's load: `in_flight` concurrent call loops to random peers until `stop`.
fn drive(agent: &Agent, in_flight: u32, stop: Arc<AtomicBool>, peers: Vec<String>) -> WorkerReport {
    let me = agent.info().clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let next_seq = Arc::new(AtomicU64::new(0));
    // The sampler owns its samples and hands them over when it ends.
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut anon, mut shm) = (Vec::new(), Vec::new());
            while !stop.load(Ordering::Acquire) {
                let (a, s) = rss_kib();
                anon.push(a);
                shm.push(s);
                // Sleep in short steps, so the end of the run is not held up.
                for _ in 0..10 {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            (anon, shm)
        })
    };
    // One buffer per size, made once: every call sends a reference to it (no copy).
    let data: Vec<Bytes> = [64usize, 4 << 10, 64 << 10, 1 << 20]
        .iter()
        .map(|&n| Bytes::from((0..n).map(|i| (i as u64 ^ me.id as u64) as u8).collect::<Vec<u8>>()))
        .collect();
    let lanes: Vec<LaneStats> = runtime.block_on(async {
        let mut tasks = Vec::new();
        for lane in 0..in_flight {
            let (agent, stop, peers, data) = (agent.clone(), stop.clone(), peers.clone(), data.clone());
            let next_seq = next_seq.clone();
            let id = me.id;
            let keep = (LATENCIES_PER_WORKER / in_flight.max(1) as usize).max(16);
            tasks.push(tokio::spawn(async move {
                let mut st = LaneStats::default();
                st.latencies_us.resize(keep, (0, 0, 0, 0));
                let woken_ns = Arc::new(AtomicU64::new(0));
                st.latencies_us.clear();
                // The highest sequence number echoed so far: a loop's sequence numbers only
                // grow, so an echo that does not is a duplicate or stale reply.
                let mut last_echoed: Option<u64> = None;
                let mut r = (lane as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ id as u64;
                while !stop.load(Ordering::Acquire) {
                    r ^= r << 13;
                    r ^= r >> 7;
                    r ^= r << 17;
                    let dest = &peers[(r % peers.len() as u64) as usize];
                    let size = size_for(r >> 8);
                    let bytes = data.iter().find(|b| b.len() == size).cloned().unwrap_or_default();
                    let seq = next_seq.fetch_add(1, Ordering::Relaxed);
                    let sum = checksum(&bytes);
                    let sent_ns = now_ns();
                    let call = Call {
                        caller: id,
                        seq,
                        dest: dest.clone(),
                        checksum: sum,
                        sent_ns,
                    };
                    let payload = Payload::encode(&call)
                        .unwrap()
                        .with_tensors(vec![Tensor::cpu(bytes.clone())]);
                    st.sent += 1;
                    woken_ns.store(0, Ordering::Relaxed);
                    let result = WakeStamped {
                        inner: agent.rpc_async(dest.as_str(), "soak.echo", payload),
                        woken_ns: woken_ns.clone(),
                    }
                    .await;
                    let resumed_ns = now_ns();
                    let us = |ns: u64| (ns / 1000).min(u32::MAX as u64) as u32;
                    let total = us(resumed_ns.saturating_sub(sent_ns));
                    // A call complete at its first poll woke nothing: no wait to count.
                    let woken = woken_ns.load(Ordering::Relaxed);
                    let resume = if woken == 0 {
                        0
                    } else {
                        us(resumed_ns.saturating_sub(woken))
                    };
                    match result {
                        Ok(mut reply) => {
                            let echo: Option<Echo> = reply.decode().ok();
                            let back = reply.take_tensors();
                            let ok = echo.as_ref().is_some_and(|e| {
                                e.caller == id && e.seq == seq && &e.responder == dest && e.checksum == call.checksum
                            }) && back.len() == 1
                                && back[0].buffer.as_cpu().is_some_and(|b| checksum(b) == call.checksum);
                            if !ok {
                                st.bad_replies += 1;
                            }
                            if let Some(e) = &echo {
                                if last_echoed.is_some_and(|l| e.seq <= l) {
                                    st.duplicates += 1;
                                }
                                last_echoed = Some(e.seq);
                            }
                            st.completed += 1;
                            st.bytes += 2 * size as u64;
                            // A reply that did not decode has no handler stamp: no sample.
                            let Some(e) = &echo else { continue };
                            let request = us(e.served_ns.saturating_sub(sent_ns)).min(total);
                            let sample = (size as u32, total, request, resume.min(total - request));
                            if st.latencies_us.len() < keep {
                                st.latencies_us.push(sample);
                            } else {
                                let slot = (r >> 3) % st.completed;
                                if (slot as usize) < keep {
                                    st.latencies_us[slot as usize] = sample;
                                }
                            }
                        }
                        Err(e) => {
                            if st.errors < 5 {
                                eprintln!("soak: {} -> {dest}: {e}", id);
                            }
                            st.errors += 1;
                        }
                    }
                }
                st
            }));
        }
        let mut lanes = Vec::new();
        for t in tasks {
            lanes.push(t.await.unwrap_or_default());
        }
        lanes
    });
    let (rss_kib, shm_kib) = sampler.join().unwrap_or_default();
    let mut rep = WorkerReport {
        name: me.name.clone(),
        rss_kib,
        shm_kib,
        ..WorkerReport::default()
    };
    for l in lanes {
        rep.sent += l.sent;
        rep.completed += l.completed;
        rep.errors += l.errors;
        rep.bad_replies += l.bad_replies;
        rep.duplicates += l.duplicates;
        rep.bytes += l.bytes;
        rep.latencies_us.extend(l.latencies_us);
    }
    rep.outstanding_at_end = rep.sent - rep.completed - rep.errors;
    rep
}

/// The two-process baseline of the same invocation: `rpc_async` no-ops from rank 0 to rank 1
/// with 64 in flight, for `seconds`, from a plain thread. Calls per second.
fn baseline_rate(agent: &Agent, seconds: f64) -> anyhow::Result<f64> {
    const WINDOW: usize = 64;
    let empty = Payload::encode(&())?;
    let mut window = std::collections::VecDeque::with_capacity(WINDOW);
    let mut done = 0u64;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < seconds || done < 3 {
        while window.len() < WINDOW {
            window.push_back(agent.rpc_async("soak1", "soak.noop", empty.clone()));
        }
        window.pop_front().expect("a call in flight").wait()?;
        done += 1;
    }
    for f in window {
        f.wait()?;
    }
    Ok(done as f64 / start.elapsed().as_secs_f64())
}

/// Agent options shared by every soak worker.
fn agent_options(rank: u32) -> AgentOptions {
    let mut o = AgentOptions::new(format!("soak{rank}"));
    o.pool_threads = 2;
    o.io_threads = 1;
    o.default_timeout = Duration::from_secs(120);
    o.init_timeout = Duration::from_secs(120);
    o
}

/// Opens this worker's pipes before the timed load: a no-op call to every other worker. Pipes
/// open on a worker's first call to a peer, so without this the first seconds of a run with
/// many workers are a storm of N·(N−1) pipe setups (64 workers: about 4,000, some 5 s of this
/// machine's two cores) in which calls wait seconds, and a short run's rate and tail measure
/// that storm rather than calls. The setup is timed on its own ([`Summary::connect_seconds`]).
fn connect_all(agent: &Agent, workers: u32) -> anyhow::Result<()> {
    for rank in 0..workers {
        let peer = format!("soak{rank}");
        if peer != agent.info().name {
            agent.call::<_, ()>(&peer, "soak.noop", &())?;
        }
    }
    Ok(())
}

/// Runs this worker's share of the load for the soak's duration, against every other worker.
fn load(agent: &Agent, options: &SoakOptions) -> WorkerReport {
    let stop = Arc::new(AtomicBool::new(false));
    let timer = {
        let (stop, secs) = (stop.clone(), options.seconds);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs_f64(secs));
            stop.store(true, Ordering::Release);
        })
    };
    let peers: Vec<String> = (0..options.workers)
        .map(|r| format!("soak{r}"))
        .filter(|n| *n != agent.info().name)
        .collect();
    let per = (options.in_flight / options.workers).max(1);
    let report = drive(agent, per, stop, peers);
    let _ = timer.join();
    report
}

/// A soak worker process (rank ≥ 1), started by [`run`] with the torchrun variables.
pub fn worker(options: &SoakOptions) -> anyhow::Result<()> {
    let rank: u32 = std::env::var("RANK")?.parse()?;
    let agent = Agent::init(agent_options(rank), registry(Arc::default()))?;
    agent.barrier("start")?;
    connect_all(&agent, options.workers)?;
    agent.barrier("connected")?;
    let report = load(&agent, options);
    agent.call::<_, ()>("soak0", "soak.report", &report)?;
    agent.shutdown()?;
    Ok(())
}

/// The whole soak's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub workers: u32,
    pub in_flight: u32,
    /// How long every worker took to open its pipes to every other (one no-op call to each),
    /// before the timed load.
    pub connect_seconds: f64,
    pub seconds: f64,
    pub calls: u64,
    pub calls_per_second: f64,
    pub gbytes_per_second: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub errors: u64,
    pub bad_replies: u64,
    pub duplicates: u64,
    pub lost: u64,
    /// Sum over workers of private resident memory after warm-up (10 s) and at the end, and
    /// the largest end/warm-up ratio of any worker.
    pub rss_after_warmup_mib: f64,
    pub rss_end_mib: f64,
    pub worst_growth: f64,
    /// The largest end / midpoint ratio of any worker's private memory: whether memory still
    /// grows in the run's second half (flat: 1.0), whatever the warm-up took.
    pub worst_late_growth: f64,
    /// Sum over workers of resident shared memory (rings and segments as mapped by each, see
    /// `rss_kib`) after warm-up, at the midpoint and at the end.
    pub shm_after_warmup_mib: f64,
    pub shm_mid_mib: f64,
    pub shm_end_mib: f64,
    /// The host's shared memory (`Shmem:`, each page once) after warm-up, at the midpoint and
    /// at the end of the load: what the segments and rings hold.
    pub host_shm_after_warmup_mib: f64,
    pub host_shm_mid_mib: f64,
    pub host_shm_end_mib: f64,
    /// The same invocation's two-process baseline: `rpc_async` no-ops with 64 in flight from
    /// rank 0 to rank 1 (before the load), and this soak's rate against it.
    pub baseline_calls_per_second: f64,
    pub ratio_to_baseline: f64,
    /// Tail against median (waiting should be queueing, not outliers).
    pub p99_over_p50: f64,
    /// The latency by tensor size: where the tail comes from.
    pub by_size: Vec<SizeLatency>,
    /// The round trip's two legs: call start to handler start (the request: the caller's
    /// write, the callee's queue and read), and handler start to the caller's task resumed
    /// (the handler, the reply's write, the caller's read and wake-up).
    pub request_p50_us: f64,
    pub request_p99_us: f64,
    pub reply_p50_us: f64,
    pub reply_p99_us: f64,
    /// The reply leg in two: handler start to the caller's agent completing the call (the
    /// handler, the reply's write, the caller's read: Sluice's reply path), and from there to
    /// the waiting task running again (the load's own runtime queue).
    pub reply_path_p50_us: f64,
    pub reply_path_p99_us: f64,
    pub resume_p50_us: f64,
    pub resume_p99_us: f64,
}

/// Latency of the calls carrying one tensor size.
#[derive(Debug, Clone, Serialize)]
pub struct SizeLatency {
    pub bytes: u32,
    /// Calls in the sample.
    pub sampled: usize,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// The `p` quantile of sorted `v` (0 when empty).
fn quantile(v: &[u32], p: f64) -> f64 {
    v.get(((v.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0) as f64
}

/// Runs the soak as rank 0, spawning the other workers with `spawn(rank, store)`.
pub fn run(
    options: &SoakOptions,
    spawn: impl Fn(u32, &str) -> anyhow::Result<std::process::Child>,
) -> anyhow::Result<Summary> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let store = format!("127.0.0.1:{port}");
    let mut children = Vec::new();
    for rank in 1..options.workers {
        children.push(spawn(rank, &store)?);
    }
    let reports = Arc::new(Mutex::new(Vec::new()));
    let agent = Agent::init(
        agent_options(0).rank(0, options.workers).store(&store),
        registry(reports.clone()),
    )?;
    // Every other worker waits at the barrier (parked) while ranks 0 and 1 measure the baseline.
    let baseline = baseline_rate(&agent, options.baseline_seconds)?;
    agent.barrier("start")?;
    let connecting = Instant::now();
    connect_all(&agent, options.workers)?;
    agent.barrier("connected")?;
    let connect_seconds = connecting.elapsed().as_secs_f64();
    let started = Instant::now();
    // The host's shared memory, sampled every second during the load: each page of the memory
    // files counted once, whichever processes map it (the workers' own `RssShmem` counts it in
    // each).
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        std::thread::spawn(move || {
            let mut kib = Vec::new();
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                kib.push(host_shmem_kib());
                std::thread::sleep(Duration::from_secs(1));
            }
            kib
        })
    };
    let mine = load(&agent, options);
    let elapsed = started.elapsed().as_secs_f64();
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let host_shm_kib = sampler.join().unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(120);
    while reports.lock().unwrap().len() < options.workers as usize - 1 {
        anyhow::ensure!(Instant::now() < deadline, "not every soak worker reported");
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.shutdown()?;
    for mut c in children {
        let status = c.wait()?;
        anyhow::ensure!(status.success(), "a soak worker failed: {status}");
    }
    let mut all = reports.lock().unwrap().clone();
    all.push(mine);
    let sorted = |f: fn(&Sample) -> u32| {
        let mut v: Vec<u32> = all.iter().flat_map(|r| r.latencies_us.iter().map(f)).collect();
        v.sort_unstable();
        v
    };
    let latencies = sorted(|l| l.1);
    let pct = |p: f64| quantile(&latencies, p);
    let (request, reply) = (sorted(|l| l.2), sorted(|l| l.1 - l.2));
    let (reply_path, resume) = (sorted(|l| l.1 - l.2 - l.3), sorted(|l| l.3));
    let mut sizes: Vec<u32> = all.iter().flat_map(|r| r.latencies_us.iter().map(|l| l.0)).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let by_size = sizes
        .into_iter()
        .map(|bytes| {
            let mut v: Vec<u32> = all
                .iter()
                .flat_map(|r| r.latencies_us.iter().filter(|l| l.0 == bytes).map(|l| l.1))
                .collect();
            v.sort_unstable();
            SizeLatency {
                bytes,
                sampled: v.len(),
                p50_us: quantile(&v, 0.5),
                p99_us: quantile(&v, 0.99),
            }
        })
        .collect();
    let warm_of = |v: &[u64]| v.get(10.min(v.len().saturating_sub(1))).copied().unwrap_or(0);
    let mid_of = |v: &[u64]| v.get(v.len() / 2).copied().unwrap_or(0);
    let end_of = |v: &[u64]| v.last().copied().unwrap_or(0);
    let warm = |r: &WorkerReport| warm_of(&r.rss_kib);
    let end = |r: &WorkerReport| end_of(&r.rss_kib);
    let mid = |r: &WorkerReport| mid_of(&r.rss_kib);
    let shm_mib = |at: &dyn Fn(&[u64]) -> u64| all.iter().map(|r| at(&r.shm_kib)).sum::<u64>() as f64 / 1024.0;
    // The largest end / `from` ratio of any worker.
    let worst = |from: &dyn Fn(&WorkerReport) -> u64| {
        all.iter()
            .map(|r| end(r) as f64 / from(r).max(1) as f64)
            .fold(0.0, f64::max)
    };
    let calls: u64 = all.iter().map(|r| r.completed).sum();
    let rate = calls as f64 / elapsed;
    Ok(Summary {
        workers: options.workers,
        connect_seconds,
        in_flight: (options.in_flight / options.workers).max(1) * options.workers,
        seconds: elapsed,
        calls,
        calls_per_second: rate,
        baseline_calls_per_second: baseline,
        ratio_to_baseline: rate / baseline.max(1e-9),
        p99_over_p50: pct(0.99) / pct(0.50).max(1.0),
        gbytes_per_second: all.iter().map(|r| r.bytes).sum::<u64>() as f64 / elapsed / 1e9,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        errors: all.iter().map(|r| r.errors).sum(),
        bad_replies: all.iter().map(|r| r.bad_replies).sum(),
        duplicates: all.iter().map(|r| r.duplicates).sum(),
        lost: all.iter().map(|r| r.outstanding_at_end).sum(),
        rss_after_warmup_mib: all.iter().map(warm).sum::<u64>() as f64 / 1024.0,
        rss_end_mib: all.iter().map(end).sum::<u64>() as f64 / 1024.0,
        shm_after_warmup_mib: shm_mib(&warm_of),
        shm_mid_mib: shm_mib(&mid_of),
        shm_end_mib: shm_mib(&end_of),
        host_shm_after_warmup_mib: warm_of(&host_shm_kib) as f64 / 1024.0,
        host_shm_mid_mib: mid_of(&host_shm_kib) as f64 / 1024.0,
        host_shm_end_mib: end_of(&host_shm_kib) as f64 / 1024.0,
        worst_growth: worst(&warm),
        worst_late_growth: worst(&mid),
        by_size,
        request_p50_us: quantile(&request, 0.5),
        request_p99_us: quantile(&request, 0.99),
        reply_p50_us: quantile(&reply, 0.5),
        reply_p99_us: quantile(&reply, 0.99),
        reply_path_p50_us: quantile(&reply_path, 0.5),
        reply_path_p99_us: quantile(&reply_path, 0.99),
        resume_p50_us: quantile(&resume, 0.5),
        resume_p99_us: quantile(&resume, 0.99),
    })
}
