//! A system's link to its cluster node: claiming the sharding channels of
//! the node's pipes (the data and migration handlers run inline on the
//! pipes' reader tasks), starting the control task and the deadline task,
//! a graceful leave and the stop; and what the link needs of the system.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::cluster::ClusterNode;
use crate::model::error::{ShardingError, ShardingResult};
use crate::runtime::ask_waits::keep_deadlines;
use crate::runtime::region::Region;
use crate::runtime::traffic::ShardKey;
use crate::sharding::control_core::{AppVersions, ControlCore};
use crate::sharding::coordinator::{
    CoordinatorConfig, CoordinatorCore, LeastShardAllocation, RebalanceRound,
    ShardAllocationStrategy,
};
use crate::sharding::migration;
use crate::sharding::remote::Remote;
use crate::sharding::stats::CoordinatorStatus;
use crate::transport::Incoming;
use crate::wire::channels::{SHARDING_CONTROL, SHARDING_DATA, SHARDING_MIGRATION};

use super::data::handle_data;
use super::inbox::DriverMsg;
use super::{Control, lock};

/// How many inbound control messages may wait for the control task.
const CONTROL_CAPACITY: usize = 4_096;
/// How long `stop` waits for the control task to send its goodbye.
const STOP_WAIT: Duration = Duration::from_secs(1);

/// A system's link to its cluster node, held by the system.
pub(crate) struct ClusterLink {
    pub(crate) node: ClusterNode,
    pub(crate) remote: Arc<Remote>,
    pub(crate) driver: mpsc::UnboundedSender<DriverMsg>,
    pub(crate) rounds: Arc<Mutex<Vec<RebalanceRound>>>,
    /// This node's view of the sharding coordinator, as the control task
    /// last published it.
    pub(crate) coordinator: Arc<Mutex<CoordinatorStatus>>,
    /// The members' application versions, as the coordinator this node
    /// follows last sent them with its table (published when a table
    /// changes them).
    pub(crate) app_versions: Arc<Mutex<AppVersions>>,
    parts: Mutex<Option<Parts>>,
    /// The system the inline data handler delivers into, once started.
    system: Arc<OnceLock<Weak<dyn SystemPort>>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// What the sharding layer needs of the system it joins to its cluster
/// node. The façade implements it; the driver holds it weakly, so the
/// system's handle alone decides how long it lives.
pub(crate) trait SystemPort: Send + Sync + 'static {
    /// The region of `type_name`, if registered.
    fn region(&self, type_name: &str) -> Option<Arc<Region>>;
    /// Every region.
    fn all_regions(&self) -> Vec<Arc<Region>>;
    /// The system's link to its cluster node.
    fn cluster_link(&self) -> Option<&ClusterLink>;
    /// Whether the system has stopped (shut down, or fenced).
    fn is_shut_down(&self) -> bool;
    /// This node is out of the cluster: the system stops at once (its
    /// handle refuses new work, its regions stop accepting, asks waiting
    /// on other nodes fail) and its regions stop their entities.
    fn fence(&self);
    /// The system's graceful stop (SPEC §10.6), run once whoever asks.
    fn shut_down(self: Arc<Self>) -> BoxFuture<'static, ()>;
    /// What this node's entities sent to which shards since the last call
    /// (sampled; none unless placement by traffic is on, SPEC §13.11).
    fn take_traffic(&self) -> Vec<(ShardKey, ShardKey, u64)>;
}

/// A boxed future, as `SystemPort::shut_down` returns it.
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What the tasks take when they start.
struct Parts {
    rx: mpsc::UnboundedReceiver<DriverMsg>,
    control: mpsc::Receiver<Incoming>,
    strategy: Box<dyn ShardAllocationStrategy>,
    config: CoordinatorConfig,
}

impl ClusterLink {
    /// Claims the sharding channels of `node`'s pipes. Fails when another
    /// sharded system already runs on the node.
    pub(crate) fn new(
        node: ClusterNode,
        strategy: Option<Box<dyn ShardAllocationStrategy>>,
        config: CoordinatorConfig,
    ) -> ShardingResult<Self> {
        let transport = node.transport();
        let taken = |_| {
            ShardingError::InvalidConfig(
                "a sharded system already runs on this cluster node".into(),
            )
        };
        let control = transport
            .register(SHARDING_CONTROL, CONTROL_CAPACITY)
            .map_err(taken)?;
        let remote = Remote::new(transport.clone());
        let system: Arc<OnceLock<Weak<dyn SystemPort>>> = Arc::new(OnceLock::new());
        // Envelopes and replies are handled on the reader task of the pipe
        // they arrive on: decode, check, deliver, with no task hop.
        // The handler holds the system only weakly, and nothing that owns the
        // transport: a reader may keep it until its pipe's next frame after
        // it is unregistered.
        let target = system.clone();
        let registered = transport.register_inline_borrowed(SHARDING_DATA, move |from, payload| {
            if let Some(shared) = target.get().and_then(Weak::upgrade)
                && let Some(link) = shared.cluster_link()
            {
                handle_data(&*shared, &link.remote, from, payload);
            }
        });
        if let Err(error) = registered {
            transport.unregister(SHARDING_CONTROL);
            return Err(taken(error));
        }
        // A new owner's pulls of migrated states, answered on the reader
        // task (copies of references to the kept chunks, and their CBOR).
        let target = system.clone();
        let registered = transport.register_inline(SHARDING_MIGRATION, move |incoming| {
            if let Some(shared) = target.get().and_then(Weak::upgrade) {
                migration::serve(|type_name| shared.region(type_name), incoming);
            }
        });
        if let Err(error) = registered {
            transport.unregister(SHARDING_CONTROL);
            transport.unregister(SHARDING_DATA);
            return Err(taken(error));
        }
        let (driver, rx) = mpsc::unbounded_channel();
        Ok(ClusterLink {
            remote,
            node,
            driver,
            rounds: Arc::new(Mutex::new(Vec::new())),
            coordinator: Arc::new(Mutex::new(CoordinatorStatus::default())),
            app_versions: Arc::default(),
            system,
            parts: Mutex::new(Some(Parts {
                rx,
                control,
                strategy: strategy.unwrap_or_else(|| Box::new(LeastShardAllocation)),
                config,
            })),
            tasks: Mutex::new(Vec::new()),
        })
    }

    /// Starts the tasks for the system `shared`: the control task, and the
    /// one that keeps the pending remote asks' deadlines.
    pub(crate) fn spawn(&self, shared: Weak<dyn SystemPort>) {
        let Some(parts) = lock(&self.parts).take() else {
            return;
        };
        let me = self.remote.me();
        let control = Control {
            shared: shared.clone(),
            node: self.node.clone(),
            me,
            core: ControlCore::new(me, CoordinatorCore::new(me, parts.config, parts.strategy))
                .with_app_version(&self.node.config().app_version),
            self_tx: self.driver.downgrade(),
            rx: parts.rx,
            control: parts.control,
            state: self.node.watch_state(),
            stats: BTreeMap::new(),
            next_stats: 0,
            fenced: false,
            rounds: self.rounds.clone(),
            sweeps: 0,
            status: self.coordinator.clone(),
            app_versions: self.app_versions.clone(),
            remote: self.remote.clone(),
        };
        // `node.shutdown()` hands this system's shards off first.
        let system = shared.clone();
        self.node.set_before_leave(Some(Arc::new(move || {
            let system = system.clone();
            Box::pin(async move {
                if let Some(shared) = system.upgrade() {
                    shared.shut_down().await;
                }
            })
        })));
        let _ = self.system.set(shared);
        lock(&self.tasks).push(tokio::spawn(control.run()));
        // The pending remote asks' deadlines (SPEC §13.5).
        let expiry = keep_deadlines(Arc::downgrade(&self.remote));
        lock(&self.tasks).push(tokio::spawn(expiry));
    }

    /// Asks the coordinator to hand off every shard hosted here (a graceful
    /// leave). True when the caller should wait for the handoffs: there is
    /// a coordinator, and somewhere the shards may go.
    pub(crate) async fn leave(&self) -> bool {
        let (done, answer) = tokio::sync::oneshot::channel();
        if self.driver.send(DriverMsg::Leave(done)).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }

    /// Stops the tasks and fails the asks still waiting on other nodes
    /// (`ShutDownInFlight`: they may have been processed there).
    ///
    /// The control task first tells the coordinator this node's regions are
    /// going (`Unregister`), so their shards get new homes now rather than
    /// when the node leaves the cluster. The data handler stays registered
    /// until the link is dropped: envelopes that still arrive are answered
    /// `ShuttingDown` by the stopped regions instead of vanishing.
    pub(crate) async fn stop(&self) {
        let (done, retired) = tokio::sync::oneshot::channel();
        let _ = self.driver.send(DriverMsg::Retire);
        let _ = self.driver.send(DriverMsg::Barrier(done));
        let _ = tokio::time::timeout(STOP_WAIT, retired).await;
        self.remote.stop_waiting();
    }
}

impl Drop for ClusterLink {
    fn drop(&mut self) {
        self.node.set_before_leave(None);
        let transport = self.node.transport();
        transport.unregister(SHARDING_DATA);
        transport.unregister(SHARDING_CONTROL);
        transport.unregister(SHARDING_MIGRATION);
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}
