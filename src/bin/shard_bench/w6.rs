//! W6 (BENCHMARK.md): entities that talk to each other. Drivers ask
//! front entities (type A); each front, when asked, asks one back entity
//! (type B) and replies with its answer. With affinity, 90 % of a
//! front's asks go to its three partners, backs in one shard that is not
//! the front's own shard number, the same for every front of a shard, so
//! that a placement could put the two shards on one node; 10 % go to a
//! random back. The uniform control draws every back at random. The
//! figure that placement moves: the fraction of front-to-back asks that
//! stay on one node, per second and in all.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datum_cluster_sharding::PlacementByTraffic;
use datum_cluster_sharding::prelude::*;
use hdrhistogram::Histogram;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use super::curve_chart::{Panel, Series};

use super::harness::{Node, SHARDS, cpu_time, form_cluster, peak_rss_kib, sharding_config};

/// Front entities (type A).
const FRONTS: u64 = 10_000;
/// Back entities (type B).
const BACKS: u64 = 10_000;
/// Each front's partners.
const PARTNERS: usize = 3;
/// The share of a front's asks that go to its partners, with affinity.
const AFFINITY: f64 = 0.9;
/// An ask's timeout, the driver's and the front's.
const TIMEOUT: Duration = Duration::from_secs(10);

/// A driver's ask to a front.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Visit;

/// A front's ask to a back.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Touch;

protocol! {
    /// W6's front: asked by the drivers, it asks a back; answers whether
    /// the back was on its node.
    pub protocol Front = "w6-front" {
        ask Visit -> bool;
    }
}

protocol! {
    /// W6's back: answers with the index of the node it lives on.
    pub protocol Back = "w6-back" {
        ask Touch -> u64;
    }
}

/// What every front of one node shares: a ref to every back, each
/// front's partners, and the node's index.
struct Plan {
    backs: Vec<EntityRef<Back>>,
    /// Indexes into `backs`, per front; empty for the uniform control.
    partners: Arc<Vec<[u32; PARTNERS]>>,
    node: u64,
}

pub struct FrontEntity {
    plan: Arc<Plan>,
    index: usize,
    rng: rand::rngs::SmallRng,
}

impl Entity for FrontEntity {
    type Protocol = Front;
}

impl Handler<Visit> for FrontEntity {
    async fn handle(&mut self, _: Visit, _: &EntityContext) -> ShardingResult<bool> {
        let plan = &self.plan;
        let back = match plan.partners.get(self.index) {
            Some(partners) if self.rng.random_bool(AFFINITY) => {
                partners[self.rng.random_range(0..PARTNERS)] as usize
            }
            _ => self.rng.random_range(0..plan.backs.len()),
        };
        let node = plan.backs[back].ask(Touch, TIMEOUT).await?;
        Ok(node == plan.node)
    }
}

pub struct BackEntity {
    node: u64,
}

impl Entity for BackEntity {
    type Protocol = Back;
}

impl Handler<Touch> for BackEntity {
    async fn handle(&mut self, _: Touch, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.node)
    }
}

fn front_id(k: u64) -> String {
    format!("a-{k}")
}

fn back_id(k: u64) -> String {
    format!("b-{k}")
}

/// Each front's partners: the front in shard `s` takes three backs of
/// shard `(s + SHARDS / 2) mod SHARDS`, never its own shard number.
fn partners(system: &ShardedSystem) -> Vec<[u32; PARTNERS]> {
    let mut by_shard = vec![Vec::new(); SHARDS as usize];
    for k in 0..BACKS {
        let shard = system.entity_ref::<Back>(back_id(k)).shard_id().0;
        by_shard[shard as usize].push(k as u32);
    }
    (0..FRONTS)
        .map(|k| {
            let shard = system.entity_ref::<Front>(front_id(k)).shard_id().0;
            let theirs = &by_shard[((shard + SHARDS / 2) % SHARDS) as usize];
            assert!(!theirs.is_empty(), "every shard holds backs");
            std::array::from_fn(|j| theirs[(k as usize * PARTNERS + j) % theirs.len()])
        })
        .collect()
}

/// On-node and cross-node front-to-back asks, counted by the drivers from
/// the fronts' answers.
#[derive(Default)]
struct Counts {
    local: AtomicU64,
    remote: AtomicU64,
    failed: AtomicU64,
}

impl Counts {
    /// On-node and cross-node asks so far.
    fn now(&self) -> (u64, u64) {
        (
            self.local.load(Ordering::Relaxed),
            self.remote.load(Ordering::Relaxed),
        )
    }
}

/// One W6 run: three nodes in this process, `messages` asks to the fronts
/// from one driver per node, `in_flight` each; `uniform`: no affinity;
/// `by_traffic`: placement by traffic (SPEC §13.11) on every node.
pub async fn run(
    messages: u64,
    in_flight: usize,
    uniform: bool,
    by_traffic: bool,
) -> Result<(Value, bool), Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster("shard-bench-w6", false).await?;
    let mut nodes = Vec::new();
    let mut plan_partners = None;
    for (index, cluster) in clusters.into_iter().enumerate() {
        let mut config = sharding_config();
        if by_traffic {
            config.placement_by_traffic = Some(PlacementByTraffic::default());
        }
        let system = ShardedSystem::builder()
            .config(config)
            .node(cluster.clone())
            .start()
            .await?;
        let partners = plan_partners
            .get_or_insert_with(|| {
                Arc::new(if uniform {
                    Vec::new()
                } else {
                    partners(&system)
                })
            })
            .clone();
        let plan = Arc::new(Plan {
            backs: (0..BACKS)
                .map(|k| system.entity_ref::<Back>(back_id(k)))
                .collect(),
            partners,
            node: index as u64,
        });
        let node = index as u64;
        system
            .entity_type::<BackEntity>()
            .register(move |_| BackEntity { node })
            .await?;
        system
            .entity_type::<FrontEntity>()
            .register(move |ctx| {
                let index = ctx
                    .entity_id()
                    .strip_prefix("a-")
                    .and_then(|k| k.parse().ok())
                    .unwrap_or(usize::MAX);
                FrontEntity {
                    plan: plan.clone(),
                    index,
                    rng: rand::rngs::SmallRng::seed_from_u64(index as u64),
                }
            })
            .await?;
        nodes.push(Node { cluster, system });
    }
    // Every region registered (a late one would get its shards only from
    // rebalance rounds, under the clock), then a warm-up in which every
    // driver asks every front once, so that the fronts and their partners
    // are started before the measured run.
    super::harness::wait_registered(&nodes).await?;
    let counts = Arc::new(Counts::default());
    drive(&nodes, 3 * FRONTS, 64, &counts).await;
    let counts = Arc::new(Counts::default());
    let series = Arc::new(Mutex::new(Vec::new()));
    let cpu_before = cpu_time();
    let start = Instant::now();
    let sampler = tokio::spawn(sample(counts.clone(), (start, cpu_before), series.clone()));
    let latency = drive(&nodes, messages, in_flight, &counts).await;
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    sampler.abort();
    let moved = super::harness::shards_moved_since(&nodes, start);
    let (most_moves, moved_late) = moves_per_shard(&nodes, start, start + wall / 2);
    let peak = peak_rss_kib();
    super::stop(nodes).await;
    let (local, remote) = counts.now();
    let failed = counts.failed.load(Ordering::Relaxed);
    let answered = local + remote;
    let on_node = local as f64 / answered.max(1) as f64;
    let name = match (uniform, by_traffic) {
        (false, false) => "w6",
        (true, false) => "w6-uniform",
        (false, true) => "w6-traffic",
        (true, true) => "w6-uniform-traffic",
    };
    // The last, partial second too (a sample taken after the run's end
    // gives way to it).
    let series = {
        let mut samples = series.lock().unwrap_or_else(|p| p.into_inner());
        samples.retain(|s| s.at < wall);
        samples.push(Sample {
            at: wall,
            local,
            remote,
            cpu,
        });
        samples
    };
    let steady = second_half(&series);
    let series = intervals(&series);
    println!(
        "{name:<18} {answered} asks · {:.0} asks/s · {:.2} µs CPU/ask · p50 {} p99 {} µs · on-node {:.3} · {moved} shards moved ({moved_late} in the second half, at most {most_moves} times one) · {failed} failed",
        answered as f64 / wall.as_secs_f64(),
        cpu.as_secs_f64() * 1e6 / answered.max(1) as f64,
        latency.value_at_quantile(0.50),
        latency.value_at_quantile(0.99),
        on_node,
    );
    if let Value::Object(half) = &steady {
        let figure = |k: &str| half.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        println!(
            "{:<18} second half: {:.0} asks/s · {:.2} µs CPU/ask · on-node {:.3}",
            "",
            figure("asks_per_sec"),
            figure("cpu_us_per_ask"),
            figure("on_node"),
        );
    }
    let record = json!({
        "workload": name,
        "placement": if by_traffic { "traffic" } else { "least-shards" },
        "asks": answered,
        "failed_asks": failed,
        "msgs_per_sec": answered as f64 / wall.as_secs_f64(),
        "cpu_us_per_msg": cpu.as_secs_f64() * 1e6 / answered.max(1) as f64,
        "p50_us": latency.value_at_quantile(0.50),
        "p99_us": latency.value_at_quantile(0.99),
        "on_node_fraction": on_node,
        "on_node_over_time": series,
        "second_half": steady,
        "shards_moved": moved,
        "most_moves_of_one_shard": most_moves,
        "shards_moved_in_second_half": moved_late,
        "in_flight_per_driver": in_flight,
        "fronts": FRONTS,
        "backs": BACKS,
        "affinity": if uniform { 0.0 } else { AFFINITY },
        "peak_rss_kib": peak,
    });
    Ok((record, failed == 0 && answered == messages))
}

/// W6 under least-shards and then under placement by traffic, each on
/// fresh nodes, and a chart of both over time at `chart`: the on-node
/// fraction and the asks per second.
pub async fn run_pair(
    messages: u64,
    in_flight: usize,
    uniform: bool,
    chart: &std::path::Path,
) -> Result<(Value, bool), Box<dyn std::error::Error>> {
    let (by_count, counted) = run(messages, in_flight, uniform, false).await?;
    let (by_traffic, placed) = run(messages, in_flight, uniform, true).await?;
    let runs = [&by_count, &by_traffic];
    let line = |figure: &'static str| -> Vec<Series> {
        runs.iter()
            .map(|record| Series {
                label: record["placement"].as_str().unwrap_or("?").to_owned(),
                points: record["on_node_over_time"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| Some((s["t_s"].as_f64()?, s[figure].as_f64()?)))
                    .collect(),
            })
            .collect()
    };
    let title = if uniform { "W6, uniform control" } else { "W6" };
    super::curve_chart::draw_linear(
        chart,
        &[
            Panel {
                title: format!("{title}: front-to-back asks on one node"),
                x_label: "seconds".into(),
                y_label: "fraction on one node".into(),
                series: line("on_node"),
            },
            Panel {
                title: format!("{title}: throughput"),
                x_label: "seconds".into(),
                y_label: "asks per second".into(),
                series: line("asks_per_sec"),
            },
        ],
    )?;
    println!("chart: {}", chart.display());
    Ok((json!([by_count, by_traffic]), counted && placed))
}

/// The most moves of one shard since `since`, as the rounds kept on every
/// node record them, and the moves of rounds decided from `late` on.
fn moves_per_shard(nodes: &[Node], since: Instant, late: Instant) -> (usize, usize) {
    let mut per_shard: std::collections::HashMap<(String, ShardId), usize> = Default::default();
    let mut moved_late = 0;
    for round in nodes.iter().flat_map(|n| n.system.rebalance_rounds()) {
        if round.at < since {
            continue;
        }
        if round.at >= late {
            moved_late += round.moves.len();
        }
        for shard in round.moves {
            *per_shard.entry((shard.type_name, shard.shard)).or_default() += 1;
        }
    }
    (per_shard.into_values().max().unwrap_or(0), moved_late)
}

/// Every second, the time since `start`, the running counts of on-node
/// and cross-node asks, and the process's CPU time since `cpu_before`.
async fn sample(
    counts: Arc<Counts>,
    (start, cpu_before): (Instant, Duration),
    series: Arc<Mutex<Vec<Sample>>>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let (local, remote) = counts.now();
        let at = start.elapsed();
        let cpu = cpu_time().saturating_sub(cpu_before);
        series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Sample {
                at,
                local,
                remote,
                cpu,
            });
    }
}

/// Running counts at a time.
#[derive(Clone, Copy)]
struct Sample {
    at: Duration,
    local: u64,
    remote: u64,
    cpu: Duration,
}

/// The run's second half, from the first sample at or past half its
/// length to the last: asks per second, CPU per ask and the on-node
/// fraction, once a placement has had time to settle.
fn second_half(samples: &[Sample]) -> Value {
    let Some(last) = samples.last() else {
        return Value::Null;
    };
    let Some(from) = samples.iter().find(|s| s.at >= last.at / 2) else {
        return Value::Null;
    };
    let (local, remote) = (last.local - from.local, last.remote - from.remote);
    let asks = (local + remote).max(1) as f64;
    let seconds = (last.at - from.at).as_secs_f64();
    if seconds <= 0.0 {
        return Value::Null;
    }
    json!({
        "from_s": from.at.as_secs_f64(),
        "asks_per_sec": asks / seconds,
        "cpu_us_per_ask": last.cpu.saturating_sub(from.cpu).as_secs_f64() * 1e6 / asks,
        "on_node": local as f64 / asks,
    })
}

/// Between one sample and the next: when the interval ended, the asks
/// answered in it, their rate and CPU per ask, and the on-node fraction
/// of them (`null` for none).
fn intervals(samples: &[Sample]) -> Vec<Value> {
    let mut before = (0, 0, Duration::ZERO, Duration::ZERO);
    let mut intervals = Vec::new();
    for sample in samples {
        let (local, remote) = (sample.local - before.0, sample.remote - before.1);
        let asks = local + remote;
        let fraction = (asks > 0).then(|| local as f64 / asks as f64);
        let seconds = sample.at.saturating_sub(before.2).as_secs_f64();
        let cpu = sample.cpu.saturating_sub(before.3).as_secs_f64();
        intervals.push(json!({
            "t_s": sample.at.as_secs_f64(),
            "asks": asks,
            "asks_per_sec": (seconds > 0.0).then(|| asks as f64 / seconds),
            "cpu_us_per_ask": (asks > 0).then(|| cpu * 1e6 / asks as f64),
            "on_node": fraction,
        }));
        before = (sample.local, sample.remote, sample.at, sample.cpu);
    }
    intervals
}

/// One driver per node, `count` asks to the fronts in all, `in_flight`
/// each; the latency of every ask.
async fn drive(
    nodes: &[Node],
    count: u64,
    in_flight: usize,
    counts: &Arc<Counts>,
) -> Histogram<u64> {
    let shares = super::shares(count);
    let mut drivers = Vec::new();
    for (d, (node, share)) in nodes.iter().zip(shares).enumerate() {
        let system = node.system.clone();
        let counts = counts.clone();
        drivers.push(tokio::spawn(async move {
            let fronts: Vec<EntityRef<Front>> = (0..FRONTS)
                .map(|k| system.entity_ref::<Front>(front_id(k)))
                .collect();
            let mut latency = Histogram::<u64>::new(3).expect("histogram");
            // A prime stride: a driver's first 10,000 asks reach every front.
            let stride = 7_919;
            let one = |k: u64| {
                let front = &fronts[((k * stride + d as u64 * 3_331) % FRONTS) as usize];
                async move {
                    let asked = Instant::now();
                    (front.ask(Visit, TIMEOUT).await, asked.elapsed())
                }
            };
            super::harness::windowed(share, in_flight, one, |(answer, took)| {
                let counter = match answer {
                    Ok(true) => &counts.local,
                    Ok(false) => &counts.remote,
                    Err(_) => &counts.failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                let _ = latency.record(took.as_micros() as u64);
            })
            .await;
            latency
        }));
    }
    let mut latency = Histogram::<u64>::new(3).expect("histogram");
    for driver in drivers {
        if let Ok(one) = driver.await {
            let _ = latency.add(one);
        }
    }
    latency
}
