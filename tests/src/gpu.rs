//! GPU test helpers: the gate every GPU test passes first, and the CUDA channel conformance
//! exercise (what every CUDA channel must do, for any pair of devices).
//!
//! CI and the development machines have no GPU, so GPU tests print `SKIPPED` with the reason
//! and pass. On the GPU machine `scripts/gpu-check.sh` sets `SLUICE_REQUIRE_GPU=1`, which turns
//! a missing GPU into a failure: a check that silently skipped there would prove nothing. The
//! gate is `sluice_cuda::gate` (one for every crate, re-exported here).

use bytes::Bytes;
use sluice_channel::cuda::{CudaBuffer, Stream};
use sluice_channel::{Allocation, Device, Message, Pipe, RecvBuffer, SendBuffer, Tensor};

use crate::pattern;

pub use sluice_channel::cuda::gate::{
    compute_or_skip, gpu_or_skip, report as report_skip, require, skipped, without_driver_or_skip, SKIP_LOG,
};

/// One tensor of a test message: where it starts and where it should land.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    pub from: Device,
    pub to: Device,
    pub len: usize,
}

/// The byte every position of tensor `i` of message `seq` holds: GPU tensors are filled on the
/// device (so the fill is queued on the sender's stream, not finished, when the write starts).
pub fn fill_byte(seq: u64, i: usize) -> u8 {
    (seq as u8).wrapping_mul(31).wrapping_add(i as u8).wrapping_add(1)
}

/// Builds message `seq`. GPU sources are allocated on `stream`'s device, set to a stale value
/// and synchronized, then filled with [`fill_byte`] by an asynchronous memset that is *not*
/// waited for: the pipe must order its read after it.
pub fn message(seq: u64, routes: &[Route], streams: &dyn Fn(u32) -> Stream) -> Message {
    let tensors = routes
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let buffer = match r.from {
                Device::Cuda(d) => {
                    let b = CudaBuffer::alloc(r.len, &streams(d)).expect("alloc");
                    b.write_from_host(&vec![0xee; r.len]).expect("stale fill");
                    b.fill(fill_byte(seq, i)).expect("fill");
                    SendBuffer::Cuda(b)
                }
                _ => SendBuffer::Cpu(Bytes::from(vec![fill_byte(seq, i); r.len])),
            };
            Tensor {
                buffer,
                metadata: Bytes::new(),
                target_device: Some(r.to),
            }
        })
        .collect();
    Message {
        metadata: Bytes::from(format!("message {seq}")),
        payloads: vec![Bytes::from(pattern(seq, 17))],
        tensors,
    }
}

/// Receives one message into memory on the devices it names (GPU memory ordered by
/// `streams`), checks every byte after synchronizing through the receiver's stream only, and
/// returns the sequence number its metadata names.
pub async fn receive_and_check(pipe: &Pipe, routes: &[Route], streams: &(dyn Fn(u32) -> Stream + Sync)) -> u64 {
    let d = pipe.read_descriptor().await.expect("descriptor");
    let seq: u64 = String::from_utf8_lossy(&d.metadata)
        .strip_prefix("message ")
        .and_then(|s| s.parse().ok())
        .expect("sequence in metadata");
    for (t, r) in d.tensors.iter().zip(routes) {
        assert_eq!(t.source_device, r.from, "message {seq}: source device");
        assert_eq!(t.target_device, Some(r.to), "message {seq}: target device");
    }
    let alloc = Allocation::try_for_descriptor(&d, |i| Ok(streams(i))).expect("allocation");
    let got = pipe.read(alloc).await.expect("read");
    check_received(seq, routes, &got);
    seq
}

/// Checks what [`message`]`(seq, routes, ..)` should have delivered, reading GPU memory back
/// after synchronizing through the receiver's stream only.
pub fn check_received(seq: u64, routes: &[Route], got: &Allocation) {
    assert_eq!(&got.payloads[0][..], &pattern(seq, 17)[..]);
    assert_eq!(got.tensors.len(), routes.len(), "message {seq}: tensor count");
    for (i, (t, r)) in got.tensors.iter().zip(routes).enumerate() {
        let bytes = match t {
            RecvBuffer::Cuda(b) => {
                assert_eq!(Device::Cuda(b.device()), r.to);
                b.read_to_host().expect("read back")
            }
            RecvBuffer::Cpu(b) => b.to_vec(),
            RecvBuffer::Shared(b) => b.to_vec(),
            other => panic!("unexpected buffer {other:?}"),
        };
        assert_eq!(bytes.len(), r.len, "message {seq} tensor {i}: length");
        let want = fill_byte(seq, i);
        if let Some(pos) = bytes.iter().position(|&b| b != want) {
            panic!(
                "message {seq} tensor {i} ({} -> {}, {} bytes): byte {pos} is {:#x}, expected {want:#x} (read before the sender's stream finished?)",
                r.from, r.to, r.len, bytes[pos]
            );
        }
    }
}

/// Both directions at once, `count` messages each way, in order and intact: the conformance
/// exercise for a CUDA channel. `routes` are as seen from `a` (b sends them mirrored).
pub async fn exercise(a: Pipe, b: Pipe, routes: Vec<Route>, count: u64) {
    let mirrored: Vec<Route> = routes
        .iter()
        .map(|r| Route {
            from: r.to,
            to: r.from,
            len: r.len,
        })
        .collect();
    let send = |p: Pipe, routes: Vec<Route>| {
        tokio::spawn(async move {
            for seq in 0..count {
                let m = message(seq, &routes, &|d| Stream::new(d).expect("stream"));
                p.write(&m).await.expect("write");
            }
        })
    };
    let recv = |p: Pipe, routes: Vec<Route>| {
        tokio::spawn(async move {
            for seq in 0..count {
                let got = receive_and_check(&p, &routes, &|d| Stream::new(d).expect("stream")).await;
                assert_eq!(got, seq, "messages out of order");
            }
        })
    };
    let tasks = [
        send(a.clone(), routes.clone()),
        send(b.clone(), mirrored.clone()),
        recv(b, routes),
        recv(a, mirrored),
    ];
    for t in tasks {
        t.await.expect("exercise task");
    }
}
