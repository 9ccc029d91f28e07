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

/// Soname versions Sluice knows, newest first (CUDA 11.2 to 11.8 name NVRTC `.so.11.2`).
const MAJORS: [&str; 4] = ["13", "12", "11.2", "11"];

/// Candidate file names for `lib` (e.g. `cublas`), for a driver of CUDA `driver` (e.g.
/// `12080`) when known: only sonames whose major is no newer than the driver's (a CUDA 13
/// library needs a CUDA 13 driver, and PTX from a newer NVRTC is refused by an older driver),
/// newest first, then the unversioned development link (its version is checked once loaded);
/// each bare (the loader's path) and in every toolkit directory.
pub fn candidates(lib: &str, driver: Option<i32>) -> Vec<String> {
    let names: Vec<String> = MAJORS
        .iter()
        .filter(|m| {
            let major: i32 = m.split('.').next().and_then(|v| v.parse().ok()).unwrap_or(0);
            driver.is_none_or(|d| major <= d / 1000)
        })
        .map(|v| format!("lib{lib}.so.{v}"))
        .chain([format!("lib{lib}.so")])
        .collect();
    let mut out = names.clone();
    for d in search_dirs() {
        out.extend(names.iter().map(|n| format!("{d}/{n}")));
    }
    out
}

/// The driver's CUDA version when the driver is usable (libraries are then chosen for it).
fn driver_version() -> Option<i32> {
    runtime().ok().map(|c| c.driver_version)
}

fn open(lib: &str) -> Result<libloading::Library, Unavailable> {
    // Under the CUDA driver model, its library stands in for NVRTC and cuBLAS too.
    if let Some(model) = driver::model() {
        // SAFETY: the model is a library of ours; its initializers only set up its state.
        return unsafe { libloading::Library::new(model) }
            .map_err(|e| Unavailable(format!("the CUDA driver model {model} as lib{lib}: {e}")));
    }
    let tried = candidates(lib, driver_version());
    for c in &tried {
        // SAFETY: loading a CUDA toolkit library runs only its own initializers, as every CUDA
        // program does when it links them.
        if let Ok(l) = unsafe { libloading::Library::new(c) } {
            tracing::debug!(library = %c, "loaded");
            return Ok(l);
        }
    }
    Err(Unavailable(format!(
        "lib{lib} was not found (looked for lib{lib}.so.13/.12/.11, none newer than the driver, on the loader path, in $CUDA_HOME and /usr/local/cuda)"
    )))
}

/// A library's major version is newer than the driver's: it cannot be used with it.
fn too_new(lib: &str, major: i32, minor: i32, driver: i32) -> Option<Unavailable> {
    (major > driver / 1000).then(|| {
        Unavailable(format!(
            "{lib} {major}.{minor} is newer than the driver (CUDA {}.{}): install the CUDA {} build of {lib} or a newer driver",
            driver / 1000,
            driver % 1000 / 10,
            driver / 1000
        ))
    })
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
    /// CUBIN output (NVRTC 11.1 and newer).
    cubin_size: Option<unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int>,
    cubin: Option<unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int>,
    /// The real architectures this NVRTC compiles for (11.2 and newer).
    archs: Option<Vec<i32>>,
    /// `(major, minor)`.
    version: (i32, i32),
}

fn nvrtc() -> Result<&'static Nvrtc, Unavailable> {
    static LIB: OnceLock<Result<Nvrtc, Unavailable>> = OnceLock::new();
    LIB.get_or_init(|| {
        let lib = open("nvrtc")?;
        type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;
        type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
        // SAFETY: each type below is the C signature from nvrtc.h; the optional entries are
        // looked up the same way and are absent from older NVRTCs.
        unsafe {
            let version_of: Version = symbol(&lib, "nvrtcVersion")?;
            let (mut major, mut minor) = (0, 0);
            version_of(&mut major, &mut minor);
            let archs = match (
                symbol::<Count>(&lib, "nvrtcGetNumSupportedArchs"),
                symbol::<Count>(&lib, "nvrtcGetSupportedArchs"),
            ) {
                (Ok(count), Ok(list)) => {
                    let mut n: c_int = 0;
                    count(&mut n);
                    let mut v = vec![0 as c_int; n.clamp(0, 256) as usize];
                    if n > 0 && n <= 256 {
                        list(v.as_mut_ptr());
                    }
                    Some(v)
                }
                _ => None,
            };
            Ok(Nvrtc {
                create: symbol(&lib, "nvrtcCreateProgram")?,
                compile: symbol(&lib, "nvrtcCompileProgram")?,
                log_size: symbol(&lib, "nvrtcGetProgramLogSize")?,
                log: symbol(&lib, "nvrtcGetProgramLog")?,
                ptx_size: symbol(&lib, "nvrtcGetPTXSize")?,
                ptx: symbol(&lib, "nvrtcGetPTX")?,
                destroy: symbol(&lib, "nvrtcDestroyProgram")?,
                cubin_size: symbol(&lib, "nvrtcGetCUBINSize").ok(),
                cubin: symbol(&lib, "nvrtcGetCUBIN").ok(),
                archs,
                version: (major, minor),
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
        // exported by every cuBLAS from 10 to 13; `cublasGetProperty` since 8.0, taking
        // `libraryPropertyType` as an int: 0 major, 1 minor).
        unsafe {
            let property: unsafe extern "C" fn(c_int, *mut c_int) -> c_int = symbol(&lib, "cublasGetProperty")?;
            let (mut major, mut minor) = (0, 0);
            property(0, &mut major);
            property(1, &mut minor);
            if let Some(e) = driver_version().and_then(|d| too_new("cuBLAS", major, minor, d)) {
                return Err(e);
            }
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

/// Whether NVRTC loads (it needs no driver: kernels compile on a machine without a GPU).
pub fn nvrtc_present() -> Result<(), Unavailable> {
    nvrtc().map(|_| ())
}

/// What NVRTC produces for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Machine code for `sm_XY` (loaded without a JIT; valid on a driver of NVRTC's major or
    /// newer, by CUDA's minor-version compatibility).
    Cubin(i32),
    /// PTX for `compute_XY`, compiled by the driver's JIT: only when NVRTC is no newer than
    /// the driver (a newer PTX ISA is refused with `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, and
    /// minor-version compatibility does not cover the JIT).
    Ptx(i32),
}

/// Chooses what to compile for a device of compute capability `device` with NVRTC `nvrtc`
/// under driver `driver` (e.g. `12040`): CUBIN for the device's own architecture whenever
/// NVRTC can produce it (no JIT, so nothing depends on the driver's PTX ISA); PTX for the
/// newest architecture NVRTC knows when the device is newer than NVRTC, provided NVRTC is no
/// newer than the driver. `archs` lists the real architectures NVRTC supports (unknown before
/// NVRTC 11.2); `cubin` says whether it can emit CUBIN (11.1 and newer).
pub fn choose_target(
    nvrtc: (i32, i32),
    driver: i32,
    device: (i32, i32),
    archs: Option<&[i32]>,
    cubin: bool,
) -> Result<Target, String> {
    let arch = device.0 * 10 + device.1;
    let nvrtc_version = nvrtc.0 * 1000 + nvrtc.1 * 10;
    if nvrtc.0 > driver / 1000 {
        return Err(format!(
            "NVRTC {}.{} is newer than the driver (CUDA {}.{}): its output needs a CUDA {} driver; install the CUDA {} NVRTC",
            nvrtc.0,
            nvrtc.1,
            driver / 1000,
            driver % 1000 / 10,
            nvrtc.0,
            driver / 1000
        ));
    }
    let ptx_ok = nvrtc_version <= driver;
    let knows = archs.is_none_or(|a| a.contains(&arch));
    if cubin && knows {
        return Ok(Target::Cubin(arch));
    }
    if !knows {
        // A device newer than NVRTC: PTX for the newest architecture it knows, JIT-compiled.
        let best = archs.and_then(|a| a.iter().copied().filter(|&x| x < arch).max());
        return match best {
            Some(b) if ptx_ok => Ok(Target::Ptx(b)),
            Some(_) => Err(format!(
                "NVRTC {}.{} does not know sm_{arch}, and its PTX is newer than the driver (CUDA {}.{}) can load",
                nvrtc.0,
                nvrtc.1,
                driver / 1000,
                driver % 1000 / 10
            )),
            None => Err(format!(
                "NVRTC {}.{} knows no architecture up to sm_{arch}",
                nvrtc.0, nvrtc.1
            )),
        };
    }
    if ptx_ok {
        Ok(Target::Ptx(arch))
    } else {
        Err(format!(
            "NVRTC {}.{} emits no CUBIN and its PTX is newer than the driver (CUDA {}.{})",
            nvrtc.0,
            nvrtc.1,
            driver / 1000,
            driver % 1000 / 10
        ))
    }
}

/// Compiles `source` for `device` into a module image (CUBIN, or PTX with its NUL).
fn compile_image(device: u32, source: &str, name: &str) -> Result<Vec<u8>, CudaError> {
    let cuda = runtime()?;
    let gpu = cuda.gpu(device)?;
    let cc = driver::compute_capability(gpu.handle)?;
    let nv = nvrtc()?;
    let target = choose_target(
        nv.version,
        cuda.driver_version,
        cc,
        nv.archs.as_deref(),
        nv.cubin.is_some() && nv.cubin_size.is_some(),
    )
    .map_err(|e| CudaError::Unavailable(Unavailable(e)))?;
    tracing::debug!(?target, nvrtc = ?nv.version, driver = cuda.driver_version, "compiling {name}");
    compile(source, name, target)
}

/// Compiles CUDA C++ `source` to PTX for compute capability `(major, minor)` with NVRTC alone
/// (no driver or GPU needed: CI uses it to check kernel sources).
pub fn ptx_for(source: &str, name: &str, (major, minor): (i32, i32)) -> Result<CString, CudaError> {
    let image = compile(source, name, Target::Ptx(major * 10 + minor))?;
    CStr::from_bytes_until_nul(&image)
        .map(CStr::to_owned)
        .map_err(|_| CudaError::Invalid("NVRTC returned PTX without a NUL".into()))
}

/// Compiles CUDA C++ `source` to CUBIN for `sm_XY` with NVRTC alone (no driver needed).
pub fn cubin_for(source: &str, name: &str, (major, minor): (i32, i32)) -> Result<Vec<u8>, CudaError> {
    compile(source, name, Target::Cubin(major * 10 + minor))
}

/// Runs NVRTC on `source` for `target`; errors carry NVRTC's log.
fn compile(source: &str, name: &str, target: Target) -> Result<Vec<u8>, CudaError> {
    let nv = nvrtc()?;
    let src = CString::new(source).map_err(|_| CudaError::Invalid("kernel source holds a NUL".into()))?;
    let cname = CString::new(name).map_err(|_| CudaError::Invalid("program name holds a NUL".into()))?;
    let arch = match target {
        Target::Cubin(a) => format!("sm_{a}"),
        Target::Ptx(a) => format!("compute_{a}"),
    };
    let options: Vec<CString> = [
        // NVRTC's default C++ standard (17 in CUDA 12 and 13) suits the kernels; naming an
        // older one risks a toolkit that dropped it.
        format!("--gpu-architecture={arch}"),
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
    let _guard = Destroy(nv, prog);
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
            "compiling {name} for {arch} failed (NVRTC error {r}):\n{log}"
        )));
    }
    let (size_of, get, what) = match target {
        Target::Ptx(_) => (nv.ptx_size, nv.ptx, "PTX"),
        Target::Cubin(_) => match (nv.cubin_size, nv.cubin) {
            (Some(s), Some(g)) => (s, g, "CUBIN"),
            _ => return Err(CudaError::Invalid("this NVRTC cannot emit CUBIN (needs 11.1)".into())),
        },
    };
    let mut len = 0usize;
    // SAFETY: writes one size through a valid pointer.
    let r = unsafe { size_of(prog, &mut len) };
    if r != 0 || len == 0 {
        return Err(nvrtc_err(&format!("getting the {what} size"), r));
    }
    let mut image = vec![0u8; len];
    // SAFETY: the buffer holds the `len` bytes NVRTC reported (a PTX image its NUL included).
    let r = unsafe { get(prog, image.as_mut_ptr() as *mut c_char) };
    if r != 0 {
        return Err(nvrtc_err(&format!("getting the {what}"), r));
    }
    Ok(image)
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
        let image = compile_image(device, source, name)?;
        let bound = runtime()?.bind(device)?;
        let module = driver::module_load(&bound, &image)?;
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
        let bound = runtime()?.bind(self.device)?;
        // SAFETY: the module is loaded into this device's context and never unloaded.
        let k = unsafe { driver::module_function(&bound, self.module, &cname) }?;
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
        let bound = runtime()?.bind(self.device)?;
        // SAFETY: each pointer points into `args`, borrowed for the call (the driver copies the
        // values at launch); the caller vouches for the kernel's contract.
        unsafe { driver::launch(&bound, f, grid, BLOCK as u32, stream.handle(), &mut params) }?;
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
    let _bound = runtime()?.bind(device)?;
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
    let _bound = runtime()?.bind(stream.device())?;
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
        let c = candidates("cublas", None);
        assert_eq!(c[0], "libcublas.so.13");
        assert!(c.contains(&"/usr/local/cuda/lib64/libcublas.so.12".to_string()));
        assert!(c.contains(&"libcublas.so".to_string()));
    }

    #[test]
    fn libraries_newer_than_the_driver_are_not_tried() {
        let c = candidates("nvrtc", Some(12040));
        assert_eq!(c[0], "libnvrtc.so.12", "a CUDA 12 driver gets CUDA 12 libraries first");
        assert!(!c.iter().any(|n| n.ends_with(".so.13")), "{c:?}");
        assert!(candidates("cublas", Some(13000))[0].ends_with(".so.13"));
        assert!(too_new("cuBLAS", 13, 0, 12080)
            .unwrap()
            .to_string()
            .contains("newer than the driver"));
        assert!(too_new("cuBLAS", 12, 9, 12040).is_none(), "minor-version compatibility");
        assert!(
            too_new("cuBLAS", 12, 9, 13000).is_none(),
            "an older major on a newer driver"
        );
    }

    #[test]
    fn the_compile_target_never_needs_a_jit_newer_than_the_driver() {
        let hopper = (9, 0);
        let archs: &[i32] = &[50, 60, 70, 75, 80, 86, 89, 90];
        // NVRTC 12.9 under a 12.4 driver: CUBIN (its PTX would be refused).
        assert_eq!(
            choose_target((12, 9), 12040, hopper, Some(archs), true),
            Ok(Target::Cubin(90))
        );
        // Same versions: CUBIN too (no JIT at all).
        assert_eq!(
            choose_target((12, 4), 12040, hopper, Some(archs), true),
            Ok(Target::Cubin(90))
        );
        // An NVRTC without CUBIN output and not newer than the driver: PTX.
        assert_eq!(choose_target((11, 0), 11040, (8, 0), None, false), Ok(Target::Ptx(80)));
        // ... but newer than the driver: refused with the reason.
        assert!(choose_target((11, 6), 11040, (8, 0), None, false)
            .unwrap_err()
            .contains("newer"));
        // A device newer than NVRTC: PTX of the newest architecture it knows, JIT-compiled.
        assert_eq!(
            choose_target((12, 4), 12080, (10, 0), Some(archs), true),
            Ok(Target::Ptx(90))
        );
        // ... unless that PTX is newer than the driver.
        assert!(choose_target((12, 8), 12040, (10, 0), Some(archs), true).is_err());
        // A newer major than the driver: refused.
        let e = choose_target((13, 0), 12080, hopper, Some(archs), true).unwrap_err();
        assert!(e.contains("install the CUDA 12 NVRTC"), "{e}");
        // Unknown architecture list (NVRTC 11.1): CUBIN for the device.
        assert_eq!(choose_target((11, 1), 11040, (8, 6), None, true), Ok(Target::Cubin(86)));
    }

    #[test]
    fn nvrtc_emits_cubin_without_a_driver() {
        if !crate::gate::nvrtc_or_skip("nvrtc_emits_cubin_without_a_driver") {
            return;
        }
        let src = "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }";
        let image = cubin_for(src, "k.cu", (9, 0)).unwrap();
        assert_eq!(&image[..4], b"\x7fELF", "a CUBIN is an ELF image");
        // A kernel that does not compile is an error carrying NVRTC's log, not a crash.
        let e = cubin_for("__global__ void k( {", "bad.cu", (9, 0)).unwrap_err();
        assert!(e.to_string().contains("compiling bad.cu"), "{e}");
    }

    #[test]
    fn without_cuda_compute_is_unavailable_with_a_reason() {
        if !crate::gate::without_driver_or_skip("without_cuda_compute_is_unavailable_with_a_reason") {
            return;
        }
        let e = available().unwrap_err();
        assert!(e.to_string().contains("libcuda"), "{e}");
        assert!(Program::compile(0, "", "x").is_err());
    }
}
