//! Remember-entities stores: which entity ids to respawn when a shard starts.
//!
//! The store is chosen when the system is built and is part of its type:
//! `ShardedSystem<NoStore>` has no `register_remembered`, so registering a
//! remembered entity type on a system without a store does not compile.
//!
//! A shard records an id when the entity starts and removes it when the entity
//! is passivated (Akka's rule: passivated entities are not remembered); a
//! restart or a node stop keeps it. When a shard starts, its remembered ids are
//! spawned without waiting for a message.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use crate::extractor::ShardId;

mod file;
pub(crate) mod writer;
pub use file::{
    FILE_STORE_VERSION, FileStore, FileStoreFsyncPolicy, LOCK_FILE, MAX_ENTITY_ID, MAX_TYPE_NAME,
};
pub use writer::{RememberEntitiesEvent, RememberEntitiesOperation};

/// The marker for a system built without a remember-entities store.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoStore;

/// A store failed; the message says how.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("remember-entities store error: {0}")]
pub struct StoreError(pub String);

/// A log a store repaired ([`RememberEntitiesStore::take_repairs`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreRepair {
    /// The entity type whose log it is.
    pub type_name: String,
    /// Its shard.
    pub shard_id: ShardId,
    /// What was done, for the event's text.
    pub what: String,
}

/// The persistence seam of remember-entities.
pub trait RememberEntitiesStore: Send + Sync + 'static {
    /// Records that `entity_id` started in `shard_id`.
    fn record_entity_started(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError>;
    /// Records that `entity_id` stopped for good (passivated).
    fn record_entity_stopped(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError>;
    /// The ids remembered in one shard.
    fn list_entities_for_shard(
        &self,
        type_name: &str,
        shard_id: ShardId,
    ) -> Result<Vec<String>, StoreError>;
    /// The logs this store repaired since the last call — say, a torn last
    /// record (a crash mid-append) cut off when the log was read — for the
    /// system to publish, each as a [`RememberEntitiesEvent`] with the
    /// operation [`RememberEntitiesOperation::RepairLog`]. Called after
    /// reads and writes; the default repairs nothing.
    fn take_repairs(&self) -> Vec<StoreRepair> {
        Vec::new()
    }
    /// The shards of a type that have remembered ids (to start them at once).
    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        let _ = type_name;
        Ok(Vec::new())
    }
    /// Applies `records` in order; one result per record. The write-behind
    /// queue hands a store every record waiting at once (up to 4,096), so a
    /// store can make them durable together (`FileStore`: one write and one
    /// sync per shard log). The default records them one by one.
    fn record_batch(&self, records: &[RememberRecord<'_>]) -> Vec<Result<(), StoreError>> {
        records
            .iter()
            .map(|r| {
                if r.started {
                    self.record_entity_started(r.type_name, r.shard_id, r.entity_id)
                } else {
                    self.record_entity_stopped(r.type_name, r.shard_id, r.entity_id)
                }
            })
            .collect()
    }
}

/// A batch's records reduced to what each id ends as (started or not),
/// in key order: applying this is applying the records in order.
#[cfg_attr(not(any(feature = "embedded", feature = "postgres")), allow(dead_code))]
pub(crate) fn final_states<'a>(
    records: &[RememberRecord<'a>],
) -> std::collections::BTreeMap<(&'a str, ShardId, &'a str), bool> {
    records
        .iter()
        .map(|r| ((r.type_name, r.shard_id, r.entity_id), r.started))
        .collect()
}

/// One record of a batch ([`RememberEntitiesStore::record_batch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RememberRecord<'a> {
    /// The entity type.
    pub type_name: &'a str,
    /// The shard.
    pub shard_id: ShardId,
    /// The entity.
    pub entity_id: &'a str,
    /// Started (`true`) or stopped for good (`false`).
    pub started: bool,
}

/// A shared store is a store: several systems (or a system and the code that
/// inspects it) can hold one `Arc` of it.
impl<T: RememberEntitiesStore + ?Sized> RememberEntitiesStore for Arc<T> {
    fn record_entity_started(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        (**self).record_entity_started(type_name, shard_id, entity_id)
    }
    fn record_entity_stopped(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        (**self).record_entity_stopped(type_name, shard_id, entity_id)
    }
    fn list_entities_for_shard(
        &self,
        type_name: &str,
        shard_id: ShardId,
    ) -> Result<Vec<String>, StoreError> {
        (**self).list_entities_for_shard(type_name, shard_id)
    }
    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        (**self).list_shards(type_name)
    }
    fn record_batch(&self, records: &[RememberRecord<'_>]) -> Vec<Result<(), StoreError>> {
        (**self).record_batch(records)
    }
    fn take_repairs(&self) -> Vec<StoreRepair> {
        (**self).take_repairs()
    }
}

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
