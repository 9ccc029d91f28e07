//! The agent's messages (requests, responses, hellos) and membership entries from the store.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = sluice_agent::wire::decode(data);
    sluice_agent::membership::fuzz_listing(data);
});
