//! A received message (`sluice_received`): metadata, payloads and tensors (in CPU memory, or in
//! GPU memory the caller's allocator gave), each tensor's
//! description parsed and checked against its bytes on arrival (never trusted). A tensor whose
//! description is bad still arrives; asking for it as a `DLTensor` is the error.

use std::ffi::c_void;

use bytes::Bytes;
use sluice_channel::{Allocation, CudaBuffer, Descriptor, RecvBuffer};
use sluice_dlpack::ffi::{DLDevice, DLTensor, DL_CPU, DL_CUDA};
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
    /// A tensor received into GPU memory: the caller's memory (its allocator's), with the
    /// stream its copy was queued on, and the caller's handle for it (`data` is empty then).
    gpu: Option<(CudaBuffer, usize)>,
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
    /// The message `descriptor` announced, filled into `allocation`; `handles[i]` is the
    /// caller's handle (an address) for tensor `i` when it arrived in GPU memory.
    pub(crate) fn new(descriptor: Descriptor, allocation: Allocation, handles: &[usize]) -> Result<SluiceReceived> {
        let payloads = allocation.payloads.into_iter().map(|p| p.freeze()).collect();
        let mut tensors = Vec::with_capacity(allocation.tensors.len());
        for (i, (buffer, d)) in allocation.tensors.into_iter().zip(descriptor.tensors).enumerate() {
            let private = matches!(buffer, RecvBuffer::Cpu(_));
            let (data, gpu) = match buffer {
                RecvBuffer::Cuda(b) => (Bytes::new(), Some((b, handles.get(i).copied().unwrap_or(0)))),
                cpu => (
                    cpu.into_cpu()
                        .ok_or_else(|| Error::unsupported(format!("tensor {i} arrived on no device")))?,
                    None,
                ),
            };
            let len = gpu.as_ref().map_or(data.len(), |(b, _)| b.len());
            let meta = Meta::decode(&d.metadata, len);
            tensors.push(ReceivedTensor {
                data,
                metadata: d.metadata,
                meta,
                private,
                gpu,
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

    /// Tensor `index`'s bytes as they arrived (its span), for a tensor in CPU memory.
    pub fn tensor_data(&self, index: usize) -> Result<&[u8]> {
        let t = self.get(index)?;
        if let Some((b, _)) = &t.gpu {
            return Err(Error::invalid(format!(
                "tensor {index} is in GPU memory (cuda:{}): sluice_received_tensor gives its device pointer",
                b.device()
            )));
        }
        Ok(&t.data)
    }

    /// For tensor `index` in GPU memory: the stream its copy was queued on (as an integer)
    /// and the caller's handle for the memory; `None` for a tensor in CPU memory.
    pub fn tensor_gpu(&self, index: usize) -> Result<Option<(usize, usize)>> {
        Ok(self.get(index)?.gpu.as_ref().map(|(b, h)| (b.stream().raw(), *h)))
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
    /// and strides arrays stay valid as long as `self` does. CPU memory is read-only; a
    /// tensor received into GPU memory is the caller's allocation (`kDLCUDA`).
    pub fn tensor(&self, index: usize) -> Result<DLTensor> {
        let meta = self.tensor_meta(index)?;
        let t = self.get(index)?;
        let (data, device) = match &t.gpu {
            Some((b, _)) => (
                b.ptr() as usize as *mut c_void,
                DLDevice {
                    device_type: DL_CUDA,
                    device_id: b.device() as i32,
                },
            ),
            None => (
                t.data.as_ptr() as *mut c_void,
                DLDevice {
                    device_type: DL_CPU,
                    device_id: 0,
                },
            ),
        };
        Ok(DLTensor {
            data,
            device,
            ndim: meta.shape.len() as i32,
            dtype: meta.dtype.to_dl(),
            shape: meta.shape.as_ptr() as *mut i64,
            strides: meta.strides.as_ptr() as *mut i64,
            byte_offset: 0,
        })
    }
}
