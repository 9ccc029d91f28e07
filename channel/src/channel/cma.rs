//! Cross-memory attach: the receiver reads the tensor straight out of the sender's address
//! space with `process_vm_readv`.
//!
//! Requirements, checked when the context is created: the kernel call exists and is not blocked
//! (a self-test read of our own memory; some container seccomp profiles forbid it), and Yama's
//! `ptrace_scope` allows it (scope 1 is relaxed with `PR_SET_PTRACER_ANY`; scopes 2 and 3
//! make the channel not viable). The descriptor holds the boot id, the PID and user namespaces
//! and the uid/gid, so only processes that can read each other compare equal. Because
//! permission ultimately depends on the actual peer, pipe setup also reads a probe in the
//! peer's memory before CMA is chosen.

use std::io;

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;

use super::{ChannelContext, ChannelKind};
use crate::device::Device;

/// Bytes the peer reads from us to prove it may.
static PROBE: [u8; 16] = *b"sluice-cma-probe";

/// The address of this process's probe, for the brochure.
pub fn probe_address() -> u64 {
    PROBE.as_ptr() as u64
}

/// Largest piece read in one system call.
const MAX_PIECE: usize = 1 << 30;

/// Copies `dst.len()` bytes from `address` in process `pid` into `dst`.
pub fn read_remote(pid: i32, address: u64, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let len = (dst.len() - done).min(MAX_PIECE);
        let remote = [RemoteIoVec {
            base: (address as usize).wrapping_add(done),
            len,
        }];
        let mut local = [io::IoSliceMut::new(&mut dst[done..done + len])];
        let n = process_vm_readv(Pid::from_raw(pid), &mut local, &remote)
            .map_err(|e| io::Error::from_raw_os_error(e as i32))?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv read nothing",
            ));
        }
        done += n;
    }
    Ok(())
}

/// Whether this process may read process `pid`'s probe at `address`.
pub fn probe_peer(pid: i32, address: u64) -> Result<(), String> {
    let mut got = [0u8; 16];
    read_remote(pid, address, &mut got).map_err(|e| format!("cannot read process {pid}'s memory: {e}"))?;
    if got != PROBE {
        return Err(format!("process {pid}'s probe holds unexpected bytes"));
    }
    Ok(())
}

fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The CMA channel's context.
pub struct CmaContext {
    descriptor: Result<String, String>,
}

impl CmaContext {
    pub fn new() -> Self {
        CmaContext {
            descriptor: Self::probe(),
        }
    }

    fn probe() -> Result<String, String> {
        match ptrace_scope() {
            None | Some(0) => {}
            Some(1) => crate::sys::allow_any_ptracer()
                .map_err(|e| format!("Yama ptrace_scope is 1 and PR_SET_PTRACER failed: {e}"))?,
            Some(n) => {
                return Err(format!(
                    "Yama ptrace_scope is {n}: processes may not read each other's memory"
                ))
            }
        }
        probe_peer(std::process::id() as i32, probe_address())
            .map_err(|e| format!("self-test failed ({e}); is process_vm_readv blocked by seccomp?"))?;
        let identity =
            sluice_transport::host::identity(&["pid", "user"]).ok_or("cannot read the boot id or namespaces")?;
        Ok(format!(
            "cma;{identity};uid={};gid={}",
            nix::unistd::getuid(),
            nix::unistd::getgid()
        ))
    }
}

impl Default for CmaContext {
    fn default() -> Self {
        Self::new()
    }
}

impl ChannelContext for CmaContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Cma
    }

    fn viability(&self) -> Result<(), String> {
        self.descriptor.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        match &self.descriptor {
            Ok(d) => vec![(Device::Cpu, d.clone())],
            Err(_) => Vec::new(),
        }
    }
}
