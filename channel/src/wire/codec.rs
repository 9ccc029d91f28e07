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

use super::prim::{bytes, varint, Malformed, Reader};
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

/// The most entries a count from the peer reserves at once.
const RESERVE_MAX: usize = 256;

/// Parses the descriptor at the start of `frame` into `d` (whose lists are cleared first and
/// keep their capacity) and returns how many bytes it took. On an error `d` holds whatever
/// was parsed so far: the caller discards it.
pub(crate) fn decode_into(frame: &[u8], d: &mut WireDescriptor) -> Result<usize, Malformed> {
    let mut r = Reader::new(frame);
    d.payloads.clear();
    d.tensors.clear();
    d.seq = r.u64()?;
    d.metadata = owned_bytes(&mut r)?;
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
            source: device_of(&mut r)?,
            target: match r.some()? {
                false => None,
                true => Some(device_of(&mut r)?),
            },
            metadata: owned_bytes(&mut r)?,
            data: source_of(&mut r)?,
        });
    }
    d.packed = r.bool()?;
    Ok(frame.len() - r.rest.len())
}

fn owned_bytes(r: &mut Reader<'_>) -> Result<Bytes, Malformed> {
    Ok(Bytes::copy_from_slice(r.slice()?))
}

fn device_of(r: &mut Reader<'_>) -> Result<Device, Malformed> {
    match r.u32()? {
        0 => Ok(Device::Cpu),
        1 => Ok(Device::Cuda(r.u32()?)),
        _ => Err("unknown device"),
    }
}

fn source_of(r: &mut Reader<'_>) -> Result<Source, Malformed> {
    Ok(match r.u32()? {
        0 => Source::Empty,
        1 => Source::Inline,
        2 => Source::Lanes,
        3 => Source::Staged,
        4 => Source::Segment { offset: r.u64()? },
        5 => Source::Cma { address: r.u64()? },
        6 => Source::Rdma {
            addr: r.u64()?,
            rkey: r.u32()?,
        },
        7 => Source::CudaIpc {
            memory: owned_bytes(r)?,
            offset: r.u64()?,
            size: r.u64()?,
            event: owned_bytes(r)?,
        },
        8 => Source::CudaLocal {
            address: r.u64()?,
            event: r.u64()?,
        },
        _ => return Err("unknown tensor source"),
    })
}
