//! Where the region's shards live: homes from the coordinator, handoffs,
//! lost nodes, the region's replica of the table, and a graceful leave
//! (the rules are the [`ShardTable`](super::ShardTable)'s).

use super::Region;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::slot::{HomeChange, ShardHome};

impl Region {
    /// The coordinator moves `shard`, hosted here under `generation`.
    pub(crate) fn hand_off(&self, shard: ShardId, generation: u64) {
        self.table.hand_off(&mut self.host(), shard, generation);
    }

    /// Whether `shard` is hosted here under `generation`, handed off and
    /// empty: its `ShardStopped` still needs an answer.
    pub(crate) fn is_handed_off(&self, shard: ShardId, generation: u64) -> bool {
        self.table.is_handed_off(shard, generation)
    }

    /// Applies a home for `shard` from the coordinator (see
    /// [`ShardTable::set_home`](super::ShardTable::set_home)); a shard whose
    /// home is now here is started by the region actor.
    pub(crate) fn set_home(
        &self,
        shard: ShardId,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> HomeChange {
        self.table.set_home(&mut self.host(), shard, home, from)
    }

    /// The highest allocation generation this region has seen for `shard`.
    pub(crate) fn generation_of(&self, shard: ShardId) -> u64 {
        self.table.generation_of(shard)
    }

    /// `node` is gone (downed, exited, removed): shards routed to it wait
    /// for a new home. Returns how many shards this region still routed to
    /// it.
    pub(crate) fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.table.node_lost(node)
    }

    /// The hosted shards whose handoff has stopped every entity.
    pub(crate) fn stopped_shards(&self) -> Vec<u32> {
        self.table.stopped_shards()
    }

    /// Every home this region knows (its replica of the table).
    pub(crate) fn replica(&self) -> Vec<(u32, ShardHome)> {
        self.table.replica()
    }

    /// A new coordinator: handoffs it did not ask for are called off.
    pub(crate) fn call_off_handoffs(&self) {
        self.table.call_off_handoffs(&mut self.host());
    }

    /// The coordinator said nothing more of this type will move off this
    /// node (see [`leave_done`](Self::leave_done)).
    pub(crate) fn mark_left(&self, nowhere: bool) {
        self.table.mark_left(nowhere);
    }

    /// In a graceful leave: whether this region is done.
    pub(crate) fn leave_done(&self) -> bool {
        self.table.leave_done()
    }
}
