//! `sluice demo ddp` as an example: `cargo run --release --example data_parallel -- --help`.
//! The demo's code and documentation are in `src/demos/ddp.rs`.

fn main() -> anyhow::Result<()> {
    sluice::demos::example_main("ddp")
}
