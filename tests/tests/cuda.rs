//! CUDA through the pipe.
//!
//! Without a GPU (CI, the development machines): the CUDA channels are not offered, CPU work is
//! untouched, a tensor for a device the peer cannot be reached on is refused without breaking
//! the pipe, and allocating GPU memory fails with the reason.
//!
//! With a GPU (`scripts/gpu-check.sh`): the CUDA channel conformance exercise for every channel
//! and device pair one GPU allows (cuda_ipc within a process and across processes, cuda_p2p in
//! loopback, cuda_staged GPU↔GPU, GPU↔CPU over TCP and shared memory), each checking stream
//! order: every GPU source is filled by an asynchronous memset the sender never waits for.

use bytes::Bytes;
use sluice_channel::cuda;
use sluice_channel::{
    Allocation, ChannelKind, Context, ContextOptions, Device, Message, Pipe, PipeError, Tensor, TransportKind,
};
use sluice_tests::gpu::{exercise, gpu_or_skip, receive_and_check, Route};
use sluice_tests::{watchdog, PeerProcess};

fn peer() -> String {
    sluice_tests::peer_exe(env!("CARGO_BIN_EXE_sluice-test-peer"))
}

fn options(transports: &[TransportKind], channels: &[ChannelKind], loopback: bool) -> ContextOptions {
    ContextOptions {
        transports: transports.to_vec(),
        channels: channels.to_vec(),
        cuda_p2p_loopback: loopback,
        ..ContextOptions::default()
    }
}

async fn pair_with(opts: ContextOptions) -> (Pipe, Pipe) {
    sluice_tests::pipe_pair(opts).await
}

// ---- Without a GPU: the not-viable paths (these run everywhere) ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cuda_the_gpu_channels_are_not_offered_and_cpu_work_is_untouched() {
    if cuda::available() {
        eprintln!("SKIPPED: this machine has a GPU; the no-GPU path is checked in CI");
        return;
    }
    watchdog("no cuda", async {
        let ctx = Context::new(ContextOptions::default()).unwrap();
        let offered = ctx.channels();
        assert!(!offered.contains(&ChannelKind::CudaIpc), "{offered:?}");
        assert!(!offered.contains(&ChannelKind::CudaP2p), "{offered:?}");
        // Staging stays, for this process's CPU only: a GPU peer may still send us its tensors.
        assert!(offered.contains(&ChannelKind::CudaStaged), "{offered:?}");
        let (a, b) = pair_with(ContextOptions::default()).await;
        assert_eq!(a.info().channels, vec![(Device::Cpu, Device::Cpu, ChannelKind::Cma)]);
        let m = Message {
            metadata: Bytes::from_static(b"cpu"),
            payloads: vec![],
            tensors: vec![Tensor::cpu(vec![7u8; 5000])],
        };
        let w = tokio::spawn({
            let a = a.clone();
            async move { a.write(&m).await }
        });
        let d = b.read_descriptor().await.unwrap();
        let got = b.read(Allocation::for_descriptor(&d)).await.unwrap();
        w.await.unwrap().unwrap();
        assert_eq!(got.tensors[0].as_cpu().unwrap(), &[7u8; 5000][..]);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tensor_for_an_unreachable_device_is_refused_and_the_pipe_goes_on() {
    watchdog("unreachable device", async {
        let (a, b) = pair_with(ContextOptions::default()).await;
        let refused = Message {
            tensors: vec![Tensor {
                buffer: Bytes::from_static(b"x").into(),
                metadata: Bytes::new(),
                target_device: Some(Device::Cuda(99)),
            }],
            ..Message::default()
        };
        match a.write(&refused).await {
            Err(PipeError::Misuse(why)) => {
                assert!(why.contains("no channel connects cpu here to cuda:99 there"), "{why}")
            }
            other => panic!("expected a misuse error, got {other:?}"),
        }
        assert!(a.error().is_none(), "a refused tensor must not break the pipe");
        let ok = Message {
            metadata: Bytes::from_static(b"after"),
            ..Message::default()
        };
        a.write(&ok).await.unwrap();
        let d = b.read_descriptor().await.unwrap();
        assert_eq!(&d.metadata[..], b"after");
        b.read(Allocation::for_descriptor(&d)).await.unwrap();
    })
    .await
}

#[test]
fn gpu_memory_without_cuda_is_an_error_with_the_reason() {
    if cuda::available() {
        eprintln!("SKIPPED: this machine has a GPU");
        return;
    }
    let e = cuda::Stream::new(0).expect_err("no GPU");
    assert!(e.to_string().contains("CUDA is not available"), "{e}");
    let d = sluice_channel::Descriptor {
        metadata: Bytes::new(),
        payload_lengths: vec![],
        tensors: vec![sluice_channel::TensorDescriptor {
            length: 16,
            source_device: Device::Cuda(0),
            target_device: Some(Device::Cuda(0)),
            metadata: Bytes::new(),
            arrives_shared: false,
        }],
    };
    let e = Allocation::try_for_descriptor(&d, cuda::Stream::new).expect_err("no GPU");
    assert!(e.to_string().contains("CUDA is not available"), "{e}");
}

// ---- With a GPU: the CUDA channel conformance exercise ----

const COUNT: u64 = 12;

fn sizes() -> Vec<usize> {
    use sluice_channel::cuda::staged::CHUNK;
    vec![1, 4099, CHUNK + 3, 3 * CHUNK + 1]
}

fn routes(from: Device, to: Device) -> Vec<Route> {
    let mut r: Vec<Route> = sizes().into_iter().map(|len| Route { from, to, len }).collect();
    // A CPU tensor rides along in every message, on the CPU channel.
    r.push(Route {
        from: Device::Cpu,
        to: Device::Cpu,
        len: 3000,
    });
    r
}

async fn in_process(channel: ChannelKind, transport: TransportKind, from: Device, to: Device, loopback: bool) {
    let opts = options(&[transport], &[ChannelKind::Basic, channel], loopback);
    let (a, b) = pair_with(opts).await;
    assert_eq!(a.info().channel(from, to), Some(channel), "{:?}", a.info().channels);
    exercise(a, b, routes(from, to), COUNT).await;
}

macro_rules! gpu_test {
    ($name:ident, $channel:expr, $transport:expr, $from:expr, $to:expr, $loopback:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            if !gpu_or_skip(stringify!($name)) {
                return;
            }
            watchdog(
                stringify!($name),
                in_process($channel, $transport, $from, $to, $loopback),
            )
            .await
        }
    };
}

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

gpu_test!(
    cuda_ipc_within_a_process,
    ChannelKind::CudaIpc,
    TransportKind::Shm,
    GPU,
    GPU,
    false
);
gpu_test!(
    cuda_p2p_loopback_within_a_process,
    ChannelKind::CudaP2p,
    TransportKind::Shm,
    GPU,
    GPU,
    true
);
gpu_test!(
    cuda_staged_gpu_to_gpu_over_tcp,
    ChannelKind::CudaStaged,
    TransportKind::Tcp,
    GPU,
    GPU,
    false
);
gpu_test!(
    cuda_staged_gpu_to_gpu_over_shm,
    ChannelKind::CudaStaged,
    TransportKind::Shm,
    GPU,
    GPU,
    false
);
gpu_test!(
    cuda_staged_gpu_to_cpu,
    ChannelKind::CudaStaged,
    TransportKind::Tcp,
    GPU,
    CPU,
    false
);
gpu_test!(
    cuda_staged_cpu_to_gpu,
    ChannelKind::CudaStaged,
    TransportKind::Shm,
    CPU,
    GPU,
    false
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_negotiation_picks_cuda_ipc_for_the_same_gpu() {
    if !gpu_or_skip("default_negotiation_picks_cuda_ipc_for_the_same_gpu") {
        return;
    }
    watchdog("default cuda negotiation", async {
        let (a, _b) = pair_with(ContextOptions::default()).await;
        let info = a.info();
        assert_eq!(
            info.channel(GPU, GPU),
            Some(ChannelKind::CudaIpc),
            "{:?}",
            info.channels
        );
        assert_eq!(info.channel(GPU, CPU), Some(ChannelKind::CudaStaged));
        assert_eq!(info.channel(CPU, GPU), Some(ChannelKind::CudaStaged));
        assert_eq!(info.channel(CPU, CPU), Some(ChannelKind::Cma));
    })
    .await
}

/// A real second process: GPU tensors go there and come back (IPC handles both ways), then the
/// peer is killed while we wait and the wait fails promptly with a peer-lost error.
async fn echo_with_gpu_peer(channel: ChannelKind) {
    let ctx = Context::new(options(
        &[TransportKind::Shm, TransportKind::Tcp],
        &[ChannelKind::Cma, ChannelKind::Basic, channel],
        false,
    ))
    .unwrap();
    let mut listener = ctx.listen("").await.unwrap();
    let list = format!("cma,basic,{}", channel.name());
    let mut peer = PeerProcess::spawn(&peer(), &["pipe-echo-cuda", listener.address(), &list]);
    let pipe = listener.accept().await.expect("peer pipe");
    assert_eq!(
        pipe.info().channel(GPU, GPU),
        Some(channel),
        "{:?}",
        pipe.info().channels
    );
    let routes = routes(GPU, GPU);
    let writer = tokio::spawn({
        let pipe = pipe.clone();
        let routes = routes.clone();
        async move {
            for seq in 0..COUNT {
                let m = sluice_tests::gpu::message(seq, &routes, &|d| cuda::Stream::new(d).unwrap());
                pipe.write(&m).await.unwrap();
            }
        }
    });
    for seq in 0..COUNT {
        let got = receive_and_check(&pipe, &routes, &|d| cuda::Stream::new(d).unwrap()).await;
        assert_eq!(got, seq);
    }
    writer.await.unwrap();
    let pending = tokio::spawn({
        let pipe = pipe.clone();
        async move { pipe.read_descriptor().await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    peer.kill();
    let err = pending.await.unwrap().expect_err("peer killed");
    assert!(err.is_peer_lost(), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_ipc_with_a_real_peer_process() {
    if !gpu_or_skip("cuda_ipc_with_a_real_peer_process") {
        return;
    }
    watchdog("cuda ipc peer", echo_with_gpu_peer(ChannelKind::CudaIpc)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_staged_with_a_real_peer_process() {
    if !gpu_or_skip("cuda_staged_with_a_real_peer_process") {
        return;
    }
    watchdog("cuda staged peer", echo_with_gpu_peer(ChannelKind::CudaStaged)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_slice_travels_from_its_offset() {
    // IPC handles name allocations; a tensor in the middle of one must arrive from its offset.
    if !gpu_or_skip("a_buffer_slice_travels_from_its_offset") {
        return;
    }
    watchdog("slice offset", async {
        let ctx = Context::new(ContextOptions::default()).unwrap();
        let mut listener = ctx.listen("").await.unwrap();
        let mut _peer = PeerProcess::spawn(&peer(), &["pipe-echo-cuda", listener.address(), "cma,cuda_ipc"]);
        let pipe = listener.accept().await.unwrap();
        let stream = cuda::Stream::new(0).unwrap();
        let whole = cuda::CudaBuffer::alloc(1 << 20, &stream).unwrap();
        let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
        whole.write_from_host(&data).unwrap();
        let part = whole.slice(4096 + 3..(1 << 19)).unwrap();
        pipe.write(&Message {
            tensors: vec![Tensor::cuda(part, GPU)],
            ..Message::default()
        })
        .await
        .unwrap();
        let d = pipe.read_descriptor().await.unwrap();
        let got = pipe
            .read(Allocation::try_for_descriptor(&d, |_| Ok(stream.clone())).unwrap())
            .await
            .unwrap();
        let back = got.tensors[0].as_cuda().unwrap().read_to_host().unwrap();
        assert_eq!(back, data[4096 + 3..1 << 19]);
    })
    .await
}
