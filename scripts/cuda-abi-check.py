#!/usr/bin/env python3
"""Checks the CUDA driver signatures Sluice declares against NVIDIA's own cuda.h.

Both sides are read mechanically: the prototypes in cuda.h (NVIDIA's runtime wheel ships it),
Sluice's declarations in cuda/src/driver.rs (`entry_points!`: what Sluice calls) and the driver
model's exports in cuda-model/src/api.rs (what the model answers). Each parameter is reduced to
its calling-convention class (pointer, 8/32/64-bit integer, size_t, a 64-byte IPC handle by
value): a mismatch in count or class is an error, as is a name cuda.h does not declare.

    scripts/cuda-abi-check.py path/to/cuda.h [path/to/nvrtc.h] [path/to/cublas_api.h]

With nvrtc.h and cublas_api.h, the model's stand-ins for NVRTC and cuBLAS are checked too.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Types to calling-convention classes, on x86-64 / aarch64 Linux. A pointer's class names what
# it points at ("ptr:u64"), so an output of the wrong width is caught too. Opaque handles
# (typedef'd pointers) are "ptr:void", as Rust declares them.
C_CLASSES = {
    "int": "i32", "CUdevice": "i32", "CUdevice_attribute": "i32", "CUpointer_attribute": "i32",
    "CUmemRangeHandleType": "i32", "CUflushGPUDirectRDMAWritesTarget": "i32",
    "CUflushGPUDirectRDMAWritesScope": "i32", "CUresult": "i32",
    "cublasOperation_t": "i32", "libraryPropertyType": "i32",
    "unsigned int": "u32", "unsigned char": "u8", "char": "i8", "size_t": "usize",
    "CUdeviceptr": "u64", "unsigned long long": "u64", "float": "f32", "double": "f64",
    "void": "void", "CUuuid": "uuid16",
    "CUcontext": "ptr:void", "CUstream": "ptr:void", "CUevent": "ptr:void",
    "CUmodule": "ptr:void", "CUfunction": "ptr:void", "nvrtcProgram": "ptr:void",
    "cublasHandle_t": "ptr:void", "cudaStream_t": "ptr:void",
    "CUipcMemHandle": "ipc64", "CUipcEventHandle": "ipc64",
}

RUST_CLASSES = {
    "c_int": "i32", "i32": "i32", "c_uint": "u32", "u32": "u32", "u8": "u8", "u64": "u64",
    "usize": "usize", "c_char": "i8", "f32": "f32", "f64": "f64", "c_void": "void",
    "Ptr": "ptr:void", "IpcHandle": "ipc64", "CuUuid": "uuid16", "[u8; 16]": "uuid16",
    "T": "generic",
}


def c_class(param):
    p = re.sub(r"/\*.*?\*/", " ", param)
    levels = p.count("*")
    words = re.sub(r"\bconst\b", " ", p).replace("*", " ").split()
    # Drop the parameter's name (the last word), keep the type.
    ty = " ".join(words[:-1]) if len(words) > 1 else words[0]
    if ty not in C_CLASSES:
        raise SystemExit(f"cuda-abi-check: no class for C type {ty!r} (in {param!r})")
    return "ptr:" * levels + C_CLASSES[ty]


def rust_class(ty):
    ty = ty.strip()
    levels = 0
    while True:
        m = re.match(r"\*(mut|const)\s+", ty)
        if not m:
            break
        levels += 1
        ty = ty[m.end():]
    if ty not in RUST_CLASSES:
        raise SystemExit(f"cuda-abi-check: no class for Rust type {ty!r}")
    return "ptr:" * levels + RUST_CLASSES[ty]


def renames(text):
    """cuda.h's `#define cuX cuX_vN` (also through the per-thread-stream macros): base name to
    the names it may stand for."""
    out = {}
    for a, b in re.findall(r"(?m)^#define\s+(cu\w+)\s+(?:__CUDA_API_\w+\()?(cu\w+)\)?\s*$", text):
        out.setdefault(a, set()).add(b)
    return out


def public_part(text):
    """cuda.h without the section for the library's own legacy builds (its last
    `#if defined(__CUDA_API_VERSION_INTERNAL)` block, near the end of the file)."""
    cut = text.rfind("#if defined(__CUDA_API_VERSION_INTERNAL)\n")
    return text[:cut] if cut > len(text) // 2 else text


def classes_of(params):
    return [] if params in ("", "void") else [c_class(p) for p in params.split(",")]


def split_params(params):
    out, depth, cur = [], 0, ""
    for ch in params:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [p.strip() for p in out if p.strip()]


def sluice_declarations():
    text = (ROOT / "cuda/src/driver.rs").read_text()
    block = text[text.index("entry_points! {"):]
    block = block[: block.index("\n}\n")]
    decls = {}
    for m in re.finditer(r"(cu\w+)\(([^;]*)\);", block):
        decls[m.group(1)] = [rust_class(t) for t in split_params(m.group(2))]
    return decls


def exports(pattern, *files):
    """The model's `extern "C"` functions whose names match `pattern`, in `files`: their
    parameters' classes."""
    text = "".join((ROOT / f).read_text() for f in files)
    out = {}
    for m in re.finditer(r'extern "C" fn (' + pattern + r')\(([^)]*)\)\s*->\s*c_int', text, re.S):
        out[m.group(1)] = [rust_class(p.split(":", 1)[1]) for p in split_params(m.group(2))]
    return out


def prototypes(text, names):
    """The parameters of each of `names` declared in `text`, the first declaration of each (a
    declaration starts its line with its return type; comment lines start with `*`)."""
    found = {}
    for name in names:
        m = re.search(r"(?m)^[ \t]*[A-Za-z_][\w \t\*]*?\b" + name + r"\s*\(([^;{]*?)\)\s*;", text)
        if m:
            found[name] = " ".join(re.sub(r"/\*.*?\*/", " ", m.group(1)).split())
    return found


def check_library(header, prefix, problems):
    found = exports(prefix + r"\w*", "cuda-model/src/compute.rs")
    protos = prototypes(Path(header).read_text(errors="replace"), found)
    for name, classes in sorted(found.items()):
        if name not in protos:
            problems.append(f"cuda-model/src/compute.rs: {name}: {header} declares no {name}")
        elif classes_of(protos[name]) != classes:
            problems.append(
                f"cuda-model/src/compute.rs: {name}: the header has ({', '.join(classes_of(protos[name]))}), we have ({', '.join(classes)})"
            )
    print(f"cuda-abi-check: cuda-model/src/compute.rs: {len(found)} {prefix} entry points against {Path(header).name}")


def main():
    if not 2 <= len(sys.argv) <= 4:
        raise SystemExit(__doc__)
    text = Path(sys.argv[1]).read_text(errors="replace")
    ours = sluice_declarations()
    model = exports(r"cu[A-Z]\w*", "cuda-model/src/api.rs", "cuda-model/src/compute.rs")
    names = renames(text)
    wanted = {n for decl in (ours, model) for d in decl for n in (d, d[:-3] if d.endswith("_v2") else d)}
    protos = prototypes(public_part(text), wanted)
    problems = []
    for header, prefix in zip(sys.argv[2:], ("nvrtc", "cublas")):
        check_library(header, prefix, problems)
    for side, decls in (("cuda/src/driver.rs", ours), ("cuda-model/src/api.rs + compute.rs", model)):
        for name, classes in sorted(decls.items()):
            base = name[:-3] if name.endswith("_v2") else name
            if base in names and name not in names[base]:
                problems.append(
                    f"{side}: {name}: cuda.h makes {base} mean {' or '.join(sorted(names[base]))}: declare that symbol"
                )
            params = protos.get(name, protos.get(base))
            want = None if params is None else classes_of(params)
            if want is None:
                problems.append(f"{side}: {name}: cuda.h declares no {name} or {base}")
            elif want != classes:
                problems.append(f"{side}: {name}: cuda.h has ({', '.join(want)}), we have ({', '.join(classes)})")
        print(f"cuda-abi-check: {side}: {len(decls)} entry points against cuda.h")
    for name in sorted(set(ours) - set(model)):
        if name not in ("cuFlushGPUDirectRDMAWrites", "cuMemGetHandleForAddressRange"):
            problems.append(f"cuda-model/src/api.rs: exports no {name}, which Sluice requires")
    for p in problems:
        print(f"cuda-abi-check: {p}", file=sys.stderr)
    if problems:
        raise SystemExit(1)
    print("cuda-abi-check: every signature matches NVIDIA's headers")


if __name__ == "__main__":
    main()
