//! What recording a remembered entity costs the region that spawns it: one
//! push onto the write-behind queue (divan). The store's own work happens on
//! the writer thread, off the message path; here it is a no-op store, so the
//! writer keeps the queue from filling.
//!
//! And what reading one shard's `FileStore` log costs a restarted node, over
//! 1,000 to 100,000 ids: it must grow linearly with the log (it grew with
//! its square when each record copied the ids).
//!
//! And what a restart costs: a node with 20,000 remembered ids over 8
//! shards, each shard's log read and its ids respawned at the configured
//! rate (1,000 every 100 ms per shard) — concurrently: until
//! every id is respawned, and until one ask to each shard is answered.
//!
//! And a burst of new remembered entities on a `FileStore` (`Always`) with
//! the default settings: 40,000 first asks from 256 concurrent askers,
//! until every record is durable; the flush must report nothing dropped
//! (under the old drop-when-full default it lost records at this rate).
//!
//! Run: `cargo bench --bench remember`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use datum_cluster_sharding::__private::bench::RememberQueue;
use datum_cluster_sharding::prelude::*;
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

#[derive(Serialize, Deserialize)]
struct Hello;

protocol! {
    /// A remembered entity that answers.
    protocol Kept = "kept" {
        ask Hello -> ();
    }
}

struct KeptEntity;

impl Entity for KeptEntity {
    type Protocol = Kept;
}

impl Handler<Hello> for KeptEntity {
    async fn handle(&mut self, _: Hello, _: &EntityContext) -> ShardingResult<()> {
        Ok(())
    }
}

const RESTART_IDS: usize = 20_000;
const RESTART_SHARDS: u32 = 8;

fn kept_id(k: usize) -> String {
    format!("kept-{k:06}")
}

/// A fresh system on a `FileStore` in `dir`, `KeptEntity` remembered.
async fn kept_on(
    dir: &std::path::Path,
    fsync: FileStoreFsyncPolicy,
    shards: u32,
) -> ShardedSystem<FileStore> {
    let store = FileStore::open(dir, fsync).expect("open");
    let system = ShardedSystem::builder()
        .num_shards(shards)
        .store(store)
        .start()
        .await
        .expect("system");
    system
        .entity_type::<KeptEntity>()
        .remembered()
        .register(|_| KeptEntity)
        .await
        .expect("registered");
    system
}

/// A store directory holding `RESTART_IDS` remembered ids over
/// `RESTART_SHARDS` shards, written by a system that then shut down.
fn remembered_store(runtime: &tokio::runtime::Runtime) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    runtime.block_on(async {
        let system = kept_on(dir.path(), FileStoreFsyncPolicy::Never, RESTART_SHARDS).await;
        for k in 0..RESTART_IDS {
            system
                .entity_ref::<Kept>(kept_id(k))
                .ask(Hello, Duration::from_secs(30))
                .await
                .expect("answered");
        }
        system.flush_remember_entities().await.expect("flushed");
        system.shutdown().await;
    });
    dir
}

/// A system restarted on `dir`, its remembered type registered; counts
/// the incarnations it starts.
async fn restarted(dir: &std::path::Path, started: &Arc<AtomicUsize>) -> ShardedSystem<FileStore> {
    let store = FileStore::open(dir, FileStoreFsyncPolicy::Never).expect("open");
    let system = ShardedSystem::builder()
        .num_shards(RESTART_SHARDS)
        .store(store)
        .start()
        .await
        .expect("system");
    let counter = started.clone();
    system
        .entity_type::<KeptEntity>()
        .remembered()
        .register(move |_| {
            counter.fetch_add(1, Ordering::Relaxed);
            KeptEntity
        })
        .await
        .expect("registered");
    system
}

/// From the restart until every remembered id runs again, and the system
/// shut down (`shutdown_of_every_respawned_id` times that part alone). At
/// the configured rate, concurrently: 2,500 ids a shard is 3 batches, the
/// last ≈ 200 ms after the first.
#[divan::bench(sample_count = 10)]
fn restart_until_every_id_respawned(bencher: divan::Bencher) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let dir = remembered_store(&runtime);
    bencher.bench(|| {
        runtime.block_on(async {
            let started = Arc::new(AtomicUsize::new(0));
            let system = restarted(dir.path(), &started).await;
            while started.load(Ordering::Relaxed) < RESTART_IDS {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            system.shutdown().await;
        })
    });
}

/// From the restart until one ask to an id of each shard is answered
/// (each waits for its own shard's read, never for another's), and the
/// system shut down.
#[divan::bench(sample_count = 10)]
fn restart_until_every_shard_answers(bencher: divan::Bencher) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let dir = remembered_store(&runtime);
    let extractor = DefaultShardExtractor;
    let mut one_per_shard: Vec<String> = Vec::new();
    for k in 0..RESTART_IDS {
        let id = kept_id(k);
        let shard = extractor.shard_id(&id, RESTART_SHARDS).0 as usize;
        if shard == one_per_shard.len() {
            one_per_shard.push(id);
        }
    }
    bencher.bench(|| {
        runtime.block_on(async {
            let started = Arc::new(AtomicUsize::new(0));
            let system = restarted(dir.path(), &started).await;
            let asks = one_per_shard.iter().map(|id| {
                let entity = system.entity_ref::<Kept>(id.clone());
                async move { entity.ask(Hello, Duration::from_secs(30)).await }
            });
            for answered in futures_util::future::join_all(asks).await {
                answered.expect("answered");
            }
            system.shutdown().await;
        })
    });
}

/// What the two benches above include besides the restart: stopping the
/// 20,000 respawned entities (the restart happens in untimed setup).
#[divan::bench(sample_count = 10)]
fn shutdown_of_every_respawned_id(bencher: divan::Bencher) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let dir = remembered_store(&runtime);
    bencher
        .with_inputs(|| {
            runtime.block_on(async {
                let started = Arc::new(AtomicUsize::new(0));
                let system = restarted(dir.path(), &started).await;
                while started.load(Ordering::Relaxed) < RESTART_IDS {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                system
            })
        })
        .bench_local_values(|system| runtime.block_on(system.shutdown()));
}

const BURST_IDS: usize = 40_000;
const BURST_ASKERS: usize = 256;

/// From a fresh system until `BURST_IDS` new remembered entities have
/// answered and their records are flushed (and the system shut down).
#[divan::bench(sample_count = 5)]
fn burst_of_new_remembered_ids_until_durable(bencher: divan::Bencher) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    bencher
        .with_inputs(|| tempfile::tempdir().expect("a temporary directory"))
        .bench_values(|dir| {
            runtime.block_on(async {
                let system = kept_on(dir.path(), FileStoreFsyncPolicy::Always, 64).await;
                let mut askers = tokio::task::JoinSet::new();
                for a in 0..BURST_ASKERS {
                    let system = system.clone();
                    askers.spawn(async move {
                        for k in (a..BURST_IDS).step_by(BURST_ASKERS) {
                            system
                                .entity_ref::<Kept>(kept_id(k))
                                .ask(Hello, Duration::from_secs(60))
                                .await
                                .expect("answered");
                        }
                    });
                }
                while let Some(done) = askers.join_next().await {
                    done.expect("an asker");
                }
                system
                    .flush_remember_entities()
                    .await
                    .expect("nothing dropped");
                system.shutdown().await;
            });
            dir
        });
}
