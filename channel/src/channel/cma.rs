//! The cma channel, for CPU tensors between two processes of one host, and cross-memory
//! attach, its fallback.
//!
//! Data path, by size (the sender chooses; the descriptor says which, see [`prepare`]):
//! - below [`INLINE_MAX`]: inline, one frame on the control connection (a frame copy on each
//!   side costs less than a segment block or a system call and an acknowledgement);
//! - when it fits: copied into the receiver's shared segment (see [`super::segment`]) before
//!   the descriptor leaves, and handed to the receiver where it lies: one copy, no
//!   acknowledgement, any number in flight;
//! - otherwise by cross-memory attach: the receiver reads the tensor straight out of the
//!   sender's address space with `process_vm_readv` and acknowledges.
//!
//! Requirements, checked when the context is created: the kernel call exists and is not blocked
//! (a self-test read of our own memory; some container seccomp profiles forbid it), and Yama's
//! `ptrace_scope` allows it (scope 1 is relaxed with `PR_SET_PTRACER_ANY`; scopes 2 and 3
//! make the channel not viable). The descriptor holds the boot id, the PID and user namespaces
//! and the uid/gid, so only processes that can read each other compare equal. Because
//! permission ultimately depends on the actual peer, pipe setup also reads a probe in the
//! peer's memory before CMA is chosen.

use std::io;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

use super::path::{Link, Received, Rx, Staging, Tx};
use super::segment::Segment;
use super::{ChannelContext, ChannelKind};
use crate::device::{Device, RecvBuffer};
use crate::wire::Source;

type PipeResult<T> = crate::error::Result<T>;

/// Tensors below this go inline through the control connection. Kept small: every byte
/// through a pipe's ring eventually touches all of the ring's pages.
pub const INLINE_MAX: usize = 4 << 10;

/// Tensors at least this long are copied by CMA on a blocking thread rather than inline.
const CMA_OFFLOAD: usize = 1 << 20;

/// Copies into the peer's segment at least this large let the runtime move this worker's other
/// tasks elsewhere while they run.
const COPY_OFFLOAD: usize = 8 << 20;

/// Bytes the peer reads from us to prove it may.
static PROBE: [u8; 16] = *b"sluice-cma-probe";

/// The address of this process's probe, for the brochure.
pub fn probe_address() -> u64 {
    PROBE.as_ptr() as u64
}

/// Largest piece read in one system call.
const MAX_PIECE: usize = 1 << 30;

/// Reads at least this long are split across threads, one piece per core (at most
/// [`MAX_THREADS`]): one thread's copy leaves the other cores idle while the sender waits for
/// the acknowledgement, and the kernel copy (with its page pinning) runs below memory speed.
const PARALLEL_MIN: usize = 16 << 20;

/// The most threads one read is split across.
const MAX_THREADS: usize = 4;

/// As [`read_remote`], split into one piece per core for large reads (pieces of whole pages,
/// each on its own thread; the first error wins).
pub fn read_remote_parallel(pid: i32, address: u64, dst: &mut [u8]) -> io::Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(MAX_THREADS);
    if dst.len() < PARALLEL_MIN || threads < 2 {
        return read_remote(pid, address, dst);
    }
    let piece = dst.len().div_ceil(threads).next_multiple_of(4096);
    std::thread::scope(|s| {
        let mut pieces = dst.chunks_mut(piece).enumerate();
        // This thread reads the first piece itself; the others get a thread each.
        let (_, first) = pieces.next().expect("a non-empty read");
        let others: Vec<_> = pieces
            .map(|(i, chunk)| s.spawn(move || read_remote(pid, address + (i * piece) as u64, chunk)))
            .collect();
        let mine = read_remote(pid, address, first);
        others
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(io::Error::other("a copy thread panicked")))
            })
            .fold(mine, |acc, r| acc.and(r))
    })
}

/// Copies `dst.len()` bytes from `address` in process `pid` into `dst`.
pub fn read_remote(pid: i32, address: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let len = (dst.len() - done).min(MAX_PIECE);
        let remote = [RemoteIoVec {
            base: (address as usize).wrapping_add(done),
            len,
        }];
        let mut local = [io::IoSliceMut::new(&mut dst[done..done + len])];
        let n = process_vm_readv(Pid::from_raw(pid), &mut local, &remote)
            .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv read nothing",
            ));
        }
        done += n;
    }
    Ok(())
}

/// Huge pages are this long (x86-64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Backs the whole huge pages inside `buf` with huge pages now, so that a peer's
/// `process_vm_readv` of it pins one page per 2 MiB instead of one per 4 KiB (the kernel pins
/// every page it copies; with 4 KiB pages that costs more than the copy: measured here, 32 MiB
/// read in 256 KiB pieces took 8.4 ms from 4 KiB pages, 2.6 ms from huge ones). Costs a copy
/// of the range once (about 2 ms per MiB here), so it pays only for buffers read again and
/// again. An error (an older kernel, no huge page free) changes nothing.
pub fn collapse_huge_pages(buf: &[u8]) -> io::Result<()> {
    let start = (buf.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (buf.as_ptr() as usize + buf.len()) / HUGE_PAGE * HUGE_PAGE;
    if end <= start {
        return Ok(());
    }
    crate::sys::collapse_huge(start, end - start)
}

/// Whether this process may read process `pid`'s probe at `address`.
pub fn probe_peer(pid: i32, address: u64) -> Result<(), String> {
    let mut got = [0u8; 16];
    read_remote(pid, address, &mut got).map_err(|e| format!("cannot read process {pid}'s memory: {e}"))?;
    if got != PROBE {
        return Err(format!("process {pid}'s probe holds unexpected bytes"));
    }
    Ok(())
}

fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The CMA channel's context.
pub struct CmaContext {
    descriptor: Result<String, String>,
}

impl CmaContext {
    pub fn new() -> Self {
        CmaContext {
            descriptor: Self::probe(),
        }
    }

    fn probe() -> Result<String, String> {
        match ptrace_scope() {
            None | Some(0) => {}
            Some(1) => crate::sys::allow_any_ptracer()
                .map_err(|e| format!("Yama ptrace_scope is 1 and PR_SET_PTRACER failed: {e}"))?,
            Some(n) => {
                return Err(format!(
                    "Yama ptrace_scope is {n}: processes may not read each other's memory"
                ))
            }
        }
        probe_peer(std::process::id() as i32, probe_address())
            .map_err(|e| format!("self-test failed ({e}); is process_vm_readv blocked by seccomp?"))?;
        let identity =
            sluice_transport::host::identity(&["pid", "user"]).ok_or("cannot read the boot id or namespaces")?;
        Ok(format!(
            "cma;{identity};uid={};gid={}",
            nix::unistd::getuid(),
            nix::unistd::getgid()
        ))
    }
}

impl Default for CmaContext {
    fn default() -> Self {
        Self::new()
    }
}

impl ChannelContext for CmaContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Cma
    }

    fn viability(&self) -> Result<(), String> {
        self.descriptor.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        match &self.descriptor {
            Ok(d) => vec![(Device::Cpu, d.clone())],
            Err(_) => Vec::new(),
        }
    }
}

/// Blocks of the peer's segment reserved for one message: given back if the message is never
/// announced (a failed or cancelled write), kept once its descriptor went out.
pub(crate) struct Reserved {
    segment: Arc<Segment>,
    ranges: Vec<(u64, Bytes)>,
    pub(crate) announced: bool,
}

impl Reserved {
    /// Copies every reserved tensor into the segment.
    fn copy(&self) {
        for (offset, bytes) in &self.ranges {
            self.segment.write(*offset, bytes);
        }
    }

    fn bytes(&self) -> usize {
        self.ranges.iter().map(|(_, b)| b.len()).sum()
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if !self.announced {
            for (offset, bytes) in &self.ranges {
                self.segment.unreserve(*offset, bytes.len());
            }
        }
    }
}

/// Sender: where a tensor goes: inline when small, into the peer's segment when it fits
/// (reserving its blocks for the message), else by cross-memory attach.
pub(crate) fn prepare(tx: &Tx, b: &Bytes, staging: &mut Staging) -> Source {
    if b.len() < INLINE_MAX {
        return Source::Inline;
    }
    if let Some(seg) = &tx.outbox {
        if let Some(offset) = seg.allocate(b.len()) {
            staging
                .reserved
                .get_or_insert_with(|| Reserved {
                    segment: seg.clone(),
                    ranges: Vec::new(),
                    announced: false,
                })
                .ranges
                .push((offset, b.clone()));
            return Source::Segment { offset };
        }
    }
    Source::Cma {
        address: b.as_ptr() as u64,
    }
}

/// Sender: copies a message's tensors into the peer's segment before it hears of them. In
/// place (a thread hand-off costs more than copying a few MiB), and for large copies on a
/// multi-thread runtime with the worker's other tasks moved elsewhere meanwhile. On a
/// current-thread runtime a large copy runs on a blocking thread, which keeps the reservation
/// until it is done (even if the write is cancelled meanwhile).
pub(crate) async fn copy_reserved(r: Reserved, link: &Link<'_>) -> PipeResult<Reserved> {
    if r.bytes() < COPY_OFFLOAD {
        r.copy();
        return Ok(r);
    }
    let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
    if matches!(flavor, Ok(tokio::runtime::RuntimeFlavor::MultiThread)) {
        tokio::task::block_in_place(|| r.copy());
        return Ok(r);
    }
    tokio::task::spawn_blocking(move || {
        r.copy();
        r
    })
    .await
    .map_err(|e| link.channel_error(ChannelKind::Cma, format!("segment copy thread failed: {e}")))
}

/// Receiver: the sources the cma channel produces (a segment only where this pipe has one).
pub(crate) fn accepts(has_inbox: bool, source: &Source) -> bool {
    match source {
        Source::Inline | Source::Cma { .. } => true,
        Source::Segment { .. } => has_inbox,
        _ => false,
    }
}

/// Receiver: a tensor in this side's segment, handed over where the sender put it (nothing to
/// copy); it replaces the buffer supplied.
pub(crate) fn take(rx: &Rx, link: &Link<'_>, offset: u64, len: u64, buffer: &mut RecvBuffer) -> PipeResult<Received> {
    let inbox = rx
        .inbox
        .as_ref()
        .ok_or_else(|| link.protocol("tensor announced in a segment this pipe does not have"))?;
    let bytes = inbox.take(offset, len).map_err(|e| link.protocol(e))?;
    *buffer = RecvBuffer::Shared(bytes);
    Ok(Received::Done)
}

/// Receiver: reads a tensor out of the sender's memory (acknowledged by the pipe).
pub(crate) async fn recv(link: &Link<'_>, address: u64, dst: &mut BytesMut) -> PipeResult<()> {
    cma_read(link.pid as i32, address, dst)
        .await
        .map_err(|detail| link.channel_error(ChannelKind::Cma, detail))
}

async fn cma_read(pid: i32, address: u64, dst: &mut BytesMut) -> Result<(), String> {
    if dst.len() < CMA_OFFLOAD {
        return read_remote(pid, address, dst).map_err(|e| e.to_string());
    }
    // A large copy would stall this runtime thread for milliseconds: run it on a blocking
    // thread, lending it the buffer.
    let mut buf = std::mem::take(dst);
    let (buf, result) = tokio::task::spawn_blocking(move || {
        let r = read_remote_parallel(pid, address, &mut buf);
        (buf, r)
    })
    .await
    .map_err(|e| format!("copy thread failed: {e}"))?;
    *dst = buf;
    result.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_pages_keep_what_the_memory_holds() {
        let mut v: Vec<u8> = (0..(8usize << 20)).map(|i| (i * 7 + i / 4096) as u8).collect();
        let before = v.clone();
        if let Err(e) = collapse_huge_pages(&v) {
            // Kernels before 6.1 do not know MADV_COLLAPSE; THP may be off or memory short.
            eprintln!("SKIPPED: MADV_COLLAPSE not available here: {e}");
        }
        assert!(v == before, "collapsing changed the bytes");
        v[12345] ^= 1;
        assert_ne!(v, before, "the memory is still ours to write");
        // Shorter than a huge page: nothing to do, not an error.
        collapse_huge_pages(&v[..4096]).unwrap();
        collapse_huge_pages(&[]).unwrap();
    }

    #[test]
    fn a_large_read_split_across_threads_is_every_byte_in_place() {
        // From this process's own memory (the self-test the context runs too).
        let len = PARALLEL_MIN * 2 + 12_345; // pieces of whole pages and a short last one
        let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ (i >> 16) as u8).collect();
        let mut dst = vec![0u8; len];
        read_remote_parallel(std::process::id() as i32, src.as_ptr() as u64, &mut dst).unwrap();
        if let Some(i) = dst.iter().zip(&src).position(|(a, b)| a != b) {
            panic!("byte {i} of {len} differs");
        }
        // An address that is not mapped is an error, not a short read passed off as whole.
        let e = read_remote_parallel(std::process::id() as i32, 8, &mut dst).unwrap_err();
        assert_ne!(e.raw_os_error(), None, "{e}");
    }
}
