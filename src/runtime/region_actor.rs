//! The region's actor: decides where shards live. On a single node every
//! shard is allocated here, on first use; in a cluster this is where the
//! coordinator's answer arrives.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::extractor::ShardId;
use crate::runtime::region::Region;
use crate::runtime::shard_actor::ShardActor;

/// What a region actor receives.
#[derive(Debug)]
pub(crate) enum RegionMsg {
    /// A shard has buffered messages and no home: allocate it.
    Allocate(ShardId),
}

pub(crate) struct RegionActor;

impl Actor for RegionActor {
    type Msg = RegionMsg;
    type State = Arc<Region>;
    type Arguments = Arc<Region>;

    async fn pre_start(
        &self,
        _myself: ActorRef<RegionMsg>,
        region: Arc<Region>,
    ) -> Result<Arc<Region>, ActorProcessingErr> {
        Ok(region)
    }

    async fn handle(
        &self,
        _myself: ActorRef<RegionMsg>,
        msg: RegionMsg,
        region: &mut Arc<Region>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RegionMsg::Allocate(shard) => {
                if region.is_stopped() {
                    return Ok(());
                }
                let (shard_actor, _) =
                    ShardActor::spawn(None, ShardActor, (region.clone(), shard)).await?;
                if !region.install_local(shard, shard_actor.clone()) {
                    shard_actor.stop(None);
                }
            }
        }
        Ok(())
    }
}
