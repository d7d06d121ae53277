//! The PostgreSQL store against a real, throwaway PostgreSQL server that
//! the test starts itself (the Debian package's `initdb` and `pg_ctl`, a
//! temporary directory, a free port on 127.0.0.1), stopped at the end.
//! Without the binaries the tests say so in one line and pass.
#![cfg(feature = "postgres")]

use std::time::Duration;

use datum_cluster_sharding::persistence::{
    Journal, PersistenceError, PersistenceId, PgPersistence, conformance,
};
use datum_cluster_sharding::prelude::*;

#[path = "../protocols/pg_server.rs"]
mod pg_server;
use pg_server::{Durability, Server};

/// A store on a fresh database of `server`.
fn store(server: &Server) -> PgPersistence {
    PgPersistence::connect(&server.database(), 4).expect("connect")
}

/// A test's server: fsync off (the tests check behaviour, not crash
/// safety); `None`, said in one line, without the package.
fn server() -> Option<Server> {
    Server::start(Durability::NoFsync)
}

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

#[derive(Default)]
struct TallyEntity {
    total: u64,
}

impl Entity for TallyEntity {
    type Protocol = Tally;
}

impl EventSourced for TallyEntity {
    type Event = u64;
    fn apply(&mut self, n: &u64) {
        self.total += n;
    }
}

impl Handler<Add> for TallyEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, msg.0).await?;
        Ok(self.total)
    }
}

impl Handler<Get> for TallyEntity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

const T: Duration = Duration::from_secs(10);

async fn system_on(store: PgPersistence) -> ShardedSystem<NoStore, PgPersistence> {
    let system = ShardedSystem::builder()
        .num_shards(8)
        .journal(store)
        .start()
        .await
        .expect("start");
    system
        .register_event_sourced::<TallyEntity>(|_| TallyEntity::default())
        .await
        .expect("register");
    system
}

#[test]
fn the_postgres_store_keeps_the_contract() {
    let Some(server) = server() else {
        return;
    };
    conformance::journal(|| store(&server));
    conformance::snapshots(|| store(&server));
    conformance::durable_state(|| store(&server));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_share_one_journal_on_postgres_and_never_fork_it() {
    let Some(server) = tokio::task::spawn_blocking(server).await.expect("start") else {
        return;
    };
    let url = server.database();
    let connect = |url: String| async move {
        tokio::task::spawn_blocking(move || PgPersistence::connect(&url, 4))
            .await
            .expect("connect")
            .expect("connect")
    };
    // Two systems, each with its own pool, as two nodes would have.
    let a = system_on(connect(url.clone()).await).await;
    let b = system_on(connect(url.clone()).await).await;
    let (at_a, at_b) = (a.entity_ref::<Tally>("x"), b.entity_ref::<Tally>("x"));
    assert_eq!(at_a.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_b.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_a.ask(Add(1), T).await.expect("a writes"), 1);
    match at_b.ask(Add(5), T).await {
        Err(ShardingError::Persistence { error, .. }) => assert!(
            matches!(
                *error,
                PersistenceError::SequenceConflict {
                    expected: 0,
                    actual: 1,
                    ..
                }
            ),
            "{error}"
        ),
        other => panic!("a stale write: {other:?}"),
    }
    a.shutdown().await;
    b.shutdown().await;
    // A new node on the same database recovers the one history.
    let c = system_on(connect(url).await).await;
    assert_eq!(
        c.entity_ref::<Tally>("x").ask(Get, T).await.expect("get"),
        1
    );
    let id = PersistenceId::new("tally", "x");
    let journal = c.journal().clone();
    let events = tokio::task::spawn_blocking(move || journal.replay(&id, 1, u64::MAX, 10))
        .await
        .expect("replay")
        .expect("replay");
    assert_eq!(
        events.iter().map(|e| e.sequence_nr).collect::<Vec<_>>(),
        [1]
    );
    c.shutdown().await;
    drop(server);
}
