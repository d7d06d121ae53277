//! One shard's slot in its region, as a plain state machine.
//!
//! A [`Slot`] holds everything the region knows of one shard — no home yet
//! (messages wait), hosted here (its entities, passivations, a handoff in
//! progress, remembered ids still to respawn), hosted elsewhere, or stopped
//! — and decides every transition itself. What a transition does outside
//! the slot (spawn an entity, enqueue into its mailbox, record in the
//! remember-entities store, forward to another node, ask for an
//! allocation, report a stopped shard) goes through a [`SlotHost`], called
//! synchronously: the region calls the slot under the shard's lock, so
//! every send still happens under that lock, and a host is a reference to
//! the region, so the local path costs no extra hop.
//!
//! Messages that cannot be delivered come back to the caller
//! ([`Undelivered`]), to be answered once the lock is released (an
//! envelope's answer may run user `Drop` code). Unit tests drive a slot
//! with a host that records its calls (`tests.rs`).

mod handoff;
mod homes;
mod host;
mod hosting;
mod limit;
mod passivating;
mod report;
mod routing;
mod stop;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

pub use host::ShardHome;
pub(crate) use host::{HomeChange, Refused, SlotHost, Undelivered};

use super::mailbox::States;
use super::passivation::Passivator;
use crate::entity::MigratedState;
use crate::model::envelope::LocalEnvelope;
use crate::model::error::ShardingError;
use crate::model::extractor::ShardId;

/// Something waiting in a buffer: a message, or a passivation request that
/// must take effect after the messages buffered before it.
pub(crate) enum Buffered {
    Message(Arc<str>, LocalEnvelope),
    Passivate(Arc<str>),
}

/// One shard's slot in its region: its state, and what outlives a hosting.
pub(crate) struct Slot<E> {
    state: State<E>,
    /// Numbers the incarnations of the shard's entities across its
    /// hostings here, so that a stop notice of an earlier hosting's
    /// incarnation is never taken for a later one's.
    last_incarnation: u64,
    /// Entities of an earlier hosting that moved away without a handoff,
    /// finishing their mailboxes (each stops after it). Should the shard
    /// come back here first, a message for one waits until it has stopped:
    /// two incarnations of an entity never run side by side on this node.
    finishing: HashMap<Arc<str>, Live<E>>,
    /// The states a handoff took from the shard's entities, when the shard
    /// moved on to another node: for the region to keep for that node
    /// ([`take_outgoing`](Self::take_outgoing)).
    outgoing: Option<(ShardHome, States)>,
}

/// One shard's state in its region.
enum State<E> {
    /// No home yet: messages wait here until the shard is allocated.
    Unallocated {
        buffer: Vec<Buffered>,
        requested: bool,
        /// The highest allocation generation seen for the shard.
        generation: u64,
        /// The coordinator allocated the shard here under `generation`,
        /// and the region is installing it (pulling migrated states
        /// first): it is this node's, and the replica says so.
        installing: bool,
    },
    /// Hosted on this node (boxed: a slot that hosts nothing stays small,
    /// and a region holds one per shard).
    Local(Box<LocalShard<E>>),
    /// Hosted on another node: messages are encoded and sent there.
    Remote(ShardHome),
    /// The system shut down.
    Stopped,
}

impl<E> State<E> {
    fn unallocated(generation: u64) -> Self {
        State::Unallocated {
            buffer: Vec::new(),
            requested: false,
            generation,
            installing: false,
        }
    }
}

struct LocalShard<E> {
    /// The allocation generation this node hosts the shard under (0 on a
    /// single node).
    generation: u64,
    entities: HashMap<Arc<str>, Entry<E>>,
    /// The last incarnation started (the slot's count, while hosted); a
    /// stop notice or passivation request names the incarnation it is about.
    last_incarnation: u64,
    /// Tells this hosting of the shard from a later one (respawn batches
    /// belong to the hosting that listed them).
    install: u64,
    /// Remembered ids listed at start and not respawned yet; an id leaves
    /// it when a message spawns it or it is passivated.
    pending_respawn: HashSet<Arc<str>>,
    /// Set while the shard is handed off to another node.
    handoff: Option<HandingOff>,
    /// Of a type with an active-entity limit: the live entities, in the
    /// policy's order.
    passivator: Option<Box<Passivator>>,
    /// States migrated with the shard (or handed over by its entities
    /// stopping for a handoff) for ids not running here: the next
    /// incarnation of each starts from its state. Taken whole when the
    /// shard moves on to another node.
    migrated: HashMap<Arc<str>, MigratedState>,
}

/// A hosted shard being handed off: its entities stop (each after its
/// mailbox), and what arrives for the shard meanwhile waits here, in
/// order, for its next home.
struct HandingOff {
    buffer: Vec<Buffered>,
    /// `ShardStopped` was sent for the current stop (entities all gone).
    reported: bool,
    /// Of a remembered type: the ids that were live or waiting to be
    /// respawned when the handoff began (the store still lists them), to be
    /// respawned here should the shard stay.
    respawn: HashSet<Arc<str>>,
    /// Entities whose passivation was asked for while they stopped to
    /// move: the state they hand over is dropped, as a passivation drops it.
    passivated: HashSet<Arc<str>>,
}

/// One incarnation of an entity.
struct Live<E> {
    actor: E,
    incarnation: u64,
}

enum Entry<E> {
    /// Messages go straight to its mailbox.
    Live(Live<E>),
    /// Stopping after what its mailbox holds; later messages wait here.
    /// `earlier`: an incarnation of an earlier hosting, finishing the
    /// mailbox it had when its shard moved away (a stopping region lets it
    /// finish rather than stop it after the message in hand).
    Passivating {
        live: Live<E>,
        buffer: Vec<Buffered>,
        earlier: bool,
    },
}

impl<E> Entry<E> {
    fn incarnation(&self) -> u64 {
        match self {
            Entry::Live(live) | Entry::Passivating { live, .. } => live.incarnation,
        }
    }
}

fn overflow<H: SlotHost + ?Sized>(host: &H, shard: ShardId) -> ShardingError {
    ShardingError::BufferOverflow {
        type_name: host.type_name(),
        shard_id: shard,
    }
}

/// The messages of a buffer, without its passivation requests.
fn messages(buffer: Vec<Buffered>) -> impl Iterator<Item = LocalEnvelope> {
    buffer.into_iter().filter_map(|item| match item {
        Buffered::Message(_, envelope) => Some(envelope),
        Buffered::Passivate(_) => None,
    })
}

/// Whether a message for `entity_id` waits in `buffer`.
fn waits_in(buffer: &[Buffered], entity_id: &Arc<str>) -> bool {
    buffer
        .iter()
        .any(|b| matches!(b, Buffered::Message(id, _) if id == entity_id))
}

fn refused() -> ShardingError {
    ShardingError::Bug("an entity mailbox refused an envelope without giving it back".into())
}

impl<E: Clone> Slot<E> {
    /// A slot with no home, that has seen `generation`.
    pub(crate) fn unallocated(generation: u64) -> Self {
        Slot {
            state: State::unallocated(generation),
            last_incarnation: 0,
            finishing: HashMap::new(),
            outgoing: None,
        }
    }

    /// Whether the region has stopped this slot.
    pub(crate) fn is_stopped(&self) -> bool {
        matches!(self.state, State::Stopped)
    }

    /// The highest allocation generation the slot has seen.
    pub(crate) fn generation(&self) -> u64 {
        match &self.state {
            State::Unallocated { generation, .. } => *generation,
            State::Local(local) => local.generation,
            State::Remote(home) => home.generation,
            State::Stopped => u64::MAX,
        }
    }
}

#[cfg(test)]
mod tests;
