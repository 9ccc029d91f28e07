//! Remote tensors from Python (`sluice.remote`): the Rust [`RemoteTensor`] of sluice-autograd,
//! recorded, fused and flushed exactly as from Rust. Values cross the binding as bytes with a
//! shape and a NumPy dtype string (the Python layer makes and reads the arrays). Training runs
//! on the owners: remote parameters, a distributed autograd context entered on the Python
//! thread, a backward from remote losses and the distributed optimizer; gradients stay on the
//! owners (Python has no autograd tensors of its own here).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use sluice_autograd::dist::Context;
use sluice_autograd::{DType, DistributedOptimizer, Error, OptimizerKind, RemoteTensor, Tensor, UpdateMode};

use crate::rpc::PyAgent;
use crate::RpcErrorPy;

fn dtype_of(s: &str) -> PyResult<DType> {
    match s {
        "<f4" => Ok(DType::F32),
        "<f8" => Ok(DType::F64),
        "<i8" => Ok(DType::I64),
        other => Err(PyValueError::new_err(format!(
            "remote tensors from Python hold float32, float64 or int64, not {other}"
        ))),
    }
}

fn dtype_str(d: DType) -> &'static str {
    match d {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::I64 => "<i8",
        // Never made from Python (operations keep their operands' dtype).
        DType::F16 => "<f2",
        DType::BF16 => "bfloat16",
    }
}

/// Mistakes in what was written are `ValueError`s; a call that failed, or failed on the owner,
/// is an `RpcError` (`RpcTimeout` for a timeout, as from `sluice.rpc`).
fn err(e: Error) -> PyErr {
    match e {
        Error::Shape { .. } | Error::DType { .. } | Error::Index { .. } => PyValueError::new_err(e.to_string()),
        Error::Rpc(e) => Python::attach(|py| crate::rpc::rpc_err(py, e)),
        Error::Remote(_) | Error::OnWorker { .. } => RpcErrorPy::new_err(e.to_string()),
        e => PyRuntimeError::new_err(e.to_string()),
    }
}

fn wrap(r: sluice_autograd::Result<RemoteTensor>) -> PyResult<PyRemoteTensor> {
    r.map(|inner| PyRemoteTensor { inner }).map_err(err)
}

/// A tensor whose value lives on another worker (see `sluice.remote.RemoteTensor`).
#[pyclass(module = "sluice._sluice", name = "_RemoteTensor", frozen)]
pub struct PyRemoteTensor {
    inner: RemoteTensor,
}

/// `data` (row-major, `shape`, NumPy dtype string `dtype`) placed on `placement`
/// (`"worker1/cpu"`): recorded there, sent with that owner's next flush. With `parameter` (a
/// name), a trainable parameter made there at once instead (float32 or float64): its gradients
/// accumulate on its owner, where a `_DistributedOptimizer` updates it.
#[pyfunction]
#[pyo3(signature = (agent, data, shape, dtype, placement, parameter=None))]
pub fn _remote_tensor(
    py: Python<'_>,
    agent: &PyAgent,
    data: &[u8],
    shape: Vec<usize>,
    dtype: &str,
    placement: &str,
    parameter: Option<&str>,
) -> PyResult<PyRemoteTensor> {
    let dtype = dtype_of(dtype)?;
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1]);
    }
    let t = Tensor::from_bytes(bytes::Bytes::copy_from_slice(data), dtype, &shape, &strides, 0).map_err(err)?;
    let agent = agent.agent().clone();
    match parameter {
        None => py.detach(|| wrap(t.to_remote(&agent, placement))),
        Some(_) if !matches!(dtype, DType::F32 | DType::F64) => {
            Err(PyValueError::new_err("a parameter holds float32 or float64"))
        }
        Some(name) => py.detach(|| wrap(RemoteTensor::parameter(&agent, placement, name, &t))),
    }
}

/// A distributed autograd context, entered on the thread that made it (PyTorch's
/// `dist_autograd.context()`); what remote tensors flush meanwhile is recorded in it.
#[pyclass(module = "sluice._sluice", name = "_DistContext", unsendable)]
pub struct PyDistContext {
    inner: Option<Context>,
    agent: sluice_agent::Agent,
}

impl PyDistContext {
    fn context(&self) -> PyResult<&Context> {
        self.inner
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("this autograd context was already left"))
    }
}

/// A tensor's value as little-endian bytes here, with its shape and dtype (half precision
/// widened to f32, which NumPy reads).
struct HostBytes(Vec<u8>, Vec<usize>, DType);

impl HostBytes {
    fn into_py(self, py: Python<'_>) -> (Bound<'_, PyBytes>, Vec<usize>, &'static str) {
        (PyBytes::new(py, &self.0), self.1, dtype_str(self.2))
    }
}

fn host_bytes(t: Tensor) -> sluice_autograd::Result<HostBytes> {
    let t = t.to_device(sluice_channel::Device::Cpu)?;
    let t = match t.dtype() {
        DType::F16 | DType::BF16 => t.to_dtype(DType::F32)?,
        _ => t,
    };
    let bytes: Vec<u8> = match t.dtype() {
        DType::F64 => t.to_vec::<f64>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::I64 => t.to_vec::<i64>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
        _ => t.to_vec::<f32>()?.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    Ok(HostBytes(bytes, t.shape().to_vec(), t.dtype()))
}

fn roots_of(roots: &[PyRef<'_, PyRemoteTensor>]) -> Vec<RemoteTensor> {
    roots.iter().map(|r| r.inner.clone()).collect()
}

/// The values of `roots` here, fetched on this thread inside its context (recorded, so the
/// backward reaches their owners), as the backward's roots.
fn roots_here(roots: &[RemoteTensor]) -> sluice_autograd::Result<Vec<Tensor>> {
    roots.iter().map(RemoteTensor::to_here).collect()
}

#[pymethods]
impl PyDistContext {
    /// Enters a new context on this thread.
    #[new]
    fn new(agent: &PyAgent) -> PyResult<PyDistContext> {
        Ok(PyDistContext {
            inner: Some(Context::new(agent.agent()).map_err(err)?),
            agent: agent.agent().clone(),
        })
    }

    #[getter]
    fn id(&self) -> PyResult<u64> {
        Ok(self.context()?.id())
    }

    /// The distributed backward from one-element remote `roots` (the graph is freed).
    fn backward(&self, py: Python<'_>, roots: Vec<PyRef<'_, PyRemoteTensor>>) -> PyResult<()> {
        let id = self.context()?.id();
        let (agent, roots) = (&self.agent, roots_of(&roots));
        py.detach(|| sluice_autograd::dist::backward(agent, id, &roots_here(&roots)?, false))
            .map_err(err)
    }

    /// The gradient remote parameter `param` accumulated in this context on its owner, read
    /// from there as `(bytes, shape, dtype string)`, or `None` when it has none.
    #[allow(clippy::type_complexity)]
    fn gradient<'py>(
        &self,
        py: Python<'py>,
        param: PyRef<'_, PyRemoteTensor>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<usize>, &'static str)>> {
        let id = self.context()?.id();
        let param = param.inner.clone();
        if param.param_rref().is_none() {
            return Err(PyValueError::new_err(
                "only a parameter (sluice.remote.parameter) keeps a gradient on its owner",
            ));
        }
        let host = py
            .detach(|| param.gradient(id)?.map(host_bytes).transpose())
            .map_err(err)?;
        Ok(host.map(|h| h.into_py(py)))
    }

    /// Leaves the context: released here and on every worker it reached (not waited for).
    fn leave(&mut self) {
        self.inner = None;
    }
}

/// The distributed optimizer over remote parameters (`_remote_tensor(..., parameter=name)`):
/// `kind` `"sgd"` or
/// `"adam"`, `mode` `"locked"` or `"hogwild"`.
#[pyclass(module = "sluice._sluice", name = "_DistributedOptimizer")]
pub struct PyDistributedOptimizer {
    inner: DistributedOptimizer,
}

#[pymethods]
impl PyDistributedOptimizer {
    #[new]
    #[pyo3(signature = (agent, params, kind, lr, momentum=0.0, mode="locked"))]
    fn new(
        py: Python<'_>,
        agent: &PyAgent,
        params: Vec<PyRef<'_, PyRemoteTensor>>,
        kind: &str,
        lr: f64,
        momentum: f64,
        mode: &str,
    ) -> PyResult<PyDistributedOptimizer> {
        let kind = match kind {
            "sgd" => OptimizerKind::Sgd { lr, momentum },
            "adam" => OptimizerKind::adam(lr),
            other => return Err(PyValueError::new_err(format!("no optimizer {other:?} (sgd or adam)"))),
        };
        let mode = match mode {
            "locked" => UpdateMode::Locked,
            "hogwild" => UpdateMode::Hogwild,
            other => {
                return Err(PyValueError::new_err(format!(
                    "no update mode {other:?} (locked or hogwild)"
                )))
            }
        };
        let rrefs = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                p.inner.param_rref().ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "parameter {i} is not a remote parameter (sluice.remote.parameter)"
                    ))
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let agent = agent.agent().clone();
        let inner = py
            .detach(|| DistributedOptimizer::new(&agent, kind, &rrefs, mode))
            .map_err(err)?;
        Ok(PyDistributedOptimizer { inner })
    }

    /// Every owner steps with the context's gradients.
    fn step(&self, py: Python<'_>, context: &PyDistContext) -> PyResult<()> {
        let id = context.context()?.id();
        py.detach(|| self.inner.step(id)).map_err(err)
    }

    /// The backward from `roots`, and the step, with owners stepping before they answer the
    /// backward where they can (one call fewer each; see the Rust `backward_and_step`).
    fn backward_and_step(
        &self,
        py: Python<'_>,
        context: &PyDistContext,
        roots: Vec<PyRef<'_, PyRemoteTensor>>,
    ) -> PyResult<()> {
        let id = context.context()?.id();
        let roots = roots_of(&roots);
        py.detach(|| self.inner.backward_and_step_by_id(id, &roots_here(&roots)?))
            .map_err(err)
    }
}

macro_rules! unary {
    ($($name:ident),* $(,)?) => {
        fn unary_op(t: &RemoteTensor, name: &str) -> PyResult<sluice_autograd::Result<RemoteTensor>> {
            Ok(match name {
                $(stringify!($name) => t.$name(),)*
                other => return Err(PyValueError::new_err(format!("no remote operation {other}"))),
            })
        }
    };
}
unary!(neg, exp, log, tanh, sigmoid, relu, sin, cos);

macro_rules! binary {
    ($($name:ident),* $(,)?) => {
        fn binary_op(a: &RemoteTensor, name: &str, b: &RemoteTensor) -> PyResult<sluice_autograd::Result<RemoteTensor>> {
            Ok(match name {
                $(stringify!($name) => a.$name(b),)*
                other => return Err(PyValueError::new_err(format!("no remote operation {other}"))),
            })
        }
    };
}
binary!(add, sub, mul, div, matmul, mse_loss, cross_entropy, embedding);

#[pymethods]
impl PyRemoteTensor {
    /// An elementwise function by name (`neg`, `exp`, `log`, `tanh`, `sigmoid`, `relu`, `sin`,
    /// `cos`).
    fn unary(&self, py: Python<'_>, name: &str) -> PyResult<PyRemoteTensor> {
        let r = py.detach(|| unary_op(&self.inner, name))?;
        wrap(r)
    }

    /// A two-operand operation by name (`add`, `sub`, `mul`, `div`, `matmul`, `mse_loss`,
    /// `cross_entropy`, `embedding`).
    fn binary(&self, py: Python<'_>, name: &str, other: &PyRemoteTensor) -> PyResult<PyRemoteTensor> {
        let r = py.detach(|| binary_op(&self.inner, name, &other.inner))?;
        wrap(r)
    }

    fn mul_scalar(&self, py: Python<'_>, s: f64) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.mul_scalar(s)))
    }

    fn add_scalar(&self, py: Python<'_>, s: f64) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.add_scalar(s)))
    }

    #[pyo3(signature = (w, b=None))]
    fn linear(&self, py: Python<'_>, w: &PyRemoteTensor, b: Option<&PyRemoteTensor>) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.linear(&w.inner, b.map(|b| &b.inner))))
    }

    fn transpose(&self, py: Python<'_>, d0: usize, d1: usize) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.transpose(d0, d1)))
    }

    fn reshape(&self, py: Python<'_>, shape: Vec<usize>) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.reshape(&shape)))
    }

    #[pyo3(signature = (dim=None, keepdim=false))]
    fn sum(&self, py: Python<'_>, dim: Option<isize>, keepdim: bool) -> PyResult<PyRemoteTensor> {
        py.detach(|| {
            wrap(match dim {
                Some(d) => self.inner.sum_dim(d, keepdim),
                None => self.inner.sum(),
            })
        })
    }

    #[pyo3(signature = (dim=None, keepdim=false))]
    fn mean(&self, py: Python<'_>, dim: Option<isize>, keepdim: bool) -> PyResult<PyRemoteTensor> {
        py.detach(|| {
            wrap(match dim {
                Some(d) => self.inner.mean_dim(d, keepdim),
                None => self.inner.mean(),
            })
        })
    }

    fn softmax(&self, py: Python<'_>, dim: isize) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.softmax(dim)))
    }

    fn log_softmax(&self, py: Python<'_>, dim: isize) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.log_softmax(dim)))
    }

    fn narrow(&self, py: Python<'_>, dim: usize, start: usize, length: usize) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.narrow(dim, start, length)))
    }

    fn index_select(&self, py: Python<'_>, dim: isize, indices: &PyRemoteTensor) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.index_select(dim, &indices.inner)))
    }

    fn gather(&self, py: Python<'_>, dim: isize, index: &PyRemoteTensor) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.gather(dim, &index.inner)))
    }

    #[staticmethod]
    fn cat(py: Python<'_>, tensors: Vec<PyRef<'_, PyRemoteTensor>>, dim: usize) -> PyResult<PyRemoteTensor> {
        let inner: Vec<RemoteTensor> = tensors.iter().map(|t| t.inner.clone()).collect();
        py.detach(|| wrap(RemoteTensor::cat(&inner.iter().collect::<Vec<_>>(), dim)))
    }

    /// The value placed on another worker or device (`"worker2/cpu"`), moved owner to owner.
    fn to(&self, py: Python<'_>, placement: &str) -> PyResult<PyRemoteTensor> {
        py.detach(|| wrap(self.inner.to(placement)))
    }

    /// Sends the owner's recording if this tensor is in it and waits until the owner holds it.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.sync()).map_err(err)
    }

    /// The value here: `(bytes, shape, dtype string)` (a flush point).
    fn to_here<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyBytes>, Vec<usize>, &'static str)> {
        let host = py.detach(|| host_bytes(self.inner.to_here()?)).map_err(err)?;
        Ok(host.into_py(py))
    }

    /// The single value of a one-element tensor (a flush point).
    fn item(&self, py: Python<'_>) -> PyResult<f64> {
        py.detach(|| self.inner.item()).map_err(err)
    }

    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.inner.shape().to_vec()
    }

    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_str(self.inner.dtype())
    }

    /// `"worker1/cpu"`: where the value lives.
    #[getter]
    fn placement(&self) -> String {
        format!("{}/{}", self.inner.owner().name, self.inner.device())
    }

    fn is_pending(&self) -> bool {
        self.inner.is_pending()
    }
}
