//! Device maps: per destination, which remote device each local device's tensors land on.
//!
//! A request's tensors are placed by the caller's map to the callee; the response's tensors go
//! back through the reverse of that same map. CPU tensors need no entry (CPU goes to CPU unless
//! the map says otherwise); a CUDA tensor whose device the map does not cover is refused before
//! anything is sent. Maps are validated at init on every worker with everyone's maps and device
//! lists, so all workers report the same error.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sluice_channel::Device;

use crate::error::{InitError, RpcError};

/// Local device → remote device, for one destination.
pub type DeviceMap = BTreeMap<Device, Device>;

/// What each worker publishes at rendezvous about its devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerDevices {
    pub name: String,
    pub devices: Vec<Device>,
    /// Destination name → map.
    pub maps: BTreeMap<String, DeviceMap>,
}

/// Checks every worker's maps: peers that exist, devices that exist on both ends, one-to-one.
pub fn validate(workers: &[WorkerDevices]) -> Result<(), InitError> {
    check(workers, true)
}

/// As [`validate`], for a group that workers may still join: a map naming a peer not here
/// (yet) is accepted; everything else is checked.
pub fn validate_present(workers: &[WorkerDevices]) -> Result<(), InitError> {
    check(workers, false)
}

fn check(workers: &[WorkerDevices], complete: bool) -> Result<(), InitError> {
    for w in workers {
        for (peer, map) in &w.maps {
            let Some(p) = workers.iter().find(|x| &x.name == peer) else {
                if !complete {
                    continue;
                }
                return Err(InitError::UnknownPeer {
                    worker: w.name.clone(),
                    peer: peer.clone(),
                });
            };
            let mut targets: BTreeMap<Device, Device> = BTreeMap::new();
            for (&from, &to) in map {
                if !w.devices.contains(&from) {
                    return Err(InitError::UnknownDevice {
                        worker: w.name.clone(),
                        peer: peer.clone(),
                        device: from,
                        owner: w.name.clone(),
                    });
                }
                if !p.devices.contains(&to) {
                    return Err(InitError::UnknownDevice {
                        worker: w.name.clone(),
                        peer: peer.clone(),
                        device: to,
                        owner: peer.clone(),
                    });
                }
                if let Some(&first) = targets.get(&to) {
                    return Err(InitError::ManyToOne {
                        worker: w.name.clone(),
                        peer: peer.clone(),
                        first,
                        second: from,
                        target: to,
                    });
                }
                targets.insert(to, from);
            }
        }
    }
    Ok(())
}

/// Where a tensor on `device` lands when sent with `map` to `peer`. CPU without an entry stays
/// on the CPU; any other device needs an entry.
pub fn forward(map: Option<&DeviceMap>, device: Device, peer: &str) -> Result<Device, RpcError> {
    match map.and_then(|m| m.get(&device)) {
        Some(&to) => Ok(to),
        None if device == Device::Cpu => Ok(Device::Cpu),
        None => Err(RpcError::MissingDeviceMap {
            worker: peer.to_owned(),
            device,
        }),
    }
}

/// Where a response tensor on the callee's `device` lands on the caller, whose map to the
/// callee is `map`: the reverse of that map.
pub fn reverse(map: Option<&DeviceMap>, device: Device, caller: &str) -> Result<Device, RpcError> {
    match map.and_then(|m| m.iter().find(|(_, &to)| to == device).map(|(&from, _)| from)) {
        Some(from) => Ok(from),
        None if device == Device::Cpu => Ok(Device::Cpu),
        None => Err(RpcError::MissingDeviceMap {
            worker: caller.to_owned(),
            device,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(name: &str, devices: &[Device], maps: &[(&str, &[(Device, Device)])]) -> WorkerDevices {
        WorkerDevices {
            name: name.into(),
            devices: devices.to_vec(),
            maps: maps
                .iter()
                .map(|(p, m)| (p.to_string(), m.iter().copied().collect()))
                .collect(),
        }
    }

    const CPU: Device = Device::Cpu;
    const G0: Device = Device::Cuda(0);
    const G1: Device = Device::Cuda(1);

    #[test]
    fn valid_maps_pass() {
        let ws = [
            worker("a", &[CPU, G0, G1], &[("b", &[(G0, G1), (G1, G0), (CPU, CPU)])]),
            worker("b", &[CPU, G0, G1], &[("a", &[(G0, CPU)])]),
        ];
        validate(&ws).unwrap();
    }

    #[test]
    fn each_violation_has_its_error() {
        let unknown_peer = [
            worker("a", &[CPU, G0], &[("c", &[(G0, G0)])]),
            worker("b", &[CPU, G0], &[]),
        ];
        assert!(matches!(validate(&unknown_peer), Err(InitError::UnknownPeer { peer, .. }) if peer == "c"));

        let missing_local = [worker("a", &[CPU], &[("b", &[(G0, G0)])]), worker("b", &[CPU, G0], &[])];
        assert!(matches!(
            validate(&missing_local),
            Err(InitError::UnknownDevice { device: G0, owner, .. }) if owner == "a"
        ));

        let missing_remote = [
            worker("a", &[CPU, G0], &[("b", &[(G0, G1)])]),
            worker("b", &[CPU, G0], &[]),
        ];
        assert!(matches!(
            validate(&missing_remote),
            Err(InitError::UnknownDevice { device: G1, owner, .. }) if owner == "b"
        ));

        let many_to_one = [
            worker("a", &[CPU, G0, G1], &[("b", &[(G0, G0), (G1, G0)])]),
            worker("b", &[CPU, G0], &[]),
        ];
        assert!(matches!(
            validate(&many_to_one),
            Err(InitError::ManyToOne {
                first: G0,
                second: G1,
                target: G0,
                ..
            })
        ));
    }

    #[test]
    fn forward_and_reverse() {
        let map: DeviceMap = [(G0, G1), (CPU, G0)].into_iter().collect();
        assert_eq!(forward(Some(&map), G0, "b").unwrap(), G1);
        assert_eq!(forward(Some(&map), CPU, "b").unwrap(), G0);
        assert_eq!(forward(None, CPU, "b").unwrap(), CPU);
        let e = forward(Some(&map), G1, "b").unwrap_err();
        assert!(matches!(e, RpcError::MissingDeviceMap { device: G1, .. }));
        assert!(e.to_string().contains("cuda:1") && e.to_string().contains("b"), "{e}");
        assert!(forward(None, G0, "b").is_err());
        assert_eq!(reverse(Some(&map), G1, "a").unwrap(), G0);
        assert_eq!(reverse(Some(&map), G0, "a").unwrap(), CPU);
        assert_eq!(reverse(None, CPU, "a").unwrap(), CPU);
        assert!(reverse(Some(&map), Device::Cuda(3), "a").is_err());
    }
}
