//! Frames inside an established pipe: message descriptors and acknowledgements.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_channel::wire::{decode, decode_descriptor, Ack, WireDescriptor};

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = decode::<WireDescriptor>(data, "fuzz") {
        // Sizes are summed the way a receiver budgets them: never overflowing.
        let _ = d.payloads.iter().fold(0u64, |a, &l| a.saturating_add(l));
    }
    // As the pipe parses a descriptor frame (the hand codec): the descriptor, then exactly
    // the bytes it packs. It agrees with the serde-derived reference on every input.
    let reference = postcard::take_from_bytes::<WireDescriptor>(data).ok();
    if let Ok((d, at)) = decode_descriptor(data, "fuzz") {
        let (r, rest) = reference.expect("the hand decoder took what the reference refuses");
        assert_eq!((&r, data.len() - rest.len()), (&d, at));
        assert!(at <= data.len());
        let packed = if d.packed {
            d.packed_len().expect("checked by the decoder")
        } else {
            0
        };
        assert_eq!(at as u64 + packed, data.len() as u64);
    }
    let _ = decode::<Ack>(data, "fuzz");
});
