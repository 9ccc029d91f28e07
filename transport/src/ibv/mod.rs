//! The ibverbs transport: a reliable-connected queue pair per connection, bootstrapped over TCP,
//! carrying frames through registered rings with RDMA write-with-immediate.
//!
//! Per direction, the receiver owns an *inbox* ring registered for remote writes and the sender
//! an *outbox* of the same size. A write copies the frame into the outbox at its head and
//! RDMA-writes the new bytes to the same offset of the peer's inbox; the immediate carries the
//! byte count, so the receiver learns where data ends from the completion alone. The reader
//! hands space back with a zero-byte send-with-immediate carrying the bytes consumed, once a
//! quarter of the ring is consumed (no acknowledgement per frame). A write completes once the
//! frame is in the outbox, so the caller's buffer may be reused at once; outbox bytes are reused
//! only after the peer acknowledged them (its NIC, hence ours, is done with them).
//!
//! One reactor thread per transport context polls the completion queue that all its
//! connections share, spinning for [`IbvOptions::spin`] and then blocking on the completion
//! channel, so an idle transport costs nothing. Every connection reserves its send and receive
//! depths in that queue, so it can never overrun; send requests in flight never exceed the
//! queue pair's depth (two slots are kept for acknowledgements and the close notice).
//!
//! Teardown: a closing side sends a close notice after its data, waits (bounded) for it to
//! complete, moves the queue pair to the error state, and frees nothing until every flushed
//! completion has been polled. The TCP bootstrap socket stays open for the life of the
//! connection: its hang-up tells the peer that this process is gone even when no notice could
//! be sent. A hang-up can overtake the completions the peer caused before it (a closing peer
//! shuts its socket once its close notice completed, possibly before our reactor polled the
//! data and the notice), so it counts only once a poll that began after it found the
//! completion queue empty: everything the peer sent first stays readable and its close reads as a
//! close. Likewise, once the close notice arrived, a request of ours that the peer no longer
//! answers (an acknowledgement racing its teardown) ends the connection quietly, not as a
//! failure.
//!
//! Backends: [`model`] (in-process, strict; tests and benches) and, with the `rdma` feature,
//! `real` (libibverbs loaded at run time through `sideway`, device, port and GID chosen
//! automatically or by configuration).
#![allow(unsafe_code)]

pub mod baseline;
pub mod gid;
pub mod model;
#[cfg(feature = "rdma")]
pub mod real;
mod region;
pub mod verbs;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;

use crate::closing::{OpGuard, Stopped};
use crate::error::{Result, TransportError};
use crate::frame::{decode_header, encode_header, total_len, HEADER_LEN};
use crate::{Closer, Connection, FrameReader, FrameWriter, Listener, Transport};
use region::Region;
pub use verbs::*;

const NAME: &str = "ibv";
const MAGIC: &[u8; 8] = b"SLCIBV01";
const VERSION: u16 = 2;
/// Immediate of the close notice (an acknowledgement never carries it: rings are ≤ 1 GiB).
const CLOSE_IMM: u32 = u32::MAX;
const MIN_RING: usize = 4096;
const MAX_RING: usize = 1 << 30;
const MAX_FABRIC: usize = 256;

// Work-request ids: a tag in the top byte, a sequence below.
const TAG_DATA: u64 = 1 << 56;
const TAG_ACK: u64 = 2 << 56;
const TAG_CLOSE: u64 = 3 << 56;
const TAG_READ: u64 = 4 << 56;
const TAG_RECV: u64 = 5 << 56;
const TAG_MASK: u64 = 0xff << 56;

/// Which device the transport opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The process-wide model device ([`model::ModelFabric::global`]): no hardware needed.
    Model,
    /// A real device (`rdma` feature). `None` fields are chosen automatically: the first device
    /// with an active port, that port, and on RoCE a RoCE v2 GID.
    Hardware {
        device: Option<String>,
        port: Option<u8>,
        gid_index: Option<u32>,
    },
}

impl DeviceChoice {
    /// From `SLUICE_IB_DEVICE` (`model` selects the model), `SLUICE_IB_PORT` and
    /// `SLUICE_IB_GID_INDEX`; automatic hardware selection when unset.
    pub fn from_env() -> DeviceChoice {
        let device = std::env::var("SLUICE_IB_DEVICE").ok().filter(|s| !s.is_empty());
        if device.as_deref() == Some("model") {
            return DeviceChoice::Model;
        }
        DeviceChoice::Hardware {
            device,
            port: std::env::var("SLUICE_IB_PORT").ok().and_then(|p| p.parse().ok()),
            gid_index: std::env::var("SLUICE_IB_GID_INDEX").ok().and_then(|p| p.parse().ok()),
        }
    }
}

/// Options of the ibverbs transport.
#[derive(Debug, Clone)]
pub struct IbvOptions {
    pub device: DeviceChoice,
    /// Bytes of each direction's ring (a power of two, 4 KiB to 1 GiB).
    pub ring_capacity: usize,
    /// Send requests per queue pair (capped by the device's `max_qp_wr`).
    pub send_depth: u32,
    /// Receives kept posted per queue pair (capped by `max_qp_wr`).
    pub recv_depth: u32,
    /// Entries of the shared completion queue (capped by `max_cqe`); it bounds the number of
    /// connections to `cq_entries / (send_depth + recv_depth)`.
    pub cq_entries: u32,
    /// How long the reactor and waiting operations spin before blocking.
    pub spin: Duration,
    pub handshake_timeout: Duration,
    /// How long a closing side waits for its close notice to complete before flushing.
    pub linger: Duration,
}

impl Default for IbvOptions {
    fn default() -> Self {
        IbvOptions {
            device: DeviceChoice::from_env(),
            ring_capacity: 2 << 20,
            send_depth: 128,
            recv_depth: 160,
            cq_entries: 1 << 16,
            spin: Duration::from_micros(50),
            handshake_timeout: Duration::from_secs(5),
            linger: Duration::from_secs(1),
        }
    }
}

/// The ibverbs transport context.
#[derive(Clone)]
pub struct IbvTransport {
    options: IbvOptions,
    opened: std::result::Result<Arc<ReactorOwner>, String>,
}

impl std::fmt::Debug for IbvTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvTransport")
            .field("device", &self.opened.as_ref().map(|o| o.reactor.device.name()))
            .finish()
    }
}

impl IbvTransport {
    /// Opens the configured device; a missing library, device or permission leaves the
    /// transport not viable (with the reason), never a panic.
    pub fn new(options: IbvOptions) -> IbvTransport {
        let device: std::result::Result<Arc<dyn VerbsDevice>, String> = match &options.device {
            DeviceChoice::Model => Ok(model_device()),
            DeviceChoice::Hardware {
                device,
                port,
                gid_index,
            } => open_hardware(device.as_deref(), *port, *gid_index),
        };
        Self::open(device, options)
    }

    /// A transport on a given device (a model device in tests).
    pub fn with_device(device: Arc<dyn VerbsDevice>, options: IbvOptions) -> IbvTransport {
        Self::open(Ok(device), options)
    }

    fn open(device: std::result::Result<Arc<dyn VerbsDevice>, String>, options: IbvOptions) -> IbvTransport {
        let opened = device.and_then(|d| Reactor::start(d, &options));
        if let Err(e) = &opened {
            tracing::debug!("ibv transport not viable: {e}");
        }
        IbvTransport { options, opened }
    }

    pub fn options(&self) -> &IbvOptions {
        &self.options
    }

    /// The opened device, when viable.
    pub fn device(&self) -> Option<Arc<dyn VerbsDevice>> {
        self.opened.as_ref().ok().map(|o| o.reactor.device.clone())
    }

    /// Connections not yet fully released (closed, flushed and drained).
    pub fn open_connections(&self) -> usize {
        self.opened
            .as_ref()
            .map_or(0, |o| o.reactor.conns.lock().expect("conns").len())
    }

    fn reactor(&self) -> Result<&Arc<Reactor>> {
        self.opened
            .as_ref()
            .map(|o| &o.reactor)
            .map_err(|reason| TransportError::NotViable {
                transport: NAME,
                reason: reason.clone(),
            })
    }
}

fn model_device() -> Arc<dyn VerbsDevice> {
    static DEVICE: std::sync::OnceLock<Arc<model::ModelDevice>> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| model::ModelFabric::global().device("model0", model::DEFAULT_LIMITS))
        .clone()
}

#[cfg(feature = "rdma")]
fn open_hardware(
    device: Option<&str>,
    port: Option<u8>,
    gid_index: Option<u32>,
) -> std::result::Result<Arc<dyn VerbsDevice>, String> {
    real::open(device, port, gid_index).map(|d| d as Arc<dyn VerbsDevice>)
}

#[cfg(not(feature = "rdma"))]
fn open_hardware(
    _device: Option<&str>,
    _port: Option<u8>,
    _gid_index: Option<u32>,
) -> std::result::Result<Arc<dyn VerbsDevice>, String> {
    Err("built without the `rdma` feature (libibverbs support)".into())
}

impl Default for IbvTransport {
    fn default() -> Self {
        IbvTransport::new(IbvOptions::default())
    }
}

impl Transport for IbvTransport {
    type Listener = IbvListener;
    type Connection = IbvConnection;

    fn name(&self) -> &'static str {
        NAME
    }

    fn viability(&self) -> Result<()> {
        self.reactor().map(|_| ())
    }

    fn domain_descriptor(&self) -> String {
        match &self.opened {
            Ok(o) => format!("ibv;{}", o.reactor.device.fabric()),
            Err(_) => String::new(),
        }
    }

    fn can_communicate_with(&self, remote: &str) -> bool {
        self.opened.is_ok() && remote == self.domain_descriptor()
    }

    async fn listen(&self, addr: &str) -> Result<IbvListener> {
        let reactor = self.reactor()?.clone();
        let addr = if addr.is_empty() { "127.0.0.1:0" } else { addr };
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| TransportError::io(addr, "listen", e))?;
        let address = listener
            .local_addr()
            .map_err(|e| TransportError::io(addr, "listen", e))?
            .to_string();
        let (tx, rx) = mpsc::channel(64);
        let options = self.options.clone();
        let task = tokio::spawn(async move {
            loop {
                let (stream, from) = match listener.accept().await {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(TransportError::io("ibv listener", "accept", e))).await;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let (tx, reactor, options) = (tx.clone(), reactor.clone(), options.clone());
                tokio::spawn(async move {
                    let peer = format!("ibv:{from}");
                    let result = establish(stream, peer, reactor, &options).await;
                    let _ = tx.send(result).await;
                });
            }
        });
        Ok(IbvListener {
            address,
            incoming: rx,
            task,
        })
    }

    async fn connect(&self, addr: &str) -> Result<IbvConnection> {
        let reactor = self.reactor()?.clone();
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| TransportError::io(addr, "connect", e))?;
        establish(stream, format!("ibv:{addr}"), reactor, &self.options).await
    }
}

/// Accepts ibverbs connections (bootstrapped on a TCP listener).
pub struct IbvListener {
    address: String,
    incoming: mpsc::Receiver<Result<IbvConnection>>,
    task: JoinHandle<()>,
}

impl Drop for IbvListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Listener for IbvListener {
    type Connection = IbvConnection;

    fn address(&self) -> String {
        self.address.clone()
    }

    async fn accept(&mut self) -> Result<IbvConnection> {
        match self.incoming.recv().await {
            Some(r) => r,
            None => Err(TransportError::Closed {
                peer: self.address.clone(),
            }),
        }
    }
}

/// What one side tells the other over TCP before the queue pairs connect.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hello {
    fabric: String,
    endpoint: Endpoint,
    inbox_addr: u64,
    inbox_rkey: u32,
    inbox_len: u64,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(80 + self.fabric.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.fabric.len() as u16).to_le_bytes());
        out.extend_from_slice(self.fabric.as_bytes());
        out.extend_from_slice(&self.endpoint.lid.to_le_bytes());
        out.extend_from_slice(&self.endpoint.gid);
        out.extend_from_slice(&self.endpoint.qpn.to_le_bytes());
        out.extend_from_slice(&self.endpoint.psn.to_le_bytes());
        out.extend_from_slice(&self.inbox_addr.to_le_bytes());
        out.extend_from_slice(&self.inbox_rkey.to_le_bytes());
        out.extend_from_slice(&self.inbox_len.to_le_bytes());
        out.extend_from_slice(&self.endpoint.mtu.to_le_bytes());
        out.push(self.endpoint.rd_responder);
        out
    }

    /// Reads and checks a peer's hello; never trusts a length before bounding it.
    async fn read(stream: &mut TcpStream) -> std::result::Result<Hello, String> {
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).await.map_err(|e| e.to_string())?;
        if &head[..8] != MAGIC {
            return Err(format!("not an ibverbs hello: {:?}", &head[..8]));
        }
        let version = u16::from_le_bytes([head[8], head[9]]);
        if version != VERSION {
            return Err(format!("protocol version {version}; this side speaks {VERSION}"));
        }
        let flen = u16::from_le_bytes([head[10], head[11]]) as usize;
        if flen > MAX_FABRIC {
            return Err(format!("fabric descriptor of {flen} bytes"));
        }
        let mut body = vec![0u8; flen + 2 + 16 + 4 + 4 + 8 + 4 + 8 + 4 + 1];
        stream.read_exact(&mut body).await.map_err(|e| e.to_string())?;
        let fabric = String::from_utf8(body[..flen].to_vec()).map_err(|_| "fabric is not UTF-8".to_string())?;
        let b = &body[flen..];
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("sized"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("sized"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("sized"));
        let mtu = u32_at(46);
        if !(MTU_256..=MTU_4096).contains(&mtu) {
            return Err(format!("path MTU code {mtu} is not an ibv_mtu (1..=5)"));
        }
        let rd_responder = b[50];
        if rd_responder == 0 {
            return Err("a peer that answers no RDMA reads".into());
        }
        Ok(Hello {
            fabric,
            endpoint: Endpoint {
                lid: u16_at(0),
                gid: b[2..18].try_into().expect("sized"),
                qpn: u32_at(18),
                psn: u32_at(22),
                mtu,
                rd_responder,
            },
            inbox_addr: u64_at(26),
            inbox_rkey: u32_at(34),
            inbox_len: u64_at(38),
        })
    }
}

/// Sets up the queue pair and rings over a fresh TCP connection (both sides run the same
/// steps: send hello, read hello, connect the queue pair, post receives, exchange ready).
async fn establish(
    mut stream: TcpStream,
    peer: String,
    reactor: Arc<Reactor>,
    options: &IbvOptions,
) -> Result<IbvConnection> {
    let fail = |reason: String| TransportError::Handshake {
        peer: peer.clone(),
        reason,
    };
    let _ = stream.set_nodelay(true);
    let setup = async {
        let half = Half::new(&reactor, options.ring_capacity, Access::REMOTE_WRITE).map_err(|e| fail(e.to_string()))?;
        let qp = reactor.new_qp().map_err(|e| fail(e.to_string()))?;
        let (lid, gid) = reactor.device.address();
        let limits = reactor.device.limits();
        let mine = Hello {
            fabric: reactor.device.fabric(),
            endpoint: Endpoint {
                lid,
                gid,
                qpn: qp.qp.qpn(),
                psn: rand::random::<u32>() & 0x00ff_ffff,
                mtu: limits.active_mtu,
                rd_responder: limits.max_rd_responder,
            },
            inbox_addr: half.region.addr(),
            inbox_rkey: half.mr.info().rkey,
            inbox_len: options.ring_capacity as u64,
        };
        stream
            .write_all(&mine.encode())
            .await
            .map_err(|e| TransportError::io(&peer, "send hello", e))?;
        let theirs = Hello::read(&mut stream)
            .await
            .map_err(|e| fail(format!("peer's hello: {e}")))?;
        if theirs.fabric != mine.fabric {
            return Err(fail(format!(
                "peer is on fabric {:?}, this side on {:?}",
                theirs.fabric, mine.fabric
            )));
        }
        let cap = theirs.inbox_len as usize;
        if !cap.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&cap) {
            return Err(fail(format!(
                "peer's ring of {cap} bytes is not a power of two in 4 KiB..1 GiB"
            )));
        }
        let outbox = Half::new(&reactor, cap, Access::LOCAL).map_err(|e| fail(e.to_string()))?;
        // RoCE routes by IP: both ends must speak the same address family.
        if mine.fabric.starts_with("roce") && !gid::same_family(&mine.endpoint.gid, &theirs.endpoint.gid) {
            return Err(fail(
                "the peer's RoCE GID is of another address family (IPv4 against IPv6): set SLUICE_IB_GID_INDEX on one side".into(),
            ));
        }
        // The smaller MTU of the two ports, and no more reads in flight than the peer answers.
        let path = Path::negotiate(&reactor.device.limits(), &theirs.endpoint);
        qp.qp
            .connect(mine.endpoint.psn, &theirs.endpoint, &path)
            .map_err(|e| fail(e.to_string()))?;
        for i in 0..qp.caps.recv_depth {
            qp.qp.post_recv(TAG_RECV | i as u64).map_err(|e| fail(e.to_string()))?;
        }
        Ok((qp, half, outbox, theirs))
    };
    let (qp, inbox, outbox, theirs) = match tokio::time::timeout(options.handshake_timeout, setup).await {
        Ok(r) => r?,
        Err(_) => return Err(fail("timed out".into())),
    };
    let conn = Arc::new(Conn {
        qp,
        inbox,
        outbox,
        peer_inbox: (theirs.inbox_addr, theirs.inbox_rkey),
        reactor: reactor.clone(),
        peer: peer.clone(),
        socket: stream,
        spin: options.spin,
        linger: options.linger,
        stopped: Stopped::default(),
        state: Mutex::new(State::default()),
        readable: Notify::new(),
        writable: Notify::new(),
        read_events: AtomicU64::new(0),
        write_events: AtomicU64::new(0),
        next_read: AtomicU64::new(0),
    });
    // The connection starts with its receives posted (in the handshake). It is registered
    // before the peer hears we are ready, so no completion of its first write finds it missing.
    conn.lock().rq = conn.qp.caps.recv_depth;
    reactor.register(conn.clone());
    let ready = tokio::time::timeout(options.handshake_timeout, exchange_ready(&conn.socket)).await;
    if let Err(reason) = ready.unwrap_or_else(|_| Err("timed out waiting for ready".into())) {
        let e = fail(reason);
        conn.fail(e.clone());
        return Err(e);
    }
    let watcher = conn.clone();
    tokio::spawn(async move {
        let mut b = [0u8; 1];
        // Nothing is sent on the socket after setup: any outcome means the peer is gone (or
        // this side released the connection and shut the socket).
        let _ = watcher.socket.peek(&mut b).await;
        watcher.socket_hung_up();
    });
    Ok(IbvConnection {
        conn: conn.clone(),
        _guard: Arc::new(CloseOnDrop(conn)),
    })
}

/// Both queue pairs can receive now: say so, and wait for the peer to say so.
async fn exchange_ready(socket: &TcpStream) -> std::result::Result<(), String> {
    loop {
        socket.writable().await.map_err(|e| e.to_string())?;
        match socket.try_write(&[1]) {
            Ok(1) => break,
            Ok(_) => return Err("could not send ready".into()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(format!("sending ready: {e}")),
        }
    }
    let mut ready = [0u8; 1];
    loop {
        socket.readable().await.map_err(|e| e.to_string())?;
        match socket.try_read(&mut ready) {
            Ok(1) if ready == [1] => return Ok(()),
            Ok(0) => return Err("peer hung up before ready".into()),
            Ok(_) => return Err(format!("unexpected ready byte {}", ready[0])),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(format!("waiting for ready: {e}")),
        }
    }
}

/// A ring's memory and its registration (field order: the registration goes first).
struct Half {
    mr: Box<dyn VerbsMr>,
    region: Region,
    len: usize,
}

impl Half {
    fn new(reactor: &Reactor, len: usize, access: Access) -> std::result::Result<Half, VerbsError> {
        let region = Region::new(len).map_err(|e| VerbsError::failed("allocate ring", e))?;
        // SAFETY: the region lives in the same `Half` and is dropped after the registration
        // (field order). Work requests on it are drained before the `Half` drops: a `Conn`
        // drops its queue pair first, and only once its flushed completions were polled.
        let mr = unsafe { reactor.device.register(region.ptr(), len, access)? };
        Ok(Half { mr, region, len })
    }
}

/// A queue pair with its reserved completion-queue share, returned on drop.
struct OwnedQp {
    qp: Box<dyn VerbsQp>,
    caps: QpCaps,
    reactor: Arc<Reactor>,
}

impl Drop for OwnedQp {
    fn drop(&mut self) {
        self.reactor
            .reserved
            .fetch_sub(self.caps.send_depth + self.caps.recv_depth, Ordering::AcqRel);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Phase {
    #[default]
    Open,
    /// The close notice is posted; waiting for its completion (or the linger deadline).
    Closing,
    /// The queue pair is in the error state; waiting for its flushed completions.
    Draining,
    /// Drained and out of the reactor; the socket is shut.
    Released,
}

#[derive(Default)]
struct State {
    // Writer: bytes copied into the outbox, posted to the peer, acknowledged by the peer.
    head: u64,
    posted: u64,
    peer_consumed: u64,
    // Reader: bytes landed in the inbox, consumed, acknowledged to the peer.
    arrived: u64,
    consumed: u64,
    acked: u64,
    /// Send and receive requests outstanding (until their completion is polled).
    sq: u32,
    rq: u32,
    phase: Phase,
    closing_since: Option<Instant>,
    close_done: bool,
    peer_closed: bool,
    /// The bootstrap socket hung up, stamped with the reactor's poll count seen then; it
    /// becomes `peer_gone` once a later poll found the completion queue empty (`advance`).
    hung_up: Option<u64>,
    /// The peer process is gone: nothing more will arrive.
    peer_gone: bool,
    /// One-sided reads waiting for their completion.
    reads: HashMap<u64, oneshot::Sender<std::result::Result<(), WcStatus>>>,
}

/// One connection's resources and state. Field order is drop order: the queue pair goes before
/// the registrations, which go before the memory.
struct Conn {
    qp: OwnedQp,
    inbox: Half,
    outbox: Half,
    peer_inbox: (u64, u32),
    reactor: Arc<Reactor>,
    peer: String,
    socket: TcpStream,
    spin: Duration,
    linger: Duration,
    stopped: Stopped,
    state: Mutex<State>,
    readable: Notify,
    writable: Notify,
    /// Bumped on every event that may unblock a reader or writer (for spinning without the
    /// lock).
    read_events: AtomicU64,
    write_events: AtomicU64,
    next_read: AtomicU64,
}

#[derive(Clone, Copy)]
enum Side {
    Reader,
    Writer,
}

impl Conn {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("ibv connection state")
    }

    fn send_depth(&self) -> u32 {
        self.qp.caps.send_depth
    }

    fn wake(&self, side: Side) {
        match side {
            Side::Reader => {
                self.read_events.fetch_add(1, Ordering::Release);
                self.readable.notify_one();
            }
            Side::Writer => {
                self.write_events.fetch_add(1, Ordering::Release);
                self.writable.notify_one();
            }
        }
    }

    fn wake_all(&self) {
        self.wake(Side::Reader);
        self.wake(Side::Writer);
    }

    /// Records the first error, starts teardown and wakes every waiter.
    fn fail(&self, error: TransportError) -> TransportError {
        if self.stopped.stop(error) {
            self.begin_close(false);
        }
        self.wake_all();
        self.stopped.error().expect("stopped connections have an error")
    }

    fn close(&self) {
        if self.stopped.stop(TransportError::Closed {
            peer: self.peer.clone(),
        }) {
            self.begin_close(true);
        }
        self.wake_all();
    }

    /// Graceful: post the close notice behind the data and let the reactor flush once it has
    /// completed. Otherwise flush now.
    fn begin_close(&self, graceful: bool) {
        let mut st = self.lock();
        if st.phase != Phase::Open {
            return;
        }
        // No notice to a peer that closed or hung up: it would not be received.
        let peer_done = st.peer_gone || st.hung_up.is_some() || st.peer_closed;
        let notice = graceful && !peer_done && st.sq < self.send_depth() && {
            let wr = SendWr {
                wr_id: TAG_CLOSE,
                op: SendOp::SendImm { imm: CLOSE_IMM },
                local: None,
            };
            // SAFETY: no local memory.
            unsafe { self.qp.qp.post_send(&wr) }.is_ok()
        };
        if notice {
            st.sq += 1;
            st.phase = Phase::Closing;
            st.closing_since = Some(Instant::now());
        } else {
            self.flush(&mut st);
        }
        drop(st);
        self.reactor.attention(self);
    }

    fn flush(&self, st: &mut State) {
        st.phase = Phase::Draining;
        if let Err(e) = self.qp.qp.set_error() {
            tracing::warn!(peer = %self.peer, "moving the queue pair to error: {e}");
        }
    }

    /// The bootstrap socket hung up (or failed). The peer may have done so right after its
    /// last requests completed, before the reactor polled their completions here, so the
    /// hang-up is only noted; the reactor turns it into `peer_gone` once they are applied
    /// (`advance`).
    fn socket_hung_up(&self) {
        let mut st = self.lock();
        if st.phase == Phase::Released || st.hung_up.is_some() {
            return;
        }
        st.hung_up = Some(self.reactor.polls.load(Ordering::SeqCst));
        drop(st);
        self.reactor.attention(self);
    }

    fn peer_lost(&self, st: &State) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer.clone(),
            detail: if st.peer_closed {
                "peer closed the connection".into()
            } else {
                "peer process hung up".into()
            },
        }
    }

    fn protocol(&self, detail: String) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer.clone(),
            detail: format!("protocol violation: {detail}"),
        }
    }

    /// Posts the outbox bytes not yet posted, as far as send slots allow (two are kept for the
    /// acknowledgement and the close notice). Returns an error when a post fails.
    fn post_data(&self, st: &mut State) -> Result<()> {
        let cap = self.outbox.len as u64;
        while st.posted < st.head && st.sq + 2 < self.send_depth() {
            let start = st.posted % cap;
            let len = (st.head - st.posted).min(cap - start);
            let wr = SendWr {
                wr_id: TAG_DATA | (st.posted & !TAG_MASK),
                op: SendOp::WriteImm {
                    remote_addr: self.peer_inbox.0 + start,
                    rkey: self.peer_inbox.1,
                    imm: len as u32,
                },
                local: Some(Sge {
                    addr: self.outbox.region.addr() + start,
                    len: len as u32,
                    lkey: self.outbox.mr.info().lkey,
                }),
            };
            // SAFETY: the range lies in the outbox registration; the writer does not touch
            // posted-but-unacknowledged bytes (free space excludes them) and the outbox lives
            // until the queue pair is drained.
            unsafe { self.qp.qp.post_send(&wr) }.map_err(|e| self.verbs_error("post write", e))?;
            st.sq += 1;
            st.posted += len;
        }
        Ok(())
    }

    /// Acknowledges consumed inbox bytes once a quarter of the ring is consumed.
    fn post_ack(&self, st: &mut State) -> Result<()> {
        let pending = st.consumed - st.acked;
        // After its close notice the peer writes nothing more (and may have flushed its queue
        // pair): space handed back would go unused.
        if st.peer_closed || pending == 0 || pending < self.inbox.len as u64 / 4 || st.sq + 1 >= self.send_depth() {
            return Ok(());
        }
        let wr = SendWr {
            wr_id: TAG_ACK,
            op: SendOp::SendImm { imm: pending as u32 },
            local: None,
        };
        // SAFETY: no local memory.
        unsafe { self.qp.qp.post_send(&wr) }.map_err(|e| self.verbs_error("post acknowledgement", e))?;
        st.sq += 1;
        st.acked = st.consumed;
        Ok(())
    }

    fn verbs_error(&self, op: &'static str, e: VerbsError) -> TransportError {
        match e {
            VerbsError::DeviceGone(d) => TransportError::PeerLost {
                peer: self.peer.clone(),
                detail: format!("device {d} is gone"),
            },
            other => TransportError::io(&self.peer, op, std::io::Error::other(other.to_string())),
        }
    }

    fn completion_error(&self, status: WcStatus) -> TransportError {
        let detail = match status {
            WcStatus::RetryExceeded => "the peer stopped answering (retries exceeded)".to_owned(),
            WcStatus::RnrRetryExceeded => "the peer posted no receive in time".to_owned(),
            other => format!("work request failed: {other:?}"),
        };
        TransportError::PeerLost {
            peer: self.peer.clone(),
            detail,
        }
    }

    /// Handles one completion (on the reactor thread).
    fn on_completion(&self, c: &Completion) {
        let tag = c.wr_id & TAG_MASK;
        let mut st = self.lock();
        let mut failure = None;
        if tag == TAG_RECV {
            st.rq -= 1;
            if c.status == WcStatus::Success {
                let imm = c.imm.unwrap_or(0);
                match c.kind {
                    WcKind::RecvWriteImm => {
                        let len = imm as u64;
                        if st.arrived - st.consumed + len > self.inbox.len as u64 {
                            failure = Some(self.protocol(format!("{len} bytes written beyond the ring's free space")));
                        } else {
                            st.arrived += len;
                            self.wake(Side::Reader);
                        }
                    }
                    _ if imm == CLOSE_IMM => {
                        st.peer_closed = true;
                        self.wake_all();
                    }
                    _ => {
                        if st.peer_consumed + imm as u64 > st.posted {
                            failure = Some(self.protocol("acknowledged bytes never sent".into()));
                        } else {
                            st.peer_consumed += imm as u64;
                            self.wake(Side::Writer);
                        }
                    }
                }
                if st.phase == Phase::Open && failure.is_none() {
                    match self.qp.qp.post_recv(c.wr_id) {
                        Ok(()) => st.rq += 1,
                        Err(e) => failure = Some(self.verbs_error("post receive", e)),
                    }
                }
            } else if c.status != WcStatus::Flushed {
                failure = Some(self.completion_error(c.status));
            }
        } else {
            st.sq -= 1;
            match tag {
                TAG_READ => {
                    if let Some(tx) = st.reads.remove(&c.wr_id) {
                        let _ = tx.send(if c.status == WcStatus::Success {
                            Ok(())
                        } else {
                            Err(c.status)
                        });
                    }
                }
                TAG_CLOSE => st.close_done = true,
                _ => {}
            }
            if c.status != WcStatus::Success && c.status != WcStatus::Flushed {
                if st.peer_closed {
                    // The peer closed after its data and tore its queue pair down: a request of
                    // ours it no longer answered (an acknowledgement posted before we polled its
                    // notice) fails, yet everything it sent has arrived and stays readable.
                    // Tear down quietly instead of failing the connection.
                    if st.phase == Phase::Open {
                        self.flush(&mut st);
                    }
                } else {
                    failure = Some(self.completion_error(c.status));
                }
            }
            if st.phase == Phase::Open && failure.is_none() {
                // A slot is free: post what the writer left behind, and a deferred acknowledgement.
                if let Err(e) = self.post_data(&mut st).and_then(|_| self.post_ack(&mut st)) {
                    failure = Some(e);
                }
            }
            self.wake(Side::Writer);
        }
        let needs_attention = st.phase != Phase::Open;
        drop(st);
        if let Some(e) = failure {
            self.fail(e);
        } else if needs_attention {
            self.reactor.attention(self);
        }
    }

    /// Advances teardown (reactor thread); `drained` is the number of the last poll that found
    /// the completion queue empty. Returns true once released.
    fn advance(&self, drained: u64) -> bool {
        let mut st = self.lock();
        let mut gone_now = false;
        if !st.peer_gone && st.hung_up.is_some_and(|seen| seen < drained) {
            // A poll that began after the hang-up found the queue empty: whatever the peer did
            // before hanging up (its data, its close notice) has been applied.
            st.peer_gone = true;
            gone_now = true;
        }
        if st.phase == Phase::Open && st.peer_gone {
            // The peer process is gone: nothing more will arrive; flush (data already in the
            // inbox stays readable).
            self.flush(&mut st);
        }
        if st.phase == Phase::Closing
            && (st.close_done || st.peer_gone || st.closing_since.is_some_and(|t| t.elapsed() >= self.linger))
        {
            self.flush(&mut st);
        }
        if st.phase == Phase::Draining && st.sq == 0 && st.rq == 0 {
            st.phase = Phase::Released;
            for (_, tx) in st.reads.drain() {
                let _ = tx.send(Err(WcStatus::Flushed));
            }
            drop(st);
            let _ = socket2::SockRef::from(&self.socket).shutdown(std::net::Shutdown::Both);
            self.wake_all();
            return true;
        }
        drop(st);
        if gone_now {
            self.wake_all();
        }
        false
    }

    /// Waits until the side's condition may have changed: spins on the event counter first,
    /// then parks on the notifier.
    async fn wait(&self, side: Side, seen: u64) {
        let (events, notify) = match side {
            Side::Reader => (&self.read_events, &self.readable),
            Side::Writer => (&self.write_events, &self.writable),
        };
        if !self.spin.is_zero() {
            let start = Instant::now();
            let mut spins = 0u32;
            loop {
                if events.load(Ordering::Acquire) != seen {
                    return;
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && start.elapsed() >= self.spin {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if events.load(Ordering::Acquire) != seen {
            return;
        }
        notified.await;
    }

    /// Fills `dst` from the inbox, waiting for data as needed.
    async fn fill(&self, dst: &mut [u8]) -> Result<()> {
        let cap = self.inbox.len as u64;
        let mut done = 0;
        while done < dst.len() {
            let seen = self.read_events.load(Ordering::Acquire);
            {
                let mut st = self.lock();
                self.stopped.check()?;
                let avail = st.arrived - st.consumed;
                if avail > 0 {
                    let start = st.consumed % cap;
                    let n = avail.min((dst.len() - done) as u64).min(cap - start) as usize;
                    // SAFETY: [consumed, arrived) landed before completions we polled under this
                    // lock, and the peer writes there only after we acknowledge it.
                    unsafe { self.inbox.region.read(start as usize, &mut dst[done..done + n]) };
                    st.consumed += n as u64;
                    done += n;
                    self.post_ack(&mut st)?;
                    continue;
                }
                if st.peer_closed || st.peer_gone || st.phase == Phase::Released {
                    return Err(self.peer_lost(&st));
                }
            }
            self.wait(Side::Reader, seen).await;
        }
        Ok(())
    }

    /// Waits until a byte has arrived in the inbox, consuming nothing (cancel-safe: the only
    /// await is the notifier's).
    async fn readable(&self) -> Result<()> {
        loop {
            let seen = self.read_events.load(Ordering::Acquire);
            {
                let st = self.lock();
                self.stopped.check()?;
                if st.arrived > st.consumed {
                    return Ok(());
                }
                if st.peer_closed || st.peer_gone || st.phase == Phase::Released {
                    return Err(self.peer_lost(&st));
                }
            }
            self.wait(Side::Reader, seen).await;
        }
    }

    async fn read_frame(&self, limit: usize, into: Option<&mut [u8]>) -> Result<(usize, Option<Vec<u8>>)> {
        let mut header = [0u8; HEADER_LEN];
        self.fill(&mut header).await?;
        let len = decode_header(header);
        if len > limit as u64 {
            return Err(TransportError::FrameTooLarge {
                peer: self.peer.clone(),
                len,
                limit,
            });
        }
        let len = len as usize;
        match into {
            Some(buf) => {
                self.fill(&mut buf[..len]).await?;
                Ok((len, None))
            }
            None => {
                let mut out = vec![0u8; len];
                self.fill(&mut out).await?;
                Ok((len, Some(out)))
            }
        }
    }

    /// Copies a frame into the outbox as space allows and posts it.
    async fn write_frame(&self, parts: &[&[u8]]) -> Result<()> {
        let cap = self.outbox.len as u64;
        let header = encode_header(total_len(parts));
        for part in std::iter::once(&header[..]).chain(parts.iter().copied()) {
            let mut off = 0;
            while off < part.len() {
                let seen = self.write_events.load(Ordering::Acquire);
                {
                    let mut st = self.lock();
                    self.stopped.check()?;
                    if st.peer_closed || st.peer_gone || st.phase == Phase::Released {
                        return Err(TransportError::PeerLost {
                            peer: self.peer.clone(),
                            detail: "peer stopped reading (closed the connection)".into(),
                        });
                    }
                    let free = cap - (st.head - st.peer_consumed);
                    if free > 0 {
                        let start = st.head % cap;
                        let n = free.min((part.len() - off) as u64).min(cap - start) as usize;
                        // SAFETY: [head, peer_consumed + cap) is free: neither posted nor being
                        // read by the NIC.
                        unsafe { self.outbox.region.write(start as usize, &part[off..off + n]) };
                        st.head += n as u64;
                        off += n;
                        if st.head - st.posted >= cap / 4 {
                            self.post_data(&mut st)?;
                        }
                        continue;
                    }
                    self.post_data(&mut st)?;
                }
                self.wait(Side::Writer, seen).await;
            }
        }
        let mut st = self.lock();
        // What does not fit in the send queue now is posted by the reactor as slots free up.
        self.post_data(&mut st)
    }

    /// One-sided RDMA read of `len` bytes at the peer's `remote_addr` into `local`.
    async fn rdma_read(&self, local: Sge, remote_addr: u64, rkey: u32) -> Result<()> {
        let id = TAG_READ | (self.next_read.fetch_add(1, Ordering::Relaxed) & !TAG_MASK);
        let rx = loop {
            let seen = self.write_events.load(Ordering::Acquire);
            {
                let mut st = self.lock();
                self.stopped.check()?;
                if st.phase != Phase::Open || st.peer_gone {
                    return Err(self.peer_lost(&st));
                }
                if st.sq + 2 < self.send_depth() {
                    let wr = SendWr {
                        wr_id: id,
                        op: SendOp::Read { remote_addr, rkey },
                        local: Some(local),
                    };
                    // SAFETY: RdmaHandle::read's contract: `local` is registered and stays
                    // valid until this read completes (or the connection is drained).
                    unsafe { self.qp.qp.post_send(&wr) }.map_err(|e| self.verbs_error("post read", e))?;
                    st.sq += 1;
                    let (tx, rx) = oneshot::channel();
                    st.reads.insert(id, tx);
                    break rx;
                }
            }
            self.wait(Side::Writer, seen).await;
        };
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(WcStatus::Flushed)) | Err(_) => {
                Err(self.stopped.error().unwrap_or_else(|| self.peer_lost(&self.lock())))
            }
            Ok(Err(status)) => Err(self.completion_error(status)),
        }
    }
}

/// Closes the connection when the last handle (connection, reader, writer) goes.
struct CloseOnDrop(Arc<Conn>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The reactor's owner handle: when the transport (all its clones) goes, the reactor thread
/// exits once its connections are released.
struct ReactorOwner {
    reactor: Arc<Reactor>,
}

impl Drop for ReactorOwner {
    fn drop(&mut self) {
        self.reactor.shutdown.store(true, Ordering::Release);
        self.reactor.cq.wake();
    }
}

/// One per transport context: the device, the shared completion queue, and the thread that
/// polls it.
struct Reactor {
    device: Arc<dyn VerbsDevice>,
    cq: Box<dyn VerbsCq>,
    cq_entries: u32,
    reserved: AtomicU32,
    caps: QpCaps,
    conns: Mutex<HashMap<u32, Arc<Conn>>>,
    /// Connections whose teardown needs a look.
    pending: Mutex<Vec<u32>>,
    has_pending: AtomicBool,
    shutdown: AtomicBool,
    spin: Duration,
    /// Numbers the completion-queue polls: bumped just before each one. A socket hang-up is
    /// stamped with the value it saw, so the reactor can tell which polls began after it.
    polls: AtomicU64,
}

impl Reactor {
    fn start(device: Arc<dyn VerbsDevice>, options: &IbvOptions) -> std::result::Result<Arc<ReactorOwner>, String> {
        let ring = options.ring_capacity;
        if !ring.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&ring) {
            return Err(format!(
                "ring capacity {ring} is not a power of two between 4 KiB and 1 GiB"
            ));
        }
        let limits = device.limits();
        // One connection pins its two rings; refuse up front (with how to raise the limit)
        // rather than fail every connection later.
        if limits.memlock < 2 * ring as u64 {
            return Err(memlock_hint(limits.memlock, 2 * ring as u64));
        }
        let caps = QpCaps {
            send_depth: options.send_depth.min(limits.max_qp_wr).max(4),
            recv_depth: options.recv_depth.min(limits.max_qp_wr).max(4),
        };
        if caps.send_depth > limits.max_qp_wr || caps.recv_depth > limits.max_qp_wr {
            return Err(format!(
                "device allows only {} work requests per queue",
                limits.max_qp_wr
            ));
        }
        let cq_entries = options.cq_entries.min(limits.max_cqe);
        if cq_entries < caps.send_depth + caps.recv_depth {
            return Err(format!("device completion queues hold only {cq_entries} entries"));
        }
        let cq = device.create_cq(cq_entries).map_err(|e| e.to_string())?;
        tracing::info!(
            device = %device.name(),
            fabric = %device.fabric(),
            send_depth = caps.send_depth,
            recv_depth = caps.recv_depth,
            cq_entries,
            "ibv transport ready"
        );
        let reactor = Arc::new(Reactor {
            device,
            cq,
            cq_entries,
            reserved: AtomicU32::new(0),
            caps,
            conns: Mutex::new(HashMap::new()),
            pending: Mutex::new(Vec::new()),
            has_pending: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            spin: options.spin,
            polls: AtomicU64::new(0),
        });
        let r = reactor.clone();
        std::thread::Builder::new()
            .name("sluice-ibv".into())
            .spawn(move || r.run())
            .map_err(|e| format!("cannot start the reactor thread: {e}"))?;
        Ok(Arc::new(ReactorOwner { reactor }))
    }

    /// A queue pair, if the completion queue has room for its completions.
    fn new_qp(self: &Arc<Self>) -> std::result::Result<OwnedQp, VerbsError> {
        let need = self.caps.send_depth + self.caps.recv_depth;
        let prev = self.reserved.fetch_add(need, Ordering::AcqRel);
        if prev + need > self.cq_entries {
            self.reserved.fetch_sub(need, Ordering::AcqRel);
            return Err(VerbsError::failed(
                "create_qp",
                format!(
                    "the completion queue ({} entries) is fully reserved by {} connections",
                    self.cq_entries,
                    prev / need
                ),
            ));
        }
        // From here the reservation is returned by OwnedQp's drop (or right here on failure).
        let qp = self.device.create_qp(self.cq.as_ref(), self.caps);
        match qp {
            Ok(qp) => Ok(OwnedQp {
                qp,
                caps: self.caps,
                reactor: self.clone(),
            }),
            Err(e) => {
                self.reserved.fetch_sub(need, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    fn register(&self, conn: Arc<Conn>) {
        self.conns.lock().expect("conns").insert(conn.qp.qp.qpn(), conn);
    }

    fn attention(&self, conn: &Conn) {
        self.pending.lock().expect("pending").push(conn.qp.qp.qpn());
        self.has_pending.store(true, Ordering::Release);
        self.cq.wake();
    }

    fn run(self: Arc<Self>) {
        let mut batch = Vec::with_capacity(64);
        let mut closing: Vec<u32> = Vec::new();
        let mut idle_since = Instant::now();
        // The number of the last poll that found the completion queue empty: every completion
        // queued before that poll began has been applied.
        let mut drained = 0u64;
        // Whether the completion queue is armed and polled since (see `VerbsCq::arm`).
        let mut armed = false;
        loop {
            batch.clear();
            let poll = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
            if let Err(e) = self.cq.poll(&mut batch, 64) {
                self.device_lost(e);
                return;
            }
            if batch.is_empty() {
                drained = poll;
            }
            if !batch.is_empty() {
                let conns = self.conns.lock().expect("conns");
                let targets: Vec<Option<Arc<Conn>>> = batch.iter().map(|c| conns.get(&c.qpn).cloned()).collect();
                drop(conns);
                for (c, conn) in batch.iter().zip(targets) {
                    if let Some(conn) = conn {
                        conn.on_completion(c);
                    }
                }
                idle_since = Instant::now();
            }
            if self.has_pending.swap(false, Ordering::AcqRel) {
                let mut p = self.pending.lock().expect("pending");
                closing.append(&mut p);
                closing.sort_unstable();
                closing.dedup();
            }
            if !closing.is_empty() {
                closing.retain(|qpn| {
                    let conn = self.conns.lock().expect("conns").get(qpn).cloned();
                    match conn {
                        Some(conn) if conn.advance(drained) => {
                            self.conns.lock().expect("conns").remove(qpn);
                            false
                        }
                        Some(_) => true,
                        None => false,
                    }
                });
            }
            if !batch.is_empty() {
                continue;
            }
            if self.shutdown.load(Ordering::Acquire) && self.conns.lock().expect("conns").is_empty() {
                return;
            }
            if idle_since.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            // Arm for the next completion, then poll once more before sleeping: a completion
            // that arrived between the last poll and the arming raises no event.
            if !armed {
                if let Err(e) = self.cq.arm() {
                    self.device_lost(e);
                    return;
                }
                armed = true;
                continue;
            }
            // Closing connections are re-checked at least this often (linger deadlines).
            let timeout = if closing.is_empty() { 200 } else { 5 };
            if let Err(e) = self.cq.wait(Duration::from_millis(timeout)) {
                self.device_lost(e);
                return;
            }
            armed = false;
        }
    }

    /// The device is gone (or this process is "killed" in the model): every connection fails
    /// and its socket is shut, so peers learn at once.
    fn device_lost(&self, e: VerbsError) {
        tracing::error!(device = %self.device.name(), "ibv device lost: {e}");
        let conns: Vec<Arc<Conn>> = self.conns.lock().expect("conns").drain().map(|(_, c)| c).collect();
        for c in conns {
            c.stopped.stop(TransportError::PeerLost {
                peer: c.peer.clone(),
                detail: format!("local device lost: {e}"),
            });
            let mut st = c.lock();
            st.phase = Phase::Released;
            for (_, tx) in st.reads.drain() {
                let _ = tx.send(Err(WcStatus::Flushed));
            }
            drop(st);
            let _ = socket2::SockRef::from(&c.socket).shutdown(std::net::Shutdown::Both);
            c.wake_all();
        }
    }
}

/// An established ibverbs connection.
pub struct IbvConnection {
    conn: Arc<Conn>,
    _guard: Arc<CloseOnDrop>,
}

impl IbvConnection {
    /// Bytes of the peer's inbox ring (this side's outbox).
    pub fn ring_capacity(&self) -> usize {
        self.conn.outbox.len
    }

    /// One-sided RDMA on this connection's queue pair (for the RDMA channels).
    pub fn rdma(&self) -> RdmaHandle {
        RdmaHandle {
            conn: self.conn.clone(),
            _guard: self._guard.clone(),
        }
    }
}

impl Connection for IbvConnection {
    type Reader = IbvReader;
    type Writer = IbvWriter;

    fn peer(&self) -> &str {
        &self.conn.peer
    }

    fn split(self) -> (IbvReader, IbvWriter) {
        (
            IbvReader {
                conn: self.conn.clone(),
                _guard: self._guard.clone(),
            },
            IbvWriter {
                conn: self.conn,
                _guard: self._guard,
            },
        )
    }
}

/// One-sided operations on a connection's queue pair, sharing its send queue.
#[derive(Clone)]
pub struct RdmaHandle {
    conn: Arc<Conn>,
    _guard: Arc<CloseOnDrop>,
}

impl RdmaHandle {
    /// The device the queue pair lives on (to register memory for [`read`](Self::read)).
    pub fn device(&self) -> Arc<dyn VerbsDevice> {
        self.conn.reactor.device.clone()
    }

    pub fn peer(&self) -> &str {
        &self.conn.peer
    }

    /// Reads `local.len` bytes of the peer's memory at `remote_addr` (registration `rkey`)
    /// into `local`. Completes when the bytes have landed.
    ///
    /// # Safety
    /// `local` lies in a live registration of [`device`](Self::device) allowing local writes,
    /// and that memory stays valid and untouched until this future completes. If the future is
    /// dropped first, it must stay valid until the connection is closed and drained (the
    /// transport flushes it before releasing).
    pub async unsafe fn read(&self, local: Sge, remote_addr: u64, rkey: u32) -> Result<()> {
        self.conn.rdma_read(local, remote_addr, rkey).await
    }
}

/// Receiving half of an ibverbs connection.
pub struct IbvReader {
    conn: Arc<Conn>,
    _guard: Arc<CloseOnDrop>,
}

/// Sending half of an ibverbs connection.
pub struct IbvWriter {
    conn: Arc<Conn>,
    _guard: Arc<CloseOnDrop>,
}

/// Runs one read or write: fails at once on a stopped connection, poisons the connection if
/// the operation is cancelled part-way, and records its error as the connection's.
async fn guarded<T>(
    conn: &Arc<Conn>,
    op: &'static str,
    run: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    conn.stopped.check()?;
    let c = conn.clone();
    let guard = OpGuard::new(move || {
        c.fail(TransportError::Poisoned {
            peer: c.peer.clone(),
            op,
        });
    });
    let r = run.await;
    guard.finish();
    r.map_err(|e| conn.fail(e))
}

fn closer(conn: &Arc<Conn>) -> Closer {
    let conn = conn.clone();
    Closer::new(move || conn.close())
}

impl FrameReader for IbvReader {
    async fn read(&mut self, buf: &mut [u8]) -> Result<usize> {
        let limit = buf.len();
        let run = self.conn.read_frame(limit, Some(buf));
        guarded(&self.conn, "read", async move { run.await.map(|(n, _)| n) }).await
    }

    async fn read_vec(&mut self, limit: usize) -> Result<Vec<u8>> {
        let run = self.conn.read_frame(limit, None);
        guarded(&self.conn, "read", async move {
            run.await.map(|(_, v)| v.expect("allocated"))
        })
        .await
    }

    async fn readable(&mut self) -> Result<()> {
        self.conn.readable().await
    }

    fn close(&self) {
        self.conn.close()
    }

    fn closer(&self) -> Closer {
        closer(&self.conn)
    }

    fn peer(&self) -> &str {
        &self.conn.peer
    }
}

impl FrameWriter for IbvWriter {
    async fn write(&mut self, parts: &[&[u8]]) -> Result<()> {
        guarded(&self.conn, "write", self.conn.write_frame(parts)).await
    }

    fn close(&self) {
        self.conn.close()
    }

    fn closer(&self) -> Closer {
        closer(&self.conn)
    }

    fn peer(&self) -> &str {
        &self.conn.peer
    }
}

impl IbvWriter {
    /// One-sided RDMA on this connection's queue pair.
    pub fn rdma(&self) -> RdmaHandle {
        RdmaHandle {
            conn: self.conn.clone(),
            _guard: self._guard.clone(),
        }
    }
}

#[cfg(test)]
mod tests;
