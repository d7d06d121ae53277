//! Copying one embedded store into another, of any kind and layout
//! ([`copy`]): the way from a redb file to a directory of redb lanes, or
//! to fjall, and back.

use super::{PersistenceError, PersistenceResult};

/// One stored record, as both embedded stores keep it: the keys' parts,
/// and the value's bytes untouched (records keep their writers, states
/// their revisions, tombstones stay tombstones).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Stored {
    /// An event: the type name, the entity id, its sequence number, its
    /// record.
    Event(String, String, u64, Vec<u8>),
    /// A persistence id's highest sequence number (which outlives deleted
    /// events).
    Highest(String, String, u64),
    /// A snapshot: the type name, the entity id, its sequence number, its
    /// record.
    Snapshot(String, String, u64, Vec<u8>),
    /// A durable state's stored value: its revision, then its record (none
    /// for a tombstone).
    State(String, String, Vec<u8>),
    /// A remembered entity: the type name, the shard, the entity id.
    Remembered(String, u32, String),
}

/// What [`copy`] needs of a store.
pub(crate) trait Records {
    /// Whether the store holds no record at all.
    fn holds_nothing(&self) -> PersistenceResult<bool>;
    /// Calls `each` with every record (each file or keyspace read on its
    /// own: the store must be quiet).
    fn export(
        &self,
        each: &mut dyn FnMut(Stored) -> PersistenceResult<()>,
    ) -> PersistenceResult<()>;
    /// Writes `records` durably, each where this store keeps it.
    fn import(&self, records: &[Stored]) -> PersistenceResult<()>;
}

/// An embedded store that [`copy`] reads from or writes to; made from a
/// reference to either (`&store` converts).
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum EmbeddedStore<'a> {
    /// The redb store, of any layout.
    #[cfg(feature = "embedded")]
    Redb(&'a super::RedbPersistence),
    /// The fjall store.
    #[cfg(feature = "fjall")]
    Fjall(&'a super::FjallPersistence),
}

#[cfg(feature = "embedded")]
impl<'a> From<&'a super::RedbPersistence> for EmbeddedStore<'a> {
    fn from(store: &'a super::RedbPersistence) -> Self {
        EmbeddedStore::Redb(store)
    }
}

#[cfg(feature = "fjall")]
impl<'a> From<&'a super::FjallPersistence> for EmbeddedStore<'a> {
    fn from(store: &'a super::FjallPersistence) -> Self {
        EmbeddedStore::Fjall(store)
    }
}

impl EmbeddedStore<'_> {
    fn records(&self) -> &dyn Records {
        match *self {
            #[cfg(feature = "embedded")]
            EmbeddedStore::Redb(store) => store,
            #[cfg(feature = "fjall")]
            EmbeddedStore::Fjall(store) => store,
        }
    }
}

/// What [`copy`] copied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    /// Events.
    pub events: u64,
    /// Persistence ids with a highest sequence number.
    pub journals: u64,
    /// Snapshots.
    pub snapshots: u64,
    /// Durable states, tombstones included.
    pub states: u64,
    /// Remembered entity ids.
    pub remembered: u64,
}

/// How many records one commit of the target takes.
const CHUNK: usize = 16_384;

/// Copies every record of `from` into `to`, an empty store of either kind
/// and any layout, as it is stored (writers, revisions, tombstones and
/// highest sequence numbers kept). Both stores must be closed to
/// everything else meanwhile: no system may run on either. `to` commits
/// in chunks, so a copy cut short leaves it part-filled: copy again into
/// a new, empty one. A `to` that holds anything is refused
/// ([`PersistenceError::Invalid`]).
pub fn copy<'a>(
    from: impl Into<EmbeddedStore<'a>>,
    to: impl Into<EmbeddedStore<'a>>,
) -> PersistenceResult<Copied> {
    let (from, to) = (from.into(), to.into());
    let (from, to) = (from.records(), to.records());
    if !to.holds_nothing()? {
        return Err(PersistenceError::Invalid(
            "the store to copy into is not empty".into(),
        ));
    }
    let mut copied = Copied::default();
    let mut chunk = Vec::with_capacity(CHUNK);
    from.export(&mut |record| {
        let count = match &record {
            Stored::Event(..) => &mut copied.events,
            Stored::Highest(..) => &mut copied.journals,
            Stored::Snapshot(..) => &mut copied.snapshots,
            Stored::State(..) => &mut copied.states,
            Stored::Remembered(..) => &mut copied.remembered,
        };
        *count += 1;
        chunk.push(record);
        if chunk.len() == CHUNK {
            to.import(&chunk)?;
            chunk.clear();
        }
        Ok(())
    })?;
    to.import(&chunk)?;
    Ok(copied)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::Copied;
    use crate::model::extractor::ShardId;
    use crate::persistence::remember::RememberEntitiesStore;
    use crate::persistence::{
        AtomicWrite, DurableStateStore, Journal, Payload, PersistenceId, SnapshotRecord,
        SnapshotStore, Writer,
    };

    const WRITER: Writer = Writer {
        node_id: 7,
        incarnation: 8,
        generation: 9,
    };

    fn payload(n: u8) -> Payload {
        Payload {
            manifest: "counter.added".into(),
            version: 2,
            bytes: vec![n; 3],
        }
    }

    fn ids() -> Vec<PersistenceId> {
        (0..40)
            .map(|i| PersistenceId::new("counter", format!("c-{i}")))
            .collect()
    }

    /// Fills `store` with 40 ids' events (1 to 3 each, id 2's first two
    /// deleted, id 4's two all deleted), snapshots, states (id 3's deleted: a tombstone) and
    /// remembered ids over five shards; what a copy of it copies.
    pub(crate) fn fill(
        store: &(impl Journal + SnapshotStore + DurableStateStore + RememberEntitiesStore),
    ) -> Copied {
        let ids = ids();
        for (i, id) in ids.iter().enumerate() {
            let write = AtomicWrite {
                persistence_id: id.clone(),
                expected: 0,
                events: (0..=(i % 3) as u8).map(payload).collect(),
                writer: WRITER,
            };
            assert_eq!(store.append(&[write]), vec![Ok(())]);
            let snapshot = SnapshotRecord {
                sequence_nr: 1,
                payload: payload(50),
                writer: WRITER,
            };
            SnapshotStore::save(store, id, snapshot).expect("snapshot");
            DurableStateStore::save(store, id, 0, payload(60), WRITER).expect("state");
            store
                .record_entity_started("counter", ShardId(i as u32 % 5), &id.entity_id)
                .expect("remember");
        }
        Journal::delete_to(store, &ids[2], 2).expect("delete");
        Journal::delete_to(store, &ids[4], 2).expect("delete all");
        DurableStateStore::delete(store, &ids[3], 1).expect("tombstone");
        // 14 ids of one event, 13 of two, 13 of three, less the four deleted.
        Copied {
            events: 75,
            journals: 40,
            snapshots: 40,
            states: 40,
            remembered: 40,
        }
    }

    /// Checks that `store` reads back all that [`fill`] wrote.
    pub(crate) fn holds_what_fill_wrote(
        store: &(impl Journal + SnapshotStore + DurableStateStore + RememberEntitiesStore),
    ) {
        for (i, id) in ids().iter().enumerate() {
            let n = (i % 3) as u64 + 1;
            assert_eq!(store.highest_sequence_nr(id), Ok(n), "{id}");
            let events = store.replay(id, 1, u64::MAX, 10).expect("replay");
            let from = match i {
                2 => 3,
                4 => 3, // none left; the highest number stays
                _ => 1,
            };
            assert_eq!(
                events.iter().map(|e| e.sequence_nr).collect::<Vec<_>>(),
                (from..=n).collect::<Vec<_>>(),
                "{id}"
            );
            assert!(events.iter().all(|e| e.writer == WRITER));
            let snapshot = SnapshotStore::load(store, id, u64::MAX).expect("load");
            assert_eq!(snapshot.map(|s| s.payload), Some(payload(50)));
            let state = DurableStateStore::load(store, id).expect("state");
            let revision = DurableStateStore::revision(store, id).expect("revision");
            if i == 3 {
                assert_eq!((state, revision), (None, 2), "the tombstone");
            } else {
                assert_eq!(
                    state.map(|s| (s.revision, s.payload, s.writer)),
                    Some((1, payload(60), WRITER))
                );
            }
        }
        for shard in 0..5u32 {
            let mut listed = store
                .list_entities_for_shard("counter", ShardId(shard))
                .expect("list");
            listed.sort();
            let mut want: Vec<String> = (0..40)
                .filter(|i| i % 5 == shard as usize)
                .map(|i| format!("c-{i}"))
                .collect();
            want.sort();
            assert_eq!(listed, want, "shard {shard}");
        }
        let shards = store.list_shards("counter").expect("shards");
        assert_eq!(shards, (0..5).map(ShardId).collect::<Vec<_>>());
    }
}
