//! The batched store writers: on a thread of its own, a system's writer of
//! one kind (journal appends, durable-state saves) hands the store many
//! entities' writes in one call (group commit), lingering briefly to fill
//! a batch, and withdraws a queued write whose ask's deadline comes first.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{CallDeadline, blocking_by};
use crate::persistence::{
    AtomicWrite, Batching, DurableStateStore, Journal, MAX_LANES, PersistenceError, PersistenceId,
    PersistenceResult, StateWrite,
};

/// How many appends one journal call takes at most.
const MAX_BATCH: usize = 1_024;

/// The longest a batch waits for appends that a commit just answered.
const MAX_LINGER: Duration = Duration::from_millis(1);

/// How the journal writer gathers a batch. Entities persist, reply, and
/// are sent their next message: the appends a commit answers tend to come
/// back soon after it. Started at once, the next batch would hold only
/// what waited during the commit, the answered ones would wait for it,
/// and the writer would settle into two half batches taking turns — half
/// the journal's rate. So a batch waits, for at most half the last
/// commit's time (and [`MAX_LINGER`]), until as many appends are queued as
/// were queued when the commit ended plus the ones it answered; it never
/// waits for more than that, so a lone writer's append goes at once. A
/// store that asks for [`Batching::Eager`] has no linger: its batches go
/// as soon as a commit ends.
#[derive(Default)]
struct Linger {
    /// The store's commits are cheap next to a wait ([`Batching::Eager`]).
    eager: bool,
    /// At least this many appends make a batch that goes at once.
    target: usize,
    /// Until when a smaller batch waits.
    until: Option<Instant>,
}

impl Linger {
    fn new(batching: Batching) -> Self {
        Linger {
            eager: batching == Batching::Eager,
            ..Linger::default()
        }
    }

    fn committed(&mut self, answered: usize, took: Duration, queued: usize) {
        if self.eager {
            return;
        }
        self.target = (queued + answered).clamp(1, MAX_BATCH);
        self.until = Some(Instant::now() + (took / 2).min(MAX_LINGER));
    }

    /// Fills `batch` with what waits, up to [`MAX_BATCH`], lingering as
    /// above.
    fn gather<T>(&mut self, rx: &std::sync::mpsc::Receiver<T>, batch: &mut Vec<T>) {
        let until = self.until.take();
        loop {
            batch.extend(rx.try_iter().take(MAX_BATCH - batch.len()));
            if batch.len() >= self.target || batch.len() >= MAX_BATCH {
                return;
            }
            let left = until.map_or(Duration::ZERO, |u| {
                u.saturating_duration_since(Instant::now())
            });
            match rx.recv_timeout(left) {
                Ok(next) => batch.push(next),
                Err(_) => return,
            }
        }
    }
}

/// Writes of one kind, batched on a thread of its own (group commit): the
/// thread hands the store everything that waits at once (lingering as
/// [`Linger`] says), in one call, so many entities' writes cost one
/// commit; while a batch commits, the next one gathers. The thread ends
/// when the last handle to the writer goes.
///
/// A write made for an ask carries the ask's [`CallDeadline`]: the batch's
/// store call ends (`call_deadline`) when the last of its writes' askers
/// stops waiting, and a write still waiting for a batch when its sender
/// stops waiting is withdrawn, never written — so a write queued behind a
/// batch stuck on a store that is away does not outlast its asker. A write
/// a batch took is waited for: its outcome is what the incarnation's
/// state must follow.
pub(crate) struct BatchWriter<W> {
    tx: std::sync::mpsc::Sender<Pending<W>>,
    /// Writes sent and not yet taken by the thread.
    waiting: Arc<std::sync::atomic::AtomicUsize>,
}

/// A write waiting for its batch, and where its result goes.
struct Pending<W> {
    write: W,
    /// When the store's waits for it must end (`CallDeadline::store`);
    /// `None`: no one waits for it with a deadline.
    by: Option<std::time::Instant>,
    /// Of a write with a deadline: set by whichever comes first, the
    /// writer taking it into a batch or its sender withdrawing it.
    claimed: Option<Arc<AtomicBool>>,
    done: tokio::sync::oneshot::Sender<PersistenceResult<()>>,
}

/// The answer to a write its sender withdrew: its deadline came before a
/// batch took it, so it was never sent.
fn withdrawn() -> PersistenceError {
    PersistenceError::Unavailable("no batch took the write before the ask's deadline".into())
}

/// When the store's waits for a batch end: when the last of its writes'
/// senders stops waiting; `None` (no bound) if one waits without a
/// deadline.
fn latest_by<W>(batch: &[Pending<W>]) -> Option<std::time::Instant> {
    let mut latest: Option<std::time::Instant> = None;
    for pending in batch {
        let by = pending.by?;
        latest = Some(latest.map_or(by, |l| l.max(by)));
    }
    latest
}

fn writer_stopped() -> PersistenceError {
    PersistenceError::Store("the system's store writer stopped".into())
}

impl<W: Send + 'static> BatchWriter<W> {
    /// Starts a writer whose batches `commit` writes (one result per
    /// write, in order), on a thread named `name` (the store's calls
    /// block; a thread also times a linger finer than the async timer's
    /// millisecond).
    fn start(
        name: &str,
        batching: Batching,
        commit: impl Fn(&[W]) -> Vec<PersistenceResult<()>> + Send + 'static,
    ) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<Pending<W>>();
        let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let queued = waiting.clone();
        let run = move || {
            let mut linger = Linger::new(batching);
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                linger.gather(&rx, &mut batch);
                queued.fetch_sub(batch.len(), Ordering::Relaxed);
                // A write its sender withdrew (its deadline came while it
                // waited) is not written; the others are claimed, so that
                // their senders know they went to the store.
                batch.retain(|p| {
                    p.claimed
                        .as_ref()
                        .is_none_or(|c| !c.swap(true, Ordering::AcqRel))
                });
                if batch.is_empty() {
                    continue;
                }
                let by = latest_by(&batch);
                let (writes, replies): (Vec<W>, Vec<_>) =
                    batch.into_iter().map(|p| (p.write, p.done)).unzip();
                let count = writes.len();
                let began = Instant::now();
                let committed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    crate::persistence::with_call_deadline(by, || commit(&writes))
                }));
                let mut results = committed.unwrap_or_else(|_| {
                    let panicked = PersistenceError::Store("the store panicked".into());
                    vec![Err(panicked); count]
                });
                // (A store that answers fewer results than writes failed
                // the rest.)
                results.resize_with(count, || {
                    Err(PersistenceError::Store("the store gave no result".into()))
                });
                // What waits is read before the replies go: an entity they
                // wake may queue its next write at once, and would count
                // twice (as waiting and as answered).
                let waiting = queued.load(Ordering::Relaxed);
                for (reply, result) in replies.into_iter().zip(results) {
                    let _ = reply.send(result);
                }
                linger.committed(count, began.elapsed(), waiting);
            }
        };
        // Without a thread there is no writer: every write fails typed.
        let _ = std::thread::Builder::new().name(name.into()).spawn(run);
        BatchWriter { tx, waiting }
    }

    /// Queues `write` for the next batch and waits for its result; with a
    /// `deadline`, withdraws it at its `wait` if no batch took it yet.
    async fn write(&self, write: W, deadline: Option<CallDeadline>) -> PersistenceResult<()> {
        let (done, mut result) = tokio::sync::oneshot::channel();
        let claimed = deadline.map(|_| Arc::new(AtomicBool::new(false)));
        let pending = Pending {
            write,
            by: deadline.map(|d| d.store),
            claimed: claimed.clone(),
            done,
        };
        self.waiting.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(pending).is_err() {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(writer_stopped());
        }
        let (Some(deadline), Some(claimed)) = (deadline, claimed) else {
            return result.await.unwrap_or_else(|_| Err(writer_stopped()));
        };
        let waited = tokio::time::timeout_at(deadline.wait, &mut result).await;
        let answer = match waited {
            Ok(answer) => answer,
            // No batch took it, and none will now.
            Err(_) if !claimed.swap(true, Ordering::AcqRel) => return Err(withdrawn()),
            // A batch took it: its store call ends by its `call_deadline`.
            Err(_) => result.await,
        };
        answer.unwrap_or_else(|_| Err(writer_stopped()))
    }
}

/// The appends of every event-sourced entity of a system, batched (a
/// [`BatchWriter`] on a `datum-journal` thread per commit lane,
/// [`Journal::commit_lanes`]), each batch one [`Journal::append`] call of
/// one lane's writes. It holds the journal weakly: the system's handle
/// alone decides how long the store stays open.
pub(crate) struct JournalWriter {
    journal: std::sync::Weak<dyn Journal>,
    lanes: Lanes<AtomicWrite>,
}

/// One [`BatchWriter`] per commit lane of a store; a persistence id's
/// writes always take its lane ([`PersistenceId::lane`]), so they keep
/// their order, while the lanes commit side by side.
pub(crate) struct Lanes<W>(Vec<BatchWriter<W>>);

impl<W: Send + 'static> Lanes<W> {
    /// `count` writers (at least one, at most [`MAX_LANES`]), on threads
    /// named `name` (with the lane's number when there are several), each
    /// committing through `commit`, paced as `batching` says.
    fn start(
        count: usize,
        batching: Batching,
        name: &str,
        commit: impl Fn(&[W]) -> Vec<PersistenceResult<()>> + Clone + Send + 'static,
    ) -> Self {
        let count = count.clamp(1, MAX_LANES);
        Lanes(
            (0..count)
                .map(|lane| {
                    let name = if count == 1 {
                        name.to_owned()
                    } else {
                        format!("{name}-{lane}")
                    };
                    BatchWriter::start(&name, batching, commit.clone())
                })
                .collect(),
        )
    }

    /// The writer that takes `id`'s writes.
    fn of(&self, id: &PersistenceId) -> &BatchWriter<W> {
        &self.0[id.lane(self.0.len())]
    }
}

impl JournalWriter {
    /// Starts the writer of `journal`.
    pub(crate) fn start(journal: &Arc<dyn Journal>) -> Arc<Self> {
        let weak = Arc::downgrade(journal);
        let store = weak.clone();
        let lanes = Lanes::start(
            journal.commit_lanes(),
            journal.batching(),
            "datum-journal",
            move |writes: &[AtomicWrite]| match store.upgrade() {
                Some(journal) => journal.append(writes),
                None => vec![Err(writer_stopped()); writes.len()],
            },
        );
        Arc::new(JournalWriter {
            journal: weak,
            lanes,
        })
    }

    pub(super) async fn append(
        &self,
        write: AtomicWrite,
        deadline: Option<CallDeadline>,
    ) -> PersistenceResult<()> {
        let lane = self.lanes.of(&write.persistence_id);
        lane.write(write, deadline).await
    }

    pub(super) fn journal(&self) -> PersistenceResult<Arc<dyn Journal>> {
        self.journal.upgrade().ok_or_else(writer_stopped)
    }
}

/// The saves of every durable-state entity of a system. On a store whose
/// `save_all` commits a batch at once
/// ([`DurableStateStore::commits_batches`]), batched (a [`BatchWriter`]
/// on a `datum-states` thread per commit lane, one `save_all` per batch:
/// on an embedded store, one commit and one sync for the lot); on another,
/// each save is its own `save` call on a blocking thread, several at a
/// time. It holds the store weakly.
pub(crate) enum StateWriter {
    Batched(Lanes<StateWrite>),
    Direct(std::sync::Weak<dyn DurableStateStore>),
}

impl StateWriter {
    /// Starts the writer of `store`.
    pub(crate) fn start(store: &Arc<dyn DurableStateStore>) -> Arc<Self> {
        let weak = Arc::downgrade(store);
        if !store.commits_batches() {
            return Arc::new(StateWriter::Direct(weak));
        }
        let lanes = Lanes::start(
            store.commit_lanes(),
            store.batching(),
            "datum-states",
            move |writes: &[StateWrite]| match weak.upgrade() {
                Some(store) => store.save_all(writes),
                None => vec![Err(writer_stopped()); writes.len()],
            },
        );
        Arc::new(StateWriter::Batched(lanes))
    }

    /// Saves `write`; with a `deadline`, withdrawing it at its `wait` if
    /// no batch took it yet (a save not batched goes to the store at once,
    /// its `call_deadline` set).
    pub(super) async fn save(
        &self,
        write: StateWrite,
        deadline: Option<CallDeadline>,
    ) -> PersistenceResult<()> {
        match self {
            StateWriter::Batched(lanes) => {
                let lane = lanes.of(&write.persistence_id);
                lane.write(write, deadline).await
            }
            StateWriter::Direct(store) => {
                let Some(store) = store.upgrade() else {
                    return Err(writer_stopped());
                };
                let saved = blocking_by(deadline.map(|d| d.store), move || {
                    let StateWrite {
                        persistence_id,
                        expected,
                        payload,
                        writer,
                    } = write;
                    store.save(&persistence_id, expected, payload, writer)
                });
                saved.await
            }
        }
    }
}

#[cfg(test)]
#[path = "linger_tests.rs"]
mod linger_tests;

#[cfg(test)]
#[path = "withdrawal_tests.rs"]
mod withdrawal_tests;
