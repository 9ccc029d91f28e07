//! Messages through the C API, end to end in one process: metadata, payloads, a contiguous
//! and a strided tensor (bytes, shapes and strides checked), release callbacks, op handles
//! and their eventfds, completion callbacks, and issue order.
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::ffi::{c_int, c_void, CStr};
use std::os::fd::BorrowedFd;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use common::*;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use sluice_c::*;
use sluice_dlpack::{DType, Meta};

/// The f32 2x3 matrix sent contiguous.
fn floats() -> Vec<f32> {
    (0..6).map(|i| i as f32 * 1.5 - 2.0).collect()
}

/// The int16 4x6 matrix whose every other column is sent.
fn shorts() -> Vec<i16> {
    (0..24).map(|i| (i * 7 - 30) as i16).collect()
}

fn check_tensors(r: *const SluiceReceived, floats: &[f32], shorts: &[i16]) {
    // SAFETY: a live received message.
    assert_eq!(unsafe { sluice_received_tensor_count(r) }, 2);
    let mut t = std::mem::MaybeUninit::<DLTensor>::uninit();
    // SAFETY: live message, writable out.
    ok(unsafe { sluice_received_tensor(r, 0, t.as_mut_ptr()) }, "tensor 0");
    // SAFETY: filled by the successful call.
    let t = unsafe { t.assume_init() };
    assert_eq!(t.device.device_type, 1);
    assert_eq!(t.ndim, 2);
    assert_eq!(t.dtype, F32);
    assert_eq!(t.byte_offset, 0);
    // SAFETY: `ndim` entries, owned by the received message.
    let (shape, strides) = unsafe {
        (
            std::slice::from_raw_parts(t.shape, 2),
            std::slice::from_raw_parts(t.strides, 2),
        )
    };
    assert_eq!(shape, [2, 3]);
    assert_eq!(strides, [3, 1]);
    // SAFETY: 6 floats of received memory (aligned: fresh allocation or segment block).
    let got = unsafe { std::slice::from_raw_parts(t.data as *const f32, 6) };
    assert_eq!(got, floats);

    let mut t = std::mem::MaybeUninit::<DLTensor>::uninit();
    // SAFETY: as above.
    ok(unsafe { sluice_received_tensor(r, 1, t.as_mut_ptr()) }, "tensor 1");
    // SAFETY: filled.
    let t = unsafe { t.assume_init() };
    assert_eq!(t.ndim, 2);
    assert_eq!(t.dtype, I16);
    // SAFETY: `ndim` entries.
    let (shape, strides) = unsafe {
        (
            std::slice::from_raw_parts(t.shape, 2),
            std::slice::from_raw_parts(t.strides, 2),
        )
    };
    assert_eq!(shape, [4, 3]);
    assert_eq!(strides, [6, 2], "a strided view arrives with its strides");
    let (mut data, mut len) = (std::ptr::null(), 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_data(r, 1, &mut data, &mut len) },
        "tensor 1 data",
    );
    assert_eq!(len, (3 * 6 + 2 * 2 + 1) * 2, "the span, first element to last");
    assert_eq!(data as *const c_void, t.data as *const c_void);
    let span: Vec<i16> = slice(data, len)
        .chunks(2)
        .map(|b| i16::from_ne_bytes([b[0], b[1]]))
        .collect();
    for i in 0..4 {
        for j in 0..3 {
            assert_eq!(span[i * 6 + j * 2], shorts[i * 6 + j * 2], "element ({i}, {j})");
        }
    }
    // The description travels in the encoding the Python binding reads.
    let (mut md, mut ml) = (std::ptr::null(), 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_metadata(r, 1, &mut md, &mut ml) },
        "metadata",
    );
    let view = Meta {
        dtype: DType::I16,
        shape: vec![4, 3],
        strides: vec![6, 2],
    };
    assert_eq!(slice(md, ml), &view.encode()[..]);
}

/// Records a completion callback's status (and the last error inside it).
#[derive(Default)]
struct Completion {
    status: Mutex<Option<(c_int, String)>>,
    cond: Condvar,
}

impl Completion {
    fn wait(&self) -> (c_int, String) {
        let mut s = self.status.lock().unwrap();
        loop {
            if let Some(s) = s.take() {
                return s;
            }
            s = self.cond.wait(s).unwrap();
        }
    }
}

unsafe extern "C" fn on_done(status: c_int, user: *mut c_void) {
    // SAFETY: the tests pass a `Completion` that outlives the write.
    let c = unsafe { &*(user as *const Completion) };
    *c.status.lock().unwrap() = Some((status, last_error()));
    c.cond.notify_all();
}

/// `expect`: the transport and channel both ends must have negotiated.
fn round_trip(transports: Option<&str>, channels: Option<&str>, expect: (&str, &str)) {
    let pair = Pair::new(transports, channels);
    for (end, pipe) in [("client", pair.client), ("server", pair.server)] {
        // SAFETY: live pipes; static-lifetime strings while they live.
        let (t, c) = unsafe {
            (
                CStr::from_ptr(sluice_pipe_transport(pipe)).to_str().unwrap(),
                CStr::from_ptr(sluice_pipe_channel(pipe)).to_str().unwrap(),
            )
        };
        assert_eq!((t, c), expect, "the {end} end negotiated {t}/{c}");
    }
    let floats = floats();
    let shorts = shorts();
    let released = Arc::new(AtomicUsize::new(0));
    let user = Arc::as_ptr(&released) as *mut c_void;

    let m = message(b"hello from C", &[b"first payload", &[1, 2, 3, 4, 5]]);
    let mut shape_f = [2i64, 3];
    let t0 = dl_tensor(&floats, F32, &mut shape_f, None);
    let mut shape_s = [4i64, 3];
    let mut strides_s = [6i64, 2];
    let t1 = dl_tensor(&shorts, I16, &mut shape_s, Some(&mut strides_s));
    // SAFETY: live message; the tensors' memory outlives the write (checked by the count).
    unsafe {
        ok(sluice_message_add_tensor(m, &t0, Some(count_release), user), "add f32");
        ok(
            sluice_message_add_tensor(m, &t1, Some(count_release), user),
            "add i16 view",
        );
    }
    assert_eq!(released.load(Ordering::SeqCst), 0, "nothing released before the write");

    let mut op = null_mut();
    // SAFETY: live pipe; the message is consumed.
    ok(
        unsafe { sluice_pipe_write_start(pair.client, m, &mut op) },
        "write_start",
    );
    // SAFETY: a live op.
    let fd = unsafe { sluice_op_fd(op) };
    assert!(fd >= 0, "op fd: {}", last_error());

    let mut r = null_mut();
    // SAFETY: live pipe, out-place.
    ok(unsafe { sluice_pipe_read(pair.server, &mut r) }, "read");

    // The op's eventfd becomes readable once the write has finished.
    // SAFETY: the op owns the fd until freed, below.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let mut fds = [PollFd::new(borrowed, PollFlags::POLLIN)];
    assert_eq!(poll(&mut fds, PollTimeout::NONE).unwrap(), 1);
    assert!(fds[0].revents().unwrap().contains(PollFlags::POLLIN));
    // SAFETY: a live op.
    ok(unsafe { sluice_op_test(op) }, "op_test");
    // SAFETY: a live op.
    ok(unsafe { sluice_op_wait(op, -1) }, "op_wait");
    let mut none = null_mut();
    // SAFETY: a live op, out-place.
    assert_eq!(unsafe { sluice_op_take_received(op, &mut none) }, SLUICE_MISUSE);
    // SAFETY: freed once.
    unsafe { sluice_op_free(op) };
    eventually(&released, 2);

    assert_eq!(metadata(r), b"hello from C");
    // SAFETY: live message.
    assert_eq!(unsafe { sluice_received_payload_count(r) }, 2);
    assert_eq!(payload(r, 0), b"first payload");
    assert_eq!(payload(r, 1), [1, 2, 3, 4, 5]);
    let (mut d, mut l) = (std::ptr::null(), 0);
    // SAFETY: live message, out-places.
    let rc = unsafe { sluice_received_payload(r, 2, &mut d, &mut l) };
    assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "out of range");
    check_tensors(r, &floats, &shorts);

    // The reply: written with a completion callback, read through an op.
    let reply = message(b"reply", &[b"pong"]);
    let done = Completion::default();
    let mut read_op = null_mut();
    // SAFETY: live pipes; `done` outlives the write (waited for below).
    unsafe {
        ok(sluice_pipe_read_start(pair.client, &mut read_op), "read_start");
        ok(
            sluice_pipe_write(
                pair.server,
                reply,
                Some(on_done),
                &done as *const Completion as *mut c_void,
            ),
            "write",
        );
    }
    assert_eq!(done.wait(), (SLUICE_OK, String::new()));
    // SAFETY: a live op.
    ok(unsafe { sluice_op_wait(read_op, -1) }, "read op");
    let mut echoed = null_mut();
    // SAFETY: a live op, out-place.
    ok(unsafe { sluice_op_take_received(read_op, &mut echoed) }, "take");
    // SAFETY: as above.
    let rc = unsafe { sluice_op_take_received(read_op, &mut none) };
    assert_eq!(rc, SLUICE_MISUSE, "taken once");
    assert_eq!(metadata(echoed), b"reply");
    assert_eq!(payload(echoed, 0), b"pong");
    // SAFETY: each freed once.
    unsafe {
        sluice_op_free(read_op);
        sluice_received_free(echoed);
        sluice_received_free(r);
    }
    drop(pair);
    assert_eq!(released.load(Ordering::SeqCst), 2, "each release exactly once");
}

#[test]
fn round_trip_default_backends() {
    watchdog("round_trip_default_backends");
    round_trip(None, None, ("shm", "cma"));
}

#[test]
fn round_trip_tcp_basic() {
    watchdog("round_trip_tcp_basic");
    round_trip(Some("tcp"), Some("basic"), ("tcp", "basic"));
}

#[test]
fn round_trip_shm_cma() {
    watchdog("round_trip_shm_cma");
    // CMA alone, no fallback: a machine where it cannot run fails here rather than passing
    // over basic.
    round_trip(Some("shm"), Some("cma"), ("shm", "cma"));
}

#[test]
fn round_trip_tcp_multilane() {
    watchdog("round_trip_tcp_multilane");
    round_trip(Some("tcp"), Some("multilane"), ("tcp", "multilane"));
}

/// The pipe negotiated what was asked for.
#[test]
fn pipe_reports_what_was_negotiated() {
    watchdog("pipe_reports_what_was_negotiated");
    let pair = Pair::new(Some("tcp"), Some("basic"));
    // SAFETY: live pipes; static-lifetime strings while they live.
    unsafe {
        assert_eq!(CStr::from_ptr(sluice_pipe_transport(pair.client)).to_str(), Ok("tcp"));
        assert_eq!(CStr::from_ptr(sluice_pipe_channel(pair.server)).to_str(), Ok("basic"));
        assert!(!CStr::from_ptr(sluice_pipe_peer(pair.client)).to_bytes().is_empty());
    }
}

/// Writes and reads one thread starts leave and take messages in the order started, even
/// though each completes on a library thread.
#[test]
fn operations_keep_the_order_they_were_started_in() {
    watchdog("operations_keep_the_order_they_were_started_in");
    const N: usize = 64;
    let pair = Pair::new(None, None);
    let data: Vec<u8> = (0..=255).cycle().take(100_000).collect();
    let mut reads = Vec::new();
    for _ in 0..N / 2 {
        let mut op = null_mut();
        // SAFETY: live pipe, out-place.
        ok(unsafe { sluice_pipe_read_start(pair.server, &mut op) }, "read_start");
        reads.push(op);
    }
    let mut writes = Vec::new();
    for i in 0..N {
        let m = message(format!("message {i}").as_bytes(), &[]);
        let mut shape = [(i * 997 % data.len()) as i64];
        let t = dl_tensor(&data, U8, &mut shape, None);
        let mut op = null_mut();
        // SAFETY: live message and pipe; `data` outlives every write (waited for below).
        unsafe {
            ok(sluice_message_add_tensor(m, &t, None, null_mut()), "add");
            ok(sluice_pipe_write_start(pair.client, m, &mut op), "write_start");
        }
        writes.push(op);
    }
    for _ in N / 2..N {
        let mut op = null_mut();
        // SAFETY: live pipe, out-place.
        ok(unsafe { sluice_pipe_read_start(pair.server, &mut op) }, "read_start");
        reads.push(op);
    }
    for (i, op) in reads.into_iter().enumerate() {
        let mut r = null_mut();
        // SAFETY: live op, out-place; each op and message freed once.
        unsafe {
            ok(sluice_op_wait(op, -1), "read");
            ok(sluice_op_take_received(op, &mut r), "take");
            sluice_op_free(op);
        }
        assert_eq!(metadata(r), format!("message {i}").as_bytes(), "in order");
        let (mut d, mut l) = (std::ptr::null(), 0);
        // SAFETY: live message, out-places.
        ok(unsafe { sluice_received_tensor_data(r, 0, &mut d, &mut l) }, "data");
        assert_eq!(slice(d, l), &data[..i * 997 % data.len()]);
        // SAFETY: freed once.
        unsafe { sluice_received_free(r) };
    }
    for op in writes {
        // SAFETY: live op, freed once.
        unsafe {
            ok(sluice_op_wait(op, -1), "write");
            sluice_op_free(op);
        }
    }
}

/// A chain of reads by callback: each callback gets its message (owned), starts the next read,
/// and the chain ends with the error once the peer closes its pipe.
#[test]
fn reads_by_callback_chain_and_end_with_the_peers_close() {
    watchdog("reads_by_callback_chain_and_end_with_the_peers_close");
    struct Chain {
        pipe: *mut SluicePipe,
        got: Mutex<Vec<Result<Vec<u8>, c_int>>>,
        done: Condvar,
    }
    unsafe extern "C" fn on_read(status: c_int, r: *mut SluiceReceived, user: *mut c_void) {
        // SAFETY: `user` is the test's `Chain`, alive until the chain has ended.
        let chain = unsafe { &*(user as *const Chain) };
        if status != 0 {
            assert!(r.is_null(), "a failed read hands out no message");
            chain.got.lock().unwrap().push(Err(status));
            chain.done.notify_all();
            return;
        }
        chain.got.lock().unwrap().push(Ok(metadata(r).to_vec()));
        // SAFETY: the callback owns the message; freed once.
        unsafe { sluice_received_free(r) };
        // SAFETY: the pipe outlives the chain; the callback may start the next read.
        ok(
            unsafe { sluice_pipe_read_then(chain.pipe, Some(on_read), user) },
            "next read",
        );
    }
    let pair = Pair::new(None, None);
    let chain = Chain {
        pipe: pair.server,
        got: Mutex::new(Vec::new()),
        done: Condvar::new(),
    };
    let user = &chain as *const Chain as *mut c_void;
    // SAFETY: live pipe; `chain` outlives every callback (waited for below).
    ok(
        unsafe { sluice_pipe_read_then(pair.server, Some(on_read), user) },
        "read_then",
    );
    for i in 0..5 {
        // SAFETY: a fresh message, consumed by the write.
        ok(
            unsafe { sluice_pipe_write_sync(pair.client, message(format!("m{i}").as_bytes(), &[])) },
            "write",
        );
    }
    // SAFETY: live pipe: the peer's close ends the chain.
    ok(unsafe { sluice_pipe_close(pair.client) }, "close");
    let mut got = chain.got.lock().unwrap();
    while !matches!(got.last(), Some(Err(_))) {
        got = chain.done.wait(got).unwrap();
    }
    let messages: Vec<_> = got.iter().filter_map(|g| g.as_ref().ok().cloned()).collect();
    let expected: Vec<Vec<u8>> = (0..5).map(|i| format!("m{i}").into_bytes()).collect();
    assert_eq!(messages, expected, "every message, in order");
    assert_eq!(got.len(), 6, "then one error: {:?}", got.last());
    drop(got);
}

/// Sends one `len`-byte u8 tensor from client to server and returns the received message.
fn one_tensor(pair: &Pair, bytes: &[u8]) -> *mut SluiceReceived {
    let m = message(b"take", &[]);
    let mut shape = [bytes.len() as i64];
    let t = dl_tensor(bytes, U8, &mut shape, None);
    let (mut r, mut op) = (null_mut(), null_mut());
    // SAFETY: live message and pipes; `bytes` outlives the write, waited for before returning
    // (by cross-memory attach the write finishes only once the reader has read).
    unsafe {
        ok(sluice_message_add_tensor(m, &t, None, null_mut()), "add");
        ok(sluice_pipe_write_start(pair.client, m, &mut op), "write");
        ok(sluice_pipe_read(pair.server, &mut r), "read");
        ok(sluice_op_wait(op, -1), "write done");
        sluice_op_free(op);
    }
    r
}

/// Tensor bytes a channel copied into this process's memory are taken out without a copy,
/// writable and owned by their own handle; bytes the pipe lends (a shared segment) are not.
#[test]
fn received_private_bytes_are_taken_without_a_copy() {
    watchdog("received_private_bytes_are_taken_without_a_copy");
    let sent: Vec<u8> = (0..(256 << 10)).map(|i| (i * 31 % 251) as u8).collect();
    let pair = Pair::new(Some("tcp"), Some("basic"));
    let r = one_tensor(&pair, &sent);
    let (mut data, mut len) = (std::ptr::null(), 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_data(r, 0, &mut data, &mut len) },
        "data",
    );
    let (mut buffer, mut taken, mut taken_len) = (null_mut(), null_mut(), 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_take(r, 0, &mut buffer, &mut taken, &mut taken_len) },
        "take",
    );
    assert!(!buffer.is_null(), "basic over TCP fills memory of this process's own");
    assert_eq!(taken as *const u8, data, "the same bytes, not a copy");
    assert_eq!(taken_len, sent.len());
    // SAFETY: a live buffer of `taken_len` writable bytes.
    let owned = unsafe { std::slice::from_raw_parts_mut(taken, taken_len) };
    assert_eq!(owned, &sent[..]);
    owned[0] ^= 0xff;
    // Taken once: the message's data is now empty, and a second take gets nothing.
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_data(r, 0, &mut data, &mut len) },
        "data after",
    );
    assert_eq!(len, 0);
    let (mut again, mut p, mut n) = (null_mut(), null_mut(), 7);
    // SAFETY: as above.
    ok(
        unsafe { sluice_received_tensor_take(r, 0, &mut again, &mut p, &mut n) },
        "again",
    );
    assert!(again.is_null() && p.is_null() && n == 0);
    // SAFETY: as above; index out of range.
    let rc = unsafe { sluice_received_tensor_take(r, 1, &mut again, &mut p, &mut n) };
    assert_eq!(rc, SLUICE_INVALID_ARGUMENT);
    // The buffer outlives the message.
    // SAFETY: each freed once; the buffer after its message.
    unsafe { sluice_received_free(r) };
    assert_eq!(owned[1], sent[1]);
    // SAFETY: as above.
    unsafe { sluice_buffer_free(buffer) };
    drop(pair);

    // Over shared memory with cma, a tensor that fits the receiver's segment arrives there,
    // lent: it is not taken, and reads as it arrived.
    let pair = Pair::new(Some("shm"), Some("cma"));
    let r = one_tensor(&pair, &sent);
    let (mut buffer, mut taken, mut taken_len) = (null_mut(), null_mut(), 1);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_take(r, 0, &mut buffer, &mut taken, &mut taken_len) },
        "take lent",
    );
    assert!(buffer.is_null() && taken.is_null() && taken_len == 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_data(r, 0, &mut data, &mut len) },
        "lent data",
    );
    assert_eq!(slice(data, len), &sent[..]);
    // SAFETY: freed once.
    unsafe { sluice_received_free(r) };
}

/// Without a segment, cma tensors arrive by cross-memory attach into this process's memory:
/// taken without a copy. Bad options are refused with the reason.
#[test]
fn without_a_segment_cma_bytes_are_the_receivers_own() {
    watchdog("without_a_segment_cma_bytes_are_the_receivers_own");
    let sent: Vec<u8> = (0..(1 << 20)).map(|i| (i * 7 % 253) as u8).collect();
    let pair = Pair::with_options(Some("shm"), Some("cma"), Some("segment_bytes=0"));
    let r = one_tensor(&pair, &sent);
    let (mut buffer, mut taken, mut taken_len) = (null_mut(), null_mut(), 0);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_take(r, 0, &mut buffer, &mut taken, &mut taken_len) },
        "take",
    );
    assert!(!buffer.is_null(), "read by cma into memory of this process's own");
    assert_eq!(slice(taken, taken_len), &sent[..]);
    // SAFETY: each freed once.
    unsafe {
        sluice_received_free(r);
        sluice_buffer_free(buffer);
    }
    // The freed buffer is kept, and the next tensor of its length is received into it (no
    // fresh memory to fault in).
    let first = taken;
    let r = one_tensor(&pair, &sent);
    // SAFETY: live message, out-places.
    ok(
        unsafe { sluice_received_tensor_take(r, 0, &mut buffer, &mut taken, &mut taken_len) },
        "take again",
    );
    assert_eq!(taken, first, "the kept buffer was reused");
    assert_eq!(slice(taken, taken_len), &sent[..]);
    // SAFETY: each freed once.
    unsafe {
        sluice_received_free(r);
        sluice_buffer_free(buffer);
    }
    drop(pair);
    for (bad, says) in [
        ("segment_bytes", "not key=value"),
        ("segment_bytes=lots", "not a byte count"),
        ("window=3", "unknown option `window`"),
    ] {
        let opts = std::ffi::CString::new(bad).unwrap();
        let mut ctx = null_mut();
        // SAFETY: valid strings and out-place.
        let rc = unsafe { sluice_context_new_with(std::ptr::null(), std::ptr::null(), opts.as_ptr(), &mut ctx) };
        assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "{bad}");
        assert!(ctx.is_null());
        assert!(last_error().contains(says), "{bad}: {}", last_error());
    }
}

/// A write nobody listens to (NULL callback) still leaves, in order, whether it finishes at
/// once (a small message) or later (a tensor read by cross-memory attach after the call).
#[test]
fn writes_without_a_callback_still_leave_in_order() {
    watchdog("writes_without_a_callback_still_leave_in_order");
    let pair = Pair::with_options(Some("shm"), Some("cma"), Some("segment_bytes=0"));
    let big: Vec<u8> = (0..(2 << 20)).map(|i| (i % 249) as u8).collect();
    for i in 0..8u8 {
        let m = message(&[i], &[b"p"]);
        if i % 2 == 1 {
            let mut shape = [big.len() as i64];
            let t = dl_tensor(&big, U8, &mut shape, None);
            // SAFETY: live message; `big` outlives the writes (the pair is dropped first).
            ok(unsafe { sluice_message_add_tensor(m, &t, None, null_mut()) }, "add");
        }
        // SAFETY: live pipe; the message is consumed.
        ok(unsafe { sluice_pipe_write(pair.client, m, None, null_mut()) }, "write");
    }
    for i in 0..8u8 {
        let mut r = null_mut();
        // SAFETY: live pipe, out-place.
        ok(unsafe { sluice_pipe_read(pair.server, &mut r) }, "read");
        assert_eq!(metadata(r), [i], "in order");
        // SAFETY: a live message.
        let n = unsafe { sluice_received_tensor_count(r) };
        assert_eq!(n, (i % 2) as usize);
        if n == 1 {
            let (mut data, mut len) = (std::ptr::null(), 0);
            // SAFETY: live message, out-places.
            ok(
                unsafe { sluice_received_tensor_data(r, 0, &mut data, &mut len) },
                "data",
            );
            assert_eq!(slice(data, len), &big[..]);
        }
        // SAFETY: freed once.
        unsafe { sluice_received_free(r) };
    }
    drop(pair);
}
