//! The CUDA C++ of every autograd kernel, compiled once per device with NVRTC.
//!
//! Conventions: one thread per output element (per row for softmax); shapes and strides travel
//! as a `Dims` struct of eight `unsigned long long` by value; offsets and strides count
//! elements. Each template is instantiated for `float` (`_f32`) and `double` (`_f64`).

/// Op codes shared with `launch::Op` (the numbers must match).
pub const SOURCE: &str = r#"
typedef unsigned long long u64;
struct Dims { u64 v[8]; };

__device__ __forceinline__ float f_exp(float x) { return expf(x); }
__device__ __forceinline__ double f_exp(double x) { return exp(x); }
__device__ __forceinline__ float f_log(float x) { return logf(x); }
__device__ __forceinline__ double f_log(double x) { return log(x); }
__device__ __forceinline__ float f_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double f_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float f_cos(float x) { return cosf(x); }
__device__ __forceinline__ double f_cos(double x) { return cos(x); }
__device__ __forceinline__ float f_sin(float x) { return sinf(x); }
__device__ __forceinline__ double f_sin(double x) { return sin(x); }
__device__ __forceinline__ float f_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double f_sqrt(double x) { return sqrt(x); }

// The storage offset of row-major element `i` of `shape` under `strides`.
__device__ __forceinline__ u64 at(u64 i, int nd, const Dims& shape, const Dims& strides) {
    u64 off = 0;
    for (int d = nd - 1; d >= 0; --d) {
        u64 n = shape.v[d];
        off += (i % n) * strides.v[d];
        i /= n;
    }
    return off;
}

__device__ __forceinline__ u64 tid() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }

template <typename T> __device__ T unary_op(int op, T x, double s) {
    switch (op) {
    case 0: return -x;
    case 1: return f_exp(x);
    case 2: return f_log(x);
    case 3: return x > T(0) ? x : T(0);
    case 4: return f_tanh(x);
    case 5: return T(1) / (T(1) + f_exp(-x));
    case 6: return f_cos(x);
    case 7: return f_sin(x);
    case 8: return f_sqrt(x);
    case 9: return x * T(s);
    case 10: return x + T(s);
    }
    return x;
}

template <typename T> __device__ T binary_op(int op, T x, T y) {
    switch (op) {
    case 20: return x + y;
    case 21: return x - y;
    case 22: return x * y;
    case 23: return x / y;
    case 24: return y > T(0) ? x : T(0);      // relu backward: g, input
    case 25: return x * (T(1) - y * y);       // tanh backward: g, output
    case 26: return x * y * (T(1) - y);       // sigmoid backward: g, output
    case 27: return -x * f_sin(y);            // cos backward: g, input
    case 28: return x * f_cos(y);             // sin backward: g, input
    case 29: return -x / (y * y);             // quotient backward for the divisor: g·a, b
    case 30: return y;                        // broadcast the second operand
    }
    return x;
}

template <typename T>
__device__ void unary(int op, const T* x, T* out, u64 n, int nd, Dims shape, Dims sx, u64 ox, double s) {
    u64 i = tid();
    if (i < n) out[i] = unary_op<T>(op, x[ox + at(i, nd, shape, sx)], s);
}

template <typename T>
__device__ void binary(int op, const T* a, const T* b, T* out, u64 n, int nd, Dims shape, Dims sa, u64 oa,
                       Dims sb, u64 ob) {
    u64 i = tid();
    if (i < n) out[i] = binary_op<T>(op, a[oa + at(i, nd, shape, sa)], b[ob + at(i, nd, shape, sb)]);
}

template <typename T>
__device__ void copy(const T* src, T* dst, u64 n, int nd, Dims shape, Dims ss, u64 os, Dims sd, u64 od) {
    u64 i = tid();
    if (i < n) dst[od + at(i, nd, shape, sd)] = src[os + at(i, nd, shape, ss)];
}

// One thread per output element: `kept` is the shape with reduced dims 1, `red` the shape
// with kept dims 1; both address the input through its strides.
template <typename T>
__device__ void sum(const T* x, T* out, u64 n_out, u64 n_red, u64 chunk, u64 parts, int nd, Dims kept,
                    Dims red, Dims sx, u64 ox) {
    // Thread t sums part t % parts (`chunk` consecutive reduced indices) of output t / parts
    // into out[t]; with parts = 1, the whole reduction of each output.
    u64 t = tid();
    if (t >= n_out * parts) return;
    u64 o = t / parts, begin = (t % parts) * chunk;
    u64 end = begin + chunk < n_red ? begin + chunk : n_red;
    u64 base = ox + at(o, nd, kept, sx);
    T acc = T(0);
    for (u64 r = begin; r < end; ++r) acc += x[base + at(r, nd, red, sx)];
    out[t] = acc;
}

template <typename T>
__device__ void softmax(const T* x, T* y, u64 rows, u64 cols, int log_) {
    u64 r = tid();
    if (r >= rows) return;
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T m = xr[0];
    for (u64 c = 1; c < cols; ++c) m = xr[c] > m ? xr[c] : m;
    T s = T(0);
    for (u64 c = 0; c < cols; ++c) s += f_exp(xr[c] - m);
    if (log_) {
        T ls = f_log(s);
        for (u64 c = 0; c < cols; ++c) yr[c] = xr[c] - m - ls;
    } else {
        for (u64 c = 0; c < cols; ++c) yr[c] = f_exp(xr[c] - m) / s;
    }
}

template <typename T>
__device__ void softmax_backward(const T* y, const T* g, T* dx, u64 rows, u64 cols, int log_) {
    u64 r = tid();
    if (r >= rows) return;
    const T* yr = y + r * cols;
    const T* gr = g + r * cols;
    T* o = dx + r * cols;
    T s = T(0);
    if (log_) {
        for (u64 c = 0; c < cols; ++c) s += gr[c];
        for (u64 c = 0; c < cols; ++c) o[c] = gr[c] - f_exp(yr[c]) * s;
    } else {
        for (u64 c = 0; c < cols; ++c) s += gr[c] * yr[c];
        for (u64 c = 0; c < cols; ++c) o[c] = yr[c] * (gr[c] - s);
    }
}

// Mean negative log-likelihood, summed by one thread in row order (as the CPU does).
template <typename T>
__device__ void nll(const T* logp, const long long* t, T* out, u64 rows, u64 cols) {
    if (tid() != 0) return;
    T s = T(0);
    for (u64 i = 0; i < rows; ++i) s += logp[i * cols + (u64)t[i]];
    out[0] = -s / T(rows > 0 ? rows : 1);
}

template <typename T>
__device__ void nll_backward(const T* g, const long long* t, T* dx, u64 rows, u64 cols) {
    u64 i = tid();
    if (i < rows) dx[i * cols + (u64)t[i]] = -g[0] / T(rows);
}

template <typename T>
__device__ void adam(const T* p, const T* g, const T* m, const T* v, T* po, T* mo, T* vo, u64 n, double lr,
                     double b1, double b2, double eps, double c1, double c2) {
    u64 i = tid();
    if (i >= n) return;
    double gi = (double)g[i];
    double mi = b1 * (double)m[i] + (1.0 - b1) * gi;
    double vi = b2 * (double)v[i] + (1.0 - b2) * gi * gi;
    mo[i] = T(mi);
    vo[i] = T(vi);
    po[i] = T((double)p[i] - lr * (mi / c1) / (sqrt(vi / c2) + eps));
}

#define FLOAT_KERNELS(T, S)                                                                          \
extern "C" __global__ void unary_##S(int op, const T* x, T* out, u64 n, int nd, Dims shape, Dims sx,  \
                                     u64 ox, double s) { unary<T>(op, x, out, n, nd, shape, sx, ox, s); } \
extern "C" __global__ void binary_##S(int op, const T* a, const T* b, T* out, u64 n, int nd,         \
                                      Dims shape, Dims sa, u64 oa, Dims sb, u64 ob) {                  \
    binary<T>(op, a, b, out, n, nd, shape, sa, oa, sb, ob); }                                         \
extern "C" __global__ void sum_##S(const T* x, T* out, u64 n_out, u64 n_red, u64 chunk, u64 parts,   \
                                   int nd, Dims kept, Dims red, Dims sx, u64 ox) {                     \
    sum<T>(x, out, n_out, n_red, chunk, parts, nd, kept, red, sx, ox); }                              \
extern "C" __global__ void softmax_##S(const T* x, T* y, u64 rows, u64 cols, int log_) {             \
    softmax<T>(x, y, rows, cols, log_); }                                                             \
extern "C" __global__ void softmax_backward_##S(const T* y, const T* g, T* dx, u64 rows, u64 cols,   \
                                                int log_) { softmax_backward<T>(y, g, dx, rows, cols, log_); } \
extern "C" __global__ void nll_##S(const T* logp, const long long* t, T* out, u64 rows, u64 cols) {  \
    nll<T>(logp, t, out, rows, cols); }                                                               \
extern "C" __global__ void nll_backward_##S(const T* g, const long long* t, T* dx, u64 rows,         \
                                            u64 cols) { nll_backward<T>(g, t, dx, rows, cols); }      \
extern "C" __global__ void adam_##S(const T* p, const T* g, const T* m, const T* v, T* po, T* mo,    \
                                    T* vo, u64 n, double lr, double b1, double b2, double eps,        \
                                    double c1, double c2) {                                           \
    adam<T>(p, g, m, v, po, mo, vo, n, lr, b1, b2, eps, c1, c2); }

FLOAT_KERNELS(float, f32)
FLOAT_KERNELS(double, f64)

// Copies move elements of any type by size.
extern "C" __global__ void copy_b2(const unsigned short* s, unsigned short* d, u64 n, int nd, Dims shape,
                                   Dims ss, u64 os, Dims sd, u64 od) {
    copy<unsigned short>(s, d, n, nd, shape, ss, os, sd, od); }
extern "C" __global__ void copy_b4(const unsigned int* s, unsigned int* d, u64 n, int nd, Dims shape,
                                   Dims ss, u64 os, Dims sd, u64 od) {
    copy<unsigned int>(s, d, n, nd, shape, ss, os, sd, od); }
extern "C" __global__ void copy_b8(const u64* s, u64* d, u64 n, int nd, Dims shape, Dims ss, u64 os,
                                   Dims sd, u64 od) { copy<u64>(s, d, n, nd, shape, ss, os, sd, od); }

extern "C" __global__ void cast_f32_f64(const float* s, double* d, u64 n) {
    u64 i = tid(); if (i < n) d[i] = (double)s[i]; }
extern "C" __global__ void cast_f64_f32(const double* s, float* d, u64 n) {
    u64 i = tid(); if (i < n) d[i] = (float)s[i]; }
"#;

#[cfg(test)]
mod tests {
    use super::SOURCE;

    /// The parameters of `.entry name(...)` in PTX, as (type, byte size for arrays).
    fn params(ptx: &str, entry: &str) -> Option<Vec<String>> {
        let start = ptx.find(&format!(".entry {entry}("))?;
        let body = &ptx[start..ptx[start..].find(')')? + start];
        Some(
            body.lines()
                .filter(|l| l.contains(".param"))
                .map(|l| {
                    let l = l.trim().trim_end_matches(',');
                    let ty = l
                        .split_whitespace()
                        .find(|w| {
                            w.starts_with(".u") || w.starts_with(".s") || w.starts_with(".f") || w.starts_with(".b")
                        })
                        .unwrap_or("?");
                    if l.contains('[') {
                        format!("{ty}[{}]", l.split('[').nth(1).unwrap_or("").trim_end_matches(']'))
                    } else {
                        ty.to_owned()
                    }
                })
                .collect(),
        )
    }

    /// Compiles every kernel with NVRTC through Sluice's own loader, for Ampere and Hopper, and
    /// checks each entry's parameters against what `launch` passes. Runs wherever libnvrtc is
    /// found (CI installs NVRTC from PyPI for this); no GPU needed.
    #[test]
    fn kernels_compile_and_take_the_arguments_launch_passes() {
        if !sluice_cuda::gate::nvrtc_or_skip("kernels_compile_and_take_the_arguments_launch_passes") {
            return;
        }
        let ptx = sluice_cuda::compute::ptx_for(SOURCE, "check.cu", (9, 0))
            .unwrap()
            .into_string()
            .expect("PTX is text");
        sluice_cuda::compute::ptx_for(SOURCE, "check.cu", (8, 0)).expect("compute_80");
        // Argument kinds as `launch` passes them: p pointer, u u64, i int, d double, D Dims.
        let expect = [
            ("unary", "ippuiDDud"),
            ("binary", "ipppuiDDuDu"),
            ("sum", "ppuuuuiDDDu"),
            ("softmax", "ppuui"),
            ("softmax_backward", "pppuui"),
            ("nll", "pppuu"),
            ("nll_backward", "pppuu"),
            ("adam", "pppppppudddddd"),
        ];
        let kind = |p: &str| match p {
            ".u32" | ".s32" => 'i',
            ".u64" | ".s64" => 'u',
            ".f64" => 'd',
            ".b8[64]" => 'D',
            other => panic!("unexpected parameter {other}"),
        };
        for (name, sig) in expect {
            for s in ["f32", "f64"] {
                let entry = format!("{name}_{s}");
                let got: String = params(&ptx, &entry)
                    .unwrap_or_else(|| panic!("{entry} is missing"))
                    .iter()
                    .map(|p| kind(p))
                    .collect();
                // Pointers are .u64 in PTX: compare with pointers read as u64.
                assert_eq!(got, sig.replace('p', "u"), "{entry}");
            }
        }
        for (entry, sig) in [
            ("copy_b2", "uuuiDDuDu"),
            ("copy_b4", "uuuiDDuDu"),
            ("copy_b8", "uuuiDDuDu"),
            ("cast_f32_f64", "uuu"),
            ("cast_f64_f32", "uuu"),
        ] {
            let got: String = params(&ptx, entry)
                .unwrap_or_else(|| panic!("{entry} is missing"))
                .iter()
                .map(|p| kind(p))
                .collect();
            assert_eq!(got, sig, "{entry}");
        }
    }
}
