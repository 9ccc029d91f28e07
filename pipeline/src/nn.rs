//! Sequential models as data: each layer is described (so a stage can be built on any worker
//! from the description) and initialised from the seed and its *global* index, so the same
//! model comes out whatever the partition, which is what lets a checkpoint restore onto
//! another placement and a pipeline be checked against the model run locally.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use sluice_autograd::{linear, DType, Parameter, Result, Tensor};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layer {
    /// `y = x Wᵀ + b`, W of shape `[outputs, inputs]`.
    Linear {
        inputs: usize,
        outputs: usize,
    },
    Relu,
    Tanh,
}

impl Layer {
    /// This layer's parameters as layer `index` of a model seeded with `seed`.
    pub fn init(&self, index: usize, seed: u64, dtype: DType) -> Result<Vec<Parameter>> {
        match *self {
            Layer::Linear { inputs, outputs } => {
                let s = 1.0 / (inputs as f64).sqrt();
                let base = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((index as u64) << 20);
                Ok(vec![
                    Parameter::new(
                        format!("layer{index}.weight"),
                        Tensor::uniform(&[outputs, inputs], -s, s, base, dtype)?,
                    ),
                    Parameter::new(
                        format!("layer{index}.bias"),
                        Tensor::uniform(&[outputs], -s, s, base + 1, dtype)?,
                    ),
                ])
            }
            Layer::Relu | Layer::Tanh => Ok(Vec::new()),
        }
    }

    pub fn forward(&self, params: &[Parameter], x: &Tensor) -> Result<Tensor> {
        match self {
            Layer::Linear { .. } => linear(x, &params[0].tensor(), Some(&params[1].tensor())),
            Layer::Relu => x.relu(),
            Layer::Tanh => x.tanh(),
        }
    }

    /// Elements of parameters.
    pub fn param_count(&self) -> usize {
        match *self {
            Layer::Linear { inputs, outputs } => outputs * inputs + outputs,
            _ => 0,
        }
    }

    /// Elements of output per sample.
    pub fn output_width(&self, input: usize) -> usize {
        match *self {
            Layer::Linear { outputs, .. } => outputs,
            _ => input,
        }
    }
}

/// Layers `range` of `model`, built: their parameters, per layer.
pub fn build(model: &[Layer], range: Range<usize>, seed: u64, dtype: DType) -> Result<Vec<Vec<Parameter>>> {
    range.map(|i| model[i].init(i, seed, dtype)).collect()
}

/// Runs layers `layers` (with `params`, one entry per layer) on `x`.
pub fn forward(layers: &[Layer], params: &[Vec<Parameter>], x: &Tensor) -> Result<Tensor> {
    let mut h = x.clone();
    for (layer, p) in layers.iter().zip(params) {
        h = layer.forward(p, &h)?;
    }
    Ok(h)
}

/// [`forward`] with the parameters given as tensors, in layer order (what a rematerialized
/// stage recomputes from).
pub fn forward_tensors(layers: &[Layer], params: &[Tensor], x: &Tensor) -> Result<Tensor> {
    let mut h = x.clone();
    let mut next = params.iter();
    for layer in layers {
        h = match layer {
            Layer::Linear { .. } => {
                let (w, b) = (next.next(), next.next());
                match (w, b) {
                    (Some(w), Some(b)) => linear(&h, w, Some(b))?,
                    _ => {
                        return Err(sluice_autograd::Error::Backward(
                            "a linear layer without its parameters".into(),
                        ))
                    }
                }
            }
            Layer::Relu => h.relu()?,
            Layer::Tanh => h.tanh()?,
        };
    }
    Ok(h)
}

/// An MLP: `widths[0]` inputs, ReLU between the linear layers.
pub fn mlp(widths: &[usize]) -> Vec<Layer> {
    let mut out = Vec::new();
    for (i, w) in widths.windows(2).enumerate() {
        if i > 0 {
            out.push(Layer::Relu);
        }
        out.push(Layer::Linear {
            inputs: w[0],
            outputs: w[1],
        });
    }
    out
}
