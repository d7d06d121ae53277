//! State migration on the old owner's side: its settings, and the states a
//! handoff took from a shard's entities, kept in chunks (by the
//! [`ShardTable`](super::ShardTable)) for the node the shard moved to until
//! it fetches them or they expire.

use std::time::Duration;

use super::{Keeping, Region};
use crate::entity::MigrationEvent;
use crate::model::extractor::ShardId;
use crate::runtime::entity_actor::MigrationEvents;

/// The largest migrated states chunk a pull is answered with (a state
/// larger than it travels alone).
pub(crate) const MIGRATION_CHUNK: usize = 256 * 1024;

/// Frees `value` on tokio's blocking pool, where a long free (a shard's
/// kept states) shares the cores with the async threads rather than
/// holding one of them; inline when there is no runtime.
pub(crate) fn drop_off_async<T: Send + 'static>(value: T) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(move || drop(value))),
        Err(_) => drop(value),
    }
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

    /// The states kept for `shard`'s allocation `generation` were not
    /// fetched in time: they go.
    pub(crate) fn expire_migration(&self, shard: ShardId, generation: u64) {
        if self.table.expire_migration(shard, generation) {
            tracing::warn!(type_name = self.type_name, %shard, generation, "migrated states not fetched in time are dropped");
        }
    }

    /// Reports what became of a shard's migration here.
    pub(crate) fn migration_event(&self, event: MigrationEvent) {
        if let Some(port) = self.port() {
            use crate::ops::history::ClusterEventKind as K;
            let recorded = match &event {
                // (Each shard's own figures are in the log.)
                MigrationEvent::Received {
                    type_name,
                    shard,
                    from,
                    ..
                } => Some((
                    K::StatesReceived,
                    *shard,
                    format!("{type_name}: the states came from {from}"),
                )),
                MigrationEvent::FellBack {
                    type_name,
                    shard,
                    reason,
                    ..
                } => Some((
                    K::MigrationFellBack,
                    *shard,
                    format!("{type_name}: started without the states: {reason}"),
                )),
                // (One per entity: the log and the subscription have them.)
                MigrationEvent::StateRefused { .. } => None,
            };
            if let Some((kind, shard, text)) = recorded {
                port.record(kind, Some(shard), text);
            }
        }
        if let Some(settings) = &self.migration {
            let _ = settings.events.send(event);
        }
    }
}

impl MigrationSettings {
    /// How the table keeps states under these settings: states travel in
    /// chunks of at most [`MIGRATION_CHUNK`] (or the largest state, if
    /// smaller; a state larger than a chunk travels alone), and wait twice
    /// the timeout for their new home.
    pub(crate) fn keeping(&self) -> Keeping {
        Keeping {
            max_state: self.max_state,
            chunk: MIGRATION_CHUNK,
            keep_for: self.timeout * 2,
        }
    }
}
