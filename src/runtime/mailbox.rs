//! What the runtime's actors receive: an entity's mailbox and its
//! region's. Apart from the actors, so that the region, which sends into
//! both, and the actors, which handle them, do not import each other.

use std::sync::Arc;

use crate::entity::MigratedState;
use crate::model::envelope::LocalEnvelope;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;

/// Migrated states of one shard's entities, by entity id.
pub(crate) type States = Vec<(Arc<str>, MigratedState)>;

/// What an entity actor receives.
#[derive(Debug)]
pub(crate) enum EntityMsg {
    /// A message for the entity's handler.
    Deliver(LocalEnvelope),
    /// Time to check whether the entity has been idle long enough to passivate.
    IdleCheck,
    /// Stop once everything queued before this marker is handled (passivation).
    Stop,
    /// As `Stop`, for a graceful move of the entity's shard: a migratable
    /// entity hands its dehydrated state over with its stop notice.
    StopToMove,
}

/// What a region actor receives.
#[derive(Debug)]
pub(crate) enum RegionMsg {
    /// A shard has buffered messages and no home: allocate it here (single node).
    Allocate(ShardId),
    /// The coordinator made this node the shard's home under `generation`;
    /// `from`: the old owner that stopped it by a handoff (its entities'
    /// states may follow).
    Host {
        shard: ShardId,
        generation: u64,
        from: Option<UniqueAddress>,
    },
    /// A shard's remembered ids have been read (`None`: not remembered, or
    /// the read failed), and the states migrated with it fetched: start
    /// hosting it.
    Install {
        shard: ShardId,
        generation: u64,
        remembered: Option<Vec<String>>,
        migrated: States,
        /// The node the states came from, and their encoded size.
        fetched: Option<(UniqueAddress, usize)>,
    },
    /// The states a handoff took from a shard, kept for its new owner to
    /// fetch, are dropped if still here (that owner never came for them).
    ExpireMigration { shard: ShardId, generation: u64 },
    /// Respawn the next remembered ids of a shard (a bounded-rate
    /// recovery), if it is still the same hosting of it.
    Respawn { shard: ShardId, install: u64 },
    /// An entity incarnation asks to be passivated: `idle`, or asked
    /// (`ctx.passivate()`, or it retired itself).
    Passivate {
        shard: ShardId,
        entity_id: Arc<str>,
        incarnation: u64,
        idle: bool,
    },
    /// An entity incarnation ended; `state`: the one it handed over,
    /// stopped to move.
    EntityStopped {
        shard: ShardId,
        entity_id: Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    },
}
