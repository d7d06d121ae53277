//! A reliable producer whose unconfirmed messages survive its restart
//! (SPEC §13.17): every message is journaled before it is sent, under the
//! producer's persistence id, with the stream number it was given; a
//! restarted producer of the same id takes the same epoch and sends again
//! what the journal holds unconfirmed, under the same numbers, so the
//! entities recognise what they handled already.
//!
//! The journal (`datum-producer|<type>/<id>`) holds `started` events (the
//! epoch, at each start: the append fences an older instance still
//! running) and `sent` events (`{entity, seq, msg}`); once
//! [`SNAPSHOT_EVERY`] events follow the last snapshot, a snapshot
//! (`{epoch, next: [[entity, next seq]], unconfirmed: [{entity, seq,
//! msg}]}`: the streams and what is unconfirmed) lets the events before it
//! go. Confirmations are not journaled: after a
//! restart a confirmed message may be sent again, and is confirmed as a
//! duplicate.

use std::marker::PhantomData;
use std::sync::{Arc, Weak};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, OwnedSemaphorePermit, oneshot};

use super::{Attempt, ProducerConfig, ProducerStats, ReliableProducer, attempt_of, epoch_now};
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::protocol::{Protocol, Tell};
use crate::persistence::{
    AtomicWrite, Journal, Payload, PersistenceError, PersistenceId, SnapshotRecord, SnapshotStore,
    Writer,
};
use crate::system::ShardedSystem;

/// Events between snapshots of a durable producer's journal.
pub(crate) const SNAPSHOT_EVERY: u64 = 1_024;

const STARTED: &str = "datum-producer#started";
/// Who writes a producer's records: no node or hosting (a producer is
/// fenced by its journal's sequence numbers alone).
const PRODUCER_WRITER: Writer = Writer {
    node_id: 0,
    incarnation: 0,
    generation: 0,
};
const SENT: &str = "datum-producer#sent";
const SNAPSHOT: &str = "datum-producer#snapshot";

/// A `sent` event.
#[derive(Serialize, Deserialize)]
struct Sent {
    entity: String,
    seq: u64,
    #[serde(with = "crate::wire::payload")]
    msg: Bytes,
}

/// A snapshot: the epoch, every stream's next number, what is unconfirmed.
#[derive(Serialize, Deserialize)]
struct Snapshot {
    epoch: u64,
    next: Vec<(String, u64)>,
    unconfirmed: Vec<Sent>,
}

/// A [`ReliableProducer`] of one tell type `M` whose unconfirmed messages
/// are journaled (SPEC §13.17): made by
/// [`ShardedSystem::durable_producer`], which resumes what an earlier
/// instance of the same id left unconfirmed.
pub struct DurableProducer<P: Protocol, M> {
    producer: ReliableProducer<P>,
    log: Arc<Log>,
    /// Sends waiting to be journaled: whichever append comes next takes
    /// them all, in the order they came.
    waiting: Arc<std::sync::Mutex<Vec<Waiting<P>>>>,
    _message: PhantomData<fn(M)>,
}

/// A send waiting to be journaled, and its caller.
struct Waiting<P: Protocol> {
    entity: Arc<str>,
    msg: Bytes,
    attempt: Attempt<P>,
    permit: OwnedSemaphorePermit,
    done: oneshot::Sender<ShardingResult<u64>>,
}

impl<P: Protocol, M> Clone for DurableProducer<P, M> {
    fn clone(&self) -> Self {
        DurableProducer {
            producer: self.producer.clone(),
            log: self.log.clone(),
            waiting: self.waiting.clone(),
            _message: PhantomData,
        }
    }
}

impl<P: Protocol, M> std::fmt::Debug for DurableProducer<P, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableProducer")
            .field("producer", &self.producer)
            .field("persistence_id", &self.log.id)
            .finish_non_exhaustive()
    }
}

/// The producer's journal, appended one write at a time (each write
/// carrying every send waiting by then). It holds the store weakly: the
/// system's handle decides how long it stays open.
struct Log {
    journal: Weak<dyn Journal>,
    snapshots: Weak<dyn SnapshotStore>,
    id: PersistenceId,
    /// The highest sequence number written; held across an append, so
    /// appends (and the numbers they give messages) go one at a time.
    highest: Mutex<u64>,
    /// The sequence number of the latest snapshot (0 for none).
    snapshot_at: std::sync::atomic::AtomicU64,
}

/// The journal and snapshot store, while the system holds them.
type Stores = (Arc<dyn Journal>, Arc<dyn SnapshotStore>);

fn corrupt(id: &PersistenceId, what: String) -> PersistenceError {
    PersistenceError::Corrupt {
        persistence_id: id.clone(),
        what,
    }
}

fn cbor<T: Serialize>(value: &T) -> ShardingResult<Vec<u8>> {
    let mut bytes = Vec::new();
    ciborium::into_writer(value, &mut bytes)
        .map_err(|e| ShardingError::Bug(format!("a producer record does not encode: {e}")))?;
    Ok(bytes)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, PersistenceError> + Send + 'static,
) -> Result<T, PersistenceError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(PersistenceError::Store(format!("a store call failed: {e}"))))
}

impl Log {
    fn error(&self, error: PersistenceError) -> ShardingError {
        ShardingError::Persistence {
            type_name: "datum-producer",
            entity_id: self.id.entity_id.clone(),
            error: Box::new(error),
        }
    }

    fn stores(&self) -> Result<Stores, PersistenceError> {
        match (self.journal.upgrade(), self.snapshots.upgrade()) {
            (Some(journal), Some(snapshots)) => Ok((journal, snapshots)),
            _ => Err(PersistenceError::Store(
                "the system's journal is closed".into(),
            )),
        }
    }

    /// Appends `events` (of `manifest`) after `*highest`, in one atomic
    /// write.
    async fn append(
        &self,
        highest: &mut u64,
        manifest: &str,
        events: Vec<Vec<u8>>,
    ) -> ShardingResult<()> {
        let count = events.len() as u64;
        let write = AtomicWrite {
            persistence_id: self.id.clone(),
            expected: *highest,
            events: events
                .into_iter()
                .map(|bytes| Payload {
                    manifest: manifest.to_owned(),
                    version: 1,
                    bytes,
                })
                .collect(),
            writer: PRODUCER_WRITER,
        };
        let (journal, _) = self.stores().map_err(|e| self.error(e))?;
        let written = blocking(move || {
            journal
                .append(std::slice::from_ref(&write))
                .pop()
                .unwrap_or_else(|| Err(PersistenceError::Store("no result".into())))
        })
        .await;
        written.map_err(|e| self.error(e))?;
        *highest += count;
        Ok(())
    }

    /// Saves a snapshot at `*highest` and deletes what it covers (a
    /// failure is logged: recovery replays more).
    async fn snapshot(&self, highest: u64, snapshot: Snapshot) {
        let id = self.id.clone();
        let saved = match (cbor(&snapshot), self.stores()) {
            (Ok(bytes), Ok((journal, snapshots))) => {
                blocking(move || {
                    let record = SnapshotRecord {
                        sequence_nr: highest,
                        payload: Payload {
                            manifest: SNAPSHOT.into(),
                            version: 1,
                            bytes,
                        },
                        writer: PRODUCER_WRITER,
                    };
                    snapshots.save(&id, record)?;
                    journal.delete_to(&id, highest)?;
                    snapshots.delete_to(&id, highest.saturating_sub(1))
                })
                .await
            }
            (Err(error), _) => Err(PersistenceError::Invalid(error.to_string())),
            (_, Err(error)) => Err(error),
        };
        if let Err(error) = saved {
            tracing::warn!(persistence_id = %self.id, %error, "a producer snapshot was not saved; its recovery replays more");
        }
    }
}

impl<S, J: Journal + SnapshotStore> ShardedSystem<S, J> {
    /// A reliable producer of `P`'s tell `M` named `producer_id`, whose
    /// unconfirmed messages are journaled on this system's journal (SPEC
    /// §13.17). An earlier instance's unconfirmed messages are sent again,
    /// under its epoch and numbers; starting fences an older instance of
    /// the id still running (its next send fails with `Persistence`, a
    /// `SequenceConflict`). Fails with the store's error, or `Persistence`
    /// (`Corrupt`) for a journal it cannot read.
    pub async fn durable_producer<P, M>(
        &self,
        producer_id: &str,
        config: ProducerConfig,
    ) -> ShardingResult<DurableProducer<P, M>>
    where
        P: Protocol,
        M: Tell<P> + Clone + Sync + serde::de::DeserializeOwned,
    {
        let store = self.journal_arc();
        let journal: Arc<dyn Journal> = store.clone();
        let snapshots: Arc<dyn SnapshotStore> = store;
        let id = PersistenceId::new("datum-producer", format!("{}/{producer_id}", P::TYPE_NAME));
        let log = Arc::new(Log {
            journal: Arc::downgrade(&journal),
            snapshots: Arc::downgrade(&snapshots),
            id: id.clone(),
            highest: Mutex::new(0),
            snapshot_at: std::sync::atomic::AtomicU64::new(0),
        });
        let (highest, recovered) = {
            let id = id.clone();
            blocking(move || recover(&*journal, &*snapshots, &id))
                .await
                .map_err(|e| log.error(e))?
        };
        // Every message decodes before anything is written or sent.
        let mut resumed = Vec::with_capacity(recovered.unconfirmed.len());
        for sent in recovered.unconfirmed {
            let msg: M = ciborium::from_reader(&sent.msg[..])
                .map_err(|e| log.error(corrupt(&id, format!("a message does not decode: {e}"))))?;
            resumed.push((sent, msg));
        }
        let epoch = recovered.epoch.unwrap_or_else(epoch_now);
        log.snapshot_at
            .store(recovered.snapshot_at, std::sync::atomic::Ordering::Relaxed);
        let producer = ReliableProducer::start_with(
            producer_id.into(),
            config,
            self.entity_template(),
            epoch,
        )?;
        let mut written = log.highest.lock().await;
        *written = highest;
        // The start is journaled first: an older instance's next append
        // then fails.
        log.append(&mut written, STARTED, vec![cbor(&epoch)?])
            .await?;
        for (sent, msg) in resumed {
            let permit = producer.try_room();
            producer.enqueue(
                sent.entity.into(),
                Some(sent.seq),
                attempt_of(msg),
                Some(Arc::from(&sent.msg[..])),
                permit,
            )?;
        }
        // (After the resumed messages, each queued under its own number.)
        for (entity, next) in recovered.next {
            producer.resume_stream(entity.into(), next);
        }
        drop(written);
        Ok(DurableProducer {
            producer,
            log,
            waiting: Arc::default(),
            _message: PhantomData,
        })
    }
}

/// What a durable producer's journal says.
#[derive(Default)]
struct Recovered {
    /// The latest snapshot's sequence number (0 for none).
    snapshot_at: u64,
    epoch: Option<u64>,
    next: Vec<(String, u64)>,
    unconfirmed: Vec<Sent>,
}

/// Reads the latest snapshot and the events after it.
fn recover(
    journal: &dyn Journal,
    snapshots: &dyn SnapshotStore,
    id: &PersistenceId,
) -> Result<(u64, Recovered), PersistenceError> {
    let highest = journal.highest_sequence_nr(id)?;
    let mut recovered = Recovered::default();
    let mut from = 1;
    if let Some(record) = snapshots.load(id, highest)? {
        if record.payload.manifest != SNAPSHOT || record.payload.version > 1 {
            return Err(corrupt(
                id,
                format!(
                    "a snapshot is a `{}` of version {}",
                    record.payload.manifest, record.payload.version
                ),
            ));
        }
        let snapshot: Snapshot = ciborium::from_reader(&record.payload.bytes[..])
            .map_err(|e| corrupt(id, format!("the snapshot does not decode: {e}")))?;
        recovered.epoch = Some(snapshot.epoch);
        recovered.next = snapshot.next;
        recovered.unconfirmed = snapshot.unconfirmed;
        recovered.snapshot_at = record.sequence_nr;
        from = record.sequence_nr + 1;
    }
    let events = journal.replay(id, from, highest, usize::MAX)?;
    let mut expected = from;
    let mut next: std::collections::HashMap<String, u64> = recovered.next.drain(..).collect();
    for event in events {
        if event.sequence_nr != expected {
            return Err(corrupt(id, format!("event {expected} is missing")));
        }
        expected += 1;
        if event.payload.version > 1 {
            return Err(corrupt(
                id,
                format!("an event has version {}", event.payload.version),
            ));
        }
        match event.payload.manifest.as_str() {
            STARTED => {
                let epoch: u64 = ciborium::from_reader(&event.payload.bytes[..])
                    .map_err(|e| corrupt(id, format!("a start does not decode: {e}")))?;
                recovered.epoch = Some(epoch);
            }
            SENT => {
                let sent: Sent = ciborium::from_reader(&event.payload.bytes[..])
                    .map_err(|e| corrupt(id, format!("a message does not decode: {e}")))?;
                let stream = next.entry(sent.entity.clone()).or_insert(1);
                *stream = (*stream).max(sent.seq + 1);
                recovered.unconfirmed.push(sent);
            }
            other => return Err(corrupt(id, format!("an event is a `{other}`"))),
        }
    }
    if expected != highest + 1 {
        return Err(corrupt(
            id,
            format!("events {expected}..={highest} are missing"),
        ));
    }
    recovered.next = next.into_iter().collect();
    recovered
        .unconfirmed
        .sort_by(|a, b| (&a.entity, a.seq).cmp(&(&b.entity, b.seq)));
    if let Some(twice) = recovered
        .unconfirmed
        .windows(2)
        .find(|w| (&w[0].entity, w[0].seq) == (&w[1].entity, w[1].seq))
    {
        return Err(corrupt(
            id,
            format!(
                "message {} to `{}` is journaled twice",
                twice[0].seq, twice[0].entity
            ),
        ));
    }
    Ok((highest, recovered))
}

impl<P: Protocol, M: Tell<P> + Clone + Sync + Serialize> DurableProducer<P, M> {
    /// As [`ReliableProducer::send`], and the message is journaled (with
    /// its number) before `send` returns: a restarted producer sends it
    /// again unless it was confirmed. Concurrent sends share journal
    /// writes: while one write is under way, the sends that arrive wait
    /// and go together in the next (group commit), in the order they came.
    pub async fn send(&self, entity_id: impl Into<Arc<str>>, msg: M) -> ShardingResult<u64>
    where
        M: 'static,
    {
        let permit = self.producer.room().await?;
        let (done, journaled) = oneshot::channel();
        let waiting = Waiting {
            entity: entity_id.into(),
            msg: Bytes::from(cbor(&msg)?),
            attempt: attempt_of(msg),
            permit,
            done,
        };
        lock(&self.waiting).push(waiting);
        // On a task of its own: once the message is waiting, the caller
        // giving up on `send` cannot leave it half done. The task takes
        // every send waiting when its turn comes (this one, unless an
        // earlier task took it).
        let (producer, log, waiting) = (
            self.producer.clone(),
            self.log.clone(),
            self.waiting.clone(),
        );
        tokio::spawn(async move {
            let mut highest = log.highest.lock().await;
            let batch = std::mem::take(&mut *lock(&waiting));
            if !batch.is_empty() {
                journal_batch(&producer, &log, &mut highest, batch).await;
            }
        });
        journaled
            .await
            .unwrap_or_else(|_| Err(ShardingError::Bug("a durable send was dropped".into())))
    }

    /// As [`ReliableProducer::flush`].
    pub async fn flush(&self, timeout: std::time::Duration) -> ShardingResult<()> {
        self.producer.flush(timeout).await
    }

    /// As [`ReliableProducer::stats`].
    pub fn stats(&self) -> ProducerStats {
        self.producer.stats()
    }

    /// The producer's epoch: an earlier instance's, when it resumed one.
    pub fn epoch(&self) -> u64 {
        self.producer.epoch()
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Numbers the sends of `batch` (in order, each after its stream's last),
/// journals them in one write after `*highest`, queues each under its
/// number and answers its caller; then snapshots when one is due. A write
/// that fails answers every send of the batch with its error and, unless
/// the store refused it as invalid, stops the producer (another instance
/// started, or the outcome is unknown: a restart reads what was written).
async fn journal_batch<P: Protocol>(
    producer: &ReliableProducer<P>,
    log: &Log,
    highest: &mut u64,
    batch: Vec<Waiting<P>>,
) {
    let fail = |batch: Vec<Waiting<P>>, error: ShardingError| {
        for w in batch {
            let _ = w.done.send(Err(error.clone()));
        }
    };
    if let Some(why) = producer.refusal() {
        return fail(batch, why);
    }
    let mut next: std::collections::HashMap<Arc<str>, u64> = std::collections::HashMap::new();
    let mut numbered = Vec::with_capacity(batch.len());
    let mut events = Vec::with_capacity(batch.len());
    for w in &batch {
        let seq = match next.get(&w.entity) {
            Some(seq) => Ok(*seq),
            None => producer.next_seq(&w.entity),
        };
        let event = seq.and_then(|seq| {
            cbor(&Sent {
                entity: w.entity.to_string(),
                seq,
                msg: w.msg.clone(),
            })
            .map(|bytes| (seq, bytes))
        });
        match event {
            Ok((seq, bytes)) => {
                next.insert(w.entity.clone(), seq + 1);
                numbered.push(seq);
                events.push(bytes);
            }
            Err(error) => return fail(batch, error),
        }
    }
    if let Err(error) = log.append(highest, SENT, events).await {
        let invalid = matches!(&error, ShardingError::Persistence { error, .. }
            if matches!(**error, PersistenceError::Invalid(_)));
        if !invalid {
            tracing::warn!(persistence_id = %log.id, %error, "a durable producer's append failed: it stops");
            producer.stop(error.clone());
        }
        return fail(batch, error);
    }
    let mut all_queued = true;
    for (w, seq) in batch.into_iter().zip(numbered) {
        let bytes: Arc<[u8]> = Arc::from(&w.msg[..]);
        let queued = producer.enqueue(w.entity, Some(seq), w.attempt, Some(bytes), Some(w.permit));
        if let Err(error) = &queued {
            // Journaled, not queued: stop rather than give its number to
            // another message (a restart sends it).
            producer.stop(error.clone());
            all_queued = false;
        }
        // Journaled, it is not lost: a restart sends it, so its sender must
        // not read "not processed" and send it again under a new number.
        let queued = queued.map_err(|error| super::in_flight_at_shutdown::<P>(error, &log.id));
        let _ = w.done.send(queued);
    }
    // A snapshot holds what is queued: with a message journaled and not
    // queued, it would delete that message's event (a restart must read
    // it), so none is taken.
    let last = log.snapshot_at.load(std::sync::atomic::Ordering::Relaxed);
    if all_queued && *highest >= last + SNAPSHOT_EVERY {
        let (next, unconfirmed) = producer.durable_view();
        let snapshot = Snapshot {
            epoch: producer.epoch(),
            next,
            unconfirmed: unconfirmed
                .into_iter()
                .map(|(entity, seq, msg)| Sent {
                    entity,
                    seq,
                    msg: Bytes::copy_from_slice(&msg),
                })
                .collect(),
        };
        log.snapshot(*highest, snapshot).await;
        log.snapshot_at
            .store(*highest, std::sync::atomic::Ordering::Relaxed);
    }
}
