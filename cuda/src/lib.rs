//! Sluice's CUDA runtime: the process's view of its GPUs (probed once, before any other call),
//! driver calls, device and pinned memory, streams, events, and kernels compiled at run time
//! (NVRTC) and matrix products (cuBLAS), all loaded at run time so every build runs without
//! CUDA. Below the messaging layers: `sluice-channel` builds the CUDA channels' protocol on it
//! (descriptors, IPC, staging, GPUDirect), `sluice-agent` places tensors on its streams, and
//! `sluice-autograd` computes with it. It knows nothing of pipes or messages.
//!
//! Availability is decided once per process by [`runtime`]: the driver library must load, the
//! driver must be CUDA 11.4 or newer, `cuInit` must succeed and at least one device must be
//! visible. Until all of that holds no other CUDA call is made (cudarc panics without the
//! library). Setting `SLUICE_CUDA=off` makes the process behave as if it had no GPU.
//!
//! GPUs are named by UUID across processes: a device's index is only meaningful in the process
//! that uses it (`CUDA_VISIBLE_DEVICES` reorders and hides devices).
//!
//! Module map: [`driver`] (raw calls, each an `unsafe fn` with its contract) and `memory` (the
//! owning types) hold most of the `unsafe`; [`events`] (plain events and the per-device pools
//! of interprocess events) and [`compute`] (NVRTC, cuBLAS) call into `driver` too. The crate
//! denies `unsafe` at its root; each of those modules allows it for itself.
#![deny(unsafe_code)]

mod alloc;
pub mod compute;
pub mod driver;
pub mod events;
#[cfg(test)]
mod facts;
pub mod gate;
mod memory;

use std::sync::OnceLock;

pub use alloc::{kept, Kept};
pub use driver::{Bound, DevicePtr, DriverError};
pub use events::Event;
pub use memory::{time_raw_copies, CudaBuffer, DeviceMemory, IpcExport, PinnedMemory, RawCopy, Stream};

use driver::RawContext;
use std::sync::Mutex;

/// The oldest driver Sluice uses (`cuDeviceGetUuid_v2` and the IPC calls are all there).
pub const MIN_DRIVER_VERSION: i32 = 11040;

/// Why CUDA cannot be used in this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA is not available: {0}")]
pub struct Unavailable(pub String);

/// A CUDA failure: no CUDA here, a driver call that failed, or a request that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error("{0}")]
    Invalid(String),
}

/// A GPU's UUID, printed as `nvidia-smi` prints it (`GPU-xxxxxxxx-xxxx-...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Uuid(pub [u8; 16]);

impl std::fmt::Display for Uuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, x) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{x:02x}")?;
        }
        Ok(())
    }
}

/// One visible GPU.
#[derive(Debug, Clone)]
pub struct Gpu {
    /// Its index in this process (what `Device::Cuda` holds).
    pub index: u32,
    pub uuid: Uuid,
    pub name: String,
    /// Indices of the devices it can access directly (peer access), itself excluded.
    pub peers: Vec<u32>,
    /// Its PCI address (`0000:3b:00.0`), to find the NIC nearest to it.
    pub pci: Option<String>,
    /// The driver's handle of the device.
    pub(crate) handle: i32,
    /// Its primary context, retained on first use: retaining creates the context, which
    /// costs hundreds of MiB of device memory, so a process pays only for the GPUs it uses.
    context: std::sync::OnceLock<RawContext>,
}

impl Gpu {
    /// The device's primary context, retained now if this is its first use.
    pub fn context(&self) -> Result<RawContext, DriverError> {
        if let Some(&c) = self.context.get() {
            return Ok(c);
        }
        // Two threads may race here: retaining twice only raises the driver's count, and the
        // context is never released either way.
        let c = driver::primary_context(self.handle)?;
        Ok(*self.context.get_or_init(|| c))
    }

    /// The driver's handle of the device (for attribute queries).
    pub fn handle(&self) -> i32 {
        self.handle
    }

    /// Whether the primary context was retained (the GPU has been used by this process).
    pub fn context_retained(&self) -> bool {
        self.context.get().is_some()
    }
}

/// The process's CUDA state: the driver version and the visible GPUs.
#[derive(Debug)]
pub struct Cuda {
    pub driver_version: i32,
    pub gpus: Vec<Gpu>,
}

impl Cuda {
    /// The GPU with this index, or an error naming what is visible.
    pub fn gpu(&self, index: u32) -> Result<&Gpu, CudaError> {
        self.gpus.get(index as usize).ok_or_else(|| {
            CudaError::Invalid(format!(
                "cuda:{index} does not exist here ({} visible GPU(s))",
                self.gpus.len()
            ))
        })
    }

    /// Makes `index`'s primary context current on this thread (retaining it on first use)
    /// and returns the proof every context-bound driver call takes (see [`driver`]'s rules).
    pub fn bind(&self, index: u32) -> Result<Bound, CudaError> {
        let gpu = self.gpu(index)?;
        Ok(driver::bind(index, gpu.context()?)?)
    }
}

/// The process's CUDA state, probed once; every CUDA path starts here.
pub fn runtime() -> Result<&'static Cuda, Unavailable> {
    static CUDA: OnceLock<Result<Cuda, Unavailable>> = OnceLock::new();
    CUDA.get_or_init(|| {
        let probed = probe();
        match &probed {
            Ok(c) => tracing::info!(
                driver = c.driver_version,
                gpus = ?c.gpus.iter().map(|g| format!("cuda:{} {} {}", g.index, g.uuid, g.name)).collect::<Vec<_>>(),
                "CUDA available"
            ),
            Err(e) => tracing::debug!("{e}"),
        }
        probed
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether this process can use CUDA (see [`runtime`]).
pub fn available() -> bool {
    runtime().is_ok()
}

fn probe() -> Result<Cuda, Unavailable> {
    if matches!(std::env::var("SLUICE_CUDA").as_deref(), Ok("off" | "0" | "false")) {
        return Err(Unavailable("disabled by SLUICE_CUDA".into()));
    }
    if let Err(e) = driver::library() {
        return Err(Unavailable(format!(
            "the CUDA driver library (libcuda.so.1) was not found or is incomplete: {}",
            e.name
        )));
    }
    let failed = |e: DriverError| Unavailable(e.to_string());
    let version = driver::driver_version().map_err(failed)?;
    if version < MIN_DRIVER_VERSION {
        return Err(Unavailable(format!(
            "the driver supports CUDA {}.{}; Sluice needs {}.{} or newer",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_VERSION / 1000,
            MIN_DRIVER_VERSION % 1000 / 10
        )));
    }
    driver::init().map_err(failed)?;
    let count = driver::device_count().map_err(failed)?;
    if count <= 0 {
        return Err(Unavailable("no CUDA device is visible".into()));
    }
    let mut handles = Vec::new();
    let mut gpus = Vec::new();
    for i in 0..count {
        let dev = driver::device(i).map_err(failed)?;
        handles.push(dev);
        gpus.push(Gpu {
            index: i as u32,
            uuid: Uuid(driver::device_uuid(dev).map_err(failed)?),
            name: driver::device_name(dev).unwrap_or_default(),
            peers: Vec::new(),
            pci: driver::pci_bus_id(dev).ok(),
            handle: dev,
            context: std::sync::OnceLock::new(),
        });
    }
    for (i, &a) in handles.iter().enumerate() {
        for (j, &b) in handles.iter().enumerate() {
            if i != j && driver::can_access_peer(a, b).unwrap_or(false) {
                gpus[i].peers.push(j as u32);
            }
        }
    }
    Ok(Cuda {
        driver_version: version,
        gpus,
    })
}

/// Enables direct access from `from`'s context to `to`'s memory, once per ordered pair.
pub fn enable_peer(cuda: &Cuda, from: u32, to: u32) -> Result<(), CudaError> {
    static DONE: OnceLock<Mutex<std::collections::HashSet<(u32, u32)>>> = OnceLock::new();
    let done = DONE.get_or_init(Default::default);
    let mut done = done.lock().expect("peer table");
    if from == to || done.contains(&(from, to)) {
        return Ok(());
    }
    let target = cuda.gpu(to)?.context()?;
    let bound = cuda.bind(from)?;
    driver::enable_peer_access(&bound, target)?;
    done.insert((from, to));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_like_nvidia_smi() {
        let u = Uuid([
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
        ]);
        assert_eq!(u.to_string(), "GPU-12345678-9abc-def0-0123-456789abcdef");
    }

    #[test]
    fn a_gpu_is_probed_with_its_identity_and_context() {
        if !gate::gpu_or_skip("a_gpu_is_probed_with_its_identity_and_context") {
            return;
        }
        let cuda = runtime().unwrap();
        assert!(
            cuda.driver_version >= MIN_DRIVER_VERSION,
            "driver {}",
            cuda.driver_version
        );
        assert!(!cuda.gpus.is_empty());
        for (i, g) in cuda.gpus.iter().enumerate() {
            assert_eq!(g.index as usize, i, "indices in order");
            assert_ne!(g.uuid, Uuid([0; 16]), "cuda:{i} has a UUID");
            assert!(!g.name.is_empty(), "cuda:{i} has a name");
            assert!(!g.peers.contains(&g.index), "cuda:{i} is not its own peer");
        }
        // Contexts are retained on first use only, then kept.
        let g = cuda.gpu(0).unwrap();
        let c = g.context().unwrap();
        assert!(g.context_retained());
        assert_eq!(g.context().unwrap(), c);
        assert!(cuda.gpu(cuda.gpus.len() as u32).is_err(), "an index past the last GPU");
        assert!(available());
    }

    #[test]
    fn without_a_driver_cuda_is_unavailable_with_a_reason() {
        // CI and the development machines have no GPU: the probe must say why, not panic.
        if !gate::without_driver_or_skip("without_a_driver_cuda_is_unavailable_with_a_reason") {
            return;
        }
        let e = runtime().expect_err("no driver here");
        assert!(e.to_string().contains("libcuda"), "{e}");
        assert!(!available());
    }
}
