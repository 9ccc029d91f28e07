//! The transport conformance suite, instantiated for every backend available without special
//! hardware. (ibverbs joins when its issue lands, gated on an RDMA device.)

use sluice_tests::conformance::transport::Backend;
use sluice_tests::transport_conformance;
use sluice_transport::shm::ShmTransport;
use sluice_transport::tcp::TcpTransport;

const PEER: &str = env!("CARGO_BIN_EXE_sluice-test-peer");

struct Tcp;
impl Backend for Tcp {
    type T = TcpTransport;
    const NAME: &'static str = "tcp";
    fn transport() -> TcpTransport {
        TcpTransport::default()
    }
}

struct Shm;
impl Backend for Shm {
    type T = ShmTransport;
    const NAME: &'static str = "shm";
    const IMMEDIATE: bool = true;
    fn transport() -> ShmTransport {
        ShmTransport::default()
    }
}

transport_conformance!(tcp, Tcp, PEER);
transport_conformance!(shm, Shm, PEER);

#[test]
fn shm_refuses_peers_in_other_namespaces_or_hosts() {
    use sluice_transport::Transport;
    let t = ShmTransport::default();
    let mine = t.domain_descriptor();
    assert!(mine.contains("boot=") && mine.contains(";net=") && mine.contains(";ipc=") && mine.contains(";user="));
    let other_host = mine.replace("boot=", "boot=x");
    let other_netns = mine.replace(";net=", ";net=1");
    assert!(!t.can_communicate_with(&other_host));
    assert!(!t.can_communicate_with(&other_netns));
}
