//! Tensors between Python and the pipe, without copies either way.
//!
//! Sending: the object's DLPack tensor is taken over ([`crate::capsule::import`]) and its span
//! becomes the channel tensor's bytes (`Bytes::from_owner`): the pipe reads the producer's
//! memory, and the producer's deleter runs when the pipe no longer needs it.
//!
//! Receiving: the bytes the pipe received into become a [`Received`], which speaks DLPack
//! itself, so `torch.from_dlpack`, `numpy.from_dlpack` (or `sluice.from_dlpack`) view that
//! memory directly.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use pyo3::exceptions::{PyNotImplementedError, PyValueError};
use pyo3::prelude::*;
use sluice_channel::{SendBuffer, Tensor};
use sluice_dlpack::ffi::{DLDevice, DL_CPU, DL_CUDA_HOST};
use sluice_dlpack::Meta;

/// The bytes of a received tensor: writable when nothing else holds them (the usual case),
/// else shared (memory a cma pipe's sender lent us, read-only by contract).
enum Memory {
    Owned(BytesMut),
    Shared(Bytes),
}

/// A tensor that arrived: a DLPack producer over the memory the pipe received into.
#[pyclass(module = "sluice._sluice", frozen)]
pub struct Received {
    memory: Arc<Memory>,
    /// The first element (the memory's start; received spans begin at their first element).
    ptr: usize,
    meta: Meta,
    framework: String,
}

impl Received {
    /// Wraps a received channel tensor, checking its description against its bytes.
    pub fn new(tensor: Tensor) -> PyResult<Received> {
        let bytes = match tensor.buffer {
            SendBuffer::Cpu(b) => b,
            other => {
                return Err(PyNotImplementedError::new_err(format!(
                    "a tensor arrived on {}; this build of the Python binding receives CPU tensors only",
                    other.device()
                )))
            }
        };
        let (meta, tag) = Meta::decode_tagged(&tensor.metadata, bytes.len())
            .map_err(|e| PyValueError::new_err(format!("the peer described a tensor badly: {e}")))?;
        let framework = String::from_utf8_lossy(tag).into_owned();
        let (memory, ptr) = match bytes.try_into_mut() {
            Ok(mut m) => {
                let ptr = m.as_mut_ptr() as usize;
                (Memory::Owned(m), ptr)
            }
            Err(b) => {
                let ptr = b.as_ptr() as usize;
                (Memory::Shared(b), ptr)
            }
        };
        Ok(Received {
            memory: Arc::new(memory),
            ptr,
            meta,
            framework,
        })
    }

    fn len(&self) -> usize {
        match &*self.memory {
            Memory::Owned(m) => m.len(),
            Memory::Shared(b) => b.len(),
        }
    }
}

#[pymethods]
impl Received {
    /// DLPack export: a capsule viewing this memory (each call another view of it), in
    /// DLPack 1.0's form when the consumer accepts it (`max_version`), else the legacy one.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<&Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = (stream, dl_device);
        if copy == Some(true) {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "a received tensor is exported as it lies (copy=True is not supported)",
            ));
        }
        let cpu = DLDevice {
            device_type: DL_CPU,
            device_id: 0,
        };
        if max_version.is_some_and(|(major, _)| major >= 1) {
            // SAFETY: as below.
            let managed = unsafe {
                sluice_dlpack::export_versioned(self.ptr as *mut u8, cpu, &self.meta, 0, Box::new(self.memory.clone()))
            };
            return crate::capsule::export_versioned(py, managed);
        }
        // SAFETY: `ptr` points at `meta.span()` bytes (checked on arrival) that the `Arc` we
        // hand over keeps alive. Writes through the view land in memory nobody else reads
        // while the view lives: owned memory is ours alone, and shared memory is leased to
        // us until the last handle drops.
        let managed =
            unsafe { sluice_dlpack::export(self.ptr as *mut u8, cpu, &self.meta, Box::new(self.memory.clone())) };
        crate::capsule::export(py, managed)
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DL_CPU, 0)
    }

    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.meta.shape.clone()
    }

    /// Strides in elements.
    #[getter]
    fn strides(&self) -> Vec<i64> {
        self.meta.strides.clone()
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        self.meta.dtype.name()
    }

    /// The framework the sender's tensor came from (`"torch"`, `"numpy"`, ... or empty).
    #[getter]
    fn framework(&self) -> &str {
        &self.framework
    }

    /// Address of the first element.
    #[getter]
    fn data_ptr(&self) -> usize {
        self.ptr
    }

    /// The buffer the pipe received into: (address, length).
    #[getter]
    fn buffer(&self) -> (usize, usize) {
        (self.ptr, self.len())
    }

    /// True when the memory is lent by the sender (a cma pipe's segment) rather than ours.
    #[getter]
    fn shared(&self) -> bool {
        matches!(&*self.memory, Memory::Shared(_))
    }

    fn __repr__(&self) -> String {
        format!(
            "Received(dtype={}, shape={:?}, strides={:?}, framework={:?})",
            self.meta.dtype.name(),
            self.meta.shape,
            self.meta.strides,
            self.framework
        )
    }
}

/// The framework an object comes from: the top-level module of its type.
pub fn framework_of(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .module()
        .map(|m| m.to_string().split('.').next().unwrap_or_default().to_owned())
        .unwrap_or_default()
}

/// A channel tensor over `obj`'s memory (no copy), described for the receiver, with the
/// sender's framework as the tag (`framework`: None takes it from the object's type).
pub fn to_channel(obj: &Bound<'_, PyAny>, framework: Option<&str>) -> PyResult<Tensor> {
    let imported = crate::capsule::import(obj)?;
    let device = imported.device();
    if device.device_type != DL_CPU && device.device_type != DL_CUDA_HOST {
        return Err(PyNotImplementedError::new_err(format!(
            "a tensor on DLPack device type {} (id {}): this build of the Python binding sends CPU tensors only",
            device.device_type, device.device_id
        )));
    }
    let tag = match (framework, obj.cast::<Received>()) {
        (Some(f), _) => f.to_owned(),
        // Forwarding a received tensor keeps the original sender's framework.
        (None, Ok(r)) => r.get().framework.clone(),
        (None, Err(_)) => framework_of(obj),
    };
    let metadata = Bytes::from(imported.meta().encode_tagged(tag.as_bytes()));
    Ok(Tensor {
        buffer: SendBuffer::Cpu(Bytes::from_owner(imported)),
        metadata,
        target_device: None,
    })
}

/// Where the pipe will read `obj`'s bytes from if it is sent: (address, length). The tests
/// compare it with the object's own data pointer to show the send path copies nothing.
#[pyfunction]
pub fn _send_view(obj: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let t = to_channel(obj, None)?;
    let b = t.buffer.as_cpu().expect("to_channel makes CPU tensors");
    Ok((b.as_ptr() as usize, b.len()))
}
