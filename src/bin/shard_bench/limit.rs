//! W5 (BENCHMARK.md): passivation by an active-entity limit on a skewed
//! load. Three nodes in one process, 1,000,000 entity ids, a limit of
//! 10,000 live entities per region, entities holding 1 KiB of state and
//! costing 200 µs to start (a blocking-pool wait, standing in for loading
//! their state); the asks' ids are drawn from a Zipf distribution
//! (exponent 1.0), or in the scan mix, every other one from a sequential
//! scan over all ids. Each (policy, mix) runs in a fresh child process, so
//! its peak RSS is its own; `idle` is idle-only passivation (1 s), no limit.
//! The figure that matters is the hit rate: the asks that found their
//! entity alive.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use datum_cluster_sharding::prelude::*;
use hdrhistogram::Histogram;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde_json::{Value, json};

use super::harness::{Node, cpu_time, form_cluster, peak_rss_kib};

/// The id space.
const IDS: u64 = 1_000_000;
/// Live entities per region.
const LIMIT: usize = 10_000;
/// What starting an entity costs.
const START_COST: Duration = Duration::from_micros(200);
/// The idle timeout of the idle-only run.
const IDLE: Duration = Duration::from_secs(1);

/// Which passivation a W5 run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Passivation {
    Lru,
    Slru,
    WTinyLfu,
    /// Idle-only (1 s), no limit.
    Idle,
}

impl Passivation {
    const ALL: [Passivation; 4] = [
        Passivation::Lru,
        Passivation::Slru,
        Passivation::WTinyLfu,
        Passivation::Idle,
    ];

    fn name(self) -> &'static str {
        match self {
            Passivation::Lru => "lru",
            Passivation::Slru => "slru",
            Passivation::WTinyLfu => "w-tiny-lfu",
            Passivation::Idle => "idle",
        }
    }

    fn config(self) -> ShardingConfig {
        let limit = |policy| Some(EntityLimit::new(LIMIT).with_policy(policy));
        let (idle, limit) = match self {
            Passivation::Lru => (None, limit(PassivationPolicy::LeastRecentlyUsed)),
            Passivation::Slru => (None, limit(PassivationPolicy::SegmentedLru)),
            Passivation::WTinyLfu => (None, limit(PassivationPolicy::WTinyLfu)),
            Passivation::Idle => (Some(IDLE), None),
        };
        ShardingConfig::builder()
            .num_shards(128)
            .passivation_idle_timeout(idle)
            .entity_limit(limit)
            .build()
    }
}

/// How a W5 run draws its ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mix {
    /// Zipf, exponent 1.0, over all ids.
    Zipf,
    /// Every other ask from a sequential scan over all ids, the others Zipf.
    Scan,
}

impl Mix {
    const ALL: [Mix; 2] = [Mix::Zipf, Mix::Scan];

    fn name(self) -> &'static str {
        match self {
            Mix::Zipf => "zipf",
            Mix::Scan => "scan",
        }
    }
}

/// One visit: the reply says whether it started the entity.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Visit;

protocol! {
    /// W5's entity: state that costs a start.
    pub protocol Cached = "w5-cached" {
        ask Visit -> bool;
    }
}

/// 1 KiB of state, and whether it has been visited yet.
pub struct CachedEntity {
    state: Vec<u8>,
    visited: bool,
}

impl Entity for CachedEntity {
    type Protocol = Cached;
}

impl Handler<Visit> for CachedEntity {
    async fn handle(&mut self, _: Visit, _: &EntityContext) -> ShardingResult<bool> {
        if self.visited {
            return Ok(false);
        }
        // Loading the state: a wait off the runtime's threads.
        let _ = tokio::task::spawn_blocking(|| std::thread::sleep(START_COST)).await;
        self.state[0] = 1;
        self.visited = true;
        Ok(true)
    }
}

/// Every (policy, mix), each in a child process; prints the table and
/// returns the JSON record.
pub fn run_all(messages: u64, in_flight: usize) -> Result<(Value, bool), String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    let mut correct = true;
    for mix in Mix::ALL {
        for policy in Passivation::ALL {
            let args = [
                "w5".to_owned(),
                "--messages".into(),
                messages.to_string(),
                "--in-flight".into(),
                in_flight.to_string(),
                "--passivation".into(),
                policy.name().into(),
                "--mix".into(),
                mix.name().into(),
            ];
            let record = super::pairs::run(&me, &args)?;
            correct &= record["failed_asks"].as_u64() == Some(0);
            runs.push(record);
        }
    }
    println!(
        "\nW5: {messages} asks over {IDS} ids, limit {LIMIT} per region, {in_flight} in flight per driver"
    );
    println!("mix   policy       hit rate   asks/s   p99 µs   peak RSS MiB   live at end");
    for r in &runs {
        println!(
            "{:<5} {:<11} {:>8.1} % {:>8.0} {:>8} {:>14.0} {:>13}",
            r["mix"].as_str().unwrap_or("?"),
            r["passivation"].as_str().unwrap_or("?"),
            r["hit_rate"].as_f64().unwrap_or(f64::NAN) * 100.0,
            r["msgs_per_sec"].as_f64().unwrap_or(f64::NAN),
            r["p99_us"].as_u64().unwrap_or(0),
            r["peak_rss_kib"].as_f64().unwrap_or(f64::NAN) / 1024.0,
            r["live_at_end"].as_u64().unwrap_or(0),
        );
    }
    Ok((json!({"workload": "w5", "runs": runs}), correct))
}

/// One W5 run in this process.
pub async fn run_one(
    messages: u64,
    in_flight: usize,
    passivation: Passivation,
    mix: Mix,
) -> Result<(Value, bool), Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster("shard-bench-w5", false).await?;
    let mut nodes = Vec::new();
    for cluster in clusters {
        let system = ShardedSystem::builder()
            .config(passivation.config())
            .node(cluster.clone())
            .start()
            .await?;
        system
            .entity_type::<CachedEntity>()
            .register(|_| CachedEntity {
                state: vec![0; 1024],
                visited: false,
            })
            .await?;
        nodes.push(Node { cluster, system });
    }
    let zipf = Zipf::new(IDS as f64, 1.0).map_err(|e| format!("zipf: {e}"))?;
    let scan = Arc::new(AtomicU64::new(0));
    let per_task = messages / (3 * in_flight as u64);
    let cpu_before = cpu_time();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (d, node) in nodes.iter().enumerate() {
        for t in 0..in_flight {
            let system = node.system.clone();
            let scan = scan.clone();
            let seed = (d * in_flight + t) as u64;
            tasks.push(tokio::spawn(async move {
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
                let mut latency = Histogram::<u64>::new(3).expect("histogram");
                let (mut misses, mut failed) = (0u64, 0u64);
                for _ in 0..per_task {
                    let id = if mix == Mix::Scan && rng.random_bool(0.5) {
                        scan.fetch_add(1, Ordering::Relaxed) % IDS
                    } else {
                        zipf.sample(&mut rng) as u64 - 1
                    };
                    let asked = Instant::now();
                    match system
                        .entity_ref::<Cached>(format!("id-{id}"))
                        .ask(Visit, Duration::from_secs(10))
                        .await
                    {
                        Ok(started) => misses += u64::from(started),
                        Err(_) => failed += 1,
                    }
                    let _ = latency.record(asked.elapsed().as_micros() as u64);
                }
                (latency, misses, failed)
            }));
        }
    }
    let mut latency = Histogram::<u64>::new(3).expect("histogram");
    let (mut misses, mut failed) = (0, 0);
    for task in tasks {
        let (l, m, f) = task.await?;
        latency.add(l).expect("same bounds");
        misses += m;
        failed += f;
    }
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    let asks = per_task * 3 * in_flight as u64;
    let live_at_end: usize = nodes
        .iter()
        .filter_map(|n| n.system.shard_region_state::<Cached>())
        .map(|s| s.shards.values().sum::<usize>())
        .sum();
    let peak = peak_rss_kib();
    super::stop(nodes).await;
    let hit_rate = 1.0 - misses as f64 / asks.max(1) as f64;
    println!(
        "w5 {:<5} {:<11} {asks} asks · hit rate {:.1} % · {:.0} asks/s · p99 {} µs · {:.1} µs CPU/ask · peak RSS {} MiB · {live_at_end} live at end · {failed} failed",
        mix.name(),
        passivation.name(),
        hit_rate * 100.0,
        asks as f64 / wall.as_secs_f64(),
        latency.value_at_quantile(0.99),
        cpu.as_secs_f64() * 1e6 / asks.max(1) as f64,
        peak / 1024,
    );
    let record = json!({
        "workload": "w5",
        "mix": mix.name(),
        "passivation": passivation.name(),
        "asks": asks,
        "misses": misses,
        "failed_asks": failed,
        "hit_rate": hit_rate,
        "msgs_per_sec": asks as f64 / wall.as_secs_f64(),
        "p50_us": latency.value_at_quantile(0.50),
        "p99_us": latency.value_at_quantile(0.99),
        "cpu_us_per_msg": cpu.as_secs_f64() * 1e6 / asks.max(1) as f64,
        "peak_rss_kib": peak,
        "live_at_end": live_at_end,
        "limit_per_region": LIMIT,
        "in_flight_per_driver": in_flight,
    });
    // Under a limit, three regions hold at most three limits.
    let within = matches!(passivation, Passivation::Idle) || live_at_end <= 3 * LIMIT;
    Ok((record, failed == 0 && within))
}
