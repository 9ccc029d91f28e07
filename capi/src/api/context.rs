//! Contexts, listeners, connecting.

use std::ffi::{c_char, c_int};

use super::{give, guard, guard_or, handle, opt_str, out_handle, take};
use crate::context::{SluiceContext, SluiceListener};
use crate::pipe::SluicePipe;
use crate::runtime;
use crate::status::{Error, SLUICE_OK};

/// Creates a context: the transports and channels this process offers to peers.
///
/// `transports` and `channels` are comma-separated names in priority order, or NULL for the
/// defaults (everything viable on this host). Transports: `shm`, `tcp`, `ibv`. Channels:
/// `basic`, `cma`, `multilane`, `rdma`, and the CUDA ones (unused by the C API, which sends CPU
/// tensors only). Unknown names are `SLUICE_INVALID_ARGUMENT`. On success `*out` is the new
/// context (free it with `sluice_context_free`); on error it is NULL.
///
/// The library starts its own threads (a runtime with two workers) on first use. A process
/// that forks must do so before its first call into the library.
#[no_mangle]
pub unsafe extern "C" fn sluice_context_new(
    transports: *const c_char,
    channels: *const c_char,
    out: *mut *mut SluiceContext,
) -> c_int {
    // SAFETY: the caller's contract is `sluice_context_new_with`'s, with no options.
    unsafe { new_context("sluice_context_new", transports, channels, std::ptr::null(), out) }
}

/// Like `sluice_context_new`, with `options` (NULL or empty: none): comma-separated
/// `key=value` pairs. `segment_bytes=N`: the size of the shared segment peers on this host copy
/// CPU tensors into for this process (default 1 GiB of address space, touched as used; the
/// tensors then arrive lent, read-only); 0: no segment, so tensors of 4 KiB and more arrive by
/// cross-memory attach straight into memory of this process's own, which
/// `sluice_received_tensor_take` hands out without a copy. `spin_us=N`: how long the
/// shared-memory transport spins on an empty ring before parking (default 50). Unknown keys and
/// malformed values are `SLUICE_INVALID_ARGUMENT`.
#[no_mangle]
pub unsafe extern "C" fn sluice_context_new_with(
    transports: *const c_char,
    channels: *const c_char,
    options: *const c_char,
    out: *mut *mut SluiceContext,
) -> c_int {
    // SAFETY: the caller's contract, forwarded.
    unsafe { new_context("sluice_context_new_with", transports, channels, options, out) }
}

/// The body of both constructors; errors are reported under `name`.
///
/// # Safety
/// The strings are NUL-terminated or NULL; `out` is a writable `sluice_context*` place or NULL.
unsafe fn new_context(
    name: &str,
    transports: *const c_char,
    channels: *const c_char,
    options: *const c_char,
    out: *mut *mut SluiceContext,
) -> c_int {
    guard(name, || {
        // SAFETY: the caller passes a writable `sluice_context*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes NUL-terminated strings or NULL.
        let transports = unsafe { opt_str(transports, "transports") }?;
        // SAFETY: as above.
        let channels = unsafe { opt_str(channels, "channels") }?;
        // SAFETY: as above.
        let options = unsafe { opt_str(options, "options") }?;
        give(out, SluiceContext::with_options(transports, channels, options)?);
        Ok(SLUICE_OK)
    })
}

/// Frees a context (NULL: nothing). Listeners and pipes made from it keep working.
#[no_mangle]
pub unsafe extern "C" fn sluice_context_free(ctx: *mut SluiceContext) {
    guard("sluice_context_free", || {
        let _entered = runtime::enter()?;
        // SAFETY: the caller gives up a context handle (or NULL).
        drop(unsafe { take(ctx) });
        Ok(SLUICE_OK)
    });
}

/// Starts listening for pipes on `addr` (`host:port`; NULL or `""`: 127.0.0.1 on a free
/// port; port 0: a free port). On success `*out` is the new listener (free it with
/// `sluice_listener_free`); on error it is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_listen(
    ctx: *const SluiceContext,
    addr: *const c_char,
    out: *mut *mut SluiceListener,
) -> c_int {
    guard("sluice_listen", || {
        // SAFETY: the caller passes a writable `sluice_listener*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live context or NULL.
        let ctx = unsafe { handle(ctx, "ctx") }?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let addr = unsafe { opt_str(addr, "addr") }?.unwrap_or("");
        give(out, ctx.listen(addr)?);
        Ok(SLUICE_OK)
    })
}

/// The address clients connect to (`host:port`, the port chosen when 0 was asked for). The
/// string is valid as long as the listener. NULL if `listener` is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_listener_address(listener: *const SluiceListener) -> *const c_char {
    guard_or(
        "sluice_listener_address",
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller passes a live listener or NULL.
            let listener = unsafe { handle(listener, "listener") }?;
            Ok(listener.address().as_ptr())
        },
    )
}

/// Waits for the next pipe (blocking). On success `*out` is the new pipe (free it with
/// `sluice_pipe_free`); on error it is NULL. An error concerns one incoming connection (a
/// peer that failed setup); the listener keeps listening, so call it again. Several threads
/// may accept on one listener. Do not free the listener while a thread waits here.
#[no_mangle]
pub unsafe extern "C" fn sluice_listener_accept(listener: *const SluiceListener, out: *mut *mut SluicePipe) -> c_int {
    guard("sluice_listener_accept", || {
        // SAFETY: the caller passes a writable `sluice_pipe*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live listener or NULL.
        let listener = unsafe { handle(listener, "listener") }?;
        give(out, listener.accept()?);
        Ok(SLUICE_OK)
    })
}

/// Stops listening and frees the listener (NULL: nothing). Pipes it accepted keep working.
#[no_mangle]
pub unsafe extern "C" fn sluice_listener_free(listener: *mut SluiceListener) {
    guard("sluice_listener_free", || {
        let _entered = runtime::enter()?;
        // SAFETY: the caller gives up a listener handle (or NULL).
        drop(unsafe { take(listener) });
        Ok(SLUICE_OK)
    });
}

/// Opens a pipe to the listener at `addr` (`host:port`), blocking through setup (at most
/// 10 s per stage: then `SLUICE_TIMEOUT`). On success `*out` is the new pipe (free it with
/// `sluice_pipe_free`); on error it is NULL. A refused connection is `SLUICE_IO`.
#[no_mangle]
pub unsafe extern "C" fn sluice_connect(
    ctx: *const SluiceContext,
    addr: *const c_char,
    out: *mut *mut SluicePipe,
) -> c_int {
    guard("sluice_connect", || {
        // SAFETY: the caller passes a writable `sluice_pipe*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live context or NULL.
        let ctx = unsafe { handle(ctx, "ctx") }?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let addr = unsafe { opt_str(addr, "addr") }?.ok_or_else(|| Error::invalid("addr is NULL"))?;
        give(out, ctx.connect(addr)?);
        Ok(SLUICE_OK)
    })
}
