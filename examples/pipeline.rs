//! `sluice demo pipeline` as an example: `cargo run --release --example pipeline -- --help`.
//! The demo's code and documentation are in `src/demos/pipeline.rs`.

fn main() -> anyhow::Result<()> {
    sluice::demos::example_main("pipeline")
}
