//! Pipe setup: the first frame a listener reads from anyone (`Hello`), the answer a client
//! reads (`Reply`), and negotiation over whatever offers they carry.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_channel::negotiation::{choose_channels, choose_transport, verify_channels};
use sluice_channel::wire::{decode_setup, ChannelOffer, Hello, Reply, TransportOffer};
use sluice_channel::Device;

fuzz_target!(|data: &[u8]| {
    let local_t = vec![
        TransportOffer {
            name: "shm".into(),
            descriptor: "boot=x;net=1".into(),
        },
        TransportOffer {
            name: "tcp".into(),
            descriptor: String::new(),
        },
    ];
    let local_c = vec![ChannelOffer {
        name: "basic".into(),
        devices: vec![(Device::Cpu, String::new())],
    }];
    let same = |_: &str, a: &str, b: &str| a == b;
    if let Ok(Hello::Pipe(b)) = decode_setup::<Hello>(data, "fuzz") {
        let _ = choose_transport(&local_t, &b.transports, &same);
        let _ = choose_channels(&local_c, &b.channels, &same);
    }
    if let Ok(Reply::Accept(a)) = decode_setup::<Reply>(data, "fuzz") {
        let _ = verify_channels(&local_c, &a.channels, &a.choices, &same);
    }
});
