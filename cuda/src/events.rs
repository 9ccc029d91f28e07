//! Pools of interprocess events, one per device, and the waits the channels build from them.
//!
//! Creating an event is cheap but an interprocess event must exist before its handle can be
//! sent, and a handle a peer has opened must keep naming the same event: so events are created
//! on demand, never destroyed, and reused through a free list. An [`EventSlot`] goes back to its
//! pool when dropped; the protocol drops it only once the peer can no longer be waiting for the
//! record it carried (see the pipe).
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, OnceLock};

use super::driver::{self, Bound, EventKind, RawEvent, RawStream, IPC_HANDLE_BYTES};
use super::{runtime, CudaError, Stream};

struct Pooled {
    event: RawEvent,
    handle: [u8; IPC_HANDLE_BYTES],
}

struct Pool {
    device: u32,
    free: Mutex<Vec<Pooled>>,
}

/// An event of a device's pool, returned to it on drop.
pub struct EventSlot {
    pool: Arc<Pool>,
    item: Option<Pooled>,
}

impl Drop for EventSlot {
    fn drop(&mut self) {
        if let Some(item) = self.item.take() {
            self.pool.free.lock().expect("event pool").push(item);
        }
    }
}

fn pool(device: u32) -> Arc<Pool> {
    static POOLS: OnceLock<Mutex<Vec<Arc<Pool>>>> = OnceLock::new();
    let pools = POOLS.get_or_init(Default::default);
    let mut pools = pools.lock().expect("event pools");
    if let Some(p) = pools.iter().find(|p| p.device == device) {
        return p.clone();
    }
    let p = Arc::new(Pool {
        device,
        free: Mutex::new(Vec::new()),
    });
    pools.push(p.clone());
    p
}

impl EventSlot {
    /// An event of `device`'s pool.
    pub fn take(device: u32) -> Result<EventSlot, CudaError> {
        let pool = pool(device);
        let reused = pool.free.lock().expect("event pool").pop();
        let item = match reused {
            Some(item) => item,
            None => {
                let bound = runtime()?.bind(device)?;
                let event = driver::event_create(&bound, EventKind::Interprocess)?;
                // SAFETY: just created as an interprocess event of the bound context.
                let handle = unsafe { driver::ipc_event_handle(&bound, event) }?;
                Pooled { event, handle }
            }
        };
        Ok(EventSlot { pool, item: Some(item) })
    }

    fn item(&self) -> &Pooled {
        self.item.as_ref().expect("present until drop")
    }

    pub fn raw(&self) -> RawEvent {
        self.item().event
    }

    pub fn ipc_handle(&self) -> [u8; IPC_HANDLE_BYTES] {
        self.item().handle
    }

    /// Records the work queued so far on `stream` (which must be of this pool's device).
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        debug_assert_eq!(stream.device(), self.pool.device);
        let bound = runtime()?.bind(self.pool.device)?;
        // SAFETY: both handles are alive (the pool never destroys events; the stream is held).
        unsafe { driver::event_record(&bound, self.raw(), stream.handle()) }?;
        Ok(())
    }

    /// Waits, without blocking the async runtime, for the work this event last recorded.
    pub async fn wait(&self) -> Result<(), CudaError> {
        wait_raw(self.pool.device, self.raw()).await
    }
}

/// Makes work queued later on `stream` wait for `event`'s last record (an event of this
/// process, or one opened from a peer's handle).
pub fn stream_wait(stream: &Stream, event: RawEvent) -> Result<(), CudaError> {
    let bound = runtime()?.bind(stream.device())?;
    // SAFETY: the stream is held; events are never destroyed while a pipe can name them
    // (pooled events live forever, opened ones are held by whoever is using them).
    unsafe { driver::stream_wait_event(&bound, stream.handle(), event) }?;
    Ok(())
}

/// Where a wait for an event recorded by *another process* is made (`SLUICE_CUDA_PEER_WAIT`).
///
/// Two processes on one GPU run in two contexts, which the GPU time-slices (unless MPS merges
/// them). A stream of one context made to wait on the other's event keeps its context
/// scheduled while it cannot progress. Measured on an H100 (2026-11-27): a 4 KiB cuda_ipc round
/// trip took ~570 µs with device waits, ~320 µs with host waits, 48 µs under MPS; and without
/// MPS a loop of 256 MiB `rpc_sync` sends with device waits stopped making progress (three
/// runs; 64 MiB did not), which host waits never did. Hence the default: host waits between
/// processes sharing a GPU. Under MPS host waits cost little (40 µs against 35 µs in one run);
/// `device` there is the user's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerWait {
    /// Always queue the wait on the stream (`cuStreamWaitEvent`): the host never waits.
    /// Best across GPUs, and on one GPU under MPS.
    Device,
    /// Always wait on the host (a query, a short spin, then a blocking thread), so no stream
    /// ever waits on another process's context.
    Host,
    /// On the host where both ends are one physical GPU, on the device otherwise (the default).
    Auto,
}

impl PeerWait {
    /// Parses `device`, `host` or `auto`.
    pub fn parse(s: &str) -> Option<PeerWait> {
        match s {
            "device" => Some(PeerWait::Device),
            "host" => Some(PeerWait::Host),
            "auto" => Some(PeerWait::Auto),
            _ => None,
        }
    }

    /// This process's policy: `SLUICE_CUDA_PEER_WAIT`, read once (an unknown value is
    /// `auto`, with a warning on stderr).
    pub fn current() -> PeerWait {
        static POLICY: OnceLock<PeerWait> = OnceLock::new();
        *POLICY.get_or_init(|| match std::env::var("SLUICE_CUDA_PEER_WAIT") {
            Ok(v) => PeerWait::parse(&v).unwrap_or_else(|| {
                eprintln!("sluice: SLUICE_CUDA_PEER_WAIT={v:?} is not device, host or auto; using auto");
                PeerWait::Auto
            }),
            Err(_) => PeerWait::Auto,
        })
    }

    /// Whether a wait for a peer's event is made on the host, for two ends that are
    /// (`shared_gpu`) or are not one physical GPU.
    pub fn on_host(self, shared_gpu: bool) -> bool {
        match self {
            PeerWait::Device => false,
            PeerWait::Host => true,
            PeerWait::Auto => shared_gpu,
        }
    }
}

/// Waits on the host for `event` of `device` (one of this process's, or one opened from a
/// peer's handle), without blocking the async runtime: it is asked again between yields to the
/// runtime for up to `SLUICE_CUDA_PEER_SPIN_US` (default 200 µs: a GPU's switch between two
/// processes' contexts takes ~100 µs, and a blocking thread's hand-off added ~40 µs and a
/// long tail on an H100; polling longer only burns a core others may need), then waited for on
/// a blocking thread. `keep` holds the event alive
/// until the wait has returned, even if this future is dropped first.
pub async fn wait_host(device: u32, event: RawEvent, keep: impl Send + 'static) -> Result<(), CudaError> {
    static SPIN: OnceLock<std::time::Duration> = OnceLock::new();
    let budget = *SPIN.get_or_init(|| spin_from_env("SLUICE_CUDA_PEER_SPIN_US", 200));
    poll_then_block(device, event, keep, budget).await
}

fn spin_from_env(var: &str, default_us: u64) -> std::time::Duration {
    let us = std::env::var(var).ok().and_then(|v| v.parse().ok());
    std::time::Duration::from_micros(us.unwrap_or(default_us))
}

/// How long a host wait for this process's own event polls it before handing the wait to a
/// blocking thread (`SLUICE_CUDA_HOST_SPIN_US`, default 0: asked once; on an H100, 200 µs cut
/// cuda_staged's 4 KiB round trip from ~500 to ~390 µs, at a core's cost while it polls).
fn host_spin() -> std::time::Duration {
    static SPIN: OnceLock<std::time::Duration> = OnceLock::new();
    *SPIN.get_or_init(|| spin_from_env("SLUICE_CUDA_HOST_SPIN_US", 0))
}

/// Waits for `event` (of `device`), polling it for up to [`host_spin`] first (see
/// [`poll_then_block`]).
async fn wait_kept(device: u32, event: RawEvent, keep: impl Send + 'static) -> Result<(), CudaError> {
    poll_then_block(device, event, keep, host_spin()).await
}

/// Asks `event` whether it has completed, again after each yield to the async runtime for up to
/// `budget` (so other tasks on this thread run meanwhile), then waits for it on a blocking
/// thread. `keep` holds the event alive until the blocking wait has returned, even if this
/// future is dropped first.
async fn poll_then_block(
    device: u32,
    event: RawEvent,
    keep: impl Send + 'static,
    budget: std::time::Duration,
) -> Result<(), CudaError> {
    let cuda = runtime()?;
    let start = std::time::Instant::now();
    loop {
        {
            let bound = cuda.bind(device)?;
            // SAFETY: the event is alive (`keep`).
            if unsafe { driver::event_query(&bound, event) }? {
                return Ok(());
            }
        }
        if start.elapsed() >= budget {
            break;
        }
        tokio::task::yield_now().await;
    }
    tokio::task::spawn_blocking(move || {
        let _keep = keep;
        let bound = cuda.bind(device)?;
        // SAFETY: as above. Events Sluice waits on this way are created with blocking sync,
        // so this thread sleeps rather than spins.
        unsafe { driver::event_synchronize(&bound, event) }?;
        Ok(())
    })
    .await
    .map_err(|e| CudaError::Invalid(format!("event wait thread failed: {e}")))?
}

/// Waits for `event` (of `device`), an event that lives as long as the process (a pool's).
pub async fn wait_raw(device: u32, event: RawEvent) -> Result<(), CudaError> {
    wait_kept(device, event, ()).await
}

/// A plain (in-process) CUDA event of one device: what a future or an RRef keeps so that a
/// consumer's stream can wait for the work that produced a value, and nothing after it.
/// Destroyed with its last clone (waits already queued on it are unaffected).
#[derive(Clone)]
pub struct Event {
    inner: Arc<EventInner>,
}

struct EventInner {
    device: u32,
    raw: RawEvent,
}

impl Drop for EventInner {
    fn drop(&mut self) {
        if let Ok(cuda) = runtime() {
            if let Ok(bound) = cuda.bind(self.device) {
                // SAFETY: created by `Event::record`, destroyed once (last clone); queued
                // waits on it keep their meaning after destruction.
                let _ = unsafe { driver::event_destroy(&bound, self.raw) };
            }
        }
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event(cuda:{}, {:#x})", self.inner.device, self.inner.raw.0)
    }
}

impl Event {
    /// A new event recording the work queued so far on `stream`.
    pub fn record(stream: &Stream) -> Result<Event, CudaError> {
        let bound = runtime()?.bind(stream.device())?;
        Event::record_raw(&bound, stream.handle())
    }

    /// As [`record`](Self::record), on a raw stream of the bound device (a stream being
    /// dropped records its last fence this way).
    pub(crate) fn record_raw(bound: &Bound, stream: RawStream) -> Result<Event, CudaError> {
        let raw = driver::event_create(bound, EventKind::Local)?;
        let event = Event {
            inner: Arc::new(EventInner {
                device: bound.device(),
                raw,
            }),
        };
        // SAFETY: both handles are alive (the event is ours; the caller holds the stream).
        unsafe { driver::event_record(bound, raw, stream) }?;
        Ok(event)
    }

    pub fn device(&self) -> u32 {
        self.inner.device
    }

    /// Makes work queued later on `stream` wait for the recorded work (no host wait).
    /// Streams of another device of this process may wait too.
    pub fn wait_on(&self, stream: &Stream) -> Result<(), CudaError> {
        stream_wait(stream, self.inner.raw)
    }

    /// Whether the recorded work has finished.
    pub fn is_done(&self) -> Result<bool, CudaError> {
        let bound = runtime()?.bind(self.inner.device)?;
        // SAFETY: the event is alive while `self` is.
        Ok(unsafe { driver::event_query(&bound, self.inner.raw) }?)
    }

    /// Blocks this thread until the recorded work has finished.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let bound = runtime()?.bind(self.inner.device)?;
        // SAFETY: as above; a blocking-sync event, so this thread sleeps.
        unsafe { driver::event_synchronize(&bound, self.inner.raw) }?;
        Ok(())
    }

    /// As [`synchronize`](Self::synchronize), without blocking the async runtime.
    pub async fn wait(&self) -> Result<(), CudaError> {
        wait_kept(self.inner.device, self.inner.raw, self.clone()).await
    }
}

#[cfg(test)]
mod tests {
    //! On a GPU only (the gate skips them elsewhere and fails them under `SLUICE_REQUIRE_GPU=1`).
    use super::*;
    use crate::gate::gpu_or_skip;
    use crate::CudaBuffer;

    #[test]
    fn peer_wait_policies_parse_and_choose() {
        assert_eq!(PeerWait::parse("device"), Some(PeerWait::Device));
        assert_eq!(PeerWait::parse("host"), Some(PeerWait::Host));
        assert_eq!(PeerWait::parse("auto"), Some(PeerWait::Auto));
        for bad in ["", "Host", "spin", "sleep"] {
            assert_eq!(PeerWait::parse(bad), None, "{bad:?}");
        }
        assert!(PeerWait::Auto.on_host(true) && !PeerWait::Auto.on_host(false));
        assert!(PeerWait::Host.on_host(false) && !PeerWait::Device.on_host(true));
    }

    #[test]
    fn an_event_orders_a_second_stream_after_the_first() {
        if !gpu_or_skip("events::an_event_orders_a_second_stream_after_the_first") {
            return;
        }
        let (a, b) = (Stream::new(0).unwrap(), Stream::new(0).unwrap());
        let n = 64 << 20;
        let src = CudaBuffer::alloc(n, &a).unwrap();
        src.fill(0x5a).unwrap();
        let done = Event::record(&a).unwrap();
        assert_eq!(done.device(), 0);
        // Stream b copies only after a's fill: without the wait it could read stale bytes.
        let dst = CudaBuffer::alloc(n, &b).unwrap();
        dst.fill(0).unwrap();
        done.wait_on(&b).unwrap();
        dst.copy_from(&src).unwrap();
        let after = Event::record(&b).unwrap();
        after.synchronize().unwrap();
        assert!(after.is_done().unwrap());
        assert!(dst.read_to_host().unwrap().iter().all(|&x| x == 0x5a));
    }

    #[test]
    fn pooled_interprocess_events_are_reused_with_their_handles() {
        if !gpu_or_skip("events::pooled_interprocess_events_are_reused_with_their_handles") {
            return;
        }
        let s = Stream::new(0).unwrap();
        let first = EventSlot::take(0).unwrap();
        let (raw, handle) = (first.raw(), first.ipc_handle());
        assert!(handle.iter().any(|&x| x != 0), "an IPC handle of zeros");
        first.record(&s).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(first.wait()).unwrap();
        drop(first);
        // Back in the pool, the same event (and handle) serves the next taker.
        let again = EventSlot::take(0).unwrap();
        assert_eq!((again.raw(), again.ipc_handle()), (raw, handle));
        // A second one taken meanwhile is a different event.
        let other = EventSlot::take(0).unwrap();
        assert_ne!(other.raw(), raw);
    }
}
