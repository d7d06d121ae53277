//! The deliveries table: what reliable producers' messages did at an
//! entity (SPEC §13.17), so that a message sent again is confirmed as a
//! duplicate instead of handled twice — and the `EntityContext` methods
//! that admit, record, save and restore it.

use std::sync::Arc;

use super::EntityContext;
use crate::model::envelope::Delivery;
use crate::model::error::ShardingResult;
use crate::persistence::{Payload, PersistenceError};

/// One producer's record at an entity, as saved and migrated: `[producer,
/// epoch, seq]` — its latest incarnation heard from, and the highest
/// number handled from that incarnation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct DeliveryRow(pub(crate) String, pub(crate) u64, pub(crate) u64);

/// What reliable producers' messages did at one entity (SPEC §13.17).
#[derive(Debug, Default)]
pub(crate) struct Deliveries {
    /// Per producer: its latest incarnation, and the highest number
    /// handled from it.
    seen: std::collections::HashMap<Arc<str>, (u64, u64)>,
    /// The message being handled, and whether a save has recorded it.
    pub(super) current: Option<(Delivery, bool)>,
}

/// What an entity does with a reliable producer's message.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Not handled yet: handle it.
    New,
    /// Handled already: confirm it, do not handle it again.
    Duplicate,
    /// From an older incarnation of its producer than one heard from.
    Superseded {
        /// The latest incarnation heard from.
        current: u64,
    },
}

impl Deliveries {
    /// The table saved or migrated as `rows`.
    pub(crate) fn from_rows(rows: Vec<DeliveryRow>) -> Deliveries {
        Deliveries {
            seen: rows
                .into_iter()
                .map(|DeliveryRow(producer, epoch, seq)| (producer.into(), (epoch, seq)))
                .collect(),
            current: None,
        }
    }

    pub(crate) fn admit(&self, delivery: &Delivery) -> Admission {
        match self.seen.get(&delivery.producer) {
            Some(&(epoch, _)) if delivery.epoch < epoch => Admission::Superseded { current: epoch },
            Some(&(epoch, seq)) if delivery.epoch == epoch && delivery.seq <= seq => {
                Admission::Duplicate
            }
            _ => Admission::New,
        }
    }

    pub(crate) fn record(&mut self, delivery: &Delivery) {
        self.seen
            .insert(delivery.producer.clone(), (delivery.epoch, delivery.seq));
    }

    pub(crate) fn rows(&self) -> Vec<DeliveryRow> {
        let mut seen = self.seen.clone();
        if let Some((delivery, _)) = &self.current {
            seen.insert(delivery.producer.clone(), (delivery.epoch, delivery.seq));
        }
        let mut rows: Vec<_> = seen
            .into_iter()
            .map(|(producer, (epoch, seq))| DeliveryRow(producer.to_string(), epoch, seq))
            .collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        rows
    }
}

impl EntityContext {
    pub(super) fn deliveries(&self) -> std::sync::MutexGuard<'_, Deliveries> {
        self.deliveries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What to do with a reliable producer's message: handle it, confirm
    /// it as a duplicate, or refuse it as from a superseded producer.
    pub(crate) fn admit(&self, delivery: &Delivery) -> Admission {
        self.deliveries().admit(delivery)
    }

    /// Marks `delivery` as the message being handled: a state saved now
    /// records it.
    pub(crate) fn begin_delivery(&self, delivery: Delivery) {
        self.deliveries().current = Some((delivery, false));
    }

    /// Ends the message being handled without recording it (its handler
    /// panicked, or its handling was cancelled).
    pub(crate) fn abandon_delivery(&self) {
        self.deliveries().current = None;
    }

    /// Ends the message being handled after its handler answered a
    /// store's error (`why`). A save that carried it made it durable: it
    /// is recorded. Otherwise a durable-state incarnation is retired — its
    /// memory may hold part of an effect its store does not — and nothing
    /// is recorded: the copy sent again finds a fresh incarnation, loaded
    /// from the store. An entity without a state store records it (the
    /// error is its handler's answer; memory is all it has).
    pub(crate) fn fail_delivery(&self, why: &crate::ShardingError) {
        let mut deliveries = self.deliveries();
        let Some((delivery, saved)) = deliveries.current.take() else {
            return;
        };
        match (&self.state, &self.journal, saved) {
            (_, _, true) => deliveries.record(&delivery),
            (Some(handle), _, false) => {
                drop(deliveries);
                handle.retire(PersistenceError::Store(format!(
                    "a reliable message's handler failed unsaved: {why}"
                )));
            }
            // An event-sourced entity's state is what its journal holds:
            // nothing was persisted, so nothing happened.
            (None, Some(_), false) => {}
            (None, None, false) => deliveries.record(&delivery),
        }
    }

    /// Of an event-sourced entity: the marker event recording the reliable
    /// message being handled (manifest `<type>#delivery`, CBOR `[producer,
    /// epoch, seq]`), while no append has carried it.
    pub(super) fn delivery_marker(&self) -> Option<ShardingResult<Payload>> {
        let deliveries = self.deliveries();
        let (delivery, false) = deliveries.current.as_ref()? else {
            return None;
        };
        let row = DeliveryRow(delivery.producer.to_string(), delivery.epoch, delivery.seq);
        drop(deliveries);
        let mut bytes = Vec::new();
        let encoded = ciborium::into_writer(&row, &mut bytes).map_err(|e| {
            self.persistence_error(PersistenceError::Invalid(format!(
                "a delivery record does not encode: {e}"
            )))
        });
        Some(encoded.map(|()| Payload {
            manifest: delivery_manifest(self.type_name),
            version: 1,
            bytes,
        }))
    }

    /// Of a durable-state entity whose handler did not save during the
    /// reliable message being handled: its state to save now, with the
    /// message's record (one write). `None` when no save is due.
    pub(crate) fn delivery_payload(
        &self,
        entity: &dyn std::any::Any,
    ) -> Option<ShardingResult<Payload>> {
        let handle = self.state.as_ref()?;
        match &self.deliveries().current {
            Some((_, false)) => {}
            _ => return None,
        }
        Some((handle.encode)(entity, self))
    }

    /// Records the message being handled as done, after saving `payload`
    /// (from [`delivery_payload`](Self::delivery_payload)) if there is
    /// one. On error nothing is recorded.
    pub(crate) async fn commit_delivery(
        &self,
        payload: Option<ShardingResult<Payload>>,
    ) -> ShardingResult<()> {
        let written = match payload {
            // An event-sourced entity whose handler persisted nothing: the
            // marker alone (a no-op once an append carried it).
            None if self.journal.is_some() => self.append(Vec::new()).await,
            None => Ok(()),
            Some(Ok(payload)) => self.save_state(payload).await,
            Some(Err(error)) => Err(error),
        };
        let mut deliveries = self.deliveries();
        let current = deliveries.current.take();
        if let (Err(error), Some(handle)) = (&written, &self.state) {
            // The effect is in memory and not in the store: this
            // incarnation must not answer the copy sent again.
            drop(deliveries);
            handle.retire(PersistenceError::Store(format!(
                "a reliable message's record was not saved: {error}"
            )));
            return written;
        }
        written?;
        if let Some((delivery, _)) = current {
            deliveries.record(&delivery);
        }
        Ok(())
    }

    /// The table as it is saved and migrated: every producer's latest
    /// record, the message being handled included.
    pub(crate) fn delivery_rows(&self) -> Vec<DeliveryRow> {
        self.deliveries().rows()
    }

    /// Adds records read back from a journal (in order: later ones win).
    pub(crate) fn merge_deliveries(&self, rows: Vec<DeliveryRow>) {
        let mut deliveries = self.deliveries();
        for DeliveryRow(producer, epoch, seq) in rows {
            deliveries.seen.insert(producer.into(), (epoch, seq));
        }
    }

    /// Takes the table that came with a migrated state, or with a loaded
    /// one.
    pub(crate) fn restore_deliveries(&self, rows: Vec<DeliveryRow>) {
        *self.deliveries() = Deliveries::from_rows(rows);
    }
}

/// The manifest of an event-sourced entity's delivery record (SPEC
/// §13.17): its bytes are the CBOR array `[producer, epoch, seq]`.
pub(super) fn delivery_manifest(type_name: &str) -> String {
    format!("{type_name}#delivery")
}
