//! What an incarnation recovers from (`Recovered`), and how `EntityContext`
//! reads it from the store: the journal's latest snapshot and the events
//! after it, a durable state, or the state that migrated with its shard.

use std::sync::atomic::Ordering;

use super::{EntityContext, MigratedState, blocking_by, snapshot_manifest, state_manifest};
use crate::model::error::ShardingResult;
use crate::persistence::{
    EventRecord, Payload, PersistenceError, PersistenceId, SnapshotRecord, StateRecord,
};

/// What an incarnation recovers from: the latest snapshot (of a
/// [`Snapshotted`](crate::Snapshotted) type) and the journal's events after it.
pub(crate) struct Recovered {
    pub(crate) snapshot: Option<SnapshotRecord>,
    pub(crate) events: Vec<EventRecord>,
    /// Of a durable-state type: the stored state.
    pub(crate) state: Option<StateRecord>,
}

pub(super) fn corrupt(ctx: &EntityContext, what: String) -> crate::ShardingError {
    let id = PersistenceId::new(ctx.type_name, ctx.entity_id());
    ctx.persistence_error(PersistenceError::Corrupt {
        persistence_id: id,
        what,
    })
}

impl EntityContext {
    /// What this entity recovers from: its latest snapshot (of a
    /// snapshotted type) and the journal's events after it; from then on
    /// this incarnation appends after the journal's highest sequence number.
    pub(crate) async fn recover_events(&self) -> ShardingResult<Recovered> {
        if let Some(state) = &self.state {
            return self.recover_state(state).await;
        }
        let handle = self.handle()?;
        let journal = handle
            .writer
            .journal()
            .map_err(|e| self.persistence_error(e))?;
        let store = match &handle.snapshots {
            Some(snapshots) => Some(snapshots.store.upgrade().ok_or_else(|| {
                self.persistence_error(PersistenceError::Store(
                    "the system's snapshot store is gone".into(),
                ))
            })?),
            None => None,
        };
        let id = handle.id.clone();
        let by = self.call_deadline().map(|d| d.store);
        let read = blocking_by(by, move || {
            let highest = journal.highest_sequence_nr(&id)?;
            let snapshot = match store {
                Some(store) => store.load(&id, highest)?,
                None => None,
            };
            let from = snapshot.as_ref().map_or(1, |s| s.sequence_nr + 1);
            let events = journal.replay(&id, from, highest, usize::MAX)?;
            let recovered = Recovered {
                snapshot,
                events,
                state: None,
            };
            Ok((highest, recovered))
        })
        .await;
        let (highest, recovered) = read.map_err(|e| self.persistence_error(e))?;
        let last = recovered
            .events
            .last()
            .map(|e| e.sequence_nr)
            .or(recovered.snapshot.as_ref().map(|s| s.sequence_nr))
            .unwrap_or(0);
        if last != highest {
            let what = format!(
                "the journal is at {highest} but holds events up to {last} only (deleted, with no snapshot to recover from)"
            );
            return Err(corrupt(self, what));
        }
        handle.highest.store(highest, Ordering::Release);
        Ok(recovered)
    }

    /// What this entity recovers from when its state migrated with its
    /// shard, at store position `migrated.position` (SPEC §13.16): the
    /// store stays the source of truth. A durable state is taken as it
    /// came if the store's revision is still that one (one small read, no
    /// load); a snapshotted type's state stands for a snapshot at that
    /// sequence number, and only the journal's events after it are read.
    /// When the store has moved on otherwise (another writer, a journal
    /// behind the state) the state is not used: the second value is false
    /// and recovery reads the store as it always does.
    pub(crate) async fn recover_migrated(
        &self,
        migrated: MigratedState,
    ) -> ShardingResult<(Recovered, bool)> {
        if let Some(handle) = &self.state {
            let store = self.state_store(handle)?;
            let id = handle.id.clone();
            let by = self.call_deadline().map(|d| d.store);
            let revision = blocking_by(by, move || store.revision(&id))
                .await
                .map_err(|e| self.persistence_error(e))?;
            if revision != migrated.position {
                return Ok((self.recover_state(handle).await?, false));
            }
            handle.revision.store(revision, Ordering::Release);
            let state = (revision > 0).then(|| StateRecord {
                revision,
                payload: Payload {
                    manifest: state_manifest(self.type_name),
                    version: migrated.version,
                    bytes: migrated.bytes.to_vec(),
                },
                writer: self.writer(),
            });
            let recovered = Recovered {
                snapshot: None,
                events: Vec::new(),
                state,
            };
            return Ok((recovered, true));
        }
        let handle = self.handle()?;
        let journal = handle
            .writer
            .journal()
            .map_err(|e| self.persistence_error(e))?;
        let id = handle.id.clone();
        let from = migrated.position;
        let by = self.call_deadline().map(|d| d.store);
        let read = blocking_by(by, move || {
            let highest = journal.highest_sequence_nr(&id)?;
            if highest < from {
                return Ok((highest, None));
            }
            Ok((
                highest,
                Some(journal.replay(&id, from + 1, highest, usize::MAX)?),
            ))
        })
        .await;
        let (highest, events) = read.map_err(|e| self.persistence_error(e))?;
        let Some(events) =
            events.filter(|events| events.last().map_or(from, |e| e.sequence_nr) == highest)
        else {
            return Ok((self.recover_events().await?, false));
        };
        handle.highest.store(highest, Ordering::Release);
        let snapshot = SnapshotRecord {
            sequence_nr: from,
            payload: Payload {
                manifest: snapshot_manifest(self.type_name),
                version: migrated.version,
                bytes: migrated.bytes.to_vec(),
            },
            writer: self.writer(),
        };
        let recovered = Recovered {
            snapshot: Some(snapshot),
            events,
            state: None,
        };
        Ok((recovered, true))
    }
}
