//! Event-sourced entities: the `EventSourced` trait, how its events are
//! encoded for the journal, and how an incarnation recovers by checking,
//! decoding and applying the journal's events.

use std::future::Future;

use super::{
    DeliveryRow, Entity, EntityContext, Recovered, Stored, Unreadable, corrupt, delivery_manifest,
};
use crate::model::error::ShardingResult;
use crate::persistence::{EventRecord, Payload, PersistenceError};

/// An entity whose state is the sum of the events it persisted: each
/// handler persists events with [`persist`](Self::persist) (which applies
/// them once they are durable), and every incarnation — after a restart,
/// passivation, a move to another node, a handler panic — recovers by
/// applying the journal's events, in order, before it handles any message.
/// Register it with
/// [`Registration::event_sourced`](crate::Registration::event_sourced), which exists
/// only on a system built with a journal.
///
/// Events are stored as CBOR with the entity type's wire name and
/// [`EVENT_VERSION`](Self::EVENT_VERSION): to evolve them, add fields as
/// `#[serde(default)]` (old events still decode) or new enum variants; to
/// change their shape otherwise, raise the version and read the older
/// shapes with an upcaster, [`read_event`](Self::read_event). Raise the
/// version too when old code must not read the new events: an incarnation
/// refuses events of a version above its own, with
/// [`PersistenceError::Corrupt`](crate::persistence::PersistenceError::Corrupt),
/// and applies nothing.
///
/// The journal refuses a write whose writer is stale — another
/// incarnation of the entity (a split brain, a handoff that timed out)
/// wrote since this one recovered — so the journal is never forked: the
/// persist fails with [`ShardingError::Persistence`](crate::ShardingError::Persistence)
/// (a `SequenceConflict`), and once the handler has answered, the
/// incarnation is replaced in place, after a short pause: a fresh one
/// recovers the journal, the other writer's events included, and handles
/// the messages that waited meanwhile.
pub trait EventSourced: Entity {
    /// What happened, as it is journaled.
    type Event: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static;

    /// The version of the events' encoding, stored with each.
    const EVENT_VERSION: u32 = 1;

    /// How an event changes the state: recovery and [`persist`](Self::persist)
    /// both call it, so it must only apply (no IO, no other effects).
    fn apply(&mut self, event: &Self::Event);

    /// Reads a journaled event, of a version at most
    /// [`EVENT_VERSION`](Self::EVENT_VERSION), into the current `Event`:
    /// the default decodes the current shape. Override it to read the
    /// shapes earlier versions wrote ([`Stored`] shows how); an error is
    /// reported as a corrupt journal, and nothing is applied.
    fn read_event(stored: Stored<'_>) -> Result<Self::Event, Unreadable>
    where
        Self: Sized,
    {
        stored.decode()
    }

    /// Appends `event` to the journal and, once it is durable, applies it.
    /// On error nothing was applied, and nothing appended — except after a
    /// `Store` error, whose outcome is unknown (the incarnation is then
    /// retired, and the next one recovers what the journal holds).
    fn persist(
        &mut self,
        ctx: &EntityContext,
        event: Self::Event,
    ) -> impl Future<Output = ShardingResult<()>> + Send
    where
        Self: Sized,
    {
        self.persist_all(ctx, vec![event])
    }

    /// Appends `events` to the journal atomically (all or none) and, once
    /// they are durable, applies them in order.
    fn persist_all(
        &mut self,
        ctx: &EntityContext,
        events: Vec<Self::Event>,
    ) -> impl Future<Output = ShardingResult<()>> + Send
    where
        Self: Sized,
    {
        async move {
            let payloads = events
                .iter()
                .map(|event| encode_event::<Self>(ctx, event))
                .collect::<ShardingResult<Vec<_>>>()?;
            if payloads.is_empty() {
                return Ok(());
            }
            ctx.append(payloads).await?;
            for event in &events {
                self.apply(event);
            }
            let entity: &Self = self;
            if let Some(snapshot) = ctx.snapshot_due(entity, events.len() as u64) {
                ctx.save_snapshot(snapshot).await;
            }
            Ok(())
        }
    }
}

fn encode_event<E: EventSourced + ?Sized>(
    ctx: &EntityContext,
    event: &E::Event,
) -> ShardingResult<Payload> {
    let mut bytes = Vec::new();
    ciborium::into_writer(event, &mut bytes).map_err(|e| {
        ctx.persistence_error(PersistenceError::Invalid(format!(
            "an event does not encode: {e}"
        )))
    })?;
    Ok(Payload {
        manifest: ctx.type_name.to_owned(),
        version: E::EVENT_VERSION,
        bytes,
    })
}

/// Checks and decodes `events`, which must be numbered from `first` on.
pub(super) fn decode_events<E: EventSourced>(
    ctx: &EntityContext,
    first: u64,
    events: Vec<EventRecord>,
) -> ShardingResult<(Vec<E::Event>, Vec<DeliveryRow>)> {
    let mut decoded = Vec::with_capacity(events.len());
    let mut rows = Vec::new();
    let delivery = delivery_manifest(ctx.type_name);
    for (i, record) in events.into_iter().enumerate() {
        let due = first + i as u64;
        if record.sequence_nr != due {
            return Err(corrupt(
                ctx,
                format!(
                    "event {} where {due} was due (events before it deleted, with no snapshot to recover from?)",
                    record.sequence_nr
                ),
            ));
        }
        let payload = &record.payload;
        if payload.manifest == delivery && payload.version <= 1 {
            let row: DeliveryRow =
                ciborium::from_reader(payload.bytes.as_slice()).map_err(|e| {
                    corrupt(
                        ctx,
                        format!(
                            "delivery record {} does not decode: {e}",
                            record.sequence_nr
                        ),
                    )
                })?;
            rows.push(row);
            continue;
        }
        if payload.manifest != ctx.type_name {
            return Err(corrupt(
                ctx,
                format!(
                    "event {} is a `{}`, not a `{}` event",
                    record.sequence_nr, payload.manifest, ctx.type_name
                ),
            ));
        }
        if payload.version > E::EVENT_VERSION {
            return Err(corrupt(
                ctx,
                format!(
                    "event {} has version {}, above this build's {}",
                    record.sequence_nr,
                    payload.version,
                    E::EVENT_VERSION
                ),
            ));
        }
        let event = E::read_event(Stored::new(payload.version, &payload.bytes)).map_err(|e| {
            corrupt(
                ctx,
                format!(
                    "event {} (version {}) cannot be read: {e}",
                    record.sequence_nr, payload.version
                ),
            )
        })?;
        decoded.push(event);
    }
    Ok((decoded, rows))
}

/// Recovers an event-sourced entity from its whole journal: every event is
/// checked and decoded first, and applied only if all are good, so a bad
/// record leaves the state as the factory made it.
pub(crate) fn recover<E: EventSourced>(
    entity: &mut E,
    ctx: &EntityContext,
    recovered: Recovered,
) -> ShardingResult<()> {
    let (events, rows) = decode_events::<E>(ctx, 1, recovered.events)?;
    for event in &events {
        entity.apply(event);
    }
    ctx.merge_deliveries(rows);
    Ok(())
}
