//! CUDA tensors through the agent and distributed autograd, between two real processes on one
//! GPU: requests mapped by the caller's device map, responses reverse-mapped, stream order with
//! no explicit synchronize anywhere on the path, CPU↔GPU maps, the missing-map error, RRefs
//! owned on a GPU, a distributed backward across a device map, and remote tensors placed on the
//! owner's GPU.
//!
//! Each worker skips (printing why) without a GPU and fails under `SLUICE_REQUIRE_GPU=1`,
//! which `scripts/gpu-check.sh` sets.

use std::time::Duration;

use sluice_agent::{Agent, CallContext, HandlerError, Payload, Registry, RpcError};
use sluice_autograd::dist::{self, Context};
use sluice_autograd::{DType, Tensor as AgTensor};
use sluice_channel::cuda::{CudaBuffer, Stream};
use sluice_channel::{Device, SendBuffer, Tensor};
use sluice_tests::gpu::gpu_or_skip;
use sluice_tests::worker_test;
use sluice_tests::workers::WorkerEnv;

const GPU: Device = Device::Cuda(0);

fn he(e: impl std::fmt::Display) -> HandlerError {
    HandlerError::new("Error", e.to_string())
}

/// The i-th tensor of a payload as a CUDA buffer (panics otherwise).
fn cuda(p: &Payload, i: usize) -> CudaBuffer {
    match &p.tensors[i].buffer {
        SendBuffer::Cuda(b) => b.clone(),
        other => panic!("tensor {i} is not on a GPU: {:?}", other.device()),
    }
}

/// A CUDA tensor whose final contents are queued, not finished: stale bytes written and
/// synchronized, then many asynchronous fills on a side stream, the last with `value`.
fn pending_tensor(len: usize, value: u8, stream: &Stream) -> CudaBuffer {
    let b = CudaBuffer::alloc(len, stream).unwrap();
    b.write_from_host(&vec![0xee; len]).unwrap();
    for v in 0..16u8 {
        b.fill(v).unwrap();
    }
    b.fill(value).unwrap();
    b
}

fn registry() -> Registry {
    let mut r = Registry::new();
    dist::install(&mut r);
    // Copies each incoming CUDA tensor on the stream it arrived on (no synchronize): the copy
    // sees the data only if that stream is ordered after the arrival. CPU tensors come back
    // as they are. Also reports where each tensor landed.
    r.raw_handler("copy_on_arrival", |ctx: &CallContext, p: Payload| {
        let mut out = Vec::new();
        for t in &p.tensors {
            out.push(match &t.buffer {
                SendBuffer::Cuda(b) => {
                    if !ctx.streams.iter().any(|s| s.raw() == b.stream().raw()) {
                        return Err(HandlerError::new(
                            "StreamError",
                            "the tensor's stream is not the handler's",
                        ));
                    }
                    let copy = CudaBuffer::alloc(b.len(), b.stream()).map_err(he)?;
                    copy.copy_from(b).map_err(he)?;
                    Tensor::cuda(copy, GPU)
                }
                _ => t.clone(),
            });
        }
        let devices: Vec<String> = p.tensors.iter().map(|t| t.buffer.device().to_string()).collect();
        Ok(Payload::encode(&devices).map_err(he)?.with_tensors(out))
    });
    // An RRef value on the GPU: produced by queued work that is not waited for.
    r.raw_handler("make_on_gpu", |_ctx: &CallContext, p: Payload| {
        let (len, value): (usize, u8) = p.decode().map_err(he)?;
        let stream = Stream::new(0).map_err(he)?;
        let b = pending_tensor(len, value, &stream);
        Ok(Payload::empty().with_tensors(vec![Tensor::cuda(b, GPU)]))
    });
    // Distributed autograd: y = tanh(x · w) with w on this worker's GPU.
    dist::function(&mut r, "gpu_layer", |_cx: &CallContext, x: AgTensor| {
        if x.device() != GPU {
            return Err(he(format!("x arrived on {}", x.device())));
        }
        let w = AgTensor::randn(&[4, 3], 0.5, 7, DType::F32)
            .and_then(|w| w.to_device(GPU))
            .map_err(he)?;
        x.matmul(&w).and_then(|y| y.tanh()).map_err(he)
    });
    r
}

fn mapped(env: &WorkerEnv, local: Device, remote: Device) -> Agent {
    let peer = WorkerEnv::name(1 - env.rank);
    Agent::init(env.options().map_device(&peer, local, remote), registry()).unwrap()
}

worker_test!(cuda_tensors_follow_device_maps_in_stream_order, 2, |env: WorkerEnv| {
    if !gpu_or_skip("cuda_tensors_follow_device_maps_in_stream_order") {
        return;
    }
    let agent = mapped(&env, GPU, GPU);
    if env.rank == 0 {
        let side = Stream::new(0).unwrap();
        for (i, len) in [4usize << 10, 1 << 20, 64 << 20].into_iter().enumerate() {
            let value = 0x40 + i as u8;
            let t = pending_tensor(len, value, &side);
            let reply = agent
                .rpc_sync(
                    1u32,
                    "copy_on_arrival",
                    Payload::empty().with_tensors(vec![Tensor::cuda(t, GPU)]),
                )
                .unwrap();
            let landed: Vec<String> = reply.decode().unwrap();
            assert_eq!(landed, vec!["cuda:0"], "request mapped to the callee's cuda:0");
            // The response came back reverse-mapped, onto our GPU, with arrival events.
            assert!(!reply.events().is_empty(), "a received CUDA payload carries events");
            let mine = Stream::new(0).unwrap();
            let on_mine = reply.cuda_tensor_on(0, &mine).unwrap();
            let bytes = on_mine.read_to_host().unwrap();
            assert_eq!(bytes.len(), len);
            assert!(
                bytes.iter().all(|&b| b == value),
                "{len} bytes: found {:#x}, expected {value:#x} (a stream was not ordered)",
                bytes.iter().find(|&&b| b != value).unwrap()
            );
            assert_eq!(cuda(&reply, 0).device(), 0);
        }
        // A CUDA tensor to a peer with no map for it fails at once, naming the map.
        agent.shutdown().unwrap();
    } else {
        agent.shutdown().unwrap();
    }
});

worker_test!(cpu_to_gpu_maps_and_missing_maps, 2, |env: WorkerEnv| {
    if !gpu_or_skip("cpu_to_gpu_maps_and_missing_maps") {
        return;
    }
    // Rank 0 maps its CPU to rank 1's GPU, and has no entry for its own GPU.
    let agent = if env.rank == 0 {
        mapped(&env, Device::Cpu, GPU)
    } else {
        Agent::init(env.options(), registry()).unwrap()
    };
    if env.rank == 0 {
        let data = bytes::Bytes::from((0..100_000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        let reply = agent
            .rpc_sync(
                1u32,
                "copy_on_arrival",
                Payload::empty().with_tensors(vec![Tensor::cpu(data.clone())]),
            )
            .unwrap();
        let landed: Vec<String> = reply.decode().unwrap();
        assert_eq!(landed, vec!["cuda:0"], "a CPU tensor mapped to the callee's GPU");
        // The handler's GPU result comes back through the reverse map: onto our CPU.
        assert_eq!(reply.tensors[0].buffer.as_cpu().expect("back on the CPU"), &data);

        let t = pending_tensor(4096, 1, &Stream::new(0).unwrap());
        let e = agent
            .rpc_sync(
                1u32,
                "copy_on_arrival",
                Payload::empty().with_tensors(vec![Tensor::cuda(t, GPU)]),
            )
            .unwrap_err();
        assert!(
            matches!(
                &e,
                RpcError::MissingDeviceMap {
                    device: Device::Cuda(0),
                    ..
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("cuda:0") && e.to_string().contains("worker1"),
            "{e}"
        );
    }
    agent.shutdown().unwrap();
});

worker_test!(rrefs_owned_on_a_gpu_keep_their_event, 2, |env: WorkerEnv| {
    if !gpu_or_skip("rrefs_owned_on_a_gpu_keep_their_event") {
        return;
    }
    let agent = mapped(&env, GPU, GPU);
    if env.rank == 0 {
        let len = 32usize << 20;
        let rref = agent
            .remote::<()>(1u32, "make_on_gpu", Payload::encode(&(len, 0x5au8)).unwrap())
            .unwrap();
        for _ in 0..3 {
            let p = rref.fetch(Duration::from_secs(60)).wait().unwrap();
            let bytes = cuda(&p, 0).read_to_host().unwrap();
            assert!(
                bytes.iter().all(|&b| b == 0x5a),
                "a fetch read before the value was made"
            );
        }
        drop(rref);
    }
    agent.shutdown().unwrap();
});

worker_test!(distributed_backward_across_a_device_map, 2, |env: WorkerEnv| {
    // Computes on the GPU (autograd's kernels): needs NVRTC and cuBLAS too.
    if !sluice_tests::gpu::compute_or_skip("distributed_backward_across_a_device_map") {
        return;
    }
    let agent = mapped(&env, GPU, GPU);
    if env.rank == 0 {
        let x0 = AgTensor::randn(&[5, 4], 1.0, 3, DType::F32).unwrap();
        let x = x0.to_device(GPU).unwrap().requires_grad_();
        let ctx = Context::new(&agent).unwrap();
        let y: AgTensor = dist::rpc_sync(&agent, 1u32, "gpu_layer", &x).unwrap();
        assert_eq!(y.device(), GPU, "the result came back through the reverse map");
        let loss = y.sum().unwrap();
        ctx.backward(std::slice::from_ref(&loss), false).unwrap();
        let g = ctx.gradient(&x).unwrap();
        assert_eq!(g.device(), GPU, "the gradient landed on the leaf's device");
        // The same computation on the CPU.
        let xl = x0.clone().requires_grad_();
        let w = AgTensor::randn(&[4, 3], 0.5, 7, DType::F32).unwrap();
        let ll = xl.matmul(&w).unwrap().tanh().unwrap().sum().unwrap();
        ll.backward().unwrap();
        let (a, b) = (g.to_f64_vec().unwrap(), xl.grad().unwrap().to_f64_vec().unwrap());
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-4, "gpu {p} vs cpu {q}");
        }
        assert!((loss.item().unwrap() - ll.item().unwrap()).abs() < 1e-3);
    }
    agent.shutdown().unwrap();
});

worker_test!(remote_tensors_placed_on_a_gpu_equal_the_cpu, 2, |env: WorkerEnv| {
    // Computes on the owner's GPU (autograd's kernels): needs NVRTC and cuBLAS too.
    if !sluice_tests::gpu::compute_or_skip("remote_tensors_placed_on_a_gpu_equal_the_cpu") {
        return;
    }
    // No device maps: values go to the owner's CPU and move to its GPU there, and come back
    // the same way.
    let agent = Agent::init(env.options(), registry()).unwrap();
    if env.rank == 0 {
        use sluice_autograd::Error;
        let x = AgTensor::uniform(&[4, 5], -1.0, 1.0, 3, DType::F64)
            .unwrap()
            .requires_grad_();
        let w = AgTensor::uniform(&[5, 3], -1.0, 1.0, 4, DType::F64)
            .unwrap()
            .requires_grad_();
        macro_rules! model {
            ($x:expr, $w:expr) => {
                $x.matmul($w)
                    .unwrap()
                    .tanh()
                    .unwrap()
                    .softmax(-1)
                    .unwrap()
                    .mul_scalar(2.0)
                    .unwrap()
                    .sum()
                    .unwrap()
            };
        }
        let local = model!(x, &w);
        local.backward().unwrap();
        let ctx = Context::new(&agent).unwrap();
        let remote = ctx.run(|| {
            let xr = x.to_remote(&agent, "worker1/cuda:0").unwrap();
            let wr = w.to_remote(&agent, "worker1/cuda:0").unwrap();
            assert_eq!((xr.owner().id, xr.device()), (1, GPU));
            // CPU-only kernels are refused on the line that writes them.
            let idx = AgTensor::indices(&[0, 1], &[2])
                .unwrap()
                .to_remote(&agent, "worker1/cuda:0")
                .unwrap();
            assert!(matches!(xr.index_select(0, &idx), Err(Error::Remote(_))));
            model!(xr, &wr).to_here().unwrap()
        });
        assert!(
            (remote.item().unwrap() - local.item().unwrap()).abs() < 1e-10,
            "gpu {} vs cpu {}",
            remote.item().unwrap(),
            local.item().unwrap()
        );
        ctx.backward(&[remote], false).unwrap();
        for (leaf, name) in [(&x, "x"), (&w, "w")] {
            let (g, want) = (ctx.gradient(leaf).unwrap(), leaf.grad().unwrap());
            let (a, b) = (g.to_f64_vec().unwrap(), want.to_f64_vec().unwrap());
            assert_eq!(a.len(), b.len(), "{name}'s gradient");
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() < 1e-10, "{name}'s gradient: gpu {p} vs cpu {q}");
            }
        }
        ctx.release().unwrap();
    }
    agent.shutdown().unwrap();
});
