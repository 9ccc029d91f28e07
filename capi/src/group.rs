//! Collective groups (`sluice_group`): ranks that exchange buffers point to point and together
//! (allreduce, broadcast, ...), formed through the caller's own rendezvous: each rank binds
//! (`sluice_group_bind`), publishes its address where the others find it (a framework's
//! key-value store), then forms the group from every rank's address (`sluice_group_form`).
//!
//! Operations read and write the caller's memory in place and complete through a callback on
//! a library thread. Every rank starts the group's collectives in the same order (each takes
//! its place when started, so several may be in flight).

use std::ffi::{c_int, CStr, CString};
use std::future::Future;
use std::time::Duration;

use sluice_collective::{Bound, CollectiveError, DType, Group, ReduceOp};
use sluice_dlpack::ffi::DLDataType;

use crate::borrowed::{Done, Region};
use crate::context::SluiceContext;
use crate::runtime;
use crate::status::{
    set_last_error, Error, Result, SLUICE_CLOSED, SLUICE_INVALID_ARGUMENT, SLUICE_IO, SLUICE_OK, SLUICE_PEER,
    SLUICE_PEER_LOST, SLUICE_TIMEOUT, SLUICE_UNSUPPORTED,
};

/// Reduction: the sum.
pub const SLUICE_REDUCE_SUM: c_int = 0;
/// Reduction: the sum divided by the number of ranks (floating point and complex dtypes).
pub const SLUICE_REDUCE_AVG: c_int = 1;
/// Reduction: the product.
pub const SLUICE_REDUCE_PRODUCT: c_int = 2;
/// Reduction: the minimum (not for complex dtypes).
pub const SLUICE_REDUCE_MIN: c_int = 3;
/// Reduction: the maximum (not for complex dtypes).
pub const SLUICE_REDUCE_MAX: c_int = 4;

/// A reduction code as the collective library's operation.
pub fn reduce_op(code: c_int) -> Result<ReduceOp> {
    Ok(match code {
        SLUICE_REDUCE_SUM => ReduceOp::Sum,
        SLUICE_REDUCE_AVG => ReduceOp::Avg,
        SLUICE_REDUCE_PRODUCT => ReduceOp::Product,
        SLUICE_REDUCE_MIN => ReduceOp::Min,
        SLUICE_REDUCE_MAX => ReduceOp::Max,
        other => return Err(Error::invalid(format!("unknown reduction {other}"))),
    })
}

/// A DLPack dtype as one Sluice carries.
pub fn dtype(dt: DLDataType) -> Result<DType> {
    DType::from_dl(dt).map_err(|e| Error::unsupported(format!("dtype: {e}")))
}

impl From<CollectiveError> for Error {
    fn from(e: CollectiveError) -> Error {
        let code = match &e {
            CollectiveError::PeerLost { .. } => SLUICE_PEER_LOST,
            CollectiveError::Aborted { .. } | CollectiveError::Closed => SLUICE_CLOSED,
            CollectiveError::Peer { .. } => SLUICE_PEER,
            CollectiveError::Timeout(_) => SLUICE_TIMEOUT,
            CollectiveError::Invalid(_) => SLUICE_INVALID_ARGUMENT,
            CollectiveError::Unsupported(_) => SLUICE_UNSUPPORTED,
            CollectiveError::Store(_) | CollectiveError::Pipe(_) => SLUICE_IO,
        };
        Error::new(code, e.to_string())
    }
}

/// A rank's listener before its group forms (`sluice_group_bind`).
pub struct SluiceGroupBound {
    bound: Bound,
    address: CString,
}

impl SluiceGroupBound {
    /// Binds on `host` (port chosen by the system), with `ctx`'s transports and channels.
    pub fn bind(ctx: &SluiceContext, host: &str) -> Result<SluiceGroupBound> {
        let bound = runtime::block_on(Group::bind(ctx.context().clone(), host))??;
        let address = CString::new(bound.address()).unwrap_or_default();
        Ok(SluiceGroupBound { bound, address })
    }

    /// Where the other ranks reach this one (`host:port`).
    pub fn address(&self) -> &CStr {
        &self.address
    }

    /// Forms the group (blocking until this rank's pipes to every other are up, or `timeout`).
    pub fn form(self, name: &str, rank: u32, addresses: &[String], timeout: Duration) -> Result<SluiceGroup> {
        let group = runtime::block_on(self.bound.form(name, rank, addresses, timeout))??;
        Ok(SluiceGroup { group })
    }
}

/// A formed group (`sluice_group_form`). Any thread may start operations on it.
pub struct SluiceGroup {
    group: Group,
}

impl SluiceGroup {
    pub fn rank(&self) -> u32 {
        self.group.rank()
    }

    pub fn world_size(&self) -> u32 {
        self.group.world_size()
    }

    /// Fails the group on every rank with `why`.
    pub fn abort(&self, why: &str) -> Result<()> {
        let _entered = runtime::enter()?;
        self.group.abort(why);
        Ok(())
    }

    /// Leaves with the others (blocking until every rank has closed, or the group's error).
    pub fn close(&self) -> Result<()> {
        let group = self.group.clone();
        runtime::block_on(group.close())??;
        Ok(())
    }

    /// Starts `op` on a clone of the group (its place in the group's order is taken here, on
    /// the calling thread); `done` hears its status on a library thread, with the error's
    /// message as that thread's last error, prefixed by `what`.
    pub(crate) fn start<F>(&self, what: &'static str, op: impl FnOnce(Group) -> F, done: Done) -> Result<()>
    where
        F: Future<Output = std::result::Result<(), CollectiveError>> + Send + 'static,
    {
        let fut = op(self.group.clone());
        runtime::start(fut, move |result| {
            let status = match result.and_then(|r| r.map_err(Error::from)) {
                Ok(()) => {
                    set_last_error("");
                    SLUICE_OK
                }
                Err(e) => {
                    set_last_error(&format!("{what}: {}", e.message));
                    e.code
                }
            };
            done.call(status)
        })
    }
}

/// An input region that may overlap the output: copied first if it does (an allgather's input
/// is often a slice of its output), so the operation never reads what it is writing.
pub(crate) fn input_apart(input: Region, out: &Region) -> Input {
    if input.overlaps(out) {
        Input::Copied(input.bytes().to_vec())
    } else {
        Input::Lent(input)
    }
}

/// A collective's input: the caller's memory, or a copy of it.
pub(crate) enum Input {
    Lent(Region),
    Copied(Vec<u8>),
}

impl Input {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Input::Lent(r) => r.bytes(),
            Input::Copied(v) => v,
        }
    }
}
