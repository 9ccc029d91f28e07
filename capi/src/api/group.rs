//! Collective groups: binding, forming, collectives, point-to-point messages with tags.

use std::ffi::{c_char, c_int, c_void};
use std::time::Duration;

use super::{give, guard, guard_or, handle, opt_str, out_handle, take, SluiceDoneFn};
use crate::borrowed::{Done, Region};
use crate::context::SluiceContext;
use crate::group::{dtype, input_apart, reduce_op, SluiceGroup, SluiceGroupBound};
use crate::runtime;
use crate::status::{Error, Result, SLUICE_OK};
use sluice_dlpack::ffi::DLDataType;

/// Binds a rank's listener for a group on `host` (NULL or `""`: 127.0.0.1), on a port the
/// system chooses, with `ctx`'s transports and channels. Publish its address
/// (`sluice_group_bound_address`) through your own rendezvous, then call `sluice_group_form`.
/// On success `*out` is the new handle (consumed by `sluice_group_form`, or freed with
/// `sluice_group_bound_free`); on error it is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_bind(
    ctx: *const SluiceContext,
    host: *const c_char,
    out: *mut *mut SluiceGroupBound,
) -> c_int {
    guard("sluice_group_bind", || {
        // SAFETY: the caller passes a writable `sluice_group_bound*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a live context or NULL.
        let ctx = unsafe { handle(ctx, "ctx") }?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let host = unsafe { opt_str(host, "host") }?
            .filter(|h| !h.is_empty())
            .unwrap_or("127.0.0.1");
        give(out, SluiceGroupBound::bind(ctx, host)?);
        Ok(SLUICE_OK)
    })
}

/// The address the other ranks reach this one at (`host:port`), valid as long as the handle.
/// NULL if `bound` is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_bound_address(bound: *const SluiceGroupBound) -> *const c_char {
    guard_or(
        "sluice_group_bound_address",
        |_| std::ptr::null(),
        || {
            // SAFETY: the caller passes a live handle or NULL.
            Ok(unsafe { handle(bound, "bound") }?.address().as_ptr())
        },
    )
}

/// Frees a bound listener that was not formed into a group (NULL: nothing).
#[no_mangle]
pub unsafe extern "C" fn sluice_group_bound_free(bound: *mut SluiceGroupBound) {
    guard("sluice_group_bound_free", || {
        let _entered = runtime::enter()?;
        // SAFETY: the caller gives up a handle (or NULL).
        drop(unsafe { take(bound) });
        Ok(SLUICE_OK)
    });
}

/// Forms group `name` as rank `rank` of `world` from every rank's address (`addresses[r]` is
/// rank `r`'s, as its `sluice_group_bound_address` said; this rank's own entry is not read):
/// every rank calls it with the same name and addresses. Blocks until this rank's pipes to
/// every other are up, or `timeout_ms` has passed (`SLUICE_TIMEOUT`); every later wait in the
/// group has the same limit. `bound` is consumed (also on error, whenever it is not NULL). On
/// success `*out` is the group (free it with `sluice_group_free`); on error it is NULL.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_form(
    bound: *mut SluiceGroupBound,
    name: *const c_char,
    rank: u32,
    world: u32,
    addresses: *const *const c_char,
    timeout_ms: u64,
    out: *mut *mut SluiceGroup,
) -> c_int {
    guard("sluice_group_form", || {
        // SAFETY: the caller gives up a handle (or NULL).
        let bound = unsafe { take(bound) }.ok_or_else(|| Error::invalid("bound is NULL"))?;
        // SAFETY: the caller passes a writable `sluice_group*` place or NULL.
        let out = unsafe { out_handle(out, "out") }?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let name = unsafe { opt_str(name, "name") }?.ok_or_else(|| Error::invalid("name is NULL"))?;
        if addresses.is_null() {
            return Err(Error::invalid("addresses is NULL"));
        }
        if rank >= world {
            return Err(Error::invalid(format!("rank {rank} in a world of {world}")));
        }
        let addresses = (0..world as usize)
            .map(|r| {
                // SAFETY: the caller passes `world` string pointers.
                let p = unsafe { *addresses.add(r) };
                if r == rank as usize {
                    return Ok(String::new());
                }
                // SAFETY: each entry is a NUL-terminated string or NULL.
                unsafe { opt_str(p, "an address") }?
                    .map(str::to_owned)
                    .ok_or_else(|| Error::invalid(format!("rank {r}'s address is NULL")))
            })
            .collect::<Result<Vec<_>>>()?;
        give(
            out,
            bound.form(name, rank, &addresses, Duration::from_millis(timeout_ms))?,
        );
        Ok(SLUICE_OK)
    })
}

/// This rank's number in the group (0 if `group` is NULL).
#[no_mangle]
pub unsafe extern "C" fn sluice_group_rank(group: *const SluiceGroup) -> u32 {
    // SAFETY: the caller passes a live group or NULL.
    guard_or(
        "sluice_group_rank",
        |_| 0,
        || Ok(unsafe { handle(group, "group") }?.rank()),
    )
}

/// The number of ranks in the group (0 if `group` is NULL).
#[no_mangle]
pub unsafe extern "C" fn sluice_group_world_size(group: *const SluiceGroup) -> u32 {
    // SAFETY: the caller passes a live group or NULL.
    guard_or(
        "sluice_group_world_size",
        |_| 0,
        || Ok(unsafe { handle(group, "group") }?.world_size()),
    )
}

/// Fails the group on every rank: each pending and later operation ends with an error that
/// carries `why` (NULL: no reason).
#[no_mangle]
pub unsafe extern "C" fn sluice_group_abort(group: *const SluiceGroup, why: *const c_char) -> c_int {
    guard("sluice_group_abort", || {
        // SAFETY: the caller passes a live group or NULL.
        let group = unsafe { handle(group, "group") }?;
        // SAFETY: the caller passes a NUL-terminated string or NULL.
        let why = unsafe { opt_str(why, "why") }?.unwrap_or("aborted");
        group.abort(why)?;
        Ok(SLUICE_OK)
    })
}

/// Leaves the group with the others: blocks until every rank has called it (then the pipes
/// close), or returns the error that failed the group. Free the handle afterwards.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_close(group: *const SluiceGroup) -> c_int {
    guard("sluice_group_close", || {
        // SAFETY: the caller passes a live group or NULL.
        unsafe { handle(group, "group") }?.close()?;
        Ok(SLUICE_OK)
    })
}

/// Frees a group (NULL: nothing). Without `sluice_group_close` first, the pipes close at once
/// and the other ranks see this one lost. Operations still pending finish with an error.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_free(group: *mut SluiceGroup) {
    guard("sluice_group_free", || {
        let _entered = runtime::enter()?;
        // SAFETY: the caller gives up a group handle (or NULL).
        drop(unsafe { take(group) });
        Ok(SLUICE_OK)
    });
}

/// The operation's pieces, checked: the group and the completion.
///
/// # Safety
/// `group` is NULL or live; `done` is callable once with `user` from any thread.
unsafe fn op_parts<'a>(
    group: *const SluiceGroup,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> Result<(&'a SluiceGroup, Done)> {
    // SAFETY: forwarded contract.
    let group = unsafe { handle(group, "group") }?;
    if done.is_none() {
        return Err(Error::invalid("done is NULL (a collective's end must be heard)"));
    }
    // SAFETY: forwarded contract.
    Ok((group, unsafe { Done::new(done, user) }))
}

/// A buffer argument lent to an operation.
///
/// # Safety
/// `Region::new`'s contract until the operation's `done` has been called.
unsafe fn region(p: *mut c_void, len: usize, what: &str) -> Result<Region> {
    if p.is_null() && len > 0 {
        return Err(Error::invalid(format!("{what} is NULL with length {len}")));
    }
    // SAFETY: forwarded contract.
    Ok(unsafe { Region::new(p.cast(), len) })
}

/// Every rank's `buf` (`len` bytes of `dtype`) becomes `op` (`SLUICE_REDUCE_*`) over all ranks'
/// `buf`s: the same bytes on every rank. f16 and bf16 are accumulated in f32.
///
/// Conventions of every collective below: it returns at once; `done(status, user)` is called
/// once on a library thread when it has finished (`SLUICE_OK`, or the error, whose message is
/// `sluice_last_error()` inside `done`; a lost rank is `SLUICE_PEER_LOST` naming it). Until
/// then the buffers belong to the operation: keep them alive and untouched. Every rank calls
/// the group's collectives in the same order, with matching sizes (a mismatch is an error,
/// never a hang). If the call itself returns an error, `done` is not called. An input may
/// overlap its output (it is copied first).
#[no_mangle]
pub unsafe extern "C" fn sluice_group_all_reduce(
    group: *const SluiceGroup,
    buf: *mut c_void,
    len: usize,
    dt: DLDataType,
    op: c_int,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    let which = |d, o| One::AllReduce(d, o);
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        one_buffer(
            "sluice_group_all_reduce",
            group,
            buf,
            len,
            Some((dt, op)),
            which,
            done,
            user,
        )
    }
}

/// Rank `root`'s `buf` is copied into every other rank's `buf` (`len` bytes everywhere). See
/// `sluice_group_all_reduce` for the conventions.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_broadcast(
    group: *const SluiceGroup,
    root: u32,
    buf: *mut c_void,
    len: usize,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    let which = |_, _| One::Broadcast(root);
    // SAFETY: the caller's contract, forwarded.
    unsafe { one_buffer("sluice_group_broadcast", group, buf, len, None, which, done, user) }
}

/// Rank `root`'s `buf` becomes `op` over all ranks' `buf`s; the others' are left as they were.
/// See `sluice_group_all_reduce` for the conventions.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn sluice_group_reduce(
    group: *const SluiceGroup,
    root: u32,
    buf: *mut c_void,
    len: usize,
    dt: DLDataType,
    op: c_int,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    let which = move |d, o| One::Reduce(root, d, o);
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        one_buffer(
            "sluice_group_reduce",
            group,
            buf,
            len,
            Some((dt, op)),
            which,
            done,
            user,
        )
    }
}

/// Which collective a one-buffer call is.
#[derive(Clone, Copy)]
enum One {
    AllReduce(sluice_collective::DType, sluice_collective::ReduceOp),
    Broadcast(u32),
    Reduce(u32, sluice_collective::DType, sluice_collective::ReduceOp),
}

/// The body of the collectives on one buffer, reduced in place or overwritten. `reduction`
/// (the C dtype and operation, checked here) is given to `which`; without one, `which` gets
/// placeholders it ignores.
///
/// # Safety
/// `group` is NULL or live; `buf` is lent as `Region::new` says until `done`; `done` is
/// callable once with `user` from any thread.
#[allow(clippy::too_many_arguments)]
unsafe fn one_buffer(
    name: &'static str,
    group: *const SluiceGroup,
    buf: *mut c_void,
    len: usize,
    reduction: Option<(DLDataType, c_int)>,
    which: impl FnOnce(sluice_collective::DType, sluice_collective::ReduceOp) -> One,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    guard(name, || {
        // SAFETY: forwarded contract.
        let (group, done) = unsafe { op_parts(group, done, user) }?;
        // SAFETY: forwarded contract.
        let mut buf = unsafe { region(buf, len, "buf") }?;
        let which = match reduction {
            Some((dt, op)) => which(dtype(dt)?, reduce_op(op)?),
            None => which(sluice_collective::DType::U8, sluice_collective::ReduceOp::Sum),
        };
        group.start(
            name,
            |g| async move {
                let b = buf.bytes_mut();
                match which {
                    One::AllReduce(dt, op) => g.all_reduce(b, dt, op).await,
                    One::Broadcast(root) => g.broadcast(root, b).await,
                    One::Reduce(root, dt, op) => g.reduce(root, b, dt, op).await,
                }
            },
            done,
        )?;
        Ok(SLUICE_OK)
    })
}

/// Which collective a two-buffer call is.
#[derive(Clone, Copy)]
enum Two {
    AllGather,
    Gather(u32),
    Scatter(u32),
    ReduceScatter(sluice_collective::DType, sluice_collective::ReduceOp),
}

/// The body of the collectives with an input and an output.
///
/// # Safety
/// `group` is NULL or live; `input` and `out` are lent as `Region::new` says until `done`;
/// `done` is callable once with `user` from any thread.
#[allow(clippy::too_many_arguments)]
unsafe fn two_buffers(
    name: &'static str,
    group: *const SluiceGroup,
    input: *const c_void,
    input_len: usize,
    out: *mut c_void,
    out_len: usize,
    which: Two,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    guard(name, || {
        // SAFETY: forwarded contract.
        let (group, done) = unsafe { op_parts(group, done, user) }?;
        // SAFETY: forwarded contract (the input is only read).
        let input = unsafe { region(input.cast_mut(), input_len, "input") }?;
        // SAFETY: forwarded contract.
        let mut out = unsafe { region(out, out_len, "out") }?;
        let input = input_apart(input, &out);
        group.start(
            name,
            |g| async move {
                let (i, o) = (input.bytes(), out.bytes_mut());
                match which {
                    Two::AllGather => g.all_gather(i, o).await,
                    Two::Gather(root) => g.gather(root, i, o).await,
                    Two::Scatter(root) => g.scatter(root, i, o).await,
                    Two::ReduceScatter(dt, op) => g.reduce_scatter(i, o, dt, op).await,
                }
            },
            done,
        )?;
        Ok(SLUICE_OK)
    })
}

/// `out` (`world × input_len` bytes) becomes every rank's `input`, in rank order. See
/// `sluice_group_all_reduce` for the conventions.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_all_gather(
    group: *const SluiceGroup,
    input: *const c_void,
    input_len: usize,
    out: *mut c_void,
    out_len: usize,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        two_buffers(
            "sluice_group_all_gather",
            group,
            input,
            input_len,
            out,
            out_len,
            Two::AllGather,
            done,
            user,
        )
    }
}

/// On `root`, `out` (`world × input_len` bytes) becomes every rank's `input` in rank order;
/// the other ranks pass `out_len` 0. See `sluice_group_all_reduce` for the conventions.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_gather(
    group: *const SluiceGroup,
    root: u32,
    input: *const c_void,
    input_len: usize,
    out: *mut c_void,
    out_len: usize,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        two_buffers(
            "sluice_group_gather",
            group,
            input,
            input_len,
            out,
            out_len,
            Two::Gather(root),
            done,
            user,
        )
    }
}

/// Rank `r`'s `out` becomes piece `r` of `root`'s `input` (`world × out_len` bytes; the other
/// ranks pass `input_len` 0). See `sluice_group_all_reduce` for the conventions.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_scatter(
    group: *const SluiceGroup,
    root: u32,
    input: *const c_void,
    input_len: usize,
    out: *mut c_void,
    out_len: usize,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        two_buffers(
            "sluice_group_scatter",
            group,
            input,
            input_len,
            out,
            out_len,
            Two::Scatter(root),
            done,
            user,
        )
    }
}

/// Rank `r`'s `out` becomes `op` over piece `r` of every rank's `input` (`world × out_len`
/// bytes). See `sluice_group_all_reduce` for the conventions.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn sluice_group_reduce_scatter(
    group: *const SluiceGroup,
    input: *const c_void,
    input_len: usize,
    out: *mut c_void,
    out_len: usize,
    dt: DLDataType,
    op: c_int,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    let which = match dtype(dt).and_then(|d| Ok(Two::ReduceScatter(d, reduce_op(op)?))) {
        Ok(w) => w,
        Err(e) => return guard("sluice_group_reduce_scatter", || Err(e)),
    };
    // SAFETY: the caller's contract, forwarded.
    unsafe {
        two_buffers(
            "sluice_group_reduce_scatter",
            group,
            input,
            input_len,
            out,
            out_len,
            which,
            done,
            user,
        )
    }
}

/// All-to-all: piece `j` of `input` (`send_lens[j]` bytes, pieces in rank order) goes to rank
/// `j`, and piece `i` of `out` (`recv_lens[i]` bytes) comes from rank `i`. Both arrays hold
/// `world` entries, read during this call; NULL for both: even pieces (`input_len / world`).
/// Rank `i`'s `send_lens[j]` must equal rank `j`'s `recv_lens[i]`. See
/// `sluice_group_all_reduce` for the conventions.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn sluice_group_all_to_all(
    group: *const SluiceGroup,
    input: *const c_void,
    input_len: usize,
    send_lens: *const usize,
    out: *mut c_void,
    out_len: usize,
    recv_lens: *const usize,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_group_all_to_all", || {
        // SAFETY: the caller's contract.
        let (group, done) = unsafe { op_parts(group, done, user) }?;
        let world = group.world_size() as usize;
        let lens = |p: *const usize, total: usize| -> Result<Vec<usize>> {
            if p.is_null() {
                if !total.is_multiple_of(world) {
                    return Err(Error::invalid(format!("{total} bytes in {world} even pieces")));
                }
                return Ok(vec![total / world; world]);
            }
            // SAFETY: the caller passes `world` entries.
            Ok(unsafe { std::slice::from_raw_parts(p, world) }.to_vec())
        };
        if send_lens.is_null() != recv_lens.is_null() {
            return Err(Error::invalid(
                "send_lens and recv_lens must both be given or both be NULL",
            ));
        }
        let (send, recv) = (lens(send_lens, input_len)?, lens(recv_lens, out_len)?);
        // SAFETY: the caller lends the buffers until `done` (the input only read).
        let input = unsafe { region(input.cast_mut(), input_len, "input") }?;
        // SAFETY: as above.
        let mut out = unsafe { region(out, out_len, "out") }?;
        let input = input_apart(input, &out);
        group.start(
            "sluice_group_all_to_all",
            |g| async move { g.all_to_all_v(input.bytes(), &send, out.bytes_mut(), &recv).await },
            done,
        )?;
        Ok(SLUICE_OK)
    })
}

/// Finishes once every rank has called it. See `sluice_group_all_reduce` for the conventions.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_barrier(
    group: *const SluiceGroup,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_group_barrier", || {
        // SAFETY: the caller's contract.
        let (group, done) = unsafe { op_parts(group, done, user) }?;
        group.start("sluice_group_barrier", |g| async move { g.barrier().await }, done)?;
        Ok(SLUICE_OK)
    })
}

/// Sends `len` bytes at `data` to rank `to` under `tag`, matched by that rank's
/// `sluice_group_recv` from this rank with the same tag, in the order sent. The bytes are
/// copied during this call. `done` runs once they are on their way. Point-to-point messages do
/// not take a place in the collectives' order.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_send(
    group: *const SluiceGroup,
    to: u32,
    tag: u64,
    data: *const c_void,
    len: usize,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_group_send", || {
        // SAFETY: the caller's contract.
        let (group, done) = unsafe { op_parts(group, done, user) }?;
        // SAFETY: `len` readable bytes at `data` during the call.
        let data = bytes::Bytes::copy_from_slice(unsafe { super::bytes(data.cast(), len, "data") }?);
        group.start(
            "sluice_group_send",
            |g| async move { g.send(to, tag, data).await },
            done,
        )?;
        Ok(SLUICE_OK)
    })
}

/// Receives the next message rank `from` sent under `tag` into `buf`, which must be exactly as
/// long as the message (else `SLUICE_INVALID_ARGUMENT` naming both lengths). See
/// `sluice_group_all_reduce` for the conventions.
#[no_mangle]
pub unsafe extern "C" fn sluice_group_recv(
    group: *const SluiceGroup,
    from: u32,
    tag: u64,
    buf: *mut c_void,
    len: usize,
    done: SluiceDoneFn,
    user: *mut c_void,
) -> c_int {
    guard("sluice_group_recv", || {
        // SAFETY: the caller's contract.
        let (group, done) = unsafe { op_parts(group, done, user) }?;
        // SAFETY: the caller lends `len` bytes until `done`.
        let mut buf = unsafe { region(buf, len, "buf") }?;
        group.start(
            "sluice_group_recv",
            |g| async move {
                let got = g.recv(from, tag).await?;
                if got.len() != buf.len() {
                    return Err(sluice_collective::CollectiveError::Invalid(format!(
                        "rank {from} sent {} bytes under tag {tag} into a buffer of {}",
                        got.len(),
                        buf.len()
                    )));
                }
                buf.bytes_mut().copy_from_slice(&got);
                Ok(())
            },
            done,
        )?;
        Ok(SLUICE_OK)
    })
}
