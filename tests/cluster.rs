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
