//! Tensor descriptions the Python and C bindings receive (dtype, shape, strides and a tag),
//! checked against the buffer that came with them: never a panic, and anything accepted fits.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first 4 bytes: the length of the buffer the description arrived with.
    let Some((len, wire)) = data.split_first_chunk::<4>() else {
        return;
    };
    let len = u32::from_le_bytes(*len) as usize;
    if let Ok((meta, _tag)) = sluice_dlpack::Meta::decode_tagged(wire, len) {
        let span = meta.span().expect("an accepted description has a span");
        assert!(span <= len, "accepted a {span} byte span for a {len} byte buffer");
        assert!(meta.shape.len() <= sluice_dlpack::MAX_RANK);
    }
});
