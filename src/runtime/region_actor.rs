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

use crate::entity::MigrationEvent;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::dispatch::panic_message;
use crate::runtime::mailbox::{RegionMsg, States};
use crate::runtime::region::{HostStep, HostWord, Preparing, Region};

pub(crate) struct RegionActor;

/// How many remembered shards' ids are read from the store at once (a
/// rebalance that brings many shards here does not start as many reads).
const CONCURRENT_READS: usize = 16;

pub(crate) struct RegionActorState {
    region: Arc<Region>,
    reads: Arc<tokio::sync::Semaphore>,
    /// Shard hostings being prepared off this actor (a store read, states
    /// fetched from the old owner).
    preparing: Preparing,
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
            preparing: Preparing::default(),
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
        let handled =
            std::panic::catch_unwind(AssertUnwindSafe(|| handle(myself, msg, &mut *state)));
        if let Err(payload) = handled {
            let panic = panic_message(payload.as_ref());
            tracing::error!(type_name = state.region.type_name, %panic, "a panic while handling a region message (user Drop code?); the region goes on");
        }
        Ok(())
    }
}

fn handle(myself: ActorRef<RegionMsg>, msg: RegionMsg, state: &mut RegionActorState) {
    let region = state.region.clone();
    match msg {
        RegionMsg::Allocate(shard) => read_then_install(myself, state, shard, 0, None),
        RegionMsg::Host {
            shard,
            generation,
            from,
        } => read_then_install(myself, state, shard, generation, from),
        RegionMsg::Install {
            shard,
            generation,
            remembered,
            migrated,
            fetched,
        } => {
            state.preparing.done(shard, generation);
            let entities = migrated.len();
            let installed = region.install_local(shard, generation, remembered, migrated);
            if let Some((from, bytes)) = fetched {
                let type_name = region.type_name;
                if installed {
                    region.migration_event(MigrationEvent::Received {
                        type_name,
                        shard,
                        from,
                        entities,
                        bytes,
                    });
                } else {
                    tracing::warn!(type_name, %shard, %from, entities, "migrated states fetched for a hosting that did not start (a newer home came meanwhile): dropped");
                    region.migration_event(MigrationEvent::FellBack {
                        type_name,
                        shard,
                        from: Some(from),
                        reason: "the states came for a hosting that did not start (a newer home came meanwhile)".into(),
                    });
                }
            }
        }
        RegionMsg::ExpireMigration { shard, generation } => {
            region.expire_migration(shard, generation);
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
            state,
        } => region.entity_stopped(shard, &entity_id, incarnation, state),
    }
}

/// Reads a shard's remembered ids off every shard lock and off the
/// runtime's worker threads (a file store may load and fsync a log), and
/// fetches the states its entities handed over from `from` (its old owner,
/// for a migratable type), on a task of its own (at most
/// `CONCURRENT_READS` reads at once), so that this actor goes on hearing
/// stop notices meanwhile; then has this actor install the shard. Messages
/// for the shard wait in its slot meanwhile.
fn read_then_install(
    myself: ActorRef<RegionMsg>,
    state: &mut RegionActorState,
    shard: ShardId,
    generation: u64,
    from: Option<UniqueAddress>,
) {
    let region = &state.region;
    let word = HostWord {
        shard,
        generation,
        from,
        migrates: region.migration_timeout().is_some(),
        remembers: region.remember().is_some(),
    };
    let (prepare, without_handoff) = state.preparing.begin(region.table(), word);
    if without_handoff {
        region.migration_event(MigrationEvent::FellBack {
            type_name: region.type_name,
            shard,
            from: None,
            reason:
                "the shard moved without a handoff (its owner was lost, or its handoff timed out)"
                    .into(),
        });
    }
    let fetch = match prepare {
        HostStep::Nothing => return,
        HostStep::InstallNow => {
            region.install_local(shard, generation, None, Vec::new());
            return;
        }
        HostStep::Prepare { fetch } => fetch.zip(region.migration_timeout()),
    };
    let region = region.clone();
    let reads = state.reads.clone();
    tokio::spawn(async move {
        let (migrated, fetched) = match fetch {
            None => (Vec::new(), None),
            Some((from, timeout)) => fetch_states(&region, shard, generation, from, timeout).await,
        };
        let remembered = if region.remember().is_some() {
            let Ok(_permit) = reads.acquire_owned().await else {
                return;
            };
            let reader = region.clone();
            tokio::task::spawn_blocking(move || reader.remembered_ids(shard))
                .await
                .unwrap_or(None)
        } else {
            None
        };
        let _ = myself.cast(RegionMsg::Install {
            shard,
            generation,
            remembered,
            migrated,
            fetched,
        });
    });
}

/// The states `shard`'s entities handed over on `from`, fetched through the
/// region's port, with where they came from and their size; none (and an
/// event saying why) when they do not come. A state for an id of another
/// shard is dropped.
async fn fetch_states(
    region: &Region,
    shard: ShardId,
    generation: u64,
    from: UniqueAddress,
    timeout: std::time::Duration,
) -> (States, Option<(UniqueAddress, usize)>) {
    let Some(port) = region.port() else {
        return (Vec::new(), None);
    };
    let type_name = region.type_name;
    match port
        .fetch_states(type_name, shard, generation, from, timeout)
        .await
    {
        Ok(mut states) => {
            states.retain(|(id, _)| {
                let here = (region.extract)(id, region.num_shards()) == shard;
                if !here {
                    tracing::warn!(type_name, %shard, %from, entity_id = %id, "a migrated state for an entity of another shard: dropped");
                }
                here
            });
            let bytes = states.iter().map(|(_, s)| s.bytes.len()).sum();
            (states, Some((from, bytes)))
        }
        Err(reason) => {
            tracing::warn!(type_name, %shard, %from, %reason, "migrated states did not come; the shard's entities start from their factory");
            region.migration_event(MigrationEvent::FellBack {
                type_name,
                shard,
                from: Some(from),
                reason,
            });
            (Vec::new(), None)
        }
    }
}
