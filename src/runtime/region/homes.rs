//! Where the region's shards live: homes from the coordinator, handoffs,
//! lost nodes, the region's replica of the table, and a graceful leave.

use std::sync::atomic::Ordering;

use super::{Region, fail_undelivered, lock};
use crate::entity::MigrationEvent;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::mailbox::RegionMsg;
use crate::runtime::slot::{HomeChange, ShardHome};

impl Region {
    /// The coordinator moves `shard`, hosted here under `generation` (see
    /// [`Slot::hand_off`]).
    pub(crate) fn hand_off(&self, shard: ShardId, generation: u64) {
        if let Some(slot) = self.slots.get(shard.0 as usize) {
            lock(slot).hand_off(&mut self.host(), shard, generation);
        }
    }

    /// Whether `shard` is hosted here under `generation`, handed off and
    /// empty: its `ShardStopped` still needs an answer.
    pub(crate) fn is_handed_off(&self, shard: ShardId, generation: u64) -> bool {
        self.slots
            .get(shard.0 as usize)
            .is_some_and(|slot| lock(slot).is_handed_off(generation))
    }

    /// Applies a home for `shard` from the coordinator (see
    /// [`Slot::set_home`]); the entities of a shard that moved away finish
    /// their mailboxes and stop, and `shutdown` waits for them. A shard
    /// whose home is now here is started by the region actor; `from`, the
    /// old owner that handed it off, has its entities' states for it. A
    /// shard handed off from here keeps its entities' states for its new
    /// home to fetch.
    pub(crate) fn set_home(
        &self,
        shard: ShardId,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> HomeChange {
        let Some(cluster) = &self.cluster else {
            return HomeChange::Unchanged;
        };
        let from = from.filter(|f| *f != cluster.me);
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let was_local = guard.is_local();
        if let Some(from) = from
            && was_local
            && home.owner == cluster.me
            && home.generation >= guard.generation()
        {
            // Hosted here already, yet the coordinator says the shard comes
            // from `from`: either it started here from a word without
            // `from` (a Table, a GetHome answer) before this one, or this
            // node missed a move, and the states it kept are older than
            // `from`'s. Neither is pulled: its entities start from the
            // factory (and this says so).
            let dropped = guard.drop_states();
            let reason = if dropped > 0 {
                format!("this node missed a move: {dropped} older states kept here dropped")
            } else {
                "the shard started here before its states were asked for".to_owned()
            };
            tracing::warn!(type_name = self.type_name, %shard, %from, %reason, "migrated states not fetched");
            self.migration_event(MigrationEvent::FellBack {
                type_name: self.type_name,
                shard,
                from: Some(from),
                reason,
            });
        }
        let (change, undelivered) =
            guard.set_home(&mut self.host(), shard, home, cluster.me, cluster.proxy);
        let moved_away = was_local && !guard.is_local();
        // Kept under the shard's lock: a pull sees the shard either still
        // here or moved on with its states kept.
        if let Some((home, states)) = guard.take_outgoing() {
            self.keep_outgoing(shard, home, states);
        }
        drop(guard);
        if moved_away {
            self.count_hosted(shard, false);
        }
        fail_undelivered(undelivered);
        if change == HomeChange::HostHere
            && let Some(actor) = self.region_actor.get()
        {
            // The region actor starts hosting the shard (messages wait in
            // the slot meanwhile).
            let _ = actor.cast(RegionMsg::Host {
                shard,
                generation: home.generation,
                from,
            });
        }
        change
    }

    /// The highest allocation generation this region has seen for `shard`.
    pub(crate) fn generation_of(&self, shard: ShardId) -> u64 {
        match self.slots.get(shard.0 as usize) {
            Some(slot) => {
                let slot = lock(slot);
                if slot.is_stopped() {
                    0
                } else {
                    slot.generation()
                }
            }
            None => 0,
        }
    }

    /// `node` is gone (downed, exited, removed): shards routed to it wait
    /// for a new home; the next message for one asks the coordinator.
    /// Returns how many shards this region still routed to it.
    pub(crate) fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.slots
            .iter()
            .filter(|slot| lock(slot).node_lost(node))
            .count()
    }

    /// The hosted shards whose handoff has stopped every entity: they host
    /// nothing any more and wait for their next home. A registration names
    /// them, so that no coordinator takes this node for their home again
    /// from a claim (SPEC §13.3).
    pub(crate) fn stopped_shards(&self) -> Vec<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| lock(slot).is_stopped_here())
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// Every home this region knows (its replica of the table).
    pub(crate) fn replica(&self) -> Vec<(u32, ShardHome)> {
        let me = self.cluster.as_ref().map(|c| c.me);
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| lock(slot).home(me).map(|home| (i as u32, home)))
            .collect()
    }

    /// A new coordinator: handoffs it did not ask for, and that have not
    /// reported their shard stopped yet, are called off (the shard stays
    /// here and what waited is delivered here; a leaving node asks the new
    /// coordinator again). Reported ones go on: their report is repeated.
    pub(crate) fn call_off_handoffs(&self) {
        for (i, slot) in self.slots.iter().enumerate() {
            let mut guard = lock(slot);
            let undelivered = guard.call_off_handoff(&mut self.host(), ShardId(i as u32));
            drop(guard);
            fail_undelivered(undelivered);
        }
    }

    /// The coordinator said nothing more of this type will move off this
    /// node (see [`leave_done`](Self::leave_done)).
    pub(crate) fn mark_left(&self, nowhere: bool) {
        self.nowhere.store(nowhere, Ordering::Release);
        self.left.store(true, Ordering::Release);
    }

    /// In a graceful leave: whether this region is done — the coordinator
    /// said there is nowhere to move its shards, or it said `Left` and this
    /// node hosts no shard any more (it has applied the new homes; one that
    /// was lost, because the new home died meanwhile, is followed by
    /// another, which the leave waits for).
    pub(crate) fn leave_done(&self) -> bool {
        self.nowhere.load(Ordering::Acquire)
            || (self.left.load(Ordering::Acquire) && self.hosted_count() == 0)
    }
}
