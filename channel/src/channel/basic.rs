//! The basic channel: a tensor's bytes as one frame on the pipe's control connection, after
//! the message's payloads, over whatever transport the pipe negotiated. Works everywhere and
//! is the fallback every pair of CPUs shares. (cma and rdma send their small tensors the same
//! way: [`Source::Inline`](crate::wire::Source::Inline).)

use bytes::{Bytes, BytesMut};

use super::path::{self, Link, Rx, Tx};
use super::{ChannelContext, ChannelKind};
use crate::device::Device;
use crate::error::Result;

/// The basic channel's context: always viable, reaches every CPU.
pub struct BasicContext;

impl ChannelContext for BasicContext {
    fn kind(&self) -> ChannelKind {
        ChannelKind::Basic
    }

    fn viability(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    fn device_descriptors(&self) -> Vec<(Device, String)> {
        vec![(Device::Cpu, "any".to_owned())]
    }
}

/// Sender: the tensor as one frame, held for the message's single transport write.
pub(crate) async fn send(tx: &mut Tx, bytes: &Bytes) -> Result<()> {
    path::send_inline(tx, bytes).await
}

/// Receiver: the frame, straight into the receiver's buffer.
pub(crate) async fn recv(rx: &mut Rx, link: &Link<'_>, dst: &mut BytesMut) -> Result<()> {
    path::recv_inline(&mut rx.control, link, dst).await
}
