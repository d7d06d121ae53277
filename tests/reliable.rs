//! Reliable delivery (SPEC §13.17): a producer's tells, sent again until
//! confirmed, are each handled once — through confirmations lost to
//! timeouts on one node, and through a node crash on three, with the
//! entities' records kept in their durable state on a store the nodes
//! share.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::persistence::{
    DurableStateStore, InMemoryPersistence, PersistenceError, PersistenceId,
};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{
    Ask, DurableProducer, Message, ProducerConfig, ReliableProducer, Tell,
};

/// Credit the entity with a value; it records it (its effect).
#[derive(Clone, Serialize, Deserialize)]
pub struct Credit(pub u64);
/// As `Credit`, after a nap of so many milliseconds.
#[derive(Clone, Serialize, Deserialize)]
pub struct SlowCredit(pub u64, pub u64);
/// As `Credit`, but the handler does not save (the system saves the
/// record, and with it the state).
#[derive(Clone, Serialize, Deserialize)]
pub struct QuietCredit(pub u64);
/// As `Credit`, but the first time, after its save, the handler answers
/// a store's error (as from a second store it also writes).
#[derive(Clone, Serialize, Deserialize)]
pub struct CreditThenFail(pub u64);
/// Every value credited, in order.
#[derive(Serialize, Deserialize)]
pub struct Entries;

protocol! {
    /// An account whose credits are its durable state.
    pub protocol Ledger = "ledger" {
        tell Credit;
        tell SlowCredit;
        tell QuietCredit;
        tell CreditThenFail;
        ask Entries -> Vec<u64>;
    }
}

#[derive(Default)]
struct LedgerEntity {
    entries: Vec<u64>,
    failed_once: bool,
}

impl Entity for LedgerEntity {
    type Protocol = Ledger;
}

impl DurableState for LedgerEntity {
    type State = Vec<u64>;
    fn state(&self) -> &Vec<u64> {
        &self.entries
    }
    fn set_state(&mut self, entries: Vec<u64>) {
        self.entries = entries;
    }
}

impl LedgerEntity {
    async fn credit(&mut self, value: u64, ctx: &EntityContext) -> ShardingResult<()> {
        self.entries.push(value);
        if let Err(error) = self.save_state(ctx).await {
            self.entries.pop();
            return Err(error);
        }
        Ok(())
    }
}

impl Handler<Credit> for LedgerEntity {
    async fn handle(&mut self, msg: Credit, ctx: &EntityContext) -> ShardingResult<()> {
        self.credit(msg.0, ctx).await
    }
}

impl Handler<SlowCredit> for LedgerEntity {
    async fn handle(&mut self, msg: SlowCredit, ctx: &EntityContext) -> ShardingResult<()> {
        tokio::time::sleep(Duration::from_millis(msg.1)).await;
        self.credit(msg.0, ctx).await
    }
}

impl Handler<QuietCredit> for LedgerEntity {
    async fn handle(&mut self, msg: QuietCredit, _: &EntityContext) -> ShardingResult<()> {
        self.entries.push(msg.0);
        Ok(())
    }
}

impl Handler<CreditThenFail> for LedgerEntity {
    async fn handle(&mut self, msg: CreditThenFail, ctx: &EntityContext) -> ShardingResult<()> {
        self.credit(msg.0, ctx).await?;
        if !std::mem::replace(&mut self.failed_once, true) {
            return Err(ShardingError::Persistence {
                type_name: ctx.type_name(),
                entity_id: ctx.entity_id().to_owned(),
                error: Box::new(PersistenceError::Store("another store is away".into())),
            });
        }
        Ok(())
    }
}

impl Handler<Entries> for LedgerEntity {
    async fn handle(&mut self, _: Entries, _: &EntityContext) -> ShardingResult<Vec<u64>> {
        Ok(self.entries.clone())
    }
}

protocol! {
    /// The same account, event-sourced: each credit is an event.
    pub protocol EventLedger = "event-ledger" {
        tell Credit;
        tell SlowCredit;
        tell QuietCredit;
        ask Entries -> Vec<u64>;
    }
}

#[derive(Default)]
struct EventLedgerEntity {
    entries: Vec<u64>,
}

impl Entity for EventLedgerEntity {
    type Protocol = EventLedger;
}

impl EventSourced for EventLedgerEntity {
    type Event = u64;
    fn apply(&mut self, value: &u64) {
        self.entries.push(*value);
    }
}

impl Handler<Credit> for EventLedgerEntity {
    async fn handle(&mut self, msg: Credit, ctx: &EntityContext) -> ShardingResult<()> {
        self.persist(ctx, msg.0).await
    }
}

impl Handler<SlowCredit> for EventLedgerEntity {
    async fn handle(&mut self, msg: SlowCredit, ctx: &EntityContext) -> ShardingResult<()> {
        tokio::time::sleep(Duration::from_millis(msg.1)).await;
        self.persist(ctx, msg.0).await
    }
}

/// Persists nothing: only the system's record of the message is written.
impl Handler<QuietCredit> for EventLedgerEntity {
    async fn handle(&mut self, _: QuietCredit, _: &EntityContext) -> ShardingResult<()> {
        Ok(())
    }
}

impl Handler<Entries> for EventLedgerEntity {
    async fn handle(&mut self, _: Entries, _: &EntityContext) -> ShardingResult<Vec<u64>> {
        Ok(self.entries.clone())
    }
}

const LONG: Duration = Duration::from_secs(60);
const ASK: Duration = Duration::from_secs(5);

/// What account `id` of `P` was credited, asked through `system`.
async fn entries_of<P, S, J>(
    system: &ShardedSystem<S, J>,
    id: impl Into<std::sync::Arc<str>>,
) -> Vec<u64>
where
    P: Protocol,
    Entries: Ask<P> + Message<P, Reply = Vec<u64>>,
{
    system
        .entity_ref::<P>(id)
        .ask(Entries, ASK)
        .await
        .expect("entries")
}

async fn one_node(store: InMemoryPersistence) -> ShardedSystem<NoStore, InMemoryPersistence> {
    let system = ShardedSystem::builder()
        .num_shards(8)
        .journal(store)
        .start()
        .await
        .expect("start");
    system
        .entity_type::<LedgerEntity>()
        .durable_state()
        .register(|_| LedgerEntity::default())
        .await
        .expect("register");
    system
}

/// A producer whose attempts time out fast and are sent again soon.
fn impatient() -> ProducerConfig {
    ProducerConfig::builder()
        .attempt_timeout(Duration::from_millis(100))
        .min_backoff(Duration::from_millis(20))
        .max_backoff(Duration::from_millis(200))
        .build()
}

#[tokio::test]
async fn a_message_whose_confirmation_timed_out_is_sent_again_and_handled_once() {
    let store = InMemoryPersistence::new();
    let system = one_node(store.clone()).await;
    let producer: ReliableProducer<Ledger> = system
        .reliable_producer("payments", impatient())
        .expect("producer");
    // Each slow credit outlasts its attempt (100 ms): the producer sends it
    // again while the entity still handles the first copy, and the copy
    // finds it handled.
    for value in 1..=4u64 {
        let seq = producer
            .send("acct-1", SlowCredit(value, 250))
            .await
            .expect("accepted");
        assert_eq!(seq, value, "numbered per entity from 1");
        producer
            .send("acct-2", QuietCredit(value))
            .await
            .expect("accepted");
    }
    producer.flush(LONG).await.expect("all confirmed");
    let stats = producer.stats();
    assert!(
        stats.resent >= 4,
        "every slow credit was sent again: {stats:?}"
    );
    assert_eq!(
        (stats.confirmed, stats.failed, stats.unconfirmed),
        (8, 0, 0)
    );
    for account in ["acct-1", "acct-2"] {
        let entries = entries_of::<Ledger, _, _>(&system, account).await;
        assert_eq!(entries, vec![1, 2, 3, 4], "{account}: each credit once");
    }
    // The record is in the stored state, saved with it: the handler's own
    // save (acct-1), or the system's after a handler that saved nothing
    // (acct-2).
    for account in ["acct-1", "acct-2"] {
        let id = PersistenceId::new("ledger", account);
        let record = store.load(&id).expect("load").expect("a state");
        assert_eq!(record.payload.manifest, "ledger#state+deliveries");
        let (entries, rows): (Vec<u64>, Vec<(String, u64, u64)>) =
            ciborium::from_reader(&record.payload.bytes[..]).expect("decodes");
        assert_eq!(entries, vec![1, 2, 3, 4]);
        assert_eq!(rows, vec![("payments".to_owned(), producer.epoch(), 4)]);
    }
    system.shutdown().await;
}

#[tokio::test]
async fn a_restarted_producer_supersedes_the_old_one_even_after_passivation() {
    let system = one_node(InMemoryPersistence::new()).await;
    let old: ReliableProducer<Ledger> = system
        .reliable_producer("orders", impatient())
        .expect("producer");
    old.send("acct-9", Credit(1)).await.expect("accepted");
    old.flush(LONG).await.expect("confirmed");
    // A restart of the producer: the same id, a later epoch.
    let new: ReliableProducer<Ledger> = system
        .reliable_producer("orders", impatient())
        .expect("producer");
    assert!(new.epoch() > old.epoch());
    new.send("acct-9", Credit(2)).await.expect("accepted");
    new.flush(LONG).await.expect("confirmed");
    // The entity's next incarnation knows the new epoch from its store.
    let account = system.entity_ref::<Ledger>("acct-9");
    account.passivate().await.expect("passivated");
    old.send("acct-9", Credit(3)).await.expect("accepted");
    let refused = old.flush(LONG).await;
    assert!(
        matches!(refused, Err(ShardingError::Superseded { .. })),
        "the superseded producer stops: {refused:?}"
    );
    assert!(matches!(
        old.send("acct-9", Credit(4)).await,
        Err(ShardingError::Superseded { .. })
    ));
    let entries = account.ask(Entries, ASK).await.expect("entries");
    assert_eq!(
        entries,
        vec![1, 2],
        "the superseded producer's credit was refused"
    );
    system.shutdown().await;
}

#[tokio::test]
async fn a_store_error_after_the_handlers_save_is_resent_and_found_handled() {
    let system = one_node(InMemoryPersistence::new()).await;
    let producer: ReliableProducer<Ledger> = system
        .reliable_producer("refunds", impatient())
        .expect("producer");
    producer
        .send("acct-5", CreditThenFail(7))
        .await
        .expect("accepted");
    producer.send("acct-5", Credit(8)).await.expect("accepted");
    producer.flush(LONG).await.expect("confirmed");
    let stats = producer.stats();
    assert!(
        stats.resent >= 1,
        "the store's error sent it again: {stats:?}"
    );
    let entries = entries_of::<Ledger, _, _>(&system, "acct-5").await;
    // Its save carried its record: the copy sent again is a duplicate.
    assert_eq!(entries, vec![7, 8], "the credit once, though sent twice");
    system.shutdown().await;
}

#[tokio::test]
async fn a_durable_producer_restarted_mid_stream_resumes_without_gaps_or_duplicates() {
    const ACCOUNTS: u64 = 5;
    const CREDITS: u64 = 10;
    let store = InMemoryPersistence::new();
    let system = one_node(store.clone()).await;
    let first: DurableProducer<Ledger, SlowCredit> = system
        .durable_producer("payroll", ProducerConfig::default())
        .await
        .expect("producer");
    for value in 1..=CREDITS {
        for k in 0..ACCOUNTS {
            // 30 ms each: most are still unconfirmed when the producer goes.
            first
                .send(format!("acct-{k}"), SlowCredit(value, 30))
                .await
                .expect("accepted");
        }
    }
    let unconfirmed = first.stats().unconfirmed;
    assert!(unconfirmed > 0, "some left unconfirmed");
    let epoch = first.epoch();
    drop(first);
    // The restart: the same id resumes the journaled messages under the
    // same epoch and numbers; those handled already are duplicates.
    let second: DurableProducer<Ledger, SlowCredit> = system
        .durable_producer("payroll", ProducerConfig::default())
        .await
        .expect("producer");
    assert_eq!(second.epoch(), epoch, "the same incarnation resumed");
    assert!(
        second.stats().unconfirmed >= unconfirmed,
        "{:?}",
        second.stats()
    );
    second.flush(LONG).await.expect("all confirmed");
    let expected: Vec<u64> = (1..=CREDITS).collect();
    for k in 0..ACCOUNTS {
        let entries = entries_of::<Ledger, _, _>(&system, format!("acct-{k}")).await;
        assert_eq!(entries, expected, "acct-{k}: each credit once, in order");
    }
    system.shutdown().await;
}

#[tokio::test]
async fn a_durable_producer_snapshots_its_journal_and_recovers_from_the_snapshot() {
    use datum_cluster_sharding::persistence::Journal;
    const ACCOUNTS: u64 = 10;
    const CREDITS: u64 = 110; // 1,100 sends: one snapshot, at event 1,024
    let store = InMemoryPersistence::new();
    let system = one_node(store.clone()).await;
    let first: DurableProducer<Ledger, Credit> = system
        .durable_producer("bulk", ProducerConfig::default())
        .await
        .expect("producer");
    for value in 1..=CREDITS {
        for k in 0..ACCOUNTS {
            first
                .send(format!("acct-{k}"), Credit(value))
                .await
                .expect("accepted");
        }
    }
    first.flush(LONG).await.expect("confirmed");
    drop(first);
    let id = PersistenceId::new("datum-producer", "ledger/bulk");
    assert_eq!(store.highest_sequence_nr(&id), Ok(1 + ACCOUNTS * CREDITS));
    assert!(
        store
            .replay(&id, 1, 1024, usize::MAX)
            .expect("replay")
            .is_empty(),
        "the events the snapshot covers are deleted"
    );
    // Recovery: the snapshot and the events after it; what they hold is
    // sent again and found handled.
    let second: DurableProducer<Ledger, Credit> = system
        .durable_producer("bulk", ProducerConfig::default())
        .await
        .expect("producer");
    second.flush(LONG).await.expect("confirmed");
    assert!(second.stats().confirmed > 0, "{:?}", second.stats());
    second
        .send("acct-0", Credit(CREDITS + 1))
        .await
        .expect("accepted");
    second.flush(LONG).await.expect("confirmed");
    for k in 0..ACCOUNTS {
        let entries = entries_of::<Ledger, _, _>(&system, format!("acct-{k}")).await;
        let last = if k == 0 { CREDITS + 1 } else { CREDITS };
        assert_eq!(entries, (1..=last).collect::<Vec<_>>(), "acct-{k}");
    }
    system.shutdown().await;
}

#[tokio::test]
async fn a_second_durable_producer_of_an_id_fences_the_first() {
    let system = one_node(InMemoryPersistence::new()).await;
    let first: DurableProducer<Ledger, Credit> = system
        .durable_producer("fenced", ProducerConfig::default())
        .await
        .expect("producer");
    first.send("acct-1", Credit(1)).await.expect("accepted");
    let second: DurableProducer<Ledger, Credit> = system
        .durable_producer("fenced", ProducerConfig::default())
        .await
        .expect("producer");
    let refused = first.send("acct-1", Credit(2)).await;
    assert!(
        matches!(&refused, Err(ShardingError::Persistence { error, .. })
            if matches!(**error, PersistenceError::SequenceConflict { .. })),
        "{refused:?}"
    );
    second.send("acct-1", Credit(3)).await.expect("accepted");
    second.flush(LONG).await.expect("confirmed");
    let entries = entries_of::<Ledger, _, _>(&system, "acct-1").await;
    assert_eq!(entries, vec![1, 3]);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_to_one_entity_each_get_their_own_number() {
    let system = one_node(InMemoryPersistence::new()).await;
    let producer: ReliableProducer<Ledger> = system
        .reliable_producer("fan-in", ProducerConfig::default())
        .expect("producer");
    let senders: Vec<_> = (0..4u64)
        .map(|t| {
            let producer = producer.clone();
            tokio::spawn(async move {
                let mut seqs = Vec::new();
                for i in 0..100u64 {
                    let seq = producer
                        .send("acct-shared", QuietCredit(t * 1_000 + i))
                        .await
                        .expect("accepted");
                    seqs.push(seq);
                }
                seqs
            })
        })
        .collect();
    let mut seqs = Vec::new();
    for sender in senders {
        seqs.extend(sender.await.expect("joined"));
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=400).collect::<Vec<_>>(), "each its own number");
    producer.flush(LONG).await.expect("confirmed");
    let entries = entries_of::<Ledger, _, _>(&system, "acct-shared").await;
    assert_eq!(entries.len(), 400, "every message handled");
    system.shutdown().await;
}

#[tokio::test]
async fn an_event_sourced_entity_journals_its_record_with_its_events() {
    use datum_cluster_sharding::persistence::Journal;
    let store = InMemoryPersistence::new();
    let system = one_node(store.clone()).await;
    system
        .entity_type::<EventLedgerEntity>()
        .event_sourced()
        .register(|_| EventLedgerEntity::default())
        .await
        .expect("registered");
    let producer: ReliableProducer<EventLedger> = system
        .reliable_producer("journal", impatient())
        .expect("producer");
    for value in 1..=3u64 {
        // Each outlasts its attempt: a copy is sent while it is handled.
        producer
            .send("acct-e", SlowCredit(value, 250))
            .await
            .expect("accepted");
    }
    producer
        .send("acct-e", QuietCredit(4))
        .await
        .expect("accepted");
    producer.flush(LONG).await.expect("confirmed");
    assert!(producer.stats().resent >= 3, "{:?}", producer.stats());
    let account = system.entity_ref::<EventLedger>("acct-e");
    assert_eq!(
        account.ask(Entries, ASK).await.expect("entries"),
        vec![1, 2, 3]
    );
    // Each credit's event and its record in one write; the quiet one's
    // record alone.
    let id = PersistenceId::new("event-ledger", "acct-e");
    let journal = store.replay(&id, 1, u64::MAX, usize::MAX).expect("replay");
    let manifests: Vec<&str> = journal
        .iter()
        .map(|e| e.payload.manifest.as_str())
        .collect();
    assert_eq!(
        manifests,
        [
            "event-ledger",
            "event-ledger#delivery",
            "event-ledger",
            "event-ledger#delivery",
            "event-ledger",
            "event-ledger#delivery",
            "event-ledger#delivery",
        ]
    );
    // The records come back with the events: after a newer producer of
    // the id reached the entity and the entity was passivated, the older
    // one is refused by the next incarnation.
    let newer: ReliableProducer<EventLedger> = system
        .reliable_producer("journal", impatient())
        .expect("producer");
    newer.send("acct-e", Credit(5)).await.expect("accepted");
    newer.flush(LONG).await.expect("confirmed");
    account.passivate().await.expect("passivated");
    producer.send("acct-e", Credit(6)).await.expect("accepted");
    assert!(matches!(
        producer.flush(LONG).await,
        Err(ShardingError::Superseded { .. })
    ));
    assert_eq!(
        account.ask(Entries, ASK).await.expect("entries"),
        vec![1, 2, 3, 5]
    );
    system.shutdown().await;
}

#[tokio::test]
async fn a_producer_config_out_of_range_is_refused() {
    let system = one_node(InMemoryPersistence::new()).await;
    for config in [
        ProducerConfig::builder().max_unconfirmed(0).build(),
        ProducerConfig::builder()
            .attempt_timeout(Duration::ZERO)
            .build(),
        ProducerConfig::builder()
            .min_backoff(Duration::from_secs(2))
            .max_backoff(Duration::from_secs(1))
            .build(),
    ] {
        let made = system.reliable_producer::<Ledger>("p", config);
        assert!(matches!(made, Err(ShardingError::InvalidConfig(_))));
    }
    assert!(matches!(
        system.reliable_producer::<Ledger>("", ProducerConfig::default()),
        Err(ShardingError::InvalidConfig(_))
    ));
    system.shutdown().await;
}

fn cluster_config(seeds: Vec<SocketAddr>) -> ClusterConfig {
    ClusterConfig::builder()
        .cluster_name("reliable-test")
        .secret("reliable-secret")
        .seed_nodes(seeds)
        .build()
}

/// Three nodes, each running the ledger on `store` (one the nodes share,
/// as a PostgreSQL database would be).
async fn three(
    store: &InMemoryPersistence,
) -> Vec<(ClusterNode, ShardedSystem<NoStore, InMemoryPersistence>)> {
    let first = ClusterNode::start(cluster_config(vec![]))
        .await
        .expect("node starts");
    let mut clusters = vec![first.clone()];
    for _ in 1..3 {
        let node = ClusterNode::start(cluster_config(vec![first.bound_addr()]))
            .await
            .expect("node starts");
        clusters.push(node);
    }
    for c in &clusters {
        c.wait_until(|s| s.up_members().count() == 3, LONG)
            .await
            .expect("three Up");
    }
    let mut nodes = Vec::new();
    for cluster in clusters {
        let system = ShardedSystem::builder()
            .num_shards(24)
            .passivation_idle_timeout(None)
            .node(cluster.clone())
            .journal(store.clone())
            .start()
            .await
            .expect("system starts");
        system
            .entity_type::<LedgerEntity>()
            .durable_state()
            .register(|_| LedgerEntity::default())
            .await
            .expect("registered");
        system
            .entity_type::<EventLedgerEntity>()
            .event_sourced()
            .register(|_| EventLedgerEntity::default())
            .await
            .expect("registered");
        nodes.push((cluster, system));
    }
    // Every region is registered with the coordinator before any shard is
    // allocated (else a late one gets none).
    let deadline = Instant::now() + LONG;
    for (_, system) in &nodes {
        while !system.sharding_coordinator().is_some_and(|c| c.registered) {
            assert!(Instant::now() < deadline, "regions not registered");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    nodes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_node_crash_every_credit_is_handled_exactly_once_in_order() {
    through_a_node_crash::<Ledger>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_a_node_crash_every_event_sourced_credit_is_journaled_exactly_once_in_order() {
    through_a_node_crash::<EventLedger>().await;
}

/// Three nodes on one store; a producer sends credits to accounts of `P`
/// (durable state, or event-sourced); node 2 crashes while some are
/// being handled there; every account ends with each credit once.
async fn through_a_node_crash<P>()
where
    P: Protocol,
    Credit: Tell<P>,
    SlowCredit: Tell<P>,
    Entries: Ask<P> + Message<P, Reply = Vec<u64>>,
{
    const ACCOUNTS: u64 = 30;
    const CREDITS: u64 = 40;
    let store = InMemoryPersistence::new();
    let nodes = three(&store).await;
    let (_, sender) = &nodes[0];
    let config = ProducerConfig::builder()
        .max_unconfirmed(64)
        .attempt_timeout(Duration::from_secs(1))
        .min_backoff(Duration::from_millis(50))
        .max_backoff(Duration::from_millis(500))
        .build();
    let producer: ReliableProducer<P> = sender
        .reliable_producer("transfers", config)
        .expect("producer");
    let account = |k: u64| format!("acct-{k}");
    let started = Instant::now();
    let mut crashed = None;
    for value in 1..=CREDITS {
        if value == CREDITS / 2 {
            // Mid-stream, once every credit before the slow ones is
            // confirmed (so the slow ones are being handled): a node dies.
            let before_slow = (CREDITS / 2 - 2) * ACCOUNTS;
            let deadline = Instant::now() + LONG;
            while producer.stats().confirmed < before_slow {
                assert!(Instant::now() < deadline, "{:?}", producer.stats());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // The node other than the sender's that hosts more accounts
            // dies (so the crash matters).
            let hosted = |n: usize| -> usize {
                let state = nodes[n].1.shard_region_state::<P>();
                state.expect("registered").shards.values().sum()
            };
            let victim = if hosted(1) > hosted(2) { 1 } else { 2 };
            assert!(hosted(victim) > 0, "nodes 1 and 2 host no account");
            nodes[victim].0.crash().await;
            crashed = Some(victim);
        }
        for k in 0..ACCOUNTS {
            // The credits just before the crash nap first: those on the
            // crashed node are handled and saved there after it died, and their
            // confirmations never come (the copies sent again must be
            // recognised, by the record saved with the state).
            let sent = if value == CREDITS / 2 - 1 {
                producer.send(account(k), SlowCredit(value, 100)).await
            } else {
                producer.send(account(k), Credit(value)).await
            };
            sent.expect("accepted");
        }
    }
    let victim = crashed.expect("a node crashed");
    producer.flush(LONG).await.expect("every credit confirmed");
    assert!(producer.stats().resent > 0, "the crash made some resends");
    println!(
        "{} credits confirmed {:?} after the start: {:?}",
        ACCOUNTS * CREDITS,
        started.elapsed(),
        producer.stats()
    );
    let expected: Vec<u64> = (1..=CREDITS).collect();
    let mut wrong = BTreeMap::new();
    for k in 0..ACCOUNTS {
        let entries = entries_of::<P, _, _>(sender, account(k)).await;
        if entries != expected {
            wrong.insert(account(k), entries);
        }
    }
    assert!(
        wrong.is_empty(),
        "accounts whose credits are not exactly 1..={CREDITS} once each, in order: {wrong:?}"
    );
    for (n, (cluster, system)) in nodes.iter().enumerate() {
        if n != victim {
            system.shutdown().await;
            let _ = cluster.shutdown().await;
        }
    }
}
