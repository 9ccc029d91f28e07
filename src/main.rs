//! The `sluice` command line: `sluice bench` measures every transport and pipe channel against
//! raw baselines measured in the same run.

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use sluice_benches::{report, BenchOptions};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Moves tensors between processes over the fastest path each pair of peers shares"
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Round-trip latency and bandwidth of every transport and channel, with raw baselines of
    /// the same size and medium, and the peers (OpenMPI, PyTorch RPC) where installed.
    ///
    /// Without --listen/--connect it spawns its own peer process on localhost.
    /// `sluice bench compare OLD.jsonl NEW.jsonl` compares two recorded runs instead.
    Bench {
        /// Suites to run, as words (`sluice bench rpc peers`); the same as --suites. Or
        /// `compare OLD.jsonl NEW.jsonl`.
        #[arg(value_name = "SUITE")]
        only: Vec<String>,
        /// Write a page with figures to DIR/index.html (and the figures as SVG files beside it).
        #[arg(long, value_name = "DIR")]
        report: Option<std::path::PathBuf>,
        /// Also write the JSON lines to benches/results/DATE-COMMIT.jsonl (in this checkout).
        #[arg(long)]
        record: bool,
        /// With `compare`: flag rows whose figure moved by more than this many percent.
        #[arg(long, default_value_t = 10.0)]
        threshold: f64,
        /// Short smoke run: three sizes, short budgets.
        #[arg(long)]
        quick: bool,
        /// Write one JSON object per result to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<std::path::PathBuf>,
        /// Run only the peer side, listening on ADDR (e.g. 0.0.0.0:7000) until killed.
        #[arg(long, value_name = "ADDR", conflicts_with = "connect")]
        listen: Option<String>,
        /// Measure against a peer started elsewhere with --listen.
        #[arg(long, value_name = "ADDR")]
        connect: Option<String>,
        /// Comma-separated suites: raw, transport, pipe, idle, rpc, collective (allreduce against
        /// Gloo where torch is installed), autograd, cuda (the cuda
        /// suite says so and measures nothing without a GPU), ibverbs (on the verbs model where
        /// there is no RDMA device), peers (OpenMPI and PyTorch RPC, each skipped with the
        /// reason where not installed).
        #[arg(
            long,
            default_value = "raw,transport,pipe,idle,rpc,collective,autograd,cuda,ibverbs,peers",
            value_delimiter = ','
        )]
        suites: Vec<String>,
        /// Internal: run as the cuda suite's peer, connecting to ADDR.
        #[arg(long, value_name = "ADDR", hide = true)]
        cuda_peer: Option<String>,
        /// Internal: the channels the cuda suite's peer offers.
        #[arg(long, value_name = "LIST", hide = true, default_value = "")]
        cuda_channels: String,
        /// Internal: run as rank 1 of the rpc suite, with the store at ADDR.
        #[arg(long, value_name = "ADDR", hide = true)]
        rpc_worker: Option<String>,
        /// Internal: run as a rank of the collective suite (STORE,RANK,WORLD,QUICK).
        #[arg(long, value_name = "SPEC", hide = true)]
        collective_worker: Option<String>,
        /// Seconds over which the idle pipe's CPU use is measured (default 5, 1 with --quick).
        #[arg(long)]
        idle_seconds: Option<f64>,
    },
    /// Starts a job's workers on this host: `sluice launch --nproc 4 -- CMD`, or roles with
    /// `--role ps=1 --role trainer=4 -- CMD`.
    Launch(sluice::launch::LaunchArgs),
    /// Load soak: N workers on this host calling each other with many calls in flight, mixed
    /// sizes, with sequence accounting (no reply lost, duplicated or misdelivered) and memory
    /// sampling. A benchmark, not a test.
    Soak {
        /// Workers per run; a list (`--workers 2,16,64`) runs one soak per entry in this
        /// invocation and reports each run's rate against the first's.
        #[arg(long, value_delimiter = ',', default_value = "16")]
        workers: Vec<u32>,
        /// Calls in flight across the whole group.
        #[arg(long, default_value_t = 10_000)]
        in_flight: u32,
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// Append the summary as one JSON object to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<std::path::PathBuf>,
        /// Internal: run as one of the soak's workers.
        #[arg(long, hide = true)]
        worker: bool,
    },
    /// Training demos over distributed autograd (each starts its own worker processes).
    Demo {
        #[command(subcommand)]
        demo: sluice::demos::DemoCommand,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if let Some(result) = sluice::demos::child_main() {
        return result;
    }
    let command = Cli::parse().command;
    if let Commands::Soak {
        workers,
        in_flight,
        seconds,
        json,
        worker,
    } = command
    {
        anyhow::ensure!(
            !workers.is_empty() && workers.iter().all(|&w| w >= 2),
            "a soak needs at least two workers"
        );
        let options = |workers: u32| sluice_benches::soak::SoakOptions {
            workers,
            in_flight,
            seconds,
            baseline_seconds: 2.0,
        };
        if worker {
            return sluice_benches::soak::worker(&options(workers[0]));
        }
        let mut summaries = Vec::new();
        for &n in &workers {
            eprintln!("soak: {n} workers, {in_flight} calls in flight, {seconds} s");
            let summary = sluice_benches::soak::run(&options(n), |rank, store| {
                Ok(Command::new(std::env::current_exe()?)
                    .args(["soak", "--worker", "--workers", &n.to_string()])
                    .args(["--in-flight", &in_flight.to_string(), "--seconds", &seconds.to_string()])
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .env("MASTER_ADDR", store.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h))
                    .env("MASTER_PORT", store.rsplit_once(':').map_or("0", |(_, p)| p))
                    .stdin(Stdio::null())
                    .spawn()?)
            })?;
            println!("{}", serde_json::to_string_pretty(&summary)?);
            if let Some(path) = &json {
                let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
                writeln!(f, "{}", serde_json::to_string(&summary)?)?;
            }
            summaries.push(summary);
        }
        let first = summaries[0].calls_per_second;
        for s in &summaries {
            eprintln!(
                "soak: {:>3} workers: {:>9.0} calls/s ({:.2}x the two-process rpc_async baseline {:.0}/s, {:.2}x the first run), p50 {:.0} us, p99 {:.0} us ({:.1}x p50), memory end/warm-up {:.2}x (end/midpoint {:.2}x), lost {}",
                s.workers,
                s.calls_per_second,
                s.ratio_to_baseline,
                s.baseline_calls_per_second,
                s.calls_per_second / first.max(1e-9),
                s.p50_us,
                s.p99_us,
                s.p99_over_p50,
                s.worst_growth,
                s.worst_late_growth,
                s.lost
            );
            let sizes: Vec<String> = s
                .by_size
                .iter()
                .map(|b| format!("{} B p50 {:.0} us p99 {:.0} us", b.bytes, b.p50_us, b.p99_us))
                .collect();
            eprintln!("soak: {:>3} workers by tensor size: {}", s.workers, sizes.join("; "));
            eprintln!(
                "soak: {:>3} workers by leg: request (call to handler) p50 {:.0} us p99 {:.0} us; reply (handler to caller resumed) p50 {:.0} us p99 {:.0} us",
                s.workers, s.request_p50_us, s.request_p99_us, s.reply_p50_us, s.reply_p99_us
            );
            eprintln!(
                "soak: {:>3} workers, the reply leg: handler to call completed p50 {:.0} us p99 {:.0} us; completed to task resumed (the load's queue) p50 {:.0} us p99 {:.0} us",
                s.workers, s.reply_path_p50_us, s.reply_path_p99_us, s.resume_p50_us, s.resume_p99_us
            );
            eprintln!(
                "soak: {:>3} workers, shared memory: the host's (Shmem) after warm-up {:.0} MiB, midpoint {:.0} MiB, end {:.0} MiB (end/midpoint {:.2}x); mapped in by the workers (RssShmem, summed) {:.0} / {:.0} / {:.0} MiB ({:.2}x)",
                s.workers,
                s.host_shm_after_warmup_mib,
                s.host_shm_mid_mib,
                s.host_shm_end_mib,
                s.host_shm_end_mib / s.host_shm_mid_mib.max(1e-9),
                s.shm_after_warmup_mib,
                s.shm_mid_mib,
                s.shm_end_mib,
                s.shm_end_mib / s.shm_mid_mib.max(1e-9)
            );
            eprintln!(
                "soak: {:>3} workers opened their pipes to each other ({} first calls) in {:.2} s before the load",
                s.workers,
                s.workers * s.workers.saturating_sub(1),
                s.connect_seconds
            );
        }
        let clean = summaries
            .iter()
            .all(|s| s.errors == 0 && s.bad_replies == 0 && s.duplicates == 0 && s.lost == 0);
        anyhow::ensure!(clean, "the soak saw errors, bad, duplicated or lost replies");
        return Ok(());
    }
    if let Commands::Launch(args) = command {
        let code = sluice::launch::launch(args)?;
        std::process::exit(code);
    }
    if let Commands::Demo { demo } = command {
        return sluice::demos::launch(demo.into());
    }
    let Commands::Bench {
        only,
        report: report_dir,
        record,
        threshold,
        quick,
        json,
        listen,
        connect,
        suites,
        idle_seconds,
        rpc_worker,
        collective_worker,
        cuda_peer,
        cuda_channels,
    } = command
    else {
        unreachable!("handled above")
    };
    if let Some(store) = rpc_worker {
        return sluice_benches::rpc::worker(&store);
    }
    if let Some(spec) = collective_worker {
        return sluice_benches::collective::worker(&spec);
    }
    if let Some(addr) = cuda_peer {
        return sluice_benches::cuda::peer(&addr, &cuda_channels);
    }
    if only.first().map(String::as_str) == Some("compare") {
        let [_, old, new] = only.as_slice() else {
            anyhow::bail!("usage: sluice bench compare OLD.jsonl NEW.jsonl [--threshold PERCENT]");
        };
        let (old, new) = (
            sluice_benches::compare::load(old.as_ref())?,
            sluice_benches::compare::load(new.as_ref())?,
        );
        let c = sluice_benches::compare::compare(&old, &new, threshold);
        print!("{}", sluice_benches::compare::table(&c, threshold));
        return Ok(());
    }
    let suites = if only.is_empty() { suites } else { only };
    const SUITES: [&str; 10] = [
        "raw",
        "transport",
        "pipe",
        "idle",
        "rpc",
        "collective",
        "autograd",
        "cuda",
        "ibverbs",
        "peers",
    ];
    for s in &suites {
        anyhow::ensure!(
            SUITES.contains(&s.as_str()),
            "unknown suite `{s}`: expected one of {} (or `compare OLD NEW`)",
            SUITES.join(", ")
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if let Some(addr) = listen {
        return runtime.block_on(sluice_benches::peer::serve(&addr, |a| {
            println!("READY {a}");
            let _ = std::io::stdout().flush();
        }));
    }
    let options = BenchOptions {
        quick,
        suites: suites.clone(),
        idle_seconds: idle_seconds.unwrap_or(if quick { 1.0 } else { 5.0 }),
    };
    let remote = connect.is_some();
    let needs_peer = suites
        .iter()
        .any(|s| !["autograd", "collective", "cuda", "ibverbs", "peers"].contains(&s.as_str()));
    let peer_suites = suites
        .iter()
        .any(|s| !["rpc", "collective", "autograd", "cuda", "ibverbs", "peers"].contains(&s.as_str()));
    let (addr, _peer) = match connect {
        Some(a) => (a, None),
        None if needs_peer => {
            let peer = PeerChild::spawn()?;
            (peer.address.clone(), Some(peer))
        }
        None => (String::new(), None),
    };
    let mut records = Vec::new();
    if peer_suites {
        records = runtime.block_on(sluice_benches::run(&options, &addr))?;
    }
    if options.suites.iter().any(|s| s == "rpc") {
        if remote {
            eprintln!("rpc suite skipped: it starts its own second worker on this host");
        } else {
            records.extend(sluice_benches::rpc::run(&options, &addr, spawn_rpc_worker)?);
        }
    }
    let mut notes = Vec::new();
    if options.suites.iter().any(|s| s == "collective") {
        if remote {
            eprintln!("collective suite skipped: it starts its own ranks on this host");
        } else {
            let (r, n) = sluice_benches::collective::run(&options, spawn_collective_worker)?;
            records.extend(r);
            notes.extend(n);
        }
    }
    if options.suites.iter().any(|s| s == "autograd") {
        if remote {
            eprintln!("autograd suite skipped: it starts its own second worker on this host");
        } else {
            records.extend(sluice_benches::autograd::run(&options, spawn_rpc_worker)?);
        }
    }
    if options.suites.iter().any(|s| s == "cuda") {
        if remote {
            eprintln!("cuda suite skipped: it starts its own peer on this host");
        } else {
            records.extend(sluice_benches::cuda::run(&options, &spawn_cuda_peer)?);
        }
    }
    if options.suites.iter().any(|s| s == "ibverbs") {
        records.extend(sluice_benches::ibverbs::run(&options)?);
    }
    let mut info = sluice_benches::page::RunInfo {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        notes,
    };
    if options.suites.iter().any(|s| s == "peers") {
        let peers = sluice_benches::peers::run(&options);
        records.extend(peers.records);
        info.notes.extend(peers.notes);
    }
    print!("{}", report::table(&records));
    // Whatever was measured is written before anything that can fail on the way out.
    let mut files: Vec<std::path::PathBuf> = json.into_iter().collect();
    if record {
        files.push(recorded_path()?);
    }
    for path in files {
        let mut f = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        for r in &records {
            writeln!(f, "{}", r.json())?;
        }
        eprintln!("wrote {} results to {}", records.len(), path.display());
    }
    if let Some(dir) = report_dir {
        let figures = sluice_benches::page::write(&dir, &records, &info)?;
        eprintln!(
            "wrote {} with {} figures ({})",
            dir.join("index.html").display(),
            figures.len(),
            figures.join(", ")
        );
    }
    Ok(())
}

/// `benches/results/DATE-COMMIT.jsonl` in the checkout this runs in.
fn recorded_path() -> anyhow::Result<std::path::PathBuf> {
    let top = Command::new("git")
        .args(["rev-parse", "--show-toplevel"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .context("--record writes into the checkout's benches/results/, and this is not a git checkout")?;
    let dir = std::path::Path::new(&top).join("benches").join("results");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let date = sluice_benches::page::now();
    let commit = sluice_benches::page::commit();
    Ok(dir.join(format!("{}-{commit}.jsonl", &date[..10])))
}

/// Starts this executable as `sluice bench ARGS` (a suite's other process), killed on drop.
fn spawn_bench_child(args: &[&str], what: &str) -> anyhow::Result<Box<dyn std::any::Any>> {
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .arg("bench")
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    Ok(Box::new(KillOnDrop(child)) as Box<dyn std::any::Any>)
}

/// Starts rank 1 of the rpc and autograd suites.
fn spawn_rpc_worker(store: &str) -> anyhow::Result<Box<dyn std::any::Any>> {
    spawn_bench_child(&["--rpc-worker", store], "the rpc worker")
}

/// Starts one rank of the collective suite.
fn spawn_collective_worker(spec: &str) -> anyhow::Result<Box<dyn std::any::Any>> {
    spawn_bench_child(&["--collective-worker", spec], "a collective worker")
}

/// Starts the cuda suite's peer, connecting to `addr` and offering `channels`.
fn spawn_cuda_peer(addr: &str, channels: &str) -> anyhow::Result<Box<dyn std::any::Any>> {
    spawn_bench_child(&["--cuda-peer", addr, "--cuda-channels", channels], "the cuda peer")
}

/// A child process killed and reaped when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // The worker leaves by itself after the graceful shutdown; this only catches failures.
        if matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The peer process `sluice bench` starts for itself; killed when dropped.
struct PeerChild {
    child: std::process::Child,
    address: String,
}

impl PeerChild {
    fn spawn() -> anyhow::Result<PeerChild> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .args(["bench", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .spawn()
            .context("starting the peer process")?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
        let address = line
            .trim()
            .strip_prefix("READY ")
            .context("peer did not report its address")?
            .to_owned();
        Ok(PeerChild { child, address })
    }
}

impl Drop for PeerChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
