//! Ownership across the DLPack boundary, both ways. The only unsafe code of the crate.

use std::any::Any;
use std::ffi::c_void;

use crate::ffi::{DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLTensor, DLPACK_VERSION};
use crate::meta::{DType, Meta, MetaError, MAX_RANK};

/// A producer's tensor we own until dropped (then its deleter runs, on whatever thread drops
/// it: DLPack requires deleters to be callable from any thread).
pub struct Imported {
    managed: Managed,
    read_only: bool,
    meta: Meta,
    device: DLDevice,
    start: *const u8,
    span: usize,
}

// SAFETY: the memory is only read through `bytes`, and DLPack's contract makes the deleter
// callable from any thread (Python producers take the GIL in theirs).
unsafe impl Send for Imported {}
// SAFETY: as above; `&Imported` only reads.
unsafe impl Sync for Imported {}

/// A producer's tensor, in either of DLPack's forms.
#[derive(Clone, Copy)]
enum Managed {
    Legacy(*mut DLManagedTensor),
    Versioned(*mut DLManagedTensorVersioned),
}

impl Managed {
    /// Runs the producer's deleter.
    ///
    /// # Safety
    /// The tensor is live and ours to delete; it is not used afterwards.
    unsafe fn delete(self) {
        match self {
            // SAFETY: per the caller.
            Managed::Legacy(m) => unsafe { delete(m) },
            Managed::Versioned(m) => {
                // SAFETY: live per the caller.
                if let Some(deleter) = unsafe { (*m).deleter } {
                    // SAFETY: the producer's own deleter, once.
                    unsafe { deleter(m) }
                }
            }
        }
    }
}

impl Imported {
    /// Takes ownership of a DLPack 1.x tensor (whose deleter runs exactly once, as with
    /// [`from_raw`](Self::from_raw)). A major version other than 1 is refused (and deleted).
    ///
    /// # Safety
    /// As for [`from_raw`](Self::from_raw).
    pub unsafe fn from_versioned(managed: *mut DLManagedTensorVersioned) -> Result<Imported, MetaError> {
        // SAFETY: the caller hands us a live tensor.
        let (version, flags, t) = unsafe { ((*managed).version, (*managed).flags, (*managed).dl_tensor) };
        let owner = Managed::Versioned(managed);
        if version.major != DLPACK_VERSION.major {
            // SAFETY: ours to delete, once.
            unsafe { owner.delete() };
            return Err(MetaError::Malformed(format!(
                "DLPack version {}.{} (this build reads {}.x)",
                version.major, version.minor, DLPACK_VERSION.major
            )));
        }
        // SAFETY: live and ours, per the caller.
        unsafe { Imported::adopt(owner, &t, flags & crate::ffi::FLAG_READ_ONLY != 0) }
    }

    /// Takes ownership of `managed` (whatever happens, its deleter runs exactly once: here on
    /// error, else when the `Imported` drops).
    ///
    /// # Safety
    /// `managed` must be a live `DLManagedTensor` that nobody else will delete, whose shape and
    /// strides arrays hold `ndim` entries and whose memory stays valid until its deleter runs.
    pub unsafe fn from_raw(managed: *mut DLManagedTensor) -> Result<Imported, MetaError> {
        // SAFETY: the caller hands us a live tensor.
        let t: DLTensor = unsafe { (*managed).dl_tensor };
        // SAFETY: live and ours, per the caller.
        unsafe { Imported::adopt(Managed::Legacy(managed), &t, false) }
    }

    /// # Safety
    /// `managed` is live and ours; `t` is its tensor.
    unsafe fn adopt(managed: Managed, t: &DLTensor, read_only: bool) -> Result<Imported, MetaError> {
        let meta = match describe(t).and_then(|m| m.span().map(|s| (m, s))) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: ours to delete, exactly once.
                unsafe { managed.delete() };
                return Err(e);
            }
        };
        let (meta, span) = meta;
        let start = if span == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr() as *const u8
        } else {
            (t.data as *const u8).wrapping_add(t.byte_offset as usize)
        };
        Ok(Imported {
            managed,
            read_only,
            meta,
            device: t.device,
            start,
            span,
        })
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// The producer flagged the memory read-only (DLPack 1.x).
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn device(&self) -> DLDevice {
        self.device
    }

    /// The address of the first element.
    pub fn data_ptr(&self) -> *const u8 {
        self.start
    }

    /// The tensor's span: its bytes from first element to last, as they lie in memory. Only
    /// meaningful for memory the CPU can read (check [`device`](Self::device)).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the producer guarantees `span` bytes from `start` stay valid until its
        // deleter runs, which is not before `self` drops; `span` is 0 for an empty tensor,
        // whose pointer is then dangling but aligned.
        unsafe { std::slice::from_raw_parts(self.start, self.span) }
    }
}

impl AsRef<[u8]> for Imported {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: we own it, and this runs once.
        unsafe { self.managed.delete() }
    }
}

/// Calls a managed tensor's deleter, if it has one.
///
/// # Safety
/// `managed` is live and ours to delete; it is not used afterwards.
unsafe fn delete(managed: *mut DLManagedTensor) {
    // SAFETY: live per the caller.
    if let Some(deleter) = unsafe { (*managed).deleter } {
        // SAFETY: the producer's own deleter, called once on its own tensor.
        unsafe { deleter(managed) }
    }
}

/// Reads a `DLTensor`'s dtype, shape and strides (null strides: row-major).
fn describe(t: &DLTensor) -> Result<Meta, MetaError> {
    let dtype = DType::from_dl(t.dtype)?;
    let rank = usize::try_from(t.ndim).map_err(|_| MetaError::Rank(usize::MAX))?;
    if rank > MAX_RANK {
        return Err(MetaError::Rank(rank));
    }
    let shape: Vec<i64> = if rank == 0 {
        Vec::new()
    } else {
        // SAFETY: DLPack's contract: `shape` holds `ndim` entries.
        unsafe { std::slice::from_raw_parts(t.shape, rank) }.to_vec()
    };
    if t.strides.is_null() || rank == 0 {
        return Ok(Meta::contiguous(dtype, &shape));
    }
    // SAFETY: non-null strides hold `ndim` entries.
    let strides = unsafe { std::slice::from_raw_parts(t.strides, rank) }.to_vec();
    Ok(Meta { dtype, shape, strides })
}

/// What an exported tensor owns: the `DLManagedTensor` first (its address is the holder's),
/// the arrays it points into, and the memory's owner.
#[repr(C)]
struct Holder {
    managed: DLManagedTensor,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _owner: Box<dyn Any + Send>,
}

unsafe extern "C" fn drop_holder(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` is the first field of a `Holder` leaked by `export`, and DLPack calls
    // the deleter once.
    drop(unsafe { Box::from_raw(managed as *mut Holder) });
}

/// Hands out `meta`'s tensor at `data` (on `device`) as a `DLManagedTensor` that owns `owner`
/// (dropped by the consumer's call to the deleter). The consumer may write through `data`.
///
/// # Safety
/// `data` must point at `meta.span()` bytes that `owner` keeps valid and that nothing else
/// writes while the tensor lives.
pub unsafe fn export(data: *mut u8, device: DLDevice, meta: &Meta, owner: Box<dyn Any + Send>) -> *mut DLManagedTensor {
    let mut holder = Box::new(Holder {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data as *mut c_void,
                device,
                ndim: meta.shape.len() as i32,
                dtype: meta.dtype.to_dl(),
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(drop_holder),
        },
        shape: meta.shape.clone(),
        strides: meta.strides.clone(),
        _owner: owner,
    });
    // The vectors' buffers do not move when the box is leaked.
    holder.managed.dl_tensor.shape = holder.shape.as_mut_ptr();
    holder.managed.dl_tensor.strides = holder.strides.as_mut_ptr();
    let raw = Box::into_raw(holder);
    // SAFETY: just allocated.
    unsafe { (*raw).managed.manager_ctx = raw as *mut c_void };
    raw as *mut DLManagedTensor
}

/// What a versioned export owns (as [`Holder`]).
#[repr(C)]
struct VersionedHolder {
    managed: DLManagedTensorVersioned,
    shape: Vec<i64>,
    strides: Vec<i64>,
    _owner: Box<dyn Any + Send>,
}

unsafe extern "C" fn drop_versioned(managed: *mut DLManagedTensorVersioned) {
    if managed.is_null() {
        return;
    }
    // SAFETY: the first field of a `VersionedHolder` leaked by `export_versioned`, deleted once.
    drop(unsafe { Box::from_raw(managed as *mut VersionedHolder) });
}

/// [`export`] in DLPack 1.0's form, with its `flags` (e.g. [`crate::ffi::FLAG_READ_ONLY`]).
///
/// # Safety
/// As for [`export`].
pub unsafe fn export_versioned(
    data: *mut u8,
    device: DLDevice,
    meta: &Meta,
    flags: u64,
    owner: Box<dyn Any + Send>,
) -> *mut DLManagedTensorVersioned {
    let mut holder = Box::new(VersionedHolder {
        managed: DLManagedTensorVersioned {
            version: DLPACK_VERSION,
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(drop_versioned),
            flags,
            dl_tensor: DLTensor {
                data: data as *mut c_void,
                device,
                ndim: meta.shape.len() as i32,
                dtype: meta.dtype.to_dl(),
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
        },
        shape: meta.shape.clone(),
        strides: meta.strides.clone(),
        _owner: owner,
    });
    holder.managed.dl_tensor.shape = holder.shape.as_mut_ptr();
    holder.managed.dl_tensor.strides = holder.strides.as_mut_ptr();
    let raw = Box::into_raw(holder);
    // SAFETY: just allocated.
    unsafe { (*raw).managed.manager_ctx = raw as *mut c_void };
    raw as *mut DLManagedTensorVersioned
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::DL_CPU;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn export_then_import_is_one_owner_dropped_once() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut data: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let ptr = data.as_mut_ptr() as *mut u8;
        let meta = Meta::contiguous(DType::F32, &[3, 4]);
        let cpu = DLDevice {
            device_type: DL_CPU,
            device_id: 0,
        };
        // SAFETY: `data` outlives the tensor (dropped below, after the import).
        let raw = unsafe { export(ptr, cpu, &meta, Box::new(Counted(drops.clone()))) };
        // SAFETY: freshly exported, ours.
        let imported = unsafe { Imported::from_raw(raw) }.unwrap();
        assert_eq!(imported.meta(), &meta);
        assert_eq!(imported.data_ptr(), ptr as *const u8);
        assert_eq!(imported.bytes().len(), 48);
        assert_eq!(&imported.bytes()[4..8], &1f32.to_ne_bytes());
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(imported);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        drop(data);
    }

    #[test]
    fn versioned_round_trip_keeps_flags_and_refuses_other_majors() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut data = vec![7u8; 6];
        let meta = Meta::contiguous(DType::U8, &[2, 3]);
        let cpu = DLDevice {
            device_type: DL_CPU,
            device_id: 0,
        };
        // SAFETY: `data` outlives the tensor.
        let raw = unsafe {
            export_versioned(
                data.as_mut_ptr(),
                cpu,
                &meta,
                crate::ffi::FLAG_READ_ONLY,
                Box::new(Counted(drops.clone())),
            )
        };
        // SAFETY: ours.
        let imported = unsafe { Imported::from_versioned(raw) }.unwrap();
        assert!(imported.read_only());
        assert_eq!(imported.bytes(), &[7u8; 6]);
        drop(imported);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // SAFETY: as above.
        let raw = unsafe { export_versioned(data.as_mut_ptr(), cpu, &meta, 0, Box::new(Counted(drops.clone()))) };
        // SAFETY: ours; a future major version must be refused.
        unsafe { (*raw).version.major = 2 };
        // SAFETY: ours.
        assert!(unsafe { Imported::from_versioned(raw) }.is_err());
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_refused_import_still_runs_the_deleter() {
        let drops = Arc::new(AtomicUsize::new(0));
        let meta = Meta {
            dtype: DType::U8,
            shape: vec![-3],
            strides: vec![1],
        };
        let cpu = DLDevice {
            device_type: DL_CPU,
            device_id: 0,
        };
        // SAFETY: a zero-length view; nothing is read.
        let raw = unsafe { export(std::ptr::null_mut(), cpu, &meta, Box::new(Counted(drops.clone()))) };
        // SAFETY: ours.
        let err = unsafe { Imported::from_raw(raw) }.err().unwrap();
        assert!(matches!(err, MetaError::Negative { .. }));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }
}
