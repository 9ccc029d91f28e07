//! What a process opened from its peers' IPC handles: their allocations mapped here and their
//! events, each opened once and cached (opening maps memory and costs tens of microseconds).
//!
//! The caches are bounded ([`MAX_OPEN`] entries each, least recently used evicted) and a peer's
//! entries are closed when its last pipe goes away, so a peer that crashed or restarted does not
//! keep its GPU memory alive through us. Before a mapping is closed, the device is synchronized:
//! copies queued from it may still be running.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::driver::{self, DevicePtr, RawEvent, IPC_HANDLE_BYTES};
use super::{runtime, CudaError};

/// Most mappings (and, separately, events) kept open per process.
pub const MAX_OPEN: usize = 1024;

type Handle = [u8; IPC_HANDLE_BYTES];

/// Who exported a handle and into which of our devices it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    peer: u64,
    device: u32,
    handle: Handle,
}

struct Entry<T> {
    value: T,
    used: u64,
}

struct Cache<T> {
    entries: HashMap<Key, Entry<T>>,
    tick: u64,
}

impl<T: Copy> Cache<T> {
    fn new() -> Self {
        Cache {
            entries: HashMap::new(),
            tick: 0,
        }
    }

    fn get(&mut self, key: &Key) -> Option<T> {
        self.tick += 1;
        let tick = self.tick;
        self.entries.get_mut(key).map(|e| {
            e.used = tick;
            e.value
        })
    }

    /// Inserts and returns what must be closed to stay within the bound.
    fn insert(&mut self, key: Key, value: T) -> Vec<(u32, T)> {
        self.tick += 1;
        self.entries.insert(key, Entry { value, used: self.tick });
        let mut evicted = Vec::new();
        while self.entries.len() > MAX_OPEN {
            let oldest = *self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k)
                .expect("over the bound, so not empty");
            let e = self.entries.remove(&oldest).expect("just found");
            evicted.push((oldest.device, e.value));
        }
        evicted
    }

    fn remove_peer(&mut self, peer: u64) -> Vec<(u32, T)> {
        let keys: Vec<Key> = self.entries.keys().filter(|k| k.peer == peer).copied().collect();
        keys.into_iter()
            .map(|k| (k.device, self.entries.remove(&k).expect("listed").value))
            .collect()
    }
}

/// An opened allocation: its base here and its size.
type Mapping = (DevicePtr, usize);

struct Caches {
    memory: Cache<Mapping>,
    events: Cache<RawEvent>,
    /// Pipes per peer process, so the last one to go can close that peer's entries.
    pipes: HashMap<u64, usize>,
}

fn caches() -> &'static Mutex<Caches> {
    static C: OnceLock<Mutex<Caches>> = OnceLock::new();
    C.get_or_init(|| {
        Mutex::new(Caches {
            memory: Cache::new(),
            events: Cache::new(),
            pipes: HashMap::new(),
        })
    })
}

/// Closes mappings and events no longer cached (after the devices' queued work).
fn close(memory: Vec<(u32, Mapping)>, events: Vec<(u32, RawEvent)>) {
    if memory.is_empty() && events.is_empty() {
        return;
    }
    let Ok(cuda) = runtime() else { return };
    for (device, (ptr, _)) in memory {
        if cuda.bind(device).is_ok() && driver::ctx_synchronize().is_ok() {
            // SAFETY: opened by `open_memory`, no longer in the cache (so never handed out
            // again), and the device has finished every copy queued from it.
            let _ = unsafe { driver::ipc_close_mem_handle(ptr) };
        }
    }
    for (device, event) in events {
        if cuda.bind(device).is_ok() {
            // SAFETY: opened by `open_event`, no longer cached; waits already queued on it
            // are unaffected by its destruction.
            let _ = unsafe { driver::event_destroy(event) };
        }
    }
}

/// The cached value for (`peer`, `device`, `handle`), or `open()` run with `device` current and
/// its result cached (closing whatever the bound evicts).
fn cached<T: Copy>(
    peer: u64,
    device: u32,
    handle: &Handle,
    cache: fn(&mut Caches) -> &mut Cache<T>,
    open: impl FnOnce() -> Result<T, CudaError>,
    evict: fn(Vec<(u32, T)>),
) -> Result<T, CudaError> {
    let key = Key {
        peer,
        device,
        handle: *handle,
    };
    if let Some(v) = cache(&mut caches().lock().expect("ipc caches")).get(&key) {
        return Ok(v);
    }
    runtime()?.bind(device)?;
    let v = open()?;
    let evicted = cache(&mut caches().lock().expect("ipc caches")).insert(key, v);
    evict(evicted);
    Ok(v)
}

/// The base address, in this process, of `peer`'s allocation named by `handle`, mapped into
/// `device`'s context, and the allocation's size (so offsets from the peer can be checked).
pub(crate) fn open_memory(peer: u64, device: u32, handle: &Handle) -> Result<Mapping, CudaError> {
    let open = || {
        let ptr = driver::ipc_open_mem_handle(handle)?;
        match driver::pointer_info(ptr) {
            Ok(info) => Ok((ptr, info.size)),
            Err(e) => {
                // SAFETY: just opened, not cached, nothing queued on it.
                let _ = unsafe { driver::ipc_close_mem_handle(ptr) };
                Err(e.into())
            }
        }
    };
    cached(peer, device, handle, |c| &mut c.memory, open, |m| close(m, Vec::new()))
}

/// `peer`'s interprocess event named by `handle`, opened here.
pub(crate) fn open_event(peer: u64, device: u32, handle: &Handle) -> Result<RawEvent, CudaError> {
    let open = || Ok(driver::ipc_open_event_handle(handle)?);
    cached(peer, device, handle, |c| &mut c.events, open, |e| close(Vec::new(), e))
}

/// A pipe to `peer` that may open its handles now exists.
pub(crate) fn pipe_opened(peer: u64) {
    let mut c = caches().lock().expect("ipc caches");
    *c.pipes.entry(peer).or_default() += 1;
}

/// A pipe to `peer` is gone; the last one closes everything opened from that peer (on a
/// thread of its own: closing waits for the device).
pub(crate) fn pipe_closed(peer: u64) {
    let (memory, events) = {
        let mut c = caches().lock().expect("ipc caches");
        let n = c.pipes.entry(peer).or_default();
        *n = n.saturating_sub(1);
        if *n > 0 {
            return;
        }
        c.pipes.remove(&peer);
        (c.memory.remove_peer(peer), c.events.remove_peer(peer))
    };
    if memory.is_empty() && events.is_empty() {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("sluice-ipc-close".into())
        .spawn(move || close(memory, events));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(peer: u64, n: u8) -> Key {
        Key {
            peer,
            device: 0,
            handle: [n; IPC_HANDLE_BYTES],
        }
    }

    #[test]
    fn the_cache_is_bounded_and_evicts_the_least_recently_used() {
        let mut c: Cache<u64> = Cache::new();
        let mut evicted = Vec::new();
        for i in 0..(MAX_OPEN + 10) as u64 {
            let k = Key {
                peer: 1,
                device: 0,
                handle: {
                    let mut h = [0u8; IPC_HANDLE_BYTES];
                    h[..8].copy_from_slice(&i.to_le_bytes());
                    h
                },
            };
            evicted.extend(c.insert(k, i));
            // Entry 0 is used after every insert: it must survive.
            let first = Key {
                peer: 1,
                device: 0,
                handle: [0u8; IPC_HANDLE_BYTES],
            };
            assert_eq!(c.get(&first), Some(0));
        }
        assert_eq!(c.entries.len(), MAX_OPEN);
        assert_eq!(evicted.len(), 10);
        assert!(evicted.iter().all(|&(_, v)| v != 0), "the warm entry was evicted");
    }

    #[test]
    fn a_peer_s_entries_leave_together() {
        let mut c: Cache<u64> = Cache::new();
        c.insert(key(1, 1), 10);
        c.insert(key(2, 1), 20);
        c.insert(key(1, 2), 11);
        let mut gone: Vec<u64> = c.remove_peer(1).into_iter().map(|(_, v)| v).collect();
        gone.sort();
        assert_eq!(gone, vec![10, 11]);
        assert_eq!(c.get(&key(2, 1)), Some(20));
        assert_eq!(c.get(&key(1, 1)), None);
    }
}
