//! One ractor actor per live entity.

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::entity::{Entity, EntityContext, MigratedState, Migration, MigrationEvent, Recovered};
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::runtime::dispatch::{Dispatch, OutcomeKind, panic_message};
use crate::runtime::mailbox::{EntityMsg, RegionMsg};
use crate::runtime::traffic;

/// Builds an entity incarnation.
pub(crate) type Factory<E> = Arc<dyn Fn(&EntityContext) -> E + Send + Sync>;

/// Of an event-sourced type: applies the journal's events to a fresh
/// incarnation (`entity::recover::<E>`).
pub(crate) type Recover<E> = fn(&mut E, &EntityContext, Recovered) -> ShardingResult<()>;

pub(crate) struct EntityActor<E>(PhantomData<fn() -> E>);

impl<E> EntityActor<E> {
    pub(crate) fn new() -> Self {
        EntityActor(PhantomData)
    }
}

/// Tells the region that an incarnation has ended, when dropped. It lives in
/// the actor's arguments and then its state, which ractor drops on every exit
/// path — stop, kill, a failed `pre_start`, a panic — so the region always
/// hears, including in the cases where ractor skips `post_stop`. (A cast to
/// the region actor, never a call into the region: a spawn that fails under
/// a shard's lock drops the notice there.)
pub(crate) struct StopNotice {
    pub(crate) region: ActorRef<RegionMsg>,
    pub(crate) shard: ShardId,
    pub(crate) entity_id: Arc<str>,
    pub(crate) incarnation: u64,
    /// The state this incarnation handed over, stopped to move.
    pub(crate) state: Option<MigratedState>,
}

impl Drop for StopNotice {
    fn drop(&mut self) {
        let msg = RegionMsg::EntityStopped {
            shard: self.shard,
            entity_id: self.entity_id.clone(),
            incarnation: self.incarnation,
            state: self.state.take(),
        };
        // The region actor stops only at shutdown, when nobody needs the notice.
        let _ = self.region.cast(msg);
    }
}

pub(crate) struct EntityArgs<E> {
    pub(crate) factory: Factory<E>,
    pub(crate) ctx: EntityContext,
    pub(crate) idle_timeout: Option<Duration>,
    pub(crate) notice: StopNotice,
    /// Of an event-sourced type: its recovery.
    pub(crate) recover: Option<Recover<E>>,
    /// Of a migratable type: its conversions, and where a refused state
    /// is reported.
    pub(crate) migration: Option<(Migration<E>, MigrationEvents)>,
    /// The state this incarnation starts from, migrated with its shard.
    pub(crate) migrated: Option<MigratedState>,
}

/// Where migration events go.
pub(crate) type MigrationEvents = tokio::sync::broadcast::Sender<MigrationEvent>;

/// Reports a migrated state that was not used, and why; the deliveries
/// table that came with it goes too (the store's, if any, is loaded).
fn report_refused<E>(args: &EntityArgs<E>, reason: String) {
    let ctx = &args.ctx;
    ctx.restore_deliveries(Vec::new());
    tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %reason, "a migrated state was refused; the entity recovers from its store");
    if let Some((_, events)) = &args.migration {
        let _ = events.send(MigrationEvent::StateRefused {
            type_name: ctx.type_name(),
            entity_id: ctx.entity_id().to_owned(),
            reason,
        });
    }
}

/// Gives a fresh incarnation the state migrated with its shard. A state
/// that does not decode is reported, and the incarnation keeps what the
/// factory made; one whose `rehydrate` panics is reported too, and the
/// incarnation (perhaps half changed) is built again by the factory.
fn rehydrate<E>(entity: &mut E, args: &mut EntityArgs<E>) -> Result<(), ActorProcessingErr> {
    // (A durable type's state goes into its recovery instead.)
    let Some((Migration { put: Some(put), .. }, events)) = &args.migration else {
        return Ok(());
    };
    let (put, events) = (*put, events.clone());
    let Some(state) = args.migrated.take() else {
        return Ok(());
    };
    let mut panicked = false;
    let applied = std::panic::catch_unwind(AssertUnwindSafe(|| put(entity, &state)))
        .unwrap_or_else(|payload| {
            panicked = true;
            Err(format!(
                "rehydrate panicked: {}",
                panic_message(payload.as_ref())
            ))
        });
    if let Err(reason) = applied {
        let ctx = &args.ctx;
        // The table describes the state that was refused.
        ctx.restore_deliveries(Vec::new());
        tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %reason, "a migrated state was refused; the entity starts from its factory");
        let _ = events.send(MigrationEvent::StateRefused {
            type_name: ctx.type_name(),
            entity_id: ctx.entity_id().to_owned(),
            reason,
        });
    }
    if panicked {
        let old = std::mem::replace(entity, build(&args.factory, &args.ctx)?);
        if std::panic::catch_unwind(AssertUnwindSafe(|| drop(old))).is_err() {
            tracing::warn!(
                type_name = args.ctx.type_name(),
                entity_id = args.ctx.entity_id(),
                "dropping the half-rehydrated entity panicked too"
            );
        }
    }
    Ok(())
}

pub(crate) struct EntityState<E> {
    // Field order is drop order: the entity is dropped before the notice is
    // sent, so the next incarnation never coexists with this one.
    entity: E,
    args: EntityArgs<E>,
    last_activity: Instant,
    /// Of a durable type: why this incarnation handles nothing (its
    /// recovery failed, or a write's outcome is unknown; a write refused
    /// because another incarnation wrote since replaces it in place
    /// instead, see `restart_after_conflict`).
    /// Every message is answered with it, and the entity is passivated, so
    /// that the next message recovers a new incarnation.
    failed: Option<ShardingError>,
}

/// Recovers a fresh incarnation of an event-sourced type from its journal.
/// Of a durable type whose state migrated with its shard, the recovery
/// starts from that state (SPEC §13.16); when the store moved on, or the
/// state does not apply, from the store as always, and that is reported.
async fn recover_fresh<E>(entity: &mut E, args: &mut EntityArgs<E>) -> Option<ShardingError> {
    let recover = args.recover?;
    if let Some(migrated) = args.migrated.take() {
        let refused = match args.ctx.recover_migrated(migrated).await {
            Ok((recovered, true)) => match recover(entity, &args.ctx, recovered) {
                Ok(()) => return None,
                Err(error) => error.to_string(),
            },
            Ok((recovered, false)) => {
                // Recovered from the store already: the state was not used.
                report_refused(args, "the store moved on since the state was taken".into());
                return recover(entity, &args.ctx, recovered).err().inspect(|error| {
                    tracing::warn!(type_name = args.ctx.type_name(), entity_id = args.ctx.entity_id(), %error, "entity recovery failed: its messages fail until it recovers");
                });
            }
            Err(error) => error.to_string(),
        };
        report_refused(args, refused);
        // Nothing of the state was kept: a fresh incarnation, from the store.
        match build(&args.factory, &args.ctx) {
            Ok(fresh) => *entity = fresh,
            Err(error) => return Some(ShardingError::Spawn(error.to_string())),
        }
    }
    let recovered = match args.ctx.recover_events().await {
        Ok(events) => recover(entity, &args.ctx, events),
        Err(error) => Err(error),
    };
    recovered.err().inspect(|error| {
        tracing::warn!(type_name = args.ctx.type_name(), entity_id = args.ctx.entity_id(), %error, "entity recovery failed: its messages fail until it recovers");
    })
}

fn build<E>(factory: &Factory<E>, ctx: &EntityContext) -> Result<E, ActorProcessingErr> {
    std::panic::catch_unwind(AssertUnwindSafe(|| factory(ctx))).map_err(|payload| {
        let panic = panic_message(payload.as_ref());
        format!(
            "entity factory for `{}` `{}` panicked: {panic}",
            ctx.type_name(),
            ctx.entity_id()
        )
        .into()
    })
}

impl<E> EntityState<E> {
    /// Asks the region to passivate this incarnation (`idle`: its idle
    /// timeout ran out).
    fn request_passivation(&self, idle: bool) {
        let notice = &self.args.notice;
        let msg = RegionMsg::Passivate {
            shard: notice.shard,
            entity_id: notice.entity_id.clone(),
            incarnation: notice.incarnation,
            idle,
        };
        let _ = notice.region.cast(msg);
    }
}

impl<E> Actor for EntityActor<E>
where
    E: Entity,
    E::Protocol: Dispatch<E>,
{
    type Msg = EntityMsg;
    type State = EntityState<E>;
    type Arguments = EntityArgs<E>;

    async fn pre_start(
        &self,
        myself: ActorRef<EntityMsg>,
        args: EntityArgs<E>,
    ) -> Result<EntityState<E>, ActorProcessingErr> {
        let mut args = args;
        if let Some(migrated) = &mut args.migrated {
            args.ctx
                .restore_deliveries(std::mem::take(&mut migrated.deliveries));
        }
        let mut entity = build(&args.factory, &args.ctx)?;
        rehydrate(&mut entity, &mut args)?;
        let failed = recover_fresh(&mut entity, &mut args).await;
        if failed.is_some() {
            // Passivated after the messages already here are answered.
            myself.send_message(EntityMsg::IdleCheck).ok();
        }
        if let Some(idle) = args.idle_timeout {
            myself.send_after(idle, || EntityMsg::IdleCheck);
        }
        Ok(EntityState {
            entity,
            args,
            last_activity: Instant::now(),
            failed,
        })
    }

    // Not an `async fn`: ractor moves this future twice per message (into
    // its own, to race it against the actor's signals), and it lives in the
    // entity's task. So what a message does without waiting is done here,
    // and the future returned holds the envelope (until the dispatch takes
    // it), the protocol's dispatch future, the actor's ref and the state's
    // reference, with no copy of the message or its parts beside them (an
    // `async fn` keeps each argument twice).
    fn handle(
        &self,
        myself: ActorRef<EntityMsg>,
        msg: EntityMsg,
        state: &mut EntityState<E>,
    ) -> impl Future<Output = Result<(), ActorProcessingErr>> + Send {
        let handling = match msg {
            EntityMsg::Deliver(envelope) => match &state.failed {
                Some(error) => {
                    envelope.fail(error.clone());
                    None
                }
                None => {
                    // The store calls its handling makes end before its
                    // asker's deadline (SPEC §8b).
                    state.args.ctx.begin_message(envelope.deadline());
                    Some(envelope)
                }
            },
            EntityMsg::Stop => {
                myself.stop(Some("passivated".into()));
                None
            }
            EntityMsg::StopToMove => {
                state.stop_to_move(&myself);
                None
            }
            EntityMsg::IdleCheck => {
                state.idle_check(&myself);
                None
            }
        };
        async move {
            let Some(mut envelope) = handling else {
                return Ok(());
            };
            let (entity, ctx) = (&mut state.entity, &state.args.ctx);
            // What the handling sends, it sends from this shard (SPEC
            // §13.11).
            let sender = (ctx.type_name(), state.args.notice.shard.0);
            // Awaited where it is made: a future bound to a local and then
            // awaited would be stored twice in this one. (`if let`, not
            // `match`: the untraced path then keeps no `Option<Span>`.)
            let outcome = if let Some(parent) = envelope.take_trace() {
                // Tracing on (SPEC §14.2): the handling is a child of the
                // sender's span, or of the span that received it.
                let span = tracing::info_span!(
                    parent: &parent,
                    "datum.handle",
                    entity_type = ctx.type_name(),
                    entity_id = ctx.entity_id(),
                );
                // The call (what the handling does before its first
                // await) runs in the span, as the future it returns does.
                let handled = {
                    let _in_span = span.enter();
                    traffic::handled_by(
                        sender,
                        <E::Protocol as Dispatch<E>>::dispatch(entity, envelope, ctx),
                    )
                };
                // Boxed: a traced message's handling is the rare case, kept
                // out of every message's future.
                Box::pin(tracing::Instrument::instrument(handled, span)).await
            } else {
                traffic::handled_by(
                    sender,
                    <E::Protocol as Dispatch<E>>::dispatch(entity, envelope, ctx),
                )
                .await
            };
            if state.args.idle_timeout.is_some() {
                state.last_activity = Instant::now();
            }
            if let OutcomeKind::Panicked(panic) = outcome.0 {
                // The rebuild recovers anew: a conflict met before the
                // panic is cleared with it.
                let _ = state.args.ctx.take_conflict();
                state.args.ctx.begin_message(None);
                // Boxed, as the rare rebuild is kept out of every
                // message's future.
                if Box::pin(state.rebuild(&myself, panic)).await.is_err() {
                    return Ok(());
                }
            } else if let Some(pause) = state.args.ctx.take_conflict() {
                // Boxed, as the rebuild is.
                if Box::pin(state.restart_after_conflict(&myself, pause))
                    .await
                    .is_err()
                {
                    return Ok(());
                }
            }
            state.after_handling();
            Ok(())
        }
    }
}

impl<E> EntityState<E>
where
    E: Entity,
    E::Protocol: Dispatch<E>,
{
    /// What a message's handling leaves to do: a write refused as stale
    /// ends this incarnation; it, a failed one, or the entity's own request
    /// asks the region to passivate it.
    fn after_handling(&mut self) {
        if self.failed.is_none() {
            self.failed = self.args.ctx.stale();
        }
        if self.failed.is_some() || self.args.ctx.take_passivate_request() {
            self.request_passivation(false);
        }
    }

    /// A fresh incarnation in place of one whose handler panicked; `Err`
    /// (the actor is stopping) when the factory could not build one.
    async fn rebuild(&mut self, myself: &ActorRef<EntityMsg>, panic: String) -> Result<(), ()> {
        let ctx = &self.args.ctx;
        tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %panic, "entity handler panicked; restarting the entity");
        self.replace_incarnation(myself).await
    }

    /// A fresh incarnation in place of one whose write was refused because
    /// another incarnation wrote since it recovered (SPEC §8b, Fencing):
    /// after `pause`, built by the factory and recovered from the store —
    /// the other writer's events or state included — it handles the
    /// messages that wait in the mailbox, so none of them is answered with
    /// a conflict it did not meet, nor tried against the refused state.
    /// Meanwhile they wait: a losing writer does not retry at once. `Err`
    /// (the actor is stopping) when the factory could not build one.
    async fn restart_after_conflict(
        &mut self,
        myself: &ActorRef<EntityMsg>,
        pause: Duration,
    ) -> Result<(), ()> {
        tokio::time::sleep(pause).await;
        self.replace_incarnation(myself).await
    }

    /// Builds and recovers a fresh incarnation in place of this one, its
    /// mailbox kept; `Err` (the actor is stopping) when the factory could
    /// not build one.
    async fn replace_incarnation(&mut self, myself: &ActorRef<EntityMsg>) -> Result<(), ()> {
        match build(&self.args.factory, &self.args.ctx) {
            Ok(mut fresh) => {
                // (Not boxed again: this whole future is boxed where it is awaited.)
                self.failed = recover_fresh(&mut fresh, &mut self.args).await;
                let old = std::mem::replace(&mut self.entity, fresh);
                if std::panic::catch_unwind(AssertUnwindSafe(|| drop(old))).is_err() {
                    let ctx = &self.args.ctx;
                    tracing::warn!(
                        type_name = ctx.type_name(),
                        entity_id = ctx.entity_id(),
                        "dropping the replaced entity panicked"
                    );
                }
                Ok(())
            }
            Err(error) => {
                tracing::error!(%error, "entity could not be rebuilt; stopping it");
                myself.stop(Some("factory panicked on restart".into()));
                Err(())
            }
        }
    }

    /// Stops this incarnation to move with its shard, handing over its
    /// state if its type migrates state.
    fn stop_to_move(&mut self, myself: &ActorRef<EntityMsg>) {
        if let (Some((migration, _)), None) = (&self.args.migration, &self.failed) {
            let take = migration.take;
            let (entity, ctx) = (&mut self.entity, &self.args.ctx);
            let taken = std::panic::catch_unwind(AssertUnwindSafe(|| take(entity, ctx)))
                .unwrap_or_else(|payload| {
                    Err(format!(
                        "dehydrate panicked: {}",
                        panic_message(payload.as_ref())
                    ))
                });
            match taken {
                Ok(mut migrated) => {
                    // The deliveries table travels with the state.
                    migrated.deliveries = self.args.ctx.delivery_rows();
                    self.args.notice.state = Some(migrated);
                }
                Err(reason) => {
                    let ctx = &self.args.ctx;
                    tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %reason, "an entity's state could not be taken; its next incarnation starts from the factory");
                }
            }
        }
        myself.stop(Some("moved".into()));
    }

    /// The idle check: passivation once the idle timeout has passed with
    /// no message (at once for an incarnation that handles nothing), the
    /// next check otherwise.
    fn idle_check(&self, myself: &ActorRef<EntityMsg>) {
        if self.failed.is_some() {
            self.request_passivation(false);
        } else if let Some(idle) = self.args.idle_timeout {
            let quiet = self.last_activity.elapsed();
            if quiet >= idle {
                self.request_passivation(true);
            } else {
                myself.send_after(idle - quiet, || EntityMsg::IdleCheck);
            }
        }
    }
}
