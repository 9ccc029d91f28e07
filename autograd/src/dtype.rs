//! Element types. Kernels exist for f32 and f64; f16 and bf16 are storage types (convert with
//! `Tensor::to_dtype` to compute); i64 holds indices.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(self, DType::I64)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
        })
    }
}

/// A type the buffers can hold.
pub trait Pod: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: DType;
}

impl Pod for f32 {
    const DTYPE: DType = DType::F32;
}
impl Pod for f64 {
    const DTYPE: DType = DType::F64;
}
impl Pod for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl Pod for half::bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Pod for i64 {
    const DTYPE: DType = DType::I64;
}

/// A type the kernels compute in (f32, f64).
pub trait Float:
    Pod
    + Copy
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::ops::DivAssign
    + std::iter::Sum
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, other: Self) -> Self;
    /// `a·b` over strided matrices, row-major (see `cpu::gemm`).
    fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: (&[Self], usize, isize, isize),
        b: (&[Self], usize, isize, isize),
    ) -> Vec<Self>;
}

macro_rules! float_impl {
    ($t:ty, $gemm:ident) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            fn gemm(
                m: usize,
                k: usize,
                n: usize,
                a: (&[Self], usize, isize, isize),
                b: (&[Self], usize, isize, isize),
            ) -> Vec<Self> {
                crate::cpu::gemm::$gemm(m, k, n, a, b)
            }
        }
    };
}
float_impl!(f32, sgemm);
float_impl!(f64, dgemm);
