//! Several hosts on one machine: network namespaces joined through a bridge by veth pairs, built
//! by the test (as root) and always removed. Workers run inside them with `ip netns exec`.
//!
//! Checked: TCP is negotiated between hosts and shared memory within one; cutting a host's link
//! makes calls to it fail promptly (heartbeats) while the rest keeps working, and restoring it
//! lets the peers reconnect; a worker killed with SIGKILL is detected and rejoins.
//!
//! Addresses are ones this test creates (10.231.N.0/24 inside its own namespaces); nothing
//! leaves them. Without root or `ip`, the test says why and is skipped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use sluice_agent::{Agent, AgentOptions, MembershipEvent, Registry, RpcError};
use sluice_tests::procs::{child_role, eventually, expect_event, put_file, spawn_role, wait_file, Role};

const TEST: &str = "namespaces_tcp_across_shm_within_cut_links_and_kills";
const PORT: u16 = 29500;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Three hosts (`<p>h1..h3`) on a bridge in `<p>hub`; removed on drop.
struct Hosts {
    prefix: String,
    subnet: u8,
}

impl Hosts {
    fn build() -> Result<Hosts, String> {
        let id = std::process::id();
        let h = Hosts {
            prefix: format!("sl{}", id % 100_000),
            subnet: (id % 200) as u8 + 20,
        };
        let hub = h.ns("hub");
        ip(&["netns", "add", &hub])?;
        for i in 1..=3 {
            ip(&["netns", "add", &h.ns(&format!("h{i}"))])?;
        }
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 1..=3 {
            let host = h.ns(&format!("h{i}"));
            let (inside, port) = (format!("vh{i}"), format!("b{i}"));
            ip(&[
                "link", "add", &inside, "netns", &host, "type", "veth", "peer", "name", &port, "netns", &hub,
            ])?;
            ip(&["-n", &host, "addr", "add", &format!("{}/24", h.addr(i)), "dev", &inside])?;
            ip(&["-n", &host, "link", "set", &inside, "up"])?;
            ip(&["-n", &host, "link", "set", "lo", "up"])?;
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
        }
        Ok(h)
    }

    fn ns(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn addr(&self, host: u32) -> String {
        format!("10.231.{}.{host}", self.subnet)
    }

    /// Takes host `i`'s link to the bridge down or up.
    fn link(&self, i: u32, up: bool) {
        ip(&[
            "-n",
            &self.ns("hub"),
            "link",
            "set",
            &format!("b{i}"),
            if up { "up" } else { "down" },
        ])
        .unwrap();
    }

    fn run(&self, role: &str, host: u32, dir: &Path) -> Role {
        let ns = self.ns(&format!("h{host}"));
        let envs = [
            ("SLUICE_TEST_IP", self.addr(host)),
            ("SLUICE_TEST_STORE", format!("tcp://{}:{PORT}", self.addr(1))),
        ];
        spawn_role(TEST, role, dir.to_str().unwrap(), &["ip", "netns", "exec", &ns], &envs)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in ["h1", "h2", "h3", "hub"] {
            let _ = ip(&["netns", "del", &self.ns(n)]);
        }
    }
}

fn fast(mut o: AgentOptions) -> AgentOptions {
    o.heartbeat_interval = Duration::from_millis(200);
    o.heartbeat_misses = 5;
    o.listen = format!("{}:0", std::env::var("SLUICE_TEST_IP").unwrap());
    o
}

static STOP: std::sync::Mutex<bool> = std::sync::Mutex::new(false);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.handler("add", |_, (a, b): (i64, i64)| Ok(a + b))
        .handler("sleep_ms", |_, ms: u64| {
            std::thread::sleep(Duration::from_millis(ms));
            Ok(())
        })
        .handler("stop", |_, (): ()| {
            *STOP.lock().unwrap() = true;
            Ok(())
        });
    r
}

#[test]
fn namespaces_tcp_across_shm_within_cut_links_and_kills() {
    if let Some((role, dir)) = child_role(TEST) {
        let dir = PathBuf::from(dir);
        if role == "driver" {
            return driver(&dir);
        }
        let store = std::env::var("SLUICE_TEST_STORE").unwrap();
        let agent = Agent::init(fast(AgentOptions::new(role.as_str()).join(store)), registry()).unwrap();
        while !*STOP.lock().unwrap() {
            std::thread::sleep(Duration::from_millis(10));
        }
        return agent.leave(Duration::from_secs(30)).unwrap();
    }
    if !nix::unistd::geteuid().is_root() {
        sluice_tests::gpu::skipped(TEST, "building network namespaces needs root");
        return;
    }
    let hosts = match Hosts::build() {
        Ok(h) => h,
        Err(e) => {
            sluice_tests::gpu::skipped(TEST, format!("cannot build network namespaces here: {e}"));
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("sluice-multihost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut driver = hosts.run("driver", 1, &dir);
    let mut local = hosts.run("local", 1, &dir);
    let mut two = hosts.run("two", 2, &dir);
    let mut three = hosts.run("three", 3, &dir);
    // The driver asks for each fault in turn through files; the test process acts on the hosts.
    wait_file(&dir.join("cut3"));
    hosts.link(3, false);
    put_file(&dir.join("cut3-done"), "");
    wait_file(&dir.join("restore3"));
    hosts.link(3, true);
    put_file(&dir.join("restore3-done"), "");
    wait_file(&dir.join("kill2"));
    two.kill();
    put_file(&dir.join("kill2-done"), "");
    wait_file(&dir.join("restart2"));
    let mut two_again = hosts.run("two", 2, &dir);
    put_file(&dir.join("restart2-done"), "");
    let out = driver.expect_success();
    for line in out
        .lines()
        .filter(|l| l.starts_with("pipe to") || l.starts_with("call over"))
    {
        eprintln!("{line}");
    }
    for r in [&mut local, &mut three, &mut two_again] {
        r.expect_success();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn ask(dir: &Path, step: &str) {
    put_file(&dir.join(step), "");
    wait_file(&dir.join(format!("{step}-done")));
}

fn driver(dir: &Path) {
    let store = std::env::var("SLUICE_TEST_STORE").unwrap();
    let addr = store.trim_start_matches("tcp://").to_owned();
    let agent = Agent::init(fast(AgentOptions::new("driver").rank(0, 1).store(addr)), registry()).unwrap();
    let events = agent.membership_events();
    eventually("every worker joined", || {
        ["local", "two", "three"].iter().all(|n| agent.worker(*n).is_ok())
    });
    for (peer, want) in [("local", "shm"), ("two", "tcp"), ("three", "tcp")] {
        assert_eq!(agent.call::<_, i64>(peer, "add", &(1i64, 2i64)).unwrap(), 3);
        let info = agent.pipe_info(peer).unwrap();
        assert_eq!(info.transport, want, "transport to {peer}: {info:?}");
        eprintln!("pipe to {peer}: {} / {:?}", info.transport, info.cpu_channel);
    }

    // Cut host 3's link with a call in flight: it fails as peer-lost (not by its long
    // timeout), and the rest keeps working.
    let pending = agent.rpc_async_timeout(
        "three",
        "sleep_ms",
        sluice_agent::Payload::encode(&5_000u64).unwrap(),
        Duration::from_secs(90),
    );
    ask(dir, "cut3");
    let cut = Instant::now();
    let e = pending.wait().unwrap_err();
    assert!(
        matches!(&e, RpcError::PeerLost { worker, .. } if worker == "three"),
        "{e}"
    );
    eprintln!("call over the cut link failed after {:?}: {e}", cut.elapsed());
    expect_event(
        &events,
        "three lost",
        |e| matches!(e, MembershipEvent::Lost { worker, .. } if worker.name == "three"),
    );
    let e = agent.call::<_, i64>("three", "add", &(1i64, 1i64)).unwrap_err();
    assert!(e.is_peer_lost(), "{e}");
    assert_eq!(agent.call::<_, i64>("two", "add", &(2i64, 2i64)).unwrap(), 4);
    assert_eq!(agent.call::<_, i64>("local", "add", &(3i64, 3i64)).unwrap(), 6);

    ask(dir, "restore3");
    expect_event(
        &events,
        "three reconnected",
        |e| matches!(e, MembershipEvent::Reconnected(w) if w.name == "three"),
    );
    assert_eq!(agent.call::<_, i64>("three", "add", &(4i64, 4i64)).unwrap(), 8);

    // SIGKILL on host 2: detected, and it rejoins under its name.
    let first = agent.worker("two").unwrap().id;
    ask(dir, "kill2");
    expect_event(
        &events,
        "two lost",
        |e| matches!(e, MembershipEvent::Lost { worker, .. } if worker.name == "two"),
    );
    ask(dir, "restart2");
    expect_event(
        &events,
        "two rejoined",
        |e| matches!(e, MembershipEvent::Joined(w) if w.name == "two"),
    );
    assert_ne!(agent.worker("two").unwrap().id, first);
    assert_eq!(agent.call::<_, i64>("two", "add", &(5i64, 5i64)).unwrap(), 10);
    assert_eq!(agent.pipe_info("two").unwrap().transport, "tcp");

    for peer in ["local", "three", "two"] {
        agent.call::<_, ()>(peer, "stop", &()).unwrap();
    }
    eventually("everyone left", || agent.workers().len() == 1);
    agent.leave(Duration::from_secs(10)).unwrap();
}
