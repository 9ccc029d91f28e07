//! Finite-difference gradient checks (in f64), used by the tests of every op.

use crate::error::{Error, Result};
use crate::graph::no_grad;
use crate::tensor::Tensor;

/// Checks the gradients of `f` at `inputs` (f64 leaves) against central differences of
/// `sum(f(inputs) · R)` for a fixed random `R`. Returns the largest relative error.
pub fn gradcheck(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], eps: f64, tol: f64) -> Result<f64> {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|t| {
            if t.dtype().is_float() {
                t.detach().requires_grad_()
            } else {
                t.clone()
            }
        })
        .collect();
    let out = f(&leaves)?;
    let weights = Tensor::randn(out.shape(), 1.0, 7, out.dtype())?;
    let loss = out.mul(&weights)?.sum()?;
    loss.backward()?;
    let eval = |xs: &[Tensor]| -> Result<f64> { no_grad(|| f(xs)?.mul(&weights)?.sum()?.item()) };
    let mut worst: f64 = 0.0;
    for (k, leaf) in leaves.iter().enumerate() {
        if !leaf.dtype().is_float() {
            continue;
        }
        let analytic = match leaf.grad() {
            Some(g) => g.to_dense()?.to_f64_vec()?,
            None => vec![0.0; leaf.numel()],
        };
        let base = leaf.to_f64_vec()?;
        for i in 0..base.len() {
            let probe = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[i] += delta;
                let mut xs: Vec<Tensor> = leaves.iter().map(Tensor::detach).collect();
                xs[k] = Tensor::from_vec(v, leaf.shape())?;
                eval(&xs)
            };
            let numeric = (probe(eps)? - probe(-eps)?) / (2.0 * eps);
            let err = (numeric - analytic[i]).abs() / (1.0 + numeric.abs());
            worst = worst.max(err);
            if err > tol {
                return Err(Error::Backward(format!(
                    "input {k} element {i}: analytic {} vs numeric {numeric}",
                    analytic[i]
                )));
            }
        }
    }
    Ok(worst)
}
