//! The envelope's codec, by hand: exactly the bytes postcard gives an [`Envelope`], written and
//! parsed without serde's visitors (see `sluice_channel::wire::prim` for the primitives).
//!
//! Every call encodes and decodes an envelope on each side. Through serde that was two passes
//! to encode (sizing, then writing), visitors to decode, and a copy of the inline value; by
//! hand it is one sizing pass over the fields, one writing pass, and a decode that borrows the
//! inline value from the received bytes. The serde derives stay the reference: the tests hold
//! this codec to postcard's bytes both ways, and the `rpc` fuzz target holds the decoder to
//! postcard's verdict on any input.

use bytes::Bytes;
use sluice_channel::wire::prim::{bytes, varint, Count, Malformed, Reader, Sink};

use super::{Body, Envelope, GlobalId, HandlerName, Request, Response, WireError, WireRRef, WireValue};
use crate::error::HandlerError;

/// The envelope's bytes, in an allocation of exactly their length.
pub(crate) fn encode(e: &Envelope) -> Bytes {
    let mut size = Count(0);
    envelope(&mut size, e);
    let mut out = Vec::with_capacity(size.0);
    envelope(&mut out, e);
    debug_assert_eq!(out.len(), size.0);
    // A boxed slice (no reallocation: the vector was sized exactly) is what `Bytes` takes
    // over as it is, with no second allocation for its shared header.
    Bytes::from(out.into_boxed_slice())
}

fn envelope<S: Sink>(out: &mut S, e: &Envelope) {
    // Variants by their index (the derive's numbering: declaration order), then their fields
    // in order.
    match e {
        Envelope::Hello {
            rank,
            version,
            heartbeat_ms,
        } => {
            out.put(0);
            varint(out, u64::from(*rank));
            varint(out, u64::from(*version));
            varint(out, *heartbeat_ms);
        }
        Envelope::Goodbye => out.put(1),
        Envelope::Request(r) => {
            out.put(2);
            varint(out, r.id);
            // `i8` is one byte, as it is.
            out.put(r.priority as u8);
            body(out, &r.body);
            value(out, &r.value);
        }
        Envelope::Response(r) => {
            out.put(3);
            varint(out, r.id);
            match &r.result {
                Ok(v) => {
                    out.put(0);
                    value(out, v);
                }
                Err(e) => {
                    out.put(1);
                    error(out, e);
                }
            }
        }
    }
}

fn body<S: Sink>(out: &mut S, b: &Body) {
    match b {
        Body::Call { handler } => {
            out.put(0);
            bytes(out, handler.as_bytes());
        }
        Body::Remote { handler, rref, fork } => {
            out.put(1);
            bytes(out, handler.as_bytes());
            id(out, rref);
            option_id(out, fork);
        }
        Body::Fetch { rref } => {
            out.put(2);
            id(out, rref);
        }
        Body::Method { rref, handler } => {
            out.put(3);
            id(out, rref);
            bytes(out, handler.as_bytes());
        }
        Body::ForkRequest { rref, fork } => {
            out.put(4);
            id(out, rref);
            id(out, fork);
        }
        Body::ChildAccept { fork } => {
            out.put(5);
            id(out, fork);
        }
        Body::Delete { rref, fork } => {
            out.put(6);
            id(out, rref);
            id(out, fork);
        }
        Body::Ping => out.put(7),
        Body::RemoteMethod {
            target,
            handler,
            rref,
            fork,
        } => {
            out.put(8);
            id(out, target);
            bytes(out, handler.as_bytes());
            id(out, rref);
            option_id(out, fork);
        }
    }
}

fn id<S: Sink>(out: &mut S, g: &GlobalId) {
    varint(out, u64::from(g.worker));
    varint(out, g.local);
}

fn option_id<S: Sink>(out: &mut S, g: &Option<GlobalId>) {
    match g {
        None => out.put(0),
        Some(g) => {
            out.put(1);
            id(out, g);
        }
    }
}

fn value<S: Sink>(out: &mut S, v: &WireValue) {
    bytes(out, &v.inline);
    out.put(v.in_payload as u8);
    varint(out, v.rrefs.len() as u64);
    for r in &v.rrefs {
        varint(out, u64::from(r.owner));
        id(out, &r.id);
        id(out, &r.fork);
        varint(out, u64::from(r.parent));
    }
}

fn error<S: Sink>(out: &mut S, e: &WireError) {
    match e {
        WireError::Handler(h) => {
            out.put(0);
            bytes(out, h.kind.as_bytes());
            bytes(out, h.message.as_bytes());
        }
        WireError::UnknownHandler(s) => {
            out.put(1);
            bytes(out, s.as_bytes());
        }
        WireError::Failed(s) => {
            out.put(2);
            bytes(out, s.as_bytes());
        }
        WireError::Rejected(s) => {
            out.put(3);
            bytes(out, s.as_bytes());
        }
    }
}

/// The most RRef entries a count from the peer reserves at once (the list grows as entries
/// actually arrive beyond that, as serde's do).
const RESERVE_MAX: usize = 64;

/// Parses the envelope at the start of `frame` (bytes after it are ignored, as postcard's
/// `from_bytes` ignores them). A non-empty inline value is a view of `frame`, not a copy.
pub(crate) fn decode(frame: &Bytes) -> Result<Envelope, Malformed> {
    let mut r = Reader::new(frame);
    Ok(match r.u32()? {
        0 => Envelope::Hello {
            rank: r.u32()?,
            version: r.u16()?,
            heartbeat_ms: r.u64()?,
        },
        1 => Envelope::Goodbye,
        2 => Envelope::Request(Request {
            id: r.u64()?,
            priority: r.byte()? as i8,
            body: body_of(&mut r)?,
            value: value_of(&mut r, frame)?,
        }),
        3 => Envelope::Response(Response {
            id: r.u64()?,
            result: match r.u32()? {
                0 => Ok(value_of(&mut r, frame)?),
                1 => Err(error_of(&mut r)?),
                _ => return Err("unknown result variant"),
            },
        }),
        _ => return Err("unknown envelope variant"),
    })
}

fn body_of(r: &mut Reader<'_>) -> Result<Body, Malformed> {
    Ok(match r.u32()? {
        0 => Body::Call { handler: name_of(r)? },
        1 => Body::Remote {
            handler: name_of(r)?,
            rref: id_of(r)?,
            fork: option_id_of(r)?,
        },
        2 => Body::Fetch { rref: id_of(r)? },
        3 => Body::Method {
            rref: id_of(r)?,
            handler: name_of(r)?,
        },
        4 => Body::ForkRequest {
            rref: id_of(r)?,
            fork: id_of(r)?,
        },
        5 => Body::ChildAccept { fork: id_of(r)? },
        6 => Body::Delete {
            rref: id_of(r)?,
            fork: id_of(r)?,
        },
        7 => Body::Ping,
        8 => Body::RemoteMethod {
            target: id_of(r)?,
            handler: name_of(r)?,
            rref: id_of(r)?,
            fork: option_id_of(r)?,
        },
        _ => return Err("unknown body variant"),
    })
}

fn name_of(r: &mut Reader<'_>) -> Result<HandlerName, Malformed> {
    Ok(HandlerName::new(r.str()?))
}

fn string_of(r: &mut Reader<'_>) -> Result<String, Malformed> {
    Ok(r.str()?.to_owned())
}

fn id_of(r: &mut Reader<'_>) -> Result<GlobalId, Malformed> {
    Ok(GlobalId {
        worker: r.u32()?,
        local: r.u64()?,
    })
}

fn option_id_of(r: &mut Reader<'_>) -> Result<Option<GlobalId>, Malformed> {
    Ok(if r.some()? { Some(id_of(r)?) } else { None })
}

fn value_of(r: &mut Reader<'_>, frame: &Bytes) -> Result<WireValue, Malformed> {
    let inline = r.slice()?;
    let inline = if inline.is_empty() {
        Bytes::new()
    } else {
        frame.slice_ref(inline)
    };
    let in_payload = r.bool()?;
    let n = r.count()?;
    let mut rrefs = Vec::with_capacity(n.min(RESERVE_MAX));
    for _ in 0..n {
        rrefs.push(WireRRef {
            owner: r.u32()?,
            id: id_of(r)?,
            fork: id_of(r)?,
            parent: r.u32()?,
        });
    }
    Ok(WireValue {
        inline,
        in_payload,
        rrefs,
    })
}

fn error_of(r: &mut Reader<'_>) -> Result<WireError, Malformed> {
    Ok(match r.u32()? {
        0 => WireError::Handler(HandlerError {
            kind: string_of(r)?,
            message: string_of(r)?,
        }),
        1 => WireError::UnknownHandler(string_of(r)?),
        2 => WireError::Failed(string_of(r)?),
        3 => WireError::Rejected(string_of(r)?),
        _ => return Err("unknown error variant"),
    })
}
