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
}
