//! One entity type's routing table: a slot per shard.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use ractor::{ActorCell, ActorRef, ActorStatus, MessagingErr, RactorErr};

use crate::entity::EntityContext;
use crate::envelope::{LocalEnvelope, RemoteReply, Undecodable};
use crate::error::{ShardingError, ShardingResult};
use crate::extractor::ShardId;
use crate::identity::UniqueAddress;
use crate::runtime::entity_actor::EntityMsg;
use crate::runtime::region_actor::RegionMsg;
use crate::runtime::shard_actor::ShardMsg;
use crate::sharding::coordinator::ShardHome;
use crate::sharding::driver::DriverMsg;
use crate::sharding::remote::Remote;
use crate::store::RememberEntitiesOperation;
use crate::store::writer::Remember;

/// Spawns one entity actor (type-erased over the entity type): its context,
/// its incarnation number, and the shard actor to notify.
pub(crate) type Spawner = Box<
    dyn Fn(EntityContext, u64, ActorRef<ShardMsg>) -> Result<ActorRef<EntityMsg>, ShardingError>
        + Send
        + Sync,
>;

/// Something waiting in a buffer: a message, or a passivation request that
/// must take effect after the messages buffered before it.
pub(crate) enum Buffered {
    Message(Arc<str>, LocalEnvelope),
    Passivate(Arc<str>),
}

/// Decodes one message of the region's protocol that came from another node.
pub(crate) type DecodeFn =
    fn(u16, &[u8], Option<RemoteReply>, u8) -> Result<LocalEnvelope, Box<Undecodable>>;

/// A region's link to the cluster, when its system runs on one.
pub(crate) struct RegionCluster {
    /// This node.
    pub(crate) me: UniqueAddress,
    /// Sends to other nodes and tracks their replies.
    pub(crate) remote: Arc<Remote>,
    /// The sharding driver: allocation requests go there.
    pub(crate) driver: tokio::sync::mpsc::UnboundedSender<DriverMsg>,
    /// A proxy-only region: it routes and never hosts a shard.
    pub(crate) proxy: bool,
}

/// One shard's state in its region.
pub(crate) enum Slot {
    /// No home yet: messages wait here until the shard is allocated.
    Unallocated {
        buffer: Vec<Buffered>,
        requested: bool,
        /// The highest allocation generation seen for the shard.
        generation: u64,
    },
    /// Hosted on this node.
    Local(LocalShard),
    /// Hosted on another node: messages are encoded and sent there.
    Remote(ShardHome),
    /// The system shut down.
    Stopped,
}

impl Slot {
    fn unallocated(generation: u64) -> Self {
        Slot::Unallocated {
            buffer: Vec::new(),
            requested: false,
            generation,
        }
    }

    fn generation(&self) -> u64 {
        match self {
            Slot::Unallocated { generation, .. } => *generation,
            Slot::Local(local) => local.generation,
            Slot::Remote(home) => home.generation,
            Slot::Stopped => u64::MAX,
        }
    }
}

/// What applying a shard's home did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HomeChange {
    /// Nothing to do: known already.
    Unchanged,
    /// Older than what the region holds: ignored.
    Stale,
    /// Now routed to another node.
    Remote,
    /// This node is the new home: the region actor must start the shard
    /// (messages buffer meanwhile).
    HostHere,
}

pub(crate) struct LocalShard {
    shard: ActorRef<ShardMsg>,
    /// The allocation generation this node hosts the shard under (0 on a
    /// single node).
    generation: u64,
    entities: HashMap<Arc<str>, Entry>,
    /// Numbers the incarnations of this shard's entities; a stop notice or
    /// passivation request names the incarnation it is about.
    last_incarnation: u64,
    /// Tells this hosting of the shard from a later one (respawn batches
    /// belong to the hosting that listed them).
    install: u64,
    /// Remembered ids listed at start and not respawned yet; an id leaves
    /// it when a message spawns it or it is passivated.
    pending_respawn: std::collections::HashSet<Arc<str>>,
    /// Set while the shard is handed off to another node.
    handoff: Option<HandingOff>,
}

/// A hosted shard being handed off: its entities stop (each after its
/// mailbox), and what arrives for the shard meanwhile waits here, in
/// order, for its next home.
struct HandingOff {
    buffer: Vec<Buffered>,
    /// `ShardStopped` was sent for the current stop (entities all gone).
    reported: bool,
    /// Of a remembered type: the ids that were live or waiting to be
    /// respawned when the handoff began (the store still lists them), to be
    /// respawned here should the shard stay.
    respawn: std::collections::HashSet<Arc<str>>,
}

/// One incarnation of an entity.
struct Live {
    actor: ActorRef<EntityMsg>,
    incarnation: u64,
}

enum Entry {
    /// Messages go straight to its mailbox.
    Live(Live),
    /// Stopping after what its mailbox holds; later messages wait here.
    Passivating { live: Live, buffer: Vec<Buffered> },
}

/// How far ahead of a slot's generation an envelope's may be and still be
/// believed (allocations are one generation each; a real lead is small).
const MAX_GENERATION_LEAD: u64 = 1 << 20;

/// Messages that could not be delivered, to be failed once the lock is released.
type Undelivered = Vec<(ShardingError, LocalEnvelope)>;

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
    slots: Box<[Mutex<Slot>]>,
    spawner: Spawner,
    pub(crate) region_actor: OnceLock<ActorRef<RegionMsg>>,
    stopped: AtomicBool,
    /// Leaving, the coordinator said nothing more of this type will move off
    /// this node; and whether that is because there is nowhere to move it.
    left: AtomicBool,
    nowhere: AtomicBool,
    /// Counts the hostings of shards here (see `LocalShard::install`).
    installs: std::sync::atomic::AtomicU64,
    /// Entities of shards that moved away without a handoff (a home
    /// elsewhere from the coordinator), finishing their mailboxes:
    /// `shutdown` waits for them too.
    finishing: Mutex<Vec<ActorCell>>,
    remember: Option<Arc<Remember>>,
    shutdown_timeout: Duration,
    /// The coordinator refused this region (`ShardingError::RegionRefused`):
    /// every message fails with it until a coordinator accepts the region.
    refused: AtomicBool,
    refusal: Mutex<Option<ShardingError>>,
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

/// Locks a slot. No code panics while holding it, so a poisoned lock (a
/// panic elsewhere in the thread) still guards consistent data.
fn lock(slot: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
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
            finishing: Mutex::new(Vec::new()),
            remember,
            shutdown_timeout,
            refused: AtomicBool::new(false),
            refusal: Mutex::new(None),
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
            let mut guard = lock(slot);
            if let Slot::Unallocated {
                buffer, requested, ..
            } = &mut *guard
            {
                *requested = false;
                for buffered in buffer.drain(..) {
                    if let Buffered::Message(_, envelope) = buffered {
                        undelivered.push((error.clone(), envelope));
                    }
                }
            }
        }
        fail_undelivered(undelivered);
    }

    /// A coordinator accepted this region (sent it the type's table).
    pub(crate) fn accepted(&self) {
        self.refused.store(false, Ordering::Release);
        *self.refusal.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    pub(crate) fn num_shards(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Whether this region routes only (it registered proxy-only).
    pub(crate) fn is_proxy(&self) -> bool {
        self.cluster.as_ref().is_some_and(|c| c.proxy)
    }

    /// The remember-entities queue, for a remembered type.
    pub(crate) fn remember_queue(&self) -> Option<Arc<Remember>> {
        self.remember.clone()
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    fn overflow(&self, shard: ShardId) -> ShardingError {
        ShardingError::BufferOverflow {
            type_name: self.type_name,
            shard_id: shard,
        }
    }

    /// Routes one envelope to `entity_id` in `shard`. On error the envelope
    /// was not accepted; it is dropped after the lock is released.
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
        let result = match &mut *guard {
            Slot::Local(local) => self.deliver_local(local, shard, entity_id, envelope),
            // (A generation absurdly far ahead is a sender's bug, not news:
            // it is forwarded as usual rather than stall the shard.)
            // Refused by the coordinator: no home will come for what would
            // wait for one (checked under the slot's lock, which `refuse`
            // drains each buffer under, so nothing slips in behind it).
            Slot::Unallocated { .. } | Slot::Remote(_) if self.refused.load(Ordering::Acquire) => {
                Err((
                    self.refusal().unwrap_or_else(|| self.overflow(shard)),
                    Some(envelope),
                ))
            }
            Slot::Remote(home)
                if envelope.routed_under() > home.generation
                    && envelope.routed_under() - home.generation <= MAX_GENERATION_LEAD =>
            {
                // The sender knows a newer allocation than this node (the
                // coordinator's word on it is on its way here): wait for it
                // rather than forward along an older table. An older home
                // arriving meanwhile is then ignored as stale.
                let generation = envelope.routed_under();
                let requested = self.request_allocation(shard);
                *guard = Slot::Unallocated {
                    buffer: vec![Buffered::Message(entity_id.clone(), envelope)],
                    requested,
                    generation,
                };
                Ok(())
            }
            Slot::Remote(home) => self.forward(*home, shard, entity_id, envelope),
            Slot::Unallocated {
                buffer, requested, ..
            } => {
                if buffer.len() >= self.buffer_cap {
                    Err((self.overflow(shard), Some(envelope)))
                } else {
                    buffer.push(Buffered::Message(entity_id.clone(), envelope));
                    if !*requested {
                        *requested = self.request_allocation(shard);
                    }
                    Ok(())
                }
            }
            Slot::Stopped => Err((ShardingError::ShuttingDown, Some(envelope))),
        };
        drop(guard);
        result.map_err(|(error, envelope)| {
            if let Some(envelope) = envelope {
                envelope.fail(error.clone());
            }
            error
        })
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
            let guard = lock(&self.slots[shard.0 as usize]);
            match &*guard {
                // (A stopped region, or a shard failed under FailClosed,
                // takes the general way, which refuses the message.)
                Slot::Local(local)
                    if !self.is_stopped()
                        && self
                            .remember
                            .as_ref()
                            .is_none_or(|r| r.check(self.type_name, shard).is_ok()) =>
                {
                    match local.entities.get(entity_id) {
                        Some(Entry::Live(live)) => match send_to(&live.actor, envelope) {
                            Ok(()) => return Ok(()),
                            Err(Some(envelope)) => envelope,
                            Err(None) => return Err(refused()),
                        },
                        _ => envelope,
                    }
                }
                // A stopped region (a node that left) still forwards what
                // peers send it for shards it knows elsewhere: a sender that
                // had not heard the new home yet loses nothing, tells
                // included.
                Slot::Remote(home) if self.is_stopped() => {
                    let home = *home;
                    return self
                        .forward(home, shard, &Arc::from(entity_id), envelope)
                        .map_err(|(error, envelope)| {
                            if let Some(envelope) = envelope {
                                envelope.fail(error.clone());
                            }
                            error
                        });
                }
                _ => envelope,
            }
        };
        self.deliver(shard, &Arc::from(entity_id), envelope)
    }

    /// Sends an envelope to the node hosting its shard. On error the
    /// envelope has been answered already.
    fn forward(
        &self,
        home: ShardHome,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), (ShardingError, Option<LocalEnvelope>)> {
        let Some(cluster) = &self.cluster else {
            return Err((
                ShardingError::Bug("a remote shard on a system without a cluster".into()),
                Some(envelope),
            ));
        };
        cluster
            .remote
            .forward(home, self, shard, entity_id, envelope)
            .map_err(|error| (error, None))
    }

    /// Routing within a hosted shard, under its lock: enqueue to the live
    /// entity (the common case), buffer behind a passivation, or spawn the
    /// entity (replacing a dead incarnation) and enqueue.
    fn deliver_local(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), (ShardingError, Option<LocalEnvelope>)> {
        if let Some(remember) = &self.remember
            && let Err(error) = remember.check(self.type_name, shard)
        {
            return Err((error, Some(envelope)));
        }
        if let Some(handoff) = &mut local.handoff {
            if handoff.buffer.len() >= self.buffer_cap {
                return Err((self.overflow(shard), Some(envelope)));
            }
            handoff
                .buffer
                .push(Buffered::Message(entity_id.clone(), envelope));
            return Ok(());
        }
        let envelope = match local.entities.get_mut(entity_id) {
            Some(Entry::Live(live)) => match send_to(&live.actor, envelope) {
                Ok(()) => return Ok(()),
                // The actor is gone without its stop notice handled yet: replace it.
                Err(Some(envelope)) => envelope,
                Err(None) => return Err((refused(), None)),
            },
            Some(Entry::Passivating { buffer, .. }) => {
                if buffer.len() >= self.buffer_cap {
                    return Err((self.overflow(shard), Some(envelope)));
                }
                buffer.push(Buffered::Message(entity_id.clone(), envelope));
                return Ok(());
            }
            None => envelope,
        };
        let actor = match self.spawn_entity(local, shard, entity_id) {
            Ok(actor) => actor,
            Err(error) => return Err((error, Some(envelope))),
        };
        send_to(&actor, envelope).map_err(|envelope| {
            let stopped = ShardingError::EntityStopped {
                type_name: self.type_name,
                entity_id: entity_id.to_string(),
            };
            (stopped, envelope)
        })
    }

    fn spawn_entity(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<ActorRef<EntityMsg>> {
        self.spawn_entity_recording(local, shard, entity_id, true)
    }

    /// Spawns an incarnation; `record` queues its start for the store (a
    /// respawned id is there already).
    fn spawn_entity_recording(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
        record: bool,
    ) -> ShardingResult<ActorRef<EntityMsg>> {
        local.pending_respawn.remove(entity_id);
        local.last_incarnation += 1;
        let incarnation = local.last_incarnation;
        let me = self.cluster.as_ref().map(|c| c.me);
        let ctx = EntityContext::new(self.type_name, entity_id.clone(), shard, me);
        let actor = (self.spawner)(ctx, incarnation, local.shard.clone())?;
        local.entities.insert(
            entity_id.clone(),
            Entry::Live(Live {
                actor: actor.clone(),
                incarnation,
            }),
        );
        if record && let Some(remember) = &self.remember {
            remember.record(
                self.type_name,
                shard,
                entity_id,
                RememberEntitiesOperation::RecordStarted,
            );
        }
        Ok(actor)
    }

    /// Asks the region actor to allocate `shard`; false if it cannot be asked
    /// (then the next message asks again).
    fn request_allocation(&self, shard: ShardId) -> bool {
        if let Some(cluster) = &self.cluster {
            return cluster
                .driver
                .send(DriverMsg::Allocate {
                    type_name: self.type_name,
                    shard,
                })
                .is_ok();
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

    /// Makes `shard` local with the given shard actor, starts respawning
    /// `remembered` (read from the store beforehand, off the lock) and
    /// replays its buffer in order. Returns false (and leaves the
    /// slot as it was) when the shard is already local or the region stopped;
    /// the caller then stops `shard_actor`.
    pub(crate) fn install_local(
        &self,
        shard: ShardId,
        shard_actor: ActorRef<ShardMsg>,
        generation: u64,
        remembered: Option<Vec<String>>,
    ) -> bool {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        if guard.generation() > generation {
            // A newer home arrived while the shard actor started.
            return false;
        }
        let buffer = match &mut *guard {
            Slot::Unallocated { buffer, .. } => std::mem::take(buffer),
            Slot::Remote(_) => Vec::new(),
            Slot::Local(_) | Slot::Stopped => return false,
        };
        let mut local = LocalShard {
            shard: shard_actor,
            generation,
            entities: HashMap::new(),
            last_incarnation: 0,
            install: self.installs.fetch_add(1, Ordering::Relaxed),
            pending_respawn: Default::default(),
            handoff: None,
        };
        if let Some(ids) = remembered {
            local.pending_respawn = ids.into_iter().map(Arc::<str>::from).collect();
            self.respawn_batch(&mut local, shard);
        }
        let undelivered = self.replay(&mut local, shard, buffer);
        *guard = Slot::Local(local);
        drop(guard);
        fail_undelivered(undelivered);
        true
    }

    /// The remembered ids of `shard`, read from the store (never under a
    /// shard's lock: the region actor calls it before installing the shard).
    /// `None` for a type that is not remembered, or when the read failed
    /// (reported through the failure policy).
    pub(crate) fn remembered_ids(&self, shard: ShardId) -> Option<Vec<String>> {
        let remember = self.remember.as_ref()?;
        match remember
            .store()
            .list_entities_for_shard(self.type_name, shard)
        {
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

    /// Respawns up to `respawn_batch` of the shard's pending remembered ids,
    /// and has the region actor come back for the rest after
    /// `respawn_interval` (Akka's constant-rate recovery), so a shard with
    /// very many remembered ids does not stampede. A message for an id not
    /// respawned yet spawns it at once (and takes it off the pending set),
    /// as any message does.
    fn respawn_batch(&self, local: &mut LocalShard, shard: ShardId) {
        let Some(remember) = &self.remember else {
            return;
        };
        let (batch, interval) = remember.respawn_rate();
        // (An id whose previous incarnation is still stopping waits for the
        // next batch.)
        let ids: Vec<Arc<str>> = local
            .pending_respawn
            .iter()
            .filter(|id| !local.entities.contains_key(*id))
            .take(batch)
            .cloned()
            .collect();
        for id in ids {
            local.pending_respawn.remove(&id);
            if !local.entities.contains_key(&id)
                && let Err(error) = self.spawn_entity_recording(local, shard, &id, false)
            {
                tracing::warn!(type_name = self.type_name, %shard, %error, "remember-entities: respawn failed");
            }
        }
        if !local.pending_respawn.is_empty()
            && let Some(actor) = self.region_actor.get()
        {
            let install = local.install;
            actor.send_after(interval, move || RegionMsg::Respawn { shard, install });
        }
    }

    /// The region actor's turn to respawn more remembered ids of `shard`,
    /// if it is still the same hosting of it.
    pub(crate) fn respawn_more(&self, shard: ShardId, install: u64) {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        if let Slot::Local(local) = &mut *guard
            && local.install == install
        {
            self.respawn_batch(local, shard);
        }
    }

    /// Starts shards that have remembered entities (used at registration).
    pub(crate) fn start_remembered_shards(&self) {
        let Some(remember) = &self.remember else {
            return;
        };
        match remember.store().list_shards(self.type_name) {
            Ok(shards) => {
                for shard in shards.into_iter().filter(|s| s.0 < self.num_shards()) {
                    if let Slot::Unallocated { requested, .. } =
                        &mut *lock(&self.slots[shard.0 as usize])
                        && !*requested
                    {
                        *requested = self.request_allocation(shard);
                    }
                }
            }
            Err(error) => remember.failure(
                self.type_name,
                None,
                None,
                RememberEntitiesOperation::ListShards,
                &error.0,
            ),
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
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let (result, undelivered) = match &mut *guard {
            Slot::Unallocated { buffer, .. } => {
                let waiting = buffer
                    .iter()
                    .any(|b| matches!(b, Buffered::Message(id, _) if id == entity_id));
                let result = if !waiting {
                    Ok(())
                } else if buffer.len() >= self.buffer_cap {
                    Err(self.overflow(shard))
                } else {
                    buffer.push(Buffered::Passivate(entity_id.clone()));
                    Ok(())
                };
                (result, Vec::new())
            }
            Slot::Local(local) => self.passivate_in(local, shard, entity_id, incarnation),
            Slot::Remote(_) if from_remote => (Ok(()), Vec::new()),
            Slot::Remote(home) => {
                // A request from an entity's own incarnation is always local.
                let result = match (&self.cluster, incarnation) {
                    (Some(cluster), None) => {
                        cluster
                            .remote
                            .passivate(home.owner, self.type_name, shard, entity_id)
                    }
                    _ => Ok(()),
                };
                (result, Vec::new())
            }
            Slot::Stopped => (Err(ShardingError::ShuttingDown), Vec::new()),
        };
        drop(guard);
        fail_undelivered(undelivered);
        result
    }

    fn passivate_in(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
    ) -> (ShardingResult<()>, Undelivered) {
        if let Some(handoff) = &mut local.handoff {
            // Every entity is stopping already; a remembered one is now
            // forgotten, so that no next home respawns it (not for a stale
            // request of an earlier incarnation). A request from outside
            // still applies to the messages waiting for that home.
            let current = match local.entities.get(entity_id) {
                Some(Entry::Live(live) | Entry::Passivating { live, .. }) => Some(live.incarnation),
                None => None,
            };
            let stale = incarnation.is_some_and(|i| current.is_some_and(|c| c != i));
            if !stale
                && handoff.respawn.remove(entity_id)
                && let Some(remember) = &self.remember
            {
                remember.record(
                    self.type_name,
                    shard,
                    entity_id,
                    RememberEntitiesOperation::RecordStopped,
                );
            }
            let waiting = handoff
                .buffer
                .iter()
                .any(|b| matches!(b, Buffered::Message(id, _) if id == entity_id));
            if incarnation.is_some() || !waiting {
                return (Ok(()), Vec::new());
            }
            if handoff.buffer.len() >= self.buffer_cap {
                return (Err(self.overflow(shard)), Vec::new());
            }
            handoff.buffer.push(Buffered::Passivate(entity_id.clone()));
            return (Ok(()), Vec::new());
        }
        let live = match local.entities.remove(entity_id) {
            Some(Entry::Live(live)) if incarnation.is_none_or(|i| i == live.incarnation) => live,
            Some(Entry::Passivating { live, mut buffer }) => {
                // Only an explicit request, for the incarnation that comes next.
                let mut result = Ok(());
                if incarnation.is_none() && !buffer.is_empty() {
                    if buffer.len() >= self.buffer_cap {
                        result = Err(self.overflow(shard));
                    } else {
                        buffer.push(Buffered::Passivate(entity_id.clone()));
                    }
                }
                local
                    .entities
                    .insert(entity_id.clone(), Entry::Passivating { live, buffer });
                return (result, Vec::new());
            }
            // A request from an earlier incarnation: stale.
            Some(other) => {
                local.entities.insert(entity_id.clone(), other);
                return (Ok(()), Vec::new());
            }
            None => return (Ok(()), Vec::new()),
        };
        if let Some(remember) = &self.remember {
            remember.record(
                self.type_name,
                shard,
                entity_id,
                RememberEntitiesOperation::RecordStopped,
            );
        }
        // Stop after what is queued. Not ractor's `drain`: draining an actor
        // whose `pre_start` has not run yet makes ractor refuse to start it,
        // losing its mailbox. Nothing can be enqueued behind this marker: the
        // entity is no longer Live, and all sends happen under this lock.
        let stop_sent = live.actor.send_message(EntityMsg::Stop).is_ok();
        let stopped = live.incarnation;
        local.entities.insert(
            entity_id.clone(),
            Entry::Passivating {
                live,
                buffer: Vec::new(),
            },
        );
        if stop_sent {
            (Ok(()), Vec::new())
        } else {
            // Already gone: finish the passivation now.
            (Ok(()), self.stopped_in(local, shard, entity_id, stopped))
        }
    }

    /// Incarnation `incarnation` of `entity_id` stopped (its stop notice, sent
    /// on every exit path): finish its passivation by replaying the messages
    /// buffered meanwhile, or forget a crashed incarnation.
    pub(crate) fn entity_stopped(&self, shard: ShardId, entity_id: &Arc<str>, incarnation: u64) {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let undelivered = match &mut *guard {
            Slot::Local(local) => self.stopped_in(local, shard, entity_id, incarnation),
            _ => Vec::new(),
        };
        drop(guard);
        fail_undelivered(undelivered);
    }

    fn stopped_in(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
    ) -> Undelivered {
        let current = match local.entities.get(entity_id) {
            Some(Entry::Live(live) | Entry::Passivating { live, .. }) => live.incarnation,
            None => return Vec::new(),
        };
        if current != incarnation {
            return Vec::new();
        }
        let undelivered = match local.entities.remove(entity_id) {
            Some(Entry::Passivating { buffer, .. }) => self.replay(local, shard, buffer),
            _ => Vec::new(),
        };
        self.report_if_stopped(local, shard);
        undelivered
    }

    /// Tells the driver a handed-off shard has no entity left (once per
    /// stop; the driver repeats it to the coordinator until a new home comes).
    fn report_if_stopped(&self, local: &mut LocalShard, shard: ShardId) {
        let Some(handoff) = &mut local.handoff else {
            return;
        };
        if handoff.reported || !local.entities.is_empty() {
            return;
        }
        handoff.reported = true;
        if let Some(cluster) = &self.cluster {
            let _ = cluster.driver.send(DriverMsg::ShardStopped {
                type_name: self.type_name,
                shard,
                generation: local.generation,
            });
        }
    }

    /// The coordinator moves `shard`, hosted here under `generation`:
    /// every entity stops after what its mailbox holds (its remembered
    /// state stays, for the next home to respawn), and what arrives
    /// meanwhile is buffered. When the last entity has stopped the driver
    /// hears `ShardStopped`. A request for another generation, or for a
    /// shard not hosted here yet (it is starting), is ignored; the
    /// coordinator asks again.
    pub(crate) fn hand_off(&self, shard: ShardId, generation: u64) {
        let Some(slot) = self.slots.get(shard.0 as usize) else {
            return;
        };
        let mut guard = lock(slot);
        let Slot::Local(local) = &mut *guard else {
            return;
        };
        if local.generation != generation {
            return;
        }
        match &mut local.handoff {
            Some(handoff) => {
                // Asked again: the report may have been lost.
                handoff.reported = false;
            }
            None => {
                let mut buffer = Vec::new();
                let mut respawn = std::mem::take(&mut local.pending_respawn);
                for (id, entry) in local.entities.iter_mut() {
                    match entry {
                        Entry::Live(live) => {
                            // Under the lock: nothing can be enqueued behind
                            // the stop marker, as for a passivation; from now
                            // on the handoff buffer takes what comes.
                            let live = Live {
                                actor: live.actor.clone(),
                                incarnation: live.incarnation,
                            };
                            if live.actor.send_message(EntityMsg::Stop).is_err() {
                                tracing::debug!(type_name = self.type_name, %shard, "entity gone before its handoff stop");
                            }
                            respawn.insert(id.clone());
                            *entry = Entry::Passivating {
                                live,
                                buffer: Vec::new(),
                            };
                        }
                        // What waited behind a passivation comes first.
                        Entry::Passivating {
                            buffer: waiting, ..
                        } => buffer.append(waiting),
                    }
                }
                if self.remember.is_none() {
                    respawn.clear();
                }
                local.handoff = Some(HandingOff {
                    buffer,
                    reported: false,
                    respawn,
                });
            }
        }
        self.report_if_stopped(local, shard);
    }

    /// Whether `shard` is hosted here under `generation`, handed off and
    /// empty: its `ShardStopped` still needs an answer.
    pub(crate) fn is_handed_off(&self, shard: ShardId, generation: u64) -> bool {
        self.slots.get(shard.0 as usize).is_some_and(|slot| {
            matches!(&*lock(slot), Slot::Local(local)
                if local.generation == generation
                    && local.handoff.is_some()
                    && local.entities.is_empty())
        })
    }

    /// Replays buffered items in order into a hosted shard, returning the
    /// messages that could not be delivered.
    fn replay(&self, local: &mut LocalShard, shard: ShardId, buffer: Vec<Buffered>) -> Undelivered {
        let mut undelivered = Vec::new();
        for item in buffer {
            match item {
                Buffered::Message(entity_id, envelope) => {
                    if let Err((error, Some(envelope))) =
                        self.deliver_local(local, shard, &entity_id, envelope)
                    {
                        undelivered.push((error, envelope));
                    }
                }
                Buffered::Passivate(entity_id) => {
                    let (result, more) = self.passivate_in(local, shard, &entity_id, None);
                    if let Err(error) = result {
                        tracing::warn!(type_name = self.type_name, %shard, %error, "buffered passivation dropped");
                    }
                    undelivered.extend(more);
                }
            }
        }
        undelivered
    }

    /// Applies a home for `shard` from the coordinator. A home older than
    /// what the slot holds is ignored. Becoming remote sends the buffered
    /// messages on, in order, under the lock; a shard that was hosted here
    /// stops its entities (each finishes its mailbox) and routes on.
    pub(crate) fn set_home(&self, shard: ShardId, home: ShardHome) -> HomeChange {
        let Some(cluster) = &self.cluster else {
            return HomeChange::Unchanged;
        };
        let mut guard = lock(&self.slots[shard.0 as usize]);
        if matches!(*guard, Slot::Stopped) {
            return HomeChange::Unchanged;
        }
        if home.generation < guard.generation() {
            return HomeChange::Stale;
        }
        if home.owner == cluster.me && cluster.proxy {
            tracing::error!(type_name = self.type_name, %shard, "a proxy-only region was given a shard; ignored");
            return HomeChange::Unchanged;
        }
        if home.owner == cluster.me {
            let mut undelivered = Vec::new();
            let change = match &mut *guard {
                Slot::Local(local) => {
                    let moved_back = home.generation > local.generation;
                    local.generation = home.generation;
                    if moved_back {
                        // The shard was being handed off, and its new home
                        // is here after all.
                        undelivered = self.resume(local, shard);
                    }
                    HomeChange::Unchanged
                }
                Slot::Unallocated { generation, .. } => {
                    *generation = home.generation;
                    HomeChange::HostHere
                }
                Slot::Remote(_) => {
                    *guard = Slot::Unallocated {
                        buffer: Vec::new(),
                        requested: true,
                        generation: home.generation,
                    };
                    HomeChange::HostHere
                }
                Slot::Stopped => HomeChange::Unchanged,
            };
            drop(guard);
            fail_undelivered(undelivered);
            return change;
        }
        let previous = std::mem::replace(&mut *guard, Slot::Remote(home));
        let mut undelivered = Vec::new();
        let mut stopping = Stopping::default();
        let buffer = match previous {
            Slot::Unallocated { buffer, .. } => buffer,
            Slot::Local(mut local) => {
                let mut buffer = Vec::new();
                // What waited behind passivations came before what arrived
                // during a handoff (which took those buffers when it began).
                let handed_off = local.handoff.take().map(|h| h.buffer);
                for (_, entry) in local.entities {
                    match entry {
                        Entry::Live(live) => stopping.push(live.actor),
                        Entry::Passivating {
                            live,
                            buffer: waiting,
                        } => {
                            stopping.push(live.actor);
                            buffer.extend(waiting);
                        }
                    }
                }
                stopping.push_shard(local.shard);
                buffer.extend(handed_off.into_iter().flatten());
                buffer
            }
            Slot::Remote(_) | Slot::Stopped => Vec::new(),
        };
        for item in buffer {
            match item {
                Buffered::Message(entity_id, envelope) => {
                    if let Err((error, Some(envelope))) =
                        self.forward(home, shard, &entity_id, envelope)
                    {
                        undelivered.push((error, envelope));
                    }
                }
                Buffered::Passivate(entity_id) => {
                    let _ = cluster
                        .remote
                        .passivate(home.owner, self.type_name, shard, &entity_id);
                }
            }
        }
        // Noted under the slot's lock: a shutdown that takes this slot
        // after it finds them in the list.
        self.note_finishing(&stopping);
        drop(guard);
        stopping.stop_all();
        fail_undelivered(undelivered);
        HomeChange::Remote
    }

    /// Keeps the entities `stopping` will stop, for `shutdown` to wait for
    /// (those that have stopped already are dropped from the list).
    fn note_finishing(&self, stopping: &Stopping) {
        if stopping.entities.is_empty() {
            return;
        }
        let mut finishing = self.finishing_list();
        finishing.retain(|cell| !matches!(cell.get_status(), ActorStatus::Stopped));
        finishing.extend(stopping.entities.iter().map(|actor| actor.get_cell()));
    }

    /// Starting `shard` here failed: let its next message ask again.
    pub(crate) fn allocation_failed(&self, shard: ShardId) {
        if let Slot::Unallocated { requested, .. } = &mut *lock(&self.slots[shard.0 as usize]) {
            *requested = false;
        }
    }

    /// The highest allocation generation this region has seen for `shard`.
    pub(crate) fn generation_of(&self, shard: ShardId) -> u64 {
        match self.slots.get(shard.0 as usize) {
            Some(slot) => match &*lock(slot) {
                Slot::Stopped => 0,
                other => other.generation(),
            },
            None => 0,
        }
    }

    /// `node` is gone (downed, exited, removed): shards routed to it wait
    /// for a new home; the next message for one asks the coordinator.
    /// Returns how many shards this region still routed to it.
    pub(crate) fn node_lost(&self, node: &UniqueAddress) -> usize {
        let mut routed = 0;
        for slot in self.slots.iter() {
            let mut guard = lock(slot);
            if let Slot::Remote(home) = &*guard
                && home.owner == *node
            {
                *guard = Slot::unallocated(home.generation);
                routed += 1;
            }
        }
        routed
    }

    /// The hosted shards whose handoff has stopped every entity: they host
    /// nothing any more and wait for their next home. A registration names
    /// them, so that no coordinator takes this node for their home again
    /// from a claim (SPEC §13.3).
    pub(crate) fn stopped_shards(&self) -> Vec<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| {
                matches!(&*lock(slot), Slot::Local(local)
                    if local.handoff.is_some() && local.entities.is_empty())
            })
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// Every home this region knows (its replica of the table).
    pub(crate) fn replica(&self) -> Vec<(u32, ShardHome)> {
        let me = self.cluster.as_ref().map(|c| c.me);
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| match &*lock(slot) {
                Slot::Remote(home) => Some((i as u32, *home)),
                Slot::Local(local) => me.map(|owner| {
                    (
                        i as u32,
                        ShardHome {
                            owner,
                            generation: local.generation,
                        },
                    )
                }),
                _ => None,
            })
            .collect()
    }

    /// How many shards of this region are hosted here.
    pub(crate) fn hosted_count(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| matches!(&*lock(slot), Slot::Local(_)))
            .count()
    }

    /// This region's own state.
    pub(crate) fn state(&self) -> crate::sharding::ShardRegionState {
        let mut shards = std::collections::BTreeMap::new();
        let mut handing_off = std::collections::BTreeSet::new();
        let mut buffered = 0;
        for (i, slot) in self.slots.iter().enumerate() {
            let shard = ShardId(i as u32);
            match &*lock(slot) {
                Slot::Unallocated { buffer, .. } => buffered += buffer.len(),
                Slot::Local(local) => {
                    let mut live = 0;
                    for entry in local.entities.values() {
                        match entry {
                            Entry::Live(_) => live += 1,
                            Entry::Passivating { buffer, .. } => buffered += buffer.len(),
                        }
                    }
                    if let Some(handoff) = &local.handoff {
                        buffered += handoff.buffer.len();
                        handing_off.insert(shard);
                    }
                    shards.insert(shard, live);
                }
                Slot::Remote(_) | Slot::Stopped => {}
            }
        }
        crate::sharding::ShardRegionState {
            type_name: self.type_name,
            shards,
            handing_off,
            buffered,
            proxy: self.is_proxy(),
            refused: self.refusal(),
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
            let undelivered = match &mut *guard {
                Slot::Local(local) if local.handoff.as_ref().is_some_and(|h| !h.reported) => {
                    self.resume(local, ShardId(i as u32))
                }
                _ => Vec::new(),
            };
            drop(guard);
            fail_undelivered(undelivered);
        }
    }

    /// Ends a handoff with the shard staying here: the buffer is replayed
    /// in order, and remembered ids stopped by the handoff are respawned
    /// (at the respawn rate, once their incarnation has stopped).
    fn resume(&self, local: &mut LocalShard, shard: ShardId) -> Undelivered {
        let Some(handoff) = local.handoff.take() else {
            return Vec::new();
        };
        let undelivered = self.replay(local, shard, handoff.buffer);
        let respawn = handoff
            .respawn
            .into_iter()
            .filter(|id| !matches!(local.entities.get(id), Some(Entry::Live(_))));
        local.pending_respawn.extend(respawn);
        if !local.pending_respawn.is_empty() {
            self.respawn_batch(local, shard);
        }
        undelivered
    }

    /// Number of live (not passivating) entities in `shard`.
    pub(crate) fn live_entities(&self, shard: ShardId) -> usize {
        match &*lock(&self.slots[shard.0 as usize]) {
            Slot::Local(local) => local
                .entities
                .values()
                .filter(|e| matches!(e, Entry::Live(_)))
                .count(),
            _ => 0,
        }
    }

    /// Refuses new messages from now on (`ShuttingDown`), before the
    /// actors are stopped by [`shutdown`](Self::shutdown).
    pub(crate) fn stop_accepting(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// stops all entity and shard actors (killing those that do not stop
    /// within the shutdown timeout).
    pub(crate) async fn shutdown(&self) {
        let (cells, shard_cells, finishing) = self.take_actors();
        let timeout = self.shutdown_timeout;
        let finish = finishing.into_iter().map(|c| finish_or_kill(c, timeout));
        let stop = cells.into_iter().map(|c| stop_or_kill(c, timeout));
        futures_util::future::join(
            futures_util::future::join_all(finish),
            futures_util::future::join_all(stop),
        )
        .await;
        futures_util::future::join_all(shard_cells.into_iter().map(|c| stop_or_kill(c, timeout)))
            .await;
        if let Some(actor) = self.region_actor.get() {
            stop_or_kill(actor.get_cell(), timeout).await;
        }
    }

    /// What `shutdown` does, at once and without waiting: every actor is
    /// killed (no mailbox is finished). For a system dropped without
    /// `shutdown`, which stops like a crash.
    pub(crate) fn kill(&self) {
        let (cells, shard_cells, finishing) = self.take_actors();
        for cell in cells.into_iter().chain(shard_cells).chain(finishing) {
            cell.kill();
        }
        if let Some(actor) = self.region_actor.get() {
            actor.get_cell().kill();
        }
    }

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// takes the entity and shard actors out of the slots (remote homes are
    /// kept: envelopes that still arrive are forwarded), and the entities
    /// finishing after their shard moved away.
    fn take_actors(&self) -> (Vec<ActorCell>, Vec<ActorCell>, Vec<ActorCell>) {
        self.stopped.store(true, Ordering::Release);
        let mut cells = Vec::new();
        let mut undelivered = Vec::new();
        let mut buffered = |buffer: Vec<Buffered>| {
            for item in buffer {
                if let Buffered::Message(_, envelope) = item {
                    undelivered.push((ShardingError::ShuttingDown, envelope));
                }
            }
        };
        let mut shard_cells = Vec::new();
        for slot in self.slots.iter() {
            let mut guard = lock(slot);
            let previous = std::mem::replace(&mut *guard, Slot::Stopped);
            if let Slot::Remote(home) = previous {
                // Kept: remote envelopes that still arrive are forwarded.
                *guard = Slot::Remote(home);
                continue;
            }
            drop(guard);
            match previous {
                Slot::Unallocated { buffer, .. } => buffered(buffer),
                Slot::Local(mut local) => {
                    if let Some(handoff) = local.handoff.take() {
                        buffered(handoff.buffer);
                    }
                    for entry in local.entities.into_values() {
                        match entry {
                            Entry::Live(live) => cells.push(live.actor.get_cell()),
                            Entry::Passivating { live, buffer } => {
                                cells.push(live.actor.get_cell());
                                buffered(buffer);
                            }
                        }
                    }
                    shard_cells.push(local.shard.get_cell());
                }
                Slot::Remote(_) | Slot::Stopped => {}
            }
        }
        fail_undelivered(undelivered);
        let finishing = std::mem::take(&mut *self.finishing_list());
        (cells, shard_cells, finishing)
    }

    fn finishing_list(&self) -> MutexGuard<'_, Vec<ActorCell>> {
        self.finishing.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Actors to stop once a shard's lock is released.
#[derive(Default)]
struct Stopping {
    entities: Vec<ActorRef<EntityMsg>>,
    shards: Vec<ActorRef<ShardMsg>>,
}

impl Stopping {
    fn push(&mut self, actor: ActorRef<EntityMsg>) {
        self.entities.push(actor);
    }

    fn push_shard(&mut self, actor: ActorRef<ShardMsg>) {
        self.shards.push(actor);
    }

    /// Each entity stops after what its mailbox holds (the stop marker goes
    /// behind it); then the shard actor.
    fn stop_all(self) {
        for actor in self.entities {
            let _ = actor.send_message(EntityMsg::Stop);
        }
        for actor in self.shards {
            actor.stop(Some("shard moved".into()));
        }
    }
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

fn refused() -> ShardingError {
    ShardingError::Bug("an entity mailbox refused an envelope without giving it back".into())
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
