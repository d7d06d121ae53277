//! Building a region: what it needs of its protocol and how it spawns
//! entities, its optional settings, and its fixed parts.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use ractor::ActorRef;

use super::{MigrationSettings, Region, RegionCluster, ShardTable};
use crate::entity::{EntityContext, MigratedState};
use crate::model::config::EntityLimit;
use crate::model::envelope::{LocalEnvelope, RemoteReply, Undecodable};
use crate::model::error::ShardingError;
use crate::model::extractor::ShardId;
use crate::ops::telemetry::RegionMetrics;
use crate::persistence::remember::writer::Remember;
use crate::runtime::mailbox::{EntityMsg, RegionMsg};

/// Spawns one entity actor (type-erased over the entity type): its context,
/// its incarnation number, the region actor to notify, and the state it
/// starts from if one migrated with its shard.
pub(crate) type Spawner = Box<
    dyn Fn(
            EntityContext,
            u64,
            ActorRef<RegionMsg>,
            Option<MigratedState>,
        ) -> Result<ActorRef<EntityMsg>, ShardingError>
        + Send
        + Sync,
>;

/// Decodes one message of the region's protocol that came from another node.
pub(crate) type DecodeFn =
    fn(u16, &[u8], Option<RemoteReply>, u8) -> Result<LocalEnvelope, Box<Undecodable>>;

/// What a region needs to know of its protocol.
pub(crate) struct RegionProtocol {
    pub(crate) type_name: &'static str,
    pub(crate) id: std::any::TypeId,
    pub(crate) fingerprint: u64,
    /// Its fingerprint up to each line (`Protocol::LINES`).
    pub(crate) lines: &'static [u64],
    pub(crate) decode: DecodeFn,
    pub(crate) extract: ExtractFn,
}

/// The protocol's shard extractor: entity id and shard count to shard.
pub(crate) type ExtractFn = fn(&str, u32) -> ShardId;

impl Region {
    pub(crate) fn new(
        protocol: RegionProtocol,
        num_shards: u32,
        buffer_cap: usize,
        spawner: Spawner,
        remember: Option<Arc<Remember>>,
        shutdown_timeout: Duration,
        cluster: Option<RegionCluster>,
    ) -> Self {
        let table = ShardTable::new(
            num_shards,
            cluster.as_ref().map(|c| c.me),
            cluster.as_ref().is_some_and(|c| c.proxy),
        );
        let node = cluster
            .as_ref()
            .map_or_else(|| "local".to_owned(), |c| c.me.addr.to_string());
        Region {
            type_name: protocol.type_name,
            protocol: protocol.id,
            fingerprint: protocol.fingerprint,
            lines: protocol.lines,
            decode: protocol.decode,
            extract: protocol.extract,
            cluster,
            buffer_cap,
            table,
            spawner,
            region_actor: OnceLock::new(),
            remember,
            shutdown_timeout,
            refused: AtomicBool::new(false),
            refusal: Mutex::new(None),
            asked_newer: Mutex::default(),
            accepted_by: Mutex::new(None),
            tracing: None,
            passivated: Default::default(),
            migration: None,
            metrics: RegionMetrics::new(protocol.type_name, node),
            durable: false,
        }
    }

    /// The region of a migratable type (`None`: not migratable).
    pub(crate) fn with_migration(self, migration: Option<MigrationSettings>) -> Self {
        let keeping = migration.as_ref().map(MigrationSettings::keeping);
        Region {
            migration,
            table: self.table.with_keeping(keeping),
            ..self
        }
    }

    /// Marks a durable type's region (see `durable`).
    pub(crate) fn with_durable(mut self, durable: bool) -> Self {
        self.durable = durable;
        self
    }

    /// Its entities keep their state in a store.
    pub(crate) fn durable(&self) -> bool {
        self.durable
    }

    /// Tracing across nodes, when the system's configuration has it.
    pub(crate) fn with_tracing(self, tracing: Option<crate::ops::telemetry::Tracing>) -> Self {
        Region { tracing, ..self }
    }

    /// The system's tracing, if on.
    pub(crate) fn tracing(&self) -> Option<&crate::ops::telemetry::Tracing> {
        self.tracing.as_ref()
    }

    /// The region with an active-entity limit (`None`: none).
    pub(crate) fn with_entity_limit(self, entity_limit: Option<EntityLimit>) -> Self {
        Region {
            table: self.table.with_entity_limit(entity_limit),
            ..self
        }
    }

    pub(crate) fn num_shards(&self) -> u32 {
        self.table.num_shards()
    }

    /// Its shards.
    pub(crate) fn table(&self) -> &ShardTable<ActorRef<EntityMsg>> {
        &self.table
    }

    /// The remember-entities queue, for a remembered type.
    pub(crate) fn remember(&self) -> Option<&Arc<Remember>> {
        self.remember.as_ref()
    }
}
