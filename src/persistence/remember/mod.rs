//! Remember-entities stores: which entity ids to respawn when a shard starts.
//!
//! The store is chosen when the system is built and is part of its type:
//! a `ShardedSystem<NoStore>`'s registrations have no `remembered()`, so registering a
//! remembered entity type on a system without a store does not compile.
//!
//! A shard records an id when the entity starts and removes it when the entity
//! is passivated (Akka's rule: passivated entities are not remembered); a
//! restart or a node stop keeps it. When a shard starts, its remembered ids are
//! spawned without waiting for a message.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use crate::model::extractor::ShardId;
mod file;
mod spi;
pub(crate) mod writer;
pub use file::{
    FILE_STORE_VERSION, FileStore, FileStoreFsyncPolicy, LOCK_FILE, MAX_ENTITY_ID, MAX_TYPE_NAME,
};
pub use spi::{
    RememberEntitiesOperation, RememberEntitiesStore, RememberRecord, StoreError, StoreRepair,
};
#[cfg(any(feature = "embedded", feature = "fjall", feature = "postgres"))]
pub(crate) use spi::{final_states, record_one};
pub use writer::RememberEntitiesEvent;

/// The marker for a system built without a remember-entities store.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoStore;

/// Process memory. Clones share one table, so regions that share an
/// `InMemoryStore` value share what it remembers; it does not survive the process.
#[derive(Debug, Clone, Default)]
pub struct InMemoryStore {
    table: Arc<Mutex<Table>>,
}

/// Remembered ids per `(type_name, shard)`.
type Table = HashMap<(String, ShardId), BTreeSet<String>>;

impl InMemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut Table) -> T) -> T {
        let mut table = self
            .table
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        f(&mut table)
    }
}

impl RememberEntitiesStore for InMemoryStore {
    fn record_entity_started(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        self.with(|t| {
            t.entry((type_name.to_owned(), shard_id))
                .or_default()
                .insert(entity_id.to_owned())
        });
        Ok(())
    }

    fn record_entity_stopped(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        self.with(|t| {
            if let Some(ids) = t.get_mut(&(type_name.to_owned(), shard_id)) {
                ids.remove(entity_id);
            }
        });
        Ok(())
    }

    fn list_entities_for_shard(
        &self,
        type_name: &str,
        shard_id: ShardId,
    ) -> Result<Vec<String>, StoreError> {
        Ok(self.with(|t| {
            t.get(&(type_name.to_owned(), shard_id))
                .map(|ids| ids.iter().cloned().collect())
                .unwrap_or_default()
        }))
    }

    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        Ok(self.with(|t| {
            let mut shards: Vec<ShardId> = t
                .iter()
                .filter(|((name, _), ids)| name == type_name && !ids.is_empty())
                .map(|((_, s), _)| *s)
                .collect();
            shards.sort();
            shards
        }))
    }
}
