//! Safe entry points to `matrixmultiply`'s strided GEMM (the crate's only unsafe).
//!
//! A matrix is `(elements, offset, row_stride, col_stride)`; every element the shape reaches
//! is bounds-checked before the call. The product is returned as a new row-major vector.

fn check<T>(what: &str, (data, offset, rs, cs): (&[T], usize, isize, isize), rows: usize, cols: usize) {
    assert!(rs >= 0 && cs >= 0, "{what}: negative strides");
    if rows > 0 && cols > 0 {
        // Checked: a stride large enough to wrap must not pass the bounds check.
        let last = (rows - 1)
            .checked_mul(rs as usize)
            .and_then(|r| (cols - 1).checked_mul(cs as usize).and_then(|c| r.checked_add(c)))
            .and_then(|rc| rc.checked_add(offset));
        assert!(
            last.is_some_and(|last| last < data.len()),
            "{what}: element {last:?} outside {} elements",
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
            // Tests poison the output first, so an element the kernel left unwritten shows.
            #[cfg(test)]
            c.spare_capacity_mut().fill(std::mem::MaybeUninit::new(<$t>::NAN));
            // SAFETY: the checks above prove that every element `a` and `b` reach (offset +
            // i·row_stride + j·col_stride within the given shapes) lies inside its slice, and
            // `c` has room for the m×n row-major elements the kernel writes (row stride n,
            // column stride 1, none aliasing). With beta = 0, C "does not need to be
            // initialized" (matrixmultiply's documentation): the first block of k writes every
            // element of `c` before any later block reads it back to accumulate, so all `len`
            // are initialized before `set_len`. `a` and `b` are borrowed immutably and `c` is
            // ours alone.
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
    /// Every element of the product is the kernel's, for empty, skinny, transposed, offset and
    /// deep shapes (k past the kernel's 256-deep blocks, m past its 64-row blocks), in both
    /// precisions: the output is never zeroed, and tests poison it with NaN first, so an
    /// element the kernel skipped fails the comparison.
    #[test]
    fn every_element_is_written() {
        let shapes = [
            (1, 1, 1),
            (3, 0, 2),
            (0, 4, 5),
            (4, 3, 0),
            (5, 7, 3),
            (33, 17, 65),
            (70, 300, 9),
        ];
        for &(m, k, n) in &shapes {
            // `a` starts 3 elements in; `b` is stored transposed (n×k) and read as k×n.
            let off = 3;
            let a: Vec<f64> = (0..off + m * k).map(|i| (i % 7) as f64 - 3.0).collect();
            let bt: Vec<f64> = (0..k * n).map(|i| (i % 5) as f64 * 0.5 + 1.0).collect();
            let want = |i: usize, j: usize| -> f64 { (0..k).map(|l| a[off + i * k + l] * bt[j * k + l]).sum() };
            let c = super::dgemm(m, k, n, (&a, off, k as isize, 1), (&bt, 0, 1, k as isize));
            let a32: Vec<f32> = a.iter().map(|&x| x as f32).collect();
            let bt32: Vec<f32> = bt.iter().map(|&x| x as f32).collect();
            let c32 = super::sgemm(m, k, n, (&a32, off, k as isize, 1), (&bt32, 0, 1, k as isize));
            assert_eq!((c.len(), c32.len()), (m * n, m * n));
            for i in 0..m {
                for j in 0..n {
                    // Small integers and halves: every sum is exact in both precisions.
                    assert_eq!(c[i * n + j], want(i, j), "f64 ({i}, {j}) of {m}×{k}×{n}");
                    assert_eq!(c32[i * n + j] as f64, want(i, j), "f32 ({i}, {j}) of {m}×{k}×{n}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn a_stride_that_would_wrap_is_refused() {
        let a = [1.0f64; 4];
        let _ = super::dgemm(2, 2, 2, (&a, 0, isize::MAX, 1), (&a, 0, 2, 1));
    }
}
