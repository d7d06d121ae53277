//! One entity type's routing table: a slot per shard.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use ractor::{ActorId, ActorRef, MessagingErr};

use crate::entity::EntityContext;
use crate::error::{ShardingError, ShardingResult};
use crate::extractor::ShardId;
use crate::private::LocalEnvelope;
use crate::runtime::entity_actor::EntityMsg;
use crate::runtime::region_actor::RegionMsg;
use crate::runtime::shard_actor::ShardMsg;
use crate::store::RememberEntitiesStore;

/// Spawns one entity actor (type-erased over the entity type).
pub(crate) type Spawner = Box<
    dyn Fn(EntityContext, ActorRef<ShardMsg>) -> Result<ActorRef<EntityMsg>, ShardingError>
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
    pub(crate) shard: ActorRef<ShardMsg>,
    pub(crate) entities: HashMap<Arc<str>, ActorRef<EntityMsg>>,
    pub(crate) passivating: HashMap<Arc<str>, Passivating>,
}

pub(crate) struct Passivating {
    actor: ActorId,
    buffer: Vec<Buffered>,
}

pub(crate) struct Region {
    pub(crate) type_name: &'static str,
    pub(crate) protocol: std::any::TypeId,
    buffer_cap: usize,
    slots: Box<[Mutex<Slot>]>,
    spawner: Spawner,
    pub(crate) region_actor: OnceLock<ActorRef<RegionMsg>>,
    stopped: AtomicBool,
    pub(crate) remember: Option<Arc<dyn RememberEntitiesStore>>,
    pub(crate) shutdown_timeout: Duration,
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
    /// was not accepted (and is dropped; the caller reports the error).
    pub(crate) fn deliver(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> ShardingResult<()> {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        match &mut *guard {
            Slot::Unallocated { buffer, requested } => {
                if buffer.len() >= self.buffer_cap {
                    return Err(self.overflow(shard));
                }
                buffer.push(Buffered::Message(entity_id.clone(), envelope));
                if !*requested {
                    *requested = true;
                    self.request_allocation(shard);
                }
                Ok(())
            }
            Slot::Local(local) => self
                .deliver_local(local, shard, entity_id, envelope)
                .map_err(|(error, _)| error),
            Slot::Stopped => Err(ShardingError::ShuttingDown),
        }
    }

    /// Routing within a hosted shard, under its lock: enqueue to the live
    /// entity (the common case), buffer behind a passivation, or replace a
    /// dead actor / spawn the entity and enqueue.
    fn deliver_local(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), (ShardingError, Option<LocalEnvelope>)> {
        if let Some(passivating) = local.passivating.get_mut(entity_id) {
            if passivating.buffer.len() >= self.buffer_cap {
                return Err((self.overflow(shard), Some(envelope)));
            }
            passivating
                .buffer
                .push(Buffered::Message(entity_id.clone(), envelope));
            return Ok(());
        }
        let envelope = match local.entities.get(entity_id) {
            Some(actor) => match send_to(actor, envelope) {
                Ok(()) => return Ok(()),
                Err(Some(envelope)) => {
                    local.entities.remove(entity_id);
                    envelope
                }
                Err(None) => return Err((refused(), None)),
            },
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
        let ctx = EntityContext::new(self.type_name, entity_id.clone(), shard);
        let actor = (self.spawner)(ctx, local.shard.clone())?;
        local.entities.insert(entity_id.clone(), actor.clone());
        if let Some(store) = &self.remember {
            if let Err(error) = store.record_entity_started(self.type_name, shard, entity_id) {
                tracing::warn!(type_name = self.type_name, %shard, entity_id = &**entity_id, %error, "remember-entities: recording a start failed");
            }
        }
        Ok(actor)
    }

    fn request_allocation(&self, shard: ShardId) {
        match self.region_actor.get() {
            Some(actor) => {
                if actor.cast(RegionMsg::Allocate(shard)).is_err() {
                    tracing::debug!(type_name = self.type_name, %shard, "region actor gone; allocation not requested");
                }
            }
            None => tracing::error!(
                type_name = self.type_name,
                "BUG: region used before its actor started"
            ),
        }
    }

    /// Makes `shard` local with the given shard actor and flushes its buffer in
    /// order. Returns false (and leaves the slot as it was) when the shard is
    /// already local or the region stopped; the caller then stops `shard_actor`.
    pub(crate) fn install_local(&self, shard: ShardId, shard_actor: ActorRef<ShardMsg>) -> bool {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        let buffer = match &mut *guard {
            Slot::Unallocated { buffer, .. } => std::mem::take(buffer),
            Slot::Local(_) | Slot::Stopped => return false,
        };
        let mut local = LocalShard {
            shard: shard_actor,
            entities: HashMap::new(),
            passivating: HashMap::new(),
        };
        self.replay(&mut local, shard, buffer);
        if let Some(store) = &self.remember {
            match store.list_entities_for_shard(self.type_name, shard) {
                Ok(ids) => {
                    for id in ids {
                        let id: Arc<str> = id.into();
                        if !local.entities.contains_key(&id) {
                            if let Err(error) = self.spawn_entity(&mut local, shard, &id) {
                                tracing::warn!(type_name = self.type_name, %shard, %error, "remember-entities: respawn failed");
                            }
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(type_name = self.type_name, %shard, %error, "remember-entities: listing the shard failed")
                }
            }
        }
        *guard = Slot::Local(local);
        true
    }

    /// Starts shards that have remembered entities (used at registration).
    pub(crate) fn start_remembered_shards(&self) {
        let Some(store) = &self.remember else { return };
        match store.list_shards(self.type_name) {
            Ok(shards) => {
                for shard in shards.into_iter().filter(|s| s.0 < self.num_shards()) {
                    let mut guard = lock(&self.slots[shard.0 as usize]);
                    if let Slot::Unallocated { requested, .. } = &mut *guard {
                        if !*requested {
                            *requested = true;
                            self.request_allocation(shard);
                        }
                    }
                }
            }
            Err(error) => {
                tracing::warn!(type_name = self.type_name, %error, "remember-entities: listing shards failed")
            }
        }
    }

    /// Begins passivating `entity_id` if `actor` (when given) is its current
    /// incarnation. While the shard has no home yet, or the entity is already
    /// passivating with messages waiting, the request is buffered behind them.
    pub(crate) fn passivate(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        actor: Option<ActorId>,
    ) -> ShardingResult<()> {
        let mut guard = lock(&self.slots[shard.0 as usize]);
        match &mut *guard {
            Slot::Unallocated { buffer, .. } => {
                if buffer
                    .iter()
                    .any(|b| matches!(b, Buffered::Message(id, _) if id == entity_id))
                {
                    if buffer.len() >= self.buffer_cap {
                        return Err(self.overflow(shard));
                    }
                    buffer.push(Buffered::Passivate(entity_id.clone()));
                }
                Ok(())
            }
            Slot::Local(local) => self.passivate_in(local, shard, entity_id, actor),
            Slot::Stopped => Err(ShardingError::ShuttingDown),
        }
    }

    fn passivate_in(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
        actor: Option<ActorId>,
    ) -> ShardingResult<()> {
        if let Some(passivating) = local.passivating.get_mut(entity_id) {
            // Only an explicit request for whatever incarnation comes next.
            if actor.is_none() && !passivating.buffer.is_empty() {
                if passivating.buffer.len() >= self.buffer_cap {
                    return Err(self.overflow(shard));
                }
                passivating
                    .buffer
                    .push(Buffered::Passivate(entity_id.clone()));
            }
            return Ok(());
        }
        let current = match local.entities.get(entity_id) {
            Some(current) if actor.is_none_or(|a| a == current.get_id()) => current.get_id(),
            _ => return Ok(()),
        };
        let Some(entity) = local.entities.remove(entity_id) else {
            return Ok(());
        };
        local.passivating.insert(
            entity_id.clone(),
            Passivating {
                actor: current,
                buffer: Vec::new(),
            },
        );
        if let Some(store) = &self.remember {
            if let Err(error) = store.record_entity_stopped(self.type_name, shard, entity_id) {
                tracing::warn!(type_name = self.type_name, %shard, %error, "remember-entities: recording a stop failed");
            }
        }
        // Stop after what is queued. Not ractor's `drain`: draining an actor
        // whose `pre_start` has not run yet makes ractor refuse to start it,
        // losing its mailbox. Nothing can be enqueued behind this marker: the
        // entity left the table under this lock.
        if entity.send_message(EntityMsg::Stop).is_err() {
            // Already stopped: its stop notice may have been handled before
            // this passivation began, so finish the passivation here.
            self.stopped_in(local, shard, entity_id, current);
        }
        Ok(())
    }

    /// An entity actor stopped: finish its passivation (respawning it with the
    /// messages buffered meanwhile), or forget a crashed incarnation.
    pub(crate) fn entity_stopped(&self, shard: ShardId, entity_id: &Arc<str>, actor: ActorId) {
        if let Slot::Local(local) = &mut *lock(&self.slots[shard.0 as usize]) {
            self.stopped_in(local, shard, entity_id, actor);
        }
    }

    fn stopped_in(
        &self,
        local: &mut LocalShard,
        shard: ShardId,
        entity_id: &Arc<str>,
        actor: ActorId,
    ) {
        if local
            .passivating
            .get(entity_id)
            .is_some_and(|p| p.actor == actor)
        {
            if let Some(passivating) = local.passivating.remove(entity_id) {
                self.replay(local, shard, passivating.buffer);
            }
        } else if local
            .entities
            .get(entity_id)
            .is_some_and(|a| a.get_id() == actor)
        {
            local.entities.remove(entity_id);
        }
    }

    /// Replays buffered items in order into a hosted shard; a message that
    /// cannot be delivered is failed back to its sender.
    fn replay(&self, local: &mut LocalShard, shard: ShardId, buffer: Vec<Buffered>) {
        for item in buffer {
            match item {
                Buffered::Message(entity_id, envelope) => {
                    if let Err((error, Some(envelope))) =
                        self.deliver_local(local, shard, &entity_id, envelope)
                    {
                        envelope.fail(error);
                    }
                }
                Buffered::Passivate(entity_id) => {
                    if let Err(error) = self.passivate_in(local, shard, &entity_id, None) {
                        tracing::warn!(type_name = self.type_name, %shard, %error, "buffered passivation dropped");
                    }
                }
            }
        }
    }

    /// Number of live entities in `shard` (for tests and metrics).
    pub(crate) fn live_entities(&self, shard: ShardId) -> usize {
        match &*lock(&self.slots[shard.0 as usize]) {
            Slot::Local(local) => local.entities.len(),
            _ => 0,
        }
    }

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// stops all entity and shard actors, waiting for them up to the shutdown timeout.
    pub(crate) async fn shutdown(&self) {
        self.stopped.store(true, Ordering::Release);
        let mut entities = Vec::new();
        let mut shards = Vec::new();
        for slot in self.slots.iter() {
            let previous = std::mem::replace(&mut *lock(slot), Slot::Stopped);
            match previous {
                Slot::Unallocated { buffer, .. } => fail_all(buffer),
                Slot::Local(local) => {
                    for (_, passivating) in local.passivating {
                        fail_all(passivating.buffer);
                    }
                    entities.extend(local.entities.into_values());
                    shards.push(local.shard);
                }
                Slot::Stopped => {}
            }
        }
        let cells = entities
            .iter()
            .map(|e| e.get_cell())
            .chain(shards.iter().map(|s| s.get_cell()));
        futures_util::future::join_all(cells.map(|cell| stop_or_kill(cell, self.shutdown_timeout)))
            .await;
        if let Some(actor) = self.region_actor.get() {
            stop_or_kill(actor.get_cell(), self.shutdown_timeout).await;
        }
    }
}

/// Enqueues into an entity's mailbox. `Err(Some)` gives the envelope back
/// (the entity is draining or gone); `Err(None)` means ractor dropped it,
/// which a correctly typed `ActorRef` never does (its asker then sees
/// `EntityStopped`).
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

fn fail_all(buffer: Vec<Buffered>) {
    for item in buffer {
        if let Buffered::Message(_, envelope) = item {
            envelope.fail(ShardingError::ShuttingDown);
        }
    }
}

/// Stops an actor after the message in hand; if that takes longer than
/// `timeout` (a handler that never returns), kills it, which abandons the
/// handler and drops its mailbox: the senders waiting there see the system
/// shutting down.
async fn stop_or_kill(cell: ractor::ActorCell, timeout: Duration) {
    if cell
        .stop_and_wait(Some("shutdown".into()), Some(timeout))
        .await
        .is_err()
    {
        tracing::warn!(actor = %cell.get_id(), ?timeout, "actor did not stop in time; killing it");
        let _ = cell.kill_and_wait(Some(timeout)).await;
    }
}
