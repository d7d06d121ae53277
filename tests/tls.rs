//! Three-node clusters with every pipe under TLS 1.3 (feature `tls`), on
//! 127.0.0.1: sharding traffic between all nodes, a kill and a handoff; a
//! plaintext node kept out; and certificates renewed on disk under traffic
//! — the old ones then expire — with no ask lost.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::transport::{Tls, TlsConfig, generate_test_certificates};

#[path = "../protocols/counter.rs"]
mod counter;
use counter::{Add, Counter, CounterEntity, Get};

const LONG: Duration = Duration::from_secs(20);
const ASK: Duration = Duration::from_secs(5);
const SHARDS: u32 = 32;
const DAY: Duration = Duration::from_secs(86_400);

struct Node {
    cluster: ClusterNode,
    system: ShardedSystem,
}

fn config(tls: Option<&TlsConfig>, seeds: Vec<std::net::SocketAddr>) -> ClusterConfig {
    let mut config = ClusterConfig::builder()
        .cluster_name("tls-test")
        .secret("tls-secret")
        .seed_nodes(seeds)
        .build();
    config.tls = tls.map(|t| Tls::load(t.clone()).expect("the TLS files load"));
    config
}

/// A node joining through `seed` (or forming the cluster), with the counter
/// type registered.
async fn node(tls: &TlsConfig, seed: Option<&Node>) -> Node {
    let seeds = seed
        .map(|s| vec![s.cluster.bound_addr()])
        .unwrap_or_default();
    let cluster = ClusterNode::start(config(Some(tls), seeds))
        .await
        .expect("node starts");
    let system = ShardedSystem::builder()
        .num_shards(SHARDS)
        .passivation_idle_timeout(None)
        .node(cluster.clone())
        .start()
        .await
        .expect("system starts");
    system
        .entity_type::<CounterEntity>()
        .register(|_| CounterEntity::default())
        .await
        .expect("registered");
    Node { cluster, system }
}

async fn all_up(nodes: &[Node], n: usize) {
    for node in nodes {
        node.cluster
            .wait_until(|s| s.up_members().count() == n, LONG)
            .await
            .expect("all Up");
    }
}

/// Asks `Get` of `id` until it is answered (within `LONG`).
async fn get(system: &ShardedSystem, id: &str) -> u64 {
    let deadline = Instant::now() + LONG;
    loop {
        match system.entity_ref::<Counter>(id).ask(Get, ASK).await {
            Ok(n) => return n,
            Err(e) => {
                assert!(Instant::now() < deadline, "{id} never answered: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn stop(nodes: Vec<Node>) {
    for n in &nodes {
        n.system.shutdown().await;
    }
    for n in &nodes {
        let _ = n.cluster.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_shards_survives_a_kill_and_hands_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs =
        generate_test_certificates(dir.path(), &["127.0.0.1"; 4], DAY).expect("certificates");
    let first = node(&certs[0], None).await;
    let second = node(&certs[1], Some(&first)).await;
    let third = node(&certs[2], Some(&first)).await;
    let nodes = vec![first, second, third];
    all_up(&nodes, 3).await;
    // Every region registered before the first allocation (a slow third
    // node would otherwise be given no shard before the check below).
    for n in &nodes {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !n
            .system
            .sharding_coordinator()
            .is_some_and(|s| s.registered)
        {
            assert!(Instant::now() < deadline, "regions never registered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    // Every node adds to every counter: each Add crosses a TLS pipe unless
    // the counter lives on the sender's node.
    let ids: Vec<String> = (0..60).map(|k| format!("c{k}")).collect();
    for n in &nodes {
        for id in &ids {
            n.system
                .entity_ref::<Counter>(id.as_str())
                .tell(Add(1))
                .await
                .expect("tell");
        }
    }
    for id in &ids {
        // Per-sender order: each node's Get follows its own Add.
        for n in &nodes {
            assert!(get(&n.system, id).await >= 1, "{id}");
        }
        assert_eq!(
            get(&nodes[0].system, id).await,
            3,
            "{id}: one Add from each node"
        );
    }
    let on_third = nodes[2].system.hosted_shards::<Counter>();
    assert!(on_third > 0, "the third node hosts shards");

    // A plaintext node cannot join: the seed speaks only TLS.
    let plain = ClusterNode::start(config(None, vec![nodes[0].cluster.bound_addr()]))
        .await
        .expect("starts alone");
    let joined = plain
        .wait_until(|s| s.up_members().count() > 1, Duration::from_secs(3))
        .await;
    assert!(joined.is_err(), "a plaintext node joined a TLS cluster");
    let _ = plain.shutdown().await;
    assert!(nodes[0].cluster.current_state().up_members().count() == 3);

    // The third node dies: its shards move to the survivors over TLS.
    let mut nodes = nodes;
    let dead = nodes.pop().expect("three");
    dead.cluster.crash().await;
    for id in &ids {
        get(&nodes[0].system, id).await;
        get(&nodes[1].system, id).await;
    }
    let hosted: usize = nodes
        .iter()
        .map(|n| n.system.hosted_shards::<Counter>())
        .sum();
    assert!(
        hosted >= on_third,
        "the survivors host the dead node's shards"
    );

    // The second node's system shuts down: its shards are handed off to the
    // first, and every counter still answers there.
    let second = nodes.pop().expect("two");
    second.system.shutdown().await;
    for id in &ids {
        get(&nodes[0].system, id).await;
    }
    let _ = second.cluster.shutdown().await;
    dead.system.shutdown().await;
    stop(nodes).await;
}

/// Copies `from`'s three files over `to`'s, each written aside and renamed
/// (as a certificate manager does), so no reader sees half a file.
fn install(from: &TlsConfig, to: &TlsConfig) {
    let pairs: [(&Path, &PathBuf); 3] = [
        (&from.cert_chain, &to.cert_chain),
        (&from.private_key, &to.private_key),
        (&from.ca_roots, &to.ca_roots),
    ];
    for (src, dst) in pairs {
        let tmp = dst.with_extension("tmp");
        std::fs::copy(src, &tmp).expect("copy");
        std::fs::rename(&tmp, dst).expect("rename");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_renewed_on_disk_under_traffic_lose_no_ask() {
    let dir = tempfile::tempdir().expect("tempdir");
    let names = ["127.0.0.1"; 4];
    // Short-lived certificates (twelve seconds: the cluster forms well within
    // them), and their renewals: a year,
    // from another CA. Every node trusts both CAs (one bundle).
    let issued = Instant::now();
    let short =
        generate_test_certificates(&dir.path().join("short"), &names, Duration::from_secs(12))
            .expect("certificates");
    let renewed = generate_test_certificates(&dir.path().join("renewed"), &names, DAY * 365)
        .expect("certificates");
    let bundle = dir.path().join("bundle.pem");
    let read = |p: &Path| std::fs::read(p).expect("read");
    std::fs::write(
        &bundle,
        [read(&short[0].ca_roots), read(&renewed[0].ca_roots)].concat(),
    )
    .expect("bundle");
    let trusting = |c: &TlsConfig| TlsConfig::new(&c.cert_chain, &c.private_key, &bundle);
    // Each node reads its files from a directory of its own.
    let live: Vec<TlsConfig> = (0..4)
        .map(|i| {
            let d = dir.path().join(format!("node-{i}"));
            std::fs::create_dir(&d).expect("mkdir");
            let files = TlsConfig::new(d.join("cert.pem"), d.join("key.pem"), d.join("ca.pem"));
            install(&trusting(&short[i]), &files);
            files
        })
        .collect();
    let first = node(&live[0], None).await;
    let second = node(&live[1], Some(&first)).await;
    let third = node(&live[2], Some(&first)).await;
    let nodes = Arc::new(vec![first, second, third]);
    all_up(&nodes, 3).await;

    // Traffic from every node, until told to stop; every ask must be
    // answered at the first attempt.
    let running = Arc::new(AtomicBool::new(true));
    let (answered, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut drivers = Vec::new();
    for i in 0..3 {
        for k in 0..4 {
            let (nodes, running) = (nodes.clone(), running.clone());
            let (answered, failed) = (answered.clone(), failed.clone());
            drivers.push(tokio::spawn(async move {
                let mut round = 0u64;
                while running.load(Ordering::Relaxed) {
                    let id = format!("r{}", (round * 7 + k) % 40);
                    match nodes[i]
                        .system
                        .entity_ref::<Counter>(id.as_str())
                        .ask(Get, ASK)
                        .await
                    {
                        Ok(_) => answered.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            eprintln!("node {i}: {id}: {e}");
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                    round += 1;
                }
            }));
        }
    }
    // Renewal: every node's files replaced while the traffic runs.
    for (files, new) in live.iter().zip(&renewed) {
        install(&trusting(new), files);
    }
    // Past the old certificates' expiry (and a second for whole-second
    // X.509 times), the established pipes still carry the traffic...
    let expired = issued + Duration::from_secs(14);
    tokio::time::sleep_until(expired.into()).await;
    let before = answered.load(Ordering::Relaxed);
    // ...and a new node joins through the first: the handshakes of its new
    // pipes use the renewed certificates, since the old ones have expired.
    let fourth = node(&live[3], Some(&nodes[0])).await;
    fourth
        .cluster
        .wait_until(|s| s.up_members().count() == 4, LONG)
        .await
        .expect("the new node is Up: its pipes were made with the renewed certificates");
    for k in 0..40 {
        get(&fourth.system, &format!("r{k}")).await;
    }
    running.store(false, Ordering::Relaxed);
    for d in drivers {
        d.await.expect("driver");
    }
    let (answered, failed) = (
        answered.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
    );
    assert!(
        answered > before,
        "traffic went on after the old certificates expired"
    );
    assert_eq!(failed, 0, "{failed} asks failed of {}", answered + failed);
    eprintln!("{answered} asks answered across the renewal, none failed");
    fourth.system.shutdown().await;
    let _ = fourth.cluster.shutdown().await;
    let nodes = Arc::try_unwrap(nodes).ok().expect("drivers done");
    stop(nodes).await;
}

/// A node that TLS keeps from its seed — its certificate from another CA,
/// the seed's certificate not naming what it expects, no TLS at all, or TLS
/// at a plaintext seed — gives up joining as a node with a wrong secret
/// does: `wait_until` fails with `JoinRefused`, whose refusal carries TLS's
/// reason, and the node stops (so a supervisor sees it fail instead of
/// waiting for ever). The seeds serve on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_tls_keeps_out_gives_up_joining_and_says_why() {
    use datum_cluster_sharding::cluster::ClusterError;
    let dir = tempfile::tempdir().expect("tempdir");
    let ours = generate_test_certificates(
        &dir.path().join("ours"),
        &["127.0.0.1", "127.0.0.1", "nodes.elsewhere.test"],
        DAY,
    )
    .expect("certificates");
    let theirs = generate_test_certificates(&dir.path().join("theirs"), &["127.0.0.1"], DAY)
        .expect("certificates");
    let seed = ClusterNode::start(config(Some(&ours[0]), vec![]))
        .await
        .expect("the TLS seed starts");
    let plain_seed = ClusterNode::start(config(None, vec![]))
        .await
        .expect("the plaintext seed starts");
    for s in [&seed, &plain_seed] {
        s.wait_until(|s| s.self_status().is_some(), LONG)
            .await
            .expect("a seed forms its cluster");
    }
    let elsewhere = ours[2].clone().with_peer_name("nodes.elsewhere.test");
    let cases = [
        (
            "a certificate from another CA",
            Some(&theirs[0]),
            &seed,
            "UnknownIssuer",
        ),
        (
            "a seed certificate naming something else",
            Some(&elsewhere),
            &seed,
            "not valid for name",
        ),
        ("no TLS, at a TLS seed", None, &seed, "speaks TLS"),
        (
            "TLS, at a plaintext seed",
            Some(&ours[1]),
            &plain_seed,
            "speaks plaintext",
        ),
    ];
    for (case, tls, seed, says) in cases {
        let node = ClusterNode::start(config(tls, vec![seed.bound_addr()]))
            .await
            .expect("starts");
        let error = node
            .wait_until(|s| s.self_status().is_some(), LONG)
            .await
            .expect_err(case);
        match &error {
            ClusterError::JoinRefused { refusal } => {
                assert_eq!(refusal.seed, seed.bound_addr(), "{case}: {error}");
                let tls = refusal.tls.as_deref().unwrap_or_default();
                assert!(tls.contains(says), "{case}: {error}");
            }
            other => panic!("{case}: expected JoinRefused, got {other:?}"),
        }
        assert!(error.to_string().contains(says), "{case}: {error}");
        assert!(!node.is_running(), "{case}: the node gave up and stopped");
        assert_eq!(node.join_refusal().map(|r| r.seed), Some(seed.bound_addr()));
        node.crash().await;
    }
    for s in [&seed, &plain_seed] {
        assert_eq!(s.current_state().members.len(), 1, "nobody was admitted");
        s.crash().await;
    }
}
