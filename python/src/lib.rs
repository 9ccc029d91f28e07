//! Sluice from Python: the native module `sluice._sluice` behind the `sluice` package.
//!
//! - [`pipe`]: contexts, listeners, pipes, messages (blocking and asyncio forms).
//! - [`rpc`]: the agent, calls, futures and RRefs behind `sluice.rpc`.
//! - [`remote`]: remote tensors behind `sluice.remote`.
//! - [`tensor`]: DLPack tensors in and out without copies; [`capsule`]: the DLPack capsule
//!   protocol (the binding's only unsafe code).
//!
//! Every wait releases the GIL; handlers take it to run Python code.

mod capsule;
mod gil;
mod pipe;
mod remote;
mod rpc;
mod runtime;
mod tensor;

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError};
use pyo3::prelude::*;

create_exception!(
    sluice,
    PipeError,
    PyRuntimeError,
    "A pipe failed (its message names the peer)."
);
/// Named apart from the agent's `RpcError`, which the binding uses too.
mod exc {
    use pyo3::create_exception;
    use pyo3::exceptions::PyRuntimeError;

    create_exception!(
        sluice,
        RpcError,
        PyRuntimeError,
        "An RPC failed for a reason other than the callee's exception."
    );
}
pub use exc::RpcError as RpcErrorPy;
create_exception!(sluice, RpcTimeout, PyTimeoutError, "An RPC did not complete in time.");

#[pymodule]
fn _sluice(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PipeError", py.get_type::<PipeError>())?;
    m.add("RpcError", py.get_type::<RpcErrorPy>())?;
    m.add("RpcTimeout", py.get_type::<RpcTimeout>())?;
    m.add_class::<pipe::PyContext>()?;
    m.add_class::<pipe::PyListener>()?;
    m.add_class::<pipe::PyPipe>()?;
    m.add_class::<tensor::Received>()?;
    m.add_class::<rpc::PyAgent>()?;
    m.add_class::<rpc::PyFuture>()?;
    m.add_class::<rpc::PyRRef>()?;
    m.add_class::<remote::PyRemoteTensor>()?;
    m.add_function(wrap_pyfunction!(remote::_remote_tensor, m)?)?;
    m.add_class::<remote::PyDistContext>()?;
    m.add_class::<remote::PyDistributedOptimizer>()?;
    m.add_function(wrap_pyfunction!(tensor::_send_view, m)?)?;
    m.add_function(wrap_pyfunction!(rpc::_set_priority, m)?)?;
    m.add_function(wrap_pyfunction!(rpc::_current_priority, m)?)?;
    m.add_function(wrap_pyfunction!(rpc::_plain, m)?)?;
    Ok(())
}
