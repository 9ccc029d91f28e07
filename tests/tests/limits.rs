//! Only our own peers get in, and no peer can make a worker hold unbounded memory: the shared
//! secret (pipes and the store), the per-message limit, and the per-peer bytes-in-flight budget,
//! across real processes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use sluice_agent::{Agent, CallContext, Payload, Registry, RpcError, Tensor};
use sluice_channel::{Context, ContextOptions, Secret};
use sluice_tests::worker_test;
use sluice_tests::workers::WorkerEnv;

static RUNNING_BYTES: AtomicU64 = AtomicU64::new(0);
static MOST_BYTES: AtomicU64 = AtomicU64::new(0);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.handler("add", |_, (a, b): (i64, i64)| Ok(a + b))
        .raw_handler("hold", |_cx: &CallContext, payload: Payload| {
            // Records how many request bytes are being served at once.
            let n: u64 = payload.tensors.iter().map(|t| t.buffer.len() as u64).sum();
            let now = RUNNING_BYTES.fetch_add(n, Ordering::SeqCst) + n;
            MOST_BYTES.fetch_max(now, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(40));
            RUNNING_BYTES.fetch_sub(n, Ordering::SeqCst);
            Ok(Payload::empty())
        })
        .handler("most", |_, (): ()| Ok(MOST_BYTES.load(Ordering::SeqCst)));
    r
}

fn secret() -> Secret {
    Secret::new("correct horse battery staple").unwrap()
}

worker_test!(a_shared_secret_keeps_strangers_out, 2, |env: WorkerEnv| {
    let mut options = env.options();
    options.secret = Some(secret());
    let agent = Agent::init(options, registry()).unwrap();
    let peer = 1 - env.rank;
    assert_eq!(agent.call::<_, i64>(peer, "add", &(1i64, 2i64)).unwrap(), 3);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for stranger in [None, Secret::new("wrong")] {
        let options = ContextOptions {
            secret: stranger.clone(),
            setup_timeout: Duration::from_secs(5),
            ..ContextOptions::default()
        };
        let ctx = Context::new(options).unwrap();
        let e = rt.block_on(ctx.connect(agent.address())).unwrap_err();
        eprintln!("stranger with {stranger:?}: {e}");
        // And the store refuses it too.
        let store = std::env::var("MASTER_ADDR").unwrap() + ":" + &std::env::var("MASTER_PORT").unwrap();
        let c = rt.block_on(sluice_agent::store::StoreClient::connect_with(
            &store,
            Duration::from_secs(2),
            stranger,
        ));
        if let Ok(c) = c {
            assert!(rt.block_on(c.get("m/", Duration::from_millis(100))).is_err());
        }
    }
    // The group is unharmed.
    assert_eq!(agent.call::<_, i64>(peer, "add", &(2i64, 2i64)).unwrap(), 4);
    agent.barrier("done").unwrap();
    agent.shutdown().unwrap();
});

worker_test!(
    oversized_messages_close_the_pipe_and_the_rest_goes_on,
    2,
    |env: WorkerEnv| {
        let mut options = env.options();
        options.max_message_bytes = 1 << 20;
        options.max_in_flight_bytes = 1 << 20;
        let agent = Agent::init(options, registry()).unwrap();
        if env.rank == 0 {
            let big = Tensor::cpu(Bytes::from(vec![1u8; 2 << 20]));
            let e = agent
                .rpc_sync(1u32, "hold", Payload::empty().with_tensors(vec![big]))
                .unwrap_err();
            assert!(matches!(&e, RpcError::PeerLost { .. } | RpcError::Pipe { .. }), "{e}");
            // A fresh pipe carries normal calls again once the peer is back.
            let deadline = std::time::Instant::now() + sluice_tests::WATCHDOG;
            loop {
                match agent.call::<_, i64>(1u32, "add", &(1i64, 1i64)) {
                    Ok(v) => break assert_eq!(v, 2),
                    Err(e) if std::time::Instant::now() < deadline => {
                        eprintln!("(waiting for the reconnect: {e})");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        agent.barrier("done").unwrap();
        agent.shutdown().unwrap();
    }
);

worker_test!(bytes_in_flight_per_peer_are_bounded, 2, |env: WorkerEnv| {
    let mut options = env.options();
    options.pool_threads = 8;
    options.max_message_bytes = 1 << 20;
    options.max_in_flight_bytes = 1 << 20;
    let agent = Agent::init(options, registry()).unwrap();
    if env.rank == 0 {
        // 12 requests of 400 KiB at once: only two fit in the 1 MiB budget at a time.
        let futures: Vec<_> = (0..12)
            .map(|_| {
                let t = Tensor::cpu(Bytes::from(vec![7u8; 400 << 10]));
                agent.rpc_async(1u32, "hold", Payload::empty().with_tensors(vec![t]))
            })
            .collect();
        for f in futures {
            f.wait().unwrap();
        }
        let most: u64 = agent.call(1u32, "most", &()).unwrap();
        assert!(most > 0 && most <= 2 * (400 << 10), "{most} bytes were held at once");
        eprintln!("at most {most} request bytes held at once");
    }
    agent.barrier("done").unwrap();
    agent.shutdown().unwrap();
});
