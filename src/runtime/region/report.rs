//! What a region reports of itself: [`ShardRegionState`], its passivation
//! counts and shard placements, the ids of live entities, and the
//! buffered-message gauges.

use std::sync::atomic::Ordering;

use super::Region;
use crate::model::extractor::ShardId;

/// The most bytes of ids one [`Region::state_with_ids`] answer holds in
/// all (its shards take from it in ascending order; those past it list
/// none and are marked cut): ids have no length limit.
pub(crate) const IDS_BYTES_IN_ALL: usize = 8 << 20;

/// Why a live entity was passivated (an index into `Region::passivated`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PassivationCause {
    /// Its idle timeout ran out.
    Idle = 0,
    /// Its shard was at its share of the active-entity limit.
    Limit = 1,
    /// Asked: `ctx.passivate()`, `EntityRef::passivate`, or an incarnation
    /// retiring itself (a failed recovery, a refused write).
    Explicit = 2,
}

/// Passivations of a region's live entities so far, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Passivations {
    /// The idle timeout ran out (`passivation_idle_timeout`).
    pub idle: u64,
    /// The shard was at its share of the active-entity limit (§6.1).
    pub limit: u64,
    /// Asked: `ctx.passivate()`, `EntityRef::passivate`, or an incarnation
    /// retiring itself after a failed recovery or a refused write.
    pub explicit: u64,
}

/// Where one shard lives, as this node's region knows it
/// ([`ShardRegionState::placements`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardPlacement {
    /// The node hosting the shard; `None` when it is this node.
    pub owner: Option<crate::model::identity::UniqueAddress>,
    /// The allocation generation the home came with (0 on a single node).
    pub generation: u64,
}

/// One region's state on this node, as
/// [`ShardedSystem::shard_region_state`](crate::ShardedSystem::shard_region_state)
/// reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardRegionState {
    /// The entity type.
    pub type_name: &'static str,
    /// Every shard hosted here, with its number of live entities
    /// (passivating ones not counted).
    pub shards: std::collections::BTreeMap<ShardId, usize>,
    /// The hosted shards being handed off to another node.
    pub handing_off: std::collections::BTreeSet<ShardId>,
    /// Of a remembered type: the hosted shards with remembered ids still
    /// to respawn (at the respawn rate). Empty once a restart's, or a
    /// move's, respawn has finished.
    pub respawning: std::collections::BTreeSet<ShardId>,
    /// Of a remembered type under `FailClosed`: the shards whose store
    /// failed; their messages fail with `ShardingError::RememberEntities`.
    pub failed: std::collections::BTreeSet<ShardId>,
    /// Messages waiting in this region's buffers: for shards without a home
    /// yet, behind passivating entities, and in handoff buffers.
    pub buffered: usize,
    /// The region routes only (proxy-only, or its type's role is not this
    /// node's).
    pub proxy: bool,
    /// The coordinator refused this region (another fingerprint or shard
    /// count than the type's in the cluster): the error every message to
    /// the type through this node fails with (`ShardingError::RegionRefused`).
    pub refused: Option<crate::ShardingError>,
    /// The active-entity limit (`ShardingConfig::entity_limit`), if the
    /// type has one; the live entities are the sum of `shards`.
    pub entity_limit: Option<usize>,
    /// Passivations of live entities so far, by cause.
    pub passivations: Passivations,
    /// Every shard this region knows a home for — hosted here or on
    /// another node — with its generation. A shard not listed has no home
    /// known here yet (no message has asked for it).
    pub placements: std::collections::BTreeMap<ShardId, ShardPlacement>,
    /// Of [`ShardedSystem::shard_region_state_with_ids`](crate::ShardedSystem::shard_region_state_with_ids)
    /// only (empty otherwise): every hosted shard with the ids of its live
    /// entities, ascending, at most the limit asked (the least ids). Read
    /// under the same lock as the shard's count in `shards`, so a list
    /// not cut has that many ids.
    pub entity_ids: std::collections::BTreeMap<ShardId, Vec<String>>,
    /// The hosted shards whose list in `entity_ids` was cut: they have
    /// more live entities than it names.
    pub entity_ids_truncated: std::collections::BTreeSet<ShardId>,
}

impl Region {
    /// Number of live (not passivating) entities in `shard`.
    pub(crate) fn live_entities(&self, shard: ShardId) -> usize {
        self.table.slot(shard).live_entities()
    }

    /// Sets the buffered-message gauges from the slots' buffers now
    /// (each slot locked in turn; its entities counted).
    pub(crate) fn sample_buffers(&self) {
        let (mut buffered, mut handoff) = (0, 0);
        for shard in 0..self.num_shards() {
            let summary = self.table.slot(ShardId(shard)).summary();
            buffered += summary.buffered;
            handoff += summary.handoff_buffered;
        }
        self.metrics.buffered.set(buffered as f64);
        self.metrics.handoff_buffered.set(handoff as f64);
    }

    /// This region's own state.
    pub(crate) fn state(&self) -> ShardRegionState {
        self.read_state(None)
    }

    /// This region's own state with the ids of its live entities: at most
    /// `per_shard` of each hosted shard, and at most `in_all` over the
    /// shards, taken in ascending order (a shard past `in_all` lists none,
    /// and is marked cut if it has live entities).
    pub(crate) fn state_with_ids(&self, per_shard: usize, in_all: usize) -> ShardRegionState {
        self.read_state(Some((per_shard, in_all)))
    }

    /// Reads every slot under its own lock in turn (never two at once, so
    /// a message path waits at most for one shard's summary), with its
    /// ids when `ids` gives the limits.
    fn read_state(&self, ids: Option<(usize, usize)>) -> ShardRegionState {
        let mut shards = std::collections::BTreeMap::new();
        let mut entity_ids = std::collections::BTreeMap::new();
        let mut entity_ids_truncated = std::collections::BTreeSet::new();
        let mut ids_left = ids.map_or(0, |(_, in_all)| in_all);
        let mut ids_bytes_left = IDS_BYTES_IN_ALL;
        let mut handing_off = std::collections::BTreeSet::new();
        let mut respawning = std::collections::BTreeSet::new();
        let mut failed = std::collections::BTreeSet::new();
        let mut buffered = 0;
        let mut placements = std::collections::BTreeMap::new();
        for i in 0..self.num_shards() {
            let shard = ShardId(i);
            let guard = self.table.slot(shard);
            let summary = guard.summary();
            let listed =
                ids.and_then(|(per_shard, _)| guard.least_live_ids(per_shard.min(ids_left)));
            drop(guard);
            // The text is copied and sorted with the lock released.
            if let Some((listed, more)) = listed {
                let mut listed: Vec<String> = listed.iter().map(|id| id.to_string()).collect();
                listed.sort_unstable();
                // Ids have no length limit: the answer has a byte budget
                // as well; once it is spent, no later shard lists any.
                let mut fit = 0;
                for id in &listed {
                    if id.len() > ids_bytes_left {
                        break;
                    }
                    ids_bytes_left -= id.len();
                    fit += 1;
                }
                let spent = fit < listed.len();
                listed.truncate(fit);
                ids_left = if spent { 0 } else { ids_left - listed.len() };
                if more || spent {
                    entity_ids_truncated.insert(shard);
                }
                entity_ids.insert(shard, listed);
            }
            buffered += summary.buffered;
            if let Some((owner, generation)) = summary.home {
                placements.insert(shard, ShardPlacement { owner, generation });
            }
            if summary.handing_off {
                handing_off.insert(shard);
            }
            if summary.respawning {
                respawning.insert(shard);
            }
            if let Some(remember) = &self.remember
                && remember.check(self.type_name, shard).is_err()
            {
                failed.insert(shard);
            }
            if let Some(live) = summary.hosted {
                shards.insert(shard, live);
            }
        }
        ShardRegionState {
            type_name: self.type_name,
            shards,
            handing_off,
            respawning,
            failed,
            buffered,
            proxy: self.is_proxy(),
            refused: self.refusal(),
            entity_limit: self.table.entity_limit().map(|l| l.max_live),
            passivations: Passivations {
                idle: self.passivated[PassivationCause::Idle as usize].load(Ordering::Relaxed),
                limit: self.passivated[PassivationCause::Limit as usize].load(Ordering::Relaxed),
                explicit: self.passivated[PassivationCause::Explicit as usize]
                    .load(Ordering::Relaxed),
            },
            placements,
            entity_ids,
            entity_ids_truncated,
        }
    }
}
