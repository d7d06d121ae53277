//! Building a system: [`ShardedSystemBuilder`], its settings, and `start`,
//! which validates the configuration, links the system to its cluster node
//! (if any) and starts its tasks.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use super::{ShardedSystem, Shared};
use crate::cluster::ClusterNode;
use crate::model::config::ShardingConfig;
use crate::model::error::ShardingResult;
use crate::persistence::remember::{NoStore, RememberEntitiesStore};
use crate::persistence::{Journal, NoJournal};
use crate::runtime::ask_waits::{AskWaits, keep_deadlines};
use crate::runtime::traffic::TrafficCounts;
use crate::sharding::coordinator::{CoordinatorConfig, ShardAllocationStrategy};
use crate::sharding::driver::{ClusterLink, SystemPort};
use crate::util::fast_hash::FastMap;

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
        // Only a cluster places by traffic.
        let counting = self.node.is_some() && self.config.placement_by_traffic.is_some();
        let traffic = Arc::new(TrafficCounts::new(counting));
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
                    placement_by_traffic: self.config.placement_by_traffic,
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
            traffic,
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
