//! Run-time choice of a transport without boxing every operation: enums over the backends that
//! implement the same traits by delegation. A new backend adds one variant to each.

use crate::error::Result;
use crate::ibv::{IbvConnection, IbvReader, IbvWriter, RdmaHandle};
use crate::shm::{ShmConnection, ShmReader, ShmWriter};
use crate::tcp::{TcpConnection, TcpReader, TcpWriter};
use crate::{Closer, Connection, FrameReader, FrameWriter};

macro_rules! delegate {
    ($self:ident, $inner:ident => $e:expr) => {
        match $self {
            Self::Tcp($inner) => $e,
            Self::Shm($inner) => $e,
            Self::Ibv($inner) => $e,
        }
    };
}

/// A connection of any backend.
pub enum AnyConnection {
    Tcp(TcpConnection),
    Shm(ShmConnection),
    Ibv(IbvConnection),
}

/// The receiving half of a connection of any backend.
pub enum AnyReader {
    Tcp(TcpReader),
    Shm(ShmReader),
    Ibv(IbvReader),
}

/// The sending half of a connection of any backend.
pub enum AnyWriter {
    Tcp(TcpWriter),
    Shm(ShmWriter),
    Ibv(IbvWriter),
}

impl AnyConnection {
    /// The backend's name.
    pub fn transport(&self) -> &'static str {
        match self {
            AnyConnection::Tcp(_) => "tcp",
            AnyConnection::Shm(_) => "shm",
            AnyConnection::Ibv(_) => "ibv",
        }
    }
}

impl AnyWriter {
    /// One-sided RDMA on the connection's queue pair, when it is an ibverbs connection.
    pub fn rdma(&self) -> Option<RdmaHandle> {
        match self {
            AnyWriter::Ibv(w) => Some(w.rdma()),
            _ => None,
        }
    }
}

impl From<IbvConnection> for AnyConnection {
    fn from(c: IbvConnection) -> Self {
        AnyConnection::Ibv(c)
    }
}

impl From<TcpConnection> for AnyConnection {
    fn from(c: TcpConnection) -> Self {
        AnyConnection::Tcp(c)
    }
}

impl From<ShmConnection> for AnyConnection {
    fn from(c: ShmConnection) -> Self {
        AnyConnection::Shm(c)
    }
}

impl Connection for AnyConnection {
    type Reader = AnyReader;
    type Writer = AnyWriter;

    fn peer(&self) -> &str {
        delegate!(self, c => c.peer())
    }

    fn split(self) -> (AnyReader, AnyWriter) {
        match self {
            AnyConnection::Tcp(c) => {
                let (r, w) = c.split();
                (AnyReader::Tcp(r), AnyWriter::Tcp(w))
            }
            AnyConnection::Shm(c) => {
                let (r, w) = c.split();
                (AnyReader::Shm(r), AnyWriter::Shm(w))
            }
            AnyConnection::Ibv(c) => {
                let (r, w) = c.split();
                (AnyReader::Ibv(r), AnyWriter::Ibv(w))
            }
        }
    }
}

impl FrameReader for AnyReader {
    async fn read(&mut self, buf: &mut [u8]) -> Result<usize> {
        delegate!(self, r => r.read(buf).await)
    }

    async fn read_vec(&mut self, limit: usize) -> Result<Vec<u8>> {
        delegate!(self, r => r.read_vec(limit).await)
    }

    async fn read_into_vec(&mut self, buf: &mut Vec<u8>, limit: usize) -> Result<usize> {
        delegate!(self, r => r.read_into_vec(buf, limit).await)
    }

    async fn readable(&mut self) -> Result<()> {
        delegate!(self, r => r.readable().await)
    }

    #[inline]
    fn has_input(&mut self) -> bool {
        delegate!(self, r => r.has_input())
    }

    #[inline]
    fn try_read_into_vec_now(&mut self, buf: &mut Vec<u8>, limit: usize) -> Option<Result<usize>> {
        delegate!(self, r => r.try_read_into_vec_now(buf, limit))
    }

    fn close(&self) {
        delegate!(self, r => r.close())
    }

    fn closer(&self) -> Closer {
        delegate!(self, r => r.closer())
    }

    fn peer(&self) -> &str {
        delegate!(self, r => r.peer())
    }
}

impl FrameWriter for AnyWriter {
    async fn write(&mut self, parts: &[&[u8]]) -> Result<()> {
        delegate!(self, w => w.write(parts).await)
    }

    async fn write_deferred(&mut self, parts: &[&[u8]]) -> Result<()> {
        delegate!(self, w => w.write_deferred(parts).await)
    }

    async fn flush(&mut self) -> Result<()> {
        delegate!(self, w => w.flush().await)
    }

    #[inline]
    fn try_write_now(&mut self, parts: &[&[u8]], publish: bool) -> Option<Result<()>> {
        delegate!(self, w => w.try_write_now(parts, publish))
    }

    #[inline]
    fn immediate(&self) -> bool {
        delegate!(self, w => w.immediate())
    }

    fn close(&self) {
        delegate!(self, w => w.close())
    }

    fn closer(&self) -> Closer {
        delegate!(self, w => w.closer())
    }

    fn peer(&self) -> &str {
        delegate!(self, w => w.peer())
    }
}
