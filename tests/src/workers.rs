//! Runs a test body on N real worker processes (default 4), the way torchrun starts a job.
//!
//! The test binary re-executes itself once per rank with `RANK`, `WORLD_SIZE`, `MASTER_ADDR`
//! and `MASTER_PORT` set, running only the test at hand; the parent waits for all of them under
//! a watchdog, kills the rest if one hangs, and fails with every worker's output. When all
//! pass, the `SKIPPED` lines the workers printed are passed through (once per distinct line,
//! naming the ranks), so a skip inside a worker is as visible as one in the test itself.
//!
//! ```ignore
//! worker_test!(my_test, 4, |env| {
//!     let agent = env.agent(Registry::new());
//!     ...
//! });
//! ```

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice_agent::{Agent, AgentOptions, Registry};

use crate::WATCHDOG;

const CHILD_VAR: &str = "SLUICE_WORKER_TEST";

/// What a worker process knows about itself.
#[derive(Debug, Clone)]
pub struct WorkerEnv {
    pub rank: u32,
    pub world_size: u32,
}

impl WorkerEnv {
    /// The conventional name of `rank`'s worker.
    pub fn name(rank: u32) -> String {
        format!("worker{rank}")
    }

    /// Options for this worker: its name; rank, world and store come from the environment.
    pub fn options(&self) -> AgentOptions {
        AgentOptions::new(Self::name(self.rank))
    }

    /// Starts this worker's agent with `registry` and default options.
    pub fn agent(&self, registry: Registry) -> Agent {
        Agent::init(self.options(), registry).unwrap_or_else(|e| panic!("init of rank {}: {e}", self.rank))
    }
}

/// How a worker may end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Exit status 0.
    Success,
    /// Killed by a signal (the test kills it on purpose).
    Killed,
}

/// Options for a group of one, `name` at rank 0, serving its store on a loopback port the
/// store's server picks (port 0: no free port picked, released and lost to a concurrent test):
/// an agent inside the test process itself.
pub fn solo_options(name: &str) -> AgentOptions {
    AgentOptions::new(name).rank(0, 1).store("127.0.0.1:0")
}

/// A free TCP port on loopback (bound, then released for the store to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on loopback")
}

/// Runs `body` on `n` worker processes. In a worker process (re-executed by the parent) this
/// runs the body for its rank and returns; in the test process it spawns the workers and waits.
/// Whether this process is one of `test`'s workers (not the test that starts them): a test
/// that forms several groups in turn forms one in each worker.
pub fn in_worker(test: &str) -> bool {
    std::env::var(CHILD_VAR).as_deref() == Ok(test)
}

pub fn run_workers(test: &str, n: u32, body: impl FnOnce(WorkerEnv)) {
    run_workers_with(test, n, |_| Ending::Success, body)
}

/// Like [`run_workers`], with the expected ending per rank.
pub fn run_workers_with(test: &str, n: u32, ending: impl Fn(u32) -> Ending, body: impl FnOnce(WorkerEnv)) {
    if std::env::var(CHILD_VAR).as_deref() == Ok(test) {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
        let rank = std::env::var("RANK").unwrap().parse().unwrap();
        let world_size = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
        body(WorkerEnv { rank, world_size });
        return;
    }
    let exe = std::env::current_exe().expect("test executable");
    let port = free_port();
    let mut children: Vec<_> = (0..n)
        .map(|rank| {
            let mut child = Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD_VAR, test)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                // Workers' skips are reported once, by this process (below), not by each.
                .env_remove(crate::gpu::SKIP_LOG)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start worker {rank}: {e}"));
            let out = drain(child.stdout.take().unwrap());
            let err = drain(child.stderr.take().unwrap());
            (child, out, err)
        })
        .collect();
    let start = Instant::now();
    let mut status: Vec<Option<std::process::ExitStatus>> = vec![None; n as usize];
    while status.iter().any(Option::is_none) && start.elapsed() < WATCHDOG {
        for (i, (child, _, _)) in children.iter_mut().enumerate() {
            if status[i].is_none() {
                status[i] = child.try_wait().expect("wait for a worker");
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let hung = status.iter().any(Option::is_none);
    for (child, _, _) in children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let mut report = String::new();
    let mut failed = hung;
    let mut skips: Vec<(String, Vec<usize>)> = Vec::new();
    for (rank, ((_, out, err), st)) in children.into_iter().zip(&status).enumerate() {
        let out = out.join().unwrap_or_default();
        let err = err.join().unwrap_or_default();
        for line in out.lines().chain(err.lines()).filter(|l| l.starts_with("SKIPPED")) {
            match skips.iter_mut().find(|(l, _)| l == line) {
                Some((_, ranks)) => ranks.push(rank),
                None => skips.push((line.to_owned(), vec![rank])),
            }
        }
        let ok = match (ending(rank as u32), st) {
            (_, None) => false,
            (Ending::Success, Some(s)) => s.success(),
            (Ending::Killed, Some(s)) => {
                use std::os::unix::process::ExitStatusExt;
                s.signal().is_some()
            }
        };
        failed |= !ok;
        report.push_str(&format!(
            "\n===== rank {rank}: {} =====\n{out}{err}",
            match st {
                None => "HUNG (killed by the watchdog)".to_owned(),
                Some(s) => s.to_string(),
            }
        ));
    }
    if !failed {
        for (line, ranks) in &skips {
            crate::gpu::report_skip(&format!("{line} (worker test {test}, ranks {ranks:?})"));
        }
    }
    if failed {
        panic!(
            "{test}: {}{report}",
            if hung {
                format!("watchdog: workers still running after {WATCHDOG:?} (deadlock?)")
            } else {
                "a worker failed".to_owned()
            }
        );
    }
}

fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = r.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// Declares a test whose body runs on `n` worker processes: `worker_test!(name, n, |env| ..)`.
#[macro_export]
macro_rules! worker_test {
    (#[$meta:meta] $name:ident, $n:expr, $body:expr) => {
        #[test]
        #[$meta]
        fn $name() {
            $crate::workers::run_workers(stringify!($name), $n, $body);
        }
    };
    ($name:ident, $n:expr, $body:expr) => {
        #[test]
        fn $name() {
            $crate::workers::run_workers(stringify!($name), $n, $body);
        }
    };
}
