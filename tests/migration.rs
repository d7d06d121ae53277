//! Live migration (SPEC §13.16): a migratable entity keeps its in-memory
//! state when its shard moves gracefully — a rebalance after a join, a
//! graceful leave, rolling restarts — and starts from its factory, with an
//! event saying why, when the old owner dies before the state came. Real
//! clusters on 127.0.0.1 ports, in one process.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::sharding::RebalanceReason;
use datum_cluster_sharding::{MigrationEvent, ShardId};
use tokio::sync::broadcast::Receiver;

const LONG: Duration = Duration::from_secs(30);
const ASK: Duration = Duration::from_secs(10);
const SHARDS: u32 = 24;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Append(pub u64);
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entries;
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Where;

protocol! {
    /// An entity that keeps, in memory only, the sequence it is sent.
    pub protocol Tally = "tally-migrating" {
        ask Append -> u64;
        ask Entries -> Vec<u64>;
        ask Where -> String;
    }
}

/// What every entity handled, in order, kept outside the entities (shared
/// by the nodes of one process, as a database would be): the truth an
/// entity's own memory is checked against.
type Ledger = Arc<Mutex<BTreeMap<String, Vec<u64>>>>;

struct TallyEntity {
    node: String,
    id: String,
    /// The whole state: it survives a move only by migration.
    log: Vec<u64>,
    ledger: Ledger,
}

impl Entity for TallyEntity {
    type Protocol = Tally;
}
impl Handler<Append> for TallyEntity {
    async fn handle(&mut self, msg: Append, _: &EntityContext) -> ShardingResult<u64> {
        self.log.push(msg.0);
        let mut ledger = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        ledger.entry(self.id.clone()).or_default().push(msg.0);
        Ok(self.log.len() as u64)
    }
}
impl Handler<Entries> for TallyEntity {
    async fn handle(&mut self, _: Entries, _: &EntityContext) -> ShardingResult<Vec<u64>> {
        Ok(self.log.clone())
    }
}
impl Handler<Where> for TallyEntity {
    async fn handle(&mut self, _: Where, _: &EntityContext) -> ShardingResult<String> {
        Ok(self.node.clone())
    }
}
impl Migratable for TallyEntity {
    type Dehydrated = Vec<u64>;
    fn dehydrate(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.log)
    }
    fn rehydrate(&mut self, log: Vec<u64>) {
        self.log = log;
    }
}

struct Node {
    cluster: ClusterNode,
    system: ShardedSystem,
    events: Receiver<MigrationEvent>,
}

async fn start_cluster_node(seeds: Vec<SocketAddr>) -> ClusterNode {
    let config = ClusterConfig::builder()
        .cluster_name("migration-test")
        .secret("migration-secret")
        .seed_nodes(seeds)
        .build();
    ClusterNode::start(config).await.expect("node starts")
}

async fn host(cluster: ClusterNode, label: &str, ledger: &Ledger) -> Node {
    let config = ShardingConfig::builder()
        .num_shards(SHARDS)
        .passivation_idle_timeout(None)
        .rebalance_interval(Duration::from_millis(300))
        .build();
    let system = ShardedSystem::builder()
        .config(config)
        .node(cluster.clone())
        .start()
        .await
        .expect("system starts");
    let events = system.subscribe_migration_events();
    let (node, ledger) = (label.to_owned(), ledger.clone());
    system
        .entity_type::<TallyEntity>()
        .migratable()
        .register(move |ctx| TallyEntity {
            node: node.clone(),
            id: ctx.entity_id().to_owned(),
            log: Vec::new(),
            ledger: ledger.clone(),
        })
        .await
        .expect("registered");
    Node {
        cluster,
        system,
        events,
    }
}

async fn wait_up(clusters: &[&ClusterNode], n: usize) {
    for c in clusters {
        c.wait_until(|s| s.up_members().count() == n, LONG)
            .await
            .expect("members Up");
    }
}

/// `n` hosting nodes, all Up, sharing `ledger`.
async fn cluster_of(n: usize, ledger: &Ledger) -> Vec<Node> {
    let clusters = clusters_of(n).await;
    let mut nodes = Vec::new();
    for (i, cluster) in clusters.into_iter().enumerate() {
        nodes.push(host(cluster, &format!("node-{i}"), ledger).await);
    }
    nodes
}

/// `n` cluster nodes on 127.0.0.1, all Up.
async fn clusters_of(n: usize) -> Vec<ClusterNode> {
    let first = start_cluster_node(vec![]).await;
    let mut clusters = vec![first.clone()];
    for _ in 1..n {
        clusters.push(start_cluster_node(vec![first.bound_addr()]).await);
    }
    wait_up(&clusters.iter().collect::<Vec<_>>(), n).await;
    clusters
}

/// A system builder on `cluster`: `SHARDS` shards, no idle passivation.
fn builder_on(cluster: &ClusterNode) -> datum_cluster_sharding::ShardedSystemBuilder {
    let config = ShardingConfig::builder()
        .num_shards(SHARDS)
        .passivation_idle_timeout(None)
        .build();
    ShardedSystem::builder()
        .config(config)
        .node(cluster.clone())
}

async fn stop(nodes: &[Node]) {
    for n in nodes {
        n.system.shutdown().await;
    }
    for n in nodes {
        let _ = n.cluster.shutdown().await;
    }
}

/// Polls `cond` until it holds; fails the test after `LONG`.
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + LONG;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn hosted(nodes: &[Node]) -> Vec<usize> {
    nodes
        .iter()
        .map(|n| n.system.hosted_shards::<Tally>())
        .collect()
}

fn balanced(counts: &[usize]) -> bool {
    let (min, max) = (counts.iter().min(), counts.iter().max());
    matches!((min, max), (Some(min), Some(max)) if max - min <= 1)
}

#[path = "../protocols/writers.rs"]
mod writers;

/// The writers of `protocols/writers.rs` on `Tally`.
type Writers = writers::Writers<Tally>;

fn writers(system: &ShardedSystem, prefix: &str, writers: usize, per_writer: usize) -> Writers {
    Writers::start(system, prefix, (writers, per_writer), Append, ASK)
}

/// Every entity handled exactly 1..=last (the ledger), and its own memory
/// holds all of it: its state came along on every move.
async fn check_memories(system: &ShardedSystem, ledger: &Ledger, last: &BTreeMap<String, u64>) {
    for (id, n) in last {
        let expected: Vec<u64> = (1..=*n).collect();
        let handled = ledger
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned();
        assert_eq!(handled, Some(expected.clone()), "{id}: handled");
        let remembered = system
            .entity_ref::<Tally>(id.as_str())
            .ask(Entries, ASK)
            .await
            .expect("entries");
        if remembered != expected {
            let first_off = remembered
                .iter()
                .zip(&expected)
                .position(|(a, b)| a != b)
                .unwrap_or(remembered.len().min(expected.len()));
            panic!(
                "{id} (shard {}): its state after the moves holds {} of {} entries, first off at {first_off}: {:?}",
                system.entity_ref::<Tally>(id.as_str()).shard_id(),
                remembered.len(),
                expected.len(),
                &remembered[first_off.saturating_sub(2)..(first_off + 3).min(remembered.len())]
            );
        }
    }
}

/// The migration events waiting on `events`: (states received, fallbacks).
fn drain(events: &mut Receiver<MigrationEvent>) -> (usize, Vec<MigrationEvent>) {
    let (mut received, mut others) = (0, Vec::new());
    while let Ok(event) = events.try_recv() {
        match event {
            MigrationEvent::Received { entities, .. } => received += entities,
            other => others.push(other),
        }
    }
    (received, others)
}

/// Every error a writer retried is a refusal of an unprocessed message by
/// a region that was stopping (SPEC §13.12).
fn only_shutting_down(errors: &[ShardingError]) {
    for e in errors {
        assert!(
            matches!(e, ShardingError::ShuttingDown),
            "{e:?} (all: {errors:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entities_keep_their_state_through_a_rebalance_after_a_join() {
    let ledger = Ledger::default();
    let mut nodes = cluster_of(3, &ledger).await;
    let writers = writers(&nodes[1].system, "join", 6, 8);
    writers.run_for(3).await;
    let allocated = writers.shards(&nodes[0].system);
    wait_for("every written shard hosted", || {
        hosted(&nodes).iter().sum::<usize>() == allocated
    })
    .await;
    let fourth = start_cluster_node(vec![nodes[0].cluster.bound_addr()]).await;
    let all: Vec<&ClusterNode> = nodes.iter().map(|n| &n.cluster).chain([&fourth]).collect();
    wait_up(&all, 4).await;
    nodes.push(host(fourth, "node-3", &ledger).await);
    wait_for("balanced with the fourth node", || {
        let counts = hosted(&nodes);
        counts[3] > 0 && balanced(&counts) && counts.iter().sum::<usize>() == allocated
    })
    .await;
    writers.run_for(2).await;
    let (last, errors) = writers.finish().await;
    assert!(errors.is_empty(), "errors during rebalance: {errors:?}");
    check_memories(&nodes[0].system, &ledger, &last).await;
    let moved: usize = nodes[0]
        .system
        .rebalance_rounds()
        .iter()
        .filter(|r| r.reason == RebalanceReason::GracefulSpread)
        .map(|r| r.moves.len())
        .sum();
    assert!(moved > 0, "shards moved to the fourth node");
    let (received, others) = drain(&mut nodes[3].events);
    assert!(received > 0, "the fourth node received states");
    assert!(others.is_empty(), "no fallback: {others:?}");
    println!("{moved} shards moved with {received} entity states");
    stop(&nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entities_keep_their_state_through_a_graceful_leave() {
    let ledger = Ledger::default();
    let mut nodes = cluster_of(3, &ledger).await;
    let writers: Vec<Writers> = (0..2)
        .map(|i| writers(&nodes[i].system, &format!("leave{i}"), 4, 8))
        .collect();
    for w in &writers {
        w.run_for(3).await;
    }
    let before = nodes[2]
        .system
        .shard_region_state::<Tally>()
        .expect("state");
    let live_before: usize = before.shards.values().sum();
    assert!(live_before > 0, "node 2 hosts live entities");
    // Node 2 leaves gracefully: its system first, then its node.
    let leaver = nodes.remove(2);
    leaver.cluster.shutdown().await.expect("leaves");
    for w in &writers {
        w.run_for(2).await;
    }
    for w in writers {
        let (last, errors) = w.finish().await;
        only_shutting_down(&errors);
        check_memories(&nodes[0].system, &ledger, &last).await;
    }
    let mut received = 0;
    for n in &mut nodes {
        let (got, others) = drain(&mut n.events);
        assert!(others.is_empty(), "no fallback: {others:?}");
        received += got;
    }
    // (A later spread round may move more.)
    assert!(
        received >= live_before,
        "every live entity's state moved: {received} of {live_before}"
    );
    stop(&nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entities_keep_their_state_through_ten_rolling_restarts() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_default())
        .try_init();
    let ledger = Ledger::default();
    let mut nodes = cluster_of(3, &ledger).await;
    // The writers run on node 0, which stays (it coordinates); the oldest
    // of the others restarts each time: a graceful leave, and a new
    // incarnation joins.
    let writers = writers(&nodes[0].system, "rolling", 4, 6);
    writers.run_for(2).await;
    let allocated = writers.shards(&nodes[0].system);
    let mut others = Vec::new();
    for i in 0..10 {
        let mut old = nodes.remove(1);
        old.cluster.shutdown().await.expect("leaves");
        others.extend(drain(&mut old.events).1);
        let fresh = start_cluster_node(vec![nodes[0].cluster.bound_addr()]).await;
        let all: Vec<&ClusterNode> = nodes.iter().map(|n| &n.cluster).chain([&fresh]).collect();
        wait_up(&all, 3).await;
        nodes.push(host(fresh, &format!("restart-{i}"), &ledger).await);
        wait_for("balanced after a restart", || {
            let counts = hosted(&nodes);
            balanced(&counts) && counts.iter().sum::<usize>() == allocated
        })
        .await;
        writers.run_for(1).await;
    }
    let (last, errors) = writers.finish().await;
    only_shutting_down(&errors);
    for n in &mut nodes {
        others.extend(drain(&mut n.events).1);
    }
    assert!(others.is_empty(), "no fallback: {others:?}");
    check_memories(&nodes[0].system, &ledger, &last).await;
    println!(
        "10 rolling restarts: {} asks retried after ShuttingDown",
        errors.len()
    );
    stop(&nodes).await;
}

/// The shard of the first entity `<prefix>-k` that lives on `label`, with
/// that entity.
async fn entity_on(system: &ShardedSystem, prefix: &str, label: &str) -> (String, ShardId) {
    for k in 0..200 {
        let id = format!("{prefix}-{k}");
        let entity = system.entity_ref::<Tally>(id.as_str());
        if entity.ask(Where, ASK).await.expect("where") == label {
            return (id, entity.shard_id());
        }
    }
    panic!("no entity of 200 lives on {label}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_old_owner_dies_before_its_states_came_starts_from_the_factory() {
    let ledger = Ledger::default();
    let mut nodes = cluster_of(3, &ledger).await;
    let (id, shard) = entity_on(&nodes[0].system, "doomed", "node-2").await;
    let entity = nodes[0].system.entity_ref::<Tally>(id.as_str());
    assert_eq!(entity.ask(Append(1), ASK).await.expect("append"), 1);
    // Node 2 leaves; as soon as it hosts nothing more (its states wait for
    // the new owners) it crashes, before or while they are fetched.
    let leaver = nodes.remove(2);
    let system = leaver.system.clone();
    let leave = tokio::spawn(async move { system.shutdown().await });
    wait_for("node 2 handed its shards off", || {
        leaver.system.hosted_shards::<Tally>() == 0
    })
    .await;
    leaver.cluster.crash().await;
    leave.abort();
    // The entity answers from a survivor either way: with its state if it
    // came in time, from the factory if not; never with a gap or twice.
    let deadline = Instant::now() + LONG;
    let log = loop {
        match entity.ask(Entries, ASK).await {
            Ok(log) => break log,
            Err(error) => assert!(Instant::now() < deadline, "{error}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(log == vec![1] || log.is_empty(), "{log:?}");
    let count = entity.ask(Append(2), ASK).await.expect("append");
    assert_eq!(count, log.len() as u64 + 1);
    // The new owner says which it was.
    let mut said = Vec::new();
    let deadline = Instant::now() + LONG;
    while said.is_empty() {
        assert!(Instant::now() < deadline, "no migration event for {shard}");
        for n in &mut nodes {
            while let Ok(event) = n.events.try_recv() {
                match &event {
                    MigrationEvent::Received { shard: s, .. }
                    | MigrationEvent::FellBack { shard: s, .. }
                        if *s == shard =>
                    {
                        said.push(event)
                    }
                    _ => {}
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match &said[0] {
        MigrationEvent::Received { entities, .. } => assert_eq!(log, vec![1], "{entities}"),
        MigrationEvent::FellBack { reason, .. } => {
            assert!(log.is_empty(), "fell back ({reason}) yet kept {log:?}")
        }
        other => panic!("{other:?}"),
    }
    println!("the shard's migration after the crash: {said:?}");
    stop(&nodes).await;
}

/// The same protocol as `TallyEntity`, from a newer build: its states are
/// version 2.
struct TallyV2(TallyEntity);

impl Entity for TallyV2 {
    type Protocol = Tally;
}
impl Handler<Append> for TallyV2 {
    async fn handle(&mut self, msg: Append, ctx: &EntityContext) -> ShardingResult<u64> {
        self.0.handle(msg, ctx).await
    }
}
impl Handler<Entries> for TallyV2 {
    async fn handle(&mut self, msg: Entries, ctx: &EntityContext) -> ShardingResult<Vec<u64>> {
        self.0.handle(msg, ctx).await
    }
}
impl Handler<Where> for TallyV2 {
    async fn handle(&mut self, msg: Where, ctx: &EntityContext) -> ShardingResult<String> {
        self.0.handle(msg, ctx).await
    }
}
impl Migratable for TallyV2 {
    type Dehydrated = Vec<u64>;
    const STATE_VERSION: u32 = 2;
    fn dehydrate(&mut self) -> Vec<u64> {
        self.0.dehydrate()
    }
    fn rehydrate(&mut self, log: Vec<u64>) {
        self.0.rehydrate(log)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_of_a_newer_version_is_refused_and_its_entity_starts_from_the_factory() {
    let ledger = Ledger::default();
    // Node 0 runs the older build, node 1 the newer one.
    let mut nodes = cluster_of(1, &ledger).await;
    let newer = start_cluster_node(vec![nodes[0].cluster.bound_addr()]).await;
    wait_up(&[&nodes[0].cluster, &newer], 2).await;
    let system = builder_on(&newer).start().await.expect("system starts");
    let ledger2 = ledger.clone();
    system
        .entity_type::<TallyV2>()
        .migratable()
        .register(move |ctx| {
            TallyV2(TallyEntity {
                node: "newer".into(),
                id: ctx.entity_id().to_owned(),
                log: Vec::new(),
                ledger: ledger2.clone(),
            })
        })
        .await
        .expect("registered");
    let (id, _) = entity_on(&nodes[0].system, "newer", "newer").await;
    let entity = nodes[0].system.entity_ref::<Tally>(id.as_str());
    assert_eq!(entity.ask(Append(1), ASK).await.expect("append"), 1);
    // The newer node leaves: its state (version 2) reaches the older build.
    system.shutdown().await;
    let deadline = Instant::now() + LONG;
    let refused = loop {
        assert!(Instant::now() < deadline, "no StateRefused event");
        match nodes[0].events.try_recv() {
            Ok(event @ MigrationEvent::StateRefused { .. }) => break event,
            Ok(_) => {}
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let MigrationEvent::StateRefused {
        entity_id, reason, ..
    } = &refused
    else {
        unreachable!()
    };
    assert_eq!(entity_id, &id);
    assert!(reason.contains("version 2"), "{reason}");
    // It answers, from the factory, on the older node; nothing else broke.
    assert_eq!(
        entity.ask(Entries, ASK).await.expect("entries"),
        Vec::<u64>::new()
    );
    assert_eq!(entity.ask(Where, ASK).await.expect("where"), "node-0");
    let _ = newer.shutdown().await;
    stop(&std::mem::take(&mut nodes)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_channel_refuses_garbage_and_a_pull_for_states_it_does_not_keep() {
    let ledger = Ledger::default();
    let nodes = cluster_of(2, &ledger).await;
    let to = nodes[0].cluster.self_address();
    let transport = nodes[1].cluster.transport();
    let channel = datum_cluster_sharding::wire::channels::SHARDING_MIGRATION;
    // Garbage: refused with a failure, the pipe goes on.
    let garbage = transport
        .request(&to, channel, bytes::Bytes::from_static(&[0xff, 0x00]), ASK)
        .await;
    assert!(
        matches!(
            garbage,
            Err(datum_cluster_sharding::transport::RequestError::Remote(
                datum_cluster_sharding::wire::RemoteFailure::Failed(_)
            ))
        ),
        "{garbage:?}"
    );
    // A well-formed pull (SPEC §13.16) for states node 0 does not keep for
    // node 1: `Nothing`, with a reason.
    let pull = ciborium::Value::Map(vec![(
        "Pull".into(),
        ciborium::Value::Map(vec![
            ("type_name".into(), "tally-migrating".into()),
            ("shard".into(), 3.into()),
            ("generation".into(), 7.into()),
            ("chunk".into(), 0.into()),
        ]),
    )]);
    let mut bytes = Vec::new();
    ciborium::into_writer(&pull, &mut bytes).expect("encodes");
    let answer = transport
        .request(&to, channel, bytes.into(), ASK)
        .await
        .expect("answered");
    let answer: ciborium::Value = ciborium::from_reader(&answer[..]).expect("CBOR");
    let nothing = answer
        .as_map()
        .and_then(|m| m.first())
        .and_then(|(k, _)| k.as_text());
    assert_eq!(nothing, Some("Nothing"), "{answer:?}");
    // The cluster still serves.
    let entity = nodes[1].system.entity_ref::<Tally>("after-garbage");
    assert_eq!(entity.ask(Append(1), ASK).await.expect("append"), 1);
    stop(&nodes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_owner_killed_while_it_pulls_leaves_its_entities_to_start_from_the_factory() {
    let ledger = Ledger::default();
    let mut nodes = cluster_of(4, &ledger).await;
    // Entities on node 3, each with [1, 2] in memory.
    let mut ids = Vec::new();
    for k in 0..400 {
        let id = format!("target-{k}");
        let entity = nodes[0].system.entity_ref::<Tally>(id.as_str());
        if entity.ask(Where, ASK).await.expect("where") == "node-3" {
            entity.ask(Append(1), ASK).await.expect("append");
            entity.ask(Append(2), ASK).await.expect("append");
            ids.push(id);
        }
    }
    assert!(ids.len() > 10, "{} entities on node 3", ids.len());
    // Node 3 leaves; as soon as its first shard has moved on (new owners
    // are pulling), node 2 — one of them — is killed.
    let before = nodes[3].system.hosted_shards::<Tally>();
    let leaver = nodes.remove(3);
    let system = leaver.system.clone();
    let leave = tokio::spawn(async move { system.shutdown().await });
    wait_for("node 3's first shard moved on", || {
        leaver.system.hosted_shards::<Tally>() < before
    })
    .await;
    let killed = nodes.remove(2);
    killed.cluster.crash().await;
    let _ = leave.await;
    let _ = leaver.cluster.shutdown().await;
    // Every entity answers again: with its state where it moved to a
    // survivor, from the factory where its new owner died; never half.
    let (mut kept, mut fresh) = (0, 0);
    for id in &ids {
        let entity = nodes[0].system.entity_ref::<Tally>(id.as_str());
        let deadline = Instant::now() + LONG;
        let log = loop {
            match entity.ask(Entries, ASK).await {
                Ok(log) => break log,
                Err(error) => assert!(Instant::now() < deadline, "{id}: {error}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match log.as_slice() {
            [1, 2] => kept += 1,
            [] => fresh += 1,
            other => panic!("{id}: {other:?}"),
        }
        let next = entity.ask(Append(3), ASK).await.expect("append");
        assert_eq!(next, log.len() as u64 + 1, "{id}");
    }
    println!("{kept} entities kept their state, {fresh} started afresh on the survivors");
    assert!(kept > 0, "the survivors' pulls went on");
    // The shards node 2 held moved without a handoff: the survivors that
    // took them say no state came.
    let mut without_handoff = 0;
    for n in &mut nodes {
        while let Ok(event) = n.events.try_recv() {
            if matches!(event, MigrationEvent::FellBack { from: None, .. }) {
                without_handoff += 1;
            }
        }
    }
    assert!(without_handoff > 0, "no FellBack for node 2's shards");
    stop(&nodes).await;
}

// ---- durable types: the state moves with its place in the store ----

use datum_cluster_sharding::persistence::{
    AtomicWrite, DurableStateStore, EventRecord, InMemoryPersistence, Journal, Payload,
    PersistenceId, PersistenceResult, SnapshotRecord, SnapshotStore, StateRecord, Writer,
};

/// One in-memory store shared by the nodes of a test (as a database
/// would be), counting the events replayed and the states loaded.
#[derive(Clone, Default)]
struct CountingStore {
    inner: InMemoryPersistence,
    replayed: Arc<AtomicU64>,
    loaded: Arc<AtomicU64>,
}

impl Journal for CountingStore {
    fn append(&self, writes: &[AtomicWrite]) -> Vec<PersistenceResult<()>> {
        self.inner.append(writes)
    }
    fn replay(
        &self,
        id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> PersistenceResult<Vec<EventRecord>> {
        let events = self.inner.replay(id, from, to, max)?;
        self.replayed
            .fetch_add(events.len() as u64, Ordering::Relaxed);
        Ok(events)
    }
    fn highest_sequence_nr(&self, id: &PersistenceId) -> PersistenceResult<u64> {
        self.inner.highest_sequence_nr(id)
    }
    fn delete_to(&self, id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        Journal::delete_to(&self.inner, id, to)
    }
}

impl SnapshotStore for CountingStore {
    fn save(&self, id: &PersistenceId, snapshot: SnapshotRecord) -> PersistenceResult<()> {
        SnapshotStore::save(&self.inner, id, snapshot)
    }
    fn load(&self, id: &PersistenceId, max: u64) -> PersistenceResult<Option<SnapshotRecord>> {
        SnapshotStore::load(&self.inner, id, max)
    }
    fn delete_to(&self, id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        SnapshotStore::delete_to(&self.inner, id, to)
    }
}

impl DurableStateStore for CountingStore {
    fn save(
        &self,
        id: &PersistenceId,
        expected: u64,
        payload: Payload,
        writer: Writer,
    ) -> PersistenceResult<()> {
        DurableStateStore::save(&self.inner, id, expected, payload, writer)
    }
    fn load(&self, id: &PersistenceId) -> PersistenceResult<Option<StateRecord>> {
        self.loaded.fetch_add(1, Ordering::Relaxed);
        DurableStateStore::load(&self.inner, id)
    }
    fn revision(&self, id: &PersistenceId) -> PersistenceResult<u64> {
        self.inner.revision(id)
    }
    fn delete(&self, id: &PersistenceId, expected: u64) -> PersistenceResult<()> {
        self.inner.delete(id, expected)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Added(pub u64);

protocol! {
    /// A journaled sum that remembers where it lives.
    pub protocol Sum = "sum-migrating" {
        ask Append -> u64;
        ask Where -> String;
    }
}

/// Event-sourced, snapshotted rarely: recovery from the journal alone
/// replays every event.
struct SumEntity {
    node: String,
    total: u64,
}

impl Entity for SumEntity {
    type Protocol = Sum;
}
impl EventSourced for SumEntity {
    type Event = Added;
    fn apply(&mut self, event: &Added) {
        self.total += event.0;
    }
}
impl Snapshotted for SumEntity {
    type Snapshot = u64;
    const SNAPSHOT_EVERY: u64 = 1_000_000;
    fn snapshot(&self) -> u64 {
        self.total
    }
    fn restore(&mut self, total: u64) {
        self.total = total;
    }
}
impl Handler<Append> for SumEntity {
    async fn handle(&mut self, msg: Append, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, Added(msg.0)).await?;
        Ok(self.total)
    }
}
impl Handler<Where> for SumEntity {
    async fn handle(&mut self, _: Where, _: &EntityContext) -> ShardingResult<String> {
        Ok(self.node.clone())
    }
}

protocol! {
    /// A saved sum.
    pub protocol SavedSum = "saved-sum-migrating" {
        ask Append -> u64;
        ask Where -> String;
    }
}

struct SavedSumEntity {
    node: String,
    total: u64,
}

impl Entity for SavedSumEntity {
    type Protocol = SavedSum;
}
impl DurableState for SavedSumEntity {
    type State = u64;
    fn state(&self) -> &u64 {
        &self.total
    }
    fn set_state(&mut self, total: u64) {
        self.total = total;
    }
}
impl Handler<Append> for SavedSumEntity {
    async fn handle(&mut self, msg: Append, ctx: &EntityContext) -> ShardingResult<u64> {
        self.total += msg.0;
        self.save_state(ctx).await?;
        Ok(self.total)
    }
}
impl Handler<Where> for SavedSumEntity {
    async fn handle(&mut self, _: Where, _: &EntityContext) -> ShardingResult<String> {
        Ok(self.node.clone())
    }
}

/// CBOR of `value`.
fn cbor<T: Serialize>(value: &T) -> Vec<u8> {
    let mut bytes = Vec::new();
    ciborium::into_writer(value, &mut bytes).expect("encodes");
    bytes
}

/// Three nodes sharing `store`, hosting `Sum` and `SavedSum` (migratable
/// when `migrate`); the third leaves gracefully after 40 entities of each
/// got 1..=5, then each gets 6. With `outside`, another writer appends
/// `Added(100)` to the first `Sum` entity's journal and saves 1,000 as the
/// first `SavedSum` entity's state before the leave (their incarnations on
/// node 2 do not know). Returns the events replayed and states loaded by
/// the move (counted from the leave on) and the migration events of the
/// survivors, and checks the sums.
async fn durable_leave(migrate: bool, outside: bool) -> (u64, u64, Vec<MigrationEvent>) {
    let store = CountingStore::default();
    let clusters = clusters_of(3).await;
    let (mut systems, mut events) = (Vec::new(), Vec::new());
    for (i, cluster) in clusters.iter().enumerate() {
        let system = builder_on(cluster)
            .journal(store.clone())
            .start()
            .await
            .expect("system starts");
        events.push(system.subscribe_migration_events());
        let node = format!("node-{i}");
        let (node2, node) = (node.clone(), node);
        let factory = move |_: &EntityContext| SumEntity {
            node: node.clone(),
            total: 0,
        };
        if migrate {
            system
                .entity_type::<SumEntity>()
                .snapshotted()
                .migratable()
                .register(factory)
                .await
        } else {
            system
                .entity_type::<SumEntity>()
                .snapshotted()
                .register(factory)
                .await
        }
        .expect("registered");
        let saved = move |_: &EntityContext| SavedSumEntity {
            node: node2.clone(),
            total: 0,
        };
        if migrate {
            system
                .entity_type::<SavedSumEntity>()
                .durable_state()
                .migratable()
                .register(saved)
                .await
        } else {
            system
                .entity_type::<SavedSumEntity>()
                .durable_state()
                .register(saved)
                .await
        }
        .expect("registered");
        systems.push(system);
    }
    // 40 entities of each type on node 2, each sent 1..=5.
    let (mut sums, mut saved) = (Vec::new(), Vec::new());
    for k in 0..400 {
        let id = format!("sum-{k}");
        let sum = systems[0].entity_ref::<Sum>(id.as_str());
        if sums.len() < 40 && sum.ask(Where, ASK).await.expect("where") == "node-2" {
            sums.push(id.clone());
        }
        let state = systems[0].entity_ref::<SavedSum>(id.as_str());
        if saved.len() < 40 && state.ask(Where, ASK).await.expect("where") == "node-2" {
            saved.push(id);
        }
    }
    assert_eq!((sums.len(), saved.len()), (40, 40));
    for n in 1..=5 {
        for id in &sums {
            let sum = systems[0].entity_ref::<Sum>(id.as_str());
            sum.ask(Append(n), ASK).await.expect("append");
        }
        for id in &saved {
            let state = systems[0].entity_ref::<SavedSum>(id.as_str());
            state.ask(Append(n), ASK).await.expect("append");
        }
    }
    let writer = Writer {
        node_id: 99,
        incarnation: 1,
        generation: 1,
    };
    if outside {
        let pid = PersistenceId::new("sum-migrating", sums[0].as_str());
        let write = AtomicWrite {
            persistence_id: pid,
            expected: 5,
            events: vec![Payload {
                manifest: "sum-migrating".into(),
                version: 1,
                bytes: cbor(&Added(100)),
            }],
            writer,
        };
        assert_eq!(store.inner.append(&[write]), vec![Ok(())]);
        let pid = PersistenceId::new("saved-sum-migrating", saved[0].as_str());
        let state = Payload {
            manifest: "saved-sum-migrating#state".into(),
            version: 1,
            bytes: cbor(&1_000u64),
        };
        DurableStateStore::save(&store.inner, &pid, 5, state, writer).expect("saved");
    }
    let (replayed, loaded) = (store.replayed.clone(), store.loaded.clone());
    let before = (
        replayed.load(Ordering::Relaxed),
        loaded.load(Ordering::Relaxed),
    );
    systems[2].shutdown().await;
    for id in &sums {
        let sum = systems[0]
            .entity_ref::<Sum>(id.as_str())
            .ask(Append(6), ASK)
            .await
            .expect("append");
        // The store is the truth: the outside event counts, after the
        // state that moved.
        let outsider = outside && *id == sums[0];
        let expected = if outsider { 121 } else { 21 };
        assert_eq!(sum, expected, "{id}: its sum after the move");
        let pid = PersistenceId::new("sum-migrating", id.as_str());
        let journal = store
            .inner
            .replay(&pid, 1, u64::MAX, usize::MAX)
            .expect("replay");
        assert_eq!(
            journal.len(),
            6 + usize::from(outsider),
            "{id}: its journal"
        );
    }
    for id in &saved {
        let state = systems[0]
            .entity_ref::<SavedSum>(id.as_str())
            .ask(Append(6), ASK)
            .await
            .expect("append");
        let outsider = outside && *id == saved[0];
        let expected = if outsider { 1_006 } else { 21 };
        assert_eq!(state, expected, "{id}: its saved sum after the move");
        let pid = PersistenceId::new("saved-sum-migrating", id.as_str());
        let revision = store.inner.revision(&pid).expect("revision");
        assert_eq!(revision, 6 + u64::from(outsider), "{id}");
    }
    let moved = (
        replayed.load(Ordering::Relaxed) - before.0,
        loaded.load(Ordering::Relaxed) - before.1,
    );
    let mut said = Vec::new();
    for e in &mut events[..2] {
        while let Ok(event) = e.try_recv() {
            said.push(event);
        }
    }
    for system in &systems[..2] {
        system.shutdown().await;
    }
    for cluster in &clusters {
        let _ = cluster.shutdown().await;
    }
    (moved.0, moved.1, said)
}

fn refused(events: &[MigrationEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            MigrationEvent::StateRefused { entity_id, .. } => Some(entity_id.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_entities_move_with_their_place_in_the_store_and_skip_the_replay() {
    let (replayed, loaded, events) = durable_leave(true, false).await;
    assert_eq!(
        (replayed, loaded),
        (0, 0),
        "with migration nothing is replayed or loaded"
    );
    assert!(refused(&events).is_empty(), "{events:?}");
    // Without it, each moved entity replays its five events and loads its
    // state: the same sums, from the store.
    let (replayed, loaded, _) = durable_leave(false, false).await;
    assert_eq!((replayed, loaded), (200, 40), "without migration");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_stays_the_truth_when_another_writer_wrote_before_the_move() {
    let (replayed, loaded, events) = durable_leave(true, true).await;
    // The journaled sum replays the one event appended after its state;
    // the saved sum's revision moved on, so its state is loaded instead
    // (and the state that came is refused, with an event).
    assert_eq!((replayed, loaded), (1, 1));
    assert_eq!(refused(&events).len(), 1, "{events:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_entities_come_back_on_the_new_owner_with_their_state() {
    let ledger = Ledger::default();
    let store = InMemoryStore::new();
    let clusters = clusters_of(3).await;
    let mut systems = Vec::new();
    for (i, cluster) in clusters.iter().enumerate() {
        let system = builder_on(cluster)
            .store(store.clone())
            .start()
            .await
            .expect("system starts");
        let (node, ledger) = (format!("node-{i}"), ledger.clone());
        system
            .entity_type::<TallyEntity>()
            .migratable()
            .remembered()
            .register(move |ctx| TallyEntity {
                node: node.clone(),
                id: ctx.entity_id().to_owned(),
                log: Vec::new(),
                ledger: ledger.clone(),
            })
            .await
            .expect("registered");
        systems.push(system);
    }
    let mut ids = Vec::new();
    for k in 0..200 {
        let id = format!("remembered-{k}");
        let entity = systems[0].entity_ref::<Tally>(id.as_str());
        if entity.ask(Where, ASK).await.expect("where") == "node-2" {
            entity.ask(Append(1), ASK).await.expect("append");
            ids.push(id);
        }
        if ids.len() == 20 {
            break;
        }
    }
    for system in &systems {
        system.flush_remember_entities().await.expect("flushed");
    }
    systems[2].shutdown().await;
    // Live again on the survivors without a message, each with its state.
    let moved: std::collections::BTreeSet<ShardId> = ids
        .iter()
        .map(|id| systems[0].entity_ref::<Tally>(id.as_str()).shard_id())
        .collect();
    wait_for("the moved entities live on the survivors", || {
        let live: usize = moved
            .iter()
            .map(|s| systems[0].live_entities::<Tally>(*s) + systems[1].live_entities::<Tally>(*s))
            .sum();
        live >= ids.len()
    })
    .await;
    for id in &ids {
        let entity = systems[0].entity_ref::<Tally>(id.as_str());
        assert_eq!(
            entity.ask(Entries, ASK).await.expect("entries"),
            vec![1],
            "{id}"
        );
    }
    for system in &systems[..2] {
        system.shutdown().await;
    }
    for cluster in &clusters {
        let _ = cluster.shutdown().await;
    }
}
