//! The embedded store: a small key-value store over TCP, served by one worker (rank 0 by
//! default), the way torchrun's TCPStore works.
//!
//! Keys hold bytes or counters. `get`, `wait_count` and `watch` block on the server until the
//! key exists, the counter is high enough, or the prefix changed (or their timeout passes), so
//! no client polls. Ephemeral keys belong to the connection that set them and are deleted when
//! it closes: a worker killed with SIGKILL leaves the membership at once.
//!
//! Hand-off: the host of the store may leave. It snapshots the state ([`StoreServer::snapshot`]),
//! a successor serves it ([`StoreServer::start_with`]), and the old server answers every request
//! from then on, long polls included, with `Moved { addr }`; clients follow the move and
//! re-assert their ephemeral keys there. Ephemeral keys nobody re-asserts within the grace
//! period are deleted. A store host that *crashes* takes the store with it: use etcd for that.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sluice_transport::auth::{self, Secret};
use sluice_transport::tcp::{TcpOptions, TcpTransport};
use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport};
use tokio::sync::Notify;

use super::{Listing, StoreError};

/// Largest store frame accepted either way.
const MAX_FRAME: usize = 16 << 20;
/// How long ephemeral keys carried over by a hand-off wait for their owner to re-assert them.
const HANDOFF_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Request {
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
    /// Set a key owned by this connection: deleted when the connection closes.
    SetEphemeral {
        key: String,
        value: Vec<u8>,
    },
    Delete {
        key: String,
    },
    List {
        prefix: String,
    },
    /// Wait until the revision passes `after`, then list `prefix`.
    Watch {
        prefix: String,
        after: u64,
        timeout_ms: u64,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Response {
    Done,
    Value(Vec<u8>),
    Count(i64),
    TimedOut,
    Listing {
        revision: u64,
        entries: Vec<(String, Vec<u8>)>,
    },
    /// The store now lives at `addr`.
    Moved {
        addr: String,
    },
}

/// A copy of the whole store, handed to a successor.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Snapshot {
    values: BTreeMap<String, Vec<u8>>,
    counters: BTreeMap<String, i64>,
    ephemeral: Vec<String>,
    revision: u64,
}

#[derive(Default)]
struct State {
    values: HashMap<String, Vec<u8>>,
    counters: HashMap<String, i64>,
    /// Ephemeral key → the connection that owns it (0: carried over, awaiting its owner).
    owners: HashMap<String, u64>,
    /// Bumped by every change to a value (counters excluded).
    revision: u64,
    moved: Option<String>,
    /// A hand-off is under way: requests wait until the move (or the thaw).
    frozen: bool,
}

impl State {
    fn set(&mut self, key: String, value: Vec<u8>, owner: Option<u64>) {
        match owner {
            Some(c) => self.owners.insert(key.clone(), c),
            None => self.owners.remove(&key),
        };
        self.values.insert(key, value);
        self.revision += 1;
    }

    fn delete(&mut self, key: &str) {
        self.owners.remove(key);
        if self.values.remove(key).is_some() {
            self.revision += 1;
        }
    }

    fn list(&self, prefix: &str) -> Response {
        let mut entries: Vec<(String, Vec<u8>)> = self
            .values
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        entries.sort();
        Response::Listing {
            revision: self.revision,
            entries,
        }
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Notify,
    next_conn: AtomicU64,
}

impl Shared {
    fn changed(&self) {
        self.changed.notify_waiters();
    }
}

/// The server side, run by one worker. Dropping it stops serving.
pub struct StoreServer {
    address: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl StoreServer {
    /// Binds `addr` (port 0 picks one) and serves until dropped.
    pub async fn start(addr: &str) -> Result<StoreServer, StoreError> {
        Self::start_with(addr, Snapshot::default(), None).await
    }

    /// Serves `snapshot` (empty, or a hand-off from another server); with a `secret`, every
    /// connection must prove it before its first request is read.
    pub async fn start_with(addr: &str, snapshot: Snapshot, secret: Option<Secret>) -> Result<StoreServer, StoreError> {
        let tcp = TcpTransport::new(TcpOptions::default());
        let mut listener = tcp.listen(addr).await.map_err(|e| StoreError::Unreachable {
            addr: addr.to_owned(),
            detail: format!("cannot listen: {e}"),
        })?;
        let address = listener.address();
        let carried: Vec<String> = snapshot.ephemeral.clone();
        let state = State {
            values: snapshot.values.into_iter().collect(),
            counters: snapshot.counters.into_iter().collect(),
            owners: carried.iter().map(|k| (k.clone(), 0)).collect(),
            revision: snapshot.revision,
            moved: None,
            frozen: false,
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            changed: Notify::new(),
            next_conn: AtomicU64::new(1),
        });
        if !carried.is_empty() {
            let shared = shared.clone();
            tokio::spawn(async move {
                tokio::time::sleep(HANDOFF_GRACE).await;
                let mut s = shared.state.lock().unwrap();
                let orphans: Vec<String> = s
                    .owners
                    .iter()
                    .filter(|(_, &c)| c == 0)
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in orphans {
                    tracing::info!(key = %k, "store: ephemeral key not re-asserted after the hand-off; deleted");
                    s.delete(&k);
                }
                drop(s);
                shared.changed();
            });
        }
        let accept_shared = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok(conn) => {
                        tokio::spawn(serve(conn, accept_shared.clone(), secret.clone()));
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "store accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        });
        Ok(StoreServer { address, shared, task })
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// A copy of the state, for a successor.
    pub fn snapshot(&self) -> Snapshot {
        let s = self.shared.state.lock().unwrap();
        Snapshot {
            values: s.values.clone().into_iter().collect(),
            counters: s.counters.clone().into_iter().collect(),
            ephemeral: s.owners.keys().cloned().collect(),
            revision: s.revision,
        }
    }

    /// Holds every request from now on, so nothing changes between the snapshot and the move.
    pub fn freeze(&self) {
        self.shared.state.lock().unwrap().frozen = true;
    }

    /// Undoes [`freeze`](Self::freeze) (the hand-off failed).
    pub fn unfreeze(&self) {
        self.shared.state.lock().unwrap().frozen = false;
        self.shared.changed();
    }

    /// From now on every request (waiting ones included) is answered with `Moved { addr }`.
    pub fn moved_to(&self, addr: &str) {
        self.shared.state.lock().unwrap().moved = Some(addr.to_owned());
        self.shared.changed();
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(conn: impl Connection, shared: Arc<Shared>, secret: Option<Secret>) {
    let peer = conn.peer().to_owned();
    let me = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let (mut reader, mut writer) = conn.split();
    if let Some(secret) = &secret {
        let proved = tokio::time::timeout(
            Duration::from_secs(10),
            auth::accept(&mut reader, &mut writer, secret, &peer),
        )
        .await;
        if !matches!(proved, Ok(Ok(()))) {
            tracing::warn!(%peer, "store: connection failed authentication; closed");
            reader.close();
            return;
        }
    }
    loop {
        let frame = match reader.read_vec(MAX_FRAME).await {
            Ok(f) => f,
            Err(_) => break,
        };
        let request: Request = match postcard::from_bytes(&frame) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "store: malformed request; closing the connection");
                break;
            }
        };
        let response = handle(&shared, me, request).await;
        let bytes = postcard::to_allocvec(&response).expect("store responses encode");
        if writer.write(&[&bytes]).await.is_err() {
            break;
        }
    }
    // The connection is gone: so are the ephemeral keys it still owns.
    let mut s = shared.state.lock().unwrap();
    let owned: Vec<String> = s
        .owners
        .iter()
        .filter(|(_, &c)| c == me)
        .map(|(k, _)| k.clone())
        .collect();
    if owned.is_empty() || s.moved.is_some() {
        return;
    }
    for k in &owned {
        s.delete(k);
    }
    drop(s);
    tracing::debug!(%peer, keys = ?owned, "store: connection closed; its ephemeral keys are deleted");
    shared.changed();
}

/// Answers one request.
async fn handle(shared: &Shared, conn: u64, request: Request) -> Response {
    if shared.state.lock().unwrap().frozen {
        // A hand-off is under way: answer with its outcome (a move, or the thaw).
        let r = wait_until(shared, u64::MAX / 4, |s| (!s.frozen).then_some(Response::Done)).await;
        if let Response::Moved { .. } = r {
            return r;
        }
    }
    if let Some(addr) = shared.state.lock().unwrap().moved.clone() {
        return Response::Moved { addr };
    }
    match request {
        Request::Set { key, value } => {
            shared.state.lock().unwrap().set(key, value, None);
            shared.changed();
            Response::Done
        }
        Request::SetEphemeral { key, value } => {
            shared.state.lock().unwrap().set(key, value, Some(conn));
            shared.changed();
            Response::Done
        }
        Request::Delete { key } => {
            shared.state.lock().unwrap().delete(&key);
            shared.changed();
            Response::Done
        }
        Request::Add { key, delta } => {
            let n = {
                let mut s = shared.state.lock().unwrap();
                let c = s.counters.entry(key).or_insert(0);
                *c = c.saturating_add(delta);
                *c
            };
            shared.changed();
            Response::Count(n)
        }
        Request::List { prefix } => shared.state.lock().unwrap().list(&prefix),
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
        Request::Watch {
            prefix,
            after,
            timeout_ms,
        } => wait_until(shared, timeout_ms, |s| (s.revision > after).then(|| s.list(&prefix))).await,
    }
}

async fn wait_until(shared: &Shared, timeout_ms: u64, check: impl Fn(&State) -> Option<Response>) -> Response {
    let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms.min(365 * 24 * 3600 * 1000));
    loop {
        let notified = shared.changed.notified();
        tokio::pin!(notified);
        // Registered before checking, so a change between the check and the wait is not missed.
        notified.as_mut().enable();
        {
            let s = shared.state.lock().unwrap();
            if let Some(addr) = &s.moved {
                return Response::Moved { addr: addr.clone() };
            }
            if let Some(r) = check(&s) {
                return r;
            }
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return Response::TimedOut;
        }
    }
}

/// Decodes and answers one request frame against a scratch store: the fuzz target's entry.
#[doc(hidden)]
pub fn fuzz_request(frame: &[u8]) {
    let Ok(request) = postcard::from_bytes::<Request>(frame) else {
        return;
    };
    let shared = Shared {
        state: Mutex::new(State::default()),
        changed: Notify::new(),
        next_conn: AtomicU64::new(1),
    };
    // Waits are bounded so a fuzz input cannot stall the run.
    let request = match request {
        Request::Get { key, .. } => Request::Get { key, timeout_ms: 0 },
        Request::WaitCount { key, at_least, .. } => Request::WaitCount {
            key,
            at_least,
            timeout_ms: 0,
        },
        Request::Watch { prefix, after, .. } => Request::Watch {
            prefix,
            after,
            timeout_ms: 0,
        },
        other => other,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let response = rt.block_on(handle(&shared, 1, request));
    let _ = postcard::to_allocvec(&response);
}

/// Valid request frames, as seeds for the fuzz target.
#[doc(hidden)]
pub fn fuzz_seeds() -> Vec<Vec<u8>> {
    [
        Request::Set {
            key: "k".into(),
            value: b"v".to_vec(),
        },
        Request::Get {
            key: "k".into(),
            timeout_ms: 10,
        },
        Request::Add {
            key: "c".into(),
            delta: -3,
        },
        Request::WaitCount {
            key: "c".into(),
            at_least: 2,
            timeout_ms: 10,
        },
        Request::SetEphemeral {
            key: "m/live/00001".into(),
            value: vec![1, 2, 3],
        },
        Request::Delete { key: "k".into() },
        Request::List { prefix: "m/".into() },
        Request::Watch {
            prefix: "m/".into(),
            after: 3,
            timeout_ms: 10,
        },
    ]
    .iter()
    .map(|r| postcard::to_allocvec(r).expect("requests encode"))
    .collect()
}

type Link = (
    <sluice_transport::tcp::TcpConnection as Connection>::Reader,
    <sluice_transport::tcp::TcpConnection as Connection>::Writer,
);

/// A client of the store: one connection, one request at a time. It follows a hand-off
/// (`Moved`) and re-asserts its ephemeral keys on the new server.
pub struct StoreClient {
    addr: Mutex<String>,
    secret: Option<Secret>,
    link: tokio::sync::Mutex<Option<Link>>,
    ephemeral: Mutex<BTreeMap<String, Vec<u8>>>,
    connect_timeout: Duration,
}

impl StoreClient {
    /// Connects to `addr`, retrying until `timeout` passes (the server may start later).
    pub async fn connect(addr: &str, timeout: Duration) -> Result<StoreClient, StoreError> {
        Self::connect_with(addr, timeout, None).await
    }

    /// [`connect`](Self::connect), proving `secret` on every connection.
    pub async fn connect_with(
        addr: &str,
        timeout: Duration,
        secret: Option<Secret>,
    ) -> Result<StoreClient, StoreError> {
        let link = open(addr, timeout, secret.as_ref()).await?;
        Ok(StoreClient {
            addr: Mutex::new(addr.to_owned()),
            secret,
            link: tokio::sync::Mutex::new(Some(link)),
            ephemeral: Mutex::new(BTreeMap::new()),
            connect_timeout: timeout.max(Duration::from_secs(5)),
        })
    }

    pub fn address(&self) -> String {
        self.addr.lock().unwrap().clone()
    }

    /// Points this client at `addr` (the store moved); the next request connects there.
    pub(crate) async fn follow(&self, addr: &str) {
        let mut link = self.link.lock().await;
        *self.addr.lock().unwrap() = addr.to_owned();
        *link = None;
    }

    async fn request(&self, request: &Request) -> Result<Response, StoreError> {
        let bytes = postcard::to_allocvec(request).map_err(|e| self.failed(e.to_string()))?;
        let mut hops = 0;
        loop {
            let mut link = self.link.lock().await;
            if link.is_none() {
                let addr = self.address();
                let mut fresh = open(&addr, self.connect_timeout, self.secret.as_ref()).await?;
                // Re-assert our ephemeral keys on the (new) server before anything else.
                let keys: Vec<(String, Vec<u8>)> = self
                    .ephemeral
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                for (key, value) in keys {
                    let r = exchange(
                        &mut fresh,
                        &postcard::to_allocvec(&Request::SetEphemeral { key, value }).unwrap(),
                    )
                    .await
                    .map_err(|d| self.failed(d))?;
                    if !matches!(r, Response::Done) {
                        return Err(self.failed(format!("re-asserting an ephemeral key got {r:?}")));
                    }
                }
                *link = Some(fresh);
            }
            let l = link.as_mut().expect("connected above");
            let response = match exchange(l, &bytes).await {
                Ok(r) => r,
                Err(detail) => {
                    *link = None;
                    return Err(self.failed(detail));
                }
            };
            match response {
                Response::Moved { addr } if hops < 4 => {
                    tracing::info!(from = %self.address(), to = %addr, "store moved; following it");
                    *self.addr.lock().unwrap() = addr;
                    *link = None;
                    hops += 1;
                }
                other => return Ok(other),
            }
        }
    }

    fn failed(&self, detail: String) -> StoreError {
        StoreError::Failed {
            addr: self.address(),
            detail,
        }
    }

    fn unexpected(&self, r: Response) -> StoreError {
        self.failed(format!("unexpected response {r:?}"))
    }

    fn timeout_of(&self, r: Response, key: &str, timeout: Duration) -> StoreError {
        match r {
            Response::TimedOut => StoreError::Timeout {
                key: key.into(),
                timeout,
            },
            r => self.unexpected(r),
        }
    }

    pub async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        match self.request(&Request::Set { key: key.into(), value }).await? {
            Response::Done => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    /// Sets a key that lives as long as this client's connection (re-asserted after a move).
    pub async fn set_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.ephemeral.lock().unwrap().insert(key.into(), value.clone());
        match self.request(&Request::SetEphemeral { key: key.into(), value }).await? {
            Response::Done => Ok(()),
            r => Err(self.unexpected(r)),
        }
    }

    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.ephemeral.lock().unwrap().remove(key);
        match self.request(&Request::Delete { key: key.into() }).await? {
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
            r => Err(self.timeout_of(r, key, timeout)),
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
            r => Err(self.timeout_of(r, key, timeout)),
        }
    }

    pub async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        match self.request(&Request::List { prefix: prefix.into() }).await? {
            Response::Listing { revision, entries } => Ok(Listing { revision, entries }),
            r => Err(self.unexpected(r)),
        }
    }

    /// Waits until anything changed after `after`, then lists `prefix`. `Ok(None)`: nothing
    /// changed within `timeout`.
    pub async fn watch(&self, prefix: &str, after: u64, timeout: Duration) -> Result<Option<Listing>, StoreError> {
        let request = Request::Watch {
            prefix: prefix.into(),
            after,
            timeout_ms: timeout.as_millis() as u64,
        };
        match self.request(&request).await? {
            Response::Listing { revision, entries } => Ok(Some(Listing { revision, entries })),
            Response::TimedOut => Ok(None),
            r => Err(self.unexpected(r)),
        }
    }
}

async fn open(addr: &str, timeout: Duration, secret: Option<&Secret>) -> Result<Link, StoreError> {
    let tcp = TcpTransport::new(TcpOptions::default());
    let start = Instant::now();
    let mut delay = Duration::from_millis(5);
    loop {
        match tcp.connect(addr).await {
            Ok(conn) => {
                let (mut r, mut w) = conn.split();
                if let Some(s) = secret {
                    auth::connect(&mut r, &mut w, s, addr)
                        .await
                        .map_err(|e| StoreError::Unreachable {
                            addr: addr.to_owned(),
                            detail: e.to_string(),
                        })?;
                }
                return Ok((r, w));
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

async fn exchange(link: &mut Link, bytes: &[u8]) -> Result<Response, String> {
    link.1.write(&[bytes]).await.map_err(|e| e.to_string())?;
    let frame = link.0.read_vec(MAX_FRAME).await.map_err(|e| e.to_string())?;
    postcard::from_bytes(&frame).map_err(|e| format!("malformed response: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn client(addr: &str) -> StoreClient {
        StoreClient::connect(addr, Duration::from_secs(5)).await.unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn set_get_add_wait() {
        let server = StoreServer::start("127.0.0.1:0").await.unwrap();
        let a = client(server.address()).await;
        let b = client(server.address()).await;
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
        let good = client(server.address()).await;
        good.set("x", vec![1]).await.unwrap();
        assert_eq!(good.get("x", Duration::from_secs(1)).await.unwrap(), vec![1]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_secret_store_refuses_clients_without_it() {
        let secret = Secret::new("s3cret");
        let server = StoreServer::start_with("127.0.0.1:0", Snapshot::default(), secret.clone())
            .await
            .unwrap();
        let good = StoreClient::connect_with(server.address(), Duration::from_secs(5), secret)
            .await
            .unwrap();
        good.set("k", vec![7]).await.unwrap();
        let wrong = StoreClient::connect_with(server.address(), Duration::from_secs(5), Secret::new("nope")).await;
        assert!(wrong.is_err());
        // Without a secret the first request is never read: the connection is closed.
        let none = client(server.address()).await;
        assert!(none.get("k", Duration::from_secs(1)).await.is_err());
        assert_eq!(good.get("k", Duration::from_secs(1)).await.unwrap(), vec![7]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ephemeral_keys_leave_with_their_connection_and_watch_sees_it() {
        let server = StoreServer::start("127.0.0.1:0").await.unwrap();
        let watcher = client(server.address()).await;
        let a = client(server.address()).await;
        a.set_ephemeral("m/a", b"A".to_vec()).await.unwrap();
        a.set("other", vec![]).await.unwrap();
        let l = watcher.list("m/").await.unwrap();
        assert_eq!(l.entries, vec![("m/a".to_string(), b"A".to_vec())]);
        // Nothing changes: the watch times out.
        assert!(watcher
            .watch("m/", l.revision + 1, Duration::from_millis(30))
            .await
            .unwrap()
            .is_none());
        let rev = watcher.list("m/").await.unwrap().revision;
        drop(a);
        let after = watcher
            .watch("m/", rev, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        assert!(after.entries.is_empty(), "{:?}", after.entries);
        assert!(after.revision > rev);
        // Plain keys stay.
        assert_eq!(
            watcher.get("other", Duration::from_secs(1)).await.unwrap(),
            Vec::<u8>::new()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hand_off_moves_clients_and_keeps_reasserted_ephemeral_keys() {
        let old = StoreServer::start("127.0.0.1:0").await.unwrap();
        let a = client(old.address()).await;
        let b = client(old.address()).await;
        a.set_ephemeral("m/a", b"A".to_vec()).await.unwrap();
        b.set_ephemeral("m/b", b"B".to_vec()).await.unwrap();
        a.add("n", 7).await.unwrap();
        let rev = a.list("m/").await.unwrap().revision;
        // `a` waits in a long poll across the move.
        let poll = tokio::spawn(async move {
            let r = a.watch("m/", rev, Duration::from_secs(20)).await;
            (a, r)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let new = StoreServer::start_with("127.0.0.1:0", old.snapshot(), None)
            .await
            .unwrap();
        old.moved_to(new.address());
        // `b` leaves for good (its key is not re-asserted) while `a` follows the move.
        drop(b);
        let (a, r) = poll.await.unwrap();
        let _ = r.unwrap();
        assert_eq!(a.address(), new.address());
        assert_eq!(a.add("n", 0).await.unwrap(), 7);
        drop(old);
        // After the grace period only `a`'s key remains.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let l = a.list("m/").await.unwrap();
            if l.entries.len() == 1 {
                assert_eq!(l.entries[0].0, "m/a");
                break;
            }
            assert!(Instant::now() < deadline, "orphaned key never deleted: {:?}", l.entries);
            let _ = a.watch("m/", l.revision, Duration::from_secs(10)).await;
        }
    }
}
