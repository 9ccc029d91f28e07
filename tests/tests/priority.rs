//! Call priorities across real processes: a busy callee takes queued requests by priority
//! (first in, first out within one) with aging; an urgent call overtakes bulk tensors stuck on
//! the normal pipe, on every CPU channel; a peer's out-of-range priority is a typed error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice_agent::priority::AGING_PASSES;
use sluice_agent::{Agent, CallContext, Payload, Priority, Registry, Tensor};
use sluice_channel::{ChannelKind, TransportKind};
use sluice_tests::workers::{Ending, WorkerEnv};
use sluice_tests::{pattern, worker_test, WATCHDOG};

/// Handlers wait for this (opened by `open`).
static GATE: AtomicBool = AtomicBool::new(false);
/// A `hold` handler is running.
static HOLDING: AtomicBool = AtomicBool::new(false);
/// What `record` saw, in the order it ran.
static ORDER: Mutex<Vec<(i8, u32)>> = Mutex::new(Vec::new());

fn wait_for_gate() {
    HOLDING.store(true, Ordering::SeqCst);
    // A plain sleep, not `pool::blocking`: the handler keeps its slot, as a long computation
    // would, so the requests behind it queue.
    while !GATE.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn registry() -> Registry {
    let mut r = Registry::new();
    r.handler("hold", |_, (): ()| {
        wait_for_gate();
        Ok(())
    })
    .raw_handler("hold_echo", |_, payload| {
        wait_for_gate();
        Ok(payload)
    })
    .raw_handler("echo", |_, payload| Ok(payload))
    .handler("noop", |_, (): ()| Ok(()))
    .async_handler("noop_async", |_, (): ()| async { Ok(()) })
    .handler("record", |_, (level, seq): (i8, u32)| {
        ORDER.lock().unwrap().push((level, seq));
        // Longer than a handler may take to be run inline: every record waits in the queue.
        std::thread::sleep(Duration::from_micros(400));
        Ok(())
    })
    // The test's controls are async handlers: they never wait for the busy slot.
    .async_handler("queued", |ctx: CallContext, (): ()| async move {
        Ok((ctx.agent.queued_requests(), HOLDING.load(Ordering::SeqCst)))
    })
    .async_handler("open", |_, (): ()| async move {
        GATE.store(true, Ordering::SeqCst);
        Ok(())
    })
    .async_handler("reset", |_, (): ()| async move {
        GATE.store(false, Ordering::SeqCst);
        HOLDING.store(false, Ordering::SeqCst);
        ORDER.lock().unwrap().clear();
        Ok(())
    })
    .async_handler("order", |_, (): ()| async move { Ok(ORDER.lock().unwrap().clone()) });
    r
}

/// Polls `done` until it holds, failing after the watchdog.
fn until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < WATCHDOG, "watchdog: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// (requests waiting for a slot on worker1, whether its slot is held).
fn queued(agent: &Agent) -> (usize, bool) {
    agent.call(1u32, "queued", &()).unwrap()
}

/// Holds worker1's only handler slot until `open`.
fn hold(agent: &Agent) -> sluice_agent::RpcFuture {
    let f = agent.call_async(1u32, "hold", &());
    until("the hold handler runs", || queued(agent).1);
    f
}

worker_test!(a_busy_callee_serves_queued_requests_by_priority_with_aging, 2, |env| {
    let agent = Agent::init(
        sluice_agent::AgentOptions {
            pool_threads: 1,
            ..env.options()
        },
        registry(),
    )
    .unwrap();
    if env.rank == 0 {
        // Mixed priorities queue behind a held slot: served highest first, FIFO within one.
        let held = hold(&agent);
        let levels = [0i8, 4, -4, 4, 0, 7, -8, 0, -4, 7];
        let calls: Vec<_> = levels
            .iter()
            .enumerate()
            .map(|(seq, &level)| {
                agent
                    .with_priority(Priority::new(level).unwrap())
                    .call_async(1u32, "record", &(level, seq as u32))
            })
            .collect();
        until("every record is queued", || queued(&agent).0 == levels.len());
        agent.call::<_, ()>(1u32, "open", &()).unwrap();
        held.wait().unwrap();
        for c in calls {
            c.wait().unwrap();
        }
        let order: Vec<(i8, u32)> = agent.call(1u32, "order", &()).unwrap();
        let mut expected: Vec<(i8, u32)> = levels.iter().enumerate().map(|(s, &l)| (l, s as u32)).collect();
        expected.sort_by_key(|&(l, s)| (std::cmp::Reverse(l), s));
        assert_eq!(order, expected);

        // Aging: one lowest-priority request, then a flood of high ones. It runs once
        // AGING_PASSES requests newer than it have run, not after the whole flood.
        agent.call::<_, ()>(1u32, "reset", &()).unwrap();
        let held = hold(&agent);
        let low = agent
            .with_priority(Priority::LOWEST)
            .call_async(1u32, "record", &(-8i8, 0u32));
        until("the low request is queued", || queued(&agent).0 == 1);
        let flood = 3 * AGING_PASSES as u32;
        let high: Vec<_> = (1..=flood)
            .map(|seq| {
                agent
                    .with_priority(Priority::HIGH)
                    .call_async(1u32, "record", &(4i8, seq))
            })
            .collect();
        until("the flood is queued", || queued(&agent).0 == 1 + flood as usize);
        agent.call::<_, ()>(1u32, "open", &()).unwrap();
        held.wait().unwrap();
        low.wait().unwrap();
        for c in high {
            c.wait().unwrap();
        }
        let order: Vec<(i8, u32)> = agent.call(1u32, "order", &()).unwrap();
        let at = order.iter().position(|&(l, _)| l == -8).unwrap();
        assert_eq!(at as u64, AGING_PASSES, "{order:?}");
        // The flood itself stays in arrival order around it.
        let seqs: Vec<u32> = order.iter().filter(|&&(l, _)| l == 4).map(|&(_, s)| s).collect();
        assert_eq!(seqs, (1..=flood).collect::<Vec<_>>());
    }
    agent.shutdown().unwrap();
});

/// worker1 holds one bulk request (its in-flight budget full), so a second bulk request and
/// everything behind it on the normal pipe stay unread. An urgent call still goes through (on
/// the express pipe) and a normal one behind the bulk does not, until the bulk is released;
/// every payload arrives byte for byte.
fn urgent_overtakes_bulk(env: WorkerEnv, transport: TransportKind, channel: ChannelKind) {
    let mut options = env.options();
    // One bulk request fills the budget; a second must wait to be read.
    options.max_message_bytes = 8 << 20;
    options.max_in_flight_bytes = 8 << 20;
    options.pipe.transports = vec![transport];
    options.pipe.channels = vec![channel];
    let agent = Agent::init(options, registry()).unwrap();
    if env.rank == 0 {
        let tensor = |seq: u64, len: usize| Tensor::cpu(Bytes::from(pattern(seq, len)));
        let call = |agent: &Agent, handler: &str, seq: u64, len: usize| {
            agent.rpc_async(1u32, handler, Payload::empty().with_tensors(vec![tensor(seq, len)]))
        };
        let check = |reply: Payload, seq: u64, len: usize| {
            let mut reply = reply;
            let t = reply.take_tensors();
            assert_eq!(t.len(), 1);
            assert_eq!(t[0].buffer.as_cpu().unwrap().as_ref(), pattern(seq, len).as_slice());
        };
        let bulk = 6 << 20;
        let b1 = call(&agent, "hold_echo", 1, bulk);
        until("the first bulk request is held", || queued(&agent).1);
        let b2 = call(&agent, "echo", 2, bulk);
        let normal = call(&agent, "echo", 3, 64);
        let urgent = call(&agent.with_priority(Priority::HIGH), "echo", 4, 64);
        let got = urgent
            .wait_timeout(WATCHDOG)
            .expect("watchdog: the urgent call waited behind the bulk tensors")
            .unwrap();
        check(got, 4, 64);
        assert!(
            !normal.is_done() && !b2.is_done(),
            "a normal call completed while the bulk ahead of it on its pipe was unread"
        );
        // Released by an urgent call too: a normal one would wait behind the bulk.
        agent
            .with_priority(Priority::HIGH)
            .call::<_, ()>(1u32, "open", &())
            .unwrap();
        check(b1.wait().unwrap(), 1, bulk);
        check(b2.wait().unwrap(), 2, bulk);
        check(normal.wait().unwrap(), 3, 64);
    }
    agent.shutdown().unwrap();
}

worker_test!(urgent_overtakes_bulk_on_shm_cma, 2, |env| {
    urgent_overtakes_bulk(env, TransportKind::Shm, ChannelKind::Cma)
});

worker_test!(urgent_overtakes_bulk_on_shm_basic, 2, |env| {
    urgent_overtakes_bulk(env, TransportKind::Shm, ChannelKind::Basic)
});

worker_test!(urgent_overtakes_bulk_on_tcp_basic, 2, |env| {
    urgent_overtakes_bulk(env, TransportKind::Tcp, ChannelKind::Basic)
});

worker_test!(urgent_overtakes_bulk_on_tcp_multilane, 2, |env| {
    urgent_overtakes_bulk(env, TransportKind::Tcp, ChannelKind::MultiLane)
});

// Nested calls made by a handler inherit its request's priority.
worker_test!(handlers_run_and_call_at_their_requests_priority, 2, |env| {
    let mut registry = registry();
    registry
        .handler("my_priority", |_, (): ()| Ok(sluice_agent::priority::current().level()))
        .handler("nested_priority", |ctx: &CallContext, (): ()| {
            Ok(ctx.agent.call::<_, i8>(&ctx.caller, "my_priority", &())?)
        });
    let agent = env.agent(registry);
    if env.rank == 0 {
        for level in [-8i8, 0, 4, 7] {
            let at = agent.with_priority(Priority::new(level).unwrap());
            assert_eq!(at.call::<_, i8>(1u32, "my_priority", &()).unwrap(), level);
            assert_eq!(at.call::<_, i8>(1u32, "nested_priority", &()).unwrap(), level);
            // The scoped form covers every call form, RRefs included.
            let via_scope = sluice_agent::with_priority(Priority::new(level).unwrap(), || {
                let r = agent
                    .remote::<i8>(1u32, "my_priority", Payload::encode(&()).unwrap())
                    .unwrap();
                r.to_here().unwrap()
            });
            assert_eq!(via_scope, level);
        }
        assert_eq!(agent.call::<_, i8>(1u32, "my_priority", &()).unwrap(), 0);
    }
    agent.shutdown().unwrap();
});

/// A peer sending a priority outside -8..=7 gets a typed rejection, and the pipe goes on.
#[test]
fn an_out_of_range_priority_is_rejected_with_a_typed_error() {
    use sluice_agent::wire::{self, Body, Envelope, Request, Response, WireError};
    use sluice_channel::{Context, ContextOptions, Message};
    let agent = Agent::init(sluice_tests::workers::solo_options("target"), registry()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let message = |e: &Envelope| Message {
        metadata: wire::encode(e),
        ..Message::default()
    };
    let request = |id: u64, priority: i8| {
        message(&Envelope::Request(Request {
            id,
            priority,
            body: Body::Call { handler: "echo".into() },
            value: Default::default(),
        }))
    };
    rt.block_on(sluice_tests::watchdog("the rejection", async {
        let pipe = Context::new(ContextOptions::default())
            .unwrap()
            .connect(agent.address())
            .await
            .unwrap();
        pipe.write(&message(&Envelope::Hello {
            rank: 0,
            version: wire::AGENT_VERSION,
            heartbeat_ms: 0,
        }))
        .await
        .unwrap();
        let read = || async {
            let d = pipe.read_descriptor().await.unwrap();
            let a = sluice_channel::Allocation {
                payloads: d
                    .payload_lengths
                    .iter()
                    .map(|&l| bytes::BytesMut::zeroed(l as usize))
                    .collect(),
                tensors: Vec::new(),
            };
            pipe.read(a).await.map_err(|e| e.error).unwrap();
            match wire::decode(&d.metadata).unwrap() {
                Envelope::Response(r) => r,
                other => panic!("expected a response, got {other:?}"),
            }
        };
        for (id, level) in [(1, 8i8), (2, -9), (3, i8::MAX), (4, i8::MIN)] {
            pipe.write(&request(id, level)).await.unwrap();
            let Response { id: got, result } = read().await;
            assert_eq!(got, id);
            match result {
                Err(WireError::Rejected(why)) => assert!(why.contains("out of range"), "{why}"),
                other => panic!("priority {level}: expected a rejection, got {other:?}"),
            }
        }
        // The pipe still serves valid requests.
        pipe.write(&request(5, 7)).await.unwrap();
        let Response { id, result } = read().await;
        assert!(id == 5 && result.is_ok(), "{result:?}");
    }));
    agent.shutdown().unwrap();
}

// Calls started from plain threads return at once even when their writes cannot finish yet:
// one thread keeps four 64 MiB tensors in flight while another makes small calls on the same
// pipe; everything completes, byte for byte.
worker_test!(bulk_calls_in_flight_from_plain_threads_complete, 2, |env| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let bulk = 64 << 20;
        let streamer = {
            let agent = agent.clone();
            std::thread::spawn(move || {
                let mut window = std::collections::VecDeque::new();
                let start = Instant::now();
                let mut seq = 0u64;
                while start.elapsed() < Duration::from_millis(1500) {
                    while window.len() < 4 {
                        seq += 1;
                        let t = Tensor::cpu(Bytes::from(pattern(seq, bulk)));
                        let f = agent.rpc_async(1u32, "echo", Payload::empty().with_tensors(vec![t]));
                        window.push_back((seq, f));
                    }
                    let (seq, f) = window.pop_front().unwrap();
                    let mut reply = f.wait_timeout(WATCHDOG).expect("watchdog: bulk call").unwrap();
                    let t = reply.take_tensors();
                    assert_eq!(t[0].buffer.as_cpu().unwrap().as_ref(), pattern(seq, bulk).as_slice());
                }
                for (_, f) in window {
                    f.wait_timeout(WATCHDOG).expect("watchdog: bulk call").unwrap();
                }
                seq
            })
        };
        let mut small = 0u64;
        while !streamer.is_finished() {
            let t = Tensor::cpu(Bytes::from(pattern(small, 64)));
            let mut reply = agent
                .rpc_async(1u32, "echo", Payload::empty().with_tensors(vec![t]))
                .wait_timeout(WATCHDOG)
                .expect("watchdog: small call")
                .unwrap();
            assert_eq!(
                reply.take_tensors()[0].buffer.as_cpu().unwrap().as_ref(),
                pattern(small, 64).as_slice()
            );
            small += 1;
            std::thread::sleep(Duration::from_millis(1));
        }
        let sent = streamer.join().unwrap();
        assert!(sent >= 4 && small > 0);
    }
    agent.shutdown().unwrap();
});

/// Many small calls in flight from a plain thread (the bench's rpc_async-64 loop) for a
/// while, over `transport`: every one completes.
fn small_calls_in_flight(env: WorkerEnv, transport: TransportKind) {
    let mut options = env.options();
    options.pipe.transports = vec![transport];
    let agent = Agent::init(options, registry()).unwrap();
    if env.rank == 0 {
        let empty = Payload::encode(&()).unwrap();
        // As the bench does: one call at a time first (sync, then async handler).
        for handler in ["noop", "noop_async"] {
            let start = Instant::now();
            while start.elapsed() < Duration::from_millis(900) {
                agent.rpc_sync(1u32, handler, empty.clone()).unwrap();
            }
        }
        let mut window = std::collections::VecDeque::new();
        let start = Instant::now();
        let mut done = 0u64;
        while start.elapsed() < Duration::from_secs(3) {
            while window.len() < 64 {
                window.push_back(agent.rpc_async(1u32, "noop", empty.clone()));
            }
            window
                .pop_front()
                .unwrap()
                .wait_timeout(WATCHDOG)
                .expect("watchdog: a call in flight never completed")
                .unwrap();
            done += 1;
        }
        for f in window {
            f.wait_timeout(WATCHDOG).expect("watchdog").unwrap();
        }
        assert!(done > 0);
    }
    agent.shutdown().unwrap();
}

worker_test!(small_calls_in_flight_from_a_plain_thread_complete_on_shm, 2, |env| {
    small_calls_in_flight(env, TransportKind::Shm)
});

// These two caught a lost read role (a waiter that left as the role was handed to it; see
// `reader::promote`): 1 run in 7 to 15 failed before the fix, 0 in 30 after.
worker_test!(small_calls_in_flight_from_a_plain_thread_complete_on_tcp, 2, |env| {
    small_calls_in_flight(env, TransportKind::Tcp)
});

/// A peer that dies fails the calls pending on both of its pipes, normal and express, and
/// later calls at any priority, each naming it.
#[test]
fn peer_death_fails_calls_on_both_pipes() {
    sluice_tests::workers::run_workers_with(
        "peer_death_fails_calls_on_both_pipes",
        2,
        |rank| if rank == 1 { Ending::Killed } else { Ending::Success },
        |env| {
            let agent = env.agent(registry());
            if env.rank == 1 {
                agent.barrier("ready").unwrap();
                std::thread::sleep(Duration::from_millis(300));
                nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).unwrap();
                unreachable!();
            }
            let normal = agent.call_async(1u32, "hold", &());
            let urgent = agent.with_priority(Priority::HIGH).call_async(1u32, "hold", &());
            agent.barrier("ready").unwrap();
            for (lane, pending) in [("normal", normal), ("express", urgent)] {
                let e = pending
                    .wait_timeout(WATCHDOG)
                    .expect("watchdog: a call pending on a dead peer never failed")
                    .unwrap_err();
                assert!(e.is_peer_lost() && e.to_string().contains("worker1"), "{lane}: {e}");
            }
            for p in [Priority::LOW, Priority::HIGH] {
                let e = agent.with_priority(p).call::<_, ()>(1u32, "hold", &()).unwrap_err();
                assert!(e.is_peer_lost() && e.to_string().contains("worker1"), "{p}: {e}");
            }
            agent.shutdown_now();
        },
    );
}
