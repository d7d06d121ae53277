//! What a user asks of a running system: its configuration, journal and
//! store, the state of its regions and their counts, the cluster-wide
//! stats, the coordinator as this node sees it, and subscriptions to
//! migration and remember-entities events.

use std::sync::Arc;
use std::time::Duration;

use super::ShardedSystem;
#[cfg(feature = "management")]
use super::Shared;
use crate::cluster::ClusterNode;
use crate::entity::MigrationEvent;
use crate::model::config::ShardingConfig;
use crate::model::error::ShardingResult;
use crate::model::extractor::ShardId;
use crate::model::protocol::Protocol;
use crate::persistence::Journal;
use crate::persistence::remember::writer::Remember;
use crate::persistence::remember::{RememberEntitiesEvent, RememberEntitiesStore};
use crate::runtime::region::Region;
use crate::sharding::coordinator::RebalanceRound;
use crate::sharding::stats::{ClusterShardingStats, ShardRegionState};
use crate::util::fast_hash::FastMap;

impl<S, J> ShardedSystem<S, J> {
    /// The configuration the system runs with.
    pub fn config(&self) -> &ShardingConfig {
        &self.shared.config
    }

    /// What becomes of migrated states on this node from now on (SPEC
    /// §13.16): shards that came with their entities' states, shards that
    /// started without them and why, states refused. A subscriber more than
    /// 1,024 events behind misses the oldest.
    pub fn subscribe_migration_events(&self) -> tokio::sync::broadcast::Receiver<MigrationEvent> {
        self.shared.migration_events.subscribe()
    }

    /// The cluster node this system runs on, if it was built with one.
    pub fn cluster_node(&self) -> Option<&ClusterNode> {
        self.shared.cluster.as_ref().map(|link| &link.node)
    }

    /// The rebalance rounds the coordinator made while this node was
    /// coordinator, oldest first (the latest 1,000). Empty on a single node.
    pub fn rebalance_rounds(&self) -> Vec<RebalanceRound> {
        match &self.shared.cluster {
            Some(link) => link
                .rounds
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            None => Vec::new(),
        }
    }

    /// The state of this node's region of protocol `P` (Akka's
    /// `GetShardRegionState`): hosted shards and their live entities,
    /// shards being handed off, buffered messages. `None` when `P` is not
    /// registered here.
    pub fn shard_region_state<P: Protocol>(&self) -> Option<ShardRegionState> {
        self.regions()
            .get(P::TYPE_NAME)
            .map(|region| region.state())
    }

    /// As [`shard_region_state`](Self::shard_region_state), with the ids
    /// of the live entities (as Akka's `GetShardRegionState` answers them):
    /// `entity_ids` has every hosted shard with the ids of its live
    /// entities, ascending, at most `limit_per_shard` of them (the least),
    /// and `entity_ids_truncated` the shards that have more: the entities
    /// a graceful leave begun now would stop here, to start again where
    /// their shards go. `None` when `P` is not registered here.
    ///
    /// Each shard is read under its own lock in turn, as for its count
    /// (SPEC §13.13); its ids take one more walk over its entities under
    /// that lock, keeping the least `limit_per_shard`, and are copied and
    /// sorted once it is released. The answer holds up to
    /// `limit_per_shard` ids for each hosted shard, and 8 MiB of ids in
    /// all (the shards past that list none and are marked cut): bound it
    /// for a region of many shards.
    pub fn shard_region_state_with_ids<P: Protocol>(
        &self,
        limit_per_shard: usize,
    ) -> Option<ShardRegionState> {
        self.regions()
            .get(P::TYPE_NAME)
            .map(|region| region.state_with_ids(limit_per_shard, usize::MAX))
    }

    /// The cluster-wide view of protocol `P` (Akka's
    /// `GetClusterShardingStats`): every live member is asked for its
    /// region's hosted shards and live entities; members that do not answer
    /// within `timeout` are listed in `failed`. `InvalidConfig` on a system
    /// without a cluster node (use [`shard_region_state`](Self::shard_region_state)).
    pub async fn cluster_sharding_stats<P: Protocol>(
        &self,
        timeout: Duration,
    ) -> ShardingResult<ClusterShardingStats> {
        self.shared.cluster_stats(P::TYPE_NAME, timeout).await
    }

    /// The sharding coordinator as this node sees it: the member acting as
    /// coordinator (which can differ from the membership's
    /// `placement_coordinator()`, SPEC §13.15), its epoch, and — on the
    /// coordinator itself — whether it allocates yet. Updated by the
    /// control task at least every 100 ms. `None` on a system without a
    /// cluster node. `cluster_sharding_stats` has the coordinator's own
    /// answer.
    pub fn sharding_coordinator(&self) -> Option<crate::sharding::CoordinatorStatus> {
        self.shared.coordinator_status()
    }

    /// The shared state, held weakly (the management endpoint must not
    /// keep a dropped system alive).
    #[cfg(feature = "management")]
    pub(crate) fn downgrade(&self) -> std::sync::Weak<Shared> {
        Arc::downgrade(&self.shared)
    }

    /// How many shards of protocol `P` this node hosts now.
    pub fn hosted_shards<P: Protocol>(&self) -> usize {
        self.regions()
            .get(P::TYPE_NAME)
            .map_or(0, |region| region.table().hosted_count())
    }

    /// Asks sent to entities on other nodes and still waiting for a reply
    /// (a diagnostic; 0 on a single node).
    pub fn pending_remote_asks(&self) -> usize {
        self.shared
            .cluster
            .as_ref()
            .map_or(0, |link| link.remote.pending_asks())
    }

    /// Whether the system has stopped serving: `shutdown` has passed its
    /// graceful leave, or the node left the cluster (downed, removed) and
    /// the system stopped its regions.
    pub fn is_shut_down(&self) -> bool {
        self.shared.is_shut_down()
    }

    pub(super) fn regions(
        &self,
    ) -> std::sync::RwLockReadGuard<'_, FastMap<&'static str, Arc<Region>>> {
        self.shared
            .regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// How many entities of protocol `P` are live in `shard` on this node.
    pub fn live_entities<P: Protocol>(&self, shard: ShardId) -> usize {
        match self.regions().get(P::TYPE_NAME) {
            Some(region) if shard.0 < region.num_shards() => region.live_entities(shard),
            _ => 0,
        }
    }
}

impl<S, J: Journal> ShardedSystem<S, J> {
    /// The system's journal.
    pub fn journal(&self) -> &J {
        &self.journal
    }

    /// The journal, shared.
    pub(crate) fn journal_arc(&self) -> Arc<J> {
        self.journal.clone()
    }
}

impl<S: RememberEntitiesStore, J> ShardedSystem<S, J> {
    /// The write-behind queue, started on first use.
    pub(super) fn remember(&self) -> ShardingResult<Arc<Remember>> {
        let mut slot = self
            .shared
            .remember
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(remember) = &*slot {
            return Ok(remember.clone());
        }
        let store: Arc<dyn RememberEntitiesStore> = self.store.clone();
        let remember = Remember::start(store, &self.shared.config.remember_entities)?;
        *slot = Some(remember.clone());
        Ok(remember)
    }

    /// Waits until every remember-entities record queued before this call
    /// has reached the store — and so is as durable as the store makes it
    /// (for `FileStore` with `FileStoreFsyncPolicy::Always`: on disk).
    /// Messages are acknowledged before their entity's record is durable;
    /// this is the barrier, for example before a planned shutdown. Fails with
    /// `RememberEntities` if records failed (or were dropped by a full
    /// queue) since the last flush that said so: those are not durable.
    pub async fn flush_remember_entities(&self) -> ShardingResult<()> {
        self.remember()?.flush().await
    }

    /// Remember-entities store failures from now on (each with the policy
    /// that was applied). A subscriber more than 1,024 events behind misses
    /// the oldest.
    pub fn subscribe_remember_entities_events(
        &self,
    ) -> ShardingResult<tokio::sync::broadcast::Receiver<RememberEntitiesEvent>> {
        Ok(self.remember()?.subscribe())
    }

    /// The system's store.
    pub fn store(&self) -> &S {
        &self.store
    }
}
