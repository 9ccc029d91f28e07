//! Differentiable operations. Each computes through the kernels of `cpu` and records a node
//! whose backward is written with the same kernels. Saved tensors are detached, so a node never
//! holds its own outputs' graph (no reference cycles).

use sluice_channel::Device;

use crate::cpu::{self, dispatch, map, zip_map};
use crate::cuda::{self as gpu, Op};
use crate::dtype::Float;
use crate::error::{shape_err, Result};
use crate::graph::record1;
use crate::tensor::{contiguous_strides, numel, Tensor};

fn need(ts: &[&Tensor]) -> Vec<bool> {
    ts.iter().map(|t| t.requires_grad()).collect()
}

/// `torch.gather`'s shape rule: an index with as many dimensions as `shape` (not 0-d), no longer
/// than it in any dimension but `dim`, unless the index is empty.
pub(crate) fn gather_fits(shape: &[usize], dim: usize, index: &[usize]) -> bool {
    dim < shape.len()
        && index.len() == shape.len()
        && (numel(index) == 0
            || index
                .iter()
                .zip(shape)
                .enumerate()
                .all(|(k, (&i, &n))| k == dim || i <= n))
}

fn dim_index(op: &'static str, t: &Tensor, dim: isize) -> Result<usize> {
    let n = t.dims() as isize;
    let d = if dim < 0 { dim + n } else { dim };
    if d < 0 || d >= n.max(1) {
        return Err(shape_err(op, format!("dimension {dim} of a {n}-d tensor")));
    }
    Ok(d as usize)
}

/// `zip_map` of two same-dtype tensors through a per-type closure on the CPU, the kernel op
/// `$cuda` on a GPU.
macro_rules! zip {
    ($a:expr, $b:expr, $cuda:ident, $op:literal, |$x:ident, $y:ident| $e:expr) => {
        if $a.device() != Device::Cpu {
            gpu::binary(Op::$cuda, $a, $b)?
        } else {
            dispatch!($a, $op, T => zip_map::<T>($op, $a, $b, |$x: T, $y: T| $e))?
        }
    };
}

/// `t` repeated to `shape` along broadcast dimensions (a materialized copy).
fn broadcast_to(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if t.shape() == shape {
        return Ok(t.clone());
    }
    if t.device() != Device::Cpu {
        // A view with zero strides along broadcast dimensions, copied out.
        let view = t.view_raw(shape.to_vec(), cpu::broadcast_strides(t, shape), t.inner.offset);
        return gpu::contiguous(&view);
    }
    let zeros = Tensor::zeros(shape, t.dtype())?;
    Ok(zip!(&zeros, t, Second, "expand", |_x, y| y))
}

macro_rules! binary_op {
    ($(#[$doc:meta])* $name:ident, $node:literal, $cuda:ident, |$x:ident, $y:ident| $fwd:expr, |$g:ident, $a:ident, $b:ident| ($ga:expr, $gb:expr)) => {
        $(#[$doc])*
        pub fn $name(&self, other: &Tensor) -> Result<Tensor> {
            let out = zip!(self, other, $cuda, $node, |$x, $y| $fwd);
            let ($a, $b) = (self.detach(), other.detach());
            let needed = need(&[self, other]);
            Ok(record1($node, &[self, other], out, move |$g| {
                let $g = $g.clone();
                let ga = if needed[0] { Some(cpu::sum_to(&$ga, $a.shape())?) } else { None };
                let gb = if needed[1] { Some(cpu::sum_to(&$gb, $b.shape())?) } else { None };
                Ok(vec![ga, gb])
            }))
        }
    };
}

macro_rules! unary_op {
    ($(#[$doc:meta])* $name:ident, $node:literal, $cuda:ident, |$x:ident| $fwd:expr, save = $save:ident, |$g:ident, $s:ident| $bwd:expr) => {
        $(#[$doc])*
        pub fn $name(&self) -> Result<Tensor> {
            let out = if self.device() != Device::Cpu {
                gpu::unary(Op::$cuda, self, 0.0)?
            } else {
                dispatch!(self, $node, T => map::<T>(self, |$x: T| $fwd))?
            };
            let saved = unary_op!(@save $save, self, out);
            Ok(record1($node, &[self], out, move |$g| {
                let $s = &saved;
                Ok(vec![Some($bwd)])
            }))
        }
    };
    (@save input, $inp:expr, $out:expr) => { $inp.detach() };
    (@save output, $inp:expr, $out:expr) => { $out.detach() };
}

impl Tensor {
    binary_op!(
        /// Elementwise sum with broadcasting.
        add, "Add", Add, |x, y| x + y, |g, a, b| (g, g));
    binary_op!(
        /// Elementwise difference with broadcasting.
        sub, "Sub", Sub, |x, y| x - y, |g, a, b| (g, cpu::scale(&g, -1.0)?));
    binary_op!(
        /// Elementwise product with broadcasting.
        mul, "Mul", Mul, |x, y| x * y, |g, a, b| (zip!(&g, &b, Mul, "mul", |x, y| x * y), zip!(&g, &a, Mul, "mul", |x, y| x * y)));
    binary_op!(
    /// Elementwise quotient with broadcasting.
    div, "Div", Div, |x, y| x / y, |g, a, b| (
        zip!(&g, &b, Div, "div", |x, y| x / y),
        zip!(&zip!(&g, &a, Mul, "mul", |x, y| x * y), &b, DivisorBackward, "div", |x, y| -x / (y * y))
    ));

    unary_op!(
        /// −x.
        neg, "Neg", Neg, |x| -x, save = input, |g, _s| cpu::scale(g, -1.0)?);
    unary_op!(exp, "Exp", Exp, |x| x.exp(), save = output, |g, y| zip!(
        g,
        y,
        Mul,
        "exp",
        |g, y| g * y
    ));
    unary_op!(
        /// Natural logarithm.
        log, "Log", Log, |x| x.ln(), save = input, |g, x| zip!(g, x, Div, "log", |g, x| g / x));
    unary_op!(
        relu,
        "Relu",
        Relu,
        |x| if x > T::ZERO { x } else { T::ZERO },
        save = input,
        |g, x| zip!(g, x, ReluBackward, "relu", |g, x| if x > T::ZERO { g } else { T::ZERO })
    );
    unary_op!(tanh, "Tanh", Tanh, |x| x.tanh(), save = output, |g, y| zip!(
        g,
        y,
        TanhBackward,
        "tanh",
        |g, y| g * (T::ONE - y * y)
    ));
    unary_op!(
        sigmoid,
        "Sigmoid",
        Sigmoid,
        |x| T::ONE / (T::ONE + (-x).exp()),
        save = output,
        |g, y| zip!(g, y, SigmoidBackward, "sigmoid", |g, y| g * y * (T::ONE - y))
    );
    unary_op!(cos, "Cos", Cos, |x| x.cos(), save = input, |g, x| zip!(
        g,
        x,
        CosBackward,
        "cos",
        |g, x| -g * x.sin()
    ));
    unary_op!(sin, "Sin", Sin, |x| x.sin(), save = input, |g, x| zip!(
        g,
        x,
        SinBackward,
        "sin",
        |g, x| g * x.cos()
    ));

    /// A copy on `device` (host↔GPU, GPU↔GPU); recorded, so gradients flow back to the
    /// source's device. Itself when already there.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.clone());
        }
        let out = if self.device() == Device::Cpu && !matches!(device, Device::Cuda(_)) {
            return Err(crate::error::Error::Device {
                op: "to_device",
                device: device.to_string(),
            });
        } else {
            gpu::to_device(self, device)?
        };
        let from = self.device();
        Ok(record1("ToDevice", &[self], out, move |g| {
            Ok(vec![Some(g.to_device(from)?)])
        }))
    }

    /// `self · s`.
    pub fn mul_scalar(&self, s: f64) -> Result<Tensor> {
        let out = cpu::scale(self, s)?;
        Ok(record1("MulScalar", &[self], out, move |g| {
            Ok(vec![Some(cpu::scale(g, s)?)])
        }))
    }

    /// `self + s`.
    pub fn add_scalar(&self, s: f64) -> Result<Tensor> {
        let out = if self.device() != Device::Cpu {
            gpu::unary(Op::AddScalar, self, s)?
        } else {
            dispatch!(self, "add", T => { let s = T::from_f64(s); map::<T>(self, |x| x + s) })?
        };
        Ok(record1("AddScalar", &[self], out, move |g| Ok(vec![Some(g.clone())])))
    }

    /// Matrix product of 2-D tensors (any strides: transposed views are not copied).
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let out = cpu::matmul(self, other)?;
        let (a, b) = (self.detach(), other.detach());
        let needed = need(&[self, other]);
        Ok(record1("MatMul", &[self, other], out, move |g| {
            let ga = if needed[0] {
                Some(cpu::matmul(g, &b.transpose_raw(0, 1))?)
            } else {
                None
            };
            let gb = if needed[1] {
                Some(cpu::matmul(&a.transpose_raw(0, 1), g)?)
            } else {
                None
            };
            Ok(vec![ga, gb])
        }))
    }

    /// Sum of every element (a 0-d tensor).
    pub fn sum(&self) -> Result<Tensor> {
        let out = cpu::sum_dims(self, &vec![true; self.dims()], false)?;
        let shape = self.shape().to_vec();
        Ok(record1("Sum", &[self], out, move |g| {
            Ok(vec![Some(broadcast_to(g, &shape)?)])
        }))
    }

    /// Sum along `dim` (negative counts from the end).
    pub fn sum_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = dim_index("sum_dim", self, dim)?;
        let reduce: Vec<bool> = (0..self.dims()).map(|i| i == d).collect();
        let out = cpu::sum_dims(self, &reduce, keepdim)?;
        let shape = self.shape().to_vec();
        Ok(record1("SumDim", &[self], out, move |g| {
            let mut kept = shape.clone();
            kept[d] = 1;
            let g = g.contiguous_raw()?.view_raw(kept.clone(), contiguous_strides(&kept), 0);
            Ok(vec![Some(broadcast_to(&g, &shape)?)])
        }))
    }

    /// Mean of every element.
    pub fn mean(&self) -> Result<Tensor> {
        self.sum()?.mul_scalar(1.0 / self.numel().max(1) as f64)
    }

    /// Mean along `dim`.
    pub fn mean_dim(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = dim_index("mean_dim", self, dim)?;
        let n = self.shape()[d].max(1);
        self.sum_dim(dim, keepdim)?.mul_scalar(1.0 / n as f64)
    }

    fn softmax_impl(&self, dim: isize, log: bool) -> Result<Tensor> {
        let d = dim_index("softmax", self, dim)?;
        let last = self.dims().saturating_sub(1);
        if d != last {
            return self.transpose(d, last)?.softmax_impl(-1, log)?.transpose(d, last);
        }
        let out = cpu::softmax_last(self, log)?;
        let y = out.detach();
        Ok(record1(
            if log { "LogSoftmax" } else { "Softmax" },
            &[self],
            out,
            move |g| Ok(vec![Some(cpu::softmax_last_backward(&y, g, log)?)]),
        ))
    }

    /// Softmax along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax along `dim` (computed stably, not as log(softmax)).
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }

    /// The same elements in a new shape (a view when contiguous).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            return Err(shape_err("reshape", format!("{:?} into {:?}", self.shape(), shape)));
        }
        let c = self.contiguous_raw()?;
        let offset = c.inner.offset;
        let out = c.view_raw(shape.to_vec(), contiguous_strides(shape), offset);
        let from = self.shape().to_vec();
        Ok(record1("Reshape", &[self], out, move |g| {
            let g = g.contiguous_raw()?;
            let offset = g.inner.offset;
            Ok(vec![Some(g.view_raw(from.clone(), contiguous_strides(&from), offset))])
        }))
    }

    pub(crate) fn transpose_raw(&self, d0: usize, d1: usize) -> Tensor {
        let mut shape = self.shape().to_vec();
        let mut strides = self.strides().to_vec();
        shape.swap(d0, d1);
        strides.swap(d0, d1);
        self.view_raw(shape, strides, self.inner.offset)
    }

    /// Swaps two dimensions (a view).
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Tensor> {
        if d0 >= self.dims() || d1 >= self.dims() {
            return Err(shape_err(
                "transpose",
                format!("dimensions {d0}, {d1} of {:?}", self.shape()),
            ));
        }
        let out = self.transpose_raw(d0, d1);
        Ok(record1("Transpose", &[self], out, move |g| {
            Ok(vec![Some(g.transpose_raw(d0, d1))])
        }))
    }

    /// Transpose of a 2-D tensor (a view).
    pub fn t(&self) -> Result<Tensor> {
        if self.dims() != 2 {
            return Err(shape_err("t", format!("{:?} is not 2-d", self.shape())));
        }
        self.transpose(0, 1)
    }

    /// Elements `start..start + len` along `dim` (a view).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        if dim >= self.dims() || start + len > self.shape()[dim] {
            return Err(shape_err(
                "narrow",
                format!("{start}..{} of dimension {dim} of {:?}", start + len, self.shape()),
            ));
        }
        let mut shape = self.shape().to_vec();
        shape[dim] = len;
        let out = self.view_raw(
            shape,
            self.strides().to_vec(),
            self.inner.offset + start * self.strides()[dim],
        );
        let full = self.shape().to_vec();
        Ok(record1("Narrow", &[self], out, move |g| {
            Ok(vec![Some(cpu::pad_narrow(&g.contiguous_raw()?, &full, dim, start)?)])
        }))
    }

    /// Pieces of the given sizes along `dim` (views).
    pub fn split(&self, sizes: &[usize], dim: usize) -> Result<Vec<Tensor>> {
        if dim >= self.dims() || sizes.iter().sum::<usize>() != self.shape()[dim] {
            return Err(shape_err(
                "split",
                format!("sizes {sizes:?} along {dim} of {:?}", self.shape()),
            ));
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&n| {
                let piece = self.narrow(dim, start, n);
                start += n;
                piece
            })
            .collect()
    }

    /// A row-major copy, recorded (itself when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let out = self.contiguous_raw()?;
        Ok(record1("Contiguous", &[self], out, |g| Ok(vec![Some(g.clone())])))
    }

    /// The identity, whose backward fails with `message` (PyTorch's `SimulateBackwardError`):
    /// for testing how failures in a backward pass are reported.
    pub fn fail_in_backward(&self, message: &str) -> Result<Tensor> {
        let message = message.to_owned();
        Ok(record1("FailInBackward", &[self], self.detach(), move |_| {
            Err(crate::error::Error::Backward(message.clone()))
        }))
    }

    /// The slices `indices` (a 1-d i64 tensor) along `dim` (negative: from the end), as
    /// `torch.index_select`: the output is this tensor with `dim` `indices.len()` long.
    /// Indices repeat freely; their gradients add up.
    pub fn index_select(&self, dim: isize, indices: &Tensor) -> Result<Tensor> {
        let d = dim_index("index_select", self, dim)?;
        if self.dims() == 0 || indices.dims() != 1 {
            return Err(shape_err(
                "index_select",
                format!(
                    "indices {:?} along dimension {dim} of {:?}",
                    indices.shape(),
                    self.shape()
                ),
            ));
        }
        let shape = self.shape().to_vec();
        let idx = indices.index_values("index_select", shape[d])?;
        let out = cpu::gather(self, &cpu::select_offsets(&shape, d, &idx), {
            let mut out = shape.clone();
            out[d] = idx.len();
            out
        })?;
        // The backward recomputes the offsets rather than keeping one per element.
        Ok(record1("IndexSelect", &[self], out, move |g| {
            Ok(vec![Some(cpu::scatter_add(
                &shape,
                &cpu::select_offsets(&shape, d, &idx),
                g,
            )?)])
        }))
    }

    /// Elements picked along `dim` (negative: from the end) by `index` (an i64 tensor with as
    /// many dimensions as this one, no longer than it in any other dimension unless empty), as
    /// `torch.gather`: the output has `index`'s shape, and its element at a coordinate is this
    /// tensor's at the same coordinate with the one along `dim` replaced by the index's value
    /// there. Indices repeat freely; their gradients add up.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let d = dim_index("gather", self, dim)?;
        let shape = self.shape().to_vec();
        if !gather_fits(&shape, d, index.shape()) {
            return Err(shape_err(
                "gather",
                format!("index {:?} along dimension {dim} of {shape:?}", index.shape()),
            ));
        }
        let idx = index.index_values("gather", shape[d])?;
        let offsets = cpu::gather_offsets(&shape, d, &idx, index.shape());
        let out = cpu::gather(self, &offsets, index.shape().to_vec())?;
        Ok(record1("Gather", &[self], out, move |g| {
            Ok(vec![Some(cpu::scatter_add(&shape, &offsets, g)?)])
        }))
    }

    /// Rows `indices` (an i64 tensor) along dimension 0.
    pub fn index_rows(&self, indices: &Tensor) -> Result<Tensor> {
        if self.dims() == 0 {
            return Err(shape_err("index_rows", "a 0-d tensor has no rows"));
        }
        let idx = indices.index_values("index_rows", self.shape()[0])?;
        let out = cpu::index_rows(self, &idx)?;
        let shape = self.shape().to_vec();
        Ok(record1("IndexRows", &[self], out, move |g| {
            Ok(vec![Some(cpu::index_add_rows(
                &Tensor::zeros(&shape, g.dtype())?,
                &idx,
                g,
            )?)])
        }))
    }
}

/// Concatenation along `dim`.
pub fn cat(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
    let out = cpu::cat_raw(tensors, dim)?;
    let sizes: Vec<usize> = tensors.iter().map(|t| t.shape()[dim]).collect();
    let refs: Vec<&Tensor> = tensors.iter().collect();
    Ok(record1("Cat", &refs, out, move |g| {
        let mut start = 0;
        Ok(sizes
            .iter()
            .map(|&n| {
                let mut shape = g.shape().to_vec();
                shape[dim] = n;
                let piece = g.view_raw(shape, g.strides().to_vec(), g.inner.offset + start * g.strides()[dim]);
                start += n;
                Some(piece)
            })
            .collect())
    }))
}

/// `x · wᵀ + b` for `x: [batch, in]`, `w: [out, in]`, `b: [out]`. One node, so `w`'s
/// gradient is computed as `gᵀ · x` straight into `w`'s own layout (no transpose to copy).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if w.dims() != 2 || x.dims() != 2 || x.shape()[1] != w.shape()[1] {
        return Err(shape_err(
            "linear",
            format!("input {:?}, weight {:?}", x.shape(), w.shape()),
        ));
    }
    if let Some(b) = b {
        if b.shape() != [w.shape()[0]] {
            return Err(shape_err(
                "linear",
                format!("bias {:?} for weight {:?}", b.shape(), w.shape()),
            ));
        }
    }
    let y = cpu::matmul(x, &w.transpose_raw(0, 1))?;
    let y = match b {
        Some(b) => cpu::binary_add(&y, b)?,
        None => y,
    };
    let (xs, ws) = (x.detach(), w.detach());
    let mut inputs = vec![x, w];
    inputs.extend(b);
    let needed = need(&inputs);
    Ok(record1("Linear", &inputs, y, move |g| {
        let gx = if needed[0] { Some(cpu::matmul(g, &ws)?) } else { None };
        let gw = if needed[1] {
            Some(cpu::matmul(&g.transpose_raw(0, 1), &xs)?)
        } else {
            None
        };
        let mut out = vec![gx, gw];
        if needed.len() == 3 {
            out.push(if needed[2] {
                Some(cpu::sum_dims(g, &[true, false], false)?)
            } else {
                None
            });
        }
        Ok(out)
    }))
}

/// Mean negative log-likelihood: `logp: [batch, classes]` log-probabilities, `targets` i64.
pub fn nll_loss(logp: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if logp.dims() != 2 || targets.shape() != [logp.shape()[0]] {
        return Err(shape_err(
            "nll_loss",
            format!("log-probabilities {:?}, targets {:?}", logp.shape(), targets.shape()),
        ));
    }
    let t = targets.index_values("nll_loss", logp.shape()[1])?;
    let out = cpu::nll_loss(logp, &t)?;
    let shape = logp.shape().to_vec();
    Ok(record1("NllLoss", &[logp], out, move |g| {
        Ok(vec![Some(cpu::nll_loss_backward(g, &shape, &t)?)])
    }))
}

/// Cross-entropy of raw scores: `nll_loss(log_softmax(logits))`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    nll_loss(&logits.log_softmax(-1)?, targets)
}

/// Rows of `weight: [vocab, dim]` picked by `indices` (any shape): `[indices…, dim]`. Its
/// gradient for `weight` is sparse: only the rows that were used.
pub fn embedding(weight: &Tensor, indices: &Tensor) -> Result<Tensor> {
    if weight.dims() != 2 {
        return Err(shape_err(
            "embedding",
            format!("weight {:?} is not 2-d", weight.shape()),
        ));
    }
    let idx = indices.index_values("embedding", weight.shape()[0])?;
    let rows = cpu::index_rows(weight, &idx)?;
    let mut shape = indices.shape().to_vec();
    shape.push(weight.shape()[1]);
    let out = rows.view_raw(shape.clone(), contiguous_strides(&shape), 0);
    let wshape = weight.shape().to_vec();
    Ok(record1("Embedding", &[weight], out, move |g| {
        let rows = g.contiguous_raw()?;
        let rows = rows.view_raw(
            vec![idx.len(), wshape[1]],
            contiguous_strides(&[idx.len(), wshape[1]]),
            rows.inner.offset,
        );
        Ok(vec![Some(Tensor::sparse_rows(idx.clone(), rows, wshape.clone())?)])
    }))
}

/// Mean squared error.
pub fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    let d = pred.sub(target)?;
    d.mul(&d)?.mean()
}

/// Fraction of rows whose highest score is the target (no graph).
pub fn accuracy(logits: &Tensor, targets: &Tensor) -> Result<f64> {
    let c = *logits
        .shape()
        .last()
        .ok_or_else(|| shape_err("accuracy", "0-d scores"))?;
    let v = logits.to_f64_vec()?;
    let t = targets.index_values("accuracy", c)?;
    let right = v
        .chunks(c)
        .zip(&t)
        .filter(|(row, &t)| row.iter().enumerate().all(|(i, &x)| x <= row[t] || i == t))
        .count();
    Ok(right as f64 / t.len().max(1) as f64)
}
