//! Facts about the host and the process's namespaces, used by domain descriptors so that peers
//! on different hosts, or in different containers on one host, never pick a same-host backend.

use std::fs;

/// The kernel's boot id: differs between hosts and between boots of one host.
pub fn boot_id() -> Option<String> {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_owned())
}

/// The inode of one of this process's namespaces (`net`, `ipc`, `user`, `pid`, `mnt`), as the
/// kernel prints it in `/proc/self/ns/<kind>` (e.g. `4026531833`).
pub fn namespace_id(kind: &str) -> Option<String> {
    let link = fs::read_link(format!("/proc/self/ns/{kind}")).ok()?;
    let text = link.to_string_lossy();
    let start = text.find('[')? + 1;
    let end = text.rfind(']')?;
    Some(text.get(start..end)?.to_owned())
}

/// `key=value` pairs for the boot id and the named namespaces, joined with `;`. `None` when any
/// of them cannot be read: a backend that cannot prove where it runs must not claim a host.
pub fn identity(namespaces: &[&str]) -> Option<String> {
    let mut out = format!("boot={}", boot_id()?);
    for ns in namespaces {
        out.push_str(&format!(";{ns}={}", namespace_id(ns)?));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn identity_names_boot_and_namespaces() {
        let id = super::identity(&["net", "ipc"]).expect("procfs readable");
        assert!(id.starts_with("boot="));
        assert!(id.contains(";net=") && id.contains(";ipc="));
    }
}
