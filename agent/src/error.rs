//! The agent's errors. Every error about a peer names it; every error is `Clone`, because a
//! call's result can be awaited many times.

use std::time::Duration;

use sluice_channel::{Device, PipeError};

use crate::name::NameError;

/// What a handler returns when it fails: a kind (a short class name, e.g. `ValueError`) and a
/// message. Both reach the caller unchanged.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct HandlerError {
    pub kind: String,
    pub message: String,
}

impl HandlerError {
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        HandlerError {
            kind: kind.into(),
            message: message.into(),
        }
    }
}

impl From<String> for HandlerError {
    fn from(message: String) -> Self {
        HandlerError::new("Error", message)
    }
}

impl From<&str> for HandlerError {
    fn from(message: &str) -> Self {
        HandlerError::new("Error", message)
    }
}

impl From<RpcError> for HandlerError {
    /// A failed nested call inside a handler: the kind names the RPC error.
    fn from(e: RpcError) -> Self {
        match e {
            RpcError::Remote { kind, message, worker } => HandlerError::new(kind, format!("{message} (on {worker})")),
            other => HandlerError::new("RpcError", other.to_string()),
        }
    }
}

/// Why a call, a remote or an RRef operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    #[error("the RPC agent has shut down")]
    Shutdown,
    #[error("no worker {dest} in this group of {world_size}")]
    UnknownWorker { dest: String, world_size: u32 },
    #[error("worker {worker} has no handler named `{handler}`")]
    UnknownHandler { worker: String, handler: String },
    /// The handler ran and failed; `kind` and `message` are what it returned.
    #[error("handler on {worker} failed: {kind}: {message}")]
    Remote {
        worker: String,
        kind: String,
        message: String,
    },
    #[error("call to {worker} timed out after {timeout:?}")]
    Timeout { worker: String, timeout: Duration },
    #[error("peer {worker} is lost: {detail}")]
    PeerLost { worker: String, detail: String },
    #[error("pipe to {worker} failed: {error}")]
    Pipe { worker: String, error: PipeError },
    #[error("could not encode the value: {0}")]
    Encode(String),
    #[error("could not decode a value from {worker}: {detail}")]
    Decode { worker: String, detail: String },
    /// A tensor on `device` was sent to `worker`, but the device map to it does not cover that
    /// device.
    #[error("no device map from {device} to {worker}: add `{device}` to the device map for `{worker}`")]
    MissingDeviceMap { worker: String, device: Device },
    /// `local_value` (or another owner-only operation) on a user reference.
    #[error("{rref} is a user reference on {here}; call local_value() on its owner {owner}")]
    NotOwner { rref: String, here: String, owner: String },
    /// The RRef's value could not be created (the remote call failed or was lost).
    #[error("RRef creation failed: {0}")]
    RRefCreation(Box<RpcError>),
    /// The rendezvous store failed (barriers).
    #[error("rendezvous store: {0}")]
    Store(String),
    /// The callee refused the request as invalid (for example a priority out of range); it
    /// did not run.
    #[error("{worker} rejected the request: {detail}")]
    Rejected { worker: String, detail: String },
    /// The RRef holds a value of another type.
    #[error("{rref} holds a value of another type than {expected}")]
    WrongType { rref: String, expected: &'static str },
}

impl RpcError {
    /// True when the peer is gone (its calls will not complete).
    pub fn is_peer_lost(&self) -> bool {
        matches!(self, RpcError::PeerLost { .. })
    }

    pub(crate) fn from_pipe(worker: &str, error: PipeError) -> RpcError {
        if error.is_peer_lost() {
            RpcError::PeerLost {
                worker: worker.to_owned(),
                detail: error.to_string(),
            }
        } else {
            RpcError::Pipe {
                worker: worker.to_owned(),
                error,
            }
        }
    }
}

/// Why `Agent::init` failed. Each broken rule has its own variant.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InitError {
    #[error("an RPC agent is already running in this process; shut it down before starting another")]
    AlreadyInitialized,
    #[error("invalid worker name: {0}")]
    Name(#[from] NameError),
    #[error("worker name `{name}` is used by both rank {first} and rank {second}; names must be unique")]
    DuplicateName { name: String, first: u32, second: u32 },
    #[error("rank {rank} is out of range for a world of {world_size}")]
    BadRank { rank: u32, world_size: u32 },
    #[error("{what} is not set: give it in the options or set {env}")]
    Missing { what: &'static str, env: &'static str },
    #[error("{var}={value:?} is not valid: {why}")]
    BadEnv {
        var: &'static str,
        value: String,
        why: String,
    },
    #[error("rendezvous store: {0}")]
    Store(String),
    #[error("rendezvous timed out after {timeout:?} waiting for {waiting_for}")]
    Timeout { timeout: Duration, waiting_for: String },
    #[error("the device map of {worker} names peer `{peer}`, which is not in the group")]
    UnknownPeer { worker: String, peer: String },
    #[error("the device map of {worker} to {peer} uses {device}, which {owner} does not have")]
    UnknownDevice {
        worker: String,
        peer: String,
        device: Device,
        owner: String,
    },
    #[error(
        "the device map of {worker} to {peer} maps both {first} and {second} to {target}; maps must be one-to-one"
    )]
    ManyToOne {
        worker: String,
        peer: String,
        first: Device,
        second: Device,
        target: Device,
    },
    #[error("{worker} offers {device}, which is not usable here: {reason}")]
    DeviceNotPresent {
        worker: String,
        device: Device,
        reason: String,
    },
    #[error("pipe setup: {0}")]
    Pipe(#[from] PipeError),
    #[error("invalid option: {0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Why a graceful shutdown failed. The agent is shut down (ungracefully) in every case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShutdownError {
    #[error(
        "graceful shutdown timed out after {timeout:?} with {outstanding} operations still outstanding in the group"
    )]
    Timeout { timeout: Duration, outstanding: u64 },
    #[error("{count} RRefs leaked at shutdown: {detail}")]
    LeakedRRefs { count: usize, detail: String },
    #[error("rendezvous store failed during shutdown: {0}")]
    Store(String),
    #[error("the RPC agent has already shut down")]
    AlreadyShutDown,
}
