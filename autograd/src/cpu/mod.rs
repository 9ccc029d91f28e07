//! CPU kernels, and the device seam: every op in `ops.rs` computes through these functions on
//! raw (graph-free) tensors, and each hands a CUDA tensor to its kernel in `crate::cuda` first.
//!
//! Elementwise loops run over contiguous slices when they can (so the compiler vectorises
//! them) and over strided rows otherwise; matmul goes to `matrixmultiply`, which takes strides,
//! so transposed views need no copy.

#[allow(unsafe_code)]
pub mod gemm;

use sluice_channel::Device;

use crate::cuda::{self, Op};
use crate::dtype::{DType, Float, Pod};
use crate::error::{shape_err, Result};
use crate::tensor::{contiguous_strides, numel, walk, Tensor};

/// Runs `$body` with `$T` bound to the tensor's float type.
macro_rules! dispatch {
    ($t:expr, $op:expr, $T:ident => $body:expr) => {
        $t.float_op(
            $op,
            || {
                type $T = f32;
                $body
            },
            || {
                type $T = f64;
                $body
            },
        )
    };
}
pub(crate) use dispatch;

pub(crate) fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let x = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let y = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (x, y) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return Err(shape_err(op, format!("shapes {a:?} and {b:?} do not broadcast"))),
        };
    }
    Ok(out)
}

/// `t`'s strides as seen from the broadcast `shape` (0 along broadcast dimensions).
pub(crate) fn broadcast_strides(t: &Tensor, shape: &[usize]) -> Vec<usize> {
    let lead = shape.len() - t.dims();
    (0..shape.len())
        .map(|d| {
            if d < lead || t.shape()[d - lead] == 1 {
                0
            } else {
                t.strides()[d - lead]
            }
        })
        .collect()
}

fn same_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(shape_err(op, format!("dtypes {} and {} differ", a.dtype(), b.dtype())));
    }
    Ok(())
}

/// `f(a, b)` elementwise with broadcasting.
pub(crate) fn zip_map<T: Float>(op: &'static str, a: &Tensor, b: &Tensor, f: impl Fn(T, T) -> T) -> Result<Tensor> {
    same_dtype(op, a, b)?;
    let shape = broadcast_shape(op, a.shape(), b.shape())?;
    if a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous() {
        let (av, bv) = (a.values::<T>()?, b.values::<T>()?);
        let out: Vec<T> = av.iter().zip(bv.iter()).map(|(&x, &y)| f(x, y)).collect();
        return Ok(Tensor::from_vec_unchecked(out, shape));
    }
    let (sa, sb) = (a.storage::<T>()?, b.storage::<T>()?);
    let (ast, bst) = (broadcast_strides(a, &shape), broadcast_strides(b, &shape));
    let mut out = Vec::with_capacity(numel(&shape));
    walk(
        &shape,
        [&ast, &bst],
        [a.inner.offset, b.inner.offset],
        |[oa, ob], [xa, xb], len| match (xa, xb) {
            (1, 1) => out.extend(sa[oa..oa + len].iter().zip(&sb[ob..ob + len]).map(|(&x, &y)| f(x, y))),
            (1, 0) => {
                let y = sb[ob];
                out.extend(sa[oa..oa + len].iter().map(|&x| f(x, y)))
            }
            (0, 1) => {
                let x = sa[oa];
                out.extend(sb[ob..ob + len].iter().map(|&y| f(x, y)))
            }
            _ => out.extend((0..len).map(|i| f(sa[oa + i * xa], sb[ob + i * xb]))),
        },
    );
    Ok(Tensor::from_vec_unchecked(out, shape))
}

/// `f(a)` elementwise.
pub(crate) fn map<T: Float>(a: &Tensor, f: impl Fn(T) -> T) -> Result<Tensor> {
    let v = a.values::<T>()?;
    Ok(Tensor::from_vec_unchecked(
        v.iter().map(|&x| f(x)).collect::<Vec<T>>(),
        a.shape().to_vec(),
    ))
}

/// Whether `t` lives on a GPU (its kernels are in `crate::cuda`).
fn on_gpu(t: &Tensor) -> bool {
    t.device() != Device::Cpu
}

pub(crate) fn binary_add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if on_gpu(a) {
        return cuda::binary(Op::Add, a, b);
    }
    dispatch!(a, "add", T => zip_map::<T>("add", a, b, |x, y| x + y))
}

pub(crate) fn scale(a: &Tensor, s: f64) -> Result<Tensor> {
    if on_gpu(a) {
        return cuda::unary(Op::Scale, a, s);
    }
    dispatch!(a, "mul", T => { let s = T::from_f64(s); map::<T>(a, |x| x * s) })
}

/// Sums over the dimensions marked in `reduce`; `keepdim` keeps them with size 1.
pub(crate) fn sum_dims(t: &Tensor, reduce: &[bool], keepdim: bool) -> Result<Tensor> {
    if on_gpu(t) {
        return cuda::sum_dims(t, reduce, keepdim);
    }
    dispatch!(t, "sum", T => sum_dims_typed::<T>(t, reduce, keepdim))
}

fn sum_dims_typed<T: Float>(t: &Tensor, reduce: &[bool], keepdim: bool) -> Result<Tensor> {
    let kept = reduced_shape(t.shape(), reduce, true);
    let mut out_strides = contiguous_strides(&kept);
    for (s, &r) in out_strides.iter_mut().zip(reduce) {
        if r {
            *s = 0;
        }
    }
    let x = t.storage::<T>()?;
    let mut out = vec![T::ZERO; numel(&kept)];
    walk(
        t.shape(),
        [t.strides(), &out_strides],
        [t.inner.offset, 0],
        |[i, o], [si, so], len| {
            if so == 0 {
                let s: T = if si == 1 {
                    x[i..i + len].iter().copied().sum()
                } else {
                    (0..len).map(|k| x[i + k * si]).sum()
                };
                out[o] += s;
            } else {
                for k in 0..len {
                    out[o + k * so] += x[i + k * si];
                }
            }
        },
    );
    Ok(Tensor::from_vec_unchecked(
        out,
        reduced_shape(t.shape(), reduce, keepdim),
    ))
}

/// The shape a sum over the dimensions marked in `reduce` leaves: those dimensions set to 1
/// with `keepdim`, removed without.
pub(crate) fn reduced_shape(shape: &[usize], reduce: &[bool], keepdim: bool) -> Vec<usize> {
    shape
        .iter()
        .zip(reduce)
        .filter_map(|(&n, &r)| match (r, keepdim) {
            (false, _) => Some(n),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

/// Sums `g` down to `shape` (undoes broadcasting).
pub(crate) fn sum_to(g: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if g.shape() == shape {
        return Ok(g.clone());
    }
    let lead = g.dims() - shape.len();
    let reduce: Vec<bool> = (0..g.dims())
        .map(|d| d < lead || (shape[d - lead] == 1 && g.shape()[d] != 1))
        .collect();
    let s = sum_dims(g, &reduce, true)?;
    Ok(s.view_raw(shape.to_vec(), contiguous_strides(shape), 0))
}

/// `a[m×k] · b[k×n]` for 2-D tensors of any strides.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_dtype("matmul", a, b)?;
    if a.dims() != 2 || b.dims() != 2 || a.shape()[1] != b.shape()[0] {
        return Err(shape_err(
            "matmul",
            format!("cannot multiply {:?} by {:?}", a.shape(), b.shape()),
        ));
    }
    if on_gpu(a) {
        return cuda::matmul(a, b);
    }
    let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
    dispatch!(a, "matmul", T => {
        let (sa, sb) = (a.storage::<T>()?, b.storage::<T>()?);
        let c = T::gemm(
            m,
            k,
            n,
            (&sa, a.inner.offset, a.strides()[0] as isize, a.strides()[1] as isize),
            (&sb, b.inner.offset, b.strides()[0] as isize, b.strides()[1] as isize),
        );
        Ok(Tensor::from_vec_unchecked(c, vec![m, n]))
    })
}

/// Softmax (or log-softmax) over the last dimension.
pub(crate) fn softmax_last(x: &Tensor, log: bool) -> Result<Tensor> {
    if on_gpu(x) {
        return cuda::softmax_last(x, log);
    }
    let cols = *x.shape().last().unwrap_or(&1);
    dispatch!(x, "softmax", T => {
        let v = x.values::<T>()?;
        let mut out = vec![T::ZERO; v.len()];
        for (row, o) in v.chunks(cols.max(1)).zip(out.chunks_mut(cols.max(1))) {
            let m = row.iter().copied().fold(row[0], T::max);
            let mut s = T::ZERO;
            for (oi, &xi) in o.iter_mut().zip(row) {
                *oi = (xi - m).exp();
                s += *oi;
            }
            if log {
                let ls = s.ln();
                for (oi, &xi) in o.iter_mut().zip(row) {
                    *oi = xi - m - ls;
                }
            } else {
                for oi in o.iter_mut() {
                    *oi /= s;
                }
            }
        }
        Ok(Tensor::from_vec_unchecked(out, x.shape().to_vec()))
    })
}

/// The input gradient of `softmax_last` (`log`: of log-softmax) given its output `y`.
pub(crate) fn softmax_last_backward(y: &Tensor, g: &Tensor, log: bool) -> Result<Tensor> {
    if on_gpu(y) {
        return cuda::softmax_last_backward(y, g, log);
    }
    let cols = *y.shape().last().unwrap_or(&1);
    dispatch!(y, "softmax backward", T => {
        let (yv, gv) = (y.values::<T>()?, g.values::<T>()?);
        let mut out = vec![T::ZERO; yv.len()];
        for ((yr, gr), o) in yv.chunks(cols.max(1)).zip(gv.chunks(cols.max(1))).zip(out.chunks_mut(cols.max(1))) {
            if log {
                let s: T = gr.iter().copied().sum();
                for ((oi, &yi), &gi) in o.iter_mut().zip(yr).zip(gr) {
                    *oi = gi - yi.exp() * s;
                }
            } else {
                let s: T = gr.iter().zip(yr).map(|(&gi, &yi)| gi * yi).sum();
                for ((oi, &yi), &gi) in o.iter_mut().zip(yr).zip(gr) {
                    *oi = yi * (gi - s);
                }
            }
        }
        Ok(Tensor::from_vec_unchecked(out, y.shape().to_vec()))
    })
}

/// `$body!(T)` with `T` the element type of `$dtype`, for kernels that only move elements.
macro_rules! every_dtype {
    ($dtype:expr, $body:ident) => {
        match $dtype {
            DType::F32 => $body!(f32),
            DType::F64 => $body!(f64),
            DType::I64 => $body!(i64),
            DType::F16 => $body!(half::f16),
            DType::BF16 => $body!(half::bf16),
        }
    };
}

/// Rows `indices` of `t` along dimension 0.
pub(crate) fn index_rows(t: &Tensor, indices: &[usize]) -> Result<Tensor> {
    t.check_cpu("index_rows (embedding)")?;
    let row: usize = t.shape()[1..].iter().product();
    macro_rules! gather {
        ($ty:ty) => {{
            let v = t.values::<$ty>()?;
            let mut out = Vec::with_capacity(indices.len() * row);
            for &i in indices {
                out.extend_from_slice(&v[i * row..(i + 1) * row]);
            }
            let mut shape = t.shape().to_vec();
            shape[0] = indices.len();
            Tensor::from_vec_unchecked(out, shape)
        }};
    }
    Ok(every_dtype!(t.dtype(), gather))
}

/// Where each element of a gather's output comes from in the row-major layout of `shape`:
/// element `k` of the index (row-major over `index_shape`, values `index`) with its coordinate
/// along `dim` replaced by `index[k]`. The caller checked `index_shape` against `shape` and
/// every value against `shape[dim]`.
pub(crate) fn gather_offsets(shape: &[usize], dim: usize, index: &[usize], index_shape: &[usize]) -> Vec<usize> {
    let strides = contiguous_strides(shape);
    let mut coord = vec![0usize; index_shape.len()];
    let mut out = Vec::with_capacity(index.len());
    for &i in index {
        let offset: usize = (0..shape.len())
            .map(|d| if d == dim { i } else { coord[d] } * strides[d])
            .sum();
        out.push(offset);
        for d in (0..index_shape.len()).rev() {
            coord[d] += 1;
            if coord[d] < index_shape[d] {
                break;
            }
            coord[d] = 0;
        }
    }
    out
}

/// Where each element of an index_select's output comes from in the row-major layout of
/// `shape`: the slices `index` (checked against `shape[dim]`) along `dim`, in order.
pub(crate) fn select_offsets(shape: &[usize], dim: usize, index: &[usize]) -> Vec<usize> {
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * index.len() * inner);
    for o in 0..outer {
        for &k in index {
            let from = (o * shape[dim] + k) * inner;
            out.extend(from..from + inner);
        }
    }
    out
}

/// The elements of `t` at `offsets` (into its row-major values), shaped `shape`.
pub(crate) fn gather(t: &Tensor, offsets: &[usize], shape: Vec<usize>) -> Result<Tensor> {
    t.check_cpu("gather")?;
    macro_rules! pick {
        ($ty:ty) => {{
            let v = t.values::<$ty>()?;
            Tensor::from_vec_unchecked(offsets.iter().map(|&o| v[o]).collect::<Vec<$ty>>(), shape)
        }};
    }
    Ok(every_dtype!(t.dtype(), pick))
}

/// Zeros of `shape` with `g[k]` added at `offsets[k]` (into its row-major values): a gather's
/// gradient.
pub(crate) fn scatter_add(shape: &[usize], offsets: &[usize], g: &Tensor) -> Result<Tensor> {
    if g.numel() != offsets.len() {
        return Err(shape_err(
            "gather (its gradient)",
            format!("{:?} for {} elements", g.shape(), offsets.len()),
        ));
    }
    let dense;
    let g = if g.is_sparse() {
        dense = g.to_dense()?;
        &dense
    } else {
        g
    };
    dispatch!(g, "gather (its gradient)", T => {
        let mut out: Vec<T> = vec![0.0; numel(shape)];
        for (&o, &x) in offsets.iter().zip(g.values::<T>()?.iter()) {
            out[o] += x;
        }
        Ok(Tensor::from_vec_unchecked(out, shape.to_vec()))
    })
}

/// `base` with `rows[i]` added to row `indices[i]` (a new tensor).
pub(crate) fn index_add_rows(base: &Tensor, indices: &[usize], rows: &Tensor) -> Result<Tensor> {
    base.check_cpu("index_add_rows (sparse gradients)")?;
    let row: usize = base.shape()[1..].iter().product();
    if rows.numel() != indices.len() * row {
        return Err(shape_err(
            "index_add",
            format!("{} rows of {row} for {:?}", indices.len(), rows.shape()),
        ));
    }
    dispatch!(base, "index_add", T => {
        let mut out = base.values::<T>()?.into_owned();
        let r = rows.values::<T>()?;
        for (k, &i) in indices.iter().enumerate() {
            if (i + 1) * row > out.len() {
                return Err(crate::error::Error::Index { op: "index_add", index: i as i64, size: base.shape()[0] });
            }
            for (o, &x) in out[i * row..(i + 1) * row].iter_mut().zip(&r[k * row..(k + 1) * row]) {
                *o += x;
            }
        }
        Ok(Tensor::from_vec_unchecked(out, base.shape().to_vec()))
    })
}

fn cat_typed<T: Pod>(parts: &[Tensor], dim: usize, shape: Vec<usize>) -> Result<Tensor> {
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let values: Vec<_> = parts.iter().map(|t| t.values::<T>()).collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(numel(&shape));
    for o in 0..outer {
        for (t, v) in parts.iter().zip(&values) {
            let chunk = t.shape()[dim] * inner;
            out.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok(Tensor::from_vec_unchecked(out, shape))
}

/// Concatenation along `dim` (any dtype).
pub(crate) fn cat_raw(parts: &[Tensor], dim: usize) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| shape_err("cat", "no tensors"))?;
    if dim >= first.dims() {
        return Err(shape_err(
            "cat",
            format!("dimension {dim} of a {}-d tensor", first.dims()),
        ));
    }
    let mut shape = first.shape().to_vec();
    shape[dim] = 0;
    for t in parts {
        let same_rest = t.dims() == first.dims()
            && t.shape()
                .iter()
                .zip(first.shape())
                .enumerate()
                .all(|(d, (a, b))| d == dim || a == b);
        if !same_rest || t.dtype() != first.dtype() {
            return Err(shape_err(
                "cat",
                format!(
                    "{:?} {} next to {:?} {}",
                    t.shape(),
                    t.dtype(),
                    first.shape(),
                    first.dtype()
                ),
            ));
        }
        shape[dim] += t.shape()[dim];
    }
    if on_gpu(first) {
        return cuda::cat(parts, dim, shape);
    }
    match first.dtype() {
        DType::F32 => cat_typed::<f32>(parts, dim, shape),
        DType::F64 => cat_typed::<f64>(parts, dim, shape),
        DType::I64 => cat_typed::<i64>(parts, dim, shape),
        DType::F16 => cat_typed::<half::f16>(parts, dim, shape),
        DType::BF16 => cat_typed::<half::bf16>(parts, dim, shape),
    }
}

/// Zeros of `shape` with `g` placed at `start..` along `dim` (the backward of `narrow`).
pub(crate) fn pad_narrow(g: &Tensor, shape: &[usize], dim: usize, start: usize) -> Result<Tensor> {
    if on_gpu(g) {
        return cuda::pad_narrow(g, shape, dim, start);
    }
    let mut parts = Vec::new();
    let mut before = shape.to_vec();
    before[dim] = start;
    let mut after = shape.to_vec();
    after[dim] = shape[dim] - start - g.shape()[dim];
    if start > 0 {
        parts.push(Tensor::zeros(&before, g.dtype())?);
    }
    parts.push(g.clone());
    if after[dim] > 0 {
        parts.push(Tensor::zeros(&after, g.dtype())?);
    }
    cat_raw(&parts, dim)
}

/// Mean negative log-likelihood of `targets` under row-wise log-probabilities `logp`.
pub(crate) fn nll_loss(logp: &Tensor, targets: &[usize]) -> Result<Tensor> {
    if on_gpu(logp) {
        return cuda::nll_loss(logp, targets);
    }
    let c = logp.shape()[1];
    dispatch!(logp, "nll_loss", T => {
        let v = logp.values::<T>()?;
        let s: T = targets.iter().enumerate().map(|(i, &t)| v[i * c + t]).sum();
        Ok(Tensor::from_vec_unchecked(vec![-s / T::from_f64(targets.len().max(1) as f64)], vec![]))
    })
}

pub(crate) fn nll_loss_backward(g: &Tensor, shape: &[usize], targets: &[usize]) -> Result<Tensor> {
    if on_gpu(g) {
        return cuda::nll_loss_backward(g, shape, targets);
    }
    let c = shape[1];
    dispatch!(g, "nll_loss backward", T => {
        let gv = g.values::<T>()?[0];
        let mut out = vec![T::ZERO; numel(shape)];
        let w = -gv / T::from_f64(targets.len().max(1) as f64);
        for (i, &t) in targets.iter().enumerate() {
            out[i * c + t] = w;
        }
        Ok(Tensor::from_vec_unchecked(out, shape.to_vec()))
    })
}
