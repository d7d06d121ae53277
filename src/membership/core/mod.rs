//! The membership state machine: events in, commands out.
//!
//! This module holds the core's type, its state and its constructor; each
//! submodule adds the methods of one concern (inputs, lifecycle, detector,
//! leader, resolver, dissemination, outputs).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::config::MembershipConfig;
use super::error::MembershipError;
use super::gossip::{Gossip, MemberKey};
use super::protocol::Command;
use super::status::MemberStatus;
use crate::model::identity::UniqueAddress;

mod detector;
mod input;
mod leader;
mod lifecycle;
mod pass;
mod publish;
mod resolver;
mod spread;
#[cfg(test)]
mod test_hooks;
mod ticks;
mod view;

/// Where this node is in its own lifecycle.
#[derive(Clone, Debug)]
enum Phase {
    /// Built, `join` not called yet.
    Idle,
    /// Asking seeds to admit it.
    Joining {
        /// Seed addresses other than this node's own.
        seeds: Vec<SocketAddr>,
        /// When to re-send the join requests.
        next_attempt: Instant,
        /// When the first seed gives up and forms a cluster by itself.
        self_join_at: Option<Instant>,
    },
    /// In the member table (any live status).
    Member,
    /// Down, Removed, or gave up waiting for removal: takes no more input.
    Terminated,
}

/// What this node last told its subscribers, to publish only changes.
#[derive(Clone, Debug, Default)]
struct Published {
    statuses: BTreeMap<MemberKey, MemberStatus>,
    unreachable: BTreeSet<MemberKey>,
    coordinator: Option<UniqueAddress>,
}

/// The sans-IO membership core of one node. See the [module docs](super)
/// for the model and the driving loop.
#[derive(Clone, Debug)]
pub struct MembershipCore {
    me: UniqueAddress,
    key: MemberKey,
    config: MembershipConfig,
    phase: Phase,
    gossip: Gossip,
    /// Failure detector, for the members this node watches: when each was
    /// last heard from (for one not heard from since it became watched: a
    /// base that grants it a grace, see `refresh_ring`).
    last_heard: BTreeMap<MemberKey, Instant>,
    /// Starvation credit granted to each watched member since its last
    /// heartbeat (capped at the acceptable pause).
    credit: BTreeMap<MemberKey, Duration>,
    /// The members this node watches: its ring successors, and every member
    /// its own row flags (until it hears them again).
    watched: BTreeSet<MemberKey>,
    /// Where this node's heartbeats go: its ring watchers, and every
    /// observer whose row flags this node.
    targets: Vec<MemberKey>,
    /// The part of `targets` that the ring gives (not the observers that
    /// flag this node): the watchers a dropped target is taken from.
    ring_targets: BTreeSet<MemberKey>,
    /// Former targets that are still live, heartbeated until the instant:
    /// a member that stops heartbeating a watcher because its view moved
    /// keeps doing so while the watcher may not have learnt the move yet.
    lingering: BTreeMap<MemberKey, Instant>,
    /// The live members, oldest first (this node included).
    ring: Vec<MemberKey>,
    /// When each live other member was first seen.
    first_seen: BTreeMap<MemberKey, Instant>,
    /// The leader in this node's view, as of the last full pass.
    leader: Option<MemberKey>,
    /// `self.gossip.digest()`, as of the last full pass.
    digest: u64,
    /// The gossip changed since the last full pass.
    dirty: bool,
    /// A member reported a new digest to this leader since the last full pass.
    seen_changed: bool,
    /// The state changed by a merge: spread the digest.
    spread_pending: bool,
    /// The last (leader, digest) this node reported to its leader.
    reported: Option<(MemberKey, u64)>,
    /// The last state (by digest) sent to each member, and when.
    sent_state: BTreeMap<MemberKey, (u64, Instant)>,
    next_gossip: Instant,
    gossip_rounds: u64,
    rng: u64,
    /// When this node asked to be woken (`poll_timeout` after its last input).
    expected_wake: Option<Instant>,
    /// Split-brain resolver decisions that downed someone: [its side
    /// stayed, its side (or itself) went down].
    resolver_decisions: [u64; 2],
    /// Last state digest each member reported (heartbeat or gossip).
    seen: BTreeMap<MemberKey, u64>,
    /// Since when each member has been unreachable in the gossiped view.
    unreachable_since: BTreeMap<MemberKey, Instant>,
    next_heartbeat: Instant,
    /// An instant and the wall clock's time since the Unix epoch then, when
    /// set ([`align_ticks`](Self::align_ticks)): heartbeat and gossip ticks
    /// fall where that clock shows a multiple of their interval; else one
    /// interval after the last tick.
    tick_anchor: Option<(Instant, Duration)>,
    exit_deadline: Option<Instant>,
    published: Published,
    marked_down: BTreeSet<MemberKey>,
    push_pending: bool,
    commands: Vec<Command>,
    /// The split-brain resolver's view: the members beyond this node's side,
    /// and since when that set has been the same.
    partition: Option<(BTreeSet<MemberKey>, Instant)>,
    /// Since when there have been members beyond this side at all.
    partitioned_since: Option<Instant>,
    /// The members beyond this side changed since the driver last asked
    /// ([`take_partition_changed`](Self::take_partition_changed)).
    partition_changed: bool,
    /// A member (not the leader) judged this partition: its side stays.
    judged: bool,
    /// Set while a timer is handled: resolver decisions are taken only then,
    /// after the whole inbound batch (a node that stalled decides on fresh
    /// heartbeats, not on the view from before its stall).
    deciding: bool,
}

impl MembershipCore {
    /// A core for the node `me`, not yet joined. `now` is the driver's clock.
    pub fn new(
        me: UniqueAddress,
        config: MembershipConfig,
        now: Instant,
    ) -> Result<Self, MembershipError> {
        config.validate()?;
        Ok(MembershipCore {
            me,
            key: MemberKey(me),
            config,
            phase: Phase::Idle,
            gossip: Gossip::default(),
            last_heard: BTreeMap::new(),
            credit: BTreeMap::new(),
            watched: BTreeSet::new(),
            targets: Vec::new(),
            ring_targets: BTreeSet::new(),
            lingering: BTreeMap::new(),
            ring: Vec::new(),
            first_seen: BTreeMap::new(),
            leader: None,
            digest: Gossip::default().digest(),
            dirty: true,
            seen_changed: false,
            spread_pending: false,
            reported: None,
            sent_state: BTreeMap::new(),
            next_gossip: now,
            gossip_rounds: 0,
            rng: me.node_id.0 ^ me.incarnation.rotate_left(32) ^ 0x5851_f42d_4c95_7f2d,
            expected_wake: None,
            resolver_decisions: [0; 2],
            seen: BTreeMap::new(),
            unreachable_since: BTreeMap::new(),
            next_heartbeat: now,
            tick_anchor: None,
            exit_deadline: None,
            published: Published::default(),
            marked_down: BTreeSet::new(),
            push_pending: false,
            commands: Vec::new(),
            partition: None,
            partitioned_since: None,
            partition_changed: false,
            judged: false,
            deciding: false,
        })
    }
}
