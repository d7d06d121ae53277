//! The handoff measure (SPEC §13.16): three nodes in one
//! process, 30,000 entities (`--entities`) holding 1 KiB of state each
//! (128 words, 1,155 bytes as CBOR); node 2 leaves gracefully and its third
//! of them (about 10,000) move. Measured from the
//! leave: the time until every moved entity answers on its new owner with
//! its state, the bytes moved, and what a W1-style driver (16 asks in
//! flight from node 0, over all the entities) saw meanwhile — once with
//! live migration, once without (the moved entities restart from the
//! factory and answer empty).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use datum_cluster_sharding::MigrationEvent;
use datum_cluster_sharding::membership::MembershipEvent;
use datum_cluster_sharding::prelude::*;
use futures_util::StreamExt;
use hdrhistogram::Histogram;
use serde_json::{Value, json};

use super::curve_chart::{Panel, Series, draw};
use super::harness::{Node, form_cluster};

/// Each entity's state: 128 words, 1 KiB.
const WORDS: u64 = 128;
/// Asks in flight while filling and checking.
const CONCURRENCY: usize = 256;
const ASK: Duration = Duration::from_secs(10);

#[derive(Serialize, Deserialize)]
pub struct Fill(pub u64);
#[derive(Serialize, Deserialize)]
pub struct Check;

protocol! {
    /// An entity holding 1 KiB of state.
    pub protocol Blob = "blob" {
        ask Fill -> ();
        ask Check -> u64;
    }
}

/// `seed`'s 1 KiB: words of the full range (nine bytes each as CBOR).
fn words(seed: u64) -> Vec<u64> {
    (0..WORDS)
        .map(|i| seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i) | 1 << 63)
        .collect()
}

/// What `Check` answers for a state: its sum, 0 for none.
fn digest(words: &[u64]) -> u64 {
    words.iter().fold(0u64, |a, w| a.wrapping_add(*w))
}

#[derive(Default)]
pub struct BlobEntity {
    words: Vec<u64>,
}

impl Entity for BlobEntity {
    type Protocol = Blob;
}
impl Handler<Fill> for BlobEntity {
    async fn handle(&mut self, msg: Fill, _: &EntityContext) -> ShardingResult<()> {
        self.words = words(msg.0);
        Ok(())
    }
}
impl Handler<Check> for BlobEntity {
    async fn handle(&mut self, _: Check, _: &EntityContext) -> ShardingResult<u64> {
        Ok(digest(&self.words))
    }
}
impl Migratable for BlobEntity {
    type Dehydrated = Vec<u64>;
    fn dehydrate(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.words)
    }
    fn rehydrate(&mut self, words: Vec<u64>) {
        self.words = words;
    }
}

fn id(k: u64) -> String {
    format!("blob-{k}")
}

/// Asks `Check` of `id` through `system` until it answers (retrying
/// errors, which a move may cause); its answer. Gives up, with the last
/// error, once a member was downed: a graceful move should down nobody,
/// and the downed node's asks would be retried for ever.
async fn check(
    system: &ShardedSystem,
    id: &str,
    downed: &AtomicBool,
) -> Result<u64, ShardingError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let entity = system.entity_ref::<Blob>(id);
    loop {
        match entity.ask(Check, ASK).await {
            Ok(digest) => return Ok(digest),
            Err(error) if Instant::now() >= deadline || downed.load(Ordering::Acquire) => {
                return Err(error);
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// Sets `downed` when node 0 sees any member downed, from the cluster's
/// start: a member downed while the entities are filled leaves the move
/// nothing (or part of a shard) to move, and would otherwise read as
/// entities that moved without their state.
fn watch_downs(node: &Node, downed: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let mut events = node.cluster.subscribe();
    tokio::spawn(async move {
        loop {
            match events.recv().await {
                Ok(MembershipEvent::MemberDowned(member)) => {
                    eprintln!("shard-bench: {member} was downed");
                    downed.store(true, Ordering::Release);
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            }
        }
    })
}

/// How late a 5 ms timer fires, at most, until `stop`: what any task of
/// the process (a heartbeat among them) waited for a core.
fn watch_lateness(stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Duration> {
    tokio::spawn(async move {
        let mut worst = Duration::ZERO;
        while !stop.load(Ordering::Acquire) {
            let at = Instant::now();
            tokio::time::sleep(Duration::from_millis(5)).await;
            worst = worst.max(at.elapsed().saturating_sub(Duration::from_millis(5)));
        }
        worst
    })
}

/// One variant's figures.
struct Moved {
    entities: usize,
    all_answered: Duration,
    with_state: usize,
    bytes: usize,
    leave: Duration,
    stall: Histogram<u64>,
    driver_before: Histogram<u64>,
    /// The most a 5 ms timer fired late from the leave until every moved
    /// entity had answered.
    late: Duration,
}

/// Runs [`run_variant`] on one of the runtime's workers, as a service's
/// own work runs, rather than on the thread blocked in `block_on`: driven
/// from that thread, about half the runs at 100,000 entities in one shard
/// saw a pipe's writer, woken by a send made there, go unpolled for over
/// 400 ms, and its node downed (BENCHMARKS.md, the handoff curve). A panic
/// in the run goes on as a panic.
async fn on_a_worker(
    migrate: bool,
    entities: u64,
    num_shards: u32,
) -> Result<Moved, Box<dyn std::error::Error>> {
    let run = tokio::spawn(async move {
        run_variant(migrate, entities, num_shards)
            .await
            .map_err(|e| e.to_string())
    });
    match run.await {
        Ok(moved) => Ok(moved?),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(e.into()),
    }
}

/// Runs one variant: `migrate` registers the type migratable.
async fn run_variant(
    migrate: bool,
    entities: u64,
    num_shards: u32,
) -> Result<Moved, Box<dyn std::error::Error>> {
    let name = if migrate {
        "handoff-migrate"
    } else {
        "handoff-factory"
    };
    let (clusters, _) = form_cluster(name, true).await?;
    let mut nodes = Vec::new();
    let mut events = Vec::new();
    for cluster in clusters {
        let config = ShardingConfig::builder()
            .num_shards(num_shards)
            .passivation_idle_timeout(None)
            .allocation_buffer(100_000)
            .build();
        let system = ShardedSystem::builder()
            .config(config)
            .node(cluster.clone())
            .start()
            .await?;
        events.push(system.subscribe_migration_events());
        if migrate {
            system
                .entity_type::<BlobEntity>()
                .migratable()
                .register(|_| BlobEntity::default())
                .await?;
        } else {
            system
                .entity_type::<BlobEntity>()
                .register(|_| BlobEntity::default())
                .await?;
        }
        nodes.push(Node { cluster, system });
    }
    let downed = Arc::new(AtomicBool::new(false));
    let downs = watch_downs(&nodes[0], downed.clone());
    // Every region registered with the coordinator before the fill (a
    // region it has not heard of yet is given no shard): probe until node 2
    // has been given one.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut probe = 0;
    while nodes[2].system.hosted_shards::<Blob>() == 0 {
        if Instant::now() > deadline {
            return Err("node 2 was never given a shard".into());
        }
        let entity = nodes[0].system.entity_ref::<Blob>(format!("probe-{probe}"));
        entity.ask(Check, ASK).await?;
        probe += 1;
    }
    // Fill every entity from node 0.
    let filler = nodes[0].system.clone();
    let filled: Vec<Result<(), ShardingError>> = futures_util::stream::iter(0..entities)
        .map(|k| {
            let system = filler.clone();
            async move { system.entity_ref::<Blob>(id(k)).ask(Fill(k), ASK).await }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    filled.into_iter().collect::<Result<Vec<()>, _>>()?;
    let leaver = &nodes[2].system;
    let moved: Vec<u64> = (0..entities)
        .filter(|k| {
            let shard = leaver.entity_ref::<Blob>(id(*k)).shard_id();
            leaver.live_entities::<Blob>(shard) > 0
        })
        .collect();
    if downed.load(Ordering::Acquire) {
        downs.abort();
        return Err("a member was downed while the entities were filled, before the move".into());
    }
    // The driver: 16 asks in flight from node 0 over all the entities.
    let stop = Arc::new(AtomicBool::new(false));
    let began = Instant::now();
    let mut drivers = Vec::new();
    for d in 0..16u64 {
        let (system, stop) = (nodes[0].system.clone(), stop.clone());
        let downed = downed.clone();
        drivers.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            let mut k = d * 1_877;
            while !stop.load(Ordering::Acquire) && !downed.load(Ordering::Acquire) {
                k = (k + 7_919) % entities;
                let at = Instant::now();
                let answered = check(&system, &id(k), &downed).await;
                if answered.is_ok() {
                    sent.push((at, at.elapsed()));
                }
            }
            sent
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The leave, and every moved entity asked from node 0 until it answers.
    let left = Instant::now();
    let moved_all = Arc::new(AtomicBool::new(false));
    let lateness = watch_lateness(moved_all.clone());
    let system = nodes[2].system.clone();
    let leave = tokio::spawn(async move {
        system.shutdown().await;
        left.elapsed()
    });
    let checker = nodes[0].system.clone();
    let answers: Vec<(u64, Result<u64, ShardingError>, Duration)> =
        futures_util::stream::iter(moved.iter().copied())
            .map(|k| {
                let (system, downed) = (checker.clone(), downed.clone());
                async move {
                    let answer = check(&system, &id(k), &downed).await;
                    (k, answer, left.elapsed())
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
    moved_all.store(true, Ordering::Release);
    let late = lateness.await?;
    downs.abort();
    if downed.load(Ordering::Acquire) {
        return Err(format!(
            "a member was downed during the graceful move (timers fired up to {} ms late)",
            late.as_millis()
        )
        .into());
    }
    let mut all_answered = Duration::ZERO;
    let mut with_state = 0;
    for (k, answer, at) in answers {
        all_answered = all_answered.max(at);
        if answer? == digest(&words(k)) {
            with_state += 1;
        }
    }
    let leave = leave.await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::Release);
    let mut stall = Histogram::<u64>::new(3)?;
    let mut driver_before = Histogram::<u64>::new(3)?;
    for driver in drivers {
        for (at, latency) in driver.await? {
            let us = latency.as_micros() as u64;
            if at >= left && at <= left + all_answered {
                stall.record(us)?;
            } else if at >= began && at < left {
                driver_before.record(us)?;
            }
        }
    }
    let mut bytes = 0;
    for e in &mut events {
        while let Ok(event) = e.try_recv() {
            if let MigrationEvent::Received { bytes: b, .. } = event {
                bytes += b;
            }
        }
    }
    for n in [&nodes[0], &nodes[1]] {
        n.system.shutdown().await;
    }
    for n in &nodes {
        let _ = n.cluster.shutdown().await;
    }
    Ok(Moved {
        entities: moved.len(),
        all_answered,
        with_state,
        bytes,
        leave,
        stall,
        driver_before,
        late,
    })
}

fn report(label: &str, m: &Moved) -> Value {
    println!(
        "{label:<10} {} entities moved · all answered {:.0} ms after the leave · {} with their state · {} KiB moved · leave took {:.0} ms · driver meanwhile: {} asks, p50 {} p99 {} max {} µs (before: p50 {} p99 {} µs)",
        m.entities,
        m.all_answered.as_secs_f64() * 1e3,
        m.with_state,
        m.bytes / 1024,
        m.leave.as_secs_f64() * 1e3,
        m.stall.len(),
        m.stall.value_at_quantile(0.5),
        m.stall.value_at_quantile(0.99),
        m.stall.max(),
        m.driver_before.value_at_quantile(0.5),
        m.driver_before.value_at_quantile(0.99),
    );
    json!({
        "entities_moved": m.entities,
        "all_answered_ms": m.all_answered.as_secs_f64() * 1e3,
        "answered_with_state": m.with_state,
        "bytes_moved": m.bytes,
        "leave_ms": m.leave.as_secs_f64() * 1e3,
        "timer_late_max_ms": m.late.as_secs_f64() * 1e3,
        "driver_during": {
            "asks": m.stall.len(),
            "p50_us": m.stall.value_at_quantile(0.5),
            "p99_us": m.stall.value_at_quantile(0.99),
            "max_us": m.stall.max(),
        },
        "driver_before": {
            "p50_us": m.driver_before.value_at_quantile(0.5),
            "p99_us": m.driver_before.value_at_quantile(0.99),
        },
    })
}

/// Both variants, one after the other, each on a fresh cluster; correct
/// when every moved entity answered with its state under migration.
pub async fn run(entities: u64) -> Result<(Value, bool), Box<dyn std::error::Error>> {
    let entities = entities.max(3);
    let migrated = on_a_worker(true, entities, 128).await?;
    let factory = on_a_worker(false, entities, 128).await?;
    let json = json!({
        "workload": "handoff",
        "migration": report("migration", &migrated),
        "factory": report("factory", &factory),
    });
    Ok((json, migrated.with_state == migrated.entities))
}

/// How a graceful move grows with the entities in a shard: for each count,
/// three nodes with three shards (one each) and three times that many
/// migratable entities of 1 KiB; node 2 leaves, and its one shard's
/// entities move with their state. A table, the chart at `chart` if
/// given, and the JSON record; correct when every moved entity answered
/// with its state.
pub async fn run_curve(
    per_shard: &[u64],
    chart: Option<&std::path::Path>,
) -> Result<(Value, bool), Box<dyn std::error::Error>> {
    println!(
        "{:>10} {:>10} {:>16} {:>12} {:>10} {:>14}",
        "per shard", "moved", "all answered ms", "MiB moved", "leave ms", "timer late ms"
    );
    let mut points = Vec::new();
    for &count in per_shard {
        let m = on_a_worker(true, count.max(1) * 3, 3).await?;
        println!(
            "{:>10} {:>10} {:>16.0} {:>12.1} {:>10.0} {:>14.0}",
            count,
            m.entities,
            m.all_answered.as_secs_f64() * 1e3,
            m.bytes as f64 / 1048576.0,
            m.leave.as_secs_f64() * 1e3,
            m.late.as_secs_f64() * 1e3
        );
        points.push((count, m));
    }
    if let Some(path) = chart {
        draw(
            path,
            &[Panel {
                title: "A graceful leave, one shard of 1 KiB entities moving".into(),
                x_label: "entities in the moved shard".into(),
                y_label: "ms after the leave began".into(),
                series: vec![
                    Series {
                        label: "every moved entity has answered with its state".into(),
                        points: points
                            .iter()
                            .map(|(_, m)| {
                                let ms = m.all_answered.as_secs_f64() * 1e3;
                                (m.entities.max(1) as f64, ms.max(0.1))
                            })
                            .collect(),
                    },
                    Series {
                        label: "the leave is over".into(),
                        points: points
                            .iter()
                            .map(|(_, m)| (m.entities.max(1) as f64, m.leave.as_secs_f64() * 1e3))
                            .collect(),
                    },
                ],
            }],
        )?;
        eprintln!("shard-bench: chart written to {}", path.display());
    }
    let correct = points.iter().all(|(_, m)| m.with_state == m.entities);
    let json = json!({
        "workload": "handoff-per-shard",
        "points": points.iter().map(|(count, m)| json!({
            "per_shard": count,
            "entities_moved": m.entities,
            "answered_with_state": m.with_state,
            "all_answered_ms": m.all_answered.as_secs_f64() * 1e3,
            "bytes_moved": m.bytes,
            "leave_ms": m.leave.as_secs_f64() * 1e3,
            "timer_late_max_ms": m.late.as_secs_f64() * 1e3,
        })).collect::<Vec<_>>(),
    });
    Ok((json, correct))
}
