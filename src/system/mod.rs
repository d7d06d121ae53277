//! The sharded system: its builder, entity registration and entity refs.
//!
//! ```
//! # use std::time::Duration;
//! # use datum_cluster_sharding::prelude::*;
//! # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
//! # #[derive(Serialize, Deserialize)] pub struct Get;
//! # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
//! # #[derive(Default)] struct CounterEntity { total: u64 }
//! # impl Entity for CounterEntity { type Protocol = Counter; }
//! # impl Handler<Add> for CounterEntity {
//! #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
//! # }
//! # impl Handler<Get> for CounterEntity {
//! #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
//! # }
//! # #[tokio::main] async fn main() -> ShardingResult<()> {
//! let system = ShardedSystem::builder().num_shards(64).start().await?;
//! system.entity_type::<CounterEntity>().register(|_ctx| CounterEntity::default()).await?;
//! let cart = system.entity_ref::<Counter>("cart-42");
//! cart.tell(Add(3)).await?;
//! assert_eq!(cart.ask(Get, Duration::from_secs(5)).await?, 3);
//! system.shutdown().await;
//! # Ok(()) }
//! ```

pub mod registration;

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::cluster::ClusterNode;
use crate::config::ShardingConfig;
use crate::dispatch::envelope_of;
use crate::entity::{JournalWriter, MigrationEvent, StateWriter};
use crate::envelope::{Delivery, Extras};
use crate::error::{ShardingError, ShardingResult};
use crate::extractor::{ShardExtractor, ShardId};
use crate::fast_hash::FastMap;
use crate::persistence::{DurableStateStore, Journal, NoJournal, SnapshotStore};
use crate::protocol::SealedProtocol;
use crate::protocol::{Ask, Message, Protocol, Tell};
use crate::runtime::ask_waits::{AskWaits, Expired, keep_deadlines};
use crate::runtime::region::{Region, RegionProtocol};
use crate::sharding::coordinator::{CoordinatorConfig, RebalanceRound, ShardAllocationStrategy};
use crate::sharding::driver::{BoxFuture, ClusterLink, DriverMsg, RegionLink, SystemPort};
use crate::sharding::stats::{ClusterShardingStats, ShardRegionState};
use crate::store::writer::Remember;
use crate::store::{NoStore, RememberEntitiesEvent, RememberEntitiesStore};

/// What a region needs to know of protocol `P`.
fn region_protocol<P: Protocol>() -> RegionProtocol {
    RegionProtocol {
        type_name: P::TYPE_NAME,
        id: TypeId::of::<P>(),
        fingerprint: P::FINGERPRINT,
        decode: <P as SealedProtocol>::decode,
        extract: |entity_id, num_shards| {
            <P::Extractor as Default>::default().shard_id(entity_id, num_shards)
        },
    }
}

/// A running sharded system on this node. `S` is its remember-entities store
/// ([`NoStore`] when built without one), `J` its journal for event-sourced
/// entities ([`NoJournal`] when built without one).
///
/// Cheap to clone; clones share the system.
pub struct ShardedSystem<S = NoStore, J = NoJournal> {
    shared: Arc<Shared>,
    store: Arc<S>,
    journal: Arc<J>,
}

impl<S, J> Clone for ShardedSystem<S, J> {
    fn clone(&self) -> Self {
        ShardedSystem {
            shared: self.shared.clone(),
            store: self.store.clone(),
            journal: self.journal.clone(),
        }
    }
}

/// The state every clone of a system and its tasks share.
pub(crate) struct Shared {
    config: ShardingConfig,
    regions: RwLock<FastMap<&'static str, Arc<Region>>>,
    stopped: AtomicBool,
    /// `shutdown` has begun (a graceful leave comes before `stopped`).
    leaving: AtomicBool,
    /// The link to the cluster node, for a system built with `node`.
    cluster: Option<ClusterLink>,
    /// The remember-entities write-behind queue, started on first use.
    remember: Mutex<Option<Arc<Remember>>>,
    /// The batching writer of the journal, once an event-sourced type is
    /// registered.
    journal_writer: OnceLock<Arc<JournalWriter>>,
    /// The journal, once an event-sourced type is registered.
    journal: OnceLock<Arc<dyn Journal>>,
    /// The snapshot store, once a snapshotted type is registered.
    snapshot_store: OnceLock<Arc<dyn SnapshotStore>>,
    /// The durable-state store, once a durable-state type is registered.
    state_store: OnceLock<Arc<dyn DurableStateStore>>,
    /// The batching writer of its saves, from then on.
    state_writer: OnceLock<Arc<StateWriter>>,
    /// The one graceful stop (`shutdown` from the system or its node): the
    /// task running it, as a watch that turns true when it is done.
    stop_task: Mutex<Option<tokio::sync::watch::Receiver<bool>>>,
    /// What became of migrated states here.
    migration_events: tokio::sync::broadcast::Sender<MigrationEvent>,
    /// The deadlines of the asks waiting on this node that no pending
    /// remote ask keeps (SPEC §13.5).
    asks: Arc<AskWaits>,
}

impl Drop for Shared {
    /// The last handle (system clone or entity ref) dropped without
    /// `shutdown`: the system stops like a crash. Its actors are killed and
    /// what waits in its buffers fails with `ShuttingDown`; once they have
    /// stopped, nothing holds this node's pipes any more (the cluster link,
    /// dropped with this, stops the sharding tasks).
    ///
    /// After a completed `shutdown` (or the stop of a node that left the
    /// cluster) there is nothing left to kill. A `shutdown` under way holds
    /// the system on its own task, so this never runs in its middle.
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Release);
        let regions = self.regions.get_mut().unwrap_or_else(|p| p.into_inner());
        for region in regions.values() {
            region.kill();
        }
    }
}

impl Shared {
    /// The graceful stop of [`ShardedSystem::shutdown`], run once, on a
    /// task of its own: later and concurrent callers wait for that one, and
    /// a caller that gives up (a timeout, a dropped future) stops nothing
    /// halfway.
    pub(crate) async fn shutdown(self: &Arc<Self>) {
        let mut done = {
            let mut task = self.stop_task.lock().unwrap_or_else(|p| p.into_inner());
            match &*task {
                Some(done) => done.clone(),
                None => {
                    let (tx, done) = tokio::sync::watch::channel(false);
                    let shared = self.clone();
                    tokio::spawn(async move {
                        shared.stop_gracefully().await;
                        // Let go of the system before saying so: a caller
                        // that drops its last handle next must find nothing
                        // of it held (a store's directory lock, say).
                        drop(shared);
                        let _ = tx.send(true);
                    });
                    *task = Some(done.clone());
                    done
                }
            }
        };
        // An error: the task ended without saying so (it panicked).
        let _ = done.wait_for(|done| *done).await;
    }

    async fn stop_gracefully(&self) {
        // No new type may register from here on (it would make this node a
        // region that is not leaving).
        self.leaving.store(true, Ordering::Release);
        let regions: Vec<Arc<Region>> = self
            .regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        // A graceful leave: the shards hosted here move to other nodes while
        // this one still routes (messages that arrive meanwhile wait in the
        // handoff buffers, then follow their shards).
        if let Some(link) = &self.cluster
            && link.leave().await
        {
            let patience = self.config.handoff_timeout + Duration::from_secs(1);
            let deadline = tokio::time::Instant::now() + patience;
            while !regions.iter().all(|r| r.leave_done()) {
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(
                        ?patience,
                        "graceful leave: not every shard was handed off in time"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The states handed over stay until the new owners fetched
            // them (or the migration timeout passes: they start without).
            let patience = self.config.migration_timeout;
            let deadline = tokio::time::Instant::now() + patience;
            while regions.iter().any(|r| r.migrations_pending()) {
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(
                        ?patience,
                        "graceful leave: migrated states not all fetched in time"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // Senders waiting for room in the remember-entities queue give up...
        self.mark_stopped();
        // No new message is accepted from here on (senders see ShuttingDown)...
        for region in &regions {
            region.stop_accepting();
        }
        // ...the coordinator hears the regions go...
        if let Some(link) = &self.cluster {
            link.stop().await;
        }
        // ...and what they hold stops.
        futures_util::future::join_all(regions.iter().map(|r| r.shutdown())).await;
        if let Some(link) = &self.cluster {
            link.remote.stop_waiting();
        }
        // What was recorded reaches the store before shutdown returns.
        let remember = self
            .remember
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(remember) = remember {
            let timeout = self.config.shutdown_timeout;
            if tokio::time::timeout(timeout, remember.flush())
                .await
                .is_err()
            {
                tracing::warn!(
                    ?timeout,
                    "remember-entities records not all written at shutdown"
                );
            }
        }
    }

    /// The link to the cluster node, for a system built with `node`.
    pub(crate) fn cluster_link(&self) -> Option<&ClusterLink> {
        self.cluster.as_ref()
    }

    pub(crate) fn is_shut_down(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// `shutdown` has begun: the graceful leave hands the shards off.
    #[cfg(feature = "management")]
    pub(crate) fn is_leaving(&self) -> bool {
        self.leaving.load(Ordering::Acquire)
    }

    /// The coordinator as this node sees it (`None` without a cluster node).
    /// `registered` is also checked against the regions as they are now: a
    /// region added since the control task last published its status has
    /// no coordinator's table yet.
    pub(crate) fn coordinator_status(&self) -> Option<crate::sharding::CoordinatorStatus> {
        let link = self.cluster.as_ref()?;
        let mut status = link
            .coordinator
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if status.registered {
            let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
            status.registered = regions.values().all(|r| r.accepted_by().is_some());
        }
        Some(status)
    }

    /// The system can no longer serve (its node is out of the cluster): no
    /// new type may register, new refs are refused.
    pub(crate) fn mark_stopped(&self) {
        self.stopped.store(true, Ordering::Release);
        // No sender waits for room in the remember-entities queue any more.
        if let Some(remember) = self
            .remember
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            remember.end_waits();
        }
    }

    /// This node is out of the cluster (downed, removed, or its node
    /// stopped): stop now, so that what the rest of the cluster
    /// reallocates does not also run here. Regions stop accepting at once
    /// and stop their entities on a task; asks waiting on other nodes fail
    /// with `ShutDownInFlight` (they may have been processed there).
    /// The system is the one owner of its regions' lifecycle: this, the
    /// graceful `shutdown`, and `Drop`.
    pub(crate) fn fence(&self) {
        self.mark_stopped();
        let regions = self.all_regions();
        if regions.is_empty() {
            return;
        }
        for region in &regions {
            region.stop_accepting();
        }
        if let Some(link) = &self.cluster {
            link.remote.stop_waiting();
        }
        tokio::spawn(async move {
            for region in regions {
                region.shutdown().await;
            }
        });
    }

    /// The region of the entity type named `type_name`.
    pub(crate) fn region(&self, type_name: &str) -> Option<Arc<Region>> {
        self.regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(type_name)
            .cloned()
    }

    /// Every region, in no particular order.
    pub(crate) fn all_regions(&self) -> Vec<Arc<Region>> {
        self.regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

impl SystemPort for Shared {
    fn region(&self, type_name: &str) -> Option<Arc<Region>> {
        Shared::region(self, type_name)
    }

    fn all_regions(&self) -> Vec<Arc<Region>> {
        Shared::all_regions(self)
    }

    fn cluster_link(&self) -> Option<&ClusterLink> {
        Shared::cluster_link(self)
    }

    fn is_shut_down(&self) -> bool {
        Shared::is_shut_down(self)
    }

    fn fence(&self) {
        Shared::fence(self)
    }

    fn shut_down(self: Arc<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { self.shutdown().await })
    }
}

/// Builds a [`ShardedSystem`]; the store and the journal given (if any)
/// become part of the system's type.
#[must_use = "a builder does nothing until `start` is awaited"]
pub struct ShardedSystemBuilder<S = NoStore, J = NoJournal> {
    config: ShardingConfig,
    store: S,
    journal: J,
    node: Option<ClusterNode>,
    strategy: Option<Box<dyn ShardAllocationStrategy>>,
}

impl<S: std::fmt::Debug, J> std::fmt::Debug for ShardedSystemBuilder<S, J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedSystemBuilder")
            .field("config", &self.config)
            .field("store", &self.store)
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl ShardedSystem<NoStore> {
    /// A builder with the default [`ShardingConfig`] and no store.
    pub fn builder() -> ShardedSystemBuilder<NoStore> {
        ShardedSystemBuilder {
            config: ShardingConfig::default(),
            store: NoStore,
            journal: NoJournal,
            node: None,
            strategy: None,
        }
    }
}

impl<S, J> ShardedSystemBuilder<S, J> {
    /// Replaces the whole configuration.
    pub fn config(mut self, config: ShardingConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets [`ShardingConfig::num_shards`].
    pub fn num_shards(mut self, num_shards: u32) -> Self {
        self.config.num_shards = num_shards;
        self
    }

    /// Sets [`ShardingConfig::allocation_buffer`].
    pub fn allocation_buffer(mut self, allocation_buffer: usize) -> Self {
        self.config.allocation_buffer = allocation_buffer;
        self
    }

    /// Sets [`ShardingConfig::passivation_idle_timeout`].
    pub fn passivation_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.config.passivation_idle_timeout = timeout;
        self
    }

    /// Uses `store` for remember-entities; enables `.remembered()`
    /// registrations.
    pub fn store<T: RememberEntitiesStore>(self, store: T) -> ShardedSystemBuilder<T, J> {
        ShardedSystemBuilder {
            config: self.config,
            store,
            journal: self.journal,
            node: self.node,
            strategy: self.strategy,
        }
    }

    /// Uses `journal` for entities with a store; enables the
    /// `event_sourced()`, `snapshotted()` and `durable_state()`
    /// registrations the journal's traits allow.
    pub fn journal<T: Journal>(self, journal: T) -> ShardedSystemBuilder<S, T> {
        ShardedSystemBuilder {
            config: self.config,
            store: self.store,
            journal,
            node: self.node,
            strategy: self.strategy,
        }
    }

    /// Runs the system on `node`'s cluster: shards are placed by the
    /// cluster's coordinator and messages reach entities on any member.
    /// Every member that registers an entity type hosts a share of its
    /// shards; all must use the same `num_shards`. Without a node the system
    /// is a single-node one.
    pub fn node(mut self, node: ClusterNode) -> Self {
        self.node = Some(node);
        self
    }

    /// Sets the coordinator's [`ShardAllocationStrategy`] (default:
    /// [`LeastShardAllocation`](crate::sharding::LeastShardAllocation)). It
    /// is used while this node is the coordinator.
    pub fn allocation_strategy(mut self, strategy: impl ShardAllocationStrategy) -> Self {
        self.strategy = Some(Box::new(strategy));
        self
    }

    /// Validates the configuration and starts the system.
    pub async fn start(self) -> ShardingResult<ShardedSystem<S, J>> {
        self.config.validate()?;
        let cluster = match self.node {
            Some(node) => {
                let cluster = node.config();
                let membership = cluster.membership();
                // With a resolver and no margin given: how far apart the
                // two sides' decisions can be (SPEC §13.15), one more
                // heartbeat for the loser's fence to land, and more per
                // ring cascade step as the membership grows.
                let (margin, per_step) =
                    match (self.config.down_removal_margin, cluster.split_brain) {
                        (Some(margin), _) => (margin, Duration::ZERO),
                        (None, Some(_)) => (
                            membership
                                .resolver_decision_spread(1)
                                .saturating_add(membership.heartbeat_interval),
                            membership.detection_step(),
                        ),
                        (None, None) => (Duration::ZERO, Duration::ZERO),
                    };
                let coordinator = CoordinatorConfig {
                    rebalance_interval: self.config.rebalance_interval,
                    rebalance_per_round: self.config.rebalance_per_round,
                    handoff_timeout: self.config.handoff_timeout,
                    dead_owner_margin: margin,
                    margin_per_ring_step: per_step,
                    ring_watchers: membership.monitored_by,
                    detection_step: if cluster.split_brain.is_some() {
                        membership.detection_step()
                    } else {
                        Duration::ZERO
                    },
                    hold_through_unreachability: cluster.split_brain.is_some(),
                    // A partition is decided by the unstable limit at the
                    // latest (SPEC §10.5); its losers have fenced a margin
                    // after that.
                    hold_for: membership.unstable_limit(1).saturating_add(margin),
                    ..CoordinatorConfig::default()
                };
                Some(ClusterLink::new(node, self.strategy, coordinator)?)
            }
            None => None,
        };
        let shared = Arc::new(Shared {
            config: self.config,
            regions: RwLock::new(FastMap::default()),
            stopped: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            cluster,
            remember: Mutex::new(None),
            stop_task: Mutex::new(None),
            journal_writer: OnceLock::new(),
            journal: OnceLock::new(),
            snapshot_store: OnceLock::new(),
            state_store: OnceLock::new(),
            state_writer: OnceLock::new(),
            migration_events: tokio::sync::broadcast::channel(1_024).0,
            asks: AskWaits::new(),
        });
        tokio::spawn(keep_deadlines(Arc::downgrade(&shared.asks)));
        if let Some(link) = &shared.cluster {
            let weak: Weak<Shared> = Arc::downgrade(&shared);
            let port: Weak<dyn SystemPort> = weak;
            link.spawn(port);
        }
        Ok(ShardedSystem {
            shared,
            store: Arc::new(self.store),
            journal: Arc::new(self.journal),
        })
    }
}

impl<S, J> ShardedSystem<S, J> {
    /// The configuration the system runs with.
    pub fn config(&self) -> &ShardingConfig {
        &self.shared.config
    }

    /// A reference to entity `entity_id` of protocol `P`. Cheap; no message is sent.
    pub fn entity_ref<P: Protocol>(&self, entity_id: impl Into<Arc<str>>) -> EntityRef<P> {
        EntityRef::on(self.shared.clone(), entity_id.into())
    }

    /// An entity ref of `P` to make others from (through
    /// `EntityRef::sibling`, which runs the extractor); itself it sends
    /// nothing.
    pub(crate) fn entity_template<P: Protocol>(&self) -> EntityRef<P> {
        EntityRef {
            shared: self.shared.clone(),
            region: OnceLock::new(),
            entity_id: Arc::from(""),
            shard: ShardId(0),
            _protocol: PhantomData,
        }
    }

    /// Stops every entity, fails buffered and pending messages with
    /// [`ShardingError::ShuttingDown`], and waits for the actors to stop.
    ///
    /// On a cluster this is a graceful leave (SPEC §13.12): first the
    /// shards hosted here are handed off to other members while this node
    /// still routes (no new type may register meanwhile), waiting at most
    /// `handoff_timeout` + 1 s; then the coordinator hears that the regions
    /// stop, and messages that still reach this node are answered
    /// `ShuttingDown`.
    ///
    /// Concurrent and repeated calls wait for the one shutdown, and so does
    /// [`ClusterNode::shutdown`](crate::cluster::ClusterNode::shutdown),
    /// which runs this first: on a cluster node, `node.shutdown()` alone is
    /// the whole graceful stop. The stop runs on a task of its own, so a
    /// caller that stops waiting (a timeout) does not cut it short. Do not
    /// await it inside an entity's handler: that entity's shard waits for
    /// the handler before it is handed off (spawn a task instead).
    pub async fn shutdown(&self) {
        self.shared.shutdown().await;
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
        let Some(link) = &self.shared.cluster else {
            return Err(ShardingError::InvalidConfig(
                "cluster_sharding_stats needs a system built with a cluster node".into(),
            ));
        };
        let (reply, answer) = oneshot::channel();
        link.driver
            .send(DriverMsg::Stats {
                type_name: P::TYPE_NAME,
                timeout,
                reply,
            })
            .map_err(|_| ShardingError::ShuttingDown)?;
        answer.await.map_err(|_| ShardingError::ShuttingDown)
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
            .map_or(0, |region| region.hosted_count())
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

    fn regions(&self) -> std::sync::RwLockReadGuard<'_, FastMap<&'static str, Arc<Region>>> {
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
    fn remember(&self) -> ShardingResult<Arc<Remember>> {
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

/// A reference to one entity of protocol `P`: send it tells and asks.
///
/// Cheap to clone. Messages from one sender that awaits each call on the same
/// ref are processed in send order.
pub struct EntityRef<P: Protocol> {
    shared: Arc<Shared>,
    region: OnceLock<Arc<Region>>,
    entity_id: Arc<str>,
    shard: ShardId,
    _protocol: PhantomData<fn() -> P>,
}

impl<P: Protocol> Clone for EntityRef<P> {
    fn clone(&self) -> Self {
        EntityRef {
            shared: self.shared.clone(),
            region: self.region.clone(),
            entity_id: self.entity_id.clone(),
            shard: self.shard,
            _protocol: PhantomData,
        }
    }
}

impl<P: Protocol> std::fmt::Debug for EntityRef<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityRef")
            .field("type_name", &P::TYPE_NAME)
            .field("entity_id", &self.entity_id)
            .field("shard", &self.shard)
            .finish()
    }
}

impl<P: Protocol> EntityRef<P> {
    /// The entity's id.
    pub fn entity_id(&self) -> &str {
        &self.entity_id
    }

    /// The entity's shard, as the protocol's extractor computed it.
    pub fn shard_id(&self) -> ShardId {
        self.shard
    }

    fn region(&self) -> ShardingResult<&Arc<Region>> {
        if let Some(region) = self.region.get() {
            return Ok(region);
        }
        if self.shared.is_shut_down() {
            return Err(ShardingError::ShuttingDown);
        }
        let region = {
            let regions = self
                .shared
                .regions
                .read()
                .unwrap_or_else(|p| p.into_inner());
            match regions.get(P::TYPE_NAME) {
                Some(region) if region.protocol == TypeId::of::<P>() => region.clone(),
                _ => {
                    return Err(ShardingError::NotRegistered {
                        type_name: P::TYPE_NAME,
                    });
                }
            }
        };
        if self.shard.0 >= region.num_shards() {
            return Err(ShardingError::InvalidShard {
                entity_id: self.entity_id.to_string(),
                shard_id: self.shard,
                num_shards: region.num_shards(),
            });
        }
        Ok(self.region.get_or_init(|| region))
    }

    /// Sends a tell message. Returns once the message is accepted (enqueued or
    /// buffered), not when it is processed.
    ///
    /// To a remembered type whose write-behind queue is full (under
    /// `RememberEntitiesQueueFull::BackPressure`), it first waits for room,
    /// `full_queue_wait` at most.
    pub async fn tell<M: Tell<P>>(&self, msg: M) -> ShardingResult<()> {
        let region = self.region()?;
        if let Some(remember) = region.remember().filter(|r| r.is_full()) {
            // Boxed: a rare wait, kept out of every tell's future.
            Box::pin(remember.room(P::TYPE_NAME, self.shard, None)).await?;
        }
        let mut envelope = envelope_of::<P, M>(msg, None);
        if region.tracing().is_some() {
            let span = tracing::info_span!(
                "datum.tell",
                entity_type = P::TYPE_NAME,
                entity_id = &*self.entity_id
            );
            envelope.set_trace(span);
        }
        region.deliver(self.shard, &self.entity_id, envelope)
    }

    /// Sends an ask message and waits up to `timeout` for its reply.
    ///
    /// On [`ShardingError::AskTimeout`] the message may still be processed.
    /// To a remembered type whose write-behind queue is full (under
    /// `RememberEntitiesQueueFull::BackPressure`), it first waits for room,
    /// within `timeout`.
    pub async fn ask<M: Ask<P>>(&self, msg: M, timeout: Duration) -> ShardingResult<M::Reply> {
        let region = self.region()?;
        // The deadline and the latency both count from this one clock
        // read; the latency's second read happens only with a recorder
        // installed.
        let sent = tokio::time::Instant::now();
        region.metrics.asks.increment(1);
        let answer = match region.tracing() {
            None => self.ask_in(region, msg, (sent, timeout), None).await,
            Some(_) => {
                let span = tracing::info_span!(
                    "datum.ask",
                    entity_type = P::TYPE_NAME,
                    entity_id = &*self.entity_id
                );
                let extras = Extras {
                    trace: Some(span.clone()),
                    delivery: None,
                    deadline: None,
                };
                let asked = self.ask_in(region, msg, (sent, timeout), Some(Box::new(extras)));
                // Boxed, as every rare wait of an ask: what an untraced
                // ask's future holds is what the common path needs.
                Box::pin(tracing::Instrument::instrument(asked, span)).await
            }
        };
        match &answer {
            Ok(_) => region.metrics.ask_answered(sent),
            Err(e) => region.metrics.ask_failed(e.kind()),
        }
        answer
    }

    /// A ref to `entity_id` through the system `shared` (its shard as the
    /// protocol's extractor puts it).
    fn on(shared: Arc<Shared>, entity_id: Arc<str>) -> EntityRef<P> {
        let shard = P::Extractor::default().shard_id(&entity_id, shared.config.num_shards);
        EntityRef {
            shared,
            region: OnceLock::new(),
            entity_id,
            shard,
            _protocol: PhantomData,
        }
    }

    /// Another entity of the same type, on the same system.
    pub(crate) fn sibling(&self, entity_id: Arc<str>) -> EntityRef<P> {
        EntityRef::on(self.shared.clone(), entity_id)
    }

    /// Whether the system this ref sends through has shut down.
    pub(crate) fn system_shut_down(&self) -> bool {
        self.shared.is_shut_down()
    }

    /// Sends tell `msg` tagged by a reliable producer (SPEC §13.17) as an
    /// ask, and waits up to `timeout` for its confirmation.
    pub(crate) async fn send_reliable<M: Tell<P>>(
        &self,
        msg: M,
        delivery: Delivery,
        timeout: Duration,
    ) -> ShardingResult<()> {
        let region = self.region()?;
        let sent = tokio::time::Instant::now();
        let extras = Extras {
            trace: None,
            delivery: Some(delivery),
            deadline: None,
        };
        self.ask_in(region, msg, (sent, timeout), Some(Box::new(extras)))
            .await
    }

    /// [`ask`](Self::ask) on the region it resolved (or a reliable tell,
    /// with its delivery tag in `extras`), `sent` at the instant its
    /// `timeout` counts from; `extras`: its trace span and delivery tag, if
    /// it has either.
    ///
    /// Its future is small (SPEC §13.5): the message is sent before the
    /// first await, the rare waits (room in a full remember-entities queue,
    /// tracing) are boxed, and what is held across the wait for the reply
    /// is the reply channel and its deadline. A caller that keeps a future
    /// per ask in flight allocates and moves each one.
    async fn ask_in<M: Message<P>>(
        &self,
        region: &Region,
        msg: M,
        (sent, timeout): (tokio::time::Instant, Duration),
        extras: Option<Box<Extras>>,
    ) -> ShardingResult<M::Reply> {
        let deadline = crate::store::writer::deadline_from(sent, timeout);
        if let Some(remember) = region.remember().filter(|r| r.is_full()) {
            Box::pin(remember.room(P::TYPE_NAME, self.shard, Some(deadline))).await?;
        }
        let (replied, guarded) = self.send_ask(region, msg, (deadline, timeout), extras)?;
        // Sent to another node in this call: the pending-ask table answers
        // `AskTimeout` at the deadline. Anywhere else — an entity here, a
        // buffer — the system's table of waiting asks keeps it. Neither
        // arms a runtime timer (SPEC §13.5).
        let replied = if guarded {
            Ok(replied.await)
        } else {
            self.shared.asks.wait(replied, deadline).await
        };
        // A reply slot closed unanswered never reached a handler: one that
        // had answers `HandlerInterrupted` if it stops midway. Except the
        // pending-ask table's: dropped with the system, after the message
        // was sent away.
        let in_flight = || ShardingError::ShutDownInFlight {
            type_name: P::TYPE_NAME,
            entity_id: self.entity_id.to_string(),
        };
        match replied {
            Ok(Ok(result)) => result,
            Ok(Err(_closed)) if guarded => Err(in_flight()),
            Ok(Err(_closed)) if region.is_stopped() => Err(ShardingError::ShuttingDown),
            Ok(Err(_closed)) => Err(ShardingError::EntityStopped {
                type_name: P::TYPE_NAME,
                entity_id: self.entity_id.to_string(),
            }),
            // The table of waiting asks stopped with its runtime: where the
            // message stands (a buffer, a handler, another node) is unknown.
            Err(Expired::Stopped) => Err(in_flight()),
            Err(Expired::TimedOut) => Err(ShardingError::AskTimeout {
                type_name: P::TYPE_NAME,
                entity_id: self.entity_id.to_string(),
                timeout,
            }),
        }
    }

    /// Sends ask `msg` through `region`: the channel its reply comes on,
    /// and whether the pending-ask table keeps its deadline.
    fn send_ask<M: Message<P>>(
        &self,
        region: &Region,
        msg: M,
        (deadline, timeout): (tokio::time::Instant, Duration),
        extras: Option<Box<Extras>>,
    ) -> ShardingResult<(oneshot::Receiver<ShardingResult<M::Reply>>, bool)> {
        let (reply, replied) = oneshot::channel();
        let mut envelope = envelope_of::<P, M>(msg, Some(reply));
        envelope.set_extras(extras);
        envelope.set_guarded();
        if region.durable() {
            envelope.set_deadline(deadline);
        }
        let guarded =
            region.deliver_ask(self.shard, &self.entity_id, envelope, (deadline, timeout))?;
        Ok((replied, guarded))
    }

    /// Passivates the entity now: messages already sent to it are still
    /// handled by the current incarnation; messages sent after this returns
    /// go to a fresh one. Does nothing if the entity is not live.
    pub async fn passivate(&self) -> ShardingResult<()> {
        let region = self.region()?;
        region.passivate(self.shard, &self.entity_id, None)
    }
}

#[cfg(test)]
mod finishing_tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use serde::{Deserialize, Serialize};

    use crate::cluster::{ClusterConfig, ClusterNode};
    use crate::entity::{Entity, EntityContext, Handler};
    use crate::error::ShardingResult;
    use crate::extractor::ShardId;
    use crate::identity::{NodeId, UniqueAddress};
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
        let generation = region.generation_of(shard) + 1;
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
}
