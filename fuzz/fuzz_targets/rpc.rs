//! The agent's messages (requests, responses, hellos) and membership entries from the store.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_agent::wire::{decode, Envelope};

fuzz_target!(|data: &[u8]| {
    // The agent's decoder (by hand) agrees with the serde-derived reference both ways: the
    // same envelope, or both refuse.
    let hand = decode(&data.to_vec().into()).ok().map(|e| format!("{e:?}"));
    let reference = postcard::from_bytes::<Envelope>(data).ok().map(|e| format!("{e:?}"));
    assert_eq!(hand, reference, "the hand decoder and postcard disagree");
    sluice_agent::membership::fuzz_listing(data);
});
