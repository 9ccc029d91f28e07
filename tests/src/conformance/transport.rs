//! The transport conformance suite, written once and run against every backend
//! (`tests/tests/transport_conformance.rs` instantiates it).

use std::time::Duration;

use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport, TransportError};

use crate::{pattern, watchdog, PeerProcess};

/// What a backend supplies to the suite.
pub trait Backend: Send + Sync + 'static {
    type T: Transport;
    /// The name the peer binary understands (`tcp`, `shm`).
    const NAME: &'static str;
    fn transport() -> Self::T;
    /// Whether the backend writes small frames at once when there is room
    /// (`FrameWriter::try_write_now`) and reads frames here whole at once
    /// (`FrameReader::try_read_into_vec_now`); one that does must not decline them all.
    const IMMEDIATE: bool = false;
    /// `Err(why)` when the backend's hardware is missing here: its tests then skip (and fail
    /// under `SLUICE_REQUIRE_RDMA=1`).
    fn available() -> Result<(), String> {
        Ok(())
    }
}

/// True (after saying why) when the backend's tests must skip on this machine.
pub fn skip<B: Backend>(test: &str) -> bool {
    let name = format!("{test} on {}", B::NAME);
    !crate::gpu::require(&name, "SLUICE_REQUIRE_RDMA", B::available())
}

type Conn<B> = <<B as Backend>::T as Transport>::Connection;

/// A connected pair of connections in this process.
pub async fn pair<B: Backend>() -> (Conn<B>, Conn<B>) {
    let t = B::transport();
    let mut listener = t.listen("").await.expect("listen");
    let addr = listener.address();
    let (a, b) = tokio::join!(t.connect(&addr), listener.accept());
    (a.expect("connect"), b.expect("accept"))
}

/// Context basics: viable here, a non-empty descriptor that it accepts and a foreign one it
/// refuses (for same-host backends).
pub async fn context_basics<B: Backend>() {
    let t = B::transport();
    t.viability().expect("viable on the test machine");
    let d = t.domain_descriptor();
    assert!(!d.is_empty());
    assert!(t.can_communicate_with(&d));
}

/// Many writes in both directions at once arrive complete and in order.
pub async fn ordering_of_interleaved_writes<B: Backend>() {
    watchdog("interleaved writes", async {
        let (a, b) = pair::<B>().await;
        let (mut ar, mut aw) = a.split();
        let (mut br, mut bw) = b.split();
        const N: u64 = 2000;
        let sizes = |i: u64| [0usize, 1, 7, 64, 1000, 4096, 70_000][(i % 7) as usize];
        let writer = |mut w: <Conn<B> as Connection>::Writer, salt: u64| async move {
            for i in 0..N {
                let body = pattern(i ^ salt, sizes(i));
                let seq = i.to_le_bytes();
                w.write(&[&seq, &body]).await.expect("write");
            }
            w
        };
        let reader = |mut r: <Conn<B> as Connection>::Reader, salt: u64| async move {
            let mut buf = vec![0u8; 80_000];
            for i in 0..N {
                let n = r.read(&mut buf).await.expect("read");
                assert_eq!(
                    u64::from_le_bytes(buf[..8].try_into().unwrap()),
                    i,
                    "frames out of order"
                );
                assert_eq!(&buf[8..n], &pattern(i ^ salt, sizes(i))[..], "frame {i} corrupted");
            }
            r
        };
        let wa = tokio::spawn(writer(aw, 1));
        let wb = tokio::spawn(writer(bw, 2));
        let rb = tokio::spawn(reader(br, 1));
        let ra = tokio::spawn(reader(ar, 2));
        aw = wa.await.unwrap();
        bw = wb.await.unwrap();
        br = rb.await.unwrap();
        ar = ra.await.unwrap();
        drop((ar, aw, br, bw));
    })
    .await
}

/// Zero-length and one-byte frames are frames like any other.
pub async fn zero_and_one_byte_writes<B: Backend>() {
    watchdog("tiny writes", async {
        let (a, b) = pair::<B>().await;
        let (_ar, mut aw) = a.split();
        let (mut br, _bw) = b.split();
        aw.write(&[]).await.unwrap();
        aw.write(&[b"x"]).await.unwrap();
        aw.write(&[b"", b""]).await.unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(br.read(&mut buf).await.unwrap(), 0);
        assert_eq!(br.read(&mut buf).await.unwrap(), 1);
        assert_eq!(buf[0], b'x');
        assert!(br.read_vec(0).await.unwrap().is_empty());
        // A zero-length frame fits a zero-length buffer.
        aw.write(&[]).await.unwrap();
        assert_eq!(br.read(&mut []).await.unwrap(), 0);
    })
    .await
}

/// Deferred frames keep their order among plain writes, leave with the next write or flush
/// (the writer then waits until the reader has them all, so a frame held back would hang the
/// reader), and may be of any size, larger than a ring or a batch buffer included.
pub async fn deferred_writes_keep_order_and_flush<B: Backend>() {
    watchdog("deferred writes", async {
        let (a, b) = pair::<B>().await;
        let (_ar, mut aw) = a.split();
        let (mut br, _bw) = b.split();
        const SIZES: [usize; 8] = [0, 1, 64, 4096, 70_000, 3 << 20, 64, 0];
        // Frames of round r: SIZES deferred, then (round 1) one plain 5-byte write.
        let frames = |round: u64| SIZES.len() as u64 + u64::from(round == 1);
        let len_of = |k: u64| SIZES.get(k as usize).copied().unwrap_or(5);
        let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(1);
        let writer = tokio::spawn(async move {
            let mut i = 0u64;
            for round in 0..3u64 {
                for &len in &SIZES {
                    aw.write_deferred(&[&i.to_le_bytes(), &pattern(i, len)])
                        .await
                        .expect("deferred write");
                    i += 1;
                }
                match round {
                    1 => {
                        aw.write(&[&i.to_le_bytes(), &pattern(i, 5)]).await.expect("write");
                        i += 1;
                    }
                    _ => aw.flush().await.expect("flush"),
                }
                if round == 2 {
                    aw.flush().await.expect("flush of nothing held");
                }
                // Idle until the reader has the whole round.
                done_rx.recv().await.expect("reader gone");
            }
            aw
        });
        let mut buf = vec![0u8; 4 << 20];
        let mut i = 0u64;
        for round in 0..3u64 {
            for k in 0..frames(round) {
                let len = len_of(k);
                let n = br.read(&mut buf).await.expect("read");
                assert_eq!(n, 8 + len, "frame {i}: length");
                assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()), i, "frame {i}: order");
                assert_eq!(&buf[8..n], &pattern(i, len)[..], "frame {i}: corrupted");
                i += 1;
            }
            done_tx.send(()).await.expect("writer gone");
        }
        drop(writer.await.expect("writer"));
    })
    .await
}

/// Immediate writes (`try_write_now`) are frames like any other: published or held back,
/// they keep their order among plain and deferred writes; one declined writes nothing; and a
/// connection nobody reads declines them once full rather than wait. (Backends without the
/// path decline every one.)
pub async fn immediate_writes_keep_order_or_decline<B: Backend>() {
    watchdog("immediate writes", async {
        let (a, b) = pair::<B>().await;
        let (_ar, mut aw) = a.split();
        let (mut br, _bw) = b.split();
        // The length of every frame written, in order.
        let mut lens: Vec<usize> = Vec::new();
        for round in 0..50usize {
            let i = lens.len() as u64;
            let len = (round * 37) % 3000;
            if let Some(r) = aw.try_write_now(&[&i.to_le_bytes(), &pattern(i, len)], true) {
                r.expect("immediate write");
                lens.push(len);
            }
            let i = lens.len() as u64;
            aw.write_deferred(&[&i.to_le_bytes(), &pattern(i, 10)])
                .await
                .expect("deferred write");
            lens.push(10);
            let i = lens.len() as u64;
            if let Some(r) = aw.try_write_now(&[&i.to_le_bytes(), &pattern(i, 5)], false) {
                r.expect("immediate write, held back");
                lens.push(5);
            }
            let i = lens.len() as u64;
            aw.write(&[&i.to_le_bytes(), &pattern(i, 1)]).await.expect("write");
            lens.push(1);
        }
        // 50 rounds of two plain writes each, plus the immediate writes taken.
        let immediate = lens.len() - 100;
        assert!(
            immediate > 0 || !B::IMMEDIATE,
            "{} declined every immediate write into an empty connection",
            B::NAME
        );
        let mut buf = vec![0u8; 80_000];
        for (i, &len) in lens.iter().enumerate() {
            let n = br.read(&mut buf).await.expect("read");
            assert_eq!(n, 8 + len, "frame {i}: length");
            assert_eq!(
                u64::from_le_bytes(buf[..8].try_into().unwrap()),
                i as u64,
                "frame {i}: order"
            );
            assert_eq!(&buf[8..n], &pattern(i as u64, len)[..], "frame {i}: corrupted");
        }
        // Nobody reads now: immediate writes must decline before they would wait for room.
        let block = vec![7u8; 64 << 10];
        let mut filled = 0usize;
        while filled < 10_000 {
            match aw.try_write_now(&[&block], true) {
                Some(r) => {
                    r.expect("immediate write into room");
                    filled += 1;
                }
                None => break,
            }
        }
        assert!(
            filled < 10_000,
            "640 MiB written with nobody reading: an immediate write waited"
        );
        assert!(
            filled > 0 || !B::IMMEDIATE,
            "{} declined an immediate write into an empty connection",
            B::NAME
        );
        for k in 0..filled {
            let n = br.read(&mut buf).await.expect("read of a filled frame");
            assert!(n == block.len() && buf[..n] == block[..], "filled frame {k} corrupted");
        }
        // A closed connection takes no immediate write.
        aw.close();
        assert!(
            !matches!(aw.try_write_now(&[b"x"], true), Some(Ok(()))),
            "an immediate write succeeded on a closed connection"
        );
    })
    .await
}

/// Immediate reads (`try_read_into_vec_now`) take a frame only when it is here whole, and
/// otherwise consume nothing: frames keep their order across immediate and plain reads, a
/// frame too large to take at once is left for the plain read intact, and one over the limit
/// is refused as a plain read refuses it. (Backends without the path decline every one.)
pub async fn immediate_reads_take_whole_frames_or_nothing<B: Backend>() {
    watchdog("immediate reads", async {
        let (a, b) = pair::<B>().await;
        let (_ar, mut aw) = a.split();
        let (mut br, _bw) = b.split();
        let mut buf = Vec::new();
        assert!(
            br.try_read_into_vec_now(&mut buf, 1 << 20).is_none(),
            "nothing was sent yet"
        );
        // Small frames, and every fifth one larger than an immediate read takes (it streams,
        // so it is written on another task), one at a time.
        let len = |i: u64| if i % 5 == 4 { 3 << 20 } else { (i as usize * 31) % 2000 };
        let (go, mut next) = tokio::sync::mpsc::channel::<u64>(1);
        let writer = tokio::spawn(async move {
            while let Some(i) = next.recv().await {
                aw.write(&[&i.to_le_bytes(), &pattern(i, len(i))]).await.expect("write");
            }
            aw
        });
        let mut taken = 0;
        for i in 0..40u64 {
            go.send(i).await.expect("writer gone");
            br.readable().await.expect("readable");
            let got = match br.try_read_into_vec_now(&mut buf, 4 << 20) {
                Some(r) => {
                    taken += 1;
                    r.expect("immediate read")
                }
                None => br.read_into_vec(&mut buf, 4 << 20).await.expect("read"),
            };
            assert_eq!(got, 8 + len(i), "frame {i}: length");
            assert_eq!(u64::from_le_bytes(buf[..8].try_into().unwrap()), i, "frame {i}: order");
            assert!(buf[8..got] == pattern(i, len(i))[..], "frame {i}: corrupted");
        }
        drop(go);
        let mut aw = writer.await.expect("writer");
        if B::IMMEDIATE {
            // Small frames are published whole: every one was taken at once; large ones never.
            assert_eq!(taken, 32, "{}: small frames taken at once", B::NAME);
        } else {
            assert_eq!(taken, 0, "{} has no immediate reads", B::NAME);
        }
        // Over the limit: refused, as a plain read refuses it (the connection is then unusable).
        aw.write(&[&pattern(1, 100)]).await.expect("write");
        if B::IMMEDIATE {
            let refused = br.try_read_into_vec_now(&mut buf, 99).expect("the frame is here");
            assert!(
                matches!(refused, Err(TransportError::FrameTooLarge { .. })),
                "expected FrameTooLarge, got {refused:?}"
            );
        }
    })
    .await
}

/// A 256 MiB frame arrives intact (it streams through rings smaller than itself).
pub async fn writes_of_256_mib<B: Backend>() {
    watchdog("256 MiB write", async {
        let (a, b) = pair::<B>().await;
        let (_ar, mut aw) = a.split();
        let (mut br, _bw) = b.split();
        const LEN: usize = 256 << 20;
        let data = pattern(42, LEN);
        let expected = checksum(&data);
        let send = tokio::spawn(async move {
            aw.write(&[&data]).await.expect("write 256 MiB");
            aw
        });
        let mut buf = vec![0u8; LEN];
        assert_eq!(br.read(&mut buf).await.expect("read 256 MiB"), LEN);
        assert_eq!(checksum(&buf), expected, "256 MiB frame corrupted");
        send.await.unwrap();
    })
    .await
}

fn checksum(data: &[u8]) -> u64 {
    data.chunks(8).fold(0u64, |acc, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        acc.rotate_left(5) ^ u64::from_le_bytes(w)
    })
}

/// 64+ connections open at once, each carrying its own traffic.
pub async fn many_connections<B: Backend>() {
    watchdog("many connections", async {
        let t = B::transport();
        let mut listener = t.listen("").await.expect("listen");
        let addr = listener.address();
        const COUNT: usize = 70;
        let mut clients = Vec::new();
        let mut servers = Vec::new();
        for _ in 0..COUNT {
            let (c, s) = tokio::join!(t.connect(&addr), listener.accept());
            clients.push(c.expect("connect"));
            servers.push(s.expect("accept"));
        }
        let mut tasks = Vec::new();
        for (i, (c, s)) in clients.into_iter().zip(servers).enumerate() {
            tasks.push(tokio::spawn(async move {
                let (mut cr, mut cw) = c.split();
                let (mut sr, mut sw) = s.split();
                let mut buf = [0u8; 64];
                for round in 0..10u8 {
                    let msg = [i as u8, round];
                    cw.write(&[&msg]).await.unwrap();
                    let n = sr.read(&mut buf).await.unwrap();
                    assert_eq!(&buf[..n], &msg);
                    sw.write(&[&buf[..n]]).await.unwrap();
                    let n = cr.read(&mut buf).await.unwrap();
                    assert_eq!(&buf[..n], &msg);
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await
}

/// Closing a connection fails its pending read and its pending (blocked) write promptly, and
/// the peer learns the connection is gone.
pub async fn close_with_operations_pending<B: Backend>() {
    watchdog("close with pending operations", async {
        // A read waiting for data that will never come.
        let (a, b) = pair::<B>().await;
        let (mut ar, aw) = a.split();
        let pending = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            ar.read(&mut buf).await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        aw.close();
        let err = pending.await.unwrap().expect_err("read must fail after close");
        assert!(matches!(err, TransportError::Closed { .. }), "got {err:?}");
        // Later operations fail with the same sticky error.
        let mut aw = aw;
        let err = aw.write(&[b"late"]).await.expect_err("write after close");
        assert!(matches!(err, TransportError::Closed { .. }), "got {err:?}");
        let (mut br, _bw) = b.split();
        let err = br.read_vec(1024).await.expect_err("peer sees the close");
        assert!(err.is_peer_lost(), "got {err:?}");

        // A write blocked because the peer does not read.
        let (a, b) = pair::<B>().await;
        let (ar, mut aw) = a.split();
        let big = vec![7u8; 64 << 20];
        let pending = tokio::spawn(async move { aw.write(&[&big]).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        ar.close();
        let err = pending.await.unwrap().expect_err("blocked write must fail after close");
        assert!(matches!(err, TransportError::Closed { .. }), "got {err:?}");
        drop(b);
    })
    .await
}

/// A frame longer than the caller's buffer (or limit) is refused without allocating it.
pub async fn oversized_frames_are_refused<B: Backend>() {
    watchdog("oversized frames", async {
        let (a, b) = pair::<B>().await;
        let (_ar, mut aw) = a.split();
        let (mut br, _bw) = b.split();
        aw.write(&[&[1u8; 100]]).await.unwrap();
        let err = br.read_vec(10).await.expect_err("limit");
        assert!(
            matches!(
                err,
                TransportError::FrameTooLarge {
                    len: 100,
                    limit: 10,
                    ..
                }
            ),
            "got {err:?}"
        );
        let (a, b) = pair::<B>().await;
        let (_ar, mut aw) = a.split();
        let (mut br, _bw) = b.split();
        aw.write(&[&[1u8; 100]]).await.unwrap();
        let err = br.read(&mut [0u8; 99]).await.expect_err("buffer too small");
        assert!(
            matches!(
                err,
                TransportError::FrameTooLarge {
                    len: 100,
                    limit: 99,
                    ..
                }
            ),
            "got {err:?}"
        );
    })
    .await
}

/// Cancelling a read mid-frame makes the connection report itself poisoned, not misaligned.
pub async fn cancelled_operation_poisons<B: Backend>() {
    watchdog("cancelled operation", async {
        let (a, b) = pair::<B>().await;
        let (mut ar, _aw) = a.split();
        let (_br, bw) = b.split();
        let mut buf = [0u8; 8];
        assert!(tokio::time::timeout(Duration::from_millis(20), ar.read(&mut buf))
            .await
            .is_err());
        let err = ar.read(&mut buf).await.expect_err("poisoned");
        assert!(
            matches!(err, TransportError::Poisoned { op: "read", .. }),
            "got {err:?}"
        );
        drop(bw);
    })
    .await
}

/// Waiting for the next frame can be given up between frames, any number of times, without
/// harming the connection (the read-role hand-off relies on it); `readable` reports a frame that
/// has begun to arrive, consumes nothing, and fails once no frame can arrive.
pub async fn readable_is_cancel_safe_between_frames<B: Backend>() {
    watchdog("readable is cancel-safe", async {
        let (a, b) = pair::<B>().await;
        let (mut ar, _aw) = a.split();
        let (_br, mut bw) = b.split();
        for _ in 0..5 {
            assert!(
                tokio::time::timeout(Duration::from_millis(5), ar.readable())
                    .await
                    .is_err(),
                "nothing was written, so nothing is readable"
            );
        }
        bw.write(&[b"first"]).await.expect("write");
        bw.write(&[b"second", b"!"]).await.expect("write");
        ar.readable().await.expect("a frame has arrived");
        // Asking again consumes nothing.
        ar.readable().await.expect("still readable");
        let mut buf = [0u8; 64];
        let n = ar.read(&mut buf).await.expect("read after readable");
        assert_eq!(&buf[..n], b"first");
        ar.readable().await.expect("the second frame is there");
        assert_eq!(ar.read_vec(64).await.expect("second"), b"second!");
        for _ in 0..3 {
            assert!(tokio::time::timeout(Duration::from_millis(5), ar.readable())
                .await
                .is_err());
        }
        // A reader that gave up is replaced by one that waits: the frame arrives intact.
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            bw.write(&[&[9u8; 3000]]).await.expect("write");
            bw
        });
        ar.readable().await.expect("readable once written");
        assert_eq!(ar.read_vec(4096).await.expect("third"), vec![9u8; 3000]);
        drop(writer.await.expect("writer"));
        drop(_br);
        // The peer is gone and nothing is left: readable fails, and so does a read.
        let err = ar.readable().await.expect_err("no frame can arrive");
        assert!(
            err.is_peer_lost() || matches!(err, TransportError::Closed { .. }),
            "got {err:?}"
        );
        assert!(ar.read(&mut buf).await.is_err());
    })
    .await
}

/// The peer process is killed with SIGKILL while streaming to us: our pending read fails with a
/// peer-lost error. Then the reverse: killed while we stream to it, our blocked write fails.
pub async fn peer_killed_mid_transfer<B: Backend>(peer_exe: &str) {
    watchdog("peer killed mid-transfer", async {
        let t = B::transport();
        // The peer streams to us.
        let mut listener = t.listen("").await.expect("listen");
        let mut peer = PeerProcess::spawn(peer_exe, &["transport", B::NAME, &listener.address(), "stream"]);
        let conn = listener.accept().await.expect("accept peer");
        let (mut r, _w) = conn.split();
        let mut buf = vec![0u8; 2 << 20];
        for _ in 0..3 {
            r.read(&mut buf).await.expect("peer frames");
        }
        peer.kill();
        let err = loop {
            // Frames already in flight may still arrive; then the loss must surface.
            match r.read(&mut buf).await {
                Ok(_) => continue,
                Err(e) => break e,
            }
        };
        assert!(err.is_peer_lost(), "expected peer lost, got {err:?}");

        // We stream to a peer that stops reading, then dies.
        let mut peer = PeerProcess::spawn(peer_exe, &["transport", B::NAME, &listener.address(), "stall"]);
        let conn = listener.accept().await.expect("accept peer");
        let (_r, mut w) = conn.split();
        let big = vec![3u8; 256 << 20];
        let pending = tokio::spawn(async move { w.write(&[&big]).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !pending.is_finished(),
            "a 256 MiB write to a stalled reader cannot have completed"
        );
        peer.kill();
        let err = pending.await.unwrap().expect_err("write to a dead peer");
        assert!(err.is_peer_lost(), "expected peer lost, got {err:?}");
    })
    .await
}

/// Instantiates the suite for one backend: `transport_conformance!(module, Backend, peer_exe)`
/// runs every test, the peer-process ones included; `transport_conformance!(module, Backend)`
/// leaves out the tests that need a second process (for the in-process verbs model).
#[macro_export]
macro_rules! transport_conformance {
    ($module:ident, $backend:ty, $peer:expr) => {
        $crate::transport_conformance!(@tests $module, $backend, {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn peer_killed_mid_transfer() {
                if !suite::skip::<$backend>("peer_killed_mid_transfer") {
                    suite::peer_killed_mid_transfer::<$backend>($peer).await
                }
            }
        });
    };
    ($module:ident, $backend:ty) => {
        $crate::transport_conformance!(@tests $module, $backend, {});
    };
    (@tests $module:ident, $backend:ty, { $($extra:tt)* }) => {
        mod $module {
            use super::*;
            use $crate::conformance::transport as suite;

            $crate::transport_conformance!(@each $backend;
                context_basics,
                ordering_of_interleaved_writes,
                zero_and_one_byte_writes,
                deferred_writes_keep_order_and_flush,
                immediate_writes_keep_order_or_decline,
                immediate_reads_take_whole_frames_or_nothing,
                writes_of_256_mib,
                many_connections,
                close_with_operations_pending,
                oversized_frames_are_refused,
                cancelled_operation_poisons,
                readable_is_cancel_safe_between_frames
            );
            $($extra)*
        }
    };
    (@each $backend:ty; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if !suite::skip::<$backend>(stringify!($name)) {
                    suite::$name::<$backend>().await
                }
            }
        )*
    };
}
