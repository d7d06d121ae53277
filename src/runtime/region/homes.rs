//! Where the region's shards live: homes from the coordinator and
//! handoffs, acted out through the region's host (the rules are the
//! [`ShardTable`](super::ShardTable)'s; what needs no host is read from
//! the table itself).

use super::Region;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::slot::{HomeChange, ShardHome};

impl Region {
    /// The coordinator moves `shard`, hosted here under `generation`.
    pub(crate) fn hand_off(&self, shard: ShardId, generation: u64) {
        self.table.hand_off(&mut self.host(), shard, generation);
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

    /// A new coordinator: handoffs it did not ask for are called off.
    pub(crate) fn call_off_handoffs(&self) {
        self.table.call_off_handoffs(&mut self.host());
    }
}
