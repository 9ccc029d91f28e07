//! The rules the model enforces, each with where it comes from, and what happens on a breach.
//!
//! A breach is reported on stderr naming the rule and its source, then the process aborts (a
//! test that breaks a rule fails loudly, wherever it runs). `SLUICE_CUDA_MODEL_BREACH=error`
//! makes the call return an error code instead (the model's own tests use it to check that each
//! rule fires); the last breach is kept for them ([`last_breach`]).

use std::sync::Mutex;

/// Where a rule comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A sentence of NVIDIA's CUDA Driver API documentation (quoted in the rule).
    Documented,
    /// What Sluice's own code promises (its module docs).
    Contract,
    /// What we believe the driver does and have not checked on hardware yet.
    Unverified,
}

/// One rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub id: &'static str,
    pub source: Source,
    /// The rule, and for documented ones the sentence it rests on.
    pub text: &'static str,
}

pub const NO_CONTEXT: Rule = Rule {
    id: "context.current",
    source: Source::Documented,
    text: "calls that work in a context need one current on the calling thread (cuMemAlloc, \
           cuStreamCreate, cuEventCreate: \"in the current context\"; otherwise \
           CUDA_ERROR_INVALID_CONTEXT)",
};
pub const POP_EMPTY: Rule = Rule {
    id: "context.pop",
    source: Source::Documented,
    text: "cuCtxPopCurrent with no context current fails (\"Pops the current CUDA context from \
           the CPU thread\")",
};
pub const HANDLE: Rule = Rule {
    id: "handle.valid",
    source: Source::Documented,
    text: "handles must name live objects (CUDA_ERROR_INVALID_HANDLE)",
};
pub const NOT_INITIALIZED: Rule = Rule {
    id: "init.first",
    source: Source::Documented,
    text: "\"cuInit() must be called before any other function from the driver API\" \
           (CUDA_ERROR_NOT_INITIALIZED)",
};
pub const COPY_RANGE: Rule = Rule {
    id: "memory.copy-range",
    source: Source::Documented,
    text: "a copy's device range must lie inside one live allocation (CUDA_ERROR_INVALID_VALUE)",
};
pub const HOST_DEREF: Rule = Rule {
    id: "memory.host-deref",
    source: Source::Documented,
    text: "host code cannot dereference device memory (device pointers are not host addresses)",
};
pub const FREE_BUSY: Rule = Rule {
    id: "memory.free-busy",
    source: Source::Contract,
    text: "memory is freed only once no queued work uses it (the driver may synchronize in \
           cuMemFree; nothing may rely on it)",
};
pub const FREE_IMPORTED: Rule = Rule {
    id: "ipc.free-imported",
    source: Source::Documented,
    text: "\"Calling cuMemFree on an exported memory region before calling cuIpcCloseMemHandle in \
           the importing context will result in undefined behavior\" (cuIpcOpenMemHandle)",
};
pub const IPC_FLAGS: Rule = Rule {
    id: "ipc.open-flags",
    source: Source::Documented,
    text: "cuIpcOpenMemHandle's Flags \"Must be specified as CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS\" \
           (CUDA_ERROR_INVALID_VALUE)",
};
pub const IPC_ONE_CONTEXT: Rule = Rule {
    id: "ipc.one-context",
    source: Source::Documented,
    text: "\"CUipcMemHandles from each CUdevice in a given process may only be opened by one \
           CUcontext per CUdevice per other process\" (cuIpcOpenMemHandle)",
};
pub const EVENT_CONTEXT: Rule = Rule {
    id: "event.same-context",
    source: Source::Documented,
    text: "\"hEvent and hStream must be from the same context otherwise CUDA_ERROR_INVALID_HANDLE \
           is returned\" (cuEventRecord)",
};
pub const PEER_FLAGS: Rule = Rule {
    id: "context.peer-flags",
    source: Source::Documented,
    text: "cuCtxEnablePeerAccess: \"Returns CUDA_ERROR_INVALID_VALUE if Flags is not 0\"",
};
pub const IPC_STALE: Rule = Rule {
    id: "ipc.stale-handle",
    source: Source::Documented,
    text: "an IPC handle names a live allocation of a live process (CUDA_ERROR_INVALID_HANDLE)",
};
pub const IPC_SAME_PROCESS: Rule = Rule {
    id: "ipc.same-process",
    source: Source::Documented,
    text: "\"cuIpcOpenMemHandle ... cannot be used to open handles in the same process\" \
           (CUDA_ERROR_INVALID_CONTEXT)",
};
pub const EVENT_DESTROYED: Rule = Rule {
    id: "ipc.event-destroyed",
    source: Source::Documented,
    text: "\"Performing operations on the imported event after the exported event has been freed \
           with cuEventDestroy will result in undefined behavior\" (cuIpcOpenEventHandle)",
};
pub const EVENT_NOT_IPC: Rule = Rule {
    id: "ipc.event-flags",
    source: Source::Documented,
    text: "cuIpcGetEventHandle needs an event made with CU_EVENT_INTERPROCESS and \
           CU_EVENT_DISABLE_TIMING (CUDA_ERROR_INVALID_VALUE)",
};
pub const IMAGE: Rule = Rule {
    id: "module.image",
    source: Source::Contract,
    text: "modules load images the model's NVRTC made (the model cannot run real PTX or CUBIN; \
           CUDA_ERROR_INVALID_IMAGE)",
};
pub const COPY_OVERLAP: Rule = Rule {
    id: "memory.copy-overlap",
    source: Source::Unverified,
    text: "a device-to-device copy's source and destination do not overlap (a GPU's copy engines \
           make no promise for overlapping ranges; the model's memmove would hide the bug)",
};
pub const LAUNCH: Rule = Rule {
    id: "launch.config",
    source: Source::Documented,
    text: "a launch's grid and block are within the device's limits (at least 1 each way, at most \
           1024 threads a block, grid y and z at most 65535) and its arguments come through \
           kernelParams (CUDA_ERROR_INVALID_VALUE)",
};
pub const LAUNCH_CONTEXT: Rule = Rule {
    id: "launch.context",
    source: Source::Documented,
    text: "a kernel runs in the context of its stream (\"the context to launch the kernel on will \
           either be taken from the specified stream\"), so it must come from a module loaded \
           there, and its pointers must be that device's memory or a peer's with access enabled",
};
pub const OUT_OF_BOUNDS: Rule = Rule {
    id: "memory.out-of-bounds",
    source: Source::Documented,
    text: "accesses stay inside their allocation (a GPU reports CUDA_ERROR_ILLEGAL_ADDRESS, or \
           corrupts a neighbour; the model's views end at a guard page, so a stray access past \
           the last page faults and is named)",
};
pub const HOST_FREE: Rule = Rule {
    id: "memory.free-host",
    source: Source::Documented,
    text: "cuMemFreeHost takes memory from cuMemHostAlloc (CUDA_ERROR_INVALID_VALUE)",
};

/// The breach that happened last (for the model's tests).
static LAST: Mutex<Option<(&'static str, String)>> = Mutex::new(None);

/// The last breach: the rule's id and the detail.
pub fn last_breach() -> Option<(&'static str, String)> {
    LAST.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// A documented refusal: the driver returns `code` for this every time (so a caller may rely
/// on it, as the driver-facts tests do); recorded like a breach, never aborting.
pub fn refuse(rule: Rule, code: i32, detail: String) -> i32 {
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = Some((rule.id, detail));
    code
}

/// Reports a breach of `rule`: aborts, or (with `SLUICE_CUDA_MODEL_BREACH=error`) returns
/// `code` for the call to return.
pub fn breach(rule: Rule, code: i32, detail: String) -> i32 {
    let source = match rule.source {
        Source::Documented => "documented",
        Source::Contract => "Sluice's own contract",
        Source::Unverified => "unverified",
    };
    eprintln!(
        "sluice CUDA driver model: broke rule {} ({source}): {}: {detail}",
        rule.id, rule.text
    );
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = Some((rule.id, detail));
    if std::env::var("SLUICE_CUDA_MODEL_BREACH").as_deref() == Ok("error") {
        return code;
    }
    std::process::abort();
}
