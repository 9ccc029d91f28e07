//! What calls carry: a serialized value (postcard), tensors moved by the pipe's channels, and
//! the RRefs the value mentions.
//!
//! RRefs inside a value serialize as an index into the payload's RRef list; the agent does the
//! fork bookkeeping for that list when it sends the payload, and materializes the references
//! eagerly when it receives one, so a reference nobody decodes is still released.

use std::any::Any;
use std::cell::RefCell;
use std::sync::Arc;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use sluice_channel::{CudaError, SendBuffer, Stream, Tensor};
use sluice_cuda::Event;

use crate::error::RpcError;

/// A reference a payload carries, opaque at this layer: the RRef layer above
/// ([`crate::rref::RRefState`]) gives it meaning, so payloads do not depend on it.
pub(crate) type Carried = Arc<dyn Any + Send + Sync>;

thread_local! {
    /// Set while a value is being encoded: RRefs met on the way are collected here.
    static ENCODING: RefCell<Option<Vec<Carried>>> = const { RefCell::new(None) };
    /// Set while a value is being decoded: RRefs are looked up here by index.
    static DECODING: RefCell<Option<Vec<Carried>>> = const { RefCell::new(None) };
}

/// Bytes, tensors and RRefs: the argument or result of a call.
#[derive(Clone, Default)]
pub struct Payload {
    pub(crate) bytes: Bytes,
    pub tensors: Vec<Tensor>,
    pub(crate) rrefs: Vec<Carried>,
    /// For a received payload: one event per stream its CUDA tensors arrived on, recorded
    /// after the incoming copies (see [`crate::gpu`]).
    pub(crate) events: Vec<Event>,
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Payload")
            .field("bytes", &self.bytes.len())
            .field("tensors", &self.tensors.len())
            .field("rrefs", &self.rrefs.len())
            .field("events", &self.events.len())
            .finish()
    }
}

impl Payload {
    /// An empty payload (no bytes, no tensors).
    pub fn empty() -> Payload {
        Payload::default()
    }

    /// Serializes `value` (postcard). RRefs inside it travel with the payload.
    pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Payload, RpcError> {
        let previous = ENCODING.with(|e| e.borrow_mut().replace(Vec::new()));
        let result = postcard::to_allocvec(value);
        let rrefs = ENCODING
            .with(|e| std::mem::replace(&mut *e.borrow_mut(), previous))
            .unwrap_or_default();
        let bytes = result.map_err(|e| RpcError::Encode(e.to_string()))?;
        Ok(Payload {
            bytes: Bytes::from(bytes),
            rrefs,
            ..Payload::default()
        })
    }

    /// Raw bytes, no RRefs.
    pub fn from_bytes(bytes: impl Into<Bytes>) -> Payload {
        Payload {
            bytes: bytes.into(),
            ..Payload::default()
        }
    }

    /// Adds tensors (moved by the pipe's channels, never copied into the value's bytes).
    pub fn with_tensors(mut self, tensors: Vec<Tensor>) -> Payload {
        self.tensors = tensors;
        self
    }

    /// Deserializes the value. RRefs inside it resolve to the references that came with it.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, RpcError> {
        let previous = DECODING.with(|d| d.borrow_mut().replace(self.rrefs.clone()));
        let result = postcard::from_bytes(&self.bytes);
        DECODING.with(|d| *d.borrow_mut() = previous);
        result.map_err(|e| RpcError::Decode {
            worker: "this worker".into(),
            detail: format!("as {}: {e}", std::any::type_name::<T>()),
        })
    }

    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// Takes the tensors out.
    pub fn take_tensors(&mut self) -> Vec<Tensor> {
        std::mem::take(&mut self.tensors)
    }

    /// The events of a received payload: one per stream its CUDA tensors landed on, marking
    /// the incoming copies. Empty for CPU-only payloads.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The streams the CUDA tensors are ordered by (for a received payload: the streams they
    /// arrived on, so work queued there sees their data).
    pub fn streams(&self) -> Vec<Stream> {
        let mut out: Vec<Stream> = Vec::new();
        for t in &self.tensors {
            if let SendBuffer::Cuda(b) = &t.buffer {
                if !out
                    .iter()
                    .any(|s| s.raw() == b.stream().raw() && s.device() == b.device())
                {
                    out.push(b.stream().clone());
                }
            }
        }
        out
    }

    /// Makes work queued later on `stream` wait until every CUDA tensor of this payload has
    /// landed (no host wait). Use it before touching the tensors on a stream of your own.
    pub fn wait_on(&self, stream: &Stream) -> Result<(), CudaError> {
        if self.events.is_empty() {
            // Not a received payload: order after the tensors' own streams instead.
            for s in self.streams() {
                sluice_cuda::Event::record(&s)?.wait_on(stream)?;
            }
        }
        for e in &self.events {
            e.wait_on(stream)?;
        }
        Ok(())
    }

    /// Blocks until every CUDA tensor of this payload has landed (or, for one built here, until
    /// its streams have finished their queued work).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        if self.events.is_empty() {
            for s in self.streams() {
                s.synchronize()?;
            }
        }
        for e in &self.events {
            e.synchronize()?;
        }
        Ok(())
    }

    /// The `i`th tensor's CUDA buffer ordered by `stream` instead, which is made to wait for the
    /// tensor's arrival first: the safe way to hand a received tensor to your own stream.
    ///
    /// Received memory returns to its arrival stream's cache when its last handle drops, and is
    /// reused in that stream's order only: keep the returned buffer until the work you queued
    /// with it on `stream` has finished, or make the tensor's own stream wait for yours
    /// (`Event::record(stream)?.wait_on(old)`) before dropping it.
    pub fn cuda_tensor_on(&self, i: usize, stream: &Stream) -> Result<sluice_channel::CudaBuffer, CudaError> {
        match self.tensors.get(i).map(|t| &t.buffer) {
            Some(SendBuffer::Cuda(b)) => {
                self.wait_on(stream)?;
                b.with_stream(stream)
            }
            Some(_) => Err(CudaError::Invalid(format!("tensor {i} is not a CUDA tensor"))),
            None => Err(CudaError::Invalid(format!(
                "tensor {i} of a payload with {} tensors",
                self.tensors.len()
            ))),
        }
    }
}

/// Called by `RRef`'s `Serialize`: records the reference, returns its index.
pub(crate) fn encode_rref(state: Carried) -> Option<u32> {
    ENCODING.with(|e| {
        let mut e = e.borrow_mut();
        let list = e.as_mut()?;
        list.push(state);
        Some(list.len() as u32 - 1)
    })
}

/// Called by `RRef`'s `Deserialize`: the reference at `index`.
pub(crate) fn decode_rref(index: u32) -> Option<Carried> {
    DECODING.with(|d| d.borrow().as_ref()?.get(index as usize).cloned())
}

/// A handler's result: an encoded payload, or a typed object kept as it is when it stays on
/// this worker (an RRef's value on its owner) and encoded only when it travels.
#[derive(Clone)]
pub enum Value {
    Payload(Payload),
    Object(Object),
}

/// A typed value with the function that encodes it.
#[derive(Clone)]
pub struct Object {
    pub(crate) any: Arc<dyn Any + Send + Sync>,
    pub(crate) encode: fn(&(dyn Any + Send + Sync)) -> Result<Payload, RpcError>,
    pub(crate) type_name: &'static str,
}

/// A value that encodes itself into a whole payload (bytes, tensors, RRefs), for objects
/// serde does not describe: the Python binding's objects, pickled with their tensors lifted
/// out.
pub trait Encode: Send + Sync + 'static {
    fn encode(&self) -> Result<Payload, RpcError>;
}

impl Value {
    /// An object with its own encoding, kept as it is while it stays on this worker.
    pub fn encodable<T: Encode>(value: T) -> Value {
        Value::Object(Object {
            any: Arc::new(value),
            encode: |any| {
                any.downcast_ref::<T>()
                    .expect("an Object encodes the type it was built from")
                    .encode()
            },
            type_name: std::any::type_name::<T>(),
        })
    }

    /// For a handler run by `remote`: the owner keeps `value`, and the creating call completes
    /// with `reply` instead of an empty payload (what [`RRef::created`](crate::RRef::created)
    /// returns), so a caller can have a value made and read part of it in one round trip. As
    /// the result of a plain call, it is `value`.
    pub fn kept_with_reply(value: Value, reply: Payload) -> Value {
        Value::encodable(KeptWithReply { value, reply })
    }

    /// `(value to keep, creation reply)` for a [`kept_with_reply`](Self::kept_with_reply)
    /// value; `(self, None)` otherwise.
    pub(crate) fn split_reply(self) -> (Value, Option<Payload>) {
        match self.object_ref::<KeptWithReply>() {
            Some(k) => (k.value.clone(), Some(k.reply.clone())),
            None => (self, None),
        }
    }

    /// The object itself, if this value is an object of type `T` (no decoding).
    pub fn object_ref<T: Send + Sync + 'static>(&self) -> Option<&T> {
        match self {
            Value::Object(o) => o.any.downcast_ref::<T>(),
            Value::Payload(_) => None,
        }
    }

    /// A typed value.
    pub fn object<T: Serialize + Send + Sync + 'static>(value: T) -> Value {
        Value::Object(Object {
            any: Arc::new(value),
            encode: |any| {
                Payload::encode(
                    any.downcast_ref::<T>()
                        .expect("an Object encodes the type it was built from"),
                )
            },
            type_name: std::any::type_name::<T>(),
        })
    }

    /// The value as a payload (encodes an object).
    pub fn to_payload(&self) -> Result<Payload, RpcError> {
        match self {
            Value::Payload(p) => Ok(p.clone()),
            Value::Object(o) => (o.encode)(&*o.any),
        }
    }

    /// The value as `T`: a shared object of that type, or decoded from a payload.
    pub fn get<T: DeserializeOwned + Send + Sync + 'static>(&self) -> Result<Arc<T>, RpcError> {
        match self {
            Value::Object(o) => o.any.clone().downcast::<T>().map_err(|_| RpcError::WrongType {
                rref: format!("value of type {}", o.type_name),
                expected: std::any::type_name::<T>(),
            }),
            Value::Payload(p) => p.decode::<T>().map(Arc::new),
        }
    }
}

/// See [`Value::kept_with_reply`].
struct KeptWithReply {
    value: Value,
    reply: Payload,
}

impl Encode for KeptWithReply {
    fn encode(&self) -> Result<Payload, RpcError> {
        self.value.to_payload()
    }
}

impl From<Payload> for Value {
    fn from(p: Payload) -> Self {
        Value::Payload(p)
    }
}
