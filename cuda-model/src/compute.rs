//! NVRTC's and cuBLAS's entry points under the model, and the driver's module and launch
//! calls (C signatures of `nvrtc.h`, `cublas_api.h` and `cuda.h`). Sluice loads them from the
//! model's own library when `SLUICE_CUDA_DRIVER` names it.
#![allow(unsafe_code)]
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Arc;

use crate::kernels;
use crate::model::{self, *};
use crate::rules;
use crate::sys::{self, Module};

type Ptr = *mut c_void;

// --- NVRTC -----------------------------------------------------------------------------------

struct Program {
    source: String,
    log: String,
    image: Option<Vec<u8>>,
}

const NVRTC_SUCCESS: c_int = 0;
const NVRTC_ERROR_INVALID_INPUT: c_int = 3;
const NVRTC_ERROR_INVALID_PROGRAM: c_int = 4;
const NVRTC_ERROR_COMPILATION: c_int = 6;

#[no_mangle]
pub unsafe extern "C" fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> c_int {
    if major.is_null() || minor.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: non-null outputs (the caller's contract).
    unsafe {
        *major = 12;
        *minor = 8;
    }
    NVRTC_SUCCESS
}

/// Writes `v` through a caller's output pointer.
unsafe fn put(out: *mut c_int, v: c_int) -> c_int {
    if out.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: a non-null output the caller sized for one int (the architecture list holds the
    // one entry nvrtcGetNumSupportedArchs announced).
    unsafe { *out = v };
    NVRTC_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetNumSupportedArchs(n: *mut c_int) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { put(n, 1) }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetSupportedArchs(archs: *mut c_int) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { put(archs, 90) }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCreateProgram(
    prog: *mut Ptr,
    src: *const c_char,
    _name: *const c_char,
    _num_headers: c_int,
    _headers: *const *const c_char,
    _include_names: *const *const c_char,
) -> c_int {
    if prog.is_null() || src.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: a NUL-terminated source (the caller's contract).
    let source = unsafe { CStr::from_ptr(src) }.to_string_lossy().into_owned();
    let p = Box::new(Program {
        source,
        log: String::new(),
        image: None,
    });
    // SAFETY: non-null output.
    unsafe { *prog = Box::into_raw(p).cast() };
    NVRTC_SUCCESS
}

/// The program behind a handle from nvrtcCreateProgram.
unsafe fn program<'a>(prog: Ptr) -> Option<&'a mut Program> {
    // SAFETY: handles are the boxes nvrtcCreateProgram made, live until destroyed.
    unsafe { prog.cast::<Program>().as_mut() }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcCompileProgram(prog: Ptr, _n: c_int, _options: *const *const c_char) -> c_int {
    // SAFETY: forwarded handle.
    let Some(p) = (unsafe { program(prog) }) else {
        return NVRTC_ERROR_INVALID_PROGRAM;
    };
    match kernels::compile(&p.source) {
        Ok(image) => {
            p.image = Some(image);
            p.log.clear();
            NVRTC_SUCCESS
        }
        Err(log) => {
            p.log = log;
            NVRTC_ERROR_COMPILATION
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLogSize(prog: Ptr, n: *mut usize) -> c_int {
    // SAFETY: forwarded handle; non-null output checked.
    match (unsafe { program(prog) }, n.is_null()) {
        (Some(p), false) => {
            unsafe { *n = p.log.len() + 1 };
            NVRTC_SUCCESS
        }
        _ => NVRTC_ERROR_INVALID_INPUT,
    }
}

/// Copies `bytes` (and a NUL when `nul`) to the caller's buffer, sized by the matching call.
unsafe fn give(out: *mut c_char, bytes: &[u8], nul: bool) -> c_int {
    if out.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the caller sized `out` from the size call (bytes, plus one for the NUL).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast(), bytes.len());
        if nul {
            *out.add(bytes.len()) = 0;
        }
    }
    NVRTC_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetProgramLog(prog: Ptr, log: *mut c_char) -> c_int {
    // SAFETY: forwarded handle and buffer.
    match unsafe { program(prog) } {
        Some(p) => unsafe { give(log, p.log.as_bytes(), true) },
        None => NVRTC_ERROR_INVALID_PROGRAM,
    }
}

/// The image's size through `n` (`extra`: one more for PTX's NUL).
unsafe fn image_size(prog: Ptr, n: *mut usize, extra: usize) -> c_int {
    // SAFETY: forwarded handle; non-null output checked.
    match (unsafe { program(prog) }.and_then(|p| p.image.as_ref()), n.is_null()) {
        (Some(i), false) => {
            unsafe { *n = i.len() + extra };
            NVRTC_SUCCESS
        }
        _ => NVRTC_ERROR_INVALID_INPUT,
    }
}

/// The image into `out` (`nul`: then a NUL, as PTX ends).
unsafe fn image(prog: Ptr, out: *mut c_char, nul: bool) -> c_int {
    // SAFETY: forwarded handle and buffer.
    match unsafe { program(prog) }.and_then(|p| p.image.as_ref()) {
        Some(i) => unsafe { give(out, i, nul) },
        None => NVRTC_ERROR_INVALID_INPUT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBINSize(prog: Ptr, n: *mut usize) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { image_size(prog, n, 0) }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetCUBIN(prog: Ptr, out: *mut c_char) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { image(prog, out, false) }
}

/// PTX is the same image (the model's loader takes either), NUL-terminated as PTX is.
#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTXSize(prog: Ptr, n: *mut usize) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { image_size(prog, n, 1) }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcGetPTX(prog: Ptr, out: *mut c_char) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { image(prog, out, true) }
}

#[no_mangle]
pub unsafe extern "C" fn nvrtcDestroyProgram(prog: *mut Ptr) -> c_int {
    if prog.is_null() {
        return NVRTC_ERROR_INVALID_INPUT;
    }
    // SAFETY: the handle is a box from nvrtcCreateProgram, destroyed once.
    unsafe {
        let p = *prog;
        if !p.is_null() {
            drop(Box::from_raw(p.cast::<Program>()));
        }
        *prog = std::ptr::null_mut();
    }
    NVRTC_SUCCESS
}

// --- modules and launches ----------------------------------------------------------------------

struct Function {
    /// The context (device ordinal) whose module holds it.
    ordinal: u32,
    launch: sys::Launcher,
    sizes: Vec<u64>,
    pointers: Vec<u8>,
    _module: Arc<Module>,
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Ptr, image: *const c_void) -> c_int {
    if module.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    if let Err(c) = need_context("cuModuleLoadData") {
        return c;
    }
    // SAFETY: every image starts with 16 bytes (a real one is longer still): the model's
    // magic and the length of the shared object that follows it.
    let head = unsafe { std::slice::from_raw_parts(image.cast::<u8>(), 16) };
    if &head[..8] != kernels::IMAGE_MAGIC {
        return rules::breach(
            rules::IMAGE,
            200,
            "cuModuleLoadData: not an image from the model's NVRTC (real PTX or CUBIN cannot run here)".into(),
        );
    }
    let len = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes")) as usize;
    // SAFETY: the model's NVRTC wrote `len` bytes of shared object after the header.
    let so = unsafe { std::slice::from_raw_parts(image.cast::<u8>().add(16), len) };
    let ordinal = match need_context("cuModuleLoadData") {
        Ok(o) => o,
        Err(c) => return c,
    };
    match Module::load(so) {
        Ok(m) => {
            // SAFETY: non-null output.
            unsafe { *module = Box::into_raw(Box::new((Arc::new(m), ordinal))).cast() };
            SUCCESS
        }
        Err(e) => rules::breach(rules::IMAGE, 200, format!("cuModuleLoadData: {e}")),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(f: *mut Ptr, module: Ptr, name: *const c_char) -> c_int {
    if f.is_null() || module.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: a module handle from cuModuleLoadData (never unloaded) and a NUL-terminated name.
    let ((m, ordinal), name) = unsafe {
        (
            &*module.cast::<(Arc<Module>, u32)>(),
            CStr::from_ptr(name).to_string_lossy(),
        )
    };
    let (Some(launch), Some(sizes), Some(pointers), Some(n)) = (
        m.symbol(&format!("__sluice_launch_{name}")),
        m.symbol(&format!("__sluice_sizes_{name}")),
        m.symbol(&format!("__sluice_ptrs_{name}")),
        m.symbol(&format!("__sluice_nparams_{name}")),
    ) else {
        return 500; // CUDA_ERROR_NOT_FOUND
    };
    // SAFETY: the generated module defines these symbols with these types and lengths.
    let func = unsafe {
        let n = sys::read_array::<c_int>(n, 1)[0].max(0) as usize;
        Function {
            ordinal: *ordinal,
            launch: sys::launcher(launch),
            sizes: sys::read_array::<u64>(sizes, n),
            pointers: sys::read_array::<u8>(pointers, n),
            _module: m.clone(),
        }
    };
    // SAFETY: non-null output; functions live as long as the process (like modules).
    unsafe { *f = Box::into_raw(Box::new(func)).cast() };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Ptr,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    _shared: c_uint,
    s: Ptr,
    params: *mut Ptr,
    extra: *mut Ptr,
) -> c_int {
    if f.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: a function handle from cuModuleGetFunction.
    let func = unsafe { &*f.cast::<Function>() };
    let threads = bx as u64 * by as u64 * bz as u64;
    if [gx, gy, gz, bx, by, bz].contains(&0)
        || threads > 1024
        || gy > 65535
        || gz > 65535
        || bz > 64
        || !extra.is_null()
        || (params.is_null() && !func.sizes.is_empty())
    {
        return rules::breach(
            rules::LAUNCH,
            INVALID_VALUE,
            format!(
                "cuLaunchKernel with grid {gx}x{gy}x{gz}, block {bx}x{by}x{bz}, kernelParams {params:?}, extra {extra:?}"
            ),
        );
    }
    let r = model::model().and_then(|mut m| {
        let st = m.stream(s as usize, "cuLaunchKernel")?;
        if st.ordinal != func.ordinal {
            return Err(rules::breach(
                rules::LAUNCH_CONTEXT,
                INVALID_CONTEXT,
                format!(
                    "a kernel of context {} launched on a stream of context {}",
                    func.ordinal, st.ordinal
                ),
            ));
        }
        // The arguments are copied now, as the driver does; device pointers become the
        // model's own view of that memory.
        let mut args: Vec<Vec<u64>> = Vec::with_capacity(func.sizes.len());
        let mut uses = Vec::new();
        for (i, (&size, &is_ptr)) in func.sizes.iter().zip(&func.pointers).enumerate() {
            let mut v = vec![0u64; (size as usize).div_ceil(8).max(1)];
            // SAFETY: params[i] points at an argument of the kernel's i-th parameter type,
            // `size` bytes (the driver's contract for kernelParams).
            unsafe {
                let src = *params.add(i);
                std::ptr::copy_nonoverlapping(src.cast::<u8>(), v.as_mut_ptr().cast::<u8>(), size as usize);
            }
            if is_ptr == 1 && v[0] != 0 {
                let (a, off) = m.find(v[0] as usize, 0, &format!("cuLaunchKernel argument {i}"))?;
                if a.ordinal != st.ordinal && !m.peer_enabled.contains(&(st.ordinal, a.ordinal)) {
                    return Err(rules::breach(
                        rules::LAUNCH_CONTEXT,
                        INVALID_VALUE,
                        format!(
                            "cuLaunchKernel argument {i} is memory of device {} on device {} without peer access",
                            a.ordinal, st.ordinal
                        ),
                    ));
                }
                v[0] = a.data(off) as u64;
                uses.push(a.pending.clone());
            }
            args.push(v);
        }
        let launch = func.launch;
        let dims = [gx, gy, gz, bx, by, bz];
        // Queued before the model is unlocked, so a free meanwhile sees it pending.
        st.enqueue(&uses, move || {
            let mut ptrs: Vec<*mut c_void> = args.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
            // SAFETY: the launcher unpacks exactly these arguments; the memory they point at
            // stays mapped while the launch is queued (a free meanwhile breaks a rule).
            unsafe { launch(ptrs.as_mut_ptr(), dims.as_ptr()) };
        });
        drop(m);
        Ok(())
    });
    match r {
        Ok(()) => SUCCESS,
        Err(c) => c,
    }
}

// --- cuBLAS ----------------------------------------------------------------------------------

struct Blas {
    stream: usize,
}

const CUBLAS_SUCCESS: c_int = 0;
const CUBLAS_NOT_INITIALIZED: c_int = 1;
const CUBLAS_INVALID_VALUE: c_int = 7;

#[no_mangle]
pub unsafe extern "C" fn cublasGetProperty(kind: c_int, value: *mut c_int) -> c_int {
    if value.is_null() {
        return CUBLAS_INVALID_VALUE;
    }
    // SAFETY: non-null output.
    unsafe { *value = [12, 8, 0].get(kind as usize).copied().unwrap_or(0) };
    CUBLAS_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(handle: *mut Ptr) -> c_int {
    if handle.is_null() {
        return CUBLAS_INVALID_VALUE;
    }
    if need_context("cublasCreate").is_err() {
        return CUBLAS_NOT_INITIALIZED;
    }
    // SAFETY: non-null output.
    unsafe { *handle = Box::into_raw(Box::new(Blas { stream: 0 })).cast() };
    CUBLAS_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetStream_v2(handle: Ptr, stream: Ptr) -> c_int {
    // SAFETY: a handle from cublasCreate_v2.
    match unsafe { handle.cast::<Blas>().as_mut() } {
        Some(b) => {
            b.stream = stream as usize;
            CUBLAS_SUCCESS
        }
        None => CUBLAS_NOT_INITIALIZED,
    }
}

/// Column-major `C = alpha op(A) op(B) + beta C`, queued on the handle's stream.
unsafe fn gemm<T>(
    handle: Ptr,
    (ta, tb): (c_int, c_int),
    (m, n, k): (c_int, c_int, c_int),
    (alpha, beta): (*const T, *const T),
    (a, lda): (*const T, c_int),
    (b, ldb): (*const T, c_int),
    (c, ldc): (*mut T, c_int),
) -> c_int
where
    T: Copy + Send + 'static + std::ops::Mul<Output = T> + std::ops::Add<Output = T> + Default + PartialEq,
{
    // SAFETY: a handle from cublasCreate_v2.
    let Some(blas) = (unsafe { handle.cast::<Blas>().as_ref() }) else {
        return CUBLAS_NOT_INITIALIZED;
    };
    if m < 0 || n < 0 || k < 0 || alpha.is_null() || beta.is_null() {
        return CUBLAS_INVALID_VALUE;
    }
    let (m, n, k) = (m as usize, n as usize, k as usize);
    // As cuBLAS checks them: an operation is N, T or C; each leading dimension at least the
    // rows of its operand as stored.
    let rows = |t: c_int, a: usize, b: usize| if t == 0 { a.max(1) } else { b.max(1) };
    if !(0..=2).contains(&ta)
        || !(0..=2).contains(&tb)
        || (lda as usize) < rows(ta, m, k)
        || (ldb as usize) < rows(tb, k, n)
        || (ldc as usize) < m.max(1)
        || lda < 1
        || ldb < 1
        || ldc < 1
    {
        return CUBLAS_INVALID_VALUE;
    }
    let (lda, ldb, ldc) = (lda as usize, ldb as usize, ldc as usize);
    if m == 0 || n == 0 {
        return CUBLAS_SUCCESS;
    }
    // SAFETY: host pointer mode (the default): the scalars are read at the call.
    let (alpha, beta) = unsafe { (*alpha, *beta) };
    let size = std::mem::size_of::<T>();
    let extent = |rows: usize, cols: usize, ld: usize| (ld * cols.max(1).saturating_sub(1) + rows) * size;
    let (ar, ac) = if ta == 0 { (m, k) } else { (k, m) };
    let (br, bc) = if tb == 0 { (k, n) } else { (n, k) };
    let r = model::model().and_then(|mut md| {
        let st = md.stream(blas.stream, "cublasGemm")?;
        let (aa, ao) = md.find(a as usize, if k == 0 { 0 } else { extent(ar, ac, lda) }, "cublasGemm A")?;
        let (ba, bo) = md.find(b as usize, if k == 0 { 0 } else { extent(br, bc, ldb) }, "cublasGemm B")?;
        let (ca, co) = md.find(c as usize, extent(m, n, ldc), "cublasGemm C")?;
        let (pa, pb, pc) = (aa.data(ao), ba.data(bo), ca.data(co));
        let uses = [aa.pending.clone(), ba.pending.clone(), ca.pending.clone()];
        // Queued before the model is unlocked, so a free meanwhile sees it pending.
        let _md = md;
        st.enqueue(&uses, move || {
            let (pa, pb, pc) = (pa as *const T, pb as *const T, pc as *mut T);
            for j in 0..n {
                for i in 0..m {
                    let mut acc = T::default();
                    for l in 0..k {
                        let x = if ta == 0 { i + l * lda } else { l + i * lda };
                        let y = if tb == 0 { l + j * ldb } else { j + l * ldb };
                        // SAFETY: indices inside the extents checked above, in live memory.
                        acc = acc + unsafe { *pa.add(x) * *pb.add(y) };
                    }
                    // SAFETY: as above; beta = 0 ignores C's old contents, as cuBLAS does.
                    unsafe {
                        let out = pc.add(i + j * ldc);
                        *out = if beta == T::default() {
                            alpha * acc
                        } else {
                            alpha * acc + beta * *out
                        };
                    }
                }
            }
        });
        Ok(())
    });
    match r {
        Ok(()) => CUBLAS_SUCCESS,
        Err(_) => CUBLAS_INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasSgemm_v2(
    handle: Ptr,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { gemm(handle, (ta, tb), (m, n, k), (alpha, beta), (a, lda), (b, ldb), (c, ldc)) }
}

#[no_mangle]
pub unsafe extern "C" fn cublasDgemm_v2(
    handle: Ptr,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f64,
    a: *const f64,
    lda: c_int,
    b: *const f64,
    ldb: c_int,
    beta: *const f64,
    c: *mut f64,
    ldc: c_int,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { gemm(handle, (ta, tb), (m, n, k), (alpha, beta), (a, lda), (b, ldb), (c, ldc)) }
}
