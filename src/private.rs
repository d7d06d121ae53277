//! Items the `protocol!` macro expands to. Not part of the stable API.
//!
//! The `Sealed*` traits are the seal of the protocol family: only code that
//! names this hidden module can implement them, and only `protocol!` should.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use tokio::sync::oneshot;

use crate::entity::{Entity, EntityContext, Handler};
use crate::error::{ShardingError, ShardingResult};
use crate::protocol::{Message, Protocol};

/// Seal of [`Protocol`].
pub trait SealedProtocol {}
/// Seal of [`Message`].
pub trait SealedMessage<P> {}
/// Seal of [`Tell`](crate::Tell).
pub trait SealedTell<P> {}
/// Seal of [`Ask`](crate::Ask).
pub trait SealedAsk<P> {}

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

/// The typed message and its reply slot, behind one allocation.
struct Typed<M, R> {
    msg: M,
    reply: Option<oneshot::Sender<ShardingResult<R>>>,
}

/// A message on its way to a local entity: the typed value itself, never
/// serialized, with the reply sender for an ask.
pub struct LocalEnvelope {
    index: u16,
    body: Box<dyn Any + Send>,
    fail: fn(Box<dyn Any + Send>, ShardingError),
}

impl std::fmt::Debug for LocalEnvelope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEnvelope")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl LocalEnvelope {
    pub(crate) fn new<P: Protocol, M: Message<P>>(
        msg: M,
        reply: Option<oneshot::Sender<ShardingResult<M::Reply>>>,
    ) -> Self {
        LocalEnvelope {
            index: M::INDEX,
            body: Box::new(Typed::<M, M::Reply> { msg, reply }),
            fail: fail_typed::<M, M::Reply>,
        }
    }

    /// The message's index in its protocol.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// Answers the sender (if it asked) with `error`; the message is dropped.
    pub(crate) fn fail(self, error: ShardingError) {
        (self.fail)(self.body, error)
    }
}

fn fail_typed<M: 'static, R: 'static>(body: Box<dyn Any + Send>, error: ShardingError) {
    if let Ok(typed) = body.downcast::<Typed<M, R>>()
        && let Some(reply) = typed.reply
    {
        let _ = reply.send(Err(error));
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
        let index = envelope.index;
        envelope.fail(ShardingError::Bug(format!(
            "message index {index} is not in the protocol"
        )));
        Outcome(OutcomeKind::Unknown)
    }
}

/// Handles one envelope known to carry `M`: runs the handler, catches a panic,
/// and answers the asker.
pub async fn handle_local<P, E, M>(
    entity: &mut E,
    envelope: LocalEnvelope,
    ctx: &EntityContext,
) -> Outcome
where
    P: Protocol,
    E: Entity<Protocol = P> + Handler<M>,
    M: Message<P>,
{
    let typed = match envelope.body.downcast::<Typed<M, M::Reply>>() {
        Ok(typed) => *typed,
        Err(body) => {
            (envelope.fail)(
                body,
                ShardingError::Bug("envelope type does not match its index".into()),
            );
            return Outcome(OutcomeKind::Unknown);
        }
    };
    let Typed { msg, reply } = typed;
    // The whole call sits inside the guarded future, so a panic before
    // `handle` returns its future is caught too.
    match AssertUnwindSafe(async move { entity.handle(msg, ctx).await })
        .catch_unwind()
        .await
    {
        Ok(result) => {
            match (reply, result) {
                (Some(reply), result) => {
                    let _ = reply.send(result);
                }
                (None, Err(error)) => {
                    tracing::warn!(type_name = ctx.type_name(), entity_id = ctx.entity_id(), %error, "tell handler failed");
                }
                (None, Ok(_)) => {}
            }
            Outcome(OutcomeKind::Handled)
        }
        Err(payload) => {
            let panic = panic_message(payload.as_ref());
            if let Some(reply) = reply {
                let _ = reply.send(Err(ShardingError::EntityPanicked {
                    type_name: ctx.type_name(),
                    entity_id: ctx.entity_id().to_owned(),
                    panic: panic.clone(),
                }));
            }
            Outcome(OutcomeKind::Panicked(panic))
        }
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
