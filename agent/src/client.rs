//! The client side: a call becomes a pending entry, a request on the peer's pipe, and a reply
//! read by the waiting thread or the background reader (see [`crate::reader`]); deadlines and
//! control messages.
//!
//! The client's driver: `impl AgentInner` work across parts (see [`crate::agent`] for the
//! layout); its own state is in [`crate::parts`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sluice_channel::Tensor;

use crate::name::WorkerInfo;
use crate::rref::{RRefHost, RRefState, RRefTable};

use crate::completion::Completion;
use crate::completion::RpcFuture;
use crate::device_map::{self, DeviceMap};
use crate::error::RpcError;
use crate::hub::AgentInner;
use crate::payload::Payload;
use crate::priority::Priority;
use crate::wire::{self, Body, Envelope, GlobalId, Request, WireError, WireRRef, WireValue};

impl AgentInner {
    /// Registers a call and sends it; the returned completion gets the reply or an error.
    pub(crate) fn start_call(
        self: &Arc<Self>,
        dest: u32,
        body: Body,
        payload: Payload,
        timeout: Duration,
    ) -> RpcFuture {
        if let Err(e) = self.check_running() {
            return Completion::ready(Err(e));
        }
        let peer = match self.peers.peer(dest) {
            Ok(p) => p,
            Err(e) => return Completion::ready(Err(e)),
        };
        if let Some(detail) = peer.down.detail() {
            return Completion::ready(Err(RpcError::PeerLost {
                worker: peer.info.name.clone(),
                detail,
            }));
        }
        let control = body.is_control();
        // Control messages of the RRef protocol keep their own (normal) lane and order.
        let priority = if control {
            Priority::NORMAL
        } else {
            crate::priority::current()
        };
        let lane = crate::parts::peers::lane_for(priority);
        let id = self.client.next_id();
        let Outgoing {
            value,
            frames,
            tensors,
            forks,
        } = match self.outgoing_value(&payload, dest, peer.map_to.as_ref(), false) {
            Ok(v) => v,
            Err(e) => return Completion::ready(Err(e)),
        };
        let message = wire::message(
            &Envelope::Request(Request {
                id,
                priority: priority.level(),
                body,
                value,
            }),
            frames,
            tensors,
        );
        let slot = self.client.calls.register(id, dest, timeout);
        self.activity.fetch_add(1, Ordering::Relaxed);
        if control && self.client.take_drop() {
            tracing::debug!(id, "fault injection: dropping a control message");
            return Completion::new(slot);
        }
        let duplicate = control && self.options.faults.duplicate_control;
        // A task of a current-thread runtime (or a `LocalSet`) must not start the write: a
        // large segment copy runs in `block_in_place`, which only a plain thread or a
        // multi-thread runtime's worker may call.
        let (in_runtime, may_block) = match tokio::runtime::Handle::try_current() {
            Ok(h) => (true, h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread),
            Err(_) => (false, true),
        };
        let open = peer.lanes[lane].current();
        // The common case, a small request on an open pipe with room for it now: written
        // right here, with no future built, moved or boxed.
        if let (Some(lane_open), true, false) = (&open, may_block, duplicate) {
            if let Some(written) = lane_open.pipe.try_write(&message) {
                match written {
                    Ok(()) => peer.lanes[lane].sent.mark(),
                    Err(e) => {
                        self.rrefs.undo_forks(&self.host(), &forks);
                        self.client
                            .calls
                            .finish(id, Err(RpcError::from_pipe(&peer.info.name, e)));
                    }
                }
                return Completion::driven(slot, open.map(|o| o.reader));
            }
        }
        let peer_for_driver = peer.clone();
        let inner = self.clone();
        let send = async move {
            let result = async {
                let pipe = inner.pipe_for(&peer, lane).await?;
                pipe.write(&message)
                    .await
                    .map_err(|e| RpcError::from_pipe(&peer.info.name, e))?;
                // The heartbeat pings only pipes quiet both ways.
                peer.lanes[lane].sent.mark();
                if duplicate {
                    // Same id: the second reply finds no pending call and is dropped.
                    pipe.write(&message)
                        .await
                        .map_err(|e| RpcError::from_pipe(&inner.peers.name_of(dest), e))?;
                }
                Ok::<_, RpcError>(())
            }
            .await;
            if let Err(e) = result {
                inner.rrefs.undo_forks(&inner.host(), &forks);
                inner.client.calls.finish(id, Err(e));
            }
        };
        let opening = open.is_none();
        if !may_block || (in_runtime && opening) {
            // A task cannot wait for the pipe to open: the write goes on as a task of its own.
            self.handle.spawn(send);
        } else if opening {
            // The lane's pipe opens first: done here, so that calls made one after another on
            // this thread are written in that order (the first poll below queues a write on
            // the pipe's fair lock; a task still opening the pipe would not).
            self.handle.block_on(send);
        } else {
            // The caller (a plain thread or a task of a multi-thread runtime, this one or
            // another) starts the write itself (no task spawned, no hand-off when it
            // completes at once, the common case), but never waits for it: a write that
            // cannot finish now (a bulk tensor the peer has not read yet, writes queued
            // ahead) goes on as a task, queued on the pipe's fair lock in call order, and
            // the future returns at once.
            let mut send = Box::pin(send);
            let _runtime = self.handle.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if std::future::Future::poll(send.as_mut(), &mut cx).is_pending() {
                self.handle.spawn(send);
            }
        }
        // Whoever waits for the reply may read it itself (the pipe is open by now when the
        // request was written on this thread).
        let driver = peer_for_driver.lanes[lane].reader();
        Completion::driven(slot, driver)
    }

    /// Prepares a value for `dest`: RRef forks, tensor placement (`reverse` for replies).
    pub(crate) fn outgoing_value(
        self: &Arc<Self>,
        payload: &Payload,
        dest: u32,
        map: Option<&DeviceMap>,
        reverse: bool,
    ) -> Result<Outgoing, RpcError> {
        // The name is for errors about tensors only: no lookup for a call without any.
        let dest_name = &if payload.tensors.is_empty() {
            String::new()
        } else {
            self.peers.name_of(dest)
        };
        let mut tensors = Vec::with_capacity(payload.tensors.len());
        for t in &payload.tensors {
            let device = t.buffer.device();
            let target = if reverse {
                device_map::reverse(map, device, dest_name)?
            } else {
                device_map::forward(map, device, dest_name)?
            };
            let mut t = t.clone();
            t.target_device = Some(target);
            tensors.push(t);
        }
        let mut forks = Vec::new();
        let rrefs = payload
            .rrefs
            .iter()
            .map(|r| {
                let r = r
                    .clone()
                    .downcast::<RRefState>()
                    .expect("a payload carries only RRef handles");
                let host = self.host();
                let fork = self.rrefs.fork_for(&host, &r, dest);
                forks.push(fork);
                WireRRef {
                    owner: r.owner,
                    id: r.id,
                    fork,
                    parent: self.me.id,
                }
            })
            .collect();
        let inline = payload.bytes.len() <= wire::INLINE_LIMIT;
        let value = WireValue {
            inline: if inline { payload.bytes.clone() } else { Bytes::new() },
            in_payload: !inline,
            rrefs,
        };
        let frames = if inline {
            Vec::new()
        } else {
            vec![payload.bytes.clone()]
        };
        Ok(Outgoing {
            value,
            frames,
            tensors,
            forks,
        })
    }

    pub(crate) fn rpc_error(&self, rank: u32, e: WireError) -> RpcError {
        let worker = self.peers.name_of(rank);
        match e {
            WireError::Handler(h) => RpcError::Remote {
                worker,
                kind: h.kind,
                message: h.message,
            },
            WireError::UnknownHandler(handler) => RpcError::UnknownHandler { worker, handler },
            WireError::Failed(detail) => RpcError::Remote {
                worker,
                kind: "Failed".into(),
                message: detail,
            },
            WireError::Rejected(detail) => RpcError::Rejected { worker, detail },
        }
    }

    /// Sends a control message and retries it until it is acknowledged (or the peer is gone).
    /// `then` runs once with the outcome: acknowledged, or abandoned with the error (the peer
    /// is gone).
    pub(crate) fn send_control(
        self: &Arc<Self>,
        dest: u32,
        body: Body,
        then: impl FnOnce(&Arc<AgentInner>, Result<(), RpcError>) + Send + 'static,
    ) {
        self.client.control_in_flight.fetch_add(1, Ordering::AcqRel);
        let inner = self.clone();
        self.handle.spawn(async move {
            let mut delay = Duration::from_millis(10);
            loop {
                let attempt = inner.start_call(dest, body.clone(), Payload::empty(), inner.options.control_retry);
                match attempt.await {
                    Ok(_) => {
                        then(&inner, Ok(()));
                        break;
                    }
                    Err(RpcError::Timeout { .. }) => {
                        tracing::debug!(worker = %inner.me, ?body, "control message unacknowledged; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                    Err(e) => {
                        tracing::debug!(worker = %inner.me, ?body, error = %e, "control message abandoned");
                        then(&inner, Err(e));
                        break;
                    }
                }
            }
            inner.client.control_in_flight.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// A value made ready for one destination: the wire value, the frames of its bytes, its
/// tensors with their target devices, and the RRef forks made for it (undone if the send fails).
pub(crate) struct Outgoing {
    pub(crate) value: WireValue,
    pub(crate) frames: Vec<Bytes>,
    pub(crate) tensors: Vec<Tensor>,
    pub(crate) forks: Vec<GlobalId>,
}

impl RRefHost for AgentInner {
    fn me(&self) -> &WorkerInfo {
        &self.me
    }

    fn worker_info(&self, id: u32) -> WorkerInfo {
        self.peers.worker_info(id)
    }

    fn check_running(&self) -> Result<(), RpcError> {
        AgentInner::check_running(self)
    }

    fn new_id(&self) -> GlobalId {
        self.client.global_id()
    }

    fn rrefs(&self) -> &RRefTable {
        &self.rrefs
    }

    fn default_timeout(&self) -> Duration {
        self.client.default_timeout()
    }

    fn call(self: Arc<Self>, to: u32, body: Body, payload: Payload, timeout: Duration) -> RpcFuture {
        self.start_call(to, body, payload, timeout)
    }

    fn control(self: Arc<Self>, to: u32, body: Body, then: Box<dyn FnOnce(Result<(), RpcError>) + Send>) {
        self.send_control(to, body, move |_, outcome| then(outcome));
    }
}
