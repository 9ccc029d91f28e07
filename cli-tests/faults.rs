//! The CLI under faults: every demo and `sluice launch` given bad input, a worker killed
//! (SIGKILL) mid-epoch and mid-save, and the supervisor that serves the store killed. Each case
//! must end (a watchdog kills it otherwise and fails the test) with a non-zero exit and stderr
//! naming the cause, and leave no worker process behind; a resume after a killed save loads
//! the last complete checkpoint.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest any case may take to end; a hang fails the test with everything printed so far.
const WATCHDOG: Duration = Duration::from_secs(60);

/// A running `sluice …` whose output is collected as it comes.
struct Run {
    child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    started: Instant,
}

fn collect(r: impl Read + Send + 'static, into: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(r).split(b'\n') {
            let Ok(line) = line else { break };
            let mut s = into.lock().unwrap();
            s.push_str(&String::from_utf8_lossy(&line));
            s.push('\n');
        }
    })
}

impl Run {
    fn start(args: &[&str]) -> Run {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(args)
            .env_remove("RUST_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (out, err) = (Arc::default(), Arc::default());
        let readers = vec![
            collect(child.stdout.take().unwrap(), Arc::clone(&out)),
            collect(child.stderr.take().unwrap(), Arc::clone(&err)),
        ];
        Run {
            child,
            out,
            err,
            readers,
            started: Instant::now(),
        }
    }

    fn text(&self) -> String {
        format!(
            "--- stdout\n{}--- stderr\n{}",
            self.out.lock().unwrap(),
            self.err.lock().unwrap()
        )
    }

    /// Waits until `what` holds for stdout and stderr (or the watchdog fires).
    fn wait_for(&mut self, what: &str, ready: impl Fn(&str, &str) -> bool) {
        loop {
            if ready(&self.out.lock().unwrap(), &self.err.lock().unwrap()) {
                return;
            }
            if let Some(s) = self.child.try_wait().unwrap() {
                panic!("sluice exited ({s}) before {what}:\n{}", self.text());
            }
            if self.started.elapsed() > WATCHDOG {
                let _ = self.child.kill();
                panic!("watchdog: no {what} after {WATCHDOG:?}:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The worker pids the supervisor reported (`NAME pid N`), by name.
    fn pids(&mut self) -> Vec<(String, i32)> {
        self.wait_for("the workers' pids", |_, e| e.contains(" pid "));
        let err = self.err.lock().unwrap().clone();
        let line = err.lines().find(|l| l.contains(" pid ")).unwrap();
        let list = &line[line.find('(').unwrap() + 1..line.find(')').unwrap()];
        list.split(", ")
            .map(|w| {
                let mut it = w.split(" pid ");
                let name = it.next().unwrap().to_owned();
                (name, it.next().unwrap().parse().unwrap())
            })
            .collect()
    }

    /// Waits for the exit under the watchdog; returns the status and all output.
    fn finish(mut self) -> (ExitStatus, String) {
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if self.started.elapsed() > WATCHDOG {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("watchdog: still running after {WATCHDOG:?}:\n{}", self.text());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for r in self.readers.drain(..) {
            r.join().unwrap();
        }
        (status, self.text())
    }
}

fn sigkill(pid: i32) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
}

/// A process that has exited (gone, or a zombie nobody has reaped yet).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().is_some_and(|s| s.trim_start().starts_with('Z')),
    }
}

/// Every pid in `pids` has exited, waiting up to the watchdog for the last.
fn all_gone(pids: &[(String, i32)], out: &str) {
    let start = Instant::now();
    for (name, pid) in pids {
        while !gone(*pid) {
            assert!(
                start.elapsed() < WATCHDOG,
                "worker {name} (pid {pid}) outlived its job:\n{out}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Kills worker `victim` (rank `rank`) of `run`: the job must fail naming it, and stop the rest.
fn kill_and_expect_named(run: Run, pids: &[(String, i32)], victim: &str, rank: u32) -> String {
    sigkill(pids.iter().find(|(n, _)| n == victim).unwrap().1);
    let (status, out) = run.finish();
    assert!(!status.success(), "{out}");
    let named = format!("worker {victim} (rank {rank}) failed: killed by SIGKILL");
    assert!(out.contains(&named), "{out}");
    all_gone(pids, &out);
    out
}

/// Runs `sluice ARGS` to the end; it must fail, with stderr containing every one of `causes`.
fn fails_naming(args: &[&str], causes: &[&str]) -> String {
    let (status, out) = Run::start(args).finish();
    assert!(!status.success(), "`sluice {}` succeeded:\n{out}", args.join(" "));
    let err = out.split("--- stderr\n").nth(1).unwrap_or_default();
    for c in causes {
        assert!(
            err.contains(c),
            "`sluice {}`: stderr does not name `{c}`:\n{out}",
            args.join(" ")
        );
    }
    out
}

/// `sluice launch --role stage=STAGES -- sluice demo pipeline ARGS`.
fn launched(stages: u32, args: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["launch", "--role", &format!("stage={stages}"), "--grace", "1", "--"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.extend([env!("CARGO_BIN_EXE_sluice"), "demo", "pipeline"].map(String::from));
    v.extend(args.iter().map(|s| s.to_string()));
    v
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn arguments_that_make_no_group_are_refused_before_anything_starts() {
    for (args, cause) in [
        (&["demo", "pipeline", "--stages", "0"][..], "--stages"),
        (&["demo", "pipeline", "--micro-batches", "0"], "--micro-batches"),
        (&["demo", "pipeline", "--batch", "0"], "--batch"),
        (&["demo", "ps", "--trainers", "0"], "--trainers"),
        (&["demo", "rl", "--observers", "0"], "--observers"),
        (&["demo", "rl", "--rounds", "0"], "--rounds"),
        (&["demo", "pipeline", "--resume"], "--resume needs --checkpoint"),
    ] {
        let out = fails_naming(args, &[cause]);
        assert!(!out.contains(" pid "), "workers were started for {args:?}:\n{out}");
    }
    // More stages than the model has layers (seven).
    let out = fails_naming(
        &[
            "demo",
            "pipeline",
            "--stages",
            "9",
            "--micro-batches",
            "2",
            "--epochs",
            "1",
        ],
        &["--stages 9", "7 layers"],
    );
    assert!(!out.contains(" pid "), "{out}");
    // A checkpoint directory that cannot be made.
    fails_naming(
        &["demo", "pipeline", "--checkpoint", "/proc/sluice-nope", "--epochs", "1"],
        &["/proc/sluice-nope", "cannot create"],
    );
}

#[test]
fn a_damaged_checkpoint_is_refused_naming_the_shard_and_the_check() {
    let dir = scratch("damaged");
    let (status, out) = Run::start(&[
        "demo",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "4",
        "--epochs",
        "1",
        "--checkpoint",
        s(&dir),
    ])
    .finish();
    assert!(status.success(), "{out}");
    // Bytes 16.. of the first shard overwritten, as a failing disk or a stray write would.
    let shard = dir.join("step-00000001/layer-0000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[16..23].copy_from_slice(b"garbage");
    std::fs::write(&shard, bytes).unwrap();
    for stages in ["2", "4"] {
        fails_naming(
            &[
                "demo",
                "pipeline",
                "--stages",
                stages,
                "--micro-batches",
                "4",
                "--epochs",
                "2",
                "--checkpoint",
                s(&dir),
                "--resume",
            ],
            &["layer-0000.bin", "crc32"],
        );
    }
    // The same under `sluice launch`: the driver's rank refuses it and the launcher stops the
    // others.
    fails_naming(
        &refs(&launched(2, &["--stages", "2", "--checkpoint", s(&dir), "--resume"])),
        &["layer-0000.bin", "crc32", "worker stage0 (rank 0) failed: exit code 1"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_launched_demo_checks_the_world_it_was_given() {
    fails_naming(
        &refs(&launched(2, &["--stages", "3"])),
        &["needs 3 workers and `sluice launch` started 2", "failed: exit code 1"],
    );
    fails_naming(
        &refs(&launched(3, &["--stages", "3", "--checkpoint", "/proc/sluice-nope"])),
        &["/proc/sluice-nope", "failed: exit code 1"],
    );
}

#[test]
fn a_stage_killed_mid_epoch_stops_the_pipeline_naming_it() {
    let mut run = Run::start(&[
        "demo",
        "pipeline",
        "--stages",
        "3",
        "--micro-batches",
        "4",
        "--epochs",
        "100000",
    ]);
    let pids = run.pids();
    run.wait_for("the first epoch", |o, _| o.contains("epoch 0:"));
    kill_and_expect_named(run, &pids, "stage1", 1);
}

#[test]
fn a_trainer_killed_mid_epoch_stops_the_parameter_server_naming_it() {
    let mut run = Run::start(&["demo", "ps", "--trainers", "2", "--epochs", "100000"]);
    let pids = run.pids();
    // The trainers have joined and are training once the group has formed; give them a moment.
    std::thread::sleep(Duration::from_millis(1500));
    kill_and_expect_named(run, &pids, "trainer2", 2);
}

#[test]
fn a_stage_killed_mid_save_leaves_the_last_checkpoint_to_resume_from() {
    let dir = scratch("mid-save");
    let args = [
        "demo",
        "pipeline",
        "--stages",
        "2",
        "--micro-batches",
        "2",
        "--epochs",
        "3",
        "--checkpoint",
        s(&dir),
    ];
    // The last stage pauses before each shard it writes, so the kill lands inside the save of
    // step 2: after stage0's shards and before the manifest.
    let mut slow = args.to_vec();
    slow.extend(["--slow-saves-ms", "400"]);
    let mut run = Run::start(&slow);
    let pids = run.pids();
    let step2 = dir.join("step-00000002");
    run.wait_for("the save of step 2", |_, _| step2.join("layer-0000.bin").exists());
    assert!(!step2.join("MANIFEST.json").exists());
    let out = kill_and_expect_named(run, &pids, "stage1", 1);
    assert!(!step2.join("MANIFEST.json").exists(), "{out}");
    // The resume loads step 1, the last complete checkpoint, and finishes.
    let mut again = args.to_vec();
    again.push("--resume");
    let (status, out) = Run::start(&again).finish();
    assert!(status.success(), "{out}");
    assert!(out.contains("(step 1), epoch 1"), "{out}");
    assert!(out.contains("epoch 2: loss"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn killing_the_supervisor_that_serves_the_store_takes_its_workers_along() {
    // `sluice demo`: the supervisor serves the store and watches the stages.
    let mut run = Run::start(&["demo", "pipeline", "--stages", "3", "--epochs", "100000"]);
    let pids = run.pids();
    run.wait_for("the first epoch", |o, _| o.contains("epoch 0:"));
    sigkill(run.child.id() as i32);
    let (_, out) = run.finish();
    all_gone(&pids, &out);
    // `sluice launch`: the same for any command.
    let mut run = Run::start(&["launch", "--nproc", "2", "--", "sleep", "600"]);
    let pids = run.pids();
    sigkill(run.child.id() as i32);
    let (_, out) = run.finish();
    all_gone(&pids, &out);
}
