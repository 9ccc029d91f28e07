//! Raw verbs baselines for `sluice bench ibverbs`: what the device (real or model) does with no
//! transport around it, measured in the same run as the transport so results are ratios.
//!
//! - [`ping_pong`]: two queue pairs on one device bounce an RDMA write-with-immediate of `size`
//!   bytes, each side busy-polling its own completion queue (the `ib_write_lat` pattern).
//! - [`write_bandwidth`]: one queue pair streams RDMA writes of `size` bytes, keeping the send
//!   queue full (the `ib_write_bw` pattern).
#![allow(unsafe_code)]

use std::time::{Duration, Instant};

use super::region::Region;
use super::verbs::*;

/// Two connected queue pairs with a registered buffer each.
/// Field order is drop order: queue pairs, registrations, completion queues, memory.
struct Loop {
    qps: [Box<dyn VerbsQp>; 2],
    mrs: [Box<dyn VerbsMr>; 2],
    cqs: [Box<dyn VerbsCq>; 2],
    _mem: [Region; 2],
}

impl Loop {
    fn new(dev: &dyn VerbsDevice, size: usize, depth: u32) -> VerbsResult<Loop> {
        let mem = [
            Region::new(size).map_err(|e| VerbsError::failed("alloc", e))?,
            Region::new(size).map_err(|e| VerbsError::failed("alloc", e))?,
        ];
        let caps = QpCaps {
            send_depth: depth,
            recv_depth: depth,
        };
        let cqs = [dev.create_cq(depth * 2)?, dev.create_cq(depth * 2)?];
        let qps = [
            dev.create_qp(cqs[0].as_ref(), caps)?,
            dev.create_qp(cqs[1].as_ref(), caps)?,
        ];
        // SAFETY: each region outlives its registration (field order in `Loop`, and `finish`
        // drains every request before anything drops).
        let mrs = unsafe {
            [
                dev.register(mem[0].ptr(), size.max(1), Access::REMOTE_WRITE)?,
                dev.register(mem[1].ptr(), size.max(1), Access::REMOTE_WRITE)?,
            ]
        };
        let (lid, gid) = dev.address();
        let limits = dev.limits();
        for (i, j) in [(0, 1), (1, 0)] {
            let remote = Endpoint {
                lid,
                gid,
                qpn: qps[j].qpn(),
                psn: 0,
                mtu: limits.active_mtu,
                rd_responder: limits.max_rd_responder,
            };
            qps[i].connect(0, &remote, &Path::negotiate(&limits, &remote))?;
        }
        for qp in &qps {
            for k in 0..depth {
                qp.post_recv(k as u64)?;
            }
        }
        Ok(Loop {
            cqs,
            qps,
            mrs,
            _mem: mem,
        })
    }

    fn write(&self, from: usize, size: usize, wr_id: u64) -> VerbsResult<()> {
        let to = 1 - from;
        let (src, dst) = (self.mrs[from].info(), self.mrs[to].info());
        let wr = SendWr {
            wr_id,
            op: SendOp::WriteImm {
                remote_addr: dst.addr,
                rkey: dst.rkey,
                imm: size as u32,
            },
            local: (size > 0).then_some(Sge {
                addr: src.addr,
                len: size as u32,
                lkey: src.lkey,
            }),
        };
        // SAFETY: the range lies in `from`'s registration, alive until `finish`.
        unsafe { self.qps[from].post_send(&wr) }
    }

    /// Busy-polls side `i` until `recvs` receive and `sends` send completions arrived
    /// (reposting receives as they come).
    fn drain(&self, i: usize, mut recvs: u32, mut sends: u32, buf: &mut Vec<Completion>) -> VerbsResult<()> {
        while recvs > 0 || sends > 0 {
            buf.clear();
            // Never more than asked for: a later wait counts the rest.
            self.cqs[i].poll(buf, (recvs + sends) as usize)?;
            for c in buf.iter() {
                if c.status != WcStatus::Success {
                    return Err(VerbsError::failed("baseline", format!("{:?}", c.status)));
                }
                if matches!(c.kind, WcKind::Recv | WcKind::RecvWriteImm) {
                    self.qps[i].post_recv(c.wr_id)?;
                    recvs = recvs.saturating_sub(1);
                } else {
                    sends = sends.saturating_sub(1);
                }
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Moves both queue pairs to error and polls every flushed completion.
    fn finish(self) {
        for qp in &self.qps {
            let _ = qp.set_error();
        }
        let mut buf = Vec::new();
        let start = Instant::now();
        // Each side has `depth` receives posted, plus whatever sends were outstanding: poll
        // until quiet for a moment.
        let mut quiet = Instant::now();
        while quiet.elapsed() < Duration::from_millis(20) && start.elapsed() < Duration::from_secs(5) {
            for cq in &self.cqs {
                buf.clear();
                if cq.poll(&mut buf, 64).unwrap_or(0) > 0 {
                    quiet = Instant::now();
                }
            }
        }
    }
}

/// Round trips of a `size`-byte write-with-immediate between two queue pairs of `dev`, for
/// about `budget`. Returns the round-trip times in nanoseconds.
pub fn ping_pong(dev: &dyn VerbsDevice, size: usize, budget: Duration) -> VerbsResult<Vec<f64>> {
    let depth = 16;
    let l = Loop::new(dev, size, depth)?;
    let mut buf = Vec::with_capacity(4);
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 100 {
        let t = Instant::now();
        l.write(0, size, 1)?;
        l.drain(1, 1, 0, &mut buf)?;
        l.write(1, size, 2)?;
        // The echo, and our own write's completion (so the send queues never fill).
        l.drain(0, 1, 1, &mut buf)?;
        l.drain(1, 0, 1, &mut buf)?;
        samples.push(t.elapsed().as_nanos() as f64);
        if samples.len() >= 1_000_000 {
            break;
        }
    }
    l.finish();
    Ok(samples)
}

/// One-way bandwidth in bytes per second of back-to-back `size`-byte writes with the send queue
/// kept full, over about `budget`.
pub fn write_bandwidth(dev: &dyn VerbsDevice, size: usize, budget: Duration) -> VerbsResult<(f64, u64)> {
    let depth = 64;
    let l = Loop::new(dev, size, depth)?;
    let mut buf = Vec::with_capacity(64);
    let mut outstanding = 0u32;
    let mut done = 0u64;
    let start = Instant::now();
    loop {
        while outstanding < depth / 2 {
            l.write(0, size, done)?;
            outstanding += 1;
        }
        l.drain(0, 0, 1, &mut buf)?;
        outstanding -= 1;
        done += 1;
        // The receiver's completions: reposted as they come.
        buf.clear();
        while l.cqs[1].poll(&mut buf, 64)? > 0 {
            for c in buf.drain(..) {
                l.qps[1].post_recv(c.wr_id)?;
            }
        }
        if start.elapsed() >= budget && done >= 8 {
            break;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    l.drain(0, 0, outstanding, &mut buf)?;
    l.finish();
    Ok((done as f64 * size as f64 / secs, done))
}
