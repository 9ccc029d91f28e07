//! GPU tensors through the C API: `sluice_message_add_cuda_tensor` on the sending side,
//! `sluice_pipe_read_then_with` and the caller's device allocator on the receiving side.
//!
//! Without a CUDA driver (CI's plain pass, the development machines) only the refusal runs: a
//! GPU tensor is `SLUICE_UNSUPPORTED` and its memory is not taken. With a GPU, or the CUDA
//! driver model (`scripts/cuda-model-check.sh`, which CI runs), the rest runs: device memory
//! filled by work still queued when the write starts arrives whole, on the device the sender
//! named, in memory the receiver's allocator gave, on its stream; every handle goes back once;
//! a reader without an allocator, or whose allocator refuses, fails with the reason and the
//! pipe closed; host memory passed as device memory is refused without taking it.
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;

use common::*;
use sluice_c::*;
use sluice_channel::cuda::gate::{gpu_or_skip, without_driver_or_skip};
use sluice_channel::{CudaBuffer, Stream};

const LEN: usize = 3 * 4096 + 5;

/// A GPU DLTensor of `len` bytes (u8, one dimension) at device address `ptr`.
fn gpu_tensor(ptr: u64, device: i32, shape: &mut [i64; 1]) -> DLTensor {
    DLTensor {
        data: ptr as usize as *mut c_void,
        device: DLDevice {
            device_type: 2,
            device_id: device,
        },
        ndim: 1,
        dtype: U8,
        shape: shape.as_mut_ptr(),
        strides: null_mut(),
        byte_offset: 0,
    }
}

/// One grant: (device, len, handle, device address, stream).
type Grant = (i32, usize, usize, u64, usize);

/// The receiver's allocator: device memory from Sluice's own allocator on a stream of its
/// own, each handle a boxed buffer; counts what it gave and what came back.
#[derive(Default)]
struct Allocator {
    /// Refuse every request (with status 42).
    refuse: bool,
    given: AtomicUsize,
    released: AtomicUsize,
    grants: Mutex<Vec<Grant>>,
}

unsafe extern "C" fn alloc(
    user: *mut c_void,
    device: c_int,
    len: usize,
    data: *mut *mut c_void,
    stream: *mut usize,
    handle: *mut *mut c_void,
) -> c_int {
    // SAFETY: the tests pass an `Allocator` that outlives every read and free.
    let a = unsafe { &*(user as *const Allocator) };
    if a.refuse {
        return 42;
    }
    let s = Stream::new(device as u32).expect("a stream for the receiver");
    let b = Box::new(CudaBuffer::alloc(len, &s).expect("device memory for the receiver"));
    let (ptr, raw) = (b.ptr(), s.raw());
    let h = Box::into_raw(b);
    a.given.fetch_add(1, Ordering::SeqCst);
    a.grants.lock().unwrap().push((device, len, h as usize, ptr, raw));
    // SAFETY: the library passes writable out-places.
    unsafe {
        *data = ptr as usize as *mut c_void;
        *stream = raw;
        *handle = h as *mut c_void;
    }
    0
}

unsafe extern "C" fn release(user: *mut c_void, handle: *mut c_void) {
    // SAFETY: as in `alloc`.
    let a = unsafe { &*(user as *const Allocator) };
    // SAFETY: a handle `alloc` made with `Box::into_raw`, given back once.
    drop(unsafe { Box::from_raw(handle as *mut CudaBuffer) });
    a.released.fetch_add(1, Ordering::SeqCst);
}

/// A write's completion callback: counts successful writes in the `AtomicUsize` at `user`.
unsafe extern "C" fn count_done(status: c_int, user: *mut c_void) {
    assert_eq!(status, SLUICE_OK, "the write: {}", last_error());
    // SAFETY: the test passes a counter that outlives the write.
    unsafe { &*(user as *const AtomicUsize) }.fetch_add(1, Ordering::SeqCst);
}

/// A write's completion callback for writes that must fail: counts them.
unsafe extern "C" fn count_failed(status: c_int, user: *mut c_void) {
    assert_ne!(status, SLUICE_OK, "the write should have failed");
    // SAFETY: the test passes a counter that outlives the write.
    unsafe { &*(user as *const AtomicUsize) }.fetch_add(1, Ordering::SeqCst);
}

/// The outcome of one read: its status and the message's address.
type Outcome = (c_int, usize, String);

unsafe extern "C" fn read_done(status: c_int, received: *mut SluiceReceived, user: *mut c_void) {
    // SAFETY: `read` passes a boxed sender of its own, given to this callback (called once):
    // the waiting thread may return, and drop its receiver, while `send` is still running.
    let tx = unsafe { Box::from_raw(user as *mut mpsc::Sender<Outcome>) };
    let _ = tx.send((status, received as usize, last_error()));
}

/// Starts a read with `allocator` (or none: `sluice_pipe_read_then`) and waits for it.
fn read(pipe: *mut SluicePipe, allocator: Option<&Allocator>) -> Outcome {
    let (tx, rx) = mpsc::channel::<Outcome>();
    let user = Box::into_raw(Box::new(tx)) as *mut c_void;
    // SAFETY: live pipe; the callback owns the boxed sender; the allocator outlives the read
    // (we wait for it below).
    let rc = unsafe {
        match allocator {
            Some(a) => sluice_pipe_read_then_with(
                pipe,
                Some(alloc),
                Some(release),
                a as *const _ as *mut c_void,
                Some(read_done),
                user,
            ),
            None => sluice_pipe_read_then(pipe, Some(read_done), user),
        }
    };
    if rc != SLUICE_OK {
        // SAFETY: the callback will not run: the sender is still ours.
        drop(unsafe { Box::from_raw(user as *mut mpsc::Sender<Outcome>) });
    }
    ok(rc, "start the read");
    rx.recv().expect("the read's callback")
}

/// Sender-side device memory of `len` bytes on `device`: stale bytes, then a fill with `byte`
/// queued on its stream and *not* waited for.
fn source(device: u32, len: usize, byte: u8) -> CudaBuffer {
    let s = Stream::new(device).unwrap();
    let b = CudaBuffer::alloc(len, &s).unwrap();
    b.write_from_host(&vec![0xee; len]).unwrap();
    b.fill(byte).unwrap();
    b
}

/// Appends `b` to `m` for `target`, counting its release in `released`.
fn add(m: *mut SluiceMessage, b: &CudaBuffer, target: i32, released: &AtomicUsize) -> c_int {
    let mut shape = [b.len() as i64];
    let t = gpu_tensor(b.ptr(), b.device() as i32, &mut shape);
    // SAFETY: live message, a DLTensor over device memory that outlives the write (the test
    // keeps `b` until the release was counted), a counter that outlives the message.
    unsafe {
        sluice_message_add_cuda_tensor(
            m,
            &t,
            b.stream().raw(),
            target,
            Some(count_release),
            released as *const _ as *mut c_void,
        )
    }
}

#[test]
fn without_a_driver_a_gpu_tensor_is_refused_and_not_taken() {
    if !without_driver_or_skip("without_a_driver_a_gpu_tensor_is_refused_and_not_taken") {
        return;
    }
    watchdog("capi cuda refusal");
    let released = AtomicUsize::new(0);
    let m = message(b"gpu", &[]);
    let mut shape = [16];
    let t = gpu_tensor(0x7000_0000, 0, &mut shape);
    // SAFETY: live message and DLTensor; the counter outlives the message.
    let rc = unsafe {
        sluice_message_add_cuda_tensor(m, &t, 0, 0, Some(count_release), &released as *const _ as *mut c_void)
    };
    assert_eq!(rc, SLUICE_UNSUPPORTED, "{}", last_error());
    assert!(last_error().contains("CUDA"), "{}", last_error());
    // SAFETY: the message is ours.
    unsafe { sluice_message_free(m) };
    assert_eq!(
        released.load(Ordering::SeqCst),
        0,
        "a refused tensor's release never runs"
    );
}

#[test]
fn gpu_tensors_arrive_in_the_receivers_memory_on_its_stream() {
    if !gpu_or_skip("gpu_tensors_arrive_in_the_receivers_memory_on_its_stream") {
        return;
    }
    watchdog("capi cuda round trip");
    let gpus = sluice_channel::cuda::runtime().unwrap().gpus.len() as u32;
    let last = gpus - 1;
    let pair = Pair::new(None, None);
    let allocator = Allocator::default();
    let released = AtomicUsize::new(0);

    // Three tensors: GPU 0 to the receiver's last GPU, the last GPU to GPU 0, GPU 0 to the
    // receiver's CPU; and a CPU one beside them.
    let (a, b, c) = (source(0, LEN, 0x11), source(last, 4096, 0x22), source(0, 777, 0x33));
    let cpu = vec![0x44u8; 100];
    let m = message(b"gpu", &[b"payload"]);
    ok(add(m, &a, last as i32, &released), "tensor a");
    ok(add(m, &b, 0, &released), "tensor b");
    ok(add(m, &c, -1, &released), "tensor c");
    let mut shape = [cpu.len() as i64];
    let t = dl_tensor(&cpu, U8, &mut shape, None);
    // SAFETY: live message; `cpu` outlives the write.
    ok(
        unsafe { sluice_message_add_tensor(m, &t, None, null_mut()) },
        "cpu tensor",
    );
    // The write finishes once the receiver has copied the data: start it, read, then wait.
    let written = AtomicUsize::new(0);
    // SAFETY: live pipe; the message is consumed; the counter outlives the write.
    ok(
        unsafe { sluice_pipe_write(pair.client, m, Some(count_done), &written as *const _ as *mut c_void) },
        "write",
    );
    let (rc, r, err) = read(pair.server, Some(&allocator));
    eventually(&written, 1);
    eventually(&released, 3);
    assert_eq!(rc, SLUICE_OK, "read: {err}");
    let r = r as *mut SluiceReceived;
    assert_eq!(
        allocator.given.load(Ordering::SeqCst),
        2,
        "one grant per tensor bound for a GPU"
    );
    let grants = allocator.grants.lock().unwrap().clone();
    assert_eq!(
        grants.iter().map(|g| (g.0, g.1)).collect::<Vec<_>>(),
        vec![(last as i32, LEN), (0, 4096)],
        "asked in order, for the devices the sender named"
    );
    for (i, (device, len, handle, ptr, stream), byte) in [(0, grants[0], 0x11u8), (1, grants[1], 0x22)] {
        let mut t = std::mem::MaybeUninit::<DLTensor>::uninit();
        // SAFETY: live message, writable out.
        ok(unsafe { sluice_received_tensor(r, i, t.as_mut_ptr()) }, "gpu tensor");
        // SAFETY: filled by the successful call.
        let t = unsafe { t.assume_init() };
        assert_eq!((t.device.device_type, t.device.device_id), (2, device));
        assert_eq!(t.data as usize as u64, ptr, "the allocator's memory");
        // SAFETY: one entry, owned by the message.
        assert_eq!(unsafe { *t.shape }, len as i64);
        let (mut s, mut h) = (0usize, null_mut());
        // SAFETY: live message, writable outs.
        ok(unsafe { sluice_received_tensor_device(r, i, &mut s, &mut h) }, "device");
        assert_eq!((s, h as usize), (stream, handle));
        let (mut d, mut l) = (std::ptr::null(), 0);
        // SAFETY: live message, writable outs.
        let rc = unsafe { sluice_received_tensor_data(r, i, &mut d, &mut l) };
        assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "GPU memory has no host bytes");
        // SAFETY: the handle is the boxed buffer `alloc` made; its stream is the one the copy
        // was queued on, so reading on it sees the data.
        let got = unsafe { &*(handle as *const CudaBuffer) }.read_to_host().unwrap();
        assert!(
            got.iter().all(|&x| x == byte),
            "tensor {i}: the fill, not the stale bytes"
        );
    }
    // The tensor sent to the receiver's CPU, and the CPU one, arrive as host bytes.
    for (i, byte, len) in [(2, 0x33u8, 777), (3, 0x44, 100)] {
        let (mut d, mut l) = (std::ptr::null(), 0);
        // SAFETY: live message, writable outs.
        ok(unsafe { sluice_received_tensor_data(r, i, &mut d, &mut l) }, "cpu data");
        assert_eq!(slice(d, l), &vec![byte; len][..], "tensor {i}");
        let (mut s, mut h) = (1usize, std::ptr::dangling_mut::<c_void>());
        // SAFETY: live message, writable outs.
        ok(unsafe { sluice_received_tensor_device(r, i, &mut s, &mut h) }, "device");
        assert_eq!((s, h), (0, null_mut()), "no stream nor handle for CPU memory");
    }
    assert_eq!(
        allocator.released.load(Ordering::SeqCst),
        0,
        "held while the message lives"
    );
    // SAFETY: the message is ours.
    unsafe { sluice_received_free(r) };
    assert_eq!(allocator.released.load(Ordering::SeqCst), 2, "each handle back once");
    drop((a, b, c));
}

#[test]
fn a_reader_with_no_allocator_or_a_refusing_one_fails_with_the_reason() {
    if !gpu_or_skip("a_reader_with_no_allocator_or_a_refusing_one_fails_with_the_reason") {
        return;
    }
    watchdog("capi cuda refusals");
    for with_refusing_allocator in [false, true] {
        let mut pair = Pair::new(None, None);
        let released = AtomicUsize::new(0);
        let a = source(0, 4096, 0x55);
        let m = message(b"gpu", &[]);
        ok(add(m, &a, 0, &released), "tensor");
        // The reader closes the pipe instead of taking the data: the write fails.
        let failed = AtomicUsize::new(0);
        // SAFETY: live pipe; the message is consumed; the counter outlives the write.
        ok(
            unsafe { sluice_pipe_write(pair.client, m, Some(count_failed), &failed as *const _ as *mut c_void) },
            "write",
        );
        let refusing = Allocator {
            refuse: true,
            ..Default::default()
        };
        let (rc, r, err) = read(pair.server, with_refusing_allocator.then_some(&refusing));
        assert_eq!(rc, SLUICE_UNSUPPORTED, "{err}");
        assert!(r == 0);
        let expect = if with_refusing_allocator {
            "refused it with status 42"
        } else {
            "device allocator"
        };
        assert!(
            err.contains(expect) && err.contains("cuda:0") && err.contains("pipe closed"),
            "{err}"
        );
        assert_eq!(
            refusing.released.load(Ordering::SeqCst),
            0,
            "nothing given, nothing back"
        );
        // The pipe is closed: the next read fails at once.
        let (rc, _, err) = read(pair.server, None);
        assert_ne!(rc, SLUICE_OK, "{err}");
        eventually(&failed, 1);
        // The sender's memory goes back once its pipe lets go of it (a peer that may still
        // be reading it keeps it until then).
        // SAFETY: the pipe is ours; the pair's drop frees NULL.
        unsafe { sluice_pipe_free(std::mem::replace(&mut pair.client, null_mut())) };
        eventually(&released, 1);
    }
}

#[test]
fn host_memory_passed_as_device_memory_is_refused_and_not_taken() {
    if !gpu_or_skip("host_memory_passed_as_device_memory_is_refused_and_not_taken") {
        return;
    }
    watchdog("capi cuda host memory");
    let host = [0u8; 64];
    let released = AtomicUsize::new(0);
    let m = message(b"gpu", &[]);
    let mut shape = [64];
    let t = gpu_tensor(host.as_ptr() as u64, 0, &mut shape);
    // SAFETY: live message and DLTensor; the counter outlives the message.
    let rc = unsafe {
        sluice_message_add_cuda_tensor(m, &t, 0, 0, Some(count_release), &released as *const _ as *mut c_void)
    };
    assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "{}", last_error());
    assert!(
        last_error().contains("CUDA") && last_error().contains("on cuda:0"),
        "{}",
        last_error()
    );
    let mut shape = [64];
    let t = gpu_tensor(0x1000, 0, &mut shape);
    // SAFETY: as above.
    let rc = unsafe { sluice_message_add_cuda_tensor(m, &t, 0, -7, None, null_mut()) };
    assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "{}", last_error());
    assert!(last_error().contains("target_device -7"), "{}", last_error());
    // SAFETY: the message is ours.
    unsafe { sluice_message_free(m) };
    assert_eq!(released.load(Ordering::SeqCst), 0);
}
