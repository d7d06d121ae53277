//! The single-node runtime: routing, order, panics, passivation, buffering,
//! timeouts, shutdown, registration errors and remember-entities.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{FileStore, FileStoreFsyncPolicy, Processed};

#[allow(dead_code)]
#[path = "../protocols/counter.rs"]
mod counter;
#[allow(dead_code)]
#[path = "../protocols/probe.rs"]
mod probe;

use counter::{Add, Counter, CounterEntity, Get};
use probe::*;

const LONG: Duration = Duration::from_secs(10);

async fn probe_system(
    config: ShardingConfig,
) -> (
    ShardedSystem,
    Arc<Probes>,
    tokio::sync::mpsc::UnboundedReceiver<Event>,
) {
    let system = ShardedSystem::builder()
        .config(config)
        .start()
        .await
        .unwrap();
    let (probes, events) = Probes::new();
    system
        .entity_type::<ProbeEntity>()
        .register(probes.factory())
        .await
        .unwrap();
    (system, probes, events)
}

/// A single-node system with the guide's counter, default settings.
async fn counter_system() -> ShardedSystem {
    let system = ShardedSystem::builder().start().await.unwrap();
    system
        .entity_type::<CounterEntity>()
        .register(|_| CounterEntity::default())
        .await
        .unwrap();
    system
}

fn no_idle() -> ShardingConfig {
    ShardingConfig::builder()
        .passivation_idle_timeout(None)
        .build()
}

/// The futures of `ask` and `tell` hold what the wait for a reply needs,
/// not every path's state (SPEC §13.5): a caller keeping many asks in
/// flight allocates each future. In a debug build this test measured 704
/// and 336 bytes before the change that set these bounds, 288 and 56 after
/// (W1's `Ping` ask in a release build: 768 bytes before, 320 after).
#[tokio::test]
async fn the_futures_of_ask_and_tell_stay_small() {
    let system = counter_system().await;
    let counter = system.entity_ref::<Counter>("c-1");
    let asked = counter.ask(Get, LONG);
    let told = counter.tell(Add(1));
    let (ask_bytes, tell_bytes) = (std::mem::size_of_val(&asked), std::mem::size_of_val(&told));
    eprintln!("ask future: {ask_bytes} bytes, tell future: {tell_bytes} bytes");
    assert!(ask_bytes <= 448, "the ask future grew to {ask_bytes} bytes");
    assert!(
        tell_bytes <= 128,
        "the tell future grew to {tell_bytes} bytes"
    );
    told.await.unwrap();
    assert_eq!(asked.await.unwrap(), 1);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tell_then_ask_reaches_the_same_entity() {
    let system = counter_system().await;
    let a = system.entity_ref::<Counter>("a");
    let b = system.entity_ref::<Counter>("b");
    a.tell(Add(2)).await.unwrap();
    a.tell(Add(5)).await.unwrap();
    b.tell(Add(100)).await.unwrap();
    assert_eq!(a.ask(Get, LONG).await.unwrap(), 7);
    assert_eq!(b.ask(Get, LONG).await.unwrap(), 100);
    // A second ref to the same id reaches the same entity.
    assert_eq!(
        system
            .entity_ref::<Counter>("a")
            .ask(Get, LONG)
            .await
            .unwrap(),
        7
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entity_spawns_on_first_message_with_its_context() {
    let (system, _probes, mut events) = probe_system(no_idle()).await;
    let r = system.entity_ref::<Probe>("cart-42");
    assert_eq!(
        system.live_entities::<Probe>(r.shard_id()),
        0,
        "nothing spawned before the first message"
    );
    let (type_name, id, shard) = r.ask(Where, LONG).await.unwrap();
    assert_eq!(
        next_event(&mut events, LONG).await,
        Event::Started("cart-42".into(), 1)
    );
    assert_eq!(type_name, "probe");
    assert_eq!(id, "cart-42");
    assert_eq!(shard, r.shard_id().0);
    assert_eq!(shard, DefaultShardExtractor.shard_id("cart-42", 128).0);
    assert_eq!(system.live_entities::<Probe>(r.shard_id()), 1);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_awaiting_sender_keeps_per_entity_order() {
    let (system, probes, _events) = probe_system(no_idle()).await;
    let ids = ["o-1", "o-2", "o-3"];
    let refs: Vec<_> = ids
        .iter()
        .map(|id| system.entity_ref::<Probe>(*id))
        .collect();
    for seq in 0..600u64 {
        let r = &refs[(seq % 3) as usize];
        if seq % 7 == 0 {
            r.ask(Total, LONG).await.unwrap();
        } else {
            r.tell(Record(seq)).await.unwrap();
        }
    }
    for r in &refs {
        r.ask(Total, LONG).await.unwrap();
    }
    for (i, id) in ids.iter().enumerate() {
        let seqs: Vec<u64> = probes.log_of(id).into_iter().map(|(_, s)| s).collect();
        let expected: Vec<u64> = (0..600u64)
            .filter(|s| s % 3 == i as u64 && s % 7 != 0)
            .collect();
        assert_eq!(
            seqs, expected,
            "entity {id} saw its messages out of order or lost some"
        );
    }
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_restarts_only_that_entity() {
    let (system, _probes, mut events) = probe_system(no_idle()).await;
    let victim = system.entity_ref::<Probe>("victim");
    let sibling = system.entity_ref::<Probe>("sibling");
    assert_eq!(victim.ask(Total, LONG).await.unwrap(), 1);
    assert_eq!(victim.ask(Total, LONG).await.unwrap(), 2);
    assert_eq!(sibling.ask(Total, LONG).await.unwrap(), 1);

    // The panicking ask gets an error naming the panic.
    match victim.ask(Boom, LONG).await {
        Err(ShardingError::EntityPanicked {
            type_name,
            entity_id,
            panic,
        }) => {
            assert_eq!((type_name, entity_id.as_str()), ("probe", "victim"));
            assert!(panic.contains("boom in victim"), "panic message: {panic}");
        }
        other => panic!("expected EntityPanicked, got {other:?}"),
    }
    // The victim restarted from its factory (state reset); the sibling kept its state.
    assert_eq!(victim.ask(Total, LONG).await.unwrap(), 1);
    assert_eq!(sibling.ask(Total, LONG).await.unwrap(), 2);

    // A panic in a tell handler: later messages, already queued, are still served.
    victim.tell(BoomTell).await.unwrap();
    victim.tell(Record(1)).await.unwrap();
    assert_eq!(
        victim.ask(Total, LONG).await.unwrap(),
        2,
        "Record then Total on the fresh incarnation"
    );

    let mut seen = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(200), events.recv()).await {
        seen.push(e);
    }
    // Factory ran for victim 3 times (first, after Boom, after BoomTell) and for sibling once.
    let starts = |id: &str| {
        seen.iter()
            .filter(|e| matches!(e, Event::Started(i, _) if i == id))
            .count()
    };
    assert_eq!(starts("victim"), 3, "events: {seen:?}");
    assert_eq!(starts("sibling"), 1, "events: {seen:?}");
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_errors_reach_the_asker() {
    let (system, _probes, _events) = probe_system(no_idle()).await;
    let r = system.entity_ref::<Probe>("e");
    assert_eq!(
        r.ask(Fail, LONG).await,
        Err(ShardingError::Handler("refused by the entity".into()))
    );
    assert_eq!(
        r.ask(Total, LONG).await.unwrap(),
        1,
        "a handler error does not restart the entity"
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_entities_are_passivated_and_respawn_on_demand() {
    let config = ShardingConfig::builder()
        .passivation_idle_timeout(Some(Duration::from_millis(100)))
        .build();
    let (system, _probes, mut events) = probe_system(config).await;
    let r = system.entity_ref::<Probe>("sleepy");
    assert_eq!(r.ask(Total, LONG).await.unwrap(), 1);
    expect_event(&mut events, Event::Started("sleepy".into(), 1), LONG).await;
    expect_event(&mut events, Event::Stopped("sleepy".into(), 1), LONG).await;
    // Fresh incarnation on the next message.
    assert_eq!(r.ask(Total, LONG).await.unwrap(), 1);
    expect_event(&mut events, Event::Started("sleepy".into(), 2), LONG).await;
    let by = system
        .shard_region_state::<Probe>()
        .expect("registered")
        .passivations;
    assert!(by.idle >= 1 && by.limit == 0 && by.explicit == 0, "{by:?}");
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_passivation_hands_later_messages_to_the_next_incarnation() {
    let (system, probes, mut events) = probe_system(no_idle()).await;
    let r = system.entity_ref::<Probe>("p");
    for seq in 0..50 {
        r.tell(Record(seq)).await.unwrap();
    }
    r.passivate().await.unwrap();
    for seq in 50..100 {
        r.tell(Record(seq)).await.unwrap();
    }
    let total = r.ask(Total, LONG).await.unwrap();
    assert_eq!(total, 51, "50 records and this ask on the new incarnation");
    expect_event(&mut events, Event::Stopped("p".into(), 1), LONG).await;
    let log = probes.log_of("p");
    assert_eq!(
        log.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
        (0..100).collect::<Vec<_>>(),
        "none lost, none reordered"
    );
    assert!(
        log[..50].iter().all(|(inc, _)| *inc == 1),
        "before passivate: first incarnation"
    );
    assert!(
        log[50..].iter().all(|(inc, _)| *inc == 2),
        "after passivate: second incarnation"
    );
    let by = system
        .shard_region_state::<Probe>()
        .expect("registered")
        .passivations;
    assert_eq!((by.idle, by.limit, by.explicit), (0, 0, 1));
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arriving_during_passivation_are_buffered_not_dropped() {
    let (system, probes, mut events) = probe_system(no_idle()).await;
    let r = system.entity_ref::<Probe>("busy");
    r.tell(Record(0)).await.unwrap();
    // Park the first incarnation inside a handler.
    let holder = {
        let r = r.clone();
        tokio::spawn(async move { r.ask(Hold, LONG).await })
    };
    expect_event(&mut events, Event::Holding("busy".into(), 1), LONG).await;
    // Passivation begins while it is busy: from here on, messages wait in the
    // passivation buffer, not in the old mailbox.
    r.passivate().await.unwrap();
    for seq in 1..200 {
        r.tell(Record(seq)).await.unwrap();
    }
    assert_eq!(
        system.live_entities::<Probe>(r.shard_id()),
        0,
        "the entity is passivating, not live"
    );
    probes.gate.add_permits(1);
    holder.await.unwrap().unwrap();
    expect_event(&mut events, Event::Stopped("busy".into(), 1), LONG).await;
    r.ask(Total, LONG).await.unwrap();
    let log = probes.log_of("busy");
    assert_eq!(
        log.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
        (0..200).collect::<Vec<_>>()
    );
    assert_eq!(log[0].0, 1);
    assert!(
        log[1..].iter().all(|(inc, _)| *inc == 2),
        "buffered messages went to the next incarnation: {log:?}"
    );
    system.shutdown().await;
}

// A current-thread runtime: the region actor cannot run between these sends,
// so the shard stays unallocated and the buffer fills deterministically.
#[tokio::test(flavor = "current_thread")]
async fn allocation_buffer_overflow_is_reported_and_nothing_accepted_is_lost() {
    let config = ShardingConfig::builder()
        .allocation_buffer(4)
        .passivation_idle_timeout(None)
        .build();
    let (system, probes, _events) = probe_system(config).await;
    let r = system.entity_ref::<Probe>("fresh");
    for seq in 0..4 {
        r.tell(Record(seq)).await.unwrap();
    }
    match r.tell(Record(4)).await {
        Err(ShardingError::BufferOverflow {
            type_name,
            shard_id,
        }) => {
            assert_eq!(type_name, "probe");
            assert_eq!(shard_id, r.shard_id());
        }
        other => panic!("expected BufferOverflow, got {other:?}"),
    }
    // Once the region actor runs, the shard is allocated and the four accepted
    // messages are delivered, in order.
    tokio::time::timeout(LONG, async {
        while system.live_entities::<Probe>(r.shard_id()) == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("shard never allocated");
    assert_eq!(r.ask(Total, LONG).await.unwrap(), 5);
    assert_eq!(
        probes
            .log_of("fresh")
            .iter()
            .map(|(_, s)| *s)
            .collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_times_out_with_a_clear_error() {
    let (system, probes, _events) = probe_system(no_idle()).await;
    let r = system.entity_ref::<Probe>("slow");
    match r.ask(Hold, Duration::from_millis(50)).await {
        Err(ShardingError::AskTimeout {
            type_name,
            entity_id,
            timeout,
        }) => {
            assert_eq!(
                (type_name, entity_id.as_str(), timeout),
                ("probe", "slow", Duration::from_millis(50))
            );
        }
        other => panic!("expected AskTimeout, got {other:?}"),
    }
    probes.gate.add_permits(1);
    assert_eq!(
        r.ask(Total, LONG).await.unwrap(),
        2,
        "the timed-out Hold was still processed"
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_pending_asks_instead_of_hanging() {
    let timeout = Duration::from_millis(200);
    let config = ShardingConfig::builder()
        .passivation_idle_timeout(None)
        .shutdown_timeout(timeout)
        .build();
    let (system, _probes, mut events) = probe_system(config).await;
    let r = system.entity_ref::<Probe>("stuck");
    let held = {
        let r = r.clone();
        tokio::spawn(async move { r.ask(Hold, Duration::from_secs(60)).await })
    };
    expect_event(&mut events, Event::Holding("stuck".into(), 1), LONG).await;
    // Queued behind the held message; the ask is enqueued before it returns a future to poll.
    let queued = {
        let r = r.clone();
        tokio::spawn(async move { r.ask(Total, Duration::from_secs(60)).await })
    };
    tokio::time::timeout(LONG, async {
        while system.live_entities::<Probe>(r.shard_id()) == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    tokio::task::yield_now().await;
    let started = std::time::Instant::now();
    tokio::time::timeout(LONG, system.shutdown())
        .await
        .expect("shutdown hung");
    assert!(
        started.elapsed() >= timeout,
        "the stuck handler was given the shutdown timeout before the kill"
    );
    let held = tokio::time::timeout(LONG, held)
        .await
        .expect("held ask hung")
        .unwrap();
    // Its handler had begun when it was killed: it may have been
    // processed, and the error says so.
    assert_eq!(
        held,
        Err(ShardingError::HandlerInterrupted {
            type_name: "probe",
            entity_id: "stuck".into()
        })
    );
    assert_eq!(held.unwrap_err().processed(), Processed::Maybe);
    let queued = tokio::time::timeout(LONG, queued)
        .await
        .expect("queued ask hung")
        .unwrap();
    assert_eq!(queued, Err(ShardingError::ShuttingDown));
    assert_eq!(r.tell(Record(1)).await, Err(ShardingError::ShuttingDown));
    assert_eq!(
        system
            .entity_ref::<Probe>("new-after-shutdown")
            .tell(Record(1))
            .await,
        Err(ShardingError::ShuttingDown)
    );
    assert!(
        system
            .entity_type::<CounterEntity>()
            .register(|_| CounterEntity::default())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_errors_are_clear() {
    let system = ShardedSystem::builder().start().await.unwrap();
    assert_eq!(
        system.entity_ref::<Counter>("x").tell(Add(1)).await,
        Err(ShardingError::NotRegistered {
            type_name: "counter"
        })
    );
    system
        .entity_type::<CounterEntity>()
        .register(|_| CounterEntity::default())
        .await
        .unwrap();
    assert_eq!(
        system
            .entity_type::<CounterEntity>()
            .register(|_| CounterEntity::default())
            .await,
        Err(ShardingError::AlreadyRegistered {
            type_name: "counter"
        })
    );
    assert!(matches!(
        ShardedSystem::builder()
            .num_shards(0)
            .start()
            .await
            .map(|_| ()),
        Err(ShardingError::InvalidConfig(_))
    ));
    system.shutdown().await;
}

/// Ids of the form `"<shard>/<rest>"` carry their own shard.
#[derive(Debug, Default)]
pub struct PrefixExtractor;

impl ShardExtractor for PrefixExtractor {
    fn shard_id(&self, entity_id: &str, _num_shards: u32) -> ShardId {
        ShardId(
            entity_id
                .split('/')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0),
        )
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WhichShard;

protocol! {
    /// Entities placed by their id's prefix.
    pub protocol Tenants = "tenants" (extractor = PrefixExtractor) {
        ask WhichShard -> u32;
    }
}

struct Tenant;
impl Entity for Tenant {
    type Protocol = Tenants;
}
impl Handler<WhichShard> for Tenant {
    async fn handle(&mut self, _msg: WhichShard, ctx: &EntityContext) -> ShardingResult<u32> {
        // A system without a cluster node: no node to name.
        if ctx.node().is_some() {
            return Err(ShardingError::Handler(
                "a node on a single-node system".into(),
            ));
        }
        Ok(ctx.shard_id().0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_can_name_its_own_extractor() {
    let system = ShardedSystem::builder()
        .num_shards(16)
        .start()
        .await
        .unwrap();
    system
        .entity_type::<Tenant>()
        .register(|_| Tenant)
        .await
        .unwrap();
    let r = system.entity_ref::<Tenants>("7/alice");
    assert_eq!(r.shard_id(), ShardId(7));
    assert_eq!(r.ask(WhichShard, LONG).await.unwrap(), 7);
    match system
        .entity_ref::<Tenants>("99/bob")
        .ask(WhichShard, LONG)
        .await
    {
        Err(ShardingError::InvalidShard {
            shard_id,
            num_shards,
            ..
        }) => assert_eq!((shard_id, num_shards), (ShardId(99), 16)),
        other => panic!("expected InvalidShard, got {other:?}"),
    }
    system.shutdown().await;
}

/// Counts every serialization; the local path must never serialize.
#[derive(Debug, Deserialize)]
pub struct Tracked(pub u64);

static SERIALIZED: AtomicUsize = AtomicUsize::new(0);

impl Serialize for Tracked {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        SERIALIZED.fetch_add(1, Ordering::SeqCst);
        s.serialize_u64(self.0)
    }
}

protocol! {
    /// Echoes a tracked value.
    pub protocol Echo = "echo" {
        ask Tracked -> u64;
    }
}

struct Echoer;
impl Entity for Echoer {
    type Protocol = Echo;
}
impl Handler<Tracked> for Echoer {
    async fn handle(&mut self, msg: Tracked, _ctx: &EntityContext) -> ShardingResult<u64> {
        Ok(msg.0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_messages_are_never_serialized() {
    let system = ShardedSystem::builder().start().await.unwrap();
    system
        .entity_type::<Echoer>()
        .register(|_| Echoer)
        .await
        .unwrap();
    for i in 0..100 {
        assert_eq!(
            system
                .entity_ref::<Echo>(format!("e{}", i % 10))
                .ask(Tracked(i), LONG)
                .await
                .unwrap(),
            i
        );
    }
    assert_eq!(SERIALIZED.load(Ordering::SeqCst), 0);
    // The counter itself works: serializing by hand is counted.
    let _ = ciborium::into_writer(&Tracked(1), Vec::new());
    assert_eq!(SERIALIZED.load(Ordering::SeqCst), 1);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remembered_entities_respawn_when_their_shard_starts() {
    let store = InMemoryStore::new();
    let config = no_idle();
    {
        let system = ShardedSystem::builder()
            .config(config.clone())
            .store(store.clone())
            .start()
            .await
            .unwrap();
        let (probes, _events) = Probes::new();
        system
            .entity_type::<ProbeEntity>()
            .remembered()
            .register(probes.factory())
            .await
            .unwrap();
        for id in ["r-1", "r-2", "r-3"] {
            let entity = system.entity_ref::<Probe>(id);
            entity.tell(Record(0)).await.unwrap();
            // A tell returns once the message is in its region, where it may
            // wait for its shard to start; the ask returns once the entity
            // has handled it, so its start is queued before the flush below
            // (a message still waiting at shutdown fails, and its entity
            // never starts).
            entity.ask(Total, LONG).await.unwrap();
        }
        let r3 = system.entity_ref::<Probe>("r-3");
        r3.passivate().await.unwrap();
        // Records reach the store behind a write-behind queue.
        system.flush_remember_entities().await.unwrap();
        let shard = r3.shard_id();
        assert!(
            !store
                .list_entities_for_shard("probe", shard)
                .unwrap()
                .contains(&"r-3".to_string()),
            "passivated ids are forgotten"
        );
        system.shutdown().await;
    }
    let mut remembered: Vec<String> = store
        .list_shards("probe")
        .unwrap()
        .into_iter()
        .flat_map(|s| store.list_entities_for_shard("probe", s).unwrap())
        .collect();
    remembered.sort();
    assert_eq!(remembered, vec!["r-1".to_string(), "r-2".to_string()]);

    // A new system over the same store respawns r-1 and r-2 with no message sent.
    let system = ShardedSystem::builder()
        .config(config)
        .store(store.clone())
        .start()
        .await
        .unwrap();
    let (probes, mut events) = Probes::new();
    system
        .entity_type::<ProbeEntity>()
        .remembered()
        .register(probes.factory())
        .await
        .unwrap();
    let mut started = Vec::new();
    while started.len() < 2 {
        if let Event::Started(id, _) = next_event(&mut events, LONG).await {
            started.push(id);
        }
    }
    started.sort();
    assert_eq!(started, vec!["r-1".to_string(), "r-2".to_string()]);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_store_ids_survive_into_a_new_store_on_the_same_directory() {
    let dir = tempfile::tempdir().unwrap();
    let open = || FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).unwrap();
    {
        let system = ShardedSystem::builder()
            .config(no_idle())
            .store(open())
            .start()
            .await
            .unwrap();
        let (probes, _events) = Probes::new();
        system
            .entity_type::<ProbeEntity>()
            .remembered()
            .register(probes.factory())
            .await
            .unwrap();
        for id in ["f-1", "f-2", "f-3"] {
            let r = system.entity_ref::<Probe>(id);
            r.tell(Record(0)).await.unwrap();
            r.ask(Total, LONG).await.unwrap();
        }
        system.entity_ref::<Probe>("f-2").passivate().await.unwrap();
        system.shutdown().await;
    }
    // A new process would open a new store on the same directory.
    let system = ShardedSystem::builder()
        .config(no_idle())
        .store(open())
        .start()
        .await
        .unwrap();
    let (probes, mut events) = Probes::new();
    system
        .entity_type::<ProbeEntity>()
        .remembered()
        .register(probes.factory())
        .await
        .unwrap();
    let mut started = Vec::new();
    while started.len() < 2 {
        if let Event::Started(id, _) = next_event(&mut events, LONG).await {
            started.push(id);
        }
    }
    started.sort();
    assert_eq!(started, vec!["f-1".to_string(), "f-3".to_string()]);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_before_handle_returns_its_future_is_caught_too() {
    let (system, _probes, _events) = probe_system(no_idle()).await;
    let r = system.entity_ref::<Probe>("early");
    r.ask(Total, LONG).await.unwrap();
    r.tell(Record(7)).await.unwrap();
    match r.ask(EarlyBoom, LONG).await {
        Err(ShardingError::EntityPanicked { panic, .. }) => {
            assert!(panic.contains("early boom"), "{panic}")
        }
        other => panic!("expected EntityPanicked, got {other:?}"),
    }
    assert_eq!(
        r.ask(Total, LONG).await.unwrap(),
        1,
        "restarted in place, mailbox kept"
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_factory_panic_fails_that_incarnation_and_the_next_message_respawns() {
    let (system, probes, _events) = probe_system(no_idle()).await;
    // Build 1 (first spawn) and build 3 (rebuild after a handler panic) fail.
    probes.panicking_builds.lock().unwrap().extend([1, 3]);
    let r = system.entity_ref::<Probe>("fragile");
    assert_eq!(
        r.ask(Total, LONG).await,
        Err(ShardingError::EntityStopped {
            type_name: "probe",
            entity_id: "fragile".into()
        })
    );
    assert_eq!(r.ask(Total, LONG).await.unwrap(), 1, "build 2 serves");
    assert!(matches!(
        r.ask(Boom, LONG).await,
        Err(ShardingError::EntityPanicked { .. })
    ));
    // The rebuild (build 3) panicked, so that actor stopped; build 4 serves.
    let answer = tokio::time::timeout(LONG, async {
        loop {
            match r.ask(Total, LONG).await {
                Ok(n) => return n,
                Err(ShardingError::EntityStopped { .. }) => continue,
                Err(other) => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .expect("never respawned");
    assert_eq!(answer, 1);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_passivation_buffer_overflows_without_losing_what_it_holds() {
    let config = ShardingConfig::builder()
        .allocation_buffer(3)
        .passivation_idle_timeout(None)
        .build();
    let (system, probes, mut events) = probe_system(config).await;
    let r = system.entity_ref::<Probe>("full");
    let holder = {
        let r = r.clone();
        tokio::spawn(async move { r.ask(Hold, LONG).await })
    };
    expect_event(&mut events, Event::Holding("full".into(), 1), LONG).await;
    r.passivate().await.unwrap();
    for seq in 0..3 {
        r.tell(Record(seq)).await.unwrap();
    }
    assert!(matches!(
        r.tell(Record(3)).await,
        Err(ShardingError::BufferOverflow {
            type_name: "probe",
            ..
        })
    ));
    probes.gate.add_permits(1);
    holder.await.unwrap().unwrap();
    // The Hold reply comes before the passivation completes: wait for the
    // next incarnation (built while the buffer is replayed) before asking,
    // or the ask could meet the still-full buffer.
    expect_event(&mut events, Event::Started("full".into(), 2), LONG).await;
    r.ask(Total, LONG).await.unwrap();
    assert_eq!(
        probes
            .log_of("full")
            .iter()
            .map(|(_, s)| *s)
            .collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_passivation_fails_what_waits() {
    let config = ShardingConfig::builder()
        .passivation_idle_timeout(None)
        .shutdown_timeout(Duration::from_millis(100))
        .build();
    let (system, _probes, mut events) = probe_system(config).await;
    let r = system.entity_ref::<Probe>("leaving");
    let held = {
        let r = r.clone();
        tokio::spawn(async move { r.ask(Hold, Duration::from_secs(60)).await })
    };
    expect_event(&mut events, Event::Holding("leaving".into(), 1), LONG).await;
    r.passivate().await.unwrap();
    let buffered = {
        let r = r.clone();
        tokio::spawn(async move { r.ask(Total, Duration::from_secs(60)).await })
    };
    tokio::time::timeout(LONG, system.shutdown())
        .await
        .expect("shutdown hung");
    let held = tokio::time::timeout(LONG, held)
        .await
        .expect("the held ask hung")
        .unwrap();
    assert_eq!(
        held,
        Err(ShardingError::HandlerInterrupted {
            type_name: "probe",
            entity_id: "leaving".into()
        })
    );
    let buffered = tokio::time::timeout(LONG, buffered)
        .await
        .expect("the buffered ask hung")
        .unwrap();
    assert_eq!(buffered, Err(ShardingError::ShuttingDown));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_racing_registration_are_all_delivered() {
    let system = ShardedSystem::builder()
        .passivation_idle_timeout(None)
        .start()
        .await
        .unwrap();
    let senders: Vec<_> = (0..4u64)
        .map(|i| {
            let system = system.clone();
            tokio::spawn(async move {
                let r = system.entity_ref::<Counter>(format!("race-{i}"));
                let mut sent = 0;
                while sent < 50 {
                    match r.tell(Add(1)).await {
                        Ok(()) => sent += 1,
                        Err(ShardingError::NotRegistered { .. }) => tokio::task::yield_now().await,
                        Err(other) => panic!("unexpected {other:?}"),
                    }
                }
            })
        })
        .collect();
    tokio::task::yield_now().await;
    system
        .entity_type::<CounterEntity>()
        .register(|_| CounterEntity::default())
        .await
        .unwrap();
    for s in senders {
        tokio::time::timeout(LONG, s)
            .await
            .expect("sender stuck")
            .unwrap();
    }
    for i in 0..4 {
        assert_eq!(
            system
                .entity_ref::<Counter>(format!("race-{i}"))
                .ask(Get, LONG)
                .await
                .unwrap(),
            50
        );
    }
    system.shutdown().await;
}

/// With an active-entity limit, a region never holds more live entities
/// than the limit, shared over its shards as they start, passivating by
/// the policy to make room; every message still reaches an entity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entity_limit_bounds_the_live_entities_and_loses_no_message() {
    for policy in [
        PassivationPolicy::LeastRecentlyUsed,
        PassivationPolicy::SegmentedLru,
        PassivationPolicy::WTinyLfu,
    ] {
        let config = ShardingConfig::builder()
            .num_shards(4)
            .passivation_idle_timeout(None)
            .entity_limit(Some(EntityLimit::new(8).with_policy(policy)))
            .build();
        let system = ShardedSystem::builder()
            .config(config)
            .start()
            .await
            .unwrap();
        system
            .entity_type::<CounterEntity>()
            .register(|_| CounterEntity::default())
            .await
            .unwrap();
        let mut most = 0;
        for round in 0..400u64 {
            // Skewed: ids 0..4 every other round, the rest a scan of 100.
            let id = if round % 2 == 0 {
                round / 2 % 4
            } else {
                4 + round % 100
            };
            let entity = system.entity_ref::<Counter>(format!("e{id}"));
            entity.tell(Add(1)).await.unwrap();
            // Nothing starts between the tell and the ask (one sender, no
            // idle timeout), so both reach one incarnation: a count of 0
            // means the Add was lost.
            let count = entity.ask(Get, LONG).await.unwrap();
            assert!(count >= 1, "{policy:?}: round {round}: the Add was lost");
            let state = system.shard_region_state::<Counter>().expect("registered");
            most = most.max(state.shards.values().sum::<usize>());
            assert_eq!(state.entity_limit, Some(8));
        }
        let state = system.shard_region_state::<Counter>().expect("registered");
        assert!(most <= 8, "{policy:?}: {most} live entities, limit 8");
        let by = state.passivations;
        assert!(by.limit > 0, "{policy:?}: nothing passivated");
        assert_eq!((by.idle, by.explicit), (0, 0), "{policy:?}");
        system.shutdown().await;
    }
}

/// `shard_region_state_with_ids` names each hosted shard's live entities,
/// ascending, cut at the limit asked (the least ids kept, the cut shards
/// named), read with the same counts as `shards`; a passivated entity
/// leaves its list and a message brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_entity_ids_of_each_shard_are_listed_up_to_a_limit() {
    use std::collections::{BTreeMap, BTreeSet};

    let config = ShardingConfig::builder()
        .num_shards(4)
        .passivation_idle_timeout(None)
        .build();
    let system = ShardedSystem::builder()
        .config(config)
        .start()
        .await
        .unwrap();
    system
        .entity_type::<CounterEntity>()
        .register(|_| CounterEntity::default())
        .await
        .unwrap();
    assert!(
        system.shard_region_state_with_ids::<Probe>(10).is_none(),
        "a type not registered here has no state"
    );

    let mut expected: BTreeMap<ShardId, Vec<String>> = BTreeMap::new();
    for i in 0..30 {
        let id = format!("e{i:02}");
        let entity = system.entity_ref::<Counter>(id.clone());
        entity.tell(Add(1)).await.unwrap();
        assert_eq!(entity.ask(Get, LONG).await.unwrap(), 1);
        expected.entry(entity.shard_id()).or_default().push(id);
    }
    for ids in expected.values_mut() {
        ids.sort();
    }
    assert!(expected.len() > 1, "30 ids over 4 shards: {expected:?}");

    // Room for all: every list whole, none cut, as many as counted.
    let state = system
        .shard_region_state_with_ids::<Counter>(1_000)
        .expect("registered");
    assert_eq!(state.entity_ids, expected);
    assert!(state.entity_ids_truncated.is_empty());
    for (shard, ids) in &state.entity_ids {
        assert_eq!(state.shards.get(shard), Some(&ids.len()), "shard {shard:?}");
    }

    // Two a shard: the two least of each, and the shards with more named.
    let state = system
        .shard_region_state_with_ids::<Counter>(2)
        .expect("registered");
    let least_two: BTreeMap<ShardId, Vec<String>> = expected
        .iter()
        .map(|(shard, ids)| (*shard, ids.iter().take(2).cloned().collect()))
        .collect();
    assert_eq!(state.entity_ids, least_two);
    let more_than_two: BTreeSet<ShardId> = expected
        .iter()
        .filter(|(_, ids)| ids.len() > 2)
        .map(|(shard, _)| *shard)
        .collect();
    assert!(!more_than_two.is_empty());
    assert_eq!(state.entity_ids_truncated, more_than_two);

    // None asked: every hosted shard listed empty, every one cut.
    let state = system
        .shard_region_state_with_ids::<Counter>(0)
        .expect("registered");
    assert!(state.entity_ids.values().all(Vec::is_empty));
    assert_eq!(
        state.entity_ids.keys().collect::<Vec<_>>(),
        expected.keys().collect::<Vec<_>>()
    );
    assert_eq!(
        state.entity_ids_truncated,
        expected.keys().copied().collect::<BTreeSet<_>>()
    );

    // The plain state lists no ids.
    let plain = system.shard_region_state::<Counter>().expect("registered");
    assert!(plain.entity_ids.is_empty() && plain.entity_ids_truncated.is_empty());

    // A passivated entity leaves its shard's list; a message brings it back.
    let gone = system.entity_ref::<Counter>("e07");
    let shard = gone.shard_id();
    gone.passivate().await.unwrap();
    let deadline = std::time::Instant::now() + LONG;
    loop {
        let state = system
            .shard_region_state_with_ids::<Counter>(1_000)
            .expect("registered");
        let listed = &state.entity_ids[&shard];
        if !listed.iter().any(|id| id == "e07") {
            let mut rest = expected[&shard].clone();
            rest.retain(|id| id != "e07");
            assert_eq!(listed, &rest, "only the passivated entity left");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "e07 still listed after passivation: {listed:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(gone.ask(Get, LONG).await.unwrap(), 0, "a fresh incarnation");
    let state = system
        .shard_region_state_with_ids::<Counter>(1_000)
        .expect("registered");
    assert_eq!(state.entity_ids, expected);
    system.shutdown().await;
}
