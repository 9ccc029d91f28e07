//! Remote modules: layers built on the worker and device a string names (`"worker1/cpu"`),
//! called like a local module. Forward is an RPC recorded in the current distributed-autograd
//! context (so a loss computed here sends gradients back through it); the parameters are RRefs
//! for the distributed optimizer; and an RRef to the module answers the `"forward"` method, so
//! `rref_rpc_sync(agent, &module_rref, "forward", &x)` from any worker is recorded too (as
//! PyTorch records `rref.rpc_sync().forward(x)`).

use sluice_agent::{Agent, RRef};
use sluice_autograd::dist::{self, DistFuture};
use sluice_autograd::{DType, OptimizerKind, Parameter, Tensor};

use crate::nn::Layer;
use crate::stage::{self, ModuleRef, StageSpec};
use crate::{check_devices, next_stage_id, Placement, Result};

pub struct RemoteModule {
    agent: Agent,
    placement: Placement,
    worker: u32,
    id: u64,
}

impl RemoteModule {
    /// Builds `layers` (initialised from `seed`) on `placement`.
    pub fn new(agent: &Agent, placement: &str, layers: Vec<Layer>, seed: u64, dtype: DType) -> Result<RemoteModule> {
        let placement: Placement = placement.parse()?;
        check_devices(std::slice::from_ref(&placement))?;
        let id = next_stage_id(agent);
        let spec = StageSpec {
            id,
            layers: 0..layers.len(),
            model: layers,
            seed,
            dtype,
            // Unused: remote modules are trained by the caller's distributed optimizer.
            optimizer: OptimizerKind::sgd(0.0),
            remat: false,
            device: placement.device()?,
        };
        let _: usize = agent.call(placement.worker.as_str(), stage::H_CREATE, &spec)?;
        let worker = agent.worker(placement.worker.as_str())?.id;
        Ok(RemoteModule {
            agent: agent.clone(),
            placement,
            worker,
            id,
        })
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// The module on `x`, on its worker (recorded in the current context, if any).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_async(x)?.wait()?)
    }

    pub fn forward_async(&self, x: &Tensor) -> Result<DistFuture<Tensor>> {
        Ok(dist::rpc_async(
            &self.agent,
            self.worker,
            stage::H_HOP,
            &(vec![(self.worker, self.id)], x.clone(), None::<u64>),
        )?)
    }

    /// The parameters, as RRefs owned by the module's worker (for a `DistributedOptimizer`).
    pub fn parameter_rrefs(&self) -> Result<Vec<RRef<Parameter>>> {
        Ok(self.agent.call(self.worker, stage::H_PARAMS, &self.id)?)
    }

    /// An RRef to the module itself: its `"forward"` method runs the module on its owner.
    pub fn rref(&self) -> Result<RRef<ModuleRef>> {
        Ok(self.agent.call(self.worker, stage::H_MODULE, &self.id)?)
    }
}

impl Drop for RemoteModule {
    fn drop(&mut self) {
        drop(self.agent.call_async(self.worker, stage::H_DROP, &self.id));
    }
}
