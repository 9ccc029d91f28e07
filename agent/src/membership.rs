//! Group membership: who is in the group now, and what changed.
//!
//! The store holds the truth. Each worker keeps an ephemeral key `m/live/<id>` with its
//! [`Announce`] (deleted when its store connection or etcd lease ends), and writes
//! `m/left/<id>` before removing it on a graceful leave. Every worker watches `m/` and diffs the
//! listing against what it knew ([`diff`]): a new live key is a join, a removed one with a left
//! marker is a leave, a removed one without is a loss.
//!
//! Ids name one *incarnation*: they are never reused. A worker restarted under its name gets a
//! fresh id; calls by name reach the new one, and everything tied to the old id (pending
//! calls, RRefs it owned, autograd contexts) fails with an error naming it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::device_map::WorkerDevices;
use crate::name::WorkerInfo;

/// Ids at and above this are handed out by the store (elastic joins, restarts); static ranks
/// sit below.
pub const ELASTIC_BASE: u32 = 4096;
/// Ids are at most 16 bits (autograd context ids are `id << 48 | counter`).
pub const MAX_ID: u32 = u16::MAX as u32;

pub(crate) const LIVE: &str = "m/live/";
pub(crate) const LEFT: &str = "m/left/";

pub(crate) fn live_key(id: u32) -> String {
    format!("{LIVE}{id:05}")
}

pub(crate) fn left_key(id: u32) -> String {
    format!("{LEFT}{id:05}")
}

/// A fixed group's first start: each rank's announcement, kept (not ephemeral), so a rank
/// that read the whole group, failed validation and left is still seen by the slower ones,
/// which then fail with the same error instead of waiting for it.
pub(crate) const FORMED: &str = "init/m/";

pub(crate) fn formed_key(id: u32) -> String {
    format!("{FORMED}{id:05}")
}

/// The announcements of a fixed group's formation (keys under [`FORMED`]).
pub(crate) fn parse_formation(entries: &[(String, Vec<u8>)]) -> BTreeMap<u32, Announce> {
    parse_announcements(entries, FORMED)
}

fn parse_announcements(entries: &[(String, Vec<u8>)], prefix: &str) -> BTreeMap<u32, Announce> {
    let mut out = BTreeMap::new();
    for (k, v) in entries {
        if let Some(id) = k.strip_prefix(prefix) {
            match (id.parse::<u32>(), postcard::from_bytes::<Announce>(v)) {
                (Ok(id), Ok(a)) if a.id == id => {
                    out.insert(id, a);
                }
                _ => tracing::warn!(key = %k, "membership: unreadable entry skipped"),
            }
        }
    }
    out
}

pub(crate) fn name_key(name: &str) -> String {
    format!("names/{name}")
}

/// What each worker publishes about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Announce {
    pub version: u16,
    pub name: String,
    pub id: u32,
    pub address: String,
    pub devices: WorkerDevices,
}

/// A change in the group, as seen by this worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// A worker joined (or a restarted worker rejoined under a new id).
    Joined(WorkerInfo),
    /// A worker left gracefully.
    Left(WorkerInfo),
    /// A worker was declared lost: its pipe failed, it missed heartbeats, or its membership
    /// expired without a graceful leave. Calls to it have failed with `PeerLost`.
    Lost { worker: WorkerInfo, detail: String },
    /// A lost worker that is still a member (a cut link was restored) is reachable again.
    Reconnected(WorkerInfo),
}

/// One diff's worth of changes.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Changes {
    pub joined: Vec<Announce>,
    /// Removed ids, with whether they left gracefully.
    pub removed: Vec<(u32, bool)>,
}

/// Parses a listing of `m/` into the live members and the ids that left. Keys or values that
/// do not parse are skipped (and logged): the store is shared, and a bad entry must not stop
/// the group.
pub(crate) fn parse_listing(entries: &[(String, Vec<u8>)]) -> (BTreeMap<u32, Announce>, Vec<u32>) {
    let live = parse_announcements(entries, LIVE);
    let left = entries
        .iter()
        .filter_map(|(k, _)| k.strip_prefix(LEFT)?.parse::<u32>().ok())
        .collect();
    (live, left)
}

/// What changed between `known` and the listing's live members.
pub(crate) fn diff(known: &HashMap<u32, Announce>, live: &BTreeMap<u32, Announce>, left: &[u32]) -> Changes {
    let mut c = Changes::default();
    for (id, a) in live {
        if !known.contains_key(id) {
            c.joined.push(a.clone());
        }
    }
    let mut removed: Vec<u32> = known.keys().filter(|id| !live.contains_key(id)).copied().collect();
    removed.sort_unstable();
    c.removed = removed.into_iter().map(|id| (id, left.contains(&id))).collect();
    c
}

/// Parses store entries built from arbitrary bytes (key ‖ 0 ‖ value, repeated): the fuzz
/// target's entry. Never panics, whatever the bytes.
#[doc(hidden)]
pub fn fuzz_listing(bytes: &[u8]) {
    let mut entries = Vec::new();
    let mut parts = bytes.split(|b| *b == 0);
    while let (Some(k), Some(v)) = (parts.next(), parts.next()) {
        entries.push((format!("m/{}", String::from_utf8_lossy(k)), v.to_vec()));
    }
    let (live, left) = parse_listing(&entries);
    let known = live.iter().map(|(id, a)| (*id ^ 1, a.clone())).collect();
    let _ = diff(&known, &live, &left);
}

type Callback = Arc<dyn Fn(&MembershipEvent) + Send + Sync>;

/// Subscribers to membership events.
#[derive(Default)]
pub(crate) struct Subscribers {
    callbacks: Mutex<Vec<Callback>>,
    channels: Mutex<Vec<crossbeam_channel::Sender<MembershipEvent>>>,
}

impl Subscribers {
    pub fn callback(&self, f: Callback) {
        self.callbacks.lock().unwrap().push(f);
    }

    pub fn channel(&self) -> crossbeam_channel::Receiver<MembershipEvent> {
        let (tx, rx) = crossbeam_channel::unbounded();
        self.channels.lock().unwrap().push(tx);
        rx
    }

    pub fn publish(&self, event: MembershipEvent) {
        tracing::info!(?event, "membership");
        let callbacks: Vec<Callback> = self.callbacks.lock().unwrap().clone();
        for f in callbacks {
            f(&event);
        }
        self.channels
            .lock()
            .unwrap()
            .retain(|tx| tx.send(event.clone()).is_ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn announce(id: u32, name: &str) -> Announce {
        Announce {
            version: 1,
            name: name.into(),
            id,
            address: format!("127.0.0.1:{}", 1000 + id),
            devices: WorkerDevices {
                name: name.into(),
                devices: vec![],
                maps: Default::default(),
            },
        }
    }

    #[test]
    fn listing_and_diff() {
        let entries = vec![
            (live_key(0), postcard::to_allocvec(&announce(0, "a")).unwrap()),
            (live_key(4096), postcard::to_allocvec(&announce(4096, "b")).unwrap()),
            // An entry whose id disagrees with its key, and garbage: both skipped.
            (live_key(7), postcard::to_allocvec(&announce(8, "x")).unwrap()),
            (live_key(9), vec![0xff, 0xff]),
            ("m/live/zz".into(), vec![]),
            (left_key(1), vec![]),
        ];
        let (live, left) = parse_listing(&entries);
        assert_eq!(live.keys().copied().collect::<Vec<_>>(), vec![0, 4096]);
        assert_eq!(left, vec![1]);
        let known: HashMap<u32, Announce> = [(0, announce(0, "a")), (1, announce(1, "c")), (2, announce(2, "d"))]
            .into_iter()
            .collect();
        let c = diff(&known, &live, &left);
        assert_eq!(c.joined, vec![announce(4096, "b")]);
        // 1 left gracefully (marker), 2 vanished (lost).
        assert_eq!(c.removed, vec![(1, true), (2, false)]);
    }

    #[test]
    fn subscribers_get_every_event_and_closed_channels_are_dropped() {
        let s = Subscribers::default();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        s.callback(Arc::new(move |e| s2.lock().unwrap().push(e.clone())));
        let rx = s.channel();
        let dropped = s.channel();
        drop(dropped);
        let w = WorkerInfo {
            name: "a".into(),
            id: 0,
        };
        s.publish(MembershipEvent::Joined(w.clone()));
        s.publish(MembershipEvent::Left(w.clone()));
        assert_eq!(rx.try_iter().count(), 2);
        assert_eq!(seen.lock().unwrap().len(), 2);
        assert_eq!(s.channels.lock().unwrap().len(), 1);
    }
}
