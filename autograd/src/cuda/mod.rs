//! CUDA kernels: the GPU side of the device seam. `cpu` functions hand a CUDA tensor here
//! first, so every op in `ops.rs` runs on whichever device its inputs live on.
//!
//! - **Kernels** are CUDA C++ in [`source`], compiled once per device with NVRTC on first use
//!   and cached for the life of the process (`Program`). Elementwise ops, broadcasting and
//!   reductions take shapes and strides, so views (transposes, narrows, broadcasts) need no
//!   copy first. Matrix products go to cuBLAS (transposed views included).
//! - **Streams**: every op runs on one compute stream per device. An input that was produced
//!   on another stream (a tensor received through the agent lands on the agent's stream) is
//!   waited for with an event first, so no caller ever synchronizes by hand.
//! - **Memory** comes from the compute stream's block cache (`CudaBuffer::alloc_cached`):
//!   freeing device memory synchronizes the whole device, which would stall every op.
//!
//! Availability: no CUDA driver, NVRTC or cuBLAS means every CUDA op fails with the reason
//! (and `Tensor::to_device` refuses a GPU), never a panic.

mod launch;
pub mod source;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use sluice_channel::Device;
use sluice_cuda::{compute, Event};
use sluice_cuda::{CudaBuffer, Stream};

use crate::dtype::DType;
use crate::error::{shape_err, Error, Result};
use crate::tensor::{contiguous_strides, numel, Inner, Storage, Tensor};

pub(crate) use launch::Op;

/// Whether CUDA ops can run here; the reason when not.
pub fn available() -> std::result::Result<(), String> {
    compute::available().map_err(|e| e.to_string())
}

fn cuda_err(e: impl std::fmt::Display) -> Error {
    Error::Cuda(e.to_string())
}

/// The compute stream of `device`: every op on it is queued here.
pub fn compute_stream(device: u32) -> Result<Stream> {
    static STREAMS: OnceLock<Mutex<HashMap<u32, Stream>>> = OnceLock::new();
    let mut map = STREAMS.get_or_init(Default::default).lock().unwrap();
    if let Some(s) = map.get(&device) {
        return Ok(s.clone());
    }
    let s = Stream::new(device).map_err(cuda_err)?;
    map.insert(device, s.clone());
    Ok(s)
}

/// `len` bytes on `device`, ordered by its compute stream (contents undefined), from the
/// compute stream's block cache.
pub(crate) fn alloc(device: u32, len: usize) -> Result<CudaBuffer> {
    CudaBuffer::alloc_cached(len, &compute_stream(device)?).map_err(cuda_err)
}

/// `t`'s buffer, ready for work on the compute stream of its device: when the buffer is ordered
/// by another stream, the compute stream waits for that stream's queued work first.
fn ready(t: &Tensor) -> Result<(u32, CudaBuffer, Stream)> {
    let b = t.cuda_buffer().ok_or_else(|| Error::Device {
        op: "cuda kernel",
        device: t.device().to_string(),
    })?;
    let stream = compute_stream(b.device())?;
    if b.stream().raw() != stream.raw() {
        Event::record(b.stream())
            .and_then(|e| e.wait_on(&stream))
            .map_err(cuda_err)?;
    }
    Ok((b.device(), b.clone(), stream))
}

/// The elements of a contiguous CUDA tensor as their own buffer, ready on the compute stream.
fn window(t: &Tensor) -> Result<CudaBuffer> {
    let (_, b, _) = ready(t)?;
    let size = t.dtype().size();
    b.slice(t.inner.offset * size..(t.inner.offset + t.numel()) * size)
        .map_err(cuda_err)
}

/// A new contiguous tensor over `buf`.
fn wrap(buf: CudaBuffer, dtype: DType, shape: Vec<usize>) -> Tensor {
    let strides = contiguous_strides(&shape);
    Tensor::from_inner(Inner {
        device: Device::Cuda(buf.device()),
        data: Storage::Cuda(buf),
        dtype,
        shape,
        strides,
        offset: 0,
        sparse: None,
        grad: None,
    })
}

fn float_dtype(op: &'static str, t: &Tensor) -> Result<DType> {
    match t.dtype() {
        d @ (DType::F32 | DType::F64) => Ok(d),
        dtype => Err(Error::DType {
            op,
            dtype,
            hint: " (CUDA kernels compute in f32 or f64)",
        }),
    }
}

fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device() != b.device() {
        return Err(shape_err(
            op,
            format!("operands on {} and {}; move one with to_device", a.device(), b.device()),
        ));
    }
    if a.dtype() != b.dtype() {
        return Err(shape_err(op, format!("dtypes {} and {} differ", a.dtype(), b.dtype())));
    }
    Ok(())
}

/// Copies `t` to `device` (host↔GPU or GPU↔GPU). A CUDA result is contiguous and ordered by
/// the target's compute stream; a host result is complete when this returns.
pub(crate) fn to_device(t: &Tensor, device: Device) -> Result<Tensor> {
    if t.is_sparse() {
        return Err(Error::Device {
            op: "to_device of sparse rows",
            device: device.to_string(),
        });
    }
    match (t.device(), device) {
        (a, b) if a == b => Ok(t.detach()),
        (Device::Cpu, Device::Cuda(i)) => {
            let c = t.contiguous_raw()?;
            let bytes = c.cpu_bytes()?;
            let size = c.dtype().size();
            let host = &bytes[c.inner.offset * size..(c.inner.offset + c.numel()) * size];
            let buf = alloc(i, host.len())?;
            buf.write_from_host(host).map_err(cuda_err)?;
            Ok(wrap(buf, c.dtype(), c.shape().to_vec()))
        }
        (Device::Cuda(_), Device::Cpu) => {
            let c = contiguous(t)?;
            let (_, buf, _) = ready(&c)?;
            let size = c.dtype().size();
            let window = buf
                .slice(c.inner.offset * size..(c.inner.offset + c.numel()) * size)
                .map_err(cuda_err)?;
            let host = window.read_to_host().map_err(cuda_err)?;
            Tensor::from_bytes(
                bytes::Bytes::from(host),
                c.dtype(),
                c.shape(),
                &contiguous_strides(c.shape()),
                0,
            )
        }
        (Device::Cuda(_), Device::Cuda(j)) => {
            let c = contiguous(t)?;
            let (_, buf, _) = ready(&c)?;
            let size = c.dtype().size();
            let src = buf
                .slice(c.inner.offset * size..(c.inner.offset + c.numel()) * size)
                .map_err(cuda_err)?;
            let dst = alloc(j, src.len())?;
            // Queued on the target's compute stream, after the source's stream.
            Event::record(&compute_stream(src.device())?)
                .and_then(|e| e.wait_on(dst.stream()))
                .and_then(|()| dst.copy_from(&src))
                // The source's memory is reused in its own stream's order: after the copy.
                .and_then(|()| Event::record(dst.stream()))
                .and_then(|e| e.wait_on(src.stream()))
                .map_err(cuda_err)?;
            Ok(wrap(dst, c.dtype(), c.shape().to_vec()))
        }
        (_, d) => Err(Error::Device {
            op: "to_device",
            device: d.to_string(),
        }),
    }
}

/// Up to eight dimensions travel to a kernel by value.
const MAX_DIMS: usize = 8;

fn dims(op: &'static str, v: &[usize]) -> Result<[u64; 8]> {
    if v.len() > MAX_DIMS {
        return Err(shape_err(
            op,
            format!("{} dims; CUDA kernels take at most {MAX_DIMS}", v.len()),
        ));
    }
    let mut out = [0u64; 8];
    for (o, &x) in out.iter_mut().zip(v) {
        *o = x as u64;
    }
    Ok(out)
}

/// A row-major copy of a strided CUDA tensor.
pub(crate) fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.detach());
    }
    let out = alloc_like(t, t.shape())?;
    copy_into(t, &out, &contiguous_strides(t.shape()), 0)?;
    Ok(out)
}

fn alloc_like(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let Device::Cuda(d) = t.device() else {
        return Err(Error::Device {
            op: "cuda alloc",
            device: t.device().to_string(),
        });
    };
    Ok(wrap(
        alloc(d, numel(shape) * t.dtype().size())?,
        t.dtype(),
        shape.to_vec(),
    ))
}

/// Zeros of `shape` on `t`'s device, in `t`'s dtype (filled on the compute stream).
fn zeros_like(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    let out = alloc_like(t, shape)?;
    ready(&out)?.1.fill(0).map_err(cuda_err)?;
    Ok(out)
}

/// Copies `src`'s elements into `dst`'s storage at `dst_offset` with `dst_strides` (which the
/// caller computed inside `dst`).
fn copy_into(src: &Tensor, dst: &Tensor, dst_strides: &[usize], dst_offset: usize) -> Result<()> {
    let (_, sb, stream) = ready(src)?;
    let (_, db, _) = ready(dst)?;
    crate::tensor::check_layout(db.len(), dst.dtype(), src.shape(), dst_strides, dst_offset)?;
    launch::copy(src, &sb, &db, dst_strides, dst_offset, &stream)
}

/// `op` over `x` elementwise (`s`: the scalar of `Scale` and `AddScalar`).
pub(crate) fn unary(op: Op, x: &Tensor, s: f64) -> Result<Tensor> {
    float_dtype("unary", x)?;
    let (_, xb, stream) = ready(x)?;
    let out = alloc_like(x, x.shape())?;
    launch::unary(op, x, &xb, &out, s, &stream)?;
    Ok(out)
}

/// `op(a, b)` elementwise with broadcasting.
pub(crate) fn binary(op: Op, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_device("binary", a, b)?;
    float_dtype("binary", a)?;
    let shape = crate::cpu::broadcast_shape("binary", a.shape(), b.shape())?;
    let (_, ab, stream) = ready(a)?;
    let (_, bb, _) = ready(b)?;
    let out = alloc_like(a, &shape)?;
    launch::binary(op, a, &ab, b, &bb, &out, &stream)?;
    Ok(out)
}

/// Sum over the dimensions marked in `reduce`.
pub(crate) fn sum_dims(t: &Tensor, reduce: &[bool], keepdim: bool) -> Result<Tensor> {
    float_dtype("sum", t)?;
    let kept = crate::cpu::reduced_shape(t.shape(), reduce, true);
    let reduced: Vec<usize> = t
        .shape()
        .iter()
        .zip(reduce)
        .map(|(&n, &r)| if r { n } else { 1 })
        .collect();
    let (_, tb, stream) = ready(t)?;
    let out = alloc_like(t, &kept)?;
    launch::sum(t, &tb, &out, &kept, &reduced, &stream)?;
    let shape = crate::cpu::reduced_shape(t.shape(), reduce, keepdim);
    Ok(out.view_raw(shape.clone(), contiguous_strides(&shape), 0))
}

/// `a · b` with cuBLAS (row- or column-major views without a copy; others made contiguous).
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_device("matmul", a, b)?;
    let dtype = float_dtype("matmul", a)?;
    if a.dims() != 2 || b.dims() != 2 || a.shape()[1] != b.shape()[0] {
        return Err(shape_err(
            "matmul",
            format!("cannot multiply {:?} by {:?}", a.shape(), b.shape()),
        ));
    }
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    let a = gemm_ready(a)?;
    let b = gemm_ready(b)?;
    let (_, ab, stream) = ready(&a)?;
    let (_, bb, _) = ready(&b)?;
    let out = alloc_like(&a, &[m, n])?;
    launch::gemm(dtype, &a, &ab, &b, &bb, &out, m, n, k, &stream)?;
    Ok(out)
}

/// A matrix cuBLAS can read as it is (see [`gemm_layout`]), else a contiguous copy.
fn gemm_ready(t: &Tensor) -> Result<Tensor> {
    match gemm_layout([t.shape()[0], t.shape()[1]], [t.strides()[0], t.strides()[1]]) {
        Some(_) => Ok(t.detach()),
        None => contiguous(t),
    }
}

/// How cuBLAS can read a 2-D operand in place: whether it is transposed (its columns
/// contiguous) and its leading dimension. `None` when it cannot: no unit stride, or rows (or
/// columns) that repeat or overlap. A broadcast view's zero stride would otherwise become a
/// leading dimension smaller than the matrix, and cuBLAS would read past the data (an illegal
/// address poisons the whole context).
pub(crate) fn gemm_layout(shape: [usize; 2], strides: [usize; 2]) -> Option<(bool, usize)> {
    let ([n0, n1], [s0, s1]) = (shape, strides);
    // Rows of unit-stride elements, each at least a row's length after the last.
    if (s1 == 1 || n1 <= 1) && (n0 <= 1 || s0 >= n1.max(1)) {
        return Some((false, if n0 <= 1 { n1.max(1) } else { s0 }));
    }
    // The same with the roles swapped: a transposed (column-major) operand.
    if (s0 == 1 || n0 <= 1) && (n1 <= 1 || s1 >= n0.max(1)) {
        return Some((true, if n1 <= 1 { n0.max(1) } else { s1 }));
    }
    None
}

/// Softmax (or log-softmax) over the last dimension.
pub(crate) fn softmax_last(x: &Tensor, log: bool) -> Result<Tensor> {
    float_dtype("softmax", x)?;
    let x = contiguous(x)?;
    let cols = *x.shape().last().unwrap_or(&1);
    let rows = x.numel() / cols.max(1);
    let (_, xb, stream) = ready(&x)?;
    let out = alloc_like(&x, x.shape())?;
    launch::softmax((&x, &xb), None, &out, rows, cols, log, &stream)?;
    Ok(out)
}

pub(crate) fn softmax_last_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Tensor> {
    same_device("softmax backward", y, g)?;
    float_dtype("softmax backward", y)?;
    let (y, g) = (contiguous(y)?, contiguous(g)?);
    let cols = *y.shape().last().unwrap_or(&1);
    let rows = y.numel() / cols.max(1);
    let (_, yb, stream) = ready(&y)?;
    let (_, gb, _) = ready(&g)?;
    let out = alloc_like(&y, y.shape())?;
    launch::softmax((&y, &yb), Some((&g, &gb)), &out, rows, cols, log, &stream)?;
    Ok(out)
}

/// Targets as an i64 buffer on `device`.
fn targets_on(device: u32, targets: &[usize]) -> Result<CudaBuffer> {
    let host: Vec<u8> = targets.iter().flat_map(|&t| (t as i64).to_le_bytes()).collect();
    let buf = alloc(device, host.len().max(8))?;
    if !host.is_empty() {
        buf.slice(0..host.len())
            .and_then(|b| b.write_from_host(&host))
            .map_err(cuda_err)?;
    }
    Ok(buf)
}

pub(crate) fn nll_loss(logp: &Tensor, targets: &[usize]) -> Result<Tensor> {
    float_dtype("nll_loss", logp)?;
    let logp = contiguous(logp)?;
    let (device, lb, stream) = ready(&logp)?;
    let tb = targets_on(device, targets)?;
    let out = alloc_like(&logp, &[])?;
    launch::nll(&logp, &lb, &tb, &out, targets.len(), logp.shape()[1], false, &stream)?;
    Ok(out)
}

pub(crate) fn nll_loss_backward(g: &Tensor, shape: &[usize], targets: &[usize]) -> Result<Tensor> {
    float_dtype("nll_loss backward", g)?;
    let (device, gb, stream) = ready(g)?;
    let tb = targets_on(device, targets)?;
    let out = zeros_like(g, shape)?;
    launch::nll(g, &gb, &tb, &out, targets.len(), shape[1], true, &stream)?;
    Ok(out)
}

/// Concatenation along `dim`: each part copied into its window of the output.
pub(crate) fn cat(parts: &[Tensor], dim: usize, shape: Vec<usize>) -> Result<Tensor> {
    let first = &parts[0];
    for p in parts {
        same_device("cat", first, p)?;
    }
    let out = alloc_like(first, &shape)?;
    let strides = contiguous_strides(&shape);
    let mut start = 0;
    for p in parts {
        copy_into(p, &out, &strides, start * strides.get(dim).copied().unwrap_or(0))?;
        start += p.shape()[dim];
    }
    Ok(out)
}

/// Zeros of `shape` with `g` placed at `start..` along `dim`.
pub(crate) fn pad_narrow(g: &Tensor, shape: &[usize], dim: usize, start: usize) -> Result<Tensor> {
    let out = zeros_like(g, shape)?;
    let strides = contiguous_strides(shape);
    copy_into(g, &out, &strides, start * strides[dim])?;
    Ok(out)
}

/// The same values in another float dtype.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    float_dtype("to_dtype", t)?;
    if !matches!(dtype, DType::F32 | DType::F64) {
        return Err(Error::DType {
            op: "to_dtype on CUDA",
            dtype,
            hint: " (CUDA tensors are f32 or f64; convert on the host)",
        });
    }
    let c = contiguous(t)?;
    let (device, cb, stream) = ready(&c)?;
    let out = wrap(alloc(device, c.numel() * dtype.size())?, dtype, c.shape().to_vec());
    launch::cast(&c, &cb, &out, &stream)?;
    Ok(out)
}

/// The optimizers' fused updates; every operand contiguous, of `p`'s shape and dtype.
pub(crate) mod optim {
    use super::*;

    /// `p − lr·g`.
    pub(crate) fn sgd(p: &Tensor, g: &Tensor, lr: f64) -> Result<Tensor> {
        let g = prepare(p, g)?;
        super::binary(Op::Sub, p, &unary(Op::Scale, &g, lr)?)
    }

    /// Momentum SGD: `buf ← momentum·buf + g`, `p − lr·buf`. Returns (p, buf).
    pub(crate) fn momentum(
        p: &Tensor,
        g: &Tensor,
        buf: Option<&Tensor>,
        lr: f64,
        momentum: f64,
    ) -> Result<(Tensor, Tensor)> {
        let g = prepare(p, g)?;
        let buf = match buf {
            Some(b) => super::binary(Op::Add, &unary(Op::Scale, b, momentum)?, &g)?,
            None => g,
        };
        Ok((super::binary(Op::Sub, p, &unary(Op::Scale, &buf, lr)?)?, buf))
    }

    /// One Adam step in a single kernel; returns (p, m, v).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn adam(
        p: &Tensor,
        g: &Tensor,
        state: Option<(&Tensor, &Tensor)>,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        step: u64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let g = prepare(p, g)?;
        let p = contiguous(p)?;
        let (m, v) = match state {
            Some((m, v)) => (m.clone(), v.clone()),
            None => {
                let z = zeros_like(&p, p.shape())?;
                (z.clone(), z)
            }
        };
        let (_, _, stream) = ready(&p)?;
        let (pb, gb, mb, vb) = (window(&p)?, window(&g)?, window(&m)?, window(&v)?);
        let (po, mo, vo) = (
            alloc_like(&p, p.shape())?,
            alloc_like(&p, p.shape())?,
            alloc_like(&p, p.shape())?,
        );
        let c1 = 1.0 - beta1.powi(step as i32);
        let c2 = 1.0 - beta2.powi(step as i32);
        launch::adam(
            &p,
            [&pb, &gb, &mb, &vb],
            [&po, &mo, &vo],
            [lr, beta1, beta2, eps, c1, c2],
            &stream,
        )?;
        Ok((po, mo, vo))
    }

    /// `g` on `p`'s device, dtype and layout.
    fn prepare(p: &Tensor, g: &Tensor) -> Result<Tensor> {
        let g = if g.device() != p.device() {
            g.to_device(p.device())?
        } else {
            g.clone()
        };
        let g = if g.dtype() != p.dtype() {
            g.to_dtype(p.dtype())?
        } else {
            g
        };
        contiguous(&g)
    }
}

#[cfg(test)]
mod tests {
    use super::gemm_layout;

    #[test]
    fn gemm_reads_in_place_only_what_it_can_address() {
        // Row-major and transposed matrices, also with padded rows: read in place.
        assert_eq!(gemm_layout([3, 4], [4, 1]), Some((false, 4)));
        assert_eq!(gemm_layout([3, 4], [8, 1]), Some((false, 8)));
        assert_eq!(gemm_layout([3, 4], [1, 3]), Some((true, 3)));
        // One row or one column: its other stride does not matter.
        assert_eq!(gemm_layout([1, 4], [0, 1]), Some((false, 4)));
        assert_eq!(gemm_layout([3, 1], [1, 0]), Some((false, 1)));
        // A broadcast view (rows or columns repeating, stride 0) and overlapping rows: copied
        // first, never handed to cuBLAS with a leading dimension smaller than the matrix.
        assert_eq!(gemm_layout([3, 4], [0, 1]), None);
        assert_eq!(gemm_layout([3, 4], [1, 0]), None);
        assert_eq!(gemm_layout([3, 4], [2, 1]), None);
        assert_eq!(gemm_layout([3, 4], [1, 2]), None);
        assert_eq!(gemm_layout([3, 4], [0, 0]), None);
        // Empty matrices get a leading dimension of at least one.
        assert_eq!(gemm_layout([0, 0], [0, 0]), Some((false, 1)));
    }
}
