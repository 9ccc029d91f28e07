//! When device memory may be freed or reused: the bookkeeping behind [`DeviceMemory`]'s drop
//! and [`CudaBuffer::alloc_cached`](super::CudaBuffer::alloc_cached).
//!
//! Rules (each from the driver documentation):
//! - `cuMemFree` only *may* synchronize, so a dropped allocation is freed once an event
//!   recorded after its last use on every stream its buffers were ordered on has completed
//!   (memory holds those streams, so the event can always be recorded; a stream Sluice does
//!   not own leaves its last event behind when its last wrapper goes). The free itself runs on
//!   a thread of its own, since it may still synchronize.
//! - Freeing an allocation another process has opened with CUDA IPC is undefined, and the
//!   exporter cannot know when every importer has closed it: exported memory is never freed.
//!   It is kept, and reused for a later allocation of a fitting size once its events are
//!   done (importers keep their mapping, which stays valid).
//! - Blocks cached per stream are keyed by the stream's identity (driver handles are reused
//!   by new streams), released when the stream is dropped, and every idle block is released
//!   (and memory waiting for its events freed after a host wait) when an allocation runs out
//!   of memory, before it is tried once more (then also on any exported block big enough).
//!
//! [`Ledger`] holds that bookkeeping with the fences and memory handles as type parameters,
//! so every rule is tested without a GPU; the functions below drive it with real events.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex, OnceLock};

use super::driver::{self, IPC_HANDLE_BYTES};
use super::memory::{DeviceMemory, StreamHandle};
use super::{runtime, CudaError, Event, Stream};

/// Most bytes cached per stream; beyond it blocks are plain allocations.
const CACHE_BYTES: usize = 4 << 30;
/// Most blocks cached per stream.
const CACHE_BLOCKS: usize = 4096;

/// An allocation the ledger tracks once its owner is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Block {
    pub device: u32,
    pub ptr: u64,
    pub len: usize,
    /// Its IPC handle when it was exported (never freed then).
    pub exported: Option<[u8; IPC_HANDLE_BYTES]>,
}

/// Something that completes: an event recorded after the work that used a block.
pub(crate) trait Fence {
    fn done(&self) -> bool;
    /// Blocks the calling thread until done.
    fn wait(&self);
}

/// A block cached for one stream.
pub(crate) trait Cached {
    fn len(&self) -> usize;
    /// Nothing but the cache holds it.
    fn idle(&self) -> bool;
}

struct StreamCache<M> {
    device: u32,
    blocks: Vec<M>,
    bytes: usize,
}

/// The bookkeeping: per-stream caches, freed memory waiting for its fences, and exported
/// memory kept for reuse.
pub(crate) struct Ledger<F, M> {
    caches: HashMap<u64, StreamCache<M>>,
    pending: Vec<(Block, Vec<F>)>,
    exported: Vec<(Block, Vec<F>)>,
}

impl<F: Fence + Clone, M: Cached + Clone> Ledger<F, M> {
    pub fn new() -> Self {
        Ledger {
            caches: HashMap::new(),
            pending: Vec::new(),
            exported: Vec::new(),
        }
    }

    /// A block's owner is gone; `fences` follow its last uses. Returns what may be freed now.
    pub fn retire(&mut self, block: Block, fences: Vec<F>) -> Vec<Block> {
        if block.exported.is_some() {
            self.exported.push((block, fences));
        } else {
            self.pending.push((block, fences));
        }
        self.reap()
    }

    /// Memory whose fences have all completed, taken out to be freed.
    pub fn reap(&mut self) -> Vec<Block> {
        let mut free = Vec::new();
        self.pending.retain(|(b, fences)| {
            let done = fences.iter().all(Fence::done);
            if done {
                free.push(*b);
            }
            !done
        });
        free
    }

    /// Exported memory on `device` that fits `len` bytes (without wasting more than half of
    /// it, unless `any_size`), and whose last uses are done.
    pub fn reuse_exported(&mut self, device: u32, len: usize, any_size: bool) -> Option<Block> {
        let fits = |b: &Block| b.device == device && b.len >= len && (any_size || b.len / 2 <= len.max(1));
        let i = self
            .exported
            .iter()
            .position(|(b, fences)| fits(b) && fences.iter().all(Fence::done))?;
        Some(self.exported.swap_remove(i).0)
    }

    /// An idle cached block of `len` bytes for stream `id`, if there is one.
    pub fn cached(&mut self, id: u64, device: u32, len: usize) -> Option<M> {
        let cache = self.caches.entry(id).or_insert_with(|| StreamCache {
            device,
            blocks: Vec::new(),
            bytes: 0,
        });
        cache.blocks.iter().find(|b| b.len() == len && b.idle()).cloned()
    }

    /// Keeps `block` cached for stream `id` when there is room.
    pub fn keep(&mut self, id: u64, block: &M) {
        let Some(cache) = self.caches.get_mut(&id) else {
            return; // the stream is gone (or never asked): not cached
        };
        if cache.bytes + block.len() <= CACHE_BYTES && cache.blocks.len() < CACHE_BLOCKS {
            cache.bytes += block.len();
            cache.blocks.push(block.clone());
        }
    }

    /// Stream `id` is gone: its cached blocks are handed back (to be dropped by the caller,
    /// outside any lock, which retires them).
    pub fn stream_gone(&mut self, id: u64) -> Vec<M> {
        self.caches.remove(&id).map(|c| c.blocks).unwrap_or_default()
    }

    /// Out of memory on `device`: every idle cached block of the device is handed back (to be
    /// dropped, which retires it), and every pending block of the device with its fences (to
    /// be waited for, then freed).
    pub fn trim(&mut self, device: u32) -> (Vec<M>, Vec<(Block, Vec<F>)>) {
        let mut idle = Vec::new();
        for cache in self.caches.values_mut().filter(|c| c.device == device) {
            let (gone, kept): (Vec<M>, Vec<M>) = cache.blocks.drain(..).partition(Cached::idle);
            cache.blocks = kept;
            cache.bytes -= gone.iter().map(Cached::len).sum::<usize>();
            idle.extend(gone);
        }
        let (mine, others): (Vec<_>, Vec<_>) = self.pending.drain(..).partition(|(b, _)| b.device == device);
        self.pending = others;
        (idle, mine)
    }

    /// Bytes kept for reuse: (cached per stream, waiting to be freed, exported).
    pub fn bytes(&self) -> (usize, usize, usize) {
        let cached = self.caches.values().map(|c| c.bytes).sum();
        let pending = self.pending.iter().map(|(b, _)| b.len).sum();
        let exported = self.exported.iter().map(|(b, _)| b.len).sum();
        (cached, pending, exported)
    }
}

impl Fence for Event {
    fn done(&self) -> bool {
        // An error (a broken context) counts as not done: the memory is then never freed,
        // which is safe.
        self.is_done().unwrap_or(false)
    }

    fn wait(&self) {
        let _ = self.synchronize();
    }
}

impl Cached for Arc<DeviceMemory> {
    fn len(&self) -> usize {
        DeviceMemory::len(self)
    }

    fn idle(&self) -> bool {
        Arc::strong_count(self) == 1
    }
}

type Live = Ledger<Event, Arc<DeviceMemory>>;

fn ledger() -> std::sync::MutexGuard<'static, Live> {
    static LEDGER: OnceLock<Mutex<Live>> = OnceLock::new();
    LEDGER
        .get_or_init(|| Mutex::new(Ledger::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Frees one block now, on this thread.
fn free_now(b: Block) {
    debug_assert!(b.exported.is_none(), "exported memory is never freed");
    let Ok(cuda) = runtime() else { return };
    if let Ok(bound) = cuda.bind(b.device) {
        // SAFETY: allocated by `allocate`, owned by no one (its `DeviceMemory` is gone), freed
        // once (taken out of the ledger), and every fence after its uses completed.
        let _ = unsafe { driver::mem_free(&bound, b.ptr) };
    }
}

/// Frees blocks whose fences completed, on the freeing thread (`cuMemFree` may synchronize
/// the device, which no caller's thread should wait for).
fn free(blocks: Vec<Block>) {
    if blocks.is_empty() {
        return;
    }
    static TX: OnceLock<Mutex<Option<mpsc::Sender<Block>>>> = OnceLock::new();
    let tx = TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Block>();
        let started = std::thread::Builder::new()
            .name("sluice-cuda-free".into())
            .spawn(move || rx.into_iter().for_each(free_now));
        Mutex::new(started.ok().map(|_| tx))
    });
    let tx = tx.lock().unwrap_or_else(|e| e.into_inner());
    for b in blocks {
        match tx.as_ref() {
            Some(t) => {
                let _ = t.send(b);
            }
            None => free_now(b),
        }
    }
}

/// A dropped allocation: a fence recorded on each stream that used it, then into the ledger.
pub(crate) fn retire(block: Block, uses: Vec<Arc<StreamHandle>>) {
    let mut fences = Vec::new();
    for stream in &uses {
        match stream.fence() {
            Some(e) => fences.push(e),
            // Without a fence the memory cannot be known unused: keep it for ever.
            None => return,
        }
    }
    let now = ledger().retire(block, fences);
    drop(uses); // outside the lock: the last holder of an owned stream destroys it
    free(now);
}

/// At least `len` bytes on `device`: reused exported memory, or a fresh allocation (after
/// trimming the caches once when the device is out of memory).
pub(crate) fn allocate(device: u32, len: usize) -> Result<Block, CudaError> {
    let (reused, done) = {
        let mut l = ledger();
        let done = l.reap();
        (l.reuse_exported(device, len, false), done)
    };
    free(done);
    if let Some(b) = reused {
        return Ok(b);
    }
    let cuda = runtime()?;
    let fresh = |len| -> Result<u64, driver::DriverError> {
        let bound = cuda.bind(device).map_err(|e| driver::DriverError {
            call: "cuMemAlloc_v2",
            code: -1,
            name: e.to_string(),
        })?;
        driver::mem_alloc(&bound, len)
    };
    let ptr = match fresh(len) {
        Ok(p) => p,
        Err(e) if e.code == driver::ERROR_OUT_OF_MEMORY => {
            let released = trim(device);
            tracing::debug!(
                device,
                released,
                "out of device memory: released cached blocks, retrying"
            );
            match fresh(len) {
                Ok(p) => p,
                Err(e) => {
                    // Last: exported memory of any size that fits (never freed, but reusable).
                    let reused = ledger().reuse_exported(device, len, true);
                    return reused.ok_or_else(|| {
                        CudaError::Invalid(format!(
                            "{e} for {len} bytes on cuda:{device}, after releasing {released} cached bytes"
                        ))
                    });
                }
            }
        }
        Err(e) => return Err(e.into()),
    };
    Ok(Block {
        device,
        ptr,
        len: len.max(1),
        exported: None,
    })
}

/// Releases every idle cached block of `device` and frees what waits for its fences (waiting
/// for them on this thread: only the out-of-memory path does this). Returns the bytes freed.
fn trim(device: u32) -> usize {
    let mut waiting = Vec::new();
    // Twice: the idle blocks handed back the first time are retired when dropped (outside
    // the lock), which puts them among the pending ones the second time takes.
    for _ in 0..2 {
        let (idle, pending) = {
            let mut l = ledger();
            l.trim(device)
        };
        waiting.extend(pending);
        drop(idle);
    }
    let mut bytes = 0;
    for (b, fences) in waiting {
        fences.iter().for_each(Fence::wait);
        bytes += b.len;
        free_now(b);
    }
    bytes
}

/// An idle block of `len` bytes cached for `stream`.
pub(crate) fn cached(stream: &Stream, len: usize) -> Option<Arc<DeviceMemory>> {
    ledger().cached(stream.id(), stream.device(), len)
}

/// Caches `mem` for `stream` when there is room.
pub(crate) fn keep(stream: &Stream, mem: &Arc<DeviceMemory>) {
    ledger().keep(stream.id(), mem);
}

/// A stream is being dropped: its cached blocks are retired.
pub(crate) fn stream_gone(id: u64) {
    let blocks = ledger().stream_gone(id);
    drop(blocks); // outside the lock: dropping retires them
}

/// Bytes of device memory kept by this process for reuse: cached per stream, waiting for
/// their last uses before being freed, and exported (kept for good).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Kept {
    pub cached: usize,
    pub pending: usize,
    pub exported: usize,
}

/// What the allocator keeps now.
pub fn kept() -> Kept {
    let (cached, pending, exported) = ledger().bytes();
    Kept {
        cached,
        pending,
        exported,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[derive(Clone, Default)]
    struct Flag(Arc<AtomicBool>);

    impl Flag {
        fn set(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl Fence for Flag {
        fn done(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
        fn wait(&self) {
            self.set();
        }
    }

    #[derive(Clone)]
    struct Mem(Arc<(u32, usize)>);

    impl Cached for Mem {
        fn len(&self) -> usize {
            self.0 .1
        }
        fn idle(&self) -> bool {
            Arc::strong_count(&self.0) == 1
        }
    }

    fn block(ptr: u64, len: usize, exported: bool) -> Block {
        Block {
            device: 0,
            ptr,
            len,
            exported: exported.then_some([7; IPC_HANDLE_BYTES]),
        }
    }

    #[test]
    fn memory_is_freed_only_after_every_fence_completed() {
        let mut l: Ledger<Flag, Mem> = Ledger::new();
        let (a, b) = (Flag::default(), Flag::default());
        assert!(l.retire(block(1, 64, false), vec![a.clone(), b.clone()]).is_empty());
        a.set();
        assert!(l.reap().is_empty(), "one stream still uses it");
        b.set();
        assert_eq!(l.reap(), vec![block(1, 64, false)]);
        assert!(l.reap().is_empty(), "freed once");
        // No uses at all: free at once.
        assert_eq!(l.retire(block(2, 64, false), vec![]), vec![block(2, 64, false)]);
    }

    #[test]
    fn exported_memory_is_never_freed_but_reused_once_idle() {
        let mut l: Ledger<Flag, Mem> = Ledger::new();
        let f = Flag::default();
        assert!(l.retire(block(1, 1 << 20, true), vec![f.clone()]).is_empty());
        assert_eq!(
            l.reuse_exported(0, 1 << 20, false),
            None,
            "its last use is still running"
        );
        f.set();
        assert!(l.reap().is_empty(), "exported memory is not freed, even when idle");
        assert_eq!(l.reuse_exported(0, 4 << 20, true), None, "too small");
        assert_eq!(l.reuse_exported(0, 1000, false), None, "would waste more than half");
        assert_eq!(l.reuse_exported(1, 1 << 20, false), None, "another device");
        assert_eq!(l.reuse_exported(0, (1 << 20) - 5, false), Some(block(1, 1 << 20, true)));
        // Out of memory, any exported block big enough will do.
        assert!(l.retire(block(2, 1 << 20, true), vec![]).is_empty());
        assert_eq!(l.reuse_exported(0, 1000, true), Some(block(2, 1 << 20, true)));
        assert_eq!(l.bytes().2, 0, "handed out");
        // Out of memory never frees exported memory either.
        assert!(l.retire(block(3, 64, true), vec![]).is_empty());
        let (_, pending) = l.trim(0);
        assert!(pending.is_empty());
        assert_eq!(l.bytes().2, 64);
    }

    #[test]
    fn caches_key_by_stream_identity_and_leave_with_the_stream() {
        let mut l: Ledger<Flag, Mem> = Ledger::new();
        assert!(l.cached(1, 0, 256).is_none());
        let m = Mem(Arc::new((0, 256)));
        l.keep(1, &m);
        assert!(l.cached(1, 0, 256).is_none(), "in use");
        drop(m);
        assert!(l.cached(1, 0, 256).is_some(), "idle: reused");
        // A new stream (whatever its driver handle) never sees stream 1's blocks.
        assert!(l.cached(2, 0, 256).is_none());
        l.keep(3, &Mem(Arc::new((0, 256))));
        assert_eq!(l.bytes().0, 256, "stream 3 never asked, so nothing is cached for it");
        assert_eq!(l.stream_gone(1).len(), 1);
        assert!(l.cached(1, 0, 256).is_none());
        assert_eq!(l.bytes().0, 0);
    }

    #[test]
    fn out_of_memory_releases_idle_blocks_and_waits_for_pending_ones() {
        let mut l: Ledger<Flag, Mem> = Ledger::new();
        l.cached(1, 0, 0);
        l.cached(2, 1, 0);
        let busy = Mem(Arc::new((0, 512)));
        l.keep(1, &busy);
        l.keep(1, &Mem(Arc::new((0, 256))));
        l.keep(2, &Mem(Arc::new((1, 256))));
        let f = Flag::default();
        l.retire(block(5, 128, false), vec![f.clone()]);
        l.retire(
            Block {
                device: 1,
                ..block(6, 128, false)
            },
            vec![Flag::default()],
        );
        let (idle, pending) = l.trim(0);
        assert_eq!(idle.len(), 1, "only device 0's idle block");
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].0.ptr, 5);
        assert_eq!(l.bytes(), (512 + 256, 128, 0), "the busy block and device 1 stay");
        drop(busy);
    }
}
