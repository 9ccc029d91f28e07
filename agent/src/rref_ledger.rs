//! The RRef protocol's state, without IO: what one worker knows about the references it owns,
//! holds and forks, as functions of (state, input) that return what to send and which values
//! to release.
//!
//! The rules (PyTorch's G1 and G2):
//! - an owned value lives while this process holds an owner handle, or a user reference to it
//!   exists anywhere (a *fork*, registered by the owner before the sender lets go of its own);
//! - a user reference tells its owner it is gone (`Delete`) only after the owner confirmed it,
//!   and only once no child it forked is still unconfirmed;
//! - a reference forked for another worker keeps its parent alive until the child is confirmed
//!   (`ForkRequest` from the child to the owner, then `ChildAccept` from the child to the
//!   parent).
//!
//! The driver ([`crate::rref`]) holds this state under one lock, sends what it returns (a
//! `ForkRequest`'s outcome comes back as [`Ledger::fork_confirmed`]) and drops the released
//! values after the lock is gone (a value may hold references whose drop re-enters).

use std::collections::{HashMap, HashSet};

use crate::wire::{Body, GlobalId, WireRRef};

/// What a handle forks from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parent {
    /// An owner handle on the value `rref`.
    Owner(GlobalId),
    /// The user reference `fork`.
    User(GlobalId),
}

/// What the driver does after an input: messages to send, values to drop.
#[derive(Debug)]
pub(crate) struct Effects<V> {
    pub(crate) send: Vec<(u32, Body)>,
    pub(crate) released: Vec<V>,
}

impl<V> Default for Effects<V> {
    fn default() -> Self {
        Effects {
            send: Vec::new(),
            released: Vec::new(),
        }
    }
}

impl<V> Effects<V> {
    fn merge(&mut self, other: Effects<V>) {
        self.send.extend(other.send);
        self.released.extend(other.released);
    }
}

struct Owned<V> {
    value: V,
    /// User references, each with the worker that holds it.
    forks: HashMap<GlobalId, u32>,
    /// Owner handles in this process, plus children forked from them not yet confirmed.
    local: usize,
}

struct User {
    owner: u32,
    rref: GlobalId,
    /// Who forked it (told `ChildAccept` once the owner confirmed it).
    parent: u32,
    /// This process still holds a handle.
    held: bool,
    /// Children forked from it, not yet confirmed.
    children: usize,
    confirmed: bool,
}

/// One worker's RRef bookkeeping. `V` is the owned value's slot.
pub(crate) struct Ledger<V> {
    me: u32,
    owned: HashMap<GlobalId, Owned<V>>,
    /// Forks the owner deleted: a late or repeated fork request for one is ignored.
    deleted: HashSet<GlobalId>,
    users: HashMap<GlobalId, User>,
    /// Children forked here and not yet confirmed: the worker each went to, and its parent.
    children: HashMap<GlobalId, (u32, Parent)>,
}

impl<V> Ledger<V> {
    pub(crate) fn new(me: u32) -> Self {
        Ledger {
            me,
            owned: HashMap::new(),
            deleted: HashSet::new(),
            users: HashMap::new(),
            children: HashMap::new(),
        }
    }

    fn entry(&mut self, id: GlobalId, make: impl FnOnce() -> V) -> &mut Owned<V> {
        self.owned.entry(id).or_insert_with(|| Owned {
            value: make(),
            forks: HashMap::new(),
            local: 0,
        })
    }

    /// Releases `id` if nothing holds it any more.
    fn release_if_unheld(&mut self, id: GlobalId, out: &mut Effects<V>) {
        if let Some(e) = self.owned.get(&id) {
            if e.forks.is_empty() && e.local == 0 {
                out.released.extend(self.owned.remove(&id).map(|e| e.value));
            }
        }
    }

    /// The slot of the owned value `id`, made if this is the first word of it (a fetch can
    /// arrive before the creating call).
    pub(crate) fn value(&mut self, id: GlobalId, make: impl FnOnce() -> V) -> &V {
        &self.entry(id, make).value
    }

    /// The slot of `id` if this worker keeps it.
    pub(crate) fn existing_value(&self, id: GlobalId) -> Option<&V> {
        self.owned.get(&id).map(|e| &e.value)
    }

    /// An owner handle on `id` is made here (by `remote` to self, `Agent::rref`, or an arriving
    /// reference to a value this worker owns).
    pub(crate) fn owner_created(&mut self, id: GlobalId, make: impl FnOnce() -> V) {
        self.entry(id, make).local += 1;
    }

    pub(crate) fn owner_dropped(&mut self, id: GlobalId) -> Effects<V> {
        let mut out = Effects::default();
        if let Some(e) = self.owned.get_mut(&id) {
            e.local = e.local.saturating_sub(1);
        }
        self.release_if_unheld(id, &mut out);
        out
    }

    /// A user handle made by this worker's own `remote` call: the owner registers it on
    /// receiving the call, so it is confirmed from the start.
    pub(crate) fn user_created(&mut self, owner: u32, rref: GlobalId, fork: GlobalId) {
        self.users.insert(
            fork,
            User {
                owner,
                rref,
                parent: owner,
                held: true,
                children: 0,
                confirmed: true,
            },
        );
    }

    /// A reference arrived from `sender` inside a value. On the owner it becomes an owner
    /// handle (and the sender hears that its child is accepted); elsewhere a user reference,
    /// confirmed at once if the owner itself sent it, else after a `ForkRequest`.
    pub(crate) fn arrived(&mut self, w: &WireRRef, sender: u32, make: impl FnOnce() -> V) -> Effects<V> {
        let mut out = Effects::default();
        if w.owner == self.me {
            self.owner_created(w.id, make);
            if sender == self.me {
                out.merge(self.child_accepted(w.fork));
            } else {
                out.send.push((sender, Body::ChildAccept { fork: w.fork }));
            }
            return out;
        }
        let confirmed = w.parent == w.owner;
        self.users.insert(
            w.fork,
            User {
                owner: w.owner,
                rref: w.id,
                parent: w.parent,
                held: true,
                children: 0,
                confirmed,
            },
        );
        if !confirmed {
            out.send.push((
                w.owner,
                Body::ForkRequest {
                    rref: w.id,
                    fork: w.fork,
                },
            ));
        }
        out
    }

    /// The owner answered this worker's `ForkRequest` for `fork` (`accepted`), or it never
    /// will (the owner is gone, or this worker shuts down). Either way the reference no longer
    /// waits: a handle already dropped is deleted now.
    pub(crate) fn fork_confirmed(&mut self, fork: GlobalId, accepted: bool) -> Effects<V> {
        let mut out = Effects::default();
        let Some(u) = self.users.get_mut(&fork) else { return out };
        u.confirmed = true;
        if accepted {
            let parent = u.parent;
            if parent == self.me {
                out.merge(self.child_accepted(fork));
            } else {
                out.send.push((parent, Body::ChildAccept { fork }));
            }
        } else {
            // Nobody to tell: the delete would go to an owner that cannot hear it.
            if let Some(u) = self.users.get_mut(&fork) {
                u.owner_unreachable();
            }
        }
        self.delete_if_done(fork, &mut out);
        out
    }

    /// This process dropped its handle on the user reference `fork`.
    pub(crate) fn user_dropped(&mut self, fork: GlobalId) -> Effects<V> {
        let mut out = Effects::default();
        if let Some(u) = self.users.get_mut(&fork) {
            u.held = false;
        }
        self.delete_if_done(fork, &mut out);
        out
    }

    fn delete_if_done(&mut self, fork: GlobalId, out: &mut Effects<V>) {
        let done = matches!(self.users.get(&fork), Some(u) if !u.held && u.children == 0 && u.confirmed);
        if done {
            let u = self.users.remove(&fork).expect("checked above");
            if u.owner != NOBODY {
                out.send.push((u.owner, Body::Delete { rref: u.rref, fork }));
            }
        }
    }

    /// A reference from `parent` (to the value `rref` owned by `owner`) is sent to `dest` as
    /// the new fork `fork`. The parent stays alive until `dest` is known to the owner.
    pub(crate) fn fork_for(&mut self, parent: Parent, rref: GlobalId, fork: GlobalId, dest: u32) {
        match parent {
            // The owner registers the fork itself, before sending.
            Parent::Owner(_) if dest != self.me => {
                if let Some(e) = self.owned.get_mut(&rref) {
                    e.forks.insert(fork, dest);
                }
            }
            Parent::Owner(id) => {
                if let Some(e) = self.owned.get_mut(&id) {
                    e.local += 1;
                }
                self.children.insert(fork, (dest, parent));
            }
            Parent::User(f) => {
                if let Some(u) = self.users.get_mut(&f) {
                    u.children += 1;
                }
                self.children.insert(fork, (dest, parent));
            }
        }
    }

    /// Lets go of what the unconfirmed child `fork` kept alive.
    fn release_parent(&mut self, parent: Parent, out: &mut Effects<V>) {
        match parent {
            Parent::Owner(id) => out.merge(self.owner_dropped(id)),
            Parent::User(f) => {
                if let Some(u) = self.users.get_mut(&f) {
                    u.children = u.children.saturating_sub(1);
                }
                self.delete_if_done(f, out);
            }
        }
    }

    /// The child `fork` is confirmed by its owner.
    pub(crate) fn child_accepted(&mut self, fork: GlobalId) -> Effects<V> {
        let mut out = Effects::default();
        if let Some((_, parent)) = self.children.remove(&fork) {
            self.release_parent(parent, &mut out);
        }
        out
    }

    /// On the owner: the user reference `fork` to `rref` is held by `holder`. Ignored for a
    /// fork already deleted (a retried request arriving after the delete).
    pub(crate) fn add_fork_held(&mut self, rref: GlobalId, fork: GlobalId, holder: u32, make: impl FnOnce() -> V) {
        if self.deleted.contains(&fork) {
            return;
        }
        self.entry(rref, make).forks.insert(fork, holder);
    }

    /// On the owner: the user reference `fork` to `rref` is gone.
    pub(crate) fn delete_fork(&mut self, rref: GlobalId, fork: GlobalId) -> Effects<V> {
        let mut out = Effects::default();
        self.deleted.insert(fork);
        if let Some(e) = self.owned.get_mut(&rref) {
            e.forks.remove(&fork);
        }
        self.release_if_unheld(rref, &mut out);
        out
    }

    /// A send carrying the forks `forks` failed: they never reach anyone.
    pub(crate) fn undo_forks(&mut self, forks: &[GlobalId]) -> Effects<V> {
        let mut out = Effects::default();
        for &f in forks {
            out.merge(self.child_accepted(f));
            let holders: Vec<GlobalId> = self
                .owned
                .iter_mut()
                .filter_map(|(id, e)| e.forks.remove(&f).map(|_| *id))
                .collect();
            for id in holders {
                self.release_if_unheld(id, &mut out);
            }
        }
        out
    }

    /// `worker` is lost: the references it held are released here, children forked for it will
    /// never be confirmed, and references it owns can never be deleted there.
    pub(crate) fn peer_lost(&mut self, worker: u32) -> Effects<V> {
        let mut out = Effects::default();
        let orphans: Vec<GlobalId> = self
            .children
            .iter()
            .filter(|(_, (dest, _))| *dest == worker)
            .map(|(f, _)| *f)
            .collect();
        for f in orphans {
            out.merge(self.child_accepted(f));
        }
        let mut emptied = Vec::new();
        for (id, e) in self.owned.iter_mut() {
            e.forks.retain(|fork, holder| {
                let keep = *holder != worker;
                if !keep {
                    self.deleted.insert(*fork);
                }
                keep
            });
            emptied.push(*id);
        }
        for id in emptied {
            self.release_if_unheld(id, &mut out);
        }
        for u in self.users.values_mut().filter(|u| u.owner == worker) {
            u.owner_unreachable();
        }
        out
    }

    /// Everything, at teardown.
    pub(crate) fn clear(&mut self) -> Effects<V> {
        self.users.clear();
        self.children.clear();
        Effects {
            send: Vec::new(),
            released: self.owned.drain().map(|(_, e)| e.value).collect(),
        }
    }

    pub(crate) fn owned_count(&self) -> usize {
        self.owned.len()
    }

    /// User references this process still holds a handle on.
    pub(crate) fn users_held(&self) -> usize {
        self.users.values().filter(|u| u.held).count()
    }

    /// Whether the owner knows the user reference `fork` (true once it can no longer learn it).
    pub(crate) fn is_confirmed(&self, fork: GlobalId) -> bool {
        self.users.get(&fork).is_none_or(|u| u.confirmed)
    }
}

/// The owner of a reference whose owner is gone: nothing is sent to it.
const NOBODY: u32 = u32::MAX;

impl User {
    fn owner_unreachable(&mut self) {
        self.owner = NOBODY;
        self.confirmed = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(worker: u32, local: u64) -> GlobalId {
        GlobalId { worker, local }
    }

    /// Workers exchanging the ledger's messages, delivered in an order the test picks.
    struct Net {
        ledgers: Vec<Ledger<u32>>,
        /// (from, to, body), in flight.
        wire: Vec<(u32, u32, Body)>,
        released: Vec<u32>,
        next: u64,
    }

    impl Net {
        fn new(n: u32) -> Net {
            Net {
                ledgers: (0..n).map(Ledger::new).collect(),
                wire: Vec::new(),
                released: Vec::new(),
                next: 100,
            }
        }

        fn apply(&mut self, from: u32, e: Effects<u32>) {
            for (to, body) in e.send {
                self.wire.push((from, to, body));
            }
            self.released.extend(e.released);
        }

        fn fresh(&mut self, worker: u32) -> GlobalId {
            self.next += 1;
            gid(worker, self.next)
        }

        /// `from` sends its handle (`parent`) on the value `rref` owned by `owner` to `to`.
        fn send_ref(&mut self, from: u32, parent: Parent, owner: u32, rref: GlobalId, to: u32) -> GlobalId {
            let fork = self.fresh(from);
            self.ledgers[from as usize].fork_for(parent, rref, fork, to);
            let w = WireRRef {
                owner,
                id: rref,
                fork,
                parent: from,
            };
            let e = self.ledgers[to as usize].arrived(&w, from, || 7);
            self.apply(to, e);
            fork
        }

        /// Delivers message `i`; a ForkRequest's answer is delivered with it (the driver's
        /// continuation).
        fn deliver(&mut self, i: usize) {
            let (from, to, body) = self.wire.remove(i);
            let l = &mut self.ledgers[to as usize];
            let e = match body {
                Body::ForkRequest { rref, fork } => {
                    l.add_fork_held(rref, fork, from, || 0);
                    let e = self.ledgers[from as usize].fork_confirmed(fork, true);
                    self.apply(from, e);
                    return;
                }
                Body::ChildAccept { fork } => l.child_accepted(fork),
                Body::Delete { rref, fork } => l.delete_fork(rref, fork),
                other => panic!("not a control message: {other:?}"),
            };
            self.apply(to, e);
        }

        fn drain(&mut self, pick: &mut impl FnMut(usize) -> usize) {
            while !self.wire.is_empty() {
                let i = pick(self.wire.len());
                self.deliver(i);
            }
        }
    }

    #[test]
    fn an_owned_value_lives_until_its_last_handle_and_fork_are_gone() {
        let mut l: Ledger<u32> = Ledger::new(0);
        let id = gid(0, 1);
        l.owner_created(id, || 5);
        l.add_fork_held(id, gid(1, 2), 1, || 0);
        assert!(l.owner_dropped(id).released.is_empty(), "a fork still holds it");
        assert_eq!(l.owned_count(), 1);
        let e = l.delete_fork(id, gid(1, 2));
        assert_eq!(e.released, vec![5]);
        assert_eq!(l.owned_count(), 0);
        // A retried fork request after the delete does not bring it back.
        l.add_fork_held(id, gid(1, 2), 1, || 0);
        assert_eq!(l.existing_value(id), None);
    }

    #[test]
    fn a_user_dropped_before_confirmation_deletes_only_after_it() {
        let mut l: Ledger<u32> = Ledger::new(2);
        let (rref, fork) = (gid(0, 1), gid(1, 9));
        let w = WireRRef {
            owner: 0,
            id: rref,
            fork,
            parent: 1,
        };
        let e = l.arrived(&w, 1, || 0);
        assert_eq!(e.send, vec![(0, Body::ForkRequest { rref, fork })]);
        assert!(!l.is_confirmed(fork));
        assert!(
            l.user_dropped(fork).send.is_empty(),
            "no delete before the owner knows the fork"
        );
        assert_eq!(l.users_held(), 0);
        let e = l.fork_confirmed(fork, true);
        assert_eq!(
            e.send,
            vec![(1, Body::ChildAccept { fork }), (0, Body::Delete { rref, fork })],
            "the parent hears of its child, then the owner of the delete"
        );
    }

    #[test]
    fn a_parent_is_deleted_only_after_its_child_is_confirmed() {
        let mut l: Ledger<u32> = Ledger::new(1);
        let (rref, mine, child) = (gid(0, 1), gid(0, 2), gid(1, 3));
        l.user_created(0, rref, mine);
        l.fork_for(Parent::User(mine), rref, child, 2);
        assert!(l.user_dropped(mine).send.is_empty(), "the child is unconfirmed");
        let e = l.child_accepted(child);
        assert_eq!(e.send, vec![(0, Body::Delete { rref, fork: mine })]);
        assert!(
            l.child_accepted(child).send.is_empty(),
            "a repeated accept changes nothing"
        );
    }

    #[test]
    fn a_lost_owner_is_not_sent_deletes_and_a_lost_holder_releases_its_forks() {
        let mut l: Ledger<u32> = Ledger::new(1);
        let (rref, fork) = (gid(0, 1), gid(0, 2));
        l.user_created(0, rref, fork);
        assert!(l.peer_lost(0).send.is_empty());
        assert!(l.user_dropped(fork).send.is_empty(), "the owner is gone");

        let mut o: Ledger<u32> = Ledger::new(0);
        let id = gid(0, 5);
        o.owner_created(id, || 3);
        o.add_fork_held(id, gid(2, 1), 2, || 0);
        o.fork_for(Parent::Owner(id), id, gid(0, 6), 2);
        assert!(o.owner_dropped(id).released.is_empty());
        assert_eq!(o.peer_lost(2).released, vec![3], "worker 2 held every fork");
    }

    #[test]
    fn a_failed_send_undoes_its_forks() {
        let mut o: Ledger<u32> = Ledger::new(0);
        let id = gid(0, 1);
        o.owner_created(id, || 4);
        o.fork_for(Parent::Owner(id), id, gid(0, 2), 1);
        assert!(o.owner_dropped(id).released.is_empty());
        assert_eq!(o.undo_forks(&[gid(0, 2)]).released, vec![4]);
    }

    /// Owner 0 sends its value to 1, 1 forks it on to 2 and 3, 2 sends it back to the owner;
    /// every handle is dropped at a chosen moment and messages arrive in a chosen order. The
    /// value must outlive every reference and be released exactly once, at the end.
    #[test]
    fn every_ordering_of_a_fork_chain_releases_the_value_once_after_the_last_reference() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for round in 0..2000 {
            let mut net = Net::new(4);
            let id = gid(0, 1);
            net.ledgers[0].owner_created(id, || 42);
            let f1 = net.send_ref(0, Parent::Owner(id), 0, id, 1);
            let e = net.ledgers[0].owner_dropped(id).into_sends_only();
            net.apply(0, e);
            let mut handles: Vec<(u32, Parent)> = vec![(1, Parent::User(f1))];
            let mut steps = 0;
            // Fork, drop and deliver in a random interleaving.
            while !handles.is_empty() || !net.wire.is_empty() {
                steps += 1;
                assert!(steps < 1000, "round {round}: no progress");
                match rand(4) {
                    0 if !net.wire.is_empty() => {
                        let i = rand(net.wire.len());
                        net.deliver(i);
                    }
                    1 if !handles.is_empty() && handles.len() < 4 && steps < 20 => {
                        let (from, parent) = handles[rand(handles.len())];
                        let to = [0, 2, 3][rand(3)];
                        let fork = net.send_ref(from, parent, 0, id, to);
                        let p = if to == 0 { Parent::Owner(id) } else { Parent::User(fork) };
                        handles.push((to, p));
                    }
                    2 if !handles.is_empty() => {
                        assert!(net.released.is_empty(), "round {round}: released while referenced");
                        let (at, p) = handles.swap_remove(rand(handles.len()));
                        let e = match p {
                            Parent::Owner(id) => net.ledgers[at as usize].owner_dropped(id),
                            Parent::User(f) => net.ledgers[at as usize].user_dropped(f),
                        };
                        net.apply(at, e);
                    }
                    _ => {}
                }
                if !handles.is_empty() {
                    assert!(net.released.is_empty(), "round {round}: released while referenced");
                }
            }
            net.drain(&mut rand);
            assert_eq!(net.released, vec![42], "round {round}");
            for (w, l) in net.ledgers.iter().enumerate() {
                assert_eq!(
                    l.owned_count() + l.users.len() + l.children.len(),
                    0,
                    "round {round}: worker {w}"
                );
            }
        }
    }

    impl<V> Effects<V> {
        fn into_sends_only(self) -> Effects<V> {
            assert!(self.released.is_empty(), "a value released while a fork holds it");
            self
        }
    }
}
