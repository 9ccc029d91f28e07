//! A message being built (`sluice_message`): metadata and payloads copied in, tensors
//! borrowed from the caller (see [`crate::borrowed`]), each with its [`Meta`] as its metadata
//! bytes, exactly as the Python binding encodes it.

use bytes::Bytes;
use sluice_channel::{CudaBuffer, Device, Message, SendBuffer, Tensor};
use sluice_dlpack::ffi::{DLDataType, DLDevice, DL_CPU, DL_CUDA, DL_CUDA_HOST};
use sluice_dlpack::{DType, Meta, MAX_RANK};

use crate::status::{meta_error, Error, Result};

/// A message being built: metadata, payloads (copied) and tensors (borrowed)
/// (`sluice_message_new`). Consumed by a write. One thread at a time may build a message.
#[derive(Debug, Default)]
pub struct SluiceMessage {
    pub(crate) inner: Message,
}

impl SluiceMessage {
    pub fn new() -> SluiceMessage {
        SluiceMessage::default()
    }

    /// Replaces the metadata with a copy of `data`.
    pub fn set_metadata(&mut self, data: &[u8]) {
        self.inner.metadata = Bytes::copy_from_slice(data);
    }

    /// Appends a copy of `data` as a payload.
    pub fn add_payload(&mut self, data: &[u8]) {
        self.inner.payloads.push(Bytes::copy_from_slice(data));
    }

    /// Appends a CPU tensor: `data` is its span as described by `meta` (checked by
    /// [`TensorSpec::check`]).
    pub fn add_tensor(&mut self, meta: &Meta, data: Bytes) {
        self.inner.tensors.push(Tensor {
            buffer: SendBuffer::Cpu(data),
            metadata: Bytes::from(meta.encode()),
            target_device: None,
        });
    }

    /// Appends a GPU tensor: `buffer` is its span on its device, read after the work queued
    /// on the buffer's stream, for the receiver's `target` device.
    pub fn add_cuda_tensor(&mut self, meta: &Meta, buffer: CudaBuffer, target: Device) {
        self.inner.tensors.push(Tensor {
            buffer: SendBuffer::Cuda(buffer),
            metadata: Bytes::from(meta.encode()),
            target_device: Some(target),
        });
    }

    pub fn tensor_count(&self) -> usize {
        self.inner.tensors.len()
    }
}

/// A `DLTensor` as read from the caller, its arrays copied out.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub device: DLDevice,
    pub dtype: DLDataType,
    pub shape: Vec<i64>,
    /// `None`: compact row-major (DLPack's NULL strides).
    pub strides: Option<Vec<i64>>,
    pub data_is_null: bool,
}

impl TensorSpec {
    /// Checks that the C API can send this tensor, and returns its description and span (in
    /// bytes, from the first element to the end of the last).
    pub fn check(&self) -> Result<(Meta, usize)> {
        self.check_on(DL_CPU)
    }

    /// [`check`](Self::check) for a tensor that must be on device type `device_type`
    /// (`kDLCPU`, or `kDLCUDA` for `sluice_message_add_cuda_tensor`).
    pub fn check_on(&self, device_type: i32) -> Result<(Meta, usize)> {
        if self.device.device_type != device_type {
            let hint = if device_type == DL_CPU {
                "sluice_message_add_tensor sends CPU tensors (kDLCPU); GPU ones go with sluice_message_add_cuda_tensor"
            } else {
                "sluice_message_add_cuda_tensor sends CUDA tensors (kDLCUDA)"
            };
            return Err(Error::unsupported(format!(
                "tensor on device type {} ({}): {hint}",
                self.device.device_type,
                device_name(self.device.device_type)
            )));
        }
        if device_type == DL_CUDA && self.device.device_id < 0 {
            return Err(Error::invalid(format!(
                "bad tensor: CUDA device {}",
                self.device.device_id
            )));
        }
        if self.shape.len() > MAX_RANK {
            return Err(meta_error(&sluice_dlpack::MetaError::Rank(self.shape.len()), false));
        }
        let dtype = DType::from_dl(self.dtype).map_err(|e| meta_error(&e, false))?;
        let meta = match &self.strides {
            None => Meta::contiguous(dtype, &self.shape),
            Some(strides) => Meta {
                dtype,
                shape: self.shape.clone(),
                strides: strides.clone(),
            },
        };
        let span = meta.span().map_err(|e| meta_error(&e, false))?;
        if span > 0 && self.data_is_null {
            return Err(Error::invalid(format!("bad tensor: data is NULL for {span} bytes")));
        }
        Ok((meta, span))
    }
}

/// DLPack's name for a device type.
fn device_name(device_type: i32) -> &'static str {
    match device_type {
        DL_CPU => "kDLCPU",
        DL_CUDA => "kDLCUDA",
        DL_CUDA_HOST => "kDLCUDAHost",
        4 => "kDLOpenCL",
        7 => "kDLVulkan",
        8 => "kDLMetal",
        9 => "kDLVPI",
        10 => "kDLROCM",
        11 => "kDLROCMHost",
        12 => "kDLExtDev",
        13 => "kDLCUDAManaged",
        14 => "kDLOneAPI",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{SLUICE_INVALID_ARGUMENT, SLUICE_UNSUPPORTED};

    fn spec(shape: &[i64], strides: Option<&[i64]>) -> TensorSpec {
        TensorSpec {
            device: DLDevice {
                device_type: DL_CPU,
                device_id: 0,
            },
            dtype: DType::F32.to_dl(),
            shape: shape.to_vec(),
            strides: strides.map(|s| s.to_vec()),
            data_is_null: false,
        }
    }

    #[test]
    fn contiguous_and_strided_spans() {
        let (meta, span) = spec(&[2, 3], None).check().unwrap();
        assert_eq!(meta.strides, vec![3, 1]);
        assert_eq!(span, 24);
        let (_, span) = spec(&[4, 3], Some(&[6, 2])).check().unwrap();
        assert_eq!(span, (3 * 6 + 2 * 2 + 1) * 4);
    }

    #[test]
    fn refusals_have_their_codes() {
        let mut cuda = spec(&[2], None);
        cuda.device.device_type = DL_CUDA;
        let e = cuda.check().unwrap_err();
        assert_eq!(e.code, SLUICE_UNSUPPORTED);
        assert!(e.message.contains("kDLCUDA"), "{}", e.message);
        assert!(cuda.check_on(DL_CUDA).is_ok());
        cuda.device.device_id = -1;
        assert_eq!(cuda.check_on(DL_CUDA).unwrap_err().code, SLUICE_INVALID_ARGUMENT);
        assert_eq!(spec(&[2], None).check_on(DL_CUDA).unwrap_err().code, SLUICE_UNSUPPORTED);
        let mut vec4 = spec(&[2], None);
        vec4.dtype.lanes = 4;
        assert_eq!(vec4.check().unwrap_err().code, SLUICE_UNSUPPORTED);
        assert_eq!(spec(&[-2], None).check().unwrap_err().code, SLUICE_INVALID_ARGUMENT);
        assert_eq!(spec(&[2], Some(&[-1])).check().unwrap_err().code, SLUICE_UNSUPPORTED);
        assert_eq!(spec(&[1; 33], None).check().unwrap_err().code, SLUICE_INVALID_ARGUMENT);
        let mut null = spec(&[2], None);
        null.data_is_null = true;
        assert_eq!(null.check().unwrap_err().code, SLUICE_INVALID_ARGUMENT);
        null.shape = vec![0];
        assert!(null.check().is_ok(), "an empty tensor may have no data");
    }
}
