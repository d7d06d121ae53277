//! The file store: layout, compaction, fsync policies, torn tails, garbage,
//! versions, hostile names, and random histories reloaded.

use std::collections::BTreeSet;
use std::path::Path;

use quickcheck::{Arbitrary, Gen, QuickCheck};

use super::*;

const POLICIES: [FileStoreFsyncPolicy; 3] = [
    FileStoreFsyncPolicy::Always,
    FileStoreFsyncPolicy::OnCompaction,
    FileStoreFsyncPolicy::Never,
];

fn ids(store: &FileStore, type_name: &str, shard: u32) -> Vec<String> {
    store
        .list_entities_for_shard(type_name, ShardId(shard))
        .expect("lists")
}

/// Every file and directory below `dir`, relative to it.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in fs::read_dir(&d).expect("readable") {
            let path = entry.expect("entry").path();
            out.push(path.strip_prefix(dir).expect("inside").to_path_buf());
            if path.is_dir() {
                todo.push(path);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_in_memory_store_keeps_the_remember_entities_contract() {
    crate::persistence::conformance::remember_entities(
        crate::persistence::remember::InMemoryStore::new,
    );
}

#[test]
fn the_file_store_keeps_the_remember_entities_contract() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let counter = std::sync::atomic::AtomicU32::new(0);
    crate::persistence::conformance::remember_entities(|| {
        let n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        FileStore::open(dir.path().join(n.to_string()), FileStoreFsyncPolicy::Never).expect("open")
    });
}

#[test]
fn layout_is_hex_type_then_hex_shard() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("opens");
    store
        .record_entity_started("counter", ShardId(42), "cart-1")
        .expect("records");
    assert_eq!(
        tree(dir.path()),
        vec![
            PathBuf::from("636f756e746572"),
            PathBuf::from("636f756e746572/0000002a.log"),
            PathBuf::from(LOCK_FILE),
        ]
    );
    let bytes = fs::read(dir.path().join("636f756e746572/0000002a.log")).expect("log");
    // header, then one record: len 7 (op + "cart-1"), crc, op 1, id.
    let mut expected = b"DCSR\x01".to_vec();
    expected.extend_from_slice(&7u32.to_be_bytes());
    expected.extend_from_slice(&crc32fast::hash(b"\x01cart-1").to_be_bytes());
    expected.extend_from_slice(b"\x01cart-1");
    assert_eq!(bytes, expected);
}

#[test]
fn a_stop_compacts_the_log_to_the_live_ids() {
    for policy in POLICIES {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileStore::open(dir.path(), policy).expect("opens");
        for id in ["a", "b", "c"] {
            store
                .record_entity_started("t", ShardId(1), id)
                .expect("start");
        }
        store
            .record_entity_stopped("t", ShardId(1), "b")
            .expect("stop");
        let path = store.log_path("t", ShardId(1)).expect("path");
        let bytes = fs::read(&path).expect("log");
        let parsed = parse(&bytes).expect("parses");
        assert_eq!(parsed.ids, BTreeSet::from(["a".to_owned(), "c".to_owned()]));
        // Exactly two start records: the stop left no tombstone behind.
        assert_eq!(
            bytes.len(),
            HEADER_LEN + 2 * (RECORD_HEAD + 2),
            "{policy:?}"
        );
        assert!(!path.with_extension("log.tmp").exists());
        // A new store on the same directory (this one closed) sees the same.
        drop(store);
        let again = FileStore::open(dir.path(), policy).expect("reopens");
        assert_eq!(ids(&again, "t", 1), vec!["a", "c"], "{policy:?}");
        assert_eq!(again.list_shards("t").expect("shards"), vec![ShardId(1)]);
        // The last stop removes the log.
        again
            .record_entity_stopped("t", ShardId(1), "a")
            .expect("stop");
        again
            .record_entity_stopped("t", ShardId(1), "c")
            .expect("stop");
        assert!(!path.exists());
        assert!(again.list_shards("t").expect("shards").is_empty());
    }
}

#[test]
fn a_torn_last_record_is_dropped_and_cut_off() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("opens");
    for id in ["one", "two", "three"] {
        store
            .record_entity_started("t", ShardId(0), id)
            .expect("start");
    }
    let path = store.log_path("t", ShardId(0)).expect("path");
    let len = fs::metadata(&path).expect("meta").len();
    // Cut the last record in the middle, as a power cut would.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open")
        .set_len(len - 3)
        .expect("cut");
    drop(store);
    let again = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("reopens");
    assert_eq!(ids(&again, "t", 0), vec!["one", "two"]);
    // The tail was cut off the file: a new append lands behind good records.
    again
        .record_entity_started("t", ShardId(0), "four")
        .expect("start");
    drop(again);
    let third = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("reopens");
    assert_eq!(ids(&third, "t", 0), vec!["four", "one", "two"]);
}

#[test]
fn a_last_record_with_a_bad_checksum_is_torn_but_one_in_the_middle_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("opens");
    for id in ["x", "y"] {
        store
            .record_entity_started("t", ShardId(3), id)
            .expect("start");
    }
    let path = store.log_path("t", ShardId(3)).expect("path");
    let mut bytes = fs::read(&path).expect("log");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&path, &bytes).expect("write");
    drop(store);
    let again = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("reopens");
    assert_eq!(ids(&again, "t", 3), vec!["x"]);
    // Now corrupt the first record's body, with a good record after it.
    let mut bytes = fs::read(&path).expect("log");
    bytes.extend_from_within(HEADER_LEN..);
    bytes[HEADER_LEN + RECORD_HEAD] ^= 0x40;
    fs::write(&path, &bytes).expect("write");
    drop(again);
    let third = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("reopens");
    let error = third
        .list_entities_for_shard("t", ShardId(3))
        .expect_err("a checksum error in the middle is not a torn tail");
    assert!(error.0.contains("fails its checksum"), "{error}");
    // The log was left as it was, for someone to look at.
    assert_eq!(fs::read(&path).expect("log"), bytes);
}

#[test]
fn garbage_and_newer_versions_are_refused_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("opens");
    let path = store.log_path("t", ShardId(9)).expect("path");
    fs::create_dir_all(path.parent().unwrap()).expect("dir");
    fs::write(&path, b"this is not a log at all").expect("write");
    let error = store
        .list_entities_for_shard("t", ShardId(9))
        .expect_err("garbage");
    assert!(error.0.contains("not a remember-entities log"), "{error}");
    assert!(error.0.contains("at byte 0"), "names the offset: {error}");
    let path = store.log_path("t", ShardId(10)).expect("path");
    fs::write(&path, b"DCSR\x02").expect("write");
    let error = store
        .list_entities_for_shard("t", ShardId(10))
        .expect_err("newer");
    assert!(
        error
            .0
            .contains("version 2 (byte 4) is newer than this build's 1"),
        "{error}"
    );
}

/// A crash between a compaction's write and its rename leaves
/// `<shard>.log.tmp` beside the intact log: the next open removes it, and
/// the log still lists what it held.
#[test]
fn an_interrupted_compactions_temporary_file_is_removed_on_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tmp = {
        let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("opens");
        store
            .record_entity_started("t", ShardId(3), "a")
            .expect("records");
        let log = store.log_path("t", ShardId(3)).expect("path");
        let tmp = log.with_extension("log.tmp");
        fs::write(&tmp, b"DCSR\x01half a compaction").expect("write");
        tmp
    };
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("opens");
    assert!(!tmp.exists(), "{tmp:?} left behind");
    assert_eq!(ids(&store, "t", 3), vec!["a"]);
}

/// The empty type name would put its logs in the store's root: refused.
#[test]
fn the_empty_type_name_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("opens");
    let error = store
        .record_entity_started("", ShardId(0), "id")
        .expect_err("empty type name");
    assert!(error.0.contains("non-empty type name"), "{error}");
    assert!(store.list_entities_for_shard("", ShardId(0)).is_err());
    assert_eq!(tree(dir.path()), vec![PathBuf::from(LOCK_FILE)]);
}

#[test]
fn hostile_names_stay_inside_the_directory() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("store");
    let store = FileStore::open(&dir, FileStoreFsyncPolicy::Never).expect("opens");
    let long = "x".repeat(10 * 1024);
    let names = [
        "../escape",
        "/etc/passwd",
        "a/../../b",
        "nul\0byte",
        "..",
        ".",
    ];
    for name in names {
        store
            .record_entity_started(name, ShardId(1), "../../id")
            .expect("records");
        assert_eq!(ids(&store, name, 1), vec!["../../id"]);
    }
    // Too long for one directory name: a clear error, nothing written.
    let error = store
        .record_entity_started(&long, ShardId(1), "id")
        .expect_err("too long");
    assert!(error.0.contains("longer than"), "{error}");
    // Only the store's directory exists under the root, and under it only
    // hex-named directories holding hex-named logs.
    assert_eq!(tree(root.path())[0], PathBuf::from("store"));
    let hex = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_hexdigit());
    for path in tree(&dir) {
        let parts: Vec<&str> = path.iter().map(|p| p.to_str().expect("utf-8")).collect();
        match parts.as_slice() {
            [lock] if *lock == LOCK_FILE => {}
            [type_dir] => assert!(hex(type_dir), "{path:?}"),
            [type_dir, log] => {
                assert!(hex(type_dir), "{path:?}");
                let shard = log.strip_suffix(".log").expect("a .log file");
                assert!(shard.len() == 8 && hex(shard), "{path:?}");
            }
            _ => panic!("unexpected depth: {path:?}"),
        }
    }
    assert_eq!(tree(&dir).len(), 2 * names.len() + 1);
}

#[test]
fn a_second_store_on_the_same_directory_is_refused_until_the_first_is_dropped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("opens");
    first
        .record_entity_started("counter", ShardId(1), "a")
        .expect("records");
    let error = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always)
        .expect_err("refused while the first is open");
    assert!(error.0.contains("in use by another FileStore"), "{error}");
    drop(first);
    let again = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("reopens");
    assert_eq!(ids(&again, "counter", 1), vec!["a"]);
}

#[test]
fn a_zero_filled_tail_is_torn_and_a_corrupt_length_mid_file_is_an_error() {
    let mut log = header().to_vec();
    put_record(&mut log, OP_STARTED, "a");
    let good = log.len();
    // A power cut left the file longer than written, the rest zeros.
    let mut zeros = log.clone();
    zeros.extend_from_slice(&[0u8; 37]);
    let parsed = parse(&zeros).expect("torn, not garbage");
    assert_eq!(parsed.torn_at, Some(good));
    assert_eq!(parsed.ids, BTreeSet::from(["a".to_owned()]));
    // A length flipped to something no record can have, with records after
    // it: corruption, reported; not a torn tail to cut (and lose the rest).
    let mut bad = log.clone();
    put_record(&mut bad, OP_STARTED, "b");
    put_record(&mut bad, OP_STARTED, "c");
    bad[good] = 0x7f;
    let error = parse(&bad).expect_err("an impossible length");
    assert!(error.contains("impossible length"), "{error}");
}

// ---- random histories ----

#[derive(Clone, Debug)]
enum Op {
    Start(u8),
    Stop(u8),
    /// A crash: the store is reopened on the same directory.
    Reopen,
    /// A power cut in the middle of the last append: `n` bytes of it lost.
    Tear(u8),
}

impl Arbitrary for Op {
    fn arbitrary(g: &mut Gen) -> Self {
        match u8::arbitrary(g) % 8 {
            0..=3 => Op::Start(u8::arbitrary(g) % 12),
            4 | 5 => Op::Stop(u8::arbitrary(g) % 12),
            6 => Op::Reopen,
            _ => Op::Tear(u8::arbitrary(g) % 12 + 1),
        }
    }
}

/// Any sequence of starts, stops (compactions), reopenings and torn last
/// appends: a reload lists exactly the ids that were live and durable.
fn reload_lists_the_durable_live_ids(ops: Vec<Op>) -> bool {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("opens");
    let mut live: BTreeSet<String> = BTreeSet::new();
    // The id of the last record appended, if nothing was written after it.
    let mut last_append: Option<String> = None;
    for op in ops {
        match op {
            Op::Start(i) => {
                let id = format!("entity-{i}");
                let fresh = !live.contains(&id);
                store
                    .record_entity_started("t", ShardId(0), &id)
                    .expect("start");
                if fresh {
                    last_append = Some(id.clone());
                }
                live.insert(id);
            }
            Op::Stop(i) => {
                let id = format!("entity-{i}");
                store
                    .record_entity_stopped("t", ShardId(0), &id)
                    .expect("stop");
                if live.remove(&id) {
                    last_append = None; // a compaction rewrote the log
                }
            }
            Op::Reopen => {
                drop(store);
                store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("reopens");
                last_append = None;
            }
            Op::Tear(n) => {
                let Some(id) = last_append.take() else {
                    continue;
                };
                let path = store.log_path("t", ShardId(0)).expect("path");
                let len = fs::metadata(&path).expect("meta").len();
                let record = (RECORD_HEAD + 1 + id.len()) as u64;
                let cut = u64::from(n).min(record);
                OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .expect("open")
                    .set_len(len - cut)
                    .expect("cut");
                // The torn record's id is lost; the rest survives a reopen.
                live.remove(&id);
                drop(store);
                store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("reopens");
            }
        }
    }
    drop(store);
    let reloaded = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("reopens");
    let listed: BTreeSet<String> = ids(&reloaded, "t", 0).into_iter().collect();
    listed == live
}

#[test]
fn random_histories_reload_exactly_the_durable_live_ids() {
    QuickCheck::new()
        .tests(300)
        .quickcheck(reload_lists_the_durable_live_ids as fn(Vec<Op>) -> bool);
}

/// A batch of records (shard, id, started) over two shards and four ids.
#[derive(Clone, Debug)]
struct Batch(Vec<(u32, u8, bool)>);

impl Arbitrary for Batch {
    fn arbitrary(g: &mut Gen) -> Self {
        let n = usize::arbitrary(g) % 12;
        Batch(
            (0..n)
                .map(|_| {
                    (
                        u32::arbitrary(g) % 2,
                        u8::arbitrary(g) % 4,
                        bool::arbitrary(g),
                    )
                })
                .collect(),
        )
    }
}

/// Group commit changes when records reach the disk, not what they say:
/// batches applied with `record_batch` leave the same live ids, after a
/// reopen, as the same records applied one by one.
fn batches_are_the_records_one_by_one(batches: Vec<Batch>) -> bool {
    let (one, many) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    {
        let single = FileStore::open(one.path(), FileStoreFsyncPolicy::Never).expect("opens");
        let grouped = FileStore::open(many.path(), FileStoreFsyncPolicy::Never).expect("opens");
        for Batch(records) in &batches {
            let ids: Vec<String> = records.iter().map(|(_, id, _)| format!("e{id}")).collect();
            let batch: Vec<RememberRecord<'_>> = records
                .iter()
                .zip(&ids)
                .map(|((shard, _, started), id)| RememberRecord {
                    type_name: "t",
                    shard_id: ShardId(*shard),
                    entity_id: id,
                    started: *started,
                })
                .collect();
            for r in &batch {
                let result = if r.started {
                    single.record_entity_started(r.type_name, r.shard_id, r.entity_id)
                } else {
                    single.record_entity_stopped(r.type_name, r.shard_id, r.entity_id)
                };
                result.expect("one by one");
            }
            let results = grouped.record_batch(&batch);
            assert!(results.iter().all(Result::is_ok), "{batch:?}: {results:?}");
        }
    }
    let single = FileStore::open(one.path(), FileStoreFsyncPolicy::Never).expect("reopens");
    let grouped = FileStore::open(many.path(), FileStoreFsyncPolicy::Never).expect("reopens");
    (0..2).all(|shard| ids(&single, "t", shard) == ids(&grouped, "t", shard))
}

#[test]
fn group_commit_records_what_one_by_one_records() {
    QuickCheck::new()
        .tests(300)
        .quickcheck(batches_are_the_records_one_by_one as fn(Vec<Batch>) -> bool);
}

#[test]
fn a_batch_of_starts_is_one_append() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).expect("opens");
    let names: Vec<String> = (0..100).map(|k| format!("id-{k}")).collect();
    let batch: Vec<RememberRecord<'_>> = names
        .iter()
        .map(|id| RememberRecord {
            type_name: "t",
            shard_id: ShardId(9),
            entity_id: id,
            started: true,
        })
        .collect();
    assert!(store.record_batch(&batch).iter().all(Result::is_ok));
    let path = store.log_path("t", ShardId(9)).expect("path");
    let bytes = fs::read(&path).expect("log");
    let parsed = parse(&bytes).expect("parses");
    assert_eq!(parsed.ids.len(), 100);
    // A bad id fails alone; the rest of its batch is written.
    let long = "x".repeat(70_000);
    let mixed = [
        RememberRecord {
            type_name: "t",
            shard_id: ShardId(9),
            entity_id: &long,
            started: true,
        },
        RememberRecord {
            type_name: "t",
            shard_id: ShardId(9),
            entity_id: "fine",
            started: true,
        },
    ];
    let results = store.record_batch(&mixed);
    assert!(results[0].is_err() && results[1].is_ok(), "{results:?}");
    assert_eq!(ids(&store, "t", 9).len(), 101);
}
