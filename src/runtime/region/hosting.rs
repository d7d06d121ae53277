//! Hosting shards here: installing a shard, its remembered entities, and
//! the active-entity limit shared over the hosted shards.

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use super::{Region, fail_undelivered, lock};
use crate::model::config::PassivationPolicy;
use crate::model::extractor::ShardId;
use crate::persistence::remember::RememberEntitiesOperation;
use crate::runtime::mailbox::States;

impl Region {
    /// Whether `shard` is hosted here under `generation` or a later one.
    pub(crate) fn hosts(&self, shard: ShardId, generation: u64) -> bool {
        self.slots.get(shard.0 as usize).is_some_and(|slot| {
            let slot = lock(slot);
            slot.is_local() && slot.generation() >= generation
        })
    }

    /// Makes `shard` local under `generation`, starts respawning
    /// `remembered` (read from the store beforehand, off the lock) and
    /// replays its buffer in order. Returns false (and leaves the slot as
    /// it was) when a newer home came meanwhile, the shard is already local
    /// or the region stopped.
    pub(crate) fn install_local(
        &self,
        shard: ShardId,
        generation: u64,
        remembered: Option<Vec<String>>,
        migrated: States,
    ) -> bool {
        let install = self.installs.fetch_add(1, Ordering::Relaxed);
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let newly_local = !guard.is_local();
        // Counted in before it starts, so that its own share is right.
        if newly_local {
            self.count_hosted(shard, true);
        }
        let installed = guard.install(
            &mut self.host(),
            shard,
            generation,
            install,
            remembered,
            migrated,
        );
        if newly_local && installed.is_none() {
            self.count_hosted(shard, false);
        }
        drop(guard);
        match installed {
            Some(undelivered) => {
                fail_undelivered(undelivered);
                if newly_local {
                    self.reshare();
                }
                true
            }
            None => false,
        }
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
        lock(&self.slots[shard.0 as usize]).respawn_more(&mut self.host(), shard, install);
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
        for shard in shards.into_iter().filter(|s| s.0 < self.num_shards()) {
            lock(&self.slots[shard.0 as usize]).request_if_idle(&mut self.host(), shard);
        }
    }

    /// How many shards of this region are hosted here.
    pub(crate) fn hosted_count(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| lock(slot).is_local())
            .count()
    }

    /// Each hosted shard's share of the limit, with `hosted` shards.
    pub(super) fn share_with(&self, hosted: usize) -> Option<(usize, PassivationPolicy)> {
        let limit = self.entity_limit?;
        Some(((limit.max_live / hosted.max(1)).max(1), limit.policy))
    }

    /// A shard was counted in: every hosted shard's share is now the
    /// smaller one for the current count, and each passivates what no
    /// longer fits. (A share that grows, when a shard moves away, is taken
    /// up by the next start.)
    fn reshare(&self) {
        let Some((share, _)) = self.share_with(self.hosted.load(Ordering::Acquire)) else {
            return;
        };
        let hosted: Vec<u32> = self.hosted_shards().iter().copied().collect();
        for i in hosted {
            lock(&self.slots[i as usize]).reshare(&mut self.host(), ShardId(i), share);
        }
    }

    fn hosted_shards(&self) -> MutexGuard<'_, std::collections::BTreeSet<u32>> {
        self.hosted_shards
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts `shard` in (`here`) or out of the shards hosted here: the
    /// set a new share visits, its size every start reads, and the
    /// `datum_sharding_shards` gauge, in step.
    pub(super) fn count_hosted(&self, shard: ShardId, here: bool) {
        let mut hosted = self.hosted_shards();
        let changed = if here {
            hosted.insert(shard.0)
        } else {
            hosted.remove(&shard.0)
        };
        if changed {
            self.hosted.store(hosted.len(), Ordering::Release);
            self.metrics.shards(if here { 1 } else { -1 });
        }
    }
}
