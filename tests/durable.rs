#![cfg(feature = "embedded")]
//! Event-sourced entities: state that survives a restart and passivation,
//! a journal never forked by two incarnations, and records that do not
//! read back refused with a typed error.

use std::time::Duration;

use datum_cluster_sharding::persistence::{
    AtomicWrite, InMemoryPersistence, Journal, Payload, PersistenceError, PersistenceId,
    RedbPersistence, Writer,
};
use datum_cluster_sharding::prelude::*;

#[derive(Serialize, Deserialize)]
pub struct Add(pub u64);
#[derive(Serialize, Deserialize)]
pub struct Get;
#[derive(Clone, Serialize, Deserialize)]
pub struct Sleep;

protocol! {
    /// A counter whose additions are journaled.
    pub protocol Tally = "tally" {
        ask Add -> u64;
        ask Get -> u64;
        tell Sleep;
    }
}

#[derive(Serialize, Deserialize)]
pub enum TallyEvent {
    Added(u64),
}

#[derive(Default)]
struct TallyEntity {
    total: u64,
}

impl Entity for TallyEntity {
    type Protocol = Tally;
}

impl EventSourced for TallyEntity {
    type Event = TallyEvent;
    fn apply(&mut self, event: &TallyEvent) {
        match event {
            TallyEvent::Added(n) => self.total += n,
        }
    }
}

impl Handler<Add> for TallyEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, TallyEvent::Added(msg.0)).await?;
        Ok(self.total)
    }
}

impl Handler<Get> for TallyEntity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

impl Handler<Sleep> for TallyEntity {
    async fn handle(&mut self, _: Sleep, ctx: &EntityContext) -> ShardingResult<()> {
        ctx.passivate();
        Ok(())
    }
}

const T: Duration = Duration::from_secs(10);

async fn system_on<J: Journal>(journal: J) -> ShardedSystem<NoStore, J> {
    let system = ShardedSystem::builder()
        .num_shards(8)
        .journal(journal)
        .start()
        .await
        .expect("start");
    system
        .entity_type::<TallyEntity>()
        .event_sourced()
        .register(|_| TallyEntity::default())
        .await
        .expect("register");
    system
}

#[tokio::test]
async fn a_durable_counter_survives_a_restart_and_passivation() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("node.redb");
    {
        let system = system_on(RedbPersistence::open(&path).expect("open")).await;
        let tally = system.entity_ref::<Tally>("t-1");
        for n in 1..=10 {
            tally.ask(Add(n), T).await.expect("add");
        }
        assert_eq!(tally.ask(Get, T).await.expect("get"), 55);
        // Passivated, then recovered by the next message.
        tally.tell(Sleep).await.expect("sleep");
        assert_eq!(tally.ask(Add(5), T).await.expect("add"), 60);
        system.shutdown().await;
    }
    // A new process on the same file: the state is recovered before the
    // first message.
    let system = system_on(RedbPersistence::open(&path).expect("reopen")).await;
    let tally = system.entity_ref::<Tally>("t-1");
    assert_eq!(tally.ask(Get, T).await.expect("get"), 60);
    assert_eq!(
        system
            .entity_ref::<Tally>("t-2")
            .ask(Get, T)
            .await
            .expect("get"),
        0
    );
    let id = PersistenceId::new("tally", "t-1");
    assert_eq!(system.journal().highest_sequence_nr(&id), Ok(11));
    system.shutdown().await;
}

/// Retries `Get` until the incarnation that answers has recovered (a stale
/// one answers its error until it is passivated).
async fn get_fresh(tally: &EntityRef<Tally>) -> u64 {
    for _ in 0..200 {
        match tally.ask(Get, T).await {
            Ok(total) => return total,
            Err(ShardingError::Persistence { .. }) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(other) => panic!("get: {other}"),
        }
    }
    panic!("the stale incarnation was never replaced");
}

#[tokio::test]
async fn two_incarnations_writing_one_journal_never_fork_it() {
    // Two systems share one journal and both host entity `x`: as two
    // incarnations would under a split brain.
    let journal = InMemoryPersistence::new();
    let a = system_on(journal.clone()).await;
    let b = system_on(journal.clone()).await;
    let (at_a, at_b) = (a.entity_ref::<Tally>("x"), b.entity_ref::<Tally>("x"));
    // Both recover from the empty journal.
    assert_eq!(at_a.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_b.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_a.ask(Add(1), T).await.expect("a writes"), 1);
    // B's incarnation is stale: its write is refused, with a typed error.
    match at_b.ask(Add(5), T).await {
        Err(ShardingError::Persistence { error, .. }) => match *error {
            PersistenceError::SequenceConflict {
                expected, actual, ..
            } => assert_eq!((expected, actual), (0, 1)),
            other => panic!("a stale write: {other}"),
        },
        other => panic!("a stale write: {other:?}"),
    }
    // The next incarnation at B recovers A's event, and writes after it.
    assert_eq!(get_fresh(&at_b).await, 1);
    assert_eq!(at_b.ask(Add(5), T).await.expect("b writes"), 6);
    // Now A is the stale one.
    assert!(matches!(
        at_a.ask(Add(100), T).await,
        Err(ShardingError::Persistence { .. })
    ));
    assert_eq!(get_fresh(&at_a).await, 6);
    let id = PersistenceId::new("tally", "x");
    let events = journal.replay(&id, 1, u64::MAX, 100).expect("replay");
    let numbers: Vec<u64> = events.iter().map(|e| e.sequence_nr).collect();
    assert_eq!(
        numbers,
        [1, 2],
        "gap-free, one history: the refused writes are not in it"
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[path = "../protocols/writers.rs"]
mod writers;

/// Two systems that do not know each other share one journal and host the
/// same entities, each through several askers that send each add again at
/// once until it is accepted (a split brain under load). A write refused
/// as stale costs its own ask: the incarnation is replaced in place after
/// a pause, and the messages behind it wait and are then handled on the
/// other writer's history — not answered with a conflict they did not
/// meet. So conflicts stay below three per accepted write (at most one:
/// each follows an accepted write of the other side); an incarnation that
/// answered every message with the conflict until it was passivated made
/// tens. (Each append call takes 5 ms, as a commit to a
/// disk would: a side's write then takes about as long as the other
/// side's recovery, and the two keep racing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_losing_second_writer_does_not_storm() {
    let journal = SlowCountingJournal::default();
    let sides = [system_on(journal.clone()).await, system_on(journal).await];
    // (Generous: the last of ten askers waits out up to ten pauses and
    // recoveries on a busy machine.)
    writers::second_writers_race::<Tally, _>(&sides, Add, 3 * T).await;
    for side in &sides {
        side.shutdown().await;
    }
}

fn event(manifest: &str, version: u32, bytes: Vec<u8>) -> Payload {
    Payload {
        manifest: manifest.into(),
        version,
        bytes,
    }
}

fn cbor(value: &TallyEvent) -> Vec<u8> {
    let mut bytes = Vec::new();
    ciborium::into_writer(value, &mut bytes).expect("encode");
    bytes
}

#[tokio::test]
async fn a_journal_that_does_not_read_back_fails_recovery_and_applies_nothing() {
    let journal = InMemoryPersistence::new();
    let cases = [
        ("undecodable", event("tally", 1, vec![0xff, 0x00])),
        (
            "another type's",
            event("cart", 1, cbor(&TallyEvent::Added(1))),
        ),
        (
            "a newer version",
            event("tally", 2, cbor(&TallyEvent::Added(1))),
        ),
    ];
    let system = system_on(journal.clone()).await;
    for (i, (case, bad)) in cases.into_iter().enumerate() {
        let entity = format!("bad-{i}");
        let id = PersistenceId::new("tally", entity.as_str());
        let write = AtomicWrite {
            persistence_id: id,
            expected: 0,
            events: vec![event("tally", 1, cbor(&TallyEvent::Added(7))), bad],
            writer: Writer::default(),
        };
        assert_eq!(journal.append(&[write]), vec![Ok(())]);
        let tally = system.entity_ref::<Tally>(entity.as_str());
        match tally.ask(Get, T).await {
            Err(ShardingError::Persistence { error, .. }) => match *error {
                PersistenceError::Corrupt { what, .. } => {
                    assert!(what.contains("event 2"), "{case}: {what}")
                }
                other => panic!("{case}: {other}"),
            },
            other => panic!("{case}: {other:?}"),
        }
        // Nothing was applied, nothing written: an add fails the same way.
        assert!(
            matches!(
                tally.ask(Add(1), T).await,
                Err(ShardingError::Persistence { .. })
            ),
            "{case}"
        );
    }
    system.shutdown().await;
}

/// A journal that counts its append calls (and apart, those carrying a
/// durable producer's writes) and takes 5 ms for each, as a commit to a
/// disk would.
#[derive(Clone, Default)]
struct SlowCountingJournal {
    inner: InMemoryPersistence,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    producer_calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The commit lanes it names (0: the default, one).
    lanes: usize,
    /// Calls under way, and the most there were at once.
    in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most_in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Calls whose writes were of more than one lane.
    mixed: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Journal for SlowCountingJournal {
    fn append(&self, writes: &[AtomicWrite]) -> Vec<Result<(), PersistenceError>> {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        if writes
            .iter()
            .any(|w| w.persistence_id.type_name == "datum-producer")
        {
            self.producer_calls.fetch_add(1, Relaxed);
        }
        let lanes = self.commit_lanes();
        let first = writes.first().map(|w| w.persistence_id.lane(lanes));
        if writes
            .iter()
            .any(|w| Some(w.persistence_id.lane(lanes)) != first)
        {
            self.mixed.fetch_add(1, Relaxed);
        }
        let now = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.most_in_flight.fetch_max(now, Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        self.in_flight.fetch_sub(1, Relaxed);
        self.inner.append(writes)
    }
    fn commit_lanes(&self) -> usize {
        self.lanes.max(1)
    }
    fn replay(
        &self,
        id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> Result<Vec<datum_cluster_sharding::persistence::EventRecord>, PersistenceError> {
        self.inner.replay(id, from, to, max)
    }
    fn highest_sequence_nr(&self, id: &PersistenceId) -> Result<u64, PersistenceError> {
        self.inner.highest_sequence_nr(id)
    }
    fn delete_to(&self, id: &PersistenceId, to: u64) -> Result<(), PersistenceError> {
        Journal::delete_to(&self.inner, id, to)
    }
}

#[tokio::test]
async fn many_entities_appending_at_once_share_commits() {
    let journal = SlowCountingJournal::default();
    let system = system_on(journal.clone()).await;
    const ENTITIES: u64 = 200;
    let asks = (0..ENTITIES).map(|i| {
        let tally = system.entity_ref::<Tally>(format!("g-{i}").as_str());
        async move { tally.ask(Add(i), T).await }
    });
    let totals = futures_util::future::join_all(asks).await;
    for (i, total) in totals.into_iter().enumerate() {
        assert_eq!(total.expect("add"), i as u64);
    }
    let calls = journal.calls.load(std::sync::atomic::Ordering::Relaxed);
    println!("{ENTITIES} appends in {calls} journal calls");
    // One at a time would take 200 calls; while one commits, the next
    // batch gathers.
    assert!(calls <= 20, "{calls} journal calls for {ENTITIES} appends");
    let most = journal
        .most_in_flight
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(most, 1, "a journal of one lane had {most} commits at once");
    system.shutdown().await;
}

/// A journal that names four commit lanes gets up to four batches at
/// once, each of one lane's writes; every append still answers with its
/// entity's total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_of_four_lanes_has_several_commits_in_flight() {
    use std::sync::atomic::Ordering::Relaxed;
    let journal = SlowCountingJournal {
        lanes: 4,
        ..SlowCountingJournal::default()
    };
    let system = system_on(journal.clone()).await;
    const ENTITIES: u64 = 200;
    for round in 1..=3u64 {
        let asks = (0..ENTITIES).map(|i| {
            let tally = system.entity_ref::<Tally>(format!("l-{i}").as_str());
            async move { tally.ask(Add(i), T).await }
        });
        let totals = futures_util::future::join_all(asks).await;
        for (i, total) in totals.into_iter().enumerate() {
            assert_eq!(total.expect("add"), i as u64 * round);
        }
    }
    let (most, mixed) = (
        journal.most_in_flight.load(Relaxed),
        journal.mixed.load(Relaxed),
    );
    println!("most commits at once {most}, batches of mixed lanes {mixed}");
    assert!(most >= 2, "four lanes, but at most {most} commit at once");
    assert!(most <= 4, "{most} commits at once over four lanes");
    assert_eq!(mixed, 0, "{mixed} batches held writes of several lanes");
    system.shutdown().await;
}

impl datum_cluster_sharding::persistence::SnapshotStore for SlowCountingJournal {
    fn save(
        &self,
        id: &PersistenceId,
        snapshot: datum_cluster_sharding::persistence::SnapshotRecord,
    ) -> Result<(), PersistenceError> {
        datum_cluster_sharding::persistence::SnapshotStore::save(&self.inner, id, snapshot)
    }
    fn load(
        &self,
        id: &PersistenceId,
        max: u64,
    ) -> Result<Option<datum_cluster_sharding::persistence::SnapshotRecord>, PersistenceError> {
        datum_cluster_sharding::persistence::SnapshotStore::load(&self.inner, id, max)
    }
    fn delete_to(&self, id: &PersistenceId, to: u64) -> Result<(), PersistenceError> {
        datum_cluster_sharding::persistence::SnapshotStore::delete_to(&self.inner, id, to)
    }
}

/// 200 sends at once through one durable producer, ten to each of 20
/// entities: they share journal writes (one at a time would take 200
/// calls of 5 ms), and each entity's ten still get the numbers 1..=10.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_durable_producer_sends_share_journal_writes() {
    use datum_cluster_sharding::{DurableProducer, ProducerConfig};
    let journal = SlowCountingJournal::default();
    let system = system_on(journal.clone()).await;
    let producer: DurableProducer<Tally, Sleep> = system
        .durable_producer("batched", ProducerConfig::default())
        .await
        .expect("producer");
    let sends = (0..200u64).map(|i| {
        let producer = producer.clone();
        async move {
            let entity = format!("b-{}", i % 20);
            let seq = producer.send(entity.as_str(), Sleep).await.expect("send");
            (entity, seq)
        }
    });
    let mut numbers = std::collections::BTreeMap::<String, Vec<u64>>::new();
    for (entity, seq) in futures_util::future::join_all(sends).await {
        numbers.entry(entity).or_default().push(seq);
    }
    for (entity, mut seqs) in numbers {
        seqs.sort_unstable();
        assert_eq!(seqs, (1..=10).collect::<Vec<_>>(), "{entity}");
    }
    let calls = journal
        .producer_calls
        .load(std::sync::atomic::Ordering::Relaxed);
    println!("200 durable sends in {calls} journal calls");
    // The start is one; the 200 sends share the rest.
    assert!(calls <= 40, "{calls} journal calls for 200 sends");
    producer.flush(T).await.expect("every send confirmed");
    system.shutdown().await;
}

/// The same store's durable states: its batches counted, 5 ms each.
impl datum_cluster_sharding::persistence::DurableStateStore for SlowCountingJournal {
    fn save(
        &self,
        id: &PersistenceId,
        expected: u64,
        payload: Payload,
        writer: Writer,
    ) -> Result<(), PersistenceError> {
        self.save_all(&[datum_cluster_sharding::persistence::StateWrite {
            persistence_id: id.clone(),
            expected,
            payload,
            writer,
        }])
        .remove(0)
    }
    fn commits_batches(&self) -> bool {
        true
    }
    fn save_all(
        &self,
        writes: &[datum_cluster_sharding::persistence::StateWrite],
    ) -> Vec<Result<(), PersistenceError>> {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        self.inner.save_all(writes)
    }
    fn load(
        &self,
        id: &PersistenceId,
    ) -> Result<Option<datum_cluster_sharding::persistence::StateRecord>, PersistenceError> {
        self.inner.load(id)
    }
    fn revision(&self, id: &PersistenceId) -> Result<u64, PersistenceError> {
        self.inner.revision(id)
    }
    fn delete(&self, id: &PersistenceId, expected: u64) -> Result<(), PersistenceError> {
        self.inner.delete(id, expected)
    }
}

#[tokio::test]
async fn many_durable_state_entities_saving_at_once_share_commits() {
    use datum_cluster_sharding::persistence::DurableStateStore;
    let store = SlowCountingJournal::default();
    let system = state_system_on(store.clone()).await;
    const ENTITIES: u64 = 200;
    let asks = (0..ENTITIES).map(|i| {
        let tally = system.entity_ref::<StateTally>(format!("s-{i}").as_str());
        async move { tally.ask(Add(i + 1), T).await }
    });
    let totals = futures_util::future::join_all(asks).await;
    for (i, total) in totals.into_iter().enumerate() {
        assert_eq!(total.expect("add"), i as u64 + 1);
    }
    let calls = store.calls.load(std::sync::atomic::Ordering::Relaxed);
    println!("{ENTITIES} saves in {calls} store calls");
    // One at a time would take 200 calls.
    assert!(calls <= 20, "{calls} store calls for {ENTITIES} saves");
    for i in [0, 199] {
        let id = PersistenceId::new("state-tally", format!("s-{i}"));
        assert_eq!(store.revision(&id), Ok(1), "each saved once");
    }
    system.shutdown().await;
}

#[tokio::test]
async fn an_entity_ref_alone_keeps_the_journal_open() {
    let system = system_on(InMemoryPersistence::new()).await;
    let tally = system.entity_ref::<Tally>("kept");
    drop(system);
    assert_eq!(
        tally
            .ask(Add(2), T)
            .await
            .expect("an add after the handle is gone"),
        2
    );
    assert_eq!(tally.ask(Add(3), T).await.expect("and another"), 5);
}

/// A journal whose next append writes and then reports a store error, as
/// a commit whose answer was lost would.
#[derive(Clone, Default)]
struct LostAnswerJournal {
    inner: InMemoryPersistence,
    lose_next: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Journal for LostAnswerJournal {
    fn append(&self, writes: &[AtomicWrite]) -> Vec<Result<(), PersistenceError>> {
        let results = self.inner.append(writes);
        if self
            .lose_next
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            let lost = PersistenceError::Store("the commit's answer was lost".into());
            return results.iter().map(|_| Err(lost.clone())).collect();
        }
        results
    }
    fn replay(
        &self,
        id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> Result<Vec<datum_cluster_sharding::persistence::EventRecord>, PersistenceError> {
        self.inner.replay(id, from, to, max)
    }
    fn highest_sequence_nr(&self, id: &PersistenceId) -> Result<u64, PersistenceError> {
        self.inner.highest_sequence_nr(id)
    }
    fn delete_to(&self, id: &PersistenceId, to: u64) -> Result<(), PersistenceError> {
        Journal::delete_to(&self.inner, id, to)
    }
}

#[tokio::test]
async fn an_append_whose_outcome_is_unknown_retires_the_incarnation() {
    let journal = LostAnswerJournal::default();
    let system = system_on(journal.clone()).await;
    let tally = system.entity_ref::<Tally>("u");
    assert_eq!(tally.ask(Add(1), T).await.expect("add"), 1);
    journal
        .lose_next
        .store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(matches!(
        tally.ask(Add(10), T).await,
        Err(ShardingError::Persistence { .. })
    ));
    // The event was written after all: the next incarnation recovers it,
    // rather than answer from a state without it and conflict with itself.
    assert_eq!(get_fresh(&tally).await, 11);
    assert_eq!(tally.ask(Add(100), T).await.expect("add"), 111);
    system.shutdown().await;
}

protocol! {
    /// A counter that snapshots its state.
    pub protocol SnapTally = "snap-tally" {
        ask Add -> u64;
        ask Get -> u64;
    }
}

#[derive(Default)]
struct SnapTallyEntity {
    total: u64,
    restored_from: Option<u64>,
}

impl Entity for SnapTallyEntity {
    type Protocol = SnapTally;
}

impl EventSourced for SnapTallyEntity {
    type Event = TallyEvent;
    fn apply(&mut self, event: &TallyEvent) {
        match event {
            TallyEvent::Added(n) => self.total += n,
        }
    }
}

impl Snapshotted for SnapTallyEntity {
    type Snapshot = u64;
    const SNAPSHOT_EVERY: u64 = 3;
    const SNAPSHOTS_KEPT: u64 = 2;
    fn snapshot(&self) -> u64 {
        self.total
    }
    fn restore(&mut self, total: u64) {
        self.total = total;
        self.restored_from = Some(total);
    }
}

impl Handler<Add> for SnapTallyEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, TallyEvent::Added(msg.0)).await?;
        Ok(self.total)
    }
}

impl Handler<Get> for SnapTallyEntity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        // The total, and (in the thousands) the snapshot it started from.
        Ok(self.total + self.restored_from.map_or(0, |s| s * 1_000))
    }
}

#[tokio::test]
async fn a_snapshotted_entity_recovers_from_its_latest_snapshot() {
    use datum_cluster_sharding::persistence::SnapshotStore;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("node.redb");
    let id = PersistenceId::new("snap-tally", "s-1");
    let start = |store: RedbPersistence| async move {
        let system = ShardedSystem::builder()
            .num_shards(8)
            .journal(store)
            .start()
            .await
            .expect("start");
        system
            .entity_type::<SnapTallyEntity>()
            .snapshotted()
            .register(|_| SnapTallyEntity::default())
            .await
            .expect("register");
        system
    };
    {
        let system = start(RedbPersistence::open(&path).expect("open")).await;
        let tally = system.entity_ref::<SnapTally>("s-1");
        for n in 1..=10 {
            assert_eq!(tally.ask(Add(n), T).await.expect("add"), n * (n + 1) / 2);
        }
        // Snapshots after events 3, 6 and 9; the last two are kept.
        let store = system.journal();
        let at = |max| SnapshotStore::load(store, &id, max).expect("load");
        assert_eq!(at(u64::MAX).map(|s| s.sequence_nr), Some(9));
        assert_eq!(at(8).map(|s| s.sequence_nr), Some(6));
        assert_eq!(at(5), None, "the snapshot after event 3 was deleted");
        // The events the snapshot covers are no longer needed.
        Journal::delete_to(store, &id, 9).expect("delete");
        system.shutdown().await;
    }
    let system = start(RedbPersistence::open(&path).expect("reopen")).await;
    let tally = system.entity_ref::<SnapTally>("s-1");
    // 55, restored from the snapshot of 45 (after event 9) and event 10.
    assert_eq!(tally.ask(Get, T).await.expect("get"), 45_000 + 55);
    system.shutdown().await;
}

protocol! {
    /// A counter whose whole state is saved.
    pub protocol StateTally = "state-tally" {
        ask Add -> u64;
        ask Get -> u64;
    }
}

#[derive(Default)]
struct StateTallyEntity {
    total: u64,
}

impl Entity for StateTallyEntity {
    type Protocol = StateTally;
}

impl DurableState for StateTallyEntity {
    type State = u64;
    fn state(&self) -> &u64 {
        &self.total
    }
    fn set_state(&mut self, total: u64) {
        self.total = total;
    }
}

impl Handler<Add> for StateTallyEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        let before = self.total;
        self.total += msg.0;
        if let Err(error) = self.save_state(ctx).await {
            self.total = before;
            return Err(error);
        }
        Ok(self.total)
    }
}

impl Handler<Get> for StateTallyEntity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

async fn state_system_on<J: datum_cluster_sharding::persistence::DurableStateStore + Journal>(
    store: J,
) -> ShardedSystem<NoStore, J> {
    let system = ShardedSystem::builder()
        .num_shards(8)
        .journal(store)
        .start()
        .await
        .expect("start");
    system
        .entity_type::<StateTallyEntity>()
        .durable_state()
        .register(|_| StateTallyEntity::default())
        .await
        .expect("register");
    system
}

#[tokio::test]
async fn a_durable_state_survives_a_restart_and_a_second_writer_is_refused() {
    use datum_cluster_sharding::persistence::DurableStateStore;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("node.redb");
    {
        let system = state_system_on(RedbPersistence::open(&path).expect("open")).await;
        let tally = system.entity_ref::<StateTally>("d-1");
        assert_eq!(tally.ask(Add(4), T).await.expect("add"), 4);
        assert_eq!(tally.ask(Add(5), T).await.expect("add"), 9);
        system.shutdown().await;
    }
    let system = state_system_on(RedbPersistence::open(&path).expect("reopen")).await;
    let id = PersistenceId::new("state-tally", "d-1");
    assert_eq!(system.journal().revision(&id), Ok(2));
    let tally = system.entity_ref::<StateTally>("d-1");
    assert_eq!(tally.ask(Get, T).await.expect("get"), 9);
    system.shutdown().await;

    // Two incarnations of one entity, on two systems sharing a store.
    let store = InMemoryPersistence::new();
    let a = state_system_on(store.clone()).await;
    let b = state_system_on(store.clone()).await;
    let (at_a, at_b) = (
        a.entity_ref::<StateTally>("x"),
        b.entity_ref::<StateTally>("x"),
    );
    assert_eq!(at_a.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_b.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_a.ask(Add(1), T).await.expect("a saves"), 1);
    match at_b.ask(Add(5), T).await {
        Err(ShardingError::Persistence { error, .. }) => assert!(
            matches!(
                *error,
                PersistenceError::RevisionConflict {
                    expected: 0,
                    actual: 1,
                    ..
                }
            ),
            "{error}"
        ),
        other => panic!("a stale save: {other:?}"),
    }
    // B's next incarnation loads A's state and saves after it.
    let mut fresh = None;
    for _ in 0..200 {
        match at_b.ask(Get, T).await {
            Ok(total) => {
                fresh = Some(total);
                break;
            }
            Err(ShardingError::Persistence { .. }) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(other) => panic!("get: {other}"),
        }
    }
    assert_eq!(fresh, Some(1));
    assert_eq!(at_b.ask(Add(5), T).await.expect("b saves"), 6);
    assert_eq!(
        DurableStateStore::load(&store, &PersistenceId::new("state-tally", "x"))
            .expect("load")
            .map(|s| s.revision),
        Some(2)
    );
    a.shutdown().await;
    b.shutdown().await;
}

#[path = "../protocols/evolving.rs"]
mod evolving;

#[tokio::test]
async fn version_1_records_read_under_version_2_on_the_embedded_store() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("node.redb");
    evolving::version_1_records_read_under_version_2(|| {
        RedbPersistence::open(&path).expect("open")
    })
    .await;
}
