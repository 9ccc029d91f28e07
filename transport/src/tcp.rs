//! TCP transport: tokio sockets created with socket2, `TCP_NODELAY` on every connection, IPv4
//! and IPv6. Addresses are `host:port` (`[::1]:port` for IPv6). Listening on an empty address
//! binds the configured default, loopback unless told otherwise.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use socket2::{Domain, Protocol, SockRef, Socket, Type};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::error::{Result, TransportError};
use crate::stream::{StreamReader, StreamShared, StreamWriter};
use crate::{Closer, Connection, FrameReader, FrameWriter, Listener, Transport};

const NAME: &str = "tcp";

/// Options of the TCP transport.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Address `listen("")` binds to. Defaults to 127.0.0.1: nothing is exposed beyond the host
    /// unless asked.
    pub bind: IpAddr,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
        }
    }
}

/// The TCP transport context.
#[derive(Debug, Clone, Default)]
pub struct TcpTransport {
    options: TcpOptions,
}

impl TcpTransport {
    pub fn new(options: TcpOptions) -> Self {
        TcpTransport { options }
    }

    pub fn options(&self) -> &TcpOptions {
        &self.options
    }

    fn bind_address(&self, addr: &str) -> Result<SocketAddr> {
        if addr.is_empty() {
            return Ok(SocketAddr::new(self.options.bind, 0));
        }
        addr.parse()
            .map_err(|e: std::net::AddrParseError| TransportError::BadAddress {
                transport: NAME,
                addr: addr.to_owned(),
                reason: e.to_string(),
            })
    }
}

fn bind_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false).ok();
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

impl Transport for TcpTransport {
    type Listener = TcpListener;
    type Connection = TcpConnection;

    fn name(&self) -> &'static str {
        NAME
    }

    fn viability(&self) -> Result<()> {
        Ok(())
    }

    /// Every TCP endpoint can try to reach every other; reachability is the network's business.
    fn domain_descriptor(&self) -> String {
        "tcp".to_owned()
    }

    async fn listen(&self, addr: &str) -> Result<TcpListener> {
        let addr = self.bind_address(addr)?;
        let std_listener = bind_listener(addr).map_err(|e| TransportError::io(&addr.to_string(), "listen", e))?;
        let listener = tokio::net::TcpListener::from_std(std_listener)
            .map_err(|e| TransportError::io(&addr.to_string(), "listen", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| TransportError::io(&addr.to_string(), "listen", e))?;
        Ok(TcpListener { inner: listener, local })
    }

    async fn connect(&self, addr: &str) -> Result<TcpConnection> {
        let stream = TcpStream::connect(addr).await.map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidInput => TransportError::BadAddress {
                transport: NAME,
                addr: addr.to_owned(),
                reason: e.to_string(),
            },
            _ => TransportError::io(addr, "connect", e),
        })?;
        TcpConnection::from_stream(stream, addr)
    }
}

/// A listening TCP socket.
#[derive(Debug)]
pub struct TcpListener {
    inner: tokio::net::TcpListener,
    local: SocketAddr,
}

impl TcpListener {
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Listener for TcpListener {
    type Connection = TcpConnection;

    fn address(&self) -> String {
        self.local.to_string()
    }

    async fn accept(&mut self) -> Result<TcpConnection> {
        let (stream, peer) = self
            .inner
            .accept()
            .await
            .map_err(|e| TransportError::io(&self.address(), "accept", e))?;
        TcpConnection::from_stream(stream, &peer.to_string())
    }
}

/// An established TCP connection.
pub struct TcpConnection {
    stream: TcpStream,
    shared: Arc<StreamShared>,
}

impl TcpConnection {
    fn from_stream(stream: TcpStream, peer_hint: &str) -> Result<Self> {
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| peer_hint.to_owned());
        stream
            .set_nodelay(true)
            .map_err(|e| TransportError::io(&peer, "set TCP_NODELAY", e))?;
        // A duplicate of the socket lets either half shut the connection down while the other
        // has an operation pending; the shutdown wakes that operation.
        let dup = SockRef::from(&stream)
            .try_clone()
            .map_err(|e| TransportError::io(&peer, "dup", e))?;
        let shared = StreamShared::new(
            peer,
            Box::new(move || {
                let _ = dup.shutdown(std::net::Shutdown::Both);
            }),
        );
        Ok(TcpConnection { stream, shared })
    }

    /// The peer's socket address, as text.
    pub fn peer_address(&self) -> &str {
        &self.shared.peer
    }
}

impl Connection for TcpConnection {
    type Reader = TcpReader;
    type Writer = TcpWriter;

    fn peer(&self) -> &str {
        &self.shared.peer
    }

    fn split(self) -> (TcpReader, TcpWriter) {
        let (r, w) = self.stream.into_split();
        (
            TcpReader(StreamReader::new(r, self.shared.clone())),
            TcpWriter(StreamWriter::new(w, self.shared)),
        )
    }
}

/// Receiving half of a TCP connection.
pub struct TcpReader(StreamReader<OwnedReadHalf>);

/// Sending half of a TCP connection.
pub struct TcpWriter(StreamWriter<OwnedWriteHalf>);

impl FrameReader for TcpReader {
    async fn read(&mut self, buf: &mut [u8]) -> Result<usize> {
        self.0.read(buf).await
    }

    async fn read_vec(&mut self, limit: usize) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.0.read_into_vec(&mut out, limit).await?;
        Ok(out)
    }

    async fn read_into_vec(&mut self, buf: &mut Vec<u8>, limit: usize) -> Result<usize> {
        self.0.read_into_vec(buf, limit).await
    }

    async fn readable(&mut self) -> Result<()> {
        self.0.readable().await
    }

    fn has_input(&mut self) -> bool {
        self.0.has_input()
    }

    fn close(&self) {
        self.0.shared().close()
    }

    fn closer(&self) -> Closer {
        let shared = self.0.shared().clone();
        Closer::new(move || shared.close())
    }

    fn peer(&self) -> &str {
        &self.0.shared().peer
    }
}

impl FrameWriter for TcpWriter {
    async fn write(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.0.write(parts).await
    }

    async fn write_deferred(&mut self, parts: &[&[u8]]) -> Result<()> {
        self.0.write_deferred(parts).await
    }

    async fn flush(&mut self) -> Result<()> {
        self.0.flush().await
    }

    fn close(&self) {
        self.0.shared().close()
    }

    fn closer(&self) -> Closer {
        let shared = self.0.shared().clone();
        Closer::new(move || shared.close())
    }

    fn peer(&self) -> &str {
        &self.0.shared().peer
    }
}
