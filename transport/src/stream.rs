//! Framing over a byte stream (TCP): an 8-byte little-endian length, then the body.
//!
//! The reader keeps a small buffer so a small frame costs one `read` system call (header and
//! body together), as a raw ping-pong would; large bodies go straight into the caller's memory.
//! The writer sends header and body with one vectored write; frames deferred by
//! `write_deferred` wait in a small buffer and leave with the next write or flush, so a batch of
//! small frames costs one system call.

use std::io::IoSlice;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::closing::{OpGuard, Stopped};
use crate::error::{classify_io, Result, TransportError};
use crate::frame::{decode_header, encode_header, total_len, HEADER_LEN};

/// Bytes the reader buffers ahead; remainders at least this long bypass the buffer.
const READ_BUFFER: usize = 64 * 1024;

/// Deferred frames are held (copied) only while they total at most this many bytes; a frame
/// that would exceed it is sent at once, together with what is held.
const DEFER_LIMIT: usize = 64 * 1024;

/// State shared by both halves of one stream connection.
pub(crate) struct StreamShared {
    pub(crate) peer: String,
    stopped: Stopped,
    shutdown: Box<dyn Fn() + Send + Sync>,
}

impl StreamShared {
    pub(crate) fn new(peer: String, shutdown: Box<dyn Fn() + Send + Sync>) -> Arc<Self> {
        Arc::new(StreamShared {
            peer,
            stopped: Stopped::default(),
            shutdown,
        })
    }

    /// Records `error` as the connection's error (unless one is recorded already), shuts the
    /// socket down, and returns the recorded (first) error.
    fn fail(&self, error: TransportError) -> TransportError {
        if self.stopped.stop(error) {
            (self.shutdown)();
        }
        self.stopped.error().expect("stopped connections have an error")
    }

    pub(crate) fn close(&self) {
        self.fail(TransportError::Closed {
            peer: self.peer.clone(),
        });
    }

    fn abort(&self, op: &'static str) {
        self.fail(TransportError::Poisoned {
            peer: self.peer.clone(),
            op,
        });
    }

    fn io_error(&self, op: &'static str, err: std::io::Error) -> TransportError {
        classify_io(&self.peer, op, err)
    }
}

pub(crate) struct StreamReader<R> {
    inner: R,
    shared: Arc<StreamShared>,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl<R: AsyncRead + Unpin + Send + 'static> StreamReader<R> {
    pub(crate) fn new(inner: R, shared: Arc<StreamShared>) -> Self {
        StreamReader {
            inner,
            shared,
            buf: vec![0; READ_BUFFER].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    pub(crate) fn shared(&self) -> &Arc<StreamShared> {
        &self.shared
    }

    /// Fills `dst` completely, from the buffer first, then from the socket.
    async fn fill(&mut self, dst: &mut [u8]) -> Result<()> {
        let mut done = (self.end - self.start).min(dst.len());
        dst[..done].copy_from_slice(&self.buf[self.start..self.start + done]);
        self.start += done;
        while done < dst.len() {
            let rest = dst.len() - done;
            if rest >= READ_BUFFER {
                done += self.read_some(Target::Caller(&mut dst[done..])).await?;
            } else {
                self.read_some(Target::Buffer).await?;
                let n = (self.end - self.start).min(rest);
                dst[done..done + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                self.start += n;
                done += n;
            }
        }
        Ok(())
    }

    async fn read_some(&mut self, target: Target<'_>) -> Result<usize> {
        let result = match target {
            Target::Caller(dst) => self.inner.read(dst).await,
            Target::Buffer => {
                self.start = 0;
                self.end = 0;
                let r = self.inner.read(&mut self.buf).await;
                if let Ok(n) = r {
                    self.end = n;
                }
                r
            }
        };
        match result {
            Ok(0) => Err(TransportError::PeerLost {
                peer: self.shared.peer.clone(),
                detail: "connection closed by peer".into(),
            }),
            Ok(n) => Ok(n),
            Err(e) => Err(self.shared.io_error("read", e)),
        }
    }

    async fn header(&mut self) -> Result<u64> {
        let mut header = [0u8; HEADER_LEN];
        self.fill(&mut header).await?;
        Ok(decode_header(header))
    }

    async fn frame_into(&mut self, dst: &mut [u8]) -> Result<usize> {
        let len = self.header().await?;
        if len > dst.len() as u64 {
            return Err(TransportError::FrameTooLarge {
                peer: self.shared.peer.clone(),
                len,
                limit: dst.len(),
            });
        }
        let len = len as usize;
        self.fill(&mut dst[..len]).await?;
        Ok(len)
    }

    async fn frame_vec(&mut self, out: &mut Vec<u8>, limit: usize) -> Result<usize> {
        let len = self.header().await?;
        if len > limit as u64 {
            return Err(TransportError::FrameTooLarge {
                peer: self.shared.peer.clone(),
                len,
                limit,
            });
        }
        out.clear();
        out.resize(len as usize, 0);
        self.fill(out).await?;
        Ok(len as usize)
    }

    pub(crate) async fn read(&mut self, dst: &mut [u8]) -> Result<usize> {
        self.shared.stopped.check()?;
        let shared = self.shared.clone();
        let guard = OpGuard::new(move || shared.abort("read"));
        let result = self.frame_into(dst).await;
        guard.finish();
        result.map_err(|e| self.shared.fail(e))
    }

    /// Waits until a byte of the next frame is buffered. Cancel-safe: with the buffer empty,
    /// the only await is the socket read into it, which consumes nothing when dropped.
    pub(crate) async fn readable(&mut self) -> Result<()> {
        self.shared.stopped.check()?;
        if self.start < self.end {
            return Ok(());
        }
        match self.read_some(Target::Buffer).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.shared.fail(e)),
        }
    }

    /// Whether bytes of the next frame are buffered (the socket itself is not asked).
    pub(crate) fn has_input(&self) -> bool {
        self.start < self.end
    }

    pub(crate) async fn read_into_vec(&mut self, out: &mut Vec<u8>, limit: usize) -> Result<usize> {
        self.shared.stopped.check()?;
        let shared = self.shared.clone();
        let guard = OpGuard::new(move || shared.abort("read"));
        let result = self.frame_vec(out, limit).await;
        guard.finish();
        result.map_err(|e| self.shared.fail(e))
    }
}

enum Target<'a> {
    Caller(&'a mut [u8]),
    Buffer,
}

pub(crate) struct StreamWriter<W> {
    inner: W,
    shared: Arc<StreamShared>,
    /// Whole frames (header and body) deferred by `write_deferred`, not sent yet.
    held: Vec<u8>,
}

impl<W: AsyncWrite + Unpin + Send + 'static> StreamWriter<W> {
    pub(crate) fn new(inner: W, shared: Arc<StreamShared>) -> Self {
        StreamWriter {
            inner,
            shared,
            held: Vec::new(),
        }
    }

    pub(crate) fn shared(&self) -> &Arc<StreamShared> {
        &self.shared
    }

    /// Sends the held frames, then the frame made of `parts` (if any), in one vectored write.
    async fn send(&mut self, parts: Option<&[&[u8]]>) -> Result<()> {
        let header = parts.map(|p| encode_header(total_len(p)));
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(parts.map_or(0, |p| p.len()) + 2);
        if !self.held.is_empty() {
            slices.push(IoSlice::new(&self.held));
        }
        if let (Some(header), Some(parts)) = (&header, parts) {
            slices.push(IoSlice::new(header));
            slices.extend(parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)));
        }
        let mut remaining: &mut [IoSlice<'_>] = &mut slices;
        while !remaining.is_empty() {
            match self.inner.write_vectored(remaining).await {
                Ok(0) => {
                    return Err(TransportError::PeerLost {
                        peer: self.shared.peer.clone(),
                        detail: "write returned zero".into(),
                    })
                }
                Ok(n) => IoSlice::advance_slices(&mut remaining, n),
                Err(e) => return Err(self.shared.io_error("write", e)),
            }
        }
        self.held.clear();
        self.inner.flush().await.map_err(|e| self.shared.io_error("flush", e))
    }

    /// Runs one send as a whole: cancelled midway, it poisons the connection.
    async fn guarded(&mut self, parts: Option<&[&[u8]]>) -> Result<()> {
        self.shared.stopped.check()?;
        let shared = self.shared.clone();
        let guard = OpGuard::new(move || shared.abort("write"));
        let result = self.send(parts).await;
        guard.finish();
        result.map_err(|e| self.shared.fail(e))
    }

    pub(crate) async fn write(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.guarded(Some(parts)).await
    }

    /// Holds the frame back while the held frames stay small; sends everything otherwise.
    pub(crate) async fn write_deferred(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.shared.stopped.check()?;
        let len = total_len(parts);
        if self.held.len() as u64 + HEADER_LEN as u64 + len > DEFER_LIMIT as u64 {
            return self.guarded(Some(parts)).await;
        }
        self.held.extend_from_slice(&encode_header(len));
        for p in parts {
            self.held.extend_from_slice(p);
        }
        Ok(())
    }

    pub(crate) async fn flush(&mut self) -> Result<()> {
        if self.held.is_empty() {
            return self.shared.stopped.check();
        }
        self.guarded(None).await
    }
}
