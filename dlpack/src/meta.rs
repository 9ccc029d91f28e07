//! The tensor metadata that travels beside a tensor's bytes: dtype, shape and strides.
//!
//! The bytes sent are the tensor's *span*: from its first element to its last, whatever its
//! strides, so a strided view is sent as it lies, without a gather, and arrives with the same
//! strides. On arrival the metadata is parsed and checked against the buffer that came with it
//! (rank, negative sizes, overflow, span longer than the buffer): a bad one is an error.

use serde::{Deserialize, Serialize};

use crate::ffi::DLDataType;

/// The most dimensions a received tensor may have.
pub const MAX_RANK: usize = 32;

/// The wire format's version: the first byte of every encoded [`Meta`].
const VERSION: u8 = 1;

/// Element types that cross: DLPack's codes, named as frameworks name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    Bool,
    I8,
    I16,
    I32,
    I64,
    U8,
    U16,
    U32,
    U64,
    F16,
    BF16,
    F32,
    F64,
    C64,
    C128,
}

impl DType {
    /// Every dtype, in this order.
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::C64,
        DType::C128,
    ];

    /// DLPack's description (one lane).
    pub fn to_dl(self) -> DLDataType {
        let (code, bits) = match self {
            DType::Bool => (6, 8),
            DType::I8 => (0, 8),
            DType::I16 => (0, 16),
            DType::I32 => (0, 32),
            DType::I64 => (0, 64),
            DType::U8 => (1, 8),
            DType::U16 => (1, 16),
            DType::U32 => (1, 32),
            DType::U64 => (1, 64),
            DType::F16 => (2, 16),
            DType::BF16 => (4, 16),
            DType::F32 => (2, 32),
            DType::F64 => (2, 64),
            DType::C64 => (5, 64),
            DType::C128 => (5, 128),
        };
        DLDataType { code, bits, lanes: 1 }
    }

    /// The type DLPack describes, if it is one of ours (one lane only).
    pub fn from_dl(dt: DLDataType) -> Result<DType, MetaError> {
        DType::ALL
            .into_iter()
            .find(|d| d.to_dl() == dt)
            .ok_or(MetaError::DType {
                code: dt.code,
                bits: dt.bits,
                lanes: dt.lanes,
            })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        self.to_dl().bits as usize / 8
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
        }
    }
}

/// Why a tensor's description was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    #[error("unsupported dtype (DLPack code {code}, {bits} bits, {lanes} lanes)")]
    DType { code: u8, bits: u8, lanes: u16 },
    #[error("rank {0} is above the limit of {MAX_RANK}")]
    Rank(usize),
    #[error("dimension {dim} has a negative size or stride ({size}, {stride})")]
    Negative { dim: usize, size: i64, stride: i64 },
    #[error("shape and strides overflow the address space")]
    Overflow,
    #[error("the tensor spans {need} bytes but its buffer holds {have}")]
    Span { need: usize, have: usize },
    #[error("{0} strides for {1} dimensions")]
    Strides(usize, usize),
    #[error("tensor metadata version {0} (this build reads {VERSION})")]
    Version(u8),
    #[error("malformed tensor metadata: {0}")]
    Malformed(String),
}

/// A tensor's description: element type, shape and strides (in elements, never negative).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
}

impl Meta {
    /// A compact row-major tensor.
    pub fn contiguous(dtype: DType, shape: &[i64]) -> Meta {
        let mut strides = vec![0i64; shape.len()];
        let mut step = 1i64;
        for (s, &d) in strides.iter_mut().zip(shape).rev() {
            *s = step;
            step = step.saturating_mul(d.max(1));
        }
        Meta {
            dtype,
            shape: shape.to_vec(),
            strides,
        }
    }

    /// Checks rank and signs, and returns the bytes from the first element to the end of the
    /// last (0 for an empty tensor).
    pub fn span(&self) -> Result<usize, MetaError> {
        if self.shape.len() > MAX_RANK {
            return Err(MetaError::Rank(self.shape.len()));
        }
        if self.strides.len() != self.shape.len() {
            return Err(MetaError::Strides(self.strides.len(), self.shape.len()));
        }
        let mut last: u64 = 0;
        let mut empty = false;
        for (dim, (&size, &stride)) in self.shape.iter().zip(&self.strides).enumerate() {
            if size < 0 || stride < 0 {
                return Err(MetaError::Negative { dim, size, stride });
            }
            if size == 0 {
                empty = true;
                continue;
            }
            let reach = ((size - 1) as u64)
                .checked_mul(stride as u64)
                .ok_or(MetaError::Overflow)?;
            last = last.checked_add(reach).ok_or(MetaError::Overflow)?;
        }
        if empty {
            return Ok(0);
        }
        let bytes = last
            .checked_add(1)
            .and_then(|n| n.checked_mul(self.dtype.size() as u64))
            .filter(|&n| n <= isize::MAX as u64)
            .ok_or(MetaError::Overflow)?;
        Ok(bytes as usize)
    }

    /// Elements in the tensor.
    pub fn numel(&self) -> usize {
        self.shape.iter().map(|&d| d.max(0) as usize).product()
    }

    /// The wire form: a version byte, then postcard.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        out.extend(postcard::to_allocvec(self).expect("a Meta always serializes"));
        out
    }

    /// The wire form followed by `tag`: bytes for the binding that wrote it (the Python
    /// binding names the tensor's framework there); readers that do not know it ignore it.
    pub fn encode_tagged(&self, tag: &[u8]) -> Vec<u8> {
        let mut out = self.encode();
        out.extend_from_slice(tag);
        out
    }

    /// Parses a received description and checks it against the `buffer_len` bytes that came
    /// with it.
    pub fn decode(bytes: &[u8], buffer_len: usize) -> Result<Meta, MetaError> {
        Meta::decode_tagged(bytes, buffer_len).map(|(m, _)| m)
    }

    /// [`decode`](Self::decode), also returning the tag that follows the description.
    pub fn decode_tagged(bytes: &[u8], buffer_len: usize) -> Result<(Meta, &[u8]), MetaError> {
        let (&version, rest) = bytes
            .split_first()
            .ok_or_else(|| MetaError::Malformed("empty".into()))?;
        if version != VERSION {
            return Err(MetaError::Version(version));
        }
        // The rank is checked before the vectors are built: postcard reads a length prefix
        // first, and an absurd one must not allocate.
        let (meta, tag): (Meta, &[u8]) =
            postcard::take_from_bytes(rest).map_err(|e| MetaError::Malformed(e.to_string()))?;
        let need = meta.span()?;
        if need > buffer_len {
            return Err(MetaError::Span { need, have: buffer_len });
        }
        Ok((meta, tag))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides_and_span() {
        let m = Meta::contiguous(DType::F32, &[2, 3, 4]);
        assert_eq!(m.strides, vec![12, 4, 1]);
        assert_eq!(m.span().unwrap(), 96);
        assert_eq!(Meta::contiguous(DType::F64, &[]).span().unwrap(), 8);
        assert_eq!(Meta::contiguous(DType::F64, &[3, 0]).span().unwrap(), 0);
    }

    #[test]
    fn strided_views_span_first_to_last() {
        // A transposed 3x4: shape [4, 3], strides [1, 4]: last element at 3 + 2*4 = 11.
        let m = Meta {
            dtype: DType::I16,
            shape: vec![4, 3],
            strides: vec![1, 4],
        };
        assert_eq!(m.span().unwrap(), 24);
        // Every other column of a 2x6: strides [6, 2], shape [2, 3]: last at 6 + 4 = 10.
        let m = Meta {
            dtype: DType::U8,
            shape: vec![2, 3],
            strides: vec![6, 2],
        };
        assert_eq!(m.span().unwrap(), 11);
    }

    #[test]
    fn round_trips_and_checks_the_buffer() {
        let m = Meta::contiguous(DType::BF16, &[5, 7]);
        let wire = m.encode();
        assert_eq!(Meta::decode(&wire, 70).unwrap(), m);
        assert_eq!(Meta::decode(&wire, 69), Err(MetaError::Span { need: 70, have: 69 }));
        let tagged = m.encode_tagged(b"torch");
        assert_eq!(Meta::decode_tagged(&tagged, 70).unwrap(), (m.clone(), &b"torch"[..]));
        assert_eq!(Meta::decode(&tagged, 70).unwrap(), m);
    }

    #[test]
    fn bad_descriptions_are_errors() {
        let bad = |m: Meta| Meta::decode(&m.encode(), usize::MAX).unwrap_err();
        let neg = Meta {
            dtype: DType::F32,
            shape: vec![-1],
            strides: vec![1],
        };
        assert!(matches!(bad(neg), MetaError::Negative { .. }));
        let huge = Meta {
            dtype: DType::F64,
            shape: vec![i64::MAX, 3],
            strides: vec![i64::MAX, 1],
        };
        assert_eq!(bad(huge), MetaError::Overflow);
        let deep = Meta::contiguous(DType::U8, &[1; MAX_RANK + 1]);
        assert_eq!(bad(deep), MetaError::Rank(MAX_RANK + 1));
        let mismatched = Meta {
            dtype: DType::U8,
            shape: vec![2, 2],
            strides: vec![1],
        };
        assert_eq!(bad(mismatched), MetaError::Strides(1, 2));
        assert_eq!(Meta::decode(&[9, 0], 0), Err(MetaError::Version(9)));
        assert!(matches!(Meta::decode(&[], 0), Err(MetaError::Malformed(_))));
        // An absurd vector length prefix: refused, not allocated.
        assert!(matches!(
            Meta::decode(&[1, 11, 0xff, 0xff, 0xff, 0xff, 0x0f], 0),
            Err(MetaError::Malformed(_))
        ));
    }

    #[test]
    fn every_dtype_maps_both_ways() {
        for d in DType::ALL {
            assert_eq!(DType::from_dl(d.to_dl()).unwrap(), d);
        }
        let vec4 = DLDataType {
            code: 2,
            bits: 32,
            lanes: 4,
        };
        assert!(matches!(DType::from_dl(vec4), Err(MetaError::DType { lanes: 4, .. })));
    }
}
