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
//!  Traffic (regions) ──┤
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
//!   period (until every member that may host — Up or Leaving, reachable
//!   or not, its regions not all unregistered — has registered with it,
//!   or `settle` has passed) it answers only with known homes of live owners
//!   and reallocates nothing, so a shard whose owner has not re-registered
//!   yet is not given a second home.
//! * **Moving a live shard** (a GracefulSpread rebalance, or the graceful
//!   leave of its owner) is a handoff: the core sends `HandOff` to the
//!   owner, which stops the shard's entities and answers `ShardStopped`;
//!   only then is the shard allocated anew (through the strategy, or to
//!   the member a move for traffic named), so two nodes do not host it at
//!   once — except after a handoff not finished
//!   within `handoff_timeout`, which completes as a DeadOwner move while the
//!   old owner's stuck entity may still run. A handoff whose owner is gone
//!   meanwhile is reallocated with the owner's other shards.
//! * **Rebalance.** Every `rebalance_interval`, for each type with no
//!   handoff in progress, the strategy names live shards to move; at most
//!   `rebalance_per_round` of them start moving. With placement by
//!   traffic on, the regions' reports of which shards talk feed a second
//!   round after it, which moves shards toward their partners' members
//!   (`affinity` is the rule, `by_traffic` the table and the round).
//!
//! The core is split by concept: `acting` (who acts as coordinator, terms
//! and holds), `region_events` (what regions send, and the direct answers),
//! `placement` (the active core's allocation work), `rounds` (rebalance
//! rounds and their history), `affinity` and `by_traffic` (placement by
//! traffic: the rule, and the counts with the round that runs it),
//! `type_table` (one type's table), `strategy`, `config` and `outputs`
//! (commands and move records).

mod acting;
mod affinity;
mod by_traffic;
mod config;
mod outputs;
mod placement;
mod region_events;
mod rounds;
#[doc(hidden)]
pub mod scale;
mod strategy;
mod type_table;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use crate::model::identity::UniqueAddress;

pub use crate::runtime::slot::ShardHome;
pub use config::CoordinatorConfig;
pub(crate) use outputs::Command;
pub use outputs::{RebalanceReason, RebalanceRound, ShardMovement};
pub use strategy::{LeastShardAllocation, ShardAllocationStrategy};

use acting::{RecentRing, Standing};
use by_traffic::TrafficTable;
use outputs::{handoff_msg, left_msg, movement};
use rounds::OpenRound;
use type_table::{HANDOFF_RESEND, HandOff, TypeTable, is_departed};

/// The coordinator's state machine. See the module docs.
pub(crate) struct CoordinatorCore {
    me: UniqueAddress,
    config: CoordinatorConfig,
    strategy: Box<dyn ShardAllocationStrategy>,
    active: bool,
    /// While active and settling: until when.
    settling_until: Option<Instant>,
    /// Settles that ended at their timeout with an eligible member not
    /// registered (SPEC §13.2: its shards may then get a second home).
    settles_timed_out: u64,
    members: BTreeMap<UniqueAddress, Standing>,
    /// The ring the margin counts its cascade steps over (SPEC §13.15
    /// rule 3): the largest of the recent views' rings, see
    /// [`note_ring`](Self::note_ring).
    ring: RecentRing,
    /// Members that registered with this core (any type).
    registered: BTreeSet<UniqueAddress>,
    /// The application versions the members registered with (none: `"0"`).
    app_versions: BTreeMap<UniqueAddress, crate::AppVersion>,
    /// The types whose rebalance rounds are held: their hosts run two
    /// versions.
    held: BTreeSet<String>,
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
    /// Members seen downed (Down in a view, or gone from it without
    /// leaving), and when this core first saw it: cut off, such a member
    /// may act as the coordinator of its own side until it hears, so a
    /// takeover within a margin of it allocates nothing. Kept until that
    /// margin has passed, whatever the view says meanwhile (the leader
    /// removes a Down member soon after).
    downed_at: BTreeMap<UniqueAddress, Instant>,
    /// Members seen Leaving or Exiting, while they are in the view: one
    /// that then goes left, and was not downed.
    seen_leaving: BTreeSet<UniqueAddress>,
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
    /// The coordinator this node last heard a table from, and until when
    /// that table said it allocates nothing: kept to if this core takes
    /// the role over from it by its graceful leave.
    heard_table: Option<(UniqueAddress, Option<Instant>)>,
    /// Whether `act` is within `quiet_until` (read by `allocate`).
    quiet: bool,
    /// The acting coordinator in the latest view.
    acting: Option<UniqueAddress>,
    /// The oldest Up member while it is flagged unreachable, and since when.
    oldest_flagged: Option<(UniqueAddress, Instant)>,
    /// Until when that hold keeps the role with it, while only time can
    /// end the hold (the member is flagged but not beyond this side).
    hold_until: Option<Instant>,
    /// The traffic between shards the regions reported, when placing by
    /// traffic (SPEC §13.11).
    traffic: TrafficTable,
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
            settles_timed_out: 0,
            members: BTreeMap::new(),
            ring: RecentRing::default(),
            registered: BTreeSet::new(),
            app_versions: BTreeMap::new(),
            held: BTreeSet::new(),
            types: BTreeMap::new(),
            departed: BTreeMap::new(),
            rounds: Vec::new(),
            closed_since: Vec::new(),
            next_rebalance: None,
            open_rounds: BTreeMap::new(),
            told_left: BTreeSet::new(),
            gone_at: BTreeMap::new(),
            downed_at: BTreeMap::new(),
            seen_leaving: BTreeSet::new(),
            next_round: 0,
            epoch: 0,
            highest_epoch: 0,
            quiet_until: None,
            heard_table: None,
            quiet: false,
            acting: None,
            oldest_flagged: None,
            hold_until: None,
            traffic: TrafficTable::default(),
        }
    }

    /// The home of `shard` of `type_name` as this core knows it.
    #[cfg(test)]
    pub(crate) fn home(&self, type_name: &str, shard: u32) -> Option<ShardHome> {
        self.types.get(type_name).and_then(|t| t.home(shard))
    }

    /// Handoffs in progress and rounds still open.
    #[cfg(test)]
    pub(crate) fn in_progress(&self) -> (usize, usize) {
        let handoffs = self.types.values().map(|t| t.handoffs.len()).sum();
        (handoffs, self.open_rounds.len())
    }

    /// How many settles ended at their timeout with an eligible member not
    /// registered (the simulator excuses a shard's second home after one).
    #[cfg(test)]
    pub(crate) fn settles_timed_out(&self) -> u64 {
        self.settles_timed_out
    }
}

#[cfg(test)]
mod tests;
