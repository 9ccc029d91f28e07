//! Devices and the buffers that live on them.
//!
//! A buffer knows its device. CPU buffers are `bytes` types: the sender offers an immutable
//! [`Bytes`] (cheap to clone, kept alive by the pipe until the receiver has the data, which is
//! what lets CMA read it in place), and the receiver supplies a [`BytesMut`] of exactly the
//! tensor's length, which the pipe fills in place and hands back. A CUDA buffer
//! ([`CudaBuffer`]: device memory plus the stream that orders it) is the other variant of both;
//! the pipe asks a buffer for its device and length and lets the negotiated channel do the
//! rest.

use bytes::{Bytes, BytesMut};

use crate::cuda::CudaBuffer;
use serde::{Deserialize, Serialize};

/// Where a buffer's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Device {
    Cpu,
    /// A CUDA device by its index in this process (after `CUDA_VISIBLE_DEVICES`). Across
    /// processes GPUs are matched by UUID during negotiation, never by this index.
    Cuda(u32),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A device name that does not parse (`cpu`, `cuda`, `cuda:N`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a device: expected `cpu`, `cuda` or `cuda:N`")]
pub struct BadDevice(pub String);

impl std::str::FromStr for Device {
    type Err = BadDevice;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        match t {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => t
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| BadDevice(s.to_owned())),
        }
    }
}

/// Memory a sender offers: read by the pipe's channels until the write completes.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum SendBuffer {
    Cpu(Bytes),
    /// Read after the work already queued on the buffer's stream.
    Cuda(CudaBuffer),
}

impl SendBuffer {
    pub fn device(&self) -> Device {
        match self {
            SendBuffer::Cpu(_) => Device::Cpu,
            SendBuffer::Cuda(b) => Device::Cuda(b.device()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            SendBuffer::Cpu(b) => b.len(),
            SendBuffer::Cuda(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The CPU bytes, if this is a CPU buffer.
    pub fn as_cpu(&self) -> Option<&Bytes> {
        match self {
            SendBuffer::Cpu(b) => Some(b),
            SendBuffer::Cuda(_) => None,
        }
    }

    /// The CUDA buffer, if this is one.
    pub fn as_cuda(&self) -> Option<&CudaBuffer> {
        match self {
            SendBuffer::Cuda(b) => Some(b),
            SendBuffer::Cpu(_) => None,
        }
    }
}

impl From<CudaBuffer> for SendBuffer {
    fn from(b: CudaBuffer) -> Self {
        SendBuffer::Cuda(b)
    }
}

impl From<Bytes> for SendBuffer {
    fn from(b: Bytes) -> Self {
        SendBuffer::Cpu(b)
    }
}

impl From<Vec<u8>> for SendBuffer {
    fn from(b: Vec<u8>) -> Self {
        SendBuffer::Cpu(Bytes::from(b))
    }
}

/// Memory a receiver supplies for one tensor: filled in place and handed back.
#[derive(Debug)]
#[non_exhaustive]
pub enum RecvBuffer {
    Cpu(BytesMut),
    /// Received in memory the pipe lends: shared with the sender (a cma pipe's segment), or
    /// a registered chunk of an rdma pipe's receive pool. The pipe puts it here instead of
    /// filling the buffer supplied (the descriptor says `arrives_shared`). Read-only; its
    /// memory goes back (to the sender, or to the pool) when the last handle drops.
    Shared(Bytes),
    /// Filled by copies queued on the buffer's stream: work queued there after the read
    /// completes sees the data.
    Cuda(CudaBuffer),
}

impl RecvBuffer {
    /// A zeroed CPU buffer of `len` bytes.
    pub fn cpu(len: usize) -> Self {
        RecvBuffer::Cpu(BytesMut::zeroed(len))
    }

    pub fn device(&self) -> Device {
        match self {
            RecvBuffer::Cpu(_) | RecvBuffer::Shared(_) => Device::Cpu,
            RecvBuffer::Cuda(b) => Device::Cuda(b.device()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            RecvBuffer::Cpu(b) => b.len(),
            RecvBuffer::Shared(b) => b.len(),
            RecvBuffer::Cuda(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The CPU bytes, if this is a CPU buffer.
    pub fn as_cpu(&self) -> Option<&[u8]> {
        match self {
            RecvBuffer::Cpu(b) => Some(b),
            RecvBuffer::Shared(b) => Some(b),
            RecvBuffer::Cuda(_) => None,
        }
    }

    /// The CPU bytes as shared bytes, without copying, if this is a CPU buffer.
    pub fn into_cpu(self) -> Option<Bytes> {
        match self {
            RecvBuffer::Cpu(b) => Some(b.freeze()),
            RecvBuffer::Shared(b) => Some(b),
            RecvBuffer::Cuda(_) => None,
        }
    }

    /// The CUDA buffer, if this is one.
    pub fn as_cuda(&self) -> Option<&CudaBuffer> {
        match self {
            RecvBuffer::Cuda(b) => Some(b),
            RecvBuffer::Cpu(_) | RecvBuffer::Shared(_) => None,
        }
    }

    /// The received memory as a buffer that can be sent on, without copying.
    pub fn freeze(self) -> SendBuffer {
        match self {
            RecvBuffer::Cpu(b) => SendBuffer::Cpu(b.freeze()),
            RecvBuffer::Shared(b) => SendBuffer::Cpu(b),
            RecvBuffer::Cuda(b) => SendBuffer::Cuda(b),
        }
    }
}
