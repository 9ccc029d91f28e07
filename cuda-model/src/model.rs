//! The model's state: devices, per-thread current contexts, allocations, streams (one worker
//! thread each, in order), events, and IPC between processes through shared memory files.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::rules::{self, breach};
use crate::sys::{self, Shared};

pub const SUCCESS: i32 = 0;
pub const INVALID_VALUE: i32 = 1;
pub const OUT_OF_MEMORY: i32 = 2;
pub const NOT_INITIALIZED: i32 = 3;
pub const INVALID_DEVICE: i32 = 101;
pub const INVALID_CONTEXT: i32 = 201;
pub const INVALID_HANDLE: i32 = 400;
pub const NOT_READY: i32 = 600;
pub const PEER_ACCESS_ALREADY_ENABLED: i32 = 704;
pub const NOT_SUPPORTED: i32 = 801;

pub type R<T> = Result<T, i32>;

const PAGE: usize = 4096;
/// Every allocation's shared file starts with this header page (magic, generation, how many
/// other processes map it); the data follows.
const MEM_MAGIC: u64 = u64::from_le_bytes(*b"SLMDLMEM");
const EVT_MAGIC: u64 = u64::from_le_bytes(*b"SLMDLEVT");

/// The model's devices, from `SLUICE_CUDA_MODEL_DEVICES` (1 to 8, default 2), in the order
/// `CUDA_VISIBLE_DEVICES` lists them.
pub fn visible() -> &'static [u32] {
    static V: OnceLock<Vec<u32>> = OnceLock::new();
    V.get_or_init(|| {
        let n: u32 = std::env::var("SLUICE_CUDA_MODEL_DEVICES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2)
            .clamp(1, 8);
        match std::env::var("CUDA_VISIBLE_DEVICES") {
            Ok(list) => list
                .split(',')
                .map_while(|s| s.trim().parse::<u32>().ok())
                .take_while(|&d| d < n)
                .collect(),
            Err(_) => (0..n).collect(),
        }
    })
}

/// The physical device behind visible ordinal `ordinal`.
pub fn physical(ordinal: i32) -> R<u32> {
    usize::try_from(ordinal)
        .ok()
        .and_then(|o| visible().get(o).copied())
        .ok_or(INVALID_DEVICE)
}

/// A device's UUID: the same in every process (derived from its physical index).
pub fn uuid(physical: u32) -> [u8; 16] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = [0u8; 16];
    for (i, b) in b"sluice-cuda-model".iter().chain(&physical.to_le_bytes()).enumerate() {
        h = (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3);
        out[i % 16] ^= (h >> 24) as u8;
    }
    out[6] = (out[6] & 0x0f) | 0x40;
    out
}

// --- contexts --------------------------------------------------------------------------------

/// Context handles: one primary context per visible ordinal.
const CTX_BASE: usize = 0x5100_0000;

pub fn ctx_handle(ordinal: u32) -> usize {
    CTX_BASE + ordinal as usize * 16
}

pub fn ctx_ordinal(handle: usize) -> R<u32> {
    let o = handle.wrapping_sub(CTX_BASE) / 16;
    if handle >= CTX_BASE && (handle - CTX_BASE).is_multiple_of(16) && o < visible().len() {
        Ok(o as u32)
    } else {
        Err(breach(
            rules::HANDLE,
            INVALID_CONTEXT,
            format!("{handle:#x} is not a context"),
        ))
    }
}

thread_local! {
    /// This thread's context stack (the top is current).
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

pub fn current() -> Option<usize> {
    STACK.with(|s| s.borrow().last().copied())
}

/// The current context's ordinal, or a breach of "a context must be current" naming `call`.
pub fn need_context(call: &str) -> R<u32> {
    match current() {
        Some(c) => ctx_ordinal(c),
        None => Err(breach(
            rules::NO_CONTEXT,
            INVALID_CONTEXT,
            format!("{call} on a thread with no current context"),
        )),
    }
}

pub fn set_current(ctx: usize) -> R<()> {
    if ctx != 0 {
        ctx_ordinal(ctx)?;
    }
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if ctx != 0 {
            s.push(ctx);
        }
    });
    Ok(())
}

pub fn push_current(ctx: usize) -> R<()> {
    ctx_ordinal(ctx)?;
    STACK.with(|s| s.borrow_mut().push(ctx));
    Ok(())
}

pub fn pop_current() -> R<usize> {
    STACK
        .with(|s| s.borrow_mut().pop())
        .ok_or_else(|| breach(rules::POP_EMPTY, INVALID_CONTEXT, "no context to pop".into()))
}

// --- the model ---------------------------------------------------------------------------------

/// One allocation in this process's device address space: its own, or another process's
/// mapped here.
pub struct Alloc {
    pub ordinal: u32,
    pub size: usize,
    /// The shared file: header page, then the data.
    pub shared: Shared,
    pub generation: u64,
    /// Queued operations that use it.
    pub pending: Arc<AtomicU64>,
    /// `Some((pid, fd, generation, opening context))` when imported from another process, with how many times
    /// this process opened it.
    pub imported: Option<((u32, i32, u64, u32), u32)>,
}

impl Alloc {
    /// The host address (in the model's own view) of data offset `off`.
    pub fn data(&self, off: usize) -> usize {
        self.shared.base + PAGE + off
    }
    fn importers(&self) -> &AtomicU64 {
        // SAFETY: the header page is mapped, 8-byte aligned, and lives as long as `self`.
        unsafe { sys::atomic_at(self.shared.base + 16) }
    }
}

pub struct Model {
    /// The device address space's base and the next free address in it.
    next: usize,
    end: usize,
    /// Device allocations by base address.
    pub allocs: BTreeMap<usize, Alloc>,
    /// Pinned host allocations: address → length.
    /// Pinned host allocations: address → (length, queued operations using it).
    pub pinned: BTreeMap<usize, (usize, Arc<AtomicU64>)>,
    pub streams: HashMap<usize, Arc<Stream>>,
    /// The legacy default stream of each ordinal.
    pub legacy: HashMap<u32, Arc<Stream>>,
    pub events: HashMap<usize, Arc<Event>>,
    pub next_handle: usize,
    pub peer_enabled: Vec<(u32, u32)>,
    pub retained: HashMap<u32, u32>,
    /// Imported allocations by (pid, fd, generation) → base, per ordinal.
    pub imports: HashMap<(u32, u32, i32, u64), usize>,
    /// Which context (ordinal) opens memory of each (process, device).
    pub ipc_contexts: HashMap<(u32, u32), u32>,
}

static MODEL: OnceLock<Result<Mutex<Model>, String>> = OnceLock::new();
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// Initialises the model (idempotent).
pub fn init() -> R<()> {
    let m = MODEL.get_or_init(|| {
        let base = sys::reserve_space().map_err(|e| format!("reserving the device address space: {e}"))?;
        Ok(Mutex::new(Model {
            next: base + (1 << 20),
            end: base + sys::SPACE,
            allocs: BTreeMap::new(),
            pinned: BTreeMap::new(),
            streams: HashMap::new(),
            legacy: HashMap::new(),
            events: HashMap::new(),
            next_handle: 0x7100_0000,
            peer_enabled: Vec::new(),
            retained: HashMap::new(),
            imports: HashMap::new(),
            ipc_contexts: HashMap::new(),
        }))
    });
    match m {
        Ok(_) => Ok(()),
        Err(e) => {
            eprintln!("sluice CUDA driver model: {e}");
            Err(OUT_OF_MEMORY)
        }
    }
}

/// The model, once initialised.
pub fn model() -> R<std::sync::MutexGuard<'static, Model>> {
    match MODEL.get() {
        Some(Ok(m)) => Ok(m.lock().unwrap_or_else(|e| e.into_inner())),
        _ => Err(breach(
            rules::NOT_INITIALIZED,
            NOT_INITIALIZED,
            "a driver call before cuInit".into(),
        )),
    }
}

fn fresh_generation() -> u64 {
    (std::process::id() as u64) << 32 | GENERATION.fetch_add(1, Ordering::Relaxed)
}

/// An IPC handle's fields: magic, exporting process, its descriptor, generation, size.
struct Handle {
    magic: u64,
    pid: u32,
    fd: i32,
    generation: u64,
    size: u64,
    /// The exporter's physical device.
    device: u32,
}

impl Handle {
    fn encode(&self) -> [u8; 64] {
        let mut h = [0u8; 64];
        h[0..8].copy_from_slice(&self.magic.to_le_bytes());
        h[8..12].copy_from_slice(&self.pid.to_le_bytes());
        h[12..16].copy_from_slice(&self.fd.to_le_bytes());
        h[16..24].copy_from_slice(&self.generation.to_le_bytes());
        h[24..32].copy_from_slice(&self.size.to_le_bytes());
        h[32..36].copy_from_slice(&self.device.to_le_bytes());
        h
    }

    fn decode(h: &[u8; 64]) -> Handle {
        let word = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().expect("8 bytes"));
        Handle {
            magic: word(0),
            pid: u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")),
            fd: i32::from_le_bytes(h[12..16].try_into().expect("4 bytes")),
            generation: word(16),
            size: word(24),
            device: u32::from_le_bytes(h[32..36].try_into().expect("4 bytes")),
        }
    }
}

impl Model {
    fn handle(&mut self) -> usize {
        self.next_handle += 16;
        self.next_handle
    }

    /// Reserves `size` bytes of device addresses (never reused: a freed range stays
    /// inaccessible, so a late use is caught).
    fn addresses(&mut self, size: usize) -> R<usize> {
        let at = self.next;
        let len = size.max(1).next_multiple_of(1 << 16);
        if at + len > self.end {
            return Err(OUT_OF_MEMORY);
        }
        self.next += len;
        Ok(at)
    }

    pub fn alloc(&mut self, ordinal: u32, size: usize) -> R<usize> {
        let generation = fresh_generation();
        let shared = Shared::create_guarded(&format!("sluice-cuda-model-{generation:x}"), PAGE + size.max(1))
            .map_err(|_| OUT_OF_MEMORY)?;
        // SAFETY: the header page was just mapped (8-byte aligned offsets).
        unsafe {
            sys::atomic_at(shared.base).store(MEM_MAGIC, Ordering::Relaxed);
            sys::atomic_at(shared.base + 8).store(generation, Ordering::Relaxed);
        }
        let at = self.addresses(size)?;
        self.allocs.insert(
            at,
            Alloc {
                ordinal,
                size,
                shared,
                generation,
                pending: Arc::new(AtomicU64::new(0)),
                imported: None,
            },
        );
        Ok(at)
    }

    /// The allocation holding `[ptr, ptr + len)`, and the offset of `ptr` in it.
    pub fn find(&self, ptr: usize, len: usize, call: &str) -> R<(&Alloc, usize)> {
        if let Some((&base, a)) = self.allocs.range(..=ptr).next_back() {
            let off = ptr - base;
            if off <= a.size && len <= a.size - off {
                return Ok((a, off));
            }
        }
        Err(breach(
            rules::COPY_RANGE,
            INVALID_VALUE,
            format!("{call}: {len} bytes at {ptr:#x} are not inside one live allocation"),
        ))
    }

    pub fn free(&mut self, ptr: usize) -> R<()> {
        let Some(a) = self.allocs.get(&ptr) else {
            return Err(breach(
                rules::HANDLE,
                INVALID_VALUE,
                format!("cuMemFree({ptr:#x}): not the start of a live allocation"),
            ));
        };
        if a.imported.is_some() {
            return Err(breach(
                rules::HANDLE,
                INVALID_VALUE,
                format!("cuMemFree({ptr:#x}): memory opened from another process (close it instead)"),
            ));
        }
        let pending = a.pending.load(Ordering::Acquire);
        if pending > 0 {
            return Err(breach(
                rules::FREE_BUSY,
                INVALID_VALUE,
                format!("cuMemFree({ptr:#x}) with {pending} queued operation(s) still using it"),
            ));
        }
        let importers = a.importers().load(Ordering::Acquire);
        if importers > 0 {
            return Err(breach(
                rules::FREE_IMPORTED,
                INVALID_VALUE,
                format!("cuMemFree({ptr:#x}) while {importers} opening(s) in other processes map it"),
            ));
        }
        self.allocs.remove(&ptr);
        Ok(())
    }

    /// An IPC handle for the allocation at `ptr` (its start).
    pub fn export(&self, ptr: usize) -> R<[u8; 64]> {
        let (a, _) = self.find(ptr, 0, "cuIpcGetMemHandle")?;
        if a.imported.is_some() {
            return Err(INVALID_VALUE);
        }
        let h = Handle {
            magic: MEM_MAGIC,
            pid: std::process::id(),
            fd: a.shared.fd,
            generation: a.generation,
            size: a.size as u64,
            device: physical(a.ordinal as i32)?,
        }
        .encode();
        Ok(h)
    }

    /// Maps another process's allocation (once per context, counted).
    pub fn import(&mut self, ordinal: u32, h: &[u8; 64]) -> R<usize> {
        let Handle {
            magic,
            pid,
            fd,
            generation,
            size,
            device,
        } = Handle::decode(h);
        let size = size as usize;
        match self.ipc_contexts.get(&(pid, device)) {
            Some(&o) if o != ordinal => {
                return Err(breach(
                    rules::IPC_ONE_CONTEXT,
                    INVALID_CONTEXT,
                    format!("process {pid}'s device {device} memory opened from context {ordinal} after context {o}"),
                ))
            }
            _ => {}
        }
        if magic != MEM_MAGIC {
            return Err(breach(
                rules::IPC_STALE,
                INVALID_HANDLE,
                "not a memory handle of the model".into(),
            ));
        }
        if pid == std::process::id() {
            return Err(rules::refuse(
                rules::IPC_SAME_PROCESS,
                INVALID_CONTEXT,
                "cuIpcOpenMemHandle on this process's own handle".into(),
            ));
        }
        if let Some(&at) = self.imports.get(&(ordinal, pid, fd, generation)) {
            let a = self.allocs.get_mut(&at).expect("an import's allocation");
            if let Some((_, n)) = &mut a.imported {
                *n += 1;
            }
            return Ok(at);
        }
        let stale = |why: String| breach(rules::IPC_STALE, INVALID_HANDLE, why);
        let name = Shared::name_of(pid, fd).map_err(|e| stale(format!("process {pid}'s memory: {e}")))?;
        if !name.contains(&format!("sluice-cuda-model-{generation:x}")) {
            return Err(stale(format!(
                "process {pid}'s allocation {generation:x} was freed (its descriptor is now {name})"
            )));
        }
        let shared = Shared::open_guarded(pid, fd, PAGE + size.max(1)).map_err(|e| stale(format!("{e}")))?;
        let at = self.addresses(size)?;
        // The memory lives on the exporter's device, as this process numbers it (pointer
        // queries name that device), else (not visible here) on this context's.
        let home = visible()
            .iter()
            .position(|&p| p == device)
            .map_or(ordinal, |o| o as u32);
        let a = Alloc {
            ordinal: home,
            size,
            shared,
            generation,
            pending: Arc::new(AtomicU64::new(0)),
            imported: Some(((pid, fd, generation, ordinal), 1)),
        };
        a.importers().fetch_add(1, Ordering::AcqRel);
        self.ipc_contexts.insert((pid, device), ordinal);
        self.allocs.insert(at, a);
        self.imports.insert((ordinal, pid, fd, generation), at);
        Ok(at)
    }

    pub fn close_import(&mut self, ptr: usize) -> R<()> {
        let Some(a) = self.allocs.get_mut(&ptr) else {
            return Err(breach(
                rules::HANDLE,
                INVALID_VALUE,
                format!("cuIpcCloseMemHandle({ptr:#x}): not opened"),
            ));
        };
        let Some((key, n)) = &mut a.imported else {
            return Err(breach(
                rules::HANDLE,
                INVALID_VALUE,
                format!("cuIpcCloseMemHandle({ptr:#x}): not imported"),
            ));
        };
        if *n > 1 {
            *n -= 1;
            return Ok(());
        }
        let (pid, fd, generation, opener) = *key;
        let pending = a.pending.load(Ordering::Acquire);
        if pending > 0 {
            return Err(breach(
                rules::FREE_BUSY,
                INVALID_VALUE,
                format!("cuIpcCloseMemHandle({ptr:#x}) with {pending} queued operation(s) still using it"),
            ));
        }
        *n = 0;
        a.importers().fetch_sub(1, Ordering::AcqRel);
        self.allocs.remove(&ptr);
        self.imports.remove(&(opener, pid, fd, generation));
        Ok(())
    }

    /// The stream `handle` names (`0`: the current context's legacy default stream), with the
    /// legacy stream's implicit synchronisation queued first: "the legacy default stream ...
    /// waits for all work in blocking streams of the same context, and work in blocking streams
    /// waits for the legacy stream's" (cuda.h's note on the null stream). Streams Sluice makes
    /// are non-blocking, so none of this orders them.
    pub fn stream(&mut self, handle: usize, call: &str) -> R<Arc<Stream>> {
        let st = self.lookup(handle, call)?;
        if handle == 0 {
            let before: Vec<(Arc<Stream>, u64)> = self
                .streams
                .values()
                .filter(|o| o.blocking && o.ordinal == st.ordinal)
                .map(|o| (o.clone(), o.queued()))
                .collect();
            if !before.is_empty() {
                st.enqueue(&[], move || before.iter().for_each(|(o, t)| o.wait(*t)));
            }
        } else if st.blocking {
            if let Some(legacy) = self.legacy.get(&st.ordinal).cloned() {
                let t = legacy.queued();
                if t > legacy.completed() {
                    st.enqueue(&[], move || legacy.wait(t));
                }
            }
        }
        Ok(st)
    }

    fn lookup(&mut self, handle: usize, call: &str) -> R<Arc<Stream>> {
        if handle == 0 {
            let ordinal = need_context(call)?;
            return Ok(self
                .legacy
                .entry(ordinal)
                .or_insert_with(|| Stream::start(ordinal, 0, false))
                .clone());
        }
        self.streams.get(&handle).cloned().ok_or_else(|| {
            breach(
                rules::HANDLE,
                INVALID_HANDLE,
                format!("{call}: {handle:#x} is not a stream"),
            )
        })
    }

    pub fn event(&self, handle: usize, call: &str) -> R<Arc<Event>> {
        self.events.get(&handle).cloned().ok_or_else(|| {
            breach(
                rules::HANDLE,
                INVALID_HANDLE,
                format!("{call}: {handle:#x} is not an event"),
            )
        })
    }

    pub fn new_stream(&mut self, ordinal: u32, flags: u32) -> usize {
        let h = self.handle();
        // CU_STREAM_NON_BLOCKING = 1.
        self.streams.insert(h, Stream::start(ordinal, h, flags & 1 == 0));
        h
    }

    /// Whether device `d` may access device `peer`'s memory (`SLUICE_CUDA_MODEL_PEERS`: `all`,
    /// the default; `none`; or the allowed pairs of physical devices, `0-1,1-0`).
    pub fn peer_allowed(d: u32, peer: u32) -> bool {
        if d == peer {
            return false;
        }
        match std::env::var("SLUICE_CUDA_MODEL_PEERS").as_deref() {
            Err(_) | Ok("all") => true,
            Ok("none") => false,
            Ok(list) => list.split(',').any(|pair| pair.trim() == format!("{d}-{peer}")),
        }
    }

    pub fn new_event(&mut self, ordinal: u32, flags: u32) -> R<usize> {
        let cell = if flags & 4 != 0 {
            let generation = fresh_generation();
            let shared =
                Shared::create(&format!("sluice-cuda-model-event-{generation:x}"), PAGE).map_err(|_| OUT_OF_MEMORY)?;
            // SAFETY: the page was just mapped.
            unsafe {
                sys::atomic_at(shared.base).store(EVT_MAGIC, Ordering::Relaxed);
                sys::atomic_at(shared.base + 8).store(generation, Ordering::Relaxed);
            }
            Cell::Shared { shared, generation }
        } else {
            Cell::Heap(Box::new(std::array::from_fn(|_| AtomicU64::new(0))))
        };
        let h = self.handle();
        self.events.insert(
            h,
            Arc::new(Event {
                ordinal,
                flags,
                cell,
                imported: false,
            }),
        );
        Ok(h)
    }

    pub fn import_event(&mut self, ordinal: u32, h: &[u8; 64]) -> R<usize> {
        let Handle {
            magic,
            pid,
            fd,
            generation,
            ..
        } = Handle::decode(h);
        let stale = |why: String| breach(rules::IPC_STALE, INVALID_HANDLE, why);
        if magic != EVT_MAGIC {
            return Err(stale("not an event handle of the model".into()));
        }
        let name = Shared::name_of(pid, fd).map_err(|e| stale(format!("process {pid}'s event: {e}")))?;
        if !name.contains(&format!("sluice-cuda-model-event-{generation:x}")) {
            return Err(stale(format!(
                "process {pid}'s event {generation:x} is gone (now {name})"
            )));
        }
        let shared = Shared::open(pid, fd, PAGE).map_err(|e| stale(format!("{e}")))?;
        let handle = self.handle();
        self.events.insert(
            handle,
            Arc::new(Event {
                ordinal,
                flags: 4 | 2,
                cell: Cell::Shared { shared, generation },
                imported: true,
            }),
        );
        Ok(handle)
    }
}

// --- streams ---------------------------------------------------------------------------------

type Job = Box<dyn FnOnce() + Send>;

/// A stream: work runs in order on its own thread, later than it was queued (with
/// `SLUICE_CUDA_MODEL_SEED`, after a random delay of up to 200 µs per operation).
pub struct Stream {
    pub ordinal: u32,
    pub handle: usize,
    /// Created without CU_STREAM_NON_BLOCKING: synchronises with the legacy default stream.
    pub blocking: bool,
    tx: Mutex<Option<mpsc::Sender<(u64, Job)>>>,
    queued: AtomicU64,
    done: Arc<(Mutex<u64>, Condvar)>,
}

impl Stream {
    fn start(ordinal: u32, handle: usize, blocking: bool) -> Arc<Stream> {
        let (tx, rx) = mpsc::channel::<(u64, Job)>();
        let done = Arc::new((Mutex::new(0u64), Condvar::new()));
        let d = done.clone();
        let mut rng = std::env::var("SLUICE_CUDA_MODEL_SEED")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .map(|s| s ^ (handle as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        std::thread::Builder::new()
            .name(format!("cuda-model-stream-{handle:x}"))
            .spawn(move || {
                for (ticket, job) in rx {
                    if let Some(x) = &mut rng {
                        *x ^= *x << 13;
                        *x ^= *x >> 7;
                        *x ^= *x << 17;
                        std::thread::sleep(Duration::from_micros(*x % 200));
                    }
                    job();
                    let (lock, cv) = &*d;
                    *lock.lock().unwrap_or_else(|e| e.into_inner()) = ticket;
                    cv.notify_all();
                }
            })
            .expect("a stream thread");
        Arc::new(Stream {
            ordinal,
            handle,
            blocking,
            tx: Mutex::new(Some(tx)),
            queued: AtomicU64::new(0),
            done,
        })
    }

    /// Queues `job`; returns its ticket (done once the stream's count reaches it).
    pub fn enqueue(&self, uses: &[Arc<AtomicU64>], job: impl FnOnce() + Send + 'static) -> u64 {
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let ticket = self.queued.fetch_add(1, Ordering::AcqRel) + 1;
        for u in uses {
            u.fetch_add(1, Ordering::AcqRel);
        }
        let uses: Vec<_> = uses.to_vec();
        let job: Job = Box::new(move || {
            job();
            for u in uses {
                u.fetch_sub(1, Ordering::AcqRel);
            }
        });
        match tx.as_ref() {
            Some(tx) => {
                let _ = tx.send((ticket, job));
            }
            None => {
                breach(
                    rules::HANDLE,
                    INVALID_HANDLE,
                    format!("work queued on stream {:#x} after it was destroyed", self.handle),
                );
            }
        }
        ticket
    }

    pub fn completed(&self) -> u64 {
        *self.done.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn queued(&self) -> u64 {
        self.queued.load(Ordering::Acquire)
    }

    /// Waits until the work queued up to `ticket` is done.
    pub fn wait(&self, ticket: u64) {
        let (lock, cv) = &*self.done;
        let mut d = lock.lock().unwrap_or_else(|e| e.into_inner());
        while *d < ticket {
            d = cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Ends the worker once its queue is done.
    pub fn stop(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

// --- events ----------------------------------------------------------------------------------

/// Words of an event's state after the shared page's 16-byte header (fits the 4096-byte page).
const EVENT_WORDS: usize = 510;
/// Records tracked at once (a record's bit is reused `DONE_BITS` records later).
const DONE_BITS: u64 = (EVENT_WORDS as u64 - 2) * 64;

/// Where an event's counters live: [recorded, completed, destroyed].
pub enum Cell {
    /// [recorded, destroyed, then the done bitmap] (see [`Event::done_word`]).
    Heap(Box<[AtomicU64; EVENT_WORDS]>),
    /// An interprocess event: the counters in a shared page after its header.
    Shared { shared: Shared, generation: u64 },
}

pub struct Event {
    pub ordinal: u32,
    pub flags: u32,
    pub cell: Cell,
    pub imported: bool,
}

impl Event {
    /// Word `i` after the header: 0 recorded, 1 destroyed, then the done bitmap.
    fn counter(&self, i: usize) -> &AtomicU64 {
        match &self.cell {
            Cell::Heap(c) => &c[i],
            // SAFETY: the page is mapped for the event's lifetime; 16 + 8 * i stays inside its
            // 4096 bytes for i < EVENT_WORDS, and is 8-aligned.
            Cell::Shared { shared, .. } => unsafe { sys::atomic_at(shared.base + 16 + 8 * i) },
        }
    }

    /// The bitmap word and bit of record `mark`: each record completes on its own, so a waiter
    /// on one record is not released by a later record of the same event on a faster stream
    /// ("Other APIs such as cuStreamWaitEvent() use the most recently captured state at the
    /// time of the API call, and are not affected by later calls to cuEventRecord()").
    fn done_word(&self, mark: u64) -> (&AtomicU64, u64) {
        let bit = mark % DONE_BITS;
        (self.counter(2 + (bit / 64) as usize), 1 << (bit % 64))
    }

    fn live(&self, call: &str) -> R<()> {
        if self.imported && self.counter(1).load(Ordering::Acquire) != 0 {
            return Err(breach(
                rules::EVENT_DESTROYED,
                INVALID_HANDLE,
                format!("{call} on an imported event whose exporter destroyed it"),
            ));
        }
        Ok(())
    }

    /// Records the work queued on `stream` so far: the event completes when it is done.
    pub fn record(self: &Arc<Self>, stream: &Stream) -> R<()> {
        self.live("cuEventRecord")?;
        if self.ordinal != stream.ordinal {
            return Err(breach(
                rules::EVENT_CONTEXT,
                INVALID_HANDLE,
                format!(
                    "an event of context {} recorded on a stream of context {}",
                    self.ordinal, stream.ordinal
                ),
            ));
        }
        let mark = self.counter(0).fetch_add(1, Ordering::AcqRel) + 1;
        let (word, bit) = self.done_word(mark);
        word.fetch_and(!bit, Ordering::AcqRel);
        let me = self.clone();
        stream.enqueue(&[], move || {
            let (word, bit) = me.done_word(mark);
            word.fetch_or(bit, Ordering::AcqRel);
        });
        Ok(())
    }

    /// The mark a waiter started now must see completed (0: never recorded, complete).
    pub fn mark(&self, call: &str) -> R<u64> {
        self.live(call)?;
        Ok(self.counter(0).load(Ordering::Acquire))
    }

    pub fn reached(&self, mark: u64) -> bool {
        if mark == 0 {
            return true;
        }
        let (word, bit) = self.done_word(mark);
        word.load(Ordering::Acquire) & bit != 0
    }

    /// Waits (polling) until `mark` is reached.
    pub fn wait(&self, mark: u64) {
        while !self.reached(mark) {
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    pub fn export(&self) -> R<[u8; 64]> {
        let Cell::Shared { shared, generation } = &self.cell else {
            return Err(breach(
                rules::EVENT_NOT_IPC,
                INVALID_VALUE,
                "cuIpcGetEventHandle on an event made without CU_EVENT_INTERPROCESS".into(),
            ));
        };
        if self.flags & 2 == 0 {
            return Err(breach(
                rules::EVENT_NOT_IPC,
                INVALID_VALUE,
                "cuIpcGetEventHandle on an event made without CU_EVENT_DISABLE_TIMING".into(),
            ));
        }
        Ok(Handle {
            magic: EVT_MAGIC,
            pid: std::process::id(),
            fd: shared.fd,
            generation: *generation,
            size: PAGE as u64,
            device: physical(self.ordinal as i32)?,
        }
        .encode())
    }

    /// Destroyed by its owner: importers that use it later break a rule.
    pub fn destroyed(&self) {
        if !self.imported {
            self.counter(1).store(1, Ordering::Release);
        }
    }
}
