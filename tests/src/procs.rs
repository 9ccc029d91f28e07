//! Role processes for fault tests: the test binary re-executes itself to run one named role
//! (a worker that joins, serves, and waits to be killed, say), so a test can start, kill and
//! restart real processes at the moments it chooses, possibly inside a network namespace.
//!
//! ```ignore
//! #[test]
//! fn my_fault_test() {
//!     if let Some((role, arg)) = procs::child_role("my_fault_test") {
//!         return run_role(&role, &arg);
//!     }
//!     let mut victim = procs::spawn_role("my_fault_test", "victim", "", &[], &[]);
//!     ...
//!     victim.kill();
//! }
//! ```

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::WATCHDOG;

const TEST_VAR: &str = "SLUICE_ROLE_TEST";
const ROLE_VAR: &str = "SLUICE_ROLE";
const ARG_VAR: &str = "SLUICE_ROLE_ARG";

/// In a role process of `test`: its role and argument (and logging is set up).
pub fn child_role(test: &str) -> Option<(String, String)> {
    if std::env::var(TEST_VAR).as_deref() != Ok(test) {
        return None;
    }
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    Some((
        std::env::var(ROLE_VAR).unwrap_or_default(),
        std::env::var(ARG_VAR).unwrap_or_default(),
    ))
}

/// A running role process; killed (SIGKILL) when dropped.
pub struct Role {
    pub name: String,
    child: Child,
    out: Option<std::thread::JoinHandle<String>>,
    err: Option<std::thread::JoinHandle<String>>,
    status: Option<ExitStatus>,
}

/// Starts `role` of `test` with `arg`; `wrap` is a command prefix (`["ip", "netns", "exec",
/// "h1"]`), `envs` extra environment.
pub fn spawn_role(test: &str, role: &str, arg: &str, wrap: &[&str], envs: &[(&str, String)]) -> Role {
    let exe = std::env::current_exe().expect("test executable");
    let mut cmd = match wrap.split_first() {
        None => Command::new(&exe),
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(&exe);
            c
        }
    };
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(TEST_VAR, test)
        .env(ROLE_VAR, role)
        .env(ARG_VAR, arg)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start role {role}: {e}"));
    let out = drain(child.stdout.take().unwrap());
    let err = drain(child.stderr.take().unwrap());
    Role {
        name: role.to_owned(),
        child,
        out: Some(out),
        err: Some(err),
        status: None,
    }
}

impl Role {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        self.status = self.child.wait().ok();
    }

    /// Waits (under the watchdog) for the process to exit; panics with its output unless it
    /// succeeded, else returns the output.
    pub fn expect_success(&mut self) -> String {
        let start = Instant::now();
        while self.status.is_none() && start.elapsed() < WATCHDOG {
            self.status = self.child.try_wait().expect("wait for a role");
            std::thread::sleep(Duration::from_millis(10));
        }
        if self.status.is_none() {
            self.kill();
            let out = self.output();
            panic!("watchdog: role {} still running after {WATCHDOG:?}\n{out}", self.name);
        }
        if !self.status.unwrap().success() {
            let out = self.output();
            panic!("role {} failed ({:?})\n{out}", self.name, self.status);
        }
        self.output()
    }

    /// Everything it printed (once it has exited).
    pub fn output(&mut self) -> String {
        let out = self
            .out
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        let err = self
            .err
            .take()
            .map(|h| h.join().unwrap_or_default())
            .unwrap_or_default();
        format!("===== {} =====\n{out}{err}", self.name)
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        if self.status.is_none() {
            self.kill();
        }
    }
}

fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = r.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// Waits (under the watchdog) until `path` exists; returns its contents.
pub fn wait_file(path: &Path) -> String {
    let start = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            return s;
        }
        assert!(
            start.elapsed() < WATCHDOG,
            "watchdog: {} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Writes `contents` to `path` atomically (readers never see half of it).
pub fn put_file(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).expect("write a sync file");
    std::fs::rename(&tmp, path).expect("publish a sync file");
}

/// Polls `check` (under the watchdog) until it holds.
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(start.elapsed() < WATCHDOG, "watchdog: never {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (under the watchdog) for a membership event matching `want` and returns it; other
/// events are logged and skipped.
pub fn expect_event(
    events: &crossbeam_channel::Receiver<sluice_agent::MembershipEvent>,
    what: &str,
    want: impl Fn(&sluice_agent::MembershipEvent) -> bool,
) -> sluice_agent::MembershipEvent {
    loop {
        match events.recv_timeout(WATCHDOG) {
            Ok(e) if want(&e) => return e,
            Ok(other) => eprintln!("(event while waiting for {what}: {other:?})"),
            Err(_) => panic!("watchdog: no {what} event"),
        }
    }
}
