//! The write-behind queue between the regions and a remember-entities store.
//!
//! ```text
//!   region (under a shard lock) ── send ──► queue ──► writer thread ──► store
//!        never waits                         FIFO       (fsync here)
//!   EntityRef::ask / tell ── waits while the queue is full (BackPressure)
//!   flush_remember_entities() ── Flush marker ──► answered when every write
//!                                                  queued before it is done
//! ```
//!
//! Recording an id never blocks the message hot path or holds a shard lock
//! across a store call: the region only enqueues. One writer thread per
//! system applies the writes in order, so a start and a later stop of one id
//! reach the store in that order. A full queue (as many records waiting as
//! its capacity, or more) holds local senders back under
//! [`RememberEntitiesQueueFull::BackPressure`], the default, or drops the
//! record as a failure under `Drop`. What a failure does is the
//! [`RememberEntitiesFailurePolicy`]'s choice: `FailOpen` keeps routing and
//! publishes a [`RememberEntitiesEvent`]; `FailClosed` also marks the shard
//! failed, and its messages then fail with
//! [`ShardingError::RememberEntities`](crate::ShardingError::RememberEntities).

use std::collections::HashSet;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use tokio::sync::{broadcast, oneshot};

use super::{RememberEntitiesOperation, RememberEntitiesStore, RememberRecord};
use crate::model::config::{
    RememberEntitiesConfig, RememberEntitiesFailurePolicy, RememberEntitiesQueueFull,
};
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;

/// A remember-entities store failure, as published to subscribers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RememberEntitiesEvent {
    /// The entity type.
    pub type_name: String,
    /// The shard (`None` for a failed `ListShards`).
    pub shard_id: Option<ShardId>,
    /// The entity, for a record.
    pub entity_id: Option<String>,
    /// What failed.
    pub operation: RememberEntitiesOperation,
    /// The policy that was applied.
    pub policy: RememberEntitiesFailurePolicy,
    /// What went wrong.
    pub error: String,
}

/// One record waiting for the store.
struct Write {
    type_name: &'static str,
    shard: ShardId,
    entity_id: Arc<str>,
    operation: RememberEntitiesOperation,
}

/// The most records handed to the store at once.
const MAX_BATCH: usize = 4_096;

/// Hands a batch to the store and reports each record that failed. A store
/// that panics fails the whole batch, not the writer.
fn apply(store: &dyn RememberEntitiesStore, writer: &std::sync::Weak<Remember>, batch: &[Write]) {
    let records: Vec<RememberRecord<'_>> = batch
        .iter()
        .map(|w| RememberRecord {
            type_name: w.type_name,
            shard_id: w.shard,
            entity_id: &w.entity_id,
            started: w.operation != RememberEntitiesOperation::RecordStopped,
        })
        .collect();
    let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store.record_batch(&records)
    }))
    .unwrap_or_else(|_| {
        records
            .iter()
            .map(|_| Err(super::StoreError("the store panicked".into())))
            .collect()
    });
    let Some(remember) = writer.upgrade() else {
        return;
    };
    remember.publish_repairs();
    for (i, w) in batch.iter().enumerate() {
        let result = results.get(i).cloned().unwrap_or_else(|| {
            Err(super::StoreError(
                "the store answered fewer results than records".into(),
            ))
        });
        if let Err(error) = result {
            remember.failure(
                w.type_name,
                Some(w.shard),
                Some(&w.entity_id),
                w.operation,
                &error.0,
            );
        }
    }
}

enum Job {
    Write(Write),
    /// Answered with the number of records failed so far.
    Flush(oneshot::Sender<u64>),
}

/// `wait` from now, or a year from now when that is past what an instant
/// can hold (a huge timeout is no deadline, not a panic).
pub(crate) fn deadline_after(wait: std::time::Duration) -> tokio::time::Instant {
    deadline_from(tokio::time::Instant::now(), wait)
}

/// `wait` from `now`, or a year from `now` when that is past what an
/// instant can hold.
pub(crate) fn deadline_from(
    now: tokio::time::Instant,
    wait: std::time::Duration,
) -> tokio::time::Instant {
    now.checked_add(wait)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(365 * 24 * 3600))
}

impl Drop for Remember {
    /// Records still queued leave the process-wide depth gauge with it.
    fn drop(&mut self) {
        self.depth
            .decrement(self.backlog.load(Ordering::Acquire) as f64);
    }
}

/// Ends the waits for room when the writer thread ends while its
/// `Remember` lives on.
struct WriterEnded(std::sync::Weak<Remember>);

impl Drop for WriterEnded {
    fn drop(&mut self) {
        if let Some(remember) = self.0.upgrade() {
            remember.end_waits_with(2);
        }
    }
}

/// How many events a slow subscriber may lag behind.
const EVENT_CAPACITY: usize = 1_024;

/// A system's write-behind queue and its failure bookkeeping.
pub(crate) struct Remember {
    store: Arc<dyn RememberEntitiesStore>,
    respawn: (usize, std::time::Duration),
    tx: Sender<Job>,
    /// Records queued and not yet applied by the store, the queue's
    /// capacity, what a full queue does, and a tell's longest wait.
    backlog: AtomicUsize,
    capacity: usize,
    when_full: RememberEntitiesQueueFull,
    full_queue_wait: std::time::Duration,
    /// Told when the backlog falls below the capacity, and when waiting
    /// ends for good (`waits_end`).
    room: tokio::sync::Notify,
    /// Why no sender waits for room any more: 0 none (they wait), 1 the
    /// system is shutting down, 2 the writer thread has ended.
    waits_end: std::sync::atomic::AtomicU8,
    policy: RememberEntitiesFailurePolicy,
    events: broadcast::Sender<RememberEntitiesEvent>,
    failed: Failed,
    /// Records that failed (or were dropped by a full queue) so far, the
    /// last of them, and how many a flush has reported already.
    record_failures: std::sync::atomic::AtomicU64,
    last_record_failure: Mutex<Option<(&'static str, ShardId, String)>>,
    reported_failures: Mutex<u64>,
    /// `datum_remember_queue_depth` and `datum_remember_failures_total`.
    depth: metrics::Gauge,
    failures: metrics::Counter,
}

/// Shards marked failed under `FailClosed`; checked on every message of a
/// remembered type, so the common "none failed" answer is one atomic load.
#[derive(Default)]
struct Failed {
    any: AtomicBool,
    shards: Mutex<HashSet<(&'static str, ShardId)>>,
}

impl Failed {
    fn mark(&self, type_name: &'static str, shard: ShardId) {
        self.shards
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((type_name, shard));
        self.any.store(true, Ordering::Release);
    }

    fn contains(&self, type_name: &'static str, shard: ShardId) -> bool {
        self.any.load(Ordering::Acquire)
            && self
                .shards
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&(type_name, shard))
    }
}

impl Remember {
    /// Starts the writer thread over `store`.
    pub(crate) fn start(
        store: Arc<dyn RememberEntitiesStore>,
        config: &RememberEntitiesConfig,
    ) -> ShardingResult<Arc<Self>> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let remember = Arc::new(Remember {
            store,
            respawn: (config.respawn_batch, config.respawn_interval),
            tx,
            backlog: AtomicUsize::new(0),
            capacity: config.queue_capacity.max(1),
            when_full: config.when_full,
            full_queue_wait: config.full_queue_wait,
            room: tokio::sync::Notify::new(),
            waits_end: std::sync::atomic::AtomicU8::new(0),
            policy: config.failure_policy,
            events,
            failed: Failed::default(),
            record_failures: std::sync::atomic::AtomicU64::new(0),
            last_record_failure: Mutex::new(None),
            reported_failures: Mutex::new(0),
            depth: metrics::gauge!(crate::ops::telemetry::REMEMBER_QUEUE),
            failures: metrics::counter!(crate::ops::telemetry::REMEMBER_FAILURES),
        });
        let writer = Arc::downgrade(&remember);
        // Weak: the thread must not keep the store (and a file store's
        // directory lock) alive once the system that owns it is gone.
        let store = Arc::downgrade(&remember.store);
        std::thread::Builder::new()
            .name("remember-entities".into())
            .spawn(move || {
                // If this thread ends while the queue is still in use (it
                // panicked outside a store call), senders waiting for room
                // stop waiting.
                let _ended = WriterEnded(writer.clone());
                // Ends when every sender (the `Remember`) is gone.
                // Every write waiting goes to the store as one batch (a
                // store may sync once for all of them); a flush marker ends
                // a batch and is answered once the writes before it are done.
                let mut batch: Vec<Write> = Vec::new();
                while let Ok(job) = rx.recv() {
                    let mut flush = None;
                    let mut next = Some(job);
                    while let Some(job) = next.take() {
                        match job {
                            Job::Flush(done) => {
                                flush = Some(done);
                                break;
                            }
                            Job::Write(write) => batch.push(write),
                        }
                        if batch.len() < MAX_BATCH {
                            next = rx.try_recv().ok();
                        }
                    }
                    if !batch.is_empty() {
                        let Some(store) = store.upgrade() else {
                            break;
                        };
                        apply(&*store, &writer, &batch);
                        if let Some(remember) = writer.upgrade() {
                            remember.taken(batch.len());
                        }
                        batch.clear();
                    }
                    if let Some(done) = flush {
                        let failures = writer
                            .upgrade()
                            .map_or(0, |r| r.record_failures.load(Ordering::Acquire));
                        let _ = done.send(failures);
                    }
                }
            })
            .map_err(|e| ShardingError::Spawn(format!("remember-entities writer: {e}")))?;
        Ok(remember)
    }

    /// How many remembered ids a shard respawns at once, and how long it
    /// waits before the next batch.
    pub(crate) fn respawn_rate(&self) -> (usize, std::time::Duration) {
        self.respawn
    }

    /// The store, for reads (listing ids when a shard starts).
    pub(crate) fn store(&self) -> &Arc<dyn RememberEntitiesStore> {
        &self.store
    }

    /// Queues a record; never waits. A full queue drops it as a failure
    /// under `Drop`; under `BackPressure` it is queued all the same (the
    /// senders wait instead: [`Remember::room`]).
    pub(crate) fn record(
        &self,
        type_name: &'static str,
        shard: ShardId,
        entity_id: &Arc<str>,
        operation: RememberEntitiesOperation,
    ) {
        if self.when_full == RememberEntitiesQueueFull::Drop
            && self.backlog.load(Ordering::Acquire) >= self.capacity
        {
            self.failure(
                type_name,
                Some(shard),
                Some(entity_id),
                operation,
                "the write-behind queue is full; the record was dropped",
            );
            return;
        }
        let job = Job::Write(Write {
            type_name,
            shard,
            entity_id: entity_id.clone(),
            operation,
        });
        self.backlog.fetch_add(1, Ordering::AcqRel);
        self.depth.increment(1.0);
        if self.tx.send(job).is_err() {
            self.taken(1);
            self.failure(
                type_name,
                Some(shard),
                Some(entity_id),
                operation,
                "the remember-entities writer has stopped",
            );
        }
    }

    /// Whether the queue counts as full (as many records waiting as its
    /// capacity, or more) under `BackPressure`: the message path's check,
    /// before anything waits.
    pub(crate) fn is_full(&self) -> bool {
        self.when_full == RememberEntitiesQueueFull::BackPressure
            && self.backlog.load(Ordering::Acquire) >= self.capacity
    }

    /// Senders waiting for room stop waiting, now and from now on: the
    /// system is shutting down (`ShuttingDown`).
    pub(crate) fn end_waits(&self) {
        self.end_waits_with(1);
    }

    fn end_waits_with(&self, why: u8) {
        let _ = self
            .waits_end
            .compare_exchange(0, why, Ordering::AcqRel, Ordering::Acquire);
        self.room.notify_waiters();
    }

    /// The writer's store applied `n` records (or one was not queued).
    fn taken(&self, n: usize) {
        let before = self.backlog.fetch_sub(n, Ordering::AcqRel);
        self.depth.decrement(n as f64);
        if before.saturating_sub(n) < self.capacity {
            self.room.notify_waiters();
        }
    }

    /// Under `BackPressure`, waits until the queue has room (fewer records
    /// waiting than its capacity), until `deadline` at most (`None`: a
    /// tell's `full_queue_wait`); at once otherwise. Past the deadline:
    /// `RememberEntities`, and the message is not sent.
    pub(crate) async fn room(
        &self,
        type_name: &'static str,
        shard: ShardId,
        deadline: Option<tokio::time::Instant>,
    ) -> ShardingResult<()> {
        if !self.is_full() {
            return Ok(());
        }
        let deadline = deadline.unwrap_or_else(|| deadline_after(self.full_queue_wait));
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.waits_end.load(Ordering::Acquire) {
                0 => {}
                1 => return Err(ShardingError::ShuttingDown),
                _ => {
                    return Err(ShardingError::RememberEntities {
                        type_name,
                        shard_id: shard,
                        message:
                            "the remember-entities writer has stopped; the message was not sent"
                                .into(),
                    });
                }
            }
            if self.backlog.load(Ordering::Acquire) < self.capacity {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(ShardingError::RememberEntities {
                    type_name,
                    shard_id: shard,
                    message: "the write-behind queue stayed full; the message was not sent".into(),
                });
            }
        }
    }

    /// Applies the policy to a failure and publishes it.
    pub(crate) fn failure(
        &self,
        type_name: &'static str,
        shard: Option<ShardId>,
        entity_id: Option<&str>,
        operation: RememberEntitiesOperation,
        error: &str,
    ) {
        tracing::warn!(type_name, ?shard, entity_id, ?operation, policy = ?self.policy, error, "remember-entities store failed");
        if matches!(
            operation,
            RememberEntitiesOperation::RecordStarted | RememberEntitiesOperation::RecordStopped
        ) && let Some(shard) = shard
        {
            *self
                .last_record_failure
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some((type_name, shard, error.to_owned()));
            self.record_failures.fetch_add(1, Ordering::AcqRel);
            self.failures.increment(1);
        }
        if self.policy == RememberEntitiesFailurePolicy::FailClosed
            && let Some(shard) = shard
        {
            self.failed.mark(type_name, shard);
        }
        let _ = self.events.send(RememberEntitiesEvent {
            type_name: type_name.to_owned(),
            shard_id: shard,
            entity_id: entity_id.map(str::to_owned),
            operation,
            policy: self.policy,
            error: error.to_owned(),
        });
    }

    /// Publishes the logs the store repaired since the last look (each a
    /// `RepairLog` event; nothing is marked failed).
    pub(crate) fn publish_repairs(&self) {
        let repairs =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.store.take_repairs()))
                .unwrap_or_default();
        for repair in repairs {
            tracing::warn!(type_name = repair.type_name, shard = %repair.shard_id, what = repair.what, "remember-entities store repaired a log");
            let _ = self.events.send(RememberEntitiesEvent {
                type_name: repair.type_name,
                shard_id: Some(repair.shard_id),
                entity_id: None,
                operation: RememberEntitiesOperation::RepairLog,
                policy: self.policy,
                error: repair.what,
            });
        }
    }

    /// Whether `shard` was marked failed (`FailClosed`): if so, the error its
    /// messages fail with.
    pub(crate) fn check(&self, type_name: &'static str, shard: ShardId) -> ShardingResult<()> {
        if self.failed.contains(type_name, shard) {
            Err(ShardingError::RememberEntities {
                type_name,
                shard_id: shard,
                message: "the shard's remember-entities store failed (FailClosed)".into(),
            })
        } else {
            Ok(())
        }
    }

    /// New subscription to failure events.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<RememberEntitiesEvent> {
        self.events.subscribe()
    }

    /// Waits until every write queued before this call has been handled by
    /// the store; returns how many records have failed so far. Reports
    /// nothing (the library's own waits use it, so that a user's flush still
    /// hears of failures).
    pub(crate) async fn barrier(&self) -> ShardingResult<u64> {
        let (done, flushed) = oneshot::channel();
        self.tx
            .send(Job::Flush(done))
            .map_err(|_| ShardingError::ShuttingDown)?;
        flushed.await.map_err(|_| ShardingError::ShuttingDown)
    }

    /// Waits until every write queued before this call has been handled by
    /// the store (and so is durable as its fsync policy makes it). Records
    /// that failed or found the queue full are not retried (they were
    /// reported as events); if any did since the last flush that said so,
    /// this one fails with `RememberEntities`, naming the last of them.
    pub(crate) async fn flush(&self) -> ShardingResult<()> {
        let failures = self.barrier().await?;
        let mut reported = self
            .reported_failures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if failures <= *reported {
            return Ok(());
        }
        let new = failures - *reported;
        *reported = failures;
        drop(reported);
        let last = self
            .last_record_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let (type_name, shard_id, error) = last.unwrap_or(("", ShardId(0), String::new()));
        Err(ShardingError::RememberEntities {
            type_name,
            shard_id,
            message: format!(
                "{new} remember-entities record(s) failed since the last flush and are not durable; the last: {error}"
            ),
        })
    }
}
