//! A strict model of the CUDA driver: the entry points Sluice calls, exported with `cuda.h`'s C
//! signatures, so that Sluice's GPU-gated suites run on machines without a GPU. Loaded only when
//! asked: `SLUICE_CUDA_DRIVER=target/release/libsluice_cuda_model.so` (see
//! `sluice_cuda::driver::MODEL_VARIABLE`); every error Sluice reports from it names the model.
//!
//! What it models (each rule in [`rules`] with its source):
//! - `cuInit` first; 1–8 devices (`SLUICE_CUDA_MODEL_DEVICES`, default 2) with UUIDs every
//!   process agrees on, PCI ids, peer access between any two, `CUDA_VISIBLE_DEVICES` honoured;
//! - per-thread current contexts (a stack); calls that need one fail without it;
//! - device memory at addresses host code cannot touch (a reserved, inaccessible range: a host
//!   dereference faults and the model names it), backed by a shared memory file the model's
//!   stream threads reach through a second mapping; every copy must lie inside one allocation;
//! - streams: in order, asynchronous (a thread each; `SLUICE_CUDA_MODEL_SEED` adds random
//!   delays); events record the work queued at the call, a never-recorded event is complete;
//!   freeing memory with work still queued on it breaks a rule;
//! - IPC between real processes: handles name the exporting process, its descriptor and the
//!   allocation's generation; the importer maps the same file at its own address (once per
//!   context, counted); freeing exported memory while another process maps it, and using an
//!   imported event after its exporter destroyed it, break rules; interprocess events;
//! - pageable copies staged (host to device) or waited for (device to host), as documented.
//!
//! - kernels: a stand-in for NVRTC compiles the same CUDA C++ with the host C++ compiler and a
//!   shim header; a launch copies its arguments at the call (device pointers checked and mapped
//!   to the model's view) and runs as a loop over grid and block on the stream's thread; a
//!   stand-in for cuBLAS runs a plain column-major gemm in stream order ([`kernels`],
//!   [`compute`]). This checks kernel logic, indexing and launch arguments, not NVRTC's code
//!   generation or parallel execution.
//!
//! - the legacy default stream's implicit synchronisation with blocking streams (Sluice's
//!   own streams are non-blocking); `SLUICE_CUDA_MODEL_PAGEABLE=sync` makes pageable uploads
//!   wait for their copy too (a driver may); `SLUICE_CUDA_MODEL_PEERS` sets the peer-access
//!   matrix (`all`, `none`, or allowed pairs `0-1,1-0`).
//!
//! Not modelled: GPUDirect (its entry points are not exported, so Sluice finds it
//! unsupported), timing events, anything Sluice does not call.

pub mod api;
pub mod compute;
pub mod kernels;
pub mod model;
pub mod rules;
mod sys;
