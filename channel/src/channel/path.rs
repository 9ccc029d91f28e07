//! The data path every channel implements, and the one place the pipe dispatches on the
//! channel. For each tensor it carries, a channel owns:
//!
//! - **prepare** (sender, before the descriptor goes out): decide how the bytes travel and say
//!   so as a wire [`Source`]; reserve, register or export what the receiver will read.
//! - **send** (sender, after the descriptor and the payloads): put the bytes on the pipe's
//!   connections, when they travel there.
//! - **accept** (receiver, when the descriptor arrives): whether a [`Source`] from the peer is
//!   one this channel produces. Anything else is a protocol error that fails the pipe.
//! - **recv** (receiver): move the bytes into the receiver's buffer, and say whether the
//!   sender must be acknowledged (and with what, for the CUDA channels).
//! - **finish** (sender, once acknowledged): what the acknowledgement carried back.
//!
//! The pipe keeps ordering, the acknowledgement round trip and sticky errors; the functions
//! below are the only `match` on [`ChannelKind`] in the data path. A zero-length tensor is
//! [`Source::Empty`] on every channel and never reaches one.

use std::sync::Arc;

use bytes::Bytes;
use sluice_transport::any::{AnyReader, AnyWriter};
use sluice_transport::ibv::RdmaHandle;
use sluice_transport::{FrameReader, FrameWriter};

use super::rdma::RegCache;
use super::segment::Segment;
use super::{basic, cma, gdr, multilane, rdma, ChannelKind};
use crate::cuda::events::EventSlot;
use crate::cuda::{direct, staged};
use crate::device::{Device, RecvBuffer, SendBuffer};
use crate::error::{PipeError, Result};
use crate::wire::{CudaDone, Source};

/// The sending side of a pipe, as its channels see it.
pub(crate) struct Tx {
    pub control: AnyWriter,
    /// multilane's connections.
    pub lanes: Vec<AnyWriter>,
    /// cma: the peer's segment, which tensors are copied into when they fit.
    pub outbox: Option<Arc<Segment>>,
    /// rdma: registrations of sent tensors.
    pub registrations: Option<RegCache>,
    /// cuda_gdr: registrations of sent GPU allocations.
    pub gpu_registrations: Option<RegCache>,
}

impl Tx {
    /// The receiver acknowledged everything sent so far: registrations may be evicted again.
    pub fn acknowledged(&mut self) {
        for c in [self.registrations.as_mut(), self.gpu_registrations.as_mut()]
            .into_iter()
            .flatten()
        {
            c.unpin_all();
        }
    }
}

/// The receiving side of a pipe, as its channels see it.
pub(crate) struct Rx {
    pub control: AnyReader,
    /// multilane's connections.
    pub lanes: Vec<AnyReader>,
    /// cma: the segment tensors from the peer arrive in.
    pub inbox: Option<Arc<Segment>>,
    /// cuda_gdr: registrations of receiving GPU allocations.
    pub gpu_targets: Option<RegCache>,
    /// rdma: registered memory CPU tensors are read into, lent to the reader.
    pub landing: Option<Arc<rdma::RecvPool>>,
    /// cuda_ipc/cuda_p2p: events whose handles went to the sender in the last
    /// acknowledgement. It may still be queueing waits on them until its next message arrives,
    /// so they are not reused before.
    pub held: Vec<EventSlot>,
}

impl Rx {
    /// A message was received whole.
    pub fn finished(&mut self) {
        if let Some(c) = self.gpu_targets.as_mut() {
            c.unpin_all();
        }
    }
}

/// What a channel knows of the pipe it works for.
pub(crate) struct Link<'a> {
    pub peer: &'a str,
    pub pid: u32,
    /// The peer's process token, and whether it is this very process.
    pub process: u64,
    pub same_process: bool,
    /// One-sided RDMA on the control connection (when it is ibverbs).
    pub rdma: Option<&'a RdmaHandle>,
    /// Fails the pipe (a read abandoned while the NIC may still write its memory).
    pub poison: &'a (dyn Fn(PipeError) -> PipeError + Send + Sync),
}

impl Link<'_> {
    pub fn protocol(&self, detail: impl Into<String>) -> PipeError {
        PipeError::Protocol {
            peer: self.peer.to_owned(),
            detail: detail.into(),
        }
    }

    pub fn channel_error(&self, channel: ChannelKind, detail: impl Into<String>) -> PipeError {
        PipeError::Channel {
            peer: self.peer.to_owned(),
            channel: channel.name(),
            detail: detail.into(),
        }
    }

    /// A buffer of a kind the channel does not carry.
    pub fn wrong_buffer(&self, channel: ChannelKind, device: Device) -> PipeError {
        self.protocol(format!(
            "channel {channel} was negotiated for a {device} buffer it cannot carry"
        ))
    }

    pub fn rdma(&self) -> Result<&RdmaHandle> {
        self.rdma
            .ok_or_else(|| self.protocol("an RDMA channel negotiated without an ibverbs connection"))
    }
}

/// Per-message work that must happen between preparing the tensors and announcing them.
#[derive(Default)]
pub(crate) struct Staging {
    /// cma: blocks of the peer's segment reserved for this message, copied into before the
    /// descriptor leaves.
    pub reserved: Option<cma::Reserved>,
}

impl Staging {
    /// Does the copies the descriptor will announce as done.
    pub async fn before_announce(&mut self, link: &Link<'_>) -> Result<()> {
        if let Some(r) = self.reserved.take() {
            self.reserved = Some(cma::copy_reserved(r, link).await?);
        }
        Ok(())
    }

    /// The descriptor went out: what it announced belongs to the receiver now.
    pub fn announced(&mut self) {
        if let Some(r) = self.reserved.as_mut() {
            r.announced = true;
        }
    }
}

/// A tensor prepared for sending.
pub(crate) struct Prepared {
    pub source: Source,
    /// cuda_ipc/cuda_p2p: the event recorded on the sender's stream once the data was ready,
    /// which the receiver waits on; kept until acknowledged.
    pub ready: Option<EventSlot>,
    /// cuda_ipc: the copy of a buffer Sluice did not allocate, exported in its place; kept
    /// until acknowledged.
    pub _keep: Option<crate::cuda::CudaBuffer>,
}

impl From<Source> for Prepared {
    fn from(source: Source) -> Self {
        Prepared {
            source,
            ready: None,
            _keep: None,
        }
    }
}

/// What the receiver owes the sender for one tensor.
pub(crate) enum Received {
    /// Nothing: the bytes came through the pipe's connections or the receiver's segment.
    Done,
    /// An acknowledgement (the sender keeps its buffer until then).
    Ack,
    /// An acknowledgement carrying the event recorded after the receiver's copy.
    Cuda(CudaDone),
}

/// Sender, before the descriptor: how `buffer` travels on `channel`.
pub(crate) fn prepare(
    channel: ChannelKind,
    tx: &mut Tx,
    link: &Link<'_>,
    buffer: &SendBuffer,
    staging: &mut Staging,
) -> Result<Prepared> {
    if buffer.is_empty() {
        return Ok(Source::Empty.into());
    }
    match (channel, buffer) {
        (ChannelKind::Basic, SendBuffer::Cpu(_)) => Ok(Source::Inline.into()),
        (ChannelKind::Cma, SendBuffer::Cpu(b)) => Ok(cma::prepare(tx, b, staging).into()),
        (ChannelKind::MultiLane, SendBuffer::Cpu(b)) => Ok(multilane::prepare(b.len()).into()),
        (ChannelKind::Rdma, SendBuffer::Cpu(b)) => rdma::prepare(tx, link, b).map(Into::into),
        (ChannelKind::CudaStaged, _) => Ok(Source::Staged.into()),
        (ChannelKind::CudaGdr, SendBuffer::Cuda(b)) => gdr::prepare(tx, link, b).map(Into::into),
        (ChannelKind::CudaIpc | ChannelKind::CudaP2p, SendBuffer::Cuda(b)) => direct::prepare(channel, link, b),
        (k, b) => Err(link.wrong_buffer(k, b.device())),
    }
}

/// Sender, for the immediate write path: the source [`prepare`] gives a CPU tensor that needs
/// nothing of the pipe (sent inline in the message's frame, or empty); `None` for any other.
/// A reference to a constant: the write path lists one per tensor, and a `Source` is large (a
/// CUDA one carries two IPC handles).
pub(crate) fn immediate(channel: ChannelKind, buffer: &SendBuffer) -> Option<&'static Source> {
    const EMPTY: &Source = &Source::Empty;
    const INLINE: &Source = &Source::Inline;
    let SendBuffer::Cpu(b) = buffer else { return None };
    if b.is_empty() {
        return Some(EMPTY);
    }
    let inline = match channel {
        ChannelKind::Basic => true,
        ChannelKind::Cma => b.len() < cma::INLINE_MAX,
        ChannelKind::MultiLane => b.len() < multilane::MIN_PIECE,
        _ => false,
    };
    inline.then_some(INLINE)
}

/// Sender, after the descriptor and payloads: the tensor's bytes, where they travel on the
/// pipe's connections.
pub(crate) async fn send(
    channel: ChannelKind,
    tx: &mut Tx,
    link: &Link<'_>,
    buffer: &SendBuffer,
    source: &Source,
) -> Result<()> {
    match (source, buffer) {
        (Source::Inline, SendBuffer::Cpu(b)) => basic::send(tx, b).await,
        (Source::Lanes, SendBuffer::Cpu(b)) => multilane::send(tx, link, b).await,
        (Source::Staged, b) => staged::send(tx, link, b).await,
        (Source::Inline | Source::Lanes, b) => Err(link.wrong_buffer(channel, b.device())),
        // Everything else is read by the receiver where it lies (or needs nothing).
        _ => Ok(()),
    }
}

/// Receiver, when the descriptor arrives: whether `source` for `length` bytes is one that
/// `channel` produces, and usable by this side.
pub(crate) fn accepts(channel: ChannelKind, rx: &Rx, link: &Link<'_>, source: &Source, length: u64) -> Result<()> {
    if produces(channel, source, length, rx.inbox.is_some(), link.same_process) {
        Ok(())
    } else {
        Err(link.protocol(format!(
            "a {length}-byte tensor announced as {} on channel {channel}",
            source.name()
        )))
    }
}

/// Whether `channel` produces `source` for a `length`-byte tensor, given whether this side has
/// a segment and whether the peer is this very process.
fn produces(channel: ChannelKind, source: &Source, length: u64, has_inbox: bool, same_process: bool) -> bool {
    match (channel, source) {
        (_, Source::Empty) => length == 0,
        (ChannelKind::Basic, s) => matches!(s, Source::Inline),
        (ChannelKind::Cma, s) => cma::accepts(has_inbox, s),
        (ChannelKind::MultiLane, s) => matches!(s, Source::Inline | Source::Lanes),
        (ChannelKind::Rdma, s) => matches!(s, Source::Inline | Source::Rdma { .. }),
        (ChannelKind::CudaStaged, s) => matches!(s, Source::Staged),
        (ChannelKind::CudaGdr, s) => matches!(s, Source::Rdma { .. }),
        (ChannelKind::CudaIpc | ChannelKind::CudaP2p, s) => direct::accepts(same_process, s),
    }
}

/// Receiver: moves an accepted tensor into `buffer` (a CPU buffer may be replaced by the
/// shared memory the tensor already lies in).
pub(crate) async fn recv(
    channel: ChannelKind,
    rx: &mut Rx,
    link: &Link<'_>,
    source: &Source,
    length: u64,
    source_device: Device,
    buffer: &mut RecvBuffer,
) -> Result<Received> {
    if let Source::Segment { offset } = source {
        return cma::take(rx, link, *offset, length, buffer);
    }
    if let (&Source::Rdma { addr, rkey }, ChannelKind::Rdma, Some(pool)) = (source, channel, rx.landing.as_ref()) {
        if lands_in_pool(length, buffer) {
            if let Some(b) = rdma::recv_pooled(link, pool, length as usize, addr, rkey).await? {
                *buffer = RecvBuffer::Shared(b);
                return Ok(Received::Ack);
            }
            // The pool is over its budget: a buffer of our own, registered for this read.
            *buffer = RecvBuffer::cpu(length as usize);
        }
    }
    writable(buffer);
    match (source, buffer) {
        (Source::Empty, _) => Ok(Received::Done),
        (Source::Inline, RecvBuffer::Cpu(dst)) => basic::recv(rx, link, dst).await.map(|()| Received::Done),
        (Source::Lanes, RecvBuffer::Cpu(dst)) => multilane::recv(rx, link, dst).await.map(|()| Received::Done),
        (Source::Staged, dst) => staged::recv(rx, link, dst).await.map(|()| Received::Done),
        (Source::Cma { address }, RecvBuffer::Cpu(dst)) => cma::recv(link, *address, dst).await.map(|()| Received::Ack),
        (&Source::Rdma { addr, rkey }, RecvBuffer::Cpu(dst)) if channel == ChannelKind::Rdma => {
            rdma::recv(link, dst, addr, rkey).await.map(|()| Received::Ack)
        }
        (&Source::Rdma { addr, rkey }, RecvBuffer::Cuda(dst)) if channel == ChannelKind::CudaGdr => {
            gdr::recv(rx, link, dst, addr, rkey).await.map(|()| Received::Ack)
        }
        (s @ (Source::CudaIpc { .. } | Source::CudaLocal { .. }), RecvBuffer::Cuda(dst)) => {
            direct::recv(channel, rx, link, s, source_device, dst)
                .await
                .map(Received::Cuda)
        }
        (_, b) => Err(link.protocol(format!("channel {channel} cannot fill a {} buffer", b.device()))),
    }
}

/// A buffer handed back from an earlier read (shared, read-only) is replaced by writable memory
/// of its length: the tensor being received is written into it.
fn writable(buffer: &mut RecvBuffer) {
    if let RecvBuffer::Shared(b) = buffer {
        *buffer = RecvBuffer::cpu(b.len());
    }
}

/// Whether an rdma tensor of `length` bytes, for which the reader supplied `buffer`, lands in
/// the receive pool: the descriptor announced it so (the reader supplied no memory).
fn lands_in_pool(length: u64, buffer: &RecvBuffer) -> bool {
    length > 0 && buffer.is_empty() && matches!(buffer, RecvBuffer::Cpu(_) | RecvBuffer::Shared(_))
}

/// Sender, once acknowledged: what the receiver sent back for one CUDA tensor.
pub(crate) async fn finish(
    channel: ChannelKind,
    link: &Link<'_>,
    buffer: &SendBuffer,
    prepared: &Prepared,
    done: &CudaDone,
) -> Result<()> {
    match buffer {
        SendBuffer::Cuda(b) if channel.is_direct_cuda() => {
            direct::finish(channel, link, b, prepared._keep.as_ref(), done).await
        }
        b => Err(link.wrong_buffer(channel, b.device())),
    }
}

/// Writes an inline tensor as one frame on the control connection (held for the message's
/// single transport write).
pub(crate) async fn send_inline(tx: &mut Tx, bytes: &Bytes) -> Result<()> {
    Ok(tx.control.write_deferred(&[bytes]).await?)
}

/// Receiver: an inline tensor of a packed message, whose bytes came in the descriptor's frame.
pub(crate) fn recv_packed(channel: ChannelKind, link: &Link<'_>, bytes: &[u8], buffer: &mut RecvBuffer) -> Result<()> {
    writable(buffer);
    match buffer {
        RecvBuffer::Cpu(dst) if dst.len() == bytes.len() => {
            dst.copy_from_slice(bytes);
            Ok(())
        }
        RecvBuffer::Cpu(dst) => {
            Err(link.protocol(format!("{} packed bytes for a {}-byte buffer", bytes.len(), dst.len())))
        }
        b => Err(link.protocol(format!("channel {channel} cannot fill a {} buffer", b.device()))),
    }
}

/// Reads one frame of exactly `dst.len()` bytes from the control connection.
pub(crate) async fn recv_inline(control: &mut AnyReader, link: &Link<'_>, dst: &mut [u8]) -> Result<()> {
    let n = control.read(dst).await?;
    if n != dst.len() {
        return Err(link.protocol(format!("frame of {n} bytes where {} were announced", dst.len())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources() -> Vec<Source> {
        vec![
            Source::Empty,
            Source::Inline,
            Source::Lanes,
            Source::Staged,
            Source::Segment { offset: 0 },
            Source::Cma { address: 1 },
            Source::Rdma { addr: 1, rkey: 2 },
            Source::CudaIpc {
                memory: Bytes::from_static(&[0; 64]),
                offset: 0,
                size: 64,
                event: Bytes::from_static(&[0; 64]),
            },
            Source::CudaLocal { address: 1, event: 2 },
        ]
    }

    /// The immediate write path sends inline exactly what `prepare` would (the same
    /// thresholds), and only what the receiver accepts; GPU buffers never.
    #[test]
    fn immediate_sources_match_prepare_and_are_accepted() {
        let cpu = |n: usize| SendBuffer::Cpu(Bytes::from(vec![1u8; n]));
        let cases = [
            (ChannelKind::Basic, 1 << 20, true),
            (ChannelKind::Cma, cma::INLINE_MAX - 1, true),
            (ChannelKind::Cma, cma::INLINE_MAX, false),
            (ChannelKind::MultiLane, multilane::MIN_PIECE - 1, true),
            (ChannelKind::MultiLane, multilane::MIN_PIECE, false),
            (ChannelKind::Rdma, 8, false),
            (ChannelKind::CudaStaged, 8, false),
        ];
        for (channel, len, inline) in cases {
            let got = immediate(channel, &cpu(len));
            assert_eq!(got.is_some(), inline, "{channel} {len} B");
            if let Some(source) = got {
                assert!(matches!(source, Source::Inline));
                for inbox in [false, true] {
                    assert!(produces(channel, source, len as u64, inbox, false), "{channel} {len} B");
                }
            }
            assert!(
                matches!(immediate(channel, &cpu(0)), Some(Source::Empty)),
                "{channel}: empty"
            );
        }
    }

    /// Each channel accepts exactly the sources it produces; everything else a peer could
    /// announce is refused (and fails the pipe as a protocol error).
    #[test]
    fn each_channel_accepts_only_its_own_sources() {
        let table: [(ChannelKind, &[&str]); 8] = [
            (ChannelKind::Basic, &["inline"]),
            (ChannelKind::Cma, &["inline", "segment", "cma"]),
            (ChannelKind::MultiLane, &["inline", "lanes"]),
            (ChannelKind::Rdma, &["inline", "rdma"]),
            (ChannelKind::CudaStaged, &["staged"]),
            (ChannelKind::CudaGdr, &["rdma"]),
            (ChannelKind::CudaIpc, &["cuda-ipc"]),
            (ChannelKind::CudaP2p, &["cuda-ipc"]),
        ];
        for (channel, ok) in table {
            for s in sources() {
                let want = ok.contains(&s.name());
                assert_eq!(produces(channel, &s, 9, true, false), want, "{channel} {}", s.name());
            }
            // Empty only for zero bytes, on every channel.
            assert!(produces(channel, &Source::Empty, 0, true, false));
            assert!(!produces(channel, &Source::Empty, 1, true, false));
        }
        // A segment only where this side has one.
        assert!(!produces(
            ChannelKind::Cma,
            &Source::Segment { offset: 0 },
            9,
            false,
            false
        ));
        // Local CUDA addresses only from this very process, IPC handles only from another.
        let local = Source::CudaLocal { address: 1, event: 2 };
        assert!(produces(ChannelKind::CudaIpc, &local, 9, true, true));
        assert!(!produces(ChannelKind::CudaIpc, &sources()[7], 9, true, true));
    }
}
