//! The PostgreSQL store against a real, throwaway PostgreSQL server that
//! the test starts itself (the Debian package's `initdb` and `pg_ctl`, a
//! temporary directory, a free port on 127.0.0.1), stopped at the end.
//! Without the binaries the tests say so in one line and pass.
#![cfg(feature = "postgres")]

use std::time::Duration;

use datum_cluster_sharding::persistence::{
    Journal, PG_CONNECTION_TIMEOUT, PersistenceError, PersistenceId, PgPersistence, conformance,
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

protocol! {
    /// A counter whose total is saved whole, as a durable state.
    pub protocol StateTally = "state-tally" {
        ask Add -> u64;
    }
}

#[derive(Default)]
struct StateTallyEntity {
    total: u64,
}

impl Entity for StateTallyEntity {
    type Protocol = StateTally;
}

impl DurableState for StateTallyEntity {
    type State = u64;
    fn state(&self) -> &u64 {
        &self.total
    }
    fn set_state(&mut self, total: u64) {
        self.total = total;
    }
}

impl Handler<Add> for StateTallyEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.total += msg.0;
        self.save_state(ctx).await?;
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
        .entity_type::<TallyEntity>()
        .event_sourced()
        .register(|_| TallyEntity::default())
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
    conformance::remember_entities(|| store(&server));
}

#[path = "../protocols/evolving.rs"]
mod evolving;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_1_records_read_under_version_2_on_postgres() {
    let Some(server) = server() else {
        return;
    };
    let url = server.database();
    evolving::version_1_records_read_under_version_2(|| {
        PgPersistence::connect(&url, 4).expect("connect")
    })
    .await;
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

/// Four threads append batches to ten shared ids in orders of their own,
/// each expecting what it last read, as nodes whose entities race would:
/// the database serializes them (no deadlock, no fork) and every accepted
/// write is there, once, numbered without a gap.
#[test]
fn concurrent_batches_on_shared_ids_neither_deadlock_nor_fork() {
    use datum_cluster_sharding::persistence::{AtomicWrite, Payload, Writer};
    let Some(server) = server() else {
        return;
    };
    let url = server.database();
    const IDS: u64 = 10;
    let pid = |k: u64| PersistenceId::new("race", k.to_string());
    let accepted: u64 = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4u64)
            .map(|node| {
                let url = url.clone();
                scope.spawn(move || {
                    let store = PgPersistence::connect(&url, 1).expect("connect");
                    let mut accepted = 0u64;
                    for round in 0..100u64 {
                        // Every thread walks the ids in its own rotation,
                        // half of them backwards.
                        let mut ids: Vec<u64> =
                            (0..IDS).map(|i| (i + node + round) % IDS).collect();
                        if node % 2 == 1 {
                            ids.reverse();
                        }
                        let batch: Vec<AtomicWrite> = ids[..4]
                            .iter()
                            .map(|&k| AtomicWrite {
                                persistence_id: pid(k),
                                expected: store.highest_sequence_nr(&pid(k)).expect("highest"),
                                events: vec![Payload {
                                    manifest: "race".into(),
                                    version: 1,
                                    bytes: vec![node as u8],
                                }],
                                writer: Writer {
                                    node_id: node,
                                    incarnation: 1,
                                    generation: round,
                                },
                            })
                            .collect();
                        for result in store.append(&batch) {
                            match result {
                                Ok(()) => accepted += 1,
                                Err(PersistenceError::SequenceConflict { .. }) => {}
                                Err(other) => panic!("only a conflict may refuse: {other}"),
                            }
                        }
                    }
                    accepted
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a thread"))
            .sum()
    });
    let store = store_on(&url);
    let mut journaled = 0;
    for k in 0..IDS {
        let events = store
            .replay(&pid(k), 1, u64::MAX, usize::MAX)
            .expect("replay");
        let numbers: Vec<u64> = events.iter().map(|e| e.sequence_nr).collect();
        let want: Vec<u64> = (1..=events.len() as u64).collect();
        assert_eq!(numbers, want, "id {k}: gap-free");
        assert_eq!(
            store.highest_sequence_nr(&pid(k)).expect("highest"),
            events.len() as u64
        );
        journaled += events.len() as u64;
    }
    assert_eq!(journaled, accepted, "every accepted write, once");
    assert!(accepted > 0);
}

fn store_on(url: &str) -> PgPersistence {
    PgPersistence::connect(url, 2).expect("connect")
}

/// The two sides of a split brain on the database at `url`: systems that
/// do not know each other (each the whole cluster in its own eyes), a pool
/// each.
async fn two_sides(url: &str) -> Vec<ShardedSystem<NoStore, PgPersistence>> {
    let mut sides = Vec::new();
    for _ in 0..2 {
        let url = url.to_owned();
        let store = tokio::task::spawn_blocking(move || store_on(&url))
            .await
            .expect("connect");
        sides.push(system_on(store).await);
    }
    sides
}

/// The database goes away under a durable entity and comes back: while it
/// is away an ask fails with a typed persistence error within its timeout;
/// nothing acknowledged is lost; once it is back the entity recovers its
/// whole history and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_going_away_fails_asks_typed_and_loses_nothing() {
    let Some(server) = tokio::task::spawn_blocking(server).await.expect("start") else {
        return;
    };
    let url = server.database();
    let store = tokio::task::spawn_blocking(move || store_on(&url))
        .await
        .expect("connect");
    let system = system_on(store).await;
    let x = system.entity_ref::<Tally>("x");
    for n in 1..=5 {
        assert_eq!(x.ask(Add(1), T).await.expect("acked"), n);
    }

    let server = std::sync::Arc::new(server);
    let halted = server.clone();
    tokio::task::spawn_blocking(move || halted.halt())
        .await
        .expect("halt");
    let asked = std::time::Instant::now();
    match x.ask(Add(1), T).await {
        Err(ShardingError::Persistence { error, .. }) => {
            assert!(matches!(*error, PersistenceError::Store(_)), "{error}")
        }
        other => panic!("an ask while the database is away: {other:?}"),
    }
    assert!(asked.elapsed() < T, "within the ask's timeout");

    let resumed = server.clone();
    tokio::task::spawn_blocking(move || resumed.resume())
        .await
        .expect("resume");
    // The entity was retired by the failure; the next ask recovers it
    // from the journal (the pool reconnecting first).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let total = loop {
        match x.ask(Get, T).await {
            Ok(total) => break total,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no recovery after the database came back: {e}"),
        }
    };
    let id = PersistenceId::new("tally", "x");
    let journal = system.journal().clone();
    let events = tokio::task::spawn_blocking(move || journal.replay(&id, 1, u64::MAX, 100))
        .await
        .expect("replay")
        .expect("replay");
    assert!(total >= 5, "nothing acknowledged is lost: {total}");
    assert_eq!(total, events.len() as u64, "the state is its journal");
    assert_eq!(x.ask(Add(1), T).await.expect("goes on"), total + 1);
    system.shutdown().await;
}

#[path = "../protocols/remembered_kill.rs"]
mod remembered_kill;

#[path = "../protocols/writers.rs"]
mod writers;

/// Remember-entities on PostgreSQL, which the nodes share (a pool each, as
/// separate processes would have): after a node dies, each id it hosted is
/// respawned by the survivor its shard lands on, with no message sent —
/// what a per-node file cannot do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_ids_of_a_dead_node_come_back_on_the_survivors() {
    let Some(server) = tokio::task::spawn_blocking(server).await.expect("start") else {
        return;
    };
    let url = server.database();
    let stores = tokio::task::spawn_blocking(move || [(); 3].map(|()| store_on(&url)))
        .await
        .expect("connect");
    remembered_kill::remembered_ids_come_back_after_a_kill(stores).await;
}

/// A split brain on one journal: two systems that do not know each other
/// (each the whole cluster in its own eyes) host the same entities and
/// write them at once. The database's fencing refuses every stale append
/// (the asker gets a typed `SequenceConflict`, the stale incarnation
/// retires and recovers on its next message): after it, every journal is
/// gap-free, every acknowledged add is in it, and what each side's
/// entities hold is their journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_brain_on_one_journal_never_forks_it() {
    let Some(server) = tokio::task::spawn_blocking(server).await.expect("start") else {
        return;
    };
    let url = server.database();
    let sides = two_sides(&url).await;
    const ENTITIES: usize = 10;
    const ADDS: usize = 60;
    let mut drivers = tokio::task::JoinSet::new();
    for (side, system) in sides.iter().enumerate() {
        for k in 0..ENTITIES {
            let entity = system.entity_ref::<Tally>(format!("e{k}"));
            drivers.spawn(async move {
                let (mut acked, mut conflicts) = (0u64, 0u64);
                for _ in 0..ADDS {
                    match entity.ask(Add(1), T).await {
                        Ok(_) => acked += 1,
                        Err(ShardingError::Persistence { error, .. }) => {
                            assert!(
                                matches!(*error, PersistenceError::SequenceConflict { .. }),
                                "side {side}: only a conflict may refuse: {error}"
                            );
                            conflicts += 1;
                        }
                        Err(other) => panic!("side {side}: {other:?}"),
                    }
                }
                (k, acked, conflicts)
            });
        }
    }
    let mut acked = [0u64; ENTITIES];
    let mut conflicts = 0;
    while let Some(done) = drivers.join_next().await {
        let (k, a, c) = done.expect("a driver");
        acked[k] += a;
        conflicts += c;
    }
    assert!(conflicts > 0, "the two sides did race");
    let journal = sides[0].journal().clone();
    for (k, acked) in acked.iter().enumerate() {
        let journaled = writers::journaled::<Tally, _>(&journal, &format!("e{k}")).await;
        assert_eq!(journaled, *acked, "e{k}: every acked add, once");
        for side in &sides {
            let total = side.entity_ref::<Tally>(format!("e{k}")).ask(Get, T).await;
            // A side whose incarnation is stale learns it on its next
            // append, not on a read: its total is at most the journal's.
            let total = total.expect("get");
            assert!(total <= *acked, "e{k}: {total} > {acked}");
        }
    }
    for side in &sides {
        side.shutdown().await;
    }
    // A fresh system recovers exactly the journal.
    let store = tokio::task::spawn_blocking(move || store_on(&url))
        .await
        .expect("connect");
    let fresh = system_on(store).await;
    for (k, acked) in acked.iter().enumerate() {
        let total = fresh
            .entity_ref::<Tally>(format!("e{k}"))
            .ask(Get, T)
            .await
            .expect("get");
        assert_eq!(total, *acked, "e{k}: recovered");
    }
    fresh.shutdown().await;
}

/// Text PostgreSQL cannot hold (a NUL byte in an id) fails that write
/// alone, typed; the writes batched with it go on.
#[test]
fn an_unstorable_id_fails_alone() {
    use datum_cluster_sharding::persistence::{AtomicWrite, Payload, Writer};
    use datum_cluster_sharding::{RememberEntitiesStore, RememberRecord, ShardId};
    let Some(server) = server() else {
        return;
    };
    let store = store(&server);
    let write = |entity: &str| AtomicWrite {
        persistence_id: PersistenceId::new("nul", entity),
        expected: 0,
        events: vec![Payload {
            manifest: "nul".into(),
            version: 1,
            bytes: vec![1],
        }],
        writer: Writer {
            node_id: 1,
            incarnation: 1,
            generation: 1,
        },
    };
    let results = store.append(&[write("bad\0id"), write("good")]);
    assert!(
        matches!(results[0], Err(PersistenceError::Invalid(_))),
        "{results:?}"
    );
    assert_eq!(results[1], Ok(()));
    assert_eq!(
        store.highest_sequence_nr(&PersistenceId::new("nul", "good")),
        Ok(1)
    );
    let record = |entity_id| RememberRecord {
        type_name: "nul",
        shard_id: ShardId(1),
        entity_id,
        started: true,
    };
    let results = store.record_batch(&[record("bad\0id"), record("good")]);
    assert!(results[0].is_err() && results[1].is_ok(), "{results:?}");
    assert_eq!(
        store.list_entities_for_shard("nul", ShardId(1)),
        Ok(vec!["good".to_owned()])
    );
}

/// A connection the server refuses fails `connect` with the server's own
/// reason, not the client's bare "db error".
#[test]
fn a_refused_connection_says_why() {
    let Some(server) = server() else {
        return;
    };
    let url = server.database().replace("dbname=", "dbname=missing_");
    let Err(error) = PgPersistence::connect(&url, 1) else {
        panic!("connected to a database that does not exist");
    };
    let text = error.to_string();
    assert!(text.contains("does not exist"), "{text}");
}

/// An ask and how long its answer took.
async fn timed<R>(
    ask: impl std::future::Future<Output = ShardingResult<R>>,
) -> (ShardingResult<R>, Duration) {
    let asked = std::time::Instant::now();
    let answer = ask.await;
    (answer, asked.elapsed())
}

/// The database stopped: an ask whose timeout is shorter than the store's
/// wait for a connection (`PG_CONNECTION_TIMEOUT`) still gets the store's
/// typed error, before its timeout, whichever write it causes — an append,
/// an append queued behind another stuck on the store, a durable state's
/// save — since the ask's deadline bounds them: `Unavailable`, nothing
/// written. (Bounded by the connection wait alone, each would answer
/// `AskTimeout`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_database_away_an_ask_hears_the_store_before_its_timeout() {
    const SHORT: Duration = Duration::from_secs(3);
    const LONGER: Duration = Duration::from_millis(4_500);
    assert!(LONGER < PG_CONNECTION_TIMEOUT);
    let Some(server) = tokio::task::spawn_blocking(server).await.expect("start") else {
        return;
    };
    let url = server.database();
    let store = tokio::task::spawn_blocking(move || store_on(&url))
        .await
        .expect("connect");
    let system = system_on(store).await;
    system
        .entity_type::<StateTallyEntity>()
        .durable_state()
        .register(|_| StateTallyEntity::default())
        .await
        .expect("register");
    let stuck = system.entity_ref::<Tally>("stuck");
    let queued = system.entity_ref::<Tally>("queued");
    let saves = system.entity_ref::<StateTally>("saves");
    assert_eq!(stuck.ask(Add(1), T).await.expect("appended"), 1);
    assert_eq!(queued.ask(Add(1), T).await.expect("appended"), 1);
    assert_eq!(saves.ask(Add(1), T).await.expect("saved"), 1);

    let server = std::sync::Arc::new(server);
    let halted = server.clone();
    tokio::task::spawn_blocking(move || halted.halt())
        .await
        .expect("halt");
    let (stuck_append, queued_append, saved) = tokio::join!(
        // Its batch holds the journal's writer while it waits for a
        // connection...
        timed(stuck.ask(Add(1), LONGER)),
        // ...so this append waits behind it, past its own deadline.
        async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            timed(queued.ask(Add(1), SHORT)).await
        },
        timed(saves.ask(Add(1), SHORT)),
    );
    for (what, (answer, took), timeout) in [
        ("an append", stuck_append, LONGER),
        ("an append queued behind it", queued_append, SHORT),
        ("a save", saved, SHORT),
    ] {
        // Each was cut short before the store took it: nothing written,
        // and the error says so.
        match answer {
            Err(ShardingError::Persistence { error, .. }) => {
                assert!(
                    matches!(*error, PersistenceError::Unavailable(_)),
                    "{what}: {error}"
                )
            }
            other => panic!("{what} with the database away, after {took:?}: {other:?}"),
        }
        assert!(took < timeout, "{what}: answered after {took:?}");
    }
    system.shutdown().await;
}

/// Two systems that do not know each other share one journal and host the
/// same entities, each through several askers that send each add again at
/// once until it is accepted (a split brain under load). A write refused
/// as stale costs its own ask: the incarnation is replaced in place after
/// a pause, and the messages behind it wait and are then handled on the
/// other writer's history — not answered with a conflict they did not
/// meet. So conflicts stay below three per accepted write (at most one:
/// each follows an accepted write of the other side); an incarnation that
/// answered every message with the conflict until it was passivated made
/// tens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_losing_second_writer_does_not_storm() {
    let Some(server) = tokio::task::spawn_blocking(server).await.expect("start") else {
        return;
    };
    let url = server.database();
    let sides = two_sides(&url).await;
    // (Generous: the last of ten askers waits out up to ten pauses and
    // recoveries on a busy machine.)
    writers::second_writers_race::<Tally, _>(&sides, Add, 3 * T).await;
    for side in &sides {
        side.shutdown().await;
    }
}
