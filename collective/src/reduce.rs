//! Element-wise reductions over raw buffers, for every dtype Sluice carries.
//!
//! Buffers are bytes in native order, read and written without alignment assumptions (received
//! memory has none). f16 and bf16 are accumulated in f32 for one step and rounded back (so a sum
//! whose partial results leave f16's range overflows to infinity before an average divides it);
//! sums of integers wrap, as PyTorch's do. Booleans reduce as logic (sum and max: or; product and min:
//! and). Complex numbers take sum, product and average; min and max are refused.

use half::{bf16, f16};
use sluice_dlpack::DType;

use crate::CollectiveError;

/// How values are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the number of ranks (floating point and complex only).
    Avg,
    Product,
    Min,
    Max,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// The operation applied for each rank's contribution (the average sums, then divides).
    fn step(self) -> ReduceOp {
        if self == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            self
        }
    }
}

/// Whether `op` is defined for `dtype`, or why not.
pub fn check(dtype: DType, op: ReduceOp) -> Result<(), CollectiveError> {
    let float = matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64);
    let complex = matches!(dtype, DType::C64 | DType::C128);
    let refused = match op {
        ReduceOp::Avg => !(float || complex),
        ReduceOp::Min | ReduceOp::Max => complex,
        _ => false,
    };
    if refused {
        return Err(CollectiveError::Unsupported(format!(
            "{} of {} tensors",
            op.name(),
            dtype.name()
        )));
    }
    Ok(())
}

/// Checks that `len` bytes are whole elements of `dtype`.
pub fn elements(dtype: DType, len: usize) -> Result<usize, CollectiveError> {
    let size = dtype.size();
    if !len.is_multiple_of(size) {
        return Err(CollectiveError::Invalid(format!(
            "{len} bytes are not whole {} elements ({size} bytes each)",
            dtype.name()
        )));
    }
    Ok(len / size)
}

/// `dst[i] = f(dst[i], src[i])` (or `f(src[i], dst[i])` when `rev`) over elements of `T`, when
/// both buffers are aligned for `T` (the common case: a vectorizable loop); `false` when they
/// are not.
fn aligned<T: bytemuck::Pod>(dst: &mut [u8], src: &[u8], rev: bool, f: impl Fn(T, T) -> T) -> bool {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        (Ok(d), Ok(s)) if rev => {
            d.iter_mut().zip(s).for_each(|(a, b)| *a = f(*b, *a));
            true
        }
        (Ok(d), Ok(s)) => {
            d.iter_mut().zip(s).for_each(|(a, b)| *a = f(*a, *b));
            true
        }
        _ => false,
    }
}

macro_rules! fold {
    ($dst:expr, $src:expr, $rev:expr, $t:ty, $n:expr, |$a:ident, $b:ident| $f:expr) => {{
        if !aligned::<$t>($dst, $src, $rev, |$a: $t, $b: $t| $f) {
            for (d, s) in $dst.chunks_exact_mut($n).zip($src.chunks_exact($n)) {
                let (x, y) = (
                    <$t>::from_ne_bytes(d.try_into().expect("element")),
                    <$t>::from_ne_bytes(s.try_into().expect("element")),
                );
                let ($a, $b) = if $rev { (y, x) } else { (x, y) };
                d.copy_from_slice(&($f).to_ne_bytes());
            }
        }
    }};
}

macro_rules! int_ops {
    ($dst:expr, $src:expr, $rev:expr, $op:expr, $t:ty) => {{
        let n = std::mem::size_of::<$t>();
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => fold!($dst, $src, $rev, $t, n, |a, b| a.wrapping_add(b)),
            ReduceOp::Product => fold!($dst, $src, $rev, $t, n, |a, b| a.wrapping_mul(b)),
            ReduceOp::Min => fold!($dst, $src, $rev, $t, n, |a, b| a.min(b)),
            ReduceOp::Max => fold!($dst, $src, $rev, $t, n, |a, b| a.max(b)),
        }
    }};
}

macro_rules! float_ops {
    ($dst:expr, $src:expr, $rev:expr, $op:expr, $t:ty) => {{
        let n = std::mem::size_of::<$t>();
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => fold!($dst, $src, $rev, $t, n, |a, b| a + b),
            ReduceOp::Product => fold!($dst, $src, $rev, $t, n, |a, b| a * b),
            // NaN wins, as in PyTorch.
            ReduceOp::Min => fold!($dst, $src, $rev, $t, n, |a, b| if a.is_nan() || a < b { a } else { b }),
            ReduceOp::Max => fold!($dst, $src, $rev, $t, n, |a, b| if a.is_nan() || a > b { a } else { b }),
        }
    }};
}

macro_rules! half_ops {
    ($dst:expr, $src:expr, $rev:expr, $op:expr, $t:ty) => {{
        let n = 2;
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => {
                fold!($dst, $src, $rev, $t, n, |a, b| <$t>::from_f32(a.to_f32() + b.to_f32()))
            }
            ReduceOp::Product => fold!($dst, $src, $rev, $t, n, |a, b| <$t>::from_f32(a.to_f32() * b.to_f32())),
            ReduceOp::Min => fold!(
                $dst,
                $src,
                $rev,
                $t,
                n,
                |a, b| if a.is_nan() || a.to_f32() < b.to_f32() { a } else { b }
            ),
            ReduceOp::Max => fold!(
                $dst,
                $src,
                $rev,
                $t,
                n,
                |a, b| if a.is_nan() || a.to_f32() > b.to_f32() { a } else { b }
            ),
        }
    }};
}

macro_rules! complex_ops {
    ($dst:expr, $src:expr, $op:expr, $t:ty) => {{
        let n = std::mem::size_of::<$t>();
        let pair = 2 * n;
        for (d, s) in $dst.chunks_exact_mut(pair).zip($src.chunks_exact(pair)) {
            let (dr, di) = d.split_at_mut(n);
            let (sr, si) = s.split_at(n);
            let get = |b: &[u8]| <$t>::from_ne_bytes(b.try_into().expect("element"));
            let (a, b, c, e) = (get(dr), get(di), get(sr), get(si));
            let (re, im) = match $op {
                ReduceOp::Product => (a * c - b * e, a * e + b * c),
                _ => (a + c, b + e),
            };
            dr.copy_from_slice(&re.to_ne_bytes());
            di.copy_from_slice(&im.to_ne_bytes());
        }
    }};
}

/// `dst[i] = dst[i] op src[i]` for every element (`op` checked with [`check`] first; the
/// average sums here and divides in [`finish`]).
pub fn combine(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    combine_ordered(dst, src, dtype, op, false)
}

/// `dst[i] = src[i] op dst[i]`: as [`combine`] with the operands the other way round (the
/// same bytes but for which NaN or which signed zero a minimum or maximum keeps), so that a
/// reduction in rank order can fold earlier ranks' values into a later rank's in place.
pub fn combine_rev(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    combine_ordered(dst, src, dtype, op, true)
}

fn combine_ordered(dst: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp, rev: bool) {
    debug_assert_eq!(dst.len(), src.len());
    let op = op.step();
    match dtype {
        DType::Bool => match op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max => dst
                .iter_mut()
                .zip(src)
                .for_each(|(d, s)| *d = ((*d != 0) || (*s != 0)) as u8),
            ReduceOp::Product | ReduceOp::Min => dst
                .iter_mut()
                .zip(src)
                .for_each(|(d, s)| *d = ((*d != 0) && (*s != 0)) as u8),
        },
        DType::I8 => int_ops!(dst, src, rev, op, i8),
        DType::I16 => int_ops!(dst, src, rev, op, i16),
        DType::I32 => int_ops!(dst, src, rev, op, i32),
        DType::I64 => int_ops!(dst, src, rev, op, i64),
        DType::U8 => int_ops!(dst, src, rev, op, u8),
        DType::U16 => int_ops!(dst, src, rev, op, u16),
        DType::U32 => int_ops!(dst, src, rev, op, u32),
        DType::U64 => int_ops!(dst, src, rev, op, u64),
        DType::F16 => half_ops!(dst, src, rev, op, f16),
        DType::BF16 => half_ops!(dst, src, rev, op, bf16),
        DType::F32 => float_ops!(dst, src, rev, op, f32),
        DType::F64 => float_ops!(dst, src, rev, op, f64),
        DType::C64 => complex_ops!(dst, src, op, f32),
        DType::C128 => complex_ops!(dst, src, op, f64),
    }
}

/// Completes a reduction over `ranks` contributions: the average divides by it.
pub fn finish(buf: &mut [u8], dtype: DType, op: ReduceOp, ranks: u32) {
    if op != ReduceOp::Avg {
        return;
    }
    let k = ranks as f64;
    macro_rules! scale {
        ($t:ty, $n:expr, |$x:ident| $f:expr) => {
            for c in buf.chunks_exact_mut($n) {
                let $x = <$t>::from_ne_bytes(c.try_into().expect("element"));
                c.copy_from_slice(&($f).to_ne_bytes());
            }
        };
    }
    match dtype {
        DType::F16 => scale!(f16, 2, |x| f16::from_f32(x.to_f32() / k as f32)),
        DType::BF16 => scale!(bf16, 2, |x| bf16::from_f32(x.to_f32() / k as f32)),
        DType::F32 | DType::C64 => scale!(f32, 4, |x| x / k as f32),
        DType::F64 | DType::C128 => scale!(f64, 8, |x| x / k),
        _ => unreachable!("checked: the average is refused for {}", dtype.name()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_of<T: Copy, const N: usize>(v: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|&x| to(x)).collect()
    }

    #[test]
    fn every_op_on_the_common_dtypes() {
        let a = bytes_of(&[1.5f32, -2.0, f32::NAN, 4.0], f32::to_ne_bytes);
        let b = bytes_of(&[0.5f32, 3.0, 1.0, -4.0], f32::to_ne_bytes);
        let run = |op| {
            let mut d = a.clone();
            combine(&mut d, &b, DType::F32, op);
            finish(&mut d, DType::F32, op, 2);
            d.chunks(4)
                .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
                .collect::<Vec<_>>()
        };
        let sum = run(ReduceOp::Sum);
        assert_eq!((sum[0], sum[1], sum[3]), (2.0, 1.0, 0.0));
        assert!(sum[2].is_nan());
        assert_eq!(run(ReduceOp::Avg)[0], 1.0);
        assert_eq!(run(ReduceOp::Product)[1], -6.0);
        let min = run(ReduceOp::Min);
        assert_eq!((min[0], min[1], min[3]), (0.5, -2.0, -4.0));
        assert!(min[2].is_nan(), "NaN wins");
        assert_eq!(run(ReduceOp::Max)[3], 4.0);

        let mut i = bytes_of(&[i32::MAX, -3], i32::to_ne_bytes);
        combine(&mut i, &bytes_of(&[1, 7], i32::to_ne_bytes), DType::I32, ReduceOp::Sum);
        assert_eq!(i, bytes_of(&[i32::MIN, 4], i32::to_ne_bytes), "integer sums wrap");

        let mut h = bytes_of(&[f16::from_f32(1.0), f16::from_f32(2048.0)], |x| x.to_ne_bytes());
        let one = bytes_of(&[f16::from_f32(0.5), f16::from_f32(1.0)], |x| x.to_ne_bytes());
        combine(&mut h, &one, DType::F16, ReduceOp::Sum);
        assert_eq!(f16::from_ne_bytes([h[0], h[1]]).to_f32(), 1.5);

        let mut c = bytes_of(&[1.0f32, 2.0], f32::to_ne_bytes); // 1 + 2i
        combine(
            &mut c,
            &bytes_of(&[3.0f32, -1.0], f32::to_ne_bytes),
            DType::C64,
            ReduceOp::Product,
        );
        assert_eq!(c, bytes_of(&[5.0f32, 5.0], f32::to_ne_bytes)); // (1+2i)(3-i) = 5+5i

        let mut t = vec![0u8, 1, 1, 0];
        combine(&mut t, &[0, 0, 1, 1], DType::Bool, ReduceOp::Product);
        assert_eq!(t, [0, 0, 1, 0]);
    }

    #[test]
    fn the_reversed_fold_puts_the_source_on_the_left() {
        // min(-0, +0) keeps its left operand's zero, so the two orders differ in bytes.
        let (neg, pos) = (
            bytes_of(&[-0.0f32; 3], f32::to_ne_bytes),
            bytes_of(&[0.0f32; 3], f32::to_ne_bytes),
        );
        let mut d = neg.clone();
        combine(&mut d, &pos, DType::F32, ReduceOp::Min);
        assert_eq!(d, pos, "min(-0, +0) with -0 on the left");
        let mut d = neg.clone();
        combine_rev(&mut d, &pos, DType::F32, ReduceOp::Min);
        assert_eq!(d, neg, "min(+0, -0) with +0 on the left");
        // The same on the unaligned (byte) path.
        let (mut d, s) = ([&[0u8][..], &neg].concat(), [&[0u8][..], &pos].concat());
        combine_rev(&mut d[1..], &s[1..], DType::F32, ReduceOp::Min);
        assert_eq!(&d[1..], &neg[..]);
        let mut sum = bytes_of(&[1i32, 2, 3], i32::to_ne_bytes);
        combine_rev(
            &mut sum,
            &bytes_of(&[10i32, 20, 30], i32::to_ne_bytes),
            DType::I32,
            ReduceOp::Sum,
        );
        assert_eq!(sum, bytes_of(&[11i32, 22, 33], i32::to_ne_bytes));
    }

    #[test]
    fn unaligned_buffers_take_the_byte_path_with_the_same_result() {
        let a: Vec<u8> = (0..64u32).flat_map(|i| (i as f64 * 0.5).to_ne_bytes()).collect();
        let b: Vec<u8> = (0..64u32).flat_map(|i| (3.0 - i as f64).to_ne_bytes()).collect();
        let mut aligned = a.clone();
        combine(&mut aligned, &b, DType::F64, ReduceOp::Max);
        // The same bytes one byte into larger buffers: no longer 8-aligned.
        let mut d = vec![0u8; a.len() + 1];
        d[1..].copy_from_slice(&a);
        let mut s = vec![0u8; b.len() + 1];
        s[1..].copy_from_slice(&b);
        assert!(
            bytemuck::try_cast_slice::<u8, f64>(&d[1..]).is_err(),
            "the test needs unaligned data"
        );
        combine(&mut d[1..], &s[1..], DType::F64, ReduceOp::Max);
        assert_eq!(&d[1..], &aligned[..]);
    }

    #[test]
    fn undefined_combinations_are_refused_with_the_reason() {
        let e = check(DType::I64, ReduceOp::Avg).unwrap_err();
        assert!(e.to_string().contains("avg of int64"), "{e}");
        assert!(check(DType::C128, ReduceOp::Max).is_err());
        assert!(check(DType::BF16, ReduceOp::Avg).is_ok());
        assert!(elements(DType::F32, 10).unwrap_err().to_string().contains("10 bytes"));
    }
}
