//! The context: which transports and channels this process offers (and in which priority),
//! the listener that accepts pipes, and `connect`.
//!
//! Opening a pipe takes one round trip of negotiation:
//! 1. The client connects over TCP (the bootstrap transport) and sends [`Hello::Pipe`] with its
//!    brochure: protocol version, transports with domain descriptors, channels with per-device
//!    descriptors.
//! 2. The server picks the transport and a channel per device pair (see
//!    [`crate::negotiation`]), registers a token for every further connection the pipe needs,
//!    and answers.
//! 3. The client checks the answer, opens those connections (each starts with
//!    [`Hello::Join`]), and both sides build the pipe. On one host the control connection moves
//!    to shared memory; otherwise the bootstrap connection stays as the control connection.
//!
//! Every connection to a listener is handled on its own task with a deadline, so a peer that
//! sends garbage, a truncated frame, an absurd length or nothing at all costs one typed error
//! (returned from [`PipeListener::accept`] and logged with the peer's address), never the
//! listener.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use sluice_transport::any::{AnyConnection, AnyReader, AnyWriter};
use sluice_transport::auth::{self, Secret};
use sluice_transport::ibv::{IbvOptions, IbvTransport};
use sluice_transport::shm::{ShmOptions, ShmTransport};
use sluice_transport::tcp::{TcpListener, TcpOptions, TcpTransport};
use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::channel::cma::{self, CmaContext};
use crate::channel::cuda::{process_token, CudaIpcContext, CudaP2pContext, CudaStagedContext};
use crate::channel::gdr::GdrContext;
use crate::channel::rdma::RdmaContext;
use crate::channel::segment::{Segment, SegmentOffer};
use crate::channel::{BasicContext, ChannelContext, ChannelKind, MultiLaneContext};
use crate::device::Device;
use crate::error::{PipeError, Result};
use crate::negotiation;
use crate::pipe::Segments;
use crate::pipe::{Links, Pipe, PipeInfo};
use crate::wire::{self, Answer, Brochure, ChannelOffer, Hello, Reply, TransportOffer};

/// A connection, split.
type Halves = (AnyReader, AnyWriter);

/// The transports a pipe's control connection can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    Shm,
    Tcp,
    Ibv,
}

impl TransportKind {
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
            TransportKind::Ibv => "ibv",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [TransportKind::Shm, TransportKind::Tcp, TransportKind::Ibv]
            .into_iter()
            .find(|k| k.name() == name)
    }
}

/// Configuration of a [`Context`]. Lists are in priority order (first wins); leaving a backend
/// out disables it, which is how to force TCP or a given channel when debugging.
#[derive(Debug, Clone)]
pub struct ContextOptions {
    /// Sent to peers, used in logs and errors.
    pub name: String,
    pub transports: Vec<TransportKind>,
    pub channels: Vec<ChannelKind>,
    pub tcp: TcpOptions,
    pub shm: ShmOptions,
    /// The ibverbs transport (device choice from `SLUICE_IB_DEVICE` and friends by default; not
    /// viable without the `rdma` feature or a device, unless the model is chosen).
    pub ibv: IbvOptions,
    /// TCP connections per pipe for the multi-lane channel.
    pub lanes: usize,
    /// Deadline for each stage of pipe setup (and for a silent incoming connection).
    pub setup_timeout: Duration,
    /// Largest message descriptor accepted from a peer (metadata included).
    pub max_descriptor_bytes: usize,
    /// A shared secret every connection must prove (both ways) before anything else is
    /// accepted on it. `None`: no authentication.
    pub secret: Option<Secret>,
    /// Lets cuda_p2p pair a GPU with itself within this process, so its peer-copy path runs on
    /// a machine with one GPU (tests and benchmarks only).
    pub cuda_p2p_loopback: bool,
    /// Size of the shared segment this process receives cma pipes' CPU tensors into, one for
    /// all its peers (see [`crate::channel::segment`]): address space, with pages allocated as
    /// they are first used and reused first. Tensors that do not fit go by cross-memory
    /// attach. 0: no segment.
    pub segment_bytes: usize,
}

impl Default for ContextOptions {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        ContextOptions {
            name: format!("pid{}", std::process::id()),
            transports: vec![TransportKind::Shm, TransportKind::Ibv, TransportKind::Tcp],
            channels: ChannelKind::ALL.to_vec(),
            tcp: TcpOptions::default(),
            shm: ShmOptions::default(),
            ibv: IbvOptions::default(),
            lanes: cores.clamp(2, 4),
            setup_timeout: Duration::from_secs(10),
            max_descriptor_bytes: 64 << 20,
            secret: None,
            cuda_p2p_loopback: false,
            segment_bytes: 1 << 30,
        }
    }
}

struct ContextInner {
    options: ContextOptions,
    tcp: TcpTransport,
    /// Viable and enabled transports, in priority order.
    transports: Vec<TransportKind>,
    shm: Option<ShmTransport>,
    ibv: Option<IbvTransport>,
    /// Viable and enabled channels, in priority order.
    channels: Vec<Box<dyn ChannelContext>>,
    /// The segment every cma pipe of this context receives into, made with the first one.
    inbox: OnceLock<Option<Arc<Segment>>>,
    /// Peers' segments opened here, by (process token, pid, descriptor), shared by the pipes
    /// to each peer.
    outboxes: Mutex<HashMap<(u64, u32, i32), Weak<Segment>>>,
}

/// A process's set of transports and channels. Cheap to clone.
#[derive(Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

impl Context {
    /// Probes every enabled backend and keeps the viable ones; a backend that cannot run here
    /// is logged and not offered.
    pub fn new(options: ContextOptions) -> Result<Context> {
        let tcp = TcpTransport::new(options.tcp.clone());
        let mut transports = Vec::new();
        let mut shm = None;
        let mut ibv = None;
        for &kind in &options.transports {
            match kind {
                TransportKind::Tcp => transports.push(kind),
                TransportKind::Shm => shm = viable(ShmTransport::new(options.shm.clone()), kind, &mut transports),
                TransportKind::Ibv => ibv = viable(IbvTransport::new(options.ibv.clone()), kind, &mut transports),
            }
        }
        if transports.is_empty() {
            return Err(PipeError::Config("no transport enabled".into()));
        }
        let mut channels: Vec<Box<dyn ChannelContext>> = Vec::new();
        for &kind in &options.channels {
            let ctx: Box<dyn ChannelContext> = match kind {
                ChannelKind::Basic => Box::new(BasicContext),
                ChannelKind::Cma => Box::new(CmaContext::new()),
                ChannelKind::MultiLane => Box::new(MultiLaneContext { lanes: options.lanes }),
                ChannelKind::Rdma => Box::new(RdmaContext::new(ibv.as_ref())),
                ChannelKind::CudaGdr => Box::new(GdrContext::new(ibv.as_ref())),
                ChannelKind::CudaIpc => Box::new(CudaIpcContext::new()),
                ChannelKind::CudaP2p => Box::new(CudaP2pContext::new(options.cuda_p2p_loopback)),
                ChannelKind::CudaStaged => {
                    let full = CudaStagedContext::new();
                    match full.viability() {
                        Ok(()) => Box::new(full),
                        Err(e) => {
                            // Without CUDA this side still takes GPU tensors into its CPU
                            // memory and sends CPU tensors to a peer's GPUs.
                            tracing::info!("channel cuda_staged serves this process's CPU only: {e}");
                            Box::new(CudaStagedContext::cpu_only())
                        }
                    }
                }
            };
            match ctx.viability() {
                Ok(()) => channels.push(ctx),
                Err(e) => tracing::info!("channel {kind} not offered: {e}"),
            }
        }
        if channels.is_empty() {
            return Err(PipeError::Config("no viable channel enabled".into()));
        }
        Ok(Context {
            inner: Arc::new(ContextInner {
                options,
                tcp,
                transports,
                shm,
                ibv,
                channels,
                inbox: OnceLock::new(),
                outboxes: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The transports this context offers, in priority order.
    pub fn transports(&self) -> &[TransportKind] {
        &self.inner.transports
    }

    /// The channels this context offers, in priority order.
    pub fn channels(&self) -> Vec<ChannelKind> {
        self.inner.channels.iter().map(|c| c.kind()).collect()
    }

    pub fn options(&self) -> &ContextOptions {
        &self.inner.options
    }

    /// Starts accepting pipes on `addr` (a TCP `host:port`; empty binds the configured default
    /// address on a free port).
    pub async fn listen(&self, addr: &str) -> Result<PipeListener> {
        let tcp = self.inner.tcp.listen(addr).await?;
        let address = tcp.address();
        let shm = match &self.inner.shm {
            Some(t) => Some(t.listen("").await?),
            None => None,
        };
        // The ibverbs bootstrap listens on the pipe listener's host, on a port of its own.
        let ibv = match &self.inner.ibv {
            Some(t) => {
                let host = address.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
                Some(t.listen(&format!("{host}:0")).await?)
            }
            None => None,
        };
        let shared = Arc::new(ListenerShared {
            ctx: self.clone(),
            tcp_address: address.clone(),
            shm_address: shm.as_ref().map(|l| l.address()),
            ibv_address: ibv.as_ref().map(|l| l.address()),
            tokens: Mutex::new(HashMap::new()),
        });
        let (tx, rx) = mpsc::channel(64);
        let mut tasks = vec![tokio::spawn(accept_tcp(tcp, shared.clone(), tx.clone()))];
        if let Some(l) = shm {
            tasks.push(tokio::spawn(accept_upgraded(l, shared.clone(), tx.clone())));
        }
        if let Some(l) = ibv {
            tasks.push(tokio::spawn(accept_upgraded(l, shared.clone(), tx)));
        }
        Ok(PipeListener {
            address,
            incoming: rx,
            tasks,
        })
    }

    /// Opens a pipe to the listener at `addr`.
    pub async fn connect(&self, addr: &str) -> Result<Pipe> {
        let timeout = self.inner.options.setup_timeout;
        let conn = self.inner.tcp.connect(addr).await?;
        let peer = addr.to_string();
        let staged = async {
            let (mut r, mut w) = AnyConnection::from(conn).split();
            self.authenticate(&mut r, &mut w, &peer).await?;
            let inbox = self.inbox_segment();
            let mut brochure = self.brochure();
            brochure.segment = inbox.as_ref().map(|s| s.offer());
            w.write(&[&wire::encode_setup(&Hello::Pipe(brochure))]).await?;
            let reply = r.read_vec(wire::MAX_SETUP_BYTES).await?;
            let answer = match wire::decode_setup::<Reply>(&reply, &peer)? {
                Reply::Accept(a) => *a,
                Reply::Reject { reason } => {
                    return Err(PipeError::Rejected {
                        peer: peer.clone(),
                        reason,
                    })
                }
            };
            self.finish_client(addr, &peer, (r, w), answer, inbox).await
        };
        tokio::time::timeout(timeout, staged)
            .await
            .map_err(|_| PipeError::Timeout {
                peer: addr.to_owned(),
                stage: "connect",
            })?
    }

    /// Proves the shared secret on a fresh outgoing connection (nothing without one).
    async fn authenticate(&self, r: &mut AnyReader, w: &mut AnyWriter, peer: &str) -> Result<()> {
        if let Some(secret) = &self.inner.options.secret {
            auth::connect(r, w, secret, peer).await?;
        }
        Ok(())
    }

    fn brochure(&self) -> Brochure {
        Brochure {
            name: self.inner.options.name.clone(),
            pid: std::process::id(),
            process: process_token(),
            cma_probe: cma::probe_address(),
            segment: None,
            transports: self.transport_offers(),
            channels: self.channel_offers(),
        }
    }

    fn transport_offers(&self) -> Vec<TransportOffer> {
        self.inner
            .transports
            .iter()
            .map(|&k| TransportOffer {
                name: k.name().to_owned(),
                descriptor: match k {
                    TransportKind::Tcp => self.inner.tcp.domain_descriptor(),
                    TransportKind::Shm => self
                        .inner
                        .shm
                        .as_ref()
                        .map(|s| s.domain_descriptor())
                        .unwrap_or_default(),
                    TransportKind::Ibv => self
                        .inner
                        .ibv
                        .as_ref()
                        .map(|s| s.domain_descriptor())
                        .unwrap_or_default(),
                },
            })
            .collect()
    }

    fn channel_offers(&self) -> Vec<ChannelOffer> {
        self.inner
            .channels
            .iter()
            .map(|c| ChannelOffer {
                name: c.kind().name().to_owned(),
                devices: c.device_descriptors(),
            })
            .collect()
    }

    fn transport_compatible(&self, name: &str, _local: &str, remote: &str) -> bool {
        match TransportKind::from_name(name) {
            Some(TransportKind::Tcp) => self.inner.tcp.can_communicate_with(remote),
            Some(TransportKind::Shm) => self.inner.shm.as_ref().is_some_and(|s| s.can_communicate_with(remote)),
            Some(TransportKind::Ibv) => self.inner.ibv.as_ref().is_some_and(|s| s.can_communicate_with(remote)),
            None => false,
        }
    }

    fn channel_compatible(&self, name: &str, local: &str, remote: &str) -> bool {
        self.inner
            .channels
            .iter()
            .any(|c| c.kind().name() == name && c.can_communicate(local, remote))
    }

    /// The segment this process receives CPU tensors into, when cma may be chosen.
    fn inbox_segment(&self) -> Option<Arc<Segment>> {
        self.inner
            .inbox
            .get_or_init(|| {
                let size = self.inner.options.segment_bytes;
                if size == 0 || !self.inner.channels.iter().any(|c| c.kind() == ChannelKind::Cma) {
                    return None;
                }
                Segment::create(size)
                    .inspect_err(|e| tracing::info!("no shared segment for cma pipes: {e}"))
                    .ok()
            })
            .clone()
    }

    /// The pipe's segments (inbox, outbox) when cma was chosen: ours, and the peer's opened
    /// here (once per peer process). Either may be missing; then tensors that would use it go
    /// by cross-memory attach.
    fn segments(
        &self,
        cpu: ChannelKind,
        inbox: Option<Arc<Segment>>,
        peer: &Peer,
        offer: Option<SegmentOffer>,
    ) -> Segments {
        if cpu != ChannelKind::Cma {
            return Segments::default();
        }
        let outbox = offer.and_then(|o| {
            let key = (peer.process, peer.pid, o.fd);
            let mut open = self.inner.outboxes.lock().expect("outbox table");
            open.retain(|_, s| s.strong_count() > 0);
            if let Some(s) = open.get(&key).and_then(Weak::upgrade) {
                return Some(s);
            }
            let s = Segment::open(peer.pid, o)
                .inspect_err(|e| tracing::info!(peer = %peer.name, "sending by cross-memory attach only: {e}"))
                .ok()?;
            open.insert(key, Arc::downgrade(&s));
            Some(s)
        });
        Segments { inbox, outbox }
    }

    async fn finish_client(
        &self,
        addr: &str,
        peer: &str,
        bootstrap: (AnyReader, AnyWriter),
        answer: Answer,
        inbox: Option<Arc<Segment>>,
    ) -> Result<Pipe> {
        let negotiation = |reason: String| PipeError::Negotiation {
            peer: peer.to_owned(),
            reason,
        };
        let kind = TransportKind::from_name(&answer.transport)
            .filter(|k| self.inner.transports.contains(k))
            .ok_or_else(|| {
                negotiation(format!(
                    "server chose transport {:?}, which this side did not offer",
                    answer.transport
                ))
            })?;
        if !self.transport_compatible(&answer.transport, "", &answer.transport_descriptor) {
            return Err(negotiation(format!(
                "transport {} cannot reach the server from here",
                answer.transport
            )));
        }
        let mine = self.channel_offers();
        negotiation::verify_channels(&mine, &answer.channels, &answer.choices, &|n, l, r| {
            self.channel_compatible(n, l, r)
        })
        .map_err(negotiation)?;
        let cpu = cpu_channel(&answer.choices).ok_or_else(|| negotiation("no channel for CPU tensors".into()))?;
        if kind != TransportKind::Ibv {
            if let Some(c) = answer
                .choices
                .iter()
                .find(|c| ChannelKind::from_name(&c.channel).is_some_and(|k| k.needs_ibv()))
            {
                return Err(negotiation(format!(
                    "server chose channel {} over transport {}, but it needs the ibv transport",
                    c.channel, answer.transport
                )));
            }
        }
        if cpu == ChannelKind::Cma {
            cma::probe_peer(answer.pid as i32, answer.cma_probe)
                .map_err(|e| negotiation(format!("cma chosen but {e}")))?;
        }
        // The ibverbs bootstrap port is on the host we reached the listener at (the server may
        // have bound a wildcard address).
        let joined;
        let shm_address = if kind == TransportKind::Ibv {
            joined = with_port_of(addr, &answer.address)
                .ok_or_else(|| negotiation(format!("bad ibv bootstrap address {:?}", answer.address)))?;
            joined.as_str()
        } else {
            answer.address.as_str()
        };
        let join = |token: u64| async move {
            let conn: AnyConnection = match kind {
                TransportKind::Tcp => self.inner.tcp.connect(addr).await?.into(),
                TransportKind::Shm => self
                    .inner
                    .shm
                    .as_ref()
                    .expect("offered, so present")
                    .connect(shm_address)
                    .await?
                    .into(),
                TransportKind::Ibv => self
                    .inner
                    .ibv
                    .as_ref()
                    .expect("offered, so present")
                    .connect(shm_address)
                    .await?
                    .into(),
            };
            let (mut r, mut w) = conn.split();
            self.authenticate(&mut r, &mut w, peer).await?;
            w.write(&[&wire::encode_setup(&Hello::Join { token })]).await?;
            Ok::<_, PipeError>((r, w))
        };
        let control = match answer.control_token {
            Some(token) => join(token).await?,
            None => bootstrap,
        };
        let reply = join(answer.reply_token).await?;
        let mut lanes = Vec::new();
        for &token in &answer.lane_tokens {
            let conn: AnyConnection = self.inner.tcp.connect(addr).await?.into();
            let (mut r, mut w) = conn.split();
            self.authenticate(&mut r, &mut w, peer).await?;
            w.write(&[&wire::encode_setup(&Hello::Join { token })]).await?;
            lanes.push((r, w));
        }
        let peer = Peer {
            name: format!("{}@{addr}", answer.name),
            pid: answer.pid,
            process: answer.process,
        };
        let segments = self.segments(cpu, inbox, &peer, answer.segment);
        Ok(assemble(
            peer,
            kind,
            cpu,
            local_pairs(&answer.choices, false),
            Links { control, reply, lanes },
            self.inner.options.max_descriptor_bytes,
            segments,
        ))
    }
}

/// `t` if it can run here (then `kind` is offered); otherwise logs why not.
fn viable<T: Transport>(t: T, kind: TransportKind, offered: &mut Vec<TransportKind>) -> Option<T> {
    match t.viability() {
        Ok(()) => {
            offered.push(kind);
            Some(t)
        }
        Err(e) => {
            tracing::info!("{} transport not offered: {e}", kind.name());
            None
        }
    }
}

/// `host:port` with the host of `addr` and the port of `other`.
fn with_port_of(addr: &str, other: &str) -> Option<String> {
    let (host, _) = addr.rsplit_once(':')?;
    let (_, port) = other.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    Some(format!("{host}:{port}"))
}

/// Who the other end is.
struct Peer {
    name: String,
    pid: u32,
    process: u64,
}

/// The pipe both ends build once their connections are in place.
fn assemble(
    peer: Peer,
    kind: TransportKind,
    cpu: ChannelKind,
    channels: Vec<(Device, Device, ChannelKind)>,
    links: Links,
    max: usize,
    segments: Segments,
) -> Pipe {
    let info = PipeInfo {
        peer: peer.name,
        peer_pid: peer.pid,
        transport: kind.name(),
        cpu_channel: cpu,
        channels,
        lanes: links.lanes.len(),
    };
    Pipe::new(info, links, max, peer.process, segments)
}

/// The server's choices as (local device, remote device, channel) for one side.
fn local_pairs(choices: &[wire::ChannelChoice], server: bool) -> Vec<(Device, Device, ChannelKind)> {
    choices
        .iter()
        .filter_map(|c| {
            let kind = ChannelKind::from_name(&c.channel)?;
            Some(if server {
                (c.server_device, c.client_device, kind)
            } else {
                (c.client_device, c.server_device, kind)
            })
        })
        .collect()
}

/// The channel chosen for CPU-to-CPU tensors.
fn cpu_channel(choices: &[wire::ChannelChoice]) -> Option<ChannelKind> {
    choices
        .iter()
        .find(|c| c.server_device == Device::Cpu && c.client_device == Device::Cpu)
        .and_then(|c| ChannelKind::from_name(&c.channel))
}

struct ListenerShared {
    ctx: Context,
    tcp_address: String,
    shm_address: Option<String>,
    ibv_address: Option<String>,
    tokens: Mutex<HashMap<u64, oneshot::Sender<Halves>>>,
}

/// Accepts pipes. Dropping it stops listening.
pub struct PipeListener {
    address: String,
    incoming: mpsc::Receiver<Result<Pipe>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for PipeListener {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl PipeListener {
    /// The TCP address clients connect to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The next pipe, or the error of one incoming connection that failed (the listener keeps
    /// serving others; call `accept` again).
    pub async fn accept(&mut self) -> Result<Pipe> {
        self.incoming.recv().await.unwrap_or_else(|| {
            Err(PipeError::Closed {
                peer: self.address.clone(),
            })
        })
    }
}

async fn accept_tcp(mut listener: TcpListener, shared: Arc<ListenerShared>, tx: mpsc::Sender<Result<Pipe>>) {
    loop {
        match listener.accept().await {
            Ok(conn) => {
                tokio::spawn(handle_incoming(conn.into(), shared.clone(), tx.clone()));
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Accepts the connections of an upgraded transport (shm, ibv): each is served like a TCP one;
/// a failed handshake is reported to `accept`.
async fn accept_upgraded<L>(mut listener: L, shared: Arc<ListenerShared>, tx: mpsc::Sender<Result<Pipe>>)
where
    L: Listener,
    L::Connection: Into<AnyConnection>,
{
    loop {
        match listener.accept().await {
            Ok(conn) => {
                tokio::spawn(handle_incoming(conn.into(), shared.clone(), tx.clone()));
            }
            Err(e) => {
                tracing::warn!("upgraded connection refused: {e}");
                if tx.send(Err(e.into())).await.is_err() {
                    return;
                }
            }
        }
    }
}

async fn handle_incoming(conn: AnyConnection, shared: Arc<ListenerShared>, tx: mpsc::Sender<Result<Pipe>>) {
    let peer = conn.peer().to_owned();
    let timeout = shared.ctx.inner.options.setup_timeout;
    let (mut r, mut w) = conn.split();
    if let Some(secret) = &shared.ctx.inner.options.secret {
        // Nothing else is read from a connection that has not proved the secret.
        let proved = tokio::time::timeout(timeout, auth::accept(&mut r, &mut w, secret, &peer)).await;
        if !matches!(proved, Ok(Ok(()))) {
            r.close();
            let e: PipeError = match proved {
                Ok(Err(e)) => e.into(),
                _ => PipeError::Timeout {
                    peer: peer.clone(),
                    stage: "authentication",
                },
            };
            tracing::warn!(peer = %peer, "incoming connection refused: {e}");
            let _ = tx.send(Err(e)).await;
            return;
        }
    }
    let hello = match tokio::time::timeout(timeout, r.read_vec(wire::MAX_SETUP_BYTES)).await {
        Err(_) => Err(PipeError::Timeout {
            peer: peer.clone(),
            stage: "hello",
        }),
        Ok(Err(e)) => Err(e.into()),
        Ok(Ok(frame)) => wire::decode_setup::<Hello>(&frame, &peer),
    };
    let result = match hello {
        Ok(Hello::Join { token }) => {
            let waiter = shared.tokens.lock().expect("token table").remove(&token);
            match waiter {
                Some(waiter) => {
                    let _ = waiter.send((r, w));
                    return;
                }
                None => Err(PipeError::Protocol {
                    peer: peer.clone(),
                    detail: format!("unknown connection token {token:#x}"),
                }),
            }
        }
        Ok(Hello::Pipe(brochure)) => {
            match tokio::time::timeout(timeout * 2, serve_pipe(&shared, &peer, (r, w), brochure)).await {
                Ok(r) => r,
                Err(_) => Err(PipeError::Timeout {
                    peer: peer.clone(),
                    stage: "setup",
                }),
            }
        }
        Err(e) => {
            if let PipeError::VersionMismatch { ours, theirs, .. } = &e {
                // Tell the peer why before hanging up, so its connect fails with a clear error.
                let reason = format!("protocol version {theirs} is not supported; this side speaks version {ours}");
                let _ = w.write(&[&wire::encode_setup(&Reply::Reject { reason })]).await;
            }
            Err(e)
        }
    };
    if let Err(e) = &result {
        tracing::warn!(peer = %peer, "incoming connection failed: {e}");
    }
    let _ = tx.send(result).await;
}

/// The server's half of setup: choose, register tokens, answer, wait for the connections.
async fn serve_pipe(shared: &ListenerShared, peer: &str, bootstrap: Halves, brochure: Brochure) -> Result<Pipe> {
    let ctx = &shared.ctx;
    let (r, mut w) = bootstrap;
    let reject = |reason: String| PipeError::Negotiation {
        peer: peer.to_owned(),
        reason,
    };
    let local = ctx.transport_offers();
    let transport = negotiation::choose_transport(&local, &brochure.transports, &|n, l, r| {
        ctx.transport_compatible(n, l, r)
    })
    .and_then(|t| TransportKind::from_name(&t.name));
    let mut channels = ctx.channel_offers();
    // Channels that borrow the ibverbs control connection need it to be ibverbs.
    if transport != Some(TransportKind::Ibv) {
        channels.retain(|c| !ChannelKind::from_name(&c.name).is_some_and(|k| k.needs_ibv()));
    }
    // CMA needs permission to read this very peer; find out before offering it.
    if channels.iter().any(|c| c.name == ChannelKind::Cma.name())
        && brochure.channels.iter().any(|c| c.name == ChannelKind::Cma.name())
    {
        if let Err(e) = cma::probe_peer(brochure.pid as i32, brochure.cma_probe) {
            tracing::info!(peer = %peer, "cma not usable with this peer: {e}");
            channels.retain(|c| c.name != ChannelKind::Cma.name());
        }
    }
    let choices = negotiation::choose_channels(&channels, &brochure.channels, &|n, l, r| {
        ctx.channel_compatible(n, l, r)
    });
    let cpu = cpu_channel(&choices);
    let (kind, cpu) = match (transport, cpu) {
        (Some(k), Some(c)) => (k, c),
        (None, _) => {
            let reason = "no common transport".to_owned();
            let _ = w
                .write(&[&wire::encode_setup(&Reply::Reject { reason: reason.clone() })])
                .await;
            return Err(reject(reason));
        }
        (_, None) => {
            let reason = "no common channel for CPU tensors".to_owned();
            let _ = w
                .write(&[&wire::encode_setup(&Reply::Reject { reason: reason.clone() })])
                .await;
            return Err(reject(reason));
        }
    };
    let lane_count = if cpu == ChannelKind::MultiLane {
        ctx.inner.options.lanes
    } else {
        0
    };
    let inbox = match (cpu, brochure.segment) {
        (ChannelKind::Cma, Some(_)) => ctx.inbox_segment(),
        _ => None,
    };
    let control_token = (kind != TransportKind::Tcp).then(rand::random::<u64>);
    let reply_token = rand::random::<u64>();
    let lane_tokens: Vec<u64> = (0..lane_count).map(|_| rand::random()).collect();
    let mut waiting = Vec::new();
    {
        let mut table = shared.tokens.lock().expect("token table");
        for &t in control_token
            .iter()
            .chain(std::iter::once(&reply_token))
            .chain(&lane_tokens)
        {
            let (tx, rx) = oneshot::channel();
            table.insert(t, tx);
            waiting.push((t, rx));
        }
    }
    let answer = Answer {
        name: ctx.inner.options.name.clone(),
        pid: std::process::id(),
        process: process_token(),
        cma_probe: cma::probe_address(),
        segment: inbox.as_ref().map(|s| s.offer()),
        transport: kind.name().to_owned(),
        transport_descriptor: local
            .iter()
            .find(|t| t.name == kind.name())
            .map(|t| t.descriptor.clone())
            .unwrap_or_default(),
        address: match kind {
            TransportKind::Shm => shared.shm_address.clone().unwrap_or_default(),
            TransportKind::Ibv => shared.ibv_address.clone().unwrap_or_default(),
            TransportKind::Tcp => shared.tcp_address.clone(),
        },
        control_token,
        reply_token,
        lane_address: shared.tcp_address.clone(),
        lane_tokens,
        channels,
        choices: choices.clone(),
    };
    let pairs = choices;
    let collected = async {
        w.write(&[&wire::encode_setup(&Reply::Accept(Box::new(answer)))])
            .await?;
        let mut halves = Vec::with_capacity(waiting.len());
        for (_, rx) in waiting.iter_mut() {
            halves.push(rx.await.map_err(|_| PipeError::Closed { peer: peer.to_owned() })?);
        }
        Ok::<_, PipeError>(halves)
    }
    .await;
    // Whatever happened, no token outlives this setup.
    {
        let mut table = shared.tokens.lock().expect("token table");
        for (t, _) in &waiting {
            table.remove(t);
        }
    }
    let mut halves = collected?.into_iter();
    let control = match control_token {
        Some(_) => halves.next().expect("control connection"),
        None => (r, w),
    };
    let reply = halves.next().expect("reply connection");
    let lanes: Vec<Halves> = halves.collect();
    let peer = Peer {
        name: format!("{}@{peer}", brochure.name),
        pid: brochure.pid,
        process: brochure.process,
    };
    let segments = ctx.segments(cpu, inbox, &peer, brochure.segment);
    Ok(assemble(
        peer,
        kind,
        cpu,
        local_pairs(&pairs, true),
        Links { control, reply, lanes },
        ctx.inner.options.max_descriptor_bytes,
        segments,
    ))
}
