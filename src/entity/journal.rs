//! An event-sourced incarnation's link to its journal (`JournalHandle`),
//! and the `EntityContext` methods that attach it and append events —
//! retiring the incarnation when an append is refused as stale or its
//! outcome is unknown.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{EntityContext, JournalWriter, Snapshots};
use crate::model::error::ShardingResult;
use crate::persistence::{AtomicWrite, Payload, PersistenceError, PersistenceId};

/// An event-sourced incarnation's link to its journal.
pub(crate) struct JournalHandle {
    pub(super) writer: Arc<JournalWriter>,
    /// Of a snapshotted type: its snapshot rule.
    pub(super) snapshots: Option<Arc<Snapshots>>,
    pub(super) id: PersistenceId,
    /// The highest sequence number this incarnation knows.
    pub(super) highest: AtomicU64,
    /// Why this incarnation must handle nothing more: a write refused
    /// because another incarnation wrote since, or one whose outcome is
    /// unknown (a store error, an append whose caller went away).
    pub(super) retired: std::sync::Mutex<Option<PersistenceError>>,
    /// Whether the reason it was retired is a conflict (read without the
    /// lock after every message; see [`EntityContext::take_conflict`]).
    pub(super) conflicted: AtomicBool,
}

impl JournalHandle {
    fn retire(&self, why: PersistenceError) {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.get_or_insert(why);
    }

    pub(super) fn retired(&self) -> Option<PersistenceError> {
        self.retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Retires the incarnation if an append is dropped before its outcome is
/// known (the journal writer may still commit it).
struct InFlight<'a> {
    handle: &'a JournalHandle,
    done: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.handle.retire(PersistenceError::Store(
                "an append was abandoned before its outcome was known".into(),
            ));
        }
    }
}

impl std::fmt::Debug for JournalHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalHandle")
            .field("id", &self.id)
            .field("highest", &self.highest)
            .finish_non_exhaustive()
    }
}

impl EntityContext {
    /// Links this incarnation to `journal` (an event-sourced type).
    pub(crate) fn attach_journal(
        &mut self,
        writer: Arc<JournalWriter>,
        snapshots: Option<Arc<Snapshots>>,
    ) {
        self.journal = Some(JournalHandle {
            writer,
            snapshots,
            id: PersistenceId::new(self.type_name, &*self.entity_id),
            highest: AtomicU64::new(0),
            retired: std::sync::Mutex::new(None),
            conflicted: AtomicBool::new(false),
        });
    }

    pub(super) fn handle(&self) -> ShardingResult<&JournalHandle> {
        self.journal.as_ref().ok_or_else(|| {
            crate::ShardingError::Bug(format!("`{}` persisted without a journal", self.type_name))
        })
    }

    /// Appends `events` after the highest sequence number this incarnation
    /// knows. A refusal because another incarnation wrote, or an outcome
    /// that is not known (a store error: the events may be in the journal;
    /// the caller gone before the answer), retires this incarnation: the
    /// next one — in place after a conflict
    /// ([`take_conflict`](Self::take_conflict)), otherwise the next
    /// message's — recovers what the journal holds. An append withdrawn
    /// before any batch took it (the ask's deadline near) was not written,
    /// and leaves the incarnation running.
    pub(super) async fn append(&self, events: Vec<Payload>) -> ShardingResult<()> {
        let handle = self.handle()?;
        if let Some(why) = handle.retired() {
            return Err(self.persistence_error(why));
        }
        let expected = handle.highest.load(Ordering::Acquire);
        let mut events = events;
        // The reliable message being handled, if its record is not in the
        // journal yet, rides in the same atomic write (SPEC §13.17).
        let marked = match self.delivery_marker() {
            Some(marker) => {
                events.push(marker?);
                true
            }
            None => false,
        };
        if events.is_empty() {
            return Ok(());
        }
        let count = events.len() as u64;
        let write = AtomicWrite {
            persistence_id: handle.id.clone(),
            expected,
            events,
            writer: self.writer(),
        };
        let mut in_flight = InFlight {
            handle,
            done: false,
        };
        let written = handle.writer.append(write, self.call_deadline()).await;
        in_flight.done = true;
        match written {
            Ok(()) => {
                handle.highest.store(expected + count, Ordering::Release);
                self.accepted();
                if marked && let Some((_, saved)) = &mut self.deliveries().current {
                    *saved = true;
                }
                Ok(())
            }
            // Refused, or not sent, before anything was written: this
            // incarnation may go on (its events apply only once written).
            Err(error @ (PersistenceError::Invalid(_) | PersistenceError::Unavailable(_))) => {
                Err(self.persistence_error(error))
            }
            Err(error) => {
                handle.retire(error.clone());
                if matches!(error, PersistenceError::SequenceConflict { .. }) {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "another incarnation wrote this entity's journal: this one recovers it anew");
                    handle.conflicted.store(true, Ordering::Release);
                } else {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "an append's outcome is unknown: this incarnation stops");
                }
                Err(self.persistence_error(error))
            }
        }
    }
}
