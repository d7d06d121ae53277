//! Sharding settings, with the guide's names and defaults.

use std::time::Duration;

use typed_builder::TypedBuilder;

use crate::model::error::{ShardingError, ShardingResult};

/// The largest shard count accepted: each shard has a slot in every region.
pub const MAX_SHARDS: u32 = 65_536;

/// Settings of a sharded system. Build with [`ShardingConfig::builder`] or
/// start from [`ShardingConfig::default`].
///
/// ```
/// use std::time::Duration;
/// use datum_cluster_sharding::ShardingConfig;
/// let config = ShardingConfig::builder()
///     .num_shards(64)
///     .passivation_idle_timeout(Some(Duration::from_secs(30)))
///     .build();
/// assert_eq!(config.allocation_buffer, 10_000);
/// ```
#[derive(Debug, Clone, TypedBuilder)]
#[non_exhaustive]
pub struct ShardingConfig {
    /// How many shards the id space is cut into; fixed for the system's life.
    #[builder(default = 128)]
    pub num_shards: u32,
    /// How many messages a shard buffers while it has no home yet or while one
    /// of its entities passivates; more fail with `BufferOverflow`.
    #[builder(default = 10_000)]
    pub allocation_buffer: usize,
    /// At most this many shards of a type start moving per rebalance round
    /// to spread load (moves away from dead or leaving owners are never
    /// capped). Used in cluster mode, by the coordinator.
    #[builder(default = 3)]
    pub rebalance_per_round: usize,
    /// How often the coordinator asks its allocation strategy whether live
    /// shards should move to spread load. Used in cluster mode.
    #[builder(default = Duration::from_secs(2))]
    pub rebalance_interval: Duration,
    /// A handoff whose old owner has not reported the shard stopped after
    /// this long completes as a DeadOwner move; a gracefully leaving node
    /// waits at most this long (plus a second) for its shards to move.
    /// Used in cluster mode.
    #[builder(default = Duration::from_secs(10))]
    pub handoff_timeout: Duration,
    /// Of a migratable type (`.migratable()`): how long a shard's
    /// new owner waits for the states its entities handed over on the old
    /// one (its messages wait meanwhile) before it starts them from the
    /// factory; the old owner keeps them twice as long. Used in cluster
    /// mode.
    #[builder(default = Duration::from_secs(5))]
    pub migration_timeout: Duration,
    /// How long the coordinator waits, after a member is gone (downed or
    /// removed), before it reallocates that member's shards: time for a node
    /// on the losing side of a partition to stop its entities first. `None`
    /// (the default): none with timeout downing, the cluster's
    /// `stable_after` plus its failure timeout with a split-brain resolver.
    /// Used in cluster mode.
    #[builder(default)]
    pub down_removal_margin: Option<Duration>,
    /// An entity with no message for this long is passivated; `None` disables
    /// idle passivation.
    #[builder(default = Some(Duration::from_secs(120)))]
    pub passivation_idle_timeout: Option<Duration>,
    /// At most this many live entities per region (of each entity type on
    /// this node), shared over its hosted shards; a new entity beyond a
    /// shard's share passivates the one the policy picks. `None` (the
    /// default): no limit. Not applied to remembered types.
    #[builder(default)]
    pub entity_limit: Option<EntityLimit>,
    /// How long `shutdown()` lets entities finish the message in hand (and
    /// the entities of a shard that moved away finish their mailboxes).
    #[builder(default = Duration::from_secs(5))]
    pub shutdown_timeout: Duration,
    /// The remember-entities write-behind queue and failure policy (used by
    /// types registered `.remembered()`).
    #[builder(default)]
    pub remember_entities: RememberEntitiesConfig,
    /// Tracing across nodes (SPEC §14.2): with it, every tell and ask has a
    /// span (`datum.tell`, `datum.ask`) and its handling one
    /// (`datum.handle`) in the same trace, the trace context carried to
    /// other nodes in the envelope. `None` (the default): no spans, nothing
    /// carried.
    #[builder(default, setter(strip_option))]
    pub tracing: Option<crate::ops::telemetry::Tracing>,
    /// Placement by traffic (SPEC §13.11): regions count which shards
    /// their entities send to, and the coordinator moves shards toward
    /// the nodes that talk to them, within the count balance. `None` (the
    /// default): shards are placed by count alone. Set it on every node:
    /// a node counts when its own config has it, and the acting
    /// coordinator moves shards when its own does. Used in cluster mode.
    #[builder(default, setter(strip_option))]
    pub placement_by_traffic: Option<PlacementByTraffic>,
}

/// Placement by traffic (SPEC §13.11): one message in this many that an
/// entity's handling sends to another shard is counted, weighing this
/// much; the coordinator's rule asks a move to stand out of the noise
/// such sampling makes.
pub(crate) const TRAFFIC_SAMPLE_WEIGHT: u64 = 8;

/// Placement by traffic (SPEC §13.11): how far the coordinator goes to
/// put shards that talk to each other on one node. Build with
/// [`PlacementByTraffic::default`] and the `with_` methods.
///
/// ```
/// use datum_cluster_sharding::{PlacementByTraffic, ShardingConfig};
/// let config = ShardingConfig::builder()
///     .placement_by_traffic(PlacementByTraffic::default().with_max_moves(4))
///     .build();
/// assert_eq!(config.placement_by_traffic.map(|p| p.slack), Some(2));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlacementByTraffic {
    /// The most shards (of all types together) a round moves for
    /// traffic.
    pub max_moves: usize,
    /// How far apart a type's shard counts per node may be after a move
    /// for traffic; the count rebalance leaves a spread this small alone.
    pub slack: usize,
    /// The least gain worth a move: messages kept on one node, as the
    /// samples estimate them, summed over recent rounds (the counts halve
    /// each round, so with steady traffic they hold about twice a
    /// round's). The noise rule alone asks more than 128 of a shard whose
    /// pull toward home is nothing (SPEC §13.11), so a value below that
    /// changes nothing.
    pub min_gain: u64,
    /// How much stronger, in percent, a shard's pull toward another node
    /// must be than its pull toward its own before it moves (the
    /// hysteresis that keeps shards from going back and forth).
    pub margin_pct: u64,
}

impl Default for PlacementByTraffic {
    fn default() -> Self {
        PlacementByTraffic {
            max_moves: 8,
            slack: 2,
            min_gain: 128,
            margin_pct: 20,
        }
    }
}

impl PlacementByTraffic {
    /// The same, with at most `max_moves` moves per round.
    pub fn with_max_moves(self, max_moves: usize) -> Self {
        PlacementByTraffic { max_moves, ..self }
    }

    /// The same, with counts per node allowed `slack` apart.
    pub fn with_slack(self, slack: usize) -> Self {
        PlacementByTraffic { slack, ..self }
    }

    /// The same, with moves that keep fewer than `min_gain` messages on
    /// one node refused.
    pub fn with_min_gain(self, min_gain: u64) -> Self {
        PlacementByTraffic { min_gain, ..self }
    }

    /// The same, with a pull away `margin_pct` percent stronger than the
    /// pull home needed for a move.
    pub fn with_margin_pct(self, margin_pct: u64) -> Self {
        PlacementByTraffic { margin_pct, ..self }
    }
}

/// Passivation by an active-entity limit (SPEC §6.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntityLimit {
    /// Live entities a region may hold; each hosted shard may hold this
    /// divided by the number of hosted shards (at least one).
    pub max_live: usize,
    /// Which entity makes room for a new one.
    pub policy: PassivationPolicy,
}

impl EntityLimit {
    /// `max_live` entities per region, under the default policy.
    pub fn new(max_live: usize) -> Self {
        EntityLimit {
            max_live,
            policy: PassivationPolicy::default(),
        }
    }

    /// The same limit under `policy`.
    pub fn with_policy(self, policy: PassivationPolicy) -> Self {
        EntityLimit { policy, ..self }
    }
}

/// Which live entity a shard at its share passivates for a new one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PassivationPolicy {
    /// The one whose last message is oldest.
    LeastRecentlyUsed,
    /// Least recently used among the entities seen once since they
    /// started, before any seen again (which keep 80 % of the share).
    SegmentedLru,
    /// W-TinyLFU: new entities wait in a small window; the window's oldest
    /// and the main area's victim compete by recent access frequency.
    /// Best on skewed loads with scans.
    #[default]
    WTinyLfu,
}

/// What a remember-entities store failure does to routing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RememberEntitiesFailurePolicy {
    /// Keep routing; publish the failure as an event (the default).
    #[default]
    FailOpen,
    /// Mark the shard failed: its messages fail with
    /// `ShardingError::RememberEntities` from then on; publish the event.
    FailClosed,
}

/// What a record does that finds the write-behind queue full.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RememberEntitiesQueueFull {
    /// Nothing is dropped: the record is queued all the same, and a local
    /// sender of a message to a remembered type waits for the queue to
    /// have room again before its message goes (an ask within its timeout,
    /// a tell within `full_queue_wait`), so a burst of new entities runs at
    /// the store's pace (the default; Akka's stores back-pressure too).
    #[default]
    BackPressure,
    /// The record is dropped and reported as a failure (`failure_policy`):
    /// senders never wait, and an application must check its flushes.
    Drop,
}

/// Remember-entities settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RememberEntitiesConfig {
    /// Records waiting for the store before the queue counts as full.
    pub queue_capacity: usize,
    /// What a full queue does.
    pub when_full: RememberEntitiesQueueFull,
    /// Under `BackPressure`, how long a tell waits for room at most (an
    /// ask waits at most its own timeout); past it the message fails with
    /// `ShardingError::RememberEntities`.
    pub full_queue_wait: Duration,
    /// What a failed (or dropped) record does.
    pub failure_policy: RememberEntitiesFailurePolicy,
    /// When a shard starts, how many of its remembered ids are respawned at
    /// once; the next as many follow every `respawn_interval`.
    pub respawn_batch: usize,
    /// The pause between two respawn batches of one shard.
    pub respawn_interval: Duration,
}

impl Default for RememberEntitiesConfig {
    fn default() -> Self {
        RememberEntitiesConfig {
            queue_capacity: 10_000,
            when_full: RememberEntitiesQueueFull::BackPressure,
            full_queue_wait: Duration::from_secs(10),
            failure_policy: RememberEntitiesFailurePolicy::FailOpen,
            respawn_batch: 1_000,
            respawn_interval: Duration::from_millis(100),
        }
    }
}

impl RememberEntitiesConfig {
    /// The defaults with another queue capacity.
    pub fn with_queue_capacity(mut self, queue_capacity: usize) -> Self {
        self.queue_capacity = queue_capacity;
        self
    }

    /// With another full-queue rule.
    pub fn with_when_full(mut self, when_full: RememberEntitiesQueueFull) -> Self {
        self.when_full = when_full;
        self
    }

    /// With another longest wait of a tell for room (under `BackPressure`).
    pub fn with_full_queue_wait(mut self, full_queue_wait: Duration) -> Self {
        self.full_queue_wait = full_queue_wait;
        self
    }

    /// With another respawn rate: `batch` ids per `interval` per shard.
    pub fn with_respawn_rate(mut self, batch: usize, interval: Duration) -> Self {
        self.respawn_batch = batch;
        self.respawn_interval = interval;
        self
    }

    /// The defaults with another failure policy.
    pub fn with_failure_policy(mut self, failure_policy: RememberEntitiesFailurePolicy) -> Self {
        self.failure_policy = failure_policy;
        self
    }
}

impl Default for ShardingConfig {
    fn default() -> Self {
        ShardingConfig::builder().build()
    }
}

impl ShardingConfig {
    /// Checks the settings; the error says which one is wrong.
    pub fn validate(&self) -> ShardingResult<()> {
        if self.num_shards == 0 || self.num_shards > MAX_SHARDS {
            return Err(ShardingError::InvalidConfig(format!(
                "num_shards must be in 1..={MAX_SHARDS}, not {}",
                self.num_shards
            )));
        }
        if self.allocation_buffer == 0 {
            return Err(ShardingError::InvalidConfig(
                "allocation_buffer must be at least 1: the first message to a shard waits in it"
                    .into(),
            ));
        }
        if self.remember_entities.respawn_batch == 0 {
            return Err(ShardingError::InvalidConfig(
                "remember_entities.respawn_batch must be at least 1".into(),
            ));
        }
        if self.remember_entities.queue_capacity == 0
            || self.remember_entities.queue_capacity > 10_000_000
        {
            return Err(ShardingError::InvalidConfig(
                "remember_entities.queue_capacity must be in 1..=10,000,000".into(),
            ));
        }
        if let Some(limit) = self.entity_limit {
            if limit.max_live == 0 {
                return Err(ShardingError::InvalidConfig(
                    "entity_limit must allow at least one live entity".into(),
                ));
            }
            if (limit.max_live as u64) < u64::from(self.num_shards) {
                // Every shard keeps a share of at least one, so a node
                // hosting every shard can hold up to num_shards.
                tracing::warn!(
                    max_live = limit.max_live,
                    num_shards = self.num_shards,
                    "entity_limit is below num_shards: a region hosting every shard may hold one entity per shard"
                );
            }
        }
        if self.rebalance_interval.is_zero()
            || self.handoff_timeout.is_zero()
            || self.migration_timeout.is_zero()
        {
            return Err(ShardingError::InvalidConfig(
                "rebalance_interval, handoff_timeout and migration_timeout must be positive".into(),
            ));
        }
        if self.placement_by_traffic.is_some_and(|p| p.max_moves == 0) {
            return Err(ShardingError::InvalidConfig(
                "placement_by_traffic.max_moves must be at least 1 (use None to turn it off)"
                    .into(),
            ));
        }
        if self.passivation_idle_timeout == Some(Duration::ZERO) {
            return Err(ShardingError::InvalidConfig(
                "passivation_idle_timeout must be positive (use None to disable)".into(),
            ));
        }
        Ok(())
    }
}
