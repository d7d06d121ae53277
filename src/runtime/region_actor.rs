//! The region's actor: starts the shards hosted on this node, and hears
//! its entities' passivation requests and stop notices. On a single node
//! every shard is allocated here, on first use; in a cluster the
//! coordinator decides, and this actor starts the shards it gives this node.
//!
//! It lives as long as the region, so an entity's stop notice reaches the
//! region even when the entity's shard has moved away meanwhile (the slot
//! holds back a next incarnation of that entity until it has).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::dispatch::panic_message;
use crate::extractor::ShardId;
use crate::runtime::mailbox::RegionMsg;
use crate::runtime::region::Region;

pub(crate) struct RegionActor;

/// How many remembered shards' ids are read from the store at once (a
/// rebalance that brings many shards here does not start as many reads).
const CONCURRENT_READS: usize = 16;

pub(crate) struct RegionActorState {
    region: Arc<Region>,
    reads: Arc<tokio::sync::Semaphore>,
}

impl Actor for RegionActor {
    type Msg = RegionMsg;
    type State = RegionActorState;
    type Arguments = Arc<Region>;

    async fn pre_start(
        &self,
        _myself: ActorRef<RegionMsg>,
        region: Arc<Region>,
    ) -> Result<RegionActorState, ActorProcessingErr> {
        Ok(RegionActorState {
            region,
            reads: Arc::new(tokio::sync::Semaphore::new(CONCURRENT_READS)),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<RegionMsg>,
        msg: RegionMsg,
        state: &mut RegionActorState,
    ) -> Result<(), ActorProcessingErr> {
        // This actor carries every shard's notices: a panic while handling
        // one (an answered envelope's value runs user `Drop` code) must not
        // end it, or the region's later notices would all be lost.
        let handled = std::panic::catch_unwind(AssertUnwindSafe(|| handle(myself, msg, state)));
        if let Err(payload) = handled {
            let panic = panic_message(payload.as_ref());
            tracing::error!(type_name = state.region.type_name, %panic, "a panic while handling a region message (user Drop code?); the region goes on");
        }
        Ok(())
    }
}

fn handle(myself: ActorRef<RegionMsg>, msg: RegionMsg, state: &RegionActorState) {
    let region = &state.region;
    match msg {
        RegionMsg::Allocate(shard) => read_then_install(myself, state, shard, 0),
        RegionMsg::Host(shard, generation) => read_then_install(myself, state, shard, generation),
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
            idle,
        } => {
            if let Err(error) = region.passivate_incarnation(shard, &entity_id, incarnation, idle) {
                tracing::warn!(%error, "passivation request dropped");
            }
        }
        RegionMsg::EntityStopped {
            shard,
            entity_id,
            incarnation,
        } => region.entity_stopped(shard, &entity_id, incarnation),
    }
}

/// Reads a shard's remembered ids off every shard lock and off the
/// runtime's worker threads (a file store may load and fsync a log), on a
/// task of its own (at most `CONCURRENT_READS` at once), so that this actor
/// goes on hearing stop notices meanwhile; then has this actor install the
/// shard.
fn read_then_install(
    myself: ActorRef<RegionMsg>,
    state: &RegionActorState,
    shard: ShardId,
    generation: u64,
) {
    let region = &state.region;
    if region.is_stopped() {
        return;
    }
    if region.remember().is_none() {
        region.install_local(shard, generation, None);
        return;
    }
    let reader = region.clone();
    let reads = state.reads.clone();
    tokio::spawn(async move {
        let Ok(_permit) = reads.acquire_owned().await else {
            return;
        };
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
