//! `sluice launch`, run as a real command: environment per role, failure reports, restarts,
//! signal forwarding, and a real job that survives a trainer's crash.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const WATCHDOG: Duration = Duration::from_secs(120);

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

fn run(args: &[&str]) -> Output {
    let child = sluice()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait(child)
}

/// Waits for the child under the watchdog.
fn wait(mut child: std::process::Child) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > WATCHDOG {
            let _ = child.kill();
            panic!("watchdog: sluice launch still running after {WATCHDOG:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn roles_ranks_and_prefixed_output() {
    let o = run(&[
        "launch",
        "--role",
        "ps=1",
        "--role",
        "trainer=2",
        "--",
        "sh",
        "-c",
        "echo \"$SLUICE_WORKER_NAME $ROLE_NAME $ROLE_RANK/$ROLE_WORLD_SIZE $RANK/$WORLD_SIZE $MASTER_ADDR\"",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for line in [
        "[ps0] ps0 ps 0/1 0/3 127.0.0.1",
        "[trainer0] trainer0 trainer 0/2 1/3 127.0.0.1",
        "[trainer1] trainer1 trainer 1/2 2/3 127.0.0.1",
    ] {
        assert!(out.contains(line), "missing `{line}` in:\n{out}");
    }
}

#[test]
fn a_failed_worker_is_named_and_the_others_stopped() {
    let o = run(&[
        "launch",
        "--nproc",
        "3",
        "--grace",
        "1",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then exit 7; fi; exec sleep 60",
    ]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("worker worker1 (rank 1) failed: exit code 7"), "{out}");
    let o = run(&["launch", "--nproc", "1", "--", "sh", "-c", "kill -9 $$"]);
    assert!(text(&o).contains("failed: killed by SIGKILL"), "{}", text(&o));
}

#[test]
fn failed_workers_restart_under_the_same_name() {
    let o = run(&[
        "launch",
        "--nproc",
        "2",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        "echo \"$SLUICE_WORKER_NAME try $TORCHELASTIC_RESTART_COUNT\"; [ $RANK = 0 ] || [ $TORCHELASTIC_RESTART_COUNT = 2 ]",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("[worker1] worker1 try 2"), "{out}");
    assert!(out.contains("restarting it (2/2)"), "{out}");
    assert!(!out.contains("[worker0] worker0 try 1"), "{out}");
}

#[test]
fn signals_are_forwarded_to_every_worker() {
    let child = sluice()
        .args([
            "launch",
            "--nproc",
            "2",
            "--",
            "sh",
            "-c",
            "trap 'echo got TERM; exit 0' TERM; echo ready; while true; do sleep 0.05; done",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Give the workers a moment to install their traps, then stop the launcher.
    std::thread::sleep(Duration::from_millis(1500));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let o = wait(child);
    let out = text(&o);
    assert!(
        out.contains("[worker0] got TERM") && out.contains("[worker1] got TERM"),
        "{out}"
    );
    assert!(out.contains("forwarding it to every worker"), "{out}");
}

#[test]
fn a_parameter_server_job_survives_a_trainer_crash() {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_sluice"))
        .parent()
        .unwrap()
        .join("examples/resilient_ps");
    if !exe.exists() {
        panic!(
            "{} is missing: build the examples (cargo test builds them)",
            exe.display()
        );
    }
    let o = run(&[
        "launch",
        "--role",
        "ps=1",
        "--role",
        "trainer=3",
        "--max-restarts",
        "1",
        "--",
        exe.to_str().unwrap(),
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("trainer1 (rank 2) failed: killed by SIGABRT; restarting it"),
        "{out}"
    );
    assert!(out.contains("reassigning shards ["), "{out}");
    assert!(
        out.contains("all 30 shards done: 1 reassigned after a loss, 0 duplicate results"),
        "{out}"
    );
}

#[test]
fn the_gpu_parameter_server_says_why_it_cannot_start() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        sluice::channel::cuda::gate::skipped(
            "the_gpu_parameter_server_says_why_it_cannot_start",
            "this machine may have a GPU (the check is for machines without one)",
        );
        return;
    }
    let o = run(&["demo", "ps", "--gpu", "--trainers", "1", "--epochs", "1"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("--gpu needs CUDA") && t.contains("libcuda"), "{t}");
}

#[test]
fn the_data_parallel_demo_trains_identical_replicas_as_well_as_the_parameter_server() {
    let accuracy = |t: &str, line: &str| -> String {
        let l = t
            .lines()
            .find(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("no `{line}` line in:\n{t}"));
        l.rsplit_once('→')
            .unwrap()
            .1
            .split('%')
            .next()
            .unwrap()
            .trim()
            .to_owned()
    };
    let o = run(&["demo", "ddp", "--workers", "3", "--epochs", "20"]);
    let ddp = text(&o);
    assert!(o.status.success(), "{ddp}");
    assert!(ddp.contains("replicas identical"), "{ddp}");
    let o = run(&["demo", "ps", "--trainers", "3", "--epochs", "20", "--sync", "mean"]);
    let ps = text(&o);
    assert!(o.status.success(), "{ps}");
    // The same update (the mean of one batch's gradient per worker) on the same data: the same
    // held-out accuracy, whichever way the gradients travelled.
    let (a, b) = (accuracy(&ddp, "data parallel"), accuracy(&ps, "parameter server"));
    assert_eq!(a, b, "{ddp}\n{ps}");
    assert!(a.parse::<f64>().unwrap() > 60.0, "{ddp}");
}
