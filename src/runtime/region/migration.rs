//! State migration on the old owner's side: its settings, and the states a
//! handoff took from a shard's entities, kept in chunks for the node the
//! shard moved to until it fetches them or they expire.

use std::sync::MutexGuard;
use std::time::Duration;

use super::{Region, lock};
use crate::entity::MigrationEvent;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::entity_actor::MigrationEvents;
use crate::runtime::mailbox::{RegionMsg, States};
use crate::runtime::slot::ShardHome;

/// The largest migrated states chunk a pull is answered with (a state
/// larger than it travels alone).
pub(crate) const MIGRATION_CHUNK: usize = 256 * 1024;

/// What a handoff took from one shard's entities, kept for the node the
/// shard moved to until it has fetched them (or for the migration
/// timeout).
pub(super) struct Outgoing {
    home: ShardHome,
    /// The states, cut into chunks of about [`MIGRATION_CHUNK`] (at least
    /// one, maybe empty).
    chunks: Vec<States>,
}

/// The answer to a pull for one chunk of a shard's migrated states.
#[derive(Debug)]
pub(crate) enum ChunkAnswer {
    /// Chunk `index` of them; `last`: nothing follows.
    Chunk { states: States, last: bool },
    /// The shard has not moved on from here yet (this node has not applied
    /// its new home): ask again.
    NotYet,
    /// None here for that node and allocation.
    Nothing(&'static str),
}

/// The migration settings of a region of a migratable type.
pub(crate) struct MigrationSettings {
    /// How long a new owner waits for the states, and an old one keeps
    /// them for it.
    pub(crate) timeout: Duration,
    /// The largest state that can travel (a frame's payload, less room
    /// for its chunk's framing): a larger one is dropped.
    pub(crate) max_state: usize,
    pub(crate) events: MigrationEvents,
}

impl Region {
    /// How long a new owner waits for migrated states, if the type migrates.
    pub(crate) fn migration_timeout(&self) -> Option<Duration> {
        self.migration.as_ref().map(|m| m.timeout)
    }

    fn outgoing(&self) -> MutexGuard<'_, std::collections::HashMap<u32, Outgoing>> {
        self.outgoing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps the states `shard`'s entities handed over for its new `home`,
    /// in chunks, until it fetches them or the migration timeout ends.
    pub(super) fn keep_outgoing(&self, shard: ShardId, home: ShardHome, states: States) {
        let Some(settings) = &self.migration else {
            return;
        };
        let mut chunks: Vec<States> = vec![Vec::new()];
        let mut size = 0;
        let chunk = MIGRATION_CHUNK.min(settings.max_state);
        for (id, state) in states {
            // (Each entry's CBOR framing is a few bytes more.)
            let len = state.bytes.len() + id.len() + 16;
            if len > settings.max_state {
                tracing::warn!(type_name = self.type_name, %shard, entity_id = %id, len, max = settings.max_state, "a state too large to migrate is dropped; the entity starts from its factory");
                continue;
            }
            if size > 0 && size + len > chunk {
                chunks.push(Vec::new());
                size = 0;
            }
            size += len;
            chunks.last_mut().expect("one at least").push((id, state));
        }
        self.outgoing().insert(shard.0, Outgoing { home, chunks });
        if let Some(actor) = self.region_actor.get() {
            let generation = home.generation;
            actor.send_after(settings.timeout * 2, move || RegionMsg::ExpireMigration {
                shard,
                generation,
            });
        }
    }

    /// Chunk `index` of the states kept for `requester`, which hosts
    /// `shard` under `generation`.
    pub(crate) fn migration_chunk(
        &self,
        requester: &UniqueAddress,
        shard: ShardId,
        generation: u64,
        index: u32,
    ) -> ChunkAnswer {
        if self.migration.is_none() {
            return ChunkAnswer::Nothing("the type does not migrate on this node");
        }
        let Some(slot) = self.slots.get(shard.0 as usize) else {
            return ChunkAnswer::Nothing("no such shard");
        };
        // Under the shard's lock, which `set_home` keeps the states under:
        // a shard that has moved on has its states kept already.
        let slot = lock(slot);
        if slot.is_local() && slot.generation() < generation {
            // Still hosted here (its handoff finishing, or its new home not
            // applied yet): the states come once it has moved on.
            return ChunkAnswer::NotYet;
        }
        let outgoing = self.outgoing();
        match outgoing.get(&shard.0) {
            Some(o) if o.home.owner == *requester && o.home.generation == generation => {
                match o.chunks.get(index as usize) {
                    Some(states) => ChunkAnswer::Chunk {
                        states: states.clone(),
                        last: index as usize + 1 == o.chunks.len(),
                    },
                    None => ChunkAnswer::Nothing("no such chunk"),
                }
            }
            _ => ChunkAnswer::Nothing("no states kept for that node and allocation"),
        }
    }

    /// `requester` has fetched every chunk of `shard`'s states: they go.
    pub(crate) fn migration_done(
        &self,
        requester: &UniqueAddress,
        shard: ShardId,
        generation: u64,
    ) {
        let mut outgoing = self.outgoing();
        if outgoing
            .get(&shard.0)
            .is_some_and(|o| o.home.owner == *requester && o.home.generation == generation)
        {
            outgoing.remove(&shard.0);
        }
    }

    /// The states kept for `shard`'s allocation `generation` were not
    /// fetched in time: they go.
    pub(crate) fn expire_migration(&self, shard: ShardId, generation: u64) {
        let mut outgoing = self.outgoing();
        if outgoing
            .get(&shard.0)
            .is_some_and(|o| o.home.generation == generation)
        {
            outgoing.remove(&shard.0);
            tracing::warn!(type_name = self.type_name, %shard, generation, "migrated states not fetched in time are dropped");
        }
    }

    /// Whether states wait here for a node to fetch them: kept for it, or
    /// still in a handed-off shard whose new home this node has not
    /// applied yet.
    pub(crate) fn migrations_pending(&self) -> bool {
        self.migration.is_some()
            && (!self.outgoing().is_empty() || self.slots.iter().any(|s| lock(s).holds_states()))
    }

    /// Reports what became of a shard's migration here.
    pub(crate) fn migration_event(&self, event: MigrationEvent) {
        if let Some(settings) = &self.migration {
            let _ = settings.events.send(event);
        }
    }
}
