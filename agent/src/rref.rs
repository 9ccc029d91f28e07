//! Remote references: the public [`RRef`], the per-process handle behind it, and the driver
//! that runs the protocol of [`crate::rref_ledger`] (which holds the rules and their tests).
//!
//! The RRef layer reaches the agent only through [`RRefHost`]: who this worker is, whether it
//! runs, a call, and a control message with its outcome. Only control messages are retried (on
//! a lost acknowledgement); they are idempotent: the owner ignores a fork it already knows or
//! already deleted. User calls are never retried.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::completion::{Completion, RpcFuture, Slot};
use crate::error::RpcError;
use crate::name::WorkerInfo;
use crate::payload::{decode_rref, encode_rref, Carried, Payload, Value};
use crate::rref_ledger::{Effects, Ledger, Parent};
use crate::wire::{Body, GlobalId, WireRRef};

type ValueSlot = Arc<Slot<Result<Value, RpcError>>>;

/// What the RRef layer needs from the agent.
pub(crate) trait RRefHost: Send + Sync + 'static {
    fn me(&self) -> &WorkerInfo;
    fn worker_info(&self, id: u32) -> WorkerInfo;
    fn check_running(&self) -> Result<(), RpcError>;
    fn new_id(&self) -> GlobalId;
    fn rrefs(&self) -> &RRefTable;
    fn default_timeout(&self) -> Duration;
    fn call(self: Arc<Self>, to: u32, body: Body, payload: Payload, timeout: Duration) -> RpcFuture;
    /// Sends a control message, retried until acknowledged or the peer is gone; `then` runs
    /// once with the outcome.
    fn control(self: Arc<Self>, to: u32, body: Body, then: Box<dyn FnOnce(Result<(), RpcError>) + Send>);
}

/// The RRef bookkeeping of one worker: the protocol's state under one lock.
pub(crate) struct RRefTable {
    ledger: Mutex<Ledger<ValueSlot>>,
    /// Woken whenever an owner's answer to a fork arrives (see [`RRefTable::confirmed`]).
    confirmations: tokio::sync::Notify,
}

impl RRefTable {
    pub(crate) fn new(me: u32) -> RRefTable {
        RRefTable {
            ledger: Mutex::new(Ledger::new(me)),
            confirmations: tokio::sync::Notify::new(),
        }
    }

    /// Runs one input on the ledger, then does what it returned, outside the lock (dropping
    /// a value can drop references, which come back here).
    fn step<R>(
        &self,
        host: &Arc<dyn RRefHost>,
        f: impl FnOnce(&mut Ledger<ValueSlot>) -> (R, Effects<ValueSlot>),
    ) -> R {
        let (r, effects) = f(&mut self.ledger.lock().unwrap());
        run(host, effects);
        r
    }

    fn input(&self, host: &Arc<dyn RRefHost>, f: impl FnOnce(&mut Ledger<ValueSlot>) -> Effects<ValueSlot>) {
        self.step(host, |l| ((), f(l)))
    }

    /// A value this worker owns is being created (by `remote` to self or `Agent::rref`): its
    /// owner handle.
    pub(crate) fn owner_handle(&self, host: &Arc<dyn RRefHost>, id: GlobalId) -> Arc<RRefState> {
        self.ledger.lock().unwrap().owner_created(id, Slot::new);
        RRefState::new(host, host.me().id, id, None)
    }

    /// A user handle made by this worker's `remote` call to `owner` (registered by the call).
    pub(crate) fn remote_user_handle(
        &self,
        host: &Arc<dyn RRefHost>,
        owner: u32,
        id: GlobalId,
        fork: GlobalId,
    ) -> Arc<RRefState> {
        self.ledger.lock().unwrap().user_created(owner, id, fork);
        RRefState::new(host, owner, id, Some(fork))
    }

    pub(crate) fn set_value(&self, id: GlobalId, value: Result<Value, RpcError>) {
        let slot = self.ledger.lock().unwrap().existing_value(id).cloned();
        match slot {
            Some(s) => {
                s.complete(value);
            }
            None => tracing::debug!(%id, "value for an RRef nobody holds any more; dropped"),
        }
    }

    /// The value of an owned RRef (waits for its creation).
    pub(crate) fn value(&self, id: GlobalId) -> Completion<Result<Value, RpcError>> {
        Completion::new(self.ledger.lock().unwrap().value(id, Slot::new).clone())
    }

    /// A user reference `fork` to the owned value `id`, held by worker `holder`.
    pub(crate) fn add_fork_held(&self, id: GlobalId, fork: GlobalId, holder: u32) {
        self.ledger.lock().unwrap().add_fork_held(id, fork, holder, Slot::new);
    }

    pub(crate) fn delete_fork(&self, host: &Arc<dyn RRefHost>, id: GlobalId, fork: GlobalId) {
        self.input(host, |l| l.delete_fork(id, fork));
    }

    pub(crate) fn child_accepted(&self, host: &Arc<dyn RRefHost>, fork: GlobalId) {
        self.input(host, |l| l.child_accepted(fork));
    }

    /// `worker` is lost: the references it held are released here, and children forked for it
    /// will never be confirmed.
    pub(crate) fn peer_lost(&self, host: &Arc<dyn RRefHost>, worker: u32) {
        self.input(host, |l| l.peer_lost(worker));
    }

    /// The fork id a reference becomes when sent to `dest`, with the bookkeeping that keeps the
    /// value alive until the receiver is known to the owner.
    pub(crate) fn fork_for(&self, host: &Arc<dyn RRefHost>, r: &RRefState, dest: u32) -> GlobalId {
        let fork = host.new_id();
        let parent = match r.fork {
            None => Parent::Owner(r.id),
            Some(f) => Parent::User(f),
        };
        self.ledger.lock().unwrap().fork_for(parent, r.id, fork, dest);
        fork
    }

    /// A send failed: forget the forks made for it.
    pub(crate) fn undo_forks(&self, host: &Arc<dyn RRefHost>, forks: &[GlobalId]) {
        if !forks.is_empty() {
            self.input(host, |l| l.undo_forks(forks));
        }
    }

    /// A reference arrived from `sender`: the handle this process uses for it.
    pub(crate) fn materialize(&self, host: &Arc<dyn RRefHost>, w: &WireRRef, sender: u32) -> Arc<RRefState> {
        self.input(host, |l| l.arrived(w, sender, Slot::new));
        let fork = (w.owner != host.me().id).then_some(w.fork);
        RRefState::new(host, w.owner, w.id, fork)
    }

    pub(crate) fn owned_count(&self) -> usize {
        self.ledger.lock().unwrap().owned_count()
    }

    pub(crate) fn users_alive(&self) -> usize {
        self.ledger.lock().unwrap().users_held()
    }

    fn is_confirmed(&self, fork: GlobalId) -> bool {
        self.ledger.lock().unwrap().is_confirmed(fork)
    }

    /// The user references among `carried` (a received payload's RRefs) that their owners have
    /// not confirmed yet.
    pub(crate) fn unconfirmed(&self, carried: &[Carried]) -> Vec<GlobalId> {
        if carried.is_empty() {
            // The common call carries none: no lock on the hot path.
            return Vec::new();
        }
        let ledger = self.ledger.lock().unwrap();
        carried
            .iter()
            .filter_map(|c| c.downcast_ref::<RRefState>()?.fork)
            .filter(|&f| !ledger.is_confirmed(f))
            .collect()
    }

    /// Waits until the owners have answered every fork in `forks` (accepted, or failed
    /// because the owner is gone: either way the reference is settled).
    pub(crate) async fn confirmed(&self, forks: &[GlobalId]) {
        loop {
            let answered = self.confirmations.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if forks.iter().all(|&f| self.is_confirmed(f)) {
                return;
            }
            answered.await;
        }
    }

    pub(crate) fn clear(&self) {
        let released = self.ledger.lock().unwrap().clear().released;
        drop(released);
    }
}

/// Does what the ledger asked: sends (while the agent runs), and drops released values.
fn run(host: &Arc<dyn RRefHost>, effects: Effects<ValueSlot>) {
    let Effects { send, released } = effects;
    drop(released);
    if host.check_running().is_err() {
        return;
    }
    for (to, body) in send {
        let then: Box<dyn FnOnce(Result<(), RpcError>) + Send> = match body {
            Body::ForkRequest { fork, .. } => {
                let weak = Arc::downgrade(host);
                Box::new(move |outcome| {
                    // Also when the owner is gone: nothing will confirm this reference, and
                    // its delete must not wait forever.
                    if let Some(host) = weak.upgrade() {
                        let accepted = outcome.is_ok();
                        host.rrefs().input(&host, |l| l.fork_confirmed(fork, accepted));
                        host.rrefs().confirmations.notify_waiters();
                    }
                })
            }
            _ => Box::new(|_| {}),
        };
        host.clone().control(to, body, then);
    }
}

/// One process's handle on a reference; shared by every clone of the `RRef`.
pub struct RRefState {
    host: Weak<dyn RRefHost>,
    pub(crate) owner: u32,
    pub(crate) id: GlobalId,
    /// `None` for an owner handle.
    pub(crate) fork: Option<GlobalId>,
    creation: OnceLock<RpcFuture>,
    owner_info: WorkerInfo,
    here: WorkerInfo,
}

impl RRefState {
    fn new(host: &Arc<dyn RRefHost>, owner: u32, id: GlobalId, fork: Option<GlobalId>) -> Arc<RRefState> {
        Arc::new(RRefState {
            host: Arc::downgrade(host),
            owner,
            id,
            fork,
            creation: OnceLock::new(),
            owner_info: host.worker_info(owner),
            here: host.me().clone(),
        })
    }

    pub(crate) fn set_creation(&self, f: RpcFuture) {
        let _ = self.creation.set(f);
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
        let Some(host) = self.host.upgrade() else { return };
        let (id, fork) = (self.id, self.fork);
        host.rrefs().input(&host, |l| match fork {
            None => l.owner_dropped(id),
            Some(f) => l.user_dropped(f),
        });
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
        match (self.state.fork, self.state.host.upgrade()) {
            (Some(f), Some(host)) => host.rrefs().is_confirmed(f),
            _ => true,
        }
    }

    fn agent(&self) -> Result<Arc<dyn RRefHost>, RpcError> {
        let inner = self.state.host.upgrade().ok_or(RpcError::Shutdown)?;
        inner.check_running()?;
        Ok(inner)
    }

    /// Completes once the value exists on its owner: with an empty payload, or with the
    /// error that kept it from being created (a reference from `remote`, or a proxy's
    /// `remote`). References that were never created remotely are ready at once.
    pub fn created(&self) -> RpcFuture {
        match self.state.creation.get() {
            Some(f) => f.clone(),
            None => Completion::ready(Ok(Payload::empty())),
        }
    }

    /// The creating call's result, if this reference came from `remote` and it failed.
    fn creation_error(&self) -> Option<RpcError> {
        match self.state.creation.get()?.try_get()? {
            Err(e) => Some(RpcError::RRefCreation(Box::new(e))),
            Ok(_) => None,
        }
    }
}

impl<T> RRef<T> {
    /// The value as its owner holds it (an object or a payload). Only on the owner.
    pub fn local(&self) -> Result<Value, RpcError> {
        let inner = self.agent()?;
        if !self.is_owner() {
            return Err(RpcError::NotOwner {
                rref: self.state.describe(),
                here: self.state.here.to_string(),
                owner: self.state.owner_info.to_string(),
            });
        }
        inner.rrefs().value(self.state.id).wait()
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
            let value = inner.rrefs().value(self.state.id);
            let owner = inner.me().name.clone();
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
        inner.call(
            self.state.owner,
            Body::Fetch { rref: self.state.id },
            Payload::empty(),
            timeout,
        )
    }

    /// Proxy: runs the method handler `method` on the value, on its owner, and returns the
    /// result's future. The deadline is the agent's default timeout from now.
    pub fn rpc_async<A: Serialize + ?Sized>(&self, method: &str, arg: &A) -> RpcFuture {
        match self.default_timeout() {
            Ok(timeout) => self.rpc_async_timeout(method, arg, timeout),
            Err(e) => Completion::ready(Err(e)),
        }
    }

    /// [`rpc_async`](Self::rpc_async) with its own timeout (zero: none).
    pub fn rpc_async_timeout<A: Serialize + ?Sized>(&self, method: &str, arg: &A, timeout: Duration) -> RpcFuture {
        match Payload::encode(arg) {
            Ok(p) => self.rpc_async_raw(method, p, timeout),
            Err(e) => Completion::ready(Err(e)),
        }
    }

    /// Proxy with a whole payload (tensors included) as the argument, for methods registered
    /// with [`raw_method`](crate::handler::Handlers::raw_method); `timeout` zero: none.
    pub fn rpc_async_raw(&self, method: &str, payload: Payload, timeout: Duration) -> RpcFuture {
        let inner = match self.agent() {
            Ok(i) => i,
            Err(e) => return Completion::ready(Err(e)),
        };
        let body = Body::Method {
            rref: self.state.id,
            handler: method.into(),
        };
        inner.call(self.state.owner, body, payload, timeout)
    }

    /// The agent's default timeout (what the proxies without `_timeout` use).
    pub fn default_timeout(&self) -> Result<Duration, RpcError> {
        Ok(self.agent()?.default_timeout())
    }

    /// Proxy: runs `method` on the value on its owner and waits for the result.
    pub fn rpc_sync<A: Serialize + ?Sized, R: DeserializeOwned>(&self, method: &str, arg: &A) -> Result<R, RpcError> {
        self.rpc_async(method, arg).wait()?.decode()
    }

    /// [`rpc_sync`](Self::rpc_sync) with its own timeout (zero: none).
    pub fn rpc_sync_timeout<A: Serialize + ?Sized, R: DeserializeOwned>(
        &self,
        method: &str,
        arg: &A,
        timeout: Duration,
    ) -> Result<R, RpcError> {
        self.rpc_async_timeout(method, arg, timeout).wait()?.decode()
    }

    /// Proxy, `remote` form: runs `method` on the value on its owner, which keeps the result
    /// as a new reference's value and owns it; returns that reference at once (a failure
    /// surfaces on its next use, as with [`Agent::remote`](crate::Agent::remote)).
    pub fn remote<R, A: Serialize + ?Sized>(&self, method: &str, arg: &A) -> Result<RRef<R>, RpcError> {
        self.remote_timeout(method, arg, self.default_timeout()?)
    }

    /// [`remote`](Self::remote) with its own timeout for the creating call (zero: none).
    pub fn remote_timeout<R, A: Serialize + ?Sized>(
        &self,
        method: &str,
        arg: &A,
        timeout: Duration,
    ) -> Result<RRef<R>, RpcError> {
        self.remote_raw(method, Payload::encode(arg)?, timeout)
    }

    /// [`remote_timeout`](Self::remote_timeout) with a whole payload (tensors included) as the
    /// argument, for methods registered with [`raw_method`](crate::handler::Handlers::raw_method).
    pub fn remote_raw<R>(&self, method: &str, payload: Payload, timeout: Duration) -> Result<RRef<R>, RpcError> {
        let host = self.agent()?;
        let (target, handler) = (self.state.id, crate::wire::HandlerName::from(method));
        let state = create_remote(&host, self.state.owner, payload, timeout, |rref, fork| {
            Body::RemoteMethod {
                target,
                handler,
                rref,
                fork,
            }
        });
        Ok(RRef::from_state(state))
    }
}

impl<T: DeserializeOwned + Send + Sync + 'static> RRef<T> {
    /// A copy of the value, fetched from the owner (on the owner: a copy of the local value).
    /// Waits up to the default timeout.
    pub fn to_here(&self) -> Result<T, RpcError> {
        let inner = self.agent()?;
        self.to_here_timeout(inner.default_timeout())
    }

    /// [`to_here`](Self::to_here) with its own timeout (zero: none).
    pub fn to_here_timeout(&self, timeout: Duration) -> Result<T, RpcError> {
        self.fetch(timeout).wait().and_then(|p| p.decode())
    }

    /// The value itself, shared. Only on the owner; elsewhere an error naming the owner.
    pub fn local_value(&self) -> Result<Arc<T>, RpcError> {
        let value = self.local()?;
        value.get::<T>().map_err(|_| RpcError::WrongType {
            rref: self.state.describe(),
            expected: std::any::type_name::<T>(),
        })
    }
}

/// Starts the call that creates a value on `owner` (kept there as a new reference's value)
/// and returns the caller's handle to it: the owner's own handle when the caller is the
/// owner, else a user reference whose fork the call carries. `body` gets the new reference's
/// id and that fork.
pub(crate) fn create_remote(
    host: &Arc<dyn RRefHost>,
    owner: u32,
    payload: Payload,
    timeout: Duration,
    body: impl FnOnce(GlobalId, Option<GlobalId>) -> Body,
) -> Arc<RRefState> {
    let id = host.new_id();
    let (state, fork) = if owner == host.me().id {
        (host.rrefs().owner_handle(host, id), None)
    } else {
        let fork = host.new_id();
        (host.rrefs().remote_user_handle(host, owner, id, fork), Some(fork))
    };
    let created = host.clone().call(owner, body(id, fork), payload, timeout);
    state.set_creation(created);
    state
}

impl<T> Serialize for RRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match encode_rref(self.state.clone()) {
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
            .and_then(|a| a.downcast::<RRefState>().ok())
            .map(RRef::from_state)
            .ok_or_else(|| serde::de::Error::custom(format!("RRef #{i} is not in this value")))
    }
}
