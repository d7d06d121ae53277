//! Passivation and stop notices: an entity stops after its mailbox, what
//! arrives meanwhile waits, and its stop notice replays that in order.

use std::sync::Arc;

use super::{Buffered, Entry, LocalShard, Slot, SlotHost, State, Undelivered, overflow, waits_in};
use crate::entity::MigratedState;
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::persistence::remember::RememberEntitiesOperation;

impl<E: Clone> Slot<E> {
    /// Passivates `entity_id` — only `incarnation` if one is named (a request
    /// from the entity itself), else whichever is current. While the entity's
    /// messages still wait in a buffer (shard not yet allocated, or entity
    /// already passivating), the request is buffered behind them. A request
    /// `from_remote` (another node sent it here) is not sent on again when
    /// the shard is not hosted here, so two disagreeing tables cannot bounce
    /// it between them.
    pub(crate) fn passivate<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        from_remote: bool,
    ) -> (ShardingResult<()>, Undelivered) {
        match &mut self.state {
            State::Unallocated { buffer, .. } => {
                let result = if !waits_in(buffer, entity_id) {
                    Ok(())
                } else if buffer.len() >= host.buffer_cap() {
                    Err(overflow(host, shard))
                } else {
                    buffer.push(Buffered::Passivate(entity_id.clone()));
                    Ok(())
                };
                (result, Vec::new())
            }
            State::Local(local) => local.passivate(host, shard, entity_id, incarnation, false),
            State::Remote(_) if from_remote => (Ok(()), Vec::new()),
            // A request from an entity's own incarnation is always local.
            State::Remote(home) if incarnation.is_none() => {
                (host.passivate_at(home.owner, shard, entity_id), Vec::new())
            }
            State::Remote(_) => (Ok(()), Vec::new()),
            State::Stopped => (Err(ShardingError::ShuttingDown), Vec::new()),
        }
    }

    /// Incarnation `incarnation` of `entity_id` stopped (its stop notice):
    /// finish its passivation by replaying what waited, or forget a crashed
    /// incarnation. `state`: the one it handed over, stopped to move, kept
    /// for its next incarnation wherever the shard goes (dropped when the
    /// shard has moved on without it: a move that did not wait for it).
    pub(crate) fn entity_stopped<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> Undelivered {
        match &mut self.state {
            State::Local(local) => local.stopped(host, shard, entity_id, incarnation, state),
            State::Unallocated { .. } | State::Remote(_) | State::Stopped => {
                if state.is_some() {
                    tracing::debug!(type_name = host.type_name(), %shard, %entity_id, "a state handed over after its shard moved on is dropped");
                }
                if self
                    .finishing
                    .get(entity_id)
                    .is_some_and(|live| live.incarnation == incarnation)
                {
                    self.finishing.remove(entity_id);
                }
                Vec::new()
            }
        }
    }
}

impl<E: Clone> LocalShard<E> {
    pub(super) fn passivate<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        by_limit: bool,
    ) -> (ShardingResult<()>, Undelivered) {
        if let Some(handoff) = &mut self.handoff {
            // Every entity is stopping already; a remembered one is now
            // forgotten, so that no next home respawns it (not for a stale
            // request of an earlier incarnation). A request from outside
            // still applies to the messages waiting for that home.
            let current = self.entities.get(entity_id).map(Entry::incarnation);
            let stale = incarnation.is_some_and(|i| current.is_some_and(|c| c != i));
            if !stale && handoff.respawn.remove(entity_id) {
                host.record(shard, entity_id, RememberEntitiesOperation::RecordStopped);
            }
            if incarnation.is_some() || !waits_in(&handoff.buffer, entity_id) {
                // Passivated where it stands: no state of it moves on.
                if !stale {
                    handoff.passivated.insert(entity_id.clone());
                    self.migrated.remove(entity_id);
                }
                return (Ok(()), Vec::new());
            }
            if handoff.buffer.len() >= host.buffer_cap() {
                return (Err(overflow(host, shard)), Vec::new());
            }
            handoff.buffer.push(Buffered::Passivate(entity_id.clone()));
            return (Ok(()), Vec::new());
        }
        let live = match self.entities.remove(entity_id) {
            Some(Entry::Live(live)) if incarnation.is_none_or(|i| i == live.incarnation) => live,
            Some(Entry::Passivating {
                live,
                mut buffer,
                earlier,
            }) => {
                // Only an explicit request, for the incarnation that comes next.
                let mut result = Ok(());
                if incarnation.is_none() && !buffer.is_empty() {
                    if buffer.len() >= host.buffer_cap() {
                        result = Err(overflow(host, shard));
                    } else {
                        buffer.push(Buffered::Passivate(entity_id.clone()));
                    }
                }
                let entry = Entry::Passivating {
                    live,
                    buffer,
                    earlier,
                };
                self.entities.insert(entity_id.clone(), entry);
                return (result, Vec::new());
            }
            // A request from an earlier incarnation: stale.
            Some(other @ Entry::Live(_)) => {
                self.entities.insert(entity_id.clone(), other);
                return (Ok(()), Vec::new());
            }
            None => return (Ok(()), Vec::new()),
        };
        if let Some(passivator) = &mut self.passivator {
            passivator.remove(entity_id);
        }
        host.record(shard, entity_id, RememberEntitiesOperation::RecordStopped);
        // Stop after what is queued (the host's marker, not ractor's
        // `drain`). Nothing can be enqueued behind it: the entity is no
        // longer Live, and all sends happen under the shard's lock.
        let stop_sent = host.stop(&live.actor);
        let stopped = live.incarnation;
        self.entities.insert(
            entity_id.clone(),
            Entry::Passivating {
                live,
                buffer: Vec::new(),
                earlier: false,
            },
        );
        if stop_sent {
            host.passivated(shard, by_limit);
            (Ok(()), Vec::new())
        } else {
            // Already gone (it crashed, not passivated): finish now.
            (Ok(()), self.stopped(host, shard, entity_id, stopped, None))
        }
    }

    fn stopped<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> Undelivered {
        match self.entities.get(entity_id) {
            Some(entry) if entry.incarnation() == incarnation => {}
            Some(Entry::Live(_) | Entry::Passivating { .. }) | None => return Vec::new(),
        }
        if let Some(passivator) = &mut self.passivator {
            passivator.remove(entity_id); // (a crashed one was live)
        }
        let removed = self.entities.remove(entity_id);
        // Only a state handed over by this hosting's handoff stop is kept
        // (not one of an earlier hosting's incarnation, finishing after a
        // move that did not wait for it), and never over one that migrated
        // in, nor for an entity passivated meanwhile.
        let this_hosting = matches!(removed, Some(Entry::Passivating { earlier: false, .. }));
        let passivated = self
            .handoff
            .as_ref()
            .is_some_and(|h| h.passivated.contains(entity_id));
        if let Some(state) = state
            && this_hosting
            && !passivated
        {
            self.migrated.entry(entity_id.clone()).or_insert(state);
        }
        // A state kept for this id (handed over by a handoff called off,
        // or migrated in while an earlier incarnation finished) starts the
        // next incarnation at once: it was live.
        if self.handoff.is_none()
            && !self.migrated.is_empty()
            && self.migrated.contains_key(entity_id)
        {
            self.start_from_state(host, shard, entity_id);
        }
        let undelivered = match removed {
            Some(Entry::Passivating { buffer, .. }) => self.replay(host, shard, buffer),
            Some(Entry::Live(_)) | None => Vec::new(),
        };
        self.report_if_stopped(host, shard);
        undelivered
    }

    /// Replays buffered items in order, returning the messages that could
    /// not be delivered.
    pub(super) fn replay<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        buffer: Vec<Buffered>,
    ) -> Undelivered {
        let mut undelivered = Vec::new();
        for item in buffer {
            match item {
                Buffered::Message(entity_id, envelope) => {
                    if let Err((error, Some(envelope))) =
                        self.deliver(host, shard, &entity_id, envelope)
                    {
                        undelivered.push((error, envelope));
                    }
                }
                Buffered::Passivate(entity_id) => {
                    let (result, more) = self.passivate(host, shard, &entity_id, None, false);
                    if let Err(error) = result {
                        tracing::warn!(type_name = host.type_name(), %shard, %error, "buffered passivation dropped");
                    }
                    undelivered.extend(more);
                }
            }
        }
        undelivered
    }
}
