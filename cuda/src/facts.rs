//! Driver facts Sluice relies on, checked wherever a driver is: on a GPU by
//! `scripts/gpu-check.sh` (which checks the CUDA driver model at the same time, since the model
//! claims each of these), and on the model by `scripts/cuda-model-check.sh`. A fact that fails
//! on hardware is a wrong rule in the model as well as a wrong assumption in Sluice.
//!
//! Each test names the sentence of the driver documentation it rests on, or says that it is
//! our own reading (unverified until a GPU ran it).
#![allow(unsafe_code)]

use crate::driver::{self, EventKind};
use crate::{gate, runtime};

/// A never-recorded event is complete ("Before the first call to cuEventRecord(), an event
/// represents an empty set of work, so for example cuEventQuery() would return
/// CUDA_SUCCESS").
#[test]
fn a_never_recorded_event_is_complete() {
    if !gate::gpu_or_skip("a_never_recorded_event_is_complete") {
        return;
    }
    let b = runtime().unwrap().bind(0).unwrap();
    let e = driver::event_create(&b, EventKind::Local).unwrap();
    // SAFETY: an event of this context, destroyed once below.
    unsafe {
        assert!(
            driver::event_query(&b, e).unwrap(),
            "a never-recorded event is complete"
        );
        driver::event_destroy(&b, e).unwrap();
    }
}

/// Copies to pageable host memory return complete ("For transfers from device memory to
/// pageable host memory, the function will return only once the copy has completed"), and a
/// stream runs its work in order (host to device, device to device, device to host, no
/// synchronisation between).
#[test]
fn stream_order_and_pageable_copies_complete_on_return() {
    if !gate::gpu_or_skip("stream_order_and_pageable_copies_complete_on_return") {
        return;
    }
    let b = runtime().unwrap().bind(0).unwrap();
    let n = 3 << 20;
    let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4096) as u8).collect();
    let mut back = vec![0u8; n];
    let s = driver::stream_create(&b).unwrap();
    let (x, y) = (driver::mem_alloc(&b, n).unwrap(), driver::mem_alloc(&b, n).unwrap());
    // SAFETY: live allocations of `n` bytes, host buffers of `n` bytes that outlive the calls
    // (the last copy returns complete, which is the fact under test; the stream is
    // synchronised before anything is freed).
    unsafe {
        driver::copy_htod_async(&b, x, data.as_ptr(), n, s).unwrap();
        driver::copy_dtod_async(&b, y, x, n, s).unwrap();
        driver::memset_async(&b, y, 0xAB, 16, s).unwrap();
        driver::copy_dtoh_async(&b, back.as_mut_ptr(), y, n, s).unwrap();
        assert!(
            back[..16].iter().all(|&v| v == 0xAB),
            "in stream order, complete on return"
        );
        assert!(back[16..] == data[16..]);
        driver::stream_synchronize(&b, s).unwrap();
        driver::mem_free(&b, x).unwrap();
        driver::mem_free(&b, y).unwrap();
        driver::stream_destroy(&b, s).unwrap();
    }
}

/// An interior pointer reports its whole allocation (cuMemGetAddressRange: "Returns the base
/// address ... and size ... of the allocation ... that contains the input pointer").
#[test]
fn an_interior_pointer_names_its_allocation() {
    if !gate::gpu_or_skip("an_interior_pointer_names_its_allocation") {
        return;
    }
    let b = runtime().unwrap().bind(0).unwrap();
    let p = driver::mem_alloc(&b, 1 << 20).unwrap();
    let info = driver::pointer_info(&b, p + 1000).unwrap();
    assert_eq!((info.base, info.device), (p, 0));
    assert!(info.is_device_memory);
    assert!(info.size >= 1 << 20, "the whole allocation ({} bytes)", info.size);
    // SAFETY: freed once, nothing queued on it.
    unsafe { driver::mem_free(&b, p).unwrap() };
}

/// "cuIpcOpenMemHandle ... cannot be used to open handles in the same process": the exporter
/// cannot open its own handle (Sluice's same-process paths never try).
#[test]
fn a_process_cannot_open_its_own_memory_handle() {
    if !gate::gpu_or_skip("a_process_cannot_open_its_own_memory_handle") {
        return;
    }
    let b = runtime().unwrap().bind(0).unwrap();
    let p = driver::mem_alloc(&b, 4096).unwrap();
    // SAFETY: the allocation's base; freed once below.
    unsafe {
        let h = driver::ipc_mem_handle(&b, p).unwrap();
        assert!(driver::ipc_open_mem_handle(&b, &h).is_err(), "opened its own handle");
        driver::mem_free(&b, p).unwrap();
    }
}

/// Another process maps exported memory and sees its bytes; opening the same handle twice in
/// one context gives the same pointer, closed once per opening ("If the memory handle has
/// already been opened by the current context, the reference count on the handle is
/// incremented by 1 and the existing device pointer is returned").
#[test]
fn another_process_maps_exported_memory_and_counts_its_openings() {
    if !gate::gpu_or_skip("another_process_maps_exported_memory_and_counts_its_openings") {
        return;
    }
    let b = runtime().unwrap().bind(0).unwrap();
    let n = 1 << 16;
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let s = driver::stream_create(&b).unwrap();
    let p = driver::mem_alloc(&b, n).unwrap();
    // SAFETY: live allocation and host buffer; synchronised before the handle goes out.
    let h = unsafe {
        driver::copy_htod_async(&b, p, data.as_ptr(), n, s).unwrap();
        driver::stream_synchronize(&b, s).unwrap();
        driver::ipc_mem_handle(&b, p).unwrap()
    };
    let hex: String = h.iter().map(|x| format!("{x:02x}")).collect();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "facts::child_opens_an_exported_handle",
            "--ignored",
            "--nocapture",
        ])
        .env("SLUICE_FACTS_HANDLE", &hex)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the importing process failed:\n{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("IMPORT OK"), "{err}");
    // SAFETY: nothing queued on it; the importer closed its mappings and exited.
    unsafe {
        driver::mem_free(&b, p).unwrap();
        driver::stream_destroy(&b, s).unwrap();
    }
}

#[test]
#[ignore = "the importing process of another_process_maps_exported_memory_and_counts_its_openings"]
fn child_opens_an_exported_handle() {
    let hex = std::env::var("SLUICE_FACTS_HANDLE").unwrap();
    let mut h = [0u8; driver::IPC_HANDLE_BYTES];
    for (i, o) in h.iter_mut().enumerate() {
        *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let b = runtime().unwrap().bind(0).unwrap();
    let p = driver::ipc_open_mem_handle(&b, &h).unwrap();
    let again = driver::ipc_open_mem_handle(&b, &h).unwrap();
    assert_eq!(p, again, "a second opening in one context gives the same pointer");
    let n = 1 << 16;
    let mut back = vec![0u8; n];
    let s = driver::stream_create(&b).unwrap();
    // SAFETY: the mapping holds the exporter's `n` bytes; pageable destination (complete on
    // return); each opening closed once.
    unsafe {
        driver::copy_dtoh_async(&b, back.as_mut_ptr(), p, n, s).unwrap();
        assert!(
            back.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8),
            "the exporter's bytes"
        );
        driver::ipc_close_mem_handle(&b, again).unwrap();
        driver::ipc_close_mem_handle(&b, p).unwrap();
        driver::stream_destroy(&b, s).unwrap();
    }
    println!("IMPORT OK");
}
