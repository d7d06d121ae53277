//! One entity type's routing table: a slot per shard.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use ractor::{ActorCell, ActorRef, MessagingErr, RactorErr};

use crate::config::{EntityLimit, PassivationPolicy};
use crate::entity::{EntityContext, MigratedState, MigrationEvent};
use crate::envelope::{LocalEnvelope, RemoteReply, Undecodable};
use crate::error::{ShardingError, ShardingResult};
use crate::extractor::ShardId;
use crate::identity::UniqueAddress;
use crate::runtime::entity_actor::MigrationEvents;
use crate::runtime::mailbox::{EntityMsg, RegionMsg, States};
use crate::runtime::slot::{HomeChange, Refused, ShardHome, Slot, SlotHost, Undelivered};
use crate::store::RememberEntitiesOperation;
use crate::store::writer::Remember;
use crate::telemetry::RegionMetrics;

/// Spawns one entity actor (type-erased over the entity type): its context,
/// its incarnation number, the region actor to notify, and the state it
/// starts from if one migrated with its shard.
pub(crate) type Spawner = Box<
    dyn Fn(
            EntityContext,
            u64,
            ActorRef<RegionMsg>,
            Option<MigratedState>,
        ) -> Result<ActorRef<EntityMsg>, ShardingError>
        + Send
        + Sync,
>;

/// A boxed future, as a [`ClusterPort`] returns one.
pub(crate) type PortFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// Decodes one message of the region's protocol that came from another node.
pub(crate) type DecodeFn =
    fn(u16, &[u8], Option<RemoteReply>, u8) -> Result<LocalEnvelope, Box<Undecodable>>;

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
}

/// The largest migrated states chunk a pull is answered with (a state
/// larger than it travels alone).
pub(crate) const MIGRATION_CHUNK: usize = 256 * 1024;

/// What a handoff took from one shard's entities, kept for the node the
/// shard moved to until it has fetched them (or for the migration
/// timeout).
struct Outgoing {
    home: ShardHome,
    /// The states, cut into chunks of about [`MIGRATION_CHUNK`] (at least
    /// one, maybe empty).
    chunks: Vec<States>,
}

/// The answer to a pull for one chunk of a shard's migrated states.
#[derive(Debug)]
pub(crate) enum ChunkAnswer {
    /// Chunk `index` of them; `last`: nothing follows.
    Chunk { states: States, last: bool },
    /// The shard has not moved on from here yet (this node has not applied
    /// its new home): ask again.
    NotYet,
    /// None here for that node and allocation.
    Nothing(&'static str),
}

/// The migration settings of a region of a migratable type.
pub(crate) struct MigrationSettings {
    /// How long a new owner waits for the states, and an old one keeps
    /// them for it.
    pub(crate) timeout: Duration,
    /// The largest state that can travel (a frame's payload, less room
    /// for its chunk's framing): a larger one is dropped.
    pub(crate) max_state: usize,
    pub(crate) events: MigrationEvents,
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

/// The most bytes of ids one [`Region::state_with_ids`] answer holds in
/// all (its shards take from it in ascending order; those past it list
/// none and are marked cut): ids have no length limit.
pub(crate) const IDS_BYTES_IN_ALL: usize = 8 << 20;

pub(crate) struct Region {
    pub(crate) type_name: &'static str,
    pub(crate) protocol: std::any::TypeId,
    /// The protocol's fingerprint, checked against every remote envelope.
    pub(crate) fingerprint: u64,
    /// The protocol's decoder for remote envelopes.
    pub(crate) decode: DecodeFn,
    /// The protocol's extractor, to check the shard a remote envelope names.
    pub(crate) extract: ExtractFn,
    cluster: Option<RegionCluster>,
    buffer_cap: usize,
    slots: Box<[Mutex<EntitySlot>]>,
    spawner: Spawner,
    pub(crate) region_actor: OnceLock<ActorRef<RegionMsg>>,
    stopped: AtomicBool,
    /// Leaving, the coordinator said nothing more of this type will move off
    /// this node; and whether that is because there is nowhere to move it.
    left: AtomicBool,
    nowhere: AtomicBool,
    /// Counts the hostings of shards here (a respawn batch names the
    /// hosting it belongs to).
    installs: std::sync::atomic::AtomicU64,
    remember: Option<Arc<Remember>>,
    shutdown_timeout: Duration,
    /// The coordinator refused this region (`ShardingError::RegionRefused`):
    /// every message fails with it until a coordinator accepts the region.
    refused: AtomicBool,
    refusal: Mutex<Option<ShardingError>>,
    /// The coordinator whose table last came for this region.
    accepted_by: Mutex<Option<crate::identity::UniqueAddress>>,
    /// Tracing across nodes (SPEC §14.2), if on.
    tracing: Option<crate::telemetry::Tracing>,
    /// The active-entity limit (none for a remembered type).
    entity_limit: Option<EntityLimit>,
    /// The shards hosted here (installed and not moved away), over which
    /// the limit is shared: a new share visits them alone. Kept by
    /// [`Region::count_hosted`] only.
    hosted_shards: Mutex<std::collections::BTreeSet<u32>>,
    /// Their number, read by every start without the lock.
    hosted: AtomicUsize,
    /// Passivations of live entities so far, by cause.
    passivated: [AtomicU64; 3],
    /// Of a migratable type on a cluster: its settings.
    migration: Option<MigrationSettings>,
    /// States kept for the nodes shards moved to, by shard.
    outgoing: Mutex<std::collections::HashMap<u32, Outgoing>>,
    /// Its handles for the `metrics` facade.
    pub(crate) metrics: RegionMetrics,
    /// Its entities keep their state in a store (event-sourced or durable
    /// state): asks carry their deadline to the store calls (SPEC §8b).
    durable: bool,
}

/// Why a live entity was passivated (an index into `Region::passivated`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PassivationCause {
    /// Its idle timeout ran out.
    Idle = 0,
    /// Its shard was at its share of the active-entity limit.
    Limit = 1,
    /// Asked: `ctx.passivate()`, `EntityRef::passivate`, or an incarnation
    /// retiring itself (a failed recovery, a refused write).
    Explicit = 2,
}

/// Passivations of a region's live entities so far, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Passivations {
    /// The idle timeout ran out (`passivation_idle_timeout`).
    pub idle: u64,
    /// The shard was at its share of the active-entity limit (§6.1).
    pub limit: u64,
    /// Asked: `ctx.passivate()`, `EntityRef::passivate`, or an incarnation
    /// retiring itself after a failed recovery or a refused write.
    pub explicit: u64,
}

/// Where one shard lives, as this node's region knows it
/// ([`ShardRegionState::placements`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardPlacement {
    /// The node hosting the shard; `None` when it is this node.
    pub owner: Option<crate::identity::UniqueAddress>,
    /// The allocation generation the home came with (0 on a single node).
    pub generation: u64,
}

/// One region's state on this node, as
/// [`ShardedSystem::shard_region_state`](crate::ShardedSystem::shard_region_state)
/// reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardRegionState {
    /// The entity type.
    pub type_name: &'static str,
    /// Every shard hosted here, with its number of live entities
    /// (passivating ones not counted).
    pub shards: std::collections::BTreeMap<ShardId, usize>,
    /// The hosted shards being handed off to another node.
    pub handing_off: std::collections::BTreeSet<ShardId>,
    /// Of a remembered type: the hosted shards with remembered ids still
    /// to respawn (at the respawn rate). Empty once a restart's, or a
    /// move's, respawn has finished.
    pub respawning: std::collections::BTreeSet<ShardId>,
    /// Of a remembered type under `FailClosed`: the shards whose store
    /// failed; their messages fail with `ShardingError::RememberEntities`.
    pub failed: std::collections::BTreeSet<ShardId>,
    /// Messages waiting in this region's buffers: for shards without a home
    /// yet, behind passivating entities, and in handoff buffers.
    pub buffered: usize,
    /// The region routes only (proxy-only, or its type's role is not this
    /// node's).
    pub proxy: bool,
    /// The coordinator refused this region (another fingerprint or shard
    /// count than the type's in the cluster): the error every message to
    /// the type through this node fails with (`ShardingError::RegionRefused`).
    pub refused: Option<crate::ShardingError>,
    /// The active-entity limit (`ShardingConfig::entity_limit`), if the
    /// type has one; the live entities are the sum of `shards`.
    pub entity_limit: Option<usize>,
    /// Passivations of live entities so far, by cause.
    pub passivations: Passivations,
    /// Every shard this region knows a home for — hosted here or on
    /// another node — with its generation. A shard not listed has no home
    /// known here yet (no message has asked for it).
    pub placements: std::collections::BTreeMap<ShardId, ShardPlacement>,
    /// Of [`ShardedSystem::shard_region_state_with_ids`](crate::ShardedSystem::shard_region_state_with_ids)
    /// only (empty otherwise): every hosted shard with the ids of its live
    /// entities, ascending, at most the limit asked (the least ids). Read
    /// under the same lock as the shard's count in `shards`, so a list
    /// not cut has that many ids.
    pub entity_ids: std::collections::BTreeMap<ShardId, Vec<String>>,
    /// The hosted shards whose list in `entity_ids` was cut: they have
    /// more live entities than it names.
    pub entity_ids_truncated: std::collections::BTreeSet<ShardId>,
}

/// What a region needs to know of its protocol.
pub(crate) struct RegionProtocol {
    pub(crate) type_name: &'static str,
    pub(crate) id: std::any::TypeId,
    pub(crate) fingerprint: u64,
    pub(crate) decode: DecodeFn,
    pub(crate) extract: ExtractFn,
}

/// The protocol's shard extractor: entity id and shard count to shard.
pub(crate) type ExtractFn = fn(&str, u32) -> ShardId;

/// A slot of this runtime: entities and shards are ractor actors.
type EntitySlot = Slot<ActorRef<EntityMsg>>;

/// Locks a slot. No code panics while holding it, so a poisoned lock (a
/// panic elsewhere in the thread) still guards consistent data.
fn lock(slot: &Mutex<EntitySlot>) -> MutexGuard<'_, EntitySlot> {
    slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Region {
    pub(crate) fn new(
        protocol: RegionProtocol,
        num_shards: u32,
        buffer_cap: usize,
        spawner: Spawner,
        remember: Option<Arc<Remember>>,
        shutdown_timeout: Duration,
        cluster: Option<RegionCluster>,
    ) -> Self {
        let slots = (0..num_shards)
            .map(|_| Mutex::new(Slot::unallocated(0)))
            .collect();
        let node = cluster
            .as_ref()
            .map_or_else(|| "local".to_owned(), |c| c.me.addr.to_string());
        Region {
            type_name: protocol.type_name,
            protocol: protocol.id,
            fingerprint: protocol.fingerprint,
            decode: protocol.decode,
            extract: protocol.extract,
            cluster,
            buffer_cap,
            slots,
            spawner,
            region_actor: OnceLock::new(),
            stopped: AtomicBool::new(false),
            left: AtomicBool::new(false),
            nowhere: AtomicBool::new(false),
            installs: std::sync::atomic::AtomicU64::new(1),
            remember,
            shutdown_timeout,
            refused: AtomicBool::new(false),
            refusal: Mutex::new(None),
            accepted_by: Mutex::new(None),
            tracing: None,
            entity_limit: None,
            hosted: AtomicUsize::new(0),
            hosted_shards: Mutex::new(std::collections::BTreeSet::new()),
            passivated: Default::default(),
            migration: None,
            outgoing: Mutex::new(std::collections::HashMap::new()),
            metrics: RegionMetrics::new(protocol.type_name, node),
            durable: false,
        }
    }

    /// The region of a migratable type (`None`: not migratable).
    pub(crate) fn with_migration(self, migration: Option<MigrationSettings>) -> Self {
        Region { migration, ..self }
    }

    /// Marks a durable type's region (see `durable`).
    pub(crate) fn with_durable(mut self, durable: bool) -> Self {
        self.durable = durable;
        self
    }

    /// Its entities keep their state in a store.
    pub(crate) fn durable(&self) -> bool {
        self.durable
    }

    /// Tracing across nodes, when the system's configuration has it.
    pub(crate) fn with_tracing(self, tracing: Option<crate::telemetry::Tracing>) -> Self {
        Region { tracing, ..self }
    }

    /// The system's tracing, if on.
    pub(crate) fn tracing(&self) -> Option<&crate::telemetry::Tracing> {
        self.tracing.as_ref()
    }

    /// Whether `shard` is hosted here under `generation` or a later one.
    pub(crate) fn hosts(&self, shard: ShardId, generation: u64) -> bool {
        self.slots.get(shard.0 as usize).is_some_and(|slot| {
            let slot = lock(slot);
            slot.is_local() && slot.generation() >= generation
        })
    }

    /// The region's way to the cluster, on a cluster.
    pub(crate) fn port(&self) -> Option<&Arc<dyn ClusterPort>> {
        self.cluster.as_ref().map(|c| &c.port)
    }

    /// How long a new owner waits for migrated states, if the type migrates.
    pub(crate) fn migration_timeout(&self) -> Option<Duration> {
        self.migration.as_ref().map(|m| m.timeout)
    }

    fn outgoing(&self) -> MutexGuard<'_, std::collections::HashMap<u32, Outgoing>> {
        self.outgoing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps the states `shard`'s entities handed over for its new `home`,
    /// in chunks, until it fetches them or the migration timeout ends.
    fn keep_outgoing(&self, shard: ShardId, home: ShardHome, states: States) {
        let Some(settings) = &self.migration else {
            return;
        };
        let mut chunks: Vec<States> = vec![Vec::new()];
        let mut size = 0;
        let chunk = MIGRATION_CHUNK.min(settings.max_state);
        for (id, state) in states {
            // (Each entry's CBOR framing is a few bytes more.)
            let len = state.bytes.len() + id.len() + 16;
            if len > settings.max_state {
                tracing::warn!(type_name = self.type_name, %shard, entity_id = %id, len, max = settings.max_state, "a state too large to migrate is dropped; the entity starts from its factory");
                continue;
            }
            if size > 0 && size + len > chunk {
                chunks.push(Vec::new());
                size = 0;
            }
            size += len;
            chunks.last_mut().expect("one at least").push((id, state));
        }
        self.outgoing().insert(shard.0, Outgoing { home, chunks });
        if let Some(actor) = self.region_actor.get() {
            let generation = home.generation;
            actor.send_after(settings.timeout * 2, move || RegionMsg::ExpireMigration {
                shard,
                generation,
            });
        }
    }

    /// Chunk `index` of the states kept for `requester`, which hosts
    /// `shard` under `generation`.
    pub(crate) fn migration_chunk(
        &self,
        requester: &UniqueAddress,
        shard: ShardId,
        generation: u64,
        index: u32,
    ) -> ChunkAnswer {
        if self.migration.is_none() {
            return ChunkAnswer::Nothing("the type does not migrate on this node");
        }
        let Some(slot) = self.slots.get(shard.0 as usize) else {
            return ChunkAnswer::Nothing("no such shard");
        };
        // Under the shard's lock, which `set_home` keeps the states under:
        // a shard that has moved on has its states kept already.
        let slot = lock(slot);
        if slot.is_local() && slot.generation() < generation {
            // Still hosted here (its handoff finishing, or its new home not
            // applied yet): the states come once it has moved on.
            return ChunkAnswer::NotYet;
        }
        let outgoing = self.outgoing();
        match outgoing.get(&shard.0) {
            Some(o) if o.home.owner == *requester && o.home.generation == generation => {
                match o.chunks.get(index as usize) {
                    Some(states) => ChunkAnswer::Chunk {
                        states: states.clone(),
                        last: index as usize + 1 == o.chunks.len(),
                    },
                    None => ChunkAnswer::Nothing("no such chunk"),
                }
            }
            _ => ChunkAnswer::Nothing("no states kept for that node and allocation"),
        }
    }

    /// `requester` has fetched every chunk of `shard`'s states: they go.
    pub(crate) fn migration_done(
        &self,
        requester: &UniqueAddress,
        shard: ShardId,
        generation: u64,
    ) {
        let mut outgoing = self.outgoing();
        if outgoing
            .get(&shard.0)
            .is_some_and(|o| o.home.owner == *requester && o.home.generation == generation)
        {
            outgoing.remove(&shard.0);
        }
    }

    /// The states kept for `shard`'s allocation `generation` were not
    /// fetched in time: they go.
    pub(crate) fn expire_migration(&self, shard: ShardId, generation: u64) {
        let mut outgoing = self.outgoing();
        if outgoing
            .get(&shard.0)
            .is_some_and(|o| o.home.generation == generation)
        {
            outgoing.remove(&shard.0);
            tracing::warn!(type_name = self.type_name, %shard, generation, "migrated states not fetched in time are dropped");
        }
    }

    /// Whether states wait here for a node to fetch them: kept for it, or
    /// still in a handed-off shard whose new home this node has not
    /// applied yet.
    pub(crate) fn migrations_pending(&self) -> bool {
        self.migration.is_some()
            && (!self.outgoing().is_empty() || self.slots.iter().any(|s| lock(s).holds_states()))
    }

    /// Reports what became of a shard's migration here.
    pub(crate) fn migration_event(&self, event: MigrationEvent) {
        if let Some(settings) = &self.migration {
            let _ = settings.events.send(event);
        }
    }

    /// The region with an active-entity limit (`None`: none).
    pub(crate) fn with_entity_limit(self, entity_limit: Option<EntityLimit>) -> Self {
        Region {
            entity_limit,
            ..self
        }
    }

    /// Each hosted shard's share of the limit, with `hosted` shards.
    fn share_with(&self, hosted: usize) -> Option<(usize, PassivationPolicy)> {
        let limit = self.entity_limit?;
        Some(((limit.max_live / hosted.max(1)).max(1), limit.policy))
    }

    /// A shard was counted in: every hosted shard's share is now the
    /// smaller one for the current count, and each passivates what no
    /// longer fits. (A share that grows, when a shard moves away, is taken
    /// up by the next start.)
    fn reshare(&self) {
        let Some((share, _)) = self.share_with(self.hosted.load(Ordering::Acquire)) else {
            return;
        };
        let hosted: Vec<u32> = self.hosted_shards().iter().copied().collect();
        for i in hosted {
            lock(&self.slots[i as usize]).reshare(&mut self.host(), ShardId(i), share);
        }
    }

    fn hosted_shards(&self) -> MutexGuard<'_, std::collections::BTreeSet<u32>> {
        self.hosted_shards
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts `shard` in (`here`) or out of the shards hosted here: the
    /// set a new share visits, its size every start reads, and the
    /// `datum_sharding_shards` gauge, in step.
    fn count_hosted(&self, shard: ShardId, here: bool) {
        let mut hosted = self.hosted_shards();
        let changed = if here {
            hosted.insert(shard.0)
        } else {
            hosted.remove(&shard.0)
        };
        if changed {
            self.hosted.store(hosted.len(), Ordering::Release);
            self.metrics.shards(if here { 1 } else { -1 });
        }
    }

    /// The slot's host: this region's effects.
    fn host(&self) -> Host<'_> {
        Host {
            region: self,
            cause: PassivationCause::Explicit,
            ask: None,
        }
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
        *self.refusal.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.clone());
        self.refused.store(true, Ordering::Release);
        let mut undelivered = Vec::new();
        for slot in self.slots.iter() {
            let drained = lock(slot).drain_refused();
            undelivered.extend(drained.into_iter().map(|e| (error.clone(), e)));
        }
        fail_undelivered(undelivered);
    }

    /// The coordinator `by` accepted this region (sent it the type's table).
    pub(crate) fn accepted(&self, by: crate::identity::UniqueAddress) {
        self.refused.store(false, Ordering::Release);
        *self.refusal.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.accepted_by.lock().unwrap_or_else(|p| p.into_inner()) = Some(by);
    }

    /// The coordinator whose table last came for this region (`None`
    /// before any, and on a single node).
    pub(crate) fn accepted_by(&self) -> Option<crate::identity::UniqueAddress> {
        *self.accepted_by.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn num_shards(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Whether this region routes only (it registered proxy-only).
    pub(crate) fn is_proxy(&self) -> bool {
        self.cluster.as_ref().is_some_and(|c| c.proxy)
    }

    /// The remember-entities queue, for a remembered type.
    pub(crate) fn remember(&self) -> Option<&Arc<Remember>> {
        self.remember.as_ref()
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Routes one envelope to `entity_id` in `shard`. On error the envelope
    /// was not accepted; it is answered after the lock is released.
    pub(crate) fn deliver(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> ShardingResult<()> {
        if self.is_stopped() {
            envelope.fail(ShardingError::ShuttingDown);
            return Err(ShardingError::ShuttingDown);
        }
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let result = guard.deliver(&mut self.host(), shard, entity_id, envelope);
        drop(guard);
        result.map_err(answer)
    }

    /// [`deliver`](Self::deliver) of an ask made on this node whose
    /// envelope is guarded: true when it went to another node in this very
    /// call, its deadline with it — the pending-ask table then answers
    /// `AskTimeout` at `deadline`, and the asker needs no timer of its own.
    pub(crate) fn deliver_ask(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
        (deadline, timeout): (tokio::time::Instant, Duration),
    ) -> ShardingResult<bool> {
        if self.is_stopped() {
            envelope.fail(ShardingError::ShuttingDown);
            return Err(ShardingError::ShuttingDown);
        }
        let mut host = self.host();
        host.ask = Some(AskDelivery {
            deadline,
            timeout,
            forwarded: false,
        });
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let result = guard.deliver(&mut host, shard, entity_id, envelope);
        drop(guard);
        result.map_err(answer)?;
        Ok(host.ask.is_some_and(|ask| ask.forwarded))
    }

    /// [`deliver`](Self::deliver) for an entity id that is not yet an
    /// `Arc<str>` (a remote envelope's): the common case — a live entity of
    /// a hosted shard — allocates nothing; anything else goes the general way.
    pub(crate) fn deliver_str(
        &self,
        shard: ShardId,
        entity_id: &str,
        envelope: LocalEnvelope,
    ) -> ShardingResult<()> {
        let envelope = {
            let mut guard = lock(&self.slots[shard.0 as usize]);
            if !self.is_stopped() {
                match guard.deliver_live(&mut self.host(), shard, entity_id, envelope) {
                    Ok(result) => return result,
                    Err(envelope) => envelope,
                }
            } else if let Some(home) = guard.home(None) {
                // A stopped region (a node that left) still forwards what
                // peers send it for shards it knows elsewhere: a sender that
                // had not heard the new home yet loses nothing, tells
                // included.
                return self
                    .host()
                    .forward(home, shard, &Arc::from(entity_id), envelope)
                    .map_err(answer);
            } else {
                envelope
            }
        };
        self.deliver(shard, &Arc::from(entity_id), envelope)
    }

    /// Makes `shard` local under `generation`, starts respawning
    /// `remembered` (read from the store beforehand, off the lock) and
    /// replays its buffer in order. Returns false (and leaves the slot as
    /// it was) when a newer home came meanwhile, the shard is already local
    /// or the region stopped.
    pub(crate) fn install_local(
        &self,
        shard: ShardId,
        generation: u64,
        remembered: Option<Vec<String>>,
        migrated: States,
    ) -> bool {
        let install = self.installs.fetch_add(1, Ordering::Relaxed);
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let newly_local = !guard.is_local();
        // Counted in before it starts, so that its own share is right.
        if newly_local {
            self.count_hosted(shard, true);
        }
        let installed = guard.install(
            &mut self.host(),
            shard,
            generation,
            install,
            remembered,
            migrated,
        );
        if newly_local && installed.is_none() {
            self.count_hosted(shard, false);
        }
        drop(guard);
        match installed {
            Some(undelivered) => {
                fail_undelivered(undelivered);
                if newly_local {
                    self.reshare();
                }
                true
            }
            None => false,
        }
    }

    /// The remembered ids of `shard`, read from the store (never under a
    /// shard's lock: the region actor calls it before installing the shard).
    /// `None` for a type that is not remembered, or when the read failed
    /// (reported through the failure policy).
    pub(crate) fn remembered_ids(&self, shard: ShardId) -> Option<Vec<String>> {
        let remember = self.remember.as_ref()?;
        let listed = remember
            .store()
            .list_entities_for_shard(self.type_name, shard);
        remember.publish_repairs();
        match listed {
            Ok(ids) => Some(ids),
            Err(error) => {
                remember.failure(
                    self.type_name,
                    Some(shard),
                    None,
                    RememberEntitiesOperation::ListEntities,
                    &error.0,
                );
                None
            }
        }
    }

    /// The region actor's turn to respawn more remembered ids of `shard`,
    /// if it is still the same hosting of it.
    pub(crate) fn respawn_more(&self, shard: ShardId, install: u64) {
        lock(&self.slots[shard.0 as usize]).respawn_more(&mut self.host(), shard, install);
    }

    /// The shards that have remembered entities, read from the store (it
    /// may block: call it where blocking is allowed). A failed read is
    /// reported through the failure policy and lists none.
    pub(crate) fn remembered_shards(&self) -> Vec<ShardId> {
        let Some(remember) = &self.remember else {
            return Vec::new();
        };
        let listed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            remember.store().list_shards(self.type_name)
        }))
        .unwrap_or_else(|_| Err(crate::store::StoreError("the store panicked".into())));
        match listed {
            Ok(shards) => shards,
            Err(error) => {
                remember.failure(
                    self.type_name,
                    None,
                    None,
                    RememberEntitiesOperation::ListShards,
                    &error.0,
                );
                Vec::new()
            }
        }
    }

    /// Starts `shards` (those with remembered entities, at registration).
    pub(crate) fn start_shards(&self, shards: Vec<ShardId>) {
        for shard in shards.into_iter().filter(|s| s.0 < self.num_shards()) {
            lock(&self.slots[shard.0 as usize]).request_if_idle(&mut self.host(), shard);
        }
    }

    /// Passivates `entity_id` — only `incarnation` if one is named (a request
    /// from the entity itself), else whichever is current. While the entity's
    /// messages still wait in a buffer (shard not yet allocated, or entity
    /// already passivating), the request is buffered behind them.
    pub(crate) fn passivate(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
    ) -> ShardingResult<()> {
        self.passivate_from(shard, entity_id, incarnation, false)
    }

    /// An entity incarnation's own request: idle, or asked (its
    /// `ctx.passivate()`, or it retired itself).
    pub(crate) fn passivate_incarnation(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        idle: bool,
    ) -> ShardingResult<()> {
        let mut host = self.host();
        if idle {
            host.cause = PassivationCause::Idle;
        }
        self.passivate_by(host, shard, entity_id, Some(incarnation), false)
    }

    /// [`passivate`](Self::passivate); a request `from_remote` (another node
    /// sent it here) is not sent on again when the shard is not hosted here,
    /// so two disagreeing tables cannot bounce it between them.
    pub(crate) fn passivate_from(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        from_remote: bool,
    ) -> ShardingResult<()> {
        self.passivate_by(self.host(), shard, entity_id, incarnation, from_remote)
    }

    /// The slot's passivation, counted under `host`'s cause.
    fn passivate_by(
        &self,
        mut host: Host<'_>,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        from_remote: bool,
    ) -> ShardingResult<()> {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let (result, undelivered) =
            guard.passivate(&mut host, shard, entity_id, incarnation, from_remote);
        drop(guard);
        fail_undelivered(undelivered);
        result
    }

    /// Incarnation `incarnation` of `entity_id` stopped (its stop notice, sent
    /// on every exit path): finish its passivation by replaying the messages
    /// buffered meanwhile, or forget a crashed incarnation.
    pub(crate) fn entity_stopped(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let undelivered =
            guard.entity_stopped(&mut self.host(), shard, entity_id, incarnation, state);
        drop(guard);
        // Every actor spawned sends one stop notice: one fewer live.
        self.metrics.entities(-1);
        fail_undelivered(undelivered);
    }

    /// The coordinator moves `shard`, hosted here under `generation` (see
    /// [`Slot::hand_off`]).
    pub(crate) fn hand_off(&self, shard: ShardId, generation: u64) {
        if let Some(slot) = self.slots.get(shard.0 as usize) {
            lock(slot).hand_off(&mut self.host(), shard, generation);
        }
    }

    /// Whether `shard` is hosted here under `generation`, handed off and
    /// empty: its `ShardStopped` still needs an answer.
    pub(crate) fn is_handed_off(&self, shard: ShardId, generation: u64) -> bool {
        self.slots
            .get(shard.0 as usize)
            .is_some_and(|slot| lock(slot).is_handed_off(generation))
    }

    /// Applies a home for `shard` from the coordinator (see
    /// [`Slot::set_home`]); the entities of a shard that moved away finish
    /// their mailboxes and stop, and `shutdown` waits for them. A shard
    /// whose home is now here is started by the region actor; `from`, the
    /// old owner that handed it off, has its entities' states for it. A
    /// shard handed off from here keeps its entities' states for its new
    /// home to fetch.
    pub(crate) fn set_home(
        &self,
        shard: ShardId,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> HomeChange {
        let Some(cluster) = &self.cluster else {
            return HomeChange::Unchanged;
        };
        let from = from.filter(|f| *f != cluster.me);
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let was_local = guard.is_local();
        if let Some(from) = from
            && was_local
            && home.owner == cluster.me
            && home.generation >= guard.generation()
        {
            // Hosted here already, yet the coordinator says the shard comes
            // from `from`: either it started here from a word without
            // `from` (a Table, a GetHome answer) before this one, or this
            // node missed a move, and the states it kept are older than
            // `from`'s. Neither is pulled: its entities start from the
            // factory (and this says so).
            let dropped = guard.drop_states();
            let reason = if dropped > 0 {
                format!("this node missed a move: {dropped} older states kept here dropped")
            } else {
                "the shard started here before its states were asked for".to_owned()
            };
            tracing::warn!(type_name = self.type_name, %shard, %from, %reason, "migrated states not fetched");
            self.migration_event(MigrationEvent::FellBack {
                type_name: self.type_name,
                shard,
                from: Some(from),
                reason,
            });
        }
        let (change, undelivered) =
            guard.set_home(&mut self.host(), shard, home, cluster.me, cluster.proxy);
        let moved_away = was_local && !guard.is_local();
        // Kept under the shard's lock: a pull sees the shard either still
        // here or moved on with its states kept.
        if let Some((home, states)) = guard.take_outgoing() {
            self.keep_outgoing(shard, home, states);
        }
        drop(guard);
        if moved_away {
            self.count_hosted(shard, false);
        }
        fail_undelivered(undelivered);
        if change == HomeChange::HostHere
            && let Some(actor) = self.region_actor.get()
        {
            // The region actor starts hosting the shard (messages wait in
            // the slot meanwhile).
            let _ = actor.cast(RegionMsg::Host {
                shard,
                generation: home.generation,
                from,
            });
        }
        change
    }

    /// The highest allocation generation this region has seen for `shard`.
    pub(crate) fn generation_of(&self, shard: ShardId) -> u64 {
        match self.slots.get(shard.0 as usize) {
            Some(slot) => {
                let slot = lock(slot);
                if slot.is_stopped() {
                    0
                } else {
                    slot.generation()
                }
            }
            None => 0,
        }
    }

    /// `node` is gone (downed, exited, removed): shards routed to it wait
    /// for a new home; the next message for one asks the coordinator.
    /// Returns how many shards this region still routed to it.
    pub(crate) fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.slots
            .iter()
            .filter(|slot| lock(slot).node_lost(node))
            .count()
    }

    /// The hosted shards whose handoff has stopped every entity: they host
    /// nothing any more and wait for their next home. A registration names
    /// them, so that no coordinator takes this node for their home again
    /// from a claim (SPEC §13.3).
    pub(crate) fn stopped_shards(&self) -> Vec<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| lock(slot).is_stopped_here())
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// Every home this region knows (its replica of the table).
    pub(crate) fn replica(&self) -> Vec<(u32, ShardHome)> {
        let me = self.cluster.as_ref().map(|c| c.me);
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| lock(slot).home(me).map(|home| (i as u32, home)))
            .collect()
    }

    /// How many shards of this region are hosted here.
    pub(crate) fn hosted_count(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| lock(slot).is_local())
            .count()
    }

    /// Sets the buffered-message gauges from the slots' buffers now
    /// (each slot locked in turn; its entities counted).
    pub(crate) fn sample_buffers(&self) {
        let (mut buffered, mut handoff) = (0, 0);
        for slot in self.slots.iter() {
            let summary = lock(slot).summary();
            buffered += summary.buffered;
            handoff += summary.handoff_buffered;
        }
        self.metrics.buffered.set(buffered as f64);
        self.metrics.handoff_buffered.set(handoff as f64);
    }

    /// This region's own state.
    pub(crate) fn state(&self) -> ShardRegionState {
        self.read_state(None)
    }

    /// This region's own state with the ids of its live entities: at most
    /// `per_shard` of each hosted shard, and at most `in_all` over the
    /// shards, taken in ascending order (a shard past `in_all` lists none,
    /// and is marked cut if it has live entities).
    pub(crate) fn state_with_ids(&self, per_shard: usize, in_all: usize) -> ShardRegionState {
        self.read_state(Some((per_shard, in_all)))
    }

    /// Reads every slot under its own lock in turn (never two at once, so
    /// a message path waits at most for one shard's summary), with its
    /// ids when `ids` gives the limits.
    fn read_state(&self, ids: Option<(usize, usize)>) -> ShardRegionState {
        let mut shards = std::collections::BTreeMap::new();
        let mut entity_ids = std::collections::BTreeMap::new();
        let mut entity_ids_truncated = std::collections::BTreeSet::new();
        let mut ids_left = ids.map_or(0, |(_, in_all)| in_all);
        let mut ids_bytes_left = IDS_BYTES_IN_ALL;
        let mut handing_off = std::collections::BTreeSet::new();
        let mut respawning = std::collections::BTreeSet::new();
        let mut failed = std::collections::BTreeSet::new();
        let mut buffered = 0;
        let mut placements = std::collections::BTreeMap::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let shard = ShardId(i as u32);
            let guard = lock(slot);
            let summary = guard.summary();
            let listed =
                ids.and_then(|(per_shard, _)| guard.least_live_ids(per_shard.min(ids_left)));
            drop(guard);
            // The text is copied and sorted with the lock released.
            if let Some((listed, more)) = listed {
                let mut listed: Vec<String> = listed.iter().map(|id| id.to_string()).collect();
                listed.sort_unstable();
                // Ids have no length limit: the answer has a byte budget
                // as well; once it is spent, no later shard lists any.
                let mut fit = 0;
                for id in &listed {
                    if id.len() > ids_bytes_left {
                        break;
                    }
                    ids_bytes_left -= id.len();
                    fit += 1;
                }
                let spent = fit < listed.len();
                listed.truncate(fit);
                ids_left = if spent { 0 } else { ids_left - listed.len() };
                if more || spent {
                    entity_ids_truncated.insert(shard);
                }
                entity_ids.insert(shard, listed);
            }
            buffered += summary.buffered;
            if let Some((owner, generation)) = summary.home {
                placements.insert(shard, ShardPlacement { owner, generation });
            }
            if summary.handing_off {
                handing_off.insert(shard);
            }
            if summary.respawning {
                respawning.insert(shard);
            }
            if let Some(remember) = &self.remember
                && remember.check(self.type_name, shard).is_err()
            {
                failed.insert(shard);
            }
            if let Some(live) = summary.hosted {
                shards.insert(shard, live);
            }
        }
        ShardRegionState {
            type_name: self.type_name,
            shards,
            handing_off,
            respawning,
            failed,
            buffered,
            proxy: self.is_proxy(),
            refused: self.refusal(),
            entity_limit: self.entity_limit.map(|l| l.max_live),
            passivations: Passivations {
                idle: self.passivated[PassivationCause::Idle as usize].load(Ordering::Relaxed),
                limit: self.passivated[PassivationCause::Limit as usize].load(Ordering::Relaxed),
                explicit: self.passivated[PassivationCause::Explicit as usize]
                    .load(Ordering::Relaxed),
            },
            placements,
            entity_ids,
            entity_ids_truncated,
        }
    }

    /// The coordinator said nothing more of this type will move off this
    /// node (see [`leave_done`](Self::leave_done)).
    pub(crate) fn mark_left(&self, nowhere: bool) {
        self.nowhere.store(nowhere, Ordering::Release);
        self.left.store(true, Ordering::Release);
    }

    /// In a graceful leave: whether this region is done — the coordinator
    /// said there is nowhere to move its shards, or it said `Left` and this
    /// node hosts no shard any more (it has applied the new homes; one that
    /// was lost, because the new home died meanwhile, is followed by
    /// another, which the leave waits for).
    pub(crate) fn leave_done(&self) -> bool {
        self.nowhere.load(Ordering::Acquire)
            || (self.left.load(Ordering::Acquire) && self.hosted_count() == 0)
    }

    /// A new coordinator: handoffs it did not ask for, and that have not
    /// reported their shard stopped yet, are called off (the shard stays
    /// here and what waited is delivered here; a leaving node asks the new
    /// coordinator again). Reported ones go on: their report is repeated.
    pub(crate) fn call_off_handoffs(&self) {
        for (i, slot) in self.slots.iter().enumerate() {
            let mut guard = lock(slot);
            let undelivered = guard.call_off_handoff(&mut self.host(), ShardId(i as u32));
            drop(guard);
            fail_undelivered(undelivered);
        }
    }

    /// Number of live (not passivating) entities in `shard`.
    pub(crate) fn live_entities(&self, shard: ShardId) -> usize {
        lock(&self.slots[shard.0 as usize]).live_entities()
    }

    /// Refuses new messages from now on (`ShuttingDown`), before the
    /// actors are stopped by [`shutdown`](Self::shutdown).
    pub(crate) fn stop_accepting(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// stops all entity actors, then the region actor (killing those that
    /// do not stop within the shutdown timeout).
    pub(crate) async fn shutdown(&self) {
        let (cells, finishing) = self.take_actors();
        let timeout = self.shutdown_timeout;
        let finish = finishing.into_iter().map(|c| finish_or_kill(c, timeout));
        let stop = cells.into_iter().map(|c| stop_or_kill(c, timeout));
        futures_util::future::join(
            futures_util::future::join_all(finish),
            futures_util::future::join_all(stop),
        )
        .await;
        if let Some(actor) = self.region_actor.get() {
            stop_or_kill(actor.get_cell(), timeout).await;
        }
        // Nothing is hosted or live here any more (stop notices that the
        // region actor no longer heard are not counted down).
        self.metrics.release();
    }

    /// What `shutdown` does, at once and without waiting: every actor is
    /// killed (no mailbox is finished). For a system dropped without
    /// `shutdown`, which stops like a crash.
    pub(crate) fn kill(&self) {
        self.metrics.release();
        let (cells, finishing) = self.take_actors();
        for cell in cells.into_iter().chain(finishing) {
            cell.kill();
        }
        if let Some(actor) = self.region_actor.get() {
            actor.get_cell().kill();
        }
    }

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// takes the entity actors out of the slots (remote homes are kept:
    /// envelopes that still arrive are forwarded), and apart from them the
    /// entities finishing after their shard moved away.
    fn take_actors(&self) -> (Vec<ActorCell>, Vec<ActorCell>) {
        self.stopped.store(true, Ordering::Release);
        let mut cells = Vec::new();
        let mut finishing = Vec::new();
        let mut undelivered = Vec::new();
        for slot in self.slots.iter() {
            let taken = lock(slot).take();
            cells.extend(taken.entities.iter().map(|actor| actor.get_cell()));
            finishing.extend(taken.finishing.iter().map(|actor| actor.get_cell()));
            undelivered.extend(
                taken
                    .buffered
                    .into_iter()
                    .map(|envelope| (ShardingError::ShuttingDown, envelope)),
            );
        }
        fail_undelivered(undelivered);
        (cells, finishing)
    }

    /// Asks for `shard`'s allocation: the sharding driver on a cluster, the
    /// region actor on one node. False if it cannot be asked.
    fn request_allocation(&self, shard: ShardId) -> bool {
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

/// A region as its slots' host: their effects on actors, the store, the
/// pipes and the driver.
struct Host<'a> {
    region: &'a Region,
    /// Whose request a passivation it makes answers.
    cause: PassivationCause,
    /// In an asker's own delivery: its ask's deadline (and timeout), and
    /// whether its guarded envelope was forwarded with them.
    ask: Option<AskDelivery>,
}

/// What [`Region::deliver_ask`] tells the host, and learns back.
struct AskDelivery {
    deadline: tokio::time::Instant,
    timeout: Duration,
    forwarded: bool,
}

impl SlotHost for Host<'_> {
    type Entity = ActorRef<EntityMsg>;

    fn entity_share(&self) -> Option<(usize, PassivationPolicy)> {
        self.region
            .share_with(self.region.hosted.load(Ordering::Acquire))
    }

    fn passivated(&mut self, _shard: ShardId, by_limit: bool) {
        let cause = if by_limit {
            PassivationCause::Limit
        } else {
            self.cause
        };
        self.region.passivated[cause as usize].fetch_add(1, Ordering::Relaxed);
        self.region.metrics.passivations[cause as usize].increment(1);
    }

    fn type_name(&self) -> &'static str {
        self.region.type_name
    }

    fn buffer_cap(&self) -> usize {
        self.region.buffer_cap
    }

    fn refused(&self) -> bool {
        self.region.refused.load(Ordering::Acquire)
    }

    fn refusal(&self) -> Option<ShardingError> {
        self.region.refusal()
    }

    fn remembers(&self) -> bool {
        self.region.remember.is_some()
    }

    fn check_store(&self, shard: ShardId) -> ShardingResult<()> {
        match &self.region.remember {
            Some(remember) => remember.check(self.region.type_name, shard),
            None => Ok(()),
        }
    }

    fn spawn(
        &mut self,
        shard: ShardId,
        generation: u64,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> ShardingResult<ActorRef<EntityMsg>> {
        let Some(region_actor) = self.region.region_actor.get() else {
            return Err(ShardingError::Bug(
                "an entity spawned before its region actor started".into(),
            ));
        };
        let me = self.region.cluster.as_ref().map(|c| c.me);
        let mut ctx = EntityContext::new(self.region.type_name, entity_id.clone(), shard, me);
        ctx.generation = generation;
        // (No ask's deadline bounds its recovery: the recovery serves
        // every message that waits for it.)
        let spawned = (self.region.spawner)(ctx, incarnation, region_actor.clone(), state);
        if spawned.is_ok() {
            self.region.metrics.entities(1);
        }
        spawned
    }

    #[inline]
    fn send(
        &mut self,
        entity: &ActorRef<EntityMsg>,
        envelope: LocalEnvelope,
    ) -> Result<(), Option<LocalEnvelope>> {
        send_to(entity, envelope)
    }

    fn stop(&mut self, entity: &ActorRef<EntityMsg>) -> bool {
        // Not ractor's `drain`: draining an actor whose `pre_start` has not
        // run yet makes ractor refuse to start it, losing its mailbox.
        entity.send_message(EntityMsg::Stop).is_ok()
    }

    fn stop_to_move(&mut self, entity: &ActorRef<EntityMsg>) -> bool {
        let msg = if self.region.migration.is_some() {
            EntityMsg::StopToMove
        } else {
            EntityMsg::Stop
        };
        entity.send_message(msg).is_ok()
    }

    fn record(&mut self, shard: ShardId, entity_id: &Arc<str>, op: RememberEntitiesOperation) {
        if let Some(remember) = &self.region.remember {
            remember.record(self.region.type_name, shard, entity_id, op);
        }
    }

    fn respawn_batch(&self) -> usize {
        self.region
            .remember
            .as_ref()
            .map_or(0, |remember| remember.respawn_rate().0)
    }

    fn respawn_later(&mut self, shard: ShardId, install: u64) {
        if let (Some(remember), Some(actor)) =
            (&self.region.remember, self.region.region_actor.get())
        {
            let interval = remember.respawn_rate().1;
            actor.send_after(interval, move || RegionMsg::Respawn { shard, install });
        }
    }

    fn forward(
        &mut self,
        home: ShardHome,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), Refused> {
        let Some(cluster) = &self.region.cluster else {
            return Err((
                ShardingError::Bug("a remote shard on a system without a cluster".into()),
                Some(envelope),
            ));
        };
        // The asker's own guarded envelope: its deadline goes with it into
        // the pending-ask table, which then answers a timeout.
        let deadline = match &self.ask {
            Some(ask) if envelope.is_guarded() => Some((ask.deadline, ask.timeout)),
            _ => None,
        };
        let kept = cluster
            .port
            .forward(home, self.region, shard, entity_id, envelope, deadline)
            .map_err(|error| (error, None))?;
        // Only the table's own word lets the asker go without a timer.
        if let (Some(ask), true) = (&mut self.ask, kept) {
            ask.forwarded = true;
        }
        Ok(())
    }

    fn passivate_at(
        &mut self,
        owner: UniqueAddress,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<()> {
        match &self.region.cluster {
            Some(cluster) => cluster
                .port
                .passivate(owner, self.region.type_name, shard, entity_id),
            None => Ok(()),
        }
    }

    fn request_allocation(&mut self, shard: ShardId) -> bool {
        self.region.request_allocation(shard)
    }

    fn shard_stopped(&mut self, shard: ShardId, generation: u64) {
        if let Some(cluster) = &self.region.cluster {
            cluster
                .port
                .shard_stopped(self.region.type_name, shard, generation);
        }
    }
}

/// Answers a refused delivery's sender, if the envelope came back.
fn answer((error, envelope): Refused) -> ShardingError {
    if let Some(envelope) = envelope {
        envelope.fail(error.clone());
    }
    error
}

/// Enqueues into an entity's mailbox. `Err(Some)` gives the envelope back
/// (the entity is gone); `Err(None)` means ractor dropped it, which a
/// correctly typed `ActorRef` never does (its asker then sees `EntityStopped`).
fn send_to(
    actor: &ActorRef<EntityMsg>,
    envelope: LocalEnvelope,
) -> Result<(), Option<LocalEnvelope>> {
    match actor.send_message(EntityMsg::Deliver(envelope)) {
        Ok(()) => Ok(()),
        Err(MessagingErr::SendErr(EntityMsg::Deliver(envelope))) => Err(Some(envelope)),
        Err(_) => Err(None),
    }
}

/// Answers the senders of undelivered messages (outside any shard lock, so a
/// message's `Drop` never runs under it).
fn fail_undelivered(undelivered: Undelivered) {
    for (error, envelope) in undelivered {
        envelope.fail(error);
    }
}

/// Waits up to `timeout` for an entity that is finishing its mailbox (its
/// stop marker is queued behind it), then kills it.
async fn finish_or_kill(cell: ActorCell, timeout: Duration) {
    if cell.wait(Some(timeout)).await.is_err() {
        tracing::warn!(actor = %cell.get_id(), ?timeout, "entity did not finish its mailbox in time; killing it");
        let _ = cell.kill_and_wait(Some(timeout)).await;
    }
}

/// Stops an actor after the message in hand; if that takes longer than
/// `timeout` (a handler that never returns), kills it, which abandons the
/// handler and drops its mailbox: the senders waiting there see the system
/// shutting down.
async fn stop_or_kill(cell: ActorCell, timeout: Duration) {
    if let Err(RactorErr::Timeout) = cell
        .stop_and_wait(Some("shutdown".into()), Some(timeout))
        .await
    {
        tracing::warn!(actor = %cell.get_id(), ?timeout, "actor did not stop in time; killing it");
        let _ = cell.kill_and_wait(Some(timeout)).await;
    }
}
