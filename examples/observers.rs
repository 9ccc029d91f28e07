//! `sluice demo rl` as an example: `cargo run --release --example observers -- --help`.
//! The demo's code and documentation are in `src/demos/rl.rs`.

fn main() -> anyhow::Result<()> {
    sluice::demos::example_main("rl")
}
