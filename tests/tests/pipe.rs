//! The pipe, end to end: negotiation outcomes, every channel over every transport, ordering,
//! misuse, sticky errors, a real peer process (killed mid-stream), and hostile input on the
//! listener.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use sluice_channel::channel::rdma;
use sluice_channel::{
    Allocation, ChannelKind, Context, ContextOptions, Message, Pipe, PipeError, RecvBuffer, Tensor, TransportKind,
};
use sluice_tests::{pattern, watchdog, PeerProcess};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn peer() -> String {
    sluice_tests::peer_exe(env!("CARGO_BIN_EXE_sluice-test-peer"))
}

fn options(transports: &[TransportKind], channels: &[ChannelKind]) -> ContextOptions {
    sluice_tests::offering(transports, channels)
}

async fn pair_with(opts: ContextOptions) -> (Pipe, Pipe) {
    sluice_tests::pipe_pair(opts).await
}

fn message(seq: u64, sizes: &[usize]) -> Message {
    Message {
        metadata: Bytes::from(format!("message {seq}")),
        payloads: vec![Bytes::from(pattern(seq, 10)), Bytes::new()],
        tensors: sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Tensor::cpu(pattern(seq * 31 + i as u64, n)))
            .collect(),
    }
}

async fn receive(pipe: &Pipe) -> Allocation {
    let d = pipe.read_descriptor().await.expect("descriptor");
    pipe.read(Allocation::for_descriptor(&d)).await.expect("read")
}

fn check(seq: u64, sizes: &[usize], got: &Allocation) {
    assert_eq!(&got.payloads[0][..], &pattern(seq, 10)[..]);
    assert!(got.payloads[1].is_empty());
    for (i, &n) in sizes.iter().enumerate() {
        let t = got.tensors[i].as_cpu().unwrap();
        assert_eq!(t.len(), n);
        assert!(
            t[..] == pattern(seq * 31 + i as u64, n)[..],
            "message {seq} tensor {i} corrupted"
        );
    }
}

/// Both directions at once, many messages, mixed sizes: intact and in order.
async fn exercise(a: Pipe, b: Pipe) {
    exercise_with(a, b, 40, |_| vec![0usize, 1, 4099, (1 << 20) + 3, 3 << 20]).await
}

/// [`exercise`] with the tensor sizes of message `i` given by `sizes(i)`.
async fn exercise_with(a: Pipe, b: Pipe, n: u64, sizes: fn(u64) -> Vec<usize>) {
    let send = move |p: Pipe| async move {
        for i in 0..n {
            p.write(&message(i, &sizes(i))).await.expect("write");
        }
    };
    let recv = move |p: Pipe| async move {
        for i in 0..n {
            let got = receive(&p).await;
            check(i, &sizes(i), &got);
        }
    };
    let t = [
        tokio::spawn(send(a.clone())),
        tokio::spawn(send(b.clone())),
        tokio::spawn(recv(a)),
        tokio::spawn(recv(b)),
    ];
    for t in t {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_negotiation_picks_shm_and_cma_on_one_host() {
    watchdog("default pipe", async {
        let (a, b) = pair_with(ContextOptions::default()).await;
        for p in [&a, &b] {
            assert_eq!(p.info().transport, "shm");
            assert_eq!(p.info().cpu_channel, ChannelKind::Cma);
        }
        exercise(a, b).await;
    })
    .await
}

macro_rules! channel_over_transport {
    ($name:ident, $transport:expr, $channel:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            watchdog(stringify!($name), async {
                let (a, b) = pair_with(options(&[$transport], &[$channel])).await;
                assert_eq!(a.info().transport, $transport.name());
                assert_eq!(a.info().cpu_channel, $channel);
                assert_eq!(b.info().cpu_channel, $channel);
                exercise(a, b).await;
            })
            .await
        }
    };
}

/// Small messages travel as one frame (descriptor, payloads and inline tensors packed
/// together), larger ones as a frame each: messages on both sides of that boundary, and small
/// ones mixed with tensors that go another way (a cma segment, multilane's lanes), arrive intact
/// and in order on every channel and transport.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_and_unpacked_messages_interleave_intact() {
    use sluice_channel::wire::PACK_MAX;
    // Every message has a 10-byte and an empty payload (see `message`).
    fn sizes(i: u64) -> Vec<usize> {
        match i % 7 {
            0 => vec![PACK_MAX - 10],
            1 => vec![PACK_MAX - 9],
            2 => vec![],
            3 => vec![1, 0, 64, 4000],
            4 => vec![64, 5000, 3, 300 << 10],
            5 => vec![(PACK_MAX - 10) / 2, (PACK_MAX - 10) / 2 + 1],
            _ => vec![8; 40],
        }
    }
    watchdog("packing boundary", async {
        for (transport, channel) in [
            (TransportKind::Shm, ChannelKind::Basic),
            (TransportKind::Tcp, ChannelKind::Basic),
            (TransportKind::Shm, ChannelKind::Cma),
            (TransportKind::Tcp, ChannelKind::MultiLane),
        ] {
            let (a, b) = pair_with(options(&[transport], &[channel])).await;
            exercise_with(a, b, 70, sizes).await;
        }
    })
    .await
}

channel_over_transport!(basic_over_tcp, TransportKind::Tcp, ChannelKind::Basic);
channel_over_transport!(basic_over_shm, TransportKind::Shm, ChannelKind::Basic);
channel_over_transport!(cma_over_tcp, TransportKind::Tcp, ChannelKind::Cma);
channel_over_transport!(cma_over_shm, TransportKind::Shm, ChannelKind::Cma);
channel_over_transport!(multilane_over_tcp, TransportKind::Tcp, ChannelKind::MultiLane);
channel_over_transport!(multilane_over_shm, TransportKind::Shm, ChannelKind::MultiLane);

fn ibv_model(channels: &[ChannelKind]) -> ContextOptions {
    ContextOptions {
        ibv: sluice_transport::ibv::IbvOptions {
            device: sluice_transport::ibv::DeviceChoice::Model,
            ..Default::default()
        },
        ..options(&[TransportKind::Ibv], channels)
    }
}

/// The ibverbs transport (on the verbs model) carries pipes; rdma moves CPU tensors by one-sided
/// reads (small ones through the ring), basic through the ring.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_and_basic_over_ibv_model() {
    watchdog("ibv pipes", async {
        for channel in [ChannelKind::Rdma, ChannelKind::Basic] {
            let (a, b) = pair_with(ibv_model(&[channel])).await;
            assert_eq!(a.info().transport, "ibv");
            assert_eq!((a.info().cpu_channel, b.info().cpu_channel), (channel, channel));
            exercise(a, b).await;
        }
        // Sizes around the inline bound, and one tensor read in several pieces.
        let (a, b) = pair_with(ibv_model(&[ChannelKind::Rdma])).await;
        let sizes = [rdma::INLINE_MAX - 1, rdma::INLINE_MAX, rdma::MAX_READ * 2 + 5];
        let m = message(7, &sizes);
        let (w, r) = tokio::join!(a.write(&m), receive(&b));
        w.unwrap();
        check(7, &sizes, &r);
        drop((a, b));
        let v = sluice_transport::ibv::model::ModelFabric::global().violations();
        assert!(v.is_empty(), "verbs rules broken: {v:?}");
    })
    .await
}

/// rdma lands received CPU tensors in the pipe's registered receive pool instead of registering
/// the reader's buffer for every read: each arrives lent (`RecvBuffer::Shared`, no buffer
/// supplied), and once dropped its chunk, still registered, serves the next tensor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_reads_land_in_a_recycled_registered_pool() {
    watchdog("rdma receive pool", async {
        let (a, b) = pair_with(ibv_model(&[ChannelKind::Rdma])).await;
        let mut addresses = std::collections::HashSet::new();
        for round in 0..20u8 {
            let m = Message {
                tensors: vec![Tensor::cpu(vec![round; 1 << 20])],
                ..Message::default()
            };
            let read = async {
                let d = b.read_descriptor().await.unwrap();
                assert!(d.tensors[0].arrives_shared, "an rdma tensor lands in the receive pool");
                assert_eq!(d.tensors[0].buffer_len(), 0);
                b.read(Allocation::for_descriptor(&d)).await.unwrap()
            };
            let (w, r) = tokio::join!(a.write(&m), read);
            w.unwrap();
            let t = &r.tensors[0];
            assert!(matches!(t, RecvBuffer::Shared(_)), "not lent from the pool");
            let bytes = t.as_cpu().unwrap();
            assert_eq!(bytes.len(), 1 << 20);
            assert!(bytes.iter().all(|&x| x == round));
            addresses.insert(bytes.as_ptr() as usize);
        }
        // Each tensor was dropped before the next arrived: one chunk served them all.
        assert_eq!(addresses.len(), 1, "chunks: {addresses:x?}");
        // A buffer of the wrong length is refused (not filled short), and the message can then
        // be read properly.
        let m = Message {
            tensors: vec![Tensor::cpu(vec![7u8; 1 << 20])],
            ..Message::default()
        };
        let read = async {
            let d = b.read_descriptor().await.unwrap();
            let short = Allocation {
                payloads: Vec::new(),
                tensors: vec![RecvBuffer::cpu(1000)],
            };
            let e = b.read(short).await.unwrap_err();
            assert!(matches!(e.error, PipeError::Misuse(_)), "{}", e.error);
            b.read(Allocation::for_descriptor(&d)).await.unwrap()
        };
        let (w, r) = tokio::join!(a.write(&m), read);
        w.unwrap();
        assert!(r.tensors[0].as_cpu().unwrap().iter().all(|&x| x == 7));
        let v = sluice_transport::ibv::model::ModelFabric::global().violations();
        assert!(v.is_empty(), "verbs rules broken: {v:?}");
    })
    .await
}

/// A tensor in read-only memory (a static) goes by rdma: its registration asks for remote reads
/// only, as hardware requires (write rights on read-only pages fail with EFAULT; the model
/// refuses them the same way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_sends_a_tensor_from_read_only_memory() {
    static READ_ONLY: [u8; 256 << 10] = [0x5a; 256 << 10];
    watchdog("rdma from read-only memory", async {
        let (a, b) = pair_with(ibv_model(&[ChannelKind::Rdma])).await;
        let m = Message {
            tensors: vec![Tensor::cpu(Bytes::from_static(&READ_ONLY))],
            ..Message::default()
        };
        let (w, r) = tokio::join!(a.write(&m), receive(&b));
        w.expect("a write from read-only memory");
        assert!(r.tensors[0].as_cpu().unwrap().iter().all(|&x| x == 0x5a));
    })
    .await
}

/// Pipes opened back to back over ibverbs, each while the previous pair's connections may still
/// be closing. Every pair ends with one side closing while the other is still reading: the
/// reader gets everything (the closing side's socket hang-up can overtake its last completions,
/// and an acknowledgement can race its teardown; neither may fail the reader).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipes_opened_while_others_close_on_ibv() {
    watchdog("ibv pipes back to back", async {
        for _ in 0..4 {
            for channel in [ChannelKind::Rdma, ChannelKind::Basic] {
                let (a, b) = pair_with(ibv_model(&[channel])).await;
                exercise(a, b).await;
            }
        }
    })
    .await
}

/// rdma borrows the ibverbs control connection: where another transport wins (shm on one host),
/// rdma is not chosen even though both sides offer it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_needs_the_ibv_transport() {
    watchdog("rdma needs ibv", async {
        let opts = ContextOptions {
            transports: vec![TransportKind::Shm, TransportKind::Ibv, TransportKind::Tcp],
            ..ibv_model(&ChannelKind::ALL)
        };
        let server = Context::new(opts.clone()).unwrap();
        assert!(server.transports().contains(&TransportKind::Ibv));
        assert!(server.channels().contains(&ChannelKind::Rdma));
        let (a, b) = pair_with(opts).await;
        assert_eq!(a.info().transport, "shm");
        assert_eq!(a.info().cpu_channel, ChannelKind::Cma);
        exercise(a, b).await;
        // Without the model (no rdma feature or no device here) neither is offered.
        let plain = Context::new(ContextOptions::default()).unwrap();
        if !cfg!(feature = "rdma") {
            assert!(!plain.transports().contains(&TransportKind::Ibv));
            assert!(!plain.channels().contains(&ChannelKind::Rdma));
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_common_channel_is_a_clear_error_on_both_sides() {
    watchdog("no common channel", async {
        let server = Context::new(options(&[TransportKind::Tcp], &[ChannelKind::Basic])).unwrap();
        let client = Context::new(options(&[TransportKind::Tcp], &[ChannelKind::MultiLane])).unwrap();
        let mut listener = server.listen("").await.unwrap();
        let addr = listener.address().to_owned();
        let (c, s) = tokio::join!(client.connect(&addr), listener.accept());
        assert!(
            matches!(c, Err(PipeError::Rejected { ref reason, .. }) if reason.contains("channel")),
            "{c:?}"
        );
        assert!(matches!(s, Err(PipeError::Negotiation { .. })), "{s:?}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_common_transport_is_a_clear_error() {
    watchdog("no common transport", async {
        let server = Context::new(options(&[TransportKind::Shm], &[ChannelKind::Basic])).unwrap();
        let client = Context::new(options(&[TransportKind::Tcp], &[ChannelKind::Basic])).unwrap();
        let mut listener = server.listen("").await.unwrap();
        let addr = listener.address().to_owned();
        let (c, s) = tokio::join!(client.connect(&addr), listener.accept());
        assert!(
            matches!(c, Err(PipeError::Rejected { ref reason, .. }) if reason.contains("transport")),
            "{c:?}"
        );
        assert!(s.is_err());
    })
    .await
}

/// A batch holds messages (from any writer) until it ends, then they all arrive in order,
/// over each transport and with every CPU channel: messages that need the peer (CMA reads,
/// multi-lane tensors) are never held, so they cannot wedge a batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_writes_arrive_in_order_once_the_batch_ends() {
    watchdog("batched writes", async {
        for (transport, channel) in [
            (TransportKind::Shm, ChannelKind::Cma),
            (TransportKind::Tcp, ChannelKind::Basic),
            (TransportKind::Tcp, ChannelKind::MultiLane),
        ] {
            let (a, b) = pair_with(options(&[transport], &[channel])).await;
            let sizes = [0usize, 64, 70_000, 3 << 20];
            a.set_batching(true).await.expect("batch");
            assert!(a.is_batching());
            for i in 0..6 {
                a.write(&message(i, &sizes[..(i as usize % 4) + 1]))
                    .await
                    .expect("write");
            }
            // A writer on another task joins the batch.
            let other = a.clone();
            tokio::spawn(async move { other.write(&message(6, &sizes[..1])).await })
                .await
                .unwrap()
                .expect("write from another task");
            a.set_batching(false).await.expect("end of batch");
            assert!(!a.is_batching());
            for i in 0..7 {
                let shape = if i == 6 {
                    &sizes[..1]
                } else {
                    &sizes[..(i as usize % 4) + 1]
                };
                let got = receive(&b).await;
                check(i, shape, &got);
            }
            // Nothing left behind, and plain writes flow again.
            assert!(!b.has_input());
            a.write(&message(7, &sizes[..2])).await.expect("write after the batch");
            check(7, &sizes[..2], &receive(&b).await);
        }
    })
    .await
}

/// `try_write` sends a small message at once or declines without sending anything: it keeps
/// the pipe's order among `write`s, never overtakes a write that holds or waits for the write
/// side, and holds back while the pipe batches. Shared memory takes it whenever there is room;
/// TCP always declines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_writes_keep_order_and_never_overtake() {
    watchdog("immediate writes", async {
        for (transport, immediate) in [(TransportKind::Shm, true), (TransportKind::Tcp, false)] {
            let (a, b) = pair_with(options(&[transport], &[ChannelKind::Basic])).await;
            assert!(
                a.try_write(&message(0, &[64 << 10])).is_none(),
                "a message larger than one packed frame is declined"
            );
            let mut taken = 0;
            for i in 0..60u64 {
                // Small tensors travel inline in the frame: taken too; large ones are not.
                let sizes: &[usize] = [&[64][..], &[], &[64 << 10]][(i % 3) as usize];
                let m = message(i, sizes);
                match a.try_write(&m) {
                    Some(r) => {
                        r.expect("immediate write");
                        taken += 1;
                    }
                    None => a.write(&m).await.expect("write"),
                }
            }
            assert_eq!(taken > 0, immediate, "{transport:?}: immediate writes taken: {taken}");
            for i in 0..60u64 {
                let sizes: &[usize] = [&[64][..], &[], &[64 << 10]][(i % 3) as usize];
                check(i, sizes, &receive(&b).await);
            }
            if !immediate {
                continue;
            }
            // While the pipe batches, an immediate write stays in the transport until the batch ends.
            a.set_batching(true).await.expect("batch");
            a.try_write(&message(60, &[]))
                .expect("room")
                .expect("immediate write in a batch");
            tokio::time::sleep(Duration::from_millis(20)).await;
            assert!(
                !b.has_input(),
                "a batched immediate write was sent before the batch ended"
            );
            a.set_batching(false).await.expect("end of batch");
            check(60, &[], &receive(&b).await);
            // A write that waits for the reader (8 MiB through a 2 MiB ring) holds the write
            // side: an immediate write declines rather than overtake it.
            let big = a.clone();
            // Built before the task starts, so the task is writing (not still filling 8 MiB, as
            // an unoptimised build can take longer than the sleep below to do) when it is checked.
            let big_message = message(61, &[8 << 20]);
            let writer = tokio::spawn(async move { big.write(&big_message).await });
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!writer.is_finished(), "the 8 MiB write should wait for the reader");
            assert!(
                a.try_write(&message(62, &[])).is_none(),
                "an immediate write overtook a waiting write"
            );
            check(61, &[8 << 20], &receive(&b).await);
            writer.await.unwrap().expect("8 MiB write");
            a.try_write(&message(62, &[]))
                .expect("room again")
                .expect("immediate write");
            check(62, &[], &receive(&b).await);
            // A closed pipe sends nothing, and says so.
            a.close();
            assert!(matches!(a.try_write(&message(63, &[])), Some(Err(_)) | None));
        }
    })
    .await
}

/// `try_read_message` takes a message at once only when it is here whole with its contents in
/// its descriptor's frame; otherwise (not here yet, a tensor on a channel, the allocation
/// declined) it returns nothing and the usual read returns the message, intact and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_reads_take_packed_messages_or_leave_them() {
    watchdog("immediate reads", async {
        for (transport, immediate) in [(TransportKind::Shm, true), (TransportKind::Tcp, false)] {
            let (a, b) = pair_with(options(&[transport], &[ChannelKind::Basic])).await;
            let alloc = |d: &sluice_channel::Descriptor| Some(Ok(Allocation::for_descriptor(d)));
            assert!(b.try_read_message(alloc).is_none(), "nothing was sent yet");
            // Packed (no tensor, a small one), a tensor too large to pack (on the channel), and
            // one the allocator declines, in turn.
            let shapes: [&[usize]; 4] = [&[], &[64], &[1 << 20], &[]];
            let mut taken = 0;
            for i in 0..12u64 {
                let sizes = shapes[(i % 4) as usize];
                let writer = {
                    let (a, m) = (a.clone(), message(i, sizes));
                    tokio::spawn(async move { a.write(&m).await })
                };
                b.readable().await.expect("readable");
                let decline = i % 4 == 3;
                let now = b.try_read_message(|d| {
                    if decline {
                        None
                    } else {
                        Some(Ok(Allocation::for_descriptor(d)))
                    }
                });
                let got = match now {
                    Some(r) => {
                        assert!(
                            sizes.iter().all(|&n| n < 16 << 10) && !decline,
                            "message {i} taken at once"
                        );
                        taken += 1;
                        r.expect("immediate read").1
                    }
                    None => {
                        if immediate && sizes.len() == 1 && sizes[0] > 16 << 10 {
                            assert!(b.has_input(), "a decoded descriptor still counts as input");
                        }
                        receive(&b).await
                    }
                };
                check(i, sizes, &got);
                writer.await.unwrap().expect("write");
            }
            assert_eq!(
                taken,
                if immediate { 6 } else { 0 },
                "{transport:?}: messages taken at once"
            );
            if immediate {
                // An allocation that does not fit is the caller's mistake: said so, and the
                // message waits for a `read` with one that fits.
                a.write(&message(12, &[])).await.expect("write");
                b.readable().await.expect("readable");
                let mut seen = None;
                let wrong = b.try_read_message(|d| {
                    seen = Some(d.clone());
                    Some(Ok(Allocation::default()))
                });
                assert!(matches!(wrong, Some(Err(PipeError::Misuse(_)))), "got {wrong:?}");
                assert!(b.error().is_none(), "misuse leaves the pipe usable");
                let d = seen.expect("the allocator saw the descriptor");
                check(12, &[], &b.read(Allocation::for_descriptor(&d)).await.expect("read"));
                // Declined, then read with `read` (its descriptor is pending), or after
                // `read_descriptor`: either way the next message is the next one (nothing of
                // the declined one is left behind).
                for (i, two_step) in [(13u64, false), (15, true)] {
                    a.write(&message(i, &[])).await.expect("write");
                    a.write(&message(i + 1, &[64])).await.expect("write");
                    b.readable().await.expect("readable");
                    let mut seen = None;
                    let declined = b.try_read_message(|d| {
                        seen = Some(d.clone());
                        None
                    });
                    assert!(declined.is_none(), "declined by the allocator");
                    let d = match two_step {
                        true => b.read_descriptor().await.expect("the declined message's descriptor"),
                        false => seen.expect("the allocator saw the descriptor"),
                    };
                    check(i, &[], &b.read(Allocation::for_descriptor(&d)).await.expect("read"));
                    check(i + 1, &[64], &receive(&b).await);
                }
                assert!(!b.has_input(), "nothing left over");
            }
        }
    })
    .await
}

/// `read_message_ready` waits for the next message and takes it at once when it is here whole
/// and packed (never on TCP); otherwise, or when the allocator declines it, it returns nothing
/// and the usual read returns the message intact. Given up while waiting, it takes nothing and
/// leaves the read side free; once the peer is gone it fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_reads_wait_then_take_or_leave_and_are_cancel_safe() {
    watchdog("ready reads", async {
        for (transport, immediate) in [(TransportKind::Shm, true), (TransportKind::Tcp, false)] {
            let (a, b) = pair_with(options(&[transport], &[ChannelKind::Basic])).await;
            let alloc = |d: &sluice_channel::Descriptor| Some(Ok(Allocation::for_descriptor(d)));
            // Given up while nothing has come: nothing is lost, and the read side is free.
            let waited = tokio::time::timeout(Duration::from_millis(50), b.read_message_ready(alloc)).await;
            assert!(waited.is_err(), "{transport:?}: nothing was sent yet");
            // A packed message, sent while the reader waits; a tensor too large to pack; one
            // the allocator declines.
            let shapes: [&[usize]; 3] = [&[64], &[1 << 20], &[]];
            for (i, sizes) in shapes.into_iter().enumerate() {
                let i = i as u64;
                let writer = {
                    let (a, m) = (a.clone(), message(i, sizes));
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        a.write(&m).await
                    })
                };
                let decline = i == 2;
                let ready = b
                    .read_message_ready(|d| (!decline).then(|| Ok(Allocation::for_descriptor(d))))
                    .await
                    .expect("ready");
                let got = match ready {
                    Some((d, got)) => {
                        assert!(immediate && i == 0, "{transport:?}: message {i} taken at once");
                        assert_eq!(d.metadata, format!("message {i}").as_bytes());
                        got
                    }
                    None => {
                        assert!(!immediate || i > 0, "{transport:?}: message {i} left");
                        assert!(b.has_input(), "a message left is still input");
                        receive(&b).await
                    }
                };
                check(i, sizes, &got);
                writer.await.unwrap().expect("write");
            }
            assert!(!b.has_input(), "nothing left over");
            // A message already here is taken without waiting.
            a.write(&message(3, &[])).await.expect("write");
            b.readable().await.expect("readable");
            match b.read_message_ready(alloc).await.expect("ready") {
                Some((_, got)) => check(3, &[], &got),
                None => check(3, &[], &receive(&b).await),
            }
            // The peer gone, a waiting read fails rather than waits.
            let waiting = tokio::spawn({
                let b = b.clone();
                async move { b.read_message_ready(alloc).await.map(|m| m.is_some()) }
            });
            tokio::time::sleep(Duration::from_millis(20)).await;
            a.close();
            drop(a);
            assert!(waiting.await.unwrap().is_err(), "{transport:?}: the peer closed");
        }
    })
    .await
}

/// Many tasks writing to one pipe at once (their writes queue and coalesce): every message
/// arrives once, intact, each task's in its order, with nothing left held when they stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_coalesce_without_loss() {
    watchdog("concurrent writers", async {
        for (transport, channel) in [
            (TransportKind::Shm, ChannelKind::Cma),
            (TransportKind::Tcp, ChannelKind::Basic),
        ] {
            let (a, b) = pair_with(options(&[transport], &[channel])).await;
            const TASKS: u64 = 8;
            const EACH: u64 = 200;
            let writers: Vec<_> = (0..TASKS)
                .map(|t| {
                    let a = a.clone();
                    tokio::spawn(async move {
                        for i in 0..EACH {
                            let seq = t * EACH + i;
                            let sizes = [[0usize, 64, 5000][(seq % 3) as usize]];
                            a.write(&message(seq, &sizes)).await.expect("write");
                        }
                    })
                })
                .collect();
            let mut next = vec![0u64; TASKS as usize];
            for _ in 0..TASKS * EACH {
                let d = b.read_descriptor().await.expect("descriptor");
                let seq: u64 = std::str::from_utf8(&d.metadata)
                    .unwrap()
                    .strip_prefix("message ")
                    .unwrap()
                    .parse()
                    .unwrap();
                let got = b.read(Allocation::for_descriptor(&d)).await.expect("read");
                let (t, i) = (seq / EACH, seq % EACH);
                assert_eq!(i, next[t as usize], "writer {t}: message {i} out of order");
                next[t as usize] += 1;
                check(seq, &[[0usize, 64, 5000][(seq % 3) as usize]], &got);
            }
            for w in writers {
                w.await.unwrap();
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misuse_is_reported_and_leaves_the_pipe_usable() {
    watchdog("misuse", async {
        let (a, b) = pair_with(ContextOptions::default()).await;
        let err = b
            .read(Allocation::default())
            .await
            .expect_err("read without descriptor");
        assert!(matches!(err.error, PipeError::Misuse(_)));
        // A CMA write completes once the receiver pulled the data: run it on its own task.
        let writer = tokio::spawn(async move { a.write(&message(0, &[100])).await });
        let d = b.read_descriptor().await.unwrap();
        assert!(matches!(b.read_descriptor().await, Err(PipeError::Misuse(_))));
        // Wrong size: refused, and the allocation comes back.
        let wrong = Allocation {
            payloads: vec![BytesMut::zeroed(10), BytesMut::new()],
            tensors: vec![RecvBuffer::cpu(99)],
        };
        let err = b.read(wrong).await.expect_err("wrong allocation");
        assert!(matches!(err.error, PipeError::Misuse(_)));
        assert_eq!(err.allocation.tensors[0].len(), 99);
        let got = b.read(Allocation::for_descriptor(&d)).await.unwrap();
        check(0, &[100], &got);
        writer.await.unwrap().unwrap();
    })
    .await
}

/// Channels that copy (here cross-memory attach, with no shared segment) fill the memory the
/// receiver supplies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_memory_is_reused_in_place() {
    watchdog("reuse", async {
        let (a, b) = pair_with(ContextOptions {
            segment_bytes: 0,
            ..ContextOptions::default()
        })
        .await;
        let mut alloc = None;
        let writer = tokio::spawn(async move {
            for i in 0..5 {
                a.write(&message(i, &[2 << 20])).await.unwrap();
            }
        });
        for i in 0..5 {
            let d = b.read_descriptor().await.unwrap();
            let given = alloc.take().unwrap_or_else(|| Allocation::for_descriptor(&d));
            let ptr = given.tensors[0].as_cpu().unwrap().as_ptr();
            let got = b.read(given).await.unwrap();
            assert_eq!(
                got.tensors[0].as_cpu().unwrap().as_ptr(),
                ptr,
                "data must land in the supplied memory"
            );
            check(i, &[2 << 20], &got);
            alloc = Some(got);
        }
        writer.await.unwrap();
    })
    .await
}

/// On one host (cma), a large tensor arrives where the sender copied it, in the receiver's
/// segment: handed over shared, no memory supplied; its blocks go back when the receiver drops
/// it, so the next one lands in the same place. Small tensors go inline, and tensors that do
/// not fit (too large, or while the receiver holds the segment full) go by cross-memory attach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cma_tensors_arrive_in_the_receivers_segment_and_go_back_when_dropped() {
    watchdog("segment", async {
        let (a, b) = pair_with(ContextOptions {
            segment_bytes: 8 << 20,
            ..ContextOptions::default()
        })
        .await;
        assert_eq!(b.info().cpu_channel, ChannelKind::Cma);
        let send = |p: &Pipe, i: u64, sizes: &'static [usize]| {
            let p = p.clone();
            tokio::spawn(async move { p.write(&message(i, sizes)).await })
        };
        const SIZES: &[usize] = &[100, 4 << 10, 3 << 20];
        let w = send(&a, 0, SIZES);
        let d = b.read_descriptor().await.unwrap();
        let shared: Vec<bool> = d.tensors.iter().map(|t| t.arrives_shared).collect();
        assert_eq!(shared, [false, true, true], "inline below 4 KiB, in the segment above");
        let got = b.read(Allocation::for_descriptor(&d)).await.unwrap();
        w.await.unwrap().unwrap();
        check(0, SIZES, &got);
        assert!(matches!(got.tensors[2], RecvBuffer::Shared(_)));
        let first = got.tensors[2].as_cpu().unwrap().as_ptr();
        // Held: a second large tensor does not fit next to the first and goes by cma.
        const BIG: &[usize] = &[6 << 20];
        let w = send(&a, 1, BIG);
        let d = b.read_descriptor().await.unwrap();
        assert!(!d.tensors[0].arrives_shared, "the segment is held full");
        let held = b.read(Allocation::for_descriptor(&d)).await.unwrap();
        w.await.unwrap().unwrap();
        check(1, BIG, &held);
        assert!(matches!(held.tensors[0], RecvBuffer::Cpu(_)));
        // Larger than the segment: cma.
        const HUGE: &[usize] = &[9 << 20];
        let w = send(&a, 2, HUGE);
        let d = b.read_descriptor().await.unwrap();
        assert!(!d.tensors[0].arrives_shared);
        check(2, HUGE, &b.read(Allocation::for_descriptor(&d)).await.unwrap());
        w.await.unwrap().unwrap();
        // Dropped: the blocks go back, and the next tensor lands where the first was.
        drop(got);
        let w = send(&a, 3, SIZES);
        let d = b.read_descriptor().await.unwrap();
        let again = b.read(Allocation::for_descriptor(&d)).await.unwrap();
        w.await.unwrap().unwrap();
        check(3, SIZES, &again);
        assert_eq!(
            again.tensors[2].as_cpu().unwrap().as_ptr(),
            first,
            "first fit reuses the blocks"
        );
        // A received tensor can be sent on as it is.
        let back = Message {
            metadata: Bytes::new(),
            payloads: vec![],
            tensors: again
                .tensors
                .into_iter()
                .map(|t| Tensor {
                    buffer: t.freeze(),
                    metadata: Bytes::new(),
                    target_device: None,
                })
                .collect(),
        };
        let echo = {
            let b = b.clone();
            tokio::spawn(async move { b.write(&back).await })
        };
        let d = a.read_descriptor().await.unwrap();
        let got = a.read(Allocation::for_descriptor(&d)).await.unwrap();
        echo.await.unwrap().unwrap();
        for (i, &n) in SIZES.iter().enumerate() {
            assert!(got.tensors[i].as_cpu().unwrap() == &pattern(3 * 31 + i as u64, n)[..]);
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_error_is_sticky_and_fails_pending_operations() {
    watchdog("sticky errors", async {
        let (a, b) = pair_with(ContextOptions::default()).await;
        let pending = tokio::spawn({
            let b = b.clone();
            async move { b.read_descriptor().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        a.close();
        let err = pending.await.unwrap().expect_err("peer closed");
        assert!(err.is_peer_lost(), "{err:?}");
        let again = b.write(&message(0, &[1])).await.expect_err("sticky");
        assert_eq!(again.to_string(), err.to_string());
        assert!(matches!(
            a.write(&message(0, &[1])).await,
            Err(PipeError::Closed { .. })
        ));
    })
    .await
}

/// A read given up in the middle of a message (its descriptor taken, its bytes still arriving)
/// cannot be resumed: abandoning it closes the pipe on this side, so later reads and writes
/// fail at once instead of parsing the middle of a tensor as a descriptor. The writer's bytes
/// pass through a proxy that stops forwarding after 8 MiB, so the 64 MiB tensor can never
/// finish arriving: the read is abandoned on every machine, however fast or loaded. (The writer
/// is not awaited: it is held by the proxy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_abandoned_mid_message_closes_the_pipe() {
    watchdog("abandoned read", async {
        let opts = options(&[TransportKind::Tcp], &[ChannelKind::Basic]);
        let mut listener = Context::new(opts.clone()).unwrap().listen("").await.unwrap();
        let proxy = stalling_proxy(listener.address().to_owned(), 8 << 20).await;
        let client = Context::new(opts).unwrap();
        let (a, b) = tokio::join!(client.connect(&proxy), listener.accept());
        let (a, b) = (a.expect("connect through the proxy"), b.expect("accept"));
        let writer = tokio::spawn({
            let a = a.clone();
            async move { a.write(&message(0, &[64 << 20])).await }
        });
        let d = b.read_descriptor().await.expect("descriptor");
        let read = tokio::time::timeout(Duration::from_millis(50), b.read(Allocation::for_descriptor(&d))).await;
        assert!(
            read.is_err(),
            "the read finished although the proxy held its bytes back"
        );
        assert!(matches!(b.read_descriptor().await, Err(PipeError::Closed { .. })));
        assert!(matches!(
            b.write(&message(1, &[1])).await,
            Err(PipeError::Closed { .. })
        ));
        writer.abort();
        a.close();
    })
    .await
}

/// A TCP proxy to `target`, for every connection made to it (the pipe's setup may open more
/// than one): everything towards the client passes, and the first `limit` bytes from the
/// client; after those it holds the rest back, both sockets left open. Returns the address to
/// connect to.
async fn stalling_proxy(target: String, limit: u64) -> String {
    let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = front.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = front.accept().await {
            let server = tokio::net::TcpStream::connect(&target).await.unwrap();
            tokio::spawn(async move {
                let (mut client_rx, mut client_tx) = client.into_split();
                let (mut server_rx, mut server_tx) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut server_rx, &mut client_tx).await });
                let _ = tokio::io::copy(&mut (&mut client_rx).take(limit), &mut server_tx).await;
                // Hold both halves open without reading on: the writer stalls, the reader waits.
                std::future::pending::<()>().await;
                drop((client_rx, server_tx));
            });
        }
    });
    addr
}

/// A real second process echoes every message back; then it is killed with SIGKILL while we
/// wait, and the wait fails promptly with a peer-lost error.
async fn echo_with_peer(channel: &str) {
    echo_with_peer_in(channel, ContextOptions::default(), &[]).await
}

/// [`echo_with_peer`] with these options here and this environment for the peer.
async fn echo_with_peer_in(channel: &str, options: ContextOptions, env: &[(&str, &str)]) {
    let ctx = Context::new(options).unwrap();
    let mut listener = ctx.listen("").await.unwrap();
    let mut peer = PeerProcess::spawn_with_env(&peer(), &["pipe-echo", listener.address(), channel], env);
    let pipe = listener.accept().await.expect("peer pipe");
    assert_eq!(pipe.info().cpu_channel.name(), channel);
    let sizes = [5, (4 << 20) + 1];
    let writer = tokio::spawn({
        let pipe = pipe.clone();
        async move {
            for i in 0..10 {
                pipe.write(&message(i, &sizes)).await.unwrap();
            }
        }
    });
    for i in 0..10 {
        check(i, &sizes, &receive(&pipe).await);
    }
    writer.await.unwrap();
    let pending = tokio::spawn({
        let pipe = pipe.clone();
        async move { pipe.read_descriptor().await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    peer.kill();
    let err = pending.await.unwrap().expect_err("peer killed");
    assert!(err.is_peer_lost(), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cma_with_a_real_peer_process() {
    watchdog("cma peer", echo_with_peer("cma")).await
}

/// Busy polling on both sides (here by option, in the peer by `SLUICE_BUSY_POLL`): messages
/// arrive intact, and a peer killed while this side spins for its next message (a kill leaves
/// no flag in the ring: only its socket's hang-up tells) fails the wait promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_with_a_real_peer_process() {
    let options = ContextOptions {
        shm: sluice_transport::shm::ShmOptions {
            busy_poll: true,
            ..Default::default()
        },
        ..ContextOptions::default()
    };
    watchdog(
        "busy peer",
        echo_with_peer_in("cma", options, &[("SLUICE_BUSY_POLL", "1")]),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn basic_with_a_real_peer_process() {
    watchdog("basic peer", echo_with_peer("basic")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multilane_with_a_real_peer_process() {
    watchdog("multilane peer", echo_with_peer("multilane")).await
}

// ---- Hostile input on the listener ----

async fn hostile_listener() -> (sluice_channel::PipeListener, String) {
    let opts = ContextOptions {
        setup_timeout: Duration::from_millis(500),
        ..ContextOptions::default()
    };
    let listener = Context::new(opts).unwrap().listen("").await.unwrap();
    let addr = listener.address().to_owned();
    (listener, addr)
}

async fn send_raw(addr: &str, bytes: &[u8]) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// After each bad connection the listener still opens a good pipe.
async fn still_serves(listener: &mut sluice_channel::PipeListener, addr: &str) {
    let client = Context::new(ContextOptions::default()).unwrap();
    let (c, s) = tokio::join!(client.connect(addr), listener.accept());
    c.expect("good client after bad input");
    s.expect("listener still serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_bytes_are_a_protocol_error() {
    watchdog("garbage", async {
        let (mut listener, addr) = hostile_listener().await;
        let _s = send_raw(&addr, &frame(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")).await;
        let err = listener.accept().await.expect_err("garbage");
        assert!(matches!(err, PipeError::Protocol { .. }), "{err:?}");
        still_serves(&mut listener, &addr).await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_frame_is_a_peer_lost_error() {
    watchdog("truncated", async {
        let (mut listener, addr) = hostile_listener().await;
        let mut bytes = frame(b"SLCE\x01\x00 and then some more bytes");
        bytes.truncate(bytes.len() - 10);
        let s = send_raw(&addr, &bytes).await;
        drop(s);
        let err = listener.accept().await.expect_err("truncated");
        assert!(err.is_peer_lost(), "{err:?}");
        still_serves(&mut listener, &addr).await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absurd_length_prefix_is_refused_without_allocating() {
    watchdog("absurd length", async {
        let (mut listener, addr) = hostile_listener().await;
        let _s = send_raw(&addr, &(1u64 << 63).to_le_bytes()).await;
        let err = listener.accept().await.expect_err("absurd length");
        assert!(
            matches!(err, PipeError::Transport(sluice_transport::TransportError::FrameTooLarge { len, .. }) if len == 1 << 63),
            "{err:?}"
        );
        still_serves(&mut listener, &addr).await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_protocol_version_is_refused_with_a_reason() {
    watchdog("unknown version", async {
        let (mut listener, addr) = hostile_listener().await;
        let mut s = send_raw(&addr, &frame(b"SLCE\x63\x00whatever")).await;
        let err = listener.accept().await.expect_err("version");
        assert!(matches!(err, PipeError::VersionMismatch { theirs: 99, .. }), "{err:?}");
        // The peer is told why before the connection closes.
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).await.unwrap();
        let reply: sluice_channel::wire::Reply = sluice_channel::wire::decode_setup(&reply[8..], "server").unwrap();
        assert!(
            matches!(reply, sluice_channel::wire::Reply::Reject { ref reason } if reason.contains("version 99")),
            "{reply:?}"
        );
        still_serves(&mut listener, &addr).await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connection_times_out_and_others_are_served_meanwhile() {
    watchdog("silent", async {
        let (mut listener, addr) = hostile_listener().await;
        let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
        // A good pipe opens while the silent one is still pending.
        still_serves(&mut listener, &addr).await;
        let err = listener.accept().await.expect_err("silent");
        assert!(matches!(err, PipeError::Timeout { stage: "hello", .. }), "{err:?}");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_join_token_is_refused() {
    watchdog("unknown token", async {
        let (mut listener, addr) = hostile_listener().await;
        let hello = sluice_channel::wire::encode_setup(&sluice_channel::wire::Hello::Join { token: 42 });
        let _s = send_raw(&addr, &frame(&hello)).await;
        let err = listener.accept().await.expect_err("token");
        assert!(
            matches!(err, PipeError::Protocol { ref detail, .. } if detail.contains("token")),
            "{err:?}"
        );
        still_serves(&mut listener, &addr).await;
    })
    .await
}
