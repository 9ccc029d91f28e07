//! The channel conformance suite (`sluice_tests::conformance::channel`), instantiated for every
//! channel: the CPU channels over each transport they run on (and cma with each of its data
//! paths), rdma on the in-process verbs model, and the CUDA channels, which skip with the reason
//! where there is no GPU (or no second GPU, or no RDMA NIC) and run under
//! `scripts/gpu-check.sh`.

use sluice_channel::channel::{cma, multilane, rdma};
use sluice_channel::cuda::staged::CHUNK;
use sluice_channel::{ChannelKind, Context, ContextOptions, Device, TransportKind};
use sluice_tests::channel_conformance;
use sluice_tests::conformance::channel::Backend;

fn peer() -> String {
    sluice_tests::peer_exe(env!("CARGO_BIN_EXE_sluice-test-peer"))
}

fn options(transports: &[TransportKind], channels: &[ChannelKind]) -> ContextOptions {
    sluice_tests::offering(transports, channels)
}

const CPU: (Device, Device) = (Device::Cpu, Device::Cpu);
const GPU0: Device = Device::Cuda(0);

/// Declares a backend: `backend!(Name, "name", channel, route, options-expression { extra items })`.
macro_rules! backend {
    ($ty:ident, $channel:expr, $route:expr, $opts:expr $(, { $($extra:tt)* })?) => {
        struct $ty;
        impl Backend for $ty {
            const NAME: &'static str = stringify!($ty);
            const CHANNEL: ChannelKind = $channel;
            const ROUTE: (Device, Device) = $route;
            fn options() -> ContextOptions {
                $opts
            }
            $($($extra)*)?
        }
    };
}

// ---- CPU channels ----

backend!(
    BasicTcp,
    ChannelKind::Basic,
    CPU,
    options(&[TransportKind::Tcp], &[ChannelKind::Basic])
);
backend!(
    BasicShm,
    ChannelKind::Basic,
    CPU,
    options(&[TransportKind::Shm], &[ChannelKind::Basic]),
    {
        fn edge_sizes() -> Vec<usize> {
            // Frames larger than the shm ring.
            vec![3 << 20]
        }
    }
);
backend!(
    CmaShm,
    ChannelKind::Cma,
    CPU,
    options(&[TransportKind::Shm], &[ChannelKind::Cma]),
    {
        fn edge_sizes() -> Vec<usize> {
            vec![cma::INLINE_MAX - 1, cma::INLINE_MAX, 64 << 10, (64 << 10) + 1]
        }
    }
);
// No shared segment: everything from INLINE_MAX up is read by process_vm_readv and acknowledged.
backend!(
    CmaWithoutSegment,
    ChannelKind::Cma,
    CPU,
    ContextOptions {
        segment_bytes: 0,
        ..options(&[TransportKind::Shm], &[ChannelKind::Cma])
    }
);
// A 2 MiB segment: tensors that fit go through it, larger ones (and those arriving while it is
// full) by process_vm_readv, mixed within messages.
backend!(
    CmaSmallSegment,
    ChannelKind::Cma,
    CPU,
    ContextOptions {
        segment_bytes: 2 << 20,
        ..options(&[TransportKind::Tcp], &[ChannelKind::Cma])
    }
);
backend!(
    MultiLaneTcp,
    ChannelKind::MultiLane,
    CPU,
    options(&[TransportKind::Tcp], &[ChannelKind::MultiLane]),
    {
        fn edge_sizes() -> Vec<usize> {
            vec![multilane::MIN_PIECE - 1, multilane::MIN_PIECE * 4 + 1, 9 << 20]
        }
    }
);
backend!(
    RdmaVerbsModel,
    ChannelKind::Rdma,
    CPU,
    ContextOptions {
        ibv: sluice_transport::ibv::IbvOptions {
            device: sluice_transport::ibv::DeviceChoice::Model,
            ..Default::default()
        },
        ..options(&[TransportKind::Ibv], &[ChannelKind::Rdma])
    },
    {
        fn edge_sizes() -> Vec<usize> {
            vec![rdma::INLINE_MAX - 1, rdma::INLINE_MAX]
        }
        fn no_peer_process() -> Option<String> {
            Some("the verbs model is a fabric inside one process".into())
        }
    }
);

channel_conformance!(basic_tcp, BasicTcp, peer());
channel_conformance!(basic_shm, BasicShm, peer());
channel_conformance!(cma_shm, CmaShm, peer());
channel_conformance!(cma_without_segment, CmaWithoutSegment, peer());
channel_conformance!(cma_small_segment, CmaSmallSegment, peer());
channel_conformance!(multilane_tcp, MultiLaneTcp, peer());
channel_conformance!(rdma_verbs_model, RdmaVerbsModel, peer());

// ---- CUDA channels (skipped, with the reason, without a GPU) ----

fn cuda_options(transports: &[TransportKind], channel: ChannelKind) -> ContextOptions {
    options(transports, &[ChannelKind::Basic, channel])
}

fn staged_sizes() -> Vec<usize> {
    vec![CHUNK - 1, CHUNK + 3, 3 * CHUNK + 1]
}

/// Why fewer than `n` GPUs are visible, if so.
fn fewer_gpus_than(n: usize) -> Option<String> {
    match sluice_channel::cuda::runtime() {
        Ok(cuda) if cuda.gpus.len() >= n => None,
        Ok(cuda) => Some(format!("needs {n} GPUs, {} visible", cuda.gpus.len())),
        Err(e) => Some(e.to_string()),
    }
}

backend!(
    CudaIpc,
    ChannelKind::CudaIpc,
    (GPU0, GPU0),
    cuda_options(&[TransportKind::Shm], ChannelKind::CudaIpc)
);
backend!(
    CudaP2pLoopback,
    ChannelKind::CudaP2p,
    (GPU0, GPU0),
    ContextOptions {
        cuda_p2p_loopback: true,
        ..cuda_options(&[TransportKind::Shm], ChannelKind::CudaP2p)
    },
    {
        fn no_peer_process() -> Option<String> {
            Some("loopback pairs a GPU with itself only within one process".into())
        }
    }
);
backend!(
    CudaP2p,
    ChannelKind::CudaP2p,
    (GPU0, Device::Cuda(1)),
    cuda_options(&[TransportKind::Shm], ChannelKind::CudaP2p),
    {
        fn unavailable() -> Option<String> {
            fewer_gpus_than(2)
        }
    }
);
backend!(
    CudaStagedTcp,
    ChannelKind::CudaStaged,
    (GPU0, GPU0),
    cuda_options(&[TransportKind::Tcp], ChannelKind::CudaStaged),
    {
        fn edge_sizes() -> Vec<usize> {
            staged_sizes()
        }
    }
);
backend!(
    CudaStagedToCpu,
    ChannelKind::CudaStaged,
    (GPU0, Device::Cpu),
    cuda_options(&[TransportKind::Shm], ChannelKind::CudaStaged),
    {
        fn edge_sizes() -> Vec<usize> {
            staged_sizes()
        }
    }
);
backend!(
    CudaGdr,
    ChannelKind::CudaGdr,
    (GPU0, GPU0),
    cuda_options(&[TransportKind::Ibv], ChannelKind::CudaGdr),
    {
        fn unavailable() -> Option<String> {
            let ctx = match Context::new(Self::options()) {
                Ok(ctx) => ctx,
                Err(e) => return Some(format!("no context with the ibverbs transport: {e}")),
            };
            if ctx.channels().contains(&ChannelKind::CudaGdr) {
                None
            } else {
                Some("cuda_gdr is not viable here: it needs a GPU and an RDMA NIC it can register GPU memory with (dma-buf or nvidia-peermem)".into())
            }
        }
    }
);

channel_conformance!(cuda_ipc, CudaIpc, peer());
channel_conformance!(cuda_p2p_loopback, CudaP2pLoopback, peer());
channel_conformance!(cuda_p2p, CudaP2p, peer());
channel_conformance!(cuda_staged_tcp, CudaStagedTcp, peer());
channel_conformance!(cuda_staged_to_cpu, CudaStagedToCpu, peer());
channel_conformance!(cuda_gdr, CudaGdr, peer());
