//! Awaiting senders for the tests that move shards under traffic
//! (tests/rebalance.rs, tests/migration.rs): each writer appends 1, 2, 3,
//! … to its own entities, one ask at a time, retrying a failed ask (so an
//! ask that failed although it was processed shows as a duplicate in the
//! entity's log). Included by `#[path]`.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use datum_cluster_sharding::prelude::*;
use tokio::task::JoinHandle;

/// How long a writer retries one ask, and `run_for` waits, before failing.
const LONG: Duration = Duration::from_secs(30);

/// What a writer sent last to each of its entities, and the errors it retried.
pub type Written = (BTreeMap<String, u64>, Vec<ShardingError>);

pub struct Writers<P> {
    ids: Vec<String>,
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<Written>>,
    _protocol: std::marker::PhantomData<fn() -> P>,
}

impl<P: Protocol> Writers<P> {
    /// `writers` writers through `system`, each with `per_writer` entities
    /// `<prefix>-<w>-<k>`, sending `append(seq)` with `timeout` per ask.
    pub fn start<M>(
        system: &ShardedSystem,
        prefix: &str,
        (writers, per_writer): (usize, usize),
        append: fn(u64) -> M,
        timeout: Duration,
    ) -> Self
    where
        M: Ask<P> + Send + 'static,
        M::Reply: Send,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        let mut all = Vec::new();
        for w in 0..writers {
            let ids: Vec<String> = (0..per_writer)
                .map(|k| format!("{prefix}-{w}-{k}"))
                .collect();
            all.extend(ids.iter().cloned());
            let (system, stop, rounds) = (system.clone(), stop.clone(), rounds.clone());
            tasks.push(tokio::spawn(async move {
                let mut last = BTreeMap::new();
                let mut errors = Vec::new();
                let mut seq = 0;
                while !stop.load(Ordering::Acquire) {
                    seq += 1;
                    for id in &ids {
                        let entity = system.entity_ref::<P>(id.as_str());
                        let deadline = Instant::now() + LONG;
                        loop {
                            match entity.ask(append(seq), timeout).await {
                                Ok(_) => break,
                                Err(error) => {
                                    assert!(
                                        Instant::now() < deadline,
                                        "{id} never answered: {errors:?}"
                                    );
                                    errors.push(error);
                                    tokio::time::sleep(Duration::from_millis(10)).await;
                                }
                            }
                        }
                        last.insert(id.clone(), seq);
                    }
                    rounds.fetch_add(1, Ordering::AcqRel);
                }
                (last, errors)
            }));
        }
        Writers {
            ids: all,
            stop,
            rounds,
            tasks,
            _protocol: std::marker::PhantomData,
        }
    }

    /// How many shards the writers' entities fall in.
    pub fn shards(&self, system: &ShardedSystem) -> usize {
        self.ids
            .iter()
            .map(|id| system.entity_ref::<P>(id.as_str()).shard_id())
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// Waits until every writer has done `more` further rounds.
    pub async fn run_for(&self, more: u64) {
        let target = self.rounds.load(Ordering::Acquire) + more * self.tasks.len() as u64;
        let deadline = Instant::now() + LONG;
        while self.rounds.load(Ordering::Acquire) < target {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for writer rounds"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn finish(self) -> Written {
        self.stop.store(true, Ordering::Release);
        let mut last = BTreeMap::new();
        let mut errors = Vec::new();
        for task in self.tasks {
            let (l, e) = task.await.expect("writer");
            last.extend(l);
            errors.extend(e);
        }
        (last, errors)
    }
}
