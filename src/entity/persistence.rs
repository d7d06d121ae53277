//! The persistence side of `EntityContext` that journaled and durable-state
//! entities share: the bounds of a store call made for an ask
//! (`CallDeadline`), store calls on a blocking thread, the pause before
//! recovering after a write conflict, and the errors and writer identity
//! of its writes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{Deliveries, EntityContext, JournalHandle};
use crate::persistence::{PersistenceError, PersistenceResult, Writer};

/// Runs a store call on a blocking thread (the SPI is synchronous), with
/// `by` as the call's [`call_deadline`](crate::persistence::call_deadline).
pub(super) async fn blocking_by<T: Send + 'static>(
    by: Option<std::time::Instant>,
    call: impl FnOnce() -> PersistenceResult<T> + Send + 'static,
) -> PersistenceResult<T> {
    let call = move || crate::persistence::with_call_deadline(by, call);
    tokio::task::spawn_blocking(call).await.unwrap_or_else(|e| {
        Err(PersistenceError::Store(format!(
            "the store call panicked: {e}"
        )))
    })
}

/// How long before an ask's deadline the store calls it causes end, at
/// most: a fifth of the time left when a call starts, up to this. (The
/// asker needs the answer before its deadline, not at it: the reply still
/// has to reach it.)
const ANSWER_MARGIN: Duration = Duration::from_millis(500);

/// The bounds of a store call made for an ask (SPEC §8b): the store's own
/// waits end at `store` (its [`call_deadline`](crate::persistence::call_deadline)),
/// and a write that no batch took by `wait`, a little later, is withdrawn
/// — both before the ask's deadline, so that the asker hears the store's
/// typed error rather than its own timeout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallDeadline {
    pub(super) store: std::time::Instant,
    pub(super) wait: tokio::time::Instant,
}

/// The first pause before an incarnation refused by a conflict recovers
/// anew; it doubles with each conflict in a row.
const CONFLICT_PAUSE: Duration = Duration::from_millis(10);

/// The longest such pause.
const CONFLICT_PAUSE_MAX: Duration = Duration::from_millis(500);

/// The pause before recovering after `conflicts` conflicts in a row:
/// between half and all of [`CONFLICT_PAUSE`] doubled for each conflict
/// after the first (at most [`CONFLICT_PAUSE_MAX`]), at random, so that
/// two writers that refuse each other do not retry in step.
fn conflict_pause(conflicts: u32) -> Duration {
    let doublings = conflicts.saturating_sub(1).min(16);
    let full = CONFLICT_PAUSE
        .saturating_mul(1 << doublings)
        .min(CONFLICT_PAUSE_MAX);
    let half = full / 2;
    let share = f64::from(getrandom::u32().unwrap_or(u32::MAX)) / f64::from(u32::MAX);
    half + half.mul_f64(share)
}

/// Clears a handle's retirement if a conflict is what retired it (its
/// `conflicted` flag set); true if it did.
fn unretire_conflict(
    conflicted: &AtomicBool,
    retired: &std::sync::Mutex<Option<PersistenceError>>,
) -> bool {
    if !conflicted.load(Ordering::Acquire) || !conflicted.swap(false, Ordering::AcqRel) {
        return false;
    }
    let mut retired = retired.lock().unwrap_or_else(|p| p.into_inner());
    let conflict = matches!(
        *retired,
        Some(PersistenceError::SequenceConflict { .. } | PersistenceError::RevisionConflict { .. })
    );
    if conflict {
        *retired = None;
    }
    conflict
}

impl EntityContext {
    /// The deadline of the message about to be handled (`None`: a tell, an
    /// ask whose deadline is not known here, or a recovery); set by the
    /// runtime before each message.
    pub(crate) fn begin_message(&mut self, deadline: Option<tokio::time::Instant>) {
        self.deadline = deadline;
        *self.wrote.get_mut() = false;
    }

    /// A write was accepted while the message being handled was.
    pub(crate) fn wrote(&self) -> bool {
        self.wrote.load(Ordering::Relaxed)
    }

    /// The bounds of a store call made now for the message being handled:
    /// the store's waits end a fifth of the time left (at most
    /// [`ANSWER_MARGIN`]) before its deadline, and a write still queued is
    /// withdrawn half that before it. `None` without a deadline, or once
    /// it has passed (the asker has gone: the call takes the time it
    /// takes, as one made for a tell does).
    pub(super) fn call_deadline(&self) -> Option<CallDeadline> {
        let deadline = self.deadline?;
        let now = tokio::time::Instant::now();
        let left = deadline
            .checked_duration_since(now)
            .filter(|l| !l.is_zero())?;
        let margin = (left / 5).min(ANSWER_MARGIN);
        Some(CallDeadline {
            // Counted on the standard clock, which the store reads.
            store: std::time::Instant::now() + (left - margin),
            wait: deadline - margin / 2,
        })
    }

    /// Of an incarnation that a conflict retired (another incarnation
    /// wrote its journal, or saved its state, since it recovered): clears
    /// that, so that it can be rebuilt in place and recovered anew (SPEC
    /// §8b, Fencing), and says how long to pause first — longer while its
    /// writes keep being refused, back to the shortest after one is
    /// accepted. `None` otherwise (after every message: one atomic load).
    pub(crate) fn take_conflict(&mut self) -> Option<Duration> {
        let journal = self
            .journal
            .as_ref()
            .is_some_and(|j| unretire_conflict(&j.conflicted, &j.retired));
        let state = self
            .state
            .as_ref()
            .is_some_and(|s| unretire_conflict(&s.conflicted, &s.retired));
        if !journal && !state {
            return None;
        }
        // As in a fresh incarnation: the recovery reads the table back,
        // and a deadline of the message that met the conflict (answered
        // by now) bounds nothing of it.
        *self.deliveries() = Deliveries::default();
        self.deadline = None;
        let conflicts = self
            .conflicts
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        Some(conflict_pause(conflicts))
    }

    /// An accepted write ends a run of conflicts.
    pub(super) fn accepted(&self) {
        self.wrote.store(true, Ordering::Relaxed);
        if self.conflicts.load(Ordering::Relaxed) != 0 {
            self.conflicts.store(0, Ordering::Relaxed);
        }
    }

    pub(super) fn persistence_error(&self, error: PersistenceError) -> crate::ShardingError {
        crate::ShardingError::Persistence {
            type_name: self.type_name,
            entity_id: self.entity_id.to_string(),
            error: Box::new(error),
        }
    }

    /// Who writes: this node's identity and the shard's generation.
    pub(super) fn writer(&self) -> Writer {
        Writer {
            node_id: self.node.map_or(0, |n| n.node_id.0),
            incarnation: self.node.map_or(0, |n| n.incarnation),
            generation: self.generation,
        }
    }

    /// Why this incarnation must handle nothing more (see `append` and
    /// `save_state`).
    pub(crate) fn stale(&self) -> Option<crate::ShardingError> {
        let journal = self.journal.as_ref().and_then(JournalHandle::retired);
        let state = self
            .state
            .as_ref()
            .and_then(|s| s.retired.lock().unwrap_or_else(|p| p.into_inner()).clone());
        Some(self.persistence_error(journal.or(state)?))
    }
}
