//! An in-process model of RDMA devices, memory regions, completion queues and reliable-connected
//! queue pairs, strict about the verbs rules, so the ibverbs transport and the RDMA channel run
//! (and are tested) on machines without RDMA hardware.
//!
//! A [`ModelFabric`] holds devices; queue pairs of any of its devices connect to each other. One
//! worker thread per fabric plays every NIC: it executes each queue pair's send queue in order
//! (so completions arrive in order per queue pair), copies bytes between registered regions,
//! and produces completions. What it enforces, as hardware would (or where hardware would
//! silently corrupt memory, as a recorded *violation*):
//! - posting to a queue pair that is not ready to send fails; posting beyond the queue's depth
//!   fails (`QueueFull`), counting a request outstanding until its completion is *polled*;
//! - a local buffer outside a registration, or with a wrong `lkey` or missing local-write right,
//!   completes with `LocalProtection`; a remote address outside the peer's registration, a
//!   wrong `rkey` or a missing remote right completes with `RemoteAccess`; both move the queue
//!   pair (and for remote errors the peer's) to the error state;
//! - a write or send with immediate that finds no receive posted waits (receiver-not-ready,
//!   retried for ever as with `rnr_retry = 7`), counted in [`ModelStats::rnr_waits`];
//! - a peer that is gone (destroyed queue pair, killed device, queue pair in error) does not
//!   answer: the request is retried until the retry timeout (the transport's `timeout` 14 and
//!   `retry_cnt` 7: 8 × 67 ms, [`RETRY_TIMEOUT`]; [`ModelFabric::set_retry_timeout`]) and only
//!   then completes with `RetryExceeded`, as a NIC does, never at once;
//! - the error state flushes every outstanding request, in order;
//! - a completion queue that overflows is a violation and moves its queue pairs to error;
//! - deregistering memory that a queued request still uses, or destroying a queue pair whose
//!   requests have not all completed and been polled, is a violation;
//! - registering asks for exactly the rights it needs: remote write without local write fails,
//!   and write rights on memory the process cannot write (read-only pages) fail, as
//!   `ibv_reg_mr` does.
//!
//! [`ModelDevice::kill`] stands in for a crashed process: its queue pairs stop answering and
//! its completion queues report the device gone.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::verbs::*;

/// How long a NIC retries a request its peer does not answer before `RetryExceeded`, with the
/// attributes the real backend sets (`timeout` 14: 4.096 µs × 2^14 = 67 ms per attempt;
/// `retry_cnt` 7: eight attempts).
pub const RETRY_TIMEOUT: Duration = Duration::from_nanos((4096u64 << 14) * 8);

/// Counters a test or benchmark can read.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelStats {
    /// Work requests executed (not counting flushes).
    pub executed: u64,
    /// Bytes moved by writes and reads.
    pub bytes: u64,
    /// Times a write or send with immediate found no receive posted and had to wait.
    pub rnr_waits: u64,
}

/// A set of model devices whose queue pairs can reach each other.
#[derive(Clone)]
pub struct ModelFabric {
    inner: Arc<Fabric>,
}

struct Fabric {
    state: Mutex<State>,
    /// Wakes the worker when there is work.
    work: Condvar,
    id: u64,
}

#[derive(Default)]
struct State {
    next: u32,
    devices: HashMap<u32, Dev>,
    mrs: HashMap<u32, Mr>,
    cqs: HashMap<u32, Cq>,
    qps: HashMap<u32, Qp>,
    violations: Vec<String>,
    stats: ModelStats,
    /// Queue pairs that may have executable work.
    ready: VecDeque<u32>,
    /// Queue pairs retrying a request their peer does not answer (revisited every few ms).
    retrying: Vec<u32>,
    retry_timeout: Duration,
    shutdown: bool,
}

struct Dev {
    alive: bool,
    limits: Limits,
}

struct Mr {
    dev: u32,
    addr: u64,
    len: usize,
    access: Access,
}

struct Cq {
    dev: u32,
    capacity: usize,
    entries: VecDeque<Completion>,
    signal: Arc<Signal>,
    /// Armed for one event (`arm`), which the next completion raises.
    armed: bool,
    /// Completions pushed since the last `arm`: any others still queued at a `wait` were
    /// there before the arming, and raise no event.
    pushed_since_arm: usize,
}

#[derive(Default)]
struct Signal {
    flag: Mutex<bool>,
    cond: Condvar,
}

impl Signal {
    fn raise(&self) {
        *self.flag.lock().expect("signal") = true;
        self.cond.notify_all();
    }

    fn wait(&self, timeout: Duration) {
        let flag = self.flag.lock().expect("signal");
        let (mut flag, _) = self
            .cond
            .wait_timeout_while(flag, timeout, |raised| !*raised)
            .expect("signal");
        *flag = false;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpState {
    Reset,
    Rts,
    Error,
}

struct Qp {
    dev: u32,
    cq: u32,
    state: QpState,
    remote: Option<u32>,
    caps: QpCaps,
    /// Posted and not yet executed.
    sq: VecDeque<SendWr>,
    rq: VecDeque<u64>,
    /// Posted and not yet polled.
    sq_outstanding: u32,
    rq_outstanding: u32,
    rnr_waiting: bool,
    /// When the head request first found its peer silent (retries run from there).
    silent_since: Option<Instant>,
}

/// Whether every page of `addr..addr+len` is mapped readable (and writable, with `write`) in
/// this process (from `/proc/self/maps`; assumed so where that cannot be read). `ibv_reg_mr`
/// pins the pages, which fails for memory the process cannot access: an inaccessible range, or
/// a GPU's device address without a peer-memory module.
fn accessible(addr: u64, len: usize, write: bool) -> bool {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return true;
    };
    let end = addr.saturating_add(len as u64);
    let mut covered = addr;
    let mut ranges: Vec<(u64, u64, bool, bool)> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (lo, hi) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.as_bytes();
            Some((
                u64::from_str_radix(lo, 16).ok()?,
                u64::from_str_radix(hi, 16).ok()?,
                perms.first() == Some(&b'r'),
                perms.get(1) == Some(&b'w'),
            ))
        })
        .collect();
    ranges.sort_unstable();
    for (lo, hi, r, w) in ranges {
        if hi <= covered || lo > covered {
            continue;
        }
        if !r || (write && !w) {
            return false;
        }
        covered = hi;
        if covered >= end {
            return true;
        }
    }
    covered >= end
}

fn violation(state: &mut State, what: String) {
    tracing::error!("verbs model: rule violated: {what}");
    state.violations.push(what);
}

impl ModelFabric {
    pub fn new() -> ModelFabric {
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let inner = Arc::new(Fabric {
            state: Mutex::new(State {
                next: 0x100,
                retry_timeout: RETRY_TIMEOUT,
                ..State::default()
            }),
            work: Condvar::new(),
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("sluice-verbs-model".into())
            .spawn(move || worker(weak))
            .expect("spawn the verbs model thread");
        ModelFabric { inner }
    }

    /// How long requests to a silent peer are retried before `RetryExceeded` (default
    /// [`RETRY_TIMEOUT`]).
    pub fn set_retry_timeout(&self, timeout: Duration) {
        self.lock().retry_timeout = timeout;
    }

    /// The process-wide fabric the transport uses when configured for the model.
    pub fn global() -> &'static ModelFabric {
        static GLOBAL: OnceLock<ModelFabric> = OnceLock::new();
        GLOBAL.get_or_init(ModelFabric::new)
    }

    /// Adds a device reporting `limits`.
    pub fn device(&self, name: &str, limits: Limits) -> Arc<ModelDevice> {
        let mut st = self.lock();
        let id = alloc_id(&mut st);
        st.devices.insert(id, Dev { alive: true, limits });
        Arc::new(ModelDevice {
            fabric: self.clone(),
            id,
            name: name.to_owned(),
            limits,
        })
    }

    /// Every rule violation recorded so far (empty when all callers behaved).
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    pub fn stats(&self) -> ModelStats {
        self.lock().stats
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("verbs model state")
    }
}

impl Default for ModelFabric {
    fn default() -> Self {
        ModelFabric::new()
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        if let Ok(mut st) = self.state.lock() {
            st.shutdown = true;
        }
        self.work.notify_all();
    }
}

fn alloc_id(st: &mut State) -> u32 {
    st.next += 1;
    st.next
}

/// Limits like a ConnectX adapter's.
pub const DEFAULT_LIMITS: Limits = Limits {
    max_qp_wr: 16_384,
    max_cqe: 4_194_303,
    max_mr_size: u64::MAX,
    max_rd_atomic: 16,
    max_rd_responder: 16,
    active_mtu: MTU_4096,
    memlock: u64::MAX,
};

/// One model device (with its protection domain).
pub struct ModelDevice {
    fabric: ModelFabric,
    id: u32,
    name: String,
    limits: Limits,
}

impl ModelDevice {
    /// The device's process "crashes": its queue pairs stop answering, nothing it had queued
    /// executes, and its completion queues report the device gone.
    pub fn kill(&self) {
        let mut st = self.fabric.lock();
        if let Some(d) = st.devices.get_mut(&self.id) {
            d.alive = false;
        }
        let mine: Vec<u32> = st
            .qps
            .iter()
            .filter(|(_, q)| q.dev == self.id)
            .map(|(&n, _)| n)
            .collect();
        for n in &mine {
            st.qps.remove(n);
        }
        // Their peers' requests now find nobody: revisit them (one waiting for a receive
        // the dead side will never post included), so they run into the retry timeout.
        let orphans: Vec<u32> = st
            .qps
            .iter()
            .filter(|(_, q)| q.remote.is_some_and(|r| mine.contains(&r)))
            .map(|(&n, _)| n)
            .collect();
        for n in orphans {
            if let Some(q) = st.qps.get_mut(&n) {
                q.rnr_waiting = false;
            }
            st.ready.push_back(n);
        }
        for cq in st.cqs.values().filter(|c| c.dev == self.id) {
            cq.signal.raise();
        }
        st.mrs.retain(|_, m| m.dev != self.id);
        drop(st);
        self.fabric.inner.work.notify_all();
    }

    pub fn fabric(&self) -> &ModelFabric {
        &self.fabric
    }

    fn alive(&self, st: &State) -> VerbsResult<()> {
        match st.devices.get(&self.id) {
            Some(d) if d.alive => Ok(()),
            _ => Err(VerbsError::DeviceGone(self.name.clone())),
        }
    }
}

impl VerbsDevice for ModelDevice {
    fn name(&self) -> String {
        format!("{}:1", self.name)
    }

    fn limits(&self) -> Limits {
        self.limits
    }

    fn address(&self) -> (u16, [u8; 16]) {
        let mut gid = [0u8; 16];
        gid[..8].copy_from_slice(&self.fabric.inner.id.to_be_bytes());
        gid[12..].copy_from_slice(&self.id.to_be_bytes());
        (self.id as u16, gid)
    }

    fn fabric(&self) -> String {
        format!("model;fabric={};pid={}", self.fabric.inner.id, std::process::id())
    }

    fn create_cq(&self, entries: u32) -> VerbsResult<Box<dyn VerbsCq>> {
        if entries == 0 || entries > self.limits.max_cqe {
            return Err(VerbsError::failed(
                "create_cq",
                format!("{entries} entries (device allows 1..={})", self.limits.max_cqe),
            ));
        }
        let mut st = self.fabric.lock();
        self.alive(&st)?;
        let id = alloc_id(&mut st);
        let signal = Arc::new(Signal::default());
        st.cqs.insert(
            id,
            Cq {
                dev: self.id,
                capacity: entries as usize,
                entries: VecDeque::new(),
                signal: signal.clone(),
                armed: false,
                pushed_since_arm: 0,
            },
        );
        Ok(Box::new(ModelCq {
            fabric: self.fabric.clone(),
            id,
            signal,
            device: self.name.clone(),
        }))
    }

    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Box<dyn VerbsMr>> {
        if len as u64 > self.limits.max_mr_size {
            return Err(VerbsError::failed("reg_mr", "larger than the device's max_mr_size"));
        }
        // As `ibv_reg_mr`: remote write needs local write (EINVAL), and write rights on memory
        // the process may not write fail when the pages are pinned for writing (EFAULT).
        if access.remote_write && !access.local_write {
            return Err(VerbsError::failed(
                "reg_mr",
                "REMOTE_WRITE without LOCAL_WRITE (EINVAL)",
            ));
        }
        if !accessible(addr as u64, len.max(1), false) {
            return Err(VerbsError::failed(
                "reg_mr",
                format!("{len} bytes at {addr:p} are not memory this process can access (EFAULT; a GPU address needs a peer-memory module)"),
            ));
        }
        if access.local_write && !accessible(addr as u64, len.max(1), true) {
            return Err(VerbsError::failed(
                "reg_mr",
                format!("write access asked for {len} bytes of read-only memory at {addr:p} (EFAULT)"),
            ));
        }
        let mut st = self.fabric.lock();
        self.alive(&st)?;
        // Pinned memory counts against the process's locked-memory limit, as the kernel does.
        let pinned: u64 = st.mrs.values().filter(|m| m.dev == self.id).map(|m| m.len as u64).sum();
        if pinned.saturating_add(len as u64) > self.limits.memlock {
            return Err(VerbsError::failed(
                "reg_mr",
                format!("ENOMEM: {}", memlock_hint(self.limits.memlock, len as u64)),
            ));
        }
        let key = alloc_id(&mut st);
        st.mrs.insert(
            key,
            Mr {
                dev: self.id,
                addr: addr as u64,
                len,
                access,
            },
        );
        Ok(Box::new(ModelMr {
            fabric: self.fabric.clone(),
            info: MrInfo {
                addr: addr as u64,
                len,
                lkey: key,
                rkey: key | RKEY_TAG,
            },
        }))
    }

    fn create_qp(&self, cq: &dyn VerbsCq, caps: QpCaps) -> VerbsResult<Box<dyn VerbsQp>> {
        if caps.send_depth == 0
            || caps.recv_depth == 0
            || caps.send_depth > self.limits.max_qp_wr
            || caps.recv_depth > self.limits.max_qp_wr
        {
            return Err(VerbsError::failed(
                "create_qp",
                format!("depths {caps:?} outside 1..={}", self.limits.max_qp_wr),
            ));
        }
        let mut st = self.fabric.lock();
        self.alive(&st)?;
        let cq_id = cq
            .as_any()
            .downcast_ref::<ModelCq>()
            .filter(|c| Arc::ptr_eq(&c.fabric.inner, &self.fabric.inner) && st.cqs.contains_key(&c.id))
            .map(|c| c.id)
            .ok_or_else(|| VerbsError::failed("create_qp", "completion queue of another fabric"))?;
        let qpn = alloc_id(&mut st);
        st.qps.insert(
            qpn,
            Qp {
                dev: self.id,
                cq: cq_id,
                state: QpState::Reset,
                remote: None,
                caps,
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                sq_outstanding: 0,
                rq_outstanding: 0,
                rnr_waiting: false,
                silent_since: None,
            },
        );
        Ok(Box::new(ModelQp {
            fabric: self.fabric.clone(),
            qpn,
            device: self.name.clone(),
        }))
    }
}

struct ModelMr {
    fabric: ModelFabric,
    info: MrInfo,
}

impl VerbsMr for ModelMr {
    fn info(&self) -> MrInfo {
        self.info
    }
}

impl Drop for ModelMr {
    fn drop(&mut self) {
        let mut st = self.fabric.lock();
        let Some(mr) = st.mrs.remove(&self.info.lkey) else {
            return; // its device was killed
        };
        let users = st
            .qps
            .values()
            .filter(|q| q.dev == mr.dev)
            .flat_map(|q| q.sq.iter())
            .filter(|wr| wr.local.is_some_and(|s| s.lkey == self.info.lkey))
            .count();
        if users > 0 {
            violation(
                &mut st,
                format!(
                    "memory region {:#x} deregistered while {users} queued request(s) still use it",
                    self.info.lkey
                ),
            );
        }
    }
}

struct ModelCq {
    fabric: ModelFabric,
    id: u32,
    signal: Arc<Signal>,
    device: String,
}

impl VerbsCq for ModelCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> VerbsResult<usize> {
        let mut st = self.fabric.lock();
        let Some(cq) = st.cqs.get_mut(&self.id) else {
            return Err(VerbsError::DeviceGone(self.device.clone()));
        };
        let n = max.min(cq.entries.len());
        let taken: Vec<Completion> = cq.entries.drain(..n).collect();
        let dev = cq.dev;
        if !st.devices.get(&dev).is_some_and(|d| d.alive) {
            return Err(VerbsError::DeviceGone(self.device.clone()));
        }
        for c in &taken {
            if let Some(qp) = st.qps.get_mut(&c.qpn) {
                match c.kind {
                    WcKind::Recv | WcKind::RecvWriteImm => qp.rq_outstanding -= 1,
                    _ => qp.sq_outstanding -= 1,
                }
            }
        }
        out.extend_from_slice(&taken);
        Ok(n)
    }

    fn arm(&self) -> VerbsResult<()> {
        let mut st = self.fabric.lock();
        let Some(cq) = st.cqs.get_mut(&self.id) else {
            return Err(VerbsError::DeviceGone(self.device.clone()));
        };
        cq.armed = true;
        cq.pushed_since_arm = 0;
        Ok(())
    }

    /// Sleeps as hardware would: only the armed event (or `wake`) ends it early, so completions
    /// queued before the arming that nobody polled are slept through; that is recorded as a
    /// violation (a caller must poll once more after arming).
    fn wait(&self, timeout: Duration) -> VerbsResult<()> {
        {
            let mut st = self.fabric.lock();
            let stale = match st.cqs.get(&self.id) {
                Some(cq) => cq.entries.len().saturating_sub(cq.pushed_since_arm),
                None => return Err(VerbsError::DeviceGone(self.device.clone())),
            };
            if stale > 0 {
                violation(
                    &mut st,
                    format!(
                        "waited on completion queue {:#x} with {stale} completion(s) queued before it was armed (poll once more after arming)",
                        self.id
                    ),
                );
            }
        }
        self.signal.wait(timeout);
        Ok(())
    }

    fn wake(&self) {
        self.signal.raise();
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for ModelCq {
    fn drop(&mut self) {
        let mut st = self.fabric.lock();
        if st.qps.values().any(|q| q.cq == self.id) {
            violation(&mut st, "completion queue destroyed while queue pairs use it".into());
        }
        st.cqs.remove(&self.id);
    }
}

struct ModelQp {
    fabric: ModelFabric,
    qpn: u32,
    device: String,
}

impl ModelQp {
    fn with<T>(&self, f: impl FnOnce(&mut State, u32) -> VerbsResult<T>) -> VerbsResult<T> {
        let mut st = self.fabric.lock();
        if !st.qps.contains_key(&self.qpn) {
            return Err(VerbsError::DeviceGone(self.device.clone()));
        }
        let r = f(&mut st, self.qpn);
        drop(st);
        self.fabric.inner.work.notify_all();
        r
    }
}

impl VerbsQp for ModelQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    /// As `modify_qp` to RTR and RTS, checking the path against both ports as hardware would:
    /// an MTU above this port's active MTU is refused (EINVAL), one above the peer's would drop
    /// every full-sized packet there; more outstanding reads than this device initiates or the
    /// peer answers would stall or fail the queue pair. The model refuses each with its reason.
    fn connect(&self, _local_psn: u32, remote: &Endpoint, path: &Path) -> VerbsResult<()> {
        self.with(|st, n| {
            let dev = st.qps.get(&n).expect("checked").dev;
            let mine = st.devices.get(&dev).map(|d| d.limits).expect("a queue pair's device");
            // The peer's port as the fabric knows it, whatever its hello said.
            let theirs = st
                .qps
                .get(&remote.qpn)
                .and_then(|q| st.devices.get(&q.dev))
                .map(|d| d.limits);
            let refuse = |why: String| Err(VerbsError::failed("modify_qp", why));
            if !(MTU_256..=MTU_4096).contains(&path.mtu) {
                return refuse(format!("path MTU code {} is not an ibv_mtu", path.mtu));
            }
            if path.mtu > mine.active_mtu {
                return refuse(format!(
                    "path MTU code {} above this port's active MTU {} (EINVAL)",
                    path.mtu, mine.active_mtu
                ));
            }
            if path.rd_initiator > mine.max_rd_atomic || path.rd_responder > mine.max_rd_responder {
                return refuse(format!(
                    "read depths {}/{} above this device's {}/{} (EINVAL)",
                    path.rd_initiator, path.rd_responder, mine.max_rd_atomic, mine.max_rd_responder
                ));
            }
            if let Some(theirs) = theirs {
                if path.mtu > theirs.active_mtu {
                    return refuse(format!(
                        "path MTU code {} above the peer port's active MTU {}: full-sized packets would be dropped there",
                        path.mtu, theirs.active_mtu
                    ));
                }
                if path.rd_initiator > theirs.max_rd_responder {
                    return refuse(format!(
                        "{} outstanding reads initiated, the peer answers {}: reads beyond it fail the queue pair",
                        path.rd_initiator, theirs.max_rd_responder
                    ));
                }
            }
            let qp = st.qps.get_mut(&n).expect("checked");
            if qp.state != QpState::Reset {
                return Err(VerbsError::failed("modify_qp", "not in the reset state"));
            }
            qp.remote = Some(remote.qpn);
            qp.state = QpState::Rts;
            Ok(())
        })
    }

    fn set_error(&self) -> VerbsResult<()> {
        self.with(|st, n| {
            to_error(st, n);
            Ok(())
        })
    }

    unsafe fn post_send(&self, wr: &SendWr) -> VerbsResult<()> {
        self.with(|st, n| {
            let qp = st.qps.get_mut(&n).expect("checked");
            match qp.state {
                QpState::Reset => return Err(VerbsError::failed("post_send", "queue pair is not ready to send")),
                QpState::Rts | QpState::Error => {}
            }
            if qp.sq_outstanding >= qp.caps.send_depth {
                return Err(VerbsError::QueueFull {
                    op: "post_send",
                    depth: qp.caps.send_depth,
                });
            }
            qp.sq_outstanding += 1;
            qp.sq.push_back(*wr);
            st.ready.push_back(n);
            Ok(())
        })
    }

    fn post_recv(&self, wr_id: u64) -> VerbsResult<()> {
        self.with(|st, n| {
            let qp = st.qps.get_mut(&n).expect("checked");
            if qp.state == QpState::Reset {
                return Err(VerbsError::failed("post_recv", "queue pair is in the reset state"));
            }
            if qp.rq_outstanding >= qp.caps.recv_depth {
                return Err(VerbsError::QueueFull {
                    op: "post_recv",
                    depth: qp.caps.recv_depth,
                });
            }
            qp.rq_outstanding += 1;
            if qp.state == QpState::Error {
                push_cqe(st, n, wr_id, WcStatus::Flushed, WcKind::Recv, None);
                return Ok(());
            }
            qp.rq.push_back(wr_id);
            // A sender held up by receiver-not-ready may go on.
            let waiting: Vec<u32> = st
                .qps
                .iter()
                .filter(|(_, q)| q.remote == Some(n) && q.rnr_waiting)
                .map(|(&k, _)| k)
                .collect();
            st.ready.extend(waiting);
            Ok(())
        })
    }
}

impl Drop for ModelQp {
    fn drop(&mut self) {
        let mut st = self.fabric.lock();
        let Some(qp) = st.qps.remove(&self.qpn) else {
            return;
        };
        if qp.sq_outstanding > 0 || qp.rq_outstanding > 0 {
            violation(
                &mut st,
                format!(
                    "queue pair {:#x} destroyed with {} send and {} receive request(s) not completed and polled",
                    self.qpn, qp.sq_outstanding, qp.rq_outstanding
                ),
            );
        }
        drop(st);
        self.fabric.inner.work.notify_all();
    }
}

/// Moves a queue pair to the error state and flushes what it has queued, in order.
fn to_error(st: &mut State, n: u32) {
    let Some(qp) = st.qps.get_mut(&n) else { return };
    qp.state = QpState::Error;
    qp.rnr_waiting = false;
    let sq: Vec<SendWr> = qp.sq.drain(..).collect();
    let rq: Vec<u64> = qp.rq.drain(..).collect();
    for wr in sq {
        push_cqe(st, n, wr.wr_id, WcStatus::Flushed, WcKind::Send, None);
    }
    for id in rq {
        push_cqe(st, n, id, WcStatus::Flushed, WcKind::Recv, None);
    }
}

fn push_cqe(st: &mut State, qpn: u32, wr_id: u64, status: WcStatus, kind: WcKind, imm: Option<u32>) {
    let Some(cq_id) = st.qps.get(&qpn).map(|q| q.cq) else {
        return;
    };
    let overrun = {
        let cq = st.cqs.get_mut(&cq_id).expect("queue pairs keep their CQ");
        if cq.entries.len() >= cq.capacity {
            true
        } else {
            cq.entries.push_back(Completion {
                wr_id,
                qpn,
                status,
                kind,
                imm,
            });
            cq.pushed_since_arm += 1;
            // As hardware: one event per arming, for a completion after it.
            if std::mem::take(&mut cq.armed) {
                cq.signal.raise();
            }
            false
        }
    };
    if overrun {
        violation(st, format!("completion queue {cq_id:#x} overran"));
        let victims: Vec<u32> = st
            .qps
            .iter()
            .filter(|(_, q)| q.cq == cq_id && q.state != QpState::Error)
            .map(|(&k, _)| k)
            .collect();
        for v in victims {
            if let Some(q) = st.qps.get_mut(&v) {
                q.state = QpState::Error;
            }
        }
    }
}

/// Checks that `[addr, addr+len)` lies in registration `key` of device `dev` with `need`.
/// Remote keys differ from local keys (as on hardware): an rkey is the region's id with this
/// bit set, an lkey the id alone, so a key used on the wrong side matches nothing.
const RKEY_TAG: u32 = 0x8000_0000;

/// Whether `key` names a region of `dev` covering `addr..addr+len` with the rights `need`;
/// `remote` says whether `key` is an rkey (from a peer) or an lkey.
#[allow(clippy::too_many_arguments)]
fn check_mr(st: &State, dev: u32, key: u32, remote: bool, addr: u64, len: u64, need: impl Fn(Access) -> bool) -> bool {
    let id = match (remote, key & RKEY_TAG != 0) {
        (true, true) => key & !RKEY_TAG,
        (false, false) => key,
        _ => return false,
    };
    st.mrs.get(&id).is_some_and(|m| {
        m.dev == dev
            && need(m.access)
            && addr >= m.addr
            && addr.checked_add(len).is_some_and(|end| end <= m.addr + m.len as u64)
    })
}

/// Whether the head request of `n`, whose peer does not answer, has been retried for the whole
/// retry timeout; if not, `n` is revisited later.
fn retried_out(st: &mut State, n: u32) -> bool {
    let timeout = st.retry_timeout;
    let q = st.qps.get_mut(&n).expect("present");
    let since = *q.silent_since.get_or_insert_with(Instant::now);
    if since.elapsed() >= timeout {
        return true;
    }
    if !st.retrying.contains(&n) {
        st.retrying.push(n);
    }
    false
}

/// The NIC: executes the head of each ready queue pair's send queue.
fn worker(fabric: Weak<Fabric>) {
    loop {
        let Some(f) = fabric.upgrade() else { return };
        let mut st = f.state.lock().expect("verbs model state");
        loop {
            if st.shutdown {
                return;
            }
            if let Some(n) = st.ready.pop_front() {
                execute(&mut st, n);
                continue;
            }
            let idle = match st.retrying.is_empty() {
                true => Duration::from_millis(100),
                false => Duration::from_millis(2),
            };
            let (guard, _) = f.work.wait_timeout(st, idle).expect("verbs model state");
            st = guard;
            // Retries go on: revisit the queue pairs whose peer was silent.
            let retrying = std::mem::take(&mut st.retrying);
            st.ready.extend(retrying);
            if st.ready.is_empty() {
                break; // let the fabric go if nobody holds it
            }
        }
    }
}

fn execute(st: &mut State, n: u32) {
    loop {
        let Some(qp) = st.qps.get(&n) else { return };
        if !st.devices.get(&qp.dev).is_some_and(|d| d.alive) {
            return;
        }
        let Some(&wr) = qp.sq.front() else { return };
        if qp.state == QpState::Error {
            to_error(st, n);
            return;
        }
        let dev = qp.dev;
        let remote = qp.remote.and_then(|r| st.qps.get(&r).map(|q| (r, q)));
        let answering =
            remote.filter(|(_, q)| st.devices.get(&q.dev).is_some_and(|d| d.alive) && q.state != QpState::Error);
        let Some((rn, rdev, r_has_recv)) = answering.map(|(r, q)| (r, q.dev, !q.rq.is_empty())) else {
            // Nobody answers: the NIC retries until the retry timeout, then gives up.
            if retried_out(st, n) {
                fail(st, n, wr, WcStatus::RetryExceeded, None);
            }
            return;
        };
        let local_len = wr.local.map_or(0, |s| s.len as u64);
        if let Some(s) = wr.local {
            let writable = matches!(wr.op, SendOp::Read { .. });
            if !check_mr(st, dev, s.lkey, false, s.addr, s.len as u64, |a| {
                !writable || a.local_write
            }) {
                fail(st, n, wr, WcStatus::LocalProtection, None);
                return;
            }
        }
        let consumes_recv = !matches!(wr.op, SendOp::Read { .. });
        if consumes_recv && !r_has_recv {
            let q = st.qps.get_mut(&n).expect("present");
            if !q.rnr_waiting {
                q.rnr_waiting = true;
                st.stats.rnr_waits += 1;
            }
            return; // retried when the peer posts a receive
        }
        match wr.op {
            SendOp::WriteImm { remote_addr, rkey, imm } => {
                if !check_mr(st, rdev, rkey, true, remote_addr, local_len, |a| a.remote_write) {
                    fail(st, n, wr, WcStatus::RemoteAccess, Some(rn));
                    return;
                }
                if let Some(s) = wr.local {
                    copy(s.addr, remote_addr, s.len as usize);
                }
                st.stats.bytes += local_len;
                finish(st, n, rn, wr, WcKind::Write, Some((WcKind::RecvWriteImm, imm)));
            }
            SendOp::SendImm { imm } => {
                if wr.local.is_some() {
                    fail(st, n, wr, WcStatus::LocalProtection, None);
                    return;
                }
                finish(st, n, rn, wr, WcKind::Send, Some((WcKind::Recv, imm)));
            }
            SendOp::Read { remote_addr, rkey } => {
                if !check_mr(st, rdev, rkey, true, remote_addr, local_len, |a| a.remote_read) {
                    fail(st, n, wr, WcStatus::RemoteAccess, Some(rn));
                    return;
                }
                if let Some(s) = wr.local {
                    copy(remote_addr, s.addr, s.len as usize);
                }
                st.stats.bytes += local_len;
                finish(st, n, rn, wr, WcKind::Read, None);
            }
        }
    }
}

fn copy(from: u64, to: u64, len: usize) {
    // SAFETY: both ranges were checked to lie within live registrations (check_mr) under the
    // fabric lock, and registrations promise (VerbsDevice::register's contract) that their
    // memory stays valid until deregistered, which takes the same lock. `copy` tolerates
    // overlap (a loopback write within one region).
    unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) }
}

/// Completes the head request successfully, consuming a receive at the peer when asked.
fn finish(st: &mut State, n: u32, rn: u32, wr: SendWr, kind: WcKind, recv: Option<(WcKind, u32)>) {
    st.stats.executed += 1;
    if let Some(q) = st.qps.get_mut(&n) {
        q.sq.pop_front();
        q.rnr_waiting = false;
    }
    if let Some((rkind, imm)) = recv {
        let id = st.qps.get_mut(&rn).and_then(|q| q.rq.pop_front()).expect("checked");
        push_cqe(st, rn, id, WcStatus::Success, rkind, Some(imm));
    }
    push_cqe(st, n, wr.wr_id, WcStatus::Success, kind, None);
}

/// Completes the head request with an error; the queue pair (and, for remote access errors,
/// the peer's) enters the error state and flushes the rest.
fn fail(st: &mut State, n: u32, wr: SendWr, status: WcStatus, peer: Option<u32>) {
    if let Some(q) = st.qps.get_mut(&n) {
        q.sq.pop_front();
    }
    push_cqe(st, n, wr.wr_id, status, WcKind::Send, None);
    to_error(st, n);
    if let Some(p) = peer {
        to_error(st, p);
    }
}
