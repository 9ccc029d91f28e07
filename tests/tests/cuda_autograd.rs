//! Autograd on CUDA: every op's forward and backward on a GPU against the CPU on random inputs,
//! training steps with each optimizer, and the not-viable path.
//!
//! GPU tests skip (printing why) without a GPU, and fail under `SLUICE_REQUIRE_GPU=1`, which
//! `scripts/gpu-check.sh` sets. The not-viable test runs everywhere else.

use sluice_autograd::{cross_entropy, linear, DType, Optimizer, OptimizerKind, Parameter, Tensor, UpdateMode};
use sluice_channel::Device;
use sluice_tests::gpu::compute_or_skip;

const GPU: Device = Device::Cuda(0);

fn close(what: &str, cpu: &Tensor, gpu: &Tensor, tol: f64) {
    assert_eq!(gpu.device(), GPU, "{what}: result left the GPU");
    assert_eq!(cpu.shape(), gpu.shape(), "{what}: shape");
    let (a, b) = (cpu.to_f64_vec().unwrap(), gpu.to_f64_vec().unwrap());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let scale = 1.0f64.max(x.abs());
        assert!((x - y).abs() <= tol * scale, "{what}: element {i}: cpu {x} vs gpu {y}");
    }
}

/// Runs `f` on CPU leaves and on the same values on the GPU; compares outputs and every
/// input's gradient (of the sum of the output).
fn parity(what: &str, inputs: &[Tensor], tol: f64, f: impl Fn(&[Tensor]) -> Tensor) {
    let cpu: Vec<Tensor> = inputs.iter().map(|t| t.clone().requires_grad_()).collect();
    let gpu: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_device(GPU).unwrap().requires_grad_())
        .collect();
    let (yc, yg) = (f(&cpu), f(&gpu));
    close(&format!("{what} forward"), &yc, &yg, tol);
    yc.sum().unwrap().backward().unwrap();
    yg.sum().unwrap().backward().unwrap();
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        match (c.grad(), g.grad()) {
            (Some(gc), Some(gg)) => close(&format!("{what} grad {i}"), &gc, &gg, tol),
            (None, None) => {}
            (a, b) => panic!("{what} grad {i}: cpu {a:?} gpu {b:?}"),
        }
    }
}

fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    Tensor::uniform(shape, 0.1, 1.0, seed, dtype).unwrap()
}

/// Long reductions are summed in passes of partial sums (a thread per chunk, then per chunk of
/// partials): every split (one pass, two, three), over contiguous and strided dimensions and
/// views with an offset, equals the CPU's sum.
#[test]
fn long_reductions_split_into_passes_match_the_cpu() {
    if !compute_or_skip("long_reductions_split_into_passes_match_the_cpu") {
        return;
    }
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
        // 64 elements: one pass; 65 and 2,000: two; 5,000 and 70,000: three.
        for n in [1usize, 63, 64, 65, 2000, 5000, 70_000] {
            let x = rand(&[n], n as u64, dtype);
            parity(&format!("sum of {n}"), std::slice::from_ref(&x), tol, |t| {
                t[0].sum().unwrap()
            });
        }
        let m = rand(&[300, 70], 9, dtype);
        parity("sum over a strided dim", std::slice::from_ref(&m), tol, |t| {
            t[0].sum_dim(0, false).unwrap()
        });
        parity(
            "mean over rows of a transposed view",
            std::slice::from_ref(&m),
            tol,
            |t| t[0].t().unwrap().mean_dim(1, true).unwrap(),
        );
        parity("sum of a narrowed view", std::slice::from_ref(&m), tol, |t| {
            t[0].narrow(0, 7, 200).unwrap().sum().unwrap()
        });
    }
}

#[test]
fn every_op_matches_the_cpu_forward_and_backward() {
    if !compute_or_skip("every_op_matches_the_cpu_forward_and_backward") {
        return;
    }
    for (dtype, tol) in [(DType::F64, 1e-9), (DType::F32, 2e-4)] {
        let a = rand(&[7, 5], 1, dtype);
        let b = rand(&[7, 5], 2, dtype);
        let row = rand(&[5], 3, dtype);
        let col = rand(&[7, 1], 4, dtype);
        parity("add", &[a.clone(), b.clone()], tol, |t| t[0].add(&t[1]).unwrap());
        parity("sub broadcast row", &[a.clone(), row.clone()], tol, |t| {
            t[0].sub(&t[1]).unwrap()
        });
        parity("mul broadcast column", &[a.clone(), col.clone()], tol, |t| {
            t[0].mul(&t[1]).unwrap()
        });
        parity("div", &[a.clone(), b.clone()], tol, |t| t[0].div(&t[1]).unwrap());
        for (name, op) in [
            ("neg", Tensor::neg as fn(&Tensor) -> sluice_autograd::Result<Tensor>),
            ("exp", Tensor::exp),
            ("log", Tensor::log),
            ("relu", Tensor::relu),
            ("tanh", Tensor::tanh),
            ("sigmoid", Tensor::sigmoid),
            ("cos", Tensor::cos),
            ("sin", Tensor::sin),
        ] {
            let shifted = a.add_scalar(-0.5).unwrap();
            let input = if name == "log" { a.clone() } else { shifted };
            parity(name, &[input], tol, |t| op(&t[0]).unwrap());
        }
        parity("scalars", std::slice::from_ref(&a), tol, |t| {
            t[0].mul_scalar(3.0).unwrap().add_scalar(-1.0).unwrap()
        });
        let m = rand(&[5, 3], 5, dtype);
        parity("matmul", &[a.clone(), m.clone()], tol, |t| t[0].matmul(&t[1]).unwrap());
        parity("matmul of transposed views", &[a.clone(), b.clone()], tol, |t| {
            t[0].t().unwrap().matmul(&t[1]).unwrap()
        });
        parity("sum, sum_dim, mean_dim", std::slice::from_ref(&a), tol, |t| {
            t[0].sum_dim(0, true)
                .unwrap()
                .mul(&t[0].mean_dim(1, true).unwrap())
                .unwrap()
                .add(&t[0].sum().unwrap())
                .unwrap()
        });
        parity("softmax", std::slice::from_ref(&a), tol, |t| {
            t[0].softmax(-1).unwrap().mul(&t[0]).unwrap()
        });
        parity("log_softmax along 0", std::slice::from_ref(&a), tol, |t| {
            t[0].log_softmax(0).unwrap()
        });
        parity("narrow, cat, reshape, transpose", std::slice::from_ref(&a), tol, |t| {
            let parts = t[0].split(&[2, 3], 1).unwrap();
            let joined = sluice_autograd::cat(&[parts[1].clone(), parts[0].clone()], 1).unwrap();
            joined
                .transpose(0, 1)
                .unwrap()
                .contiguous()
                .unwrap()
                .reshape(&[35])
                .unwrap()
        });
        let w = rand(&[4, 5], 6, dtype);
        let bias = rand(&[4], 7, dtype);
        let targets = Tensor::indices(&[0, 3, 1, 2, 3, 0, 1], &[7]).unwrap();
        parity("linear + cross_entropy", &[a.clone(), w, bias], tol, |t| {
            cross_entropy(&linear(&t[0], &t[1], Some(&t[2])).unwrap(), &targets).unwrap()
        });
    }
}

#[test]
fn dtype_and_device_moves_round_trip() {
    if !compute_or_skip("dtype_and_device_moves_round_trip") {
        return;
    }
    let a = rand(&[3, 4], 9, DType::F32);
    let g = a.to_device(GPU).unwrap().to_dtype(DType::F64).unwrap();
    assert_eq!((g.device(), g.dtype()), (GPU, DType::F64));
    let back = g.to_dtype(DType::F32).unwrap().to_device(Device::Cpu).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), a.to_vec::<f32>().unwrap());
    // Gradients flow back across the move, onto the CPU leaf.
    let leaf = a.clone().requires_grad_();
    leaf.to_device(GPU)
        .unwrap()
        .mul_scalar(2.0)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let grad = leaf.grad().unwrap();
    assert_eq!(grad.device(), Device::Cpu);
    assert!(grad.to_f64_vec().unwrap().iter().all(|&x| x == 2.0));
}

#[test]
fn training_steps_match_the_cpu_for_every_optimizer() {
    if !compute_or_skip("training_steps_match_the_cpu_for_every_optimizer") {
        return;
    }
    let x = rand(&[16, 8], 11, DType::F32);
    let targets = Tensor::indices(&(0..16).map(|i| i % 3).collect::<Vec<_>>(), &[16]).unwrap();
    for kind in [
        OptimizerKind::sgd(0.1),
        OptimizerKind::Sgd {
            lr: 0.05,
            momentum: 0.9,
        },
        OptimizerKind::adam(0.01),
    ] {
        let run = |device: Device| {
            let w = Parameter::new(
                "w",
                Tensor::randn(&[3, 8], 0.3, 12, DType::F32)
                    .unwrap()
                    .to_device(device)
                    .unwrap(),
            );
            let b = Parameter::new("b", Tensor::zeros(&[3], DType::F32).unwrap().to_device(device).unwrap());
            let opt = Optimizer::new(kind, vec![w.clone(), b.clone()], UpdateMode::Locked);
            let x = x.to_device(device).unwrap();
            let mut losses = Vec::new();
            for _ in 0..5 {
                let loss = cross_entropy(&linear(&x, &w.tensor(), Some(&b.tensor())).unwrap(), &targets).unwrap();
                losses.push(loss.item().unwrap());
                loss.backward().unwrap();
                opt.step().unwrap();
            }
            assert_eq!(w.data().device(), device, "{kind:?}: the parameter moved");
            (losses, w.data().to_f64_vec().unwrap())
        };
        let (lc, wc) = run(Device::Cpu);
        let (lg, wg) = run(GPU);
        for (c, g) in lc.iter().zip(&lg).chain(wc.iter().zip(&wg)) {
            assert!((c - g).abs() <= 1e-4 * c.abs().max(1.0), "{kind:?}: cpu {c} vs gpu {g}");
        }
        assert!(lg[4] < lg[0], "{kind:?}: the loss did not fall: {lg:?}");
    }
}

#[test]
fn without_a_gpu_cuda_ops_fail_with_the_reason() {
    if !sluice_tests::gpu::without_driver_or_skip("without_a_gpu_cuda_ops_fail_with_the_reason") {
        return;
    }
    let e = sluice_autograd::cuda::available().unwrap_err();
    assert!(e.contains("libcuda"), "{e}");
    let a = Tensor::ones(&[2, 2], DType::F32).unwrap();
    let e = a.to_device(GPU).unwrap_err();
    assert!(e.to_string().contains("CUDA"), "{e}");
    // The CPU is untouched.
    assert_eq!(a.to_device(Device::Cpu).unwrap().to_vec::<f32>().unwrap(), vec![1.0; 4]);
}
