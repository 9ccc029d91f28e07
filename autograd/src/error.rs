//! Errors of tensor operations, backward passes and the distributed layer.

use sluice_agent::RpcError;

use crate::dtype::DType;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("shape error in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("{op} does not support dtype {dtype}{hint}")]
    DType {
        op: &'static str,
        dtype: DType,
        hint: &'static str,
    },
    #[error("{op} has no kernels for device {device} yet")]
    Device { op: &'static str, device: String },
    #[error("index {index} out of range for {op} with size {size}")]
    Index { op: &'static str, index: i64, size: usize },
    #[error("backward: {0}")]
    Backward(String),
    #[error(
        "the graph was already freed by an earlier backward through {0}; pass retain_graph=true to backward twice"
    )]
    GraphFreed(&'static str),
    #[error("malformed tensor from a peer: {0}")]
    Wire(String),
    #[error("could not find autograd context with id {0} (unknown or already released)")]
    UnknownContext(u64),
    #[error("this thread already has distributed autograd context {0}; contexts do not nest")]
    NestedContext(u64),
    #[error("no distributed autograd context is active on this thread")]
    NoContext,
    #[error(
        "distributed autograd is not installed: call sluice_autograd::dist::install on the registry before Agent::init"
    )]
    NotInstalled,
    /// A failure on a worker, with the worker's rank: "error on worker N: …".
    #[error("error on worker {worker}: {detail}")]
    OnWorker { worker: u32, detail: String },
    #[error(transparent)]
    Rpc(#[from] RpcError),
    #[error("optimizer: {0}")]
    Optimizer(String),
    /// A remote tensor's misuse or failure (placement, mixed devices, a failed flush).
    #[error("remote tensor: {0}")]
    Remote(String),
    #[error("CUDA: {0}")]
    Cuda(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn shape_err(op: &'static str, detail: impl Into<String>) -> Error {
    Error::Shape {
        op,
        detail: detail.into(),
    }
}
