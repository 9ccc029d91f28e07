//! The verbs model's rules, and the transport's bootstrap parsing.

use std::time::{Duration, Instant};

use super::model::{ModelFabric, DEFAULT_LIMITS};
use super::*;

/// Two connected queue pairs on two devices of a fresh fabric, each with its own CQ.
struct Pair {
    fabric: ModelFabric,
    _devs: (Arc<model::ModelDevice>, Arc<model::ModelDevice>),
    cqs: (Box<dyn VerbsCq>, Box<dyn VerbsCq>),
    qps: (Box<dyn VerbsQp>, Box<dyn VerbsQp>),
}

/// What `d` would say in its hello for queue pair `q`.
fn endpoint(d: &model::ModelDevice, q: &dyn VerbsQp) -> Endpoint {
    let (lid, gid) = d.address();
    let l = d.limits();
    Endpoint {
        lid,
        gid,
        qpn: q.qpn(),
        psn: 0,
        mtu: l.active_mtu,
        rd_responder: l.max_rd_responder,
    }
}

fn pair(limits: Limits, caps: QpCaps, cq_entries: u32) -> Pair {
    let fabric = ModelFabric::new();
    let a = fabric.device("a", limits);
    let b = fabric.device("b", limits);
    let ca = a.create_cq(cq_entries).unwrap();
    let cb = b.create_cq(cq_entries).unwrap();
    let qa = a.create_qp(ca.as_ref(), caps).unwrap();
    let qb = b.create_qp(cb.as_ref(), caps).unwrap();
    let (eb, ea) = (endpoint(&b, qb.as_ref()), endpoint(&a, qa.as_ref()));
    qa.connect(0, &eb, &Path::negotiate(&a.limits(), &eb)).unwrap();
    qb.connect(0, &ea, &Path::negotiate(&b.limits(), &ea)).unwrap();
    Pair {
        fabric,
        _devs: (a, b),
        cqs: (ca, cb),
        qps: (qa, qb),
    }
}

fn caps(d: u32) -> QpCaps {
    QpCaps {
        send_depth: d,
        recv_depth: d,
    }
}

/// Polls until `n` completions arrived (watchdog: 10 s).
fn poll_n(cq: &dyn VerbsCq, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    let start = Instant::now();
    while out.len() < n {
        let want = n - out.len();
        cq.poll(&mut out, want).unwrap();
        if out.len() < n {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "only {out:?} of {n} completions"
            );
            // Arm, poll once more, and sleep only if that found nothing.
            cq.arm().unwrap();
            let want = n - out.len();
            if cq.poll(&mut out, want).unwrap() == 0 {
                cq.wait(Duration::from_millis(10)).unwrap();
            }
        }
    }
    out
}

fn registered(dev: &model::ModelDevice, buf: &mut [u8], access: Access) -> Box<dyn VerbsMr> {
    // SAFETY: every test keeps `buf` alive past the region's drop.
    unsafe { dev.register(buf.as_mut_ptr(), buf.len(), access).unwrap() }
}

#[test]
fn write_with_immediate_lands_and_completes_in_order() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    let mut src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    let smr = registered(&p._devs.0, &mut src, Access::LOCAL);
    let dmr = registered(&p._devs.1, &mut dst, Access::REMOTE_WRITE);
    for i in 0..4 {
        p.qps.1.post_recv(100 + i).unwrap();
    }
    for i in 0..4u64 {
        let wr = SendWr {
            wr_id: i,
            op: SendOp::WriteImm {
                remote_addr: dmr.info().addr + i * 1024,
                rkey: dmr.info().rkey,
                imm: i as u32,
            },
            local: Some(Sge {
                addr: smr.info().addr,
                len: 1024,
                lkey: smr.info().lkey,
            }),
        };
        unsafe { p.qps.0.post_send(&wr).unwrap() };
    }
    let sent = poll_n(p.cqs.0.as_ref(), 4);
    assert_eq!(sent.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert!(sent
        .iter()
        .all(|c| c.status == WcStatus::Success && c.kind == WcKind::Write));
    let got = poll_n(p.cqs.1.as_ref(), 4);
    assert_eq!(
        got.iter().map(|c| c.imm).collect::<Vec<_>>(),
        vec![Some(0), Some(1), Some(2), Some(3)]
    );
    assert_eq!(
        got.iter().map(|c| c.wr_id).collect::<Vec<_>>(),
        vec![100, 101, 102, 103]
    );
    assert!(dst.iter().all(|&b| b == 7));
    drop((smr, dmr));
    assert!(p.fabric.violations().is_empty(), "{:?}", p.fabric.violations());
}

#[test]
fn posting_beyond_the_queue_depth_fails_until_completions_are_polled() {
    let p = pair(DEFAULT_LIMITS, caps(2), 64);
    for i in 0..2 {
        p.qps.1.post_recv(i).unwrap();
    }
    assert!(matches!(
        p.qps.1.post_recv(9),
        Err(VerbsError::QueueFull { depth: 2, .. })
    ));
    let send = |id| SendWr {
        wr_id: id,
        op: SendOp::SendImm { imm: 1 },
        local: None,
    };
    unsafe {
        p.qps.0.post_send(&send(1)).unwrap();
        p.qps.0.post_send(&send(2)).unwrap();
        assert!(matches!(p.qps.0.post_send(&send(3)), Err(VerbsError::QueueFull { .. })));
    }
    // Executed is not enough: the slot frees when the completion is polled.
    poll_n(p.cqs.0.as_ref(), 1);
    unsafe { p.qps.0.post_send(&send(3)).unwrap() };
}

#[test]
fn wrong_keys_and_out_of_range_addresses_fail_and_break_the_queue_pairs() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    let mut src = vec![1u8; 64];
    let mut dst = vec![0u8; 64];
    let smr = registered(&p._devs.0, &mut src, Access::LOCAL);
    let dmr = registered(&p._devs.1, &mut dst, Access::REMOTE_WRITE);
    p.qps.1.post_recv(0).unwrap();
    let write = |id, addr, rkey, lkey, len| SendWr {
        wr_id: id,
        op: SendOp::WriteImm {
            remote_addr: addr,
            rkey,
            imm: 0,
        },
        local: Some(Sge {
            addr: smr.info().addr,
            len,
            lkey,
        }),
    };
    // Past the end of the remote region.
    unsafe {
        p.qps
            .0
            .post_send(&write(1, dmr.info().addr + 32, dmr.info().rkey, smr.info().lkey, 64))
            .unwrap();
        // Queued behind it: flushed.
        p.qps
            .0
            .post_send(&write(2, dmr.info().addr, dmr.info().rkey, smr.info().lkey, 8))
            .unwrap();
    }
    let c = poll_n(p.cqs.0.as_ref(), 2);
    assert_eq!(c[0].status, WcStatus::RemoteAccess);
    assert_eq!(c[1].status, WcStatus::Flushed);
    // The responder's queue pair went to error too: its receive is flushed.
    let r = poll_n(p.cqs.1.as_ref(), 1);
    assert_eq!(r[0].status, WcStatus::Flushed);
    assert!(dst.iter().all(|&b| b == 0), "nothing may land");

    // A wrong rkey and a wrong lkey, on a fresh pair.
    let q = pair(DEFAULT_LIMITS, caps(8), 64);
    let mut src2 = vec![1u8; 64];
    let mut dst2 = vec![0u8; 64];
    let smr2 = registered(&q._devs.0, &mut src2, Access::LOCAL);
    let dmr2 = registered(&q._devs.1, &mut dst2, Access::LOCAL); // no remote write right
    q.qps.1.post_recv(0).unwrap();
    let wr = SendWr {
        wr_id: 5,
        op: SendOp::WriteImm {
            remote_addr: dmr2.info().addr,
            rkey: dmr2.info().rkey,
            imm: 0,
        },
        local: Some(Sge {
            addr: smr2.info().addr,
            len: 8,
            lkey: smr2.info().lkey,
        }),
    };
    unsafe { q.qps.0.post_send(&wr).unwrap() };
    assert_eq!(poll_n(q.cqs.0.as_ref(), 1)[0].status, WcStatus::RemoteAccess);
    let r = SendWr {
        wr_id: 6,
        local: Some(Sge {
            addr: smr2.info().addr,
            len: 8,
            lkey: smr2.info().lkey ^ 0x55,
        }),
        ..wr
    };
    let z = pair(DEFAULT_LIMITS, caps(8), 64);
    unsafe { z.qps.0.post_send(&r).unwrap() };
    assert_eq!(poll_n(z.cqs.0.as_ref(), 1)[0].status, WcStatus::LocalProtection);
    drop((smr, dmr, smr2, dmr2));
}

#[test]
fn rdma_read_copies_remote_memory_and_needs_the_right() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    let mut remote: Vec<u8> = (0..=255).collect();
    let mut local = vec![0u8; 256];
    let rmr = registered(&p._devs.1, &mut remote, Access::REMOTE_READ);
    let lmr = registered(&p._devs.0, &mut local, Access::LOCAL);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Read {
            remote_addr: rmr.info().addr,
            rkey: rmr.info().rkey,
        },
        local: Some(Sge {
            addr: lmr.info().addr,
            len: 256,
            lkey: lmr.info().lkey,
        }),
    };
    unsafe { p.qps.0.post_send(&wr).unwrap() };
    let c = poll_n(p.cqs.0.as_ref(), 1);
    assert_eq!((c[0].status, c[0].kind), (WcStatus::Success, WcKind::Read));
    drop((rmr, lmr));
    assert_eq!(local, remote);
}

/// As on hardware, a region's remote key is not its local key: a read naming the peer's lkey
/// where its rkey belongs fails with a remote access error.
#[test]
fn an_lkey_is_not_an_rkey() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    let mut remote = vec![1u8; 256];
    let mut local = vec![0u8; 256];
    let rmr = registered(&p._devs.1, &mut remote, Access::REMOTE_READ);
    let lmr = registered(&p._devs.0, &mut local, Access::LOCAL);
    assert_ne!(rmr.info().lkey, rmr.info().rkey);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Read {
            remote_addr: rmr.info().addr,
            rkey: rmr.info().lkey,
        },
        local: Some(Sge {
            addr: lmr.info().addr,
            len: 256,
            lkey: lmr.info().lkey,
        }),
    };
    unsafe { p.qps.0.post_send(&wr).unwrap() };
    assert_eq!(poll_n(p.cqs.0.as_ref(), 1)[0].status, WcStatus::RemoteAccess);
    drop((rmr, lmr));
}

#[test]
fn the_error_state_flushes_everything_outstanding_in_order() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    for i in 0..5 {
        p.qps.0.post_recv(i).unwrap();
    }
    p.qps.0.set_error().unwrap();
    let c = poll_n(p.cqs.0.as_ref(), 5);
    assert_eq!(c.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    assert!(c.iter().all(|c| c.status == WcStatus::Flushed));
    // Posting in the error state completes as flushed.
    unsafe {
        p.qps
            .0
            .post_send(&SendWr {
                wr_id: 9,
                op: SendOp::SendImm { imm: 0 },
                local: None,
            })
            .unwrap()
    };
    assert_eq!(poll_n(p.cqs.0.as_ref(), 1)[0].status, WcStatus::Flushed);
    // The peer's sends now find nobody: retries exceeded.
    unsafe {
        p.qps
            .1
            .post_send(&SendWr {
                wr_id: 10,
                op: SendOp::SendImm { imm: 0 },
                local: None,
            })
            .unwrap()
    };
    assert_eq!(poll_n(p.cqs.1.as_ref(), 1)[0].status, WcStatus::RetryExceeded);
}

#[test]
fn a_dead_peer_fails_only_after_the_retry_timeout() {
    // Hardware retries a request nobody answers (`timeout` × `retry_cnt`) before reporting
    // RETRY_EXC_ERR; a model that failed at once let code pass that expects dead peers to
    // show up immediately.
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    assert_eq!(model::RETRY_TIMEOUT.as_millis(), 536);
    let retry = Duration::from_millis(300);
    p.fabric.set_retry_timeout(retry);
    p._devs.1.kill();
    let start = Instant::now();
    unsafe {
        p.qps
            .0
            .post_send(&SendWr {
                wr_id: 1,
                op: SendOp::SendImm { imm: 0 },
                local: None,
            })
            .unwrap()
    };
    // Nothing yet: the NIC is still retrying.
    std::thread::sleep(Duration::from_millis(50));
    let mut early = Vec::new();
    p.cqs.0.poll(&mut early, 4).unwrap();
    assert!(early.is_empty(), "failed before the retry timeout: {early:?}");
    let c = poll_n(p.cqs.0.as_ref(), 1);
    assert_eq!(c[0].status, WcStatus::RetryExceeded);
    assert!(
        start.elapsed() >= retry,
        "failed after {:?}, before the retry timeout",
        start.elapsed()
    );
}

#[test]
fn a_send_without_a_posted_receive_waits_for_one() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    unsafe {
        p.qps
            .0
            .post_send(&SendWr {
                wr_id: 1,
                op: SendOp::SendImm { imm: 42 },
                local: None,
            })
            .unwrap()
    };
    std::thread::sleep(Duration::from_millis(30));
    let mut none = Vec::new();
    p.cqs.0.poll(&mut none, 8).unwrap();
    assert!(none.is_empty(), "completed without a receive: {none:?}");
    assert_eq!(p.fabric.stats().rnr_waits, 1);
    p.qps.1.post_recv(7).unwrap();
    assert_eq!(poll_n(p.cqs.1.as_ref(), 1)[0].imm, Some(42));
    assert_eq!(poll_n(p.cqs.0.as_ref(), 1)[0].status, WcStatus::Success);
}

#[test]
fn overrunning_a_completion_queue_is_a_violation() {
    let p = pair(DEFAULT_LIMITS, caps(8), 2);
    for i in 0..3 {
        p.qps.0.post_recv(i).unwrap();
    }
    p.qps.0.set_error().unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert!(p.fabric.violations().iter().any(|v| v.contains("overran")));
}

#[test]
fn freeing_memory_or_queue_pairs_before_draining_is_a_violation() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    let mut src = vec![0u8; 64];
    let smr = registered(&p._devs.0, &mut src, Access::LOCAL);
    // No receive at the peer: the write stays queued (receiver not ready).
    unsafe {
        p.qps
            .0
            .post_send(&SendWr {
                wr_id: 1,
                op: SendOp::WriteImm {
                    remote_addr: 0,
                    rkey: 0,
                    imm: 0,
                },
                local: Some(Sge {
                    addr: smr.info().addr,
                    len: 8,
                    lkey: smr.info().lkey,
                }),
            })
            .unwrap()
    };
    std::thread::sleep(Duration::from_millis(10));
    drop(smr);
    let Pair { fabric, qps, .. } = p;
    drop(qps);
    let v = fabric.violations();
    assert!(v.iter().any(|v| v.contains("deregistered while")), "{v:?}");
    assert!(v.iter().any(|v| v.contains("destroyed with")), "{v:?}");
}

#[test]
fn limits_bound_queue_and_completion_queue_sizes() {
    let limits = Limits {
        max_qp_wr: 16,
        max_cqe: 64,
        ..DEFAULT_LIMITS
    };
    let fabric = ModelFabric::new();
    let d = fabric.device("small", limits);
    assert!(d.create_cq(65).is_err());
    let cq = d.create_cq(64).unwrap();
    assert!(d.create_qp(cq.as_ref(), caps(17)).is_err());
    // The transport derives its depths from the limits and refuses connections beyond the CQ.
    let t = IbvTransport::with_device(d, IbvOptions::default());
    t.viability().unwrap();
    let r = t.reactor().unwrap();
    assert_eq!((r.caps.send_depth, r.caps.recv_depth), (16, 16));
    assert_eq!(r.cq_entries, 64);
    let _q1 = r.new_qp().unwrap();
    let _q2 = r.new_qp().unwrap();
    let err = r.new_qp().err().expect("CQ fully reserved").to_string();
    assert!(err.contains("fully reserved"), "{err}");
}

#[test]
fn hello_round_trips_and_junk_is_refused() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let hello = Hello {
            fabric: "model;fabric=1".into(),
            endpoint: Endpoint {
                lid: 3,
                gid: [9; 16],
                qpn: 77,
                psn: 5,
                mtu: 3,
                rd_responder: 8,
            },
            inbox_addr: 0x1000,
            inbox_rkey: 0xabc,
            inbox_len: 1 << 20,
        };
        let bytes = hello.encode();
        let mut bad_version = bytes.clone();
        bad_version[8] = 9;
        let mut huge_fabric = bytes.clone();
        huge_fabric[10..12].copy_from_slice(&60_000u16.to_le_bytes());
        // The MTU code and the responder depth come from the peer: checked before use (an
        // unknown MTU code would make the verbs binding panic).
        let at = 12 + hello.fabric.len() + 46;
        let mut bad_mtu = bytes.clone();
        bad_mtu[at..at + 4].copy_from_slice(&9u32.to_le_bytes());
        let mut no_reads = bytes.clone();
        no_reads[at + 4] = 0;
        for (input, want) in [
            (bytes.clone(), None),
            (b"GET / HTTP/1.1\r\n\r\n".to_vec(), Some("not an ibverbs hello")),
            (bad_version, Some("protocol version 9")),
            (huge_fabric, Some("fabric descriptor of 60000 bytes")),
            (bad_mtu, Some("MTU code 9")),
            (no_reads, Some("answers no RDMA reads")),
            (bytes[..20].to_vec(), Some("")),
        ] {
            let mut c = TcpStream::connect(addr).await.unwrap();
            let (mut s, _) = l.accept().await.unwrap();
            c.write_all(&input).await.unwrap();
            drop(c);
            match (Hello::read(&mut s).await, want) {
                (Ok(h), None) => assert_eq!(h, hello),
                (Err(e), Some(w)) => assert!(e.contains(w), "{e}"),
                (r, w) => panic!("{r:?} for {w:?}"),
            }
        }
    });
}

#[test]
fn without_the_rdma_feature_or_a_device_hardware_is_not_viable() {
    let t = IbvTransport::new(IbvOptions {
        device: DeviceChoice::Hardware {
            device: None,
            port: None,
            gid_index: None,
        },
        ..IbvOptions::default()
    });
    let err = t.viability().expect_err("no RDMA device on this machine").to_string();
    assert!(err.contains("not viable"), "{err}");
    assert!(t.domain_descriptor().is_empty());
    assert!(!t.can_communicate_with(""));
}

#[test]
fn baselines_run_on_the_model() {
    let fabric = ModelFabric::new();
    let dev = fabric.device("bench", DEFAULT_LIMITS);
    let s = baseline::ping_pong(dev.as_ref(), 64, Duration::from_millis(20)).unwrap();
    assert!(s.len() >= 100);
    let (bps, n) = baseline::write_bandwidth(dev.as_ref(), 1 << 20, Duration::from_millis(20)).unwrap();
    assert!(bps > 0.0 && n >= 8);
    assert!(fabric.violations().is_empty(), "{:?}", fabric.violations());
}

/// Two transports on devices of a fresh fabric, one connection between them (`a` connects to
/// `b`), on 64 KiB rings (the reader hands space back every 16 KiB consumed).
async fn connected(fabric: &ModelFabric) -> (IbvTransport, IbvTransport, IbvConnection, IbvConnection) {
    let opts = IbvOptions {
        device: DeviceChoice::Model,
        ring_capacity: 1 << 16,
        ..IbvOptions::default()
    };
    let a = IbvTransport::with_device(fabric.device("a", DEFAULT_LIMITS), opts.clone());
    let b = IbvTransport::with_device(fabric.device("b", DEFAULT_LIMITS), opts);
    let mut listener = b.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.address();
    let (ca, cb) = tokio::join!(a.connect(&addr), listener.accept());
    (a, b, ca.unwrap(), cb.unwrap())
}

/// Holds a reactor's connection table on a thread of its own until dropped, so the reactor
/// cannot apply the completions it polls: a reactor running late, made deterministic.
struct Stall {
    release: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Stall {
    fn new(reactor: &Arc<Reactor>) -> Stall {
        let reactor = reactor.clone();
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (release, release_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let _table = reactor.conns.lock().unwrap();
            locked_tx.send(()).unwrap();
            let _ = release_rx.recv();
        });
        locked_rx.recv().unwrap();
        Stall {
            release: Some(release),
            thread: Some(thread),
        }
    }
}

impl Drop for Stall {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

/// Waits (10 s at most) until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn frame(i: u8) -> Vec<u8> {
    vec![i; 4000]
}

fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A peer that writes, closes and releases (shutting its bootstrap socket) before our reactor
/// polled its data and close notice: the socket's hang-up overtakes the completion queue. What
/// it sent is still read in full, and then its close reads as a close, not as "peer process
/// hung up".
#[test]
fn a_hang_up_overtaking_the_peers_last_completions_loses_nothing() {
    multi_thread().block_on(async {
        let fabric = ModelFabric::new();
        let (a, b, ca, cb) = connected(&fabric).await;
        let theirs = cb.conn.clone();
        let (mut r, w) = cb.split();
        let stall = Stall::new(&theirs.reactor);
        let (ar, mut aw) = ca.split();
        for i in 0..4 {
            aw.write(&[&frame(i)]).await.unwrap();
        }
        aw.close();
        until("the writer's side is released", || a.open_connections() == 0).await;
        until("the reader's side saw the socket hang up", || {
            theirs.lock().hung_up.is_some()
        })
        .await;
        assert!(
            !theirs.lock().peer_gone,
            "a hang-up counts only once the queue is drained"
        );
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            for _ in 0..4 {
                got.push(r.read_vec(1 << 20).await?);
            }
            let end = r.read_vec(1 << 20).await.expect_err("the peer closed");
            Ok::<_, TransportError>((got, end))
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!reader.is_finished(), "nothing was readable yet: {:?}", reader.await);
        drop(stall);
        let (got, end) = reader.await.unwrap().expect("everything the peer sent is read");
        assert_eq!(got, (0..4).map(frame).collect::<Vec<_>>());
        assert!(end.is_peer_lost() && end.to_string().contains("peer closed"), "{end}");
        drop((ar, aw, w));
        until("both sides are released", || {
            a.open_connections() + b.open_connections() == 0
        })
        .await;
        assert!(fabric.violations().is_empty(), "{:?}", fabric.violations());
    });
}

/// An acknowledgement posted before our reactor polled the peer's close notice reaches a queue
/// pair the peer already tore down and fails: that ends the connection quietly, and the data
/// still in the inbox stays readable.
#[test]
fn an_acknowledgement_racing_the_peers_teardown_does_not_fail_the_reader() {
    multi_thread().block_on(async {
        let fabric = ModelFabric::new();
        let (a, b, ca, cb) = connected(&fabric).await;
        let theirs = cb.conn.clone();
        let (mut r, w) = cb.split();
        let (ar, mut aw) = ca.split();
        // 8 frames (32 KiB) fit the ring: the writer needs no acknowledgement.
        for i in 0..8 {
            aw.write(&[&frame(i)]).await.unwrap();
        }
        let sent = 8 * (4000 + HEADER_LEN as u64);
        until("the data has arrived", || theirs.lock().arrived == sent).await;
        let stall = Stall::new(&theirs.reactor);
        aw.close();
        until("the writer's side is released", || a.open_connections() == 0).await;
        // Five frames consume more than a quarter of the ring: an acknowledgement goes out,
        // to a queue pair in the error state.
        for i in 0..5 {
            assert_eq!(r.read_vec(1 << 20).await.unwrap(), frame(i));
        }
        assert_eq!(theirs.lock().sq, 1, "the acknowledgement is outstanding");
        drop(stall);
        until("the acknowledgement's completion is polled", || theirs.lock().sq == 0).await;
        for i in 5..8 {
            assert_eq!(r.read_vec(1 << 20).await.unwrap(), frame(i));
        }
        let end = r.read_vec(1 << 20).await.expect_err("the peer closed");
        assert!(end.is_peer_lost() && end.to_string().contains("peer closed"), "{end}");
        drop((ar, aw, r, w));
        until("both sides are released", || {
            a.open_connections() + b.open_connections() == 0
        })
        .await;
        assert!(fabric.violations().is_empty(), "{:?}", fabric.violations());
    });
}

/// As hardware: arming requests an event for the *next* completion. Sleeping with completions
/// that were queued before the arming (not polled once more) is recorded as a violation; the
/// arm-poll-wait sequence is not.
#[test]
fn sleeping_on_completions_queued_before_arming_is_a_violation() {
    let p = pair(DEFAULT_LIMITS, caps(8), 64);
    let cq = p.cqs.1.as_ref();
    p.qps.1.post_recv(1).unwrap();
    cq.arm().unwrap();
    unsafe {
        p.qps
            .0
            .post_send(&SendWr {
                wr_id: 5,
                op: SendOp::SendImm { imm: 7 },
                local: None,
            })
            .unwrap()
    };
    // The armed event fires for the completion (the timeout is only a watchdog).
    cq.wait(Duration::from_secs(10)).unwrap();
    assert!(p.fabric.violations().is_empty(), "{:?}", p.fabric.violations());
    // Armed again without polling: the queued completion raises no event, and sleeping on it
    // is the bug.
    cq.arm().unwrap();
    cq.wait(Duration::from_millis(1)).unwrap();
    let v = p.fabric.violations();
    assert!(v.iter().any(|v| v.contains("queued before it was armed")), "{v:?}");
    let got = poll_n(cq, 1);
    assert_eq!(got[0].imm, Some(7));
    poll_n(p.cqs.0.as_ref(), 1);
}

/// Registration asks for exactly the rights it needs, as `ibv_reg_mr` checks them: write
/// rights on read-only memory fail (EFAULT), remote write without local write fails (EINVAL),
/// a source for remote reads needs no write right at all, and memory the process cannot access
/// cannot be registered.
#[test]
fn registration_rights_are_checked_against_the_memory() {
    static READ_ONLY: [u8; 8192] = [3; 8192];
    let fabric = ModelFabric::new();
    let dev = fabric.device("a", DEFAULT_LIMITS);
    let ro = READ_ONLY.as_ptr() as *mut u8;
    // SAFETY: a static outlives every region; nothing is posted with these regions.
    let r = unsafe { dev.register(ro, READ_ONLY.len(), Access::REMOTE_READ) };
    assert!(r.is_ok(), "a read-only source for remote reads: {:?}", r.err());
    let w = unsafe { dev.register(ro, READ_ONLY.len(), Access::LOCAL) };
    assert!(w.err().is_some_and(|e| e.to_string().contains("EFAULT")));
    let mut buf = vec![0u8; 4096];
    let bad = Access {
        local_write: false,
        remote_write: true,
        remote_read: false,
    };
    let e = unsafe { dev.register(buf.as_mut_ptr(), buf.len(), bad) };
    assert!(e.err().is_some_and(|e| e.to_string().contains("EINVAL")));
    // Sources (what the peer reads) ask for no write right.
    const { assert!(!Access::REMOTE_READ.local_write) };
    // Memory the process cannot access at all (the first page is never mapped; a GPU's device
    // address without a peer-memory module is the same to the NIC): EFAULT, even to read.
    // SAFETY: registration fails before anything is recorded; nothing reads the address.
    let none = unsafe { dev.register(4096 as *mut u8, 4096, Access::REMOTE_READ) };
    let why = none.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(why.contains("not memory this process can access"), "{why}");
}

/// Ports with different MTUs and read depths: the path is the smaller MTU of the two, and
/// neither side initiates more reads than the other answers. The model refuses a path that
/// exceeds the peer's port (what taking the local MTU alone would do).
#[test]
fn the_path_fits_both_ports() {
    let fabric = ModelFabric::new();
    let small = Limits {
        active_mtu: 3, // 1024 B
        max_rd_atomic: 4,
        max_rd_responder: 2,
        ..DEFAULT_LIMITS
    };
    let a = fabric.device("a", small);
    let b = fabric.device("b", DEFAULT_LIMITS);
    let (ca, cb) = (a.create_cq(64).unwrap(), b.create_cq(64).unwrap());
    let qa = a.create_qp(ca.as_ref(), caps(8)).unwrap();
    let qb = b.create_qp(cb.as_ref(), caps(8)).unwrap();
    let (ea, eb) = (endpoint(&a, qa.as_ref()), endpoint(&b, qb.as_ref()));
    // b on its own limits alone: a 4096 B MTU and 16 reads in flight, more than a takes.
    let local_only = Path {
        mtu: DEFAULT_LIMITS.active_mtu,
        rd_initiator: DEFAULT_LIMITS.max_rd_atomic,
        rd_responder: DEFAULT_LIMITS.max_rd_responder,
    };
    let e = qb.connect(0, &ea, &local_only).unwrap_err().to_string();
    assert!(e.contains("peer port's active MTU"), "{e}");
    let too_deep = Path { mtu: 3, ..local_only };
    let e = qb.connect(0, &ea, &too_deep).unwrap_err().to_string();
    assert!(e.contains("the peer answers 2"), "{e}");
    let pb = Path::negotiate(&b.limits(), &ea);
    let pa = Path::negotiate(&a.limits(), &eb);
    assert_eq!((pb.mtu, pb.rd_initiator, pa.rd_initiator), (3, 2, 4));
    qb.connect(0, &ea, &pb).unwrap();
    qa.connect(0, &eb, &pa).unwrap();
}

/// The same through the transport: two devices with different ports connect and carry frames.
#[test]
fn transports_on_mismatched_ports_negotiate_and_carry_frames() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let fabric = ModelFabric::new();
        let opts = IbvOptions {
            device: DeviceChoice::Model,
            ring_capacity: 1 << 16,
            ..IbvOptions::default()
        };
        let small = Limits {
            active_mtu: 2,
            max_rd_responder: 1,
            ..DEFAULT_LIMITS
        };
        let a = IbvTransport::with_device(fabric.device("a", small), opts.clone());
        let b = IbvTransport::with_device(fabric.device("b", DEFAULT_LIMITS), opts);
        let mut listener = b.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.address().to_owned();
        let (ca, cb) = tokio::join!(a.connect(&addr), listener.accept());
        let (mut ra, mut wa) = ca.unwrap().split();
        let (mut rb, mut wb) = cb.unwrap().split();
        // Larger than the 64 KiB ring: the writer waits for the reader to hand space back.
        let frame = vec![7u8; 100_000];
        let mut got = vec![0u8; frame.len()];
        let parts: [&[u8]; 1] = [&frame];
        let (w, r) = tokio::join!(wa.write(&parts), rb.read(&mut got));
        w.unwrap();
        assert_eq!(r.unwrap(), frame.len());
        assert_eq!(got, frame);
        wb.write(&[b"back"]).await.unwrap();
        let mut back = [0u8; 4];
        assert_eq!(ra.read(&mut back).await.unwrap(), 4);
        assert!(fabric.violations().is_empty(), "{:?}", fabric.violations());
    });
}

/// The locked-memory limit: a transport whose one connection could not pin its rings is not
/// viable and says which limit and how to raise it; a registration beyond the limit fails the
/// same way (the model counts pinned bytes as the kernel does).
#[test]
fn the_locked_memory_limit_is_checked_and_named() {
    let fabric = ModelFabric::new();
    let tight = Limits {
        memlock: 3 << 20,
        ..DEFAULT_LIMITS
    };
    let t = IbvTransport::with_device(fabric.device("tight", tight), IbvOptions::default());
    let why = t.viability().expect_err("two 2 MiB rings do not fit 3 MiB").to_string();
    assert!(why.contains("RLIMIT_MEMLOCK") && why.contains("ulimit -l"), "{why}");
    let dev = fabric.device("d", tight);
    let mut a = vec![0u8; 2 << 20];
    let mut b = vec![0u8; 2 << 20];
    let first = registered(&dev, &mut a, Access::LOCAL);
    // SAFETY: `b` outlives the (failed) registration attempt.
    let e = unsafe { dev.register(b.as_mut_ptr(), b.len(), Access::LOCAL) }
        .err()
        .expect("over the limit");
    assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
    drop(first);
    let again = registered(&dev, &mut b, Access::LOCAL);
    drop(again);
}
