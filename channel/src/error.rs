//! Pipe and context errors. Every variant that concerns a peer names it.

use sluice_transport::TransportError;

/// Why a pipe (or its setup) failed.
///
/// Errors other than [`PipeError::Misuse`] are sticky: the first one fails every pending and
/// later operation of the pipe.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PipeError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The peer sent bytes that do not parse, or that contradict the protocol.
    #[error("protocol error from {peer}: {detail}")]
    Protocol { peer: String, detail: String },
    /// The peer speaks another protocol version.
    #[error("{peer} speaks protocol version {theirs}, this side speaks version {ours}")]
    VersionMismatch { peer: String, ours: u16, theirs: u16 },
    /// The two sides share no usable transport or channel, or the peer's choice is unusable.
    #[error("negotiation with {peer} failed: {reason}")]
    Negotiation { peer: String, reason: String },
    /// The peer refused the connection and said why.
    #[error("{peer} rejected the pipe: {reason}")]
    Rejected { peer: String, reason: String },
    /// A channel failed to move a tensor.
    #[error("channel {channel} with {peer} failed: {detail}")]
    Channel {
        peer: String,
        channel: &'static str,
        detail: String,
    },
    /// The pipe was closed locally.
    #[error("pipe to {peer} was closed")]
    Closed { peer: String },
    /// Setup did not finish in time.
    #[error("pipe setup with {peer} timed out during {stage}")]
    Timeout { peer: String, stage: &'static str },
    /// The API was used out of order (e.g. `read` without a descriptor). Not sticky.
    #[error("misuse: {0}")]
    Misuse(String),
    /// A configuration that cannot work (no transport enabled, bad option).
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl PipeError {
    /// True when the error means the peer is gone.
    pub fn is_peer_lost(&self) -> bool {
        matches!(self, PipeError::Transport(t) if t.is_peer_lost())
    }
}

pub type Result<T, E = PipeError> = std::result::Result<T, E>;
