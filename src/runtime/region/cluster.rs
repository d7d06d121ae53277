//! A region's link to the cluster: the port to the other nodes and the
//! coordinator, asking for allocations, and the coordinator's refusal or
//! acceptance of the region.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::Region;
use crate::model::envelope::LocalEnvelope;
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::ops::history::ClusterEventKind;
use crate::runtime::mailbox::{RegionMsg, States};
use crate::runtime::slot::ShardHome;

/// How often a shard hosted here asks again to move to a node of a newer
/// protocol version, while messages of a line this version lacks reach it.
const ASK_NEWER_EVERY: Duration = Duration::from_secs(1);

/// A boxed future, as a [`ClusterPort`] returns one.
pub(crate) type PortFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// How a region reaches the other nodes and the coordinator, when its
/// system runs on a cluster. The sharding layer implements it: the runtime
/// knows nothing of pipes, wire forms or the allocation protocol.
pub(crate) trait ClusterPort: Send + Sync + 'static {
    /// Encodes `envelope` and sends it to the shard's home. On error the
    /// envelope's asker has been answered with the same error.
    fn forward(
        &self,
        home: ShardHome,
        region: &Region,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
        deadline: Option<(tokio::time::Instant, Duration)>,
    ) -> ShardingResult<bool>;
    /// Sends a passivation request to the node hosting the shard.
    fn passivate(
        &self,
        owner: UniqueAddress,
        type_name: &'static str,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<()>;
    /// Asks the coordinator for the shard's home; false if it cannot be
    /// asked (the next message asks again).
    fn allocate(&self, type_name: &'static str, shard: ShardId) -> bool;
    /// Reports that a handed-off shard has no entity left (hosted here
    /// under `generation`).
    fn shard_stopped(&self, type_name: &'static str, shard: ShardId, generation: u64);
    /// Asks for `shard`, hosted here, to move to a node of a newer version
    /// of the protocol: a message of a line this node's version lacks
    /// reached it (SPEC §13.6).
    fn needs_newer(&self, type_name: &'static str, shard: ShardId);
    /// Fetches, from `from`, the states its entities handed over when it
    /// stopped `shard`, now hosted here under `generation`; within
    /// `timeout`. `Err` says why they did not come.
    fn fetch_states(
        &self,
        type_name: &'static str,
        shard: ShardId,
        generation: u64,
        from: UniqueAddress,
        timeout: Duration,
    ) -> PortFuture<Result<States, String>>;
    /// Records an event in this node's history (SPEC §14.1), about
    /// `shard` if given (then `text` names the entity type, not the shard).
    fn record(&self, kind: ClusterEventKind, shard: Option<ShardId>, text: String);
}

/// A region's link to the cluster, when its system runs on one.
pub(crate) struct RegionCluster {
    /// This node.
    pub(crate) me: UniqueAddress,
    /// The other nodes and the coordinator.
    pub(crate) port: Arc<dyn ClusterPort>,
    /// A proxy-only region: it routes and never hosts a shard.
    pub(crate) proxy: bool,
}

impl Region {
    /// The region's way to the cluster, on a cluster.
    pub(crate) fn port(&self) -> Option<&Arc<dyn ClusterPort>> {
        self.cluster.as_ref().map(|c| &c.port)
    }

    /// Whether this region routes only (it registered proxy-only).
    pub(crate) fn is_proxy(&self) -> bool {
        self.cluster.as_ref().is_some_and(|c| c.proxy)
    }

    /// Why the coordinator refused this region, if it did (and no
    /// coordinator has accepted it since).
    pub(crate) fn refusal(&self) -> Option<ShardingError> {
        if !self.refused.load(Ordering::Acquire) {
            return None;
        }
        self.refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The coordinator refused this region: fail what waits for a home, and
    /// every later message, with `error` (they would otherwise wait for a
    /// home that never comes).
    pub(crate) fn refuse(&self, error: ShardingError) {
        // (Refused again at every registration's retry: the history folds
        // the repeats into one event.)
        if let Some(cluster) = &self.cluster {
            cluster
                .port
                .record(ClusterEventKind::RegionRefused, None, error.to_string());
        }
        *self.refusal.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.clone());
        self.refused.store(true, Ordering::Release);
        self.table.refuse(&mut self.host(), &error);
    }

    /// The coordinator `by` accepted this region (sent it the type's table).
    pub(crate) fn accepted(&self, by: crate::model::identity::UniqueAddress) {
        self.refused.store(false, Ordering::Release);
        *self.refusal.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.accepted_by.lock().unwrap_or_else(|p| p.into_inner()) = Some(by);
    }

    /// The coordinator whose table last came for this region (`None`
    /// before any, and on a single node).
    pub(crate) fn accepted_by(&self) -> Option<crate::model::identity::UniqueAddress> {
        *self.accepted_by.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A message of a protocol line this node's version lacks reached
    /// `shard`: if it is hosted here, ask for it to move to a node of a
    /// newer version (SPEC §13.6).
    /// Asked again at most once a second per shard (a request the
    /// coordinator dropped while it could not move the shard is made again
    /// by a later message).
    pub(crate) fn needs_newer(&self, shard: ShardId) {
        let Some(cluster) = &self.cluster else {
            return;
        };
        if !self.table.slot(shard).is_local() {
            return;
        }
        let now = std::time::Instant::now();
        let mut asked = self.asked_newer.lock().unwrap_or_else(|p| p.into_inner());
        let recent = asked
            .get(&shard.0)
            .is_some_and(|at| now.duration_since(*at) < ASK_NEWER_EVERY);
        if !recent {
            asked.insert(shard.0, now);
            drop(asked);
            cluster.port.needs_newer(self.type_name, shard);
            cluster.port.record(
                ClusterEventKind::NeedsNewer,
                Some(shard),
                format!(
                    "{}: a message of a protocol line this build lacks came; asked to move the shard to a newer node",
                    self.type_name
                ),
            );
        }
    }

    /// Asks for `shard`'s allocation: the sharding driver on a cluster, the
    /// region actor on one node. False if it cannot be asked.
    pub(super) fn request_allocation(&self, shard: ShardId) -> bool {
        if let Some(cluster) = &self.cluster {
            return cluster.port.allocate(self.type_name, shard);
        }
        match self.region_actor.get() {
            Some(actor) => actor.cast(RegionMsg::Allocate(shard)).is_ok(),
            None => {
                tracing::error!(
                    type_name = self.type_name,
                    "BUG: region used before its actor started"
                );
                false
            }
        }
    }
}
