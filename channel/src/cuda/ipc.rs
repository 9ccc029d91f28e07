//! What a process opened from its peers' IPC handles: their allocations mapped here and their
//! events, each opened once and shared (opening maps memory and costs tens of microseconds).
//!
//! - **Single flight**: the first caller for a handle opens it while later callers for the
//!   same handle wait for that result, so a handle is never opened twice (the driver counts
//!   opens, and a second open would leak a reference). A failed open is not cached.
//! - **Reference counted**: callers hold an `Arc` of what was opened; the cache holds one
//!   too. Eviction (the cache is bounded, least recently used first) and a peer's last pipe
//!   closing only drop the cache's reference, so nothing is closed under a caller.
//! - **Closed after its copies, never blocking the runtime**: a mapping remembers an event
//!   recorded after each copy that read it; once the last reference is gone it is handed to a
//!   closer thread, which closes it when those events have completed (polling, never waiting
//!   on the device: a crashed peer's event that never fires delays the close, for at most
//!   [`CLOSE_PATIENCE`], after which the mapping is left open rather than closed under a copy).
//!
//! The exporter keeps exported memory for good (see `sluice_cuda`'s allocator), so however
//! long a mapping stays open here, it never outlives the allocation it maps.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::driver::{self, DevicePtr, RawEvent, IPC_HANDLE_BYTES};
use super::{runtime, CudaError, Event};

/// Most mappings (and, separately, events) kept open per process.
pub const MAX_OPEN: usize = 1024;

/// How long the closer waits for a mapping's copies before leaving it open for good.
pub const CLOSE_PATIENCE: Duration = Duration::from_secs(60);

type Handle = [u8; IPC_HANDLE_BYTES];

/// Who exported a handle and into which of our devices it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    peer: u64,
    device: u32,
    handle: Handle,
}

/// An open attempt others may wait on.
type Flight<T> = Arc<OnceLock<Result<Arc<T>, CudaError>>>;

struct Entry<T> {
    flight: Flight<T>,
    used: u64,
}

/// A bounded, single-flight cache of shared values, least recently used evicted.
struct Cache<K, T> {
    entries: HashMap<K, Entry<T>>,
    tick: u64,
    bound: usize,
}

impl<K: Copy + Eq + Hash, T> Cache<K, T> {
    fn new(bound: usize) -> Self {
        Cache {
            entries: HashMap::new(),
            tick: 0,
            bound,
        }
    }

    /// The flight for `key` (joined or started), evicting the least recently used entries
    /// beyond the bound (their holders keep them alive).
    fn flight(&mut self, key: K) -> Flight<T> {
        self.tick += 1;
        let tick = self.tick;
        let flight = {
            let e = self.entries.entry(key).or_insert_with(|| Entry {
                flight: Arc::new(OnceLock::new()),
                used: tick,
            });
            e.used = tick;
            e.flight.clone()
        };
        while self.entries.len() > self.bound {
            let oldest = *self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k)
                .expect("over the bound, so not empty");
            self.entries.remove(&oldest);
        }
        flight
    }

    /// Forgets a failed flight so the next caller tries again.
    fn failed(&mut self, key: &K, flight: &Flight<T>) {
        if self.entries.get(key).is_some_and(|e| Arc::ptr_eq(&e.flight, flight)) {
            self.entries.remove(key);
        }
    }

    fn remove_where(&mut self, f: impl Fn(&K) -> bool) {
        self.entries.retain(|k, _| !f(k));
    }
}

/// Runs `key`'s flight: joins an open in progress or cached, or opens now (without holding
/// the cache's lock, so other handles are not held up).
fn get<K: Copy + Eq + Hash, T>(
    cache: &Mutex<Cache<K, T>>,
    key: K,
    open: impl FnOnce() -> Result<T, CudaError>,
) -> Result<Arc<T>, CudaError> {
    let flight = cache.lock().unwrap_or_else(|e| e.into_inner()).flight(key);
    let result = flight.get_or_init(|| open().map(Arc::new)).clone();
    if result.is_err() {
        cache.lock().unwrap_or_else(|e| e.into_inner()).failed(&key, &flight);
    }
    result
}

/// A peer's allocation mapped into one of our devices.
pub(crate) struct Mapping {
    device: u32,
    base: DevicePtr,
    /// The allocation's size as its exporter stated it (a handle names one allocation, whose
    /// size never changes: a peer stating another size for it is refused).
    size: u64,
    /// Events recorded after copies that read the mapping, not yet known complete.
    fences: Mutex<Vec<Event>>,
}

impl Mapping {
    pub fn base(&self) -> DevicePtr {
        self.base
    }

    /// A copy reading this mapping was queued; `fence` follows it.
    pub fn used(&self, fence: Event) {
        let mut f = self.fences.lock().unwrap_or_else(|e| e.into_inner());
        f.retain(|e| !e.is_done().unwrap_or(false));
        f.push(fence);
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let fences = std::mem::take(self.fences.get_mut().unwrap_or_else(|e| e.into_inner()));
        closer(Closing {
            device: self.device,
            base: self.base,
            fences,
            since: Instant::now(),
        });
    }
}

/// A peer's interprocess event opened here; destroyed with its last holder (waits already
/// queued on it keep their meaning).
pub(crate) struct OpenedEvent {
    device: u32,
    raw: RawEvent,
}

impl OpenedEvent {
    pub fn raw(&self) -> RawEvent {
        self.raw
    }
}

impl Drop for OpenedEvent {
    fn drop(&mut self) {
        let Ok(cuda) = runtime() else { return };
        if let Ok(bound) = cuda.bind(self.device) {
            // SAFETY: opened by `open_event`, destroyed once (its last holder); no caller can
            // queue a wait on it any more.
            let _ = unsafe { driver::event_destroy(&bound, self.raw) };
        }
    }
}

struct Caches {
    memory: Mutex<Cache<Key, Mapping>>,
    events: Mutex<Cache<Key, OpenedEvent>>,
    /// Pipes per peer process, so the last one to go can drop that peer's entries.
    pipes: Mutex<HashMap<u64, usize>>,
}

fn caches() -> &'static Caches {
    static C: OnceLock<Caches> = OnceLock::new();
    C.get_or_init(|| Caches {
        memory: Mutex::new(Cache::new(MAX_OPEN)),
        events: Mutex::new(Cache::new(MAX_OPEN)),
        pipes: Mutex::default(),
    })
}

/// `peer`'s allocation named by `handle` (of `size` bytes, as the peer states), mapped into
/// `device`'s context.
pub(crate) fn open_memory(peer: u64, device: u32, handle: &Handle, size: u64) -> Result<Arc<Mapping>, CudaError> {
    let key = Key {
        peer,
        device,
        handle: *handle,
    };
    let mapping = get(&caches().memory, key, || {
        let bound = runtime()?.bind(device)?;
        let base = driver::ipc_open_mem_handle(&bound, handle)?;
        // The stated size is what offsets are checked against. Where the driver can tell the
        // mapping's size, a peer that overstates it is refused; where it cannot (the query is
        // not documented for imported memory), the statement stands.
        if let Ok(info) = driver::pointer_info(&bound, base) {
            if info.base == base && (info.size as u64) < size {
                // SAFETY: just opened, never shared, nothing queued on it.
                let _ = unsafe { driver::ipc_close_mem_handle(&bound, base) };
                return Err(CudaError::Invalid(format!(
                    "the peer states {size} bytes for an allocation of {} bytes",
                    info.size
                )));
            }
        }
        Ok(Mapping {
            device,
            base,
            size,
            fences: Mutex::default(),
        })
    })?;
    if mapping.size != size {
        return Err(CudaError::Invalid(format!(
            "the peer states {size} bytes for an allocation it stated as {} bytes before",
            mapping.size
        )));
    }
    Ok(mapping)
}

/// `peer`'s interprocess event named by `handle`, opened in `device`'s context.
pub(crate) fn open_event(peer: u64, device: u32, handle: &Handle) -> Result<Arc<OpenedEvent>, CudaError> {
    let key = Key {
        peer,
        device,
        handle: *handle,
    };
    get(&caches().events, key, || {
        let bound = runtime()?.bind(device)?;
        let raw = driver::ipc_open_event_handle(&bound, handle)?;
        Ok(OpenedEvent { device, raw })
    })
}

/// A pipe to `peer` that may open its handles now exists.
pub(crate) fn pipe_opened(peer: u64) {
    *caches()
        .pipes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(peer)
        .or_default() += 1;
}

/// A pipe to `peer` is gone; the last one drops everything cached from that peer (each is
/// closed once its holders and copies are done).
pub(crate) fn pipe_closed(peer: u64) {
    {
        let mut pipes = caches().pipes.lock().unwrap_or_else(|e| e.into_inner());
        let n = pipes.entry(peer).or_default();
        *n = n.saturating_sub(1);
        if *n > 0 {
            return;
        }
        pipes.remove(&peer);
    }
    let c = caches();
    c.memory
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove_where(|k| k.peer == peer);
    c.events
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove_where(|k| k.peer == peer);
}

/// A mapping no one holds, waiting for its copies before it is closed.
struct Closing {
    device: u32,
    base: DevicePtr,
    fences: Vec<Event>,
    since: Instant,
}

/// Hands a mapping to the closer thread (started on first use).
fn closer(c: Closing) {
    static TX: OnceLock<Mutex<mpsc::Sender<Closing>>> = OnceLock::new();
    let tx = TX.get_or_init(|| {
        let (tx, rx) = mpsc::channel();
        let _ = std::thread::Builder::new()
            .name("sluice-ipc-close".into())
            .spawn(move || close_loop(rx));
        Mutex::new(tx)
    });
    // If the thread could not start, the mapping stays open: safe, if wasteful.
    let _ = tx.lock().unwrap_or_else(|e| e.into_inner()).send(c);
}

/// Whether a closing mapping may be closed now, must wait, or must be left open.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Close,
    Wait,
    Abandon,
}

fn verdict(done: bool, waited: Duration) -> Verdict {
    if done {
        Verdict::Close
    } else if waited >= CLOSE_PATIENCE {
        Verdict::Abandon
    } else {
        Verdict::Wait
    }
}

fn close_loop(rx: mpsc::Receiver<Closing>) {
    let mut waiting: Vec<Closing> = Vec::new();
    loop {
        let next = if waiting.is_empty() {
            rx.recv().ok()
        } else {
            match rx.recv_timeout(Duration::from_millis(2)) {
                Ok(c) => Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        if let Some(c) = next {
            waiting.push(c);
        } else if waiting.is_empty() {
            return; // the sender is gone (process exit)
        }
        waiting.retain(|c| {
            let done = c.fences.iter().all(|f| f.is_done().unwrap_or(false));
            match verdict(done, c.since.elapsed()) {
                Verdict::Wait => true,
                Verdict::Abandon => {
                    tracing::warn!(
                        device = c.device,
                        "a peer's CUDA mapping is left open: the copies that read it never completed"
                    );
                    false
                }
                Verdict::Close => {
                    if let Ok(bound) = runtime().map_err(CudaError::from).and_then(|r| r.bind(c.device)) {
                        // SAFETY: opened by `open_memory`, closed once (its last holder is
                        // gone, so no new copy can be queued from it), and every copy that
                        // read it has completed.
                        let _ = unsafe { driver::ipc_close_mem_handle(&bound, c.base) };
                    }
                    false
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Counts its own drops (a "close").
    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_handle_is_opened_once_however_many_ask_at_the_same_time() {
        let cache: Arc<Mutex<Cache<u8, u32>>> = Arc::new(Mutex::new(Cache::new(8)));
        let opens = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (cache, opens) = (cache.clone(), opens.clone());
                std::thread::spawn(move || {
                    get(&cache, 1, || {
                        opens.fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(50));
                        Ok(7)
                    })
                    .map(|v| *v)
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), 7);
        }
        assert_eq!(
            opens.load(Ordering::SeqCst),
            1,
            "a duplicate open would leak a reference"
        );
    }

    #[test]
    fn a_failed_open_is_not_cached() {
        let cache: Mutex<Cache<u8, u32>> = Mutex::new(Cache::new(8));
        assert!(get(&cache, 1, || Err(CudaError::Invalid("no".into()))).is_err());
        assert_eq!(*get(&cache, 1, || Ok(3)).unwrap(), 3);
    }

    #[test]
    fn eviction_never_closes_what_a_caller_holds() {
        let closed = Arc::new(AtomicUsize::new(0));
        let cache: Mutex<Cache<u8, Counted>> = Mutex::new(Cache::new(2));
        let held = get(&cache, 1, || Ok(Counted(closed.clone()))).unwrap();
        for k in 2..6 {
            let _ = get(&cache, k, || Ok(Counted(closed.clone()))).unwrap();
        }
        assert_eq!(cache.lock().unwrap().entries.len(), 2, "bounded");
        assert_eq!(closed.load(Ordering::SeqCst), 2, "evicted and unheld: closed");
        drop(held);
        assert_eq!(closed.load(Ordering::SeqCst), 3, "closed once its holder let go");
        // The least recently used goes first.
        let cache: Mutex<Cache<u8, u8>> = Mutex::new(Cache::new(2));
        get(&cache, 1, || Ok(1)).unwrap();
        get(&cache, 2, || Ok(2)).unwrap();
        get(&cache, 1, || Ok(1)).unwrap();
        get(&cache, 3, || Ok(3)).unwrap();
        let keys: Vec<u8> = cache.lock().unwrap().entries.keys().copied().collect();
        assert!(keys.contains(&1) && keys.contains(&3), "{keys:?}");
    }

    #[test]
    fn a_peer_s_entries_leave_together_but_stay_with_their_holders() {
        let closed = Arc::new(AtomicUsize::new(0));
        let cache: Mutex<Cache<(u64, u8), Counted>> = Mutex::new(Cache::new(8));
        let held = get(&cache, (1, 1), || Ok(Counted(closed.clone()))).unwrap();
        get(&cache, (1, 2), || Ok(Counted(closed.clone()))).unwrap();
        get(&cache, (2, 1), || Ok(Counted(closed.clone()))).unwrap();
        cache.lock().unwrap().remove_where(|k| k.0 == 1);
        assert_eq!(closed.load(Ordering::SeqCst), 1);
        assert_eq!(cache.lock().unwrap().entries.len(), 1);
        drop(held);
        assert_eq!(closed.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_mapping_closes_after_its_copies_or_is_left_open() {
        assert_eq!(verdict(true, Duration::ZERO), Verdict::Close);
        assert_eq!(verdict(false, Duration::from_secs(1)), Verdict::Wait);
        assert_eq!(verdict(false, CLOSE_PATIENCE), Verdict::Abandon);
    }
}
