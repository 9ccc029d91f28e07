//! DLPack capsules: taking a producer's (`__dlpack__()`) and making our own. The only unsafe
//! code of the binding.
//!
//! The protocol: a capsule named `"dltensor"` holds a `DLManagedTensor`; a consumer renames it
//! `"used_dltensor"` and becomes responsible for the deleter; a capsule destroyed while still
//! named `"dltensor"` was never consumed, and its destructor deletes the tensor.

use std::ffi::{c_void, CStr};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::{ffi, PyErr};
use sluice_dlpack::ffi::{DLManagedTensor, DLManagedTensorVersioned};
use sluice_dlpack::Imported;

const DLTENSOR: &CStr = c"dltensor";
const USED: &CStr = c"used_dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";

/// Takes the tensor out of `obj`: an object with `__dlpack__`, or a `"dltensor"` capsule.
pub fn import(obj: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let py = obj.py();
    // SAFETY: `obj` is a live object (we hold a reference).
    let is_capsule = unsafe { ffi::PyCapsule_CheckExact(obj.as_ptr()) } != 0;
    let capsule = if is_capsule {
        obj.clone()
    } else {
        match obj.getattr(pyo3::intern!(py, "__dlpack__")) {
            // DLPack 1.0 first (it can export read-only memory); producers that predate it
            // reject the keyword.
            Ok(f) => {
                let kwargs = pyo3::types::PyDict::new(py);
                kwargs.set_item("max_version", (1, 0))?;
                match f.call((), Some(&kwargs)) {
                    Ok(c) => c,
                    Err(e) if e.is_instance_of::<PyTypeError>(py) => f.call0()?,
                    Err(e) => return Err(e),
                }
            }
            Err(_) => {
                return Err(PyTypeError::new_err(format!(
                    "a {} cannot be sent as a tensor: it has no __dlpack__ (torch.Tensor, numpy.ndarray, \
                     CuPy and JAX arrays have one)",
                    obj.get_type().name()?
                )))
            }
        }
    };
    let raw = capsule.as_ptr();
    // SAFETY: `raw` is live; IsValid checks the type and the name and sets no error.
    if unsafe { ffi::PyCapsule_IsValid(raw, VERSIONED.as_ptr()) } == 1 {
        // SAFETY: a valid capsule of that name holds a DLManagedTensorVersioned.
        let managed = unsafe { ffi::PyCapsule_GetPointer(raw, VERSIONED.as_ptr()) } as *mut DLManagedTensorVersioned;
        if managed.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: renaming a live capsule to a static name: consumed from here on.
        if unsafe { ffi::PyCapsule_SetName(raw, USED_VERSIONED.as_ptr()) } != 0 {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: handed over by the rename; valid until its deleter, which runs once.
        return unsafe { Imported::from_versioned(managed) }
            .map_err(|e| PyValueError::new_err(format!("cannot send this tensor: {e}")));
    }
    // SAFETY: as above.
    if unsafe { ffi::PyCapsule_IsValid(raw, DLTENSOR.as_ptr()) } != 1 {
        return Err(PyTypeError::new_err(
            "__dlpack__ returned something other than an unused \"dltensor\" capsule",
        ));
    }
    // SAFETY: a valid capsule of that name: its pointer is the producer's DLManagedTensor.
    let managed = unsafe { ffi::PyCapsule_GetPointer(raw, DLTENSOR.as_ptr()) } as *mut DLManagedTensor;
    if managed.is_null() {
        return Err(PyErr::fetch(py));
    }
    // Consumed from here on: the capsule's destructor will leave the tensor alone.
    // SAFETY: renaming a live capsule to a static name.
    if unsafe { ffi::PyCapsule_SetName(raw, USED.as_ptr()) } != 0 {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: the producer handed the tensor over (the capsule is renamed), and DLPack promises
    // its memory stays valid until the deleter, which `Imported` calls exactly once.
    unsafe { Imported::from_raw(managed) }.map_err(|e| PyValueError::new_err(format!("cannot send this tensor: {e}")))
}

/// Deletes a capsule's tensor unless a consumer took it.
unsafe extern "C" fn destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed; IsValid sets no error.
    if unsafe { ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) } != 1 {
        return;
    }
    // SAFETY: still named "dltensor": nobody consumed it, so the tensor is ours to delete.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) } as *mut DLManagedTensor;
    if managed.is_null() {
        return;
    }
    // SAFETY: a tensor made by `sluice_dlpack::export`, deleted once.
    if let Some(deleter) = unsafe { (*managed).deleter } {
        // SAFETY: as above.
        unsafe { deleter(managed) }
    }
}

/// Deletes a versioned capsule's tensor unless a consumer took it.
unsafe extern "C" fn destructor_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed; IsValid sets no error.
    if unsafe { ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) } != 1 {
        return;
    }
    // SAFETY: unconsumed: ours to delete.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()) } as *mut DLManagedTensorVersioned;
    if managed.is_null() {
        return;
    }
    // SAFETY: a tensor made by `sluice_dlpack::export_versioned`.
    if let Some(deleter) = unsafe { (*managed).deleter } {
        // SAFETY: its own deleter, once.
        unsafe { deleter(managed) }
    }
}

/// Wraps a tensor made by `sluice_dlpack::export_versioned` in a `"dltensor_versioned"` capsule.
pub fn export_versioned(py: Python<'_>, managed: *mut DLManagedTensorVersioned) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: as in `export`.
    let capsule = unsafe { ffi::PyCapsule_New(managed as *mut c_void, VERSIONED.as_ptr(), Some(destructor_versioned)) };
    if capsule.is_null() {
        // SAFETY: not handed over: still ours to delete, once.
        if let Some(deleter) = unsafe { (*managed).deleter } {
            // SAFETY: its own deleter.
            unsafe { deleter(managed) }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}

/// Wraps a tensor made by `sluice_dlpack::export` in a `"dltensor"` capsule that owns it.
pub fn export(py: Python<'_>, managed: *mut DLManagedTensor) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: `managed` is a live tensor we own; the capsule takes it over, with a destructor
    // that deletes it unless consumed.
    let capsule = unsafe { ffi::PyCapsule_New(managed as *mut c_void, DLTENSOR.as_ptr(), Some(destructor)) };
    if capsule.is_null() {
        // SAFETY: not handed over: still ours to delete, once.
        if let Some(deleter) = unsafe { (*managed).deleter } {
            // SAFETY: its own deleter, on its own tensor, once.
            unsafe { deleter(managed) }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference, returned by PyCapsule_New.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}
