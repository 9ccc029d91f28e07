//! Tensors inside RPC values (distributed autograd): the description a peer sends and its data.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    sluice_autograd::dist::wire::fuzz_from_wire(data);
});
