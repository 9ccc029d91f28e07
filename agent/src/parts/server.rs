//! The server's own state: what requests being served hold, the pool that runs slow handlers,
//! receive buffers and CUDA streams, and reading a request within the worker's limits.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use sluice_channel::{Allocation, Descriptor, Device, Pipe, PipeError, RecvBuffer};

use crate::budget::Budget;
use crate::gpu::StreamPool;
use crate::pool::Pool;

/// Received buffers at least this large are recycled once every user has dropped them.
pub(crate) const POOL_MIN: usize = 256 << 10;
pub(crate) const POOL_KEEP: usize = 8;

/// The server's own state: the pool that runs the slow ones, what the requests
/// being served hold, and the buffers received requests land in.
pub(crate) struct Server {
    /// The largest message read from a peer (the options' `max_message_bytes`).
    max_message_bytes: u64,
    pub(crate) pool: Pool,
    /// Requests being served that hold bytes of their caller's budget, released by the reply.
    pub(crate) held: HeldRequests,
    /// Handlers running (outstanding work for shutdown).
    pub(crate) handlers_running: AtomicI64,
    recv_pool: Mutex<Vec<Bytes>>,
    /// Streams incoming CUDA tensors land on, and fetched RRef values leave from.
    pub(crate) streams: StreamPool,
    /// The pipes peers opened to this worker.
    pub(crate) incoming: Mutex<Vec<Pipe>>,
}

impl Server {
    /// Memory for an incoming message: recycled CPU buffers for large tensors when possible;
    /// CUDA tensors on their target device, one pooled stream per device. A target this
    /// worker does not have (a peer's stale or hostile map) or a failed device allocation is
    /// an error: the message cannot be placed.
    pub(crate) fn allocate(&self, d: &Descriptor) -> Result<Allocation, String> {
        let mut streams: Vec<(u32, sluice_channel::Stream)> = Vec::new();
        let mut tensors = Vec::with_capacity(d.tensors.len());
        for t in &d.tensors {
            let len = t.buffer_len();
            tensors.push(match t.target_device.unwrap_or(Device::Cpu) {
                Device::Cuda(i) => {
                    let stream = match streams.iter().find(|(d, _)| *d == i) {
                        Some((_, s)) => s.clone(),
                        None => {
                            let s = self
                                .streams
                                .next(i)
                                .map_err(|e| format!("cannot place a tensor on cuda:{i}: {e}"))?;
                            streams.push((i, s.clone()));
                            s
                        }
                    };
                    RecvBuffer::Cuda(
                        sluice_channel::CudaBuffer::alloc_cached(len, &stream)
                            .map_err(|e| format!("cannot allocate {len} bytes on cuda:{i}: {e}"))?,
                    )
                }
                _ => RecvBuffer::Cpu(self.recv_buffer(len)),
            });
        }
        Ok(Allocation {
            payloads: d
                .payload_lengths
                .iter()
                .map(|&l| BytesMut::zeroed(l as usize))
                .collect(),
            tensors,
        })
    }

    pub(crate) fn recv_buffer(&self, len: usize) -> BytesMut {
        if len >= POOL_MIN {
            let mut pool = self.recv_pool.lock().unwrap();
            let mut i = 0;
            while i < pool.len() {
                if pool[i].len() == len && pool[i].is_unique() {
                    let b = pool.swap_remove(i);
                    if let Ok(m) = b.try_into_mut() {
                        return m;
                    }
                } else {
                    i += 1;
                }
            }
        }
        BytesMut::zeroed(len)
    }
    pub(crate) fn keep_for_reuse(&self, b: &Bytes) {
        if b.len() >= POOL_MIN {
            let mut pool = self.recv_pool.lock().unwrap();
            if pool.len() >= POOL_KEEP {
                // Forget the oldest; it is freed when its user drops it.
                pool.remove(0);
            }
            pool.push(b.clone());
        }
    }

    pub(crate) fn new(pool: Pool, max_message_bytes: u64) -> Server {
        Server {
            max_message_bytes,
            pool,
            held: HeldRequests::default(),
            handlers_running: AtomicI64::new(0),
            recv_pool: Mutex::new(Vec::new()),
            streams: StreamPool::default(),
            incoming: Mutex::new(Vec::new()),
        }
    }
}

/// Requests being served that hold bytes of their caller's budget (see [`Budget`]): each
/// is released when its reply goes out. A request of no bytes (a small call, its value inline)
/// holds nothing and costs no lock; nor does a reply while nothing is held.
#[derive(Default)]
pub(crate) struct HeldRequests {
    /// How many entries `map` has (changed under its lock).
    count: AtomicUsize,
    /// SipHash, not FxHash: the request ids are the peer's to choose.
    map: Mutex<std::collections::HashMap<(u32, u64), Hold>>,
}

/// What a request holds: bytes of its caller's budget.
type Hold = (Arc<Budget>, u64);

impl HeldRequests {
    /// Request `id` from `caller` holds `size` bytes of `budget` until [`release`](Self::release).
    pub(crate) fn hold(&self, caller: u32, id: u64, budget: &Arc<Budget>, size: u64) {
        if size == 0 {
            return;
        }
        let mut map = self.map.lock().unwrap();
        if let Some((earlier, n)) = map.insert((caller, id), (budget.clone(), size)) {
            // A peer that reused an id in flight: the earlier hold is released, not leaked.
            earlier.release(n);
        }
        self.count.store(map.len(), Ordering::Release);
    }

    /// The reply to request `id` from `caller` is going out: what it held is released.
    pub(crate) fn release(&self, caller: u32, id: u64) {
        // A request that held bytes was counted before it was dispatched, so its reply sees
        // a count of at least one.
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let held = {
            let mut map = self.map.lock().unwrap();
            let held = map.remove(&(caller, id));
            self.count.store(map.len(), Ordering::Release);
            held
        };
        if let Some((budget, size)) = held {
            budget.release(size);
        }
    }
}

/// Bytes a message will occupy once received.
pub(crate) fn message_bytes(d: &Descriptor) -> u64 {
    let payloads: u64 = d.payload_lengths.iter().fold(0u64, |a, &l| a.saturating_add(l));
    d.tensors
        .iter()
        .fold(payloads, |a, t| a.saturating_add(t.length))
        .saturating_add(d.metadata.len() as u64)
}

/// Reads one whole message from `pipe`, refusing one larger than `max_message_bytes` before
/// allocating anything for it.
pub(crate) async fn read_message(pipe: &Pipe, server: &Server) -> Result<(Descriptor, Allocation), PipeError> {
    pipe.read_message(|d| allocate_within_limit(pipe, server, d)).await
}

/// The memory for a message `d` announces, refused (a protocol error) above
/// `max_message_bytes` before anything is allocated.
pub(crate) fn allocate_within_limit(pipe: &Pipe, server: &Server, d: &Descriptor) -> Result<Allocation, PipeError> {
    within_limit(pipe, server, message_bytes(d))?;
    allocate(pipe, server, d)
}

/// Refuses a message of `size` bytes above `max_message_bytes` (a protocol error).
pub(crate) fn within_limit(pipe: &Pipe, server: &Server, size: u64) -> Result<(), PipeError> {
    if size > server.max_message_bytes {
        return Err(PipeError::Protocol {
            peer: pipe.info().peer.clone(),
            detail: format!(
                "a message of {size} bytes exceeds this worker's limit of {} bytes (max_message_bytes)",
                server.max_message_bytes
            ),
        });
    }
    Ok(())
}

/// The allocation for a message, or the protocol error that refuses it (a tensor this worker
/// cannot place).
pub(crate) fn allocate(pipe: &Pipe, server: &Server, d: &Descriptor) -> Result<Allocation, PipeError> {
    server.allocate(d).map_err(|detail| PipeError::Protocol {
        peer: pipe.info().peer.clone(),
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each hold is released exactly once: by its reply, or by a request that reused its id
    /// while it was in flight; a request of no bytes holds nothing.
    #[test]
    fn held_requests_release_each_hold_once() {
        let budget = Arc::new(Budget::new(1000));
        let held = HeldRequests::default();
        assert!(budget.try_acquire(300));
        held.hold(1, 7, &budget, 0);
        held.release(1, 7);
        assert_eq!(budget.used(), 300, "a request of no bytes held nothing");
        held.hold(1, 7, &budget, 100);
        held.hold(2, 7, &budget, 200);
        held.release(1, 7);
        assert_eq!(budget.used(), 200);
        held.release(1, 7);
        assert_eq!(budget.used(), 200, "a second reply releases nothing");
        assert!(budget.try_acquire(50));
        held.hold(2, 7, &budget, 50);
        assert_eq!(budget.used(), 50, "the reused id's earlier hold was released");
        held.release(2, 7);
        assert_eq!(budget.used(), 0);
        assert_eq!(held.count.load(Ordering::Acquire), 0);
    }
}
