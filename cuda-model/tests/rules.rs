//! Each rule of the model fires when broken (and the model works when it is not). The rules are
//! checked with `SLUICE_CUDA_MODEL_BREACH=error` (the call returns an error and the model keeps
//! the breach); the ones that need a second process (IPC) or end the process (a host
//! dereference) run this test binary again as a child.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::process::Command;
use std::ptr::null_mut;

use sluice_cuda_model::api::*;
use sluice_cuda_model::rules::last_breach;

type Ptr = *mut c_void;

/// The model's last breach is process-wide: the tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn setup() {
    std::env::set_var("SLUICE_CUDA_MODEL_BREACH", "error");
    // SAFETY: cuInit has no pointer arguments.
    assert_eq!(unsafe { cuInit(0) }, 0);
}

fn bind(device: i32) -> Ptr {
    let mut ctx = null_mut();
    // SAFETY: valid output pointers.
    unsafe {
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, device), 0);
        assert_eq!(cuCtxSetCurrent(ctx), 0);
    }
    ctx
}

fn unbind() {
    // SAFETY: no pointers.
    assert_eq!(unsafe { cuCtxSetCurrent(null_mut()) }, 0);
}

fn broke(rule: &str) {
    let (id, detail) = last_breach().expect("a breach was recorded");
    assert_eq!(id, rule, "{detail}");
}

/// Runs this binary's test `name` as a child with `env`; returns (success, stderr).
fn child(name: &str, env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_context_bound_call_without_a_context_fails() {
    let _turn = serial();
    setup();
    unbind();
    let mut p = 0u64;
    // SAFETY: valid output pointers.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut p, 64), 201);
        broke("context.current");
        let mut s = null_mut();
        assert_eq!(cuStreamCreate(&mut s, 0), 201);
        assert_eq!(cuMemcpyHtoDAsync_v2(0, [0u8; 4].as_ptr().cast(), 4, null_mut()), 201);
        let mut ctx = null_mut();
        assert_eq!(cuCtxPopCurrent_v2(&mut ctx), 201);
        broke("context.pop");
    }
}

#[test]
fn copies_run_in_stream_order_and_stay_inside_allocations() {
    let _turn = serial();
    setup();
    bind(0);
    let (mut a, mut b) = (0u64, 0u64);
    let mut s = null_mut();
    let data: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
    let mut back = vec![0u8; 1000];
    // SAFETY: valid pointers; host buffers outlive the synchronising calls.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut a, 1000), 0);
        assert_eq!(cuMemAlloc_v2(&mut b, 1000), 0);
        assert_eq!(cuStreamCreate(&mut s, 0), 0);
        assert_eq!(cuMemcpyHtoDAsync_v2(a, data.as_ptr().cast(), 1000, s), 0);
        assert_eq!(cuMemcpyDtoDAsync_v2(b, a, 1000, s), 0);
        assert_eq!(cuMemsetD8Async(b, 7, 10, s), 0);
        assert_eq!(cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), b, 1000, s), 0);
        assert_eq!(cuStreamSynchronize(s), 0);
        // One byte past the end of an allocation.
        assert_eq!(cuMemcpyDtoDAsync_v2(b, a + 1, 1000, s), 1);
        broke("memory.copy-range");
        assert_eq!(cuMemcpyDtoDAsync_v2(a + 10, a, 100, s), 1);
        broke("memory.copy-overlap");
        assert_eq!(cuMemFree_v2(a), 0);
        assert_eq!(cuMemFree_v2(a), 1, "a double free");
        broke("handle.valid");
        assert_eq!(cuMemFree_v2(b), 0);
        assert_eq!(cuStreamDestroy_v2(s), 0);
        assert_eq!(cuStreamSynchronize(s), 400);
        broke("handle.valid");
    }
    assert!(back[..10].iter().all(|&x| x == 7));
    assert_eq!(&back[10..], &data[10..]);
}

#[test]
fn freeing_memory_with_queued_work_breaks_a_rule() {
    let _turn = serial();
    // Random delays keep the copy queued while the free comes.
    std::env::set_var("SLUICE_CUDA_MODEL_SEED", "7");
    setup();
    bind(1);
    let (mut a, mut s) = (0u64, null_mut());
    let pinned_len = 1 << 20;
    let mut host = null_mut();
    // SAFETY: valid pointers; the pinned buffer outlives the synchronisation.
    unsafe {
        assert_eq!(cuMemHostAlloc(&mut host, pinned_len, 0), 0);
        assert_eq!(cuMemAlloc_v2(&mut a, pinned_len), 0);
        assert_eq!(cuStreamCreate(&mut s, 0), 0);
        for _ in 0..50 {
            assert_eq!(cuMemcpyHtoDAsync_v2(a, host, pinned_len, s), 0);
        }
        assert_eq!(cuMemFree_v2(a), 1);
        broke("memory.free-busy");
        assert_eq!(cuMemFreeHost(host), 1, "pinned memory a queued copy reads");
        broke("memory.free-busy");
        assert_eq!(cuStreamSynchronize(s), 0);
        assert_eq!(cuMemFree_v2(a), 0);
        assert_eq!(cuMemFreeHost(host), 0);
        assert_eq!(cuMemFreeHost(host), 1);
        broke("memory.free-host");
    }
}

#[test]
fn an_event_records_the_work_queued_at_the_call() {
    let _turn = serial();
    setup();
    bind(0);
    let (mut s, mut e) = (null_mut(), null_mut());
    // SAFETY: valid pointers.
    unsafe {
        assert_eq!(cuStreamCreate(&mut s, 0), 0);
        assert_eq!(cuEventCreate(&mut e, 2), 0);
        assert_eq!(cuEventQuery(e), 0, "a never-recorded event is complete");
        assert_eq!(cuEventRecord(e, s), 0);
        assert_eq!(cuEventSynchronize(e), 0);
        assert_eq!(cuEventQuery(e), 0);
        let mut h = std::mem::zeroed();
        assert_eq!(cuIpcGetEventHandle(&mut h, e), 1);
        broke("ipc.event-flags");
        assert_eq!(cuEventDestroy_v2(e), 0);
        assert_eq!(cuEventQuery(e), 400);
        // An event of one context recorded on another context's stream.
        assert_eq!(cuEventCreate(&mut e, 2), 0);
        let other = bind(1);
        let mut s1 = null_mut();
        assert_eq!(cuStreamCreate(&mut s1, 0), 0);
        assert_eq!(cuEventRecord(e, s1), 400);
        broke("event.same-context");
        assert_eq!(cuCtxEnablePeerAccess(other, 3), 1);
        broke("context.peer-flags");
    }
}

#[test]
fn opening_ones_own_handle_is_refused() {
    let _turn = serial();
    setup();
    bind(0);
    let mut a = 0u64;
    // SAFETY: valid pointers.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut a, 4096), 0);
        let mut h = std::mem::zeroed();
        assert_eq!(cuIpcGetMemHandle(&mut h, a), 0);
        let mut p = 0u64;
        assert_eq!(cuIpcOpenMemHandle_v2(&mut p, h, 0), 1);
        broke("ipc.open-flags");
        assert_eq!(cuIpcOpenMemHandle_v2(&mut p, h, 1), 201);
        broke("ipc.same-process");
    }
}

#[test]
fn a_host_dereference_of_device_memory_is_named() {
    let _turn = serial();
    let (ok, err) = child("child_dereferences_device_memory", &[]);
    assert!(!ok, "the child survived: {err}");
    assert!(err.contains("memory.host-deref"), "{err}");
}

#[test]
#[ignore = "a child of a_host_dereference_of_device_memory_is_named"]
fn child_dereferences_device_memory() {
    setup();
    bind(0);
    let mut a = 0u64;
    // SAFETY: deliberately not: this reads device memory from the host, which the model must
    // catch (the process ends there).
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut a, 64), 0);
        let v = std::ptr::read_volatile(a as *const u8);
        println!("read {v}");
    }
}

/// The parent exports memory and an interprocess event, a child imports both; then the parent
/// breaks the IPC rules while the child holds them.
#[test]
fn ipc_between_processes_and_its_rules() {
    let _turn = serial();
    setup();
    bind(0);
    let (mut a, mut s, mut e) = (0u64, null_mut(), null_mut());
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 3) as u8).collect();
    // SAFETY: valid pointers.
    let (mh, eh) = unsafe {
        assert_eq!(cuMemAlloc_v2(&mut a, 4096), 0);
        assert_eq!(cuStreamCreate(&mut s, 0), 0);
        assert_eq!(cuMemcpyHtoDAsync_v2(a, data.as_ptr().cast(), 4096, s), 0);
        assert_eq!(cuEventCreate(&mut e, 2 | 4), 0);
        assert_eq!(cuEventRecord(e, s), 0);
        assert_eq!(cuStreamSynchronize(s), 0);
        let (mut mh, mut eh) = (std::mem::zeroed::<IpcHandle>(), std::mem::zeroed::<IpcHandle>());
        assert_eq!(cuIpcGetMemHandle(&mut mh, a), 0);
        assert_eq!(cuIpcGetEventHandle(&mut eh, e), 0);
        (hex(&mh.reserved), hex(&eh.reserved))
    };
    // A child that maps the memory, checks its bytes, and holds it until told to go.
    let mut kid = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_imports",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MEM_HANDLE", &mh)
        .env("EVENT_HANDLE", &eh)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    use std::io::{BufRead, Write};
    let mut out = std::io::BufReader::new(kid.stdout.take().unwrap());
    while !line.contains("IMPORTED") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended before importing"
        );
    }
    // SAFETY: no pointers.
    unsafe {
        assert_eq!(cuMemFree_v2(a), 1);
        broke("ipc.free-imported");
        assert_eq!(cuEventDestroy_v2(e), 0);
    }
    writeln!(kid.stdin.as_mut().unwrap(), "go").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(kid.wait().unwrap().success(), "{rest}");
    assert!(rest.contains("EVENT GONE NOTICED"), "{rest}");
    // One context per exporting device per process: a second context may not open it.
    let (ok, err) = child("child_imports", &[("MEM_HANDLE", &mh), ("EXPECT_ONE_CONTEXT", "1")]);
    assert!(ok, "{err}");
    // SAFETY: no pointers.
    assert_eq!(unsafe { cuMemFree_v2(a) }, 0, "freed once the children closed it");
    // A handle to freed memory names it as stale.
    let (ok, err) = child("child_imports", &[("MEM_HANDLE", &mh), ("EXPECT_STALE", "1")]);
    assert!(ok, "{err}");
}

#[test]
#[ignore = "a child of ipc_between_processes_and_its_rules"]
fn child_imports() {
    setup();
    bind(0);
    let mh = IpcHandle {
        reserved: unhex(&std::env::var("MEM_HANDLE").unwrap()),
    };
    let mut p = 0u64;
    // SAFETY: valid pointers; the handle came from the parent.
    unsafe {
        if std::env::var_os("EXPECT_STALE").is_some() {
            assert_eq!(cuIpcOpenMemHandle_v2(&mut p, mh, 1), 400);
            broke("ipc.stale-handle");
            return;
        }
        assert_eq!(cuIpcOpenMemHandle_v2(&mut p, mh, 1), 0);
        if std::env::var_os("EXPECT_ONE_CONTEXT").is_some() {
            bind(1);
            let mut q = 0u64;
            assert_eq!(cuIpcOpenMemHandle_v2(&mut q, mh, 1), 201);
            broke("ipc.one-context");
            bind(0);
            assert_eq!(cuIpcCloseMemHandle(p), 0);
            return;
        }
        let mut again = 0u64;
        assert_eq!(cuIpcOpenMemHandle_v2(&mut again, mh, 1), 0);
        assert_eq!(again, p, "opened once per context, counted");
        let mut back = vec![0u8; 4096];
        let mut s = null_mut();
        assert_eq!(cuStreamCreate(&mut s, 0), 0);
        assert_eq!(cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), p, 4096, s), 0);
        assert!(back.iter().enumerate().all(|(i, &b)| b == (i as u32 * 3) as u8));
        let eh = IpcHandle {
            reserved: unhex(&std::env::var("EVENT_HANDLE").unwrap()),
        };
        let mut e = null_mut();
        assert_eq!(cuIpcOpenEventHandle(&mut e, eh), 0);
        assert_eq!(cuEventQuery(e), 0, "the parent's recorded work is done");
        println!("IMPORTED");
        let mut go = String::new();
        std::io::stdin().read_line(&mut go).unwrap();
        assert_eq!(cuEventQuery(e), 400);
        broke("ipc.event-destroyed");
        println!("EVENT GONE NOTICED");
        assert_eq!(cuIpcCloseMemHandle(p), 0);
        assert_eq!(cuIpcCloseMemHandle(p), 0);
    }
}

/// Compiles `src` with the model's NVRTC, loads it and returns kernel `name`.
///
/// # Safety
/// A context must be current.
unsafe fn kernel(src: &str, name: &str) -> Ptr {
    use sluice_cuda_model::compute::*;
    let src = std::ffi::CString::new(src).unwrap();
    // SAFETY: valid pointers throughout (the caller's contract for the context).
    unsafe {
        let mut prog = null_mut();
        assert_eq!(
            nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                null_mut(),
                0,
                std::ptr::null(),
                std::ptr::null()
            ),
            0
        );
        assert_eq!(nvrtcCompileProgram(prog, 0, std::ptr::null()), 0);
        let mut len = 0usize;
        assert_eq!(nvrtcGetCUBINSize(prog, &mut len), 0);
        let mut image = vec![0u8; len];
        assert_eq!(nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()), 0);
        assert_eq!(nvrtcDestroyProgram(&mut prog), 0);
        let (mut module, mut f) = (null_mut(), null_mut());
        assert_eq!(cuModuleLoadData(&mut module, image.as_ptr().cast()), 0);
        let name = std::ffi::CString::new(name).unwrap();
        assert_eq!(cuModuleGetFunction(&mut f, module, name.as_ptr()), 0);
        f
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> [u8; 64] {
    let mut out = [0u8; 64];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

#[test]
fn a_call_before_cu_init_fails() {
    let (ok, err) = child("child_calls_before_init", &[("SLUICE_CUDA_MODEL_BREACH", "error")]);
    assert!(ok, "{err}");
    assert!(err.contains("init.first"), "{err}");
}

#[test]
#[ignore = "a child of a_call_before_cu_init_fails"]
fn child_calls_before_init() {
    let mut n = 0;
    // SAFETY: a valid output pointer.
    assert_eq!(unsafe { cuDeviceGetCount(&mut n) }, 3);
    broke("init.first");
}

#[test]
fn kernels_compile_launch_in_stream_order_and_foreign_images_are_refused() {
    let _turn = serial();
    setup();
    bind(0);
    use sluice_cuda_model::compute::*;
    let n = 1000usize;
    let data: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut back = vec![0f32; n];
    // SAFETY: valid pointers throughout; the argument values outlive the launch call (the
    // driver copies them at the call).
    unsafe {
        let f = kernel(
            "extern \"C\" __global__ void scale(float* x, float s, unsigned long long n) {\n\
             unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;\n\
             if (i < n) x[i] *= s; }",
            "scale",
        );
        let mut module = null_mut();
        let (mut x, mut s) = (0u64, null_mut());
        assert_eq!(cuMemAlloc_v2(&mut x, n * 4), 0);
        assert_eq!(cuStreamCreate(&mut s, 0), 0);
        assert_eq!(cuMemcpyHtoDAsync_v2(x, data.as_ptr().cast(), n * 4, s), 0);
        let (mut xp, mut k, mut len64) = (x, 2.5f32, n as u64);
        let mut params: [Ptr; 3] = [
            (&mut xp as *mut u64).cast(),
            (&mut k as *mut f32).cast(),
            (&mut len64 as *mut u64).cast(),
        ];
        assert_eq!(
            cuLaunchKernel(f, 4, 1, 1, 256, 1, 1, 0, s, params.as_mut_ptr(), null_mut()),
            0
        );
        assert_eq!(cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), x, n * 4, s), 0);
        assert!(
            back.iter().enumerate().all(|(i, &v)| v == i as f32 * 2.5),
            "{:?}",
            &back[..4]
        );
        // Launch limits: 2048 threads a block, and extra with kernelParams.
        assert_eq!(
            cuLaunchKernel(f, 1, 1, 1, 2048, 1, 1, 0, s, params.as_mut_ptr(), null_mut()),
            1
        );
        broke("launch.config");
        // A pointer argument outside any allocation is refused at the launch.
        let mut bad = 12345u64;
        params[0] = (&mut bad as *mut u64).cast();
        assert_eq!(
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params.as_mut_ptr(), null_mut()),
            1
        );
        broke("memory.copy-range");
        // A kernel loaded in context 0 runs on context 0's streams, on its own device's memory.
        let mut xp_saved = x;
        params[0] = (&mut xp_saved as *mut u64).cast();
        bind(1);
        let (mut s1, mut y) = (null_mut(), 0u64);
        assert_eq!(cuStreamCreate(&mut s1, 1), 0);
        assert_eq!(cuMemAlloc_v2(&mut y, n * 4), 0);
        assert_eq!(
            cuLaunchKernel(f, 4, 1, 1, 256, 1, 1, 0, s1, params.as_mut_ptr(), null_mut()),
            201
        );
        broke("launch.context");
        bind(0);
        let mut yp = y;
        params[0] = (&mut yp as *mut u64).cast();
        assert_eq!(
            cuLaunchKernel(f, 4, 1, 1, 256, 1, 1, 0, s, params.as_mut_ptr(), null_mut()),
            1
        );
        broke("launch.context");
        // Real PTX (or anything but the model's own images) cannot load.
        let ptx = b".version 8.0\n.target sm_90\n\0\0\0\0\0\0\0\0";
        assert_eq!(cuModuleLoadData(&mut module, ptx.as_ptr().cast()), 200);
        broke("module.image");
        assert_eq!(cuStreamSynchronize(s), 0);
        assert_eq!(cuMemFree_v2(x), 0);
    }
}

#[test]
fn the_legacy_stream_waits_for_blocking_streams_and_peer_access_follows_the_matrix() {
    let _turn = serial();
    std::env::set_var("SLUICE_CUDA_MODEL_SEED", "11");
    setup();
    let ctx1 = bind(1);
    bind(0);
    let n = 1 << 20;
    let data = vec![9u8; n];
    let mut back = vec![0u8; n];
    let (mut a, mut blocking) = (0u64, null_mut());
    // SAFETY: valid pointers; host buffers outlive the synchronising calls.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut a, n), 0);
        assert_eq!(cuStreamCreate(&mut blocking, 0), 0, "flags 0: a blocking stream");
        for _ in 0..20 {
            assert_eq!(cuMemsetD8Async(a, 1, n, blocking), 0);
        }
        assert_eq!(cuMemcpyHtoDAsync_v2(a, data.as_ptr().cast(), n, blocking), 0);
        // The legacy stream (0) reads after everything queued on the blocking stream.
        assert_eq!(cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), a, n, null_mut()), 0);
        assert!(
            back.iter().all(|&b| b == 9),
            "the legacy stream ran ahead of a blocking one"
        );
        // With SLUICE_CUDA_MODEL_PAGEABLE=sync a pageable upload is done when it returns.
        std::env::set_var("SLUICE_CUDA_MODEL_PAGEABLE", "sync");
        assert_eq!(cuMemcpyHtoDAsync_v2(a, back.as_ptr().cast(), n, blocking), 0);
        std::env::remove_var("SLUICE_CUDA_MODEL_PAGEABLE");
        assert!(idle(), "work left after a synchronous pageable upload");
        assert_eq!(cuStreamSynchronize(blocking), 0);
        assert_eq!(cuMemFree_v2(a), 0);
        // The peer-access matrix.
        let mut can = -1;
        std::env::set_var("SLUICE_CUDA_MODEL_PEERS", "none");
        assert_eq!(cuDeviceCanAccessPeer(&mut can, 0, 1), 0);
        assert_eq!(can, 0);
        assert_eq!(cuCtxEnablePeerAccess(ctx1, 0), 217);
        std::env::set_var("SLUICE_CUDA_MODEL_PEERS", "1-0");
        assert_eq!(cuDeviceCanAccessPeer(&mut can, 1, 0), 0);
        assert_eq!(can, 1);
        assert_eq!(cuDeviceCanAccessPeer(&mut can, 0, 1), 0);
        assert_eq!(can, 0);
        std::env::remove_var("SLUICE_CUDA_MODEL_PEERS");
    }
}

#[test]
fn a_wait_follows_the_record_it_saw_not_a_later_one() {
    let _turn = serial();
    std::env::set_var("SLUICE_CUDA_MODEL_SEED", "5");
    setup();
    bind(0);
    let n = 1 << 20;
    let mut back = vec![0u8; n];
    let (mut a, mut slow, mut fast, mut waiter, mut e) = (0u64, null_mut(), null_mut(), null_mut(), null_mut());
    // SAFETY: valid pointers; the host buffer outlives the synchronous copy.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut a, n), 0);
        for s in [&mut slow, &mut fast, &mut waiter] {
            assert_eq!(cuStreamCreate(s, 1), 0);
        }
        assert_eq!(cuEventCreate(&mut e, 2), 0);
        for v in 1..=30u8 {
            assert_eq!(cuMemsetD8Async(a, v, n, slow), 0);
        }
        assert_eq!(cuEventRecord(e, slow), 0);
        assert_eq!(cuStreamWaitEvent(waiter, e, 0), 0);
        // Recorded again on an idle stream: done at once, and no concern of the waiter above.
        assert_eq!(cuEventRecord(e, fast), 0);
        assert_eq!(cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), a, n, waiter), 0);
        assert!(
            back.iter().all(|&b| b == 30),
            "the waiter ran before the record it waited on"
        );
        assert_eq!(cuStreamSynchronize(slow), 0);
        assert_eq!(cuMemFree_v2(a), 0);
    }
}

#[test]
fn a_kernel_writing_past_its_allocation_is_named() {
    let (ok, err) = child("child_writes_past_an_allocation", &[]);
    assert!(!ok, "the child survived: {err}");
    assert!(err.contains("memory.out-of-bounds"), "{err}");
}

#[test]
#[ignore = "a child of a_kernel_writing_past_its_allocation_is_named"]
fn child_writes_past_an_allocation() {
    setup();
    bind(0);
    use sluice_cuda_model::compute::cuLaunchKernel;
    // SAFETY: valid pointers; the launch deliberately writes one element past the allocation,
    // which the model must catch (the process ends there).
    unsafe {
        let f = kernel(
            "extern \"C\" __global__ void past(float* x, unsigned long long n) { x[n + threadIdx.x] = 1.0f; }",
            "past",
        );
        let (mut x, mut s) = (0u64, null_mut());
        assert_eq!(cuMemAlloc_v2(&mut x, 8192), 0);
        assert_eq!(cuStreamCreate(&mut s, 1), 0);
        let (mut xp, mut n) = (x, 2048u64);
        let mut params: [Ptr; 2] = [(&mut xp as *mut u64).cast(), (&mut n as *mut u64).cast()];
        assert_eq!(
            cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params.as_mut_ptr(), null_mut()),
            0
        );
        cuStreamSynchronize(s);
    }
}
