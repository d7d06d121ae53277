//! What the runtime's actors receive: an entity's mailbox and its
//! region's. Apart from the actors, so that the region, which sends into
//! both, and the actors, which handle them, do not import each other.

use std::sync::Arc;

use crate::envelope::LocalEnvelope;
use crate::extractor::ShardId;

/// What an entity actor receives.
#[derive(Debug)]
pub(crate) enum EntityMsg {
    /// A message for the entity's handler.
    Deliver(LocalEnvelope),
    /// Time to check whether the entity has been idle long enough to passivate.
    IdleCheck,
    /// Stop once everything queued before this marker is handled (passivation).
    Stop,
}

/// What a region actor receives.
#[derive(Debug)]
pub(crate) enum RegionMsg {
    /// A shard has buffered messages and no home: allocate it here (single node).
    Allocate(ShardId),
    /// The coordinator made this node the shard's home under `generation`.
    Host(ShardId, u64),
    /// A shard's remembered ids have been read (`None`: not remembered, or
    /// the read failed): start hosting it.
    Install {
        shard: ShardId,
        generation: u64,
        remembered: Option<Vec<String>>,
    },
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
    /// An entity incarnation ended.
    EntityStopped {
        shard: ShardId,
        entity_id: Arc<str>,
        incarnation: u64,
    },
}
