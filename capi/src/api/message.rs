//! Building messages.

use std::ffi::{c_int, c_void};

use sluice_dlpack::ffi::DLTensor;

use super::{bytes, give, guard, handle, handle_mut, out_handle, take, SluiceReleaseFn};
use crate::borrowed::{lend, lend_cuda};
use crate::message::{SluiceMessage, TensorSpec};
use crate::status::{Error, SLUICE_OK};

/// Creates an empty message: no metadata, payloads or tensors. On success `*out` is the new
/// message; it is consumed by a write, or freed with `sluice_message_free`.
#[no_mangle]
pub unsafe extern "C" fn sluice_message_new(out: *mut *mut SluiceMessage) -> c_int {
    guard("sluice_message_new", || {
        // SAFETY: the caller passes a writable `sluice_message*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        give(out, SluiceMessage::new());
        Ok(SLUICE_OK)
    })
}

/// Sets the message's metadata to a copy of `len` bytes at `data` (NULL allowed when `len`
/// is 0), replacing any set before.
#[no_mangle]
pub unsafe extern "C" fn sluice_message_set_metadata(
    message: *mut SluiceMessage,
    data: *const u8,
    len: usize,
) -> c_int {
    guard("sluice_message_set_metadata", || {
        // SAFETY: the caller passes a live message, used by no other thread meanwhile, or NULL.
        let message = unsafe { handle_mut(message, "message") }?;
        // SAFETY: the caller passes `len` readable bytes (or NULL).
        let data = unsafe { bytes(data, len, "data") }?;
        message.set_metadata(data);
        Ok(SLUICE_OK)
    })
}

/// Appends a payload: a copy of `len` bytes at `data` (NULL allowed when `len` is 0).
/// Payloads travel beside the metadata; put large data in tensors, which are not copied.
#[no_mangle]
pub unsafe extern "C" fn sluice_message_add_payload(message: *mut SluiceMessage, data: *const u8, len: usize) -> c_int {
    guard("sluice_message_add_payload", || {
        // SAFETY: the caller passes a live message, used by no other thread meanwhile, or NULL.
        let message = unsafe { handle_mut(message, "message") }?;
        // SAFETY: the caller passes `len` readable bytes (or NULL).
        let data = unsafe { bytes(data, len, "data") }?;
        message.add_payload(data);
        Ok(SLUICE_OK)
    })
}

/// Appends a CPU tensor, NOT copied: the message borrows the tensor's memory.
///
/// `tensor` describes it (device `kDLCPU`; dtype one lane of bool, int8-64, uint8-64,
/// float16/32/64, bfloat16, complex64/128; `strides` NULL for compact row-major, otherwise
/// non-negative). The bytes sent are the tensor's span, from its first element to the end of
/// its last (`data + byte_offset` onwards), so a strided view goes as it lies and arrives with
/// the same strides. The description travels as the tensor's metadata, in the encoding the
/// Python binding uses. The `DLTensor` and its shape and strides arrays are read during this
/// call only.
///
/// The memory must stay valid and unchanged until `release(user)` is called: once, from any
/// thread, when the library holds no more references to it (after the write that sent it has
/// completed, or when the message is freed unsent). `release` may be NULL (then the memory
/// must outlive every write of the message). If this call fails, the tensor was not taken and
/// `release` is not called. A tensor on another device is `SLUICE_UNSUPPORTED`.
#[no_mangle]
pub unsafe extern "C" fn sluice_message_add_tensor(
    message: *mut SluiceMessage,
    tensor: *const DLTensor,
    release: SluiceReleaseFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_message_add_tensor", || {
        // SAFETY: the caller passes a live message, used by no other thread meanwhile, or NULL.
        let message = unsafe { handle_mut(message, "message") }?;
        // SAFETY: the caller passes a readable `DLTensor` or NULL.
        let t = unsafe { handle(tensor, "tensor") }?;
        // SAFETY: DLPack's contract: `shape` and non-NULL `strides` hold `ndim` entries.
        let spec = unsafe { read_spec(t) }?;
        let (meta, span) = spec.check()?;
        let start = (t.data as *const u8).wrapping_add(t.byte_offset as usize);
        // SAFETY: the caller lends `span` bytes from the first element (checked against
        // `ndim`, shape, strides and dtype above) until `release(user)`, callable from any
        // thread, as documented.
        let data = unsafe { lend(start, span, release, user) };
        message.add_tensor(&meta, data);
        Ok(SLUICE_OK)
    })
}

/// Appends a CUDA tensor, NOT copied: the message borrows the tensor's device memory.
///
/// `tensor` is described as for `sluice_message_add_tensor`, on device `kDLCUDA` (its
/// `device_id` the GPU's index in this process). `stream` is a CUDA stream of that GPU
/// (`cudaStream_t`/`CUstream` as an integer; 0: the legacy default stream) that orders the
/// work producing the data: the pipe reads the tensor after the work queued on `stream` by the
/// time of the write, never before. `target_device` is where the receiver gets it: a GPU index
/// in the *receiving* process (0 and up; a device map's answer), or -1 for the receiver's CPU
/// memory. The pipe picks a CUDA channel for that pair of devices (CUDA IPC or NVLink on one
/// host, staged through host memory otherwise); a pair no channel connects fails the write.
///
/// The memory must stay allocated and unchanged, and `stream` alive, until `release(user)` is
/// called: once, from any thread, when the library holds no more references to them (after
/// the write has completed, or when the message is freed unsent; after a failed write, when
/// the pipe is freed, as a peer may still be reading; over cuda_gdr, when the pipe's cached
/// registration of the memory is dropped). The write completes in `stream`'s
/// order: work queued on `stream` after `release` may reuse the memory, but host code that
/// frees it, or work on another stream, must wait for `stream` first (a caching allocator
/// that reuses blocks on other streams must record `stream` as a user of the block).
/// `release` may be NULL. If this call fails, the tensor was not taken and `release` is not
/// called. Without a usable CUDA driver, or with memory that is not device memory of that GPU,
/// the call fails (`SLUICE_UNSUPPORTED` or `SLUICE_INVALID_ARGUMENT`); so does an empty tensor
/// (0 bytes: send it as a CPU tensor).
#[no_mangle]
pub unsafe extern "C" fn sluice_message_add_cuda_tensor(
    message: *mut SluiceMessage,
    tensor: *const DLTensor,
    stream: usize,
    target_device: i32,
    release: SluiceReleaseFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_message_add_cuda_tensor", || {
        // SAFETY: the caller passes a live message, used by no other thread meanwhile, or NULL.
        let message = unsafe { handle_mut(message, "message") }?;
        // SAFETY: the caller passes a readable `DLTensor` or NULL.
        let t = unsafe { handle(tensor, "tensor") }?;
        // SAFETY: DLPack's contract: `shape` and non-NULL `strides` hold `ndim` entries.
        let spec = unsafe { read_spec(t) }?;
        let (meta, span) = spec.check_on(sluice_dlpack::ffi::DL_CUDA)?;
        if span == 0 {
            return Err(Error::invalid(
                "an empty GPU tensor (0 bytes) has no device memory to lend: send it as a CPU tensor",
            ));
        }
        let target = match target_device {
            -1 => sluice_channel::Device::Cpu,
            d if d >= 0 => sluice_channel::Device::Cuda(d as u32),
            d => {
                return Err(Error::invalid(format!(
                    "target_device {d}: a GPU index (0 and up) or -1 (CPU)"
                )))
            }
        };
        let device = t.device.device_id as u32;
        let start = (t.data as u64).wrapping_add(t.byte_offset);
        // What the caller passed that the driver refused is the caller's mistake.
        let refused = |e: sluice_channel::CudaError| match e {
            sluice_channel::CudaError::Unavailable(_) => Error::from(e),
            e => Error::invalid(format!(
                "tensor of {span} bytes at {start:#x} on cuda:{device}, stream {stream:#x}: CUDA: {e}"
            )),
        };
        // SAFETY: the caller lends `span` bytes of device memory from the first element and a
        // live stream of this GPU (or 0) until `release(user)`, callable once from any thread,
        // as documented; `lend_cuda` checks the memory's and the stream's device.
        let buffer = unsafe { lend_cuda(device, stream, start, span, release, user) }.map_err(refused)?;
        message.add_cuda_tensor(&meta, buffer, target);
        Ok(SLUICE_OK)
    })
}

/// A `DLTensor`'s description with its arrays copied out.
///
/// # Safety
/// `shape` holds `ndim` entries, and so does `strides` unless it is NULL.
unsafe fn read_spec(t: &DLTensor) -> crate::status::Result<TensorSpec> {
    let rank = usize::try_from(t.ndim).map_err(|_| Error::invalid(format!("bad tensor: ndim {}", t.ndim)))?;
    if rank > sluice_dlpack::MAX_RANK {
        return Err(Error::invalid(format!(
            "bad tensor: ndim {rank} is above the limit of {}",
            sluice_dlpack::MAX_RANK
        )));
    }
    let array = |p: *const i64, what: &str| -> crate::status::Result<Vec<i64>> {
        if rank == 0 {
            return Ok(Vec::new());
        }
        if p.is_null() {
            return Err(Error::invalid(format!("bad tensor: {what} is NULL with ndim {rank}")));
        }
        // SAFETY: the function's contract: `rank` entries.
        Ok(unsafe { std::slice::from_raw_parts(p, rank) }.to_vec())
    };
    Ok(TensorSpec {
        device: t.device,
        dtype: t.dtype,
        shape: array(t.shape, "shape")?,
        strides: if t.strides.is_null() {
            None
        } else {
            Some(array(t.strides, "strides")?)
        },
        data_is_null: t.data.is_null(),
    })
}

/// Frees a message that was not written (NULL: nothing), releasing its tensors.
#[no_mangle]
pub unsafe extern "C" fn sluice_message_free(message: *mut SluiceMessage) {
    guard("sluice_message_free", || {
        // SAFETY: the caller gives up a message handle (or NULL).
        drop(unsafe { take(message) });
        Ok(SLUICE_OK)
    });
}
