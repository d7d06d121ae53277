//! The region's actor: starts the shards hosted on this node, and hears
//! its entities' passivation requests and stop notices. On a single node
//! every shard is allocated here, on first use; in a cluster the
//! coordinator decides, and this actor starts the shards it gives this node.
//!
//! It lives as long as the region, so an entity's stop notice reaches the
//! region even when the entity's shard has moved away meanwhile (the slot
//! holds back a next incarnation of that entity until it has).

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::extractor::ShardId;
use crate::runtime::mailbox::RegionMsg;
use crate::runtime::region::Region;

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
        myself: ActorRef<RegionMsg>,
        msg: RegionMsg,
        region: &mut Arc<Region>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            RegionMsg::Allocate(shard) => read_then_install(myself, region, shard, 0),
            RegionMsg::Host(shard, generation) => {
                read_then_install(myself, region, shard, generation)
            }
            RegionMsg::Install {
                shard,
                generation,
                remembered,
            } => {
                if !region.is_stopped() {
                    region.install_local(shard, generation, remembered);
                }
            }
            RegionMsg::Respawn { shard, install } => region.respawn_more(shard, install),
            RegionMsg::Passivate {
                shard,
                entity_id,
                incarnation,
            } => {
                if let Err(error) = region.passivate(shard, &entity_id, Some(incarnation)) {
                    tracing::warn!(%error, "passivation request dropped");
                }
            }
            RegionMsg::EntityStopped {
                shard,
                entity_id,
                incarnation,
            } => region.entity_stopped(shard, &entity_id, incarnation),
        }
        Ok(())
    }
}

/// Reads a shard's remembered ids off every shard lock and off the
/// runtime's worker threads (a file store may load and fsync a log), on a
/// task of its own, so that this actor goes on hearing stop notices
/// meanwhile; then has this actor install the shard.
fn read_then_install(
    myself: ActorRef<RegionMsg>,
    region: &Arc<Region>,
    shard: ShardId,
    generation: u64,
) {
    if region.is_stopped() {
        return;
    }
    if region.remember_queue().is_none() {
        region.install_local(shard, generation, None);
        return;
    }
    let reader = region.clone();
    tokio::spawn(async move {
        let remembered = tokio::task::spawn_blocking(move || reader.remembered_ids(shard))
            .await
            .unwrap_or(None);
        let _ = myself.cast(RegionMsg::Install {
            shard,
            generation,
            remembered,
        });
    });
}
