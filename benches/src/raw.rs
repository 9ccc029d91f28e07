//! Raw baselines, measured in the same run as Sluice's own figures.
//!
//! Every baseline is of the same size and medium as what it is compared with: a shared-memory
//! round trip of N bytes against [`shm_copy_pingpong`] of N bytes (two threads that busy-poll
//! and copy the N bytes through shared buffers on both sides), a TCP round trip against the raw
//! TCP ping-pong of N bytes, a bandwidth against memcpy or the raw TCP stream of N bytes.
#![allow(unsafe_code)]

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Busy-poll ping-pong over shared atomics between two threads (two cores), moving no bytes:
/// the floor for any shared-memory round trip. Per-round-trip samples in ns.
pub fn busy_poll_pingpong(budget: Duration, max_iters: usize) -> Vec<f64> {
    shm_copy_pingpong(0, budget, max_iters)
}

/// A buffer the two threads of [`shm_copy_pingpong`] take turns on.
struct Turn(UnsafeCell<Vec<u8>>);

// SAFETY: the ping-pong hands each buffer from one thread to the other with a Release store
// and an Acquire load of the round's counter; only the thread whose turn it is touches it.
unsafe impl Sync for Turn {}

impl Turn {
    /// # Safety
    /// Only the thread whose turn it is may call this (see the protocol in
    /// [`shm_copy_pingpong`]).
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self) -> &mut Vec<u8> {
        // SAFETY: forwarded from the caller: nobody else touches the buffer meanwhile.
        unsafe { &mut *self.0.get() }
    }
}

/// Busy-poll ping-pong that also moves `len` bytes each way the way a shared-memory transport
/// must: the sender copies its message into a shared buffer, the receiver copies it out, and
/// back (four copies of `len` bytes per round trip, across two cores). The floor for a
/// shared-memory round trip of `len` bytes. Returns per-round-trip samples in ns.
pub fn shm_copy_pingpong(len: usize, budget: Duration, max_iters: usize) -> Vec<f64> {
    let ping = Arc::new(CachePadded::new(AtomicU64::new(0)));
    let pong = Arc::new(CachePadded::new(AtomicU64::new(0)));
    let there = Arc::new(Turn(UnsafeCell::new(vec![0u8; len])));
    let back = Arc::new(Turn(UnsafeCell::new(vec![0u8; len])));
    let stop = u64::MAX;
    let echo = {
        let (ping, pong, there, back) = (ping.clone(), pong.clone(), there.clone(), back.clone());
        std::thread::spawn(move || {
            let mut mine = vec![0u8; len];
            let reply = vec![9u8; len];
            let mut last = 0;
            loop {
                let v = ping.load(Ordering::Acquire);
                if v == stop {
                    return;
                }
                if v != last {
                    last = v;
                    // SAFETY: `ping == v` hands `there` to this thread and `back` is ours until
                    // `pong` says `v`.
                    unsafe {
                        mine.copy_from_slice(there.get());
                        back.get().copy_from_slice(&reply);
                    }
                    std::hint::black_box(&mut mine);
                    pong.store(v, Ordering::Release);
                }
                std::hint::spin_loop();
            }
        })
    };
    let out = vec![7u8; len];
    let mut got = vec![0u8; len];
    // Every round trip is timed on its own, as Sluice's rows are: percentiles of single round
    // trips on both sides (the clock's two reads, tens of ns, are in every row alike).
    let mut samples = Vec::new();
    let start = Instant::now();
    let mut i = 0u64;
    while samples.len() < max_iters && (start.elapsed() < budget || samples.len() < 100.min(max_iters)) {
        let t = Instant::now();
        i += 1;
        // SAFETY: `there` is ours until `ping` says `i`; `back` is ours once `pong` does.
        unsafe { there.get().copy_from_slice(&out) };
        ping.store(i, Ordering::Release);
        while pong.load(Ordering::Acquire) != i {
            std::hint::spin_loop();
        }
        // SAFETY: as above.
        unsafe { got.copy_from_slice(back.get()) };
        std::hint::black_box(&mut got);
        samples.push(t.elapsed().as_nanos() as f64);
    }
    ping.store(stop, Ordering::Release);
    echo.join().expect("echo thread");
    samples
}

/// A one-way stream of `len`-byte messages the way a shared-memory transport must move them:
/// the sender copies each, in pieces of at most 256 KiB, into a 2 MiB ring (the transport's
/// default size) and the receiver, another thread and so another core, copies the pieces out
/// into its message, both busy-polling. The floor for a shared-memory stream of `len`-byte
/// messages: two copies a byte through a cache-sized ring, and the cache lines' trip between
/// the cores, which on a shared VM swings with where the host runs them. GB/s.
pub fn shm_copy_stream(len: usize, budget: Duration) -> (f64, u64) {
    let len = len.max(1);
    let piece = len.min(256 << 10);
    let pieces_per_message = len.div_ceil(piece) as u64;
    let slots = ((2 << 20) / piece).max(2) as u64;
    // Every buffer is written once before the clock starts: the baseline times copies, not
    // the page faults of fresh memory.
    let mut ring = vec![1u8; slots as usize * piece];
    // Both threads copy through raw pointers into disjoint slots, handed over by the counters;
    // `ring` outlives the reader thread (joined below).
    let base = ring.as_mut_ptr() as usize;
    // Pieces written and pieces taken, counted from the start.
    let written = Arc::new(CachePadded::new(AtomicU64::new(0)));
    let taken = Arc::new(CachePadded::new(AtomicU64::new(0)));
    let stop = u64::MAX;
    let piece_len = move |k: u64| {
        let at = (k % pieces_per_message) as usize * piece;
        (at, piece.min(len - at))
    };
    let mut mine = vec![1u8; len];
    let reader = {
        let (written, taken) = (written.clone(), taken.clone());
        std::thread::spawn(move || {
            let mut next = 0u64;
            loop {
                let w = written.load(Ordering::Acquire);
                if w == stop {
                    return;
                }
                if w > next {
                    let (at, n) = piece_len(next);
                    // SAFETY: `written > next` hands slot `next % slots` (inside `ring`, which
                    // outlives this thread) to this thread until `taken` passes `next`; `mine`
                    // has `at + n <= len` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (base as *const u8).add((next % slots) as usize * piece),
                            mine.as_mut_ptr().add(at),
                            n,
                        )
                    };
                    std::hint::black_box(&mut mine);
                    next += 1;
                    taken.store(next, Ordering::Release);
                } else {
                    std::hint::spin_loop();
                }
            }
        })
    };
    let out = vec![7u8; len];
    let start = Instant::now();
    let (mut messages, mut k) = (0u64, 0u64);
    while messages < 3 || start.elapsed() < budget {
        for _ in 0..pieces_per_message {
            while k - taken.load(Ordering::Acquire) >= slots {
                std::hint::spin_loop();
            }
            let (at, n) = piece_len(k);
            // SAFETY: `taken > k - slots` means the reader is done with slot `k % slots`, and
            // it does not read it again until `written` passes `k`; `out` has `at + n` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    out.as_ptr().add(at),
                    (base as *mut u8).add((k % slots) as usize * piece),
                    n,
                )
            };
            k += 1;
            written.store(k, Ordering::Release);
        }
        messages += 1;
    }
    while taken.load(Ordering::Acquire) < k {
        std::hint::spin_loop();
    }
    let secs = start.elapsed().as_secs_f64();
    written.store(stop, Ordering::Release);
    reader.join().expect("stream reader thread");
    drop(ring);
    (len as f64 * messages as f64 / secs / 1e9, messages)
}

/// Single-thread memcpy of `len` bytes between warm buffers, in GB/s.
pub fn memcpy_gbps(len: usize, budget: Duration) -> (f64, u64) {
    let src = vec![1u8; len];
    let mut dst = vec![0u8; len];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    let mut n = 0u64;
    while n < 3 || start.elapsed() < budget {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        n += 1;
    }
    (len as f64 * n as f64 / start.elapsed().as_secs_f64() / 1e9, n)
}

/// Raw TCP ping-pong of `len`-byte messages with the peer's raw echo server (tokio streams,
/// `TCP_NODELAY`: the same waiting strategy as the TCP transport, without framing).
pub async fn tcp_pingpong(addr: &str, len: usize, budget: Duration, max_iters: usize) -> anyhow::Result<Vec<f64>> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_all(b"e").await?;
    s.write_all(&(len as u64).to_le_bytes()).await?;
    let out = vec![7u8; len];
    let mut back = vec![0u8; len];
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < max_iters && (start.elapsed() < budget || samples.len() < 3) {
        let t = Instant::now();
        s.write_all(&out).await?;
        s.read_exact(&mut back).await?;
        samples.push(t.elapsed().as_nanos() as f64);
    }
    Ok(samples)
}

/// Raw TCP stream: `len`-byte writes, the peer drains and acknowledges each batch. GB/s.
pub async fn tcp_stream(addr: &str, len: usize, budget: Duration) -> anyhow::Result<(f64, u64)> {
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_all(b"s").await?;
    s.write_all(&(len as u64).to_le_bytes()).await?;
    let out = vec![7u8; len];
    let batch = batch_for(len);
    let start = Instant::now();
    let mut n = 0u64;
    let mut ack = [0u8; 1];
    while n < 3 || start.elapsed() < budget {
        for _ in 0..batch {
            s.write_all(&out).await?;
        }
        s.read_exact(&mut ack).await?;
        n += batch as u64;
    }
    Ok((len as f64 * n as f64 / start.elapsed().as_secs_f64() / 1e9, n))
}

/// Messages per acknowledged batch in streaming measurements: about 8 MiB, at least one.
pub fn batch_for(len: usize) -> usize {
    ((8 << 20) / len.max(1)).clamp(1, 1024)
}

/// The raw server side: `e` + len: echo `len`-byte messages; `s` + len: drain batches of
/// `batch_for(len)` messages and answer each with one byte.
pub async fn serve_raw(mut s: TcpStream) -> anyhow::Result<()> {
    s.set_nodelay(true)?;
    let mut mode = [0u8; 1];
    s.read_exact(&mut mode).await?;
    let mut len = [0u8; 8];
    s.read_exact(&mut len).await?;
    let len = u64::from_le_bytes(len) as usize;
    anyhow::ensure!(len <= 1 << 30, "raw message of {len} bytes refused");
    let mut buf = vec![0u8; len];
    match mode[0] {
        b'e' => loop {
            s.read_exact(&mut buf).await?;
            s.write_all(&buf).await?;
        },
        b's' => loop {
            for _ in 0..batch_for(len) {
                s.read_exact(&mut buf).await?;
            }
            s.write_all(&[1]).await?;
        },
        m => anyhow::bail!("unknown raw mode {m}"),
    }
}
