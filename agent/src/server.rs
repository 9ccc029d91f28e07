//! The server side: requests read from incoming pipes, dispatched to handlers (inline, pool or
//! async), and answered on the same pipe.
//!
//! The server's driver: `impl AgentInner` work across parts (see [`crate::agent`] for the
//! layout); its own state is in [`crate::parts`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use sluice_channel::{Allocation, Descriptor, Message, Pipe, PipeError, RecvBuffer, Tensor};

use crate::budget::Budget;
use crate::clock::Activity;
use crate::error::{HandlerError, RpcError};
use crate::gpu;
use crate::handler::{BoxFuture, Handler};
use crate::hub::CallContext;
use crate::hub::{Agent, AgentInner};
use crate::name::WorkerInfo;
use crate::parts::server::{allocate, message_bytes, read_message, within_limit};
use crate::payload::Carried;
use crate::payload::{Payload, Value};
use crate::priority::{with_priority, Priority};
use crate::wire::{self, Body, Envelope, GlobalId, Request, Response, WireError};

impl AgentInner {
    /// Turns a received message into its envelope and value.
    pub(crate) fn receive(
        self: &Arc<Self>,
        sender: u32,
        d: &Descriptor,
        allocation: Allocation,
    ) -> Result<(Envelope, Option<Payload>), String> {
        let envelope = wire::decode(&d.metadata)?;
        let mut payloads = allocation.payloads.into_iter();
        let tensors = allocation
            .tensors
            .into_iter()
            .zip(&d.tensors)
            .map(|(b, td)| {
                // Memory shared with the sender goes back to it, not to our pool.
                let shared = matches!(b, RecvBuffer::Shared(_));
                let buffer = b.freeze();
                if let (Some(bytes), false) = (buffer.as_cpu(), shared) {
                    self.server.keep_for_reuse(bytes);
                }
                Tensor {
                    buffer,
                    metadata: td.metadata.clone(),
                    target_device: None,
                }
            })
            .collect::<Vec<_>>();
        let value = match &envelope {
            Envelope::Request(r) => Some(&r.value),
            Envelope::Response(Response { result: Ok(v), .. }) => Some(v),
            _ => None,
        };
        let payload = match value {
            None => None,
            Some(v) => {
                let bytes = if v.in_payload {
                    payloads
                        .next()
                        .ok_or("the value announced a payload that the message lacks")?
                        .freeze()
                } else {
                    v.inline.clone()
                };
                let rrefs = v
                    .rrefs
                    .iter()
                    .map(|w| {
                        let host = self.host();
                        self.rrefs.materialize(&host, w, sender) as Carried
                    })
                    .collect();
                let mut payload = Payload {
                    bytes,
                    tensors,
                    rrefs,
                    events: Vec::new(),
                };
                // The copies into CUDA tensors are queued, not done: mark them.
                gpu::record_events(&mut payload).map_err(|e| format!("recording arrival events: {e}"))?;
                Some(payload)
            }
        };
        Ok((envelope, payload))
    }

    /// Starts the request's work. Work that runs on this task (async handlers, RRef fetches,
    /// control replies) comes back as a future for the reader to poll at once, so a handler
    /// that finishes without waiting replies with no task switch; the reader spawns whatever is
    /// still pending.
    pub(crate) fn dispatch(
        self: &Arc<Self>,
        caller_info: &WorkerInfo,
        pipe: Pipe,
        request: Request,
        payload: Payload,
    ) -> Option<BoxFuture<()>> {
        let caller = caller_info.id;
        let ctx = CallContext {
            agent: Agent {
                inner: self.clone(),
                priority: None,
            },
            caller: caller_info.clone(),
            streams: payload.streams(),
            kept: matches!(request.body, Body::Remote { .. } | Body::RemoteMethod { .. }),
        };
        let id = request.id;
        let Some(priority) = Priority::new(request.priority) else {
            let detail = format!(
                "priority {} is out of range ({}..={})",
                request.priority,
                Priority::LOWEST,
                Priority::HIGHEST
            );
            tracing::warn!(worker = %self.me, caller, %detail, "rejecting a request");
            return Some(self.reply_later(pipe, caller, id, Err(WireError::Rejected(detail))));
        };
        let call = Call { pipe, id, priority };
        match request.body {
            Body::Call { handler } => self.run_handler(ctx, call, &handler, payload, None),
            Body::Remote { handler, rref, fork } => {
                if let Some(fork) = fork {
                    self.rrefs.add_fork_held(rref, fork, caller);
                }
                self.run_handler(ctx, call, &handler, payload, Some(rref))
            }
            Body::Fetch { rref } => {
                let pipe = call.pipe;
                let value = self.rrefs.value(rref);
                let inner = self.clone();
                self.server.handlers_running.fetch_add(1, Ordering::AcqRel);
                Some(Box::pin(async move {
                    let mut pairs = Vec::new();
                    let result = match value.await {
                        Ok(v) => v
                            .to_payload()
                            .and_then(|mut p| {
                                // Send from a stream that waits for the value's own events.
                                pairs = gpu::restream(&mut p, &inner.server.streams)
                                    .map_err(|e| RpcError::Encode(format!("ordering the value's CUDA tensors: {e}")))?;
                                Ok(p)
                            })
                            .map_err(|e| WireError::Failed(e.to_string())),
                        Err(e) => Err(typed(e)),
                    };
                    inner.reply(&pipe, caller, id, result).await;
                    gpu::rejoin(&pairs);
                    inner.server.handlers_running.fetch_sub(1, Ordering::AcqRel);
                }))
            }
            Body::Method { rref, handler } => self.run_method(ctx, call, rref, handler, payload, None),
            Body::RemoteMethod {
                target,
                handler,
                rref,
                fork,
            } => {
                if let Some(fork) = fork {
                    self.rrefs.add_fork_held(rref, fork, caller);
                }
                self.run_method(ctx, call, target, handler, payload, Some(rref))
            }
            Body::Ping => Some(self.reply_later(call.pipe, caller, id, Ok(Payload::empty()))),
            Body::ForkRequest { rref, fork } => {
                self.rrefs.add_fork_held(rref, fork, caller);
                Some(self.reply_later(call.pipe, caller, id, Ok(Payload::empty())))
            }
            Body::ChildAccept { fork } => {
                self.rrefs.child_accepted(&self.host(), fork);
                Some(self.reply_later(call.pipe, caller, id, Ok(Payload::empty())))
            }
            Body::Delete { rref, fork } => {
                self.rrefs.delete_fork(&self.host(), rref, fork);
                Some(self.reply_later(call.pipe, caller, id, Ok(Payload::empty())))
            }
        }
    }

    pub(crate) fn reply_later(
        self: &Arc<Self>,
        pipe: Pipe,
        caller: u32,
        id: u64,
        result: Result<Payload, WireError>,
    ) -> BoxFuture<()> {
        let inner = self.clone();
        Box::pin(async move { inner.reply(&pipe, caller, id, result).await })
    }

    pub(crate) fn encode_result(&self, result: Result<Value, HandlerError>) -> Result<Payload, WireError> {
        match result {
            Ok(v) => v.to_payload().map_err(|e| WireError::Failed(e.to_string())),
            Err(e) => Err(WireError::Handler(e)),
        }
    }

    /// Runs method handler `handler` on RRef `target`'s value, on the pool once the value
    /// exists; with `rref`, keeps the result as that RRef's value (see [`settle`](Self::settle)).
    fn run_method(
        self: &Arc<Self>,
        ctx: CallContext,
        call: Call,
        target: GlobalId,
        handler: wire::HandlerName,
        payload: Payload,
        rref: Option<GlobalId>,
    ) -> Option<BoxFuture<()>> {
        let caller = ctx.caller.id;
        let Call { pipe, id, priority } = call;
        let Some(method) = self.registry.methods.get(handler.as_str()).cloned() else {
            return Some(self.unknown_handler(pipe, caller, id, &handler, rref));
        };
        let value = self.rrefs.value(target);
        let inner = self.clone();
        self.server.handlers_running.fetch_add(1, Ordering::AcqRel);
        Some(Box::pin(async move {
            match value.await {
                Ok(v) => {
                    let pool_inner = inner.clone();
                    inner.server.pool.submit_at(priority, move || {
                        let result = with_priority(priority, || method(&ctx, &v, payload));
                        let reply = pool_inner.settle(rref, result);
                        pool_inner.reply_from_pool(pipe, caller, id, reply);
                    });
                }
                Err(e) => {
                    // The method never ran: its call (and the reference it was to create)
                    // fails with the target's own error, type and all.
                    if let Some(r) = rref {
                        inner.rrefs.set_value(r, Err(e.clone()));
                    }
                    inner.reply(&pipe, caller, id, Err(typed(e))).await;
                    inner.server.handlers_running.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }))
    }

    /// The reply to a call of a handler or method this worker does not have; a reference the
    /// call was to create holds the same error.
    fn unknown_handler(
        self: &Arc<Self>,
        pipe: Pipe,
        caller: u32,
        id: u64,
        name: &str,
        rref: Option<GlobalId>,
    ) -> BoxFuture<()> {
        if let Some(r) = rref {
            self.rrefs.set_value(
                r,
                Err(RpcError::UnknownHandler {
                    worker: self.me.name.clone(),
                    handler: name.to_owned(),
                }),
            );
        }
        self.reply_later(pipe, caller, id, Err(WireError::UnknownHandler(name.to_owned())))
    }

    /// A handler's result as its reply: the value itself, or with `rref`, kept as that RRef's
    /// value (its failure too) and answered empty.
    pub(crate) fn settle(
        &self,
        rref: Option<GlobalId>,
        result: Result<Value, HandlerError>,
    ) -> Result<Payload, WireError> {
        let Some(r) = rref else {
            return self.encode_result(result.map(|v| v.split_reply().0));
        };
        let (result, created) = match result {
            Ok(v) => {
                let (v, reply) = v.split_reply();
                (Ok(v), reply)
            }
            Err(e) => (Err(e), None),
        };
        let reply = match &result {
            Ok(_) => Ok(created.unwrap_or_else(Payload::empty)),
            Err(e) => Err(WireError::Handler(e.clone())),
        };
        // A value on a GPU keeps events marking the work that made it, for fetches.
        let result = result.and_then(|v| match v {
            Value::Payload(mut p) => match gpu::record_events(&mut p) {
                Ok(()) => Ok(Value::Payload(p)),
                Err(e) => Err(HandlerError::new("CudaError", e.to_string())),
            },
            other => Ok(other),
        });
        self.rrefs.set_value(
            r,
            result.map_err(|e| RpcError::Remote {
                worker: self.me.name.clone(),
                kind: e.kind,
                message: e.message,
            }),
        );
        reply
    }

    /// Runs a registered handler; with `rref`, keeps the value as that RRef's and replies
    /// empty.
    pub(crate) fn run_handler(
        self: &Arc<Self>,
        ctx: CallContext,
        call: Call,
        name: &str,
        payload: Payload,
        rref: Option<GlobalId>,
    ) -> Option<BoxFuture<()>> {
        let caller = ctx.caller.id;
        let Call { pipe, id, priority } = call;
        let Some(handler) = self.registry.handlers.get(name).cloned() else {
            return Some(self.unknown_handler(pipe, caller, id, name, rref));
        };
        self.server.handlers_running.fetch_add(1, Ordering::AcqRel);
        let inner = self.clone();
        let finish = move |inner: &Arc<AgentInner>, result: Result<Value, HandlerError>| inner.settle(rref, result);
        match handler {
            // Quick last time and never blocked, and no request of a higher priority waits
            // for a slot (it would be overtaken): run right here, on the thread that read the
            // request (the serve loop hands its read role on if the handler blocks after all).
            Handler::Sync(f, pace)
                if pace.inline() && crate::pool::may_inline() && !self.server.pool.waiting_above(priority) =>
            {
                let result = with_priority(priority, || pace.run(|| f(&ctx, payload)));
                let reply = finish(&inner, result);
                // A small reply leaves at once, with no future; any other is written by the
                // future returned, which the reader polls at once.
                let (message, forks) = inner.reply_message(caller, id, reply);
                if let Some(written) = pipe.try_write(&message) {
                    inner.reply_written(caller, written, &forks);
                    inner.server.handlers_running.fetch_sub(1, Ordering::AcqRel);
                    return None;
                }
                Some(Box::pin(async move {
                    let written = pipe.write(&message).await;
                    inner.reply_written(caller, written, &forks);
                    inner.server.handlers_running.fetch_sub(1, Ordering::AcqRel);
                }))
            }
            Handler::Sync(f, pace) => {
                self.server.pool.submit_at(priority, move || {
                    // A handler that computed for long last time (without blocking) claims
                    // a core from this host's spinners while it runs (see `occupy_core`),
                    // given back before the reply.
                    let result = {
                        let _core = pace.computes().then(sluice_transport::shm::occupy_core).flatten();
                        with_priority(priority, || pace.run(|| f(&ctx, payload)))
                    };
                    let reply = finish(&inner, result);
                    inner.reply_from_pool(pipe, caller, id, reply);
                });
                None
            }
            Handler::Async(f) => Some(Box::pin(async move {
                let result = f(ctx, payload).await;

                let reply = finish(&inner, result);
                inner.reply(&pipe, caller, id, reply).await;
                inner.server.handlers_running.fetch_sub(1, Ordering::AcqRel);
            })),
        }
    }

    /// Replies from a handler thread, then counts the handler done. A reply without tensors is
    /// written right here (its write completes at once); one with tensors is handed to the I/O
    /// runtime, because its write may wait for the receiver (a CMA write completes when the
    /// caller has pulled the bytes), and a pool thread must not wait a round trip for that.
    pub(crate) fn reply_from_pool(
        self: &Arc<Self>,
        pipe: Pipe,
        caller: u32,
        id: u64,
        result: Result<Payload, WireError>,
    ) {
        let has_tensors = result.as_ref().is_ok_and(|p| !p.tensors.is_empty());
        if has_tensors {
            let inner = self.clone();
            self.handle.spawn(async move {
                inner.reply(&pipe, caller, id, result).await;
                inner.server.handlers_running.fetch_sub(1, Ordering::AcqRel);
            });
        } else {
            let (message, forks) = self.reply_message(caller, id, result);
            let written = match pipe.try_write(&message) {
                Some(written) => written,
                None => self.handle.block_on(pipe.write(&message)),
            };
            self.reply_written(caller, written, &forks);
            self.server.handlers_running.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Sends the reply to request `id` back on `pipe`.
    pub(crate) async fn reply(self: &Arc<Self>, pipe: &Pipe, caller: u32, id: u64, result: Result<Payload, WireError>) {
        let (message, forks) = self.reply_message(caller, id, result);
        // A small reply leaves at once; any other through the general write, boxed so that
        // the futures of async handlers and fetches that await this one stay small.
        let written = match pipe.try_write(&message) {
            Some(written) => written,
            None => Box::pin(pipe.write(&message)).await,
        };
        self.reply_written(caller, written, &forks);
    }

    /// After a reply's write: a reply that could not be sent gives back the RRef forks it
    /// made (the caller learns of the failure from its pipe).
    pub(crate) fn reply_written(self: &Arc<Self>, caller: u32, written: Result<(), PipeError>, forks: &[GlobalId]) {
        if let Err(e) = written {
            self.rrefs.undo_forks(&self.host(), forks);
            tracing::debug!(worker = %self.me, caller, error = %e, "could not send a reply");
        }
    }

    /// The reply to request `id` as a message, and the RRef forks it made; the request's
    /// bytes stop counting against the caller's budget.
    pub(crate) fn reply_message(
        self: &Arc<Self>,
        caller: u32,
        id: u64,
        result: Result<Payload, WireError>,
    ) -> (Message, Vec<GlobalId>) {
        self.server.held.release(caller, id);
        // The caller's map matters only for tensors; skip the lookup otherwise.
        let needs_map = result.as_ref().is_ok_and(|p| !p.tensors.is_empty());
        let peer = if needs_map { self.peers.peer(caller).ok() } else { None };
        let map = peer.as_ref().and_then(|p| p.map_from.as_ref());
        let (result, frames, tensors, forks) = match result {
            Ok(payload) => match self.outgoing_value(&payload, caller, map, true) {
                Ok(o) => (Ok(o.value), o.frames, o.tensors, o.forks),
                Err(e) => (
                    Err(WireError::Failed(e.to_string())),
                    Vec::new(),
                    Vec::new(),
                    Vec::new(),
                ),
            },
            Err(e) => (Err(e), Vec::new(), Vec::new(), Vec::new()),
        };
        let message = wire::message(&Envelope::Response(Response { id, result }), frames, tensors);
        (message, forks)
    }
}

/// Where a request came from and how urgent it is: its reply goes back on `pipe` (so a
/// request on the express pipe is answered there) under `id`.
pub(crate) struct Call {
    pub(crate) pipe: Pipe,
    pub(crate) id: u64,
    pub(crate) priority: Priority,
}

/// Reads the message whose descriptor `d` (of `size` bytes) was just read, within the
/// server's memory `budget` (its bytes are acquired before anything is allocated for it).
pub(crate) async fn finish_read(
    pipe: &Pipe,
    inner: &AgentInner,
    d: Descriptor,
    budget: &Budget,
    size: u64,
) -> Result<(Descriptor, Allocation), PipeError> {
    if let Err(e) = within_limit(pipe, &inner.server, size) {
        pipe.close();
        return Err(e);
    }
    budget.acquire(size).await;
    let allocation = match allocate(pipe, &inner.server, &d) {
        Ok(a) => a,
        Err(e) => {
            budget.release(size);
            pipe.close();
            return Err(e);
        }
    };
    match pipe.read(allocation).await {
        Ok(a) => Ok((d, a)),
        Err(e) => {
            budget.release(size);
            Err(e.error)
        }
    }
}

/// The next request from `pipe`, its contents, and the bytes it holds of the caller's
/// `budget`. A request whole and small is taken as soon as it is here, under the same hold of
/// the pipe's read side as the wait for it (the common case); any other is read by the general
/// path.
async fn next_request(
    pipe: &Pipe,
    inner: &AgentInner,
    budget: &Budget,
) -> Result<(Descriptor, Allocation, u64), PipeError> {
    // The bytes the read holds of the budget, given back if it fails after taking them.
    let mut acquired = 0;
    let read = pipe
        .read_message_ready(|d| {
            let size = message_bytes(d);
            if let Err(e) = within_limit(pipe, &inner.server, size) {
                return Some(Err(e));
            }
            // Over the budget, the general path waits for room.
            if !budget.try_acquire(size) {
                return None;
            }
            acquired = size;
            Some(allocate(pipe, &inner.server, d))
        })
        .await;
    match read {
        Ok(Some((d, a))) => return Ok((d, a, acquired)),
        Ok(None) => {}
        Err(e) => {
            budget.release(acquired);
            return Err(e);
        }
    }
    // Boxed: rare, and its future is large; the loop's own stays small.
    Box::pin(async {
        let d = pipe.read_descriptor().await?;
        let size = message_bytes(&d);
        finish_read(pipe, inner, d, budget, size)
            .await
            .map(|(d, a)| (d, a, size))
    })
    .await
}

/// Serves one incoming pipe: requests in, replies out. A caller that heartbeats and then
/// falls silent for `heartbeat_misses` of its intervals is declared lost.
pub(crate) async fn serve_pipe(inner: Arc<AgentInner>, pipe: Pipe) {
    let (caller, silence) = match read_message(&pipe, &inner.server).await {
        Ok((d, _)) => match wire::decode(&d.metadata) {
            Ok(Envelope::Hello {
                rank,
                version,
                heartbeat_ms,
            }) if version == wire::AGENT_VERSION && inner.peers.known_or_refreshed(rank).await => {
                let silence = (heartbeat_ms > 0).then(|| {
                    Duration::from_millis(heartbeat_ms.min(3_600_000)) * inner.options.heartbeat_misses.max(1)
                });
                (rank, silence)
            }
            Ok(other) => {
                tracing::warn!(worker = %inner.me, peer = %pipe.info().peer, ?other, "pipe did not start with a valid hello from a member; closing it");
                pipe.close();
                return;
            }
            Err(e) => {
                tracing::warn!(worker = %inner.me, peer = %pipe.info().peer, error = %e, "closing pipe");
                pipe.close();
                return;
            }
        },
        Err(_) => return,
    };
    let budget = Arc::new(Budget::new(inner.options.max_in_flight_bytes));
    // Silence is watched by a separate task, so reading costs no timer per message.
    let heard = Arc::new(Activity::default());
    if let Some(limit) = silence {
        tokio::spawn(watch_silence(
            Arc::downgrade(&inner),
            pipe.clone(),
            caller,
            heard.clone(),
            limit,
        ));
    }
    serve_requests(Arc::new(Served {
        caller: inner.peers.worker_info(caller),
        inner,
        pipe,
        budget,
        heard,
    }))
    .await
}

/// An incoming pipe being served: whoever holds its read role runs [`serve_requests`].
pub(crate) struct Served {
    pub(crate) inner: Arc<AgentInner>,
    pub(crate) pipe: Pipe,
    /// The caller, looked up once per pipe (ids are never reused).
    pub(crate) caller: WorkerInfo,
    pub(crate) budget: Arc<Budget>,
    pub(crate) heard: Arc<Activity>,
}

/// Declares the caller of an incoming pipe lost once the pipe has heard nothing for `limit`;
/// ends with the pipe.
pub(crate) async fn watch_silence(
    weak: std::sync::Weak<AgentInner>,
    pipe: Pipe,
    caller: u32,
    heard: Arc<Activity>,
    limit: Duration,
) {
    let Some(mut heard_at) = weak.upgrade().map(|inner| inner.now_ms()) else {
        return;
    };
    loop {
        tokio::time::sleep(limit / 4).await;
        let Some(inner) = weak.upgrade() else { return };
        if inner.is_down() || pipe.error().is_some() {
            return;
        }
        let silent = heard.quiet_for(&mut heard_at, inner.now_ms());
        if silent >= limit {
            pipe.close();
            inner.declare_lost(
                caller,
                None,
                format!("its pipe to this worker was silent for {silent:?}"),
            );
            return;
        }
    }
}

impl crate::pool::HandOff for Served {
    fn hand_off(self: Arc<Self>) {
        tokio::spawn(serve_requests(self));
    }
}

/// Reads requests from one caller and dispatches them, until the pipe ends or the read role
/// is handed to a new reader (a handler running inline blocked).
pub(crate) fn serve_requests(served: Arc<Served>) -> BoxFuture<()> {
    Box::pin(serve_loop(served))
}

/// Most requests whose replies one batch holds back.
const MAX_BATCH: usize = 32;

pub(crate) async fn serve_loop(served: Arc<Served>) {
    let Served {
        inner,
        pipe,
        caller: caller_info,
        budget,
        heard,
    } = &*served;
    let caller = caller_info.id;
    // Requests in this batch (see below).
    let mut batched = 0usize;
    loop {
        // Replies to a burst of requests leave together: while more requests are already
        // here, the pipe batches (replies wait in the transport), and the batch ends, sending
        // them in one transport write, before this loop would wait for a request, or after
        // MAX_BATCH requests so a steady stream cannot hold replies back. (A batch left open
        // by a loop that handed the pipe over is ended here too.)
        if pipe.is_batching() && (batched >= MAX_BATCH || !pipe.has_input()) {
            batched = 0;
            // A failed pipe is reported by the read below.
            let _ = pipe.set_batching(false).await;
        }
        let message = next_request(pipe, inner, budget).await;
        heard.mark();
        let (d, allocation, size) = match message {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(worker = %inner.me, caller, error = %e, pipe = %pipe.debug_state(), "incoming pipe ended");
                // Whatever ended the reading (a misuse leaves a pipe open), the caller learns
                // of it now rather than by its calls' timeouts.
                pipe.close();
                return;
            }
        };
        let received = inner.receive(caller, &d, allocation);
        if !matches!(&received, Ok((Envelope::Request(_), Some(_)))) {
            budget.release(size);
        }
        match received {
            Ok((Envelope::Request(request), Some(payload))) => {
                if !matches!(request.body, Body::Ping) {
                    inner.activity.fetch_add(1, Ordering::Relaxed);
                }
                if pipe.is_batching() || pipe.has_input() {
                    let _ = pipe.set_batching(true).await;
                    batched += 1;
                }
                // Held until the reply goes out (`reply` releases it), whenever it runs.
                inner.server.held.hold(caller, request.id, budget, size);
                // A call that carries user references runs only once their owners confirmed
                // them (as PyTorch does), so a handler never sees a half-registered reference;
                // meanwhile this pipe goes on serving.
                let waiting = inner.rrefs.unconfirmed(&payload.rrefs);
                if !waiting.is_empty() {
                    let (inner, pipe, caller_info) = (inner.clone(), pipe.clone(), caller_info.clone());
                    tokio::spawn(async move {
                        inner.rrefs.confirmed(&waiting).await;
                        if let Some(work) = inner.dispatch(&caller_info, pipe, request, payload) {
                            work.await;
                        }
                    });
                    continue;
                }
                // Should a handler run here block, a new reader takes the pipe over first.
                let hand_off: Arc<dyn crate::pool::HandOff> = served.clone();
                let mut once = Some((hand_off, request, payload));
                let (pending, handed) = std::future::poll_fn(|cx| {
                    let (hand_off, request, payload) = once.take().expect("polled once");
                    Poll::Ready(crate::pool::inline(hand_off, || {
                        let mut work = inner.dispatch(caller_info, pipe.clone(), request, payload)?;
                        // Poll once here, so work that finishes without waiting replies with
                        // no task switch; what must wait continues as its own task (which
                        // polls it again at once, so its waker is the task's own).
                        work.as_mut().poll(cx).is_pending().then_some(work)
                    }))
                })
                .await;
                if let Some(work) = pending {
                    tokio::spawn(work);
                }
                if handed {
                    return;
                }
            }
            Ok((Envelope::Goodbye, _)) => {
                if let Ok(p) = inner.peers.peer(caller) {
                    p.leaving.store(true, Ordering::Release);
                }
            }
            Ok((other, _)) => {
                tracing::warn!(worker = %inner.me, caller, ?other, "unexpected message on an incoming pipe; closing it");
                pipe.close();
                return;
            }
            Err(e) => {
                tracing::warn!(worker = %inner.me, caller, error = %e, "closing incoming pipe");
                pipe.close();
                return;
            }
        }
    }
}

/// An error an RRef's value holds, as the reply that carries it to a caller with its type: an
/// unknown handler stays `UnknownHandler` and a handler's error keeps its kind and message, so
/// `to_here` and the proxies fail the way `rpc_sync` does; anything else goes as text.
fn typed(e: RpcError) -> WireError {
    match e {
        RpcError::UnknownHandler { handler, .. } => WireError::UnknownHandler(handler),
        RpcError::Remote { kind, message, .. } => WireError::Handler(HandlerError { kind, message }),
        other => WireError::Failed(format!("RRef creation failed: {other}")),
    }
}
