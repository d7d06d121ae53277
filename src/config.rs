//! Sharding settings, with the guide's names and defaults.

use std::time::Duration;

use typed_builder::TypedBuilder;

use crate::error::{ShardingError, ShardingResult};

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
    /// At most this many shards moved per rebalance round to spread load
    /// (moves away from dead owners are never capped). Used in cluster mode.
    #[builder(default = 3)]
    pub rebalance_per_round: usize,
    /// How long a region waits after a handoff completes before draining the
    /// buffered messages to the shard's new home. Used in cluster mode.
    #[builder(default = Duration::from_millis(10))]
    pub handoff_drain_delay: Duration,
    /// An entity with no message for this long is passivated; `None` disables
    /// idle passivation.
    #[builder(default = Some(Duration::from_secs(120)))]
    pub passivation_idle_timeout: Option<Duration>,
    /// How long `shutdown()` lets entities finish the message in hand.
    #[builder(default = Duration::from_secs(5))]
    pub shutdown_timeout: Duration,
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
        if self.passivation_idle_timeout == Some(Duration::ZERO) {
            return Err(ShardingError::InvalidConfig(
                "passivation_idle_timeout must be positive (use None to disable)".into(),
            ));
        }
        Ok(())
    }
}
