//! A stopping region takes its entities and buffered messages out of a slot.

use super::{Entry, Slot, State, messages};
use crate::model::envelope::LocalEnvelope;

/// What a stopping region takes out of a slot.
pub(crate) struct Taken<E> {
    /// The hosted shard's entities, to stop.
    pub(crate) entities: Vec<E>,
    /// Entities of an earlier hosting finishing their mailboxes, to wait for.
    pub(crate) finishing: Vec<E>,
    /// Messages that waited in buffers, to fail.
    pub(crate) buffered: Vec<LocalEnvelope>,
}

impl<E: Clone> Slot<E> {
    /// The region stops: the slot becomes `Stopped` and gives up its
    /// entities (hosted and finishing) and its buffered messages (to be failed
    /// with `ShuttingDown`). A remote home is kept: envelopes that still
    /// arrive are forwarded.
    pub(crate) fn take(&mut self) -> Taken<E> {
        let mut taken = Taken {
            entities: Vec::new(),
            finishing: self.finishing.drain().map(|(_, live)| live.actor).collect(),
            buffered: Vec::new(),
        };
        if matches!(&self.state, State::Remote(_)) {
            return taken;
        }
        let buffered = |buffer, into: &mut Vec<LocalEnvelope>| into.extend(messages(buffer));
        match std::mem::replace(&mut self.state, State::Stopped) {
            State::Unallocated { buffer, .. } => buffered(buffer, &mut taken.buffered),
            State::Local(mut local) => {
                if let Some(handoff) = local.handoff.take() {
                    buffered(handoff.buffer, &mut taken.buffered);
                }
                for entry in local.entities.into_values() {
                    match entry {
                        Entry::Live(live) => taken.entities.push(live.actor),
                        Entry::Passivating {
                            live,
                            buffer,
                            earlier,
                        } => {
                            if earlier {
                                taken.finishing.push(live.actor);
                            } else {
                                taken.entities.push(live.actor);
                            }
                            buffered(buffer, &mut taken.buffered);
                        }
                    }
                }
            }
            State::Remote(_) | State::Stopped => {}
        }
        taken
    }
}
