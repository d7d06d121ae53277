//! What recording a remembered entity costs the region that spawns it: one
//! push onto the write-behind queue (divan). The store's own work happens on
//! the writer thread, off the message path; here it is a no-op store, so the
//! writer keeps the queue from filling.
//!
//! And what reading one shard's `FileStore` log costs a restarted node, over
//! 1,000 to 100,000 ids: it must grow linearly with the log (it grew with
//! its square, a copy of the ids per record, until issue 28).
//!
//! Run: `cargo bench --bench remember`.

use std::sync::Arc;

use datum_cluster_sharding::__private::bench::RememberQueue;
use datum_cluster_sharding::{
    FileStore, FileStoreFsyncPolicy, RememberEntitiesStore, RememberRecord, ShardId,
};

fn main() {
    divan::main();
}

#[divan::bench]
fn push_one_record(bencher: divan::Bencher) {
    let queue = RememberQueue::new(1_000_000);
    let id: Arc<str> = Arc::from("entity-123");
    bencher.bench(|| queue.push(divan::black_box(&id)));
}

/// Opens a store on a log of `n` ids (written once, with one append) and
/// lists the shard: what a restarted node pays before respawning it.
#[divan::bench(args = [1_000, 10_000, 100_000], sample_count = 10)]
fn read_a_shards_log(bencher: divan::Bencher, n: usize) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ids: Vec<String> = (0..n).map(|k| format!("entity-{k:08}")).collect();
    {
        let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("open");
        let records: Vec<RememberRecord<'_>> = ids
            .iter()
            .map(|id| RememberRecord {
                type_name: "bench",
                shard_id: ShardId(0),
                entity_id: id,
                started: true,
            })
            .collect();
        assert!(store.record_batch(&records).iter().all(Result::is_ok));
    }
    bencher.bench(|| {
        let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Never).expect("open");
        let listed = store
            .list_entities_for_shard("bench", ShardId(0))
            .expect("read");
        assert_eq!(listed.len(), n);
        listed
    });
}
