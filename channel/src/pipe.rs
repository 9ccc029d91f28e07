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
//!   lanes drained, and for CMA the receiver's acknowledgement received. So a CMA write waits
//!   until the peer has *read* the message: do not await a write and then, on the same task,
//!   the read the peer's reply depends on being made by this side. If a write is
//!   cancelled while the peer may still be reading its memory, the pipe keeps the buffers alive
//!   until it is dropped.
//! - **Sticky errors.** The first failure closes every connection of the pipe; every pending and
//!   later operation fails with that same error. [`Pipe::read`] hands the allocation back even
//!   then. Misuse (reading without a descriptor, a wrong allocation) is reported without
//!   breaking the pipe.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};
use sluice_transport::any::{AnyReader, AnyWriter};
use sluice_transport::{Closer, FrameReader, FrameWriter};
use tokio::sync::Mutex;

use crate::channel::{cma, multilane, ChannelKind};
use crate::device::{Device, RecvBuffer, SendBuffer};
use crate::error::{PipeError, Result};
use crate::message::{Allocation, Descriptor, Message, TensorDescriptor};
use crate::wire::{self, Ack, WireDescriptor, WireTensor};

/// Tensors at least this long are copied by CMA on a blocking thread rather than inline.
const CMA_OFFLOAD: usize = 1 << 20;

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
    pub lanes: usize,
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
    /// CMA sources the peer may still be reading (cleared once acknowledged).
    exposed: Vec<Bytes>,
}

struct ReadSide {
    control: AnyReader,
    acks: AnyWriter,
    lanes: Vec<AnyReader>,
    seq: u64,
    pending: Option<WireDescriptor>,
}

struct Inner {
    info: PipeInfo,
    max_descriptor: usize,
    failed: AtomicBool,
    error: OnceLock<PipeError>,
    closers: Vec<Closer>,
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
    pub(crate) fn new(info: PipeInfo, links: Links, max_descriptor: usize) -> Pipe {
        let mut closers = vec![links.control.0.closer(), links.reply.0.closer()];
        closers.extend(links.lanes.iter().map(|(r, _)| r.closer()));
        let (lane_readers, lane_writers): (Vec<_>, Vec<_>) = links.lanes.into_iter().unzip();
        Pipe {
            inner: Arc::new(Inner {
                info,
                max_descriptor,
                failed: AtomicBool::new(false),
                error: OnceLock::new(),
                closers,
                writer: Mutex::new(WriteSide {
                    control: links.control.1,
                    acks: links.reply.0,
                    lanes: lane_writers,
                    seq: 0,
                    exposed: Vec::new(),
                }),
                reader: Mutex::new(ReadSide {
                    control: links.control.0,
                    acks: links.reply.1,
                    lanes: lane_readers,
                    seq: 0,
                    pending: None,
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

    fn channel_for(&self, source: Device, target: Device) -> Result<ChannelKind> {
        match (source, target) {
            (Device::Cpu, Device::Cpu) => Ok(self.inner.info.cpu_channel),
            (source, target) => Err(PipeError::Negotiation {
                peer: self.inner.info.peer.clone(),
                reason: format!("no channel moves {source} memory to {target} (CUDA channels are not built yet)"),
            }),
        }
    }

    /// Sends `message`. Completes, in issue order, once every buffer of the message may be
    /// reused.
    pub async fn write(&self, message: &Message) -> Result<()> {
        let mut side = self.inner.writer.lock().await;
        self.inner.check()?;
        match self.write_locked(&mut side, message).await {
            Ok(()) => Ok(()),
            Err(e) => Err(self.inner.fail(e)),
        }
    }

    async fn write_locked(&self, side: &mut WriteSide, message: &Message) -> Result<()> {
        let seq = side.seq;
        let mut channels = Vec::with_capacity(message.tensors.len());
        let mut tensors = Vec::with_capacity(message.tensors.len());
        for t in &message.tensors {
            let source = t.buffer.device();
            // Nothing is written yet, so an unmovable tensor is the caller's mistake, not the
            // pipe's: report it without breaking the pipe.
            let channel = self
                .channel_for(source, t.target_device.unwrap_or(source))
                .map_err(|e| PipeError::Misuse(e.to_string()))?;
            let address = match (&t.buffer, channel) {
                (SendBuffer::Cpu(b), ChannelKind::Cma) => {
                    side.exposed.push(b.clone());
                    Some(b.as_ptr() as u64)
                }
                _ => None,
            };
            channels.push(channel);
            tensors.push(WireTensor {
                length: t.buffer.len() as u64,
                source,
                target: t.target_device,
                metadata: t.metadata.clone(),
                address,
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
        side.control.write(&[&wire::encode(&descriptor)]).await?;
        for p in &message.payloads {
            side.control.write(&[p]).await?;
        }
        let mut cma_pending = false;
        for (t, channel) in message.tensors.iter().zip(&channels) {
            let SendBuffer::Cpu(bytes) = &t.buffer;
            match channel {
                ChannelKind::Basic => side.control.write(&[bytes]).await?,
                ChannelKind::MultiLane => send_lanes(&mut side.lanes, bytes, &self.inner.info.peer).await?,
                ChannelKind::Cma => cma_pending = true,
            }
        }
        if cma_pending {
            let ack = side.acks.read_vec(64).await?;
            let ack: Ack = wire::decode(&ack, &self.inner.info.peer)?;
            if ack.seq != seq {
                return Err(self.inner.protocol(format!(
                    "acknowledgement for message {} while waiting for {seq}",
                    ack.seq
                )));
            }
            side.exposed.clear();
        }
        Ok(())
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
                .channel_for(t.source, t.target.unwrap_or(t.source))
                .map_err(|e| self.inner.fail(e))?;
            if (channel == ChannelKind::Cma) != t.address.is_some() {
                return Err(self.inner.fail(
                    self.inner
                        .protocol("tensor address does not match the negotiated channel"),
                ));
            }
        }
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
                })
                .collect(),
        };
        side.pending = Some(descriptor);
        Ok(public)
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
        for (t, buf) in descriptor.tensors.iter().zip(allocation.tensors.iter_mut()) {
            let RecvBuffer::Cpu(dst) = buf;
            match self.channel_for(t.source, t.target.unwrap_or(t.source))? {
                ChannelKind::Basic => read_exact_frame(&mut side.control, dst, &self.inner).await?,
                ChannelKind::MultiLane => recv_lanes(&mut side.lanes, dst, &self.inner.info.peer).await?,
                ChannelKind::Cma => {
                    cma = true;
                    let address = t.address.expect("checked in read_descriptor");
                    cma_read(self.inner.info.peer_pid as i32, address, dst)
                        .await
                        .map_err(|detail| PipeError::Channel {
                            peer: self.inner.info.peer.clone(),
                            channel: "cma",
                            detail,
                        })?;
                }
            }
        }
        if cma {
            side.acks.write(&[&wire::encode(&Ack { seq: descriptor.seq })]).await?;
        }
        Ok(())
    }
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
        if b.len() as u64 != t.length {
            return Err(format!(
                "tensor {i}: buffer of {} bytes for {} bytes",
                b.len(),
                t.length
            ));
        }
        if let Some(target) = t.target {
            if b.device() != target {
                return Err(format!(
                    "tensor {i}: buffer on {} but the sender asked for {target}",
                    b.device()
                ));
            }
        }
    }
    Ok(())
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
