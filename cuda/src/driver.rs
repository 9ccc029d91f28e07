//! The CUDA driver calls Sluice makes, as thin wrappers over cudarc's raw bindings (loaded at run
//! time, so a build without CUDA still starts). Every call that touches memory or handles is an
//! `unsafe fn` whose contract is stated here; its callers (`memory`, `events`, `ipc`, the
//! pipe's copy) justify each use with a `// SAFETY:` comment.
//!
//! Rules every caller keeps:
//! - Nothing here may be called before [`library_present`] returned true and
//!   [`driver_version`] was checked: cudarc panics on a missing library or symbol. The
//!   process-wide [`super::runtime`] does both once and hands out nothing when either fails.
//! - Calls that work on a context (allocation, streams, events, copies, IPC) need one current
//!   on the calling thread: callers [`set_current`] a device's primary context first, on the
//!   same thread, with no `.await` in between.
//!
//! Raw handles travel as integers ([`RawStream`], [`RawEvent`], [`RawContext`]): the driver's
//! handles are process-wide and may be used from any thread, which the integer form makes
//! `Send` and `Sync` without claiming anything about Rust memory.
#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint, c_void, CStr};

use cudarc::driver::sys;

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

impl RawStream {
    fn ptr(self) -> sys::CUstream {
        self.0 as sys::CUstream
    }
}

impl RawEvent {
    fn ptr(self) -> sys::CUevent {
        self.0 as sys::CUevent
    }
}

impl RawContext {
    fn ptr(self) -> sys::CUcontext {
        self.0 as sys::CUcontext
    }
}

/// Bytes of an IPC memory or event handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A failed driver call: which call, and the driver's error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed: {name} ({code})")]
pub struct DriverError {
    pub call: &'static str,
    pub code: i32,
    pub name: String,
}

pub type Result<T> = std::result::Result<T, DriverError>;

fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DriverError {
            call,
            code: r as i32,
            name: format!("{r:?}"),
        })
    }
}

/// Whether the driver library (`libcuda.so` or `libcuda.so.1`) can be loaded.
pub fn library_present() -> bool {
    // SAFETY: tries to dlopen the candidate names and drops each handle; loading the real
    // driver library runs only its own initializers, which is what every CUDA program does.
    unsafe { sys::is_culib_present() }
}

/// The driver's CUDA version, e.g. `12080` for 12.8.
pub fn driver_version() -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: writes one int through a valid pointer; needs no context.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v) })?;
    Ok(v)
}

pub fn init() -> Result<()> {
    // SAFETY: no pointers; the flags must be 0.
    check("cuInit", unsafe { sys::cuInit(0) })
}

pub fn device_count() -> Result<i32> {
    let mut n: c_int = 0;
    // SAFETY: writes one int through a valid pointer; after cuInit.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

/// The driver's handle of the device with visible index `ordinal`.
pub fn device(ordinal: i32) -> Result<i32> {
    let mut d: sys::CUdevice = 0;
    // SAFETY: writes one int through a valid pointer; the driver checks the ordinal.
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut d, ordinal) })?;
    Ok(d)
}

/// The device's UUID (the same in every process, whatever `CUDA_VISIBLE_DEVICES` says).
pub fn device_uuid(dev: i32) -> Result<[u8; 16]> {
    let mut u = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: writes 16 bytes into a valid CUuuid.
    check("cuDeviceGetUuid_v2", unsafe { sys::cuDeviceGetUuid_v2(&mut u, dev) })?;
    Ok(u.bytes.map(|b| b as u8))
}

pub fn device_name(dev: i32) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes into `buf`.
    check("cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, dev)
    })?;
    // SAFETY: `buf` is NUL-terminated (the driver wrote a C string shorter than the buffer,
    // and the last byte is still 0 either way).
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}

/// The device's PCI address, lower case (`0000:3b:00.0`), as sysfs names it.
pub fn pci_bus_id(dev: i32) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes into `buf`.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, dev)
    })?;
    // SAFETY: NUL-terminated, as above.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().to_lowercase())
}

/// A dma-buf file descriptor for `base..base+size` (an allocation, page aligned), for a NIC to
/// register (GPUDirect RDMA without the peer-memory module). The caller closes it.
///
/// # Safety
/// The context owning the allocation is current on this thread, and the range lies within a
/// live allocation that stays allocated while anything registered from the descriptor exists.
pub unsafe fn dmabuf_fd(base: DevicePtr, size: usize) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let mut fd: c_int = -1;
    check("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            &mut fd as *mut c_int as *mut c_void,
            base,
            size,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(DriverError {
            call: "cuMemGetHandleForAddressRange",
            code: -1,
            name: "no descriptor returned".into(),
        });
    }
    // SAFETY: a fresh descriptor the driver handed to us.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Whether `dev` can access `peer`'s memory directly (NVLink or PCIe peer-to-peer).
pub fn can_access_peer(dev: i32, peer: i32) -> Result<bool> {
    let mut can: c_int = 0;
    // SAFETY: writes one int through a valid pointer.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, dev, peer)
    })?;
    Ok(can != 0)
}

/// Retains the device's primary context (the one the runtime API and PyTorch use). Never
/// released: the process keeps it for its lifetime.
pub fn primary_context(dev: i32) -> Result<RawContext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle through a valid pointer.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
    })?;
    Ok(RawContext(ctx as usize))
}

/// Makes `ctx` current on this thread.
pub fn set_current(ctx: RawContext) -> Result<()> {
    // SAFETY: `ctx` came from `primary_context` and is never released.
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx.ptr()) })
}

/// Waits for everything queued in the current context.
pub fn ctx_synchronize() -> Result<()> {
    // SAFETY: no pointers; needs a current context, which callers set.
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// Lets the current context access `peer`'s memory. Already enabled is not an error.
pub fn enable_peer_access(peer: RawContext) -> Result<()> {
    // SAFETY: `peer` came from `primary_context`; the flags must be 0.
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ptr(), 0) };
    if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check("cuCtxEnablePeerAccess", r)
}

/// Allocates `len` bytes of device memory in the current context.
pub fn mem_alloc(len: usize) -> Result<DevicePtr> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: writes one address through a valid pointer.
    check("cuMemAlloc_v2", unsafe { sys::cuMemAlloc_v2(&mut p, len.max(1)) })?;
    Ok(p)
}

/// Frees device memory.
///
/// # Safety
/// `p` came from [`mem_alloc`], is freed once, and no queued work still uses it.
pub unsafe fn mem_free(p: DevicePtr) -> Result<()> {
    check("cuMemFree_v2", sys::cuMemFree_v2(p))
}

/// Allocates `len` bytes of pinned host memory, usable by every context.
pub fn host_alloc(len: usize) -> Result<*mut u8> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer through a valid pointer.
    check("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut p, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE)
    })?;
    Ok(p as *mut u8)
}

/// Frees pinned host memory.
///
/// # Safety
/// `p` came from [`host_alloc`], is freed once, and nothing (host or device) still uses it.
pub unsafe fn host_free(p: *mut u8) -> Result<()> {
    check("cuMemFreeHost", sys::cuMemFreeHost(p as *mut c_void))
}

/// A new non-blocking stream in the current context.
pub fn stream_create() -> Result<RawStream> {
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: writes one handle through a valid pointer.
    check("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint)
    })?;
    Ok(RawStream(s as usize))
}

/// # Safety
/// `s` came from [`stream_create`] and is destroyed once.
pub unsafe fn stream_destroy(s: RawStream) -> Result<()> {
    check("cuStreamDestroy_v2", sys::cuStreamDestroy_v2(s.ptr()))
}

/// # Safety
/// `s` is a live stream handle (or 0).
pub unsafe fn stream_synchronize(s: RawStream) -> Result<()> {
    check("cuStreamSynchronize", sys::cuStreamSynchronize(s.ptr()))
}

/// Makes work queued later on `s` wait for the work `e` last recorded.
///
/// # Safety
/// `s` and `e` are live handles.
pub unsafe fn stream_wait_event(s: RawStream, e: RawEvent) -> Result<()> {
    check("cuStreamWaitEvent", sys::cuStreamWaitEvent(s.ptr(), e.ptr(), 0))
}

/// A new event without timing; `interprocess` makes it exportable with [`ipc_event_handle`].
pub fn event_create(interprocess: bool) -> Result<RawEvent> {
    let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
    if interprocess {
        flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as c_uint;
    }
    let mut e: sys::CUevent = std::ptr::null_mut();
    // SAFETY: writes one handle through a valid pointer.
    check("cuEventCreate", unsafe { sys::cuEventCreate(&mut e, flags) })?;
    Ok(RawEvent(e as usize))
}

/// # Safety
/// `e` is a live event (created or opened here) destroyed once; waits already queued on it
/// are unaffected.
pub unsafe fn event_destroy(e: RawEvent) -> Result<()> {
    check("cuEventDestroy_v2", sys::cuEventDestroy_v2(e.ptr()))
}

/// # Safety
/// `e` and `s` are live handles of the same device.
pub unsafe fn event_record(e: RawEvent, s: RawStream) -> Result<()> {
    check("cuEventRecord", sys::cuEventRecord(e.ptr(), s.ptr()))
}

/// Whether the work `e` last recorded has finished.
///
/// # Safety
/// `e` is a live handle.
pub unsafe fn event_query(e: RawEvent) -> Result<bool> {
    let r = sys::cuEventQuery(e.ptr());
    if r == sys::CUresult::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check("cuEventQuery", r).map(|()| true)
}

/// Blocks this thread until the work `e` last recorded has finished.
///
/// # Safety
/// `e` is a live handle.
pub unsafe fn event_synchronize(e: RawEvent) -> Result<()> {
    check("cuEventSynchronize", sys::cuEventSynchronize(e.ptr()))
}

/// The IPC handle of the allocation that *starts* at `base`.
///
/// # Safety
/// `base` is the start of a live allocation made with `cuMemAlloc` (not a pool or VMM
/// allocation, which the driver rejects with an error).
pub unsafe fn ipc_mem_handle(base: DevicePtr) -> Result<[u8; IPC_HANDLE_BYTES]> {
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    check("cuIpcGetMemHandle", sys::cuIpcGetMemHandle(&mut h, base))?;
    Ok(h.reserved.map(|b| b as u8))
}

/// Maps another process's allocation into the current context; returns its base.
pub fn ipc_open_mem_handle(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<DevicePtr> {
    let h = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: the handle is passed by value and validated by the driver; writes one address.
    check("cuIpcOpenMemHandle_v2", unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut p,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint,
        )
    })?;
    Ok(p)
}

/// # Safety
/// `p` came from [`ipc_open_mem_handle`], is closed once, and no queued work still reads it.
pub unsafe fn ipc_close_mem_handle(p: DevicePtr) -> Result<()> {
    check("cuIpcCloseMemHandle", sys::cuIpcCloseMemHandle(p))
}

/// # Safety
/// `e` is a live event created with `interprocess`.
pub unsafe fn ipc_event_handle(e: RawEvent) -> Result<[u8; IPC_HANDLE_BYTES]> {
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    check("cuIpcGetEventHandle", sys::cuIpcGetEventHandle(&mut h, e.ptr()))?;
    Ok(h.reserved.map(|b| b as u8))
}

/// Opens another process's interprocess event (destroy it with [`event_destroy`]).
pub fn ipc_open_event_handle(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<RawEvent> {
    let h = sys::CUipcEventHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut e: sys::CUevent = std::ptr::null_mut();
    // SAFETY: the handle is passed by value and validated by the driver; writes one handle.
    check("cuIpcOpenEventHandle", unsafe { sys::cuIpcOpenEventHandle(&mut e, h) })?;
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

/// Looks up `p`. Unknown addresses (host memory never registered) are an error.
pub fn pointer_info(p: DevicePtr) -> Result<PointerInfo> {
    let mut ordinal: c_int = -1;
    let mut kind: c_uint = 0;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: each call writes one value of the attribute's documented type (int, unsigned
    // int, address, size) through a valid pointer of that type.
    unsafe {
        check(
            "cuPointerGetAttribute(DEVICE_ORDINAL)",
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut c_int as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p,
            ),
        )?;
        check(
            "cuPointerGetAttribute(MEMORY_TYPE)",
            sys::cuPointerGetAttribute(
                &mut kind as *mut c_uint as *mut c_void,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                p,
            ),
        )?;
        check(
            "cuMemGetAddressRange_v2",
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, p),
        )?;
    }
    Ok(PointerInfo {
        device: ordinal,
        is_device_memory: kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as c_uint,
        base,
        size,
    })
}

/// The device of the context a stream belongs to (visible index).
///
/// # Safety
/// `s` is a live stream handle, not 0.
pub unsafe fn stream_device(s: RawStream) -> Result<i32> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    check("cuStreamGetCtx", sys::cuStreamGetCtx(s.ptr(), &mut ctx))?;
    check("cuCtxPushCurrent_v2", sys::cuCtxPushCurrent_v2(ctx))?;
    let mut dev: sys::CUdevice = -1;
    let r = sys::cuCtxGetDevice(&mut dev);
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    let _ = sys::cuCtxPopCurrent_v2(&mut popped);
    check("cuCtxGetDevice", r)?;
    Ok(dev)
}

/// Queues a device-to-device copy (any two devices of this process under unified addressing).
///
/// # Safety
/// `dst` and `src` are valid for `len` bytes until `s` reaches the copy; `s` is live.
pub unsafe fn copy_dtod_async(dst: DevicePtr, src: DevicePtr, len: usize, s: RawStream) -> Result<()> {
    check(
        "cuMemcpyDtoDAsync_v2",
        sys::cuMemcpyDtoDAsync_v2(dst, src, len, s.ptr()),
    )
}

/// Queues a copy between two contexts' memory (peer-to-peer when enabled, staged by the
/// driver otherwise).
///
/// # Safety
/// As [`copy_dtod_async`]; both contexts are live.
pub unsafe fn copy_peer_async(
    dst: DevicePtr,
    dst_ctx: RawContext,
    src: DevicePtr,
    src_ctx: RawContext,
    len: usize,
    s: RawStream,
) -> Result<()> {
    check(
        "cuMemcpyPeerAsync",
        sys::cuMemcpyPeerAsync(dst, dst_ctx.ptr(), src, src_ctx.ptr(), len, s.ptr()),
    )
}

/// Queues a host-to-device copy.
///
/// # Safety
/// `src` is readable for `len` bytes and `dst` writable for `len` bytes until `s` reaches
/// the copy (for pageable `src`, until this call returns).
pub unsafe fn copy_htod_async(dst: DevicePtr, src: *const u8, len: usize, s: RawStream) -> Result<()> {
    check(
        "cuMemcpyHtoDAsync_v2",
        sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, s.ptr()),
    )
}

/// Queues a device-to-host copy.
///
/// # Safety
/// `dst` is writable for `len` bytes (and not otherwise accessed) until `s` reaches the copy;
/// `src` is valid for `len` bytes.
pub unsafe fn copy_dtoh_async(dst: *mut u8, src: DevicePtr, len: usize, s: RawStream) -> Result<()> {
    check(
        "cuMemcpyDtoHAsync_v2",
        sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, s.ptr()),
    )
}

/// Queues a fill of `len` bytes with `value`.
///
/// # Safety
/// `dst` is valid for `len` bytes until `s` reaches the fill.
pub unsafe fn memset_async(dst: DevicePtr, value: u8, len: usize, s: RawStream) -> Result<()> {
    check("cuMemsetD8Async", sys::cuMemsetD8Async(dst, value, len, s.ptr()))
}

/// A loaded module (compiled kernels) of one context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawModule(pub usize);

/// A kernel of a loaded module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawFunction(pub usize);

/// Whether the device orders GPUDirect RDMA writes for its own context
/// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` at least `OWNER`): when it does not,
/// a NIC's writes must be flushed ([`flush_gpudirect_writes`]) before kernels read the memory.
pub fn gpudirect_writes_ordered(dev: i32) -> Result<bool> {
    let mut ordering: c_int = 0;
    // SAFETY: writes one int through a valid pointer; the driver checks `dev`.
    check("cuDeviceGetAttribute(GPU_DIRECT_RDMA_WRITES_ORDERING)", unsafe {
        sys::cuDeviceGetAttribute(
            &mut ordering,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
            dev,
        )
    })?;
    Ok(ordering >= sys::CUGPUDirectRDMAWritesOrdering_enum::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER as c_int)
}

/// Makes the GPUDirect RDMA writes that have completed so far visible to work in the current
/// context (`cuFlushGPUDirectRDMAWrites`, target the current context, scope its owner). The
/// caller has the context of the written memory's device current.
pub fn flush_gpudirect_writes() -> Result<()> {
    // SAFETY: no pointers; the driver checks that a context is current.
    check("cuFlushGPUDirectRDMAWrites", unsafe {
        sys::cuFlushGPUDirectRDMAWrites(
            sys::CUflushGPUDirectRDMAWritesTarget_enum::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
            sys::CUflushGPUDirectRDMAWritesScope_enum::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
        )
    })
}

/// The device's compute capability, `(major, minor)`.
pub fn compute_capability(dev: i32) -> Result<(i32, i32)> {
    use sys::CUdevice_attribute as A;
    let mut major: c_int = 0;
    let mut minor: c_int = 0;
    // SAFETY: each call writes one int through a valid pointer; the driver checks `dev`.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut major, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    })?;
    // SAFETY: as above.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(&mut minor, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    })?;
    Ok((major, minor))
}

/// Loads PTX (NUL-terminated) into the current context.
pub fn module_load_ptx(ptx: &CStr) -> Result<RawModule> {
    let mut m: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `ptx` is a NUL-terminated image the driver reads during the call; writes one
    // handle through a valid pointer.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut m, ptx.as_ptr() as *const c_void)
    })?;
    Ok(RawModule(m as usize))
}

/// The kernel `name` of a loaded module.
///
/// # Safety
/// `m` is a live module.
pub unsafe fn module_function(m: RawModule, name: &CStr) -> Result<RawFunction> {
    let mut f: sys::CUfunction = std::ptr::null_mut();
    check(
        "cuModuleGetFunction",
        sys::cuModuleGetFunction(&mut f, m.0 as sys::CUmodule, name.as_ptr()),
    )?;
    Ok(RawFunction(f as usize))
}

/// Queues `f` on `s` with a 1-D grid.
///
/// # Safety
/// `f` is a live kernel of the current context's module, `s` a live stream of that context,
/// and `params` holds one pointer per kernel parameter, each to a value of exactly the type
/// the kernel declares (read during the call). Every address the kernel dereferences must be
/// device memory that stays allocated until the stream has passed the kernel, and every
/// write must stay inside memory the caller owns.
pub unsafe fn launch(f: RawFunction, grid: u32, block: u32, s: RawStream, params: &mut [*mut c_void]) -> Result<()> {
    check(
        "cuLaunchKernel",
        sys::cuLaunchKernel(
            f.0 as sys::CUfunction,
            grid,
            1,
            1,
            block,
            1,
            1,
            0,
            s.ptr(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ),
    )
}
