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

#[cfg(test)]
mod tests {
    /// Modules above the parts: the hub, the drivers and the public handle.
    const ABOVE: [&str; 6] = [
        "crate::hub",
        "crate::agent",
        "crate::client",
        "crate::server",
        "crate::peers",
        "crate::lifecycle",
    ];

    /// Code lines of a source file (comments may name any module).
    fn code(src: &str) -> impl Iterator<Item = &str> {
        src.lines().filter(|l| !l.trim_start().starts_with("//"))
    }

    /// The rule that keeps the agent's dependencies a tree: the parts use none of the modules
    /// above them, and the hub uses the parts, not the drivers or the public handle.
    #[test]
    fn dependencies_point_one_way() {
        for (file, src) in [
            ("parts/client.rs", include_str!("client.rs")),
            ("parts/server.rs", include_str!("server.rs")),
            ("parts/peers.rs", include_str!("peers.rs")),
        ] {
            for line in code(src) {
                for above in ABOVE {
                    assert!(!line.contains(above), "{file} uses {above}: {line}");
                }
            }
        }
        for line in code(include_str!("../hub.rs")) {
            for above in &ABOVE[1..] {
                assert!(!line.contains(above), "hub.rs uses {above}: {line}");
            }
        }
    }
}
