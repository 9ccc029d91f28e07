//! The owning CUDA types: streams, device memory, pinned host memory, and [`CudaBuffer`] (device
//! memory plus the stream that orders it), with the copies the channels queue on them.
//!
//! Memory safety: device memory is never dereferenced by the host, so the Rust-level promise
//! these types keep is that every address handed to the driver lies inside an allocation that
//! is alive until the work using it has finished. A buffer keeps its allocation alive (`keep`),
//! and a dropped allocation is freed only once events recorded on the streams that used it
//! have completed (`alloc`). Pinned memory is touched by the host only
//! through `&mut`, and the staging code waits for the device's copies out of a slot before it
//! hands the slot out again.
#![allow(unsafe_code)]

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::driver::{self, DevicePtr, RawStream};
use super::{alloc, runtime, CudaError, Event};

/// What a peer needs to map a buffer exported with [`CudaBuffer::ipc_export`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// The allocation's IPC handle.
    pub handle: [u8; driver::IPC_HANDLE_BYTES],
    /// The buffer's offset from the allocation's start.
    pub offset: u64,
    /// The allocation's size: the importer checks offsets against it rather than asking the
    /// driver about the mapped pointer.
    pub size: u64,
}

/// Gives every stream an identity of its own: a driver handle can be reused by a new stream
/// once the old one is destroyed, so caches key by this, never by the handle.
static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

/// The driver's stream, shared by a [`Stream`]'s clones and by the memory its buffers used, so
/// an event can always be recorded after that memory's last use. An owned stream is destroyed
/// with the last of them.
pub(crate) struct StreamHandle {
    device: u32,
    raw: RawStream,
    owned: bool,
    end: Mutex<End>,
}

/// Whether events may still be recorded on a stream.
enum End {
    Live,
    /// A stream Sluice does not own whose last wrapper is gone (its owner may destroy it):
    /// the event recorded then stands for all of its work.
    Ended(Event),
    /// As `Ended`, but no event could be recorded: memory it used is never freed.
    Unknown,
}

impl StreamHandle {
    /// An event after everything queued on the stream so far (its last one, once it ended);
    /// `None` when none can be had.
    pub(crate) fn fence(&self) -> Option<Event> {
        let end = self.end.lock().unwrap_or_else(|e| e.into_inner());
        match &*end {
            End::Ended(e) => Some(e.clone()),
            End::Unknown => None,
            End::Live => {
                let bound = runtime().ok()?.bind(self.device).ok()?;
                Event::record_raw(&bound, self.raw).ok()
            }
        }
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let Ok(cuda) = runtime() else { return };
        if let Ok(bound) = cuda.bind(self.device) {
            // SAFETY: created by `Stream::new`, destroyed once (its last holder); work already
            // queued on it still completes.
            let _ = unsafe { driver::stream_destroy(&bound, self.raw) };
        }
    }
}

/// A stream as Sluice's caches know it: an identity plus the driver's stream.
pub(crate) struct StreamInner {
    id: u64,
    handle: Arc<StreamHandle>,
}

impl StreamHandle {
    /// For a stream made elsewhere: records the fence that work queued on memory after this
    /// point is ordered against, once (later calls keep the first). The owner may destroy the
    /// stream afterwards.
    fn end_now(&self) {
        if self.owned {
            return;
        }
        let mut end = self.end.lock().unwrap_or_else(|e| e.into_inner());
        if matches!(*end, End::Live) {
            let fence = runtime()
                .ok()
                .and_then(|c| c.bind(self.device).ok())
                .and_then(|b| Event::record_raw(&b, self.raw).ok());
            *end = fence.map_or(End::Unknown, End::Ended);
        }
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        // The owner may destroy a stream made elsewhere once our last wrapper is gone: fence it.
        self.handle.end_now();
        // Its cached blocks are retired (each fenced on the handle, which memory keeps).
        alloc::stream_gone(self.id);
    }
}

/// A CUDA stream of one device. Cheap to clone; an owned stream is destroyed once its last
/// clone and the last memory its buffers used are gone.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Stream(cuda:{}, {:#x})",
            self.inner.handle.device, self.inner.handle.raw.0
        )
    }
}

impl Stream {
    fn wrap(device: u32, raw: RawStream, owned: bool) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                id: NEXT_STREAM.fetch_add(1, Ordering::Relaxed),
                handle: Arc::new(StreamHandle {
                    device,
                    raw,
                    owned,
                    end: Mutex::new(End::Live),
                }),
            }),
        }
    }

    /// A new non-blocking stream on `device`.
    pub fn new(device: u32) -> Result<Stream, CudaError> {
        let bound = runtime()?.bind(device)?;
        let raw = driver::stream_create(&bound)?;
        Ok(Stream::wrap(device, raw, true))
    }

    /// Wraps a stream made elsewhere (for example PyTorch's current stream). Sluice never
    /// destroys it. Each wrapper is a stream of its own to Sluice's caches: blocks cached for
    /// it are released (after the work queued so far) when its last clone is dropped.
    ///
    /// # Safety
    /// `raw` is a live stream handle of `device`'s primary context (or 0, that context's legacy
    /// default stream) and stays alive as long as this value and its clones are used.
    pub unsafe fn from_raw(device: u32, raw: usize) -> Result<Stream, CudaError> {
        let cuda = runtime()?;
        cuda.bind(device)?;
        if raw != 0 {
            // SAFETY: the caller promises a live handle.
            let actual = unsafe { driver::stream_device(RawStream(raw)) }?;
            if actual != device as i32 {
                return Err(CudaError::Invalid(format!(
                    "stream {raw:#x} belongs to cuda:{actual}, not cuda:{device}"
                )));
            }
        }
        Ok(Stream::wrap(device, RawStream(raw), false))
    }

    pub fn device(&self) -> u32 {
        self.inner.handle.device
    }

    /// For a stream wrapped with [`from_raw`](Self::from_raw): fences it now, as the drop of
    /// its last wrapper would, so that its owner may destroy it once this returns even if a
    /// clone is still held somewhere (what the C API does before handing memory and its stream
    /// back to the caller). Nothing may queue work on it afterwards. No effect on a stream
    /// Sluice made.
    pub fn retire(&self) {
        self.inner.handle.end_now();
    }

    /// The driver's handle.
    pub fn raw(&self) -> usize {
        self.inner.handle.raw.0
    }

    pub fn handle(&self) -> RawStream {
        self.inner.handle.raw
    }

    /// This stream's identity in this process (never reused, unlike its handle).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Blocks until everything queued so far has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let bound = runtime()?.bind(self.device())?;
        // SAFETY: the stream is alive while `self` is.
        unsafe { driver::stream_synchronize(&bound, self.handle()) }?;
        Ok(())
    }
}

/// Device memory owned by Sluice (`cuMemAlloc`, so it can be shared with CUDA IPC).
///
/// Dropping it never frees at once: the driver only says `cuMemFree` *may* wait for the work
/// using the memory. Instead an event is recorded on every stream its buffers were ordered on
/// (see [`alloc`]) and the memory is freed once those events have completed. Memory that was
/// exported to another process is never freed at all (an importer may still map it; freeing
/// it first is undefined): it is kept for reuse by later allocations of its size.
pub struct DeviceMemory {
    device: u32,
    ptr: DevicePtr,
    len: usize,
    /// Its IPC handle, once exported (exported memory is never freed).
    exported: OnceLock<[u8; driver::IPC_HANDLE_BYTES]>,
    /// The streams buffers over this memory were ordered on (held, so an event can be recorded
    /// on each when the memory is dropped).
    uses: Mutex<Vec<Arc<StreamHandle>>>,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("exported", &self.exported.get().is_some())
            .finish()
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        let uses = std::mem::take(self.uses.get_mut().unwrap_or_else(|e| e.into_inner()));
        alloc::retire(
            alloc::Block {
                device: self.device,
                ptr: self.ptr,
                len: self.len,
                exported: self.exported.get().copied(),
            },
            uses,
        );
    }
}

impl DeviceMemory {
    /// At least `len` bytes on `device` (contents undefined): exported memory of a fitting
    /// size whose last users are done, or a fresh allocation. When the device is out of
    /// memory, blocks cached for reuse and memory waiting to be freed are released first and
    /// the allocation is tried again.
    pub fn new(device: u32, len: usize) -> Result<Arc<DeviceMemory>, CudaError> {
        let block = alloc::allocate(device, len)?;
        Ok(Arc::new(DeviceMemory {
            device,
            ptr: block.ptr,
            len: block.len,
            exported: block.exported.map(OnceLock::from).unwrap_or_default(),
            uses: Mutex::default(),
        }))
    }

    pub fn device(&self) -> u32 {
        self.device
    }

    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this memory was ever exported to another process (it will never be freed).
    pub fn is_exported(&self) -> bool {
        self.exported.get().is_some()
    }

    /// Notes that work on `stream` may use this memory.
    pub(crate) fn used_on(&self, stream: &Stream) {
        let mut uses = self.uses.lock().unwrap_or_else(|e| e.into_inner());
        if !uses.iter().any(|h| Arc::ptr_eq(h, &stream.inner.handle)) {
            uses.push(stream.inner.handle.clone());
        }
    }

    /// The IPC handle of this allocation, made once; the memory is never freed from then on.
    fn export(&self) -> Result<[u8; driver::IPC_HANDLE_BYTES], CudaError> {
        if let Some(h) = self.exported.get() {
            return Ok(*h);
        }
        let bound = runtime()?.bind(self.device)?;
        // SAFETY: `ptr` is the start of this live `cuMemAlloc` allocation.
        let handle = unsafe { driver::ipc_mem_handle(&bound, self.ptr) }?;
        Ok(*self.exported.get_or_init(|| handle))
    }

    /// A buffer over `range` of this memory, ordered by `stream`.
    pub fn buffer(self: &Arc<Self>, range: Range<usize>, stream: &Stream) -> Result<CudaBuffer, CudaError> {
        if range.start > range.end || range.end > self.len {
            return Err(CudaError::Invalid(format!(
                "range {range:?} is outside an allocation of {} bytes",
                self.len
            )));
        }
        if stream.device() != self.device {
            return Err(CudaError::Invalid(format!(
                "memory on cuda:{} with a stream of cuda:{}",
                self.device,
                stream.device()
            )));
        }
        self.used_on(stream);
        Ok(CudaBuffer {
            _keep: self.clone(),
            ptr: self.ptr + range.start as u64,
            len: range.end - range.start,
            device: self.device,
            stream: stream.clone(),
        })
    }
}

/// Pinned (page-locked) host memory, usable by every device. Freed on drop (which may
/// synchronize), so the staging pool allocates it once and its users wait for their copies
/// before letting it go.
#[derive(Debug)]
pub struct PinnedMemory {
    ptr: *mut u8,
    len: usize,
    /// The device whose context allocated it (and frees it).
    device: u32,
}

// SAFETY: the allocation is process-wide and owned by this value alone; access to its bytes
// goes through `&self`/`&mut self` like a `Vec<u8>`.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above: shared access only reads.
unsafe impl Sync for PinnedMemory {}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        let Ok(cuda) = runtime() else { return };
        if let Ok(bound) = cuda.bind(self.device) {
            // SAFETY: allocated by `new` in this context, freed once; its users waited for
            // their copies.
            let _ = unsafe { driver::host_free(&bound, self.ptr) };
        }
    }
}

impl PinnedMemory {
    pub fn new(len: usize) -> Result<PinnedMemory, CudaError> {
        // Portable memory serves every device; allocate it in a context already in use
        // rather than create one (contexts are retained on first use).
        let cuda = runtime()?;
        let device = cuda.gpus.iter().find(|g| g.context_retained()).map_or(0, |g| g.index);
        let bound = cuda.bind(device)?;
        let ptr = driver::host_alloc(&bound, len)?;
        // Touch it once so the first transfer does not pay for page faults; also makes every
        // byte initialized for the slice accessors.
        // SAFETY: `ptr` is a fresh allocation of `len` bytes (at least 1) owned by us.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedMemory { ptr, len, device })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialized bytes owned by `self`, alive while borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Queues a copy of `len` bytes from `src` (at `src_offset`) into the start of this memory,
    /// on `src`'s stream. The caller must not touch these bytes until the stream has passed
    /// the copy (record an event after it and wait for that).
    pub fn fill_from_device(&mut self, src: &CudaBuffer, src_offset: usize, len: usize) -> Result<(), CudaError> {
        check_range(src, src_offset, len)?;
        if len > self.len {
            return Err(CudaError::Invalid(format!("{len} bytes into a {}-byte slot", self.len)));
        }
        let bound = runtime()?.bind(src.device)?;
        // SAFETY: the source range lies inside `src` (checked), kept alive by its `keep`; the
        // destination is ours, and the staging code does not read or reuse it before the
        // stream has passed the copy.
        unsafe { driver::copy_dtoh_async(&bound, self.ptr, src.ptr + src_offset as u64, len, src.stream.handle()) }?;
        Ok(())
    }

    /// Queues a copy of the first `len` bytes of this memory into `dst` (at `dst_offset`), on
    /// `dst`'s stream. The caller must not overwrite these bytes until the stream has passed
    /// the copy.
    pub fn drain_to_device(&self, dst: &CudaBuffer, dst_offset: usize, len: usize) -> Result<(), CudaError> {
        check_range(dst, dst_offset, len)?;
        if len > self.len {
            return Err(CudaError::Invalid(format!("{len} bytes from a {}-byte slot", self.len)));
        }
        let bound = runtime()?.bind(dst.device)?;
        // SAFETY: the destination range lies inside `dst` (checked); the source is ours and is
        // not overwritten before the stream has passed the copy.
        unsafe { driver::copy_htod_async(&bound, dst.ptr + dst_offset as u64, self.ptr, len, dst.stream.handle()) }?;
        Ok(())
    }
}

fn check_range(b: &CudaBuffer, offset: usize, len: usize) -> Result<(), CudaError> {
    if offset.checked_add(len).is_none_or(|end| end > b.len) {
        return Err(CudaError::Invalid(format!(
            "{len} bytes at offset {offset} of a {}-byte buffer",
            b.len
        )));
    }
    Ok(())
}

/// Device memory plus the stream that orders its use: what a CUDA tensor is to a pipe.
///
/// The sender's stream says when the data is ready (channels read only after the work already
/// queued on it); the receiver's stream is where the incoming copy is queued (work queued on it
/// later sees the data).
#[derive(Clone)]
pub struct CudaBuffer {
    ptr: DevicePtr,
    len: usize,
    device: u32,
    stream: Stream,
    /// Never read: holds whatever keeps the memory allocated. Declared last so that it drops
    /// last: a stream wrapped with `Stream::from_raw` is fenced when its last wrapper drops,
    /// and what `keep` holds may be what keeps that stream alive (the C API's allocators).
    _keep: Arc<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("stream", &self.stream)
            .finish()
    }
}

impl CudaBuffer {
    /// A fresh allocation of `len` bytes on the stream's device.
    pub fn alloc(len: usize, stream: &Stream) -> Result<CudaBuffer, CudaError> {
        DeviceMemory::new(stream.device(), len)?.buffer(0..len, stream)
    }

    /// `len` bytes on the stream's device from a cache of blocks kept for reuse on *this
    /// stream* (by the stream's identity, never its reusable handle): freeing device memory
    /// may synchronize the device, so hot paths (received tensors, autograd ops) reuse blocks
    /// instead. A stream's blocks are released when its last clone is dropped, and every
    /// stream's idle blocks when the device runs out of memory.
    ///
    /// A block is reused once nothing but the cache holds it, and only for the same stream, so
    /// the work its last users queued on that stream is ordered before its next user's. Work
    /// queued on *another* stream with this memory must finish before the last handle is
    /// dropped (the rule of PyTorch's caching allocator without `record_stream`).
    pub fn alloc_cached(len: usize, stream: &Stream) -> Result<CudaBuffer, CudaError> {
        let class = len.max(256).next_power_of_two();
        if let Some(mem) = alloc::cached(stream, class) {
            return mem.buffer(0..len, stream);
        }
        let mem = DeviceMemory::new(stream.device(), class)?;
        alloc::keep(stream, &mem);
        mem.buffer(0..len, stream)
    }

    /// Wraps memory allocated elsewhere (for example a PyTorch tensor's storage). The device is
    /// derived from the pointer and must match the stream's.
    ///
    /// # Safety
    /// `ptr..ptr+len` is device memory that stays allocated while this buffer (or a clone, or a
    /// pipe operation using it) exists; `keep` may hold whatever keeps it alive.
    pub unsafe fn from_raw(
        ptr: DevicePtr,
        len: usize,
        stream: &Stream,
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Result<CudaBuffer, CudaError> {
        let bound = runtime()?.bind(stream.device())?;
        let info = driver::pointer_info(&bound, ptr)?;
        if !info.is_device_memory {
            return Err(CudaError::Invalid(format!("{ptr:#x} is not device memory")));
        }
        if info.device != stream.device() as i32 {
            return Err(CudaError::Invalid(format!(
                "{ptr:#x} lives on cuda:{} but its stream is on cuda:{}",
                info.device,
                stream.device()
            )));
        }
        if ptr + len as u64 > info.base + info.size as u64 {
            return Err(CudaError::Invalid(format!(
                "{len} bytes at {ptr:#x} run past the end of their allocation"
            )));
        }
        Ok(CudaBuffer {
            _keep: keep,
            ptr,
            len,
            device: stream.device(),
            stream: stream.clone(),
        })
    }

    pub fn device(&self) -> u32 {
        self.device
    }

    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The same memory ordered by another stream of the same device.
    pub fn with_stream(&self, stream: &Stream) -> Result<CudaBuffer, CudaError> {
        if stream.device() != self.device {
            return Err(CudaError::Invalid(format!(
                "a buffer on cuda:{} cannot use a stream of cuda:{}",
                self.device,
                stream.device()
            )));
        }
        if let Some(mem) = self.memory() {
            mem.used_on(stream);
        }
        Ok(CudaBuffer {
            stream: stream.clone(),
            ..self.clone()
        })
    }

    /// The Sluice allocation this buffer lies in (`None` for memory wrapped with
    /// [`from_raw`](Self::from_raw)).
    pub fn memory(&self) -> Option<&DeviceMemory> {
        self._keep.downcast_ref::<DeviceMemory>()
    }

    /// The sub-buffer `range` (same stream, same allocation kept alive).
    pub fn slice(&self, range: Range<usize>) -> Result<CudaBuffer, CudaError> {
        if range.start > range.end || range.end > self.len {
            return Err(CudaError::Invalid(format!(
                "range {range:?} of a {}-byte buffer",
                self.len
            )));
        }
        Ok(CudaBuffer {
            ptr: self.ptr + range.start as u64,
            len: range.end - range.start,
            ..self.clone()
        })
    }

    /// Exports the allocation this buffer lies in to other processes: its IPC handle, the
    /// allocation's size and the buffer's offset in it (handles name allocations, not
    /// addresses). Only Sluice's own memory can be exported, because exported memory must
    /// never be freed while an importer may map it, and Sluice keeps exported memory for good
    /// (reusing it for later allocations). Memory wrapped from elsewhere is refused: copy it
    /// into a buffer of ours first.
    pub fn ipc_export(&self) -> Result<IpcExport, CudaError> {
        let mem = self.memory().ok_or_else(|| {
            CudaError::Invalid(
                "memory Sluice did not allocate is not exported (its owner could free it while a peer maps it)".into(),
            )
        })?;
        Ok(IpcExport {
            handle: mem.export()?,
            offset: self.ptr - mem.ptr,
            size: mem.len as u64,
        })
    }

    /// Copies `data` in, in stream order, and waits for it (tests and examples).
    pub fn write_from_host(&self, data: &[u8]) -> Result<(), CudaError> {
        check_range(self, 0, data.len())?;
        let bound = runtime()?.bind(self.device)?;
        // SAFETY: the destination lies inside this buffer; the pageable source is read before
        // the call returns or, at the latest, by the synchronize below, while `data` is
        // borrowed.
        unsafe { driver::copy_htod_async(&bound, self.ptr, data.as_ptr(), data.len(), self.stream.handle()) }?;
        self.stream.synchronize()
    }

    /// The bytes, after everything queued on the stream (tests and examples).
    pub fn read_to_host(&self) -> Result<Vec<u8>, CudaError> {
        let mut out = vec![0u8; self.len];
        let bound = runtime()?.bind(self.device)?;
        // SAFETY: the source lies inside this buffer; `out` is written only by this copy and
        // read after the synchronize.
        unsafe { driver::copy_dtoh_async(&bound, out.as_mut_ptr(), self.ptr, self.len, self.stream.handle()) }?;
        self.stream.synchronize()?;
        Ok(out)
    }

    /// Queues a fill with `value` on the stream.
    pub fn fill(&self, value: u8) -> Result<(), CudaError> {
        let bound = runtime()?.bind(self.device)?;
        // SAFETY: the range is this buffer's.
        unsafe { driver::memset_async(&bound, self.ptr, value, self.len, self.stream.handle()) }?;
        Ok(())
    }

    /// Queues a copy of `src` into this buffer on this buffer's stream (same length; any two
    /// devices of this process). Used by baselines and by the channels.
    pub fn copy_from(&self, src: &CudaBuffer) -> Result<(), CudaError> {
        if src.len != self.len {
            return Err(CudaError::Invalid(format!(
                "copy of {} bytes into {} bytes",
                src.len, self.len
            )));
        }
        // The copy reads `src` on this buffer's stream: its memory is freed only after it.
        if let Some(mem) = src.memory() {
            mem.used_on(&self.stream);
        }
        // SAFETY: both ranges are live buffers of the stated length.
        unsafe { self.copy_from_address(src.device, src.ptr) }
    }

    /// Queues a copy of `self.len()` bytes from `src` (on device `src_device`, in this
    /// process's address space, e.g. opened from an IPC handle) on this buffer's stream.
    ///
    /// # Safety
    /// `src..src+len` is valid device memory until the stream has passed the copy.
    pub unsafe fn copy_from_address(&self, src_device: u32, src: DevicePtr) -> Result<(), CudaError> {
        let cuda = runtime()?;
        let src_ctx = if src_device == self.device {
            None
        } else {
            Some(cuda.gpu(src_device)?.context()?)
        };
        let bound = cuda.bind(self.device)?;
        match src_ctx {
            // SAFETY: the destination is this buffer; the caller vouches for the source.
            None => unsafe { driver::copy_dtod_async(&bound, self.ptr, src, self.len, self.stream.handle()) }?,
            // SAFETY: as above, across two contexts of this process.
            Some(src_ctx) => unsafe {
                driver::copy_peer_async(
                    &bound,
                    self.ptr,
                    bound.context(),
                    src,
                    src_ctx,
                    self.len,
                    self.stream.handle(),
                )
            }?,
        }
        Ok(())
    }
}

/// A raw copy measured as a baseline for the CUDA channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawCopy {
    /// Device memory to device memory on one GPU (`cuMemcpyDtoDAsync`).
    DeviceToDevice,
    /// Pinned host memory to the GPU.
    HostToDevice,
    /// The GPU to pinned host memory.
    DeviceToHost,
}

/// Times `iterations` back-to-back copies of `bytes` on `device`'s stream (after one warm-up
/// copy), from the first enqueue until the stream has finished the last.
pub fn time_raw_copies(
    device: u32,
    kind: RawCopy,
    bytes: usize,
    iterations: u32,
) -> Result<std::time::Duration, CudaError> {
    let stream = Stream::new(device)?;
    let a = CudaBuffer::alloc(bytes, &stream)?;
    let mut pinned = None;
    let b = match kind {
        RawCopy::DeviceToDevice => Some(CudaBuffer::alloc(bytes, &stream)?),
        _ => {
            pinned = Some(PinnedMemory::new(bytes)?);
            None
        }
    };
    let mut run = |n: u32| -> Result<std::time::Duration, CudaError> {
        let start = std::time::Instant::now();
        for _ in 0..n {
            match (kind, &b, pinned.as_mut()) {
                (RawCopy::DeviceToDevice, Some(b), _) => b.copy_from(&a)?,
                (RawCopy::HostToDevice, _, Some(p)) => p.drain_to_device(&a, 0, bytes)?,
                (RawCopy::DeviceToHost, _, Some(p)) => p.fill_from_device(&a, 0, bytes)?,
                _ => unreachable!("allocated above for this kind"),
            }
        }
        // The host does not touch the pinned memory until the stream has passed every copy.
        stream.synchronize()?;
        Ok(start.elapsed())
    };
    run(1)?;
    run(iterations)
}

#[cfg(test)]
mod tests {
    //! On a GPU only (the gate skips them elsewhere and fails them under `SLUICE_REQUIRE_GPU=1`).
    use super::*;
    use crate::gate::gpu_or_skip;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)).collect()
    }

    #[test]
    fn device_memory_round_trips_through_the_host() {
        if !gpu_or_skip("memory::device_memory_round_trips_through_the_host") {
            return;
        }
        let s = Stream::new(0).unwrap();
        let n = (1 << 20) + 3;
        let b = CudaBuffer::alloc(n, &s).unwrap();
        assert_eq!((b.len(), b.device()), (n, 0));
        let want = pattern(n, 1);
        b.write_from_host(&want).unwrap();
        assert_eq!(b.read_to_host().unwrap(), want);
        // A slice is its own bytes, and a slice past the end is refused.
        let part = b.slice(4096..8197).unwrap();
        assert_eq!(part.read_to_host().unwrap(), &want[4096..8197]);
        assert!(b.slice(n - 1..n + 1).is_err());
        assert!(b.write_from_host(&vec![0; n + 1]).is_err());
        // Fills and device copies, in stream order, seen after the stream.
        let c = CudaBuffer::alloc(n, &s).unwrap();
        c.fill(0xab).unwrap();
        assert!(c.read_to_host().unwrap().iter().all(|&x| x == 0xab));
        c.copy_from(&b).unwrap();
        assert_eq!(c.read_to_host().unwrap(), want);
        assert!(c.copy_from(&part).is_err(), "lengths differ");
    }

    #[test]
    fn pinned_staging_copies_both_ways_in_stream_order() {
        if !gpu_or_skip("memory::pinned_staging_copies_both_ways_in_stream_order") {
            return;
        }
        let s = Stream::new(0).unwrap();
        let n = 3 << 20;
        let want = pattern(n, 5);
        let src = CudaBuffer::alloc(n, &s).unwrap();
        src.write_from_host(&want).unwrap();
        let mut pinned = PinnedMemory::new(n).unwrap();
        assert_eq!(pinned.len(), n);
        pinned.fill_from_device(&src, 0, n).unwrap();
        s.synchronize().unwrap();
        assert!(pinned.as_slice() == &want[..], "device -> pinned");
        let dst = CudaBuffer::alloc(n + 100, &s).unwrap();
        dst.fill(0).unwrap();
        pinned.drain_to_device(&dst, 100, n).unwrap();
        let got = dst.read_to_host().unwrap();
        assert!(got[..100].iter().all(|&x| x == 0), "bytes before the offset untouched");
        assert!(got[100..] == want[..], "pinned -> device at an offset");
        // Out-of-range copies are refused before reaching the driver.
        assert!(pinned.fill_from_device(&src, 1, n).is_err());
        assert!(pinned.drain_to_device(&dst, 101, n).is_err());
        assert!(pinned.drain_to_device(&dst, 0, n + 1).is_err());
    }

    #[test]
    fn an_exported_buffer_names_its_allocation_and_offset() {
        if !gpu_or_skip("memory::an_exported_buffer_names_its_allocation_and_offset") {
            return;
        }
        let s = Stream::new(0).unwrap();
        let mem = DeviceMemory::new(0, 1 << 20).unwrap();
        assert!(mem.len() >= 1 << 20);
        let b = mem.buffer(4096..8192, &s).unwrap();
        let e = b.ipc_export().unwrap();
        assert_eq!(e.offset, 4096);
        assert_eq!(e.size, mem.len() as u64);
        assert!(e.handle.iter().any(|&x| x != 0), "an IPC handle of zeros");
        assert!(mem.is_exported(), "exported memory is kept for good");
        // The handle is made once per allocation: every buffer in it gives the same one.
        let other = mem.buffer(0..16, &s).unwrap().ipc_export().unwrap();
        assert_eq!((other.handle, other.offset), (e.handle, 0));
        // Ranges outside the allocation, and streams of another device, are refused.
        assert!(mem.buffer(0..mem.len() + 1, &s).is_err());
    }
}
