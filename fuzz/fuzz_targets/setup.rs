//! Pipe setup: the first frame a listener reads from anyone (`Hello`), the answer a client
//! reads (`Reply`), and negotiation over whatever offers they carry.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_channel::cuda::descriptor::{ipc_compatible, p2p_compatible, staged_compatible};
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
    let gpu = "gpu=GPU-1|proc=ab|peers=GPU-2|host=boot=1;ipc=2;pid=3";
    let local_c = vec![
        ChannelOffer {
            name: "basic".into(),
            devices: vec![(Device::Cpu, String::new())],
        },
        ChannelOffer {
            name: "cuda_ipc".into(),
            devices: vec![(Device::Cuda(0), gpu.into())],
        },
        ChannelOffer {
            name: "cuda_p2p".into(),
            devices: vec![(Device::Cuda(0), gpu.into())],
        },
        ChannelOffer {
            name: "cuda_staged".into(),
            devices: vec![
                (Device::Cpu, "staged;cpu".into()),
                (Device::Cuda(0), "staged;gpu".into()),
            ],
        },
    ];
    // The real compatibility rules, which parse the peer's descriptors.
    let same = |name: &str, a: &str, b: &str| match name {
        "cuda_ipc" => ipc_compatible(a, b),
        "cuda_p2p" => p2p_compatible(a, b),
        "cuda_staged" => staged_compatible(a, b),
        _ => a == b,
    };
    if let Ok(Hello::Pipe(b)) = decode_setup::<Hello>(data, "fuzz") {
        let _ = choose_transport(&local_t, &b.transports, &same);
        let _ = choose_channels(&local_c, &b.channels, &same);
    }
    if let Ok(Reply::Accept(a)) = decode_setup::<Reply>(data, "fuzz") {
        let _ = verify_channels(&local_c, &a.channels, &a.choices, &same);
    }
});
