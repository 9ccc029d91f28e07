//! The data path of cuda_ipc and cuda_p2p: the receiver copies straight from the sender's GPU
//! memory, device to device, ordered by events on both sides' streams.
//!
//! - Sender ([`prepare`]): records a *ready* event on the buffer's stream and describes the
//!   bytes: a plain address and event within one process ([`Source::CudaLocal`]), IPC handles
//!   of the allocation and the event otherwise ([`Source::CudaIpc`]). The buffer is kept until
//!   the receiver acknowledges.
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

use super::events::{self, EventSlot};
use super::{driver, ipc, CudaBuffer, CudaError};
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
    let export = || -> std::result::Result<Prepared, CudaError> {
        let event = EventSlot::take(b.device())?;
        event.record(b.stream())?;
        let source = if link.same_process {
            Source::CudaLocal {
                address: b.ptr(),
                event: event.raw().0 as u64,
            }
        } else {
            let (memory, offset) = b.ipc_export()?;
            Source::CudaIpc {
                memory: Bytes::copy_from_slice(&memory),
                offset,
                event: Bytes::copy_from_slice(&event.ipc_handle()),
            }
        };
        Ok(Prepared {
            source,
            ready: Some(event),
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
pub(crate) fn recv(
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
        Source::CudaIpc { memory, offset, event } => {
            if link.same_process {
                return Err(link.protocol("IPC handles from this very process"));
            }
            let (memory, event) = match (ipc_handle(memory), ipc_handle(event)) {
                (Some(m), Some(e)) => (m, e),
                _ => return Err(link.protocol("malformed IPC handle")),
            };
            let (base, size) = ipc::open_memory(link.process, device, &memory).map_err(fail)?;
            if offset.checked_add(dst.len() as u64).is_none_or(|end| end > size as u64) {
                return Err(link.protocol(format!(
                    "{} bytes at offset {offset} of a {size}-byte allocation",
                    dst.len()
                )));
            }
            let ready = ipc::open_event(link.process, device, &event).map_err(fail)?;
            events::stream_wait(dst.stream(), ready).map_err(fail)?;
            // SAFETY: the range lies inside the peer's allocation (checked above), which the
            // peer keeps alive until our acknowledgement, and the copy is ordered after its
            // ready event.
            unsafe { dst.copy_from_address(device, base + offset) }.map_err(fail)?;
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
    Ok(done)
}

/// Sender, acknowledged: makes the buffer's stream wait for the receiver's copy.
pub(crate) fn finish(channel: ChannelKind, link: &Link<'_>, buffer: &CudaBuffer, done: &CudaDone) -> Result<()> {
    let event = match done {
        CudaDone::Local { event } if link.same_process => driver::RawEvent(*event as usize),
        CudaDone::Ipc { event } if !link.same_process => {
            let handle = ipc_handle(event).ok_or_else(|| link.protocol("malformed IPC event handle"))?;
            ipc::open_event(link.process, buffer.device(), &handle).map_err(|e| cuda_error(link, channel, e))?
        }
        _ => return Err(link.protocol("acknowledgement of the wrong kind for this peer")),
    };
    events::stream_wait(buffer.stream(), event).map_err(|e| cuda_error(link, channel, e))
}

/// A 64-byte IPC handle from the wire.
fn ipc_handle(b: &Bytes) -> Option<[u8; driver::IPC_HANDLE_BYTES]> {
    b.as_ref().try_into().ok()
}
