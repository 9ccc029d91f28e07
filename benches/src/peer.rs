//! The benchmark's other side. One pipe listener is the entry point; the addresses of the raw
//! TCP, TCP-transport and shared-memory listeners are handed out over a pipe ("directory"), so
//! `--listen` on one host and `--connect` on another need only one address.
//!
//! Protocols, all driven by the client:
//! - transport connections: first frame `echo` (every later frame is sent back) or `sink`
//!   (frames are drained; an empty frame is answered with an empty frame);
//! - pipe messages: metadata `dir` (reply with addresses), `echo` (send the message back),
//!   `bw` (drain), `ack` (reply with an empty message);
//! - raw TCP: see [`crate::raw::serve_raw`].

use std::net::SocketAddr;

use bytes::Bytes;
use sluice_channel::{Allocation, Context, ContextOptions, Message, Pipe, RecvBuffer, SendBuffer, Tensor};
use sluice_transport::shm::ShmTransport;
use sluice_transport::tcp::TcpTransport;
use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport};

/// Largest frame the echo server accepts.
pub const MAX_FRAME: usize = 64 << 20;

/// Runs the peer until the process is killed. `ready` gets the pipe address once listening.
pub async fn serve(listen: &str, ready: impl FnOnce(&str)) -> anyhow::Result<()> {
    let ctx = Context::new(ContextOptions::default())?;
    let mut pipes = ctx.listen(listen).await?;
    let ip = pipes.address().parse::<SocketAddr>()?.ip();
    let any = SocketAddr::new(ip, 0).to_string();
    // Busy polling (shared memory only): a second pipe listener and shm listener that never park.
    let busy = crate::run::busy_shm();
    let busy_ctx = Context::new(ContextOptions {
        shm: busy.clone(),
        ..ContextOptions::default()
    })?;
    let mut busy_pipes = busy_ctx.listen(&any).await?;
    let tcp = TcpTransport::default();
    let mut tcp_listener = tcp.listen(&any).await?;
    let listen_shm = |shm: ShmTransport| async move {
        match shm.listen("").await {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("shm transport unavailable: {e}");
                None
            }
        }
    };
    let mut shm_listener = listen_shm(ShmTransport::default()).await;
    let mut shm_busy_listener = listen_shm(ShmTransport::new(busy)).await;
    let raw = tokio::net::TcpListener::bind(&any).await?;
    let directory = format!(
        "tcp={};shm={};raw={};busy={};shmbusy={}",
        tcp_listener.address(),
        shm_listener.as_ref().map(|l| l.address()).unwrap_or_default(),
        raw.local_addr()?,
        busy_pipes.address(),
        shm_busy_listener.as_ref().map(|l| l.address()).unwrap_or_default(),
    );
    tokio::spawn(async move {
        while let Ok(c) = tcp_listener.accept().await {
            tokio::spawn(serve_transport(c));
        }
    });
    for mut l in [shm_listener.take(), shm_busy_listener.take()].into_iter().flatten() {
        tokio::spawn(async move {
            while let Ok(c) = l.accept().await {
                tokio::spawn(serve_transport(c));
            }
        });
    }
    {
        let directory = directory.clone();
        tokio::spawn(async move {
            while let Ok(pipe) = busy_pipes.accept().await {
                tokio::spawn(serve_pipe(pipe, directory.clone()));
            }
        });
    }
    tokio::spawn(async move {
        while let Ok((s, _)) = raw.accept().await {
            tokio::spawn(async move {
                let _ = crate::raw::serve_raw(s).await;
            });
        }
    });
    ready(pipes.address());
    loop {
        match pipes.accept().await {
            Ok(pipe) => {
                let directory = directory.clone();
                tokio::spawn(async move {
                    let _ = serve_pipe(pipe, directory).await;
                });
            }
            Err(e) => eprintln!("bench peer: incoming pipe failed: {e}"),
        }
    }
}

/// A frame buffer for one transport connection, from a process-wide pool and back to it when
/// the connection ends. A fresh 64 MiB buffer per connection faulted its pages in during the
/// client's timed stream (the bench opens a connection per row and slice).
struct FrameBuffer(Vec<u8>);

static SPARE: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

impl FrameBuffer {
    fn take() -> FrameBuffer {
        let spare = SPARE.lock().unwrap_or_else(|p| p.into_inner()).pop();
        FrameBuffer(spare.unwrap_or_else(|| vec![0u8; MAX_FRAME]))
    }
}

impl Drop for FrameBuffer {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        SPARE.lock().unwrap_or_else(|p| p.into_inner()).push(buf);
    }
}

async fn serve_transport<C: Connection>(conn: C) -> anyhow::Result<()> {
    let (mut r, mut w) = conn.split();
    let mode = r.read_vec(16).await?;
    let mut frame = FrameBuffer::take();
    let buf = &mut frame.0;
    match &mode[..] {
        b"echo" => loop {
            let n = r.read(buf).await?;
            w.write(&[&buf[..n]]).await?;
        },
        b"sink" => loop {
            if r.read(buf).await? == 0 {
                w.write(&[]).await?;
            }
        },
        other => anyhow::bail!("unknown transport mode {other:?}"),
    }
}

async fn serve_pipe(pipe: Pipe, directory: String) -> anyhow::Result<()> {
    let mut spare: Option<Allocation> = None;
    let mut echo = Message::default();
    loop {
        let (d, mut got) = pipe
            .read_message(|d| {
                // Reuse the previous message's memory when the shape matches: no page faults.
                let fits = |a: &Allocation| {
                    a.payloads.len() == d.payload_lengths.len()
                        && a.payloads
                            .iter()
                            .zip(&d.payload_lengths)
                            .all(|(p, &n)| p.len() as u64 == n)
                        && a.tensors.len() == d.tensors.len()
                        && a.tensors
                            .iter()
                            .zip(&d.tensors)
                            .all(|(b, t)| b.len() as u64 == t.length)
                };
                Ok(match spare.take() {
                    Some(a) if fits(&a) => a,
                    _ => Allocation::for_descriptor(d),
                })
            })
            .await?;
        match &d.metadata[..] {
            b"dir" => {
                pipe.write(&Message {
                    metadata: Bytes::from(directory.clone()),
                    ..Message::default()
                })
                .await?;
                spare = Some(got);
            }
            b"echo" => {
                // The received buffers go back as they are, and come back for the next message
                // once written: like the transport's echo, this allocates nothing per message,
                // so the round trip measures the pipe and not the echo.
                echo.metadata = Bytes::from_static(b"echo");
                echo.tensors
                    .extend(got.tensors.drain(..).filter_map(|t| t.into_cpu()).map(Tensor::cpu));
                let written = pipe.write(&echo).await;
                // The write is complete, so the pipe holds no reference: take the memory back
                // (memory the pipe lent, a shared segment, goes back to the sender instead).
                for t in echo.tensors.drain(..) {
                    if let SendBuffer::Cpu(b) = t.buffer {
                        if let Ok(b) = b.try_into_mut() {
                            got.tensors.push(RecvBuffer::Cpu(b));
                        }
                    }
                }
                written?;
                if got.tensors.len() == d.tensors.len() {
                    spare = Some(got);
                }
            }
            b"ack" => pipe.write(&Message::default()).await?,
            _ => spare = Some(got),
        }
    }
}
