//! Frames inside an established pipe: message descriptors and acknowledgements.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_channel::wire::{decode, Ack, WireDescriptor};

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = decode::<WireDescriptor>(data, "fuzz") {
        // Sizes are summed the way a receiver budgets them: never overflowing.
        let _ = d.payloads.iter().fold(0u64, |a, &l| a.saturating_add(l));
    }
    let _ = decode::<Ack>(data, "fuzz");
});
