//! CUDA tensors in calls: which devices this worker has, the streams incoming tensors land on,
//! and the events that let a consumer's stream wait for exactly the work that produced a value.
//!
//! Stream semantics, end to end:
//! - **Sending**: a CUDA tensor is read by the pipe after the work already queued on its
//!   buffer's stream, so a caller may hand over a tensor its side stream is still computing.
//! - **Receiving**: each message gets one stream per device from a small pool; its tensors are
//!   allocated there and the pipe queues the incoming copies on it. The agent records an
//!   [`Event`] on each after the read, and the payload carries them.
//! - **Handlers** see those streams in [`CallContext::streams`](crate::CallContext): work they
//!   queue on a tensor's own stream is ordered after its arrival, with no synchronize.
//! - **Futures** complete with the payload and its events; [`Payload::wait_on`] makes any
//!   stream wait for them, [`Payload::synchronize`] blocks the host until the data is there.
//! - **RRefs** owned on a GPU record events when their value is stored, and every fetch sends
//!   from a fresh stream that waits on those events only.

use std::collections::HashMap;
use std::sync::Mutex;

use sluice_channel::{CudaError, Device, SendBuffer, Stream};
use sluice_cuda::{self as cuda, Event};

use crate::error::InitError;
use crate::payload::Payload;

/// The devices found here: the CPU, and every GPU CUDA can use.
pub fn local_devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    if let Ok(c) = cuda::runtime() {
        devices.extend(c.gpus.iter().map(|g| Device::Cuda(g.index)));
    }
    devices
}

/// Checks that every device a worker offers exists here.
pub(crate) fn check_local(worker: &str, offered: &[Device]) -> Result<(), InitError> {
    for &d in offered {
        if let Device::Cuda(i) = d {
            let reason = match cuda::runtime() {
                Err(e) => e.to_string(),
                Ok(c) if c.gpu(i).is_err() => format!("{} GPU(s) are visible", c.gpus.len()),
                Ok(_) => continue,
            };
            return Err(InitError::DeviceNotPresent {
                worker: worker.to_owned(),
                device: d,
                reason,
            });
        }
    }
    Ok(())
}

/// Streams per device, handed out round-robin: enough that unrelated messages rarely queue
/// behind each other, few enough to create once.
const STREAMS_PER_DEVICE: usize = 4;

#[derive(Default)]
pub(crate) struct StreamPool {
    devices: Mutex<HashMap<u32, (Vec<Stream>, usize)>>,
}

impl StreamPool {
    /// The next stream of `device`.
    pub(crate) fn next(&self, device: u32) -> Result<Stream, CudaError> {
        let mut devices = self.devices.lock().expect("stream pool");
        let (streams, turn) = devices.entry(device).or_default();
        if streams.len() < STREAMS_PER_DEVICE {
            let s = Stream::new(device)?;
            streams.push(s.clone());
            return Ok(s);
        }
        *turn = (*turn + 1) % streams.len();
        Ok(streams[*turn].clone())
    }
}

/// Records an event on each stream of the payload's CUDA tensors (after everything queued
/// on them so far) and keeps them in the payload.
pub(crate) fn record_events(payload: &mut Payload) -> Result<(), CudaError> {
    if payload.tensors.is_empty() {
        // Most calls: nothing to look at (and no vectors to build and drop). Events a handler
        // left on a payload whose tensors it took are dropped, as before.
        payload.events.clear();
        return Ok(());
    }
    let events = payload
        .streams()
        .iter()
        .map(Event::record)
        .collect::<Result<Vec<_>, _>>()?;
    payload.events = events;
    Ok(())
}

/// For a payload that carries events (an RRef's stored value), moves each CUDA tensor onto a
/// stream of `pool` that waits on those events, so sending it waits for the work that produced
/// it and nothing queued on its old stream since. Returns (old, new) stream pairs for
/// [`rejoin`] once the send has completed.
pub(crate) fn restream(payload: &mut Payload, pool: &StreamPool) -> Result<Vec<(Stream, Stream)>, CudaError> {
    let mut pairs: Vec<(Stream, Stream)> = Vec::new();
    if payload.events.is_empty() {
        return Ok(pairs);
    }
    let mut chosen: HashMap<u32, Stream> = HashMap::new();
    for t in &mut payload.tensors {
        let SendBuffer::Cuda(b) = &t.buffer else { continue };
        let stream = match chosen.get(&b.device()) {
            Some(s) => s.clone(),
            None => {
                let s = pool.next(b.device())?;
                for e in &payload.events {
                    e.wait_on(&s)?;
                }
                chosen.insert(b.device(), s.clone());
                s
            }
        };
        if !pairs.iter().any(|(o, _)| o.raw() == b.stream().raw()) {
            pairs.push((b.stream().clone(), stream.clone()));
        }
        t.buffer = SendBuffer::Cuda(b.with_stream(&stream)?);
    }
    Ok(pairs)
}

/// After a restreamed send completed (the pipe made the new streams wait for the peer's
/// copies), makes each old stream wait for its new one, so memory freed back to the old
/// stream's cache is not reused before the peer has read it.
pub(crate) fn rejoin(pairs: &[(Stream, Stream)]) {
    for (old, new) in pairs {
        if let Err(e) = Event::record(new).and_then(|ev| ev.wait_on(old)) {
            tracing::warn!(error = %e, "could not order a stream after a fetch's copies");
        }
    }
}
