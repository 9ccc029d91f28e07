//! Rendezvous and membership storage, chosen by a URL:
//!
//! - `tcp://host:port` (or plain `host:port`): the embedded store ([`tcp`]), served by one
//!   worker. The default for one host and small groups.
//! - `etcd://host:port/prefix`: etcd ([`etcd`]), for elastic groups across hosts; membership
//!   survives any worker, liveness comes from leases.
//!
//! Both give the same operations: plain and ephemeral keys, counters, blocking waits, and
//! watches of a prefix (level-triggered: a watch returns the whole listing once anything changed
//! after the caller's revision, and the caller diffs it).

pub mod etcd;
pub mod tcp;

use std::time::Duration;

use sluice_transport::auth::Secret;

pub use tcp::{Snapshot, StoreClient, StoreServer};

/// A store error: the server is unreachable, went away, or answered nonsense.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("cannot reach the store at {addr}: {detail}")]
    Unreachable { addr: String, detail: String },
    #[error("the store at {addr} failed: {detail}")]
    Failed { addr: String, detail: String },
    #[error("timed out after {timeout:?} waiting for `{key}`")]
    Timeout { key: String, timeout: Duration },
    #[error("invalid store URL `{url}`: {why}")]
    BadUrl { url: String, why: String },
}

/// The keys under a prefix (sorted) at a revision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    pub revision: u64,
    pub entries: Vec<(String, Vec<u8>)>,
}

/// Where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Tcp(String),
    Etcd { endpoint: String, prefix: String },
}

impl StoreUrl {
    /// Parses `tcp://host:port`, `etcd://host:port/prefix` or `host:port`.
    pub fn parse(url: &str) -> Result<StoreUrl, StoreError> {
        let bad = |why: &str| StoreError::BadUrl {
            url: url.to_owned(),
            why: why.to_owned(),
        };
        if let Some(rest) = url.strip_prefix("etcd://") {
            let (endpoint, prefix) = rest
                .split_once('/')
                .ok_or_else(|| bad("etcd URLs name a key prefix for the job: etcd://host:port/prefix"))?;
            if endpoint.is_empty() || !endpoint.contains(':') {
                return Err(bad("the endpoint must be host:port"));
            }
            let prefix = prefix.trim_matches('/');
            if prefix.is_empty() {
                return Err(bad("the job prefix is empty"));
            }
            return Ok(StoreUrl::Etcd {
                endpoint: endpoint.to_owned(),
                prefix: prefix.to_owned(),
            });
        }
        if let Some((scheme, _)) = url.split_once("://") {
            if scheme != "tcp" {
                return Err(bad("the scheme must be tcp:// or etcd://"));
            }
        }
        let addr = url.strip_prefix("tcp://").unwrap_or(url);
        if addr.is_empty() || !addr.contains(':') {
            return Err(bad("expected host:port"));
        }
        Ok(StoreUrl::Tcp(addr.to_owned()))
    }
}

/// A connected store of either kind.
pub enum Store {
    Tcp(Box<StoreClient>),
    Etcd(Box<etcd::EtcdStore>),
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            Store::Tcp($s) => $e,
            Store::Etcd($s) => $e,
        }
    };
}

impl Store {
    /// Connects; `secret` authenticates connections to the embedded store (etcd has its own
    /// authentication and TLS, configured on the etcd side).
    pub async fn connect(url: &StoreUrl, timeout: Duration, secret: Option<Secret>) -> Result<Store, StoreError> {
        Ok(match url {
            StoreUrl::Tcp(addr) => Store::Tcp(Box::new(StoreClient::connect_with(addr, timeout, secret).await?)),
            StoreUrl::Etcd { endpoint, prefix } => {
                Store::Etcd(Box::new(etcd::EtcdStore::connect(endpoint, prefix, timeout).await?))
            }
        })
    }

    pub fn address(&self) -> String {
        both!(self, s => s.address())
    }

    pub async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        both!(self, s => s.set(key, value).await)
    }

    /// A key that lives as long as this client (its connection, or its etcd lease).
    pub async fn set_ephemeral(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        both!(self, s => s.set_ephemeral(key, value).await)
    }

    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        both!(self, s => s.delete(key).await)
    }

    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        both!(self, s => s.get(key, timeout).await)
    }

    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        both!(self, s => s.add(key, delta).await)
    }

    pub async fn wait_count(&self, key: &str, at_least: i64, timeout: Duration) -> Result<i64, StoreError> {
        both!(self, s => s.wait_count(key, at_least, timeout).await)
    }

    pub async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        both!(self, s => s.list(prefix).await)
    }

    pub async fn watch(&self, prefix: &str, after: u64, timeout: Duration) -> Result<Option<Listing>, StoreError> {
        both!(self, s => s.watch(prefix, after, timeout).await)
    }

    /// Arrives at the barrier `key` of `world` members and waits for the rest.
    pub async fn barrier(&self, key: &str, world: u32, timeout: Duration) -> Result<(), StoreError> {
        self.add(key, 1).await?;
        self.wait_count(key, world as i64, timeout).await.map(|_| ())
    }

    /// Points a TCP client at the store's new address (a hand-off); etcd never moves.
    pub async fn follow(&self, addr: &str) {
        if let Store::Tcp(c) = self {
            c.follow(addr).await;
        }
    }

    /// Gives up this client's ephemeral keys at once.
    pub async fn close(&self) {
        if let Store::Etcd(e) = self {
            e.close().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            StoreUrl::parse("127.0.0.1:29500").unwrap(),
            StoreUrl::Tcp("127.0.0.1:29500".into())
        );
        assert_eq!(StoreUrl::parse("tcp://h:1").unwrap(), StoreUrl::Tcp("h:1".into()));
        assert_eq!(
            StoreUrl::parse("etcd://127.0.0.1:2379/jobs/42/").unwrap(),
            StoreUrl::Etcd {
                endpoint: "127.0.0.1:2379".into(),
                prefix: "jobs/42".into()
            }
        );
        for bad in [
            "etcd://127.0.0.1:2379",
            "etcd://127.0.0.1:2379/",
            "etcd:///p",
            "http://h:1",
            "h",
            "",
        ] {
            assert!(matches!(StoreUrl::parse(bad), Err(StoreError::BadUrl { .. })), "{bad}");
        }
    }
}
