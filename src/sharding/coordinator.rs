//! The shard coordinator: where each shard of each entity type lives.
//!
//! A sans-IO core, like [`MembershipCore`](crate::membership::MembershipCore):
//! events go in with the current time, `Command`s come out, and the driver
//! calls `CoordinatorCore::tick` as time passes. It holds no socket, spawns nothing and
//! reads no clock, so tests drive it through joins, crashes and takeovers
//! deterministically.
//!
//! ```text
//!  membership state ──┐                       ┌─► Home    to every region of the type
//!  Register (region) ──┤                       ├─► Table   to a registering region
//!  GetHome  (region) ──┤    CoordinatorCore    ├─► Refused (fingerprint / shard count)
//!  ShardStopped (owner)┤  table[type][shard]   ├─► HandOff to a shard's owner
//!  Leave / Unregister ─┤ = (owner, generation) └─► RebalanceRound records
//!  tick(now) ──────────┘
//! ```
//!
//! Every node runs one core; it acts only while its node is the placement
//! coordinator (the oldest reachable Up member). The rules:
//!
//! * **Eligible owners** of a type are members that are Up, reachable, and
//!   have registered a region of that type. Down, Exiting and Removed
//!   members (and members gone from the view) are *gone*: their shards are
//!   reallocated at once, as [`RebalanceReason::DeadOwner`] moves, never
//!   capped; so are the shards of a member whose region of the type stopped
//!   (`Unregister`). Other members (Joining, Leaving, unreachable) keep what
//!   they own but get nothing new.
//! * **Allocation** goes through a [`ShardAllocationStrategy`];
//!   [`LeastShardAllocation`] is the default.
//! * **Generations.** Every allocation of a shard gets a generation one
//!   above the highest this core has seen for it; regions accept a home only
//!   with a generation at least as high as the one they hold.
//! * **Takeover.** A core that becomes active starts from what it knows —
//!   the local region's replica of the table and every registration it has
//!   received (each carries the registering region's replica, its own
//!   shards included) — keeping the highest generation per shard. For a settle
//!   period (until every eligible member has registered with it, or
//!   `settle` has passed) it answers only with known homes of live owners
//!   and reallocates nothing, so a shard whose owner has not re-registered
//!   yet is not given a second home.
//! * **Moving a live shard** (a GracefulSpread rebalance, or the graceful
//!   leave of its owner) is a handoff: the core sends `HandOff` to the
//!   owner, which stops the shard's entities and answers `ShardStopped`;
//!   only then is the shard allocated anew (through the strategy), so two
//!   nodes do not host it at once — except after a handoff not finished
//!   within `handoff_timeout`, which completes as a DeadOwner move while the
//!   old owner's stuck entity may still run. A handoff whose owner is gone
//!   meanwhile is reallocated with the owner's other shards.
//! * **Rebalance.** Every `rebalance_interval`, for each type with no
//!   handoff in progress, the strategy names live shards to move; at most
//!   `rebalance_per_round` of them start moving.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::extractor::ShardId;
use crate::identity::UniqueAddress;
use crate::membership::{MemberStatus, MembershipState};
use crate::sharding::wire::{ControlMsg, TypeRegistration};

pub use crate::runtime::slot::ShardHome;

/// Why a shard moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RebalanceReason {
    /// Its owner is no longer an eligible member (downed, exited, removed),
    /// or its owner's sharded system stopped. Never throttled.
    DeadOwner,
    /// Moved to spread load (after a node joined), by a handoff, at most
    /// `rebalance_per_round` per type per round.
    GracefulSpread,
    /// Moved by a handoff because its owner's system is shutting down
    /// gracefully (a graceful leave). Never throttled.
    GracefulLeave,
}

/// One shard moved by the coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMovement {
    /// The entity type.
    pub type_name: String,
    /// The shard.
    pub shard: ShardId,
    /// The previous owner.
    pub from: UniqueAddress,
    /// The new owner.
    pub to: UniqueAddress,
    /// The new allocation's generation.
    pub generation: u64,
}

/// The moves the coordinator made for one reason at one moment: the
/// dead-owner moves of one change, or the handoffs one decision started
/// (recorded when the last of them ends, with those that completed; `at`
/// is the decision's time; a handoff that times out is recorded as a
/// DeadOwner round of its own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebalanceRound {
    /// When (the `now` the core was given).
    pub at: Instant,
    /// Why.
    pub reason: RebalanceReason,
    /// What moved.
    pub moves: Vec<ShardMovement>,
}

/// Decides where a shard goes. The coordinator calls it only with at least
/// one candidate.
pub trait ShardAllocationStrategy: Send + 'static {
    /// Picks the new home of `shard` of `type_name` among the keys of
    /// `counts`, which maps every eligible member to the number of shards of
    /// this type it owns now. Returning a member that is not a key, or
    /// `None`, leaves the shard unallocated for now (it is asked again at the
    /// next change).
    fn allocate(
        &mut self,
        type_name: &str,
        shard: ShardId,
        counts: &BTreeMap<UniqueAddress, usize>,
    ) -> Option<UniqueAddress>;

    /// Names live shards of `type_name` to move to spread load. `owned` maps
    /// every eligible member to the shards of the type it owns; the
    /// coordinator moves at most `limit` of the shards named (those owned
    /// by a key of `owned`), each by a handoff, after which the shard is
    /// allocated anew through [`allocate`](Self::allocate). It is asked
    /// once per `rebalance_interval` for each type with no handoff in
    /// progress and at least two eligible members. The default moves
    /// nothing.
    fn rebalance(
        &mut self,
        type_name: &str,
        owned: &BTreeMap<UniqueAddress, Vec<ShardId>>,
        limit: usize,
    ) -> Vec<ShardId> {
        let _ = (type_name, owned, limit);
        Vec::new()
    }
}

/// The default strategy: the eligible member owning the fewest shards of the
/// type, the oldest among equals. Allocating one shard at a time this way
/// keeps the per-member counts within one of each other over a stable set
/// of members; rebalancing moves shards from the most loaded members while
/// counts differ by more than one (so a member that joins gets its share).
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastShardAllocation;

impl ShardAllocationStrategy for LeastShardAllocation {
    fn allocate(
        &mut self,
        _type_name: &str,
        _shard: ShardId,
        counts: &BTreeMap<UniqueAddress, usize>,
    ) -> Option<UniqueAddress> {
        counts
            .iter()
            .min_by_key(|(member, count)| (**count, member.age_key()))
            .map(|(member, _)| *member)
    }

    fn rebalance(
        &mut self,
        _type_name: &str,
        owned: &BTreeMap<UniqueAddress, Vec<ShardId>>,
        limit: usize,
    ) -> Vec<ShardId> {
        // Plays the moves out on a copy: each takes the highest shard of the
        // most loaded member (the youngest among equals) to the least loaded.
        let mut owned: Vec<(UniqueAddress, Vec<ShardId>)> = owned
            .iter()
            .map(|(member, shards)| (*member, shards.clone()))
            .collect();
        let mut moves = Vec::new();
        while moves.len() < limit {
            let load =
                |(member, shards): &(UniqueAddress, Vec<ShardId>)| (shards.len(), member.age_key());
            let (Some(most), Some(least)) = (
                (0..owned.len()).max_by_key(|i| load(&owned[*i])),
                (0..owned.len()).min_by_key(|i| load(&owned[*i])),
            ) else {
                break;
            };
            if owned[most].1.len() <= owned[least].1.len() + 1 {
                break;
            }
            owned[most].1.sort_unstable();
            let Some(shard) = owned[most].1.pop() else {
                break;
            };
            owned[least].1.push(shard);
            moves.push(shard);
        }
        moves
    }
}

/// What the core asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// Send `msg` to `to` on the control channel (to this node itself: hand
    /// it to the local regions).
    Send { to: UniqueAddress, msg: ControlMsg },
}

/// How a member counts for shard ownership.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    /// Up and reachable: may receive shards.
    Eligible,
    /// Alive but not to receive shards now (joining, leaving, unreachable).
    Keep,
}

/// A live shard on its way from its owner to a new home.
#[derive(Clone, Copy, Debug)]
struct HandOff {
    /// The owner that stops the shard.
    from: UniqueAddress,
    /// The generation it hosts the shard under.
    generation: u64,
    reason: RebalanceReason,
    started: Instant,
    /// When `HandOff` was last sent to the owner.
    sent: Instant,
    /// The owner reported the shard stopped: it has no home, and is
    /// allocated as soon as there is a candidate.
    stopped: bool,
    /// The rebalance round that started it (none for a handoff that an
    /// earlier coordinator started).
    round: Option<u64>,
}

/// A rebalance round whose handoffs are not all finished: it enters the
/// history when the last one ends, with the moves that completed.
struct OpenRound {
    round: RebalanceRound,
    pending: usize,
}

/// `HandOff` is sent again this often until the owner reports.
const HANDOFF_RESEND: Duration = Duration::from_secs(1);

struct TypeTable {
    fingerprint: u64,
    num_shards: u32,
    homes: Vec<Option<ShardHome>>,
    /// The highest generation seen per shard, even when it has no home now.
    generations: Vec<u64>,
    regions: BTreeSet<UniqueAddress>,
    /// Regions registered proxy-only: they route and are given nothing.
    proxies: BTreeSet<UniqueAddress>,
    /// Regions leaving gracefully: their shards are handed off, and they
    /// are given nothing new.
    leaving: BTreeSet<UniqueAddress>,
    /// Shards asked for that have no home yet, and who asked.
    waiting: BTreeMap<u32, BTreeSet<UniqueAddress>>,
    handoffs: BTreeMap<u32, HandOff>,
    /// Shards a region says it hosts under a generation this table has
    /// passed, while the table has no home for them (see `settle_claims`).
    claims: BTreeMap<u32, BTreeSet<UniqueAddress>>,
    /// What each region said it hosts in its latest registration: its own
    /// homes that it has not stopped, shard → generation (see
    /// `reallocate_orphans`).
    hosting: BTreeMap<UniqueAddress, BTreeMap<u32, u64>>,
}

impl TypeTable {
    fn new(fingerprint: u64, num_shards: u32) -> Self {
        TypeTable {
            fingerprint,
            num_shards,
            homes: vec![None; num_shards as usize],
            generations: vec![0; num_shards as usize],
            regions: BTreeSet::new(),
            proxies: BTreeSet::new(),
            leaving: BTreeSet::new(),
            waiting: BTreeMap::new(),
            handoffs: BTreeMap::new(),
            claims: BTreeMap::new(),
            hosting: BTreeMap::new(),
        }
    }

    /// Starts moving `shard` away from its owner as part of `round`; false
    /// (nothing done) for a shard with no home or already moving.
    fn start_handoff(
        &mut self,
        type_name: &str,
        shard: u32,
        (reason, round): (RebalanceReason, u64),
        (now, epoch): (Instant, u64),
        out: &mut Vec<Command>,
    ) -> bool {
        let Some(home) = self.homes[shard as usize] else {
            return false;
        };
        if self.handoffs.contains_key(&shard) {
            return false;
        }
        self.handoffs.insert(
            shard,
            HandOff {
                from: home.owner,
                generation: home.generation,
                reason,
                started: now,
                sent: now,
                stopped: false,
                round: Some(round),
            },
        );
        out.push(handoff_msg(type_name, shard, home, epoch));
        true
    }

    /// Takes `home` for `shard` if its generation is higher than what is
    /// known (an equal one only when the shard has no home, and was not
    /// stopped under it by a handoff: a replica sent before the stop must
    /// not bring the old home back).
    fn learn(&mut self, shard: u32, home: ShardHome) -> bool {
        let i = shard as usize;
        if self
            .handoffs
            .get(&shard)
            .is_some_and(|h| h.stopped && home.generation <= h.generation)
        {
            return false;
        }
        if home.generation <= self.generations[i] && self.homes[i].is_some() {
            return false;
        }
        if home.generation < self.generations[i] {
            return false;
        }
        self.generations[i] = home.generation;
        self.homes[i] = Some(home);
        true
    }

    /// Makes `owner` the home of `shard` under a new generation, above every
    /// one seen and above `above`; `None` (nothing changed) once the
    /// generations are exhausted.
    fn place(&mut self, shard: u32, owner: UniqueAddress, above: u64) -> Option<ShardHome> {
        let i = shard as usize;
        let generation = self.generations[i].max(above).checked_add(1)?;
        let home = ShardHome { owner, generation };
        self.generations[i] = generation;
        self.homes[i] = Some(home);
        Some(home)
    }

    /// Tells every region of the type the new `home` of `shard`; `from`:
    /// the old owner, whose handoff of the shard this allocation follows.
    fn tell_regions(
        &self,
        type_name: &str,
        shard: u32,
        (home, from): (ShardHome, Option<UniqueAddress>),
        epoch: u64,
        out: &mut Vec<Command>,
    ) {
        for region in &self.regions {
            let mut msg = self.home_msg(type_name, shard, home, epoch);
            if let ControlMsg::Home { from: f, .. } = &mut msg {
                *f = from;
            }
            out.push(Command::Send { to: *region, msg });
        }
    }

    fn home_msg(&self, type_name: &str, shard: u32, home: ShardHome, epoch: u64) -> ControlMsg {
        debug_assert!(shard < self.num_shards);
        ControlMsg::Home {
            type_name: type_name.to_owned(),
            shard,
            owner: home.owner,
            generation: home.generation,
            epoch,
            from: None,
        }
    }
}

fn left_msg(to: UniqueAddress, type_name: &str, nowhere: bool, epoch: u64) -> Command {
    Command::Send {
        to,
        msg: ControlMsg::Left {
            type_name: type_name.to_owned(),
            nowhere,
            epoch,
        },
    }
}

fn handoff_msg(type_name: &str, shard: u32, home: ShardHome, epoch: u64) -> Command {
    Command::Send {
        to: home.owner,
        msg: ControlMsg::HandOff {
            type_name: type_name.to_owned(),
            shard,
            generation: home.generation,
            epoch,
        },
    }
}

fn is_departed(
    departed: &BTreeMap<String, BTreeSet<UniqueAddress>>,
    type_name: &str,
    member: &UniqueAddress,
) -> bool {
    departed.get(type_name).is_some_and(|d| d.contains(member))
}

/// Settings of the coordinator core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// After becoming coordinator, how long at most to wait for the
    /// eligible members to register before reallocating or allocating new
    /// shards.
    pub settle: Duration,
    /// How many rebalance rounds to keep in the history.
    pub history: usize,
    /// How often the strategy is asked to spread load.
    pub rebalance_interval: Duration,
    /// At most this many shards of a type start moving per rebalance round.
    pub rebalance_per_round: usize,
    /// A handoff not finished after this long completes as a DeadOwner move.
    pub handoff_timeout: Duration,
    /// The shards of a member gone from the cluster are reallocated only
    /// this long after the core first saw it gone (time for a node on the
    /// losing side of a partition to stop its entities).
    pub dead_owner_margin: Duration,
    /// Added to `dead_owner_margin` twice per ring cascade step of the
    /// current membership (`(members − 1) / ring_watchers`): a partition of
    /// a larger ring is seen whole later (SPEC §13.15). Zero: a fixed margin.
    pub margin_per_ring_step: Duration,
    /// The membership's `monitored_by`, for the cascade steps.
    pub ring_watchers: usize,
    /// The membership's ring detection step
    /// (`MembershipConfig::detection_step`): the resolver's unstable limit
    /// grows by one per cascade step, and so does `hold_for`. Zero: no
    /// resolver, or a fixed hold.
    pub detection_step: Duration,
    /// A split-brain resolver decides who is gone: the coordinator role
    /// stays with the oldest Up member while it is unreachable (see
    /// `CoordinatorCore::acting`).
    pub hold_through_unreachability: bool,
    /// How long the role stays with an oldest member that is flagged but
    /// not beyond this node's side: while a partition is being detected
    /// its members are seen flagged one by one, so this looks like one bad
    /// link that others bridge; after this long a partition would have
    /// been decided, and it is one. Per ring cascade step of the current
    /// membership, one `detection_step` (the resolver's unstable limit) and
    /// two `margin_per_ring_step`s (the margin after it) are added.
    pub hold_for: Duration,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            settle: Duration::from_secs(1),
            history: 1_000,
            rebalance_interval: Duration::from_secs(2),
            rebalance_per_round: 3,
            handoff_timeout: Duration::from_secs(10),
            dead_owner_margin: Duration::ZERO,
            margin_per_ring_step: Duration::ZERO,
            ring_watchers: 1,
            detection_step: Duration::ZERO,
            hold_through_unreachability: false,
            hold_for: Duration::ZERO,
        }
    }
}

/// The rings of the recent views, for the margin (SPEC §13.15 rule 3).
#[derive(Debug, Default)]
struct RecentRing {
    /// The last view's ring.
    last: usize,
    /// The largest ring of `recent` (at the last view).
    high: usize,
    /// Each recent view's ring (the larger of its own and the one before
    /// it), when it was seen and how long it counts.
    recent: Vec<(usize, Instant, Duration)>,
}

/// The coordinator's state machine. See the module docs.
pub(crate) struct CoordinatorCore {
    me: UniqueAddress,
    config: CoordinatorConfig,
    strategy: Box<dyn ShardAllocationStrategy>,
    active: bool,
    /// While active and settling: until when.
    settling_until: Option<Instant>,
    members: BTreeMap<UniqueAddress, Standing>,
    /// The ring the margin counts its cascade steps over (SPEC §13.15
    /// rule 3): the largest of the recent views' rings, see
    /// [`note_ring`](Self::note_ring).
    ring: RecentRing,
    /// Members that registered with this core (any type).
    registered: BTreeSet<UniqueAddress>,
    types: BTreeMap<String, TypeTable>,
    /// Per type, members whose region of it stopped (unregistered) and has
    /// not registered again: their shards are orphans, though they are
    /// members.
    departed: BTreeMap<String, BTreeSet<UniqueAddress>>,
    rounds: Vec<RebalanceRound>,
    /// Rounds closed and not yet taken by `take_closed`.
    closed_since: Vec<(RebalanceReason, usize, Instant)>,
    /// When the strategy is next asked to spread load.
    next_rebalance: Option<Instant>,
    /// Rounds with handoffs in progress, by number.
    open_rounds: BTreeMap<u64, OpenRound>,
    /// Leaving regions told `Left` for a type since they began leaving.
    told_left: BTreeSet<(String, UniqueAddress)>,
    /// Owners gone from the view, and when this core first saw them gone.
    gone_at: BTreeMap<UniqueAddress, Instant>,
    next_round: u64,
    /// This core's epoch while active (its term as coordinator), stamped on
    /// every message it sends to regions; 0 while inactive.
    epoch: u64,
    /// The highest epoch seen anywhere: this core's own terms, the regions'
    /// registrations and the coordinators this node accepted.
    highest_epoch: u64,
    /// Until when no shard is allocated anew: `dead_owner_margin` after a
    /// member was last seen gone (the losing side of a partition, whose
    /// coordinator may have placed shards this core never heard of, has
    /// stopped them by then).
    quiet_until: Option<Instant>,
    /// Whether `act` is within `quiet_until` (read by `allocate`).
    quiet: bool,
    /// The acting coordinator in the latest view.
    acting: Option<UniqueAddress>,
    /// The oldest Up member while it is flagged unreachable, and since when.
    oldest_flagged: Option<(UniqueAddress, Instant)>,
    /// Until when that hold keeps the role with it, while only time can
    /// end the hold (the member is flagged but not beyond this side).
    hold_until: Option<Instant>,
}

impl CoordinatorCore {
    pub(crate) fn new(
        me: UniqueAddress,
        config: CoordinatorConfig,
        strategy: Box<dyn ShardAllocationStrategy>,
    ) -> Self {
        CoordinatorCore {
            me,
            config,
            strategy,
            active: false,
            settling_until: None,
            members: BTreeMap::new(),
            ring: RecentRing::default(),
            registered: BTreeSet::new(),
            types: BTreeMap::new(),
            departed: BTreeMap::new(),
            rounds: Vec::new(),
            closed_since: Vec::new(),
            next_rebalance: None,
            open_rounds: BTreeMap::new(),
            told_left: BTreeSet::new(),
            gone_at: BTreeMap::new(),
            next_round: 0,
            epoch: 0,
            highest_epoch: 0,
            quiet_until: None,
            quiet: false,
            acting: None,
            oldest_flagged: None,
            hold_until: None,
        }
    }

    /// An epoch seen elsewhere: a region's registration, or a coordinator
    /// this node accepted. An active core whose own epoch is not above it
    /// takes the next one, so that regions which heard a later coordinator
    /// (the view flapped) accept this one again.
    pub(crate) fn observe_epoch(&mut self, epoch: u64) {
        self.highest_epoch = self.highest_epoch.max(epoch);
        if self.active && epoch > self.epoch {
            self.highest_epoch = self.highest_epoch.saturating_add(1);
            self.epoch = self.highest_epoch;
        }
    }

    /// Fencing (SPEC §13.15): whether a message from the coordinator this
    /// node's view names may be acted on — false for a coordinator message
    /// from an epoch below the highest seen (an older term). An accepted
    /// epoch is observed.
    pub(crate) fn accept_epoch(&mut self, msg: &ControlMsg) -> bool {
        match msg.coordinator_epoch() {
            Some(epoch) if epoch < self.highest_epoch => false,
            Some(epoch) => {
                self.observe_epoch(epoch);
                true
            }
            None => true,
        }
    }

    /// The highest epoch this node has seen (what its registrations carry,
    /// and below which its driver ignores coordinator messages).
    pub(crate) fn highest_epoch(&self) -> u64 {
        self.highest_epoch
    }

    /// The member that acts as shard coordinator in `state` at `now`: the
    /// membership's placement coordinator (the oldest reachable Up member),
    /// except that with a split-brain resolver the role stays with the
    /// oldest Up member while it is beyond this node's side of a partition
    /// (this side then has no coordinator until the resolver has downed it
    /// or the partition heals), and while it is flagged unreachable at all,
    /// for at most `hold_for` (SPEC §13.15).
    pub(crate) fn acting(
        &mut self,
        now: Instant,
        state: &MembershipState,
    ) -> Option<UniqueAddress> {
        if !self.config.hold_through_unreachability {
            return state.coordinator;
        }
        let oldest = state
            .members
            .iter()
            .filter(|m| m.status == MemberStatus::Up)
            .min_by_key(|m| m.address.age_key())
            .map(|m| m.address);
        let Some(oldest) = oldest.filter(|o| state.unreachable.contains(o)) else {
            self.oldest_flagged = None;
            self.hold_until = None;
            return state.coordinator;
        };
        let since = match self.oldest_flagged {
            Some((member, since)) if member == oldest => since,
            _ => {
                self.oldest_flagged = Some((oldest, now));
                now
            }
        };
        // (A hold too long to add to an instant never runs out.)
        let until = since.checked_add(self.hold_for(state));
        let beyond = state.beyond.contains(&oldest);
        let holding = until.is_none_or(|until| now < until);
        self.hold_until = until.filter(|_| !beyond && holding);
        if beyond || holding {
            Some(oldest)
        } else {
            state.coordinator
        }
    }

    /// Whether a hold on a flagged oldest member is running, so that the
    /// role may move at a tick without a new membership view.
    pub(crate) fn holding(&self) -> bool {
        self.oldest_flagged.is_some()
    }

    /// The acting coordinator of the latest view.
    pub(crate) fn acting_now(&self) -> Option<UniqueAddress> {
        self.acting
    }

    /// Ring cascade steps of a ring of `members` (SPEC §13.15).
    fn cascade_steps(&self, members: usize) -> u32 {
        let steps = members.saturating_sub(1) / self.config.ring_watchers.max(1);
        u32::try_from(steps).unwrap_or(u32::MAX)
    }

    /// The members of `state`'s monitoring ring: every live one (Down and
    /// Removed members are out of it, Exiting ones still in), as the
    /// membership core builds it.
    fn ring_members(state: &MembershipState) -> usize {
        state.members.iter().filter(|m| m.status.is_live()).count()
    }

    /// The hold for a ring of `members`: `hold_for`, plus per cascade step
    /// one detection step and two margin steps.
    fn hold_for_ring(&self, members: usize) -> Duration {
        let per_step = self
            .config
            .detection_step
            .saturating_add(self.config.margin_per_ring_step.saturating_mul(2));
        self.config
            .hold_for
            .saturating_add(per_step.saturating_mul(self.cascade_steps(members)))
    }

    /// The dead-owner margin for a ring of `members`: two margin steps per
    /// cascade step on top of `dead_owner_margin`.
    fn margin_for_ring(&self, members: usize) -> Duration {
        let steps = self.cascade_steps(members).saturating_mul(2);
        self.config
            .dead_owner_margin
            .saturating_add(self.config.margin_per_ring_step.saturating_mul(steps))
    }

    /// Takes in the ring of a new view. A member the winning side has just
    /// downed is out of this side's ring, but the losing side gives up on
    /// the cascade of the ring from before the cut, which still held it:
    /// so each view counts the larger of its ring and the one before it
    /// (the ring from before a loss), for as long as a loss it showed
    /// could still be waiting out its margin (a hold and a margin of that
    /// ring), and the margin takes the largest of the views that count.
    fn note_ring(&mut self, now: Instant, members: usize) {
        let before = std::mem::replace(&mut self.ring.last, members);
        let ring = before.max(members);
        let keep = self
            .hold_for_ring(ring)
            .saturating_add(self.margin_for_ring(ring));
        let recent = &mut self.ring.recent;
        // (An entry of a ring no larger than this one ends no later.)
        recent
            .retain(|(r, since, keep)| *r > ring && now.saturating_duration_since(*since) < *keep);
        recent.push((ring, now, keep));
        self.ring.high = recent.iter().map(|(ring, ..)| *ring).max().unwrap_or(ring);
    }

    /// How long the role stays with a flagged oldest member on this side,
    /// for the membership of `state`: `hold_for`, plus per ring cascade
    /// step of its live members (the resolver's ring) one detection step,
    /// by which the unstable limit grows (SPEC §10.5), and two margin
    /// steps, by which the margin after it grows.
    fn hold_for(&self, state: &MembershipState) -> Duration {
        self.hold_for_ring(Self::ring_members(state))
    }

    /// The dead-owner margin, over the recent views' largest ring (it
    /// shrinks back at the first view after their time is up).
    fn margin(&self) -> Duration {
        self.margin_for_ring(self.ring.high)
    }

    /// Whether this core is the acting coordinator.
    pub(crate) fn is_active(&self) -> bool {
        self.active
    }

    /// While active: this core's epoch, and whether it allocates at `now`
    /// (settled, and past the quiet period of a takeover).
    pub(crate) fn activity(&self, now: Instant) -> Option<(u64, bool)> {
        self.active.then(|| {
            let settled = self.settling_until.is_none_or(|until| now >= until);
            let loud = self.quiet_until.is_none_or(|until| now >= until);
            (self.epoch, settled && loud)
        })
    }

    /// The rebalance rounds made while this node was coordinator, oldest first.
    pub(crate) fn rounds(&self) -> &[RebalanceRound] {
        &self.rounds
    }

    /// The rounds closed since the last call (reason, moves, decided at),
    /// whatever the history keeps: for the metrics.
    pub(crate) fn take_closed(&mut self) -> Vec<(RebalanceReason, usize, Instant)> {
        std::mem::take(&mut self.closed_since)
    }

    /// The home of `shard` of `type_name` as this core knows it.
    #[cfg(test)]
    pub(crate) fn home(&self, type_name: &str, shard: u32) -> Option<ShardHome> {
        self.types
            .get(type_name)
            .and_then(|t| t.homes.get(shard as usize).copied().flatten())
    }

    /// Handoffs in progress and rounds still open.
    #[cfg(test)]
    pub(crate) fn in_progress(&self) -> (usize, usize) {
        let handoffs = self.types.values().map(|t| t.handoffs.len()).sum();
        (handoffs, self.open_rounds.len())
    }

    /// When [`tick`](Self::tick) has something to do, if nothing else
    /// happens first (`None`: only an event can give it work): the end of
    /// the settle period or of a quiet margin, the next rebalance round, a
    /// handoff to send again or that times out, a gone owner's shards at
    /// the end of their margin, and a hold on a flagged oldest member that
    /// runs out (the driver then looks at the view again). After the core
    /// has acted at `now`, never `now` or earlier.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if let Some(until) = self.hold_until {
            at(until);
        }
        if !self.active {
            return next;
        }
        if let Some(until) = self.settling_until {
            // Nothing acts before the settle period ends.
            at(until);
            return next;
        }
        match self.quiet_until {
            // Quiet: nothing is allocated, moved or completed before it ends
            // (handoffs already asked for are still sent again).
            Some(until) => at(until),
            None => {
                if let Some(rebalance) = self.next_rebalance {
                    at(rebalance);
                }
            }
        }
        let margin = self.margin();
        for table in self.types.values() {
            for handoff in table.handoffs.values().filter(|h| !h.stopped) {
                if !self.members.contains_key(&handoff.from) {
                    continue;
                }
                at(handoff.sent + HANDOFF_RESEND);
                if self.quiet_until.is_none() {
                    // (A timeout too long to add to an instant never comes.)
                    if let Some(t) = handoff.started.checked_add(self.config.handoff_timeout) {
                        at(t);
                    }
                }
            }
            if self.quiet_until.is_none() {
                for home in table.homes.iter().flatten() {
                    if !self.members.contains_key(&home.owner)
                        && let Some(gone) = self.gone_at.get(&home.owner)
                        && let Some(t) = gone.checked_add(margin)
                    {
                        at(t);
                    }
                }
            }
        }
        next
    }

    /// Whether the core is active and still in its settle period.
    #[cfg(test)]
    pub(crate) fn is_settling(&self) -> bool {
        self.settling_until.is_some()
    }

    /// [`acting`](Self::acting), then [`apply_membership`](Self::apply_membership).
    #[cfg(test)]
    pub(crate) fn set_membership(&mut self, now: Instant, state: &MembershipState) -> Vec<Command> {
        let acting = self.acting(now, state);
        self.apply_membership(now, state, acting)
    }

    /// A new membership view, with the acting coordinator already found by
    /// [`acting`](Self::acting) for it (the driver needs it first, to seed
    /// a takeover). Becoming the coordinator starts the settle period;
    /// while active, shards of members that are gone are reallocated.
    pub(crate) fn apply_membership(
        &mut self,
        now: Instant,
        state: &MembershipState,
        acting: Option<UniqueAddress>,
    ) -> Vec<Command> {
        let unreachable: BTreeSet<UniqueAddress> = state.unreachable.iter().copied().collect();
        self.note_ring(now, Self::ring_members(state));
        let before = std::mem::take(&mut self.members);
        self.members = state
            .members
            .iter()
            .filter_map(|m| {
                let standing = match m.status {
                    MemberStatus::Up if !unreachable.contains(&m.address) => Standing::Eligible,
                    MemberStatus::Joining | MemberStatus::Up | MemberStatus::Leaving => {
                        Standing::Keep
                    }
                    MemberStatus::Exiting | MemberStatus::Down | MemberStatus::Removed => {
                        return None;
                    }
                };
                Some((m.address, standing))
            })
            .collect();
        self.note_gone(now, state, &before);
        let members = &self.members;
        self.registered.retain(|m| members.contains_key(m));
        for table in self.types.values_mut() {
            table.regions.retain(|m| members.contains_key(m));
            table.proxies.retain(|m| members.contains_key(m));
            table.leaving.retain(|m| members.contains_key(m));
            table.hosting.retain(|m, _| members.contains_key(m));
            for askers in table.waiting.values_mut() {
                askers.retain(|m| members.contains_key(m));
            }
        }
        let previous = std::mem::replace(&mut self.acting, acting);
        let should_be_active = acting == Some(self.me);
        if should_be_active && !self.active {
            self.active = true;
            self.highest_epoch = self.highest_epoch.saturating_add(1);
            self.epoch = self.highest_epoch;
            // Taking over from a coordinator that did not hand the role
            // over by leaving: it may have placed shards this core never
            // heard of, on members beyond a partition, and may still act
            // for a moment. Allocate nothing until those have fenced
            // (SPEC §13.15).
            let margin = self.margin();
            let handed_over = |p: &UniqueAddress| {
                matches!(
                    state.status_of(p),
                    Some(MemberStatus::Leaving | MemberStatus::Exiting)
                )
            };
            if let Some(previous) = previous
                && previous != self.me
                && !handed_over(&previous)
                && !margin.is_zero()
            {
                self.quiet_until = Some(now + margin);
            }
            self.settling_until = Some(now + self.config.settle);
            self.next_rebalance = Some(now + self.config.settle + self.config.rebalance_interval);
            // Registrations from an earlier term, or sent before this node
            // saw itself coordinator, may miss what moved since: settle on
            // fresh ones (regions register with every new coordinator and
            // again until they hear its table), or on the timeout for
            // regions whose view never saw the coordinator change. Which
            // members are regions is kept: a region that stopped tells
            // every coordinator it sees (`Unregister`).
            let me = self.me;
            self.registered.retain(|m| *m == me);
        } else if !should_be_active && self.active {
            self.active = false;
            self.epoch = 0;
            self.settling_until = None;
            self.next_rebalance = None;
            // Owners report stopped shards to whichever coordinator they
            // see, again until a new home comes: the next one finishes.
            for table in self.types.values_mut() {
                table.waiting.clear();
                table.handoffs.clear();
                table.claims.clear();
            }
            for (_, open) in std::mem::take(&mut self.open_rounds) {
                self.close(open.round);
            }
        }
        self.act(now)
    }

    /// Notes when this core first saw each member gone (Exiting, Down,
    /// Removed, or out of the view): a gone owner's shards move one margin
    /// after that (SPEC §13.15 rule 3). Noted at the view, active or not,
    /// quiet or not: the losing side's fence is bound to the Down, which
    /// this view shows, so a core that takes over at that view (the old
    /// coordinator's own shards) or is quiet meanwhile must not start the
    /// margin again at its first act. Entries are kept while the member is
    /// in the view or owns a home here.
    fn note_gone(
        &mut self,
        now: Instant,
        state: &MembershipState,
        before: &BTreeMap<UniqueAddress, Standing>,
    ) {
        let gone_now = state
            .members
            .iter()
            .filter(|m| {
                matches!(
                    m.status,
                    MemberStatus::Exiting | MemberStatus::Down | MemberStatus::Removed
                )
            })
            .map(|m| m.address);
        let out_of_view = before
            .keys()
            .filter(|a| !self.members.contains_key(a))
            .copied();
        for gone in gone_now.chain(out_of_view).collect::<Vec<_>>() {
            self.gone_at.entry(gone).or_insert(now);
        }
        let types = &self.types;
        self.gone_at.retain(|a, _| {
            state.members.iter().any(|m| m.address == *a)
                || types
                    .values()
                    .any(|t| t.homes.iter().flatten().any(|h| h.owner == *a))
        });
    }

    /// Seeds the table from this node's own replica (before acting as the
    /// coordinator for the first time): known homes, highest generation wins.
    pub(crate) fn seed(
        &mut self,
        type_name: &str,
        fingerprint: u64,
        num_shards: u32,
        homes: &[(u32, ShardHome)],
    ) {
        let table = self
            .types
            .entry(type_name.to_owned())
            .or_insert_with(|| TypeTable::new(fingerprint, num_shards));
        if table.fingerprint != fingerprint || table.num_shards != num_shards {
            return;
        }
        for &(shard, home) in homes {
            if shard < num_shards {
                table.learn(shard, home);
            }
        }
    }

    /// A region registered its types (idempotent). Recorded whether or not
    /// this core is active; answered only while it is.
    pub(crate) fn register(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        types: &[TypeRegistration],
    ) -> Vec<Command> {
        let mut out = Vec::new();
        let mut ended = Vec::new();
        self.registered.insert(from);
        for reg in types {
            if reg.num_shards == 0 || reg.num_shards > crate::config::MAX_SHARDS {
                if self.active {
                    out.push(Command::Send {
                        to: from,
                        msg: ControlMsg::Refused {
                            type_name: reg.type_name.clone(),
                            reason: format!(
                                "num_shards {} is outside 1..={}",
                                reg.num_shards,
                                crate::config::MAX_SHARDS
                            ),
                            cluster_fingerprint: None,
                            cluster_num_shards: None,
                        },
                    });
                }
                continue;
            }
            let table = self
                .types
                .entry(reg.type_name.clone())
                .or_insert_with(|| TypeTable::new(reg.fingerprint, reg.num_shards));
            if table.regions.is_empty()
                && table.homes.iter().all(Option::is_none)
                && (table.fingerprint, table.num_shards) != (reg.fingerprint, reg.num_shards)
            {
                // Nobody holds this type's table yet: the first region decides
                // it (generations seen so far are kept where shards remain).
                let mut fresh = TypeTable::new(reg.fingerprint, reg.num_shards);
                for (g, old) in fresh.generations.iter_mut().zip(&table.generations) {
                    *g = *old;
                }
                ended.extend(std::mem::take(&mut table.handoffs).into_values());
                *table = fresh;
            }
            if table.fingerprint != reg.fingerprint || table.num_shards != reg.num_shards {
                if self.active {
                    let reason = format!(
                        "type `{}` is registered with fingerprint {:016x} and {} shards in this cluster; this region has {:016x} and {}",
                        reg.type_name,
                        table.fingerprint,
                        table.num_shards,
                        reg.fingerprint,
                        reg.num_shards
                    );
                    out.push(Command::Send {
                        to: from,
                        msg: ControlMsg::Refused {
                            type_name: reg.type_name.clone(),
                            reason,
                            cluster_fingerprint: Some(table.fingerprint),
                            cluster_num_shards: Some(table.num_shards),
                        },
                    });
                }
                continue;
            }
            table.regions.insert(from);
            if reg.leaving {
                table.leaving.insert(from);
            } else {
                table.leaving.remove(&from);
            }
            if reg.proxy {
                table.proxies.insert(from);
            } else {
                table.proxies.remove(&from);
            }
            if let Some(departed) = self.departed.get_mut(&reg.type_name) {
                departed.remove(&from);
            }
            // A registration says all the region hosts now: its earlier
            // claims are replaced by this one's.
            table.claims.retain(|_, claimants| {
                claimants.remove(&from);
                !claimants.is_empty()
            });
            let hosting: BTreeMap<u32, u64> = reg
                .homes
                .iter()
                .filter(|(shard, owner, _)| {
                    *owner == from && *shard < table.num_shards && !reg.stopped.contains(shard)
                })
                .map(|&(shard, _, generation)| (shard, generation))
                .collect();
            if reg.proxy || hosting.is_empty() {
                table.hosting.remove(&from);
            } else {
                table.hosting.insert(from, hosting);
            }
            for &(shard, owner, generation) in &reg.homes {
                if shard < table.num_shards
                    && !table.learn(shard, ShardHome { owner, generation })
                    && owner == from
                    && !reg.proxy
                    && !reg.stopped.contains(&shard)
                    && self.active
                    && table.homes[shard as usize].is_none()
                {
                    // Settled in `act` (`settle_claims`). Only the active
                    // core takes claims: regions register anew with each
                    // new coordinator, so a standby core's would go stale.
                    table.claims.entry(shard).or_default().insert(from);
                }
            }
            if self.active {
                let homes = table
                    .homes
                    .iter()
                    .enumerate()
                    .filter_map(|(shard, home)| home.map(|h| (shard as u32, h.owner, h.generation)))
                    .collect();
                out.push(Command::Send {
                    to: from,
                    msg: ControlMsg::Table {
                        type_name: reg.type_name.clone(),
                        homes,
                        epoch: self.epoch,
                    },
                });
            }
        }
        for handoff in ended {
            self.end_handoff(handoff, None);
        }
        out.extend(self.act(now));
        out
    }

    /// A region's types stop on `from` (its system shut down): it is no
    /// longer a region of them, and the shards it still owns (a graceful
    /// leave hands them off first) are reallocated at once, as dead-owner
    /// moves.
    pub(crate) fn unregister(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        types: &[String],
    ) -> Vec<Command> {
        for type_name in types {
            if let Some(table) = self.types.get_mut(type_name) {
                table.regions.remove(&from);
                table.proxies.remove(&from);
                table.leaving.remove(&from);
                table.hosting.remove(&from);
            }
            // Kept also for a type this core has no table of yet: a later
            // registration may bring homes on `from`.
            self.departed
                .entry(type_name.clone())
                .or_default()
                .insert(from);
        }
        self.act(now)
    }

    /// The table of `type_name` while this core is active, if `shard` is in
    /// its range (what a region's request may act on at all).
    fn active_table(&mut self, type_name: &str, shard: u32) -> Option<&mut TypeTable> {
        if !self.active {
            return None;
        }
        self.types
            .get_mut(type_name)
            .filter(|table| shard < table.num_shards)
    }

    /// A region asks where `shard` of `type_name` lives; it has seen the
    /// shard under `generation` at most.
    pub(crate) fn get_home(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        type_name: &str,
        shard: u32,
        generation: u64,
    ) -> Vec<Command> {
        let Some(table) = self.active_table(type_name, shard) else {
            return Vec::new();
        };
        if !table.regions.contains(&from) {
            // Unknown shard, or a region that has not registered (its
            // registration was lost or refused): no answer; a region
            // registers again until it hears this coordinator's table.
            return Vec::new();
        }
        let i = shard as usize;
        if generation > table.generations[i] && generation.checked_add(1).is_some() {
            // The asker saw an allocation this core does not know of (its
            // knowledge was lost with an earlier coordinator): what this
            // core holds is older, so the shard is allocated anew above it.
            table.generations[i] = generation;
            table.homes[i] = None;
            if let Some(handoff) = table.handoffs.remove(&shard) {
                self.end_handoff(handoff, None);
            }
        }
        let Some(table) = self.types.get_mut(type_name) else {
            return Vec::new();
        };
        if let Some(home) = table.homes[shard as usize]
            && self.members.contains_key(&home.owner)
            && !is_departed(&self.departed, type_name, &home.owner)
        {
            return vec![Command::Send {
                to: from,
                msg: table.home_msg(type_name, shard, home, self.epoch),
            }];
        }
        table.waiting.entry(shard).or_default().insert(from);
        self.act(now)
    }

    /// `from` leaves gracefully (its system is shutting down): its shards
    /// of `types` are handed off, uncapped, and it is given nothing new.
    /// Each `Leave` (the leaver repeats it while it waits) is answered, per
    /// type, with `Left` once nothing more of the type will move off the
    /// leaver: it owns no shard of it, or no other region can take them.
    pub(crate) fn leave(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        types: &[String],
    ) -> Vec<Command> {
        for type_name in types {
            if let Some(table) = self.types.get_mut(type_name) {
                table.leaving.insert(from);
            }
        }
        let mut out = self.act(now);
        if self.active && self.settling_until.is_none() {
            for type_name in types {
                if let Some(nowhere) = self.left(type_name, &from) {
                    out.push(left_msg(from, type_name, nowhere, self.epoch));
                }
            }
        }
        out
    }

    /// Whether nothing more of `type_name` will move off `leaver`: `None`
    /// while something will; `Some(true)` when no other member has a region
    /// that could host the type (reachable now or not: a peer that is
    /// unreachable for a moment is still a home to wait for), `Some(false)`
    /// when the leaver owns nothing now and waits for nothing.
    fn left(&self, type_name: &str, leaver: &UniqueAddress) -> Option<bool> {
        let Some(table) = self.types.get(type_name) else {
            return Some(false);
        };
        if !self.has_host_besides(type_name, leaver) {
            return Some(true);
        }
        let owns = table.homes.iter().flatten().any(|h| h.owner == *leaver);
        // A stopped shard waiting for its next home (or one whose handoff
        // timed out before a home was found) is still with it.
        let moving = table.handoffs.values().any(|h| h.from == *leaver);
        let waiting = table.waiting.values().any(|askers| askers.contains(leaver));
        if !owns && !moving && !waiting {
            Some(false)
        } else {
            None
        }
    }

    /// Whether a member other than `leaver`, reachable or not, has a region
    /// of `type_name` that may host (not proxy-only, leaving or stopped).
    pub(crate) fn has_host_besides(&self, type_name: &str, leaver: &UniqueAddress) -> bool {
        self.hosts(type_name).any(|(m, _)| m != leaver)
    }

    /// `from`, the owner of `shard` under `generation`, has stopped it (the
    /// answer to `HandOff`, sent again until a newer home comes). The shard
    /// is allocated anew. A report about an older allocation is answered
    /// with the current home, or, when the shard has none now, with the
    /// next one, so the reporter stops repeating it.
    pub(crate) fn shard_stopped(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        type_name: &str,
        shard: u32,
        generation: u64,
    ) -> Vec<Command> {
        let epoch = self.epoch;
        let Some(table) = self.active_table(type_name, shard) else {
            return Vec::new();
        };
        let i = shard as usize;
        match table.homes[i] {
            Some(home) if home.owner == from && home.generation == generation => {
                let reason = match table.handoffs.get(&shard) {
                    Some(handoff) => handoff.reason,
                    // A handoff a previous coordinator started.
                    None if table.leaving.contains(&from) => RebalanceReason::GracefulLeave,
                    None => RebalanceReason::GracefulSpread,
                };
                table.homes[i] = None;
                match table.handoffs.get_mut(&shard) {
                    Some(handoff) => handoff.stopped = true,
                    None => {
                        let handoff = HandOff {
                            from,
                            generation,
                            reason,
                            started: now,
                            sent: now,
                            stopped: true,
                            round: None,
                        };
                        table.handoffs.insert(shard, handoff);
                    }
                }
                table.waiting.entry(shard).or_default();
            }
            Some(home) if home.generation > generation => {
                return vec![Command::Send {
                    to: from,
                    msg: table.home_msg(type_name, shard, home, epoch),
                }];
            }
            Some(home) if home.owner != from => {
                // The reporter held the shard under a generation this
                // table's home does not pass (another coordinator's, placed
                // while this one could not see): it would ignore that home
                // and wait for ever. The home is issued again above the
                // report, to the reporter and to the owner.
                let Some(home) = table.place(shard, home.owner, generation) else {
                    return Vec::new();
                };
                return [from, home.owner]
                    .into_iter()
                    .map(|to| Command::Send {
                        to,
                        msg: table.home_msg(type_name, shard, home, epoch),
                    })
                    .collect();
            }
            None => {
                // Stopped and not yet allocated anew (a report repeated, one
                // this core had not heard of, or one about an older home):
                // the reporter hears the next home.
                table.generations[i] = table.generations[i].max(generation);
                table.waiting.entry(shard).or_default().insert(from);
            }
            _ => return Vec::new(),
        }
        self.act(now)
    }

    /// Time passes: the settle period may end, handoffs time out, a
    /// rebalance round may be due.
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Command> {
        self.act(now)
    }

    fn settled(&mut self, now: Instant) -> bool {
        let Some(until) = self.settling_until else {
            return true;
        };
        let everyone = self
            .members
            .iter()
            .filter(|(_, s)| **s == Standing::Eligible)
            .all(|(m, _)| self.registered.contains(m));
        if everyone || now >= until {
            self.settling_until = None;
            true
        } else {
            false
        }
    }

    /// The members that may be given shards of `type_name`: Up and
    /// reachable, with a region of the type that is not proxy-only,
    /// leaving or stopped.
    fn candidates(&self, type_name: &str) -> BTreeSet<UniqueAddress> {
        self.hosts(type_name)
            .filter(|(_, standing)| *standing == Standing::Eligible)
            .map(|(m, _)| *m)
            .collect()
    }

    /// The members with a region of `type_name` that may host (not
    /// proxy-only, leaving or stopped), with how they stand now.
    fn hosts<'a>(
        &'a self,
        type_name: &'a str,
    ) -> impl Iterator<Item = (&'a UniqueAddress, Standing)> + 'a {
        self.types
            .get(type_name)
            .into_iter()
            .flat_map(move |table| {
                table.regions.iter().filter_map(move |m| {
                    let standing = *self.members.get(m)?;
                    let hosts = !table.proxies.contains(m)
                        && !table.leaving.contains(m)
                        && !is_departed(&self.departed, type_name, m);
                    hosts.then_some((m, standing))
                })
            })
    }

    /// While active and settled: reallocate the shards of gone owners, move
    /// handoffs along, allocate the shards asked for, and rebalance when due.
    fn act(&mut self, now: Instant) -> Vec<Command> {
        if !self.active || !self.settled(now) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut moves: Vec<(RebalanceReason, ShardMovement)> = Vec::new();
        let type_names: Vec<String> = self.types.keys().cloned().collect();
        // While quiet nothing is allocated, moved or completed: known homes
        // are still answered, handoffs already asked for still resent.
        self.quiet = self.quiet_until.is_some_and(|until| now < until);
        if !self.quiet {
            // Over: no deadline left behind in the past.
            self.quiet_until = None;
        }
        for type_name in &type_names {
            self.settle_claims(type_name, &mut out);
            if !self.quiet {
                self.reallocate_orphans(type_name, now, &mut out, &mut moves);
            }
            self.drive_handoffs(type_name, now, &mut out, &mut moves);
            self.answer_waiting(type_name, &mut out, &mut moves);
        }
        if !self.quiet && self.next_rebalance.is_none_or(|at| now >= at) {
            self.next_rebalance = Some(now + self.config.rebalance_interval);
            for type_name in &type_names {
                self.rebalance(type_name, now, &mut out);
            }
        }
        self.record(now, moves);
        self.tell_left(&type_names, &mut out);
        let types = &self.types;
        self.gone_at.retain(|m, _| {
            types
                .values()
                .any(|t| t.homes.iter().flatten().any(|h| h.owner == *m))
        });
        out
    }

    /// Settles the claims of regions that say they host a shard under a
    /// generation this table has passed while it has no home for it:
    /// another coordinator placed the shard there while this one could not
    /// see (SPEC §13.3). Left alone, such a region would go on hosting a
    /// shard this table could give to a second node. Runs once the core is
    /// settled (every region has registered, so a higher home would be
    /// known by now):
    /// * the shard got a home meanwhile: every claimant hears it (and stops
    ///   hosting, if it is another node);
    /// * nothing is quiet or moving the shard: its home is the first
    ///   claimant that is still a member with a region able to host
    ///   (reachable or not, leaving or not: the usual rules then move it
    ///   on, as for any owner), under a fresh generation, and every
    ///   claimant hears it;
    /// * otherwise the claims wait (claimants no longer regions of the type
    ///   are dropped).
    fn settle_claims(&mut self, type_name: &str, out: &mut Vec<Command>) {
        let (quiet, epoch) = (self.quiet, self.epoch);
        let Some(table) = self.types.get_mut(type_name) else {
            return;
        };
        let claims = std::mem::take(&mut table.claims);
        for (shard, mut claimants) in claims {
            let i = shard as usize;
            claimants.retain(|c| {
                table.regions.contains(c)
                    && !table.proxies.contains(c)
                    && self.members.contains_key(c)
                    && !is_departed(&self.departed, type_name, c)
            });
            if let Some(home) = table.homes[i] {
                // Placed meanwhile: the claimants hear where.
                for claimant in claimants {
                    out.push(Command::Send {
                        to: claimant,
                        msg: table.home_msg(type_name, shard, home, epoch),
                    });
                }
                continue;
            }
            let free = !quiet && !table.handoffs.contains_key(&shard);
            let placed = match claimants.first() {
                Some(&owner) if free => table.place(shard, owner, 0),
                _ => None,
            };
            match placed {
                // A new home, as an allocation's: every region hears it.
                Some(home) => table.tell_regions(type_name, shard, (home, None), epoch, out),
                None if !claimants.is_empty() => {
                    table.claims.insert(shard, claimants);
                }
                None => {}
            }
        }
    }

    /// Tells each leaving region, once, when nothing more of a type will
    /// move off it (it also hears so in answer to every `Leave`).
    fn tell_left(&mut self, type_names: &[String], out: &mut Vec<Command>) {
        let mut leaving = BTreeSet::new();
        for type_name in type_names {
            for leaver in &self.types[type_name].leaving {
                leaving.insert((type_name.clone(), *leaver));
                if !self.told_left.contains(&(type_name.clone(), *leaver))
                    && let Some(nowhere) = self.left(type_name, leaver)
                {
                    self.told_left.insert((type_name.clone(), *leaver));
                    out.push(left_msg(*leaver, type_name, nowhere, self.epoch));
                }
            }
        }
        self.told_left.retain(|key| leaving.contains(key));
    }

    /// Shards whose owner is gone from the cluster, or whose owner's region
    /// stopped, get new homes at once (DeadOwner), handoffs or not.
    fn reallocate_orphans(
        &mut self,
        type_name: &str,
        now: Instant,
        out: &mut Vec<Command>,
        moves: &mut Vec<(RebalanceReason, ShardMovement)>,
    ) {
        let table = &self.types[type_name];
        let margin = self.margin();
        let members = &self.members;
        let gone_at = &mut self.gone_at;
        // A gone member's shards wait out the margin; a stopped region's
        // (departed) and a proxy's do not.
        let mut gone_long_enough = |owner: &UniqueAddress| {
            let at = *gone_at.entry(*owner).or_insert(now);
            now.duration_since(at) >= margin
        };
        let orphaned: Vec<(u32, ShardHome)> = table
            .homes
            .iter()
            .enumerate()
            .filter_map(|(shard, home)| {
                home.filter(|h| {
                    (!members.contains_key(&h.owner) && gone_long_enough(&h.owner))
                        || is_departed(&self.departed, type_name, &h.owner)
                        || table.proxies.contains(&h.owner)
                })
                .map(|h| (shard as u32, h))
            })
            .collect();
        let candidates = self.candidates(type_name);
        for (shard, old) in orphaned {
            let Some(table) = self.types.get_mut(type_name) else {
                return;
            };
            table.homes[shard as usize] = None;
            if let Some(handoff) = table.handoffs.remove(&shard) {
                self.end_handoff(handoff, None);
            }
            let previous = old.owner;
            let home = self
                .rehome_with_host(type_name, shard, old, &candidates, out)
                .or_else(|| self.allocate(type_name, shard, out));
            if let Some(home) = home {
                moves.push((
                    RebalanceReason::DeadOwner,
                    movement(type_name, shard, previous, home),
                ));
            }
        }
    }

    /// Gives an orphaned `shard` (its home `old` lost its owner) to an
    /// eligible region that said, registering with this core in its
    /// current term, that it hosts the shard under `old`'s generation or a
    /// later one, under a generation above both. Two coordinators on either side of a
    /// partition can give out the same generation (the one that placed it
    /// first may be gone before anyone else hears of it); the region
    /// already hosts the shard, so it keeps it, under a fresh generation,
    /// instead of hearing of a new home elsewhere and stopping its entities
    /// while the new home starts them: no two hosts at once.
    fn rehome_with_host(
        &mut self,
        type_name: &str,
        shard: u32,
        old: ShardHome,
        candidates: &BTreeSet<UniqueAddress>,
        out: &mut Vec<Command>,
    ) -> Option<ShardHome> {
        let epoch = self.epoch;
        let registered = &self.registered;
        let table = self.types.get_mut(type_name)?;
        // Only a registration this term (regions register with each new
        // coordinator) says what a region hosts now.
        let host = table.hosting.iter().find_map(|(region, shards)| {
            let hosts = shards.get(&shard).is_some_and(|g| *g >= old.generation);
            let eligible = candidates.contains(region) && registered.contains(region);
            (hosts && *region != old.owner && eligible).then_some(*region)
        })?;
        let home = table.place(shard, host, old.generation)?;
        table.tell_regions(type_name, shard, (home, None), epoch, out);
        Some(home)
    }

    /// Sends `HandOff` again to owners that have not reported, completes
    /// the handoffs that timed out as DeadOwner moves, and starts handing
    /// off the shards of leaving owners.
    fn drive_handoffs(
        &mut self,
        type_name: &str,
        now: Instant,
        out: &mut Vec<Command>,
        moves: &mut Vec<(RebalanceReason, ShardMovement)>,
    ) {
        let timeout = self.config.handoff_timeout;
        let epoch = self.epoch;
        let quiet = self.quiet;
        // A leaving owner's shards move only when they have somewhere to go.
        let can_move = !self.candidates(type_name).is_empty();
        let Some(table) = self.types.get_mut(type_name) else {
            return;
        };
        let mut timed_out = Vec::new();
        let members = &self.members;
        for (shard, handoff) in table.handoffs.iter_mut().filter(|(_, h)| !h.stopped) {
            if !members.contains_key(&handoff.from) {
                // Its owner is gone: the shard is an orphan, reallocated
                // with the owner's others once the dead-owner margin is over.
                continue;
            }
            if !quiet && now.duration_since(handoff.started) >= timeout {
                timed_out.push((*shard, handoff.from));
            } else if now.duration_since(handoff.sent) >= HANDOFF_RESEND {
                handoff.sent = now;
                let home = ShardHome {
                    owner: handoff.from,
                    generation: handoff.generation,
                };
                out.push(handoff_msg(type_name, *shard, home, self.epoch));
            }
        }
        let leaving: Vec<u32> = (0..table.num_shards)
            .filter(|s| {
                can_move
                    && table.homes[*s as usize].is_some_and(|h| table.leaving.contains(&h.owner))
            })
            .collect();
        if !leaving.is_empty() {
            let round = self.next_round;
            let reason = RebalanceReason::GracefulLeave;
            let started = leaving
                .into_iter()
                .filter(|shard| {
                    table.start_handoff(type_name, *shard, (reason, round), (now, epoch), out)
                })
                .count();
            self.open_round(round, reason, now, started);
        }
        for (shard, from) in timed_out {
            tracing::warn!(type_name, shard, %from, ?timeout, "handoff timed out; the shard is reallocated as a dead-owner move");
            let ended = self.types.get_mut(type_name).and_then(|table| {
                table.homes[shard as usize] = None;
                table.handoffs.remove(&shard)
            });
            if let Some(handoff) = ended {
                self.end_handoff(handoff, None);
            }
            match self.allocate(type_name, shard, out) {
                Some(home) => {
                    moves.push((
                        RebalanceReason::DeadOwner,
                        movement(type_name, shard, from, home),
                    ));
                }
                None => {
                    // The old owner does not ask (it still hosts the shard):
                    // it hears the home found later.
                    if let Some(table) = self.types.get_mut(type_name) {
                        table.waiting.entry(shard).or_default().insert(from);
                    }
                }
            }
        }
    }

    /// Allocates the shards asked for (and the stopped shards of
    /// handoffs), and tells the askers.
    fn answer_waiting(
        &mut self,
        type_name: &str,
        out: &mut Vec<Command>,
        moves: &mut Vec<(RebalanceReason, ShardMovement)>,
    ) {
        let waiting: Vec<(u32, BTreeSet<UniqueAddress>)> = self
            .types
            .get_mut(type_name)
            .map(|t| std::mem::take(&mut t.waiting).into_iter().collect())
            .unwrap_or_default();
        for (shard, askers) in waiting {
            let known = self.types[type_name].homes[shard as usize];
            if let Some(home) = known
                && !self.members.contains_key(&home.owner)
            {
                // Its owner is gone and the margin not over: keep waiting.
                if let Some(table) = self.types.get_mut(type_name) {
                    table.waiting.insert(shard, askers);
                }
                continue;
            }
            if let Some(home) = known {
                // Known meanwhile (allocated by an earlier step, or learned
                // from a registration, which is not broadcast): every asker
                // hears it, and a stopped handoff of it is over.
                let ended = self.types.get_mut(type_name).and_then(|t| {
                    let stopped = t.handoffs.get(&shard).is_some_and(|h| h.stopped);
                    if stopped {
                        t.handoffs.remove(&shard)
                    } else {
                        None
                    }
                });
                if let Some(handoff) = ended {
                    self.end_handoff(handoff, None);
                }
                let table = &self.types[type_name];
                for asker in &askers {
                    out.push(Command::Send {
                        to: *asker,
                        msg: table.home_msg(type_name, shard, home, self.epoch),
                    });
                }
                continue;
            }
            let Some(home) = self.allocate(type_name, shard, out) else {
                // No candidate yet, or a member was gone too recently:
                // keep waiting.
                if let Some(table) = self.types.get_mut(type_name) {
                    table.waiting.insert(shard, askers);
                }
                continue;
            };
            let ended = self
                .types
                .get_mut(type_name)
                .and_then(|t| t.handoffs.remove(&shard));
            if let Some(handoff) = ended {
                let moved = movement(type_name, shard, handoff.from, home);
                if handoff
                    .round
                    .is_some_and(|r| self.open_rounds.contains_key(&r))
                {
                    self.end_handoff(handoff, Some(moved));
                } else {
                    moves.push((handoff.reason, moved));
                }
            }
            let Some(table) = self.types.get(type_name) else {
                continue;
            };
            // Regions heard the broadcast; other askers hear it now.
            for asker in askers.iter().filter(|a| !table.regions.contains(a)) {
                out.push(Command::Send {
                    to: *asker,
                    msg: table.home_msg(type_name, shard, home, self.epoch),
                });
            }
        }
    }

    /// Asks the strategy which shards of `type_name` to move to spread
    /// load, and starts at most `rebalance_per_round` handoffs.
    fn rebalance(&mut self, type_name: &str, now: Instant, out: &mut Vec<Command>) {
        let candidates = self.candidates(type_name);
        let Some(table) = self.types.get_mut(type_name) else {
            return;
        };
        if candidates.len() < 2 || !table.handoffs.is_empty() {
            return;
        }
        let mut owned: BTreeMap<UniqueAddress, Vec<ShardId>> =
            candidates.iter().map(|m| (*m, Vec::new())).collect();
        for (shard, home) in table.homes.iter().enumerate() {
            if let Some(shards) = home.and_then(|h| owned.get_mut(&h.owner)) {
                shards.push(ShardId(shard as u32));
            }
        }
        let limit = self.config.rebalance_per_round;
        let epoch = self.epoch;
        let chosen = self.strategy.rebalance(type_name, &owned, limit);
        let round = (RebalanceReason::GracefulSpread, self.next_round);
        let mut started = 0;
        for ShardId(shard) in chosen {
            if started == limit {
                break;
            }
            let owned_by_candidate = table
                .homes
                .get(shard as usize)
                .copied()
                .flatten()
                .is_some_and(|h| candidates.contains(&h.owner));
            if owned_by_candidate && table.start_handoff(type_name, shard, round, (now, epoch), out)
            {
                started += 1;
            }
        }
        self.open_round(round.1, round.0, now, started);
    }

    /// Opens round `number` (the next one) with `started` handoffs.
    fn open_round(&mut self, number: u64, reason: RebalanceReason, at: Instant, started: usize) {
        if started == 0 {
            return;
        }
        debug_assert_eq!(number, self.next_round);
        self.next_round += 1;
        let round = RebalanceRound {
            at,
            reason,
            moves: Vec::new(),
        };
        self.open_rounds.insert(
            number,
            OpenRound {
                round,
                pending: started,
            },
        );
    }

    /// A handoff ended: with the move it completed, or without one (its
    /// shard was reallocated another way). Its round closes with its last.
    fn end_handoff(&mut self, handoff: HandOff, moved: Option<ShardMovement>) {
        let Some(number) = handoff.round else {
            return;
        };
        let Some(open) = self.open_rounds.get_mut(&number) else {
            return;
        };
        open.round.moves.extend(moved);
        open.pending -= 1;
        if open.pending == 0
            && let Some(open) = self.open_rounds.remove(&number)
        {
            self.close(open.round);
        }
    }

    /// Adds a finished round to the history (if it moved anything).
    fn close(&mut self, round: RebalanceRound) {
        if round.moves.is_empty() {
            return;
        }
        self.closed_since
            .push((round.reason, round.moves.len(), round.at));
        self.rounds.push(round);
        if self.rounds.len() > self.config.history {
            let excess = self.rounds.len() - self.config.history;
            self.rounds.drain(..excess);
        }
    }

    /// Adds moves made now outside any open round to the history, a round
    /// per reason.
    fn record(&mut self, now: Instant, moves: Vec<(RebalanceReason, ShardMovement)>) {
        for reason in [
            RebalanceReason::DeadOwner,
            RebalanceReason::GracefulLeave,
            RebalanceReason::GracefulSpread,
        ] {
            let these: Vec<ShardMovement> = moves
                .iter()
                .filter(|(r, _)| *r == reason)
                .map(|(_, m)| m.clone())
                .collect();
            self.close(RebalanceRound {
                at: now,
                reason,
                moves: these,
            });
        }
    }

    /// Allocates `shard` through the strategy and broadcasts its new home to
    /// every region of the type. `None` when there is no eligible candidate.
    fn allocate(
        &mut self,
        type_name: &str,
        shard: u32,
        out: &mut Vec<Command>,
    ) -> Option<ShardHome> {
        if self.quiet {
            return None;
        }
        let candidates = self.candidates(type_name);
        let table = self.types.get(type_name)?;
        let mut counts: BTreeMap<UniqueAddress, usize> =
            candidates.into_iter().map(|m| (m, 0)).collect();
        if counts.is_empty() {
            return None;
        }
        for home in table.homes.iter().flatten() {
            if let Some(count) = counts.get_mut(&home.owner) {
                *count += 1;
            }
        }
        let owner = self.strategy.allocate(type_name, ShardId(shard), &counts);
        let Some(owner) = owner.filter(|o| counts.contains_key(o)) else {
            tracing::warn!(
                type_name,
                shard,
                "allocation strategy chose no eligible member; shard stays unallocated"
            );
            return None;
        };
        let table = self.types.get_mut(type_name)?;
        let Some(home) = table.place(shard, owner, 0) else {
            tracing::error!(
                type_name,
                shard,
                "shard generation exhausted; shard stays unallocated"
            );
            return None;
        };
        // After a handoff that stopped the shard, its old owner holds the
        // states its entities handed over (none after a timeout: no stop).
        let from = table
            .handoffs
            .get(&shard)
            .filter(|h| h.stopped)
            .map(|h| h.from);
        table.tell_regions(type_name, shard, (home, from), self.epoch, out);
        Some(home)
    }
}

fn movement(type_name: &str, shard: u32, from: UniqueAddress, home: ShardHome) -> ShardMovement {
    ShardMovement {
        type_name: type_name.to_owned(),
        shard: ShardId(shard),
        from,
        to: home.owner,
        generation: home.generation,
    }
}

#[cfg(test)]
#[path = "coordinator_tests.rs"]
mod tests;
