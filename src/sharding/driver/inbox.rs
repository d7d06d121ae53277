//! The control task's inbox: what regions and the system tell it, and a
//! region's link to the cluster (envelopes and passivations out on the
//! pipes, allocation requests and stopped shards to the control task).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use crate::model::envelope::LocalEnvelope;
use crate::model::error::ShardingResult;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::ops::history::{ClusterEventKind, History};
use crate::runtime::mailbox::States;
use crate::runtime::region::{ClusterPort, PortFuture, Region};
use crate::sharding::coordinator::ShardHome;
use crate::sharding::migration;
use crate::sharding::remote::Remote;
use crate::sharding::stats::ClusterShardingStats;

/// What regions and the system tell the control task.
#[derive(Debug)]
pub(crate) enum DriverMsg {
    /// A shard has buffered messages and no home.
    Allocate {
        type_name: &'static str,
        shard: ShardId,
    },
    /// A message of a protocol line this node's version lacks reached a
    /// shard hosted here: ask for it to move to a newer node.
    NeedsNewer {
        type_name: &'static str,
        shard: ShardId,
    },
    /// An entity type was registered here: tell the coordinator.
    TypeRegistered,
    /// Answered once everything sent before it is handled.
    Barrier(tokio::sync::oneshot::Sender<()>),
    /// The system shut down: its regions are gone. The task goes on as a
    /// coordinator core for the cluster (the node may still be the oldest
    /// member) and tells every coordinator it sees that this node hosts
    /// nothing any more.
    Retire,
    /// The system begins a graceful leave: ask the coordinator to hand off
    /// every shard hosted here. Answered whether there is a coordinator that
    /// may have somewhere to move them (if not, there is nothing to wait for).
    Leave(tokio::sync::oneshot::Sender<bool>),
    /// A handed-off shard's entities have all stopped (from the region).
    ShardStopped {
        type_name: &'static str,
        shard: ShardId,
        generation: u64,
    },
    /// Gather every member's view of a type (answered by the deadline with
    /// what came, the silent members listed as failed).
    Stats {
        type_name: &'static str,
        timeout: Duration,
        reply: tokio::sync::oneshot::Sender<ClusterShardingStats>,
    },
    /// Its remember-entities records are written: report it to the coordinator.
    ReportStopped {
        type_name: &'static str,
        shard: ShardId,
        generation: u64,
    },
}

/// A region's way to the cluster: envelopes and passivations go out on
/// the pipes, allocation requests and stopped shards to the driver.
pub(crate) struct RegionLink {
    pub(crate) remote: Arc<Remote>,
    pub(crate) driver: mpsc::UnboundedSender<DriverMsg>,
    /// The node's history.
    pub(crate) history: Arc<History>,
}

impl ClusterPort for RegionLink {
    fn forward(
        &self,
        home: ShardHome,
        region: &Region,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
        deadline: Option<(tokio::time::Instant, Duration)>,
    ) -> ShardingResult<bool> {
        self.remote
            .forward(home, region, shard, entity_id, envelope, deadline)
    }

    fn passivate(
        &self,
        owner: UniqueAddress,
        type_name: &'static str,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<()> {
        self.remote.passivate(owner, type_name, shard, entity_id)
    }

    fn allocate(&self, type_name: &'static str, shard: ShardId) -> bool {
        self.driver
            .send(DriverMsg::Allocate { type_name, shard })
            .is_ok()
    }

    fn needs_newer(&self, type_name: &'static str, shard: ShardId) {
        let _ = (self.driver).send(DriverMsg::NeedsNewer { type_name, shard });
    }

    fn shard_stopped(&self, type_name: &'static str, shard: ShardId, generation: u64) {
        self.history.record_shard(
            ClusterEventKind::HandedOff,
            shard.0,
            format!("{type_name}: handed off, the entities stopped"),
        );
        let _ = self.driver.send(DriverMsg::ShardStopped {
            type_name,
            shard,
            generation,
        });
    }

    fn fetch_states(
        &self,
        type_name: &'static str,
        shard: ShardId,
        generation: u64,
        from: UniqueAddress,
        timeout: Duration,
    ) -> PortFuture<Result<States, String>> {
        let transport = self.remote.transport().clone();
        Box::pin(migration::fetch(
            transport, type_name, shard, generation, from, timeout,
        ))
    }

    fn record(&self, kind: ClusterEventKind, shard: Option<ShardId>, text: String) {
        match shard {
            Some(shard) => self.history.record_shard(kind, shard.0, text),
            None => self.history.record(kind, text),
        }
    }
}
