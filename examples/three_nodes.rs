//! The main job: a three-node cluster on 127.0.0.1 doing the W1 workload
//! through the library, then losing a node under traffic.
//!
//! Three `ClusterNode`s form a cluster over authenticated TCP pipes. Each runs
//! a `ShardedSystem` on its node (`builder().node(..)`) and registers the W1
//! ping entity (1,000 entities, 128 shards); the coordinator places the
//! shards. Each node runs one W1 driver (BENCHMARK.md): driver `d` sends its
//! k-th ask to `entity-{(3k + d) mod 1000}` with at most 16 in flight, all
//! through plain `EntityRef`s — the library decides whether an entity is
//! local (never serialized) or remote (encoded once into the owner's pipe).
//! Every ack is checked against its request.
//!
//! Then the two surviving drivers keep going while node 2 is killed (no
//! goodbye): the run prints the shards per node before and after, when the
//! killed node was Down, how long until every entity that lived on it
//! answered again, and the acks, all of which arrive with the drivers'
//! retries.
//!
//! Run: `cargo run --release --example three_nodes [-- --messages N --in-flight W]`

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::membership::MembershipEvent;
use datum_cluster_sharding::prelude::*;
use futures_util::StreamExt;
use hdrhistogram::Histogram;
use tokio::sync::Mutex;

#[path = "../protocols/ping.rs"]
mod ping;
use ping::{Ack, Checks, Ping, PingEntity, Pinger};

const ENTITIES: u64 = 1_000;
const NODES: usize = 3;
const SHARDS: u32 = 128;
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Parser, Debug)]
#[command(about = "A three-node cluster doing W1 through the library, then losing a node")]
struct Args {
    /// W1 messages in all, shared by the three drivers.
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Asks in flight per driver.
    #[arg(long, default_value_t = 16)]
    in_flight: usize,
    /// Messages the two surviving drivers send in the kill phase.
    #[arg(long, default_value_t = 200_000)]
    kill_messages: u64,
}

struct Node {
    cluster: ClusterNode,
    system: ShardedSystem,
}

fn entity_id(k: u64) -> String {
    format!("entity-{k}")
}

/// When each entity (by number) first answered after `since` (the kill phase).
#[derive(Default)]
struct Answered {
    since: Option<Instant>,
    first: HashMap<u64, Duration>,
}

struct DriverReport {
    latency: Histogram<u64>,
    acks: u64,
    retries: u64,
}

/// Driver `d` on `system`: its share of the messages, issued in `seq` order
/// with at most `in_flight` asks outstanding (so an entity sees one driver's
/// seqs in order); a failed ask is retried with the same `(driver, seq)`.
async fn drive(
    system: ShardedSystem,
    d: u32,
    stride: u64,
    count: u64,
    in_flight: usize,
    answered: Option<Arc<Mutex<Answered>>>,
) -> DriverReport {
    let mut report = DriverReport {
        latency: Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram"),
        acks: 0,
        retries: 0,
    };
    // A user holds its refs: one per entity, made once.
    let refs: Arc<Vec<EntityRef<Pinger>>> = Arc::new(
        (0..ENTITIES)
            .map(|k| system.entity_ref::<Pinger>(entity_id(k)))
            .collect(),
    );
    let asks = futures_util::stream::iter(0..count).map(|k| {
        let refs = refs.clone();
        let answered = answered.clone();
        async move {
            let ping = Ping { driver: d, seq: k };
            let id = (stride * k + u64::from(d)) % ENTITIES;
            let entity = &refs[id as usize];
            let mut latencies = Vec::with_capacity(1);
            loop {
                let start = Instant::now();
                let result = entity.ask(ping, ASK_TIMEOUT).await;
                latencies.push((start.elapsed().as_micros() as u64).max(1));
                match result {
                    Ok(ack) if ack == Ack { driver: d, seq: k } => break,
                    Ok(ack) => panic!("wrong ack {ack:?} for {ping:?}"),
                    Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            }
            if let Some(answered) = answered {
                let mut answered = answered.lock().await;
                if let Some(since) = answered.since {
                    let at = since.elapsed();
                    answered.first.entry(id).or_insert(at);
                }
            }
            latencies
        }
    });
    let mut done = asks.buffer_unordered(in_flight);
    while let Some(latencies) = done.next().await {
        report.retries += latencies.len() as u64 - 1;
        for micros in latencies {
            report.latency.saturating_record(micros);
        }
        report.acks += 1;
    }
    report
}

/// User + system CPU of this process, from /proc (Linux).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum())
        .unwrap_or(0);
    Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn shards_per_node(nodes: &[Node]) -> Vec<usize> {
    nodes
        .iter()
        .map(|n| n.system.hosted_shards::<Pinger>())
        .collect()
}

async fn join_reports(
    drivers: Vec<tokio::task::JoinHandle<DriverReport>>,
) -> Result<(Histogram<u64>, u64, u64), Box<dyn std::error::Error>> {
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut acks, mut retries) = (0, 0);
    for driver in drivers {
        let report = driver.await?;
        latency.add(&report.latency)?;
        acks += report.acks;
        retries += report.retries;
    }
    Ok((latency, acks, retries))
}

fn print_latency(latency: &Histogram<u64>) {
    println!(
        "  latency µs             p50 {} · p99 {} · p99.9 {} · max {}",
        latency.value_at_quantile(0.50),
        latency.value_at_quantile(0.99),
        latency.value_at_quantile(0.999),
        latency.max()
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let config = |seeds| {
        ClusterConfig::builder()
            .cluster_name("three-nodes")
            .secret("demo-secret")
            .seed_nodes(seeds)
            .build()
    };

    let formed = Instant::now();
    let first = ClusterNode::start(config(vec![])).await?;
    let mut clusters = vec![first.clone()];
    for _ in 1..NODES {
        clusters.push(ClusterNode::start(config(vec![first.bound_addr()])).await?);
    }
    for c in &clusters {
        c.wait_until(|s| s.up_members().count() == NODES, Duration::from_secs(30))
            .await?;
    }
    let formed = formed.elapsed();

    let checks = Arc::new(Checks::default());
    let mut nodes = Vec::new();
    for cluster in clusters {
        let sharding = ShardingConfig::builder()
            .num_shards(SHARDS)
            .passivation_idle_timeout(None)
            .build();
        let system = ShardedSystem::builder()
            .config(sharding)
            .node(cluster.clone())
            .start()
            .await?;
        let node_checks = checks.clone();
        system
            .register::<PingEntity>(move |_| PingEntity::checked(node_checks.clone()))
            .await?;
        nodes.push(Node { cluster, system });
    }

    // Warm-up, not counted: one ask per entity from each node, which
    // allocates every shard and spawns every entity.
    let warm = Instant::now();
    for (i, n) in nodes.iter().enumerate() {
        for k in 0..ENTITIES {
            let entity = n.system.entity_ref::<Pinger>(entity_id(k));
            let ping = Ping {
                driver: 90 + i as u32,
                seq: k,
            };
            entity.ask(ping, ASK_TIMEOUT).await?;
        }
    }
    let warm = warm.elapsed();
    let before = shards_per_node(&nodes);

    // Phase 1: W1.
    let shares: Vec<u64> = (0..NODES as u64)
        .map(|d| args.messages / 3 + u64::from(d < args.messages % 3))
        .collect();
    let stats_before: Vec<_> = nodes
        .iter()
        .map(|n| n.cluster.transport().stats())
        .collect();
    let cpu_before = cpu_time();
    let start = Instant::now();
    let drivers: Vec<_> = (0..NODES)
        .map(|d| {
            let system = nodes[d].system.clone();
            tokio::spawn(drive(system, d as u32, 3, shares[d], args.in_flight, None))
        })
        .collect();
    let (latency, acks, retries) = join_reports(drivers).await?;
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    let (frames, writes) = nodes
        .iter()
        .zip(&stats_before)
        .fold((0, 0), |(f, w), (n, b)| {
            let s = n.cluster.transport().stats();
            (
                f + s.frames_written - b.frames_written,
                w + s.writes - b.writes,
            )
        });

    println!("three-node cluster, W1 through EntityRef (coordinator-placed shards)");
    println!(
        "  cluster formed (3 Up)  {:>10.1} ms",
        formed.as_secs_f64() * 1e3
    );
    println!(
        "  shards per node        {:>10}   (allocated by least-shards on first use; warm-up {:.0} ms)",
        format!("{before:?}"),
        warm.as_secs_f64() * 1e3
    );
    println!(
        "  messages               {:>10}   ({} in flight per driver, 3 drivers)",
        acks, args.in_flight
    );
    println!("  missing acks           {:>10}", args.messages - acks);
    println!(
        "  duplicate processings  {:>10}",
        checks.duplicate_processings.load(Ordering::Relaxed)
    );
    println!(
        "  order violations       {:>10}",
        checks.order_violations.load(Ordering::Relaxed)
    );
    println!("  retries                {:>10}", retries);
    println!(
        "  wall                   {:>10.1} ms",
        wall.as_secs_f64() * 1e3
    );
    println!(
        "  throughput             {:>10.0} msg/s",
        acks as f64 / wall.as_secs_f64()
    );
    print_latency(&latency);
    println!(
        "  CPU                    {:>10.2} µs/msg ({:.2} s user+sys)",
        cpu.as_secs_f64() * 1e6 / acks as f64,
        cpu.as_secs_f64()
    );
    println!(
        "  peak RSS (process)     {:>10.1} MiB",
        peak_rss_kib() as f64 / 1024.0
    );
    println!(
        "  pipe batching          {:>10.1} frames per write ({frames} frames)",
        frames as f64 / writes.max(1) as f64
    );

    // Phase 2: the drivers on nodes 0 and 1 keep going; node 2 is killed.
    let affected: Vec<u64> = (0..ENTITIES)
        .filter(|k| {
            let shard = nodes[0]
                .system
                .entity_ref::<Pinger>(entity_id(*k))
                .shard_id();
            // Where the entity lives now: the node whose region hosts its shard.
            nodes[2].system.live_entities::<Pinger>(shard) > 0
        })
        .collect();
    let answered = Arc::new(Mutex::new(Answered::default()));
    let share = args.kill_messages / 2;
    let kill_drivers: Vec<_> = (0..2)
        .map(|d| {
            let system = nodes[d].system.clone();
            let answered = answered.clone();
            tokio::spawn(drive(
                system,
                10 + d as u32,
                2,
                share,
                args.in_flight,
                Some(answered),
            ))
        })
        .collect();
    // Let traffic run, then kill.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let victim = nodes[2].cluster.self_address();
    let mut watchers: Vec<_> = nodes[..2].iter().map(|n| n.cluster.subscribe()).collect();
    let killed = Instant::now();
    answered.lock().await.since = Some(killed);
    nodes[2].cluster.crash().await;
    let mut downed = Vec::new();
    for events in watchers.iter_mut() {
        let seen = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if let Ok(MembershipEvent::MemberDowned(m)) = events.recv().await
                    && m == victim
                {
                    return killed.elapsed();
                }
            }
        })
        .await?;
        downed.push(seen);
    }
    let (latency, acks, retries) = join_reports(kill_drivers).await?;
    let after = shards_per_node(&nodes[..2]);
    let answered = answered.lock().await;
    let rehomed = affected
        .iter()
        .filter_map(|id| answered.first.get(id))
        .max()
        .copied();
    let unanswered = affected
        .iter()
        .filter(|id| !answered.first.contains_key(*id))
        .count();
    let first_ack = answered.first.values().min().copied();
    println!(
        "node 2 killed under traffic (two drivers, {} asks)",
        2 * share
    );
    println!(
        "  Down seen by nodes 0, 1 {:.0} / {:.0} ms after the kill (bound: {:?} after the last heartbeat)",
        downed[0].as_secs_f64() * 1e3,
        downed[1].as_secs_f64() * 1e3,
        nodes[0]
            .cluster
            .config()
            .detect_and_down_time()
            .unwrap_or_default()
    );
    println!(
        "  shards per node        {:>10} → {:?}",
        format!("{before:?}"),
        after
    );
    println!(
        "  affected entities      {:>10}   (lived on node 2; {} not asked after the kill)",
        affected.len(),
        unanswered
    );
    match rehomed {
        Some(t) => println!(
            "  all answered again     {:>10.0} ms after the kill",
            t.as_secs_f64() * 1e3
        ),
        None => println!("  all answered again            n/a"),
    }
    if let Some(t) = first_ack {
        println!(
            "  first ack after kill   {:>10.3} ms",
            t.as_secs_f64() * 1e3
        );
    }
    println!(
        "  acks                   {:>10}   missing {} · retries {}",
        acks,
        2 * share - acks,
        retries
    );
    println!(
        "  DeadOwner moves        {:>10}",
        nodes[0]
            .system
            .rebalance_rounds()
            .iter()
            .map(|r| r.moves.len())
            .sum::<usize>()
    );
    print_latency(&latency);
    for node in nodes.iter().take(2) {
        node.system.shutdown().await;
        node.cluster.shutdown().await.ok();
    }
    nodes[2].system.shutdown().await;
    Ok(())
}
