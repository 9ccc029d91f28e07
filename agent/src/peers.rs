//! Peers: the group as this worker knows it (membership applied from the store), the pipe to
//! each peer and its read role, heartbeats, loss and reconnection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use sluice_channel::{Allocation, Descriptor, Message, Pipe, PipeError};

use crate::agent::AgentInner;
use crate::clock::Activity;
use crate::completion::Driver;
use crate::device_map::DeviceMap;
use crate::error::RpcError;
use crate::membership::{self, Announce, MembershipEvent, Subscribers};
use crate::name::{Dest, WorkerInfo};
use crate::reader::{Replies, ReplyReader};
use crate::server::{read_message, try_read_message};
use crate::store::{Listing, Store, StoreServer, StoreUrl};
use crate::wire::{self, Body, Envelope, Request, Response, WireValue};

pub(crate) struct Peer {
    pub(crate) info: WorkerInfo,
    pub(crate) announce: Announce,
    /// The normal pipe (calls up to normal priority) and the express pipe (calls above it),
    /// each opened on first use: see [`crate::priority`].
    pub(crate) lanes: [Lane; 2],
    /// Counts the pipes opened to this peer: each gets the next number, so a stale pipe's
    /// failure is not blamed on a newer one.
    pub(crate) generation: AtomicU64,
    /// Set while the peer is lost and not reconnected; new calls fail at once with it.
    pub(crate) down: Down,
    /// The peer said goodbye: its pipes closing is a leave, not a loss.
    pub(crate) leaving: AtomicBool,
    /// My device map to this peer, and its map to me (for responses).
    pub(crate) map_to: Option<DeviceMap>,
    pub(crate) map_from: Option<DeviceMap>,
}

/// The lane of calls up to normal priority.
pub(crate) const NORMAL_LANE: usize = 0;
/// The lane of calls above normal priority.
pub(crate) const EXPRESS_LANE: usize = 1;

/// Why a peer is down, while it is. Every call looks: a flag answers the common case (up)
/// without taking the lock.
#[derive(Default)]
pub(crate) struct Down {
    /// Whether `detail` is set (written under its lock).
    flag: AtomicBool,
    detail: Mutex<DownState>,
}

#[derive(Default)]
struct DownState {
    detail: Option<String>,
    /// The peer left the group (or its membership expired): down for good, whatever a
    /// reconnect that was under way when it went finds.
    removed: bool,
}

impl Down {
    /// Why the peer is down, or `None` while it is up.
    pub(crate) fn detail(&self) -> Option<String> {
        if !self.flag.load(Ordering::Acquire) {
            return None;
        }
        self.detail.lock().unwrap().detail.clone()
    }

    pub(crate) fn is_down(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Marks the peer down for good with `detail` (replacing an earlier one): it was removed
    /// from the group. Returns whether it was down already.
    pub(crate) fn remove(&self, detail: String) -> bool {
        let mut d = self.detail.lock().unwrap();
        self.flag.store(true, Ordering::Release);
        d.removed = true;
        d.detail.replace(detail).is_some()
    }

    /// Marks the peer down with `detail` unless it is down already; returns whether it did.
    pub(crate) fn set_if_up(&self, detail: &str) -> bool {
        let mut d = self.detail.lock().unwrap();
        if d.detail.is_some() {
            return false;
        }
        d.detail = Some(detail.to_owned());
        self.flag.store(true, Ordering::Release);
        true
    }

    /// Whether the peer was removed from the group.
    pub(crate) fn is_removed(&self) -> bool {
        self.detail.lock().unwrap().removed
    }

    /// The peer is back, unless it was removed meanwhile; returns whether it is back.
    pub(crate) fn clear(&self) -> bool {
        let mut d = self.detail.lock().unwrap();
        if d.removed {
            return false;
        }
        d.detail = None;
        self.flag.store(false, Ordering::Release);
        true
    }
}

/// One of this worker's pipes to a peer.
#[derive(Default)]
pub(crate) struct Lane {
    /// The open pipe with its generation and read role: `None` before the first call and
    /// after a failure. One lock for the three, taken once per call.
    pub(crate) open: Mutex<Option<OpenLane>>,
    /// Serializes opening a pipe.
    pub(crate) connecting: tokio::sync::Mutex<()>,
    /// Whether a message arrived on this pipe, and whether we wrote one, since the heartbeat
    /// last looked. Either silent for an interval sends a ping: the callee judges us by what
    /// we send, we judge it by what it answers.
    pub(crate) heard: Activity,
    pub(crate) sent: Activity,
}

/// A lane's open pipe.
#[derive(Clone)]
pub(crate) struct OpenLane {
    /// Counts the peer's pipes (see [`Peer::generation`]).
    pub(crate) generation: u64,
    pub(crate) pipe: Pipe,
    /// The pipe's read role: who reads its replies (see [`crate::reader`]).
    pub(crate) reader: Arc<dyn Driver>,
}

/// The lane for calls at `priority`.
pub(crate) fn lane_for(priority: crate::priority::Priority) -> usize {
    if priority.express() {
        EXPRESS_LANE
    } else {
        NORMAL_LANE
    }
}

impl Lane {
    /// The generation of the open pipe, if one is open.
    pub(crate) fn generation(&self) -> Option<u64> {
        self.open.lock().unwrap().as_ref().map(|o| o.generation)
    }

    /// The open pipe and its read role, if one is open.
    pub(crate) fn current(&self) -> Option<OpenLane> {
        self.open.lock().unwrap().clone()
    }

    /// The open pipe, if one is open.
    pub(crate) fn pipe(&self) -> Option<Pipe> {
        self.open.lock().unwrap().as_ref().map(|o| o.pipe.clone())
    }

    /// The open pipe's read role, if one is open.
    pub(crate) fn reader(&self) -> Option<Arc<dyn Driver>> {
        self.open.lock().unwrap().as_ref().map(|o| o.reader.clone())
    }
}

impl Peer {
    /// Whether `generation` is the open pipe of one of the lanes.
    pub(crate) fn is_current(&self, generation: u64) -> bool {
        self.lanes.iter().any(|l| l.generation() == Some(generation))
    }

    /// The pipes open now.
    pub(crate) fn open_pipes(&self) -> Vec<Pipe> {
        self.lanes.iter().filter_map(Lane::pipe).collect()
    }

    /// Closes every pipe and forgets its read role (the closed pipes' tasks and late failures
    /// are stale from then on, even for a lane that a reconnect does not reopen).
    pub(crate) fn close_lanes(&self) {
        for lane in &self.lanes {
            let open = lane.open.lock().unwrap().take();
            if let Some(open) = open {
                open.pipe.close();
            }
        }
    }
}

/// The group as this worker knows it.
#[derive(Default)]
pub(crate) struct Members {
    // Looked up on every call: a fast hash (the keys are ours, from the store).
    pub(crate) by_id: rustc_hash::FxHashMap<u32, Arc<Peer>>,
    pub(crate) by_name: rustc_hash::FxHashMap<String, u32>,
    /// Ids that are gone, and why: errors about them still name the worker.
    pub(crate) gone: HashMap<u32, (WorkerInfo, String)>,
}

/// The peers' own state: the group as this worker knows it, this worker's announcement, the
/// store membership lives in (and the embedded store, where this worker hosts it), and who
/// hears of membership changes.
pub(crate) struct Peers {
    pub(crate) announce: Announce,
    pub(crate) members: RwLock<Members>,
    /// The fixed group's size (zero for an elastic join).
    pub(crate) static_world: u32,
    pub(crate) subscribers: Subscribers,
    pub(crate) store: Store,
    store_url: StoreUrl,
    pub(crate) secret: Option<sluice_channel::Secret>,
    pub(crate) store_server: Mutex<Option<StoreServer>>,
}

impl Peers {
    pub(crate) fn new(
        announce: Announce,
        static_world: u32,
        store: Store,
        store_url: StoreUrl,
        secret: Option<sluice_channel::Secret>,
        store_server: Option<StoreServer>,
    ) -> Peers {
        Peers {
            announce,
            members: RwLock::new(Members::default()),
            static_world,
            subscribers: Subscribers::default(),
            store,
            store_url,
            secret,
            store_server: Mutex::new(store_server),
        }
    }

    pub(crate) fn add_member(&self, m: &mut Members, a: Announce) -> Arc<Peer> {
        let info = WorkerInfo {
            name: a.name.clone(),
            id: a.id,
        };
        let peer = Arc::new(Peer {
            info: info.clone(),
            lanes: Default::default(),
            generation: AtomicU64::new(0),
            down: Down::default(),
            leaving: AtomicBool::new(false),
            map_to: self.announce.devices.maps.get(&a.name).cloned(),
            map_from: a.devices.maps.get(&self.announce.name).cloned(),
            announce: a,
        });
        // The newest incarnation owns the name.
        let newer = m.by_name.get(&info.name).is_none_or(|&old| old <= info.id);
        if newer {
            m.by_name.insert(info.name.clone(), info.id);
        }
        m.by_id.insert(info.id, peer.clone());
        peer
    }

    /// True if `id` is (or was: a leaving worker finishing its work) a member, asking the
    /// store when the watcher has not seen it yet.
    pub(crate) async fn known_or_refreshed(&self, id: u32) -> bool {
        {
            let m = self.members.read().unwrap();
            if m.by_id.contains_key(&id) || m.gone.contains_key(&id) {
                return true;
            }
        }
        self.absorb_joins().await && self.members.read().unwrap().by_id.contains_key(&id)
    }

    /// Reads the membership from the store now and adds the live workers not known here (the
    /// watcher may lag behind a fresh join), publishing their joins. False if the store did
    /// not answer within 5 s.
    pub(crate) async fn absorb_joins(&self) -> bool {
        let Ok(Ok(listing)) = tokio::time::timeout(Duration::from_secs(5), self.store.list("m/")).await else {
            return false;
        };
        let (live, _) = membership::parse_listing(&listing.entries);
        let mut joined = Vec::new();
        {
            let mut m = self.members.write().unwrap();
            for a in live.into_values() {
                if !m.by_id.contains_key(&a.id) && !m.gone.contains_key(&a.id) && a.version == wire::AGENT_VERSION {
                    joined.push(self.add_member(&mut m, a).info.clone());
                }
            }
        }
        for info in joined {
            self.subscribers.publish(MembershipEvent::Joined(info));
        }
        true
    }
    pub(crate) fn member_count(&self) -> u32 {
        self.members.read().unwrap().by_id.len() as u32
    }
    /// The live member `id`, or the error that says why there is none.
    pub(crate) fn peer(&self, id: u32) -> Result<Arc<Peer>, RpcError> {
        let m = self.members.read().unwrap();
        if let Some(p) = m.by_id.get(&id) {
            return Ok(p.clone());
        }
        match m.gone.get(&id) {
            Some((info, detail)) => Err(RpcError::PeerLost {
                worker: info.name.clone(),
                detail: format!("{} {detail}", info),
            }),
            None => Err(RpcError::UnknownWorker {
                dest: format!("id {id}"),
                world_size: m.by_id.len() as u32,
            }),
        }
    }
    pub(crate) fn name_of(&self, id: u32) -> String {
        self.worker_info(id).name
    }
    pub(crate) fn worker_info(&self, id: u32) -> WorkerInfo {
        let m = self.members.read().unwrap();
        if let Some(p) = m.by_id.get(&id) {
            return p.info.clone();
        }
        match m.gone.get(&id) {
            Some((info, _)) => info.clone(),
            None => WorkerInfo {
                name: format!("worker-{id}"),
                id,
            },
        }
    }
}

/// Applies membership changes from the store as they happen.
pub(crate) async fn watch_members(weak: std::sync::Weak<AgentInner>, mut revision: u64) {
    let (url, secret) = match weak.upgrade() {
        Some(inner) => (inner.peers.store_url.clone(), inner.peers.secret.clone()),
        None => return,
    };
    // Its own connection: a watch is a long poll.
    let mut watcher: Option<Store> = None;
    let mut pause = Duration::from_millis(50);
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down() {
            return;
        }
        drop(inner);
        if watcher.is_none() {
            let Some(inner) = weak.upgrade() else { return };
            // Follow the main client's view of where the store is.
            let url = match &url {
                StoreUrl::Tcp(_) => StoreUrl::Tcp(inner.peers.store.address()),
                other => other.clone(),
            };
            drop(inner);
            match Store::connect(&url, Duration::from_secs(2), secret.clone()).await {
                Ok(s) => watcher = Some(s),
                Err(e) => {
                    tracing::debug!(error = %e, "membership watcher cannot reach the store; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                    continue;
                }
            }
        }
        let w = watcher.as_ref().expect("connected above");
        match w.watch("m/", revision, Duration::from_secs(5)).await {
            Ok(Some(listing)) => {
                pause = Duration::from_millis(50);
                revision = listing.revision;
                let Some(inner) = weak.upgrade() else { return };
                if w.address() != inner.peers.store.address() {
                    // The store moved (hand-off): take the main client along and re-assert
                    // our membership there at once.
                    inner.peers.store.follow(&w.address()).await;
                    let _ = inner.peers.store.list("m/live/").await;
                }
                inner.apply_listing(&listing).await;
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e, "membership watch failed; reconnecting");
                watcher = None;
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

impl AgentInner {
    /// Diffs a listing of `m/` against the members known here and applies the changes.
    pub(crate) async fn apply_listing(self: &Arc<Self>, listing: &Listing) {
        let (live, left) = membership::parse_listing(&listing.entries);
        let known: HashMap<u32, Announce> = self
            .peers
            .members
            .read()
            .unwrap()
            .by_id
            .iter()
            .map(|(id, p)| (*id, p.announce.clone()))
            .collect();
        let changes = membership::diff(&known, &live, &left);
        for a in changes.joined {
            if a.version != wire::AGENT_VERSION {
                tracing::warn!(worker = %a.name, version = a.version, "a worker with another protocol version joined; ignored");
                continue;
            }
            let info = {
                let mut m = self.peers.members.write().unwrap();
                self.peers.add_member(&mut m, a).info.clone()
            };
            self.peers.subscribers.publish(MembershipEvent::Joined(info));
        }
        for (id, graceful) in changes.removed {
            if id == self.me.id {
                if self.is_down() {
                    continue;
                }
                // Our own membership vanished (an expired lease, a store that moved without
                // us): we are still here, so say so again.
                tracing::warn!(worker = %self.me, "this worker's membership vanished from the store; re-announcing");
                if let Ok(bytes) = postcard::to_allocvec(&self.peers.announce) {
                    let _ = self.peers.store.set_ephemeral(&membership::live_key(id), bytes).await;
                }
                continue;
            }
            let detail = if graceful {
                "left the group".to_owned()
            } else {
                "its membership expired without a goodbye (crashed, killed or cut off)".to_owned()
            };
            self.remove_member(id, graceful, detail);
        }
    }

    /// A member is gone for good (left, or its membership expired).
    pub(crate) fn remove_member(self: &Arc<Self>, id: u32, graceful: bool, detail: String) {
        let peer = {
            let mut m = self.peers.members.write().unwrap();
            let Some(peer) = m.by_id.remove(&id) else { return };
            if m.by_name.get(&peer.info.name) == Some(&id) {
                m.by_name.remove(&peer.info.name);
                // An older incarnation still listed takes the name back only if it is alive.
                if let Some(other) = m
                    .by_id
                    .values()
                    .filter(|p| p.info.name == peer.info.name)
                    .map(|p| p.info.id)
                    .max()
                {
                    m.by_name.insert(peer.info.name.clone(), other);
                }
            }
            m.gone.insert(id, (peer.info.clone(), detail.clone()));
            peer
        };
        let was_down = peer.down.remove(detail.clone());
        self.drop_peer_state(&peer, &detail);
        if graceful || peer.leaving.load(Ordering::Acquire) {
            self.peers.subscribers.publish(MembershipEvent::Left(peer.info.clone()));
        } else if !was_down {
            self.peers.subscribers.publish(MembershipEvent::Lost {
                worker: peer.info.clone(),
                detail,
            });
        }
    }

    /// Closes the peer's pipe, fails its calls and releases what it held here.
    pub(crate) fn drop_peer_state(self: &Arc<Self>, peer: &Peer, detail: &str) {
        peer.close_lanes();
        let name = peer.info.name.clone();
        self.client.calls.fail(Some(peer.info.id), |_| RpcError::PeerLost {
            worker: name.clone(),
            detail: detail.to_owned(),
        });
        self.rrefs.peer_lost(&self.host(), peer.info.id);
    }

    /// Declares `id` lost (if `generation` is still its pipe's, or always with `None`). While
    /// it stays a member, a background task tries to reconnect.
    pub(crate) fn declare_lost(self: &Arc<Self>, id: u32, generation: Option<u64>, detail: String) {
        if self.is_down() {
            return;
        }
        let Ok(peer) = self.peers.peer(id) else { return };
        if generation.is_some_and(|g| !peer.is_current(g)) {
            return;
        }
        if !peer.down.set_if_up(&detail) {
            return;
        }
        let leaving = peer.leaving.load(Ordering::Acquire);
        let detail = if leaving {
            format!("{detail} (it is leaving the group)")
        } else {
            detail
        };
        tracing::info!(worker = %self.me, peer = %peer.info, %detail, "peer lost");
        self.drop_peer_state(&peer, &detail);
        if leaving {
            return;
        }
        self.peers.subscribers.publish(MembershipEvent::Lost {
            worker: peer.info.clone(),
            detail,
        });
        if id != self.me.id {
            self.handle.spawn(reconnect(Arc::downgrade(self), peer));
        }
    }

    pub(crate) fn resolve(&self, dest: &Dest) -> Result<u32, RpcError> {
        let find = |m: &Members| match dest {
            Dest::Name(n) => m.by_name.get(n).copied(),
            Dest::Rank(r) => (m.by_id.contains_key(r) || m.gone.contains_key(r)).then_some(*r),
        };
        if let Some(id) = find(&self.peers.members.read().unwrap()) {
            return Ok(id);
        }
        // The watcher may not have seen a fresh join yet: ask the store (from plain threads).
        if tokio::runtime::Handle::try_current().is_err()
            && !self.is_down()
            && self.handle.block_on(self.peers.absorb_joins())
        {
            if let Some(id) = find(&self.peers.members.read().unwrap()) {
                return Ok(id);
            }
        }
        // A name that belonged to the group and is gone stays known: calls to it fail as
        // lost (or left), naming it and how it went (see `peer`), never as unknown.
        if let Dest::Name(n) = dest {
            let m = self.peers.members.read().unwrap();
            if let Some(id) = m
                .gone
                .iter()
                .filter(|(_, (info, _))| &info.name == n)
                .map(|(id, _)| *id)
                .max()
            {
                return Ok(id);
            }
        }
        Err(RpcError::UnknownWorker {
            dest: dest.to_string(),
            world_size: self.peers.member_count(),
        })
    }

    /// The normal pipe to `id`, opened on first use; its reader task delivers replies and its
    /// heartbeat task watches it.
    pub(crate) async fn pipe_to(self: &Arc<Self>, id: u32) -> Result<Pipe, RpcError> {
        self.pipe_for(&self.peers.peer(id)?, NORMAL_LANE).await
    }

    /// The pipe of `lane` to a peer already looked up, opened on first use.
    pub(crate) async fn pipe_for(self: &Arc<Self>, peer: &Arc<Peer>, lane: usize) -> Result<Pipe, RpcError> {
        let l = &peer.lanes[lane];
        if let Some(p) = l.pipe() {
            return Ok(p);
        }
        let _connecting = l.connecting.lock().await;
        if let Some(detail) = peer.down.detail() {
            return Err(RpcError::PeerLost {
                worker: peer.info.name.clone(),
                detail,
            });
        }
        if let Some(p) = l.pipe() {
            return Ok(p);
        }
        // Boxed: opening is rare, and its future is large; a call's own future (moved on
        // every call) stays small.
        Box::pin(self.open_pipe(peer, lane)).await
    }

    /// Opens a new pipe of `lane` to `peer` and starts its reader and heartbeat.
    pub(crate) async fn open_pipe(self: &Arc<Self>, peer: &Arc<Peer>, lane: usize) -> Result<Pipe, RpcError> {
        let name = peer.info.name.clone();
        let address = &peer.announce.address;
        let pipe = self.context.connect(address).await.map_err(|e| match e {
            PipeError::Transport(_) | PipeError::Timeout { .. } => RpcError::PeerLost {
                worker: name.clone(),
                detail: format!("cannot open a pipe to {address}: {e}"),
            },
            other => RpcError::Pipe {
                worker: name.clone(),
                error: other,
            },
        })?;
        let hello = Message {
            metadata: wire::encode(&Envelope::Hello {
                rank: self.me.id,
                version: wire::AGENT_VERSION,
                heartbeat_ms: self.options.heartbeat_interval.as_millis() as u64,
            }),
            ..Message::default()
        };
        pipe.write(&hello).await.map_err(|e| RpcError::from_pipe(&name, e))?;
        let generation = peer.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let l = &peer.lanes[lane];
        let replies = PeerReplies {
            inner: Arc::downgrade(self),
            peer: peer.clone(),
            lane,
            generation,
            handle: self.handle.clone(),
        };
        let reader = ReplyReader::new(replies, pipe.clone());
        // The heartbeat counts silence from its own start, so a stale mark does no harm.
        let displaced = l.open.lock().unwrap().replace(OpenLane {
            generation,
            pipe: pipe.clone(),
            reader: reader.clone(),
        });
        // A pipe opened while the peer was being declared lost, then replaced by the
        // reconnect's: closed, not left open with its reader.
        if let Some(old) = displaced {
            old.pipe.close();
        }
        // Removed from the group while this pipe opened: `remove_member` sets that before it
        // closes the lanes, so either it closed this one or this sees the removal.
        if peer.down.is_removed() {
            peer.close_lanes();
            return Err(RpcError::PeerLost {
                worker: name,
                detail: peer.down.detail().unwrap_or_default(),
            });
        }
        tokio::spawn(reader.background());
        if !self.options.heartbeat_interval.is_zero() {
            tokio::spawn(heartbeat(
                Arc::downgrade(self),
                peer.clone(),
                lane,
                generation,
                pipe.clone(),
            ));
        }
        Ok(pipe)
    }
}

/// Pings `peer` on `pipe` whenever the pipe has heard nothing for an interval, and declares the
/// peer lost after `heartbeat_misses` silent intervals. Ends with the pipe.
pub(crate) async fn heartbeat(
    weak: std::sync::Weak<AgentInner>,
    peer: Arc<Peer>,
    lane: usize,
    generation: u64,
    pipe: Pipe,
) {
    let (interval, misses) = match weak.upgrade() {
        Some(inner) => (inner.options.heartbeat_interval, inner.options.heartbeat_misses.max(1)),
        None => return,
    };
    let limit = interval * misses;
    let (mut heard_at, mut sent_at) = match weak.upgrade() {
        Some(inner) => (inner.now_ms(), inner.now_ms()),
        None => return,
    };
    loop {
        tokio::time::sleep(interval / 2).await;
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down() || peer.lanes[lane].generation() != Some(generation) || peer.down.is_down() {
            return;
        }
        let now = inner.now_ms();
        let l = &peer.lanes[lane];
        let silent = l.heard.quiet_for(&mut heard_at, now);
        let quiet = l.sent.quiet_for(&mut sent_at, now);
        if silent >= limit {
            // What the pipe and its read role looked like, for whoever finds this in a log.
            let role = l.reader().map(|r| r.debug_state());
            tracing::warn!(worker = %inner.me, peer = %peer.info, lane, pipe = %pipe.debug_state(), role = ?role, "no reply to heartbeats: declaring the peer lost");
            pipe.close();
            let which = if lane == EXPRESS_LANE {
                " on the express pipe"
            } else {
                ""
            };
            inner.declare_lost(
                peer.info.id,
                Some(generation),
                format!("no reply to heartbeats for {silent:?}{which}"),
            );
            return;
        }
        if silent >= interval || quiet >= interval {
            sent_at = now;
            let ping = Message {
                metadata: wire::encode(&Envelope::Request(Request {
                    id: inner.client.next_id(),
                    priority: 0,
                    body: Body::Ping,
                    value: WireValue::default(),
                })),
                ..Message::default()
            };
            let write = tokio::time::timeout(limit, pipe.write(&ping));
            if let Ok(Err(e)) = write.await {
                inner.declare_lost(peer.info.id, Some(generation), format!("heartbeat failed: {e}"));
                return;
            }
        }
    }
}

/// While `peer` is lost but still a member, tries to open a new pipe to it now and then.
pub(crate) async fn reconnect(weak: std::sync::Weak<AgentInner>, peer: Arc<Peer>) {
    let mut pause = Duration::from_millis(200);
    loop {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down()
            || !inner
                .peers
                .members
                .read()
                .unwrap()
                .by_id
                .get(&peer.info.id)
                .is_some_and(|p| Arc::ptr_eq(p, &peer))
        {
            return;
        }
        let _connecting = peer.lanes[NORMAL_LANE].connecting.lock().await;
        let attempt = tokio::time::timeout(Duration::from_secs(5), inner.open_pipe(&peer, NORMAL_LANE)).await;
        if let Ok(Ok(_)) = attempt {
            if !peer.down.clear() {
                // Removed from the group while the pipe was opening (`remove_member` closes
                // it): no reconnect to announce.
                return;
            }
            tracing::info!(worker = %inner.me, peer = %peer.info, "reconnected");
            inner
                .peers
                .subscribers
                .publish(MembershipEvent::Reconnected(peer.info.clone()));
            return;
        }
    }
}

/// The agent's side of an outgoing pipe's read role: what one reply does when it arrives.
pub(crate) struct PeerReplies {
    pub(crate) inner: std::sync::Weak<AgentInner>,
    pub(crate) peer: Arc<Peer>,
    /// Which of the peer's pipes this is.
    pub(crate) lane: usize,
    pub(crate) generation: u64,
    pub(crate) handle: tokio::runtime::Handle,
}

impl PeerReplies {
    /// Delivers a message read from the pipe: a reply completes its call.
    fn deliver(
        &self,
        inner: &Arc<AgentInner>,
        message: Result<(Descriptor, Allocation), PipeError>,
    ) -> Result<(), String> {
        let id = self.peer.info.id;
        let (d, allocation) = message.map_err(|e| e.to_string())?;
        self.peer.lanes[self.lane].heard.mark();
        match inner.receive(id, &d, allocation) {
            Ok((Envelope::Response(Response { id: call, result }), payload)) => {
                let result = match result {
                    Ok(_) => Ok(payload.unwrap_or_default()),
                    Err(e) => Err(inner.rpc_error(id, e)),
                };
                if inner.client.calls.finish(call, result) {
                    inner.activity.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
            Ok((Envelope::Goodbye, _)) => {
                self.peer.leaving.store(true, Ordering::Release);
                Ok(())
            }
            Ok((other, _)) => Err(format!("protocol error: unexpected {other:?} on a reply pipe")),
            Err(e) => Err(format!("protocol error: {e}")),
        }
    }
}

impl Replies for PeerReplies {
    async fn read_one(&self, pipe: &Pipe) -> Result<(), String> {
        let inner = self.inner.upgrade().ok_or("the agent is down")?;
        let message = read_message(pipe, &inner.server).await;
        self.deliver(&inner, message)
    }

    fn try_read_one(&self, pipe: &Pipe) -> Option<Result<(), String>> {
        let Some(inner) = self.inner.upgrade() else {
            return Some(Err("the agent is down".into()));
        };
        let message = try_read_message(pipe, &inner.server)?;
        Some(self.deliver(&inner, message))
    }

    fn failed(&self, detail: String) {
        let Some(inner) = self.inner.upgrade() else { return };
        if let Some(open) = self.peer.lanes[self.lane].open.lock().unwrap().as_ref() {
            if open.generation == self.generation {
                open.pipe.close();
            }
        }
        tracing::debug!(worker = %inner.me, peer = self.peer.info.id, error = %detail, "pipe to peer failed");
        inner.declare_lost(self.peer.info.id, Some(self.generation), detail);
    }

    fn wanted(&self) -> bool {
        self.inner
            .upgrade()
            .is_some_and(|inner| inner.client.calls.pending_to(self.peer.info.id) > 0)
    }

    fn runtime(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

#[cfg(test)]
mod tests {
    use super::Down;

    #[test]
    fn a_removed_peer_stays_down_through_a_late_reconnect() {
        let down = Down::default();
        assert!(down.set_if_up("pipe failed"));
        assert!(!down.set_if_up("again"), "a second loss does not replace the first");
        assert_eq!(down.detail().as_deref(), Some("pipe failed"));
        // A reconnect while it is still a member brings it back.
        assert!(down.clear());
        assert!(!down.is_down());
        assert!(down.set_if_up("pipe failed"));
        // It leaves the group while a reconnect is opening a pipe: the reconnect's clear must
        // not bring it back.
        assert!(down.remove("left the group".into()), "it was down already");
        assert!(!down.clear());
        assert!(down.is_down() && down.is_removed());
        assert_eq!(down.detail().as_deref(), Some("left the group"));
        // Removed while up: reported as not down before.
        let up = Down::default();
        assert!(!up.remove("left the group".into()));
        assert!(!up.clear() && up.is_down());
    }
}
