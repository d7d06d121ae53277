//! The membership state machine: events in, commands out.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tracing::{debug, info};

use super::config::{MembershipConfig, SplitBrainStrategy};
use super::error::MembershipError;
use super::gossip::{Gossip, MemberKey};
use super::protocol::{Command, MembershipEvent, MembershipMsg, Target};
use super::ring;
use super::state::{Member, MembershipState};
use super::status::MemberStatus;
use crate::identity::UniqueAddress;

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

    /// This node's identity.
    pub fn self_address(&self) -> UniqueAddress {
        self.me
    }

    /// The configuration the core runs with.
    pub fn config(&self) -> &MembershipConfig {
        &self.config
    }

    /// This node's own status, `None` until it is admitted.
    pub fn self_status(&self) -> Option<MemberStatus> {
        self.gossip.status(&self.key)
    }

    /// Whether the node is out of the cluster for good (Down, Removed, or
    /// its exit timed out). It then ignores every input and emits nothing.
    pub fn is_terminated(&self) -> bool {
        matches!(self.phase, Phase::Terminated)
    }

    /// The gossiped state as this node holds it.
    pub fn gossip(&self) -> &Gossip {
        &self.gossip
    }

    /// A snapshot of this node's view.
    pub fn state(&self) -> MembershipState {
        let unreachable = self.gossip.unreachable_keys();
        MembershipState {
            self_member: self.me,
            members: self
                .gossip
                .member_keys()
                .filter(|(_, s)| *s != MemberStatus::Removed)
                .map(|(k, status)| Member {
                    address: k.0,
                    status,
                })
                .collect(),
            unreachable: unreachable.iter().map(|k| k.0).collect(),
            leader: self.leader_key(&unreachable).map(|k| k.0),
            coordinator: self.coordinator_key(&unreachable).map(|k| k.0),
            beyond: self
                .partition
                .iter()
                .flat_map(|(beyond, _)| beyond.iter().map(|k| k.0))
                .collect(),
        }
    }

    /// Whether [`MembershipState::beyond`] changed since the last call (the
    /// driver publishes a new state then, though no event came with it).
    pub fn take_partition_changed(&mut self) -> bool {
        std::mem::take(&mut self.partition_changed)
    }

    /// Takes the commands produced so far, oldest first.
    pub fn drain_commands(&mut self) -> Vec<Command> {
        std::mem::take(&mut self.commands)
    }

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

    /// Starts joining through `seeds`.
    ///
    /// * No seed other than this node's own address: this node forms a new
    ///   cluster at once (and becomes Up and leader).
    /// * Otherwise a [`Join`](MembershipMsg::Join) goes to every other seed,
    ///   re-sent every `join_retry_interval` until one admits this node. If
    ///   this node's address is the *first* seed, it forms a new cluster by
    ///   itself after `seed_timeout` without an answer; other nodes never do.
    pub fn join(&mut self, now: Instant, seeds: &[SocketAddr]) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle => {}
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Joining { .. } | Phase::Member => return Err(MembershipError::AlreadyJoining),
        }
        let mut others: Vec<SocketAddr> = Vec::new();
        for s in seeds {
            if *s != self.me.addr && !others.contains(s) {
                others.push(*s);
            }
        }
        if others.is_empty() {
            return self.self_join(now);
        }
        let first = seeds.first() == Some(&self.me.addr);
        self.phase = Phase::Joining {
            seeds: others,
            next_attempt: now,
            self_join_at: if first {
                now.checked_add(self.config.seed_timeout)
            } else {
                None
            },
        };
        self.send_joins(now);
        Ok(())
    }

    /// The split-brain resolver's decisions on this node that downed
    /// someone so far: `(stayed, went_down)` — its side stayed and it downed
    /// the members beyond it, or its side (or this node alone) went down.
    pub fn split_brain_decisions(&self) -> (u64, u64) {
        (self.resolver_decisions[0], self.resolver_decisions[1])
    }

    /// Starts joining through seeds that discovery will name
    /// ([`set_seeds`](Self::set_seeds)): until then nobody is asked, and
    /// the node does not form a cluster by itself.
    pub fn join_discovered(&mut self, now: Instant) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle => {}
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Joining { .. } | Phase::Member => return Err(MembershipError::AlreadyJoining),
        }
        self.phase = Phase::Joining {
            seeds: Vec::new(),
            next_attempt: now,
            self_join_at: None,
        };
        Ok(())
    }

    /// While joining: the seeds are now `seeds` (this node's own address
    /// left out). A seed not asked before is asked at once. With `may_form`
    /// this node forms a new cluster by itself once `seed_timeout` passes
    /// without an admission (counted from the first such call); without
    /// it, it never does. A member ignores this.
    pub fn set_seeds(
        &mut self,
        now: Instant,
        seeds: &[SocketAddr],
        may_form: bool,
    ) -> Result<(), MembershipError> {
        let me = self.me.addr;
        let timeout = self.config.seed_timeout;
        let Phase::Joining {
            seeds: current,
            self_join_at,
            ..
        } = &mut self.phase
        else {
            return match self.phase {
                Phase::Idle => Err(MembershipError::NotAMember),
                _ => Ok(()),
            };
        };
        let mut others: Vec<SocketAddr> = Vec::new();
        for s in seeds {
            if *s != me && !others.contains(s) {
                others.push(*s);
            }
        }
        let new = others.iter().any(|s| !current.contains(s));
        *current = others;
        match (may_form, *self_join_at) {
            (true, None) => *self_join_at = now.checked_add(timeout),
            (false, Some(_)) => *self_join_at = None,
            _ => {}
        }
        if new {
            self.send_joins(now);
        }
        self.expected_wake = self.poll_timeout();
        Ok(())
    }

    /// Leaves gracefully: this node goes Leaving, then the leader moves it
    /// to Exiting and Removed once every member has seen each step. The node
    /// may shut down when it publishes `MemberRemoved` for itself (or
    /// `is_terminated()` turns true). Idempotent while leaving.
    pub fn leave(&mut self, now: Instant) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle | Phase::Joining { .. } => return Err(MembershipError::NotAMember),
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Member => {}
        }
        match self.self_status() {
            Some(MemberStatus::Joining | MemberStatus::Up) => {
                self.decide(self.key, MemberStatus::Leaving)?;
                self.after_input(now).map(|_| ())
            }
            Some(MemberStatus::Leaving | MemberStatus::Exiting) => Ok(()),
            Some(MemberStatus::Down | MemberStatus::Removed) => Err(MembershipError::Terminated),
            None => Err(MembershipError::Bug(
                "member phase without an own entry".into(),
            )),
        }
    }

    /// Marks `node` Down (manual downing). Any member may down any live
    /// member, itself included. Downing a Down member is a no-op.
    pub fn down(&mut self, now: Instant, node: UniqueAddress) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle | Phase::Joining { .. } => return Err(MembershipError::NotAMember),
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Member => {}
        }
        let key = MemberKey(node);
        match self.gossip.status(&key) {
            None => Err(MembershipError::UnknownMember(node)),
            Some(MemberStatus::Down) => Ok(()),
            Some(MemberStatus::Removed) => Err(MembershipError::IllegalTransition {
                member: node,
                from: MemberStatus::Removed,
                to: MemberStatus::Down,
            }),
            Some(_) => {
                info!(member = %node, "manual down");
                self.decide(key, MemberStatus::Down)?;
                self.after_input(now).map(|_| ())
            }
        }
    }

    /// Advisory: the transport lost its connection to `peer`. Reachability
    /// is decided by heartbeats alone (a pipe may drop and reconnect within
    /// the heartbeat budget), so this only records the fact in the trace.
    pub fn connection_lost(&mut self, _now: Instant, peer: UniqueAddress) {
        debug!(%peer, "connection lost (advisory)");
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

    /// Puts this node's heartbeat and gossip ticks on the wall clock's
    /// grid: from now on each falls where the clock shows a whole multiple
    /// of its interval since the Unix epoch. The driver reads its clock
    /// once: `since_epoch` is what it showed at `anchor`. So the nodes of a
    /// cluster (clocks within a few ms of each other) tick together, for
    /// any interval: a member's heartbeats then arrive together with its
    /// own tick, and it wakes about once per interval instead of once per
    /// watcher (SPEC §10.4). Nothing depends on it for correctness; without
    /// it each node ticks one interval after its last tick.
    pub fn align_ticks(&mut self, anchor: Instant, since_epoch: Duration) {
        self.tick_anchor = Some((anchor, since_epoch));
    }

    /// The next tick after `now` for a timer every `every`.
    fn next_tick(&self, now: Instant, every: Duration) -> Instant {
        let Some((anchor, since_epoch)) = self
            .tick_anchor
            .filter(|(a, _)| *a <= now && !every.is_zero())
        else {
            return later(now, every);
        };
        let every_ns = every.as_nanos();
        let wall_ns = since_epoch.as_nanos() + now.duration_since(anchor).as_nanos();
        let into_tick = wall_ns % every_ns;
        u64::try_from(every_ns - into_tick)
            .ok()
            .and_then(|left| now.checked_add(Duration::from_nanos(left)))
            .unwrap_or_else(|| later(now, every))
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

    /// One gossip round: the digest to `gossip_fanout` random members, and
    /// to the leader when it has not had this node's current digest (or,
    /// against loss, every tenth round).
    fn gossip_round(&mut self) {
        self.gossip_rounds = self.gossip_rounds.wrapping_add(1);
        let mut to: BTreeSet<MemberKey> = self
            .random_others(self.config.gossip_fanout)
            .into_iter()
            .collect();
        if let Some(l) = self.leader
            && l != self.key
            && (self.reported != Some((l, self.digest)) || self.gossip_rounds.is_multiple_of(10))
        {
            to.insert(l);
        }
        for k in to {
            self.send_digest(k);
        }
    }

    /// Sends this node's digest (a `Heartbeat`) to `k`.
    fn send_digest(&mut self, k: MemberKey) {
        if self.leader == Some(k) {
            self.reported = Some((k, self.digest));
        }
        self.send(
            k.0,
            MembershipMsg::Heartbeat {
                digest: self.digest,
            },
        );
    }

    /// Sends this node's whole state to `k`.
    fn send_state(&mut self, k: MemberKey, now: Instant) {
        if self.leader == Some(k) {
            self.reported = Some((k, self.digest));
        }
        self.sent_state.insert(k, (self.digest, now));
        self.send(
            k.0,
            MembershipMsg::Gossip {
                gossip: self.gossip.clone(),
            },
        );
    }

    /// Up to `n` distinct random live members other than this node.
    /// Where a change spreads: `gossip_fanout` random live members and the
    /// leader.
    fn spread_targets(&mut self) -> BTreeSet<MemberKey> {
        let mut to: BTreeSet<MemberKey> = self
            .random_others(self.config.gossip_fanout)
            .into_iter()
            .collect();
        to.extend(self.leader.filter(|l| *l != self.key));
        to
    }

    fn random_others(&mut self, n: usize) -> Vec<MemberKey> {
        let others: Vec<MemberKey> = self
            .ring
            .iter()
            .copied()
            .filter(|k| *k != self.key)
            .collect();
        if others.len() <= n {
            return others;
        }
        let mut picked: Vec<MemberKey> = Vec::with_capacity(n);
        while picked.len() < n {
            let k = others[(self.next_random() % others.len() as u64) as usize];
            if !picked.contains(&k) {
                picked.push(k);
            }
        }
        picked
    }

    fn next_random(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The starved-watcher correction. An input that comes more than a
    /// quarter heartbeat interval after the wake-up this node asked for
    /// means its process was starved: heartbeats may be waiting, unread, in
    /// its pipes. Every watched member then gets at least one heartbeat
    /// interval from now before it can be flagged; the credit a member gets
    /// this way between two of its heartbeats is capped at the acceptable
    /// pause, so a dead member is still flagged by a starved watcher.
    fn note_starvation(&mut self, now: Instant) {
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

    // ---- inputs -------------------------------------------------------

    fn self_join(&mut self, now: Instant) -> Result<(), MembershipError> {
        self.gossip.put_status(self.key, MemberStatus::Joining);
        self.phase = Phase::Member;
        self.next_heartbeat = now;
        self.next_gossip = now;
        self.dirty = true;
        self.push_pending = true;
        self.after_input(now).map(|_| ())
    }

    fn send_joins(&mut self, now: Instant) {
        if let Phase::Joining {
            seeds,
            next_attempt,
            ..
        } = &mut self.phase
        {
            for s in seeds.iter() {
                self.commands.push(Command::Send {
                    to: Target::Seed(*s),
                    msg: MembershipMsg::Join,
                });
            }
            *next_attempt = later(now, self.config.join_retry_interval);
        }
    }

    fn on_welcome(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        gossip: Gossip,
    ) -> Result<(), MembershipError> {
        if gossip.status_of(&self.me).is_none() {
            // Not an admission of this identity (say, meant for an earlier
            // incarnation at this address): keep asking.
            return Ok(());
        }
        info!(me = %self.me, by = %from, "admitted to the cluster");
        self.seen.insert(MemberKey(from), gossip.digest());
        self.gossip = self.gossip.merge(&gossip);
        self.phase = Phase::Member;
        self.next_heartbeat = now;
        self.next_gossip = now;
        self.dirty = true;
        self.after_input(now).map(|_| ())
    }

    fn on_join(&mut self, now: Instant, from: UniqueAddress) -> Result<(), MembershipError> {
        if !matches!(
            self.self_status(),
            Some(MemberStatus::Joining | MemberStatus::Up)
        ) || from.addr == self.me.addr
        {
            return Ok(());
        }
        let fk = MemberKey(from);
        match self.gossip.status(&fk) {
            Some(s) if s.is_live() => {
                // A retried join whose welcome was lost.
                self.send(
                    from,
                    MembershipMsg::Welcome {
                        gossip: self.gossip.clone(),
                    },
                );
                return Ok(());
            }
            Some(_) => return Ok(()), // Down or Removed: that identity is out for good.
            None => {}
        }
        let same_addr: Vec<MemberKey> = self
            .gossip
            .member_keys()
            .filter(|(k, s)| k.0.addr == from.addr && s.is_live())
            .map(|(k, _)| k)
            .collect();
        if same_addr.iter().any(|k| !k.0.is_older_than(&from)) {
            // A newer incarnation already holds the address: a stale joiner.
            return Ok(());
        }
        for old in same_addr {
            info!(old = %old.0, new = %from, "a new incarnation joins at the same address: downing the old one");
            self.decide(old, MemberStatus::Down)?;
        }
        info!(me = %self.me, joiner = %from, "admitting");
        self.gossip.put_status(fk, MemberStatus::Joining);
        self.dirty = true;
        self.push_pending = true;
        self.after_input(now)?;
        if !self.is_terminated() {
            self.send(
                from,
                MembershipMsg::Welcome {
                    gossip: self.gossip.clone(),
                },
            );
        }
        Ok(())
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
            _ => return Ok(()), // a stranger, or quarantined (Down/Removed)
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

    // ---- the common tail of every input ------------------------------

    /// Normalises, takes leader decisions, resyncs the detector and the
    /// ring, publishes what changed, and pushes the state (a change of this
    /// node's own) or its digest (a change learnt by merge) to a few
    /// members. The full pass runs only when something it reads changed or
    /// a timed decision is due, so an input that changes nothing (the
    /// common heartbeat) costs O(log N), not O(N).
    fn after_input(&mut self, now: Instant) -> Result<(), MembershipError> {
        if !matches!(self.phase, Phase::Member) {
            return Ok(());
        }
        let downing_due = self.leader == Some(self.key)
            && self.config.split_brain.is_none()
            && self.config.downing_timeout.is_some_and(|d| {
                self.unreachable_since
                    .values()
                    .any(|since| since.checked_add(d).is_some_and(|t| now >= t))
            });
        let resolving = self.deciding && self.partition.is_some();
        if self.dirty || self.seen_changed || downing_due || resolving {
            self.full_pass(now)?;
        }
        if self.push_pending {
            self.push_pending = false;
            self.spread_pending = false;
            for k in self.spread_targets() {
                self.send_state(k, now);
            }
        } else if self.spread_pending {
            self.spread_pending = false;
            for k in self.spread_targets() {
                self.send_digest(k);
            }
        }
        if self.self_status().is_some_and(|s| !s.is_live()) {
            info!(me = %self.me, status = ?self.self_status(), "this node is out of the cluster");
            self.phase = Phase::Terminated;
        }
        self.expected_wake = self.poll_timeout();
        Ok(())
    }

    fn full_pass(&mut self, now: Instant) -> Result<(), MembershipError> {
        self.gossip.normalize();
        // Each pass moves a member at most one step; a lone node (for which
        // convergence is immediate) may need several passes.
        // Events are published after each pass, so subscribers see every
        // step this node takes itself (Down, then Removed).
        for _ in 0..8 {
            self.refresh_unreachable_since(now);
            self.publish_changes();
            if !self.leader_actions(now)? {
                break;
            }
        }
        self.refresh_unreachable_since(now);
        self.publish_changes();
        let Some(my_status) = self.self_status() else {
            return Err(MembershipError::Bug(
                "member phase without an own entry".into(),
            ));
        };
        if my_status == MemberStatus::Exiting && self.exit_deadline.is_none() {
            self.exit_deadline = now.checked_add(self.config.exit_timeout);
        }
        self.digest = self.gossip.digest();
        self.refresh_ring(now);
        self.dirty = false;
        self.seen_changed = false;
        Ok(())
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
    fn refresh_ring(&mut self, now: Instant) {
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

    fn refresh_unreachable_since(&mut self, now: Instant) {
        let unreachable = self.gossip.unreachable_keys();
        self.unreachable_since
            .retain(|k, _| unreachable.contains(k));
        for k in unreachable {
            self.unreachable_since.entry(k).or_insert(now);
        }
    }

    /// The leader's duties. Returns whether it changed anything.
    fn leader_actions(&mut self, now: Instant) -> Result<bool, MembershipError> {
        let unreachable = self.gossip.unreachable_keys();
        let leader = self.leader_key(&unreachable) == Some(self.key);
        let mut changed = false;
        if let Some(strategy) = self.config.split_brain {
            // Every node follows the partition and judges its side (a member
            // of a losing side downs itself even if its leader's word never
            // reaches it); the leader also downs the others.
            self.track_partition(now, &unreachable);
            if self.deciding {
                changed = self.resolve(now, strategy, leader)?;
            }
        }
        if !leader {
            return Ok(changed);
        }
        if let (None, Some(downing)) = (self.config.split_brain, self.config.downing_timeout) {
            let due: Vec<MemberKey> = self
                .unreachable_since
                .iter()
                .filter(|(_, since)| since.checked_add(downing).is_some_and(|t| now >= t))
                .map(|(k, _)| *k)
                .collect();
            for k in due {
                if self.gossip.status(&k).is_some_and(|s| s.is_live()) {
                    info!(leader = %self.me, member = %k.0, "unreachable past the downing timeout: down");
                    self.decide(k, MemberStatus::Down)?;
                    changed = true;
                }
            }
        }
        if changed || !self.converged(&unreachable) {
            return Ok(changed);
        }
        let snapshot: Vec<(MemberKey, MemberStatus)> = self.gossip.member_keys().collect();
        for (k, status) in snapshot {
            let next = match status {
                MemberStatus::Joining => MemberStatus::Up,
                MemberStatus::Leaving => MemberStatus::Exiting,
                MemberStatus::Exiting | MemberStatus::Down => MemberStatus::Removed,
                MemberStatus::Up | MemberStatus::Removed => continue,
            };
            debug!(leader = %self.me, member = %k.0, from = ?status, to = ?next, "leader action");
            self.decide(k, next)?;
            changed = true;
        }
        Ok(changed)
    }

    /// This node's side: the closure, from this node, over *watch links*
    /// that neither end flags. A watch link goes from a member of the side
    /// to a member it watches in this node's view of the ring (or flags);
    /// only the watcher's row is evidence that it hears the member, and
    /// that row is fresh because the watcher is on this side. A member that
    /// flags the watcher (it cannot hear it) does not join through that
    /// link. One bad link between two members that others watch leaves all
    /// of them on one side. With at most `monitored_by + 1` members every
    /// pair is linked both ways: the closure over all links neither end
    /// flags, as before rings.
    fn side(&self) -> BTreeSet<MemberKey> {
        let ring: Vec<MemberKey> = self.live_keys().into_iter().collect();
        let unreachable = self.gossip.unreachable_keys();
        let k = self.config.monitored_by;
        let mut side = BTreeSet::from([self.key]);
        let mut frontier = vec![self.key];
        while let Some(observer) = frontier.pop() {
            let Ok(at) = ring.binary_search(&observer) else {
                continue;
            };
            for m in ring::watched_by(&ring, at, &unreachable, k) {
                if !side.contains(&m)
                    && !self.gossip.observes_unreachable(&observer, &m)
                    && !self.gossip.observes_unreachable(&m, &observer)
                {
                    side.insert(m);
                    frontier.push(m);
                }
            }
        }
        side
    }

    /// Follows the members beyond this node's side: the set, and since when
    /// it has been the same (any change, an empty set included, starts the
    /// wait over).
    fn track_partition(&mut self, now: Instant, unreachable: &BTreeSet<MemberKey>) {
        // Nobody flagged: everyone is on this side (the common case, at
        // every input; the closure below is quadratic).
        let beyond: BTreeSet<MemberKey> = if unreachable.is_empty() {
            BTreeSet::new()
        } else {
            let side = self.side();
            self.live_keys().difference(&side).copied().collect()
        };
        if beyond.is_empty() {
            self.partition_changed |= self.partition.is_some();
            self.partition = None;
            self.partitioned_since = None;
            self.judged = false;
        } else {
            self.partitioned_since.get_or_insert(now);
            if self
                .partition
                .as_ref()
                .is_none_or(|(seen, _)| *seen != beyond)
            {
                self.partition = Some((beyond, now));
                self.partition_changed = true;
                self.judged = false;
            }
        }
    }

    /// How long a side may stay partitioned without its view ever holding
    /// still for `stable_after` before it gives up and downs itself.
    ///
    /// On a ring that is not all-to-all, a partition is seen whole only
    /// step by step: the watchers at its edge flag the members they watch
    /// beyond it, then watch the next ones (which get a grace before the
    /// detector counts), and so on — about one [detection
    /// step](MembershipConfig::detection_step) per `monitored_by` members
    /// beyond. The limit allows one such step per `monitored_by` live
    /// members beyond the first (none up to `monitored_by` members; one at
    /// `monitored_by + 1`, which is still watched all-to-all: a step too
    /// many, on the safe side).
    fn unstable_limit(&self) -> Duration {
        self.config.unstable_limit(self.ring.len())
    }

    /// Whether this side stays under `strategy`. Joining members count in
    /// the cluster's size but not for a side, nor as the oldest or the
    /// lowest address (one side may not have heard of a joiner at all).
    fn side_stays(
        &self,
        strategy: SplitBrainStrategy,
        side: &BTreeSet<MemberKey>,
        live: &BTreeSet<MemberKey>,
    ) -> bool {
        let settled = |k: &&MemberKey| self.gossip.status(k) != Some(MemberStatus::Joining);
        let s = side.iter().filter(settled).count();
        let n = live.len();
        let beyond: Vec<&MemberKey> = live.iter().filter(|k| !side.contains(k)).collect();
        match strategy {
            SplitBrainStrategy::KeepMajority => {
                if 2 * s != n {
                    2 * s > n
                } else {
                    live.iter()
                        .filter(settled)
                        .map(|k| k.0.addr)
                        .min()
                        .is_some_and(|lowest| side.iter().any(|k| k.0.addr == lowest))
                }
            }
            // A cluster of 2q or more could hold two quorums: nobody stays.
            SplitBrainStrategy::StaticQuorum(quorum) => s >= quorum && n < 2 * quorum,
            SplitBrainStrategy::KeepOldest { down_if_alone } => {
                let oldest = live.iter().filter(settled).min_by_key(|k| k.0.age_key());
                match oldest {
                    Some(o) if side.contains(o) => !(down_if_alone && s == 1 && !beyond.is_empty()),
                    Some(_) => down_if_alone && beyond.len() == 1,
                    None => true,
                }
            }
            SplitBrainStrategy::DownAll => false,
        }
    }

    /// The split-brain resolver, at a timer: once the members beyond this
    /// side have been the same for `stable_after`, the strategy says whether
    /// this side stays. Its leader then marks the members beyond it Down, or
    /// its whole side when it loses; any other member of a losing side marks
    /// itself Down. A side whose view never holds still that long within
    /// `unstable_limit` loses.
    fn resolve(
        &mut self,
        now: Instant,
        strategy: SplitBrainStrategy,
        leader: bool,
    ) -> Result<bool, MembershipError> {
        let Some((beyond, since)) = self.partition.clone() else {
            return Ok(false);
        };
        if self.judged && !leader {
            return Ok(false);
        }
        let stable = now.duration_since(since) >= self.config.stable_after;
        let unstable = self
            .partitioned_since
            .is_some_and(|at| now.duration_since(at) >= self.unstable_limit());
        if !stable && !unstable {
            return Ok(false);
        }
        let live = self.live_keys();
        let side = self.side();
        let stays = stable && self.side_stays(strategy, &side, &live);
        let doomed: Vec<MemberKey> = match (stays, leader) {
            (true, true) => beyond.iter().copied().collect(),
            (false, true) => side.iter().copied().collect(),
            (false, false) => vec![self.key],
            (true, false) => {
                // Nothing for a member to do: its leader downs the others.
                self.judged = true;
                return Ok(false);
            }
        };
        tracing::warn!(
            node = %self.me,
            leader,
            ?strategy,
            side = side.len(),
            live = live.len(),
            stays,
            unstable = !stable,
            "split-brain resolver: {}",
            if stays { "this side stays; downing the members beyond it" } else { "this side loses; downing itself" }
        );
        let mut changed = false;
        for k in doomed {
            if self.gossip.status(&k).is_some_and(|st| st.is_live()) {
                self.decide(k, MemberStatus::Down)?;
                changed = true;
            }
        }
        if changed {
            self.resolver_decisions[usize::from(!stays)] += 1;
        }
        self.partition = None;
        self.partitioned_since = None;
        self.judged = false;
        Ok(changed)
    }

    /// Whether every live member this node must wait for has reported the
    /// very state this node holds. Unreachable members block convergence,
    /// except Exiting ones (they are on their way out anyway).
    fn converged(&self, unreachable: &BTreeSet<MemberKey>) -> bool {
        let digest = self.gossip.digest();
        self.gossip.member_keys().all(|(k, s)| {
            if k == self.key || !s.is_live() {
                return true;
            }
            if unreachable.contains(&k) {
                return s == MemberStatus::Exiting;
            }
            self.seen.get(&k) == Some(&digest)
        })
    }

    /// Applies one decision taken by this node, refusing illegal steps.
    fn decide(&mut self, key: MemberKey, to: MemberStatus) -> Result<(), MembershipError> {
        let Some(from) = self.gossip.status(&key) else {
            return Err(MembershipError::Bug(format!(
                "decision about unknown member {}",
                key.0
            )));
        };
        if !from.can_transition_to(to) {
            return Err(MembershipError::Bug(format!(
                "illegal decision {from:?}->{to:?} for {}",
                key.0
            )));
        }
        self.gossip.put_status(key, to);
        self.gossip.normalize();
        self.dirty = true;
        self.push_pending = true;
        Ok(())
    }

    // ---- derived views ------------------------------------------------

    /// The oldest reachable member among Up and Leaving ones; failing that,
    /// the oldest reachable live member. This node always counts itself
    /// reachable here: otherwise a node that others flagged before they
    /// became unreachable to it would find no leader and never down them.
    fn leader_key(&self, unreachable: &BTreeSet<MemberKey>) -> Option<MemberKey> {
        let candidates: Vec<(MemberKey, MemberStatus)> = self
            .gossip
            .member_keys()
            .filter(|(k, s)| s.is_live() && (*k == self.key || !unreachable.contains(k)))
            .collect();
        candidates
            .iter()
            .find(|(_, s)| matches!(s, MemberStatus::Up | MemberStatus::Leaving))
            .or(candidates.first())
            .map(|(k, _)| *k)
    }

    /// The oldest reachable Up member.
    fn coordinator_key(&self, unreachable: &BTreeSet<MemberKey>) -> Option<MemberKey> {
        self.gossip
            .member_keys()
            .find(|(k, s)| *s == MemberStatus::Up && !unreachable.contains(k))
            .map(|(k, _)| k)
    }

    /// Every live member, this node included.
    fn live_keys(&self) -> BTreeSet<MemberKey> {
        self.gossip
            .member_keys()
            .filter(|(_, s)| s.is_live())
            .map(|(k, _)| k)
            .collect()
    }

    // ---- outputs ------------------------------------------------------

    fn send(&mut self, to: UniqueAddress, msg: MembershipMsg) {
        self.commands.push(Command::Send {
            to: Target::Member(to),
            msg,
        });
    }

    /// Publishes every difference between the current view and the last
    /// published one; sends a last gossip to members that just went Down or
    /// Removed, then marks them down for the transport.
    fn publish_changes(&mut self) {
        let unreachable = self.gossip.unreachable_keys();
        let mut newly_out: Vec<(MemberKey, bool)> = Vec::new();
        let current: Vec<(MemberKey, MemberStatus)> = self.gossip.member_keys().collect();
        for (k, status) in current {
            let prev = self.published.statuses.get(&k).copied();
            if prev == Some(status) {
                continue;
            }
            let m = k.0;
            let event = match (prev, status) {
                // A tombstone learnt on arrival: never seen live, nothing to say.
                (None, MemberStatus::Down | MemberStatus::Removed) => None,
                (_, MemberStatus::Joining) => Some(MembershipEvent::MemberJoined(m)),
                (_, MemberStatus::Up) => Some(MembershipEvent::MemberUp(m)),
                (_, MemberStatus::Leaving) => Some(MembershipEvent::MemberLeft(m)),
                (_, MemberStatus::Exiting) => Some(MembershipEvent::MemberExited(m)),
                (_, MemberStatus::Down) => Some(MembershipEvent::MemberDowned(m)),
                (Some(previous), MemberStatus::Removed) => Some(MembershipEvent::MemberRemoved {
                    member: m,
                    previous,
                }),
            };
            if let Some(e) = event {
                self.commands.push(Command::Publish(e));
            }
            if !status.is_live() && k != self.key && !self.marked_down.contains(&k) {
                newly_out.push((k, prev.is_some_and(|p| p.is_live())));
            }
            self.published.statuses.insert(k, status);
        }
        for k in unreachable.difference(&self.published.unreachable) {
            self.commands
                .push(Command::Publish(MembershipEvent::Unreachable(k.0)));
        }
        for k in self.published.unreachable.difference(&unreachable) {
            if self.gossip.status(k).is_some_and(|s| s.is_live()) {
                self.commands
                    .push(Command::Publish(MembershipEvent::Reachable(k.0)));
            }
        }
        let coordinator = self.coordinator_key(&unreachable).map(|k| k.0);
        if coordinator != self.published.coordinator {
            self.commands
                .push(Command::Publish(MembershipEvent::CoordinatorChanged(
                    coordinator,
                )));
            self.published.coordinator = coordinator;
        }
        self.published.unreachable = unreachable;
        for (k, was_live) in newly_out {
            if was_live {
                // Best effort: tell it its fate, so a wrongly downed node stops.
                self.send(
                    k.0,
                    MembershipMsg::Gossip {
                        gossip: self.gossip.clone(),
                    },
                );
            }
            self.commands.push(Command::MarkDown(k.0));
            self.marked_down.insert(k);
        }
    }
}

/// `now + d`, saturating far in the future instead of panicking.
fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(3_600)))
        .unwrap_or(now)
}

#[cfg(test)]
impl MembershipCore {
    /// The former heartbeat targets still heartbeated, and until when.
    pub(crate) fn lingering_for_tests(&self) -> Vec<(UniqueAddress, Instant)> {
        self.lingering.iter().map(|(k, t)| (k.0, *t)).collect()
    }

    /// Where this node's heartbeats go.
    pub(crate) fn targets_for_tests(&self) -> Vec<UniqueAddress> {
        self.targets.iter().map(|k| k.0).collect()
    }

    /// A member of an already formed cluster holding `gossip` (simulations
    /// of large clusters). Its view is published silently.
    pub(crate) fn formed_for_tests(
        me: UniqueAddress,
        config: MembershipConfig,
        now: Instant,
        gossip: Gossip,
    ) -> Self {
        let mut core = MembershipCore::new(me, config, now).expect("valid config");
        core.gossip = gossip;
        core.phase = Phase::Member;
        core.dirty = true;
        core.after_input(now).expect("a formed state");
        core.commands.clear();
        core
    }
}
