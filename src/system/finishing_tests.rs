//! Entities still finishing their mailboxes after their shard moved away
//! without a handoff: a shutdown waits for them, and their shard coming
//! back holds their next incarnations until they stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterConfig, ClusterNode};
use crate::entity::{Entity, EntityContext, Handler};
use crate::model::error::ShardingResult;
use crate::model::extractor::ShardId;
use crate::model::identity::{NodeId, UniqueAddress};
use crate::runtime::region::Region;
use crate::runtime::slot::HomeChange;
use crate::sharding::coordinator::ShardHome;

use super::{EntityRef, ShardedSystem};

#[derive(Serialize, Deserialize)]
struct Work;
#[derive(Serialize, Deserialize)]
struct Ready;

crate::protocol! {
    protocol Slow = "slow" {
        tell Work;
        ask Ready -> ();
    }
}

/// What the incarnations did: `Work`s done, and the most that were
/// alive at once.
#[derive(Default)]
struct Counts {
    done: AtomicU64,
    alive: AtomicU64,
    most: AtomicU64,
}

/// Takes 20 ms over each `Work`, counting it and its incarnations.
struct SlowEntity(Arc<Counts>);

impl SlowEntity {
    fn new(counts: &Arc<Counts>) -> Self {
        let now = counts.alive.fetch_add(1, Ordering::SeqCst) + 1;
        counts.most.fetch_max(now, Ordering::SeqCst);
        SlowEntity(counts.clone())
    }
}

impl Drop for SlowEntity {
    fn drop(&mut self) {
        self.0.alive.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Entity for SlowEntity {
    type Protocol = Slow;
}

impl Handler<Work> for SlowEntity {
    async fn handle(&mut self, _: Work, _: &EntityContext) -> ShardingResult<()> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        self.0.done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl Handler<Ready> for SlowEntity {
    async fn handle(&mut self, _: Ready, _: &EntityContext) -> ShardingResult<()> {
        Ok(())
    }
}

/// `Work`s queued in the entity's mailbox when its shard moves away.
const WORK: u64 = 25;

/// A one-node cluster whose entity `e` has `WORK` slow messages queued
/// when the coordinator's word moves its shard to a member this node
/// cannot reach (nothing is forwarded there), without a handoff.
struct MovedAway {
    cluster: ClusterNode,
    system: ShardedSystem,
    entity: EntityRef<Slow>,
    region: Arc<Region>,
    shard: ShardId,
    generation: u64,
    counts: Arc<Counts>,
}

async fn moved_away(name: &str) -> MovedAway {
    let config = ClusterConfig::builder()
        .cluster_name(name)
        .secret("finishing-secret")
        .build();
    let cluster = ClusterNode::start(config).await.expect("node starts");
    cluster
        .wait_until(|s| s.up_members().count() == 1, Duration::from_secs(30))
        .await
        .expect("Up");
    let system = ShardedSystem::builder()
        .node(cluster.clone())
        .passivation_idle_timeout(None)
        .start()
        .await
        .expect("system starts");
    let counts = Arc::new(Counts::default());
    let c = counts.clone();
    system
        .entity_type::<SlowEntity>()
        .register(move |_| SlowEntity::new(&c))
        .await
        .expect("registered");
    let entity = system.entity_ref::<Slow>("e");
    entity
        .ask(Ready, Duration::from_secs(30))
        .await
        .expect("hosted here");
    for _ in 0..WORK {
        entity.tell(Work).await.expect("accepted");
    }
    let region = system.shared.region("slow").expect("region");
    let shard = entity.shard_id();
    let elsewhere = UniqueAddress {
        addr: "127.0.0.1:9".parse().expect("address"),
        node_id: NodeId(7),
        incarnation: 1,
    };
    let generation = region.table().generation_of(shard) + 1;
    let home = ShardHome {
        owner: elsewhere,
        generation,
    };
    assert_eq!(region.set_home(shard, home, None), HomeChange::Remote);
    assert!(
        counts.done.load(Ordering::Relaxed) < WORK,
        "the mailbox is still being worked through"
    );
    MovedAway {
        cluster,
        system,
        entity,
        region,
        shard,
        generation,
        counts,
    }
}

/// A shard whose home moves away without a handoff stops its entities
/// behind their mailboxes; a shutdown meanwhile waits for them to
/// finish (SPEC §13.3), so nothing they held is lost with the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_entities_finishing_after_their_shard_moved_away() {
    let moved = moved_away("finishing-test").await;
    moved.system.shutdown().await;
    assert_eq!(moved.counts.done.load(Ordering::Relaxed), WORK);
    let _ = moved.cluster.shutdown().await;
}

/// A shard moves away without a handoff and comes back while an entity
/// still finishes its mailbox: the entity's next incarnation waits for
/// the old one to stop (its stop notice reaches the region although
/// the shard it was started in has moved), so two never run at once
/// (SPEC §13.3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_back_before_its_entities_finished_holds_their_next_incarnations() {
    let moved = moved_away("back-test").await;
    // Back here, as the coordinator would say, before the mailbox is
    // done (the region actor starts the shard; what comes waits).
    let back = ShardHome {
        owner: moved.cluster.self_address(),
        generation: moved.generation + 1,
    };
    assert_eq!(
        moved.region.set_home(moved.shard, back, None),
        HomeChange::HostHere
    );
    moved.entity.tell(Work).await.expect("accepted");
    moved
        .entity
        .ask(Ready, Duration::from_secs(30))
        .await
        .expect("answered by the next incarnation");
    assert_eq!(moved.counts.done.load(Ordering::Relaxed), WORK + 1);
    assert_eq!(
        moved.counts.most.load(Ordering::SeqCst),
        1,
        "two incarnations ran at once"
    );
    moved.system.shutdown().await;
    let _ = moved.cluster.shutdown().await;
}
