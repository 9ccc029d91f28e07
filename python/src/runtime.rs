//! The runtime that drives the binding's pipes, and the bridge from its futures to Python:
//! blocking calls wait with the GIL released; `*_async` calls return an asyncio future that a
//! runtime task settles through the loop's `call_soon_threadsafe`.

use std::future::Future;
use std::sync::OnceLock;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use tokio::runtime::Runtime;

/// One runtime per process, started on first use (two threads: the pipes' I/O is light; the
/// heavy copies run in the channels' own threads or the kernel).
pub fn rt() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("sluice-py")
            .enable_all()
            .build()
            .expect("the binding's runtime starts")
    })
}

/// Runs `fut` to completion with the GIL released.
pub fn block_on<T: Send, F: Future<Output = T> + Send>(py: Python<'_>, fut: F) -> T {
    py.detach(|| rt().block_on(fut))
}

static RESOLVE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// An asyncio future of the running loop, settled with `fut`'s result (converted with the GIL
/// held) when it completes.
pub fn to_asyncio<'py, T, F, C>(py: Python<'py>, fut: F, convert: C) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = PyResult<T>> + Send + 'static,
    T: Send + 'static,
    C: for<'a> FnOnce(Python<'a>, T) -> PyResult<Bound<'a, PyAny>> + Send + 'static,
{
    let resolve = RESOLVE.import(py, "sluice._aio", "resolve")?.clone().unbind();
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let future = event_loop.call_method0("create_future")?;
    let (lp, f) = (event_loop.unbind(), future.clone().unbind());
    rt().spawn(async move {
        let result = fut.await;
        crate::gil::attach(|py| {
            let (ok, value) = match result.and_then(|v| convert(py, v)) {
                Ok(v) => (true, v),
                Err(e) => (false, e.into_value(py).into_bound(py).into_any()),
            };
            // The loop may be closed by now: nobody is waiting, nothing to report.
            let _ = lp.call_method1(py, "call_soon_threadsafe", (resolve, f, ok, value));
        });
    });
    Ok(future)
}
