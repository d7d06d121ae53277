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
//! with a host that records its calls (`slot_tests.rs`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::mailbox::States;
use super::passivation::Passivator;
use crate::config::PassivationPolicy;
use crate::entity::MigratedState;
use crate::envelope::LocalEnvelope;
use crate::error::{ShardingError, ShardingResult};
use crate::extractor::ShardId;
use crate::identity::UniqueAddress;
use crate::store::RememberEntitiesOperation;

/// Where a shard lives, and which allocation of it this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardHome {
    /// The node that hosts the shard.
    pub owner: UniqueAddress,
    /// The allocation generation: grows with every allocation of the shard.
    pub generation: u64,
}

/// What a slot's transitions do outside the slot. `Entity` is a handle on
/// one incarnation's mailbox.
pub(crate) trait SlotHost {
    /// One incarnation's mailbox.
    type Entity: Clone;

    /// The entity type's name, for errors and logs.
    fn type_name(&self) -> &'static str;
    /// How many messages a buffer holds before it overflows.
    fn buffer_cap(&self) -> usize;
    /// Whether the coordinator refused the region (cheap: an atomic load).
    fn refused(&self) -> bool;
    /// Why it refused the region.
    fn refusal(&self) -> Option<ShardingError>;
    /// Whether the type remembers its entities.
    fn remembers(&self) -> bool;
    /// The store's state for `shard`: an error under FailClosed after a
    /// failed write.
    fn check_store(&self, shard: ShardId) -> ShardingResult<()>;
    /// Starts incarnation `incarnation` of `entity_id`, in the shard's
    /// hosting of allocation `generation` (its stop notice and passivation
    /// requests come back to the slot, naming it), from `state` if one
    /// migrated with the shard.
    fn spawn(
        &mut self,
        shard: ShardId,
        generation: u64,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> ShardingResult<Self::Entity>;
    /// Enqueues into a mailbox. `Err(Some)` gives the envelope back (the
    /// entity is gone); `Err(None)`: the mailbox dropped it.
    fn send(
        &mut self,
        entity: &Self::Entity,
        envelope: LocalEnvelope,
    ) -> Result<(), Option<LocalEnvelope>>;
    /// Queues a stop marker behind the mailbox; false if the entity is gone.
    fn stop(&mut self, entity: &Self::Entity) -> bool;
    /// As [`stop`](Self::stop), for a handoff: a migratable entity hands
    /// its state over with its stop notice.
    fn stop_to_move(&mut self, entity: &Self::Entity) -> bool;
    /// Queues a record for the remember-entities store (nothing for a type
    /// that does not remember).
    fn record(&mut self, shard: ShardId, entity_id: &Arc<str>, op: RememberEntitiesOperation);
    /// How many remembered ids one respawn batch starts.
    fn respawn_batch(&self) -> usize;
    /// Has [`Slot::respawn_more`] called for `install` after the respawn
    /// interval.
    fn respawn_later(&mut self, shard: ShardId, install: u64);
    /// Sends an envelope to the shard's home on another node. On
    /// `Err((_, None))` the envelope has been answered already.
    fn forward(
        &mut self,
        home: ShardHome,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), (ShardingError, Option<LocalEnvelope>)>;
    /// Sends a passivation request to the node hosting the shard.
    fn passivate_at(
        &mut self,
        owner: UniqueAddress,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<()>;
    /// Asks for the shard's allocation; false if it could not be asked (the
    /// next message asks again).
    fn request_allocation(&mut self, shard: ShardId) -> bool;
    /// Reports that a handed-off shard has no entity left.
    fn shard_stopped(&mut self, shard: ShardId, generation: u64);
    /// Of a type with an active-entity limit: each hosted shard's share of
    /// it now, and the policy.
    fn entity_share(&self) -> Option<(usize, PassivationPolicy)>;
    /// A live entity began passivating: `by_limit` to keep its shard
    /// within its share, else on a request (the host knows whose).
    fn passivated(&mut self, shard: ShardId, by_limit: bool);
}

/// Something waiting in a buffer: a message, or a passivation request that
/// must take effect after the messages buffered before it.
pub(crate) enum Buffered {
    Message(Arc<str>, LocalEnvelope),
    Passivate(Arc<str>),
}

/// Messages that could not be delivered, to be failed once the lock is released.
pub(crate) type Undelivered = Vec<(ShardingError, LocalEnvelope)>;

/// A delivery's failure: the error, and the envelope unless it has been
/// answered already.
pub(crate) type Refused = (ShardingError, Option<LocalEnvelope>);

/// What applying a shard's home did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HomeChange {
    /// Nothing to do: known already.
    Unchanged,
    /// Older than what the region holds: ignored.
    Stale,
    /// Now routed to another node.
    Remote,
    /// This node is the new home: the region actor must start the shard
    /// (messages buffer meanwhile).
    HostHere,
}

/// How far ahead of a slot's generation an envelope's may be and still be
/// believed (allocations are one generation each; a real lead is small).
const MAX_GENERATION_LEAD: u64 = 1 << 20;

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

/// What the region reports of one slot (`ShardRegionState`).
#[derive(Default)]
pub(crate) struct SlotSummary {
    /// Hosted here, with this many live entities.
    pub(crate) hosted: Option<usize>,
    pub(crate) handing_off: bool,
    /// Hosted here with remembered ids still to respawn.
    pub(crate) respawning: bool,
    /// Messages waiting in the slot's buffers.
    pub(crate) buffered: usize,
    /// The part of `buffered` waiting behind a handoff.
    pub(crate) handoff_buffered: usize,
    /// Where the slot knows the shard lives: here (`None` inside), on
    /// another node, or nowhere yet (the outer `None`); with the
    /// allocation generation it knows.
    pub(crate) home: Option<(Option<UniqueAddress>, u64)>,
}

/// What a stopping region takes out of a slot.
pub(crate) struct Taken<E> {
    /// The hosted shard's entities, to stop.
    pub(crate) entities: Vec<E>,
    /// Entities of an earlier hosting finishing their mailboxes, to wait for.
    pub(crate) finishing: Vec<E>,
    /// Messages that waited in buffers, to fail.
    pub(crate) buffered: Vec<LocalEnvelope>,
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

    /// Routes one envelope to `entity_id`. On error the envelope was not
    /// accepted (the caller answers it, outside the lock).
    pub(crate) fn deliver<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), Refused> {
        match &mut self.state {
            State::Local(local) => local.deliver(host, shard, entity_id, envelope),
            // Refused by the coordinator: no home will come for what would
            // wait for one (checked under the slot's lock, which `refuse`
            // drains each buffer under, so nothing slips in behind it).
            State::Unallocated { .. } | State::Remote(_) if host.refused() => Err((
                host.refusal().unwrap_or_else(|| overflow(host, shard)),
                Some(envelope),
            )),
            // (A generation absurdly far ahead is a sender's bug, not news:
            // it is forwarded as usual rather than stall the shard.)
            State::Remote(home)
                if envelope.routed_under() > home.generation
                    && envelope.routed_under() - home.generation <= MAX_GENERATION_LEAD =>
            {
                // The sender knows a newer allocation than this node (the
                // coordinator's word on it is on its way here): wait for it
                // rather than forward along an older table. An older home
                // arriving meanwhile is then ignored as stale.
                let generation = envelope.routed_under();
                let requested = host.request_allocation(shard);
                self.state = State::Unallocated {
                    buffer: vec![Buffered::Message(entity_id.clone(), envelope)],
                    requested,
                    generation,
                };
                Ok(())
            }
            State::Remote(home) => host.forward(*home, shard, entity_id, envelope),
            State::Unallocated {
                buffer, requested, ..
            } => {
                if buffer.len() >= host.buffer_cap() {
                    return Err((overflow(host, shard), Some(envelope)));
                }
                buffer.push(Buffered::Message(entity_id.clone(), envelope));
                if !*requested {
                    *requested = host.request_allocation(shard);
                }
                Ok(())
            }
            State::Stopped => Err((ShardingError::ShuttingDown, Some(envelope))),
        }
    }

    /// The fast path of a remote envelope: straight into the mailbox of a
    /// live entity of a hosted shard. Gives the envelope back for anything
    /// else (which then takes [`deliver`](Self::deliver)).
    pub(crate) fn deliver_live<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &str,
        envelope: LocalEnvelope,
    ) -> Result<Result<(), ShardingError>, LocalEnvelope> {
        let State::Local(local) = &mut self.state else {
            return Err(envelope);
        };
        // (A shard failed under FailClosed takes the general way, which
        // refuses the message.)
        if host.remembers() && host.check_store(shard).is_err() {
            return Err(envelope);
        }
        match local.entities.get(entity_id) {
            Some(Entry::Live(live)) => match host.send(&live.actor, envelope) {
                Ok(()) => {
                    local.accessed(entity_id);
                    Ok(Ok(()))
                }
                Err(Some(envelope)) => Err(envelope),
                Err(None) => Ok(Err(refused())),
            },
            _ => Err(envelope),
        }
    }

    /// Makes the shard local (hosting number `install`), starts each
    /// entity whose state `migrated` with the shard from it, starts
    /// respawning `remembered` and replays the buffer in order. `None`
    /// (and the slot left as it was) when a newer home arrived meanwhile,
    /// the shard is local already or the region stopped. An entity of an
    /// earlier hosting still finishing its mailbox is taken in as
    /// passivating: what comes for it waits until it has stopped.
    pub(crate) fn install<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        generation: u64,
        install: u64,
        remembered: Option<Vec<String>>,
        migrated: States,
    ) -> Option<Undelivered> {
        if self.generation() > generation {
            return None;
        }
        let buffer = match &mut self.state {
            State::Unallocated { buffer, .. } => std::mem::take(buffer),
            State::Remote(_) => Vec::new(),
            State::Local(_) | State::Stopped => return None,
        };
        let entities = self
            .finishing
            .drain()
            .map(|(id, live)| {
                let entry = Entry::Passivating {
                    live,
                    buffer: Vec::new(),
                    earlier: true,
                };
                (id, entry)
            })
            .collect();
        let mut local = LocalShard {
            generation,
            entities,
            last_incarnation: self.last_incarnation,
            install,
            pending_respawn: HashSet::new(),
            handoff: None,
            passivator: host
                .entity_share()
                .map(|(share, policy)| Box::new(Passivator::new(policy, share))),
            migrated: migrated.into_iter().collect(),
        };
        if let Some(ids) = remembered {
            local.pending_respawn = ids.into_iter().map(Arc::<str>::from).collect();
        }
        // The migrated entities were live on their old owner: they start
        // at once, each from its state, before any message.
        local.start_migrated(host, shard);
        if !local.pending_respawn.is_empty() {
            local.respawn_batch(host, shard);
        }
        let undelivered = local.replay(host, shard, buffer);
        self.state = State::Local(Box::new(local));
        Some(undelivered)
    }

    /// The region actor's turn to respawn more remembered ids, if the slot
    /// is still the hosting `install`.
    pub(crate) fn respawn_more<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        install: u64,
    ) {
        if let State::Local(local) = &mut self.state
            && local.install == install
        {
            local.respawn_batch(host, shard);
        }
    }

    /// The region's shards changed: a hosted shard's share of the
    /// active-entity limit is now `share`.
    pub(crate) fn reshare<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        share: usize,
    ) {
        if let State::Local(local) = &mut self.state {
            local.reshare(host, shard, share);
        }
    }

    /// Asks for an allocation unless one is asked for already (a shard with
    /// remembered entities, at registration).
    pub(crate) fn request_if_idle<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
    ) {
        if let State::Unallocated { requested, .. } = &mut self.state
            && !*requested
        {
            *requested = host.request_allocation(shard);
        }
    }

    /// Passivates `entity_id` — only `incarnation` if one is named (a request
    /// from the entity itself), else whichever is current. While the entity's
    /// messages still wait in a buffer (shard not yet allocated, or entity
    /// already passivating), the request is buffered behind them. A request
    /// `from_remote` (another node sent it here) is not sent on again when
    /// the shard is not hosted here, so two disagreeing tables cannot bounce
    /// it between them.
    pub(crate) fn passivate<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        from_remote: bool,
    ) -> (ShardingResult<()>, Undelivered) {
        match &mut self.state {
            State::Unallocated { buffer, .. } => {
                let result = if !waits_in(buffer, entity_id) {
                    Ok(())
                } else if buffer.len() >= host.buffer_cap() {
                    Err(overflow(host, shard))
                } else {
                    buffer.push(Buffered::Passivate(entity_id.clone()));
                    Ok(())
                };
                (result, Vec::new())
            }
            State::Local(local) => local.passivate(host, shard, entity_id, incarnation, false),
            State::Remote(_) if from_remote => (Ok(()), Vec::new()),
            // A request from an entity's own incarnation is always local.
            State::Remote(home) if incarnation.is_none() => {
                (host.passivate_at(home.owner, shard, entity_id), Vec::new())
            }
            State::Remote(_) => (Ok(()), Vec::new()),
            State::Stopped => (Err(ShardingError::ShuttingDown), Vec::new()),
        }
    }

    /// Incarnation `incarnation` of `entity_id` stopped (its stop notice):
    /// finish its passivation by replaying what waited, or forget a crashed
    /// incarnation. `state`: the one it handed over, stopped to move, kept
    /// for its next incarnation wherever the shard goes (dropped when the
    /// shard has moved on without it: a move that did not wait for it).
    pub(crate) fn entity_stopped<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> Undelivered {
        match &mut self.state {
            State::Local(local) => local.stopped(host, shard, entity_id, incarnation, state),
            _ => {
                if state.is_some() {
                    tracing::debug!(type_name = host.type_name(), %shard, %entity_id, "a state handed over after its shard moved on is dropped");
                }
                if self
                    .finishing
                    .get(entity_id)
                    .is_some_and(|live| live.incarnation == incarnation)
                {
                    self.finishing.remove(entity_id);
                }
                Vec::new()
            }
        }
    }

    /// The coordinator moves the shard, hosted here under `generation`:
    /// every entity stops after what its mailbox holds (its remembered
    /// state stays, for the next home to respawn), and what arrives
    /// meanwhile is buffered. When the last entity has stopped the host
    /// hears `shard_stopped`. A request for another generation, or for a
    /// shard not hosted here yet (it is starting), is ignored; the
    /// coordinator asks again.
    pub(crate) fn hand_off<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        generation: u64,
    ) {
        let State::Local(local) = &mut self.state else {
            return;
        };
        if local.generation != generation {
            return;
        }
        match &mut local.handoff {
            // Asked again: the report may have been lost.
            Some(handoff) => handoff.reported = false,
            None => {
                let mut buffer = Vec::new();
                let mut respawn = std::mem::take(&mut local.pending_respawn);
                for (id, entry) in local.entities.iter_mut() {
                    match entry {
                        Entry::Live(live) => {
                            // Under the lock: nothing can be enqueued behind
                            // the stop marker, as for a passivation; from now
                            // on the handoff buffer takes what comes.
                            let live = Live {
                                actor: live.actor.clone(),
                                incarnation: live.incarnation,
                            };
                            if !host.stop_to_move(&live.actor) {
                                tracing::debug!(type_name = host.type_name(), %shard, "entity gone before its handoff stop");
                            }
                            respawn.insert(id.clone());
                            *entry = Entry::Passivating {
                                live,
                                buffer: Vec::new(),
                                earlier: false,
                            };
                        }
                        // What waited behind a passivation comes first.
                        Entry::Passivating {
                            buffer: waiting, ..
                        } => buffer.append(waiting),
                    }
                }
                if !host.remembers() {
                    respawn.clear();
                }
                if let Some(passivator) = &mut local.passivator {
                    passivator.clear(); // every entity is stopping
                }
                local.handoff = Some(HandingOff {
                    buffer,
                    reported: false,
                    respawn,
                    passivated: HashSet::new(),
                });
            }
        }
        local.report_if_stopped(host, shard);
    }

    /// Whether the shard is hosted here under `generation`, handed off and
    /// empty: its `ShardStopped` still needs an answer.
    pub(crate) fn is_handed_off(&self, generation: u64) -> bool {
        matches!(&self.state, State::Local(local)
            if local.generation == generation && local.is_stopped())
    }

    /// Whether the shard is hosted here, handed off, with every entity
    /// stopped: it hosts nothing and waits for its next home.
    pub(crate) fn is_stopped_here(&self) -> bool {
        matches!(&self.state, State::Local(local) if local.is_stopped())
    }

    /// Applies a home from the coordinator, `me` being this node (`proxy`:
    /// its region routes only, and takes no shard). A home
    /// older than what the slot holds is ignored. Becoming remote sends the
    /// buffered messages on, in order; a shard that was hosted here stops
    /// its entities (each after its mailbox: they are kept as finishing
    /// until their stop notices come) and routes on.
    pub(crate) fn set_home<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        home: ShardHome,
        me: UniqueAddress,
        proxy: bool,
    ) -> (HomeChange, Undelivered) {
        if matches!(&self.state, State::Stopped) {
            return (HomeChange::Unchanged, Vec::new());
        }
        if home.generation < self.generation() {
            return (HomeChange::Stale, Vec::new());
        }
        if home.owner == me && proxy {
            tracing::error!(type_name = host.type_name(), %shard, "a proxy-only region was given a shard; ignored");
            return (HomeChange::Unchanged, Vec::new());
        }
        if home.owner == me {
            let mut undelivered = Vec::new();
            let change = match &mut self.state {
                State::Local(local) => {
                    let moved_back = home.generation > local.generation;
                    local.generation = home.generation;
                    if moved_back {
                        // The shard was being handed off, and its new home
                        // is here after all.
                        undelivered = local.resume(host, shard);
                    }
                    HomeChange::Unchanged
                }
                State::Unallocated { generation, .. } => {
                    *generation = home.generation;
                    HomeChange::HostHere
                }
                State::Remote(_) => {
                    self.state = State::Unallocated {
                        buffer: Vec::new(),
                        requested: true,
                        generation: home.generation,
                    };
                    HomeChange::HostHere
                }
                State::Stopped => HomeChange::Unchanged,
            };
            return (change, undelivered);
        }
        let previous = std::mem::replace(&mut self.state, State::Remote(home));
        let buffer = match previous {
            State::Unallocated { buffer, .. } => buffer,
            State::Local(mut local) => {
                let mut buffer = Vec::new();
                // What waited behind passivations came before what arrived
                // during a handoff (which took those buffers when it began).
                // Handed off with every entity stopped (reported to the
                // coordinator): the states wait for the new home to fetch.
                let stopped = local.is_stopped();
                let handed_off = local.handoff.take().map(|h| h.buffer);
                for (id, entry) in local.entities {
                    let live = match entry {
                        Entry::Live(live) => {
                            // Under the lock: nothing is enqueued behind it.
                            host.stop(&live.actor);
                            live
                        }
                        Entry::Passivating {
                            live,
                            buffer: waiting,
                            ..
                        } => {
                            buffer.extend(waiting);
                            live
                        }
                    };
                    self.finishing.insert(id, live);
                }
                self.last_incarnation = local.last_incarnation;
                buffer.extend(handed_off.into_iter().flatten());
                if stopped {
                    self.outgoing = Some((home, local.migrated.into_iter().collect()));
                }
                buffer
            }
            State::Remote(_) | State::Stopped => Vec::new(),
        };
        let mut undelivered = Vec::new();
        for item in buffer {
            match item {
                Buffered::Message(entity_id, envelope) => {
                    if let Err((error, Some(envelope))) =
                        host.forward(home, shard, &entity_id, envelope)
                    {
                        undelivered.push((error, envelope));
                    }
                }
                Buffered::Passivate(entity_id) => {
                    let _ = host.passivate_at(home.owner, shard, &entity_id);
                }
            }
        }
        (HomeChange::Remote, undelivered)
    }

    /// Whether the shard is hosted here, handed off and stopped, with states
    /// its entities handed over that have not moved on yet.
    pub(crate) fn holds_states(&self) -> bool {
        matches!(&self.state, State::Local(local) if local.is_stopped() && !local.migrated.is_empty())
    }

    /// Drops the states kept here for the shard's entities (a newer state
    /// is elsewhere), and those its entities still stopping would hand
    /// over (they are taken as an earlier hosting's): their next
    /// incarnations start from the factory. How many were dropped.
    pub(crate) fn drop_states(&mut self) -> usize {
        let State::Local(local) = &mut self.state else {
            return 0;
        };
        for entry in local.entities.values_mut() {
            if let Entry::Passivating { earlier, .. } = entry {
                *earlier = true;
            }
        }
        std::mem::take(&mut local.migrated).len()
    }

    /// The states the shard's entities handed over, with the home the
    /// shard moved to, once it has moved on (see
    /// [`set_home`](Self::set_home)).
    pub(crate) fn take_outgoing(&mut self) -> Option<(ShardHome, States)> {
        self.outgoing.take()
    }

    /// `node` is gone: a shard routed to it waits for a new home (the next
    /// message asks). Whether it was routed there.
    pub(crate) fn node_lost(&mut self, node: &UniqueAddress) -> bool {
        if let State::Remote(home) = &mut self.state
            && home.owner == *node
        {
            self.state = State::unallocated(home.generation);
            return true;
        }
        false
    }

    /// The coordinator refused the region: what waits for a home is given
    /// back (to be failed), and the next message asks again.
    pub(crate) fn drain_refused(&mut self) -> Vec<LocalEnvelope> {
        let State::Unallocated {
            buffer, requested, ..
        } = &mut self.state
        else {
            return Vec::new();
        };
        *requested = false;
        messages(std::mem::take(buffer)).collect()
    }

    /// A new coordinator: a handoff it did not ask for, that has not
    /// reported the shard stopped yet, is called off (the shard stays here
    /// and what waited is delivered here). A reported one goes on.
    pub(crate) fn call_off_handoff<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
    ) -> Undelivered {
        match &mut self.state {
            State::Local(local) if local.handoff.as_ref().is_some_and(|h| !h.reported) => {
                local.resume(host, shard)
            }
            _ => Vec::new(),
        }
    }

    /// The home of this slot, `me` standing for a shard hosted here.
    pub(crate) fn home(&self, me: Option<UniqueAddress>) -> Option<ShardHome> {
        match &self.state {
            State::Remote(home) => Some(*home),
            State::Local(local) => me.map(|owner| ShardHome {
                owner,
                generation: local.generation,
            }),
            _ => None,
        }
    }

    pub(crate) fn is_local(&self) -> bool {
        matches!(&self.state, State::Local(_))
    }

    /// Number of live (not passivating) entities.
    pub(crate) fn live_entities(&self) -> usize {
        match &self.state {
            State::Local(local) => local
                .entities
                .values()
                .filter(|e| matches!(e, Entry::Live(_)))
                .count(),
            _ => 0,
        }
    }

    /// Of a hosted shard: the `limit` least ids of its live (not
    /// passivating) entities, in no order, and whether it has more; `None`
    /// for a shard not hosted here.
    ///
    /// One walk over the entities, as counting them makes, keeping the
    /// least ids seen in a heap of at most `limit`: a shard's lock is held
    /// about as long for its ids as for its count (a comparison more per
    /// entity, and `limit` reference counts), never for a sort or a copy
    /// of the text, which the caller makes once the lock is released.
    pub(crate) fn least_live_ids(&self, limit: usize) -> Option<(Vec<Arc<str>>, bool)> {
        let State::Local(local) = &self.state else {
            return None;
        };
        let mut least: std::collections::BinaryHeap<&Arc<str>> =
            std::collections::BinaryHeap::with_capacity(limit.min(local.entities.len()));
        let mut more = false;
        for (id, entry) in &local.entities {
            if !matches!(entry, Entry::Live(_)) {
                continue;
            }
            if least.len() < limit {
                least.push(id);
                continue;
            }
            more = true;
            // Full (or `limit` 0, with nothing to peek): the greatest kept
            // gives way to a lesser id.
            if let Some(mut greatest) = least.peek_mut()
                && id < *greatest
            {
                *greatest = id;
            }
        }
        Some((least.into_iter().cloned().collect(), more))
    }

    /// What the region reports of this slot.
    pub(crate) fn summary(&self) -> SlotSummary {
        let mut summary = SlotSummary::default();
        match &self.state {
            State::Unallocated { buffer, .. } => summary.buffered = buffer.len(),
            State::Remote(home) => summary.home = Some((Some(home.owner), home.generation)),
            State::Local(local) => {
                summary.home = Some((None, local.generation));
                let mut live = 0;
                for entry in local.entities.values() {
                    match entry {
                        Entry::Live(_) => live += 1,
                        Entry::Passivating { buffer, .. } => summary.buffered += buffer.len(),
                    }
                }
                if let Some(handoff) = &local.handoff {
                    summary.buffered += handoff.buffer.len();
                    summary.handoff_buffered = handoff.buffer.len();
                    summary.handing_off = true;
                }
                summary.respawning = !local.pending_respawn.is_empty();
                summary.hosted = Some(live);
            }
            State::Stopped => {}
        }
        summary
    }

    /// The region stops: the slot becomes `Stopped` and gives up its
    /// entities (hosted and finishing) and its buffered messages (to be failed
    /// with `ShuttingDown`). A remote home is kept: envelopes that still
    /// arrive are forwarded.
    pub(crate) fn take(&mut self) -> Taken<E> {
        let mut taken = Taken {
            entities: Vec::new(),
            finishing: self.finishing.drain().map(|(_, live)| live.actor).collect(),
            buffered: Vec::new(),
        };
        if matches!(&self.state, State::Remote(_)) {
            return taken;
        }
        let buffered = |buffer, into: &mut Vec<LocalEnvelope>| into.extend(messages(buffer));
        match std::mem::replace(&mut self.state, State::Stopped) {
            State::Unallocated { buffer, .. } => buffered(buffer, &mut taken.buffered),
            State::Local(mut local) => {
                if let Some(handoff) = local.handoff.take() {
                    buffered(handoff.buffer, &mut taken.buffered);
                }
                for entry in local.entities.into_values() {
                    match entry {
                        Entry::Live(live) => taken.entities.push(live.actor),
                        Entry::Passivating {
                            live,
                            buffer,
                            earlier,
                        } => {
                            if earlier {
                                taken.finishing.push(live.actor);
                            } else {
                                taken.entities.push(live.actor);
                            }
                            buffered(buffer, &mut taken.buffered);
                        }
                    }
                }
            }
            State::Remote(_) | State::Stopped => {}
        }
        taken
    }
}

impl<E: Clone> LocalShard<E> {
    /// Handed off, with every entity stopped.
    fn is_stopped(&self) -> bool {
        self.handoff.is_some() && self.entities.is_empty()
    }

    /// A live entity was sent a message.
    fn accessed(&mut self, entity_id: &str) {
        if let Some(passivator) = &mut self.passivator {
            passivator.access(entity_id);
        }
    }

    /// Before `entity_id` starts: within the shard's share of the limit
    /// (as it is now: the region's shards come and go), passivating what
    /// the policy picks to make room. An incarnation replacing a crashed
    /// one takes its place.
    fn make_room<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) {
        let Some(passivator) = &mut self.passivator else {
            return;
        };
        if passivator.contains(entity_id) {
            passivator.access(entity_id);
            return;
        }
        let share = host
            .entity_share()
            .map_or(passivator.share(), |(share, _)| share);
        let mut victims = passivator.resize(share);
        victims.extend(passivator.admit(entity_id));
        self.passivate_for_room(host, shard, victims);
    }

    /// The shard's share changed: passivates what no longer fits.
    fn reshare<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId, share: usize) {
        if self.handoff.is_some() {
            return; // every entity is stopping already
        }
        if let Some(passivator) = &mut self.passivator {
            let victims = passivator.resize(share);
            self.passivate_for_room(host, shard, victims);
        }
    }

    fn passivate_for_room<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        victims: Vec<Arc<str>>,
    ) {
        for victim in victims {
            // A live entity's passivation leaves nothing undelivered: its
            // buffer starts empty.
            let (result, undelivered) = self.passivate(host, shard, &victim, None, true);
            debug_assert!(result.is_ok() && undelivered.is_empty());
        }
    }

    /// Routing within a hosted shard: enqueue to the live entity (the
    /// common case), buffer behind a passivation or handoff, or spawn the
    /// entity (replacing a dead incarnation) and enqueue.
    fn deliver<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), Refused> {
        if host.remembers()
            && let Err(error) = host.check_store(shard)
        {
            return Err((error, Some(envelope)));
        }
        if let Some(handoff) = &mut self.handoff {
            if handoff.buffer.len() >= host.buffer_cap() {
                return Err((overflow(host, shard), Some(envelope)));
            }
            handoff
                .buffer
                .push(Buffered::Message(entity_id.clone(), envelope));
            return Ok(());
        }
        let envelope = match self.entities.get_mut(entity_id) {
            Some(Entry::Live(live)) => match host.send(&live.actor, envelope) {
                Ok(()) => {
                    self.accessed(entity_id);
                    return Ok(());
                }
                // The actor is gone without its stop notice handled yet: replace it.
                Err(Some(envelope)) => envelope,
                Err(None) => return Err((refused(), None)),
            },
            Some(Entry::Passivating { buffer, .. }) => {
                if buffer.len() >= host.buffer_cap() {
                    return Err((overflow(host, shard), Some(envelope)));
                }
                buffer.push(Buffered::Message(entity_id.clone(), envelope));
                return Ok(());
            }
            None => envelope,
        };
        let actor = match self.spawn(host, shard, entity_id, true) {
            Ok(actor) => actor,
            Err(error) => return Err((error, Some(envelope))),
        };
        host.send(&actor, envelope).map_err(|envelope| {
            let stopped = ShardingError::EntityStopped {
                type_name: host.type_name(),
                entity_id: entity_id.to_string(),
            };
            (stopped, envelope)
        })
    }

    /// Spawns an incarnation; `record` queues its start for the store (a
    /// respawned id is there already).
    fn spawn<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        record: bool,
    ) -> ShardingResult<E> {
        self.pending_respawn.remove(entity_id);
        self.make_room(host, shard, entity_id);
        self.last_incarnation += 1;
        let incarnation = self.last_incarnation;
        // (Empty unless the type migrates: no hashing on every spawn.)
        let state = if self.migrated.is_empty() {
            None
        } else {
            self.migrated.remove(entity_id)
        };
        let actor = match host.spawn(shard, self.generation, entity_id, incarnation, state) {
            Ok(actor) => actor,
            Err(e) => {
                // Not live after all: it holds no place in the policy.
                if let Some(passivator) = &mut self.passivator {
                    passivator.remove(entity_id);
                }
                return Err(e);
            }
        };
        self.entities.insert(
            entity_id.clone(),
            Entry::Live(Live {
                actor: actor.clone(),
                incarnation,
            }),
        );
        if record {
            host.record(shard, entity_id, RememberEntitiesOperation::RecordStarted);
        }
        Ok(actor)
    }

    /// Starts every entity whose state is kept here and that is not
    /// running (one still finishing starts when it has stopped).
    /// Under an active-entity limit, only as many as the share has room
    /// for: the rest keep their states until their next message (rather
    /// than start only to be passivated, states lost, by the next ones).
    fn start_migrated<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId) {
        let room = match &self.passivator {
            Some(passivator) => {
                let share = host
                    .entity_share()
                    .map_or(passivator.share(), |(share, _)| share);
                share.saturating_sub(passivator.len())
            }
            None => usize::MAX,
        };
        let ids: Vec<Arc<str>> = self
            .migrated
            .keys()
            .filter(|id| !self.entities.contains_key(*id))
            .take(room)
            .cloned()
            .collect();
        for id in ids {
            self.start_from_state(host, shard, &id);
        }
    }

    /// Starts `entity_id` from the state kept for it (a spawn that fails
    /// loses the state: its next message starts it from the factory).
    fn start_from_state<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) {
        let record = !self.pending_respawn.contains(entity_id);
        if let Err(error) = self.spawn(host, shard, entity_id, record) {
            tracing::warn!(type_name = host.type_name(), %shard, %entity_id, %error, "an entity with a migrated state did not start");
        }
    }

    /// Respawns up to a batch of the shard's pending remembered ids, and has
    /// the host come back for the rest after the respawn interval (Akka's
    /// constant-rate recovery), so a shard with very many remembered ids
    /// does not stampede. A message for an id not respawned yet spawns it at
    /// once (and takes it off the pending set), as any message does.
    fn respawn_batch<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId) {
        if !host.remembers() {
            return;
        }
        // (An id whose previous incarnation is still stopping waits for the
        // next batch.)
        let ids: Vec<Arc<str>> = self
            .pending_respawn
            .iter()
            .filter(|id| !self.entities.contains_key(*id))
            .take(host.respawn_batch())
            .cloned()
            .collect();
        for id in ids {
            self.pending_respawn.remove(&id);
            if let Err(error) = self.spawn(host, shard, &id, false) {
                tracing::warn!(type_name = host.type_name(), %shard, %error, "remember-entities: respawn failed");
            }
        }
        if !self.pending_respawn.is_empty() {
            host.respawn_later(shard, self.install);
        }
    }

    fn passivate<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        by_limit: bool,
    ) -> (ShardingResult<()>, Undelivered) {
        if let Some(handoff) = &mut self.handoff {
            // Every entity is stopping already; a remembered one is now
            // forgotten, so that no next home respawns it (not for a stale
            // request of an earlier incarnation). A request from outside
            // still applies to the messages waiting for that home.
            let current = self.entities.get(entity_id).map(Entry::incarnation);
            let stale = incarnation.is_some_and(|i| current.is_some_and(|c| c != i));
            if !stale && handoff.respawn.remove(entity_id) {
                host.record(shard, entity_id, RememberEntitiesOperation::RecordStopped);
            }
            if incarnation.is_some() || !waits_in(&handoff.buffer, entity_id) {
                // Passivated where it stands: no state of it moves on.
                if !stale {
                    handoff.passivated.insert(entity_id.clone());
                    self.migrated.remove(entity_id);
                }
                return (Ok(()), Vec::new());
            }
            if handoff.buffer.len() >= host.buffer_cap() {
                return (Err(overflow(host, shard)), Vec::new());
            }
            handoff.buffer.push(Buffered::Passivate(entity_id.clone()));
            return (Ok(()), Vec::new());
        }
        let live = match self.entities.remove(entity_id) {
            Some(Entry::Live(live)) if incarnation.is_none_or(|i| i == live.incarnation) => live,
            Some(Entry::Passivating {
                live,
                mut buffer,
                earlier,
            }) => {
                // Only an explicit request, for the incarnation that comes next.
                let mut result = Ok(());
                if incarnation.is_none() && !buffer.is_empty() {
                    if buffer.len() >= host.buffer_cap() {
                        result = Err(overflow(host, shard));
                    } else {
                        buffer.push(Buffered::Passivate(entity_id.clone()));
                    }
                }
                let entry = Entry::Passivating {
                    live,
                    buffer,
                    earlier,
                };
                self.entities.insert(entity_id.clone(), entry);
                return (result, Vec::new());
            }
            // A request from an earlier incarnation: stale.
            Some(other) => {
                self.entities.insert(entity_id.clone(), other);
                return (Ok(()), Vec::new());
            }
            None => return (Ok(()), Vec::new()),
        };
        if let Some(passivator) = &mut self.passivator {
            passivator.remove(entity_id);
        }
        host.record(shard, entity_id, RememberEntitiesOperation::RecordStopped);
        // Stop after what is queued (the host's marker, not ractor's
        // `drain`). Nothing can be enqueued behind it: the entity is no
        // longer Live, and all sends happen under the shard's lock.
        let stop_sent = host.stop(&live.actor);
        let stopped = live.incarnation;
        self.entities.insert(
            entity_id.clone(),
            Entry::Passivating {
                live,
                buffer: Vec::new(),
                earlier: false,
            },
        );
        if stop_sent {
            host.passivated(shard, by_limit);
            (Ok(()), Vec::new())
        } else {
            // Already gone (it crashed, not passivated): finish now.
            (Ok(()), self.stopped(host, shard, entity_id, stopped, None))
        }
    }

    fn stopped<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> Undelivered {
        match self.entities.get(entity_id) {
            Some(entry) if entry.incarnation() == incarnation => {}
            _ => return Vec::new(),
        }
        if let Some(passivator) = &mut self.passivator {
            passivator.remove(entity_id); // (a crashed one was live)
        }
        let removed = self.entities.remove(entity_id);
        // Only a state handed over by this hosting's handoff stop is kept
        // (not one of an earlier hosting's incarnation, finishing after a
        // move that did not wait for it), and never over one that migrated
        // in, nor for an entity passivated meanwhile.
        let this_hosting = matches!(removed, Some(Entry::Passivating { earlier: false, .. }));
        let passivated = self
            .handoff
            .as_ref()
            .is_some_and(|h| h.passivated.contains(entity_id));
        if let Some(state) = state
            && this_hosting
            && !passivated
        {
            self.migrated.entry(entity_id.clone()).or_insert(state);
        }
        // A state kept for this id (handed over by a handoff called off,
        // or migrated in while an earlier incarnation finished) starts the
        // next incarnation at once: it was live.
        if self.handoff.is_none()
            && !self.migrated.is_empty()
            && self.migrated.contains_key(entity_id)
        {
            self.start_from_state(host, shard, entity_id);
        }
        let undelivered = match removed {
            Some(Entry::Passivating { buffer, .. }) => self.replay(host, shard, buffer),
            _ => Vec::new(),
        };
        self.report_if_stopped(host, shard);
        undelivered
    }

    /// Tells the host a handed-off shard has no entity left (once per stop;
    /// the driver repeats it to the coordinator until a new home comes).
    fn report_if_stopped<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId) {
        let Some(handoff) = &mut self.handoff else {
            return;
        };
        if handoff.reported || !self.entities.is_empty() {
            return;
        }
        handoff.reported = true;
        host.shard_stopped(shard, self.generation);
    }

    /// Replays buffered items in order, returning the messages that could
    /// not be delivered.
    fn replay<H: SlotHost<Entity = E>>(
        &mut self,
        host: &mut H,
        shard: ShardId,
        buffer: Vec<Buffered>,
    ) -> Undelivered {
        let mut undelivered = Vec::new();
        for item in buffer {
            match item {
                Buffered::Message(entity_id, envelope) => {
                    if let Err((error, Some(envelope))) =
                        self.deliver(host, shard, &entity_id, envelope)
                    {
                        undelivered.push((error, envelope));
                    }
                }
                Buffered::Passivate(entity_id) => {
                    let (result, more) = self.passivate(host, shard, &entity_id, None, false);
                    if let Err(error) = result {
                        tracing::warn!(type_name = host.type_name(), %shard, %error, "buffered passivation dropped");
                    }
                    undelivered.extend(more);
                }
            }
        }
        undelivered
    }

    /// Ends a handoff with the shard staying here: the buffer is replayed
    /// in order, and remembered ids stopped by the handoff are respawned
    /// (at the respawn rate, once their incarnation has stopped).
    fn resume<H: SlotHost<Entity = E>>(&mut self, host: &mut H, shard: ShardId) -> Undelivered {
        let Some(handoff) = self.handoff.take() else {
            return Vec::new();
        };
        self.start_migrated(host, shard);
        let undelivered = self.replay(host, shard, handoff.buffer);
        let respawn = handoff
            .respawn
            .into_iter()
            .filter(|id| !matches!(self.entities.get(id), Some(Entry::Live(_))));
        self.pending_respawn.extend(respawn);
        if !self.pending_respawn.is_empty() {
            self.respawn_batch(host, shard);
        }
        undelivered
    }
}

fn refused() -> ShardingError {
    ShardingError::Bug("an entity mailbox refused an envelope without giving it back".into())
}

#[cfg(test)]
#[path = "slot_tests.rs"]
mod tests;
