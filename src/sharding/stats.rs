//! What the regions hold: one region's own state, and a cluster-wide view
//! gathered from every member (Akka's `GetShardRegionState` and
//! `GetClusterShardingStats`).

use std::collections::{BTreeMap, BTreeSet};

use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;

pub use crate::runtime::region::{Passivations, ShardPlacement, ShardRegionState};

/// The cluster-wide view of one entity type, as
/// [`ShardedSystem::cluster_sharding_stats`](crate::ShardedSystem::cluster_sharding_stats)
/// gathers it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClusterShardingStats {
    /// Per member with a region of the type: its hosted shards and their
    /// live entities (empty for a proxy-only region).
    pub regions: BTreeMap<UniqueAddress, BTreeMap<ShardId, usize>>,
    /// Members asked that did not answer in time.
    pub failed: BTreeSet<UniqueAddress>,
    /// The application version of every member that answered
    /// (`ClusterConfig::app_version`; `"0"` from one that names none).
    pub app_versions: BTreeMap<UniqueAddress, crate::AppVersion>,
    /// The asks each member that answered sent to the type since its
    /// region started, by latency bucket and failure kind (a member of a
    /// build that does not count them is absent).
    pub asks: BTreeMap<UniqueAddress, crate::telemetry::AskCounts>,
    /// The roles of each member that answered (`ClusterConfig::roles`).
    pub roles: BTreeMap<UniqueAddress, BTreeSet<String>>,
    /// The acting sharding coordinator, as it answered for itself (its
    /// epoch, whether it allocates yet); `None` when no member that
    /// answered is acting (a takeover under way, or its answer was late).
    pub coordinator: Option<CoordinatorStatus>,
}

/// The sharding coordinator (SPEC §13.15), as
/// [`ShardedSystem::sharding_coordinator`](crate::ShardedSystem::sharding_coordinator)
/// and [`ClusterShardingStats::coordinator`] report it. It may differ from
/// the membership's `placement_coordinator()`: with a split-brain resolver
/// the role stays with an oldest member that is only unreachable until the
/// resolver has downed it (or a hold ran out), and a new coordinator
/// allocates only after its settle period and, when it took over from a
/// coordinator that did not hand over, the dead-owner margin.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CoordinatorStatus {
    /// The member acting as the sharding coordinator (`None` while no
    /// member may act, as on the side of a partition without the oldest).
    pub acting: Option<UniqueAddress>,
    /// The acting coordinator's epoch, its term: on the coordinator itself
    /// its own; elsewhere the highest epoch this node has seen (the
    /// coordinator's once this node has heard from it). 0: none yet.
    pub epoch: u64,
    /// Whether the coordinator allocates now — active, settled, and past
    /// the quiet period of a takeover. `Some` only where that is known: on
    /// the acting coordinator itself (and in `ClusterShardingStats`, from
    /// its answer).
    pub allocating: Option<bool>,
    /// This node's regions are registered: each has had the table of the
    /// coordinator this node follows (false until then, and while it
    /// follows none; checked against the regions as they are when read,
    /// so a type registered a moment ago makes it false at once). This
    /// node's own view only (always false in `ClusterShardingStats`).
    pub registered: bool,
}

impl ClusterShardingStats {
    /// Shards hosted per member.
    pub fn shards_per_member(&self) -> BTreeMap<UniqueAddress, usize> {
        self.regions
            .iter()
            .map(|(member, shards)| (*member, shards.len()))
            .collect()
    }

    /// Live entities in the whole cluster.
    pub fn entities(&self) -> usize {
        self.regions.values().flat_map(|s| s.values()).sum()
    }
}
