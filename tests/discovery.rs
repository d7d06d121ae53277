//! Seed discovery (SPEC §10b.1): nodes that find each other through a real
//! DNS server this test starts on 127.0.0.1 (hickory-server, an in-memory
//! zone whose records the test adds and removes while the cluster forms),
//! and through a seed file that changes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode, DiscoveryError, SeedDiscovery};
use hickory_server::Server;
use hickory_server::proto::rr::rdata::{A, AAAA, SOA, SRV};
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordType, RrKey};
use hickory_server::store::in_memory::InMemoryZoneHandler;
use hickory_server::zone_handler::{AxfrPolicy, Catalog, ZoneHandler, ZoneType};

mod common;

const LONG: Duration = Duration::from_secs(30);
const ZONE: &str = "cluster.test.";

/// A DNS server on 127.0.0.1 serving one zone from memory.
struct Dns {
    addr: SocketAddr,
    zone: Arc<InMemoryZoneHandler>,
    serial: u32,
    _server: Server<Catalog>,
}

fn name(s: &str) -> Name {
    Name::from_str(s).expect("a DNS name")
}

impl Dns {
    async fn start() -> Dns {
        let origin = name(ZONE);
        let zone = Arc::new(InMemoryZoneHandler::empty(
            origin.clone(),
            ZoneType::Primary,
            AxfrPolicy::Deny,
        ));
        let soa = SOA::new(
            name("ns.cluster.test."),
            name("admin.cluster.test."),
            1,
            60,
            60,
            60,
            0,
        );
        zone.upsert(Record::from_rdata(origin.clone(), 0, RData::SOA(soa)), 1)
            .await;
        let mut catalog = Catalog::new();
        catalog.upsert(
            LowerName::new(&origin),
            vec![zone.clone() as Arc<dyn ZoneHandler>],
        );
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let mut server = Server::new(catalog);
        server.register_socket(socket);
        Dns {
            addr,
            zone,
            serial: 1,
            _server: server,
        }
    }

    /// Adds `rdata` at `owner` (TTL 0: resolvers keep nothing); false if
    /// it was there already.
    async fn add(&mut self, owner: &str, rdata: RData) -> bool {
        self.serial += 1;
        self.zone
            .upsert(Record::from_rdata(name(owner), 0, rdata), self.serial)
            .await
    }

    /// Removes every record of `kind` at `owner`.
    async fn remove(&mut self, owner: &str, kind: RecordType) {
        let key = RrKey::new(LowerName::new(&name(owner)), kind);
        assert!(
            self.zone.records_mut().await.remove(&key).is_some(),
            "{owner} was there"
        );
    }

    /// An SRV record of the cluster's service for `node`, its target
    /// `host` dual-stack: A 127.0.0.1 and AAAA ::1 (so each node is listed
    /// twice, once per family, as a dual-stack pod is).
    async fn add_node(&mut self, host: &str, node: SocketAddr) {
        let target = format!("{host}.{ZONE}");
        self.add(&target, RData::A(A(Ipv4Addr::LOCALHOST))).await;
        self.add(&target, RData::AAAA(AAAA(Ipv6Addr::LOCALHOST)))
            .await;
        let srv = SRV::new(0, 0, node.port(), name(&target));
        let added = self
            .add(&format!("_datum._tcp.{ZONE}"), RData::SRV(srv))
            .await;
        assert!(added, "the SRV record of {host} added");
    }
}

fn srv_discovery(dns: &Dns) -> SeedDiscovery {
    SeedDiscovery::dns_srv(format!("_datum._tcp.{ZONE}"))
        .name_servers(vec![dns.addr])
        .interval(Duration::from_millis(100))
}

/// A node that discovers its seeds, on a free port of 127.0.0.1.
async fn start_node(discovery: SeedDiscovery) -> ClusterNode {
    let config = ClusterConfig::builder()
        .cluster_name("discovery")
        .secret("discovery-secret")
        .discovery(discovery)
        .build();
    ClusterNode::start(config).await.expect("node starts")
}

/// `n` nodes, sorted by address (the lowest is the one that may form).
async fn start_nodes(discovery: &SeedDiscovery, n: usize) -> Vec<ClusterNode> {
    let mut nodes = Vec::new();
    for _ in 0..n {
        nodes.push(start_node(discovery.clone()).await);
    }
    nodes.sort_by_key(|node| node.bound_addr());
    nodes
}

/// Waits 1.5 s (three seed timeouts) and fails if any of `nodes` became a
/// member meanwhile: an absence has no event to wait for.
async fn nobody_forms(nodes: &[ClusterNode]) {
    let formed = tokio::time::timeout(
        Duration::from_millis(1_500),
        futures_util::future::select_all(
            nodes
                .iter()
                .map(|n| Box::pin(n.wait_until(|s| s.self_status().is_some(), LONG))),
        ),
    )
    .await;
    assert!(formed.is_err(), "a node formed a cluster alone");
    for node in nodes {
        assert_eq!(node.current_state().self_status(), None);
    }
}

async fn members_up(node: &ClusterNode, n: usize) {
    node.wait_until(|s| s.up_members().count() == n, LONG)
        .await
        .unwrap_or_else(|e| panic!("{} never saw {n} members Up: {e}", node.self_address()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_a_aaaa_and_srv_records_resolve_to_seed_addresses() {
    let mut dns = Dns::start().await;
    let a_records = SeedDiscovery::dns(format!("pods.{ZONE}"), 7355).name_servers(vec![dns.addr]);
    // No such name yet: an empty answer, not an error.
    assert_eq!(a_records.resolve().await.unwrap(), vec![]);
    let pods = format!("pods.{ZONE}");
    assert!(
        dns.add(&pods, RData::A(A(Ipv4Addr::new(10, 0, 0, 6))))
            .await
    );
    assert!(
        dns.add(&pods, RData::A(A(Ipv4Addr::new(10, 0, 0, 5))))
            .await
    );
    let v6 = RData::AAAA(AAAA(Ipv6Addr::from_str("fd00::5").unwrap()));
    assert!(dns.add(&pods, v6).await);
    let expected: Vec<SocketAddr> = vec![
        SocketAddr::new(IpAddr::from([10, 0, 0, 5]), 7355),
        SocketAddr::new(IpAddr::from([10, 0, 0, 6]), 7355),
        SocketAddr::new(IpAddr::from_str("fd00::5").unwrap(), 7355),
    ];
    assert_eq!(a_records.resolve().await.unwrap(), expected);
    dns.remove(&pods, RecordType::AAAA).await;
    assert_eq!(a_records.resolve().await.unwrap(), expected[..2].to_vec());

    // SRV: each target's address with the record's port.
    let srv = srv_discovery(&dns);
    assert_eq!(srv.resolve().await.unwrap(), vec![]);
    dns.add_node("n1", "127.0.0.1:7001".parse().unwrap()).await;
    dns.add_node("n2", "127.0.0.1:7002".parse().unwrap()).await;
    assert_eq!(
        srv.resolve().await.unwrap(),
        vec![
            "127.0.0.1:7001".parse::<SocketAddr>().unwrap(),
            "127.0.0.1:7002".parse().unwrap(),
            "[::1]:7001".parse().unwrap(),
            "[::1]:7002".parse().unwrap(),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_forms_through_srv_records_added_and_removed_while_it_forms() {
    let mut dns = Dns::start().await;
    // Three nodes start with nothing to find; two must be listed before
    // the lowest may form the cluster.
    let discovery = srv_discovery(&dns).required(2);
    let nodes = start_nodes(&discovery, 3).await;
    let addr = |i: usize| nodes[i].bound_addr();
    nobody_forms(&nodes).await;
    // Only the highest is listed (twice: IPv4 and IPv6): one address of
    // the nodes' family is not two, so nobody forms.
    dns.add_node("n2", addr(2)).await;
    nobody_forms(&nodes).await;
    // Then the lowest: it forms, the others join it.
    dns.add_node("n0", addr(0)).await;
    for node in &nodes {
        members_up(node, 3).await;
    }
    let state = nodes[0].current_state();
    let mut members: Vec<SocketAddr> = state.members.iter().map(|m| m.address.addr).collect();
    members.sort_unstable();
    assert_eq!(
        members,
        vec![addr(0), addr(1), addr(2)],
        "one cluster of the three"
    );

    // The lowest's record goes, a dead address takes its place, and a
    // fourth node joins through what is still listed.
    dns.remove(&format!("_datum._tcp.{ZONE}"), RecordType::SRV)
        .await;
    dns.add_node("n2", addr(2)).await;
    dns.add_node("dead", SocketAddr::from(([127, 0, 0, 1], 1)))
        .await;
    let late = start_node(discovery.clone()).await;
    members_up(&late, 4).await;
    members_up(&nodes[0], 4).await;
    for node in nodes.iter().chain([&late]) {
        node.shutdown().await.expect("leaves");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_file_that_changes_forms_the_cluster_and_bad_lines_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seeds");
    let discovery = SeedDiscovery::file(&path)
        .required(2)
        .interval(Duration::from_millis(100));
    // Missing: an error that names the file.
    let missing = discovery.resolve().await.unwrap_err();
    assert!(matches!(missing, DiscoveryError::Read { .. }), "{missing}");
    // A malformed line: an error naming the line, nothing half-read.
    std::fs::write(&path, "# seeds\n127.0.0.1:7001\nnot-an-address\n").unwrap();
    match discovery.resolve().await {
        Err(DiscoveryError::Malformed { line: 3, text, .. }) => assert_eq!(text, "not-an-address"),
        other => panic!("expected a malformed line 3, got {other:?}"),
    }
    // A byte-order mark and CRLF line ends are read past.
    std::fs::write(&path, "\u{feff}127.0.0.1:7002\r\n127.0.0.1:7001\r\n").unwrap();
    let listed = discovery.resolve().await.unwrap();
    assert_eq!(
        listed,
        vec![([127, 0, 0, 1], 7001).into(), ([127, 0, 0, 1], 7002).into()]
    );
    std::fs::remove_file(&path).unwrap();

    // Two nodes start while the file is missing; then it lists only the
    // higher: nobody forms.
    let nodes = start_nodes(&discovery, 2).await;
    let addr = |i: usize| nodes[i].bound_addr();
    nobody_forms(&nodes).await;
    std::fs::write(&path, format!("{}\n", addr(1))).unwrap();
    nobody_forms(&nodes).await;
    // Written whole (by rename): both listed, the lowest forms, the other joins.
    let next = dir.path().join("seeds.next");
    std::fs::write(
        &next,
        format!("# the cluster\n\n{}\n  {}\n", addr(1), addr(0)),
    )
    .unwrap();
    std::fs::rename(&next, &path).unwrap();
    for node in &nodes {
        members_up(node, 2).await;
    }
    for node in &nodes {
        node.shutdown().await.expect("leaves");
    }
}

#[tokio::test]
async fn seeds_and_discovery_together_are_refused() {
    let config = ClusterConfig::builder()
        .cluster_name("discovery")
        .seed_nodes(vec!["127.0.0.1:7355".parse().unwrap()])
        .discovery(SeedDiscovery::file("/nonexistent"))
        .build();
    let error = ClusterNode::start(config).await.unwrap_err();
    assert!(error.to_string().contains("not both"), "{error}");
}

#[test]
fn datum_node_finds_its_seeds_through_a_file() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::sync::mpsc;
    const BIN: &str = env!("CARGO_BIN_EXE_datum-node");

    let bad = Command::new(BIN)
        .args([
            "--cluster-name",
            "c",
            "--secret",
            "s",
            "--discovery",
            "ldap:x",
        ])
        .output()
        .expect("run datum-node");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("file:PATH"));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("seeds");
    // Each node's JSON lines, read on a thread of its own.
    let mut children = Vec::new();
    let mut lines = Vec::new();
    for _ in 0..2 {
        let mut child = Command::new(BIN)
            .args(["--cluster-name", "discovery-proc", "--secret", "s"])
            .args(["--discovery", &format!("file:{}", path.display())])
            .args(["--discovery-required", "2"])
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn datum-node");
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        children.push(common::KillOnDrop(child));
        lines.push(rx);
    }
    let next = |rx: &mpsc::Receiver<String>, event: &str| loop {
        let line = rx
            .recv_timeout(LONG)
            .unwrap_or_else(|e| panic!("no {event} line: {e}"));
        if line.contains(&format!("\"event\":\"{event}\"")) {
            return line;
        }
    };
    // The file is written once both listen: their `started` lines name them.
    let addrs: Vec<String> = lines
        .iter()
        .map(|rx| {
            let line: serde_json::Value = serde_json::from_str(&next(rx, "started")).unwrap();
            line["addr"].as_str().unwrap().to_owned()
        })
        .collect();
    std::fs::write(&path, format!("{}\n{}\n", addrs[0], addrs[1])).unwrap();
    for rx in &lines {
        next(rx, "member_up");
        next(rx, "member_up");
    }
    for child in &children {
        // SAFETY: a plain kill(2) of our own child.
        unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    }
    for child in &mut children {
        assert_eq!(child.0.wait().expect("exit").code(), Some(0));
    }
}
