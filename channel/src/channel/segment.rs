//! The shared segment: where CPU tensors between two processes of one host land, so the
//! receiver keeps them where the sender put them (one copy in all, none on the receiving side)
//! and no acknowledgement is needed.
//!
//! Each process creates one segment it *receives* into (a memory file, see [`SharedFile`]), for
//! all its cma pipes, and offers it in every pipe's setup; each peer opens it through `/proc`
//! (once per peer process) and allocates from it when it sends. One segment per receiving
//! process, not per pipe, keeps the memory it touches at the bytes in flight *to* it, however
//! many peers it has. The segment is blocks of [`BLOCK`] bytes after a header with one bit per
//! block. Senders set bits (a first fit that keeps reused pages warm, claiming each bitmap word
//! with a compare-and-swap, so senders in several processes never claim the same block); the
//! receiver clears them (when the last handle on a received tensor drops). So allocation needs
//! no lock and no round trip: the sender's copy happens-before the descriptor it writes on the
//! control connection; the receiver's last read happens-before its release, which a sender's
//! acquire load sees before reusing the blocks.
//!
//! Memory: the pages of a block are allocated when a sender first writes it, so a receiver's
//! segment holds the largest burst of bytes in flight to it so far (plus fragmentation), which
//! under a long load with rare peaks kept growing (the 64-worker soak: 1.1 GB of shared memory
//! on the host after 10 s, 2.1 GB after 100 s). The receiver therefore gives back, every few
//! seconds, the pages of free blocks that no tensor delivered to it used lately (see
//! [`TRIM_EPOCH`] and [`Segment::trim`]), from a thread of its own, so an idle receiver gives
//! its last burst back too and no tensor's drop pays for it: it claims them in the bitmap as a
//! sender would (so no sender writes them meanwhile, and a peer naming them is refused),
//! punches them out of the file, and frees them again. A sender that reuses one later takes
//! page faults into fresh pages.
//!
//! Trust: a peer that can open the segment can already read and write this process's memory
//! (the same permission as cross-memory attach), so the segment adds no exposure. A confused
//! peer is still caught: the receiver takes only blocks marked allocated and not already held
//! by a tensor it delivered, else the read fails with a protocol error.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use sluice_transport::shm::SharedFile;

/// Allocation unit. Tensors smaller than this go inline through the control connection.
pub const BLOCK: usize = 64 << 10;
const MAGIC: u64 = u64::from_le_bytes(*b"SLCSEG01");
/// Header: magic, block count, then the bitmap; padded to whole blocks.
const FIXED: usize = 16;

/// What a side offers in setup: the file its peer opens to send to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SegmentOffer {
    pub fd: i32,
    pub bytes: u64,
}

/// One direction's segment, mapped on both sides.
pub struct Segment {
    file: SharedFile,
    blocks: usize,
    /// Where data starts (after the header).
    data: usize,
    /// Receiving side only: what it holds and has used (bit per block).
    received: Mutex<Received>,
    /// Sending side: the blocks this process has already mapped in (bit per block).
    populated: Box<[AtomicU64]>,
    /// Tests: punches fail as a kernel that refuses them would have them fail.
    #[cfg(test)]
    refuse_punches: std::sync::atomic::AtomicBool,
}

/// The receiving side's view of its blocks, bit per block.
#[derive(Default)]
struct Received {
    /// Held by tensors this process received (so a peer naming them twice is caught), or
    /// claimed by a trim giving their pages back.
    held: Vec<u64>,
    /// Delivered or released in this trim epoch (`[0]`) and the one before (`[1]`).
    seen: [Vec<u64>; 2],
    /// Delivered since their pages were last given back: pages that may be resident.
    resident: Vec<u64>,
    /// Set when the kernel refused a punch (a sandbox, an old kernel): trims stop.
    refused: bool,
}

/// How long a trim epoch lasts: a free block's pages go back to the kernel once no delivered
/// tensor used it in the current epoch or the one before (4 to 8 s). Shorter, the pages of
/// blocks used now and then go back and come again (a punch, a fresh zero-filled page, and a
/// page fault per page in every sender that writes it): with 1 s epochs, 5% of the 64-worker
/// soak's CPU.
pub const TRIM_EPOCH: Duration = Duration::from_secs(4);

impl Received {
    fn new(words: usize) -> Received {
        Received {
            held: vec![0; words],
            seen: [vec![0; words], vec![0; words]],
            resident: vec![0; words],
            refused: false,
        }
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("blocks", &self.blocks).finish()
    }
}

fn layout(bytes: usize) -> Option<(usize, usize)> {
    // blocks * BLOCK + header(blocks) <= bytes
    let mut blocks = bytes / BLOCK;
    while blocks > 0 {
        let header = (FIXED + blocks.div_ceil(64) * 8).div_ceil(BLOCK) * BLOCK;
        if header + blocks * BLOCK <= bytes {
            return Some((blocks, header));
        }
        blocks -= 1;
    }
    None
}

impl Segment {
    /// A new segment of about `bytes` bytes for this process to receive into, trimmed every
    /// [`TRIM_EPOCH`] by a thread of its own (which ends once the segment is dropped).
    pub fn create(bytes: usize) -> Result<Arc<Segment>, String> {
        Self::create_trimmed_every(bytes, Some(TRIM_EPOCH))
    }

    /// [`create`](Self::create) with another trim epoch, or none (no trimming thread: the
    /// owner calls [`trim`](Self::trim) itself).
    pub fn create_trimmed_every(bytes: usize, epoch: Option<Duration>) -> Result<Arc<Segment>, String> {
        let seg = Self::create_untrimmed(bytes)?;
        if let Some(epoch) = epoch {
            let weak = Arc::downgrade(&seg);
            let spawned = std::thread::Builder::new()
                .name("sluice-segment-trim".into())
                .spawn(move || loop {
                    std::thread::sleep(epoch);
                    match weak.upgrade() {
                        Some(seg) => {
                            seg.trim();
                        }
                        None => return,
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("segment pages will not be given back: no thread to trim it: {e}");
            }
        }
        Ok(seg)
    }

    fn create_untrimmed(bytes: usize) -> Result<Arc<Segment>, String> {
        let (blocks, data) = layout(bytes).ok_or_else(|| format!("a segment of {bytes} bytes holds no block"))?;
        let file = SharedFile::create("sluice-segment", bytes).map_err(|e| format!("creating the segment: {e}"))?;
        let seg = Segment {
            file,
            blocks,
            data,
            received: Mutex::new(Received::new(blocks.div_ceil(64))),
            populated: Box::default(),
            #[cfg(test)]
            refuse_punches: Default::default(),
        };
        seg.word(0).store(MAGIC, Ordering::Relaxed);
        seg.word(1).store(blocks as u64, Ordering::Release);
        Ok(Arc::new(seg))
    }

    /// The peer's segment, to send into.
    pub fn open(pid: u32, offer: SegmentOffer) -> Result<Arc<Segment>, String> {
        let bytes = usize::try_from(offer.bytes).map_err(|_| "segment too large".to_owned())?;
        let (blocks, data) = layout(bytes).ok_or_else(|| format!("a segment of {bytes} bytes holds no block"))?;
        let file = SharedFile::open_peer(pid, offer.fd, bytes)
            .map_err(|e| format!("cannot open process {pid}'s segment: {e}"))?;
        let seg = Segment {
            file,
            blocks,
            data,
            received: Mutex::new(Received::default()),
            populated: (0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            #[cfg(test)]
            refuse_punches: Default::default(),
        };
        if seg.word(0).load(Ordering::Relaxed) != MAGIC || seg.word(1).load(Ordering::Acquire) != blocks as u64 {
            return Err(format!("process {pid}'s file is not a segment of {blocks} blocks"));
        }
        Ok(Arc::new(seg))
    }

    pub fn offer(&self) -> SegmentOffer {
        SegmentOffer {
            fd: self.file.raw_fd(),
            bytes: self.file.len() as u64,
        }
    }

    /// Largest tensor that can ever fit.
    pub fn capacity(&self) -> usize {
        self.blocks * BLOCK
    }

    /// Header word `i` (0: magic, 1: block count, 2..: bitmap).
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(FIXED / 8 + self.blocks.div_ceil(64) > i, "header word {i} out of range");
        // SAFETY: the header lies inside the mapping (checked by `layout`), `i` is in range
        // (asserted), the mapping is page-aligned so every u64 is aligned, and the memory is
        // shared with the peer only through atomic operations on these words.
        unsafe { &*(self.file.as_ptr().add(i * 8) as *const AtomicU64) }
    }

    fn bits(&self, w: usize) -> &AtomicU64 {
        self.word(FIXED / 8 + w)
    }

    /// Sender: reserves `len` bytes, returning their offset in the data area. Senders in
    /// several threads and processes may allocate at once. Single blocks are taken first fit
    /// from the bottom, longer runs from the top down, so the two kinds mostly keep apart: the
    /// pages a segment touches stay close to its peak of bytes in flight.
    ///
    /// A sender looks first among the blocks it has mapped in (see [`write`](Self::write)),
    /// and only then among all: each block it maps in costs it a page-table entry a page, and
    /// with many senders to one receiver, each taking the lowest free blocks would come to map
    /// in the receiver's whole region of bytes in flight. The price: a single block may be
    /// taken among the runs' blocks a sender mapped in (and a run among its singles), so a
    /// nearly full segment fragments sooner, and a tensor finding no free run goes by
    /// cross-memory attach instead (see `cma.rs`).
    pub fn allocate(&self, len: usize) -> Option<u64> {
        let need = len.div_ceil(BLOCK).max(1);
        if need > self.blocks {
            return None;
        }
        if need > 1 {
            return self.run_from_top(need, true).or_else(|| self.run_from_top(need, false));
        }
        self.single(true).or_else(|| self.single(false))
    }

    /// Whether this sender has mapped block `b` in.
    fn is_mapped(&self, b: usize) -> bool {
        self.populated
            .get(b / 64)
            .is_some_and(|w| w.load(Ordering::Relaxed) & 1 << (b % 64) != 0)
    }

    /// One past the highest block this sender has mapped in; `None` if it has none.
    fn mapped_top(&self) -> Option<usize> {
        let (w, bits) = self
            .populated
            .iter()
            .enumerate()
            .rev()
            .map(|(w, p)| (w, p.load(Ordering::Relaxed)))
            .find(|&(_, bits)| bits != 0)?;
        Some((w * 64 + 64 - bits.leading_zeros() as usize).min(self.blocks))
    }

    /// The lowest free block (among those mapped in, if `mapped_only`), claimed.
    fn single(&self, mapped_only: bool) -> Option<u64> {
        // Words are read one at a time (each is a cache line other processes write): the
        // first with a free block usually is the first.
        for w in 0..self.blocks.div_ceil(64) {
            let mut valid = if (w + 1) * 64 <= self.blocks {
                u64::MAX
            } else {
                (1u64 << (self.blocks % 64)) - 1
            };
            if mapped_only {
                valid &= self.populated.get(w).map_or(0, |p| p.load(Ordering::Relaxed));
                if valid == 0 {
                    continue;
                }
            }
            let word = self.bits(w);
            let mut cur = word.load(Ordering::Acquire);
            while !cur & valid != 0 {
                let bit = (!cur & valid).trailing_zeros();
                match word.compare_exchange_weak(cur, cur | 1 << bit, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Some(((w * 64 + bit as usize) * BLOCK) as u64),
                    Err(now) => cur = now,
                }
            }
        }
        None
    }

    /// The highest free run of `need` blocks (of blocks mapped in, if `mapped_only`), claimed.
    /// Reads only the words it looks at.
    fn run_from_top(&self, need: usize, mapped_only: bool) -> Option<u64> {
        // Among mapped-in blocks, from the highest one mapped in (none: nothing to look at).
        let top = if mapped_only { self.mapped_top()? } else { self.blocks };
        let mut seen: Vec<Option<u64>> = vec![None; self.blocks.div_ceil(64)];
        let mut start = top.checked_sub(need)?;
        let word_unmapped = |b: usize| {
            self.populated
                .get(b / 64)
                .is_none_or(|w| w.load(Ordering::Relaxed) == 0)
        };
        loop {
            let mut used = |b: usize| {
                (mapped_only && !self.is_mapped(b))
                    || *seen[b / 64].get_or_insert_with(|| self.bits(b / 64).load(Ordering::Acquire)) & (1 << (b % 64))
                        != 0
            };
            match (start..start + need).find(|&b| used(b)) {
                // A word with nothing mapped in is passed over whole (64 blocks at a step).
                Some(b) if mapped_only && word_unmapped(b) => start = (b / 64 * 64).checked_sub(need)?,
                // The run must end below the lowest used block of this window.
                Some(b) if b >= need => start = b - need,
                Some(_) => return None,
                None => match self.claim(start, need) {
                    Ok(()) => return Some((start * BLOCK) as u64),
                    // Another sender got there first: look again.
                    Err(w) => seen[w] = None,
                },
            }
        }
    }

    /// The word masks covering blocks `first..first + n`.
    fn masks(first: usize, n: usize) -> impl Iterator<Item = (usize, u64)> {
        let mut b = first;
        std::iter::from_fn(move || {
            if b >= first + n {
                return None;
            }
            let (w, lo) = (b / 64, b % 64);
            let count = (64 - lo).min(first + n - b);
            let mask = if count == 64 {
                u64::MAX
            } else {
                ((1u64 << count) - 1) << lo
            };
            b += count;
            Some((w, mask))
        })
    }

    /// Claims blocks `first..first + n` word by word; if one is taken meanwhile, gives back
    /// what it claimed and returns that word.
    fn claim(&self, first: usize, n: usize) -> Result<(), usize> {
        let mut claimed: Vec<(usize, u64)> = Vec::new();
        for (w, mask) in Self::masks(first, n) {
            let word = self.bits(w);
            let mut cur = word.load(Ordering::Acquire);
            loop {
                if cur & mask != 0 {
                    for &(w, mask) in &claimed {
                        self.bits(w).fetch_and(!mask, Ordering::AcqRel);
                    }
                    return Err(w);
                }
                match word.compare_exchange_weak(cur, cur | mask, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(now) => cur = now,
                }
            }
            claimed.push((w, mask));
        }
        Ok(())
    }

    /// Clears the bits of blocks `first..first + n` (the receiver releasing, or a sender giving
    /// back blocks it never announced).
    fn clear(&self, first: usize, n: usize) {
        for (w, mask) in Self::masks(first, n) {
            self.bits(w).fetch_and(!mask, Ordering::AcqRel);
        }
    }

    /// Sender: gives back blocks reserved at `offset` for `len` bytes that the receiver never
    /// heard of (the message carrying them was not sent).
    pub fn unreserve(&self, offset: u64, len: usize) {
        self.clear(offset as usize / BLOCK, len.div_ceil(BLOCK).max(1));
    }

    /// Sender: copies `src` into the blocks reserved at `offset`.
    ///
    /// Each sender maps the receiver's segment on its own, so each page the receiver's hot blocks
    /// span would fault once in every sender's page tables (with 64 processes on one host, page
    /// faults on segments were a tenth of all CPU time in the soak). Instead, the first write
    /// into a block maps its pages in with one system call (adjacent blocks with one call), and
    /// only the blocks written: every process maps its peers' segments on its own, so a page
    /// mapped in that a sender never writes costs a page-table entry per sender for nothing.
    /// (Mapping 1 MiB at a time instead, as this did first, left the 64-worker soak spending a
    /// seventh of its CPU mapping in pages: 15% slower, and p99 5.5× p50 against 3.7×.)
    pub fn write(&self, offset: u64, src: &[u8]) {
        let offset = offset as usize;
        assert!(
            offset.is_multiple_of(BLOCK) && offset + src.len() <= self.capacity(),
            "write outside the reserved blocks"
        );
        self.populate(offset / BLOCK, src.len().div_ceil(BLOCK).max(1));
        // SAFETY: the range lies in the data area (asserted) and was reserved by `allocate` on
        // this side, so the receiver does not read it until the descriptor naming it arrives,
        // and no other sender writes it.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.file.as_ptr().add(self.data + offset), src.len());
        }
    }

    /// Maps in, once per process, blocks `first..first + n` (adjacent ones with one call). A
    /// block is marked before it is mapped: a concurrent writer into it just takes the page
    /// faults. A failed call (a kernel before 5.14) leaves the faults too.
    fn populate(&self, first: usize, n: usize) {
        let mut run: Option<(usize, usize)> = None;
        let map = |(b0, b1): (usize, usize)| {
            let _ = self.file.populate_write(self.data + b0 * BLOCK, (b1 - b0) * BLOCK);
        };
        for b in first..first + n {
            let Some(word) = self.populated.get(b / 64) else { break };
            let bit = 1u64 << (b % 64);
            if word.load(Ordering::Relaxed) & bit == 0 && word.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
                run = Some(run.map_or((b, b + 1), |(b0, _)| (b0, b + 1)));
            } else if let Some(r) = run.take() {
                map(r);
            }
        }
        if let Some(r) = run {
            map(r);
        }
    }

    /// Receiver: the `len` bytes at `offset`, as bytes that free their blocks when the last
    /// handle drops. Fails for a range outside the segment, not allocated by the sender, or
    /// already held by a tensor delivered earlier.
    pub fn take(self: &Arc<Self>, offset: u64, len: u64) -> Result<Bytes, String> {
        let bad = || format!("segment range {offset}+{len} is not a sent tensor");
        let (offset, len) = (
            usize::try_from(offset).map_err(|_| bad())?,
            usize::try_from(len).map_err(|_| bad())?,
        );
        if !offset.is_multiple_of(BLOCK) || offset.checked_add(len).is_none_or(|end| end > self.capacity()) {
            return Err(bad());
        }
        let (first, n) = (offset / BLOCK, len.div_ceil(BLOCK).max(1));
        {
            let mut guard = self.received.lock().unwrap_or_else(PoisonError::into_inner);
            let r = &mut *guard;
            if r.held.is_empty() {
                return Err("this side sends into the segment; it receives nothing from it".into());
            }
            for b in first..first + n {
                let (w, bit) = (b / 64, 1u64 << (b % 64));
                if r.held[w] & bit != 0 || self.bits(w).load(Ordering::Acquire) & bit == 0 {
                    return Err(bad());
                }
            }
            for (w, mask) in Self::masks(first, n) {
                r.held[w] |= mask;
                r.seen[0][w] |= mask;
                r.resident[w] |= mask;
            }
        }
        Ok(Bytes::from_owner(Lease {
            seg: self.clone(),
            first,
            n,
            len,
        }))
    }

    fn release(&self, first: usize, n: usize) {
        let mut r = self.received.lock().unwrap_or_else(PoisonError::into_inner);
        for (w, mask) in Self::masks(first, n) {
            r.held[w] &= !mask;
            // Used until now: a tensor held for longer than two epochs keeps its pages for
            // two more.
            r.seen[0][w] |= mask;
        }
        // Freed under the lock: `take` sees the block either held or not allocated, never
        // allocated and free to take (a peer naming it now is refused).
        self.clear(first, n);
    }

    /// Receiver: ends a trim epoch. Free blocks whose pages may be resident and that no tensor
    /// delivered here used (or released) in this epoch or the one before are claimed (as a
    /// sender claims them: no sender writes them meanwhile, and `take` refuses them), their
    /// pages punched out of the file, and then freed. Returns the blocks given back. A punch
    /// the kernel refuses is logged once, and trims stop.
    pub fn trim(&self) -> usize {
        let claimed: Vec<(usize, u64)> = {
            let mut guard = self.received.lock().unwrap_or_else(PoisonError::into_inner);
            let r = &mut *guard;
            if r.refused {
                return 0;
            }
            let mut claimed = Vec::new();
            for w in 0..r.held.len() {
                let idle = r.resident[w] & !r.seen[0][w] & !r.seen[1][w] & !r.held[w];
                if idle == 0 {
                    continue;
                }
                let word = self.bits(w);
                let mut cur = word.load(Ordering::Acquire);
                while idle & !cur != 0 {
                    match word.compare_exchange_weak(cur, cur | (idle & !cur), Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => {
                            let mine = idle & !cur;
                            r.held[w] |= mine;
                            claimed.push((w, mine));
                            break;
                        }
                        Err(now) => cur = now,
                    }
                }
            }
            let [now, before] = &mut r.seen;
            std::mem::swap(now, before);
            now.fill(0);
            claimed
        };
        // Punched outside the lock (it unmaps the pages from every sender's page tables too),
        // one call per run of adjacent blocks; the blocks of runs punched are no longer
        // resident.
        let mut given_back = vec![0u64; claimed.last().map_or(0, |&(w, _)| w + 1)];
        let mut refused = false;
        let mut punch = |(b0, b1): (usize, usize)| {
            if refused {
                return;
            }
            match self.release_pages(b0, b1) {
                Ok(()) => {
                    for (w, mask) in Self::masks(b0, b1 - b0) {
                        given_back[w] |= mask;
                    }
                }
                Err(e) => {
                    tracing::warn!("segment pages cannot be given back (no more trims): {e}");
                    refused = true;
                }
            }
        };
        let mut run: Option<(usize, usize)> = None;
        for &(w, mask) in &claimed {
            let mut bits = mask;
            while bits != 0 {
                let b = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                run = match run {
                    Some((b0, b1)) if b1 == b => Some((b0, b + 1)),
                    Some(r) => {
                        punch(r);
                        Some((b, b + 1))
                    }
                    None => Some((b, b + 1)),
                };
            }
        }
        if let Some(r) = run {
            punch(r);
        }
        let mut r = self.received.lock().unwrap_or_else(PoisonError::into_inner);
        r.refused |= refused;
        for &(w, mask) in &claimed {
            r.held[w] &= !mask;
            r.resident[w] &= !given_back[w];
            // Freed under the lock, as in `release`.
            self.bits(w).fetch_and(!mask, Ordering::AcqRel);
        }
        given_back.iter().map(|m| m.count_ones() as usize).sum()
    }

    /// Gives the pages of blocks `b0..b1` back to the kernel.
    fn release_pages(&self, b0: usize, b1: usize) -> std::io::Result<()> {
        #[cfg(test)]
        if self.refuse_punches.load(Ordering::Relaxed) {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
        self.file.release_pages(self.data + b0 * BLOCK, (b1 - b0) * BLOCK)
    }

    /// Receiver: bytes of the segment backed by memory now.
    pub fn resident_bytes(&self) -> u64 {
        self.file.resident_bytes()
    }

    /// Blocks currently allocated (for tests and statistics).
    pub fn blocks_in_use(&self) -> usize {
        (0..self.blocks.div_ceil(64))
            .map(|w| self.bits(w).load(Ordering::Acquire).count_ones() as usize)
            .sum()
    }
}

/// A received tensor's blocks, freed when the last `Bytes` over them drops.
struct Lease {
    seg: Arc<Segment>,
    first: usize,
    n: usize,
    len: usize,
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the range lies in the data area (checked in `take`) and its blocks stay
        // allocated while this lease lives, so the sender does not write them; the mapping lives
        // as long as `seg`.
        unsafe { std::slice::from_raw_parts(self.seg.file.as_ptr().add(self.seg.data + self.first * BLOCK), self.len) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.seg.release(self.first, self.n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(bytes: usize) -> (Arc<Segment>, Arc<Segment>) {
        // Trimmed only where a test calls `trim`.
        let inbox = Segment::create_trimmed_every(bytes, None).unwrap();
        let outbox = Segment::open(std::process::id(), inbox.offer()).unwrap();
        (outbox, inbox)
    }

    /// Kilobytes of the mapping that starts at `at` present in this process's page tables
    /// (its `Rss:` line in `/proc/self/smaps`).
    fn mapped_kib(at: *const u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{:x}-", at as usize);
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start)).skip(1);
        let rss = lines.find(|l| l.starts_with("Rss:")).expect("the mapping's Rss line");
        rss.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    #[test]
    fn a_sender_maps_in_the_blocks_it_writes_and_only_those() {
        let (tx, rx) = pair(64 * BLOCK);
        // A kernel before 5.14 (or a sandbox) lacks the call: the pages fault in as before.
        if let Err(e) = tx.file.populate_write(tx.file.len() - BLOCK, BLOCK) {
            sluice_cuda::gate::skipped(
                "a_sender_maps_in_the_blocks_it_writes_and_only_those",
                format!("MADV_POPULATE_WRITE: {e}"),
            );
            return;
        }
        let block = vec![7u8; BLOCK];
        let before_kib = mapped_kib(tx.file.as_ptr());
        // Blocks 0, 1 and 3: the first two mapped in with one call, the third with another.
        let at: Vec<u64> = (0..4).map(|_| tx.allocate(BLOCK).unwrap()).collect();
        tx.unreserve(at[2], BLOCK);
        for a in [at[0], at[1], at[3]] {
            tx.write(a, &block);
        }
        let mapped: Vec<usize> = (0..tx.blocks).filter(|&b| tx.is_mapped(b)).collect();
        assert_eq!(mapped, [0, 1, 3], "marked mapped in: the blocks written");
        // Only those: the rest of the segment stays out of this sender's page tables (every
        // sender of a receiver maps its segment on its own). The faults the mapping-in takes
        // are counted as this thread's too, so the page tables tell, not the fault count.
        let kib = |blocks: u64| blocks * BLOCK as u64 / 1024;
        let grew = mapped_kib(tx.file.as_ptr()) - before_kib;
        assert_eq!(grew, kib(3), "mapped in: three 64 KiB blocks");
        // The mapping-in itself puts pages in the page tables, with no write at all (the writes
        // above would have faulted their pages in without it).
        tx.populate(10, 2);
        let grew = mapped_kib(tx.file.as_ptr()) - before_kib;
        assert_eq!(grew, kib(5), "two blocks more mapped in, unwritten");
        assert_eq!(&rx.take(at[0], BLOCK as u64).unwrap()[..], &block[..]);
    }

    #[test]
    fn a_sender_uses_the_blocks_it_has_mapped_in_first() {
        let (tx, rx) = pair(64 * BLOCK);
        let other = Segment::open(std::process::id(), rx.offer()).unwrap();
        let block = vec![1u8; BLOCK];
        // Six single blocks; only the last is written (mapped in); all given back.
        let singles: Vec<u64> = (0..6).map(|_| tx.allocate(BLOCK).unwrap()).collect();
        assert_eq!(singles[5], 5 * BLOCK as u64);
        tx.write(singles[5], &block);
        for &at in &singles {
            tx.unreserve(at, BLOCK);
        }
        assert_eq!(
            tx.allocate(BLOCK),
            Some(5 * BLOCK as u64),
            "the block it mapped in, not block 0"
        );
        assert_eq!(
            other.allocate(BLOCK),
            Some(0),
            "another sender, nothing mapped in: the lowest"
        );
        // Runs likewise: the lower of two runs was written; given back, it is taken again.
        let top = tx.allocate(2 * BLOCK).unwrap();
        let lower = tx.allocate(2 * BLOCK).unwrap();
        assert_eq!(top, lower + 2 * BLOCK as u64);
        tx.write(lower, &[block.clone(), block.clone()].concat());
        tx.unreserve(top, 2 * BLOCK);
        tx.unreserve(lower, 2 * BLOCK);
        assert_eq!(tx.allocate(2 * BLOCK), Some(lower), "the run it mapped in, not the top");
        assert_eq!(tx.allocate(2 * BLOCK), Some(top), "then the highest free");
    }

    /// Sends `len` bytes of `fill` from `tx` and takes them at `rx`.
    fn deliver(tx: &Segment, rx: &Arc<Segment>, len: usize, fill: u8) -> Bytes {
        let at = tx.allocate(len).unwrap();
        tx.write(at, &vec![fill; len]);
        rx.take(at, len as u64).unwrap()
    }

    /// A receiver gives back the pages of blocks no delivered tensor used in the current or the
    /// previous epoch; blocks used since, and blocks a tensor still holds, keep theirs; a block
    /// given back is written and delivered again like any other.
    #[test]
    fn idle_blocks_give_their_pages_back_and_recent_ones_keep_theirs() {
        let (tx, rx) = pair(64 * BLOCK);
        // The header's page(s).
        let header = rx.resident_bytes();
        let deliver = |len: usize, fill: u8| deliver(&tx, &rx, len, fill);
        let kept = deliver(BLOCK, 9);
        // Eight singles (blocks 1 to 8) and a run of four (from the top), held at once.
        let mut held: Vec<Bytes> = (0..8).map(|i| deliver(BLOCK, i)).collect();
        held.push(deliver(4 * BLOCK, 1));
        drop(held);
        assert_eq!(rx.resident_bytes(), header + 13 * BLOCK as u64, "13 blocks written");
        assert_eq!(rx.trim(), 0, "all used in this epoch");
        assert_eq!(rx.trim(), 0, "all used in the previous epoch");
        let recent = deliver(2 * BLOCK, 5);
        drop(recent);
        assert_eq!(
            rx.trim(),
            12 - 2,
            "idle for two epochs: the singles and the run, less the two reused"
        );
        assert_eq!(
            rx.resident_bytes(),
            header + 3 * BLOCK as u64,
            "left: the held block and the two used last epoch"
        );
        assert_eq!(tx.blocks_in_use(), 1, "claimed for the trim, then freed");
        assert!(kept.iter().all(|&b| b == 9), "a held tensor is never trimmed");
        // Given back, blocks are taken and written as before (fresh pages, zero-filled, then
        // written by the sender).
        for fill in 20..30 {
            let got = deliver(3 * BLOCK, fill);
            assert!(got.iter().all(|&b| b == fill));
        }
        assert_eq!(tx.trim(), 0, "a sender's view of a segment trims nothing");
    }

    /// A kernel that refuses to punch (a sandbox, an old kernel): the blocks a trim claimed are
    /// freed again, nothing is given back, later trims do nothing, and the segment carries on.
    #[test]
    fn a_refused_punch_frees_what_it_claimed_and_stops_trims() {
        let (tx, rx) = pair(16 * BLOCK);
        let header = rx.resident_bytes();
        let deliver = |len: usize, fill: u8| deliver(&tx, &rx, len, fill);
        let held = deliver(BLOCK, 7);
        drop((0..4).map(|i| deliver(BLOCK, i)).collect::<Vec<_>>());
        let written = rx.resident_bytes();
        assert_eq!(written, header + 5 * BLOCK as u64, "five blocks written");
        assert_eq!((rx.trim(), rx.trim()), (0, 0), "used in this epoch and the one before");
        rx.refuse_punches.store(true, Ordering::Relaxed);
        assert_eq!(rx.trim(), 0, "refused: nothing given back");
        assert_eq!(tx.blocks_in_use(), 1, "the blocks claimed for the punch are free again");
        assert_eq!(rx.resident_bytes(), written, "no page went back");
        // The kernel would now allow it, but trims have stopped.
        rx.refuse_punches.store(false, Ordering::Relaxed);
        for _ in 0..3 {
            assert_eq!(rx.trim(), 0, "trims stopped after the refusal");
        }
        assert_eq!(rx.resident_bytes(), written);
        // Delivery goes on as before, into the blocks that were claimed and freed.
        for fill in 10..20 {
            let got = deliver(4 * BLOCK, fill);
            assert!(got.iter().all(|&b| b == fill));
        }
        assert!(held.iter().all(|&b| b == 7), "a held tensor is untouched");
    }

    /// Senders in two threads keep writing, and a receiver keeps checking, tensors of one to
    /// three blocks, while another thread trims as fast as it can: every tensor arrives intact
    /// (a trim never punches a block a sender has claimed or a tensor holds), and nothing
    /// deadlocks (the watchdog).
    #[test]
    fn trims_racing_senders_never_touch_a_block_in_use() {
        let (tx, rx) = pair(32 * BLOCK);
        let other = Segment::open(std::process::id(), rx.offer()).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let trimmer = {
            let (rx, stop) = (rx.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut given_back = 0;
                while !stop.load(Ordering::Relaxed) {
                    given_back += rx.trim();
                }
                given_back
            })
        };
        let senders: Vec<_> = [tx, other]
            .into_iter()
            .enumerate()
            .map(|(t, tx)| {
                let (rx, done) = (rx.clone(), done_tx.clone());
                std::thread::spawn(move || {
                    for i in 0..3_000usize {
                        let len = (1 + (i + t) % 3) * BLOCK - i % 100;
                        // Never zero: a block punched under a tensor reads as zeros.
                        let fill = ((i * 7 + t) % 255 + 1) as u8;
                        let Some(at) = tx.allocate(len) else { continue };
                        tx.write(at, &vec![fill; len]);
                        let got = rx.take(at, len as u64).unwrap();
                        assert!(got.iter().all(|&b| b == fill), "sender {t}, tensor {i}");
                    }
                    done.send(()).unwrap();
                })
            })
            .collect();
        for _ in 0..2 {
            done_rx
                .recv_timeout(std::time::Duration::from_secs(120))
                .expect("a sender neither finished nor failed: a deadlock");
        }
        for s in senders {
            s.join().expect("every tensor intact");
        }
        stop.store(true, Ordering::Relaxed);
        let given_back = trimmer.join().unwrap();
        assert!(given_back > 0, "the trims gave pages back while the senders ran");
        assert_eq!(rx.blocks_in_use(), 0);
    }

    /// A receiver left idle after a burst still gives its pages back (its own thread trims it;
    /// nothing is released or delivered meanwhile), while a tensor it holds keeps its own, and
    /// the thread ends once the segment is dropped.
    #[test]
    fn an_idle_receiver_gives_its_last_burst_back() {
        let rx = Segment::create_trimmed_every(64 * BLOCK, Some(Duration::from_millis(50))).unwrap();
        let tx = Segment::open(std::process::id(), rx.offer()).unwrap();
        let header = rx.resident_bytes();
        let deliver = |len: usize, fill: u8| deliver(&tx, &rx, len, fill);
        let kept = deliver(BLOCK, 3);
        drop((0..10).map(|i| deliver(BLOCK, i + 10)).collect::<Vec<_>>());
        assert_eq!(rx.resident_bytes(), header + 11 * BLOCK as u64);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while rx.resident_bytes() > header + BLOCK as u64 {
            assert!(
                std::time::Instant::now() < deadline,
                "the idle burst was never given back: {} bytes resident",
                rx.resident_bytes()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(kept.iter().all(|&b| b == 3), "the held tensor kept its pages");
        let weak = Arc::downgrade(&rx);
        drop((kept, tx, rx));
        // The thread holds the segment only while it trims.
        while weak.strong_count() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the trimming thread keeps the segment alive"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_tensor_arrives_in_place_and_its_blocks_return_when_dropped() {
        let (tx, rx) = pair(1 << 20);
        let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let at = tx.allocate(data.len()).unwrap();
        tx.write(at, &data);
        let got = rx.take(at, data.len() as u64).unwrap();
        assert_eq!(&got[..], &data[..]);
        assert_eq!(tx.blocks_in_use(), 4);
        let copy = got.slice(10..20);
        drop(got);
        assert_eq!(tx.blocks_in_use(), 4, "a slice still holds the blocks");
        drop(copy);
        assert_eq!(tx.blocks_in_use(), 0);
        let again = tx.allocate(data.len()).unwrap();
        assert_eq!(again, at, "the same run is reused");
        assert_eq!(tx.allocate(1), Some(0), "single blocks come from the bottom");
        assert_eq!(at as usize + 4 * BLOCK, tx.capacity(), "longer runs from the top");
    }

    #[test]
    fn a_full_segment_refuses_and_recovers() {
        let (tx, rx) = pair(BLOCK * 5);
        let cap = tx.capacity();
        assert!(tx.allocate(cap + 1).is_none(), "larger than the segment");
        let a = tx.allocate(cap / 2).unwrap();
        assert!(tx.allocate(cap).is_none(), "no room while half is held");
        let t = rx.take(a, (cap / 2) as u64).unwrap();
        drop(t);
        assert_eq!(tx.allocate(cap), Some(0));
        let one = tx.allocate(1);
        assert!(one.is_none(), "full");
    }

    /// Several senders (threads here; processes behave the same through the shared file)
    /// allocate, fill and free at once: no block is ever handed to two of them.
    #[test]
    fn concurrent_senders_never_share_a_block() {
        let (tx, rx) = pair(4 << 20);
        let threads: Vec<_> = (0..4u8)
            .map(|id| {
                let (tx, rx) = (tx.clone(), rx.clone());
                std::thread::spawn(move || {
                    let mut seed = 0x2545_f491_4f6c_dd1du64 ^ id as u64;
                    for round in 0..2000u32 {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        let len = 1 + (seed % (BLOCK as u64 * 5)) as usize;
                        let Some(at) = tx.allocate(len) else { continue };
                        let fill = vec![id.wrapping_mul(31).wrapping_add(round as u8); len];
                        tx.write(at, &fill);
                        std::thread::yield_now();
                        let got = rx.take(at, len as u64).expect("a block handed out once is taken once");
                        assert!(
                            got.iter().all(|&b| b == fill[0]),
                            "another sender wrote into our blocks"
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(tx.blocks_in_use(), 0);
    }

    #[test]
    fn a_confused_peer_is_caught() {
        let (tx, rx) = pair(1 << 20);
        let at = tx.allocate(100).unwrap();
        assert!(rx.take(at + 1, 10).is_err(), "unaligned");
        assert!(rx.take(BLOCK as u64 * 3, 10).is_err(), "never allocated");
        assert!(rx.take(0, u64::MAX).is_err(), "absurd length");
        assert!(rx.take(u64::MAX - 5, 1).is_err(), "absurd offset");
        let held = rx.take(at, 100).unwrap();
        assert!(rx.take(at, 100).is_err(), "already delivered");
        drop(held);
    }

    #[test]
    fn a_file_that_is_not_a_segment_is_refused() {
        let f = SharedFile::create("not-a-segment", 1 << 20).unwrap();
        let offer = SegmentOffer {
            fd: f.raw_fd(),
            bytes: 1 << 20,
        };
        assert!(Segment::open(std::process::id(), offer).is_err());
        let wrong = SegmentOffer {
            fd: f.raw_fd(),
            bytes: 2 << 20,
        };
        assert!(Segment::open(std::process::id(), wrong).is_err(), "size differs");
    }
}
