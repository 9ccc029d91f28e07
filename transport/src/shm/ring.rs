//! A single-producer, single-consumer byte ring in a shared memory segment.
//!
//! Layout: one page of header (atomics on their own cache lines), then `capacity` bytes of
//! data, `capacity` a power of two. `head` and `tail` are monotonically increasing byte counts;
//! the index into the data is the count modulo the capacity. The producer writes `tail`, the
//! consumer writes `head`; each keeps a cached copy of the other's counter and re-reads it only
//! when the cache says there is no room (or nothing to read), so a streaming side does not pull
//! the other side's cache line on every frame.
//!
//! A ring found empty by its producer once the write position is past [`REWIND_AT`] bytes into
//! the data area is *rewound* (on an 8-byte boundary): the producer records where it stopped
//! (`skip_from`, on a header line of its own, written only by rewinds) and carries on from the
//! start of the data area, and the consumer, on reaching that position, jumps there too. The bytes skipped carry nothing. So a ring whose
//! traffic is small messages (most pipes, most of the time) keeps reusing its first pages: they
//! stay in cache, and the rest of the segment is never touched, so resident shared memory stays
//! flat instead of growing to the whole ring over time.
//!
//! **Frame words.** The transport above frames its messages; every frame starts on an 8-byte
//! boundary with an 8-byte *frame word* (length and flags, see [`word`]), and the producer keeps
//! the word at the *next* frame boundary zero until it writes that frame. A frame written whole
//! in one go ([`Producer::push_frame`]) has its word stored last, with release ordering and the
//! `COMPLETE` flag: a consumer waiting at a frame boundary ([`Consumer::frame_available`]) reads
//! only that word, so the line that tells it a frame has come is the line that holds the frame,
//! and it never pulls the producer's `tail` line (one cache-line transfer a message instead of
//! two). Frames that stream, and whole frames held back for a batch, have no `COMPLETE` and are
//! read as the published `tail` covers them; `tail` also still wakes a parked consumer. A zero
//! word means nothing yet. Because every boundary's word was zeroed before the frame ending there
//! was announced (or before a rewind to it), an old lap's bytes are never read as a frame word.
//! A consumer at a boundary also reads `skip_from`, after the word: once the producer rewinds it
//! may fill the next lap over the position the consumer waits at, and the rewind, seen, says to
//! move on instead. The producer never fills the last [`RESERVE`] bytes of the ring, so there is
//! always room for the padding and the zeroed word after a frame.
//!
//! The peer process can scribble on the header at any time. Nothing read back from shared memory
//! is trusted for memory safety: the capacity is validated once against the file size and kept
//! locally, indices are masked, copy lengths are clamped, and a head/tail pair that claims more
//! than `capacity` bytes in flight is reported as corruption.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use super::sys::{file_len, memfd, Mapping};

/// Bytes reserved for the header; the data starts page-aligned after it.
pub(crate) const HEADER_BYTES: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"SLCRING3");
pub(crate) const MIN_CAPACITY: usize = 4096;
pub(crate) const MAX_CAPACITY: usize = 1 << 30;
/// Write position (bytes into the data area) past which an empty ring is rewound to its start.
pub(crate) const REWIND_AT: usize = 16 << 10;
/// Bytes written between two looks at whether a busy ring has emptied, once past `REWIND_AT`:
/// each look reads the consumer's cache line.
const REWIND_RECHECK: u64 = 1 << 10;

/// Bytes of the ring the producer never fills: room for a frame's padding (to 8 bytes) and the
/// zeroed frame word after it.
pub(crate) const RESERVE: usize = 16;

/// The frame word: the first 8 bytes of every frame (little-endian in the ring).
pub(crate) mod word {
    /// Set in every frame word, so that one is never zero.
    pub(crate) const FRAME: u64 = 1 << 62;
    /// The frame's bytes were all written before its word (the word was stored last).
    pub(crate) const COMPLETE: u64 = 1 << 63;
    /// The frame's length (bytes after the word, before padding).
    pub(crate) const LEN_MASK: u64 = (1 << 48) - 1;

    /// The length in a frame word, or `None` for a word no producer writes at a frame's start.
    #[inline]
    pub(crate) fn frame_len(word: u64) -> Option<u64> {
        (word & !(FRAME | COMPLETE | LEN_MASK) == 0 && word & FRAME != 0).then_some(word & LEN_MASK)
    }
}

/// `len` rounded up to the 8-byte boundary at which the next frame starts.
#[inline]
pub(crate) const fn padded(len: u64) -> u64 {
    len.wrapping_add(7) & !7
}

/// Whether a ring of `capacity` bytes is ever rewound: one too small to have pages worth
/// sparing is not.
const fn rewinds(capacity: usize) -> bool {
    capacity >= 4 * REWIND_AT
}

#[repr(C)]
struct RingHeader {
    magic: AtomicU64,
    capacity: AtomicU64,
    /// The producer's counter.
    tail: CachePadded<AtomicU64>,
    /// The position at which the producer last rewound (`u64::MAX`: never). A line of its own:
    /// a consumer waiting at a frame boundary reads it at every look, and it changes only at a
    /// rewind.
    skip_from: CachePadded<AtomicU64>,
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
        // No rewind yet: a position the consumer never holds (it holds 0 at the start).
        h.skip_from.store(u64::MAX, Ordering::Relaxed);
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

    #[inline]
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

    /// The 8-byte word of the data area at byte count `pos` (rounded down to 8 bytes).
    #[inline]
    fn word(&self, pos: u64) -> &AtomicU64 {
        let idx = (pos as usize) & (self.capacity - 1) & !7;
        // SAFETY: the data area starts page-aligned and holds `capacity` bytes, a power of two
        // of at least MIN_CAPACITY, so an 8-aligned index below it leaves the 8 bytes of the word
        // inside the mapping and aligned for an AtomicU64. Any bit pattern is a valid u64. The
        // area is shared with another process, which writes it with atomics (frame words) and
        // plain byte copies: one case overlaps a read of a word, a consumer waiting where the
        // producer rewound while the producer copies the next lap over that position. The value
        // read is then discarded (the consumer follows `skip_from`, read after it), and the
        // hardware this runs on (x86-64's ordered stores; AArch64's barriers and acquire loads)
        // makes `skip_from` visible before those bytes. Nothing in Rust's model covers memory
        // another process writes; with both ends in one process (the tests, a connection to
        // oneself) the overlap is a formal data race, benign on that hardware, which a race
        // detector would report.
        unsafe { &*(self.data().add(idx) as *const AtomicU64) }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    #[inline]
    pub(crate) fn consumer_parked(&self) -> &AtomicU32 {
        &self.header().consumer_parked
    }

    #[inline]
    pub(crate) fn producer_parked(&self) -> &AtomicU32 {
        &self.header().producer_parked
    }

    #[inline]
    pub(crate) fn producer_closed(&self) -> &AtomicU32 {
        &self.header().producer_closed
    }

    #[inline]
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
            // Most copies do not wrap: no second call for nothing.
            if first < len {
                std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data(), len - first);
            }
        }
    }

    /// Copies from the data area at byte count `pos` into `dst`, wrapping at the end.
    fn copy_out(&self, pos: u64, dst: &mut [u8]) {
        let len = dst.len().min(self.capacity);
        // SAFETY: a `&mut [u8]` is valid for writes of its length, and cannot point into the
        // ring, which is only ever reached through raw pointers.
        unsafe { self.copy_out_raw(pos, dst.as_mut_ptr(), len) }
    }

    /// [`copy_out`](Self::copy_out) into raw memory: exactly `len` bytes at `dst` (at most the
    /// capacity: checked, so a caller that exposes `len` bytes afterwards never exposes
    /// unwritten ones).
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes and not overlap the ring.
    unsafe fn copy_out_raw(&self, pos: u64, dst: *mut u8, len: usize) {
        assert!(len <= self.capacity, "a copy out of the ring larger than the ring");
        let idx = (pos as usize) & (self.capacity - 1);
        let first = len.min(self.capacity - idx);
        // SAFETY: bounds as in `copy_in`. The bytes were published by the producer (a release
        // store of `tail` we acquired), and it will not touch them until we advance `head`. A
        // misbehaving peer could write them concurrently; that can only garble its own data,
        // as both sides treat the area as plain bytes. The caller guarantees `dst` is writable
        // for `len` bytes outside the ring.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data().add(idx), dst, first);
            if first < len {
                std::ptr::copy_nonoverlapping(self.data(), dst.add(first), len - first);
            }
        }
    }
}

/// The writing end of a ring.
pub(crate) struct Producer {
    ring: Ring,
    tail: u64,
    head_cache: u64,
    /// `tail` as last made visible to the consumer, plus any bytes skipped by a rewind since
    /// (so `unpublished` counts only bytes written).
    published: u64,
    /// The last rewind, from and to: a consumer that has not read past it yet still shows
    /// `skipped_from` as its head, which then means `skipped_to`.
    skipped_from: u64,
    skipped_to: u64,
    /// The write position at which to look next whether the ring can be rewound.
    rewind_check: u64,
}

impl Producer {
    pub(crate) fn new(ring: Ring) -> Self {
        let rewind_check = if rewinds(ring.capacity) {
            REWIND_AT as u64
        } else {
            u64::MAX
        };
        Producer {
            ring,
            tail: 0,
            head_cache: 0,
            published: 0,
            skipped_from: u64::MAX,
            skipped_to: 0,
            rewind_check,
        }
    }

    pub(crate) fn ring(&self) -> &Ring {
        &self.ring
    }

    fn free_cached(&self) -> usize {
        (self.ring.capacity - RESERVE).saturating_sub(self.tail.wrapping_sub(self.head_cache) as usize)
    }

    /// Re-reads the consumer's head into the cache.
    fn read_head(&mut self) -> Result<(), Corrupt> {
        let mut head = self.ring.header().head.load(Ordering::Acquire);
        if head == self.skipped_from {
            head = self.skipped_to;
        }
        if self.tail.wrapping_sub(head) > self.ring.capacity as u64 {
            return Err(Corrupt);
        }
        self.head_cache = head;
        Ok(())
    }

    /// Bytes free, re-reading the consumer's head when the cached view shows fewer than `want`.
    ///
    /// With nothing pushed and unpublished, also rewinds the ring if it is found empty past
    /// [`REWIND_AT`]: whenever the head is re-read anyway, and every [`REWIND_RECHECK`] bytes
    /// written past `REWIND_AT` otherwise. (That can be in the middle of a frame, after a
    /// streaming publication: the ring is a byte stream, and the reader follows the rewind
    /// wherever it falls.)
    pub(crate) fn free(&mut self, want: usize) -> Result<usize, Corrupt> {
        let between_frames = self.tail == self.published;
        let mut look = between_frames && self.tail >= self.rewind_check;
        if look {
            let into_lap = self.tail & (self.ring.capacity as u64 - 1);
            if into_lap < REWIND_AT as u64 {
                // The ring wrapped on its own since the last look.
                self.rewind_check = self.tail - into_lap + REWIND_AT as u64;
                look = false;
            }
        }
        if look || self.free_cached() < want {
            self.read_head()?;
            if between_frames {
                self.rewind_if_empty(look);
            }
        }
        Ok(self.free_cached())
    }

    /// After a fresh read of the head: moves the write position to the start of the data area
    /// if the consumer has read everything and the position is past `REWIND_AT`. A look that
    /// finds bytes unread looks again `REWIND_RECHECK` bytes later.
    fn rewind_if_empty(&mut self, looked: bool) {
        let mask = self.ring.capacity as u64 - 1;
        if !rewinds(self.ring.capacity) || self.tail & mask < REWIND_AT as u64 {
            return;
        }
        // Only on an 8-byte boundary: a frame rewound in its middle keeps its bytes' alignment,
        // so it still ends where its length says its padding ends.
        if self.head_cache != self.tail || !self.tail.is_multiple_of(8) {
            if looked {
                self.rewind_check = self.tail.wrapping_add(REWIND_RECHECK);
            }
            return;
        }
        // Empty: every byte written was published and read. The consumer learns of the jump from
        // `skip_from`: with the next publication of `tail`, or, waiting at a frame boundary here,
        // at its next look. The word at the new position, where the next frame's word goes, is
        // zeroed first. The fence keeps the bytes written next (over this position too, in the
        // next lap) from being seen before `skip_from` by a consumer that looks here.
        let to = (self.tail | mask).wrapping_add(1);
        self.ring.word(to).store(0, Ordering::Relaxed);
        self.ring.header().skip_from.store(self.tail, Ordering::Release);
        fence(Ordering::SeqCst);
        self.published = self.published.wrapping_add(to.wrapping_sub(self.tail));
        self.skipped_from = self.tail;
        self.skipped_to = to;
        self.tail = to;
        self.head_cache = to;
        self.rewind_check = to.wrapping_add(REWIND_AT as u64);
    }

    /// Copies as much of `src` as fits (by the cached view) and returns how much; the bytes
    /// become visible to the consumer at the next [`publish`](Self::publish).
    pub(crate) fn push(&mut self, src: &[u8]) -> usize {
        let n = src.len().min(self.free_cached());
        self.ring.copy_in(self.tail, &src[..n]);
        self.tail = self.tail.wrapping_add(n as u64);
        n
    }

    /// Writes a whole frame of `len` bytes (the sum of `parts`' lengths, checked) at the write
    /// position, which must be a frame boundary, with its word stored last. Marked `complete`, a
    /// consumer waiting at this boundary sees the frame without a publication (for a frame about
    /// to be published anyway); unmarked, only once it is published (a frame held back for a
    /// batch). The caller checks first that [`free`](Self::free) has `8 + padded(len)` bytes.
    pub(crate) fn push_frame(&mut self, len: u64, parts: &[&[u8]], complete: bool) {
        let total = 8 + padded(len);
        assert!(
            self.free_cached() as u64 >= total && len <= word::LEN_MASK && self.tail.is_multiple_of(8),
            "a frame pushed without room, too long or off a frame boundary"
        );
        let start = self.tail;
        let mut at = start.wrapping_add(8);
        for part in parts {
            self.ring.copy_in(at, part);
            at = at.wrapping_add(part.len() as u64);
        }
        assert_eq!(
            at.wrapping_sub(start),
            8 + len,
            "the parts do not add up to the frame's length"
        );
        self.tail = start.wrapping_add(total);
        // The next boundary's word, zeroed (within the reserve) before this frame is announced.
        self.ring.word(self.tail).store(0, Ordering::Relaxed);
        let flag = if complete { word::COMPLETE } else { 0 };
        self.ring.word(start).store(len | word::FRAME | flag, Ordering::Release);
    }

    /// Starts a frame that streams: its word, without `COMPLETE` (the frame's bytes follow with
    /// [`push`](Self::push) and are read as they are published). The write position must be a
    /// frame boundary and [`free`](Self::free) must have 8 bytes (both checked).
    pub(crate) fn push_word(&mut self, w: u64) {
        assert!(
            self.free_cached() >= 8 && self.tail.is_multiple_of(8),
            "a frame word pushed without room or off a frame boundary"
        );
        self.ring.word(self.tail).store(w, Ordering::Relaxed);
        self.tail = self.tail.wrapping_add(8);
    }

    /// Ends a frame written with [`push`](Self::push) (word first, so without `COMPLETE`): pads
    /// it to the next frame boundary and zeroes the word there. Must come before any publication
    /// that covers the frame's last byte. The padding and the word fit in the reserve.
    pub(crate) fn end_frame(&mut self) {
        self.tail = padded(self.tail);
        self.ring.word(self.tail).store(0, Ordering::Relaxed);
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
    /// `head` as last handed back to the producer, plus any bytes skipped by a rewind since (so
    /// `unreleased` counts only bytes read).
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

    #[inline]
    fn available_cached(&self) -> usize {
        self.tail_cache.wrapping_sub(self.head) as usize
    }

    /// [`available`](Self::available) for a consumer at a frame boundary (the caller knows it
    /// is): with nothing cached it reads the frame word there first. A complete frame is then
    /// readable whole without reading the producer's `tail`; a zero word means nothing has come
    /// (no read of `tail` either); a rewind is followed. A frame that streams (its word without
    /// `COMPLETE`) is read as bytes published through `tail`.
    #[inline]
    pub(crate) fn frame_available(&mut self, want: usize) -> Result<usize, Corrupt> {
        let mask = self.ring.capacity as u64 - 1;
        while self.available_cached() == 0 && self.head.is_multiple_of(8) {
            let w = self.ring.word(self.head).load(Ordering::Acquire);
            // After the word (see the module's notes): a rewind from here makes the word moot.
            if self.head & mask != 0 && self.ring.header().skip_from.load(Ordering::Acquire) == self.head {
                let to = (self.head | mask).wrapping_add(1);
                self.released = self.released.wrapping_add(to.wrapping_sub(self.head));
                self.head = to;
                self.tail_cache = to;
                continue;
            }
            if w == 0 {
                return Ok(0);
            }
            if w & word::COMPLETE != 0 {
                let len = word::frame_len(w).ok_or(Corrupt)?;
                let total = 8 + padded(len);
                if total > (self.ring.capacity - RESERVE) as u64 {
                    return Err(Corrupt);
                }
                self.tail_cache = self.head.wrapping_add(total);
            }
            break;
        }
        self.available(want)
    }

    /// Bytes readable, re-reading the producer's tail when the cached view shows fewer than
    /// `want`. Follows the producer's rewind on reaching the position it rewound from.
    #[inline]
    pub(crate) fn available(&mut self, want: usize) -> Result<usize, Corrupt> {
        if self.available_cached() < want {
            let header = self.ring.header();
            let tail = header.tail.load(Ordering::Acquire);
            // Complete frames are read before their publication (`frame_available`), so the
            // published tail may be behind what is cached (after a rewind, by more than a ring):
            // then it tells nothing new. (Compared as signed: the counters wrap.)
            if self.tail_cache.wrapping_sub(tail) as i64 >= 0 {
                return Ok(self.available_cached());
            }
            let mask = self.ring.capacity as u64 - 1;
            // `skip_from` was stored before the `tail` just acquired was published, so it must be
            // loaded after `tail` (as here), never before. After a rewind the producer may have
            // filled the whole ring from its start, so the bytes in flight count from there.
            if tail != self.head && self.head & mask != 0 && header.skip_from.load(Ordering::Relaxed) == self.head {
                let to = (self.head | mask).wrapping_add(1);
                if tail.wrapping_sub(to) > self.ring.capacity as u64 {
                    return Err(Corrupt);
                }
                self.released = self.released.wrapping_add(to.wrapping_sub(self.head));
                self.head = to;
            }
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

    /// Replaces `out`'s contents with the next `n` readable bytes (by the cached view), which
    /// must be there (checked), without zero-filling `out` first.
    pub(crate) fn pop_to_vec(&mut self, out: &mut Vec<u8>, n: usize) {
        assert!(n <= self.available_cached(), "pop_to_vec of bytes not yet available");
        out.clear();
        out.reserve(n);
        // SAFETY: `reserve` made `out` valid for writes of `n` bytes past its (zero) length, in
        // its own allocation (not the ring); `copy_out_raw` writes exactly `n` bytes there (or
        // panics first), after which they are initialised and `set_len` exposes them.
        unsafe {
            self.ring.copy_out_raw(self.head, out.as_mut_ptr(), n);
            out.set_len(n);
        }
        self.head = self.head.wrapping_add(n as u64);
    }

    /// Consumes `n` readable bytes (by the cached view, checked) without copying them: for
    /// bytes already seen with [`peek`](Self::peek).
    pub(crate) fn discard(&mut self, n: usize) {
        assert!(n <= self.available_cached(), "discard of bytes not yet available");
        self.head = self.head.wrapping_add(n as u64);
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

    /// A producer and a consumer of one new ring of `capacity` bytes, and its memory file.
    fn pair(capacity: usize) -> (Producer, Consumer, OwnedFd) {
        let (ring, fd) = Ring::create(capacity).unwrap();
        let peer = Ring::open(&fd).unwrap();
        (Producer::new(ring), Consumer::new(peer), fd)
    }

    /// Bytes of the memory file that hold pages (tmpfs allocates a page on its first write).
    fn allocated(fd: &OwnedFd) -> u64 {
        use nix::unistd::{lseek, Whence};
        use std::os::fd::AsRawFd;
        let len = file_len(fd).unwrap() as i64;
        let (mut total, mut pos) = (0, 0);
        while pos < len {
            let Ok(start) = lseek(fd.as_raw_fd(), pos, Whence::SeekData) else {
                break;
            };
            let end = lseek(fd.as_raw_fd(), start, Whence::SeekHole).unwrap();
            total += (end - start) as u64;
            pos = end;
        }
        total
    }

    /// Sends `msgs` through the pair one at a time, each read back whole before the next.
    fn ping(p: &mut Producer, c: &mut Consumer, msgs: impl Iterator<Item = Vec<u8>>) {
        for msg in msgs {
            assert!(p.free(msg.len()).unwrap() >= msg.len());
            assert_eq!(p.push(&msg), msg.len());
            p.publish();
            assert_eq!(c.available(msg.len()).unwrap(), msg.len());
            let mut got = vec![0; msg.len()];
            assert_eq!(c.pop(&mut got), msg.len());
            c.release();
            assert_eq!(got, msg);
        }
    }

    #[test]
    fn an_empty_ring_rewinds_so_small_messages_reuse_its_first_pages() {
        let capacity = 1 << 20;
        let (mut p, mut c, fd) = pair(capacity);
        // 20,000 messages of 100 bytes: 2 MB, which would be two laps of the ring.
        ping(&mut p, &mut c, (0..20_000u32).map(|i| vec![i as u8; 100]));
        let into_lap = (p.tail & (capacity as u64 - 1)) as usize;
        assert!(
            into_lap < REWIND_AT + 100,
            "write position {into_lap} bytes into the ring"
        );
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap_or_default();
        if thp.contains("[always]") || thp.contains("[force]") {
            eprintln!("skipped the page count: shared memory uses huge pages on this host ({thp:?})");
        } else {
            let page = super::super::sys::page_size();
            let bound = (HEADER_BYTES + REWIND_AT + 100).div_ceil(page) * page + page;
            let pages = allocated(&fd);
            assert!(
                pages <= bound as u64,
                "{pages} bytes of the ring's file allocated (bound {bound})"
            );
        }
        // Nothing counted as unpublished or unreleased but real bytes.
        assert_eq!(p.unpublished(), 0);
        assert_eq!(c.unreleased(), 0);
    }

    #[test]
    fn a_busy_ring_is_not_rewound_and_a_late_reader_follows_the_rewind() {
        let capacity = 1 << 17;
        let (mut p, mut c, _fd) = pair(capacity);
        let mut sent = Vec::new();
        let mut got = Vec::new();
        let mut next = 0u32;
        let mut push = |p: &mut Producer, n: usize, sent: &mut Vec<u8>| {
            let chunk: Vec<u8> = (0..n).map(|i| (next as usize * 31 + i) as u8).collect();
            next += 1;
            assert!(p.free(n).unwrap() >= n);
            assert_eq!(p.push(&chunk), n);
            p.publish();
            sent.extend_from_slice(&chunk);
        };
        // Past REWIND_AT with one byte always left unread: no rewind.
        for _ in 0..40 {
            push(&mut p, 1000, &mut sent);
            let n = c.available(1).unwrap() - 1;
            let mut buf = vec![0; n];
            c.pop(&mut buf);
            c.release();
            got.extend_from_slice(&buf);
        }
        assert_eq!(p.tail, 40_000, "a ring with unread bytes kept its position");
        // Drained.
        let mut buf = vec![0; c.available(1).unwrap()];
        c.pop(&mut buf);
        c.release();
        got.extend_from_slice(&buf);
        // Kept drained, the ring rewinds at the next look (REWIND_RECHECK bytes after the last);
        // the message written after the rewind is left for a reader that has not looked yet.
        let mut from = 0;
        for _ in 0..10 {
            from = p.tail;
            push(&mut p, 1000, &mut sent);
            if p.tail > capacity as u64 {
                break;
            }
            let mut buf = vec![0; c.available(1).unwrap()];
            c.pop(&mut buf);
            c.release();
            got.extend_from_slice(&buf);
        }
        assert_eq!(p.tail, capacity as u64 + 1000, "rewound within REWIND_RECHECK bytes");
        // The producer fills the rest of the ring from its start before the reader looks.
        assert_eq!(p.ring.header().skip_from.load(Ordering::Relaxed), from);
        push(&mut p, capacity - RESERVE - 1000, &mut sent);
        assert_eq!(p.free(1).unwrap(), 0, "full");
        let mut buf = vec![0; c.available(capacity).unwrap()];
        assert_eq!(buf.len(), capacity - RESERVE, "the skipped bytes are not offered");
        c.pop(&mut buf);
        c.release();
        got.extend_from_slice(&buf);
        assert_eq!(got, sent);
        // The producer reads the consumer's head as the rewound position.
        assert_eq!(p.free(capacity).unwrap(), capacity - RESERVE);
    }

    #[test]
    fn rewinds_work_across_the_wrap_of_the_counters() {
        let capacity = 1 << 17;
        let (mut p, mut c, _fd) = pair(capacity);
        // Both sides start three laps before the u64 counters wrap.
        let start = 0u64.wrapping_sub(3 * capacity as u64);
        p.ring.header().tail.store(start, Ordering::Relaxed);
        p.ring.header().head.store(start, Ordering::Relaxed);
        (p.tail, p.head_cache, p.published, p.rewind_check) = (start, start, start, start + REWIND_AT as u64);
        (c.head, c.tail_cache, c.released) = (start, start, start);
        let before = p.tail;
        ping(
            &mut p,
            &mut c,
            (0..40_000u32).map(|i| vec![i as u8; 100 + i as usize % 300]),
        );
        assert!(p.tail < before, "the counters wrapped");
        assert!(
            (p.tail & (capacity as u64 - 1)) < (REWIND_AT + 400) as u64,
            "and the ring kept rewinding"
        );
    }

    #[test]
    fn random_traffic_survives_rewinds() {
        let capacity = 1 << 16;
        let (mut p, mut c, _fd) = pair(capacity);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let (mut sent, mut got) = (Vec::new(), Vec::new());
        let mut rewinds = 0;
        for round in 0..20_000u64 {
            let n = rand(3000) as usize;
            let before = p.tail;
            let free = p.free(n).unwrap();
            let chunk: Vec<u8> = (0..n.min(free)).map(|i| (round as usize + i * 3) as u8).collect();
            if p.tail != before {
                rewinds += 1;
            }
            assert_eq!(p.push(&chunk), chunk.len());
            sent.extend_from_slice(&chunk);
            if rand(4) != 0 {
                p.publish();
            }
            let want = rand(4000) as usize;
            let n = c.available(want).unwrap().min(want);
            let mut buf = vec![0; n];
            c.pop(&mut buf);
            if rand(2) == 0 {
                c.release();
            }
            got.extend_from_slice(&buf);
        }
        p.publish();
        let mut buf = vec![0; c.available(capacity).unwrap()];
        c.pop(&mut buf);
        got.extend_from_slice(&buf);
        let differ = got.iter().zip(&sent).position(|(a, b)| a != b);
        assert!(
            got.len() == sent.len() && differ.is_none(),
            "{} bytes read of {} sent, first difference at {differ:?}",
            got.len(),
            sent.len()
        );
        assert!(rewinds > 10, "only {rewinds} rewinds");
    }

    #[test]
    fn a_rewind_claiming_more_than_was_published_is_corruption() {
        let capacity = 1 << 17;
        let (ring, fd) = Ring::create(capacity).unwrap();
        let peer = Ring::open(&fd).unwrap();
        let mut p = Producer::new(ring.clone());
        let mut c = Consumer::new(peer);
        ping(&mut p, &mut c, std::iter::once(vec![7; 100]));
        // The "peer" says it rewound at our position but published only 10 bytes more.
        ring.header().skip_from.store(100, Ordering::Relaxed);
        ring.header().tail.store(110, Ordering::Release);
        assert!(c.available(1).is_err());
    }

    /// Checks that the producer has room for a frame of `payload` (looking, as the transport
    /// does, whether to rewind).
    fn assert_room(p: &mut Producer, payload: &[u8]) {
        let total = 8 + padded(payload.len() as u64) as usize;
        assert!(p.free(total).unwrap() >= total, "no room for a frame of {total} bytes");
    }

    /// Writes one whole frame, as the transport does when it fits.
    fn send_frame(p: &mut Producer, payload: &[u8]) {
        assert_room(p, payload);
        p.push_frame(payload.len() as u64, &[payload], true);
    }

    /// Writes one whole frame held back for a batch: without `COMPLETE`, so unseen until published.
    fn send_frame_held(p: &mut Producer, payload: &[u8]) {
        assert_room(p, payload);
        p.push_frame(payload.len() as u64, &[payload], false);
    }

    /// Reads the next frame at the consumer's frame boundary, if one has come (whole: a frame
    /// begun but not all there fails the test).
    fn receive_frame(c: &mut Consumer) -> Option<Vec<u8>> {
        receive_frame_or(c, || panic!("a frame announced but not all there"))
    }

    /// [`receive_frame`], calling `short` (which may wait) while the frame begun is not all there.
    fn receive_frame_or(c: &mut Consumer, short: impl Fn()) -> Option<Vec<u8>> {
        if c.frame_available(8).unwrap() < 8 {
            return None;
        }
        let mut header = [0; 8];
        c.peek(&mut header);
        let len = word::frame_len(u64::from_le_bytes(header)).expect("a frame word") as usize;
        let total = 8 + padded(len as u64) as usize;
        while c.available(total).unwrap() < total {
            short();
        }
        c.discard(8);
        let mut out = vec![0; len];
        c.pop(&mut out);
        c.discard(total - 8 - len);
        c.release();
        Some(out)
    }

    /// A payload whose every 8-byte word looks like the word of a complete frame.
    fn decoy(len: usize) -> Vec<u8> {
        let fake = (24 | word::FRAME | word::COMPLETE).to_le_bytes();
        (0..len).map(|i| fake[i % 8]).collect()
    }

    #[test]
    fn a_waiting_consumer_sees_a_whole_frame_from_its_word_alone() {
        let (mut p, mut c, _fd) = pair(MIN_CAPACITY);
        assert_eq!(c.frame_available(1).unwrap(), 0, "a new ring holds nothing");
        // Written whole and not published: the word says it is all there.
        send_frame(&mut p, b"hello, frame");
        assert_eq!(p.unpublished(), 8 + 16);
        assert_eq!(c.ring.header().tail.load(Ordering::Relaxed), 0, "nothing published");
        assert_eq!(c.frame_available(1).unwrap(), 8 + 16);
        assert_eq!(receive_frame(&mut c).unwrap(), b"hello, frame");
        assert_eq!(c.frame_available(1).unwrap(), 0, "the next boundary's word was zeroed");
        // A whole frame held back for a batch (no COMPLETE) is seen only once published.
        send_frame_held(&mut p, b"held");
        assert_eq!(c.frame_available(1).unwrap(), 0, "held back");
        p.publish();
        assert_eq!(receive_frame(&mut c).as_deref(), Some(&b"held"[..]));
        // A frame that streams (word first, no COMPLETE) is seen only once published.
        p.free(8 + 8).unwrap();
        p.push_word(5 | word::FRAME);
        p.push(b"abcde");
        p.end_frame();
        assert_eq!(c.frame_available(1).unwrap(), 0, "not published yet");
        p.publish();
        assert_eq!(receive_frame(&mut c).unwrap(), b"abcde");
        assert_eq!(receive_frame(&mut c), None);
    }

    /// Writes one frame that streams: its word, then its bytes in pieces, each published.
    fn stream_frame(p: &mut Producer, payload: &[u8]) {
        assert_room(p, payload);
        push_streaming(p, payload, 100);
    }

    /// The writing of a frame that streams, in pieces of `piece` bytes (room checked before).
    fn push_streaming(p: &mut Producer, payload: &[u8], piece: usize) {
        p.push_word(payload.len() as u64 | word::FRAME);
        for piece in payload.chunks(piece) {
            p.push(piece);
            p.publish();
        }
        p.end_frame();
        p.publish();
    }

    #[test]
    fn an_old_laps_bytes_are_never_read_as_a_frame_word() {
        let (mut p, mut c, _fd) = pair(MIN_CAPACITY);
        // Frames of every length up to 300 bytes, each full of decoy words, for many laps: each
        // new boundary falls, sooner or later, on an old payload's decoy. Whole frames and
        // streaming ones alternate (each zeroes the next boundary's word its own way).
        for round in 0..3000usize {
            let payload = decoy(round * 37 % 301);
            if round % 2 == 0 {
                send_frame(&mut p, &payload);
            } else {
                stream_frame(&mut p, &payload);
            }
            assert_eq!(receive_frame(&mut c).as_deref(), Some(&payload[..]), "frame {round}");
            assert_eq!(
                c.frame_available(1).unwrap(),
                0,
                "a decoy read as a frame after frame {round}"
            );
        }
        assert!(p.tail > 50 * MIN_CAPACITY as u64, "the ring lapped");
    }

    /// A pair whose first lap's start is full of decoy frames, all read, and whose producer has
    /// just rewound (at its first look past REWIND_AT, writing nothing) to the second lap.
    fn rewound_pair(capacity: usize) -> (Producer, Consumer, OwnedFd) {
        let (mut p, mut c, fd) = pair(capacity);
        while p.tail < REWIND_AT as u64 {
            send_frame(&mut p, &decoy(1000));
            p.publish();
            assert!(receive_frame(&mut c).is_some());
        }
        let from = p.tail;
        p.free(1).unwrap();
        assert_eq!(p.tail, capacity as u64, "rewound from {from}");
        (p, c, fd)
    }

    #[test]
    fn a_consumer_following_a_rewind_finds_nothing_until_the_next_frame() {
        let capacity = 1 << 17;
        let (mut p, mut c, _fd) = rewound_pair(capacity);
        // The consumer follows the rewind to the first lap's start, where its old words lie:
        // the word where the next frame goes was zeroed.
        assert_eq!(c.frame_available(1).unwrap(), 0);
        assert_eq!(c.head, capacity as u64, "followed the rewind");
        send_frame(&mut p, b"after the rewind");
        assert_eq!(receive_frame(&mut c).as_deref(), Some(&b"after the rewind"[..]));
    }

    #[test]
    fn a_published_tail_left_behind_by_a_rewind_is_not_news() {
        let (mut p, mut c, _fd) = rewound_pair(1 << 17);
        // Whole frames read as they come, before any publication: more bytes since the rewind
        // than the rewind's position into its lap, so the published tail (left where the rewind
        // was) falls more than a ring behind what the consumer has read.
        for i in 0..30u8 {
            send_frame(&mut p, &[i; 1000]);
            assert_eq!(receive_frame(&mut c), Some(vec![i; 1000]));
        }
        // A frame that streams is read through the published tail: not corrupt.
        p.free(16).unwrap();
        p.push_word(5 | word::FRAME);
        assert_eq!(c.frame_available(1).unwrap(), 0, "its bytes are not published yet");
        p.push(b"tail!");
        p.end_frame();
        p.publish();
        assert_eq!(receive_frame(&mut c).as_deref(), Some(&b"tail!"[..]));
    }

    #[test]
    fn two_threads_exchange_frames_through_rewinds() {
        let capacity = 1 << 16;
        let (ring, fd) = Ring::create(capacity).unwrap();
        let peer = Ring::open(&fd).unwrap();
        const FRAMES: u32 = 200_000;
        // A watchdog: a lost frame or a stale word must fail the test, not hang it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let alive = move |what: &str| assert!(std::time::Instant::now() < deadline, "stuck {what}");
        // Frame `i`: a decoy of a length from 0 to 4 KiB, its first bytes the frame's number.
        let frame = |i: u32| {
            let mut f = decoy((i as usize * 613) % 4097);
            let n = f.len().min(4);
            f[..n].copy_from_slice(&i.to_le_bytes()[..n]);
            f
        };
        let producer = std::thread::spawn(move || {
            let mut p = Producer::new(ring);
            let mut rewinds = 0;
            for i in 0..FRAMES {
                let f = frame(i);
                let total = 8 + padded(f.len() as u64) as usize;
                loop {
                    let before = p.tail;
                    let free = p.free(total).unwrap();
                    if p.tail & (capacity as u64 - 1) < before & (capacity as u64 - 1) {
                        rewinds += 1;
                    }
                    if free >= total {
                        break;
                    }
                    p.publish();
                    alive("writing");
                    std::thread::yield_now();
                }
                // Whole and published at once, whole and held back for a batch, or streamed.
                match i % 5 {
                    0 | 1 => {
                        p.push_frame(f.len() as u64, &[&f], true);
                        p.publish();
                    }
                    2 | 3 => p.push_frame(f.len() as u64, &[&f], false),
                    _ => push_streaming(&mut p, &f, 700),
                }
            }
            p.publish();
            rewinds
        });
        let mut c = Consumer::new(peer);
        for i in 0..FRAMES {
            let wait = || {
                alive("reading a frame that streams");
                std::thread::yield_now();
            };
            let got = loop {
                if let Some(f) = receive_frame_or(&mut c, wait) {
                    break f;
                }
                alive("reading");
                std::thread::yield_now();
            };
            assert!(
                got == frame(i),
                "frame {i}: {} bytes, {:?}",
                got.len(),
                &got[..got.len().min(8)]
            );
        }
        assert_eq!(receive_frame(&mut c), None);
        let rewinds = producer.join().unwrap();
        assert!(rewinds > 0, "the ring never rewound");
    }

    #[test]
    fn a_consumer_waiting_where_the_producer_rewound_moves_on() {
        let capacity = 1 << 17;
        let (mut p, mut c, _fd) = pair(capacity);
        // Frames read as they come until the producer rewinds (past REWIND_AT, found empty).
        let mask = capacity as u64 - 1;
        let mut from;
        loop {
            from = p.tail;
            send_frame(&mut p, &decoy(1000));
            p.publish();
            if p.tail & mask < from & mask {
                break;
            }
            assert!(receive_frame(&mut c).is_some());
        }
        assert!(
            p.tail < from + capacity as u64 && p.tail & (capacity as u64 - 1) < 1100,
            "rewound"
        );
        // Before the consumer looks again, the producer's frames fill the next lap over the
        // position the consumer waits at, with decoys.
        let mut sent = vec![decoy(1000)];
        while p.free(1100).unwrap() >= 1100 {
            let payload = decoy(sent.len() * 13 % 1000 + 1);
            send_frame(&mut p, &payload);
            p.publish();
            sent.push(payload);
        }
        assert!(
            p.tail > from + capacity as u64 - 1100,
            "the lap covers the consumer's position"
        );
        for (i, want) in sent.iter().enumerate() {
            assert_eq!(receive_frame(&mut c).as_ref(), Some(want), "frame {i} after the rewind");
        }
        assert_eq!(receive_frame(&mut c), None);
    }

    #[test]
    fn two_threads_stream_through_rewinds() {
        let capacity = 1 << 16;
        let (ring, fd) = Ring::create(capacity).unwrap();
        let peer = Ring::open(&fd).unwrap();
        let total: u64 = 64 << 20;
        // A watchdog: a lost byte or a missed wake-up must fail the test, not hang it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let alive = move |what: &str| assert!(std::time::Instant::now() < deadline, "stuck {what}");
        let byte = |pos: u64| (pos ^ (pos >> 11)) as u8;
        let producer = std::thread::spawn(move || {
            let mut p = Producer::new(ring);
            let (mut sent, mut size, mut rewinds, mut chunks) = (0u64, 1usize, 0, 0u32);
            let mut chunk = Vec::new();
            while sent < total {
                // Sizes from 1 byte to 8 KiB, so the ring is sometimes empty and sometimes full.
                size = (size * 5 + 3) % 8192 + 1;
                let n = size.min((total - sent) as usize);
                chunk.clear();
                chunk.extend((0..n as u64).map(|i| byte(sent + i)));
                let mut off = 0;
                while off < n {
                    let before = p.tail;
                    if p.free(1).unwrap() == 0 {
                        alive("writing");
                        std::thread::yield_now();
                        continue;
                    }
                    if p.tail != before {
                        rewinds += 1;
                    }
                    off += p.push(&chunk[off..]);
                    p.publish();
                }
                sent += n as u64;
                chunks += 1;
                if chunks % 8 == 0 {
                    // Now and then wait for the reader to drain the ring, as a sender that
                    // waits for replies does.
                    let before = p.tail;
                    while p.free(capacity).unwrap() < capacity - RESERVE {
                        alive("waiting for the reader to drain the ring");
                        std::thread::yield_now();
                    }
                    if p.tail != before {
                        rewinds += 1;
                    }
                }
            }
            rewinds
        });
        let mut c = Consumer::new(peer);
        let mut buf = vec![0; 5000];
        let mut got = 0u64;
        while got < total {
            let n = c.available(1).unwrap().min(buf.len());
            if n == 0 {
                c.release();
                alive("reading");
                std::thread::yield_now();
                continue;
            }
            // Reads of every size, on every alignment.
            let n = n.min(got as usize % 4999 + 1);
            c.pop(&mut buf[..n]);
            for (i, b) in buf[..n].iter().enumerate() {
                assert_eq!(*b, byte(got + i as u64), "byte {}", got + i as u64);
            }
            got += n as u64;
            if c.unreleased() > 4096 {
                c.release();
            }
        }
        c.release();
        let rewinds = producer.join().unwrap();
        assert!(rewinds > 0, "the ring never rewound");
    }
}
