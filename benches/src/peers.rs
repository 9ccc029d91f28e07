//! `sluice bench peers`: what a user would pick instead of Sluice, measured on this machine in
//! the same run. OpenMPI point-to-point (`benches/peers/mpi_p2p.c`, built with `mpicc` when
//! OpenMPI is installed) and PyTorch RPC (`benches/peers/pytorch_rpc.py`, run when
//! `import torch` works in `$SLUICE_BENCH_PYTHON`, `python3` by default), the same program
//! twice: on PyTorch's TensorPipe backend, then on Sluice's (`sluice_torch`, when
//! `pip install --no-build-isolation ./python/torch` put it there). All print records in our
//! JSON-lines format with `suite = "peer"`.
//!
//! A peer that is not installed is skipped with the reason and measures nothing. One that
//! fails, crashes or outlives its deadline is killed and reported by name, and whatever it had
//! measured by then is kept.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

use crate::compare::Recorded;
use crate::report::Record;
use crate::run::BenchOptions;

const MPI_SOURCE: &str = include_str!("../peers/mpi_p2p.c");
const TORCH_SCRIPT: &str = include_str!("../peers/pytorch_rpc.py");
const TORCH_COLLECTIVES_SCRIPT: &str = include_str!("../peers/torch_collectives.py");
const MPI_ALLREDUCE_SOURCE: &str = include_str!("../peers/mpi_allreduce.c");

/// What the peers suite measured, and a line for each peer it skipped or lost.
#[derive(Debug, Default)]
pub struct Peers {
    pub records: Vec<Record>,
    pub notes: Vec<String>,
}

/// Runs every peer available here.
pub fn run(options: &BenchOptions) -> Peers {
    let mut out = Peers::default();
    let sizes = options.sizes();
    let budget = options.budget();
    let mut take = |name: &str, result: anyhow::Result<Outcome>| match result {
        Ok(Outcome::Skipped(why)) => {
            let note = format!("{name}: skipped: {why}");
            eprintln!("peers: {note}");
            out.notes.push(note);
        }
        Ok(Outcome::Ran(records, failure)) => {
            if let Some(why) = failure {
                let note = format!("{name}: {why} ({} results kept)", records.len());
                eprintln!("peers: {note}");
                out.notes.push(note);
            }
            out.records.extend(records);
        }
        Err(e) => {
            let note = format!("{name}: {e:#}");
            eprintln!("peers: {note}");
            out.notes.push(note);
        }
    };
    take("openmpi", openmpi(&sizes, budget));
    take("pytorch-rpc", pytorch(&sizes, budget, "tensorpipe"));
    take("pytorch-sluice", pytorch(&sizes, budget, "sluice"));
    for line in compare_torch_backends(&mut out.records) {
        eprintln!("peers: {line}");
    }
    out
}

/// Each row of PyTorch's program on Sluice's backend gets the same row on TensorPipe as its
/// baseline (ratio: latency over latency, bandwidth or rate over bandwidth or rate); returns a
/// line per pair.
fn compare_torch_backends(records: &mut [Record]) -> Vec<String> {
    let theirs: Vec<Record> = records
        .iter()
        .filter(|r| r.backend.starts_with("pytorch-") && !r.backend.starts_with("pytorch-sluice-"))
        .cloned()
        .collect();
    let mut lines = Vec::new();
    for r in records.iter_mut() {
        let Some(rest) = r.backend.strip_prefix("pytorch-sluice-") else {
            continue;
        };
        let name = format!("pytorch-{rest}");
        let Some(t) = theirs
            .iter()
            .find(|t| t.backend == name && t.metric == r.metric && t.bytes == r.bytes)
        else {
            continue;
        };
        let (ours, base, unit) = match r.metric {
            "rtt" => (r.p50_ns, t.p50_ns, "µs p50"),
            "bw" => (r.gbps, t.gbps, "GB/s"),
            _ => (r.per_second, t.per_second, "/s"),
        };
        let (Some(ours), Some(base)) = (ours, base) else {
            continue;
        };
        if base <= 0.0 {
            continue;
        }
        let scale = if r.metric == "rtt" { 1e-3 } else { 1.0 };
        r.baseline = name.clone();
        r.ratio = Some(ours / base);
        lines.push(format!(
            "torch on sluice vs tensorpipe: {rest} {} {} B: {:.2} vs {:.2} {unit} ({:.2}×)",
            r.metric,
            r.bytes,
            ours * scale,
            base * scale,
            ours / base
        ));
    }
    lines
}

enum Outcome {
    Skipped(String),
    /// What it measured, and why it stopped early (if it did).
    Ran(Vec<Record>, Option<String>),
}

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(program))
        .find(|p| p.is_file())
}

/// Writes `source` as `dir/NAME.c` and builds `dir/NAME` with `mpicc -O2` (bounded): the
/// executable, or why it could not be built.
fn build_mpi(mpicc: &Path, dir: &Path, name: &str, source: &str) -> anyhow::Result<PathBuf> {
    let file = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    std::fs::write(&file, source)?;
    let built = run_bounded(
        "mpicc",
        Command::new(mpicc).arg("-O2").arg("-o").arg(&exe).arg(&file),
        Duration::from_secs(120),
    )?;
    if let Some(why) = &built.failure {
        bail!("building {}: {why}\n{}", file.display(), built.stderr_tail());
    }
    Ok(exe)
}

/// A scratch directory for the peers' sources and binaries.
fn scratch() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("sluice-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn openmpi(sizes: &[usize], budget: Duration) -> anyhow::Result<Outcome> {
    let (Some(mpicc), Some(mpirun)) = (on_path("mpicc"), on_path("mpirun")) else {
        return Ok(Outcome::Skipped(
            "OpenMPI is not installed (no mpicc or mpirun on PATH; Debian: openmpi-bin libopenmpi-dev)".into(),
        ));
    };
    let dir = scratch()?;
    let exe = build_mpi(&mpicc, &dir, "mpi_p2p", MPI_SOURCE)?;
    let mut cmd = Command::new(&mpirun);
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(&exe)
        .arg(budget.as_millis().to_string())
        .args(sizes.iter().map(|s| s.to_string()));
    // Two measurements per size, each at least its budget; start-up and slow sizes on top.
    let deadline = budget * 3 * sizes.len() as u32 + Duration::from_secs(60);
    let ran = run_bounded("openmpi", &mut cmd, deadline)?;
    let _ = std::fs::remove_dir_all(&dir);
    ran.into_outcome("openmpi")
}

/// PyTorch's RPC benchmark on `backend` (`tensorpipe` or `sluice`).
fn pytorch(sizes: &[usize], budget: Duration, backend: &str) -> anyhow::Result<Outcome> {
    const TORCH: (&str, &str) = (
        "torch, torch.distributed.rpc",
        "PyTorch is not installed there; set SLUICE_BENCH_PYTHON to a Python that has it",
    );
    const BACKEND: (&str, &str) = (
        "sluice_torch",
        "Sluice's torch backend is not installed there: pip install --no-build-isolation ./python/torch",
    );
    let needs: &[(&str, &str)] = if backend == "sluice" {
        &[TORCH, BACKEND]
    } else {
        &[TORCH]
    };
    let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    let args = [
        "--budget-ms".to_owned(),
        budget.as_millis().to_string(),
        "--sizes".to_owned(),
        list.join(","),
        "--backend".to_owned(),
        backend.to_owned(),
    ];
    let deadline = budget * (2 * sizes.len() as u32 + 6) + Duration::from_secs(120);
    let name = format!("pytorch-rpc ({backend})");
    python_peer(&name, "pytorch_rpc.py", TORCH_SCRIPT, needs, &args, deadline)
}

/// Runs the Python program `source` (saved as `file`) with `args` under `$SLUICE_BENCH_PYTHON`
/// (`python3` by default), bounded by `deadline`; skipped with the reason when one of `needs`
/// (modules to import, and what to say if they do not) fails to import there.
fn python_peer(
    name: &str,
    file: &str,
    source: &str,
    needs: &[(&str, &str)],
    args: &[String],
    deadline: Duration,
) -> anyhow::Result<Outcome> {
    let python = std::env::var("SLUICE_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    for (modules, why) in needs {
        if let Some(skip) = cannot_import(&python, modules, why) {
            return Ok(skip);
        }
    }
    let dir = scratch()?;
    let script = dir.join(file);
    std::fs::write(&script, source)?;
    let ran = run_bounded(name, Command::new(&python).arg(&script).args(args), deadline)?;
    let _ = std::fs::remove_dir_all(&dir);
    ran.into_outcome(name)
}

/// torch.distributed's allreduce (f32 sum) at `sizes` on each of `worlds` processes through
/// Gloo (the collective suite's baseline) and, when `sluice_torch` imports, Sluice's "sluice"
/// process group; and the DDP step on 2 processes without DDP and under DDP on each: the
/// records, and notes for what was skipped or failed.
pub fn torch_collectives(sizes: &[usize], worlds: &[u32], quick: bool) -> (Vec<Record>, Vec<String>) {
    let list = |v: Vec<String>| v.join(",");
    let python = std::env::var("SLUICE_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut notes = Vec::new();
    let backends = match cannot_import(
        &python,
        "sluice_torch",
        "Sluice's torch backend is not installed there: pip install --no-build-isolation ./python/torch",
    ) {
        None => "gloo,sluice",
        Some(Outcome::Skipped(why)) => {
            notes.push(format!("torch-sluice: skipped: {why}"));
            "gloo"
        }
        Some(Outcome::Ran(..)) => "gloo",
    };
    let mut args = vec![
        "--sizes".to_owned(),
        list(sizes.iter().map(|s| s.to_string()).collect()),
        "--worlds".to_owned(),
        list(worlds.iter().map(|w| w.to_string()).collect()),
        "--backends".to_owned(),
        backends.to_owned(),
        "--ddp".to_owned(),
    ];
    if quick {
        args.push("--quick".to_owned());
    }
    let needs = [(
        "torch, torch.distributed",
        "PyTorch is not installed there; set SLUICE_BENCH_PYTHON to a Python that has it",
    )];
    let ran = python_peer(
        "torch collectives",
        "torch_collectives.py",
        TORCH_COLLECTIVES_SCRIPT,
        &needs,
        &args,
        Duration::from_secs(900),
    );
    match ran {
        Ok(Outcome::Skipped(why)) => notes.push(format!("torch collectives: skipped: {why}")),
        Ok(Outcome::Ran(records, failure)) => {
            notes.extend(failure.map(|f| format!("torch collectives: {f}")));
            return (records, notes);
        }
        Err(e) => notes.push(format!("torch collectives: {e:#}")),
    }
    (Vec::new(), notes)
}

/// OpenMPI's `MPI_Allreduce` (f32 sum) at `sizes` on each of `worlds` processes, a baseline of
/// the collective suite: its records, and a note per world when it was skipped or failed.
pub fn mpi_allreduce(sizes: &[usize], worlds: &[u32], quick: bool) -> (Vec<Record>, Vec<String>) {
    let (Some(mpicc), Some(mpirun)) = (on_path("mpicc"), on_path("mpirun")) else {
        let why = "OpenMPI is not installed (no mpicc or mpirun on PATH; Debian: openmpi-bin libopenmpi-dev)";
        return (Vec::new(), vec![format!("openmpi-allreduce: skipped: {why}")]);
    };
    let build = || -> anyhow::Result<PathBuf> {
        let dir = scratch()?.join("allreduce");
        std::fs::create_dir_all(&dir)?;
        build_mpi(&mpicc, &dir, "mpi_allreduce", MPI_ALLREDUCE_SOURCE)
    };
    let exe = match build() {
        Ok(exe) => exe,
        Err(e) => return (Vec::new(), vec![format!("openmpi-allreduce: {e:#}")]),
    };
    let (mut records, mut notes) = (Vec::new(), Vec::new());
    for world in worlds {
        let mut cmd = Command::new(&mpirun);
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-np", &world.to_string()])
            .arg(&exe)
            .arg(if quick { "1" } else { "0" })
            .args(sizes.iter().map(|s| s.to_string()));
        let name = format!("openmpi-allreduce ({world} processes)");
        match run_bounded(&name, &mut cmd, Duration::from_secs(600)).and_then(|ran| ran.into_outcome(&name)) {
            Ok(Outcome::Ran(r, failure)) => {
                records.extend(r);
                notes.extend(failure.map(|f| format!("{name}: {f}")));
            }
            Ok(Outcome::Skipped(why)) => notes.push(format!("{name}: skipped: {why}")),
            Err(e) => notes.push(format!("{name}: {e:#}")),
        }
    }
    if let Some(dir) = exe.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    (records, notes)
}

/// `Some(skip)` with the reason when `python -c 'import MODULES'` fails (`why` says what that
/// means), `None` when the import works.
fn cannot_import(python: &str, modules: &str, why: &str) -> Option<Outcome> {
    let probe = Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match probe {
        Ok(s) if s.success() => None,
        Ok(_) => Some(Outcome::Skipped(format!(
            "`{python} -c 'import {modules}'` fails ({why})"
        ))),
        Err(e) => Some(Outcome::Skipped(format!("cannot run `{python}`: {e}"))),
    }
}

/// What a bounded child run produced.
struct Ran {
    lines: Vec<String>,
    stderr: String,
    /// Why it did not succeed (non-zero exit, a signal, the deadline), if it did not.
    failure: Option<String>,
}

impl Ran {
    fn stderr_tail(&self) -> String {
        let lines: Vec<&str> = self.stderr.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// The records it printed; lines that are not records (progress, warnings) are ignored,
    /// but a run that printed none and failed is an error.
    fn into_outcome(self, name: &str) -> anyhow::Result<Outcome> {
        let records: Vec<Record> = self
            .lines
            .iter()
            .filter_map(|l| serde_json::from_str::<Recorded>(l).ok())
            .filter_map(|r| r.into_peer_record())
            .collect();
        match self.failure {
            Some(ref why) if records.is_empty() => bail!("{name} {why}\n{}", self.stderr_tail()),
            failure => Ok(Outcome::Ran(records, failure)),
        }
    }
}

/// Runs `cmd`, collecting its output lines, and kills it at `deadline`.
fn run_bounded(name: &str, cmd: &mut Command, deadline: Duration) -> anyhow::Result<Ran> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let lines = Arc::new(Mutex::new(Vec::new()));
    let out = child.stdout.take().expect("piped");
    let reader = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                lines.lock().unwrap().push(line);
            }
        })
    };
    let mut err = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let failure = loop {
        match child.try_wait()? {
            Some(status) if status.success() => break None,
            Some(status) => break Some(format!("failed ({status})")),
            None if start.elapsed() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break Some(format!("did not finish within {deadline:?} and was killed"));
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    // Grandchildren (mpirun's ranks) may hold the pipes open after a kill: wait for the
    // readers a little, never for ever.
    let waited = Instant::now();
    while !errors.is_finished() && waited.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let stderr = if errors.is_finished() {
        errors.join().unwrap_or_default()
    } else {
        String::new()
    };
    while !reader.is_finished() && waited.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let lines = lines.lock().unwrap().clone();
    Ok(Ran { lines, stderr, failure })
}

impl Recorded {
    /// A peer's line as a record of the `peer` suite (other suites and metrics are refused).
    fn into_peer_record(self) -> Option<Record> {
        if self.suite != "peer" {
            return None;
        }
        let iterations = self.iterations.unwrap_or(0);
        let mut r = match self.metric.as_str() {
            "rtt" => {
                let mut r = Record::rtt("peer", self.backend, self.bytes as usize, vec![0.0]);
                r.p50_ns = Some(self.p50_ns?);
                r.p99_ns = self.p99_ns;
                r
            }
            "bw" => Record::bw("peer", self.backend, self.bytes as usize, self.gbps?, iterations),
            "rate" => Record::rate("peer", self.backend, self.bytes as usize, self.per_second?, iterations),
            _ => return None,
        };
        r.iterations = iterations;
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str =
        r#"{"suite":"peer","backend":"x","metric":"bw","bytes":64,"gbps":1.5,"iterations":9,"baseline":""}"#;

    #[test]
    fn a_peer_that_hangs_is_killed_and_what_it_measured_is_kept() {
        let script = format!("echo '{LINE}'; echo 'not a record'; sleep 30");
        let start = Instant::now();
        let ran = run_bounded(
            "hanger",
            Command::new("sh").args(["-c", &script]),
            Duration::from_millis(500),
        )
        .unwrap();
        assert!(start.elapsed() < Duration::from_secs(10), "bounded wait");
        assert!(ran.failure.as_deref().unwrap().contains("killed"));
        let Outcome::Ran(records, Some(why)) = ran.into_outcome("hanger").unwrap() else {
            panic!("partial results expected")
        };
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].gbps, Some(1.5));
        assert!(why.contains("killed"));
    }

    #[test]
    fn a_peer_that_crashes_is_an_error_naming_it() {
        let ran = run_bounded(
            "crasher",
            Command::new("sh").args(["-c", "echo boom >&2; exit 3"]),
            Duration::from_secs(10),
        )
        .unwrap();
        let e = format!("{:#}", ran.into_outcome("crasher").err().expect("an error"));
        assert!(e.contains("crasher") && e.contains("boom"), "{e}");
        // Records of other suites or unknown metrics are not taken from a peer.
        let foreign = r#"{"suite":"pipe","backend":"x","metric":"bw","bytes":1,"gbps":1.0}"#;
        let r: Recorded = serde_json::from_str(foreign).unwrap();
        assert!(r.into_peer_record().is_none());
    }
}
