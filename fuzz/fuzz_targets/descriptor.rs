//! Frames inside an established pipe: message descriptors and acknowledgements.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_channel::wire::{decode, decode_descriptor, Ack, WireDescriptor, PACK_MAX};

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = decode::<WireDescriptor>(data, "fuzz") {
        // Sizes are summed the way a receiver budgets them: never overflowing.
        let _ = d.payloads.iter().fold(0u64, |a, &l| a.saturating_add(l));
    }
    // As the pipe parses a descriptor frame (the hand codec): the descriptor, then exactly
    // the bytes it packs. It agrees with the serde-derived reference both ways: it accepts
    // a frame exactly when postcard reads a descriptor whose packed bytes are the rest.
    let reference = postcard::take_from_bytes::<WireDescriptor>(data)
        .ok()
        .map(|(d, rest)| (d, data.len() - rest.len()));
    let frame_ok = reference.as_ref().is_some_and(|(d, at)| {
        let want = if d.packed { d.packed_len() } else { Some(0) };
        want.is_some_and(|w| w <= PACK_MAX as u64 && w == (data.len() - at) as u64)
    });
    match decode_descriptor(data, "fuzz") {
        Ok((d, at)) => {
            assert!(frame_ok, "the hand decoder took a frame the reference refuses");
            assert_eq!(reference, Some((d, at)));
        }
        Err(_) => assert!(!frame_ok, "the hand decoder refused a frame the reference takes"),
    }
    let _ = decode::<Ack>(data, "fuzz");
});
