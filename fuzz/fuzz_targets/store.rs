//! The embedded store's protocol: any request frame, answered against a scratch store.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    sluice_agent::store::tcp::fuzz_request(data);
});
