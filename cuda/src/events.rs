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

/// Waits for `event` (of `device`): a query first, then a blocking wait on a blocking thread.
/// `keep` holds the event alive until the blocking wait has returned, even if this future is
/// dropped first.
async fn wait_kept(device: u32, event: RawEvent, keep: impl Send + 'static) -> Result<(), CudaError> {
    let cuda = runtime()?;
    {
        let bound = cuda.bind(device)?;
        // SAFETY: the event is alive (`keep`).
        if unsafe { driver::event_query(&bound, event) }? {
            return Ok(());
        }
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
