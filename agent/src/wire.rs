//! The agent's messages, carried in a pipe message's metadata (postcard). The value's bytes
//! travel inline when small, otherwise as the message's first payload; tensors are the
//! message's tensors.
//!
//! Everything here comes from a peer: it is decoded into these types or the pipe is dropped.

mod codec;

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

/// The envelope's bytes (postcard's, written by hand: see [`codec`]).
pub fn encode(envelope: &Envelope) -> Bytes {
    codec::encode(envelope)
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

/// Parses an envelope from a peer (postcard's bytes, read by hand: see [`codec`]); a
/// non-empty inline value is a view of `bytes`.
pub fn decode(bytes: &Bytes) -> Result<Envelope, String> {
    codec::decode(bytes).map_err(|e| format!("malformed agent message: {e}"))
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
        assert!(decode(&Bytes::from_static(&[0xff, 0xff, 0xff])).is_err());
        assert!(decode(&Bytes::new()).is_err());
        // A truncated message never decodes.
        for n in 0..b.len() {
            let _ = decode(&b.slice(..n));
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

    /// One envelope of every kind, with extreme integers and every variant of every enum.
    fn every_kind_of_envelope() -> Vec<Envelope> {
        let g = |worker, local| GlobalId { worker, local };
        let value = WireValue {
            inline: Bytes::from_static(b"inline value"),
            in_payload: true,
            rrefs: vec![
                WireRRef {
                    owner: u32::MAX,
                    id: g(0, u64::MAX),
                    fork: g(7, 1 << 48 | 5),
                    parent: 128,
                },
                WireRRef {
                    owner: 0,
                    id: g(1, 0),
                    fork: g(2, 127),
                    parent: 3,
                },
            ],
        };
        let bodies = vec![
            Body::Call { handler: "noop".into() },
            Body::Remote {
                handler: "a.handler.name.longer.than.23.bytes".into(),
                rref: g(1, 2),
                fork: None,
            },
            Body::Remote {
                handler: "ü".into(),
                rref: g(1, 2),
                fork: Some(g(3, u64::MAX)),
            },
            Body::Fetch { rref: g(u32::MAX, 300) },
            Body::Method {
                rref: g(4, 5),
                handler: "m".into(),
            },
            Body::ForkRequest {
                rref: g(6, 7),
                fork: g(8, 9),
            },
            Body::ChildAccept { fork: g(10, 11) },
            Body::Delete {
                rref: g(12, 13),
                fork: g(14, 15),
            },
            Body::Ping,
            Body::RemoteMethod {
                target: g(16, 17),
                handler: "".into(),
                rref: g(18, 19),
                fork: Some(g(20, 21)),
            },
        ];
        let mut all = vec![
            Envelope::Hello {
                rank: u32::MAX,
                version: u16::MAX,
                heartbeat_ms: u64::MAX,
            },
            Envelope::Hello {
                rank: 0,
                version: AGENT_VERSION,
                heartbeat_ms: 1000,
            },
            Envelope::Goodbye,
        ];
        for (i, body) in bodies.into_iter().enumerate() {
            all.push(Envelope::Request(Request {
                id: if i % 2 == 0 { u64::MAX } else { i as u64 },
                priority: [i8::MIN, -1, 0, 1, i8::MAX][i % 5],
                body,
                value: if i % 2 == 0 {
                    value.clone()
                } else {
                    WireValue::default()
                },
            }));
        }
        let errors = [
            WireError::Handler(HandlerError::new("ValueError", "bad")),
            WireError::UnknownHandler("nope".into()),
            WireError::Failed("x".repeat(300)),
            WireError::Rejected(String::new()),
        ];
        all.push(Envelope::Response(Response {
            id: 0,
            result: Ok(value),
        }));
        all.push(Envelope::Response(Response {
            id: 1,
            result: Ok(WireValue::default()),
        }));
        for (i, e) in errors.into_iter().enumerate() {
            all.push(Envelope::Response(Response {
                id: 1 << (i * 20),
                result: Err(e),
            }));
        }
        all
    }

    /// The hand encoder writes postcard's bytes for every kind of envelope, and the hand
    /// decoder reads them back to the same envelope.
    #[test]
    fn hand_codec_matches_postcard_both_ways() {
        for e in every_kind_of_envelope() {
            let reference = postcard::to_allocvec(&e).unwrap();
            let ours = encode(&e);
            assert_eq!(&ours[..], &reference[..], "{e:?}");
            let back = decode(&ours).unwrap();
            assert_eq!(format!("{back:?}"), format!("{e:?}"));
            let serde_back: Envelope = postcard::from_bytes(&reference).unwrap();
            assert_eq!(format!("{back:?}"), format!("{serde_back:?}"));
        }
    }

    /// The hand decoder agrees with postcard's serde decoder (the same envelope, or both
    /// refuse) on every prefix and every single-bit flip of every kind of envelope, and on
    /// pseudo-random bytes.
    #[test]
    fn hand_decoder_agrees_with_serde() {
        let agree = |bytes: &[u8]| {
            let reference = postcard::from_bytes::<Envelope>(bytes).ok().map(|e| format!("{e:?}"));
            let hand = decode(&Bytes::copy_from_slice(bytes)).ok().map(|e| format!("{e:?}"));
            assert_eq!(hand, reference, "on {bytes:02x?}");
        };
        let samples: Vec<Vec<u8>> = every_kind_of_envelope()
            .iter()
            .map(|e| postcard::to_allocvec(e).unwrap())
            .collect();
        for input in sluice_channel::wire::prim::agreement_inputs(&samples, 4096) {
            agree(&input);
        }
    }

    /// A non-empty inline value is a view of the received bytes, not a copy.
    #[test]
    fn inline_values_borrow_the_received_bytes() {
        let e = Envelope::Request(Request {
            id: 1,
            priority: 0,
            body: Body::Call { handler: "f".into() },
            value: WireValue {
                inline: Bytes::from_static(b"abcdef"),
                ..Default::default()
            },
        });
        let frame = encode(&e);
        let Ok(Envelope::Request(r)) = decode(&frame) else {
            panic!("a request")
        };
        let range = frame.as_ptr_range();
        assert!(range.contains(&r.value.inline.as_ptr()));
        assert_eq!(&r.value.inline[..], b"abcdef");
    }
}
