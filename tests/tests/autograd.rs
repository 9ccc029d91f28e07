//! Distributed autograd and the distributed optimizer across real processes, checked against
//! the same computation run locally.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sluice_agent::{Agent, CallContext, HandlerError, RRef, Registry};
use sluice_autograd::dist::{self, Context, DistOptions, PointKind};
use sluice_autograd::{
    linear, DType, DistributedOptimizer, Error, Optimizer, OptimizerKind, Parameter, Tensor, UpdateMode,
};
use sluice_tests::worker_test;
use sluice_tests::workers::{run_workers_with, Ending, WorkerEnv};

const D: usize = 4;

/// A worker's parameters: W, b (used by `layer`) and U (never used), seeded by rank.
fn seeded(rank: u32) -> Vec<Parameter> {
    let r = rank as u64;
    vec![
        Parameter::new("W", Tensor::randn(&[D, D], 0.5, 100 + r, DType::F64).unwrap()),
        Parameter::new("b", Tensor::randn(&[D], 0.5, 200 + r, DType::F64).unwrap()),
        Parameter::new("U", Tensor::randn(&[D], 0.5, 300 + r, DType::F64).unwrap()),
    ]
}

static PARAMS: OnceLock<Vec<Parameter>> = OnceLock::new();

fn params(agent: &Agent) -> &'static [Parameter] {
    PARAMS.get_or_init(|| seeded(agent.info().id))
}

fn layer_with(x: &Tensor, p: &[Parameter]) -> sluice_autograd::Result<Tensor> {
    linear(x, &p[0].tensor(), Some(&p[1].tensor()))?.tanh()
}

fn he(e: impl std::fmt::Display) -> HandlerError {
    HandlerError::new("Error", e.to_string())
}

/// A model kept on its owner and reached through an RRef (its parameters are the owner's).
#[derive(serde::Serialize, serde::Deserialize)]
struct Layer;

fn registry() -> Registry {
    let mut r = Registry::new();
    dist::install(&mut r);
    dist::method(&mut r, "forward", |cx: &CallContext, _m: &Layer, x: Tensor| {
        layer_with(&x, params(&cx.agent)).map_err(he)
    });
    r.handler("layer_rref", |cx: &CallContext, (): ()| Ok(cx.agent.rref(Layer)));
    dist::function(&mut r, "layer", |cx: &CallContext, x: Tensor| {
        layer_with(&x, params(&cx.agent)).map_err(he)
    });
    dist::function(&mut r, "chain", |cx: &CallContext, (x, rest): (Tensor, Vec<u32>)| {
        let y = layer_with(&x, params(&cx.agent)).map_err(he)?;
        match rest.split_first() {
            None => Ok(y),
            Some((next, rest)) => dist::rpc_sync(&cx.agent, *next, "chain", &(y, rest.to_vec())).map_err(he),
        }
    });
    dist::function(
        &mut r,
        "fail_deep",
        |cx: &CallContext, (x, rest): (Tensor, Vec<u32>)| {
            let y = layer_with(&x, params(&cx.agent)).map_err(he)?;
            match rest.split_first() {
                None => y.fail_in_backward("simulated failure in backward").map_err(he),
                Some((next, rest)) => dist::rpc_sync(&cx.agent, *next, "fail_deep", &(y, rest.to_vec())).map_err(he),
            }
        },
    );
    dist::function(&mut r, "grads", |cx: &CallContext, ctx: u64| {
        let grads = dist::get_gradients(ctx).map_err(he)?;
        Ok(params(&cx.agent)
            .iter()
            .map(|p| grads.get(&p.id()).map(|g| g.to_dense().unwrap()))
            .collect::<Vec<Option<Tensor>>>())
    });
    dist::function(&mut r, "values", |cx: &CallContext, (): ()| {
        Ok(params(&cx.agent).iter().map(Parameter::data).collect::<Vec<Tensor>>())
    });
    dist::function(&mut r, "describe", |_cx: &CallContext, t: Tensor| {
        Ok((t.strides().to_vec(), t.is_contiguous(), t.to_vec::<f64>().map_err(he)?))
    });
    dist::function(&mut r, "total", |cx: &CallContext, (): ()| {
        params(&cx.agent)[2].tensor().sum().map_err(he)
    });
    r.handler("param_rrefs", |cx: &CallContext, (): ()| {
        Ok(params(&cx.agent)
            .iter()
            .map(|p| cx.agent.rref(p.clone()))
            .collect::<Vec<RRef<Parameter>>>())
    })
    .handler("live", |_cx, (): ()| Ok(dist::live_contexts()))
    .handler("steps_in_backward", |_cx, (): ()| {
        Ok(sluice_autograd::optim::steps_in_backward())
    });
    r
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-9 * (1.0 + x.abs()),
            "{what}[{i}]: distributed {x} vs local {y}"
        );
    }
}

fn input() -> Tensor {
    Tensor::randn(&[3, D], 1.0, 42, DType::F64).unwrap()
}

worker_test!(distributed_gradients_and_updates_match_local, 4, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        // Distributed: a nested chain 1→2→3, a call to 3, a round trip of a result to 2, and
        // two roots.
        let x = input().requires_grad_();
        let ctx = Context::new(&agent).unwrap();
        let a: Tensor = dist::rpc_sync(&agent, 1u32, "chain", &(x.clone(), vec![2u32, 3])).unwrap();
        let b: Tensor = dist::rpc_sync(&agent, 3u32, "layer", &x.mul_scalar(2.0).unwrap()).unwrap();
        let c: Tensor = dist::rpc_sync(&agent, 2u32, "layer", &a).unwrap();
        let loss1 = a.mul(&b).unwrap().sum().unwrap();
        let loss2 = c.mean().unwrap();
        ctx.backward(&[loss1.clone(), loss2.clone()], false).unwrap();

        // Locally, with the same parameters.
        let xl = input().requires_grad_();
        let local: Vec<Vec<Parameter>> = (0..4).map(seeded).collect();
        let al = layer_with(
            &layer_with(&layer_with(&xl, &local[1]).unwrap(), &local[2]).unwrap(),
            &local[3],
        )
        .unwrap();
        let bl = layer_with(&xl.mul_scalar(2.0).unwrap(), &local[3]).unwrap();
        let cl = layer_with(&al, &local[2]).unwrap();
        let l1 = al.mul(&bl).unwrap().sum().unwrap();
        let l2 = cl.mean().unwrap();
        assert_close("loss1", &loss1, &l1);
        assert_close("loss2", &loss2, &l2);
        l1.add(&l2).unwrap().backward().unwrap();

        assert_close("dx", &ctx.gradient(&x).unwrap(), &xl.grad().unwrap());
        assert!(
            x.grad().is_none(),
            "a distributed backward never writes a tensor's own grad"
        );
        for w in 1..4u32 {
            let g: Vec<Option<Tensor>> = dist::rpc_sync(&agent, w, "grads", &ctx.id()).unwrap();
            assert_close(
                &format!("dW on {w}"),
                g[0].as_ref().unwrap(),
                &local[w as usize][0].grad().unwrap(),
            );
            assert_close(
                &format!("db on {w}"),
                g[1].as_ref().unwrap(),
                &local[w as usize][1].grad().unwrap(),
            );
            assert!(g[2].is_none(), "U is unused, so it has no gradient");
        }

        // The distributed optimizer (Adam) against the local one, twice.
        let mut rrefs = Vec::new();
        for w in 1..4u32 {
            rrefs.extend(agent.call::<_, Vec<RRef<Parameter>>>(w, "param_rrefs", &()).unwrap());
        }
        let kind = OptimizerKind::adam(0.05);
        let opt = DistributedOptimizer::new(&agent, kind, &rrefs, UpdateMode::Locked).unwrap();
        let local_opt = Optimizer::new(kind, local[1..].iter().flatten().cloned().collect(), UpdateMode::Locked);
        opt.step(ctx.id()).unwrap();
        local_opt.step().unwrap();
        for w in 1..4u32 {
            let v: Vec<Tensor> = dist::rpc_sync(&agent, w, "values", &()).unwrap();
            for (i, p) in local[w as usize].iter().enumerate() {
                assert_close(&format!("param {i} on {w} after a step"), &v[i], &p.data());
            }
            assert_close("U unchanged", &v[2], &seeded(w)[2].data());
        }
        ctx.release().unwrap();
        // Released on every worker that took part (and here).
        assert!(dist::live_contexts().is_empty());
        for w in 1..4u32 {
            assert_eq!(
                agent.call::<_, Vec<u64>>(w, "live", &()).unwrap(),
                Vec::<u64>::new(),
                "worker {w}"
            );
        }
    }
    agent.shutdown().unwrap();
});

worker_test!(backward_and_step_matches_backward_then_step, 4, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let mut rrefs = Vec::new();
        for w in 1..4u32 {
            rrefs.extend(agent.call::<_, Vec<RRef<Parameter>>>(w, "param_rrefs", &()).unwrap());
        }
        // Adam, so a step taken twice or skipped shows in the second iteration's values.
        let kind = OptimizerKind::adam(0.05);
        let opt = DistributedOptimizer::new(&agent, kind, &rrefs, UpdateMode::Locked).unwrap();
        let local: Vec<Vec<Parameter>> = (0..4).map(seeded).collect();
        let local_opt = Optimizer::new(kind, local[1..].iter().flatten().cloned().collect(), UpdateMode::Locked);
        let fused = |w: u32| agent.call::<_, u64>(w, "steps_in_backward", &()).unwrap();
        for iteration in 0..3 {
            // Worker 1 and worker 3 answer one call each (one way in for their gradients: they
            // step in the backward's answer); worker 2 answers two (it cannot tell, so it
            // steps on a call of its own). The third time, this worker sends worker 1's
            // result on to worker 2: a gradient coming back for it runs a pass of its own here,
            // which reaches worker 1 a second time, so nobody may step early.
            let resend = iteration == 2;
            let x = input();
            // The same model, each layer run by `layer(worker, input)`.
            let model = |layer: &dyn Fn(u32, &Tensor) -> Tensor| {
                let a = layer(1, &x);
                let c = layer(2, &if resend { a.clone() } else { x.mul_scalar(3.0).unwrap() });
                let (b, d) = (layer(2, &x), layer(3, &x.mul_scalar(2.0).unwrap()));
                let ab = a.mul(&b).unwrap().sum().unwrap();
                ab.add(&c.mean().unwrap()).unwrap().add(&d.sum().unwrap()).unwrap()
            };
            let ctx = Context::new(&agent).unwrap();
            let loss = model(&|w, t| dist::rpc_sync(&agent, w, "layer", t).unwrap());
            opt.backward_and_step(&ctx, &[loss]).unwrap();
            let l = model(&|w, t| layer_with(t, &local[w as usize]).unwrap());
            local[1..].iter().flatten().for_each(Parameter::zero_grad);
            l.backward().unwrap();
            local_opt.step().unwrap();
            for w in 1..4u32 {
                let v: Vec<Tensor> = dist::rpc_sync(&agent, w, "values", &()).unwrap();
                for (i, p) in local[w as usize].iter().enumerate() {
                    assert_close(&format!("param {i} on {w} after step {iteration}"), &v[i], &p.data());
                }
            }
            let n = (iteration + 1).min(2);
            assert_eq!(
                (fused(1), fused(2), fused(3)),
                (n, 0, n),
                "steps taken in the backward's answer"
            );
            ctx.release().unwrap();
        }

        // One `remote` result fetched twice: two receive functions here for one send function
        // on worker 1, so the pass sends worker 1 two messages and it must not step early.
        // (An optimizer over worker 1's parameters only: this context reaches no other.)
        let opt1 = DistributedOptimizer::new(&agent, kind, &rrefs[..3], UpdateMode::Locked).unwrap();
        let local_opt1 = Optimizer::new(kind, local[1].clone(), UpdateMode::Locked);
        let x = input();
        let ctx = Context::new(&agent).unwrap();
        let r = dist::remote::<_, Tensor>(&agent, 1u32, "layer", &x).unwrap();
        let (a1, a2) = (r.to_here().unwrap(), r.to_here().unwrap());
        opt1.backward_and_step(&ctx, &[a1.mul(&a2).unwrap().sum().unwrap()])
            .unwrap();
        ctx.release().unwrap();
        let al = layer_with(&x, &local[1]).unwrap();
        local[1..].iter().flatten().for_each(Parameter::zero_grad);
        al.mul(&al).unwrap().sum().unwrap().backward().unwrap();
        local_opt1.step().unwrap();
        let v: Vec<Tensor> = dist::rpc_sync(&agent, 1u32, "values", &()).unwrap();
        for (i, p) in local[1].iter().enumerate() {
            assert_close(
                &format!("param {i} on 1 after a result fetched twice"),
                &v[i],
                &p.data(),
            );
        }
        assert_eq!(fused(1), 2, "a worker sent two messages does not step in its answer");

        // A backward that fails steps nothing: the error names the worker, values stay.
        let before: Vec<Tensor> = dist::rpc_sync(&agent, 1u32, "values", &()).unwrap();
        let ctx = Context::new(&agent).unwrap();
        let y: Tensor = dist::rpc_sync(&agent, 1u32, "fail_deep", &(input(), Vec::<u32>::new())).unwrap();
        let e = opt.backward_and_step(&ctx, &[y.sum().unwrap()]).unwrap_err();
        assert!(matches!(&e, Error::OnWorker { worker: 1, .. }), "{e:?}");
        let after: Vec<Tensor> = dist::rpc_sync(&agent, 1u32, "values", &()).unwrap();
        for (i, (b, a)) in before.iter().zip(&after).enumerate() {
            assert_close(&format!("param {i} on 1 after a failed backward"), a, b);
        }
        assert_eq!(fused(1), 2, "no step in a failed backward's answer");
    }
    agent.shutdown().unwrap();
});

worker_test!(
    unused_rpc_output_finishes_and_retain_graph_accumulates,
    3,
    |env: WorkerEnv| {
        let agent = env.agent(registry());
        if env.rank == 0 {
            let x = input().requires_grad_();
            let ctx = Context::new(&agent).unwrap();
            assert!(dist::current_context() == Some(ctx.id()) && ctx.id() >> 48 == 0);
            let used: Tensor = dist::rpc_sync(&agent, 1u32, "layer", &x).unwrap();
            let _unused: Tensor = dist::rpc_sync(&agent, 2u32, "layer", &x).unwrap();
            let loss = used.sum().unwrap();
            // PyTorch's FAST mode hangs here; this returns.
            ctx.backward(std::slice::from_ref(&loss), true).unwrap();
            let once = ctx.gradient(&x).unwrap();
            let xl = input().requires_grad_();
            layer_with(&xl, &seeded(1)).unwrap().sum().unwrap().backward().unwrap();
            assert_close("dx", &once, &xl.grad().unwrap());
            assert_eq!(ctx.unused_sends().len(), 1, "the call to worker2 never got a gradient");
            // The context's RPCs on this worker, in order: a send and the reply's recv per call,
            // each send's message id also the unused one for the call to worker2.
            let points = ctx.rpc_points();
            let kinds: Vec<(PointKind, u32)> = points.iter().map(|p| (p.kind, p.peer)).collect();
            assert_eq!(
                kinds,
                vec![
                    (PointKind::Send, 1),
                    (PointKind::Recv, 1),
                    (PointKind::Send, 2),
                    (PointKind::Recv, 2)
                ]
            );
            assert_eq!(points[2].message, ctx.unused_sends()[0]);
            assert_eq!(dist::rpc_points(ctx.id()).unwrap(), points);
            // retain_graph: a second backward accumulates, a third after a non-retaining one fails.
            ctx.backward(std::slice::from_ref(&loss), false).unwrap();
            assert_close(
                "2·dx",
                &ctx.gradient(&x).unwrap(),
                &xl.grad().unwrap().mul_scalar(2.0).unwrap(),
            );
            let e = ctx.backward(&[loss], false).unwrap_err();
            assert!(e.to_string().contains("retain_graph"), "{e}");
            // Contexts don't nest, and unknown ids are named.
            assert!(matches!(Context::new(&agent), Err(Error::NestedContext(id)) if id == ctx.id()));
            let e = dist::get_gradients(12345).unwrap_err();
            assert!(e.to_string().contains("12345"), "{e}");
            drop(ctx);
            assert!(dist::current_context().is_none());
            let e = dist::backward(&agent, 12345, &[], false).unwrap_err();
            assert!(e.to_string().contains("12345"), "{e}");
        }
        agent.shutdown().unwrap();
    }
);

// `remote` followed by `to_here`, and a forward through an RRef proxy, are recorded in the
// caller's context like `rpc_sync`: the backward reaches the owner's parameters and comes back
// with the same input gradient as the local computation (PyTorch trains a parameter server's
// model behind an RRef this way).
worker_test!(remote_to_here_and_proxies_are_recorded, 2, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let xl = input().requires_grad_();
        layer_with(&xl, &seeded(1)).unwrap().sum().unwrap().backward().unwrap();
        let local_dx = xl.grad().unwrap();
        let model: RRef<Layer> = agent.call(1u32, "layer_rref", &()).unwrap();
        for form in [
            "remote + to_here",
            "proxy rpc_sync",
            "proxy rpc_async",
            "proxy remote + to_here",
        ] {
            let x = input().requires_grad_();
            let ctx = Context::new(&agent).unwrap();
            let y: Tensor = match form {
                "remote + to_here" => {
                    let r = dist::remote::<_, Tensor>(&agent, 1u32, "layer", &x).unwrap();
                    assert_eq!(r.owner().id, 1);
                    r.to_here().unwrap()
                }
                "proxy rpc_sync" => dist::rref_rpc_sync(&agent, &model, "forward", &x).unwrap(),
                "proxy remote + to_here" => {
                    let r = dist::rref_remote::<_, _, Tensor>(&agent, &model, "forward", &x).unwrap();
                    r.to_here().unwrap()
                }
                _ => dist::rref_rpc_async(&agent, &model, "forward", &x)
                    .unwrap()
                    .wait()
                    .unwrap(),
            };
            ctx.backward(&[y.sum().unwrap()], false).unwrap();
            let dx = ctx
                .gradient(&x)
                .unwrap_or_else(|| panic!("{form}: no gradient came back to the input"));
            assert_close(form, &dx, &local_dx);
            assert!(ctx.unused_sends().is_empty(), "{form}");
            let grads: Vec<Option<Tensor>> = dist::rpc_sync(&agent, 1u32, "grads", &ctx.id()).unwrap();
            assert!(
                grads[0].is_some() && grads[1].is_some(),
                "{form}: the owner's parameters got no gradient"
            );
        }
    }
    agent.shutdown().unwrap();
});

worker_test!(
    error_deep_in_backward_names_the_worker_and_agent_goes_on,
    4,
    |env: WorkerEnv| {
        let agent = env.agent(registry());
        if env.rank == 0 {
            for _ in 0..3 {
                let x = input().requires_grad_();
                let ctx = Context::new(&agent).unwrap();
                let y: Tensor = dist::rpc_sync(&agent, 1u32, "fail_deep", &(x.clone(), vec![2u32, 3])).unwrap();
                let e = ctx.backward(&[y.sum().unwrap()], false).unwrap_err();
                assert!(matches!(&e, Error::OnWorker { worker: 3, .. }), "{e:?}");
                let text = e.to_string();
                assert!(
                    text.starts_with("error on worker 3: ") && text.contains("simulated failure"),
                    "{text}"
                );
            }
            // A new context works.
            let x = input().requires_grad_();
            let ctx = Context::new(&agent).unwrap();
            let y: Tensor = dist::rpc_sync(&agent, 1u32, "chain", &(x.clone(), vec![2u32, 3])).unwrap();
            ctx.backward(&[y.sum().unwrap()], false).unwrap();
            assert!(ctx.gradient(&x).is_some());
        }
        agent.shutdown().unwrap();
    }
);

worker_test!(release_survives_lost_cleanup_messages, 4, |env: WorkerEnv| {
    dist::configure(DistOptions {
        drop_releases: 2,
        release_backoff: Duration::from_millis(10),
        release_timeout: Duration::from_secs(5),
        ..DistOptions::default()
    });
    let agent = env.agent(registry());
    if env.rank == 0 {
        for _ in 0..2 {
            let x = input().requires_grad_();
            let ctx = Context::new(&agent).unwrap();
            let y: Tensor = dist::rpc_sync(&agent, 1u32, "chain", &(x.clone(), vec![2u32, 3])).unwrap();
            ctx.backward(&[y.sum().unwrap()], false).unwrap();
            for w in 1..4u32 {
                assert_eq!(
                    agent.call::<_, Vec<u64>>(w, "live", &()).unwrap(),
                    vec![ctx.id()],
                    "worker {w} took part"
                );
            }
            // Each worker drops its first two release messages; retries get through, and the
            // release spreads 0→1→2→3 along the call tree.
            ctx.release().unwrap();
            for w in 1..4u32 {
                assert!(
                    agent.call::<_, Vec<u64>>(w, "live", &()).unwrap().is_empty(),
                    "worker {w}"
                );
            }
        }
    }
    agent.shutdown().unwrap();
});

#[test]
fn dead_peer_fails_backward_and_its_contexts_are_reclaimed() {
    let name = "dead_peer_fails_backward_and_its_contexts_are_reclaimed";
    run_workers_with(
        name,
        3,
        |r| if r == 2 { Ending::Killed } else { Ending::Success },
        |env| {
            let agent = env.agent(registry());
            match env.rank {
                2 => {
                    // Drive a context that lives on worker 1, then die.
                    let ctx = Context::new(&agent).unwrap();
                    let _y: Tensor = dist::rpc_sync(&agent, 1u32, "layer", &input().requires_grad_()).unwrap();
                    std::mem::forget(ctx);
                    agent.barrier("ready").unwrap();
                    agent.barrier("got").unwrap();
                    std::thread::sleep(Duration::from_millis(200));
                    nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).unwrap();
                    unreachable!();
                }
                1 => {
                    agent.barrier("ready").unwrap();
                    let orphan = dist::live_contexts();
                    assert_eq!(orphan.len(), 1);
                    assert_eq!(orphan[0] >> 48, 2, "driven by worker 2");
                    agent.barrier("got").unwrap();
                    // Once worker 2 is gone, the reaper reclaims its context.
                    let start = Instant::now();
                    while dist::live_contexts().contains(&orphan[0]) {
                        dist::reap_now(&agent, Duration::ZERO);
                        assert!(start.elapsed() < Duration::from_secs(60), "never reclaimed");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                _ => {
                    agent.barrier("ready").unwrap();
                    let x = input().requires_grad_();
                    let ctx = Context::new(&agent).unwrap();
                    let y: Tensor = dist::rpc_sync(&agent, 2u32, "layer", &x).unwrap();
                    agent.barrier("got").unwrap();
                    std::thread::sleep(Duration::from_millis(500));
                    let start = Instant::now();
                    let e = ctx.backward(&[y.sum().unwrap()], false).unwrap_err();
                    assert!(start.elapsed() < Duration::from_secs(60));
                    assert!(e.to_string().contains("worker2"), "{e}");
                }
            }
            if env.rank == 1 {
                // Wait until rank 0 is done with its checks before it leaves.
                std::thread::sleep(Duration::from_millis(200));
            }
            agent.shutdown_now();
        },
    );
}

worker_test!(views_travel_with_strides_or_contiguous, 2, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let base = Tensor::from_vec((0..12).map(|i| i as f64).collect::<Vec<_>>(), &[3, 4]).unwrap();
        let t = base.t().unwrap();
        let (strides, contiguous, values): (Vec<usize>, bool, Vec<f64>) =
            dist::rpc_sync(&agent, 1u32, "describe", &t).unwrap();
        assert_eq!(
            (strides, contiguous),
            (vec![1, 4], false),
            "a transpose arrives with its strides"
        );
        assert_eq!(values, t.to_vec::<f64>().unwrap());
        let window = base.narrow(1, 1, 2).unwrap();
        let (strides, contiguous, values): (Vec<usize>, bool, Vec<f64>) =
            dist::rpc_sync(&agent, 1u32, "describe", &window).unwrap();
        assert_eq!(
            (strides, contiguous),
            (vec![2, 1], true),
            "a strided window arrives contiguous"
        );
        assert_eq!(values, vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    }
    agent.shutdown().unwrap();
});

fn shared_param_training(agent: &Agent, rank: u32, mode: UpdateMode, tag: &str) {
    const STEPS: usize = 15;
    if rank != 0 {
        let rrefs: Vec<RRef<Parameter>> = agent.call(0u32, "param_rrefs", &()).unwrap();
        let opt = DistributedOptimizer::new(agent, OptimizerKind::sgd(0.5), &rrefs[2..], mode).unwrap();
        for _ in 0..STEPS {
            let ctx = Context::new(agent).unwrap();
            let total: Tensor = dist::rpc_sync(agent, 0u32, "total", &()).unwrap();
            ctx.backward(&[total], false).unwrap();
            opt.step(ctx.id()).unwrap();
        }
        // An owner's error reaches the caller, naming the owner.
        let e = opt.step(999).unwrap_err();
        assert!(
            matches!(&e, Error::OnWorker { worker: 0, detail } if detail.contains("999")),
            "{e:?}"
        );
    }
    agent.barrier(tag).unwrap();
    if rank == 0 {
        // d(sum U)/dU = 1, so every step of every trainer moves U by −0.5: none may be lost.
        let u = params(agent)[2].data().to_f64_vec().unwrap();
        let start = seeded(0)[2].data().to_f64_vec().unwrap();
        let trainers = (agent.workers().len() - 1) as f64;
        for (now, was) in u.iter().zip(&start) {
            let moved = was - now;
            assert!(
                (moved - 0.5 * trainers * STEPS as f64).abs() < 1e-9,
                "{mode:?}: moved {moved}"
            );
        }
        params(agent)[2].set(seeded(0)[2].data());
    }
    agent.barrier(&format!("{tag}-reset")).unwrap();
}

worker_test!(
    hogwild_and_locked_trainers_share_a_parameter_server,
    4,
    |env: WorkerEnv| {
        let agent = env.agent(registry());
        shared_param_training(&agent, env.rank, UpdateMode::Hogwild, "hogwild");
        shared_param_training(&agent, env.rank, UpdateMode::Locked, "locked");
        agent.shutdown().unwrap();
    }
);
