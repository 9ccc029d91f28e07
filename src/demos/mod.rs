//! The training demos behind `sluice demo …` and the examples: a parameter server, a pipeline,
//! and an agent driving observers. Each starts its worker processes itself (this executable,
//! re-run with the torchrun variables and `SLUICE_DEMO` set), so one command runs the group.

pub mod data;
pub mod pipeline;
pub mod ps;
pub mod rl;

use std::process::{Child, Command, Stdio};

use anyhow::Context as _;

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
    },
    /// Pipeline parallelism over `stages` workers.
    Pipeline(pipeline::Settings),
    /// Agent and observers: observers, rounds.
    Rl { observers: u32, rounds: u32 },
}

impl Demo {
    fn world_size(&self) -> u32 {
        match self {
            Demo::Ps { trainers, .. } => trainers + 1,
            Demo::Pipeline(s) => pipeline::world_size(s),
            Demo::Rl { observers, .. } => observers + 1,
        }
    }

    fn run_rank(&self, rank: u32) -> anyhow::Result<()> {
        match self {
            Demo::Ps { .. } => ps::run(self, rank),
            Demo::Pipeline { .. } => pipeline::run(self, rank),
            Demo::Rl { .. } => rl::run(self, rank),
        }
    }
}

/// `sluice demo …` (and the examples): which demo, with what settings.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DemoCommand {
    /// Parameter server: an MLP on rank 0, trainers driving it with distributed autograd.
    Ps {
        #[arg(long, default_value_t = 2)]
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
    },
    /// Pipeline parallelism: an MLP on handwritten digits split over stages, micro-batched
    /// (GPipe, 1F1B or asynchronous 1F1B), partitioned from a profile, checkpointed every epoch.
    Pipeline {
        #[arg(long, default_value_t = 4)]
        stages: u32,
        #[arg(long, default_value_t = 8)]
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
        #[arg(long, default_value_t = 128)]
        width: usize,
        /// Mini-batch size.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Rematerialize: stages keep only their inputs and recompute activations in the
        /// backward.
        #[arg(long)]
        remat: bool,
    },
    /// An agent driving observers through RPC and RRefs (REINFORCE).
    Rl {
        #[arg(long, default_value_t = 4)]
        observers: u32,
        #[arg(long, default_value_t = 60)]
        rounds: u32,
    },
}

impl From<DemoCommand> for Demo {
    fn from(c: DemoCommand) -> Demo {
        match c {
            DemoCommand::Ps {
                trainers,
                epochs,
                sync,
                gpu,
            } => Demo::Ps {
                trainers: trainers.max(1),
                epochs,
                reducer: sync,
                gpu,
            },
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
            } => Demo::Pipeline(pipeline::Settings {
                stages: stages.max(1),
                micro_batches: micro_batches.max(1),
                epochs,
                schedule,
                auto_partition: partition != "hints",
                checkpoint,
                resume,
                width: width.max(1),
                batch: batch.max(1),
                remat,
            }),
            DemoCommand::Rl { observers, rounds } => Demo::Rl {
                observers: observers.max(1),
                rounds: rounds.max(1),
            },
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

/// Runs `demo`: this process is rank 0; ranks 1.. are started as children. Under `sluice
/// launch` (which names each worker) every process is already one of the group: it runs its
/// own rank only.
pub fn launch(demo: Demo) -> anyhow::Result<()> {
    if std::env::var("SLUICE_WORKER_NAME").is_ok() {
        let rank: u32 = std::env::var("RANK")?.parse()?;
        return demo.run_rank(rank);
    }
    if let Demo::Ps { gpu: true, .. } = demo {
        // Say so before starting anyone, rather than through a failed rank.
        sluice_autograd::cuda::available().map_err(|e| anyhow::anyhow!("--gpu needs CUDA, NVRTC and cuBLAS: {e}"))?;
    }
    let n = demo.world_size();
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let exe = std::env::current_exe()?;
    let args = serde_json::to_string(&demo)?;
    std::env::set_var("RANK", "0");
    std::env::set_var("WORLD_SIZE", n.to_string());
    std::env::set_var("MASTER_ADDR", "127.0.0.1");
    std::env::set_var("MASTER_PORT", port.to_string());
    let mut children: Vec<Child> = (1..n)
        .map(|rank| {
            Command::new(&exe)
                .env(ROLE_VAR, "1")
                .env(ARGS_VAR, &args)
                .env("RANK", rank.to_string())
                .stdin(Stdio::null())
                .spawn()
                .with_context(|| format!("starting rank {rank}"))
        })
        .collect::<anyhow::Result<_>>()?;
    let result = demo.run_rank(0);
    for (i, c) in children.iter_mut().enumerate() {
        let status = c.wait()?;
        anyhow::ensure!(status.success(), "rank {} failed: {status}", i + 1);
    }
    result
}

pub(crate) fn agent_options(name: String) -> sluice_agent::AgentOptions {
    let mut o = sluice_agent::AgentOptions::new(name);
    o.pool_threads = 8;
    o
}

pub(crate) fn handler_error(e: impl std::fmt::Display) -> sluice_agent::HandlerError {
    sluice_agent::HandlerError::new("Error", e.to_string())
}
