//! How each collective moves its bytes.
//!
//! - **Direct** (buffers up to [`DIRECT_MAX`](crate::DIRECT_MAX), and every collective whose
//!   data has one source or one destination per piece: broadcast, gather, scatter, all-to-all,
//!   allgather, barrier): each rank sends what another needs straight to it, all sends at
//!   once: one step of latency. Reductions then combine the n contributions on every rank in
//!   rank order, so every rank computes the same bytes.
//! - **Ring** (allreduce, reduce and reduce-scatter above `DIRECT_MAX`): the buffer is cut into
//!   n pieces on element boundaries; in n − 1 steps each rank passes one piece to its right
//!   neighbour and combines the piece arriving from its left into its own copy (reduce-scatter),
//!   so each piece is reduced once, by a chain through every rank; allreduce then passes the
//!   finished pieces around the ring (allgather) and reduce sends them to the root. Each rank
//!   sends about 2 (n − 1) / n of the buffer and reduces (n − 1) / n of it, whatever n is.
//!
//! - **Local** (allreduce, reduce-scatter, allgather and broadcast from
//!   [`LOCAL_MIN`](crate::LOCAL_MIN) up, when every rank can read every other's memory): no
//!   messages but small plans and *done*s; each rank reads its peers' buffers itself (see
//!   [`crate::local`]).
//!
//! Otherwise the pieces travel through the pipes (a copy into the receiver's shared segment on
//! one host; TCP or RDMA across hosts).

use std::ops::Range;

use bytes::Bytes;

use crate::local;
use crate::reduce::{self, ReduceOp};
use crate::DType;
use crate::{Op, Result, DIRECT_MAX, LOCAL_MIN};

/// `n` ranges of bytes covering `len` bytes of `size`-byte elements, as even as whole elements
/// allow (the first ones one element longer).
pub(crate) fn pieces(len: usize, size: usize, n: usize) -> Vec<Range<usize>> {
    let elems = len / size;
    let (base, extra) = (elems / n, elems % n);
    let mut at = 0;
    (0..n)
        .map(|i| {
            let e = base + usize::from(i < extra);
            let r = at..at + e * size;
            at = r.end;
            r
        })
        .collect()
}

fn modn(x: i64, n: u32) -> usize {
    x.rem_euclid(n as i64) as usize
}

/// Sends each `(to, step, data)`, one after another: a write finishes once its bytes are on
/// their way (in the peer's ring or segment), so nothing waits on the peer here, and no task
/// hand-off is paid per message.
pub(crate) async fn send_all(op: &Op, sends: Vec<(u32, u32, &[u8])>) -> Result<()> {
    for (to, step, data) in sends {
        op.send(to, step, data).await?;
    }
    Ok(())
}

/// The other ranks, in order.
fn others(op: &Op) -> impl Iterator<Item = u32> + '_ {
    (0..op.mesh.world).filter(move |&r| r != op.mesh.rank)
}

pub(crate) async fn all_reduce(op: &Op, buf: &mut [u8], dtype: DType, rop: ReduceOp) -> Result<()> {
    let n = op.mesh.world;
    if n == 1 {
        reduce::finish(buf, dtype, rop, 1);
        return Ok(());
    }
    if buf.len() <= DIRECT_MAX || buf.len() / dtype.size() < n as usize {
        let all = exchange(op, buf).await?;
        combine_in_order(buf, &all, dtype, rop);
        return Ok(());
    }
    let p = pieces(buf.len(), dtype.size(), n as usize);
    if buf.len() >= LOCAL_MIN {
        if let Some(plan) = local::plan(op, buf).await? {
            return local::all_reduce(op, plan, buf, &p, dtype, rop).await;
        }
    }
    let me = op.mesh.rank as i64;
    ring_reduce_scatter(op, buf, &p, dtype, rop, 0).await?;
    // This rank now holds piece (me + 1) fully reduced.
    let mine = p[modn(me + 1, n)].clone();
    reduce::finish(&mut buf[mine], dtype, rop, n);
    let right = ((me + 1) % n as i64) as u32;
    let left = modn(me - 1, n) as u32;
    for s in 0..n as i64 - 1 {
        let (out, inn) = (modn(me + 1 - s, n), modn(me - s, n));
        let step = (n as i64 - 1 + s) as u32;
        let (sent, got) = tokio::join!(
            op.send(right, step, &buf[p[out].clone()]),
            op.recv(left, step, p[inn].len())
        );
        sent?;
        buf[p[inn].clone()].copy_from_slice(&got?);
    }
    Ok(())
}

/// The ring's reduce-scatter over `buf` cut into `p`: after it, this rank's piece
/// `rank + 1 + shift` (mod n) holds the reduction of that piece over every rank (not finished:
/// the average is not yet divided).
async fn ring_reduce_scatter(
    op: &Op,
    buf: &mut [u8],
    p: &[Range<usize>],
    dtype: DType,
    rop: ReduceOp,
    shift: i64,
) -> Result<()> {
    let n = op.mesh.world;
    let me = op.mesh.rank as i64;
    let right = ((me + 1) % n as i64) as u32;
    let left = modn(me - 1, n) as u32;
    for s in 0..n as i64 - 1 {
        let (out, inn) = (modn(me - s + shift, n), modn(me - s - 1 + shift, n));
        let (sent, got) = tokio::join!(
            op.send(right, s as u32, &buf[p[out].clone()]),
            op.recv(left, s as u32, p[inn].len())
        );
        sent?;
        reduce::combine(&mut buf[p[inn].clone()], &got?, dtype, rop);
    }
    Ok(())
}

/// The ring's reduce-scatter reading `input` (left unchanged) cut into `p`: `dst` becomes this
/// rank's piece `rank + 1 + shift` (mod n) reduced over every rank (not finished). Only the
/// pieces in flight are written (a copy of the whole input would cost a pass over it and, for a
/// fresh buffer, a page fault per 4 KiB); the last step reduces straight into `dst`.
async fn ring_reduce_scatter_from(
    op: &Op,
    input: &[u8],
    p: &[Range<usize>],
    dtype: DType,
    rop: ReduceOp,
    shift: i64,
    dst: &mut [u8],
) -> Result<()> {
    let n = op.mesh.world;
    let me = op.mesh.rank as i64;
    let right = ((me + 1) % n as i64) as u32;
    let left = modn(me - 1, n) as u32;
    let mut acc: Vec<u8> = Vec::new();
    for s in 0..n as i64 - 1 {
        let (out, inn) = (modn(me - s + shift, n), modn(me - s - 1 + shift, n));
        // The piece sent is the input's at first, then the one reduced the step before.
        let data: &[u8] = if s == 0 { &input[p[out].clone()] } else { &acc };
        let (sent, got) = tokio::join!(op.send(right, s as u32, data), op.recv(left, s as u32, p[inn].len()));
        sent?;
        let got = got?;
        let last = s == n as i64 - 2;
        let into: &mut [u8] = if last {
            dst
        } else {
            acc.clear();
            acc.resize(p[inn].len(), 0);
            &mut acc
        };
        into.copy_from_slice(&input[p[inn].clone()]);
        reduce::combine(into, &got, dtype, rop);
        if last {
            break;
        }
    }
    Ok(())
}

/// Sends `buf` to every other rank and returns every rank's buffer, in rank order (this rank's
/// as `None`).
async fn exchange(op: &Op, buf: &[u8]) -> Result<Vec<Option<Bytes>>> {
    let sends = others(op).map(|r| (r, 0, buf)).collect();
    let (sent, got) = tokio::join!(send_all(op, sends), recv_all(op, buf.len()));
    sent?;
    got
}

/// Step 0 from every other rank (`len` bytes each), in rank order, this rank's place `None`.
async fn recv_all(op: &Op, len: usize) -> Result<Vec<Option<Bytes>>> {
    let mut all = Vec::with_capacity(op.mesh.world as usize);
    for r in 0..op.mesh.world {
        all.push(if r == op.mesh.rank {
            None
        } else {
            Some(op.recv(r, 0, len).await?)
        });
    }
    Ok(all)
}

/// `buf` becomes the reduction of every rank's contribution in rank order (`None`: `buf`'s own).
fn combine_in_order(buf: &mut [u8], all: &[Option<Bytes>], dtype: DType, rop: ReduceOp) {
    let mut acc = match &all[0] {
        Some(b) => b.to_vec(),
        None => buf.to_vec(),
    };
    for c in &all[1..] {
        match c {
            Some(b) => reduce::combine(&mut acc, b, dtype, rop),
            None => reduce::combine(&mut acc, buf, dtype, rop),
        }
    }
    reduce::finish(&mut acc, dtype, rop, all.len() as u32);
    buf.copy_from_slice(&acc);
}

pub(crate) async fn broadcast(op: &Op, root: u32, buf: &mut [u8]) -> Result<()> {
    if buf.len() >= LOCAL_MIN && op.mesh.world > 1 {
        if let Some(plan) = local::plan(op, buf).await? {
            return local::broadcast(op, plan, root, buf).await;
        }
    }
    if op.mesh.rank == root {
        send_all(op, others(op).map(|r| (r, 0, &*buf)).collect()).await
    } else {
        let got = op.recv(root, 0, buf.len()).await?;
        buf.copy_from_slice(&got);
        Ok(())
    }
}

pub(crate) async fn reduce(op: &Op, root: u32, buf: &mut [u8], dtype: DType, rop: ReduceOp) -> Result<()> {
    let n = op.mesh.world;
    let me = op.mesh.rank;
    if n == 1 {
        reduce::finish(buf, dtype, rop, 1);
        return Ok(());
    }
    if buf.len() <= DIRECT_MAX || buf.len() / dtype.size() < n as usize {
        if me != root {
            return op.send(root, 0, buf).await;
        }
        let all = recv_all(op, buf.len()).await?;
        combine_in_order(buf, &all, dtype, rop);
        return Ok(());
    }
    // The ring's reduce-scatter on a copy (only the root's buffer changes), then every rank
    // sends its finished piece to the root.
    let p = pieces(buf.len(), dtype.size(), n as usize);
    let mine = p[modn(me as i64 + 1, n)].clone();
    let mut acc = vec![0u8; mine.len()];
    ring_reduce_scatter_from(op, buf, &p, dtype, rop, 0, &mut acc).await?;
    let step = n - 1;
    reduce::finish(&mut acc, dtype, rop, n);
    if me != root {
        return op.send(root, step, &acc).await;
    }
    buf[mine].copy_from_slice(&acc);
    for r in others(op) {
        let theirs = p[modn(r as i64 + 1, n)].clone();
        let got = op.recv(r, step, theirs.len()).await?;
        buf[theirs].copy_from_slice(&got);
    }
    Ok(())
}

pub(crate) async fn all_gather(op: &Op, input: &[u8], out: &mut [u8]) -> Result<()> {
    if out.len() >= LOCAL_MIN && !input.is_empty() && op.mesh.world > 1 {
        if let Some(plan) = local::plan(op, input).await? {
            return local::all_gather(op, plan, input, out).await;
        }
    }
    let all = exchange(op, input).await?;
    for (r, piece) in all.iter().enumerate() {
        let at = r * input.len()..(r + 1) * input.len();
        out[at].copy_from_slice(piece.as_deref().unwrap_or(input));
    }
    Ok(())
}

pub(crate) async fn gather(op: &Op, root: u32, input: &[u8], out: &mut [u8]) -> Result<()> {
    if op.mesh.rank != root {
        return op.send(root, 0, input).await;
    }
    let len = input.len();
    out[root as usize * len..(root as usize + 1) * len].copy_from_slice(input);
    for r in others(op) {
        let got = op.recv(r, 0, len).await?;
        out[r as usize * len..(r as usize + 1) * len].copy_from_slice(&got);
    }
    Ok(())
}

pub(crate) async fn scatter(op: &Op, root: u32, input: &[u8], out: &mut [u8]) -> Result<()> {
    let len = out.len();
    if op.mesh.rank != root {
        let got = op.recv(root, 0, len).await?;
        out.copy_from_slice(&got);
        return Ok(());
    }
    let sends = others(op)
        .map(|r| (r, 0, &input[r as usize * len..(r as usize + 1) * len]))
        .collect();
    out.copy_from_slice(&input[root as usize * len..(root as usize + 1) * len]);
    send_all(op, sends).await
}

pub(crate) async fn reduce_scatter(op: &Op, input: &[u8], out: &mut [u8], dtype: DType, rop: ReduceOp) -> Result<()> {
    let n = op.mesh.world;
    let me = op.mesh.rank;
    let len = out.len();
    let piece = |r: u32| r as usize * len..(r as usize + 1) * len;
    if n == 1 {
        out.copy_from_slice(input);
        reduce::finish(out, dtype, rop, 1);
        return Ok(());
    }
    if input.len() <= DIRECT_MAX {
        let sends = others(op).map(|r| (r, 0, &input[piece(r)])).collect();
        let (sent, got) = tokio::join!(send_all(op, sends), recv_all(op, len));
        sent?;
        out.copy_from_slice(&input[piece(me)]);
        combine_in_order(out, &got?, dtype, rop);
        return Ok(());
    }
    if input.len() >= LOCAL_MIN {
        if let Some(plan) = local::plan(op, input).await? {
            return local::reduce_scatter(op, plan, input, out, dtype, rop).await;
        }
    }
    // The ring, shifted by one so that this rank ends with its own piece.
    let p: Vec<_> = (0..n).map(piece).collect();
    ring_reduce_scatter_from(op, input, &p, dtype, rop, -1, out).await?;
    reduce::finish(out, dtype, rop, n);
    Ok(())
}

/// Piece `r` of `input` (`send[r]`) goes to rank `r`; piece `r` of `out` (`recv[r]`) comes from
/// rank `r`. Pieces may differ in length (all-to-all-v); each rank's `send[j]` must be as long
/// as rank `j`'s `recv[i]`.
pub(crate) async fn all_to_all(
    op: &Op,
    input: &[u8],
    send: &[Range<usize>],
    out: &mut [u8],
    recv: &[Range<usize>],
) -> Result<()> {
    let me = op.mesh.rank as usize;
    let sends = others(op).map(|r| (r, 0, &input[send[r as usize].clone()])).collect();
    if send[me].len() != recv[me].len() {
        return Err(crate::CollectiveError::Invalid(format!(
            "all_to_all: rank {me} sends itself {} bytes into a piece of {}",
            send[me].len(),
            recv[me].len()
        )));
    }
    out[recv[me].clone()].copy_from_slice(&input[send[me].clone()]);
    let (sent, got) = tokio::join!(send_all(op, sends), async {
        let mut got = Vec::new();
        for r in others(op) {
            got.push((r, op.recv(r, 0, recv[r as usize].len()).await?));
        }
        Ok::<_, crate::CollectiveError>(got)
    });
    sent?;
    for (r, b) in got? {
        out[recv[r as usize].clone()].copy_from_slice(&b);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_buffer_on_element_boundaries() {
        let p = pieces(40, 4, 3);
        assert_eq!(p, vec![0..16, 16..28, 28..40]);
        let p = pieces(8, 4, 4);
        assert_eq!(p, vec![0..4, 4..8, 8..8, 8..8]);
        assert_eq!(modn(-1, 4), 3);
    }
}
