//! The region as its slots' host: what a slot's transitions do on actors,
//! the remember-entities store, the cluster port and the driver.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ractor::{ActorRef, MessagingErr};

use super::{PassivationCause, Region, RegionHost};
use crate::entity::MigrationEvent;
use crate::entity::{EntityContext, MigratedState};
use crate::model::config::PassivationPolicy;
use crate::model::envelope::LocalEnvelope;
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::persistence::remember::RememberEntitiesOperation;
use crate::runtime::mailbox::{EntityMsg, RegionMsg};
use crate::runtime::slot::{Refused, ShardHome, SlotHost, Undelivered};

impl Region {
    /// The slot's host: this region's effects.
    pub(super) fn host(&self) -> Host<'_> {
        Host {
            region: self,
            cause: PassivationCause::Explicit,
            ask: None,
        }
    }
}

/// A region as its slots' host: their effects on actors, the store, the
/// pipes and the driver.
pub(super) struct Host<'a> {
    region: &'a Region,
    /// Whose request a passivation it makes answers.
    pub(super) cause: PassivationCause,
    /// In an asker's own delivery: its ask's deadline (and timeout), and
    /// whether its guarded envelope was forwarded with them.
    pub(super) ask: Option<AskDelivery>,
}

/// What [`Region::deliver_ask`] tells the host, and learns back.
pub(super) struct AskDelivery {
    pub(super) deadline: tokio::time::Instant,
    pub(super) timeout: Duration,
    pub(super) forwarded: bool,
}

impl SlotHost for Host<'_> {
    type Entity = ActorRef<EntityMsg>;

    fn entity_share(&self) -> Option<(usize, PassivationPolicy)> {
        self.region.table.share()
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

impl RegionHost for Host<'_> {
    fn fail(&mut self, undelivered: Undelivered) {
        for (error, envelope) in undelivered {
            envelope.fail(error);
        }
    }

    fn host_shard(&mut self, shard: ShardId, generation: u64, from: Option<UniqueAddress>) {
        // The region actor prepares and installs the shard.
        if let Some(actor) = self.region.region_actor.get() {
            let _ = actor.cast(RegionMsg::Host {
                shard,
                generation,
                from,
            });
        }
    }

    fn states_not_fetched(&mut self, shard: ShardId, from: UniqueAddress, reason: String) {
        let type_name = self.region.type_name;
        tracing::warn!(type_name, %shard, %from, %reason, "migrated states not fetched");
        self.region.migration_event(MigrationEvent::FellBack {
            type_name,
            shard,
            from: Some(from),
            reason,
        });
    }

    fn expire_later(&mut self, shard: ShardId, generation: u64, after: Duration) {
        if let Some(actor) = self.region.region_actor.get() {
            actor.send_after(after, move || RegionMsg::ExpireMigration {
                shard,
                generation,
            });
        }
    }

    fn hosted_changed(&mut self, here: bool) {
        self.region.metrics.shards(if here { 1 } else { -1 });
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
