//! A region's shards without its actors: the slot of each shard and every
//! rule the region keeps around them — routing, applying homes, hosting
//! and the limit's shares, handoffs, the states kept for a shard's new
//! home, a leave and a stop.
//!
//! [`ShardTable`] is generic over the entity handle and acts only through
//! its [`RegionHost`], so the runtime's [`Region`](super::Region) (actors,
//! pipes, metrics) and the cluster simulator (mailboxes in memory) run
//! this same code.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::entity::MigratedState;
use crate::model::config::{EntityLimit, PassivationPolicy};
use crate::model::envelope::LocalEnvelope;
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::mailbox::States;
use crate::runtime::slot::{HomeChange, Refused, ShardHome, Slot, SlotHost, Undelivered};

/// What the table's rules do outside the slots, beyond a slot's own
/// effects ([`SlotHost`]). As a slot's calls, `states_not_fetched`,
/// `expire_later` and `hosted_changed` may come with a shard's slot
/// locked: a host must take no slot lock in them. `fail` and `host_shard`
/// come with none locked.
pub(crate) trait RegionHost: SlotHost {
    /// Answers the senders of what could not be delivered (called with no
    /// shard locked, so a message's `Drop` never runs under a lock).
    fn fail(&mut self, undelivered: Undelivered);
    /// `shard` is to be hosted here under `generation`, with the states
    /// its entities handed over on `from`: the shard is prepared and
    /// installed (messages wait in its slot meanwhile).
    fn host_shard(&mut self, shard: ShardId, generation: u64, from: Option<UniqueAddress>);
    /// The states `from` keeps for `shard` will not be fetched (the shard
    /// is hosted here already): why.
    fn states_not_fetched(&mut self, shard: ShardId, from: UniqueAddress, reason: String);
    /// States were kept for allocation `generation` of `shard`: they are
    /// to expire after `after` unless fetched.
    fn expire_later(&mut self, shard: ShardId, generation: u64, after: Duration);
    /// A shard was counted in (`here`) or out of those hosted here.
    fn hosted_changed(&mut self, here: bool);
}

/// How a migratable type's states are kept for a shard's new home.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Keeping {
    /// The largest state that can travel: a larger one is dropped.
    pub(crate) max_state: usize,
    /// The largest chunk a pull is answered with (a larger state travels
    /// alone).
    pub(crate) chunk: usize,
    /// How long kept states wait for their new home to fetch them.
    pub(crate) keep_for: Duration,
}

/// What a handoff took from one shard's entities, kept for the node the
/// shard moved to until it has fetched them (or they expire).
struct Outgoing {
    home: ShardHome,
    /// The states, cut into chunks (at least one, maybe empty).
    chunks: Vec<States>,
}

/// The answer to a pull for one chunk of a shard's migrated states.
#[derive(Debug)]
pub(crate) enum ChunkAnswer {
    /// The chunk asked for; `last`: nothing follows.
    Chunk { states: States, last: bool },
    /// The shard has not moved on from here yet (this node has not applied
    /// its new home): ask again.
    NotYet,
    /// None here for that node and allocation.
    Nothing(&'static str),
}

/// What [`ShardTable::take_all`] took out of a stopped region.
pub(crate) struct TakenAll<E> {
    /// The entities of the shards hosted here.
    pub(crate) entities: Vec<E>,
    /// The entities finishing their mailboxes after their shard moved away.
    pub(crate) finishing: Vec<E>,
}

/// One entity type's shards on this node.
pub(crate) struct ShardTable<E> {
    /// This node, on a cluster.
    me: Option<UniqueAddress>,
    /// A proxy-only region: it routes and never hosts a shard.
    proxy: bool,
    slots: Box<[Mutex<Slot<E>>]>,
    stopped: AtomicBool,
    /// Leaving, the coordinator said nothing more of this type will move off
    /// this node; and whether that is because there is nowhere to move it.
    left: AtomicBool,
    nowhere: AtomicBool,
    /// Counts the hostings of shards here (a respawn batch names the
    /// hosting it belongs to).
    installs: AtomicU64,
    /// The active-entity limit (none for a remembered type).
    entity_limit: Option<EntityLimit>,
    /// The shards hosted here (installed and not moved away), over which
    /// the limit is shared: a new share visits them alone. Kept by
    /// [`count_hosted`](Self::count_hosted) only.
    hosted_shards: Mutex<BTreeSet<u32>>,
    /// Their number, read by every start without the lock.
    hosted: AtomicUsize,
    /// Of a migratable type: how its states are kept.
    keeping: Option<Keeping>,
    /// States kept for the nodes shards moved to, by shard.
    outgoing: Mutex<HashMap<u32, Outgoing>>,
}

/// Locks a mutex. No code panics while holding one of the table's, so a
/// poisoned lock (a panic elsewhere in the thread) still guards consistent
/// data.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<E: Clone> ShardTable<E> {
    /// `num_shards` unallocated shards; `me` is this node on a cluster.
    pub(crate) fn new(num_shards: u32, me: Option<UniqueAddress>, proxy: bool) -> Self {
        ShardTable {
            me,
            proxy,
            slots: (0..num_shards)
                .map(|_| Mutex::new(Slot::unallocated(0)))
                .collect(),
            stopped: AtomicBool::new(false),
            left: AtomicBool::new(false),
            nowhere: AtomicBool::new(false),
            installs: AtomicU64::new(1),
            entity_limit: None,
            hosted_shards: Mutex::new(BTreeSet::new()),
            hosted: AtomicUsize::new(0),
            keeping: None,
            outgoing: Mutex::new(HashMap::new()),
        }
    }

    /// The table of a migratable type (`None`: not migratable).
    pub(crate) fn with_keeping(self, keeping: Option<Keeping>) -> Self {
        ShardTable { keeping, ..self }
    }

    /// The table with an active-entity limit (`None`: none).
    pub(crate) fn with_entity_limit(self, entity_limit: Option<EntityLimit>) -> Self {
        ShardTable {
            entity_limit,
            ..self
        }
    }

    pub(crate) fn num_shards(&self) -> u32 {
        self.slots.len() as u32
    }

    pub(crate) fn entity_limit(&self) -> Option<EntityLimit> {
        self.entity_limit
    }

    /// Locks `shard`'s slot, to read it.
    pub(crate) fn slot(&self, shard: ShardId) -> MutexGuard<'_, Slot<E>> {
        lock(&self.slots[shard.0 as usize])
    }

    // ---- routing ----

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Refuses new messages from now on (`ShuttingDown`).
    pub(crate) fn stop_accepting(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    /// Routes one envelope to `entity_id` in `shard`. On error the envelope
    /// was not accepted; it is answered after the lock is released.
    #[inline]
    pub(crate) fn deliver<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> ShardingResult<()> {
        if self.is_stopped() {
            host.fail(vec![(ShardingError::ShuttingDown, envelope)]);
            return Err(ShardingError::ShuttingDown);
        }
        let result = self.slot(shard).deliver(host, shard, entity_id, envelope);
        result.map_err(|refused| answer(host, refused))
    }

    /// [`deliver`](Self::deliver) for an entity id that is not yet an
    /// `Arc<str>` (a remote envelope's): the common case — a live entity of
    /// a hosted shard — allocates nothing; anything else goes the general way.
    pub(crate) fn deliver_str<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        entity_id: &str,
        envelope: LocalEnvelope,
    ) -> ShardingResult<()> {
        let envelope = {
            let mut guard = self.slot(shard);
            if !self.is_stopped() {
                match guard.deliver_live(host, shard, entity_id, envelope) {
                    Ok(result) => return result,
                    Err(envelope) => envelope,
                }
            } else if let Some(home) = guard.home(None) {
                // A stopped region (a node that left) still forwards what
                // peers send it for shards it knows elsewhere: a sender that
                // had not heard the new home yet loses nothing, tells
                // included.
                let forwarded = host.forward(home, shard, &Arc::from(entity_id), envelope);
                drop(guard);
                return forwarded.map_err(|refused| answer(host, refused));
            } else {
                envelope
            }
        };
        self.deliver(host, shard, &Arc::from(entity_id), envelope)
    }

    /// Passivates `entity_id` — only `incarnation` if one is named (a request
    /// from the entity itself), else whichever is current. A request
    /// `from_remote` (another node sent it here) is not sent on again when
    /// the shard is not hosted here, so two disagreeing tables cannot bounce
    /// it between them.
    pub(crate) fn passivate<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        from_remote: bool,
    ) -> ShardingResult<()> {
        let (result, undelivered) =
            self.slot(shard)
                .passivate(host, shard, entity_id, incarnation, from_remote);
        host.fail(undelivered);
        result
    }

    /// Incarnation `incarnation` of `entity_id` stopped (its stop notice,
    /// sent on every exit path): its passivation finishes by replaying the
    /// messages buffered meanwhile, or a crashed incarnation is forgotten.
    pub(crate) fn entity_stopped<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) {
        let undelivered =
            self.slot(shard)
                .entity_stopped(host, shard, entity_id, incarnation, state);
        host.fail(undelivered);
    }

    // ---- homes ----

    /// Applies a home for `shard` from the coordinator (see
    /// [`Slot::set_home`]); the entities of a shard that moved away finish
    /// their mailboxes and stop. A shard whose home is now here goes to
    /// [`RegionHost::host_shard`]; `from`, the old owner that handed it
    /// off, has its entities' states for it. A shard handed off from here
    /// keeps its entities' states for its new home to fetch.
    pub(crate) fn set_home<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> HomeChange {
        let Some(me) = self.me else {
            return HomeChange::Unchanged;
        };
        if shard.0 >= self.num_shards() {
            return HomeChange::Unchanged;
        }
        let from = from.filter(|f| *f != me);
        let mut guard = self.slot(shard);
        let was_local = guard.is_local();
        if let Some(from) = from
            && was_local
            && home.owner == me
            && home.generation >= guard.generation()
        {
            // Hosted here already, yet the coordinator says the shard comes
            // from `from`: either it started here from a word without
            // `from` (a Table, a GetHome answer) before this one, or this
            // node missed a move, and the states it kept are older than
            // `from`'s. Neither is pulled: its entities start from the
            // factory (and this says so).
            let dropped = guard.drop_states();
            let reason = if dropped > 0 {
                format!("this node missed a move: {dropped} older states kept here dropped")
            } else {
                "the shard started here before its states were asked for".to_owned()
            };
            host.states_not_fetched(shard, from, reason);
        }
        let (change, undelivered) = guard.set_home(host, shard, home, me, self.proxy);
        let moved_away = was_local && !guard.is_local();
        // Kept under the shard's lock: a pull sees the shard either still
        // here or moved on with its states kept.
        if let Some((home, states)) = guard.take_outgoing() {
            self.keep_outgoing(host, shard, home, states);
        }
        drop(guard);
        if moved_away {
            self.count_hosted(host, shard, false);
        }
        host.fail(undelivered);
        if change == HomeChange::HostHere {
            host.host_shard(shard, home.generation, from);
        }
        change
    }

    /// The coordinator moves `shard`, hosted here under `generation` (see
    /// [`Slot::hand_off`]).
    pub(crate) fn hand_off<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        generation: u64,
    ) {
        if shard.0 < self.num_shards() {
            self.slot(shard).hand_off(host, shard, generation);
        }
    }

    /// Whether `shard` is hosted here under `generation`, handed off and
    /// empty: its `ShardStopped` still needs an answer.
    pub(crate) fn is_handed_off(&self, shard: ShardId, generation: u64) -> bool {
        shard.0 < self.num_shards() && self.slot(shard).is_handed_off(generation)
    }

    /// The highest allocation generation this region has seen for `shard`
    /// (0 once the region stopped it).
    pub(crate) fn generation_of(&self, shard: ShardId) -> u64 {
        if shard.0 >= self.num_shards() {
            return 0;
        }
        let slot = self.slot(shard);
        if slot.is_stopped() {
            0
        } else {
            slot.generation()
        }
    }

    /// `node` is gone (downed, exited, removed): shards routed to it wait
    /// for a new home; the next message for one asks the coordinator.
    /// Returns how many shards this region still routed to it.
    pub(crate) fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.slots
            .iter()
            .filter(|slot| lock(slot).node_lost(node))
            .count()
    }

    /// The hosted shards whose handoff has stopped every entity: they host
    /// nothing any more and wait for their next home. A registration names
    /// them, so that no coordinator takes this node for their home again
    /// from a claim (SPEC §13.3).
    pub(crate) fn stopped_shards(&self) -> Vec<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| lock(slot).is_stopped_here())
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// Every home this region knows (its replica of the table).
    pub(crate) fn replica(&self) -> Vec<(u32, ShardHome)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| lock(slot).home(self.me).map(|home| (i as u32, home)))
            .collect()
    }

    /// A new coordinator: handoffs it did not ask for, and that have not
    /// reported their shard stopped yet, are called off (the shard stays
    /// here and what waited is delivered here; a leaving node asks the new
    /// coordinator again). Reported ones go on: their report is repeated.
    pub(crate) fn call_off_handoffs<H: RegionHost<Entity = E>>(&self, host: &mut H) {
        for (i, slot) in self.slots.iter().enumerate() {
            let undelivered = lock(slot).call_off_handoff(host, ShardId(i as u32));
            host.fail(undelivered);
        }
    }

    /// The coordinator refused this region: what waits for a home fails
    /// with `error` (it would otherwise wait for a home that never comes).
    pub(crate) fn refuse<H: RegionHost<Entity = E>>(&self, host: &mut H, error: &ShardingError) {
        let mut undelivered = Vec::new();
        for slot in self.slots.iter() {
            let drained = lock(slot).drain_refused();
            undelivered.extend(drained.into_iter().map(|e| (error.clone(), e)));
        }
        host.fail(undelivered);
    }

    /// The coordinator said nothing more of this type will move off this
    /// node (see [`leave_done`](Self::leave_done)).
    pub(crate) fn mark_left(&self, nowhere: bool) {
        self.nowhere.store(nowhere, Ordering::Release);
        self.left.store(true, Ordering::Release);
    }

    /// Whether the coordinator said there is nowhere to move this type's
    /// shards.
    pub(crate) fn nowhere(&self) -> bool {
        self.nowhere.load(Ordering::Acquire)
    }

    /// In a graceful leave: whether this region is done — the coordinator
    /// said there is nowhere to move its shards, or it said `Left` and this
    /// node hosts no shard any more (it has applied the new homes; one that
    /// was lost, because the new home died meanwhile, is followed by
    /// another, which the leave waits for).
    pub(crate) fn leave_done(&self) -> bool {
        self.nowhere() || (self.left.load(Ordering::Acquire) && self.hosted_count() == 0)
    }

    // ---- hosting ----

    /// Whether `shard` is hosted here under `generation` or a later one.
    pub(crate) fn hosts(&self, shard: ShardId, generation: u64) -> bool {
        shard.0 < self.num_shards() && {
            let slot = self.slot(shard);
            slot.is_local() && slot.generation() >= generation
        }
    }

    /// How many shards are hosted here.
    pub(crate) fn hosted_count(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| lock(slot).is_local())
            .count()
    }

    /// Makes `shard` local under `generation`, starts respawning
    /// `remembered` (read from the store beforehand, off the lock) and
    /// replays its buffer in order. Returns false (and leaves the slot as
    /// it was) when a newer home came meanwhile, the shard is already local
    /// or the region stopped.
    pub(crate) fn install<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        generation: u64,
        remembered: Option<Vec<String>>,
        migrated: States,
    ) -> bool {
        if self.is_stopped() {
            return false;
        }
        let install = self.installs.fetch_add(1, Ordering::Relaxed);
        let mut guard = self.slot(shard);
        let newly_local = !guard.is_local();
        // Counted in before it starts, so that its own share is right.
        if newly_local {
            self.count_hosted(host, shard, true);
        }
        let installed = guard.install(host, shard, generation, install, remembered, migrated);
        if newly_local && installed.is_none() {
            self.count_hosted(host, shard, false);
        }
        drop(guard);
        match installed {
            Some(undelivered) => {
                host.fail(undelivered);
                if newly_local {
                    self.reshare(host);
                }
                true
            }
            None => false,
        }
    }

    /// Respawns more remembered ids of `shard`, if it is still hosting
    /// `install`.
    pub(crate) fn respawn_more<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        install: u64,
    ) {
        self.slot(shard).respawn_more(host, shard, install);
    }

    /// Asks for the allocation of each of `shards` not yet asked for (those
    /// with remembered entities, at registration).
    pub(crate) fn start_shards<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shards: Vec<ShardId>,
    ) {
        for shard in shards.into_iter().filter(|s| s.0 < self.num_shards()) {
            self.slot(shard).request_if_idle(host, shard);
        }
    }

    /// Each hosted shard's share of the limit now, and its policy.
    pub(crate) fn share(&self) -> Option<(usize, PassivationPolicy)> {
        let limit = self.entity_limit?;
        let hosted = self.hosted.load(Ordering::Acquire);
        Some(((limit.max_live / hosted.max(1)).max(1), limit.policy))
    }

    /// A shard was counted in: every hosted shard's share is now the
    /// smaller one for the current count, and each passivates what no
    /// longer fits. (A share that grows, when a shard moves away, is taken
    /// up by the next start.)
    fn reshare<H: RegionHost<Entity = E>>(&self, host: &mut H) {
        let Some((share, _)) = self.share() else {
            return;
        };
        let hosted: Vec<u32> = lock(&self.hosted_shards).iter().copied().collect();
        for i in hosted {
            self.slot(ShardId(i)).reshare(host, ShardId(i), share);
        }
    }

    /// Counts `shard` in (`here`) or out of the shards hosted here: the
    /// set a new share visits and its size every start reads, in step.
    fn count_hosted<H: RegionHost<Entity = E>>(&self, host: &mut H, shard: ShardId, here: bool) {
        let mut hosted = lock(&self.hosted_shards);
        let changed = if here {
            hosted.insert(shard.0)
        } else {
            hosted.remove(&shard.0)
        };
        if changed {
            self.hosted.store(hosted.len(), Ordering::Release);
            drop(hosted);
            host.hosted_changed(here);
        }
    }

    // ---- states kept for a shard's new home ----

    /// Keeps the states `shard`'s entities handed over for its new `home`,
    /// in chunks, until it fetches them or they expire. A state too large
    /// to travel is dropped (its entity starts from its factory there).
    fn keep_outgoing<H: RegionHost<Entity = E>>(
        &self,
        host: &mut H,
        shard: ShardId,
        home: ShardHome,
        states: States,
    ) {
        let Some(keeping) = self.keeping else {
            return;
        };
        let mut chunks: Vec<States> = vec![Vec::new()];
        let mut size = 0;
        let chunk = keeping.chunk.min(keeping.max_state);
        for (id, state) in states {
            // (Each entry's CBOR framing is a few bytes more.)
            let len = state.bytes.len() + id.len() + 16;
            if len > keeping.max_state {
                tracing::warn!(type_name = host.type_name(), %shard, entity_id = %id, len, max = keeping.max_state, "a state too large to migrate is dropped; the entity starts from its factory");
                continue;
            }
            if size > 0 && size + len > chunk {
                chunks.push(Vec::new());
                size = 0;
            }
            size += len;
            chunks.last_mut().expect("one at least").push((id, state));
        }
        let replaced = lock(&self.outgoing).insert(shard.0, Outgoing { home, chunks });
        if let Some(replaced) = replaced {
            // An earlier allocation's states, never fetched.
            super::drop_off_async(replaced.chunks);
        }
        host.expire_later(shard, home.generation, keeping.keep_for);
    }

    /// Chunk `index` of the states kept for `requester`, which hosts
    /// `shard` under `generation`.
    pub(crate) fn migration_chunk(
        &self,
        requester: &UniqueAddress,
        shard: ShardId,
        generation: u64,
        index: u32,
    ) -> ChunkAnswer {
        if self.keeping.is_none() {
            return ChunkAnswer::Nothing("the type does not migrate on this node");
        }
        if shard.0 >= self.num_shards() {
            return ChunkAnswer::Nothing("no such shard");
        }
        // Under the shard's lock, which `set_home` keeps the states under:
        // a shard that has moved on has its states kept already.
        let slot = self.slot(shard);
        if slot.is_local() && slot.generation() < generation {
            // Still hosted here (its handoff finishing, or its new home not
            // applied yet): the states come once it has moved on.
            return ChunkAnswer::NotYet;
        }
        let outgoing = lock(&self.outgoing);
        match outgoing.get(&shard.0) {
            Some(o) if o.home.owner == *requester && o.home.generation == generation => {
                match o.chunks.get(index as usize) {
                    Some(states) => ChunkAnswer::Chunk {
                        states: states.clone(),
                        last: index as usize + 1 == o.chunks.len(),
                    },
                    None => ChunkAnswer::Nothing("no such chunk"),
                }
            }
            _ => ChunkAnswer::Nothing("no states kept for that node and allocation"),
        }
    }

    /// `requester` has fetched every chunk of `shard`'s states: they go.
    pub(crate) fn migration_done(
        &self,
        requester: &UniqueAddress,
        shard: ShardId,
        generation: u64,
    ) {
        self.drop_outgoing(shard, |o| {
            o.home.owner == *requester && o.home.generation == generation
        });
    }

    /// The states kept for `shard`'s allocation `generation` were not
    /// fetched in time: they go. True if there were any.
    pub(crate) fn expire_migration(&self, shard: ShardId, generation: u64) -> bool {
        self.drop_outgoing(shard, |o| o.home.generation == generation)
    }

    /// Drops the states kept for `shard` if `which` matches them, freed on
    /// tokio's blocking pool (see [`drop_off_async`](super::drop_off_async)):
    /// a shard's 100,000 states take over 100 ms to free, and the callers
    /// run on a pipe's reader or the region's actor. True if it dropped any.
    fn drop_outgoing(&self, shard: ShardId, which: impl FnOnce(&Outgoing) -> bool) -> bool {
        let taken = {
            let mut outgoing = lock(&self.outgoing);
            match outgoing.get(&shard.0) {
                Some(o) if which(o) => outgoing.remove(&shard.0),
                _ => None,
            }
        };
        taken.map(|o| super::drop_off_async(o.chunks)).is_some()
    }

    /// Whether states wait here for a node to fetch them: kept for it, or
    /// still in a handed-off shard whose new home this node has not
    /// applied yet.
    pub(crate) fn migrations_pending(&self) -> bool {
        self.keeping.is_some()
            && (!lock(&self.outgoing).is_empty()
                || self.slots.iter().any(|s| lock(s).holds_states()))
    }

    // ---- stopping ----

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// takes the entities out of the slots (remote homes are kept:
    /// envelopes that still arrive are forwarded), and apart from them the
    /// entities finishing after their shard moved away.
    pub(crate) fn take_all<H: RegionHost<Entity = E>>(&self, host: &mut H) -> TakenAll<E> {
        self.stop_accepting();
        let mut taken_all = TakenAll {
            entities: Vec::new(),
            finishing: Vec::new(),
        };
        let mut undelivered = Vec::new();
        for slot in self.slots.iter() {
            let taken = lock(slot).take();
            taken_all.entities.extend(taken.entities);
            taken_all.finishing.extend(taken.finishing);
            undelivered.extend(
                taken
                    .buffered
                    .into_iter()
                    .map(|envelope| (ShardingError::ShuttingDown, envelope)),
            );
        }
        host.fail(undelivered);
        taken_all
    }
}

/// Answers a refused delivery's sender, if the envelope came back.
fn answer<H: RegionHost>(host: &mut H, (error, envelope): Refused) -> ShardingError {
    if let Some(envelope) = envelope {
        host.fail(vec![(error.clone(), envelope)]);
    }
    error
}
