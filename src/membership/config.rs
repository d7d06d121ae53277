//! Tunables of the membership core, with the defaults and what they imply.

use std::time::Duration;

use super::error::MembershipError;

/// Timing of heartbeats, failure detection, downing and joining.
///
/// The defaults target a LAN or loopback cluster under heavy load:
///
/// | setting | default |
/// |---|---|
/// | `heartbeat_interval` | 100 ms |
/// | `acceptable_heartbeat_pause` | 300 ms |
/// | `downing_timeout` | `Some(200 ms)` |
/// | `monitored_by` | 5 |
/// | `gossip_fanout` | 2 |
/// | `gossip_interval` | 1 s |
///
/// A member that stops is marked Unreachable by an observer at most
/// `heartbeat_interval + acceptable_heartbeat_pause` = **400 ms** after the
/// last heartbeat that observer received from it, and Down by the leader
/// `downing_timeout` later: **≤ 600 ms** from the last heartbeat to Down
/// (plus one network hop for the leader to learn the observation). A live
/// member whose heartbeats arrive late by up to the 300 ms pause (a loaded
/// pipe, a delayed task) is never marked Unreachable. Beyond that it may be
/// flagged Unreachable, and it is Downed only if the leader goes on seeing
/// it Unreachable for the whole downing timeout: a stall that ends within
/// roughly `acceptable_heartbeat_pause + downing_timeout` (≈ 500 ms) is
/// cleared before Down when the network itself is fast.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipConfig {
    /// How often each member sends a heartbeat to each of its watchers.
    pub heartbeat_interval: Duration,
    /// Extra silence tolerated beyond `heartbeat_interval` before an observer
    /// marks the peer Unreachable.
    pub acceptable_heartbeat_pause: Duration,
    /// How long a member stays Unreachable before the leader marks it Down.
    /// `None` disables timeout downing: only [`down`](super::MembershipCore::down)
    /// downs a member.
    pub downing_timeout: Option<Duration>,
    /// How long an observer waits for the *first* heartbeat of a member it
    /// has just learnt about before the failure detector starts counting.
    /// Knowledge spreads by gossip, so a new observer may know a member
    /// before that member knows the observer and starts heartbeating it; the
    /// grace keeps that lag from flagging the member. A member never heard
    /// from is flagged `first_heartbeat_grace + failure_timeout()` after it
    /// was first seen.
    pub first_heartbeat_grace: Duration,
    /// How often a joining node re-sends its join request to the seeds.
    pub join_retry_interval: Duration,
    /// How long the *first* seed (the one whose address is first in the seed
    /// list) waits for another seed to admit it before it forms a new cluster
    /// by itself.
    pub seed_timeout: Duration,
    /// How long an Exiting node waits for the leader to mark it Removed
    /// before it considers itself removed anyway.
    pub exit_timeout: Duration,
    /// The split-brain resolver: which side of a partition survives. `None`
    /// keeps timeout downing (`downing_timeout`), under which both sides of a
    /// partition down each other and go on.
    pub split_brain: Option<SplitBrainStrategy>,
    /// How long the resolver's view of the partition must stay the same
    /// before it decides.
    pub stable_after: Duration,
    /// How many members watch each member (heartbeat it and run a failure
    /// detector on it): its `monitored_by` predecessors on the ring of live
    /// members sorted by age, not counting unreachable ones (SPEC §10.5).
    /// A cluster of at most `monitored_by + 1` members is watched
    /// all-to-all.
    pub monitored_by: usize,
    /// How many random live members a gossip round, and a change of the
    /// state, sends the state digest (or, for a change of this node's own,
    /// the state) to.
    pub gossip_fanout: usize,
    /// How often a gossip round sends the digest to `gossip_fanout` random
    /// members. Changes spread at once (a push or a digest to
    /// `gossip_fanout` members and the leader, and on from each member that
    /// learns them); rounds only repair what was lost or missed.
    pub gossip_interval: Duration,
}

/// Which side of a partition stays (the other downs itself). A side is what
/// this node reaches, directly or through members it reaches (so one bad
/// link between two members that others both reach is no partition).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitBrainStrategy {
    /// The side with more than half of the live members stays; on an even
    /// split, the side with the lowest address.
    KeepMajority,
    /// A side of at least this many live members stays; a smaller one downs
    /// itself (both may, if the cluster shrank below it).
    StaticQuorum(usize),
    /// The side with the oldest member stays. With `down_if_alone`, an
    /// oldest member cut off alone downs itself and the others stay.
    KeepOldest {
        /// Down the oldest member when it is alone on its side.
        down_if_alone: bool,
    },
    /// Every side downs itself.
    DownAll,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            heartbeat_interval: Duration::from_millis(100),
            acceptable_heartbeat_pause: Duration::from_millis(300),
            downing_timeout: Some(Duration::from_millis(200)),
            first_heartbeat_grace: Duration::from_secs(1),
            join_retry_interval: Duration::from_millis(250),
            seed_timeout: Duration::from_millis(500),
            exit_timeout: Duration::from_secs(2),
            split_brain: None,
            stable_after: Duration::from_secs(1),
            monitored_by: 5,
            gossip_fanout: 2,
            gossip_interval: Duration::from_secs(1),
        }
    }
}

impl MembershipConfig {
    /// With a split-brain resolver, a bound on how far apart in time the
    /// two sides of a clean partition of `members` live members take their
    /// decisions (SPEC §13.15). A side that stays decides no sooner than
    /// `F − H + S` after the cut (heartbeat H, failure timeout F,
    /// `stable_after` S: its first detection, then a view that held still).
    /// A side that loses detects no later than `F` + the starved-watcher
    /// credit (at most the pause P) + one [detection
    /// step](Self::detection_step) per ring cascade step, and gives up no
    /// later than the unstable limit after that (`2S + F` + the same
    /// cascade). The difference: `S + F + H + P + 2 × steps × (P + F)`, with
    /// `steps = (members − 1) / monitored_by`.
    pub fn resolver_decision_spread(&self, members: usize) -> Duration {
        let steps = self.cascade_steps(members);
        let step = self.detection_step();
        self.stable_after
            .saturating_add(self.failure_timeout())
            .saturating_add(self.heartbeat_interval)
            .saturating_add(self.acceptable_heartbeat_pause)
            .saturating_add(step.saturating_mul(steps.saturating_mul(2)))
    }

    /// Ring cascade steps of a partition of `members` live members: a side
    /// is seen whole one detection step per `monitored_by` members beyond
    /// the first (SPEC §10.5).
    pub fn cascade_steps(&self, members: usize) -> u32 {
        u32::try_from(members.saturating_sub(1) / self.monitored_by.max(1)).unwrap_or(u32::MAX)
    }

    /// With a split-brain resolver, how long a side of `members` live
    /// members may stay partitioned without its view holding still for
    /// `stable_after` before it gives up: `2S + F` plus one detection step
    /// per cascade step (SPEC §10.5).
    pub fn unstable_limit(&self, members: usize) -> Duration {
        self.stable_after
            .saturating_mul(2)
            .saturating_add(self.failure_timeout())
            .saturating_add(
                self.detection_step()
                    .saturating_mul(self.cascade_steps(members)),
            )
    }

    /// How long a member that starts watching another (because the ring
    /// moved: a nearer watcher was flagged) takes to flag it if it is
    /// silent: a grace of the pause `P` (this node's state reaching the
    /// member, and its first heartbeat coming back), then the failure
    /// timeout `F`: `P + F` in all (700 ms by default), plus up to `P` of
    /// starved-watcher credit. A partition of a large ring is seen whole one
    /// such step per `monitored_by` members; `stable_after` must be longer
    /// than a step for a side to wait for the whole of it (SPEC §10.10).
    pub fn detection_step(&self) -> Duration {
        self.acceptable_heartbeat_pause
            .saturating_add(self.failure_timeout())
    }

    /// The silence after which an observer marks a peer Unreachable:
    /// `heartbeat_interval + acceptable_heartbeat_pause`.
    pub fn failure_timeout(&self) -> Duration {
        self.heartbeat_interval
            .saturating_add(self.acceptable_heartbeat_pause)
    }

    /// Time from a crashed member's last delivered heartbeat to its Down
    /// (network latency not included): with timeout downing, at most the
    /// failure timeout plus the downing timeout; with a split-brain
    /// resolver, the failure timeout plus `stable_after` once every
    /// observer's view holds still (a view that keeps changing is decided
    /// by the unstable limit, up to `2 × stable_after` + failure timeout
    /// after detection). `None` with neither (manual downing only).
    pub fn detect_and_down_time(&self) -> Option<Duration> {
        let wait = match self.split_brain {
            Some(_) => Some(self.stable_after),
            None => self.downing_timeout,
        };
        wait.map(|d| self.failure_timeout().saturating_add(d))
    }

    /// Checks that every period is non-zero (a zero period would make the
    /// core ask to be woken at the same instant forever).
    pub fn validate(&self) -> Result<(), MembershipError> {
        let periods = [
            ("heartbeat_interval", self.heartbeat_interval),
            ("join_retry_interval", self.join_retry_interval),
            ("gossip_interval", self.gossip_interval),
        ];
        if self.monitored_by == 0 {
            return Err(MembershipError::InvalidConfig {
                reason: "monitored_by must be at least 1".into(),
            });
        }
        if self.split_brain == Some(SplitBrainStrategy::StaticQuorum(0)) {
            return Err(MembershipError::InvalidConfig {
                reason: "a static quorum must be at least 1".into(),
            });
        }
        for (name, value) in periods {
            if value.is_zero() {
                return Err(MembershipError::InvalidConfig {
                    reason: format!("{name} must be non-zero"),
                });
            }
        }
        Ok(())
    }
}
