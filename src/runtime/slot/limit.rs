//! The active-entity limit within a hosted shard: each start stays within
//! the shard's share, passivating what the policy picks to make room.

use std::sync::Arc;

use super::{LocalShard, Slot, SlotHost, State};
use crate::model::extractor::ShardId;

impl<E: Clone> Slot<E> {
    /// The region's shards changed: a hosted shard's share of the
    /// active-entity limit is now `share`.
    pub(crate) fn reshare<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        share: usize,
    ) {
        if let State::Local(local) = &mut self.state {
            local.reshare(host, shard, share);
        }
    }
}

impl<E: Clone> LocalShard<E> {
    /// A live entity was sent a message.
    pub(super) fn accessed(&mut self, entity_id: &str) {
        if let Some(passivator) = &mut self.passivator {
            passivator.access(entity_id);
        }
    }

    /// Before `entity_id` starts: within the shard's share of the limit
    /// (as it is now: the region's shards come and go), passivating what
    /// the policy picks to make room. An incarnation replacing a crashed
    /// one takes its place.
    pub(super) fn make_room<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) {
        let Some(passivator) = &mut self.passivator else {
            return;
        };
        if passivator.contains(entity_id) {
            passivator.access(entity_id);
            return;
        }
        let share = host
            .entity_share()
            .map_or(passivator.share(), |(share, _)| share);
        let mut victims = passivator.resize(share);
        victims.extend(passivator.admit(entity_id));
        self.passivate_for_room(host, shard, victims);
    }

    /// The shard's share changed: passivates what no longer fits.
    fn reshare<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId, share: usize) {
        if self.handoff.is_some() {
            return; // every entity is stopping already
        }
        if let Some(passivator) = &mut self.passivator {
            let victims = passivator.resize(share);
            self.passivate_for_room(host, shard, victims);
        }
    }

    fn passivate_for_room<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        victims: Vec<Arc<str>>,
    ) {
        for victim in victims {
            // A live entity's passivation leaves nothing undelivered: its
            // buffer starts empty.
            let (result, undelivered) = self.passivate(host, shard, &victim, None, true);
            debug_assert!(result.is_ok() && undelivered.is_empty());
        }
    }
}
