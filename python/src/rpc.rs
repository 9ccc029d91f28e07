//! The RPC level: an agent whose handlers run Python functions (see `sluice/rpc.py` for the
//! API shaped like `torch.distributed.rpc`).
//!
//! A call's payload is `(pace key, rrefs, pickle bytes)` in postcard plus the tensors the
//! pickler lifted out, which the pipe's channels move; a call by reference without arguments
//! carries its reference string in place of the pickle (see [`function_by_reference`]).
//!
//! Three handlers serve Python: `py.call` (a function, whose result stays an unencoded object
//! when it becomes an RRef's value), `py.call_async` (a function decorated `async_execution`:
//! its future settles the reply, no thread held) and the method `py.method` (a method on an
//! RRef's value, on its owner).

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyComplex, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use sluice_agent::{
    Agent, AgentOptions, Device, Encode, HandlerError, Payload, RRef, Registry, RpcError, RpcFuture, Value,
};
use sluice_channel::{ChannelKind, TransportKind};
use tokio::sync::oneshot;

use crate::runtime::rt;
use crate::tensor::{to_channel, Received};
use crate::{RpcErrorPy, RpcTimeout};

/// What the Python side of the binding provides, looked up once.
struct Hook(PyOnceLock<Py<PyAny>>, &'static str);

impl Hook {
    const fn new(name: &'static str) -> Hook {
        Hook(PyOnceLock::new(), name)
    }

    fn get<'py>(&self, py: Python<'py>) -> PyResult<&Bound<'py, PyAny>> {
        self.0.import(py, "sluice.rpc", self.1)
    }
}

static SERVE_CALL: Hook = Hook::new("_serve_call");
static SERVE_METHOD: Hook = Hook::new("_serve_method");
static PACK: Hook = Hook::new("_pack");
static UNPACK: Hook = Hook::new("_unpack");
static LOADS: Hook = Hook::new("_loads");
static DUMPS: Hook = Hook::new("_dumps");
static DESCRIBE: Hook = Hook::new("_describe");
static REMOTE_ERROR: Hook = Hook::new("_remote_error");
static CALLEE_FUNCTION: Hook = Hook::new("_callee_function_kept");

/// A Python object as an agent value: kept as it is on its owner, pickled to travel.
pub struct PyObj(Py<PyAny>);

impl Encode for PyObj {
    fn encode(&self) -> Result<Payload, RpcError> {
        crate::gil::attach(|py| pack(py, self.0.bind(py)))
    }
}

/// `obj` pickled (its tensors and RRefs lifted out) as a payload; None (the result of a call
/// made for its effect) as a constant, a plain scalar by the C pickler alone, with no Python
/// frame.
fn pack(py: Python<'_>, obj: &Bound<'_, PyAny>) -> Result<Payload, RpcError> {
    let packed = if obj.is_none() {
        encode_payload("", NONE_PICKLED, Vec::new(), Vec::new())
    } else if plain_scalar(obj) {
        DUMPS
            .get(py)
            .and_then(|f| f.call1((obj,)))
            .and_then(|data| encode_payload("", data.cast::<PyBytes>()?.as_bytes(), Vec::new(), Vec::new()))
    } else {
        PACK.get(py).and_then(|f| f.call1((obj,))).and_then(|p| {
            let (data, tensors, rrefs): (Bound<'_, PyBytes>, Bound<'_, PyAny>, Bound<'_, PyAny>) = p.extract()?;
            payload("", &data, &tensors, &rrefs)
        })
    };
    packed.map_err(|e| RpcError::Encode(format!("the result cannot be pickled: {e}")))
}

/// A handler's result: pickled while the handler still holds the GIL when it goes back to
/// the caller (one GIL hold per call instead of two; the pickling counts in the handler's
/// pace), kept as the object itself when it stays here (a `remote`'s value). A result that
/// cannot be pickled gives the error encoding it later would have.
fn result_value(py: Python<'_>, obj: Bound<'_, PyAny>, kept: bool) -> Value {
    if kept {
        return Value::encodable(PyObj(obj.unbind()));
    }
    match pack(py, &obj) {
        Ok(p) => Value::Payload(p),
        // Pickled once: the reply carries this error, as encoding the object later would.
        Err(e) => Value::encodable(Unpicklable(e)),
    }
}

/// A result that could not be pickled, as the error its encoding gives.
struct Unpicklable(RpcError);

impl Encode for Unpicklable {
    fn encode(&self) -> Result<Payload, RpcError> {
        Err(self.0.clone())
    }
}

/// A payload from the callee's pace key (the function's name; empty for results), pickle
/// bytes, the tensors lifted out of them and the RRefs they mention.
/// `tensors` and `rrefs`: lists, or tuples (`()` when a call lifted nothing out).
fn payload(
    key: &str,
    data: &Bound<'_, PyBytes>,
    tensors: &Bound<'_, PyAny>,
    rrefs: &Bound<'_, PyAny>,
) -> PyResult<Payload> {
    let rrefs = items(rrefs, "RRefs")?
        .iter()
        .map(|r| Ok(r.cast::<PyRRef>()?.get().rref.clone()))
        .collect::<PyResult<Vec<RRef<()>>>>()?;
    let tensors = items(tensors, "tensors")?
        .iter()
        .map(|t| to_channel(t, None))
        .collect::<PyResult<Vec<_>>>()?;
    encode_payload(key, data.as_bytes(), rrefs, tensors)
}

fn encode_payload(
    key: &str,
    data: &[u8],
    rrefs: Vec<RRef<()>>,
    tensors: Vec<sluice_channel::Tensor>,
) -> PyResult<Payload> {
    let bytes = Bytes::copy_from_slice(data);
    Ok(Payload::encode(&(key, rrefs, bytes))
        .map_err(|e| PyValueError::new_err(e.to_string()))?
        .with_tensors(tensors))
}

/// The items of a list or a tuple (anything else, a str included, is refused).
fn items<'py>(seq: &Bound<'py, PyAny>, what: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if let Ok(l) = seq.cast::<PyList>() {
        return Ok(l.iter().collect());
    }
    if let Ok(t) = seq.cast::<PyTuple>() {
        return Ok(t.iter().collect());
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "{what} must be a list or a tuple, not {}",
        seq.get_type().name()?
    )))
}

/// `pickle.dumps(None, 5)`: the result of every call made for its effect, so neither side runs
/// the pickler for it.
const NONE_PICKLED: &[u8] = b"\x80\x05N.";

/// Whether `obj` is plain data, with nothing for the lifting pickler to find: None or an exact
/// builtin scalar, or an exact tuple, list or dict (scalar keys) of at most 16 plain items, at
/// most three levels deep. `rpc.py`'s `_plain`: the caller's test before pickling arguments
/// with the C pickler alone.
#[pyfunction]
pub fn _plain(obj: &Bound<'_, PyAny>) -> bool {
    plain_within(obj, 3)
}

const PLAIN_LEN: usize = 16;

fn plain_within(obj: &Bound<'_, PyAny>, depth: u32) -> bool {
    let scalar = |o: &Bound<'_, PyAny>| o.is_none() || o.is_exact_instance_of::<PyComplex>() || plain_scalar(o);
    if scalar(obj) {
        return true;
    }
    if depth == 0 {
        return false;
    }
    if let Ok(t) = obj.cast_exact::<PyTuple>() {
        return t.len() <= PLAIN_LEN && t.iter().all(|x| plain_within(&x, depth - 1));
    }
    if let Ok(l) = obj.cast_exact::<PyList>() {
        return l.len() <= PLAIN_LEN && l.iter().all(|x| plain_within(&x, depth - 1));
    }
    if let Ok(d) = obj.cast_exact::<PyDict>() {
        return d.len() <= PLAIN_LEN && d.iter().all(|(k, v)| scalar(&k) && plain_within(&v, depth - 1));
    }
    false
}

/// An object of an exact builtin scalar type: its pickle has nothing to lift out.
fn plain_scalar(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_exact_instance_of::<PyInt>()
        || obj.is_exact_instance_of::<PyFloat>()
        || obj.is_exact_instance_of::<PyString>()
        || obj.is_exact_instance_of::<PyBool>()
        || obj.is_exact_instance_of::<PyBytes>()
}

/// The pace key a payload starts with (without decoding the rest).
fn key_of(payload_bytes: &[u8]) -> &str {
    postcard::take_from_bytes::<&str>(payload_bytes)
        .map(|(k, _)| k)
        .unwrap_or_default()
}

/// `(pickle bytes, [Received], [_RRef])` from a payload.
fn unpack<'py>(py: Python<'py>, mut p: Payload) -> PyResult<Bound<'py, PyTuple>> {
    let (rrefs, bytes) = decode(&p)?;
    unpack_parts(py, bytes, p.take_tensors(), rrefs)
}

/// A payload's RRefs and pickle bytes.
fn decode(p: &Payload) -> PyResult<(Vec<RRef<()>>, Bytes)> {
    let (_key, rrefs, bytes): (String, Vec<RRef<()>>, Bytes) = p
        .decode()
        .map_err(|e| PyValueError::new_err(format!("a malformed Python payload: {e}")))?;
    Ok((rrefs, bytes))
}

/// The object a reply's payload holds: unpickled here when it carries no tensors and no
/// RRefs (no tuple, lists or Python frame of `_unpack` on the way), else by `_unpack`.
fn unpack_value<'py>(py: Python<'py>, mut p: Payload) -> PyResult<Bound<'py, PyAny>> {
    let (rrefs, bytes) = decode(&p)?;
    let tensors = p.take_tensors();
    if tensors.is_empty() && rrefs.is_empty() {
        if bytes == NONE_PICKLED {
            return Ok(py.None().into_bound(py));
        }
        return LOADS.get(py)?.call1((PyBytes::new(py, &bytes),));
    }
    UNPACK.get(py)?.call1(unpack_parts(py, bytes, tensors, rrefs)?)
}

fn unpack_parts<'py>(
    py: Python<'py>,
    bytes: Bytes,
    received: Vec<sluice_channel::Tensor>,
    rrefs: Vec<RRef<()>>,
) -> PyResult<Bound<'py, PyTuple>> {
    let tensors = PyList::empty(py);
    for t in received {
        tensors.append(Received::new(t)?)?;
    }
    let refs = PyList::empty(py);
    for r in rrefs {
        refs.append(PyRRef { rref: r })?;
    }
    PyTuple::new(
        py,
        [PyBytes::new(py, &bytes).into_any(), tensors.into_any(), refs.into_any()],
    )
}

/// A Python exception as a handler error: its qualified type name, its message and the
/// traceback (rebuilt as the same type on the caller, by `_remote_error`).
fn describe(py: Python<'_>, e: PyErr) -> HandlerError {
    let described = DESCRIBE
        .get(py)
        .and_then(|f| f.call1((e.value(py), e.traceback(py))))
        .and_then(|d| d.extract::<(String, String)>());
    match described {
        Ok((kind, message)) => HandlerError::new(kind, message),
        Err(_) => HandlerError::new("builtins.RuntimeError", e.to_string()),
    }
}

/// The Python exception for an agent error: a remote exception as its own type, a timeout as
/// `sluice.rpc.RpcTimeout` (a `TimeoutError`), the rest as `sluice.rpc.RpcError`.
pub fn rpc_err(py: Python<'_>, e: RpcError) -> PyErr {
    match e {
        RpcError::RRefCreation(inner) => rpc_err(py, *inner),
        RpcError::Remote { kind, message, worker } => {
            match REMOTE_ERROR
                .get(py)
                .and_then(|f| f.call1((kind.as_str(), message.as_str(), worker.as_str())))
            {
                Ok(exc) => PyErr::from_value(exc),
                Err(_) => PyRuntimeError::new_err(format!("{kind} on {worker}: {message}")),
            }
        }
        e @ RpcError::Timeout { .. } => RpcTimeout::new_err(e.to_string()),
        e => RpcErrorPy::new_err(e.to_string()),
    }
}

/// Which Python functions were quick last time they ran (by `module.qualname`). Python code
/// can block in ways the agent cannot see (`time.sleep`, a lock, I/O): a function not known
/// to be quick runs as [`sluice_agent::pool::blocking`] work, so a handler running inline
/// hands the pipe's read role on first and later requests are served meanwhile.
static PACE: std::sync::LazyLock<Mutex<HashMap<String, bool>>> = std::sync::LazyLock::new(Mutex::default);

/// Quick: under the agent's own bar for running inline.
const QUICK: Duration = Duration::from_micros(200);

fn paced<R>(key: &str, run: impl FnOnce() -> R) -> R {
    let quick = PACE.lock().expect("pace map").get(key).copied().unwrap_or(false);
    let start = std::time::Instant::now();
    let r = if quick {
        run()
    } else {
        sluice_agent::pool::blocking(run)
    };
    let now_quick = start.elapsed() < QUICK;
    if now_quick != quick {
        PACE.lock().expect("pace map").insert(key.to_owned(), now_quick);
    }
    r
}

fn serve_call(payload: Payload, kept: bool) -> Result<Value, HandlerError> {
    // The key borrows the payload's bytes (a second handle on them); the call takes the payload.
    let bytes = payload.bytes().clone();
    paced(key_of(&bytes), || serve_call_now(payload, kept))
}

fn serve_call_now(mut payload: Payload, kept: bool) -> Result<Value, HandlerError> {
    crate::gil::attach(|py| {
        let mut call = || {
            let (rrefs, bytes) = decode(&payload)?;
            let tensors = payload.take_tensors();
            if rrefs.is_empty() && tensors.is_empty() {
                if bytes.first() != Some(&PICKLED) {
                    return function_by_reference(py, &bytes)?.call0();
                }
                if let Some(call) = plain_call(py, &bytes) {
                    let (func, args, kwargs) = call?;
                    return func.call(args, (!kwargs.is_empty()).then_some(&kwargs));
                }
            }
            SERVE_CALL.get(py)?.call1(unpack_parts(py, bytes, tensors, rrefs)?)
        };
        match call() {
            Ok(v) => Ok(result_value(py, v, kept)),
            Err(e) => Err(describe(py, e)),
        }
    })
}

/// A call taken apart: the function, its positional and its keyword arguments.
type Call<'py> = (Bound<'py, PyAny>, Bound<'py, PyTuple>, Bound<'py, PyDict>);

/// A pickled call with nothing lifted out, taken apart here: `(function, args, kwargs)` with
/// the function resolved (by reference, as [`function_by_reference`] does, with its error when
/// the name resolves to nothing; or as unpickled), and no Python frame on the way. None when
/// the bytes do not unpickle to that shape: `_serve_call` then runs them and reports what is
/// wrong, exactly as before. Nothing here calls the function, so it never runs twice.
fn plain_call<'py>(py: Python<'py>, bytes: &[u8]) -> Option<PyResult<Call<'py>>> {
    let call = LOADS.get(py).ok()?.call1((PyBytes::new(py, bytes),)).ok()?;
    let (func, args, kwargs): Call<'py> = call.extract().ok()?;
    let func = match func.cast::<PyString>() {
        Ok(name) => match function_by_reference(py, name.to_cow().ok()?.as_bytes()) {
            Ok(f) => f,
            Err(e) => return Some(Err(e)),
        },
        Err(_) => func,
    };
    Some(Ok((func, args, kwargs)))
}

/// The first byte of every pickle the package makes (protocol ≥ 2 opens with `PROTO`). The
/// bytes of a call by reference without arguments are its reference string instead, which as
/// UTF-8 never starts with it (see `_meta_of` in `rpc.py`).
const PICKLED: u8 = 0x80;

/// Functions called by reference without arguments, by reference string: resolved by
/// `_callee_function_kept` once, then called from here with no Python frame, pickle or tuple
/// on the way. Kept only under the one name callers send for each function (what `rpc.py`'s
/// `_function` keeps too), so a peer cannot grow it with aliases; other names resolve each time.
static BY_REFERENCE: std::sync::LazyLock<Mutex<HashMap<Box<str>, Py<PyAny>>>> =
    std::sync::LazyLock::new(Mutex::default);

fn function_by_reference<'py>(py: Python<'py>, reference: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let name = std::str::from_utf8(reference).ok();
    if let Some(f) = name.and_then(|n| {
        BY_REFERENCE
            .lock()
            .expect("by-reference map")
            .get(n)
            .map(|f| f.clone_ref(py))
    }) {
        return Ok(f.into_bound(py));
    }
    // Not held across the call: resolving may import a module, which may release the GIL.
    let (f, keep): (Bound<'py, PyAny>, bool) = CALLEE_FUNCTION
        .get(py)?
        .call1((PyBytes::new(py, reference),))?
        .extract()?;
    if let Some(n) = name.filter(|_| keep) {
        // A first resolution kept, never replaced: no reference is dropped under the lock.
        let mut map = BY_REFERENCE.lock().expect("by-reference map");
        map.entry(n.into()).or_insert_with(|| f.clone().unbind());
    }
    Ok(f)
}

fn serve_method(value: &Value, payload: Payload, kept: bool) -> Result<Value, HandlerError> {
    let bytes = payload.bytes().clone();
    paced(key_of(&bytes), || serve_method_now(value, payload, kept))
}

fn serve_method_now(value: &Value, payload: Payload, kept: bool) -> Result<Value, HandlerError> {
    crate::gil::attach(|py| {
        let target = match value.object_ref::<PyObj>() {
            Some(o) => o.0.bind(py).clone(),
            None => {
                let p = value
                    .to_payload()
                    .map_err(|e| HandlerError::new("builtins.RuntimeError", e.to_string()))?;
                let packed = unpack(py, p).map_err(|e| describe(py, e))?;
                UNPACK
                    .get(py)
                    .and_then(|f| f.call1(packed))
                    .map_err(|e| describe(py, e))?
            }
        };
        let (data, tensors, rrefs): (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>) = unpack(py, payload)
            .map_err(|e| describe(py, e))?
            .extract()
            .map_err(|e| describe(py, e))?;
        match SERVE_METHOD
            .get(py)
            .and_then(|f| f.call1((target, data, tensors, rrefs)))
        {
            Ok(v) => Ok(result_value(py, v, kept)),
            Err(e) => Err(describe(py, e)),
        }
    })
}

/// Settles an `async_execution` reply: called by the function's future when it completes.
#[pyclass(module = "sluice._sluice")]
struct Settle {
    tx: Mutex<Option<oneshot::Sender<Result<Value, HandlerError>>>>,
}

#[pymethods]
impl Settle {
    fn __call__(&self, py: Python<'_>, fut: &Bound<'_, PyAny>) {
        let result = match fut.call_method0("wait") {
            Ok(v) => Ok(Value::encodable(PyObj(v.unbind()))),
            Err(e) => Err(describe(py, e)),
        };
        if let Some(tx) = self.tx.lock().expect("settle slot").take() {
            let _ = tx.send(result);
        }
    }
}

async fn serve_async(payload: Payload) -> Result<Value, HandlerError> {
    let rx = crate::gil::attach(|py| -> Result<_, HandlerError> {
        let args = unpack(py, payload).map_err(|e| describe(py, e))?;
        let fut = SERVE_CALL
            .get(py)
            .and_then(|f| f.call1(args))
            .map_err(|e| describe(py, e))?;
        let (tx, rx) = oneshot::channel();
        let settle = Settle {
            tx: Mutex::new(Some(tx)),
        };
        fut.call_method1("add_done_callback", (settle,))
            .map_err(|e| describe(py, e))?;
        Ok(rx)
    })?;
    rx.await.unwrap_or_else(|_| {
        Err(HandlerError::new(
            "builtins.RuntimeError",
            "the async_execution function's future was dropped without a result",
        ))
    })
}

fn registry() -> Registry {
    let mut r = Registry::new();
    // Distributed autograd's and remote tensors' handlers: a Python worker can own remote
    // tensors that Rust or Python workers record.
    sluice_autograd::dist::install(&mut r);
    r.value_handler("py.call", |cx, payload| serve_call(payload, cx.kept));
    r.value_async_handler("py.call_async", |_cx, payload| serve_async(payload));
    r.value_method("py.method", |cx, value, payload| serve_method(value, payload, cx.kept));
    r
}

/// Seconds from Python as a duration, never a panic: infinite (or too large) means none
/// (zero, as 0 does), and NaN or negative count as zero too (the Python layer rejects NaN first).
fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::ZERO)
}

fn timeout(agent: &Agent, seconds_or_default: Option<f64>) -> Duration {
    match seconds_or_default {
        None => agent.default_timeout(),
        Some(s) if s < 0.0 => agent.default_timeout(),
        Some(s) => seconds(s),
    }
}

/// This process's agent.
#[pyclass(module = "sluice._sluice", name = "_Agent", frozen)]
pub struct PyAgent {
    agent: Agent,
}

impl PyAgent {
    pub(crate) fn agent(&self) -> &Agent {
        &self.agent
    }
}

impl Drop for PyAgent {
    fn drop(&mut self) {
        // The last reference may go on one of the agent's own runtime threads (Python frees
        // objects on whichever thread next takes the GIL), where the agent cannot be dropped:
        // stop it from a thread of its own instead.
        if tokio::runtime::Handle::try_current().is_ok() {
            let agent = self.agent.clone();
            std::thread::spawn(move || {
                agent.shutdown_now();
                drop(agent);
            });
        } else {
            self.agent.shutdown_now();
        }
    }
}

#[pymethods]
impl PyAgent {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (name, rank=None, world_size=None, store=None, timeout=60.0, device_maps=None,
                        transports=None, channels=None, threads=None, listen=None))]
    fn new(
        py: Python<'_>,
        name: String,
        rank: Option<u32>,
        world_size: Option<u32>,
        store: Option<String>,
        timeout: f64,
        device_maps: Option<HashMap<String, HashMap<String, String>>>,
        transports: Option<Vec<String>>,
        channels: Option<Vec<String>>,
        threads: Option<usize>,
        listen: Option<String>,
    ) -> PyResult<PyAgent> {
        let mut o = AgentOptions::new(name);
        o.rank = rank;
        o.world_size = world_size;
        o.store_addr = store;
        o.default_timeout = seconds(timeout);
        if let Some(t) = threads {
            o.pool_threads = t.max(1);
        }
        if let Some(l) = listen {
            o.listen = l;
        }
        for (peer, map) in device_maps.unwrap_or_default() {
            for (local, remote) in map {
                let parse = |d: &str| {
                    Device::from_str(d).map_err(|e| PyValueError::new_err(format!("device map for {peer}: {}", e.0)))
                };
                o = o.map_device(&peer, parse(&local)?, parse(&remote)?);
            }
        }
        if let Some(list) = transports {
            o.pipe.transports = list
                .iter()
                .map(|t| {
                    TransportKind::from_name(t).ok_or_else(|| PyValueError::new_err(format!("unknown transport {t:?}")))
                })
                .collect::<PyResult<_>>()?;
        }
        if let Some(list) = channels {
            o.pipe.channels = list
                .iter()
                .map(|c| {
                    ChannelKind::from_name(c).ok_or_else(|| PyValueError::new_err(format!("unknown channel {c:?}")))
                })
                .collect::<PyResult<_>>()?;
        }
        let agent = py
            .detach(|| Agent::init(o, registry()))
            .map_err(|e| RpcErrorPy::new_err(format!("init_rpc failed: {e}")))?;
        Ok(PyAgent { agent })
    }

    /// `(name, id)` of this worker, or of `name`/rank `id`.
    #[pyo3(signature = (dest=None))]
    fn worker(&self, py: Python<'_>, dest: Option<&Bound<'_, PyAny>>) -> PyResult<(String, u32)> {
        let info = match dest {
            None => self.agent.info().clone(),
            Some(d) => self.agent.worker(dest_of(d)?).map_err(|e| rpc_err(py, e))?,
        };
        Ok((info.name, info.id))
    }

    fn workers(&self) -> Vec<(String, u32)> {
        self.agent.workers().into_iter().map(|w| (w.name, w.id)).collect()
    }

    /// Starts a call (see [`Request`]).
    fn call(&self, py: Python<'_>, request: Request<'_>) -> PyResult<PyFuture> {
        let (dest, handler, p, t) = self.prepare(request)?;
        let fut = py.detach(|| self.agent.rpc_async_timeout(dest, &handler, p, t));
        Ok(PyFuture { fut })
    }

    /// A call and its wait in one step (the `rpc_sync` path: no future object); returns the
    /// result itself.
    fn call_sync<'py>(&self, py: Python<'py>, request: Request<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (dest, handler, p, t) = self.prepare(request)?;
        let result = py.detach(|| self.agent.rpc_sync_timeout(dest, &handler, p, t));
        unpack_value(py, result.map_err(|e| rpc_err(py, e))?)
    }

    /// The `remote` form: the callee keeps the result as the new RRef's value.
    fn remote(&self, py: Python<'_>, request: Request<'_>) -> PyResult<PyRRef> {
        let (dest, handler, p, t) = self.prepare(request)?;
        let rref = py
            .detach(|| self.agent.remote_timeout::<()>(dest, &handler, p, t))
            .map_err(|e| rpc_err(py, e))?;
        Ok(PyRRef { rref })
    }

    /// An RRef owned here, holding `obj` itself.
    fn rref(&self, obj: Py<PyAny>) -> PyRRef {
        PyRRef {
            rref: self.agent.rref_value(Value::encodable(PyObj(obj))),
        }
    }

    #[getter]
    fn default_timeout(&self) -> f64 {
        self.agent.default_timeout().as_secs_f64()
    }

    fn set_default_timeout(&self, s: f64) {
        self.agent.set_default_timeout(seconds(s));
    }

    /// Graceful: waits for every worker's outstanding work (a barrier), then stops.
    #[pyo3(signature = (graceful=true, timeout=None))]
    fn shutdown(&self, py: Python<'_>, graceful: bool, timeout: Option<f64>) -> PyResult<()> {
        if !graceful {
            py.detach(|| self.agent.shutdown_now());
            return Ok(());
        }
        let r = py.detach(|| match timeout {
            Some(t) => self.agent.shutdown_timeout(seconds(t)),
            None => self.agent.shutdown(),
        });
        r.map_err(|e| RpcErrorPy::new_err(format!("shutdown: {e}")))
    }
}

/// A call as Python hands it over: `(dest, handler, pace key, pickle bytes or a reference,
/// tensors, RRefs, timeout)`; `handler` is `py.call` or `py.call_async`; tensors and RRefs in
/// a list or a tuple.
#[derive(FromPyObject)]
pub struct Request<'py>(
    Bound<'py, PyAny>,
    String,
    String,
    Bound<'py, PyBytes>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Option<f64>,
);

impl PyAgent {
    fn prepare(&self, r: Request<'_>) -> PyResult<(sluice_agent::Dest, String, Payload, Duration)> {
        let Request(dest, handler, key, data, tensors, rrefs, t) = r;
        let p = payload(&key, &data, &tensors, &rrefs)?;
        Ok((dest_of(&dest)?, handler, p, timeout(&self.agent, t)))
    }
}

fn dest_of(d: &Bound<'_, PyAny>) -> PyResult<sluice_agent::Dest> {
    if let Ok(name) = d.extract::<String>() {
        return Ok(name.into());
    }
    if let Ok(id) = d.extract::<u32>() {
        return Ok(id.into());
    }
    // A WorkerInfo (anything with an `id`).
    let id: u32 = d.getattr("id")?.extract()?;
    Ok(id.into())
}

/// The pending result of a call.
#[pyclass(module = "sluice._sluice", name = "_Future", frozen)]
pub struct PyFuture {
    fut: RpcFuture,
}

#[pymethods]
impl PyFuture {
    /// Waits (GIL released) and returns `(pickle bytes, [Received], [_RRef])`.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyTuple>> {
        let r = match timeout {
            // No deadline, or one that never comes.
            None => py.detach(|| self.fut.wait()),
            Some(t) if !t.is_finite() => py.detach(|| self.fut.wait()),
            Some(t) => py
                .detach(|| self.fut.wait_timeout(seconds(t)))
                .ok_or_else(|| RpcTimeout::new_err(format!("no result within {t} s (the call goes on)")))?,
        };
        unpack(py, r.map_err(|e| rpc_err(py, e))?)
    }

    fn done(&self) -> bool {
        self.fut.is_done()
    }

    /// Calls `callback()` (with the GIL, on a runtime thread) once the result is there.
    fn add_done_callback(&self, callback: Py<PyAny>) {
        let fut = self.fut.clone();
        rt().spawn(async move {
            let _ = fut.await;
            crate::gil::attach(|py| {
                if let Err(e) = callback.call0(py) {
                    e.write_unraisable(py, None);
                }
            });
        });
    }
}

/// A reference to a value owned by some worker.
#[pyclass(module = "sluice._sluice", name = "_RRef", frozen)]
pub struct PyRRef {
    rref: RRef<()>,
}

#[pymethods]
impl PyRRef {
    fn owner(&self) -> (String, u32) {
        let o = self.rref.owner();
        (o.name.clone(), o.id)
    }

    fn is_owner(&self) -> bool {
        self.rref.is_owner()
    }

    fn confirmed_by_owner(&self) -> bool {
        self.rref.confirmed_by_owner()
    }

    /// The value itself (only on the owner).
    fn local_value<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = py.detach(|| self.rref.local()).map_err(|e| rpc_err(py, e))?;
        if let Some(o) = v.object_ref::<PyObj>() {
            return Ok(o.0.bind(py).clone());
        }
        let p = v.to_payload().map_err(|e| rpc_err(py, e))?;
        UNPACK.get(py)?.call1(unpack(py, p)?)
    }

    /// Fetches a copy of the value.
    #[pyo3(signature = (timeout))]
    fn fetch(&self, timeout: f64) -> PyFuture {
        PyFuture {
            fut: self.rref.fetch(seconds(timeout)),
        }
    }

    /// Waits until the value exists on its owner; raises the error that kept it from
    /// existing (the callee's own exception for a failed `remote`).
    fn wait_created(&self, py: Python<'_>) -> PyResult<()> {
        let created = self.rref.created();
        py.detach(|| created.wait()).map(|_| ()).map_err(|e| rpc_err(py, e))
    }

    /// Runs a method of the value on its owner (`py.method`).
    fn method(
        &self,
        py: Python<'_>,
        key: &str,
        data: &Bound<'_, PyBytes>,
        tensors: &Bound<'_, PyAny>,
        rrefs: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<PyFuture> {
        let p = payload(key, data, tensors, rrefs)?;
        let t = seconds(timeout);
        let fut = py.detach(|| self.rref.rpc_async_raw("py.method", p, t));
        Ok(PyFuture { fut })
    }

    /// The `remote` form of [`method`]: the owner keeps the result.
    fn remote_method(
        &self,
        py: Python<'_>,
        key: &str,
        data: &Bound<'_, PyBytes>,
        tensors: &Bound<'_, PyAny>,
        rrefs: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<PyRRef> {
        let p = payload(key, data, tensors, rrefs)?;
        let t = seconds(timeout);
        let rref = py
            .detach(|| self.rref.remote_raw::<()>("py.method", p, t))
            .map_err(|e| rpc_err(py, e))?;
        Ok(PyRRef { rref })
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.rref)
    }
}

/// Sets the priority of calls made on this thread from now on (`sluice.rpc.priority`) and
/// returns the previous level; a level outside -8..=7 is a `ValueError`.
#[pyfunction]
pub fn _set_priority(level: i64) -> PyResult<i8> {
    let p = i8::try_from(level)
        .ok()
        .and_then(sluice_agent::Priority::new)
        .ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "priority {level} is out of range ({}..={})",
                sluice_agent::Priority::LOWEST,
                sluice_agent::Priority::HIGHEST
            ))
        })?;
    Ok(sluice_agent::priority::set_current(p).level())
}

/// The priority level calls made on this thread get now (`sluice.rpc.current_priority`).
#[pyfunction]
pub fn _current_priority() -> i8 {
    sluice_agent::priority::current().level()
}
