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
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};
use sluice_transport::any::{AnyReader, AnyWriter};
use sluice_transport::ibv::{Access, RdmaHandle, Sge};
use sluice_transport::{Closer, FrameReader, FrameWriter};
use tokio::sync::Mutex;

use crate::channel::gdr;
use crate::channel::rdma::{self, RegCache};
use crate::channel::segment::Segment;
use crate::channel::{cma, multilane, ChannelKind};
use crate::cuda::events::{self, EventSlot};
use crate::cuda::{driver, ipc, staged, CudaBuffer, CudaError};
use crate::device::{Device, RecvBuffer, SendBuffer};
use crate::error::{PipeError, Result};
use crate::message::{Allocation, Descriptor, Message, TensorDescriptor};
use crate::wire::{self, Ack, CpuSource, CudaDone, CudaSource, RdmaSource, WireDescriptor, WireTensor};

/// Tensors at least this long are copied by CMA on a blocking thread rather than inline.
const CMA_OFFLOAD: usize = 1 << 20;

/// Copies into the peer's segment at least this large let the runtime move this worker's other
/// tasks elsewhere while they run.
const COPY_OFFLOAD: usize = 8 << 20;

/// cma-channel tensors below this go inline through the control connection: a frame copy on
/// each side costs less than a segment block or a system call and an acknowledgement. Kept
/// small: every byte through a pipe's ring eventually touches all of the ring's pages.
const INLINE_MAX: usize = 4 << 10;

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

/// Blocks of the peer's segment reserved for one message: given back if the message is never
/// announced (a failed or cancelled write), kept once its descriptor went out.
struct Reserved {
    segment: Arc<Segment>,
    ranges: Vec<(u64, Bytes)>,
    announced: bool,
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
    control: AnyWriter,
    acks: AnyReader,
    lanes: Vec<AnyWriter>,
    seq: u64,
    /// Sources the peer may still be reading (CMA, rdma, CUDA), cleared once acknowledged.
    exposed: Vec<SendBuffer>,
    /// The rdma channel's registrations of sent tensors.
    registrations: Option<RegCache>,
    /// cuda_gdr's registrations of sent GPU allocations.
    gpu_registrations: Option<RegCache>,
    /// The peer's segment, which cma tensors are copied into when they fit.
    outbox: Option<Arc<Segment>>,
}

struct ReadSide {
    control: AnyReader,
    acks: AnyWriter,
    lanes: Vec<AnyReader>,
    seq: u64,
    pending: Option<WireDescriptor>,
    /// Events whose handles went to the sender in the last acknowledgement: it may still be
    /// queueing a wait on them until its next message arrives, so they are not reused before.
    held: Vec<EventSlot>,
    /// cuda_gdr's registrations of receiving GPU allocations.
    gpu_targets: Option<RegCache>,
}

struct Inner {
    info: PipeInfo,
    table: HashMap<(Device, Device), ChannelKind>,
    /// The peer's process token, and whether it is this process.
    peer_process: u64,
    same_process: bool,
    /// Whether this pipe is counted in the IPC caches (see `cuda::ipc`).
    ipc_counted: bool,
    max_descriptor: usize,
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
    /// The segment cma tensors from the peer arrive in.
    inbox: Option<Arc<Segment>>,
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
        let table = info.channels.iter().map(|&(l, r, k)| ((l, r), k)).collect();
        let ipc_counted = info.channels.iter().any(|c| c.2.is_direct_cuda());
        if ipc_counted {
            ipc::pipe_opened(peer_process);
        }
        let mut closers = vec![links.control.0.closer(), links.reply.0.closer()];
        closers.extend(links.lanes.iter().map(|(r, _)| r.closer()));
        let (lane_readers, lane_writers): (Vec<_>, Vec<_>) = links.lanes.into_iter().unzip();
        let rdma = links.control.1.rdma();
        // Bounded: 256 registrations or 4 GiB of sent tensors kept registered (and alive).
        let registrations = rdma.as_ref().map(|h| RegCache::new(h.device(), 256, 4 << 30));
        // GPU registrations use BAR space: fewer of them.
        let gpu_cache = || rdma.as_ref().map(|h| RegCache::new(h.device(), 64, 16 << 30));
        let (gpu_registrations, gpu_targets) = (gpu_cache(), gpu_cache());
        Pipe {
            inner: Arc::new(Inner {
                info,
                table,
                peer_process,
                same_process: peer_process == crate::channel::cuda::process_token(),
                ipc_counted,
                max_descriptor,
                failed: AtomicBool::new(false),
                batching: AtomicBool::new(false),
                queued: AtomicUsize::new(0),
                held: AtomicBool::new(false),
                error: OnceLock::new(),
                closers,
                rdma,
                inbox: segments.inbox,
                writer: Mutex::new(WriteSide {
                    control: links.control.1,
                    acks: links.reply.0,
                    lanes: lane_writers,
                    seq: 0,
                    exposed: Vec::new(),
                    registrations,
                    gpu_registrations,
                    outbox: segments.outbox,
                }),
                reader: Mutex::new(ReadSide {
                    control: links.control.0,
                    acks: links.reply.1,
                    lanes: lane_readers,
                    seq: 0,
                    pending: None,
                    held: Vec::new(),
                    gpu_targets,
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
            .table
            .get(&(local, remote))
            .copied()
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

    fn cuda_error(&self, channel: ChannelKind, e: CudaError) -> PipeError {
        PipeError::Channel {
            peer: self.inner.info.peer.clone(),
            channel: channel.name(),
            detail: e.to_string(),
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

    /// Sends what the control connection holds.
    async fn flush_locked(&self, side: &mut WriteSide) -> Result<()> {
        self.inner.held.store(false, Ordering::SeqCst);
        match side.control.flush().await {
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

    /// Whether a batch is open (see [`set_batching`](Self::set_batching)).
    pub fn is_batching(&self) -> bool {
        self.inner.batching.load(Ordering::Acquire)
    }

    /// Whether the start of another message has already arrived (never waits). `false` while
    /// someone else is reading.
    pub fn has_input(&self) -> bool {
        match self.inner.reader.try_lock() {
            Ok(mut side) => side.pending.is_some() || side.control.has_input(),
            Err(_) => false,
        }
    }

    async fn write_locked(&self, side: &mut WriteSide, message: &Message, defer: bool) -> Result<()> {
        let seq = side.seq;
        let mut channels = Vec::with_capacity(message.tensors.len());
        let mut tensors = Vec::with_capacity(message.tensors.len());
        // Sender events of cuda_ipc/cuda_p2p tensors: the receiver waits on them before its
        // copy, so they are kept until its acknowledgement.
        let mut ready_events = Vec::new();
        let mut reserved: Option<Reserved> = None;
        for t in &message.tensors {
            let source = t.buffer.device();
            let target = t.target_device.or_else(|| self.default_target(source));
            // Nothing is written yet, so an unmovable tensor is the caller's mistake, not the
            // pipe's: report it without breaking the pipe.
            let channel = self
                .channel_for(source, target.unwrap_or(source))
                .map_err(|e| PipeError::Misuse(e.to_string()))?;
            let mut cpu = None;
            let mut cuda = None;
            let mut rdma = None;
            match (&t.buffer, channel) {
                (SendBuffer::Cpu(b), ChannelKind::Cma) => cpu = Some(place_cpu(side.outbox.as_ref(), &mut reserved, b)),
                (SendBuffer::Cpu(b), ChannelKind::Rdma) if b.len() >= rdma::INLINE_MAX => {
                    let cache = side
                        .registrations
                        .as_mut()
                        .ok_or_else(|| self.inner.protocol("rdma negotiated without an ibverbs connection"))?;
                    let mr = cache.get(b).map_err(|e| PipeError::Channel {
                        peer: self.inner.info.peer.clone(),
                        channel: "rdma",
                        detail: format!("registering a {} byte tensor: {e}", b.len()),
                    })?;
                    rdma = Some(RdmaSource {
                        addr: b.as_ptr() as u64,
                        rkey: mr.rkey,
                    });
                }
                (SendBuffer::Cuda(b), ChannelKind::CudaGdr) if !b.is_empty() => {
                    let cache = side
                        .gpu_registrations
                        .as_mut()
                        .ok_or_else(|| self.inner.protocol("cuda_gdr negotiated without an ibverbs connection"))?;
                    rdma = Some(self.expose_gpu(cache, b)?);
                }
                (SendBuffer::Cuda(b), k) if k.is_direct_cuda() => {
                    let (source, event) = self
                        .export(b)
                        .map_err(|e| PipeError::Misuse(format!("{} cannot send this buffer: {e}", k.name())))?;
                    cuda = Some(source);
                    ready_events.push(event);
                }
                _ => {}
            }
            channels.push(channel);
            tensors.push(WireTensor {
                length: t.buffer.len() as u64,
                source,
                target,
                metadata: t.metadata.clone(),
                cpu,
                cuda,
                rdma,
            });
        }
        // Counted only once the message is known to be sendable (a refused one leaves no gap).
        side.seq += 1;
        let descriptor = WireDescriptor {
            seq,
            metadata: message.metadata.clone(),
            payloads: message.payloads.iter().map(|p| p.len() as u64).collect(),
            tensors,
        };
        let mut acked = Vec::new();
        for ((t, &channel), w) in message.tensors.iter().zip(&channels).zip(&descriptor.tensors) {
            let by_cma = matches!(w.cpu, Some(CpuSource::Cma { .. }));
            if by_cma || channel.is_direct_cuda() || w.rdma.is_some() {
                // Kept alive until acknowledged, even if this write is cancelled.
                side.exposed.push(t.buffer.clone());
                if channel.is_direct_cuda() {
                    acked.push(
                        t.buffer
                            .as_cuda()
                            .expect("direct CUDA channels carry CUDA buffers")
                            .clone(),
                    );
                }
            }
        }
        // Tensors in the peer's segment are copied before it hears of them: in place (a thread
        // hand-off costs more than copying a few MiB), and for large copies on a multi-thread
        // runtime with the worker's other tasks moved elsewhere meanwhile. On a current-thread
        // runtime a large copy runs on a blocking thread, which keeps the reservation until it
        // is done (even if this write is cancelled meanwhile).
        let reserved = match reserved {
            Some(r) if r.bytes() >= COPY_OFFLOAD => {
                let flavor = tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor());
                if matches!(flavor, Ok(tokio::runtime::RuntimeFlavor::MultiThread)) {
                    tokio::task::block_in_place(|| r.copy());
                    Some(r)
                } else {
                    tokio::task::spawn_blocking(move || {
                        r.copy();
                        r
                    })
                    .await
                    .map(Some)
                    .map_err(|e| self.inner.protocol(format!("segment copy thread failed: {e}")))?
                }
            }
            Some(r) => {
                r.copy();
                Some(r)
            }
            None => None,
        };
        // The message's frames on the control connection leave as one transport write (one
        // system call, one publication), at the end or before anything that waits on the peer.
        side.control.write_deferred(&[&wire::encode(&descriptor)]).await?;
        if let Some(mut r) = reserved {
            r.announced = true;
        }
        for p in &message.payloads {
            side.control.write_deferred(&[p]).await?;
        }
        let mut needs_ack = false;
        for ((t, &channel), w) in message.tensors.iter().zip(&channels).zip(&descriptor.tensors) {
            match (&t.buffer, channel) {
                (SendBuffer::Cpu(bytes), ChannelKind::Basic) => side.control.write_deferred(&[bytes]).await?,
                (SendBuffer::Cpu(bytes), ChannelKind::MultiLane) => {
                    // The receiver reads the lanes only once it has the descriptor.
                    side.control.flush().await?;
                    send_lanes(&mut side.lanes, bytes, &self.inner.info.peer).await?
                }
                (SendBuffer::Cpu(bytes), ChannelKind::CudaStaged) => staged::send_cpu(&mut side.control, bytes).await?,
                (SendBuffer::Cuda(b), ChannelKind::CudaStaged) => {
                    staged::send_gpu(&mut side.control, b, &self.inner.info.peer).await?
                }
                (SendBuffer::Cpu(bytes), ChannelKind::Cma) => match w.cpu {
                    Some(CpuSource::Inline) => side.control.write_deferred(&[bytes]).await?,
                    Some(CpuSource::Segment { .. }) => {}
                    _ => needs_ack = true,
                },
                (SendBuffer::Cpu(bytes), ChannelKind::Rdma) => {
                    if bytes.len() >= rdma::INLINE_MAX {
                        needs_ack = true;
                    } else {
                        side.control.write_deferred(&[bytes]).await?
                    }
                }
                (_, k) if k.is_direct_cuda() => needs_ack = true,
                (SendBuffer::Cuda(b), ChannelKind::CudaGdr) => needs_ack |= !b.is_empty(),
                (b, k) => {
                    return Err(self.inner.protocol(format!(
                        "channel {k} was negotiated for a {} buffer it cannot carry",
                        b.device()
                    )))
                }
            }
        }
        if !defer || needs_ack {
            side.control.flush().await?;
        }
        if needs_ack {
            let ack = side.acks.read_vec(64 + acked.len() * 80).await?;
            let ack: Ack = wire::decode(&ack, &self.inner.info.peer)?;
            if ack.seq != seq {
                return Err(self.inner.protocol(format!(
                    "acknowledgement for message {} while waiting for {seq}",
                    ack.seq
                )));
            }
            if ack.cuda.len() != acked.len() {
                return Err(self.inner.protocol(format!(
                    "acknowledgement names {} CUDA copies, the message had {}",
                    ack.cuda.len(),
                    acked.len()
                )));
            }
            for (buffer, done) in acked.iter().zip(&ack.cuda) {
                self.wait_for_receiver(buffer, done)?;
            }
            side.exposed.clear();
            for c in [side.registrations.as_mut(), side.gpu_registrations.as_mut()]
                .into_iter()
                .flatten()
            {
                c.unpin_all();
            }
            drop(ready_events);
        }
        Ok(())
    }

    /// Describes a CUDA buffer for the receiver of a cuda_ipc/cuda_p2p tensor: an event
    /// recorded on its stream (the data is ready when the stream gets there) and where the
    /// bytes are (an address within this process, IPC handles otherwise).
    fn export(&self, b: &CudaBuffer) -> std::result::Result<(CudaSource, EventSlot), CudaError> {
        let event = EventSlot::take(b.device())?;
        event.record(b.stream())?;
        if self.inner.same_process {
            return Ok((
                CudaSource::Local {
                    address: b.ptr(),
                    event: event.raw().0 as u64,
                },
                event,
            ));
        }
        let (memory, offset) = b.ipc_export()?;
        let source = CudaSource::Ipc {
            memory: Bytes::copy_from_slice(&memory),
            offset,
            event: Bytes::copy_from_slice(&event.ipc_handle()),
        };
        Ok((source, event))
    }

    /// Makes the sender's stream wait for the receiver's copy of `buffer`.
    fn wait_for_receiver(&self, buffer: &CudaBuffer, done: &CudaDone) -> Result<()> {
        let event = match done {
            CudaDone::Local { event } if self.inner.same_process => driver::RawEvent(*event as usize),
            CudaDone::Ipc { event } if !self.inner.same_process => {
                let handle = ipc_handle(event).ok_or_else(|| self.inner.protocol("malformed IPC event handle"))?;
                ipc::open_event(self.inner.peer_process, buffer.device(), &handle)
                    .map_err(|e| self.cuda_error(ChannelKind::CudaIpc, e))?
            }
            _ => return Err(self.inner.protocol("acknowledgement of the wrong kind for this peer")),
        };
        events::stream_wait(buffer.stream(), event).map_err(|e| self.cuda_error(ChannelKind::CudaIpc, e))
    }

    /// Waits for the next message and returns its descriptor. Call [`read`](Self::read) before
    /// asking for another.
    pub async fn read_descriptor(&self) -> Result<Descriptor> {
        let mut side = self.inner.reader.lock().await;
        self.inner.check()?;
        if side.pending.is_some() {
            return Err(PipeError::Misuse(
                "a descriptor is already waiting for its read()".into(),
            ));
        }
        let frame = match side.control.read_vec(self.inner.max_descriptor).await {
            Ok(f) => f,
            Err(e) => return Err(self.inner.fail(e.into())),
        };
        let descriptor: WireDescriptor = match wire::decode(&frame, &self.inner.info.peer) {
            Ok(d) => d,
            Err(e) => return Err(self.inner.fail(e)),
        };
        if descriptor.seq != side.seq {
            return Err(self.inner.fail(
                self.inner
                    .protocol(format!("message {} arrived, expected {}", descriptor.seq, side.seq)),
            ));
        }
        for t in &descriptor.tensors {
            let channel = self
                .channel_for(t.target.unwrap_or(t.source), t.source)
                .map_err(|e| self.inner.fail(e))?;
            let by_rdma = carried_by_rdma(channel, t.length);
            if t.in_segment() && self.inner.inbox.is_none() {
                return Err(self.inner.fail(
                    self.inner
                        .protocol("tensor announced in a segment this pipe does not have"),
                ));
            }
            if (channel == ChannelKind::Cma) != t.cpu.is_some()
                || channel.is_direct_cuda() != t.cuda.is_some()
                || by_rdma != t.rdma.is_some()
            {
                return Err(self.inner.fail(
                    self.inner
                        .protocol("tensor address does not match the negotiated channel"),
                ));
            }
        }
        // The sender has finished waiting on the events of our previous acknowledgement.
        side.held.clear();
        let public = Descriptor {
            metadata: descriptor.metadata.clone(),
            payload_lengths: descriptor.payloads.clone(),
            tensors: descriptor
                .tensors
                .iter()
                .map(|t| TensorDescriptor {
                    length: t.length,
                    source_device: t.source,
                    target_device: t.target,
                    metadata: t.metadata.clone(),
                    arrives_shared: t.in_segment(),
                })
                .collect(),
        };
        side.pending = Some(descriptor);
        Ok(public)
    }

    /// Waits until the next message's descriptor has begun to arrive (or one is already
    /// waiting for its `read`), consuming nothing. **Cancel-safe:** dropping it leaves the pipe
    /// exactly as it was, so a reader may give up between messages and let another take over
    /// (the agent's read-role hand-off). Fails with the pipe's error once nothing more can
    /// arrive.
    pub async fn readable(&self) -> Result<()> {
        let mut side = self.inner.reader.lock().await;
        self.inner.check()?;
        if side.pending.is_some() {
            return Ok(());
        }
        match side.control.readable().await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.inner.fail(e.into())),
        }
    }

    /// Receives the message whose descriptor was just read into `allocation` (one buffer per
    /// payload and tensor, each exactly as long as announced) and hands it back filled.
    pub async fn read(&self, allocation: Allocation) -> Result<Allocation, ReadError> {
        let mut side = self.inner.reader.lock().await;
        if let Err(error) = self.inner.check() {
            return Err(ReadError { error, allocation });
        }
        let Some(descriptor) = side.pending.take() else {
            return Err(ReadError {
                error: PipeError::Misuse("read() without a descriptor: call read_descriptor() first".into()),
                allocation,
            });
        };
        if let Err(why) = check_allocation(&descriptor, &allocation) {
            side.pending = Some(descriptor);
            return Err(ReadError {
                error: PipeError::Misuse(why),
                allocation,
            });
        }
        let mut allocation = allocation;
        match self.read_locked(&mut side, &descriptor, &mut allocation).await {
            Ok(()) => {
                side.seq += 1;
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
        for p in allocation.payloads.iter_mut() {
            read_exact_frame(&mut side.control, p, &self.inner).await?;
        }
        let mut cma = false;
        let mut done = Vec::new();
        for (t, buf) in descriptor.tensors.iter().zip(allocation.tensors.iter_mut()) {
            let channel = self.channel_for(buf.device(), t.source)?;
            if let (Some(CpuSource::Segment { offset }), Some(inbox)) = (t.cpu, &self.inner.inbox) {
                // Nothing to copy: the tensor is handed over where the sender put it.
                let bytes = inbox.take(offset, t.length).map_err(|e| self.inner.protocol(e))?;
                *buf = RecvBuffer::Shared(bytes);
                continue;
            }
            if let RecvBuffer::Shared(b) = buf {
                // A buffer handed back from an earlier read: this tensor needs writable memory.
                *buf = RecvBuffer::cpu(b.len());
            }
            match (buf, channel) {
                (RecvBuffer::Cpu(dst), ChannelKind::Basic) => {
                    read_exact_frame(&mut side.control, dst, &self.inner).await?
                }
                (RecvBuffer::Cpu(dst), ChannelKind::MultiLane) => {
                    recv_lanes(&mut side.lanes, dst, &self.inner.info.peer).await?
                }
                (RecvBuffer::Cpu(dst), ChannelKind::Cma) => {
                    let address = match t.cpu {
                        Some(CpuSource::Cma { address }) => address,
                        _ => {
                            read_exact_frame(&mut side.control, dst, &self.inner).await?;
                            continue;
                        }
                    };
                    cma = true;
                    cma_read(self.inner.info.peer_pid as i32, address, dst)
                        .await
                        .map_err(|detail| PipeError::Channel {
                            peer: self.inner.info.peer.clone(),
                            channel: "cma",
                            detail,
                        })?;
                }
                (RecvBuffer::Cpu(dst), ChannelKind::Rdma) => match t.rdma {
                    Some(source) => {
                        cma = true;
                        self.rdma_read(dst, source).await?;
                    }
                    None => read_exact_frame(&mut side.control, dst, &self.inner).await?,
                },
                (RecvBuffer::Cpu(dst), ChannelKind::CudaStaged) => {
                    staged::recv_cpu(&mut side.control, dst, &self.inner.info.peer).await?
                }
                (RecvBuffer::Cuda(dst), ChannelKind::CudaStaged) => {
                    staged::recv_gpu(&mut side.control, dst, &self.inner.info.peer).await?
                }
                (RecvBuffer::Cuda(dst), ChannelKind::CudaGdr) => {
                    if let Some(source) = t.rdma {
                        cma = true;
                        let cache = side
                            .gpu_targets
                            .as_mut()
                            .ok_or_else(|| self.inner.protocol("cuda_gdr negotiated without an ibverbs connection"))?;
                        self.gdr_read(cache, dst, source).await?;
                    }
                }
                (RecvBuffer::Cuda(dst), k) if k.is_direct_cuda() => {
                    let source = t.cuda.as_ref().expect("checked in read_descriptor");
                    let (ack, event) = self.copy_in(dst, t.source, source, k)?;
                    done.push(ack);
                    side.held.push(event);
                }
                (b, k) => {
                    return Err(self
                        .inner
                        .protocol(format!("channel {k} cannot fill a {} buffer", b.device())))
                }
            }
        }
        if let Some(c) = side.gpu_targets.as_mut() {
            c.unpin_all();
        }
        if cma || !done.is_empty() {
            let ack = Ack {
                seq: descriptor.seq,
                cuda: done,
            };
            side.acks.write(&[&wire::encode(&ack)]).await?;
        }
        Ok(())
    }

    fn rdma_error(&self, channel: &'static str, detail: String) -> PipeError {
        PipeError::Channel {
            peer: self.inner.info.peer.clone(),
            channel,
            detail,
        }
    }

    fn rdma_handle(&self) -> Result<&RdmaHandle> {
        self.inner.rdma.as_ref().ok_or_else(|| {
            self.inner
                .protocol("an RDMA channel negotiated without an ibverbs connection")
        })
    }

    /// RDMA-reads `len` bytes at the sender's `source` into registered local memory at `addr`,
    /// in pieces of at most [`rdma::MAX_READ`].
    ///
    /// # Safety
    /// `addr..addr+len` lies in a registration with `lkey` allowing local writes, and stays
    /// valid until this future completes (callers leak it if the future is dropped).
    async unsafe fn pull(&self, addr: u64, lkey: u32, len: usize, source: RdmaSource) -> Result<()> {
        let handle = self.rdma_handle()?;
        let mut done = 0usize;
        while done < len {
            let piece = (len - done).min(rdma::MAX_READ);
            let sge = Sge {
                addr: addr + done as u64,
                len: piece as u32,
                lkey,
            };
            // SAFETY: forwarded from this function's contract.
            unsafe { handle.read(sge, source.addr + done as u64, source.rkey) }.await?;
            done += piece;
        }
        Ok(())
    }

    /// Reads an rdma tensor into `dst` (registered for the read only). If this future is
    /// dropped mid-read, the destination and its registration are leaked (the NIC may still
    /// write there) and the pipe fails.
    async fn rdma_read(&self, dst: &mut BytesMut, source: RdmaSource) -> Result<()> {
        let device = self.rdma_handle()?.device();
        let mut buf = std::mem::take(dst);
        // SAFETY: `buf` is owned by the lease below until the registration is dropped; if the
        // lease is abandoned mid-read, both are leaked rather than freed.
        let mr = match unsafe { device.register(buf.as_mut_ptr(), buf.len(), Access::LOCAL) } {
            Ok(mr) => mr,
            Err(e) => {
                *dst = buf;
                return Err(self.rdma_error("rdma", format!("registering the destination: {e}")));
            }
        };
        let info = mr.info();
        let mut lease = Lease {
            held: Some((buf, mr)),
            inner: &self.inner,
            channel: "rdma",
        };
        // SAFETY: the lease holds the registered memory until the read completes, or leaks it.
        let result = unsafe { self.pull(info.addr, info.lkey, info.len, source) }.await;
        let (buf, mr) = lease.held.take().expect("held until here");
        drop(mr);
        *dst = buf;
        result
    }

    /// Makes a cuda_gdr source readable by the peer's NIC: its stream's pending work done, its
    /// allocation registered (cached).
    fn expose_gpu(&self, cache: &mut RegCache, b: &CudaBuffer) -> Result<RdmaSource> {
        let fail = |detail: String| self.rdma_error("cuda_gdr", detail);
        // The NIC does not follow streams: the data must be complete before the peer reads.
        b.stream()
            .synchronize()
            .map_err(|e| fail(format!("synchronizing the source stream: {e}")))?;
        let info =
            gdr::cached(cache, b, Access::REMOTE_READ).map_err(|e| fail(format!("registering the source: {e}")))?;
        Ok(RdmaSource {
            addr: b.ptr(),
            rkey: info.rkey,
        })
    }

    /// Reads a cuda_gdr tensor straight into `dst`'s GPU memory (its allocation registered and
    /// cached, kept alive by the cache). If this future is dropped mid-read, a clone of `dst` is
    /// leaked so the memory outlives the NIC's writes, and the pipe fails.
    async fn gdr_read(&self, cache: &mut RegCache, dst: &CudaBuffer, source: RdmaSource) -> Result<()> {
        let info = gdr::cached(cache, dst, Access::LOCAL)
            .map_err(|e| self.rdma_error("cuda_gdr", format!("registering the destination: {e}")))?;
        let mut lease = Lease {
            held: Some(dst.clone()),
            inner: &self.inner,
            channel: "cuda_gdr",
        };
        // SAFETY: `dst` lies in the registered allocation (addressed by device addresses), which
        // the cache and the lease keep allocated until the read completes (or for ever).
        let result = unsafe { self.pull(dst.ptr(), info.lkey, dst.len(), source) }.await;
        lease.held = None;
        result
    }

    /// Queues the copy of a cuda_ipc/cuda_p2p tensor into `dst` on its stream, after the
    /// sender's ready event, and records the event the sender will wait on.
    fn copy_in(
        &self,
        dst: &CudaBuffer,
        source_device: Device,
        source: &CudaSource,
        channel: ChannelKind,
    ) -> Result<(CudaDone, EventSlot)> {
        let fail = |e: CudaError| self.cuda_error(channel, e);
        let device = dst.device();
        match source {
            CudaSource::Local { address, event } => {
                let Device::Cuda(from) = source_device else {
                    return Err(self.inner.protocol("a CUDA address from a CPU tensor"));
                };
                if !self.inner.same_process {
                    return Err(self.inner.protocol("a local CUDA address from another process"));
                }
                events::stream_wait(dst.stream(), driver::RawEvent(*event as usize)).map_err(fail)?;
                // SAFETY: the peer is this very process (checked by token), so the address is
                // the sender's live buffer, kept alive by its pipe until our acknowledgement
                // and ordered after its ready event.
                unsafe { dst.copy_from_address(from, *address) }.map_err(fail)?;
            }
            CudaSource::Ipc { memory, offset, event } => {
                if self.inner.same_process {
                    return Err(self.inner.protocol("IPC handles from this very process"));
                }
                let (memory, event) = match (ipc_handle(memory), ipc_handle(event)) {
                    (Some(m), Some(e)) => (m, e),
                    _ => return Err(self.inner.protocol("malformed IPC handle")),
                };
                let peer = self.inner.peer_process;
                let (base, size) = ipc::open_memory(peer, device, &memory).map_err(fail)?;
                if offset.checked_add(dst.len() as u64).is_none_or(|end| end > size as u64) {
                    return Err(self.inner.protocol(format!(
                        "{} bytes at offset {offset} of a {size}-byte allocation",
                        dst.len()
                    )));
                }
                let ready = ipc::open_event(peer, device, &event).map_err(fail)?;
                events::stream_wait(dst.stream(), ready).map_err(fail)?;
                // SAFETY: the range lies inside the peer's allocation (checked above), which
                // the peer keeps alive until our acknowledgement, and the copy is ordered after
                // its ready event.
                unsafe { dst.copy_from_address(device, base + offset) }.map_err(fail)?;
            }
        }
        let copied = EventSlot::take(device).map_err(fail)?;
        copied.record(dst.stream()).map_err(fail)?;
        let ack = if self.inner.same_process {
            CudaDone::Local {
                event: copied.raw().0 as u64,
            }
        } else {
            CudaDone::Ipc {
                event: Bytes::copy_from_slice(&copied.ipc_handle()),
            }
        };
        Ok((ack, copied))
    }
}

/// A 64-byte IPC handle from the wire.
fn ipc_handle(b: &Bytes) -> Option<[u8; driver::IPC_HANDLE_BYTES]> {
    b.as_ref().try_into().ok()
}

fn check_allocation(d: &WireDescriptor, a: &Allocation) -> std::result::Result<(), String> {
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
        if b.len() as u64 != t.length && !t.in_segment() {
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

/// Whether a tensor of `length` bytes on `channel` travels by RDMA read (the descriptor then
/// carries its source), rather than through the control connection or not at all.
fn carried_by_rdma(channel: ChannelKind, length: u64) -> bool {
    match channel {
        ChannelKind::Rdma => length >= rdma::INLINE_MAX as u64,
        ChannelKind::CudaGdr => length > 0,
        _ => false,
    }
}

/// What an RDMA read writes into. Dropped before the read finished (the future was cancelled),
/// it leaks what it holds, since the NIC may still write there, and fails the pipe.
struct Lease<'a, T> {
    held: Option<T>,
    inner: &'a Inner,
    channel: &'static str,
}

impl<T> Drop for Lease<'_, T> {
    fn drop(&mut self) {
        if let Some(held) = self.held.take() {
            std::mem::forget(held);
            self.inner.fail(PipeError::Channel {
                peer: self.inner.info.peer.clone(),
                channel: self.channel,
                detail: "a read was cancelled while the NIC could still write its memory".into(),
            });
        }
    }
}

async fn read_exact_frame(reader: &mut AnyReader, dst: &mut [u8], inner: &Inner) -> Result<()> {
    let n = reader.read(dst).await?;
    if n != dst.len() {
        return Err(inner.protocol(format!("frame of {n} bytes where {} were announced", dst.len())));
    }
    Ok(())
}

async fn cma_read(pid: i32, address: u64, dst: &mut BytesMut) -> std::result::Result<(), String> {
    if dst.len() < CMA_OFFLOAD {
        return cma::read_remote(pid, address, dst).map_err(|e| e.to_string());
    }
    // A large copy would stall this runtime thread for milliseconds: run it on a blocking
    // thread, lending it the buffer.
    let mut buf = std::mem::take(dst);
    let (buf, result) = tokio::task::spawn_blocking(move || {
        let r = cma::read_remote(pid, address, &mut buf);
        (buf, r)
    })
    .await
    .map_err(|e| format!("copy thread failed: {e}"))?;
    *dst = buf;
    result.map_err(|e| e.to_string())
}

/// Where a cma-channel tensor goes: inline when small, into the peer's segment when it fits
/// (reserving its blocks in `reserved`), else by cross-memory attach.
fn place_cpu(outbox: Option<&Arc<Segment>>, reserved: &mut Option<Reserved>, b: &Bytes) -> CpuSource {
    if b.len() < INLINE_MAX {
        return CpuSource::Inline;
    }
    if let Some(seg) = outbox {
        if let Some(offset) = seg.allocate(b.len()) {
            reserved
                .get_or_insert_with(|| Reserved {
                    segment: seg.clone(),
                    ranges: Vec::new(),
                    announced: false,
                })
                .ranges
                .push((offset, b.clone()));
            return CpuSource::Segment { offset };
        }
    }
    CpuSource::Cma {
        address: b.as_ptr() as u64,
    }
}

/// What one lane task hands back: its lane, what it carried (if anything), and how it went.
type LaneOutcome<L, X> = (L, X, std::result::Result<(), sluice_transport::TransportError>);

/// Awaits the lane tasks in lane order and puts the lanes back in front (keeping lane order).
/// Returns what each finished task carried, even when one failed, and the first error (naming
/// the peer).
async fn join_lanes<L, X>(
    lanes: &mut Vec<L>,
    tasks: Vec<tokio::task::JoinHandle<LaneOutcome<L, X>>>,
    peer: &str,
) -> (Vec<X>, Result<()>) {
    let mut first_error: Option<PipeError> = None;
    let mut returned = Vec::with_capacity(tasks.len());
    let mut carried = Vec::with_capacity(tasks.len());
    for t in tasks {
        match t.await {
            Ok((lane, x, r)) => {
                returned.push(lane);
                carried.push(x);
                if let Err(e) = r {
                    first_error.get_or_insert(e.into());
                }
            }
            Err(e) => {
                first_error.get_or_insert(PipeError::Channel {
                    peer: peer.to_owned(),
                    channel: "multilane",
                    detail: e.to_string(),
                });
            }
        }
    }
    returned.append(lanes);
    *lanes = returned;
    (carried, first_error.map_or(Ok(()), Err))
}

/// Sends `bytes` over the lanes, one piece per lane, all lanes at once.
async fn send_lanes(lanes: &mut Vec<AnyWriter>, bytes: &Bytes, peer: &str) -> Result<()> {
    let pieces = multilane::pieces(bytes.len(), lanes.len());
    let taken: Vec<AnyWriter> = lanes.drain(..pieces.len()).collect();
    let tasks = taken
        .into_iter()
        .zip(pieces)
        .map(|(mut lane, range)| {
            let piece = bytes.slice(range);
            tokio::spawn(async move {
                let r = lane.write(&[&piece]).await;
                (lane, (), r)
            })
        })
        .collect();
    join_lanes(lanes, tasks, peer).await.1
}

/// Receives a tensor's pieces from the lanes straight into `dst`, all lanes at once.
async fn recv_lanes(lanes: &mut Vec<AnyReader>, dst: &mut BytesMut, peer: &str) -> Result<()> {
    let pieces = multilane::pieces(dst.len(), lanes.len());
    let mut whole = std::mem::take(dst);
    let mut chunks = Vec::with_capacity(pieces.len());
    for range in pieces.iter().rev() {
        chunks.push(whole.split_off(range.start));
    }
    chunks.reverse();
    let taken: Vec<AnyReader> = lanes.drain(..pieces.len()).collect();
    let tasks = taken
        .into_iter()
        .zip(chunks)
        .map(|(mut lane, mut chunk)| {
            tokio::spawn(async move {
                let r = lane.read(&mut chunk).await.and_then(|n| {
                    if n == chunk.len() {
                        Ok(())
                    } else {
                        Err(sluice_transport::TransportError::FrameTooLarge {
                            peer: lane.peer().to_owned(),
                            len: n as u64,
                            limit: chunk.len(),
                        })
                    }
                });
                (lane, chunk, r)
            })
        })
        .collect();
    let (chunks, result) = join_lanes(lanes, tasks, peer).await;
    for chunk in chunks {
        // Pieces were split off one allocation in order, so this re-joins without copying.
        whole.unsplit(chunk);
    }
    *dst = whole;
    result
}
