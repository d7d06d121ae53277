#![cfg(all(feature = "embedded", feature = "fjall"))]
//! The embedded stores as an operator meets them: a process killed while
//! it appends loses nothing it was told was written, on every embedded
//! store and layout; and `datum-node copy-store` moves a redb file to
//! fjall or to redb lanes.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use datum_cluster_sharding::RememberEntitiesStore;
use datum_cluster_sharding::ShardId;
use datum_cluster_sharding::persistence::{
    AtomicWrite, DurableStateStore, FjallPersistence, Journal, Payload, PersistenceId,
    RedbPersistence, Writer,
};

const BIN: &str = env!("CARGO_BIN_EXE_datum-node");
/// Generous: the machine is shared.
const LONG: Duration = Duration::from_secs(60);
/// Ids the appending child writes to.
const IDS: usize = 64;

/// A store named as `datum-node copy-store` names it.
fn open(spec: &str) -> Box<dyn Journal> {
    let (kind, path) = spec.split_once(':').expect("kind:path");
    match kind {
        "redb" => Box::new(RedbPersistence::open(path).expect("open redb")),
        "fjall" => Box::new(FjallPersistence::open(path).expect("open fjall")),
        lanes => {
            let n = lanes.strip_prefix("redb-lanes=").expect("a store kind");
            Box::new(RedbPersistence::open_lanes(path, n.parse().expect("lanes")).expect("open"))
        }
    }
}

fn id(i: usize) -> PersistenceId {
    PersistenceId::new("tally", format!("t-{i}"))
}

/// Not a test of its own: the child process of
/// [`a_killed_writer_loses_no_acknowledged_event`], run by it (with
/// `--ignored --exact`) with the store in `DATUM_KILL_STORE`. It appends
/// batches of 16 one-event writes round the ids, from the highest numbers
/// the store holds, and prints `acked <id> <seq>` for each once its batch
/// returned, until it is killed.
#[test]
#[ignore = "the child process of a_killed_writer_loses_no_acknowledged_event"]
fn appending_child() {
    let Ok(spec) = std::env::var("DATUM_KILL_STORE") else {
        return;
    };
    let store = open(&spec);
    let mut highest: Vec<u64> = (0..IDS)
        .map(|i| store.highest_sequence_nr(&id(i)).expect("highest"))
        .collect();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").expect("stdout");
    out.flush().expect("flush");
    for round in 0usize.. {
        let batch: Vec<AtomicWrite> = (0..16)
            .map(|k| {
                let i = (round * 16 + k) % IDS;
                AtomicWrite {
                    persistence_id: id(i),
                    expected: highest[i],
                    events: vec![Payload {
                        manifest: "tally.added".into(),
                        version: 1,
                        bytes: (highest[i] + 1).to_le_bytes().to_vec(),
                    }],
                    writer: Writer::default(),
                }
            })
            .collect();
        for (k, result) in store.append(&batch).into_iter().enumerate() {
            result.expect("append");
            let i = (round * 16 + k) % IDS;
            highest[i] += 1;
            writeln!(out, "acked {i} {}", highest[i]).expect("stdout");
        }
        out.flush().expect("flush");
    }
}

/// Kills the appending child three times on each store, each time at a
/// different count of acknowledged batches (while it is writing the
/// next), and after each kill reopens the store: every acknowledged event
/// is there, each id's events are `1..=highest` with no gap, and each
/// holds the number it was written with.
#[test]
fn a_killed_writer_loses_no_acknowledged_event() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let stores = [
        format!("redb:{}", dir.path().join("one.redb").display()),
        format!("redb-lanes=4:{}", dir.path().join("lanes").display()),
        format!("fjall:{}", dir.path().join("fjall").display()),
    ];
    let exe = std::env::current_exe().expect("the test binary");
    for spec in &stores {
        let mut acked: BTreeMap<usize, u64> = BTreeMap::new();
        for (kill, after) in [160, 400, 800].into_iter().enumerate() {
            let mut child = Command::new(&exe)
                .args(["--ignored", "--exact", "appending_child", "--nocapture"])
                .env("DATUM_KILL_STORE", spec)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn the child");
            let stdout = child.stdout.take().expect("stdout");
            // Lines come over a channel, so that a child that hangs fails
            // the test at the deadline instead of hanging it.
            let (tx, lines) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    if line.is_err() || tx.send(line.unwrap_or_default()).is_err() {
                        return;
                    }
                }
            });
            let deadline = Instant::now() + LONG;
            let mut seen = 0;
            while seen < after {
                let left = deadline.saturating_duration_since(Instant::now());
                let Ok(line) = lines.recv_timeout(left) else {
                    break;
                };
                let Some(rest) = line.strip_prefix("acked ") else {
                    continue;
                };
                let (i, seq) = rest.split_once(' ').expect("acked i seq");
                acked.insert(i.parse().expect("i"), seq.parse().expect("seq"));
                seen += 1;
            }
            assert_eq!(seen, after, "{spec}: the child stopped after {seen} acks");
            child.kill().expect("kill");
            child.wait().expect("reap");
            let store = open(spec);
            for (&i, &seq) in &acked {
                let highest = store.highest_sequence_nr(&id(i)).expect("highest");
                assert!(
                    highest >= seq,
                    "{spec}, kill {kill}: id {i} acked {seq}, holds {highest}"
                );
                let events = store
                    .replay(&id(i), 1, u64::MAX, usize::MAX)
                    .expect("replay");
                assert_eq!(events.len() as u64, highest, "{spec}: id {i}'s events");
                for (n, event) in (1u64..).zip(&events) {
                    assert_eq!(event.sequence_nr, n, "{spec}: id {i}");
                    assert_eq!(
                        event.payload.bytes,
                        n.to_le_bytes(),
                        "{spec}: id {i} event {n}"
                    );
                }
            }
            drop(store);
        }
        println!(
            "{spec}: {} acked events survived three kills",
            acked.values().sum::<u64>()
        );
    }
}

/// Fills a redb file through the public API: 10 ids' events, one state,
/// one remembered id.
fn fill(path: &Path) {
    let store = RedbPersistence::open(path).expect("open");
    for i in 0..10 {
        let write = AtomicWrite {
            persistence_id: id(i),
            expected: 0,
            events: (0..=i as u8)
                .map(|n| Payload {
                    manifest: "tally.added".into(),
                    version: 1,
                    bytes: vec![n],
                })
                .collect(),
            writer: Writer::default(),
        };
        assert_eq!(store.append(&[write]), vec![Ok(())]);
    }
    let state = Payload {
        manifest: "tally.state".into(),
        version: 1,
        bytes: vec![42],
    };
    DurableStateStore::save(&store, &id(0), 0, state, Writer::default()).expect("save");
    store
        .record_entity_started("tally", ShardId(3), "t-0")
        .expect("remember");
}

fn copy_store(from: &str, to: &str) -> std::process::Output {
    Command::new(BIN)
        .args(["copy-store", "--from", from, "--to", to])
        .output()
        .expect("run datum-node copy-store")
}

/// `datum-node copy-store` moves a redb file to fjall, and fjall to four
/// redb lanes: every event, the state and the remembered id read back
/// from each; a target that holds anything, a source that does not
/// exist and a bad store name are refused with a message and a failing
/// exit.
#[test]
fn copy_store_moves_a_redb_file_to_fjall_and_to_lanes() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = dir.path().join("node.redb");
    fill(&file);
    let redb = format!("redb:{}", file.display());
    let fjall = format!("fjall:{}", dir.path().join("fjall").display());
    let lanes = format!("redb-lanes=4:{}", dir.path().join("lanes").display());
    for (from, to) in [(&redb, &fjall), (&fjall, &lanes)] {
        let out = copy_store(from, to);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{from} → {to}: {out:?}");
        assert!(
            stdout.contains(
                "copied 55 events of 10 journals, 0 snapshots, 1 states and 1 remembered entities"
            ),
            "{stdout}"
        );
    }
    {
        let copied = FjallPersistence::open(dir.path().join("fjall")).expect("open fjall");
        let four = RedbPersistence::open_lanes(dir.path().join("lanes"), 4).expect("open lanes");
        for i in 0..10 {
            for store in [&copied as &dyn Journal, &four] {
                let events = store.replay(&id(i), 1, u64::MAX, 100).expect("replay");
                let bytes: Vec<u8> = events.iter().map(|e| e.payload.bytes[0]).collect();
                assert_eq!(bytes, (0..=i as u8).collect::<Vec<_>>(), "id {i}");
            }
        }
        let state = DurableStateStore::load(&four, &id(0)).expect("state");
        assert_eq!(
            state.map(|s| (s.revision, s.payload.bytes)),
            Some((1, vec![42]))
        );
        let remembered = four
            .list_entities_for_shard("tally", ShardId(3))
            .expect("remembered");
        assert_eq!(remembered, ["t-0"]);
    }
    // A directory that holds no store is not made one by reading it.
    let plain = dir.path().join("plain");
    std::fs::create_dir(&plain).expect("a directory");
    let refusals = [
        (
            redb.clone(),
            fjall.clone(),
            1,
            "invalid persistence request: the store to copy into is not empty",
        ),
        (
            format!("redb:{}", dir.path().join("missing.redb").display()),
            format!("fjall:{}", dir.path().join("new").display()),
            1,
            "does not exist",
        ),
        (
            format!("fjall:{}", plain.display()),
            format!("redb:{}", dir.path().join("new.redb").display()),
            1,
            "version does not exist",
        ),
        (
            format!("redb-lanes=4:{}", plain.display()),
            format!("redb:{}", dir.path().join("new.redb").display()),
            1,
            "lane-0-of-4.redb does not exist",
        ),
        (
            redb.clone(),
            format!("redb-lanes=x:{}", dir.path().display()),
            2,
            "lane count",
        ),
        (
            redb.clone(),
            "sqlite:/tmp/x".into(),
            2,
            "expected redb:FILE",
        ),
        (
            redb.clone(),
            format!("redb-lanes=0:{}", dir.path().display()),
            2,
            "from 1 to 64",
        ),
    ];
    for (from, to, code, why) in refusals {
        let out = copy_store(&from, &to);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{from} → {to}: {stderr}");
        assert!(stderr.contains(why), "{from} → {to}: {stderr}");
    }
    let left: Vec<_> = std::fs::read_dir(&plain).expect("read").collect();
    assert!(left.is_empty(), "reading {} wrote into it", plain.display());
}
