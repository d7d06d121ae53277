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
mod preparing;
mod report;
mod routing;
mod setup;
mod stop;
mod table;

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ractor::ActorRef;

pub(crate) use cluster::{ClusterPort, PortFuture, RegionCluster};
pub(crate) use migration::{MigrationSettings, drop_off_async};
pub(crate) use preparing::{HostStep, HostWord, Preparing, StatesPull};
pub(crate) use report::PassivationCause;
pub use report::{Passivations, ShardPlacement, ShardRegionState};
pub(crate) use setup::{DecodeFn, ExtractFn, RegionProtocol, Spawner};
pub(crate) use table::{ChunkAnswer, Keeping, RegionHost, ShardTable};

use crate::model::error::ShardingError;
use crate::ops::telemetry::RegionMetrics;
use crate::persistence::remember::writer::Remember;
use crate::runtime::mailbox::{EntityMsg, RegionMsg};

pub(crate) struct Region {
    pub(crate) type_name: &'static str,
    pub(crate) protocol: std::any::TypeId,
    /// The protocol's fingerprint (what it registers with).
    pub(crate) fingerprint: u64,
    /// The protocol's fingerprint up to each of its lines: an envelope
    /// carries its own line's, and is checked against it.
    pub(crate) lines: &'static [u64],
    /// The protocol's decoder for remote envelopes.
    pub(crate) decode: DecodeFn,
    /// The protocol's extractor, to check the shard a remote envelope names.
    pub(crate) extract: ExtractFn,
    cluster: Option<RegionCluster>,
    buffer_cap: usize,
    /// Its shards: every rule around their slots.
    table: ShardTable<ActorRef<EntityMsg>>,
    spawner: Spawner,
    pub(crate) region_actor: OnceLock<ActorRef<RegionMsg>>,
    remember: Option<Arc<Remember>>,
    shutdown_timeout: Duration,
    /// The coordinator refused this region (`ShardingError::RegionRefused`):
    /// every message fails with it until a coordinator accepts the region.
    refused: AtomicBool,
    refusal: Mutex<Option<ShardingError>>,
    /// When each shard last asked to move to a node of a newer protocol
    /// version: at most once a second (a producer of a line this version
    /// lacks must not flood the control channel).
    asked_newer: Mutex<std::collections::BTreeMap<u32, std::time::Instant>>,
    /// The coordinator whose table last came for this region.
    accepted_by: Mutex<Option<crate::model::identity::UniqueAddress>>,
    /// Tracing across nodes (SPEC §14.2), if on.
    tracing: Option<crate::ops::telemetry::Tracing>,
    /// Passivations of live entities so far, by cause.
    passivated: [AtomicU64; 3],
    /// Of a migratable type on a cluster: its settings.
    migration: Option<MigrationSettings>,
    /// Its handles for the `metrics` facade.
    pub(crate) metrics: RegionMetrics,
    /// Its entities keep their state in a store (event-sourced or durable
    /// state): asks carry their deadline to the store calls (SPEC §8b).
    durable: bool,
}
