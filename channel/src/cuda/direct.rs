//! The data path of cuda_ipc and cuda_p2p: the receiver copies straight from the sender's GPU
//! memory, device to device, ordered by events on both sides' streams.
//!
//! - Sender ([`prepare`]): records a *ready* event on the buffer's stream and describes the
//!   bytes: a plain address and event within one process ([`Source::CudaLocal`]), IPC handles
//!   of the allocation (with its size) and the event otherwise ([`Source::CudaIpc`]). Only
//!   Sluice's own memory is exported, because exported memory must outlive every importer's
//!   mapping and Sluice keeps it for good; a buffer wrapped from elsewhere is first copied
//!   (on its stream) into a block of ours. The buffer is kept until the receiver acknowledges.
//! - Receiver ([`recv`]): makes its stream wait for the ready event, queues the copy, records a
//!   *copied* event and sends it back in the acknowledgement. The read completes once the copy
//!   is queued.
//! - Sender, acknowledged ([`finish`]): makes the buffer's stream wait for the copied event, so
//!   work queued there later (overwriting the buffer) runs after the copy.
//!
//! Every address and handle from the peer is checked: a local address only from this very
//! process (by token), IPC handles only from another, and the range inside the opened
//! allocation.
#![allow(unsafe_code)]

use bytes::Bytes;

use super::events::{self, EventSlot, PeerWait};
use super::trace::mark;
use super::{driver, ipc, CudaBuffer, CudaError, Event};
use crate::channel::path::{Link, Prepared, Rx};
use crate::channel::ChannelKind;
use crate::device::Device;
use crate::error::{PipeError, Result};
use crate::wire::{CudaDone, Source};

fn cuda_error(link: &Link<'_>, channel: ChannelKind, e: CudaError) -> PipeError {
    link.channel_error(channel, e.to_string())
}

/// Sender: the ready event and where the bytes are. A buffer that cannot be exported is the
/// caller's mistake (reported without breaking the pipe).
pub(crate) fn prepare(channel: ChannelKind, link: &Link<'_>, b: &CudaBuffer) -> Result<Prepared> {
    mark("send: prepare");
    let export = || -> std::result::Result<Prepared, CudaError> {
        // Across processes, memory we did not allocate is copied into ours first: its owner
        // could free it while the peer still maps it.
        let staged = match b.memory() {
            None if !link.same_process => {
                let copy = CudaBuffer::alloc_cached(b.len(), b.stream())?;
                copy.copy_from(b)?;
                Some(copy)
            }
            _ => None,
        };
        // Recorded after everything queued on the stream, the staging copy included.
        let event = EventSlot::take(b.device())?;
        event.record(b.stream())?;
        mark("send: ready recorded");
        let source = if link.same_process {
            Source::CudaLocal {
                address: b.ptr(),
                event: event.raw().0 as u64,
            }
        } else {
            let exported = staged.as_ref().unwrap_or(b).ipc_export()?;
            Source::CudaIpc {
                memory: Bytes::copy_from_slice(&exported.handle),
                offset: exported.offset,
                size: exported.size,
                event: Bytes::copy_from_slice(&event.ipc_handle()),
            }
        };
        Ok(Prepared {
            source,
            ready: Some(event),
            _keep: staged,
        })
    };
    export().map_err(|e| PipeError::Misuse(format!("{channel} cannot send this buffer: {e}")))
}

/// Receiver: a local address only from this very process, IPC handles only from another.
pub(crate) fn accepts(same_process: bool, source: &Source) -> bool {
    match source {
        Source::CudaLocal { .. } => same_process,
        Source::CudaIpc { .. } => !same_process,
        _ => false,
    }
}

/// Receiver: queues the copy into `dst` on its stream, after the sender's ready event, and
/// records the event the sender will wait on (held until the sender's next message).
pub(crate) async fn recv(
    channel: ChannelKind,
    rx: &mut Rx,
    link: &Link<'_>,
    source: &Source,
    source_device: Device,
    dst: &CudaBuffer,
) -> Result<CudaDone> {
    let fail = |e: CudaError| cuda_error(link, channel, e);
    let device = dst.device();
    match source {
        Source::CudaLocal { address, event } => {
            let Device::Cuda(from) = source_device else {
                return Err(link.protocol("a CUDA address from a CPU tensor"));
            };
            if !link.same_process {
                return Err(link.protocol("a local CUDA address from another process"));
            }
            events::stream_wait(dst.stream(), driver::RawEvent(*event as usize)).map_err(fail)?;
            // SAFETY: the peer is this very process (checked by token), so the address is the
            // sender's live buffer, kept alive by its pipe until our acknowledgement and
            // ordered after its ready event.
            unsafe { dst.copy_from_address(from, *address) }.map_err(fail)?;
        }
        Source::CudaIpc {
            memory,
            offset,
            size,
            event,
        } => {
            if link.same_process {
                return Err(link.protocol("IPC handles from this very process"));
            }
            let (memory, event) = match (ipc_handle(memory), ipc_handle(event)) {
                (Some(m), Some(e)) => (m, e),
                _ => return Err(link.protocol("malformed IPC handle")),
            };
            // Checked against the size the exporter states (a handle names one allocation:
            // the mapping refuses another size for it later), before anything is opened.
            if offset.checked_add(dst.len() as u64).is_none_or(|end| end > *size) {
                return Err(link.protocol(format!(
                    "{} bytes at offset {offset} of a {size}-byte allocation",
                    dst.len()
                )));
            }
            mark("recv: start");
            let mapping = ipc::open_memory(link.process, device, &memory, *size).map_err(|e| match e {
                CudaError::Invalid(detail) => link.protocol(detail),
                e => fail(e),
            })?;
            let ready = ipc::open_event(link.process, device, &event).map_err(fail)?;
            mark("recv: opened");
            if PeerWait::current().on_host(shares_gpu(channel)) {
                let raw = ready.raw();
                events::wait_host(device, raw, ready).await.map_err(fail)?;
            } else {
                events::stream_wait(dst.stream(), ready.raw()).map_err(fail)?;
            }
            mark("recv: waited for ready");
            // SAFETY: the range lies inside the peer's allocation (checked above), which the
            // peer never frees (exported memory is kept for good), and the copy is ordered
            // after its ready event.
            unsafe { dst.copy_from_address(device, mapping.base() + offset) }.map_err(fail)?;
            mark("recv: copy queued");
            // The mapping is closed only after this copy (and any other that read it). Without
            // a fence it can never be known unread: it is then left open for good.
            match Event::record(dst.stream()) {
                Ok(fence) => mapping.used(fence),
                Err(e) => {
                    std::mem::forget(mapping);
                    return Err(fail(e));
                }
            }
        }
        other => return Err(link.protocol(format!("{channel} cannot copy from a {} source", other.name()))),
    }
    let copied = EventSlot::take(device).map_err(fail)?;
    copied.record(dst.stream()).map_err(fail)?;
    let done = if link.same_process {
        CudaDone::Local {
            event: copied.raw().0 as u64,
        }
    } else {
        CudaDone::Ipc {
            event: Bytes::copy_from_slice(&copied.ipc_handle()),
        }
    };
    rx.held.push(copied);
    mark("recv: copied recorded");
    Ok(done)
}

/// Sender, acknowledged: makes the buffer's stream wait for the receiver's copy. Where the two
/// ends are one GPU in two processes the wait is made on the host (see [`PeerWait`]): the
/// write then completes once the copy has. That wait runs as a task of its own holding the
/// buffer and `staged` (the copy [`prepare`] exported in its place), so a write abandoned
/// meanwhile cannot hand either back for reuse while the peer still reads it.
pub(crate) async fn finish(
    channel: ChannelKind,
    link: &Link<'_>,
    buffer: &CudaBuffer,
    staged: Option<&CudaBuffer>,
    done: &CudaDone,
) -> Result<()> {
    let fail = |e| cuda_error(link, channel, e);
    match done {
        CudaDone::Local { event } if link.same_process => {
            events::stream_wait(buffer.stream(), driver::RawEvent(*event as usize)).map_err(fail)
        }
        CudaDone::Ipc { event } if !link.same_process => {
            let handle = ipc_handle(event).ok_or_else(|| link.protocol("malformed IPC event handle"))?;
            let copied = ipc::open_event(link.process, buffer.device(), &handle).map_err(fail)?;
            mark("send: acked");
            let waited = if PeerWait::current().on_host(shares_gpu(channel)) {
                let (device, raw) = (buffer.device(), copied.raw());
                let held = (copied, buffer.clone(), staged.cloned());
                match tokio::spawn(events::wait_host(device, raw, held)).await {
                    Ok(r) => r.map_err(fail),
                    Err(e) => Err(link.channel_error(channel, format!("waiting for the peer's copy: {e}"))),
                }
            } else {
                events::stream_wait(buffer.stream(), copied.raw()).map_err(fail)
            };
            mark("send: waited for copied");
            waited
        }
        _ => Err(link.protocol("acknowledgement of the wrong kind for this peer")),
    }
}

/// Whether the two ends of a cross-process transfer are one physical GPU: cuda_ipc connects a
/// GPU only with itself (the same UUID on the same host), cuda_p2p two different GPUs.
fn shares_gpu(channel: ChannelKind) -> bool {
    channel == ChannelKind::CudaIpc
}

/// A 64-byte IPC handle from the wire.
fn ipc_handle(b: &Bytes) -> Option<[u8; driver::IPC_HANDLE_BYTES]> {
    b.as_ref().try_into().ok()
}
