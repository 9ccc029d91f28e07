//! The etcd backend (`etcd://host:port/prefix`): for elastic groups across hosts, and for
//! groups whose rendezvous must outlive any one worker.
//!
//! Every key lives under the job's prefix. Ephemeral keys are attached to this client's lease,
//! kept alive by a background task; a worker that dies stops renewing it and its keys expire
//! after the lease's time to live. Counters are decimal strings changed by compare-and-swap
//! transactions; waits (`get`, `wait_count`, `watch`) are etcd watches started at the revision
//! of the read that found the condition unmet, so no change between the read and the watch is
//! missed.

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};

use super::{Listing, StoreError};

/// Time to live of a worker's lease: how long a crashed worker stays a member.
pub const LEASE_TTL_SECS: i64 = 3;

pub struct EtcdStore {
    endpoint: String,
    prefix: String,
    client: Client,
    lease: i64,
    keepalive: tokio::task::JoinHandle<()>,
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.keepalive.abort();
        // The lease is revoked by `close`; if we were not closed, it expires on its own.
    }
}

impl EtcdStore {
    /// Connects to `endpoint` (`host:port`), takes a lease and starts renewing it. Retries
    /// until `timeout` passes (etcd may start after the workers).
    pub async fn connect(endpoint: &str, prefix: &str, timeout: Duration) -> Result<EtcdStore, StoreError> {
        let unreachable = |detail: String| StoreError::Unreachable {
            addr: format!("etcd://{endpoint}"),
            detail,
        };
        let start = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(20);
        let (mut client, lease) = loop {
            let attempt = async {
                let options = etcd_client::ConnectOptions::new()
                    .with_connect_timeout(timeout.max(Duration::from_secs(1)))
                    .with_timeout(Duration::from_secs(30));
                let mut client = Client::connect([endpoint], Some(options))
                    .await
                    .map_err(|e| e.to_string())?;
                let lease = client
                    .lease_grant(LEASE_TTL_SECS, None)
                    .await
                    .map_err(|e| format!("cannot take a lease: {e}"))?
                    .id();
                Ok::<_, String>((client, lease))
            };
            match tokio::time::timeout(
                timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(100)),
                attempt,
            )
            .await
            {
                Ok(Ok(c)) => break c,
                Ok(Err(e)) if start.elapsed() >= timeout => return Err(unreachable(e)),
                Err(_) => return Err(unreachable(format!("no answer within {timeout:?}"))),
                Ok(Err(_)) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
            }
        };
        let (mut keeper, mut responses) = client
            .lease_keep_alive(lease)
            .await
            .map_err(|e| unreachable(format!("cannot keep the lease alive: {e}")))?;
        let keepalive = tokio::spawn(async move {
            let period = Duration::from_millis((LEASE_TTL_SECS as u64 * 1000) / 3);
            loop {
                if keeper.keep_alive().await.is_err() {
                    tracing::warn!(
                        lease,
                        "etcd lease keep-alive failed; this worker's membership will expire"
                    );
                    return;
                }
                match responses.message().await {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    other => {
                        tracing::warn!(lease, ?other, "etcd lease expired; this worker's membership is gone");
                        return;
                    }
                }
                tokio::time::sleep(period).await;
            }
        });
        Ok(EtcdStore {
            endpoint: endpoint.to_owned(),
            prefix: prefix.trim_end_matches('/').to_owned() + "/",
            client,
            lease,
            keepalive,
        })
    }

    pub fn address(&self) -> String {
        format!("etcd://{}/{}", self.endpoint, self.prefix.trim_end_matches('/'))
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn failed(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::Failed {
            addr: self.address(),
            detail: e.to_string(),
        }
    }

    pub async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.client
            .clone()
            .put(self.key(key), value, None)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    pub async fn set_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.client
            .clone()
            .put(self.key(key), value, Some(PutOptions::new().with_lease(self.lease)))
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.client
            .clone()
            .delete(self.key(key), None)
            .await
            .map_err(|e| self.failed(e))?;
        Ok(())
    }

    /// The current value of `key` (if any) and the store's revision at that read.
    async fn read(&self, key: &str) -> Result<(Option<Vec<u8>>, i64), StoreError> {
        let r = self
            .client
            .clone()
            .get(self.key(key), None)
            .await
            .map_err(|e| self.failed(e))?;
        let revision = r.header().map(|h| h.revision()).unwrap_or(0);
        Ok((r.kvs().first().map(|kv| kv.value().to_vec()), revision))
    }

    /// Waits (up to `timeout`) for any change to `key` (or keys under it, with `prefix`) after
    /// `revision`. False when the time ran out.
    async fn wait_change(&self, key: &str, prefix: bool, revision: i64, timeout: Duration) -> Result<bool, StoreError> {
        let mut options = WatchOptions::new().with_start_revision(revision + 1);
        if prefix {
            options = options.with_prefix();
        }
        let mut stream = self
            .client
            .clone()
            .watch(self.key(key), Some(options))
            .await
            .map_err(|e| self.failed(e))?;
        let wait = async {
            loop {
                match stream.message().await {
                    Ok(Some(r)) if r.canceled() => {
                        return Err(self.failed(format!("watch canceled: {}", r.cancel_reason())))
                    }
                    Ok(Some(r)) if !r.events().is_empty() => return Ok(()),
                    Ok(Some(_)) => continue,
                    Ok(None) => return Err(self.failed("watch stream ended")),
                    Err(e) => return Err(self.failed(e)),
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(r) => r.map(|_| true),
            Err(_) => Ok(false),
        }
    }

    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let (value, revision) = self.read(key).await?;
            if let Some(v) = value {
                return Ok(v);
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() || !self.wait_change(key, false, revision, left).await? {
                return Err(StoreError::Timeout {
                    key: key.into(),
                    timeout,
                });
            }
        }
    }

    fn parse_count(&self, key: &str, v: &[u8]) -> Result<i64, StoreError> {
        std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| self.failed(format!("counter `{key}` holds {v:?}, not a number")))
    }

    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let full = self.key(key);
        loop {
            let (value, _) = self.read(key).await?;
            let (compare, old) = match &value {
                Some(v) => (
                    Compare::value(full.clone(), CompareOp::Equal, v.clone()),
                    self.parse_count(key, v)?,
                ),
                None => (Compare::version(full.clone(), CompareOp::Equal, 0), 0),
            };
            let new = old.saturating_add(delta);
            let txn = Txn::new()
                .when([compare])
                .and_then([TxnOp::put(full.clone(), new.to_string(), None)]);
            let r = self.client.clone().txn(txn).await.map_err(|e| self.failed(e))?;
            if r.succeeded() {
                return Ok(new);
            }
        }
    }

    pub async fn wait_count(&self, key: &str, at_least: i64, timeout: Duration) -> Result<i64, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let (value, revision) = self.read(key).await?;
            let n = match value {
                Some(v) => self.parse_count(key, &v)?,
                None => 0,
            };
            if n >= at_least {
                return Ok(n);
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() || !self.wait_change(key, false, revision, left).await? {
                return Err(StoreError::Timeout {
                    key: key.into(),
                    timeout,
                });
            }
        }
    }

    pub async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        let r = self
            .client
            .clone()
            .get(self.key(prefix), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.failed(e))?;
        let revision = r.header().map(|h| h.revision()).unwrap_or(0);
        let strip = self.prefix.len();
        let mut entries: Vec<(String, Vec<u8>)> = r
            .kvs()
            .iter()
            .filter_map(|kv| {
                let k = std::str::from_utf8(kv.key()).ok()?;
                Some((k.get(strip..)?.to_owned(), kv.value().to_vec()))
            })
            .collect();
        entries.sort();
        Ok(Listing {
            revision: revision.max(0) as u64,
            entries,
        })
    }

    pub async fn watch(&self, prefix: &str, after: u64, timeout: Duration) -> Result<Option<Listing>, StoreError> {
        if self.wait_change(prefix, true, after as i64, timeout).await? {
            self.list(prefix).await.map(Some)
        } else {
            Ok(None)
        }
    }

    /// Revokes the lease: this worker's ephemeral keys go at once.
    pub async fn close(&self) {
        let _ = self.client.clone().lease_revoke(self.lease).await;
    }
}
