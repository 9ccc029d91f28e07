//! What goes over the wire, and how it is parsed.
//!
//! Setup frames (the first frame on every connection, and the server's answer) are wrapped in a
//! versioned envelope: `b"SLCE"`, a little-endian `u16` protocol version, then a postcard body.
//! The envelope is checked before the body is decoded, so a peer on another version gets a
//! clear [`PipeError::VersionMismatch`], never a decoding accident. Frames inside an
//! established pipe (descriptors, acknowledgements) are plain postcard: the version is settled.
//!
//! Every decoder takes bytes from a peer: lengths are bounded by the frame (which the transport
//! bounded before allocating), and anything that does not parse is a typed error.

mod codec;
pub mod prim;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::channel::segment::SegmentOffer;
use crate::device::Device;
use crate::error::PipeError;

pub const MAGIC: [u8; 4] = *b"SLCE";
/// The protocol version this build speaks.
pub const VERSION: u16 = 7;
const ENVELOPE: usize = 6;

/// Largest setup frame accepted (hello or answer).
pub const MAX_SETUP_BYTES: usize = 64 * 1024;

/// The first frame of every connection to a Sluice listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Hello {
    /// Open a new pipe; here is what I support.
    Pipe(Brochure),
    /// This connection belongs to a pipe being set up (a secondary connection).
    Join { token: u64 },
}

/// Everything a client supports, sent in its first frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Brochure {
    pub name: String,
    pub pid: u32,
    /// A random token naming the process (CUDA channels use plain addresses within one).
    pub process: u64,
    /// Address of the CMA probe in the sender's memory (see `channel::cma`).
    pub cma_probe: u64,
    /// The segment the client receives CPU tensors into (see `channel::segment`), used by the
    /// server when cma is chosen.
    pub segment: Option<SegmentOffer>,
    /// In the client's priority order.
    pub transports: Vec<TransportOffer>,
    /// In the client's priority order.
    pub channels: Vec<ChannelOffer>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransportOffer {
    pub name: String,
    pub descriptor: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelOffer {
    pub name: String,
    pub devices: Vec<(Device, String)>,
}

/// The server's reply to a [`Hello::Pipe`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    Accept(Box<Answer>),
    Reject { reason: String },
}

/// The server's choices, and where the client connects to complete the pipe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub name: String,
    pub pid: u32,
    pub process: u64,
    pub cma_probe: u64,
    /// The segment the server receives CPU tensors into (only when cma is chosen).
    pub segment: Option<SegmentOffer>,
    pub transport: String,
    pub transport_descriptor: String,
    /// Where to open the control connection (when the transport is not the bootstrap one).
    pub address: String,
    /// Token of the control connection; `None` keeps the bootstrap connection as control.
    pub control_token: Option<u64>,
    pub reply_token: u64,
    /// Where to open multi-lane connections, and their tokens (empty without multi-lane).
    pub lane_address: String,
    pub lane_tokens: Vec<u64>,
    /// The server's channel offers, so the client can check the choice.
    pub channels: Vec<ChannelOffer>,
    pub choices: Vec<ChannelChoice>,
}

/// The channel chosen for one (server device, client device) pair.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelChoice {
    pub server_device: Device,
    pub client_device: Device,
    pub channel: String,
}

/// The descriptor frame of one message on the control connection.
///
/// A *packed* message (a small one: see [`PACK_MAX`]) carries its payloads and its inline
/// tensors in the descriptor's own frame, right after the descriptor, in that order: one frame
/// per message. Otherwise each payload and each inline tensor is a frame of its own after it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WireDescriptor {
    pub seq: u64,
    pub metadata: Bytes,
    pub payloads: Vec<u64>,
    pub tensors: Vec<WireTensor>,
    pub packed: bool,
}

/// A message whose payloads and inline tensors total at most this many bytes is packed into
/// its descriptor's frame (the receiver copies them out of that frame: one copy more, for
/// bytes this few, against a frame and a wait fewer).
pub const PACK_MAX: usize = 16 << 10;

impl WireDescriptor {
    /// The bytes a packed frame carries after the descriptor (payloads and inline tensors), or
    /// `None` if a peer's lengths overflow.
    pub fn packed_len(&self) -> Option<u64> {
        let inline = self.tensors.iter().filter(|t| matches!(t.data, Source::Inline));
        self.payloads
            .iter()
            .copied()
            .chain(inline.map(|t| t.length))
            .try_fold(0u64, u64::checked_add)
    }
}

/// The sender's view of a descriptor, borrowing the message: encodes to exactly the bytes of
/// the [`WireDescriptor`] the receiver decodes, without building one.
#[derive(Serialize)]
pub(crate) struct DescriptorOut<'a> {
    pub seq: u64,
    pub metadata: ByteSlice<'a>,
    pub payloads: Lengths<'a>,
    pub tensors: &'a [TensorOut<'a>],
    pub packed: bool,
}

/// The sender's view of a [`WireTensor`].
#[derive(Serialize)]
pub(crate) struct TensorOut<'a> {
    pub length: u64,
    pub source: Device,
    pub target: Option<Device>,
    pub metadata: ByteSlice<'a>,
    pub data: &'a Source,
}

/// Bytes serialized as [`Bytes`] is.
pub(crate) struct ByteSlice<'a>(pub &'a [u8]);

impl Serialize for ByteSlice<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

/// The lengths of a message's payloads, serialized as a `Vec<u64>` is.
pub(crate) struct Lengths<'a>(pub &'a [Bytes]);

impl Serialize for Lengths<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|p| p.len() as u64))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    pub length: u64,
    pub source: Device,
    pub target: Option<Device>,
    pub metadata: Bytes,
    /// How the tensor's bytes travel, which the receiver checks against the channel it
    /// negotiated for this device pair (see [`Source`]).
    pub data: Source,
}

impl WireTensor {
    /// Whether the tensor is in the receiver's segment (handed over in place).
    pub fn in_segment(&self) -> bool {
        matches!(self.data, Source::Segment { .. })
    }
}

/// Where a tensor's bytes are and how the receiver gets them: one variant per data path, so
/// a descriptor cannot name two at once. Which variants a channel may use is the channel's
/// own rule (`channel::path::accepts`); anything else is a protocol error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    /// A zero-length tensor: nothing to move, whatever the channel.
    Empty,
    /// One frame on the control connection, after the payloads (basic; small cma and rdma
    /// tensors).
    Inline,
    /// Cut into pieces across the pipe's lanes (multilane).
    Lanes,
    /// In chunks through pinned host memory on the control connection (cuda_staged).
    Staged,
    /// Already in the receiver's shared segment, at this offset of its data area (cma).
    Segment { offset: u64 },
    /// In the sender's address space: the receiver reads it with `process_vm_readv` and
    /// acknowledges (cma).
    Cma { address: u64 },
    /// Registered memory of the sender (host or GPU): the receiver RDMA-reads it and
    /// acknowledges (rdma, cuda_gdr).
    Rdma { addr: u64, rkey: u32 },
    /// GPU memory of another process: the IPC handle of the allocation (64 bytes), the
    /// tensor's offset in it, the allocation's size (offsets are checked against it), and the
    /// IPC handle of the event recorded on the sender's stream once the data was ready
    /// (cuda_ipc, cuda_p2p).
    CudaIpc {
        memory: Bytes,
        offset: u64,
        size: u64,
        event: Bytes,
    },
    /// GPU memory of this very process (only accepted from a peer with this process's token):
    /// its address and ready event (cuda_ipc, cuda_p2p).
    CudaLocal { address: u64, event: u64 },
}

impl Source {
    /// Whether the receiver acknowledges this tensor (the sender keeps the buffer until then).
    pub fn needs_ack(&self) -> bool {
        matches!(
            self,
            Source::Cma { .. } | Source::Rdma { .. } | Source::CudaIpc { .. } | Source::CudaLocal { .. }
        )
    }

    /// The variant's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Source::Empty => "empty",
            Source::Inline => "inline",
            Source::Lanes => "lanes",
            Source::Staged => "staged",
            Source::Segment { .. } => "segment",
            Source::Cma { .. } => "cma",
            Source::Rdma { .. } => "rdma",
            Source::CudaIpc { .. } => "cuda-ipc",
            Source::CudaLocal { .. } => "cuda-local",
        }
    }
}

/// The receiver's event for one cuda_ipc or cuda_p2p tensor, recorded after its copy: the
/// sender's stream waits on it before the sender's write completes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CudaDone {
    Ipc { event: Bytes },
    Local { event: u64 },
}

/// Sent on the reply connection once the receiver is done with (CMA) or has queued its copies
/// of (cuda_ipc, cuda_p2p) a message's tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ack {
    pub seq: u64,
    /// One per cuda_ipc or cuda_p2p tensor, in order.
    pub cuda: Vec<CudaDone>,
}

/// Serializes a setup frame with the versioned envelope.
pub fn encode_setup<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    postcard::to_extend(value, out).expect("serializing to a Vec cannot fail")
}

/// Parses a setup frame: envelope first, then the body.
pub fn decode_setup<T: DeserializeOwned>(bytes: &[u8], peer: &str) -> Result<T, PipeError> {
    if bytes.len() < ENVELOPE || bytes[..4] != MAGIC {
        return Err(PipeError::Protocol {
            peer: peer.to_owned(),
            detail: "not a Sluice frame (bad magic)".into(),
        });
    }
    let theirs = u16::from_le_bytes([bytes[4], bytes[5]]);
    if theirs != VERSION {
        return Err(PipeError::VersionMismatch {
            peer: peer.to_owned(),
            ours: VERSION,
            theirs,
        });
    }
    decode(&bytes[ENVELOPE..], peer)
}

/// Serializes a frame of an established pipe.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    postcard::to_stdvec(value).expect("serializing to a Vec cannot fail")
}

/// Serializes a frame of an established pipe into `out` (cleared first, its capacity reused).
#[cfg(test)]
pub(crate) fn encode_into<T: Serialize>(value: &T, out: &mut Vec<u8>) {
    out.clear();
    let buf = std::mem::take(out);
    *out = postcard::to_extend(value, buf).expect("serializing to a Vec cannot fail");
}

/// Parses a frame of an established pipe; trailing bytes are an error.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], peer: &str) -> Result<T, PipeError> {
    match postcard::take_from_bytes(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(PipeError::Protocol {
            peer: peer.to_owned(),
            detail: format!("{} trailing bytes", rest.len()),
        }),
        Err(e) => Err(PipeError::Protocol {
            peer: peer.to_owned(),
            detail: format!("malformed frame: {e}"),
        }),
    }
}

/// Parses a descriptor frame: the descriptor, and where its packed bytes start in `bytes`.
/// The bytes after the descriptor must be exactly what it says it packed (nothing, unless it
/// is packed), and no more than [`PACK_MAX`].
pub fn decode_descriptor(bytes: &[u8], peer: &str) -> Result<(WireDescriptor, usize), PipeError> {
    let mut d = WireDescriptor::default();
    let at = decode_descriptor_into(bytes, peer, &mut d)?;
    Ok((d, at))
}

/// [`decode_descriptor`] into a descriptor the caller reuses: its lists keep their capacity,
/// so a reader that hands it back allocates no list per message.
pub fn decode_descriptor_into(bytes: &[u8], peer: &str, d: &mut WireDescriptor) -> Result<usize, PipeError> {
    let protocol = |detail: String| PipeError::Protocol {
        peer: peer.to_owned(),
        detail,
    };
    let at = codec::decode_into(bytes, d).map_err(|e| protocol(format!("malformed frame: {e}")))?;
    let want = if d.packed {
        let want = d
            .packed_len()
            .ok_or_else(|| protocol("packed lengths overflow".into()))?;
        if want > PACK_MAX as u64 {
            return Err(protocol(format!("{want} bytes packed, more than {PACK_MAX}")));
        }
        want
    } else {
        0
    };
    let rest = bytes.len() - at;
    if rest as u64 != want {
        return Err(protocol(format!(
            "{rest} bytes after the descriptor, which packs {want}"
        )));
    }
    Ok(at)
}

/// Writes a descriptor frame's descriptor into `out` (cleared first, its capacity reused).
pub(crate) fn encode_descriptor(d: &DescriptorOut<'_>, out: &mut Vec<u8>) {
    out.clear();
    codec::encode(d, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_round_trip_and_version_check() {
        let hello = Hello::Join { token: 7 };
        let bytes = encode_setup(&hello);
        assert_eq!(decode_setup::<Hello>(&bytes, "p").unwrap(), hello);
        let mut other = bytes.clone();
        other[4] = 9;
        assert!(matches!(
            decode_setup::<Hello>(&other, "p"),
            Err(PipeError::VersionMismatch {
                theirs: 9,
                ours: VERSION,
                ..
            })
        ));
        assert!(matches!(
            decode_setup::<Hello>(b"GET / HTTP/1.1", "p"),
            Err(PipeError::Protocol { .. })
        ));
        assert!(matches!(
            decode_setup::<Hello>(&bytes[..bytes.len() - 1], "p"),
            Err(PipeError::Protocol { .. })
        ));
    }

    #[test]
    fn garbage_never_panics() {
        // Every prefix and a spread of byte patterns decode to a value or an error.
        let sample = encode(&WireDescriptor {
            seq: 3,
            metadata: Bytes::from_static(b"meta"),
            payloads: vec![1, 2],
            tensors: vec![WireTensor {
                length: 9,
                source: Device::Cpu,
                target: None,
                metadata: Bytes::new(),
                data: Source::CudaIpc {
                    memory: Bytes::from_static(&[1; 64]),
                    offset: 5,
                    size: 4096,
                    event: Bytes::from_static(&[2; 64]),
                },
            }],
            packed: false,
        });
        for cut in 0..sample.len() {
            let _ = decode::<WireDescriptor>(&sample[..cut], "p");
            let _ = decode_descriptor(&sample[..cut], "p");
        }
        let mut x = 0x1234_5678u32;
        for len in 0..512 {
            let junk: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            let _ = decode::<WireDescriptor>(&junk, "p");
            let _ = decode_descriptor(&junk, "p");
            let _ = decode_setup::<Hello>(&junk, "p");
        }
    }

    /// Every variant and the largest values of every field, for the codec tests.
    fn every_kind_of_tensor() -> Vec<WireTensor> {
        let sources = [
            Source::Empty,
            Source::Inline,
            Source::Lanes,
            Source::Staged,
            Source::Segment { offset: u64::MAX },
            Source::Cma { address: 1 << 47 },
            Source::Rdma {
                addr: 0x7f00_0000_1000,
                rkey: u32::MAX,
            },
            Source::CudaIpc {
                memory: Bytes::from_static(&[1; 64]),
                offset: 5,
                size: 4096,
                event: Bytes::from_static(&[2; 64]),
            },
            Source::CudaLocal {
                address: 0xdead_beef,
                event: u64::MAX - 1,
            },
        ];
        let devices = [
            (Device::Cpu, None),
            (Device::Cuda(u32::MAX), Some(Device::Cpu)),
            (Device::Cuda(1), Some(Device::Cuda(127))),
            (Device::Cpu, Some(Device::Cuda(128))),
        ];
        sources
            .iter()
            .enumerate()
            .map(|(i, data)| {
                let (source, target) = devices[i % devices.len()];
                WireTensor {
                    length: [0, 1, 127, 128, 1 << 35, u64::MAX][i % 6],
                    source,
                    target,
                    metadata: Bytes::from(vec![i as u8; i * 40]),
                    data: data.clone(),
                }
            })
            .collect()
    }

    /// The sender's borrowed form, written by the hand codec, gives postcard's bytes for the
    /// owned descriptor (so the receiver's serde-derived reference reads it), and the hand
    /// decoder reads postcard's bytes back to the same descriptor.
    #[test]
    fn hand_codec_matches_postcard_both_ways() {
        let all = every_kind_of_tensor();
        let payloads = [Bytes::from_static(b"abc"), Bytes::new(), Bytes::from(vec![9u8; 300])];
        for (seq, tensors, packed) in [
            (1u64 << 40, &all[..], true),
            (0, &all[..0], false),
            (u64::MAX, &all[1..2], true),
            (127, &all[3..], false),
        ] {
            let owned = WireDescriptor {
                seq,
                metadata: Bytes::from_static(b"meta"),
                payloads: vec![3, 0, 300],
                tensors: tensors.to_vec(),
                packed,
            };
            let outs: Vec<TensorOut<'_>> = tensors
                .iter()
                .map(|t| TensorOut {
                    length: t.length,
                    source: t.source,
                    target: t.target,
                    metadata: ByteSlice(&t.metadata),
                    data: &t.data,
                })
                .collect();
            let borrowed = DescriptorOut {
                seq,
                metadata: ByteSlice(b"meta"),
                payloads: Lengths(&payloads),
                tensors: &outs,
                packed,
            };
            let reference = encode(&owned);
            let mut out = vec![7; 3];
            encode_into(&borrowed, &mut out);
            assert_eq!(out, reference, "serde's borrowed form");
            let mut out = vec![7; 3];
            encode_descriptor(&borrowed, &mut out);
            assert_eq!(out, reference, "the hand encoder");
            // Decoded into a descriptor that held something else: nothing of it remains.
            let mut back = WireDescriptor {
                payloads: vec![1; 9],
                tensors: all.clone(),
                ..WireDescriptor::default()
            };
            assert_eq!(codec::decode_into(&reference, &mut back), Ok(reference.len()));
            assert_eq!(back, owned);
        }
    }

    /// On any input, the hand decoder and the serde-derived one agree: the same descriptor
    /// and length, or both refuse. Inputs: every prefix of a valid descriptor, every single-
    /// bit flip of it, and pseudo-random bytes.
    #[test]
    fn hand_decoder_agrees_with_serde() {
        let sample = encode(&WireDescriptor {
            seq: 300,
            metadata: Bytes::from_static(b"meta"),
            payloads: vec![1, 1 << 20],
            tensors: every_kind_of_tensor(),
            packed: true,
        });
        let agree = |bytes: &[u8]| {
            let reference = postcard::take_from_bytes::<WireDescriptor>(bytes)
                .ok()
                .map(|(d, rest)| (d, bytes.len() - rest.len()));
            let mut d = WireDescriptor::default();
            let hand = codec::decode_into(bytes, &mut d).ok().map(|at| (d, at));
            assert_eq!(hand, reference, "on {bytes:02x?}");
        };
        for input in prim::agreement_inputs(&[sample], 2048) {
            agree(&input);
        }
    }

    /// A descriptor frame carries exactly the bytes it packs, no more, no fewer.
    #[test]
    fn packed_tail_must_match() {
        let d = WireDescriptor {
            seq: 0,
            metadata: Bytes::new(),
            payloads: vec![2],
            tensors: vec![WireTensor {
                length: 3,
                source: Device::Cpu,
                target: None,
                metadata: Bytes::new(),
                data: Source::Inline,
            }],
            packed: true,
        };
        let head = encode(&d);
        let mut frame = head.clone();
        frame.extend_from_slice(b"ppttt");
        let (back, at) = decode_descriptor(&frame, "p").unwrap();
        assert_eq!((back, at), (d.clone(), head.len()));
        for wrong in [&b"ppt"[..], b"pptttt", b""] {
            let mut f = head.clone();
            f.extend_from_slice(wrong);
            assert!(matches!(decode_descriptor(&f, "p"), Err(PipeError::Protocol { .. })));
        }
        // Unpacked: nothing may follow.
        let unpacked = WireDescriptor {
            packed: false,
            ..d.clone()
        };
        let mut f = encode(&unpacked);
        assert!(decode_descriptor(&f, "p").is_ok());
        f.push(0);
        assert!(matches!(decode_descriptor(&f, "p"), Err(PipeError::Protocol { .. })));
        // Lengths that overflow when summed are refused, not wrapped.
        let huge = WireDescriptor {
            payloads: vec![u64::MAX, 2],
            ..d.clone()
        };
        assert!(matches!(
            decode_descriptor(&encode(&huge), "p"),
            Err(PipeError::Protocol { .. })
        ));
        // More than PACK_MAX is refused even when the bytes are there.
        let big = WireDescriptor {
            payloads: vec![PACK_MAX as u64 + 1],
            tensors: vec![],
            ..d
        };
        let mut f = encode(&big);
        f.resize(f.len() + PACK_MAX + 1, 0);
        assert!(matches!(decode_descriptor(&f, "p"), Err(PipeError::Protocol { .. })));
    }
}
