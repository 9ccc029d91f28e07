//! A generated dataset: three interleaved spirals in 2-D (classes are not linearly separable,
//! so a hidden layer is needed), with a fixed seed and a held-out test split.

use sluice_autograd::{DType, Rng, Tensor};

pub const CLASSES: usize = 3;
pub const FEATURES: usize = 2;

pub struct Split {
    pub x: Vec<f32>,
    pub y: Vec<usize>,
}

impl Split {
    pub fn len(&self) -> usize {
        self.y.len()
    }

    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// Rows `range` as tensors.
    pub fn batch(&self, range: std::ops::Range<usize>) -> (Tensor, Tensor) {
        let x = Tensor::from_vec(
            self.x[range.start * FEATURES..range.end * FEATURES].to_vec(),
            &[range.len(), FEATURES],
        )
        .expect("batch shape");
        let y = Tensor::indices(&self.y[range.clone()], &[range.len()]).expect("labels");
        (x, y)
    }

    /// Every `k`-th row starting at `offset` (a trainer's shard).
    pub fn shard(&self, offset: usize, k: usize) -> Split {
        let rows: Vec<usize> = (offset..self.len()).step_by(k).collect();
        Split {
            x: rows.iter().flat_map(|&r| [self.x[2 * r], self.x[2 * r + 1]]).collect(),
            y: rows.iter().map(|&r| self.y[r]).collect(),
        }
    }
}

/// (train, test): `per_class` points per class, 80% for training, shuffled.
pub fn spirals(per_class: usize, seed: u64) -> (Split, Split) {
    let mut rng = Rng::new(seed);
    let mut rows: Vec<([f32; 2], usize)> = Vec::new();
    for c in 0..CLASSES {
        for i in 0..per_class {
            let r = i as f64 / per_class as f64;
            let t = c as f64 * 4.0 + 4.0 * r + rng.normal() * 0.2;
            rows.push(([(r * t.sin()) as f32, (r * t.cos()) as f32], c));
        }
    }
    for i in (1..rows.len()).rev() {
        rows.swap(i, rng.below(i + 1));
    }
    let cut = rows.len() * 4 / 5;
    let split = |rows: &[([f32; 2], usize)]| Split {
        x: rows.iter().flat_map(|(p, _)| *p).collect(),
        y: rows.iter().map(|&(_, c)| c).collect(),
    };
    (split(&rows[..cut]), split(&rows[cut..]))
}

/// An MLP's parameters: `[w1, b1, w2, b2]` for 2 → hidden → 3, seeded.
pub fn mlp_init(hidden: usize, seed: u64) -> Vec<Tensor> {
    let s1 = 1.0 / (FEATURES as f64).sqrt();
    let s2 = 1.0 / (hidden as f64).sqrt();
    vec![
        Tensor::uniform(&[hidden, FEATURES], -s1, s1, seed, DType::F32).expect("init"),
        Tensor::uniform(&[hidden], -s1, s1, seed + 1, DType::F32).expect("init"),
        Tensor::uniform(&[CLASSES, hidden], -s2, s2, seed + 2, DType::F32).expect("init"),
        Tensor::uniform(&[CLASSES], -s2, s2, seed + 3, DType::F32).expect("init"),
    ]
}
