//! Writes the seed corpus (valid frames of every kind) into `fuzz/corpus/<target>/`:
//! `cargo run --manifest-path fuzz/Cargo.toml --bin seeds`.

use std::path::Path;

use sluice_agent::wire::{Body, Envelope, GlobalId, Request, Response, WireRRef, WireValue};

use sluice_channel::wire::{
    encode, encode_setup, Ack, Answer, Brochure, ChannelChoice, ChannelOffer, CudaDone, Hello, Reply, Source,
    TransportOffer, WireDescriptor, WireTensor,
};
use sluice_channel::Device;

fn write(target: &str, seeds: Vec<Vec<u8>>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    std::fs::create_dir_all(&dir).unwrap();
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), s).unwrap();
    }
    println!("{target}: {} seeds", seeds.len());
}

fn main() {
    let offers = vec![
        ChannelOffer {
            name: "cma".into(),
            devices: vec![(Device::Cpu, "boot=1;uid=0".into())],
        },
        ChannelOffer {
            name: "basic".into(),
            devices: vec![(Device::Cpu, String::new()), (Device::Cuda(0), "gpu".into())],
        },
        ChannelOffer {
            name: "cuda_ipc".into(),
            devices: vec![(
                Device::Cuda(0),
                "gpu=GPU-1|proc=ab|peers=GPU-2|host=boot=1;ipc=2;pid=3".into(),
            )],
        },
        ChannelOffer {
            name: "cuda_staged".into(),
            devices: vec![
                (Device::Cpu, "staged;cpu".into()),
                (Device::Cuda(0), "staged;gpu".into()),
            ],
        },
    ];
    let brochure = Brochure {
        name: "worker0".into(),
        pid: 42,
        process: 0xabc1,
        cma_probe: 0x7fff_0000,
        segment: Some(sluice_channel::channel::segment::SegmentOffer {
            fd: 12,
            bytes: 256 << 20,
        }),
        transports: vec![
            TransportOffer {
                name: "shm".into(),
                descriptor: "boot=x;net=1".into(),
            },
            TransportOffer {
                name: "tcp".into(),
                descriptor: String::new(),
            },
        ],
        channels: offers.clone(),
    };
    let answer = Answer {
        name: "worker1".into(),
        pid: 43,
        process: 0xabc3,
        cma_probe: 1,
        segment: None,
        transport: "tcp".into(),
        transport_descriptor: String::new(),
        address: "127.0.0.1:1".into(),
        control_token: Some(7),
        reply_token: 8,
        lane_address: "127.0.0.1:1".into(),
        lane_tokens: vec![9, 10],
        channels: offers,
        choices: vec![ChannelChoice {
            server_device: Device::Cpu,
            client_device: Device::Cpu,
            channel: "basic".into(),
        }],
    };
    write(
        "setup",
        vec![
            encode_setup(&Hello::Pipe(brochure)),
            encode_setup(&Hello::Join { token: 99 }),
            encode_setup(&Reply::Accept(Box::new(answer))),
            encode_setup(&Reply::Reject { reason: "no".into() }),
        ],
    );
    let t = WireTensor {
        length: 4096,
        source: Device::Cpu,
        target: Some(Device::Cpu),
        metadata: vec![1, 2].into(),
        data: Source::Cma { address: 0x1000 },
    };
    let gpu = WireTensor {
        length: 1 << 20,
        source: Device::Cuda(0),
        target: Some(Device::Cuda(1)),
        metadata: vec![3].into(),
        data: Source::CudaIpc {
            memory: vec![7; 64].into(),
            offset: 4096,
            size: 8 << 20,
            event: vec![9; 64].into(),
        },
    };
    let rdma = WireTensor {
        length: 1 << 24,
        data: Source::Rdma {
            addr: 0x7f00_0000_0000,
            rkey: 0x1234,
        },
        ..t.clone()
    };
    let local = WireTensor {
        data: Source::CudaLocal {
            address: 0x7000_0000,
            event: 0x55,
        },
        ..gpu.clone()
    };
    let others = [Source::Empty, Source::Lanes, Source::Staged]
        .into_iter()
        .map(|data| WireTensor {
            length: 0,
            data,
            ..t.clone()
        });
    write(
        "descriptor",
        vec![
            encode(&WireDescriptor {
                seq: 3,
                metadata: vec![0; 16].into(),
                payloads: vec![100, 0],
                tensors: vec![t.clone(), gpu, local, rdma],
                packed: false,
            }),
            encode(&WireDescriptor {
                seq: 4,
                metadata: Vec::new().into(),
                payloads: vec![],
                tensors: vec![
                    WireTensor {
                        data: Source::Segment { offset: 65536 },
                        ..t.clone()
                    },
                    WireTensor {
                        length: 12,
                        data: Source::Inline,
                        ..t.clone()
                    },
                ],
                packed: false,
            }),
            // A packed message: two payloads and an inline tensor after the descriptor.
            {
                let mut frame = encode(&WireDescriptor {
                    seq: 6,
                    metadata: vec![1; 4].into(),
                    payloads: vec![3, 2],
                    tensors: vec![WireTensor {
                        length: 4,
                        data: Source::Inline,
                        ..t.clone()
                    }],
                    packed: true,
                });
                frame.extend_from_slice(b"pppqqtttt");
                frame
            },
            encode(&WireDescriptor {
                seq: 5,
                metadata: Vec::new().into(),
                payloads: vec![1],
                tensors: others.collect(),
                packed: false,
            }),
            encode(&Ack { seq: 3, cuda: vec![] }),
            encode(&Ack {
                seq: 4,
                cuda: vec![
                    CudaDone::Ipc {
                        event: vec![1; 64].into(),
                    },
                    CudaDone::Local { event: 3 },
                ],
            }),
        ],
    );
    let value = WireValue {
        inline: vec![1, 2, 3].into(),
        in_payload: false,
        rrefs: vec![WireRRef {
            owner: 1,
            id: GlobalId { worker: 1, local: 5 },
            fork: GlobalId { worker: 0, local: 6 },
            parent: 0,
        }],
    };
    let envelopes = [
        Envelope::Hello {
            rank: 1,
            version: sluice_agent::wire::AGENT_VERSION,
            heartbeat_ms: 1000,
        },
        Envelope::Goodbye,
        Envelope::Request(Request {
            id: 1 << 48 | 3,
            priority: 0,
            body: Body::Call { handler: "add".into() },
            value: value.clone(),
        }),
        Envelope::Request(Request {
            id: 4,
            priority: 0,
            body: Body::Ping,
            value: WireValue::default(),
        }),
        Envelope::Request(Request {
            id: 5,
            priority: 7,
            body: Body::Remote {
                handler: "make".into(),
                rref: GlobalId { worker: 0, local: 1 },
                fork: None,
            },
            value: value.clone(),
        }),
        // Out of range: the callee rejects it with a typed error.
        Envelope::Request(Request {
            id: 6,
            priority: 100,
            body: Body::Call { handler: "add".into() },
            value: value.clone(),
        }),
        Envelope::Response(Response {
            id: 5,
            result: Ok(value),
        }),
    ];
    let mut rpc: Vec<Vec<u8>> = envelopes
        .iter()
        .map(|e| sluice_agent::wire::encode(e).to_vec())
        .collect();
    rpc.push(b"live/00001\0\x02\x05w\0left/00002\0".to_vec());
    write("rpc", rpc);
    write("store", sluice_agent::store::tcp::fuzz_seeds());
    write("tensor", sluice_autograd::dist::wire::fuzz_seeds());
    write("meta", meta_seeds());
}

/// Tensor descriptions as the bindings send them, each after the length of its buffer.
fn meta_seeds() -> Vec<Vec<u8>> {
    use sluice_dlpack::{DType, Meta};
    let strided = Meta {
        dtype: DType::I16,
        shape: vec![4, 3],
        strides: vec![6, 2],
    };
    let cases = [
        (Meta::contiguous(DType::F32, &[2, 3]), 24u32, &b"torch"[..]),
        (strided, 46, &b"numpy"[..]),
        (Meta::contiguous(DType::BF16, &[]), 2, &b""[..]),
        (Meta::contiguous(DType::Bool, &[0, 5]), 0, &b""[..]),
        (Meta::contiguous(DType::C128, &[1, 1, 1, 2]), 64, &b"jax"[..]),
    ];
    cases
        .into_iter()
        .map(|(m, len, tag)| {
            let mut v = len.to_le_bytes().to_vec();
            v.extend(m.encode_tagged(tag));
            v
        })
        .collect()
}
