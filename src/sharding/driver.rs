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
//! ```
//!
//! The control task is IO around two sans-IO cores: the coordinator core
//! (`coordinator.rs`, acting when this node is the coordinator) and the
//! region side of the allocation protocol (`region_core.rs`: where this
//! node's shards wait for a home, registrations, reports, leaving). It
//! feeds both with `now`, runs their commands, and wakes at the earlier of
//! their `poll_timeout`s (and for stats deadlines and a once-a-second
//! sweep of asks whose caller gave up). The data path
//! runs inline on each pipe's reader task (`Transport::register_inline_borrowed`,
//! the payload read in place): decoding and delivery never block,
//! so no queue or task hop sits between the socket and an entity's mailbox,
//! and a burst of entity traffic never delays the coordinator's protocol
//! (which travels on the pipes' priority lane and its own task).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::sleep_until;

use crate::cluster::ClusterNode;
use crate::envelope::{Delivery, LocalEnvelope};
use crate::envelope::{RemoteReply, ReplySink};
use crate::error::{RegionRefusal, ShardingError, ShardingResult};
use crate::extractor::ShardId;
use crate::identity::UniqueAddress;
use crate::membership::{MemberStatus, MembershipState};
use crate::runtime::ask_waits::keep_deadlines;
use crate::runtime::mailbox::States;
use crate::runtime::region::{ClusterPort, PortFuture, Region};
use crate::runtime::slot::HomeChange;
use crate::sharding::coordinator::{
    Command, CoordinatorConfig, CoordinatorCore, LeastShardAllocation, RebalanceReason,
    RebalanceRound, ShardAllocationStrategy, ShardHome,
};
use crate::sharding::fast::{self, DataRef, DeliveryRef, EnvelopeRef};
use crate::sharding::migration;
use crate::sharding::region_core::{LocalRegions, RegionCommand, RegionCore};
use crate::sharding::remote::Remote;
use crate::sharding::stats::{ClusterShardingStats, CoordinatorStatus};
use crate::sharding::wire::{
    ActiveCoordinator, CompactEnvelope, CompactEnvelopeRef, ControlMsg, DataMsg, RemoteError,
    ReplyBody, TypeRegistration,
};
use crate::telemetry::TraceContext;
use crate::warn_limit::{WarnLimit, warn_limited};

/// Warnings about undecodable data messages from authenticated peers, at
/// most ten per ten seconds in this process (the rest at debug).
static BAD_DATA: WarnLimit = WarnLimit::new(10, Duration::from_secs(10));
use crate::transport::Incoming;
use crate::wire::channels::{SHARDING_CONTROL, SHARDING_DATA, SHARDING_MIGRATION};

/// How many inbound control messages may wait for the control task.
const CONTROL_CAPACITY: usize = 4_096;
/// The least time between two of the control task's timed wakes.
const MIN_WAKE: Duration = Duration::from_millis(5);
/// How long `stop` waits for the control task to send its goodbye.
const STOP_WAIT: Duration = Duration::from_secs(1);
/// How often asks whose caller gave up are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// The buffered-message gauges are sampled every this many sweeps.
const SAMPLE_BUFFERS_EVERY: u32 = 5;

/// What regions and the system tell the control task.
#[derive(Debug)]
pub(crate) enum DriverMsg {
    /// A shard has buffered messages and no home.
    Allocate {
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

/// A system's link to its cluster node, held by the system.
pub(crate) struct ClusterLink {
    pub(crate) node: ClusterNode,
    pub(crate) remote: Arc<Remote>,
    pub(crate) driver: mpsc::UnboundedSender<DriverMsg>,
    pub(crate) rounds: Arc<Mutex<Vec<RebalanceRound>>>,
    /// This node's view of the sharding coordinator, as the control task
    /// last published it.
    pub(crate) coordinator: Arc<Mutex<CoordinatorStatus>>,
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
}

/// A boxed future, as `SystemPort::shut_down` returns it.
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// A region's way to the cluster: envelopes and passivations go out on
/// the pipes, allocation requests and stopped shards to the driver.
pub(crate) struct RegionLink {
    pub(crate) remote: Arc<Remote>,
    pub(crate) driver: mpsc::UnboundedSender<DriverMsg>,
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

    fn shard_stopped(&self, type_name: &'static str, shard: ShardId, generation: u64) {
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
}

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

    /// Starts the control and inbound tasks for the system `shared`.
    pub(crate) fn spawn(&self, shared: Weak<dyn SystemPort>) {
        let Some(parts) = lock(&self.parts).take() else {
            return;
        };
        let me = self.remote.me();
        let control = Control {
            shared: shared.clone(),
            node: self.node.clone(),
            me,
            core: CoordinatorCore::new(me, parts.config, parts.strategy),
            self_tx: self.driver.downgrade(),
            rx: parts.rx,
            control: parts.control,
            state: self.node.watch_state(),
            side: RegionCore::new(me),
            stats: BTreeMap::new(),
            next_stats: 0,
            fenced: false,
            rounds: self.rounds.clone(),
            sweeps: 0,
            status: self.coordinator.clone(),
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

/// A member answered that it acts as the coordinator: the highest epoch
/// among such answers wins (two only around a partition's healing).
fn note_coordinator(
    stats: &mut ClusterShardingStats,
    from: UniqueAddress,
    active: ActiveCoordinator,
) {
    if stats
        .coordinator
        .as_ref()
        .is_none_or(|c| c.epoch < active.epoch)
    {
        stats.coordinator = Some(CoordinatorStatus {
            acting: Some(from),
            epoch: active.epoch,
            allocating: Some(active.allocating),
            registered: false,
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The inbound data path: decode, check, deliver. Runs on a reader task.
fn handle_data(
    shared: &dyn SystemPort,
    remote: &Arc<Remote>,
    from: &UniqueAddress,
    payload: &[u8],
) {
    // The hot messages in their canonical form, read in place.
    match fast::decode(payload, from) {
        Some(DataRef::Envelope(envelope)) => {
            return deliver_envelope(shared, remote, from, envelope);
        }
        Some(DataRef::ReplyOk { ask_id, value }) => {
            return remote.complete(from, ask_id, Ok(value));
        }
        None => {}
    }
    let msg: DataMsg = match ciborium::from_reader(payload) {
        Ok(msg) => msg,
        Err(error) => {
            warn_limited!(BAD_DATA, "undecodable sharding data message dropped"; %from, %error);
            return;
        }
    };
    match msg {
        DataMsg::Reply { ask_id, result } => match result {
            ReplyBody::Ok(bytes) => remote.complete(from, ask_id, Ok(&bytes)),
            ReplyBody::Err(error) => remote.complete(from, ask_id, Err(error)),
        },
        DataMsg::Envelope(e) => {
            let envelope = EnvelopeRef {
                type_name: &e.type_name,
                fingerprint: e.fingerprint,
                shard: e.shard,
                generation: e.generation,
                entity_id: &e.entity_id,
                index: e.index,
                hops: e.hops,
                reply_to: e.reply_to,
                payload: &e.payload,
                // (Only the canonical form's trace is read.)
                trace: None,
                delivery: e
                    .delivery
                    .as_ref()
                    .map(|(producer, epoch, seq)| DeliveryRef(producer, *epoch, *seq)),
            };
            deliver_envelope(shared, remote, from, envelope);
        }
        DataMsg::E(CompactEnvelope(t, fingerprint, shard, generation, e, index, ask, payload)) => {
            let c =
                CompactEnvelopeRef(&t, fingerprint, shard, generation, &e, index, ask, &payload);
            deliver_envelope(shared, remote, from, EnvelopeRef::from_compact(c, from));
        }
        DataMsg::R(ask_id, bytes) => remote.complete(from, ask_id, Ok(&bytes)),
        DataMsg::Passivate {
            type_name,
            shard,
            entity_id,
        } => {
            if let Some(region) = shared.region(&type_name)
                && shard < region.num_shards()
                && let Err(error) =
                    region.passivate_from(ShardId(shard), &entity_id.into(), None, true)
            {
                tracing::debug!(%from, %error, "remote passivation request dropped");
            }
        }
    }
}

/// Checks a remote envelope against the local region and delivers it; every
/// refusal is answered to the asker.
fn deliver_envelope(
    shared: &dyn SystemPort,
    remote: &Arc<Remote>,
    from: &UniqueAddress,
    envelope: EnvelopeRef<'_>,
) {
    let sink: Arc<dyn ReplySink> = remote.clone();
    let reply = envelope
        .reply_to
        .map(|target| RemoteReply::new(target, sink));
    let refuse = |reply: Option<RemoteReply>, error: RemoteError| {
        tracing::debug!(%from, type_name = %envelope.type_name, ?error, "remote envelope refused");
        if let Some(reply) = reply {
            reply.fail_remote(error);
        }
    };
    let Some(region) = shared.region(envelope.type_name) else {
        return refuse(reply, RemoteError::NotRegistered);
    };
    if region.fingerprint != envelope.fingerprint {
        return refuse(
            reply,
            RemoteError::ProtocolMismatch {
                receiver: region.fingerprint,
                sender: envelope.fingerprint,
            },
        );
    }
    if envelope.shard >= region.num_shards()
        || (region.extract)(envelope.entity_id, region.num_shards()) != ShardId(envelope.shard)
    {
        // Out of range, or not the shard this node's extractor and shard
        // count put the entity in (a node configured differently): refused,
        // so one entity never lives in two shards.
        return refuse(
            reply,
            RemoteError::InvalidShard {
                shard: envelope.shard,
                num_shards: region.num_shards(),
            },
        );
    }
    let hops = envelope.hops.saturating_add(1);
    match (region.decode)(envelope.index, envelope.payload, reply, hops) {
        Ok(mut local) => {
            local.set_routed_under(envelope.generation);
            if let Some(DeliveryRef(producer, epoch, seq)) = envelope.delivery {
                local.set_delivery(Delivery {
                    producer: producer.into(),
                    epoch,
                    seq,
                });
            }
            if let Some(tracing) = region.tracing()
                && let Some(parent) = envelope.trace.and_then(|t| TraceContext::from_bytes(&t))
            {
                let span = tracing::info_span!(
                    "datum.receive",
                    entity_type = region.type_name,
                    entity_id = envelope.entity_id,
                );
                tracing.propagation().set_parent(&span, parent);
                local.set_trace(span);
            }
            // On error the envelope has been answered inside `deliver`.
            let _ = region.deliver_str(ShardId(envelope.shard), envelope.entity_id, local);
        }
        Err(undecodable) => {
            tracing::debug!(%from, error = %undecodable.error, "remote envelope does not decode");
            if let Some(reply) = undecodable.reply {
                reply.fail(&undecodable.error);
            }
        }
    }
}

/// A cluster-wide stats request in progress.
struct PendingStats {
    deadline: Instant,
    waiting: BTreeSet<UniqueAddress>,
    stats: ClusterShardingStats,
    reply: tokio::sync::oneshot::Sender<ClusterShardingStats>,
}

/// The hosted shards of a region, with their live entities, as `Stats` carries them.
fn hosted_shards(region: &Region) -> Vec<(u32, u32)> {
    region
        .state()
        .shards
        .into_iter()
        .map(|(shard, live)| (shard.0, u32::try_from(live).unwrap_or(u32::MAX)))
        .collect()
}

/// The control task's state.
struct Control {
    shared: Weak<dyn SystemPort>,
    node: ClusterNode,
    me: UniqueAddress,
    core: CoordinatorCore,
    rx: mpsc::UnboundedReceiver<DriverMsg>,
    control: mpsc::Receiver<Incoming>,
    state: watch::Receiver<MembershipState>,
    /// The region side of the allocation protocol.
    side: RegionCore,
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
    remote: Arc<Remote>,
}

impl Control {
    async fn run(mut self) {
        let state = self.state.borrow_and_update().clone();
        self.membership(state);
        let mut next_sweep = Instant::now() + SWEEP_EVERY;
        let mut woke = Instant::now();
        loop {
            // Wake when a core has something to do with time alone, when a
            // stats request runs out, and for the sweep of given-up asks.
            // (Never sooner than `MIN_WAKE` after the last wake: a deadline
            // left in the past, a core's bug, must not spin the task.)
            let due = [
                self.core.poll_timeout(),
                self.side.poll_timeout(),
                self.stats.values().map(|p| p.deadline).min(),
                Some(next_sweep),
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(next_sweep)
            .max(woke + MIN_WAKE);
            tokio::select! {
                msg = self.rx.recv() => match msg {
                    None => break,
                    Some(DriverMsg::Retire) => {
                        let types = self.hosted().type_names();
                        let commands = self.side.retire(Instant::now(), types);
                        self.run_side(commands);
                    }
                    Some(DriverMsg::Barrier(done)) => {
                        let _ = done.send(());
                    }
                    Some(DriverMsg::Allocate { type_name, shard }) => {
                        let commands = self.side.allocate(Instant::now(), &self.hosted(), type_name, shard.0);
                        self.run_side(commands);
                    }
                    Some(DriverMsg::TypeRegistered) => {
                        let epoch = self.core.highest_epoch();
                        let commands = self.side.register(Instant::now(), &self.hosted(), epoch);
                        self.run_side(commands);
                    }
                    Some(DriverMsg::Leave(done)) => {
                        let wait = self.begin_leave();
                        let _ = done.send(wait);
                    }
                    Some(DriverMsg::ShardStopped { type_name, shard, generation }) => {
                        self.flush_then_report(type_name, shard, generation);
                    }
                    Some(DriverMsg::Stats { type_name, timeout, reply }) => {
                        self.gather_stats(type_name, timeout, reply);
                    }
                    Some(DriverMsg::ReportStopped { type_name, shard, generation }) => {
                        let commands = self.side.shard_stopped(Instant::now(), type_name, shard.0, generation);
                        self.run_side(commands);
                    }
                },
                incoming = self.control.recv() => match incoming {
                    Some(incoming) => match ciborium::from_reader::<ControlMsg, _>(&incoming.payload[..]) {
                        Ok(msg) => self.handle(incoming.from, msg),
                        Err(error) => tracing::debug!(from = %incoming.from, %error, "undecodable sharding control message dropped"),
                    },
                    None => break,
                },
                changed = self.state.changed() => {
                    if changed.is_err() {
                        // The cluster node stopped (downed, or shut down):
                        // what this node hosts must stop too.
                        self.fence("the cluster node stopped");
                        break;
                    }
                    let state = self.state.borrow_and_update().clone();
                    self.membership(state);
                }
                _ = sleep_until(due.into()) => {
                    let now = Instant::now();
                    woke = now;
                    self.wake(now);
                    if now >= next_sweep {
                        next_sweep = now + SWEEP_EVERY;
                        self.remote.sweep();
                        // Every fifth sweep (5 s): sampling counts every
                        // hosted entity under its slot's lock.
                        self.sweeps = self.sweeps.wrapping_add(1);
                        if self.sweeps.is_multiple_of(SAMPLE_BUFFERS_EVERY) {
                            for region in self.regions() {
                                region.sample_buffers();
                            }
                        }
                    }
                }
            }
            let status = self.coordinator_status();
            let mut published = lock(&self.status);
            if *published != status {
                *published = status;
            }
        }
        // Stopped (fenced, or the system is gone): this node follows no
        // coordinator any more, and is none.
        *lock(&self.status) = CoordinatorStatus::default();
        tracing::debug!(node = %self.me, "sharding control task stopped");
    }

    fn regions(&self) -> Vec<Arc<Region>> {
        match self.shared.upgrade() {
            Some(shared) => shared.all_regions(),
            None => Vec::new(),
        }
    }

    fn region(&self, type_name: &str) -> Option<Arc<Region>> {
        self.shared.upgrade()?.region(type_name)
    }

    /// Starts a graceful leave. Returns whether handoffs are worth waiting
    /// for: not when there is no coordinator, nor when this node
    /// coordinates and no other region can take a shard.
    fn begin_leave(&mut self) -> bool {
        let hosted = self.hosted();
        let (me, core) = (self.me, &self.core);
        let (wait, commands) = self.side.begin_leave(Instant::now(), &hosted, |types| {
            core.is_active() && !types.iter().any(|t| core.has_host_besides(t, &me))
        });
        self.run_side(commands);
        wait
    }

    /// A handed-off shard stopped: once what its entities recorded is in
    /// the store (the next home reads it to respawn them), tell the
    /// coordinator.
    fn flush_then_report(&mut self, type_name: &'static str, shard: ShardId, generation: u64) {
        let report = DriverMsg::ReportStopped {
            type_name,
            shard,
            generation,
        };
        let remember = self.region(type_name).and_then(|r| r.remember().cloned());
        match (remember, self.self_tx.upgrade()) {
            (Some(remember), Some(tx)) => {
                tokio::spawn(async move {
                    if let Err(error) = remember.barrier().await {
                        tracing::warn!(type_name, %shard, %error, "remember-entities records of a handed-off shard not flushed");
                    }
                    let _ = tx.send(report);
                });
            }
            _ => {
                let commands =
                    self.side
                        .shard_stopped(Instant::now(), type_name, shard.0, generation);
                self.run_side(commands);
            }
        }
    }

    /// Asks every live member (this one answered at once) for its region
    /// of `type_name`.
    fn gather_stats(
        &mut self,
        type_name: &'static str,
        timeout: Duration,
        reply: tokio::sync::oneshot::Sender<ClusterShardingStats>,
    ) {
        let mut stats = ClusterShardingStats::default();
        if let Some(region) = self.region(type_name) {
            let shards = region.state().shards;
            stats.regions.insert(self.me, shards);
        }
        if let Some((epoch, allocating)) = self.core.activity(Instant::now()) {
            note_coordinator(&mut stats, self.me, ActiveCoordinator { epoch, allocating });
        }
        let state = self.state.borrow().clone();
        let waiting: BTreeSet<UniqueAddress> = state
            .members
            .iter()
            .filter(|m| {
                matches!(
                    m.status,
                    MemberStatus::Joining | MemberStatus::Up | MemberStatus::Leaving
                )
            })
            .map(|m| m.address)
            .filter(|a| *a != self.me)
            .collect();
        if waiting.is_empty() {
            let _ = reply.send(stats);
            return;
        }
        let id = self.next_stats;
        self.next_stats += 1;
        for member in &waiting {
            let msg = ControlMsg::GetStats {
                id,
                type_name: type_name.to_owned(),
            };
            self.send_remote(*member, &msg);
        }
        self.stats.insert(
            id,
            PendingStats {
                deadline: Instant::now() + timeout,
                waiting,
                stats,
                reply,
            },
        );
    }

    fn stats_answer(
        &mut self,
        from: UniqueAddress,
        id: u64,
        region: bool,
        shards: Vec<(u32, u32)>,
        coordinator: Option<ActiveCoordinator>,
    ) {
        let Some(pending) = self.stats.get_mut(&id) else {
            return;
        };
        if !pending.waiting.remove(&from) {
            return;
        }
        if let Some(active) = coordinator {
            note_coordinator(&mut pending.stats, from, active);
        }
        if region {
            let shards = shards
                .into_iter()
                .map(|(shard, live)| (ShardId(shard), live as usize))
                .collect();
            pending.stats.regions.insert(from, shards);
        }
        if pending.waiting.is_empty()
            && let Some(done) = self.stats.remove(&id)
        {
            let _ = done.reply.send(done.stats);
        }
    }

    /// Answers the stats requests whose time is up, with the silent members
    /// as failed.
    fn expire_stats(&mut self, now: Instant) {
        let due: Vec<u64> = self
            .stats
            .iter()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            if let Some(mut done) = self.stats.remove(&id) {
                done.stats.failed = std::mem::take(&mut done.waiting);
                let _ = done.reply.send(done.stats);
            }
        }
    }

    /// This node is out of the cluster (downed — by the split-brain
    /// resolver on the losing side, by another member, or removed — or its
    /// cluster node stopped): its regions stop accepting and stop their
    /// entities, so that what the rest of the cluster reallocates does not
    /// also run here. Done once.
    fn fence(&mut self, why: &str) {
        if self.fenced {
            return;
        }
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        if shared.is_shut_down() {
            return;
        }
        self.fenced = true;
        if !shared.all_regions().is_empty() {
            tracing::warn!(node = %self.me, why, "this node is out of the cluster: its regions stop");
        }
        shared.fence();
    }

    fn membership(&mut self, mut state: MembershipState) {
        let now = Instant::now();
        // The coordinator this layer follows (the placement coordinator, or
        // with a resolver an oldest member beyond a partition: SPEC §13.15).
        let acting = self.core.acting(now, &state);
        state.coordinator = acting;
        if RegionCore::is_out(&state) {
            self.fence("this node was downed or removed");
        }
        let hosted = self.hosted();
        if state.coordinator == Some(self.me) && !self.core.is_active() {
            // Taking over: start from this node's replica and registration,
            // before the gone members' homes leave it below (their shards are
            // then known as theirs, and move as dead-owner moves).
            for region in &hosted.0 {
                self.core.seed(
                    region.type_name,
                    region.fingerprint,
                    region.num_shards(),
                    &region.replica(),
                );
            }
            let own = self.side.registrations(&hosted);
            let commands = self.core.register(now, self.me, &own);
            self.execute(commands);
        }
        let commands = self.side.members(&state, &hosted);
        self.run_side(commands);
        let commands = self.core.apply_membership(now, &state, acting);
        self.execute(commands);
        let epoch = self.core.highest_epoch();
        let commands = self.side.follow(now, state.coordinator, &hosted, epoch);
        self.run_side(commands);
        let commands = self.side.catch_up(now, &hosted);
        self.run_side(commands);
    }

    /// This node's regions, for the region side.
    fn hosted(&self) -> Hosted {
        Hosted(self.regions())
    }

    /// Runs the region side's commands.
    fn run_side(&mut self, commands: Vec<RegionCommand>) {
        for command in commands {
            match command {
                RegionCommand::Send { to, msg } => self.send(to, msg),
                RegionCommand::FailAsks(node) => {
                    let failed = self.remote.node_lost(&node);
                    tracing::debug!(node = %self.me, lost = %node, failed_asks = failed, "member gone");
                }
            }
        }
    }

    /// Time alone has work for a core: the view is looked at again when
    /// a hold on a flagged coordinator may have run out, then the
    /// coordinator core and the region side act, and stats requests whose
    /// time is up are answered.
    fn wake(&mut self, now: Instant) {
        if self.core.holding() {
            // The role may move when a hold runs out: the view is handled
            // again only then.
            let state = self.state.borrow().clone();
            if self.core.acting(now, &state) != self.core.acting_now() {
                self.membership(state);
            }
        }
        let commands = self.core.tick(now);
        self.execute(commands);
        self.tick_side(now);
        self.expire_stats(now);
    }

    /// The region side's timers, step by step: each step's messages (to
    /// this node itself, answered at once) land before the next looks.
    fn tick_side(&mut self, now: Instant) {
        let hosted = self.hosted();
        let commands = self.side.retry_requests(now, &hosted);
        self.run_side(commands);
        let epoch = self.core.highest_epoch();
        let commands = self.side.reregister(now, &hosted, epoch);
        self.run_side(commands);
        let commands = self.side.repeat_reports(now, &hosted);
        self.run_side(commands);
    }

    fn handle(&mut self, from: UniqueAddress, msg: ControlMsg) {
        let mut queue = VecDeque::from([(from, msg)]);
        while let Some((from, msg)) = queue.pop_front() {
            let now = Instant::now();
            let commands = match msg {
                ControlMsg::Register { types, epoch } => {
                    self.core.observe_epoch(epoch);
                    self.core.register(now, from, &types)
                }
                ControlMsg::Unregister { types } => self.core.unregister(now, from, &types),
                ControlMsg::GetHome {
                    type_name,
                    shard,
                    generation,
                } => self.core.get_home(now, from, &type_name, shard, generation),
                ControlMsg::ShardStopped {
                    type_name,
                    shard,
                    generation,
                } => self
                    .core
                    .shard_stopped(now, from, &type_name, shard, generation),
                ControlMsg::Leave { types } => self.core.leave(now, from, &types),
                ControlMsg::GetStats { id, type_name } => {
                    let region = self.region(&type_name);
                    let msg = ControlMsg::Stats {
                        id,
                        region: region.is_some(),
                        shards: region.as_deref().map(hosted_shards).unwrap_or_default(),
                        coordinator: self
                            .core
                            .activity(now)
                            .map(|(epoch, allocating)| ActiveCoordinator { epoch, allocating }),
                    };
                    self.send_remote(from, &msg);
                    Vec::new()
                }
                ControlMsg::Stats {
                    id,
                    region,
                    shards,
                    coordinator,
                } => {
                    self.stats_answer(from, id, region, shards, coordinator);
                    Vec::new()
                }
                msg @ (ControlMsg::Home { .. }
                | ControlMsg::Table { .. }
                | ControlMsg::HandOff { .. }
                | ControlMsg::Left { .. }
                | ControlMsg::Refused { .. }) => {
                    if !self.side.hears(from) {
                        tracing::debug!(node = %self.me, %from, "a home from a node that is not the coordinator here: ignored");
                    } else if !self.core.accept_epoch(&msg) {
                        // Fencing (SPEC §13.15): a coordinator of an older
                        // term. Register again, carrying the higher epoch, so
                        // that it takes one above it if it is still in charge.
                        tracing::debug!(node = %self.me, %from, epoch = ?msg.coordinator_epoch(), highest = self.core.highest_epoch(), "a coordinator message from an older epoch: ignored");
                        self.side.older_epoch();
                    } else {
                        self.side.coordinator_said(from, msg, &self.hosted());
                    }
                    Vec::new()
                }
            };
            for command in commands {
                match command {
                    Command::Send { to, msg } if to == self.me => queue.push_back((to, msg)),
                    Command::Send { to, msg } => self.send_remote(to, &msg),
                }
            }
        }
        self.publish_rounds();
    }

    fn send(&mut self, to: UniqueAddress, msg: ControlMsg) {
        if to == self.me {
            self.handle(to, msg);
        } else {
            self.send_remote(to, &msg);
        }
    }

    fn send_remote(&self, to: UniqueAddress, msg: &ControlMsg) {
        let payload = Bytes::from(msg.encode());
        if let Err(error) = self.node.transport().send(&to, SHARDING_CONTROL, payload) {
            tracing::debug!(%to, reason = %error.reason, "sharding control message not sent");
        }
    }

    fn execute(&mut self, commands: Vec<Command>) {
        for command in commands {
            match command {
                Command::Send { to, msg } => self.send(to, msg),
            }
        }
        self.publish_rounds();
    }

    /// This node's view of the sharding coordinator.
    fn coordinator_status(&self) -> CoordinatorStatus {
        let mut status = CoordinatorStatus {
            acting: self.side.coordinator(),
            epoch: self.core.highest_epoch(),
            allocating: None,
            registered: self.side.coordinator().is_some_and(|c| {
                self.regions()
                    .iter()
                    .all(|region| region.accepted_by() == Some(c))
            }),
        };
        if let Some((epoch, allocating)) = self.core.activity(Instant::now()) {
            status.acting = Some(self.me);
            status.epoch = epoch;
            status.allocating = Some(allocating);
        }
        status
    }

    fn publish_rounds(&mut self) {
        let closed = self.core.take_closed();
        if !closed.is_empty() {
            let node = self.me.addr.to_string();
            let now = Instant::now();
            for (reason, moves, at) in closed {
                let reason = reason_label(reason);
                let seconds = now.saturating_duration_since(at).as_secs_f64();
                crate::telemetry::rebalance_round(&node, reason, moves, seconds);
            }
        }
        let rounds = self.core.rounds();
        let mut published = lock(&self.rounds);
        if published.len() != rounds.len() || published.last() != rounds.last() {
            *published = rounds.to_vec();
        }
    }
}

/// This node's regions, as the region side reads and moves them.
struct Hosted(Vec<Arc<Region>>);

impl Hosted {
    fn get(&self, type_name: &str) -> Option<&Arc<Region>> {
        self.0.iter().find(|r| r.type_name == type_name)
    }

    /// The region of `type_name`, if `shard` is one of its shards.
    fn with_shard(&self, type_name: &str, shard: u32) -> Option<&Arc<Region>> {
        self.get(type_name).filter(|r| shard < r.num_shards())
    }
}

impl LocalRegions for Hosted {
    fn registrations(&self, leaving: bool) -> Vec<TypeRegistration> {
        self.0
            .iter()
            .map(|r| TypeRegistration {
                type_name: r.type_name.to_owned(),
                fingerprint: r.fingerprint,
                num_shards: r.num_shards(),
                proxy: r.is_proxy(),
                leaving,
                homes: r
                    .replica()
                    .into_iter()
                    .map(|(shard, home)| (shard, home.owner, home.generation))
                    .collect(),
                stopped: r.stopped_shards(),
            })
            .collect()
    }

    fn type_names(&self) -> Vec<String> {
        self.0.iter().map(|r| r.type_name.to_owned()).collect()
    }

    fn generation_of(&self, type_name: &str, shard: u32) -> u64 {
        self.get(type_name)
            .map_or(0, |r| r.generation_of(ShardId(shard)))
    }

    fn is_handed_off(&self, type_name: &str, shard: u32, generation: u64) -> bool {
        self.get(type_name)
            .is_some_and(|r| r.is_handed_off(ShardId(shard), generation))
    }

    fn set_home(
        &self,
        type_name: &str,
        shard: u32,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> Option<(&'static str, HomeChange)> {
        let region = self.with_shard(type_name, shard)?;
        Some((
            region.type_name,
            region.set_home(ShardId(shard), home, from),
        ))
    }

    fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.0.iter().map(|r| r.node_lost(node)).sum()
    }

    fn call_off_handoffs(&self) {
        for region in &self.0 {
            region.call_off_handoffs();
        }
    }

    fn hand_off(&self, type_name: &str, shard: u32, generation: u64) {
        if let Some(region) = self.with_shard(type_name, shard) {
            region.hand_off(ShardId(shard), generation);
        }
    }

    fn mark_left(&self, type_name: &str, nowhere: bool) {
        if let Some(region) = self.get(type_name) {
            region.mark_left(nowhere);
        }
    }

    fn accepted(&self, type_name: &str, by: UniqueAddress) {
        if let Some(region) = self.get(type_name) {
            region.accepted(by);
        }
    }

    fn refused(
        &self,
        type_name: &str,
        reason: String,
        cluster_fingerprint: Option<u64>,
        cluster_num_shards: Option<u32>,
    ) {
        if let Some(region) = self.get(type_name) {
            region.refuse(ShardingError::RegionRefused(Box::new(RegionRefusal {
                type_name: region.type_name,
                fingerprint: region.fingerprint,
                num_shards: region.num_shards(),
                cluster_fingerprint,
                cluster_num_shards,
                reason,
            })));
        }
    }
}

/// A rebalance round's reason as the metrics label it (SPEC §14).
fn reason_label(reason: RebalanceReason) -> &'static str {
    match reason {
        RebalanceReason::DeadOwner => "dead_owner",
        RebalanceReason::GracefulSpread => "graceful_spread",
        RebalanceReason::GracefulLeave => "graceful_leave",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reasons registered at 0 when a node starts are the labels its
    /// rounds are counted under, so no zero series sits beside a real one.
    #[test]
    fn the_reasons_registered_at_start_are_those_rounds_count_under() {
        let all = [
            RebalanceReason::DeadOwner,
            RebalanceReason::GracefulSpread,
            RebalanceReason::GracefulLeave,
        ];
        assert_eq!(all.map(reason_label), crate::telemetry::REBALANCE_REASONS);
    }
}
