//! One entity type's routing table: a slot per shard.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use ractor::{ActorRef, MessagingErr, RactorErr};

use crate::entity::EntityContext;
use crate::error::{ShardingError, ShardingResult};
use crate::extractor::ShardId;
use crate::private::LocalEnvelope;
use crate::runtime::entity_actor::EntityMsg;
use crate::runtime::region_actor::RegionMsg;
use crate::runtime::shard_actor::ShardMsg;
use crate::store::RememberEntitiesStore;

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

/// One shard's state in its region.
pub(crate) enum Slot {
    /// No home yet: messages wait here until the shard is allocated.
    Unallocated {
        buffer: Vec<Buffered>,
        requested: bool,
    },
    /// Hosted on this node.
    Local(LocalShard),
    /// The system shut down.
    Stopped,
}

pub(crate) struct LocalShard {
    shard: ActorRef<ShardMsg>,
    entities: HashMap<Arc<str>, Entry>,
    /// Numbers the incarnations of this shard's entities; a stop notice or
    /// passivation request names the incarnation it is about.
    last_incarnation: u64,
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

/// Messages that could not be delivered, to be failed once the lock is released.
type Undelivered = Vec<(ShardingError, LocalEnvelope)>;

pub(crate) struct Region {
    pub(crate) type_name: &'static str,
    pub(crate) protocol: std::any::TypeId,
    buffer_cap: usize,
    slots: Box<[Mutex<Slot>]>,
    spawner: Spawner,
    pub(crate) region_actor: OnceLock<ActorRef<RegionMsg>>,
    stopped: AtomicBool,
    remember: Option<Arc<dyn RememberEntitiesStore>>,
    shutdown_timeout: Duration,
}

/// Locks a slot. No code panics while holding it, so a poisoned lock (a
/// panic elsewhere in the thread) still guards consistent data.
fn lock(slot: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
    slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Region {
    pub(crate) fn new(
        type_name: &'static str,
        protocol: std::any::TypeId,
        num_shards: u32,
        buffer_cap: usize,
        spawner: Spawner,
        remember: Option<Arc<dyn RememberEntitiesStore>>,
        shutdown_timeout: Duration,
    ) -> Self {
        let slots = (0..num_shards)
            .map(|_| {
                Mutex::new(Slot::Unallocated {
                    buffer: Vec::new(),
                    requested: false,
                })
            })
            .collect();
        Region {
            type_name,
            protocol,
            buffer_cap,
            slots,
            spawner,
            region_actor: OnceLock::new(),
            stopped: AtomicBool::new(false),
            remember,
            shutdown_timeout,
        }
    }

    pub(crate) fn num_shards(&self) -> u32 {
        self.slots.len() as u32
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
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let result = match &mut *guard {
            Slot::Local(local) => self.deliver_local(local, shard, entity_id, envelope),
            Slot::Unallocated { buffer, requested } => {
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
        result.map_err(|(error, _envelope)| error)
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
        local.last_incarnation += 1;
        let incarnation = local.last_incarnation;
        let ctx = EntityContext::new(self.type_name, entity_id.clone(), shard);
        let actor = (self.spawner)(ctx, incarnation, local.shard.clone())?;
        local.entities.insert(
            entity_id.clone(),
            Entry::Live(Live {
                actor: actor.clone(),
                incarnation,
            }),
        );
        if let Some(store) = &self.remember
            && let Err(error) = store.record_entity_started(self.type_name, shard, entity_id)
        {
            tracing::warn!(type_name = self.type_name, %shard, entity_id = &**entity_id, %error, "remember-entities: recording a start failed");
        }
        Ok(actor)
    }

    /// Asks the region actor to allocate `shard`; false if it cannot be asked
    /// (then the next message asks again).
    fn request_allocation(&self, shard: ShardId) -> bool {
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

    /// Makes `shard` local with the given shard actor, spawns its remembered
    /// entities and replays its buffer in order. Returns false (and leaves the
    /// slot as it was) when the shard is already local or the region stopped;
    /// the caller then stops `shard_actor`.
    pub(crate) fn install_local(&self, shard: ShardId, shard_actor: ActorRef<ShardMsg>) -> bool {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let buffer = match &mut *guard {
            Slot::Unallocated { buffer, .. } => std::mem::take(buffer),
            Slot::Local(_) | Slot::Stopped => return false,
        };
        let mut local = LocalShard {
            shard: shard_actor,
            entities: HashMap::new(),
            last_incarnation: 0,
        };
        self.spawn_remembered(&mut local, shard);
        let undelivered = self.replay(&mut local, shard, buffer);
        *guard = Slot::Local(local);
        drop(guard);
        fail_undelivered(undelivered);
        true
    }

    fn spawn_remembered(&self, local: &mut LocalShard, shard: ShardId) {
        let Some(store) = &self.remember else { return };
        match store.list_entities_for_shard(self.type_name, shard) {
            Ok(ids) => {
                for id in ids {
                    let id: Arc<str> = id.into();
                    if !local.entities.contains_key(&id)
                        && let Err(error) = self.spawn_entity(local, shard, &id)
                    {
                        tracing::warn!(type_name = self.type_name, %shard, %error, "remember-entities: respawn failed");
                    }
                }
            }
            Err(error) => {
                tracing::warn!(type_name = self.type_name, %shard, %error, "remember-entities: listing the shard failed")
            }
        }
    }

    /// Starts shards that have remembered entities (used at registration).
    pub(crate) fn start_remembered_shards(&self) {
        let Some(store) = &self.remember else { return };
        match store.list_shards(self.type_name) {
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
            Err(error) => {
                tracing::warn!(type_name = self.type_name, %error, "remember-entities: listing shards failed")
            }
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
        if let Some(store) = &self.remember
            && let Err(error) = store.record_entity_stopped(self.type_name, shard, entity_id)
        {
            tracing::warn!(type_name = self.type_name, %shard, %error, "remember-entities: recording a stop failed");
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
        match local.entities.remove(entity_id) {
            Some(Entry::Passivating { buffer, .. }) => self.replay(local, shard, buffer),
            _ => Vec::new(),
        }
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

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// stops all entity and shard actors (killing those that do not stop
    /// within the shutdown timeout).
    pub(crate) async fn shutdown(&self) {
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
            let previous = std::mem::replace(&mut *lock(slot), Slot::Stopped);
            match previous {
                Slot::Unallocated { buffer, .. } => buffered(buffer),
                Slot::Local(local) => {
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
                Slot::Stopped => {}
            }
        }
        fail_undelivered(undelivered);
        let timeout = self.shutdown_timeout;
        futures_util::future::join_all(cells.into_iter().map(|c| stop_or_kill(c, timeout))).await;
        futures_util::future::join_all(shard_cells.into_iter().map(|c| stop_or_kill(c, timeout)))
            .await;
        if let Some(actor) = self.region_actor.get() {
            stop_or_kill(actor.get_cell(), timeout).await;
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

/// Stops an actor after the message in hand; if that takes longer than
/// `timeout` (a handler that never returns), kills it, which abandons the
/// handler and drops its mailbox: the senders waiting there see the system
/// shutting down.
async fn stop_or_kill(cell: ractor::ActorCell, timeout: Duration) {
    if let Err(RactorErr::Timeout) = cell
        .stop_and_wait(Some("shutdown".into()), Some(timeout))
        .await
    {
        tracing::warn!(actor = %cell.get_id(), ?timeout, "actor did not stop in time; killing it");
        let _ = cell.kill_and_wait(Some(timeout)).await;
    }
}
