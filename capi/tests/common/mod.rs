//! Helpers for the C API's tests: a watchdog, status checks, and a connected pair of pipes.
#![allow(dead_code)]

use std::ffi::{c_void, CStr, CString};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sluice_c::*;

/// Aborts the process if the test has not finished in 60 s (a hang becomes a failure, not a
/// stuck CI job).
pub fn watchdog(test: &'static str) {
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        eprintln!("watchdog: {test} did not finish within 60 s (deadlock?)");
        std::process::abort();
    });
}

pub fn last_error() -> String {
    // SAFETY: the library returns a NUL-terminated string valid until the next call.
    unsafe { CStr::from_ptr(sluice_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts `rc` is `SLUICE_OK`, with the last error otherwise.
#[track_caller]
pub fn ok(rc: i32, what: &str) {
    assert_eq!(rc, SLUICE_OK, "{what}: {} ({})", status(rc), last_error());
}

pub fn status(rc: i32) -> String {
    // SAFETY: a static string.
    unsafe { CStr::from_ptr(sluice_status_name(rc)) }
        .to_string_lossy()
        .into_owned()
}

pub fn cstring(s: &str) -> CString {
    CString::new(s).unwrap()
}

/// A context, a listener and the two ends of one pipe.
pub struct Pair {
    pub ctx: *mut SluiceContext,
    pub listener: *mut SluiceListener,
    pub client: *mut SluicePipe,
    pub server: *mut SluicePipe,
}

impl Pair {
    /// `transports` / `channels`: comma lists, or `None` for the defaults.
    pub fn new(transports: Option<&str>, channels: Option<&str>) -> Pair {
        Self::with_options(transports, channels, None)
    }

    /// As [`Pair::new`], with context options (`key=value,...`).
    pub fn with_options(transports: Option<&str>, channels: Option<&str>, options: Option<&str>) -> Pair {
        let t = transports.map(cstring);
        let c = channels.map(cstring);
        let o = options.map(cstring);
        let mut ctx = null_mut();
        let mut listener = null_mut();
        // SAFETY: valid strings (or NULL) and out-places.
        unsafe {
            ok(
                sluice_context_new_with(
                    t.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                    c.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                    o.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
                    &mut ctx,
                ),
                "context",
            );
            ok(sluice_listen(ctx, std::ptr::null(), &mut listener), "listen");
        }
        // SAFETY: a live listener.
        let addr = unsafe { CStr::from_ptr(sluice_listener_address(listener)) }.to_owned();
        let l = listener as usize;
        let accepting = std::thread::spawn(move || {
            let mut server = null_mut();
            // SAFETY: the listener outlives this thread (joined below).
            let rc = unsafe { sluice_listener_accept(l as *const SluiceListener, &mut server) };
            (rc, last_error(), server as usize)
        });
        let mut client = null_mut();
        // SAFETY: live context, valid address string, out-place.
        ok(unsafe { sluice_connect(ctx, addr.as_ptr(), &mut client) }, "connect");
        let (rc, err, server) = accepting.join().unwrap();
        assert_eq!(rc, SLUICE_OK, "accept: {err}");
        Pair {
            ctx,
            listener,
            client,
            server: server as *mut SluicePipe,
        }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // SAFETY: handles made in `new`, freed once (the pipes may be NULL if a test took them).
        unsafe {
            sluice_pipe_free(self.client);
            sluice_pipe_free(self.server);
            sluice_listener_free(self.listener);
            sluice_context_free(self.ctx);
        }
    }
}

/// A release callback counting its calls in the `AtomicUsize` its argument points at.
pub unsafe extern "C" fn count_release(user: *mut c_void) {
    // SAFETY: tests pass a pointer to an `AtomicUsize` that outlives the message.
    unsafe { &*(user as *const AtomicUsize) }.fetch_add(1, Ordering::SeqCst);
}

/// Waits (under the watchdog) until `counter` reaches `n`.
pub fn eventually(counter: &AtomicUsize, n: usize) {
    while counter.load(Ordering::SeqCst) < n {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(counter.load(Ordering::SeqCst), n);
}

/// A CPU DLTensor over `data` with `shape` and optional `strides` (in elements).
pub fn dl_tensor<T>(data: &[T], dtype: DLDataType, shape: &mut [i64], strides: Option<&mut [i64]>) -> DLTensor {
    DLTensor {
        data: data.as_ptr() as *mut c_void,
        device: DLDevice {
            device_type: 1,
            device_id: 0,
        },
        ndim: shape.len() as i32,
        dtype,
        shape: shape.as_mut_ptr(),
        strides: strides.map_or(null_mut(), |s| s.as_mut_ptr()),
        byte_offset: 0,
    }
}

pub const F32: DLDataType = DLDataType {
    code: 2,
    bits: 32,
    lanes: 1,
};
pub const I16: DLDataType = DLDataType {
    code: 0,
    bits: 16,
    lanes: 1,
};
pub const U8: DLDataType = DLDataType {
    code: 1,
    bits: 8,
    lanes: 1,
};

/// A message with `metadata` and `payloads`.
pub fn message(metadata: &[u8], payloads: &[&[u8]]) -> *mut SluiceMessage {
    let mut m = null_mut();
    // SAFETY: out-place, then valid byte ranges.
    unsafe {
        ok(sluice_message_new(&mut m), "message_new");
        ok(
            sluice_message_set_metadata(m, metadata.as_ptr(), metadata.len()),
            "metadata",
        );
        for p in payloads {
            ok(sluice_message_add_payload(m, p.as_ptr(), p.len()), "payload");
        }
    }
    m
}

/// A received message's byte range as a slice (valid while the message lives).
pub fn slice<'a>(data: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the library hands out `len` readable bytes.
    unsafe { std::slice::from_raw_parts(data, len) }
}

pub fn metadata<'a>(r: *const SluiceReceived) -> &'a [u8] {
    let (mut d, mut l) = (std::ptr::null(), 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_metadata(r, &mut d, &mut l) },
        "received metadata",
    );
    slice(d, l)
}

pub fn payload<'a>(r: *const SluiceReceived, i: usize) -> &'a [u8] {
    let (mut d, mut l) = (std::ptr::null(), 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_payload(r, i, &mut d, &mut l) },
        "received payload",
    );
    slice(d, l)
}
