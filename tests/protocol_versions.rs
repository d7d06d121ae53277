//! Two versions of one protocol in one cluster of real nodes on 127.0.0.1:
//! a version that appends a line registers beside the one it extends, both
//! route to each other, a message of the new line reaching an owner of the
//! old version is answered `UnknownMessage`, unprocessed, and moves its
//! shard to the new version's node, where it is answered when sent again;
//! a version that changes a line is refused, named at its first differing
//! line.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::sharding::RebalanceReason;
use datum_cluster_sharding::{Processed, extends};

const LONG: Duration = Duration::from_secs(20);
const ASK: Duration = Duration::from_secs(5);
const SHARDS: u32 = 16;
const IDS: u64 = 24;

#[derive(Debug, Serialize, Deserialize)]
pub struct Add(pub u64);
#[derive(Debug, Serialize, Deserialize)]
pub struct Get;
#[derive(Debug, Serialize, Deserialize)]
pub struct Reset;
#[derive(Debug, Serialize, Deserialize)]
pub struct Peek;

protocol! {
    /// The first version of a counter.
    pub protocol CounterV1 = "counter" { tell Add; ask Get -> u64; }
}

protocol! {
    /// Its second version: one ask appended.
    pub protocol CounterV2 = "counter" { tell Add; ask Get -> u64; ask Reset -> u64; }
}

protocol! {
    /// A version that changes the second line: not compatible.
    pub protocol CounterOther = "counter" { tell Add; ask Peek -> u64; }
}

const _: () = assert!(extends::<CounterV2, CounterV1>());
const _: () = assert!(!extends::<CounterOther, CounterV1>());

/// A counter entity of `protocol`: it adds, and reads its total with
/// `$read` (`Get` or `Peek`); its total migrates with its shard.
macro_rules! counter {
    ($entity:ident, $protocol:ident, $read:ident) => {
        #[derive(Default)]
        struct $entity(u64);
        impl Entity for $entity {
            type Protocol = $protocol;
        }
        impl Handler<Add> for $entity {
            async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> {
                self.0 += m.0;
                Ok(())
            }
        }
        impl Handler<$read> for $entity {
            async fn handle(&mut self, _: $read, _: &EntityContext) -> ShardingResult<u64> {
                Ok(self.0)
            }
        }
        impl Migratable for $entity {
            type Dehydrated = u64;
            fn dehydrate(&mut self) -> u64 {
                self.0
            }
            fn rehydrate(&mut self, total: u64) {
                self.0 = total;
            }
        }
    };
}

counter!(V1, CounterV1, Get);
counter!(V2, CounterV2, Get);
counter!(Other, CounterOther, Peek);

impl Handler<Reset> for V2 {
    async fn handle(&mut self, _: Reset, _: &EntityContext) -> ShardingResult<u64> {
        Ok(std::mem::take(&mut self.0))
    }
}

fn config(seeds: Vec<SocketAddr>) -> ClusterConfig {
    ClusterConfig::builder()
        .cluster_name("versions-test")
        .secret("versions-secret")
        .seed_nodes(seeds)
        .build()
}

async fn system_on(node: &ClusterNode) -> ShardedSystem {
    ShardedSystem::builder()
        .num_shards(SHARDS)
        .passivation_idle_timeout(None)
        .node(node.clone())
        .start()
        .await
        .expect("system starts")
}

/// Asks until an answer other than a wait for the cluster comes (the
/// first asks may meet a coordinator still settling).
async fn ask_settled<P: Protocol, M: Ask<P>>(
    system: &ShardedSystem,
    id: &str,
    message: impl Fn() -> M,
) -> ShardingResult<M::Reply> {
    let deadline = Instant::now() + LONG;
    loop {
        match system.entity_ref::<P>(id).ask(message(), ASK).await {
            Err(ShardingError::AskTimeout { .. }) if Instant::now() < deadline => {}
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_versions_of_a_protocol_serve_one_type_and_a_third_that_changes_a_line_is_refused() {
    // The old version's node runs alone first: the first half of the
    // entities live there. Then the new version's node joins, and the new
    // shards go to it (the type's newest version).
    let old = ClusterNode::start(config(vec![]))
        .await
        .expect("node starts");
    let old_system = system_on(&old).await;
    old_system
        .entity_type::<V1>()
        .migratable()
        .register(|_| V1::default())
        .await
        .expect("registered");
    let ids: Vec<String> = (0..IDS).map(|i| format!("c-{i}")).collect();
    for id in &ids[..IDS as usize / 2] {
        assert_eq!(
            ask_settled::<CounterV1, _>(&old_system, id, || Get).await,
            Ok(0)
        );
    }
    let new = ClusterNode::start(config(vec![old.bound_addr()]))
        .await
        .expect("node starts");
    for n in [&old, &new] {
        n.wait_until(|s| s.up_members().count() == 2, LONG)
            .await
            .expect("two Up");
    }
    let new_system = system_on(&new).await;
    new_system
        .entity_type::<V2>()
        .migratable()
        .register(|_| V2::default())
        .await
        .expect("registered");
    // Both versions route both ways: each entity is told from both nodes
    // and reads the sum from both.
    for (i, id) in ids.iter().enumerate() {
        let i = i as u64;
        assert_eq!(
            ask_settled::<CounterV1, _>(&old_system, id, || Get).await,
            Ok(0)
        );
        let to_old = old_system.entity_ref::<CounterV1>(id.as_str());
        let to_new = new_system.entity_ref::<CounterV2>(id.as_str());
        // (A sender's messages to one entity arrive in order.)
        to_old.tell(Add(i)).await.expect("told from the old node");
        assert_eq!(to_old.ask(Get, ASK).await, Ok(i), "{id}");
        to_new.tell(Add(100)).await.expect("told from the new node");
        assert_eq!(to_new.ask(Get, ASK).await, Ok(i + 100), "{id}");
        assert_eq!(to_old.ask(Get, ASK).await, Ok(i + 100), "{id}");
    }
    // The new line: answered where a new-version node hosts the entity,
    // refused unprocessed (its total stays) where an old one does.
    let mut answered = BTreeMap::new();
    let mut refused = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let i = i as u64;
        let to_new = new_system.entity_ref::<CounterV2>(id.as_str());
        match to_new.ask(Reset, ASK).await {
            Ok(total) => {
                assert_eq!(total, i + 100, "{id}");
                answered.insert(id.clone(), total);
            }
            Err(error) => {
                match &error {
                    ShardingError::UnknownMessage {
                        type_name,
                        line,
                        lines,
                        ..
                    } => assert_eq!((*type_name, *line, *lines), ("counter", 3, 2)),
                    other => panic!("{id}: {other:?}"),
                }
                assert_eq!(error.processed(), Processed::No);
                assert!(error.to_string().contains("line 3"), "{error}");
                refused.push(id.clone());
            }
        }
    }
    assert!(
        !answered.is_empty() && !refused.is_empty(),
        "both nodes host entities: answered {answered:?}, refused {refused:?}"
    );
    // Each refusal moved its shard to the new version's node (by a
    // handoff, its migratable state with it): sent again, the message is
    // answered there, on the total the refused one left unprocessed.
    for id in &refused {
        let i: u64 = id["c-".len()..].parse().expect("an index");
        let to_new = new_system.entity_ref::<CounterV2>(id.as_str());
        let deadline = Instant::now() + LONG;
        let total = loop {
            match to_new.ask(Reset, ASK).await {
                Ok(total) => break total,
                Err(error) => assert!(Instant::now() < deadline, "{id} never moved: {error}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(total, i + 100, "{id}");
    }
    for id in &ids {
        let to_old = old_system.entity_ref::<CounterV1>(id.as_str());
        assert_eq!(to_old.ask(Get, ASK).await, Ok(0), "{id}: reset once");
    }
    // (The old node coordinates: it is the oldest.)
    let rounds = old_system.rebalance_rounds();
    assert!(
        rounds
            .iter()
            .any(|r| r.reason == RebalanceReason::NewerVersion),
        "{rounds:?}"
    );
    // A third node whose version changes the second line is refused,
    // named at that line, and the two others serve on.
    let third = ClusterNode::start(config(vec![old.bound_addr()]))
        .await
        .expect("node starts");
    third
        .wait_until(|s| s.up_members().count() == 3, LONG)
        .await
        .expect("three Up");
    let third_system = system_on(&third).await;
    third_system
        .entity_type::<Other>()
        .register(|_| Other::default())
        .await
        .expect("registered");
    let refusal = match ask_settled::<CounterOther, _>(&third_system, "c-0", || Peek).await {
        Err(ShardingError::RegionRefused(refusal)) => refusal,
        other => panic!("expected RegionRefused, got {other:?}"),
    };
    assert_eq!(refusal.differing_line, Some(2), "{refusal:?}");
    assert!(refusal.reason.contains("line 2"), "{}", refusal.reason);
    assert_eq!(
        old_system
            .entity_ref::<CounterV1>(ids[0].as_str())
            .ask(Get, ASK)
            .await,
        new_system
            .entity_ref::<CounterV2>(ids[0].as_str())
            .ask(Get, ASK)
            .await,
    );
    for system in [&third_system, &new_system, &old_system] {
        system.shutdown().await;
    }
    for node in [&third, &new, &old] {
        let _ = node.shutdown().await;
    }
}
