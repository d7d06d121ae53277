//! Remember-entities behind the write-behind queue: flush as a durability
//! barrier, and both failure policies driven by a fault-injecting store.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{
    FileStore, FileStoreFsyncPolicy, RememberEntitiesConfig, RememberEntitiesEvent,
    RememberEntitiesFailurePolicy, RememberEntitiesOperation, RememberEntitiesQueueFull,
    StoreError,
};

const LONG: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello;

/// Asks nothing back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Wave;

protocol! {
    /// Answers 7.
    pub protocol Greeter = "greeter" {
        ask Hello -> u64;
        tell Wave;
    }
}

struct GreeterEntity;
impl Entity for GreeterEntity {
    type Protocol = Greeter;
}
impl Handler<Hello> for GreeterEntity {
    async fn handle(&mut self, _: Hello, _: &EntityContext) -> ShardingResult<u64> {
        Ok(7)
    }
}
impl Handler<Wave> for GreeterEntity {
    async fn handle(&mut self, _: Wave, _: &EntityContext) -> ShardingResult<()> {
        Ok(())
    }
}

/// An in-memory store that fails on demand, or holds every write (and
/// every read of `slow_shard`) until released.
#[derive(Default)]
struct FaultyStore {
    inner: InMemoryStore,
    fail: AtomicBool,
    /// `record_entity_started` calls seen.
    starts: std::sync::atomic::AtomicUsize,
    held: Mutex<bool>,
    release: Condvar,
    /// The shard whose reads are held too, and whether one began.
    slow_shard: Mutex<Option<ShardId>>,
    reading: AtomicBool,
}

impl FaultyStore {
    fn hold(&self) {
        *self.held.lock().unwrap() = true;
    }

    fn release(&self) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.release.notify_all();
    }

    fn wait_while_held(&self) {
        let mut held = self.held.lock().unwrap();
        while *held {
            held = self.release.wait(held).unwrap();
        }
    }
}

/// The shared handle the system owns (a store is moved into the builder).
#[derive(Clone, Default)]
struct Faulty(Arc<FaultyStore>);

/// Releases what the store holds when dropped: on every way out of a test,
/// a failed assertion included (a held read sits on a blocking thread the
/// runtime waits for).
struct Release(Faulty);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.0.release();
    }
}

impl RememberEntitiesStore for Faulty {
    fn record_entity_started(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        self.0.wait_while_held();
        self.0.starts.fetch_add(1, Ordering::SeqCst);
        if self.0.fail.load(Ordering::SeqCst) {
            return Err(StoreError("disk on fire".into()));
        }
        self.0
            .inner
            .record_entity_started(type_name, shard_id, entity_id)
    }
    fn record_entity_stopped(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        self.0.wait_while_held();
        self.0
            .inner
            .record_entity_stopped(type_name, shard_id, entity_id)
    }
    fn list_entities_for_shard(
        &self,
        type_name: &str,
        shard_id: ShardId,
    ) -> Result<Vec<String>, StoreError> {
        if *self.0.slow_shard.lock().unwrap() == Some(shard_id) {
            self.0.reading.store(true, Ordering::SeqCst);
            self.0.wait_while_held();
        }
        self.0.inner.list_entities_for_shard(type_name, shard_id)
    }
    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        self.0.inner.list_shards(type_name)
    }
}

/// A system on a `FileStore` in `dir`, with `Greeter` remembered.
async fn on_files(dir: &std::path::Path) -> ShardedSystem<FileStore> {
    let store = FileStore::open(dir, FileStoreFsyncPolicy::Always).unwrap();
    let system = ShardedSystem::builder()
        .num_shards(16)
        .store(store)
        .start()
        .await
        .unwrap();
    system
        .entity_type::<GreeterEntity>()
        .remembered()
        .register(|_| GreeterEntity)
        .await
        .unwrap();
    system
}

/// Polls `cond` until it holds; fails the test after `LONG`.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    tokio::time::timeout(LONG, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

async fn system_with(
    store: Faulty,
    policy: RememberEntitiesFailurePolicy,
    capacity: usize,
) -> ShardedSystem<Faulty> {
    system_full(store, policy, capacity, RememberEntitiesQueueFull::Drop).await
}

async fn system_full(
    store: Faulty,
    policy: RememberEntitiesFailurePolicy,
    capacity: usize,
    when_full: RememberEntitiesQueueFull,
) -> ShardedSystem<Faulty> {
    let config = ShardingConfig::builder()
        .num_shards(16)
        .passivation_idle_timeout(None)
        .remember_entities(
            RememberEntitiesConfig::default()
                .with_failure_policy(policy)
                .with_queue_capacity(capacity)
                .with_when_full(when_full),
        )
        .build();
    let system = ShardedSystem::builder()
        .config(config)
        .store(store)
        .start()
        .await
        .unwrap();
    system
        .entity_type::<GreeterEntity>()
        .remembered()
        .register(|_| GreeterEntity)
        .await
        .unwrap();
    system
}

async fn next(
    events: &mut tokio::sync::broadcast::Receiver<RememberEntitiesEvent>,
) -> RememberEntitiesEvent {
    tokio::time::timeout(LONG, events.recv())
        .await
        .expect("an event in time")
        .expect("events open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_is_a_durability_barrier_for_the_file_store() {
    let dir = tempfile::tempdir().unwrap();
    let system = on_files(dir.path()).await;
    let ids: BTreeSet<String> = (0..50).map(|k| format!("g-{k}")).collect();
    for id in &ids {
        assert_eq!(
            system
                .entity_ref::<Greeter>(id.as_str())
                .ask(Hello, LONG)
                .await,
            Ok(7)
        );
    }
    system.flush_remember_entities().await.unwrap();
    // A store on a copy of the directory's files as they are on disk now
    // (the system's store holds the directory's lock) sees every id
    // recorded before the flush, as a restarted process would.
    let copy = tempfile::tempdir().unwrap();
    copy_tree(dir.path(), copy.path());
    let other = FileStore::open(copy.path(), FileStoreFsyncPolicy::Always).unwrap();
    let mut found = BTreeSet::new();
    for shard in other.list_shards("greeter").unwrap() {
        found.extend(other.list_entities_for_shard("greeter", shard).unwrap());
    }
    assert_eq!(found, ids);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_waits_for_the_writes_queued_before_it() {
    let store = Faulty::default();
    let system = system_with(store.clone(), RememberEntitiesFailurePolicy::FailOpen, 100).await;
    store.0.hold();
    let r = system.entity_ref::<Greeter>("held-1");
    assert_eq!(r.ask(Hello, LONG).await, Ok(7));
    let flushing = {
        let system = system.clone();
        tokio::spawn(async move { system.flush_remember_entities().await })
    };
    // The store holds the write: the flush cannot have finished.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !flushing.is_finished(),
        "flush returned before the write reached the store"
    );
    assert!(
        store
            .0
            .inner
            .list_entities_for_shard("greeter", r.shard_id())
            .unwrap()
            .is_empty()
    );
    store.0.release();
    tokio::time::timeout(LONG, flushing)
        .await
        .expect("flush in time")
        .unwrap()
        .unwrap();
    assert_eq!(
        store
            .0
            .inner
            .list_entities_for_shard("greeter", r.shard_id())
            .unwrap(),
        vec!["held-1"]
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn respawned_ids_are_not_recorded_again_and_a_passivated_one_stays_forgotten() {
    let store = Faulty::default();
    let ids = ids_in_shard(5, 30);
    for id in &ids {
        store
            .0
            .inner
            .record_entity_started("greeter", ShardId(5), id)
            .unwrap();
    }
    // One id per batch, slowly: the test passivates one before its batch.
    let config = ShardingConfig::builder()
        .num_shards(16)
        .passivation_idle_timeout(None)
        .remember_entities(
            RememberEntitiesConfig::default().with_respawn_rate(1, Duration::from_millis(50)),
        )
        .build();
    let system = ShardedSystem::builder()
        .config(config)
        .store(store.clone())
        .start()
        .await
        .unwrap();
    let (tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    system
        .entity_type::<GreeterEntity>()
        .remembered()
        .register(move |ctx| {
            let _ = tx.send(ctx.entity_id().to_owned());
            GreeterEntity
        })
        .await
        .unwrap();
    let first = tokio::time::timeout(LONG, started.recv())
        .await
        .unwrap()
        .unwrap();
    // Pick an id still waiting, wake it with a message, passivate it.
    let victim = ids.iter().find(|id| **id != first).unwrap().clone();
    let r = system.entity_ref::<Greeter>(victim.as_str());
    assert_eq!(r.ask(Hello, LONG).await, Ok(7));
    r.passivate().await.unwrap();
    let mut seen = BTreeSet::from([first]);
    // Every other id comes back; the passivated one ran once, for its message.
    while seen.len() < ids.len() {
        let id = tokio::time::timeout(LONG, started.recv())
            .await
            .unwrap()
            .unwrap();
        seen.insert(id);
    }
    let again = tokio::time::timeout(Duration::from_millis(300), started.recv()).await;
    assert!(again.is_err(), "an id came back twice: {again:?}");
    system.flush_remember_entities().await.unwrap();
    let remembered: BTreeSet<String> = store
        .0
        .inner
        .list_entities_for_shard("greeter", ShardId(5))
        .unwrap()
        .into_iter()
        .collect();
    assert!(!remembered.contains(&victim));
    assert_eq!(remembered.len(), ids.len() - 1);
    // The store heard one start: the victim's, spawned by its message.
    // Respawned ids were not recorded again.
    assert_eq!(store.0.starts.load(Ordering::SeqCst), 1);
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_keeps_routing_and_reports_the_failure() {
    let store = Faulty::default();
    store.0.fail.store(true, Ordering::SeqCst);
    let system = system_with(store.clone(), RememberEntitiesFailurePolicy::FailOpen, 100).await;
    let mut events = system.subscribe_remember_entities_events().unwrap();
    let r = system.entity_ref::<Greeter>("open-1");
    assert_eq!(r.ask(Hello, LONG).await, Ok(7));
    let event = next(&mut events).await;
    assert_eq!(event.type_name, "greeter");
    assert_eq!(event.shard_id, Some(r.shard_id()));
    assert_eq!(event.entity_id.as_deref(), Some("open-1"));
    assert_eq!(event.operation, RememberEntitiesOperation::RecordStarted);
    assert_eq!(event.policy, RememberEntitiesFailurePolicy::FailOpen);
    assert!(event.error.contains("disk on fire"), "{}", event.error);
    // Still routed.
    assert_eq!(r.ask(Hello, LONG).await, Ok(7));
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_closed_fails_the_shard_and_only_that_shard() {
    let store = Faulty::default();
    let system = system_with(
        store.clone(),
        RememberEntitiesFailurePolicy::FailClosed,
        100,
    )
    .await;
    let mut events = system.subscribe_remember_entities_events().unwrap();
    // One entity recorded fine first, in another shard than the next one.
    let healthy = system.entity_ref::<Greeter>("closed-ok");
    assert_eq!(healthy.ask(Hello, LONG).await, Ok(7));
    system.flush_remember_entities().await.unwrap();
    let doomed = (0..)
        .map(|k| system.entity_ref::<Greeter>(format!("closed-{k}")))
        .find(|r| r.shard_id() != healthy.shard_id())
        .unwrap();
    store.0.fail.store(true, Ordering::SeqCst);
    // The first message is accepted (the record is written behind it)...
    assert_eq!(doomed.ask(Hello, LONG).await, Ok(7));
    let event = next(&mut events).await;
    assert_eq!(event.policy, RememberEntitiesFailurePolicy::FailClosed);
    assert_eq!(event.shard_id, Some(doomed.shard_id()));
    // ...and once the failure is known, the shard refuses messages.
    match doomed.ask(Hello, LONG).await {
        Err(ShardingError::RememberEntities {
            type_name,
            shard_id,
            ..
        }) => {
            assert_eq!(type_name, "greeter");
            assert_eq!(shard_id, doomed.shard_id());
        }
        other => panic!("expected RememberEntities, got {other:?}"),
    }
    // The region's state names the failed shard, and only it.
    let state = system.shard_region_state::<Greeter>().expect("registered");
    assert_eq!(state.failed, BTreeSet::from([doomed.shard_id()]));
    // Other shards are not disturbed.
    store.0.fail.store(false, Ordering::SeqCst);
    assert_eq!(healthy.ask(Hello, LONG).await, Ok(7));
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_drop_a_full_queue_never_blocks_a_sender_and_is_reported() {
    let store = Faulty::default();
    store.0.hold();
    let system = system_with(store.clone(), RememberEntitiesFailurePolicy::FailOpen, 1).await;
    let mut events = system.subscribe_remember_entities_events().unwrap();
    // The writer is stuck in the store; one record fits in the queue; the
    // rest find it full. Every ask is still answered at once.
    for k in 0..4 {
        let r = system.entity_ref::<Greeter>(format!("q-{k}"));
        assert_eq!(r.ask(Hello, LONG).await, Ok(7));
    }
    let event = next(&mut events).await;
    assert!(event.error.contains("queue is full"), "{}", event.error);
    assert_eq!(event.operation, RememberEntitiesOperation::RecordStarted);
    store.0.release();
    // The flush says the dropped records are not durable, once.
    match system.flush_remember_entities().await {
        Err(ShardingError::RememberEntities { message, .. }) => {
            assert!(message.contains("queue is full"), "{message}");
            assert!(message.contains("record(s) failed"), "{message}");
        }
        other => panic!("expected RememberEntities, got {other:?}"),
    }
    system.flush_remember_entities().await.unwrap();
    system.shutdown().await;
}

/// A held store behind a system whose queue holds one record and holds
/// senders back when full.
async fn held_back_pressure() -> (Faulty, ShardedSystem<Faulty>) {
    let store = Faulty::default();
    store.0.hold();
    let system = system_full(
        store.clone(),
        RememberEntitiesFailurePolicy::FailOpen,
        1,
        RememberEntitiesQueueFull::BackPressure,
    )
    .await;
    (store, system)
}

/// The default: a full queue drops nothing — a sender waits for room (an
/// ask within its timeout; past it the message is not sent and the ask
/// fails typed), and once the store catches up everything waiting goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_holds_senders_back_by_default_and_drops_nothing() {
    assert_eq!(
        RememberEntitiesConfig::default().when_full,
        RememberEntitiesQueueFull::BackPressure
    );
    let (store, system) = held_back_pressure().await;
    let mut events = system.subscribe_remember_entities_events().unwrap();
    // The writer is stuck in the store with the first record: the queue
    // is full from then on.
    let first = system.entity_ref::<Greeter>("w-0");
    // (A timeout too long to add to an instant is no deadline: no panic.)
    assert_eq!(first.ask(Hello, Duration::MAX).await, Ok(7));
    // A sender waits; past its timeout its message is not sent.
    let short = system.entity_ref::<Greeter>("w-1");
    match short.ask(Hello, Duration::from_millis(300)).await {
        Err(ShardingError::RememberEntities { message, .. }) => {
            assert!(message.contains("stayed full"), "{message}")
        }
        other => panic!("expected RememberEntities, got {other:?}"),
    }
    // Another waits, and goes once the store catches up.
    let patient = system.entity_ref::<Greeter>("w-2");
    let waiting = tokio::spawn(async move { patient.ask(Hello, LONG).await });
    assert!(!waiting.is_finished());
    store.0.release();
    assert_eq!(waiting.await.unwrap(), Ok(7));
    // Nothing was dropped: the flush is clean, no failure was published,
    // and the store has both started entities (not the unsent one).
    system.flush_remember_entities().await.unwrap();
    assert!(events.try_recv().is_err(), "no failure event");
    let shard = |id: &str| system.entity_ref::<Greeter>(id.to_owned()).shard_id();
    let mut stored = BTreeSet::new();
    for id in ["w-0", "w-1", "w-2"] {
        let listed = store
            .0
            .inner
            .list_entities_for_shard("greeter", shard(id))
            .unwrap();
        stored.extend(listed);
    }
    let want: BTreeSet<String> = ["w-0", "w-2"].iter().map(|s| s.to_string()).collect();
    assert_eq!(stored, want);
    system.shutdown().await;
}

/// A sender waiting for room in a full queue does not outlive the system:
/// its shutdown ends the wait at once with `ShuttingDown` (the message is
/// not sent), not after the ask's timeout or a tell's `full_queue_wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_the_waits_for_room() {
    let (store, system) = held_back_pressure().await;
    // The writer is stuck in the store with the first record.
    let first = system.entity_ref::<Greeter>("s-0");
    assert_eq!(first.ask(Hello, LONG).await, Ok(7));
    let asker = system.entity_ref::<Greeter>("s-1");
    let teller = system.entity_ref::<Greeter>("s-2");
    let waiting_ask = tokio::spawn(async move { asker.ask(Hello, LONG).await });
    let waiting_tell = tokio::spawn(async move { teller.tell(Wave).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !waiting_ask.is_finished() && !waiting_tell.is_finished(),
        "both wait for room"
    );
    let stopping = {
        let system = system.clone();
        tokio::spawn(async move { system.shutdown().await })
    };
    let ended = tokio::time::timeout(Duration::from_secs(2), async {
        (waiting_ask.await.unwrap(), waiting_tell.await.unwrap())
    })
    .await
    .expect("the waits end with the shutdown, not at their deadlines");
    assert_eq!(
        ended,
        (
            Err(ShardingError::ShuttingDown),
            Err(ShardingError::ShuttingDown)
        )
    );
    store.0.release();
    stopping.await.unwrap();
}

/// The child half of `flushed_ids_survive_a_sigkill`: run only when the
/// parent starts this test binary with `REMEMBER_CHILD_DIR` set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_records_flushes_and_waits_to_be_killed() {
    let Some(dir) = std::env::var_os("REMEMBER_CHILD_DIR") else {
        return; // Not the child: nothing to do here.
    };
    let system = on_files(std::path::Path::new(&dir)).await;
    for k in 0..30 {
        let r = system.entity_ref::<Greeter>(format!("k-{k}"));
        assert_eq!(r.ask(Hello, LONG).await, Ok(7));
    }
    system.flush_remember_entities().await.unwrap();
    println!("FLUSHED");
    use std::io::Write as _;
    std::io::stdout().flush().unwrap();
    // Keep recording after the flush: whatever of this lands or not, the
    // flushed ids must survive the kill.
    // Bounded in count and time, should the parent never kill it.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for k in 30..1_000_000 {
        if std::time::Instant::now() > deadline {
            break;
        }
        let r = system.entity_ref::<Greeter>(format!("k-{k}"));
        let _ = r.ask(Hello, LONG).await;
    }
}

#[test]
fn flushed_ids_survive_a_sigkill() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_records_flushes_and_waits_to_be_killed",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("REMEMBER_CHILD_DIR", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    // Read the child's output on a thread, so a child that hangs fails the
    // test after a generous wait instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let flushed = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.contains("FLUSHED"));
        let _ = tx.send(flushed);
    });
    let flushed = rx.recv_timeout(Duration::from_secs(60)).unwrap_or(false);
    if !flushed {
        let _ = child.kill();
    }
    assert!(flushed, "the child never flushed");
    // No goodbye: SIGKILL.
    child.kill().unwrap();
    child.wait().unwrap();
    // A new process's view: every id flushed before the kill is there.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).unwrap();
        let system = ShardedSystem::builder()
            .num_shards(16)
            .store(store)
            .start()
            .await
            .unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        system
            .entity_type::<GreeterEntity>()
            .remembered()
            .register(move |ctx| {
                let _ = tx.send(ctx.entity_id().to_owned());
                GreeterEntity
            })
            .await
            .unwrap();
        // They are respawned with no message sent.
        let wanted: BTreeSet<String> = (0..30).map(|k| format!("k-{k}")).collect();
        let mut started = BTreeSet::new();
        while !wanted.is_subset(&started) {
            let id = tokio::time::timeout(LONG, rx.recv())
                .await
                .expect("respawned in time")
                .expect("factory alive");
            started.insert(id);
        }
        system.shutdown().await;
    });
}

/// `count` ids that the default extractor puts in `shard` of 16.
fn ids_in_shard(shard: u32, count: usize) -> Vec<String> {
    use datum_cluster_sharding::DefaultShardExtractor;
    (0..)
        .map(|k| format!("many-{k}"))
        .filter(|id| DefaultShardExtractor.shard_id(id, 16) == ShardId(shard))
        .take(count)
        .collect()
}

async fn respawning_system(
    store: InMemoryStore,
    batch: usize,
    interval: Duration,
) -> (
    ShardedSystem<InMemoryStore>,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let config = ShardingConfig::builder()
        .num_shards(16)
        .remember_entities(RememberEntitiesConfig::default().with_respawn_rate(batch, interval))
        .build();
    let system = ShardedSystem::builder()
        .config(config)
        .store(store)
        .start()
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    system
        .entity_type::<GreeterEntity>()
        .remembered()
        .register(move |ctx| {
            let _ = tx.send(ctx.entity_id().to_owned());
            GreeterEntity
        })
        .await
        .unwrap();
    (system, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn respawn_runs_at_a_bounded_rate_and_a_message_does_not_wait_for_it() {
    let store = InMemoryStore::new();
    let ids = ids_in_shard(3, 250);
    for id in &ids {
        store
            .record_entity_started("greeter", ShardId(3), id)
            .unwrap();
    }
    // A long interval: only the first batch comes for now.
    let (system, mut started) =
        respawning_system(store.clone(), 100, Duration::from_secs(30)).await;
    let mut seen = BTreeSet::new();
    while seen.len() < 100 {
        let id = tokio::time::timeout(LONG, started.recv())
            .await
            .unwrap()
            .unwrap();
        seen.insert(id);
    }
    let more = tokio::time::timeout(Duration::from_millis(300), started.recv()).await;
    assert!(
        more.is_err(),
        "more than one batch respawned at once: {more:?}"
    );
    // An id still waiting for its batch is spawned by its first message.
    let waiting = ids.iter().find(|id| !seen.contains(*id)).unwrap();
    assert_eq!(
        system
            .entity_ref::<Greeter>(waiting.as_str())
            .ask(Hello, LONG)
            .await,
        Ok(7)
    );
    let id = tokio::time::timeout(LONG, started.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&id, waiting);
    system.shutdown().await;

    // A short interval: every id comes back, batch after batch.
    let (system, mut started) = respawning_system(store, 100, Duration::from_millis(10)).await;
    let mut seen = BTreeSet::new();
    while seen.len() < ids.len() {
        let id = tokio::time::timeout(LONG, started.recv())
            .await
            .unwrap()
            .unwrap();
        seen.insert(id);
    }
    assert_eq!(seen, ids.iter().cloned().collect());
    system.shutdown().await;
}

/// Copies the files under `from` to `to` (directories created).
fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// A shard whose remembered ids are slow to read holds up no
/// other shard — an ask to another shard is answered while the read waits
/// (the read used to run in the region actor, which then heard nothing
/// else until it was done).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_read_of_one_shard_holds_up_no_other() {
    let store = Faulty::default();
    let [slow_id] = <[String; 1]>::try_from(ids_in_shard(3, 1)).unwrap();
    let [quick_id] = <[String; 1]>::try_from(ids_in_shard(4, 1)).unwrap();
    store
        .0
        .inner
        .record_entity_started("greeter", ShardId(3), &slow_id)
        .unwrap();
    *store.0.slow_shard.lock().unwrap() = Some(ShardId(3));
    store.0.hold();
    let _release = Release(store.clone());
    let system = system_with(store.clone(), RememberEntitiesFailurePolicy::FailOpen, 100).await;
    // Registration starts the remembered shard: its read begins and waits.
    eventually("the slow shard's read", || {
        store.0.reading.load(Ordering::SeqCst)
    })
    .await;
    let quick = system.entity_ref::<Greeter>(quick_id.as_str());
    assert_eq!(quick.ask(Hello, LONG).await.expect("answered meanwhile"), 7);
    store.0.release();
    let slow = system.entity_ref::<Greeter>(slow_id.as_str());
    assert_eq!(slow.ask(Hello, LONG).await.expect("answered after"), 7);
    system.shutdown().await;
}

/// A program can tell when a restart's respawn has finished —
/// the region's state lists the shards with remembered ids still to
/// respawn, and a shard leaves the list once its last id runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_region_state_tells_when_a_respawn_has_finished() {
    // Two remembered ids of one shard; one respawns per hour.
    let store = InMemoryStore::new();
    let ids = ids_in_shard(5, 2);
    for id in &ids {
        store
            .record_entity_started("greeter", ShardId(5), id)
            .unwrap();
    }
    let (system, _started) = respawning_system(store, 1, Duration::from_secs(3_600)).await;
    let state = || system.shard_region_state::<Greeter>().expect("registered");
    // The shard starts, respawns one id and waits an hour for the other.
    eventually("the shard respawning", || {
        state().respawning.contains(&ShardId(5))
    })
    .await;
    assert!(state().failed.is_empty());
    // A message to each id starts whichever is still waiting: done.
    for id in &ids {
        let entity = system.entity_ref::<Greeter>(id.as_str());
        assert_eq!(entity.ask(Hello, LONG).await, Ok(7));
    }
    assert!(state().respawning.is_empty(), "{:?}", state().respawning);
    assert_eq!(state().shards.get(&ShardId(5)), Some(&2));
    system.shutdown().await;
}

/// A torn tail the file store cuts off on reading a log is
/// published as a `RepairLog` event, not only logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_cut_off_on_restart_is_published_as_an_event() {
    let dir = tempfile::tempdir().unwrap();
    {
        let system = on_files(dir.path()).await;
        for k in 0..3 {
            let entity = system.entity_ref::<Greeter>(format!("torn-{k}"));
            assert_eq!(entity.ask(Hello, LONG).await, Ok(7));
        }
        system.flush_remember_entities().await.unwrap();
        system.shutdown().await;
    }
    // Half a record more at the end of one shard's log, as a crash
    // mid-append leaves it.
    let mut logs = Vec::new();
    let mut dirs = vec![dir.path().to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "log") {
                logs.push(path);
            }
        }
    }
    let log = logs.first().expect("a shard's log");
    let mut file = std::fs::OpenOptions::new().append(true).open(log).unwrap();
    std::io::Write::write_all(&mut file, &[0x09, 0x00, 0x00]).unwrap();
    drop(file);
    let store = FileStore::open(dir.path(), FileStoreFsyncPolicy::Always).unwrap();
    let system = ShardedSystem::builder()
        .num_shards(16)
        .store(store)
        .start()
        .await
        .unwrap();
    let mut events = system.subscribe_remember_entities_events().unwrap();
    system
        .entity_type::<GreeterEntity>()
        .remembered()
        .register(|_| GreeterEntity)
        .await
        .unwrap();
    let event = loop {
        let event = next(&mut events).await;
        if event.operation == RememberEntitiesOperation::RepairLog {
            break event;
        }
    };
    assert_eq!(event.type_name, "greeter");
    assert!(
        event.error.contains("torn record (3 bytes"),
        "{}",
        event.error
    );
    // Nothing was marked failed, and every id still answers.
    let state = system.shard_region_state::<Greeter>().expect("registered");
    assert!(state.failed.is_empty());
    for k in 0..3 {
        let entity = system.entity_ref::<Greeter>(format!("torn-{k}"));
        assert_eq!(entity.ask(Hello, LONG).await, Ok(7));
    }
    system.shutdown().await;
}
