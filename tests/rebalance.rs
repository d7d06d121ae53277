//! Shards that move while the cluster stays up: rebalance after a join,
//! graceful leaves, rolling restarts, coordinator takeover, handoffs whose
//! owner dies, proxy-only regions and roles. Real clusters on 127.0.0.1
//! ports, in one process.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::membership::MemberStatus;
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::sharding::{RebalanceReason, RebalanceRound};

const LONG: Duration = Duration::from_secs(30);
const ASK: Duration = Duration::from_secs(5);
const SHARDS: u32 = 32;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Append(pub u64);
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entries;
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Where;
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Slow(pub u64);

protocol! {
    /// An entity that keeps the sequence it is sent and says where it lives.
    pub protocol Seq = "seq" {
        ask Append -> u64;
        ask Entries -> Vec<u64>;
        ask Where -> String;
        ask Slow -> ();
    }
}

/// What every entity of a test was sent, in the order it handled it, kept
/// outside the entities (shared by the nodes of one process, as a database
/// would be): a moved entity starts with an empty `log`, the ledger goes on.
type Ledger = Arc<Mutex<BTreeMap<String, Vec<u64>>>>;

struct SeqEntity {
    node: String,
    id: String,
    log: Vec<u64>,
    ledger: Ledger,
}

impl Entity for SeqEntity {
    type Protocol = Seq;
}
impl Handler<Append> for SeqEntity {
    async fn handle(&mut self, msg: Append, _: &EntityContext) -> ShardingResult<u64> {
        self.log.push(msg.0);
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        ledger.entry(self.id.clone()).or_default().push(msg.0);
        Ok(self.log.len() as u64)
    }
}
impl Handler<Entries> for SeqEntity {
    async fn handle(&mut self, _: Entries, _: &EntityContext) -> ShardingResult<Vec<u64>> {
        Ok(self.log.clone())
    }
}
impl Handler<Where> for SeqEntity {
    async fn handle(&mut self, _: Where, _: &EntityContext) -> ShardingResult<String> {
        Ok(self.node.clone())
    }
}
impl Handler<Slow> for SeqEntity {
    async fn handle(&mut self, msg: Slow, _: &EntityContext) -> ShardingResult<()> {
        // Noted under `<id>#slow` as it begins (a test can wait for it).
        self.ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(format!("{}#slow", self.id))
            .or_default()
            .push(msg.0);
        tokio::time::sleep(Duration::from_millis(msg.0)).await;
        Ok(())
    }
}

fn cluster_config(seeds: Vec<SocketAddr>, roles: &[&str]) -> ClusterConfig {
    ClusterConfig::builder()
        .cluster_name("rebalance-test")
        .secret("rebalance-secret")
        .seed_nodes(seeds)
        .roles(roles.iter().copied())
        .build()
}

fn sharding_config() -> ShardingConfig {
    ShardingConfig::builder()
        .num_shards(SHARDS)
        .passivation_idle_timeout(None)
        .rebalance_interval(Duration::from_millis(300))
        .build()
}

struct Node {
    label: String,
    cluster: ClusterNode,
    system: ShardedSystem,
    ledger: Ledger,
}

async fn start_cluster_node(seeds: Vec<SocketAddr>, roles: &[&str]) -> ClusterNode {
    ClusterNode::start(cluster_config(seeds, roles))
        .await
        .expect("node starts")
}

async fn start_system(cluster: &ClusterNode) -> ShardedSystem {
    ShardedSystem::builder()
        .config(sharding_config())
        .node(cluster.clone())
        .start()
        .await
        .expect("system starts")
}

fn factory(
    label: &str,
    ledger: &Ledger,
) -> impl Fn(&EntityContext) -> SeqEntity + Send + Sync + 'static {
    let (node, ledger) = (label.to_owned(), ledger.clone());
    move |ctx| SeqEntity {
        node: node.clone(),
        id: ctx.entity_id().to_owned(),
        log: Vec::new(),
        ledger: ledger.clone(),
    }
}

async fn host(cluster: ClusterNode, label: &str, ledger: &Ledger) -> Node {
    let system = start_system(&cluster).await;
    system
        .entity_type::<SeqEntity>()
        .register(factory(label, ledger))
        .await
        .expect("registered");
    Node {
        label: label.to_owned(),
        cluster,
        system,
        ledger: ledger.clone(),
    }
}

async fn wait_up(clusters: &[&ClusterNode], n: usize) {
    for c in clusters {
        c.wait_until(|s| s.up_members().count() == n, LONG)
            .await
            .expect("members Up");
    }
}

/// `n` hosting nodes, all Up.
async fn cluster_of(n: usize) -> Vec<Node> {
    let first = start_cluster_node(vec![], &[]).await;
    let mut clusters = vec![first.clone()];
    for _ in 1..n {
        clusters.push(start_cluster_node(vec![first.bound_addr()], &[]).await);
    }
    wait_up(&clusters.iter().collect::<Vec<_>>(), n).await;
    let ledger = Ledger::default();
    let mut nodes = Vec::new();
    for (i, cluster) in clusters.into_iter().enumerate() {
        nodes.push(host(cluster, &format!("node-{i}"), &ledger).await);
    }
    nodes
}

async fn stop(nodes: &[Node]) {
    for n in nodes {
        n.system.shutdown().await;
    }
    for n in nodes {
        let _ = n.cluster.shutdown().await;
    }
}

/// Where `entity` lives, asking until it answers (within `LONG`).
async fn where_retrying(entity: &EntityRef<Seq>) -> String {
    let deadline = Instant::now() + LONG;
    loop {
        match entity.ask(Where, ASK).await {
            Ok(home) => return home,
            Err(error) => {
                assert!(Instant::now() < deadline, "{}: {error}", entity.entity_id());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// A fourth node with a proxy-only region of `Seq`, once all four are Up:
/// a client whose every ask goes straight to the shard's owner.
async fn join_proxy(nodes: &[Node]) -> (ClusterNode, ShardedSystem) {
    let proxy_cluster = start_cluster_node(vec![nodes[0].cluster.bound_addr()], &[]).await;
    let all: Vec<&ClusterNode> = nodes
        .iter()
        .map(|n| &n.cluster)
        .chain([&proxy_cluster])
        .collect();
    wait_up(&all, 4).await;
    let proxy = start_system(&proxy_cluster).await;
    proxy.register_proxy::<Seq>().await.expect("proxy");
    (proxy_cluster, proxy)
}

/// The first entity `<prefix>-k` that lives on the node labelled `label`.
async fn entity_living_on(system: &ShardedSystem, prefix: &str, label: &str) -> EntityRef<Seq> {
    for k in 0..200 {
        let entity = system.entity_ref::<Seq>(format!("{prefix}-{k}"));
        if where_retrying(&entity).await == label {
            return entity;
        }
    }
    panic!("no entity of 200 lives on {label}")
}

/// Polls `cond` until it holds; fails the test after `LONG`.
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + LONG;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn hosted(nodes: &[&ShardedSystem]) -> Vec<usize> {
    nodes.iter().map(|s| s.hosted_shards::<Seq>()).collect()
}

fn balanced(counts: &[usize]) -> bool {
    let (min, max) = (counts.iter().min(), counts.iter().max());
    matches!((min, max), (Some(min), Some(max)) if max - min <= 1)
}

#[path = "../protocols/writers.rs"]
mod writers;

/// The writers of `protocols/writers.rs` on `Seq`.
type Writers = writers::Writers<Seq>;

fn writers(system: &ShardedSystem, prefix: &str, writers: usize, per_writer: usize) -> Writers {
    Writers::start(system, prefix, (writers, per_writer), Append, ASK)
}

/// Every entity handled exactly 1..=last, across its moves: nothing lost,
/// nothing twice, in the order its one sender sent it.
fn check_logs(ledger: &Ledger, last: &BTreeMap<String, u64>) {
    let ledger = ledger.lock().unwrap_or_else(|p| p.into_inner());
    for (id, n) in last {
        let expected: Vec<u64> = (1..=*n).collect();
        assert_eq!(ledger.get(id), Some(&expected), "{id}");
    }
}

fn spread_rounds(rounds: &[RebalanceRound]) -> Vec<&RebalanceRound> {
    rounds
        .iter()
        .filter(|r| r.reason == RebalanceReason::GracefulSpread)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fourth_node_joins_under_traffic_and_gets_its_share_in_capped_rounds() {
    let mut nodes = cluster_of(3).await;
    let writers = writers(&nodes[1].system, "join", 8, 8);
    writers.run_for(3).await;
    let systems: Vec<&ShardedSystem> = nodes.iter().map(|n| &n.system).collect();
    let allocated = writers.shards(&nodes[0].system);
    wait_for("every written shard hosted", || {
        hosted(&systems).iter().sum::<usize>() == allocated
    })
    .await;
    drop(systems);

    let fourth = start_cluster_node(vec![nodes[0].cluster.bound_addr()], &[]).await;
    let all: Vec<&ClusterNode> = nodes.iter().map(|n| &n.cluster).chain([&fourth]).collect();
    wait_up(&all, 4).await;
    let ledger = nodes[0].ledger.clone();
    nodes.push(host(fourth, "node-3", &ledger).await);
    let systems: Vec<&ShardedSystem> = nodes.iter().map(|n| &n.system).collect();
    let deadline = Instant::now() + LONG;
    loop {
        let counts = hosted(&systems);
        if counts[3] > 0 && balanced(&counts) && counts.iter().sum::<usize>() == allocated {
            break;
        }
        if Instant::now() >= deadline {
            let states: Vec<_> = systems
                .iter()
                .map(|s| s.shard_region_state::<Seq>())
                .collect();
            panic!(
                "not balanced: {counts:?} of {allocated}; rounds {:?}; states {states:?}",
                nodes[0].system.rebalance_rounds()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("shards per node after the join: {:?}", hosted(&systems));
    writers.run_for(2).await;
    let (last, errors) = writers.finish().await;
    // A graceful move loses nothing and fails nothing: messages wait in the
    // handoff buffers and follow their shard.
    assert!(errors.is_empty(), "errors during rebalance: {errors:?}");
    check_logs(&nodes[0].ledger, &last);

    let rounds = nodes[0].system.rebalance_rounds();
    let spread = spread_rounds(&rounds);
    let cap = sharding_config().rebalance_per_round;
    assert!(spread.len() >= 2, "8 moves at {cap} per round: {rounds:?}");
    for round in &spread {
        assert!(round.moves.len() <= cap, "{round:?}");
        let to_new = round
            .moves
            .iter()
            .all(|m| m.to == nodes[3].cluster.self_address());
        assert!(to_new, "spread moves go to the new node: {round:?}");
    }
    let moved: usize = spread.iter().map(|r| r.moves.len()).sum();
    println!("{} spread rounds moved {moved} shards", spread.len());
    assert!(
        rounds
            .iter()
            .all(|r| r.reason != RebalanceReason::DeadOwner)
    );
    stop(&nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_leave_under_traffic_loses_nothing() {
    let nodes = cluster_of(3).await;
    let writers: Vec<Writers> = (0..2)
        .map(|i| writers(&nodes[i].system, &format!("leave{i}"), 4, 8))
        .collect();
    for w in &writers {
        w.run_for(3).await;
    }
    let before = nodes[2].system.hosted_shards::<Seq>();
    assert!(before > 0);
    // Node 2's system leaves; its cluster node stays.
    nodes[2].system.shutdown().await;
    assert_eq!(nodes[2].system.hosted_shards::<Seq>(), 0);
    for w in &writers {
        w.run_for(2).await;
    }
    let mut errors = Vec::new();
    for w in writers {
        let (last, e) = w.finish().await;
        check_logs(&nodes[0].ledger, &last);
        errors.extend(e);
    }
    // A message that reached node 2 after its regions stopped is refused
    // unprocessed (and retried); nothing else fails.
    for e in &errors {
        assert!(matches!(e, ShardingError::ShuttingDown), "{e:?}");
    }
    println!("{} asks retried after ShuttingDown", errors.len());
    let rounds = nodes[0].system.rebalance_rounds();
    let left: usize = rounds
        .iter()
        .filter(|r| r.reason == RebalanceReason::GracefulLeave)
        .flat_map(|r| &r.moves)
        .filter(|m| m.from == nodes[2].cluster.self_address())
        .count();
    assert_eq!(left, before, "every shard of the leaver was handed off");
    assert!(
        rounds
            .iter()
            .all(|r| r.reason != RebalanceReason::DeadOwner)
    );
    stop(&nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_behind_a_proxy_loses_nothing_and_moves_shards_a_bounded_number_of_times()
{
    let mut nodes = cluster_of(3).await;
    // The client: a proxy-only region on a fourth node, which routes and
    // hosts nothing.
    let (proxy_cluster, proxy) = join_proxy(&nodes).await;
    let writers = writers(&proxy, "rolling", 8, 8);
    writers.run_for(3).await;
    let ledger = nodes[0].ledger.clone();
    let allocated = writers.shards(&proxy);
    let mut rounds: Vec<RebalanceRound> = Vec::new();
    for i in 0..3 {
        // Restart node i: a graceful leave of its system, then of its node.
        let old = nodes.remove(0);
        old.system.shutdown().await;
        rounds.extend(old.system.rebalance_rounds());
        old.cluster.shutdown().await.expect("leaves");
        let fresh = start_cluster_node(vec![proxy_cluster.bound_addr()], &[]).await;
        let all: Vec<&ClusterNode> = nodes
            .iter()
            .map(|n| &n.cluster)
            .chain([&proxy_cluster, &fresh])
            .collect();
        wait_up(&all, 4).await;
        nodes.push(host(fresh, &format!("node-{i}-restarted"), &ledger).await);
        let systems: Vec<&ShardedSystem> = nodes.iter().map(|n| &n.system).collect();
        wait_for("balanced after a restart", || {
            let counts = hosted(&systems);
            balanced(&counts) && counts.iter().sum::<usize>() == allocated
        })
        .await;
        assert_eq!(proxy.hosted_shards::<Seq>(), 0, "the proxy hosts nothing");
        writers.run_for(2).await;
        println!(
            "after restarting node {i}: {:?} on {:?}",
            hosted(&systems),
            nodes.iter().map(|n| n.label.as_str()).collect::<Vec<_>>()
        );
    }
    let (last, errors) = writers.finish().await;
    // Errors first: a duplicate in the logs is explained by the error that
    // made the writer retry.
    for e in &errors {
        assert!(
            matches!(e, ShardingError::ShuttingDown),
            "{e:?} (all: {errors:?})"
        );
    }
    check_logs(&nodes[0].ledger, &last);
    rounds.extend(proxy.rebalance_rounds());
    for n in &nodes {
        rounds.extend(n.system.rebalance_rounds());
    }
    let mut moves: BTreeMap<ShardId, usize> = BTreeMap::new();
    for m in rounds.iter().flat_map(|r| &r.moves) {
        *moves.entry(m.shard).or_insert(0) += 1;
    }
    let most = moves.values().copied().max().unwrap_or(0);
    let total: usize = moves.values().sum();
    println!(
        "rolling restart of 3 nodes: {total} shard moves, at most {most} for one shard, {} retried asks",
        errors.len()
    );
    // Each restart moves a shard at most twice: off the leaving node, and
    // (perhaps) onto the restarted one.
    assert!(most <= 6, "{moves:?}");
    assert!(
        rounds
            .iter()
            .all(|r| r.reason != RebalanceReason::DeadOwner)
    );
    proxy.shutdown().await;
    stop(&nodes).await;
    let _ = proxy_cluster.shutdown().await;
}

/// `ClusterNode::shutdown()` alone is the whole graceful stop: it hands the
/// node's shards off first. Repeated under traffic from a proxy (every
/// ask's first hop is a shard's owner, the leaver included) and from the
/// coordinator's node: no ask fails with `PeerLost`, no message is
/// processed twice, no shard moves as a dead owner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_leaves_by_node_shutdown_alone_fail_no_ask_and_process_nothing_twice() {
    let mut nodes = cluster_of(3).await;
    let (proxy_cluster, proxy) = join_proxy(&nodes).await;
    let from_proxy = writers(&proxy, "bare-p", 6, 8);
    let from_coordinator = writers(&nodes[0].system, "bare-c", 2, 8);
    from_proxy.run_for(2).await;
    let ledger = nodes[0].ledger.clone();
    let mut rounds: Vec<RebalanceRound> = Vec::new();
    for i in 0..2 {
        // The newest hosting node leaves by `node.shutdown()` alone.
        let old = nodes.pop().expect("a node");
        assert!(
            old.system.hosted_shards::<Seq>() > 0,
            "{} hosts shards",
            old.label
        );
        old.cluster.shutdown().await.expect("leaves");
        assert_eq!(old.system.hosted_shards::<Seq>(), 0, "handed off first");
        rounds.extend(old.system.rebalance_rounds());
        from_proxy.run_for(2).await;
        let fresh = start_cluster_node(vec![proxy_cluster.bound_addr()], &[]).await;
        let all: Vec<&ClusterNode> = nodes
            .iter()
            .map(|n| &n.cluster)
            .chain([&proxy_cluster, &fresh])
            .collect();
        wait_up(&all, 4).await;
        nodes.push(host(fresh, &format!("node-{i}-fresh"), &ledger).await);
        let systems: Vec<&ShardedSystem> = nodes.iter().map(|n| &n.system).collect();
        wait_for("the fresh node hosts shards", || hosted(&systems)[2] > 0).await;
        from_proxy.run_for(2).await;
    }
    let mut errors = Vec::new();
    for writers in [from_proxy, from_coordinator] {
        let (last, e) = writers.finish().await;
        errors.extend(e);
        check_logs(&ledger, &last);
    }
    println!("{} asks retried: {errors:?}", errors.len());
    assert!(
        !errors.iter().any(|e| matches!(
            e,
            ShardingError::PeerLost { .. } | ShardingError::AskTimeout { .. }
        )),
        "{errors:?}"
    );
    rounds.extend(proxy.rebalance_rounds());
    for n in &nodes {
        rounds.extend(n.system.rebalance_rounds());
    }
    assert!(
        rounds
            .iter()
            .all(|r| r.reason != RebalanceReason::DeadOwner),
        "{rounds:?}"
    );
    proxy.shutdown().await;
    stop(&nodes).await;
    let _ = proxy_cluster.shutdown().await;
}

/// An ask whose first hop is a leaving node, buffered in its handoff and
/// sent on to the shard's next home, is answered from there even when the
/// leaver is removed from the cluster before that answer comes: the asker
/// does not fail it with `PeerLost` (its caller's retry would process it
/// twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_handed_on_by_a_leaver_is_answered_after_the_leaver_is_gone() {
    let nodes = cluster_of(3).await;
    let (proxy_cluster, proxy) = join_proxy(&nodes).await;
    let entity = entity_living_on(&proxy, "handed-on", "node-2").await;
    let long = Duration::from_secs(20);
    // The entity is busy, so its shard's handoff waits for it...
    let busy = {
        let entity = entity.clone();
        tokio::spawn(async move { entity.ask(Slow(1_500), long).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let leaver = nodes[2].cluster.clone();
    let leave = tokio::spawn(async move { leaver.shutdown().await });
    wait_for("the handoff under way", || {
        nodes[2]
            .system
            .shard_region_state::<Seq>()
            .is_some_and(|s| !s.handing_off.is_empty())
    })
    .await;
    // ...and this ask waits in the leaver's handoff buffer, then follows the
    // shard; its handling outlasts the leaver's removal.
    let handed_on = {
        let entity = entity.clone();
        tokio::spawn(async move { entity.ask(Slow(3_000), long).await })
    };
    let proxy_node = proxy_cluster.clone();
    let gone = nodes[2].cluster.self_address();
    leave.await.expect("leave task").expect("leaves");
    proxy_node
        .wait_until(
            |s| {
                s.status_of(&gone)
                    .is_none_or(|st| st == MemberStatus::Removed)
            },
            LONG,
        )
        .await
        .expect("the proxy sees the leaver gone");
    // (The ask must still be in handling when the leaver is gone, or this
    // test would not test what it says.)
    assert!(
        !handed_on.is_finished(),
        "answered before the leaver was gone"
    );
    assert_eq!(busy.await.expect("task"), Ok(()));
    assert_eq!(
        handed_on.await.expect("task"),
        Ok(()),
        "the handed-on ask is answered"
    );
    assert_ne!(where_retrying(&entity).await, "node-2");
    proxy.shutdown().await;
    stop(&nodes[..2]).await;
    let _ = proxy_cluster.shutdown().await;
}

/// A `node.shutdown()` whose caller gives up (a timeout) while the shards
/// are being handed off does not cut the graceful stop short: it goes on to
/// the end on its own task, and a later call waits for it and leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_whose_caller_gives_up_goes_on_to_the_end() {
    let nodes = cluster_of(3).await;
    let entity = entity_living_on(&nodes[0].system, "stop", "node-2").await;
    // A busy entity holds its shard's handoff for a while.
    let busy = tokio::spawn(async move { entity.ask(Slow(1_000), LONG).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let gave_up =
        tokio::time::timeout(Duration::from_millis(200), nodes[2].cluster.shutdown()).await;
    assert!(gave_up.is_err(), "the stop outlasts the caller's patience");
    // Nobody waits on it now, yet the system's stop completes.
    wait_for("the system stopped", || nodes[2].system.is_shut_down()).await;
    wait_for("its shards handed off", || {
        nodes[2].system.hosted_shards::<Seq>() == 0
    })
    .await;
    assert_eq!(busy.await.expect("task"), Ok(()));
    nodes[2].cluster.shutdown().await.expect("leaves");
    let rounds = nodes[0].system.rebalance_rounds();
    assert!(
        rounds
            .iter()
            .all(|r| r.reason != RebalanceReason::DeadOwner),
        "{rounds:?}"
    );
    stop(&nodes[..2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_restricted_type_is_hosted_only_on_members_with_the_role() {
    let first = start_cluster_node(vec![], &["backend"]).await;
    let seeds = vec![first.bound_addr()];
    let clusters = vec![
        first,
        start_cluster_node(seeds.clone(), &["frontend"]).await,
        start_cluster_node(seeds, &["backend", "frontend"]).await,
    ];
    wait_up(&clusters.iter().collect::<Vec<_>>(), 3).await;
    let mut systems = Vec::new();
    let ledger = Ledger::default();
    for (i, cluster) in clusters.iter().enumerate() {
        let system = start_system(cluster).await;
        system
            .entity_type::<SeqEntity>()
            .on_role("backend")
            .register(factory(&format!("node-{i}"), &ledger))
            .await
            .expect("registered");
        systems.push(system);
    }
    let mut homes = BTreeSet::new();
    for k in 0..64 {
        let home = systems[1]
            .entity_ref::<Seq>(format!("role-{k}"))
            .ask(Where, ASK)
            .await
            .expect("answered through the proxy");
        homes.insert(home);
    }
    assert_eq!(
        homes,
        BTreeSet::from(["node-0".to_owned(), "node-2".to_owned()])
    );
    assert_eq!(systems[1].hosted_shards::<Seq>(), 0);
    // The same seen through the stats: the cluster-wide view from the
    // proxy, and each region's own state.
    let stats = systems[1]
        .cluster_sharding_stats::<Seq>(ASK)
        .await
        .expect("stats");
    assert!(stats.failed.is_empty(), "{stats:?}");
    assert_eq!(stats.regions.len(), 3);
    assert_eq!(stats.entities(), 64);
    let per_member = stats.shards_per_member();
    assert_eq!(per_member[&clusters[1].self_address()], 0);
    let hosting: usize = [0, 2]
        .iter()
        .map(|i| per_member[&clusters[*i].self_address()])
        .sum();
    let states: Vec<_> = systems
        .iter()
        .map(|s| s.shard_region_state::<Seq>().expect("registered"))
        .collect();
    assert!(states[1].proxy && states[1].shards.is_empty());
    assert!(!states[0].proxy && !states[2].proxy);
    assert_eq!(hosting, states[0].shards.len() + states[2].shards.len());
    assert_eq!(
        states.iter().flat_map(|s| s.shards.values()).sum::<usize>(),
        64
    );
    for s in &systems {
        s.shutdown().await;
    }
    for c in &clusters {
        let _ = c.shutdown().await;
    }
}

/// Entities that live on the survivors keep their state (their log) across
/// the loss of the coordinator: the new one kept their homes.
async fn takeover_keeps_the_survivors_homes(kill: bool) {
    let nodes = cluster_of(3).await;
    let ids: Vec<String> = (0..48).map(|k| format!("takeover-{k}")).collect();
    let mut homes = BTreeMap::new();
    for id in &ids {
        let entity = nodes[1].system.entity_ref::<Seq>(id.as_str());
        entity.ask(Append(1), ASK).await.expect("append");
        homes.insert(id.clone(), entity.ask(Where, ASK).await.expect("where"));
    }
    // Node 0 is the oldest member: the coordinator.
    if kill {
        nodes[0].cluster.crash().await;
    } else {
        nodes[0].system.shutdown().await;
        nodes[0].cluster.shutdown().await.expect("leaves");
    }
    for id in &ids {
        let entity = nodes[2].system.entity_ref::<Seq>(id.as_str());
        let home = where_retrying(&entity).await;
        assert_ne!(home, "node-0");
        let log = entity.ask(Entries, ASK).await.expect("entries");
        if homes[id] == "node-0" {
            // Not remembered: a fresh incarnation on its new home.
            assert!(log.is_empty(), "{id}: {log:?}");
        } else {
            assert_eq!(home, homes[id], "{id} moved although its owner lives");
            assert_eq!(log, vec![1], "{id} lost its state");
        }
    }
    // Node 0's shards, and only they, moved: by the next coordinator as
    // dead-owner moves after a kill, by node 0 itself as a graceful leave;
    // each to a generation above the first allocation's.
    let mut rounds = nodes[0].system.rebalance_rounds();
    rounds.extend(nodes[1].system.rebalance_rounds());
    let moved: Vec<_> = rounds.iter().flat_map(|r| &r.moves).collect();
    assert!(!moved.is_empty(), "node 0's shards moved");
    for m in &moved {
        assert_eq!(m.from, nodes[0].cluster.self_address());
        assert!(m.generation >= 2, "{m:?}");
    }
    let reason = if kill {
        RebalanceReason::DeadOwner
    } else {
        RebalanceReason::GracefulLeave
    };
    assert!(rounds.iter().all(|r| r.reason == reason), "{rounds:?}");
    println!(
        "coordinator {}: {} shards moved",
        if kill { "killed" } else { "left" },
        moved.len()
    );
    stop(&nodes[1..]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinators_node_killed_the_next_one_keeps_the_survivors_homes() {
    takeover_keeps_the_survivors_homes(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinators_node_left_the_next_one_keeps_the_survivors_homes() {
    takeover_keeps_the_survivors_homes(false).await;
}

/// Two entity ids of one shard hosted on `node`.
fn two_in_one_shard(
    nodes: &[Node],
    node: usize,
    homes: &BTreeMap<String, String>,
) -> (String, String) {
    let mut by_shard: BTreeMap<ShardId, Vec<String>> = BTreeMap::new();
    for (id, home) in homes {
        if *home == nodes[node].label {
            let shard = nodes[0].system.entity_ref::<Seq>(id.as_str()).shard_id();
            by_shard.entry(shard).or_default().push(id.clone());
        }
    }
    let pair = by_shard
        .values()
        .find(|ids| ids.len() >= 2)
        .expect("two entities share a shard");
    (pair[0].clone(), pair[1].clone())
}

async fn homes_of(
    system: &ShardedSystem,
    ids: impl Iterator<Item = String>,
) -> BTreeMap<String, String> {
    let mut homes = BTreeMap::new();
    for id in ids {
        let home = system
            .entity_ref::<Seq>(id.as_str())
            .ask(Where, ASK)
            .await
            .expect("where");
        homes.insert(id, home);
    }
    homes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_whose_old_owner_is_killed_midway_completes_as_a_dead_owner_move() {
    let nodes = cluster_of(3).await;
    let homes = homes_of(&nodes[0].system, (0..200).map(|k| format!("midway-{k}"))).await;
    let (busy, other) = two_in_one_shard(&nodes, 2, &homes);
    let shard = nodes[0].system.entity_ref::<Seq>(busy.as_str()).shard_id();
    // `busy` is in a long handler: its shard cannot finish a handoff.
    let slow = {
        let entity = nodes[0].system.entity_ref::<Seq>(busy.as_str());
        tokio::spawn(async move { entity.ask(Slow(60_000), Duration::from_secs(90)).await })
    };
    nodes[0]
        .system
        .entity_ref::<Seq>(other.as_str())
        .ask(Append(1), ASK)
        .await
        .expect("append");
    // The slow handler runs before the leave begins (the spawned ask may
    // be sent after the append).
    let began = format!("{busy}#slow");
    wait_for("the slow handler to begin", || {
        nodes[0]
            .ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&began)
    })
    .await;
    let leaver = nodes[2].system.clone();
    let leave = tokio::spawn(async move { leaver.shutdown().await });
    // Every other shard of node 2 is handed off; the busy one stays (within
    // the handoff timeout, 10 s, after which the leave goes on without it).
    let deadline = Instant::now() + LONG;
    while nodes[2].system.hosted_shards::<Seq>() != 1 {
        // (On a timeout, say where node 2 stands, for the diagnosis.)
        assert!(
            Instant::now() < deadline,
            "timed out waiting for node 2 down to its busy shard {shard}: {:?}; coordinator {:?}",
            nodes[2].system.shard_region_state::<Seq>(),
            nodes[2].system.sharding_coordinator(),
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state = nodes[2].system.shard_region_state::<Seq>().expect("state");
    assert_eq!(state.handing_off, BTreeSet::from([shard]), "{state:?}");
    nodes[2].cluster.crash().await;
    // Messages for the shard are answered from a survivor again.
    let entity = nodes[1].system.entity_ref::<Seq>(other.as_str());
    let home = where_retrying(&entity).await;
    assert_ne!(home, "node-2");
    let slow = slow.await.expect("task");
    assert!(
        matches!(slow, Err(ShardingError::PeerLost { .. })),
        "{slow:?}"
    );
    let rounds = nodes[0].system.rebalance_rounds();
    let dead: Vec<_> = rounds
        .iter()
        .filter(|r| r.reason == RebalanceReason::DeadOwner)
        .flat_map(|r| &r.moves)
        .collect();
    assert!(dead.iter().any(|m| m.shard == shard), "{rounds:?}");
    leave.abort();
    stop(&nodes[..2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passivation_while_a_shard_moves_applies_to_what_waits_for_the_new_home() {
    let nodes = cluster_of(3).await;
    let homes = homes_of(&nodes[0].system, (0..200).map(|k| format!("pass-{k}"))).await;
    let (busy, other) = two_in_one_shard(&nodes, 2, &homes);
    let slow = {
        let entity = nodes[0].system.entity_ref::<Seq>(busy.as_str());
        tokio::spawn(async move { entity.ask(Slow(3_000), LONG).await })
    };
    let entity = nodes[0].system.entity_ref::<Seq>(other.as_str());
    entity.ask(Append(1), ASK).await.expect("append");
    let shard = entity.shard_id();
    // The busy handler has begun (the spawned ask may be sent after the
    // append: wait for the handler itself).
    let began = format!("{busy}#slow");
    wait_for("the slow handler to begin", || {
        nodes[0]
            .ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&began)
    })
    .await;
    let leaver = nodes[2].system.clone();
    let leave = tokio::spawn(async move { leaver.shutdown().await });
    wait_for("node 2 down to its busy shard", || {
        nodes[2]
            .system
            .shard_region_state::<Seq>()
            .is_some_and(|s| s.shards.len() == 1 && s.handing_off.contains(&shard))
    })
    .await;
    // The shard is moving: `other` has stopped, its next message waits in
    // the handoff buffer, and a passivation request waits behind it.
    // (`join` polls the ask first: its message is buffered before the
    // passivation request.)
    let sent = Instant::now();
    let (append, passivated) = tokio::join!(entity.ask(Append(2), LONG), entity.passivate());
    passivated.expect("passivation accepted while moving");
    assert_eq!(append.expect("append answered"), 1);
    let after = entity.ask(Entries, ASK).await.expect("entries");
    // A fresh incarnation on the new home took the buffered message (the
    // entity is not remembered, so its log starts again), after the busy
    // handler finished.
    assert_eq!(
        after,
        Vec::<u64>::new(),
        "passivated after its buffered message"
    );
    assert!(sent.elapsed() < LONG);
    slow.await
        .expect("task")
        .expect("the busy handler finished");
    leave.await.expect("leave");
    let home = entity.ask(Where, ASK).await.expect("where");
    assert_ne!(home, "node-2");
    stop(&nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_entities_are_respawned_on_the_new_homes_after_a_graceful_leave() {
    // One store shared by the three systems (as a shared database would be).
    let store = InMemoryStore::new();
    let first = start_cluster_node(vec![], &[]).await;
    let seeds = vec![first.bound_addr()];
    let clusters = [
        first,
        start_cluster_node(seeds.clone(), &[]).await,
        start_cluster_node(seeds, &[]).await,
    ];
    wait_up(&clusters.iter().collect::<Vec<_>>(), 3).await;
    let ledger = Ledger::default();
    let mut systems = Vec::new();
    for (i, cluster) in clusters.iter().enumerate() {
        let system = ShardedSystem::builder()
            .config(sharding_config())
            .store(store.clone())
            .node(cluster.clone())
            .start()
            .await
            .expect("system");
        system
            .entity_type::<SeqEntity>()
            .remembered()
            .register(factory(&format!("node-{i}"), &ledger))
            .await
            .expect("registered");
        systems.push(system);
    }
    let ids: Vec<String> = (0..60).map(|k| format!("remembered-{k}")).collect();
    let mut on_leaver = 0;
    for id in &ids {
        let entity = systems[0].entity_ref::<Seq>(id.as_str());
        entity.ask(Append(1), ASK).await.expect("append");
        if entity.ask(Where, ASK).await.expect("where") == "node-2" {
            on_leaver += 1;
        }
    }
    assert!(on_leaver > 0);
    let live = |systems: &[ShardedSystem<InMemoryStore>]| -> usize {
        systems
            .iter()
            .filter_map(|s| s.shard_region_state::<Seq>())
            .flat_map(|state| state.shards.into_values())
            .sum()
    };
    assert_eq!(live(&systems), ids.len());
    systems[2].shutdown().await;
    // With no message sent to them, the leaver's entities come back on the
    // nodes that took its shards: the handoff kept them in the store.
    wait_for("every remembered entity live on the survivors", || {
        live(&systems[..2]) == ids.len()
    })
    .await;
    for id in &ids {
        let home = systems[1]
            .entity_ref::<Seq>(id.as_str())
            .ask(Where, ASK)
            .await
            .expect("where");
        assert_ne!(home, "node-2");
    }
    println!("{on_leaver} remembered entities moved with their shards and respawned");
    // A new node joins: rebalance rounds move shards to it, and their
    // remembered entities respawn there, again with no message sent.
    let newcomer = start_cluster_node(vec![clusters[0].bound_addr()], &[]).await;
    let all: Vec<&ClusterNode> = clusters.iter().chain([&newcomer]).collect();
    wait_up(&all, 4).await;
    let system = ShardedSystem::builder()
        .config(sharding_config())
        .store(store.clone())
        .node(newcomer.clone())
        .start()
        .await
        .expect("system");
    system
        .entity_type::<SeqEntity>()
        .remembered()
        .register(factory("node-3", &ledger))
        .await
        .expect("registered");
    systems.swap_remove(2);
    systems.push(system);
    wait_for(
        "remembered entities live on the newcomer, none lost",
        || {
            let on_new = systems[2]
                .shard_region_state::<Seq>()
                .map_or(0, |s| s.shards.into_values().sum::<usize>());
            on_new > 0 && live(&systems) == ids.len()
        },
    )
    .await;
    let rounds = systems[0].rebalance_rounds();
    assert!(
        rounds
            .iter()
            .any(|r| r.reason == RebalanceReason::GracefulSpread),
        "{rounds:?}"
    );
    for s in &systems {
        s.shutdown().await;
    }
    for c in clusters.iter().chain([&newcomer]) {
        let _ = c.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_downed_by_the_others_stops_its_entities() {
    let nodes = cluster_of(3).await;
    let homes = homes_of(&nodes[0].system, (0..60).map(|k| format!("fenced-{k}"))).await;
    let on_2: Vec<&String> = homes
        .iter()
        .filter(|(_, h)| *h == "node-2")
        .map(|(id, _)| id)
        .collect();
    assert!(!on_2.is_empty());
    // Node 0 downs node 2 while node 2 runs (as the winning side of a
    // split-brain decision would): node 2 hears it and fences itself.
    nodes[0]
        .cluster
        .down(nodes[2].cluster.self_address())
        .await
        .expect("down");
    wait_for("node 2's regions stopped", || {
        nodes[2]
            .system
            .shard_region_state::<Seq>()
            .is_some_and(|s| s.shards.is_empty())
    })
    .await;
    let refused = nodes[2]
        .system
        .entity_ref::<Seq>(on_2[0].as_str())
        .ask(Where, ASK)
        .await;
    assert!(
        matches!(refused, Err(ShardingError::ShuttingDown)),
        "{refused:?}"
    );
    // The others serve its entities.
    for id in on_2 {
        let home = where_retrying(&nodes[1].system.entity_ref::<Seq>(id.as_str())).await;
        assert_ne!(home, "node-2");
    }
    stop(&nodes[..2]).await;
    nodes[2].system.shutdown().await;
}
