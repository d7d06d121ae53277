//! Durable entity state: the store SPI (a journal of events, snapshots,
//! durable state), the stores, and a conformance suite a store must pass.
//!
//! ```text
//!   entity incarnation (one writer per persistence id at a time)
//!      │ append(expected = highest seq it knows, events, writer)
//!      ▼
//!   Journal ──── refuses a stale expected sequence number: never forks
//!   SnapshotStore ── latest snapshot at or below a sequence number
//!   DurableStateStore ── upsert with an expected revision
//! ```
//!
//! An entity's state lives under its [`PersistenceId`] (entity type and
//! entity id). Every write names what its writer believes the current
//! position is — the journal's highest sequence number, the durable state's
//! revision — and the store applies it only if that is still true, in one
//! atomic step. Two incarnations of one entity (a split brain, a handoff
//! that timed out) may both try to write; the second one's write is refused
//! with [`PersistenceError::SequenceConflict`] or
//! [`PersistenceError::RevisionConflict`], and the journal stays one
//! history. Each record also carries its [`Writer`] (node incarnation and
//! shard generation), so what wrote it can be told afterwards.
//!
//! The traits are synchronous, as [`RememberEntitiesStore`](crate::RememberEntitiesStore)
//! is: the system calls them off its async workers (on blocking threads),
//! and a write takes a whole batch, so a store can make many entities'
//! appends durable in one commit (group commit). A call the system makes
//! for an ask says, through [`call_deadline`], when its asker stops
//! waiting: a store should not wait for a connection or a server past it.
//! [`conformance`] holds the contract as tests: every store of this crate
//! runs it, and so can a third party's.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

pub mod conformance;
#[cfg(any(feature = "embedded", feature = "fjall"))]
mod copy;
#[cfg(any(feature = "embedded", feature = "fjall"))]
pub use copy::{Copied, EmbeddedStore, copy};
#[cfg(any(feature = "embedded", feature = "fjall"))]
mod record;
#[cfg(feature = "embedded")]
mod redb_store;
pub(crate) mod remember;
#[cfg(feature = "embedded")]
pub use redb_store::RedbPersistence;
#[cfg(feature = "fjall")]
mod fjall_store;
#[cfg(feature = "fjall")]
pub use fjall_store::FjallPersistence;
#[cfg(feature = "postgres")]
mod pg_store;
#[cfg(feature = "postgres")]
pub use pg_store::{PG_CONNECTION_TIMEOUT, PgPersistence};

thread_local! {
    /// See [`call_deadline`].
    static CALL_DEADLINE: std::cell::Cell<Option<std::time::Instant>> =
        const { std::cell::Cell::new(None) };
}

/// When the store call this thread is making must be over: a little
/// before the deadline of the ask that caused it (of the last of the asks
/// whose writes share a batch), so that the asker hears the store's typed
/// error rather than its own timeout. `None` when nothing bounds it: a
/// tell, an ask from another node (the wire does not carry its deadline),
/// an asker gone already.
///
/// The system sets it around the calls an entity's message causes (a
/// recovery, an append, a snapshot, a state's save; they run on its
/// blocking threads and writer threads). A store that waits for what it
/// does not control — a connection from its pool, a server that is away —
/// should stop waiting by then and fail with [`PersistenceError::Store`];
/// the PostgreSQL store's wait for a connection ends then. (An append or
/// a save, once a store call has it, is waited for: its outcome decides
/// the entity's state; one still queued for its batch near the deadline
/// is withdrawn instead, never written.)
pub fn call_deadline() -> Option<std::time::Instant> {
    CALL_DEADLINE.with(std::cell::Cell::get)
}

/// Runs `call` with [`call_deadline`] giving `deadline`, and then what it
/// gave before (a panic in `call` included).
pub(crate) fn with_call_deadline<T>(
    deadline: Option<std::time::Instant>,
    call: impl FnOnce() -> T,
) -> T {
    struct Restore(Option<std::time::Instant>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CALL_DEADLINE.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(CALL_DEADLINE.with(|d| d.replace(deadline)));
    call()
}

/// The marker for a system built without a journal: its registrations
/// have no `event_sourced()`, `durable_state()` nor `snapshotted()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoJournal;

/// Whose state: an entity type and an entity id.
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct PersistenceId {
    /// The entity type's name (its protocol's type name).
    pub type_name: String,
    /// The entity id.
    pub entity_id: String,
}

impl PersistenceId {
    /// Which of `lanes` commit lanes this id's writes take: FNV-1a 64
    /// ([`fnv1a_64`](crate::fnv1a_64)) of the type name, one `0xFF` byte
    /// (never in UTF-8) and the entity id, mixed by MurmurHash3's 64-bit
    /// finalizer, modulo `lanes` (`0` for `lanes` ≤ 1). The mixing keeps
    /// an id's lane from following its shard: FNV-1a's low bits, which a
    /// shard is taken from, depend on the bytes' low bits alone, so one
    /// shard's ids would share a lane; and its high bits barely move with
    /// an id's last character. It is a stored layout's key, and never
    /// changes.
    pub fn lane(&self, lanes: usize) -> usize {
        lane_of(&self.type_name, &self.entity_id, lanes)
    }

    /// The persistence id of `entity_id` of `type_name`.
    pub fn new(type_name: impl Into<String>, entity_id: impl Into<String>) -> Self {
        PersistenceId {
            type_name: type_name.into(),
            entity_id: entity_id.into(),
        }
    }
}

impl std::fmt::Display for PersistenceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}|{}", self.type_name, self.entity_id)
    }
}

/// Who wrote a record: the node (its unique identity) and the shard's
/// allocation generation the entity incarnation ran under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Writer {
    /// The writing node's id (`UniqueAddress::node_id`).
    pub node_id: u64,
    /// The writing node's incarnation (`UniqueAddress::incarnation`).
    pub incarnation: u64,
    /// The allocation generation of the shard the entity ran in.
    pub generation: u64,
}

/// A serialized value with its schema: the wire name of its type and the
/// version of that type's encoding (for evolution: a reader refuses a
/// version it does not know rather than misread it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Payload {
    /// The type's wire name.
    pub manifest: String,
    /// The encoding's version.
    pub version: u32,
    /// The bytes (CBOR, as the crate writes them).
    pub bytes: Vec<u8>,
}

/// One event in a journal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRecord {
    /// Its sequence number: 1 for a persistence id's first event, then one
    /// more for each.
    pub sequence_nr: u64,
    /// The event.
    pub payload: Payload,
    /// Who appended it.
    pub writer: Writer,
}

/// Events to append to one persistence id, all or none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AtomicWrite {
    /// Whose journal.
    pub persistence_id: PersistenceId,
    /// The highest sequence number the writer knows (0 for none): the
    /// write applies only if it is still the journal's highest, and its
    /// events are numbered on from it.
    pub expected: u64,
    /// The events, in order (at least one).
    pub events: Vec<Payload>,
    /// Who writes.
    pub writer: Writer,
}

/// A state to save as the revision after `expected` (one write of a
/// [`DurableStateStore::save_all`] batch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateWrite {
    /// Whose state.
    pub persistence_id: PersistenceId,
    /// The revision the writer knows (0 for none): the write applies only
    /// if it is still the current one.
    pub expected: u64,
    /// The state.
    pub payload: Payload,
    /// Who writes.
    pub writer: Writer,
}

/// A snapshot of an entity's state after an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRecord {
    /// The sequence number of the last event the snapshot includes.
    pub sequence_nr: u64,
    /// The state.
    pub payload: Payload,
    /// Who took it.
    pub writer: Writer,
}

/// A durable state and its revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateRecord {
    /// 1 for the first save, one more for each.
    pub revision: u64,
    /// The state.
    pub payload: Payload,
    /// Who saved it.
    pub writer: Writer,
}

/// Why a persistence operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum PersistenceError {
    /// An append expected another highest sequence number: another writer
    /// appended since (or the writer is stale). Nothing was written.
    #[error(
        "journal of {persistence_id}: the append expected sequence number {expected}, the journal is at {actual}"
    )]
    SequenceConflict {
        /// Whose journal.
        persistence_id: PersistenceId,
        /// What the writer expected.
        expected: u64,
        /// The journal's highest sequence number.
        actual: u64,
    },
    /// A save expected another revision. Nothing was written.
    #[error(
        "durable state of {persistence_id}: the save expected revision {expected}, the store holds {actual}"
    )]
    RevisionConflict {
        /// Whose state.
        persistence_id: PersistenceId,
        /// What the writer expected.
        expected: u64,
        /// The stored revision (0 for none).
        actual: u64,
    },
    /// The write is malformed (say, an append of no events).
    #[error("invalid persistence request: {0}")]
    Invalid(String),
    /// What the store holds does not read back: a record that does not
    /// decode, a gap in sequence numbers.
    #[error("corrupt persistence record of {persistence_id}: {what}")]
    Corrupt {
        /// Whose record.
        persistence_id: PersistenceId,
        /// What is wrong.
        what: String,
    },
    /// The store failed (IO, the database is unreachable); the write may
    /// or may not have been applied only where the store says so.
    #[error("persistence store error: {0}")]
    Store(String),
    /// The call's deadline (`call_deadline`, an ask's) came before the
    /// store took the write — no connection from the pool by then, or the
    /// write still queued for a batch: nothing was sent, nothing written.
    #[error("persistence store not reached in time, nothing written: {0}")]
    Unavailable(String),
}

/// The result of a persistence operation.
pub type PersistenceResult<T> = Result<T, PersistenceError>;

/// An append-only journal of events per persistence id.
///
/// The contract ([`conformance::journal`] tests it): sequence numbers of a
/// persistence id start at 1 and have no gaps; an [`AtomicWrite`] is
/// applied only if its `expected` is the journal's highest sequence number
/// at that moment, all its events or none, numbered `expected + 1…`;
/// what [`append`](Self::append) reported written survives a crash of the
/// process; deleting up to a sequence number removes events but never
/// lowers the highest sequence number.
pub trait Journal: Send + Sync + 'static {
    /// Applies `writes`, one result each, in order: a write to a
    /// persistence id sees the writes before it in the batch. A store may
    /// make the whole batch durable in one commit.
    fn append(&self, writes: &[AtomicWrite]) -> Vec<PersistenceResult<()>>;
    /// The events of `persistence_id` with sequence numbers `from..=to`,
    /// in order, at most `max` of them.
    fn replay(
        &self,
        persistence_id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> PersistenceResult<Vec<EventRecord>>;
    /// The highest sequence number of `persistence_id` (0 for none), even
    /// when its events were deleted.
    fn highest_sequence_nr(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64>;
    /// Deletes the events of `persistence_id` up to `to`, inclusive. (An
    /// event-sourced entity recovers from its whole journal: until it
    /// recovers from snapshots, deleting its events makes its recovery
    /// fail, closed.)
    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()>;
    /// How many batches the store commits at once: a system runs one
    /// batched writer per lane, each with one commit in flight, and sends
    /// a persistence id's writes always through the lane
    /// [`PersistenceId::lane`] names, so they keep their order. One batch
    /// holds writes of one lane only. Default: `1` (one commit at a time).
    fn commit_lanes(&self) -> usize {
        1
    }
    /// How the system's batched writer paces this store's commits.
    /// Default: [`Batching::Linger`].
    fn batching(&self) -> Batching {
        Batching::Linger
    }
}

/// How a system's batched writer paces a store's commits (SPEC §8b): the
/// trade between fuller batches (fewer commits, less CPU) and writes that
/// wait less.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Batching {
    /// After a commit, the next batch waits briefly (at most half the
    /// commit's time, and 1 ms) for the writes that commit answered, so
    /// that they share one commit instead of two half ones: for a store
    /// whose commit has a high fixed cost, such as a B-tree's page writes
    /// or a server's round trip.
    Linger,
    /// The next batch takes what waits as soon as a commit ends: for a
    /// store whose commit is little more than one log append and one
    /// sync, where a fuller batch saves less than the wait costs.
    Eager,
}

/// Snapshots per persistence id.
///
/// The contract ([`conformance::snapshots`]): [`load`](Self::load) gives the
/// snapshot with the highest sequence number at or below the bound; saving
/// at a sequence number that has one replaces it; [`delete_to`](Self::delete_to)
/// removes those at or below.
pub trait SnapshotStore: Send + Sync + 'static {
    /// Saves `snapshot` for `persistence_id`.
    fn save(
        &self,
        persistence_id: &PersistenceId,
        snapshot: SnapshotRecord,
    ) -> PersistenceResult<()>;
    /// The latest snapshot at or below `max_sequence_nr`.
    fn load(
        &self,
        persistence_id: &PersistenceId,
        max_sequence_nr: u64,
    ) -> PersistenceResult<Option<SnapshotRecord>>;
    /// Deletes the snapshots at or below `to`.
    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()>;
}

/// One whole state per persistence id, with a revision.
///
/// The contract ([`conformance::durable_state`]): a save with `expected`
/// equal to the current revision (0 for none) stores the state as revision
/// `expected + 1`; any other `expected` is refused with
/// [`PersistenceError::RevisionConflict`] and changes nothing. Revisions
/// never go back: a delete is a revision too (a tombstone), so a writer
/// that loaded a state before it was deleted and saved again cannot
/// overwrite what came after.
pub trait DurableStateStore: Send + Sync + 'static {
    /// Saves `payload` as the next revision after `expected`.
    fn save(
        &self,
        persistence_id: &PersistenceId,
        expected: u64,
        payload: Payload,
        writer: Writer,
    ) -> PersistenceResult<()>;
    /// The stored state, if any (none after a delete).
    fn load(&self, persistence_id: &PersistenceId) -> PersistenceResult<Option<StateRecord>>;
    /// The current revision: the last save's or delete's (0 for none); the
    /// next save expects it.
    fn revision(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64>;
    /// Deletes the state if the current revision is `expected`, as revision
    /// `expected + 1`.
    fn delete(&self, persistence_id: &PersistenceId, expected: u64) -> PersistenceResult<()>;
    /// Saves several states: one result per write, in order, each as
    /// [`save`](Self::save) would answer it; a write sees the writes before
    /// it (a second write to one id expects the first's revision); a
    /// refused write does not stop the others. A store may commit the whole
    /// batch at once (group commit: the embedded store does, in one
    /// transaction); what is reported saved survives a crash. The default
    /// saves them one by one.
    fn save_all(&self, writes: &[StateWrite]) -> Vec<PersistenceResult<()>> {
        writes
            .iter()
            .map(|w| self.save(&w.persistence_id, w.expected, w.payload.clone(), w.writer))
            .collect()
    }
    /// Whether [`save_all`](Self::save_all) commits a batch at once (the
    /// embedded store's does). A system batches its entities' saves
    /// through it only then; otherwise each save is its own `save` call,
    /// several at a time. Default: `false`.
    fn commits_batches(&self) -> bool {
        false
    }
    /// With [`commits_batches`](Self::commits_batches): how many batches
    /// of saves the store commits at once, as [`Journal::commit_lanes`].
    /// Default: `1`.
    fn commit_lanes(&self) -> usize {
        1
    }
    /// With [`commits_batches`](Self::commits_batches): how the batched
    /// writer paces the store's commits, as [`Journal::batching`].
    /// Default: [`Batching::Linger`].
    fn batching(&self) -> Batching {
        Batching::Linger
    }
}

/// A journal, snapshot store and durable-state store in memory, for tests
/// (nothing survives the process). Clones share one store.
#[derive(Clone, Default)]
pub struct InMemoryPersistence {
    inner: Arc<Mutex<Memory>>,
}

#[derive(Default)]
struct Memory {
    journals: HashMap<PersistenceId, MemoryJournal>,
    snapshots: HashMap<PersistenceId, BTreeMap<u64, SnapshotRecord>>,
    /// The current revision, and the state unless deleted.
    states: HashMap<PersistenceId, (u64, Option<StateRecord>)>,
}

#[derive(Default)]
struct MemoryJournal {
    highest: u64,
    events: BTreeMap<u64, EventRecord>,
}

impl InMemoryPersistence {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The most commit lanes a system runs for one store (one writer thread
/// each), and the most files `RedbPersistence::open_lanes` opens: more
/// buy no more syncs in flight on one disk.
pub const MAX_LANES: usize = 64;

/// [`PersistenceId::lane`] of the id `(type_name, entity_id)`.
pub(crate) fn lane_of(type_name: &str, entity_id: &str, lanes: usize) -> usize {
    if lanes <= 1 {
        return 0;
    }
    let key = type_name.bytes().chain([0xFF]).chain(entity_id.bytes());
    let hash = crate::model::extractor::fnv1a_64_of(key);
    (fmix64(hash) % lanes as u64) as usize
}

/// MurmurHash3's 64-bit finalizer: every bit of the result depends on
/// every bit of `h`.
fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// Checks one atomic write against the highest sequence number: the
/// numbers its events take, or why it is refused.
pub(crate) fn check_append(
    write: &AtomicWrite,
    highest: u64,
) -> PersistenceResult<std::ops::RangeInclusive<u64>> {
    if write.events.is_empty() {
        return Err(PersistenceError::Invalid(format!(
            "an append of no events to {}",
            write.persistence_id
        )));
    }
    if write.expected != highest {
        return Err(PersistenceError::SequenceConflict {
            persistence_id: write.persistence_id.clone(),
            expected: write.expected,
            actual: highest,
        });
    }
    let last = highest
        .checked_add(write.events.len() as u64)
        .ok_or_else(|| PersistenceError::Invalid("sequence numbers overflow".into()))?;
    Ok(highest + 1..=last)
}

impl Journal for InMemoryPersistence {
    fn append(&self, writes: &[AtomicWrite]) -> Vec<PersistenceResult<()>> {
        let mut memory = self.lock();
        writes
            .iter()
            .map(|write| {
                let journal = memory
                    .journals
                    .entry(write.persistence_id.clone())
                    .or_default();
                let numbers = check_append(write, journal.highest)?;
                for (sequence_nr, payload) in numbers.zip(&write.events) {
                    let record = EventRecord {
                        sequence_nr,
                        payload: payload.clone(),
                        writer: write.writer,
                    };
                    journal.events.insert(sequence_nr, record);
                    journal.highest = sequence_nr;
                }
                Ok(())
            })
            .collect()
    }

    fn replay(
        &self,
        persistence_id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> PersistenceResult<Vec<EventRecord>> {
        if from > to {
            return Ok(Vec::new());
        }
        let memory = self.lock();
        Ok(memory
            .journals
            .get(persistence_id)
            .map(|j| {
                j.events
                    .range(from..=to)
                    .take(max)
                    .map(|(_, e)| e.clone())
                    .collect()
            })
            .unwrap_or_default())
    }

    fn highest_sequence_nr(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        Ok(self
            .lock()
            .journals
            .get(persistence_id)
            .map_or(0, |j| j.highest))
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        if let Some(journal) = self.lock().journals.get_mut(persistence_id) {
            journal.events.retain(|sequence_nr, _| *sequence_nr > to);
        }
        Ok(())
    }
}

impl SnapshotStore for InMemoryPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        snapshot: SnapshotRecord,
    ) -> PersistenceResult<()> {
        self.lock()
            .snapshots
            .entry(persistence_id.clone())
            .or_default()
            .insert(snapshot.sequence_nr, snapshot);
        Ok(())
    }

    fn load(
        &self,
        persistence_id: &PersistenceId,
        max_sequence_nr: u64,
    ) -> PersistenceResult<Option<SnapshotRecord>> {
        Ok(self.lock().snapshots.get(persistence_id).and_then(|s| {
            s.range(..=max_sequence_nr)
                .next_back()
                .map(|(_, snapshot)| snapshot.clone())
        }))
    }

    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        if let Some(snapshots) = self.lock().snapshots.get_mut(persistence_id) {
            snapshots.retain(|sequence_nr, _| *sequence_nr > to);
        }
        Ok(())
    }
}

/// Checks a save or delete against the stored revision.
pub(crate) fn check_revision(
    persistence_id: &PersistenceId,
    expected: u64,
    actual: u64,
) -> PersistenceResult<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(PersistenceError::RevisionConflict {
            persistence_id: persistence_id.clone(),
            expected,
            actual,
        })
    }
}

impl DurableStateStore for InMemoryPersistence {
    fn save(
        &self,
        persistence_id: &PersistenceId,
        expected: u64,
        payload: Payload,
        writer: Writer,
    ) -> PersistenceResult<()> {
        let mut memory = self.lock();
        let actual = memory.states.get(persistence_id).map_or(0, |s| s.0);
        check_revision(persistence_id, expected, actual)?;
        let record = StateRecord {
            revision: actual + 1,
            payload,
            writer,
        };
        memory
            .states
            .insert(persistence_id.clone(), (actual + 1, Some(record)));
        Ok(())
    }

    fn load(&self, persistence_id: &PersistenceId) -> PersistenceResult<Option<StateRecord>> {
        Ok(self
            .lock()
            .states
            .get(persistence_id)
            .and_then(|(_, state)| state.clone()))
    }

    fn revision(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        Ok(self.lock().states.get(persistence_id).map_or(0, |s| s.0))
    }

    fn delete(&self, persistence_id: &PersistenceId, expected: u64) -> PersistenceResult<()> {
        let mut memory = self.lock();
        let actual = memory.states.get(persistence_id).map_or(0, |s| s.0);
        check_revision(persistence_id, expected, actual)?;
        memory
            .states
            .insert(persistence_id.clone(), (actual + 1, None));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_in_memory_store_keeps_the_contract() {
        conformance::journal(InMemoryPersistence::new);
        conformance::snapshots(InMemoryPersistence::new);
        conformance::durable_state(InMemoryPersistence::new);
    }

    /// SPEC §8b's lane vectors: the hash, mixed, and the lane of 2, 4
    /// and 8.
    #[test]
    fn a_persistence_id_takes_the_lane_the_spec_says() {
        let cases = [
            (
                "tally",
                "t-1",
                0x7fa8_c745_a811_a7b0_u64,
                0x2978_4219_90b3_1007_u64,
                [1, 3, 7],
            ),
            (
                "tally",
                "t-2",
                0x7fa8_ca45_a811_acc9,
                0x01bd_12fd_aa2c_a33c,
                [0, 0, 4],
            ),
            (
                "tally",
                "t-4",
                0x7fa8_cc45_a811_b02f,
                0xeba0_cea1_8e77_07b2,
                [0, 2, 2],
            ),
            (
                "counter",
                "c-1",
                0xc3b6_95c1_955a_381b,
                0x26ab_3923_ad95_346b,
                [1, 3, 3],
            ),
        ];
        for (type_name, entity_id, hash, mixed, lanes) in cases {
            let id = PersistenceId::new(type_name, entity_id);
            let key = [type_name.as_bytes(), &[0xFF], entity_id.as_bytes()].concat();
            assert_eq!(crate::fnv1a_64(&key), hash, "{id}");
            assert_eq!(fmix64(hash), mixed, "{id}");
            assert_eq!([id.lane(2), id.lane(4), id.lane(8)], lanes, "{id}");
            assert_eq!((id.lane(0), id.lane(1)), (0, 0), "{id}");
        }
    }

    /// The ids of one shard spread over every lane, for shard counts that
    /// are and are not powers of two, so a node's writes use all its
    /// lanes whichever shards it holds.
    #[test]
    fn the_ids_of_one_shard_spread_over_every_lane() {
        use crate::model::extractor::{DefaultShardExtractor, ShardExtractor};
        for shards in [64, 100, 1024] {
            for lanes in [2, 4, 8] {
                let mut seen =
                    std::collections::HashMap::<u32, std::collections::BTreeSet<usize>>::new();
                for k in 0..(shards as usize * 200) {
                    let entity_id = format!("e-{k}");
                    let shard = DefaultShardExtractor.shard_id(&entity_id, shards).0;
                    let lane = PersistenceId::new("pinger", entity_id).lane(lanes);
                    seen.entry(shard).or_default().insert(lane);
                }
                for (shard, used) in seen {
                    assert_eq!(
                        used.len(),
                        lanes,
                        "{shards} shards, {lanes} lanes: shard {shard} uses {used:?}"
                    );
                }
            }
        }
    }
}
