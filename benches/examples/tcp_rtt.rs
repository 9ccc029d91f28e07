//! Where the TCP transport's small-message round trip goes, against raw tokio TCP: the same
//! 64-byte ping-pong over (a) one TcpStream, (b) its split halves, (c) the framed transport,
//! each echoed by a second process (this binary with `echo`), alternating, several rounds.
use std::time::{Duration, Instant};

use sluice_transport::tcp::TcpTransport;
use sluice_transport::{Connection, FrameReader, FrameWriter, Listener, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const N: usize = 64;

fn p50(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("echo") {
        let raw = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let t = TcpTransport::default();
        let mut framed = t.listen("127.0.0.1:0").await?;
        println!("{} {}", raw.local_addr()?, framed.address());
        tokio::spawn(async move {
            loop {
                let (mut s, _) = raw.accept().await.unwrap();
                s.set_nodelay(true).unwrap();
                tokio::spawn(async move {
                    let mut b = [0u8; N];
                    while s.read_exact(&mut b).await.is_ok() {
                        if s.write_all(&b).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        loop {
            let c = framed.accept().await?;
            tokio::spawn(async move {
                let (mut r, mut w) = c.split();
                let mut b = vec![0u8; 1 << 20];
                while let Ok(n) = r.read(&mut b).await {
                    if w.write(&[&b[..n]]).await.is_err() {
                        break;
                    }
                }
            });
        }
    }
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .arg("echo")
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line)?;
    let mut it = line.split_whitespace();
    let (raw_addr, framed_addr) = (it.next().unwrap().to_owned(), it.next().unwrap().to_owned());
    let budget = Duration::from_millis(300);
    for round in 0..3 {
        // (a) one stream
        let mut s = tokio::net::TcpStream::connect(&raw_addr).await?;
        s.set_nodelay(true)?;
        let out = [7u8; N];
        let mut back = [0u8; N];
        let mut a = Vec::new();
        let t = Instant::now();
        while t.elapsed() < budget {
            let t0 = Instant::now();
            s.write_all(&out).await?;
            s.read_exact(&mut back).await?;
            a.push(t0.elapsed().as_nanos() as f64);
        }
        // (b) split halves
        let s = tokio::net::TcpStream::connect(&raw_addr).await?;
        s.set_nodelay(true)?;
        let (mut r, mut w) = s.into_split();
        let mut b = Vec::new();
        let t = Instant::now();
        while t.elapsed() < budget {
            let t0 = Instant::now();
            w.write_all(&out).await?;
            r.read_exact(&mut back).await?;
            b.push(t0.elapsed().as_nanos() as f64);
        }
        // (c) the framed transport
        let c = TcpTransport::default().connect(&framed_addr).await?;
        let (mut r, mut w) = c.split();
        let mut got = vec![0u8; N];
        let mut f = Vec::new();
        let t = Instant::now();
        while t.elapsed() < budget {
            let t0 = Instant::now();
            w.write(&[&out]).await?;
            r.read(&mut got).await?;
            f.push(t0.elapsed().as_nanos() as f64);
        }
        println!(
            "round {round}: stream {:.1} us, split {:.1} us, framed {:.1} us (n = {}, {}, {})",
            p50(a.clone()) / 1e3,
            p50(b.clone()) / 1e3,
            p50(f.clone()) / 1e3,
            a.len(),
            b.len(),
            f.len()
        );
    }
    let _ = child.kill();
    Ok(())
}
