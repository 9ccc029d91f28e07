//! The tensor: shape, strides and a dtype over a raw, shared, immutable buffer.
//!
//! A CPU buffer is a `bytes::Bytes`, so a tensor received through the agent *is* the received
//! buffer (no copy), and a tensor sent through it is a slice of its own storage. Views
//! (`transpose`, `narrow`, `split`, `reshape` of a contiguous tensor) share storage.
//!
//! Gradient identity: a leaf that requires grad carries a [`LeafState`]; its [`LeafId`] is the
//! key of distributed gradients (`dist::Context::gradients`). Parameters keep one `LeafState`
//! while their data is replaced by optimizer steps.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use sluice_channel::Device;

use crate::dtype::{DType, Pod};
use crate::error::{shape_err, Error, Result};
use crate::graph::{Edge, LeafState};

/// The identity of a leaf that requires grad: the key of gradients in a distributed context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct LeafId(pub u64);

static NEXT_LEAF: AtomicU64 = AtomicU64::new(1);

impl LeafId {
    pub(crate) fn fresh() -> LeafId {
        LeafId(NEXT_LEAF.fetch_add(1, Ordering::Relaxed))
    }
}

#[derive(Clone)]
pub(crate) enum GradMeta {
    Leaf(Arc<LeafState>),
    Output(Edge),
}

/// A tensor. Clones are cheap and share data and gradient identity.
#[derive(Clone)]
pub struct Tensor {
    pub(crate) inner: Arc<Inner>,
}

/// Where a tensor's elements live.
#[derive(Clone)]
pub(crate) enum Storage {
    Cpu(Bytes),
    /// Device memory; the buffer's stream orders every use (see `crate::cuda`).
    Cuda(sluice_channel::CudaBuffer),
}

impl Storage {
    /// Bytes of storage.
    pub(crate) fn len(&self) -> usize {
        match self {
            Storage::Cpu(b) => b.len(),
            Storage::Cuda(b) => b.len(),
        }
    }
}

#[derive(Clone)]
pub(crate) struct Inner {
    pub(crate) data: Storage,
    pub(crate) device: Device,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) strides: Vec<usize>,
    /// In elements.
    pub(crate) offset: usize,
    /// Sparse rows: the dense shape is `shape`; `data` holds `indices.len()` contiguous rows of
    /// `shape[1..]`, row `i` belonging to dense row `indices[i]` (repeats add up).
    pub(crate) sparse: Option<Arc<Vec<usize>>>,
    pub(crate) grad: Option<GradMeta>,
}

/// A `Vec<T>` handed to `Bytes` without a copy.
struct PodVec<T: Pod>(Vec<T>);

impl<T: Pod> AsRef<[u8]> for PodVec<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut s: usize = 1;
    for (d, &n) in shape.iter().enumerate().rev() {
        strides[d] = s;
        // Saturating: a shape too large to address gets strides that `from_bytes` rejects,
        // never an overflow panic (zero-sized tensors have any strides).
        s = s.saturating_mul(n.max(1));
    }
    strides
}

pub(crate) fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {:?}, {}", self.dtype(), self.shape(), self.device())?;
        if self.is_sparse() {
            write!(f, ", sparse rows {}", self.sparse_indices().map_or(0, |i| i.len()))?;
        }
        if self.requires_grad() {
            write!(f, ", requires_grad")?;
        }
        if self.numel() <= 16 && !self.is_sparse() && self.dtype().is_float() {
            if let Ok(v) = self.to_f64_vec() {
                write!(f, ", {v:?}")?;
            }
        }
        write!(f, ")")
    }
}

impl Tensor {
    pub(crate) fn from_inner(inner: Inner) -> Tensor {
        Tensor { inner: Arc::new(inner) }
    }

    /// A contiguous CPU tensor owning `values`.
    pub fn from_vec<T: Pod>(values: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        if values.len() != numel(shape) {
            return Err(shape_err(
                "from_vec",
                format!("{} values for shape {shape:?}", values.len()),
            ));
        }
        Ok(Tensor::from_vec_unchecked(values, shape.to_vec()))
    }

    pub(crate) fn from_vec_unchecked<T: Pod>(values: Vec<T>, shape: Vec<usize>) -> Tensor {
        debug_assert_eq!(values.len(), numel(&shape));
        let strides = contiguous_strides(&shape);
        Tensor::from_inner(Inner {
            data: Storage::Cpu(Bytes::from_owner(PodVec(values))),
            device: Device::Cpu,
            dtype: T::DTYPE,
            shape,
            strides,
            offset: 0,
            sparse: None,
            grad: None,
        })
    }

    /// A CPU tensor over raw bytes (little-endian elements), e.g. a buffer received from a peer.
    /// Checked: every element the shape and strides reach must lie inside `data`.
    pub fn from_bytes(data: Bytes, dtype: DType, shape: &[usize], strides: &[usize], offset: usize) -> Result<Tensor> {
        Tensor::over(Storage::Cpu(data), dtype, shape, strides, offset)
    }

    /// A CUDA tensor over device memory (e.g. a buffer received from a peer), checked like
    /// [`from_bytes`](Self::from_bytes). Ops on it wait for the work queued on the buffer's
    /// stream first.
    pub fn from_cuda(
        data: sluice_channel::CudaBuffer,
        dtype: DType,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Tensor> {
        Tensor::over(Storage::Cuda(data), dtype, shape, strides, offset)
    }

    /// A tensor over `data`, its layout checked against the storage's length.
    fn over(data: Storage, dtype: DType, shape: &[usize], strides: &[usize], offset: usize) -> Result<Tensor> {
        check_layout(data.len(), dtype, shape, strides, offset)?;
        Ok(Tensor::from_inner(Inner {
            device: match &data {
                Storage::Cpu(_) => Device::Cpu,
                Storage::Cuda(b) => Device::Cuda(b.device()),
            },
            data,
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            offset,
            sparse: None,
            grad: None,
        }))
    }

    pub fn from_slice<T: Pod>(values: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(values.to_vec(), shape)
    }

    /// A 0-dimensional tensor.
    pub fn scalar(value: f64, dtype: DType) -> Result<Tensor> {
        Tensor::full(&[], value, dtype)
    }

    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        let n = numel(shape);
        Ok(match dtype {
            DType::F32 => Tensor::from_vec_unchecked(vec![value as f32; n], shape.to_vec()),
            DType::F64 => Tensor::from_vec_unchecked(vec![value; n], shape.to_vec()),
            DType::F16 => Tensor::from_vec_unchecked(vec![half::f16::from_f64(value); n], shape.to_vec()),
            DType::BF16 => Tensor::from_vec_unchecked(vec![half::bf16::from_f64(value); n], shape.to_vec()),
            DType::I64 => Tensor::from_vec_unchecked(vec![value as i64; n], shape.to_vec()),
        })
    }

    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype)
    }

    pub fn ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype)
    }

    /// Normal(0, std²) values from a seeded generator (deterministic across runs and machines).
    pub fn randn(shape: &[usize], std: f64, seed: u64, dtype: DType) -> Result<Tensor> {
        let mut rng = Rng::new(seed);
        let v: Vec<f64> = (0..numel(shape)).map(|_| rng.normal() * std).collect();
        Tensor::from_vec_unchecked(v, shape.to_vec()).to_dtype(dtype)
    }

    /// Uniform values in [lo, hi) from a seeded generator.
    pub fn uniform(shape: &[usize], lo: f64, hi: f64, seed: u64, dtype: DType) -> Result<Tensor> {
        let mut rng = Rng::new(seed);
        let v: Vec<f64> = (0..numel(shape)).map(|_| lo + (hi - lo) * rng.unit()).collect();
        Tensor::from_vec_unchecked(v, shape.to_vec()).to_dtype(dtype)
    }

    /// Indices (i64), for `embedding`, `index_rows` and `nll_loss` targets.
    pub fn indices(values: &[usize], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(values.iter().map(|&v| v as i64).collect::<Vec<i64>>(), shape)
    }

    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }

    pub fn dims(&self) -> usize {
        self.inner.shape.len()
    }

    pub fn numel(&self) -> usize {
        numel(&self.inner.shape)
    }

    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    pub fn device(&self) -> Device {
        self.inner.device
    }

    pub fn strides(&self) -> &[usize] {
        &self.inner.strides
    }

    pub fn is_sparse(&self) -> bool {
        self.inner.sparse.is_some()
    }

    pub fn sparse_indices(&self) -> Option<&[usize]> {
        self.inner.sparse.as_deref().map(|v| v.as_slice())
    }

    pub fn is_contiguous(&self) -> bool {
        self.inner.sparse.is_none() && {
            let want = contiguous_strides(&self.inner.shape);
            self.inner
                .shape
                .iter()
                .zip(want.iter().zip(&self.inner.strides))
                .all(|(&n, (a, b))| n <= 1 || a == b)
        }
    }

    /// Whether this tensor records operations for backward.
    pub fn requires_grad(&self) -> bool {
        self.inner.grad.is_some()
    }

    /// The same data as a new leaf that requires grad (a fresh gradient identity).
    pub fn requires_grad_(self) -> Tensor {
        self.with_leaf(Arc::new(LeafState::new(LeafId::fresh())))
    }

    pub(crate) fn with_leaf(&self, leaf: Arc<LeafState>) -> Tensor {
        let mut inner = (*self.inner).clone();
        inner.grad = Some(GradMeta::Leaf(leaf));
        Tensor::from_inner(inner)
    }

    pub(crate) fn with_edge(&self, edge: Edge) -> Tensor {
        let mut inner = (*self.inner).clone();
        inner.grad = Some(GradMeta::Output(edge));
        Tensor::from_inner(inner)
    }

    /// The same data, cut from the graph.
    pub fn detach(&self) -> Tensor {
        if self.inner.grad.is_none() {
            return self.clone();
        }
        let mut inner = (*self.inner).clone();
        inner.grad = None;
        Tensor::from_inner(inner)
    }

    /// The gradient identity of a leaf that requires grad.
    pub fn leaf_id(&self) -> Option<LeafId> {
        match &self.inner.grad {
            Some(GradMeta::Leaf(l)) => Some(l.id),
            _ => None,
        }
    }

    pub(crate) fn leaf_state(&self) -> Option<&Arc<LeafState>> {
        match &self.inner.grad {
            Some(GradMeta::Leaf(l)) => Some(l),
            _ => None,
        }
    }

    /// The gradient a local backward accumulated into this leaf (distributed backwards never
    /// write here; see `dist::Context::gradients`).
    pub fn grad(&self) -> Option<Tensor> {
        self.leaf_state().and_then(|l| l.grad.lock().unwrap().clone())
    }

    pub fn zero_grad(&self) {
        if let Some(l) = self.leaf_state() {
            *l.grad.lock().unwrap() = None;
        }
    }

    /// The CPU storage (an error naming the device otherwise).
    pub(crate) fn cpu_bytes(&self) -> Result<&Bytes> {
        match &self.inner.data {
            Storage::Cpu(b) => Ok(b),
            Storage::Cuda(_) => Err(Error::Device {
                op: "host access",
                device: self.device().to_string(),
            }),
        }
    }

    /// The CUDA storage, if any.
    pub(crate) fn cuda_buffer(&self) -> Option<&sluice_channel::CudaBuffer> {
        match &self.inner.data {
            Storage::Cuda(b) => Some(b),
            Storage::Cpu(_) => None,
        }
    }

    pub(crate) fn check_cpu(&self, op: &'static str) -> Result<()> {
        match self.inner.device {
            Device::Cpu => Ok(()),
            d => Err(Error::Device {
                op,
                device: d.to_string(),
            }),
        }
    }

    /// The whole storage as `T` (borrowed when aligned, which allocator memory always is).
    pub(crate) fn storage<T: Pod>(&self) -> Result<Cow<'_, [T]>> {
        if self.inner.dtype != T::DTYPE {
            return Err(Error::DType {
                op: "storage",
                dtype: self.inner.dtype,
                hint: "",
            });
        }
        self.check_cpu("storage")?;
        let data = self.cpu_bytes()?;
        Ok(match bytemuck::try_cast_slice::<u8, T>(data) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec::<u8, T>(data)),
        })
    }

    /// The elements in row-major order (borrowed when the tensor is contiguous).
    pub(crate) fn values<T: Pod>(&self) -> Result<Cow<'_, [T]>> {
        let storage = self.storage::<T>()?;
        let n = self.numel();
        if self.is_contiguous() {
            return Ok(match storage {
                Cow::Borrowed(s) => Cow::Borrowed(&s[self.inner.offset..self.inner.offset + n]),
                Cow::Owned(v) => Cow::Owned(v[self.inner.offset..self.inner.offset + n].to_vec()),
            });
        }
        if self.is_sparse() {
            return Ok(Cow::Owned(storage[..].to_vec()));
        }
        let mut out = Vec::with_capacity(n);
        walk(
            &self.inner.shape,
            [&self.inner.strides],
            [self.inner.offset],
            |[o], [s], len| {
                if s == 1 {
                    out.extend_from_slice(&storage[o..o + len]);
                } else {
                    out.extend((0..len).map(|i| storage[o + i * s]));
                }
            },
        );
        Ok(Cow::Owned(out))
    }

    /// A copy of the elements in row-major order.
    pub fn to_vec<T: Pod>(&self) -> Result<Vec<T>> {
        if self.device() != Device::Cpu {
            return self.to_device(Device::Cpu)?.to_vec();
        }
        if self.is_sparse() {
            return self.to_dense()?.to_vec();
        }
        Ok(self.values::<T>()?.into_owned())
    }

    /// The elements as f64, whatever the float dtype.
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        self.to_dtype(DType::F64)?.to_vec::<f64>()
    }

    /// The value of a one-element tensor.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(shape_err(
                "item",
                format!("shape {:?} has {} elements", self.shape(), self.numel()),
            ));
        }
        Ok(self.to_f64_vec()?[0])
    }

    /// Indices held by an i64 tensor, checked against `bound`.
    pub(crate) fn index_values(&self, op: &'static str, bound: usize) -> Result<Vec<usize>> {
        if self.device() != Device::Cpu {
            // Indices steer host-side bookkeeping (and are checked here): read them back.
            return self.to_device(Device::Cpu)?.index_values(op, bound);
        }
        if self.inner.dtype != DType::I64 {
            return Err(Error::DType {
                op,
                dtype: self.inner.dtype,
                hint: " (indices must be i64)",
            });
        }
        self.values::<i64>()?
            .iter()
            .map(|&i| {
                if i < 0 || i as usize >= bound {
                    Err(Error::Index {
                        op,
                        index: i,
                        size: bound,
                    })
                } else {
                    Ok(i as usize)
                }
            })
            .collect()
    }

    /// The same values in another dtype (a copy unless the dtype is already `dtype`).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.inner.dtype {
            return Ok(self.detach());
        }
        if self.device() != Device::Cpu {
            return crate::cuda::cast(self, dtype);
        }
        let v64: Vec<f64> = match self.inner.dtype {
            DType::F32 => self.values::<f32>()?.iter().map(|&x| x as f64).collect(),
            DType::F64 => self.values::<f64>()?.into_owned(),
            DType::F16 => self.values::<half::f16>()?.iter().map(|x| x.to_f64()).collect(),
            DType::BF16 => self.values::<half::bf16>()?.iter().map(|x| x.to_f64()).collect(),
            DType::I64 => self.values::<i64>()?.iter().map(|&x| x as f64).collect(),
        };
        let shape = self.inner.shape.clone();
        let mut out = match dtype {
            DType::F32 => Tensor::from_vec_unchecked(v64.iter().map(|&x| x as f32).collect::<Vec<_>>(), shape),
            DType::F64 => Tensor::from_vec_unchecked(v64, shape),
            DType::F16 => {
                Tensor::from_vec_unchecked(v64.iter().map(|&x| half::f16::from_f64(x)).collect::<Vec<_>>(), shape)
            }
            DType::BF16 => {
                Tensor::from_vec_unchecked(v64.iter().map(|&x| half::bf16::from_f64(x)).collect::<Vec<_>>(), shape)
            }
            DType::I64 => Tensor::from_vec_unchecked(v64.iter().map(|&x| x as i64).collect::<Vec<_>>(), shape),
        };
        if let Some(idx) = &self.inner.sparse {
            Arc::make_mut(&mut out.inner).sparse = Some(idx.clone());
        }
        Ok(out)
    }

    /// A sparse-rows tensor with dense shape `shape` (see `is_sparse`).
    pub(crate) fn sparse_rows(indices: Vec<usize>, rows: Tensor, shape: Vec<usize>) -> Result<Tensor> {
        let mut inner = (*rows.contiguous_raw()?.inner).clone();
        inner.shape = shape;
        inner.strides = contiguous_strides(&inner.shape);
        inner.sparse = Some(Arc::new(indices));
        inner.grad = None;
        Ok(Tensor::from_inner(inner))
    }

    /// The values of a sparse tensor as a dense `[nnz, rest…]` tensor.
    pub(crate) fn sparse_values(&self) -> Tensor {
        let mut inner = (*self.inner).clone();
        let nnz = inner.sparse.take().map_or(0, |i| i.len());
        inner.shape[0] = nnz;
        inner.strides = contiguous_strides(&inner.shape);
        inner.grad = None;
        Tensor::from_inner(inner)
    }

    /// A dense copy of a sparse tensor (itself when dense).
    pub fn to_dense(&self) -> Result<Tensor> {
        let Some(indices) = &self.inner.sparse else {
            return Ok(self.clone());
        };
        crate::cpu::index_add_rows(
            &Tensor::zeros(&self.inner.shape, self.inner.dtype)?,
            indices,
            &self.sparse_values(),
        )
    }

    /// Row-major copy unless already contiguous (no graph recording).
    pub(crate) fn contiguous_raw(&self) -> Result<Tensor> {
        if self.is_contiguous() || self.is_sparse() {
            return Ok(self.detach());
        }
        if self.device() != Device::Cpu {
            return crate::cuda::contiguous(self);
        }
        macro_rules! copy {
            ($t:ty) => {
                Tensor::from_vec_unchecked(
                    self.values::<$t>().expect("dtype checked").into_owned(),
                    self.inner.shape.clone(),
                )
            };
        }
        Ok(match self.inner.dtype {
            DType::F32 => copy!(f32),
            DType::F64 => copy!(f64),
            DType::F16 => copy!(half::f16),
            DType::BF16 => copy!(half::bf16),
            DType::I64 => copy!(i64),
        })
    }

    /// A view with new shape/strides/offset over the same storage (no graph recording).
    pub(crate) fn view_raw(&self, shape: Vec<usize>, strides: Vec<usize>, offset: usize) -> Tensor {
        let mut inner = (*self.inner).clone();
        inner.shape = shape;
        inner.strides = strides;
        inner.offset = offset;
        inner.grad = None;
        Tensor::from_inner(inner)
    }

    /// A contiguous tensor's elements: a slice of its storage, no copy (CPU bytes or a CUDA
    /// sub-buffer).
    pub(crate) fn contiguous_storage(&self) -> Result<Storage> {
        let t = self.contiguous_raw()?;
        let size = t.inner.dtype.size();
        let start = t.inner.offset * size;
        let len = if t.is_sparse() {
            t.sparse_values().numel() * size
        } else {
            t.numel() * size
        };
        Ok(match &t.inner.data {
            Storage::Cpu(b) => Storage::Cpu(b.slice(start..start + len)),
            Storage::Cuda(b) => Storage::Cuda(b.slice(start..start + len).map_err(|e| Error::Cuda(e.to_string()))?),
        })
    }

    /// Whether the view reaches exactly every element of its storage once (a permutation of a
    /// contiguous layout, e.g. a transpose), so it can travel with its strides and no copy.
    pub(crate) fn is_dense_permutation(&self) -> bool {
        if self.is_sparse() || self.inner.offset != 0 || self.numel() * self.inner.dtype.size() != self.inner.data.len()
        {
            return false;
        }
        let mut dims: Vec<(usize, usize)> = self
            .inner
            .strides
            .iter()
            .copied()
            .zip(self.inner.shape.iter().copied())
            .filter(|&(_, n)| n > 1)
            .collect();
        dims.sort();
        let mut expect = 1;
        for (s, n) in dims {
            if s != expect {
                return false;
            }
            expect *= n;
        }
        true
    }

    pub(crate) fn float_op<R>(
        &self,
        op: &'static str,
        f32_fn: impl FnOnce() -> Result<R>,
        f64_fn: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        self.check_cpu(op)?;
        match self.inner.dtype {
            DType::F32 => f32_fn(),
            DType::F64 => f64_fn(),
            dtype => Err(Error::DType {
                op,
                dtype,
                hint: " (compute in f32 or f64: convert with to_dtype)",
            }),
        }
    }
}

/// Checks that every element `shape`, `strides` and `offset` reach lies inside `len` bytes of
/// `dtype` elements.
pub(crate) fn check_layout(len: usize, dtype: DType, shape: &[usize], strides: &[usize], offset: usize) -> Result<()> {
    if shape.len() != strides.len() {
        return Err(Error::Wire(format!(
            "{} dims but {} strides",
            shape.len(),
            strides.len()
        )));
    }
    if !len.is_multiple_of(dtype.size()) {
        return Err(Error::Wire(format!("{len} bytes is not a whole number of {dtype}")));
    }
    let elements = len / dtype.size();
    let mut count: usize = 1;
    let mut last = offset;
    for (&n, &s) in shape.iter().zip(strides) {
        count = count
            .checked_mul(n)
            .ok_or_else(|| Error::Wire(format!("shape {shape:?} overflows")))?;
        if n > 0 {
            last = (n - 1)
                .checked_mul(s)
                .and_then(|x| x.checked_add(last))
                .ok_or_else(|| Error::Wire(format!("strides {strides:?} overflow")))?;
        }
    }
    if count > 0 && last >= elements {
        return Err(Error::Wire(format!(
            "shape {shape:?} strides {strides:?} offset {offset} reach element {last} of a {elements}-element buffer"
        )));
    }
    Ok(())
}

/// Calls `f(offsets, inner_strides, inner_len)` for every innermost row of `shape`, with one
/// offset and stride per operand.
pub(crate) fn walk<const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    base: [usize; N],
    mut f: impl FnMut([usize; N], [usize; N], usize),
) {
    let nd = shape.len();
    if shape.contains(&0) {
        return;
    }
    if nd == 0 {
        f(base, [0; N], 1);
        return;
    }
    let inner = shape[nd - 1];
    let inner_strides: [usize; N] = std::array::from_fn(|k| strides[k][nd - 1]);
    let mut idx = vec![0usize; nd - 1];
    let mut off = base;
    loop {
        f(off, inner_strides, inner);
        let mut d = nd - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            // Wrapping: stepping past the last index of a dimension (size 1 with any stride,
            // say) may leave the valid range for a moment; it is undone just below, and every
            // offset handed to `f` was bounds-checked when the tensor was made.
            for k in 0..N {
                off[k] = off[k].wrapping_add(strides[k][d]);
            }
            if idx[d] < shape[d] {
                break;
            }
            for k in 0..N {
                off[k] = off[k].wrapping_sub(strides[k][d].wrapping_mul(shape[d]));
            }
            idx[d] = 0;
        }
    }
}

/// A small deterministic generator (xorshift64*), for seeded initialization and tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(1e-300);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// The state behind a leaf: identity and the gradient a local backward accumulates.
impl LeafState {
    pub(crate) fn new(id: LeafId) -> LeafState {
        LeafState {
            id,
            grad: Mutex::new(None),
        }
    }
}
