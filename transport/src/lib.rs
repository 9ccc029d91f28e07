//! Ordered, reliable, framed connections between two processes.
//!
//! A transport moves *frames* (byte strings with a length) between exactly two processes, in
//! order, without loss. It is the signalling layer under a pipe: bulk tensor data may travel on
//! a channel instead (see `sluice-channel`).
//!
//! The trait family:
//! - [`Transport`]: a backend's context. Answers "can I run here" ([`Transport::viability`]),
//!   gives its *domain descriptor*, decides "can I talk to that peer"
//!   ([`Transport::can_communicate_with`]), and opens listeners and connections.
//! - [`Listener`]: an address and `accept`.
//! - [`Connection`]: split into a [`FrameReader`] and a [`FrameWriter`] so reads and writes run
//!   concurrently. Reads land in caller-supplied memory; a write completes only once its buffer
//!   may be reused (the kernel, or the peer's ring, holds the bytes). Either half can
//!   [`close`](FrameWriter::close) the whole connection; pending operations then fail with
//!   [`TransportError::Closed`].
//!
//! Backends: [`tcp`] (tokio + socket2, `TCP_NODELAY`, IPv4 and IPv6), [`shm`] (rings in
//! memfd segments, spin-then-park) and [`ibv`] (RC queue pairs, rings written with RDMA
//! write-with-immediate; a strict in-process verbs model where there is no RDMA hardware). [`any`] holds the enums the pipe uses to pick one at run
//! time without boxing every operation.
//!
//! What this crate does not do: reconnect, multiplex, or interpret frames. Cancelling a read or
//! write part-way through a frame (dropping its future) leaves the stream misaligned, so the
//! connection reports [`TransportError::Poisoned`] from then on.
//!
//! Degrading: a backend that cannot run here says so through [`Transport::viability`] and is not
//! offered; nothing in this crate panics on a missing kernel feature.
#![deny(unsafe_code)]

pub mod any;
pub mod auth;
mod closing;
mod error;
mod frame;
pub mod host;
pub mod ibv;
pub mod shm;
mod stream;
pub mod tcp;

use std::future::Future;

pub use error::{Result, TransportError};
pub use frame::HEADER_LEN;

/// A transport backend: its negotiation hooks and its factory methods.
pub trait Transport: Send + Sync + 'static {
    type Listener: Listener<Connection = Self::Connection>;
    type Connection: Connection;

    /// Short lowercase name used in negotiation and configuration (`"tcp"`, `"shm"`).
    fn name(&self) -> &'static str;

    /// `Ok` when the backend can run on this host; otherwise why not.
    fn viability(&self) -> Result<()>;

    /// Describes the domain this process can reach with this transport. Two peers may use the
    /// transport only if [`can_communicate_with`](Self::can_communicate_with) accepts the other's
    /// descriptor.
    fn domain_descriptor(&self) -> String;

    /// Whether a peer whose domain descriptor is `remote` is reachable. Must be symmetric.
    fn can_communicate_with(&self, remote: &str) -> bool {
        remote == self.domain_descriptor()
    }

    /// Starts listening on `addr` (the backend's address syntax; empty means the default).
    fn listen(&self, addr: &str) -> impl Future<Output = Result<Self::Listener>> + Send;

    /// Connects to a listener's address.
    fn connect(&self, addr: &str) -> impl Future<Output = Result<Self::Connection>> + Send;
}

/// Accepts connections.
pub trait Listener: Send + 'static {
    type Connection: Connection;

    /// The address peers connect to.
    fn address(&self) -> String;

    /// Waits for the next connection. An error about one incoming connection (say, a failed
    /// handshake) does not close the listener: call `accept` again.
    fn accept(&mut self) -> impl Future<Output = Result<Self::Connection>> + Send;
}

/// An established connection, not yet split.
pub trait Connection: Send + 'static {
    type Reader: FrameReader;
    type Writer: FrameWriter;

    /// A human-readable name of the peer (address, or process id for shared memory).
    fn peer(&self) -> &str;

    /// Splits into halves that can be driven concurrently from different tasks.
    fn split(self) -> (Self::Reader, Self::Writer);
}

/// The receiving half of a connection.
pub trait FrameReader: Send + 'static {
    /// Reads the next frame into `buf` and returns its length. A frame longer than `buf` fails
    /// with [`TransportError::FrameTooLarge`] and closes the connection.
    fn read(&mut self, buf: &mut [u8]) -> impl Future<Output = Result<usize>> + Send;

    /// Reads the next frame into a new vector, refusing (before allocating) any frame longer
    /// than `limit`.
    fn read_vec(&mut self, limit: usize) -> impl Future<Output = Result<Vec<u8>>> + Send;

    /// Reads the next frame into `buf`, replacing its contents and reusing its capacity (no
    /// allocation once it has grown to the frames it carries), refusing before growing it any
    /// frame longer than `limit`. Returns the frame's length.
    fn read_into_vec(&mut self, buf: &mut Vec<u8>, limit: usize) -> impl Future<Output = Result<usize>> + Send {
        async move {
            *buf = self.read_vec(limit).await?;
            Ok(buf.len())
        }
    }

    /// Waits until the next frame has begun to arrive, consuming nothing; fails when no frame
    /// can arrive any more (the connection's error). **Cancel-safe:** dropping it leaves the
    /// connection exactly as it was, so a reader can give up between frames and another can
    /// take over. (A `read` dropped after it consumed a byte of its frame still poisons the
    /// connection.) After it returned `Ok`, the next `read` finds its first byte at once.
    fn readable(&mut self) -> impl Future<Output = Result<()>> + Send;

    /// Whether a byte of the next frame is already here, without waiting or consuming
    /// anything (a hint: `false` may mean it has not been looked for). Backends that cannot
    /// tell cheaply say `false`.
    fn has_input(&mut self) -> bool {
        false
    }

    /// Reads the next frame like [`read_into_vec`](Self::read_into_vec) if all of it is here
    /// now; `None` means nothing was consumed (the frame has not arrived whole, or the backend
    /// has no such path, which then always says `None`). A frame longer than `limit` is
    /// refused as `read_into_vec` refuses it. Lets a reader take a small frame without
    /// building a future.
    fn try_read_into_vec_now(&mut self, buf: &mut Vec<u8>, limit: usize) -> Option<Result<usize>> {
        let _ = (buf, limit);
        None
    }

    /// Closes the whole connection; pending operations on both halves fail promptly.
    fn close(&self);

    /// A handle that closes the connection from anywhere, even while this half is busy.
    fn closer(&self) -> Closer;

    /// The peer's name, for errors and logs.
    fn peer(&self) -> &str;
}

/// Closes a connection when asked; cheap to clone.
#[derive(Clone)]
pub struct Closer(std::sync::Arc<dyn Fn() + Send + Sync>);

impl Closer {
    pub fn new(close: impl Fn() + Send + Sync + 'static) -> Self {
        Closer(std::sync::Arc::new(close))
    }

    pub fn close(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for Closer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Closer")
    }
}

/// The sending half of a connection.
pub trait FrameWriter: Send + 'static {
    /// Writes one frame made of the concatenation of `parts`. Completes once every byte has
    /// left `parts` (the buffers may be reused).
    fn write(&mut self, parts: &[&[u8]]) -> impl Future<Output = Result<()>> + Send;

    /// Writes one frame like [`write`](Self::write), but the backend may hold it back, together
    /// with the frames deferred before it, until the next `write` or [`flush`](Self::flush),
    /// which send everything held in one transport operation (one system call for TCP, one
    /// publication for shared memory). Completes once `parts` may be reused. Frames keep their
    /// order; a frame held back when the connection fails is lost with it. Backends without
    /// batching send it at once.
    fn write_deferred(&mut self, parts: &[&[u8]]) -> impl Future<Output = Result<()>> + Send {
        self.write(parts)
    }

    /// Sends every frame held back by [`write_deferred`](Self::write_deferred).
    fn flush(&mut self) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(Ok(()))
    }

    /// Writes one frame like [`write`](Self::write) (`publish`) or
    /// [`write_deferred`](Self::write_deferred) (not), but only if that needs no waiting: a
    /// small frame with room for it now. `None` means nothing was written, and the caller
    /// uses the asynchronous path; backends without such a path always say `None`. This lets
    /// a caller send a small message without building (and moving, and boxing) a future.
    fn try_write_now(&mut self, parts: &[&[u8]], publish: bool) -> Option<Result<()>> {
        let _ = (parts, publish);
        None
    }

    /// Whether this connection has the immediate paths at all (`try_write_now` here and
    /// `FrameReader::try_read_into_vec_now` on its reader): when not, callers skip preparing
    /// an attempt that is always declined.
    fn immediate(&self) -> bool {
        false
    }

    /// Closes the whole connection; pending operations on both halves fail promptly.
    fn close(&self);

    /// A handle that closes the connection from anywhere, even while this half is busy.
    fn closer(&self) -> Closer;

    /// The peer's name, for errors and logs.
    fn peer(&self) -> &str;
}
