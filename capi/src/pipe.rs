//! The pipe handle (`sluice_pipe`): writes and reads, blocking or started (completion by
//! callback or op), on a [`Pipe`].
//!
//! Order: operations one thread starts on a pipe take their places in its queues in the order
//! they were started (see [`runtime::start`]), so messages leave and are taken in that order.
//! A read is the two steps of the pipe (descriptor, then the data into fresh CPU memory) under
//! one per-pipe lock, so reads started together never interleave their steps.

use std::ffi::{CStr, CString};
use std::sync::Arc;

use sluice_channel::{Allocation, Device, Pipe, RecvBuffer};
use tokio::sync::Mutex;

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
        runtime::block_on(read(self.pipe.clone(), self.reads.clone()))?
    }

    /// Starts receiving the next message; `done` gets it on a library thread.
    pub fn read_then(&self, done: impl FnOnce(Result<SluiceReceived>) + Send + 'static) -> Result<()> {
        runtime::start(read(self.pipe.clone(), self.reads.clone()), move |r| {
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
async fn read(pipe: Pipe, reads: Arc<Mutex<()>>) -> Result<SluiceReceived> {
    let _turn = reads.lock_owned().await;
    let descriptor = pipe.read_descriptor().await?;
    for (i, t) in descriptor.tensors.iter().enumerate() {
        let target = t.target_device.unwrap_or(t.source_device);
        if target != Device::Cpu {
            // The message cannot be taken into CPU memory, and it cannot be skipped.
            let e = Error::unsupported(format!(
                "{} sent tensor {i} for {target}; the C API receives CPU tensors only (pipe closed)",
                pipe.info().peer
            ));
            pipe.close();
            return Err(e);
        }
    }
    // Large tensors go into kept memory of the same length where there is some (see
    // `crate::pool`); tensors arriving shared need none.
    let allocation = Allocation {
        payloads: descriptor
            .payload_lengths
            .iter()
            .map(|&l| bytes::BytesMut::zeroed(l as usize))
            .collect(),
        tensors: descriptor
            .tensors
            .iter()
            .map(|t| RecvBuffer::Cpu(crate::pool::take(t.buffer_len())))
            .collect(),
    };
    let allocation = pipe.read(allocation).await.map_err(|e| e.error)?;
    SluiceReceived::new(descriptor, allocation)
}
