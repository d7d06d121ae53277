//! `shard-bench w1 --reliable [--journal embedded]` and `w2 --reliable`.
//!
//! W1's load through
//! reliable producers (SPEC §13.17) — each driver a `ReliableProducer`
//! whose window is W1's in-flight count, sending tells to W1's 1,000
//! entities — after plain W1 on a cluster of its own, in one sitting. The
//! entities count what they handle and check each driver's notes come
//! once, in order; with `--journal embedded` they are durable-state
//! entities on one redb file per node, saving with every note.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use datum_cluster_sharding::persistence::{
    DurableStateStore, InMemoryPersistence, Journal, SnapshotStore,
};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{DurableProducer, ProducerConfig, ReliableProducer};
use serde_json::json;

use super::durable::JournalKind;
use super::harness::{
    ENTITIES, Node, cpu_time, entity_id, form_cluster, peak_rss_kib, shards_moved_since, shares,
    wait_registered,
};
use super::ping::Checks;
use super::stop;

/// One note of a driver's stream.
#[derive(Clone, Copy, Serialize, Deserialize)]
pub struct Note {
    pub driver: u32,
    pub seq: u64,
}

/// How many notes the entity handled.
#[derive(Serialize, Deserialize)]
pub struct Noted;

protocol! {
    /// W1's entity, told rather than asked.
    pub protocol Notes = "notes" {
        tell Note;
        ask Noted -> u64;
    }
}

/// What a note entity keeps (and saves, when durable).
#[derive(Clone, Default, Serialize, Deserialize)]
pub struct NoteState {
    handled: u64,
    last: BTreeMap<u32, u64>,
}

struct NoteEntity {
    state: NoteState,
    durable: bool,
    checks: Arc<Checks>,
}

impl Entity for NoteEntity {
    type Protocol = Notes;
}

impl DurableState for NoteEntity {
    type State = NoteState;
    fn state(&self) -> &NoteState {
        &self.state
    }
    fn set_state(&mut self, state: NoteState) {
        self.state = state;
    }
}

impl Handler<Note> for NoteEntity {
    async fn handle(&mut self, note: Note, ctx: &EntityContext) -> ShardingResult<()> {
        let before = self.state.clone();
        let last = self.state.last.insert(note.driver, note.seq);
        self.checks.count_processed();
        match last {
            Some(last) if last == note.seq => {
                self.checks
                    .duplicate_processings
                    .fetch_add(1, Ordering::Relaxed);
            }
            Some(last) if last > note.seq => {
                self.checks.order_violations.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        self.state.handled += 1;
        if self.durable
            && let Err(error) = self.save_state(ctx).await
        {
            self.state = before;
            return Err(error);
        }
        Ok(())
    }
}

impl Handler<Noted> for NoteEntity {
    async fn handle(&mut self, _: Noted, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.state.handled)
    }
}

/// One run's figures.
struct Figures {
    messages: u64,
    wall: Duration,
    cpu: Duration,
    resent: u64,
    handled: u64,
    /// Shards the coordinator moved while the clock ran: with a store per
    /// node, a moved durable-state entity starts from a store that has
    /// not seen its saves, and its count is lost (none move once every
    /// region registered before the warm-up).
    moved: usize,
}

impl Figures {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.wall.as_secs_f64()
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "messages": self.messages,
            "handled": self.handled,
            "shards_moved": self.moved,
            "resent": self.resent,
            "wall_ms": self.wall.as_secs_f64() * 1e3,
            "msgs_per_sec": self.rate(),
            "cpu_us_per_msg": self.cpu.as_secs_f64() * 1e6 / self.messages.max(1) as f64,
        })
    }
}

/// A note to every entity from `producer` (not counted), all confirmed.
async fn warm_up(producer: &ReliableProducer<Notes>) -> Result<(), Box<dyn std::error::Error>> {
    for k in 0..ENTITIES {
        producer
            .send(
                entity_id(k),
                Note {
                    driver: u32::MAX,
                    seq: k,
                },
            )
            .await?;
    }
    producer.flush(Duration::from_secs(120)).await?;
    Ok(())
}

/// A driver's producer: its messages kept in memory, or journaled before
/// each send returns (`--durable-producer`).
#[derive(Clone)]
enum Producer {
    Memory(ReliableProducer<Notes>),
    Durable(DurableProducer<Notes, Note>),
}

impl Producer {
    async fn send(&self, entity: String, note: Note) -> ShardingResult<u64> {
        match self {
            Producer::Memory(p) => p.send(entity, note).await,
            Producer::Durable(p) => p.send(entity, note).await,
        }
    }

    async fn flush(&self, timeout: Duration) -> ShardingResult<()> {
        match self {
            Producer::Memory(p) => p.flush(timeout).await,
            Producer::Durable(p) => p.flush(timeout).await,
        }
    }

    fn stats(&self) -> datum_cluster_sharding::ProducerStats {
        match self {
            Producer::Memory(p) => p.stats(),
            Producer::Durable(p) => p.stats(),
        }
    }
}

/// `senders` tasks per producer, each sending its part of the producer's
/// share of notes to entities drawn at random (from `seed`) as a driver
/// of its own (so each entity can check every sender's order), then
/// waiting until all are confirmed.
fn spawn_drivers(
    producers: &[Producer],
    shares: Vec<u64>,
    senders: u64,
    seed: u64,
) -> Vec<tokio::task::JoinHandle<ShardingResult<()>>> {
    let mut tasks = Vec::new();
    for (d, (producer, share)) in producers.iter().zip(shares).enumerate() {
        for t in 0..senders {
            let producer = producer.clone();
            let driver = d as u64 * senders + t;
            let part = share / senders + u64::from(t < share % senders);
            tasks.push(tokio::spawn(async move {
                let mut x = seed ^ (driver + 1);
                for seq in 0..part {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let note = Note {
                        driver: driver as u32,
                        seq,
                    };
                    producer.send(entity_id(x % ENTITIES), note).await?;
                }
                producer.flush(Duration::from_secs(600)).await
            }));
        }
    }
    tasks
}

/// The notes every entity handled, asked through `system`, less the
/// warm-up's one each.
async fn count_handled<S, J>(system: &ShardedSystem<S, J>) -> ShardingResult<u64> {
    let mut handled = 0;
    for k in 0..ENTITIES {
        handled += system
            .entity_ref::<Notes>(entity_id(k))
            .ask(Noted, Duration::from_secs(30))
            .await?;
    }
    Ok(handled - ENTITIES)
}

/// Three durable producers, one per node on its journal, each with
/// `in_flight` unconfirmed at most.
async fn durable_producers<J: Journal + SnapshotStore>(
    nodes: &[Node<NoStore, J>],
    in_flight: usize,
) -> ShardingResult<Vec<Producer>> {
    let config = ProducerConfig::builder().max_unconfirmed(in_flight).build();
    let mut producers = Vec::new();
    for (d, n) in nodes.iter().enumerate() {
        let id = format!("driver-{d}");
        let producer = n.system.durable_producer(&id, config.clone()).await?;
        producers.push(Producer::Durable(producer));
    }
    Ok(producers)
}

/// Three in-memory producers, one per node, each with `in_flight`
/// unconfirmed at most.
fn memory_producers<J>(
    nodes: &[Node<NoStore, J>],
    in_flight: usize,
) -> ShardingResult<Vec<Producer>> {
    let config = ProducerConfig::builder().max_unconfirmed(in_flight).build();
    nodes
        .iter()
        .enumerate()
        .map(|(d, n)| {
            let producer = n
                .system
                .reliable_producer(format!("driver-{d}"), config.clone());
            producer.map(Producer::Memory)
        })
        .collect()
}

/// The reliable run on `nodes`: `producers` (one per node), each sending
/// its share of `messages` to entities drawn at random from `senders`
/// tasks; then every entity's count is asked.
async fn drive_reliable<J: Send + Sync + 'static>(
    nodes: &[Node<NoStore, J>],
    producers: Vec<Producer>,
    messages: u64,
    senders: u64,
) -> Result<Figures, Box<dyn std::error::Error>> {
    let warm = nodes[0]
        .system
        .reliable_producer("warm-up", ProducerConfig::default())?;
    warm_up(&warm).await?;
    let cpu_before = cpu_time();
    let start = Instant::now();
    let drivers = spawn_drivers(&producers, shares(messages), senders, 0x9e37_79b9_7f4a_7c15);
    for driver in drivers {
        driver.await??;
    }
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    let resent = producers.iter().map(|p| p.stats().resent).sum();
    let handled = count_handled(&nodes[0].system).await?;
    Ok(Figures {
        messages,
        wall,
        cpu,
        resent,
        handled,
        moved: shards_moved_since(nodes, start),
    })
}

/// Three nodes whose note entities are durable-state ones, node `i` on
/// `journals[i]` (clones of one store, for a store the nodes share).
async fn durable_note_nodes<J>(
    name: &str,
    journals: Vec<J>,
    checks: &Arc<Checks>,
) -> Result<Vec<Node<NoStore, J>>, Box<dyn std::error::Error>>
where
    J: Journal + DurableStateStore,
{
    let (clusters, _) = form_cluster(name, false).await?;
    let mut nodes = Vec::new();
    for (cluster, journal) in clusters.into_iter().zip(journals) {
        let system = ShardedSystem::builder()
            .config(super::harness::sharding_config())
            .node(cluster.clone())
            .journal(journal)
            .start()
            .await?;
        let checks = checks.clone();
        system
            .entity_type::<NoteEntity>()
            .durable_state()
            .register(move |_| NoteEntity {
                state: NoteState::default(),
                durable: true,
                checks: checks.clone(),
            })
            .await?;
        nodes.push(Node { cluster, system });
    }
    wait_registered(&nodes).await?;
    Ok(nodes)
}

async fn plain_note_nodes(
    name: &str,
    checks: &Arc<Checks>,
) -> Result<Vec<Node>, Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster(name, false).await?;
    let mut nodes = Vec::new();
    for cluster in clusters {
        let system = ShardedSystem::builder()
            .config(super::harness::sharding_config())
            .node(cluster.clone())
            .start()
            .await?;
        let checks = checks.clone();
        system
            .entity_type::<NoteEntity>()
            .register(move |_| NoteEntity {
                state: NoteState::default(),
                durable: false,
                checks: checks.clone(),
            })
            .await?;
        nodes.push(Node { cluster, system });
    }
    wait_registered(&nodes).await?;
    Ok(nodes)
}

/// Where a reliable run keeps its state.
pub struct Store {
    /// The entities' store: none (in memory) or embedded.
    pub journal: Option<JournalKind>,
    /// The producers are durable ones, their sends journaled.
    pub durable_producer: bool,
    /// With the embedded store: commit lanes (redb files) per node.
    pub lanes: usize,
}

/// The reliable run on durable-state entities saved to `journals` (one
/// per node), with memory or durable producers; its figures and what it
/// ran on.
async fn on_stores<J>(
    journals: Vec<J>,
    (kind, durable_producer): (JournalKind, bool),
    checks: &Arc<Checks>,
    messages: u64,
    in_flight: usize,
) -> Result<(Figures, String), Box<dyn std::error::Error>>
where
    J: Journal + DurableStateStore + SnapshotStore,
{
    let nodes = durable_note_nodes("shard-bench-reliable", journals, checks).await?;
    // A durable producer's send returns once journaled: one sender would
    // wait for every append; `in_flight` senders share the producer, as
    // concurrent callers would.
    let (producers, senders, store) = if durable_producer {
        (
            durable_producers(&nodes, in_flight).await,
            in_flight as u64,
            "(durable state, a save per note; durable producers, their sends journaled)",
        )
    } else {
        (
            memory_producers(&nodes, in_flight),
            1,
            "(durable state, a save per note)",
        )
    };
    let figures = match producers {
        Ok(producers) => drive_reliable(&nodes, producers, messages, senders).await,
        Err(error) => Err(error.into()),
    };
    stop(nodes).await;
    Ok((figures?, format!("{} {store}", kind.name())))
}

/// Plain W1 (`plain` messages), then the reliable run (`messages`), each
/// on a cluster of its own; the ratio of their rates.
pub async fn run(
    plain: (u64, super::Run),
    messages: u64,
    in_flight: usize,
    store: Store,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let Store {
        journal,
        durable_producer,
        lanes,
    } = store;
    let (plain_messages, plain_run) = plain;
    let checks = Arc::new(Checks::default());
    let (figures, store) = match journal {
        None => {
            let nodes = plain_note_nodes("shard-bench-reliable", &checks).await?;
            let figures = match memory_producers(&nodes, in_flight) {
                Ok(producers) => drive_reliable(&nodes, producers, messages, 1).await,
                Err(error) => Err(error.into()),
            };
            stop(nodes).await;
            (
                figures?,
                "memory (the deliveries table in memory)".to_owned(),
            )
        }
        Some(JournalKind::Embedded) => {
            let dir = tempfile::tempdir()?;
            let mut journals = Vec::new();
            for i in 0..3 {
                journals.push(super::durable::open_redb(
                    dir.path(),
                    &format!("n{i}"),
                    lanes,
                )?);
            }
            let kind = (JournalKind::Embedded, durable_producer);
            on_stores(journals, kind, &checks, messages, in_flight).await?
        }
        Some(JournalKind::Fjall) => {
            #[cfg(feature = "fjall")]
            {
                let dir = tempfile::tempdir()?;
                let mut journals = Vec::new();
                for i in 0..3 {
                    let path = dir.path().join(format!("n{i}"));
                    journals.push(datum_cluster_sharding::persistence::FjallPersistence::open(
                        path,
                    )?);
                }
                let kind = (JournalKind::Fjall, durable_producer);
                on_stores(journals, kind, &checks, messages, in_flight).await?
            }
            #[cfg(not(feature = "fjall"))]
            return Err("--journal fjall needs a build with `--features fjall`".into());
        }
        Some(JournalKind::Postgres) => {
            return Err("w1 --reliable runs without a journal or on the embedded one".into());
        }
    };
    let plain_rate = plain_run.acks as f64 / plain_run.wall.as_secs_f64();
    let ratio = figures.rate() / plain_rate;
    let duplicates = checks.duplicate_processings.load(Ordering::Relaxed);
    let order = checks.order_violations.load(Ordering::Relaxed);
    println!(
        "w1-reliable    {:>9} notes · handled {} · dup {duplicates} · order {order} · resent {} · shards moved {} · {:>8.0} msg/s · {:.2} µs CPU/msg · {store}",
        figures.messages,
        figures.handled,
        figures.resent,
        figures.moved,
        figures.rate(),
        figures.cpu.as_secs_f64() * 1e6 / figures.messages.max(1) as f64,
    );
    println!("reliable / plain W1 ({plain_messages} asks): {ratio:.3} of the throughput");
    let mut record = figures.json();
    record["workload"] = "w1-reliable".into();
    record["store"] = store.into();
    record["in_flight_per_driver"] = in_flight.into();
    record["durable_producer"] = durable_producer.into();
    record["commit_lanes"] = match journal {
        Some(JournalKind::Embedded) => lanes,
        _ => 1,
    }
    .into();
    record["duplicate_processings"] = duplicates.into();
    record["order_violations"] = order.into();
    record["plain_w1"] = plain_run.json();
    record["ratio_to_plain"] = ratio.into();
    record["peak_rss_kib"] = peak_rss_kib().into();
    let correct = figures.handled == figures.messages && duplicates == 0 && order == 0;
    Ok((record, correct))
}

/// W2 through reliable producers: drivers on nodes 0 and 1 send
/// `messages` notes (16 unconfirmed each) to W1's entities, durable-state
/// ones on a store the nodes share; node 2 crashes once 30 % are
/// confirmed. Afterwards every entity's stored count and the entities'
/// checks say whether each note took effect exactly once.
pub async fn run_w2(
    messages: u64,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let checks = Arc::new(Checks::default());
    let store = InMemoryPersistence::new();
    let journals = vec![store.clone(), store.clone(), store];
    let nodes = durable_note_nodes("shard-bench-w2-reliable", journals, &checks).await?;
    let config = ProducerConfig::builder()
        .max_unconfirmed(16)
        .attempt_timeout(Duration::from_secs(2))
        .build();
    let mut producers = Vec::new();
    for (d, n) in nodes.iter().take(2).enumerate() {
        let producer: ReliableProducer<Notes> = n
            .system
            .reliable_producer(format!("driver-{d}"), config.clone())?;
        producers.push(producer);
    }
    warm_up(&producers[0]).await?;
    let start = Instant::now();
    let halves = [messages / 2 + messages % 2, messages / 2];
    let memory: Vec<Producer> = producers.iter().cloned().map(Producer::Memory).collect();
    let drivers = spawn_drivers(&memory, halves.to_vec(), 1, 0x2545_f491_4f6c_dd1d);
    let confirmed = |producers: &[ReliableProducer<Notes>]| -> u64 {
        producers.iter().map(|p| p.stats().confirmed).sum()
    };
    while confirmed(&producers) < ENTITIES + messages * 3 / 10 {
        if start.elapsed() > Duration::from_secs(600) {
            return Err("30 % of the notes were not confirmed in 600 s".into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let killed_at = start.elapsed();
    nodes[2].cluster.crash().await;
    for driver in drivers {
        driver.await??;
    }
    let wall = start.elapsed();
    let resent: u64 = producers.iter().map(|p| p.stats().resent).sum();
    let handled = count_handled(&nodes[0].system).await?;
    let duplicates = checks.duplicate_processings.load(Ordering::Relaxed);
    let order = checks.order_violations.load(Ordering::Relaxed);
    let missing = messages.saturating_sub(handled);
    let extra = handled.saturating_sub(messages);
    println!(
        "w2-reliable    {messages} notes · node 2 crashed at {killed_at:?} · all confirmed after {wall:?} · effects: {handled} (missing {missing}, extra {extra}) · dup {duplicates} · order {order} · resent {resent}"
    );
    for n in &nodes[..2] {
        n.system.shutdown().await;
        let _ = n.cluster.shutdown().await;
    }
    let record = json!({
        "workload": "w2-reliable",
        "messages": messages,
        "killed_at_ms": killed_at.as_secs_f64() * 1e3,
        "wall_ms": wall.as_secs_f64() * 1e3,
        "effects": handled,
        "missing_effects": missing,
        "extra_effects": extra,
        "duplicate_processings": duplicates,
        "order_violations": order,
        "resent": resent,
    });
    let correct = missing == 0 && extra == 0 && duplicates == 0 && order == 0;
    Ok((record, correct))
}
