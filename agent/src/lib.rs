//! RPC over pipes: what PyTorch users know as `torch.distributed.rpc`, with the same concepts
//! (workers, `rpc_sync` / `rpc_async` / `remote`, RRefs, async handlers, device maps, graceful
//! shutdown) and honest errors.
//!
//! ```no_run
//! use sluice_agent::{Agent, AgentOptions, Payload, Registry};
//!
//! let mut registry = Registry::new();
//! registry.handler("add", |_ctx, (a, b): (i64, i64)| Ok(a + b));
//! // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment.
//! let agent = Agent::init(AgentOptions::new("worker0"), registry)?;
//! let sum: i64 = agent.call("worker1", "add", &(2i64, 3i64))?;
//! agent.shutdown()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Start with [`agent`] (init, calls, serving, shutdown), then [`rref`] (references and their
//! counting protocol), [`handler`] (what a handler may be) and [`store`] (rendezvous).
//!
//! Groups are elastic ([`membership`]): workers join ([`AgentOptions::join`]) and leave
//! ([`Agent::leave`]) at any time, lost peers are detected (pipe errors, heartbeats, expired
//! membership) and reported ([`MembershipEvent`]), and the rendezvous is the embedded store or
//! etcd ([`store`]).
//!
//! CUDA tensors travel by device map with stream semantics, never a host synchronize ([`gpu`]):
//! requests land where the caller's map says, responses go back through its reverse, handlers
//! run on the streams their tensors arrived on, received payloads carry arrival events, and
//! RRefs owned on a GPU keep the events of the work that made them.
//!
//! What it does not do (yet): survive the *crash* of the embedded store's host (a graceful
//! leave hands the store over; use etcd for crashes).

#![forbid(unsafe_code)]

pub mod agent;
mod budget;
mod calls;
mod client;
mod clock;
pub mod completion;
pub mod device_map;
pub mod error;
pub mod gpu;
pub mod handler;
mod hub;
mod lifecycle;
pub mod membership;
pub mod name;
pub mod options;
mod parts;
pub mod payload;
mod peers;
pub mod pool;
pub mod priority;
mod reader;
mod role;
pub mod rref;
mod rref_ledger;
mod server;
pub mod store;
pub mod wire;

pub use agent::{Agent, Registry, RpcFuture};
pub use completion::{wait_all, Completion};
pub use device_map::DeviceMap;
pub use error::{HandlerError, InitError, RpcError, ShutdownError};
pub use hub::CallContext;
pub use membership::MembershipEvent;
pub use name::{Dest, WorkerInfo};
pub use options::{AgentOptions, Connect, Faults};
pub use payload::{Encode, Payload, Value};
pub use priority::{with_priority, Priority};
pub use rref::RRef;
pub use sluice_channel::{Device, Tensor};
