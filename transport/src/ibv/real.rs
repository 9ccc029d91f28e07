//! Real RDMA devices: libibverbs loaded at run time through `sideway` (over `rdma-mummy-sys`,
//! which resolves libibverbs with `dlopen`), so one binary starts on hosts without rdma-core and
//! simply finds no device.
//!
//! All the `unsafe` of the hardware backend lives here; every block says why it holds.
//!
//! Device selection ([`open`]): a named device or the first with an active port; a named port or
//! the first active one; on InfiniBand GID index 0 with the port's LID, on RoCE a named GID index
//! or the first RoCE v2 GID (IPv4-mapped preferred), because RoCE v1 and link-local GIDs do not
//! route. The choice is logged. Fork safety: `ibv_fork_init` runs before any memory is
//! registered (a no-op where the kernel copes with fork on its own).
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_mummy_sys as sys;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, PortState};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType, SetScatterGatherEntry,
    WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::gid::{self, GidEntry};

/// `IBV_QPF_GRH_REQUIRED` (`ib_user_ioctl_verbs.h`): the port's packets must carry a GRH.
const IBV_QPF_GRH_REQUIRED: u8 = 1;
use super::verbs::*;

/// An opened device, port and GID with its protection domain.
pub struct RealDevice {
    ctx: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
    name: String,
    port: u8,
    gid_index: u8,
    lid: u16,
    gid: [u8; 16],
    roce: bool,
    /// The port requires a GRH on every packet (`IBV_QPF_GRH_REQUIRED`), even on InfiniBand.
    grh_required: bool,
    /// The GRH traffic class (`SLUICE_IB_TRAFFIC_CLASS`, 0 by default): RoCE fabrics map it
    /// to a lossless priority.
    traffic_class: u8,
    limits: Limits,
}

fn fork_safety() {
    // SAFETY: plain library calls without arguments; rdma-mummy-sys returns an error code when
    // libibverbs is absent (the caller has already listed devices, so it is present).
    unsafe {
        if sys::ibv_is_fork_initialized() == sys::IBV_FORK_DISABLED {
            let rc = sys::ibv_fork_init();
            if rc != 0 {
                tracing::warn!("ibv_fork_init failed ({rc}): a forked child must not touch registered memory");
            }
        }
    }
}

/// Opens the device to use (see the module docs for the automatic choice).
pub fn open(device: Option<&str>, port: Option<u8>, gid_index: Option<u32>) -> Result<Arc<RealDevice>, String> {
    let list = DeviceList::new().map_err(|e| format!("no RDMA devices (is rdma-core installed?): {e}"))?;
    if list.is_empty() {
        return Err("no RDMA devices on this host".into());
    }
    fork_safety();
    let mut tried = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        if device.is_some_and(|want| want != name) {
            continue;
        }
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                tried.push(format!("{name}: cannot open: {e}"));
                continue;
            }
        };
        match choose_port(&ctx, &name, port, gid_index) {
            Ok(d) => return Ok(Arc::new(d)),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    if tried.is_empty() {
        return Err(format!("no RDMA device named {:?}", device.unwrap_or("")));
    }
    Err(tried.join("; "))
}

fn choose_port(
    ctx: &Arc<DeviceContext>,
    name: &str,
    port: Option<u8>,
    gid_index: Option<u32>,
) -> Result<RealDevice, String> {
    let attr = ctx.query_device().map_err(|e| format!("query_device: {e}"))?;
    let ports: Vec<u8> = match port {
        Some(p) => vec![p],
        None => (1..=attr.phys_port_cnt()).collect(),
    };
    let mut skipped = Vec::new();
    for p in ports {
        let pa = match ctx.query_port(p) {
            Ok(pa) => pa,
            Err(e) => {
                tracing::debug!("{name}:{p}: query_port: {e}");
                continue;
            }
        };
        if pa.port_state() != PortState::Active {
            tracing::debug!("{name}:{p}: port not active ({:?})", pa.port_state());
            continue;
        }
        let roce = pa.link_layer() == LinkLayer::Ethernet;
        // A port that cannot be used says why, and the next port is tried.
        let index = match (gid_index, roce) {
            (Some(i), _) => i,
            (None, false) => 0,
            (None, true) => match roce_v2_gid(ctx, p, pa.gid_tbl_len()) {
                Some(i) => i,
                None => {
                    skipped.push(format!(
                        "port {p} has no routable RoCE v2 GID (set SLUICE_IB_GID_INDEX)"
                    ));
                    continue;
                }
            },
        };
        let gid = match ctx.query_gid(p, index) {
            Ok(g) => g,
            Err(e) => {
                skipped.push(format!("port {p} GID {index}: {e}"));
                continue;
            }
        };
        let pd = ctx.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;
        let limits = Limits {
            max_qp_wr: attr.max_qp_wr().max(0) as u32,
            max_cqe: attr.max_cqe().max(0) as u32,
            max_mr_size: attr.max_mr_size(),
            max_rd_atomic: attr.max_qp_init_rd_atom().clamp(1, 16) as u8,
            max_rd_responder: attr.max_qp_rd_atom().clamp(1, 16) as u8,
            active_mtu: pa.active_mtu() as u32,
            memlock: memlock_limit(),
        };
        tracing::info!(
            device = name,
            port = p,
            gid_index = index,
            gid = %gid,
            link = if roce { "roce" } else { "infiniband" },
            lid = pa.lid(),
            "ibverbs device chosen"
        );
        return Ok(RealDevice {
            ctx: ctx.clone(),
            pd,
            name: name.to_owned(),
            port: p,
            gid_index: index as u8,
            lid: pa.lid(),
            gid: gid.raw,
            roce,
            grh_required: pa.attr.flags & IBV_QPF_GRH_REQUIRED != 0,
            traffic_class: std::env::var("SLUICE_IB_TRAFFIC_CLASS")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0),
            limits,
        });
    }
    if skipped.is_empty() {
        Err("no active port".into())
    } else {
        Err(skipped.join("; "))
    }
}

/// Bytes this process may pin: `RLIMIT_MEMLOCK`, unlimited for root (CAP_IPC_LOCK).
fn memlock_limit() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit structure we own.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    // SAFETY: geteuid has no preconditions.
    if rc != 0 || r.rlim_cur == libc::RLIM_INFINITY || unsafe { libc::geteuid() } == 0 {
        u64::MAX
    } else {
        r.rlim_cur
    }
}

/// The RoCE v2 GID of `port` to use (see [`gid::choose_roce_v2`]).
fn roce_v2_gid(ctx: &DeviceContext, port: u8, len: i32) -> Option<u32> {
    let table: Vec<GidEntry> = (0..len.max(0) as u32)
        .filter_map(|index| {
            let sysfs_type = ctx.query_gid_type(port, index).ok()?;
            let gid = ctx.query_gid(port, index).ok()?;
            Some(GidEntry {
                index,
                sysfs_type,
                gid: gid.raw,
            })
        })
        .collect();
    gid::choose_roce_v2(&table)
}

/// Exactly the rights asked for: a source registered for remote reads may be read-only memory,
/// and asking LOCAL_WRITE there fails (EFAULT).
fn access_flags(a: Access) -> AccessFlags {
    let mut f = AccessFlags::none();
    if a.local_write {
        f |= AccessFlags::LocalWrite;
    }
    if a.remote_write {
        f |= AccessFlags::RemoteWrite;
    }
    if a.remote_read {
        f |= AccessFlags::RemoteRead;
    }
    f
}

impl VerbsDevice for RealDevice {
    fn name(&self) -> String {
        format!("{}:{}", self.name, self.port)
    }

    fn limits(&self) -> Limits {
        self.limits
    }

    fn address(&self) -> (u16, [u8; 16]) {
        (self.lid, self.gid)
    }

    fn fabric(&self) -> String {
        if self.roce {
            "roce".into()
        } else {
            // Queue pairs connect by LID within one subnet (its prefix is the GID's upper half).
            let prefix: String = self.gid[..8].iter().map(|b| format!("{b:02x}")).collect();
            format!("ib;subnet={prefix}")
        }
    }

    fn create_cq(&self, entries: u32) -> VerbsResult<Box<dyn VerbsCq>> {
        let channel = self
            .ctx
            .create_comp_channel()
            .map_err(|e| VerbsError::failed("create_comp_channel", e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| VerbsError::failed("comp channel nonblocking", e))?;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(entries)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| VerbsError::failed("create_cq", e))?;
        // SAFETY: eventfd(2) with valid flags; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(VerbsError::failed("eventfd", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor owned by nobody else.
        let wake = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Box::new(RealCq {
            cq,
            channel,
            wake,
            name: self.name(),
        }))
    }

    unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Box<dyn VerbsMr>> {
        // SAFETY: forwarded contract: the caller keeps the memory valid while registered.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access_flags(access)) }.map_err(|e| {
            // Pinning beyond RLIMIT_MEMLOCK fails with ENOMEM: say which limit and how to raise it.
            let text = e.to_string();
            if text.contains("Cannot allocate memory") || text.contains("ENOMEM") {
                VerbsError::failed(
                    "reg_mr",
                    format!("{text}: {}", memlock_hint(self.limits.memlock, len as u64)),
                )
            } else {
                VerbsError::failed("reg_mr", text)
            }
        })?;
        Ok(Box::new(RealMr(mr)))
    }

    unsafe fn register_dmabuf(
        &self,
        fd: std::os::fd::RawFd,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> VerbsResult<Box<dyn VerbsMr>> {
        // SAFETY: forwarded contract: the dma-buf's memory outlives the registration.
        let mr = unsafe { self.pd.reg_dmabuf_mr(offset, len, iova, fd, access_flags(access)) }
            .map_err(|e| VerbsError::failed("reg_dmabuf_mr", e))?;
        Ok(Box::new(RealMr(mr)))
    }

    fn pci_path(&self) -> Option<std::path::PathBuf> {
        std::fs::canonicalize(format!("/sys/class/infiniband/{}/device", self.name)).ok()
    }

    fn create_qp(&self, cq: &dyn VerbsCq, caps: QpCaps) -> VerbsResult<Box<dyn VerbsQp>> {
        let cq = cq
            .as_any()
            .downcast_ref::<RealCq>()
            .ok_or_else(|| VerbsError::failed("create_qp", "completion queue of another backend"))?;
        let qp = self
            .pd
            .create_qp_builder()
            .setup_qp_type(QueuePairType::ReliableConnection)
            .setup_max_send_wr(caps.send_depth)
            .setup_max_recv_wr(caps.recv_depth)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_send_cq(cq.cq.clone())
            .setup_recv_cq(cq.cq.clone())
            .build()
            .map_err(|e| VerbsError::failed("create_qp", e))?;
        let qpn = qp.qp_number();
        Ok(Box::new(RealQp {
            qp: Mutex::new(qp),
            qpn,
            port: self.port,
            gid_index: self.gid_index,
            grh: self.roce || self.grh_required,
            traffic_class: self.traffic_class,
        }))
    }
}

struct RealMr(Arc<MemoryRegion>);

impl VerbsMr for RealMr {
    fn info(&self) -> MrInfo {
        MrInfo {
            addr: self.0.get_ptr() as u64,
            len: self.0.region_len(),
            lkey: self.0.lkey(),
            rkey: self.0.rkey(),
        }
    }
}

struct RealCq {
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    wake: OwnedFd,
    name: String,
}

fn status(raw: u32) -> WcStatus {
    use sys::ibv_wc_status::*;
    match raw {
        IBV_WC_SUCCESS => WcStatus::Success,
        IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
        IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
        IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
        IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        other => WcStatus::Other(other),
    }
}

fn kind(opcode: u32) -> WcKind {
    use sys::ibv_wc_opcode::*;
    match opcode {
        IBV_WC_RDMA_WRITE => WcKind::Write,
        IBV_WC_RDMA_READ => WcKind::Read,
        IBV_WC_RECV => WcKind::Recv,
        IBV_WC_RECV_RDMA_WITH_IMM => WcKind::RecvWriteImm,
        _ => WcKind::Send,
    }
}

impl VerbsCq for RealCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> VerbsResult<usize> {
        let mut wcs: [std::mem::MaybeUninit<sys::ibv_wc>; 32] = [std::mem::MaybeUninit::uninit(); 32];
        let want = max.min(wcs.len()) as i32;
        // SAFETY: the CQ is live (held by self); `wcs` has room for `want` entries, of which
        // the first `n` are initialised by ibv_poll_cq.
        let n = unsafe { sys::ibv_poll_cq(self.cq.cq().as_ptr(), want, wcs.as_mut_ptr() as *mut sys::ibv_wc) };
        if n < 0 {
            return Err(VerbsError::failed("poll_cq", std::io::Error::from_raw_os_error(-n)));
        }
        for wc in &wcs[..n as usize] {
            // SAFETY: initialised by ibv_poll_cq (see above).
            let wc = unsafe { wc.assume_init() };
            let st = status(wc.status);
            let with_imm = wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            out.push(Completion {
                wr_id: wc.wr_id,
                qpn: wc.qp_num,
                status: st,
                kind: kind(wc.opcode),
                // SAFETY: the union holds the immediate when IBV_WC_WITH_IMM is set.
                imm: with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
            });
        }
        Ok(n as usize)
    }

    fn arm(&self) -> VerbsResult<()> {
        // SAFETY: the CQ is live; arming it for the next completion has no memory effects.
        let rc = unsafe { sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc != 0 {
            return Err(VerbsError::failed(
                "req_notify_cq",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> VerbsResult<()> {
        // The caller armed the CQ and polled once more since, so a completion that raced the
        // arming is not slept through; block until the channel or the wake eventfd is readable.
        let mut fds = [
            libc::pollfd {
                fd: self.channel.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd structures.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout.as_millis().min(i32::MAX as u128) as i32) };
        if rc < 0 {
            return Ok(()); // EINTR: the caller polls and waits again
        }
        if fds[0].revents != 0 {
            let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; on success the event belongs to our
            // CQ (the only one on this channel) and is acknowledged right away.
            unsafe {
                if sys::ibv_get_cq_event(self.channel.comp_channel().as_ptr(), &mut cq, &mut ctx) == 0 {
                    sys::ibv_ack_cq_events(cq, 1);
                }
            }
        }
        if fds[1].revents != 0 {
            let mut b = [0u8; 8];
            // SAFETY: reads 8 bytes into a local buffer from our eventfd.
            unsafe { libc::read(self.wake.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
        }
        Ok(())
    }

    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a local buffer to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl std::fmt::Debug for RealCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RealCq({})", self.name)
    }
}

struct RealQp {
    qp: Mutex<BasicQueuePair>,
    qpn: u32,
    port: u8,
    gid_index: u8,
    /// Every packet carries a GRH (RoCE, or a port that requires one).
    grh: bool,
    traffic_class: u8,
}

impl RealQp {
    fn modify(&self, attr: &QueuePairAttribute, step: &'static str) -> VerbsResult<()> {
        self.qp
            .lock()
            .expect("queue pair")
            .modify(attr)
            .map_err(|e| VerbsError::failed(step, e))
    }
}

impl VerbsQp for RealQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn connect(&self, local_psn: u32, remote: &Endpoint, path: &Path) -> VerbsResult<()> {
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(self.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead);
        self.modify(&init, "modify_qp to INIT")?;

        let mut ah = AddressHandleAttribute::new();
        ah.setup_port(self.port).setup_dest_lid(remote.lid);
        if self.grh || remote.lid == 0 {
            ah.setup_grh(&Gid { raw: remote.gid }, 0, self.gid_index, 64, self.traffic_class);
        }
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            // Checked to be a valid code when the peer's hello was parsed.
            .setup_path_mtu(path.mtu.into())
            .setup_dest_qp_num(remote.qpn)
            .setup_rq_psn(remote.psn)
            .setup_max_dest_read_atomic(path.rd_responder)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&ah);
        self.modify(&rtr, "modify_qp to RTR")?;

        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(local_psn)
            .setup_timeout(14)
            .setup_retry_cnt(7)
            // Receiver-not-ready is retried for ever: the transport's credits make it rare,
            // never fatal.
            .setup_rnr_retry(7)
            .setup_max_read_atomic(path.rd_initiator);
        self.modify(&rts, "modify_qp to RTS")
    }

    fn set_error(&self) -> VerbsResult<()> {
        let mut err = QueuePairAttribute::new();
        err.setup_state(QueuePairState::Error);
        self.modify(&err, "modify_qp to ERR")
    }

    unsafe fn post_send(&self, wr: &SendWr) -> VerbsResult<()> {
        let mut qp = self.qp.lock().expect("queue pair");
        let mut guard = qp.start_post_send();
        let handle = guard.construct_wr(wr.wr_id, WorkRequestFlags::Signaled);
        let buf = match wr.op {
            SendOp::WriteImm { remote_addr, rkey, imm } => handle.setup_write_imm(rkey, remote_addr, imm.to_be()),
            SendOp::SendImm { imm } => handle.setup_send_imm(imm.to_be()),
            SendOp::Read { remote_addr, rkey } => handle.setup_read(rkey, remote_addr),
        };
        if let Some(s) = wr.local {
            // SAFETY: forwarded contract of VerbsQp::post_send: the buffer is registered under
            // `lkey` and stays valid until the completion is polled.
            unsafe { buf.setup_sge(s.lkey, s.addr, s.len) };
        }
        guard.post().map_err(|e| match e {
            sideway::ibverbs::queue_pair::PostSendError::NotEnoughResources(_) => VerbsError::QueueFull {
                op: "post_send",
                depth: 0,
            },
            other => VerbsError::failed("post_send", other),
        })
    }

    fn post_recv(&self, wr_id: u64) -> VerbsResult<()> {
        let mut qp = self.qp.lock().expect("queue pair");
        let mut guard = qp.start_post_recv();
        let _ = guard.construct_wr(wr_id);
        guard.post().map_err(|e| VerbsError::failed("post_recv", e))
    }
}
