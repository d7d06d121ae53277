//! The region's actor: starts the shards hosted on this node. On a single
//! node every shard is allocated here, on first use; in a cluster the
//! coordinator decides, and this actor starts the shards it gives this node.

use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::extractor::ShardId;
use crate::runtime::region::Region;
use crate::runtime::shard_actor::ShardActor;

/// What a region actor receives.
#[derive(Debug)]
pub(crate) enum RegionMsg {
    /// A shard has buffered messages and no home: allocate it here (single node).
    Allocate(ShardId),
    /// The coordinator made this node the shard's home under `generation`.
    Host(ShardId, u64),
    /// Respawn the next remembered ids of a shard (a bounded-rate
    /// recovery), if it is still the same hosting of it.
    Respawn { shard: ShardId, install: u64 },
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
        let (shard, generation) = match msg {
            RegionMsg::Allocate(shard) => (shard, 0),
            RegionMsg::Host(shard, generation) => (shard, generation),
            RegionMsg::Respawn { shard, install } => {
                region.respawn_more(shard, install);
                return Ok(());
            }
        };
        if region.is_stopped() {
            return Ok(());
        }
        // The store is read here, off every shard lock and off the runtime's
        // worker threads (a file store may load and fsync a log), and before
        // the shard actor exists: if this actor is killed at an await (a
        // system dropped without shutdown), no shard actor is left that
        // nobody installed or stops.
        let reader = region.clone();
        let remembered = tokio::task::spawn_blocking(move || reader.remembered_ids(shard))
            .await
            .unwrap_or(None);
        // A shard actor that cannot be spawned must not end this actor (every
        // later shard of the region would wait for it): the shard stays
        // unallocated here and its next message asks again.
        let shard_actor = match ShardActor::spawn(None, ShardActor, (region.clone(), shard)).await {
            Ok((actor, _)) => actor,
            Err(error) => {
                tracing::error!(type_name = region.type_name, %shard, %error, "could not start a shard actor");
                region.allocation_failed(shard);
                return Ok(());
            }
        };
        // No await from here to the install: it happens, or the actor stops.
        if !region.install_local(shard, shard_actor.clone(), generation, remembered) {
            shard_actor.stop(None);
        }
        Ok(())
    }
}
