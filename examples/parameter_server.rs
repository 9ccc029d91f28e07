//! `sluice demo ps` as an example: `cargo run --release --example parameter_server -- --help`.
//! The demo's code and documentation are in `src/demos/ps.rs`.

fn main() -> anyhow::Result<()> {
    sluice::demos::example_main("ps")
}
