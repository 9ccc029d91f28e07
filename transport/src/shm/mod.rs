//! Shared-memory transport: two rings in memfd segments, one per direction, set up over a Unix
//! socket in the abstract namespace with `SCM_RIGHTS`.
//!
//! Each side creates its *inbox* ring plus two eventfds (data-ready, space-ready) and sends the
//! three descriptors to the peer, which maps the inbox as its outbox. After setup the socket
//! carries nothing; its hang-up tells a parked side that the peer process is gone.
//!
//! Waiting: a side that finds its ring empty (or full) spins for at most [`ShmOptions::spin`]
//! (and only while fewer threads of the host spin than there are cores: see [`spin`]), then
//! sets its *parked* flag and sleeps on its eventfd (through tokio), so a busy connection gets
//! spinning latency and an idle one costs no CPU. The other side signals the eventfd only when
//! the flag is set (a store/fence/load on each side, so no wake-up is lost), and only once a
//! sleep: the first signal marks the flag signalled, and the sleeper sets it again before it
//! next looks at its ring.
//!
//! Domain: the descriptor holds the boot id and the network, IPC and user namespaces, so peers
//! on different hosts or in different containers never choose shared memory. (The abstract
//! socket is scoped by the network namespace; the user namespace governs credentials.)
//!
//! Addresses are abstract socket names; `listen("")` picks a fresh one.

mod ring;
mod shared;
mod spin;
pub mod stats;
mod sys;

use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

pub use shared::SharedFile;
pub use spin::{occupy_core, CoreClaim};
pub use sys::page_size;
use tokio::io::Interest;
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::closing::{OpGuard, Stopped};
use crate::error::{Result, TransportError};
use crate::frame::{total_len, HEADER_LEN};
use crate::{Closer, Connection, FrameReader, FrameWriter, Listener, Transport};
use ring::{padded, word, Consumer, Producer, Ring};

const NAME: &str = "shm";
const HANDSHAKE_MAGIC: &[u8; 8] = b"SLCSHM02";

/// Options of the shared-memory transport.
#[derive(Debug, Clone)]
pub struct ShmOptions {
    /// Bytes in each direction's ring (a power of two, 4 KiB to 1 GiB). Frames larger than the
    /// ring stream through it.
    pub ring_capacity: usize,
    /// How long a side spins on an empty or full ring before parking on its eventfd. Zero parks
    /// at once (lowest CPU, highest latency); longer keeps wake-ups (tens of µs) off busy
    /// connections. A side whose recent waits typically lasted longer than this but at most
    /// 2.5 ms (a caller waiting on a handler that computes) spins up to twice that typical wait
    /// instead, yielding its core to any thread ready to run on it.
    pub spin: Duration,
    /// How long an accepted socket may take to complete the descriptor exchange.
    pub handshake_timeout: Duration,
    /// Busy polling: a waiting side never parks. It spins for as long as it waits (in rounds of
    /// `spin`, between which it lets its runtime run other tasks and looks whether the peer
    /// process is gone), whatever other waiters the host has. Lowest latency, for hosts with a
    /// core to give to each waiting connection side: while it waits, that side keeps one core
    /// fully busy, idle connections included. Off by default (adaptive: spin, then park);
    /// `SLUICE_BUSY_POLL=1` in the environment turns it on.
    pub busy_poll: bool,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_capacity: 2 << 20,
            spin: Duration::from_micros(50),
            handshake_timeout: Duration::from_secs(5),
            busy_poll: busy_poll_from_env(),
        }
    }
}

/// Whether `SLUICE_BUSY_POLL` asks for busy polling (`1`, `true`, `yes`, `on`).
pub fn busy_poll_from_env() -> bool {
    std::env::var("SLUICE_BUSY_POLL")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// The shared-memory transport context.
#[derive(Debug, Clone)]
pub struct ShmTransport {
    options: ShmOptions,
    descriptor: std::result::Result<String, String>,
}

impl ShmTransport {
    pub fn new(options: ShmOptions) -> Self {
        let descriptor = Self::probe(&options);
        ShmTransport { options, descriptor }
    }

    fn probe(options: &ShmOptions) -> std::result::Result<String, String> {
        if !options.ring_capacity.is_power_of_two()
            || !(ring::MIN_CAPACITY..=ring::MAX_CAPACITY).contains(&options.ring_capacity)
        {
            return Err(format!(
                "ring capacity {} is not a power of two between 4 KiB and 1 GiB",
                options.ring_capacity
            ));
        }
        let identity = crate::host::identity(&["net", "ipc", "user"])
            .ok_or_else(|| "cannot read the boot id or namespaces from /proc".to_owned())?;
        Ring::create(ring::MIN_CAPACITY).map_err(|e| format!("cannot create a shared memory segment: {e}"))?;
        sys::eventfd().map_err(|e| format!("cannot create an eventfd: {e}"))?;
        Ok(format!("shm;{identity}"))
    }

    pub fn options(&self) -> &ShmOptions {
        &self.options
    }
}

impl Default for ShmTransport {
    fn default() -> Self {
        ShmTransport::new(ShmOptions::default())
    }
}

fn abstract_addr(name: &str) -> Result<std::os::unix::net::SocketAddr> {
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| TransportError::BadAddress {
        transport: NAME,
        addr: name.to_owned(),
        reason: e.to_string(),
    })
}

impl Transport for ShmTransport {
    type Listener = ShmListener;
    type Connection = ShmConnection;

    fn name(&self) -> &'static str {
        NAME
    }

    fn viability(&self) -> Result<()> {
        self.descriptor
            .as_ref()
            .map(|_| ())
            .map_err(|reason| TransportError::NotViable {
                transport: NAME,
                reason: reason.clone(),
            })
    }

    fn domain_descriptor(&self) -> String {
        self.descriptor.clone().unwrap_or_default()
    }

    fn can_communicate_with(&self, remote: &str) -> bool {
        matches!(&self.descriptor, Ok(d) if d == remote)
    }

    async fn listen(&self, addr: &str) -> Result<ShmListener> {
        self.viability()?;
        let name = if addr.is_empty() {
            format!("sluice-shm-{}-{:016x}", std::process::id(), rand::random::<u64>())
        } else {
            addr.to_owned()
        };
        let std_listener = std::os::unix::net::UnixListener::bind_addr(&abstract_addr(&name)?)
            .and_then(|l| l.set_nonblocking(true).map(|_| l))
            .map_err(|e| TransportError::io(&name, "listen", e))?;
        let listener =
            tokio::net::UnixListener::from_std(std_listener).map_err(|e| TransportError::io(&name, "listen", e))?;
        let (tx, rx) = mpsc::channel(64);
        let options = self.options.clone();
        let task = tokio::spawn(accept_loop(listener, options, tx));
        Ok(ShmListener {
            name,
            incoming: rx,
            task,
        })
    }

    async fn connect(&self, addr: &str) -> Result<ShmConnection> {
        self.viability()?;
        let std_stream = std::os::unix::net::UnixStream::connect_addr(&abstract_addr(addr)?)
            .and_then(|s| s.set_nonblocking(true).map(|_| s))
            .map_err(|e| TransportError::io(addr, "connect", e))?;
        let stream = UnixStream::from_std(std_stream).map_err(|e| TransportError::io(addr, "connect", e))?;
        let peer = format!("shm:{addr}");
        tokio::time::timeout(
            self.options.handshake_timeout,
            handshake(stream, &self.options, true, peer.clone()),
        )
        .await
        .map_err(|_| TransportError::Handshake {
            peer,
            reason: "timed out".into(),
        })?
    }
}

async fn accept_loop(listener: tokio::net::UnixListener, options: ShmOptions, tx: mpsc::Sender<Result<ShmConnection>>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                let _ = tx.send(Err(TransportError::io("shm listener", "accept", e))).await;
                // Back off on persistent errors (e.g. out of descriptors) instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let tx = tx.clone();
        let options = options.clone();
        // Each handshake runs on its own, so a peer that never sends cannot stall the others.
        tokio::spawn(async move {
            let peer = match sys::peer_pid(&stream) {
                Some(pid) => format!("shm:pid={pid}"),
                None => "shm:unknown".to_owned(),
            };
            let result = tokio::time::timeout(
                options.handshake_timeout,
                handshake(stream, &options, false, peer.clone()),
            )
            .await
            .unwrap_or_else(|_| {
                Err(TransportError::Handshake {
                    peer,
                    reason: "timed out".into(),
                })
            });
            let _ = tx.send(result).await;
        });
    }
}

/// Listens on an abstract Unix socket and completes shared-memory handshakes in the background.
pub struct ShmListener {
    name: String,
    incoming: mpsc::Receiver<Result<ShmConnection>>,
    task: JoinHandle<()>,
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Listener for ShmListener {
    type Connection = ShmConnection;

    fn address(&self) -> String {
        self.name.clone()
    }

    async fn accept(&mut self) -> Result<ShmConnection> {
        match self.incoming.recv().await {
            Some(r) => r,
            None => Err(TransportError::Closed {
                peer: self.name.clone(),
            }),
        }
    }
}

async fn send_fds(stream: &UnixStream, data: &[u8], fds: &[&OwnedFd]) -> std::io::Result<()> {
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || {
            sys::send_with_fds(stream.as_fd(), data, &borrowed)
        }) {
            Ok(n) if n == data.len() => return Ok(()),
            Ok(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    "short handshake write",
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

async fn recv_fds(stream: &UnixStream, buf: &mut [u8], max_fds: usize) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    loop {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || sys::recv_with_fds(stream.as_fd(), buf, max_fds)) {
            Ok(r) => return Ok(r),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

async fn handshake(stream: UnixStream, options: &ShmOptions, client: bool, peer: String) -> Result<ShmConnection> {
    let fail = |reason: String| TransportError::Handshake {
        peer: peer.clone(),
        reason,
    };
    let io = |op: &'static str| {
        let peer = peer.clone();
        move |e: std::io::Error| TransportError::io(&peer, op, e)
    };
    let (inbox, inbox_fd) = Ring::create(options.ring_capacity).map_err(io("create ring"))?;
    let data_efd = sys::eventfd().map_err(io("eventfd"))?;
    let space_efd = sys::eventfd().map_err(io("eventfd"))?;
    let mine = [&inbox_fd, &data_efd, &space_efd];

    if client {
        send_fds(&stream, HANDSHAKE_MAGIC, &mine)
            .await
            .map_err(io("send descriptors"))?;
    }
    let mut magic = [0u8; 8];
    let (n, mut theirs) = recv_fds(&stream, &mut magic, 3)
        .await
        .map_err(|e| fail(format!("receiving descriptors: {e}")))?;
    if n == 0 {
        return Err(fail("peer hung up during the handshake".into()));
    }
    if n != magic.len() || &magic != HANDSHAKE_MAGIC {
        return Err(fail(format!("unexpected handshake bytes {:?}", &magic[..n])));
    }
    if theirs.len() != 3 {
        return Err(fail(format!("expected 3 descriptors, got {}", theirs.len())));
    }
    if !client {
        send_fds(&stream, HANDSHAKE_MAGIC, &mine)
            .await
            .map_err(io("send descriptors"))?;
    }
    let peer_space_efd = theirs.pop().expect("three descriptors");
    let peer_data_efd = theirs.pop().expect("three descriptors");
    let outbox_fd = theirs.pop().expect("three descriptors");
    let outbox = Ring::open(&outbox_fd).map_err(|e| fail(format!("peer's ring: {e}")))?;
    let peer_name = match sys::peer_pid(&stream) {
        Some(pid) if client => format!("shm:pid={pid}"),
        _ => peer.clone(),
    };
    let socket = stream.into_std().map_err(io("socket"))?;
    let reg = sys::register_readable;
    let socket = reg(OwnedFd::from(socket)).map_err(io("register socket"))?;
    let shared = Arc::new(Shared {
        peer: peer_name,
        spin: options.spin,
        busy_poll: options.busy_poll,
        inbox_data: reg(data_efd).map_err(io("register eventfd"))?,
        inbox_space: space_efd,
        outbox_data: peer_data_efd,
        outbox_space: reg(peer_space_efd).map_err(io("register eventfd"))?,
        socket,
        stopped: Stopped::default(),
        peer_gone: AtomicBool::new(false),
        typical_wait_ns: [AtomicU64::new(0), AtomicU64::new(0)],
        inbox: inbox.clone(),
        outbox: outbox.clone(),
    });
    Ok(ShmConnection {
        shared,
        consumer: Consumer::new(inbox),
        producer: Producer::new(outbox),
    })
}

/// How many bytes of a large frame move between publications (writer) and releases (reader):
/// a quarter of the ring, at most 256 KiB, so both sides work on the ring at once.
fn stream_step(capacity: usize) -> usize {
    (capacity / 4).clamp(1, 256 << 10)
}

/// State shared by the two halves of a shared-memory connection.
struct Shared {
    peer: String,
    spin: Duration,
    /// Never park (see [`ShmOptions::busy_poll`]).
    busy_poll: bool,
    /// Signalled by the peer when it published into our inbox while we were parked.
    inbox_data: AsyncFd<OwnedFd>,
    /// We signal it when we freed inbox space while the peer's writer was parked.
    inbox_space: OwnedFd,
    /// We signal it when we published into the outbox while the peer's reader was parked.
    outbox_data: OwnedFd,
    /// Signalled by the peer when it freed outbox space while we were parked.
    outbox_space: AsyncFd<OwnedFd>,
    /// The setup socket; its hang-up means the peer process is gone.
    socket: AsyncFd<OwnedFd>,
    stopped: Stopped,
    peer_gone: AtomicBool,
    /// How long this process's reader and writer (by [`Side`]) have typically waited lately,
    /// in ns (a moving average of the waits that ended with the ring ready): see
    /// [`Shared::spin_limit`].
    typical_wait_ns: [AtomicU64; 2],
    inbox: Ring,
    outbox: Ring,
}

/// A side whose waits typically end within this long learns to spin through them (see
/// [`Shared::spin_limit`]).
const ADAPT_MAX: Duration = Duration::from_micros(2_500);

/// What a wait that ended within its first 64 looks counts as (see [`Shared::spin_on`]): about
/// what such waits take here; any length below the configured spin (50 µs by default) acts the
/// same (a spin configured below 0.5 µs is stretched to 1 µs by the adaptive rule).
const SHORT_WAIT: Duration = Duration::from_nanos(500);

/// The spin before parking for a side configured to spin `spin` whose waits typically last
/// `typical_ns`: twice the typical wait where that is longer than `spin` but within
/// [`ADAPT_MAX`], else `spin`.
fn adaptive_spin(spin: Duration, typical_ns: u64) -> Duration {
    let typical = Duration::from_nanos(typical_ns);
    if typical > spin && typical <= ADAPT_MAX {
        typical * 2
    } else {
        spin
    }
}

/// A moving average of wait lengths (ns): the first wait as it is, then each new one at ¼.
fn fold_wait(typical_ns: u64, waited: Duration) -> u64 {
    let waited = waited.as_nanos().min(u64::MAX as u128 / 4) as u64;
    if typical_ns == 0 {
        waited
    } else {
        (typical_ns * 3 + waited) / 4
    }
}

#[derive(Clone, Copy)]
enum Side {
    Reader,
    Writer,
}

impl Shared {
    fn fail(&self, error: TransportError) -> TransportError {
        if self.stopped.stop(error) {
            self.shut();
        }
        self.stopped.error().expect("stopped connections have an error")
    }

    /// Tells the peer we are gone and wakes every waiter, ours and theirs.
    fn shut(&self) {
        self.inbox.consumer_closed().store(1, Ordering::Release);
        self.outbox.producer_closed().store(1, Ordering::Release);
        for fd in [
            &self.outbox_data,
            &self.inbox_space,
            self.inbox_data.get_ref(),
            self.outbox_space.get_ref(),
        ] {
            sys::eventfd_signal(fd.as_fd());
        }
        sys::shutdown(self.socket.get_ref().as_fd());
    }

    fn close(&self) {
        self.fail(TransportError::Closed {
            peer: self.peer.clone(),
        });
    }

    fn abort(&self, op: &'static str) {
        self.fail(TransportError::Poisoned {
            peer: self.peer.clone(),
            op,
        });
    }

    fn corrupt(&self) -> TransportError {
        TransportError::PeerLost {
            peer: self.peer.clone(),
            detail: "shared ring is corrupt".into(),
        }
    }

    /// The peer has stopped producing into (Reader) or consuming from (Writer) our rings.
    #[inline]
    fn peer_stopped(&self, side: Side) -> bool {
        let flag = match side {
            Side::Reader => self.inbox.producer_closed(),
            Side::Writer => self.outbox.consumer_closed(),
        };
        flag.load(Ordering::Acquire) != 0 || self.peer_gone.load(Ordering::Acquire)
    }

    fn peer_lost(&self, side: Side) -> TransportError {
        let detail = if self.peer_gone.load(Ordering::Acquire) {
            "peer process hung up"
        } else {
            match side {
                Side::Reader => "peer closed the connection",
                Side::Writer => "peer stopped reading (closed the connection)",
            }
        };
        TransportError::PeerLost {
            peer: self.peer.clone(),
            detail: detail.into(),
        }
    }

    /// Waits until `ready` holds: spins for the configured budget, then parks on the eventfd.
    /// Fails when the connection stopped locally or the peer is gone (after a last look at
    /// `ready`, so bytes the peer published before leaving are still delivered).
    async fn wait(
        &self,
        side: Side,
        mut ready: impl FnMut() -> std::result::Result<bool, ring::Corrupt>,
    ) -> Result<()> {
        let mut check = |this: &Self| -> Result<bool> {
            this.stopped.check()?;
            let stopped = this.peer_stopped(side);
            if ready().map_err(|_| this.corrupt())? {
                return Ok(true);
            }
            if stopped {
                return Err(this.peer_lost(side));
            }
            Ok(false)
        };
        if check(self)? {
            return Ok(());
        }
        if self.busy_poll {
            return self.busy_wait(check).await;
        }
        // Spin only in a free slot: see `spin`.
        let slot = if self.spin.is_zero() { None } else { spin::try_spin() };
        let mut spun = Duration::ZERO;
        if slot.is_some() {
            match self.spin_on(&mut check, self.spin_limit(side))? {
                Ok(waited) => {
                    self.learn(side, waited);
                    return Ok(());
                }
                Err(spent) => spun = spent,
            }
        }
        drop(slot);
        let park_start = Instant::now();
        let _counted = Parked(spun, stats::on().then_some(park_start));
        let (parked, efd): (&AtomicU32, &AsyncFd<OwnedFd>) = match side {
            Side::Reader => (self.inbox.consumer_parked(), &self.inbox_data),
            Side::Writer => (self.outbox.producer_parked(), &self.outbox_space),
        };
        // Cleared however the wait ends, cancellation included: a flag left set would cost the
        // peer a signal, and this side a wake-up for nothing, at its next wait.
        let _parked = ParkedFlag(parked);
        loop {
            // Also after a signal (SIGNALLED): a frame published since then must signal again.
            parked.store(PARKED, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            let outcome = check(self);
            if !matches!(outcome, Ok(false)) {
                parked.store(RUNNING, Ordering::Relaxed);
                if outcome.is_ok() {
                    self.learn(side, spun + park_start.elapsed());
                }
                return outcome.map(|_| ());
            }
            tokio::select! {
                biased;
                // The eventfd is never drained (a read per wake-up was one system call in
                // ten at 64 workers): tokio's registration is edge-triggered, and every signal
                // is a new edge whatever the counter holds, so clearing tokio's readiness is
                // enough. The counter only grows, by one per sleep signalled: 2^64 signals
                // away from saturating.
                guard = efd.readable() => {
                    if let Ok(mut guard) = guard {
                        guard.clear_ready();
                    }
                }
                guard = self.socket.readable() => {
                    if let Ok(mut guard) = guard {
                        if self.peer_still_there() {
                            guard.clear_ready();
                        }
                    }
                }
            }
            parked.store(RUNNING, Ordering::Relaxed);
        }
    }

    /// Busy polling (see [`ShmOptions::busy_poll`]): spins until `check` says ready or fails,
    /// never parking. Between rounds of `spin` it yields to the runtime (other tasks of its
    /// worker run; with none, it is polled again at once) and looks, without waiting, whether
    /// the peer process hung up (a process killed mid-frame sets no flag in the ring).
    async fn busy_wait(&self, mut check: impl FnMut(&Self) -> Result<bool>) -> Result<()> {
        let round = self.spin.max(Duration::from_micros(10));
        while self.spin_on(&mut check, round)?.is_err() {
            self.peer_still_there();
            tokio::task::yield_now().await;
        }
        Ok(())
    }

    /// How long a wait of `side` spins before it parks: the configured `spin`, or, where this
    /// side's recent waits typically ended after longer but within [`ADAPT_MAX`], twice their
    /// typical length. A caller waiting on a handler that computes for a millisecond then gets
    /// its reply without being woken (on this machine kind a wake-up of a parked thread costs
    /// tens of µs, three times in a distributed training step); a side whose waits are short
    /// (a busy pipe) or long (an idle one, heartbeats) keeps the configured spin. The spin
    /// yields the core every few µs to any thread ready to run on it, and needs a spin slot as
    /// before, so spinners never outnumber cores.
    #[inline]
    fn spin_limit(&self, side: Side) -> Duration {
        adaptive_spin(self.spin, self.typical_wait_ns[side as usize].load(Ordering::Relaxed))
    }

    /// Folds a finished wait of `side` into its typical length (concurrent waits of one side
    /// may lose an update, which only slows the learning).
    #[inline]
    fn learn(&self, side: Side, waited: Duration) {
        let slot = &self.typical_wait_ns[side as usize];
        slot.store(fold_wait(slot.load(Ordering::Relaxed), waited), Ordering::Relaxed);
    }

    /// Spins on `check` for up to `limit`: `Ok(waited)` once it says ready (a wait counted as
    /// spun), else `Err(spent)`. Every 512 rounds it yields the core (`sched_yield`) to any thread
    /// waiting for it: a spinner must not delay the work it waits for.
    ///
    /// The clock is first read after 64 looks, so a wait that ends sooner (most waits of a busy
    /// pipe: a few hundred ns) never reads it, on the path from the data's arrival to its
    /// reader least of all (~22 ns a read here); such a wait counts as [`SHORT_WAIT`]. Times
    /// are counted from that first read, a few µs after the wait began. A yield that gave the
    /// core to another spinner for its turn marks the wait as shared, for `spin::wait_ended`
    /// (which moves a thread that keeps sharing its core with a spinner).
    fn spin_on(
        &self,
        check: &mut impl FnMut(&Self) -> Result<bool>,
        limit: Duration,
    ) -> Result<std::result::Result<Duration, Duration>> {
        let mut start: Option<Instant> = None;
        let mut spins = 0u32;
        // Whether a yield of this wait ran another spinner here (see `spin::wait_ended`).
        let mut shared = false;
        loop {
            if check(self)? {
                spin::wait_ended(shared);
                let waited = start.map_or(SHORT_WAIT, |s| s.elapsed());
                stats::wait(true, waited, Duration::ZERO);
                return Ok(Ok(waited));
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                let spent = match start {
                    Some(s) => s.elapsed(),
                    None => {
                        start = Some(Instant::now());
                        Duration::ZERO
                    }
                };
                if spent >= limit {
                    spin::wait_ended(shared);
                    return Ok(Err(spent));
                }
                if spins.is_multiple_of(512) {
                    std::thread::yield_now();
                    let after = start.map_or(Duration::ZERO, |s| s.elapsed());
                    shared |= spin::SPINNER_TURN.contains(&after.saturating_sub(spent));
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Looks, without waiting, whether the peer's setup socket hung up, and records it when it
    /// did (EOF, an error, or bytes that should never come after setup). True while it is there.
    fn peer_still_there(&self) -> bool {
        match sys::peek_hangup(self.socket.get_ref().as_fd()) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => true,
            _ => {
                self.peer_gone.store(true, Ordering::Release);
                false
            }
        }
    }

    /// After publishing: wake the peer's reader if it parked.
    #[inline]
    fn notify_reader(&self) {
        fence(Ordering::SeqCst);
        if first_signal(self.outbox.consumer_parked()) {
            sys::eventfd_signal(self.outbox_data.as_fd());
            stats::woke();
        }
    }

    /// After releasing space: wake the peer's writer if it parked.
    #[inline]
    fn notify_writer(&self) {
        fence(Ordering::SeqCst);
        if first_signal(self.inbox.producer_parked()) {
            sys::eventfd_signal(self.inbox_space.as_fd());
            stats::woke();
        }
    }
}

/// A side's *parked* word: the side runs (or spins).
const RUNNING: u32 = 0;
/// The side sleeps on its eventfd.
const PARKED: u32 = 1;
/// The side sleeps and has been signalled; it sets the word again before it next looks at its
/// ring, so it sees whatever was published before the signal.
const SIGNALLED: u32 = 2;

/// Whether a side whose *parked* word is `parked` needs a signal now (after the caller's
/// publication and fence): only the first one of a sleep does. A peer that writes many frames to
/// a sleeping reader (at 64 workers on two cores, 80% of frames find theirs asleep) makes one
/// system call, not one a frame.
#[inline]
fn first_signal(parked: &AtomicU32) -> bool {
    parked.load(Ordering::Relaxed) == PARKED
        && parked
            .compare_exchange(PARKED, SIGNALLED, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Counts a parked wait (see [`stats`]) when it ends, however it ends.
struct Parked(Duration, Option<Instant>);

impl Drop for Parked {
    fn drop(&mut self) {
        if let Some(start) = self.1 {
            stats::wait(false, self.0, start.elapsed());
        }
    }
}

/// Clears a ring's parked flag when a wait ends, however it ends.
struct ParkedFlag<'a>(&'a AtomicU32);

impl Drop for ParkedFlag<'_> {
    fn drop(&mut self) {
        self.0.store(RUNNING, Ordering::Relaxed);
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.close();
    }
}

/// An established shared-memory connection.
pub struct ShmConnection {
    shared: Arc<Shared>,
    consumer: Consumer,
    producer: Producer,
}

impl ShmConnection {
    /// Bytes in each direction's ring.
    pub fn ring_capacity(&self) -> usize {
        self.consumer.ring().capacity().min(self.producer.ring().capacity())
    }
}

impl Connection for ShmConnection {
    type Reader = ShmReader;
    type Writer = ShmWriter;

    fn peer(&self) -> &str {
        &self.shared.peer
    }

    fn split(self) -> (ShmReader, ShmWriter) {
        (
            ShmReader {
                shared: self.shared.clone(),
                consumer: self.consumer,
            },
            ShmWriter {
                shared: self.shared,
                producer: self.producer,
            },
        )
    }
}

/// Receiving half of a shared-memory connection.
pub struct ShmReader {
    shared: Arc<Shared>,
    consumer: Consumer,
}

/// One read in progress: the connection's shared state (borrowed, so an operation costs no
/// reference count) and the inbox's consumer.
struct ReadOp<'a> {
    shared: &'a Shared,
    consumer: &'a mut Consumer,
}

impl ReadOp<'_> {
    /// Fills `dst` from the inbox, waiting for the peer as needed. Space is handed back to the
    /// peer every [`stream_step`] bytes (so a frame larger than the ring streams: the writer
    /// refills behind the reader instead of waiting for it to drain the ring), before every
    /// wait, and at the end.
    async fn fill(&mut self, dst: &mut [u8]) -> Result<()> {
        let step = stream_step(self.consumer.ring().capacity());
        let mut done = 0;
        while done < dst.len() {
            let avail = self.consumer.available(1).map_err(|_| self.shared.corrupt())?;
            if avail == 0 {
                if self.consumer.has_unreleased() {
                    self.hand_back();
                }
                let consumer = &mut *self.consumer;
                self.shared
                    .wait(Side::Reader, || consumer.available(1).map(|n| n > 0))
                    .await?;
                continue;
            }
            let end = dst.len().min(done + step);
            done += self.consumer.pop(&mut dst[done..end]);
            if self.consumer.unreleased() >= step as u64 {
                self.hand_back();
            }
        }
        Ok(())
    }

    /// Hands the space of the bytes read back to the writer, waking it if it parked for room.
    fn hand_back(&mut self) {
        self.consumer.release();
        self.shared.notify_writer();
    }

    /// Reads the frame's padding and hands its space back.
    async fn finish_frame(&mut self, len: usize) -> Result<()> {
        let pad = (padded(len as u64) - len as u64) as usize;
        if pad > 0 {
            self.fill(&mut [0u8; 8][..pad]).await?;
        }
        self.hand_back();
        Ok(())
    }

    /// Waits until the next frame has begun to come, looking at its frame word (the consumer is
    /// at a frame boundary between reads: frames are consumed whole).
    async fn frame_start(&mut self) -> Result<()> {
        if self.consumer.frame_available(1).map_err(|_| self.shared.corrupt())? > 0 {
            return Ok(());
        }
        if self.consumer.has_unreleased() {
            self.hand_back();
        }
        let consumer = &mut *self.consumer;
        self.shared
            .wait(Side::Reader, || consumer.frame_available(1).map(|n| n > 0))
            .await
    }

    /// The next frame's length, refused (before anything is allocated for it) above `limit`.
    /// The caller has waited for the frame to begin ([`frame_start`](Self::frame_start)).
    async fn header(&mut self, limit: usize) -> Result<usize> {
        let mut header = [0u8; HEADER_LEN];
        self.fill(&mut header).await?;
        let len = word::frame_len(u64::from_le_bytes(header)).ok_or_else(|| self.shared.corrupt())?;
        if len > limit as u64 {
            return Err(TransportError::FrameTooLarge {
                peer: self.shared.peer.clone(),
                len,
                limit,
            });
        }
        Ok(len as usize)
    }

    /// Reads the next frame at once if it is here whole and would not stream (`take` copies its
    /// `len` bytes out of the consumer); `None` leaves it to the general path. A frame left
    /// half-read by an earlier read (one abandoned closes the connection) is impossible here:
    /// frames are consumed whole, so the head is at a frame's start.
    fn whole_frame_now(&mut self, limit: usize, take: impl FnOnce(&mut Consumer, usize)) -> Option<Result<usize>> {
        let (shared, consumer) = (self.shared, &mut *self.consumer);
        match consumer.frame_available(HEADER_LEN) {
            Ok(n) if n >= HEADER_LEN => {}
            Ok(_) => return None,
            Err(_) => return Some(Err(shared.corrupt())),
        }
        let mut header = [0u8; HEADER_LEN];
        consumer.peek(&mut header);
        let Some(len) = word::frame_len(u64::from_le_bytes(header)) else {
            return Some(Err(shared.corrupt()));
        };
        if len > limit as u64 {
            return Some(Err(TransportError::FrameTooLarge {
                peer: shared.peer.clone(),
                len,
                limit,
            }));
        }
        // A frame that streams, or has not arrived whole, is read by the general path.
        let step = stream_step(consumer.ring().capacity());
        let total = HEADER_LEN as u64 + padded(len);
        if total > step as u64 {
            return None;
        }
        let total = total as usize;
        match consumer.available(total) {
            Ok(n) if n >= total => {}
            Ok(_) => return None,
            Err(_) => return Some(Err(shared.corrupt())),
        }
        // The whole frame, padding included, was checked to be here.
        consumer.discard(HEADER_LEN);
        take(consumer, len as usize);
        consumer.discard(total - HEADER_LEN - len as usize);
        self.hand_back();
        Some(Ok(len as usize))
    }

    async fn frame_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        self.frame_start().await?;
        if let Some(read) = self.whole_frame_now(dst.len(), |c, len| {
            c.pop(&mut dst[..len]);
        }) {
            return read;
        }
        let len = self.header(dst.len()).await?;
        self.fill(&mut dst[..len]).await?;
        self.finish_frame(len).await?;
        Ok(len)
    }

    async fn frame_vec(&mut self, out: &mut Vec<u8>, limit: usize) -> Result<usize> {
        self.frame_start().await?;
        if let Some(read) = self.whole_frame_now(limit, |c, len| c.pop_to_vec(out, len)) {
            return read;
        }
        let len = self.header(limit).await?;
        out.clear();
        out.resize(len, 0);
        self.fill(out).await?;
        self.finish_frame(len).await?;
        Ok(len)
    }
}

impl ShmReader {
    /// Runs one read as a whole: cancelled part-way, it poisons the connection.
    async fn guarded<T>(&mut self, op: impl AsyncFnOnce(&mut ReadOp<'_>) -> Result<T>) -> Result<T> {
        self.shared.stopped.check()?;
        let ShmReader { shared, consumer } = self;
        let shared: &Shared = shared;
        let guard = OpGuard::new(|| shared.abort("read"));
        let result = op(&mut ReadOp { shared, consumer }).await;
        guard.finish();
        result.map_err(|e| shared.fail(e))
    }
}

impl FrameReader for ShmReader {
    async fn read(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.guarded(async |op| op.frame_into(buf).await).await
    }

    async fn read_vec(&mut self, limit: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.read_into_vec(&mut out, limit).await?;
        Ok(out)
    }

    async fn read_into_vec(&mut self, buf: &mut Vec<u8>, limit: usize) -> Result<usize> {
        self.guarded(async |op| op.frame_vec(buf, limit).await).await
    }

    fn has_input(&mut self) -> bool {
        // A corrupt ring says yes: the next read reports it.
        self.consumer.frame_available(1).map_or(true, |n| n > 0)
    }

    fn try_read_into_vec_now(&mut self, out: &mut Vec<u8>, limit: usize) -> Option<Result<usize>> {
        if let Err(e) = self.shared.stopped.check() {
            return Some(Err(e));
        }
        let ShmReader { shared, consumer } = self;
        let mut op = ReadOp { shared, consumer };
        let read = op.whole_frame_now(limit, |c, len| c.pop_to_vec(out, len))?;
        Some(read.map_err(|e| shared.fail(e)))
    }

    async fn readable(&mut self) -> Result<()> {
        self.shared.stopped.check()?;
        // Nothing is consumed while waiting, so dropping this future changes nothing.
        let consumer = &mut self.consumer;
        let result = self
            .shared
            .wait(Side::Reader, || consumer.frame_available(1).map(|n| n > 0))
            .await;
        result.map_err(|e| self.shared.fail(e))
    }

    fn close(&self) {
        self.shared.close()
    }

    fn closer(&self) -> Closer {
        let shared = self.shared.clone();
        Closer::new(move || shared.close())
    }

    fn peer(&self) -> &str {
        &self.shared.peer
    }
}

/// Sending half of a shared-memory connection.
pub struct ShmWriter {
    shared: Arc<Shared>,
    producer: Producer,
}

/// Copies one frame into the ring; `publish` makes it (and every frame copied before it)
/// visible to the reader and wakes a parked reader. A frame that fits whole is written with its
/// frame word last (a reader waiting for it sees it at once, published or not); a larger one
/// streams, its word first. Unpublished frames wait for the next publication; a full ring
/// publishes what it holds before waiting for room.
async fn write_frame(shared: &Shared, producer: &mut Producer, parts: &[&[u8]], publish: bool) -> Result<()> {
    if shared.peer_stopped(Side::Writer) {
        return Err(shared.peer_lost(Side::Writer));
    }
    let len = total_len(parts);
    if len > word::LEN_MASK {
        return Err(TransportError::FrameTooLarge {
            peer: shared.peer.clone(),
            len,
            limit: word::LEN_MASK as usize,
        });
    }
    let step = stream_step(producer.ring().capacity());
    let whole = HEADER_LEN as u64 + padded(len);
    if whole <= step as u64 && producer.free(whole as usize).map_err(|_| shared.corrupt())? >= whole as usize {
        // A frame held back (deferred) stays unseen until its publication, as it always was.
        producer.push_frame(len, parts, publish);
    } else {
        stream_frame(shared, producer, len, parts, step).await?;
    }
    if publish {
        producer.publish();
        shared.notify_reader();
    }
    Ok(())
}

/// Copies a frame that does not fit now (or would stream) into the ring, its word first,
/// publishing every `step` bytes and whenever the ring is full.
async fn stream_frame(shared: &Shared, producer: &mut Producer, len: u64, parts: &[&[u8]], step: usize) -> Result<()> {
    // The word, stored whole (the reader may be watching it), once there is room for it.
    while producer.free(HEADER_LEN).map_err(|_| shared.corrupt())? < HEADER_LEN {
        producer.publish();
        shared.notify_reader();
        let producer = &mut *producer;
        shared
            .wait(Side::Writer, || producer.free(HEADER_LEN).map(|n| n >= HEADER_LEN))
            .await?;
    }
    producer.push_word(len | word::FRAME);
    // The frame's end (padding, the next boundary's word zeroed) must be ready before any
    // publication covers its last byte: counted in bytes, as trailing parts may be empty.
    let mut left = len;
    if left == 0 {
        producer.end_frame();
    }
    for part in parts {
        let mut off = 0;
        while off < part.len() {
            producer.free(part.len() - off).map_err(|_| shared.corrupt())?;
            let n = producer.push(&part[off..part.len().min(off + step)]);
            off += n;
            left -= n as u64;
            if left == 0 {
                producer.end_frame();
            }
            if producer.unpublished() >= step as u64 {
                // A large frame streams: the reader starts on it while the rest is copied in.
                producer.publish();
                shared.notify_reader();
            }
            if off < part.len() && producer.free(1).map_err(|_| shared.corrupt())? == 0 {
                // The ring is full: let the reader see what is there, then wait for room.
                producer.publish();
                shared.notify_reader();
                let producer = &mut *producer;
                shared.wait(Side::Writer, || producer.free(1).map(|n| n > 0)).await?;
            }
        }
    }
    debug_assert_eq!(left, 0, "the parts add up to the frame's length");
    Ok(())
}

impl ShmWriter {
    /// Runs one frame's write as a whole: cancelled part-way, it poisons the connection.
    async fn guarded(&mut self, parts: &[&[u8]], publish: bool) -> Result<()> {
        self.shared.stopped.check()?;
        let ShmWriter { shared, producer } = self;
        let shared: &Shared = shared;
        let guard = OpGuard::new(|| shared.abort("write"));
        let result = write_frame(shared, producer, parts, publish).await;
        guard.finish();
        result.map_err(|e| shared.fail(e))
    }

    fn publish(&mut self) {
        self.producer.publish();
        self.shared.notify_reader();
    }
}

impl FrameWriter for ShmWriter {
    async fn write(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.guarded(parts, true).await
    }

    async fn write_deferred(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.guarded(parts, false).await
    }

    async fn flush(&mut self) -> Result<()> {
        self.shared.stopped.check()?;
        self.publish();
        Ok(())
    }

    fn immediate(&self) -> bool {
        true
    }

    fn try_write_now(&mut self, parts: &[&[u8]], publish: bool) -> Option<Result<()>> {
        if let Err(e) = self.shared.stopped.check() {
            return Some(Err(e));
        }
        let len = total_len(parts);
        let step = stream_step(self.producer.ring().capacity());
        // A frame that would stream, or wait for room, takes the asynchronous path.
        let total = HEADER_LEN as u64 + padded(len);
        if total > step as u64 {
            return None;
        }
        let total = total as usize;
        match self.producer.free(total) {
            Ok(free) if free >= total => {}
            Ok(_) => return None,
            Err(_) => return Some(Err(self.shared.fail(self.shared.corrupt()))),
        }
        if self.shared.peer_stopped(Side::Writer) {
            return Some(Err(self.shared.fail(self.shared.peer_lost(Side::Writer))));
        }
        self.producer.push_frame(len, parts, publish);
        if publish || self.producer.unpublished() >= step as u64 {
            self.publish();
        }
        Some(Ok(()))
    }

    fn close(&self) {
        self.shared.close()
    }

    fn closer(&self) -> Closer {
        let shared = self.shared.clone();
        Closer::new(move || shared.close())
    }

    fn peer(&self) -> &str {
        &self.shared.peer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN: Duration = Duration::from_micros(50);
    const US: u64 = 1_000;

    /// Waits of a millisecond or two (a caller waiting on a handler that computes) teach a side to
    /// spin through them; short waits (a busy ping-pong) and long ones (an idle pipe,
    /// heartbeats) leave the configured spin; an unknown side spins as configured.
    #[test]
    fn a_side_spins_through_waits_it_has_learned_are_short_enough() {
        assert_eq!(adaptive_spin(SPIN, 0), SPIN);
        assert_eq!(adaptive_spin(SPIN, 3 * US), SPIN);
        assert_eq!(adaptive_spin(SPIN, 800 * US), Duration::from_micros(1_600));
        assert_eq!(adaptive_spin(SPIN, 2_500 * US), Duration::from_micros(5_000));
        assert_eq!(adaptive_spin(SPIN, 2_501 * US), SPIN);
        assert_eq!(adaptive_spin(SPIN, 5_000_000 * US), SPIN);
        // A side configured not to spin learns nothing to spin for: `wait` takes no spin slot
        // when `spin` is zero.
        assert_eq!(adaptive_spin(Duration::ZERO, 0), Duration::ZERO);
    }

    /// Frames and room flow both ways between a busy-polling side and a side that parks at
    /// every wait (no spin), through rings small enough that both writers wait for room: the
    /// busy side still wakes the parked one (a wake-up lost leaves that side asleep: the
    /// watchdog).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_side_and_a_parking_side_lose_no_wake_up() {
        let options = |busy_poll| ShmOptions {
            ring_capacity: ring::MIN_CAPACITY,
            spin: Duration::ZERO,
            busy_poll,
            ..ShmOptions::default()
        };
        let (busy, parking) = (ShmTransport::new(options(true)), ShmTransport::new(options(false)));
        let mut listener = parking.listen("").await.unwrap();
        let addr = listener.address();
        let (b, p) = tokio::join!(busy.connect(&addr), listener.accept());
        let (b, p) = (b.unwrap(), p.unwrap());

        const FRAMES: usize = 2_000;
        let frame = |i: usize| vec![(i % 251) as u8; 1_000 + i % 700];
        async fn send(mut w: impl FrameWriter, frame: impl Fn(usize) -> Vec<u8>) {
            for i in 0..FRAMES {
                w.write(&[&frame(i)]).await.unwrap();
            }
        }
        async fn receive(mut r: impl FrameReader, frame: impl Fn(usize) -> Vec<u8>) {
            let mut buf = vec![0u8; 4096];
            for i in 0..FRAMES {
                let n = r.read(&mut buf).await.unwrap();
                assert!(buf[..n] == frame(i)[..], "frame {i}");
            }
        }
        let ((br, bw), (pr, pw)) = (b.split(), p.split());
        let all = async {
            tokio::join!(
                tokio::spawn(send(bw, frame)),
                tokio::spawn(receive(pr, frame)),
                tokio::spawn(send(pw, frame)),
                tokio::spawn(receive(br, frame)),
            )
        };
        let tasks = tokio::time::timeout(Duration::from_secs(30), all)
            .await
            .expect("a side left asleep: a wake-up was lost");
        for task in <[_; 4]>::from(tasks) {
            task.unwrap();
        }
    }

    /// Reads and resets the count of signals on `reader`'s eventfd (0 when none came).
    fn take_signals(reader: &ShmReader) -> u64 {
        use std::os::fd::AsRawFd;
        let mut count = [0u8; 8];
        match nix::unistd::read(reader.shared.inbox_data.get_ref().as_raw_fd(), &mut count) {
            Ok(8) => u64::from_ne_bytes(count),
            Err(nix::errno::Errno::EAGAIN) => 0,
            other => panic!("eventfd read: {other:?}"),
        }
    }

    /// Two connected ends of one transport made with `options`.
    async fn connected(options: ShmOptions) -> (ShmConnection, ShmConnection) {
        let transport = ShmTransport::new(options);
        let mut listener = transport.listen("").await.unwrap();
        let addr = listener.address();
        let (a, b) = tokio::join!(transport.connect(&addr), listener.accept());
        (a.unwrap(), b.unwrap())
    }

    /// Two sides that park at every wait (no spin) play ping-pong: every frame wakes a sleeper,
    /// through an eventfd that nobody ever drains (its counter only grows), and each wake-up
    /// must still come as a new edge: one lost leaves both sides asleep (the watchdog). Many
    /// rounds, so the sleeper's readiness is cleared and set again each time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sleepers_woken_through_undrained_eventfds_lose_no_wake_up() {
        let (a, b) = connected(ShmOptions {
            spin: Duration::ZERO,
            ..ShmOptions::default()
        })
        .await;
        let ((mut ar, mut aw), (mut br, mut bw)) = (a.split(), b.split());
        const ROUNDS: u32 = 3_000;
        let echo = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            for _ in 0..ROUNDS {
                let n = br.read(&mut buf).await.unwrap();
                bw.write(&[&buf[..n]]).await.unwrap();
            }
            br
        });
        let ping = async {
            let mut buf = [0u8; 16];
            for i in 0..ROUNDS {
                aw.write(&[&i.to_le_bytes()]).await.unwrap();
                let n = ar.read(&mut buf).await.unwrap();
                assert_eq!(buf[..n], i.to_le_bytes(), "round {i}");
            }
        };
        tokio::time::timeout(Duration::from_secs(60), ping)
            .await
            .expect("a sleeper was never woken: a wake-up was lost");
        let br = echo.await.unwrap();
        // Both sides slept and were signalled (the counters grew), and nothing read them: a
        // side that parks at every wait is signalled for nearly every frame.
        assert!(take_signals(&br) > 1, "the echo side's eventfd was drained");
    }

    /// Frames of every length from 0 to 3,000 bytes through a 4 KiB ring (so the larger ones
    /// stream, and some wait for room), each sent as its bytes followed by empty parts, written
    /// at once or held back for a batch, and full of words that look like complete frames: each
    /// arrives whole and in order. (A frame's end must be ready before its last byte is
    /// published, however its parts fall; a batch's frames stay unseen until it ends.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_of_every_shape_arrive_whole() {
        let (a, b) = connected(ShmOptions {
            ring_capacity: ring::MIN_CAPACITY,
            ..ShmOptions::default()
        })
        .await;
        let (_, mut w) = a.split();
        let (mut r, _) = b.split();
        const FRAMES: usize = 3_000;
        let frame = |i: usize| {
            let len = (i * 389) % 3001;
            let len = if i.is_multiple_of(8) { len & !7 } else { len };
            let fake = (24 | word::FRAME | word::COMPLETE).to_le_bytes();
            let mut f: Vec<u8> = (0..len).map(|k| fake[k % 8]).collect();
            let n = f.len().min(4);
            f[..n].copy_from_slice(&(i as u32).to_le_bytes()[..n]);
            f
        };
        // A frame held back is not seen until the batch ends.
        w.write_deferred(&[b"held back"]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!r.has_input(), "a held-back frame was seen before its batch ended");
        w.flush().await.unwrap();
        let mut first = [0u8; 16];
        let n = r.read(&mut first).await.unwrap();
        assert_eq!(&first[..n], b"held back");
        let send = tokio::spawn(async move {
            for i in 0..FRAMES {
                let f = frame(i);
                let parts: [&[u8]; 3] = [&f, &[], &[]];
                if i % 3 == 0 {
                    w.write_deferred(&parts).await.unwrap();
                } else {
                    w.write(&parts).await.unwrap();
                }
                if i % 7 == 0 {
                    w.flush().await.unwrap();
                }
            }
            w.flush().await.unwrap();
            w
        });
        let receive = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            for i in 0..FRAMES {
                let n = r.read(&mut buf).await.unwrap();
                assert!(buf[..n] == frame(i)[..], "frame {i}: {n} bytes");
            }
            r
        });
        let (sent, received) = tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(send, receive) })
            .await
            .expect("a frame never arrived");
        sent.unwrap();
        received.unwrap();
    }

    /// A sleeping reader is signalled once however many frames come before it wakes, and again
    /// for the first frame after it goes back to sleep; a running one is not signalled at all.
    /// (The reader here is simulated: its *parked* word is set by hand, and the eventfd's
    /// counter read and reset by the test: a real reader never reads it.)
    #[tokio::test]
    async fn a_sleeping_reader_is_signalled_once_a_sleep() {
        let (a, b) = connected(ShmOptions::default()).await;
        let ((_, mut writer), (reader, _)) = (a.split(), b.split());
        let parked = reader.shared.inbox.consumer_parked();
        let signals = || take_signals(&reader);
        let mut write = || writer.try_write_now(&[b"frame"], true).unwrap().unwrap();
        parked.store(PARKED, Ordering::Relaxed);
        for _ in 0..10 {
            write();
        }
        assert_eq!(signals(), 1, "ten frames to a sleeping reader");
        assert_eq!(parked.load(Ordering::Relaxed), SIGNALLED);
        write();
        assert_eq!(signals(), 0, "signalled already, not yet awake");
        // Awake, it looks at its ring, then sleeps again: the next frame signals again.
        parked.store(PARKED, Ordering::Relaxed);
        write();
        assert_eq!(signals(), 1, "the first frame of the next sleep");
        parked.store(RUNNING, Ordering::Relaxed);
        write();
        assert_eq!(signals(), 0, "a running reader");
    }

    /// The average follows a change of pattern within a few waits; one idle gap after a run of
    /// millisecond waits sends the side back to the configured spin until it learns again.
    #[test]
    fn the_typical_wait_follows_the_recent_ones() {
        let mut t = 0;
        t = fold_wait(t, Duration::from_micros(800));
        assert_eq!(t, 800 * US, "the first wait is taken as it is");
        for _ in 0..10 {
            t = fold_wait(t, Duration::from_micros(2));
        }
        assert!(
            adaptive_spin(SPIN, t) == SPIN,
            "ten short waits later, no long spin ({t} ns)"
        );
        for _ in 0..10 {
            t = fold_wait(t, Duration::from_micros(700));
        }
        assert!(
            adaptive_spin(SPIN, t) > Duration::from_millis(1),
            "long waits again: {t} ns"
        );
        // One idle second pushes the average past ADAPT_MAX: back to the configured spin...
        t = fold_wait(t, Duration::from_secs(1));
        assert_eq!(adaptive_spin(SPIN, t), SPIN);
        // ...and no wait, however long, overflows the average.
        t = fold_wait(t, Duration::MAX);
        assert!(t > 0 && adaptive_spin(SPIN, t) == SPIN);
    }
}
