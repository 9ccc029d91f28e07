//! Channels: what moves tensor bytes for one peer pair, and how each takes part in
//! negotiation.
//!
//! Each channel answers the same three questions the transports do: can it run here
//! ([`ChannelContext::viability`]), what it looks like from here, per device
//! ([`ChannelContext::device_descriptors`]), and whether it can reach a peer's device
//! ([`ChannelContext::can_communicate`]). The pipe compares and picks by priority; it never
//! special-cases a channel during negotiation.
//!
//! - **basic**: tensor bytes as frames on the pipe's control connection (whatever transport it
//!   negotiated). Works everywhere.
//! - **cma**: the receiver copies straight out of the sender's memory with `process_vm_readv`
//!   (one copy, no staging). Same host, same user, ptrace permission; probed at start-up and
//!   again against the actual peer at pipe setup.
//! - **multilane**: a large tensor is cut into equal contiguous pieces sent in parallel over N
//!   TCP connections, each driven by its own task (so by several cores).

pub mod cma;
pub mod multilane;

use crate::device::Device;

/// The channels Sluice knows, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChannelKind {
    Basic,
    Cma,
    MultiLane,
}

impl ChannelKind {
    pub const ALL: [ChannelKind; 3] = [ChannelKind::Cma, ChannelKind::MultiLane, ChannelKind::Basic];

    pub fn name(self) -> &'static str {
        match self {
            ChannelKind::Basic => "basic",
            ChannelKind::Cma => "cma",
            ChannelKind::MultiLane => "multilane",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl std::fmt::Display for ChannelKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A channel's negotiation hooks.
pub trait ChannelContext: Send + Sync {
    fn kind(&self) -> ChannelKind;

    /// `Ok` when the channel can run here; otherwise why not.
    fn viability(&self) -> Result<(), String>;

    /// One descriptor per device this channel serves here.
    fn device_descriptors(&self) -> Vec<(Device, String)>;

    /// Whether this channel on a local device described by `local` can move data to or from a
    /// remote device described by `remote`. Must be symmetric.
    fn can_communicate(&self, local: &str, remote: &str) -> bool {
        local == remote
    }
}

/// The basic channel: always viable, reaches every CPU.
pub struct BasicContext;

impl ChannelContext for BasicContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Basic
    }

    fn viability(&self) -> Result<(), String> {
        Ok(())
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        vec![(Device::Cpu, "any".to_owned())]
    }
}

/// The multi-lane channel's context: `lanes` TCP connections per pipe.
pub struct MultiLaneContext {
    pub lanes: usize,
}

impl ChannelContext for MultiLaneContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::MultiLane
    }

    fn viability(&self) -> Result<(), String> {
        if self.lanes == 0 {
            Err("configured with zero lanes".into())
        } else {
            Ok(())
        }
    }

    /// Lanes are TCP connections: any CPU that the bootstrap reached can be reached by lanes.
    fn device_descriptors(&self) -> Vec<(Device, String)> {
        vec![(Device::Cpu, "tcp".to_owned())]
    }
}
