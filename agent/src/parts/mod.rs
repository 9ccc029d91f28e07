//! Each part's own state, as a struct of its own: [`client::Client`], [`server::Server`],
//! [`peers::Peers`]. What a part does with its state alone is a method here; what crosses parts
//! is an `impl AgentInner` in the part's driver module (`crate::client`, `crate::server`,
//! `crate::peers`, `crate::lifecycle`).
//!
//! The rule that keeps the dependencies a tree: nothing under `parts` uses the hub
//! ([`crate::hub`]), the drivers or the public handle ([`crate::agent`]); they use only leaf
//! modules (calls, wire, store, membership, ...). The hub composes the parts; the drivers use
//! the hub and the parts; the public handle uses the hub and the drivers.

pub(crate) mod client;
pub(crate) mod peers;
pub(crate) mod server;
