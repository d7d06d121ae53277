use super::*;
use crate::persistence::conformance;

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
    let txn = store.db.begin_write().expect("write");
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
    let txn = store.db.begin_write().expect("write");
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
