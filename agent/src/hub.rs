//! The hub: [`AgentInner`] composes the parts ([`crate::parts`]: the client's, server's and
//! peers' state) with what every part shares (this worker's name, the options, the runtime,
//! the pipe context, the running state, the handlers and the RRef table). [`Agent`] is the
//! public handle on it, [`CallContext`] what a handler gets. The drivers (`crate::client`,
//! `crate::server`, `crate::peers`, `crate::lifecycle`) work across parts as `impl AgentInner`
//! blocks; the public API is in [`crate::agent`]. The hub uses only the parts and leaf modules.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use sluice_channel::Context;

use crate::error::RpcError;
use crate::name::WorkerInfo;
use crate::options::AgentOptions;
use crate::parts::client::Client;
use crate::parts::peers::Peers;
use crate::parts::server::Server;
use crate::priority::Priority;
use crate::rref::{RRefHost, RRefTable};

/// Every handler and method of a worker, fixed at init.
pub type Registry = crate::handler::Handlers<CallContext>;

/// Only one agent runs in a process at a time.
pub(crate) static RUNNING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub(crate) const RUNNING_STATE: u8 = 0;
pub(crate) const DOWN: u8 = 2;

pub(crate) struct AgentInner {
    pub(crate) me: WorkerInfo,
    pub(crate) options: AgentOptions,
    pub(crate) runtime: Mutex<Option<tokio::runtime::Runtime>>,
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) context: Context,
    pub(crate) state: AtomicU8,
    /// Requests and replies seen since the last shutdown round.
    pub(crate) activity: AtomicU64,
    pub(crate) rrefs: RRefTable,
    /// The handlers and methods requests name.
    pub(crate) registry: Registry,
    /// The calls this worker makes: the call table and its ids.
    pub(crate) client: Client,
    /// The requests this worker serves: handlers, their pool and what they hold.
    pub(crate) server: Server,
    /// The group and the pipes to it: members, the store, membership events.
    pub(crate) peers: Peers,
}

/// A handle to this process's agent. Cheap to clone.
#[derive(Clone)]
pub struct Agent {
    pub(crate) inner: Arc<AgentInner>,
    /// The priority of this handle's calls; `None`: the calling thread's (see
    /// [`crate::priority`]).
    pub(crate) priority: Option<Priority>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("me", &self.inner.me).finish()
    }
}

/// What a handler sees besides its argument.
#[derive(Clone)]
pub struct CallContext {
    /// This worker's agent, for nested calls.
    pub agent: Agent,
    /// Who called.
    pub caller: WorkerInfo,
    /// The streams the request's CUDA tensors arrived on (one per device): work queued on
    /// them is ordered after the tensors' arrival, with no synchronize. Empty without CUDA
    /// tensors.
    pub streams: Vec<sluice_channel::Stream>,
    /// Whether the handler's result stays on this worker (the value of a `remote`'s RRef)
    /// rather than going back to the caller as the reply: a handler whose result is only sent
    /// may encode it at once.
    pub kept: bool,
}

impl AgentInner {
    pub(crate) fn is_down(&self) -> bool {
        self.state.load(Ordering::Acquire) == DOWN
    }

    pub(crate) fn check_running(&self) -> Result<(), RpcError> {
        if self.is_down() {
            Err(RpcError::Shutdown)
        } else {
            Ok(())
        }
    }

    /// Milliseconds since this agent started, to a scheduler tick.
    pub(crate) fn now_ms(&self) -> u64 {
        self.client.calls.clock().now_ms()
    }

    /// This agent as the RRef layer sees it.
    pub(crate) fn host(self: &Arc<Self>) -> Arc<dyn RRefHost> {
        self.clone()
    }
}
