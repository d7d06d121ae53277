//! Membership over real pipes: nodes on 127.0.0.1 ports in one process.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::identity::UniqueAddress;
use datum_cluster_sharding::membership::{MemberStatus, MembershipEvent, MembershipState};

const LONG: Duration = Duration::from_secs(15);

fn config(seeds: Vec<SocketAddr>) -> ClusterConfig {
    ClusterConfig::builder()
        .cluster_name("test-cluster")
        .secret("test-secret")
        .seed_nodes(seeds)
        // These tests pin timeout downing's timing (the resolver, the
        // default, is tested in the membership simulator and
        // tests/partition.rs).
        .split_brain(None)
        .build()
}

async fn node(seeds: Vec<SocketAddr>) -> ClusterNode {
    ClusterNode::start(config(seeds))
        .await
        .expect("node starts")
}

fn up_count(s: &MembershipState) -> usize {
    s.up_members().count()
}

fn status(s: &MembershipState, m: &UniqueAddress) -> Option<MemberStatus> {
    s.status_of(m)
}

/// Three nodes joined through the first; returns them once all see three Up.
async fn three() -> Vec<ClusterNode> {
    let a = node(vec![]).await;
    let b = node(vec![a.bound_addr()]).await;
    let c = node(vec![a.bound_addr()]).await;
    let nodes = vec![a, b, c];
    for n in &nodes {
        n.wait_until(|s| up_count(s) == 3, LONG)
            .await
            .expect("three nodes Up");
    }
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_form_a_cluster_and_a_fourth_joins() {
    let nodes = three().await;
    // Everyone agrees on the coordinator: the oldest, which is the first node.
    for n in &nodes {
        let s = n.current_state();
        assert_eq!(s.placement_coordinator(), Some(nodes[0].self_address()));
        assert!(s.is_placement_coordinator(nodes[0].node_id()));
        assert!(!s.is_placement_coordinator(nodes[1].node_id()));
    }
    let d = node(vec![nodes[1].bound_addr()]).await;
    for n in nodes.iter().chain([&d]) {
        n.wait_until(|s| up_count(s) == 4, LONG)
            .await
            .expect("four nodes Up");
    }
    for n in nodes.iter().chain([&d]) {
        n.shutdown().await.ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_node_is_unreachable_then_down_within_the_configured_time() {
    let nodes = three().await;
    let victim = nodes[2].self_address();
    let mut events = nodes[0].subscribe();
    let crashed_at = Instant::now();
    nodes[2].crash().await;
    let mut unreachable_at = None;
    let down_at = tokio::time::timeout(LONG, async {
        loop {
            match events.recv().await.expect("events") {
                MembershipEvent::Unreachable(m) if m == victim => {
                    unreachable_at = Some(crashed_at.elapsed())
                }
                MembershipEvent::MemberDowned(m) if m == victim => return crashed_at.elapsed(),
                _ => {}
            }
        }
    })
    .await
    .expect("the crashed node was never downed");
    let budget = config(vec![]).detect_and_down_time().unwrap();
    eprintln!("crash → unreachable {unreachable_at:?}, → down {down_at:?} (budget {budget:?})");
    assert!(unreachable_at.is_some(), "Unreachable comes before Down");
    // Generous: the budget plus scheduling slack on a loaded 2-core machine.
    assert!(
        down_at < budget + Duration::from_millis(700),
        "down after {down_at:?}"
    );
    // The other survivor downs it too, within the same bound.
    nodes[1]
        .wait_until(
            |s| status(s, &victim) != Some(MemberStatus::Up),
            budget + Duration::from_secs(1),
        )
        .await
        .expect("the second survivor downs the crashed node too");
    for n in &nodes[..2] {
        n.wait_until(
            |s| !matches!(status(s, &victim), Some(MemberStatus::Up)),
            LONG,
        )
        .await
        .unwrap();
        n.wait_until(|s| up_count(s) == 2, LONG).await.unwrap();
    }
    for n in &nodes[..2] {
        n.shutdown().await.ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_leave_ends_removed_everywhere() {
    let nodes = three().await;
    let leaver = nodes[1].self_address();
    let mut events = nodes[0].subscribe();
    let mut leaver_events = nodes[1].subscribe();
    let leave_started = Instant::now();
    nodes[1].shutdown().await.expect("graceful leave completes");
    eprintln!("graceful leave took {:?}", leave_started.elapsed());
    // The leaver heard it was removed (its last gossip was flushed before its
    // pipes closed), so it never suspected its healthy peers.
    let mut leaver_saw = Vec::new();
    while let Ok(event) = leaver_events.try_recv() {
        leaver_saw.push(event);
    }
    assert!(
        leaver_saw.iter().any(
            |e| matches!(e, MembershipEvent::MemberRemoved { member, .. } if *member == leaver)
        ),
        "the leaver never learned it was removed: {leaver_saw:?}"
    );
    assert!(
        !leaver_saw.iter().any(|e| matches!(
            e,
            MembershipEvent::MemberDowned(_) | MembershipEvent::Unreachable(_)
        )),
        "the leaver suspected healthy peers: {leaver_saw:?}"
    );
    let mut seen = Vec::new();
    tokio::time::timeout(LONG, async {
        loop {
            match events.recv().await.expect("events") {
                MembershipEvent::MemberRemoved { member, previous } if member == leaver => {
                    seen.push(format!("removed from {previous:?}"));
                    return;
                }
                MembershipEvent::MemberLeft(m) if m == leaver => seen.push("left".into()),
                MembershipEvent::MemberExited(m) if m == leaver => seen.push("exited".into()),
                MembershipEvent::MemberDowned(m) if m == leaver => {
                    panic!("a leaver must not be downed")
                }
                _ => {}
            }
        }
    })
    .await
    .expect("the leaver was never removed");
    assert_eq!(
        seen.last().map(String::as_str),
        Some("removed from Exiting"),
        "{seen:?}"
    );
    for n in [&nodes[0], &nodes[2]] {
        n.wait_until(|s| status(s, &leaver).is_none() && up_count(s) == 2, LONG)
            .await
            .unwrap();
    }
    for n in [&nodes[0], &nodes[2]] {
        n.shutdown().await.ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_moves_to_the_next_oldest_when_the_oldest_dies() {
    let nodes = three().await;
    let (oldest, next) = (nodes[0].self_address(), nodes[1].self_address());
    assert!(oldest.is_older_than(&next));
    assert!(
        nodes[2]
            .current_state()
            .is_placement_coordinator(oldest.node_id)
    );
    nodes[0].crash().await;
    for n in &nodes[1..] {
        let s = n
            .wait_until(
                |s| {
                    s.placement_coordinator() == Some(next)
                        && status(s, &oldest) != Some(MemberStatus::Up)
                },
                LONG,
            )
            .await
            .expect("coordinator moved");
        assert!(s.is_placement_coordinator(next.node_id));
        assert!(!s.is_placement_coordinator(oldest.node_id));
    }
    for n in &nodes[1..] {
        n.shutdown().await.ok();
    }
}

/// A node that cannot authenticate never becomes a member, and the cluster
/// keeps admitting correct nodes meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_name_wrong_secret_and_garbage_are_refused_while_the_cluster_works() {
    use tokio::io::AsyncWriteExt;
    let nodes = three().await;
    let seed = nodes[0].bound_addr();
    let wrong_name = ClusterNode::start(
        ClusterConfig::builder()
            .cluster_name("other-cluster")
            .secret("test-secret")
            .seed_nodes(vec![seed])
            .build(),
    )
    .await
    .unwrap();
    let wrong_secret = ClusterNode::start(
        ClusterConfig::builder()
            .cluster_name("test-cluster")
            .secret("guess")
            .seed_nodes(vec![seed])
            .build(),
    )
    .await
    .unwrap();
    // Raw garbage, and a length prefix far above the maximum frame size.
    let mut garbage = tokio::net::TcpStream::connect(seed).await.unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut oversized = tokio::net::TcpStream::connect(seed).await.unwrap();
    oversized.write_all(&u32::MAX.to_be_bytes()).await.unwrap();

    // A correct fourth node joins through the same seed meanwhile.
    let good = node(vec![seed]).await;
    for n in nodes.iter().chain([&good]) {
        n.wait_until(|s| up_count(s) == 4, LONG)
            .await
            .expect("the cluster kept working");
    }
    // The refused nodes are members nowhere, and see only themselves.
    for bad in [&wrong_name, &wrong_secret] {
        for n in nodes.iter().chain([&good]) {
            assert_eq!(status(&n.current_state(), &bad.self_address()), None);
        }
        assert!(
            bad.current_state()
                .members
                .iter()
                .all(|m| m.address == bad.self_address())
        );
    }
    // The bad connections were closed by the node, which keeps serving.
    let mut buf = [0u8; 64];
    for conn in [&mut garbage, &mut oversized] {
        let closed =
            tokio::time::timeout(LONG, tokio::io::AsyncReadExt::read(conn, &mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "connection not closed: {closed:?}"
        );
    }
    for n in nodes.iter().chain([&good, &wrong_name, &wrong_secret]) {
        n.crash().await;
    }
}

/// A join refused for another cluster name or secret is reported: an event
/// per refusal naming the seed and the reason, then the node gives up and
/// `wait_until` fails with `JoinRefused` (not a plain timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_join_is_reported_and_the_node_gives_up() {
    use datum_cluster_sharding::cluster::{ClusterError, JoinRefusal};
    use datum_cluster_sharding::wire::RejectReason;
    let seed_node = node(vec![]).await;
    let seed = seed_node.bound_addr();
    let cases = [
        (
            "other-cluster",
            "test-secret",
            RejectReason::WrongCluster,
            true,
        ),
        // The joiner cannot verify the seed's proof of the secret.
        ("test-cluster", "guess", RejectReason::BadProof, false),
    ];
    for (name, secret, reason, by_seed) in cases {
        let bad = ClusterNode::start(
            ClusterConfig::builder()
                .cluster_name(name)
                .secret(secret)
                .seed_nodes(vec![seed])
                .join_refusal_limit(3)
                .build(),
        )
        .await
        .unwrap();
        let mut events = bad.subscribe();
        let error = bad
            .wait_until(|s| s.self_status() == Some(MemberStatus::Up), LONG)
            .await
            .expect_err("a refused node never becomes Up");
        match &error {
            ClusterError::JoinRefused {
                refusal:
                    JoinRefusal {
                        seed: s,
                        reason: r,
                        by_seed: b,
                        refusals,
                        tls,
                        ..
                    },
            } => {
                assert_eq!((*s, r, *b), (seed, &reason, by_seed), "{error}");
                assert_eq!(tls, &None, "not a TLS refusal: {error}");
                assert_eq!(*refusals, 3, "gave up at the limit: {error}");
            }
            other => panic!("expected JoinRefused, got {other:?}"),
        }
        assert!(error.to_string().contains(&seed.to_string()), "{error}");
        // The refusals were published (the first may predate the subscription).
        let mut published = 0;
        while let Ok(event) = events.try_recv() {
            if let MembershipEvent::JoinRefused {
                seed: s,
                reason: r,
                by_seed: b,
            } = event
            {
                assert_eq!((s, r, b), (seed, reason.clone(), by_seed));
                published += 1;
            }
        }
        assert!(published >= 2, "{published} refusal events");
        assert_eq!(bad.join_refusal().map(|r| r.refusals), Some(3));
        bad.crash().await;
    }
    // The seed never admitted them and serves on.
    assert_eq!(seed_node.current_state().members.len(), 1);
    seed_node.crash().await;
}

/// One seed of another cluster among good ones that are still starting does
/// not make a joining node give up: it gives up only once every seed has
/// refused it, and joins when a good seed comes up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_refusing_seed_among_starting_ones_does_not_stop_the_join() {
    let stranger = ClusterNode::start(
        ClusterConfig::builder()
            .cluster_name("other-cluster")
            .secret("test-secret")
            .build(),
    )
    .await
    .unwrap();
    // A port for the good seed, free until it starts.
    let good_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let limit = 3;
    let mut joiner_config = config(vec![stranger.bound_addr(), good_addr]);
    joiner_config.join_refusal_limit = limit;
    let joiner = ClusterNode::start(joiner_config).await.unwrap();
    let mut events = joiner.subscribe();
    // Well past the limit from the one refusing seed...
    let mut refused = 0;
    while refused < 2 * limit {
        match tokio::time::timeout(LONG, events.recv()).await {
            Ok(Ok(MembershipEvent::JoinRefused { seed, .. })) => {
                assert_eq!(seed, stranger.bound_addr());
                refused += 1;
            }
            Ok(Ok(_)) => {}
            other => panic!("no refusal: {other:?}"),
        }
    }
    // ...the node is still joining, and joins once a good seed is up.
    let mut good_config = config(vec![]);
    good_config.bind_addr = good_addr;
    let good = ClusterNode::start(good_config)
        .await
        .expect("the good seed binds its port");
    joiner
        .wait_until(|s| s.self_status() == Some(MemberStatus::Up), LONG)
        .await
        .expect("joined through the good seed");
    assert_eq!(
        joiner.join_refusal(),
        None,
        "a member has no refusal to report"
    );
    for n in [&joiner, &good, &stranger] {
        n.crash().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_at_the_same_address_is_a_new_member() {
    let nodes = three().await;
    let old = nodes[2].self_address();
    nodes[2].crash().await;
    let restarted = ClusterNode::start(
        ClusterConfig::builder()
            .cluster_name("test-cluster")
            .secret("test-secret")
            .bind_addr(old.addr)
            .seed_nodes(vec![nodes[0].bound_addr()])
            .build(),
    )
    .await
    .expect("rebinds the same port");
    let new = restarted.self_address();
    assert_eq!(new.addr, old.addr);
    assert_ne!(new.node_id, old.node_id);
    for n in [&nodes[0], &nodes[1], &restarted] {
        n.wait_until(
            |s| {
                s.status_of(&new) == Some(MemberStatus::Up)
                    && !matches!(s.status_of(&old), Some(MemberStatus::Up))
                    && up_count(s) == 3
            },
            LONG,
        )
        .await
        .expect("the new incarnation is Up and the old one is not");
    }
    for n in [&nodes[0], &nodes[1], &restarted] {
        n.shutdown().await.ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_never_joined_shuts_down_at_once() {
    // Nothing listens on port 1: the seed never answers.
    let lonely = node(vec!["127.0.0.1:1".parse().unwrap()]).await;
    let started = Instant::now();
    lonely.shutdown().await.expect("nothing to leave");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_shutdowns_share_one_graceful_leave() {
    let nodes = three().await;
    let leaver = nodes[2].self_address();
    let mut events = nodes[0].subscribe();
    let twin = nodes[2].clone();
    let (a, b) = tokio::join!(nodes[2].shutdown(), twin.shutdown());
    a.expect("first shutdown");
    b.expect("second shutdown");
    tokio::time::timeout(LONG, async {
        loop {
            if let MembershipEvent::MemberRemoved { member, previous } =
                events.recv().await.unwrap()
                && member == leaver
            {
                return assert_eq!(
                    previous,
                    MemberStatus::Exiting,
                    "a graceful leave, not a down"
                );
            }
        }
    })
    .await
    .expect("never removed");
    for n in &nodes[..2] {
        n.shutdown().await.expect("graceful leave");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_every_handle_stops_the_node_and_the_others_down_it() {
    let mut nodes = three().await;
    let dropped = nodes.pop().unwrap();
    let gone = dropped.self_address();
    drop(dropped);
    for n in &nodes {
        n.wait_until(
            |s| {
                matches!(
                    status(s, &gone),
                    None | Some(MemberStatus::Down | MemberStatus::Removed)
                )
            },
            LONG,
        )
        .await
        .expect("a node whose handles were all dropped must stop heartbeating");
    }
    for n in &nodes {
        n.shutdown().await.expect("graceful leave");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_down_reports_what_the_core_decided() {
    let nodes = three().await;
    let stranger = UniqueAddress::new_at("127.0.0.1:9".parse().unwrap());
    assert!(matches!(
        nodes[0].down(stranger).await,
        Err(datum_cluster_sharding::cluster::ClusterError::Membership(_))
    ));
    let victim = nodes[2].self_address();
    nodes[0]
        .down(victim)
        .await
        .expect("a known member can be downed");
    for n in &nodes[..2] {
        n.wait_until(|s| status(s, &victim) != Some(MemberStatus::Up), LONG)
            .await
            .unwrap();
    }
    for n in &nodes[..2] {
        n.shutdown().await.expect("graceful leave");
    }
    nodes[2].crash().await;
}
