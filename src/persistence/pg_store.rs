//! The PostgreSQL store: journal, snapshots and durable state in one
//! database that every node of a cluster shares (feature `postgres`).
//!
//! Through [`postgres`](https://docs.rs/postgres) (tokio-postgres's
//! blocking client; the SPI is synchronous and runs on blocking threads)
//! and an [`r2d2`](https://docs.rs/r2d2) pool of connections. The schema is
//! created on first use. One [`Journal::append`] batch is one transaction
//! of a fixed number of statements, whatever its size: many entities'
//! appends cost one commit and eleven round trips (group commit).
//!
//! Tables (`type_name`, `entity_id` text; numbers `bigint`, holding the
//! `u64`s' bits):
//!
//! | table | key | columns |
//! |---|---|---|
//! | `datum_events` | `(type_name, entity_id, sequence_nr)` | `manifest, version, payload, writer_node, writer_incarnation, writer_generation` |
//! | `datum_highest` | `(type_name, entity_id)` | `highest` |
//! | `datum_snapshots` | `(type_name, entity_id, sequence_nr)` | as events |
//! | `datum_states` | `(type_name, entity_id)` | `revision`, then as events, nullable (a delete's tombstone) |
//! | `datum_remembered` | `(type_name, shard_id, entity_id)` | — (remember-entities: a row is a remembered id) |
//!
//! A batch: `BEGIN`; one `INSERT … ON CONFLICT DO NOTHING` makes sure
//! every persistence id it writes has a `datum_highest` row; one `SELECT
//! … FOR UPDATE` locks and reads them all, in key order; the expected
//! sequence numbers are checked here; one `INSERT … SELECT FROM unnest`
//! writes every accepted event and one `UPDATE … FROM unnest` the new
//! highest numbers; `COMMIT`. Fencing: two nodes appending to one journal
//! are serialized by the row lock, and the second one's expected sequence
//! number is checked against the first's commit.

use std::collections::{BTreeMap, BTreeSet};

use r2d2_postgres::PostgresConnectionManager;
use r2d2_postgres::postgres::{Client, GenericClient, IsolationLevel, NoTls, Row};

use super::remember::{
    RememberEntitiesStore, RememberRecord, StoreError, final_states, record_one,
};
use crate::model::extractor::ShardId;

use super::{
    AtomicWrite, DurableStateStore, EventRecord, Journal, Payload, PersistenceError, PersistenceId,
    PersistenceResult, SnapshotRecord, SnapshotStore, StateRecord, Writer, check_append,
    check_revision,
};

type Pool = r2d2::Pool<PostgresConnectionManager<NoTls>>;

/// How long a call waits for a connection (a pooled one, or a new one
/// while the server is away) before it fails with a `Store` error; less
/// when it is made for an ask whose deadline comes first
/// ([`call_deadline`](crate::persistence::call_deadline)).
pub const PG_CONNECTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The advisory lock key that serializes schema creation ("datum" in
/// ASCII).
const SCHEMA_LOCK: i64 = 0x64_61_74_75_6d;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS datum_events (
    type_name text NOT NULL, entity_id text NOT NULL, sequence_nr bigint NOT NULL,
    manifest text NOT NULL, version integer NOT NULL, payload bytea NOT NULL,
    writer_node bigint NOT NULL, writer_incarnation bigint NOT NULL, writer_generation bigint NOT NULL,
    PRIMARY KEY (type_name, entity_id, sequence_nr));
CREATE TABLE IF NOT EXISTS datum_highest (
    type_name text NOT NULL, entity_id text NOT NULL, highest bigint NOT NULL,
    PRIMARY KEY (type_name, entity_id));
CREATE TABLE IF NOT EXISTS datum_snapshots (
    type_name text NOT NULL, entity_id text NOT NULL, sequence_nr bigint NOT NULL,
    manifest text NOT NULL, version integer NOT NULL, payload bytea NOT NULL,
    writer_node bigint NOT NULL, writer_incarnation bigint NOT NULL, writer_generation bigint NOT NULL,
    PRIMARY KEY (type_name, entity_id, sequence_nr));
CREATE TABLE IF NOT EXISTS datum_remembered (
    type_name text NOT NULL, shard_id bigint NOT NULL, entity_id text NOT NULL,
    PRIMARY KEY (type_name, shard_id, entity_id));
CREATE TABLE IF NOT EXISTS datum_states (
    type_name text NOT NULL, entity_id text NOT NULL, revision bigint NOT NULL,
    manifest text, version integer, payload bytea,
    writer_node bigint, writer_incarnation bigint, writer_generation bigint,
    PRIMARY KEY (type_name, entity_id));
";

/// The PostgreSQL store (see the module docs). Clones share one pool.
///
/// Its calls block (they run on the system's blocking threads); call them
/// yourself only where blocking is allowed, not on an async task.
#[derive(Clone)]
pub struct PgPersistence {
    pool: std::sync::Arc<Holder>,
    connect_errors: ConnectErrors,
}

/// The pool's handler of failed connection attempts. r2d2's own logs the
/// client's bare "db error" and its errors carry only that; this one logs
/// the causes too, and keeps the last failure since the last connection
/// made, for the error a call that got no connection returns.
#[derive(Clone, Debug, Default)]
struct ConnectErrors(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl ConnectErrors {
    fn set(&self, last: Option<String>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = last;
    }
}

impl r2d2::HandleError<r2d2_postgres::postgres::Error> for ConnectErrors {
    fn handle_error(&self, error: r2d2_postgres::postgres::Error) {
        let text = error_text(error);
        tracing::warn!(error = %text, "a PostgreSQL connection failed or broke");
        self.set(Some(text));
    }
}

impl r2d2::CustomizeConnection<r2d2_postgres::postgres::Client, r2d2_postgres::postgres::Error>
    for ConnectErrors
{
    fn on_acquire(
        &self,
        _: &mut r2d2_postgres::postgres::Client,
    ) -> Result<(), r2d2_postgres::postgres::Error> {
        self.set(None); // connected: earlier failures explain nothing now
        Ok(())
    }
}

impl ConnectErrors {
    /// `error` (the pool gave no connection), with the last attempt's cause.
    fn explain(&self, error: r2d2::Error) -> PersistenceError {
        match self.0.lock().unwrap_or_else(|e| e.into_inner()).as_deref() {
            Some(last) => PersistenceError::Store(format!("{error} (last attempt: {last})")),
            None => store_error(error),
        }
    }
}

/// Owns the pool. The blocking client drives each connection with a
/// runtime of its own, which must not be dropped inside another runtime:
/// the last clone of a store may go on an async task, so the pool is
/// dropped on a thread of its own.
struct Holder(Option<Pool>);

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(pool) = self.0.take() {
            let _ = std::thread::Builder::new()
                .name("datum-pg-close".into())
                .spawn(move || drop(pool))
                .map(|t| t.join());
        }
    }
}

/// A client or pool error, with its causes: the client's own text for a
/// server error is only "db error", the server's message is its source.
fn store_error(error: impl std::error::Error) -> PersistenceError {
    PersistenceError::Store(error_text(error))
}

/// `error`'s text followed by its causes'.
fn error_text(error: impl std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str(": ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

/// A transaction at READ COMMITTED, whatever the database's default: the
/// fencing relies on a statement that waited for a row lock reading the
/// row as committed by the other transaction.
fn read_committed(
    client: &mut Client,
) -> PersistenceResult<r2d2_postgres::postgres::Transaction<'_>> {
    client
        .build_transaction()
        .isolation_level(IsolationLevel::ReadCommitted)
        .start()
        .map_err(store_error)
}

/// A server that goes away mid-query without closing the connection (a
/// partition, a dead host) must not hold the journal's one writer thread
/// for the kernel's minutes: TCP keepalives and a user timeout end the
/// connection within about 10 s, and a statement (one waiting for another
/// node's row lock included) is cancelled after 30 s, unless the URL sets
/// its own `statement_timeout`.
fn bound_stalls(config: &mut r2d2_postgres::postgres::Config) {
    config
        .keepalives(true)
        .keepalives_idle(std::time::Duration::from_secs(5))
        .keepalives_interval(std::time::Duration::from_secs(1))
        .keepalives_retries(5)
        .tcp_user_timeout(std::time::Duration::from_secs(10));
    let options = config.get_options().unwrap_or_default().to_owned();
    if !options.contains("statement_timeout") {
        config.options(format!("{options} -c statement_timeout=30000").trim());
    }
}

/// Text PostgreSQL cannot store (a NUL byte), refused for that write
/// only: the rest of its batch goes on.
fn unstorable(text: &str) -> bool {
    text.contains('\0')
}

fn storable(write: &AtomicWrite) -> PersistenceResult<()> {
    let id = &write.persistence_id;
    if unstorable(&id.type_name)
        || unstorable(&id.entity_id)
        || write.events.iter().any(|e| unstorable(&e.manifest))
    {
        return Err(PersistenceError::Invalid(format!(
            "{id}: PostgreSQL text cannot hold a NUL byte (in the type name, the entity id or a manifest)"
        )));
    }
    Ok(())
}

/// A `u64` in a `bigint` column (the same bits).
fn big(n: u64) -> i64 {
    n as i64
}

fn unbig(n: i64) -> u64 {
    n as u64
}

impl PgPersistence {
    /// Connects to `url` (a libpq connection string, say `host=127.0.0.1
    /// port=5432 user=app dbname=app`) with a pool of up to `pool_size`
    /// connections, and creates the schema if it is missing.
    ///
    /// It connects on a thread of its own, so it may be called anywhere,
    /// an async task included. A later call that cannot get a connection
    /// within [`PG_CONNECTION_TIMEOUT`] (the server is away) fails with
    /// [`PersistenceError::Store`]; the pool reconnects once the server is
    /// back.
    pub fn connect(url: &str, pool_size: u32) -> PersistenceResult<Self> {
        let mut config: r2d2_postgres::postgres::Config = url.parse().map_err(store_error)?;
        bound_stalls(&mut config);
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let manager = PostgresConnectionManager::new(config, NoTls);
                    let connect_errors = ConnectErrors::default();
                    let pool = r2d2::Pool::builder()
                        .max_size(pool_size.max(1))
                        .connection_timeout(PG_CONNECTION_TIMEOUT)
                        .error_handler(Box::new(connect_errors.clone()))
                        .connection_customizer(Box::new(connect_errors.clone()))
                        .build(manager)
                        .map_err(|e| connect_errors.explain(e))?;
                    let store = PgPersistence {
                        pool: std::sync::Arc::new(Holder(Some(pool))),
                        connect_errors,
                    };
                    // Nodes starting together on a fresh database would
                    // race `CREATE TABLE IF NOT EXISTS` (which is not safe
                    // concurrently): one at a time, under a lock.
                    store
                        .client()?
                        .batch_execute(&format!(
                            "BEGIN; SELECT pg_advisory_xact_lock({SCHEMA_LOCK}); {SCHEMA} COMMIT;"
                        ))
                        .map_err(store_error)?;
                    Ok(store)
                })
                .join()
                .unwrap_or_else(|_| Err(PersistenceError::Store("connecting panicked".into())))
        })
    }

    fn client(
        &self,
    ) -> PersistenceResult<r2d2::PooledConnection<PostgresConnectionManager<NoTls>>> {
        let pool = self
            .pool
            .0
            .as_ref()
            .ok_or_else(|| PersistenceError::Store("the store is closed".into()))?;
        // A call made for an ask waits no longer than its deadline allows
        // (`call_deadline`): with the server away, the asker hears this
        // store's error rather than its own timeout.
        let wait = super::call_deadline().map_or(PG_CONNECTION_TIMEOUT, |by| {
            by.saturating_duration_since(std::time::Instant::now())
                .min(PG_CONNECTION_TIMEOUT)
        });
        // Cut short by the deadline, the call sent nothing: the caller
        // may go on as if it had not been made (`Unavailable`).
        let cut_short = wait < PG_CONNECTION_TIMEOUT;
        pool.get_timeout(wait)
            .map_err(|e| match self.connect_errors.explain(e) {
                PersistenceError::Store(why) if cut_short => PersistenceError::Unavailable(why),
                other => other,
            })
    }
}

fn payload_of(row: &Row, id: &PersistenceId) -> PersistenceResult<(Payload, Writer)> {
    let read = || -> Result<(Payload, Writer), r2d2_postgres::postgres::Error> {
        let version: i32 = row.try_get("version")?;
        let payload = Payload {
            manifest: row.try_get("manifest")?,
            version: version as u32,
            bytes: row.try_get("payload")?,
        };
        let writer = Writer {
            node_id: unbig(row.try_get("writer_node")?),
            incarnation: unbig(row.try_get("writer_incarnation")?),
            generation: unbig(row.try_get("writer_generation")?),
        };
        Ok((payload, writer))
    };
    read().map_err(|e| PersistenceError::Corrupt {
        persistence_id: id.clone(),
        what: e.to_string(),
    })
}

/// Locks (creating the missing ones) the highest rows of every
/// persistence id a batch writes, in key order so that two nodes' batches
/// cannot deadlock, and reads them: two statements whatever the batch.
fn lock_highest(
    client: &mut impl GenericClient,
    writes: &[AtomicWrite],
) -> PersistenceResult<BTreeMap<(String, String), u64>> {
    let ids: BTreeSet<(&str, &str)> = writes
        .iter()
        .filter(|w| storable(w).is_ok())
        .map(|w| {
            (
                w.persistence_id.type_name.as_str(),
                w.persistence_id.entity_id.as_str(),
            )
        })
        .collect();
    let (type_names, entity_ids): (Vec<&str>, Vec<&str>) = ids.iter().copied().unzip();
    client
        .execute(
            "INSERT INTO datum_highest \
             SELECT type_name, entity_id, 0 FROM unnest($1::text[], $2::text[]) AS u(type_name, entity_id) \
             ORDER BY type_name, entity_id ON CONFLICT DO NOTHING",
            &[&type_names, &entity_ids],
        )
        .map_err(store_error)?;
    let rows = client
        .query(
            "SELECT h.type_name, h.entity_id, h.highest FROM datum_highest AS h \
             JOIN unnest($1::text[], $2::text[]) AS u(type_name, entity_id) \
             ON h.type_name = u.type_name AND h.entity_id = u.entity_id \
             ORDER BY h.type_name, h.entity_id FOR UPDATE OF h",
            &[&type_names, &entity_ids],
        )
        .map_err(store_error)?;
    Ok(rows
        .iter()
        .map(|row| ((row.get(0), row.get(1)), unbig(row.get(2))))
        .collect())
}

/// The accepted events of a batch, column by column, for one `INSERT`.
#[derive(Default)]
struct EventRows<'w> {
    type_names: Vec<&'w str>,
    entity_ids: Vec<&'w str>,
    sequence_nrs: Vec<i64>,
    manifests: Vec<&'w str>,
    versions: Vec<i32>,
    payloads: Vec<&'w [u8]>,
    nodes: Vec<i64>,
    incarnations: Vec<i64>,
    generations: Vec<i64>,
}

impl<'w> EventRows<'w> {
    fn push(&mut self, write: &'w AtomicWrite, numbers: std::ops::RangeInclusive<u64>) {
        let (id, w) = (&write.persistence_id, write.writer);
        for (n, payload) in numbers.zip(&write.events) {
            self.type_names.push(&id.type_name);
            self.entity_ids.push(&id.entity_id);
            self.sequence_nrs.push(big(n));
            self.manifests.push(&payload.manifest);
            self.versions.push(payload.version as i32);
            self.payloads.push(&payload.bytes);
            self.nodes.push(big(w.node_id));
            self.incarnations.push(big(w.incarnation));
            self.generations.push(big(w.generation));
        }
    }

    fn insert(&self, client: &mut impl GenericClient) -> PersistenceResult<()> {
        client
            .execute(
                "INSERT INTO datum_events SELECT * FROM unnest($1::text[], $2::text[], \
                 $3::bigint[], $4::text[], $5::integer[], $6::bytea[], $7::bigint[], \
                 $8::bigint[], $9::bigint[])",
                &[
                    &self.type_names,
                    &self.entity_ids,
                    &self.sequence_nrs,
                    &self.manifests,
                    &self.versions,
                    &self.payloads,
                    &self.nodes,
                    &self.incarnations,
                    &self.generations,
                ],
            )
            .map_err(store_error)?;
        Ok(())
    }
}

impl Journal for PgPersistence {
    fn append(&self, writes: &[AtomicWrite]) -> Vec<PersistenceResult<()>> {
        let applied = (|| {
            let mut client = self.client()?;
            let mut txn = read_committed(&mut client)?;
            let mut highest = lock_highest(&mut txn, writes)?;
            // Checked in batch order, as if one after the other: a second
            // write to one id in a batch sees the first one's events.
            let mut results = Vec::with_capacity(writes.len());
            let mut rows = EventRows::default();
            for write in writes {
                if let Err(refused) = storable(write) {
                    results.push(Err(refused));
                    continue;
                }
                let id = &write.persistence_id;
                let key = (id.type_name.clone(), id.entity_id.clone());
                let Some(top) = highest.get_mut(&key) else {
                    results.push(Err(PersistenceError::Store(format!("{id} was not locked"))));
                    continue;
                };
                match check_append(write, *top) {
                    Ok(numbers) => {
                        *top = *numbers.end();
                        rows.push(write, numbers);
                        results.push(Ok(()));
                    }
                    Err(refused) => results.push(Err(refused)),
                }
            }
            if !rows.type_names.is_empty() {
                rows.insert(&mut txn)?;
                let (type_names, (entity_ids, tops)): (Vec<&str>, (Vec<&str>, Vec<i64>)) = highest
                    .iter()
                    .map(|((t, e), &top)| (t.as_str(), (e.as_str(), big(top))))
                    .unzip();
                txn.execute(
                    "UPDATE datum_highest AS h SET highest = u.highest \
                     FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(type_name, entity_id, highest) \
                     WHERE h.type_name = u.type_name AND h.entity_id = u.entity_id \
                     AND h.highest <> u.highest",
                    &[&type_names, &entity_ids, &tops],
                )
                .map_err(store_error)?;
            }
            txn.commit().map_err(store_error)?;
            Ok::<_, PersistenceError>(results)
        })();
        // A failed transaction wrote nothing (unless the commit's answer
        // was lost): every write fails with it.
        applied.unwrap_or_else(|error| writes.iter().map(|_| Err(error.clone())).collect())
    }

    fn replay(
        &self,
        persistence_id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> PersistenceResult<Vec<EventRecord>> {
        if from > to || max == 0 {
            return Ok(Vec::new());
        }
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        // (Sequence numbers above i64::MAX are not stored: the bounds are clamped.)
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let rows = self
            .client()?
            .query(
                "SELECT * FROM datum_events WHERE type_name = $1 AND entity_id = $2 \
                 AND sequence_nr BETWEEN $3 AND $4 ORDER BY sequence_nr LIMIT $5",
                &[
                    &persistence_id.type_name,
                    &persistence_id.entity_id,
                    &clamp(from),
                    &clamp(to),
                    &limit,
                ],
            )
            .map_err(store_error)?;
        let mut out: Vec<EventRecord> = Vec::with_capacity(rows.len());
        for row in &rows {
            let sequence_nr = unbig(row.get("sequence_nr"));
            if let Some(previous) = out.last()
                && previous.sequence_nr + 1 != sequence_nr
            {
                return Err(PersistenceError::Corrupt {
                    persistence_id: persistence_id.clone(),
                    what: format!(
                        "sequence number {sequence_nr} follows {}",
                        previous.sequence_nr
                    ),
                });
            }
            let (payload, writer) = payload_of(row, persistence_id)?;
            out.push(EventRecord {
                sequence_nr,
                payload,
                writer,
            });
        }
        Ok(out)
    }

    fn highest_sequence_nr(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        let row = self
            .client()?
            .query_opt(
                "SELECT highest FROM datum_highest WHERE type_name = $1 AND entity_id = $2",
                &[&persistence_id.type_name, &persistence_id.entity_id],
            )
            .map_err(store_error)?;
        Ok(row.map_or(0, |r| unbig(r.get(0))))
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        self.client()?
            .execute(
                "DELETE FROM datum_events WHERE type_name = $1 AND entity_id = $2 \
                 AND sequence_nr >= 0 AND sequence_nr <= $3",
                &[
                    &persistence_id.type_name,
                    &persistence_id.entity_id,
                    &i64::try_from(to).unwrap_or(i64::MAX),
                ],
            )
            .map_err(store_error)?;
        Ok(())
    }
}

impl SnapshotStore for PgPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        snapshot: SnapshotRecord,
    ) -> PersistenceResult<()> {
        let (p, w) = (&snapshot.payload, snapshot.writer);
        self.client()?
            .execute(
                "INSERT INTO datum_snapshots VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (type_name, entity_id, sequence_nr) DO UPDATE SET \
                 manifest = $4, version = $5, payload = $6, writer_node = $7, \
                 writer_incarnation = $8, writer_generation = $9",
                &[
                    &persistence_id.type_name,
                    &persistence_id.entity_id,
                    &big(snapshot.sequence_nr),
                    &p.manifest,
                    &(p.version as i32),
                    &p.bytes,
                    &big(w.node_id),
                    &big(w.incarnation),
                    &big(w.generation),
                ],
            )
            .map_err(store_error)?;
        Ok(())
    }

    fn load(
        &self,
        persistence_id: &PersistenceId,
        max_sequence_nr: u64,
    ) -> PersistenceResult<Option<SnapshotRecord>> {
        let row = self
            .client()?
            .query_opt(
                "SELECT * FROM datum_snapshots WHERE type_name = $1 AND entity_id = $2 \
                 AND sequence_nr >= 0 AND sequence_nr <= $3 ORDER BY sequence_nr DESC LIMIT 1",
                &[
                    &persistence_id.type_name,
                    &persistence_id.entity_id,
                    &i64::try_from(max_sequence_nr).unwrap_or(i64::MAX),
                ],
            )
            .map_err(store_error)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let (payload, writer) = payload_of(&row, persistence_id)?;
        Ok(Some(SnapshotRecord {
            sequence_nr: unbig(row.get("sequence_nr")),
            payload,
            writer,
        }))
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        self.client()?
            .execute(
                "DELETE FROM datum_snapshots WHERE type_name = $1 AND entity_id = $2 \
                 AND sequence_nr >= 0 AND sequence_nr <= $3",
                &[
                    &persistence_id.type_name,
                    &persistence_id.entity_id,
                    &i64::try_from(to).unwrap_or(i64::MAX),
                ],
            )
            .map_err(store_error)?;
        Ok(())
    }
}

/// The current revision of a state, locked for this transaction.
fn lock_revision(client: &mut impl GenericClient, id: &PersistenceId) -> PersistenceResult<u64> {
    client
        .execute(
            "INSERT INTO datum_states (type_name, entity_id, revision) VALUES ($1, $2, 0) \
             ON CONFLICT DO NOTHING",
            &[&id.type_name, &id.entity_id],
        )
        .map_err(store_error)?;
    let row = client
        .query_one(
            "SELECT revision FROM datum_states WHERE type_name = $1 AND entity_id = $2 FOR UPDATE",
            &[&id.type_name, &id.entity_id],
        )
        .map_err(store_error)?;
    Ok(unbig(row.get(0)))
}

impl DurableStateStore for PgPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        expected: u64,
        payload: Payload,
        writer: Writer,
    ) -> PersistenceResult<()> {
        let mut client = self.client()?;
        let mut txn = read_committed(&mut client)?;
        let actual = lock_revision(&mut txn, persistence_id)?;
        check_revision(persistence_id, expected, actual)?;
        txn.execute(
            "UPDATE datum_states SET revision = $3, manifest = $4, version = $5, payload = $6, \
             writer_node = $7, writer_incarnation = $8, writer_generation = $9 \
             WHERE type_name = $1 AND entity_id = $2",
            &[
                &persistence_id.type_name,
                &persistence_id.entity_id,
                &big(actual + 1),
                &payload.manifest,
                &(payload.version as i32),
                &payload.bytes,
                &big(writer.node_id),
                &big(writer.incarnation),
                &big(writer.generation),
            ],
        )
        .map_err(store_error)?;
        txn.commit().map_err(store_error)
    }

    fn load(&self, persistence_id: &PersistenceId) -> PersistenceResult<Option<StateRecord>> {
        let row = self
            .client()?
            .query_opt(
                "SELECT * FROM datum_states WHERE type_name = $1 AND entity_id = $2 \
                 AND payload IS NOT NULL",
                &[&persistence_id.type_name, &persistence_id.entity_id],
            )
            .map_err(store_error)?;
        let Some(row) = row else {
            return Ok(None);
        };
        let (payload, writer) = payload_of(&row, persistence_id)?;
        Ok(Some(StateRecord {
            revision: unbig(row.get("revision")),
            payload,
            writer,
        }))
    }

    fn revision(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        let row = self
            .client()?
            .query_opt(
                "SELECT revision FROM datum_states WHERE type_name = $1 AND entity_id = $2",
                &[&persistence_id.type_name, &persistence_id.entity_id],
            )
            .map_err(store_error)?;
        Ok(row.map_or(0, |r| unbig(r.get(0))))
    }

    fn delete(&self, persistence_id: &PersistenceId, expected: u64) -> PersistenceResult<()> {
        let mut client = self.client()?;
        let mut txn = read_committed(&mut client)?;
        let actual = lock_revision(&mut txn, persistence_id)?;
        check_revision(persistence_id, expected, actual)?;
        txn.execute(
            "UPDATE datum_states SET revision = $3, manifest = NULL, version = NULL, \
             payload = NULL, writer_node = NULL, writer_incarnation = NULL, \
             writer_generation = NULL WHERE type_name = $1 AND entity_id = $2",
            &[
                &persistence_id.type_name,
                &persistence_id.entity_id,
                &big(actual + 1),
            ],
        )
        .map_err(store_error)?;
        txn.commit().map_err(store_error)
    }
}

/// Remember-entities in the same database: every node sees every node's
/// remembered ids, so a shard's ids are respawned wherever it lands — after
/// its old owner died too. A batch is one transaction: its records reduced
/// to each id's last state, one `INSERT … FROM unnest` of the started ones
/// and one `DELETE … USING unnest` of the stopped ones.
impl RememberEntitiesStore for PgPersistence {
    fn record_entity_started(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        record_one(self, type_name, shard_id, entity_id, true)
    }

    fn record_entity_stopped(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        record_one(self, type_name, shard_id, entity_id, false)
    }

    fn list_entities_for_shard(
        &self,
        type_name: &str,
        shard_id: ShardId,
    ) -> Result<Vec<String>, StoreError> {
        let rows = self
            .client()
            .map_err(remember_error)?
            .query(
                "SELECT entity_id FROM datum_remembered WHERE type_name = $1 AND shard_id = $2 \
                 ORDER BY entity_id",
                &[&type_name, &i64::from(shard_id.0)],
            )
            .map_err(|e| remember_error(store_error(e)))?;
        rows.iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(|e| remember_error(store_error(e)))
    }

    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        let rows = self
            .client()
            .map_err(remember_error)?
            .query(
                "SELECT DISTINCT shard_id FROM datum_remembered WHERE type_name = $1 ORDER BY 1",
                &[&type_name],
            )
            .map_err(|e| remember_error(store_error(e)))?;
        rows.iter()
            .map(|r| {
                let shard: i64 = r.try_get(0).map_err(|e| remember_error(store_error(e)))?;
                u32::try_from(shard)
                    .map(ShardId)
                    .map_err(|_| StoreError(format!("a remembered shard id {shard} out of range")))
            })
            .collect()
    }

    fn record_batch(&self, records: &[RememberRecord<'_>]) -> Vec<Result<(), StoreError>> {
        // An id PostgreSQL cannot store fails alone; the rest go on.
        let unfit = |r: &RememberRecord<'_>| unstorable(r.type_name) || unstorable(r.entity_id);
        let fit: Vec<RememberRecord<'_>> = records.iter().filter(|r| !unfit(r)).copied().collect();
        let states = final_states(&fit);
        let column = |started: bool| {
            let mut columns = (Vec::new(), Vec::new(), Vec::new());
            for (&(t, s, e), _) in states.iter().filter(|(_, up)| **up == started) {
                columns.0.push(t);
                columns.1.push(i64::from(s.0));
                columns.2.push(e);
            }
            columns
        };
        let (started, stopped) = (column(true), column(false));
        let applied = (|| {
            let mut client = self.client()?;
            let mut txn = read_committed(&mut client)?;
            if !started.0.is_empty() {
                txn.execute(
                    "INSERT INTO datum_remembered \
                     SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[]) AS u(t, s, e) \
                     ORDER BY t, s, e ON CONFLICT DO NOTHING",
                    &[&started.0, &started.1, &started.2],
                )
                .map_err(store_error)?;
            }
            if !stopped.0.is_empty() {
                // Rows locked in key order first, as the inserts take them,
                // so two nodes' batches cannot deadlock.
                txn.query(
                    "SELECT 1 FROM datum_remembered AS r \
                     JOIN unnest($1::text[], $2::bigint[], $3::text[]) AS u(type_name, shard_id, entity_id) \
                     ON r.type_name = u.type_name AND r.shard_id = u.shard_id \
                     AND r.entity_id = u.entity_id \
                     ORDER BY r.type_name, r.shard_id, r.entity_id FOR UPDATE OF r",
                    &[&stopped.0, &stopped.1, &stopped.2],
                )
                .map_err(store_error)?;
                txn.execute(
                    "DELETE FROM datum_remembered AS r \
                     USING unnest($1::text[], $2::bigint[], $3::text[]) AS u(type_name, shard_id, entity_id) \
                     WHERE r.type_name = u.type_name AND r.shard_id = u.shard_id \
                     AND r.entity_id = u.entity_id",
                    &[&stopped.0, &stopped.1, &stopped.2],
                )
                .map_err(store_error)?;
            }
            txn.commit().map_err(store_error)
        })();
        let applied = applied.map_err(remember_error);
        records
            .iter()
            .map(|r| {
                if unfit(r) {
                    Err(StoreError(format!(
                        "{}/{}: PostgreSQL text cannot hold a NUL byte",
                        r.type_name, r.entity_id
                    )))
                } else {
                    applied.clone()
                }
            })
            .collect()
    }
}

fn remember_error(error: PersistenceError) -> StoreError {
    StoreError(error.to_string())
}
