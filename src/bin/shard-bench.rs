//! `shard-bench`: the workloads of BENCHMARK.md (W1, W1-sat, W2, W3, W4, W5) through
//! the public `EntityRef` API, three nodes in one process or in three
//! (`--mode multi-process`); baseline (a), the transport alone
//! (`transport`); the workload and its baselines interleaved (`--pairs N
//! --limits PATH`); W2's latency chart (`--chart`). SPEC §13b.
//!
//! Shows a live line on stderr while it runs (messages handled, rate),
//! prints a table for people, then one JSON object on the last line for
//! machines; exits 1 when `missing_acks` is not 0 (a message not acked
//! after 60 s of retries) or a message that was not retried was handled
//! twice or out of order.
//!
//! Run: `cargo run --release --bin shard-bench -- w1 [--messages N]`

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use datum_cluster_sharding::membership::MembershipEvent;
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::transport::Tls;
use datum_cluster_sharding::{FileStore, FileStoreFsyncPolicy};
use hdrhistogram::Histogram;
use serde_json::json;
use tokio::sync::Mutex;

#[path = "shard_bench/chart.rs"]
mod chart;
#[path = "../../protocols/harness.rs"]
mod harness;
#[path = "shard_bench/pairs.rs"]
mod pairs;
#[path = "../../protocols/ping.rs"]
mod ping;
#[path = "shard_bench/transport.rs"]
mod transport;
use harness::{
    Answered, ENTITIES, Node, cpu_time, drive, drive_fresh, drive_open, entities_hosted_on,
    entity_id, form_cluster, join_reports, peak_rss_kib, ping_factory, sharding_config,
    shards_moved_since, shares, warm_up,
};
use ping::{Checks, PingEntity, Pinger};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// 16 asks in flight per driver.
    W1,
    /// 256 asks in flight per driver.
    W1Sat,
    /// Kill one node at 30% of the acks.
    W2,
    /// W1 without a store, with the in-memory store, with the file store.
    W3,
    /// W1 where every ask journals one event before its ack (`--journal`),
    /// interleaved with the store's raw batched appends (`--rounds`).
    W4,
    /// Passivation by an active-entity limit on a skewed load: every
    /// policy and idle-only passivation, on a Zipf mix and a scan mix, each
    /// in a child process (`--passivation` and `--mix` run one).
    W5,
    /// Live migration: 30,000 entities of 1 KiB, node 2 leaves gracefully
    /// and its third move; with migration and without (SPEC §13.16).
    Handoff,
    /// Baseline (a): the same three nodes and pipes, request/reply answered
    /// inline by the receiver, no sharding (16 in flight per node unless
    /// `--in-flight`).
    Transport,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Three nodes in this process.
    InProcess,
    /// Three OS processes (this binary, started by itself), W1, W1-sat, W2
    /// and W3: CPU and RSS per node as well as in total.
    MultiProcess,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Downing {
    KeepMajority,
    Timeout,
}

impl Downing {
    /// What the run's output says of it (the defaults of ClusterConfig).
    fn label(self) -> &'static str {
        match self {
            Downing::Timeout => "timeout downing 200 ms",
            Downing::KeepMajority => "keep-majority, stable_after 1 s, margin 1.9 s",
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "The sharding workloads W1, W1-sat, W2, W3, W4 and W5 (BENCHMARK.md)")]
struct Args {
    /// Which workload.
    workload: Workload,
    /// Messages in all (BENCHMARK.md: 1,000,000).
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Asks in flight per driver (default: 256 for w1-sat, 16 otherwise).
    #[arg(long)]
    in_flight: Option<usize>,
    /// How the three nodes run.
    #[arg(long, value_enum, default_value_t = Mode::InProcess)]
    mode: Mode,
    /// W3 only: every message goes to a fresh entity, so the measured phase
    /// spawns (and records) one entity per message — the store's cost on
    /// the message path, which plain W3 (entities spawned in the warm-up)
    /// does not show.
    #[arg(long)]
    spawning: bool,
    /// Run the workload this many times interleaved with its baselines,
    /// each run a fresh child process, and report the ratios pair by pair
    /// with their median (w1 and w1-sat).
    #[arg(long)]
    pairs: Option<usize>,
    /// With --pairs: the `limits` anchor's binary, to interleave
    /// `tcp-mux`, `tcp-echo` and `ractor-ask` as well.
    #[arg(long)]
    limits: Option<std::path::PathBuf>,
    /// W2 only: how a crashed node is downed — `keep-majority`, the
    /// project's default resolver (Down after the failure timeout plus
    /// `stable_after`, its shards moved after the dead-owner margin), or
    /// `timeout` (timeout downing: Down after the failure timeout plus the
    /// downing timeout, shards moved at once).
    #[arg(long, value_enum, default_value_t = Downing::KeepMajority)]
    downing: Downing,
    /// W2 only: which of the three nodes is killed — 2 (the default: not
    /// the coordinator) or 0 (the oldest, the sharding coordinator: its
    /// shards move after a takeover). The two others drive.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=2))]
    victim: u8,
    /// W4, and W2 on durable entities: the journal — `embedded` (redb) or
    /// `postgres` (a throwaway server; build with `--features postgres`).
    /// W2 without it runs the plain ping entity.
    #[arg(long, value_enum)]
    journal: Option<durable::JournalKind>,
    /// W4 only: how many (W4, raw appends) pairs to run.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// W5 only: run this passivation alone, in this process (with --mix).
    #[arg(long, value_enum, requires = "mix")]
    passivation: Option<limit::Passivation>,
    /// W5 only: run this mix alone, in this process (with --passivation).
    #[arg(long, value_enum, requires = "passivation")]
    mix: Option<limit::Mix>,
    /// W1 and W1-sat in one process: every pipe under TLS 1.3 (a build with
    /// `--features tls`), the three nodes' certificates from a throwaway CA.
    #[arg(long)]
    tls: bool,
    /// W1 and W1-sat in one process: a Prometheus recorder
    /// (metrics-exporter-prometheus, histograms as buckets from 1 µs to
    /// 10 s) installed, so every metric of SPEC §14 is recorded; the run
    /// renders it once at the end.
    #[arg(long)]
    prometheus: bool,
    /// Handoff only: entities in all (node 2 hosts about a third, which
    /// move).
    #[arg(long, default_value_t = 30_000)]
    entities: u64,
    /// W2 only: where to write the latency-over-time chart (SVG).
    #[arg(long, default_value = "w2-latency.svg")]
    chart: std::path::PathBuf,
    /// W2 only: an open loop instead of closed ones — the two drivers issue
    /// this many asks per second in all, each on its own schedule (as
    /// requests reach a service), whatever the earlier ones are waiting
    /// for; the chart splits the acks between the entities that lived on
    /// the killed node and the rest.
    #[arg(long, value_parser = positive_rate, conflicts_with = "journal")]
    offered_rate: Option<f64>,
    /// W1 in one process: plain W1 (300,000 asks), then W1's load
    /// through reliable producers (SPEC §13.17) on a cluster of its own —
    /// `--messages` tells, the window W1's in-flight count — and the ratio
    /// of their rates; with `--journal embedded` the entities are
    /// durable-state ones saving with every message. W2 in one process:
    /// reliable producers on nodes 0 and 1, durable-state entities on a
    /// store the nodes share, node 2 crashed at 30 %; every note's effect
    /// counted.
    #[arg(long)]
    reliable: bool,
    /// With `w1 --reliable --journal embedded`: the producers are durable
    /// ones (each send journaled on the node's store before it returns),
    /// each sent to by W1's in-flight count of concurrent callers.
    #[arg(long, requires = "reliable", requires = "journal")]
    durable_producer: bool,
    /// (multi-process, internal) run as node N of the three.
    #[arg(long, hide = true)]
    child: Option<usize>,
    /// (multi-process, internal) the first node's address.
    #[arg(long, hide = true)]
    seed: Option<std::net::SocketAddr>,
    /// (multi-process, internal) W3's store for this cluster: none,
    /// memory or file.
    #[arg(long, hide = true, default_value = "none")]
    store: String,
}

/// One run's figures.
struct Run {
    acks: u64,
    expected: u64,
    retries: u64,
    wall: Duration,
    cpu: Duration,
    latency: Histogram<u64>,
    checks: Arc<Checks>,
    /// The messages that took more than one attempt.
    retried: std::collections::HashSet<(u32, u64)>,
    /// Shards the coordinator moved while the clock ran.
    moved: usize,
}

impl Run {
    fn from_joined(
        joined: harness::Joined,
        expected: u64,
        times: (Duration, Duration),
        checks: Arc<Checks>,
        moved: usize,
    ) -> Run {
        Run {
            acks: joined.acks,
            expected,
            retries: joined.retries,
            wall: times.0,
            cpu: times.1,
            latency: joined.latency,
            checks,
            retried: joined.retried,
            moved,
        }
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "expected_acks": self.expected,
            "unique_acks": self.acks,
            "missing_acks": self.expected - self.acks,
            "duplicate_processings": self.checks.duplicate_processings.load(Ordering::Relaxed),
            "order_violations": self.checks.order_violations.load(Ordering::Relaxed),
            "unexplained_violations": self.checks.unexplained(&self.retried),
            "retries": self.retries,
            "shards_moved": self.moved,
            "wall_ms": self.wall.as_secs_f64() * 1e3,
            "msgs_per_sec": self.acks as f64 / self.wall.as_secs_f64(),
            "p50_us": self.latency.value_at_quantile(0.50),
            "p99_us": self.latency.value_at_quantile(0.99),
            "p999_us": self.latency.value_at_quantile(0.999),
            "max_us": self.latency.max(),
            "cpu_ms": self.cpu.as_secs_f64() * 1e3,
            "cpu_us_per_msg": self.cpu.as_secs_f64() * 1e6 / self.acks.max(1) as f64,
        })
    }

    fn print(&self, label: &str) {
        println!(
            "{label:<14} {:>9} acks · missing {} · dup {} · order {} · retries {} · {:>8.0} msg/s · {:.2} µs CPU/msg · p50 {} p99 {} p99.9 {} max {} µs",
            self.acks,
            self.expected - self.acks,
            self.checks.duplicate_processings.load(Ordering::Relaxed),
            self.checks.order_violations.load(Ordering::Relaxed),
            self.retries,
            self.acks as f64 / self.wall.as_secs_f64(),
            self.cpu.as_secs_f64() * 1e6 / self.acks.max(1) as f64,
            self.latency.value_at_quantile(0.50),
            self.latency.value_at_quantile(0.99),
            self.latency.value_at_quantile(0.999),
            self.latency.max(),
        );
    }

    /// Whether the correctness counters hold: every ack came, and no
    /// message that was not retried was handled twice or out of order
    /// (BENCHMARK.md counts those of retried messages apart).
    fn correct(&self) -> bool {
        self.acks == self.expected && self.checks.unexplained(&self.retried) == 0
    }
}

/// Three nodes with the ping entity registered, warmed up (timeout
/// downing if `timeout_downing`, else the project's default resolver).
async fn cluster(
    name: &str,
    checks: &Arc<Checks>,
    timeout_downing: bool,
    tls: &[Tls],
) -> Result<Vec<Node>, Box<dyn std::error::Error>> {
    let (clusters, _) = harness::form_cluster_with(name, timeout_downing, tls).await?;
    let mut nodes = Vec::new();
    for cluster in clusters {
        let builder = ShardedSystem::builder().config(sharding_config());
        let system = builder.node(cluster.clone()).start().await?;
        system
            .entity_type::<PingEntity>()
            .register(ping_factory(checks.clone()))
            .await?;
        nodes.push(Node { cluster, system });
    }
    warm_up(&nodes).await?;
    Ok(nodes)
}

/// The same with the entity remembered in `store` (shared by the three).
async fn remembered_cluster<S: RememberEntitiesStore + Clone>(
    name: &str,
    store: S,
    checks: &Arc<Checks>,
) -> Result<Vec<Node<S>>, Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster(name, false).await?;
    let mut nodes = Vec::new();
    for cluster in clusters {
        let builder = ShardedSystem::builder().config(sharding_config());
        let system = builder
            .node(cluster.clone())
            .store(store.clone())
            .start()
            .await?;
        system
            .entity_type::<PingEntity>()
            .remembered()
            .register(ping_factory(checks.clone()))
            .await?;
        nodes.push(Node { cluster, system });
    }
    warm_up(&nodes).await?;
    Ok(nodes)
}

async fn stop<S, J>(nodes: Vec<Node<S, J>>) {
    for n in &nodes {
        n.system.shutdown().await;
    }
    for n in &nodes {
        let _ = n.cluster.shutdown().await;
    }
}

/// What a remembered run cost its store.
struct StoreCost {
    /// Failure events (records dropped by a full queue, or failed).
    failures: usize,
    /// How long the flush after the run took (the writer catching up).
    flush: Duration,
}

/// W1 (or its spawning variant) on remembered nodes, counting the store's
/// failure events and timing the flush after it.
async fn remembered_run<S: RememberEntitiesStore>(
    nodes: &[Node<S>],
    messages: u64,
    spawn: bool,
    checks: Arc<Checks>,
) -> Result<(Run, StoreCost), Box<dyn std::error::Error>> {
    let mut events = Vec::new();
    for n in nodes {
        events.push(n.system.subscribe_remember_entities_events()?);
    }
    let run = run_drivers(nodes, messages, 16, checks, spawn).await?;
    let flushed = Instant::now();
    for n in nodes {
        // A flush that reports failures still waited for the writer.
        let _ = n.system.flush_remember_entities().await;
    }
    let flush = flushed.elapsed();
    let mut failures = 0;
    for e in &mut events {
        loop {
            match e.try_recv() {
                Ok(_) => failures += 1,
                // Events this subscriber missed were failures too.
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(n)) => {
                    failures += n as usize;
                }
                Err(_) => break,
            }
        }
    }
    Ok((run, StoreCost { failures, flush }))
}

/// W1's drivers on every node.
async fn w1<S: Send + Sync + 'static>(
    nodes: &[Node<S>],
    messages: u64,
    in_flight: usize,
    checks: Arc<Checks>,
) -> Result<Run, Box<dyn std::error::Error>> {
    run_drivers(nodes, messages, in_flight, checks, false).await
}

/// Three drivers, one per node, `in_flight` asks each: W1's, or with
/// `fresh` W3's spawning variant (a new entity per message).
async fn run_drivers<S: Send + Sync + 'static, J: Send + Sync + 'static>(
    nodes: &[Node<S, J>],
    messages: u64,
    in_flight: usize,
    checks: Arc<Checks>,
    fresh: bool,
) -> Result<Run, Box<dyn std::error::Error>> {
    let shares = shares(messages);
    let label = if fresh { "w3-spawning" } else { "w1" };
    let _progress = Progress::start(label, checks.clone());
    let cpu_before = cpu_time();
    let start = Instant::now();
    let drivers: Vec<_> = (0..3)
        .map(|d| {
            let system = nodes[d].system.clone();
            if fresh {
                tokio::spawn(drive_fresh(system, d as u32, shares[d], in_flight))
            } else {
                tokio::spawn(drive(system, d as u32, 3, shares[d], in_flight, None))
            }
        })
        .collect();
    let joined = join_reports(drivers).await?;
    let times = (start.elapsed(), cpu_time().saturating_sub(cpu_before));
    let moved = shards_moved_since(nodes, start);
    Ok(Run::from_joined(joined, messages, times, checks, moved))
}

async fn run_w1(
    messages: u64,
    in_flight: usize,
    label: &str,
    tls: bool,
    prometheus: bool,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let recorder = if prometheus {
        // Histograms as buckets (1 µs to 10 s), as the management
        // endpoint exports them.
        let builder = datum_cluster_sharding::telemetry::prometheus_builder();
        Some(builder.install_recorder()?)
    } else {
        None
    };
    let checks = Arc::new(Checks::default());
    let (_certificates, tls) = bench_tls(tls)?;
    let nodes = cluster("shard-bench", &checks, false, &tls).await?;
    let before = pipe_writes(&nodes);
    let run = w1(&nodes, messages, in_flight, checks).await?;
    let (frames, writes) = pipe_writes(&nodes);
    run.print(label);
    stop(nodes).await;
    let mut json = run.json();
    // Frames per `write_all` on the pipes during the run (the anchors
    // report the same figure).
    json["frames_per_write"] =
        ((frames - before.0) as f64 / (writes - before.1).max(1) as f64).into();
    json["workload"] = label.into();
    json["in_flight_per_driver"] = in_flight.into();
    json["peak_rss_kib"] = peak_rss_kib().into();
    json["tls"] = (!tls.is_empty()).into();
    if let Some(recorder) = recorder {
        // One scrape, so the run shows the recorder saw the metrics.
        let text = recorder.render();
        let asks = text
            .lines()
            .filter(|l| l.starts_with("datum_asks_total"))
            .count();
        json["prometheus_bytes"] = text.len().into();
        json["prometheus_ask_series"] = asks.into();
    }
    Ok((json, run.correct()))
}

/// Plain W1 (300,000 asks), then the reliable run (SPEC §13.17).
async fn run_w1_reliable(
    messages: u64,
    in_flight: usize,
    journal: (Option<durable::JournalKind>, bool),
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    const PLAIN: u64 = 300_000;
    let checks = Arc::new(Checks::default());
    let nodes = cluster("shard-bench", &checks, false, &[]).await?;
    let plain = w1(&nodes, PLAIN, in_flight, checks).await?;
    plain.print("w1");
    stop(nodes).await;
    let plain_correct = plain.correct();
    let (json, correct) = reliable::run((PLAIN, plain), messages, in_flight, journal).await?;
    Ok((json, correct && plain_correct))
}

/// With `tls`, a throwaway CA's certificates for the three nodes (in a
/// temporary directory, kept while the run reads them) and each node's
/// loaded material; else none.
fn bench_tls(
    tls: bool,
) -> Result<(Option<tempfile::TempDir>, Vec<Tls>), Box<dyn std::error::Error>> {
    if !tls {
        return Ok((None, Vec::new()));
    }
    #[cfg(feature = "tls")]
    {
        use datum_cluster_sharding::transport::generate_test_certificates;
        let dir = tempfile::tempdir()?;
        let day = Duration::from_secs(86_400);
        let configs = generate_test_certificates(dir.path(), &["127.0.0.1"; 3], day)?;
        let tls = configs
            .into_iter()
            .map(Tls::load)
            .collect::<Result<_, _>>()?;
        Ok((Some(dir), tls))
    }
    #[cfg(not(feature = "tls"))]
    Err("--tls needs a build with `--features tls`".into())
}

/// Frames written and `write_all` calls so far, over every node's pipes.
fn pipe_writes<S>(nodes: &[harness::Node<S>]) -> (u64, u64) {
    nodes.iter().fold((0, 0), |(f, w), n| {
        let stats = n.cluster.transport().stats();
        (f + stats.frames_written, w + stats.writes)
    })
}

async fn run_w3(
    messages: u64,
    spawn: bool,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let mut results = Vec::new();
    let mut ok = true;
    // What a remembered run's records cost the store: failures reported (a
    // full queue drops records) and, for the file store, whether the writer
    // kept up by the end (the flush after the run).
    let mut dropped: Vec<(&str, usize)> = Vec::new();
    let mut flushes: Vec<(&str, Duration)> = Vec::new();
    {
        let checks = Arc::new(Checks::default());
        let nodes = cluster("shard-bench-w3a", &checks, false, &[]).await?;
        let run = run_drivers(&nodes, messages, 16, checks, spawn).await?;
        run.print("no store");
        ok &= run.correct();
        results.push(("none", run));
        stop(nodes).await;
    }
    {
        let checks = Arc::new(Checks::default());
        let nodes = remembered_cluster("shard-bench-w3b", InMemoryStore::new(), &checks).await?;
        let (run, store) = remembered_run(&nodes, messages, spawn, checks).await?;
        dropped.push(("in_memory", store.failures));
        flushes.push(("in_memory", store.flush));
        run.print("in-memory");
        ok &= run.correct();
        results.push(("in_memory", run));
        stop(nodes).await;
    }
    {
        let checks = Arc::new(Checks::default());
        // Removed when dropped, on every path out.
        let dir = tempfile::Builder::new()
            .prefix("shard-bench-w3-")
            .tempdir()?;
        let store = Arc::new(FileStore::open(dir.path(), FileStoreFsyncPolicy::Always)?);
        let nodes = remembered_cluster("shard-bench-w3c", store, &checks).await?;
        let (run, store) = remembered_run(&nodes, messages, spawn, checks).await?;
        dropped.push(("file_always", store.failures));
        flushes.push(("file_always", store.flush));
        run.print("file (Always)");
        ok &= run.correct();
        results.push(("file_always", run));
        stop(nodes).await;
    }
    let base = results[0].1.cpu.as_secs_f64() / results[0].1.acks.max(1) as f64;
    let workload = if spawn { "w3-spawning" } else { "w3" };
    let mut json = json!({ "workload": workload, "peak_rss_kib": peak_rss_kib() });
    for (name, run) in &results {
        let per = run.cpu.as_secs_f64() / run.acks.max(1) as f64;
        let mut r = run.json();
        r["cpu_increase_pct"] = ((per / base - 1.0) * 100.0).into();
        if let Some((_, n)) = dropped.iter().find(|(d, _)| d == name) {
            r["store_failures"] = (*n).into();
        }
        if let Some((_, f)) = flushes.iter().find(|(d, _)| d == name) {
            r["flush_after_ms"] = (f.as_secs_f64() * 1e3).into();
        }
        json[*name] = r;
    }
    Ok((json, ok))
}

/// The chart's interval.
const W2_INTERVAL: Duration = Duration::from_millis(20);

/// `--offered-rate`: a positive number of asks per second.
fn positive_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate >= 1.0 => Ok(rate),
        _ => Err(format!("not a rate of at least 1 ask per second: {s:?}")),
    }
}

/// How a W2 run goes: the downing, the node killed, the chart, and the
/// open loop's rate (closed loops without one).
#[derive(Clone, Copy)]
struct W2Shape<'a> {
    downing: Downing,
    victim_index: usize,
    chart_path: &'a std::path::Path,
    offered_rate: Option<f64>,
}

/// W2 on the ping entity, or with `journal` on the durable one (and its
/// checks after the run: `durable::check_w2`).
async fn run_w2(
    messages: u64,
    shape: W2Shape<'_>,
    journal: Option<durable::JournalKind>,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let checks = Arc::new(Checks::default());
    let timeout_downing = shape.downing == Downing::Timeout;
    let Some(kind) = journal else {
        let nodes = cluster("shard-bench-w2", &checks, timeout_downing, &[]).await?;
        let done = w2_on(nodes, checks, messages, shape).await?;
        stop(done.survivors).await;
        return Ok((done.json, done.correct));
    };
    let stores = durable::Stores::new(kind)?;
    // One journal the three share (the killed node's entities recover
    // from it on the survivors).
    let journals = stores.fresh(true)?;
    let nodes =
        durable::durable_cluster("shard-bench-w2", &checks, timeout_downing, journals).await?;
    let mut done = w2_on(nodes, checks, messages, shape).await?;
    let (checked, ok) =
        durable::check_w2(&done.survivors[0], 2, messages / 2, &done.retried).await?;
    stop(done.survivors).await;
    done.json["journal"] = kind.name().into();
    done.json["durable"] = checked;
    Ok((done.json, done.correct && ok))
}

/// What a W2 run gives.
struct W2Done<J> {
    json: serde_json::Value,
    correct: bool,
    /// The two nodes that were not killed.
    survivors: Vec<Node<NoStore, J>>,
    /// The messages that took more than one attempt.
    retried: std::collections::HashSet<(u32, u64)>,
}

/// W2 on `nodes`.
async fn w2_on<J: Send + Sync + 'static>(
    nodes: Vec<Node<NoStore, J>>,
    checks: Arc<Checks>,
    messages: u64,
    shape: W2Shape<'_>,
) -> Result<W2Done<J>, Box<dyn std::error::Error>> {
    let W2Shape {
        victim_index,
        chart_path,
        offered_rate,
        ..
    } = shape;
    let downing = shape.downing.label();
    // Node 0, the oldest, is the coordinator.
    let affected = entities_hosted_on(&nodes, victim_index);
    let driving: Vec<usize> = (0..3).filter(|i| *i != victim_index).collect();
    let answered = Arc::new(Mutex::new(Answered::default()));
    let share = messages / 2;
    let _progress = Progress::start("w2", checks.clone());
    let cpu_before = cpu_time();
    let start = Instant::now();
    answered.lock().await.started = Some(start);
    let drivers: Vec<_> = (0..2)
        .map(|d| {
            let system = nodes[driving[d]].system.clone();
            let answered = answered.clone();
            match offered_rate {
                Some(rate) => {
                    tokio::spawn(drive_open(system, d as u32, 2, share, rate / 2.0, answered))
                }
                None => tokio::spawn(drive(system, d as u32, 2, share, 16, Some(answered))),
            }
        })
        .collect();
    // Kill at 30% of the acks: watch the entity-side counter.
    let target = (2 * share) * 3 / 10;
    // (The warm-up processed one ask per entity from each of the three nodes.)
    while checks.processed() < target + 3 * ENTITIES {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let victim = nodes[victim_index].cluster.self_address();
    let mut events = nodes[driving[0]].cluster.subscribe();
    let killed = Instant::now();
    answered.lock().await.since = Some(killed);
    nodes[victim_index].cluster.crash().await;
    let downed = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            if let Ok(MembershipEvent::MemberDowned(m)) = events.recv().await
                && m == victim
            {
                return killed.elapsed();
            }
        }
    })
    .await?;
    let joined = join_reports(drivers).await?;
    let times = (start.elapsed(), cpu_time().saturating_sub(cpu_before));
    let moved = shards_moved_since(&nodes, start);
    let run = Run::from_joined(joined, 2 * share, times, checks.clone(), moved);
    run.print("w2");
    let answered = answered.lock().await;
    let (rehomed, unasked, first_ack) = answered.rehomed(&affected);
    println!(
        "w2 ({downing}, node {victim_index} killed): {} affected entities, Down after {:.0} ms, all rehomed {} ms after the kill, first ack after the kill {:.3} ms",
        affected.len(),
        downed.as_secs_f64() * 1e3,
        rehomed.map_or("n/a".into(), |t| format!("{:.0}", t.as_secs_f64() * 1e3)),
        first_ack.map_or(f64::NAN, |t| t.as_secs_f64() * 1e3),
    );
    let mut json = run.json();
    json["workload"] = "w2".into();
    json["peak_rss_kib"] = peak_rss_kib().into();
    json["affected_entities"] = affected.len().into();
    json["victim"] = victim_index.into();
    json["affected_not_asked_after_kill"] = unasked.into();
    json["down_after_kill_ms"] = (downed.as_secs_f64() * 1e3).into();
    json["rehomed_ms"] = rehomed.map(|t| t.as_secs_f64() * 1e3).into();
    json["first_ack_after_kill_ms"] = first_ack.map(|t| t.as_secs_f64() * 1e3).into();
    let cut = chart::intervals(&answered.timeline, W2_INTERVAL);
    let kill_s = killed.duration_since(start).as_secs_f64();
    let marks = chart::Marks {
        kill_s,
        down_s: kill_s + downed.as_secs_f64(),
        rehomed_s: rehomed.map(|t| kill_s + t.as_secs_f64()),
    };
    json["downing"] = downing.into();
    match offered_rate {
        None => {
            let title = format!(
                "W2: {} asks, node {victim_index} killed at {:.2} s (detector 100 + 300 ms; {downing})",
                run.expected, kill_s
            );
            chart::draw(chart_path, &title, &cut, W2_INTERVAL, &marks)?;
        }
        Some(rate) => {
            let split = open_loop_split(&answered, &affected, &marks, rate, &mut json);
            let title = format!(
                "W2 open loop: {rate:.0} asks/s offered, node {victim_index} killed at {kill_s:.2} s ({downing})"
            );
            chart::draw_split(chart_path, &title, &split, W2_INTERVAL, &marks)?;
        }
    }
    println!("w2: chart written to {}", chart_path.display());
    json["chart"] = chart_path.display().to_string().into();
    json["interval_ms"] = (W2_INTERVAL.as_secs_f64() * 1e3).into();
    json["intervals"] = cut
        .iter()
        .map(|i| json!([i.start_s * 1e3, i.acks, i.p50_us, i.p99_us, i.max_us]))
        .collect::<Vec<_>>()
        .into();
    let mut nodes = nodes;
    let dead = nodes.remove(victim_index);
    dead.system.shutdown().await;
    let correct = run.correct();
    Ok(W2Done {
        json,
        correct,
        survivors: nodes,
        retried: run.retried,
    })
}

/// The open loop's figures: its timeline cut into intervals for the
/// entities that lived on the killed node and for the rest, and, in
/// `json`, the rest's ack rate before the kill and between the kill and the
/// last rehome, and the affected asks' longest wait.
fn open_loop_split(
    answered: &Answered,
    affected: &[u64],
    marks: &chart::Marks,
    rate: f64,
    json: &mut serde_json::Value,
) -> chart::Split {
    let affected: std::collections::HashSet<u64> = affected.iter().copied().collect();
    let (mut hit, mut rest) = (Vec::new(), Vec::new());
    for (point, id) in answered.timeline.iter().zip(&answered.timeline_ids) {
        if affected.contains(id) {
            hit.push(*point)
        } else {
            rest.push(*point)
        }
    }
    let rate_between = |from_s: f64, to_s: f64| {
        let (from, to) = ((from_s * 1e6) as u64, (to_s * 1e6) as u64);
        let acks = rest
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .count();
        // (None for an empty window: a kill in the first half second.)
        (to_s > from_s).then(|| acks as f64 / (to_s - from_s))
    };
    // Without a last rehome (an affected entity never asked again) the
    // outage is taken to end at the Down.
    let outage_end = marks.rehomed_s.unwrap_or(marks.down_s);
    let before = rate_between(0.5, marks.kill_s);
    let during = rate_between(marks.kill_s, outage_end);
    let longest = hit.iter().map(|(_, took)| *took).max().unwrap_or(0);
    let shown = |rate: Option<f64>| rate.map_or("n/a".to_owned(), |r| format!("{r:.0}"));
    println!(
        "w2 open loop ({rate:.0} asks/s offered): the other entities acked {}/s before the kill and {}/s from the kill to the last rehome; the affected entities' longest wait (from its first attempt) {:.0} ms",
        shown(before),
        shown(during),
        longest as f64 / 1e3
    );
    json["offered_rate"] = rate.into();
    json["unaffected_acks_per_s_before_kill"] = before.into();
    json["unaffected_acks_per_s_during_outage"] = during.into();
    json["affected_longest_wait_ms"] = (longest as f64 / 1e3).into();
    let end = answered
        .timeline
        .iter()
        .map(|(at, _)| *at)
        .max()
        .unwrap_or(0);
    chart::Split {
        affected: chart::intervals_to(&hit, W2_INTERVAL, end),
        rest: chart::intervals_to(&rest, W2_INTERVAL, end),
    }
}

/// Baseline (a): the transport alone (`transport.rs`).
async fn run_transport(
    messages: u64,
    in_flight: usize,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster("shard-bench-transport", false).await?;
    let cpu_before = cpu_time();
    let figures = transport::run(&clusters, &shares(messages), in_flight).await?;
    let cpu = cpu_time().saturating_sub(cpu_before);
    let per_sec = figures.acks as f64 / figures.wall.as_secs_f64();
    let cpu_us = cpu.as_secs_f64() * 1e6 / figures.acks.max(1) as f64;
    println!(
        "transport {:>9} acks · missing {} · wrong {} · {per_sec:>8.0} msg/s · {cpu_us:.2} µs CPU/msg · p50 {} p99 {} p99.9 {} max {} µs",
        figures.acks,
        messages - figures.acks,
        figures.wrong,
        figures.latency.value_at_quantile(0.5),
        figures.latency.value_at_quantile(0.99),
        figures.latency.value_at_quantile(0.999),
        figures.latency.max(),
    );
    let json = json!({
        "workload": "transport",
        "in_flight": in_flight,
        "expected_acks": messages,
        "unique_acks": figures.acks,
        "missing_acks": messages - figures.acks,
        "wrong_replies": figures.wrong,
        "failed_requests": figures.failed,
        "wall_ms": figures.wall.as_secs_f64() * 1e3,
        "msgs_per_sec": per_sec,
        "cpu_ms": cpu.as_secs_f64() * 1e3,
        "cpu_us_per_msg": cpu_us,
        "p50_us": figures.latency.value_at_quantile(0.5),
        "p99_us": figures.latency.value_at_quantile(0.99),
        "p999_us": figures.latency.value_at_quantile(0.999),
        "max_us": figures.latency.max(),
        "peak_rss_kib": peak_rss_kib(),
    });
    for cluster in clusters {
        let _ = cluster.shutdown().await;
    }
    Ok((json, figures.acks == messages && figures.wrong == 0))
}

/// A live line on stderr while a run goes: messages the entities have
/// handled so far and the rate over the last second. Stops when dropped.
struct Progress(tokio::task::JoinHandle<()>);

impl Progress {
    fn start(label: &'static str, checks: Arc<Checks>) -> Self {
        Progress(tokio::spawn(async move {
            let mut last = checks.processed();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let now = checks.processed();
                eprint!("\r{label}: {now:>9} handled · {:>8} msg/s   ", now - last);
                last = now;
            }
        }))
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.abort();
        eprintln!();
    }
}

/// Prints a parent run's JSON record and exits 0, 1 if a run was not
/// correct, 2 if one could not run.
fn exit_with(result: Result<(serde_json::Value, bool), String>) -> ExitCode {
    match result {
        Ok((json, correct)) => {
            println!("{json}");
            ExitCode::from(if correct { 0 } else { 1 })
        }
        Err(error) => {
            eprintln!("shard-bench: {error}");
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let in_flight = args
        .in_flight
        .unwrap_or(if args.workload == Workload::W1Sat {
            256
        } else {
            16
        });
    let w1 = matches!(args.workload, Workload::W1 | Workload::W1Sat);
    if args.prometheus && (!w1 || args.mode == Mode::MultiProcess || args.pairs.is_some()) {
        eprintln!(
            "shard-bench: --prometheus runs w1 and w1-sat in one process (compare with farm-bench)"
        );
        return ExitCode::from(2);
    }
    if args.tls && (!w1 || args.mode == Mode::MultiProcess || args.pairs.is_some()) {
        eprintln!("shard-bench: --tls runs w1 and w1-sat in one process (compare with farm-bench)");
        return ExitCode::from(2);
    }
    if args.reliable
        && (!matches!(args.workload, Workload::W1 | Workload::W2)
            || args.mode == Mode::MultiProcess
            || args.pairs.is_some()
            || args.tls
            || args.prometheus)
    {
        eprintln!("shard-bench: --reliable runs w1 and w2 in one process");
        return ExitCode::from(2);
    }
    if args.durable_producer && !w1 {
        eprintln!("shard-bench: --durable-producer runs w1 --reliable --journal embedded");
        return ExitCode::from(2);
    }
    if let Some(rounds) = args.pairs {
        let name = match args.workload {
            Workload::W1 => "w1",
            Workload::W1Sat => "w1-sat",
            _ => {
                eprintln!("shard-bench: --pairs runs w1 and w1-sat");
                return ExitCode::from(2);
            }
        };
        return exit_with(pairs::interleave(
            name,
            args.messages,
            in_flight,
            rounds,
            args.limits.as_deref(),
        ));
    }
    if args.workload == Workload::W5 && args.passivation.is_none() {
        return exit_with(limit::run_all(args.messages, in_flight));
    }
    if let Some(index) = args.child {
        return multi::child(index, &args, in_flight);
    }
    if args.mode == Mode::MultiProcess {
        if matches!(
            args.workload,
            Workload::Transport | Workload::W4 | Workload::W5 | Workload::Handoff
        ) || args.spawning
            || args.journal.is_some()
            || args.offered_rate.is_some()
        {
            eprintln!(
                "shard-bench: multi-process mode runs w1, w1-sat, w2 and w3, without --journal or --offered-rate"
            );
            return ExitCode::from(2);
        }
        return multi::parent(&args, in_flight);
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(in_process(args, in_flight))
}

async fn in_process(args: Args, in_flight: usize) -> ExitCode {
    let result = match args.workload {
        Workload::W1 if args.reliable => {
            run_w1_reliable(
                args.messages,
                in_flight,
                (args.journal, args.durable_producer),
            )
            .await
        }
        Workload::W1 => run_w1(args.messages, in_flight, "w1", args.tls, args.prometheus).await,
        Workload::W1Sat => {
            run_w1(
                args.messages,
                in_flight,
                "w1-sat",
                args.tls,
                args.prometheus,
            )
            .await
        }
        Workload::Transport => run_transport(args.messages, in_flight).await,
        Workload::W2 if args.reliable => reliable::run_w2(args.messages).await,
        Workload::W2 => {
            let shape = W2Shape {
                downing: args.downing,
                victim_index: args.victim as usize,
                chart_path: &args.chart,
                offered_rate: args.offered_rate,
            };
            run_w2(args.messages, shape, args.journal).await
        }
        Workload::W3 => run_w3(args.messages, args.spawning).await,
        Workload::Handoff => handoff::run(args.entities).await,
        Workload::W5 => match (args.passivation, args.mix) {
            (Some(passivation), Some(mix)) => {
                limit::run_one(args.messages, in_flight, passivation, mix).await
            }
            _ => unreachable!("w5 without --passivation runs its children above"),
        },
        Workload::W4 => {
            durable::run_w4(
                args.journal.unwrap_or(durable::JournalKind::Embedded),
                args.messages,
                in_flight,
                args.rounds,
            )
            .await
        }
    };
    match result {
        Ok((json, correct)) => {
            println!("{json}");
            if correct {
                ExitCode::SUCCESS
            } else {
                eprintln!("shard-bench: a correctness counter is off");
                ExitCode::from(1)
            }
        }
        Err(error) => {
            eprintln!("shard-bench: {error}");
            ExitCode::from(2)
        }
    }
}

#[path = "shard_bench/durable.rs"]
mod durable;
#[path = "shard_bench/handoff.rs"]
mod handoff;
#[path = "shard_bench/limit.rs"]
mod limit;
#[path = "shard_bench/multi.rs"]
mod multi;
#[cfg(feature = "postgres")]
#[path = "../../protocols/pg_server.rs"]
mod pg_server;
#[path = "shard_bench/reliable.rs"]
mod reliable;
