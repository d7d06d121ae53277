//! What happened to the cluster as this node saw it: the most recent
//! [`HISTORY_CAPACITY`] events — members joining, leaving, going down or
//! unreachable, split-brain decisions, rebalance rounds, handoffs,
//! migrations and refusals — each with its wall-clock time (SPEC §14.1).
//!
//! [`ClusterNode::recent_events`](crate::cluster::ClusterNode::recent_events)
//! reads them; the management endpoint serves them at `/cluster/events`
//! and the live page lists them. They are kept in memory only: a restarted
//! node starts with an empty history. An event repeated back to back (the
//! same kind and text) is kept once, with its count and latest time, so a
//! fault that repeats does not push the rest out.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::SystemTime;

use crate::membership::MembershipEvent;

/// How many events a node keeps; the oldest go first.
pub const HISTORY_CAPACITY: usize = 512;

/// What kind of event a [`ClusterEvent`] is. Its [`name`](Self::name) is
/// what `/cluster/events` calls it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClusterEventKind {
    /// A member was admitted (Joining).
    MemberJoined,
    /// A member is Up.
    MemberUp,
    /// A member is Leaving.
    MemberLeaving,
    /// A member is Exiting.
    MemberExiting,
    /// A member is Down.
    MemberDowned,
    /// A member was removed.
    MemberRemoved,
    /// Some live observer cannot hear a member.
    Unreachable,
    /// Every observer hears a member again.
    Reachable,
    /// The placement coordinator (oldest reachable Up member) changed.
    CoordinatorChanged,
    /// A seed's handshake refused this node's join (or this node the seed).
    JoinRefused,
    /// This node's split-brain resolver decided: its side stays, or goes down.
    SplitBrainDecision,
    /// The sharding coordinator on this node completed a rebalance round.
    RebalanceRound,
    /// A shard hosted here was handed off: its entities have stopped.
    HandedOff,
    /// A shard moved here with its entities' states.
    StatesReceived,
    /// A shard started here without its entities' states.
    MigrationFellBack,
    /// The coordinator refused this node's region of a type.
    RegionRefused,
    /// A message of a protocol line this build lacks reached a shard hosted
    /// here, which asked to move to a newer node.
    NeedsNewer,
}

impl ClusterEventKind {
    /// The kind in snake case, as `/cluster/events` names it.
    pub fn name(self) -> &'static str {
        match self {
            ClusterEventKind::MemberJoined => "member_joined",
            ClusterEventKind::MemberUp => "member_up",
            ClusterEventKind::MemberLeaving => "member_leaving",
            ClusterEventKind::MemberExiting => "member_exiting",
            ClusterEventKind::MemberDowned => "member_downed",
            ClusterEventKind::MemberRemoved => "member_removed",
            ClusterEventKind::Unreachable => "unreachable",
            ClusterEventKind::Reachable => "reachable",
            ClusterEventKind::CoordinatorChanged => "coordinator_changed",
            ClusterEventKind::JoinRefused => "join_refused",
            ClusterEventKind::SplitBrainDecision => "split_brain_decision",
            ClusterEventKind::RebalanceRound => "rebalance_round",
            ClusterEventKind::HandedOff => "handed_off",
            ClusterEventKind::StatesReceived => "states_received",
            ClusterEventKind::MigrationFellBack => "migration_fell_back",
            ClusterEventKind::RegionRefused => "region_refused",
            ClusterEventKind::NeedsNewer => "needs_newer",
        }
    }
}

/// One event of a node's history.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClusterEvent {
    /// Its place in this node's history, from 1: a reader that keeps the
    /// highest it has seen asks only for what came after. An event
    /// repeated back to back keeps its number.
    pub seq: u64,
    /// When it happened (the latest time, for a repeated one).
    pub at: SystemTime,
    /// What kind of event it is.
    pub kind: ClusterEventKind,
    /// What happened, in words.
    pub text: String,
    /// How many times it happened back to back (1 for most).
    pub count: u64,
}

/// A node's history: shared by its membership driver and the sharding
/// layer on it, read by the management endpoint.
#[derive(Default)]
pub(crate) struct History {
    events: Mutex<Recent>,
}

#[derive(Default)]
struct Recent {
    /// Oldest first.
    events: VecDeque<ClusterEvent>,
    /// The last `seq` given out.
    last: u64,
}

impl History {
    /// Records an event that happened now.
    pub(crate) fn record(&self, kind: ClusterEventKind, text: impl Into<String>) {
        self.record_at(SystemTime::now(), kind, text.into());
    }

    fn record_at(&self, at: SystemTime, kind: ClusterEventKind, text: String) {
        let mut recent = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(newest) = recent.events.back_mut()
            && newest.kind == kind
            && newest.text == text
        {
            newest.count += 1;
            newest.at = at;
            return;
        }
        recent.last += 1;
        let seq = recent.last;
        if recent.events.len() == HISTORY_CAPACITY {
            recent.events.pop_front();
        }
        recent.events.push_back(ClusterEvent {
            seq,
            at,
            kind,
            text,
            count: 1,
        });
    }

    /// The events kept, newest first.
    pub(crate) fn recent(&self) -> Vec<ClusterEvent> {
        let recent = self.events.lock().unwrap_or_else(|p| p.into_inner());
        recent.events.iter().rev().cloned().collect()
    }

    /// A membership event as this node's history words it.
    pub(crate) fn membership(&self, event: &MembershipEvent) {
        use ClusterEventKind as K;
        let (kind, text) = match event {
            MembershipEvent::MemberJoined(m) => (K::MemberJoined, format!("{m} joined")),
            MembershipEvent::MemberUp(m) => (K::MemberUp, format!("{m} is up")),
            MembershipEvent::MemberLeft(m) => (K::MemberLeaving, format!("{m} is leaving")),
            MembershipEvent::MemberExited(m) => (K::MemberExiting, format!("{m} is exiting")),
            MembershipEvent::MemberDowned(m) => (K::MemberDowned, format!("{m} is down")),
            MembershipEvent::MemberRemoved { member, previous } => (
                K::MemberRemoved,
                format!("{member} was removed (it was {previous:?})"),
            ),
            MembershipEvent::Unreachable(m) => (K::Unreachable, format!("{m} is unreachable")),
            MembershipEvent::Reachable(m) => (K::Reachable, format!("{m} is reachable again")),
            MembershipEvent::CoordinatorChanged(Some(m)) => (
                K::CoordinatorChanged,
                format!("{m} is the placement coordinator"),
            ),
            MembershipEvent::CoordinatorChanged(None) => (
                K::CoordinatorChanged,
                "no member can be the placement coordinator".to_owned(),
            ),
            MembershipEvent::JoinRefused {
                seed,
                reason,
                by_seed,
            } => (
                K::JoinRefused,
                if *by_seed {
                    format!("seed {seed} refused this node's join: {reason:?}")
                } else {
                    format!("this node refused seed {seed}: {reason:?}")
                },
            ),
        };
        self.record(kind, text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_history_keeps_the_newest_and_folds_repeats() {
        let history = History::default();
        for i in 0..HISTORY_CAPACITY + 3 {
            history.record(ClusterEventKind::HandedOff, format!("shard {i}"));
        }
        history.record(ClusterEventKind::NeedsNewer, "shard 1");
        history.record(ClusterEventKind::NeedsNewer, "shard 1");
        history.record(ClusterEventKind::NeedsNewer, "shard 2");
        let events = history.recent();
        assert_eq!(events.len(), HISTORY_CAPACITY);
        let newest: Vec<(u64, &str, u64)> = events[..3]
            .iter()
            .map(|e| (e.seq, e.text.as_str(), e.count))
            .collect();
        let n = HISTORY_CAPACITY as u64 + 3;
        assert_eq!(
            newest,
            [
                (n + 2, "shard 2", 1),
                (n + 1, "shard 1", 2),
                (n, "shard 514", 1)
            ]
        );
        // The oldest kept: the first ones went.
        let oldest = events.last().expect("full");
        assert_eq!(oldest.seq, 6);
        assert_eq!(oldest.text, "shard 5");
    }
}
