//! The choices made when a pipe opens, as pure functions: no I/O, no clocks, so every case is
//! tested deterministically.
//!
//! The server picks: the first transport in *its* priority order that the client offered and
//! whose descriptors are compatible, then for every (server device, client device) pair the
//! first channel in its order that both offered for those devices with compatible descriptors.
//! The client checks the choice against what it offered (it does not need the same priorities).
//! Compatibility is the backend's own `can_communicate` hook, passed in as `compatible`.

use crate::device::Device;
use crate::wire::{ChannelChoice, ChannelOffer, TransportOffer};

/// `compatible(backend, local_descriptor, remote_descriptor)`.
pub type Compatible<'a> = &'a dyn Fn(&str, &str, &str) -> bool;

/// The server's transport choice, or `None` when nothing both sides support can connect them.
pub fn choose_transport<'a>(
    local: &'a [TransportOffer],
    remote: &[TransportOffer],
    compatible: Compatible<'_>,
) -> Option<&'a TransportOffer> {
    local.iter().find(|mine| {
        remote
            .iter()
            .any(|theirs| theirs.name == mine.name && compatible(&mine.name, &mine.descriptor, &theirs.descriptor))
    })
}

fn descriptor<'a>(offers: &'a [ChannelOffer], channel: &str, device: Device) -> Option<&'a str> {
    offers
        .iter()
        .find(|o| o.name == channel)?
        .devices
        .iter()
        .find(|(d, _)| *d == device)
        .map(|(_, s)| s.as_str())
}

fn devices(offers: &[ChannelOffer]) -> Vec<Device> {
    let mut all: Vec<Device> = offers.iter().flat_map(|o| o.devices.iter().map(|(d, _)| *d)).collect();
    all.sort();
    all.dedup();
    all
}

/// The server's channel choice for every device pair that some channel can serve.
pub fn choose_channels(
    server: &[ChannelOffer],
    client: &[ChannelOffer],
    compatible: Compatible<'_>,
) -> Vec<ChannelChoice> {
    let mut choices = Vec::new();
    for server_device in devices(server) {
        for client_device in devices(client) {
            let pick = server.iter().find(|offer| {
                match (
                    descriptor(server, &offer.name, server_device),
                    descriptor(client, &offer.name, client_device),
                ) {
                    (Some(mine), Some(theirs)) => compatible(&offer.name, mine, theirs),
                    _ => false,
                }
            });
            if let Some(offer) = pick {
                choices.push(ChannelChoice {
                    server_device,
                    client_device,
                    channel: offer.name.clone(),
                });
            }
        }
    }
    choices
}

/// The client's check of the server's channel choices: each must be a channel the client
/// offered for that device, compatible with the server's descriptor. Returns what is wrong.
pub fn verify_channels(
    client: &[ChannelOffer],
    server: &[ChannelOffer],
    choices: &[ChannelChoice],
    compatible: Compatible<'_>,
) -> Result<(), String> {
    for c in choices {
        let mine = descriptor(client, &c.channel, c.client_device).ok_or_else(|| {
            format!(
                "server chose channel {} for {}, which this side did not offer",
                c.channel, c.client_device
            )
        })?;
        let theirs = descriptor(server, &c.channel, c.server_device).ok_or_else(|| {
            format!(
                "server chose channel {} for its {} without offering it",
                c.channel, c.server_device
            )
        })?;
        if !compatible(&c.channel, mine, theirs) {
            return Err(format!(
                "channel {} cannot connect {} here to {} there",
                c.channel, c.client_device, c.server_device
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eq(_: &str, a: &str, b: &str) -> bool {
        a == b
    }

    fn t(name: &str, d: &str) -> TransportOffer {
        TransportOffer {
            name: name.into(),
            descriptor: d.into(),
        }
    }

    fn ch(name: &str, d: &str) -> ChannelOffer {
        ChannelOffer {
            name: name.into(),
            devices: vec![(Device::Cpu, d.into())],
        }
    }

    #[test]
    fn same_host_upgrades_to_shm() {
        let local = [t("shm", "host-a"), t("tcp", "tcp")];
        let remote = [t("shm", "host-a"), t("tcp", "tcp")];
        assert_eq!(choose_transport(&local, &remote, &eq).unwrap().name, "shm");
    }

    #[test]
    fn other_host_or_container_falls_back_to_tcp() {
        let local = [t("shm", "host-a;net=1"), t("tcp", "tcp")];
        let remote = [t("shm", "host-a;net=2"), t("tcp", "tcp")];
        assert_eq!(choose_transport(&local, &remote, &eq).unwrap().name, "tcp");
    }

    #[test]
    fn no_common_transport_is_none() {
        assert!(choose_transport(&[t("shm", "a")], &[t("tcp", "tcp")], &eq).is_none());
    }

    #[test]
    fn server_priority_decides_and_client_verifies() {
        let server = [ch("cma", "h1"), ch("multilane", "tcp"), ch("basic", "any")];
        let client = [ch("basic", "any"), ch("multilane", "tcp"), ch("cma", "h1")];
        let choices = choose_channels(&server, &client, &eq);
        assert_eq!(
            choices,
            vec![ChannelChoice {
                server_device: Device::Cpu,
                client_device: Device::Cpu,
                channel: "cma".into()
            }]
        );
        verify_channels(&client, &server, &choices, &eq).unwrap();
    }

    #[test]
    fn incompatible_channels_are_skipped() {
        let server = [ch("cma", "h1"), ch("basic", "any")];
        let client = [ch("cma", "h2"), ch("basic", "any")];
        assert_eq!(choose_channels(&server, &client, &eq)[0].channel, "basic");
    }

    #[test]
    fn client_rejects_a_choice_it_did_not_offer() {
        let server = [ch("cma", "h1")];
        let client = [ch("basic", "any")];
        let bogus = [ChannelChoice {
            server_device: Device::Cpu,
            client_device: Device::Cpu,
            channel: "cma".into(),
        }];
        assert!(verify_channels(&client, &server, &bogus, &eq).is_err());
        assert!(choose_channels(&server, &client, &eq).is_empty());
    }

    /// Two processes see the same two GPUs in opposite orders (`CUDA_VISIBLE_DEVICES=1,0` on
    /// one side): pairs are matched by UUID, never by index, and peer access decides cuda_p2p.
    fn gpu_offers(order: [&str; 2], peers: bool, process: u64) -> Vec<ChannelOffer> {
        use crate::cuda::descriptor::{GpuDescriptor, STAGED_CPU, STAGED_GPU};
        let describe = |uuid: &str, other: &str| {
            GpuDescriptor {
                host: "boot=1;ipc=2;pid=3".into(),
                process,
                gpu: uuid.into(),
                peers: if peers { vec![other.into()] } else { vec![] },
            }
            .encode()
        };
        let gpus =
            |with: &dyn Fn(usize) -> String| (0..2).map(|i| (Device::Cuda(i as u32), with(i))).collect::<Vec<_>>();
        vec![
            ChannelOffer {
                name: "cma".into(),
                devices: vec![(Device::Cpu, "h".into())],
            },
            ChannelOffer {
                name: "cuda_ipc".into(),
                devices: gpus(&|i| describe(order[i], order[1 - i])),
            },
            ChannelOffer {
                name: "cuda_p2p".into(),
                devices: gpus(&|i| describe(order[i], order[1 - i])),
            },
            ChannelOffer {
                name: "cuda_staged".into(),
                devices: std::iter::once((Device::Cpu, STAGED_CPU.to_owned()))
                    .chain(gpus(&|_| STAGED_GPU.to_owned()))
                    .collect(),
            },
        ]
    }

    fn real(name: &str, a: &str, b: &str) -> bool {
        use crate::cuda::descriptor;
        match name {
            "cuda_ipc" => descriptor::ipc_compatible(a, b),
            "cuda_p2p" => descriptor::p2p_compatible(a, b),
            "cuda_staged" => descriptor::staged_compatible(a, b),
            _ => a == b,
        }
    }

    fn pick(choices: &[ChannelChoice], server: Device, client: Device) -> &str {
        choices
            .iter()
            .find(|c| c.server_device == server && c.client_device == client)
            .map_or("none", |c| c.channel.as_str())
    }

    #[test]
    fn gpus_are_matched_by_uuid_and_peer_access_decides_p2p() {
        let (c0, c1) = (Device::Cuda(0), Device::Cuda(1));
        for peers in [true, false] {
            let server = gpu_offers(["GPU-A", "GPU-B"], peers, 1);
            let client = gpu_offers(["GPU-B", "GPU-A"], peers, 2);
            let choices = choose_channels(&server, &client, &real);
            verify_channels(&client, &server, &choices, &real).unwrap();
            // Server cuda:0 is GPU-A, which the client calls cuda:1.
            assert_eq!(pick(&choices, c0, c1), "cuda_ipc");
            assert_eq!(pick(&choices, c1, c0), "cuda_ipc");
            let other = if peers { "cuda_p2p" } else { "cuda_staged" };
            assert_eq!(pick(&choices, c0, c0), other, "peers allowed: {peers}");
            assert_eq!(pick(&choices, c1, c1), other, "peers allowed: {peers}");
            assert_eq!(pick(&choices, Device::Cpu, c0), "cuda_staged");
            assert_eq!(pick(&choices, c1, Device::Cpu), "cuda_staged");
            assert_eq!(pick(&choices, Device::Cpu, Device::Cpu), "cma");
        }
    }

    #[test]
    fn a_peer_without_cuda_still_reaches_our_gpus_through_staging() {
        use crate::cuda::descriptor::STAGED_CPU;
        let server = gpu_offers(["GPU-A", "GPU-B"], true, 1);
        let client = vec![
            ChannelOffer {
                name: "cma".into(),
                devices: vec![(Device::Cpu, "h".into())],
            },
            ChannelOffer {
                name: "cuda_staged".into(),
                devices: vec![(Device::Cpu, STAGED_CPU.into())],
            },
        ];
        let choices = choose_channels(&server, &client, &real);
        assert_eq!(pick(&choices, Device::Cuda(1), Device::Cpu), "cuda_staged");
        assert_eq!(pick(&choices, Device::Cpu, Device::Cpu), "cma");
        assert_eq!(choices.len(), 3, "{choices:?}");
    }
}
