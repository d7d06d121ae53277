//! The tasks that join a sharded system to its cluster node.
//!
//! ```text
//!            membership watch ──┐
//!   regions: Allocate{type,shard}┤                       ┌─► control channel (Register,
//!   system: TypeRegistered ──────┼─► control task ───────┤   GetHome, Home, Table, Refused)
//!   control channel (peers) ─────┤   CoordinatorCore     └─► regions: set_home / node_lost
//!   timers ──────────────────────┘   RegionCore
//!
//!   data channel (peers) ──► on the pipe's reader task: decode ──► region.deliver
//!                                                              └► pending replies
//!   migration channel (peers) ──► on the pipe's reader task: kept states served
//! ```
//!
//! The control task is IO around one sans-IO core, `control_core`, which
//! runs two: the coordinator core (`coordinator`, acting when this node is
//! the coordinator) and the region side of the allocation protocol
//! (`region_core`: where this node's shards wait for a home,
//! registrations, reports, leaving). It feeds it with `now`, runs its
//! commands, and wakes at its `poll_timeout` (and for stats deadlines and a once-a-second
//! sweep of asks whose caller gave up). The data path
//! runs inline on each pipe's reader task (`Transport::register_inline_borrowed`,
//! the payload read in place): decoding and delivery never block,
//! so no queue or task hop sits between the socket and an entity's mailbox,
//! and a burst of entity traffic never delays the coordinator's protocol
//! (which travels on the pipes' priority lane and its own task). A new
//! owner's pulls of migrated states are answered inline the same way. The
//! only other long-lived task keeps the pending remote asks' deadlines
//! (SPEC §13.5).
//!
//! `link` claims the channels and starts the tasks, `inbox` is what the
//! control task hears, `control` is its loop, `channel`, `region_side`,
//! `stats_requests` and `publish` are its parts, and `data` is the inline
//! data path.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{mpsc, watch};

use crate::cluster::ClusterNode;
use crate::membership::MembershipState;
use crate::model::identity::UniqueAddress;
use crate::sharding::control_core::{AppVersions, ControlCore};
use crate::sharding::coordinator::RebalanceRound;
use crate::sharding::remote::Remote;
use crate::sharding::stats::CoordinatorStatus;
use crate::transport::Incoming;

mod channel;
mod control;
mod data;
mod inbox;
mod link;
mod publish;
mod region_side;
mod stats_requests;
#[cfg(test)]
mod tests;

pub(crate) use self::inbox::{DriverMsg, RegionLink};
pub(crate) use self::link::{BoxFuture, ClusterLink, SystemPort};
#[cfg(test)]
pub(crate) use self::region_side::{Hosted, TypeRegion};
use self::stats_requests::PendingStats;

/// The control task's state.
struct Control {
    shared: Weak<dyn SystemPort>,
    node: ClusterNode,
    me: UniqueAddress,
    /// The decisions: the coordinator core and the region side.
    core: ControlCore,
    rx: mpsc::UnboundedReceiver<DriverMsg>,
    control: mpsc::Receiver<Incoming>,
    state: watch::Receiver<MembershipState>,
    /// This task's own inbox (weak: the system's handle keeps it open).
    self_tx: mpsc::WeakUnboundedSender<DriverMsg>,
    /// This node's regions were stopped because it is out of the cluster.
    fenced: bool,
    /// Stats requests waiting for answers, by id.
    stats: BTreeMap<u64, PendingStats>,
    next_stats: u64,
    rounds: Arc<Mutex<Vec<RebalanceRound>>>,
    /// Sweeps since the buffers were last sampled for the metrics.
    sweeps: u32,
    status: Arc<Mutex<CoordinatorStatus>>,
    app_versions: Arc<Mutex<AppVersions>>,
    remote: Arc<Remote>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
