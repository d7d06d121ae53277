//! A durable counter: each run adds to it, and the next run of the process
//! finds the total the last one left (its events are in an embedded redb
//! file, recovered before the entity's first message).
//!
//! Run it twice: `cargo run --example durable_counter` (the store lives
//! in `$TMPDIR/datum-durable-counter.redb`; `-- --path FILE` for another).

use std::time::Duration;

use datum_cluster_sharding::persistence::RedbPersistence;
use datum_cluster_sharding::prelude::*;

#[derive(Serialize, Deserialize)]
pub struct Add(pub u64);
#[derive(Serialize, Deserialize)]
pub struct Get;

protocol! {
    /// A counter whose additions are journaled.
    pub protocol Tally = "tally" {
        ask Add -> u64;
        ask Get -> u64;
    }
}

/// What happened to a tally.
#[derive(Serialize, Deserialize)]
pub enum Added {
    By(u64),
}

#[derive(Default)]
struct TallyEntity {
    total: u64,
}

impl Entity for TallyEntity {
    type Protocol = Tally;
}

impl EventSourced for TallyEntity {
    type Event = Added;
    fn apply(&mut self, event: &Added) {
        let Added::By(n) = event;
        self.total += n;
    }
}

impl Handler<Add> for TallyEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, Added::By(msg.0)).await?; // durable, then applied
        Ok(self.total)
    }
}

impl Handler<Get> for TallyEntity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = match std::env::args().skip_while(|a| a != "--path").nth(1) {
        Some(path) => path.into(),
        None => std::env::temp_dir().join("datum-durable-counter.redb"),
    };
    let system = ShardedSystem::builder()
        .num_shards(64)
        .journal(RedbPersistence::open(&path)?)
        .start()
        .await?;
    system
        .entity_type::<TallyEntity>()
        .event_sourced()
        .register(|_ctx| TallyEntity::default())
        .await?;
    let visits = system.entity_ref::<Tally>("visits");
    let before = visits.ask(Get, Duration::from_secs(5)).await?;
    let after = visits.ask(Add(1), Duration::from_secs(5)).await?;
    println!(
        "visits: {before} before this run, {after} now (journal: {})",
        path.display()
    );
    assert_eq!(after, before + 1);
    system.shutdown().await;
    Ok(())
}
