//! The persistence contract as tests, for any store.
//!
//! Each function takes a way to make an empty store, runs the contract's
//! cases against fresh stores, and panics with the case's name and what
//! differed. Every store of this crate runs those it implements in its
//! tests (the journal, snapshot and durable-state contracts, and the
//! remember-entities one, [`remember_entities`]); a
//! third-party store can too:
//!
//! ```
//! use datum_cluster_sharding::persistence::{conformance, InMemoryPersistence};
//! conformance::journal(InMemoryPersistence::new);
//! conformance::snapshots(InMemoryPersistence::new);
//! conformance::durable_state(InMemoryPersistence::new);
//! conformance::remember_entities(datum_cluster_sharding::InMemoryStore::new);
//! ```
//!
//! Concurrent writers of one id are checked too: four threads appending
//! (or saving) at once, each from the position it last read, never fork
//! it — every write either lands whole or is refused. What it cannot
//! check: durability across a crash (a store's own tests must reopen it).

use std::collections::BTreeSet;

use super::remember::{RememberEntitiesStore, RememberRecord};
use crate::model::extractor::ShardId;

use super::{
    AtomicWrite, DurableStateStore, Journal, Payload, PersistenceError, PersistenceId,
    SnapshotRecord, SnapshotStore, StateWrite, Writer,
};

fn pid(entity: &str) -> PersistenceId {
    PersistenceId::new("conformance", entity)
}

fn payload(n: u32) -> Payload {
    Payload {
        manifest: format!("event-{n}"),
        version: n % 3,
        bytes: n.to_be_bytes().to_vec(),
    }
}

fn writer(generation: u64) -> Writer {
    Writer {
        node_id: 7,
        incarnation: 9,
        generation,
    }
}

fn write(entity: &str, expected: u64, events: &[u32]) -> AtomicWrite {
    AtomicWrite {
        persistence_id: pid(entity),
        expected,
        events: events.iter().map(|n| payload(*n)).collect(),
        writer: writer(expected),
    }
}

fn append_one<J: Journal>(journal: &J, w: AtomicWrite) -> Result<(), PersistenceError> {
    let mut results = journal.append(std::slice::from_ref(&w));
    assert_eq!(results.len(), 1, "append: one result per write");
    results.remove(0)
}

fn sequence_nrs<J: Journal>(journal: &J, entity: &str) -> Vec<u64> {
    journal
        .replay(&pid(entity), 1, u64::MAX, usize::MAX)
        .expect("replay")
        .iter()
        .map(|e| e.sequence_nr)
        .collect()
}

/// The [`Journal`] contract.
pub fn journal<J: Journal>(make: impl Fn() -> J) {
    // Numbering, payloads and writers round-trip.
    let j = make();
    assert_eq!(
        j.highest_sequence_nr(&pid("a")).expect("highest"),
        0,
        "empty: 0"
    );
    append_one(&j, write("a", 0, &[1, 2])).expect("first append");
    append_one(&j, write("a", 2, &[3])).expect("second append");
    let events = j
        .replay(&pid("a"), 1, u64::MAX, usize::MAX)
        .expect("replay");
    let got: Vec<(u64, Payload, Writer)> = events
        .into_iter()
        .map(|e| (e.sequence_nr, e.payload, e.writer))
        .collect();
    let want = vec![
        (1, payload(1), writer(0)),
        (2, payload(2), writer(0)),
        (3, payload(3), writer(2)),
    ];
    assert_eq!(
        got, want,
        "events, numbers and writers read back as written"
    );
    assert_eq!(j.highest_sequence_nr(&pid("a")).expect("highest"), 3);

    // A stale or future expectation is refused and writes nothing.
    for expected in [0, 2, 4] {
        let refused = append_one(&j, write("a", expected, &[9]));
        assert_eq!(
            refused,
            Err(PersistenceError::SequenceConflict {
                persistence_id: pid("a"),
                expected,
                actual: 3
            }),
            "an append expecting {expected} of a journal at 3"
        );
    }
    assert_eq!(
        sequence_nrs(&j, "a"),
        [1, 2, 3],
        "a refused append wrote nothing"
    );

    // An append of no events is refused.
    assert!(
        matches!(
            append_one(&j, write("a", 3, &[])),
            Err(PersistenceError::Invalid(_))
        ),
        "an append of no events"
    );

    // Persistence ids are independent: another id, one that the first is
    // a prefix of, the same id of another type.
    append_one(&j, write("b", 0, &[5])).expect("another id");
    assert_eq!(sequence_nrs(&j, "b"), [1]);
    append_one(&j, write("ab", 0, &[6])).expect("a longer id");
    let other_type = AtomicWrite {
        persistence_id: PersistenceId::new("conformance-2", "a"),
        ..write("a", 0, &[7])
    };
    append_one(&j, other_type).expect("another type's id");
    assert_eq!(sequence_nrs(&j, "a"), [1, 2, 3], "ids do not mix");
    assert_eq!(j.highest_sequence_nr(&pid("a")).expect("highest"), 3);
    assert_eq!(j.highest_sequence_nr(&pid("ab")).expect("highest"), 1);

    // Replay bounds: from, to, max.
    assert_eq!(
        j.replay(&pid("a"), 2, 3, usize::MAX)
            .expect("replay")
            .iter()
            .map(|e| e.sequence_nr)
            .collect::<Vec<_>>(),
        [2, 3],
        "replay from 2"
    );
    assert_eq!(
        j.replay(&pid("a"), 1, 2, 1).expect("replay").len(),
        1,
        "max"
    );
    assert!(
        j.replay(&pid("a"), 3, 2, 10).expect("replay").is_empty(),
        "from > to"
    );
    assert!(
        j.replay(&pid("zz"), 1, 10, 10).expect("replay").is_empty(),
        "unknown id"
    );

    // A batch: each write sees those before it; a refused one does not stop
    // the others.
    let j = make();
    let batch = [
        write("c", 0, &[1]),
        write("c", 1, &[2, 3]),
        write("c", 1, &[4]),
        write("d", 0, &[1]),
        write("c", 3, &[5]),
    ];
    let results = j.append(&batch);
    assert_eq!(results.len(), batch.len(), "one result per write");
    assert!(results[0].is_ok() && results[1].is_ok(), "{results:?}");
    assert_eq!(
        results[2],
        Err(PersistenceError::SequenceConflict {
            persistence_id: pid("c"),
            expected: 1,
            actual: 3
        }),
        "a stale write within a batch"
    );
    assert!(results[3].is_ok() && results[4].is_ok(), "{results:?}");
    assert_eq!(sequence_nrs(&j, "c"), [1, 2, 3, 4]);
    let fifth = j.replay(&pid("c"), 4, 4, 1).expect("replay");
    assert_eq!(
        fifth[0].payload,
        payload(5),
        "the write after the refused one"
    );

    // Deleting keeps the highest sequence number, and numbering goes on.
    j.delete_to(&pid("c"), 2).expect("delete");
    assert_eq!(sequence_nrs(&j, "c"), [3, 4]);
    assert_eq!(j.highest_sequence_nr(&pid("c")).expect("highest"), 4);
    j.delete_to(&pid("c"), 10).expect("delete all");
    assert!(sequence_nrs(&j, "c").is_empty());
    assert_eq!(
        j.highest_sequence_nr(&pid("c")).expect("highest"),
        4,
        "kept after deleting all"
    );
    append_one(&j, write("c", 4, &[6])).expect("append after delete");
    assert_eq!(sequence_nrs(&j, "c"), [5]);
    assert!(
        append_one(&j, write("c", 0, &[7])).is_err(),
        "a deleted journal does not start again at 1"
    );
    concurrent_appends(&make());
}

/// Writers racing on one id, each this many tries.
const RACE_TRIES: u32 = 40;

/// Four threads, started together, each calling `attempt(thread, try)`
/// [`RACE_TRIES`] times; what each had accepted (the numbers an accepted
/// attempt names).
fn race(attempt: impl Fn(u32, u32) -> Option<Vec<u32>> + Sync) -> Vec<Vec<u32>> {
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        let racers: Vec<_> = (0..4u32)
            .map(|t| {
                let (start, attempt) = (&start, &attempt);
                scope.spawn(move || {
                    start.wait();
                    (0..RACE_TRIES)
                        .filter_map(|k| attempt(t, k))
                        .flatten()
                        .collect::<Vec<u32>>()
                })
            })
            .collect();
        racers
            .into_iter()
            .map(|r| r.join().expect("a racer panicked"))
            .collect()
    })
}

/// Four threads append to one id at once (started together), each from
/// the highest number it last read, two events a write: the accepted
/// appends are the journal, numbered without a gap, each write's two
/// events side by side, holding what its writer sent. A store whose
/// answer to a write that landed can be lost would fail here: it reads
/// as refused.
fn concurrent_appends<J: Journal>(j: &J) {
    let accepted = race(|t, k| {
        let n = t * 1_000 + k * 2;
        let top = j.highest_sequence_nr(&pid("race")).expect("highest");
        let landed = append_one(j, write("race", top, &[n, n + 1])).is_ok();
        landed.then(|| vec![n, n + 1])
    });
    let total: usize = accepted.iter().map(Vec::len).sum();
    assert!(total > 0, "racing writers: no append was accepted");
    let events = j
        .replay(&pid("race"), 1, u64::MAX, usize::MAX)
        .expect("replay");
    assert_eq!(
        events.iter().map(|e| e.sequence_nr).collect::<Vec<_>>(),
        (1..=total as u64).collect::<Vec<_>>(),
        "racing writers: one event per accepted append, numbered without a gap"
    );
    let held_in_order: Vec<u32> = events
        .iter()
        .map(|e| u32::from_be_bytes(e.payload.bytes[..4].try_into().expect("4 bytes")))
        .collect();
    for pair in held_in_order.chunks(2) {
        assert!(
            pair.len() == 2 && pair[0] % 2 == 0 && pair[1] == pair[0] + 1,
            "racing writers: a write's events are side by side, whole: {pair:?}"
        );
    }
    let mut held: Vec<Vec<u8>> = events.into_iter().map(|e| e.payload.bytes).collect();
    let mut sent: Vec<Vec<u8>> = accepted
        .into_iter()
        .flatten()
        .map(|n| n.to_be_bytes().to_vec())
        .collect();
    held.sort();
    sent.sort();
    assert_eq!(
        held, sent,
        "racing writers: the journal holds what was accepted"
    );
}

/// The [`SnapshotStore`] contract.
pub fn snapshots<S: SnapshotStore>(make: impl Fn() -> S) {
    let s = make();
    let id = pid("s");
    assert_eq!(s.load(&id, u64::MAX).expect("load"), None, "empty");
    let snapshot = |n: u64| SnapshotRecord {
        sequence_nr: n,
        payload: payload(n as u32),
        writer: writer(n),
    };
    for n in [3, 7, 12] {
        s.save(&id, snapshot(n)).expect("save");
    }
    assert_eq!(
        s.load(&id, u64::MAX).expect("load"),
        Some(snapshot(12)),
        "the latest"
    );
    assert_eq!(
        s.load(&id, 11).expect("load"),
        Some(snapshot(7)),
        "at or below 11"
    );
    assert_eq!(s.load(&id, 7).expect("load"), Some(snapshot(7)), "at 7");
    assert_eq!(s.load(&id, 2).expect("load"), None, "none at or below 2");
    assert_eq!(
        s.load(&pid("other"), u64::MAX).expect("load"),
        None,
        "ids independent"
    );
    // Saving again at a number replaces it.
    let again = SnapshotRecord {
        payload: payload(99),
        ..snapshot(12)
    };
    s.save(&id, again.clone()).expect("save again");
    assert_eq!(s.load(&id, u64::MAX).expect("load"), Some(again));
    s.delete_to(&id, 7).expect("delete");
    assert_eq!(
        s.load(&id, 11).expect("load"),
        None,
        "deleted at or below 7"
    );
    assert!(s.load(&id, u64::MAX).expect("load").is_some(), "12 is kept");
}

/// The [`DurableStateStore`] contract.
pub fn durable_state<D: DurableStateStore>(make: impl Fn() -> D) {
    let d = make();
    let id = pid("d");
    assert_eq!(d.load(&id).expect("load"), None, "empty");
    d.save(&id, 0, payload(1), writer(1)).expect("first save");
    d.save(&id, 1, payload(2), writer(2)).expect("second save");
    let stored = d.load(&id).expect("load").expect("stored");
    assert_eq!(
        (stored.revision, stored.payload, stored.writer),
        (2, payload(2), writer(2))
    );
    for expected in [0, 1, 3] {
        assert_eq!(
            d.save(&id, expected, payload(9), writer(9)),
            Err(PersistenceError::RevisionConflict {
                persistence_id: id.clone(),
                expected,
                actual: 2
            }),
            "a save expecting {expected} of revision 2"
        );
    }
    assert_eq!(
        d.load(&id).expect("load").expect("stored").payload,
        payload(2),
        "unchanged"
    );
    assert_eq!(
        d.load(&pid("other")).expect("load"),
        None,
        "ids independent"
    );
    assert!(
        matches!(
            d.delete(&id, 1),
            Err(PersistenceError::RevisionConflict { .. })
        ),
        "a stale delete"
    );
    assert_eq!(d.revision(&id), Ok(2));
    d.delete(&id, 2).expect("delete");
    assert_eq!(d.load(&id).expect("load"), None, "deleted");
    assert_eq!(d.revision(&id), Ok(3), "a delete is a revision");
    // A writer that loaded revision 1 or 2 before the delete, or nothing,
    // cannot save over what follows it.
    for expected in [0, 1, 2] {
        assert!(
            matches!(
                d.save(&id, expected, payload(8), writer(8)),
                Err(PersistenceError::RevisionConflict { actual: 3, .. })
            ),
            "a save expecting {expected} after the delete"
        );
    }
    d.save(&id, 3, payload(3), writer(3))
        .expect("a save after the delete");
    assert_eq!(d.load(&id).expect("load").expect("stored").revision, 4);
    assert_eq!(d.revision(&pid("never")), Ok(0));
    durable_state_batches(&make());
    concurrent_saves(&make());
}

/// Four threads save one id at once, each from the revision it last read:
/// the revision ends at the number of accepted saves, and the state is
/// one of theirs.
fn concurrent_saves<D: DurableStateStore>(d: &D) {
    let id = pid("race");
    let accepted = race(|t, k| {
        let n = t * 1_000 + k;
        let revision = d.revision(&id).expect("revision");
        let landed = d.save(&id, revision, payload(n), writer(1)).is_ok();
        landed.then(|| vec![n])
    });
    let total = accepted.iter().map(Vec::len).sum::<usize>() as u64;
    assert!(total > 0, "racing saves: none was accepted");
    let state = d.load(&id).expect("load").expect("a state");
    assert_eq!(
        state.revision, total,
        "racing saves: one revision per accepted save"
    );
    assert!(
        accepted
            .iter()
            .flatten()
            .any(|&n| payload(n) == state.payload),
        "racing saves: the state is one that was accepted"
    );
}

/// `save_all`: one result per write, in order; a write sees those before
/// it in the batch; a refused write stops none of the others.
fn durable_state_batches<D: DurableStateStore>(d: &D) {
    let (a, b) = (pid("batch-a"), pid("batch-b"));
    let write = |id: &PersistenceId, expected: u64, n: u32| StateWrite {
        persistence_id: id.clone(),
        expected,
        payload: payload(n),
        writer: writer(u64::from(n)),
    };
    let results = d.save_all(&[
        write(&a, 0, 1),
        write(&a, 1, 2), // sees the first
        write(&b, 5, 3), // refused: b has no state
        write(&b, 0, 4),
        write(&a, 1, 5), // refused: the second made revision 2
    ]);
    assert_eq!(results.len(), 5, "one result per write");
    assert_eq!(results[0], Ok(()));
    assert_eq!(results[1], Ok(()), "a write sees the one before it");
    assert_eq!(
        results[2],
        Err(PersistenceError::RevisionConflict {
            persistence_id: b.clone(),
            expected: 5,
            actual: 0
        })
    );
    assert_eq!(results[3], Ok(()), "a refusal stops no other write");
    assert_eq!(
        results[4],
        Err(PersistenceError::RevisionConflict {
            persistence_id: a.clone(),
            expected: 1,
            actual: 2
        })
    );
    let stored = d.load(&a).expect("load").expect("stored");
    assert_eq!((stored.revision, stored.payload), (2, payload(2)));
    let stored = d.load(&b).expect("load").expect("stored");
    assert_eq!((stored.revision, stored.payload), (1, payload(4)));
    assert!(d.save_all(&[]).is_empty());
}

/// The [`RememberEntitiesStore`] contract: ids are remembered per type and
/// shard until stopped; starting twice is one id; stopping an unknown id
/// is not an error; a batch applies its records in order, one result
/// each; every shard with a remembered id is listed by `list_shards`, and
/// no shard that was never written.
pub fn remember_entities<S: RememberEntitiesStore>(make: impl Fn() -> S) {
    const T: &str = "conformance";
    let ids = |s: &S, t: &str, shard: u32| -> BTreeSet<String> {
        s.list_entities_for_shard(t, ShardId(shard))
            .expect("list")
            .into_iter()
            .collect()
    };
    let set = |v: &[&str]| -> BTreeSet<String> { v.iter().map(|x| (*x).to_owned()).collect() };
    let shards = |s: &S, t: &str| -> BTreeSet<u32> {
        s.list_shards(t)
            .expect("shards")
            .into_iter()
            .map(|s| s.0)
            .collect()
    };

    let s = make();
    assert!(ids(&s, T, 1).is_empty(), "empty: no ids");
    assert!(shards(&s, T).is_empty(), "empty: no shards");

    // Per type and shard; a prefix is another id; shard u32::MAX works.
    for (t, shard, id) in [
        (T, 1, "a"),
        (T, 1, "b"),
        (T, 1, "ab"),
        (T, 2, "c"),
        (T, u32::MAX, "far"),
        ("conformance-2", 1, "d"),
    ] {
        s.record_entity_started(t, ShardId(shard), id)
            .expect("started");
    }
    s.record_entity_started(T, ShardId(1), "a")
        .expect("started twice");
    assert_eq!(ids(&s, T, 1), set(&["a", "ab", "b"]), "shard 1");
    assert_eq!(ids(&s, T, 2), set(&["c"]), "shard 2");
    assert_eq!(ids(&s, T, u32::MAX), set(&["far"]), "the last shard");
    assert_eq!(ids(&s, "conformance-2", 1), set(&["d"]), "types do not mix");
    assert!(ids(&s, T, 3).is_empty(), "a shard never written");
    let listed = shards(&s, T);
    for shard in [1, 2, u32::MAX] {
        assert!(listed.contains(&shard), "shard {shard} listed: {listed:?}");
    }
    assert!(!listed.contains(&3), "a shard never written is not listed");

    // Stopping forgets; stopping an unknown id is not an error.
    s.record_entity_stopped(T, ShardId(1), "b")
        .expect("stopped");
    s.record_entity_stopped(T, ShardId(1), "never")
        .expect("unknown");
    s.record_entity_stopped(T, ShardId(2), "a")
        .expect("another shard's id");
    assert_eq!(ids(&s, T, 1), set(&["a", "ab"]), "after a stop");

    // A batch, in order: the last record of an id decides.
    let r = |shard: u32, id: &'static str, started: bool| RememberRecord {
        type_name: T,
        shard_id: ShardId(shard),
        entity_id: id,
        started,
    };
    let batch = [
        r(5, "x", true),
        r(5, "x", false),
        r(5, "y", false),
        r(5, "y", true),
        r(1, "a", false),
        r(1, "z", true),
    ];
    let results = s.record_batch(&batch);
    assert_eq!(results.len(), batch.len(), "one result per record");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(ids(&s, T, 5), set(&["y"]), "in order within a batch");
    assert_eq!(ids(&s, T, 1), set(&["ab", "z"]), "a batch across shards");
    assert!(shards(&s, T).contains(&5), "a batch's shard listed");
    assert!(s.record_batch(&[]).is_empty(), "an empty batch");
}
