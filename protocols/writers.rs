//! Awaiting senders for the tests that move shards under traffic
//! (tests/rebalance.rs, tests/migration.rs): each writer appends 1, 2, 3,
//! … to its own entities, one ask at a time, retrying a failed ask (so an
//! ask that failed although it was processed shows as a duplicate in the
//! entity's log). And the second writers of a split brain on one journal
//! (tests/durable.rs, tests/postgres.rs): `second_writers_race`,
//! `journaled`. Included by `#[path]`.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use datum_cluster_sharding::persistence::{Journal, PersistenceError, PersistenceId};
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

/// Drives two sides of a split brain on one journal (`sides`, systems that
/// do not know each other, sharing it and hosting the same entities
/// `w0`..`w3` of `P`): on each side ten askers per entity, each sending
/// `add(1)` with `timeout` again at once until it is accepted, ten adds
/// each (a storm gives up, to fail here rather than run on). Checks that a
/// write was accepted, that conflicts stay below three per accepted write,
/// and that each entity's journal is gap-free and holds every accepted
/// add, once. `P` is named at the call (`::<Tally, _>`): one message type
/// may be asked of several protocols.
pub async fn second_writers_race<P, M>(
    sides: &[ShardedSystem<impl Sized, impl Journal + Clone>],
    add: fn(u64) -> M,
    timeout: Duration,
) where
    P: Protocol,
    M: Ask<P> + Send + 'static,
    M::Reply: Send,
{
    const ENTITIES: usize = 4;
    const ASKERS: usize = 10;
    const ADDS: u64 = 10;
    let mut askers = tokio::task::JoinSet::new();
    for system in sides {
        for k in 0..ENTITIES {
            for _ in 0..ASKERS {
                let entity = system.entity_ref::<P>(format!("w{k}"));
                askers.spawn(async move {
                    let (mut accepted, mut conflicts) = (0u64, 0u64);
                    // Each add sent again at once until it is accepted (a
                    // storm gives up, to fail below rather than run on).
                    while accepted < ADDS && conflicts < 100 * ADDS {
                        match entity.ask(add(1), timeout).await {
                            Ok(_) => accepted += 1,
                            Err(ShardingError::Persistence { error, .. })
                                if matches!(*error, PersistenceError::SequenceConflict { .. }) =>
                            {
                                conflicts += 1
                            }
                            Err(other) => panic!("only a conflict may refuse: {other}"),
                        }
                    }
                    (k, accepted, conflicts)
                });
            }
        }
    }
    let mut accepted = [0u64; ENTITIES];
    let mut conflicts = 0u64;
    while let Some(done) = askers.join_next().await {
        let (k, a, c) = done.expect("an asker");
        accepted[k] += a;
        conflicts += c;
    }
    let total: u64 = accepted.iter().sum();
    assert!(total > 0, "no write was accepted");
    assert!(
        conflicts < 3 * total,
        "{conflicts} conflicts for {total} accepted writes"
    );
    let journal = sides[0].journal();
    for (k, accepted) in accepted.iter().enumerate() {
        assert_eq!(
            journaled::<P, _>(journal, &format!("w{k}")).await,
            *accepted,
            "w{k}: every accepted add, once"
        );
    }
}

/// How many events `journal` holds for `entity` of `P`, checked gap-free
/// (numbered `1..=n`). The replay runs on a blocking thread, as a store's
/// calls may block.
pub async fn journaled<P: Protocol, J: Journal + Clone>(journal: &J, entity: &str) -> u64 {
    let id = PersistenceId::new(P::TYPE_NAME, entity);
    let journal = journal.clone();
    let events = tokio::task::spawn_blocking(move || journal.replay(&id, 1, u64::MAX, 10_000))
        .await
        .expect("replay")
        .expect("replay");
    let numbers: Vec<u64> = events.iter().map(|e| e.sequence_nr).collect();
    assert_eq!(
        numbers,
        (1..=events.len() as u64).collect::<Vec<_>>(),
        "{entity}: gap-free"
    );
    events.len() as u64
}
