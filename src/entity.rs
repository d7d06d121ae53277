//! Entities: the stateful actors that sharding places, and their handlers.
//!
//! An entity type names its protocol and implements [`Handler<M>`] for each
//! message `M` of it. A tell handler returns `ShardingResult<()>`; an ask
//! handler returns the reply itself, so there is no reply port to forget.
//! Handlers are `async` and run one message at a time, in mailbox order.
//!
//! ```
//! # use datum_cluster_sharding::prelude::*;
//! # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
//! # #[derive(Serialize, Deserialize)] pub struct Get;
//! # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
//! #[derive(Default)]
//! struct CounterEntity { total: u64 }
//!
//! impl Entity for CounterEntity { type Protocol = Counter; }
//!
//! impl Handler<Add> for CounterEntity {
//!     async fn handle(&mut self, msg: Add, _ctx: &EntityContext) -> ShardingResult<()> {
//!         self.total += msg.0;
//!         Ok(())
//!     }
//! }
//!
//! impl Handler<Get> for CounterEntity {
//!     async fn handle(&mut self, _msg: Get, _ctx: &EntityContext) -> ShardingResult<u64> {
//!         Ok(self.total)
//!     }
//! }
//! # fn main() {}
//! ```
//!
//! Every incarnation of an entity is built by the factory given at
//! registration: on the first message, after a handler panic (the entity
//! restarts in place, its mailbox kept), and after passivation.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::envelope::Delivery;
use crate::error::ShardingResult;
use crate::extractor::ShardId;
use crate::persistence::{
    AtomicWrite, DurableStateStore, EventRecord, Journal, Payload, PersistenceError, PersistenceId,
    PersistenceResult, SnapshotRecord, SnapshotStore, StateRecord, StateWrite, Writer,
};
use crate::protocol::{Message, Protocol};

/// A stateful entity of one protocol.
pub trait Entity: Send + 'static {
    /// The protocol whose messages this entity handles.
    type Protocol: Protocol;
}

/// Handling of one message `M` of the entity's protocol.
///
/// For an ask message the handler's `Ok` value is the reply; an `Err` is
/// returned to the asker. For a tell message an `Err` is logged.
pub trait Handler<M>: Entity
where
    M: Message<Self::Protocol>,
{
    /// Handles one message. Runs to completion before the next message starts.
    fn handle(
        &mut self,
        msg: M,
        ctx: &EntityContext,
    ) -> impl Future<Output = ShardingResult<M::Reply>> + Send;
}

/// Handling of one message `M` declared `defer M -> R;`: the handler gets the
/// reply's [`ReplyPort`] and answers when it likes — at once, from a task it
/// spawns, or from a later message once it has what the reply needs.
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// #[derive(Serialize, Deserialize)] pub struct Slow(pub u64);
/// protocol! { pub protocol Echo = "echo" { defer Slow -> u64; } }
/// struct EchoEntity;
/// impl Entity for EchoEntity { type Protocol = Echo; }
/// impl DeferredHandler<Slow> for EchoEntity {
///     async fn handle(&mut self, msg: Slow, reply: ReplyPort<u64>, _: &EntityContext) -> ShardingResult<()> {
///         tokio::spawn(async move {
///             tokio::time::sleep(Duration::from_millis(5)).await;
///             reply.send(msg.0 * 2);
///         });
///         Ok(()) // the entity takes its next message meanwhile
///     }
/// }
/// # #[tokio::main] async fn main() -> ShardingResult<()> {
/// let system = ShardedSystem::builder().start().await?;
/// system.register::<EchoEntity>(|_| EchoEntity).await?;
/// assert_eq!(system.entity_ref::<Echo>("e").ask(Slow(21), Duration::from_secs(5)).await?, 42);
/// # system.shutdown().await; Ok(()) }
/// ```
pub trait DeferredHandler<M>: Entity
where
    M: Message<Self::Protocol>,
{
    /// Handles one message; `reply` answers the asker (once). A port
    /// dropped unanswered — or lost with a panicking or killed handler —
    /// answers
    /// [`ShardingError::HandlerInterrupted`](crate::ShardingError::HandlerInterrupted)
    /// (the message may have been processed). An `Err` returned here is
    /// logged, not sent.
    fn handle(
        &mut self,
        msg: M,
        reply: ReplyPort<M::Reply>,
        ctx: &EntityContext,
    ) -> impl Future<Output = ShardingResult<()>> + Send;
}

/// The reply slot of one ask, for a [`DeferredHandler`]: answer it once, from
/// anywhere (it is `Send`), whether the asker is on this node or another.
/// It cannot be sent inside a message.
#[must_use = "dropping a ReplyPort answers the asker with HandlerInterrupted"]
pub struct ReplyPort<R> {
    /// `None` once answered.
    reply: Option<crate::envelope::ReplyTo<R>>,
    type_name: &'static str,
    entity_id: Arc<str>,
}

impl<R> Drop for ReplyPort<R> {
    fn drop(&mut self) {
        if let Some(reply) = self.reply.take() {
            reply.interrupted(self.type_name, &self.entity_id);
        }
    }
}

impl<R> std::fmt::Debug for ReplyPort<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyPort").finish_non_exhaustive()
    }
}

impl<R: serde::Serialize + Send + 'static> ReplyPort<R> {
    pub(crate) fn new(reply: crate::envelope::ReplyTo<R>, ctx: &EntityContext) -> Self {
        ReplyPort {
            reply: Some(reply),
            type_name: ctx.type_name,
            entity_id: ctx.entity_id.clone(),
        }
    }

    /// Sends the reply.
    pub fn send(mut self, reply: R) {
        if let Some(port) = self.reply.take() {
            port.answer(Ok(reply));
        }
    }

    /// Answers with an error instead (for example `ShardingError::Handler`).
    /// The handler ran: an error of another variant than `Handler` or
    /// `Persistence` reaches the asker as `Handler` with its text, so that
    /// it never reads as "not processed" (SPEC §11).
    pub fn fail(mut self, error: crate::ShardingError) {
        if let Some(port) = self.reply.take() {
            port.answer(Err(
                error.answered_by_handler((self.type_name, &self.entity_id))
            ));
        }
    }
}

/// Where an entity lives, given to its factory and to every handler.
#[derive(Debug)]
pub struct EntityContext {
    type_name: &'static str,
    entity_id: Arc<str>,
    shard_id: ShardId,
    node: Option<crate::identity::UniqueAddress>,
    /// The allocation generation of the shard's hosting (0 on one node).
    pub(crate) generation: u64,
    passivate: AtomicBool,
    /// Of an event-sourced entity: its journal.
    pub(crate) journal: Option<JournalHandle>,
    /// Of a durable-state entity: its state store.
    state: Option<StateHandle>,
    /// What reliable producers' messages did here (SPEC §13.17).
    deliveries: std::sync::Mutex<Deliveries>,
    /// The deadline of the ask being handled: the store calls it causes
    /// end before it (see [`CallDeadline`]). `None` for a tell, an ask from
    /// another node, or no message — and during a recovery, which serves
    /// every message waiting for it, not one ask.
    deadline: Option<tokio::time::Instant>,
    /// A write was accepted while the message being handled was (reset
    /// with `deadline` for each message): a later write's error then says
    /// the message was processed in part.
    wrote: AtomicBool,
    /// How many of this entity's writes in a row were refused by a
    /// conflict (kept across its restarts in place; reset by an accepted
    /// write): the pause before the next restart grows with it.
    conflicts: AtomicU32,
}

impl EntityContext {
    pub(crate) fn new(
        type_name: &'static str,
        entity_id: Arc<str>,
        shard_id: ShardId,
        node: Option<crate::identity::UniqueAddress>,
    ) -> Self {
        EntityContext {
            type_name,
            entity_id,
            shard_id,
            node,
            generation: 0,
            passivate: AtomicBool::new(false),
            journal: None,
            state: None,
            deliveries: std::sync::Mutex::default(),
            deadline: None,
            conflicts: AtomicU32::new(0),
            wrote: AtomicBool::new(false),
        }
    }

    /// The entity type's name (the protocol's wire name).
    pub fn type_name(&self) -> &'static str {
        self.type_name
    }

    /// This entity's id.
    pub fn entity_id(&self) -> &str {
        &self.entity_id
    }

    /// The shard this entity belongs to.
    pub fn shard_id(&self) -> ShardId {
        self.shard_id
    }

    /// The cluster node this entity runs on (its identity: address, node
    /// id, incarnation); `None` on a system without a cluster node.
    pub fn node(&self) -> Option<crate::identity::UniqueAddress> {
        self.node
    }

    /// Asks for this entity to be passivated once the current message is
    /// handled. Messages that arrive meanwhile are kept and delivered to the
    /// next incarnation; none is dropped.
    pub fn passivate(&self) {
        self.passivate.store(true, Ordering::Relaxed);
    }

    pub(crate) fn entity_id_arc(&self) -> Arc<str> {
        self.entity_id.clone()
    }

    pub(crate) fn take_passivate_request(&self) -> bool {
        self.passivate.swap(false, Ordering::Relaxed)
    }

    fn deliveries(&self) -> std::sync::MutexGuard<'_, Deliveries> {
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
    fn delivery_marker(&self) -> Option<ShardingResult<Payload>> {
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
    current: Option<(Delivery, bool)>,
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

/// An entity whose state is the sum of the events it persisted: each
/// handler persists events with [`persist`](Self::persist) (which applies
/// them once they are durable), and every incarnation — after a restart,
/// passivation, a move to another node, a handler panic — recovers by
/// applying the journal's events, in order, before it handles any message.
/// Register it with `ShardedSystem::register_event_sourced`, which exists
/// only on a system built with a journal.
///
/// Events are stored as CBOR with the entity type's wire name and
/// [`EVENT_VERSION`](Self::EVENT_VERSION): to evolve them, add fields as
/// `#[serde(default)]` (old events still decode) or new enum variants, and
/// raise the version when old code must not read the new events (an
/// incarnation refuses events of a version above its own, with
/// [`PersistenceError::Corrupt`](crate::persistence::PersistenceError::Corrupt),
/// and applies nothing).
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

/// What an incarnation recovers from: the latest snapshot (of a
/// [`Snapshotted`] type) and the journal's events after it.
pub(crate) struct Recovered {
    pub(crate) snapshot: Option<SnapshotRecord>,
    pub(crate) events: Vec<EventRecord>,
    /// Of a durable-state type: the stored state.
    pub(crate) state: Option<StateRecord>,
}

fn corrupt(ctx: &EntityContext, what: String) -> crate::ShardingError {
    let id = PersistenceId::new(ctx.type_name, ctx.entity_id());
    ctx.persistence_error(PersistenceError::Corrupt {
        persistence_id: id,
        what,
    })
}

/// Checks and decodes `events`, which must be numbered from `first` on.
fn decode_events<E: EventSourced>(
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
        let event: E::Event = ciborium::from_reader(payload.bytes.as_slice()).map_err(|e| {
            corrupt(
                ctx,
                format!("event {} does not decode: {e}", record.sequence_nr),
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

/// The manifest of a type's snapshots.
fn snapshot_manifest(type_name: &str) -> String {
    format!("{type_name}#snapshot")
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
            let undecodable = |e: ciborium::de::Error<std::io::Error>| {
                corrupt(ctx, format!("snapshot {seq} does not decode: {e}"))
            };
            let (snapshot, rows) = if with_deliveries {
                let (snapshot, rows): (E::Snapshot, Vec<DeliveryRow>) =
                    ciborium::from_reader(payload.bytes.as_slice()).map_err(undecodable)?;
                (snapshot, Some(rows))
            } else {
                let snapshot: E::Snapshot =
                    ciborium::from_reader(payload.bytes.as_slice()).map_err(undecodable)?;
                (snapshot, None)
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

/// An [`EventSourced`] entity that also saves snapshots of its state: one
/// after every `SNAPSHOT_EVERY` events, keeping the last `SNAPSHOTS_KEPT`;
/// an incarnation recovers from the latest snapshot and the events after
/// it. Register it with `ShardedSystem::register_snapshotted`, which needs
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
}

/// An entity whose in-memory state moves with it when its shard moves
/// gracefully (live migration, Orleans' dehydrate / rehydrate): a
/// rebalance, a graceful leave, a rolling restart, a system's `shutdown()`.
/// The old owner lets each live entity finish its mailbox, takes its state
/// with [`dehydrate`](Self::dehydrate) and sends it to the new owner, which
/// builds the next incarnation with the factory and hands it the state with
/// [`rehydrate`](Self::rehydrate) before any message. Register it with
/// `ShardedSystem::register_migratable`.
///
/// When the state cannot come — the old owner died, the move timed out,
/// the state does not decode, or its version is above this build's
/// [`STATE_VERSION`](Self::STATE_VERSION) — the incarnation starts as the
/// factory made it, and a [`MigrationEvent`](crate::MigrationEvent) says
/// so. A state is applied at most once, to one incarnation.
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Counter = "counter" { tell Add; } }
/// #[derive(Default)]
/// struct CounterEntity { total: u64 }
/// impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// impl Migratable for CounterEntity {
///     type Dehydrated = u64;
///     fn dehydrate(&mut self) -> u64 { self.total }
///     fn rehydrate(&mut self, total: u64) { self.total = total; }
/// }
/// # fn main() {}
/// ```
pub trait Migratable: Entity {
    /// The state as it travels (CBOR).
    type Dehydrated: serde::Serialize + serde::de::DeserializeOwned + Send + 'static;
    /// The version of the state's encoding, sent with it: a receiver
    /// refuses a state of a version above its own.
    const STATE_VERSION: u32 = 1;
    /// Takes the state out of an incarnation that has handled its last
    /// message here (it is dropped next).
    fn dehydrate(&mut self) -> Self::Dehydrated;
    /// Puts a migrated state into an incarnation fresh from the factory,
    /// before its first message.
    fn rehydrate(&mut self, state: Self::Dehydrated);
}

/// One entity's dehydrated state, encoded: what a move carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MigratedState {
    /// The version of its encoding when it was taken
    /// (`Migratable::STATE_VERSION`, `Snapshotted::SNAPSHOT_VERSION` or
    /// `DurableState::STATE_VERSION`).
    pub(crate) version: u32,
    /// Its CBOR.
    pub(crate) bytes: bytes::Bytes,
    /// Of a durable type: where the state stands in its store (the
    /// journal's sequence number it includes, or the state's revision); 0
    /// otherwise.
    pub(crate) position: u64,
    /// The entity's deliveries table (SPEC §13.17), empty if it has none.
    pub(crate) deliveries: Vec<DeliveryRow>,
}

/// A migratable type's two conversions, type-erased for its spawner.
pub(crate) struct Migration<E> {
    /// Dehydrates and encodes; `Err` says why it could not.
    pub(crate) take: fn(&mut E, &EntityContext) -> Result<MigratedState, String>,
    /// Decodes and rehydrates; `Err` (nothing applied) says why not. `None`
    /// for a durable type, whose state goes into its recovery instead.
    pub(crate) put: Option<Rehydrate<E>>,
}

/// Decodes a migrated state into a fresh incarnation.
pub(crate) type Rehydrate<E> = fn(&mut E, &MigratedState) -> Result<(), String>;

impl<E> Clone for Migration<E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Migration<E> {}

impl<E: Migratable> Migration<E> {
    pub(crate) fn of() -> Self {
        Migration {
            take: |entity, _| {
                let mut bytes = Vec::new();
                ciborium::into_writer(&entity.dehydrate(), &mut bytes)
                    .map_err(|e| format!("the state does not encode: {e}"))?;
                Ok(MigratedState {
                    version: E::STATE_VERSION,
                    bytes: bytes.into(),
                    position: 0,
                    deliveries: Vec::new(),
                })
            },
            put: Some(|entity, state| {
                if state.version > E::STATE_VERSION {
                    return Err(format!(
                        "the state has version {}, above this build's {}",
                        state.version,
                        E::STATE_VERSION
                    ));
                }
                let decoded: E::Dehydrated = ciborium::from_reader(&state.bytes[..])
                    .map_err(|e| format!("the state does not decode: {e}"))?;
                entity.rehydrate(decoded);
                Ok(())
            }),
        }
    }
}

impl<E: Snapshotted> Migration<E> {
    /// A snapshotted type's: its snapshot, at the journal's sequence
    /// number this incarnation knows.
    pub(crate) fn snapshotted() -> Self {
        Migration {
            take: |entity, ctx| {
                let mut bytes = Vec::new();
                ciborium::into_writer(&entity.snapshot(), &mut bytes)
                    .map_err(|e| format!("the snapshot does not encode: {e}"))?;
                let position = ctx
                    .journal
                    .as_ref()
                    .map_or(0, |j| j.highest.load(Ordering::Acquire));
                Ok(MigratedState {
                    version: E::SNAPSHOT_VERSION,
                    bytes: bytes.into(),
                    position,
                    deliveries: Vec::new(),
                })
            },
            put: None,
        }
    }
}

impl<E: DurableState> Migration<E> {
    /// A durable-state type's: its state, at the revision this incarnation
    /// knows.
    pub(crate) fn durable_state() -> Self {
        Migration {
            take: |entity, ctx| {
                let mut bytes = Vec::new();
                ciborium::into_writer(entity.state(), &mut bytes)
                    .map_err(|e| format!("the state does not encode: {e}"))?;
                let position = ctx
                    .state
                    .as_ref()
                    .map_or(0, |h| h.revision.load(Ordering::Acquire));
                Ok(MigratedState {
                    version: E::STATE_VERSION,
                    bytes: bytes.into(),
                    position,
                    deliveries: Vec::new(),
                })
            },
            put: None,
        }
    }
}

/// What became of migrated states on this node
/// (`ShardedSystem::subscribe_migration_events`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationEvent {
    /// A shard moved here with the states of `entities` entities
    /// (`bytes` of them, encoded), each given to its next incarnation.
    Received {
        /// The entity type.
        type_name: &'static str,
        /// The shard.
        shard: ShardId,
        /// Its old owner.
        from: crate::identity::UniqueAddress,
        /// How many states came.
        entities: usize,
        /// Their encoded size.
        bytes: usize,
    },
    /// A shard started here without its entities' states: they start from
    /// the factory (a durable type's, from its store).
    FellBack {
        /// The entity type.
        type_name: &'static str,
        /// The shard.
        shard: ShardId,
        /// Its old owner, when the move was a handoff; `None` for a shard
        /// that moved without one (its owner was lost, or its handoff
        /// timed out), which moves no state.
        from: Option<crate::identity::UniqueAddress>,
        /// Why: the old owner is gone, had none for this node, the
        /// migration timed out, or the move was not a handoff.
        reason: String,
    },
    /// One entity's state came but was refused (it does not decode, or its
    /// version is above this build's): that entity starts from the factory.
    StateRefused {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
        /// Why.
        reason: String,
    },
}

/// A snapshotted type's snapshot rule, shared by its incarnations.
pub(crate) struct Snapshots {
    store: std::sync::Weak<dyn SnapshotStore>,
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
/// waits for more than that, so a lone writer's append goes at once.
#[derive(Default)]
struct Linger {
    /// At least this many appends make a batch that goes at once.
    target: usize,
    /// Until when a smaller batch waits.
    until: Option<Instant>,
}

impl Linger {
    fn committed(&mut self, answered: usize, took: Duration, queued: usize) {
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
        commit: impl Fn(&[W]) -> Vec<PersistenceResult<()>> + Send + 'static,
    ) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<Pending<W>>();
        let waiting = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let queued = waiting.clone();
        let run = move || {
            let mut linger = Linger::default();
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
/// [`BatchWriter`] on a `datum-journal` thread), each batch one
/// [`Journal::append`] call. It holds the journal weakly: the system's
/// handle alone decides how long the store stays open.
pub(crate) struct JournalWriter {
    journal: std::sync::Weak<dyn Journal>,
    batches: BatchWriter<AtomicWrite>,
}

impl JournalWriter {
    /// Starts the writer of `journal`.
    pub(crate) fn start(journal: &Arc<dyn Journal>) -> Arc<Self> {
        let weak = Arc::downgrade(journal);
        let store = weak.clone();
        let batches =
            BatchWriter::start("datum-journal", move |writes: &[AtomicWrite]| {
                match store.upgrade() {
                    Some(journal) => journal.append(writes),
                    None => vec![Err(writer_stopped()); writes.len()],
                }
            });
        Arc::new(JournalWriter {
            journal: weak,
            batches,
        })
    }

    async fn append(
        &self,
        write: AtomicWrite,
        deadline: Option<CallDeadline>,
    ) -> PersistenceResult<()> {
        self.batches.write(write, deadline).await
    }

    fn journal(&self) -> PersistenceResult<Arc<dyn Journal>> {
        self.journal.upgrade().ok_or_else(writer_stopped)
    }
}

/// The saves of every durable-state entity of a system. On a store whose
/// `save_all` commits a batch at once
/// ([`DurableStateStore::commits_batches`]), batched (a [`BatchWriter`]
/// on a `datum-states` thread, one `save_all` per batch: on the embedded
/// store, one transaction and one sync for the lot); on another, each save
/// is its own `save` call on a blocking thread, several at a time. It holds
/// the store weakly.
pub(crate) enum StateWriter {
    Batched(BatchWriter<StateWrite>),
    Direct(std::sync::Weak<dyn DurableStateStore>),
}

impl StateWriter {
    /// Starts the writer of `store`.
    pub(crate) fn start(store: &Arc<dyn DurableStateStore>) -> Arc<Self> {
        let weak = Arc::downgrade(store);
        if !store.commits_batches() {
            return Arc::new(StateWriter::Direct(weak));
        }
        let batches = BatchWriter::start("datum-states", move |writes: &[StateWrite]| {
            match weak.upgrade() {
                Some(store) => store.save_all(writes),
                None => vec![Err(writer_stopped()); writes.len()],
            }
        });
        Arc::new(StateWriter::Batched(batches))
    }

    /// Saves `write`; with a `deadline`, withdrawing it at its `wait` if
    /// no batch took it yet (a save not batched goes to the store at once,
    /// its `call_deadline` set).
    async fn save(
        &self,
        write: StateWrite,
        deadline: Option<CallDeadline>,
    ) -> PersistenceResult<()> {
        match self {
            StateWriter::Batched(batches) => batches.write(write, deadline).await,
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

/// An event-sourced incarnation's link to its journal.
pub(crate) struct JournalHandle {
    writer: Arc<JournalWriter>,
    /// Of a snapshotted type: its snapshot rule.
    snapshots: Option<Arc<Snapshots>>,
    id: PersistenceId,
    /// The highest sequence number this incarnation knows.
    highest: AtomicU64,
    /// Why this incarnation must handle nothing more: a write refused
    /// because another incarnation wrote since, or one whose outcome is
    /// unknown (a store error, an append whose caller went away).
    retired: std::sync::Mutex<Option<PersistenceError>>,
    /// Whether the reason it was retired is a conflict (read without the
    /// lock after every message; see [`EntityContext::take_conflict`]).
    conflicted: AtomicBool,
}

impl JournalHandle {
    fn retire(&self, why: PersistenceError) {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.get_or_insert(why);
    }

    fn retired(&self) -> Option<PersistenceError> {
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

/// Runs a store call on a blocking thread (the SPI is synchronous), with
/// `by` as the call's [`call_deadline`](crate::persistence::call_deadline).
async fn blocking_by<T: Send + 'static>(
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
    store: std::time::Instant,
    wait: tokio::time::Instant,
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
    fn call_deadline(&self) -> Option<CallDeadline> {
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
    fn accepted(&self) {
        self.wrote.store(true, Ordering::Relaxed);
        if self.conflicts.load(Ordering::Relaxed) != 0 {
            self.conflicts.store(0, Ordering::Relaxed);
        }
    }

    fn persistence_error(&self, error: PersistenceError) -> crate::ShardingError {
        crate::ShardingError::Persistence {
            type_name: self.type_name,
            entity_id: self.entity_id.to_string(),
            error: Box::new(error),
        }
    }

    fn handle(&self) -> ShardingResult<&JournalHandle> {
        self.journal.as_ref().ok_or_else(|| {
            crate::ShardingError::Bug(format!("`{}` persisted without a journal", self.type_name))
        })
    }

    /// Who writes: this node's identity and the shard's generation.
    fn writer(&self) -> Writer {
        Writer {
            node_id: self.node.map_or(0, |n| n.node_id.0),
            incarnation: self.node.map_or(0, |n| n.incarnation),
            generation: self.generation,
        }
    }

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

    /// After `count` events were appended and applied to `entity`: its
    /// snapshot, when the count crossed a multiple of the type's
    /// `SNAPSHOT_EVERY`.
    fn snapshot_due(
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
    async fn save_snapshot(&self, snapshot: ShardingResult<SnapshotRecord>) {
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

    /// Appends `events` after the highest sequence number this incarnation
    /// knows. A refusal because another incarnation wrote, or an outcome
    /// that is not known (a store error: the events may be in the journal;
    /// the caller gone before the answer), retires this incarnation: the
    /// next one — in place after a conflict
    /// ([`take_conflict`](Self::take_conflict)), otherwise the next
    /// message's — recovers what the journal holds. An append withdrawn
    /// before any batch took it (the ask's deadline near) was not written,
    /// and leaves the incarnation running.
    async fn append(&self, events: Vec<Payload>) -> ShardingResult<()> {
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

    /// Links this incarnation to `store` (a durable-state type, whose
    /// state `encode` takes).
    pub(crate) fn attach_state(
        &mut self,
        store: std::sync::Weak<dyn DurableStateStore>,
        writer: Arc<StateWriter>,
        encode: StateEncoder,
    ) {
        self.state = Some(StateHandle {
            store,
            writer,
            encode,
            id: PersistenceId::new(self.type_name, &*self.entity_id),
            revision: AtomicU64::new(0),
            retired: std::sync::Mutex::new(None),
            conflicted: AtomicBool::new(false),
        });
    }

    fn state_store(&self, handle: &StateHandle) -> ShardingResult<Arc<dyn DurableStateStore>> {
        handle.store.upgrade().ok_or_else(|| {
            self.persistence_error(PersistenceError::Store(
                "the system's state store is gone".into(),
            ))
        })
    }

    async fn recover_state(&self, handle: &StateHandle) -> ShardingResult<Recovered> {
        let store = self.state_store(handle)?;
        let id = handle.id.clone();
        let by = self.call_deadline().map(|d| d.store);
        let read = blocking_by(by, move || Ok((store.revision(&id)?, store.load(&id)?))).await;
        let (revision, state) = read.map_err(|e| self.persistence_error(e))?;
        handle.revision.store(revision, Ordering::Release);
        Ok(Recovered {
            snapshot: None,
            events: Vec::new(),
            state,
        })
    }

    /// Saves `payload` as the next revision after the one this incarnation
    /// knows. A conflict (another incarnation saved since) or an outcome
    /// that is not known retires this incarnation, as for an append; a
    /// save withdrawn unwritten leaves it running.
    async fn save_state(&self, payload: Payload) -> ShardingResult<()> {
        let Some(handle) = &self.state else {
            return Err(crate::ShardingError::Bug(format!(
                "`{}` saved a state without a state store",
                self.type_name
            )));
        };
        if let Some(why) = handle
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(self.persistence_error(why));
        }
        let expected = handle.revision.load(Ordering::Acquire);
        let write = StateWrite {
            persistence_id: handle.id.clone(),
            expected,
            payload,
            writer: self.writer(),
        };
        let mut guard = StateInFlight {
            handle,
            done: false,
        };
        let saved = handle.writer.save(write, self.call_deadline()).await;
        guard.done = true;
        match saved {
            Ok(()) => {
                handle.revision.store(expected + 1, Ordering::Release);
                self.accepted();
                // The message being handled, if a reliable one, is recorded.
                if let Some((_, saved)) = &mut self.deliveries().current {
                    *saved = true;
                }
                Ok(())
            }
            Err(error @ PersistenceError::Invalid(_)) => Err(self.persistence_error(error)),
            // Not written, but the handler changed the state in memory
            // before it saved: this incarnation is retired, so the next
            // one loads what is stored (and "not processed" holds).
            Err(error) => {
                handle.retire(error.clone());
                if matches!(error, PersistenceError::RevisionConflict { .. }) {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "another incarnation saved this entity's state: this one loads it anew");
                    handle.conflicted.store(true, Ordering::Release);
                } else if matches!(error, PersistenceError::Unavailable(_)) {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "a state save was not sent in time: this incarnation stops, the next loads what is stored");
                } else {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "a state save's outcome is unknown: this incarnation stops");
                }
                Err(self.persistence_error(error))
            }
        }
    }
}

/// Encodes a durable-state entity's state (with the deliveries table of its
/// context) as it is saved.
pub(crate) type StateEncoder = fn(&dyn std::any::Any, &EntityContext) -> ShardingResult<Payload>;

/// A durable-state incarnation's link to its store.
struct StateHandle {
    store: std::sync::Weak<dyn DurableStateStore>,
    /// The system's batched writer of saves.
    writer: Arc<StateWriter>,
    encode: StateEncoder,
    id: PersistenceId,
    /// The revision this incarnation knows.
    revision: AtomicU64,
    /// Why this incarnation must handle nothing more.
    retired: std::sync::Mutex<Option<PersistenceError>>,
    /// Whether the reason it was retired is a conflict.
    conflicted: AtomicBool,
}

impl StateHandle {
    /// Marks the incarnation as done (the first reason stays).
    fn retire(&self, why: PersistenceError) {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.get_or_insert(why);
    }
}

impl std::fmt::Debug for StateHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateHandle")
            .field("id", &self.id)
            .field("revision", &self.revision)
            .finish_non_exhaustive()
    }
}

/// Retires the incarnation if a save is dropped before its outcome is known.
struct StateInFlight<'a> {
    handle: &'a StateHandle,
    done: bool,
}

impl Drop for StateInFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.handle.retire(PersistenceError::Store(
                "a save was abandoned before its outcome was known".into(),
            ));
        }
    }
}

/// An entity whose whole state is saved, with a revision (Akka's durable
/// state, Orleans' grain storage): a handler changes the state and calls
/// [`save_state`](Self::save_state), which stores it as the next revision
/// only if no other incarnation saved since this one loaded; every
/// incarnation loads the stored state before its first message. Register
/// it with `ShardedSystem::register_durable_state`, which needs a system
/// whose journal is also a [`DurableStateStore`]. A save refused as stale,
/// or whose outcome is unknown, retires the incarnation as a stale
/// [`EventSourced`] one is.
pub trait DurableState: Entity {
    /// The state as it is saved.
    type State: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static;
    /// The version of the state's encoding, stored with it.
    const STATE_VERSION: u32 = 1;
    /// The state to save.
    fn state(&self) -> &Self::State;
    /// Takes the stored state (into an incarnation fresh from the factory;
    /// not called when nothing is stored).
    fn set_state(&mut self, state: Self::State);

    /// Saves [`state`](Self::state) as the next revision; on error nothing
    /// was saved unless the error is a store's (outcome unknown: the next
    /// incarnation loads what is there).
    fn save_state(&mut self, ctx: &EntityContext) -> impl Future<Output = ShardingResult<()>> + Send
    where
        Self: Sized,
    {
        let payload = encode_state::<Self>(ctx, self.state());
        async move { ctx.save_state(payload?).await }
    }
}

fn state_manifest(type_name: &str) -> String {
    format!("{type_name}#state")
}

/// The manifest of an event-sourced entity's delivery record (SPEC
/// §13.17): its bytes are the CBOR array `[producer, epoch, seq]`.
fn delivery_manifest(type_name: &str) -> String {
    format!("{type_name}#delivery")
}

/// The manifest of a snapshot saved with its deliveries table: its bytes
/// are the CBOR array `[snapshot, [[producer, epoch, seq], …]]`.
fn snapshot_with_deliveries_manifest(type_name: &str) -> String {
    format!("{type_name}#snapshot+deliveries")
}

/// The manifest of a state saved with its deliveries table (SPEC §13.17):
/// its bytes are the CBOR array `[state, [[producer, epoch, seq], …]]`.
fn state_with_deliveries_manifest(type_name: &str) -> String {
    format!("{type_name}#state+deliveries")
}

fn encode_state<E: DurableState>(ctx: &EntityContext, state: &E::State) -> ShardingResult<Payload> {
    let rows = ctx.delivery_rows();
    let mut bytes = Vec::new();
    let (manifest, encoded) = if rows.is_empty() {
        let encoded = ciborium::into_writer(state, &mut bytes);
        (state_manifest(ctx.type_name), encoded)
    } else {
        let encoded = ciborium::into_writer(&(state, rows), &mut bytes);
        (state_with_deliveries_manifest(ctx.type_name), encoded)
    };
    encoded.map_err(|e| {
        ctx.persistence_error(PersistenceError::Invalid(format!(
            "a state does not encode: {e}"
        )))
    })?;
    Ok(Payload {
        manifest,
        version: E::STATE_VERSION,
        bytes,
    })
}

/// [`encode_state`] of the entity behind `entity` (a `E`).
pub(crate) fn encode_state_of<E: DurableState>(
    entity: &dyn std::any::Any,
    ctx: &EntityContext,
) -> ShardingResult<Payload> {
    let entity = entity
        .downcast_ref::<E>()
        .ok_or_else(|| crate::ShardingError::Bug("a state of another entity type".into()))?;
    encode_state::<E>(ctx, entity.state())
}

/// Loads a durable-state entity's stored state, checked and decoded first.
pub(crate) fn recover_state<E: DurableState>(
    entity: &mut E,
    ctx: &EntityContext,
    recovered: Recovered,
) -> ShardingResult<()> {
    let Some(record) = recovered.state else {
        return Ok(());
    };
    let payload = record.payload;
    let with_deliveries = payload.manifest == state_with_deliveries_manifest(ctx.type_name);
    if payload.manifest != state_manifest(ctx.type_name) && !with_deliveries {
        return Err(corrupt(
            ctx,
            format!("the state is a `{}`", payload.manifest),
        ));
    }
    if payload.version > E::STATE_VERSION {
        return Err(corrupt(
            ctx,
            format!(
                "the state has version {}, above this build's {}",
                payload.version,
                E::STATE_VERSION
            ),
        ));
    }
    let undecodable = |e: ciborium::de::Error<std::io::Error>| {
        corrupt(ctx, format!("the state does not decode: {e}"))
    };
    if with_deliveries {
        let (state, rows): (E::State, Vec<DeliveryRow>) =
            ciborium::from_reader(payload.bytes.as_slice()).map_err(undecodable)?;
        ctx.restore_deliveries(rows);
        entity.set_state(state);
    } else {
        let state: E::State =
            ciborium::from_reader(payload.bytes.as_slice()).map_err(undecodable)?;
        entity.set_state(state);
    }
    Ok(())
}

#[cfg(test)]
mod linger_tests {
    use super::*;

    /// A journal's append, as its writer queues it.
    type Append = Pending<AtomicWrite>;

    fn append() -> (
        Append,
        tokio::sync::oneshot::Receiver<PersistenceResult<()>>,
    ) {
        let (done, result) = tokio::sync::oneshot::channel();
        let write = AtomicWrite {
            persistence_id: crate::persistence::PersistenceId::new("t", "e"),
            expected: 0,
            events: Vec::new(),
            writer: crate::persistence::Writer {
                node_id: 1,
                incarnation: 1,
                generation: 1,
            },
        };
        let pending = Pending {
            write,
            by: None,
            claimed: None,
            done,
        };
        (pending, result)
    }

    #[test]
    fn a_first_batch_takes_what_waits_and_goes() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut kept = Vec::new();
        for _ in 0..3 {
            let (a, r) = append();
            tx.send(a).unwrap();
            kept.push(r);
        }
        let mut batch = vec![rx.recv().unwrap()];
        Linger::default().gather(&rx, &mut batch);
        assert_eq!(batch.len(), 3);
    }

    #[test]
    fn after_a_commit_a_batch_waits_for_the_answered_then_no_longer() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut linger = Linger::default();
        // A commit answered 4 while 1 waited: a batch of 5 goes at once...
        linger.committed(4, Duration::from_secs(1), 1);
        let mut kept = Vec::new();
        for _ in 0..6 {
            let (a, r) = append();
            tx.send(a).unwrap();
            kept.push(r);
        }
        let mut batch = vec![rx.recv().unwrap()];
        linger.gather(&rx, &mut batch);
        assert_eq!(batch.len(), 6, "everything waiting, at least the target");
        // ...and a smaller one waits at most the linger, then goes.
        linger.committed(4, Duration::from_secs(1), 0);
        let (a, _r) = append();
        tx.send(a).unwrap();
        let began = Instant::now();
        let mut batch = vec![rx.recv().unwrap()];
        linger.gather(&rx, &mut batch);
        assert_eq!(batch.len(), 1);
        assert!(
            began.elapsed() < Duration::from_secs(1),
            "bounded by MAX_LINGER"
        );
        // A lone writer (one answered, one back) has its batch at once.
        linger.committed(1, Duration::from_secs(1), 0);
        assert_eq!(linger.target, 1, "one append is a whole batch");
    }
}

#[cfg(test)]
mod withdrawal_tests {
    use super::*;

    /// A write still queued for its batch when its sender's time is up is
    /// withdrawn — answered at once, and never handed to the store — while
    /// the write the store has is waited for.
    #[tokio::test]
    async fn a_write_queued_past_its_deadline_is_withdrawn_unwritten() {
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = std::sync::Mutex::new(held);
        let (entered, mut batches) = tokio::sync::mpsc::unbounded_channel::<Vec<u32>>();
        let writer = Arc::new(BatchWriter::start(
            "datum-test-writer",
            move |writes: &[u32]| {
                let _ = entered.send(writes.to_vec());
                // The store answers once the test lets it.
                let _ = held.lock().unwrap_or_else(|p| p.into_inner()).recv();
                vec![Ok(()); writes.len()]
            },
        ));
        let first = tokio::spawn({
            let writer = writer.clone();
            async move { writer.write(1, None).await }
        });
        assert_eq!(
            batches.recv().await,
            Some(vec![1]),
            "the store has the first"
        );
        let soon = CallDeadline {
            store: std::time::Instant::now() + Duration::from_millis(20),
            wait: tokio::time::Instant::now() + Duration::from_millis(20),
        };
        assert!(
            matches!(
                writer.write(2, Some(soon)).await,
                Err(PersistenceError::Unavailable(_))
            ),
            "queued behind a store that does not answer"
        );
        release.send(()).expect("the writer waits");
        release.send(()).expect("the writer waits");
        assert!(matches!(first.await.expect("the first"), Ok(())));
        assert!(matches!(writer.write(3, None).await, Ok(())));
        assert_eq!(
            batches.recv().await,
            Some(vec![3]),
            "the withdrawn write is not written"
        );
    }
}
