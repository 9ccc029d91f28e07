//! Agent options, and the environment variables that fill the gaps (`MASTER_ADDR`,
//! `MASTER_PORT`, `RANK`, `WORLD_SIZE`), so jobs start the way torchrun starts them.

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_channel::{ContextOptions, Device};

use crate::device_map::DeviceMap;
use crate::error::InitError;

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
    /// Store address `host:port`; `None` builds it from `MASTER_ADDR` and `MASTER_PORT`.
    pub store_addr: Option<String>,
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
    /// Devices this worker offers; `None` means the ones found here (the CPU, plus GPUs once the
    /// CUDA channels exist).
    pub devices: Option<Vec<Device>>,
    /// Destination worker name → map from local to remote device.
    pub device_maps: BTreeMap<String, DeviceMap>,
    pub connect: Connect,
    /// Fail shutdown when RRefs are still held (off by default, as in PyTorch).
    pub leak_check: bool,
    /// How long a control message waits for its acknowledgement before it is sent again.
    pub control_retry: Duration,
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
            pipe: ContextOptions::default(),
            faults: Faults::default(),
        }
    }

    pub fn rank(mut self, rank: u32, world_size: u32) -> Self {
        self.rank = Some(rank);
        self.world_size = Some(world_size);
        self
    }

    pub fn store(mut self, addr: impl Into<String>) -> Self {
        self.store_addr = Some(addr.into());
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
    pub rank: u32,
    pub world_size: u32,
    pub store_addr: String,
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

pub(crate) fn resolve(o: &AgentOptions) -> Result<Resolved, InitError> {
    let rank = match o.rank {
        Some(r) => r,
        None => env_number("RANK")?.ok_or(InitError::Missing {
            what: "the rank",
            env: "RANK",
        })?,
    };
    let world_size = match o.world_size {
        Some(w) => w,
        None => env_number("WORLD_SIZE")?.ok_or(InitError::Missing {
            what: "the world size",
            env: "WORLD_SIZE",
        })?,
    };
    if world_size == 0 || rank >= world_size {
        return Err(InitError::BadRank { rank, world_size });
    }
    if o.store_rank >= world_size {
        return Err(InitError::Config(format!(
            "store rank {} is outside a world of {world_size}",
            o.store_rank
        )));
    }
    let store_addr = match &o.store_addr {
        Some(a) => a.clone(),
        None => {
            let host = std::env::var("MASTER_ADDR").map_err(|_| InitError::Missing {
                what: "the store address",
                env: "MASTER_ADDR",
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
    if o.pool_threads == 0 || o.io_threads == 0 {
        return Err(InitError::Config(
            "pool_threads and io_threads must be at least 1".into(),
        ));
    }
    Ok(Resolved {
        rank,
        world_size,
        store_addr,
    })
}
