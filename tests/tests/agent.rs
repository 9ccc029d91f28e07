//! The RPC agent across real processes: each test body runs on N worker processes started by
//! the fixture in `sluice_tests::workers`, rendezvousing through the store on rank 0 with the
//! torchrun environment variables.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sluice_agent::{
    Agent, AgentOptions, CallContext, Device, HandlerError, InitError, Payload, RRef, Registry, RpcError,
    ShutdownError, Tensor,
};
use sluice_tests::workers::{run_workers_with, Ending, WorkerEnv};
use sluice_tests::{pattern, worker_test};

#[derive(Debug, Serialize, Deserialize)]
struct Counter {
    value: AtomicI64,
}

/// Tests that start an agent in the test process itself take turns: one agent per process.
static IN_PROCESS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A counter on rank 0 that survivors use as a barrier when a worker is dead.
static ARRIVED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Opened by the `open` handler; the `gate` handler can wait for it.
static GATE_OPEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.handler("add", |_, (a, b): (i64, i64)| Ok(a + b))
        .handler("whoami", |ctx: &CallContext, (): ()| Ok(ctx.agent.info().name.clone()))
        .handler("fail", |_, msg: String| -> Result<(), _> {
            Err(HandlerError::new("ValueError", msg))
        })
        .handler("sleep_ms", |ctx: &CallContext, ms: u64| {
            std::thread::sleep(Duration::from_millis(ms));
            Ok(ctx.agent.info().id)
        })
        .raw_handler("echo", |_, payload| Ok(payload))
        // Nested: bounces back to the caller until depth reaches zero.
        .handler("bounce", |ctx: &CallContext, depth: u32| {
            if depth == 0 {
                return Ok(0u32);
            }
            let n: u32 = ctx.agent.call(&ctx.caller, "bounce", &(depth - 1))?;
            Ok(n + 1)
        })
        .async_handler("relay", |ctx: CallContext, (target, ms): (String, u64)| async move {
            let reply = ctx.agent.call_async(target.as_str(), "sleep_ms", &ms).await?;
            Ok(reply.decode::<u32>()?)
        })
        .handler("make_counter", |_, start: i64| {
            Ok(Counter {
                value: AtomicI64::new(start),
            })
        })
        .handler("own_counter", |ctx: &CallContext, start: i64| {
            Ok(ctx.agent.rref(Counter {
                value: AtomicI64::new(start),
            }))
        })
        .handler("read_rref", |_, r: RRef<Counter>| {
            Ok(r.to_here()?.value.load(Ordering::SeqCst))
        })
        // What a handler sees of a user reference it was passed: confirmed by its owner?
        .handler("rref_confirmed", |_, r: RRef<Counter>| Ok(r.confirmed_by_owner()))
        .async_handler("rref_confirmed_async", |_, r: RRef<Counter>| async move {
            Ok(r.confirmed_by_owner())
        })
        .handler(
            "forward_rref",
            |ctx: &CallContext, (mut chain, r): (Vec<String>, RRef<Counter>)| {
                if chain.is_empty() {
                    return Ok(r.to_here()?.value.load(Ordering::SeqCst));
                }
                let next = chain.remove(0);
                Ok(ctx.agent.call::<_, i64>(next.as_str(), "forward_rref", &(chain, r))?)
            },
        )
        .handler("owned", |ctx: &CallContext, (): ()| Ok(ctx.agent.owned_rrefs() as u64))
        .handler("arrive", |_, add: u32| {
            Ok(ARRIVED.fetch_add(add, Ordering::SeqCst) + add)
        })
        // Quick unless asked to wait for `open`: a quick run lets the next one run inline on
        // the thread that read it, and then that one blocks.
        .handler("gate", |_, wait: bool| {
            if wait {
                sluice_agent::pool::blocking(|| {
                    while !GATE_OPEN.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                });
            }
            Ok(wait)
        })
        .handler("open", |_, (): ()| {
            GATE_OPEN.store(true, Ordering::SeqCst);
            Ok(())
        })
        .method("counter_add", |_, c: &Counter, d: i64| {
            Ok(c.value.fetch_add(d, Ordering::SeqCst) + d)
        })
        .method("counter_fail", |_, _c: &Counter, msg: String| -> Result<i64, _> {
            Err(HandlerError::new("ValueError", msg))
        })
        .method("counter_read_after", |_, c: &Counter, ms: u64| {
            std::thread::sleep(Duration::from_millis(ms));
            Ok(c.value.load(Ordering::SeqCst))
        });
    r
}

fn name(rank: u32) -> String {
    WorkerEnv::name(rank)
}

/// Polls `f` until it holds; the fixture's watchdog turns a hang into a failure.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(60), "never happened: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

worker_test!(calls_by_name_rank_and_info, 4, |env| {
    let agent = env.agent(registry());
    let me = env.rank as i64;
    for peer in 0..env.world_size {
        let by_name: i64 = agent.call(name(peer).as_str(), "add", &(me, 100)).unwrap();
        let by_rank: i64 = agent.call(peer, "add", &(me, 200)).unwrap();
        let info = agent.worker(peer).unwrap();
        let by_info: String = agent.call(&info, "whoami", &()).unwrap();
        assert_eq!((by_name, by_rank, by_info), (me + 100, me + 200, name(peer)));
    }
    // Many calls in flight to everyone at once.
    let futures: Vec<_> = (0..200)
        .map(|i| (i, agent.call_async(i % env.world_size, "add", &(i as i64, 1i64))))
        .collect();
    for (i, f) in futures {
        assert_eq!(f.wait().unwrap().decode::<i64>().unwrap(), i as i64 + 1);
    }
    agent.shutdown().unwrap();
});

worker_test!(errors_reach_the_caller_and_the_agent_keeps_serving, 2, |env| {
    let agent = env.agent(registry());
    let peer = 1 - env.rank;
    // Invalid destinations.
    let e = agent.call::<_, i64>("nobody", "add", &(1i64, 2i64)).unwrap_err();
    assert!(
        matches!(&e, RpcError::UnknownWorker { dest, .. } if dest.contains("nobody")),
        "{e}"
    );
    let e = agent.call::<_, i64>(7u32, "add", &(1i64, 2i64)).unwrap_err();
    assert!(matches!(e, RpcError::UnknownWorker { .. }), "{e}");
    // Unknown handler.
    let e = agent.call::<_, i64>(peer, "no_such", &()).unwrap_err();
    assert!(
        matches!(&e, RpcError::UnknownHandler { handler, worker } if handler == "no_such" && *worker == name(peer))
    );
    // A handler error keeps its kind and message, every time the future is awaited.
    let f = agent.call_async(peer, "fail", &"bad input".to_owned());
    for _ in 0..3 {
        match f.wait() {
            Err(RpcError::Remote { worker, kind, message }) => {
                assert_eq!(
                    (worker.as_str(), kind.as_str(), message.as_str()),
                    (name(peer).as_str(), "ValueError", "bad input")
                );
            }
            other => panic!("expected the handler's error, got {other:?}"),
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    assert!(matches!(rt.block_on(f.clone()), Err(RpcError::Remote { .. })));
    // An argument that does not decode as the handler's type: the handler reports it.
    let e = agent.call::<_, i64>(peer, "add", &()).unwrap_err();
    assert!(
        matches!(&e, RpcError::Remote { kind, .. } if kind == "DecodeError"),
        "{e}"
    );
    // Still serving.
    assert_eq!(agent.call::<_, i64>(peer, "add", &(2i64, 2i64)).unwrap(), 4);
    agent.shutdown().unwrap();
    // Any call after shutdown errors.
    assert!(matches!(
        agent.call::<_, i64>(peer, "add", &(1i64, 1i64)),
        Err(RpcError::Shutdown)
    ));
    assert!(matches!(agent.shutdown(), Err(ShutdownError::AlreadyShutDown)));
});

// An unknown handler and a handler's own typed error fail the same way through every call
// form: `call`, `call_async`, `remote` then `to_here`, and an RRef's proxies (`rpc_sync`,
// `rpc_async`, `remote` then `to_here`).
// Calls made from tasks of every kind of runtime, with a tensor large enough (16 MiB) that the
// sender's copy into the peer's segment is offloaded: the caller starts the write itself where
// it may block (a plain thread, a multi-thread runtime's task) and hands it to the agent's
// runtime where it may not (a current-thread runtime's task, a `LocalSet`).
worker_test!(large_tensors_from_tasks_of_any_runtime, 2, |env| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let big = Payload::empty().with_tensors(vec![Tensor::cpu(bytes::Bytes::from(vec![7u8; 16 << 20]))]);
        let echo = |reply: Payload| reply.tensors[0].buffer.as_cpu().map(|b| (b.len(), b[b.len() - 1]));
        // The lane's pipe is open before the calls below (their write starts inline).
        assert_eq!(
            echo(agent.rpc_sync(1u32, "echo", big.clone()).unwrap()),
            Some((16 << 20, 7))
        );
        let single = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let got = single
            .block_on(async { agent.rpc_async(1u32, "echo", big.clone()).await })
            .unwrap();
        assert_eq!(echo(got), Some((16 << 20, 7)), "current-thread runtime");
        let local = tokio::task::LocalSet::new();
        let got = local
            .block_on(&single, async {
                tokio::task::spawn_local(agent.rpc_async(1u32, "echo", big.clone()))
                    .await
                    .unwrap()
            })
            .unwrap();
        assert_eq!(echo(got), Some((16 << 20, 7)), "LocalSet");
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let got = multi
            .block_on(async {
                let agent = agent.clone();
                let big = big.clone();
                tokio::spawn(async move { agent.rpc_async(1u32, "echo", big).await })
                    .await
                    .unwrap()
            })
            .unwrap();
        assert_eq!(echo(got), Some((16 << 20, 7)), "multi-thread runtime");
    }
    agent.shutdown().unwrap();
});

worker_test!(every_call_form_gives_the_same_typed_error, 2, |env| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let unknown = |e: RpcError, form: &str| {
            assert!(
                matches!(&e, RpcError::UnknownHandler { handler, worker } if handler == "no_such" && worker == "worker1"),
                "{form}: {e:?}"
            );
        };
        let value_error = |e: RpcError, form: &str| {
            assert!(
                matches!(&e, RpcError::Remote { kind, message, worker } if kind == "ValueError" && message == "bad" && worker == "worker1"),
                "{form}: {e:?}"
            );
        };
        let arg = Payload::encode(&"bad".to_owned()).unwrap();
        unknown(agent.call::<_, i64>(1u32, "no_such", &()).unwrap_err(), "call");
        unknown(agent.call_async(1u32, "no_such", &()).wait().unwrap_err(), "call_async");
        let r: RRef<i64> = agent.remote(1u32, "no_such", Payload::empty()).unwrap();
        unknown(r.to_here().unwrap_err(), "remote + to_here");
        value_error(
            agent.call::<_, ()>(1u32, "fail", &"bad".to_owned()).unwrap_err(),
            "call",
        );
        value_error(
            agent.call_async(1u32, "fail", &"bad".to_owned()).wait().unwrap_err(),
            "call_async",
        );
        let r: RRef<()> = agent.remote(1u32, "fail", arg).unwrap();
        value_error(r.to_here().unwrap_err(), "remote + to_here");
        // The proxies of a reference to a value on worker1.
        let c: RRef<Counter> = agent
            .remote(1u32, "make_counter", Payload::encode(&0i64).unwrap())
            .unwrap();
        unknown(c.rpc_sync::<_, i64>("no_such", &()).unwrap_err(), "proxy rpc_sync");
        unknown(c.rpc_async("no_such", &()).wait().unwrap_err(), "proxy rpc_async");
        let p: RRef<i64> = c.remote("no_such", &()).unwrap();
        unknown(p.to_here().unwrap_err(), "proxy remote + to_here");
        value_error(
            c.rpc_sync::<_, i64>("counter_fail", &"bad".to_owned()).unwrap_err(),
            "proxy rpc_sync",
        );
        value_error(
            c.rpc_async("counter_fail", &"bad".to_owned()).wait().unwrap_err(),
            "proxy rpc_async",
        );
        let p: RRef<i64> = c.remote("counter_fail", &"bad".to_owned()).unwrap();
        value_error(p.to_here().unwrap_err(), "proxy remote + to_here");
        // A method called on a reference whose creation failed fails with that error.
        let broken: RRef<Counter> = agent.remote(1u32, "no_such", Payload::empty()).unwrap();
        unknown(
            broken.rpc_sync::<_, i64>("counter_add", &1i64).unwrap_err(),
            "proxy on a failed reference",
        );
        let p: RRef<i64> = broken.remote("counter_add", &1i64).unwrap();
        unknown(p.to_here().unwrap_err(), "proxy remote on a failed reference");
    }
    agent.shutdown().unwrap();
});

worker_test!(calls_to_self_and_tensors_without_copies, 2, |env| {
    let mut options = env.options();
    options.connect = sluice_agent::Connect::Eager;
    let agent = Agent::init(options, registry()).unwrap();
    // Eager: the pipes exist before the first call.
    assert!(agent.pipe_info(1 - env.rank).is_some());
    let me = env.rank;
    assert_eq!(agent.call::<_, i64>(me, "add", &(20i64, 22i64)).unwrap(), 42);
    assert_eq!(agent.call::<_, String>(me, "whoami", &()).unwrap(), name(me));
    for (i, size) in [0usize, 1, 4096, 1 << 20, 24 << 20].into_iter().enumerate() {
        let a = Bytes::from(pattern(i as u64, size));
        let b = Bytes::from(pattern(100 + i as u64, size / 2));
        let payload = Payload::encode(&("meta", size))
            .unwrap()
            .with_tensors(vec![Tensor::cpu(a.clone()), Tensor::cpu(b.clone())]);
        for dest in [1 - me, me] {
            let reply = agent.rpc_sync(dest, "echo", payload.clone()).unwrap();
            assert_eq!(reply.decode::<(String, usize)>().unwrap(), ("meta".to_owned(), size));
            assert_eq!(reply.tensors.len(), 2);
            assert_eq!(
                reply.tensors[0].buffer.as_cpu().unwrap(),
                &a,
                "tensor 0 of {size} bytes via {dest}"
            );
            assert_eq!(reply.tensors[1].buffer.as_cpu().unwrap(), &b);
        }
    }
    agent.shutdown().unwrap();
});

worker_test!(nested_calls_never_deadlock_with_a_pool_of_one, 2, |env| {
    let mut options = env.options();
    options.pool_threads = 1;
    let agent = Agent::init(options, registry()).unwrap();
    let peer = 1 - env.rank;
    // Both workers bounce calls back and forth at once, 8 levels deep, from 8 threads each.
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                let n: u32 = agent.call(peer, "bounce", &8u32).unwrap();
                assert_eq!(n, 8);
            });
        }
    });
    agent.shutdown().unwrap();
});

worker_test!(threads_and_tasks_share_a_pipe_and_each_reply_arrives_once, 2, |env| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        // Threads that read their own replies (leaders and followers of one pipe's read role),
        // tasks that await theirs (the background reader), and waits that give up, all on the
        // same pipe at once: every call gets its own reply, exactly once.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        std::thread::scope(|s| {
            for t in 0..6i64 {
                let agent = &agent;
                s.spawn(move || {
                    for i in 0..300i64 {
                        if i % 3 == 0 {
                            let futures: Vec<_> = (0..4i64)
                                .map(|k| agent.call_async(1u32, "add", &(i * 10 + k, t)))
                                .collect();
                            for (k, f) in futures.into_iter().enumerate().rev() {
                                let got = f.wait().unwrap().decode::<i64>().unwrap();
                                assert_eq!(got, i * 10 + k as i64 + t);
                            }
                        } else {
                            assert_eq!(agent.call::<_, i64>(1u32, "add", &(i, t)).unwrap(), i + t);
                        }
                    }
                });
            }
            s.spawn(|| {
                runtime.block_on(async {
                    let tasks: Vec<_> = (0..32i64)
                        .map(|t| {
                            let agent = agent.clone();
                            tokio::spawn(async move {
                                for i in 0..100i64 {
                                    let r = agent.call_async(1u32, "add", &(i, 1000 + t)).await.unwrap();
                                    assert_eq!(r.decode::<i64>().unwrap(), i + 1000 + t);
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.unwrap();
                    }
                })
            });
            s.spawn(|| {
                for _ in 0..5 {
                    let f = agent.call_async(1u32, "sleep_ms", &30u64);
                    // Gives up while reading for everyone; the reply still completes the call.
                    assert!(f.wait_timeout(Duration::from_millis(5)).is_none());
                    assert_eq!(f.wait().unwrap().decode::<u32>().unwrap(), 1);
                }
            });
        });
    }
    agent.shutdown().unwrap();
});

worker_test!(an_inline_handler_that_blocks_hands_its_pipe_on, 2, |env| {
    let mut options = env.options();
    options.io_threads = 1;
    options.pool_threads = 1;
    let agent = Agent::init(options, registry()).unwrap();
    if env.rank == 0 {
        // Quick runs: `gate` then runs inline on the thread that reads the pipe.
        for _ in 0..10 {
            assert!(!agent.call::<_, bool>(1u32, "gate", &false).unwrap());
        }
        // This one blocks until `open` arrives on the same pipe from the same caller, which
        // only a new reader can read: the blocked handler must have handed the pipe on.
        let blocked = agent.call_async(1u32, "gate", &true);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!blocked.is_done());
        agent.call::<_, ()>(1u32, "open", &()).unwrap();
        assert!(blocked.wait().unwrap().decode::<bool>().unwrap());
        // And the pipe goes on serving.
        assert_eq!(agent.call::<_, i64>(1u32, "add", &(2i64, 3i64)).unwrap(), 5);
    }
    agent.shutdown().unwrap();
});

worker_test!(async_handlers_release_their_thread, 3, |env| {
    let mut options = env.options();
    options.pool_threads = 1;
    options.io_threads = 1;
    let agent = Agent::init(options, registry()).unwrap();
    if env.rank == 0 {
        // 100 relays in flight through worker1 to worker2, each waiting 50 ms there: they can
        // only all finish if the relays hold no thread while they wait.
        let futures: Vec<_> = (0..100)
            .map(|_| agent.call_async(1u32, "relay", &(name(2), 50u64)))
            .collect();
        for f in futures {
            assert_eq!(f.wait().unwrap().decode::<u32>().unwrap(), 2);
        }
    }
    agent.shutdown().unwrap();
});

worker_test!(timeouts_name_the_peer_and_drop_late_replies, 2, |env| {
    let mut options = env.options();
    options.default_timeout = Duration::from_millis(200);
    let agent = Agent::init(options, registry()).unwrap();
    if env.rank == 0 {
        let e = agent
            .rpc_sync_timeout(
                1u32,
                "sleep_ms",
                Payload::encode(&400u64).unwrap(),
                Duration::from_millis(50),
            )
            .unwrap_err();
        match &e {
            RpcError::Timeout { worker, timeout } => {
                assert_eq!((worker.as_str(), *timeout), ("worker1", Duration::from_millis(50)));
                assert!(
                    e.to_string().contains("worker1") && e.to_string().contains("50ms"),
                    "{e}"
                );
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
        // The default timeout applies when none is given.
        let e = agent.call::<_, u32>(1u32, "sleep_ms", &400u64).unwrap_err();
        assert!(matches!(e, RpcError::Timeout { timeout, .. } if timeout == Duration::from_millis(200)));
        // Zero means no timeout.
        let r = agent.rpc_sync_timeout(1u32, "sleep_ms", Payload::encode(&300u64).unwrap(), Duration::ZERO);
        assert_eq!(r.unwrap().decode::<u32>().unwrap(), 1);
        // The late replies of the timed-out calls went nowhere: later calls get their own.
        std::thread::sleep(Duration::from_millis(500));
        for i in 0..20i64 {
            assert_eq!(agent.call::<_, i64>(1u32, "add", &(i, 0i64)).unwrap(), i);
        }
    }
    agent.shutdown().unwrap();
});

worker_test!(rrefs_remote_to_here_local_value_and_proxies, 3, |env| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let r: RRef<Counter> = agent
            .remote(1u32, "make_counter", Payload::encode(&5i64).unwrap())
            .unwrap();
        assert_eq!(r.owner().name, "worker1");
        assert!(!r.is_owner());
        assert_eq!(r.to_here().unwrap().value.load(Ordering::SeqCst), 5);
        // local_value on a user names the owner.
        let e = r.local_value().unwrap_err();
        assert!(
            matches!(&e, RpcError::NotOwner { owner, .. } if owner.contains("worker1")),
            "{e}"
        );
        // Proxy: a method runs on the owner's value.
        assert_eq!(r.rpc_sync::<_, i64>("counter_add", &10i64).unwrap(), 15);
        assert_eq!(r.to_here().unwrap().value.load(Ordering::SeqCst), 15);
        // Proxy, remote form: the result stays on the value's owner, as a new reference.
        let added: RRef<i64> = r.remote("counter_add", &1i64).unwrap();
        assert_eq!(added.owner().name, "worker1");
        assert_eq!(added.to_here().unwrap(), 16);
        assert_eq!(r.rpc_sync::<_, i64>("counter_add", &-1i64).unwrap(), 15);
        // Per-call timeouts on every proxy form.
        let e = r
            .rpc_sync_timeout::<_, i64>("counter_read_after", &400u64, Duration::from_millis(20))
            .unwrap_err();
        assert!(matches!(&e, RpcError::Timeout { .. }), "{e}");
        let late: RRef<i64> = r
            .remote_timeout("counter_read_after", &400u64, Duration::from_millis(20))
            .unwrap();
        let e = late.created().wait().unwrap_err();
        assert!(
            matches!(&e, RpcError::Timeout { .. }),
            "a remote whose creation timed out: {e}"
        );
        let e = late.to_here().unwrap_err();
        assert!(
            e.to_string().contains("timed out"),
            "to_here after the creation timed out: {e}"
        );
        let in_time = r.rpc_async_timeout("counter_read_after", &1u64, Duration::from_secs(30));
        assert_eq!(in_time.wait().unwrap().decode::<i64>().unwrap(), 15);
        // A reference's creation as a future: done once the owner has the value, or failed.
        r.created().wait().expect("created");
        let never: RRef<i64> = agent.remote(1u32, "no_such_handler", Payload::empty()).unwrap();
        assert!(never.created().wait().is_err());
        // wait_all: every payload in order, or the first error.
        let sums = sluice_agent::wait_all((0..4i64).map(|i| agent.call_async(1u32, "add", &(i, 1i64)))).unwrap();
        let sums: Vec<i64> = sums.iter().map(|p| p.decode().unwrap()).collect();
        assert_eq!(sums, vec![1, 2, 3, 4]);
        let e = sluice_agent::wait_all(vec![
            agent.call_async(1u32, "add", &(1i64, 1i64)),
            agent.call_async(1u32, "fail", &"first".to_owned()),
            agent.call_async(1u32, "fail", &"second".to_owned()),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("first"), "{e}");
        // The default timeout changes for calls started afterwards.
        let before = agent.call_async(1u32, "sleep_ms", &300u64);
        agent.set_default_timeout(Duration::from_millis(20));
        assert_eq!(agent.default_timeout(), Duration::from_millis(20));
        let e = agent.call::<_, u32>(1u32, "sleep_ms", &300u64).unwrap_err();
        assert!(matches!(&e, RpcError::Timeout { .. }), "{e}");
        agent.set_default_timeout(Duration::from_secs(60));
        before.wait().expect("a call sent before the change keeps its deadline");
        // Passed as an argument to a third worker, which fetches it from the owner.
        assert_eq!(agent.call::<_, i64>(2u32, "read_rref", &r).unwrap(), 15);
        // A handler given a user reference runs only once the owner confirmed it (sync and
        // async handlers, repeated: the owner's answer races the call).
        for _ in 0..20 {
            assert!(agent.call::<_, bool>(2u32, "rref_confirmed", &r).unwrap());
            assert!(agent.call::<_, bool>(2u32, "rref_confirmed_async", &r).unwrap());
        }
        // Passed to its owner.
        assert_eq!(agent.call::<_, i64>(1u32, "read_rref", &r).unwrap(), 15);
        // Returned from a call: worker2 owns a counter and hands back a reference.
        let mine: RRef<Counter> = agent.call(2u32, "own_counter", &7i64).unwrap();
        assert_eq!(mine.owner().name, "worker2");
        assert_eq!(mine.to_here().unwrap().value.load(Ordering::SeqCst), 7);
        // Forwarded through a chain of calls: 0 -> 1 -> 2 -> 1 -> 2 -> to_here.
        let chain = vec![name(2), name(1), name(2)];
        assert_eq!(
            agent
                .call::<_, i64>(1u32, "forward_rref", &(chain, mine.clone()))
                .unwrap(),
            7
        );
        // A creation that fails surfaces on use.
        let bad: RRef<Counter> = agent
            .remote(1u32, "fail", Payload::encode(&"no".to_owned()).unwrap())
            .unwrap();
        let e = bad.to_here().unwrap_err();
        assert!(e.to_string().contains("no"), "{e}");
        // A remote to self gives an owner reference.
        let local: RRef<Counter> = agent
            .remote(0u32, "make_counter", Payload::encode(&3i64).unwrap())
            .unwrap();
        assert!(local.is_owner());
        assert_eq!(local.to_here().unwrap().value.load(Ordering::SeqCst), 3);
        assert_eq!(local.local_value().unwrap().value.load(Ordering::SeqCst), 3);
        let owned_here: RRef<Counter> = agent.rref(Counter {
            value: AtomicI64::new(1),
        });
        assert_eq!(agent.call::<_, i64>(2u32, "read_rref", &owned_here).unwrap(), 1);
    }
    agent.barrier("used").unwrap();
    // Every reference is dropped now: each owner frees its values.
    eventually("owners freed every value", || agent.owned_rrefs() == 0);
    agent.barrier("freed").unwrap();
    agent.shutdown().unwrap();
});

/// Lost and duplicated control messages: the protocol retries and stays idempotent.
fn lossy_rref_body(env: WorkerEnv, duplicate: bool) {
    let mut options = env.options();
    options.faults.drop_control = 3;
    options.faults.duplicate_control = duplicate;
    options.control_retry = Duration::from_millis(100);
    let agent = Agent::init(options, registry()).unwrap();
    if env.rank == 0 {
        for i in 0..5i64 {
            let r: RRef<Counter> = agent
                .remote(1u32, "make_counter", Payload::encode(&i).unwrap())
                .unwrap();
            assert_eq!(agent.call::<_, i64>(2u32, "read_rref", &r).unwrap(), i);
            assert_eq!(r.to_here().unwrap().value.load(Ordering::SeqCst), i);
        }
    }
    agent.barrier("used").unwrap();
    eventually("owner freed every value despite lost control messages", || {
        agent.owned_rrefs() == 0
    });
    agent.barrier("freed").unwrap();
    agent.shutdown().unwrap();
}

worker_test!(rref_control_messages_are_retried_when_lost, 3, |env| lossy_rref_body(
    env, false
));
worker_test!(rref_control_messages_are_idempotent, 3, |env| lossy_rref_body(
    env, true
));

worker_test!(leaked_rrefs_fail_shutdown_only_with_leak_checking, 2, |env| {
    let mut options = env.options();
    options.leak_check = env.rank == 0;
    let agent = Agent::init(options, registry()).unwrap();
    let held: Option<RRef<Counter>> = (env.rank == 0).then(|| {
        agent
            .remote(1u32, "make_counter", Payload::encode(&1i64).unwrap())
            .unwrap()
    });
    if let Some(r) = &held {
        assert_eq!(r.to_here().unwrap().value.load(Ordering::SeqCst), 1);
    }
    let result = agent.shutdown();
    if env.rank == 0 {
        assert!(
            matches!(result, Err(ShutdownError::LeakedRRefs { count: 1, .. })),
            "{result:?}"
        );
    } else {
        result.unwrap();
    }
    drop(held);
});

worker_test!(graceful_shutdown_waits_for_the_whole_group, 3, |env| {
    let agent = env.agent(registry());
    match env.rank {
        // Rank 0 leaves at once; rank 1 still calls rank 2, which must not leave before it
        // answered, and rank 1 calls rank 0 after a while, which must still be there.
        0 => agent.shutdown().unwrap(),
        1 => {
            let slow = agent.call_async(2u32, "sleep_ms", &300u64);
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(agent.call::<_, i64>(0u32, "add", &(1i64, 1i64)).unwrap(), 2);
            assert_eq!(slow.wait().unwrap().decode::<u32>().unwrap(), 2);
            agent.shutdown().unwrap();
        }
        _ => agent.shutdown().unwrap(),
    }
});

worker_test!(graceful_shutdown_times_out_cleanly, 2, |env| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        // Rank 1 never joins the shutdown while it is busy.
        let e = agent.shutdown_timeout(Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, ShutdownError::Timeout { .. }), "{e}");
        assert!(matches!(
            agent.call::<_, i64>(1u32, "add", &(1i64, 1i64)),
            Err(RpcError::Shutdown)
        ));
    } else {
        std::thread::sleep(Duration::from_millis(1500));
        agent.shutdown_now();
    }
});

#[test]
fn peer_death_fails_pending_and_new_calls_and_survivors_go_on() {
    run_workers_with(
        "peer_death_fails_pending_and_new_calls_and_survivors_go_on",
        4,
        |rank| if rank == 3 { Ending::Killed } else { Ending::Success },
        |env| {
            let agent = env.agent(registry());
            if env.rank == 3 {
                agent.barrier("ready").unwrap();
                // Die while others wait on us.
                std::thread::sleep(Duration::from_millis(300));
                nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).unwrap();
                unreachable!();
            }
            // Every survivor has a call pending on worker3 when it dies.
            let pending = agent.call_async(3u32, "sleep_ms", &30_000u64);
            agent.barrier("ready").unwrap();
            let e = pending.wait().unwrap_err();
            assert!(e.is_peer_lost() && e.to_string().contains("worker3"), "{e}");
            let e = agent.call::<_, i64>(3u32, "add", &(1i64, 1i64)).unwrap_err();
            assert!(e.is_peer_lost() && e.to_string().contains("worker3"), "{e}");
            // The survivors keep working together.
            for peer in 0..3u32 {
                assert_eq!(
                    agent.call::<_, i64>(peer, "add", &(peer as i64, 1i64)).unwrap(),
                    peer as i64 + 1
                );
            }
            // The store-based barrier needs all four; the survivors meet on rank 0 instead.
            agent.call::<_, u32>(0u32, "arrive", &1u32).unwrap();
            loop {
                match agent.call::<_, u32>(0u32, "arrive", &0u32) {
                    Ok(n) if n < 3 => std::thread::sleep(Duration::from_millis(10)),
                    // Everyone arrived (or rank 0 saw that and left).
                    _ => break,
                }
            }
            agent.shutdown_now();
        },
    );
}

/// Both workers of a group with a duplicate name fail init with `DuplicateName`, promptly and
/// every time. The race this guards against (found 2026-11-23, about one formation in three):
/// the worker that read the whole group first failed, left, and took its ephemeral membership
/// key along before the slower one had read it; the slower one then waited for it until its
/// init timeout. Formation now waits on announcements that stay. Repeated, so a race shows.
#[test]
fn init_rejects_duplicate_names() {
    const TEST: &str = "init_rejects_duplicate_names";
    for _ in 0..if sluice_tests::workers::in_worker(TEST) { 1 } else { 50 } {
        sluice_tests::workers::run_workers(TEST, 2, |_env| {
            let e = Agent::init(AgentOptions::new("same"), registry()).unwrap_err();
            assert!(
                matches!(&e, InitError::DuplicateName { name, first: 0, second: 1 } if name == "same"),
                "{e}"
            );
        });
    }
}

worker_test!(init_rejects_bad_device_maps_everywhere, 2, |env| {
    // Rank 0 maps its CPU to a device rank 1 does not have: both workers refuse, naming it.
    let options = env.options().map_device("worker1", Device::Cpu, Device::Cuda(5));
    let e = Agent::init(options, registry()).unwrap_err();
    assert!(
        matches!(&e, InitError::UnknownDevice { device: Device::Cuda(5), owner, .. } if owner == "worker1"),
        "{e}"
    );
});

worker_test!(init_rejects_a_map_to_an_unknown_peer_everywhere, 2, |env| {
    let options = env.options().map_device("worker7", Device::Cpu, Device::Cpu);
    let e = Agent::init(options, registry()).unwrap_err();
    assert!(
        matches!(&e, InitError::UnknownPeer { worker, peer } if worker == "worker0" && peer == "worker7"),
        "{e}"
    );
});

worker_test!(device_maps_are_applied_and_checked, 2, |env| {
    let peer = name(1 - env.rank);
    let options = env.options().map_device(&peer, Device::Cpu, Device::Cpu);
    let agent = Agent::init(options, registry()).unwrap();
    let t = Bytes::from(pattern(1, 1000));
    let reply = agent
        .rpc_sync(
            peer.as_str(),
            "echo",
            Payload::empty().with_tensors(vec![Tensor::cpu(t.clone())]),
        )
        .unwrap();
    assert_eq!(reply.tensors[0].buffer.as_cpu().unwrap(), &t);
    // CPU tensors carry no events; waiting on them is a no-op.
    assert!(reply.events().is_empty());
    agent.shutdown().unwrap();
});

#[test]
fn offering_a_gpu_this_machine_lacks_fails_init() {
    let _turn = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    if !sluice_tests::gpu::without_driver_or_skip("offering_a_gpu_this_machine_lacks_fails_init") {
        return;
    }
    let mut options = AgentOptions::new("gpuless").rank(0, 1).store("127.0.0.1:1");
    options.devices = Some(vec![Device::Cpu, Device::Cuda(0)]);
    let e = Agent::init(options, Registry::new()).unwrap_err();
    assert!(
        matches!(
            &e,
            InitError::DeviceNotPresent {
                device: Device::Cuda(0),
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("cuda:0"), "{e}");
    // By default a worker offers what it has: the CPU alone here.
    assert_eq!(sluice_agent::gpu::local_devices(), vec![Device::Cpu]);
}

#[test]
fn init_checks_names_and_second_init_errors() {
    let _turn = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    // Single-process checks that need no group.
    for (bad, rule) in [("", "empty"), ("a b", "contains"), (&"x".repeat(129) as &str, "129")] {
        let e = Agent::init(AgentOptions::new(bad).rank(0, 1).store("127.0.0.1:1"), Registry::new()).unwrap_err();
        assert!(
            matches!(e, InitError::Name(_)) && e.to_string().contains(rule),
            "{bad:?}: {e}"
        );
    }
    let e = Agent::init(AgentOptions::new("w").rank(3, 2).store("127.0.0.1:1"), Registry::new()).unwrap_err();
    assert!(matches!(e, InitError::BadRank { rank: 3, world_size: 2 }), "{e}");
    let port = sluice_tests::workers::free_port();
    let store = format!("127.0.0.1:{port}");
    let agent = Agent::init(AgentOptions::new("solo").rank(0, 1).store(&store), registry()).unwrap();
    let e = Agent::init(AgentOptions::new("other").rank(0, 1).store(&store), Registry::new()).unwrap_err();
    assert!(matches!(e, InitError::AlreadyInitialized), "{e}");
    assert_eq!(agent.call::<_, i64>("solo", "add", &(1i64, 2i64)).unwrap(), 3);
    agent.shutdown().unwrap();
    // After shutdown a new agent may start.
    let again = Agent::init(sluice_tests::workers::solo_options("solo2"), registry()).unwrap();
    // Port 0: a group of one serves its store on a port of its own, and says which.
    assert!(!again.store_address().ends_with(":0"), "{}", again.store_address());
    again.shutdown().unwrap();
    // In a bigger group nobody could find that port: a configuration error, at once.
    let e = Agent::init(AgentOptions::new("w").rank(0, 2).store("127.0.0.1:0"), Registry::new()).unwrap_err();
    assert!(
        matches!(e, InitError::Config(_)) && e.to_string().contains("port 0"),
        "{e}"
    );
}

#[test]
fn hostile_pipes_are_closed_and_the_agent_keeps_serving() {
    let _turn = IN_PROCESS.lock().unwrap_or_else(|e| e.into_inner());
    use sluice_channel::{Context, ContextOptions, Message};
    let agent = Agent::init(sluice_tests::workers::solo_options("target"), registry()).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let garbage = [
        Bytes::from_static(b"\xff\xff\xff\xff"),
        Bytes::new(),
        // A well-formed hello from a rank that does not exist.
        Bytes::from(
            postcard::to_allocvec(&sluice_agent::wire::Envelope::Hello {
                rank: 99,
                version: sluice_agent::wire::AGENT_VERSION,
                heartbeat_ms: 0,
            })
            .unwrap(),
        ),
        // A request before any hello.
        Bytes::from(
            postcard::to_allocvec(&sluice_agent::wire::Envelope::Request(sluice_agent::wire::Request {
                id: 1,
                priority: 0,
                body: sluice_agent::wire::Body::Call { handler: "add".into() },
                value: Default::default(),
            }))
            .unwrap(),
        ),
    ];
    // A message asking for a device no channel of the pipe serves is refused by the sender's
    // own pipe, before anything travels (the agent's side refuses such a target too, see
    // `allocate`, should a peer's pipe not check).
    let connect = || async {
        Context::new(ContextOptions::default())
            .unwrap()
            .connect(agent.address())
            .await
            .unwrap()
    };
    rt.block_on(async {
        let pipe = connect().await;
        let mut tensor = Tensor::cpu(Bytes::from(vec![7u8; 64]));
        tensor.target_device = Some(Device::Cuda(7));
        let e = pipe
            .write(&Message {
                metadata: Bytes::from_static(b"x"),
                payloads: Vec::new(),
                tensors: vec![tensor],
            })
            .await
            .unwrap_err();
        assert!(e.to_string().contains("cuda:7"), "{e}");
    });
    for metadata in garbage {
        rt.block_on(async {
            let pipe = connect().await;
            pipe.write(&Message {
                metadata,
                ..Message::default()
            })
            .await
            .unwrap();
            // The agent closes the pipe instead of answering.
            let e = tokio::time::timeout(sluice_tests::WATCHDOG, pipe.read_descriptor())
                .await
                .expect("watchdog");
            assert!(e.is_err(), "the agent answered a hostile pipe");
        });
        assert_eq!(agent.call::<_, i64>(0u32, "add", &(1i64, 2i64)).unwrap(), 3);
    }
    agent.shutdown().unwrap();
}
