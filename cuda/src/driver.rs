//! The CUDA driver calls Sluice makes. The driver library is opened at run time (`libcuda.so.1`,
//! the driver's own soname, before the unversioned name a toolkit's stub may answer to) and
//! each entry point is declared here with its C signature, **its result as a plain integer**:
//! a driver newer than these declarations returns codes no Rust enum lists, and turning such a
//! value into an enum would be undefined behaviour. Known codes are named by the driver itself
//! (`cuGetErrorName`) or by [`error_name`]'s table; any other is reported by number.
//!
//! Rules every caller keeps, and how they are enforced:
//! - No call before the library loaded: every wrapper goes through [`api`], which fails (never
//!   panics) when the library or a required symbol is missing. [`super::runtime`] also checks
//!   the driver version and `cuInit` before handing anything out.
//! - **A context current on the calling thread** for every call that works on one (memory,
//!   streams, events, copies, IPC, pointer queries, modules): those wrappers take a [`Bound`],
//!   the proof [`super::Cuda::bind`] hands out after making a device's primary context
//!   current. It is neither `Send` nor `Sync`, so it cannot cross to another thread or be held
//!   across an `.await` of a spawned task, and each use checks that no other device was bound
//!   on this thread since.
//! - Calls that touch memory or handles are `unsafe fn`s whose contract is stated here; their
//!   callers justify each use with a `// SAFETY:` comment.
//!
//! Raw handles travel as integers ([`RawStream`], [`RawEvent`], [`RawContext`]): the driver's
//! handles are process-wide and may be used from any thread, which the integer form makes
//! `Send` and `Sync` without claiming anything about Rust memory.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::marker::PhantomData;
use std::sync::OnceLock;

/// A device address (unified addressing: one space for every device of the process).
pub type DevicePtr = u64;

/// A stream handle (`0` is the legacy default stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawStream(pub usize);

/// An event handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawEvent(pub usize);

/// A context handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawContext(pub usize);

/// A loaded module (compiled kernels) of one context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawModule(pub usize);

/// A kernel of a loaded module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawFunction(pub usize);

type Ptr = *mut c_void;

/// Bytes of an IPC memory or event handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// `CUipcMemHandle` and `CUipcEventHandle` (passed by value).
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [c_char; IPC_HANDLE_BYTES],
}

/// `CUuuid`.
#[repr(C)]
struct CuUuid {
    bytes: [c_char; 16],
}

/// The values of cuda.h this module passes (stable across driver versions).
mod consts {
    pub const SUCCESS: i32 = 0;
    pub const ERROR_OUT_OF_MEMORY: i32 = 2;
    pub const ERROR_STUB_LIBRARY: i32 = 34;
    pub const ERROR_INVALID_CONTEXT: i32 = 201;
    pub const ERROR_NOT_READY: i32 = 600;
    pub const ERROR_PEER_ACCESS_ALREADY_ENABLED: i32 = 704;
    pub const STREAM_NON_BLOCKING: u32 = 1;
    pub const EVENT_BLOCKING_SYNC: u32 = 1;
    pub const EVENT_DISABLE_TIMING: u32 = 2;
    pub const EVENT_INTERPROCESS: u32 = 4;
    pub const MEMHOSTALLOC_PORTABLE: u32 = 1;
    pub const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: u32 = 1;
    pub const POINTER_ATTRIBUTE_MEMORY_TYPE: i32 = 2;
    pub const POINTER_ATTRIBUTE_DEVICE_ORDINAL: i32 = 9;
    pub const MEMORYTYPE_DEVICE: u32 = 2;
    pub const MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: i32 = 1;
    pub const ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub const ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: i32 = 76;
    pub const ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING: i32 = 118;
    pub const GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER: i32 = 100;
    pub const FLUSH_TARGET_CURRENT_CTX: i32 = 0;
    pub const FLUSH_TO_OWNER: i32 = 100;
}
pub use consts::{ERROR_OUT_OF_MEMORY, ERROR_STUB_LIBRARY};

/// Declares the driver entry points: required ones fail the load when missing, optional ones
/// (newer than [`super::MIN_DRIVER_VERSION`]) are `None` and their wrappers say what they need.
macro_rules! entry_points {
    (
        required { $($name:ident ( $($arg:ty),* );)* }
        optional { $($oname:ident ( $($oarg:ty),* );)* }
    ) => {
        #[allow(non_snake_case)]
        struct Api {
            /// Where the library was found.
            path: &'static str,
            $($name: unsafe extern "C" fn($($arg),*) -> c_int,)*
            $($oname: Option<unsafe extern "C" fn($($oarg),*) -> c_int>,)*
            _lib: libloading::Library,
        }

        impl Api {
            fn load(lib: libloading::Library, path: &'static str) -> std::result::Result<Api, String> {
                // SAFETY: each type is the symbol's C signature from cuda.h with `CUresult`
                // declared as a plain int (the enum is a 32-bit C enum), handles as pointers
                // and enums passed by value as ints of the same width.
                unsafe {
                    Ok(Api {
                        path,
                        $($name: *lib
                            .get(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| format!("{path} lacks {}: {e}", stringify!($name)))?,)*
                        $($oname: lib
                            .get(concat!(stringify!($oname), "\0").as_bytes())
                            .ok()
                            .map(|s| *s),)*
                        _lib: lib,
                    })
                }
            }
        }
    };
}

entry_points! {
    required {
        cuGetErrorName(c_int, *mut *const c_char);
        cuDriverGetVersion(*mut c_int);
        cuInit(c_uint);
        cuDeviceGetCount(*mut c_int);
        cuDeviceGet(*mut c_int, c_int);
        cuDeviceGetUuid_v2(*mut CuUuid, c_int);
        cuDeviceGetName(*mut c_char, c_int, c_int);
        cuDeviceGetPCIBusId(*mut c_char, c_int, c_int);
        cuDeviceGetAttribute(*mut c_int, c_int, c_int);
        cuDeviceCanAccessPeer(*mut c_int, c_int, c_int);
        cuDevicePrimaryCtxRetain(*mut Ptr, c_int);
        cuCtxSetCurrent(Ptr);
        cuCtxEnablePeerAccess(Ptr, c_uint);
        cuCtxPushCurrent_v2(Ptr);
        cuCtxPopCurrent_v2(*mut Ptr);
        cuCtxGetDevice(*mut c_int);
        cuMemAlloc_v2(*mut u64, usize);
        cuMemFree_v2(u64);
        cuMemHostAlloc(*mut Ptr, usize, c_uint);
        cuMemFreeHost(Ptr);
        cuStreamCreate(*mut Ptr, c_uint);
        cuStreamDestroy_v2(Ptr);
        cuStreamSynchronize(Ptr);
        cuStreamWaitEvent(Ptr, Ptr, c_uint);
        cuStreamGetCtx(Ptr, *mut Ptr);
        cuEventCreate(*mut Ptr, c_uint);
        cuEventDestroy_v2(Ptr);
        cuEventRecord(Ptr, Ptr);
        cuEventQuery(Ptr);
        cuEventSynchronize(Ptr);
        cuIpcGetMemHandle(*mut IpcHandle, u64);
        cuIpcOpenMemHandle_v2(*mut u64, IpcHandle, c_uint);
        cuIpcCloseMemHandle(u64);
        cuIpcGetEventHandle(*mut IpcHandle, Ptr);
        cuIpcOpenEventHandle(*mut Ptr, IpcHandle);
        cuPointerGetAttribute(Ptr, c_int, u64);
        cuMemGetAddressRange_v2(*mut u64, *mut usize, u64);
        cuMemcpyDtoDAsync_v2(u64, u64, usize, Ptr);
        cuMemcpyPeerAsync(u64, Ptr, u64, Ptr, usize, Ptr);
        cuMemcpyHtoDAsync_v2(u64, *const c_void, usize, Ptr);
        cuMemcpyDtoHAsync_v2(Ptr, u64, usize, Ptr);
        cuMemsetD8Async(u64, u8, usize, Ptr);
        cuModuleLoadData(*mut Ptr, *const c_void);
        cuModuleGetFunction(*mut Ptr, Ptr, *const c_char);
        cuLaunchKernel(Ptr, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Ptr, *mut Ptr, *mut Ptr);
    }
    optional {
        // CUDA 11.3.
        cuFlushGPUDirectRDMAWrites(c_int, c_int);
        // CUDA 11.7.
        cuMemGetHandleForAddressRange(Ptr, u64, usize, c_int, u64);
    }
}

/// Names tried in order: the driver's soname first. The unversioned name is a development
/// link, and in a toolkit's `stubs/` directory it is a stub that fails every call with
/// `CUDA_ERROR_STUB_LIBRARY`; it is tried last, and a stub is reported as such.
pub const LIBRARY_NAMES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// The variable that names a CUDA driver *model* to load instead of the driver: a library
/// exporting the same entry points (Sluice's own is `cuda-model/`, for CI without a GPU). Only
/// that file is tried when it is set, and every error and figure names it as the model.
pub const MODEL_VARIABLE: &str = "SLUICE_CUDA_DRIVER";

/// The driver model in use (the path in [`MODEL_VARIABLE`]), if one is.
pub fn model() -> Option<&'static str> {
    static MODEL: OnceLock<Option<String>> = OnceLock::new();
    MODEL
        .get_or_init(|| std::env::var(MODEL_VARIABLE).ok().filter(|p| !p.is_empty()))
        .as_deref()
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        if let Some(path) = model() {
            // SAFETY: the model is a library of ours whose initializers only set up its state.
            return match unsafe { libloading::Library::new(path) } {
                Ok(lib) => Api::load(lib, path),
                Err(e) => Err(format!("the CUDA driver model {path} ({MODEL_VARIABLE}): {e}")),
            };
        }
        let mut why = Vec::new();
        for name in LIBRARY_NAMES {
            // SAFETY: loading the driver library runs only its own initializers, which is
            // what every CUDA program does.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return Api::load(lib, name),
                Err(e) => why.push(format!("{name}: {e}")),
            }
        }
        Err(why.join("; "))
    })
    .as_ref()
    .map_err(|e| DriverError {
        call: "loading the CUDA driver library",
        code: -1,
        name: e.clone(),
    })
}

/// A failed driver call: which call, and the driver's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {name} ({code})")]
pub struct DriverError {
    pub call: &'static str,
    /// The driver's code (`-1` when the call could not be made at all).
    pub code: i32,
    pub name: String,
}

pub type Result<T> = std::result::Result<T, DriverError>;

/// Names of the codes Sluice meets most, for when the driver cannot name one itself.
const KNOWN: &[(i32, &str)] = &[
    (0, "CUDA_SUCCESS"),
    (1, "CUDA_ERROR_INVALID_VALUE"),
    (2, "CUDA_ERROR_OUT_OF_MEMORY"),
    (3, "CUDA_ERROR_NOT_INITIALIZED"),
    (4, "CUDA_ERROR_DEINITIALIZED"),
    (34, "CUDA_ERROR_STUB_LIBRARY"),
    (36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"),
    (46, "CUDA_ERROR_DEVICE_UNAVAILABLE"),
    (100, "CUDA_ERROR_NO_DEVICE"),
    (101, "CUDA_ERROR_INVALID_DEVICE"),
    (200, "CUDA_ERROR_INVALID_IMAGE"),
    (201, "CUDA_ERROR_INVALID_CONTEXT"),
    (208, "CUDA_ERROR_ALREADY_MAPPED"),
    (209, "CUDA_ERROR_NO_BINARY_FOR_GPU"),
    (217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"),
    (218, "CUDA_ERROR_INVALID_PTX"),
    (221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"),
    (222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
    (400, "CUDA_ERROR_INVALID_HANDLE"),
    (500, "CUDA_ERROR_NOT_FOUND"),
    (600, "CUDA_ERROR_NOT_READY"),
    (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    (704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"),
    (719, "CUDA_ERROR_LAUNCH_FAILED"),
    (801, "CUDA_ERROR_NOT_SUPPORTED"),
    (803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    (804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"),
    (917, "CUDA_ERROR_STREAM_DETACHED"),
    (999, "CUDA_ERROR_UNKNOWN"),
];

/// The name of a driver result code: the driver's own name when it has one (newer drivers
/// know codes this file does not), else [`KNOWN`]'s, else the number.
pub fn error_name(code: i32) -> String {
    if let Ok(api) = api() {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: the driver writes a pointer to a static string, or fails for an unknown
        // code and leaves `s` alone; the code is passed as the int it is.
        if unsafe { (api.cuGetErrorName)(code, &mut s) } == consts::SUCCESS && !s.is_null() {
            // SAFETY: a NUL-terminated static string owned by the driver.
            return unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
        }
    }
    known_name(code)
}

fn known_name(code: i32) -> String {
    KNOWN
        .iter()
        .find(|(c, _)| *c == code)
        .map_or_else(|| format!("unknown CUDA error {code}"), |(_, n)| (*n).to_owned())
}

fn check(call: &'static str, r: c_int) -> Result<()> {
    if r == consts::SUCCESS {
        return Ok(());
    }
    let mut name = error_name(r);
    if let Some(path) = model() {
        name = format!("{name} [from the CUDA driver model {path}, not a GPU]");
    }
    if r == consts::ERROR_STUB_LIBRARY {
        let path = api().map(|a| a.path).unwrap_or("libcuda");
        name = format!(
            "{name}: {path} is the CUDA toolkit's stub, not a driver (no NVIDIA driver is \
             installed, or a toolkit's stubs directory is on the loader path ahead of it)"
        );
    }
    Err(DriverError { call, code: r, name })
}

fn missing(call: &'static str, needs: &str) -> DriverError {
    DriverError {
        call,
        code: -1,
        name: format!("this driver does not export it (needs {needs})"),
    }
}

thread_local! {
    /// The device whose primary context [`bind`] last made current on this thread.
    static CURRENT: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Proof that a device's primary context is current on this thread: what every driver call
/// that works on a context takes. Made only by [`super::Cuda::bind`]; not `Send`, so it stays
/// on the thread that bound it.
#[derive(Debug)]
pub struct Bound {
    device: u32,
    context: RawContext,
    _not_send: PhantomData<*const ()>,
}

impl Bound {
    /// The device bound.
    pub fn device(&self) -> u32 {
        self.device
    }

    pub fn context(&self) -> RawContext {
        self.context
    }

    /// The context is still the one current on this thread (no other device was bound since).
    fn api(&self) -> Result<&'static Api> {
        if CURRENT.get() != Some(self.device) {
            return Err(DriverError {
                call: "using a bound context",
                code: consts::ERROR_INVALID_CONTEXT,
                name: format!(
                    "cuda:{}'s context is no longer current on this thread (another device was bound since)",
                    self.device
                ),
            });
        }
        api()
    }
}

/// Makes `context` (device `device`'s primary context) current on this thread.
pub(crate) fn bind(device: u32, context: RawContext) -> Result<Bound> {
    // SAFETY: `context` came from `primary_context` and is never released.
    check("cuCtxSetCurrent", unsafe { (api()?.cuCtxSetCurrent)(context.0 as Ptr) })?;
    CURRENT.set(Some(device));
    Ok(Bound {
        device,
        context,
        _not_send: PhantomData,
    })
}

/// Whether the driver library can be loaded (with every entry point Sluice requires).
pub fn library_present() -> bool {
    api().is_ok()
}

/// Where the driver library was loaded from, or why it could not be.
pub fn library() -> std::result::Result<&'static str, DriverError> {
    api().map(|a| a.path)
}

/// The driver's CUDA version, e.g. `12080` for 12.8.
pub fn driver_version() -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: writes one int through a valid pointer; needs no context.
    check("cuDriverGetVersion", unsafe { (api()?.cuDriverGetVersion)(&mut v) })?;
    Ok(v)
}

pub fn init() -> Result<()> {
    // SAFETY: no pointers; the flags must be 0.
    check("cuInit", unsafe { (api()?.cuInit)(0) })
}

pub fn device_count() -> Result<i32> {
    let mut n: c_int = 0;
    // SAFETY: writes one int through a valid pointer; after cuInit.
    check("cuDeviceGetCount", unsafe { (api()?.cuDeviceGetCount)(&mut n) })?;
    Ok(n)
}

/// The driver's handle of the device with visible index `ordinal`.
pub fn device(ordinal: i32) -> Result<i32> {
    let mut d: c_int = 0;
    // SAFETY: writes one int through a valid pointer; the driver checks the ordinal.
    check("cuDeviceGet", unsafe { (api()?.cuDeviceGet)(&mut d, ordinal) })?;
    Ok(d)
}

/// The device's UUID (the same in every process, whatever `CUDA_VISIBLE_DEVICES` says).
pub fn device_uuid(dev: i32) -> Result<[u8; 16]> {
    let mut u = CuUuid { bytes: [0; 16] };
    // SAFETY: writes 16 bytes into a valid CUuuid.
    check("cuDeviceGetUuid_v2", unsafe {
        (api()?.cuDeviceGetUuid_v2)(&mut u, dev)
    })?;
    Ok(u.bytes.map(|b| b as u8))
}

pub fn device_name(dev: i32) -> Result<String> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes into `buf`.
    check("cuDeviceGetName", unsafe {
        (api()?.cuDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int - 1, dev)
    })?;
    Ok(c_string(&buf))
}

/// The device's PCI address, lower case (`0000:3b:00.0`), as sysfs names it.
pub fn pci_bus_id(dev: i32) -> Result<String> {
    let mut buf = [0 as c_char; 32];
    // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes into `buf`.
    check("cuDeviceGetPCIBusId", unsafe {
        (api()?.cuDeviceGetPCIBusId)(buf.as_mut_ptr(), buf.len() as c_int - 1, dev)
    })?;
    Ok(c_string(&buf).to_lowercase())
}

/// The text before the first NUL (the buffer's last byte is never written, so there is one).
fn c_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn attribute(dev: i32, attribute: c_int, what: &'static str) -> Result<c_int> {
    let mut v: c_int = 0;
    // SAFETY: writes one int through a valid pointer; the driver checks `dev` and the
    // attribute (an older driver rejects one it does not know with an error).
    check(what, unsafe { (api()?.cuDeviceGetAttribute)(&mut v, attribute, dev) })?;
    Ok(v)
}

/// The device's compute capability, `(major, minor)`.
pub fn compute_capability(dev: i32) -> Result<(i32, i32)> {
    Ok((
        attribute(
            dev,
            consts::ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            "cuDeviceGetAttribute(CC_MAJOR)",
        )?,
        attribute(
            dev,
            consts::ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            "cuDeviceGetAttribute(CC_MINOR)",
        )?,
    ))
}

/// Whether the device orders GPUDirect RDMA writes for its own context
/// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` at least `OWNER`): when it does not,
/// a NIC's writes must be flushed ([`flush_gpudirect_writes`]) before kernels read the memory.
pub fn gpudirect_writes_ordered(dev: i32) -> Result<bool> {
    let ordering = attribute(
        dev,
        consts::ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
        "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WRITES_ORDERING)",
    )?;
    Ok(ordering >= consts::GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER)
}

/// Whether `dev` can access `peer`'s memory directly (NVLink or PCIe peer-to-peer).
pub fn can_access_peer(dev: i32, peer: i32) -> Result<bool> {
    let mut can: c_int = 0;
    // SAFETY: writes one int through a valid pointer; needs no context.
    check("cuDeviceCanAccessPeer", unsafe {
        (api()?.cuDeviceCanAccessPeer)(&mut can, dev, peer)
    })?;
    Ok(can != 0)
}

/// Retains the device's primary context (the one the runtime API and PyTorch use). Never
/// released: the process keeps it for its lifetime. Retaining creates the context (hundreds
/// of MiB of device memory), so it is done on a device's first use, not at probe time.
pub fn primary_context(dev: i32) -> Result<RawContext> {
    let mut ctx: Ptr = std::ptr::null_mut();
    // SAFETY: writes one handle through a valid pointer.
    check("cuDevicePrimaryCtxRetain", unsafe {
        (api()?.cuDevicePrimaryCtxRetain)(&mut ctx, dev)
    })?;
    Ok(RawContext(ctx as usize))
}

/// Lets the bound context access `peer`'s memory. Already enabled is not an error.
pub fn enable_peer_access(b: &Bound, peer: RawContext) -> Result<()> {
    // SAFETY: `peer` came from `primary_context`; the flags must be 0.
    let r = unsafe { (b.api()?.cuCtxEnablePeerAccess)(peer.0 as Ptr, 0) };
    if r == consts::ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check("cuCtxEnablePeerAccess", r)
}

/// Allocates `len` bytes of device memory in the bound context.
pub fn mem_alloc(b: &Bound, len: usize) -> Result<DevicePtr> {
    let mut p: u64 = 0;
    // SAFETY: writes one address through a valid pointer.
    check("cuMemAlloc_v2", unsafe { (b.api()?.cuMemAlloc_v2)(&mut p, len.max(1)) })?;
    Ok(p)
}

/// Frees device memory. The driver only says it *may* synchronize, so callers free only
/// after the work using the memory is known to be complete.
///
/// # Safety
/// `p` came from [`mem_alloc`] in the bound context, is freed once, and every piece of work
/// that used it has completed (an event recorded after it reported done).
pub unsafe fn mem_free(b: &Bound, p: DevicePtr) -> Result<()> {
    check("cuMemFree_v2", (b.api()?.cuMemFree_v2)(p))
}

/// Allocates `len` bytes of pinned host memory, usable by every context.
pub fn host_alloc(b: &Bound, len: usize) -> Result<*mut u8> {
    let mut p: Ptr = std::ptr::null_mut();
    // SAFETY: writes one pointer through a valid pointer.
    check("cuMemHostAlloc", unsafe {
        (b.api()?.cuMemHostAlloc)(&mut p, len.max(1), consts::MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(p as *mut u8)
}

/// Frees pinned host memory.
///
/// # Safety
/// `p` came from [`host_alloc`], is freed once, and nothing (host or device) still uses it.
pub unsafe fn host_free(b: &Bound, p: *mut u8) -> Result<()> {
    check("cuMemFreeHost", (b.api()?.cuMemFreeHost)(p as Ptr))
}

/// A new non-blocking stream in the bound context.
pub fn stream_create(b: &Bound) -> Result<RawStream> {
    let mut s: Ptr = std::ptr::null_mut();
    // SAFETY: writes one handle through a valid pointer.
    check("cuStreamCreate", unsafe {
        (b.api()?.cuStreamCreate)(&mut s, consts::STREAM_NON_BLOCKING)
    })?;
    Ok(RawStream(s as usize))
}

/// # Safety
/// `s` came from [`stream_create`] in the bound context and is destroyed once (work already
/// queued on it still completes).
pub unsafe fn stream_destroy(b: &Bound, s: RawStream) -> Result<()> {
    check("cuStreamDestroy_v2", (b.api()?.cuStreamDestroy_v2)(s.0 as Ptr))
}

/// # Safety
/// `s` is a live stream handle of the bound context (or 0).
pub unsafe fn stream_synchronize(b: &Bound, s: RawStream) -> Result<()> {
    check("cuStreamSynchronize", (b.api()?.cuStreamSynchronize)(s.0 as Ptr))
}

/// Makes work queued later on `s` wait for the work `e` last recorded.
///
/// # Safety
/// `s` (of the bound context) and `e` are live handles.
pub unsafe fn stream_wait_event(b: &Bound, s: RawStream, e: RawEvent) -> Result<()> {
    check(
        "cuStreamWaitEvent",
        (b.api()?.cuStreamWaitEvent)(s.0 as Ptr, e.0 as Ptr, 0),
    )
}

/// The device of the context a stream belongs to (visible index); needs no bound context
/// (it pushes the stream's own and pops it again).
///
/// # Safety
/// `s` is a live stream handle, not 0.
pub unsafe fn stream_device(s: RawStream) -> Result<i32> {
    let api = api()?;
    let mut ctx: Ptr = std::ptr::null_mut();
    check("cuStreamGetCtx", (api.cuStreamGetCtx)(s.0 as Ptr, &mut ctx))?;
    check("cuCtxPushCurrent_v2", (api.cuCtxPushCurrent_v2)(ctx))?;
    let mut dev: c_int = -1;
    let r = (api.cuCtxGetDevice)(&mut dev);
    let mut popped: Ptr = std::ptr::null_mut();
    let _ = (api.cuCtxPopCurrent_v2)(&mut popped);
    check("cuCtxGetDevice", r)?;
    Ok(dev)
}

/// What an event is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Ordering and host waits in this process: a host wait sleeps instead of spinning.
    Local,
    /// Exportable with [`ipc_event_handle`] (the driver requires timing disabled).
    Interprocess,
}

/// The flags an event of `kind` is created with (no event records timing).
pub fn event_flags(kind: EventKind) -> u32 {
    match kind {
        EventKind::Local => consts::EVENT_DISABLE_TIMING | consts::EVENT_BLOCKING_SYNC,
        // Blocking sync is allowed with interprocess (PyTorch's shared CUDA tensors use the
        // same three flags); the driver requires timing disabled.
        EventKind::Interprocess => {
            consts::EVENT_DISABLE_TIMING | consts::EVENT_INTERPROCESS | consts::EVENT_BLOCKING_SYNC
        }
    }
}

/// A new event of the bound context.
pub fn event_create(b: &Bound, kind: EventKind) -> Result<RawEvent> {
    let mut e: Ptr = std::ptr::null_mut();
    // SAFETY: writes one handle through a valid pointer.
    check("cuEventCreate", unsafe {
        (b.api()?.cuEventCreate)(&mut e, event_flags(kind))
    })?;
    Ok(RawEvent(e as usize))
}

/// # Safety
/// `e` is a live event (created or opened here) destroyed once; waits already queued on it
/// are unaffected.
pub unsafe fn event_destroy(b: &Bound, e: RawEvent) -> Result<()> {
    check("cuEventDestroy_v2", (b.api()?.cuEventDestroy_v2)(e.0 as Ptr))
}

/// # Safety
/// `e` and `s` are live handles of the bound context.
pub unsafe fn event_record(b: &Bound, e: RawEvent, s: RawStream) -> Result<()> {
    check("cuEventRecord", (b.api()?.cuEventRecord)(e.0 as Ptr, s.0 as Ptr))
}

/// Whether the work `e` last recorded has finished (an event never recorded has).
///
/// # Safety
/// `e` is a live handle.
pub unsafe fn event_query(b: &Bound, e: RawEvent) -> Result<bool> {
    let r = (b.api()?.cuEventQuery)(e.0 as Ptr);
    if r == consts::ERROR_NOT_READY {
        return Ok(false);
    }
    check("cuEventQuery", r).map(|()| true)
}

/// Blocks this thread until the work `e` last recorded has finished.
///
/// # Safety
/// `e` is a live handle.
pub unsafe fn event_synchronize(b: &Bound, e: RawEvent) -> Result<()> {
    check("cuEventSynchronize", (b.api()?.cuEventSynchronize)(e.0 as Ptr))
}

/// The IPC handle of the allocation that *starts* at `base`.
///
/// # Safety
/// `base` is the start of a live allocation of the bound context made with `cuMemAlloc` (not
/// a pool or VMM allocation, which the driver rejects with an error).
pub unsafe fn ipc_mem_handle(b: &Bound, base: DevicePtr) -> Result<[u8; IPC_HANDLE_BYTES]> {
    let mut h = IpcHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    check("cuIpcGetMemHandle", (b.api()?.cuIpcGetMemHandle)(&mut h, base))?;
    Ok(h.reserved.map(|c| c as u8))
}

/// Maps another process's allocation into the bound context; returns its base.
pub fn ipc_open_mem_handle(b: &Bound, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<DevicePtr> {
    let h = IpcHandle {
        reserved: handle.map(|c| c as c_char),
    };
    let mut p: u64 = 0;
    // SAFETY: the handle is passed by value and validated by the driver; writes one address.
    check("cuIpcOpenMemHandle_v2", unsafe {
        (b.api()?.cuIpcOpenMemHandle_v2)(&mut p, h, consts::IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    })?;
    Ok(p)
}

/// # Safety
/// `p` came from [`ipc_open_mem_handle`] in the bound context, is closed once, and every copy
/// that read it has completed.
pub unsafe fn ipc_close_mem_handle(b: &Bound, p: DevicePtr) -> Result<()> {
    check("cuIpcCloseMemHandle", (b.api()?.cuIpcCloseMemHandle)(p))
}

/// # Safety
/// `e` is a live event of the bound context created as [`EventKind::Interprocess`].
pub unsafe fn ipc_event_handle(b: &Bound, e: RawEvent) -> Result<[u8; IPC_HANDLE_BYTES]> {
    let mut h = IpcHandle {
        reserved: [0; IPC_HANDLE_BYTES],
    };
    check(
        "cuIpcGetEventHandle",
        (b.api()?.cuIpcGetEventHandle)(&mut h, e.0 as Ptr),
    )?;
    Ok(h.reserved.map(|c| c as u8))
}

/// Opens another process's interprocess event in the bound context (destroy it with
/// [`event_destroy`]).
pub fn ipc_open_event_handle(b: &Bound, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<RawEvent> {
    let h = IpcHandle {
        reserved: handle.map(|c| c as c_char),
    };
    let mut e: Ptr = std::ptr::null_mut();
    // SAFETY: the handle is passed by value and validated by the driver; writes one handle.
    check("cuIpcOpenEventHandle", unsafe {
        (b.api()?.cuIpcOpenEventHandle)(&mut e, h)
    })?;
    Ok(RawEvent(e as usize))
}

/// What the driver knows about an address: the device it lives on (visible index), whether it
/// is device memory, and the allocation around it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    pub device: i32,
    pub is_device_memory: bool,
    pub base: DevicePtr,
    pub size: usize,
}

/// Looks up `p` (with a context bound: the address-range query works on the current one).
/// Unknown addresses (host memory never registered) are an error.
pub fn pointer_info(b: &Bound, p: DevicePtr) -> Result<PointerInfo> {
    let api = b.api()?;
    let mut ordinal: c_int = -1;
    let mut kind: c_uint = 0;
    let mut base: u64 = 0;
    let mut size: usize = 0;
    // SAFETY: each call writes one value of the attribute's documented type (int, unsigned
    // int, address, size) through a valid pointer of that type.
    unsafe {
        check(
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
            (api.cuPointerGetAttribute)(
                &mut ordinal as *mut c_int as Ptr,
                consts::POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p,
            ),
        )?;
        check(
            "cuPointerGetAttribute(MEMORY_TYPE)",
            (api.cuPointerGetAttribute)(
                &mut kind as *mut c_uint as Ptr,
                consts::POINTER_ATTRIBUTE_MEMORY_TYPE,
                p,
            ),
        )?;
        check(
            "cuMemGetAddressRange_v2",
            (api.cuMemGetAddressRange_v2)(&mut base, &mut size, p),
        )?;
    }
    Ok(PointerInfo {
        device: ordinal,
        is_device_memory: kind == consts::MEMORYTYPE_DEVICE,
        base,
        size,
    })
}

/// Queues a device-to-device copy (any two devices of this process under unified addressing).
///
/// # Safety
/// `dst` and `src` are valid for `len` bytes until `s` reaches the copy; `s` is a live stream
/// of the bound context.
pub unsafe fn copy_dtod_async(b: &Bound, dst: DevicePtr, src: DevicePtr, len: usize, s: RawStream) -> Result<()> {
    check(
        "cuMemcpyDtoDAsync_v2",
        (b.api()?.cuMemcpyDtoDAsync_v2)(dst, src, len, s.0 as Ptr),
    )
}

/// Queues a copy between two contexts' memory (peer-to-peer when enabled, staged by the
/// driver otherwise).
///
/// # Safety
/// As [`copy_dtod_async`]; both contexts are live.
pub unsafe fn copy_peer_async(
    b: &Bound,
    dst: DevicePtr,
    dst_ctx: RawContext,
    src: DevicePtr,
    src_ctx: RawContext,
    len: usize,
    s: RawStream,
) -> Result<()> {
    check(
        "cuMemcpyPeerAsync",
        (b.api()?.cuMemcpyPeerAsync)(dst, dst_ctx.0 as Ptr, src, src_ctx.0 as Ptr, len, s.0 as Ptr),
    )
}

/// Queues a host-to-device copy.
///
/// # Safety
/// `src` is readable for `len` bytes and `dst` writable for `len` bytes until `s` reaches
/// the copy (for pageable `src`, until this call returns); `s` is of the bound context.
pub unsafe fn copy_htod_async(b: &Bound, dst: DevicePtr, src: *const u8, len: usize, s: RawStream) -> Result<()> {
    check(
        "cuMemcpyHtoDAsync_v2",
        (b.api()?.cuMemcpyHtoDAsync_v2)(dst, src as *const c_void, len, s.0 as Ptr),
    )
}

/// Queues a device-to-host copy.
///
/// # Safety
/// `dst` is writable for `len` bytes (and not otherwise accessed) until `s` reaches the copy;
/// `src` is valid for `len` bytes; `s` is of the bound context.
pub unsafe fn copy_dtoh_async(b: &Bound, dst: *mut u8, src: DevicePtr, len: usize, s: RawStream) -> Result<()> {
    check(
        "cuMemcpyDtoHAsync_v2",
        (b.api()?.cuMemcpyDtoHAsync_v2)(dst as Ptr, src, len, s.0 as Ptr),
    )
}

/// Queues a fill of `len` bytes with `value`.
///
/// # Safety
/// `dst` is valid for `len` bytes until `s` (of the bound context) reaches the fill.
pub unsafe fn memset_async(b: &Bound, dst: DevicePtr, value: u8, len: usize, s: RawStream) -> Result<()> {
    check(
        "cuMemsetD8Async",
        (b.api()?.cuMemsetD8Async)(dst, value, len, s.0 as Ptr),
    )
}

/// A dma-buf file descriptor for `base..base+size` (page aligned), for a NIC to register
/// (GPUDirect RDMA without the peer-memory module). The caller closes it. Needs a CUDA 11.7
/// driver; an older one says so.
///
/// # Safety
/// The range lies within a live allocation of the bound context that stays allocated while
/// anything registered from the descriptor exists.
pub unsafe fn dmabuf_fd(b: &Bound, base: DevicePtr, size: usize) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let call = "cuMemGetHandleForAddressRange";
    let f = b
        .api()?
        .cuMemGetHandleForAddressRange
        .ok_or_else(|| missing(call, "CUDA 11.7"))?;
    let mut fd: c_int = -1;
    check(
        call,
        f(
            &mut fd as *mut c_int as Ptr,
            base,
            size,
            consts::MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        ),
    )?;
    if fd < 0 {
        return Err(DriverError {
            call,
            code: -1,
            name: "no descriptor returned".into(),
        });
    }
    // SAFETY: a fresh descriptor the driver handed to us.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Makes the GPUDirect RDMA writes that have completed so far visible to work in the bound
/// context (`cuFlushGPUDirectRDMAWrites`, target the current context, scope its owner).
pub fn flush_gpudirect_writes(b: &Bound) -> Result<()> {
    let call = "cuFlushGPUDirectRDMAWrites";
    let f = b
        .api()?
        .cuFlushGPUDirectRDMAWrites
        .ok_or_else(|| missing(call, "CUDA 11.3"))?;
    // SAFETY: no pointers; the context is current (`b`).
    check(call, unsafe {
        f(consts::FLUSH_TARGET_CURRENT_CTX, consts::FLUSH_TO_OWNER)
    })
}

/// Loads a module image (PTX, NUL-terminated, or a CUBIN) into the bound context.
pub fn module_load(b: &Bound, image: &[u8]) -> Result<RawModule> {
    let mut m: Ptr = std::ptr::null_mut();
    // SAFETY: the image is read by the driver during the call only (a PTX image carries its
    // NUL, a CUBIN its ELF header with its own length); writes one handle.
    check("cuModuleLoadData", unsafe {
        (b.api()?.cuModuleLoadData)(&mut m, image.as_ptr() as *const c_void)
    })?;
    Ok(RawModule(m as usize))
}

/// The kernel `name` of a loaded module.
///
/// # Safety
/// `m` is a live module of the bound context.
pub unsafe fn module_function(b: &Bound, m: RawModule, name: &CStr) -> Result<RawFunction> {
    let mut f: Ptr = std::ptr::null_mut();
    check(
        "cuModuleGetFunction",
        (b.api()?.cuModuleGetFunction)(&mut f, m.0 as Ptr, name.as_ptr()),
    )?;
    Ok(RawFunction(f as usize))
}

/// Queues `f` on `s` with a 1-D grid.
///
/// # Safety
/// `f` is a live kernel of the bound context's module, `s` a live stream of that context,
/// and `params` holds one pointer per kernel parameter, each to a value of exactly the type
/// the kernel declares (read during the call). Every address the kernel dereferences must be
/// device memory that stays allocated until the stream has passed the kernel, and every
/// write must stay inside memory the caller owns.
pub unsafe fn launch(
    b: &Bound,
    f: RawFunction,
    grid: u32,
    block: u32,
    s: RawStream,
    params: &mut [*mut c_void],
) -> Result<()> {
    check(
        "cuLaunchKernel",
        (b.api()?.cuLaunchKernel)(
            f.0 as Ptr,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            s.0 as Ptr,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_integers_and_unknown_ones_are_named_by_number() {
        // Codes newer than any table here (CUDA 12.9/13 added several) must not be trusted to
        // fit an enum: they are reported as numbers.
        for code in [47, 227, 918, 919, 12345, -7] {
            let e = check("cuTest", code).unwrap_err();
            assert_eq!(e.code, code);
            if !library_present() {
                assert_eq!(e.name, format!("unknown CUDA error {code}"), "{e}");
            }
        }
        // Codes of CUDA 13 that the 12.8 bindings lacked are named.
        assert_eq!(known_name(36), "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER");
        assert_eq!(known_name(917), "CUDA_ERROR_STREAM_DETACHED");
        assert!(check("cuTest", 0).is_ok());
        assert_eq!(known_name(222), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION");
    }

    #[test]
    fn a_stub_library_is_reported_as_such() {
        let e = check("cuInit", ERROR_STUB_LIBRARY).unwrap_err();
        assert!(e.name.contains("stub"), "{e}");
        assert!(e.to_string().contains("(34)"), "{e}");
    }

    #[test]
    fn the_driver_soname_is_tried_before_the_development_link() {
        assert_eq!(LIBRARY_NAMES[0], "libcuda.so.1");
        assert_eq!(LIBRARY_NAMES.last(), Some(&"libcuda.so"));
    }

    #[test]
    fn host_waits_sleep_and_exported_events_keep_timing_off() {
        assert_eq!(event_flags(EventKind::Local), 0x1 | 0x2);
        assert_eq!(event_flags(EventKind::Interprocess), 0x1 | 0x2 | 0x4);
    }

    #[test]
    fn without_a_driver_nothing_panics() {
        if !crate::gate::without_driver_or_skip("without_a_driver_nothing_panics") {
            return;
        }
        assert!(driver_version().is_err());
        assert!(init().is_err());
        assert!(library().unwrap_err().name.contains("libcuda.so.1"));
    }
}
