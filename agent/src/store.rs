//! The rendezvous store: a small key-value store over TCP, served by one worker (rank 0 by
//! default), the way torchrun's TCPStore works. Workers publish their address and devices under
//! their rank, wait for everyone else's, and use counters for barriers (init, shutdown).
//!
//! Keys hold bytes or counters. `get` and `wait_count` block on the server until the key
//! exists (or the counter is high enough) or their timeout passes, so no client polls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sluice_transport::tcp::{TcpOptions, TcpTransport};
use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport};
use tokio::sync::Notify;

/// Largest store frame accepted either way.
const MAX_FRAME: usize = 16 << 20;

#[derive(Debug, Serialize, Deserialize)]
enum Request {
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    Add {
        key: String,
        delta: i64,
    },
    WaitCount {
        key: String,
        at_least: i64,
        timeout_ms: u64,
    },
}

#[derive(Debug, Serialize, Deserialize)]
enum Response {
    Done,
    Value(Vec<u8>),
    Count(i64),
    TimedOut,
}

/// A store error: the server is unreachable, went away, or answered nonsense.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("cannot reach the store at {addr}: {detail}")]
    Unreachable { addr: String, detail: String },
    #[error("the store at {addr} failed: {detail}")]
    Failed { addr: String, detail: String },
    #[error("timed out after {timeout:?} waiting for `{key}`")]
    Timeout { key: String, timeout: Duration },
}

#[derive(Default)]
struct State {
    values: HashMap<String, Vec<u8>>,
    counters: HashMap<String, i64>,
}

struct Shared {
    state: Mutex<State>,
    changed: Notify,
}

/// The server side, run by one worker. Dropping it stops serving.
pub struct StoreServer {
    address: String,
    task: tokio::task::JoinHandle<()>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks one) and serves until dropped.
    pub async fn start(addr: &str) -> Result<StoreServer, StoreError> {
        let tcp = TcpTransport::new(TcpOptions::default());
        let mut listener = tcp.listen(addr).await.map_err(|e| StoreError::Unreachable {
            addr: addr.to_owned(),
            detail: format!("cannot listen: {e}"),
        })?;
        let address = listener.address();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Notify::new(),
        });
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok(conn) => {
                        tokio::spawn(serve(conn, shared.clone()));
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "store accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
        Ok(StoreServer { address, task })
    }

    pub fn address(&self) -> &str {
        &self.address
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(conn: impl Connection, shared: Arc<Shared>) {
    let peer = conn.peer().to_owned();
    let (mut reader, mut writer) = conn.split();
    loop {
        let frame = match reader.read_vec(MAX_FRAME).await {
            Ok(f) => f,
            Err(_) => return,
        };
        let request: Request = match postcard::from_bytes(&frame) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "store: malformed request; closing the connection");
                return;
            }
        };
        let response = handle(&shared, request).await;
        let bytes = postcard::to_allocvec(&response).expect("store responses encode");
        if writer.write(&[&bytes]).await.is_err() {
            return;
        }
    }
}

async fn handle(shared: &Shared, request: Request) -> Response {
    match request {
        Request::Set { key, value } => {
            shared.state.lock().unwrap().values.insert(key, value);
            shared.changed.notify_waiters();
            Response::Done
        }
        Request::Add { key, delta } => {
            let n = {
                let mut s = shared.state.lock().unwrap();
                let c = s.counters.entry(key).or_insert(0);
                *c = c.saturating_add(delta);
                *c
            };
            shared.changed.notify_waiters();
            Response::Count(n)
        }
        Request::Get { key, timeout_ms } => {
            wait_until(shared, timeout_ms, |s| s.values.get(&key).cloned().map(Response::Value)).await
        }
        Request::WaitCount {
            key,
            at_least,
            timeout_ms,
        } => {
            wait_until(shared, timeout_ms, |s| {
                let n = s.counters.get(&key).copied().unwrap_or(0);
                (n >= at_least).then_some(Response::Count(n))
            })
            .await
        }
    }
}

async fn wait_until(shared: &Shared, timeout_ms: u64, check: impl Fn(&State) -> Option<Response>) -> Response {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
    loop {
        let notified = shared.changed.notified();
        tokio::pin!(notified);
        // Registered before checking, so a change between the check and the wait is not missed.
        notified.as_mut().enable();
        if let Some(r) = check(&shared.state.lock().unwrap()) {
            return r;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return Response::TimedOut;
        }
    }
}

type Link = (
    <sluice_transport::tcp::TcpConnection as Connection>::Reader,
    <sluice_transport::tcp::TcpConnection as Connection>::Writer,
);

/// A client of the store: one connection, one request at a time.
pub struct StoreClient {
    addr: String,
    link: tokio::sync::Mutex<Link>,
}

impl StoreClient {
    /// Connects to `addr`, retrying until `timeout` passes (the server may start later).
    pub async fn connect(addr: &str, timeout: Duration) -> Result<StoreClient, StoreError> {
        let tcp = TcpTransport::new(TcpOptions::default());
        let start = Instant::now();
        let mut delay = Duration::from_millis(5);
        loop {
            match tcp.connect(addr).await {
                Ok(conn) => {
                    return Ok(StoreClient {
                        addr: addr.to_owned(),
                        link: tokio::sync::Mutex::new(conn.split()),
                    })
                }
                Err(e) if start.elapsed() >= timeout => {
                    return Err(StoreError::Unreachable {
                        addr: addr.to_owned(),
                        detail: e.to_string(),
                    })
                }
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(200));
                }
            }
        }
    }

    async fn request(&self, request: &Request) -> Result<Response, StoreError> {
        let failed = |detail: String| StoreError::Failed {
            addr: self.addr.clone(),
            detail,
        };
        let bytes = postcard::to_allocvec(request).map_err(|e| failed(e.to_string()))?;
        let mut link = self.link.lock().await;
        link.1.write(&[&bytes]).await.map_err(|e| failed(e.to_string()))?;
        let frame = link.0.read_vec(MAX_FRAME).await.map_err(|e| failed(e.to_string()))?;
        postcard::from_bytes(&frame).map_err(|e| failed(format!("malformed response: {e}")))
    }

    fn unexpected(&self, r: Response) -> StoreError {
        StoreError::Failed {
            addr: self.addr.clone(),
            detail: format!("unexpected response {r:?}"),
        }
    }

    pub async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        match self.request(&Request::Set { key: key.into(), value }).await? {
            Response::Done => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// The value of `key`, waiting up to `timeout` for it to be set.
    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let request = Request::Get {
            key: key.into(),
            timeout_ms: timeout.as_millis() as u64,
        };
        match self.request(&request).await? {
            Response::Value(v) => Ok(v),
            Response::TimedOut => Err(StoreError::Timeout {
                key: key.into(),
                timeout,
            }),
            r => Err(self.unexpected(r)),
        }
    }

    /// Adds `delta` to the counter `key` and returns its new value.
    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        match self.request(&Request::Add { key: key.into(), delta }).await? {
            Response::Count(n) => Ok(n),
            r => Err(self.unexpected(r)),
        }
    }

    /// Waits up to `timeout` until the counter `key` reaches `at_least`; returns its value.
    pub async fn wait_count(&self, key: &str, at_least: i64, timeout: Duration) -> Result<i64, StoreError> {
        let request = Request::WaitCount {
            key: key.into(),
            at_least,
            timeout_ms: timeout.as_millis() as u64,
        };
        match self.request(&request).await? {
            Response::Count(n) => Ok(n),
            Response::TimedOut => Err(StoreError::Timeout {
                key: key.into(),
                timeout,
            }),
            r => Err(self.unexpected(r)),
        }
    }

    /// Arrives at the barrier `key` of `world` members and waits for the rest.
    pub async fn barrier(&self, key: &str, world: u32, timeout: Duration) -> Result<(), StoreError> {
        self.add(key, 1).await?;
        self.wait_count(key, world as i64, timeout).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn set_get_add_wait() {
        let server = StoreServer::start("127.0.0.1:0").await.unwrap();
        let a = StoreClient::connect(server.address(), Duration::from_secs(5))
            .await
            .unwrap();
        let b = StoreClient::connect(server.address(), Duration::from_secs(5))
            .await
            .unwrap();
        // A get blocks until another client sets the key.
        let waiter = tokio::spawn(async move {
            let v = b.get("k", Duration::from_secs(10)).await.unwrap();
            (b, v)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.set("k", b"v".to_vec()).await.unwrap();
        let (b, v) = waiter.await.unwrap();
        assert_eq!(v, b"v");
        assert_eq!(a.add("c", 2).await.unwrap(), 2);
        assert_eq!(b.add("c", 3).await.unwrap(), 5);
        assert_eq!(a.wait_count("c", 5, Duration::from_secs(1)).await.unwrap(), 5);
        assert!(matches!(
            a.get("missing", Duration::from_millis(30)).await,
            Err(StoreError::Timeout { .. })
        ));
        assert!(matches!(
            a.wait_count("c", 6, Duration::from_millis(30)).await,
            Err(StoreError::Timeout { .. })
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_closes_only_that_connection() {
        use tokio::io::AsyncWriteExt;
        let server = StoreServer::start("127.0.0.1:0").await.unwrap();
        let mut raw = tokio::net::TcpStream::connect(server.address()).await.unwrap();
        raw.write_all(&5u64.to_le_bytes()).await.unwrap();
        raw.write_all(&[0xff; 5]).await.unwrap();
        let good = StoreClient::connect(server.address(), Duration::from_secs(5))
            .await
            .unwrap();
        good.set("x", vec![1]).await.unwrap();
        assert_eq!(good.get("x", Duration::from_secs(1)).await.unwrap(), vec![1]);
    }
}
