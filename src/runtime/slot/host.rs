//! What a slot asks of its host, and what it hands back: the
//! [`SlotHost`] its transitions act through, the [`ShardHome`] a shard is
//! routed to, and the results of a delivery or of a new home.

use std::sync::Arc;

use crate::entity::MigratedState;
use crate::model::config::PassivationPolicy;
use crate::model::envelope::LocalEnvelope;
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::persistence::remember::RememberEntitiesOperation;

/// Where a shard lives, and which allocation of it this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardHome {
    /// The node that hosts the shard.
    pub owner: UniqueAddress,
    /// The allocation generation: grows with every allocation of the shard.
    pub generation: u64,
}

/// What a slot's transitions do outside the slot. `Entity` is a handle on
/// one incarnation's mailbox.
pub(crate) trait SlotHost {
    /// One incarnation's mailbox.
    type Entity: Clone;

    /// The entity type's name, for errors and logs.
    fn type_name(&self) -> &'static str;
    /// How many messages a buffer holds before it overflows.
    fn buffer_cap(&self) -> usize;
    /// Whether the coordinator refused the region (cheap: an atomic load).
    fn refused(&self) -> bool;
    /// Why it refused the region.
    fn refusal(&self) -> Option<ShardingError>;
    /// Whether the type remembers its entities.
    fn remembers(&self) -> bool;
    /// The store's state for `shard`: an error under FailClosed after a
    /// failed write.
    fn check_store(&self, shard: ShardId) -> ShardingResult<()>;
    /// Starts incarnation `incarnation` of `entity_id`, in the shard's
    /// hosting of allocation `generation` (its stop notice and passivation
    /// requests come back to the slot, naming it), from `state` if one
    /// migrated with the shard.
    fn spawn(
        &mut self,
        shard: ShardId,
        generation: u64,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> ShardingResult<Self::Entity>;
    /// Enqueues into a mailbox. `Err(Some)` gives the envelope back (the
    /// entity is gone); `Err(None)`: the mailbox dropped it.
    fn send(
        &mut self,
        entity: &Self::Entity,
        envelope: LocalEnvelope,
    ) -> Result<(), Option<LocalEnvelope>>;
    /// Queues a stop marker behind the mailbox; false if the entity is gone.
    fn stop(&mut self, entity: &Self::Entity) -> bool;
    /// As [`stop`](Self::stop), for a handoff: a migratable entity hands
    /// its state over with its stop notice.
    fn stop_to_move(&mut self, entity: &Self::Entity) -> bool;
    /// Queues a record for the remember-entities store (nothing for a type
    /// that does not remember).
    fn record(&mut self, shard: ShardId, entity_id: &Arc<str>, op: RememberEntitiesOperation);
    /// How many remembered ids one respawn batch starts.
    fn respawn_batch(&self) -> usize;
    /// Has [`Slot::respawn_more`] called for `install` after the respawn
    /// interval.
    fn respawn_later(&mut self, shard: ShardId, install: u64);
    /// Sends an envelope to the shard's home on another node. On
    /// `Err((_, None))` the envelope has been answered already.
    fn forward(
        &mut self,
        home: ShardHome,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), (ShardingError, Option<LocalEnvelope>)>;
    /// Sends a passivation request to the node hosting the shard.
    fn passivate_at(
        &mut self,
        owner: UniqueAddress,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<()>;
    /// Asks for the shard's allocation; false if it could not be asked (the
    /// next message asks again).
    fn request_allocation(&mut self, shard: ShardId) -> bool;
    /// Reports that a handed-off shard has no entity left.
    fn shard_stopped(&mut self, shard: ShardId, generation: u64);
    /// Of a type with an active-entity limit: each hosted shard's share of
    /// it now, and the policy.
    fn entity_share(&self) -> Option<(usize, PassivationPolicy)>;
    /// A live entity began passivating: `by_limit` to keep its shard
    /// within its share, else on a request (the host knows whose).
    fn passivated(&mut self, shard: ShardId, by_limit: bool);
}

/// Messages that could not be delivered, to be failed once the lock is released.
pub(crate) type Undelivered = Vec<(ShardingError, LocalEnvelope)>;

/// A delivery's failure: the error, and the envelope unless it has been
/// answered already.
pub(crate) type Refused = (ShardingError, Option<LocalEnvelope>);

/// What applying a shard's home did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HomeChange {
    /// Nothing to do: known already.
    Unchanged,
    /// Older than what the region holds: ignored.
    Stale,
    /// Now routed to another node.
    Remote,
    /// This node is the new home: the region actor must start the shard
    /// (messages buffer meanwhile).
    HostHere,
}
