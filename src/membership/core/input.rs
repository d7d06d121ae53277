//! The inputs a driver feeds the core: messages from members and the timer
//! (heartbeats, the failure detector's deadlines, join retries), and when
//! the core next needs that timer.

use std::time::Instant;

use tracing::{debug, info};

use super::{MembershipCore, Phase};
use crate::membership::error::MembershipError;
use crate::membership::gossip::{Gossip, MemberKey};
use crate::membership::protocol::{Command, MembershipEvent, MembershipMsg};
use crate::membership::status::MemberStatus;
use crate::model::identity::UniqueAddress;

impl MembershipCore {
    /// When the core next needs [`handle_timeout`](Self::handle_timeout);
    /// `None` when it needs no wake-up. May be in the past: call it at once.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Idle | Phase::Terminated => None,
            Phase::Joining {
                next_attempt,
                self_join_at,
                ..
            } => Some(self_join_at.map_or(*next_attempt, |t| t.min(*next_attempt))),
            Phase::Member => {
                let mut next = self.next_heartbeat.min(self.next_gossip);
                let timeout = self.config.failure_timeout();
                for (k, heard) in &self.last_heard {
                    if !self.gossip.observes_unreachable(&self.key, k)
                        && let Some(t) = heard.checked_add(timeout)
                    {
                        next = next.min(t);
                    }
                }
                // The resolver's wake-up: when the view will have held
                // still for stable_after, or, if that comes later, when the
                // side gives up on an unstable view.
                if let Some((_, since)) = &self.partition
                    && !self.judged
                {
                    let stable = since.checked_add(self.config.stable_after);
                    let unstable = self
                        .partitioned_since
                        .and_then(|at| at.checked_add(self.unstable_limit()));
                    if let Some(t) = match (stable, unstable) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    } {
                        next = next.min(t);
                    }
                }
                if let Some(downing) = self.config.downing_timeout
                    && self.config.split_brain.is_none()
                    && self.leader == Some(self.key)
                {
                    for since in self.unreachable_since.values() {
                        if let Some(t) = since.checked_add(downing) {
                            next = next.min(t);
                        }
                    }
                }
                if let Some(t) = self.exit_deadline {
                    next = next.min(t);
                }
                Some(next)
            }
        }
    }

    /// Handles a message from `from` (the identity the pipe authenticated).
    pub fn handle_message(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        msg: MembershipMsg,
    ) -> Result<(), MembershipError> {
        if from == self.me {
            return Ok(());
        }
        self.note_starvation(now);
        let result = self.dispatch(now, from, msg);
        self.expected_wake = self.poll_timeout();
        result
    }

    fn dispatch(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        msg: MembershipMsg,
    ) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle | Phase::Terminated => Ok(()),
            Phase::Joining { .. } => match msg {
                MembershipMsg::Welcome { gossip } => self.on_welcome(now, from, gossip),
                MembershipMsg::Join
                | MembershipMsg::Gossip { .. }
                | MembershipMsg::Heartbeat { .. } => Ok(()),
            },
            Phase::Member => match msg {
                MembershipMsg::Join => self.on_join(now, from),
                MembershipMsg::Welcome { gossip } | MembershipMsg::Gossip { gossip } => {
                    self.on_gossip(now, from, gossip)
                }
                MembershipMsg::Heartbeat { digest } => self.on_heartbeat(now, from, digest),
            },
        }
    }

    /// Advisory: the transport lost its connection to `peer`. Reachability
    /// is decided by heartbeats alone (a pipe may drop and reconnect within
    /// the heartbeat budget), so this only records the fact in the trace.
    pub fn connection_lost(&mut self, _now: Instant, peer: UniqueAddress) {
        debug!(%peer, "connection lost (advisory)");
    }

    /// Handles the wake-up asked for by [`poll_timeout`](Self::poll_timeout):
    /// sends heartbeats, runs the failure detector, retries joins, takes the
    /// leader's timed decisions. Calling it early or often is harmless.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), MembershipError> {
        self.note_starvation(now);
        let result = self.on_timeout(now);
        self.expected_wake = self.poll_timeout();
        result
    }

    fn on_timeout(&mut self, now: Instant) -> Result<(), MembershipError> {
        match &self.phase {
            Phase::Idle | Phase::Terminated => Ok(()),
            Phase::Joining {
                next_attempt,
                self_join_at,
                ..
            } => {
                if self_join_at.is_some_and(|t| now >= t) {
                    info!(me = %self.me, "no seed answered: the first seed forms a new cluster");
                    return self.self_join(now);
                }
                if now >= *next_attempt {
                    self.send_joins(now);
                }
                Ok(())
            }
            Phase::Member => {
                let timeout = self.config.failure_timeout();
                let silent: Vec<MemberKey> = self
                    .last_heard
                    .iter()
                    .filter(|(k, heard)| {
                        heard.checked_add(timeout).is_some_and(|t| now >= t)
                            && !self.gossip.observes_unreachable(&self.key, k)
                    })
                    .map(|(k, _)| *k)
                    .collect();
                for k in silent {
                    debug!(me = %self.me, member = %k.0, "no heartbeat within the budget: unreachable");
                    if self.gossip.observe(self.key, k, true) {
                        self.dirty = true;
                        self.push_pending = true;
                    }
                }
                if self.exit_deadline.is_some_and(|t| now >= t) {
                    info!(me = %self.me, "leader did not remove this exiting node in time; considering it removed");
                    self.phase = Phase::Terminated;
                    self.commands
                        .push(Command::Publish(MembershipEvent::MemberRemoved {
                            member: self.me,
                            previous: MemberStatus::Exiting,
                        }));
                    return Ok(());
                }
                self.deciding = true;
                let result = self.after_input(now).map(|_| ());
                self.deciding = false;
                result?;
                if self.is_terminated() {
                    return Ok(());
                }
                if now >= self.next_heartbeat {
                    self.lingering.retain(|_, until| now < *until);
                    let lingering: Vec<MemberKey> = self.lingering.keys().copied().collect();
                    for k in self.targets.clone().into_iter().chain(lingering) {
                        self.send_digest(k);
                    }
                    self.next_heartbeat = self.next_tick(now, self.config.heartbeat_interval);
                }
                if now >= self.next_gossip {
                    self.gossip_round();
                    self.next_gossip = self.next_tick(now, self.config.gossip_interval);
                }
                Ok(())
            }
        }
    }

    fn on_gossip(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        gossip: Gossip,
    ) -> Result<(), MembershipError> {
        let fk = MemberKey(from);
        match self.gossip.status(&fk) {
            Some(s) if s.is_live() => {}
            // Unknown: a member this node has not heard of yet (the push
            // that announced it went to a few members, not all) is taken in
            // when its state lists both it and this node as live.
            None if gossip.status_of(&from).is_some_and(|s| s.is_live())
                && gossip.status_of(&self.me).is_some_and(|s| s.is_live()) => {}
            // A stranger, or quarantined (Down/Removed: not `is_live`).
            Some(_) | None => return Ok(()),
        }
        let theirs = gossip.digest();
        self.note_seen(fk, theirs);
        let merged = self.gossip.merge(&gossip);
        let answer = merged != gossip;
        if merged != self.gossip {
            // Learnt something: spread the news (digest first).
            self.gossip = merged;
            self.dirty = true;
            self.spread_pending = true;
        }
        self.after_input(now)?;
        if answer && !self.is_terminated() {
            // The sender lacks something this node knows: answer with it.
            self.send_state(fk, now);
        }
        Ok(())
    }

    /// Records the digest `k` reported; the leader re-checks convergence
    /// when it changed.
    fn note_seen(&mut self, k: MemberKey, digest: u64) {
        if self.seen.insert(k, digest) != Some(digest) && self.leader == Some(self.key) {
            self.seen_changed = true;
        }
    }

    fn on_heartbeat(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        digest: u64,
    ) -> Result<(), MembershipError> {
        let fk = MemberKey(from);
        match self.gossip.status(&fk) {
            Some(s) if s.is_live() => {}
            None => {
                // A member that knows this node but is not known here yet:
                // answer with this state; if the sender knows more (itself),
                // it answers back with the merge, which is taken in.
                let recent = self.sent_state.get(&fk).is_some_and(|(d, at)| {
                    *d == self.digest && now < *at + self.config.heartbeat_interval * 3
                });
                if !recent && !self.is_terminated() {
                    self.send_state(fk, now);
                }
                return Ok(());
            }
            Some(_) => return Ok(()), // quarantined (Down/Removed)
        }
        if let Some(heard) = self.last_heard.get_mut(&fk) {
            *heard = now;
            self.credit.remove(&fk);
        }
        if self.gossip.observes_unreachable(&self.key, &fk) {
            debug!(me = %self.me, member = %from, "heartbeat resumed: reachable again");
            self.gossip.observe(self.key, fk, false);
            self.dirty = true;
            self.push_pending = true;
        }
        self.note_seen(fk, digest);
        self.after_input(now)?;
        if !self.is_terminated() && digest != self.digest {
            // Another state: answer with this one, unless it went to that
            // member within three heartbeat intervals (a push, or an answer to the same digest
            // from a member that heartbeats faster than the state moves).
            let recent = self.sent_state.get(&fk).is_some_and(|(d, at)| {
                *d == self.digest && now < *at + self.config.heartbeat_interval * 3
            });
            if !recent {
                self.send_state(fk, now);
            }
        }
        Ok(())
    }
}
