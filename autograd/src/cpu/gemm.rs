//! Safe entry points to `matrixmultiply`'s strided GEMM (the crate's only unsafe).
//!
//! A matrix is `(elements, offset, row_stride, col_stride)`; every element the shape reaches
//! is bounds-checked before the call.

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
        /// `c[m×n] = a[m×k] · b[k×n]`, `c` contiguous row-major.
        pub fn $name(
            m: usize,
            k: usize,
            n: usize,
            a: (&[$t], usize, isize, isize),
            b: (&[$t], usize, isize, isize),
            c: &mut [$t],
        ) {
            check("a", a, m, k);
            check("b", b, k, n);
            assert!(c.len() >= m * n, "c: {} elements for {m}×{n}", c.len());
            if m == 0 || n == 0 {
                return;
            }
            if k == 0 {
                c[..m * n].fill(0.0);
                return;
            }
            // SAFETY: the checks above prove that every element `a`, `b` and `c` reach (offset +
            // i·row_stride + j·col_stride within the given shapes) lies inside its slice; `c` is
            // borrowed mutably and `a`/`b` immutably, so nothing else writes them meanwhile;
            // with beta = 0 the kernel never reads `c`.
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
                )
            }
        }
    };
}

gemm!(sgemm, f32, matrixmultiply::sgemm);
gemm!(dgemm, f64, matrixmultiply::dgemm);
