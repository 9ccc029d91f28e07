//! The model's system calls: the device address space, shared memory files and the fault
//! handler that names a host dereference of device memory.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes of address space reserved for device memory (never backed: host access faults).
pub const SPACE: usize = 1 << 40;

static SPACE_BASE: AtomicUsize = AtomicUsize::new(0);

/// Where the model's own views of device memory lie: a second reserved range, each allocation
/// followed by an inaccessible guard page, so an access past an allocation's end (a kernel's,
/// or a bad copy's) faults and is named instead of landing in a neighbour.
static BACKING_BASE: AtomicUsize = AtomicUsize::new(0);
static BACKING_NEXT: AtomicUsize = AtomicUsize::new(0);

/// `SPACE` bytes of address space, inaccessible and unbacked.
fn reserve() -> io::Result<usize> {
    // SAFETY: a fresh anonymous mapping at an address the kernel chooses, with no access and
    // no backing: it touches no existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SPACE,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as usize)
}

/// Reserves the device address space and the model's backing range (both inaccessible) and
/// installs the fault handler; returns the device space's base.
pub fn reserve_space() -> io::Result<usize> {
    let p = reserve()?;
    SPACE_BASE.store(p, Ordering::SeqCst);
    let b = reserve()?;
    BACKING_BASE.store(b, Ordering::SeqCst);
    BACKING_NEXT.store(b, Ordering::SeqCst);
    install_fault_handler();
    Ok(p)
}

fn in_backing(addr: usize) -> bool {
    let base = BACKING_BASE.load(Ordering::Relaxed);
    base != 0 && addr >= base && addr < base + SPACE
}

/// A fresh place for a view of `len` bytes in the backing range, a guard page after it.
fn take_backing(len: usize) -> io::Result<usize> {
    let span = len.next_multiple_of(4096) + 4096;
    let at = BACKING_NEXT.fetch_add(span, Ordering::Relaxed);
    if BACKING_BASE.load(Ordering::Relaxed) == 0 || at + span > BACKING_BASE.load(Ordering::Relaxed) + SPACE {
        return Err(io::Error::other("the model's backing range is used up"));
    }
    Ok(at)
}

/// Whether `addr` lies in the device address space.
pub fn in_space(addr: usize) -> bool {
    let base = SPACE_BASE.load(Ordering::Relaxed);
    base != 0 && addr >= base && addr < base + SPACE
}

/// The handlers installed before ours (Rust's stack-overflow report, a Python faulthandler...),
/// for SIGSEGV and SIGBUS: faults outside device memory go to them.
static PREVIOUS: [std::sync::OnceLock<libc::sigaction>; 2] = [std::sync::OnceLock::new(), std::sync::OnceLock::new()];

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    if in_space(addr) {
        let msg = b"sluice CUDA driver model: broke rule memory.host-deref (documented): host code \
dereferenced a device pointer (device memory is not host memory)\n";
        // SAFETY: write(2) and abort(3) are async-signal-safe; the buffer is static.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::abort();
        }
    }
    if in_backing(addr) {
        let msg = b"sluice CUDA driver model: broke rule memory.out-of-bounds (documented): an access \
went past the end of a device allocation (a kernel's or a copy's)\n";
        // SAFETY: write(2) and abort(3) are async-signal-safe; the buffer is static.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::abort();
        }
    }
    // Not ours: the handler that was there before, else the default action.
    let previous = PREVIOUS[usize::from(sig == libc::SIGBUS)].get();
    // SAFETY: calling the previous handler with the arguments the kernel gave us (as its own
    // installation asked: SA_SIGINFO or not), or restoring the default disposition and
    // re-raising; all async-signal-safe.
    unsafe {
        match previous {
            Some(old) if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN => {
                if old.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(old.sa_sigaction);
                    f(sig, info, ctx);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(old.sa_sigaction);
                    f(sig);
                }
            }
            _ => {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
        }
    }
}

fn install_fault_handler() {
    // SAFETY: a zeroed sigaction with our handler, SA_SIGINFO and SA_ONSTACK (a stack overflow
    // still reaches Rust's handler on its alternate stack) is a valid argument; the previous
    // handlers are kept to chain to; the handler only calls async-signal-safe functions.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_fault as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut sa.sa_mask);
        for (i, sig) in [libc::SIGSEGV, libc::SIGBUS].into_iter().enumerate() {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, &sa, &mut old) == 0 {
                let _ = PREVIOUS[i].set(old);
            }
        }
    }
}

/// A shared memory file (memfd) mapped read-write in this process.
pub struct Shared {
    pub fd: i32,
    pub base: usize,
    pub len: usize,
    /// Placed in the backing range (given back as inaccessible, never unmapped, so nothing else
    /// lands where a stale pointer points).
    guarded: bool,
}

impl Shared {
    /// A new file of `len` bytes named `name` (visible in `/proc/PID/fd` links).
    /// As [`Shared::create`], placed in the backing range before a guard page.
    pub fn create_guarded(name: &str, len: usize) -> io::Result<Shared> {
        Self::create_at(name, len, Some(take_backing(len)?))
    }

    /// As [`Shared::open`], placed in the backing range before a guard page.
    pub fn open_guarded(pid: u32, fd: i32, len: usize) -> io::Result<Shared> {
        Self::open_at(pid, fd, len, Some(take_backing(len)?))
    }

    pub fn create(name: &str, len: usize) -> io::Result<Shared> {
        Self::create_at(name, len, None)
    }

    pub fn open(pid: u32, fd: i32, len: usize) -> io::Result<Shared> {
        Self::open_at(pid, fd, len, None)
    }

    fn create_at(name: &str, len: usize, at: Option<usize>) -> io::Result<Shared> {
        let cname = CString::new(name).expect("no NUL in a name");
        // SAFETY: memfd_create reads the NUL-terminated name and returns a new descriptor.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: ftruncate on the descriptor just made.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        Self::map(fd, len, at)
    }

    /// Opens process `pid`'s descriptor `fd` (another process's memfd) and maps `len` bytes.
    fn open_at(pid: u32, fd: i32, len: usize, at: Option<usize>) -> io::Result<Shared> {
        let path = format!("/proc/{pid}/fd/{fd}");
        // The file must hold what the handle claims (mapping past its end would fault later).
        let size = std::fs::metadata(&path)?.len() as usize;
        if size < len {
            return Err(io::Error::other(format!(
                "{path} holds {size} bytes, the handle claims {len}"
            )));
        }
        let path = CString::new(path).expect("no NUL");
        // SAFETY: open(2) on a NUL-terminated path.
        let own = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if own < 0 {
            return Err(io::Error::last_os_error());
        }
        Self::map(own, len, at)
    }

    fn map(fd: i32, len: usize, at: Option<usize>) -> io::Result<Shared> {
        // SAFETY: a new shared mapping of our own descriptor, at an address the kernel chooses
        // or (MAP_FIXED) at a fresh place of the model's own reserved backing range, which
        // nothing else uses.
        let p = unsafe {
            libc::mmap(
                at.unwrap_or(0) as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | if at.is_some() { libc::MAP_FIXED } else { 0 },
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        Ok(Shared {
            fd,
            base: p as usize,
            len,
            guarded: at.is_some(),
        })
    }

    /// The name of process `pid`'s descriptor `fd` (what `/proc/PID/fd/FD` links to).
    pub fn name_of(pid: u32, fd: i32) -> io::Result<String> {
        std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).map(|p| p.to_string_lossy().into_owned())
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: unmapping and closing what `map` made; nothing refers to the mapping once
        // its owner drops it (the model keeps every user of it alive until then).
        unsafe {
            if self.guarded {
                // Back to reserved and inaccessible (a late access faults and is named).
                libc::mmap(
                    self.base as *mut libc::c_void,
                    self.len,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                    -1,
                    0,
                );
            } else {
                libc::munmap(self.base as *mut libc::c_void, self.len);
            }
            libc::close(self.fd);
        }
    }
}

/// Anonymous host memory (what `cuMemHostAlloc` returns).
pub fn host_alloc(len: usize) -> io::Result<usize> {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p as usize)
}

/// Gives back what [`host_alloc`] returned.
pub fn host_free(addr: usize, len: usize) {
    // SAFETY: `addr` and `len` are a mapping `host_alloc` made (the caller checked).
    unsafe { libc::munmap(addr as *mut libc::c_void, len.max(1)) };
}

/// Copies `len` bytes from `src` to `dst` (host addresses: the model's backing views or the
/// caller's host memory).
///
/// # Safety
/// Both ranges must be mapped and writable/readable for `len` bytes and not overlap.
pub unsafe fn copy(dst: usize, src: usize, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) }
}

/// Fills `len` bytes at `dst` with `value`.
///
/// # Safety
/// The range must be mapped and writable.
pub unsafe fn fill(dst: usize, value: u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::write_bytes(dst as *mut u8, value, len) }
}

/// The `u64` at `addr` in a shared mapping, as an atomic.
///
/// # Safety
/// `addr` must be 8-byte aligned inside a mapping that outlives the returned reference.
pub unsafe fn atomic_at<'a>(addr: usize) -> &'a std::sync::atomic::AtomicU64 {
    // SAFETY: the caller's contract; AtomicU64 has the layout of u64.
    unsafe { &*(addr as *const std::sync::atomic::AtomicU64) }
}

/// A compiled kernel module, loaded (`dlopen`) from `image` written to a file.
pub struct Module {
    handle: usize,
}

impl Module {
    pub fn load(so: &[u8]) -> io::Result<Module> {
        // Through a memory file, not a path in a shared temporary directory (nothing another
        // user could swap under us).
        let file = Shared::create("sluice-cuda-model-module", so.len().max(1))?;
        // SAFETY: the mapping holds `so.len()` writable bytes.
        unsafe { copy(file.base, so.as_ptr() as usize, so.len()) };
        let c = CString::new(format!("/proc/self/fd/{}", file.fd)).expect("no NUL");
        // SAFETY: loading a shared object the model compiled from kernel source; its only
        // initializers are the C++ runtime's for that code.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        drop(file);
        if h.is_null() {
            // SAFETY: dlerror returns a static string or null.
            let e = unsafe { libc::dlerror() };
            let why = if e.is_null() {
                "dlopen failed".to_owned()
            } else {
                // SAFETY: a NUL-terminated string owned by the loader.
                unsafe { std::ffi::CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            return Err(io::Error::other(why));
        }
        Ok(Module { handle: h as usize })
    }

    /// The address of symbol `name`, if the module has it.
    pub fn symbol(&self, name: &str) -> Option<usize> {
        let c = CString::new(name).ok()?;
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle as *mut libc::c_void, c.as_ptr()) };
        (!p.is_null()).then_some(p as usize)
    }
}

/// A kernel launcher of a loaded module: `launch(params, dims)`.
pub type Launcher = unsafe extern "C" fn(*mut *mut libc::c_void, *const u32);

/// The launcher at `addr` (from [`Module::symbol`]).
///
/// # Safety
/// `addr` must be the address of a generated `__sluice_launch_*` function.
pub unsafe fn launcher(addr: usize) -> Launcher {
    // SAFETY: the caller's contract: a function of exactly this signature.
    unsafe { std::mem::transmute::<usize, Launcher>(addr) }
}

/// `n` values of type `T` at `addr` (a module's constant arrays).
///
/// # Safety
/// `addr` must point at `n` initialised values of `T` that live as long as the module.
pub unsafe fn read_array<T: Copy>(addr: usize, n: usize) -> Vec<T> {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(addr as *const T, n) }.to_vec()
}
