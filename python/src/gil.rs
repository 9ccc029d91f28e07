//! Taking the GIL from the agent's and the runtime's threads cheaply.
//!
//! A thread Python has never seen gets a fresh thread state from every `PyGILState_Ensure` and
//! loses it at the matching release: microseconds per handler call. The first time such a
//! thread takes the GIL here it keeps one thread state for good (ensured once, never released,
//! the GIL itself given back at once), so later attaches only take the GIL.

use std::cell::Cell;

use pyo3::{ffi, Python};

thread_local! {
    static KEPT: Cell<bool> = const { Cell::new(false) };
}

/// `Python::attach`, keeping this thread's Python thread state between calls.
pub fn attach<R>(f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
    if !KEPT.get() {
        KEPT.set(true);
        // SAFETY: with the interpreter initialized (this module is loaded by it), asking for
        // this thread's state has no precondition.
        let known = unsafe { !ffi::PyGILState_GetThisThreadState().is_null() };
        if !known {
            // SAFETY: a thread with no thread state holds no GIL: Ensure creates its state and
            // takes the GIL; SaveThread gives the GIL back and keeps the state (the Ensure is
            // deliberately never released, so the state lives as long as the thread).
            unsafe {
                let _ = ffi::PyGILState_Ensure();
                let _ = ffi::PyEval_SaveThread();
            }
        }
    }
    Python::attach(f)
}
