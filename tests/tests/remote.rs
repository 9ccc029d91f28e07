//! Remote tensors across real processes: results equal the same ops run locally (forward and
//! backward), each flush point, graph caching, owner-to-owner moves, and an owner killed
//! while it runs a graph.

use std::time::{Duration, Instant};

use sluice_agent::{Agent, CallContext, Registry};
use sluice_autograd::dist::remote::{self, FLUSH_OPS};
use sluice_autograd::dist::{self, Context};
use sluice_autograd::{DType, DistributedOptimizer, Error, OptimizerKind, RemoteTensor, Tensor, UpdateMode};
use sluice_tests::worker_test;
use sluice_tests::workers::{run_workers_with, Ending, WorkerEnv};

fn registry() -> Registry {
    let mut r = Registry::new();
    dist::install(&mut r);
    r.handler("stats", |_cx: &CallContext, (): ()| {
        let s = remote::stats();
        Ok((s.graphs_run, s.fetches, s.bytes_fetched, s.flushes))
    });
    r
}

fn owner_stats(agent: &Agent, worker: u32) -> (u64, u64, u64, u64) {
    agent.call(worker, "stats", &()).unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect()
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-12 * (1.0 + x.abs()),
            "{what}[{i}]: remote {x} vs local {y}"
        );
    }
}

/// The model both ways: `loss = mean(tanh(x·W + b) * 2 - 1)^2`-ish, with a softmax branch.
macro_rules! model {
    ($x:expr, $w:expr, $b:expr) => {{
        let h = $x.matmul($w).unwrap().add($b).unwrap().tanh().unwrap();
        let s = h.softmax(-1).unwrap().mul_scalar(3.0).unwrap();
        h.mul_scalar(2.0)
            .unwrap()
            .add_scalar(-1.0)
            .unwrap()
            .mul(&s)
            .unwrap()
            .sum_dim(1, false)
            .unwrap()
            .exp()
            .unwrap()
            .mean()
            .unwrap()
    }};
}

fn model_local(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    model!(x, w, b)
}

fn model_remote(x: &RemoteTensor, w: &RemoteTensor, b: &RemoteTensor) -> RemoteTensor {
    model!(x, w, b)
}

worker_test!(remote_results_and_gradients_equal_local, 2, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let x = Tensor::randn(&[4, 3], 1.0, 1, DType::F64).unwrap().requires_grad_();
        let w0 = Tensor::randn(&[3, 5], 0.5, 2, DType::F64).unwrap();
        let b0 = Tensor::randn(&[5], 0.5, 3, DType::F64).unwrap();
        let w = RemoteTensor::parameter(&agent, "worker1/cpu", "W", &w0).unwrap();
        let b = RemoteTensor::parameter(&agent, "worker1/cpu", "b", &b0).unwrap();
        let opt = DistributedOptimizer::new(
            &agent,
            OptimizerKind::sgd(0.1),
            &[w.param_rref().unwrap(), b.param_rref().unwrap()],
            UpdateMode::Locked,
        )
        .unwrap();

        // Local reference: the same ops, here.
        let (wl, bl) = (w0.clone().requires_grad_(), b0.clone().requires_grad_());
        let local = model_local(&x, &wl, &bl);
        local.backward().unwrap();
        let (gx, gw, gb) = (x.grad().unwrap(), wl.grad().unwrap(), bl.grad().unwrap());
        x.zero_grad();

        let before = remote::stats();
        let ctx = Context::new(&agent).unwrap();
        let loss = ctx.run(|| {
            let xr = x.to_remote(&agent, "worker1/cpu").unwrap();
            assert!(xr.requires_grad() && xr.is_pending());
            let loss = model_remote(&xr, &w, &b);
            assert_eq!(loss.shape(), &[] as &[usize]);
            // Nothing has been sent: every op is recorded.
            assert_eq!(remote::stats().flushes, before.flushes);
            loss.to_here().unwrap()
        });
        let after = remote::stats();
        assert_eq!(after.flushes - before.flushes, 1, "one flush for the whole forward");
        assert_eq!(after.fetches, before.fetches, "the loss came back in the flush's reply");
        assert_eq!(
            bits(&loss),
            bits(&local),
            "the remote forward equals the local one bit for bit"
        );
        ctx.backward(&[loss], false).unwrap();
        let g = ctx.gradient(&x).expect("x's gradient came back from worker 1");
        close(&g, &gx, "x's gradient");
        // The parameters' gradients stay on worker 1, read from there one call each.
        close(
            &w.gradient(ctx.id()).unwrap().expect("W's gradient"),
            &gw,
            "W's gradient, read",
        );
        close(
            &b.gradient(ctx.id()).unwrap().expect("b's gradient"),
            &gb,
            "b's gradient, read",
        );
        // A tensor that is no parameter keeps none.
        let not_param = w.mul_scalar(2.0).unwrap();
        assert!(matches!(not_param.gradient(ctx.id()), Err(Error::Remote(_))));
        // One SGD step there, then the parameters read back.
        opt.step(ctx.id()).unwrap();
        let w1 = w.to_here().unwrap();
        let b1 = b.to_here().unwrap();
        let expect = |p: &Tensor, g: &Tensor| p.sub(&g.mul_scalar(0.1).unwrap()).unwrap();
        close(&w1, &expect(&w0, &gw), "W after the remote step");
        close(&b1, &expect(&b0, &gb), "b after the remote step");
        ctx.release().unwrap();
        // A context worker 1 never saw holds none.
        let other = Context::new(&agent).unwrap();
        assert!(w.gradient(other.id()).unwrap().is_none());
        other.release().unwrap();
    }
    agent.shutdown().unwrap();
});

worker_test!(each_flush_point_sends_the_recording, 3, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let base = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let flushes = || remote::stats().flushes;
        let on1 = || base.to_remote(&agent, "worker1/cpu").unwrap().mul_scalar(2.0).unwrap();

        // to_here: a small recorded value comes back in the flush's own reply (no fetch)
        let fetches = || remote::stats().fetches;
        let (n, f, a) = (flushes(), fetches(), on1());
        assert!(a.is_pending());
        assert_eq!(a.to_here().unwrap().to_vec::<f64>().unwrap(), vec![2.0, 4.0, 6.0, 8.0]);
        assert_eq!((flushes() - n, fetches() - f), (1, 0));
        assert!(!a.is_pending());
        // ... and once stored, by a fetch; a value over the bound is always fetched
        assert_eq!(a.to_here().unwrap().to_vec::<f64>().unwrap(), vec![2.0, 4.0, 6.0, 8.0]);
        assert_eq!(fetches() - f, 1);
        let big = remote::FETCH_WITH_FLUSH_MAX / 8 + 1;
        let ones = Tensor::from_vec(vec![1.0f64; big], &[big]).unwrap();
        let (n, f) = (flushes(), fetches());
        let got = ones
            .to_remote(&agent, "worker1/cpu")
            .unwrap()
            .mul_scalar(3.0)
            .unwrap()
            .to_here()
            .unwrap();
        assert_eq!((flushes() - n, fetches() - f), (1, 1));
        assert!(got.to_vec::<f64>().unwrap().iter().all(|&v| v == 3.0));
        // item
        let n = flushes();
        assert_eq!(on1().sum().unwrap().item().unwrap(), 20.0);
        assert_eq!(flushes() - n, 1);
        // a print
        let n = flushes();
        let printed = format!("{}", on1().add_scalar(1.0).unwrap());
        assert!(printed.contains("worker1"), "{printed}");
        assert_eq!(flushes() - n, 1);
        // sync
        let (n, a) = (flushes(), on1());
        a.sync().unwrap();
        assert!(!a.is_pending());
        assert_eq!(flushes() - n, 1);
        // an op mixing owners flushes the other owner's recording (not its own)
        let (n, a) = (flushes(), on1());
        let b = base.to_remote(&agent, "worker2/cpu").unwrap().neg().unwrap();
        let c = a.add(&b).unwrap();
        assert!(!b.is_pending() && a.is_pending() && c.is_pending());
        assert_eq!(flushes() - n, 1);
        assert_eq!(c.to_here().unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        // the size bound
        let n = flushes();
        let mut t = on1();
        for _ in 0..FLUSH_OPS {
            t = t.add_scalar(1.0).unwrap();
        }
        assert!(flushes() - n >= 1, "the size bound flushed");
        let expect: Vec<f64> = [2.0, 4.0, 6.0, 8.0].iter().map(|v| v + FLUSH_OPS as f64).collect();
        assert_eq!(t.to_here().unwrap().to_vec::<f64>().unwrap(), expect);
        // A recording nobody references is never sent.
        let n = flushes();
        drop(on1());
        remote::flush_all(&agent).unwrap();
        assert_eq!(flushes(), n);
    }
    agent.shutdown().unwrap();
});

worker_test!(narrow_cat_and_embedding_equal_local, 2, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let x = Tensor::from_vec((0..24).map(|v| v as f64 * 0.1).collect(), &[4, 6])
            .unwrap()
            .requires_grad_();
        let w = Tensor::from_vec((0..15).map(|v| 1.0 + v as f64).collect(), &[5, 3])
            .unwrap()
            .requires_grad_();
        let idx = Tensor::from_vec(vec![4i64, 0, 2, 2, 1, 4], &[2, 3]).unwrap();
        // Locally.
        let a = x.narrow(1, 1, 3).unwrap();
        let c = sluice_autograd::ops::cat(&[a.exp().unwrap(), a.mul_scalar(2.0).unwrap()], 0).unwrap();
        let e = sluice_autograd::ops::embedding(&w, &idx).unwrap();
        let local = c.sum().unwrap().add(&e.mul(&e).unwrap().sum().unwrap()).unwrap();
        local.backward().unwrap();
        let (gx, gw) = (x.grad().unwrap(), w.grad().unwrap());
        // On worker 1, recorded and run as one graph.
        let ctx = Context::new(&agent).unwrap();
        let remote = ctx.run(|| {
            let xr = x.to_remote(&agent, "worker1/cpu").unwrap();
            let a = xr.narrow(1, 1, 3).unwrap();
            assert_eq!(a.shape(), &[4, 3]);
            let c = RemoteTensor::cat(&[&a.exp().unwrap(), &a.mul_scalar(2.0).unwrap()], 0).unwrap();
            assert_eq!(c.shape(), &[8, 3]);
            let wr = w.to_remote(&agent, "worker1/cpu").unwrap();
            let e = wr.embedding(&idx.to_remote(&agent, "worker1/cpu").unwrap()).unwrap();
            assert_eq!(e.shape(), &[2, 3, 3]);
            // Shapes and dtypes are checked where they are written.
            assert!(matches!(xr.narrow(1, 4, 3), Err(Error::Shape { .. })));
            assert!(matches!(RemoteTensor::cat(&[&xr, &e], 0), Err(Error::Shape { .. })));
            assert!(matches!(wr.embedding(&xr), Err(Error::Shape { .. })));
            c.sum()
                .unwrap()
                .add(&e.mul(&e).unwrap().sum().unwrap())
                .unwrap()
                .to_here()
                .unwrap()
        });
        assert_eq!(bits(&remote), bits(&local), "forward");
        ctx.backward(&[remote], false).unwrap();
        close(
            &ctx.gradient(&x).expect("x's gradient"),
            &gx,
            "x's gradient through narrow and cat",
        );
        close(
            &ctx.gradient(&w).expect("w's gradient"),
            &gw,
            "w's gradient through embedding",
        );
        ctx.release().unwrap();
        // An index past the vocabulary is the owner's error, at the flush.
        let bad = Tensor::from_vec(vec![9i64], &[1]).unwrap();
        let wr = w.to_remote(&agent, "worker1/cpu").unwrap();
        let err = wr
            .embedding(&bad.to_remote(&agent, "worker1/cpu").unwrap())
            .unwrap()
            .to_here();
        assert!(err.is_err(), "{err:?}");
    }
    agent.shutdown().unwrap();
});

worker_test!(gather_and_index_select_equal_local, 2, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let x = Tensor::from_vec((0..24).map(|v| (v as f64 * 0.37).sin()).collect(), &[2, 3, 4])
            .unwrap()
            .requires_grad_();
        let index = Tensor::from_vec(vec![2i64, 0, 2, 1, 1, 0, 0, 2], &[2, 2, 2]).unwrap();
        let picks = Tensor::from_vec(vec![3i64, 0, 3], &[3]).unwrap();
        // Locally: the gathered elements and the selected slices, both through a square.
        macro_rules! f {
            ($g:expr, $s:expr) => {{
                let (g, s) = ($g, $s);
                g.mul(&g)
                    .unwrap()
                    .sum()
                    .unwrap()
                    .add(&s.exp().unwrap().sum().unwrap())
                    .unwrap()
            }};
        }
        let local = f!(x.gather(1, &index).unwrap(), x.index_select(2, &picks).unwrap());
        local.backward().unwrap();
        let gx = x.grad().unwrap();
        let ctx = Context::new(&agent).unwrap();
        let remote = ctx.run(|| {
            let on1 = |t: &Tensor| t.to_remote(&agent, "worker1/cpu").unwrap();
            let xr = on1(&x);
            let g = xr.gather(1, &on1(&index)).unwrap();
            assert_eq!(g.shape(), &[2, 2, 2]);
            let s = xr.index_select(2, &on1(&picks)).unwrap();
            assert_eq!(s.shape(), &[2, 3, 3]);
            // Shapes are checked where they are written.
            assert!(matches!(
                xr.gather(3, &on1(&index)),
                Err(Error::Shape { op: "gather", .. })
            ));
            let tall = Tensor::from_vec(vec![0i64; 12], &[3, 2, 2]).unwrap();
            assert!(matches!(
                xr.gather(1, &on1(&tall)),
                Err(Error::Shape { op: "gather", .. })
            ));
            assert!(matches!(
                xr.index_select(1, &on1(&index)),
                Err(Error::Shape { op: "index_select", .. })
            ));
            f!(g, s).to_here().unwrap()
        });
        assert_eq!(bits(&remote), bits(&local), "forward");
        ctx.backward(&[remote], false).unwrap();
        close(
            &ctx.gradient(&x).expect("x's gradient"),
            &gx,
            "x's gradient through gather and index_select",
        );
        ctx.release().unwrap();
        // An index past the dimension is the owner's error, at the flush.
        let bad = Tensor::from_vec(vec![7i64], &[1]).unwrap();
        let err = x
            .to_remote(&agent, "worker1/cpu")
            .unwrap()
            .index_select(0, &bad.to_remote(&agent, "worker1/cpu").unwrap())
            .unwrap()
            .to_here();
        assert!(err.is_err(), "{err:?}");
    }
    agent.shutdown().unwrap();
});

worker_test!(record_time_errors_name_the_mistake, 2, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let a = Tensor::ones(&[2, 3], DType::F64)
            .unwrap()
            .to_remote(&agent, "worker1/cpu")
            .unwrap();
        let b = Tensor::ones(&[2, 3], DType::F64)
            .unwrap()
            .to_remote(&agent, "worker1/cpu")
            .unwrap();
        let n = remote::stats().ops_recorded;
        assert!(matches!(a.matmul(&b), Err(Error::Shape { op: "matmul", .. })));
        assert!(matches!(a.reshape(&[4, 2]), Err(Error::Shape { .. })));
        assert!(matches!(a.softmax(5), Err(Error::Shape { .. })));
        assert!(matches!(a.transpose(0, 7), Err(Error::Shape { .. })));
        let i = Tensor::indices(&[0, 1], &[2])
            .unwrap()
            .to_remote(&agent, "worker1/cpu")
            .unwrap();
        assert!(matches!(i.exp(), Err(Error::DType { .. })));
        let f = Tensor::ones(&[2, 3], DType::F32)
            .unwrap()
            .to_remote(&agent, "worker1/cpu")
            .unwrap();
        assert!(a.add(&f).is_err(), "mixed dtypes");
        assert!(matches!(a.reshape(&[usize::MAX, 4]), Err(Error::Shape { .. })));
        assert_eq!(remote::stats().ops_recorded, n + 2, "only the two inputs were recorded");
        assert!(matches!(a.to("nobody/cpu"), Err(Error::Rpc(_))));
        assert!(matches!(a.to("worker1"), Err(Error::Remote(_))));
        assert!(matches!(a.to("worker1/tpu:0"), Err(Error::Remote(_))));
        // A value never flushed leaves nothing behind on the owner.
        let before = owner_stats(&agent, 1).0;
        drop((a, b, i, f));
        remote::flush_all(&agent).unwrap();
        assert_eq!(owner_stats(&agent, 1).0, before);
        assert_eq!(agent.user_rrefs(), 0);
    }
    agent.shutdown().unwrap();
});

worker_test!(an_identical_graph_is_sent_once, 2, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let step = |seed: u64| {
            let x = Tensor::randn(&[8, 8], 1.0, seed, DType::F64).unwrap();
            let r = x.to_remote(&agent, "worker1/cpu").unwrap();
            let y = r.matmul(&r).unwrap().relu().unwrap().sum().unwrap();
            let want = x.matmul(&x).unwrap().relu().unwrap().sum().unwrap();
            assert_eq!(bits(&y.to_here().unwrap()), bits(&want));
        };
        let s0 = remote::stats();
        step(1);
        let s1 = remote::stats();
        assert_eq!(
            (
                s1.graphs_sent - s0.graphs_sent,
                s1.graphs_by_reference - s0.graphs_by_reference
            ),
            (1, 0)
        );
        for seed in 2..5 {
            step(seed);
        }
        let s2 = remote::stats();
        assert_eq!(
            (
                s2.graphs_sent - s1.graphs_sent,
                s2.graphs_by_reference - s1.graphs_by_reference
            ),
            (0, 3),
            "the same graph with new values is named, not sent"
        );
        assert_eq!(owner_stats(&agent, 1).0, 4, "the owner ran all four");
    }
    agent.shutdown().unwrap();
});

worker_test!(tensors_crossing_owners_move_owner_to_owner, 3, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        const N: usize = 1 << 17; // 1 MiB of f64
        let a0 = Tensor::randn(&[N], 1.0, 1, DType::F64).unwrap();
        let b0 = Tensor::randn(&[N], 1.0, 2, DType::F64).unwrap();
        let a = a0.to_remote(&agent, "worker1/cpu").unwrap().tanh().unwrap();
        let b = b0.to_remote(&agent, "worker2/cpu").unwrap().exp().unwrap();
        // b is read by worker 1, which fetches it from worker 2 itself.
        let moved = b.to("worker1/cpu").unwrap();
        let s = a.mul(&moved).unwrap().sum().unwrap();
        let here = remote::stats();
        let want = a0.tanh().unwrap().mul(&b0.exp().unwrap()).unwrap().sum().unwrap();
        assert_eq!(bits(&s.to_here().unwrap()), bits(&want));
        let fetched_here = remote::stats().bytes_fetched - here.bytes_fetched;
        assert_eq!(fetched_here, 8, "the caller received only the 0-d result");
        let (_, fetches1, bytes1, _) = owner_stats(&agent, 1);
        assert_eq!(
            (fetches1, bytes1),
            (1, (N * 8) as u64),
            "worker 1 fetched b from worker 2"
        );
        let (_, fetches2, bytes2, _) = owner_stats(&agent, 2);
        assert_eq!((fetches2, bytes2), (0, 0));
        // And the other way in one op (mixing owners): worker 2 reads a from worker 1.
        let c = b.div(&a).unwrap().mean().unwrap();
        let want = b0.exp().unwrap().div(&a0.tanh().unwrap()).unwrap().mean().unwrap();
        assert_eq!(bits(&c.to_here().unwrap()), bits(&want));
        assert_eq!(owner_stats(&agent, 2).2, (N * 8) as u64);
    }
    agent.shutdown().unwrap();
});

#[test]
fn an_owner_killed_mid_flush_fails_it_naming_the_owner() {
    run_workers_with(
        "an_owner_killed_mid_flush_fails_it_naming_the_owner",
        2,
        |r| if r == 1 { Ending::Killed } else { Ending::Success },
        |env| {
            let agent = env.agent(registry());
            if env.rank == 1 {
                // Die as soon as a graph starts running here.
                std::thread::spawn(|| loop {
                    if remote::stats().graphs_run > 0 {
                        std::thread::sleep(Duration::from_millis(100));
                        nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).unwrap();
                    }
                    std::thread::sleep(Duration::from_millis(5));
                });
                agent.barrier("done").ok();
                std::thread::sleep(Duration::from_secs(60));
                return;
            }
            let x = Tensor::randn(&[384, 384], 1.0, 1, DType::F64).unwrap();
            let mut t = x.to_remote(&agent, "worker1/cpu").unwrap();
            for _ in 0..200 {
                t = t.matmul(&t).unwrap().tanh().unwrap();
            }
            let start = Instant::now();
            let e = t.to_here().expect_err("the owner died running it");
            let text = e.to_string();
            assert!(text.contains("worker1"), "the error names the owner: {text}");
            assert!(start.elapsed() < Duration::from_secs(30), "noticed within seconds");
            // Later use fails the same way, at once.
            assert!(t.add_scalar(1.0).unwrap().to_here().is_err());
            agent.shutdown_now();
        },
    );
}
