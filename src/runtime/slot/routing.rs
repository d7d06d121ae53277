//! Routing one message: to the shard's home elsewhere, into a buffer
//! until the shard has a home, or within a hosted shard to its live entity,
//! behind a passivation or handoff, or to a newly spawned incarnation.

use std::sync::Arc;

use super::{Buffered, Entry, Live, LocalShard, Refused, Slot, SlotHost, State, overflow, refused};
use crate::model::envelope::LocalEnvelope;
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::persistence::remember::RememberEntitiesOperation;

/// How far ahead of a slot's generation an envelope's may be and still be
/// believed (allocations are one generation each; a real lead is small).
const MAX_GENERATION_LEAD: u64 = 1 << 20;

impl<E: Clone> Slot<E> {
    /// Routes one envelope to `entity_id`. On error the envelope was not
    /// accepted (the caller answers it, outside the lock).
    pub(crate) fn deliver<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), Refused> {
        match &mut self.state {
            State::Local(local) => local.deliver(host, shard, entity_id, envelope),
            // Refused by the coordinator: no home will come for what would
            // wait for one (checked under the slot's lock, which `refuse`
            // drains each buffer under, so nothing slips in behind it).
            State::Unallocated { .. } | State::Remote(_) if host.refused() => Err((
                host.refusal().unwrap_or_else(|| overflow(host, shard)),
                Some(envelope),
            )),
            // (A generation absurdly far ahead is a sender's bug, not news:
            // it is forwarded as usual rather than stall the shard.)
            State::Remote(home)
                if envelope.routed_under() > home.generation
                    && envelope.routed_under() - home.generation <= MAX_GENERATION_LEAD =>
            {
                // The sender knows a newer allocation than this node (the
                // coordinator's word on it is on its way here): wait for it
                // rather than forward along an older table. An older home
                // arriving meanwhile is then ignored as stale.
                let generation = envelope.routed_under();
                let requested = host.request_allocation(shard);
                self.state = State::Unallocated {
                    buffer: vec![Buffered::Message(entity_id.clone(), envelope)],
                    requested,
                    generation,
                    installing: false,
                };
                Ok(())
            }
            State::Remote(home) => host.forward(*home, shard, entity_id, envelope),
            State::Unallocated {
                buffer, requested, ..
            } => {
                if buffer.len() >= host.buffer_cap() {
                    return Err((overflow(host, shard), Some(envelope)));
                }
                buffer.push(Buffered::Message(entity_id.clone(), envelope));
                if !*requested {
                    *requested = host.request_allocation(shard);
                }
                Ok(())
            }
            State::Stopped => Err((ShardingError::ShuttingDown, Some(envelope))),
        }
    }

    /// The fast path of a remote envelope: straight into the mailbox of a
    /// live entity of a hosted shard. Gives the envelope back for anything
    /// else (which then takes [`deliver`](Self::deliver)).
    pub(crate) fn deliver_live<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &str,
        envelope: LocalEnvelope,
    ) -> Result<Result<(), ShardingError>, LocalEnvelope> {
        let State::Local(local) = &mut self.state else {
            return Err(envelope);
        };
        // (A shard failed under FailClosed takes the general way, which
        // refuses the message.)
        if host.remembers() && host.check_store(shard).is_err() {
            return Err(envelope);
        }
        match local.entities.get(entity_id) {
            Some(Entry::Live(live)) => match host.send(&live.actor, envelope) {
                Ok(()) => {
                    local.accessed(entity_id);
                    Ok(Ok(()))
                }
                Err(Some(envelope)) => Err(envelope),
                Err(None) => Ok(Err(refused())),
            },
            Some(Entry::Passivating { .. }) | None => Err(envelope),
        }
    }
}

impl<E: Clone> LocalShard<E> {
    /// Routing within a hosted shard: enqueue to the live entity (the
    /// common case), buffer behind a passivation or handoff, or spawn the
    /// entity (replacing a dead incarnation) and enqueue.
    pub(super) fn deliver<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), Refused> {
        if host.remembers()
            && let Err(error) = host.check_store(shard)
        {
            return Err((error, Some(envelope)));
        }
        if let Some(handoff) = &mut self.handoff {
            if handoff.buffer.len() >= host.buffer_cap() {
                return Err((overflow(host, shard), Some(envelope)));
            }
            handoff
                .buffer
                .push(Buffered::Message(entity_id.clone(), envelope));
            return Ok(());
        }
        let envelope = match self.entities.get_mut(entity_id) {
            Some(Entry::Live(live)) => match host.send(&live.actor, envelope) {
                Ok(()) => {
                    self.accessed(entity_id);
                    return Ok(());
                }
                // The actor is gone without its stop notice handled yet: replace it.
                Err(Some(envelope)) => envelope,
                Err(None) => return Err((refused(), None)),
            },
            Some(Entry::Passivating { buffer, .. }) => {
                if buffer.len() >= host.buffer_cap() {
                    return Err((overflow(host, shard), Some(envelope)));
                }
                buffer.push(Buffered::Message(entity_id.clone(), envelope));
                return Ok(());
            }
            None => envelope,
        };
        let actor = match self.spawn(host, shard, entity_id, true) {
            Ok(actor) => actor,
            Err(error) => return Err((error, Some(envelope))),
        };
        host.send(&actor, envelope).map_err(|envelope| {
            let stopped = ShardingError::EntityStopped {
                type_name: host.type_name(),
                entity_id: entity_id.to_string(),
            };
            (stopped, envelope)
        })
    }

    /// Spawns an incarnation; `record` queues its start for the store (a
    /// respawned id is there already).
    pub(super) fn spawn<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        record: bool,
    ) -> ShardingResult<E> {
        self.pending_respawn.remove(entity_id);
        self.make_room(host, shard, entity_id);
        self.last_incarnation += 1;
        let incarnation = self.last_incarnation;
        // (Empty unless the type migrates: no hashing on every spawn.)
        let state = if self.migrated.is_empty() {
            None
        } else {
            self.migrated.remove(entity_id)
        };
        let actor = match host.spawn(shard, self.generation, entity_id, incarnation, state) {
            Ok(actor) => actor,
            Err(e) => {
                // Not live after all: it holds no place in the policy.
                if let Some(passivator) = &mut self.passivator {
                    passivator.remove(entity_id);
                }
                return Err(e);
            }
        };
        self.entities.insert(
            entity_id.clone(),
            Entry::Live(Live {
                actor: actor.clone(),
                incarnation,
            }),
        );
        if record {
            host.record(shard, entity_id, RememberEntitiesOperation::RecordStarted);
        }
        Ok(actor)
    }
}
