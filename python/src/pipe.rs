//! The pipe level: contexts, listeners, pipes, messages (see `sluice/pipe.py` for the Python
//! face of these classes).

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use sluice_channel::{
    Allocation, ChannelKind, Context, ContextOptions, Descriptor, Message, Pipe, PipeListener, Tensor, TransportKind,
};
use tokio::sync::Mutex as AsyncMutex;

use crate::runtime::{block_on, rt, to_asyncio};
use crate::tensor::{to_channel, Received};
use crate::PipeError;

fn pipe_err(e: sluice_channel::PipeError) -> PyErr {
    PipeError::new_err(e.to_string())
}

/// A process's transports and channels.
#[pyclass(module = "sluice._sluice", name = "_Context", frozen)]
pub struct PyContext {
    ctx: Context,
}

#[pymethods]
impl PyContext {
    #[new]
    #[pyo3(signature = (transports=None, channels=None, name=None))]
    fn new(transports: Option<Vec<String>>, channels: Option<Vec<String>>, name: Option<String>) -> PyResult<Self> {
        let mut options = ContextOptions::default();
        if let Some(list) = transports {
            options.transports = list
                .iter()
                .map(|t| {
                    TransportKind::from_name(t)
                        .ok_or_else(|| PyValueError::new_err(format!("unknown transport {t:?} (tcp, shm, ibv)")))
                })
                .collect::<PyResult<_>>()?;
        }
        if let Some(list) = channels {
            options.channels = list
                .iter()
                .map(|c| {
                    ChannelKind::from_name(c).ok_or_else(|| {
                        let known: Vec<&str> = ChannelKind::ALL.iter().map(|k| k.name()).collect();
                        PyValueError::new_err(format!("unknown channel {c:?} (one of {})", known.join(", ")))
                    })
                })
                .collect::<PyResult<_>>()?;
        }
        if let Some(n) = name {
            options.name = n;
        }
        // Made inside the runtime: the context's transports register with its reactor.
        let ctx = rt().block_on(async { Context::new(options) }).map_err(pipe_err)?;
        Ok(PyContext { ctx })
    }

    /// Viable transports and channels, in priority order.
    #[getter]
    fn transports(&self) -> Vec<&'static str> {
        self.ctx.transports().iter().map(|t| t.name()).collect()
    }

    #[getter]
    fn channels(&self) -> Vec<&'static str> {
        self.ctx.channels().iter().map(|c| c.name()).collect()
    }

    fn listen(&self, py: Python<'_>, addr: &str) -> PyResult<PyListener> {
        let ctx = self.ctx.clone();
        let addr = addr.to_owned();
        let l = block_on(py, async move { ctx.listen(&addr).await }).map_err(pipe_err)?;
        Ok(PyListener {
            address: l.address().to_owned(),
            inner: Arc::new(AsyncMutex::new(Some(l))),
        })
    }

    fn connect(&self, py: Python<'_>, addr: &str) -> PyResult<PyPipe> {
        let ctx = self.ctx.clone();
        let addr = addr.to_owned();
        let p = block_on(py, async move { ctx.connect(&addr).await }).map_err(pipe_err)?;
        Ok(PyPipe::new(p))
    }

    fn connect_async<'py>(&self, py: Python<'py>, addr: &str) -> PyResult<Bound<'py, PyAny>> {
        let ctx = self.ctx.clone();
        let addr = addr.to_owned();
        to_asyncio(
            py,
            async move { ctx.connect(&addr).await.map_err(pipe_err) },
            |py, p| Ok(Bound::new(py, PyPipe::new(p))?.into_any()),
        )
    }
}

/// Accepts pipes.
#[pyclass(module = "sluice._sluice", name = "_Listener", frozen)]
pub struct PyListener {
    address: String,
    inner: Arc<AsyncMutex<Option<PipeListener>>>,
}

async fn accept(inner: Arc<AsyncMutex<Option<PipeListener>>>) -> PyResult<Pipe> {
    let mut guard = inner.lock().await;
    let l = guard
        .as_mut()
        .ok_or_else(|| PipeError::new_err("the listener is closed"))?;
    l.accept().await.map_err(pipe_err)
}

#[pymethods]
impl PyListener {
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    fn accept(&self, py: Python<'_>) -> PyResult<PyPipe> {
        let inner = self.inner.clone();
        block_on(py, accept(inner)).map(PyPipe::new)
    }

    fn accept_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner.clone();
        to_asyncio(
            py,
            accept(inner),
            |py, p| Ok(Bound::new(py, PyPipe::new(p))?.into_any()),
        )
    }

    /// Stops listening (pipes already accepted stay open).
    fn close(&self, py: Python<'_>) {
        let inner = self.inner.clone();
        block_on(py, async move { inner.lock().await.take() });
    }
}

/// A link to one peer.
#[pyclass(module = "sluice._sluice", name = "_Pipe", frozen)]
pub struct PyPipe {
    pipe: Pipe,
    /// The descriptor read last, waiting for its `read`.
    pending: Arc<Mutex<Option<Descriptor>>>,
}

impl PyPipe {
    fn new(pipe: Pipe) -> PyPipe {
        PyPipe {
            pipe,
            pending: Arc::default(),
        }
    }

    fn message(metadata: &[u8], payloads: Vec<Vec<u8>>, tensors: &Bound<'_, PyList>) -> PyResult<Message> {
        let tensors = tensors
            .iter()
            .map(|t| to_channel(&t, None))
            .collect::<PyResult<Vec<Tensor>>>()?;
        Ok(Message {
            metadata: Bytes::copy_from_slice(metadata),
            payloads: payloads.into_iter().map(Bytes::from).collect(),
            tensors,
        })
    }
}

async fn read_descriptor(pipe: Pipe, pending: Arc<Mutex<Option<Descriptor>>>) -> PyResult<Descriptor> {
    let d = pipe.read_descriptor().await.map_err(pipe_err)?;
    *pending.lock().expect("descriptor slot") = Some(d.clone());
    Ok(d)
}

async fn read(pipe: Pipe, pending: Arc<Mutex<Option<Descriptor>>>) -> PyResult<(Descriptor, Allocation)> {
    let d = match pending.lock().expect("descriptor slot").take() {
        Some(d) => d,
        None => {
            return Err(PipeError::new_err(
                "read() without a descriptor: call read_descriptor() first",
            ))
        }
    };
    let allocation = Allocation::for_descriptor(&d);
    let filled = pipe.read(allocation).await.map_err(|e| pipe_err(e.error))?;
    Ok((d, filled))
}

/// `(metadata, payload_lengths, [tensor info dicts])`.
fn descriptor_py<'py>(py: Python<'py>, d: Descriptor) -> PyResult<Bound<'py, PyAny>> {
    let tensors = PyList::empty(py);
    for t in &d.tensors {
        let info = PyDict::new(py);
        info.set_item("nbytes", t.length)?;
        info.set_item("device", t.source_device.to_string())?;
        if let Ok((meta, tag)) = sluice_dlpack::Meta::decode_tagged(&t.metadata, t.length as usize) {
            info.set_item("dtype", meta.dtype.name())?;
            info.set_item("shape", meta.shape.clone())?;
            info.set_item("strides", meta.strides.clone())?;
            info.set_item("framework", String::from_utf8_lossy(tag).into_owned())?;
        }
        tensors.append(info)?;
    }
    Ok((PyBytes::new(py, &d.metadata), d.payload_lengths.clone(), tensors)
        .into_pyobject(py)?
        .into_any())
}

/// `(metadata, [payload bytes], [Received])`.
fn message_py<'py>(py: Python<'py>, (d, a): (Descriptor, Allocation)) -> PyResult<Bound<'py, PyAny>> {
    let payloads = PyList::empty(py);
    for p in &a.payloads {
        payloads.append(PyBytes::new(py, p))?;
    }
    let tensors = PyList::empty(py);
    for (buffer, td) in a.tensors.into_iter().zip(&d.tensors) {
        let t = Tensor {
            buffer: buffer.freeze(),
            metadata: td.metadata.clone(),
            target_device: None,
        };
        tensors.append(Received::new(t)?)?;
    }
    Ok((PyBytes::new(py, &d.metadata), payloads, tensors)
        .into_pyobject(py)?
        .into_any())
}

#[pymethods]
impl PyPipe {
    /// Sends a message; returns once every buffer of it may be reused.
    fn write(
        &self,
        py: Python<'_>,
        metadata: &[u8],
        payloads: Vec<Vec<u8>>,
        tensors: &Bound<'_, PyList>,
    ) -> PyResult<()> {
        let m = Self::message(metadata, payloads, tensors)?;
        let pipe = self.pipe.clone();
        block_on(py, async move { pipe.write(&m).await }).map_err(pipe_err)
    }

    fn write_async<'py>(
        &self,
        py: Python<'py>,
        metadata: &[u8],
        payloads: Vec<Vec<u8>>,
        tensors: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let m = Self::message(metadata, payloads, tensors)?;
        let pipe = self.pipe.clone();
        to_asyncio(py, async move { pipe.write(&m).await.map_err(pipe_err) }, |py, ()| {
            Ok(py.None().into_bound(py))
        })
    }

    fn read_descriptor<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let d = block_on(py, read_descriptor(self.pipe.clone(), self.pending.clone()))?;
        descriptor_py(py, d)
    }

    fn read_descriptor_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_asyncio(
            py,
            read_descriptor(self.pipe.clone(), self.pending.clone()),
            descriptor_py,
        )
    }

    fn read<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let r = block_on(py, read(self.pipe.clone(), self.pending.clone()))?;
        message_py(py, r)
    }

    fn read_async<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_asyncio(py, read(self.pipe.clone(), self.pending.clone()), message_py)
    }

    fn close(&self) {
        self.pipe.close();
    }

    /// What negotiation chose: transport, CPU channel, peer.
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.pipe.info();
        let d = PyDict::new(py);
        d.set_item("peer", &i.peer)?;
        d.set_item("transport", i.transport)?;
        d.set_item("cpu_channel", i.cpu_channel.name())?;
        d.set_item("lanes", i.lanes)?;
        Ok(d)
    }
}
