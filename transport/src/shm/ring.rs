//! A single-producer, single-consumer byte ring in a shared memory segment.
//!
//! Layout: one page of header (atomics on their own cache lines), then `capacity` bytes of
//! data, `capacity` a power of two. `head` and `tail` are monotonically increasing byte counts;
//! the index into the data is the count modulo the capacity. The producer writes `tail`, the
//! consumer writes `head`; each keeps a cached copy of the other's counter and re-reads it only
//! when the cache says there is no room (or nothing to read), so a streaming side does not pull
//! the other side's cache line on every frame.
//!
//! The peer process can scribble on the header at any time. Nothing read back from shared memory
//! is trusted for memory safety: the capacity is validated once against the file size and kept
//! locally, indices are masked, copy lengths are clamped, and a head/tail pair that claims more
//! than `capacity` bytes in flight is reported as corruption.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use super::sys::{file_len, memfd, Mapping};

/// Bytes reserved for the header; the data starts page-aligned after it.
pub(crate) const HEADER_BYTES: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"SLCRING1");
pub(crate) const MIN_CAPACITY: usize = 4096;
pub(crate) const MAX_CAPACITY: usize = 1 << 30;

#[repr(C)]
struct RingHeader {
    magic: AtomicU64,
    capacity: AtomicU64,
    tail: CachePadded<AtomicU64>,
    head: CachePadded<AtomicU64>,
    consumer_parked: CachePadded<AtomicU32>,
    producer_parked: CachePadded<AtomicU32>,
    producer_closed: AtomicU32,
    consumer_closed: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<RingHeader>() <= HEADER_BYTES);

/// The ring's memory was found inconsistent (a misbehaving peer).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Corrupt;

/// A mapped ring segment, shared by one producer and one consumer (in two processes).
#[derive(Clone)]
pub(crate) struct Ring {
    map: Arc<Mapping>,
    capacity: usize,
}

impl Ring {
    /// Creates a ring of `capacity` bytes (a power of two) in a new memory file.
    pub(crate) fn create(capacity: usize) -> io::Result<(Ring, OwnedFd)> {
        if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("ring capacity {capacity} is not a power of two in [{MIN_CAPACITY}, {MAX_CAPACITY}]"),
            ));
        }
        let fd = memfd("sluice-shm-ring", HEADER_BYTES + capacity)?;
        let map = Mapping::new(&fd, HEADER_BYTES + capacity)?;
        let ring = Ring {
            map: Arc::new(map),
            capacity,
        };
        let h = ring.header();
        h.capacity.store(capacity as u64, Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        Ok((ring, fd))
    }

    /// Maps a ring created by the peer, validating it against the size of its file.
    pub(crate) fn open(fd: &OwnedFd) -> io::Result<Ring> {
        let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let len = file_len(fd)?;
        if len <= HEADER_BYTES as u64 || len > (HEADER_BYTES + MAX_CAPACITY) as u64 {
            return Err(bad(format!("ring segment of {len} bytes")));
        }
        let capacity = len as usize - HEADER_BYTES;
        if !capacity.is_power_of_two() || capacity < MIN_CAPACITY {
            return Err(bad(format!("ring capacity {capacity} is not a power of two")));
        }
        let map = Mapping::new(fd, len as usize)?;
        let ring = Ring {
            map: Arc::new(map),
            capacity,
        };
        let h = ring.header();
        if h.magic.load(Ordering::Acquire) != MAGIC || h.capacity.load(Ordering::Relaxed) != capacity as u64 {
            return Err(bad("ring header has the wrong magic or capacity".into()));
        }
        Ok(ring)
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: the mapping is page-aligned and at least HEADER_BYTES long (checked in
        // `create`/`open`), RingHeader fits in HEADER_BYTES (const assertion above) and consists
        // only of atomics, for which any bit pattern is valid and concurrent access from the
        // peer process is defined.
        unsafe { &*(self.map.as_ptr() as *const RingHeader) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: HEADER_BYTES < mapping length, so the result stays inside the mapping.
        unsafe { self.map.as_ptr().add(HEADER_BYTES) }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    pub(crate) fn consumer_parked(&self) -> &AtomicU32 {
        &self.header().consumer_parked
    }

    pub(crate) fn producer_parked(&self) -> &AtomicU32 {
        &self.header().producer_parked
    }

    pub(crate) fn producer_closed(&self) -> &AtomicU32 {
        &self.header().producer_closed
    }

    pub(crate) fn consumer_closed(&self) -> &AtomicU32 {
        &self.header().consumer_closed
    }

    /// Copies `src` into the data area at byte count `pos`, wrapping at the end.
    /// `src.len()` must not exceed the capacity (enforced).
    fn copy_in(&self, pos: u64, src: &[u8]) {
        let len = src.len().min(self.capacity);
        let idx = (pos as usize) & (self.capacity - 1);
        let first = len.min(self.capacity - idx);
        // SAFETY: idx < capacity and first <= capacity - idx, so [idx, idx+first) is in the data
        // area; the second copy covers [0, len-first) with len <= capacity. The source is a
        // distinct Rust slice, so the ranges do not overlap. The protocol gives the producer
        // exclusive use of these bytes until it publishes them.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data().add(idx), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data(), len - first);
        }
    }

    /// Copies from the data area at byte count `pos` into `dst`, wrapping at the end.
    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let len = dst.len().min(self.capacity);
        let idx = (pos as usize) & (self.capacity - 1);
        let first = len.min(self.capacity - idx);
        // SAFETY: bounds as in `copy_in`. The bytes were published by the producer (a release
        // store of `tail` we acquired), and it will not touch them until we advance `head`. A
        // misbehaving peer could write them concurrently; that can only garble its own data,
        // as both sides treat the area as plain bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(idx), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data(), dst.as_mut_ptr().add(first), len - first);
        }
    }
}

/// The writing end of a ring.
pub(crate) struct Producer {
    ring: Ring,
    tail: u64,
    head_cache: u64,
    /// `tail` as last made visible to the consumer.
    published: u64,
}

impl Producer {
    pub(crate) fn new(ring: Ring) -> Self {
        Producer {
            ring,
            tail: 0,
            head_cache: 0,
            published: 0,
        }
    }

    pub(crate) fn ring(&self) -> &Ring {
        &self.ring
    }

    fn free_cached(&self) -> usize {
        self.ring.capacity - (self.tail.wrapping_sub(self.head_cache) as usize)
    }

    /// Bytes free, re-reading the consumer's head when the cached view shows fewer than `want`.
    pub(crate) fn free(&mut self, want: usize) -> Result<usize, Corrupt> {
        if self.free_cached() < want {
            let head = self.ring.header().head.load(Ordering::Acquire);
            let used = self.tail.wrapping_sub(head);
            if used > self.ring.capacity as u64 {
                return Err(Corrupt);
            }
            self.head_cache = head;
        }
        Ok(self.free_cached())
    }

    /// Copies as much of `src` as fits (by the cached view) and returns how much; the bytes
    /// become visible to the consumer at the next [`publish`](Self::publish).
    pub(crate) fn push(&mut self, src: &[u8]) -> usize {
        let n = src.len().min(self.free_cached());
        self.ring.copy_in(self.tail, &src[..n]);
        self.tail = self.tail.wrapping_add(n as u64);
        n
    }

    /// Bytes pushed since the last publication.
    pub(crate) fn unpublished(&self) -> u64 {
        self.tail.wrapping_sub(self.published)
    }

    /// Makes every pushed byte visible to the consumer.
    pub(crate) fn publish(&mut self) {
        self.ring.header().tail.store(self.tail, Ordering::Release);
        self.published = self.tail;
    }
}

/// The reading end of a ring.
pub(crate) struct Consumer {
    ring: Ring,
    head: u64,
    tail_cache: u64,
    /// `head` as last handed back to the producer.
    released: u64,
}

impl Consumer {
    pub(crate) fn new(ring: Ring) -> Self {
        Consumer {
            ring,
            head: 0,
            tail_cache: 0,
            released: 0,
        }
    }

    pub(crate) fn ring(&self) -> &Ring {
        &self.ring
    }

    fn available_cached(&self) -> usize {
        self.tail_cache.wrapping_sub(self.head) as usize
    }

    /// Bytes readable, re-reading the producer's tail when the cached view shows fewer than
    /// `want`.
    pub(crate) fn available(&mut self, want: usize) -> Result<usize, Corrupt> {
        if self.available_cached() < want {
            let tail = self.ring.header().tail.load(Ordering::Acquire);
            if tail.wrapping_sub(self.head) > self.ring.capacity as u64 {
                return Err(Corrupt);
            }
            self.tail_cache = tail;
        }
        Ok(self.available_cached())
    }

    /// Copies as many readable bytes (by the cached view) as fit in `dst` and returns how many;
    /// the space is handed back to the producer at the next [`release`](Self::release).
    pub(crate) fn pop(&mut self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.available_cached());
        self.ring.copy_out(self.head, &mut dst[..n]);
        self.head = self.head.wrapping_add(n as u64);
        n
    }

    /// Copies readable bytes (by the cached view) into `dst` without consuming them; returns
    /// how many.
    pub(crate) fn peek(&self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.available_cached());
        self.ring.copy_out(self.head, &mut dst[..n]);
        n
    }

    /// Bytes popped since the last release.
    pub(crate) fn unreleased(&self) -> u64 {
        self.head.wrapping_sub(self.released)
    }

    /// Whether bytes were popped since the last release.
    pub(crate) fn has_unreleased(&self) -> bool {
        self.unreleased() != 0
    }

    /// Hands every popped byte's space back to the producer.
    pub(crate) fn release(&mut self) {
        self.ring.header().head.store(self.head, Ordering::Release);
        self.released = self.head;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_and_preserves_bytes() {
        let (ring, fd) = Ring::create(MIN_CAPACITY).unwrap();
        let peer = Ring::open(&fd).unwrap();
        let mut p = Producer::new(ring);
        let mut c = Consumer::new(peer);
        let mut expected = Vec::new();
        let mut got = Vec::new();
        for round in 0..100u32 {
            let chunk: Vec<u8> = (0..1000 + round).map(|i| (i * 7 + round) as u8).collect();
            let mut off = 0;
            while off < chunk.len() {
                p.free(1).unwrap();
                off += p.push(&chunk[off..]);
                p.publish();
                let n = c.available(1).unwrap();
                let mut buf = vec![0; n];
                assert_eq!(c.pop(&mut buf), n);
                c.release();
                got.extend_from_slice(&buf);
            }
            expected.extend_from_slice(&chunk);
        }
        assert_eq!(got, expected);
    }

    #[test]
    fn rejects_corrupt_counters() {
        let (ring, fd) = Ring::create(MIN_CAPACITY).unwrap();
        let peer = Ring::open(&fd).unwrap();
        let mut c = Consumer::new(peer);
        // The "peer" claims far more bytes than the ring holds.
        ring.header().tail.store(u64::MAX / 2, Ordering::Release);
        assert!(c.available(1).is_err());
    }

    #[test]
    fn open_rejects_wrong_sizes() {
        let fd = memfd("bad", HEADER_BYTES + 5000).unwrap();
        assert!(Ring::open(&fd).is_err());
        let fd = memfd("tiny", 10).unwrap();
        assert!(Ring::open(&fd).is_err());
    }
}
