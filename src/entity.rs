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
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::ShardingResult;
use crate::extractor::ShardId;
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
    /// dropped unanswered — or lost with a panicking handler — answers
    /// [`ShardingError::EntityStopped`](crate::ShardingError::EntityStopped).
    /// An `Err` returned here is logged, not sent.
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
#[must_use = "dropping a ReplyPort answers the asker with EntityStopped"]
pub struct ReplyPort<R> {
    reply: crate::envelope::ReplyTo<R>,
}

impl<R> std::fmt::Debug for ReplyPort<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyPort").finish_non_exhaustive()
    }
}

impl<R: serde::Serialize + Send + 'static> ReplyPort<R> {
    pub(crate) fn new(reply: crate::envelope::ReplyTo<R>) -> Self {
        ReplyPort { reply }
    }

    /// Sends the reply.
    pub fn send(self, reply: R) {
        self.reply.answer(Ok(reply));
    }

    /// Answers with an error instead (for example `ShardingError::Handler`).
    pub fn fail(self, error: crate::ShardingError) {
        self.reply.answer(Err(error));
    }
}

/// Where an entity lives, given to its factory and to every handler.
#[derive(Debug)]
pub struct EntityContext {
    type_name: &'static str,
    entity_id: Arc<str>,
    shard_id: ShardId,
    node: Option<crate::identity::UniqueAddress>,
    passivate: AtomicBool,
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
            passivate: AtomicBool::new(false),
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
}
