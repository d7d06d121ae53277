//! Hosting shards here: installing a shard, and reading its remembered
//! entities from the store.

use super::Region;
use crate::model::extractor::ShardId;
use crate::persistence::remember::RememberEntitiesOperation;
use crate::runtime::mailbox::States;

impl Region {
    /// Makes `shard` local under `generation` (see
    /// [`ShardTable::install`](super::ShardTable::install)).
    pub(crate) fn install_local(
        &self,
        shard: ShardId,
        generation: u64,
        remembered: Option<Vec<String>>,
        migrated: States,
    ) -> bool {
        self.table
            .install(&mut self.host(), shard, generation, remembered, migrated)
    }

    /// The remembered ids of `shard`, read from the store (never under a
    /// shard's lock: the region actor calls it before installing the shard).
    /// `None` for a type that is not remembered, or when the read failed
    /// (reported through the failure policy).
    pub(crate) fn remembered_ids(&self, shard: ShardId) -> Option<Vec<String>> {
        let remember = self.remember.as_ref()?;
        let listed = remember
            .store()
            .list_entities_for_shard(self.type_name, shard);
        remember.publish_repairs();
        match listed {
            Ok(ids) => Some(ids),
            Err(error) => {
                remember.failure(
                    self.type_name,
                    Some(shard),
                    None,
                    RememberEntitiesOperation::ListEntities,
                    &error.0,
                );
                None
            }
        }
    }

    /// The region actor's turn to respawn more remembered ids of `shard`,
    /// if it is still the same hosting of it.
    pub(crate) fn respawn_more(&self, shard: ShardId, install: u64) {
        self.table.respawn_more(&mut self.host(), shard, install);
    }

    /// The shards that have remembered entities, read from the store (it
    /// may block: call it where blocking is allowed). A failed read is
    /// reported through the failure policy and lists none.
    pub(crate) fn remembered_shards(&self) -> Vec<ShardId> {
        let Some(remember) = &self.remember else {
            return Vec::new();
        };
        let listed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            remember.store().list_shards(self.type_name)
        }))
        .unwrap_or_else(|_| {
            Err(crate::persistence::remember::StoreError(
                "the store panicked".into(),
            ))
        });
        match listed {
            Ok(shards) => shards,
            Err(error) => {
                remember.failure(
                    self.type_name,
                    None,
                    None,
                    RememberEntitiesOperation::ListShards,
                    &error.0,
                );
                Vec::new()
            }
        }
    }

    /// Starts `shards` (those with remembered entities, at registration).
    pub(crate) fn start_shards(&self, shards: Vec<ShardId>) {
        self.table.start_shards(&mut self.host(), shards);
    }
}
