//! Which GID a RoCE port is addressed by: pure, so the choice is tested without a device.
//!
//! `ibv_query_gid_type` (what `sideway::DeviceContext::query_gid_type` returns) fills the
//! *sysfs* enumeration of rdma-core's `driver.h`: `IBV_GID_TYPE_SYSFS_IB_ROCE_V1 = 0` (InfiniBand
//! or RoCE v1) and `IBV_GID_TYPE_SYSFS_ROCE_V2 = 1`. The public enumeration of `verbs.h`
//! (`IBV_GID_TYPE_IB = 0`, `ROCE_V1 = 1`, `ROCE_V2 = 2`) is what `ibv_query_gid_ex` returns;
//! comparing the first with the second's value (2) never matches anything.

/// `IBV_GID_TYPE_SYSFS_ROCE_V2`: the value `ibv_query_gid_type` gives a RoCE v2 GID.
pub const SYSFS_ROCE_V2: u32 = 1;

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    /// As `ibv_query_gid_type` reports it (the sysfs enumeration).
    pub sysfs_type: u32,
    pub gid: [u8; 16],
}

fn is_zero(gid: &[u8; 16]) -> bool {
    gid.iter().all(|&b| b == 0)
}

/// An IPv4 address in IPv4-mapped form (`::ffff:a.b.c.d`).
pub fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]
}

/// An IPv6 link-local address (`fe80::/10`): it does not route, so two hosts on different
/// subnets (or whose link-local scopes differ) cannot use it.
pub fn is_link_local(gid: &[u8; 16]) -> bool {
    gid[0] == 0xfe && gid[1] & 0xc0 == 0x80
}

/// The GID a RoCE port should be addressed by: the first RoCE v2 GID holding an IPv4-mapped
/// address, else the first routable (not link-local) IPv6 RoCE v2 GID. RoCE v1 GIDs, empty
/// entries and link-local addresses are never chosen.
pub fn choose_roce_v2(table: &[GidEntry]) -> Option<u32> {
    let usable = |e: &&GidEntry| e.sysfs_type == SYSFS_ROCE_V2 && !is_zero(&e.gid);
    table
        .iter()
        .filter(usable)
        .find(|e| is_ipv4_mapped(&e.gid))
        .or_else(|| table.iter().filter(usable).find(|e| !is_link_local(&e.gid)))
        .map(|e| e.index)
}

/// Whether two RoCE GIDs are of the same address family (both IPv4-mapped or both IPv6): a
/// queue pair cannot route from one to the other.
pub fn same_family(a: &[u8; 16], b: &[u8; 16]) -> bool {
    is_ipv4_mapped(a) == is_ipv4_mapped(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> [u8; 16] {
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, last]
    }

    fn link_local() -> [u8; 16] {
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        g[15] = 7;
        g
    }

    fn global_v6() -> [u8; 16] {
        let mut g = [0u8; 16];
        g[0] = 0x20;
        g[1] = 0x01;
        g[15] = 9;
        g
    }

    fn entry(index: u32, sysfs_type: u32, gid: [u8; 16]) -> GidEntry {
        GidEntry { index, sysfs_type, gid }
    }

    /// A typical RoCE port: v1 and v2 entries for a link-local and an IPv4 address.
    #[test]
    fn a_roce_v2_ipv4_gid_is_found_by_its_sysfs_type() {
        let table = [
            entry(0, 0, link_local()),
            entry(1, SYSFS_ROCE_V2, link_local()),
            entry(2, 0, v4(5)),
            entry(3, SYSFS_ROCE_V2, v4(5)),
        ];
        assert_eq!(choose_roce_v2(&table), Some(3));
        // The public enumeration's value for RoCE v2 (2) is not what the sysfs query returns.
        let wrong = [entry(0, 2, v4(5))];
        assert_eq!(choose_roce_v2(&wrong), None);
    }

    #[test]
    fn link_local_v1_and_empty_gids_are_never_chosen() {
        let table = [
            entry(0, SYSFS_ROCE_V2, [0; 16]),
            entry(1, SYSFS_ROCE_V2, link_local()),
            entry(2, 0, v4(1)),
        ];
        assert_eq!(choose_roce_v2(&table), None);
        let with_global = [
            entry(0, SYSFS_ROCE_V2, link_local()),
            entry(1, SYSFS_ROCE_V2, global_v6()),
        ];
        assert_eq!(choose_roce_v2(&with_global), Some(1));
        assert!(same_family(&v4(1), &v4(2)) && !same_family(&v4(1), &global_v6()));
    }
}
