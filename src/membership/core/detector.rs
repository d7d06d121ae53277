//! The failure detector: the ring of live members that says whom this node
//! watches and heartbeats, the grace a newly watched member gets, the
//! starved-watcher correction, and since when each member is unreachable.

use std::collections::BTreeSet;
use std::time::Instant;

use tracing::debug;

use super::ticks::later;
use super::{MembershipCore, Phase};
use crate::membership::gossip::MemberKey;
use crate::membership::ring;

impl MembershipCore {
    /// The starved-watcher correction. An input that comes more than a
    /// quarter heartbeat interval after the wake-up this node asked for
    /// means its process was starved: heartbeats may be waiting, unread, in
    /// its pipes. Every watched member then gets at least one heartbeat
    /// interval from now before it can be flagged; the credit a member gets
    /// this way between two of its heartbeats is capped at the acceptable
    /// pause, so a dead member is still flagged by a starved watcher.
    pub(super) fn note_starvation(&mut self, now: Instant) {
        if !matches!(self.phase, Phase::Member) {
            return;
        }
        let Some(due) = self.expected_wake else {
            return;
        };
        let late = now.saturating_duration_since(due);
        if late <= self.config.heartbeat_interval / 4 {
            return;
        }
        let timeout = self.config.failure_timeout();
        let Some(floor) = later(now, self.config.heartbeat_interval).checked_sub(timeout) else {
            return;
        };
        let pause = self.config.acceptable_heartbeat_pause;
        debug!(me = %self.me, ?late, "this node was starved: its watched members get the time back");
        for (k, heard) in self.last_heard.iter_mut() {
            if *heard >= floor {
                continue;
            }
            let credit = self.credit.entry(*k).or_default();
            let give = floor
                .duration_since(*heard)
                .min(pause.saturating_sub(*credit));
            *heard += give;
            *credit += give;
        }
    }

    /// Recomputes the ring, the leader, whom this node watches and whom it
    /// heartbeats. A member this node starts watching gets a grace before
    /// the detector counts: `first_heartbeat_grace` from when it was first
    /// seen (a joiner may not know this node yet), and at least the pause
    /// from now. An old member may not know yet that it should
    /// heartbeat this node: the change that moved the ring (a third member
    /// flagged or gone) may not have reached it. So this node sends it its
    /// whole state at once (a digest would cost two more hops before the
    /// news arrived; a member heartbeats a new watcher at once), and the
    /// grace covers that delivery and the first heartbeat coming back (the
    /// pause P), before the usual timeout counts.
    pub(super) fn refresh_ring(&mut self, now: Instant) {
        let unreachable = self.gossip.unreachable_keys();
        self.leader = self.leader_key(&unreachable);
        self.ring = self.live_keys().into_iter().collect();
        let ring = &self.ring;
        self.first_seen.retain(|k, _| ring.binary_search(k).is_ok());
        for k in &self.ring {
            if *k != self.key {
                self.first_seen.entry(*k).or_insert(now);
            }
        }
        self.seen.retain(|k, _| self.first_seen.contains_key(k));
        self.sent_state
            .retain(|k, _| self.first_seen.contains_key(k));
        let Ok(me) = self.ring.binary_search(&self.key) else {
            self.watched.clear();
            self.targets.clear();
            self.ring_targets.clear();
            self.lingering.clear();
            self.last_heard.clear();
            return;
        };
        let k = self.config.monitored_by;
        let mut watched: BTreeSet<MemberKey> = ring::watched_by(&self.ring, me, &unreachable, k)
            .into_iter()
            .collect();
        watched.extend(self.gossip.row_subjects(&self.key));
        let ring_targets: BTreeSet<MemberKey> = ring::watchers_of(&self.ring, me, &unreachable, k)
            .into_iter()
            .collect();
        let mut targets = ring_targets.clone();
        targets.extend(self.gossip.observers_of(&self.key));
        let told = self.watch(now, watched);
        let dropped = self.retarget(now, ring_targets, targets);
        let inform: BTreeSet<MemberKey> = told.into_iter().chain(dropped).collect();
        for m in inform {
            self.send_state(m, now);
        }
    }

    /// Makes `watched` the members this node watches. Each newly watched
    /// member gets its grace (see `refresh_ring`); returns those this node
    /// knew before now (they may not know yet that they must heartbeat it).
    fn watch(&mut self, now: Instant, watched: BTreeSet<MemberKey>) -> Vec<MemberKey> {
        self.last_heard.retain(|m, _| watched.contains(m));
        self.credit.retain(|m, _| watched.contains(m));
        let mut told = Vec::new();
        for m in &watched {
            if self.last_heard.contains_key(m) {
                continue;
            }
            let first = self.first_seen.get(m).copied().unwrap_or(now);
            let base = later(first, self.config.first_heartbeat_grace)
                .max(later(now, self.config.acceptable_heartbeat_pause));
            self.last_heard.insert(*m, base);
            if first < now {
                told.push(*m);
            }
        }
        self.watched = watched;
        told
    }

    /// Makes `targets` (the ring's watchers, `ring_targets`, and the
    /// observers that flag this node) where its heartbeats go. A new
    /// watcher known before now may already be counting (a newcomer gives
    /// this node the first-heartbeat grace): it is heartbeated at once. A
    /// ring watcher dropped may still watch this node until the change
    /// reaches it: it keeps getting heartbeats for `first_heartbeat_grace`
    /// (the time a member is given to learn of a membership change);
    /// returns those, to be sent this node's state. An observer that
    /// cleared its flag is not one: it heard this node.
    fn retarget(
        &mut self,
        now: Instant,
        ring_targets: BTreeSet<MemberKey>,
        targets: BTreeSet<MemberKey>,
    ) -> Vec<MemberKey> {
        let dropped: Vec<MemberKey> = self
            .ring_targets
            .iter()
            .filter(|t| !targets.contains(t) && self.ring.binary_search(t).is_ok())
            .copied()
            .collect();
        let added: Vec<MemberKey> = targets
            .iter()
            .filter(|t| !self.targets.contains(t))
            .filter(|t| self.first_seen.get(t).is_some_and(|first| *first < now))
            .copied()
            .collect();
        let ring = &self.ring;
        self.lingering
            .retain(|t, _| !targets.contains(t) && ring.binary_search(t).is_ok());
        for t in &dropped {
            self.lingering
                .insert(*t, later(now, self.config.first_heartbeat_grace));
        }
        self.targets = targets.into_iter().collect();
        self.ring_targets = ring_targets;
        for m in added {
            self.send_digest(m);
        }
        dropped
    }

    pub(super) fn refresh_unreachable_since(&mut self, now: Instant) {
        let unreachable = self.gossip.unreachable_keys();
        self.unreachable_since
            .retain(|k, _| unreachable.contains(k));
        for k in unreachable {
            self.unreachable_since.entry(k).or_insert(now);
        }
    }
}
