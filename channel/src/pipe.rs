//! The pipe: one ordered, bidirectional lane of messages between two processes, over the
//! transport and channels negotiated when it opened (see [`crate::context`]).
//!
//! Contracts:
//! - **Two-step receive.** [`Pipe::read_descriptor`] yields what the next message holds;
//!   [`Pipe::read`] then takes the memory it should land in and fills it in place. Until the
//!   receiver asks for a descriptor, nothing more is read, so a slow receiver stops its sender
//!   (backpressure through the transport).
//! - **Ordering.** Writes complete in the order they were issued, reads likewise (each side
//!   runs under a fair lock, one operation at a time).
//! - **A write completes when its buffers may be reused**: frames handed to the transport,
//!   lanes drained, and for CMA and rdma the receiver's acknowledgement received. So such a write waits
//!   until the peer has *read* the message: do not await a write and then, on the same task,
//!   the read the peer's reply depends on being made by this side. If a write is
//!   cancelled while the peer may still be reading its memory, the pipe keeps the buffers alive
//!   until it is dropped.
//! - **CUDA tensors are stream-ordered.** A sender's data is read only after the work already
//!   queued on its buffer's stream. For cuda_ipc and cuda_p2p, the receiver's `read` completes
//!   once its copy is *queued* on its buffer's stream (work queued there later sees the data);
//!   the sender's `write` completes once the sender's stream has been made to wait for the
//!   receiver's copy (work queued there later, such as overwriting the buffer, runs after the
//!   copy; host code that frees the memory must synchronize the stream first). For
//!   cuda_staged, the sender's write completes when every byte has left the GPU, and the
//!   receiver's read when every host-to-device copy is queued on its stream.
//! - **Targets.** A tensor goes to its `target_device` on the receiver. Without one, a CPU
//!   tensor goes to the receiver's CPU, and a CUDA tensor to the receiver's device on the same
//!   GPU when cuda_ipc connects them, otherwise to the receiver's CPU; the descriptor then
//!   names the target chosen.
//! - **Sticky errors.** The first failure closes every connection of the pipe; every pending and
//!   later operation fails with that same error. [`Pipe::read`] hands the allocation back even
//!   then. Misuse (reading without a descriptor, a wrong allocation) is reported without
//!   breaking the pipe.
//!
//! - **Small messages are one frame.** A message whose payloads and inline tensors total at
//!   most [`PACK_MAX`] travels packed after its descriptor (see [`WireDescriptor`]); the reader
//!   keeps the frame in a buffer it reuses and copies those bytes out of it in `read`. The
//!   descriptor is encoded from the message into a reused buffer, never built as a value.
//!
//! How each tensor's bytes move is its channel's business (`channel::path` dispatches to the
//! channel's module); the pipe keeps ordering, acknowledgements and sticky errors.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use sluice_transport::any::{AnyReader, AnyWriter};
use sluice_transport::ibv::RdmaHandle;
use sluice_transport::{Closer, FrameReader, FrameWriter};
use smallvec::SmallVec;
use tokio::sync::Mutex;

use crate::channel::path::{self, Link, Received, Rx, Staging, Tx};
use crate::channel::rdma::RegCache;
use crate::channel::segment::Segment;
use crate::channel::ChannelKind;
use crate::cuda::ipc;
use crate::device::{Device, SendBuffer};
use crate::error::{PipeError, Result};
use crate::message::{Allocation, Descriptor, Message, TensorDescriptor};
use crate::wire::{
    self, Ack, ByteSlice, DescriptorOut, Lengths, Source, TensorOut, WireDescriptor, WireTensor, PACK_MAX,
};

/// A cma pipe's shared segments: the one this side receives into, and the peer's, which this
/// side sends into (see [`crate::channel::segment`]).
#[derive(Default)]
pub(crate) struct Segments {
    pub(crate) inbox: Option<Arc<Segment>>,
    pub(crate) outbox: Option<Arc<Segment>>,
}

/// A writer's place in the queue for the write lock (see [`Pipe::write`]).
struct Queued<'a>(Option<&'a Pipe>);

impl Queued<'_> {
    /// The lock is taken: no longer queued.
    fn leave(mut self) {
        if let Some(pipe) = self.0.take() {
            pipe.inner.queued.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Queued<'_> {
    /// A writer that gave up while queued: if it was the last in the queue and frames are
    /// held for it, a task sends them.
    fn drop(&mut self) {
        let Some(pipe) = self.0.take() else { return };
        let last = pipe.inner.queued.fetch_sub(1, Ordering::SeqCst) == 1;
        if last && pipe.inner.held.load(Ordering::SeqCst) {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let pipe = pipe.clone();
                handle.spawn(async move {
                    if pipe.inner.held.load(Ordering::SeqCst) && pipe.inner.queued.load(Ordering::SeqCst) == 0 {
                        let mut side = pipe.inner.writer.lock().await;
                        if pipe.inner.check().is_ok() {
                            let _ = pipe.flush_locked(&mut side).await;
                        }
                    }
                });
            }
        }
    }
}

/// The connections of one pipe, already split, as setup produced them.
pub(crate) struct Links {
    pub control: (AnyReader, AnyWriter),
    pub reply: (AnyReader, AnyWriter),
    pub lanes: Vec<(AnyReader, AnyWriter)>,
}

/// What negotiation decided, kept for the pipe's lifetime.
#[derive(Debug, Clone)]
pub struct PipeInfo {
    /// The peer's context name and address.
    pub peer: String,
    pub peer_pid: u32,
    /// The transport of the control connection (`"shm"`, `"tcp"`).
    pub transport: &'static str,
    /// The channel for CPU-to-CPU tensors.
    pub cpu_channel: ChannelKind,
    /// The channel for every (local device, remote device) pair negotiation could serve.
    pub channels: Vec<(Device, Device, ChannelKind)>,
    pub lanes: usize,
}

impl PipeInfo {
    /// The channel between a local and a remote device, if negotiation found one.
    pub fn channel(&self, local: Device, remote: Device) -> Option<ChannelKind> {
        self.channels
            .iter()
            .find(|(l, r, _)| *l == local && *r == remote)
            .map(|&(_, _, k)| k)
    }
}

/// A failed [`Pipe::read`]: the error, and the allocation handed back.
#[derive(Debug)]
pub struct ReadError {
    pub error: PipeError,
    pub allocation: Allocation,
}

impl From<ReadError> for PipeError {
    fn from(e: ReadError) -> Self {
        e.error
    }
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for ReadError {}

struct WriteSide {
    tx: Tx,
    acks: AnyReader,
    seq: u64,
    /// Sources the peer may still be reading (CMA, rdma, CUDA), cleared once acknowledged.
    exposed: Vec<SendBuffer>,
    /// The last descriptor's encoding (its capacity reused by the next).
    encoded: Vec<u8>,
}

struct ReadSide {
    rx: Rx,
    acks: AnyWriter,
    seq: u64,
    /// `descriptor` is the next message's, decoded and checked, waiting for its read.
    pending: bool,
    /// The pending message's descriptor (its metadata already handed to the reader). Every
    /// message's is decoded into this one in place: its lists keep their capacity (no list is
    /// allocated per message), and a message read at once is read from here, never moved.
    descriptor: WireDescriptor,
    /// A descriptor decoded by [`Pipe::try_read_message`] or
    /// [`Pipe::read_message_ready`] whose message it could not take at once (or whose
    /// allocation was declined): the next `read_descriptor` or `read_message` returns it.
    early: Option<Descriptor>,
    /// The last descriptor frame (its capacity reused by the next); a packed message's
    /// payloads and inline tensors are copied out of it, from `packed_at` on.
    frame: Vec<u8>,
    packed_at: usize,
}

impl ReadSide {
    /// The message taken from `descriptor` (no longer pending) is read: the next is expected,
    /// and the descriptor decoded into, unless a large message grew its lists (their memory is
    /// let go, as `frame`'s is past `FRAME_KEEP`).
    fn read_done(&mut self) {
        self.seq += 1;
        let d = &self.descriptor;
        if d.payloads.capacity() > LIST_KEEP || d.tensors.capacity() > LIST_KEEP {
            self.descriptor = WireDescriptor::default();
        }
    }
}

/// A descriptor frame buffer grown past this (by a large metadata) is let go rather than kept.
const FRAME_KEEP: usize = 1 << 20;
/// A read side's descriptor whose lists grew past this many entries is let go rather than kept.
const LIST_KEEP: usize = 1024;

struct Inner {
    info: PipeInfo,
    /// The peer's process token, and whether it is this process.
    peer_process: u64,
    same_process: bool,
    /// Whether this pipe is counted in the IPC caches (see `cuda::ipc`).
    ipc_counted: bool,
    max_descriptor: usize,
    /// Whether the control connection has the immediate paths (`try_write`,
    /// `try_read_message` are not even attempted otherwise).
    immediate: bool,
    failed: AtomicBool,
    /// Writes may be held in the transport (see [`Pipe::set_batching`]).
    batching: AtomicBool,
    /// Writes waiting for the write lock: a writer that sees one leaves its frames in the
    /// transport for the next writer to send with its own (see [`Pipe::write`]).
    queued: AtomicUsize,
    /// Frames are held in the control connection's writer, not yet sent.
    held: AtomicBool,
    error: OnceLock<PipeError>,
    closers: Vec<Closer>,
    /// One-sided RDMA on the control connection (when it is ibverbs).
    rdma: Option<RdmaHandle>,
    writer: Mutex<WriteSide>,
    reader: Mutex<ReadSide>,
}

impl Inner {
    fn check(&self) -> Result<()> {
        if self.failed.load(Ordering::Acquire) {
            return Err(self.error.get().cloned().unwrap_or(PipeError::Closed {
                peer: self.info.peer.clone(),
            }));
        }
        Ok(())
    }

    /// Records the pipe's first error, closes every connection, and returns the first error.
    fn fail(&self, error: PipeError) -> PipeError {
        if matches!(error, PipeError::Misuse(_)) {
            return error;
        }
        let _ = self.error.set(error);
        if !self.failed.swap(true, Ordering::AcqRel) {
            tracing::debug!(peer = %self.info.peer, error = %self.error.get().expect("set above"), "pipe failed");
            for c in &self.closers {
                c.close();
            }
        }
        self.error.get().cloned().expect("set above")
    }

    fn protocol(&self, detail: impl Into<String>) -> PipeError {
        PipeError::Protocol {
            peer: self.info.peer.clone(),
            detail: detail.into(),
        }
    }

    /// What the channels know of this pipe; `poison` is `|e| self.fail(e)`.
    fn link<'a>(&'a self, poison: &'a (dyn Fn(PipeError) -> PipeError + Send + Sync)) -> Link<'a> {
        Link {
            peer: &self.info.peer,
            pid: self.info.peer_pid,
            process: self.peer_process,
            same_process: self.same_process,
            rdma: self.rdma.as_ref(),
            poison,
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for c in &self.closers {
            c.close();
        }
        if self.ipc_counted {
            ipc::pipe_closed(self.peer_process);
        }
    }
}

/// A negotiated link to one peer. Cheap to clone; all clones are the same pipe.
#[derive(Clone)]
pub struct Pipe {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Pipe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipe").field("info", &self.inner.info).finish()
    }
}

impl Pipe {
    pub(crate) fn new(
        info: PipeInfo,
        links: Links,
        max_descriptor: usize,
        peer_process: u64,
        segments: Segments,
    ) -> Pipe {
        let ipc_counted = info.channels.iter().any(|c| c.2.is_direct_cuda());
        if ipc_counted {
            ipc::pipe_opened(peer_process);
        }
        let mut closers = vec![links.control.0.closer(), links.reply.0.closer()];
        closers.extend(links.lanes.iter().map(|(r, _)| r.closer()));
        let (lane_readers, lane_writers): (Vec<_>, Vec<_>) = links.lanes.into_iter().unzip();
        let rdma = links.control.1.rdma();
        let immediate = links.control.1.immediate();
        // Bounded: 256 registrations or 4 GiB of sent tensors kept registered (and alive).
        // Registrations pin memory: a quarter of the locked-memory limit at most.
        let pin_budget = |cap: usize| {
            rdma.as_ref().map_or(cap, |h| {
                cap.min((h.device().limits().memlock / 4).min(usize::MAX as u64) as usize)
            })
        };
        let registrations = rdma
            .as_ref()
            .map(|h| RegCache::new(h.device(), 256, pin_budget(4 << 30)));
        // GPU registrations use BAR space: fewer of them.
        let gpu_cache = || {
            rdma.as_ref()
                .map(|h| RegCache::new(h.device(), 64, pin_budget(16 << 30)))
        };
        let (gpu_registrations, gpu_targets) = (gpu_cache(), gpu_cache());
        // Received CPU tensors land in registered chunks recycled across reads.
        let landing = rdma
            .as_ref()
            .map(|h| crate::channel::rdma::RecvPool::new(h.device(), pin_budget(1 << 30)));
        Pipe {
            inner: Arc::new(Inner {
                info,
                peer_process,
                same_process: peer_process == crate::channel::cuda::process_token(),
                ipc_counted,
                max_descriptor,
                immediate,
                failed: AtomicBool::new(false),
                batching: AtomicBool::new(false),
                queued: AtomicUsize::new(0),
                held: AtomicBool::new(false),
                error: OnceLock::new(),
                closers,
                rdma,
                writer: Mutex::new(WriteSide {
                    tx: Tx {
                        control: links.control.1,
                        lanes: lane_writers,
                        outbox: segments.outbox,
                        registrations,
                        gpu_registrations,
                    },
                    acks: links.reply.0,
                    seq: 0,
                    exposed: Vec::new(),
                    encoded: Vec::new(),
                }),
                reader: Mutex::new(ReadSide {
                    rx: Rx {
                        control: links.control.0,
                        lanes: lane_readers,
                        inbox: segments.inbox,
                        gpu_targets,
                        landing,
                        held: Vec::new(),
                    },
                    acks: links.reply.1,
                    seq: 0,
                    pending: false,
                    descriptor: WireDescriptor::default(),
                    early: None,
                    frame: Vec::new(),
                    packed_at: 0,
                }),
            }),
        }
    }

    /// What negotiation chose.
    pub fn info(&self) -> &PipeInfo {
        &self.inner.info
    }

    /// Closes the pipe: pending and later operations fail with [`PipeError::Closed`]; the peer
    /// sees the pipe fail.
    pub fn close(&self) {
        self.inner.fail(PipeError::Closed {
            peer: self.inner.info.peer.clone(),
        });
    }

    /// The pipe's error, if it has failed.
    pub fn error(&self) -> Option<PipeError> {
        self.inner.check().err()
    }

    /// The negotiated channel between a local and a remote device.
    fn channel_for(&self, local: Device, remote: Device) -> Result<ChannelKind> {
        self.inner
            .info
            .channel(local, remote)
            .ok_or_else(|| PipeError::Negotiation {
                peer: self.inner.info.peer.clone(),
                reason: format!("no channel connects {local} here to {remote} there"),
            })
    }

    /// Where a tensor from `source` goes when the sender named no target (see the module
    /// docs); `None` keeps the descriptor's target empty (CPU to CPU).
    fn default_target(&self, source: Device) -> Option<Device> {
        match source {
            Device::Cpu => None,
            gpu => Some(
                self.inner
                    .info
                    .channels
                    .iter()
                    .find(|&&(l, _, k)| l == gpu && k == ChannelKind::CudaIpc)
                    .map_or(Device::Cpu, |&(_, r, _)| r),
            ),
        }
    }

    /// Sends `message`. Completes, in issue order, once every buffer of the message may be
    /// reused. While the pipe [batches](Self::set_batching), the message may wait in the
    /// transport for a later write or flush.
    ///
    /// Writes queued behind one another coalesce: a writer that finds others waiting for the
    /// write lock leaves its frames in the transport, and the last of the queue sends them all
    /// with its own in one transport write. A queued writer that gives up (its future dropped)
    /// and leaves frames held with nobody behind them sends them from a task of its own.
    pub async fn write(&self, message: &Message) -> Result<()> {
        if let Some(written) = self.try_write(message) {
            return written;
        }
        let inner = &self.inner;
        inner.queued.fetch_add(1, Ordering::SeqCst);
        let queued = Queued(Some(self));
        let mut side = inner.writer.lock().await;
        queued.leave();
        inner.check()?;
        // Read under the write lock, so a write cannot miss the flush that ends a batch.
        let defer = inner.batching.load(Ordering::Acquire) || inner.queued.load(Ordering::SeqCst) > 0;
        let result = self.write_locked(&mut side, message, defer).await;
        if result.is_ok() && defer {
            // Whoever is queued sends these frames; should the queue have emptied meanwhile
            // (a waiter gave up), send them now. (Either this or the waiter's check sees
            // the other's write; both sending is harmless.)
            inner.held.store(true, Ordering::SeqCst);
            if inner.queued.load(Ordering::SeqCst) == 0 && !inner.batching.load(Ordering::Acquire) {
                return self.flush_locked(&mut side).await;
            }
        } else if result.is_ok() {
            inner.held.store(false, Ordering::SeqCst);
        }
        result.map_err(|e| inner.fail(e))
    }

    /// Sends a small message at once, with no future, if nothing stands in its way; `None`
    /// (nothing sent) when it needs [`write`](Self::write): a tensor that does not travel
    /// inline in the message's frame (on a GPU, or too large for its channel's inline path),
    /// more than one packed frame of payloads and tensors, another write holding or waiting
    /// for the write side, or a transport that would have to wait (a full ring; TCP always).
    /// Sent, it keeps `write`'s order and completion, and, while the pipe batches, stays in the
    /// transport like `write`'s.
    pub fn try_write(&self, message: &Message) -> Option<Result<()>> {
        if !self.inner.immediate {
            return None;
        }
        // Every tensor must be one the message's frame carries (a small CPU tensor on a
        // channel that sends it inline, or an empty one); anything else, or a tensor with no
        // channel (reported by `write`), takes the general path.
        // `new` (not `with_capacity`, an out-of-line call whose result is moved: a copy of
        // the whole inline array, hundreds of bytes, on every message) builds them in place.
        let mut sources: SmallVec<[&'static Source; 4]> = SmallVec::new();
        let mut targets: SmallVec<[Option<Device>; 4]> = SmallVec::new();
        let mut packed_len = message.payloads.iter().map(|p| p.len()).sum::<usize>();
        for t in &message.tensors {
            let source = t.buffer.device();
            let target = t.target_device.or_else(|| self.default_target(source));
            let channel = self.channel_for(source, target.unwrap_or(source)).ok()?;
            sources.push(path::immediate(channel, &t.buffer)?);
            targets.push(target);
            packed_len += t.buffer.len();
        }
        if packed_len > PACK_MAX {
            return None;
        }
        let inner = &self.inner;
        // Fails while another write holds the lock or waits for it (tokio's lock is fair):
        // this one never overtakes a queued write.
        let mut side = inner.writer.try_lock().ok()?;
        if let Err(e) = inner.check() {
            return Some(Err(e));
        }
        // Read under the write lock, as `write` does: a batch ended after this read is
        // flushed by whoever ends it, once this lock is released.
        let defer = inner.batching.load(Ordering::Acquire);
        let side = &mut *side;
        let mut encoded = std::mem::take(&mut side.encoded);
        {
            let mut tensors = SmallVec::new();
            tensors_out(&mut tensors, message, sources.iter().copied(), &targets);
            wire::encode_descriptor(
                &DescriptorOut {
                    seq: side.seq,
                    metadata: ByteSlice(&message.metadata),
                    payloads: Lengths(&message.payloads),
                    tensors: &tensors,
                    packed: true,
                },
                &mut encoded,
            );
        }
        let result = {
            let mut parts: SmallVec<[&[u8]; 8]> = SmallVec::new();
            parts.push(&encoded);
            parts.extend(message.payloads.iter().map(|p| &p[..]));
            for (t, data) in message.tensors.iter().zip(&sources) {
                if let (Source::Inline, SendBuffer::Cpu(b)) = (*data, &t.buffer) {
                    parts.push(b);
                }
            }
            side.tx.control.try_write_now(&parts, !defer)
        };
        side.encoded = encoded;
        match result? {
            Ok(()) => {
                side.seq += 1;
                inner.held.store(defer, Ordering::SeqCst);
                Some(Ok(()))
            }
            Err(e) => Some(Err(inner.fail(e.into()))),
        }
    }

    /// Sends what the control connection holds.
    async fn flush_locked(&self, side: &mut WriteSide) -> Result<()> {
        self.inner.held.store(false, Ordering::SeqCst);
        match side.tx.control.flush().await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.inner.fail(e.into())),
        }
    }

    /// Starts or ends a batch. While batching, messages written to this pipe (by anyone) may
    /// stay in the transport until the batch ends, so that several leave in one transport
    /// write (one system call for TCP); ending the batch sends what is held. A server that
    /// sees more requests already waiting batches its replies; it must end the batch before it
    /// waits for the next request. Messages that need the peer's acknowledgement, and tensors
    /// on other connections, are never held back.
    pub async fn set_batching(&self, on: bool) -> Result<()> {
        if on {
            self.inner.batching.store(true, Ordering::Release);
            return Ok(());
        }
        if !self.inner.batching.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let mut side = self.inner.writer.lock().await;
        self.inner.check()?;
        self.flush_locked(&mut side).await
    }

    /// The pipe's coordination state, for diagnostics: writers queued, frames held, batching,
    /// whether the write and read sides are held now, whether a descriptor waits for its read.
    pub fn debug_state(&self) -> String {
        let inner = &self.inner;
        let writer = match inner.writer.try_lock() {
            Ok(_) => "free".to_owned(),
            Err(_) => "held".to_owned(),
        };
        let reader = match inner.reader.try_lock() {
            Ok(mut side) => {
                let input = side.rx.control.has_input();
                format!(
                    "free (descriptor pending: {} (decoded early: {}), input waiting: {input})",
                    side.pending,
                    side.early.is_some(),
                )
            }
            Err(_) => "held".to_owned(),
        };
        format!(
            "queued writers {}, frames held {}, batching {}, failed {}, write side {writer}, read side {reader}",
            inner.queued.load(Ordering::SeqCst),
            inner.held.load(Ordering::SeqCst),
            inner.batching.load(Ordering::Acquire),
            inner.failed.load(Ordering::Acquire),
        )
    }

    /// Whether a batch is open (see [`set_batching`](Self::set_batching)).
    #[inline]
    pub fn is_batching(&self) -> bool {
        self.inner.batching.load(Ordering::Acquire)
    }

    /// Whether the start of another message has already arrived (never waits). `false` while
    /// someone else is reading.
    pub fn has_input(&self) -> bool {
        match self.inner.reader.try_lock() {
            Ok(mut side) => side.pending || side.rx.control.has_input(),
            Err(_) => false,
        }
    }

    async fn write_locked(&self, side: &mut WriteSide, message: &Message, defer: bool) -> Result<()> {
        let inner = &self.inner;
        let poison = |e: PipeError| inner.fail(e);
        let link = inner.link(&poison);
        let seq = side.seq;
        let mut channels: SmallVec<[ChannelKind; 4]> = SmallVec::new();
        let mut targets: SmallVec<[Option<Device>; 4]> = SmallVec::new();
        let mut prepared: SmallVec<[path::Prepared; 4]> = SmallVec::new();
        let mut staging = Staging::default();
        for t in &message.tensors {
            let source = t.buffer.device();
            let target = t.target_device.or_else(|| self.default_target(source));
            // Nothing is written yet, so an unmovable tensor is the caller's mistake, not the
            // pipe's: report it without breaking the pipe.
            let channel = self
                .channel_for(source, target.unwrap_or(source))
                .map_err(|e| PipeError::Misuse(e.to_string()))?;
            prepared.push(path::prepare(channel, &mut side.tx, &link, &t.buffer, &mut staging)?);
            channels.push(channel);
            targets.push(target);
        }
        // Counted only once the message is known to be sendable (a refused one leaves no gap).
        side.seq += 1;
        let inline = |p: &path::Prepared| matches!(p.source, Source::Inline);
        let packed_len = message.payloads.iter().map(|p| p.len()).sum::<usize>()
            + message
                .tensors
                .iter()
                .zip(&prepared)
                .filter(|(_, p)| inline(p))
                .map(|(t, _)| t.buffer.len())
                .sum::<usize>();
        let packed = packed_len <= PACK_MAX;
        let mut encoded = std::mem::take(&mut side.encoded);
        {
            let mut tensors = SmallVec::new();
            tensors_out(&mut tensors, message, prepared.iter().map(|p| &p.source), &targets);
            let descriptor = DescriptorOut {
                seq,
                metadata: ByteSlice(&message.metadata),
                payloads: Lengths(&message.payloads),
                tensors: &tensors,
                packed,
            };
            wire::encode_descriptor(&descriptor, &mut encoded);
        }
        let needs_ack = prepared.iter().any(|p| p.source.needs_ack());
        for (t, p) in message.tensors.iter().zip(&prepared) {
            if p.source.needs_ack() {
                // Kept alive until acknowledged, even if this write is cancelled.
                side.exposed.push(t.buffer.clone());
            }
        }
        staging.before_announce(&link).await?;
        // The message's frames on the control connection leave as one transport write (one
        // system call, one publication), at the end or before anything that waits on the peer.
        // A packed message is one frame: the descriptor, its payloads, its inline tensors.
        if packed {
            let mut parts: SmallVec<[&[u8]; 8]> = SmallVec::new();
            parts.push(&encoded);
            parts.extend(message.payloads.iter().map(|p| &p[..]));
            for ((t, &channel), p) in message.tensors.iter().zip(&channels).zip(&prepared) {
                if inline(p) {
                    match &t.buffer {
                        SendBuffer::Cpu(b) => parts.push(b),
                        b => return Err(link.wrong_buffer(channel, b.device())),
                    }
                }
            }
            side.tx.control.write_deferred(&parts).await?;
        } else {
            side.tx.control.write_deferred(&[&encoded]).await?;
        }
        side.encoded = encoded;
        staging.announced();
        if !packed {
            for p in &message.payloads {
                side.tx.control.write_deferred(&[p]).await?;
            }
        }
        for ((t, &channel), p) in message.tensors.iter().zip(&channels).zip(&prepared) {
            if !(packed && inline(p)) {
                path::send(channel, &mut side.tx, &link, &t.buffer, &p.source).await?;
            }
        }
        if !defer || needs_ack {
            side.tx.control.flush().await?;
        }
        if needs_ack {
            crate::cuda::trace::mark("send: announced");
            let cuda = prepared.iter().filter(|p| p.ready.is_some()).count();
            let ack = side.acks.read_vec(64 + cuda * 80).await?;
            let ack: Ack = wire::decode(&ack, &inner.info.peer)?;
            if ack.seq != seq {
                return Err(inner.protocol(format!(
                    "acknowledgement for message {} while waiting for {seq}",
                    ack.seq
                )));
            }
            if ack.cuda.len() != cuda {
                return Err(inner.protocol(format!(
                    "acknowledgement names {} CUDA copies, the message had {cuda}",
                    ack.cuda.len()
                )));
            }
            let answered = message.tensors.iter().zip(&channels).zip(&prepared);
            let answered = answered.filter(|(_, p)| p.ready.is_some());
            for (((t, &channel), p), done) in answered.zip(&ack.cuda) {
                path::finish(channel, &link, &t.buffer, p, done).await?;
            }
            side.exposed.clear();
            side.tx.acknowledged();
            // The ready events may be reused: the receiver's copies are ordered after them.
            drop(prepared);
        }
        Ok(())
    }

    /// The read side, taken with no future when it is free (the common case: tokio's `lock`
    /// builds and polls one even then, tens of ns a read). `try_lock` fails while another
    /// read waits for the side (tokio's lock is fair), so this never overtakes one.
    async fn read_side(&self) -> tokio::sync::MutexGuard<'_, ReadSide> {
        match self.inner.reader.try_lock() {
            Ok(side) => side,
            Err(_) => self.inner.reader.lock().await,
        }
    }

    /// Waits for the next message and returns its descriptor. Call [`read`](Self::read) before
    /// asking for another.
    pub async fn read_descriptor(&self) -> Result<Descriptor> {
        let mut side = self.read_side().await;
        self.inner.check()?;
        self.next_descriptor(&mut side).await
    }

    /// Receives the next message whole: its descriptor, and its contents in the allocation
    /// `allocate` makes for that descriptor. The same as [`read_descriptor`](Self::read_descriptor)
    /// then [`read`](Self::read), the message taken under one hold of the read side (at once,
    /// by [`try_read_message`](Self::try_read_message), when it is here whole and small). An
    /// allocation that fails fails the pipe with its error (a message this receiver refuses,
    /// say, as too large).
    pub async fn read_message(
        &self,
        allocate: impl FnOnce(&Descriptor) -> Result<Allocation>,
    ) -> Result<(Descriptor, Allocation)> {
        // A small message is taken at once once it is here (see `try_read_message`), under
        // the same hold of the read side as the wait for it.
        let mut allocate = Some(allocate);
        let mut side = self.read_side().await;
        self.inner.check()?;
        if self.inner.immediate {
            // Already here: taken before any wait's future is built. (`wait_and_take` looks
            // once more before it waits; a version without that second look measured 50–60 ns
            // slower per round trip, likely code layout, so it stays.)
            if let Some(m) = self.take_now(&mut side, |d| allocate.take().map(|f| f(d))) {
                return m;
            }
            if let Some(m) = self.wait_and_take(&mut side, |d| allocate.take().map(|f| f(d))).await? {
                return Ok(m);
            }
        }
        let allocate = allocate.expect("used only by a read that returned");
        let d = self.next_descriptor(&mut side).await?;
        let allocation = allocate(&d).map_err(|e| self.inner.fail(e))?;
        let allocation = self.read_pending(&mut side, allocation).await?;
        Ok((d, allocation))
    }

    async fn next_descriptor(&self, side: &mut ReadSide) -> Result<Descriptor> {
        if let Some(d) = side.early.take() {
            return Ok(d);
        }
        if side.pending {
            return Err(PipeError::Misuse(
                "a descriptor is already waiting for its read()".into(),
            ));
        }
        let limit = self.frame_limit(side);
        let ReadSide { rx, frame, .. } = &mut *side;
        if let Err(e) = rx.control.read_into_vec(frame, limit).await {
            return Err(self.inner.fail(e.into()));
        }
        self.accept_descriptor(side)
    }

    /// Receives the next message at once, with no future, if it is here whole and its
    /// contents travel in its descriptor's frame (a packed message whose tensors, if any, are
    /// inline): its descriptor, and its contents in the allocation `allocate` makes for that
    /// descriptor. `None` means nothing was returned: the message has not arrived whole, needs
    /// a channel, `allocate` declined it (said `None`), or another read holds the read side;
    /// the next [`read_message`](Self::read_message) or
    /// [`read_descriptor`](Self::read_descriptor) returns it as usual (its descriptor may be
    /// decoded already). An allocation that fails fails the pipe, as in `read_message`; one
    /// that does not fit the descriptor is [`PipeError::Misuse`], and the message waits for
    /// a [`read`](Self::read) with one that fits, as after `read_descriptor`.
    pub fn try_read_message(
        &self,
        allocate: impl FnOnce(&Descriptor) -> Option<Result<Allocation>>,
    ) -> Option<Result<(Descriptor, Allocation)>> {
        let inner = &self.inner;
        if !inner.immediate {
            return None;
        }
        let mut side = inner.reader.try_lock().ok()?;
        if let Err(e) = inner.check() {
            return Some(Err(e));
        }
        self.take_now(&mut side, allocate)
    }

    /// Waits until the next message has begun to arrive, then takes it at once if it is here
    /// whole and small, as [`try_read_message`](Self::try_read_message) does: the wait and the
    /// take under one hold of the read side. `None` (nothing returned) when the message needs
    /// the general path ([`read_message`](Self::read_message), or
    /// [`read_descriptor`](Self::read_descriptor) then [`read`](Self::read)), its descriptor
    /// perhaps decoded already, or when `allocate` declined it (said `None`). Errors as
    /// `try_read_message`'s, and the pipe's error once nothing more can arrive.
    ///
    /// **Cancel-safe**, like [`readable`](Self::readable): the wait consumes nothing, and a
    /// message is taken with no await after the wait.
    pub async fn read_message_ready(
        &self,
        allocate: impl FnOnce(&Descriptor) -> Option<Result<Allocation>>,
    ) -> Result<Option<(Descriptor, Allocation)>> {
        let mut side = self.read_side().await;
        self.inner.check()?;
        self.wait_and_take(&mut side, allocate).await
    }

    /// [`read_message_ready`](Self::read_message_ready) with the read side held.
    async fn wait_and_take(
        &self,
        side: &mut ReadSide,
        allocate: impl FnOnce(&Descriptor) -> Option<Result<Allocation>>,
    ) -> Result<Option<(Descriptor, Allocation)>> {
        // Called at most once: a message `allocate` declined waits as the pending one.
        let mut allocate = Some(allocate);
        let mut now = |side: &mut ReadSide| self.take_now(side, |d| allocate.take().and_then(|f| f(d)));
        if let Some(m) = now(side) {
            return m.map(Some);
        }
        if side.pending {
            return Ok(None);
        }
        if let Err(e) = side.rx.control.readable().await {
            return Err(self.inner.fail(e.into()));
        }
        now(side).transpose()
    }

    /// [`try_read_message`](Self::try_read_message) with the read side held.
    fn take_now(
        &self,
        side: &mut ReadSide,
        allocate: impl FnOnce(&Descriptor) -> Option<Result<Allocation>>,
    ) -> Option<Result<(Descriptor, Allocation)>> {
        let inner = &self.inner;
        if !inner.immediate || side.pending {
            return None;
        }
        let limit = self.frame_limit(side);
        if let Err(e) = side.rx.control.try_read_into_vec_now(&mut side.frame, limit)? {
            return Some(Err(inner.fail(e.into())));
        }
        let d = match self.accept_descriptor(side) {
            Ok(d) => d,
            Err(e) => return Some(Err(e)),
        };
        let w = &side.descriptor;
        let in_hand = w.packed && w.tensors.iter().all(|t| matches!(t.data, Source::Inline));
        let allocation = if in_hand { allocate(&d) } else { None };
        let mut allocation = match allocation {
            None => {
                side.early = Some(d);
                return None;
            }
            Some(Err(e)) => return Some(Err(inner.fail(e))),
            Some(Ok(a)) => a,
        };
        if let Err(why) = check_allocation(&side.descriptor, &allocation, side.rx.landing.is_some()) {
            // As with `read`: the caller's mistake, and the message waits for a `read` with a
            // fitting allocation.
            return Some(Err(PipeError::Misuse(why)));
        }
        // Taken: whatever happens now, the message is read or the pipe has failed.
        side.pending = false;
        let poison = |e: PipeError| inner.fail(e);
        let link = inner.link(&poison);
        let tail = &side.frame[side.packed_at..];
        if let Err(e) = self.unpack(tail, &side.descriptor, &mut allocation, &link) {
            return Some(Err(inner.fail(e)));
        }
        side.rx.finished();
        side.read_done();
        Some(Ok((d, allocation)))
    }

    /// Copies a packed message's payloads and inline tensors out of the rest of its
    /// descriptor's frame, `tail`.
    fn unpack(
        &self,
        mut tail: &[u8],
        descriptor: &WireDescriptor,
        allocation: &mut Allocation,
        link: &Link<'_>,
    ) -> Result<()> {
        let inner = &self.inner;
        let mut take = |n: u64| -> Result<&[u8]> {
            let Some((head, rest)) = tail.split_at_checked(n as usize) else {
                return Err(inner.protocol("packed bytes shorter than announced"));
            };
            tail = rest;
            Ok(head)
        };
        for p in allocation.payloads.iter_mut() {
            let n = p.len() as u64;
            p.copy_from_slice(take(n)?);
        }
        for (t, buf) in descriptor.tensors.iter().zip(allocation.tensors.iter_mut()) {
            if matches!(t.data, Source::Inline) {
                let channel = self.channel_for(buf.device(), t.source)?;
                path::recv_packed(channel, link, take(t.length)?, buf)?;
            }
        }
        Ok(())
    }

    /// Readies `side.frame` for the next descriptor frame (a buffer grown past `FRAME_KEEP` is
    /// let go) and returns the longest such frame accepted: a descriptor and its packed bytes.
    #[inline]
    fn frame_limit(&self, side: &mut ReadSide) -> usize {
        if side.frame.capacity() > FRAME_KEEP {
            side.frame = Vec::new();
        }
        self.inner.max_descriptor.saturating_add(PACK_MAX)
    }

    /// Decodes and checks the descriptor frame just read into `side.frame`; it becomes the
    /// pending descriptor, and its public form is returned.
    fn accept_descriptor(&self, side: &mut ReadSide) -> Result<Descriptor> {
        let descriptor = &mut side.descriptor;
        let packed_at = match wire::decode_descriptor_into(&side.frame, &self.inner.info.peer, descriptor) {
            Ok(at) => at,
            Err(e) => return Err(self.inner.fail(e)),
        };
        side.packed_at = packed_at;
        crate::cuda::trace::mark("recv: descriptor");
        if descriptor.seq != side.seq {
            return Err(self.inner.fail(
                self.inner
                    .protocol(format!("message {} arrived, expected {}", descriptor.seq, side.seq)),
            ));
        }
        let inner = &self.inner;
        let poison = |e: PipeError| inner.fail(e);
        let link = inner.link(&poison);
        for t in &descriptor.tensors {
            let checked = self
                .channel_for(t.target.unwrap_or(t.source), t.source)
                .and_then(|channel| path::accepts(channel, &side.rx, &link, &t.data, t.length));
            if let Err(e) = checked {
                return Err(inner.fail(e));
            }
        }
        // The sender has finished waiting on the events of our previous acknowledgement.
        side.rx.held.clear();
        let pooled = side.rx.landing.is_some();
        // The metadata moves to the reader: `read` needs only the lengths and sources.
        let public = Descriptor {
            metadata: std::mem::take(&mut descriptor.metadata),
            payload_lengths: descriptor.payloads.clone(),
            tensors: descriptor
                .tensors
                .iter_mut()
                .map(|t| TensorDescriptor {
                    length: t.length,
                    source_device: t.source,
                    target_device: t.target,
                    metadata: std::mem::take(&mut t.metadata),
                    arrives_shared: lent(t, pooled),
                })
                .collect(),
        };
        side.pending = true;
        Ok(public)
    }

    /// Waits until the next message's descriptor has begun to arrive (or one is already
    /// waiting for its `read`), consuming nothing. **Cancel-safe:** dropping it leaves the pipe
    /// exactly as it was, so a reader may give up between messages and let another take over
    /// (the agent's read-role hand-off). Fails with the pipe's error once nothing more can
    /// arrive.
    pub async fn readable(&self) -> Result<()> {
        let mut side = self.read_side().await;
        self.inner.check()?;
        if side.pending {
            return Ok(());
        }
        match side.rx.control.readable().await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.inner.fail(e.into())),
        }
    }

    /// Receives the message whose descriptor was just read into `allocation` (one buffer per
    /// payload and tensor, each exactly as long as announced) and hands it back filled.
    pub async fn read(&self, allocation: Allocation) -> Result<Allocation, ReadError> {
        let mut side = self.read_side().await;
        if let Err(error) = self.inner.check() {
            return Err(ReadError { error, allocation });
        }
        self.read_pending(&mut side, allocation).await
    }

    /// [`read`](Self::read) with the read side held.
    async fn read_pending(&self, side: &mut ReadSide, allocation: Allocation) -> Result<Allocation, ReadError> {
        // A descriptor decoded early is this one: it is being read now.
        side.early = None;
        if !side.pending {
            return Err(ReadError {
                error: PipeError::Misuse("read() without a descriptor: call read_descriptor() first".into()),
                allocation,
            });
        }
        if let Err(why) = check_allocation(&side.descriptor, &allocation, side.rx.landing.is_some()) {
            return Err(ReadError {
                error: PipeError::Misuse(why),
                allocation,
            });
        }
        let mut allocation = allocation;
        // The descriptor is taken (out of the side, for the read's borrows, and back after):
        // a read abandoned from here on would leave the peer waiting for an acknowledgement
        // that cannot come, so abandoning it closes the pipe.
        side.pending = false;
        let descriptor = std::mem::take(&mut side.descriptor);
        let abandoned = CloseOnDrop(Some(&self.inner));
        let read = self.read_locked(side, &descriptor, &mut allocation).await;
        abandoned.disarm();
        side.descriptor = descriptor;
        match read {
            Ok(()) => {
                side.read_done();
                Ok(allocation)
            }
            Err(e) => Err(ReadError {
                error: self.inner.fail(e),
                allocation,
            }),
        }
    }

    async fn read_locked(
        &self,
        side: &mut ReadSide,
        descriptor: &WireDescriptor,
        allocation: &mut Allocation,
    ) -> Result<()> {
        let inner = &self.inner;
        let poison = |e: PipeError| inner.fail(e);
        let link = inner.link(&poison);
        let ReadSide {
            rx,
            acks,
            frame,
            packed_at,
            ..
        } = side;
        // A packed message's payloads and inline tensors are in its descriptor's frame.
        if descriptor.packed {
            self.unpack(&frame[*packed_at..], descriptor, allocation, &link)?;
        } else {
            for p in allocation.payloads.iter_mut() {
                path::recv_inline(&mut rx.control, &link, p).await?;
            }
        }
        let mut ack = false;
        let mut cuda = Vec::new();
        for (t, buf) in descriptor.tensors.iter().zip(allocation.tensors.iter_mut()) {
            if descriptor.packed && matches!(t.data, Source::Inline) {
                continue;
            }
            let channel = self.channel_for(buf.device(), t.source)?;
            match path::recv(channel, rx, &link, &t.data, t.length, t.source, buf).await? {
                Received::Done => {}
                Received::Ack => ack = true,
                Received::Cuda(done) => cuda.push(done),
            }
        }
        rx.finished();
        if ack || !cuda.is_empty() {
            let ack = Ack {
                seq: descriptor.seq,
                cuda,
            };
            acks.write(&[&wire::encode(&ack)]).await?;
            crate::cuda::trace::mark("recv: ack sent");
        }
        Ok(())
    }
}

/// The descriptor's view of a message's tensors: each one's length, devices, metadata, and
/// `sources` (where its bytes travel).
fn tensors_out<'a>(
    out: &mut SmallVec<[TensorOut<'a>; 4]>,
    message: &'a Message,
    sources: impl Iterator<Item = &'a Source>,
    targets: &[Option<Device>],
) {
    // Filled in place: a returned SmallVec would be copied whole into the caller's frame.
    out.extend(
        message
            .tensors
            .iter()
            .zip(sources)
            .zip(targets)
            .map(|((t, data), &target)| TensorOut {
                length: t.buffer.len() as u64,
                source: t.buffer.device(),
                target,
                metadata: ByteSlice(&t.metadata),
                data,
            }),
    );
}

/// Closes the pipe when dropped armed: a read given up between taking a message's descriptor
/// and acknowledging it.
struct CloseOnDrop<'a>(Option<&'a Inner>);

impl CloseOnDrop<'_> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(inner) = self.0.take() {
            tracing::debug!(peer = %inner.info.peer, "a read abandoned mid-message closes the pipe");
            inner.fail(PipeError::Closed {
                peer: inner.info.peer.clone(),
            });
        }
    }
}

/// Whether a tensor arrives in memory the pipe lends (the reader supplies an empty buffer):
/// the receiver's cma segment, or for rdma the receive pool (`pooled`: this pipe has one).
fn lent(t: &WireTensor, pooled: bool) -> bool {
    t.in_segment()
        || (pooled
            && matches!(t.data, crate::wire::Source::Rdma { .. })
            && t.target.unwrap_or(t.source) == Device::Cpu
            && t.length > 0
            && t.length as usize <= crate::channel::rdma::POOL_MAX_TENSOR)
}

fn check_allocation(d: &WireDescriptor, a: &Allocation, pooled: bool) -> std::result::Result<(), String> {
    if a.payloads.len() != d.payloads.len() || a.tensors.len() != d.tensors.len() {
        return Err(format!(
            "allocation has {} payloads and {} tensors; the message has {} and {}",
            a.payloads.len(),
            a.tensors.len(),
            d.payloads.len(),
            d.tensors.len()
        ));
    }
    for (i, (p, &len)) in a.payloads.iter().zip(&d.payloads).enumerate() {
        if p.len() as u64 != len {
            return Err(format!("payload {i}: buffer of {} bytes for {len} bytes", p.len()));
        }
    }
    for (i, (b, t)) in a.tensors.iter().zip(&d.tensors).enumerate() {
        // A lent tensor takes an empty buffer; any other buffer must be exactly its length.
        if b.len() as u64 != t.length && !(b.is_empty() && lent(t, pooled)) {
            return Err(format!(
                "tensor {i}: buffer of {} bytes for {} bytes",
                b.len(),
                t.length
            ));
        }
        let target = t.target.unwrap_or(t.source);
        if b.device() != target {
            return Err(format!(
                "tensor {i}: buffer on {} but the sender sent it for {target}",
                b.device()
            ));
        }
    }
    Ok(())
}
