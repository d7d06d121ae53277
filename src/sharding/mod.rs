//! Sharding across a cluster: the coordinator, routing to other nodes, and
//! what happens when a node is lost.
//!
//! A [`ShardedSystem`](crate::ShardedSystem) built with
//! [`node`](crate::ShardedSystemBuilder::node) joins this layer to a
//! [`ClusterNode`](crate::cluster::ClusterNode):
//!
//! ```text
//!   EntityRef ─► Region slot[shard]
//!                  Local      ─► entity mailbox (never serialized)
//!                  Remote(B)  ─► remote: encode once ─► B's pipe (data channel)
//!                  Unallocated─► buffer; driver ─► GetHome ─► coordinator
//!                                                       │
//!   coordinator (oldest reachable Up member):           ▼
//!     CoordinatorCore: table[type][shard] = (owner, generation)
//!     ─► Home to every region of the type (control channel, priority lane)
//! ```
//!
//! * [`coordinator`] — the sans-IO allocation core and the
//!   [`ShardAllocationStrategy`] trait, a folder split by concept.
//! * `region_core` — the region side of the allocation protocol, sans-IO.
//! * `control_core` — what the control task decides, sans-IO: it runs the
//!   coordinator core and the region side and gives the commands to carry
//!   out.
//! * `remote` — envelopes to other nodes, replies routed to the asker's node;
//!   `pending` — its table of the asks waiting on other nodes, sans-IO.
//! * `driver` — the IO around `control_core`: the tasks that feed it and
//!   carry out its commands, and the inbound data path.
//! * [`stats`] — a region's state and the cluster-wide view of a type.
//! * `wire` — the messages on the two sharding channels.
//!
//! SPEC.md §13 states the protocol, the wire form and the guarantees.

pub(crate) mod control_core;
pub mod coordinator;
pub(crate) mod driver;
pub(crate) mod fast;
pub(crate) mod migration;
pub(crate) mod pending;
pub(crate) mod region_core;
pub(crate) mod remote;
#[cfg(test)]
mod sim_tests;
pub mod stats;
pub(crate) mod wire;

pub use coordinator::{
    LeastShardAllocation, RebalanceReason, RebalanceRound, ShardAllocationStrategy, ShardHome,
    ShardMovement,
};
pub use stats::{
    ClusterShardingStats, CoordinatorStatus, Passivations, ShardPlacement, ShardRegionState,
};
pub use wire::RemoteError;
