//! The exported entry points, with the C signatures of `cuda.h` (results as `int`, handles as
//! pointers). Each one checks its arguments, writes its outputs and hands the rest to
//! [`crate::model`]. Pointer arguments come from the caller: writing through them is the only
//! `unsafe` here, each under the driver's own contract (the caller passes valid outputs).
#![allow(unsafe_code)]
#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::model::{self, *};
use crate::rules;

type Ptr = *mut c_void;

/// `CUipcMemHandle` / `CUipcEventHandle`: 64 bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcHandle {
    pub reserved: [u8; 64],
}

fn code(r: R<()>) -> c_int {
    match r {
        Ok(()) => SUCCESS,
        Err(c) => c,
    }
}

/// Writes `v` through the caller's output pointer (null: an invalid value).
macro_rules! out {
    ($p:expr, $v:expr) => {{
        if $p.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: the driver's contract: a non-null output points at writable storage of
        // this type.
        unsafe { *$p = $v };
    }};
}

const NAMES: &[(c_int, &[u8])] = &[
    (0, b"CUDA_SUCCESS\0"),
    (1, b"CUDA_ERROR_INVALID_VALUE\0"),
    (2, b"CUDA_ERROR_OUT_OF_MEMORY\0"),
    (3, b"CUDA_ERROR_NOT_INITIALIZED\0"),
    (101, b"CUDA_ERROR_INVALID_DEVICE\0"),
    (201, b"CUDA_ERROR_INVALID_CONTEXT\0"),
    (400, b"CUDA_ERROR_INVALID_HANDLE\0"),
    (600, b"CUDA_ERROR_NOT_READY\0"),
    (704, b"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED\0"),
    (801, b"CUDA_ERROR_NOT_SUPPORTED\0"),
];

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: c_int, name: *mut *const c_char) -> c_int {
    match NAMES.iter().find(|(c, _)| *c == error) {
        Some((_, n)) => {
            out!(name, n.as_ptr().cast());
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> c_int {
    out!(v, 12080);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuInit(_flags: c_uint) -> c_int {
    code(model::init())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> c_int {
    if let Err(c) = model::model() {
        return c;
    }
    out!(n, visible().len() as c_int);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut c_int, ordinal: c_int) -> c_int {
    if let Err(c) = model::model().map(drop).and_then(|()| physical(ordinal)) {
        return c;
    }
    out!(d, ordinal);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(u: *mut [u8; 16], d: c_int) -> c_int {
    match physical(d) {
        Ok(p) => {
            out!(u, uuid(p));
            SUCCESS
        }
        Err(c) => c,
    }
}

/// Copies `s` and a NUL into the caller's buffer of `len` bytes.
unsafe fn write_str(buf: *mut c_char, len: c_int, s: &str) -> c_int {
    if buf.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: the caller's buffer holds `len` bytes; we write `n + 1 <= len`.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast(), buf, n);
        *buf.add(n) = 0;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, d: c_int) -> c_int {
    match physical(d) {
        // SAFETY: forwarded caller contract.
        Ok(p) => unsafe { write_str(name, len, &format!("Sluice CUDA driver model device {p}")) },
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(id: *mut c_char, len: c_int, d: c_int) -> c_int {
    match physical(d) {
        // SAFETY: forwarded caller contract.
        Ok(p) => unsafe { write_str(id, len, &format!("0000:{:02x}:00.0", 0x10 + p)) },
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attribute: c_int, d: c_int) -> c_int {
    if let Err(c) = physical(d) {
        return c;
    }
    let value = match attribute {
        75 => 9, // compute capability major
        76 => 0, // minor
        _ => 0,  // GPUDirect RDMA and the rest: not supported / zero
    };
    out!(v, value);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, d: c_int, peer: c_int) -> c_int {
    if let Err(c) = physical(d).and_then(|_| physical(peer)) {
        return c;
    }
    let (Ok(pd), Ok(pp)) = (physical(d), physical(peer)) else {
        return INVALID_DEVICE;
    };
    out!(can, c_int::from(Model::peer_allowed(pd, pp)));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Ptr, d: c_int) -> c_int {
    let r = model::model().and_then(|mut m| {
        physical(d)?;
        *m.retained.entry(d as u32).or_default() += 1;
        Ok(())
    });
    if let Err(c) = r {
        return c;
    }
    out!(ctx, ctx_handle(d as u32) as Ptr);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: Ptr) -> c_int {
    code(set_current(ctx as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: Ptr) -> c_int {
    code(push_current(ctx as usize))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut Ptr) -> c_int {
    match pop_current() {
        Ok(c) => {
            if !ctx.is_null() {
                out!(ctx, c as Ptr);
            }
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(d: *mut c_int) -> c_int {
    match need_context("cuCtxGetDevice") {
        Ok(o) => {
            out!(d, o as c_int);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: Ptr, flags: c_uint) -> c_int {
    if flags != 0 {
        return rules::breach(
            rules::PEER_FLAGS,
            INVALID_VALUE,
            format!("cuCtxEnablePeerAccess with flags {flags}"),
        );
    }
    let r = (|| {
        let me = need_context("cuCtxEnablePeerAccess")?;
        let other = ctx_ordinal(peer as usize)?;
        if !Model::peer_allowed(physical(me as i32)?, physical(other as i32)?) {
            return Err(217); // CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
        }
        let mut m = model::model()?;
        if m.peer_enabled.contains(&(me, other)) {
            return Err(PEER_ACCESS_ALREADY_ENABLED);
        }
        m.peer_enabled.push((me, other));
        Ok(())
    })();
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut u64, size: usize) -> c_int {
    let r = need_context("cuMemAlloc").and_then(|o| model::model()?.alloc(o, size));
    match r {
        Ok(at) => {
            out!(p, at as u64);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(p: u64) -> c_int {
    code(need_context("cuMemFree").and_then(|_| model::model()?.free(p as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(p: *mut Ptr, size: usize, _flags: c_uint) -> c_int {
    let r = need_context("cuMemHostAlloc").and_then(|_| {
        let at = crate::sys::host_alloc(size).map_err(|_| OUT_OF_MEMORY)?;
        model::model()?.pinned.insert(at, (size, Arc::new(AtomicU64::new(0))));
        Ok(at)
    });
    match r {
        Ok(at) => {
            out!(p, at as Ptr);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: Ptr) -> c_int {
    let r = model::model().and_then(|mut m| match m.pinned.get(&(p as usize)).cloned() {
        Some((_, busy)) if busy.load(Ordering::Acquire) > 0 => Err(rules::breach(
            rules::FREE_BUSY,
            INVALID_VALUE,
            format!("cuMemFreeHost({p:?}) with queued copies still using it"),
        )),
        Some((len, _)) => {
            m.pinned.remove(&(p as usize));
            crate::sys::host_free(p as usize, len);
            Ok(())
        }
        None => Err(rules::breach(
            rules::HOST_FREE,
            INVALID_VALUE,
            format!("cuMemFreeHost({p:?}): not from cuMemHostAlloc"),
        )),
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(s: *mut Ptr, flags: c_uint) -> c_int {
    let r = need_context("cuStreamCreate").and_then(|o| Ok(model::model()?.new_stream(o, flags)));
    match r {
        Ok(h) => {
            out!(s, h as Ptr);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: Ptr) -> c_int {
    let r = model::model().and_then(|mut m| {
        if s.is_null() {
            return Err(rules::breach(
                rules::HANDLE,
                INVALID_HANDLE,
                "cuStreamDestroy of the legacy default stream (0)".into(),
            ));
        }
        let st = m.stream(s as usize, "cuStreamDestroy")?;
        m.streams.remove(&(s as usize));
        // Work already queued still runs (as the driver documents), then the thread ends.
        st.stop();
        Ok(())
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(s: Ptr) -> c_int {
    let st = match model::model().and_then(|mut m| m.stream(s as usize, "cuStreamSynchronize")) {
        Ok(st) => st,
        Err(c) => return c,
    };
    st.wait(st.queued());
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(s: Ptr, ctx: *mut Ptr) -> c_int {
    match model::model().and_then(|mut m| m.stream(s as usize, "cuStreamGetCtx")) {
        Ok(st) => {
            out!(ctx, ctx_handle(st.ordinal) as Ptr);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(s: Ptr, e: Ptr, _flags: c_uint) -> c_int {
    let r = model::model().and_then(|mut m| {
        let st = m.stream(s as usize, "cuStreamWaitEvent")?;
        let ev = m.event(e as usize, "cuStreamWaitEvent")?;
        drop(m);
        let mark = ev.mark("cuStreamWaitEvent")?;
        st.enqueue(&[], move || ev.wait(mark));
        Ok(())
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(e: *mut Ptr, flags: c_uint) -> c_int {
    let r = need_context("cuEventCreate").and_then(|o| model::model()?.new_event(o, flags));
    match r {
        Ok(h) => {
            out!(e, h as Ptr);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(e: Ptr) -> c_int {
    let r = model::model().and_then(|mut m| {
        let ev = m.event(e as usize, "cuEventDestroy")?;
        ev.destroyed();
        m.events.remove(&(e as usize));
        Ok(())
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(e: Ptr, s: Ptr) -> c_int {
    let r = model::model().and_then(|mut m| {
        let ev = m.event(e as usize, "cuEventRecord")?;
        let st = m.stream(s as usize, "cuEventRecord")?;
        drop(m);
        ev.record(&st)
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(e: Ptr) -> c_int {
    let r = model::model().and_then(|m| {
        let ev = m.event(e as usize, "cuEventQuery")?;
        drop(m);
        let mark = ev.mark("cuEventQuery")?;
        if ev.reached(mark) {
            Ok(())
        } else {
            Err(NOT_READY)
        }
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(e: Ptr) -> c_int {
    let r = model::model().and_then(|m| {
        let ev = m.event(e as usize, "cuEventSynchronize")?;
        drop(m);
        let mark = ev.mark("cuEventSynchronize")?;
        ev.wait(mark);
        Ok(())
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(h: *mut IpcHandle, p: u64) -> c_int {
    match need_context("cuIpcGetMemHandle").and_then(|_| model::model()?.export(p as usize)) {
        Ok(handle) => {
            out!(h, IpcHandle { reserved: handle });
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(p: *mut u64, h: IpcHandle, flags: c_uint) -> c_int {
    if flags != 1 {
        return rules::breach(
            rules::IPC_FLAGS,
            INVALID_VALUE,
            format!("cuIpcOpenMemHandle with flags {flags}"),
        );
    }
    match need_context("cuIpcOpenMemHandle").and_then(|o| model::model()?.import(o, &h.reserved)) {
        Ok(at) => {
            out!(p, at as u64);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcCloseMemHandle(p: u64) -> c_int {
    code(need_context("cuIpcCloseMemHandle").and_then(|_| model::model()?.close_import(p as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcGetEventHandle(h: *mut IpcHandle, e: Ptr) -> c_int {
    let r = model::model().and_then(|m| m.event(e as usize, "cuIpcGetEventHandle")?.export());
    match r {
        Ok(handle) => {
            out!(h, IpcHandle { reserved: handle });
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenEventHandle(e: *mut Ptr, h: IpcHandle) -> c_int {
    match need_context("cuIpcOpenEventHandle").and_then(|o| model::model()?.import_event(o, &h.reserved)) {
        Ok(at) => {
            out!(e, at as Ptr);
            SUCCESS
        }
        Err(c) => c,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(data: Ptr, attribute: c_int, p: u64) -> c_int {
    let r = model::model().and_then(|m| {
        let p = p as usize;
        if let Some((&base, a)) = m.allocs.range(..=p).next_back() {
            if p - base < a.size.max(1) {
                return Ok((2u32, a.ordinal));
            }
        }
        if let Some((&base, &(len, _))) = m.pinned.range(..=p).next_back() {
            if p - base < len.max(1) {
                return Ok((1u32, 0));
            }
        }
        Err(INVALID_VALUE)
    });
    let (kind, ordinal) = match r {
        Ok(v) => v,
        Err(c) => return c,
    };
    match attribute {
        2 => out!(data.cast::<c_uint>(), kind),
        9 => out!(data.cast::<c_int>(), ordinal as c_int),
        _ => return NOT_SUPPORTED,
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(base: *mut u64, size: *mut usize, p: u64) -> c_int {
    let r = model::model().and_then(|m| {
        // An address outside every allocation is an answer, not a misuse: CUDA_ERROR_NOT_FOUND.
        let p = p as usize;
        match m.allocs.range(..=p).next_back() {
            Some((&base, a)) if p - base < a.size.max(1) => Ok((base, a.size)),
            _ => Err(500),
        }
    });
    match r {
        Ok((b, s)) => {
            if !base.is_null() {
                out!(base, b as u64);
            }
            if !size.is_null() {
                out!(size, s);
            }
            SUCCESS
        }
        Err(c) => c,
    }
}

/// The pinned allocation (from cuMemHostAlloc) holding `len` bytes at `p`, by its count of
/// queued operations, if there is one.
fn pinned(m: &Model, p: usize, len: usize) -> Option<Arc<AtomicU64>> {
    m.pinned
        .range(..=p)
        .next_back()
        .filter(|(&base, &(l, _))| p - base <= l && len <= l - (p - base))
        .map(|(_, (_, busy))| busy.clone())
}

/// Queues a device-to-device copy.
fn copy_d2d(dst: u64, src: u64, n: usize, s: Ptr, call: &str) -> c_int {
    let r = model::model().and_then(|mut m| {
        let st = m.stream(s as usize, call)?;
        let (d, doff) = m.find(dst as usize, n, call)?;
        let (sa, soff) = m.find(src as usize, n, call)?;
        let (dst, src) = (dst as usize, src as usize);
        if n > 0 && dst < src + n && src < dst + n {
            return Err(rules::breach(
                rules::COPY_OVERLAP,
                INVALID_VALUE,
                format!("{call}: {n} bytes from {src:#x} to {dst:#x} overlap"),
            ));
        }
        let (to, from) = (d.data(doff), sa.data(soff));
        let uses = [d.pending.clone(), sa.pending.clone()];
        // SAFETY: both ranges lie in live allocations, kept mapped while the copy is queued
        // (freeing them meanwhile is a breach that aborts).
        st.enqueue(&uses, move || unsafe { crate::sys::copy(to, from, n) });
        Ok(())
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, s: Ptr) -> c_int {
    copy_d2d(dst, src, n, s, "cuMemcpyDtoDAsync")
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(dst: u64, dctx: Ptr, src: u64, sctx: Ptr, n: usize, s: Ptr) -> c_int {
    if let Err(c) = ctx_ordinal(dctx as usize).and_then(|_| ctx_ordinal(sctx as usize)) {
        return c;
    }
    copy_d2d(dst, src, n, s, "cuMemcpyPeerAsync")
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(dst: u64, src: *const c_void, n: usize, s: Ptr) -> c_int {
    let r = model::model().and_then(|mut m| {
        let st = m.stream(s as usize, "cuMemcpyHtoDAsync")?;
        let (d, off) = m.find(dst as usize, n, "cuMemcpyHtoDAsync")?;
        let to = d.data(off);
        let from = src as usize;
        if let Some(host) = pinned(&m, from, n) {
            // SAFETY: pinned memory the caller keeps until the copy is done (the driver's
            // contract for asynchronous copies; freeing it meanwhile breaks a rule); the
            // device range is live.
            st.enqueue(&[d.pending.clone(), host], move || unsafe {
                crate::sys::copy(to, from, n)
            });
        } else {
            // Pageable: staged now, as the driver does ("returns once the pageable buffer has
            // been copied to the staging memory"); with SLUICE_CUDA_MODEL_PAGEABLE=sync, the
            // call also waits for the copy itself (a driver may), which code must not mind.
            let mut staged = vec![0u8; n];
            // SAFETY: the caller's source holds `n` readable bytes for the call.
            unsafe { crate::sys::copy(staged.as_mut_ptr() as usize, from, n) };
            let ticket = st.enqueue(std::slice::from_ref(&d.pending), move || unsafe {
                // SAFETY: the staged copy lives in this closure; the device range is live.
                crate::sys::copy(to, staged.as_ptr() as usize, n)
            });
            if std::env::var("SLUICE_CUDA_MODEL_PAGEABLE").as_deref() == Ok("sync") {
                drop(m);
                st.wait(ticket);
            }
        }
        Ok(())
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(dst: Ptr, src: u64, n: usize, s: Ptr) -> c_int {
    let r = model::model().and_then(|mut m| {
        let st = m.stream(s as usize, "cuMemcpyDtoHAsync")?;
        let (a, off) = m.find(src as usize, n, "cuMemcpyDtoHAsync")?;
        let from = a.data(off);
        let to = dst as usize;
        let host = pinned(&m, to, n);
        let sync = host.is_none();
        let uses: Vec<_> = std::iter::once(a.pending.clone()).chain(host).collect();
        // Queued (its uses counted) before the model is unlocked: a free from another thread
        // then sees the copy pending.
        // SAFETY: the caller's destination holds `n` writable bytes until the copy is done
        // (pinned: the asynchronous contract; pageable: this call waits for it).
        let ticket = st.enqueue(&uses, move || unsafe { crate::sys::copy(to, from, n) });
        drop(m);
        if sync {
            // "For transfers from device memory to pageable host memory, the function will
            // return only once the copy has completed."
            st.wait(ticket);
        }
        Ok(())
    });
    code(r)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(dst: u64, value: u8, n: usize, s: Ptr) -> c_int {
    let r = model::model().and_then(|mut m| {
        let st = m.stream(s as usize, "cuMemsetD8Async")?;
        let (a, off) = m.find(dst as usize, n, "cuMemsetD8Async")?;
        let to = a.data(off);
        let uses = [a.pending.clone()];
        // SAFETY: a live device range, kept mapped while queued.
        st.enqueue(&uses, move || unsafe { crate::sys::fill(to, value, n) });
        Ok(())
    });
    code(r)
}

/// For the model's tests: whether queued work is done everywhere.
pub fn idle() -> bool {
    model::model().is_ok_and(|m| {
        m.streams
            .values()
            .chain(m.legacy.values())
            .all(|s| s.completed() >= s.queued())
            && m.allocs.values().all(|a| a.pending.load(Ordering::Acquire) == 0)
    })
}
