//! The log-structured embedded store: journal, snapshots, durable state
//! and remembered entities in one [fjall](https://docs.rs/fjall) database
//! (a directory) per node.
//!
//! fjall is an LSM tree in pure Rust: a commit appends one record of the
//! whole batch to one log file (its journal) and syncs it, and the trees
//! are written later in the background, in large sequential files. A
//! commit of 16 small events is one `write` and one `fdatasync`, where a
//! copy-on-write B-tree (redb) writes every page the batch touched (about
//! 17 `pwrite`s): on the machine of BENCHMARKS.md the raw commit costs 7
//! µs of CPU per event against redb's 17, and its rate is 2.2× redb's.
//!
//! Keyspaces (a key starts with the persistence id: the type name's length
//! as `u32` big-endian, its UTF-8 bytes, the entity id's length, its bytes
//! — so one id's keys are one range, in order):
//!
//! | keyspace | key | value |
//! |---|---|---|
//! | `events` | id, `sequence_nr` (`u64` BE) | a record (SPEC §8b) |
//! | `highest` | id | the highest sequence number, `u64` BE |
//! | `snapshots` | id, `sequence_nr` (`u64` BE) | a record |
//! | `states` | id | the revision, `u64` BE, then a record (none: deleted) |
//! | `remembered` | type name (length, bytes), shard (`u32` BE), entity id | empty |
//!
//! A write checks what it expects (the highest sequence number, the
//! revision) and commits under one lock, so two writers of one id never
//! both pass; it syncs after that lock (fjall's own log lock still lets one
//! commit or sync at a time). Syncing the log syncs every commit before
//! it: a write reported durable never rests on one that is not. After a
//! failed commit or sync, what the store holds in memory may be more than
//! what is on the disk: the store then fails closed, every later call,
//! reads included, answering [`PersistenceError::Store`] until it is
//! opened again (and fjall itself refuses every later write). A key holds
//! at most 65,535 bytes (fjall's limit): a write to a persistence id whose
//! names are longer than that allows is refused
//! ([`PersistenceError::Invalid`]), alone.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::{Arc, Mutex};

use fjall::{Database, Keyspace, KeyspaceCreateOptions, PersistMode};
use lru::LruCache;

use super::copy::{Records, Stored};
use super::record::{decode, encode, read_state};
use super::remember::{
    RememberEntitiesStore, RememberRecord, StoreError, final_states, record_one,
};
use super::{
    AtomicWrite, Batching, DurableStateStore, EventRecord, Journal, Payload, PersistenceError,
    PersistenceId, PersistenceResult, SnapshotRecord, SnapshotStore, StateRecord, StateWrite,
    Writer, check_append, check_revision,
};
use crate::model::extractor::ShardId;

/// The log-structured embedded store (see the module docs). Clones share
/// one open database; a second open of the same directory, by this
/// process or another, is refused.
#[derive(Clone)]
pub struct FjallPersistence {
    inner: Arc<Inner>,
}

struct Inner {
    db: Database,
    events: Keyspace,
    highest: Keyspace,
    snapshots: Keyspace,
    states: Keyspace,
    remembered: Keyspace,
    /// Held from a write's check to its commit (not its sync).
    commit: Mutex<Known>,
    /// Set by a failed commit or sync: every later call is refused.
    failed: std::sync::atomic::AtomicBool,
    /// Held through a sync and the marking of its failure, so that no
    /// sync after a failed one can report success: on Linux a second
    /// `fdatasync` after a failed one may succeed with the first's pages
    /// lost, and fjall marks itself failed only once its `persist` has
    /// returned.
    syncing: Mutex<()>,
}

/// How many persistence ids' highest numbers, and how many revisions, the
/// store keeps in memory (a few in its unit tests, so that they read past
/// what it forgot).
const KNOWN: usize = if cfg!(test) { 16 } else { 65_536 };

/// The highest sequence numbers and revisions of recently written ids,
/// as committed: a write's check reads them here instead of searching
/// the tree (whose in-memory table holds every version of a key until it
/// is flushed, so a point read there grows with the writes). Only
/// written under the commit lock, after a commit succeeded.
struct Known {
    highest: LruCache<Vec<u8>, u64>,
    revisions: LruCache<Vec<u8>, u64>,
}

impl Known {
    fn new() -> Known {
        let cap = NonZeroUsize::new(KNOWN).expect("KNOWN > 0");
        Known {
            highest: LruCache::new(cap),
            revisions: LruCache::new(cap),
        }
    }
}

fn store_error(error: impl std::fmt::Display) -> PersistenceError {
    PersistenceError::Store(error.to_string())
}

fn remember_error(error: impl std::fmt::Display) -> StoreError {
    StoreError(error.to_string())
}

impl FjallPersistence {
    /// Opens the store in the directory `dir`, creating it if missing.
    pub fn open(dir: impl AsRef<Path>) -> PersistenceResult<Self> {
        let dir = dir.as_ref();
        let db = Database::builder(dir)
            .open()
            .map_err(|e| PersistenceError::Store(format!("opening {}: {e}", dir.display())))?;
        let keyspace = |name: &str| {
            db.keyspace(name, KeyspaceCreateOptions::default)
                .map_err(store_error)
        };
        let inner = Inner {
            events: keyspace("events")?,
            highest: keyspace("highest")?,
            snapshots: keyspace("snapshots")?,
            states: keyspace("states")?,
            remembered: keyspace("remembered")?,
            db,
            commit: Mutex::new(Known::new()),
            failed: Default::default(),
            syncing: Mutex::new(()),
        };
        Ok(FjallPersistence {
            inner: Arc::new(inner),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        self.inner.commit.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses every call once a commit or a sync failed.
    fn usable(&self) -> PersistenceResult<()> {
        if self.inner.failed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(PersistenceError::Store(
                "an earlier commit or sync failed: open the store again".into(),
            ));
        }
        Ok(())
    }

    /// Marks the store failed (see [`usable`](Self::usable)).
    fn failed(&self, error: impl std::fmt::Display) -> PersistenceError {
        self.inner
            .failed
            .store(true, std::sync::atomic::Ordering::Release);
        store_error(error)
    }

    /// Commits `batch` (not yet durable).
    fn commit(&self, batch: fjall::OwnedWriteBatch) -> PersistenceResult<()> {
        batch.commit().map_err(|e| self.failed(e))
    }

    /// Makes every commit so far durable; refused after a failed one.
    fn sync(&self) -> PersistenceResult<()> {
        let _syncing = self.inner.syncing.lock().unwrap_or_else(|p| p.into_inner());
        self.usable()?;
        self.inner
            .db
            .persist(PersistMode::SyncData)
            .map_err(|e| self.failed(e))
    }
}

/// The longest key fjall takes.
const MAX_KEY: usize = u16::MAX as usize;

/// [`id_key`], refused when a numbered key of it would pass [`MAX_KEY`].
fn checked_id_key(id: &PersistenceId) -> PersistenceResult<Vec<u8>> {
    if 8 + id.type_name.len() + id.entity_id.len() + 8 > MAX_KEY {
        return Err(PersistenceError::Invalid(format!(
            "a persistence id of {} bytes: the fjall store keys at most {}",
            id.type_name.len() + id.entity_id.len(),
            MAX_KEY - 16
        )));
    }
    Ok(id_key(id))
}

/// A persistence id's key: the type name and the entity id, each after
/// its length.
fn id_key(id: &PersistenceId) -> Vec<u8> {
    let mut key = Vec::with_capacity(8 + id.type_name.len() + id.entity_id.len() + 8);
    for part in [&id.type_name, &id.entity_id] {
        key.extend_from_slice(&(part.len() as u32).to_be_bytes());
        key.extend_from_slice(part.as_bytes());
    }
    key
}

/// An event's or a snapshot's key: the id's key, then the number.
fn numbered(id_key: &[u8], n: u64) -> Vec<u8> {
    [id_key, &n.to_be_bytes()].concat()
}

/// The number at the end of a numbered key.
fn number_of(key: &[u8]) -> u64 {
    key.last_chunk::<8>().map_or(0, |n| u64::from_be_bytes(*n))
}

fn u64_of(id: &PersistenceId, value: &[u8]) -> PersistenceResult<u64> {
    match value.first_chunk::<8>() {
        Some(n) => Ok(u64::from_be_bytes(*n)),
        None => Err(PersistenceError::Corrupt {
            persistence_id: id.clone(),
            what: format!("a number of {} bytes", value.len()),
        }),
    }
}

impl Journal for FjallPersistence {
    /// One commit and one sync for the whole batch.
    fn append(&self, writes: &[AtomicWrite]) -> Vec<PersistenceResult<()>> {
        let inner = &self.inner;
        let committed = (|| {
            self.usable()?;
            let mut known = self.lock();
            let mut batch = inner.db.batch();
            // Within the batch, a second write to one id sees the first.
            let mut tops: HashMap<Vec<u8>, u64> = HashMap::new();
            let mut results = Vec::with_capacity(writes.len());
            let mut buffer = Vec::new();
            for write in writes {
                let id = &write.persistence_id;
                // What fails for one id fails its write alone.
                let read = checked_id_key(id).and_then(|key| {
                    let top = match tops.get(&key).or_else(|| known.highest.get(&key)) {
                        Some(top) => *top,
                        None => match inner.highest.get(&key).map_err(store_error)? {
                            Some(v) => u64_of(id, &v)?,
                            None => 0,
                        },
                    };
                    Ok((key, top))
                });
                let (key, top) = match read {
                    Ok(read) => read,
                    Err(error) => {
                        results.push(Err(error));
                        continue;
                    }
                };
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
                    batch.insert(&inner.events, numbered(&key, n), buffer.as_slice());
                }
                batch.insert(
                    &inner.highest,
                    key.as_slice(),
                    last.to_be_bytes().as_slice(),
                );
                tops.insert(key, last);
                results.push(Ok(()));
            }
            self.commit(batch)?;
            for (key, last) in tops {
                known.highest.put(key, last);
            }
            Ok::<_, PersistenceError>(results)
        })();
        // A failed commit wrote nothing; a failed sync leaves the store
        // refusing writes, and what it committed unknown: every write
        // fails with it.
        let synced = committed.and_then(|results| self.sync().map(|()| results));
        synced.unwrap_or_else(|error| writes.iter().map(|_| Err(error.clone())).collect())
    }

    fn replay(
        &self,
        persistence_id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> PersistenceResult<Vec<EventRecord>> {
        self.usable()?;
        let key = checked_id_key(persistence_id)?;
        if from > to || max == 0 {
            return Ok(Vec::new());
        }
        let range = numbered(&key, from)..=numbered(&key, to);
        let mut out: Vec<EventRecord> = Vec::new();
        for entry in self.inner.events.range(range).take(max) {
            let (key, value) = entry.into_inner().map_err(store_error)?;
            let sequence_nr = number_of(&key);
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
            let (payload, writer) = decode(persistence_id, &value)?;
            out.push(EventRecord {
                sequence_nr,
                payload,
                writer,
            });
        }
        Ok(out)
    }

    fn highest_sequence_nr(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        self.usable()?;
        match self
            .inner
            .highest
            .get(checked_id_key(persistence_id)?)
            .map_err(store_error)?
        {
            Some(v) => u64_of(persistence_id, &v),
            None => Ok(0),
        }
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        remove_range(self, &self.inner.events, persistence_id, to)
    }

    /// A commit is one log append and one sync: batches go at once.
    fn batching(&self) -> Batching {
        Batching::Eager
    }
}

/// Removes `id`'s numbered keys up to `to` from `keyspace`, in one commit.
fn remove_range(
    store: &FjallPersistence,
    keyspace: &Keyspace,
    id: &PersistenceId,
    to: u64,
) -> PersistenceResult<()> {
    store.usable()?;
    let key = checked_id_key(id)?;
    {
        let _commit = store.lock();
        let mut batch = store.inner.db.batch();
        for entry in keyspace.range(numbered(&key, 0)..=numbered(&key, to)) {
            batch.remove(keyspace, entry.key().map_err(store_error)?);
        }
        store.commit(batch)?;
    }
    store.sync()
}

impl SnapshotStore for FjallPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        snapshot: SnapshotRecord,
    ) -> PersistenceResult<()> {
        self.usable()?;
        let mut key = checked_id_key(persistence_id)?;
        key.extend_from_slice(&snapshot.sequence_nr.to_be_bytes());
        let mut buffer = Vec::new();
        encode(&snapshot.payload, snapshot.writer, &mut buffer);
        {
            let _commit = self.lock();
            let mut batch = self.inner.db.batch();
            batch.insert(&self.inner.snapshots, key, buffer);
            self.commit(batch)?;
        }
        self.sync()
    }

    fn load(
        &self,
        persistence_id: &PersistenceId,
        max_sequence_nr: u64,
    ) -> PersistenceResult<Option<SnapshotRecord>> {
        self.usable()?;
        let key = checked_id_key(persistence_id)?;
        let Some(entry) = self
            .inner
            .snapshots
            .range(numbered(&key, 0)..=numbered(&key, max_sequence_nr))
            .next_back()
        else {
            return Ok(None);
        };
        let (key, value) = entry.into_inner().map_err(store_error)?;
        let (payload, writer) = decode(persistence_id, &value)?;
        Ok(Some(SnapshotRecord {
            sequence_nr: number_of(&key),
            payload,
            writer,
        }))
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        remove_range(self, &self.inner.snapshots, persistence_id, to)
    }
}

/// The current revision of `id`'s state (0 for none).
fn revision_of(store: &FjallPersistence, id: &PersistenceId, key: &[u8]) -> PersistenceResult<u64> {
    match store.inner.states.get(key).map_err(store_error)? {
        Some(value) => u64_of(id, &value),
        None => Ok(0),
    }
}

impl DurableStateStore for FjallPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        expected: u64,
        payload: Payload,
        writer: Writer,
    ) -> PersistenceResult<()> {
        let write = StateWrite {
            persistence_id: persistence_id.clone(),
            expected,
            payload,
            writer,
        };
        self.save_all(std::slice::from_ref(&write))
            .pop()
            .unwrap_or_else(|| Err(store_error("no result")))
    }

    fn commits_batches(&self) -> bool {
        true
    }

    /// One commit and one sync for the whole batch.
    fn save_all(&self, writes: &[StateWrite]) -> Vec<PersistenceResult<()>> {
        let committed = (|| {
            self.usable()?;
            let mut known = self.lock();
            let mut batch = self.inner.db.batch();
            let mut revisions: HashMap<Vec<u8>, u64> = HashMap::new();
            let mut results = Vec::with_capacity(writes.len());
            for w in writes {
                let id = &w.persistence_id;
                // What fails for one id fails its write alone.
                let read = checked_id_key(id).and_then(|key| {
                    let actual = match revisions.get(&key).or_else(|| known.revisions.get(&key)) {
                        Some(revision) => *revision,
                        None => revision_of(self, id, &key)?,
                    };
                    Ok((key, actual))
                });
                let (key, actual) = match read {
                    Ok(read) => read,
                    Err(error) => {
                        results.push(Err(error));
                        continue;
                    }
                };
                if let Err(refused) = check_revision(id, w.expected, actual) {
                    results.push(Err(refused));
                    continue;
                }
                let mut value = (actual + 1).to_be_bytes().to_vec();
                encode(&w.payload, w.writer, &mut value);
                batch.insert(&self.inner.states, key.as_slice(), value);
                revisions.insert(key, actual + 1);
                results.push(Ok(()));
            }
            self.commit(batch)?;
            for (key, revision) in revisions {
                known.revisions.put(key, revision);
            }
            Ok::<_, PersistenceError>(results)
        })();
        let synced = committed.and_then(|results| self.sync().map(|()| results));
        synced.unwrap_or_else(|error| writes.iter().map(|_| Err(error.clone())).collect())
    }

    fn load(&self, persistence_id: &PersistenceId) -> PersistenceResult<Option<StateRecord>> {
        self.usable()?;
        match self
            .inner
            .states
            .get(checked_id_key(persistence_id)?)
            .map_err(store_error)?
        {
            Some(value) => Ok(read_state(persistence_id, &value)?.1),
            None => Ok(None),
        }
    }

    fn revision(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        self.usable()?;
        revision_of(self, persistence_id, &checked_id_key(persistence_id)?)
    }

    fn delete(&self, persistence_id: &PersistenceId, expected: u64) -> PersistenceResult<()> {
        {
            self.usable()?;
            let mut known = self.lock();
            let key = checked_id_key(persistence_id)?;
            let actual = match known.revisions.get(&key) {
                Some(revision) => *revision,
                None => revision_of(self, persistence_id, &key)?,
            };
            check_revision(persistence_id, expected, actual)?;
            // The tombstone: the revision alone.
            let mut batch = self.inner.db.batch();
            let tombstone = (actual + 1).to_be_bytes();
            batch.insert(&self.inner.states, key.as_slice(), tombstone.as_slice());
            self.commit(batch)?;
            known.revisions.put(key, actual + 1);
        }
        self.sync()
    }

    fn batching(&self) -> Batching {
        Batching::Eager
    }
}

/// A remembered id's key prefix: the type name (after its length) and
/// the shard.
fn shard_prefix(type_name: &str, shard: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(8 + type_name.len());
    key.extend_from_slice(&(type_name.len() as u32).to_be_bytes());
    key.extend_from_slice(type_name.as_bytes());
    key.extend_from_slice(&shard.to_be_bytes());
    key
}

/// Refuses a type name too long for a remembered id's key.
fn type_fits(type_name: &str) -> Result<(), StoreError> {
    if 8 + type_name.len() > MAX_KEY {
        return Err(StoreError(format!(
            "a type name of {} bytes: the fjall store keys at most {}",
            type_name.len(),
            MAX_KEY - 8
        )));
    }
    Ok(())
}

/// Remember-entities in the node's database: one commit (and sync) per
/// batch, its records reduced to each id's last state. As with
/// `FileStore`, a dead node's remembered ids come back only when that
/// node (its directory) does.
impl RememberEntitiesStore for FjallPersistence {
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
        self.usable().map_err(remember_error)?;
        type_fits(type_name)?;
        let prefix = shard_prefix(type_name, shard_id.0);
        let mut ids = Vec::new();
        for entry in self.inner.remembered.prefix(&prefix) {
            let key = entry.key().map_err(remember_error)?;
            let id = std::str::from_utf8(&key[prefix.len()..])
                .map_err(|_| StoreError("a remembered id that is not UTF-8".into()))?;
            ids.push(id.to_owned());
        }
        Ok(ids)
    }

    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        self.usable().map_err(remember_error)?;
        type_fits(type_name)?;
        let mut shards = Vec::new();
        let mut from = 0u32;
        // One look-up per shard: from each shard found, on to the next.
        loop {
            let start = shard_prefix(type_name, from);
            let type_prefix = &start[..start.len() - 4];
            let Some(entry) = self.inner.remembered.range(start.clone()..).next() else {
                break;
            };
            let key = entry.key().map_err(remember_error)?;
            let Some(shard) = key
                .strip_prefix(type_prefix)
                .and_then(|rest| rest.first_chunk::<4>())
            else {
                break;
            };
            let shard = u32::from_be_bytes(*shard);
            shards.push(ShardId(shard));
            match shard.checked_add(1) {
                Some(next) => from = next,
                None => break,
            }
        }
        Ok(shards)
    }

    /// A record whose key would be too long for fjall is answered alone;
    /// the others are committed.
    fn record_batch(&self, records: &[RememberRecord<'_>]) -> Vec<Result<(), StoreError>> {
        let too_long = |r: &RememberRecord<'_>| 8 + r.type_name.len() + r.entity_id.len() > MAX_KEY;
        let fitting: Vec<RememberRecord<'_>> =
            records.iter().filter(|r| !too_long(r)).copied().collect();
        let applied = (|| {
            self.usable()?;
            {
                let _commit = self.lock();
                let mut batch = self.inner.db.batch();
                for ((t, s, id), started) in final_states(&fitting) {
                    let mut key = shard_prefix(t, s.0);
                    key.extend_from_slice(id.as_bytes());
                    if started {
                        batch.insert(&self.inner.remembered, key, [].as_slice());
                    } else {
                        batch.remove(&self.inner.remembered, key);
                    }
                }
                self.commit(batch)?;
            }
            self.sync()
        })()
        .map_err(remember_error);
        records
            .iter()
            .map(|r| match &applied {
                _ if too_long(r) => Err(StoreError(format!(
                    "a remembered entity of {} bytes: the fjall store keys at most {}",
                    r.type_name.len() + r.entity_id.len(),
                    MAX_KEY - 8
                ))),
                Ok(()) => Ok(()),
                Err(e) => Err(e.clone()),
            })
            .collect()
    }
}

/// Reads a persistence id's key back: the type name, the entity id, and
/// what follows them.
fn split_id_key(key: &[u8]) -> PersistenceResult<(String, String, &[u8])> {
    let mut rest = key;
    let mut part = || {
        let (len, after) = rest.split_first_chunk::<4>()?;
        let len = u32::from_be_bytes(*len) as usize;
        let text = std::str::from_utf8(after.get(..len)?).ok()?.to_owned();
        rest = &after[len..];
        Some(text)
    };
    let (Some(t), Some(id)) = (part(), part()) else {
        return Err(PersistenceError::Store(format!(
            "a key that does not read: {key:02x?}"
        )));
    };
    Ok((t, id, rest))
}

fn number_in(key: &[u8], rest: &[u8]) -> PersistenceResult<u64> {
    match <[u8; 8]>::try_from(rest) {
        Ok(n) => Ok(u64::from_be_bytes(n)),
        Err(_) => Err(PersistenceError::Store(format!(
            "a key that does not read: {key:02x?}"
        ))),
    }
}

impl Records for FjallPersistence {
    fn holds_nothing(&self) -> PersistenceResult<bool> {
        self.usable()?;
        let inner = &self.inner;
        for keyspace in [
            &inner.events,
            &inner.highest,
            &inner.snapshots,
            &inner.states,
            &inner.remembered,
        ] {
            if !keyspace.is_empty().map_err(store_error)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn export(
        &self,
        each: &mut dyn FnMut(Stored) -> PersistenceResult<()>,
    ) -> PersistenceResult<()> {
        self.usable()?;
        let inner = &self.inner;
        for entry in inner.events.iter() {
            let (key, value) = entry.into_inner().map_err(store_error)?;
            let (t, id, rest) = split_id_key(&key)?;
            each(Stored::Event(t, id, number_in(&key, rest)?, value.to_vec()))?;
        }
        for entry in inner.highest.iter() {
            let (key, value) = entry.into_inner().map_err(store_error)?;
            let (t, id, _) = split_id_key(&key)?;
            let n = u64_of(&PersistenceId::new(t.clone(), id.clone()), &value)?;
            each(Stored::Highest(t, id, n))?;
        }
        for entry in inner.snapshots.iter() {
            let (key, value) = entry.into_inner().map_err(store_error)?;
            let (t, id, rest) = split_id_key(&key)?;
            each(Stored::Snapshot(
                t,
                id,
                number_in(&key, rest)?,
                value.to_vec(),
            ))?;
        }
        for entry in inner.states.iter() {
            let (key, value) = entry.into_inner().map_err(store_error)?;
            let (t, id, _) = split_id_key(&key)?;
            each(Stored::State(t, id, value.to_vec()))?;
        }
        for entry in inner.remembered.iter() {
            let key = entry.key().map_err(store_error)?;
            let unreadable =
                || PersistenceError::Store(format!("a key that does not read: {key:02x?}"));
            let (len, after) = key.split_first_chunk::<4>().ok_or_else(unreadable)?;
            let len = u32::from_be_bytes(*len) as usize;
            let t = after.get(..len).and_then(|t| std::str::from_utf8(t).ok());
            let rest = after.get(len..).and_then(|r| r.split_first_chunk::<4>());
            let (Some(t), Some((shard, id))) = (t, rest) else {
                return Err(unreadable());
            };
            let id = std::str::from_utf8(id).map_err(|_| unreadable())?;
            each(Stored::Remembered(
                t.into(),
                u32::from_be_bytes(*shard),
                id.into(),
            ))?;
        }
        Ok(())
    }

    /// One commit and one sync for the lot.
    fn import(&self, records: &[Stored]) -> PersistenceResult<()> {
        self.usable()?;
        if records.is_empty() {
            return Ok(());
        }
        // A record whose key fjall cannot take is refused before anything
        // of the chunk is written.
        for record in records {
            let (t, id, extra) = match record {
                Stored::Event(t, id, ..) | Stored::Snapshot(t, id, ..) => (t, id, 16),
                Stored::Highest(t, id, _) | Stored::State(t, id, _) => (t, id, 8),
                Stored::Remembered(t, _, id) => (t, id, 8),
            };
            if t.len() + id.len() + extra > MAX_KEY {
                return Err(PersistenceError::Invalid(format!(
                    "a record of {t}'s id of {} bytes: the fjall store keys at most {}",
                    id.len(),
                    MAX_KEY - extra
                )));
            }
        }
        let inner = &self.inner;
        let key = |t: &str, id: &str| id_key(&PersistenceId::new(t, id));
        {
            // What the records hold is read from the store from now on.
            let mut known = self.lock();
            known.highest.clear();
            known.revisions.clear();
            let mut batch = inner.db.batch();
            for record in records {
                match record {
                    Stored::Event(t, id, n, value) => {
                        batch.insert(&inner.events, numbered(&key(t, id), *n), value.as_slice());
                    }
                    Stored::Highest(t, id, n) => {
                        batch.insert(&inner.highest, key(t, id), n.to_be_bytes().as_slice());
                    }
                    Stored::Snapshot(t, id, n, value) => {
                        batch.insert(
                            &inner.snapshots,
                            numbered(&key(t, id), *n),
                            value.as_slice(),
                        );
                    }
                    Stored::State(t, id, value) => {
                        batch.insert(&inner.states, key(t, id), value.as_slice());
                    }
                    Stored::Remembered(t, shard, id) => {
                        let mut k = shard_prefix(t, *shard);
                        k.extend_from_slice(id.as_bytes());
                        batch.insert(&inner.remembered, k, [].as_slice());
                    }
                }
            }
            self.commit(batch)?;
        }
        self.sync()
    }
}

#[cfg(test)]
#[path = "fjall_tests.rs"]
mod tests;
