//! Remote references.
//!
//! An RRef names a value kept by its owner. The owner holds the value while any user reference
//! (a *fork*) exists or this process holds owner handles. The protocol keeps two guarantees
//! (PyTorch's G1 and G2):
//!
//! - the owner learns of every user reference that goes away (`Delete`, sent when the last
//!   handle in a process is dropped, only after the owner has confirmed that reference);
//! - a reference that forks a child for another worker stays alive until the owner has
//!   confirmed the child (`ForkRequest` from the child to the owner, then `ChildAccept` from
//!   the child to the parent).
//!
//! Only these control messages are retried (on a lost acknowledgement); they are idempotent:
//! the owner ignores a fork it already knows or already deleted. User calls are never retried.

use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::agent::{AgentInner, RpcFuture};
use crate::completion::{Completion, Slot};
use crate::error::RpcError;
use crate::name::WorkerInfo;
use crate::payload::{decode_rref, encode_rref, Payload, Value};
use crate::wire::{Body, GlobalId, WireRRef};

type ValueSlot = Arc<Slot<Result<Value, RpcError>>>;

struct OwnerEntry {
    value: ValueSlot,
    /// User references, each with the worker that holds it.
    forks: HashMap<GlobalId, u32>,
    /// Owner handles held in this process.
    local: usize,
}

impl OwnerEntry {
    fn new() -> Self {
        OwnerEntry {
            value: Slot::new(),
            forks: HashMap::new(),
            local: 0,
        }
    }
}

/// The RRef bookkeeping of one worker: values it owns, children it forked.
#[derive(Default)]
pub(crate) struct RRefTable {
    owned: Mutex<HashMap<GlobalId, OwnerEntry>>,
    /// Forks the owner deleted: a late or repeated fork request for one is ignored.
    deleted: Mutex<HashSet<GlobalId>>,
    /// Children forked by this worker's references, kept until their owner confirmed them;
    /// holding the parent here keeps it alive. With the worker the child went to.
    pending_children: Mutex<HashMap<GlobalId, (u32, Arc<RRefState>)>>,
    users: AtomicI64,
}

impl RRefTable {
    /// A value this worker owns is being created (by `remote` to self or `Agent::rref`), with
    /// one owner handle.
    pub(crate) fn owner_created(&self, id: GlobalId) {
        self.owned
            .lock()
            .unwrap()
            .entry(id)
            .or_insert_with(OwnerEntry::new)
            .local += 1;
    }

    pub(crate) fn set_value(&self, id: GlobalId, value: Result<Value, RpcError>) {
        let slot = self.owned.lock().unwrap().get(&id).map(|e| e.value.clone());
        match slot {
            Some(s) => {
                s.complete(value);
            }
            None => tracing::debug!(%id, "value for an RRef nobody holds any more; dropped"),
        }
    }

    /// The value of an owned RRef (waits for its creation).
    pub(crate) fn value(&self, id: GlobalId) -> Completion<Result<Value, RpcError>> {
        let slot = self
            .owned
            .lock()
            .unwrap()
            .entry(id)
            .or_insert_with(OwnerEntry::new)
            .value
            .clone();
        Completion::new(slot)
    }

    /// A user reference `fork` to the owned value `id`, held by worker `holder`.
    pub(crate) fn add_fork_held(&self, id: GlobalId, fork: GlobalId, holder: u32) {
        if self.deleted.lock().unwrap().contains(&fork) {
            return;
        }
        self.owned
            .lock()
            .unwrap()
            .entry(id)
            .or_insert_with(OwnerEntry::new)
            .forks
            .insert(fork, holder);
    }

    /// `worker` is lost: the references it held are released here, and children forked for it
    /// will never be confirmed.
    pub(crate) fn peer_lost(&self, worker: u32) {
        let children: Vec<_> = {
            let mut pending = self.pending_children.lock().unwrap();
            let ids: Vec<GlobalId> = pending
                .iter()
                .filter(|(_, (d, _))| *d == worker)
                .map(|(f, _)| *f)
                .collect();
            ids.into_iter().filter_map(|f| pending.remove(&f)).collect()
        };
        drop(children);
        let released: Vec<OwnerEntry> = {
            let mut owned = self.owned.lock().unwrap();
            let mut deleted = self.deleted.lock().unwrap();
            let mut empty = Vec::new();
            for (id, e) in owned.iter_mut() {
                e.forks.retain(|fork, holder| {
                    let keep = *holder != worker;
                    if !keep {
                        deleted.insert(*fork);
                    }
                    keep
                });
                if e.forks.is_empty() && e.local == 0 {
                    empty.push(*id);
                }
            }
            empty.into_iter().filter_map(|id| owned.remove(&id)).collect()
        };
        if !released.is_empty() {
            tracing::info!(
                worker,
                values = released.len(),
                "released the RRef values a lost worker held"
            );
        }
    }

    pub(crate) fn delete_fork(&self, id: GlobalId, fork: GlobalId) {
        self.deleted.lock().unwrap().insert(fork);
        let mut owned = self.owned.lock().unwrap();
        if let Some(e) = owned.get_mut(&id) {
            e.forks.remove(&fork);
            if e.forks.is_empty() && e.local == 0 {
                owned.remove(&id);
            }
        }
    }

    fn owner_handle_dropped(&self, id: GlobalId) {
        let mut owned = self.owned.lock().unwrap();
        if let Some(e) = owned.get_mut(&id) {
            e.local = e.local.saturating_sub(1);
            if e.forks.is_empty() && e.local == 0 {
                owned.remove(&id);
            }
        }
    }

    pub(crate) fn child_accepted(&self, fork: GlobalId) {
        // Dropping the parent here may send its own delete.
        let parent = self.pending_children.lock().unwrap().remove(&fork);
        drop(parent);
    }

    /// The fork id a reference becomes when sent to `dest`, with the bookkeeping that keeps the
    /// value alive until the receiver is known to the owner.
    pub(crate) fn fork_for(&self, inner: &Arc<AgentInner>, r: &Arc<RRefState>, dest: u32) -> GlobalId {
        let fork = inner.global_id();
        if r.owner == inner.me.id {
            if dest != inner.me.id {
                self.add_fork_held(r.id, fork, dest);
            } else {
                // To ourselves: the receiving side takes an owner handle; keep one meanwhile.
                self.pending_children.lock().unwrap().insert(fork, (dest, r.clone()));
            }
        } else {
            self.pending_children.lock().unwrap().insert(fork, (dest, r.clone()));
        }
        fork
    }

    /// A send failed: forget the forks made for it.
    pub(crate) fn undo_forks(&self, forks: &[GlobalId]) {
        for f in forks {
            let child = self.pending_children.lock().unwrap().remove(f);
            drop(child);
            let mut owned = self.owned.lock().unwrap();
            for e in owned.values_mut() {
                e.forks.remove(f);
            }
        }
    }

    /// A reference arrived from `sender`: the handle this process uses for it.
    pub(crate) fn materialize(&self, inner: &Arc<AgentInner>, w: &WireRRef, sender: u32) -> Arc<RRefState> {
        if w.owner == inner.me.id {
            self.owner_created(w.id);
            let state = RRefState::owner(inner, w.id);
            if sender == inner.me.id {
                self.child_accepted(w.fork);
            } else {
                // The sender holds its reference until we confirm we hold ours.
                inner.send_control(sender, Body::ChildAccept { fork: w.fork }, |_, _| {});
            }
            return state;
        }
        let confirmed = w.parent == w.owner;
        let state = RRefState::user(inner, w.owner, w.id, w.fork, confirmed);
        if !confirmed {
            let parent = w.parent;
            let fork = w.fork;
            let st = state.clone();
            inner.send_control(
                w.owner,
                Body::ForkRequest { rref: w.id, fork },
                move |inner, outcome| {
                    // Also when the owner is gone: nothing will confirm this reference, and its
                    // delete must not wait forever (it fails fast instead).
                    st.confirm();
                    if outcome.is_err() {
                        return;
                    }
                    if parent == inner.me.id {
                        inner.rrefs.child_accepted(fork);
                    } else {
                        inner.send_control(parent, Body::ChildAccept { fork }, |_, _| {});
                    }
                },
            );
        }
        state
    }

    pub(crate) fn owned_count(&self) -> usize {
        self.owned.lock().unwrap().len()
    }

    pub(crate) fn users_alive(&self) -> usize {
        self.users.load(Ordering::Acquire).max(0) as usize
    }

    pub(crate) fn clear(&self) {
        let children: Vec<_> = self.pending_children.lock().unwrap().drain().collect();
        drop(children);
        let owned: Vec<_> = self.owned.lock().unwrap().drain().collect();
        drop(owned);
    }
}

/// One process's handle on a reference; shared by every clone of the `RRef`.
pub struct RRefState {
    agent: Weak<AgentInner>,
    pub(crate) owner: u32,
    pub(crate) id: GlobalId,
    /// `None` for an owner handle.
    pub(crate) fork: Option<GlobalId>,
    confirmed: Arc<Slot<()>>,
    creation: OnceLock<RpcFuture>,
    owner_info: WorkerInfo,
    here: WorkerInfo,
}

impl RRefState {
    pub(crate) fn owner(inner: &Arc<AgentInner>, id: GlobalId) -> Arc<RRefState> {
        let confirmed = Slot::new();
        confirmed.complete(());
        Arc::new(RRefState {
            agent: Arc::downgrade(inner),
            owner: inner.me.id,
            id,
            fork: None,
            confirmed,
            creation: OnceLock::new(),
            owner_info: inner.me.clone(),
            here: inner.me.clone(),
        })
    }

    pub(crate) fn user(
        inner: &Arc<AgentInner>,
        owner: u32,
        id: GlobalId,
        fork: GlobalId,
        confirmed: bool,
    ) -> Arc<RRefState> {
        inner.rrefs.users.fetch_add(1, Ordering::AcqRel);
        let slot = Slot::new();
        if confirmed {
            slot.complete(());
        }
        Arc::new(RRefState {
            agent: Arc::downgrade(inner),
            owner,
            id,
            fork: Some(fork),
            confirmed: slot,
            creation: OnceLock::new(),
            owner_info: inner.worker_info(owner),
            here: inner.me.clone(),
        })
    }

    pub(crate) fn set_creation(&self, f: RpcFuture) {
        let _ = self.creation.set(f);
    }

    fn confirm(&self) {
        self.confirmed.complete(());
    }

    fn describe(&self) -> String {
        match self.fork {
            None => format!("OwnerRRef({})", self.id),
            Some(f) => format!("UserRRef(id={}, fork={})", self.id, f),
        }
    }
}

impl Drop for RRefState {
    fn drop(&mut self) {
        let Some(inner) = self.agent.upgrade() else { return };
        match self.fork {
            None => inner.rrefs.owner_handle_dropped(self.id),
            Some(fork) => {
                inner.rrefs.users.fetch_sub(1, Ordering::AcqRel);
                if inner.check_running().is_err() {
                    return;
                }
                let (owner, id) = (self.owner, self.id);
                let confirmed = Completion::new(self.confirmed.clone());
                if confirmed.is_done() {
                    inner.send_control(owner, Body::Delete { rref: id, fork }, |_, _| {});
                } else {
                    // The owner must know the fork before it hears that it is gone.
                    inner.control_in_flight.fetch_add(1, Ordering::AcqRel);
                    let handle = inner.handle.clone();
                    handle.spawn(async move {
                        confirmed.await;
                        inner.send_control(owner, Body::Delete { rref: id, fork }, |_, _| {});
                        inner.control_in_flight.fetch_sub(1, Ordering::AcqRel);
                    });
                }
            }
        }
    }
}

/// A reference to a value of type `T` owned by some worker.
///
/// Clones share one handle. Send it to other workers inside a call's value (it serializes as a
/// fork); the owner keeps the value until every reference anywhere is dropped.
pub struct RRef<T> {
    state: Arc<RRefState>,
    _value: PhantomData<fn() -> T>,
}

impl<T> Clone for RRef<T> {
    fn clone(&self) -> Self {
        RRef {
            state: self.state.clone(),
            _value: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for RRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.state.describe())
    }
}

impl<T> RRef<T> {
    pub(crate) fn from_state(state: Arc<RRefState>) -> Self {
        RRef {
            state,
            _value: PhantomData,
        }
    }

    pub fn owner(&self) -> &WorkerInfo {
        &self.state.owner_info
    }

    pub fn is_owner(&self) -> bool {
        self.state.fork.is_none()
    }

    /// True once the owner knows this reference (always true on the owner).
    pub fn confirmed_by_owner(&self) -> bool {
        self.state.confirmed.is_done()
    }

    fn agent(&self) -> Result<Arc<AgentInner>, RpcError> {
        let inner = self.state.agent.upgrade().ok_or(RpcError::Shutdown)?;
        inner.check_running()?;
        Ok(inner)
    }

    /// The creating call's result, if this reference came from `remote` and it failed.
    fn creation_error(&self) -> Option<RpcError> {
        match self.state.creation.get()?.try_get()? {
            Err(e) => Some(RpcError::RRefCreation(Box::new(e))),
            Ok(_) => None,
        }
    }
}

impl<T: DeserializeOwned + Send + Sync + 'static> RRef<T> {
    /// A copy of the value, fetched from the owner (on the owner: a copy of the local value).
    /// Waits up to the default timeout.
    pub fn to_here(&self) -> Result<T, RpcError> {
        let inner = self.agent()?;
        self.to_here_timeout(inner.options.default_timeout)
    }

    /// [`to_here`](Self::to_here) with its own timeout (zero: none).
    pub fn to_here_timeout(&self, timeout: Duration) -> Result<T, RpcError> {
        self.fetch(timeout).wait().and_then(|p| p.decode())
    }

    /// The fetch as a future (for async code).
    pub fn fetch(&self, timeout: Duration) -> RpcFuture {
        let inner = match self.agent() {
            Ok(i) => i,
            Err(e) => return Completion::ready(Err(e)),
        };
        if let Some(e) = self.creation_error() {
            return Completion::ready(Err(e));
        }
        if self.is_owner() {
            let value = inner.rrefs.value(self.state.id);
            let owner = inner.me.name.clone();
            let local = match value.try_get() {
                Some(v) => v,
                None => match timeout.is_zero() {
                    true => Some(value.wait()),
                    false => value.wait_timeout(timeout),
                }
                .unwrap_or(Err(RpcError::Timeout { worker: owner, timeout })),
            };
            return Completion::ready(local.and_then(|v| v.to_payload()));
        }
        inner.start_call(
            self.state.owner,
            Body::Fetch { rref: self.state.id },
            Payload::empty(),
            timeout,
        )
    }

    /// The value itself, shared. Only on the owner; elsewhere an error naming the owner.
    pub fn local_value(&self) -> Result<Arc<T>, RpcError> {
        let inner = self.agent()?;
        if !self.is_owner() {
            return Err(RpcError::NotOwner {
                rref: self.state.describe(),
                here: self.state.here.to_string(),
                owner: self.state.owner_info.to_string(),
            });
        }
        let value = inner.rrefs.value(self.state.id).wait()?;
        value.get::<T>().map_err(|_| RpcError::WrongType {
            rref: self.state.describe(),
            expected: std::any::type_name::<T>(),
        })
    }

    /// Proxy: runs the method handler `method` on the value, on its owner, and returns the
    /// result's future.
    pub fn rpc_async<A: Serialize + ?Sized>(&self, method: &str, arg: &A) -> RpcFuture {
        let inner = match self.agent() {
            Ok(i) => i,
            Err(e) => return Completion::ready(Err(e)),
        };
        let payload = match Payload::encode(arg) {
            Ok(p) => p,
            Err(e) => return Completion::ready(Err(e)),
        };
        let body = Body::Method {
            rref: self.state.id,
            handler: method.to_owned(),
        };
        let timeout = inner.options.default_timeout;
        inner.start_call(self.state.owner, body, payload, timeout)
    }

    /// Proxy: runs `method` on the value on its owner and waits for the result.
    pub fn rpc_sync<A: Serialize + ?Sized, R: DeserializeOwned>(&self, method: &str, arg: &A) -> Result<R, RpcError> {
        self.rpc_async(method, arg).wait()?.decode()
    }
}

impl<T> Serialize for RRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match encode_rref(&self.state) {
            Some(i) => s.serialize_u32(i),
            None => Err(serde::ser::Error::custom(
                "an RRef can only be serialized inside a call's value (Payload::encode)",
            )),
        }
    }
}

impl<'de, T> Deserialize<'de> for RRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let i = u32::deserialize(d)?;
        decode_rref(i)
            .map(RRef::from_state)
            .ok_or_else(|| serde::de::Error::custom(format!("RRef #{i} is not in this value")))
    }
}
