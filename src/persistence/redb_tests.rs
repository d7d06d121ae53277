use super::*;
use crate::persistence::conformance;
use crate::persistence::record::HEADER;

fn fresh() -> impl Fn() -> RedbPersistence {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let counter = std::sync::atomic::AtomicU32::new(0);
    move || {
        let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        RedbPersistence::open(dir.path().join(format!("store-{n}.redb"))).expect("open")
    }
}

#[test]
fn the_embedded_store_keeps_the_contract() {
    conformance::journal(fresh());
    conformance::snapshots(fresh());
    conformance::durable_state(fresh());
    conformance::remember_entities(fresh());
}

/// Fresh stores of `lanes` files each.
fn fresh_lanes(lanes: usize) -> impl Fn() -> RedbPersistence {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let counter = std::sync::atomic::AtomicU32::new(0);
    move || {
        let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        RedbPersistence::open_lanes(dir.path().join(format!("store-{n}")), lanes).expect("open")
    }
}

#[test]
fn the_embedded_store_of_several_lanes_keeps_the_contract() {
    conformance::journal(fresh_lanes(4));
    conformance::snapshots(fresh_lanes(4));
    conformance::durable_state(fresh_lanes(4));
    conformance::remember_entities(fresh_lanes(3));
}

fn writes_to(ids: &[PersistenceId], expected: u64) -> Vec<AtomicWrite> {
    ids.iter()
        .map(|id| AtomicWrite {
            persistence_id: id.clone(),
            expected,
            events: vec![payload(expected as u8 + 1)],
            writer: Writer::default(),
        })
        .collect()
}

/// A batch over several lanes: each id's records land in its lane's
/// file alone, the answers keep the batch's order, and a refused write
/// (a stale expected number) is answered in its place.
#[test]
fn a_batch_over_several_lanes_answers_in_order_and_lands_in_each_lane() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = RedbPersistence::open_lanes(dir.path(), 4).expect("open");
    assert_eq!(Journal::commit_lanes(&store), 4);
    assert_eq!(DurableStateStore::commit_lanes(&store), 4);
    let ids: Vec<PersistenceId> = (0..32)
        .map(|i| PersistenceId::new("counter", format!("c-{i}")))
        .collect();
    let lanes: std::collections::BTreeSet<usize> = ids.iter().map(|id| id.lane(4)).collect();
    assert_eq!(lanes.len(), 4, "32 ids all fall in lanes {lanes:?}");
    assert!(store.append(&writes_to(&ids, 0)).iter().all(Result::is_ok));
    let mut second = writes_to(&ids, 1);
    second[5].expected = 0;
    let answers = store.append(&second);
    for (i, answer) in answers.iter().enumerate() {
        match i {
            5 => assert!(
                matches!(
                    answer,
                    Err(PersistenceError::SequenceConflict { actual: 1, .. })
                ),
                "{answer:?}"
            ),
            _ => assert_eq!(answer, &Ok(()), "write {i}"),
        }
    }
    for (i, id) in ids.iter().enumerate() {
        let want = if i == 5 { 1 } else { 2 };
        assert_eq!(store.highest_sequence_nr(id), Ok(want), "{id}");
        for (lane, db) in store.lanes.iter().enumerate() {
            let txn = db.begin_read().expect("read");
            let highest = txn.open_table(HIGHEST).expect("table");
            let held = highest.get(named(id)).expect("get").is_some();
            assert_eq!(held, lane == id.lane(4), "{id} in lane {lane}");
        }
    }
}

#[test]
fn a_directory_opens_with_the_lane_count_it_was_made_with() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let id = PersistenceId::new("counter", "c-1");
    {
        let store = RedbPersistence::open_lanes(dir.path(), 4).expect("open");
        assert!(store.append(&writes_to(std::slice::from_ref(&id), 0))[0].is_ok());
    }
    let Err(PersistenceError::Invalid(why)) = RedbPersistence::open_lanes(dir.path(), 2) else {
        panic!("a store of 4 lanes opened with 2");
    };
    assert!(why.contains("4 lanes, opened with 2"), "{why}");
    assert!(matches!(
        RedbPersistence::open_lanes(dir.path(), 0),
        Err(PersistenceError::Invalid(_))
    ));
    let store = RedbPersistence::open_lanes(dir.path(), 4).expect("reopen");
    assert_eq!(store.highest_sequence_nr(&id), Ok(1));
    drop(store);
    // A lost lane file is not made anew, empty.
    std::fs::remove_file(dir.path().join("lane-2-of-4.redb")).expect("remove");
    let Err(PersistenceError::Invalid(why)) = RedbPersistence::open_lanes(dir.path(), 4) else {
        panic!("a store of 4 lanes opened without its third file");
    };
    assert!(why.contains("lane-2-of-4.redb is missing"), "{why}");
}

/// One file copied into four lanes, and back into one: every event,
/// highest number (past deleted events), snapshot, state, tombstone and
/// remembered id, with its writer and revision; a store that is not
/// empty is refused.
#[test]
fn a_store_copies_into_another_layout_whole() {
    use crate::persistence::copy::tests::{fill, holds_what_fill_wrote};
    let dir = tempfile::tempdir().expect("a temporary directory");
    let one = RedbPersistence::open(dir.path().join("old.redb")).expect("open");
    let filled = fill(&one);
    let four = RedbPersistence::open_lanes(dir.path().join("new"), 4).expect("open");
    assert_eq!(crate::persistence::copy(&one, &four), Ok(filled));
    let back = RedbPersistence::open(dir.path().join("back.redb")).expect("open");
    assert_eq!(crate::persistence::copy(&four, &back), Ok(filled));
    holds_what_fill_wrote(&four);
    holds_what_fill_wrote(&back);
    let Err(PersistenceError::Invalid(why)) = crate::persistence::copy(&one, &four) else {
        panic!("copied into a store that is not empty");
    };
    assert!(why.contains("not empty"), "{why}");
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
    let path = dir.path().join("node.redb");
    let id = PersistenceId::new("counter", "c-1");
    let writer = Writer {
        node_id: 1,
        incarnation: 2,
        generation: 3,
    };
    {
        let store = RedbPersistence::open(&path).expect("open");
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
    let store = RedbPersistence::open(&path).expect("reopen");
    assert_eq!(store.highest_sequence_nr(&id), Ok(2));
    let events = store.replay(&id, 1, u64::MAX, 10).expect("replay");
    assert_eq!(
        events.iter().map(|e| &e.payload).collect::<Vec<_>>(),
        [&payload(1), &payload(2)]
    );
    assert_eq!(events[1].writer, writer);
    let snapshot = SnapshotStore::load(&store, &id, u64::MAX).expect("load");
    assert_eq!(snapshot.map(|s| s.payload), Some(payload(9)));
    let state = DurableStateStore::load(&store, &id).expect("load");
    assert_eq!(
        state.map(|s| (s.revision, s.payload)),
        Some((1, payload(7)))
    );
}

#[test]
fn a_second_open_of_one_file_is_refused() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("node.redb");
    let _first = RedbPersistence::open(&path).expect("open");
    assert!(matches!(
        RedbPersistence::open(&path),
        Err(PersistenceError::Store(_))
    ));
}

/// Overwrites the value under an event's key, as damage would.
fn damage(store: &RedbPersistence, id: &PersistenceId, n: u64, value: &[u8]) {
    let txn = store.file(id).begin_write().expect("write");
    {
        let mut events = txn.open_table(EVENTS).expect("table");
        events.insert(numbered(id, n), value).expect("insert");
    }
    txn.commit().expect("commit");
}

#[test]
fn a_record_that_does_not_read_back_is_reported_corrupt() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = RedbPersistence::open(dir.path().join("node.redb")).expect("open");
    let id = PersistenceId::new("counter", "c-2");
    let write = AtomicWrite {
        persistence_id: id.clone(),
        expected: 0,
        events: vec![payload(1), payload(2), payload(3)],
        writer: Writer::default(),
    };
    assert_eq!(store.append(&[write]), vec![Ok(())]);
    let mut good = Vec::new();
    encode(&payload(2), Writer::default(), &mut good);
    let cases: [(&str, Vec<u8>); 4] = [
        ("short", vec![1, 2, 3]),
        ("unknown format", {
            let mut v = good.clone();
            v[0] = 9;
            v
        }),
        ("manifest longer than the record", {
            let mut v = good.clone();
            v[29..33].copy_from_slice(&1_000u32.to_le_bytes());
            v
        }),
        ("manifest not UTF-8", {
            let mut v = good.clone();
            v[HEADER] = 0xff;
            v
        }),
    ];
    for (case, value) in cases {
        damage(&store, &id, 2, &value);
        assert!(
            matches!(
                store.replay(&id, 1, u64::MAX, 10),
                Err(PersistenceError::Corrupt { .. })
            ),
            "{case}"
        );
    }
    // A hole in the sequence numbers.
    damage(&store, &id, 2, &good);
    let txn = store.file(&id).begin_write().expect("write");
    txn.open_table(EVENTS)
        .expect("table")
        .remove(numbered(&id, 2))
        .expect("remove");
    txn.commit().expect("commit");
    let error = store.replay(&id, 1, u64::MAX, 10).expect_err("a hole");
    assert!(
        error.to_string().contains("sequence number 3 follows 1"),
        "{error}"
    );
}

/// SPEC §8b's worked example, byte for byte.
#[test]
fn a_record_is_laid_out_as_the_spec_says() {
    let payload = Payload {
        manifest: "ev".into(),
        version: 2,
        bytes: vec![0xAA],
    };
    let writer = Writer {
        node_id: 1,
        incarnation: 2,
        generation: 3,
    };
    let mut bytes = Vec::new();
    encode(&payload, writer, &mut bytes);
    let mut want = vec![0x01];
    for n in [1u64, 2, 3] {
        want.extend_from_slice(&n.to_le_bytes());
    }
    want.extend_from_slice(&[0x02, 0, 0, 0, 0x02, 0, 0, 0, b'e', b'v', 0xAA]);
    assert_eq!(bytes, want);
    assert_eq!(bytes.len(), 36);
    let id = PersistenceId::new("t", "e");
    assert_eq!(decode(&id, &bytes), Ok((payload, writer)));
}
