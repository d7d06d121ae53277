//! The sharded system `--counter` hosts on the node: the counter entity
//! type (of `--counter-version`), or with `--journal-url` the journaled
//! (event-sourced) counter,
//! whose journal is connected before the node joins. Here the system starts
//! and registers its entity type.

use std::process::ExitCode;
#[cfg(feature = "postgres")]
use std::sync::atomic::Ordering;
use std::time::Instant;

use datum_cluster_sharding::cluster::ClusterNode;
use datum_cluster_sharding::{MigrationEvent, ShardedSystem};
#[cfg(feature = "postgres")]
use datum_cluster_sharding::{NoStore, persistence::PgPersistence};
use tokio::sync::broadcast;

use super::EXIT_START_FAILED;
use super::flags::Args;
use super::output::RegionLine;
use super::{counter, counter_v2};
#[cfg(feature = "postgres")]
use super::{journaled, journaled_v2};

/// Opens the `--journal-url` journal when `--counter` hosts the journaled
/// counter (none otherwise), after setting the `--handle-ms` delay of its
/// `Add` handler; on a failure, says why on stderr and gives exit code 1.
pub(super) async fn connect_journal(args: &Args) -> Result<Option<Journal>, ExitCode> {
    #[cfg(feature = "postgres")]
    journaled::ADD_DELAY_MS.store(args.handle_ms, Ordering::Relaxed);
    // The journal is connected before the node joins: a bad URL or an
    // unreachable database fails the start without a member to down.
    match open_journal(args.journal_url.as_deref().filter(|_| args.counter)).await {
        Ok(journal) => Ok(journal),
        Err(error) => {
            eprintln!("datum-node: cannot open the journal: {error}");
            Err(ExitCode::from(EXIT_START_FAILED))
        }
    }
}

/// With `--counter`: starts the sharded system hosting the counter type on
/// `node` (none without the flag), with a subscription to its migration
/// events taken before the type is registered; on a failure, says why on
/// stderr, crashes the node and gives exit code 1.
pub(super) async fn host_counter(
    args: &Args,
    node: &ClusterNode,
    journal: Option<Journal>,
) -> Result<Option<(Hosted, Migrations)>, ExitCode> {
    if args.counter {
        match Hosted::start(node, args.shards, args.counter_version, journal).await {
            Ok(system) => Ok(Some(system)),
            Err(error) => {
                eprintln!("datum-node: cannot start the counter's sharded system: {error}");
                node.crash().await;
                Err(ExitCode::from(EXIT_START_FAILED))
            }
        }
    } else {
        Ok(None)
    }
}

/// What became of the states that moved with the hosted type's shards.
pub(super) type Migrations = broadcast::Receiver<MigrationEvent>;

/// The sharded system `--counter` runs: the counter, or with
/// `--journal-url` the journaled counter (its system typed by its journal).
pub(super) enum Hosted {
    Counter(ShardedSystem),
    #[cfg(feature = "postgres")]
    Journaled(ShardedSystem<NoStore, PgPersistence>),
}

/// The `--journal-url` store.
#[cfg(feature = "postgres")]
pub(super) type Journal = PgPersistence;
/// Without the `postgres` feature there is none.
#[cfg(not(feature = "postgres"))]
pub(super) type Journal = std::convert::Infallible;

/// Connects the journal `url` names (none without a URL).
async fn open_journal(url: Option<&str>) -> Result<Option<Journal>, Box<dyn std::error::Error>> {
    let Some(url) = url else {
        return Ok(None);
    };
    #[cfg(feature = "postgres")]
    {
        // Connecting blocks (up to the store's connection timeout).
        let url = url.to_owned();
        let journal =
            tokio::task::spawn_blocking(move || PgPersistence::connect(&url, 4)).await??;
        Ok(Some(journal))
    }
    #[cfg(not(feature = "postgres"))]
    {
        let _ = url;
        Err("--journal-url needs a build with `--features postgres`".into())
    }
}

impl Hosted {
    /// Starts the system on `node` and registers its entity type: the
    /// journaled counter with a journal, else the counter of `version`.
    async fn start(
        node: &ClusterNode,
        shards: u32,
        version: u8,
        journal: Option<Journal>,
    ) -> Result<(Hosted, Migrations), Box<dyn std::error::Error>> {
        let builder = ShardedSystem::builder()
            .num_shards(shards)
            .node(node.clone());
        let Some(journal) = journal else {
            let system = builder.start().await?;
            let migrations = system.subscribe_migration_events();
            if version == 2 {
                system
                    .entity_type::<counter_v2::CounterV2Entity>()
                    .migratable()
                    .register(|_| Default::default())
                    .await?;
            } else {
                system
                    .entity_type::<counter::CounterEntity>()
                    .migratable()
                    .register(|_| Default::default())
                    .await?;
            }
            return Ok((Hosted::Counter(system), migrations));
        };
        #[cfg(feature = "postgres")]
        {
            let system = builder.journal(journal).start().await?;
            let migrations = system.subscribe_migration_events();
            if version == 2 {
                system
                    .entity_type::<journaled_v2::JournaledCounterV2Entity>()
                    .event_sourced()
                    .register(|_| Default::default())
                    .await?;
            } else {
                system
                    .entity_type::<journaled::JournaledCounterEntity>()
                    .event_sourced()
                    .register(|_| Default::default())
                    .await?;
            }
            Ok((Hosted::Journaled(system), migrations))
        }
        #[cfg(not(feature = "postgres"))]
        match journal {}
    }

    /// A line about the hosted type's region on this node.
    pub(super) fn region_line<'a>(&self, event: &'a str, started: Instant) -> RegionLine<'a> {
        match self {
            Hosted::Counter(system) => {
                RegionLine::of::<counter::Counter, _>(system, event, started)
            }
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) => {
                RegionLine::of::<journaled::JournaledCounter, _>(system, event, started)
            }
        }
    }

    pub(super) async fn shutdown(&self) {
        match self {
            Hosted::Counter(system) => system.shutdown().await,
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) => system.shutdown().await,
        }
    }
}
