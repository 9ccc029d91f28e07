//! Agent options, and the environment variables that fill the gaps, so jobs start the way
//! their launcher starts them:
//!
//! - torchrun: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`;
//! - Slurm (`srun`): `SLURM_PROCID`, `SLURM_NTASKS`;
//! - Open MPI / MPICH / Intel MPI (`mpirun`): `OMPI_COMM_WORLD_RANK`/`_SIZE`, `PMI_RANK`/`PMI_SIZE`,
//!   `PMIX_RANK`;
//! - `SLUICE_STORE`: a store URL (`tcp://host:port` or `etcd://host:port/prefix`), which wins
//!   over `MASTER_ADDR`/`MASTER_PORT`.
//!
//! Under Slurm or MPI, `MASTER_ADDR` must still name the store's host (or `SLUICE_STORE` the
//! store); the launcher gives ranks, not a rendezvous.

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_channel::{ContextOptions, Device, Secret};

use crate::device_map::DeviceMap;
use crate::error::InitError;
use crate::store::StoreUrl;

/// When pipes to peers are opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connect {
    /// On the first call to each peer (the default: a worker pays only for the peers it talks
    /// to).
    Lazy,
    /// To every peer during init, so the first call pays no setup.
    Eager,
}

/// Test hooks that simulate lost messages.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Drop this many outgoing control messages (fork request, child accept, delete) before
    /// sending any, as if the network lost them; their senders must retry.
    pub drop_control: usize,
    /// Send every control message twice (idempotency).
    pub duplicate_control: bool,
}

#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// This worker's name (required; unique in the group).
    pub name: String,
    /// This worker's rank; `None` reads `RANK`.
    pub rank: Option<u32>,
    /// Size of the group; `None` reads `WORLD_SIZE`.
    pub world_size: Option<u32>,
    /// Store URL: `host:port` or `tcp://host:port` (the embedded store), or
    /// `etcd://host:port/prefix`. `None` reads `SLUICE_STORE`, then `MASTER_ADDR`/`MASTER_PORT`.
    pub store_addr: Option<String>,
    /// Join a running group instead of forming a fixed one: no rank or world size, an id
    /// handed out by the store, and no waiting for anyone.
    pub elastic: bool,
    /// A pipe with no reply for this long gets a heartbeat (zero: no heartbeats).
    pub heartbeat_interval: Duration,
    /// A peer silent for this many intervals is declared lost.
    pub heartbeat_misses: u32,
    /// Where this worker serves the embedded store if it takes it over from a leaving host
    /// (port 0 picks one). `None`: the host of `listen`.
    pub store_listen: Option<String>,
    /// The rank that serves the store.
    pub store_rank: u32,
    /// Where this worker listens for pipes (`host:port`, port 0 picks one). The host is what
    /// peers connect to, so use a routable address for multi-host groups.
    pub listen: String,
    /// Threads running synchronous handlers (more start while handlers block in nested calls).
    pub pool_threads: usize,
    /// Runtime threads driving pipes and async handlers.
    pub io_threads: usize,
    /// Timeout of calls that do not give one; zero means none.
    pub default_timeout: Duration,
    /// How long init waits for the whole group.
    pub init_timeout: Duration,
    /// Devices this worker offers; `None` means the ones found here (the CPU and every GPU CUDA
    /// can use). Offering one that is not here fails init (`InitError::DeviceNotPresent`).
    pub devices: Option<Vec<Device>>,
    /// Destination worker name → map from local to remote device.
    pub device_maps: BTreeMap<String, DeviceMap>,
    pub connect: Connect,
    /// Fail shutdown when RRefs are still held (off by default, as in PyTorch).
    pub leak_check: bool,
    /// How long a control message waits for its acknowledgement before it is sent again.
    pub control_retry: Duration,
    /// A shared secret that every pipe and store connection must prove (HMAC challenge–response)
    /// before anything else is accepted. `None` reads `SLUICE_SECRET` or `SLUICE_SECRET_FILE`.
    pub secret: Option<Secret>,
    /// Largest message (payloads and tensors together) accepted from a peer; a larger one
    /// closes that peer's pipe.
    pub max_message_bytes: u64,
    /// Bytes of requests from one peer that may be in memory at once (received, not yet
    /// answered); beyond it this worker stops reading that peer's pipe until replies go out.
    pub max_in_flight_bytes: u64,
    /// Transports and channels for pipes (the name is set from `name`).
    pub pipe: ContextOptions,
    pub faults: Faults,
}

impl AgentOptions {
    pub fn new(name: impl Into<String>) -> AgentOptions {
        AgentOptions {
            name: name.into(),
            rank: None,
            world_size: None,
            store_addr: None,
            store_rank: 0,
            elastic: false,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_misses: 5,
            store_listen: None,
            listen: "127.0.0.1:0".into(),
            pool_threads: 4,
            io_threads: 2,
            default_timeout: Duration::from_secs(60),
            init_timeout: Duration::from_secs(60),
            devices: None,
            device_maps: BTreeMap::new(),
            connect: Connect::Lazy,
            leak_check: false,
            control_retry: Duration::from_millis(500),
            secret: None,
            max_message_bytes: 4 << 30,
            max_in_flight_bytes: 8 << 30,
            pipe: ContextOptions::default(),
            faults: Faults::default(),
        }
    }

    /// Options named from the environment: `SLUICE_WORKER_NAME` (set by `sluice launch`), else
    /// `worker<RANK>` with the rank from any launcher's variables.
    pub fn from_env() -> Result<AgentOptions, InitError> {
        if let Ok(name) = std::env::var("SLUICE_WORKER_NAME") {
            return Ok(AgentOptions::new(name));
        }
        let rank = env_first(RANK_VARS)?.ok_or(InitError::Missing {
            what: "the worker name",
            env: "SLUICE_WORKER_NAME (or RANK)",
        })?;
        Ok(AgentOptions::new(format!("worker{rank}")))
    }

    pub fn rank(mut self, rank: u32, world_size: u32) -> Self {
        self.rank = Some(rank);
        self.world_size = Some(world_size);
        self
    }

    /// The store's address (`host:port`, or a URL such as `etcd://…`). Port 0 is for a group of
    /// one: the worker serves its store on any free port (its address is then
    /// [`Agent::store_address`](crate::Agent::store_address)); anything else with port 0 is a
    /// configuration error.
    pub fn store(mut self, addr: impl Into<String>) -> Self {
        self.store_addr = Some(addr.into());
        self
    }

    /// Joins a running group through the store at `url` (see [`AgentOptions::elastic`]).
    pub fn join(mut self, url: impl Into<String>) -> Self {
        self.store_addr = Some(url.into());
        self.elastic = true;
        self
    }

    /// Adds `local → remote` to the device map for `peer`.
    pub fn map_device(mut self, peer: &str, local: Device, remote: Device) -> Self {
        self.device_maps
            .entry(peer.to_owned())
            .or_default()
            .insert(local, remote);
        self
    }
}

/// Options with every gap filled.
pub(crate) struct Resolved {
    pub secret: Option<Secret>,
    /// `None` for an elastic join.
    pub rank: Option<u32>,
    pub world_size: u32,
    pub store: StoreUrl,
}

fn env_number(var: &'static str) -> Result<Option<u32>, InitError> {
    match std::env::var(var) {
        Ok(v) => v.trim().parse().map(Some).map_err(|e| InitError::BadEnv {
            var,
            value: v,
            why: format!("{e}"),
        }),
        Err(_) => Ok(None),
    }
}

/// The first of `vars` that is set.
fn env_first(vars: &[&'static str]) -> Result<Option<u32>, InitError> {
    for v in vars {
        if let Some(n) = env_number(v)? {
            return Ok(Some(n));
        }
    }
    Ok(None)
}

/// Rank variables, in the order they are read: torchrun, Slurm, Open MPI, PMI (MPICH, Intel
/// MPI), PMIx.
pub const RANK_VARS: &[&str] = &["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"];
/// World-size variables, likewise.
pub const WORLD_VARS: &[&str] = &["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];

pub(crate) fn resolve(o: &AgentOptions) -> Result<Resolved, InitError> {
    let store = resolve_store(o)?;
    let secret = match &o.secret {
        Some(s) => Some(s.clone()),
        None => Secret::from_env().map_err(|e| InitError::BadEnv {
            var: "SLUICE_SECRET_FILE",
            value: std::env::var("SLUICE_SECRET_FILE").unwrap_or_default(),
            why: e.to_string(),
        })?,
    };
    if o.max_message_bytes == 0 || o.max_in_flight_bytes < o.max_message_bytes {
        return Err(InitError::Config(
            "max_in_flight_bytes must be at least max_message_bytes, which must be positive".into(),
        ));
    }
    if o.pool_threads == 0 || o.io_threads == 0 {
        return Err(InitError::Config(
            "pool_threads and io_threads must be at least 1".into(),
        ));
    }
    if o.heartbeat_interval > Duration::ZERO && o.heartbeat_misses == 0 {
        return Err(InitError::Config("heartbeat_misses must be at least 1".into()));
    }
    if o.elastic {
        return Ok(Resolved {
            secret,
            rank: None,
            world_size: 0,
            store,
        });
    }
    let rank = match o.rank {
        Some(r) => r,
        None => env_first(RANK_VARS)?.ok_or(InitError::Missing {
            what: "the rank",
            env: "RANK",
        })?,
    };
    let world_size = match o.world_size {
        Some(w) => w,
        None => env_first(WORLD_VARS)?.ok_or(InitError::Missing {
            what: "the world size",
            env: "WORLD_SIZE",
        })?,
    };
    if world_size == 0 || rank >= world_size {
        return Err(InitError::BadRank { rank, world_size });
    }
    if world_size > crate::membership::ELASTIC_BASE {
        return Err(InitError::Config(format!(
            "a fixed group has at most {} ranks; use elastic joins beyond that",
            crate::membership::ELASTIC_BASE
        )));
    }
    if o.store_rank >= world_size {
        return Err(InitError::Config(format!(
            "store rank {} is outside a world of {world_size}",
            o.store_rank
        )));
    }
    Ok(Resolved {
        secret,
        rank: Some(rank),
        world_size,
        store,
    })
}

fn resolve_store(o: &AgentOptions) -> Result<StoreUrl, InitError> {
    let url = match (&o.store_addr, std::env::var("SLUICE_STORE")) {
        (Some(a), _) => a.clone(),
        (None, Ok(u)) => u,
        (None, Err(_)) => {
            let host = std::env::var("MASTER_ADDR").map_err(|_| InitError::Missing {
                what: "the store address",
                env: "MASTER_ADDR (or SLUICE_STORE)",
            })?;
            let port = env_number("MASTER_PORT")?.ok_or(InitError::Missing {
                what: "the store port",
                env: "MASTER_PORT",
            })?;
            if port > u16::MAX as u32 {
                return Err(InitError::BadEnv {
                    var: "MASTER_PORT",
                    value: port.to_string(),
                    why: "not a port number".into(),
                });
            }
            if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            }
        }
    };
    StoreUrl::parse(&url).map_err(|e| InitError::Store(e.to_string()))
}

/// The port of a `host:port` address (IPv6 hosts in brackets), if it has a numeric one.
pub(crate) fn port_of(addr: &str) -> Option<u16> {
    addr.rsplit_once(':').and_then(|(_, port)| port.parse().ok())
}

#[cfg(test)]
mod port_tests {
    use super::port_of;

    #[test]
    fn ports_are_parsed_as_numbers() {
        assert_eq!(port_of("127.0.0.1:0"), Some(0));
        assert_eq!(port_of("host:00"), Some(0));
        assert_eq!(port_of("[::1]:29500"), Some(29500));
        assert_eq!(port_of("host"), None);
        assert_eq!(port_of("host:x"), None);
    }
}
