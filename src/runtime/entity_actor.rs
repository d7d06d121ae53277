//! One ractor actor per live entity.

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::entity::{Entity, EntityContext};
use crate::private::{Dispatch, LocalEnvelope, OutcomeKind, panic_message};
use crate::runtime::shard_actor::ShardMsg;

/// Builds an entity incarnation.
pub(crate) type Factory<E> = Arc<dyn Fn(&EntityContext) -> E + Send + Sync>;

/// What an entity actor receives.
#[derive(Debug)]
pub(crate) enum EntityMsg {
    /// A message for the entity's handler.
    Deliver(LocalEnvelope),
    /// Time to check whether the entity has been idle long enough to passivate.
    IdleCheck,
    /// Stop once everything queued before this marker is handled (passivation).
    Stop,
}

pub(crate) struct EntityActor<E>(PhantomData<fn() -> E>);

impl<E> EntityActor<E> {
    pub(crate) fn new() -> Self {
        EntityActor(PhantomData)
    }
}

pub(crate) struct EntityArgs<E> {
    pub(crate) factory: Factory<E>,
    pub(crate) ctx: EntityContext,
    pub(crate) shard: ActorRef<ShardMsg>,
    pub(crate) idle_timeout: Option<Duration>,
}

pub(crate) struct EntityState<E> {
    entity: E,
    args: EntityArgs<E>,
    last_activity: Instant,
}

fn build<E>(factory: &Factory<E>, ctx: &EntityContext) -> Result<E, ActorProcessingErr> {
    std::panic::catch_unwind(AssertUnwindSafe(|| factory(ctx))).map_err(|payload| {
        format!(
            "entity factory for `{}` `{}` panicked: {}",
            ctx.type_name(),
            ctx.entity_id(),
            panic_message(payload.as_ref())
        )
        .into()
    })
}

impl<E> EntityState<E> {
    fn request_passivation(&self, myself: &ActorRef<EntityMsg>) {
        let msg = ShardMsg::Passivate {
            entity_id: self.args.ctx.entity_id_arc().clone(),
            actor: myself.get_id(),
        };
        // The shard stops only at shutdown, which stops this entity too.
        let _ = self.args.shard.cast(msg);
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
        let entity = build(&args.factory, &args.ctx)?;
        if let Some(idle) = args.idle_timeout {
            myself.send_after(idle, || EntityMsg::IdleCheck);
        }
        Ok(EntityState {
            entity,
            args,
            last_activity: Instant::now(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<EntityMsg>,
        msg: EntityMsg,
        state: &mut EntityState<E>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EntityMsg::Deliver(envelope) => {
                if state.args.idle_timeout.is_some() {
                    state.last_activity = Instant::now();
                }
                let outcome = <E::Protocol as Dispatch<E>>::dispatch(
                    &mut state.entity,
                    envelope,
                    &state.args.ctx,
                )
                .await;
                if let OutcomeKind::Panicked(panic) = outcome.0 {
                    tracing::warn!(type_name = state.args.ctx.type_name(), entity_id = state.args.ctx.entity_id(), %panic, "entity handler panicked; restarting the entity");
                    match build(&state.args.factory, &state.args.ctx) {
                        Ok(entity) => state.entity = entity,
                        Err(error) => {
                            tracing::error!(%error, "entity could not be rebuilt; stopping it");
                            myself.stop(Some("factory panicked on restart".into()));
                            return Ok(());
                        }
                    }
                }
                if state.args.ctx.take_passivate_request() {
                    state.request_passivation(&myself);
                }
            }
            EntityMsg::Stop => myself.stop(Some("passivated".into())),
            EntityMsg::IdleCheck => {
                if let Some(idle) = state.args.idle_timeout {
                    let quiet = state.last_activity.elapsed();
                    if quiet >= idle {
                        state.request_passivation(&myself);
                    } else {
                        myself.send_after(idle - quiet, || EntityMsg::IdleCheck);
                    }
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<EntityMsg>,
        state: &mut EntityState<E>,
    ) -> Result<(), ActorProcessingErr> {
        let msg = ShardMsg::EntityStopped {
            entity_id: state.args.ctx.entity_id_arc().clone(),
            actor: myself.get_id(),
        };
        let _ = state.args.shard.cast(msg);
        Ok(())
    }
}
