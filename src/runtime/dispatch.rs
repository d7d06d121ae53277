//! How a type-erased envelope reaches a typed handler: the [`Dispatch`]
//! that `protocol!` implements for each protocol, the [`Handles`] bridge to
//! an entity's `Handler` and `DeferredHandler` impls, and the typed doors
//! into the envelope module (`envelope_of` for a send on this node,
//! `decode_as` for a message from another node).

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use futures_util::future::{CatchUnwind, Either, ready};
use serde::Serialize;
use tokio::sync::oneshot;

use crate::entity::{Admission, DeferredHandler, Entity, EntityContext, Handler, ReplyPort};
use crate::model::envelope::{
    Delivery, LocalEnvelope, RemoteReply, ReplyTo, Undecodable, from_cbor,
};
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::protocol::{Message, Protocol};

/// Runs a type-erased envelope against an entity. `protocol!` implements it for
/// the protocol marker, generic over every entity that handles all its messages.
pub trait Dispatch<E: Entity<Protocol = Self>>: Protocol {
    /// Handles one envelope on `entity`.
    fn dispatch(
        entity: &mut E,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send;
}

/// The envelope of message `msg` of `P` sent on this node; `reply` is the
/// asker's, `None` for a tell.
pub(crate) fn envelope_of<P: Protocol, M: Message<P>>(
    msg: M,
    reply: Option<oneshot::Sender<ShardingResult<M::Reply>>>,
) -> LocalEnvelope {
    LocalEnvelope::local(M::INDEX, msg, reply)
}

/// Decodes message `M` of `P` from its CBOR bytes into an envelope whose
/// reply (if any) goes back to the remote asker.
pub fn decode_as<P: Protocol, M: Message<P>>(
    bytes: &[u8],
    reply: Option<RemoteReply>,
    hops: u8,
) -> Result<LocalEnvelope, Box<Undecodable>> {
    match from_cbor::<M>(bytes) {
        Ok(msg) => {
            let reply = match reply {
                Some(remote) => ReplyTo::Remote(remote),
                None => ReplyTo::Nobody,
            };
            Ok(LocalEnvelope::build::<M, M::Reply>(
                M::INDEX,
                msg,
                reply,
                hops,
            ))
        }
        Err(error) => Err(Box::new(Undecodable {
            error: ShardingError::Undecodable {
                what: format!("message {} of `{}`", M::INDEX, P::TYPE_NAME),
                error: error.to_string(),
            },
            reply,
        })),
    }
}

/// What handling one envelope did to the entity.
#[derive(Debug)]
pub struct Outcome(pub(crate) OutcomeKind);

#[derive(Debug)]
pub(crate) enum OutcomeKind {
    /// The handler ran to completion (with `Ok` or `Err`).
    Handled,
    /// The handler panicked; the entity must be rebuilt.
    Panicked(String),
    /// The envelope did not belong to this protocol (a bug).
    Unknown,
}

impl Outcome {
    /// The envelope's index is not in the protocol: fail it as a bug.
    pub fn unknown(envelope: LocalEnvelope) -> Self {
        let index = envelope.index();
        envelope.fail(ShardingError::Bug(format!(
            "message index {index} is not in the protocol"
        )));
        Outcome(OutcomeKind::Unknown)
    }
}

/// The line style of a `tell`/`ask` message: the handler's return value is
/// the reply.
pub enum Direct {}
/// The line style of a `defer` message: the handler gets a [`ReplyPort`].
pub enum Deferred {}

/// How entity `Self` handles message `M` of style `S` (`Direct` or
/// `Deferred`): what `protocol!`'s dispatch requires of an entity for each
/// line, implemented for every entity with the matching handler.
#[diagnostic::on_unimplemented(
    message = "`{Self}` does not handle `{M}` as its protocol declares",
    label = "missing a handler",
    note = "an entity implements `Handler<{M}>` for a `tell` or `ask` line, `DeferredHandler<{M}>` for a `defer` line"
)]
pub trait Handles<M, S>: Entity
where
    M: Message<Self::Protocol>,
{
    /// Runs the handler on one envelope known to carry `M`.
    fn run(
        &mut self,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send;
}

impl<E, M> Handles<M, Direct> for E
where
    E: Handler<M>,
    M: Message<E::Protocol>,
{
    fn run(
        &mut self,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send {
        handle_local::<E::Protocol, E, M>(self, envelope, ctx)
    }
}

impl<E, M> Handles<M, Deferred> for E
where
    E: DeferredHandler<M>,
    M: Message<E::Protocol>,
{
    fn run(
        &mut self,
        envelope: LocalEnvelope,
        ctx: &EntityContext,
    ) -> impl Future<Output = Outcome> + Send {
        handle_deferred::<E::Protocol, E, M>(self, envelope, ctx)
    }
}

/// The typed message inside an envelope known to carry `M`; a mismatch (a
/// bug) is answered and reported as such.
fn open<M: 'static, R: 'static>(envelope: LocalEnvelope) -> Result<(M, ReplyTo<R>), Outcome> {
    envelope.open::<M, R>().ok_or(Outcome(OutcomeKind::Unknown))
}

/// Handles one envelope of a `defer` line: the reply slot becomes the
/// handler's `ReplyPort`.
///
/// Like [`handle_local`], it opens the envelope when called and returns a
/// future that holds only the handler's guarded future and what follows it.
fn handle_deferred<P, E, M>(
    entity: &mut E,
    envelope: LocalEnvelope,
    ctx: &EntityContext,
) -> impl Future<Output = Outcome> + Send
where
    P: Protocol,
    E: Entity<Protocol = P> + DeferredHandler<M>,
    M: Message<P>,
{
    let mut envelope = envelope;
    if envelope.take_delivery().is_some() {
        envelope.fail(reliable_ask::<P, M>());
        return Either::Left(ready(Outcome(OutcomeKind::Handled)));
    }
    let (msg, reply) = match open::<M, M::Reply>(envelope) {
        Ok(typed) => typed,
        Err(outcome) => return Either::Left(ready(outcome)),
    };
    let port = ReplyPort::new(reply, ctx);
    let handled = match guarded(|| entity.handle(msg, port, ctx)) {
        Ok(handling) => Either::Left(handling),
        Err(panic) => Either::Right(ready(Err(panic))),
    };
    Either::Right(handled.map(move |handled| match handled {
        Ok(Ok(())) => Outcome(OutcomeKind::Handled),
        Ok(Err(error)) => {
            tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %error, "deferred handler failed");
            Outcome(OutcomeKind::Handled)
        }
        // The port went down with the handler: its asker hears it was interrupted.
        Err(payload) => Outcome(OutcomeKind::Panicked(panic_message(payload.as_ref()))),
    }))
}

/// Handles one envelope known to carry `M`: runs the handler, catches a panic,
/// and answers the asker.
///
/// The envelope is opened when this is called, and the future returned
/// holds the handler's guarded future and the reply slot, nothing else:
/// it is moved twice per message inside ractor's own (SPEC §13.5), so no
/// argument is kept in it twice, as an `async fn` would keep them.
pub fn handle_local<P, E, M>(
    entity: &mut E,
    envelope: LocalEnvelope,
    ctx: &EntityContext,
) -> impl Future<Output = Outcome> + Send
where
    P: Protocol,
    E: Entity<Protocol = P> + Handler<M>,
    M: Message<P>,
{
    let mut envelope = envelope;
    if let Some(delivery) = envelope.take_delivery() {
        // Boxed: the reliable path's future (the handler's and the store
        // write's) stays out of every message's handling future.
        let reliable = Box::pin(handle_reliable::<P, E, M>(entity, envelope, delivery, ctx));
        return Either::Left(Either::Left(reliable));
    }
    let (msg, reply) = match open::<M, M::Reply>(envelope) {
        Ok(typed) => typed,
        Err(outcome) => return Either::Left(Either::Right(ready(outcome))),
    };
    // From here the handler has begun: should its future be dropped
    // unfinished (the entity killed), the asker hears so.
    let reply = Begun::new(reply, ctx);
    // The common path's future is the guarded handling and the answer,
    // with no branch for the rare panic in the call, answered here.
    match guarded(|| entity.handle(msg, ctx)) {
        Ok(handled) => Either::Right(Either::Left(
            handled.map(move |handled| answer::<P, M>(reply, handled, ctx)),
        )),
        Err(panic) => Either::Right(Either::Right(ready(answer::<P, M>(reply, Err(panic), ctx)))),
    }
}

/// Makes a handler's call and guards the future it returns: a panic in
/// the call (before the handler returns its future) is `Err` with its
/// payload here, one while that future runs is its `Err` output.
fn guarded<F: Future>(
    call: impl FnOnce() -> F,
) -> Result<CatchUnwind<AssertUnwindSafe<F>>, Box<dyn Any + Send>> {
    std::panic::catch_unwind(AssertUnwindSafe(call)).map(|f| AssertUnwindSafe(f).catch_unwind())
}

/// The reply slot of a message whose handler has begun: dropped
/// unanswered (the handling future dropped midway, as when its entity is
/// killed), it answers `HandlerInterrupted`, since the message may have been
/// processed; a slot dropped before its handler began answers
/// `EntityStopped`, since it was not.
struct Begun<'a, R: Serialize> {
    /// `ReplyTo::Nobody` once taken to be answered.
    reply: ReplyTo<R>,
    ctx: &'a EntityContext,
}

impl<'a, R: Serialize> Begun<'a, R> {
    fn new(reply: ReplyTo<R>, ctx: &'a EntityContext) -> Self {
        Begun { reply, ctx }
    }

    /// The slot, to answer: this guard answers nothing more.
    fn take(mut self) -> ReplyTo<R> {
        std::mem::replace(&mut self.reply, ReplyTo::Nobody)
    }
}

impl<R: Serialize> Drop for Begun<'_, R> {
    fn drop(&mut self) {
        let reply = std::mem::replace(&mut self.reply, ReplyTo::Nobody);
        reply.interrupted(self.ctx.type_name(), self.ctx.entity_id());
    }
}

/// An error the handler of `ctx`'s entity answered with, as its asker
/// gets it (`ShardingError::answered_after`).
fn handlers_error(error: ShardingError, ctx: &EntityContext) -> ShardingError {
    error.answered_after((ctx.type_name(), ctx.entity_id()), ctx.wrote())
}

/// Answers the asker with what the handler did (its result, or its panic).
fn answer<P: Protocol, M: Message<P>>(
    reply: Begun<'_, M::Reply>,
    handled: Result<ShardingResult<M::Reply>, Box<dyn Any + Send>>,
    ctx: &EntityContext,
) -> Outcome {
    let reply = reply.take();
    match handled {
        Ok(result) => {
            if let (ReplyTo::Nobody, Err(error)) = (&reply, &result) {
                tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %error, "tell handler failed");
            }
            reply.answer(result.map_err(|e| handlers_error(e, ctx)));
            Outcome(OutcomeKind::Handled)
        }
        Err(payload) => {
            let panic = panic_message(payload.as_ref());
            let error = ShardingError::EntityPanicked {
                type_name: ctx.type_name(),
                entity_id: ctx.entity_id().to_owned(),
                panic: panic.clone(),
            };
            reply.answer(Err(error));
            Outcome(OutcomeKind::Panicked(panic))
        }
    }
}

/// The answer to a reliable producer's tag on an ask (no producer sends
/// one: only tells are sent reliably).
fn reliable_ask<P: Protocol, M: Message<P>>() -> ShardingError {
    ShardingError::Undecodable {
        what: format!("message {} of `{}`", M::INDEX, P::TYPE_NAME),
        error: "a reliable delivery of an ask (only tells are sent reliably)".into(),
    }
}

/// The confirmation of a reliable producer's message: `()`, the reply of
/// every tell; `None` when `R` is not `()` (an ask, which no producer sends).
fn confirmation<R: 'static>() -> Option<R> {
    let unit: Box<dyn Any> = Box::new(());
    unit.downcast::<R>().ok().map(|unit| *unit)
}

/// Handles a reliable producer's message (SPEC §13.17): a duplicate is
/// confirmed without running the handler, one from a superseded producer
/// is refused, and a new one is handled and recorded — for a durable-state
/// entity, in its store, in one write with its state — before its reply
/// confirms it. A handler's error is its answer and the message counts as
/// handled, except an error of the store (`Persistence`), whose message is
/// not recorded (the producer sends it again).
async fn handle_reliable<P, E, M>(
    entity: &mut E,
    envelope: LocalEnvelope,
    delivery: Delivery,
    ctx: &EntityContext,
) -> Outcome
where
    P: Protocol,
    E: Entity<Protocol = P> + Handler<M>,
    M: Message<P>,
{
    let (msg, reply) = match open::<M, M::Reply>(envelope) {
        Ok(typed) => typed,
        Err(outcome) => return outcome,
    };
    let Some(confirmed) = confirmation::<M::Reply>() else {
        reply.answer(Err(reliable_ask::<P, M>()));
        return Outcome(OutcomeKind::Handled);
    };
    match ctx.admit(&delivery) {
        Admission::New => {}
        Admission::Duplicate => {
            reply.answer(Ok(confirmed));
            return Outcome(OutcomeKind::Handled);
        }
        Admission::Superseded { current } => {
            reply.answer(Err(ShardingError::Superseded {
                producer_id: delivery.producer.to_string(),
                epoch: delivery.epoch,
                current,
            }));
            return Outcome(OutcomeKind::Handled);
        }
    }
    ctx.begin_delivery(delivery);
    // Should this future be dropped midway, the message stays unrecorded,
    // and its producer hears the handler was interrupted (it sends again;
    // a write that committed makes the next attempt a duplicate).
    let _unrecorded = Unrecorded(ctx);
    let reply = Begun::new(reply, ctx);
    let handled = AssertUnwindSafe(async { entity.handle(msg, ctx).await })
        .catch_unwind()
        .await;
    match handled {
        Ok(Err(error @ ShardingError::Persistence { .. })) => {
            ctx.fail_delivery(&error);
            reply.take().answer(Err(error));
            Outcome(OutcomeKind::Handled)
        }
        Ok(result) => {
            let entity: &E = entity;
            let payload =
                std::panic::catch_unwind(AssertUnwindSafe(|| ctx.delivery_payload(entity)))
                    .unwrap_or_else(|panic| {
                        Some(Err(ShardingError::Persistence {
                            type_name: ctx.type_name(),
                            entity_id: ctx.entity_id().to_owned(),
                            error: Box::new(crate::persistence::PersistenceError::Invalid(
                                format!(
                                    "encoding the state panicked: {}",
                                    panic_message(panic.as_ref())
                                ),
                            )),
                        }))
                    });
            let answer = match ctx.commit_delivery(payload).await {
                Ok(()) => result.map_err(|e| handlers_error(e, ctx)),
                Err(error) => Err(error),
            };
            if let Err(error) = &answer {
                tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %error, "reliable tell handler failed");
            }
            reply.take().answer(answer);
            Outcome(OutcomeKind::Handled)
        }
        Err(payload) => {
            ctx.abandon_delivery();
            let panic = panic_message(payload.as_ref());
            reply.take().answer(Err(ShardingError::EntityPanicked {
                type_name: ctx.type_name(),
                entity_id: ctx.entity_id().to_owned(),
                panic: panic.clone(),
            }));
            Outcome(OutcomeKind::Panicked(panic))
        }
    }
}

/// Leaves the message being handled unrecorded when dropped (a no-op once
/// it was recorded or abandoned).
struct Unrecorded<'a>(&'a EntityContext);

impl Drop for Unrecorded<'_> {
    fn drop(&mut self) {
        self.0.abandon_delivery();
    }
}

pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::extractor::ShardId;

    fn ctx() -> EntityContext {
        EntityContext::new("t", Arc::from("e"), ShardId(0), None)
    }

    fn interrupted() -> ShardingError {
        ShardingError::HandlerInterrupted {
            type_name: "t",
            entity_id: "e".into(),
        }
    }

    /// A handling future dropped midway (its entity killed) answers that
    /// the message may have been processed; a reply slot dropped before
    /// its handler began (a mailbox dropped) closes, which the asker
    /// reads as not processed.
    #[test]
    fn a_reply_slot_dropped_after_its_handler_began_says_maybe_processed() {
        let ctx = ctx();
        let (reply, mut replied) = oneshot::channel::<ShardingResult<u32>>();
        drop(Begun::new(ReplyTo::Local(reply), &ctx));
        assert_eq!(replied.try_recv(), Ok(Err(interrupted())));

        let (reply, mut replied) = oneshot::channel::<ShardingResult<u32>>();
        drop(ReplyTo::Local(reply));
        assert_eq!(
            replied.try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        );

        // Answered, it answers nothing more.
        let (reply, mut replied) = oneshot::channel::<ShardingResult<u32>>();
        Begun::new(ReplyTo::Local(reply), &ctx).take().answer(Ok(7));
        assert_eq!(replied.try_recv(), Ok(Ok(7)));
    }

    /// A deferred handler's port dropped unanswered — by the handler, or
    /// with it — says the same.
    #[test]
    fn a_reply_port_dropped_unanswered_says_maybe_processed() {
        let ctx = ctx();
        let (reply, mut replied) = oneshot::channel::<ShardingResult<u32>>();
        drop(ReplyPort::new(ReplyTo::Local(reply), &ctx));
        assert_eq!(replied.try_recv(), Ok(Err(interrupted())));

        let (reply, mut replied) = oneshot::channel::<ShardingResult<u32>>();
        ReplyPort::new(ReplyTo::Local(reply), &ctx).send(3);
        assert_eq!(replied.try_recv(), Ok(Ok(3)));
    }
}
