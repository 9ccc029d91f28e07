//! The multi-lane channel: a large tensor is cut into equal contiguous pieces sent in
//! parallel over N TCP connections (the pipe's lanes), each driven by its own task, so by
//! several cores. A tensor below [`MIN_PIECE`] goes inline on the control connection instead. Both ends compute the same cut from the length and the lane count, so no
//! per-tensor control message is needed; the receiver reads the lanes once it has the
//! descriptor.

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use sluice_transport::any::{AnyReader, AnyWriter};
use sluice_transport::{FrameReader, FrameWriter};

use super::path::{Link, Rx, Tx};
use super::{ChannelContext, ChannelKind};
use crate::device::Device;
use crate::error::{PipeError, Result};
use crate::wire::Source;

/// The multi-lane channel's context: `lanes` TCP connections per pipe.
pub struct MultiLaneContext {
    pub lanes: usize,
}

impl ChannelContext for MultiLaneContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::MultiLane
    }

    fn viability(&self) -> std::result::Result<(), String> {
        if self.lanes == 0 {
            Err("configured with zero lanes".into())
        } else {
            Ok(())
        }
    }

    /// Lanes are TCP connections: any CPU that the bootstrap reached can be reached by lanes.
    fn device_descriptors(&self) -> Vec<(Device, String)> {
        vec![(Device::Cpu, "tcp".to_owned())]
    }
}

/// Pieces smaller than this are not worth a lane of their own.
pub const MIN_PIECE: usize = 256 * 1024;

/// The contiguous piece of a `len`-byte tensor each lane carries (in lane order). Small tensors
/// use fewer lanes; every byte is in exactly one piece.
pub fn pieces(len: usize, lanes: usize) -> Vec<Range<usize>> {
    let used = (len / MIN_PIECE).clamp(1, lanes.max(1));
    (0..used).map(|i| (len * i / used)..(len * (i + 1) / used)).collect()
}

/// Sender: a tensor too small for a lane piece of its own goes inline on the control
/// connection (a lane round trip costs more than the copy); larger ones across the lanes.
pub(crate) fn prepare(len: usize) -> Source {
    if len < MIN_PIECE {
        Source::Inline
    } else {
        Source::Lanes
    }
}

/// Sender: the descriptor first (the receiver reads the lanes only once it has it), then one
/// piece per lane, all lanes at once.
pub(crate) async fn send(tx: &mut Tx, link: &Link<'_>, bytes: &Bytes) -> Result<()> {
    tx.control.flush().await?;
    send_lanes(&mut tx.lanes, bytes, link.peer).await
}

/// Receiver: the pieces from the lanes straight into `dst`, all lanes at once.
pub(crate) async fn recv(rx: &mut Rx, link: &Link<'_>, dst: &mut BytesMut) -> Result<()> {
    recv_lanes(&mut rx.lanes, dst, link.peer).await
}

/// What one lane task hands back: its lane, what it carried (if anything), and how it went.
type LaneOutcome<L, X> = (L, X, std::result::Result<(), sluice_transport::TransportError>);

/// Awaits the lane tasks in lane order and puts the lanes back in front (keeping lane order).
/// Returns what each finished task carried, even when one failed, and the first error (naming
/// the peer).
async fn join_lanes<L, X>(
    lanes: &mut Vec<L>,
    tasks: Vec<tokio::task::JoinHandle<LaneOutcome<L, X>>>,
    peer: &str,
) -> (Vec<X>, Result<()>) {
    let mut first_error: Option<PipeError> = None;
    let mut returned = Vec::with_capacity(tasks.len());
    let mut carried = Vec::with_capacity(tasks.len());
    for t in tasks {
        match t.await {
            Ok((lane, x, r)) => {
                returned.push(lane);
                carried.push(x);
                if let Err(e) = r {
                    first_error.get_or_insert(e.into());
                }
            }
            Err(e) => {
                first_error.get_or_insert(PipeError::Channel {
                    peer: peer.to_owned(),
                    channel: "multilane",
                    detail: e.to_string(),
                });
            }
        }
    }
    returned.append(lanes);
    *lanes = returned;
    (carried, first_error.map_or(Ok(()), Err))
}

/// Sends `bytes` over the lanes, one piece per lane, all lanes at once.
async fn send_lanes(lanes: &mut Vec<AnyWriter>, bytes: &Bytes, peer: &str) -> Result<()> {
    let pieces = pieces(bytes.len(), lanes.len());
    let taken: Vec<AnyWriter> = lanes.drain(..pieces.len()).collect();
    let tasks = taken
        .into_iter()
        .zip(pieces)
        .map(|(mut lane, range)| {
            let piece = bytes.slice(range);
            tokio::spawn(async move {
                let r = lane.write(&[&piece]).await;
                (lane, (), r)
            })
        })
        .collect();
    join_lanes(lanes, tasks, peer).await.1
}

/// Receives a tensor's pieces from the lanes straight into `dst`, all lanes at once.
async fn recv_lanes(lanes: &mut Vec<AnyReader>, dst: &mut BytesMut, peer: &str) -> Result<()> {
    let pieces = pieces(dst.len(), lanes.len());
    let mut whole = std::mem::take(dst);
    let mut chunks = Vec::with_capacity(pieces.len());
    for range in pieces.iter().rev() {
        chunks.push(whole.split_off(range.start));
    }
    chunks.reverse();
    let taken: Vec<AnyReader> = lanes.drain(..pieces.len()).collect();
    let tasks = taken
        .into_iter()
        .zip(chunks)
        .map(|(mut lane, mut chunk)| {
            tokio::spawn(async move {
                let r = lane.read(&mut chunk).await.and_then(|n| {
                    if n == chunk.len() {
                        Ok(())
                    } else {
                        Err(sluice_transport::TransportError::FrameTooLarge {
                            peer: lane.peer().to_owned(),
                            len: n as u64,
                            limit: chunk.len(),
                        })
                    }
                });
                (lane, chunk, r)
            })
        })
        .collect();
    let (chunks, result) = join_lanes(lanes, tasks, peer).await;
    for chunk in chunks {
        // Pieces were split off one allocation in order, so this re-joins without copying.
        whole.unsplit(chunk);
    }
    *dst = whole;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_every_byte_once() {
        for len in [0usize, 1, 100, MIN_PIECE, MIN_PIECE * 3 + 7, 64 << 20] {
            for lanes in 1..6 {
                let p = pieces(len, lanes);
                assert!(!p.is_empty() && p.len() <= lanes);
                assert_eq!(p[0].start, 0);
                assert_eq!(p.last().unwrap().end, len);
                assert!(p.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        assert_eq!(pieces(64 << 20, 4).len(), 4);
        assert_eq!(pieces(1000, 4).len(), 1);
    }
}
