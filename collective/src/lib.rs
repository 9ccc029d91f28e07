//! Collectives over Sluice pipes: a group of ranks that exchange buffers point to point (with
//! tags) and together (allreduce, broadcast, reduce, allgather, gather, scatter,
//! reduce-scatter, all-to-all, barrier), for data parallelism the way NCCL, Gloo and MPI serve
//! it, over the fastest path each pair of ranks shares (shared memory and cross-memory attach on
//! one host, TCP or RDMA across hosts).
//!
//! ```ignore
//! let group = Group::new(GroupOptions::from_env("grads")?).await?;
//! group.all_reduce(bytemuck::cast_slice_mut(&mut grads), DType::F32, ReduceOp::Sum).await?;
//! ```
//!
//! Contracts:
//! - Every rank calls the group's collectives in the same order (each takes the next sequence
//!   number when it is *called*, not when it is first polled, so several may be in flight).
//!   Point-to-point messages match by sender and tag, in the order sent.
//! - Buffers are raw bytes with a dtype ([`DType`], every dtype Sluice carries); reductions are
//!   [`ReduceOp`]s, f16 and bf16 accumulated in f32 per step. Sizes must agree across ranks: a
//!   mismatch is an error on the ranks that see it, never a hang (every wait has the group's
//!   timeout).
//! - Results are the same bytes on every rank (every element is reduced once, in a fixed order,
//!   then copied), so data-parallel replicas stay bitwise identical.
//! - A rank that is lost (its pipe fails) fails the whole group: every pending and later
//!   operation returns an error naming it, on every rank (the ranks that see the loss tell the
//!   others).
//!
//! Algorithms (see [`algorithm`]): small buffers go directly to every rank that needs them (one
//! step of latency, every rank reduces the full buffer in rank order); large ones take a ring
//! (reduce-scatter then allgather: each byte crosses each link about twice, each rank reduces
//! 1/n of the data). On one host, buffers from [`LOCAL_MIN`] up are not sent at all: each rank
//! reads what it needs straight out of the others' memory (cross-memory attach), one copy per
//! byte (see the `local` module).
#![forbid(unsafe_code)]

mod local;
mod mesh;
pub mod reduce;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sluice_agent::store::{Store, StoreServer, StoreUrl};
use sluice_channel::{Context, ContextOptions, PipeError};

pub use reduce::ReduceOp;
pub use sluice_dlpack::DType;

use mesh::{Kind, Mesh};

/// What went wrong in a group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    #[error("rank {rank} was lost: {why}")]
    PeerLost { rank: u32, why: String },
    #[error("the group was aborted by rank {by}: {why}")]
    Aborted { by: u32, why: String },
    #[error("{}: {detail}", rank.map_or("a peer".to_owned(), |r| format!("rank {r}")))]
    Peer { rank: Option<u32>, detail: String },
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("store: {0}")]
    Store(String),
    #[error("pipe: {0}")]
    Pipe(String),
    #[error("the group was closed")]
    Closed,
}

impl From<PipeError> for CollectiveError {
    fn from(e: PipeError) -> Self {
        CollectiveError::Pipe(e.to_string())
    }
}

type Result<T> = std::result::Result<T, CollectiveError>;

/// How to form a group.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// The group's name: groups of different names over the same ranks never mix messages.
    /// Unique for the store's lifetime: a group formed again under the same name over the same
    /// store would find the first one's addresses there.
    pub name: String,
    pub rank: u32,
    pub world_size: u32,
    /// The store's address (`host:port`), the same one the RPC agent uses.
    pub store: String,
    /// Whether this rank serves the store (rank 0 by default, unless a launcher serves it). Set
    /// it to false when something else in the job already serves it at that address (an RPC
    /// agent, or an earlier group).
    pub serve_store: bool,
    /// The address this rank listens on for its peers (routable across hosts).
    pub host: String,
    /// Every wait in the group, formation included, ends after this long with an error.
    pub timeout: Duration,
    /// The transports and channels the group's pipes may use.
    pub pipe: ContextOptions,
}

impl GroupOptions {
    /// Options from torchrun's variables: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
    /// (or `SLUICE_STORE=[tcp://]host:port`, as `sluice launch` sets it); rank 0 serves the store unless `SLUICE_STORE_SERVED` is set.
    pub fn from_env(name: &str) -> Result<GroupOptions> {
        let var = |k: &str| std::env::var(k).map_err(|_| CollectiveError::Invalid(format!("{k} is not set")));
        let number = |k: &str| -> Result<u32> {
            var(k)?
                .parse()
                .map_err(|_| CollectiveError::Invalid(format!("{k} is not a number")))
        };
        let rank = number("RANK")?;
        let world_size = number("WORLD_SIZE")?;
        let store = match std::env::var("SLUICE_STORE") {
            Ok(s) => s,
            Err(_) => format!("{}:{}", var("MASTER_ADDR")?, var("MASTER_PORT")?),
        };
        let host = routable_host(&store);
        Ok(GroupOptions {
            name: name.to_owned(),
            rank,
            world_size,
            store,
            serve_store: rank == 0 && std::env::var_os("SLUICE_STORE_SERVED").is_none(),
            host,
            timeout: Duration::from_secs(60),
            pipe: ContextOptions::default(),
        })
    }
}

/// The address peers reach this rank at: `SLUICE_HOST`, else the interface that routes to the
/// store's host (no packet is sent), else loopback.
fn routable_host(store: &str) -> String {
    std::env::var("SLUICE_HOST").ok().unwrap_or_else(|| {
        let addr = store.strip_prefix("tcp://").unwrap_or(store);
        let addr = addr
            .strip_prefix("etcd://")
            .map_or(addr, |r| r.split('/').next().unwrap_or(r));
        std::net::UdpSocket::bind("0.0.0.0:0")
            .and_then(|s| s.connect(addr).map(|()| s))
            .and_then(|s| s.local_addr())
            .map(|a| a.ip().to_string())
            .unwrap_or_else(|_| "127.0.0.1".into())
    })
}

/// A group of ranks exchanging buffers. Cheap to clone (clones share the group).
#[derive(Clone)]
pub struct Group {
    inner: Arc<Inner>,
}

struct Inner {
    mesh: Arc<Mesh>,
    seq: AtomicU64,
    _ctx: Context,
    _store: Option<Store>,
    _server: Option<StoreServer>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.mesh.close();
    }
}

/// A rank's listener, bound before its group forms (see [`Group::bind`]).
pub struct Bound {
    ctx: Context,
    listener: sluice_channel::PipeListener,
}

impl Bound {
    /// Where the other ranks reach this one (`host:port`).
    pub fn address(&self) -> &str {
        self.listener.address()
    }

    /// Forms the group `name` from every rank's address (`addresses[r]` is rank `r`'s; this
    /// rank's own entry is not read): every rank calls it with the same name, world and
    /// addresses. A rank connects to the higher ranks and accepts the lower ones, so it returns
    /// once all of its own pipes are up (others may still be forming).
    pub async fn form(self, name: &str, rank: u32, addresses: &[String], timeout: Duration) -> Result<Group> {
        let world = u32::try_from(addresses.len())
            .map_err(|_| CollectiveError::Invalid(format!("a world of {} ranks", addresses.len())))?;
        check_world(rank, world)?;
        let lookup = |r: u32| std::future::ready(Ok(addresses[r as usize].clone()));
        let mesh = Mesh::build(&self.ctx, self.listener, name, rank, world, timeout, lookup).await?;
        Ok(Group::with(mesh, self.ctx, None, None))
    }
}

fn check_world(rank: u32, world: u32) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(CollectiveError::Invalid(format!("rank {rank} in a world of {world}")));
    }
    // A collective's steps are numbered in 16 bits and the ring takes 2 (n - 1) of them.
    if world > 1 << 15 {
        return Err(CollectiveError::Invalid(format!("a world of {world} ranks")));
    }
    Ok(())
}

/// Buffers at most this long take the direct algorithms; longer ones the ring.
pub const DIRECT_MAX: usize = 64 << 10;

/// Buffers at least this long are read straight out of the other ranks' memory when every
/// rank can read every other's (one host, cross-memory attach allowed; the `local` module).
pub const LOCAL_MIN: usize = 256 << 10;

/// Steps within one collective are numbered in the low bits of its key.
const STEP_BITS: u32 = 16;

impl Group {
    /// Forms the group: every rank must call this with the same name and world size.
    pub async fn new(options: GroupOptions) -> Result<Group> {
        let o = options;
        check_world(o.rank, o.world_size)?;
        let server = if o.serve_store {
            Some(
                StoreServer::start(&o.store)
                    .await
                    .map_err(|e| CollectiveError::Store(e.to_string()))?,
            )
        } else {
            None
        };
        let url = StoreUrl::parse(&o.store).map_err(|e| CollectiveError::Store(e.to_string()))?;
        let store = Store::connect(&url, o.timeout, None)
            .await
            .map_err(|e| CollectiveError::Store(e.to_string()))?;
        let bound = Group::bind(Context::new(o.pipe.clone())?, &o.host).await?;
        let name = &o.name;
        let key = |r: u32| format!("collective/{name}/addr/{r}");
        store
            .set(&key(o.rank), bound.address().as_bytes().to_vec())
            .await
            .map_err(|e| CollectiveError::Store(e.to_string()))?;
        let lookup = |r: u32| {
            let (store, key) = (&store, key(r));
            async move {
                let addr = store
                    .get(&key, o.timeout)
                    .await
                    .map_err(|e| CollectiveError::Store(format!("rank {r}'s address: {e}")))?;
                Ok(String::from_utf8_lossy(&addr).into_owned())
            }
        };
        let mesh = Mesh::build(
            &bound.ctx,
            bound.listener,
            name,
            o.rank,
            o.world_size,
            o.timeout,
            lookup,
        )
        .await?;
        // Nobody leaves formation (and maybe takes the store with it) before all have formed.
        if let Err(e) = store
            .barrier(&format!("collective/{name}/formed"), o.world_size, o.timeout)
            .await
        {
            mesh.close();
            return Err(CollectiveError::Store(e.to_string()));
        }
        Ok(Group::with(mesh, bound.ctx, Some(store), server))
    }

    /// Forms group `name` over the workers of a running RPC agent, through its store: ranks in
    /// the order of the workers' ids, this worker's among them. The members are those the agent
    /// knows when called, so every worker must call it while the membership is the same (a
    /// static group, or an elastic one between changes); each worker's address is the one that
    /// routes to the store's host (`SLUICE_HOST` overrides).
    pub async fn from_agent(agent: &sluice_agent::Agent, name: &str, timeout: Duration) -> Result<Group> {
        let members = agent.workers();
        let me = agent.info().id;
        let rank = members.iter().position(|w| w.id == me).ok_or_else(|| {
            CollectiveError::Invalid(format!("worker {} is not among the agent's members", agent.info()))
        })?;
        let store = agent.store_address();
        Group::new(GroupOptions {
            name: name.to_owned(),
            rank: rank as u32,
            world_size: members.len() as u32,
            host: routable_host(&store),
            store,
            serve_store: false,
            timeout,
            pipe: ContextOptions::default(),
        })
        .await
    }

    /// Binds this rank's listener on `host` (port chosen by the system), for a group formed
    /// through another rendezvous (a framework's own store): publish [`Bound::address`] there,
    /// then [`Bound::form`] with every rank's address.
    pub async fn bind(ctx: Context, host: &str) -> Result<Bound> {
        let listener = ctx.listen(&format!("{host}:0")).await?;
        Ok(Bound { ctx, listener })
    }

    fn with(mesh: Arc<Mesh>, ctx: Context, store: Option<Store>, server: Option<StoreServer>) -> Group {
        Group {
            inner: Arc::new(Inner {
                mesh,
                seq: AtomicU64::new(0),
                _ctx: ctx,
                _store: store,
                _server: server,
            }),
        }
    }

    pub fn rank(&self) -> u32 {
        self.inner.mesh.rank
    }

    pub fn world_size(&self) -> u32 {
        self.inner.mesh.world
    }

    /// How many of this group's collectives so far read the other ranks' buffers straight out
    /// of their memory (one host, large buffers; the rest went direct or round the ring).
    pub fn local_collectives(&self) -> u64 {
        self.inner.mesh.local_ops.load(Ordering::Relaxed)
    }

    /// Why the group failed, if it has (a lost rank, an abort, a close).
    pub fn failed(&self) -> Option<CollectiveError> {
        self.inner.mesh.failed()
    }

    /// Fails the group on every rank with `why` (each pending operation ends with it).
    pub fn abort(&self, why: &str) {
        let e = CollectiveError::Aborted {
            by: self.rank(),
            why: why.to_owned(),
        };
        if self.inner.mesh.fail(e) {
            self.inner.mesh.tell_others(self.rank(), why);
        }
    }

    /// Leaves the group with the others: returns once every rank has called `close` (then the
    /// pipes close), or with the error that failed the group. Dropping the last handle without
    /// it closes the pipes at once, which the other ranks see as this rank lost.
    pub async fn close(self) -> Result<()> {
        if let Some(e) = self.failed() {
            self.inner.mesh.close();
            return Err(e);
        }
        let r = self.inner.mesh.leave().await;
        self.inner.mesh.close();
        r
    }

    /// Sends `data` to rank `to` under `tag` (matched by `recv(self.rank, tag)` there).
    pub async fn send(&self, to: u32, tag: u64, data: Bytes) -> Result<()> {
        self.peer(to)?;
        self.inner.mesh.send(to, Kind::User, tag, data).await
    }

    /// The next message rank `from` sent under `tag`.
    pub async fn recv(&self, from: u32, tag: u64) -> Result<Bytes> {
        self.peer(from)?;
        self.inner.mesh.recv(from, Kind::User, tag).await
    }

    fn peer(&self, r: u32) -> Result<()> {
        if r == self.rank() || r >= self.world_size() {
            return Err(CollectiveError::Invalid(format!(
                "rank {r} is not a peer of rank {} in a group of {}",
                self.rank(),
                self.world_size()
            )));
        }
        Ok(())
    }

    /// The next collective's sequence number (taken when a collective is called).
    fn next(&self) -> Op {
        Op {
            mesh: self.inner.mesh.clone(),
            seq: self.inner.seq.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> impl std::future::Future<Output = Result<()>> + '_ {
        let op = self.next();
        async move { algorithm::all_gather(&op, &[], &mut []).await }
    }

    /// Every rank's `buf` becomes `op` over all ranks' `buf`s (the same bytes everywhere).
    pub fn all_reduce<'a>(
        &'a self,
        buf: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            reduce::check(dtype, op)?;
            reduce::elements(dtype, buf.len())?;
            algorithm::all_reduce(&o, buf, dtype, op).await
        }
    }

    /// Rank `root`'s `buf` is copied into every other rank's `buf`.
    pub fn broadcast<'a>(&'a self, root: u32, buf: &'a mut [u8]) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            o.root(root)?;
            algorithm::broadcast(&o, root, buf).await
        }
    }

    /// Rank `root`'s `buf` becomes `op` over all ranks' `buf`s (the others' are unchanged).
    pub fn reduce<'a>(
        &'a self,
        root: u32,
        buf: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            o.root(root)?;
            reduce::check(dtype, op)?;
            reduce::elements(dtype, buf.len())?;
            algorithm::reduce(&o, root, buf, dtype, op).await
        }
    }

    /// `out` (world × `input.len()` bytes) becomes every rank's `input`, in rank order.
    pub fn all_gather<'a>(
        &'a self,
        input: &'a [u8],
        out: &'a mut [u8],
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            o.sized(out.len(), input.len(), "all_gather output")?;
            algorithm::all_gather(&o, input, out).await
        }
    }

    /// On `root`, `out` (world × `input.len()` bytes) becomes every rank's `input` in rank
    /// order; other ranks pass an empty `out`.
    pub fn gather<'a>(
        &'a self,
        root: u32,
        input: &'a [u8],
        out: &'a mut [u8],
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            o.root(root)?;
            if o.mesh.rank == root {
                o.sized(out.len(), input.len(), "gather output")?;
            }
            algorithm::gather(&o, root, input, out).await
        }
    }

    /// Rank `r`'s `out` becomes piece `r` of `root`'s `input` (world × `out.len()` bytes; other
    /// ranks pass an empty `input`).
    pub fn scatter<'a>(
        &'a self,
        root: u32,
        input: &'a [u8],
        out: &'a mut [u8],
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            o.root(root)?;
            if o.mesh.rank == root {
                o.sized(input.len(), out.len(), "scatter input")?;
            }
            algorithm::scatter(&o, root, input, out).await
        }
    }

    /// Rank `r`'s `out` becomes `op` over piece `r` of every rank's `input` (world ×
    /// `out.len()` bytes).
    pub fn reduce_scatter<'a>(
        &'a self,
        input: &'a [u8],
        out: &'a mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            reduce::check(dtype, op)?;
            reduce::elements(dtype, out.len())?;
            o.sized(input.len(), out.len(), "reduce_scatter input")?;
            algorithm::reduce_scatter(&o, input, out, dtype, op).await
        }
    }

    /// Piece `j` of rank `i`'s `input` becomes piece `i` of rank `j`'s `out` (both world ×
    /// piece bytes).
    pub fn all_to_all<'a>(
        &'a self,
        input: &'a [u8],
        out: &'a mut [u8],
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            let n = o.mesh.world as usize;
            if input.len() != out.len() || !input.len().is_multiple_of(n) {
                return Err(CollectiveError::Invalid(format!(
                    "all_to_all of {} bytes into {} bytes over {n} ranks",
                    input.len(),
                    out.len(),
                )));
            }
            let even = vec![input.len() / n; n];
            let p = splits(&even, input.len(), "all_to_all")?;
            algorithm::all_to_all(&o, input, &p, out, &p).await
        }
    }

    /// All-to-all with pieces of their own lengths: `input`'s piece `j` (`send_lens[j]` bytes,
    /// in rank order) goes to rank `j`, and `out`'s piece `i` (`recv_lens[i]` bytes) comes from
    /// rank `i`. Rank `i`'s `send_lens[j]` must equal rank `j`'s `recv_lens[i]` (a mismatch is
    /// an error on rank `j`).
    pub fn all_to_all_v<'a>(
        &'a self,
        input: &'a [u8],
        send_lens: &'a [usize],
        out: &'a mut [u8],
        recv_lens: &'a [usize],
    ) -> impl std::future::Future<Output = Result<()>> + 'a {
        let o = self.next();
        async move {
            let n = o.mesh.world as usize;
            if send_lens.len() != n || recv_lens.len() != n {
                return Err(CollectiveError::Invalid(format!(
                    "all_to_all_v with {} send and {} receive lengths over {n} ranks",
                    send_lens.len(),
                    recv_lens.len()
                )));
            }
            let send = splits(send_lens, input.len(), "all_to_all_v input")?;
            let recv = splits(recv_lens, out.len(), "all_to_all_v output")?;
            algorithm::all_to_all(&o, input, &send, out, &recv).await
        }
    }
}

/// Consecutive ranges of `lens`, which must cover exactly `total` bytes.
fn splits(lens: &[usize], total: usize, what: &str) -> Result<Vec<std::ops::Range<usize>>> {
    let mut at = 0usize;
    let ranges = lens
        .iter()
        .map(|&l| {
            let r = at..at.saturating_add(l);
            at = r.end;
            r
        })
        .collect();
    if at != total {
        return Err(CollectiveError::Invalid(format!(
            "{what}: pieces of {lens:?} bytes for a buffer of {total} bytes"
        )));
    }
    Ok(ranges)
}

/// One collective in flight: its sequence number and the mesh.
pub(crate) struct Op {
    mesh: Arc<Mesh>,
    seq: u64,
}

impl Op {
    fn key(&self, step: u32) -> u64 {
        (self.seq << STEP_BITS) | step as u64
    }

    /// Sends a copy of `data` as step `step` to `to`.
    async fn send(&self, to: u32, step: u32, data: &[u8]) -> Result<()> {
        self.mesh.send_copy(to, Kind::Coll, self.key(step), data).await
    }

    /// Receives step `step` from `from`, which must be `len` bytes long.
    async fn recv(&self, from: u32, step: u32, len: usize) -> Result<Bytes> {
        let got = self.mesh.recv(from, Kind::Coll, self.key(step)).await?;
        if got.len() != len {
            let e = CollectiveError::Invalid(format!(
                "rank {from} sent {} bytes where rank {} expected {len} (buffer sizes differ across ranks?)",
                got.len(),
                self.mesh.rank
            ));
            return Err(e);
        }
        Ok(got)
    }

    fn root(&self, root: u32) -> Result<()> {
        if root >= self.mesh.world {
            return Err(CollectiveError::Invalid(format!(
                "root {root} in a group of {}",
                self.mesh.world
            )));
        }
        Ok(())
    }

    fn sized(&self, whole: usize, piece: usize, what: &str) -> Result<()> {
        if whole != piece * self.mesh.world as usize {
            return Err(CollectiveError::Invalid(format!(
                "{what} of {whole} bytes for pieces of {piece} bytes over {} ranks",
                self.mesh.world
            )));
        }
        Ok(())
    }
}

pub mod algorithm;
