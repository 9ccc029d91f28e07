//! The narrow verbs interface the ibverbs transport and the RDMA channels are written against.
//!
//! It holds exactly what Sluice uses of libibverbs: one protection domain per device, memory
//! regions, completion queues with a blocking wait, and reliable-connected queue pairs posting
//! RDMA write (with immediate), RDMA read and send with immediate. Two implementations:
//! [`super::model`] (an in-process model that enforces the verbs rules strictly, used by the
//! tests and by `sluice bench` on machines without RDMA) and, with the `rdma` feature,
//! `super::real` (libibverbs loaded at run time through `sideway`).
//!
//! Rules every caller keeps (the model checks them; real hardware corrupts memory or hangs
//! without them):
//! - A work request's local and remote memory stays valid and registered until its completion
//!   (success or flush) has been polled.
//! - At most `send_depth` send and `recv_depth` receive requests are outstanding per queue pair,
//!   and a completion queue holds every completion its queue pairs can produce at once.
//! - On close, a queue pair is moved to the error state and its flushed completions are drained
//!   before its memory is deregistered or freed.
#![allow(unsafe_code)]

use std::time::Duration;

/// Why a verbs call failed (synchronously; asynchronous failures arrive as completions).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum VerbsError {
    #[error("{op}: {reason}")]
    Failed { op: &'static str, reason: String },
    /// A post beyond the queue's depth (`ENOMEM` from libibverbs).
    #[error("{op}: queue full ({depth} requests outstanding)")]
    QueueFull { op: &'static str, depth: u32 },
    /// The device went away (the model's "process killed", a removed adapter).
    #[error("device {0} is gone")]
    DeviceGone(String),
}

impl VerbsError {
    pub fn failed(op: &'static str, reason: impl std::fmt::Display) -> Self {
        VerbsError::Failed {
            op,
            reason: reason.to_string(),
        }
    }
}

pub type VerbsResult<T> = std::result::Result<T, VerbsError>;

/// Limits the device reports; queue sizes are derived from them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    pub max_mr_size: u64,
    /// Outstanding RDMA reads a queue pair may initiate (`max_qp_init_rd_atom`).
    pub max_rd_atomic: u8,
    /// Outstanding RDMA reads a queue pair may answer as responder (`max_qp_rd_atom`).
    pub max_rd_responder: u8,
    /// The selected port's active MTU, as an `ibv_mtu` code ([`MTU_256`] ..= [`MTU_4096`]).
    pub active_mtu: u32,
    /// Bytes this process may pin (`RLIMIT_MEMLOCK`; `u64::MAX` when unlimited): every
    /// registration counts against it.
    pub memlock: u64,
}

/// Why a registration did not fit the locked-memory limit, and how to raise it.
pub fn memlock_hint(limit: u64, wanted: u64) -> String {
    format!(
        "the locked-memory limit (RLIMIT_MEMLOCK, `ulimit -l`) is {} KiB and {} KiB more must be pinned; \
         raise it (`ulimit -l unlimited`, Docker `--ulimit memlock=-1`, systemd `LimitMEMLOCK=infinity`, \
         or `memlock` in /etc/security/limits.conf)",
        limit / 1024,
        wanted / 1024
    )
}

/// `IBV_MTU_256`: the smallest path MTU code.
pub const MTU_256: u32 = 1;
/// `IBV_MTU_4096`: the largest path MTU code.
pub const MTU_4096: u32 = 5;

/// What a connection's two ends agree on, from both sides' [`Endpoint`]s: neither port's MTU
/// is exceeded, and neither side initiates more outstanding reads than the other answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    /// `ibv_mtu` code: the smaller of both ports' active MTUs.
    pub mtu: u32,
    /// Reads this side may have outstanding (`max_rd_atomic`): its own initiator limit, bounded
    /// by the peer's responder limit.
    pub rd_initiator: u8,
    /// Reads this side answers at once (`max_dest_rd_atomic`): its own responder limit, which
    /// the peer bounds its initiator depth by.
    pub rd_responder: u8,
}

impl Path {
    /// The path between this device and the peer that sent `remote`.
    pub fn negotiate(local: &Limits, remote: &Endpoint) -> Path {
        Path {
            mtu: local.active_mtu.min(remote.mtu),
            rd_initiator: local.max_rd_atomic.min(remote.rd_responder).max(1),
            rd_responder: local.max_rd_responder.max(1),
        }
    }
}

/// What the peer needs to connect a queue pair to ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub lid: u16,
    pub gid: [u8; 16],
    pub qpn: u32,
    pub psn: u32,
    /// The port's active MTU (`ibv_mtu` code).
    pub mtu: u32,
    /// Reads this side answers at once as responder (`max_qp_rd_atom`).
    pub rd_responder: u8,
}

/// Memory access rights of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    pub local_write: bool,
    pub remote_write: bool,
    pub remote_read: bool,
}

impl Access {
    pub const LOCAL: Access = Access {
        local_write: true,
        remote_write: false,
        remote_read: false,
    };
    pub const REMOTE_WRITE: Access = Access {
        local_write: true,
        remote_write: true,
        remote_read: false,
    };
    /// A source the peer reads: no local write, so read-only memory can be registered.
    pub const REMOTE_READ: Access = Access {
        local_write: false,
        remote_write: false,
        remote_read: true,
    };
}

/// A registered memory region: the keys the NIC checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrInfo {
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
}

/// A local buffer of a work request (one scatter/gather entry).
#[derive(Debug, Clone, Copy)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// What a send-queue work request does.
#[derive(Debug, Clone, Copy)]
pub enum SendOp {
    /// RDMA write of the local buffer to `remote_addr`, consuming a receive on the peer that
    /// completes with `imm`.
    WriteImm { remote_addr: u64, rkey: u32, imm: u32 },
    /// A zero-byte send carrying only `imm`.
    SendImm { imm: u32 },
    /// RDMA read of `remote_addr` into the local buffer.
    Read { remote_addr: u64, rkey: u32 },
}

/// A send-queue work request. Every request is signalled (produces a completion).
#[derive(Debug, Clone, Copy)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: SendOp,
    pub local: Option<Sge>,
}

/// The outcome of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcStatus {
    Success,
    /// Flushed because the queue pair entered the error state.
    Flushed,
    LocalProtection,
    RemoteAccess,
    /// The peer stopped answering (it died, or its queue pair is gone).
    RetryExceeded,
    /// The peer had no receive posted for longer than the retry budget.
    RnrRetryExceeded,
    Other(u32),
}

/// Which kind of request a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WcKind {
    Send,
    Write,
    Read,
    /// A receive consumed by a send with immediate.
    Recv,
    /// A receive consumed by an RDMA write with immediate.
    RecvWriteImm,
}

/// One completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub qpn: u32,
    pub status: WcStatus,
    /// Valid only when `status` is `Success` (flushed completions carry no opcode in verbs).
    pub kind: WcKind,
    pub imm: Option<u32>,
}

/// Queue depths of a queue pair.
#[derive(Debug, Clone, Copy)]
pub struct QpCaps {
    pub send_depth: u32,
    pub recv_depth: u32,
}

/// An opened device with one protection domain, on the port and GID it was configured with.
pub trait VerbsDevice: Send + Sync + 'static {
    /// The device's name and port, for logs (`mlx5_0:1`).
    fn name(&self) -> String;
    fn limits(&self) -> Limits;
    /// The local part of an [`Endpoint`] (LID, GID) on the selected port.
    fn address(&self) -> (u16, [u8; 16]);
    /// Which fabric this port is on; peers connect only within one (`ib;subnet=...`, `roce`).
    fn fabric(&self) -> String;
    fn create_cq(&self, entries: u32) -> VerbsResult<Box<dyn VerbsCq>>;
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// The memory must stay valid (not freed, not unmapped) until the returned region is
    /// dropped, and every work request using it has completed before then.
    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Box<dyn VerbsMr>>;
    /// Registers `len` bytes at `offset` of a dma-buf (GPU memory exported by its driver) so
    /// that they are addressed from `iova` on. Devices or backends without dma-buf support say
    /// so.
    ///
    /// # Safety
    /// `fd` is a dma-buf whose exported memory stays allocated until the region is dropped.
    unsafe fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> VerbsResult<Box<dyn VerbsMr>> {
        let _ = (fd, offset, len, iova, access);
        Err(VerbsError::failed("reg_dmabuf_mr", "not supported by this device"))
    }
    /// The device's place in the PCI hierarchy (its canonical sysfs path), to pair GPUs with
    /// their nearest NIC. `None` when unknown (the model).
    fn pci_path(&self) -> Option<std::path::PathBuf> {
        None
    }
    /// Creates a reliable-connected queue pair whose completions go to `cq` (in the reset
    /// state: connect it before posting).
    fn create_qp(&self, cq: &dyn VerbsCq, caps: QpCaps) -> VerbsResult<Box<dyn VerbsQp>>;
}

/// A memory registration; dropping it deregisters.
pub trait VerbsMr: Send + Sync {
    fn info(&self) -> MrInfo;
}

/// A completion queue.
pub trait VerbsCq: Send + Sync {
    /// Appends up to `max` completions to `out`; returns how many.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> VerbsResult<usize>;
    /// Requests one event for the next completion (`ibv_req_notify_cq`). Completions already
    /// queued raise none: after arming, poll once more and [`wait`](Self::wait) only if that
    /// found nothing, or a completion that raced the arming is slept through.
    fn arm(&self) -> VerbsResult<()>;
    /// Blocks until the armed event fires, [`wake`](Self::wake) is called, or `timeout` passes.
    /// Callers poll again afterwards (wake-ups may be spurious) and arm again before the next
    /// wait.
    fn wait(&self, timeout: Duration) -> VerbsResult<()>;
    /// Ends a pending [`wait`](Self::wait) early (from any thread).
    fn wake(&self);
    /// For implementations to recognise their own queues.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A reliable-connected queue pair. Dropping it destroys it: do so only once it is in the
/// error state and every flushed completion has been polled.
pub trait VerbsQp: Send + Sync {
    fn qpn(&self) -> u32;
    /// Moves the queue pair through INIT, RTR and RTS towards `remote`, over `path` (see
    /// [`Path::negotiate`]).
    fn connect(&self, local_psn: u32, remote: &Endpoint, path: &Path) -> VerbsResult<()>;
    /// Moves the queue pair to the error state: outstanding requests complete as flushed.
    fn set_error(&self) -> VerbsResult<()>;
    /// Posts a send-queue request.
    ///
    /// # Safety
    /// `wr.local` lies within a live registration of this device whose `lkey` it names, and
    /// that memory stays valid, and is neither written (for a write or send) nor read (for a
    /// read) by anyone else, until the request's completion has been polled. At most
    /// `send_depth` requests may be outstanding.
    unsafe fn post_send(&self, wr: &SendWr) -> VerbsResult<()>;
    /// Posts a receive without a buffer (it is consumed by a write or send with immediate).
    fn post_recv(&self, wr_id: u64) -> VerbsResult<()>;
}
