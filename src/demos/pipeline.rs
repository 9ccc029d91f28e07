//! Pipeline parallelism on handwritten digits: an MLP (64 → 128 → 128 → 64 → 10) split into
//! stages over the group's workers (`stage0` … `stageN-1`; `stage0` also drives), partitioned
//! automatically from a profile or by hints, trained with micro-batches under GPipe or 1F1B,
//! with a distributed checkpoint after every epoch and `--resume` from the newest.
//!
//! The data: the 1,797 8×8 images of the UCI "Optical Recognition of Handwritten Digits" test
//! set (E. Alpaydin, C. Kaynak; CC BY 4.0), pixels 0–16, bundled as `digits.bin` (64 pixels and
//! the label per image); 1,500 for training, the rest held out.
//!
//! Starts its own workers, or runs as one of them under `sluice launch --role stage=N -- sluice
//! demo pipeline --stages N`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context as _;

use sluice_agent::{Agent, Priority};
use sluice_autograd::{accuracy, DType, OptimizerKind, Rng, Tensor};
use sluice_pipeline::partition::{self, Partition};
use sluice_pipeline::schedule::{self, Schedule};
use sluice_pipeline::{nn, Pipeline, PipelineOptions, Remat};

use super::{agent_options, Demo};

const DIGITS: &[u8] = include_bytes!("digits.bin");
const PIXELS: usize = 64;
const TRAIN: usize = 1500;

/// Images (pixels scaled to 0..1, 64 per image) and their labels.
type Images = (Vec<f32>, Vec<usize>);

/// (train, test), shuffled with a fixed seed.
fn digits() -> (Images, Images) {
    let mut rows: Vec<&[u8]> = DIGITS.chunks_exact(PIXELS + 1).collect();
    let mut rng = Rng::new(5);
    for i in (1..rows.len()).rev() {
        rows.swap(i, rng.below(i + 1));
    }
    let split = |rows: &[&[u8]]| {
        let x = rows
            .iter()
            .flat_map(|r| r[..PIXELS].iter().map(|&p| p as f32 / 16.0))
            .collect();
        let y = rows.iter().map(|r| r[PIXELS] as usize).collect();
        (x, y)
    };
    (split(&rows[..TRAIN]), split(&rows[TRAIN..]))
}

fn tensors((x, y): &Images, range: std::ops::Range<usize>) -> anyhow::Result<(Tensor, Tensor)> {
    let n = range.len();
    Ok((
        Tensor::from_vec(x[range.start * PIXELS..range.end * PIXELS].to_vec(), &[n, PIXELS])?,
        Tensor::indices(&y[range], &[n])?,
    ))
}

/// The demo's MLP; wider than 1,024 it is the checkpoint benchmark's model instead, with five
/// hidden layers (four of them `width`²: about 1 GiB of f32 at 8,192).
fn model(width: usize) -> Vec<nn::Layer> {
    if width > 1024 {
        return nn::mlp(&[PIXELS, width, width, width, width, width, 10]);
    }
    nn::mlp(&[PIXELS, width, width, width.clamp(16, 64), 10])
}

/// Settings of `sluice demo pipeline`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Settings {
    pub stages: u32,
    pub micro_batches: u32,
    pub epochs: u32,
    pub schedule: Schedule,
    pub auto_partition: bool,
    pub checkpoint: Option<PathBuf>,
    pub resume: bool,
    /// Width of the hidden layers (128: the demo; ~16,000: a model of about 1 GiB, to measure
    /// checkpoint saves).
    pub width: usize,
    /// Mini-batch size.
    pub batch: usize,
    /// Every stage rematerializes.
    pub remat: bool,
    /// Backwards at normal priority (the default puts them above forwards).
    #[serde(default)]
    pub flat_priority: bool,
    /// Fault injection: the last stage pauses this long before each shard it writes.
    #[serde(default)]
    pub slow_saves_ms: u64,
}

pub fn world_size(s: &Settings) -> u32 {
    s.stages.max(1)
}

/// The settings make a pipeline: at least one stage and no more than the model has layers, at
/// least one micro-batch, and a checkpoint directory to resume from.
pub fn check(s: &Settings) -> anyhow::Result<()> {
    let layers = model(s.width).len();
    anyhow::ensure!(
        (1..=layers as u32).contains(&s.stages),
        "--stages {}: the model has {layers} layers, so 1 to {layers} stages",
        s.stages
    );
    anyhow::ensure!(s.micro_batches >= 1, "--micro-batches must be at least 1");
    anyhow::ensure!(s.width >= 1 && s.batch >= 1, "--width and --batch must be at least 1");
    anyhow::ensure!(
        !s.resume || s.checkpoint.is_some(),
        "--resume needs --checkpoint DIR (where to find the checkpoint)"
    );
    Ok(())
}

/// The checkpoint directory exists or can be made, and can be written; with `--resume`, its
/// newest complete checkpoint passes every check (sizes, CRC-32) before any stage starts.
pub fn check_files(s: &Settings) -> anyhow::Result<()> {
    let Some(dir) = &s.checkpoint else { return Ok(()) };
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--checkpoint {}: cannot create the directory", dir.display()))?;
    let probe = dir.join(format!(".sluice-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .with_context(|| format!("--checkpoint {}: cannot write there", dir.display()))?;
    if s.resume {
        let dir = std::path::absolute(dir)?;
        let manifest = sluice_pipeline::checkpoint::latest(&dir)
            .with_context(|| format!("--resume: no checkpoint to resume from in {}", dir.display()))?;
        sluice_pipeline::checkpoint::verify(&dir, &manifest)
            .with_context(|| format!("--resume: the checkpoint of step {} is damaged", manifest.step))?;
    }
    Ok(())
}

fn choose_partition(agent: &Agent, s: &Settings, stages: usize) -> anyhow::Result<Partition> {
    let model = model(s.width);
    if !s.auto_partition {
        return Ok(partition::by_weights(model.len(), &vec![1.0; stages])?);
    }
    let micro = s.batch.div_ceil(s.micro_batches as usize);
    let costs = sluice_pipeline::profile(agent, "stage0", &model, micro, DType::F32)?;
    let in_flight = schedule::peak_in_flight(s.schedule, stages, s.micro_batches as usize);
    let auto = partition::auto(&costs, &vec![u64::MAX; stages], in_flight)?;
    if let Some(best) = partition::exhaustive(&costs, &vec![u64::MAX; stages], in_flight) {
        println!(
            "automatic partition: slowest stage {:.3} ms, exhaustive search's best {:.3} ms ({:.2}×)",
            auto.bottleneck() * 1e3,
            best.bottleneck() * 1e3,
            auto.bottleneck() / best.bottleneck()
        );
    }
    Ok(auto)
}

/// Bytes written per second by a plain file write of `bytes` (synced), in `dir`: the disk's
/// own figure, measured beside the checkpoint.
fn disk_write_rate(dir: &Path, bytes: usize) -> anyhow::Result<f64> {
    use std::io::Write;
    let path = dir.join("disk-baseline.tmp");
    let data = vec![0x5au8; bytes.max(1)];
    let start = Instant::now();
    let mut f = std::fs::File::create(&path)?;
    f.write_all(&data)?;
    f.sync_all()?;
    let rate = bytes as f64 / start.elapsed().as_secs_f64();
    std::fs::remove_file(&path)?;
    Ok(rate)
}

fn checkpoint_bytes(dir: &Path, step: u64) -> u64 {
    std::fs::read_dir(sluice_pipeline::checkpoint::step_dir(dir, step))
        .map(|d| d.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// Saves a checkpoint and prints its rate beside the disk's, measured right after on the same
/// bytes.
fn save_timed(p: &Pipeline, dir: &Path, step: u64, driver: serde_json::Value) -> anyhow::Result<()> {
    let t = Instant::now();
    p.save(dir, step, driver)?;
    let secs = t.elapsed().as_secs_f64();
    let bytes = checkpoint_bytes(dir, step);
    let disk = disk_write_rate(dir, bytes as usize)?;
    println!(
        "checkpoint {step}: {:.1} MB in {:.1} ms = {:.0} MB/s; the same bytes written plainly (one file, synced): {:.0} MB/s ({:.2}×)",
        bytes as f64 / 1e6,
        secs * 1e3,
        bytes as f64 / secs / 1e6,
        disk / 1e6,
        bytes as f64 / secs / disk
    );
    Ok(())
}

pub fn run(demo: &Demo, rank: u32) -> anyhow::Result<()> {
    let Demo::Pipeline(s) = demo else { unreachable!() };
    let mut registry = sluice_agent::Registry::new();
    sluice_pipeline::install(&mut registry);
    let agent = Agent::init(agent_options(demo.worker_name(rank)), registry)?;
    if rank == 0 {
        drive(&agent, s)?;
    }
    agent.shutdown()?;
    Ok(())
}

fn drive(agent: &Agent, s: &Settings) -> anyhow::Result<()> {
    let stages = world_size(s) as usize;
    let placements: Vec<String> = (0..stages).map(|i| format!("stage{i}/cpu")).collect();
    let refs: Vec<&str> = placements.iter().map(String::as_str).collect();
    let options = PipelineOptions {
        seed: 11,
        dtype: DType::F32,
        // The asynchronous schedule updates once per micro-batch: the step is divided among
        // them, so an epoch moves the weights about as far as under the synchronous ones.
        optimizer: OptimizerKind::Sgd {
            lr: match s.schedule {
                Schedule::AsyncOneFOneB => 0.05 / s.micro_batches.max(1) as f64,
                _ => 0.05,
            },
            momentum: 0.9,
        },
        schedule: s.schedule,
        micro_batches: s.micro_batches as usize,
        remat: if s.remat { Remat::All } else { Remat::None },
        backward_priority: if s.flat_priority {
            Priority::NORMAL
        } else {
            Priority::HIGH
        },
    };
    let partition = choose_partition(agent, s, stages)?;
    let (pipeline, first_epoch) = match (&s.checkpoint, s.resume) {
        (Some(dir), true) => {
            let (p, m) = Pipeline::restore(agent, dir, &refs, partition, options)?;
            let next = m.driver["next_epoch"].as_u64().unwrap_or(m.step);
            println!("resumed from {} (step {}), epoch {next}", dir.display(), m.step);
            (p, next as u32)
        }
        _ => (Pipeline::new(agent, model(s.width), &refs, partition, options)?, 0),
    };
    print!("{}", pipeline.partition());
    if s.slow_saves_ms > 0 {
        pipeline.pause_saves(stages - 1, s.slow_saves_ms)?;
    }
    if s.epochs == 0 {
        // Only a checkpoint of the initial model, timed against the disk.
        if let Some(dir) = &s.checkpoint {
            save_timed(&pipeline, dir, 0, serde_json::json!({ "next_epoch": 0 }))?;
        }
        return Ok(());
    }
    let (train, test) = digits();
    let eval = |p: &Pipeline| -> anyhow::Result<f64> {
        let (x, y) = tensors(&test, 0..test.1.len())?;
        Ok(accuracy(&p.predict(&x)?, &y)?)
    };
    let before = eval(&pipeline)?;
    {
        let (x, y) = tensors(&train, 0..s.batch.clamp(1, TRAIN))?;
        let held: Vec<String> = pipeline
            .activation_memory(&x, &y)?
            .iter()
            .map(|b| format!("{:.1}", *b as f64 / (1 << 20) as f64))
            .collect();
        println!(
            "activations held per stage for one mini-batch of {} (MiB){}: {}",
            s.batch,
            if s.remat { ", rematerializing" } else { "" },
            held.join(" / ")
        );
    }
    let batch = s.batch.clamp(1, TRAIN);
    let batches = TRAIN / batch;
    let start = Instant::now();
    let mut samples = 0usize;
    let mut bubbles = Vec::new();
    for epoch in first_epoch..s.epochs {
        let mut total = 0.0;
        let busy_before = pipeline.busy()?;
        let epoch_start = Instant::now();
        for b in 0..batches {
            let (x, y) = tensors(&train, b * batch..(b + 1) * batch)?;
            total += pipeline.train_step(&x, &y)?.loss;
            samples += batch;
        }
        let bubble =
            sluice_pipeline::measured_bubble(&busy_before, &pipeline.busy()?, epoch_start.elapsed().as_secs_f64());
        bubbles.push(bubble);
        println!(
            "epoch {epoch}: loss {:.4}, measured bubble {:.0}%",
            total / batches as f64,
            bubble * 100.0
        );
        if let Some(dir) = &s.checkpoint {
            let step = u64::from(epoch) + 1;
            save_timed(&pipeline, dir, step, serde_json::json!({ "next_epoch": epoch + 1 }))?;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let memory: Vec<String> = pipeline
        .memory()?
        .iter()
        .map(|(peak, _)| format!("{:.1}", *peak as f64 / (1 << 20) as f64))
        .collect();
    println!(
        "peak resident memory per stage process (MiB){}: {}",
        if s.remat { ", rematerializing" } else { "" },
        memory.join(" / ")
    );
    let mean_bubble = bubbles.iter().sum::<f64>() / bubbles.len().max(1) as f64;
    println!(
        "{stages} stages, {} micro-batches ({:?}, bubble measured {:.0}%, theoretical {:.0}%): {:.0} samples/s; held-out accuracy {:.1}% → {:.1}%",
        s.micro_batches,
        s.schedule,
        mean_bubble * 100.0,
        schedule::theoretical_bubble(stages, s.micro_batches as usize) * 100.0,
        samples as f64 / secs.max(1e-9),
        before * 100.0,
        eval(&pipeline)? * 100.0
    );
    Ok(())
}
