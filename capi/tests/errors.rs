//! Errors through the C API: each a status code and a message, never a hang or a crash.
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use common::*;
use sluice_c::*;
use sluice_channel::{Context, ContextOptions, Message, Tensor, TransportKind};
use sluice_dlpack::{DType, Meta};

#[test]
fn connecting_to_a_closed_port_is_an_error_with_a_message() {
    watchdog("connecting_to_a_closed_port_is_an_error_with_a_message");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = cstring(&format!("127.0.0.1:{port}"));
    let mut ctx = null_mut();
    let mut pipe = std::ptr::NonNull::<SluicePipe>::dangling().as_ptr();
    // SAFETY: valid arguments; the context is freed once.
    let rc = unsafe {
        ok(sluice_context_new(null(), null(), &mut ctx), "context");
        let rc = sluice_connect(ctx, addr.as_ptr(), &mut pipe);
        sluice_context_free(ctx);
        rc
    };
    assert_eq!(rc, SLUICE_IO, "{}", status(rc));
    assert!(pipe.is_null(), "the out handle is NULL on error");
    let msg = last_error();
    assert!(msg.starts_with("sluice_connect: "), "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "names the peer: {msg}");
}

#[test]
fn null_arguments_are_invalid_arguments() {
    watchdog("null_arguments_are_invalid_arguments");
    let invalid = |rc: c_int, what: &str| {
        assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "{what}: {}", status(rc));
        assert!(last_error().contains("NULL"), "{what}: {}", last_error());
    };
    let mut ctx = null_mut();
    // SAFETY: every call is given NULL where a pointer is checked; nothing else is touched.
    unsafe {
        invalid(sluice_context_new(null(), null(), null_mut()), "context_new out");
        ok(sluice_context_new(null(), null(), &mut ctx), "context");
        let mut l = null_mut();
        invalid(sluice_listen(null(), null(), &mut l), "listen ctx");
        invalid(sluice_listen(ctx, null(), null_mut()), "listen out");
        let mut p = null_mut();
        invalid(sluice_connect(ctx, null(), &mut p), "connect addr");
        invalid(sluice_connect(null(), c"127.0.0.1:1".as_ptr(), &mut p), "connect ctx");
        invalid(sluice_listener_accept(null(), &mut p), "accept");
        assert!(sluice_listener_address(null()).is_null());
        invalid(sluice_message_new(null_mut()), "message_new");
        let m = message(b"", &[]);
        invalid(sluice_message_set_metadata(null_mut(), null(), 0), "metadata handle");
        invalid(sluice_message_set_metadata(m, null(), 3), "metadata bytes");
        invalid(sluice_message_add_payload(m, null(), 1), "payload bytes");
        ok(sluice_message_add_payload(m, null(), 0), "an empty payload may be NULL");
        invalid(sluice_message_add_tensor(m, null(), None, null_mut()), "tensor");
        let mut shape = [4i64];
        let mut t = dl_tensor::<u8>(&[], U8, &mut shape, None);
        t.data = null_mut();
        invalid(sluice_message_add_tensor(m, &t, None, null_mut()), "tensor data");
        t.shape = null_mut();
        invalid(sluice_message_add_tensor(m, &t, None, null_mut()), "tensor shape");
        invalid(
            sluice_pipe_write_sync(null_mut(), m),
            "write pipe (consumes the message)",
        );
        invalid(sluice_pipe_write_sync(null_mut(), null_mut()), "write message");
        invalid(sluice_pipe_write(null_mut(), null_mut(), None, null_mut()), "write");
        let mut op = null_mut();
        invalid(sluice_pipe_write_start(null_mut(), null_mut(), &mut op), "write_start");
        invalid(sluice_pipe_read_start(null_mut(), &mut op), "read_start");
        let mut r = null_mut();
        invalid(sluice_pipe_read(null_mut(), &mut r), "read");
        invalid(sluice_pipe_close(null_mut()), "close");
        invalid(sluice_op_test(null()), "op_test");
        invalid(sluice_op_wait(null(), 0), "op_wait");
        assert_eq!(sluice_op_fd(null()), -1);
        invalid(sluice_op_take_received(null(), &mut r), "take");
        let (mut d, mut n) = (null(), 0usize);
        invalid(sluice_received_metadata(null(), &mut d, &mut n), "received metadata");
        invalid(sluice_received_payload(null(), 0, &mut d, &mut n), "received payload");
        let mut dl = std::mem::zeroed::<DLTensor>();
        invalid(sluice_received_tensor(null(), 0, &mut dl), "received tensor");
        assert_eq!(sluice_received_payload_count(null()), 0);
        assert_eq!(sluice_received_tensor_count(null()), 0);
        assert!(sluice_pipe_peer(null()).is_null());
        // Freeing NULL does nothing.
        sluice_context_free(null_mut());
        sluice_listener_free(null_mut());
        sluice_pipe_free(null_mut());
        sluice_message_free(null_mut());
        sluice_received_free(null_mut());
        sluice_op_free(null_mut());
        sluice_context_free(ctx);
    }
}

#[test]
fn unknown_backend_names_are_invalid_arguments() {
    let mut ctx = null_mut();
    // SAFETY: valid strings and out-place.
    let rc = unsafe { sluice_context_new(c"tcp,pigeon".as_ptr(), null(), &mut ctx) };
    assert_eq!(rc, SLUICE_INVALID_ARGUMENT);
    assert!(ctx.is_null());
    assert!(last_error().contains("pigeon"), "{}", last_error());
    // SAFETY: as above.
    let rc = unsafe { sluice_context_new(null(), c"basic,telepathy".as_ptr(), &mut ctx) };
    assert_eq!(rc, SLUICE_INVALID_ARGUMENT);
    assert!(last_error().contains("telepathy"), "{}", last_error());
}

#[test]
fn a_cuda_tensor_is_unsupported_and_not_taken() {
    let released = AtomicUsize::new(0);
    let data = [0f32; 4];
    let mut shape = [4i64];
    let mut t = dl_tensor(&data, F32, &mut shape, None);
    t.device.device_type = 2; // kDLCUDA
    let m = message(b"", &[]);
    // SAFETY: live message and readable tensor; `released` outlives the call.
    let rc = unsafe {
        sluice_message_add_tensor(
            m,
            &t,
            Some(count_release),
            &released as *const AtomicUsize as *mut c_void,
        )
    };
    assert_eq!(rc, SLUICE_UNSUPPORTED, "{}", status(rc));
    assert!(last_error().contains("kDLCUDA"), "{}", last_error());
    // An unsupported dtype (4 lanes) likewise.
    t.device.device_type = 1;
    t.dtype.lanes = 4;
    // SAFETY: as above.
    let rc = unsafe { sluice_message_add_tensor(m, &t, None, null_mut()) };
    assert_eq!(rc, SLUICE_UNSUPPORTED, "{}", last_error());
    // SAFETY: freed once.
    unsafe { sluice_message_free(m) };
    assert_eq!(released.load(Ordering::SeqCst), 0, "a refused tensor is not released");
}

#[test]
fn an_unsent_message_releases_its_tensors_when_freed() {
    let released = AtomicUsize::new(0);
    let data = [7u8; 16];
    let mut shape = [16i64];
    let t = dl_tensor(&data, U8, &mut shape, None);
    let m = message(b"", &[]);
    // SAFETY: `data` and `released` outlive the message, freed here.
    unsafe {
        ok(
            sluice_message_add_tensor(
                m,
                &t,
                Some(count_release),
                &released as *const AtomicUsize as *mut c_void,
            ),
            "add",
        );
        assert_eq!(released.load(Ordering::SeqCst), 0);
        sluice_message_free(m);
    }
    assert_eq!(released.load(Ordering::SeqCst), 1);
}

#[test]
fn writing_on_a_closed_pipe_is_closed_and_releases_the_message() {
    watchdog("writing_on_a_closed_pipe_is_closed_and_releases_the_message");
    let pair = Pair::new(None, None);
    let released = Arc::new(AtomicUsize::new(0));
    let user = Arc::as_ptr(&released) as *mut c_void;
    let data = vec![1u8; 1 << 16];
    let mut shape = [data.len() as i64];
    let t = dl_tensor(&data, U8, &mut shape, None);
    // SAFETY: live pipe.
    ok(unsafe { sluice_pipe_close(pair.client) }, "close");
    let m = message(b"late", &[b"x"]);
    // SAFETY: live message and pipe; the message is consumed.
    let rc = unsafe {
        ok(sluice_message_add_tensor(m, &t, Some(count_release), user), "add");
        sluice_pipe_write_sync(pair.client, m)
    };
    assert_eq!(rc, SLUICE_CLOSED, "{}: {}", status(rc), last_error());
    assert!(last_error().contains("closed"), "{}", last_error());
    assert_eq!(released.load(Ordering::SeqCst), 1);

    let m = message(b"later", &[]);
    let mut op = null_mut();
    // SAFETY: as above; the op is freed once.
    unsafe {
        ok(sluice_message_add_tensor(m, &t, Some(count_release), user), "add");
        ok(sluice_pipe_write_start(pair.client, m, &mut op), "write_start");
        assert_eq!(sluice_op_wait(op, -1), SLUICE_CLOSED);
        assert_eq!(sluice_op_test(op), SLUICE_CLOSED, "the same answer again");
        assert!(
            last_error().starts_with("sluice_op_test: sluice_pipe_write: "),
            "{}",
            last_error()
        );
        sluice_op_free(op);
    }
    eventually(&released, 2);

    // The peer sees the pipe end.
    let mut r = null_mut();
    // SAFETY: live pipe, out-place.
    let rc = unsafe { sluice_pipe_read(pair.server, &mut r) };
    assert!(
        rc == SLUICE_PEER_LOST || rc == SLUICE_CLOSED,
        "{}: {}",
        status(rc),
        last_error()
    );
    assert!(r.is_null());
    // And reading on the closed side fails at once.
    // SAFETY: as above.
    assert_eq!(unsafe { sluice_pipe_read(pair.client, &mut r) }, SLUICE_CLOSED);
}

#[test]
fn freeing_a_pipe_fails_its_pending_read() {
    watchdog("freeing_a_pipe_fails_its_pending_read");
    let mut pair = Pair::new(Some("tcp"), Some("basic"));
    let mut op = null_mut();
    // SAFETY: live pipe; then the pipe is freed once (and forgotten by the pair).
    unsafe {
        ok(sluice_pipe_read_start(pair.server, &mut op), "read_start");
        assert_eq!(sluice_op_test(op), SLUICE_PENDING);
        assert_eq!(sluice_op_wait(op, 10), SLUICE_PENDING, "the timeout passes first");
        sluice_pipe_free(pair.server);
        pair.server = null_mut();
        assert_eq!(sluice_op_wait(op, -1), SLUICE_CLOSED, "{}", last_error());
        sluice_op_free(op);
    }
}

/// What the callback below saw.
struct Nested {
    pipe: usize,
    result: Mutex<Option<(c_int, c_int, String)>>,
}

unsafe extern "C" fn write_sync_inside(status: c_int, user: *mut c_void) {
    // SAFETY: the test passes a `Nested` that outlives the write.
    let n = unsafe { &*(user as *const Nested) };
    let m = message(b"nested", &[]);
    // SAFETY: a live pipe; the message is consumed.
    let rc = unsafe { sluice_pipe_write_sync(n.pipe as *mut SluicePipe, m) };
    *n.result.lock().unwrap() = Some((status, rc, last_error()));
}

#[test]
fn a_blocking_call_inside_a_callback_is_misuse() {
    watchdog("a_blocking_call_inside_a_callback_is_misuse");
    let pair = Pair::new(Some("tcp"), Some("basic"));
    let nested = Nested {
        pipe: pair.client as usize,
        result: Mutex::new(None),
    };
    let m = message(b"first", &[]);
    // SAFETY: live pipe; `nested` outlives the callback (waited for below).
    ok(
        unsafe {
            sluice_pipe_write(
                pair.client,
                m,
                Some(write_sync_inside),
                &nested as *const Nested as *mut c_void,
            )
        },
        "write",
    );
    let (status, rc, msg) = loop {
        if let Some(r) = nested.result.lock().unwrap().take() {
            break r;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    assert_eq!(status, SLUICE_OK);
    assert_eq!(rc, SLUICE_MISUSE, "{msg}");
    assert!(msg.contains("callback"), "{msg}");
}

/// A Rust peer sends tensors whose descriptions are bad: the C side receives the message, and
/// asking for such a tensor as a DLTensor is `SLUICE_PEER` with the reason. A description
/// followed by a binding's tag (as Python writes them) is read.
#[test]
fn a_bad_tensor_description_from_the_peer_is_a_peer_error() {
    watchdog("a_bad_tensor_description_from_the_peer_is_a_peer_error");
    let mut ctx = null_mut();
    let mut listener = null_mut();
    // SAFETY: valid arguments and out-places.
    unsafe {
        ok(
            sluice_context_new(c"tcp".as_ptr(), c"basic".as_ptr(), &mut ctx),
            "context",
        );
        ok(sluice_listen(ctx, null(), &mut listener), "listen");
    }
    // SAFETY: a live listener.
    let addr = unsafe { std::ffi::CStr::from_ptr(sluice_listener_address(listener)) }
        .to_str()
        .unwrap()
        .to_owned();
    let peer = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let rust = Context::new(ContextOptions {
                transports: vec![TransportKind::Tcp],
                channels: vec![sluice_channel::ChannelKind::Basic],
                ..ContextOptions::default()
            })
            .unwrap();
            let pipe = rust.connect(&addr).await.unwrap();
            let claims_more = Meta::contiguous(DType::F32, &[8]).encode();
            let fine = Meta::contiguous(DType::U8, &[3]).encode();
            let tensor = |data: &'static [u8], metadata: Vec<u8>| Tensor {
                metadata: Bytes::from(metadata),
                ..Tensor::cpu(Bytes::from_static(data))
            };
            let message = Message {
                metadata: Bytes::from_static(b"from rust"),
                payloads: vec![],
                tensors: vec![
                    tensor(b"junk", b"not a description".to_vec()),
                    tensor(&[0; 16], claims_more),
                    tensor(&[1, 2, 3], fine),
                    // As the Python binding writes them: the description, then its tag.
                    tensor(&[9, 8], Meta::contiguous(DType::I8, &[2]).encode_tagged(b"numpy")),
                ],
            };
            pipe.write(&message).await.unwrap();
            // Keep the pipe open until the C side has read.
            let _ = pipe.read_descriptor().await;
        });
    });
    let mut pipe = null_mut();
    let mut r = null_mut();
    // SAFETY: live listener and pipe, out-places.
    unsafe {
        ok(sluice_listener_accept(listener, &mut pipe), "accept");
        ok(sluice_pipe_read(pipe, &mut r), "read");
    }
    assert_eq!(metadata(r), b"from rust");
    let mut t = std::mem::MaybeUninit::<DLTensor>::uninit();
    // SAFETY: live message, writable out.
    let rc = unsafe { sluice_received_tensor(r, 0, t.as_mut_ptr()) };
    assert_eq!(rc, SLUICE_PEER, "{}", last_error());
    assert!(last_error().contains("tensor 0"), "{}", last_error());
    // SAFETY: the out is zeroed on error.
    assert!(unsafe { t.assume_init() }.data.is_null());
    // SAFETY: as above.
    let rc = unsafe { sluice_received_tensor(r, 1, t.as_mut_ptr()) };
    assert_eq!(rc, SLUICE_PEER);
    assert!(
        last_error().contains("spans 32 bytes but its buffer holds 16"),
        "{}",
        last_error()
    );
    // SAFETY: as above.
    ok(unsafe { sluice_received_tensor(r, 2, t.as_mut_ptr()) }, "a good one");
    // SAFETY: filled.
    let t = unsafe { t.assume_init() };
    // SAFETY: 3 bytes of received memory.
    assert_eq!(unsafe { std::slice::from_raw_parts(t.data as *const u8, 3) }, [1, 2, 3]);
    // The raw bytes of a refused tensor are still there.
    let (mut d, mut n) = (null(), 0);
    // SAFETY: live message, out-places.
    ok(unsafe { sluice_received_tensor_data(r, 0, &mut d, &mut n) }, "raw data");
    assert_eq!(slice(d, n), b"junk");
    let mut tagged = t;
    // SAFETY: live message, writable out.
    ok(unsafe { sluice_received_tensor(r, 3, &mut tagged) }, "a tagged one");
    assert_eq!((tagged.ndim, tagged.dtype.code, tagged.dtype.bits), (1, 0, 8));
    // SAFETY: 2 bytes of received memory.
    let bytes = unsafe { std::slice::from_raw_parts(tagged.data as *const u8, 2) };
    assert_eq!(bytes, [9, 8]);
    // SAFETY: live message, writable out; the index is out of range.
    let rc = unsafe { sluice_received_tensor(r, 4, &mut tagged) };
    assert_eq!(rc, SLUICE_INVALID_ARGUMENT);
    // SAFETY: each freed once; freeing the pipe ends the peer's read.
    unsafe {
        sluice_received_free(r);
        sluice_pipe_free(pipe);
        sluice_listener_free(listener);
        sluice_context_free(ctx);
    }
    peer.join().unwrap();
}
