//! [`EntityRef`]: a reference to one entity, through which tells, asks and
//! passivations reach its region, and how a system makes one.

use std::any::TypeId;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;

use super::{ShardedSystem, Shared};
use crate::model::envelope::{Delivery, Extras};
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::{ShardExtractor, ShardId};
use crate::model::protocol::{Ask, Message, Protocol, Tell};
use crate::runtime::ask_waits::Expired;
use crate::runtime::dispatch::envelope_of;
use crate::runtime::region::Region;

/// A reference to one entity of protocol `P`: send it tells and asks.
///
/// Cheap to clone. Messages from one sender that awaits each call on the same
/// ref are processed in send order.
pub struct EntityRef<P: Protocol> {
    shared: Arc<Shared>,
    region: OnceLock<Arc<Region>>,
    entity_id: Arc<str>,
    shard: ShardId,
    _protocol: PhantomData<fn() -> P>,
}

impl<P: Protocol> Clone for EntityRef<P> {
    fn clone(&self) -> Self {
        EntityRef {
            shared: self.shared.clone(),
            region: self.region.clone(),
            entity_id: self.entity_id.clone(),
            shard: self.shard,
            _protocol: PhantomData,
        }
    }
}

impl<P: Protocol> std::fmt::Debug for EntityRef<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityRef")
            .field("type_name", &P::TYPE_NAME)
            .field("entity_id", &self.entity_id)
            .field("shard", &self.shard)
            .finish()
    }
}

impl<P: Protocol> EntityRef<P> {
    /// The entity's id.
    pub fn entity_id(&self) -> &str {
        &self.entity_id
    }

    /// The entity's shard, as the protocol's extractor computed it.
    pub fn shard_id(&self) -> ShardId {
        self.shard
    }

    fn region(&self) -> ShardingResult<&Arc<Region>> {
        if let Some(region) = self.region.get() {
            return Ok(region);
        }
        if self.shared.is_shut_down() {
            return Err(ShardingError::ShuttingDown);
        }
        let region = {
            let regions = self
                .shared
                .regions
                .read()
                .unwrap_or_else(|p| p.into_inner());
            match regions.get(P::TYPE_NAME) {
                Some(region) if region.protocol == TypeId::of::<P>() => region.clone(),
                _ => {
                    return Err(ShardingError::NotRegistered {
                        type_name: P::TYPE_NAME,
                    });
                }
            }
        };
        if self.shard.0 >= region.num_shards() {
            return Err(ShardingError::InvalidShard {
                entity_id: self.entity_id.to_string(),
                shard_id: self.shard,
                num_shards: region.num_shards(),
            });
        }
        Ok(self.region.get_or_init(|| region))
    }

    /// Sends a tell message. Returns once the message is accepted (enqueued or
    /// buffered), not when it is processed.
    ///
    /// To a remembered type whose write-behind queue is full (under
    /// `RememberEntitiesQueueFull::BackPressure`), it first waits for room,
    /// `full_queue_wait` at most.
    pub async fn tell<M: Tell<P>>(&self, msg: M) -> ShardingResult<()> {
        let region = self.region()?;
        self.shared.traffic.sent((P::TYPE_NAME, self.shard.0));
        if let Some(remember) = region.remember().filter(|r| r.is_full()) {
            // Boxed: a rare wait, kept out of every tell's future.
            Box::pin(remember.room(P::TYPE_NAME, self.shard, None)).await?;
        }
        let mut envelope = envelope_of::<P, M>(msg, None);
        if region.tracing().is_some() {
            let span = tracing::info_span!(
                "datum.tell",
                entity_type = P::TYPE_NAME,
                entity_id = &*self.entity_id
            );
            envelope.set_trace(span);
        }
        region.deliver(self.shard, &self.entity_id, envelope)
    }

    /// Sends an ask message and waits up to `timeout` for its reply.
    ///
    /// On [`ShardingError::AskTimeout`] the message may still be processed.
    /// To a remembered type whose write-behind queue is full (under
    /// `RememberEntitiesQueueFull::BackPressure`), it first waits for room,
    /// within `timeout`.
    pub async fn ask<M: Ask<P>>(&self, msg: M, timeout: Duration) -> ShardingResult<M::Reply> {
        let region = self.region()?;
        // The deadline and the latency both count from this one clock
        // read (the latency's end is one more, when the answer comes).
        let sent = tokio::time::Instant::now();
        region.metrics.asks.increment(1);
        self.shared.traffic.sent((P::TYPE_NAME, self.shard.0));
        let answer = match region.tracing() {
            None => self.ask_in(region, msg, (sent, timeout), None).await,
            Some(_) => {
                let span = tracing::info_span!(
                    "datum.ask",
                    entity_type = P::TYPE_NAME,
                    entity_id = &*self.entity_id
                );
                let extras = Extras {
                    trace: Some(span.clone()),
                    delivery: None,
                    deadline: None,
                };
                let asked = self.ask_in(region, msg, (sent, timeout), Some(Box::new(extras)));
                // Boxed, as every rare wait of an ask: what an untraced
                // ask's future holds is what the common path needs.
                Box::pin(tracing::Instrument::instrument(asked, span)).await
            }
        };
        match &answer {
            Ok(_) => region.metrics.ask_answered(sent),
            Err(e) => region.metrics.ask_failed(e.kind()),
        }
        answer
    }

    /// A ref to `entity_id` through the system `shared` (its shard as the
    /// protocol's extractor puts it).
    fn on(shared: Arc<Shared>, entity_id: Arc<str>) -> EntityRef<P> {
        let shard = P::Extractor::default().shard_id(&entity_id, shared.config.num_shards);
        EntityRef {
            shared,
            region: OnceLock::new(),
            entity_id,
            shard,
            _protocol: PhantomData,
        }
    }

    /// Another entity of the same type, on the same system.
    pub(crate) fn sibling(&self, entity_id: Arc<str>) -> EntityRef<P> {
        EntityRef::on(self.shared.clone(), entity_id)
    }

    /// Whether the system this ref sends through has shut down.
    pub(crate) fn system_shut_down(&self) -> bool {
        self.shared.is_shut_down()
    }

    /// Sends tell `msg` tagged by a reliable producer (SPEC §13.17) as an
    /// ask, and waits up to `timeout` for its confirmation.
    pub(crate) async fn send_reliable<M: Tell<P>>(
        &self,
        msg: M,
        delivery: Delivery,
        timeout: Duration,
    ) -> ShardingResult<()> {
        let region = self.region()?;
        let sent = tokio::time::Instant::now();
        let extras = Extras {
            trace: None,
            delivery: Some(delivery),
            deadline: None,
        };
        self.ask_in(region, msg, (sent, timeout), Some(Box::new(extras)))
            .await
    }

    /// [`ask`](Self::ask) on the region it resolved (or a reliable tell,
    /// with its delivery tag in `extras`), `sent` at the instant its
    /// `timeout` counts from; `extras`: its trace span and delivery tag, if
    /// it has either.
    ///
    /// Its future is small (SPEC §13.5): the message is sent before the
    /// first await, the rare waits (room in a full remember-entities queue,
    /// tracing) are boxed, and what is held across the wait for the reply
    /// is the reply channel and its deadline. A caller that keeps a future
    /// per ask in flight allocates and moves each one.
    async fn ask_in<M: Message<P>>(
        &self,
        region: &Region,
        msg: M,
        (sent, timeout): (tokio::time::Instant, Duration),
        extras: Option<Box<Extras>>,
    ) -> ShardingResult<M::Reply> {
        let deadline = crate::persistence::remember::writer::deadline_from(sent, timeout);
        if let Some(remember) = region.remember().filter(|r| r.is_full()) {
            Box::pin(remember.room(P::TYPE_NAME, self.shard, Some(deadline))).await?;
        }
        let (replied, guarded) = self.send_ask(region, msg, (deadline, timeout), extras)?;
        // Sent to another node in this call: the pending-ask table answers
        // `AskTimeout` at the deadline. Anywhere else — an entity here, a
        // buffer — the system's table of waiting asks keeps it. Neither
        // arms a runtime timer (SPEC §13.5).
        let replied = if guarded {
            Ok(replied.await)
        } else {
            self.shared.asks.wait(replied, deadline).await
        };
        // A reply slot closed unanswered never reached a handler: one that
        // had answers `HandlerInterrupted` if it stops midway. Except the
        // pending-ask table's: dropped with the system, after the message
        // was sent away.
        let in_flight = || ShardingError::ShutDownInFlight {
            type_name: P::TYPE_NAME,
            entity_id: self.entity_id.to_string(),
        };
        match replied {
            Ok(Ok(result)) => result,
            Ok(Err(_closed)) if guarded => Err(in_flight()),
            Ok(Err(_closed)) if region.is_stopped() => Err(ShardingError::ShuttingDown),
            Ok(Err(_closed)) => Err(ShardingError::EntityStopped {
                type_name: P::TYPE_NAME,
                entity_id: self.entity_id.to_string(),
            }),
            // The table of waiting asks stopped with its runtime: where the
            // message stands (a buffer, a handler, another node) is unknown.
            Err(Expired::Stopped) => Err(in_flight()),
            Err(Expired::TimedOut) => Err(ShardingError::AskTimeout {
                type_name: P::TYPE_NAME,
                entity_id: self.entity_id.to_string(),
                timeout,
            }),
        }
    }

    /// Sends ask `msg` through `region`: the channel its reply comes on,
    /// and whether the pending-ask table keeps its deadline.
    fn send_ask<M: Message<P>>(
        &self,
        region: &Region,
        msg: M,
        (deadline, timeout): (tokio::time::Instant, Duration),
        extras: Option<Box<Extras>>,
    ) -> ShardingResult<(oneshot::Receiver<ShardingResult<M::Reply>>, bool)> {
        let (reply, replied) = oneshot::channel();
        let mut envelope = envelope_of::<P, M>(msg, Some(reply));
        envelope.set_extras(extras);
        envelope.set_guarded();
        if region.durable() {
            envelope.set_deadline(deadline);
        }
        let guarded =
            region.deliver_ask(self.shard, &self.entity_id, envelope, (deadline, timeout))?;
        Ok((replied, guarded))
    }

    /// Passivates the entity now: messages already sent to it are still
    /// handled by the current incarnation; messages sent after this returns
    /// go to a fresh one. Does nothing if the entity is not live.
    pub async fn passivate(&self) -> ShardingResult<()> {
        let region = self.region()?;
        region.passivate(self.shard, &self.entity_id, None)
    }
}

impl<S, J> ShardedSystem<S, J> {
    /// A reference to entity `entity_id` of protocol `P`. Cheap; no message is sent.
    pub fn entity_ref<P: Protocol>(&self, entity_id: impl Into<Arc<str>>) -> EntityRef<P> {
        EntityRef::on(self.shared.clone(), entity_id.into())
    }

    /// An entity ref of `P` to make others from (through
    /// `EntityRef::sibling`, which runs the extractor); itself it sends
    /// nothing.
    pub(crate) fn entity_template<P: Protocol>(&self) -> EntityRef<P> {
        EntityRef {
            shared: self.shared.clone(),
            region: OnceLock::new(),
            entity_id: Arc::from(""),
            shard: ShardId(0),
            _protocol: PhantomData,
        }
    }
}
