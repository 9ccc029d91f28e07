//! The group's wiring: one pipe between every pair of ranks, found through the store, and the
//! mailbox that sorts what arrives by sender and key.
//!
//! Every message is one pipe message: a fixed 32-byte header as its metadata (magic, version,
//! kind, the group's id, the sender's rank, a key) and at most one CPU tensor holding the data.
//! Bytes from a peer are parsed, never trusted: a header of the wrong size, magic, version or
//! group, or a sender that is not the pipe's peer, fails the group naming that rank.
//!
//! Keys: a point-to-point message's key is its user tag; a collective's is its sequence number
//! in the group (every rank calls collectives in the same order, as in MPI) and the step within
//! it, so messages of different operations never meet.
//!
//! Failure: when a pipe fails, the rank at its other end is lost. The group is then failed for
//! good: every pending and later operation ends with an error naming the lost rank, and every
//! other peer is told (an abort message), so ranks that were not talking to the lost one stop
//! waiting too.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sluice_channel::{Allocation, ChannelKind, Context, Message, Pipe, PipeListener, Tensor};
use tokio::sync::oneshot;

use crate::CollectiveError;

const MAGIC: u32 = u32::from_le_bytes(*b"SLCO");

/// The largest piece of data a peer may send in one message (a collective's step or a
/// point-to-point message); larger announcements fail the group before anything is allocated.
pub const MAX_MESSAGE_BYTES: u64 = 16 << 30;
const VERSION: u16 = 1;
const HEADER: usize = 32;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub(crate) enum Kind {
    /// The first message on a pipe: who is calling.
    Hello = 1,
    /// Point-to-point data under a user tag.
    User = 2,
    /// A step of a collective.
    Coll = 3,
    /// The group failed; the data says why.
    Abort = 4,
    /// Leaving: key 0, "I am done sending"; key 1, "I have everyone's key 0".
    Bye = 5,
}

impl Kind {
    fn from_u16(v: u16) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::User,
            3 => Kind::Coll,
            4 => Kind::Abort,
            5 => Kind::Bye,
            _ => return None,
        })
    }
}

/// A message's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: Kind,
    pub group: u64,
    pub from: u32,
    pub key: u64,
}

impl Header {
    pub fn encode(&self) -> Bytes {
        let mut b = Vec::with_capacity(HEADER);
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.kind as u16).to_le_bytes());
        b.extend_from_slice(&self.group.to_le_bytes());
        b.extend_from_slice(&self.from.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&self.key.to_le_bytes());
        Bytes::from(b)
    }

    pub fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() != HEADER {
            return Err(format!("a header of {} bytes (expected {HEADER})", b.len()));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC {
            return Err("a message that is not a collective's (bad magic)".into());
        }
        if u16_at(4) != VERSION {
            return Err(format!(
                "collective wire version {} (this build speaks {VERSION})",
                u16_at(4)
            ));
        }
        let kind = Kind::from_u16(u16_at(6)).ok_or_else(|| format!("unknown message kind {}", u16_at(6)))?;
        Ok(Header {
            kind,
            group: u64_at(8),
            from: u32_at(16),
            key: u64_at(24),
        })
    }
}

/// A stable id for a group name (FNV-1a), carried in every header.
pub(crate) fn group_id(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// Where a received message waits for its receiver (or a receiver for its message).
#[derive(Default)]
struct Slot {
    arrived: VecDeque<Bytes>,
    waiting: VecDeque<oneshot::Sender<Result<Bytes, CollectiveError>>>,
}

#[derive(Default)]
struct Boxes {
    slots: HashMap<(u32, Kind, u64), Slot>,
    failed: Option<CollectiveError>,
    /// `queued[r]`: bytes from rank `r` that arrived and wait for a receiver.
    queued: Vec<u64>,
}

/// How many bytes one peer's messages may hold in this rank's mailbox before its pipe is read
/// no further (until a receiver takes some): `SLUICE_COLLECTIVE_MAILBOX_BYTES`, default 1 GiB.
/// A single larger message is still taken when nothing else of that peer waits.
pub const MAILBOX_BYTES: u64 = 1 << 30;

fn mailbox_bytes() -> u64 {
    std::env::var("SLUICE_COLLECTIVE_MAILBOX_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MAILBOX_BYTES)
}

/// Pipes to every other rank and the mailbox of what they delivered.
pub(crate) struct Mesh {
    pub rank: u32,
    pub world: u32,
    pub group: u64,
    pub name: String,
    /// `pipes[r]`: the pipe to rank `r` (`None` for this rank).
    pipes: Vec<Option<Pipe>>,
    boxes: Mutex<Boxes>,
    pub timeout: Duration,
    /// `bye[r]`: rank `r` said it is leaving (its first goodbye arrived): its pipe closing
    /// after that is its graceful exit, not a loss.
    bye: Vec<std::sync::atomic::AtomicBool>,
    /// Send buffers kept for reuse (large copies into fresh memory fault in every page).
    spare: Mutex<Vec<bytes::BytesMut>>,
    /// Per-peer bound on the mailbox (see [`MAILBOX_BYTES`]), and the signal that room was made.
    mailbox: u64,
    room: tokio::sync::Notify,
    /// `pids[r]`: rank `r`'s process id, when every pipe of this rank carries CPU tensors by
    /// cross-memory attach (so this rank may read every peer's memory; see [`crate::local`]).
    pub pids: Option<Vec<i32>>,
    /// Collectives that read their peers' memory (see [`crate::local`]).
    pub local_ops: std::sync::atomic::AtomicU64,
    /// Buffers this rank exposed to its peers lately, (address, length), and whether they were
    /// given huge pages; `None` when that is turned off (`SLUICE_COLLECTIVE_HUGE_PAGES=0`).
    exposed: Option<Mutex<VecDeque<Exposed>>>,
}

/// A buffer exposed to the peers: (address, length), and whether it has huge pages.
type Exposed = ((usize, usize), bool);

/// Exposed buffers at least this long are given huge pages the second time they are exposed.
const HUGE_MIN: usize = 4 << 20;
/// How many exposed buffers are remembered.
const EXPOSED_KEPT: usize = 64;

/// Send buffers at least this long are kept for reuse, at most [`SPARE_BYTES`] in all.
const SPARE_MIN: usize = 256 << 10;
const SPARE_BYTES: usize = 256 << 20;

impl Mesh {
    /// Connects this rank to every other through `listener` (already bound, its address
    /// published where the others find it): a rank connects to every higher rank, whose address
    /// `lookup` finds, and accepts the lower ones (who say who they are).
    #[allow(clippy::too_many_arguments)]
    pub async fn build<L, F>(
        ctx: &Context,
        mut listener: PipeListener,
        name: &str,
        rank: u32,
        world: u32,
        timeout: Duration,
        lookup: L,
    ) -> Result<Arc<Mesh>, CollectiveError>
    where
        L: Fn(u32) -> F,
        F: std::future::Future<Output = Result<String, CollectiveError>>,
    {
        let group = group_id(name);
        let mut pipes: Vec<Option<Pipe>> = (0..world).map(|_| None).collect();
        // Accept the lower ranks while connecting to the higher ones.
        let lower = rank as usize;
        let accepting = async {
            let mut got = Vec::new();
            for _ in 0..lower {
                let pipe = listener.accept().await?;
                let d = pipe.read_descriptor().await?;
                let h = Header::decode(&d.metadata).map_err(|e| CollectiveError::Peer {
                    rank: None,
                    detail: format!("{}: {e}", pipe.info().peer),
                })?;
                if h.kind != Kind::Hello || h.group != group || h.from >= rank {
                    return Err(CollectiveError::Peer {
                        rank: Some(h.from),
                        detail: format!("an unexpected first message ({h:?}) for group {name}"),
                    });
                }
                pipe.read(Allocation::for_descriptor(&d)).await.map_err(|e| e.error)?;
                got.push((h.from, pipe));
            }
            Ok::<_, CollectiveError>(got)
        };
        let connecting = async {
            let mut got = Vec::new();
            for r in rank + 1..world {
                let addr = lookup(r).await?;
                let pipe = ctx.connect(&addr).await?;
                let hello = Header {
                    kind: Kind::Hello,
                    group,
                    from: rank,
                    key: 0,
                };
                pipe.write(&Message {
                    metadata: hello.encode(),
                    ..Message::default()
                })
                .await?;
                got.push((r, pipe));
            }
            Ok::<_, CollectiveError>(got)
        };
        let (accepted, connected) = tokio::time::timeout(timeout, async { tokio::try_join!(accepting, connecting) })
            .await
            .map_err(|_| CollectiveError::Timeout(format!("forming group {name} (rank {rank} of {world})")))??;
        for (r, pipe) in accepted.into_iter().chain(connected) {
            if pipes[r as usize].replace(pipe).is_some() {
                return Err(CollectiveError::Peer {
                    rank: Some(r),
                    detail: "connected twice".into(),
                });
            }
        }
        let pids = pipes
            .iter()
            .flatten()
            .all(|p| p.info().cpu_channel == ChannelKind::Cma)
            .then(|| {
                pipes
                    .iter()
                    .map(|p| p.as_ref().map_or(std::process::id(), |p| p.info().peer_pid) as i32)
                    .collect()
            });
        let mesh = Arc::new(Mesh {
            rank,
            world,
            group,
            name: name.to_owned(),
            pipes,
            boxes: Mutex::new(Boxes {
                queued: vec![0; world as usize],
                ..Boxes::default()
            }),
            timeout,
            bye: (0..world).map(|_| std::sync::atomic::AtomicBool::new(false)).collect(),
            spare: Mutex::new(Vec::new()),
            mailbox: mailbox_bytes(),
            room: tokio::sync::Notify::new(),
            pids,
            local_ops: std::sync::atomic::AtomicU64::new(0),
            exposed: (std::env::var("SLUICE_COLLECTIVE_HUGE_PAGES").as_deref() != Ok("0"))
                .then(|| Mutex::new(VecDeque::new())),
        });
        for r in 0..world {
            if r != rank {
                let m = mesh.clone();
                tokio::spawn(async move { m.serve(r).await });
            }
        }
        Ok(mesh)
    }

    fn pipe(&self, r: u32) -> Result<&Pipe, CollectiveError> {
        self.pipes
            .get(r as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| CollectiveError::Invalid(format!("rank {r} is not a peer in a group of {}", self.world)))
    }

    /// Reads rank `r`'s messages into the mailbox until its pipe ends.
    async fn serve(self: Arc<Self>, r: u32) {
        let pipe = self.pipes[r as usize].as_ref().expect("a peer's pipe").clone();
        loop {
            let d = match pipe.read_descriptor().await {
                Ok(d) => d,
                Err(_) if self.bye[r as usize].load(std::sync::atomic::Ordering::Acquire) => {
                    // Gone after saying goodbye: that stands for its second goodbye.
                    return self.deliver(r, Kind::Bye, 1, Bytes::new());
                }
                Err(e) => return self.lost(r, e.to_string()),
            };
            let h = match Header::decode(&d.metadata) {
                Ok(h) if h.group != self.group => {
                    return self.lost(r, format!("sent a message of another group ({:#x})", h.group))
                }
                Ok(h) if h.from != r => return self.lost(r, format!("sent a message claiming to be rank {}", h.from)),
                Ok(h) if h.kind == Kind::Hello => return self.lost(r, "said hello twice".into()),
                Ok(_) if d.tensors.len() > 1 => {
                    return self.lost(
                        r,
                        format!("sent {} tensors in one message (at most 1)", d.tensors.len()),
                    )
                }
                // Checked before anything is allocated for it.
                Ok(_) if d.tensors.iter().any(|t| t.length > MAX_MESSAGE_BYTES) || !d.payload_lengths.is_empty() => {
                    return self.lost(
                        r,
                        format!(
                            "sent a message of {:?} payload bytes and {:?} tensor bytes (no payloads, one tensor of at most {MAX_MESSAGE_BYTES} bytes)",
                            d.payload_lengths,
                            d.tensors.iter().map(|t| t.length).collect::<Vec<_>>()
                        ),
                    )
                }
                Ok(h) => h,
                Err(e) => return self.lost(r, format!("sent {e}")),
            };
            // Backpressure: a peer whose unclaimed messages fill its share of the mailbox is
            // not read further until a receiver takes some (its writes then wait, and fail at
            // the group's timeout if nobody ever receives).
            self.room_for(r, d.tensors.first().map_or(0, |t| t.length)).await;
            let got = match pipe.read(Allocation::for_descriptor(&d)).await {
                Ok(a) => a,
                Err(e) => return self.lost(r, e.error.to_string()),
            };
            let data = got
                .tensors
                .into_iter()
                .next()
                .and_then(|t| t.into_cpu())
                .unwrap_or_default();
            if h.kind == Kind::Bye && h.key == 0 {
                self.bye[r as usize].store(true, std::sync::atomic::Ordering::Release);
            }
            if h.kind == Kind::Abort {
                let why = String::from_utf8_lossy(&data).into_owned();
                self.fail(CollectiveError::Aborted { by: r, why });
            }
            self.deliver(r, h.kind, h.key, data);
        }
    }

    /// Returns once rank `r`'s queued bytes leave room for `len` more (or none are queued, or
    /// the group has failed: then everything is read and dropped).
    async fn room_for(&self, r: u32, len: u64) {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let boxes = self.boxes.lock().expect("mailbox");
                let queued = boxes.queued[r as usize];
                if boxes.failed.is_some() || queued == 0 || queued.saturating_add(len) <= self.mailbox {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Files `data` for its receiver. Once the group has failed, what still arrives is read and
    /// dropped here, so that a peer's writes queued behind its abort are not left waiting.
    fn deliver(&self, from: u32, kind: Kind, key: u64, data: Bytes) {
        let mut boxes = self.boxes.lock().expect("mailbox");
        if boxes.failed.is_some() {
            return;
        }
        let slot = boxes.slots.entry((from, kind, key)).or_default();
        let mut data = Some(data);
        while let Some(w) = slot.waiting.pop_front() {
            match w.send(Ok(data.take().expect("not yet delivered"))) {
                Ok(()) => break,
                // That receiver gave up (timed out): the next one gets it.
                Err(back) => data = Some(back.expect("sent Ok")),
            }
        }
        let mut added = 0;
        if let Some(d) = data {
            added = d.len() as u64;
            slot.arrived.push_back(d);
        }
        if slot.arrived.is_empty() && slot.waiting.is_empty() {
            boxes.slots.remove(&(from, kind, key));
        }
        boxes.queued[from as usize] += added;
    }

    /// Rank `r`'s pipe failed: the group fails, naming it, and the others are told.
    fn lost(&self, r: u32, why: String) {
        let e = CollectiveError::PeerLost { rank: r, why };
        if self.fail(e.clone()) {
            self.tell_others(r, &e.to_string());
        }
    }

    /// Fails the group with `e` (the first failure wins); returns whether it was the first.
    pub fn fail(&self, e: CollectiveError) -> bool {
        let waiting: Vec<_> = {
            let mut boxes = self.boxes.lock().expect("mailbox");
            if boxes.failed.is_some() {
                return false;
            }
            tracing::warn!(group = %self.name, rank = self.rank, "collective group failed: {e}");
            boxes.failed = Some(e.clone());
            boxes.slots.drain().flat_map(|(_, s)| s.waiting).collect()
        };
        for w in waiting {
            let _ = w.send(Err(e.clone()));
        }
        // Readers held back for room go on (and drop what they read).
        self.room.notify_waiters();
        true
    }

    pub fn tell_others(&self, except: u32, why: &str) {
        let header = Header {
            kind: Kind::Abort,
            group: self.group,
            from: self.rank,
            key: 0,
        };
        for (r, p) in self.pipes.iter().enumerate() {
            if let (Some(p), true) = (p, r as u32 != except) {
                let p = p.clone();
                let m = Message {
                    metadata: header.encode(),
                    payloads: Vec::new(),
                    tensors: vec![Tensor::cpu(Bytes::from(why.as_bytes().to_vec()))],
                };
                tokio::spawn(async move {
                    let _ = p.write(&m).await;
                });
            }
        }
    }

    /// Why the group failed, if it has.
    pub fn failed(&self) -> Option<CollectiveError> {
        self.boxes.lock().expect("mailbox").failed.clone()
    }

    /// Sends `data` to rank `to` under (`kind`, `key`).
    pub async fn send(&self, to: u32, kind: Kind, key: u64, data: Bytes) -> Result<(), CollectiveError> {
        if let Some(e) = self.failed() {
            return Err(e);
        }
        let header = Header {
            kind,
            group: self.group,
            from: self.rank,
            key,
        };
        let m = Message {
            metadata: header.encode(),
            payloads: Vec::new(),
            tensors: vec![Tensor::cpu(data)],
        };
        let pipe = self.pipe(to)?;
        match tokio::time::timeout(self.timeout, pipe.write(&m)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.lost(to, e.to_string());
                Err(self.failed().unwrap_or(CollectiveError::PeerLost {
                    rank: to,
                    why: e.to_string(),
                }))
            }
            Err(_) => {
                // A write abandoned midway leaves the pipe's state unknown (an acknowledgement
                // may still arrive for it): the group cannot go on.
                let e = CollectiveError::Timeout(format!(
                    "sending to rank {to} in group {} took longer than {:?}",
                    self.name, self.timeout
                ));
                if self.fail(e.clone()) {
                    self.tell_others(self.rank, &e.to_string());
                }
                Err(self.failed().unwrap_or(e))
            }
        }
    }

    /// Sends a copy of `data` (into a kept buffer of its length where there is one, given back
    /// once the write is done with it).
    pub async fn send_copy(&self, to: u32, kind: Kind, key: u64, data: &[u8]) -> Result<(), CollectiveError> {
        let mut buf = if data.len() >= SPARE_MIN {
            let mut spare = self.spare.lock().expect("spare buffers");
            match spare.iter().position(|b| b.len() == data.len()) {
                Some(i) => spare.swap_remove(i),
                None => bytes::BytesMut::zeroed(data.len()),
            }
        } else {
            bytes::BytesMut::zeroed(data.len())
        };
        buf.copy_from_slice(data);
        let frozen = buf.freeze();
        let r = self.send(to, kind, key, frozen.clone()).await;
        if let Ok(back) = frozen.try_into_mut() {
            if back.len() >= SPARE_MIN {
                let mut spare = self.spare.lock().expect("spare buffers");
                let kept: usize = spare.iter().map(|b| b.len()).sum();
                if kept + back.len() <= SPARE_BYTES {
                    spare.push(back);
                }
            }
        }
        r
    }

    /// The next message from rank `from` under (`kind`, `key`).
    pub async fn recv(&self, from: u32, kind: Kind, key: u64) -> Result<Bytes, CollectiveError> {
        self.pipe(from)?;
        let rx = {
            let mut boxes = self.boxes.lock().expect("mailbox");
            if let Some(e) = &boxes.failed {
                return Err(e.clone());
            }
            let slot = boxes.slots.entry((from, kind, key)).or_default();
            if let Some(d) = slot.arrived.pop_front() {
                if slot.arrived.is_empty() && slot.waiting.is_empty() {
                    boxes.slots.remove(&(from, kind, key));
                }
                boxes.queued[from as usize] -= d.len() as u64;
                drop(boxes);
                self.room.notify_waiters();
                return Ok(d);
            }
            let (tx, rx) = oneshot::channel();
            slot.waiting.push_back(tx);
            rx
        };
        match tokio::time::timeout(self.timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(self
                .failed()
                .unwrap_or(CollectiveError::Invalid("the group was dropped".into()))),
            // The group may have failed meanwhile (the error that says why beats the timeout).
            Err(_) => Err(self.failed().unwrap_or_else(|| {
                CollectiveError::Timeout(format!(
                    "waiting for rank {from} in group {} took longer than {:?}",
                    self.name, self.timeout
                ))
            })),
        }
    }

    /// Leaves with every other rank: each says goodbye and waits for everyone's, then says it
    /// has them all and waits for that from everyone (or for the pipe of a rank that said
    /// goodbye to close), so that no rank closes a pipe whose other end still waits on it.
    pub async fn leave(&self) -> Result<(), CollectiveError> {
        for round in 0..2u64 {
            for r in (0..self.world).filter(|&r| r != self.rank) {
                self.send(r, Kind::Bye, round, Bytes::new()).await?;
            }
            for r in (0..self.world).filter(|&r| r != self.rank) {
                self.recv(r, Kind::Bye, round).await?;
            }
        }
        Ok(())
    }

    /// Called with a buffer about to be read by the peers: the second time the same buffer
    /// (address and length) comes, at least [`HUGE_MIN`] long, it is backed with huge pages,
    /// which makes the peers' reads of it about 3× cheaper (see
    /// [`collapse_huge_pages`](sluice_channel::channel::cma::collapse_huge_pages)). Buffers used
    /// once (a fresh one per call) pay nothing; reused ones (DDP's gradient buckets, an
    /// optimizer's flat parameters) pay the collapse once.
    pub fn expose(&self, buf: &[u8]) {
        let Some(exposed) = &self.exposed else { return };
        if buf.len() < HUGE_MIN {
            return;
        }
        let key = (buf.as_ptr() as usize, buf.len());
        {
            let mut seen = exposed.lock().expect("exposed buffers");
            match seen.iter_mut().find(|(k, _)| *k == key) {
                Some((_, true)) => return,
                Some((_, collapsed)) => *collapsed = true,
                None => {
                    if seen.len() == EXPOSED_KEPT {
                        seen.pop_front();
                    }
                    seen.push_back((key, false));
                    return;
                }
            }
        }
        if let Err(e) = sluice_channel::channel::cma::collapse_huge_pages(buf) {
            tracing::debug!(group = %self.name, "no huge pages for a {} byte buffer: {e}", buf.len());
        }
    }

    /// Closes every pipe (the group is done).
    pub fn close(&self) {
        self.fail(CollectiveError::Closed);
        for p in self.pipes.iter().flatten() {
            p.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_named() {
        let h = Header {
            kind: Kind::Coll,
            group: group_id("g"),
            from: 3,
            key: 77,
        };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode().to_vec();
        bad[4] = 9;
        assert!(Header::decode(&bad).unwrap_err().contains("version 9"));
        bad = h.encode().to_vec();
        bad[6] = 42;
        assert!(Header::decode(&bad).unwrap_err().contains("kind 42"));
        assert!(Header::decode(&bad[..31]).unwrap_err().contains("31 bytes"));
        assert!(Header::decode(&[0u8; 32]).unwrap_err().contains("magic"));
        assert_ne!(group_id("a"), group_id("b"));
    }
}
