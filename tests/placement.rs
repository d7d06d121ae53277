//! Placement by traffic (SPEC §13.11) on a real cluster: entities of one
//! type ask entities of another whose shards are dealt to other nodes;
//! with placement by traffic on, the shards that talk come together on
//! one node and stay, and no ask fails on the way. Three nodes on
//! 127.0.0.1 ports, in one process.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use datum_cluster_sharding::PlacementByTraffic;
use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::sharding::RebalanceReason;

const LONG: Duration = Duration::from_secs(90);
const ASK: Duration = Duration::from_secs(10);
const SHARDS: u32 = 12;
/// Asks of each pair in one pass, all in flight at once.
const ASKS_PER_PAIR: usize = 64;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Call(pub String);
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Here;

protocol! {
    /// Asks the callee it is told of, and answers whether the two live on
    /// one node.
    pub protocol Caller = "placement-caller" {
        ask Call -> bool;
    }
}

protocol! {
    /// Answers with the node it lives on.
    pub protocol Callee = "placement-callee" {
        ask Here -> String;
    }
}

struct CallerEntity {
    node: String,
    system: ShardedSystem,
}

impl Entity for CallerEntity {
    type Protocol = Caller;
}

impl Handler<Call> for CallerEntity {
    async fn handle(&mut self, msg: Call, _: &EntityContext) -> ShardingResult<bool> {
        let there = self
            .system
            .entity_ref::<Callee>(msg.0)
            .ask(Here, ASK)
            .await?;
        Ok(there == self.node)
    }
}

struct CalleeEntity {
    node: String,
}

impl Entity for CalleeEntity {
    type Protocol = Callee;
}

impl Handler<Here> for CalleeEntity {
    async fn handle(&mut self, _: Here, _: &EntityContext) -> ShardingResult<String> {
        Ok(self.node.clone())
    }
}

fn cluster_config(seeds: Vec<SocketAddr>) -> ClusterConfig {
    ClusterConfig::builder()
        .cluster_name("placement-test")
        .secret("placement-secret")
        .seed_nodes(seeds)
        .build()
}

fn sharding_config(by_traffic: bool) -> ShardingConfig {
    let mut config = ShardingConfig::builder()
        .num_shards(SHARDS)
        .passivation_idle_timeout(None)
        .rebalance_interval(Duration::from_secs(2))
        .build();
    if by_traffic {
        config.placement_by_traffic = Some(PlacementByTraffic::default());
    }
    config
}

/// Three nodes, each hosting both types.
async fn cluster(by_traffic: bool) -> Vec<(ClusterNode, ShardedSystem)> {
    let first = ClusterNode::start(cluster_config(vec![]))
        .await
        .expect("node starts");
    let mut clusters = vec![first.clone()];
    for _ in 1..3 {
        let node = ClusterNode::start(cluster_config(vec![first.bound_addr()]))
            .await
            .expect("node starts");
        clusters.push(node);
    }
    for c in &clusters {
        c.wait_until(|s| s.up_members().count() == 3, LONG)
            .await
            .expect("members Up");
    }
    let mut nodes = Vec::new();
    for (i, cluster) in clusters.into_iter().enumerate() {
        let system = ShardedSystem::builder()
            .config(sharding_config(by_traffic))
            .node(cluster.clone())
            .start()
            .await
            .expect("system starts");
        let node = format!("node-{i}");
        let label = node.clone();
        system
            .entity_type::<CalleeEntity>()
            .register(move |_| CalleeEntity {
                node: label.clone(),
            })
            .await
            .expect("registered");
        let handle = system.clone();
        system
            .entity_type::<CallerEntity>()
            .register(move |_| CallerEntity {
                node: node.clone(),
                system: handle.clone(),
            })
            .await
            .expect("registered");
        nodes.push((cluster, system));
    }
    nodes
}

/// One caller per shard `s`, each with a callee of shard `s + SHARDS / 2`:
/// `(caller, callee)` ids.
fn pairs(system: &ShardedSystem) -> Vec<(String, String)> {
    let mut callers = BTreeMap::new();
    let mut callees = BTreeMap::new();
    for k in 0..1_000 {
        let caller = format!("caller-{k}");
        let shard = system.entity_ref::<Caller>(caller.clone()).shard_id().0;
        callers.entry(shard).or_insert(caller);
        let callee = format!("callee-{k}");
        let shard = system.entity_ref::<Callee>(callee.clone()).shard_id().0;
        callees.entry(shard).or_insert(callee);
    }
    assert_eq!(callers.len(), SHARDS as usize, "a caller in every shard");
    assert_eq!(callees.len(), SHARDS as usize, "a callee in every shard");
    (0..SHARDS)
        .map(|s| {
            (
                callers[&s].clone(),
                callees[&((s + SHARDS / 2) % SHARDS)].clone(),
            )
        })
        .collect()
}

/// Every caller asks its callee `ASKS_PER_PAIR` times, all at once,
/// through `system`: how many pairs answered together every time. An ask
/// that fails fails the test.
async fn one_pass(system: &ShardedSystem, pairs: &[(String, String)]) -> usize {
    let mut asks = tokio::task::JoinSet::new();
    for (i, (caller, callee)) in pairs.iter().enumerate() {
        for _ in 0..ASKS_PER_PAIR {
            let caller = system.entity_ref::<Caller>(caller.clone());
            let call = Call(callee.clone());
            asks.spawn(async move { (i, caller.ask(call, ASK).await) });
        }
    }
    let mut together = vec![true; pairs.len()];
    while let Some(answer) = asks.join_next().await {
        match answer.expect("the ask's task") {
            (i, Ok(same_node)) => together[i] &= same_node,
            (i, Err(error)) => panic!("{:?}: {error}", pairs[i]),
        }
    }
    together.iter().filter(|t| **t).count()
}

async fn stop(nodes: Vec<(ClusterNode, ShardedSystem)>) {
    for (_, system) in &nodes {
        system.shutdown().await;
    }
    for (cluster, _) in &nodes {
        let _ = cluster.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_that_talk_come_together_and_stay() {
    let nodes = cluster(true).await;
    // Every region registered before the first shard is dealt.
    for (_, system) in &nodes {
        let deadline = Instant::now() + LONG;
        while !system.sharding_coordinator().is_some_and(|c| c.registered) {
            assert!(Instant::now() < deadline, "regions not registered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let pairs = pairs(&nodes[0].1);
    // Least-shards deals each type's shards to the nodes in turn, in the
    // order they are first asked for: the callees one pair ahead of the
    // callers, so that every pair starts apart.
    for k in 0..pairs.len() {
        let callee = &pairs[(k + 1) % pairs.len()].1;
        let entity = nodes[1].1.entity_ref::<Callee>(callee.clone());
        entity.ask(Here, ASK).await.expect("the callee answers");
    }
    let mut first = 0;
    for (caller, callee) in &pairs {
        let entity = nodes[1].1.entity_ref::<Caller>(caller.clone());
        first += usize::from(
            entity
                .ask(Call(callee.clone()), ASK)
                .await
                .expect("answered"),
        );
    }
    assert!(first < pairs.len(), "together from the start");
    let deadline = Instant::now() + LONG;
    // Until every pair is together.
    loop {
        let together = one_pass(&nodes[1].1, &pairs).await;
        if together == pairs.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{together} of {} pairs together",
            pairs.len()
        );
    }
    // And they stay: the traffic goes on for three more rounds, and no
    // pair comes apart nor shard moves.
    let traffic_moves = || {
        let rounds = nodes[0].1.rebalance_rounds();
        let moves: usize = rounds
            .iter()
            .filter(|r| r.reason == RebalanceReason::Traffic)
            .map(|r| r.moves.len())
            .sum();
        (moves, rounds)
    };
    let (moves, rounds) = traffic_moves();
    let settled = Instant::now();
    while settled.elapsed() < Duration::from_secs(6) {
        assert_eq!(one_pass(&nodes[1].1, &pairs).await, pairs.len());
    }
    assert_eq!(traffic_moves().0, moves, "moved again");
    assert!(moves > 0, "moved for traffic: {rounds:?}");
    // Each pair needs one of its shards moved, perhaps twice on the way.
    assert!(moves <= 2 * pairs.len(), "{moves} moves: {rounds:?}");
    // The counts per node are within the slack.
    for hosted in [
        nodes
            .iter()
            .map(|(_, s)| s.hosted_shards::<Caller>())
            .collect::<Vec<_>>(),
        nodes
            .iter()
            .map(|(_, s)| s.hosted_shards::<Callee>())
            .collect(),
    ] {
        let spread = hosted.iter().max().unwrap() - hosted.iter().min().unwrap();
        assert!(spread <= 2, "{hosted:?}");
    }
    stop(nodes).await;
}
