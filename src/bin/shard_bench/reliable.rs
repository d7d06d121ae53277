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
    DurableStateStore, InMemoryPersistence, Journal, RedbPersistence,
};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{ProducerConfig, ReliableProducer};
use serde_json::json;

use super::durable::JournalKind;
use super::harness::{ENTITIES, Node, cpu_time, entity_id, form_cluster, peak_rss_kib, shares};
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
        self.checks.processed.fetch_add(1, Ordering::Relaxed);
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
}

impl Figures {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.wall.as_secs_f64()
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "messages": self.messages,
            "handled": self.handled,
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
            .send(entity_id(k), Note { driver: 99, seq: k })
            .await?;
    }
    producer.flush(Duration::from_secs(120)).await?;
    Ok(())
}

/// One task per producer sending its share of notes to entities drawn at
/// random (from `seed`), then waiting until all are confirmed.
fn spawn_drivers(
    producers: &[ReliableProducer<Notes>],
    shares: Vec<u64>,
    seed: u64,
) -> Vec<tokio::task::JoinHandle<ShardingResult<()>>> {
    producers
        .iter()
        .zip(shares)
        .enumerate()
        .map(|(d, (producer, share))| {
            let producer = producer.clone();
            tokio::spawn(async move {
                let mut x = seed ^ (d as u64 + 1);
                for seq in 0..share {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let note = Note {
                        driver: d as u32,
                        seq,
                    };
                    producer.send(entity_id(x % ENTITIES), note).await?;
                }
                producer.flush(Duration::from_secs(600)).await
            })
        })
        .collect()
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

/// The reliable run on `nodes`: three producers, one per node, each with
/// `in_flight` unconfirmed at most, sending their share of `messages` to
/// entities drawn at random; then every entity's count is asked.
async fn drive_reliable<J: Send + Sync + 'static>(
    nodes: &[Node<NoStore, J>],
    messages: u64,
    in_flight: usize,
) -> Result<Figures, Box<dyn std::error::Error>> {
    let config = ProducerConfig::builder().max_unconfirmed(in_flight).build();
    let mut producers = Vec::new();
    for (d, n) in nodes.iter().enumerate() {
        let producer: ReliableProducer<Notes> = n
            .system
            .reliable_producer(format!("driver-{d}"), config.clone())?;
        producers.push(producer);
    }
    warm_up(&producers[0]).await?;
    let cpu_before = cpu_time();
    let start = Instant::now();
    let drivers = spawn_drivers(&producers, shares(messages), 0x9e37_79b9_7f4a_7c15);
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
            .register_durable_state::<NoteEntity>(move |_| NoteEntity {
                state: NoteState::default(),
                durable: true,
                checks: checks.clone(),
            })
            .await?;
        nodes.push(Node { cluster, system });
    }
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
            .register::<NoteEntity>(move |_| NoteEntity {
                state: NoteState::default(),
                durable: false,
                checks: checks.clone(),
            })
            .await?;
        nodes.push(Node { cluster, system });
    }
    Ok(nodes)
}

/// Plain W1 (`plain` messages), then the reliable run (`messages`), each
/// on a cluster of its own; the ratio of their rates.
pub async fn run(
    plain: (u64, super::Run),
    messages: u64,
    in_flight: usize,
    journal: Option<JournalKind>,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let (plain_messages, plain_run) = plain;
    let checks = Arc::new(Checks::default());
    let (figures, store) = match journal {
        None => {
            let nodes = plain_note_nodes("shard-bench-reliable", &checks).await?;
            let figures = drive_reliable(&nodes, messages, in_flight).await;
            stop(nodes).await;
            (figures?, "memory (the deliveries table in memory)")
        }
        Some(JournalKind::Embedded) => {
            let dir = tempfile::tempdir()?;
            let mut journals = Vec::new();
            for i in 0..3 {
                journals.push(RedbPersistence::open(
                    dir.path().join(format!("n{i}.redb")),
                )?);
            }
            let nodes = durable_note_nodes("shard-bench-reliable", journals, &checks).await?;
            let figures = drive_reliable(&nodes, messages, in_flight).await;
            stop(nodes).await;
            (figures?, "embedded (durable state, a save per note)")
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
        "w1-reliable    {:>9} notes · handled {} · dup {duplicates} · order {order} · resent {} · {:>8.0} msg/s · {:.2} µs CPU/msg · {store}",
        figures.messages,
        figures.handled,
        figures.resent,
        figures.rate(),
        figures.cpu.as_secs_f64() * 1e6 / figures.messages.max(1) as f64,
    );
    println!("reliable / plain W1 ({plain_messages} asks): {ratio:.3} of the throughput");
    let mut record = figures.json();
    record["workload"] = "w1-reliable".into();
    record["store"] = store.into();
    record["in_flight_per_driver"] = in_flight.into();
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
    let drivers = spawn_drivers(&producers, halves.to_vec(), 0x2545_f491_4f6c_dd1d);
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
