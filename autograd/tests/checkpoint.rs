//! Rematerialization: a checkpointed function's gradients equal the plain ones, for every
//! input (parameters included), and nothing inside it is recorded in the forward.

use sluice_autograd::{checkpoint, linear, DType, Result, Tensor};

fn f(t: &[Tensor]) -> Result<Tensor> {
    linear(&t[0], &t[1], Some(&t[2]))?.tanh()?.mul_scalar(2.0)?.relu()
}

fn leaves() -> Vec<Tensor> {
    vec![
        Tensor::randn(&[4, 5], 1.0, 1, DType::F64).unwrap().requires_grad_(),
        Tensor::randn(&[3, 5], 1.0, 2, DType::F64).unwrap().requires_grad_(),
        Tensor::randn(&[3], 1.0, 3, DType::F64).unwrap().requires_grad_(),
    ]
}

#[test]
fn checkpointed_gradients_equal_the_plain_ones() {
    let plain = leaves();
    f(&plain).unwrap().sum().unwrap().backward().unwrap();
    let ckpt = leaves();
    let y = checkpoint(&ckpt, f).unwrap();
    y.sum().unwrap().backward().unwrap();
    for (a, b) in plain.iter().zip(&ckpt) {
        let (a, b) = (
            a.grad().unwrap().to_f64_vec().unwrap(),
            b.grad().unwrap().to_f64_vec().unwrap(),
        );
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-14), "{a:?} vs {b:?}");
    }
    // Twice without retain_graph through the same checkpoint fails as any op would.
    let again = leaves();
    let y = checkpoint(&again, f).unwrap().sum().unwrap();
    y.backward().unwrap();
    assert!(y.backward().is_err());
}
