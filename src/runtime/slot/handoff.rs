//! Handing a hosted shard off: its entities stop, what arrives waits, and
//! the host hears when none is left; or the handoff is called off and the
//! shard resumes here.

use std::collections::HashSet;

use super::{Entry, HandingOff, Live, LocalShard, Slot, SlotHost, State, Undelivered};
use crate::model::extractor::ShardId;

impl<E: Clone> Slot<E> {
    /// The coordinator moves the shard, hosted here under `generation`:
    /// every entity stops after what its mailbox holds (its remembered
    /// state stays, for the next home to respawn), and what arrives
    /// meanwhile is buffered. When the last entity has stopped the host
    /// hears `shard_stopped`. A request for another generation, or for a
    /// shard not hosted here yet (it is starting), is ignored; the
    /// coordinator asks again.
    pub(crate) fn hand_off<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        generation: u64,
    ) {
        let State::Local(local) = &mut self.state else {
            return;
        };
        if local.generation != generation {
            return;
        }
        match &mut local.handoff {
            // Asked again: the report may have been lost.
            Some(handoff) => handoff.reported = false,
            None => {
                let mut buffer = Vec::new();
                let mut respawn = std::mem::take(&mut local.pending_respawn);
                for (id, entry) in local.entities.iter_mut() {
                    match entry {
                        Entry::Live(live) => {
                            // Under the lock: nothing can be enqueued behind
                            // the stop marker, as for a passivation; from now
                            // on the handoff buffer takes what comes.
                            let live = Live {
                                actor: live.actor.clone(),
                                incarnation: live.incarnation,
                            };
                            if !host.stop_to_move(&live.actor) {
                                tracing::debug!(type_name = host.type_name(), %shard, "entity gone before its handoff stop");
                            }
                            respawn.insert(id.clone());
                            *entry = Entry::Passivating {
                                live,
                                buffer: Vec::new(),
                                earlier: false,
                            };
                        }
                        // What waited behind a passivation comes first.
                        Entry::Passivating {
                            buffer: waiting, ..
                        } => buffer.append(waiting),
                    }
                }
                if !host.remembers() {
                    respawn.clear();
                }
                if let Some(passivator) = &mut local.passivator {
                    passivator.clear(); // every entity is stopping
                }
                local.handoff = Some(HandingOff {
                    buffer,
                    reported: false,
                    respawn,
                    passivated: HashSet::new(),
                });
            }
        }
        local.report_if_stopped(host, shard);
    }

    /// Whether the shard is hosted here under `generation`, handed off and
    /// empty: its `ShardStopped` still needs an answer.
    pub(crate) fn is_handed_off(&self, generation: u64) -> bool {
        matches!(&self.state, State::Local(local)
            if local.generation == generation && local.is_stopped())
    }

    /// Whether the shard is hosted here, handed off, with every entity
    /// stopped: it hosts nothing and waits for its next home.
    pub(crate) fn is_stopped_here(&self) -> bool {
        matches!(&self.state, State::Local(local) if local.is_stopped())
    }

    /// A new coordinator: a handoff it did not ask for, that has not
    /// reported the shard stopped yet, is called off (the shard stays here
    /// and what waited is delivered here). A reported one goes on.
    pub(crate) fn call_off_handoff<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
    ) -> Undelivered {
        match &mut self.state {
            State::Local(local) if local.handoff.as_ref().is_some_and(|h| !h.reported) => {
                local.resume(host, shard)
            }
            State::Unallocated { .. } | State::Local(_) | State::Remote(_) | State::Stopped => {
                Vec::new()
            }
        }
    }
}

impl<E: Clone> LocalShard<E> {
    /// Handed off, with every entity stopped.
    pub(super) fn is_stopped(&self) -> bool {
        self.handoff.is_some() && self.entities.is_empty()
    }

    /// Tells the host a handed-off shard has no entity left (once per stop;
    /// the driver repeats it to the coordinator until a new home comes).
    pub(super) fn report_if_stopped<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
    ) {
        let Some(handoff) = &mut self.handoff else {
            return;
        };
        if handoff.reported || !self.entities.is_empty() {
            return;
        }
        handoff.reported = true;
        host.shard_stopped(shard, self.generation);
    }

    /// Ends a handoff with the shard staying here: the buffer is replayed
    /// in order, and remembered ids stopped by the handoff are respawned
    /// (at the respawn rate, once their incarnation has stopped).
    pub(super) fn resume<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
    ) -> Undelivered {
        let Some(handoff) = self.handoff.take() else {
            return Vec::new();
        };
        self.start_migrated(host, shard);
        let undelivered = self.replay(host, shard, handoff.buffer);
        let respawn = handoff
            .respawn
            .into_iter()
            .filter(|id| !matches!(self.entities.get(id), Some(Entry::Live(_))));
        self.pending_respawn.extend(respawn);
        if !self.pending_respawn.is_empty() {
            self.respawn_batch(host, shard);
        }
        undelivered
    }
}
