//! The cuda_staged channel's data path: GPU bytes cross through pinned host slots as frames on
//! the pipe's control connection (so over whatever transport the pipe negotiated, across hosts
//! too), chunked and pipelined.
//!
//! Sender, for a GPU source: up to [`DEPTH`] device-to-host copies are queued ahead on the
//! source buffer's own stream (so they run after the work already queued there); chunk `k` is
//! written to the connection as soon as its copy is done, while the copies of chunks `k+1..`
//! continue. Receiver, for a GPU target: each frame is read into a slot whose previous
//! host-to-device copy has finished, and its copy is queued on the target buffer's stream. A
//! CPU side reads or writes its bytes directly, so CPU↔GPU pairs use one staging step.
//!
//! Slots come from two process-wide pools, one for sending and one for receiving, so a sender
//! waiting for its peer can never hold the slots that peer's receiver needs. Each transfer
//! takes all its slots at once (no transfer holds some while waiting for more). Slots are
//! allocated on first use and kept: freeing pinned memory synchronizes the device.
//!
//! Completion: a send completes when every byte has left the GPU and been handed to the
//! transport (the source may be reused at once); a receive completes when every copy into the
//! target is queued on its stream (work queued there later sees the data).

use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::{Bytes, BytesMut};
use sluice_transport::any::{AnyReader, AnyWriter};
use sluice_transport::{FrameReader, FrameWriter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{CudaBuffer, CudaError, Event, PinnedMemory};
use crate::channel::path::{Link, Rx, Tx};
use crate::device::{RecvBuffer, SendBuffer};
use crate::error::PipeError;

/// Bytes per chunk (and per pinned slot).
pub const CHUNK: usize = 4 << 20;
/// Chunks in flight per transfer.
pub const DEPTH: usize = 4;
/// Slots per pool (sending, receiving): at most `2 * SLOTS * CHUNK` bytes pinned per process.
pub const SLOTS: usize = 32;

/// The chunks a `len`-byte tensor travels in, in order (none for an empty tensor).
pub fn chunks(len: usize) -> impl Iterator<Item = Range<usize>> {
    (0..len.div_ceil(CHUNK)).map(move |k| k * CHUNK..((k + 1) * CHUNK).min(len))
}

struct Slot {
    memory: PinnedMemory,
    /// Recorded after the last device copy that used the slot (a plain event: staging works
    /// where CUDA IPC does not).
    fence: Option<Event>,
}

impl Slot {
    /// Waits for the slot's last device copy. The fence is cleared only once it has
    /// completed: a slot whose wait was cancelled or failed goes back to its pool still fenced.
    async fn settle(&mut self) -> Result<(), CudaError> {
        if let Some(f) = &self.fence {
            f.wait().await?;
        }
        self.fence = None;
        Ok(())
    }
}

struct Pool {
    free: Mutex<Vec<Slot>>,
    permits: Arc<Semaphore>,
}

fn pool(sending: bool) -> &'static Pool {
    static SEND: OnceLock<Pool> = OnceLock::new();
    static RECV: OnceLock<Pool> = OnceLock::new();
    let cell = if sending { &SEND } else { &RECV };
    cell.get_or_init(|| Pool {
        free: Mutex::new(Vec::new()),
        permits: Arc::new(Semaphore::new(SLOTS)),
    })
}

/// Slots lent to one transfer; handed back on drop.
struct Lease {
    pool: &'static Pool,
    slots: Vec<Slot>,
    _permits: OwnedSemaphorePermit,
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.free.lock().expect("slot pool").append(&mut self.slots);
    }
}

async fn lease(sending: bool, n: usize) -> Result<Lease, CudaError> {
    let pool = pool(sending);
    let permits = pool
        .permits
        .clone()
        .acquire_many_owned(n as u32)
        .await
        .map_err(|_| CudaError::Invalid("staging pool closed".into()))?;
    // Popped slots belong to the lease at once, so an error below hands them back (with their
    // fences) instead of freeing memory a copy may still be using.
    let popped = {
        let mut free = pool.free.lock().expect("slot pool");
        let keep = free.len().saturating_sub(n);
        free.split_off(keep)
    };
    let mut lease = Lease {
        pool,
        slots: popped,
        _permits: permits,
    };
    while lease.slots.len() < n {
        lease.slots.push(Slot {
            memory: PinnedMemory::new(CHUNK)?,
            fence: None,
        });
    }
    for s in lease.slots.iter_mut() {
        s.settle().await?;
    }
    Ok(lease)
}

fn channel_error(peer: &str, e: impl std::fmt::Display) -> PipeError {
    PipeError::Channel {
        peer: peer.to_owned(),
        channel: "cuda_staged",
        detail: e.to_string(),
    }
}

/// Sends a GPU buffer's bytes as `chunks(len)` frames.
async fn send_gpu(w: &mut AnyWriter, src: &CudaBuffer, peer: &str) -> Result<(), PipeError> {
    let plan: Vec<Range<usize>> = chunks(src.len()).collect();
    if plan.is_empty() {
        return Ok(());
    }
    let depth = DEPTH.min(plan.len());
    let mut lease = lease(true, depth).await.map_err(|e| channel_error(peer, e))?;
    let queue = |slot: &mut Slot, range: &Range<usize>| -> Result<(), CudaError> {
        slot.memory.fill_from_device(src, range.start, range.len())?;
        slot.fence = Some(Event::record(src.stream())?);
        Ok(())
    };
    for (k, range) in plan.iter().enumerate().take(depth) {
        queue(&mut lease.slots[k], range).map_err(|e| channel_error(peer, e))?;
    }
    for (k, range) in plan.iter().enumerate() {
        let slot = &mut lease.slots[k % depth];
        slot.settle().await.map_err(|e| channel_error(peer, e))?;
        w.write(&[&slot.memory.as_slice()[..range.len()]]).await?;
        if let Some(next) = plan.get(k + depth) {
            queue(slot, next).map_err(|e| channel_error(peer, e))?;
        }
    }
    Ok(())
}

/// Sends CPU bytes as `chunks(len)` frames, for a GPU receiver.
async fn send_cpu(w: &mut AnyWriter, src: &Bytes) -> Result<(), PipeError> {
    for range in chunks(src.len()) {
        w.write(&[&src[range]]).await?;
    }
    Ok(())
}

async fn read_exact(r: &mut AnyReader, dst: &mut [u8], peer: &str) -> Result<(), PipeError> {
    let n = r.read(dst).await?;
    if n != dst.len() {
        return Err(PipeError::Protocol {
            peer: peer.to_owned(),
            detail: format!("staged chunk of {n} bytes where {} were expected", dst.len()),
        });
    }
    Ok(())
}

/// Receives `chunks(len)` frames into a GPU buffer; returns once every copy is queued on the
/// buffer's stream.
async fn recv_gpu(r: &mut AnyReader, dst: &CudaBuffer, peer: &str) -> Result<(), PipeError> {
    let plan: Vec<Range<usize>> = chunks(dst.len()).collect();
    if plan.is_empty() {
        return Ok(());
    }
    let depth = DEPTH.min(plan.len());
    let mut lease = lease(false, depth).await.map_err(|e| channel_error(peer, e))?;
    for (k, range) in plan.iter().enumerate() {
        let slot = &mut lease.slots[k % depth];
        slot.settle().await.map_err(|e| channel_error(peer, e))?;
        read_exact(r, &mut slot.memory.as_mut_slice()[..range.len()], peer).await?;
        let queued = (|| {
            slot.memory.drain_to_device(dst, range.start, range.len())?;
            slot.fence = Some(Event::record(dst.stream())?);
            Ok::<_, CudaError>(())
        })();
        queued.map_err(|e| channel_error(peer, e))?;
    }
    Ok(())
}

/// Receives `chunks(len)` frames straight into CPU memory.
async fn recv_cpu(r: &mut AnyReader, dst: &mut BytesMut, peer: &str) -> Result<(), PipeError> {
    for range in chunks(dst.len()) {
        read_exact(r, &mut dst[range], peer).await?;
    }
    Ok(())
}

/// Sender: a tensor of either side's memory as `chunks(len)` frames on the control
/// connection (a GPU source through pinned slots).
pub(crate) async fn send(tx: &mut Tx, link: &Link<'_>, buffer: &SendBuffer) -> Result<(), PipeError> {
    match buffer {
        SendBuffer::Cpu(b) => send_cpu(&mut tx.control, b).await,
        SendBuffer::Cuda(b) => send_gpu(&mut tx.control, b, link.peer).await,
    }
}

/// Receiver: the frames into CPU memory directly, or through pinned slots into GPU memory.
pub(crate) async fn recv(rx: &mut Rx, link: &Link<'_>, buffer: &mut RecvBuffer) -> Result<(), PipeError> {
    match buffer {
        RecvBuffer::Cpu(dst) => recv_cpu(&mut rx.control, dst, link.peer).await,
        RecvBuffer::Cuda(dst) => recv_gpu(&mut rx.control, dst, link.peer).await,
        RecvBuffer::Shared(_) => Err(link.protocol("cuda_staged cannot fill shared memory")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_byte_once_in_order() {
        assert_eq!(chunks(0).count(), 0);
        assert_eq!(chunks(1).collect::<Vec<_>>(), vec![0..1]);
        assert_eq!(chunks(CHUNK).collect::<Vec<_>>(), vec![0..CHUNK]);
        assert_eq!(
            chunks(2 * CHUNK + 5).collect::<Vec<_>>(),
            vec![0..CHUNK, CHUNK..2 * CHUNK, 2 * CHUNK..2 * CHUNK + 5]
        );
        let len = 1usize << 30;
        let all: Vec<_> = chunks(len).collect();
        assert_eq!(all.len(), len / CHUNK);
        assert!(all.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!(all.last().unwrap().end, len);
    }
}
