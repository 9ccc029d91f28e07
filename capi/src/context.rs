//! Contexts (`sluice_context`: the transports and channels this process offers) and
//! listeners (`sluice_listener`).

use std::ffi::{CStr, CString};

use sluice_channel::{ChannelKind, Context, ContextOptions, PipeListener, TransportKind};
use tokio::sync::Mutex;

use crate::pipe::SluicePipe;
use crate::runtime;
use crate::status::{Error, Result};

/// A context: the transports and channels this process offers (`sluice_context_new`).
/// Contexts, listeners and pipes may be used from any thread.
pub struct SluiceContext {
    ctx: Context,
}

impl SluiceContext {
    /// A context offering `transports` and `channels` (comma-separated names in priority
    /// order; `None` for the defaults: every transport and channel viable here).
    pub fn new(transports: Option<&str>, channels: Option<&str>) -> Result<SluiceContext> {
        Self::with_options(transports, channels, None)
    }

    /// As [`new`](Self::new), with `options`: comma-separated `key=value` pairs (see
    /// `sluice_context_new_with`).
    pub fn with_options(
        transports: Option<&str>,
        channels: Option<&str>,
        extra: Option<&str>,
    ) -> Result<SluiceContext> {
        let mut options = ContextOptions::default();
        for pair in extra.unwrap_or("").split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| Error::invalid(format!("option `{pair}` is not key=value")))?;
            let number = || {
                value
                    .trim()
                    .parse::<usize>()
                    .map_err(|_| Error::invalid(format!("option {key}: `{value}` is not a byte count")))
            };
            match key.trim() {
                "segment_bytes" => options.segment_bytes = number()?,
                "spin_us" => options.shm.spin = std::time::Duration::from_micros(number()? as u64),
                other => {
                    return Err(Error::invalid(format!(
                        "unknown option `{other}` (known: segment_bytes, spin_us)"
                    )))
                }
            }
        }
        if let Some(list) = transports {
            options.transports = parse(list, "transport", TransportKind::from_name, &["shm", "tcp", "ibv"])?;
        }
        if let Some(list) = channels {
            let known: Vec<&str> = ChannelKind::ALL.iter().map(|k| k.name()).collect();
            options.channels = parse(list, "channel", ChannelKind::from_name, &known)?;
        }
        let _entered = runtime::enter()?;
        Ok(SluiceContext {
            ctx: Context::new(options)?,
        })
    }

    /// The context itself.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Starts accepting pipes on `addr` (`host:port`; empty: 127.0.0.1 on a free port).
    pub fn listen(&self, addr: &str) -> Result<SluiceListener> {
        let listener = runtime::block_on(self.ctx.listen(addr))??;
        let address = CString::new(listener.address()).unwrap_or_default();
        Ok(SluiceListener {
            listener: Mutex::new(listener),
            address,
        })
    }

    /// Opens a pipe to the listener at `addr` (blocking, through negotiation).
    pub fn connect(&self, addr: &str) -> Result<SluicePipe> {
        let pipe = runtime::block_on(self.ctx.connect(addr))??;
        Ok(SluicePipe::new(pipe))
    }
}

/// Parses a comma-separated list of names.
fn parse<T>(list: &str, what: &str, from_name: impl Fn(&str) -> Option<T>, known: &[&str]) -> Result<Vec<T>> {
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            from_name(n).ok_or_else(|| Error::invalid(format!("unknown {what} `{n}` (known: {})", known.join(", "))))
        })
        .collect()
}

/// A listener accepting pipes on a TCP address (`sluice_listen`).
pub struct SluiceListener {
    listener: Mutex<PipeListener>,
    address: CString,
}

impl SluiceListener {
    /// The address clients connect to (`host:port`).
    pub fn address(&self) -> &CStr {
        &self.address
    }

    /// The next pipe (blocking), or the error of one incoming connection that failed (the
    /// listener keeps listening).
    pub fn accept(&self) -> Result<SluicePipe> {
        let pipe = runtime::block_on(async { self.listener.lock().await.accept().await })??;
        Ok(SluicePipe::new(pipe))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::SLUICE_INVALID_ARGUMENT;

    #[test]
    fn names_parse_and_unknown_ones_are_refused() {
        let t = parse(" tcp, shm ,", "transport", TransportKind::from_name, &[]).unwrap();
        assert_eq!(t, vec![TransportKind::Tcp, TransportKind::Shm]);
        let e = SluiceContext::new(Some("tcp,carrier-pigeon"), None).err().unwrap();
        assert_eq!(e.code, SLUICE_INVALID_ARGUMENT);
        assert!(e.message.contains("carrier-pigeon"), "{}", e.message);
        let e = SluiceContext::new(Some(""), None).err().unwrap();
        assert_eq!(e.code, SLUICE_INVALID_ARGUMENT, "{}", e.message);
    }
}
