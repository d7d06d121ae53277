//! The embedded store: journal, snapshots and durable state in
//! [redb](https://docs.rs/redb) files, one per node or one per commit lane.
//!
//! redb is an ACID key-value store in pure Rust (copy-on-write B-trees, a
//! commit is durable when it returns), so the store needs no server, builds
//! with no C compiler, and survives a crash of the process or the machine
//! with every committed write. One [`Journal::append`] batch is one write
//! transaction: many entities' appends cost one commit (group commit).
//!
//! redb commits one write transaction at a time per file. A store opened
//! with [`RedbPersistence::open_lanes`] keeps `N` files in a directory,
//! `lane-<i>-of-<N>.redb`: a persistence id's records live in the file of
//! its lane ([`PersistenceId::lane`]), remember-entities in lane 0's, and
//! the system runs one writer per lane, so `N` commits (and `N` syncs)
//! are in flight at once ([`Journal::commit_lanes`]). Each file is a store
//! of its own: a commit is atomic and durable per file, and a batch of the
//! system's writer touches one file only. The lane count is part of the
//! layout: a directory is opened with the count it was made with, or moved
//! to another with [`copy`](super::copy()).
//!
//! Tables (keys are `(type name, entity id[, number])`):
//!
//! | table | key | value |
//! |---|---|---|
//! | `events` | `(type, id, sequence_nr)` | a record (below) |
//! | `highest` | `(type, id)` | the highest sequence number, `u64` |
//! | `snapshots` | `(type, id, sequence_nr)` | a record |
//! | `states` | `(type, id)` | the revision, `u64` big-endian, then a record (none: deleted) |
//! | `remembered` | `(type, shard, id)` | `()` — remember-entities: a key is a remembered id |
//!
//! A record, version 1: byte `1`; the writer's node id, incarnation and
//! generation (`u64` little-endian each); the payload's version (`u32`
//! LE); the manifest's length (`u32` LE) and its UTF-8 bytes; the payload's
//! bytes to the end. A record that does not read so is reported as
//! [`PersistenceError::Corrupt`], never applied.

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableTable, TableDefinition};

use super::remember::{
    RememberEntitiesStore, RememberRecord, StoreError, final_states, record_one,
};
use crate::model::extractor::ShardId;

use super::record::{decode, encode, read_state};
use super::{
    AtomicWrite, DurableStateStore, EventRecord, Journal, MAX_LANES, Payload, PersistenceError,
    PersistenceId, PersistenceResult, SnapshotRecord, SnapshotStore, StateRecord, StateWrite,
    Writer, check_append, check_revision,
};

type Numbered<'a> = (&'a str, &'a str, u64);
type Named<'a> = (&'a str, &'a str);

const EVENTS: TableDefinition<Numbered, &[u8]> = TableDefinition::new("events");
const HIGHEST: TableDefinition<Named, u64> = TableDefinition::new("highest");
const SNAPSHOTS: TableDefinition<Numbered, &[u8]> = TableDefinition::new("snapshots");
const STATES: TableDefinition<Named, &[u8]> = TableDefinition::new("states");
const REMEMBERED: TableDefinition<Remembered, ()> = TableDefinition::new("remembered");

type Remembered<'a> = (&'a str, u32, &'a str);

/// The embedded store (see the module docs). Clones share the open files;
/// a second open of a file, by this process or another, is refused.
#[derive(Clone)]
pub struct RedbPersistence {
    /// One file per commit lane: a persistence id's records live in its
    /// lane's, remembered entities in the first.
    lanes: Arc<[Database]>,
}

fn store_error(error: impl std::fmt::Display) -> PersistenceError {
    PersistenceError::Store(error.to_string())
}

impl RedbPersistence {
    /// Opens the store at `path`, one file, creating it if missing: one
    /// commit at a time.
    pub fn open(path: impl AsRef<Path>) -> PersistenceResult<Self> {
        let db = open_file(path.as_ref())?;
        Ok(RedbPersistence {
            lanes: Arc::from([db]),
        })
    }

    /// Opens the store of `lanes` files in the directory `dir`, creating
    /// the directory and the files if missing: `lanes` commits in flight
    /// at once (1 to [`MAX_LANES`]). A directory made with another lane
    /// count is refused ([`PersistenceError::Invalid`]): every id would be
    /// looked for in the wrong file. So is one that holds some of its lane
    /// files but not all: a lost file's ids would start again from
    /// nothing.
    pub fn open_lanes(dir: impl AsRef<Path>, lanes: usize) -> PersistenceResult<Self> {
        let dir = dir.as_ref();
        if !(1..=MAX_LANES).contains(&lanes) {
            return Err(PersistenceError::Invalid(format!(
                "{lanes} lanes: from 1 to {MAX_LANES}"
            )));
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| PersistenceError::Store(format!("creating {}: {e}", dir.display())))?;
        let listed = std::fs::read_dir(dir)
            .map_err(|e| PersistenceError::Store(format!("reading {}: {e}", dir.display())))?;
        let mut present = 0;
        for entry in listed.flatten() {
            let name = entry.file_name();
            let Some(found) = name.to_str().and_then(lane_count_of) else {
                continue;
            };
            present += 1;
            if found != lanes {
                return Err(PersistenceError::Invalid(format!(
                    "{} holds a store of {found} lanes, opened with {lanes}: open it with \
                     {found}, or copy it into a new directory (persistence::copy, \
                     `datum-node copy-store`)",
                    dir.display()
                )));
            }
        }
        if present > 0 {
            let missing = (0..lanes)
                .map(|lane| dir.join(lane_file(lane, lanes)))
                .find(|path| !matches!(path.try_exists(), Ok(true)));
            if let Some(path) = missing {
                return Err(PersistenceError::Invalid(format!(
                    "{} is missing from a store of {lanes} lanes: its ids' records are gone \
                     (or the store's first open stopped half-way)",
                    path.display()
                )));
            }
        }
        let files = (0..lanes)
            .map(|lane| open_file(&dir.join(lane_file(lane, lanes))))
            .collect::<PersistenceResult<Vec<_>>>()?;
        Ok(RedbPersistence {
            lanes: Arc::from(files),
        })
    }

    /// The file that holds `id`'s records.
    fn file(&self, id: &PersistenceId) -> &Database {
        &self.lanes[id.lane(self.lanes.len())]
    }

    /// The file that holds remembered entities.
    fn first(&self) -> &Database {
        &self.lanes[0]
    }
}

/// `lane-<i>-of-<n>.redb`.
fn lane_file(lane: usize, lanes: usize) -> String {
    format!("lane-{lane}-of-{lanes}.redb")
}

/// The lane count `n` of a file named `lane-<i>-of-<n>.redb`.
fn lane_count_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("lane-")?.strip_suffix(".redb")?;
    let (_, count) = rest.split_once("-of-")?;
    count.parse().ok()
}

/// Opens (or creates) one file and its tables.
fn open_file(path: &Path) -> PersistenceResult<Database> {
    let db = Database::create(path)
        .map_err(|e| PersistenceError::Store(format!("opening {}: {e}", path.display())))?;
    let txn = db.begin_write().map_err(store_error)?;
    txn.open_table(EVENTS).map_err(store_error)?;
    txn.open_table(HIGHEST).map_err(store_error)?;
    txn.open_table(SNAPSHOTS).map_err(store_error)?;
    txn.open_table(STATES).map_err(store_error)?;
    txn.open_table(REMEMBERED).map_err(store_error)?;
    txn.commit().map_err(store_error)?;
    Ok(db)
}

/// Applies `writes`, a batch that may span lanes: one call of `commit`
/// per lane it touches (side by side on scoped threads when there are
/// several), each with that lane's writes in their order; the results
/// come back in the batch's order. The system's writers hand over one
/// lane's writes at a time, which goes straight through.
fn by_lane<W: Sync>(
    lanes: usize,
    writes: &[W],
    id_of: impl Fn(&W) -> &PersistenceId,
    commit: impl Fn(usize, &[&W]) -> Vec<PersistenceResult<()>> + Sync,
) -> Vec<PersistenceResult<()>> {
    let lane_of = |w: &W| id_of(w).lane(lanes);
    let Some(first) = writes.first().map(&lane_of) else {
        return Vec::new();
    };
    if writes.iter().all(|w| lane_of(w) == first) {
        let all: Vec<&W> = writes.iter().collect();
        return commit(first, &all);
    }
    let mut groups: Vec<(Vec<usize>, Vec<&W>)> = (0..lanes).map(|_| Default::default()).collect();
    for (at, write) in writes.iter().enumerate() {
        let group = &mut groups[lane_of(write)];
        group.0.push(at);
        group.1.push(write);
    }
    let mut results: Vec<Option<PersistenceResult<()>>> = (0..writes.len()).map(|_| None).collect();
    let commit = &commit;
    let answered: Vec<(Vec<usize>, Vec<PersistenceResult<()>>)> = std::thread::scope(|scope| {
        let running: Vec<_> = groups
            .into_iter()
            .enumerate()
            .filter(|(_, (at, _))| !at.is_empty())
            .map(|(lane, (at, group))| scope.spawn(move || (at, commit(lane, &group))))
            .collect();
        running
            .into_iter()
            .map(|r| {
                r.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    for (at, answers) in answered {
        for (i, answer) in at.into_iter().zip(answers) {
            results[i] = Some(answer);
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(store_error("a lane gave no result"))))
        .collect()
}

fn named(id: &PersistenceId) -> Named<'_> {
    (id.type_name.as_str(), id.entity_id.as_str())
}

fn numbered(id: &PersistenceId, n: u64) -> Numbered<'_> {
    (id.type_name.as_str(), id.entity_id.as_str(), n)
}

/// One lane's appends in one write transaction of its file.
fn append_in(db: &Database, writes: &[&AtomicWrite]) -> Vec<PersistenceResult<()>> {
    let applied = (|| {
        let txn = db.begin_write().map_err(store_error)?;
        let mut results = Vec::with_capacity(writes.len());
        {
            let mut events = txn.open_table(EVENTS).map_err(store_error)?;
            let mut highest = txn.open_table(HIGHEST).map_err(store_error)?;
            let mut buffer = Vec::new();
            for write in writes {
                let id = &write.persistence_id;
                let top = highest
                    .get(named(id))
                    .map_err(store_error)?
                    .map_or(0, |v| v.value());
                let numbers = match check_append(write, top) {
                    Ok(numbers) => numbers,
                    Err(refused) => {
                        results.push(Err(refused));
                        continue;
                    }
                };
                let last = *numbers.end();
                for (n, payload) in numbers.zip(&write.events) {
                    buffer.clear();
                    encode(payload, write.writer, &mut buffer);
                    events
                        .insert(numbered(id, n), buffer.as_slice())
                        .map_err(store_error)?;
                }
                highest.insert(named(id), last).map_err(store_error)?;
                results.push(Ok(()));
            }
        }
        txn.commit().map_err(store_error)?;
        Ok::<_, PersistenceError>(results)
    })();
    // A failed transaction wrote nothing: every write fails with it.
    applied.unwrap_or_else(|error| writes.iter().map(|_| Err(error.clone())).collect())
}

impl Journal for RedbPersistence {
    /// One write transaction per lane the batch touches.
    fn append(&self, writes: &[AtomicWrite]) -> Vec<PersistenceResult<()>> {
        by_lane(
            self.lanes.len(),
            writes,
            |w| &w.persistence_id,
            |lane, group| append_in(&self.lanes[lane], group),
        )
    }

    fn commit_lanes(&self) -> usize {
        self.lanes.len()
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
        let txn = self
            .file(persistence_id)
            .begin_read()
            .map_err(store_error)?;
        let events = txn.open_table(EVENTS).map_err(store_error)?;
        let range = events
            .range(numbered(persistence_id, from)..=numbered(persistence_id, to))
            .map_err(store_error)?;
        let mut out: Vec<EventRecord> = Vec::new();
        for entry in range.take(max) {
            let (key, value) = entry.map_err(store_error)?;
            let sequence_nr = key.value().2;
            if let Some(previous) = out.last()
                && previous.sequence_nr + 1 != sequence_nr
            {
                // Deletion removes a prefix only: a hole is damage.
                return Err(PersistenceError::Corrupt {
                    persistence_id: persistence_id.clone(),
                    what: format!(
                        "sequence number {sequence_nr} follows {}",
                        previous.sequence_nr
                    ),
                });
            }
            let (payload, writer) = decode(persistence_id, value.value())?;
            out.push(EventRecord {
                sequence_nr,
                payload,
                writer,
            });
        }
        Ok(out)
    }

    fn highest_sequence_nr(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        let txn = self
            .file(persistence_id)
            .begin_read()
            .map_err(store_error)?;
        let highest = txn.open_table(HIGHEST).map_err(store_error)?;
        Ok(highest
            .get(named(persistence_id))
            .map_err(store_error)?
            .map_or(0, |v| v.value()))
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        let txn = self
            .file(persistence_id)
            .begin_write()
            .map_err(store_error)?;
        {
            let mut events = txn.open_table(EVENTS).map_err(store_error)?;
            events
                .retain_in(
                    numbered(persistence_id, 0)..=numbered(persistence_id, to),
                    |_, _| false,
                )
                .map_err(store_error)?;
        }
        txn.commit().map_err(store_error)
    }
}

impl SnapshotStore for RedbPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        snapshot: SnapshotRecord,
    ) -> PersistenceResult<()> {
        let mut buffer = Vec::new();
        encode(&snapshot.payload, snapshot.writer, &mut buffer);
        let txn = self
            .file(persistence_id)
            .begin_write()
            .map_err(store_error)?;
        {
            let mut snapshots = txn.open_table(SNAPSHOTS).map_err(store_error)?;
            snapshots
                .insert(
                    numbered(persistence_id, snapshot.sequence_nr),
                    buffer.as_slice(),
                )
                .map_err(store_error)?;
        }
        txn.commit().map_err(store_error)
    }

    fn load(
        &self,
        persistence_id: &PersistenceId,
        max_sequence_nr: u64,
    ) -> PersistenceResult<Option<SnapshotRecord>> {
        let txn = self
            .file(persistence_id)
            .begin_read()
            .map_err(store_error)?;
        let snapshots = txn.open_table(SNAPSHOTS).map_err(store_error)?;
        let mut range = snapshots
            .range(numbered(persistence_id, 0)..=numbered(persistence_id, max_sequence_nr))
            .map_err(store_error)?;
        match range.next_back() {
            None => Ok(None),
            Some(entry) => {
                let (key, value) = entry.map_err(store_error)?;
                let (payload, writer) = decode(persistence_id, value.value())?;
                Ok(Some(SnapshotRecord {
                    sequence_nr: key.value().2,
                    payload,
                    writer,
                }))
            }
        }
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        let txn = self
            .file(persistence_id)
            .begin_write()
            .map_err(store_error)?;
        {
            let mut snapshots = txn.open_table(SNAPSHOTS).map_err(store_error)?;
            snapshots
                .retain_in(
                    numbered(persistence_id, 0)..=numbered(persistence_id, to),
                    |_, _| false,
                )
                .map_err(store_error)?;
        }
        txn.commit().map_err(store_error)
    }
}

/// The current revision of a state (0 for none), in a transaction.
fn revision_in(
    states: &impl ReadableTable<Named<'static>, &'static [u8]>,
    id: &PersistenceId,
) -> PersistenceResult<u64> {
    match states.get(named(id)).map_err(store_error)? {
        // The revision alone: the record after it is not decoded.
        Some(value) => match value.value().first_chunk::<8>() {
            Some(revision) => Ok(u64::from_be_bytes(*revision)),
            None => read_state(id, value.value()).map(|(revision, _)| revision),
        },
        None => Ok(0),
    }
}

/// One lane's saves in one write transaction of its file.
fn save_all_in(db: &Database, writes: &[&StateWrite]) -> Vec<PersistenceResult<()>> {
    let batch = || -> PersistenceResult<Vec<PersistenceResult<()>>> {
        let txn = db.begin_write().map_err(store_error)?;
        let mut results = Vec::with_capacity(writes.len());
        {
            let mut states = txn.open_table(STATES).map_err(store_error)?;
            let mut buffer = Vec::new();
            for w in writes {
                let id = &w.persistence_id;
                let saved = revision_in(&states, id).and_then(|actual| {
                    check_revision(id, w.expected, actual)?;
                    buffer.clear();
                    buffer.extend_from_slice(&(actual + 1).to_be_bytes());
                    encode(&w.payload, w.writer, &mut buffer);
                    states
                        .insert(named(id), buffer.as_slice())
                        .map_err(store_error)?;
                    Ok(())
                });
                results.push(saved);
            }
        }
        txn.commit().map_err(store_error)?;
        Ok(results)
    };
    batch().unwrap_or_else(|error| vec![Err(error); writes.len()])
}

impl DurableStateStore for RedbPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        expected: u64,
        payload: Payload,
        writer: Writer,
    ) -> PersistenceResult<()> {
        let txn = self
            .file(persistence_id)
            .begin_write()
            .map_err(store_error)?;
        {
            let mut states = txn.open_table(STATES).map_err(store_error)?;
            let actual = revision_in(&states, persistence_id)?;
            check_revision(persistence_id, expected, actual)?;
            let mut buffer = (actual + 1).to_be_bytes().to_vec();
            encode(&payload, writer, &mut buffer);
            states
                .insert(named(persistence_id), buffer.as_slice())
                .map_err(store_error)?;
        }
        txn.commit().map_err(store_error)
    }

    fn commits_batches(&self) -> bool {
        true
    }

    /// One write transaction (and one sync) per lane the batch touches.
    fn save_all(&self, writes: &[StateWrite]) -> Vec<PersistenceResult<()>> {
        by_lane(
            self.lanes.len(),
            writes,
            |w| &w.persistence_id,
            |lane, group| save_all_in(&self.lanes[lane], group),
        )
    }

    fn commit_lanes(&self) -> usize {
        self.lanes.len()
    }

    fn load(&self, persistence_id: &PersistenceId) -> PersistenceResult<Option<StateRecord>> {
        let txn = self
            .file(persistence_id)
            .begin_read()
            .map_err(store_error)?;
        let states = txn.open_table(STATES).map_err(store_error)?;
        match states.get(named(persistence_id)).map_err(store_error)? {
            Some(value) => Ok(read_state(persistence_id, value.value())?.1),
            None => Ok(None),
        }
    }

    fn revision(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        let txn = self
            .file(persistence_id)
            .begin_read()
            .map_err(store_error)?;
        let states = txn.open_table(STATES).map_err(store_error)?;
        revision_in(&states, persistence_id)
    }

    fn delete(&self, persistence_id: &PersistenceId, expected: u64) -> PersistenceResult<()> {
        let txn = self
            .file(persistence_id)
            .begin_write()
            .map_err(store_error)?;
        {
            let mut states = txn.open_table(STATES).map_err(store_error)?;
            let actual = revision_in(&states, persistence_id)?;
            check_revision(persistence_id, expected, actual)?;
            // The tombstone: the revision alone.
            let tombstone = (actual + 1).to_be_bytes();
            states
                .insert(named(persistence_id), tombstone.as_slice())
                .map_err(store_error)?;
        }
        txn.commit().map_err(store_error)
    }
}

#[path = "redb_copy.rs"]
mod copy;

#[cfg(test)]
#[path = "redb_tests.rs"]
mod tests;

fn remember_error(error: impl std::fmt::Display) -> StoreError {
    StoreError(error.to_string())
}

/// Remember-entities in the node's file: one write transaction (one
/// commit) per batch, its records reduced to each id's last state. The
/// file is the node's own, so, as with `FileStore`, a dead node's
/// remembered ids come back only when that node (its file) does.
impl RememberEntitiesStore for RedbPersistence {
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
        let txn = self.first().begin_read().map_err(remember_error)?;
        let table = txn.open_table(REMEMBERED).map_err(remember_error)?;
        let mut ids = Vec::new();
        for entry in table
            .range((type_name, shard_id.0, "")..)
            .map_err(remember_error)?
        {
            let (key, _) = entry.map_err(remember_error)?;
            let (t, s, id) = key.value();
            if t != type_name || s != shard_id.0 {
                break;
            }
            ids.push(id.to_owned());
        }
        Ok(ids)
    }

    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        let txn = self.first().begin_read().map_err(remember_error)?;
        let table = txn.open_table(REMEMBERED).map_err(remember_error)?;
        let mut shards = Vec::new();
        let mut from = 0u32;
        // One look-up per shard: from each shard found, on to the next.
        loop {
            let first = table
                .range((type_name, from, "")..)
                .map_err(remember_error)?
                .next();
            let Some(entry) = first else { break };
            let (key, _) = entry.map_err(remember_error)?;
            let (t, s, _) = key.value();
            if t != type_name {
                break;
            }
            shards.push(ShardId(s));
            match s.checked_add(1) {
                Some(next) => from = next,
                None => break,
            }
        }
        Ok(shards)
    }

    fn record_batch(&self, records: &[RememberRecord<'_>]) -> Vec<Result<(), StoreError>> {
        let applied = (|| {
            let txn = self.first().begin_write().map_err(remember_error)?;
            {
                let mut table = txn.open_table(REMEMBERED).map_err(remember_error)?;
                for ((t, s, id), started) in final_states(records) {
                    if started {
                        table.insert((t, s.0, id), ()).map_err(remember_error)?;
                    } else {
                        table.remove((t, s.0, id)).map_err(remember_error)?;
                    }
                }
            }
            txn.commit().map_err(remember_error)
        })();
        match applied {
            Ok(()) => records.iter().map(|_| Ok(())).collect(),
            Err(e) => records.iter().map(|_| Err(e.clone())).collect(),
        }
    }
}
