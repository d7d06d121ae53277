//! The raw limits of the embedded stores a durable journal could sit on:
//! on `writers` threads, batches of `batch` one-event appends, each append
//! checked against its persistence id's highest sequence number and the
//! batch made durable by one synced commit — what the journal's writer
//! asks of a store. Ids take turns over 1,000 entities; each writer has
//! its own ids (as a commit lane does), so no two writers touch one id.
//!
//! Prints one line per (candidate, layout, writers): events/s, CPU per
//! event (the process's user + system time), and the p50 / p99 of a
//! batch's commit. Count syncs per event by running it under
//! `strace -f -c -e trace=fsync,fdatasync`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datum_cluster_sharding::persistence::{
    AtomicWrite, Journal, Payload, PersistenceId, RedbPersistence, Writer,
};

const ENTITIES: usize = 1_000;
/// An event's bytes: about what W4's ping event is.
const EVENT: [u8; 24] = [7; 24];

/// One writer's work: `batches` batches over its `ids`.
trait Append: Send + Sync {
    /// Appends one event to each of `ids` (their highest numbers checked
    /// and raised), durably, in one commit.
    fn append(&self, ids: &[PersistenceId]);
}

/// The crate's embedded store: `append` reads each id's highest number in
/// its write transaction and refuses a stale one; the expected numbers
/// come from memory, as an entity knows its own.
struct Redb(
    RedbPersistence,
    std::sync::Mutex<std::collections::HashMap<PersistenceId, u64>>,
);

impl Redb {
    fn new(store: RedbPersistence) -> Redb {
        Redb(store, Default::default())
    }
}

impl Append for Redb {
    fn append(&self, ids: &[PersistenceId]) {
        let mut known = self.1.lock().expect("lock");
        let writes: Vec<AtomicWrite> = ids
            .iter()
            .map(|id| AtomicWrite {
                persistence_id: id.clone(),
                expected: {
                    let n = known.entry(id.clone()).or_default();
                    *n += 1;
                    *n - 1
                },
                events: vec![Payload {
                    manifest: "ping".into(),
                    version: 1,
                    bytes: EVENT.to_vec(),
                }],
                writer: Writer::default(),
            })
            .collect();
        for result in self.0.append(&writes) {
            result.expect("append");
        }
    }
}

/// fjall: an LSM tree whose commits append to one journal file; a batch
/// is atomic across keyspaces, and `persist(SyncData)` syncs the journal.
struct Fjall {
    db: fjall::Database,
    events: fjall::Keyspace,
    highest: fjall::Keyspace,
}

impl Fjall {
    fn open(dir: &Path) -> Fjall {
        let db = fjall::Database::builder(dir).open().expect("open fjall");
        let events = db
            .keyspace("events", fjall::KeyspaceCreateOptions::default)
            .expect("keyspace");
        let highest = db
            .keyspace("highest", fjall::KeyspaceCreateOptions::default)
            .expect("keyspace");
        Fjall {
            db,
            events,
            highest,
        }
    }
}

fn key(id: &PersistenceId) -> Vec<u8> {
    let mut key = id.type_name.as_bytes().to_vec();
    key.push(0);
    key.extend_from_slice(id.entity_id.as_bytes());
    key
}

impl Append for Fjall {
    fn append(&self, ids: &[PersistenceId]) {
        let mut batch = self.db.batch();
        for id in ids {
            let key = key(id);
            let top = self.highest.get(&key).expect("get").map_or(0, |v| {
                u64::from_be_bytes(v[..8].try_into().expect("8 bytes"))
            });
            let next = top + 1;
            let mut event_key = key.clone();
            event_key.push(0);
            event_key.extend_from_slice(&next.to_be_bytes());
            batch.insert(&self.events, event_key, EVENT.to_vec());
            batch.insert(&self.highest, key, next.to_be_bytes().to_vec());
        }
        batch.commit().expect("commit");
        self.db
            .persist(fjall::PersistMode::SyncData)
            .expect("persist");
    }
}

/// SQLite in WAL mode, `synchronous = FULL` (the WAL synced at every
/// commit), one connection per writer; writers of one file take turns
/// on its write lock.
struct Sqlite {
    connection: std::sync::Mutex<rusqlite::Connection>,
}

impl Sqlite {
    fn open(path: &Path) -> Sqlite {
        let connection = rusqlite::Connection::open(path).expect("open sqlite");
        connection
            .busy_timeout(Duration::from_secs(30))
            .expect("busy timeout");
        connection
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;
                 CREATE TABLE IF NOT EXISTS events (type TEXT, id TEXT, seq INTEGER, event BLOB,
                   PRIMARY KEY (type, id, seq)) WITHOUT ROWID;
                 CREATE TABLE IF NOT EXISTS highest (type TEXT, id TEXT, seq INTEGER,
                   PRIMARY KEY (type, id)) WITHOUT ROWID;",
            )
            .expect("schema");
        Sqlite {
            connection: std::sync::Mutex::new(connection),
        }
    }
}

impl Append for Sqlite {
    fn append(&self, ids: &[PersistenceId]) {
        let mut connection = self.connection.lock().expect("lock");
        let txn = connection
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .expect("begin");
        {
            let mut top = txn
                .prepare_cached("SELECT seq FROM highest WHERE type = ?1 AND id = ?2")
                .expect("prepare");
            let mut insert = txn
                .prepare_cached("INSERT INTO events VALUES (?1, ?2, ?3, ?4)")
                .expect("prepare");
            let mut raise = txn
                .prepare_cached("INSERT OR REPLACE INTO highest VALUES (?1, ?2, ?3)")
                .expect("prepare");
            for id in ids {
                let seq: i64 = top
                    .query_row((&id.type_name, &id.entity_id), |row| row.get(0))
                    .unwrap_or(0);
                insert
                    .execute((&id.type_name, &id.entity_id, seq + 1, &EVENT[..]))
                    .expect("insert");
                raise
                    .execute((&id.type_name, &id.entity_id, seq + 1))
                    .expect("raise");
            }
        }
        txn.commit().expect("commit");
    }
}

fn cpu_time() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1_000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// `writers` threads, writer `w` appending through `stores[w % stores.len()]`
/// to the ids `w` owns; `events` appends in all, `batch` per commit.
fn run(name: &str, stores: Vec<Arc<dyn Append>>, writers: usize, events: usize, batch: usize) {
    let ids: Vec<PersistenceId> = (0..ENTITIES)
        .map(|i| PersistenceId::new("pinger", format!("e-{i}")))
        .collect();
    let batches = events / batch / writers;
    let cpu = cpu_time();
    let start = Instant::now();
    let threads: Vec<_> = (0..writers)
        .map(|w| {
            let store = stores[w % stores.len()].clone();
            let mine: Vec<PersistenceId> = ids
                .iter()
                .enumerate()
                .filter(|(i, _)| i % writers == w)
                .map(|(_, id)| id.clone())
                .collect();
            std::thread::spawn(move || {
                let mut took = Vec::with_capacity(batches);
                let mut next = 0;
                for _ in 0..batches {
                    let group: Vec<PersistenceId> = (0..batch)
                        .map(|k| mine[(next + k) % mine.len()].clone())
                        .collect();
                    next += batch;
                    let began = Instant::now();
                    store.append(&group);
                    took.push(began.elapsed());
                }
                took
            })
        })
        .collect();
    let mut took: Vec<Duration> = threads
        .into_iter()
        .flat_map(|t| t.join().expect("a writer panicked"))
        .collect();
    let wall = start.elapsed();
    let cpu = cpu_time() - cpu;
    took.sort();
    let done = took.len() * batch;
    let at = |q: f64| took[((took.len() as f64 * q) as usize).min(took.len() - 1)];
    println!(
        "{name:<28} writers {writers}  {:>8.0} events/s  {:>6.1} µs CPU/event  commit p50 {:>6} p99 {:>6} µs",
        done as f64 / wall.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / done as f64,
        at(0.5).as_micros(),
        at(0.99).as_micros(),
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let events: usize = args.next().map_or(64_000, |a| a.parse().expect("events"));
    let only = args.next();
    let batch = 16;
    let wanted = |name: &str| only.as_deref().is_none_or(|o| name.starts_with(o));
    for writers in [1, 4] {
        let dir = tempfile::tempdir().expect("a temporary directory");
        if wanted("redb") {
            let one = RedbPersistence::open(dir.path().join("one.redb")).expect("open");
            run(
                "redb, one file",
                vec![Arc::new(Redb::new(one))],
                writers,
                events,
                batch,
            );
            if writers > 1 {
                let lanes = (0..writers)
                    .map(|w| {
                        let file = dir.path().join(format!("lane-{w}.redb"));
                        Arc::new(Redb::new(RedbPersistence::open(file).expect("open")))
                            as Arc<dyn Append>
                    })
                    .collect();
                run(
                    &format!("redb, {writers} files"),
                    lanes,
                    writers,
                    events,
                    batch,
                );
            }
        }
        if wanted("fjall") {
            let fjall = Fjall::open(&dir.path().join("fjall"));
            run(
                "fjall, one database",
                vec![Arc::new(fjall)],
                writers,
                events,
                batch,
            );
        }
        if wanted("sqlite") {
            let shared = dir.path().join("one.sqlite");
            let connections = (0..writers)
                .map(|_| Arc::new(Sqlite::open(&shared)) as Arc<dyn Append>)
                .collect();
            run("sqlite WAL, one file", connections, writers, events, batch);
            if writers > 1 {
                let files = (0..writers)
                    .map(|w| {
                        let file = dir.path().join(format!("lane-{w}.sqlite"));
                        Arc::new(Sqlite::open(&file)) as Arc<dyn Append>
                    })
                    .collect();
                run(
                    &format!("sqlite WAL, {writers} files"),
                    files,
                    writers,
                    events,
                    batch,
                );
            }
        }
    }
}
