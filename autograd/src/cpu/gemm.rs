//! Safe entry points to `matrixmultiply`'s strided GEMM (the crate's only unsafe).
//!
//! A matrix is `(elements, offset, row_stride, col_stride)`; every element the shape reaches
//! is bounds-checked before the call. The product is returned as a new row-major vector.

fn check<T>(what: &str, (data, offset, rs, cs): (&[T], usize, isize, isize), rows: usize, cols: usize) {
    assert!(rs >= 0 && cs >= 0, "{what}: negative strides");
    if rows > 0 && cols > 0 {
        let last = offset + (rows - 1) * rs as usize + (cols - 1) * cs as usize;
        assert!(
            last < data.len(),
            "{what}: element {last} outside {} elements",
            data.len()
        );
    }
}

macro_rules! gemm {
    ($name:ident, $t:ty, $kernel:path) => {
        /// `a[m×k] · b[k×n]`, contiguous row-major. The output is written by the kernel alone:
        /// it is never zeroed first (a 1024² gradient's zeroing cost a quarter of a training
        /// step's update on a thread whose allocator could not hand out fresh pages).
        pub fn $name(
            m: usize,
            k: usize,
            n: usize,
            a: (&[$t], usize, isize, isize),
            b: (&[$t], usize, isize, isize),
        ) -> Vec<$t> {
            check("a", a, m, k);
            check("b", b, k, n);
            let len = m.checked_mul(n).expect("gemm output size overflows");
            if len == 0 || k == 0 {
                return vec![0.0; len];
            }
            let mut c: Vec<$t> = Vec::with_capacity(len);
            // SAFETY: the checks above prove that every element `a` and `b` reach (offset +
            // i·row_stride + j·col_stride within the given shapes) lies inside its slice, and
            // `c` has room for the m×n row-major elements the kernel writes (row stride n,
            // column stride 1, none aliasing). With beta = 0 the kernel never reads `c`
            // ("if β is zero, then C does not need to be initialized", matrixmultiply's
            // documentation) and writes each of its m·n elements, so all `len` are initialized
            // before `set_len`. `a` and `b` are borrowed immutably and `c` is ours alone.
            unsafe {
                $kernel(
                    m,
                    k,
                    n,
                    1.0,
                    a.0.as_ptr().add(a.1),
                    a.2,
                    a.3,
                    b.0.as_ptr().add(b.1),
                    b.2,
                    b.3,
                    0.0,
                    c.as_mut_ptr(),
                    n as isize,
                    1,
                );
                c.set_len(len);
            }
            c
        }
    };
}

gemm!(sgemm, f32, matrixmultiply::sgemm);
gemm!(dgemm, f64, matrixmultiply::dgemm);

#[cfg(test)]
mod tests {
    /// Every element of the product is the kernel's, for empty, skinny and transposed shapes:
    /// the output is never zeroed first, so an element the kernel skipped would be garbage.
    #[test]
    fn every_element_is_written() {
        for &(m, k, n) in &[(1, 1, 1), (3, 0, 2), (0, 4, 5), (4, 3, 0), (5, 7, 3), (33, 17, 65)] {
            let a: Vec<f64> = (0..m * k).map(|i| (i % 7) as f64 - 3.0).collect();
            // `b` stored transposed (n×k), read as k×n through its strides.
            let bt: Vec<f64> = (0..k * n).map(|i| (i % 5) as f64 * 0.5).collect();
            let c = super::dgemm(m, k, n, (&a, 0, k as isize, 1), (&bt, 0, 1, k as isize));
            assert_eq!(c.len(), m * n);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|l| a[i * k + l] * bt[j * k + l]).sum();
                    assert_eq!(c[i * n + j], want, "({i}, {j}) of {m}×{k}×{n}");
                }
            }
        }
    }
}
