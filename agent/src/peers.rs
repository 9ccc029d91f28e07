//! Peers: the group as this worker knows it (membership applied from the store), the pipe to
//! each peer and its read role, heartbeats, loss and reconnection.
//!
//! The peers' driver: `impl AgentInner` work across parts (see [`crate::agent`] for the
//! layout); its own state is in [`crate::parts`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use sluice_channel::{Allocation, Descriptor, Message, Pipe, PipeError};

use crate::error::RpcError;
use crate::hub::AgentInner;
use crate::membership::{self, Announce, MembershipEvent};
use crate::name::Dest;
use crate::parts::peers::{Members, OpenLane, Peer, EXPRESS_LANE, NORMAL_LANE};
use crate::parts::server::{allocate_within_limit, read_message};
use crate::reader::{Replies, ReplyReader};
use crate::store::{Listing, Store, StoreUrl};
use crate::wire::{self, Body, Envelope, Request, Response, WireValue};

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
        let _order = peer.events.lock().unwrap();
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
        let order = peer.events.lock().unwrap();
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
        drop(order);
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
            let _order = peer.events.lock().unwrap();
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

    async fn read_ready(&self, pipe: &Pipe) -> Result<bool, String> {
        // The agent is held only once a message is here: a reader waiting on a quiet pipe keeps
        // nothing alive. Gone, the message is left to `read_one`, which says so.
        let mut agent = None;
        let read = pipe
            .read_message_ready(|d| {
                let inner = agent.insert(self.inner.upgrade()?);
                Some(allocate_within_limit(pipe, &inner.server, d))
            })
            .await;
        let Some(message) = read.map_err(|e| e.to_string())? else {
            return Ok(false);
        };
        // Taken, so `allocate` ran and holds the agent.
        let Some(inner) = agent else {
            return Err("the agent is down".into());
        };
        self.deliver(&inner, Ok(message)).map(|()| true)
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
