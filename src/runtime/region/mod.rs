//! One entity type's routing table: a slot per shard.
//!
//! A [`Region`] is this node's share of one entity type: it routes each
//! message through its shard's slot, hosts shards and starts their
//! entities, hands shards off, reports its state, and reaches the rest of
//! the cluster through its port.

mod cluster;
mod homes;
mod host;
mod hosting;
mod migration;
mod report;
mod routing;
mod setup;
mod stop;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use ractor::ActorRef;

pub(crate) use cluster::{ClusterPort, PortFuture, RegionCluster};
pub(crate) use migration::{ChunkAnswer, MigrationSettings};
pub(crate) use report::PassivationCause;
pub use report::{Passivations, ShardPlacement, ShardRegionState};
pub(crate) use setup::{DecodeFn, ExtractFn, RegionProtocol, Spawner};

use crate::model::config::EntityLimit;
use crate::model::error::ShardingError;
use crate::ops::telemetry::RegionMetrics;
use crate::persistence::remember::writer::Remember;
use crate::runtime::mailbox::{EntityMsg, RegionMsg};
use crate::runtime::slot::{Slot, Undelivered};
use migration::Outgoing;

pub(crate) struct Region {
    pub(crate) type_name: &'static str,
    pub(crate) protocol: std::any::TypeId,
    /// The protocol's fingerprint, checked against every remote envelope.
    pub(crate) fingerprint: u64,
    /// The protocol's decoder for remote envelopes.
    pub(crate) decode: DecodeFn,
    /// The protocol's extractor, to check the shard a remote envelope names.
    pub(crate) extract: ExtractFn,
    cluster: Option<RegionCluster>,
    buffer_cap: usize,
    slots: Box<[Mutex<EntitySlot>]>,
    spawner: Spawner,
    pub(crate) region_actor: OnceLock<ActorRef<RegionMsg>>,
    stopped: AtomicBool,
    /// Leaving, the coordinator said nothing more of this type will move off
    /// this node; and whether that is because there is nowhere to move it.
    left: AtomicBool,
    nowhere: AtomicBool,
    /// Counts the hostings of shards here (a respawn batch names the
    /// hosting it belongs to).
    installs: std::sync::atomic::AtomicU64,
    remember: Option<Arc<Remember>>,
    shutdown_timeout: Duration,
    /// The coordinator refused this region (`ShardingError::RegionRefused`):
    /// every message fails with it until a coordinator accepts the region.
    refused: AtomicBool,
    refusal: Mutex<Option<ShardingError>>,
    /// The coordinator whose table last came for this region.
    accepted_by: Mutex<Option<crate::model::identity::UniqueAddress>>,
    /// Tracing across nodes (SPEC §14.2), if on.
    tracing: Option<crate::ops::telemetry::Tracing>,
    /// The active-entity limit (none for a remembered type).
    entity_limit: Option<EntityLimit>,
    /// The shards hosted here (installed and not moved away), over which
    /// the limit is shared: a new share visits them alone. Kept by
    /// [`Region::count_hosted`] only.
    hosted_shards: Mutex<std::collections::BTreeSet<u32>>,
    /// Their number, read by every start without the lock.
    hosted: AtomicUsize,
    /// Passivations of live entities so far, by cause.
    passivated: [AtomicU64; 3],
    /// Of a migratable type on a cluster: its settings.
    migration: Option<MigrationSettings>,
    /// States kept for the nodes shards moved to, by shard.
    outgoing: Mutex<std::collections::HashMap<u32, Outgoing>>,
    /// Its handles for the `metrics` facade.
    pub(crate) metrics: RegionMetrics,
    /// Its entities keep their state in a store (event-sourced or durable
    /// state): asks carry their deadline to the store calls (SPEC §8b).
    durable: bool,
}

/// A slot of this runtime: entities and shards are ractor actors.
type EntitySlot = Slot<ActorRef<EntityMsg>>;

/// Locks a slot. No code panics while holding it, so a poisoned lock (a
/// panic elsewhere in the thread) still guards consistent data.
fn lock(slot: &Mutex<EntitySlot>) -> MutexGuard<'_, EntitySlot> {
    slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Answers the senders of undelivered messages (outside any shard lock, so a
/// message's `Drop` never runs under it).
fn fail_undelivered(undelivered: Undelivered) {
    for (error, envelope) in undelivered {
        envelope.fail(error);
    }
}
