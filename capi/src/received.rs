//! A received message (`sluice_received`): metadata, payloads and CPU tensors, each tensor's
//! description parsed and checked against its bytes on arrival (never trusted). A tensor whose
//! description is bad still arrives; asking for it as a `DLTensor` is the error.

use std::ffi::c_void;

use bytes::Bytes;
use sluice_channel::{Allocation, Descriptor};
use sluice_dlpack::ffi::{DLDevice, DLTensor, DL_CPU};
use sluice_dlpack::{Meta, MetaError};

use crate::status::{meta_error, Error, Result};

/// A received message: metadata, payloads and CPU tensors (`sluice_pipe_read`).
#[derive(Debug)]
pub struct SluiceReceived {
    metadata: Bytes,
    payloads: Vec<Bytes>,
    tensors: Vec<ReceivedTensor>,
}

#[derive(Debug)]
struct ReceivedTensor {
    data: Bytes,
    metadata: Bytes,
    meta: std::result::Result<Meta, MetaError>,
    /// Whether `data` is this process's own memory (filled by a copy), rather than memory the
    /// pipe lends (a shared segment, read-only, going back to the sender when dropped).
    private: bool,
}

/// A tensor's bytes taken out of a received message (`sluice_received_tensor_take`): this
/// process's own memory, writable, freed with `sluice_buffer_free` (large ones are kept for
/// reuse by later reads, see [`crate::pool`]).
#[derive(Debug)]
pub struct SluiceBuffer {
    pub(crate) bytes: bytes::BytesMut,
}

impl Drop for SluiceBuffer {
    fn drop(&mut self) {
        crate::pool::give_back(std::mem::take(&mut self.bytes));
    }
}

impl Drop for SluiceReceived {
    fn drop(&mut self) {
        // Memory of this process's own that nothing else holds goes back for reuse.
        for t in &mut self.tensors {
            if t.private {
                if let Ok(b) = std::mem::take(&mut t.data).try_into_mut() {
                    crate::pool::give_back(b);
                }
            }
        }
    }
}

impl SluiceReceived {
    /// The message `descriptor` announced, filled into `allocation` (CPU memory only).
    pub(crate) fn new(descriptor: Descriptor, allocation: Allocation) -> Result<SluiceReceived> {
        let payloads = allocation.payloads.into_iter().map(|p| p.freeze()).collect();
        let mut tensors = Vec::with_capacity(allocation.tensors.len());
        for (i, (buffer, d)) in allocation.tensors.into_iter().zip(descriptor.tensors).enumerate() {
            let private = matches!(buffer, sluice_channel::RecvBuffer::Cpu(_));
            let data = buffer
                .into_cpu()
                .ok_or_else(|| Error::unsupported(format!("tensor {i} arrived in GPU memory")))?;
            let meta = Meta::decode(&d.metadata, data.len());
            tensors.push(ReceivedTensor {
                data,
                metadata: d.metadata,
                meta,
                private,
            });
        }
        Ok(SluiceReceived {
            metadata: descriptor.metadata,
            payloads,
            tensors,
        })
    }

    pub fn metadata(&self) -> &[u8] {
        &self.metadata
    }

    pub fn payloads(&self) -> &[Bytes] {
        &self.payloads
    }

    pub fn payload(&self, index: usize) -> Result<&[u8]> {
        self.payloads.get(index).map(|p| &p[..]).ok_or_else(|| {
            Error::invalid(format!(
                "payload {index} of a message with {} payloads",
                self.payloads.len()
            ))
        })
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    fn get(&self, index: usize) -> Result<&ReceivedTensor> {
        self.tensors.get(index).ok_or_else(|| {
            Error::invalid(format!(
                "tensor {index} of a message with {} tensors",
                self.tensors.len()
            ))
        })
    }

    /// Tensor `index`'s bytes as they arrived (its span).
    pub fn tensor_data(&self, index: usize) -> Result<&[u8]> {
        Ok(&self.get(index)?.data)
    }

    /// Takes tensor `index`'s bytes out of the message when they are this process's own memory
    /// and nothing else holds them: `Ok(None)` when they are lent by the pipe (or already
    /// taken, or empty), so the caller copies instead. The tensor's description stays; its data
    /// reads as empty afterwards.
    pub fn take_tensor_data(&mut self, index: usize) -> Result<Option<SluiceBuffer>> {
        let n = self.tensors.len();
        let t = self
            .tensors
            .get_mut(index)
            .ok_or_else(|| Error::invalid(format!("tensor {index} of a message with {n} tensors")))?;
        if !t.private || t.data.is_empty() {
            return Ok(None);
        }
        match std::mem::take(&mut t.data).try_into_mut() {
            Ok(bytes) => {
                t.private = false;
                Ok(Some(SluiceBuffer { bytes }))
            }
            Err(shared) => {
                t.data = shared;
                Ok(None)
            }
        }
    }

    /// Tensor `index`'s metadata bytes as they arrived.
    pub fn tensor_metadata(&self, index: usize) -> Result<&[u8]> {
        Ok(&self.get(index)?.metadata)
    }

    /// Tensor `index`'s description, or why the peer's one was refused.
    pub fn tensor_meta(&self, index: usize) -> Result<&Meta> {
        let t = self.get(index)?;
        t.meta
            .as_ref()
            .map_err(|e| meta_error(e, true).context(&format!("tensor {index}")))
    }

    /// Tensor `index` as a `DLTensor` viewing this message's memory: the data and the shape
    /// and strides arrays stay valid as long as `self` does. The memory is read-only.
    pub fn tensor(&self, index: usize) -> Result<DLTensor> {
        let meta = self.tensor_meta(index)?;
        let data = &self.get(index)?.data;
        Ok(DLTensor {
            data: data.as_ptr() as *mut c_void,
            device: DLDevice {
                device_type: DL_CPU,
                device_id: 0,
            },
            ndim: meta.shape.len() as i32,
            dtype: meta.dtype.to_dl(),
            shape: meta.shape.as_ptr() as *mut i64,
            strides: meta.strides.as_ptr() as *mut i64,
            byte_offset: 0,
        })
    }
}
