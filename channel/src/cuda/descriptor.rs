//! What a CUDA channel says about one of its devices during negotiation, and when two such
//! descriptions can be connected: pure functions, so every answer (same GPU or not, peer access
//! granted one way, both ways or not at all) is tested without a GPU.
//!
//! A GPU descriptor names the host (boot id plus the IPC and PID namespaces: CUDA IPC needs
//! both processes to share them), the process (a random token: pids repeat across
//! namespaces), the GPU by UUID, and the UUIDs of the GPUs it can access directly.
//!
//! - **cuda_ipc**: the same GPU on the same host, in another process (IPC handles) or in this
//!   one (plain addresses).
//! - **cuda_p2p**: two different GPUs on the same host, each able to access the other.
//! - **cuda_staged**: any pair where at least one side is a GPU; the bytes cross hosts through
//!   the pipe's connection, so nothing else needs to match.

use std::fmt::Write as _;

/// One GPU as a CUDA channel describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDescriptor {
    /// Boot id and namespaces (`sluice_transport::host::identity`).
    pub host: String,
    /// A random token naming the process.
    pub process: u64,
    /// `GPU-...` UUID.
    pub gpu: String,
    /// UUIDs of the GPUs this one can access directly.
    pub peers: Vec<String>,
}

impl GpuDescriptor {
    /// The text form: `gpu=UUID|proc=HEX|peers=UUID,UUID|host=...` (host last: it may hold
    /// anything).
    pub fn encode(&self) -> String {
        let mut s = format!("gpu={}|proc={:x}|peers=", self.gpu, self.process);
        for (i, p) in self.peers.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            s.push_str(p);
        }
        let _ = write!(s, "|host={}", self.host);
        s
    }

    /// Parses [`encode`](Self::encode)'s form; `None` for anything else (a peer's descriptor
    /// that does not parse is simply not compatible).
    pub fn parse(s: &str) -> Option<GpuDescriptor> {
        let mut parts = s.splitn(4, '|');
        let gpu = parts.next()?.strip_prefix("gpu=")?;
        let process = u64::from_str_radix(parts.next()?.strip_prefix("proc=")?, 16).ok()?;
        let peers = parts.next()?.strip_prefix("peers=")?;
        let host = parts.next()?.strip_prefix("host=")?;
        if gpu.is_empty() || host.is_empty() {
            return None;
        }
        Some(GpuDescriptor {
            host: host.to_owned(),
            process,
            gpu: gpu.to_owned(),
            peers: peers.split(',').filter(|p| !p.is_empty()).map(str::to_owned).collect(),
        })
    }

    pub fn same_process(&self, other: &GpuDescriptor) -> bool {
        self.host == other.host && self.process == other.process
    }
}

/// cuda_ipc: the same GPU, the same host.
pub fn ipc_compatible(local: &str, remote: &str) -> bool {
    match (GpuDescriptor::parse(local), GpuDescriptor::parse(remote)) {
        (Some(a), Some(b)) => a.host == b.host && a.gpu == b.gpu,
        _ => false,
    }
}

/// cuda_p2p: two different GPUs of the same host, each allowed to access the other.
pub fn p2p_compatible(local: &str, remote: &str) -> bool {
    match (GpuDescriptor::parse(local), GpuDescriptor::parse(remote)) {
        (Some(a), Some(b)) => {
            a.host == b.host && a.gpu != b.gpu && a.peers.contains(&b.gpu) && b.peers.contains(&a.gpu)
        }
        _ => false,
    }
}

/// The cuda_staged descriptor of a CPU.
pub const STAGED_CPU: &str = "staged;cpu";
/// The cuda_staged descriptor of a GPU.
pub const STAGED_GPU: &str = "staged;gpu";

/// cuda_staged: any pair with a GPU on at least one side.
pub fn staged_compatible(local: &str, remote: &str) -> bool {
    let known = |d: &str| d == STAGED_CPU || d == STAGED_GPU;
    known(local) && known(remote) && (local == STAGED_GPU || remote == STAGED_GPU)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(host: &str, process: u64, uuid: &str, peers: &[&str]) -> String {
        GpuDescriptor {
            host: host.into(),
            process,
            gpu: uuid.into(),
            peers: peers.iter().map(|p| p.to_string()).collect(),
        }
        .encode()
    }

    #[test]
    fn descriptors_round_trip_and_junk_is_refused() {
        let d = GpuDescriptor {
            host: "boot=abc;ipc=1;pid=2".into(),
            process: 0xfeed,
            gpu: "GPU-1".into(),
            peers: vec!["GPU-2".into(), "GPU-3".into()],
        };
        assert_eq!(GpuDescriptor::parse(&d.encode()), Some(d.clone()));
        let lonely = GpuDescriptor { peers: vec![], ..d };
        assert_eq!(GpuDescriptor::parse(&lonely.encode()), Some(lonely));
        for junk in [
            "",
            "gpu=",
            "gpu=x|proc=zz|peers=|host=h",
            "gpu=x|proc=1|peers=",
            "staged;gpu",
        ] {
            assert_eq!(GpuDescriptor::parse(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn ipc_needs_the_same_gpu_on_the_same_host() {
        let a = gpu("h", 1, "GPU-A", &[]);
        assert!(ipc_compatible(&a, &gpu("h", 2, "GPU-A", &[])));
        assert!(ipc_compatible(&a, &gpu("h", 1, "GPU-A", &[])), "same process too");
        assert!(!ipc_compatible(&a, &gpu("h", 2, "GPU-B", &[])), "other GPU");
        assert!(
            !ipc_compatible(&a, &gpu("h2", 2, "GPU-A", &[])),
            "other host (or namespace)"
        );
        assert!(!ipc_compatible(&a, "garbage"));
    }

    #[test]
    fn p2p_needs_peer_access_both_ways() {
        let a = gpu("h", 1, "GPU-A", &["GPU-B"]);
        assert!(
            p2p_compatible(&a, &gpu("h", 2, "GPU-B", &["GPU-A"])),
            "granted both ways"
        );
        assert!(!p2p_compatible(&a, &gpu("h", 2, "GPU-B", &[])), "one way only");
        assert!(
            !p2p_compatible(&gpu("h", 1, "GPU-A", &[]), &gpu("h", 2, "GPU-B", &["GPU-A"])),
            "the other way only"
        );
        assert!(
            !p2p_compatible(&gpu("h", 1, "GPU-A", &[]), &gpu("h", 2, "GPU-B", &[])),
            "refused"
        );
        assert!(
            !p2p_compatible(&a, &gpu("h", 2, "GPU-A", &["GPU-B"])),
            "same GPU is ipc's"
        );
        assert!(!p2p_compatible(&a, &gpu("h2", 2, "GPU-B", &["GPU-A"])), "other host");
    }

    #[test]
    fn staged_serves_any_pair_with_a_gpu() {
        assert!(staged_compatible(STAGED_GPU, STAGED_GPU));
        assert!(staged_compatible(STAGED_GPU, STAGED_CPU));
        assert!(staged_compatible(STAGED_CPU, STAGED_GPU));
        assert!(
            !staged_compatible(STAGED_CPU, STAGED_CPU),
            "CPU pairs belong to CPU channels"
        );
        assert!(!staged_compatible(STAGED_GPU, "staged;tpu"));
    }
}
