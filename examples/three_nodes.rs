//! The main job: a three-node cluster on 127.0.0.1 doing the W1 workload's
//! data path, with its figures printed.
//!
//! Three `ClusterNode`s form a cluster over authenticated TCP pipes. Each hosts
//! a `ShardedSystem` with the W1 ping entity (1,000 entities, 128 shards).
//! Until the shard coordinator exists, shards are placed statically: shard `s`
//! lives on node `s mod 3`. Each node runs one W1 driver (BENCHMARK.md): driver
//! `d` sends its k-th ask to `entity-{(3k + d) mod 1000}` with at most 16 in
//! flight; an ask for a local entity goes straight to its `EntityRef` (never
//! serialized), a remote one crosses the pipe as CBOR and the owner answers it
//! through its own `EntityRef`. Every ack is checked against its request.
//! Finally one node crashes (no goodbye) and the time until the others mark it
//! Down is printed.
//!
//! Run: `cargo run --release --example three_nodes [-- --messages N --in-flight W]`

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::membership::MembershipEvent;
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::transport::{Incoming, Transport};
use futures_util::StreamExt;
use hdrhistogram::Histogram;

#[path = "../protocols/ping.rs"]
mod ping;
use ping::{Ack, Checks, Ping, PingEntity, Pinger};

const WORK_CHANNEL: u16 = 2;
const ENTITIES: u64 = 1_000;
const NODES: usize = 3;
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Parser, Debug)]
#[command(about = "A three-node cluster doing the W1 data path, with its figures printed")]
struct Args {
    /// Messages in all, shared by the three drivers.
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Asks in flight per driver.
    #[arg(long, default_value_t = 16)]
    in_flight: usize,
}

struct Node {
    cluster: ClusterNode,
    system: ShardedSystem,
}

/// Which node owns an entity: static placement, shard mod 3.
fn owner(system: &ShardedSystem, entity: &str) -> usize {
    system.entity_ref::<Pinger>(entity).shard_id().0 as usize % NODES
}

fn entity_id(k: u64) -> String {
    format!("entity-{k}")
}

/// Answers remote asks on one task: each request is decoded and its ask to
/// the local entity started in arrival order (the pipe's order, so one
/// driver's messages to an entity stay in order), while the replies are
/// awaited concurrently.
fn serve(transport: &Transport, system: ShardedSystem) {
    let mut inbound = transport
        .register(WORK_CHANNEL, 65_536)
        .expect("work channel");
    tokio::spawn(async move {
        let mut serving = futures_util::stream::FuturesUnordered::new();
        loop {
            tokio::select! {
                incoming = inbound.recv() => match incoming {
                    Some(incoming) => serving.push(serve_one(system.clone(), incoming)),
                    None => break,
                },
                Some(()) = serving.next(), if !serving.is_empty() => {}
            }
        }
    });
}

async fn serve_one(system: ShardedSystem, incoming: Incoming) {
    let Some(reply) = incoming.reply else { return };
    let (entity, ping): (String, Ping) = match ciborium::from_reader(&incoming.payload[..]) {
        Ok(request) => request,
        Err(error) => return drop(reply.fail(format!("bad request: {error}"))),
    };
    match system
        .entity_ref::<Pinger>(entity)
        .ask(ping, ASK_TIMEOUT)
        .await
    {
        Ok(ack) => {
            let mut out = Vec::with_capacity(16);
            ciborium::into_writer(&ack, &mut out).expect("ack encodes");
            let _ = reply.reply(Bytes::from(out));
        }
        Err(error) => drop(reply.fail(error.to_string())),
    }
}

async fn ask(nodes: &[Node], from: usize, entity: String, ping: Ping) -> Result<Ack, String> {
    let to = owner(&nodes[from].system, &entity);
    if to == from {
        return nodes[from]
            .system
            .entity_ref::<Pinger>(entity)
            .ask(ping, ASK_TIMEOUT)
            .await
            .map_err(|e| e.to_string());
    }
    let mut payload = Vec::with_capacity(48);
    ciborium::into_writer(&(entity, ping), &mut payload).map_err(|e| e.to_string())?;
    let peer = nodes[to].cluster.self_address();
    let reply = nodes[from]
        .cluster
        .transport()
        .request(&peer, WORK_CHANNEL, Bytes::from(payload), ASK_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    ciborium::from_reader(&reply[..]).map_err(|e| e.to_string())
}

struct DriverReport {
    latency: Histogram<u64>,
    acks: u64,
    retries: u64,
}

/// Driver `d`: its share of the messages, issued in `seq` order with at most
/// `in_flight` asks outstanding (so an entity, which hears from a driver every
/// 1,000 messages, sees that driver's seqs in order); a failed ask is retried
/// with the same `(driver, seq)`.
async fn drive(nodes: Arc<Vec<Node>>, d: usize, count: u64, in_flight: usize) -> DriverReport {
    let mut report = DriverReport {
        latency: Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram"),
        acks: 0,
        retries: 0,
    };
    let asks = futures_util::stream::iter(0..count).map(|k| {
        let nodes = nodes.clone();
        async move {
            let ping = Ping {
                driver: d as u32,
                seq: k,
            };
            let entity = entity_id((3 * k + d as u64) % ENTITIES);
            let mut latencies = Vec::with_capacity(1);
            loop {
                let start = Instant::now();
                let result = ask(&nodes, d, entity.clone(), ping).await;
                latencies.push((start.elapsed().as_micros() as u64).max(1));
                match result {
                    Ok(ack)
                        if ack
                            == Ack {
                                driver: ping.driver,
                                seq: ping.seq,
                            } =>
                    {
                        return latencies;
                    }
                    Ok(ack) => panic!("wrong ack {ack:?} for {ping:?}"),
                    Err(_) => {}
                }
            }
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
            .num_shards(128)
            .passivation_idle_timeout(None)
            .build();
        let system = ShardedSystem::builder().config(sharding).start().await?;
        let node_checks = checks.clone();
        system
            .register::<PingEntity>(move |_| PingEntity::checked(node_checks.clone()))
            .await?;
        serve(cluster.transport(), system.clone());
        nodes.push(Node { cluster, system });
    }
    let nodes = Arc::new(nodes);

    // Warm-up, not counted: one ask per entity, from the node that owns it.
    for k in 0..ENTITIES {
        let entity = entity_id(k);
        let owner_node = owner(&nodes[0].system, &entity);
        ask(&nodes, owner_node, entity, Ping { driver: 99, seq: k }).await?;
    }

    let shares: Vec<u64> = (0..NODES as u64)
        .map(|d| args.messages / 3 + u64::from(d < args.messages % 3))
        .collect();
    let cpu_before = cpu_time();
    let start = Instant::now();
    let drivers: Vec<_> = (0..NODES)
        .map(|d| tokio::spawn(drive(nodes.clone(), d, shares[d], args.in_flight)))
        .collect();
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut acks, mut retries) = (0, 0);
    for driver in drivers {
        let report = driver.await?;
        latency.add(&report.latency)?;
        acks += report.acks;
        retries += report.retries;
    }
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);

    println!(
        "three-node cluster, W1 data path (static placement: shard mod 3; no coordinator yet)"
    );
    println!(
        "  cluster formed (3 Up)  {:>10.1} ms",
        formed.as_secs_f64() * 1e3
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
    println!(
        "  latency µs             p50 {} · p99 {} · p99.9 {} · max {}",
        latency.value_at_quantile(0.50),
        latency.value_at_quantile(0.99),
        latency.value_at_quantile(0.999),
        latency.max()
    );
    println!(
        "  CPU                    {:>10.2} µs/msg ({:.2} s user+sys)",
        cpu.as_secs_f64() * 1e6 / acks as f64,
        cpu.as_secs_f64()
    );
    println!(
        "  peak RSS (process)     {:>10.1} MiB",
        peak_rss_kib() as f64 / 1024.0
    );

    // Crash node 2 and time its detection on the others.
    let victim = nodes[2].cluster.self_address();
    let mut watchers: Vec<_> = nodes[..2].iter().map(|n| n.cluster.subscribe()).collect();
    let crashed = Instant::now();
    nodes[2].cluster.crash().await;
    for (i, events) in watchers.iter_mut().enumerate() {
        let seen = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                if let Ok(MembershipEvent::MemberDowned(m)) = events.recv().await
                    && m == victim
                {
                    return crashed.elapsed();
                }
            }
        })
        .await?;
        println!(
            "  node {i} saw the crashed node Down {:.0} ms after the crash (bound: {:?} after its last heartbeat)",
            seen.as_secs_f64() * 1e3,
            nodes[0]
                .cluster
                .config()
                .detect_and_down_time()
                .unwrap_or_default()
        );
    }
    for node in nodes.iter().take(2) {
        node.system.shutdown().await;
        node.cluster.shutdown().await.ok();
    }
    nodes[2].system.shutdown().await;
    Ok(())
}
