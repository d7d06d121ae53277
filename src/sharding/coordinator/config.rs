//! The coordinator core's settings: the settle period, the rebalance pace,
//! the handoff timeout, and the holds and margins that keep coordinators
//! on either side of a partition from placing a shard twice.

use std::time::Duration;

use crate::model::config::PlacementByTraffic;

/// Settings of the coordinator core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// After becoming coordinator, how long at most to wait for the
    /// members that may host (Up or Leaving, reachable or not, whose
    /// regions have not all unregistered) to register before reallocating
    /// or allocating new shards.
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
    /// Placement by traffic (SPEC §13.11): each rebalance round also
    /// moves shards toward the nodes their traffic goes to, and the
    /// strategy's rebalance leaves a type whose counts are within the
    /// slack alone. `None`: by count alone.
    pub placement_by_traffic: Option<PlacementByTraffic>,
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
            placement_by_traffic: None,
        }
    }
}
