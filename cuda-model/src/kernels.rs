//! Kernels under the model: a stand-in for NVRTC that compiles the same CUDA C++ with the host
//! C++ compiler (`$CXX`, else `c++`) against a small shim header, and module loading and
//! launches that run each launch as a loop over grid and block on the stream's thread.
//!
//! What this checks: kernel logic, indexing, strides and launch arguments (count, sizes, which
//! are device pointers, into live allocations). Not NVRTC's code generation, not parallel
//! execution (threads of a launch run one after another, so a kernel relying on barriers,
//! shared memory or atomics would need more than this shim offers; Sluice's have none).
//!
//! The "image" NVRTC returns is the compiled shared object behind a magic and its length; the launcher of each
//! `extern "C" __global__` kernel is generated from its signature (found by preprocessing the
//! source), with the size of each parameter and whether it is a pointer.

use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

pub const IMAGE_MAGIC: &[u8; 8] = b"SLMDLKRN";

const SHIM: &str = r#"
#include <cmath>
#include <cstdint>
struct __sluice_dim3 { unsigned x, y, z; };
static thread_local __sluice_dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
"#;

/// One kernel's signature: its name and its parameters' types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    pub name: String,
    pub params: Vec<String>,
}

/// The `extern "C" __global__` kernels in preprocessed source where `__global__` became
/// `__sluice_kernel__`.
pub fn kernels(expanded: &str) -> Vec<Kernel> {
    let text = expanded.split_whitespace().collect::<Vec<_>>().join(" ");
    let marker = "extern \"C\" __sluice_kernel__ void ";
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find(marker) {
        rest = &rest[i + marker.len()..];
        let Some(open) = rest.find('(') else { break };
        let name = rest[..open].trim().to_owned();
        let mut depth = 0;
        let mut end = open;
        for (j, c) in rest[open..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let params = rest[open + 1..end]
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty() && *p != "void")
            .map(|p| {
                // The type is all but the parameter's name.
                let cut = p
                    .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .map_or(0, |k| k + 1);
                p[..cut].trim().to_owned()
            })
            .collect();
        out.push(Kernel { name, params });
        rest = &rest[end..];
    }
    out
}

/// The launcher, sizes and pointer flags of each kernel, as C++.
pub fn launchers(kernels: &[Kernel]) -> String {
    let mut s = String::new();
    for k in kernels {
        let n = k.params.len();
        let sizes: Vec<String> = k.params.iter().map(|t| format!("sizeof({t})")).collect();
        let ptrs: Vec<&str> = k
            .params
            .iter()
            .map(|t| if t.contains('*') { "1" } else { "0" })
            .collect();
        let args: Vec<String> = k
            .params
            .iter()
            .enumerate()
            .map(|(i, t)| format!("*reinterpret_cast<{t}*>(p[{i}])"))
            .collect();
        s += &format!(
            "extern \"C\" const unsigned long long __sluice_sizes_{name}[] = {{ {sizes} }};\n\
             extern \"C\" const unsigned char __sluice_ptrs_{name}[] = {{ {ptrs} }};\n\
             extern \"C\" const int __sluice_nparams_{name} = {n};\n\
             extern \"C\" void __sluice_launch_{name}(void** p, const unsigned* d) {{\n\
             (void)p;\n\
             gridDim = {{d[0], d[1], d[2]}}; blockDim = {{d[3], d[4], d[5]}};\n\
             for (unsigned bz = 0; bz < d[2]; ++bz) for (unsigned by = 0; by < d[1]; ++by)\n\
             for (unsigned bx = 0; bx < d[0]; ++bx) for (unsigned tz = 0; tz < d[5]; ++tz)\n\
             for (unsigned ty = 0; ty < d[4]; ++ty) for (unsigned tx = 0; tx < d[3]; ++tx) {{\n\
             blockIdx = {{bx, by, bz}}; threadIdx = {{tx, ty, tz}};\n\
             {name}({args});\n\
             }}\n}}\n",
            name = k.name,
            sizes = if n == 0 { "0".into() } else { sizes.join(", ") },
            ptrs = if n == 0 { "0".into() } else { ptrs.join(", ") },
            args = args.join(", "),
        );
    }
    s
}

static PROGRAMS: AtomicU64 = AtomicU64::new(0);

/// Compiles `source` into an image (the magic, then a shared object); the error is the
/// compiler's output.
pub fn compile(source: &str) -> Result<Vec<u8>, String> {
    // A directory of our own, made fresh (it fails if the name exists, so nobody can have
    // planted links in it); its files are ours alone.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!(
        "sluice-cuda-model-{}-{}-{nanos:x}",
        std::process::id(),
        PROGRAMS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let body = format!("{SHIM}\n#line 1 \"kernels.cu\"\n{source}\n");
    let src = dir.join("kernels.cpp");
    std::fs::write(&src, &body).map_err(|e| e.to_string())?;
    let run = |args: &[&str]| -> Result<Vec<u8>, String> {
        let out = Command::new(&cxx)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run the host C++ compiler `{cxx}` ({e}); set CXX"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(out.stdout)
    };
    let src_s = src.to_string_lossy().into_owned();
    let expanded = run(&[
        "-E",
        "-P",
        "-x",
        "c++",
        "-std=c++17",
        "-D__global__=__sluice_kernel__",
        &src_s,
    ])?;
    let found = kernels(&String::from_utf8_lossy(&expanded));
    let full = dir.join("module.cpp");
    std::fs::write(&full, format!("{body}\n{}", launchers(&found))).map_err(|e| e.to_string())?;
    let so = dir.join("module.so");
    let (full_s, so_s) = (full.to_string_lossy().into_owned(), so.to_string_lossy().into_owned());
    run(&[
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-D__global__=",
        "-w",
        "-o",
        &so_s,
        &full_s,
    ])?;
    let so = std::fs::read(&so).map_err(|e| e.to_string())?;
    let mut image = IMAGE_MAGIC.to_vec();
    image.extend((so.len() as u64).to_le_bytes());
    image.extend(so);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_signatures_are_found_in_preprocessed_source() {
        let k = kernels(
            "struct Dims { unsigned long long v[8]; };\nextern \"C\" __sluice_kernel__ void add_f32(const float* a,\n float *b, unsigned long long n, Dims d) { }\n\
             extern \"C\" __sluice_kernel__ void none() {}",
        );
        assert_eq!(k.len(), 2);
        assert_eq!(k[0].name, "add_f32");
        assert_eq!(
            k[0].params,
            vec!["const float*", "float *", "unsigned long long", "Dims"]
        );
        assert!(k[1].params.is_empty());
        let l = launchers(&k);
        assert!(l.contains("__sluice_ptrs_add_f32[] = { 1, 1, 0, 0 }"), "{l}");
    }
}
