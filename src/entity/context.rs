//! `EntityContext`: where an entity lives (its type, id, shard and node),
//! given to its factory and to every handler. What it does for reliable
//! delivery and for persistence is in the other files of this module.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use super::{Deliveries, JournalHandle, StateHandle};
use crate::model::extractor::ShardId;

/// Where an entity lives, given to its factory and to every handler.
#[derive(Debug)]
pub struct EntityContext {
    pub(super) type_name: &'static str,
    pub(super) entity_id: Arc<str>,
    shard_id: ShardId,
    pub(super) node: Option<crate::model::identity::UniqueAddress>,
    /// The allocation generation of the shard's hosting (0 on one node).
    pub(crate) generation: u64,
    passivate: AtomicBool,
    /// Of an event-sourced entity: its journal.
    pub(crate) journal: Option<JournalHandle>,
    /// Of a durable-state entity: its state store.
    pub(super) state: Option<StateHandle>,
    /// What reliable producers' messages did here (SPEC §13.17).
    pub(super) deliveries: std::sync::Mutex<Deliveries>,
    /// The deadline of the ask being handled: the store calls it causes
    /// end before it (see [`CallDeadline`](super::CallDeadline)). `None`
    /// for a tell, an ask from another node, or no message — and during a
    /// recovery, which serves every message waiting for it, not one ask.
    pub(super) deadline: Option<tokio::time::Instant>,
    /// A write was accepted while the message being handled was (reset
    /// with `deadline` for each message): a later write's error then says
    /// the message was processed in part.
    pub(super) wrote: AtomicBool,
    /// How many of this entity's writes in a row were refused by a
    /// conflict (kept across its restarts in place; reset by an accepted
    /// write): the pause before the next restart grows with it.
    pub(super) conflicts: AtomicU32,
}

impl EntityContext {
    pub(crate) fn new(
        type_name: &'static str,
        entity_id: Arc<str>,
        shard_id: ShardId,
        node: Option<crate::model::identity::UniqueAddress>,
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
    pub fn node(&self) -> Option<crate::model::identity::UniqueAddress> {
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
