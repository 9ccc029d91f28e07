//! Collectives across real processes: every collective, dtype and reduction at sizes from
//! nothing to past the ring threshold against a reference computed independently (in f64, from
//! inputs every rank can recompute), point-to-point tags, two groups over the same ranks, and a
//! rank killed mid-allreduce failing the others with an error naming it.

use std::time::Duration;

use half::{bf16, f16};
use sluice_collective::{CollectiveError, DType, Group, GroupOptions, ReduceOp, DIRECT_MAX, LOCAL_MIN};
use sluice_tests::worker_test;
use sluice_tests::workers::{run_workers_with, Ending, WorkerEnv};

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
];

/// Rank `rank`'s value at element `i`: small integers in -2..=2, so every reduction of up to 4
/// of them is exact in every dtype whatever the order (products reach 16, sums 8).
fn value(rank: u32, i: usize) -> f64 {
    ((rank as usize * 7 + i * 3) % 5) as f64 - 2.0
}

/// The bytes of `v` as `dtype` (complex: `v` and `-v / 2` as the two parts).
fn encode(dtype: DType, vals: &[f64]) -> Vec<u8> {
    let mut out = Vec::new();
    for &v in vals {
        match dtype {
            DType::Bool => out.push((v != 0.0) as u8),
            DType::I8 => out.extend((v as i8).to_ne_bytes()),
            DType::I16 => out.extend((v as i16).to_ne_bytes()),
            DType::I32 => out.extend((v as i32).to_ne_bytes()),
            DType::I64 => out.extend((v as i64).to_ne_bytes()),
            DType::U8 => out.extend((v.abs() as u8).to_ne_bytes()),
            DType::U16 => out.extend((v.abs() as u16).to_ne_bytes()),
            DType::U32 => out.extend((v.abs() as u32).to_ne_bytes()),
            DType::U64 => out.extend((v.abs() as u64).to_ne_bytes()),
            DType::F16 => out.extend(f16::from_f64(v).to_ne_bytes()),
            DType::BF16 => out.extend(bf16::from_f64(v).to_ne_bytes()),
            DType::F32 => out.extend((v as f32).to_ne_bytes()),
            DType::F64 => out.extend(v.to_ne_bytes()),
            DType::C64 => {
                out.extend((v as f32).to_ne_bytes());
                out.extend(((-v / 2.0) as f32).to_ne_bytes());
            }
            DType::C128 => {
                out.extend(v.to_ne_bytes());
                out.extend((-v / 2.0).to_ne_bytes());
            }
        }
    }
    out
}

/// The value each rank contributes, as the dtype sees it (unsigned types take |v|).
fn seen(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => v.abs(),
        DType::Bool => (v != 0.0) as u8 as f64,
        _ => v,
    }
}

/// The reference: `op` over every rank's element `i`, computed in f64 (complex separately).
fn reference(dtype: DType, op: ReduceOp, world: u32, elems: usize) -> Vec<u8> {
    let complex = matches!(dtype, DType::C64 | DType::C128);
    if complex {
        let mut out = Vec::new();
        for i in 0..elems {
            let (mut re, mut im) = (0.0f64, 0.0f64);
            for r in 0..world {
                let (a, b) = (value(r, i), -value(r, i) / 2.0);
                if r == 0 {
                    (re, im) = (a, b);
                } else if op == ReduceOp::Product {
                    (re, im) = (re * a - im * b, re * b + im * a);
                } else {
                    (re, im) = (re + a, im + b);
                }
            }
            if op == ReduceOp::Avg {
                (re, im) = (re / world as f64, im / world as f64);
            }
            if dtype == DType::C64 {
                out.extend((re as f32).to_ne_bytes());
                out.extend((im as f32).to_ne_bytes());
            } else {
                out.extend(re.to_ne_bytes());
                out.extend(im.to_ne_bytes());
            }
        }
        return out;
    }
    let vals: Vec<f64> = (0..elems)
        .map(|i| {
            let xs = (0..world).map(|r| seen(dtype, value(r, i)));
            match (dtype, op) {
                (DType::Bool, ReduceOp::Sum | ReduceOp::Max) => xs.fold(0.0, f64::max),
                (DType::Bool, _) => xs.fold(1.0, f64::min),
                (_, ReduceOp::Sum) => xs.sum(),
                (_, ReduceOp::Avg) => xs.sum::<f64>() / world as f64,
                (_, ReduceOp::Product) => xs.product(),
                (_, ReduceOp::Min) => xs.fold(f64::INFINITY, f64::min),
                (_, ReduceOp::Max) => xs.fold(f64::NEG_INFINITY, f64::max),
            }
        })
        .collect();
    // Unsigned types: the values are already |v|; encode must not take |x| of a negative sum.
    encode(dtype, &vals)
}

/// Whether two buffers hold the same values: bytes, except that floating-point zeros compare
/// equal whatever their sign (a complex product's zero parts take the sign of a subtraction,
/// which depends on the order of the factors).
fn same(dtype: DType, a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let vals = |x: &[u8]| -> Vec<f64> {
        match dtype {
            DType::F16 => x.chunks(2).map(|c| f16::from_ne_bytes([c[0], c[1]]).to_f64()).collect(),
            DType::BF16 => x
                .chunks(2)
                .map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f64())
                .collect(),
            DType::F32 | DType::C64 => x
                .chunks(4)
                .map(|c| f32::from_ne_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            DType::F64 | DType::C128 => x.chunks(8).map(|c| f64::from_ne_bytes(c.try_into().unwrap())).collect(),
            _ => x.iter().map(|&v| v as f64).collect(),
        }
    };
    vals(a) == vals(b)
}

fn input(dtype: DType, rank: u32, elems: usize) -> Vec<u8> {
    encode(dtype, &(0..elems).map(|i| value(rank, i)).collect::<Vec<_>>())
}

fn options(env: &WorkerEnv, name: &str) -> GroupOptions {
    let mut o = GroupOptions::from_env(name).expect("torchrun's variables");
    o.timeout = Duration::from_secs(30);
    assert_eq!((o.rank, o.world_size), (env.rank, env.world_size));
    o
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

const DTYPES: [DType; 15] = DType::ALL;

// Twice: over the default pipes (one host: large buffers are read straight out of the peers'
// memory) and over pipes without cross-memory attach (large buffers take the ring).
worker_test!(every_collective_dtype_and_op_matches_the_reference, 4, |env| {
    let rt = runtime();
    rt.block_on(async {
        let g = Group::new(options(&env, "every")).await.expect("group");
        let big = conformance(&g).await;
        let local = g.local_collectives();
        assert!(
            local >= big,
            "only {local} collectives read their peers, of at least {big}"
        );
        // (The first group stays: rank 0's serves the store.)
        let first = g;
        let mut o = options(&env, "every-ring");
        o.serve_store = false;
        o.pipe.channels = vec![sluice_channel::ChannelKind::Basic];
        let g = Group::new(o).await.expect("group");
        conformance(&g).await;
        assert_eq!(
            g.local_collectives(),
            0,
            "read the peers' memory without cross-memory attach"
        );
        g.close().await.unwrap();
        first.close().await.unwrap();
    });
});

/// Returns how many collectives it made at the local length (allreduce at the largest count,
/// broadcast and allgather at the largest length).
async fn conformance(g: &Group) -> u64 {
    let mut big = 0;
    let (me, n) = (g.rank(), g.world_size());
    for dtype in DTYPES {
        let size = dtype.size();
        // Nothing, one element, an odd count, past the ring threshold and past the local
        // one (odd counts again).
        for elems in [0, 1, 1001, DIRECT_MAX / size + 3001, LOCAL_MIN / size + 3001] {
            for op in OPS {
                let want = reference(dtype, op, n, elems);
                if sluice_collective::reduce::check(dtype, op).is_err() {
                    let mut buf = input(dtype, me, elems);
                    let e = g.all_reduce(&mut buf, dtype, op).await.unwrap_err();
                    assert!(matches!(e, CollectiveError::Unsupported(_)), "{e}");
                    continue;
                }
                let what = format!("{} {} x{elems}", dtype.name(), op.name());
                let mut buf = input(dtype, me, elems);
                g.all_reduce(&mut buf, dtype, op).await.unwrap();
                assert!(same(dtype, &buf, &want), "all_reduce {what}");
                big += u64::from(elems > LOCAL_MIN / size);
                let mut buf = input(dtype, me, elems);
                g.reduce(1, &mut buf, dtype, op).await.unwrap();
                if me == 1 {
                    assert!(same(dtype, &buf, &want), "reduce {what}");
                } else {
                    assert!(buf == input(dtype, me, elems), "reduce leaves non-roots alone: {what}");
                }
                // reduce_scatter: each rank's input is n pieces of `elems` elements.
                let whole: Vec<u8> = (0..n).flat_map(|_| input(dtype, me, elems)).collect();
                let mut out = vec![0u8; elems * size];
                g.reduce_scatter(&whole, &mut out, dtype, op).await.unwrap();
                assert!(same(dtype, &out, &want), "reduce_scatter {what}");
            }
        }
    }
    // The data-moving collectives, bytes only, at a small, a ring-sized and a local length.
    for len in [0usize, 5, DIRECT_MAX + 7, LOCAL_MIN + 7] {
        let mine = |r: u32| sluice_tests::pattern(r as u64 + 100, len);
        let mut buf = if me == 2 { mine(2) } else { vec![0; len] };
        g.broadcast(2, &mut buf).await.unwrap();
        assert!(buf == mine(2), "broadcast {len}");
        let all: Vec<u8> = (0..n).flat_map(mine).collect();
        let mut out = vec![0; len * n as usize];
        g.all_gather(&mine(me), &mut out).await.unwrap();
        assert!(out == all, "all_gather {len}");
        big += 2 * u64::from(len > LOCAL_MIN);
        let mut out = if me == 3 { vec![0; len * n as usize] } else { Vec::new() };
        g.gather(3, &mine(me), &mut out).await.unwrap();
        if me == 3 {
            assert!(out == all, "gather {len}");
        }
        let mut out = vec![0; len];
        g.scatter(0, if me == 0 { &all } else { &[] }, &mut out).await.unwrap();
        assert!(out == mine(me), "scatter {len}");
        // all_to_all: rank i's piece j is pattern(i * 16 + j).
        let piece = |i: u32, j: u32| sluice_tests::pattern((i * 16 + j) as u64, len);
        let input: Vec<u8> = (0..n).flat_map(|j| piece(me, j)).collect();
        let want: Vec<u8> = (0..n).flat_map(|i| piece(i, me)).collect();
        let mut out = vec![0; input.len()];
        g.all_to_all(&input, &mut out).await.unwrap();
        assert!(out == want, "all_to_all {len}");
        g.barrier().await.unwrap();
    }
    // Point to point: tags keep messages apart, and order holds within a tag.
    let next = (me + 1) % n;
    let prev = (me + n - 1) % n;
    for k in 0..3u8 {
        g.send(next, 7, vec![me as u8, k].into()).await.unwrap();
    }
    g.send(next, 9, vec![99].into()).await.unwrap();
    assert_eq!(&g.recv(prev, 9).await.unwrap()[..], [99]);
    for k in 0..3u8 {
        assert_eq!(&g.recv(prev, 7).await.unwrap()[..], [prev as u8, k]);
    }
    // One 8 MiB buffer used again and again (given huge pages from its second use on,
    // where the peers read it directly): right every time.
    let mut reused = vec![0u8; 8 << 20];
    for k in 0..3u32 {
        for (i, c) in reused.chunks_exact_mut(4).enumerate() {
            c.copy_from_slice(&((i % 1000) as f32 + (me * 7 + k) as f32).to_ne_bytes());
        }
        g.all_reduce(&mut reused, DType::F32, ReduceOp::Sum).await.unwrap();
        let base: u32 = (0..n).map(|r| r * 7 + k).sum();
        for (i, c) in reused.chunks_exact(4).enumerate().step_by(4099) {
            let got = f32::from_ne_bytes(c.try_into().unwrap());
            assert_eq!(
                got,
                (n * (i % 1000) as u32 + base) as f32,
                "reused buffer, round {k}, element {i}"
            );
        }
        big += 1;
    }
    // Sizes that disagree across ranks are an error, not a hang.
    let mut odd = vec![0u8; if me == 0 { 8 } else { 12 }];
    let e = g.all_reduce(&mut odd, DType::F32, ReduceOp::Sum).await.unwrap_err();
    assert!(e.to_string().contains("bytes"), "{e}");
    // Also when both are long enough to read each other's memory.
    let mut odd = vec![0u8; LOCAL_MIN + if me == 0 { 8 } else { 12 }];
    let e = g.all_reduce(&mut odd, DType::F32, ReduceOp::Sum).await.unwrap_err();
    assert!(e.to_string().contains("bytes"), "{e}");
    g.barrier().await.unwrap();
    big
}

worker_test!(a_group_forms_from_a_running_agents_members, 3, |env| {
    let agent = sluice_agent::Agent::init(env.options(), sluice_agent::Registry::new()).expect("agent");
    let rt = runtime();
    rt.block_on(async {
        let g = Group::from_agent(&agent, "from-agent", Duration::from_secs(30))
            .await
            .expect("group");
        assert_eq!((g.rank(), g.world_size()), (env.rank, env.world_size));
        let mut x = vec![g.rank() as u8 + 1; 100_000];
        g.all_reduce(&mut x, DType::U8, ReduceOp::Sum).await.unwrap();
        assert!(x.iter().all(|&v| v == 6));
        g.close().await.unwrap();
    });
    agent.shutdown().expect("shutdown");
});

// A receiver that does not receive holds back its peer instead of buffering without bound:
// with a 1 MiB mailbox per peer, 64 MiB sent ahead over TCP cannot all be taken off the wire,
// so the sender's last send completes only after the receiver starts receiving (1.5 s late),
// and every message then arrives whole and in order.
worker_test!(a_receiver_that_does_not_receive_holds_its_sender_back, 2, |env| {
    std::env::set_var("SLUICE_COLLECTIVE_MAILBOX_BYTES", (1u64 << 20).to_string());
    let rt = runtime();
    rt.block_on(async {
        let mut o = options(&env, "held-back");
        o.pipe = sluice_channel::ContextOptions {
            transports: vec![sluice_channel::TransportKind::Tcp],
            channels: vec![sluice_channel::ChannelKind::Basic],
            ..Default::default()
        };
        let g = Group::new(o).await.expect("group");
        const N: usize = 128;
        const LEN: usize = 512 << 10;
        let start = std::time::Instant::now();
        if g.rank() == 0 {
            for i in 0..N {
                g.send(1, 5, sluice_tests::pattern(i as u64, LEN).into()).await.unwrap();
            }
            let took = start.elapsed().as_millis() as u64;
            g.send(1, 6, took.to_le_bytes().to_vec().into()).await.unwrap();
        } else {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            for i in 0..N {
                let got = g.recv(0, 5).await.unwrap();
                assert!(got[..] == sluice_tests::pattern(i as u64, LEN)[..], "message {i}");
            }
            let took = u64::from_le_bytes(g.recv(0, 6).await.unwrap()[..8].try_into().unwrap());
            assert!(
                took >= 1000,
                "the sender finished its 64 MiB in {took} ms, before the receiver received anything: nothing held it back"
            );
        }
        g.close().await.unwrap();
    });
});

worker_test!(two_groups_over_the_same_ranks_do_not_mix, 3, |env| {
    let rt = runtime();
    rt.block_on(async {
        let a = Group::new(options(&env, "alpha")).await.expect("alpha");
        let mut ob = options(&env, "beta");
        // The second group uses the first one's store (already served by rank 0).
        ob.serve_store = false;
        let b = Group::new(ob).await.expect("beta");
        let me = a.rank();
        // The same sequence numbers and tags in both, interleaved.
        let mut x = vec![me as u8 + 1; 4];
        let mut y = vec![10 * (me as u8 + 1); 4];
        let (r1, r2) = tokio::join!(
            a.all_reduce(&mut x, DType::U8, ReduceOp::Sum),
            b.all_reduce(&mut y, DType::U8, ReduceOp::Sum)
        );
        r1.unwrap();
        r2.unwrap();
        assert_eq!(x, vec![6; 4]);
        assert_eq!(y, vec![60; 4]);
        let peer = (me + 1) % 3;
        a.send(peer, 1, vec![1].into()).await.unwrap();
        b.send(peer, 1, vec![2].into()).await.unwrap();
        let from = (me + 2) % 3;
        assert_eq!(&b.recv(from, 1).await.unwrap()[..], [2]);
        assert_eq!(&a.recv(from, 1).await.unwrap()[..], [1]);
        a.barrier().await.unwrap();
        b.barrier().await.unwrap();
        b.close().await.unwrap();
        a.close().await.unwrap();
    });
});

/// Rank 2 dies while the others are in an allreduce (large: the ring, in which rank 0 never
/// talks to rank 2): every survivor's allreduce fails with an error naming rank 2, well within
/// the group's timeout (the ranks that see the loss tell the others), and later calls fail at
/// once.
#[test]
fn a_rank_killed_mid_allreduce_fails_the_others_naming_it() {
    const TEST: &str = "a_rank_killed_mid_allreduce_fails_the_others_naming_it";
    let ending = |r: u32| if r == 2 { Ending::Killed } else { Ending::Success };
    run_workers_with(TEST, 4, ending, |env| {
        let rt = runtime();
        rt.block_on(async {
            let mut o = options(&env, "killed");
            o.timeout = Duration::from_secs(20);
            let g = Group::new(o).await.expect("group");
            let mut buf = vec![0u8; 8 << 20];
            g.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).await.unwrap();
            g.barrier().await.unwrap();
            if g.rank() == 2 {
                // Dies once the others are inside the next allreduce (waiting on it), not while
                // some are still leaving the barrier.
                std::thread::sleep(Duration::from_millis(300));
                std::process::abort();
            }
            let started = std::time::Instant::now();
            let e = g.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).await.unwrap_err();
            let text = e.to_string();
            assert!(text.contains("rank 2"), "rank {}: {text}", g.rank());
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "took {:?}",
                started.elapsed()
            );
            let again = g.barrier().await.unwrap_err();
            assert!(again.to_string().contains("rank 2"), "{again}");
            // Survivors stay until all of them have seen the loss: a survivor's exit is a loss
            // too, and a rank that saw it first would name that rank instead.
            tokio::time::sleep(Duration::from_secs(1)).await;
            assert!(g.close().await.unwrap_err().to_string().contains("rank 2"));
        });
    });
}

/// Rank 1 is an impostor speaking the wire by hand: whatever malformed message it sends (bad
/// magic, another group's id, another sender, a short header), rank 0's pending operation
/// fails at once with an error naming rank 1 and what it sent. (Lengths are bounded before
/// allocation, `MAX_MESSAGE_BYTES`; a forged oversized announcement needs a forged pipe
/// descriptor, which the pipe's own hostile-input tests cover.)
#[test]
fn a_peer_sending_malformed_messages_fails_the_group_naming_it() {
    use bytes::Bytes;
    use sluice_agent::store::{Store, StoreUrl};
    use sluice_channel::{Allocation, Context, ContextOptions, Message, Tensor};

    let rt = runtime();
    let header = |magic: &[u8; 4], group: u64, from: u32| {
        let mut h = Vec::new();
        h.extend_from_slice(magic);
        h.extend_from_slice(&1u16.to_le_bytes());
        h.extend_from_slice(&3u16.to_le_bytes()); // a collective's step
        h.extend_from_slice(&group.to_le_bytes());
        h.extend_from_slice(&from.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&0u64.to_le_bytes());
        h
    };
    for (case, says) in [
        ("magic", "bad magic"),
        ("group", "another group"),
        ("sender", "claiming to be rank 5"),
        ("short", "header of 7 bytes"),
    ] {
        rt.block_on(async {
            let port = sluice_tests::workers::free_port();
            let store = format!("127.0.0.1:{port}");
            let name = format!("hostile-{case}");
            let o0 = GroupOptions {
                name: name.clone(),
                rank: 0,
                world_size: 2,
                store: store.clone(),
                serve_store: true,
                host: "127.0.0.1".into(),
                timeout: Duration::from_secs(20),
                pipe: ContextOptions::default(),
            };
            let honest = tokio::spawn(async move {
                let g = Group::new(o0).await?;
                let mut buf = vec![0u8; 16];
                g.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).await
            });
            // The impostor: publishes an address, accepts rank 0's pipe, reads its hello, joins
            // the formation barrier, then sends one malformed message.
            let s = loop {
                match Store::connect(&StoreUrl::parse(&store).unwrap(), Duration::from_secs(5), None).await {
                    Ok(s) => break s,
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            };
            let ctx = Context::new(ContextOptions::default()).unwrap();
            let mut listener = ctx.listen("127.0.0.1:0").await.unwrap();
            s.set(
                &format!("collective/{name}/addr/1"),
                listener.address().as_bytes().to_vec(),
            )
            .await
            .unwrap();
            let pipe = listener.accept().await.unwrap();
            let d = pipe.read_descriptor().await.unwrap();
            pipe.read(Allocation::for_descriptor(&d)).await.unwrap();
            let group = u64::from_le_bytes(d.metadata[8..16].try_into().unwrap());
            s.barrier(&format!("collective/{name}/formed"), 2, Duration::from_secs(10))
                .await
                .unwrap();
            let metadata = match case {
                "magic" => header(b"XXXX", group, 1),
                "group" => header(b"SLCO", group ^ 1, 1),
                "sender" => header(b"SLCO", group, 5),
                _ => header(b"SLCO", group, 1)[..7].to_vec(),
            };
            pipe.write(&Message {
                metadata: Bytes::from(metadata),
                payloads: Vec::new(),
                tensors: vec![Tensor::cpu(Bytes::from_static(&[0; 16]))],
            })
            .await
            .unwrap();
            let started = std::time::Instant::now();
            let e = honest.await.unwrap().unwrap_err().to_string();
            assert!(e.contains("rank 1") && e.contains(says), "{case}: {e}");
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{case}: took {:?}",
                started.elapsed()
            );
        });
    }
}

worker_test!(an_abort_reaches_every_rank_with_its_reason, 3, |env| {
    let rt = runtime();
    rt.block_on(async {
        let g = Group::new(options(&env, "abort")).await.expect("group");
        g.barrier().await.unwrap();
        if g.rank() == 1 {
            // The others are waiting for this rank in the allreduce below.
            tokio::time::sleep(Duration::from_millis(200)).await;
            g.abort("the data loader failed");
        }
        let started = std::time::Instant::now();
        let mut buf = vec![0u8; 64];
        let e = g.all_reduce(&mut buf, DType::F32, ReduceOp::Sum).await.unwrap_err();
        assert!(
            matches!(&e, CollectiveError::Aborted { by: 1, why } if why.contains("data loader")),
            "rank {}: {e}",
            g.rank()
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
        // Everyone has seen it before anyone leaves (a leaving rank would be a loss too).
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(g.close().await.is_err());
    });
});

// A collective dropped after its plan went out (here by a caller's own timeout) fails the group
// at once: its peers may be reading its buffer, which its caller now has back. The other rank
// learns it when it calls, not at its own timeout (30 s).
worker_test!(a_collective_dropped_while_peers_may_read_it_fails_the_group, 2, |env| {
    let rt = runtime();
    rt.block_on(async {
        let g = Group::new(options(&env, "dropped")).await.expect("group");
        let mut buf = vec![1u8; LOCAL_MIN * 4];
        if g.rank() == 0 {
            let r = tokio::time::timeout(
                Duration::from_millis(200),
                g.all_reduce(&mut buf, DType::U8, ReduceOp::Sum),
            )
            .await;
            assert!(
                r.is_err(),
                "rank 1 was not there yet: the call should have been dropped"
            );
            let e = g.barrier().await.unwrap_err();
            assert!(e.to_string().contains("abandoned"), "{e}");
            tokio::time::sleep(Duration::from_secs(2)).await;
        } else {
            tokio::time::sleep(Duration::from_millis(800)).await;
            let started = std::time::Instant::now();
            let e = g.all_reduce(&mut buf, DType::U8, ReduceOp::Sum).await.unwrap_err();
            assert!(e.to_string().contains("abandoned"), "{e}");
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "took {:?}",
                started.elapsed()
            );
        }
    });
});
