//! The CUDA channels' negotiation hooks. Their data paths sit with their protocol in
//! [`crate::cuda`]: `direct` (cuda_ipc, cuda_p2p) and [`crate::cuda::staged`].
//!
//! Each is viable only when CUDA is (see [`crate::cuda::runtime`]) and what it needs actually
//! works here: cuda_ipc exports a probe allocation and an interprocess event at start-up (some
//! platforms refuse CUDA IPC); cuda_p2p needs a GPU with a peer. When not viable, the channel
//! is logged with the reason and not offered, and CPU work is untouched.

use std::sync::OnceLock;

use super::{ChannelContext, ChannelKind};
use crate::cuda::descriptor::{self, GpuDescriptor};
use crate::cuda::{self, Cuda, CudaError};
use crate::device::Device;

/// A random token naming this process in descriptors (pids repeat across namespaces).
pub fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| rand::random::<u64>() | 1)
}

fn host() -> Result<String, String> {
    sluice_transport::host::identity(&["ipc", "pid"]).ok_or_else(|| "cannot read the boot id or namespaces".into())
}

fn descriptors(cuda: &Cuda, host: &str, with_peers: bool, loopback: bool) -> Vec<(Device, String)> {
    cuda.gpus
        .iter()
        .map(|g| {
            let mut peers: Vec<String> = if with_peers {
                g.peers
                    .iter()
                    .filter_map(|&p| cuda.gpu(p).ok())
                    .map(|p| p.uuid.to_string())
                    .collect()
            } else {
                Vec::new()
            };
            if loopback {
                peers.push(g.uuid.to_string());
            }
            let d = GpuDescriptor {
                host: host.to_owned(),
                process: process_token(),
                gpu: g.uuid.to_string(),
                peers,
            };
            (Device::Cuda(g.index), d.encode())
        })
        .collect()
}

/// What a CUDA channel offers: its descriptors, or why it cannot run here.
struct Offer(Result<Vec<(Device, String)>, String>);

impl Offer {
    fn viability(&self) -> Result<(), String> {
        self.0.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    fn descriptors(&self) -> Vec<(Device, String)> {
        self.0.clone().unwrap_or_default()
    }
}

/// Whether CUDA IPC works here, found out once per process.
fn ipc_works() -> Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT
        .get_or_init(|| ipc_self_test().map_err(|e| format!("CUDA IPC does not work here: {e}")))
        .clone()
}

/// Exports a probe allocation and an interprocess event.
fn ipc_self_test() -> Result<(), CudaError> {
    let stream = cuda::Stream::new(0)?;
    let probe = cuda::CudaBuffer::alloc(256, &stream)?;
    probe.ipc_export()?;
    cuda::events::EventSlot::take(0)?;
    Ok(())
}

/// cuda_ipc: the same GPU, another process on this host (or this process).
pub struct CudaIpcContext {
    offer: Offer,
}

impl CudaIpcContext {
    pub fn new() -> Self {
        let state = (|| {
            let cuda = cuda::runtime().map_err(|e| e.to_string())?;
            let host = host()?;
            ipc_works()?;
            Ok(descriptors(cuda, &host, false, false))
        })();
        CudaIpcContext { offer: Offer(state) }
    }
}

impl Default for CudaIpcContext {
    fn default() -> Self {
        Self::new()
    }
}

impl ChannelContext for CudaIpcContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::CudaIpc
    }

    fn viability(&self) -> Result<(), String> {
        self.offer.viability()
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        self.offer.descriptors()
    }

    fn can_communicate(&self, local: &str, remote: &str) -> bool {
        descriptor::ipc_compatible(local, remote)
    }
}

/// cuda_p2p: two GPUs of this host with peer access both ways.
pub struct CudaP2pContext {
    offer: Offer,
    loopback: bool,
}

impl CudaP2pContext {
    /// `loopback` also pairs each GPU with itself within this process, so the peer-copy path
    /// can run on a machine with one GPU (for tests and `sluice bench cuda`; never needed in
    /// production, where cuda_ipc serves same-GPU pairs).
    pub fn new(loopback: bool) -> Self {
        let state = (|| {
            let cuda = cuda::runtime().map_err(|e| e.to_string())?;
            let host = host()?;
            if !loopback && cuda.gpus.iter().all(|g| g.peers.is_empty()) {
                return Err(format!(
                    "no pair of the {} visible GPU(s) allows peer access",
                    cuda.gpus.len()
                ));
            }
            for g in &cuda.gpus {
                for &p in &g.peers {
                    cuda::enable_peer(cuda, g.index, p).map_err(|e| e.to_string())?;
                }
            }
            Ok(descriptors(cuda, &host, true, loopback))
        })();
        CudaP2pContext {
            offer: Offer(state),
            loopback,
        }
    }
}

impl ChannelContext for CudaP2pContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::CudaP2p
    }

    fn viability(&self) -> Result<(), String> {
        self.offer.viability()
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        self.offer.descriptors()
    }

    fn can_communicate(&self, local: &str, remote: &str) -> bool {
        if descriptor::p2p_compatible(local, remote) {
            return true;
        }
        // Loopback: the same GPU, within this process, when both sides asked for it (each
        // lists its own GPU among its peers only in loopback mode).
        self.loopback
            && match (GpuDescriptor::parse(local), GpuDescriptor::parse(remote)) {
                (Some(a), Some(b)) => {
                    a.same_process(&b) && a.gpu == b.gpu && a.peers.contains(&a.gpu) && b.peers.contains(&b.gpu)
                }
                _ => false,
            }
    }
}

/// cuda_staged: through pinned host memory over the pipe's connection; any pair with a GPU.
pub struct CudaStagedContext {
    offer: Offer,
}

impl CudaStagedContext {
    pub fn new() -> Self {
        let state = cuda::runtime().map_err(|e| e.to_string()).map(|cuda| {
            let mut d = vec![(Device::Cpu, descriptor::STAGED_CPU.to_owned())];
            d.extend(
                cuda.gpus
                    .iter()
                    .map(|g| (Device::Cuda(g.index), descriptor::STAGED_GPU.to_owned())),
            );
            d
        });
        CudaStagedContext { offer: Offer(state) }
    }

    /// The CPU-only form a process without CUDA offers, so a GPU peer can still send it GPU
    /// tensors (they land in CPU memory) and receive CPU tensors into its GPUs.
    pub fn cpu_only() -> Self {
        CudaStagedContext {
            offer: Offer(Ok(vec![(Device::Cpu, descriptor::STAGED_CPU.to_owned())])),
        }
    }
}

impl Default for CudaStagedContext {
    fn default() -> Self {
        Self::new()
    }
}

impl ChannelContext for CudaStagedContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::CudaStaged
    }

    fn viability(&self) -> Result<(), String> {
        self.offer.viability()
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        self.offer.descriptors()
    }

    fn can_communicate(&self, local: &str, remote: &str) -> bool {
        descriptor::staged_compatible(local, remote)
    }
}
