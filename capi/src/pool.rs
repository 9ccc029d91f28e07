//! Receive memory kept for reuse. A large tensor received into fresh memory pays a page fault
//! per page as it is filled (for 64 MiB, 16,384 faults: more than the copy itself on these
//! machines); programs that exchange tensors of the same sizes over and over (training) can
//! take the memory of one they are done with instead. Buffers of at least [`MIN`] bytes come
//! back here when a received message is freed with tensors still in it, and when a buffer
//! taken out of one (`sluice_received_tensor_take`) is freed; a read takes one of exactly the
//! length it needs, if any, without zeroing it (the channel overwrites every byte). At most
//! [`KEEP`] bytes are kept, oldest dropped first.

use std::collections::VecDeque;
use std::sync::Mutex;

use bytes::BytesMut;

/// Buffers smaller than this are not kept (fresh ones cost little).
pub(crate) const MIN: usize = 256 << 10;

/// The most bytes kept for reuse in a process.
pub(crate) const KEEP: usize = 256 << 10 << 10;

struct Pool {
    buffers: VecDeque<BytesMut>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    buffers: VecDeque::new(),
    bytes: 0,
});

/// `len` bytes to receive into: a kept buffer of that length, or fresh zeroed memory.
pub fn take(len: usize) -> BytesMut {
    if len >= MIN {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pool.buffers.iter().position(|b| b.len() == len) {
            let b = pool.buffers.remove(i).expect("found above");
            pool.bytes -= b.len();
            return b;
        }
    }
    BytesMut::zeroed(len)
}

/// Keeps `b` for a later read of the same length (or drops it if it is small).
pub fn give_back(b: BytesMut) {
    if b.len() < MIN || b.len() > KEEP {
        return;
    }
    let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    pool.bytes += b.len();
    pool.buffers.push_back(b);
    while pool.bytes > KEEP {
        let old = pool.buffers.pop_front().expect("over the limit, so not empty");
        pool.bytes -= old.len();
    }
}

/// Bytes kept now.
#[cfg(test)]
fn kept() -> usize {
    POOL.lock().unwrap_or_else(|e| e.into_inner()).bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_by_exact_length_and_the_total_is_bounded() {
        // One test owns the process-wide pool here (no other unit test of this crate uses it).
        let a = take(MIN);
        let ptr = a.as_ptr();
        give_back(a);
        give_back(BytesMut::zeroed(MIN - 1)); // too small: not kept
        assert_eq!(kept(), MIN);
        let b = take(MIN + 1);
        assert_ne!(b.as_ptr(), ptr, "another length gets fresh memory");
        let c = take(MIN);
        assert_eq!(c.as_ptr(), ptr, "the same length gets the kept buffer");
        assert_eq!(kept(), 0);
        // Past the limit the oldest go first.
        let n = KEEP / MIN + 2;
        let firsts: Vec<*const u8> = (0..n)
            .map(|_| {
                let x = BytesMut::zeroed(MIN);
                let p = x.as_ptr();
                give_back(x);
                p
            })
            .collect();
        assert!(kept() <= KEEP);
        let newest = take(MIN);
        assert!(firsts[2..].contains(&newest.as_ptr()));
        assert!(!firsts[..2].contains(&newest.as_ptr()), "the oldest were dropped");
        drop((b, c, newest));
    }
}
