//! Helpers for Sluice's cross-crate tests: the conformance suites (written once, instantiated per
//! backend), real peer processes, and a watchdog for tests that could deadlock.
//!
//! Tests never assert how fast something is; the watchdog only turns a hang into a failure.

pub mod conformance;
pub mod gpu;
pub mod procs;
pub mod workers;

use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Generous bound after which a test that is still waiting is declared deadlocked.
pub const WATCHDOG: Duration = Duration::from_secs(120);

/// Runs `fut`, failing the test if it has not finished within [`WATCHDOG`].
pub async fn watchdog<F: Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(WATCHDOG, fut).await {
        Ok(v) => v,
        Err(_) => panic!("watchdog: {what} did not finish within {WATCHDOG:?} (deadlock?)"),
    }
}

/// The peer binary: `built` (the `CARGO_BIN_EXE_` path of this build), unless
/// `SLUICE_TEST_PEER` names another place (test binaries copied to a GPU machine by
/// `scripts/gpu-check.sh` run there without the build tree).
pub fn peer_exe(built: &str) -> String {
    std::env::var("SLUICE_TEST_PEER").unwrap_or_else(|_| built.to_owned())
}

/// Context options offering exactly these transports and channels (in priority order).
pub fn offering(
    transports: &[sluice_channel::TransportKind],
    channels: &[sluice_channel::ChannelKind],
) -> sluice_channel::ContextOptions {
    sluice_channel::ContextOptions {
        transports: transports.to_vec(),
        channels: channels.to_vec(),
        ..sluice_channel::ContextOptions::default()
    }
}

/// Two ends of one pipe within this process: a listener's context with `opts` and a client's.
pub async fn pipe_pair(opts: sluice_channel::ContextOptions) -> (sluice_channel::Pipe, sluice_channel::Pipe) {
    let server = sluice_channel::Context::new(opts.clone()).unwrap();
    let client = sluice_channel::Context::new(opts).unwrap();
    let mut listener = server.listen("").await.unwrap();
    let addr = listener.address().to_owned();
    let (c, s) = tokio::join!(client.connect(&addr), listener.accept());
    (c.expect("connect"), s.expect("accept"))
}

/// A child process killed (SIGKILL) and reaped when dropped.
pub struct PeerProcess {
    child: Child,
}

impl PeerProcess {
    /// Starts the peer binary `exe` with `args`.
    pub fn spawn(exe: &str, args: &[&str]) -> PeerProcess {
        Self::spawn_with_env(exe, args, &[])
    }

    /// Starts the peer binary `exe` with `args` and these environment variables added.
    pub fn spawn_with_env(exe: &str, args: &[&str], env: &[(&str, &str)]) -> PeerProcess {
        let child = Command::new(exe)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start peer {exe}: {e}"));
        PeerProcess { child }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Reads one line the peer printed on stdout (blocking).
    pub fn read_line(&mut self) -> String {
        use std::io::BufRead;
        let stdout = self.child.stdout.as_mut().expect("piped stdout");
        let mut reader = std::io::BufReader::new(stdout);
        let mut line = String::new();
        reader.read_line(&mut line).expect("read peer stdout");
        line.trim().to_owned()
    }

    /// Kills the peer with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }

    /// Waits for the peer to exit and returns whether it succeeded.
    pub fn wait_success(&mut self) -> bool {
        self.child.wait().map(|s| s.success()).unwrap_or(false)
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A deterministic byte pattern: frame `seq`, byte `i`.
pub fn pattern(seq: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(x as u8);
    }
    out
}
