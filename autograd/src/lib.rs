//! Tensors over raw buffers, ops with backward, a local engine, distributed autograd and the
//! distributed optimizer.
//!
//! Start with [`tensor`] (what a tensor is), [`ops`] (what you can compute and differentiate),
//! [`engine`] (how a backward runs), then [`dist`] (contexts, recorded RPCs, the distributed
//! backward) and [`optim`] (parameters, optimizers, the distributed optimizer).
//!
//! Devices: CPU kernels live in [`cpu`], CUDA kernels (NVRTC-compiled, cuBLAS for matmul) in
//! [`cuda`]; each `cpu` entry point hands a CUDA tensor to its CUDA kernel first. Embedding's
//! sparse gradients and f16/bf16 compute are CPU-only and say so.

#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod cpu;
pub mod cuda;
pub mod dist;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod gradcheck;
pub mod graph;
pub mod ops;
pub mod optim;
pub mod tensor;

pub use dist::remote::RemoteTensor;
pub use dtype::DType;
pub use error::{Error, Result};
pub use graph::{checkpoint, enable_grad, no_grad};
pub use ops::{accuracy, cat, cross_entropy, embedding, linear, mse_loss, nll_loss};
pub use optim::{DistributedOptimizer, Optimizer, OptimizerKind, ParamState, Parameter, UpdateMode};
pub use tensor::{LeafId, Rng, Tensor};
