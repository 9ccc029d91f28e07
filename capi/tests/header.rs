//! The checked-in header (`include/sluice.h`) is what build.rs generates from the code, and it
//! compiles; the DLPack structures it declares have the layout the library was built with.
//!
//! To update the header after changing the API:
//! `SLUICE_BLESS_HEADER=1 cargo test -p sluice-capi --test header`.

use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use sluice_c::{DLDataType, DLDevice, DLTensor};

const GENERATED: &str = include_str!(concat!(env!("OUT_DIR"), "/sluice.h"));

fn checked_in() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include/sluice.h")
}

#[test]
fn checked_in_header_is_current() {
    let path = checked_in();
    if std::env::var_os("SLUICE_BLESS_HEADER").is_some() {
        std::fs::write(&path, GENERATED).unwrap();
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == GENERATED,
        "{} is stale: regenerate it with `SLUICE_BLESS_HEADER=1 cargo test -p sluice-capi --test header`",
        path.display()
    );
}

/// The layout `include/sluice.h` asserts for C (`SLUICE_LAYOUT_ASSERT`), checked here for Rust.
#[test]
fn dlpack_layout_is_the_one_the_header_asserts() {
    let p = size_of::<*mut u8>();
    assert_eq!(size_of::<DLDevice>(), 8);
    assert_eq!(size_of::<DLDataType>(), 4);
    assert_eq!(offset_of!(DLTensor, device), p);
    assert_eq!(offset_of!(DLTensor, ndim), p + 8);
    assert_eq!(offset_of!(DLTensor, dtype), p + 12);
    assert_eq!(offset_of!(DLTensor, shape), p + 16);
    assert_eq!(offset_of!(DLTensor, strides), 2 * p + 16);
    assert_eq!(offset_of!(DLTensor, byte_offset), 3 * p + 16);
}

/// Compiles a file that includes the header as C11 and as C++ with warnings as errors, with
/// and without dlpack.h's include guard defined first (skipped where there is no compiler).
#[test]
fn header_compiles_as_c_and_cpp() {
    let dir = std::env::temp_dir().join(format!("sluice-capi-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let uses = "int main(void) { DLTensor t; sluice_message *m = 0; (void)t; \
                return sluice_message_new(&m) == SLUICE_OK ? 0 : 1; }\n";
    let mut compiled = 0;
    for (compiler, ext, std) in [("cc", "c", "-std=c11"), ("c++", "cpp", "-std=c++11")] {
        for prelude in ["", "#define DLPACK_DLPACK_H_\n#include <stdint.h>\ntypedef struct { void *data; struct { int32_t device_type; int32_t device_id; } device; int32_t ndim; struct { uint8_t code; uint8_t bits; uint16_t lanes; } dtype; int64_t *shape; int64_t *strides; uint64_t byte_offset; } DLTensor;\ntypedef struct { int32_t device_type; int32_t device_id; } DLDevice;\ntypedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataType;\n"] {
            let src = dir.join(format!("use{}.{ext}", prelude.len()));
            std::fs::write(&src, format!("{prelude}#include \"sluice.h\"\n{uses}")).unwrap();
            let out = Command::new(compiler)
                .args([std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-fsyntax-only", "-I"])
                .arg(&include)
                .arg(&src)
                .output();
            let Ok(out) = out else {
                eprintln!("{compiler} not found: skipped");
                continue;
            };
            assert!(
                out.status.success(),
                "{compiler} {}: {}",
                src.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            compiled += 1;
        }
    }
    eprintln!("compiled the header {compiled} ways");
    let _ = std::fs::remove_dir_all(&dir);
}
