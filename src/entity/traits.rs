//! The traits an entity type implements — `Entity`, and `Handler` or
//! `DeferredHandler` for each message of its protocol — and the
//! `ReplyPort` through which a deferred handler answers an ask.

use std::future::Future;
use std::sync::Arc;

use super::EntityContext;
use crate::model::error::ShardingResult;
use crate::model::protocol::{Message, Protocol};

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
/// system.entity_type::<EchoEntity>().register(|_| EchoEntity).await?;
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
    reply: Option<crate::model::envelope::ReplyTo<R>>,
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
    pub(crate) fn new(reply: crate::model::envelope::ReplyTo<R>, ctx: &EntityContext) -> Self {
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
