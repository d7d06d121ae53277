//! Snapshots of event-sourced entities: the `Snapshotted` trait, recovery
//! from the latest snapshot and the events after it, and when and how an
//! incarnation saves one (`Snapshots`).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{
    EntityContext, EventSourced, Recovered, Stored, Unreadable, blocking_by, corrupt, decode_events,
};
use crate::model::error::ShardingResult;
use crate::persistence::{Payload, PersistenceError, SnapshotRecord, SnapshotStore};

/// An [`EventSourced`] entity that also saves snapshots of its state: one
/// after every `SNAPSHOT_EVERY` events, keeping the last `SNAPSHOTS_KEPT`;
/// an incarnation recovers from the latest snapshot and the events after
/// it. Register it with
/// [`Registration::snapshotted`](crate::Registration::snapshotted), which needs
/// a journal that is also a [`SnapshotStore`](crate::persistence::SnapshotStore).
pub trait Snapshotted: EventSourced {
    /// The state as it is saved.
    type Snapshot: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static;
    /// A snapshot after this many events (at least 1).
    const SNAPSHOT_EVERY: u64 = 100;
    /// How many snapshots are kept (the older ones are deleted).
    const SNAPSHOTS_KEPT: u64 = 2;
    /// The version of the snapshots' encoding, stored with each.
    const SNAPSHOT_VERSION: u32 = 1;
    /// The state to save.
    fn snapshot(&self) -> Self::Snapshot;
    /// Takes a saved state (into an incarnation fresh from the factory).
    fn restore(&mut self, snapshot: Self::Snapshot);

    /// Reads a saved snapshot, of a version at most
    /// [`SNAPSHOT_VERSION`](Self::SNAPSHOT_VERSION), into the current
    /// `Snapshot`: the default decodes the current shape. Override it to
    /// read the shapes earlier versions saved ([`Stored`] shows how); an
    /// error is reported as a corrupt snapshot, and nothing is applied.
    fn read_snapshot(stored: Stored<'_>) -> Result<Self::Snapshot, Unreadable>
    where
        Self: Sized,
    {
        stored.decode()
    }
}

/// The manifest of a type's snapshots.
pub(super) fn snapshot_manifest(type_name: &str) -> String {
    format!("{type_name}#snapshot")
}

/// The manifest of a snapshot saved with its deliveries table: its bytes
/// are the CBOR array `[snapshot, [[producer, epoch, seq], …]]`.
fn snapshot_with_deliveries_manifest(type_name: &str) -> String {
    format!("{type_name}#snapshot+deliveries")
}

/// Recovers a snapshotted entity: its latest snapshot, then the events
/// after it, all checked and decoded before anything is applied.
pub(crate) fn recover_snapshotted<E: Snapshotted>(
    entity: &mut E,
    ctx: &EntityContext,
    recovered: Recovered,
) -> ShardingResult<()> {
    let (first, snapshot) = match recovered.snapshot {
        None => (1, None),
        Some(record) => {
            let seq = record.sequence_nr;
            let payload = record.payload;
            let with_deliveries =
                payload.manifest == snapshot_with_deliveries_manifest(ctx.type_name);
            if payload.manifest != snapshot_manifest(ctx.type_name) && !with_deliveries {
                return Err(corrupt(
                    ctx,
                    format!("snapshot {seq} is a `{}`", payload.manifest),
                ));
            }
            if payload.version > E::SNAPSHOT_VERSION {
                return Err(corrupt(
                    ctx,
                    format!(
                        "snapshot {seq} has version {}, above this build's {}",
                        payload.version,
                        E::SNAPSHOT_VERSION
                    ),
                ));
            }
            let unreadable = |e: Unreadable| {
                corrupt(
                    ctx,
                    format!(
                        "snapshot {seq} (version {}) cannot be read: {e}",
                        payload.version
                    ),
                )
            };
            let (snapshot, rows) = if with_deliveries {
                let stored = Stored::paired(payload.version, &payload.bytes);
                let snapshot = E::read_snapshot(stored).map_err(unreadable)?;
                (snapshot, Some(stored.deliveries().map_err(unreadable)?))
            } else {
                let stored = Stored::new(payload.version, &payload.bytes);
                (E::read_snapshot(stored).map_err(unreadable)?, None)
            };
            (seq + 1, Some((snapshot, rows)))
        }
    };
    let (events, later_rows) = decode_events::<E>(ctx, first, recovered.events)?;
    if let Some((snapshot, rows)) = snapshot {
        entity.restore(snapshot);
        if let Some(rows) = rows {
            ctx.restore_deliveries(rows);
        }
    }
    for event in &events {
        entity.apply(event);
    }
    ctx.merge_deliveries(later_rows);
    Ok(())
}

/// A snapshotted type's snapshot rule, shared by its incarnations.
pub(crate) struct Snapshots {
    pub(super) store: std::sync::Weak<dyn SnapshotStore>,
    every: u64,
    kept: u64,
    take: fn(&dyn std::any::Any, &EntityContext) -> ShardingResult<Payload>,
}

impl Snapshots {
    /// The rule of `E`, saving to `store`.
    pub(crate) fn of<E: Snapshotted>(store: &Arc<dyn SnapshotStore>) -> Arc<Self> {
        Arc::new(Snapshots {
            store: Arc::downgrade(store),
            every: E::SNAPSHOT_EVERY.max(1),
            kept: E::SNAPSHOTS_KEPT.max(1),
            take: take_snapshot::<E>,
        })
    }
}

fn take_snapshot<E: Snapshotted>(
    entity: &dyn std::any::Any,
    ctx: &EntityContext,
) -> ShardingResult<Payload> {
    let entity = entity
        .downcast_ref::<E>()
        .ok_or_else(|| crate::ShardingError::Bug("a snapshot of another entity type".into()))?;
    let rows = ctx.delivery_rows();
    let mut bytes = Vec::new();
    let (manifest, encoded) = if rows.is_empty() {
        let encoded = ciborium::into_writer(&entity.snapshot(), &mut bytes);
        (snapshot_manifest(ctx.type_name), encoded)
    } else {
        let encoded = ciborium::into_writer(&(entity.snapshot(), rows), &mut bytes);
        (snapshot_with_deliveries_manifest(ctx.type_name), encoded)
    };
    encoded.map_err(|e| {
        ctx.persistence_error(PersistenceError::Invalid(format!(
            "a snapshot does not encode: {e}"
        )))
    })?;
    Ok(Payload {
        manifest,
        version: E::SNAPSHOT_VERSION,
        bytes,
    })
}

impl EntityContext {
    /// After `count` events were appended and applied to `entity`: its
    /// snapshot, when the count crossed a multiple of the type's
    /// `SNAPSHOT_EVERY`.
    pub(super) fn snapshot_due(
        &self,
        entity: &dyn std::any::Any,
        count: u64,
    ) -> Option<ShardingResult<SnapshotRecord>> {
        let handle = self.journal.as_ref()?;
        let snapshots = handle.snapshots.as_ref()?;
        let after = handle.highest.load(Ordering::Acquire);
        let before = after.saturating_sub(count);
        if after / snapshots.every == before / snapshots.every {
            return None;
        }
        Some(
            (snapshots.take)(entity, self).map(|payload| SnapshotRecord {
                sequence_nr: after,
                payload,
                writer: self.writer(),
            }),
        )
    }

    /// Saves `snapshot` and deletes those older than the kept ones. A
    /// failure is logged (the events are durable; recovery replays more).
    pub(super) async fn save_snapshot(&self, snapshot: ShardingResult<SnapshotRecord>) {
        let Some(handle) = self.journal.as_ref() else {
            return;
        };
        let Some(snapshots) = &handle.snapshots else {
            return;
        };
        let saved = match (snapshot, snapshots.store.upgrade()) {
            (Ok(record), Some(store)) => {
                let id = handle.id.clone();
                let older = record
                    .sequence_nr
                    .saturating_sub(snapshots.kept * snapshots.every);
                let deadline = self.call_deadline();
                let save = blocking_by(deadline.map(|d| d.store), move || {
                    store.save(&id, record)?;
                    if older > 0 {
                        store.delete_to(&id, older)?;
                    }
                    Ok(())
                });
                let saved = match deadline {
                    None => save.await,
                    // The reply waits for this: not past the asker's deadline.
                    Some(deadline) => tokio::time::timeout_at(deadline.wait, save)
                        .await
                        .unwrap_or_else(|_| {
                            Err(PersistenceError::Store(
                                "the snapshot store did not answer before the ask's deadline"
                                    .into(),
                            ))
                        }),
                };
                saved.map_err(|e| self.persistence_error(e))
            }
            (Err(error), _) => Err(error),
            (_, None) => return,
        };
        if let Err(error) = saved {
            tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "a snapshot was not saved; recovery replays the events instead");
        }
    }
}
