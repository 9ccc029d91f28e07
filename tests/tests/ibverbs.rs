//! The ibverbs transport: the transport conformance suite on the in-process verbs model (always)
//! and on real hardware (with the `rdma` feature, where a device exists: `scripts/rdma-check.sh`),
//! plus what only the model can show: a crashed peer, and that no verbs rule was broken.

use std::time::{Duration, Instant};

use sluice_tests::conformance::transport::Backend;
use sluice_tests::{pattern, transport_conformance, watchdog};
use sluice_transport::ibv::model::{ModelFabric, DEFAULT_LIMITS};
use sluice_transport::ibv::{DeviceChoice, IbvOptions, IbvTransport};
use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport};

fn model_options() -> IbvOptions {
    IbvOptions {
        device: DeviceChoice::Model,
        ..IbvOptions::default()
    }
}

struct Model;
impl Backend for Model {
    type T = IbvTransport;
    const NAME: &'static str = "ibv";
    fn transport() -> IbvTransport {
        IbvTransport::new(model_options())
    }
}

transport_conformance!(ibv_model, Model);

#[cfg(feature = "rdma")]
mod hardware {
    use super::*;

    const PEER: &str = env!("CARGO_BIN_EXE_sluice-test-peer");

    /// The device `SLUICE_IB_DEVICE` / `_PORT` / `_GID_INDEX` name, or the automatic choice.
    pub struct Hardware;
    impl Backend for Hardware {
        type T = IbvTransport;
        const NAME: &'static str = "ibv";
        fn transport() -> IbvTransport {
            IbvTransport::default()
        }
        fn available() -> Result<(), String> {
            IbvTransport::default().viability().map_err(|e| e.to_string())
        }
    }

    transport_conformance!(ibv_hardware, Hardware, &sluice_tests::peer_exe(PEER));

    /// GPUDirect RDMA where the host has both a GPU and a NIC that can register its memory:
    /// GPU tensors (at offsets inside their allocations) land intact in the peer's GPU memory.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cuda_gdr_on_hardware() {
        use sluice_channel::channel::gdr::GdrContext;
        use sluice_channel::channel::ChannelContext;
        use sluice_channel::cuda::Stream;
        use sluice_channel::{
            Allocation, ChannelKind, ContextOptions, CudaBuffer, Device, Message, Tensor, TransportKind,
        };
        if sluice_tests::conformance::transport::skip::<Hardware>("cuda_gdr_on_hardware") {
            return;
        }
        let gdr = GdrContext::new(Some(&IbvTransport::default())).viability();
        if !sluice_tests::gpu::require("cuda_gdr_on_hardware", "SLUICE_REQUIRE_GPU", gdr) {
            return;
        }
        watchdog("cuda_gdr on hardware", async {
            let opts = ContextOptions {
                transports: vec![TransportKind::Ibv],
                channels: vec![ChannelKind::Rdma, ChannelKind::CudaGdr],
                ..ContextOptions::default()
            };
            let (a, b) = sluice_tests::pipe_pair(opts).await;
            assert_eq!(
                a.info().channel(Device::Cuda(0), Device::Cuda(0)),
                Some(ChannelKind::CudaGdr)
            );
            let stream = Stream::new(0).unwrap();
            for (round, len) in [1usize, 4096, (1 << 20) + 7, 80 << 20].into_iter().enumerate() {
                let whole = CudaBuffer::alloc(len + 512, &stream).unwrap();
                let src = whole.slice(512..512 + len).unwrap();
                let data = pattern(round as u64, len);
                src.write_from_host(&data).unwrap();
                let m = Message {
                    metadata: bytes::Bytes::new(),
                    payloads: Vec::new(),
                    tensors: vec![Tensor::cuda(src, Device::Cuda(0))],
                };
                let recv = async {
                    let d = b.read_descriptor().await.unwrap();
                    let alloc = Allocation::try_for_descriptor(&d, Stream::new).unwrap();
                    b.read(alloc).await.unwrap()
                };
                let (w, got) = tokio::join!(a.write(&m), recv);
                w.unwrap();
                let out = got.tensors[0].as_cuda().unwrap().read_to_host().unwrap();
                assert!(out == data, "{len} bytes corrupted through cuda_gdr");
            }
        })
        .await
    }

    /// A pipe over the real device: rdma (and, for small tensors, the ring) both ways.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipe_rdma_on_hardware() {
        use sluice_channel::{Allocation, ChannelKind, ContextOptions, Message, Tensor, TransportKind};
        if sluice_tests::conformance::transport::skip::<Hardware>("pipe_rdma_on_hardware") {
            return;
        }
        watchdog("rdma pipe on hardware", async {
            let opts = ContextOptions {
                transports: vec![TransportKind::Ibv],
                channels: vec![ChannelKind::Rdma],
                ..ContextOptions::default()
            };
            let (a, b) = sluice_tests::pipe_pair(opts).await;
            assert_eq!((a.info().transport, a.info().cpu_channel), ("ibv", ChannelKind::Rdma));
            let sizes = [0usize, 1, 65_535, 65_536, (1 << 20) + 3, 200 << 20];
            for round in 0..4u64 {
                let (from, to) = if round % 2 == 0 { (&a, &b) } else { (&b, &a) };
                let m = Message {
                    metadata: bytes::Bytes::new(),
                    payloads: Vec::new(),
                    tensors: sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| Tensor::cpu(pattern(round * 10 + i as u64, n)))
                        .collect(),
                };
                let recv = async {
                    let d = to.read_descriptor().await.unwrap();
                    to.read(Allocation::for_descriptor(&d)).await.unwrap()
                };
                let (w, got) = tokio::join!(from.write(&m), recv);
                w.unwrap();
                for (i, &n) in sizes.iter().enumerate() {
                    assert!(got.tensors[i].as_cpu().unwrap()[..] == pattern(round * 10 + i as u64, n)[..]);
                }
            }
        })
        .await
    }
}

/// Waits until every connection of `t` has been released (flushed and drained).
async fn released(t: &IbvTransport) {
    let start = Instant::now();
    while t.open_connections() > 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "connections never drained");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A peer whose process dies (its model device is killed: queue pairs stop answering, sockets
/// close) fails our pending read and our blocked write with peer-lost errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_peer_crash_mid_transfer() {
    watchdog("ibv peer crash", async {
        let ours = IbvTransport::new(model_options());
        for direction in ["peer streams to us", "we stream to the peer"] {
            let victim_dev = ModelFabric::global().device("victim", DEFAULT_LIMITS);
            let victim = IbvTransport::with_device(victim_dev.clone(), model_options());
            let mut listener = ours.listen("").await.unwrap();
            let addr = listener.address();
            let (c, s) = tokio::join!(victim.connect(&addr), listener.accept());
            let (vr, mut vw) = c.unwrap().split();
            let (mut r, mut w) = s.unwrap().split();
            if direction == "peer streams to us" {
                let streamer = tokio::spawn(async move {
                    let chunk = pattern(1, 1 << 20);
                    loop {
                        if vw.write(&[&chunk]).await.is_err() {
                            return;
                        }
                    }
                });
                let mut buf = vec![0u8; 2 << 20];
                for _ in 0..3 {
                    r.read(&mut buf).await.unwrap();
                }
                victim_dev.kill();
                let err = loop {
                    match r.read(&mut buf).await {
                        Ok(_) => continue,
                        Err(e) => break e,
                    }
                };
                assert!(err.is_peer_lost(), "{direction}: got {err:?}");
                streamer.abort();
            } else {
                let big = vec![3u8; 64 << 20];
                let pending = tokio::spawn(async move { w.write(&[&big]).await });
                tokio::time::sleep(Duration::from_millis(100)).await;
                assert!(!pending.is_finished(), "64 MiB cannot fit a 2 MiB ring unread");
                victim_dev.kill();
                let err = pending.await.unwrap().expect_err("write to a dead peer");
                assert!(err.is_peer_lost(), "{direction}: got {err:?}");
            }
            drop(vr);
        }
        released(&ours).await;
    })
    .await
}

/// Orderly traffic and every way of closing leave the model with no rule broken: nothing
/// freed before its flushed completions were polled, no queue or completion queue overrun.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_keeps_the_verbs_rules() {
    watchdog("ibv teardown rules", async {
        let fabric = ModelFabric::new();
        let t = IbvTransport::with_device(fabric.device("rules", DEFAULT_LIMITS), model_options());
        let mut listener = t.listen("").await.unwrap();
        for round in 0..6 {
            let addr = listener.address();
            let (c, s) = tokio::join!(t.connect(&addr), listener.accept());
            let (mut cr, mut cw) = c.unwrap().split();
            let (mut sr, mut sw) = s.unwrap().split();
            // Traffic both ways, with writes still queued when the close comes.
            for i in 0..50u64 {
                cw.write(&[&pattern(i, 5000)]).await.unwrap();
                sw.write(&[&pattern(i, 3000)]).await.unwrap();
            }
            for i in 0..50u64 {
                assert_eq!(sr.read_vec(1 << 20).await.unwrap(), pattern(i, 5000));
            }
            match round % 3 {
                0 => cw.close(),
                1 => drop((cr, cw)),
                _ => {
                    // A read pending at close.
                    let pending = tokio::spawn(async move {
                        let mut buf = vec![0u8; 1 << 20];
                        for _ in 0..50 {
                            cr.read(&mut buf).await.unwrap();
                        }
                        cr.read(&mut buf).await
                    });
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    sw.close();
                    assert!(pending.await.unwrap().unwrap_err().is_peer_lost());
                    drop(cw);
                    drop((sr, sw));
                    continue;
                }
            }
            let err = sr.read_vec(1 << 20).await.expect_err("peer closed");
            assert!(err.is_peer_lost(), "{err:?}");
            drop((sr, sw));
        }
        released(&t).await;
        let v = fabric.violations();
        assert!(v.is_empty(), "verbs rules broken: {v:?}");
        let stats = fabric.stats();
        assert!(stats.executed > 600, "{stats:?}");
    })
    .await
}

/// One-sided reads through a connection's queue pair: the data lands, a wrong key fails the
/// read (and the connection) with an error naming the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sided_reads() {
    use sluice_transport::ibv::{Access, Sge};
    watchdog("ibv one-sided reads", async {
        let t = IbvTransport::new(model_options());
        let mut listener = t.listen("").await.unwrap();
        let addr = listener.address();
        let (c, s) = tokio::join!(t.connect(&addr), listener.accept());
        let (c, s) = (c.unwrap(), s.unwrap());
        let dev = t.device().unwrap();
        let mut remote = pattern(9, 3 << 20);
        let mut local = vec![0u8; 3 << 20];
        // SAFETY: both vectors outlive their registrations (dropped at the end of the test).
        let rmr = unsafe { dev.register(remote.as_mut_ptr(), remote.len(), Access::REMOTE_READ) }.unwrap();
        let lmr = unsafe { dev.register(local.as_mut_ptr(), local.len(), Access::LOCAL) }.unwrap();
        let h = c.rdma();
        let sge = Sge {
            addr: lmr.info().addr,
            len: local.len() as u32,
            lkey: lmr.info().lkey,
        };
        // SAFETY: `local` is registered and outlives the awaited read.
        unsafe { h.read(sge, rmr.info().addr, rmr.info().rkey) }.await.unwrap();
        assert!(local == remote);
        let err = unsafe { h.read(sge, rmr.info().addr, rmr.info().rkey ^ 1) }
            .await
            .expect_err("wrong rkey");
        assert!(err.to_string().contains("ibv:"), "names the peer: {err}");
        drop((h, c, s));
        released(&t).await;
        drop((rmr, lmr));
    })
    .await
}
