//! The remember-entities store SPI: which entity ids to respawn when a
//! shard starts. `InMemoryStore` and `FileStore` implement it beside this;
//! `RedbPersistence` and `PgPersistence` beside their journals.

use std::sync::Arc;

use crate::model::extractor::ShardId;

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
    /// system to publish, each as a [`RememberEntitiesEvent`](crate::RememberEntitiesEvent) with the
    /// operation [`RememberEntitiesOperation::RepairLog`](crate::RememberEntitiesOperation::RepairLog). Called after
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
#[cfg_attr(
    not(any(feature = "embedded", feature = "fjall", feature = "postgres")),
    allow(dead_code)
)]
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

/// One start or stop through `store`'s batch: for a store whose batch is
/// its real write (one transaction), so that a single record takes the
/// same path.
#[cfg_attr(
    not(any(feature = "embedded", feature = "fjall", feature = "postgres")),
    allow(dead_code)
)]
pub(crate) fn record_one(
    store: &(impl RememberEntitiesStore + ?Sized),
    type_name: &str,
    shard_id: ShardId,
    entity_id: &str,
    started: bool,
) -> Result<(), StoreError> {
    let record = RememberRecord {
        type_name,
        shard_id,
        entity_id,
        started,
    };
    store.record_batch(&[record]).pop().unwrap_or(Ok(()))
}

/// What a remember-entities event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RememberEntitiesOperation {
    /// Recording that an entity started.
    RecordStarted,
    /// Recording that an entity stopped (passivated).
    RecordStopped,
    /// Listing a shard's ids when it starts.
    ListEntities,
    /// Listing a type's shards at registration.
    ListShards,
    /// Not a failure: the store repaired a log it read (a torn last
    /// record, from a crash mid-append, cut off; that record had not been
    /// made durable). The event's `error` says what was done.
    RepairLog,
}
