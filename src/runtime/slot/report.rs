//! What a slot tells of itself: its home, its live entities and their
//! ids, and the summary the region reports.

use std::sync::Arc;

use super::{Entry, ShardHome, Slot, State};
use crate::model::identity::UniqueAddress;

/// What the region reports of one slot (`ShardRegionState`).
#[derive(Default)]
pub(crate) struct SlotSummary {
    /// Hosted here, with this many live entities.
    pub(crate) hosted: Option<usize>,
    pub(crate) handing_off: bool,
    /// Hosted here with remembered ids still to respawn.
    pub(crate) respawning: bool,
    /// Messages waiting in the slot's buffers.
    pub(crate) buffered: usize,
    /// The part of `buffered` waiting behind a handoff.
    pub(crate) handoff_buffered: usize,
    /// Where the slot knows the shard lives: here (`None` inside), on
    /// another node, or nowhere yet (the outer `None`); with the
    /// allocation generation it knows.
    pub(crate) home: Option<(Option<UniqueAddress>, u64)>,
}

impl<E: Clone> Slot<E> {
    /// The home of this slot, `me` standing for a shard hosted here — or
    /// allocated here and being installed: a coordinator that takes over
    /// from this node's replica must not allocate it again.
    pub(crate) fn home(&self, me: Option<UniqueAddress>) -> Option<ShardHome> {
        match &self.state {
            State::Remote(home) => Some(*home),
            State::Local(local) => me.map(|owner| ShardHome {
                owner,
                generation: local.generation,
            }),
            State::Unallocated {
                generation,
                installing: true,
                ..
            } => me.map(|owner| ShardHome {
                owner,
                generation: *generation,
            }),
            State::Unallocated {
                installing: false, ..
            }
            | State::Stopped => None,
        }
    }

    pub(crate) fn is_local(&self) -> bool {
        matches!(&self.state, State::Local(_))
    }

    /// Number of live (not passivating) entities.
    pub(crate) fn live_entities(&self) -> usize {
        match &self.state {
            State::Local(local) => local
                .entities
                .values()
                .filter(|e| matches!(e, Entry::Live(_)))
                .count(),
            State::Unallocated { .. } | State::Remote(_) | State::Stopped => 0,
        }
    }

    /// Of a hosted shard: the `limit` least ids of its live (not
    /// passivating) entities, in no order, and whether it has more; `None`
    /// for a shard not hosted here.
    ///
    /// One walk over the entities, as counting them makes, keeping the
    /// least ids seen in a heap of at most `limit`: a shard's lock is held
    /// about as long for its ids as for its count (a comparison more per
    /// entity, and `limit` reference counts), never for a sort or a copy
    /// of the text, which the caller makes once the lock is released.
    pub(crate) fn least_live_ids(&self, limit: usize) -> Option<(Vec<Arc<str>>, bool)> {
        let State::Local(local) = &self.state else {
            return None;
        };
        let mut least: std::collections::BinaryHeap<&Arc<str>> =
            std::collections::BinaryHeap::with_capacity(limit.min(local.entities.len()));
        let mut more = false;
        for (id, entry) in &local.entities {
            if !matches!(entry, Entry::Live(_)) {
                continue;
            }
            if least.len() < limit {
                least.push(id);
                continue;
            }
            more = true;
            // Full (or `limit` 0, with nothing to peek): the greatest kept
            // gives way to a lesser id.
            if let Some(mut greatest) = least.peek_mut()
                && id < *greatest
            {
                *greatest = id;
            }
        }
        Some((least.into_iter().cloned().collect(), more))
    }

    /// What the region reports of this slot.
    pub(crate) fn summary(&self) -> SlotSummary {
        let mut summary = SlotSummary::default();
        match &self.state {
            State::Unallocated { buffer, .. } => summary.buffered = buffer.len(),
            State::Remote(home) => summary.home = Some((Some(home.owner), home.generation)),
            State::Local(local) => {
                summary.home = Some((None, local.generation));
                let mut live = 0;
                for entry in local.entities.values() {
                    match entry {
                        Entry::Live(_) => live += 1,
                        Entry::Passivating { buffer, .. } => summary.buffered += buffer.len(),
                    }
                }
                if let Some(handoff) = &local.handoff {
                    summary.buffered += handoff.buffer.len();
                    summary.handoff_buffered = handoff.buffer.len();
                    summary.handing_off = true;
                }
                summary.respawning = !local.pending_respawn.is_empty();
                summary.hosted = Some(live);
            }
            State::Stopped => {}
        }
        summary
    }
}
