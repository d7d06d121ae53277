//! Reliable delivery to entities (SPEC §13.17): a producer that numbers
//! its tells per entity and sends each again until the entity confirms
//! it, and the entity's side that handles each number once.
//!
//! ```text
//!  producer "orders" (epoch e)                 entity "cart-42"
//!  send(cart-42, m) → seq 7, queued
//!  ask [m, delivery (orders, e, 7)] ────────►  7 > 6 seen: handle, record 7
//!                                              (durable state: one save with
//!                                               the state), then reply
//!  confirmed ◄────────────────────────────────  Ok(())
//!  (lost or timed out: sent again, backing off;   a second 7: a duplicate,
//!   the next to cart-42 waits for it)             confirmed, not handled
//! ```
//!
//! One message per entity is in flight at a time (so the entity sees each
//! producer's stream in order, and a number above the last it handled is
//! always the next one); the window (`max_unconfirmed`) bounds how many are
//! unconfirmed across all entities.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

mod durable;

pub use durable::DurableProducer;

use crate::model::envelope::Delivery;
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::protocol::{Protocol, Tell};
use crate::persistence::PersistenceError;
use crate::system::{EntityRef, ShardedSystem};

/// How a [`ReliableProducer`] sends.
#[derive(Clone, Debug, typed_builder::TypedBuilder)]
#[non_exhaustive]
pub struct ProducerConfig {
    /// How many messages may be unconfirmed at once, across all entities;
    /// [`ReliableProducer::send`] waits for room beyond it. Default 1,024.
    #[builder(default = 1024)]
    pub max_unconfirmed: usize,
    /// How long one attempt waits for its confirmation before the message
    /// is sent again. Default 5 s.
    #[builder(default = Duration::from_secs(5))]
    pub attempt_timeout: Duration,
    /// The wait before the first resend; it doubles with each failed
    /// attempt up to `max_backoff`. Default 100 ms.
    #[builder(default = Duration::from_millis(100))]
    pub min_backoff: Duration,
    /// The longest wait between attempts. Default 5 s.
    #[builder(default = Duration::from_secs(5))]
    pub max_backoff: Duration,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        ProducerConfig::builder().build()
    }
}

impl ProducerConfig {
    fn validate(&self) -> ShardingResult<()> {
        let invalid = |why: &str| Err(ShardingError::InvalidConfig(format!("producer: {why}")));
        if self.max_unconfirmed == 0 || self.max_unconfirmed > Semaphore::MAX_PERMITS {
            return invalid("max_unconfirmed must be at least 1");
        }
        if self.attempt_timeout.is_zero() {
            return invalid("attempt_timeout must be above zero");
        }
        if self.min_backoff.is_zero() || self.max_backoff < self.min_backoff {
            return invalid("min_backoff must be above zero and at most max_backoff");
        }
        Ok(())
    }
}

/// What a producer has done so far ([`ReliableProducer::stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProducerStats {
    /// Messages accepted by `send` and not yet confirmed.
    pub unconfirmed: usize,
    /// Messages the entity confirmed (handled, or recognised as handled).
    pub confirmed: u64,
    /// Of those, the ones whose handler answered an error (or panicked):
    /// handled, not sent again.
    pub failed: u64,
    /// Attempts sent again after a failure or a timeout.
    pub resent: u64,
}

/// Sends a protocol's tells to its entities reliably (SPEC §13.17): each
/// is numbered in the producer's stream to its entity and sent again,
/// backing off, until the entity confirms it — through lost replies,
/// timeouts, lost nodes, handoffs — and the entity handles each number
/// once. Effectively once needs the entity to keep its record durably
/// (a durable-state entity does, in one write with its state); see SPEC
/// for what weakens without it.
///
/// Made by [`ShardedSystem::reliable_producer`](crate::ShardedSystem::reliable_producer).
/// Clones share one producer; it stops when the last clone is dropped, or
/// its system shuts down, leaving what was unconfirmed unsent.
pub struct ReliableProducer<P: Protocol> {
    inner: Arc<Producer<P>>,
}

impl<P: Protocol> Clone for ReliableProducer<P> {
    fn clone(&self) -> Self {
        ReliableProducer {
            inner: self.inner.clone(),
        }
    }
}

impl<P: Protocol> std::fmt::Debug for ReliableProducer<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReliableProducer")
            .field("type_name", &P::TYPE_NAME)
            .field("producer_id", &self.inner.id)
            .field("epoch", &self.inner.epoch)
            .finish_non_exhaustive()
    }
}

/// One send of a queued message, with its tag, bounded by a timeout.
type Attempt<P> = Box<
    dyn Fn(&EntityRef<P>, Delivery, Duration) -> BoxFuture<'static, ShardingResult<()>>
        + Send
        + Sync,
>;

struct Producer<P: Protocol> {
    id: Arc<str>,
    epoch: u64,
    config: ProducerConfig,
    /// An entity ref of the type, to make the others from.
    entities: EntityRef<P>,
    window: Arc<Semaphore>,
    state: Mutex<State<P>>,
    /// Wakes `flush` when nothing is unconfirmed.
    drained: Notify,
}

struct State<P: Protocol> {
    streams: HashMap<Arc<str>, Stream<P>>,
    stats: ProducerStats,
    /// Why the producer stopped sending, once it has.
    stopped: Option<ShardingError>,
}

/// The producer's stream to one entity.
struct Stream<P: Protocol> {
    /// The number the next message gets.
    next_seq: u64,
    /// Unconfirmed, in order: the first is in flight.
    queue: VecDeque<Queued<P>>,
    /// Whether a task is sending the queue.
    sending: bool,
}

struct Queued<P: Protocol> {
    seq: u64,
    attempt: Arc<Attempt<P>>,
    /// Of a durable producer: the message's CBOR, for its snapshots.
    bytes: Option<Arc<[u8]>>,
    /// The message's place in the window, given back when it is confirmed
    /// (none for one recovered beyond the window).
    _permit: Option<OwnedSemaphorePermit>,
}

/// Every stream's next number, and the unconfirmed messages (entity, seq,
/// CBOR) of a durable producer.
pub(crate) type DurableView = (Vec<(String, u64)>, Vec<(String, u64, Arc<[u8]>)>);

/// One send of tell `msg`, as a producer queues it.
fn attempt_of<P: Protocol, M: Tell<P> + Clone + Sync>(msg: M) -> Attempt<P> {
    Box::new(move |entity, delivery, timeout| {
        let (entity, msg) = (entity.clone(), msg.clone());
        Box::pin(async move { entity.send_reliable(msg, delivery, timeout).await })
    })
}

impl<S, J> ShardedSystem<S, J> {
    /// A reliable producer named `producer_id` of `P`'s tells (SPEC
    /// §13.17): each message it sends is numbered per entity and sent
    /// again until the entity confirms it, and the entity handles each
    /// number once. Start at most one per id at a time: a later one (a
    /// restart) supersedes the earlier at every entity it reaches.
    ///
    /// Fails with `InvalidConfig` for an empty id or a config out of range.
    pub fn reliable_producer<P: Protocol>(
        &self,
        producer_id: impl Into<Arc<str>>,
        config: ProducerConfig,
    ) -> ShardingResult<ReliableProducer<P>> {
        ReliableProducer::start(producer_id.into(), config, self.entity_template())
    }
}

impl<P: Protocol> ReliableProducer<P> {
    /// A producer named `id` sending through `entities`' system.
    pub(crate) fn start(
        id: Arc<str>,
        config: ProducerConfig,
        entities: EntityRef<P>,
    ) -> ShardingResult<Self> {
        Self::start_with(id, config, entities, epoch_now())
    }

    /// A producer named `id` of incarnation `epoch`.
    pub(crate) fn start_with(
        id: Arc<str>,
        config: ProducerConfig,
        entities: EntityRef<P>,
        epoch: u64,
    ) -> ShardingResult<Self> {
        config.validate()?;
        if id.is_empty() {
            return Err(ShardingError::InvalidConfig(
                "producer: the id must not be empty".into(),
            ));
        }
        Ok(ReliableProducer {
            inner: Arc::new(Producer {
                id,
                epoch,
                window: Arc::new(Semaphore::new(config.max_unconfirmed)),
                config,
                entities,
                state: Mutex::new(State {
                    streams: HashMap::new(),
                    stats: ProducerStats::default(),
                    stopped: None,
                }),
                drained: Notify::new(),
            }),
        })
    }

    /// The producer's id.
    pub fn producer_id(&self) -> &str {
        &self.inner.id
    }

    /// This incarnation of the producer: a later one (a restart under the
    /// same id) has a higher epoch and supersedes it at every entity.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// Queues tell `msg` to entity `entity_id` and returns its number in
    /// the stream to that entity, once it is accepted — at once while
    /// fewer than `max_unconfirmed` messages are unconfirmed, else when
    /// one is confirmed. It is then sent (again, until confirmed) in the
    /// background, after the messages queued to that entity before it.
    ///
    /// Fails with `ShuttingDown` when the system has shut down, or the
    /// error that stopped the producer (`Superseded`: another incarnation
    /// of it runs).
    pub async fn send<M>(&self, entity_id: impl Into<Arc<str>>, msg: M) -> ShardingResult<u64>
    where
        M: Tell<P> + Clone + Sync,
    {
        let permit = self.room().await?;
        self.enqueue(entity_id.into(), None, attempt_of(msg), None, Some(permit))
    }

    /// A place in the window, once there is one.
    pub(crate) async fn room(&self) -> ShardingResult<OwnedSemaphorePermit> {
        let inner = &self.inner;
        inner
            .window
            .clone()
            .acquire_owned()
            .await
            .map_err(|_closed| inner.stopped_error())
    }

    /// A place in the window if there is one now.
    pub(crate) fn try_room(&self) -> Option<OwnedSemaphorePermit> {
        self.inner.window.clone().try_acquire_owned().ok()
    }

    /// The number the next message to `entity_id` gets.
    pub(crate) fn next_seq(&self, entity_id: &str) -> ShardingResult<u64> {
        let state = self.inner.lock();
        if let Some(why) = &state.stopped {
            return Err(why.clone());
        }
        Ok(state.streams.get(entity_id).map_or(1, |s| s.next_seq))
    }

    /// Queues a message to `entity_id` under the stream's next number (or
    /// under `seq`, which must be at least that: a durable producer's,
    /// journaled with it), starts the stream's sender if it is idle, and
    /// says the number.
    pub(crate) fn enqueue(
        &self,
        entity_id: Arc<str>,
        seq: Option<u64>,
        attempt: Attempt<P>,
        bytes: Option<Arc<[u8]>>,
        permit: Option<OwnedSemaphorePermit>,
    ) -> ShardingResult<u64> {
        let inner = &self.inner;
        let start = {
            let mut state = inner.lock();
            if let Some(why) = &state.stopped {
                return Err(why.clone());
            }
            if inner.entities.system_shut_down() {
                return Err(ShardingError::ShuttingDown);
            }
            let stream = state.streams.entry(entity_id.clone()).or_insert(Stream {
                next_seq: 1,
                queue: VecDeque::new(),
                sending: false,
            });
            let seq = match seq {
                None => stream.next_seq,
                Some(seq) if seq >= stream.next_seq => seq,
                Some(seq) => {
                    return Err(ShardingError::Bug(format!(
                        "message {seq} to `{entity_id}` is below the stream's next, {}",
                        stream.next_seq
                    )));
                }
            };
            stream.next_seq = seq + 1;
            stream.queue.push_back(Queued {
                seq,
                attempt: Arc::new(attempt),
                bytes,
                _permit: permit,
            });
            let start = !stream.sending;
            stream.sending = true;
            state.stats.unconfirmed += 1;
            (seq, start)
        };
        let (seq, start) = start;
        if start {
            let producer = Arc::downgrade(inner);
            let entity = inner.entities.sibling(entity_id);
            tokio::spawn(send_stream(producer, entity));
        }
        Ok(seq)
    }

    /// Why the producer cannot take a message now, if it cannot.
    pub(crate) fn refusal(&self) -> Option<ShardingError> {
        if let Some(why) = &self.inner.lock().stopped {
            return Some(why.clone());
        }
        self.inner
            .entities
            .system_shut_down()
            .then_some(ShardingError::ShuttingDown)
    }

    /// Sets the number the next message to `entity_id` gets (a recovered
    /// stream's).
    pub(crate) fn resume_stream(&self, entity_id: Arc<str>, next_seq: u64) {
        let mut state = self.inner.lock();
        let stream = state.streams.entry(entity_id).or_insert(Stream {
            next_seq: 1,
            queue: VecDeque::new(),
            sending: false,
        });
        stream.next_seq = stream.next_seq.max(next_seq);
    }

    /// What a durable producer's snapshot keeps: every stream's next
    /// number, and the unconfirmed messages with their bytes.
    pub(crate) fn durable_view(&self) -> DurableView {
        let state = self.inner.lock();
        let mut next = Vec::with_capacity(state.streams.len());
        let mut unconfirmed = Vec::new();
        for (id, stream) in &state.streams {
            next.push((id.to_string(), stream.next_seq));
            for queued in &stream.queue {
                if let Some(bytes) = &queued.bytes {
                    unconfirmed.push((id.to_string(), queued.seq, bytes.clone()));
                }
            }
        }
        (next, unconfirmed)
    }

    /// Stops the producer with `why` (its streams send nothing more).
    pub(crate) fn stop(&self, why: ShardingError) {
        self.inner.stop(why);
    }

    /// Waits until every message sent so far is confirmed, `timeout` at
    /// most (`AskTimeout` naming the producer then), or the producer
    /// stops (its error; when its system shut down, `ShutDownInFlight`
    /// naming the producer, since an unconfirmed message may have been
    /// handled before its confirmation was lost).
    pub async fn flush(&self, timeout: Duration) -> ShardingResult<()> {
        let inner = &self.inner;
        let waited = tokio::time::timeout(timeout, async {
            loop {
                let drained = inner.drained.notified();
                {
                    let state = inner.lock();
                    if state.stats.unconfirmed == 0 {
                        return Ok(());
                    }
                    if let Some(why) = &state.stopped {
                        return Err(in_flight_at_shutdown::<P>(why.clone(), &inner.id));
                    }
                }
                drained.await;
            }
        })
        .await;
        waited.unwrap_or_else(|_elapsed| {
            Err(ShardingError::AskTimeout {
                type_name: P::TYPE_NAME,
                entity_id: format!("(producer {})", inner.id),
                timeout,
            })
        })
    }

    /// What the producer has done so far.
    pub fn stats(&self) -> ProducerStats {
        self.inner.lock().stats
    }
}

impl<P: Protocol> Producer<P> {
    fn lock(&self) -> MutexGuard<'_, State<P>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopped_error(&self) -> ShardingError {
        self.lock()
            .stopped
            .clone()
            .unwrap_or(ShardingError::ShuttingDown)
    }

    /// Stops sending: `why` is what `send` and `flush` answer from now on.
    fn stop(&self, why: ShardingError) {
        self.lock().stopped.get_or_insert(why);
        self.window.close();
        self.drained.notify_waiters();
    }
}

/// A producer's error about messages it had taken: its system's shutdown
/// (`ShuttingDown`, which would say "not processed") is `ShutDownInFlight`
/// naming the producer, since a taken message may have been handled (or,
/// journaled, is sent again by a restart).
pub(crate) fn in_flight_at_shutdown<P: Protocol>(
    error: ShardingError,
    producer: &impl std::fmt::Display,
) -> ShardingError {
    match error {
        ShardingError::ShuttingDown => ShardingError::ShutDownInFlight {
            type_name: P::TYPE_NAME,
            entity_id: format!("(producer {producer})"),
        },
        other => other,
    }
}

/// Whether an attempt that failed so is sent again: the message may not
/// have been handled (lost, timed out, refused before handling), or its
/// store failed in a way that may pass. Any other error is the handler's
/// answer (or its panic), or will not pass by sending again (a store that
/// refuses the write as invalid): the message counts as handled.
fn resend_after(error: &ShardingError) -> bool {
    use ShardingError as E;
    match error {
        E::Persistence { error, .. } => !matches!(**error, PersistenceError::Invalid(_)),
        E::AskTimeout { .. }
        | E::PeerLost { .. }
        | E::EntityStopped { .. }
        | E::HandlerInterrupted { .. }
        | E::ShutDownInFlight { .. }
        | E::BufferOverflow { .. }
        | E::ShuttingDown
        | E::NotRegistered { .. }
        | E::RegionRefused(_)
        | E::UnknownMessage { .. }
        | E::TooManyHops { .. }
        | E::RememberEntities { .. }
        | E::Spawn(_) => true,
        _ => false,
    }
}

/// Sends the queue of one entity's stream, first to last, each until it
/// is confirmed; ends when the queue is empty or the producer is gone.
async fn send_stream<P: Protocol>(weak: std::sync::Weak<Producer<P>>, entity: EntityRef<P>) {
    let id = entity.entity_id().to_owned();
    loop {
        let (delivery, attempt, config) = {
            let Some(producer) = weak.upgrade() else {
                return;
            };
            let mut state = producer.lock();
            if state.stopped.is_some() {
                return;
            }
            let Some(stream) = state.streams.get_mut(&*id) else {
                return;
            };
            let Some(first) = stream.queue.front() else {
                stream.sending = false;
                return;
            };
            let delivery = Delivery {
                producer: producer.id.clone(),
                epoch: producer.epoch,
                seq: first.seq,
            };
            (delivery, first.attempt.clone(), producer.config.clone())
        };
        let mut backoff = config.min_backoff;
        let failed = loop {
            let answer = attempt(&entity, delivery.clone(), config.attempt_timeout).await;
            let Some(producer) = weak.upgrade() else {
                return;
            };
            match answer {
                Ok(()) => break false,
                Err(_) if entity.system_shut_down() => {
                    producer.stop(ShardingError::ShuttingDown);
                    return;
                }
                Err(error @ ShardingError::Superseded { .. }) => {
                    tracing::warn!(producer = %producer.id, epoch = producer.epoch, %error, "a newer incarnation of this reliable producer runs: this one stops");
                    producer.stop(error);
                    return;
                }
                Err(error) if resend_after(&error) => {
                    tracing::debug!(producer = %producer.id, entity_id = %id, seq = delivery.seq, %error, "a reliable message is sent again");
                    producer.lock().stats.resent += 1;
                }
                Err(error) => {
                    tracing::warn!(producer = %producer.id, entity_id = %id, seq = delivery.seq, %error, "a reliable message was handled with an error");
                    break true;
                }
            }
            drop(producer);
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(config.max_backoff);
            match weak.upgrade() {
                Some(producer) if producer.lock().stopped.is_none() => {}
                _ => return,
            }
        };
        let Some(producer) = weak.upgrade() else {
            return;
        };
        let mut state = producer.lock();
        if let Some(stream) = state.streams.get_mut(&*id) {
            // Its permit goes back to the window here.
            stream.queue.pop_front();
        }
        state.stats.unconfirmed -= 1;
        state.stats.confirmed += 1;
        state.stats.failed += u64::from(failed);
        if state.stats.unconfirmed == 0 {
            producer.drained.notify_waiters();
        }
    }
}

/// A new incarnation's epoch: the wall clock in microseconds, so that a
/// producer restarted under the same id supersedes the one before it.
/// Within one process, each epoch is above the one before.
fn epoch_now() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let before = LAST
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
            Some(now.max(last + 1))
        })
        .unwrap_or(0);
    now.max(before + 1)
}
