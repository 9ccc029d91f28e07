//! One copy per byte for ranks of one host: each rank reads what it needs straight out of the
//! other ranks' buffers by cross-memory attach (`process_vm_readv`), instead of having it copied
//! into a pipe's segment and out again.
//!
//! Used for buffers of at least [`LOCAL_MIN`](crate::LOCAL_MIN) bytes when every rank's pipes
//! to every other carry CPU tensors by cross-memory attach (the pipe's `cma` channel was
//! negotiated, which proves each side may read the other's memory). Every rank decides the same
//! way: the first step of each such collective is a *plan* from every rank to every other (its
//! buffer's address and length, and whether it can read all of its peers); only if all can do
//! they read, otherwise they go on with the ring (whose steps follow the plan in the same
//! mailbox slots, in order).
//!
//! allreduce (reduce-scatter then allgather, as NCCL and MPI do on one node):
//! 1. rank `r` reduces piece `r` of the buffer: it reads piece `r` of every rank's buffer in
//!    cache-sized chunks and combines them, in rank order, into its own piece `r` (each element
//!    is reduced once, by one rank, so every rank ends with the same bytes);
//! 2. a round of *done* messages: every piece is reduced;
//! 3. rank `r` reads every other rank's finished piece into its own buffer;
//! 4. *done* again: nobody reads anybody's buffer any more;
//! 5. *release*: a rank sends it once it has everyone's last *done*.
//!
//! Each rank reads (n − 1)/n of the buffer twice and writes nothing into another process.
//!
//! The kernel pins every page it copies across processes, and with 4 KiB pages the pinning
//! costs more than the copy; so a buffer exposed a second time (DDP's buckets, any reused
//! buffer of at least 4 MiB) is first backed with huge pages (`MADV_COLLAPSE`, once per buffer;
//! `SLUICE_COLLECTIVE_HUGE_PAGES=0` turns it off). Measured on the 2-core VM, allreduce of
//! 64 MiB over 2 ranks: 20 ms from 4 KiB pages, 13 ms from huge ones.
//!
//! **Why the release round**: a rank's buffer is read by the others while it waits. A rank that
//! stops waiting early (its timeout, a lost peer) hands its buffer back to its caller, who may
//! change it while a peer is still reading; that peer would then finish with wrong bytes. So a
//! rank succeeds only once every other rank has released, which each does only after everyone
//! said they finished reading it; a rank that stops early never releases, and a rank that fails
//! here fails the whole group (the others learn of it at once), and so does a collective whose
//! future is dropped after its plan went out (a guard's `Drop`). Reads and reductions run
//! through `block_in_place` on a multi-threaded runtime, so the runtime's other tasks (the
//! pipes' readers among them) go on meanwhile. Huge pages are given after the release round,
//! so no peer waits on them. Reads only ever copy *from*
//! another process, so a peer's mistake cannot corrupt this one's memory; addresses and lengths
//! from a peer are checked (lengths must equal ours) and read from that peer's own process
//! only (its id comes from the pipe's negotiation, not from the plan).

use std::ops::Range;

use sluice_channel::channel::cma::read_remote;

use crate::reduce::{self, ReduceOp};
use crate::{CollectiveError, DType, Op, Result};

/// Plans are this long: magic, whether the sender can read every peer, the exposed buffer's
/// address and length.
const PLAN: usize = 32;
const PLAN_MAGIC: u32 = u32::from_le_bytes(*b"PLAN");

/// Reductions read this much of each peer at a time (a multiple of every element size, small
/// enough to stay in cache while it is combined).
const CHUNK: usize = 256 << 10;

/// Plans travel on a step of their own, never the data steps of the direct and ring algorithms
/// (those use at most 2 (n - 1) < 0xFFFF): a rank on another path (sizes that differ across
/// ranks) never takes a plan for data. It then waits for data that never comes and fails at the
/// group's timeout, as the planning ranks do waiting for its plan.
const PLAN_STEP: u32 = 0xFFFF;

/// The steps after the plan.
const DONE: u32 = 1;
const DONE_AGAIN: u32 = 2;
const RELEASE: u32 = 3;

/// Every rank's process and exposed buffer, by rank (this rank's own entry is itself).
pub(crate) struct Peers {
    me: u32,
    pids: Vec<i32>,
    addrs: Vec<u64>,
}

impl Peers {
    /// Copies `dst.len()` bytes at `offset` in rank `r`'s exposed buffer into `dst`.
    fn read(&self, r: u32, offset: usize, dst: &mut [u8]) -> Result<()> {
        let at = self.addrs[r as usize].wrapping_add(offset as u64);
        read_remote(self.pids[r as usize], at, dst).map_err(|e| CollectiveError::Peer {
            rank: Some(r),
            detail: format!(
                "reading {} bytes of its buffer at {at:#x} (process {}): {e}",
                dst.len(),
                self.pids[r as usize]
            ),
        })
    }
}

fn encode_plan(capable: bool, exposed: &[u8]) -> [u8; PLAN] {
    let mut b = [0u8; PLAN];
    b[0..4].copy_from_slice(&PLAN_MAGIC.to_le_bytes());
    b[4] = u8::from(capable);
    b[8..16].copy_from_slice(&(exposed.as_ptr() as u64).to_le_bytes());
    b[16..24].copy_from_slice(&(exposed.len() as u64).to_le_bytes());
    b
}

/// The first step of a collective that may read its peers: every rank tells every other where
/// its `exposed` buffer lies. Returns the plan (the peers to read, and the guard that fails the
/// group if this collective is abandoned while they may read this rank) when every rank can
/// read every other, `None` when some cannot (then every rank goes on with the ring). Buffers
/// of differing lengths are an error on every rank.
pub(crate) async fn plan<'a>(op: &'a Op, exposed: &[u8]) -> Result<Option<Plan<'a>>> {
    let mesh = &op.mesh;
    let (me, n) = (mesh.rank, mesh.world);
    // From the moment the plan leaves, peers may read `exposed`.
    let guard = Abandoned { op, armed: true };
    let mine = encode_plan(mesh.pids.is_some(), exposed);
    let sends: Vec<_> = (0..n).filter(|&r| r != me).map(|r| (r, PLAN_STEP, &mine[..])).collect();
    let (sent, got) = tokio::join!(crate::algorithm::send_all(op, sends), async {
        let mut got = Vec::with_capacity(n as usize);
        for r in (0..n).filter(|&r| r != me) {
            got.push((r, op.recv(r, PLAN_STEP, PLAN).await?));
        }
        Ok::<_, CollectiveError>(got)
    });
    // A rank that gave up waiting for a plan may already be read by those that have them all:
    // it fails the group rather than hand its buffer back quietly.
    let got = match (sent, got) {
        (Err(CollectiveError::Timeout(w)), _) | (_, Err(CollectiveError::Timeout(w))) => {
            guard.disarm();
            return Err(fail_group(op, CollectiveError::Timeout(w)));
        }
        (Err(e), _) | (_, Err(e)) => {
            // Lost peers and aborts have failed the group already; a plan of the wrong length
            // (a peer on another path: sizes differ) leaves nobody reading this rank.
            guard.disarm();
            return Err(e);
        }
        (Ok(()), Ok(got)) => got,
    };
    let mut addrs = vec![exposed.as_ptr() as u64; n as usize];
    let mut all = mesh.pids.is_some();
    for (r, b) in got {
        let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        if b[0..4] != PLAN_MAGIC.to_le_bytes() || b[4] > 1 {
            guard.disarm();
            let e = CollectiveError::Peer {
                rank: Some(r),
                detail: format!("sent a malformed plan {:02x?}", &b[..8]),
            };
            return Err(fail_group(op, e));
        }
        if word(16) != exposed.len() as u64 {
            // Every honest rank sees a mismatch too (its length differs from one of the two),
            // so none reads: the group goes on. (A peer telling ranks different lengths is
            // caught by the release round: whoever read waits for a release that never comes.)
            guard.disarm();
            return Err(CollectiveError::Invalid(format!(
                "rank {r}'s buffer is {} bytes where rank {me}'s is {} (buffer sizes differ across ranks?)",
                word(16),
                exposed.len()
            )));
        }
        all &= b[4] == 1;
        addrs[r as usize] = word(8);
    }
    Ok(match (&mesh.pids, all) {
        (Some(pids), true) => {
            mesh.local_ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(Plan {
                peers: Peers {
                    me,
                    pids: pids.clone(),
                    addrs,
                },
                guard,
            })
        }
        _ => {
            guard.disarm();
            None
        }
    })
}

/// What [`plan`] found: the peers to read, and the guard to disarm once the collective is done.
pub(crate) struct Plan<'a> {
    peers: Peers,
    guard: Abandoned<'a>,
}

/// Fails the group when dropped armed: a collective whose future is dropped after its plan went
/// out hands its buffer back while peers may still read it; failing the group at once tells
/// them (they would otherwise wait out their timeout for its release).
struct Abandoned<'a> {
    op: &'a Op,
    armed: bool,
}

impl Abandoned<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if self.armed {
            let why = format!(
                "rank {} abandoned a collective while its peers could read its buffer (its future was dropped)",
                self.op.mesh.rank
            );
            fail_group(self.op, CollectiveError::Invalid(why));
        }
    }
}

/// Runs `f` (a blocking read or reduction) where it does not hold up the runtime's other tasks:
/// through `block_in_place` on a multi-threaded runtime, inline elsewhere.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Fails the group with `e` (telling the others) and returns the group's error.
fn fail_group(op: &Op, e: CollectiveError) -> CollectiveError {
    if op.mesh.fail(e.clone()) {
        op.mesh.tell_others(op.mesh.rank, &e.to_string());
    }
    op.mesh.failed().unwrap_or(e)
}

/// An empty message to every other rank as `step`, then one from every other rank.
async fn round(op: &Op, step: u32) -> Result<()> {
    let me = op.mesh.rank;
    let sends = (0..op.mesh.world)
        .filter(|&r| r != me)
        .map(|r| (r, step, &[][..]))
        .collect();
    crate::algorithm::send_all(op, sends).await?;
    for r in (0..op.mesh.world).filter(|&r| r != me) {
        op.recv(r, step, 0).await?;
    }
    Ok(())
}

/// The last two rounds: this rank has finished reading; once everyone has, it releases its
/// buffer, and it returns once everyone has released theirs.
async fn finish(op: &Op, done: u32) -> Result<()> {
    round(op, done).await?;
    round(op, RELEASE).await
}

/// `dst` becomes, chunk by chunk, the reduction in rank order of every rank's bytes at
/// `offset` in its exposed buffer, this rank's own taken from `own` (or from `dst` itself
/// when `own` is `None`: in place). Nothing is copied but the peers' bytes (each read once, a
/// chunk at a time, into a buffer that stays in cache): in place, the ranks before this one are
/// folded together first, then into `dst` from the left.
fn reduce_from(
    peers: &Peers,
    offset: usize,
    dst: &mut [u8],
    own: Option<&[u8]>,
    dtype: DType,
    rop: ReduceOp,
) -> Result<()> {
    let n = peers.pids.len() as u32;
    let me = peers.me;
    let mut theirs = vec![0u8; CHUNK.min(dst.len())];
    let mut before = if own.is_none() && me > 0 {
        theirs.clone()
    } else {
        Vec::new()
    };
    for (i, d) in dst.chunks_mut(CHUNK).enumerate() {
        let at = offset + i * CHUNK;
        let theirs = &mut theirs[..d.len()];
        match own {
            // Rank 0's bytes, then the others' up to this one, then this one's.
            Some(o) => {
                let o = &o[i * CHUNK..i * CHUNK + d.len()];
                if me == 0 {
                    d.copy_from_slice(o);
                } else {
                    peers.read(0, at, d)?;
                    for r in 1..me {
                        peers.read(r, at, theirs)?;
                        reduce::combine(d, theirs, dtype, rop);
                    }
                    reduce::combine(d, o, dtype, rop);
                }
            }
            // `d` holds this rank's bytes: the ranks before it go into `before`, then `before`
            // into `d` (on its left).
            None if me > 0 => {
                let before = &mut before[..d.len()];
                peers.read(0, at, before)?;
                for r in 1..me {
                    peers.read(r, at, theirs)?;
                    reduce::combine(before, theirs, dtype, rop);
                }
                reduce::combine_rev(d, before, dtype, rop);
            }
            None => {}
        }
        for r in me + 1..n {
            peers.read(r, at, theirs)?;
            reduce::combine(d, theirs, dtype, rop);
        }
    }
    Ok(())
}

/// Runs the reading part `f` of a collective planned as `plan`: an error fails the group (this
/// rank's buffer may still be read, and peers may wait for its release). Callers give the
/// buffer peers read huge pages for next time once this returns Ok (after the release, so no
/// peer waits on it).
async fn run<F: std::future::Future<Output = Result<()>>>(
    op: &Op,
    plan: Plan<'_>,
    f: impl FnOnce(Peers) -> F,
) -> Result<()> {
    let Plan { peers, guard } = plan;
    let r = f(peers).await.map_err(|e| fail_group(op, e));
    guard.disarm();
    r
}

/// allreduce in place (see the module's notes); `p` cuts the buffer into one piece per rank.
pub(crate) async fn all_reduce(
    op: &Op,
    plan: Plan<'_>,
    buf: &mut [u8],
    p: &[Range<usize>],
    dtype: DType,
    rop: ReduceOp,
) -> Result<()> {
    let n = p.len() as u32;
    let me = plan.peers.me as usize;
    run(op, plan, |peers| async {
        let peers = peers;
        let mine = p[me].clone();
        blocking(|| {
            reduce_from(&peers, mine.start, &mut buf[mine.clone()], None, dtype, rop)?;
            reduce::finish(&mut buf[mine], dtype, rop, n);
            Ok::<_, CollectiveError>(())
        })?;
        round(op, DONE).await?;
        blocking(|| {
            (0..n).filter(|&r| r as usize != me).try_for_each(|r| {
                let theirs = p[r as usize].clone();
                peers.read(r, theirs.start, &mut buf[theirs])
            })
        })?;
        finish(op, DONE_AGAIN).await
    })
    .await
    .inspect(|()| op.mesh.expose(buf))
}

/// reduce-scatter: `out` becomes the reduction of piece `me` of every rank's `input` (the
/// exposed buffer).
pub(crate) async fn reduce_scatter(
    op: &Op,
    plan: Plan<'_>,
    input: &[u8],
    out: &mut [u8],
    dtype: DType,
    rop: ReduceOp,
) -> Result<()> {
    let len = out.len();
    run(op, plan, |peers| async move {
        let me = peers.me as usize;
        let mine = &input[me * len..(me + 1) * len];
        blocking(|| {
            reduce_from(&peers, me * len, out, Some(mine), dtype, rop)?;
            reduce::finish(out, dtype, rop, peers.pids.len() as u32);
            Ok::<_, CollectiveError>(())
        })?;
        finish(op, DONE).await
    })
    .await
    .inspect(|()| op.mesh.expose(input))
}

/// allgather: piece `r` of `out` is read from rank `r`'s `input` (the exposed buffer).
pub(crate) async fn all_gather(op: &Op, plan: Plan<'_>, input: &[u8], out: &mut [u8]) -> Result<()> {
    let len = input.len();
    run(op, plan, |peers| async move {
        blocking(|| {
            out.chunks_mut(len).enumerate().try_for_each(|(r, piece)| {
                if r as u32 == peers.me {
                    piece.copy_from_slice(input);
                    Ok(())
                } else {
                    peers.read(r as u32, 0, piece)
                }
            })
        })?;
        finish(op, DONE).await
    })
    .await
    .inspect(|()| op.mesh.expose(input))
}

/// broadcast: every rank but the root reads the root's buffer (the exposed one).
pub(crate) async fn broadcast(op: &Op, plan: Plan<'_>, root: u32, buf: &mut [u8]) -> Result<()> {
    let me = plan.peers.me;
    run(op, plan, |peers| async {
        let peers = peers;
        if me != root {
            blocking(|| peers.read(root, 0, buf))?;
        }
        finish(op, DONE).await
    })
    .await
    // Only the root's buffer is read by the others.
    .inspect(|()| {
        if me == root {
            op.mesh.expose(buf)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_holds_the_buffer_it_describes() {
        let buf = vec![0u8; 1000];
        let b = encode_plan(true, &buf);
        assert_eq!(&b[0..4], b"PLAN");
        assert_eq!(b[4], 1);
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), buf.as_ptr() as u64);
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), 1000);
        assert_eq!(CHUNK % 16, 0, "chunks end on element boundaries");
    }
}
