//! The channel conformance suite: what every channel must do, written once and instantiated per
//! channel by [`channel_conformance!`](crate::channel_conformance)
//! (`tests/tests/channel_conformance.rs`).
//!
//! Each test opens pipes whose negotiation can only pick the backend's channel for its device
//! pair, checks that it did, and then asserts behaviour: every size intact in both directions
//! at once (zero bytes and the channel's own thresholds included), many tensors in one message,
//! concurrent writers each kept in order, a wrong allocation refused without breaking the pipe,
//! a closed pipe failing every pending and later operation with one error, and a real peer
//! process that echoes and is then killed. A backend that cannot run here (no GPU, no RDMA
//! device, one GPU where two are needed) prints `SKIPPED` with the reason; under
//! `SLUICE_REQUIRE_GPU=1` (the GPU machine) a missing GPU is a failure instead.

use std::collections::HashMap;
use std::time::Duration;

use sluice_channel::cuda::Stream;
use sluice_channel::{Allocation, ChannelKind, Context, ContextOptions, Device, Pipe, PipeError};

use crate::gpu::{self, check_received, message, receive_and_check, Route};
use crate::{pipe_pair, PeerProcess};

/// One channel under test.
pub trait Backend {
    /// Test module name, for messages.
    const NAME: &'static str;
    const CHANNEL: ChannelKind;
    /// The device pair it is tested on: (this side's device, the peer's).
    const ROUTE: (Device, Device);

    /// Options under which negotiation can only pick [`Self::CHANNEL`] for the route.
    fn options() -> ContextOptions;

    /// Why the channel cannot run here beyond a missing GPU (checked first), if it cannot.
    fn unavailable() -> Option<String> {
        None
    }

    /// Sizes around the channel's own thresholds, added to the common ones.
    fn edge_sizes() -> Vec<usize> {
        Vec::new()
    }

    /// Why a second process cannot take part (the verbs model lives in one process), if it
    /// cannot. The test peer is started with the channels and transports of
    /// [`Self::options`] and its segment size.
    fn no_peer_process() -> Option<String> {
        None
    }
}

/// Sizes every channel carries in the suite: nothing, one byte, both sides of a page and of
/// 64 KiB, and a few MiB.
const SIZES: [usize; 8] = [0, 1, 4095, 4096, 65535, 65536, (1 << 20) + 3, 5 << 20];

/// Messages each way in the size test.
const COUNT: u64 = 6;

fn uses_gpu<B: Backend>() -> bool {
    matches!(B::ROUTE.0, Device::Cuda(_)) || matches!(B::ROUTE.1, Device::Cuda(_))
}

/// Whether `test` should be skipped for `B` (printing why).
pub fn skip<B: Backend>(test: &str) -> bool {
    let name = format!("{}::{test}", B::NAME);
    if uses_gpu::<B>() && !gpu::gpu_or_skip(&name) {
        return true;
    }
    if let Some(why) = B::unavailable() {
        gpu::skipped(&name, why);
        return true;
    }
    false
}

fn stream(device: u32) -> Stream {
    Stream::new(device).expect("stream")
}

fn routes<B: Backend>() -> Vec<Route> {
    let (from, to) = B::ROUTE;
    SIZES
        .into_iter()
        .chain(B::edge_sizes())
        .map(|len| Route { from, to, len })
        .collect()
}

fn mirror(routes: &[Route]) -> Vec<Route> {
    routes
        .iter()
        .map(|r| Route {
            from: r.to,
            to: r.from,
            len: r.len,
        })
        .collect()
}

/// A pipe pair over which the backend's channel connects the route both ways.
async fn pair<B: Backend>() -> (Pipe, Pipe) {
    let (a, b) = pipe_pair(B::options()).await;
    let (here, there) = B::ROUTE;
    assert_eq!(
        a.info().channel(here, there),
        Some(B::CHANNEL),
        "{:?}",
        a.info().channels
    );
    assert_eq!(
        b.info().channel(there, here),
        Some(B::CHANNEL),
        "{:?}",
        b.info().channels
    );
    (a, b)
}

/// Every size, both directions at once, in order and intact.
pub async fn every_size_intact_both_ways<B: Backend>() {
    let (a, b) = pair::<B>().await;
    gpu::exercise(a, b, routes::<B>(), COUNT).await;
}

/// Forty tensors of mixed sizes in one message, each intact and in its place.
pub async fn many_tensors_in_one_message<B: Backend>() {
    let (a, b) = pair::<B>().await;
    let (from, to) = B::ROUTE;
    let routes: Vec<Route> = (0..40)
        .map(|i| Route {
            from,
            to,
            len: [0, 7, 4096, 70_000, 300_000][i % 5] + i,
        })
        .collect();
    for seq in 0..3 {
        let m = message(seq, &routes, &stream);
        let (w, got) = tokio::join!(a.write(&m), receive_and_check(&b, &routes, &stream));
        w.expect("write");
        assert_eq!(got, seq);
    }
}

/// Four tasks write on one pipe at once; the reader sees each task's messages in its order.
pub async fn concurrent_writers_keep_their_order<B: Backend>() {
    const WRITERS: u64 = 4;
    const EACH: u64 = 15;
    let (a, b) = pair::<B>().await;
    let (from, to) = B::ROUTE;
    let routes: Vec<Route> = [3usize, 5000, 200_000]
        .into_iter()
        .map(|len| Route { from, to, len })
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (a, routes) = (a.clone(), routes.clone());
            tokio::spawn(async move {
                for i in 0..EACH {
                    a.write(&message(w * 1000 + i, &routes, &stream)).await.expect("write");
                }
            })
        })
        .collect();
    let mut next: HashMap<u64, u64> = HashMap::new();
    for _ in 0..WRITERS * EACH {
        let seq = receive_and_check(&b, &routes, &stream).await;
        let (w, i) = (seq / 1000, seq % 1000);
        let expected = next.entry(w).or_insert(0);
        assert_eq!(i, *expected, "writer {w}'s messages out of order");
        *expected += 1;
    }
    for w in writers {
        w.await.expect("writer");
    }
}

/// A read with the wrong allocation is the caller's mistake: refused with the allocation
/// handed back, and the same message is then read whole.
pub async fn wrong_allocation_is_refused_and_the_pipe_goes_on<B: Backend>() {
    let (a, b) = pair::<B>().await;
    let (from, to) = B::ROUTE;
    let routes = vec![Route { from, to, len: 100_000 }, Route { from, to, len: 10 }];
    for seq in 0..2 {
        let m = message(seq, &routes, &stream);
        let write = tokio::spawn({
            let a = a.clone();
            async move { a.write(&m).await }
        });
        let d = b.read_descriptor().await.expect("descriptor");
        let mut short = Allocation::try_for_descriptor(&d, |i| Ok(stream(i))).expect("allocation");
        short.tensors.pop();
        let refused = b.read(short).await.expect_err("an allocation missing a tensor");
        assert!(matches!(refused.error, PipeError::Misuse(_)), "{:?}", refused.error);
        assert_eq!(refused.allocation.tensors.len(), 1, "the allocation comes back");
        assert!(b.error().is_none(), "misuse must not break the pipe");
        let alloc = Allocation::try_for_descriptor(&d, |i| Ok(stream(i))).expect("allocation");
        let got = b.read(alloc).await.expect("read after the refusal");
        check_received(seq, &routes, &got);
        write.await.expect("writer task").expect("write");
    }
}

/// Closing one end fails the other's pending read and every later operation on both ends,
/// each with the pipe's first error (never a hang, never misuse).
pub async fn close_fails_pending_and_later_operations<B: Backend>() {
    let (a, b) = pair::<B>().await;
    let (from, to) = B::ROUTE;
    let routes = vec![Route { from, to, len: 70_000 }];
    let m = message(0, &routes, &stream);
    let back = mirror(&routes);
    let first = message(0, &back, &stream);
    let (w, got) = tokio::join!(b.write(&first), receive_and_check(&a, &back, &stream));
    w.expect("write before the close");
    assert_eq!(got, 0);
    let pending = tokio::spawn({
        let a = a.clone();
        async move { a.read_descriptor().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    b.close();
    let first = pending.await.expect("reader task").expect_err("read on a closed pipe");
    assert!(!matches!(first, PipeError::Misuse(_)), "{first:?}");
    let later = a.write(&m).await.expect_err("write after the pipe failed");
    assert_eq!(later.to_string(), first.to_string(), "the first error is sticky");
    assert_eq!(a.error().map(|e| e.to_string()), Some(first.to_string()));
    let closed = b.write(&m).await.expect_err("write on the closed end");
    assert!(matches!(closed, PipeError::Closed { .. }), "{closed:?}");
}

/// A real second process echoes every message back (the channel both ways across processes),
/// then is killed while this side waits: the wait fails promptly with a peer-lost error.
pub async fn peer_process_echoes_then_dies<B: Backend>(peer_exe: &str) {
    if let Some(why) = B::no_peer_process() {
        gpu::skipped(&format!("{}::peer_process_echoes_then_dies", B::NAME), why);
        return;
    }
    let opts = B::options();
    let list = |names: Vec<&str>| names.join(",");
    let channels = list(opts.channels.iter().map(|c| c.name()).collect());
    let transports = list(opts.transports.iter().map(|t| t.name()).collect());
    let segment = opts.segment_bytes.to_string();
    let ctx = Context::new(opts).expect("context");
    let mut listener = ctx.listen("").await.expect("listen");
    let mut peer = PeerProcess::spawn(
        peer_exe,
        &["pipe-echo-cuda", listener.address(), &channels, &transports, &segment],
    );
    let pipe = listener.accept().await.expect("the peer's pipe");
    let (here, there) = B::ROUTE;
    assert_eq!(
        pipe.info().channel(here, there),
        Some(B::CHANNEL),
        "{:?}",
        pipe.info().channels
    );
    let routes = routes::<B>();
    let back = mirror(&routes);
    let writer = tokio::spawn({
        let (pipe, routes) = (pipe.clone(), routes.clone());
        async move {
            for seq in 0..COUNT {
                pipe.write(&message(seq, &routes, &stream)).await.expect("write");
            }
        }
    });
    for seq in 0..COUNT {
        assert_eq!(receive_and_check(&pipe, &back, &stream).await, seq);
    }
    writer.await.expect("writer");
    let pending = tokio::spawn({
        let pipe = pipe.clone();
        async move { pipe.read_descriptor().await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    peer.kill();
    let err = pending.await.expect("reader task").expect_err("peer killed");
    assert!(err.is_peer_lost(), "{err:?}");
}

/// Instantiates the suite for one backend: `channel_conformance!(module, Backend, peer_exe)`.
#[macro_export]
macro_rules! channel_conformance {
    ($module:ident, $backend:ty, $peer:expr) => {
        mod $module {
            use super::*;
            use $crate::conformance::channel as suite;

            $crate::channel_conformance!(@each $backend;
                every_size_intact_both_ways,
                many_tensors_in_one_message,
                concurrent_writers_keep_their_order,
                wrong_allocation_is_refused_and_the_pipe_goes_on,
                close_fails_pending_and_later_operations
            );

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn peer_process_echoes_then_dies() {
                if !suite::skip::<$backend>("peer_process_echoes_then_dies") {
                    $crate::watchdog(
                        concat!(stringify!($module), "::peer_process_echoes_then_dies"),
                        suite::peer_process_echoes_then_dies::<$backend>(&$peer),
                    )
                    .await
                }
            }
        }
    };
    (@each $backend:ty; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                if !suite::skip::<$backend>(stringify!($name)) {
                    $crate::watchdog(stringify!($name), suite::$name::<$backend>()).await
                }
            }
        )*
    };
}
