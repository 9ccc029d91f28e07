//! Zero-copy RDMA for CPU tensors: the receiver RDMA-reads the tensor straight from the
//! sender's memory into the memory it chose, on the queue pair of the pipe's ibverbs control
//! connection. No ring, no copy on either side (TensorPipe copied CPU tensors twice through a
//! 2 MiB ring and reached 1.9–2.3 GB/s on links several times faster).
//!
//! - Only offered when the pipe's transport is ibverbs (the server drops it otherwise), since it
//!   borrows that connection's queue pair.
//! - Tensors below [`INLINE_MAX`] bytes travel through the ring instead: a read costs a round
//!   trip and a registration, a ring write neither.
//! - The sender's registrations are cached per pipe ([`RegCache`], bounded by count and bytes);
//!   an entry keeps its buffer alive, so a cached address can never be freed and reused under
//!   a stale registration. The receiver reads into its pipe's [`RecvPool`]: registered chunks
//!   recycled by size class, lent to the reader as `RecvBuffer::Shared` and back in the pool
//!   (still registered) when the last handle drops, so a steady stream of tensors registers
//!   nothing after the first few. Caller-owned memory could not be cached (nothing keeps it
//!   alive, and UCX's registration cache needs memory hooks to notice it being freed); a pool
//!   whose memory the pipe owns needs none. When the pool is over its budget the read falls back
//!   to registering a fresh buffer for that read only.
//! - The sender's write completes when the receiver acknowledges its reads (as with CMA).
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use sluice_transport::ibv::{Access, IbvTransport, MrInfo, Sge, VerbsDevice, VerbsError, VerbsMr};
use sluice_transport::Transport;

use super::path::{Link, Tx};
use super::{ChannelContext, ChannelKind};
use crate::device::Device;
use crate::wire::Source;

type PipeResult<T> = crate::error::Result<T>;

/// Smaller CPU tensors go through the transport's ring even when rdma was negotiated.
pub const INLINE_MAX: usize = 64 << 10;
/// Largest single RDMA read (devices take up to 1–2 GiB per request).
pub const MAX_READ: usize = 64 << 20;

/// The rdma channel's context: viable where the ibverbs transport is.
pub struct RdmaContext {
    descriptor: Result<String, String>,
}

impl RdmaContext {
    pub fn new(ibv: Option<&IbvTransport>) -> RdmaContext {
        let descriptor = match ibv {
            Some(t) => t.viability().map(|_| t.domain_descriptor()).map_err(|e| e.to_string()),
            None => Err("the ibv transport is not enabled".into()),
        };
        RdmaContext { descriptor }
    }
}

impl ChannelContext for RdmaContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Rdma
    }

    fn viability(&self) -> Result<(), String> {
        self.descriptor.as_ref().map(|_| ()).map_err(|e| e.clone())
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        match &self.descriptor {
            Ok(d) => vec![(Device::Cpu, d.clone())],
            Err(_) => Vec::new(),
        }
    }
}

struct Entry {
    addr: u64,
    len: usize,
    mr: Box<dyn VerbsMr>,
    /// Keeps the memory alive (and so unreusable) while registered: a `Bytes` or `CudaBuffer`
    /// clone.
    _keep: Box<dyn std::any::Any + Send + Sync>,
    pinned: bool,
}

/// A bounded cache of the sender's registrations, most recently used last.
pub struct RegCache {
    device: Arc<dyn VerbsDevice>,
    entries: VecDeque<Entry>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    pub hits: u64,
    pub misses: u64,
}

impl RegCache {
    pub fn new(device: Arc<dyn VerbsDevice>, max_entries: usize, max_bytes: usize) -> RegCache {
        RegCache {
            device,
            entries: VecDeque::new(),
            bytes: 0,
            max_entries,
            max_bytes,
            hits: 0,
            misses: 0,
        }
    }

    /// The registration of `b` (readable remotely), pinned until [`unpin_all`](Self::unpin_all).
    pub fn get(&mut self, b: &Bytes) -> Result<MrInfo, VerbsError> {
        let device = self.device.clone();
        let keep = b.clone();
        self.get_or_register(b.as_ptr() as u64, b.len(), Box::new(b.clone()), move || {
            // SAFETY: the entry keeps a clone of `b`, so the memory stays valid (and is never
            // reused) until the registration is dropped; the NIC only reads it (remote read).
            unsafe { device.register(keep.as_ptr() as *mut u8, keep.len(), Access::REMOTE_READ) }
        })
    }

    /// The cached registration of `addr..addr+len`, or a new one from `register`; `keep` holds
    /// the memory alive while cached. Pinned until [`unpin_all`](Self::unpin_all).
    pub fn get_or_register(
        &mut self,
        addr: u64,
        len: usize,
        keep: Box<dyn std::any::Any + Send + Sync>,
        register: impl FnOnce() -> Result<Box<dyn VerbsMr>, VerbsError>,
    ) -> Result<MrInfo, VerbsError> {
        if let Some(i) = self.entries.iter().position(|e| e.addr == addr && e.len == len) {
            self.hits += 1;
            let mut e = self.entries.remove(i).expect("found");
            e.pinned = true;
            let info = e.mr.info();
            self.entries.push_back(e);
            return Ok(info);
        }
        self.misses += 1;
        let mr = register()?;
        let info = mr.info();
        self.bytes += len;
        self.entries.push_back(Entry {
            addr,
            len,
            mr,
            _keep: keep,
            pinned: true,
        });
        self.evict();
        Ok(info)
    }

    pub fn device(&self) -> &Arc<dyn VerbsDevice> {
        &self.device
    }

    /// Called once the peer acknowledged: no registration is in use by it any more.
    pub fn unpin_all(&mut self) {
        for e in &mut self.entries {
            e.pinned = false;
        }
        self.evict();
    }

    /// Drops least recently used, unpinned entries while over either bound.
    fn evict(&mut self) {
        while self.entries.len() > self.max_entries || self.bytes > self.max_bytes {
            let Some(i) = self.entries.iter().position(|e| !e.pinned) else {
                return; // everything is in flight: over budget until the acknowledgement
            };
            let e = self.entries.remove(i).expect("found");
            self.bytes -= e.len;
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Sender: a tensor of at least [`INLINE_MAX`] bytes is registered (cached) and read by the
/// receiver where it lies; a smaller one goes inline.
pub(crate) fn prepare(tx: &mut Tx, link: &Link<'_>, b: &Bytes) -> PipeResult<Source> {
    if b.len() < INLINE_MAX {
        return Ok(Source::Inline);
    }
    let cache = tx
        .registrations
        .as_mut()
        .ok_or_else(|| link.protocol("rdma negotiated without an ibverbs connection"))?;
    let mr = cache
        .get(b)
        .map_err(|e| link.channel_error(ChannelKind::Rdma, format!("registering a {} byte tensor: {e}", b.len())))?;
    Ok(Source::Rdma {
        addr: b.as_ptr() as u64,
        rkey: mr.rkey,
    })
}

/// Largest tensor the receive pool lands (larger ones are read into a buffer registered for
/// that read).
pub const POOL_MAX_TENSOR: usize = 256 << 20;

/// A registered chunk of the receive pool (fields drop in order: the registration before the
/// memory).
struct Chunk {
    mr: Box<dyn VerbsMr>,
    mem: Box<[u8]>,
}

/// Registered memory the receiver RDMA-reads tensors into, recycled by power-of-two size class
/// (a chunk keeps its registration while free), within a byte budget.
pub struct RecvPool {
    device: Arc<dyn VerbsDevice>,
    state: Mutex<PoolState>,
    /// Registrations made (what the pool saves: one per chunk, not one per read).
    pub registrations: AtomicU64,
}

struct PoolState {
    free: HashMap<usize, Vec<Chunk>>,
    /// Bytes registered: free chunks and chunks lent out.
    bytes: usize,
    max_bytes: usize,
}

impl RecvPool {
    pub fn new(device: Arc<dyn VerbsDevice>, max_bytes: usize) -> Arc<RecvPool> {
        Arc::new(RecvPool {
            device,
            state: Mutex::new(PoolState {
                free: HashMap::new(),
                bytes: 0,
                max_bytes,
            }),
            registrations: AtomicU64::new(0),
        })
    }

    fn class(len: usize) -> usize {
        len.max(INLINE_MAX).next_power_of_two()
    }

    /// A registered chunk for `len` bytes: a free one of its class, or a new one if the budget
    /// allows (evicting free chunks of other classes first). `None`: over budget.
    pub fn take(self: &Arc<Self>, len: usize) -> Result<Option<Landing>, VerbsError> {
        if len > POOL_MAX_TENSOR {
            return Ok(None);
        }
        let class = Self::class(len);
        let mut st = self.state.lock().expect("receive pool");
        if let Some(chunk) = st.free.get_mut(&class).and_then(Vec::pop) {
            return Ok(Some(Landing::new(chunk, len, self)));
        }
        // What is lent out stays; if even evicting every free chunk could not make room,
        // evict nothing (a pool of mixed sizes must not thrash).
        let free: usize = st.free.iter().map(|(&c, v)| c * v.len()).sum();
        if (st.bytes - free).saturating_add(class) > st.max_bytes {
            return Ok(None);
        }
        while st.bytes + class > st.max_bytes {
            let Some((&other, _)) = st.free.iter().find(|(_, v)| !v.is_empty()) else {
                return Ok(None);
            };
            st.free.get_mut(&other).and_then(Vec::pop);
            st.bytes -= other;
        }
        st.bytes += class;
        drop(st);
        let mut mem = vec![0u8; class].into_boxed_slice();
        // SAFETY: the chunk owns `mem` with its registration, and the registration is dropped
        // (with the chunk) before the memory; a chunk lent to a read that is abandoned is
        // leaked, never freed (see `Lease`).
        let mr = match unsafe { self.device.register(mem.as_mut_ptr(), class, Access::LOCAL) } {
            Ok(mr) => mr,
            Err(e) => {
                // Refused (the locked-memory limit, most likely): this read registers a buffer
                // of its own instead, as without a pool.
                self.state.lock().expect("receive pool").bytes -= class;
                tracing::debug!("receive pool: registering {class} bytes failed ({e}); reading without the pool");
                return Ok(None);
            }
        };
        self.registrations.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Landing::new(Chunk { mr, mem }, len, self)))
    }

    fn give_back(&self, chunk: Chunk) {
        let class = chunk.mem.len();
        self.state
            .lock()
            .expect("receive pool")
            .free
            .entry(class)
            .or_default()
            .push(chunk);
    }
}

/// A chunk of the pool lent for one tensor: the tensor's bytes, back to the pool (still
/// registered) when dropped.
pub struct Landing {
    chunk: Option<Chunk>,
    len: usize,
    pool: std::sync::Weak<RecvPool>,
}

impl Landing {
    fn new(chunk: Chunk, len: usize, pool: &Arc<RecvPool>) -> Landing {
        Landing {
            chunk: Some(chunk),
            len,
            pool: Arc::downgrade(pool),
        }
    }

    fn info(&self) -> MrInfo {
        self.chunk.as_ref().expect("lent").mr.info()
    }
}

impl AsRef<[u8]> for Landing {
    fn as_ref(&self) -> &[u8] {
        &self.chunk.as_ref().expect("lent").mem[..self.len]
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if let (Some(chunk), Some(pool)) = (self.chunk.take(), self.pool.upgrade()) {
            pool.give_back(chunk);
        }
    }
}

/// Receiver: RDMA-reads a tensor of `len` bytes into a chunk of `pool`, lent to the caller as
/// the returned bytes. `None` when the pool is over its budget (the caller falls back to
/// [`recv`]). Abandoned mid-read, the chunk is leaked (the NIC may still write there).
pub(crate) async fn recv_pooled(
    link: &Link<'_>,
    pool: &Arc<RecvPool>,
    len: usize,
    addr: u64,
    rkey: u32,
) -> PipeResult<Option<Bytes>> {
    let landing = match pool.take(len) {
        Ok(Some(l)) => l,
        Ok(None) => return Ok(None),
        Err(e) => return Err(link.channel_error(ChannelKind::Rdma, format!("registering receive memory: {e}"))),
    };
    let info = landing.info();
    let mut lease = Lease::new(landing, link, ChannelKind::Rdma);
    // SAFETY: the lease holds the registered chunk until the read completes, or leaks it.
    let result = unsafe { pull(link, info.addr, info.lkey, len, addr, rkey) }.await;
    let landing = lease.release();
    result.map(|()| Some(Bytes::from_owner(landing)))
}

/// Receiver: RDMA-reads a tensor into `dst` (registered for the read only). If this future is
/// dropped mid-read, the destination and its registration are leaked (the NIC may still write
/// there) and the pipe fails.
pub(crate) async fn recv(link: &Link<'_>, dst: &mut BytesMut, addr: u64, rkey: u32) -> PipeResult<()> {
    let device = link.rdma()?.device();
    let mut buf = std::mem::take(dst);
    // SAFETY: `buf` is owned by the lease below until the registration is dropped; if the
    // lease is abandoned mid-read, both are leaked rather than freed.
    let mr = match unsafe { device.register(buf.as_mut_ptr(), buf.len(), Access::LOCAL) } {
        Ok(mr) => mr,
        Err(e) => {
            *dst = buf;
            return Err(link.channel_error(ChannelKind::Rdma, format!("registering the destination: {e}")));
        }
    };
    let info = mr.info();
    let mut lease = Lease::new((buf, mr), link, ChannelKind::Rdma);
    // SAFETY: the lease holds the registered memory until the read completes, or leaks it.
    let result = unsafe { pull(link, info.addr, info.lkey, info.len, addr, rkey) }.await;
    let (buf, mr) = lease.release();
    drop(mr);
    *dst = buf;
    result
}

/// RDMA-reads `len` bytes at the sender's `source` (with `rkey`) into registered local memory
/// at `addr`, in pieces of at most [`MAX_READ`].
///
/// # Safety
/// `addr..addr+len` lies in a registration with `lkey` allowing local writes, and stays
/// valid until this future completes (callers leak it if the future is dropped).
pub(crate) async unsafe fn pull(
    link: &Link<'_>,
    addr: u64,
    lkey: u32,
    len: usize,
    source: u64,
    rkey: u32,
) -> PipeResult<()> {
    let handle = link.rdma()?;
    let mut done = 0usize;
    while done < len {
        let piece = (len - done).min(MAX_READ);
        let sge = Sge {
            addr: addr + done as u64,
            len: piece as u32,
            lkey,
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { handle.read(sge, source + done as u64, rkey) }.await?;
        done += piece;
    }
    Ok(())
}

/// What an RDMA read writes into. Dropped before the read finished (the future was
/// cancelled), it leaks what it holds, since the NIC may still write there, and fails the pipe.
pub(crate) struct Lease<'a, T> {
    held: Option<T>,
    link: &'a Link<'a>,
    channel: ChannelKind,
}

impl<'a, T> Lease<'a, T> {
    pub(crate) fn new(held: T, link: &'a Link<'a>, channel: ChannelKind) -> Self {
        Lease {
            held: Some(held),
            link,
            channel,
        }
    }

    /// The read finished: what was lent comes back.
    pub(crate) fn release(&mut self) -> T {
        self.held.take().expect("released once")
    }
}

impl<T> Drop for Lease<'_, T> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            std::mem::forget(held);
            (self.link.poison)(self.link.channel_error(
                self.channel,
                "a read was cancelled while the NIC could still write its memory",
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_transport::ibv::model::{ModelFabric, DEFAULT_LIMITS};

    #[test]
    fn the_receive_pool_registers_once_per_chunk_and_keeps_to_its_budget() {
        let pool = RecvPool::new(ModelFabric::new().device("pool", DEFAULT_LIMITS), 4 << 20);
        // A steady stream of 1 MiB tensors: one registration, the chunk lent and given back.
        for _ in 0..50 {
            let l = pool.take(1 << 20).unwrap().expect("within budget");
            assert_eq!(l.as_ref().len(), 1 << 20);
            drop(l);
        }
        assert_eq!(pool.registrations.load(Ordering::Relaxed), 1);
        // Lent chunks count against the budget: a fifth 1 MiB chunk does not fit.
        let held: Vec<Landing> = (0..4).map(|_| pool.take(1 << 20).unwrap().unwrap()).collect();
        assert!(pool.take(1 << 20).unwrap().is_none(), "over budget");
        drop(held);
        // Free chunks of another class are evicted to make room.
        let big = pool.take(3 << 20).unwrap().expect("evicts free 1 MiB chunks");
        assert_eq!(big.as_ref().len(), 3 << 20);
        // Tensors above the pool's limit are not pooled.
        assert!(pool.take(POOL_MAX_TENSOR + 1).unwrap().is_none());
    }

    #[test]
    fn the_cache_is_bounded_keeps_pinned_entries_and_holds_its_buffers() {
        let dev = ModelFabric::new().device("cache", DEFAULT_LIMITS);
        let mut c = RegCache::new(dev, 2, 1 << 20);
        let a = Bytes::from(vec![1u8; 1000]);
        let b = Bytes::from(vec![2u8; 1000]);
        let d = Bytes::from(vec![3u8; 1000]);
        let ka = c.get(&a).unwrap();
        assert_eq!(c.get(&a).unwrap(), ka);
        assert_eq!((c.hits, c.misses), (1, 1));
        c.get(&b).unwrap();
        // Three pinned entries: over the bound until the acknowledgement.
        c.get(&d).unwrap();
        assert_eq!(c.len(), 3);
        c.unpin_all();
        assert_eq!(c.len(), 2);
        // `a` was least recently used: evicted; `d` is still cached.
        assert_eq!(c.get(&d).unwrap().addr, d.as_ptr() as u64);
        assert_eq!(c.hits, 2);
        // The byte bound applies too.
        let mut small = RegCache::new(ModelFabric::new().device("s", DEFAULT_LIMITS), 10, 1500);
        small.get(&a).unwrap();
        small.get(&b).unwrap();
        small.unpin_all();
        assert_eq!(small.len(), 1);
        // A cached entry holds its memory: dropping ours does not free it.
        let weak_probe = Bytes::from(vec![9u8; 10]);
        let addr = weak_probe.as_ptr() as u64;
        small.get(&weak_probe).unwrap();
        drop(weak_probe);
        assert!(small.entries.iter().any(|e| e.addr == addr));
    }
}
