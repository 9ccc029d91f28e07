//! The etcd backend (`etcd://host:port/prefix`): for elastic groups across hosts, and for
//! groups whose rendezvous must outlive any one worker.
//!
//! It speaks etcd's v3 API through the JSON gateway every etcd since 3.3 serves on its client
//! port (`POST /v3/kv/range`, `/v3/watch`, `/v3/lease/grant`, …), over plain HTTP with `ureq`.
//! That keeps the build free of protoc and gRPC code generation, so Sluice builds anywhere
//! with the Rust toolchain alone.
//!
//! Every key lives under the job's prefix. Ephemeral keys are attached to this client's lease,
//! renewed by a background thread; a worker that dies stops renewing it and its keys expire
//! after the lease's time to live. Counters are decimal strings changed by compare-and-swap
//! transactions; waits (`get`, `wait_count`, `watch`) are etcd watches started just after the
//! revision of the read that found the condition unmet, so no change in between is missed.

use std::io::BufRead;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

use super::{Listing, StoreError};

/// Time to live of a worker's lease: how long a crashed worker stays a member.
pub const LEASE_TTL_SECS: i64 = 3;
/// Largest gateway answer read (a listing of a big group fits many times over).
const MAX_ANSWER: u64 = 64 << 20;

pub struct EtcdStore {
    endpoint: String,
    prefix: String,
    http: ureq::Agent,
    lease: i64,
    stop: Arc<AtomicBool>,
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        // The lease is revoked by `close`; if we were not closed, it expires on its own.
        self.stop.store(true, Ordering::Release);
    }
}

fn b64(s: &str) -> String {
    B64.encode(s.as_bytes())
}

/// The end of the key range that holds every key starting with `prefix`.
fn prefix_end(prefix: &str) -> String {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return B64.encode(&end);
        }
    }
    B64.encode([0u8])
}

/// An int64 from the gateway (JSON strings, or numbers; absent means zero).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn bytes(v: &Value) -> Vec<u8> {
    v.as_str().and_then(|s| B64.decode(s).ok()).unwrap_or_default()
}

impl EtcdStore {
    /// Connects to `endpoint` (`host:port`), takes a lease and starts renewing it. Retries
    /// until `timeout` passes (etcd may start after the workers).
    pub async fn connect(endpoint: &str, prefix: &str, timeout: Duration) -> Result<EtcdStore, StoreError> {
        let http = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(2))
            .timeout(Duration::from_secs(30))
            .build();
        let mut store = EtcdStore {
            endpoint: endpoint.to_owned(),
            prefix: prefix.trim_end_matches('/').to_owned() + "/",
            http,
            lease: 0,
            stop: Arc::new(AtomicBool::new(false)),
        };
        let start = Instant::now();
        let mut pause = Duration::from_millis(20);
        let lease = loop {
            match store.post("/v3/lease/grant", json!({ "TTL": LEASE_TTL_SECS })).await {
                Ok(r) if int(&r["ID"]) != 0 => break int(&r["ID"]),
                Ok(r) => {
                    return Err(StoreError::Unreachable {
                        addr: store.address(),
                        detail: format!("etcd granted no lease: {r}"),
                    })
                }
                Err(e) if start.elapsed() >= timeout => {
                    return Err(StoreError::Unreachable {
                        addr: store.address(),
                        detail: e.to_string(),
                    })
                }
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
            }
        };
        store.lease = lease;
        let (http, url, stop) = (store.http.clone(), store.url("/v3/lease/keepalive"), store.stop.clone());
        std::thread::Builder::new()
            .name("sluice-etcd-lease".into())
            .spawn(move || {
                let period = Duration::from_millis(LEASE_TTL_SECS as u64 * 1000 / 3);
                while !stop.load(Ordering::Acquire) {
                    let alive = http
                        .post(&url)
                        .send_json(json!({ "ID": lease.to_string() }))
                        .ok()
                        .and_then(|r| r.into_string().ok())
                        .is_some_and(|s| s.contains("TTL"));
                    if !alive {
                        tracing::warn!(lease, "etcd lease renewal failed; this worker's membership may expire");
                    }
                    std::thread::sleep(period);
                }
            })
            .map_err(|e| StoreError::Unreachable {
                addr: store.address(),
                detail: format!("cannot start the lease thread: {e}"),
            })?;
        Ok(store)
    }

    pub fn address(&self) -> String {
        format!("etcd://{}/{}", self.endpoint, self.prefix.trim_end_matches('/'))
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.endpoint)
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

    /// One gateway call, off the async threads.
    async fn post(&self, path: &str, body: Value) -> Result<Value, StoreError> {
        let (http, url) = (self.http.clone(), self.url(path));
        let answer = tokio::task::spawn_blocking(move || -> Result<Value, String> {
            let r = http.post(&url).send_json(body).map_err(|e| e.to_string())?;
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::Read::take(r.into_reader(), MAX_ANSWER), &mut text)
                .map_err(|e| e.to_string())?;
            serde_json::from_str(&text).map_err(|e| format!("unreadable answer: {e}"))
        })
        .await
        .map_err(|e| self.failed(e))?;
        let v = answer.map_err(|e| self.failed(e))?;
        if let Some(err) = v.get("error") {
            return Err(self.failed(format!("etcd: {err}")));
        }
        Ok(v)
    }

    pub async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.post(
            "/v3/kv/put",
            json!({ "key": b64(&self.key(key)), "value": B64.encode(value) }),
        )
        .await
        .map(|_| ())
    }

    pub async fn set_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let body = json!({ "key": b64(&self.key(key)), "value": B64.encode(value), "lease": self.lease.to_string() });
        self.post("/v3/kv/put", body).await.map(|_| ())
    }

    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.post("/v3/kv/deleterange", json!({ "key": b64(&self.key(key)) }))
            .await
            .map(|_| ())
    }

    /// The current value of `key` (if any) and the store's revision at that read.
    async fn read(&self, key: &str) -> Result<(Option<Vec<u8>>, i64), StoreError> {
        let r = self.post("/v3/kv/range", json!({ "key": b64(&self.key(key)) })).await?;
        let value = r["kvs"]
            .as_array()
            .and_then(|k| k.first())
            .map(|kv| bytes(&kv["value"]));
        Ok((value, int(&r["header"]["revision"])))
    }

    /// Waits (up to `timeout`) for any change to `key` (or keys under it, with `prefix`) after
    /// `revision`. False when the time ran out.
    async fn wait_change(&self, key: &str, prefix: bool, revision: i64, timeout: Duration) -> Result<bool, StoreError> {
        let full = self.key(key);
        let mut create = json!({ "key": b64(&full), "start_revision": (revision + 1).to_string() });
        if prefix {
            create["range_end"] = Value::String(prefix_end(&full));
        }
        let url = self.url("/v3/watch");
        let http = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(2))
            .timeout_read(timeout.max(Duration::from_millis(1)))
            .build();
        let seen = tokio::task::spawn_blocking(move || -> Result<bool, String> {
            let r = match http.post(&url).send_json(json!({ "create_request": create })) {
                Ok(r) => r,
                Err(ureq::Error::Transport(t)) if t.to_string().contains("timed out") => return Ok(false),
                Err(e) => return Err(e.to_string()),
            };
            let deadline = Instant::now() + timeout;
            let mut lines = std::io::BufReader::new(std::io::Read::take(r.into_reader(), MAX_ANSWER));
            let mut line = String::new();
            loop {
                line.clear();
                match lines.read_line(&mut line) {
                    Ok(0) => return Err("the watch stream ended".into()),
                    Ok(_) => {
                        let v: Value =
                            serde_json::from_str(line.trim()).map_err(|e| format!("unreadable watch answer: {e}"))?;
                        if v["result"]["canceled"].as_bool() == Some(true) {
                            return Err(format!("watch canceled: {}", v["result"]["cancel_reason"]));
                        }
                        if v["result"]["events"].as_array().is_some_and(|e| !e.is_empty()) {
                            return Ok(true);
                        }
                        if Instant::now() >= deadline {
                            return Ok(false);
                        }
                    }
                    Err(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {
                        return Ok(false)
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
        })
        .await
        .map_err(|e| self.failed(e))?;
        seen.map_err(|e| self.failed(e))
    }

    /// Reads `key` until `ready` accepts its value (absent: `None`), waiting on a watch
    /// between reads, for up to `timeout`.
    async fn read_until<T>(
        &self,
        key: &str,
        timeout: Duration,
        ready: impl Fn(Option<Vec<u8>>) -> Result<Option<T>, StoreError>,
    ) -> Result<T, StoreError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let (value, revision) = self.read(key).await?;
            if let Some(v) = ready(value)? {
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

    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.read_until(key, timeout, Ok).await
    }

    fn parse_count(&self, key: &str, v: &[u8]) -> Result<i64, StoreError> {
        std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| self.failed(format!("counter `{key}` holds {v:?}, not a number")))
    }

    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let full = b64(&self.key(key));
        loop {
            let (value, _) = self.read(key).await?;
            let (compare, old) = match &value {
                Some(v) => (
                    json!({ "key": full, "result": "EQUAL", "target": "VALUE", "value": B64.encode(v) }),
                    self.parse_count(key, v)?,
                ),
                None => (
                    json!({ "key": full, "result": "EQUAL", "target": "VERSION", "version": "0" }),
                    0,
                ),
            };
            let new = old.saturating_add(delta);
            let txn = json!({
                "compare": [compare],
                "success": [{ "request_put": { "key": full, "value": B64.encode(new.to_string()) } }],
            });
            let r = self.post("/v3/kv/txn", txn).await?;
            if r["succeeded"].as_bool() == Some(true) {
                return Ok(new);
            }
        }
    }

    pub async fn wait_count(&self, key: &str, at_least: i64, timeout: Duration) -> Result<i64, StoreError> {
        self.read_until(key, timeout, |value| {
            let n = match value {
                Some(v) => self.parse_count(key, &v)?,
                None => 0,
            };
            Ok((n >= at_least).then_some(n))
        })
        .await
    }

    pub async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        let full = self.key(prefix);
        let r = self
            .post(
                "/v3/kv/range",
                json!({ "key": b64(&full), "range_end": prefix_end(&full) }),
            )
            .await?;
        let strip = self.prefix.len();
        let mut entries: Vec<(String, Vec<u8>)> = r["kvs"]
            .as_array()
            .map(|kvs| {
                kvs.iter()
                    .filter_map(|kv| {
                        let k = String::from_utf8(bytes(&kv["key"])).ok()?;
                        Some((k.get(strip..)?.to_owned(), bytes(&kv["value"])))
                    })
                    .collect()
            })
            .unwrap_or_default();
        entries.sort();
        Ok(Listing {
            revision: int(&r["header"]["revision"]).max(0) as u64,
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
        self.stop.store(true, Ordering::Release);
        let _ = self
            .post("/v3/lease/revoke", json!({ "ID": self.lease.to_string() }))
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_and_gateway_numbers() {
        assert_eq!(B64.decode(prefix_end("a/")).unwrap(), b"a0");
        assert_eq!(B64.decode(prefix_end("ab")).unwrap(), b"ac");
        assert_eq!(int(&json!("42")), 42);
        assert_eq!(int(&json!(7)), 7);
        assert_eq!(int(&Value::Null), 0);
        assert_eq!(bytes(&json!(B64.encode("hi"))), b"hi");
    }
}
