//! The slot against a host that records every call: each test drives one
//! case the region meets and asserts the exact calls it made.

use std::collections::HashSet;
use std::sync::Arc;

use super::*;
use crate::model::config::PassivationPolicy;
use crate::model::envelope::LocalEnvelope;
use crate::model::error::ShardingResult;
use crate::model::identity::{NodeId, UniqueAddress};
use crate::persistence::remember::RememberEntitiesOperation;

/// A fake mailbox: the number of the spawn that made it.
type Mailbox = u32;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    /// Spawned `id` as `incarnation`.
    Spawn(String, u64),
    /// Spawned `id` as `incarnation` from a migrated state (its bytes).
    SpawnFrom(String, u64, Vec<u8>),
    /// Enqueued message `n` into a mailbox.
    Send(Mailbox, u64),
    Stop(Mailbox),
    Record(String, RememberEntitiesOperation),
    RespawnLater(u64),
    /// Forwarded message `n` of `id` to the home of `generation`.
    Forward(u64, String, u64),
    PassivateAt(String),
    RequestAllocation,
    ShardStopped(u64),
    PassivatedByLimit,
}

struct Fake {
    calls: Vec<Call>,
    buffer_cap: usize,
    remembers: bool,
    batch: usize,
    spawned: Mailbox,
    /// Mailboxes whose entity is gone (sends give the envelope back).
    gone: HashSet<Mailbox>,
    refusal: Option<ShardingError>,
    /// The shard's share of an active-entity limit.
    share: Option<(usize, PassivationPolicy)>,
    /// Spawns fail.
    spawn_fails: bool,
}

impl Fake {
    fn new() -> Self {
        Fake {
            calls: Vec::new(),
            buffer_cap: 100,
            remembers: false,
            batch: 100,
            spawned: 0,
            gone: HashSet::new(),
            refusal: None,
            share: None,
            spawn_fails: false,
        }
    }

    /// The calls since the last look.
    fn calls(&mut self) -> Vec<Call> {
        std::mem::take(&mut self.calls)
    }
}

impl SlotHost for Fake {
    type Entity = Mailbox;

    fn type_name(&self) -> &'static str {
        "fake"
    }

    fn buffer_cap(&self) -> usize {
        self.buffer_cap
    }

    fn refused(&self) -> bool {
        self.refusal.is_some()
    }

    fn refusal(&self) -> Option<ShardingError> {
        self.refusal.clone()
    }

    fn remembers(&self) -> bool {
        self.remembers
    }

    fn check_store(&self, _shard: ShardId) -> ShardingResult<()> {
        Ok(())
    }

    fn spawn(
        &mut self,
        _shard: ShardId,
        _generation: u64,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) -> ShardingResult<Mailbox> {
        self.calls.push(match state {
            Some(state) => {
                Call::SpawnFrom(entity_id.to_string(), incarnation, state.bytes.to_vec())
            }
            None => Call::Spawn(entity_id.to_string(), incarnation),
        });
        if self.spawn_fails {
            return Err(ShardingError::Spawn(format!("{entity_id}: refused")));
        }
        self.spawned += 1;
        Ok(self.spawned)
    }

    fn send(
        &mut self,
        entity: &Mailbox,
        envelope: LocalEnvelope,
    ) -> Result<(), Option<LocalEnvelope>> {
        if self.gone.contains(entity) {
            return Err(Some(envelope));
        }
        self.calls.push(Call::Send(*entity, number(envelope)));
        Ok(())
    }

    fn stop(&mut self, entity: &Mailbox) -> bool {
        self.calls.push(Call::Stop(*entity));
        !self.gone.contains(entity)
    }

    fn stop_to_move(&mut self, entity: &Mailbox) -> bool {
        self.stop(entity)
    }

    fn record(&mut self, _shard: ShardId, entity_id: &Arc<str>, op: RememberEntitiesOperation) {
        if self.remembers {
            self.calls.push(Call::Record(entity_id.to_string(), op));
        }
    }

    fn respawn_batch(&self) -> usize {
        self.batch
    }

    fn respawn_later(&mut self, _shard: ShardId, install: u64) {
        self.calls.push(Call::RespawnLater(install));
    }

    fn forward(
        &mut self,
        home: ShardHome,
        _shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> Result<(), Refused> {
        self.calls.push(Call::Forward(
            home.generation,
            entity_id.to_string(),
            number(envelope),
        ));
        Ok(())
    }

    fn passivate_at(
        &mut self,
        _owner: UniqueAddress,
        _shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<()> {
        self.calls.push(Call::PassivateAt(entity_id.to_string()));
        Ok(())
    }

    fn request_allocation(&mut self, _shard: ShardId) -> bool {
        self.calls.push(Call::RequestAllocation);
        true
    }

    fn shard_stopped(&mut self, _shard: ShardId, generation: u64) {
        self.calls.push(Call::ShardStopped(generation));
    }

    fn entity_share(&self) -> Option<(usize, PassivationPolicy)> {
        self.share
    }

    fn passivated(&mut self, _shard: ShardId, by_limit: bool) {
        if by_limit {
            self.calls.push(Call::PassivatedByLimit);
        }
    }
}

const SHARD: ShardId = ShardId(3);

fn node(port: u16) -> UniqueAddress {
    UniqueAddress {
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        node_id: NodeId(u64::from(port)),
        incarnation: 1,
    }
}

fn me() -> UniqueAddress {
    node(1)
}

fn home(generation: u64) -> ShardHome {
    ShardHome {
        owner: node(2),
        generation,
    }
}

/// A home on this node.
fn here(generation: u64) -> ShardHome {
    ShardHome {
        owner: me(),
        generation,
    }
}

fn id(name: &str) -> Arc<str> {
    Arc::from(name)
}

/// A tell carrying the number `n`.
fn tell(n: u64) -> LocalEnvelope {
    LocalEnvelope::local::<u64, ()>(0, n, None)
}

fn number(envelope: LocalEnvelope) -> u64 {
    envelope.open::<u64, ()>().expect("a test tell").0
}

fn spawn(name: &str, incarnation: u64) -> Call {
    Call::Spawn(name.into(), incarnation)
}

/// Delivers message `n` to `name`, which the slot must accept.
fn deliver(slot: &mut Slot<Mailbox>, host: &mut Fake, name: &str, n: u64) {
    if slot.deliver(host, SHARD, &id(name), tell(n)).is_err() {
        panic!("message {n} for {name} refused");
    }
}

/// A slot hosted here under generation 1, no entity yet.
fn hosted(host: &mut Fake) -> Slot<Mailbox> {
    let mut slot = Slot::unallocated(0);
    let undelivered = slot
        .install(host, SHARD, 1, 1, None, Vec::new())
        .expect("installed");
    assert!(undelivered.is_empty());
    host.calls();
    slot
}

#[test]
fn messages_wait_for_a_home_and_are_replayed_in_order_when_it_comes() {
    let mut host = Fake::new();
    let mut slot = Slot::unallocated(0);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    deliver(&mut slot, &mut host, "a", 3);
    assert_eq!(host.calls(), [Call::RequestAllocation], "asked once");
    let undelivered = slot
        .install(&mut host, SHARD, 1, 1, None, Vec::new())
        .expect("installed");
    assert!(undelivered.is_empty());
    assert_eq!(
        host.calls(),
        [
            spawn("a", 1),
            Call::Send(1, 1),
            spawn("b", 2),
            Call::Send(2, 2),
            Call::Send(1, 3),
        ]
    );
}

#[test]
fn a_full_buffer_refuses_the_message_and_gives_it_back() {
    let mut host = Fake::new();
    host.buffer_cap = 2;
    let mut slot = Slot::unallocated(0);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "a", 2);
    match slot.deliver(&mut host, SHARD, &id("a"), tell(3)) {
        Err((ShardingError::BufferOverflow { shard_id, .. }, Some(envelope))) => {
            assert_eq!(shard_id, SHARD);
            assert_eq!(number(envelope), 3);
        }
        other => panic!("expected an overflow, got {:?}", other.map_err(|e| e.0)),
    }
    // Behind a passivation too.
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    let _ = slot.passivate(&mut host, SHARD, &id("a"), None, false);
    deliver(&mut slot, &mut host, "a", 2);
    deliver(&mut slot, &mut host, "a", 3);
    host.calls();
    let refused = slot.deliver(&mut host, SHARD, &id("a"), tell(4));
    assert!(matches!(
        refused,
        Err((ShardingError::BufferOverflow { .. }, Some(_)))
    ));
    assert_eq!(host.calls(), []);
}

#[test]
fn a_live_entity_gets_its_message_and_nothing_else_happens() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    assert_eq!(host.calls(), [spawn("a", 1), Call::Send(1, 1)]);
    deliver(&mut slot, &mut host, "a", 2);
    assert_eq!(host.calls(), [Call::Send(1, 2)]);
    // The remote fast path takes the same mailbox, and gives back what is
    // not for a live entity.
    assert!(matches!(
        slot.deliver_live(&mut host, SHARD, "a", tell(3)),
        Ok(Ok(()))
    ));
    assert_eq!(host.calls(), [Call::Send(1, 3)]);
    let back = slot.deliver_live(&mut host, SHARD, "b", tell(4));
    assert_eq!(number(back.expect_err("given back")), 4);
    assert_eq!(host.calls(), []);
}

#[test]
fn a_gone_mailbox_is_replaced_by_a_new_incarnation() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    host.calls();
    host.gone.insert(1);
    deliver(&mut slot, &mut host, "a", 2);
    assert_eq!(host.calls(), [spawn("a", 2), Call::Send(2, 2)]);
}

#[test]
fn a_passivation_buffers_what_comes_until_the_entity_has_stopped() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    host.calls();
    let (result, undelivered) = slot.passivate(&mut host, SHARD, &id("a"), None, false);
    assert!(result.is_ok() && undelivered.is_empty());
    assert_eq!(host.calls(), [Call::Stop(1)]);
    deliver(&mut slot, &mut host, "a", 2);
    assert_eq!(host.calls(), [], "waits behind the stop");
    assert_eq!(slot.live_entities(), 0);
    let undelivered = slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    assert!(undelivered.is_empty());
    assert_eq!(host.calls(), [spawn("a", 2), Call::Send(2, 2)]);
}

#[test]
fn notices_of_an_earlier_incarnation_change_nothing() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    host.gone.insert(1);
    deliver(&mut slot, &mut host, "a", 2);
    host.calls();
    // Incarnation 2 is current: a stop notice and a passivation request of
    // incarnation 1 are stale.
    assert!(
        slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None)
            .is_empty()
    );
    let (result, _) = slot.passivate(&mut host, SHARD, &id("a"), Some(1), false);
    assert!(result.is_ok());
    assert_eq!(host.calls(), []);
    deliver(&mut slot, &mut host, "a", 3);
    assert_eq!(host.calls(), [Call::Send(2, 3)]);
}

#[test]
fn a_handoff_stops_every_entity_and_what_waited_follows_the_shard_in_order() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    let _ = slot.passivate(&mut host, SHARD, &id("b"), None, false);
    deliver(&mut slot, &mut host, "b", 7);
    host.calls();
    slot.hand_off(&mut host, SHARD, 1);
    assert_eq!(host.calls(), [Call::Stop(1)], "b is stopping already");
    deliver(&mut slot, &mut host, "a", 8);
    let (result, _) = slot.passivate(&mut host, SHARD, &id("a"), None, false);
    assert!(result.is_ok());
    assert_eq!(host.calls(), [], "both wait for the next home");
    assert!(
        slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None)
            .is_empty()
    );
    assert_eq!(host.calls(), []);
    assert!(!slot.is_handed_off(1));
    assert!(
        slot.entity_stopped(&mut host, SHARD, &id("b"), 2, None)
            .is_empty()
    );
    assert_eq!(host.calls(), [Call::ShardStopped(1)], "reported once");
    assert!(slot.is_handed_off(1) && slot.is_stopped_here());
    let (change, undelivered) = slot.set_home(&mut host, SHARD, home(2), me(), false);
    assert_eq!(change, HomeChange::Remote);
    assert!(undelivered.is_empty());
    assert_eq!(
        host.calls(),
        [
            Call::Forward(2, "b".into(), 7),
            Call::Forward(2, "a".into(), 8),
            Call::PassivateAt("a".into()),
        ],
        "what waited behind a passivation, then what came during the handoff"
    );
}

#[test]
fn a_handoff_asked_again_reports_again_and_one_for_another_generation_is_ignored() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    slot.hand_off(&mut host, SHARD, 2);
    assert_eq!(host.calls(), []);
    assert!(!slot.is_stopped_here());
    slot.hand_off(&mut host, SHARD, 1);
    assert_eq!(
        host.calls(),
        [Call::ShardStopped(1)],
        "no entity: stopped at once"
    );
    slot.hand_off(&mut host, SHARD, 1);
    assert_eq!(
        host.calls(),
        [Call::ShardStopped(1)],
        "the report may have been lost"
    );
}

#[test]
fn a_called_off_handoff_delivers_here_what_waited() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    slot.hand_off(&mut host, SHARD, 1);
    deliver(&mut slot, &mut host, "a", 2);
    host.calls();
    assert!(slot.call_off_handoff(&mut host, SHARD).is_empty());
    assert_eq!(host.calls(), [], "a is still stopping: 2 waits behind it");
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    assert_eq!(host.calls(), [spawn("a", 2), Call::Send(2, 2)]);
    // A reported handoff is not called off.
    slot.hand_off(&mut host, SHARD, 1);
    slot.entity_stopped(&mut host, SHARD, &id("a"), 2, None);
    assert_eq!(host.calls(), [Call::Stop(2), Call::ShardStopped(1)]);
    deliver(&mut slot, &mut host, "a", 3);
    assert!(slot.call_off_handoff(&mut host, SHARD).is_empty());
    assert_eq!(host.calls(), []);
}

#[test]
fn a_sender_that_knows_a_newer_generation_makes_the_slot_wait_for_it() {
    let mut host = Fake::new();
    let mut slot = Slot::unallocated(0);
    assert_eq!(
        slot.set_home(&mut host, SHARD, home(2), me(), false).0,
        HomeChange::Remote
    );
    let mut envelope = tell(1);
    envelope.set_routed_under(3);
    assert!(slot.deliver(&mut host, SHARD, &id("a"), envelope).is_ok());
    assert_eq!(host.calls(), [Call::RequestAllocation]);
    assert_eq!(slot.generation(), 3);
    assert_eq!(
        slot.set_home(&mut host, SHARD, home(2), me(), false).0,
        HomeChange::Stale
    );
    assert_eq!(host.calls(), []);
    assert_eq!(
        slot.set_home(&mut host, SHARD, home(3), me(), false).0,
        HomeChange::Remote
    );
    assert_eq!(host.calls(), [Call::Forward(3, "a".into(), 1)]);
}

#[test]
fn a_refused_region_fails_what_would_wait_for_a_home() {
    let mut host = Fake::new();
    let mut slot = Slot::unallocated(0);
    deliver(&mut slot, &mut host, "a", 1);
    host.refusal = Some(ShardingError::ShuttingDown);
    let drained = slot.drain_refused();
    assert_eq!(drained.into_iter().map(number).collect::<Vec<_>>(), [1]);
    assert!(matches!(
        slot.deliver(&mut host, SHARD, &id("a"), tell(2)),
        Err((ShardingError::ShuttingDown, Some(_)))
    ));
    assert_eq!(host.calls(), [Call::RequestAllocation]);
}

#[test]
fn a_lost_home_makes_the_next_message_ask_again() {
    let mut host = Fake::new();
    let mut slot = Slot::unallocated(0);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    assert!(!slot.node_lost(&node(9)));
    assert!(slot.node_lost(&node(2)));
    assert_eq!(slot.generation(), 2);
    deliver(&mut slot, &mut host, "a", 1);
    assert_eq!(host.calls(), [Call::RequestAllocation]);
}

#[test]
fn an_entity_finishing_after_its_shard_moved_away_holds_back_its_next_incarnation() {
    // SPEC §13.3's old limit: the shard moves away (no handoff) and comes
    // back before an entity has finished its mailbox. The next incarnation
    // waits for the old one's stop notice instead of running beside it.
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    host.calls();
    let (change, _) = slot.set_home(&mut host, SHARD, home(2), me(), false);
    assert_eq!(change, HomeChange::Remote);
    assert_eq!(host.calls(), [Call::Stop(1)]);
    assert_eq!(
        slot.set_home(&mut host, SHARD, here(3), me(), false).0,
        HomeChange::HostHere
    );
    slot.install(&mut host, SHARD, 3, 2, None, Vec::new())
        .expect("installed");
    deliver(&mut slot, &mut host, "a", 2);
    deliver(&mut slot, &mut host, "b", 3);
    assert_eq!(
        host.calls(),
        [spawn("b", 2), Call::Send(2, 3)],
        "a waits for its finishing incarnation"
    );
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    assert_eq!(host.calls(), [spawn("a", 3), Call::Send(3, 2)]);
}

#[test]
fn an_entity_that_finished_while_its_shard_was_away_is_forgotten() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    host.calls();
    slot.set_home(&mut host, SHARD, here(3), me(), false);
    slot.install(&mut host, SHARD, 3, 2, None, Vec::new())
        .expect("installed");
    deliver(&mut slot, &mut host, "a", 2);
    assert_eq!(host.calls(), [spawn("a", 2), Call::Send(2, 2)]);
    // A stopping region waits for finishing entities apart from the others.
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "c", 1);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    let taken = slot.take();
    assert_eq!(taken.finishing.len(), 1);
    assert!(taken.entities.is_empty() && taken.buffered.is_empty());
}

#[test]
fn remembered_ids_respawn_in_batches_of_the_hosting_that_listed_them() {
    let mut host = Fake::new();
    host.remembers = true;
    host.batch = 2;
    let mut slot = Slot::unallocated(0);
    let ids = vec!["x".to_owned(), "y".to_owned(), "z".to_owned()];
    slot.install(&mut host, SHARD, 1, 7, Some(ids), Vec::new())
        .expect("installed");
    let calls = host.calls();
    let spawned: Vec<_> = calls
        .iter()
        .filter(|c| matches!(c, Call::Spawn(..)))
        .collect();
    assert_eq!(spawned.len(), 2, "{calls:?}");
    assert_eq!(calls.last(), Some(&Call::RespawnLater(7)));
    assert_eq!(calls.len(), 3, "a respawn records nothing: {calls:?}");
    slot.respawn_more(&mut host, SHARD, 6);
    assert_eq!(host.calls(), [], "another hosting's batch");
    slot.respawn_more(&mut host, SHARD, 7);
    let calls = host.calls();
    assert_eq!(
        calls.len(),
        1,
        "the last one, and no more batches: {calls:?}"
    );
    assert!(matches!(calls[0], Call::Spawn(_, 3)));
    // A new id is recorded when a message starts it.
    deliver(&mut slot, &mut host, "w", 1);
    assert_eq!(
        host.calls(),
        [
            spawn("w", 4),
            Call::Record("w".into(), RememberEntitiesOperation::RecordStarted),
            Call::Send(4, 1),
        ]
    );
}

#[test]
fn a_passivation_during_a_handoff_forgets_a_remembered_entity_once() {
    let mut host = Fake::new();
    host.remembers = true;
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    slot.hand_off(&mut host, SHARD, 1);
    host.calls();
    let _ = slot.passivate(&mut host, SHARD, &id("a"), None, false);
    assert_eq!(
        host.calls(),
        [Call::Record(
            "a".into(),
            RememberEntitiesOperation::RecordStopped
        )]
    );
    let _ = slot.passivate(&mut host, SHARD, &id("a"), None, false);
    assert_eq!(host.calls(), []);
}

#[test]
fn a_stopping_region_takes_every_entity_and_fails_what_waited() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    let _ = slot.passivate(&mut host, SHARD, &id("b"), None, false);
    deliver(&mut slot, &mut host, "b", 3);
    let taken = slot.take();
    let mut entities = taken.entities;
    entities.sort();
    assert_eq!(entities, [1, 2]);
    assert_eq!(
        taken.buffered.into_iter().map(number).collect::<Vec<_>>(),
        [3]
    );
    assert!(matches!(
        slot.deliver(&mut host, SHARD, &id("a"), tell(4)),
        Err((ShardingError::ShuttingDown, Some(_)))
    ));
    // A remote home stays: what still arrives is forwarded.
    let mut slot = Slot::unallocated(0);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    slot.take();
    host.calls();
    deliver(&mut slot, &mut host, "a", 5);
    assert_eq!(host.calls(), [Call::Forward(2, "a".into(), 5)]);
}

/// The shard moved away and its new home was lost before the shard came
/// back here: the finishing entity still holds back its next incarnation,
/// and its stop notice is not taken for the next one's.
#[test]
fn a_finishing_entity_outlives_the_loss_of_its_shards_new_home() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    assert!(slot.node_lost(&node(2)));
    host.calls();
    slot.set_home(&mut host, SHARD, here(3), me(), false);
    slot.install(&mut host, SHARD, 3, 2, None, Vec::new())
        .expect("installed");
    deliver(&mut slot, &mut host, "a", 2);
    assert_eq!(host.calls(), [], "waits for incarnation 1");
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    assert_eq!(host.calls(), [spawn("a", 2), Call::Send(2, 2)]);
    // A stale notice of incarnation 1 leaves incarnation 2 alone.
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    deliver(&mut slot, &mut host, "a", 3);
    assert_eq!(host.calls(), [Call::Send(2, 3)]);
}

/// Back here, a finishing entity is still let finish by a stopping region;
/// moved away a second time, it is finishing again (no second stop).
#[test]
fn a_finishing_entity_taken_back_is_still_let_finish() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    slot.set_home(&mut host, SHARD, here(3), me(), false);
    slot.install(&mut host, SHARD, 3, 2, None, Vec::new())
        .expect("installed");
    deliver(&mut slot, &mut host, "b", 2);
    host.calls();
    slot.set_home(&mut host, SHARD, home(4), me(), false);
    assert_eq!(
        host.calls(),
        [Call::Stop(2)],
        "only b is stopped: a was already"
    );
    slot.set_home(&mut host, SHARD, here(5), me(), false);
    slot.install(&mut host, SHARD, 5, 3, None, Vec::new())
        .expect("installed");
    let taken = slot.take();
    let mut finishing = taken.finishing;
    finishing.sort();
    assert_eq!(finishing, [1, 2]);
    assert!(taken.entities.is_empty());
}

#[test]
fn a_proxy_region_takes_no_shard_but_still_sees_stale_homes() {
    let mut host = Fake::new();
    let mut slot = Slot::unallocated(0);
    assert_eq!(
        slot.set_home(&mut host, SHARD, here(2), me(), true).0,
        HomeChange::Unchanged
    );
    slot.set_home(&mut host, SHARD, home(3), me(), true);
    assert_eq!(
        slot.set_home(&mut host, SHARD, here(2), me(), true).0,
        HomeChange::Stale
    );
}

#[test]
fn a_shard_at_its_share_passivates_the_least_recent_entity_and_loses_nothing() {
    let mut host = Fake::new();
    host.share = Some((2, PassivationPolicy::LeastRecentlyUsed));
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    deliver(&mut slot, &mut host, "a", 3);
    host.calls();
    // A third entity: b, the least recently sent to, makes room, stopping
    // after its mailbox; c starts.
    deliver(&mut slot, &mut host, "c", 4);
    assert_eq!(
        host.calls(),
        [
            Call::Stop(2),
            Call::PassivatedByLimit,
            spawn("c", 3),
            Call::Send(3, 4)
        ]
    );
    assert_eq!(slot.live_entities(), 2);
    // What comes for b meanwhile waits, and goes to its next incarnation,
    // which in turn makes room (a is now the least recent).
    deliver(&mut slot, &mut host, "b", 5);
    assert_eq!(host.calls(), [], "waits behind the stop");
    let undelivered = slot.entity_stopped(&mut host, SHARD, &id("b"), 2, None);
    assert!(undelivered.is_empty());
    assert_eq!(
        host.calls(),
        [
            Call::Stop(1),
            Call::PassivatedByLimit,
            spawn("b", 4),
            Call::Send(4, 5)
        ]
    );
    assert_eq!(slot.live_entities(), 2);
}

#[test]
fn a_spawn_that_fails_holds_no_place_under_the_limit() {
    let mut host = Fake::new();
    host.share = Some((2, PassivationPolicy::LeastRecentlyUsed));
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    let undelivered = slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    assert!(undelivered.is_empty(), "a crashed: one place free");
    host.calls();
    host.spawn_fails = true;
    assert!(slot.deliver(&mut host, SHARD, &id("c"), tell(3)).is_err());
    assert_eq!(host.calls(), [spawn("c", 3)], "room without a victim");
    // c never started: d takes the free place, b stays.
    host.spawn_fails = false;
    deliver(&mut slot, &mut host, "d", 4);
    assert_eq!(host.calls(), [spawn("d", 4), Call::Send(3, 4)]);
    assert_eq!(slot.live_entities(), 2);
}

#[test]
fn a_smaller_share_passivates_what_no_longer_fits_and_a_crash_frees_a_place() {
    let mut host = Fake::new();
    host.share = Some((3, PassivationPolicy::LeastRecentlyUsed));
    let mut slot = hosted(&mut host);
    for (n, name) in ["a", "b", "c"].into_iter().enumerate() {
        deliver(&mut slot, &mut host, name, n as u64);
    }
    host.calls();
    host.share = Some((1, PassivationPolicy::LeastRecentlyUsed));
    slot.reshare(&mut host, SHARD, 1);
    assert_eq!(
        host.calls(),
        [
            Call::Stop(1),
            Call::PassivatedByLimit,
            Call::Stop(2),
            Call::PassivatedByLimit
        ]
    );
    assert_eq!(slot.live_entities(), 1);
    // c crashes (its stop notice, no passivation): a new entity starts
    // without passivating anything.
    assert!(
        slot.entity_stopped(&mut host, SHARD, &id("c"), 3, None)
            .is_empty()
    );
    deliver(&mut slot, &mut host, "d", 9);
    assert_eq!(host.calls(), [spawn("d", 4), Call::Send(4, 9)]);
}

/// One step of a region under an active-entity limit, for quickcheck.
#[derive(Clone, Debug)]
enum LimitOp {
    /// A message to entity `id` of shard `shard` (hosting it first if it
    /// is not hosted yet: every share shrinks).
    Deliver { shard: u8, id: u8 },
    /// The oldest stop marker sent is reached: that entity stops.
    Stopped,
}

impl quickcheck::Arbitrary for LimitOp {
    fn arbitrary(g: &mut quickcheck::Gen) -> Self {
        if u8::arbitrary(g) % 3 == 0 {
            LimitOp::Stopped
        } else {
            LimitOp::Deliver {
                shard: u8::arbitrary(g) % 4,
                id: u8::arbitrary(g) % 12,
            }
        }
    }
}

/// Four slots sharing a limit of `limit` as the region does (each hosted
/// shard gets `limit / hosted`), driven by `ops`: the region's live
/// entities never exceed the limit, and once every stop has been reached,
/// every message was enqueued exactly once.
fn a_region_under_a_limit(limit: u8, policy: u8, ops: Vec<LimitOp>) -> bool {
    let limit = usize::from(limit % 8) + 4; // ≥ the four shards
    let policy = [
        PassivationPolicy::LeastRecentlyUsed,
        PassivationPolicy::SegmentedLru,
        PassivationPolicy::WTinyLfu,
    ][usize::from(policy % 3)];
    let mut host = Fake::new();
    let mut slots: Vec<Option<Slot<Mailbox>>> = (0..4).map(|_| None).collect();
    // Mailbox → (slot, id, incarnation); stop markers not yet reached.
    let mut mailboxes: Vec<(usize, String, u64)> = Vec::new();
    let mut stops: std::collections::VecDeque<Mailbox> = Default::default();
    let mut sent = 0u64;
    let mut enqueued: Vec<u64> = Vec::new();
    let mut absorb = |host: &mut Fake,
                      slot: usize,
                      mailboxes: &mut Vec<_>,
                      stops: &mut std::collections::VecDeque<_>| {
        for call in host.calls() {
            match call {
                Call::Spawn(id, incarnation) => mailboxes.push((slot, id, incarnation)),
                Call::Stop(mailbox) => stops.push_back(mailbox),
                Call::Send(_, n) => enqueued.push(n),
                _ => {}
            }
        }
    };
    for op in ops {
        match op {
            LimitOp::Deliver { shard, id: entity } => {
                let s = usize::from(shard);
                if slots[s].is_none() {
                    let hosted = slots.iter().filter(|x| x.is_some()).count() + 1;
                    host.share = Some(((limit / hosted).max(1), policy));
                    let mut slot = Slot::unallocated(0);
                    slot.install(&mut host, ShardId(u32::from(shard)), 1, 1, None, Vec::new());
                    slots[s] = Some(slot);
                    for (i, other) in slots.iter_mut().enumerate() {
                        if let Some(other) = other {
                            other.reshare(&mut host, ShardId(i as u32), (limit / hosted).max(1));
                            absorb(&mut host, i, &mut mailboxes, &mut stops);
                        }
                    }
                }
                sent += 1;
                let slot = slots[s].as_mut().expect("hosted");
                let name = format!("s{shard}-e{entity}");
                if slot
                    .deliver(&mut host, ShardId(u32::from(shard)), &id(&name), tell(sent))
                    .is_err()
                {
                    return false;
                }
                absorb(&mut host, s, &mut mailboxes, &mut stops);
            }
            LimitOp::Stopped => {
                let Some(mailbox) = stops.pop_front() else {
                    continue;
                };
                let (s, name, incarnation) = mailboxes[mailbox as usize - 1].clone();
                let slot = slots[s].as_mut().expect("hosted");
                if !slot
                    .entity_stopped(&mut host, ShardId(s as u32), &id(&name), incarnation, None)
                    .is_empty()
                {
                    return false;
                }
                absorb(&mut host, s, &mut mailboxes, &mut stops);
            }
        }
        let live: usize = slots.iter().flatten().map(Slot::live_entities).sum();
        if live > limit {
            return false;
        }
    }
    while let Some(mailbox) = stops.pop_front() {
        let (s, name, incarnation) = mailboxes[mailbox as usize - 1].clone();
        let slot = slots[s].as_mut().expect("hosted");
        let _ = slot.entity_stopped(&mut host, ShardId(s as u32), &id(&name), incarnation, None);
        absorb(&mut host, s, &mut mailboxes, &mut stops);
    }
    enqueued.sort_unstable();
    enqueued == (1..=sent).collect::<Vec<_>>()
}

quickcheck::quickcheck! {
    fn a_region_under_a_limit_never_exceeds_it_and_loses_nothing(limit: u8, policy: u8, ops: Vec<LimitOp>) -> bool {
        a_region_under_a_limit(limit, policy, ops)
    }
}

/// A state migrated with (or handed over by) entity "a": its byte `b`.
fn state(b: u8) -> Option<MigratedState> {
    Some(MigratedState {
        version: 1,
        bytes: bytes::Bytes::from(vec![b]),
        position: 0,
        deliveries: Vec::new(),
    })
}

fn spawn_from(name: &str, incarnation: u64, b: u8) -> Call {
    Call::SpawnFrom(name.into(), incarnation, vec![b])
}

#[test]
fn a_handoff_keeps_the_states_its_entities_hand_over_for_the_next_home() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    slot.hand_off(&mut host, SHARD, 1);
    deliver(&mut slot, &mut host, "a", 3);
    host.calls();
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, state(7));
    slot.entity_stopped(&mut host, SHARD, &id("b"), 2, state(8));
    assert_eq!(host.calls(), [Call::ShardStopped(1)]);
    assert!(
        slot.take_outgoing().is_none(),
        "kept until the shard moves on"
    );
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    assert_eq!(host.calls(), [Call::Forward(2, "a".into(), 3)]);
    let (to, mut states) = slot.take_outgoing().expect("states for the next home");
    assert_eq!(to, home(2));
    states.sort_by(|x, y| x.0.cmp(&y.0));
    let bytes: Vec<(String, Vec<u8>)> = states
        .into_iter()
        .map(|(id, s)| (id.to_string(), s.bytes.to_vec()))
        .collect();
    assert_eq!(bytes, [("a".into(), vec![7]), ("b".into(), vec![8])]);
    assert!(slot.take_outgoing().is_none(), "given once");
}

#[test]
fn a_shard_that_moves_on_without_a_handoff_keeps_no_states() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    assert!(slot.take_outgoing().is_none());
    // Its entity's late notice (a plain stop hands nothing over) is quiet.
    host.calls();
    assert!(
        slot.entity_stopped(&mut host, SHARD, &id("a"), 1, state(1))
            .is_empty()
    );
    assert_eq!(host.calls(), []);
}

#[test]
fn a_handed_off_shard_with_no_entity_gives_its_next_home_an_empty_set() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    slot.hand_off(&mut host, SHARD, 1);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    let (to, states) = slot.take_outgoing().expect("an answer for the next home");
    assert_eq!((to, states.len()), (home(2), 0));
}

#[test]
fn migrated_states_start_their_entities_at_install_before_the_buffer() {
    let mut host = Fake::new();
    let mut slot: Slot<Mailbox> = Slot::unallocated(0);
    slot.set_home(&mut host, SHARD, here(4), me(), false);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "c", 2);
    host.calls();
    let migrated = vec![(id("a"), state(5).expect("state"))];
    let undelivered = slot
        .install(&mut host, SHARD, 4, 1, None, migrated)
        .expect("installed");
    assert!(undelivered.is_empty());
    assert_eq!(
        host.calls(),
        [
            spawn_from("a", 1, 5),
            Call::Send(1, 1),
            spawn("c", 2),
            Call::Send(2, 2),
        ],
        "a starts from its state before any message; c from the factory"
    );
}

#[test]
fn a_state_migrated_while_an_earlier_incarnation_finishes_starts_the_next_one() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    // Moved away without a handoff: "a" (incarnation 1) finishes its mailbox.
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    slot.set_home(&mut host, SHARD, here(3), me(), false);
    host.calls();
    let migrated = vec![(id("a"), state(9).expect("state"))];
    slot.install(&mut host, SHARD, 3, 2, None, migrated)
        .expect("installed");
    deliver(&mut slot, &mut host, "a", 2);
    assert_eq!(host.calls(), [], "two incarnations never run side by side");
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, None);
    assert_eq!(host.calls(), [spawn_from("a", 2, 9), Call::Send(2, 2)]);
}

#[test]
fn a_handoff_called_off_restarts_its_entities_from_the_states_they_handed_over() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    slot.hand_off(&mut host, SHARD, 1);
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, state(3));
    deliver(&mut slot, &mut host, "a", 3);
    host.calls();
    // Called off before "b" stopped: "a" restarts from its state at once,
    // then what waited; "b" does when its state comes with its notice.
    assert!(slot.call_off_handoff(&mut host, SHARD).is_empty());
    assert_eq!(host.calls(), [spawn_from("a", 3, 3), Call::Send(3, 3)]);
    slot.entity_stopped(&mut host, SHARD, &id("b"), 2, state(4));
    assert_eq!(host.calls(), [spawn_from("b", 4, 4)]);
    assert!(slot.take_outgoing().is_none());
}

#[test]
fn a_shard_that_comes_back_to_its_old_owner_restarts_from_the_kept_states() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    slot.hand_off(&mut host, SHARD, 1);
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, state(6));
    deliver(&mut slot, &mut host, "a", 2);
    host.calls();
    // The coordinator's next home is this node after all.
    let (change, undelivered) = slot.set_home(&mut host, SHARD, here(2), me(), false);
    assert_eq!(change, HomeChange::Unchanged);
    assert!(undelivered.is_empty());
    assert_eq!(host.calls(), [spawn_from("a", 2, 6), Call::Send(2, 2)]);
}

#[test]
fn a_state_from_an_earlier_hostings_handoff_is_never_applied() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    // A handoff stops "a" to move; it is slow; the handoff times out and
    // the shard moves away without waiting for it (a dead-owner move)...
    slot.hand_off(&mut host, SHARD, 1);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    assert!(slot.take_outgoing().is_none(), "not stopped: nothing kept");
    // ...and comes back before "a" has stopped, with a newer state of it.
    slot.set_home(&mut host, SHARD, here(3), me(), false);
    let migrated = vec![(id("a"), state(2).expect("state"))];
    slot.install(&mut host, SHARD, 3, 2, None, migrated)
        .expect("installed");
    host.calls();
    // The old incarnation's notice carries its state of generation 1.
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, state(1));
    assert_eq!(
        host.calls(),
        [spawn_from("a", 2, 2)],
        "the newer state wins"
    );
}

#[test]
fn an_entity_passivated_while_it_stops_to_move_hands_no_state_on() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    slot.hand_off(&mut host, SHARD, 1);
    // "a" asks to be passivated (its idle timeout) before its stop.
    let (result, _) = slot.passivate(&mut host, SHARD, &id("a"), Some(1), false);
    assert!(result.is_ok());
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, state(1));
    slot.entity_stopped(&mut host, SHARD, &id("b"), 2, state(2));
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    let (_, states) = slot.take_outgoing().expect("kept");
    let ids: Vec<String> = states.iter().map(|(id, _)| id.to_string()).collect();
    assert_eq!(ids, ["b"]);
}

#[test]
fn under_a_limit_only_the_shares_room_of_migrated_entities_starts_at_once() {
    let mut host = Fake::new();
    host.share = Some((1, PassivationPolicy::LeastRecentlyUsed));
    let mut slot: Slot<Mailbox> = Slot::unallocated(0);
    slot.set_home(&mut host, SHARD, here(4), me(), false);
    let migrated = vec![
        (id("a"), state(1).expect("state")),
        (id("b"), state(2).expect("state")),
    ];
    slot.install(&mut host, SHARD, 4, 1, None, migrated)
        .expect("installed");
    let calls = host.calls();
    assert_eq!(calls.len(), 1, "one started, none passivated: {calls:?}");
    // The other starts from its state on its first message.
    let other = match &calls[0] {
        Call::SpawnFrom(name, _, _) if name == "a" => ("b", 2),
        _ => ("a", 1),
    };
    deliver(&mut slot, &mut host, other.0, 9);
    let calls = host.calls();
    assert!(
        calls.contains(&spawn_from(other.0, 2, other.1)),
        "{calls:?}"
    );
}

#[test]
fn states_dropped_for_a_missed_move_include_those_of_entities_still_stopping() {
    let mut host = Fake::new();
    let mut slot = hosted(&mut host);
    deliver(&mut slot, &mut host, "a", 1);
    deliver(&mut slot, &mut host, "b", 2);
    slot.hand_off(&mut host, SHARD, 1);
    slot.entity_stopped(&mut host, SHARD, &id("a"), 1, state(1));
    // A newer state is elsewhere (this node missed a move): what is kept,
    // and what "b" (still stopping) will hand over, is not used.
    assert_eq!(slot.drop_states(), 1);
    assert!(slot.call_off_handoff(&mut host, SHARD).is_empty());
    host.calls();
    slot.entity_stopped(&mut host, SHARD, &id("b"), 2, state(2));
    deliver(&mut slot, &mut host, "b", 3);
    assert_eq!(host.calls(), [spawn("b", 3), Call::Send(3, 3)]);
}

#[test]
fn a_shard_allocated_here_is_this_nodes_in_the_replica_before_it_is_installed() {
    let mut host = Fake::new();
    let mut slot = Slot::unallocated(0);
    deliver(&mut slot, &mut host, "a", 1);
    assert_eq!(slot.home(Some(me())), None, "waiting for a home");
    let (change, undelivered) = slot.set_home(&mut host, SHARD, here(4), me(), false);
    assert_eq!(change, HomeChange::HostHere);
    assert!(undelivered.is_empty());
    // Not installed yet (the region pulls migrated states first), and
    // already this node's: a coordinator seeded from this replica must not
    // allocate it again.
    assert!(!slot.is_local());
    assert_eq!(slot.home(Some(me())), Some(here(4)));
    // A shard routed elsewhere, then allocated here, likewise.
    let mut slot = Slot::unallocated(0);
    slot.set_home(&mut host, SHARD, home(2), me(), false);
    slot.set_home(&mut host, SHARD, here(3), me(), false);
    assert_eq!(slot.home(Some(me())), Some(here(3)));
    // A region that knows no cluster names no home of its own.
    assert_eq!(slot.home(None), None);
}
