//! A shard's home changing: a home from the coordinator, a lost node, a
//! refused region, and the states kept for the node a shard moved to.

use super::{Buffered, Entry, HomeChange, ShardHome, Slot, SlotHost, State, Undelivered, messages};
use crate::model::envelope::LocalEnvelope;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::mailbox::States;

impl<E: Clone> Slot<E> {
    /// Applies a home from the coordinator, `me` being this node (`proxy`:
    /// its region routes only, and takes no shard). A home
    /// older than what the slot holds is ignored. Becoming remote sends the
    /// buffered messages on, in order; a shard that was hosted here stops
    /// its entities (each after its mailbox: they are kept as finishing
    /// until their stop notices come) and routes on.
    pub(crate) fn set_home<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        home: ShardHome,
        me: UniqueAddress,
        proxy: bool,
    ) -> (HomeChange, Undelivered) {
        if matches!(&self.state, State::Stopped) {
            return (HomeChange::Unchanged, Vec::new());
        }
        if home.generation < self.generation() {
            return (HomeChange::Stale, Vec::new());
        }
        if home.owner == me && proxy {
            tracing::error!(type_name = host.type_name(), %shard, "a proxy-only region was given a shard; ignored");
            return (HomeChange::Unchanged, Vec::new());
        }
        if home.owner == me {
            let mut undelivered = Vec::new();
            let change = match &mut self.state {
                State::Local(local) => {
                    let moved_back = home.generation > local.generation;
                    local.generation = home.generation;
                    if moved_back {
                        // The shard was being handed off, and its new home
                        // is here after all.
                        undelivered = local.resume(host, shard);
                    }
                    HomeChange::Unchanged
                }
                State::Unallocated {
                    generation,
                    installing,
                    ..
                } => {
                    *generation = home.generation;
                    *installing = true;
                    HomeChange::HostHere
                }
                State::Remote(_) => {
                    self.state = State::Unallocated {
                        buffer: Vec::new(),
                        requested: true,
                        generation: home.generation,
                        installing: true,
                    };
                    HomeChange::HostHere
                }
                State::Stopped => HomeChange::Unchanged,
            };
            return (change, undelivered);
        }
        let previous = std::mem::replace(&mut self.state, State::Remote(home));
        let buffer = match previous {
            State::Unallocated { buffer, .. } => buffer,
            State::Local(mut local) => {
                let mut buffer = Vec::new();
                // What waited behind passivations came before what arrived
                // during a handoff (which took those buffers when it began).
                // Handed off with every entity stopped (reported to the
                // coordinator): the states wait for the new home to fetch.
                let stopped = local.is_stopped();
                let handed_off = local.handoff.take().map(|h| h.buffer);
                for (id, entry) in local.entities {
                    let live = match entry {
                        Entry::Live(live) => {
                            // Under the lock: nothing is enqueued behind it.
                            host.stop(&live.actor);
                            live
                        }
                        Entry::Passivating {
                            live,
                            buffer: waiting,
                            ..
                        } => {
                            buffer.extend(waiting);
                            live
                        }
                    };
                    self.finishing.insert(id, live);
                }
                self.last_incarnation = local.last_incarnation;
                buffer.extend(handed_off.into_iter().flatten());
                if stopped {
                    self.outgoing = Some((home, local.migrated.into_iter().collect()));
                }
                buffer
            }
            State::Remote(_) | State::Stopped => Vec::new(),
        };
        let mut undelivered = Vec::new();
        for item in buffer {
            match item {
                Buffered::Message(entity_id, envelope) => {
                    if let Err((error, Some(envelope))) =
                        host.forward(home, shard, &entity_id, envelope)
                    {
                        undelivered.push((error, envelope));
                    }
                }
                Buffered::Passivate(entity_id) => {
                    let _ = host.passivate_at(home.owner, shard, &entity_id);
                }
            }
        }
        (HomeChange::Remote, undelivered)
    }

    /// Whether the shard is hosted here, handed off and stopped, with states
    /// its entities handed over that have not moved on yet.
    pub(crate) fn holds_states(&self) -> bool {
        matches!(&self.state, State::Local(local) if local.is_stopped() && !local.migrated.is_empty())
    }

    /// Drops the states kept here for the shard's entities (a newer state
    /// is elsewhere), and those its entities still stopping would hand
    /// over (they are taken as an earlier hosting's): their next
    /// incarnations start from the factory. How many were dropped.
    pub(crate) fn drop_states(&mut self) -> usize {
        let State::Local(local) = &mut self.state else {
            return 0;
        };
        for entry in local.entities.values_mut() {
            if let Entry::Passivating { earlier, .. } = entry {
                *earlier = true;
            }
        }
        std::mem::take(&mut local.migrated).len()
    }

    /// The states the shard's entities handed over, with the home the
    /// shard moved to, once it has moved on (see
    /// [`set_home`](Self::set_home)).
    pub(crate) fn take_outgoing(&mut self) -> Option<(ShardHome, States)> {
        self.outgoing.take()
    }

    /// `node` is gone: a shard routed to it waits for a new home (the next
    /// message asks). Whether it was routed there.
    pub(crate) fn node_lost(&mut self, node: &UniqueAddress) -> bool {
        if let State::Remote(home) = &mut self.state
            && home.owner == *node
        {
            self.state = State::unallocated(home.generation);
            return true;
        }
        false
    }

    /// The coordinator refused the region: what waits for a home is given
    /// back (to be failed), and the next message asks again.
    pub(crate) fn drain_refused(&mut self) -> Vec<LocalEnvelope> {
        let State::Unallocated {
            buffer, requested, ..
        } = &mut self.state
        else {
            return Vec::new();
        };
        *requested = false;
        messages(std::mem::take(buffer)).collect()
    }
}
