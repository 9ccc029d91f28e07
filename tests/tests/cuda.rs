//! CUDA through the pipe.
//!
//! Without a GPU (CI, the development machines): the CUDA channels are not offered, CPU work is
//! untouched, a tensor for a device the peer cannot be reached on is refused without breaking
//! the pipe, and allocating GPU memory fails with the reason.
//!
//! With a GPU (`scripts/gpu-check.sh`): default negotiation picks cuda_ipc for one GPU, and a
//! slice of an allocation travels from its offset. The CUDA channels' conformance (every
//! channel and device pair one GPU allows, in both directions and with real peer processes,
//! each checking stream order) is the channel conformance suite (`channel_conformance.rs`).

use bytes::Bytes;
use sluice_channel::cuda;
use sluice_channel::{Allocation, ChannelKind, Context, ContextOptions, Device, Message, Pipe, PipeError, Tensor};
use sluice_tests::gpu::{gpu_or_skip, without_driver_or_skip};
use sluice_tests::{watchdog, PeerProcess};

fn peer() -> String {
    sluice_tests::peer_exe(env!("CARGO_BIN_EXE_sluice-test-peer"))
}

async fn pair_with(opts: ContextOptions) -> (Pipe, Pipe) {
    sluice_tests::pipe_pair(opts).await
}

// ---- Without a GPU: the not-viable paths (these run everywhere) ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cuda_the_gpu_channels_are_not_offered_and_cpu_work_is_untouched() {
    if !without_driver_or_skip("without_cuda_the_gpu_channels_are_not_offered_and_cpu_work_is_untouched") {
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
    if !without_driver_or_skip("gpu_memory_without_cuda_is_an_error_with_the_reason") {
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

// ---- With a GPU ----
// Every CUDA channel's conformance (both directions, stream order, real peer processes) is in
// `channel_conformance.rs`; what is particular to CUDA stays here.

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

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
