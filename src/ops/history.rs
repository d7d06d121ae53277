//! What happened to the cluster as this node saw it: the most recent
//! [`HISTORY_CAPACITY`] events — members joining, leaving, going down or
//! unreachable, split-brain decisions, rebalance rounds, handoffs,
//! migrations and refusals — each with its wall-clock time (SPEC §14.1).
//!
//! [`ClusterNode::recent_events`](crate::cluster::ClusterNode::recent_events)
//! reads them; the management endpoint serves them at `/cluster/events`
//! and the live page lists them. They are kept in memory only: a restarted
//! node starts with an empty history.
//!
//! An event of the same kind and text as one of the last [`FOLD_LOOKBACK`]
//! events, within [`FOLD_WINDOW`] of that one's latest time, is folded into
//! it: its count grows, its time moves on, and an event about a shard adds
//! the shard to its list. So a kill that moves a hundred shards, or an
//! upgrade whose shards ask to move every second, makes one event each,
//! and does not push out the joins and downs that explain it.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

use crate::membership::MembershipEvent;

/// How many events a node keeps; the oldest go first.
pub const HISTORY_CAPACITY: usize = 512;

/// How many of the newest events an event may be folded into.
pub const FOLD_LOOKBACK: usize = 16;

/// How recent an event must be (its latest time) for another to be folded
/// into it.
pub const FOLD_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

/// How many shards one event lists at most (its count goes on).
const MAX_SHARDS_LISTED: usize = 1_024;

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
    /// Its place in this node's history, from 1 (kept when later ones are
    /// folded into it).
    pub seq: u64,
    /// The history's change number when it was recorded or last folded
    /// into: a reader that keeps the highest it has seen asks only for
    /// what changed after it.
    pub changed: u64,
    /// When it happened, by the wall clock (the latest time, for a folded
    /// one).
    pub at: SystemTime,
    /// What kind of event it is.
    pub kind: ClusterEventKind,
    /// What happened, in words (an event about shards names its entity
    /// type; the shards are in `shards`).
    pub text: String,
    /// How many times it happened (more than 1 when others were folded
    /// in; a shard that comes again counts again, and is listed once).
    pub count: u64,
    /// The shards it concerns, in the order they came, each once (at most
    /// 1,024 listed); empty for an event about no shard.
    pub shards: Vec<u32>,
}

/// A node's history: shared by its membership driver and the sharding
/// layer on it, read by the management endpoint.
#[derive(Default)]
pub(crate) struct History {
    events: Mutex<Recent>,
}

#[derive(Default)]
struct Recent {
    /// Oldest first, each with the monotonic time it last happened (the
    /// fold window is measured on it: a step of the wall clock neither
    /// folds nor splits events).
    events: VecDeque<(ClusterEvent, Instant)>,
    /// The last `seq` given out.
    last_seq: u64,
    /// The last change number given out.
    last_change: u64,
}

impl History {
    /// Records an event that happened now.
    pub(crate) fn record(&self, kind: ClusterEventKind, text: impl Into<String>) {
        self.record_at(Instant::now(), kind, text.into(), None);
    }

    /// Records an event about `shard` that happened now; `text` names its
    /// entity type and not the shard.
    pub(crate) fn record_shard(&self, kind: ClusterEventKind, shard: u32, text: String) {
        self.record_at(Instant::now(), kind, text, Some(shard));
    }

    fn record_at(&self, now: Instant, kind: ClusterEventKind, text: String, shard: Option<u32>) {
        let at = SystemTime::now();
        let mut recent = self.events.lock().unwrap_or_else(|p| p.into_inner());
        recent.last_change += 1;
        let changed = recent.last_change;
        let fold = (recent.events.iter_mut().rev().take(FOLD_LOOKBACK)).find(|(e, last)| {
            e.kind == kind && e.text == text && now.saturating_duration_since(*last) <= FOLD_WINDOW
        });
        if let Some((event, last)) = fold {
            event.count += 1;
            event.at = at;
            *last = now;
            event.changed = changed;
            if let Some(shard) = shard
                && event.shards.len() < MAX_SHARDS_LISTED
                && !event.shards.contains(&shard)
            {
                event.shards.push(shard);
            }
            return;
        }
        recent.last_seq += 1;
        let seq = recent.last_seq;
        if recent.events.len() == HISTORY_CAPACITY {
            recent.events.pop_front();
        }
        let event = ClusterEvent {
            seq,
            changed,
            at,
            kind,
            text,
            count: 1,
            shards: shard.into_iter().collect(),
        };
        recent.events.push_back((event, now));
    }

    /// The events kept that changed after change number `after` (0: all),
    /// newest first.
    pub(crate) fn changed_after(&self, after: u64) -> Vec<ClusterEvent> {
        let recent = self.events.lock().unwrap_or_else(|p| p.into_inner());
        (recent.events.iter().rev())
            .filter(|(e, _)| e.changed > after)
            .map(|(e, _)| e.clone())
            .collect()
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
            history.record(ClusterEventKind::MemberUp, format!("node {i} is up"));
        }
        let events = history.changed_after(0);
        assert_eq!(events.len(), HISTORY_CAPACITY);
        // The oldest went first.
        let oldest = events.last().expect("full");
        assert_eq!((oldest.seq, oldest.text.as_str()), (4, "node 3 is up"));
        let last = events[0].changed;

        // Shards of one kind and text fold into one event, each listed
        // once, whatever came between (within the last 16 events).
        let fell_back = || "counter: started without their states".to_owned();
        history.record_shard(ClusterEventKind::MigrationFellBack, 7, fell_back());
        history.record(ClusterEventKind::Unreachable, "node 9 is unreachable");
        history.record_shard(ClusterEventKind::MigrationFellBack, 3, fell_back());
        history.record_shard(ClusterEventKind::MigrationFellBack, 7, fell_back());
        let changed = history.changed_after(last);
        let seen: Vec<(u64, ClusterEventKind, u64, Vec<u32>)> = (changed.iter())
            .map(|e| (e.seq, e.kind, e.count, e.shards.clone()))
            .collect();
        let n = HISTORY_CAPACITY as u64 + 3;
        assert_eq!(
            seen,
            [
                (n + 2, ClusterEventKind::Unreachable, 1, vec![]),
                (n + 1, ClusterEventKind::MigrationFellBack, 3, vec![7, 3]),
            ]
        );
        // Only what changed after a change number comes back.
        let newest_change = changed.iter().map(|e| e.changed).max().expect("two");
        assert!(history.changed_after(newest_change).is_empty());
        history.record_shard(ClusterEventKind::MigrationFellBack, 9, fell_back());
        let again = history.changed_after(newest_change);
        assert_eq!(again.len(), 1);
        assert_eq!((again[0].seq, again[0].count), (n + 1, 4));

        // Past the window, or past the lookback, an event stands alone.
        let long_ago =
            (Instant::now().checked_sub(FOLD_WINDOW * 2)).expect("a machine up for 20 s");
        let history = History::default();
        history.record_at(long_ago, ClusterEventKind::NeedsNewer, "x".into(), Some(1));
        history.record_shard(ClusterEventKind::NeedsNewer, 1, "x".into());
        assert_eq!(history.changed_after(0).len(), 2);
        let history = History::default();
        history.record(ClusterEventKind::Reachable, "a");
        for i in 0..FOLD_LOOKBACK {
            history.record(ClusterEventKind::MemberUp, format!("{i}"));
        }
        history.record(ClusterEventKind::Reachable, "a");
        assert_eq!(history.changed_after(0).len(), FOLD_LOOKBACK + 2);
    }
}
