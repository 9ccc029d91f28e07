//! The agent's messages, carried in a pipe message's metadata (postcard). The value's bytes
//! travel inline when small, otherwise as the message's first payload; tensors are the
//! message's tensors.
//!
//! Everything here comes from a peer: it is decoded into these types or the pipe is dropped.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
/// A handler's name: kept inline up to 23 bytes (no allocation per call on either side),
/// and sent as a plain string.
pub use smol_str::SmolStr as HandlerName;

use crate::error::HandlerError;

/// Bumped on any incompatible change; compared at rendezvous.
pub const AGENT_VERSION: u16 = 3;

/// Values up to this size travel inside the envelope; larger ones as a separate payload.
pub const INLINE_LIMIT: usize = 4096;

/// A globally unique id: the worker that made it and a counter there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GlobalId {
    pub worker: u32,
    pub local: u64,
}

impl std::fmt::Display for GlobalId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.worker, self.local)
    }
}

/// An RRef inside a value: its owner, its id, the fork the receiver becomes, and who sent it
/// (the fork's parent).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireRRef {
    pub owner: u32,
    pub id: GlobalId,
    pub fork: GlobalId,
    pub parent: u32,
}

/// The value part of a request or response.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WireValue {
    /// The value's bytes when they are small; otherwise empty and `in_payload` is set.
    pub inline: Bytes,
    pub in_payload: bool,
    pub rrefs: Vec<WireRRef>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Envelope {
    /// First message on every pipe a worker opens: who is calling, and how often it will
    /// ping an idle pipe (zero: never), so the callee knows how long silence may last.
    Hello {
        rank: u32,
        version: u16,
        heartbeat_ms: u64,
    },
    /// The sender is leaving the group: the pipe closing next is not a failure.
    Goodbye,
    Request(Request),
    Response(Response),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    /// `worker_id << 48 | counter`.
    pub id: u64,
    /// The call's priority level as sent; checked against the range of
    /// [`Priority`](crate::priority::Priority) when it arrives.
    pub priority: i8,
    pub body: Body,
    pub value: WireValue,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Body {
    /// Run a handler, reply with its value.
    Call { handler: HandlerName },
    /// Run a handler and keep its value as the RRef `rref`; `fork` is the creator's reference
    /// (`None` when the creator is the owner itself).
    Remote {
        handler: HandlerName,
        rref: GlobalId,
        fork: Option<GlobalId>,
    },
    /// Reply with a copy of the RRef's value (`to_here`).
    Fetch { rref: GlobalId },
    /// Run a method handler on the RRef's value (proxies).
    Method { rref: GlobalId, handler: HandlerName },
    /// Control (idempotent, retried): a new user reference introduces itself to the owner.
    ForkRequest { rref: GlobalId, fork: GlobalId },
    /// Control (idempotent, retried): tells the parent that the owner knows its child.
    ChildAccept { fork: GlobalId },
    /// Control (idempotent, retried): a user reference is gone.
    Delete { rref: GlobalId, fork: GlobalId },
    /// A heartbeat on an idle pipe; answered at once, never counted as activity.
    Ping,
    /// Run a method handler on the RRef `target`'s value and keep the result as the RRef
    /// `rref`, owned here too (the proxies' `remote` form); `fork` as for `Remote`.
    RemoteMethod {
        target: GlobalId,
        handler: HandlerName,
        rref: GlobalId,
        fork: Option<GlobalId>,
    },
}

impl Body {
    /// Control messages may be retried; user calls never are.
    pub fn is_control(&self) -> bool {
        matches!(
            self,
            Body::ForkRequest { .. } | Body::ChildAccept { .. } | Body::Delete { .. }
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub id: u64,
    pub result: Result<WireValue, WireError>,
}

/// Why a request failed on the callee.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum WireError {
    Handler(HandlerError),
    UnknownHandler(String),
    /// Anything else (decoding, wrong RRef type, …), as text.
    Failed(String),
    /// The request itself was invalid (a priority out of range); it was not run.
    Rejected(String),
}

pub fn encode(envelope: &Envelope) -> Bytes {
    // Sized first: one allocation of exactly the length, which `Bytes` takes over as it is
    // (a growing vector would reallocate, and its spare capacity cost `Bytes` a second box).
    let size = postcard::experimental::serialized_size(envelope).expect("agent envelopes always encode");
    let mut buf = vec![0u8; size];
    let used = postcard::to_slice(envelope, &mut buf)
        .expect("agent envelopes always encode")
        .len();
    debug_assert_eq!(used, size);
    Bytes::from(buf)
}

/// A pipe message carrying `envelope`, with its payload frames and tensors.
pub(crate) fn message(
    envelope: &Envelope,
    payloads: Vec<Bytes>,
    tensors: Vec<sluice_channel::Tensor>,
) -> sluice_channel::Message {
    sluice_channel::Message {
        metadata: encode(envelope),
        payloads,
        tensors,
    }
}

pub fn decode(bytes: &[u8]) -> Result<Envelope, String> {
    postcard::from_bytes(bytes).map_err(|e| format!("malformed agent message: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let e = Envelope::Request(Request {
            id: 7 << 48 | 3,
            priority: 0,
            body: Body::Call { handler: "f".into() },
            value: WireValue {
                inline: Bytes::from_static(b"abc"),
                ..Default::default()
            },
        });
        let b = encode(&e);
        // Sized then encoded in place: the same bytes as postcard's own vector, no spare room.
        assert_eq!(&b[..], &postcard::to_allocvec(&e).unwrap()[..]);
        let reply = Envelope::Response(Response {
            id: 9,
            result: Err(WireError::Failed("x".repeat(300))),
        });
        assert_eq!(&encode(&reply)[..], &postcard::to_allocvec(&reply).unwrap()[..]);
        assert!(matches!(decode(&b), Ok(Envelope::Request(r)) if r.id == 7 << 48 | 3));
        assert!(decode(&[0xff, 0xff, 0xff]).is_err());
        assert!(decode(&[]).is_err());
        // A truncated message never decodes.
        for n in 0..b.len() {
            let _ = decode(&b[..n]);
        }
    }

    /// Handler names travel as plain strings (the wire is what it was with `String`), short
    /// or long.
    #[test]
    fn handler_names_are_plain_strings_on_the_wire() {
        for name in ["noop", "a.handler.name.longer.than.23.bytes"] {
            let ours = postcard::to_allocvec(&HandlerName::from(name)).unwrap();
            assert_eq!(ours, postcard::to_allocvec(&name.to_owned()).unwrap());
            let back: HandlerName = postcard::from_bytes(&ours).unwrap();
            assert_eq!(back, name);
        }
    }
}
