//! The descriptor frame's codec, by hand: the bytes postcard gives a [`WireDescriptor`]
//! (unsigned integers as LEB128 varints, byte strings and sequences behind a varint length,
//! enum variants by a varint index, `Option` and `bool` as one byte), written and parsed
//! without serde's visitors.
//!
//! A descriptor is encoded and decoded once per message on both sides of every pipe; through
//! serde the two cost ~100 ns a message on this project's machines, a third of the pipe's own
//! CPU per small message. The serde derives stay the reference: the tests hold this codec to
//! postcard's bytes both ways, and the `descriptor` fuzz target holds the pipe's decoder to
//! postcard's verdict both ways on any input.
//!
//! Decoding fills a [`WireDescriptor`] the caller reuses (its lists keep their capacity), and
//! trusts nothing: every length is checked against the bytes that remain before anything is
//! taken or reserved, and every malformed input is an error, never a panic.

use bytes::Bytes;

use super::{DescriptorOut, Source, TensorOut, WireDescriptor, WireTensor};
use crate::device::Device;

/// Appends the descriptor's bytes to `out`: exactly what postcard writes for the
/// [`WireDescriptor`] it describes.
pub(crate) fn encode(d: &DescriptorOut<'_>, out: &mut Vec<u8>) {
    varint(out, d.seq);
    bytes(out, d.metadata.0);
    varint(out, d.payloads.0.len() as u64);
    for p in d.payloads.0 {
        varint(out, p.len() as u64);
    }
    varint(out, d.tensors.len() as u64);
    for t in d.tensors {
        tensor(out, t);
    }
    out.push(d.packed as u8);
}

fn tensor(out: &mut Vec<u8>, t: &TensorOut<'_>) {
    varint(out, t.length);
    device(out, t.source);
    match t.target {
        None => out.push(0),
        Some(d) => {
            out.push(1);
            device(out, d);
        }
    }
    bytes(out, t.metadata.0);
    source(out, t.data);
}

fn device(out: &mut Vec<u8>, d: Device) {
    match d {
        Device::Cpu => out.push(0),
        Device::Cuda(i) => {
            out.push(1);
            varint(out, u64::from(i));
        }
    }
}

fn source(out: &mut Vec<u8>, s: &Source) {
    // The variant's index, then its fields in order (the derive's numbering: declaration order).
    match s {
        Source::Empty => out.push(0),
        Source::Inline => out.push(1),
        Source::Lanes => out.push(2),
        Source::Staged => out.push(3),
        Source::Segment { offset } => {
            out.push(4);
            varint(out, *offset);
        }
        Source::Cma { address } => {
            out.push(5);
            varint(out, *address);
        }
        Source::Rdma { addr, rkey } => {
            out.push(6);
            varint(out, *addr);
            varint(out, u64::from(*rkey));
        }
        Source::CudaIpc {
            memory,
            offset,
            size,
            event,
        } => {
            out.push(7);
            bytes(out, memory);
            varint(out, *offset);
            varint(out, *size);
            bytes(out, event);
        }
        Source::CudaLocal { address, event } => {
            out.push(8);
            varint(out, *address);
            varint(out, *event);
        }
    }
}

fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The most entries a count from the peer reserves at once.
const RESERVE_MAX: usize = 256;

/// Why a descriptor frame does not parse.
pub(crate) type Malformed = &'static str;

/// Parses the descriptor at the start of `frame` into `d` (whose lists are cleared first and
/// keep their capacity) and returns how many bytes it took. On an error `d` holds whatever
/// was parsed so far: the caller discards it.
pub(crate) fn decode_into(frame: &[u8], d: &mut WireDescriptor) -> Result<usize, Malformed> {
    let mut r = Reader { rest: frame };
    d.payloads.clear();
    d.tensors.clear();
    d.seq = r.u64()?;
    d.metadata = r.owned_bytes()?;
    let n = r.count()?;
    // A count is trusted only as far as the bytes left could hold it (each entry takes at
    // least one byte), and reserved for only up to `RESERVE_MAX` entries: beyond that the
    // lists grow as entries actually arrive, as serde's do.
    d.payloads.reserve(n.min(RESERVE_MAX));
    for _ in 0..n {
        d.payloads.push(r.u64()?);
    }
    let n = r.count()?;
    d.tensors.reserve(n.min(RESERVE_MAX));
    for _ in 0..n {
        d.tensors.push(WireTensor {
            length: r.u64()?,
            source: r.device()?,
            target: match r.byte()? {
                0 => None,
                1 => Some(r.device()?),
                _ => return Err("bad option tag"),
            },
            metadata: r.owned_bytes()?,
            data: r.source()?,
        });
    }
    d.packed = match r.byte()? {
        0 => false,
        1 => true,
        _ => return Err("bad bool"),
    };
    Ok(frame.len() - r.rest.len())
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Result<u8, Malformed> {
        let (&b, rest) = self.rest.split_first().ok_or("frame ends early")?;
        self.rest = rest;
        Ok(b)
    }

    /// A varint of at most `max` bytes whose last byte is at most `last` (postcard's rule:
    /// the value must fit the type).
    fn varint(&mut self, max: usize, last: u8) -> Result<u64, Malformed> {
        let mut v = 0u64;
        for i in 0..max {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                if i == max - 1 && b > last {
                    return Err("varint overflows");
                }
                return Ok(v);
            }
        }
        Err("varint too long")
    }

    fn u64(&mut self) -> Result<u64, Malformed> {
        self.varint(10, 0x01)
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(self.varint(5, 0x0f)? as u32)
    }

    /// A sequence's length, no more than the bytes left.
    fn count(&mut self) -> Result<usize, Malformed> {
        let n = self.u64()?;
        if n > self.rest.len() as u64 {
            return Err("sequence longer than the frame");
        }
        Ok(n as usize)
    }

    fn slice(&mut self) -> Result<&'a [u8], Malformed> {
        let n = self.u64()?;
        if n > self.rest.len() as u64 {
            return Err("byte string longer than the frame");
        }
        let (head, rest) = self.rest.split_at(n as usize);
        self.rest = rest;
        Ok(head)
    }

    fn owned_bytes(&mut self) -> Result<Bytes, Malformed> {
        Ok(Bytes::copy_from_slice(self.slice()?))
    }

    fn device(&mut self) -> Result<Device, Malformed> {
        match self.u32()? {
            0 => Ok(Device::Cpu),
            1 => Ok(Device::Cuda(self.u32()?)),
            _ => Err("unknown device"),
        }
    }

    fn source(&mut self) -> Result<Source, Malformed> {
        Ok(match self.u32()? {
            0 => Source::Empty,
            1 => Source::Inline,
            2 => Source::Lanes,
            3 => Source::Staged,
            4 => Source::Segment { offset: self.u64()? },
            5 => Source::Cma { address: self.u64()? },
            6 => Source::Rdma {
                addr: self.u64()?,
                rkey: self.u32()?,
            },
            7 => Source::CudaIpc {
                memory: self.owned_bytes()?,
                offset: self.u64()?,
                size: self.u64()?,
                event: self.owned_bytes()?,
            },
            8 => Source::CudaLocal {
                address: self.u64()?,
                event: self.u64()?,
            },
            _ => return Err("unknown tensor source"),
        })
    }
}
