use super::*;
use crate::persistence::conformance;

fn fresh() -> impl Fn() -> FjallPersistence {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let counter = std::sync::atomic::AtomicU32::new(0);
    move || {
        let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        FjallPersistence::open(dir.path().join(format!("store-{n}"))).expect("open")
    }
}

#[test]
fn the_fjall_store_keeps_the_contract() {
    conformance::journal(fresh());
    conformance::snapshots(fresh());
    conformance::durable_state(fresh());
    conformance::remember_entities(fresh());
}

/// Its commit is one log append and one sync: the system's writers take
/// its batches at once, and batch its saves.
#[test]
fn the_fjall_store_asks_for_eager_batches() {
    let store = fresh()();
    assert_eq!(Journal::batching(&store), Batching::Eager);
    assert_eq!(DurableStateStore::batching(&store), Batching::Eager);
    assert!(store.commits_batches());
}

fn payload(n: u8) -> Payload {
    Payload {
        manifest: "counter.added".into(),
        version: 2,
        bytes: vec![n; 3],
    }
}

#[test]
fn what_was_committed_is_there_after_a_reopen() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let id = PersistenceId::new("counter", "c-1");
    let writer = Writer {
        node_id: 1,
        incarnation: 2,
        generation: 3,
    };
    {
        let store = FjallPersistence::open(dir.path()).expect("open");
        let write = AtomicWrite {
            persistence_id: id.clone(),
            expected: 0,
            events: vec![payload(1), payload(2)],
            writer,
        };
        assert_eq!(store.append(&[write]), vec![Ok(())]);
        let snapshot = SnapshotRecord {
            sequence_nr: 2,
            payload: payload(9),
            writer,
        };
        SnapshotStore::save(&store, &id, snapshot).expect("snapshot");
        DurableStateStore::save(&store, &id, 0, payload(7), writer).expect("state");
    }
    let store = FjallPersistence::open(dir.path()).expect("reopen");
    assert_eq!(store.highest_sequence_nr(&id), Ok(2));
    let events = store.replay(&id, 1, u64::MAX, 10).expect("replay");
    assert_eq!(
        events
            .iter()
            .map(|e| (&e.payload, e.writer))
            .collect::<Vec<_>>(),
        [(&payload(1), writer), (&payload(2), writer)]
    );
    let snapshot = SnapshotStore::load(&store, &id, u64::MAX).expect("load");
    assert_eq!(snapshot.map(|s| s.payload), Some(payload(9)));
    let state = DurableStateStore::load(&store, &id).expect("load");
    assert_eq!(
        state.map(|s| (s.revision, s.payload)),
        Some((1, payload(7)))
    );
}

#[test]
fn a_second_open_of_one_directory_is_refused() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let _first = FjallPersistence::open(dir.path()).expect("open");
    assert!(matches!(
        FjallPersistence::open(dir.path()),
        Err(PersistenceError::Store(_))
    ));
}

/// Ids whose names run into each other's keys stay apart: an id's keys
/// hold the lengths of its type name and entity id.
#[test]
fn ids_that_share_a_prefix_keep_their_own_events() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = FjallPersistence::open(dir.path()).expect("open");
    let ids = [
        PersistenceId::new("ab", "c"),
        PersistenceId::new("a", "bc"),
        PersistenceId::new("a", "b"),
        PersistenceId::new("a", "b\u{0}\u{0}"),
    ];
    for (i, id) in ids.iter().enumerate() {
        let write = AtomicWrite {
            persistence_id: id.clone(),
            expected: 0,
            events: (0..=i as u8).map(payload).collect(),
            writer: Writer::default(),
        };
        assert_eq!(store.append(&[write]), vec![Ok(())]);
    }
    for (i, id) in ids.iter().enumerate() {
        let events = store.replay(id, 1, u64::MAX, 100).expect("replay");
        assert_eq!(events.len(), i + 1, "{id}");
        assert_eq!(store.highest_sequence_nr(id), Ok(i as u64 + 1), "{id}");
    }
}

/// A record that does not read back is reported, never applied.
#[test]
fn a_record_that_does_not_read_back_is_reported_corrupt() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = FjallPersistence::open(dir.path()).expect("open");
    let id = PersistenceId::new("counter", "c-2");
    let write = AtomicWrite {
        persistence_id: id.clone(),
        expected: 0,
        events: vec![payload(1), payload(2)],
        writer: Writer::default(),
    };
    assert_eq!(store.append(&[write]), vec![Ok(())]);
    store
        .inner
        .events
        .insert(numbered(&id_key(&id), 2), [9u8, 1, 2].as_slice())
        .expect("damage");
    assert!(matches!(
        store.replay(&id, 1, u64::MAX, 10),
        Err(PersistenceError::Corrupt { .. })
    ));
    store
        .inner
        .states
        .insert(id_key(&id), [1u8, 2].as_slice())
        .expect("damage");
    assert!(matches!(
        DurableStateStore::load(&store, &id),
        Err(PersistenceError::Corrupt { .. })
    ));
}

/// A redb file copied into fjall, and fjall into three redb lanes: all
/// that was stored reads back from both.
#[cfg(feature = "embedded")]
#[test]
fn a_redb_store_copies_into_fjall_and_back() {
    use crate::persistence::RedbPersistence;
    use crate::persistence::copy::tests::{fill, holds_what_fill_wrote};
    let dir = tempfile::tempdir().expect("a temporary directory");
    let redb = RedbPersistence::open(dir.path().join("old.redb")).expect("open");
    let filled = fill(&redb);
    let fjall = FjallPersistence::open(dir.path().join("fjall")).expect("open");
    assert_eq!(crate::persistence::copy(&redb, &fjall), Ok(filled));
    holds_what_fill_wrote(&fjall);
    let lanes = RedbPersistence::open_lanes(dir.path().join("lanes"), 3).expect("open");
    assert_eq!(crate::persistence::copy(&fjall, &lanes), Ok(filled));
    holds_what_fill_wrote(&lanes);
    assert!(matches!(
        crate::persistence::copy(&redb, &fjall),
        Err(PersistenceError::Invalid(_))
    ));
}

/// SPEC §8b's example key, byte for byte.
#[test]
fn an_event_is_keyed_as_the_spec_says() {
    let key = numbered(&id_key(&PersistenceId::new("tally", "t-1")), 3);
    let want = [
        0, 0, 0, 5, b't', b'a', b'l', b'l', b'y', 0, 0, 0, 3, b't', b'-', b'1', 0, 0, 0, 0, 0, 0,
        0, 3,
    ];
    assert_eq!(key, want);
}

/// More ids than the store keeps the highest numbers and revisions of
/// (16 in tests): a write to an id it forgot reads the tree, and a stale
/// write is refused there as well.
#[test]
fn writes_past_what_the_store_keeps_in_memory_are_checked_against_the_tree() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = FjallPersistence::open(dir.path()).expect("open");
    let ids: Vec<PersistenceId> = (0..100)
        .map(|i| PersistenceId::new("counter", format!("c-{i}")))
        .collect();
    for round in 0..3u64 {
        let writes: Vec<AtomicWrite> = ids
            .iter()
            .map(|id| AtomicWrite {
                persistence_id: id.clone(),
                expected: round,
                events: vec![payload(round as u8)],
                writer: Writer::default(),
            })
            .collect();
        assert!(
            store.append(&writes).iter().all(Result::is_ok),
            "round {round}"
        );
        for id in &ids {
            DurableStateStore::save(&store, id, round, payload(9), Writer::default())
                .expect("save");
        }
    }
    for id in &ids {
        assert_eq!(store.highest_sequence_nr(id), Ok(3), "{id}");
        assert_eq!(DurableStateStore::revision(&store, id), Ok(3), "{id}");
    }
    let stale = AtomicWrite {
        persistence_id: ids[0].clone(),
        expected: 2,
        events: vec![payload(1)],
        writer: Writer::default(),
    };
    assert!(matches!(
        store.append(&[stale])[0],
        Err(PersistenceError::SequenceConflict { actual: 3, .. })
    ));
    assert!(matches!(
        DurableStateStore::save(&store, &ids[0], 2, payload(1), Writer::default()),
        Err(PersistenceError::RevisionConflict { .. })
    ));
}

/// A persistence id too long for a fjall key is refused alone, with a
/// typed error, and the rest of its batch is written.
#[test]
fn an_id_too_long_for_a_key_is_refused_alone() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = FjallPersistence::open(dir.path()).expect("open");
    let long = PersistenceId::new("counter", "x".repeat(70_000));
    let short = PersistenceId::new("counter", "c-1");
    let writes: Vec<AtomicWrite> = [&long, &short]
        .into_iter()
        .map(|id| AtomicWrite {
            persistence_id: id.clone(),
            expected: 0,
            events: vec![payload(1)],
            writer: Writer::default(),
        })
        .collect();
    let answers = store.append(&writes);
    assert!(
        matches!(answers[0], Err(PersistenceError::Invalid(_))),
        "{answers:?}"
    );
    assert_eq!(answers[1], Ok(()));
    assert!(matches!(
        store.highest_sequence_nr(&long),
        Err(PersistenceError::Invalid(_))
    ));
    assert!(matches!(
        DurableStateStore::save(&store, &long, 0, payload(1), Writer::default()),
        Err(PersistenceError::Invalid(_))
    ));
    assert_eq!(store.highest_sequence_nr(&short), Ok(1));
}

/// A remembered id too long for a key is answered alone; the rest of its
/// batch is recorded.
#[test]
fn a_remembered_id_too_long_for_a_key_is_refused_alone() {
    use crate::persistence::remember::RememberEntitiesStore;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = FjallPersistence::open(dir.path()).expect("open");
    let long = "x".repeat(70_000);
    let records = [
        RememberRecord {
            type_name: "counter",
            shard_id: ShardId(1),
            entity_id: &long,
            started: true,
        },
        RememberRecord {
            type_name: "counter",
            shard_id: ShardId(1),
            entity_id: "c-1",
            started: true,
        },
    ];
    let answers = store.record_batch(&records);
    assert!(answers[0].is_err(), "{answers:?}");
    assert_eq!(answers[1], Ok(()));
    assert_eq!(
        store.list_entities_for_shard("counter", ShardId(1)),
        Ok(vec!["c-1".to_owned()])
    );
}
