//! Starting to host a shard here: installing it, starting the entities
//! whose states migrated with it, and respawning its remembered entities
//! in batches.

use std::collections::HashSet;
use std::sync::Arc;

use super::{Entry, LocalShard, Slot, SlotHost, State, Undelivered};
use crate::model::extractor::ShardId;
use crate::runtime::mailbox::States;
use crate::runtime::passivation::Passivator;

impl<E: Clone> Slot<E> {
    /// Makes the shard local (hosting number `install`), starts each
    /// entity whose state `migrated` with the shard from it, starts
    /// respawning `remembered` and replays the buffer in order. `None`
    /// (and the slot left as it was) when a newer home arrived meanwhile,
    /// the shard is local already or the region stopped. An entity of an
    /// earlier hosting still finishing its mailbox is taken in as
    /// passivating: what comes for it waits until it has stopped.
    pub(crate) fn install<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        generation: u64,
        install: u64,
        remembered: Option<Vec<String>>,
        migrated: States,
    ) -> Option<Undelivered> {
        if self.generation() > generation {
            return None;
        }
        let buffer = match &mut self.state {
            State::Unallocated { buffer, .. } => std::mem::take(buffer),
            State::Remote(_) => Vec::new(),
            State::Local(_) | State::Stopped => return None,
        };
        let entities = self
            .finishing
            .drain()
            .map(|(id, live)| {
                let entry = Entry::Passivating {
                    live,
                    buffer: Vec::new(),
                    earlier: true,
                };
                (id, entry)
            })
            .collect();
        let mut local = LocalShard {
            generation,
            entities,
            last_incarnation: self.last_incarnation,
            install,
            pending_respawn: HashSet::new(),
            handoff: None,
            passivator: host
                .entity_share()
                .map(|(share, policy)| Box::new(Passivator::new(policy, share))),
            migrated: migrated.into_iter().collect(),
        };
        if let Some(ids) = remembered {
            local.pending_respawn = ids.into_iter().map(Arc::<str>::from).collect();
        }
        // The migrated entities were live on their old owner: they start
        // at once, each from its state, before any message.
        local.start_migrated(host, shard);
        if !local.pending_respawn.is_empty() {
            local.respawn_batch(host, shard);
        }
        let undelivered = local.replay(host, shard, buffer);
        self.state = State::Local(Box::new(local));
        Some(undelivered)
    }

    /// The region actor's turn to respawn more remembered ids, if the slot
    /// is still the hosting `install`.
    pub(crate) fn respawn_more<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        install: u64,
    ) {
        if let State::Local(local) = &mut self.state
            && local.install == install
        {
            local.respawn_batch(host, shard);
        }
    }

    /// Asks for an allocation unless one is asked for already (a shard with
    /// remembered entities, at registration).
    pub(crate) fn request_if_idle<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
    ) {
        if let State::Unallocated { requested, .. } = &mut self.state
            && !*requested
        {
            *requested = host.request_allocation(shard);
        }
    }
}

impl<E: Clone> LocalShard<E> {
    /// Starts every entity whose state is kept here and that is not
    /// running (one still finishing starts when it has stopped).
    /// Under an active-entity limit, only as many as the share has room
    /// for: the rest keep their states until their next message (rather
    /// than start only to be passivated, states lost, by the next ones).
    pub(super) fn start_migrated<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId) {
        let room = match &self.passivator {
            Some(passivator) => {
                let share = host
                    .entity_share()
                    .map_or(passivator.share(), |(share, _)| share);
                share.saturating_sub(passivator.len())
            }
            None => usize::MAX,
        };
        let ids: Vec<Arc<str>> = self
            .migrated
            .keys()
            .filter(|id| !self.entities.contains_key(*id))
            .take(room)
            .cloned()
            .collect();
        for id in ids {
            self.start_from_state(host, shard, &id);
        }
    }

    /// Starts `entity_id` from the state kept for it (a spawn that fails
    /// loses the state: its next message starts it from the factory).
    pub(super) fn start_from_state<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) {
        let record = !self.pending_respawn.contains(entity_id);
        if let Err(error) = self.spawn(host, shard, entity_id, record) {
            tracing::warn!(type_name = host.type_name(), %shard, %entity_id, %error, "an entity with a migrated state did not start");
        }
    }

    /// Respawns up to a batch of the shard's pending remembered ids, and has
    /// the host come back for the rest after the respawn interval (Akka's
    /// constant-rate recovery), so a shard with very many remembered ids
    /// does not stampede. A message for an id not respawned yet spawns it at
    /// once (and takes it off the pending set), as any message does.
    pub(super) fn respawn_batch<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId) {
        if !host.remembers() {
            return;
        }
        // (An id whose previous incarnation is still stopping waits for the
        // next batch.)
        let ids: Vec<Arc<str>> = self
            .pending_respawn
            .iter()
            .filter(|id| !self.entities.contains_key(*id))
            .take(host.respawn_batch())
            .cloned()
            .collect();
        for id in ids {
            self.pending_respawn.remove(&id);
            if let Err(error) = self.spawn(host, shard, &id, false) {
                tracing::warn!(type_name = host.type_name(), %shard, %error, "remember-entities: respawn failed");
            }
        }
        if !self.pending_respawn.is_empty() {
            host.respawn_later(shard, self.install);
        }
    }
}
