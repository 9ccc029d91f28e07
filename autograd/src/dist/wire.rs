//! How autograd tensors travel inside agent payloads.
//!
//! A value is serialized with postcard; every `Tensor` inside it becomes an index into the
//! payload's tensor list, and its data travels as a pipe tensor (moved by the pipe's channels,
//! never copied into the value's bytes). Shape, strides, dtype and whether it requires grad
//! travel in a [`WireTensor`] beside the value.
//!
//! Layout on the wire: a contiguous tensor (or a contiguous window of a larger buffer) sends
//! just its elements, a slice of its storage, no copy. A view that is a permutation of its
//! whole buffer (a transpose) sends the buffer unchanged and **arrives with its strides**. Any
//! other view (a strided window) is made contiguous first, so only the bytes it covers travel.
//!
//! Every field from a peer is checked (`Tensor::from_bytes`): dtype, dims ≤ 16, the buffer
//! covering every element the strides reach, sparse indices inside the dense shape.

use std::cell::RefCell;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sluice_channel::SendBuffer;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::{contiguous_strides, Storage, Tensor};

const MAX_DIMS: usize = 16;

/// A tensor's description; its data is the pipe tensor at `buffer`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireTensor {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
    pub offset: u64,
    pub requires_grad: bool,
    /// Sparse rows: the dense row of each stored row.
    pub sparse: Option<Vec<u64>>,
    pub buffer: u32,
}

/// Prepares `t` for sending: its description and the memory to move (CPU bytes, or a CUDA
/// buffer that the pipe reads after the work queued on its stream).
pub(crate) fn to_wire(t: &Tensor, buffer: u32) -> Result<(WireTensor, SendBuffer)> {
    let requires_grad = t.requires_grad();
    let (data, strides, offset) = if t.is_dense_permutation() && !t.is_contiguous() {
        (t.inner.data.clone(), t.strides().to_vec(), 0)
    } else {
        (t.contiguous_storage()?, contiguous_strides(t.shape()), 0)
    };
    let data = match data {
        Storage::Cpu(b) => SendBuffer::Cpu(b),
        Storage::Cuda(b) => SendBuffer::Cuda(b),
    };
    let wire = WireTensor {
        dtype: t.dtype(),
        shape: t.shape().iter().map(|&n| n as u64).collect(),
        strides: strides.iter().map(|&n| n as u64).collect(),
        offset,
        requires_grad,
        sparse: t.sparse_indices().map(|i| i.iter().map(|&n| n as u64).collect()),
        buffer,
    };
    Ok((wire, data))
}

fn usize_of(v: u64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::Wire(format!("{what} {v} does not fit")))
}

/// Rebuilds a tensor from its description and its received memory (graph-free). A CUDA
/// buffer becomes a CUDA tensor on the device the agent placed it on.
pub(crate) fn from_wire(w: &WireTensor, data: SendBuffer) -> Result<Tensor> {
    match data {
        SendBuffer::Cpu(bytes) => from_wire_cpu(w, bytes),
        SendBuffer::Cuda(buf) => {
            if w.sparse.is_some() {
                return Err(Error::Wire("sparse rows arrived on a GPU; they are CPU-only".into()));
            }
            // The same description, checked on a zero-length stand-in first (so the checks
            // stay in one place), then over the device buffer.
            let (shape, strides) = checked_dense(w, buf.len())?;
            Tensor::from_cuda(buf, w.dtype, &shape, &strides, usize_of(w.offset, "offset")?)
        }
        _ => Err(Error::Wire("a buffer on an unknown device".into())),
    }
}

/// The shape and strides of a dense description whose data is `len` bytes, checked as
/// `from_wire_cpu` checks them.
fn checked_dense(w: &WireTensor, len: usize) -> Result<(Vec<usize>, Vec<usize>)> {
    if w.shape.len() > MAX_DIMS || w.shape.len() != w.strides.len() {
        return Err(Error::Wire(format!(
            "{} dims with {} strides",
            w.shape.len(),
            w.strides.len()
        )));
    }
    if !w.dtype.is_float() && w.requires_grad {
        return Err(Error::Wire("an i64 tensor cannot require grad".into()));
    }
    let shape: Vec<usize> = w
        .shape
        .iter()
        .map(|&n| usize_of(n, "dimension"))
        .collect::<Result<_>>()?;
    let strides: Vec<usize> = w
        .strides
        .iter()
        .map(|&n| usize_of(n, "stride"))
        .collect::<Result<_>>()?;
    let numel = shape.iter().try_fold(1usize, |a, &n| a.checked_mul(n));
    let need = numel.and_then(|n| n.checked_mul(w.dtype.size()));
    match (numel, need) {
        (Some(_), Some(need)) if need <= len => Ok((shape, strides)),
        _ => Err(Error::Wire(format!(
            "shape {shape:?} of {:?} needs more than the {len} bytes sent (repeated elements are never sent)",
            w.dtype
        ))),
    }
}

fn from_wire_cpu(w: &WireTensor, data: Bytes) -> Result<Tensor> {
    // Dense: senders only ever send contiguous tensors or dense permutations (see `to_wire`),
    // so every element has bytes of its own. A view that repeats elements (zero or
    // overlapping strides) could make a few bytes stand for a huge tensor that the first
    // contiguous copy would try to allocate: `checked_dense` refuses it.
    let Some(indices) = &w.sparse else {
        let (shape, strides) = checked_dense(w, data.len())?;
        return Tensor::from_bytes(data, w.dtype, &shape, &strides, usize_of(w.offset, "offset")?);
    };
    // Sparse rows: the same header checks, then the rows.
    let (shape, _) = checked_dense(w, usize::MAX)?;
    if shape.is_empty() {
        return Err(Error::Wire("a sparse tensor needs rows".into()));
    }
    let dense = shape.iter().try_fold(w.dtype.size(), |a, &n| a.checked_mul(n));
    if dense.is_none_or(|b| b > isize::MAX as usize) {
        return Err(Error::Wire(format!(
            "sparse tensor of shape {shape:?} is too large to exist"
        )));
    }
    let indices: Vec<usize> = indices
        .iter()
        .map(|&i| match usize_of(i, "row") {
            Ok(i) if i < shape[0] => Ok(i),
            _ => Err(Error::Wire(format!("sparse row {i} outside {} rows", shape[0]))),
        })
        .collect::<Result<_>>()?;
    let mut rows_shape = shape.clone();
    rows_shape[0] = indices.len();
    let rows = Tensor::from_bytes(data, w.dtype, &rows_shape, &contiguous_strides(&rows_shape), 0)?;
    if rows.numel() * w.dtype.size() != rows.inner.data.len() {
        return Err(Error::Wire("sparse rows and their buffer differ in length".into()));
    }
    Tensor::sparse_rows(indices, rows, shape)
}

thread_local! {
    static ENCODING: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
    static DECODING: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
}

/// Serializes `value`, collecting the tensors inside it (in order of appearance).
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<(Vec<u8>, Vec<Tensor>)> {
    let previous = ENCODING.with(|e| e.borrow_mut().replace(Vec::new()));
    let bytes = postcard::to_allocvec(value);
    let tensors = ENCODING
        .with(|e| std::mem::replace(&mut *e.borrow_mut(), previous))
        .unwrap_or_default();
    let bytes = bytes.map_err(|e| Error::Wire(format!("encoding: {e}")))?;
    Ok((bytes, tensors))
}

/// Deserializes `bytes`, resolving tensor indices against `tensors`.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], tensors: Vec<Tensor>) -> Result<T> {
    let previous = DECODING.with(|d| d.borrow_mut().replace(tensors));
    let value = postcard::from_bytes(bytes);
    DECODING.with(|d| *d.borrow_mut() = previous);
    value.map_err(|e| Error::Wire(format!("decoding {}: {e}", std::any::type_name::<T>())))
}

/// How a tensor is written inside a value: an index when the value travels through
/// `dist::rpc_*` (data moved by the pipe), inline bytes otherwise (e.g. inside a plain agent
/// call or an RRef fetch).
#[derive(Serialize, Deserialize)]
enum Repr {
    Indexed(u32),
    Inline(WireTensor, serde_bytes_compat::Buf),
}

mod serde_bytes_compat {
    /// Bytes serialized as one byte string.
    pub struct Buf(pub bytes::Bytes);
    impl serde::Serialize for Buf {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(&self.0)
        }
    }
    impl<'de> serde::Deserialize<'de> for Buf {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            bytes::Bytes::deserialize(d).map(Buf)
        }
    }
}

impl Serialize for Tensor {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let index = ENCODING.with(|e| {
            e.borrow_mut().as_mut().map(|list| {
                list.push(self.clone());
                list.len() as u32 - 1
            })
        });
        match index {
            Some(i) => Repr::Indexed(i).serialize(s),
            None => {
                // Outside `dist::rpc_*` data travels inline, through the host.
                use serde::ser::Error as _;
                let host = self.to_device(sluice_channel::Device::Cpu).map_err(S::Error::custom)?;
                let (w, data) = to_wire(&host, 0).map_err(S::Error::custom)?;
                let bytes = data.as_cpu().cloned().unwrap_or_default();
                Repr::Inline(w, serde_bytes_compat::Buf(bytes)).serialize(s)
            }
        }
    }
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        match Repr::deserialize(d)? {
            Repr::Indexed(i) => DECODING
                .with(|list| list.borrow().as_ref().and_then(|l| l.get(i as usize).cloned()))
                .ok_or_else(|| D::Error::custom(format!("tensor index {i} outside the message's tensors"))),
            Repr::Inline(w, buf) => from_wire_cpu(&w, buf.0).map_err(D::Error::custom),
        }
    }
}

/// Decodes a tensor description as a peer would send it, followed by its data, and validates
/// it: the fuzz target's entry. Never panics, whatever the bytes.
#[doc(hidden)]
pub fn fuzz_from_wire(bytes: &[u8]) {
    if let Ok((w, rest)) = postcard::take_from_bytes::<WireTensor>(bytes) {
        if let Ok(t) = from_wire_cpu(&w, Bytes::copy_from_slice(rest)) {
            // A dense tensor that passed validation must be fully readable. (Densifying a
            // sparse one is the receiver's explicit choice, sized by its own parameters.)
            if !t.is_sparse() {
                let _ = t.contiguous_raw();
            }
        }
    }
}

/// Valid descriptions with their data, as seeds for the fuzz target.
#[doc(hidden)]
pub fn fuzz_seeds() -> Vec<Vec<u8>> {
    let dense = Tensor::from_vec((0..12).map(|i| i as f32).collect::<Vec<f32>>(), &[3, 4]).expect("a 3x4 tensor");
    let mut out = Vec::new();
    for t in [dense.clone(), dense.transpose(0, 1).expect("a transpose")] {
        let (w, data) = to_wire(&t, 0).expect("a CPU tensor");
        let mut seed = postcard::to_allocvec(&w).expect("descriptions encode");
        seed.extend_from_slice(data.as_cpu().expect("a CPU tensor"));
        out.push(seed);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn described(shape: Vec<u64>, strides: Vec<u64>) -> WireTensor {
        WireTensor {
            dtype: DType::F32,
            shape,
            strides,
            offset: 0,
            requires_grad: false,
            sparse: None,
            buffer: 0,
        }
    }

    #[test]
    fn a_few_bytes_cannot_stand_for_a_huge_tensor() {
        // Found by the `tensor` fuzz target: zero strides made 4 bytes a 2^40-element view,
        // which the first contiguous copy tried to allocate.
        let data = Bytes::from(vec![0u8; 4]);
        let e = from_wire_cpu(&described(vec![1 << 20, 1 << 20], vec![0, 0]), data.clone()).unwrap_err();
        assert!(e.to_string().contains("repeated elements"), "{e}");
        assert!(from_wire_cpu(&described(vec![u64::MAX, 2], vec![1, 1]), data.clone()).is_err());
        // A real tensor and a real transpose still arrive.
        let t = from_wire_cpu(&described(vec![1], vec![1]), data).unwrap();
        assert_eq!(t.shape(), &[1]);
        let x = Tensor::from_vec((0..6).map(|i| i as f32).collect::<Vec<f32>>(), &[2, 3]).unwrap();
        let (w, d) = to_wire(&x.transpose(0, 1).unwrap(), 0).unwrap();
        assert_eq!(
            from_wire(&w, d).unwrap().to_vec::<f32>().unwrap(),
            vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
        );
        // The fuzzer's inputs, replayed: an out-of-memory (zero strides), an overflow in the
        // strides of a zero-sized tensor with huge dimensions, and a size-1 dimension with a
        // huge stride (walking it overflowed for a moment).
        for input in [
            "AAQEEP//BOUEBAAAAAAAAAAAAAAFAAAAAAA=",
            "AwwMDAQEgAAEAQAA+//9//7///xyAAwMDAwMDAwMDAwMDAAAAAABAAAAAAABADE9AAAAAAAMDAwMDA==",
            "AAIC8PDw8PDw8AMCAAAAAAAAAP////8rAAAA/////38AAAT+Av8=",
            "AQQBAwECBAMA////////////AQACAQAEADIyMjIBAwECBAMAAjIyMjIyMjIyMjIyMjL//////////////wQA+DX/AwR+AAAC",
        ] {
            use base64::Engine;
            fuzz_from_wire(&base64::engine::general_purpose::STANDARD.decode(input).unwrap());
        }
    }
}
