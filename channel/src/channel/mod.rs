//! Channels: what moves tensor bytes for one peer pair, and how each takes part in
//! negotiation.
//!
//! Each channel answers the same three questions the transports do: can it run here
//! ([`ChannelContext::viability`]), what it looks like from here, per device
//! ([`ChannelContext::device_descriptors`]), and whether it can reach a peer's device
//! ([`ChannelContext::can_communicate`]). The pipe compares and picks by priority; it never
//! special-cases a channel during negotiation.
//!
//! Each channel's module also owns its data path: how the sender prepares a tensor and says
//! where it is (a wire `Source`), what it sends, how the receiver checks and moves it, and its
//! part of the acknowledgement. `path` is the one place that dispatches on the channel; the
//! pipe itself keeps ordering, acknowledgements and sticky errors only. (The CUDA channels'
//! paths sit with their protocol in [`crate::cuda`]: `direct` for cuda_ipc and cuda_p2p,
//! `staged` for cuda_staged.)
//!
//! - **basic**: tensor bytes as frames on the pipe's control connection (whatever transport it
//!   negotiated). Works everywhere.
//! - **cma**: the receiver copies straight out of the sender's memory with `process_vm_readv`
//!   (one copy, no staging). Same host, same user, ptrace permission; probed at start-up and
//!   again against the actual peer at pipe setup.
//! - **multilane**: a large tensor is cut into equal contiguous pieces sent in parallel over N
//!   TCP connections, each driven by its own task (so by several cores).
//! - **cuda_ipc**: GPU to the same GPU on this host: the receiver opens the sender's memory
//!   (CUDA IPC; a plain address within one process) and copies device to device, ordered by
//!   events on both sides' streams.
//! - **cuda_p2p**: GPU to another GPU of this host with peer access both ways (NVLink or PCIe),
//!   the same way.
//! - **cuda_staged**: any pair with a GPU on one side, through pinned host memory in pipelined
//!   chunks on the pipe's connection; works across hosts.
//! - **rdma**: CPU to CPU over the pipe's ibverbs connection: the receiver RDMA-reads the
//!   tensor straight from the sender's memory (zero copies; small tensors ride the ring).
//! - **cuda_gdr**: GPU to GPU (or a GPU and a CPU) over the pipe's ibverbs connection with
//!   GPUDirect RDMA: the NIC reads and writes GPU memory registered through dma-buf or the
//!   peer-memory module.

pub mod basic;
pub mod cma;
pub mod cuda;
pub mod gdr;
pub mod multilane;
pub(crate) mod path;
pub mod rdma;
pub mod segment;

pub use basic::BasicContext;
pub use multilane::MultiLaneContext;

use crate::device::Device;

/// The channels Sluice knows, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChannelKind {
    Basic,
    Cma,
    MultiLane,
    CudaIpc,
    CudaP2p,
    CudaStaged,
    Rdma,
    CudaGdr,
}

impl ChannelKind {
    /// Every channel, in the default priority order.
    pub const ALL: [ChannelKind; 8] = [
        ChannelKind::Rdma,
        ChannelKind::Cma,
        ChannelKind::MultiLane,
        ChannelKind::Basic,
        ChannelKind::CudaIpc,
        ChannelKind::CudaP2p,
        ChannelKind::CudaGdr,
        ChannelKind::CudaStaged,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ChannelKind::Basic => "basic",
            ChannelKind::Cma => "cma",
            ChannelKind::MultiLane => "multilane",
            ChannelKind::CudaIpc => "cuda_ipc",
            ChannelKind::CudaP2p => "cuda_p2p",
            ChannelKind::CudaStaged => "cuda_staged",
            ChannelKind::Rdma => "rdma",
            ChannelKind::CudaGdr => "cuda_gdr",
        }
    }

    /// Whether it moves GPU memory (so it needs a CUDA tensor on at least one side).
    pub fn is_cuda(self) -> bool {
        matches!(
            self,
            ChannelKind::CudaIpc | ChannelKind::CudaP2p | ChannelKind::CudaStaged | ChannelKind::CudaGdr
        )
    }

    /// Whether it borrows the queue pair of an ibverbs control connection.
    pub fn needs_ibv(self) -> bool {
        matches!(self, ChannelKind::Rdma | ChannelKind::CudaGdr)
    }

    /// Whether the receiver copies straight from the sender's GPU memory (and acknowledges).
    pub fn is_direct_cuda(self) -> bool {
        matches!(self, ChannelKind::CudaIpc | ChannelKind::CudaP2p)
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for ChannelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A channel's negotiation hooks.
pub trait ChannelContext: Send + Sync {
    fn kind(&self) -> ChannelKind;

    /// `Ok` when the channel can run here; otherwise why not.
    fn viability(&self) -> Result<(), String>;

    /// One descriptor per device this channel serves here.
    fn device_descriptors(&self) -> Vec<(Device, String)>;

    /// Whether this channel on a local device described by `local` can move data to or from a
    /// remote device described by `remote`. Must be symmetric.
    fn can_communicate(&self, local: &str, remote: &str) -> bool {
        local == remote
    }
}
