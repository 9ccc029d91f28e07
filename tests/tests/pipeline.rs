//! Pipeline parallelism and distributed checkpoints across real processes: gradients equal the
//! unpipelined model's (f64, 1e-9) for both schedules and several micro-batch counts; the
//! automatic partition matches exhaustive search; a checkpoint restores onto another placement
//! and training resumes exactly; corrupt checkpoints are refused naming the file and the check;
//! a worker killed in the middle of a save leaves the previous checkpoint valid.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sluice_agent::{Agent, CallContext, Priority, Registry};
use sluice_autograd::{cross_entropy, DType, Optimizer, OptimizerKind, Parameter, Tensor, UpdateMode};
use sluice_pipeline::partition::{self, by_counts};
use sluice_pipeline::{checkpoint, nn, Pipeline, PipelineOptions, Remat, Schedule};
use sluice_tests::worker_test;
use sluice_tests::workers::{run_workers_with, Ending, WorkerEnv};

const SEED: u64 = 7;

/// The largest element-wise difference of two equally long vectors (a length that differs,
/// say an echo that dropped values, fails here rather than comparing a prefix).
fn gap(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

fn model() -> Vec<nn::Layer> {
    nn::mlp(&[16, 24, 24, 24, 24, 10])
}

fn options(schedule: Schedule, micro_batches: usize) -> PipelineOptions {
    PipelineOptions {
        seed: SEED,
        dtype: DType::F64,
        optimizer: OptimizerKind::Sgd {
            lr: 0.05,
            momentum: 0.9,
        },
        schedule,
        micro_batches,
        remat: Remat::None,
        backward_priority: Priority::HIGH,
    }
}

/// Mini-batch `step` of a fixed synthetic data set (inputs f64, labels 0..10).
fn batch(step: u64) -> (Tensor, Tensor) {
    let x = Tensor::randn(&[24, 16], 1.0, 1000 + step, DType::F64).unwrap();
    let labels: Vec<usize> = (0..24).map(|i| ((i as u64 * 7 + step * 3) % 10) as usize).collect();
    (x, Tensor::indices(&labels, &[24]).unwrap())
}

static DONE: AtomicBool = AtomicBool::new(false);

fn registry() -> Registry {
    let mut r = Registry::new();
    sluice_pipeline::install(&mut r);
    r.handler("test.done", |_cx: &CallContext, (): ()| {
        DONE.store(true, Ordering::SeqCst);
        Ok(())
    });
    r
}

fn names(stages: &[u32]) -> Vec<String> {
    stages.iter().map(|w| format!("worker{w}/cpu")).collect()
}

fn pipeline(agent: &Agent, stages: &[u32], counts: &[usize], opts: PipelineOptions) -> Pipeline {
    let placements = names(stages);
    let refs: Vec<&str> = placements.iter().map(String::as_str).collect();
    Pipeline::new(agent, model(), &refs, by_counts(model().len(), counts).unwrap(), opts).unwrap()
}

worker_test!(pipelined_gradients_equal_the_local_models, 5, |env: WorkerEnv| {
    let agent = env.agent(registry());
    if env.rank == 0 {
        let (x, y) = batch(0);
        // The same model in this process, whole mini-batch at once.
        let local = nn::build(&model(), 0..model().len(), SEED, DType::F64).unwrap();
        let loss = cross_entropy(&nn::forward(&model(), &local, &x).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        let want: Vec<(String, Vec<f64>)> = local
            .iter()
            .flatten()
            .map(|p| (p.name().to_owned(), p.grad().unwrap().to_f64_vec().unwrap()))
            .collect();
        for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
            for micro in [1, 4, 8] {
                let p = pipeline(&agent, &[1, 2, 3, 4], &[3, 2, 2, 2], options(schedule, micro));
                let (l, got) = p.gradients(&x, &y).unwrap();
                assert!(
                    (l - loss.item().unwrap()).abs() < 1e-12,
                    "{schedule:?} m={micro}: loss {l}"
                );
                assert_eq!(got.len(), want.len());
                for ((gn, g), (wn, w)) in got.iter().zip(&want) {
                    assert_eq!(gn, wn);
                    let worst = gap(g, w);
                    assert!(worst < 1e-9, "{schedule:?} m={micro} {gn}: off by {worst:e}");
                }
            }
        }
        // Rematerialized stages (all, or some) give the same gradients.
        for remat in [Remat::All, Remat::Stages(0b0101)] {
            let opts = PipelineOptions {
                remat,
                ..options(Schedule::OneFOneB, 4)
            };
            let p = pipeline(&agent, &[1, 2, 3, 4], &[3, 2, 2, 2], opts);
            let (l, got) = p.gradients(&x, &y).unwrap();
            assert!((l - loss.item().unwrap()).abs() < 1e-12, "{remat:?}: loss {l}");
            assert_eq!(got.len(), want.len());
            for ((gn, g), (_, w)) in got.iter().zip(&want) {
                let worst = gap(g, w);
                assert!(worst < 1e-9, "{remat:?} {gn}: off by {worst:e}");
            }
        }
        // CUDA stages (where a GPU is): stages on the GPU and the CPU, the same gradients.
        if sluice_tests::gpu::compute_or_skip("CUDA stages of a pipeline") {
            let refs = ["worker1/cuda:0", "worker2/cpu", "worker3/cuda:0", "worker4/cpu"];
            let split = by_counts(model().len(), &[3, 2, 2, 2]).unwrap();
            let p = Pipeline::new(&agent, model(), &refs, split, options(Schedule::OneFOneB, 4)).unwrap();
            let (l, got) = p.gradients(&x, &y).unwrap();
            assert!((l - loss.item().unwrap()).abs() < 1e-9, "CUDA stages: loss {l}");
            assert_eq!(got.len(), want.len());
            for ((gn, g), (_, w)) in got.iter().zip(&want) {
                let worst = gap(g, w);
                assert!(worst < 1e-9, "CUDA stages {gn}: off by {worst:e}");
            }
        }
        // The pipeline predicts what the local model does.
        let p = pipeline(&agent, &[4, 3, 2, 1], &[1, 4, 1, 3], options(Schedule::OneFOneB, 3));
        let out = p.predict(&x).unwrap().to_f64_vec().unwrap();
        let want = nn::forward(&model(), &local, &x).unwrap().to_f64_vec().unwrap();
        assert!(gap(&out, &want) < 1e-12);
        // Partitions must cover every layer once, in order.
        let overlapping = partition::Partition {
            stages: vec![0..4, 3..9],
            predicted: Vec::new(),
        };
        let e = Pipeline::new(
            &agent,
            model(),
            &["worker1/cpu", "worker2/cpu"],
            overlapping,
            options(Schedule::GPipe, 1),
        );
        assert!(e.err().unwrap().to_string().contains("contiguous"));
        // Placement errors are clear.
        let bad = Pipeline::new(
            &agent,
            model(),
            &["worker1"],
            by_counts(9, &[9]).unwrap(),
            options(Schedule::GPipe, 1),
        );
        assert!(bad.err().unwrap().to_string().contains("WORKER/DEVICE"));
    }
    agent.shutdown().unwrap();
});

worker_test!(
    the_automatic_partition_matches_exhaustive_search,
    3,
    |env: WorkerEnv| {
        let agent = env.agent(registry());
        if env.rank == 0 {
            // A model with one wide layer: a balanced cut is not one of equal layer counts.
            let model = nn::mlp(&[64, 512, 64, 64, 64, 10]);
            let costs = sluice_pipeline::profile(&agent, "worker1", &model, 32, DType::F32).unwrap();
            assert_eq!(costs.len(), model.len());
            assert!(costs.iter().all(|c| c.forward > 0.0 && c.backward > 0.0));
            let limits = [u64::MAX; 2];
            let auto = partition::auto(&costs, &limits, 4).unwrap();
            let best = partition::exhaustive(&costs, &limits, 4).unwrap();
            println!("automatic partition:\n{auto}");
            assert!(auto.bottleneck() <= best.bottleneck() * (1.0 + 1e-12));
            let refs = ["worker1/cpu", "worker2/cpu"];
            let opts = PipelineOptions {
                dtype: DType::F32,
                ..options(Schedule::OneFOneB, 4)
            };
            let p = Pipeline::new(&agent, model, &refs, auto, opts).unwrap();
            let x = Tensor::randn(&[32, 64], 1.0, 1, DType::F32).unwrap();
            let y = Tensor::indices(&(0..32).map(|i| i % 10).collect::<Vec<_>>(), &[32]).unwrap();
            let first = p.train_step(&x, &y).unwrap().loss;
            let mut last = first;
            for _ in 0..20 {
                last = p.train_step(&x, &y).unwrap().loss;
            }
            assert!(last < first, "training did not reduce the loss: {first} → {last}");
        }
        agent.shutdown().unwrap();
    }
);

/// The asynchronous schedule simulated in this process: micro-batch by micro-batch, each
/// gradient computed on the weight version its forward was issued on
/// (`schedule::async_versions`) and applied to the newest weights.
fn simulate_async(stages: usize, micro: usize, steps: u64) -> Vec<(String, Vec<f64>)> {
    let local = nn::build(&model(), 0..model().len(), SEED, DType::F64).unwrap();
    let flat: Vec<Parameter> = local.iter().flatten().cloned().collect();
    let opt = Optimizer::new(
        options(Schedule::AsyncOneFOneB, micro).optimizer,
        flat.clone(),
        UpdateMode::Locked,
    );
    let mut stash: Vec<Vec<Tensor>> = vec![flat.iter().map(Parameter::data).collect()];
    for step in 0..steps {
        let (x, y) = batch(step);
        let n = x.shape()[0];
        let sizes: Vec<usize> = (0..micro).map(|i| n / micro + usize::from(i < n % micro)).collect();
        let (xs, ys) = (x.split(&sizes, 0).unwrap(), y.split(&sizes, 0).unwrap());
        let base = stash.len() - 1;
        for (k, (version, _)) in sluice_pipeline::schedule::async_versions(stages, micro)
            .into_iter()
            .enumerate()
        {
            let weights = &stash[base + version as usize];
            let tensors: Vec<Tensor> = flat.iter().zip(weights).map(|(p, w)| p.tensor_of(w)).collect();
            let out = nn::forward_tensors(&model(), &tensors, &xs[k]).unwrap();
            cross_entropy(&out, &ys[k]).unwrap().backward().unwrap();
            opt.step().unwrap();
            stash.push(flat.iter().map(Parameter::data).collect());
        }
    }
    flat.iter()
        .map(|p| (p.name().to_owned(), p.data().to_f64_vec().unwrap()))
        .collect()
}

worker_test!(
    asynchronous_1f1b_applies_each_gradient_to_newer_weights_as_simulated,
    4,
    |env: WorkerEnv| {
        let agent = env.agent(registry());
        if env.rank == 0 {
            for (stages, counts, micro) in [
                (&[1u32, 2, 3][..], &[3usize, 3, 3][..], 4usize),
                (&[2][..], &[9][..], 3),
            ] {
                let p = pipeline(&agent, stages, counts, options(Schedule::AsyncOneFOneB, micro));
                for step in 0..3 {
                    let (x, y) = batch(step);
                    p.train_step(&x, &y).unwrap();
                }
                let got = p.parameters().unwrap();
                let want = simulate_async(stages.len(), micro, 3);
                assert_eq!(got.len(), want.len());
                for ((gn, g), (wn, w)) in got.iter().zip(&want) {
                    assert_eq!(gn, wn);
                    let worst = gap(g, w);
                    assert!(worst < 1e-9, "{} stages {gn}: off by {worst:e}", stages.len());
                }
                // Not the synchronous update: the schedules differ in what they compute.
                let sync = pipeline(&agent, stages, counts, options(Schedule::OneFOneB, micro));
                let (x, y) = batch(0);
                sync.train_step(&x, &y).unwrap();
                let one = simulate_async(stages.len(), micro, 1);
                let s = sync.parameters().unwrap();
                let differs = s
                    .iter()
                    .zip(&one)
                    .any(|((_, a), (_, b))| a.iter().zip(b).any(|(u, v)| (u - v).abs() > 1e-9));
                assert!(
                    differs,
                    "the synchronous step should differ from per-micro-batch updates"
                );
            }
        }
        agent.shutdown().unwrap();
    }
);

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

worker_test!(
    a_checkpoint_restores_onto_another_placement_and_resumes_exactly,
    5,
    |env: WorkerEnv| {
        let agent = env.agent(registry());
        if env.rank == 0 {
            let dir = scratch("resume");
            // Uninterrupted: six steps on four stages.
            let whole = pipeline(&agent, &[1, 2, 3, 4], &[3, 2, 2, 2], options(Schedule::OneFOneB, 4));
            let losses: Vec<f64> = (0..6)
                .map(|s| {
                    let (x, y) = batch(s);
                    whole.train_step(&x, &y).unwrap().loss
                })
                .collect();
            drop(whole);
            // Interrupted: three steps, a checkpoint, then (restored on two other stages with
            // another partition and schedule) the last three.
            let first = pipeline(&agent, &[1, 2, 3, 4], &[3, 2, 2, 2], options(Schedule::OneFOneB, 4));
            for s in 0..3 {
                let (x, y) = batch(s);
                assert_eq!(
                    first.train_step(&x, &y).unwrap().loss.to_bits(),
                    losses[s as usize].to_bits()
                );
            }
            first.save(&dir, 3, serde_json::json!({ "next_step": 3 })).unwrap();
            // A step is saved once: overwriting its shards under its manifest could tear it.
            let e = first.save(&dir, 3, serde_json::json!({})).unwrap_err().to_string();
            assert!(e.contains("already saved"), "{e}");
            drop(first);
            let placements = ["worker3/cpu", "worker4/cpu"];
            let (second, manifest) = Pipeline::restore(
                &agent,
                &dir,
                &placements,
                by_counts(model().len(), &[5, 4]).unwrap(),
                options(Schedule::GPipe, 4),
            )
            .unwrap();
            assert_eq!(manifest.step, 3);
            // The saved state belongs to one update rule and dtype: another is refused.
            let adam = PipelineOptions {
                optimizer: OptimizerKind::adam(0.01),
                ..options(Schedule::GPipe, 4)
            };
            let e = Pipeline::restore(
                &agent,
                &dir,
                &placements,
                by_counts(model().len(), &[5, 4]).unwrap(),
                adam,
            )
            .err()
            .unwrap()
            .to_string();
            assert!(e.contains("saved with"), "{e}");
            assert_eq!(manifest.driver["next_step"], 3);
            for s in 3..6 {
                let (x, y) = batch(s);
                let l = second.train_step(&x, &y).unwrap().loss;
                assert!(
                    (l - losses[s as usize]).abs() < 1e-12,
                    "step {s}: {l} resumed, {} uninterrupted",
                    losses[s as usize]
                );
            }
            drop(second);

            // Corrupt or partial checkpoints are refused, naming the file and the check.
            let m = checkpoint::latest(&dir).unwrap();
            let shard = checkpoint::step_dir(&dir, 3).join(&m.shards[2].file);
            let good = std::fs::read(&shard).unwrap();
            let mut bad = good.clone();
            bad[good.len() / 2] ^= 0x40;
            std::fs::write(&shard, &bad).unwrap();
            let e = restore_error(&agent, &dir);
            assert!(e.contains("layer-0002.bin") && e.contains("crc32"), "{e}");
            std::fs::write(&shard, &good[..good.len() - 1]).unwrap();
            let e = restore_error(&agent, &dir);
            assert!(e.contains("layer-0002.bin") && e.contains("size"), "{e}");
            std::fs::write(&shard, &good).unwrap();
            let manifest_path = checkpoint::step_dir(&dir, 3).join("MANIFEST.json");
            std::fs::write(&manifest_path, b"{ not json").unwrap();
            let e = restore_error(&agent, &dir);
            assert!(e.contains("no complete checkpoint"), "{e}");
            let _ = std::fs::remove_dir_all(&dir);
        }
        agent.shutdown().unwrap();
    }
);

fn restore_error(agent: &Agent, dir: &Path) -> String {
    match Pipeline::restore(
        agent,
        dir,
        &["worker1/cpu"],
        by_counts(model().len(), &[model().len()]).unwrap(),
        options(Schedule::GPipe, 1),
    ) {
        Ok(_) => panic!("a damaged checkpoint was restored"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_worker_killed_mid_save_leaves_the_previous_checkpoint() {
    const TEST: &str = "a_worker_killed_mid_save_leaves_the_previous_checkpoint";
    run_workers_with(
        TEST,
        5,
        |rank| if rank == 3 { Ending::Killed } else { Ending::Success },
        |env| {
            let agent = env.agent(registry());
            if env.rank != 0 {
                return serve_until_done(agent);
            }
            let dir = scratch("killed");
            let p = pipeline(&agent, &[1, 2, 3, 4], &[3, 2, 2, 2], options(Schedule::GPipe, 2));
            let (x, y) = batch(0);
            p.train_step(&x, &y).unwrap();
            p.save(&dir, 1, serde_json::json!({})).unwrap();
            p.train_step(&x, &y).unwrap();
            // Stage 2 (on worker3) writes slowly; kill it once it has begun.
            p.pause_saves(2, 400).unwrap();
            let saving = std::thread::scope(|s| {
                let save = s.spawn(|| p.save(&dir, 2, serde_json::json!({})));
                let step2 = checkpoint::step_dir(&dir, 2);
                let start = Instant::now();
                // Stages 0, 1 and 3 write without pauses: wait for one of their shards.
                while !step2.join("layer-0000.bin").exists() {
                    assert!(start.elapsed() < Duration::from_secs(30), "the save never started");
                    std::thread::sleep(Duration::from_millis(5));
                }
                kill(&agent, "worker3");
                save.join().unwrap()
            });
            let e = saving.unwrap_err().to_string();
            assert!(
                e.contains("worker3"),
                "the failed save should name the lost worker: {e}"
            );
            // Step 2 never got a manifest: the checkpoint of step 1 is the latest, and whole.
            assert!(!checkpoint::step_dir(&dir, 2).join("MANIFEST.json").exists());
            let m = checkpoint::latest(&dir).unwrap();
            assert_eq!(m.step, 1);
            checkpoint::verify(&dir, &m).unwrap();
            // And it restores onto the survivors.
            let (q, _) = Pipeline::restore(
                &agent,
                &dir,
                &["worker1/cpu", "worker2/cpu", "worker4/cpu"],
                by_counts(model().len(), &[3, 3, 3]).unwrap(),
                options(Schedule::GPipe, 2),
            )
            .unwrap();
            q.train_step(&x, &y).unwrap();
            drop(q);
            drop(p);
            for w in [1u32, 2, 4] {
                let () = agent.call(w, "test.done", &()).unwrap();
            }
            let _ = std::fs::remove_dir_all(&dir);
            agent.shutdown_now();
        },
    );
}

worker_test!(
    remote_modules_train_through_forward_and_their_rrefs,
    3,
    |env: WorkerEnv| {
        use sluice_autograd::dist::{self, Context};
        use sluice_autograd::{DistributedOptimizer, UpdateMode};
        use sluice_pipeline::RemoteModule;

        let agent = env.agent(registry());
        if env.rank == 0 {
            let first = vec![nn::Layer::Linear { inputs: 8, outputs: 6 }, nn::Layer::Tanh];
            let second = vec![nn::Layer::Linear { inputs: 6, outputs: 3 }];
            let m1 = RemoteModule::new(&agent, "worker1/cpu", first.clone(), 1, DType::F64).unwrap();
            let m2 = RemoteModule::new(&agent, "worker2/cpu", second.clone(), 2, DType::F64).unwrap();
            let m2_ref = m2.rref().unwrap();
            let mut params = m1.parameter_rrefs().unwrap();
            params.extend(m2.parameter_rrefs().unwrap());
            assert_eq!(params.len(), 4);
            let opt = DistributedOptimizer::new(&agent, OptimizerKind::sgd(0.1), &params, UpdateMode::Locked).unwrap();
            let x = Tensor::randn(&[5, 8], 1.0, 3, DType::F64).unwrap();
            // Forward through the module, then through the other module's RRef: both recorded.
            let ctx = Context::new(&agent).unwrap();
            let h = m1.forward(&x).unwrap();
            let y: Tensor = dist::rref_rpc_sync(&agent, &m2_ref, sluice_pipeline::stage::FORWARD, &h).unwrap();
            let loss = y.mul(&y).unwrap().mean().unwrap();
            ctx.backward(std::slice::from_ref(&loss), false).unwrap();
            opt.step(ctx.id()).unwrap();
            // The same locally: one SGD step by hand.
            let l1 = nn::build(&first, 0..2, 1, DType::F64).unwrap();
            let l2 = nn::build(&second, 0..1, 2, DType::F64).unwrap();
            let yl = nn::forward(&second, &l2, &nn::forward(&first, &l1, &x).unwrap()).unwrap();
            let ll = yl.mul(&yl).unwrap().mean().unwrap();
            assert!((ll.item().unwrap() - loss.item().unwrap()).abs() < 1e-12);
            ll.backward().unwrap();
            let local: Vec<_> = l1.iter().chain(&l2).flatten().collect();
            assert_eq!(params.len(), local.len());
            for (remote, p) in params.iter().zip(local) {
                let now = remote.to_here().unwrap().data().to_f64_vec().unwrap();
                let want: Vec<f64> = p
                    .data()
                    .to_f64_vec()
                    .unwrap()
                    .iter()
                    .zip(p.grad().unwrap().to_f64_vec().unwrap())
                    .map(|(w, g)| w - 0.1 * g)
                    .collect();
                let worst = gap(&now, &want);
                assert!(worst < 1e-12, "{}: off by {worst:e}", p.name());
            }
            // Placements name a worker and a device: an unknown device is refused, and a GPU
            // the worker lacks is refused by the worker, with its reason.
            let e = RemoteModule::new(&agent, "worker1/tpu:0", second.clone(), 2, DType::F64)
                .err()
                .unwrap();
            assert!(e.to_string().contains("unknown device"), "{e}");
            if sluice_autograd::cuda::available().is_err() {
                let e = RemoteModule::new(&agent, "worker1/cuda:0", second.clone(), 2, DType::F64)
                    .err()
                    .unwrap();
                assert!(e.to_string().contains("cuda:0 is not usable on this worker"), "{e}");
            }
            assert!(RemoteModule::new(&agent, "worker1", second, 2, DType::F64).is_err());
        }
        agent.shutdown().unwrap();
    }
);

/// Serves a worker's stages until the driver says it is done (a barrier would wait for a worker
/// the test killed), then stops.
fn serve_until_done(agent: Agent) {
    let start = Instant::now();
    while !DONE.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(90) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // `test.done` set the flag from its handler, before its reply left: an immediate
    // `shutdown_now` could close the pipe under that reply, and the caller would see this
    // worker lost (CI saw it once: "peer closed the connection" on `test.done`).
    std::thread::sleep(Duration::from_millis(300));
    agent.shutdown_now();
}

fn kill(agent: &Agent, worker: &str) {
    let victim = sluice_pipeline::worker_pid(agent, worker).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

/// Every pipeline call returns an error (never hangs) on bad input and once a stage's worker is
/// gone, and the error names what failed: the input's shape, the checkpoint's path, the lost
/// worker. Bad input leaves the pipeline usable.
#[test]
fn bad_input_and_a_lost_stage_fail_every_pipeline_call() {
    const TEST: &str = "bad_input_and_a_lost_stage_fail_every_pipeline_call";
    run_workers_with(
        TEST,
        4,
        |rank| if rank == 3 { Ending::Killed } else { Ending::Success },
        |env| {
            let agent = env.agent(registry());
            if env.rank != 0 {
                return serve_until_done(agent);
            }
            let dir = scratch("lost-stage");
            let p = pipeline(&agent, &[1, 2, 3], &[3, 3, 3], options(Schedule::OneFOneB, 2));
            let (x, y) = batch(0);
            p.train_step(&x, &y).unwrap();

            // Bad input: each is refused by the stage or the driver that sees it, with the shapes.
            let narrow = Tensor::randn(&[24, 15], 1.0, 1, DType::F64).unwrap();
            let e = p.train_step(&narrow, &y).unwrap_err().to_string();
            assert!(e.contains("15"), "a 15-feature input for a 16-feature model: {e}");
            let e = p.predict(&narrow).unwrap_err().to_string();
            assert!(e.contains("15"), "{e}");
            let few = Tensor::indices(&[1, 2, 3], &[3]).unwrap();
            assert!(p.train_step(&x, &few).is_err(), "24 inputs with 3 labels");
            let out_of_range = Tensor::indices(&[12; 24], &[24]).unwrap();
            assert!(p.train_step(&x, &out_of_range).is_err(), "label 12 of 10 classes");
            // A save where nothing can be written names the path.
            let e = p
                .save(Path::new("/proc/sluice-cannot-write"), 1, serde_json::json!({}))
                .unwrap_err();
            assert!(e.to_string().contains("/proc/sluice-cannot-write"), "{e}");
            // None of that broke the pipeline.
            p.train_step(&x, &y).unwrap();
            p.save(&dir, 1, serde_json::json!({})).unwrap();

            // The last stage's worker is killed: everything that needs it fails naming it.
            kill(&agent, "worker3");
            let e = p.train_step(&x, &y).unwrap_err().to_string();
            assert!(e.contains("worker3"), "train_step: {e}");
            let e = p.predict(&x).unwrap_err().to_string();
            assert!(e.contains("worker3"), "predict: {e}");
            let e = p.save(&dir, 2, serde_json::json!({})).unwrap_err().to_string();
            assert!(e.contains("worker3"), "save: {e}");
            assert!(!checkpoint::step_dir(&dir, 2).join("MANIFEST.json").exists());
            let e = Pipeline::restore(
                &agent,
                &dir,
                &["worker1/cpu", "worker3/cpu"],
                by_counts(model().len(), &[5, 4]).unwrap(),
                options(Schedule::GPipe, 2),
            )
            .err()
            .expect("a restore onto a lost worker")
            .to_string();
            assert!(e.contains("worker3"), "restore: {e}");
            let e = Pipeline::new(
                &agent,
                model(),
                &["worker1/cpu", "worker3/cpu"],
                by_counts(model().len(), &[5, 4]).unwrap(),
                options(Schedule::GPipe, 2),
            )
            .err()
            .expect("a pipeline on a lost worker")
            .to_string();
            assert!(e.contains("worker3"), "new: {e}");
            // The survivors restore the checkpoint and train.
            let (q, m) = Pipeline::restore(
                &agent,
                &dir,
                &["worker1/cpu", "worker2/cpu"],
                by_counts(model().len(), &[5, 4]).unwrap(),
                options(Schedule::GPipe, 2),
            )
            .unwrap();
            assert_eq!(m.step, 1);
            q.train_step(&x, &y).unwrap();
            drop((p, q));
            for w in [1u32, 2] {
                let () = agent.call(w, "test.done", &()).unwrap();
            }
            let _ = std::fs::remove_dir_all(&dir);
            agent.shutdown_now();
        },
    );
}
