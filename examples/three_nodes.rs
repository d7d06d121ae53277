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

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::Parser;
use datum_cluster_sharding::membership::MembershipEvent;
use datum_cluster_sharding::prelude::*;
use hdrhistogram::Histogram;
use tokio::sync::Mutex;

#[path = "../protocols/harness.rs"]
mod harness;
#[path = "../protocols/ping.rs"]
mod ping;
use harness::{
    Answered, Node, cpu_time, drive, entities_hosted_on, form_cluster, join_reports, peak_rss_kib,
    ping_factory, sharding_config, shares, warm_up,
};
use ping::{Checks, Pinger};

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

fn shards_per_node(nodes: &[Node]) -> Vec<usize> {
    nodes
        .iter()
        .map(|n| n.system.hosted_shards::<Pinger>())
        .collect()
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
    let (clusters, formed) = form_cluster("three-nodes", false).await?;
    let checks = Arc::new(Checks::default());
    let mut nodes = Vec::new();
    for cluster in clusters {
        let system = ShardedSystem::builder()
            .config(sharding_config())
            .node(cluster.clone())
            .start()
            .await?;
        system
            .entity_type::<ping::PingEntity>()
            .register(ping_factory(checks.clone()))
            .await?;
        nodes.push(Node { cluster, system });
    }

    // Warm-up, not counted: one ask per entity from each node, which
    // allocates every shard and spawns every entity.
    let warm = warm_up(&nodes).await?;
    let before = shards_per_node(&nodes);

    // Phase 1: W1.
    let shares = shares(args.messages);
    let stats_before: Vec<_> = nodes
        .iter()
        .map(|n| n.cluster.transport().stats())
        .collect();
    let cpu_before = cpu_time();
    let start = Instant::now();
    let drivers: Vec<_> = (0..3)
        .map(|d| {
            let system = nodes[d].system.clone();
            tokio::spawn(drive(system, d as u32, 3, shares[d], args.in_flight, None))
        })
        .collect();
    let harness::Joined {
        latency,
        acks,
        retries,
        ..
    } = join_reports(drivers).await?;
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
    let affected = entities_hosted_on(&nodes, 2);
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
    let harness::Joined {
        latency,
        acks,
        retries,
        ..
    } = join_reports(kill_drivers).await?;
    let after = shards_per_node(&nodes[..2]);
    let answered = answered.lock().await;
    let (rehomed, unanswered, first_ack) = answered.rehomed(&affected);
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
