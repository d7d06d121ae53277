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

/// Where an entity lives, given to its factory and to every handler.
#[derive(Debug)]
pub struct EntityContext {
    type_name: &'static str,
    entity_id: Arc<str>,
    shard_id: ShardId,
    passivate: AtomicBool,
}

impl EntityContext {
    pub(crate) fn new(type_name: &'static str, entity_id: Arc<str>, shard_id: ShardId) -> Self {
        EntityContext {
            type_name,
            entity_id,
            shard_id,
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
