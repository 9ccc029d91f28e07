//! Lifecycle: init (join, store, pipes), the group barrier, leave with the store hand-off, and
//! shutdown.
//!
//! The lifecycle driver: `impl AgentInner` work across parts (see [`crate::agent`] for the
//! layout); its own state is in [`crate::parts`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_channel::{Context, Message, Pipe};

use crate::calls::Outstanding;
use crate::device_map::{self, WorkerDevices};
use crate::error::{HandlerError, InitError, ShutdownError};
use crate::gpu;
use crate::hub::{Agent, AgentInner, CallContext, Registry, DOWN, RUNNING, RUNNING_STATE};
use crate::membership::{self, Announce};
use crate::name::{validate_name, WorkerInfo};
use crate::options::{self, AgentOptions, Connect};
use crate::parts::client::Client;
use crate::parts::peers::{Peer, Peers};
use crate::parts::server::Server;
use crate::payload::Payload;
use crate::peers::watch_members;
use crate::pool::Pool;
use crate::rref::RRefTable;
use crate::server::serve_pipe;
use crate::store::{Snapshot, Store, StoreError, StoreServer, StoreUrl};
use crate::wire::{self, Body, Envelope};

/// The internal handler that takes over the embedded store from a leaving host.
pub(crate) const H_TAKEOVER: &str = "sluice.store.takeover";

pub(crate) fn store_error(e: StoreError) -> InitError {
    match e {
        StoreError::Timeout { key, timeout } => InitError::Timeout {
            timeout,
            waiting_for: format!("store key `{key}` (is every worker started?)"),
        },
        other => InitError::Store(other.to_string()),
    }
}

pub(crate) fn init(options: AgentOptions, mut registry: Registry) -> Result<Agent, InitError> {
    validate_name(&options.name)?;
    if let Some(devices) = &options.devices {
        gpu::check_local(&options.name, devices)?;
    }
    let mut resolved = options::resolve(&options)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(options.io_threads)
        .thread_name(format!("sluice-io-{}", options.name))
        .enable_all()
        .build()?;
    let handle = runtime.handle().clone();
    let deadline = Instant::now() + options.init_timeout;
    let left = move || deadline.saturating_duration_since(Instant::now());
    registry.handler(H_TAKEOVER, |ctx: &CallContext, snapshot: Snapshot| {
        ctx.agent
            .inner
            .take_over_store(snapshot)
            .map_err(|e| HandlerError::new("StoreTakeover", e.to_string()))
    });

    let (store_server, store, context, mut listener, announce, listing, formation, restart) =
        runtime.block_on(async {
            // A launcher that serves the store itself says so (`SLUICE_STORE_SERVED`).
            let serves = matches!(resolved.store, StoreUrl::Tcp(_))
                && resolved.rank == Some(options.store_rank)
                && std::env::var_os("SLUICE_STORE_SERVED").is_none();
            let server = match (&resolved.store, serves) {
                (StoreUrl::Tcp(addr), true) => {
                    match StoreServer::start_with(addr, Snapshot::default(), resolved.secret.clone()).await {
                        Ok(s) => Some(s),
                        Err(e) => return Err(InitError::Store(e.to_string())),
                    }
                }
                _ => None,
            };
            // Port 0: a group of one serves its store wherever the server bound (no free port
            // to pick and lose to a race). Nobody else could find it, so a bigger group, or a
            // worker that does not serve the store, is told so.
            if let StoreUrl::Tcp(addr) = &resolved.store {
                if options::port_of(addr) == Some(0) {
                    match &server {
                        Some(s) if resolved.world_size == 1 => resolved.store = StoreUrl::Tcp(s.address().to_owned()),
                        _ => {
                            return Err(InitError::Config(format!(
                                "store address {addr}: port 0 is for a group of one that serves its own store; \
                                 give the others a real port"
                            )))
                        }
                    }
                }
            }
            let store = Store::connect(&resolved.store, left(), resolved.secret.clone())
                .await
                .map_err(store_error)?;
            // A name seen before means a restart: this incarnation gets a fresh id.
            let name_key = membership::name_key(&options.name);
            let name_seen = store
                .list(&name_key)
                .await
                .map_err(store_error)?
                .entries
                .iter()
                .any(|(k, _)| *k == name_key);
            // In a fixed group a seen name is a restart only once the group has formed; before
            // that it is a duplicate, which validation reports.
            let restart = match resolved.rank {
                Some(_) if name_seen => store.add("init", 0).await.map_err(store_error)? >= resolved.world_size as i64,
                _ => name_seen,
            };
            let id = match resolved.rank {
                Some(rank) if !restart => rank,
                _ => {
                    let n = store.add("ids/next", 1).await.map_err(store_error)?;
                    let id = membership::ELASTIC_BASE as i64 + n - 1;
                    if id > membership::MAX_ID as i64 {
                        return Err(InitError::Config(format!(
                            "the group has handed out every worker id ({} joins)",
                            n
                        )));
                    }
                    id as u32
                }
            };
            let mut pipe_options = options.pipe.clone();
            pipe_options.name = options.name.clone();
            pipe_options.secret = resolved.secret.clone();
            let context = Context::new(pipe_options)?;
            let listener = context.listen(&options.listen).await?;
            let announce = Announce {
                version: wire::AGENT_VERSION,
                name: options.name.clone(),
                id,
                address: listener.address().to_owned(),
                devices: WorkerDevices {
                    name: options.name.clone(),
                    devices: options.devices.clone().unwrap_or_else(gpu::local_devices),
                    maps: options.device_maps.clone(),
                },
            };
            // A live member with our name is either a duplicate or our own crashed incarnation
            // whose membership has not expired yet: wait for it to go.
            let mut listing = store.list("m/").await.map_err(store_error)?;
            while restart || resolved.rank.is_none() {
                let (live, _) = membership::parse_listing(&listing.entries);
                let Some(other) = live.values().find(|a| a.name == options.name) else {
                    break;
                };
                if left().is_zero() {
                    return Err(InitError::DuplicateName {
                        name: options.name.clone(),
                        first: other.id,
                        second: id,
                    });
                }
                if let Some(l) = store.watch("m/", listing.revision, left()).await.map_err(store_error)? {
                    listing = l;
                }
            }
            let bytes = postcard::to_allocvec(&announce).map_err(|e| InitError::Config(e.to_string()))?;
            store
                .set_ephemeral(&membership::live_key(id), bytes.clone())
                .await
                .map_err(store_error)?;
            store
                .set(&name_key, id.to_string().into_bytes())
                .await
                .map_err(store_error)?;
            // A fixed group's first start waits for every rank's announcement. They are kept
            // apart from the (ephemeral) membership keys, so a rank that read the whole group and
            // left at once (failing validation) still counts: every rank validates the same group
            // and fails with the same error.
            let mut formation = None;
            if resolved.rank.is_some() && !restart {
                store
                    .set(&membership::formed_key(id), bytes)
                    .await
                    .map_err(store_error)?;
                let mut formed = store.list(membership::FORMED).await.map_err(store_error)?;
                loop {
                    let announced = membership::parse_formation(&formed.entries);
                    if (0..resolved.world_size).all(|r| announced.contains_key(&r)) {
                        formation = Some(announced);
                        break;
                    }
                    let missing: Vec<u32> = (0..resolved.world_size)
                        .filter(|r| !announced.contains_key(r))
                        .collect();
                    match store
                        .watch(membership::FORMED, formed.revision, left())
                        .await
                        .map_err(store_error)?
                    {
                        Some(l) => formed = l,
                        None => {
                            return Err(InitError::Timeout {
                                timeout: options.init_timeout,
                                waiting_for: format!("ranks {missing:?} to join (is every worker started?)"),
                            })
                        }
                    }
                }
            }
            let listing = store.list("m/").await.map_err(store_error)?;
            if resolved.rank.is_some() && !restart {
                // The store's host stays until everyone has read the complete group, even when
                // validation is about to fail (all workers then report the same error).
                store.add("init/read", 1).await.map_err(store_error)?;
                if server.is_some() {
                    store
                        .wait_count("init/read", resolved.world_size as i64, left())
                        .await
                        .map_err(store_error)?;
                }
            }
            Ok::<_, InitError>((server, store, context, listener, announce, listing, formation, restart))
        })?;

    let (live, _) = membership::parse_listing(&listing.entries);
    // A fixed group validates the group as formed; later joiners what is live.
    let group = formation.as_ref().unwrap_or(&live);
    for a in group.values() {
        if a.version != wire::AGENT_VERSION {
            return Err(InitError::Config(format!(
                "worker {} ({}) speaks agent protocol version {}, this worker speaks {}",
                a.id,
                a.name,
                a.version,
                wire::AGENT_VERSION
            )));
        }
        validate_name(&a.name)?;
    }
    let mut names = HashMap::new();
    for a in group.values() {
        if let Some(first) = names.insert(a.name.clone(), a.id) {
            return Err(InitError::DuplicateName {
                name: a.name.clone(),
                first,
                second: a.id,
            });
        }
    }
    let devices: Vec<WorkerDevices> = group.values().map(|a| a.devices.clone()).collect();
    if resolved.rank.is_some() && !restart {
        device_map::validate(&devices)?;
    } else {
        // Peers named in maps may join later; what is here must still be consistent.
        device_map::validate_present(&devices)?;
    }

    let me = WorkerInfo {
        name: options.name.clone(),
        id: announce.id,
    };
    let pool = Pool::new(&format!("sluice-handler-{}", options.name), options.pool_threads);
    let inner = Arc::new(AgentInner {
        me,
        runtime: Mutex::new(None),
        handle: handle.clone(),
        context,
        state: AtomicU8::new(RUNNING_STATE),
        activity: AtomicU64::new(0),
        rrefs: RRefTable::new(announce.id),
        client: Client::new(announce.id, &options),
        registry,
        server: Server::new(pool, options.max_message_bytes),
        peers: Peers::new(
            announce.clone(),
            resolved.world_size,
            store,
            resolved.store.clone(),
            resolved.secret.clone(),
            store_server,
        ),
        options,
    });
    {
        let mut m = inner.peers.members.write().unwrap();
        for a in live.values() {
            inner.peers.add_member(&mut m, a.clone());
        }
    }

    let weak = Arc::downgrade(&inner);
    handle.spawn(async move {
        loop {
            let accepted = listener.accept().await;
            let Some(inner) = weak.upgrade() else { return };
            if inner.is_down() {
                return;
            }
            match accepted {
                Ok(pipe) => {
                    inner.server.incoming.lock().unwrap().push(pipe.clone());
                    tokio::spawn(serve_pipe(inner, pipe));
                }
                Err(e) => tracing::warn!(worker = %inner.me, error = %e, "refused an incoming pipe"),
            }
        }
    });
    let name_of = {
        let weak = Arc::downgrade(&inner);
        move |id| {
            weak.upgrade()
                .map_or_else(|| format!("worker {id}"), |inner| inner.peers.name_of(id))
        }
    };
    handle.spawn(Outstanding::run_timer(Arc::downgrade(&inner.client.calls), name_of));
    handle.spawn(watch_members(Arc::downgrade(&inner), listing.revision));
    *inner.runtime.lock().unwrap() = Some(runtime);

    let agent = Agent { inner, priority: None };
    let inner = &agent.inner;
    let fixed_start = resolved.rank.is_some() && !restart;
    let result = handle.block_on(async {
        if fixed_start {
            inner
                .peers
                .store
                .barrier("init", inner.peers.static_world, left())
                .await
                .map_err(store_error)?;
        }
        if inner.options.connect == Connect::Eager {
            let ids: Vec<u32> = inner.peers.members.read().unwrap().by_id.keys().copied().collect();
            for id in ids {
                inner.pipe_to(id).await.map_err(|e| InitError::Config(e.to_string()))?;
            }
        }
        Ok::<_, InitError>(())
    });
    if let Err(e) = result {
        agent.inner.teardown();
        return Err(e);
    }
    tracing::debug!(worker = %agent.inner.me, restart, "agent ready");
    Ok(agent)
}

impl AgentInner {
    /// A barrier over the group: the members that exist at each check (a fixed group's ranks
    /// that are still here, and every worker that joined it later).
    pub(crate) async fn group_barrier(&self, key: &str, timeout: Duration) -> Result<(), StoreError> {
        let start = Instant::now();
        self.peers.store.add(key, 1).await?;
        loop {
            let world = self.peers.member_count();
            let step = Duration::from_millis(250).min(timeout.saturating_sub(start.elapsed()));
            match self.peers.store.wait_count(key, world as i64, step).await {
                Ok(_) => return Ok(()),
                Err(StoreError::Timeout { .. }) if start.elapsed() < timeout => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Serves the embedded store from here, from a leaving host's snapshot.
    pub(crate) fn take_over_store(&self, snapshot: Snapshot) -> Result<String, StoreError> {
        let addr = match &self.options.store_listen {
            Some(a) => a.clone(),
            None => {
                let host = self
                    .peers
                    .announce
                    .address
                    .rsplit_once(':')
                    .map_or("127.0.0.1", |(h, _)| h);
                format!("{host}:0")
            }
        };
        let server = self
            .handle
            .block_on(StoreServer::start_with(&addr, snapshot, self.peers.secret.clone()))?;
        let address = server.address().to_owned();
        tracing::info!(worker = %self.me, %address, "took over the store");
        *self.peers.store_server.lock().unwrap() = Some(server);
        Ok(address)
    }

    pub(crate) fn leave(self: &Arc<Self>, timeout: Duration) -> Result<(), ShutdownError> {
        if self.is_down() {
            return Err(ShutdownError::AlreadyShutDown);
        }
        let start = Instant::now();
        let id = self.me.id;
        // Our own work drains (replies to us, handlers we run, control messages), first while
        // we are still a member: a peer that sees us leave fails what it still awaits from us,
        // so a reply must be on its way before the marker is (a handler that tells us to leave
        // gets its answer).
        let drain = || {
            let mut last = self.outstanding();
            while last > 0 && start.elapsed() < timeout {
                std::thread::sleep(Duration::from_millis(2));
                last = self.outstanding();
            }
            last
        };
        drain();
        // The marker first: whoever sees our key go also sees that we left. The store moves
        // (if we serve it) before our key goes, so the successor hears of the leave as a leave.
        if let Err(e) = self
            .handle
            .block_on(self.peers.store.set(&membership::left_key(id), Vec::new()))
        {
            self.teardown();
            return Err(ShutdownError::Store(e.to_string()));
        }
        let handed = self.hand_off_store();
        if let Err(e) = self.handle.block_on(self.peers.store.delete(&membership::live_key(id))) {
            self.teardown();
            return Err(ShutdownError::Store(e.to_string()));
        }
        // What arrived meanwhile drains too.
        let last = drain();
        // Goodbye on every pipe, so peers take the closing for a leave.
        let goodbye = Message {
            metadata: wire::encode(&Envelope::Goodbye),
            ..Message::default()
        };
        let pipes: Vec<Pipe> = {
            let m = self.peers.members.read().unwrap();
            let mut p: Vec<Pipe> = m.by_id.values().flat_map(|peer| peer.open_pipes()).collect();
            p.extend(self.server.incoming.lock().unwrap().iter().cloned());
            p
        };
        self.handle.block_on(async {
            for p in pipes {
                let _ = tokio::time::timeout(Duration::from_millis(500), p.write(&goodbye)).await;
            }
        });
        self.handle.block_on(self.peers.store.close());
        self.teardown();
        handed?;
        if last > 0 {
            return Err(ShutdownError::Timeout {
                timeout,
                outstanding: last,
            });
        }
        Ok(())
    }

    /// If this worker serves the embedded store, hands it to the member with the lowest id.
    pub(crate) fn hand_off_store(self: &Arc<Self>) -> Result<(), ShutdownError> {
        let guard = self.peers.store_server.lock().unwrap();
        let Some(server) = guard.as_ref() else { return Ok(()) };
        let successor = {
            let m = self.peers.members.read().unwrap();
            m.by_id
                .values()
                .filter(|p| p.info.id != self.me.id && !p.down.is_down())
                .map(|p| p.info.id)
                .min()
        };
        let Some(successor) = successor else {
            tracing::info!(worker = %self.me, "last member leaving; the store goes with it");
            return Ok(());
        };
        server.freeze();
        let snapshot = server.snapshot();
        let payload = match Payload::encode(&snapshot) {
            Ok(p) => p,
            Err(e) => return Err(ShutdownError::Store(e.to_string())),
        };
        let body = Body::Call {
            handler: H_TAKEOVER.into(),
        };
        let reply = self
            .start_call(successor, body, payload, Duration::from_secs(30))
            .wait();
        match reply.and_then(|p| p.decode::<String>()) {
            Ok(addr) => {
                server.moved_to(&addr);
                tracing::info!(worker = %self.me, to = successor, %addr, "store handed off");
                drop(guard);
                // Long polls hear `Moved` at once; give them a moment to read it.
                std::thread::sleep(Duration::from_millis(200));
                Ok(())
            }
            Err(e) => {
                server.unfreeze();
                Err(ShutdownError::Store(format!(
                    "could not hand the store to worker {successor}: {e}"
                )))
            }
        }
    }

    pub(crate) fn outstanding(&self) -> u64 {
        let calls = self.client.calls.len() as i64;
        let n = calls
            + self.server.handlers_running.load(Ordering::Acquire)
            + self.client.control_in_flight.load(Ordering::Acquire);
        n.max(0) as u64
    }

    pub(crate) fn shutdown(&self, timeout: Option<Duration>) -> Result<(), ShutdownError> {
        if self.is_down() {
            return Err(ShutdownError::AlreadyShutDown);
        }
        let start = Instant::now();
        let left = || match timeout {
            None => Duration::from_secs(365 * 24 * 3600),
            Some(t) => t.saturating_sub(start.elapsed()),
        };
        // Every member there is, joiners of a fixed group included: the store's host must
        // not leave before the last of them has read the quiet round.
        let world_at_start = self.peers.member_count();
        let result = self.handle.block_on(async {
            let mut round = 0u64;
            let mut last = 0;
            loop {
                if timeout.is_some() && left().is_zero() {
                    return Err(ShutdownError::Timeout {
                        timeout: timeout.unwrap_or_default(),
                        outstanding: last,
                    });
                }
                let report = self.outstanding() + self.activity.swap(0, Ordering::AcqRel);
                let sum_key = format!("shutdown/{round}/sum");
                let r = async {
                    self.peers.store.add(&sum_key, report as i64).await?;
                    self.group_barrier(&format!("shutdown/{round}/arrive"), left()).await?;
                    self.peers.store.add(&sum_key, 0).await
                }
                .await;
                let sum = match r {
                    Ok(s) => s as u64,
                    Err(crate::store::StoreError::Timeout { .. }) => {
                        return Err(ShutdownError::Timeout {
                            timeout: timeout.unwrap_or_default(),
                            outstanding: last,
                        })
                    }
                    Err(e) => return Err(ShutdownError::Store(e.to_string())),
                };
                if sum == 0 {
                    break;
                }
                last = sum;
                round += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // Everyone saw the quiet round; the store's host waits until all have read it.
            let _ = self.peers.store.add("shutdown/left", 1).await;
            if self.peers.store_server.lock().unwrap().is_some() {
                // The group as it was when shutdown began: members that finish first leave the
                // membership, and must not make the host stop waiting for the slower ones.
                let world = world_at_start;
                let _ = self
                    .peers
                    .store
                    .wait_count("shutdown/left", world as i64, left().min(Duration::from_secs(10)))
                    .await;
            }
            Ok(())
        });
        let users = self.rrefs.users_alive();
        self.teardown();
        result?;
        if self.options.leak_check && users > 0 {
            return Err(ShutdownError::LeakedRRefs {
                count: users,
                detail: format!("{} still holds {users} user references", self.me),
            });
        }
        Ok(())
    }

    /// Stops everything at once.
    pub(crate) fn teardown(&self) {
        if self.state.swap(DOWN, Ordering::AcqRel) == DOWN {
            return;
        }
        self.client.calls.close();
        let peers: Vec<Arc<Peer>> = self.peers.members.read().unwrap().by_id.values().cloned().collect();
        for p in peers {
            p.close_lanes();
        }
        for p in self.server.incoming.lock().unwrap().drain(..) {
            p.close();
        }
        self.server.pool.stop();
        self.peers.store_server.lock().unwrap().take();
        if let Some(rt) = self.runtime.lock().unwrap().take() {
            rt.shutdown_background();
        }
        self.rrefs.clear();
        RUNNING.store(false, Ordering::Release);
        tracing::debug!(worker = %self.me, "agent down");
    }
}
