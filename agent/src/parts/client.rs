//! The client's own state: the call table, ids, the default timeout, control messages in
//! flight.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::calls::Outstanding;
use crate::options::AgentOptions;
use crate::wire::GlobalId;

/// The client's own state: the calls this worker started and has not completed (and the
/// agent's clock), the counter of ids, the default timeout, control messages in flight.
pub(crate) struct Client {
    /// This worker's id, the high bits of every id made here.
    worker: u32,
    pub(crate) calls: Arc<Outstanding>,
    counter: AtomicU64,
    /// The default timeout of calls started from now, in nanoseconds (starts as the options'
    /// `default_timeout`; see [`crate::Agent::set_default_timeout`]).
    default_timeout_ns: AtomicU64,
    /// Control messages sent and not yet acknowledged or abandoned (outstanding work for
    /// shutdown).
    pub(crate) control_in_flight: AtomicI64,
    /// Fault injection: control messages still to drop.
    drop_control: AtomicUsize,
}

impl Client {
    pub(crate) fn new(worker: u32, options: &AgentOptions) -> Client {
        Client {
            worker,
            calls: Arc::new(Outstanding::new()),
            counter: AtomicU64::new(0),
            default_timeout_ns: AtomicU64::new(nanos(options.default_timeout)),
            control_in_flight: AtomicI64::new(0),
            drop_control: AtomicUsize::new(options.faults.drop_control),
        }
    }

    /// A fresh `worker << 48 | counter` id.
    pub(crate) fn next_id(&self) -> u64 {
        (self.worker as u64) << 48 | self.counter.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn global_id(&self) -> GlobalId {
        GlobalId {
            worker: self.worker,
            local: self.counter.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The timeout calls get when none is given (zero: none).
    pub(crate) fn default_timeout(&self) -> Duration {
        Duration::from_nanos(self.default_timeout_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn set_default_timeout(&self, timeout: Duration) {
        self.default_timeout_ns.store(nanos(timeout), Ordering::Relaxed);
    }

    /// Fault injection: whether to drop this control message.
    pub(crate) fn take_drop(&self) -> bool {
        // Read first: no read-modify-write per control message when no fault is injected.
        self.drop_control.load(Ordering::Relaxed) > 0
            && self
                .drop_control
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
                .is_ok()
    }
}

/// `d` in nanoseconds, saturated.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
