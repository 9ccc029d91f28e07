//! Collective groups through the C API, ranks as threads of one process: forming from
//! addresses exchanged by the caller, reductions checked against a reference, an allgather
//! whose input lies inside its output, an uneven all-to-all, tagged point-to-point messages,
//! and the errors (mismatched sizes, a wrong receive length, an abort) reaching every rank.
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::ffi::{c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::{Arc, Barrier, Condvar, Mutex};

use common::*;
use sluice_c::*;
use sluice_dlpack::DType;

/// A completion heard through `done`: the status and the last error inside the callback.
#[derive(Default)]
struct Heard {
    got: Mutex<Option<(c_int, String)>>,
    cv: Condvar,
}

unsafe extern "C" fn heard(status: c_int, user: *mut c_void) {
    // SAFETY: `user` is the `Arc<Heard>` given up by `start` below, taken back once here.
    let h = unsafe { Arc::from_raw(user as *const Heard) };
    *h.got.lock().unwrap() = Some((status, last_error()));
    h.cv.notify_all();
}

/// Starts an operation with a fresh completion and waits for it.
fn run(start: impl FnOnce(SluiceDoneFn, *mut c_void) -> c_int) -> (c_int, String) {
    let h = Arc::new(Heard::default());
    let user = Arc::into_raw(h.clone()) as *mut c_void;
    let rc = start(Some(heard), user);
    if rc != SLUICE_OK {
        // SAFETY: not handed to the library after all: take it back.
        drop(unsafe { Arc::from_raw(user as *const Heard) });
        return (rc, last_error());
    }
    let mut got = h.got.lock().unwrap();
    while got.is_none() {
        got = h.cv.wait(got).unwrap();
    }
    got.take().unwrap()
}

/// Forms a group of `world` ranks (threads), each running `body(rank, group)`.
fn with_group(name: &str, world: u32, body: impl Fn(u32, *const SluiceGroup) + Sync) {
    let addresses = Mutex::new(vec![String::new(); world as usize]);
    let published = Barrier::new(world as usize);
    // Every rank is done before any frees its group (freeing closes the pipes at once, which the
    // others would see as that rank lost, possibly before an abort it sent reaches them).
    let finished = Barrier::new(world as usize);
    std::thread::scope(|s| {
        for rank in 0..world {
            let (addresses, published, finished, body) = (&addresses, &published, &finished, &body);
            s.spawn(move || {
                let mut ctx = null_mut();
                let mut bound = null_mut();
                let mut group = null_mut();
                // SAFETY: valid out-places; NULL names the defaults.
                unsafe {
                    ok(
                        sluice_context_new(std::ptr::null(), std::ptr::null(), &mut ctx),
                        "context",
                    );
                    ok(sluice_group_bind(ctx, std::ptr::null(), &mut bound), "bind");
                }
                // SAFETY: a live bound listener's address.
                let addr = unsafe { CStr::from_ptr(sluice_group_bound_address(bound)) };
                addresses.lock().unwrap()[rank as usize] = addr.to_str().unwrap().to_owned();
                published.wait();
                let all: Vec<_> = addresses.lock().unwrap().iter().map(|a| cstring(a)).collect();
                let ptrs: Vec<_> = all.iter().map(|a| a.as_ptr()).collect();
                let n = cstring(name);
                // SAFETY: `world` address strings, a live bound handle given up, a valid out.
                ok(
                    unsafe { sluice_group_form(bound, n.as_ptr(), rank, world, ptrs.as_ptr(), 20_000, &mut group) },
                    "form",
                );
                body(rank, group);
                finished.wait();
                // SAFETY: live handles, freed once.
                unsafe {
                    sluice_group_free(group);
                    sluice_context_free(ctx);
                }
            });
        }
    });
}

fn dl(d: DType) -> DLDataType {
    d.to_dl()
}

#[test]
fn reductions_gathers_and_all_to_all_match_a_reference() {
    watchdog("reductions_gathers_and_all_to_all_match_a_reference");
    let world = 3;
    with_group("c-ref", world, |rank, g| {
        // SAFETY: a live group.
        let (r, w) = unsafe { (sluice_group_rank(g), sluice_group_world_size(g)) };
        assert_eq!((r, w), (rank, world));
        // Small (direct) and large (ring) sums.
        for n in [1usize, 1000, 300_001] {
            let mut v: Vec<f32> = (0..n).map(|i| (i % 97) as f32 + rank as f32).collect();
            let (rc, e) = run(|d, u| {
                // SAFETY: `v` outlives the operation (run waits for it).
                unsafe {
                    sluice_group_all_reduce(g, v.as_mut_ptr().cast(), n * 4, dl(DType::F32), SLUICE_REDUCE_SUM, d, u)
                }
            });
            ok(rc, &e);
            for (i, x) in v.iter().enumerate() {
                assert_eq!(*x, 3.0 * (i % 97) as f32 + 3.0, "element {i} of {n}");
            }
        }
        // Max over i32.
        let mut m = [rank as i32 * 10 - 5, -(rank as i32)];
        // SAFETY: `m` outlives the operation.
        let (rc, e) = run(|d, u| unsafe {
            sluice_group_all_reduce(g, m.as_mut_ptr().cast(), 8, dl(DType::I32), SLUICE_REDUCE_MAX, d, u)
        });
        ok(rc, &e);
        assert_eq!(m, [15, 0]);
        // An allgather whose input is this rank's piece of the output (copied first).
        let mut out = vec![0u8; 4 * world as usize];
        out[rank as usize * 4..rank as usize * 4 + 4].copy_from_slice(&[rank as u8 + 1; 4]);
        let input = out[rank as usize * 4..].as_ptr();
        // SAFETY: both regions inside `out`, which outlives the operation.
        let (rc, e) = run(|d, u| unsafe {
            sluice_group_all_gather(g, input.cast(), 4, out.as_mut_ptr().cast(), out.len(), d, u)
        });
        ok(rc, &e);
        assert_eq!(out, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
        // Uneven all-to-all: rank i sends (i + j + 1) bytes of value 10 i + j to rank j.
        let send_lens: Vec<usize> = (0..world).map(|j| (rank + j + 1) as usize).collect();
        let recv_lens: Vec<usize> = (0..world).map(|i| (i + rank + 1) as usize).collect();
        let input: Vec<u8> = (0..world)
            .flat_map(|j| std::iter::repeat_n((10 * rank + j) as u8, (rank + j + 1) as usize))
            .collect();
        let mut got = vec![0u8; recv_lens.iter().sum()];
        // SAFETY: buffers and length arrays outlive the operation.
        let (rc, e) = run(|d, u| unsafe {
            sluice_group_all_to_all(
                g,
                input.as_ptr().cast(),
                input.len(),
                send_lens.as_ptr(),
                got.as_mut_ptr().cast(),
                got.len(),
                recv_lens.as_ptr(),
                d,
                u,
            )
        });
        ok(rc, &e);
        let want: Vec<u8> = (0..world)
            .flat_map(|i| std::iter::repeat_n((10 * i + rank) as u8, (i + rank + 1) as usize))
            .collect();
        assert_eq!(got, want);
        // Tagged point-to-point around the ring, tags kept apart.
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        for tag in [7u64, 8] {
            let msg = [rank as u8, tag as u8];
            // SAFETY: copied during the call.
            let (rc, e) = run(|d, u| unsafe { sluice_group_send(g, next, tag, msg.as_ptr().cast(), 2, d, u) });
            ok(rc, &e);
        }
        for tag in [8u64, 7] {
            let mut b = [0u8; 2];
            // SAFETY: `b` outlives the operation.
            let (rc, e) = run(|d, u| unsafe { sluice_group_recv(g, prev, tag, b.as_mut_ptr().cast(), 2, d, u) });
            ok(rc, &e);
            assert_eq!(b, [prev as u8, tag as u8]);
        }
        // SAFETY: a live group.
        let (rc, e) = run(|d, u| unsafe { sluice_group_barrier(g, d, u) });
        ok(rc, &e);
        // SAFETY: a live group; every rank closes.
        ok(unsafe { sluice_group_close(g) }, "close");
    });
}

#[test]
fn mismatches_and_aborts_are_errors_on_every_rank() {
    watchdog("mismatches_and_aborts_are_errors_on_every_rank");
    with_group("c-errors", 2, |rank, g| {
        // A receive into a buffer of the wrong length names both lengths.
        if rank == 0 {
            let msg = [1u8; 5];
            // SAFETY: copied during the call.
            let (rc, e) = run(|d, u| unsafe { sluice_group_send(g, 1, 3, msg.as_ptr().cast(), 5, d, u) });
            ok(rc, &e);
        } else {
            let mut b = [0u8; 4];
            // SAFETY: `b` outlives the operation.
            let (rc, e) = run(|d, u| unsafe { sluice_group_recv(g, 0, 3, b.as_mut_ptr().cast(), 4, d, u) });
            assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "{e}");
            assert!(e.contains("5 bytes") && e.contains("buffer of 4"), "{e}");
        }
        // Arguments refused at the call: an unknown reduction, no callback.
        let mut x = [0f32; 2];
        // SAFETY: refused before anything is lent.
        let rc = unsafe {
            sluice_group_all_reduce(g, x.as_mut_ptr().cast(), 8, dl(DType::F32), 99, Some(heard), null_mut())
        };
        assert_eq!(rc, SLUICE_INVALID_ARGUMENT);
        assert!(last_error().contains("unknown reduction 99"), "{}", last_error());
        // SAFETY: refused before anything is lent.
        let rc = unsafe { sluice_group_barrier(g, None, null_mut()) };
        assert_eq!(rc, SLUICE_INVALID_ARGUMENT);
        // Sizes that differ across ranks: an error on the ranks that see it, never a hang.
        let n = if rank == 0 { 4 } else { 6 };
        let mut v = vec![1f32; n];
        // SAFETY: `v` outlives the operation.
        let (rc, e) = run(|d, u| unsafe {
            sluice_group_all_reduce(g, v.as_mut_ptr().cast(), n * 4, dl(DType::F32), SLUICE_REDUCE_SUM, d, u)
        });
        assert_eq!(rc, SLUICE_INVALID_ARGUMENT, "{e}");
        assert!(e.contains("sizes differ"), "{e}");
        // An abort ends the next operation on every rank with its reason.
        if rank == 1 {
            let why = cstring("rank 1 gives up");
            // SAFETY: a live group and a valid string.
            ok(unsafe { sluice_group_abort(g, why.as_ptr()) }, "abort");
        }
        let mut v = [1f32; 4];
        // SAFETY: `v` outlives the operation.
        let (rc, e) = run(|d, u| unsafe {
            sluice_group_all_reduce(g, v.as_mut_ptr().cast(), 16, dl(DType::F32), SLUICE_REDUCE_SUM, d, u)
        });
        assert_eq!(rc, SLUICE_CLOSED, "{e}");
        assert!(e.contains("rank 1 gives up"), "rank {rank}: {e}");
    });
}
