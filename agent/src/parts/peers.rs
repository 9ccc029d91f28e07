//! The peers' own state: the members as applied from the store, each peer's lanes (pipes and
//! read roles) and whether it is down, the store, and membership subscribers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use sluice_channel::Pipe;

use crate::clock::Activity;
use crate::completion::Driver;
use crate::device_map::DeviceMap;
use crate::error::RpcError;
use crate::membership::{self, Announce, MembershipEvent, Subscribers};
use crate::name::WorkerInfo;
use crate::store::{Store, StoreServer, StoreUrl};
use crate::wire;

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
    /// Held while the peer goes down, comes back or is removed, until the event that says so is
    /// published: subscribers hear the changes in the order they happened (never `Reconnected`
    /// after the `Left` of a removal that came between). Not `down`'s lock: subscribers run
    /// while this is held, and may ask `down`.
    pub(crate) events: Mutex<()>,
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
    pub(crate) store_url: StoreUrl,
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
            events: Mutex::new(()),
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
