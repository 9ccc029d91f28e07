//! Writes the C header from the exported functions (`src/api/`), their doc comments and the
//! status constants (`src/status.rs`) into `$OUT_DIR/sluice.h`. The checked-in copy,
//! `include/sluice.h`, is compared with it by `tests/header.rs`, which also rewrites it when
//! `SLUICE_BLESS_HEADER=1`.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("capi/cbindgen.toml");
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen could not generate the C header")
        .write_to_file(out.join("sluice.h"));
}
