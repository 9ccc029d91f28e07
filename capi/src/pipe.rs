//! The pipe handle (`sluice_pipe`): writes and reads, blocking or started (completion by
//! callback or op), on a [`Pipe`].
//!
//! Order: operations one thread starts on a pipe take their places in its queues in the order
//! they were started (see [`runtime::start`]), so messages leave and are taken in that order.
//! A read is the two steps of the pipe (descriptor, then the data into fresh CPU memory) under
//! one per-pipe lock, so reads started together never interleave their steps.

use std::ffi::{CStr, CString};
use std::sync::Arc;

use sluice_channel::{Allocation, CudaBuffer, Device, Pipe, RecvBuffer, TensorDescriptor};
use tokio::sync::Mutex;

use crate::borrowed::{DeviceAllocator, GrantError};
use crate::message::SluiceMessage;
use crate::received::SluiceReceived;
use crate::runtime;
use crate::status::{Error, Result};

/// A pipe to one peer: ordered messages both ways (`sluice_connect`, `sluice_listener_accept`).
/// Any thread may write and read; freeing it closes it.
pub struct SluicePipe {
    pipe: Pipe,
    reads: Arc<Mutex<()>>,
    peer: CString,
    transport: CString,
    channel: CString,
}

impl SluicePipe {
    pub(crate) fn new(pipe: Pipe) -> SluicePipe {
        let info = pipe.info();
        let c = |s: &str| CString::new(s.replace('\0', " ")).unwrap_or_default();
        SluicePipe {
            peer: c(&info.peer),
            transport: c(info.transport),
            channel: c(info.cpu_channel.name()),
            pipe,
            reads: Arc::new(Mutex::new(())),
        }
    }

    /// The peer's name (its address or process name), as errors name it.
    pub fn peer(&self) -> &CStr {
        &self.peer
    }

    /// The transport negotiated for the control connection (`shm`, `tcp`, `ibv`).
    pub fn transport(&self) -> &CStr {
        &self.transport
    }

    /// The channel negotiated for CPU tensors (`cma`, `basic`, `multilane`, ...).
    pub fn cpu_channel(&self) -> &CStr {
        &self.channel
    }

    /// Closes the pipe: pending and later operations fail with `SLUICE_CLOSED`.
    pub fn close(&self) {
        self.pipe.close();
    }

    /// Sends `message` and waits until its memory may be reused.
    pub fn write_sync(&self, message: SluiceMessage) -> Result<()> {
        let result = runtime::block_on(self.pipe.write(&message.inner));
        drop(message);
        Ok(result??)
    }

    /// Starts sending `message`; `done` gets the result on a library thread, after the message
    /// (and with it the tensors' references) has been dropped.
    pub fn write_then(&self, message: SluiceMessage, done: impl FnOnce(Result<()>) + Send + 'static) -> Result<()> {
        let pipe = self.pipe.clone();
        let write = async move {
            let result = pipe.write(&message.inner).await;
            drop(message);
            result
        };
        runtime::start(write, move |r| done(r.and_then(|w| Ok(w?))))
    }

    /// Starts writing `message` with nobody waiting for the outcome (see
    /// [`runtime::start_detached`]).
    pub fn write_detached(&self, message: SluiceMessage) -> Result<()> {
        let pipe = self.pipe.clone();
        runtime::start_detached(async move {
            let _ = pipe.write(&message.inner).await;
            drop(message);
        })
    }

    /// Receives the next message (blocking).
    pub fn read_sync(&self) -> Result<SluiceReceived> {
        runtime::block_on(read(self.pipe.clone(), self.reads.clone(), None))?
    }

    /// Starts receiving the next message; `done` gets it on a library thread. Tensors bound
    /// for a GPU go into memory `devices` gives (without one, such a message is refused).
    pub(crate) fn read_then(
        &self,
        devices: Option<DeviceAllocator>,
        done: impl FnOnce(Result<SluiceReceived>) + Send + 'static,
    ) -> Result<()> {
        runtime::start(read(self.pipe.clone(), self.reads.clone(), devices), move |r| {
            done(r.and_then(|r| r))
        })
    }
}

impl Drop for SluicePipe {
    fn drop(&mut self) {
        self.pipe.close();
    }
}

/// The two steps of a read, under the pipe's read lock.
async fn read(pipe: Pipe, reads: Arc<Mutex<()>>, devices: Option<DeviceAllocator>) -> Result<SluiceReceived> {
    let _turn = reads.lock_owned().await;
    let descriptor = pipe.read_descriptor().await?;
    // Large CPU tensors go into kept memory of the same length where there is some (see
    // `crate::pool`); tensors arriving shared need none; GPU ones go where `devices` says.
    let mut tensors = Vec::with_capacity(descriptor.tensors.len());
    let mut handles = Vec::with_capacity(descriptor.tensors.len());
    for (i, t) in descriptor.tensors.iter().enumerate() {
        match gpu_buffer(&pipe, devices.as_ref(), i, t) {
            Ok(Some((b, handle))) => {
                tensors.push(RecvBuffer::Cuda(b));
                handles.push(handle);
            }
            Ok(None) => {
                tensors.push(RecvBuffer::Cpu(crate::pool::take(t.buffer_len())));
                handles.push(0);
            }
            Err(e) => {
                // The message cannot be taken, and it cannot be skipped.
                pipe.close();
                return Err(e);
            }
        }
    }
    let allocation = Allocation {
        payloads: descriptor
            .payload_lengths
            .iter()
            .map(|&l| bytes::BytesMut::zeroed(l as usize))
            .collect(),
        tensors,
    };
    let allocation = pipe.read(allocation).await.map_err(|e| e.error)?;
    SluiceReceived::new(descriptor, allocation, &handles)
}

/// The memory for tensor `i` (described by `t`) when it is bound for a GPU: the caller's, from
/// `devices`, with the caller's handle for it (as an address); `None` for a tensor bound for
/// the CPU.
fn gpu_buffer(
    pipe: &Pipe,
    devices: Option<&DeviceAllocator>,
    i: usize,
    t: &TensorDescriptor,
) -> Result<Option<(CudaBuffer, usize)>> {
    let Device::Cuda(device) = t.target_device.unwrap_or(t.source_device) else {
        return Ok(None);
    };
    let peer = &pipe.info().peer;
    let Some(devices) = devices else {
        return Err(Error::unsupported(format!(
            "{peer} sent tensor {i} for cuda:{device}; receiving GPU tensors takes a device allocator \
             (sluice_pipe_read_then_with) (pipe closed)"
        )));
    };
    let len = t.length as usize;
    match devices.grant(device, len) {
        Ok((buffer, handle)) => Ok(Some((buffer, handle as usize))),
        Err(GrantError::Refused(status)) => Err(Error::unsupported(format!(
            "{peer} sent tensor {i} ({len} bytes) for cuda:{device}; the device allocator refused it \
             with status {status} (pipe closed)"
        ))),
        Err(GrantError::Unusable(e)) => Err(Error::invalid(format!(
            "the device allocator's memory for tensor {i} ({len} bytes on cuda:{device}): {e} (pipe closed)"
        ))),
    }
}
