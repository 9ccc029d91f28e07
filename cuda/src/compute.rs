//! Compute on the GPU: kernels compiled at run time with NVRTC, and matrix products with cuBLAS.
//! The autograd crate's CUDA ops are built on these two and nothing else.
//!
//! Both libraries are loaded with `dlopen` on first use, never linked, so every build starts
//! without CUDA; a missing library is a [`Unavailable`] error naming what was searched, never a
//! panic. Sluice loads them itself rather than through cudarc's loaders because those look only
//! for the sonames of the CUDA version cudarc was built for (12.x here) and miss the toolkit's
//! own directory: a CUDA 13 machine ships `libcublas.so.13` under `/usr/local/cuda/lib64`.
//!
//! A [`Program`] is compiled once per (source, device) by its owner and keeps its kernels
//! looked up by name. Launching is `unsafe`: a kernel can write anywhere, so the caller states
//! that it writes only inside buffers it owns.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

use super::driver::{self, RawFunction, RawModule};
use super::{runtime, CudaError, Stream, Unavailable};

/// Where the toolkit libraries may be, besides the loader's own search path.
fn search_dirs() -> Vec<String> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(d) = std::env::var(var) {
            dirs.push(format!("{d}/lib64"));
            dirs.push(format!("{d}/lib"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs.push("/usr/lib/x86_64-linux-gnu".into());
    dirs
}

/// Candidate file names for `lib` (e.g. `cublas`): newest soname first, then the unversioned
/// development link; each bare (the loader's path) and in every toolkit directory.
fn candidates(lib: &str) -> Vec<String> {
    let names: Vec<String> = ["13", "12", "11"]
        .iter()
        .map(|v| format!("lib{lib}.so.{v}"))
        .chain([format!("lib{lib}.so")])
        .collect();
    let mut out = names.clone();
    for d in search_dirs() {
        out.extend(names.iter().map(|n| format!("{d}/{n}")));
    }
    out
}

fn open(lib: &str) -> Result<libloading::Library, Unavailable> {
    let tried = candidates(lib);
    for c in &tried {
        // SAFETY: loading a CUDA toolkit library runs only its own initializers, as every CUDA
        // program does when it links them.
        if let Ok(l) = unsafe { libloading::Library::new(c) } {
            tracing::debug!(library = %c, "loaded");
            return Ok(l);
        }
    }
    Err(Unavailable(format!(
        "lib{lib} was not found (looked for lib{lib}.so.13/.12/.11 on the loader path, in $CUDA_HOME and /usr/local/cuda)"
    )))
}

/// Resolves `name` in `lib` as a function pointer of type `F`.
///
/// # Safety
/// `F` is the exact C signature of the symbol.
unsafe fn symbol<F: Copy>(lib: &libloading::Library, name: &str) -> Result<F, Unavailable> {
    // SAFETY: the caller vouches for the type.
    unsafe { lib.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| Unavailable(format!("{name} is missing: {e}")))
}

type NvrtcProgram = *mut c_void;

struct Nvrtc {
    _lib: libloading::Library,
    create: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut NvrtcProgram) -> c_int,
}

fn nvrtc() -> Result<&'static Nvrtc, Unavailable> {
    static LIB: OnceLock<Result<Nvrtc, Unavailable>> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = open("nvrtc")?;
        // SAFETY: each type below is the C signature from nvrtc.h.
        unsafe {
            Ok(Nvrtc {
                create: symbol(&lib, "nvrtcCreateProgram")?,
                compile: symbol(&lib, "nvrtcCompileProgram")?,
                log_size: symbol(&lib, "nvrtcGetProgramLogSize")?,
                log: symbol(&lib, "nvrtcGetProgramLog")?,
                ptx_size: symbol(&lib, "nvrtcGetPTXSize")?,
                ptx: symbol(&lib, "nvrtcGetPTX")?,
                destroy: symbol(&lib, "nvrtcDestroyProgram")?,
                _lib: lib,
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

type CublasHandle = *mut c_void;
type Gemm<T> = unsafe extern "C" fn(
    CublasHandle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const T,
    *const T,
    c_int,
    *const T,
    c_int,
    *const T,
    *mut T,
    c_int,
) -> c_int;

struct Cublas {
    _lib: libloading::Library,
    create: unsafe extern "C" fn(*mut CublasHandle) -> c_int,
    set_stream: unsafe extern "C" fn(CublasHandle, *mut c_void) -> c_int,
    sgemm: Gemm<f32>,
    dgemm: Gemm<f64>,
}

fn cublas() -> Result<&'static Cublas, Unavailable> {
    static LIB: OnceLock<Result<Cublas, Unavailable>> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = open("cublas")?;
        // SAFETY: each type below is the C signature from cublas_api.h (the `_v2` entry points,
        // exported by every cuBLAS from 10 to 13).
        unsafe {
            Ok(Cublas {
                create: symbol(&lib, "cublasCreate_v2")?,
                set_stream: symbol(&lib, "cublasSetStream_v2")?,
                sgemm: symbol(&lib, "cublasSgemm_v2")?,
                dgemm: symbol(&lib, "cublasDgemm_v2")?,
                _lib: lib,
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether kernels can be compiled and matrix products run here: CUDA, NVRTC and cuBLAS all
/// present. The reason when not.
pub fn available() -> Result<(), Unavailable> {
    runtime()?;
    nvrtc()?;
    cublas()?;
    Ok(())
}

/// Compiles CUDA C++ `source` to PTX for `device`'s architecture. Errors carry NVRTC's log.
fn compile_ptx(device: u32, source: &str, name: &str) -> Result<CString, CudaError> {
    let cuda = runtime()?;
    let dev = driver::device(cuda.gpu(device)?.index as i32)?;
    ptx_for(source, name, driver::compute_capability(dev)?)
}

/// Compiles CUDA C++ `source` to PTX for compute capability `(major, minor)` with NVRTC alone
/// (no driver or GPU needed: CI uses it to check kernel sources).
pub fn ptx_for(source: &str, name: &str, (major, minor): (i32, i32)) -> Result<CString, CudaError> {
    let nv = nvrtc()?;
    let src = CString::new(source).map_err(|_| CudaError::Invalid("kernel source holds a NUL".into()))?;
    let cname = CString::new(name).map_err(|_| CudaError::Invalid("program name holds a NUL".into()))?;
    let options: Vec<CString> = [
        // NVRTC's default C++ standard (17 in CUDA 12 and 13) suits the kernels; naming an
        // older one risks a toolkit that dropped it.
        format!("--gpu-architecture=compute_{major}{minor}"),
        "-default-device".into(),
    ]
    .into_iter()
    .map(|o| CString::new(o).expect("options have no NUL"))
    .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let nvrtc_err = |call: &str, r: c_int| CudaError::Invalid(format!("{call} failed with NVRTC error {r}"));
    let mut prog: NvrtcProgram = std::ptr::null_mut();
    // SAFETY: the strings are NUL-terminated and outlive the call; no headers.
    let r = unsafe {
        (nv.create)(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(nvrtc_err("nvrtcCreateProgram", r));
    }
    struct Destroy<'a>(&'a Nvrtc, NvrtcProgram);
    impl Drop for Destroy<'_> {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed once.
            unsafe { (self.0.destroy)(&mut self.1) };
        }
    }
    let guard = Destroy(nv, prog);
    // SAFETY: `prog` is live; the option strings outlive the call.
    let r = unsafe { (nv.compile)(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
    if r != 0 {
        let mut len = 0usize;
        // SAFETY: writes one size through a valid pointer.
        unsafe { (nv.log_size)(prog, &mut len) };
        let mut log = vec![0u8; len.max(1)];
        // SAFETY: the buffer holds `len` bytes, as NVRTC asked.
        unsafe { (nv.log)(prog, log.as_mut_ptr() as *mut c_char) };
        let log = String::from_utf8_lossy(&log).trim_end_matches('\0').to_string();
        return Err(CudaError::Invalid(format!(
            "compiling {name} for compute_{major}{minor} failed (NVRTC error {r}):\n{log}"
        )));
    }
    let mut len = 0usize;
    // SAFETY: writes one size through a valid pointer.
    let r = unsafe { (nv.ptx_size)(prog, &mut len) };
    if r != 0 || len == 0 {
        return Err(nvrtc_err("nvrtcGetPTXSize", r));
    }
    let mut ptx = vec![0u8; len];
    // SAFETY: the buffer holds the `len` bytes (NUL included) NVRTC reported.
    let r = unsafe { (nv.ptx)(prog, ptx.as_mut_ptr() as *mut c_char) };
    drop(guard);
    if r != 0 {
        return Err(nvrtc_err("nvrtcGetPTX", r));
    }
    CStr::from_bytes_until_nul(&ptx)
        .map(CStr::to_owned)
        .map_err(|_| CudaError::Invalid("NVRTC returned PTX without a NUL".into()))
}

/// Kernels compiled for one device, loaded into its primary context (never unloaded: a
/// program lives as long as the process, like the kernels of a linked library).
pub struct Program {
    device: u32,
    module: RawModule,
    functions: Mutex<HashMap<String, RawFunction>>,
}

impl std::fmt::Debug for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Program(cuda:{})", self.device)
    }
}

/// One kernel parameter, passed by value.
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    /// A device address.
    Ptr(u64),
    U64(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    F64(f64),
    /// A small array passed by value (a struct of eight `unsigned long long`).
    Dims([u64; 8]),
}

impl Program {
    /// Compiles `source` for `device` and loads it.
    pub fn compile(device: u32, source: &str, name: &str) -> Result<Program, CudaError> {
        let ptx = compile_ptx(device, source, name)?;
        runtime()?.bind(device)?;
        let module = driver::module_load_ptx(&ptx)?;
        Ok(Program {
            device,
            module,
            functions: Mutex::default(),
        })
    }

    pub fn device(&self) -> u32 {
        self.device
    }

    fn function(&self, name: &str) -> Result<RawFunction, CudaError> {
        let mut f = self.functions.lock().expect("kernel table");
        if let Some(&k) = f.get(name) {
            return Ok(k);
        }
        let cname = CString::new(name).map_err(|_| CudaError::Invalid("kernel name holds a NUL".into()))?;
        // SAFETY: the module is loaded and never unloaded.
        let k = unsafe { driver::module_function(self.module, &cname) }?;
        f.insert(name.to_owned(), k);
        Ok(k)
    }

    /// Queues `kernel` over `threads` threads (blocks of 256) on `stream`.
    ///
    /// # Safety
    /// `args` match the kernel's parameters in number and type; every address passed is device
    /// memory of this process that stays allocated until the stream has passed the kernel;
    /// the kernel reads and writes only inside the buffers those addresses belong to, and
    /// writes only memory no other work uses concurrently.
    pub unsafe fn launch(&self, kernel: &str, threads: usize, stream: &Stream, args: &[Arg]) -> Result<(), CudaError> {
        if stream.device() != self.device {
            return Err(CudaError::Invalid(format!(
                "a kernel of cuda:{} on a stream of cuda:{}",
                self.device,
                stream.device()
            )));
        }
        if threads == 0 {
            return Ok(());
        }
        const BLOCK: usize = 256;
        let grid = threads.div_ceil(BLOCK);
        let grid = u32::try_from(grid).map_err(|_| CudaError::Invalid(format!("{threads} threads is too many")))?;
        let f = self.function(kernel)?;
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(v) | Arg::U64(v) => v as *const u64 as *mut c_void,
                Arg::I64(v) => v as *const i64 as *mut c_void,
                Arg::I32(v) => v as *const i32 as *mut c_void,
                Arg::F32(v) => v as *const f32 as *mut c_void,
                Arg::F64(v) => v as *const f64 as *mut c_void,
                Arg::Dims(v) => v.as_ptr() as *mut c_void,
            })
            .collect();
        runtime()?.bind(self.device)?;
        // SAFETY: each pointer points into `args`, borrowed for the call (the driver copies the
        // values at launch); the caller vouches for the kernel's contract.
        unsafe { driver::launch(f, grid, BLOCK as u32, stream.handle(), &mut params) }?;
        Ok(())
    }
}

/// A row-major matrix operand: its device address, whether it is stored transposed (its
/// column stride is 1 when not, its row stride 1 when it is), and its leading dimension.
#[derive(Debug, Clone, Copy)]
pub struct MatrixRef {
    pub ptr: u64,
    pub transposed: bool,
    pub ld: usize,
}

/// cuBLAS handles per device, each used under its lock (a handle has one current stream).
fn handle(device: u32) -> Result<&'static Mutex<usize>, CudaError> {
    static HANDLES: OnceLock<Mutex<HashMap<u32, &'static Mutex<usize>>>> = OnceLock::new();
    let blas = cublas()?;
    let mut map = HANDLES.get_or_init(Default::default).lock().expect("cublas handles");
    if let Some(h) = map.get(&device) {
        return Ok(h);
    }
    runtime()?.bind(device)?;
    let mut h: CublasHandle = std::ptr::null_mut();
    // SAFETY: writes one handle; the device's primary context is current, so the handle
    // belongs to it.
    let r = unsafe { (blas.create)(&mut h) };
    if r != 0 {
        return Err(CudaError::Invalid(format!("cublasCreate failed with status {r}")));
    }
    let h: &'static Mutex<usize> = Box::leak(Box::new(Mutex::new(h as usize)));
    map.insert(device, h);
    Ok(h)
}

/// The element type of a matrix product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmType {
    F32,
    F64,
}

/// `c = a · b` for row-major `a` (m×k), `b` (k×n) and contiguous `c` (m×n) of `ty`, queued on
/// `stream`.
///
/// # Safety
/// The three addresses are device memory of `stream`'s device, allocated until the stream has
/// passed the product, holding at least the elements their shapes and leading dimensions
/// reach; `c` is written and must not overlap `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    ty: GemmType,
    stream: &Stream,
    m: usize,
    n: usize,
    k: usize,
    a: MatrixRef,
    b: MatrixRef,
    c: u64,
) -> Result<(), CudaError> {
    let blas = cublas()?;
    let dim = |v: usize| c_int::try_from(v).map_err(|_| CudaError::Invalid(format!("{v} exceeds cuBLAS's int")));
    let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
    let (lda, ldb) = (dim(a.ld.max(1))?, dim(b.ld.max(1))?);
    if m == 0 || n == 0 {
        return Ok(());
    }
    // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: pass B first. A row-major operand that is
    // not transposed reads as its transpose in column-major, which is exactly what is wanted
    // (op N); a transposed one needs op T.
    let op = |t: bool| if t { 1 } else { 0 };
    let h = handle(stream.device())?;
    let guard = h.lock().expect("cublas handle");
    let handle = *guard as CublasHandle;
    runtime()?.bind(stream.device())?;
    // SAFETY: the handle is ours, used under its lock; the stream is held.
    let r = unsafe { (blas.set_stream)(handle, stream.raw() as *mut c_void) };
    if r != 0 {
        return Err(CudaError::Invalid(format!("cublasSetStream failed with status {r}")));
    }
    let (ta, tb) = (op(a.transposed), op(b.transposed));
    // SAFETY: the caller vouches for the three matrices; alpha and beta are host values read
    // during the call (host pointer mode, cuBLAS's default).
    let r = unsafe {
        match ty {
            GemmType::F32 => (blas.sgemm)(
                handle,
                tb,
                ta,
                ni,
                mi,
                ki,
                &1.0f32,
                b.ptr as *const f32,
                ldb,
                a.ptr as *const f32,
                lda,
                &0.0f32,
                c as *mut f32,
                ni,
            ),
            GemmType::F64 => (blas.dgemm)(
                handle,
                tb,
                ta,
                ni,
                mi,
                ki,
                &1.0f64,
                b.ptr as *const f64,
                ldb,
                a.ptr as *const f64,
                lda,
                &0.0f64,
                c as *mut f64,
                ni,
            ),
        }
    };
    if r != 0 {
        return Err(CudaError::Invalid(format!(
            "cublas gemm ({m}x{k} · {k}x{n}) failed with status {r}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_cover_cuda_13_and_the_toolkit_directory() {
        let c = candidates("cublas");
        assert_eq!(c[0], "libcublas.so.13");
        assert!(c.contains(&"/usr/local/cuda/lib64/libcublas.so.12".to_string()));
        assert!(c.contains(&"libcublas.so".to_string()));
    }

    #[test]
    fn without_cuda_compute_is_unavailable_with_a_reason() {
        if driver::library_present() {
            eprintln!("SKIPPED: this machine has a CUDA driver library");
            return;
        }
        let e = available().unwrap_err();
        assert!(e.to_string().contains("libcuda"), "{e}");
        assert!(Program::compile(0, "", "x").is_err());
    }
}
