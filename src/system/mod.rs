//! The sharded system: its builder, entity registration and entity refs.
//!
//! ```
//! # use std::time::Duration;
//! # use datum_cluster_sharding::prelude::*;
//! # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
//! # #[derive(Serialize, Deserialize)] pub struct Get;
//! # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
//! # #[derive(Default)] struct CounterEntity { total: u64 }
//! # impl Entity for CounterEntity { type Protocol = Counter; }
//! # impl Handler<Add> for CounterEntity {
//! #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
//! # }
//! # impl Handler<Get> for CounterEntity {
//! #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
//! # }
//! # #[tokio::main] async fn main() -> ShardingResult<()> {
//! let system = ShardedSystem::builder().num_shards(64).start().await?;
//! system.entity_type::<CounterEntity>().register(|_ctx| CounterEntity::default()).await?;
//! let cart = system.entity_ref::<Counter>("cart-42");
//! cart.tell(Add(3)).await?;
//! assert_eq!(cart.ask(Get, Duration::from_secs(5)).await?, 3);
//! system.shutdown().await;
//! # Ok(()) }
//! ```

mod builder;
mod entity_ref;
#[cfg(test)]
mod finishing_tests;
mod lifecycle;
mod queries;
pub mod registration;

pub use builder::ShardedSystemBuilder;
pub use entity_ref::EntityRef;

use std::any::TypeId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use crate::entity::{JournalWriter, MigrationEvent, StateWriter};
use crate::model::config::ShardingConfig;
use crate::model::extractor::ShardExtractor;
use crate::model::protocol::Protocol;
use crate::model::protocol::SealedProtocol;
use crate::persistence::remember::NoStore;
use crate::persistence::remember::writer::Remember;
use crate::persistence::{DurableStateStore, Journal, NoJournal, SnapshotStore};
use crate::runtime::ask_waits::AskWaits;
use crate::runtime::region::{Region, RegionProtocol};
use crate::runtime::traffic::TrafficCounts;
use crate::sharding::driver::{ClusterLink, RegionLink};
use crate::util::fast_hash::FastMap;

/// What a region needs to know of protocol `P`.
fn region_protocol<P: Protocol>() -> RegionProtocol {
    RegionProtocol {
        type_name: P::TYPE_NAME,
        id: TypeId::of::<P>(),
        fingerprint: P::FINGERPRINT,
        lines: P::LINES,
        decode: <P as SealedProtocol>::decode,
        extract: |entity_id, num_shards| {
            <P::Extractor as Default>::default().shard_id(entity_id, num_shards)
        },
    }
}

/// A running sharded system on this node. `S` is its remember-entities store
/// ([`NoStore`] when built without one), `J` its journal for event-sourced
/// entities ([`NoJournal`] when built without one).
///
/// Cheap to clone; clones share the system.
pub struct ShardedSystem<S = NoStore, J = NoJournal> {
    shared: Arc<Shared>,
    store: Arc<S>,
    journal: Arc<J>,
}

impl<S, J> Clone for ShardedSystem<S, J> {
    fn clone(&self) -> Self {
        ShardedSystem {
            shared: self.shared.clone(),
            store: self.store.clone(),
            journal: self.journal.clone(),
        }
    }
}

/// The state every clone of a system and its tasks share.
pub(crate) struct Shared {
    config: ShardingConfig,
    regions: RwLock<FastMap<&'static str, Arc<Region>>>,
    stopped: AtomicBool,
    /// `shutdown` has begun (a graceful leave comes before `stopped`).
    leaving: AtomicBool,
    /// The link to the cluster node, for a system built with `node`.
    cluster: Option<ClusterLink>,
    /// The remember-entities write-behind queue, started on first use.
    remember: Mutex<Option<Arc<Remember>>>,
    /// The batching writer of the journal, once an event-sourced type is
    /// registered.
    journal_writer: OnceLock<Arc<JournalWriter>>,
    /// The journal, once an event-sourced type is registered.
    journal: OnceLock<Arc<dyn Journal>>,
    /// The snapshot store, once a snapshotted type is registered.
    snapshot_store: OnceLock<Arc<dyn SnapshotStore>>,
    /// The durable-state store, once a durable-state type is registered.
    state_store: OnceLock<Arc<dyn DurableStateStore>>,
    /// The batching writer of its saves, from then on.
    state_writer: OnceLock<Arc<StateWriter>>,
    /// The one graceful stop (`shutdown` from the system or its node): the
    /// task running it, as a watch that turns true when it is done.
    stop_task: Mutex<Option<tokio::sync::watch::Receiver<bool>>>,
    /// What became of migrated states here.
    migration_events: tokio::sync::broadcast::Sender<MigrationEvent>,
    /// The deadlines of the asks waiting on this node that no pending
    /// remote ask keeps (SPEC §13.5).
    asks: Arc<AskWaits>,
    /// What this node's entities send to which shards, when placement by
    /// traffic is on (SPEC §13.11).
    traffic: Arc<TrafficCounts>,
}

impl Shared {
    /// The link to the cluster node, for a system built with `node`.
    pub(crate) fn cluster_link(&self) -> Option<&ClusterLink> {
        self.cluster.as_ref()
    }

    pub(crate) fn is_shut_down(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// `shutdown` has begun: the graceful leave hands the shards off.
    #[cfg(feature = "management")]
    pub(crate) fn is_leaving(&self) -> bool {
        self.leaving.load(Ordering::Acquire)
    }

    /// The members' application versions, as the sharding coordinator this
    /// node follows last sent them with its table (empty without a cluster
    /// node, or before a table came).
    #[cfg(feature = "management")]
    pub(crate) fn member_app_versions(&self) -> crate::sharding::control_core::AppVersions {
        let Some(link) = self.cluster.as_ref() else {
            return Default::default();
        };
        link.app_versions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The cluster-wide view of entity type `type_name` (see
    /// `ShardedSystem::cluster_sharding_stats`).
    pub(crate) async fn cluster_stats(
        &self,
        type_name: &'static str,
        timeout: std::time::Duration,
    ) -> crate::ShardingResult<crate::sharding::ClusterShardingStats> {
        let Some(link) = &self.cluster else {
            return Err(crate::ShardingError::InvalidConfig(
                "cluster_sharding_stats needs a system built with a cluster node".into(),
            ));
        };
        let (reply, answer) = tokio::sync::oneshot::channel();
        link.driver
            .send(crate::sharding::driver::DriverMsg::Stats {
                type_name,
                timeout,
                reply,
            })
            .map_err(|_| crate::ShardingError::ShuttingDown)?;
        answer.await.map_err(|_| crate::ShardingError::ShuttingDown)
    }

    /// The coordinator as this node sees it (`None` without a cluster node).
    /// `registered` is also checked against the regions as they are now: a
    /// region added since the control task last published its status has
    /// no coordinator's table yet.
    pub(crate) fn coordinator_status(&self) -> Option<crate::sharding::CoordinatorStatus> {
        let link = self.cluster.as_ref()?;
        let mut status = link
            .coordinator
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if status.registered {
            let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
            status.registered = regions.values().all(|r| r.accepted_by().is_some());
        }
        Some(status)
    }

    /// The region of the entity type named `type_name`.
    pub(crate) fn region(&self, type_name: &str) -> Option<Arc<Region>> {
        self.regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(type_name)
            .cloned()
    }

    /// Every region, in no particular order.
    pub(crate) fn all_regions(&self) -> Vec<Arc<Region>> {
        self.regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }
}
