//! Mutual challenge–response authentication with a shared secret (HMAC-SHA256), run on every
//! connection before anything else is accepted on it.
//!
//! 1. The acceptor sends a 32-byte random challenge.
//! 2. The connector answers with its own 32-byte challenge and
//!    `HMAC(secret, "sluice-auth-v1/connector" ‖ acceptor challenge ‖ connector challenge)`.
//! 3. The acceptor checks it (in constant time) and answers with
//!    `HMAC(secret, "sluice-auth-v1/acceptor" ‖ connector challenge ‖ acceptor challenge)`,
//!    which the connector checks in turn.
//!
//! A wrong proof closes the connection with [`TransportError::Auth`] on the side that found it
//! (logged there); the other side sees the connection close. Frames are size-limited, so an
//! unauthenticated peer can make neither side allocate more than a few dozen bytes.
//! The secret never travels; each challenge is fresh, so a recorded exchange cannot be replayed.

use std::sync::Arc;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::{FrameReader, FrameWriter, Result, TransportError};

const NONCE: usize = 32;
const TAG: usize = 32;
const CONNECTOR: &[u8] = b"sluice-auth-v1/connector";
const ACCEPTOR: &[u8] = b"sluice-auth-v1/acceptor";

/// A shared secret. Its `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Arc<[u8]>);

impl Secret {
    /// A secret from its bytes; empty secrets are refused (they would prove nothing).
    pub fn new(bytes: impl AsRef<[u8]>) -> Option<Secret> {
        let b = bytes.as_ref();
        (!b.is_empty()).then(|| Secret(Arc::from(b)))
    }

    /// `SLUICE_SECRET`, or the contents of the file named by `SLUICE_SECRET_FILE` (a trailing
    /// newline is dropped). `Ok(None)` when neither is set.
    pub fn from_env() -> std::io::Result<Option<Secret>> {
        if let Some(s) = std::env::var_os("SLUICE_SECRET") {
            return Ok(Secret::new(s.as_encoded_bytes()));
        }
        if let Some(path) = std::env::var_os("SLUICE_SECRET_FILE") {
            let mut bytes = std::fs::read(path)?;
            while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                bytes.pop();
            }
            return Ok(Secret::new(bytes));
        }
        Ok(None)
    }

    fn tag(&self, label: &[u8], first: &[u8], second: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rand::thread_rng().fill_bytes(&mut n);
    n
}

fn refused(peer: &str, reason: &str) -> TransportError {
    TransportError::Auth {
        peer: peer.to_owned(),
        reason: reason.to_owned(),
    }
}

/// The accepting side: challenge, check the proof, prove ourselves.
pub async fn accept<R: FrameReader, W: FrameWriter>(r: &mut R, w: &mut W, secret: &Secret, peer: &str) -> Result<()> {
    let mine = nonce();
    w.write(&[&mine]).await?;
    let answer = r.read_vec(NONCE + TAG).await?;
    if answer.len() != NONCE + TAG {
        r.close();
        return Err(refused(peer, "malformed authentication answer"));
    }
    let (theirs, proof) = answer.split_at(NONCE);
    if secret.tag(CONNECTOR, &mine, theirs).verify_slice(proof).is_err() {
        r.close();
        tracing::warn!(%peer, "authentication failed: wrong secret; connection closed");
        return Err(refused(peer, "the peer does not know the shared secret"));
    }
    let tag = secret.tag(ACCEPTOR, theirs, &mine).finalize().into_bytes();
    w.write(&[&tag]).await
}

/// The connecting side: answer the challenge, check the acceptor's proof.
pub async fn connect<R: FrameReader, W: FrameWriter>(r: &mut R, w: &mut W, secret: &Secret, peer: &str) -> Result<()> {
    let challenge = r.read_vec(NONCE).await?;
    if challenge.len() != NONCE {
        r.close();
        return Err(refused(
            peer,
            "malformed authentication challenge (does the peer use a secret?)",
        ));
    }
    let mine = nonce();
    let tag = secret.tag(CONNECTOR, &challenge, &mine).finalize().into_bytes();
    w.write(&[&mine, &tag]).await?;
    let proof = r.read_vec(TAG).await.map_err(|e| match e {
        TransportError::PeerLost { .. } | TransportError::Closed { .. } => {
            refused(peer, "the peer closed the connection: it rejected our secret")
        }
        other => other,
    })?;
    if secret.tag(ACCEPTOR, &mine, &challenge).verify_slice(&proof).is_err() {
        r.close();
        tracing::warn!(%peer, "authentication failed: the peer does not know the secret; connection closed");
        return Err(refused(peer, "the peer does not know the shared secret"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::{TcpOptions, TcpTransport};
    use crate::{Connection, Listener, Transport};

    async fn pair(server: Option<Secret>, client: Option<Secret>) -> (Result<()>, Result<()>) {
        let tcp = TcpTransport::new(TcpOptions::default());
        let mut l = tcp.listen("127.0.0.1:0").await.unwrap();
        let addr = l.address();
        let s = tokio::spawn(async move {
            let c = l.accept().await.unwrap();
            let (mut r, mut w) = c.split();
            match server {
                Some(s) => accept(&mut r, &mut w, &s, "client").await,
                None => Ok(()),
            }
        });
        let c = tcp.connect(&addr).await.unwrap();
        let (mut r, mut w) = c.split();
        let client = match client {
            Some(s) => connect(&mut r, &mut w, &s, "server").await,
            None => {
                // Not authenticating: send a hello as if no secret were in use.
                w.write(&[b"hello, no secret here, just a request......................."])
                    .await
            }
        };
        (s.await.unwrap(), client)
    }

    #[tokio::test]
    async fn same_secret_passes_both_ways() {
        let k = Secret::new("k1").unwrap();
        let (s, c) = pair(Some(k.clone()), Some(k)).await;
        s.unwrap();
        c.unwrap();
    }

    #[tokio::test]
    async fn wrong_or_missing_secret_is_refused() {
        let (s, c) = pair(Some(Secret::new("k1").unwrap()), Some(Secret::new("k2").unwrap())).await;
        assert!(matches!(s, Err(TransportError::Auth { .. })), "{s:?}");
        assert!(c.is_err());
        let (s, _) = pair(Some(Secret::new("k1").unwrap()), None).await;
        assert!(matches!(s, Err(TransportError::Auth { .. })), "{s:?}");
        assert!(Secret::new("").is_none());
        assert_eq!(format!("{:?}", Secret::new("hidden").unwrap()), "Secret(..)");
    }
}
