//! The transport error type: one enum, every variant names the peer where there is one.

use std::io;
use std::sync::Arc;

/// Result alias for transport operations.
pub type Result<T, E = TransportError> = std::result::Result<T, E>;

/// Why a transport operation failed.
///
/// Errors are `Clone` so that a connection (and the pipe above it) can keep the first one and
/// hand it to every later operation: errors are sticky.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// This side closed the connection (or listener) while the operation was pending or before
    /// it started.
    #[error("connection to {peer} was closed locally")]
    Closed { peer: String },
    /// The peer went away: it closed the connection, its process died, or the link reset.
    #[error("peer {peer} lost: {detail}")]
    PeerLost { peer: String, detail: String },
    /// A frame announced more bytes than the caller's buffer or limit allows. The connection is
    /// closed: the frame's body was not consumed.
    #[error("frame of {len} bytes from {peer} exceeds the limit of {limit} bytes")]
    FrameTooLarge { peer: String, len: u64, limit: usize },
    /// An operation was cancelled (its future dropped) part-way through a frame, so the byte
    /// stream is no longer aligned on frame boundaries.
    #[error("connection to {peer} is unusable: an earlier {op} was cancelled mid-frame")]
    Poisoned { peer: String, op: &'static str },
    /// A system call failed.
    #[error("{op} with {peer} failed: {source}")]
    Io {
        peer: String,
        op: &'static str,
        #[source]
        source: Arc<io::Error>,
    },
    /// The peer failed the shared-secret challenge (or we failed its).
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },
    /// The peer broke the transport's own setup protocol (shared-memory handshake).
    #[error("handshake with {peer} failed: {reason}")]
    Handshake { peer: String, reason: String },
    /// The address could not be parsed or resolved for this transport.
    #[error("bad {transport} address {addr:?}: {reason}")]
    BadAddress {
        transport: &'static str,
        addr: String,
        reason: String,
    },
    /// The transport cannot run on this host (missing kernel feature, permission, ...).
    #[error("transport {transport} is not viable here: {reason}")]
    NotViable { transport: &'static str, reason: String },
}

impl TransportError {
    pub(crate) fn io(peer: &str, op: &'static str, source: io::Error) -> Self {
        TransportError::Io {
            peer: peer.to_owned(),
            op,
            source: Arc::new(source),
        }
    }

    /// The peer named in the error, when there is one.
    pub fn peer(&self) -> Option<&str> {
        match self {
            TransportError::Closed { peer }
            | TransportError::PeerLost { peer, .. }
            | TransportError::FrameTooLarge { peer, .. }
            | TransportError::Poisoned { peer, .. }
            | TransportError::Io { peer, .. }
            | TransportError::Handshake { peer, .. }
            | TransportError::Auth { peer, .. } => Some(peer),
            TransportError::BadAddress { .. } | TransportError::NotViable { .. } => None,
        }
    }

    /// True when the error means the remote side is gone (as opposed to local misuse or a
    /// local close).
    pub fn is_peer_lost(&self) -> bool {
        matches!(self, TransportError::PeerLost { .. })
    }
}

/// Maps an I/O error from a read or write on an established connection: resets, broken pipes
/// and EOF mean the peer is gone.
pub(crate) fn classify_io(peer: &str, op: &'static str, err: io::Error) -> TransportError {
    use io::ErrorKind::*;
    match err.kind() {
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected => TransportError::PeerLost {
            peer: peer.to_owned(),
            detail: format!("{op}: {err}"),
        },
        _ => TransportError::io(peer, op, err),
    }
}
