//! Messages, descriptors and allocations: what a pipe carries.

use bytes::{Bytes, BytesMut};

use crate::cuda::{CudaBuffer, CudaError, Stream};
use crate::device::{Device, RecvBuffer, SendBuffer};

/// One message: metadata, payloads (small CPU bytes that travel on the pipe's control stream)
/// and tensors (any device, moved by channels).
#[derive(Debug, Clone, Default)]
pub struct Message {
    pub metadata: Bytes,
    pub payloads: Vec<Bytes>,
    pub tensors: Vec<Tensor>,
}

/// A tensor of a message.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub buffer: SendBuffer,
    /// Opaque bytes for the application (shape, dtype, ...).
    pub metadata: Bytes,
    /// The device the receiver should place it on; `None` leaves the choice to the receiver.
    pub target_device: Option<Device>,
}

impl Tensor {
    /// A CPU tensor without metadata.
    pub fn cpu(data: impl Into<Bytes>) -> Self {
        Tensor {
            buffer: SendBuffer::Cpu(data.into()),
            metadata: Bytes::new(),
            target_device: None,
        }
    }

    /// A CUDA tensor without metadata, for the receiver's `target` device.
    pub fn cuda(buffer: CudaBuffer, target: Device) -> Self {
        Tensor {
            buffer: SendBuffer::Cuda(buffer),
            metadata: Bytes::new(),
            target_device: Some(target),
        }
    }
}

/// A message without its data: what the receiver learns first, to decide where the data goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub metadata: Bytes,
    pub payload_lengths: Vec<u64>,
    pub tensors: Vec<TensorDescriptor>,
}

/// A tensor without its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDescriptor {
    pub length: u64,
    pub source_device: Device,
    pub target_device: Option<Device>,
    pub metadata: Bytes,
    /// The tensor arrives in memory the pipe lends (a cma pipe's segment shared with the
    /// sender, or an rdma pipe's registered receive pool) and is handed over as
    /// [`RecvBuffer::Shared`]: supply an empty buffer for it.
    pub arrives_shared: bool,
}

impl TensorDescriptor {
    /// The length of the buffer to supply: 0 for a tensor that arrives shared.
    pub fn buffer_len(&self) -> usize {
        if self.arrives_shared {
            0
        } else {
            self.length as usize
        }
    }
}

/// The memory a receiver supplies for one message: one buffer per payload and per tensor, each
/// exactly as long as the descriptor says (empty for a tensor that arrives shared). Filled in place and handed back by `Pipe::read`.
#[derive(Debug, Default)]
pub struct Allocation {
    pub payloads: Vec<BytesMut>,
    pub tensors: Vec<RecvBuffer>,
}

impl Allocation {
    /// Fresh memory for everything `descriptor` announces, on the devices it names: zeroed CPU
    /// memory, and for CUDA targets new device memory ordered by `stream(device)`. (To avoid
    /// allocating for every message, keep the returned allocation and pass it back for the
    /// next one: freeing device memory synchronizes the device.)
    pub fn try_for_descriptor(
        descriptor: &Descriptor,
        mut stream: impl FnMut(u32) -> Result<Stream, CudaError>,
    ) -> Result<Self, CudaError> {
        let mut tensors = Vec::with_capacity(descriptor.tensors.len());
        for t in &descriptor.tensors {
            tensors.push(match t.target_device.unwrap_or(t.source_device) {
                Device::Cuda(i) => RecvBuffer::Cuda(CudaBuffer::alloc(t.length as usize, &stream(i)?)?),
                _ => RecvBuffer::cpu(t.buffer_len()),
            });
        }
        Ok(Allocation {
            payloads: payloads(descriptor),
            tensors,
        })
    }

    /// Fresh zeroed CPU memory for everything `descriptor` announces (for messages whose
    /// tensors all go to the CPU; see [`try_for_descriptor`](Self::try_for_descriptor)).
    pub fn for_descriptor(descriptor: &Descriptor) -> Self {
        Allocation {
            payloads: payloads(descriptor),
            tensors: descriptor
                .tensors
                .iter()
                .map(|t| RecvBuffer::cpu(t.buffer_len()))
                .collect(),
        }
    }
}

/// Zeroed memory for every payload `descriptor` announces.
fn payloads(descriptor: &Descriptor) -> Vec<BytesMut> {
    descriptor
        .payload_lengths
        .iter()
        .map(|&l| BytesMut::zeroed(l as usize))
        .collect()
}
