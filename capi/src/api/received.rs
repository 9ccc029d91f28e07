//! Reading a received message.

use std::ffi::{c_int, c_void};

use sluice_dlpack::ffi::DLTensor;

use super::{guard, guard_or, handle, handle_mut, out as place, take};
use crate::received::{SluiceBuffer, SluiceReceived};
use crate::status::SLUICE_OK;

/// Sets `*data` and `*len` to `bytes`, valid as long as the received message.
///
/// # Safety
/// `data` and `len` are NULL or writable.
unsafe fn put_bytes(bytes: &[u8], data: *mut *const u8, len: *mut usize) -> crate::status::Result<c_int> {
    // SAFETY: forwarded contract.
    let data = unsafe { place(data, "data", std::ptr::null()) }?;
    // SAFETY: forwarded contract.
    let len = unsafe { place(len, "len", 0) }?;
    data.set(bytes.as_ptr());
    len.set(bytes.len());
    Ok(SLUICE_OK)
}

/// The message's metadata: `*data` (valid as long as `received`) and `*len`.
#[no_mangle]
pub unsafe extern "C" fn sluice_received_metadata(
    received: *const SluiceReceived,
    data: *mut *const u8,
    len: *mut usize,
) -> c_int {
    guard("sluice_received_metadata", || {
        // SAFETY: the caller passes a live received message or NULL.
        let r = unsafe { handle(received, "received") }?;
        // SAFETY: the caller passes writable places or NULL.
        unsafe { put_bytes(r.metadata(), data, len) }
    })
}

/// The number of payloads (0 if `received` is NULL).
#[no_mangle]
pub unsafe extern "C" fn sluice_received_payload_count(received: *const SluiceReceived) -> usize {
    guard_or(
        "sluice_received_payload_count",
        |_| 0,
        || {
            // SAFETY: the caller passes a live received message or NULL.
            Ok(unsafe { handle(received, "received") }?.payloads().len())
        },
    )
}

/// Payload `index`: `*data` (valid as long as `received`) and `*len`. An index out of range is
/// `SLUICE_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn sluice_received_payload(
    received: *const SluiceReceived,
    index: usize,
    data: *mut *const u8,
    len: *mut usize,
) -> c_int {
    guard("sluice_received_payload", || {
        // SAFETY: the caller passes a live received message or NULL.
        let r = unsafe { handle(received, "received") }?;
        let payload = r.payload(index)?;
        // SAFETY: the caller passes writable places or NULL.
        unsafe { put_bytes(payload, data, len) }
    })
}

/// The number of tensors (0 if `received` is NULL).
#[no_mangle]
pub unsafe extern "C" fn sluice_received_tensor_count(received: *const SluiceReceived) -> usize {
    guard_or(
        "sluice_received_tensor_count",
        |_| 0,
        || {
            // SAFETY: the caller passes a live received message or NULL.
            Ok(unsafe { handle(received, "received") }?.tensor_count())
        },
    )
}

/// Fills `*out` with tensor `index` as a `DLTensor` viewing the received memory (device
/// `kDLCPU`, `byte_offset` 0, strides always set). The data and the shape and strides arrays
/// are owned by `received` and valid as long as it; treat the data as read-only. A tensor
/// received into GPU memory (`sluice_pipe_read_then_with`) is `kDLCUDA` with its GPU's index,
/// its data the allocator's memory (see `sluice_received_tensor_device` for its stream). The tensor's
/// description is checked against its bytes: a bad one (from a buggy or hostile peer, or a
/// peer that sent its own metadata) is `SLUICE_PEER` with the reason, and `*out` is zeroed.
#[no_mangle]
pub unsafe extern "C" fn sluice_received_tensor(
    received: *const SluiceReceived,
    index: usize,
    out: *mut DLTensor,
) -> c_int {
    guard("sluice_received_tensor", || {
        // SAFETY: the caller passes a live received message or NULL.
        let r = unsafe { handle(received, "received") }?;
        // SAFETY: the caller passes a writable `DLTensor` or NULL.
        let out = unsafe { place(out, "out", empty_tensor()) }?;
        out.set(r.tensor(index)?);
        Ok(SLUICE_OK)
    })
}

/// A zeroed `DLTensor`.
fn empty_tensor() -> DLTensor {
    DLTensor {
        data: std::ptr::null_mut(),
        device: sluice_dlpack::ffi::DLDevice {
            device_type: 0,
            device_id: 0,
        },
        ndim: 0,
        dtype: sluice_dlpack::ffi::DLDataType {
            code: 0,
            bits: 0,
            lanes: 0,
        },
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// For tensor `index` received into GPU memory (`sluice_pipe_read_then_with`): `*stream`, the
/// stream its copy was queued on (work queued there afterwards sees the data; make any other
/// stream wait on it first), and `*handle`, the allocator's handle for its memory. For a
/// tensor in CPU memory both are 0 (NULL). An index out of range is `SLUICE_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn sluice_received_tensor_device(
    received: *const SluiceReceived,
    index: usize,
    stream: *mut usize,
    handle_out: *mut *mut c_void,
) -> c_int {
    guard("sluice_received_tensor_device", || {
        // SAFETY: the caller passes a live received message or NULL.
        let r = unsafe { handle(received, "received") }?;
        // SAFETY: the caller passes writable places or NULL.
        let stream = unsafe { place(stream, "stream", 0) }?;
        // SAFETY: as above.
        let handle_out = unsafe { place(handle_out, "handle", std::ptr::null_mut()) }?;
        if let Some((s, h)) = r.tensor_gpu(index)? {
            stream.set(s);
            handle_out.set(h as *mut c_void);
        }
        Ok(SLUICE_OK)
    })
}

/// Tensor `index`'s bytes as they arrived (its span), whatever its metadata: `*data` (valid as
/// long as `received`, read-only) and `*len`. A tensor in GPU memory has no bytes here
/// (`SLUICE_INVALID_ARGUMENT`): `sluice_received_tensor` gives its device pointer.
#[no_mangle]
pub unsafe extern "C" fn sluice_received_tensor_data(
    received: *const SluiceReceived,
    index: usize,
    data: *mut *const u8,
    len: *mut usize,
) -> c_int {
    guard("sluice_received_tensor_data", || {
        // SAFETY: the caller passes a live received message or NULL.
        let r = unsafe { handle(received, "received") }?;
        let bytes = r.tensor_data(index)?;
        // SAFETY: the caller passes writable places or NULL.
        unsafe { put_bytes(bytes, data, len) }
    })
}

/// Takes tensor `index`'s bytes out of `received` without copying them, when they are this
/// process's own memory (a channel copied them in) rather than memory the pipe lends (a shared
/// segment, read-only): then `*buffer` owns them (free it with `sluice_buffer_free`, in any
/// thread, before or after `received`), `*data` points at them, writable, and `*len` is their
/// length, and the tensor's data in `received` reads as empty from then on (its description,
/// `sluice_received_tensor`, stays: ask for it first). Otherwise `*buffer` and `*data` are
/// NULL and `*len` 0: copy the bytes from `sluice_received_tensor_data` instead. Either way the
/// status is `SLUICE_OK` unless the arguments are wrong.
#[no_mangle]
pub unsafe extern "C" fn sluice_received_tensor_take(
    received: *mut SluiceReceived,
    index: usize,
    buffer: *mut *mut SluiceBuffer,
    data: *mut *mut u8,
    len: *mut usize,
) -> c_int {
    guard("sluice_received_tensor_take", || {
        // SAFETY: the caller passes writable places or NULL.
        let buffer = unsafe { place(buffer, "buffer", std::ptr::null_mut()) }?;
        // SAFETY: as above.
        let data = unsafe { place(data, "data", std::ptr::null_mut()) }?;
        // SAFETY: as above.
        let len = unsafe { place(len, "len", 0) }?;
        // SAFETY: the caller passes a live received message or NULL, used by no other thread
        // during the call.
        let r = unsafe { handle_mut(received, "received") }?;
        if let Some(mut taken) = r.take_tensor_data(index)? {
            data.set(taken.bytes.as_mut_ptr());
            len.set(taken.bytes.len());
            buffer.set(Box::into_raw(Box::new(taken)));
        }
        Ok(SLUICE_OK)
    })
}

/// Frees a buffer taken with `sluice_received_tensor_take` (NULL is ignored).
#[no_mangle]
pub unsafe extern "C" fn sluice_buffer_free(buffer: *mut SluiceBuffer) {
    guard("sluice_buffer_free", || {
        // SAFETY: the caller gives back a buffer handle (or NULL) it no longer uses.
        drop(unsafe { take(buffer) });
        Ok(SLUICE_OK)
    });
}

/// Tensor `index`'s metadata bytes as they arrived (for peers that send their own): `*data`
/// (valid as long as `received`) and `*len`.
#[no_mangle]
pub unsafe extern "C" fn sluice_received_tensor_metadata(
    received: *const SluiceReceived,
    index: usize,
    data: *mut *const u8,
    len: *mut usize,
) -> c_int {
    guard("sluice_received_tensor_metadata", || {
        // SAFETY: the caller passes a live received message or NULL.
        let r = unsafe { handle(received, "received") }?;
        let bytes = r.tensor_metadata(index)?;
        // SAFETY: the caller passes writable places or NULL.
        unsafe { put_bytes(bytes, data, len) }
    })
}

/// Frees a received message and the memory its tensors view (NULL: nothing).
#[no_mangle]
pub unsafe extern "C" fn sluice_received_free(received: *mut SluiceReceived) {
    guard("sluice_received_free", || {
        // SAFETY: the caller gives up a received-message handle (or NULL).
        drop(unsafe { take(received) });
        Ok(SLUICE_OK)
    });
}
