//! The peer process of Sluice's multi-process tests. Each mode does one thing the test in the
//! parent process needs a separate process for (so it can be killed, or hold its own memory).
//!
//! Usage:
//! - `sluice-test-peer transport <tcp|shm|ibv> ADDR <stream|stall>`
//! - `sluice-test-peer pipe-echo ADDR CHANNEL,CHANNEL,... [TRANSPORT,... [SEGMENT_BYTES]]` (or
//!   `pipe-echo-cuda`): receive every message into memory on the devices it names (GPU memory
//!   on a stream of this process) and send it back to the devices its tensors came from,
//!   without touching the host.

use sluice_transport::ibv::IbvTransport;
use sluice_transport::shm::ShmTransport;
use sluice_transport::tcp::TcpTransport;
use sluice_transport::{Connection, FrameWriter, Transport};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["transport", "tcp", addr, mode] => transport_mode(TcpTransport::default(), addr, mode).await,
        ["transport", "shm", addr, mode] => transport_mode(ShmTransport::default(), addr, mode).await,
        ["transport", "ibv", addr, mode] => transport_mode(IbvTransport::default(), addr, mode).await,
        ["pipe-echo" | "pipe-echo-cuda", addr, channels] => pipe_echo(addr, channels, None, None).await,
        ["pipe-echo" | "pipe-echo-cuda", addr, channels, transports] => {
            pipe_echo(addr, channels, Some(transports), None).await
        }
        ["pipe-echo" | "pipe-echo-cuda", addr, channels, transports, segment] => {
            let segment = segment.parse().expect("segment bytes");
            pipe_echo(addr, channels, Some(transports), Some(segment)).await
        }
        _ => {
            eprintln!("usage: sluice-test-peer transport <tcp|shm|ibv> ADDR <stream|stall> | pipe-echo ADDR CHANNEL");
            std::process::exit(2);
        }
    }
}

async fn transport_mode<T: Transport>(t: T, addr: &str, mode: &str) {
    let conn = t.connect(addr).await.expect("peer connect");
    let (mut r, mut w) = conn.split();
    match mode {
        // Write 1 MiB frames until killed (or the connection fails).
        "stream" => {
            let frame = vec![5u8; 1 << 20];
            while w.write(&[&frame]).await.is_ok() {}
        }
        // Never read: the parent's writes back up. Wait to be killed.
        "stall" => {
            let _keep = (&mut r, &mut w);
            std::future::pending::<()>().await;
        }
        _ => panic!("unknown mode {mode}"),
    }
}

/// Echoes every message back to the devices its tensors came from, receiving GPU tensors into
/// memory on streams of this process.
async fn pipe_echo(addr: &str, channels: &str, transports: Option<&str>, segment: Option<usize>) {
    use sluice_channel::cuda::Stream;
    use sluice_channel::{Allocation, ChannelKind, Context, ContextOptions, Message, Tensor, TransportKind};
    let channels = channels
        .split(',')
        .map(|c| ChannelKind::from_name(c).expect("channel name"))
        .collect();
    let defaults = ContextOptions::default();
    let transports = match transports {
        Some(list) => list
            .split(',')
            .map(|t| TransportKind::from_name(t).expect("transport name"))
            .collect(),
        None => defaults.transports.clone(),
    };
    let ctx = Context::new(ContextOptions {
        channels,
        transports,
        segment_bytes: segment.unwrap_or(defaults.segment_bytes),
        ..defaults
    })
    .expect("context");
    let pipe = ctx.connect(addr).await.expect("peer connect");
    // One stream per device, reused: the echo must not depend on a synchronize.
    let mut streams: std::collections::HashMap<u32, Stream> = Default::default();
    loop {
        let Ok(d) = pipe.read_descriptor().await else { return };
        let alloc = Allocation::try_for_descriptor(&d, |i| {
            if let Some(s) = streams.get(&i) {
                return Ok(s.clone());
            }
            let s = Stream::new(i)?;
            streams.insert(i, s.clone());
            Ok(s)
        })
        .expect("allocation");
        let Ok(got) = pipe.read(alloc).await else { return };
        let back = Message {
            metadata: d.metadata.clone(),
            payloads: got.payloads.into_iter().map(|p| p.freeze()).collect(),
            tensors: got
                .tensors
                .into_iter()
                .zip(&d.tensors)
                .map(|(t, desc)| Tensor {
                    buffer: t.freeze(),
                    metadata: desc.metadata.clone(),
                    target_device: Some(desc.source_device),
                })
                .collect(),
        };
        if pipe.write(&back).await.is_err() {
            return;
        }
    }
}
