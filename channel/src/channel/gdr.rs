//! GPUDirect RDMA (`cuda_gdr`): the receiver's NIC reads a CUDA tensor straight out of the
//! sender's GPU memory into its own GPU memory, on the queue pair of the pipe's ibverbs control
//! connection. No host staging on either side.
//!
//! - **Registration**: dma-buf first (`cuMemGetHandleForAddressRange` then
//!   `ibv_reg_dmabuf_mr`, in the kernel since 5.12), otherwise the peer-memory module
//!   (`ibv_reg_mr` on the device address, with `nvidia-peermem` loaded). Whole allocations are
//!   registered (addressed by their device addresses) and cached, holding a clone of the buffer
//!   so the memory cannot be freed while registered: registration is slow and uses BAR space.
//! - **Viability, per GPU**: CUDA present, the ibverbs transport viable, this GPU's nearest NIC
//!   (by PCI topology) is the transport's device, and registering a small allocation on the GPU
//!   actually succeeds. A GPU that fails any of these is not offered; its tensors take
//!   cuda_staged instead.
//! - **Ordering**: the sender synchronizes its buffer's stream before exposing it (the NIC does
//!   not follow streams); the receiver's read completes once the bytes have landed in its GPU
//!   memory, so anything queued on its stream afterwards sees them. The sender's write
//!   completes when the receiver acknowledges.
//!
//! Pairing is one NIC per process (the transport's device): on a multi-rail host, GPUs nearest
//! another NIC are not offered rather than sent across the PCIe root complex.
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};

use sluice_transport::ibv::{Access, IbvTransport, MrInfo, VerbsDevice, VerbsError, VerbsMr};
use sluice_transport::Transport;

use super::path::{Link, Rx, Tx};
use super::rdma::{pull, Lease, RegCache};
use super::{ChannelContext, ChannelKind};
use crate::cuda::{self, driver, CudaBuffer};
use crate::device::Device;
use crate::wire::Source;

type PipeResult<T> = crate::error::Result<T>;

/// The cuda_gdr channel's context: the GPUs it serves, with the fabric descriptor.
pub struct GdrContext {
    offered: Result<Vec<(Device, String)>, String>,
}

impl GdrContext {
    pub fn new(ibv: Option<&IbvTransport>) -> GdrContext {
        GdrContext {
            offered: Self::probe(ibv),
        }
    }

    fn probe(ibv: Option<&IbvTransport>) -> Result<Vec<(Device, String)>, String> {
        let t = ibv.ok_or("the ibv transport is not enabled")?;
        t.viability().map_err(|e| e.to_string())?;
        let nic = t.device().ok_or("the ibv transport has no device")?;
        let rt = cuda::runtime().map_err(|e| e.to_string())?;
        let descriptor = t.domain_descriptor();
        let nics = nic_paths();
        let mut offered = Vec::new();
        for gpu in &rt.gpus {
            let device = Device::Cuda(gpu.index);
            let near = match (&gpu.pci, nic.pci_path()) {
                (Some(pci), Some(ours)) => {
                    let gpu_path = std::fs::canonicalize(format!("/sys/bus/pci/devices/{pci}")).ok();
                    gpu_path.is_none_or(|g| is_nearest(&g, &ours, &nics))
                }
                _ => true, // topology unknown: let registration decide
            };
            if !near {
                tracing::info!(
                    "cuda_gdr: {device} is nearer another NIC than {}; not offered",
                    nic.name()
                );
                continue;
            }
            match probe_registration(nic.as_ref(), gpu.index) {
                Ok(how) => {
                    tracing::info!("cuda_gdr: {device} registers with {} via {how}", nic.name());
                    offered.push((device, descriptor.clone()));
                }
                Err(e) => tracing::info!("cuda_gdr: {device} not offered: {e}"),
            }
        }
        if offered.is_empty() {
            return Err("no GPU can be registered with the NIC".into());
        }
        Ok(offered)
    }
}

impl ChannelContext for GdrContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::CudaGdr
    }

    fn viability(&self) -> Result<(), String> {
        self.offered.as_ref().map(|_| ()).map_err(|e| e.clone())
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        self.offered.clone().unwrap_or_default()
    }
}

/// Every RDMA device's canonical PCI path.
fn nic_paths() -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir("/sys/class/infiniband") else {
        return Vec::new();
    };
    dir.filter_map(|e| std::fs::canonicalize(e.ok()?.path().join("device")).ok())
        .collect()
}

/// How many leading path components two PCI paths share (more: nearer in the hierarchy).
fn shared_depth(a: &Path, b: &Path) -> usize {
    a.components().zip(b.components()).take_while(|(x, y)| x == y).count()
}

/// Whether `ours` is (one of) the NICs nearest to the GPU at `gpu`.
pub fn is_nearest(gpu: &Path, ours: &Path, nics: &[PathBuf]) -> bool {
    let mine = shared_depth(gpu, ours);
    nics.iter().all(|n| shared_depth(gpu, n) <= mine)
}

/// Registers a small allocation on GPU `index` and says how it worked.
fn probe_registration(nic: &dyn VerbsDevice, index: u32) -> Result<&'static str, String> {
    let stream = cuda::Stream::new(index).map_err(|e| e.to_string())?;
    let buf = CudaBuffer::alloc(2 << 20, &stream).map_err(|e| e.to_string())?;
    register(nic, &buf, Access::REMOTE_READ)
        .map(|(_, how)| how)
        .map_err(|e| e.to_string())
}

/// Registers the whole allocation holding `buf`, addressed by device addresses: through
/// dma-buf where the driver exports one, else through the peer-memory module.
pub fn register(
    nic: &dyn VerbsDevice,
    buf: &CudaBuffer,
    access: Access,
) -> Result<(Box<dyn VerbsMr>, &'static str), VerbsError> {
    let fail = |e: cuda::CudaError| VerbsError::failed("register GPU memory", e);
    let rt = cuda::runtime().map_err(|e| VerbsError::failed("register GPU memory", e))?;
    let bound = rt.bind(buf.device()).map_err(fail)?;
    let info = driver::pointer_info(&bound, buf.ptr()).map_err(|e| fail(e.into()))?;
    // `cuMemGetHandleForAddressRange` takes page-aligned ranges only: export the pages around
    // the allocation, addressed from the first page's start.
    // `cuMemGetHandleForAddressRange` aligns to the host page.
    let (start, len) = page_span(info.base, info.size, sluice_transport::shm::page_size() as u64);
    // SAFETY: the context of the buffer's device is current (bind above) and the range covers
    // the allocation around `buf`, which the caller keeps alive (a clone) while registered.
    let dmabuf = unsafe { driver::dmabuf_fd(&bound, start, len) };
    if let Ok(fd) = dmabuf {
        use std::os::fd::AsRawFd;
        // SAFETY: the dma-buf exports the allocation, kept alive by the caller while the
        // registration exists; the NIC keeps its own reference to the dma-buf, so our
        // descriptor may close after registering.
        match unsafe { nic.register_dmabuf(fd.as_raw_fd(), 0, len, start, access) } {
            Ok(mr) => return Ok((mr, "dma-buf")),
            Err(e) => tracing::debug!("dma-buf registration failed ({e}); trying peer memory"),
        }
    }
    // SAFETY: as above; with nvidia-peermem the NIC pins the GPU pages itself.
    let mr = unsafe { nic.register(info.base as *mut u8, info.size, access)? };
    Ok((mr, "peer memory"))
}

/// The page-aligned span covering `base..base+size`: its start and length.
pub fn page_span(base: u64, size: usize, page: u64) -> (u64, usize) {
    let start = base / page * page;
    let end = (base + size as u64).div_ceil(page) * page;
    (start, (end - start) as usize)
}

/// The registration of the allocation holding `buf`, from `cache` or made now (the cache then
/// holds a clone of `buf`, keeping the allocation alive while registered). For memory lent
/// from outside (the C API's GPU tensors and allocators) that clone also holds the lender's
/// release back until the entry is evicted or the pipe is dropped.
pub fn cached(cache: &mut RegCache, buf: &CudaBuffer, access: Access) -> Result<MrInfo, VerbsError> {
    let fail = |e: cuda::CudaError| VerbsError::failed("pointer info", e);
    // Pointer queries work on the current context: bind the buffer's device first (this can
    // run on any runtime thread).
    let bound = cuda::runtime()
        .map_err(|e| fail(e.into()))?
        .bind(buf.device())
        .map_err(fail)?;
    let info = driver::pointer_info(&bound, buf.ptr()).map_err(|e| fail(e.into()))?;
    let device = cache.device().clone();
    cache.get_or_register(info.base, info.size, Box::new(buf.clone()), || {
        register(device.as_ref(), buf, access).map(|(mr, _)| mr)
    })
}

/// Sender: makes a GPU tensor readable by the peer's NIC: its stream's pending work done, its
/// allocation registered (cached).
pub(crate) fn prepare(tx: &mut Tx, link: &Link<'_>, b: &CudaBuffer) -> PipeResult<Source> {
    let fail = |detail: String| link.channel_error(ChannelKind::CudaGdr, detail);
    let cache = tx
        .gpu_registrations
        .as_mut()
        .ok_or_else(|| link.protocol("cuda_gdr negotiated without an ibverbs connection"))?;
    // The NIC does not follow streams: the data must be complete before the peer reads.
    b.stream()
        .synchronize()
        .map_err(|e| fail(format!("synchronizing the source stream: {e}")))?;
    let info = cached(cache, b, Access::REMOTE_READ).map_err(|e| fail(format!("registering the source: {e}")))?;
    Ok(Source::Rdma {
        addr: b.ptr(),
        rkey: info.rkey,
    })
}

/// Receiver: reads a tensor straight into `dst`'s GPU memory (its allocation registered and
/// cached, kept alive by the cache). If this future is dropped mid-read, a clone of `dst` is
/// leaked so the memory outlives the NIC's writes, and the pipe fails.
pub(crate) async fn recv(rx: &mut Rx, link: &Link<'_>, dst: &CudaBuffer, addr: u64, rkey: u32) -> PipeResult<()> {
    let cache = rx
        .gpu_targets
        .as_mut()
        .ok_or_else(|| link.protocol("cuda_gdr negotiated without an ibverbs connection"))?;
    let info = cached(cache, dst, Access::LOCAL)
        .map_err(|e| link.channel_error(ChannelKind::CudaGdr, format!("registering the destination: {e}")))?;
    // The NIC does not follow streams either: work already queued on `dst`'s stream (memory a
    // caching allocator just handed out may still be in use there) finishes before it writes.
    dst.stream().synchronize().map_err(|e| {
        link.channel_error(
            ChannelKind::CudaGdr,
            format!("synchronizing the destination stream: {e}"),
        )
    })?;
    let mut lease = Lease::new(dst.clone(), link, ChannelKind::CudaGdr);
    // SAFETY: `dst` lies in the registered allocation (addressed by device addresses), which
    // the cache and the lease keep allocated until the read completes (or for ever).
    let result = unsafe { pull(link, dst.ptr(), info.lkey, dst.len(), addr, rkey) }.await;
    lease.release();
    result?;
    flush_writes(dst).map_err(|e| link.channel_error(ChannelKind::CudaGdr, format!("flushing the NIC's writes: {e}")))
}

/// Makes the NIC's writes into `dst` visible to work queued on its stream afterwards, where the
/// device does not order GPUDirect writes by itself (NCCL flushes the same way by default).
fn flush_writes(dst: &CudaBuffer) -> Result<(), cuda::CudaError> {
    let cuda = cuda::runtime()?;
    let handle = cuda.gpu(dst.device())?.handle();
    let bound = cuda.bind(dst.device())?;
    if !driver::gpudirect_writes_ordered(handle)? {
        driver::flush_gpudirect_writes(&bound)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dma_buf_ranges_are_whole_pages() {
        assert_eq!(page_span(0x20_0000, 0x20_0000, 4096), (0x20_0000, 0x20_0000));
        assert_eq!(page_span(0x20_0000, 100, 4096), (0x20_0000, 4096));
        assert_eq!(page_span(0x20_0010, 4096, 4096), (0x20_0000, 8192));
        assert_eq!(page_span(0x1fff, 2, 4096), (0x1000, 8192));
    }

    #[test]
    fn the_nearest_nic_shares_the_longest_pci_path() {
        let gpu = Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0");
        let same_switch = PathBuf::from("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0");
        let same_root = PathBuf::from("/sys/devices/pci0000:00/0000:00:02.0/0000:05:00.0");
        let other_socket = PathBuf::from("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0");
        let nics = vec![same_switch.clone(), same_root.clone(), other_socket.clone()];
        assert!(is_nearest(gpu, &same_switch, &nics));
        assert!(!is_nearest(gpu, &same_root, &nics));
        assert!(!is_nearest(gpu, &other_socket, &nics));
        // Alone, any NIC is the nearest; ties count as nearest.
        assert!(is_nearest(gpu, &other_socket, std::slice::from_ref(&other_socket)));
        assert!(is_nearest(gpu, &same_root, &[same_root.clone(), same_root.clone()]));
    }

    #[test]
    fn without_cuda_or_ibv_gdr_is_not_viable_and_says_why() {
        let none = GdrContext::new(None);
        assert!(none.viability().unwrap_err().contains("ibv transport is not enabled"));
        let model = IbvTransport::new(sluice_transport::ibv::IbvOptions {
            device: sluice_transport::ibv::DeviceChoice::Model,
            ..Default::default()
        });
        let ctx = GdrContext::new(Some(&model));
        let why = ctx.viability().unwrap_err();
        assert!(
            why.contains("CUDA") || why.contains("no GPU can be registered"),
            "{why}"
        );
        assert!(ctx.device_descriptors().is_empty());
    }
}
