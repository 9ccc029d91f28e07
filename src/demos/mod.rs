//! The training demos behind `sluice demo …` and the examples: a parameter server, a pipeline,
//! and an agent driving observers. Each starts its worker processes itself (this executable,
//! re-run with the torchrun variables and `SLUICE_DEMO` set), so one command runs the group.

pub mod data;
pub mod ddp;
pub mod pipeline;
pub mod ps;
pub mod remote;
pub mod rl;

use std::time::Duration;

use anyhow::Context as _;

use crate::launch::{supervise, Job, Outcome, Slot};

const ROLE_VAR: &str = "SLUICE_DEMO";
const ARGS_VAR: &str = "SLUICE_DEMO_ARGS";

/// Which demo and with which arguments (the same for every process of the group).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Demo {
    /// Parameter server: trainers, steps per trainer, synchronous reducer (None: Hogwild).
    Ps {
        trainers: u32,
        epochs: u32,
        reducer: Option<ps::Reducer>,
        /// The server's parameters live on `cuda:0`.
        gpu: bool,
        /// Trainers' pulls (the forward calls) go at high priority.
        urgent_pulls: bool,
    },
    /// Data parallelism: workers, epochs.
    Ddp { workers: u32, epochs: u32 },
    /// Pipeline parallelism over `stages` workers.
    Pipeline(pipeline::Settings),
    /// Agent and observers: observers, rounds.
    Rl { observers: u32, rounds: u32 },
    /// Remote tensors: a model on worker 1 trained from rank 0; `per_op`: no fusion.
    Remote { epochs: u32, per_op: bool },
}

impl Demo {
    fn world_size(&self) -> u32 {
        match self {
            Demo::Ps { trainers, .. } => trainers + 1,
            Demo::Ddp { workers, .. } => *workers,
            Demo::Pipeline(s) => pipeline::world_size(s),
            Demo::Rl { observers, .. } => observers + 1,
            Demo::Remote { .. } => 2,
        }
    }

    /// The name rank `rank`'s worker joins the group under.
    pub fn worker_name(&self, rank: u32) -> String {
        match (self, rank) {
            (Demo::Ps { .. }, 0) => "ps".to_owned(),
            (Demo::Ps { .. }, r) => format!("trainer{r}"),
            (Demo::Ddp { .. }, r) => format!("worker{r}"),
            (Demo::Pipeline(_), r) => format!("stage{r}"),
            (Demo::Rl { .. }, 0) => "agent".to_owned(),
            (Demo::Rl { .. }, r) => format!("observer{r}"),
            (Demo::Remote { .. }, r) => format!("worker{r}"),
        }
    }

    /// Checks the settings before any process starts (every rank checks them again).
    pub fn check(&self) -> anyhow::Result<()> {
        match self {
            Demo::Ps { trainers, .. } => anyhow::ensure!(*trainers >= 1, "--trainers must be at least 1"),
            Demo::Ddp { workers, .. } => anyhow::ensure!(*workers >= 1, "--workers must be at least 1"),
            Demo::Pipeline(s) => pipeline::check(s)?,
            Demo::Rl { observers, rounds } => {
                anyhow::ensure!(*observers >= 1, "--observers must be at least 1");
                anyhow::ensure!(*rounds >= 1, "--rounds must be at least 1");
            }
            Demo::Remote { epochs, .. } => anyhow::ensure!(*epochs >= 1, "--epochs must be at least 1"),
        }
        Ok(())
    }

    /// The checks that touch files (a checkpoint directory that can be written, a checkpoint to
    /// resume from that is whole), made once by whoever starts the group.
    pub fn check_files(&self) -> anyhow::Result<()> {
        match self {
            Demo::Pipeline(s) => pipeline::check_files(s),
            _ => Ok(()),
        }
    }

    fn run_rank(&self, rank: u32) -> anyhow::Result<()> {
        match self {
            Demo::Ps { .. } => ps::run(self, rank),
            Demo::Ddp { .. } => ddp::run(self, rank),
            Demo::Pipeline { .. } => pipeline::run(self, rank),
            Demo::Rl { .. } => rl::run(self, rank),
            Demo::Remote { .. } => remote::run(self, rank),
        }
    }
}

/// `sluice demo …` (and the examples): which demo, with what settings.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DemoCommand {
    /// Parameter server: an MLP on rank 0, trainers driving it with distributed autograd.
    Ps {
        #[arg(long, default_value_t = 2, value_parser = at_least_one())]
        trainers: u32,
        #[arg(long, default_value_t = 100)]
        epochs: u32,
        /// Synchronous training with this gradient reducer (mean or median); Hogwild without.
        #[arg(long, value_name = "REDUCER")]
        sync: Option<ps::Reducer>,
        /// Keep the server's parameters (and its forward, backward and optimizer steps) on
        /// the GPU `cuda:0`; trainers stay on the CPU.
        #[arg(long)]
        gpu: bool,
        /// Trainers mark their pulls (the forward call that reads the parameters) urgent: the
        /// server serves them before queued backward and optimizer work.
        #[arg(long)]
        urgent_pulls: bool,
    },
    /// Data parallelism: the parameter server's model and data, a replica per worker, the
    /// gradients averaged by allreduce every step (compare `ps --sync mean`).
    Ddp {
        #[arg(long, default_value_t = 2, value_parser = at_least_one())]
        workers: u32,
        #[arg(long, default_value_t = 100)]
        epochs: u32,
    },
    /// Pipeline parallelism: an MLP on handwritten digits split over stages, micro-batched
    /// (GPipe, 1F1B or asynchronous 1F1B), partitioned from a profile, checkpointed every epoch.
    Pipeline {
        /// Stage processes (1 up to the model's layer count).
        #[arg(long, default_value_t = 4, value_parser = at_least_one())]
        stages: u32,
        #[arg(long, default_value_t = 8, value_parser = at_least_one())]
        micro_batches: u32,
        #[arg(long, default_value_t = 10)]
        epochs: u32,
        /// gpipe, 1f1b or async-1f1b (PipeDream: an update per micro-batch, weight stashing).
        #[arg(long, default_value = "1f1b")]
        schedule: sluice_pipeline::Schedule,
        /// auto (from a profile of each layer) or hints (equal shares of the layers).
        #[arg(long, default_value = "auto", value_parser = ["auto", "hints"])]
        partition: String,
        /// Save a distributed checkpoint here after every epoch.
        #[arg(long)]
        checkpoint: Option<std::path::PathBuf>,
        /// Start from the newest checkpoint in --checkpoint.
        #[arg(long)]
        resume: bool,
        /// Hidden width (about 16000 makes a 1 GiB model; with --epochs 0 and --checkpoint,
        /// only the initial model is saved and timed against the disk).
        #[arg(long, default_value_t = 128, value_parser = positive_size)]
        width: usize,
        /// Mini-batch size.
        #[arg(long, default_value_t = 64, value_parser = positive_size)]
        batch: usize,
        /// Rematerialize: stages keep only their inputs and recompute activations in the
        /// backward.
        #[arg(long)]
        remat: bool,
        /// Backwards at normal priority, like forwards (by default they go above: 1F1B's
        /// rule), to measure what the priority changes.
        #[arg(long)]
        flat_priority: bool,
        /// Fault injection for the CLI tests: the last stage pauses this many milliseconds
        /// before each checkpoint shard it writes.
        #[arg(long, hide = true, default_value_t = 0)]
        slow_saves_ms: u64,
    },
    /// An agent driving observers through RPC and RRefs (REINFORCE).
    Rl {
        #[arg(long, default_value_t = 4, value_parser = at_least_one())]
        observers: u32,
        #[arg(long, default_value_t = 60, value_parser = at_least_one())]
        rounds: u32,
    },
    /// Remote tensors: the model written against tensors placed with to("worker1/cpu"), every
    /// forward fused into one call, trained from rank 0 with distributed autograd.
    Remote {
        #[arg(long, default_value_t = 30)]
        epochs: u32,
        /// One call per operation instead of one per forward (to compare).
        #[arg(long)]
        per_op: bool,
    },
}

fn at_least_one() -> clap::builder::RangedI64ValueParser<u32> {
    clap::value_parser!(u32).range(1..)
}

fn positive_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

impl From<DemoCommand> for Demo {
    fn from(c: DemoCommand) -> Demo {
        match c {
            DemoCommand::Ps {
                trainers,
                epochs,
                sync,
                gpu,
                urgent_pulls,
            } => Demo::Ps {
                trainers,
                epochs,
                reducer: sync,
                gpu,
                urgent_pulls,
            },
            DemoCommand::Ddp { workers, epochs } => Demo::Ddp { workers, epochs },
            DemoCommand::Pipeline {
                stages,
                micro_batches,
                epochs,
                schedule,
                partition,
                checkpoint,
                resume,
                width,
                batch,
                remat,
                flat_priority,
                slow_saves_ms,
            } => Demo::Pipeline(pipeline::Settings {
                stages,
                micro_batches,
                epochs,
                schedule,
                auto_partition: partition != "hints",
                checkpoint,
                resume,
                width,
                batch,
                remat,
                flat_priority,
                slow_saves_ms,
            }),
            DemoCommand::Rl { observers, rounds } => Demo::Rl { observers, rounds },
            DemoCommand::Remote { epochs, per_op } => Demo::Remote { epochs, per_op },
        }
    }
}

#[derive(clap::Parser)]
struct ExampleCli {
    #[command(subcommand)]
    demo: DemoCommand,
}

/// The `main` of an example: `which` is the demo's subcommand name, the arguments follow.
pub fn example_main(which: &str) -> anyhow::Result<()> {
    if let Some(result) = child_main() {
        return result;
    }
    use clap::Parser;
    let mut args: Vec<String> = std::env::args().collect();
    args.insert(1, which.to_owned());
    launch(ExampleCli::parse_from(args).demo.into())
}

/// In a demo's worker process: runs its rank and returns `Some`; elsewhere `None`.
pub fn child_main() -> Option<anyhow::Result<()>> {
    std::env::var(ROLE_VAR).ok()?;
    Some((|| {
        let demo: Demo = serde_json::from_str(&std::env::var(ARGS_VAR)?)?;
        let rank: u32 = std::env::var("RANK")?.parse()?;
        demo.run_rank(rank)
    })())
}

/// Runs `demo`: checks its settings, then starts every rank as a process of its own and
/// watches them as `sluice launch` does: the first to fail (an error, a signal) is named and the
/// others are stopped, and the error is this function's. Under `sluice launch` (which names
/// each worker) every process is already one of the group: it runs its own rank only.
pub fn launch(demo: Demo) -> anyhow::Result<()> {
    demo.check()?;
    if std::env::var("SLUICE_WORKER_NAME").is_ok() {
        let rank: u32 = std::env::var("RANK")?.parse()?;
        let world: u32 = std::env::var("WORLD_SIZE")?.parse()?;
        anyhow::ensure!(
            world == demo.world_size(),
            "this demo needs {} workers and `sluice launch` started {world}",
            demo.world_size()
        );
        if rank == 0 {
            demo.check_files()?;
        }
        return demo.run_rank(rank);
    }
    if let Demo::Ps { gpu: true, .. } = demo {
        // Say so before starting anyone, rather than through a failed rank.
        sluice_autograd::cuda::available().map_err(|e| anyhow::anyhow!("--gpu needs CUDA, NVRTC and cuBLAS: {e}"))?;
    }
    demo.check_files()?;
    let n = demo.world_size();
    let job = Job {
        label: "sluice demo",
        slots: (0..n)
            .map(|rank| Slot {
                name: demo.worker_name(rank),
                role: "worker".to_owned(),
                rank,
                role_rank: rank,
                role_size: n,
            })
            .collect(),
        cmd: vec![std::env::current_exe().context("this executable")?.into()],
        env: vec![
            (ROLE_VAR.to_owned(), "1".to_owned()),
            (ARGS_VAR.to_owned(), serde_json::to_string(&demo)?),
        ],
        prefix_output: false,
        max_restarts: 0,
        grace: Duration::from_secs(2),
        store: None,
    };
    match supervise(&job)? {
        Outcome::Finished => Ok(()),
        Outcome::Failed(why) => Err(anyhow::anyhow!(why)),
    }
}

pub(crate) fn agent_options(name: String) -> sluice_agent::AgentOptions {
    let mut o = sluice_agent::AgentOptions::new(name);
    o.pool_threads = 8;
    o
}

pub(crate) fn handler_error(e: impl std::fmt::Display) -> sluice_agent::HandlerError {
    sluice_agent::HandlerError::new("Error", e.to_string())
}
