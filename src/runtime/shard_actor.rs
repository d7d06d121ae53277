//! One actor per hosted shard: the serialization point of its entities'
//! lifecycle (passivation and respawn). Messages to entities do not pass
//! through it; they go straight to the entity's mailbox.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::extractor::ShardId;
use crate::runtime::region::Region;

/// What a shard actor receives.
#[derive(Debug)]
pub(crate) enum ShardMsg {
    /// An entity incarnation asks to be passivated (idle, or `ctx.passivate()`).
    Passivate {
        entity_id: Arc<str>,
        incarnation: u64,
    },
    /// An entity incarnation ended.
    EntityStopped {
        entity_id: Arc<str>,
        incarnation: u64,
    },
}

pub(crate) struct ShardActor;

pub(crate) struct ShardState {
    region: Arc<Region>,
    shard: ShardId,
}

impl Actor for ShardActor {
    type Msg = ShardMsg;
    type State = ShardState;
    type Arguments = (Arc<Region>, ShardId);

    async fn pre_start(
        &self,
        _myself: ActorRef<ShardMsg>,
        (region, shard): (Arc<Region>, ShardId),
    ) -> Result<ShardState, ActorProcessingErr> {
        Ok(ShardState { region, shard })
    }

    async fn handle(
        &self,
        _myself: ActorRef<ShardMsg>,
        msg: ShardMsg,
        state: &mut ShardState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ShardMsg::Passivate {
                entity_id,
                incarnation,
            } => {
                if let Err(error) =
                    state
                        .region
                        .passivate(state.shard, &entity_id, Some(incarnation))
                {
                    tracing::warn!(%error, "passivation request dropped");
                }
            }
            ShardMsg::EntityStopped {
                entity_id,
                incarnation,
            } => {
                state
                    .region
                    .entity_stopped(state.shard, &entity_id, incarnation);
            }
        }
        Ok(())
    }
}
