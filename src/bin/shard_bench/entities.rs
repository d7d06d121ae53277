//! How memory and the ask rate grow with the live entities on one node:
//! for each count, a fresh child process starts a one-node system, makes
//! that many entities live (each holds one `u64`), then sends asks spread
//! evenly over all of them; and, in another child, spawns as many bare
//! ractor actors holding one `u64`, the floor an entity-per-actor design
//! stands on. Each child's resident memory before and after says what one
//! live entity (or actor) costs. SPEC §13b.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use datum_cluster_sharding::prelude::*;
use futures_util::StreamExt;
use hdrhistogram::Histogram;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde_json::{Value, json};

use super::curve_chart::{Panel, Series, draw};

/// Asks in flight while starting entities and while measuring.
const CONCURRENCY: usize = 256;
const ASK: Duration = Duration::from_secs(30);

#[derive(Serialize, Deserialize)]
pub struct Bump;

protocol! {
    /// An entity that counts.
    pub protocol Tally = "tally" {
        ask Bump -> u64;
    }
}

#[derive(Default)]
pub struct TallyEntity {
    count: u64,
}

impl Entity for TallyEntity {
    type Protocol = Tally;
}
impl Handler<Bump> for TallyEntity {
    async fn handle(&mut self, _: Bump, _: &EntityContext) -> ShardingResult<u64> {
        self.count += 1;
        Ok(self.count)
    }
}

/// A bare ractor actor holding one `u64`.
struct Bare;

impl Actor for Bare {
    type Msg = ();
    type State = u64;
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<()>, _: ()) -> Result<u64, ActorProcessingErr> {
        Ok(0)
    }
}

/// Resident memory of this process now, in bytes.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn entity_id(i: u64) -> String {
    format!("tally-{i}")
}

/// One child's measure: `count` live entities of a one-node system, then
/// `asks` asks spread over them (the k-th to entity `k·p mod count`, `p`
/// a large prime, so every entity is asked in turn).
pub async fn child_entities(
    count: u64,
    asks: u64,
) -> Result<(Value, bool), Box<dyn std::error::Error>> {
    let count = count.max(1);
    let before = rss_bytes();
    let config = ShardingConfig::builder()
        .num_shards(128)
        .passivation_idle_timeout(None)
        .allocation_buffer(1_000_000)
        .build();
    let system = ShardedSystem::builder().config(config).start().await?;
    system
        .entity_type::<TallyEntity>()
        .register(|_| TallyEntity::default())
        .await?;
    let started = Instant::now();
    let failed = futures_util::stream::iter(0..count)
        .map(|i| {
            let entity = system.entity_ref::<Tally>(entity_id(i));
            async move { entity.ask(Bump, ASK).await.is_err() }
        })
        .buffer_unordered(CONCURRENCY)
        .filter(|failed| std::future::ready(*failed))
        .count()
        .await;
    let start_all = started.elapsed();
    let live_bytes = rss_bytes().saturating_sub(before);

    const STRIDE: u64 = 2_654_435_761;
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).expect("bounds");
    let started = Instant::now();
    let timings: Vec<Option<u64>> = futures_util::stream::iter(0..asks)
        .map(|k| {
            let entity = system.entity_ref::<Tally>(entity_id(k.wrapping_mul(STRIDE) % count));
            async move {
                let sent = Instant::now();
                entity
                    .ask(Bump, ASK)
                    .await
                    .ok()
                    .map(|_| sent.elapsed().as_micros() as u64)
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let asking = started.elapsed();
    let mut missing = failed as u64;
    for timing in timings {
        match timing {
            Some(us) => latency.saturating_record(us.max(1)),
            None => missing += 1,
        }
    }
    let live = system
        .shard_region_state::<Tally>()
        .map_or(0, |s| s.shards.values().sum::<usize>());
    let rss_live = rss_bytes();
    system.shutdown().await;
    let json = json!({
        "kind": "entities",
        "count": count,
        "live": live,
        "start_all_ms": start_all.as_secs_f64() * 1e3,
        "bytes_per_entity": live_bytes as f64 / count as f64,
        "rss_mib": rss_live as f64 / 1048576.0,
        "asks": asks,
        "asks_per_sec": asks as f64 / asking.as_secs_f64(),
        "p50_us": latency.value_at_quantile(0.5),
        "p99_us": latency.value_at_quantile(0.99),
        "missing": missing,
    });
    Ok((json, missing == 0 && live as u64 == count))
}

/// One child's floor: `count` bare ractor actors holding one `u64`.
pub async fn child_bare(count: u64) -> Result<(Value, bool), Box<dyn std::error::Error>> {
    let count = count.max(1);
    let before = rss_bytes();
    let started = Instant::now();
    let mut actors = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let (actor, handle) = Actor::spawn(None, Bare, ()).await?;
        actors.push((actor, handle));
    }
    let spawn_all = started.elapsed();
    // (The vector of refs and handles is the caller's, not the actors'.)
    let refs = (count as usize * std::mem::size_of::<(ActorRef<()>, tokio::task::JoinHandle<()>)>())
        as u64;
    let bytes = rss_bytes().saturating_sub(before).saturating_sub(refs);
    for (actor, handle) in actors {
        actor.stop(None);
        let _ = handle.await;
    }
    let json = json!({
        "kind": "bare",
        "count": count,
        "start_all_ms": spawn_all.as_secs_f64() * 1e3,
        "bytes_per_actor": bytes as f64 / count as f64,
    });
    Ok((json, true))
}

/// Runs `this binary entities --entity-count N [--bare]` and reads its
/// JSON record.
fn run_child(count: u64, asks: u64, bare: bool) -> Result<Value, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut command = Command::new(exe);
    command.args([
        "entities",
        "--entity-count",
        &count.to_string(),
        "--messages",
        &asks.to_string(),
    ]);
    if bare {
        command.arg("--bare");
    }
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    // A child that printed its record and exited 1 counted something
    // wrong: its record says what, and the parent's exit code too.
    serde_json::from_str(last).map_err(|e| {
        format!(
            "the child for {count} printed no record ({e}, {}): {stdout}",
            output.status
        )
    })
}

/// The parent: every count in a child of its own, sharded and bare; a
/// table, the chart at `chart` if given, and the JSON record.
pub fn run(counts: &[u64], asks: u64, chart: Option<&Path>) -> Result<(Value, bool), String> {
    println!(
        "{:>9} {:>12} {:>12} {:>12} {:>12} {:>9} {:>9} {:>13}",
        "entities", "start ms", "B/entity", "B/actor", "asks/s", "p50 µs", "p99 µs", "RSS MiB"
    );
    let mut points = Vec::new();
    for &count in counts {
        let sharded = run_child(count, asks, false)?;
        let bare = run_child(count, asks, true)?;
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
        println!(
            "{:>9} {:>12.0} {:>12.0} {:>12.0} {:>12.0} {:>9.0} {:>9.0} {:>13.1}",
            count,
            f(&sharded, "start_all_ms"),
            f(&sharded, "bytes_per_entity"),
            f(&bare, "bytes_per_actor"),
            f(&sharded, "asks_per_sec"),
            f(&sharded, "p50_us"),
            f(&sharded, "p99_us"),
            f(&sharded, "rss_mib"),
        );
        points.push((count, sharded, bare));
    }
    if let Some(path) = chart {
        let line = |label: &str, value: &dyn Fn(&(u64, Value, Value)) -> f64| Series {
            label: label.into(),
            points: points.iter().map(|p| (p.0 as f64, value(p))).collect(),
        };
        draw(
            path,
            &[
                Panel {
                    title: "Memory per live entity".into(),
                    x_label: "live entities on one node".into(),
                    y_label: "bytes of RSS each".into(),
                    series: vec![
                        line("entity (library + actor)", &|p| {
                            p.1["bytes_per_entity"].as_f64().unwrap_or(1.0)
                        }),
                        line("bare ractor actor", &|p| {
                            p.2["bytes_per_actor"].as_f64().unwrap_or(1.0)
                        }),
                    ],
                },
                Panel {
                    title: "Asks over all of them".into(),
                    x_label: "live entities on one node".into(),
                    y_label: "asks per second".into(),
                    series: vec![line("256 in flight", &|p| {
                        p.1["asks_per_sec"].as_f64().unwrap_or(1.0)
                    })],
                },
            ],
        )
        .map_err(|e| format!("drawing {}: {e}", path.display()))?;
        eprintln!("shard-bench: chart written to {}", path.display());
    }
    let correct = points.iter().all(|p| p.1["missing"] == 0);
    let json = json!({
        "workload": "entities",
        "points": points.iter().map(|(count, sharded, bare)| json!({
            "entities": count,
            "sharded": sharded,
            "bare": bare,
        })).collect::<Vec<_>>(),
    });
    Ok((json, correct))
}
