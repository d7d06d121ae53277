//! Multi-process mode: the parent starts three copies of this binary as
//! nodes, steps them through a run over their stdin and stdout (one word a
//! line), and adds up what each reports. Each node measures its own CPU
//! (from `GO` to `STOP`, so serving the others counts) and peak RSS.
//!
//! The steps: each child prints `ADDR <addr>` (node 0's is the others'
//! seed) and `READY` once three members are Up and its entity registered;
//! on `WARM` it asks every entity once and prints `WARMED` and `HOSTED
//! [entity numbers whose shard it hosts]`; on `GO` it drives its share and
//! prints `PROCESSED <n>` (its entities' count) every 10 ms, then `DONE
//! {json}`; on `STOP` it prints `FIGURES {json}` and exits. W2: only nodes
//! 0 and 1 drive; when the three nodes' `PROCESSED` add up to 30% of the
//! messages (after the warm-up), the parent SIGKILLs node 2 and tells the
//! others `KILLED <its addr>`; from then each records when every entity
//! first answered and when it saw node 2 Down (both from its receipt of
//! `KILLED`, a millisecond or so after the kill), and reports them in
//! `DONE`. W3: the W1 steps three times, on fresh clusters with no store,
//! the in-memory store and the file store (`Always`, a temporary directory
//! per node).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::ClusterNode;
use datum_cluster_sharding::membership::{MemberStatus, MembershipEvent};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{FileStore, FileStoreFsyncPolicy};
use serde_json::json;
use tokio::sync::Mutex;

use super::args::{Args, Downing, Workload};
use super::harness::{
    self, Answered, ENTITIES, cpu_time, drive, entity_id, peak_rss_kib, ping_factory,
    sharding_config, shares,
};
use super::ping::{self, Checks, PingEntity, Pinger};

const WAIT: Duration = Duration::from_secs(120);

struct NodeProcess {
    process: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Drop for NodeProcess {
    /// A child left behind by an error path is killed, not left to run.
    fn drop(&mut self) {
        if matches!(self.process.try_wait(), Ok(None)) {
            let _ = self.process.kill();
            let _ = self.process.wait();
        }
    }
}

impl NodeProcess {
    fn start(index: usize, seed: Option<SocketAddr>, args: &Args, store: &str) -> NodeProcess {
        let mut command = Command::new(std::env::current_exe().expect("own path"));
        let workload = match args.workload {
            Workload::W1Sat => "w1-sat",
            Workload::W2 => "w2",
            _ => "w1",
        };
        let downing = match args.downing {
            Downing::KeepMajority => "keep-majority",
            Downing::Timeout => "timeout",
        };
        command
            .args([workload, "--messages", &args.messages.to_string()])
            .args(["--child", &index.to_string(), "--store", store])
            .args(["--downing", downing])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(in_flight) = args.in_flight {
            command.args(["--in-flight", &in_flight.to_string()]);
        }
        if let Some(seed) = seed {
            command.args(["--seed", &seed.to_string()]);
        }
        let mut process = command.spawn().expect("a node process");
        let stdin = process.stdin.take().expect("stdin");
        let stdout = process.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        NodeProcess {
            process,
            stdin,
            lines,
        }
    }

    /// The rest of the next line that starts with `word`.
    fn expect(&self, word: &str) -> Result<String, String> {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .map_err(|_| format!("a node said no `{word}` in time"))?;
            if let Some(rest) = line.strip_prefix(word) {
                return Ok(rest.trim().to_owned());
            }
        }
    }

    fn expect_json(&self, word: &str) -> Result<serde_json::Value, String> {
        serde_json::from_str(&self.expect(word)?).map_err(|e| e.to_string())
    }

    fn say(&mut self, word: &str) {
        let _ = writeln!(self.stdin, "{word}");
        let _ = self.stdin.flush();
    }
}

pub(super) fn parent(args: &Args, in_flight: usize) -> ExitCode {
    let result = if args.workload == Workload::W3 {
        run_w3(args, in_flight)
    } else {
        run_cluster(args, in_flight, "none").map(|(record, ok)| {
            println!("{record}");
            ok
        })
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("shard-bench: a correctness counter is off");
            ExitCode::from(1)
        }
        Err(error) => {
            eprintln!("shard-bench: {error}");
            ExitCode::from(2)
        }
    }
}

/// W3: the W1 steps on three fresh clusters, one per store.
fn run_w3(args: &Args, in_flight: usize) -> Result<bool, String> {
    let mut record = json!({ "workload": "w3", "mode": "multi-process" });
    let mut ok = true;
    let mut base = None;
    for (store, name) in [
        ("none", "none"),
        ("memory", "in_memory"),
        ("file", "file_always"),
    ] {
        let (mut run, correct) = run_cluster(args, in_flight, store)?;
        ok &= correct;
        let per = run["cpu_us_per_msg"].as_f64().unwrap_or(f64::NAN);
        let base = *base.get_or_insert(per);
        run["cpu_increase_pct"] = ((per / base - 1.0) * 100.0).into();
        println!(
            "w3 {name}: {:.2} µs CPU/msg ({:+.1}%)",
            per,
            (per / base - 1.0) * 100.0
        );
        record[name] = run;
    }
    println!("{record}");
    Ok(ok)
}

/// One cluster of three processes through the steps; its JSON record.
fn run_cluster(
    args: &Args,
    in_flight: usize,
    store: &str,
) -> Result<(serde_json::Value, bool), String> {
    let w2 = args.workload == Workload::W2;
    let mut nodes = vec![NodeProcess::start(0, None, args, store)];
    let seed: SocketAddr = nodes[0]
        .expect("ADDR")?
        .parse()
        .map_err(|e| format!("node 0's address: {e}"))?;
    let mut addrs = vec![seed];
    for index in 1..3 {
        nodes.push(NodeProcess::start(index, Some(seed), args, store));
        addrs.push(
            nodes[index]
                .expect("ADDR")?
                .parse()
                .map_err(|e| format!("node {index}'s address: {e}"))?,
        );
    }
    for n in &nodes {
        n.expect("READY")?;
    }
    for n in &mut nodes {
        n.say("WARM");
    }
    let mut hosted = Vec::new();
    for n in &nodes {
        n.expect("WARMED")?;
        let list: Vec<u64> =
            serde_json::from_str(&n.expect("HOSTED")?).map_err(|e| e.to_string())?;
        hosted.push(list);
    }
    let start = Instant::now();
    for n in &mut nodes {
        n.say("GO");
    }
    let mut killed_at = None;
    if w2 {
        // Kill node 2 at 30% of the acks (BENCHMARK.md), watching the
        // entities' counters (the warm-up made three asks per entity).
        let target = args.messages * 3 / 10 + 3 * ENTITIES;
        let mut processed = [0u64; 3];
        let deadline = Instant::now() + WAIT;
        while processed.iter().sum::<u64>() < target {
            if Instant::now() > deadline {
                return Err("the drivers never reached 30%".into());
            }
            for (i, n) in nodes.iter().enumerate() {
                while let Ok(line) = n.lines.try_recv() {
                    if let Some(count) = line.strip_prefix("PROCESSED ") {
                        processed[i] = count.trim().parse().unwrap_or(processed[i]);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        nodes[2]
            .process
            .kill()
            .map_err(|e| format!("SIGKILL node 2: {e}"))?;
        killed_at = Some(start.elapsed());
        let victim = addrs[2];
        for n in &mut nodes[..2] {
            n.say(&format!("KILLED {victim}"));
        }
        let _ = nodes[2].process.wait();
    }
    let live = if w2 { 2 } else { 3 };
    let mut reports = Vec::new();
    for n in &nodes[..live] {
        reports.push(n.expect_json("DONE")?);
    }
    let wall = start.elapsed();
    for n in &mut nodes[..live] {
        n.say("STOP");
    }
    let mut figures = Vec::new();
    for n in &nodes[..live] {
        figures.push(n.expect_json("FIGURES")?);
    }
    for (i, n) in nodes[..live].iter_mut().enumerate() {
        let status = n.process.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("node {i} exited with {status}"));
        }
    }
    let sum = |v: &[serde_json::Value], key: &str| -> u64 {
        v.iter().map(|r| r[key].as_u64().unwrap_or(0)).sum()
    };
    // W2's two drivers take half each (an odd count leaves one out).
    let expected = if w2 {
        2 * (args.messages / 2)
    } else {
        args.messages
    };
    let acks = sum(&reports, "acks");
    let retries = sum(&reports, "retries");
    let duplicates = sum(&figures, "duplicate_processings");
    let order = sum(&figures, "order_violations");
    // Duplicates and order violations of messages that were not retried.
    let pairs = |v: &[serde_json::Value], key: &str| -> Vec<(u64, u64)> {
        v.iter()
            .filter_map(|r| r[key].as_array())
            .flatten()
            .filter_map(|p| Some((p[0].as_u64()?, p[1].as_u64()?)))
            .collect()
    };
    let retried: std::collections::HashSet<(u64, u64)> =
        pairs(&reports, "retried").into_iter().collect();
    let unexplained = pairs(&figures, "flagged")
        .iter()
        .filter(|p| !retried.contains(p))
        .count();
    let cpu_ms: f64 = figures
        .iter()
        .map(|f| f["cpu_ms"].as_f64().unwrap_or(0.0))
        .sum();
    let max_rss = figures
        .iter()
        .map(|f| f["peak_rss_kib"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0);
    let p99_max = reports
        .iter()
        .map(|r| r["p99_us"].as_u64().unwrap_or(0))
        .max()
        .unwrap_or(0);
    for (i, (r, f)) in reports.iter().zip(&figures).enumerate() {
        println!(
            "node {i}: {} acks · p50 {} p99 {} µs · CPU {:.0} ms · peak RSS {:.1} MiB",
            r["acks"],
            r["p50_us"],
            r["p99_us"],
            f["cpu_ms"].as_f64().unwrap_or(0.0),
            f["peak_rss_kib"].as_f64().unwrap_or(0.0) / 1024.0
        );
    }
    println!(
        "total ({store} store): {acks} acks · missing {} · dup {duplicates} · order {order} · retries {retries} · {:.0} msg/s · {:.2} µs CPU/msg",
        expected - acks,
        acks as f64 / wall.as_secs_f64(),
        cpu_ms * 1e3 / acks.max(1) as f64
    );
    let workload = match args.workload {
        Workload::W1Sat => "w1-sat",
        Workload::W2 => "w2",
        Workload::W3 => "w3",
        _ => "w1",
    };
    let mut record = json!({
        "workload": workload,
        "mode": "multi-process",
        "store": store,
        "in_flight_per_driver": in_flight,
        "expected_acks": expected,
        "unique_acks": acks,
        "missing_acks": expected - acks,
        "duplicate_processings": duplicates,
        "order_violations": order,
        "unexplained_violations": unexplained,
        "retries": retries,
        "wall_ms": wall.as_secs_f64() * 1e3,
        "msgs_per_sec": acks as f64 / wall.as_secs_f64(),
        "p99_us_max_of_nodes": p99_max,
        "cpu_ms": cpu_ms,
        "cpu_us_per_msg": cpu_ms * 1e3 / acks.max(1) as f64,
        "max_rss_kib": max_rss,
        "sum_rss_kib": sum(&figures, "peak_rss_kib"),
        "nodes": reports.iter().zip(&figures).map(|(r, f)| json!({"driver": r, "process": f})).collect::<Vec<_>>(),
    });
    if let Some(killed_at) = killed_at {
        // Per entity, its first answer after the kill seen by either driver.
        let mut first: HashMap<u64, f64> = HashMap::new();
        for r in &reports {
            if let Some(map) = r["first_ms"].as_object() {
                for (k, v) in map {
                    if let (Ok(k), Some(v)) = (k.parse::<u64>(), v.as_f64()) {
                        let e = first.entry(k).or_insert(v);
                        *e = e.min(v);
                    }
                }
            }
        }
        let affected = &hosted[2];
        let rehomed = affected
            .iter()
            .filter_map(|k| first.get(k))
            .copied()
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
        let unasked = affected.iter().filter(|k| !first.contains_key(k)).count();
        let first_ack = first.values().copied().fold(f64::INFINITY, f64::min);
        let down = reports
            .iter()
            .filter_map(|r| r["down_after_kill_ms"].as_f64())
            .fold(0.0, f64::max);
        println!(
            "w2 (multi-process, {}): {} affected entities, Down after {down:.0} ms, all rehomed {} ms after the kill, first ack after the kill {first_ack:.3} ms",
            reports[0]["downing"].as_str().unwrap_or("?"),
            affected.len(),
            rehomed.map_or("n/a".into(), |t| format!("{t:.0}")),
        );
        record["killed_at_ms"] = (killed_at.as_secs_f64() * 1e3).into();
        record["affected_entities"] = affected.len().into();
        record["affected_not_asked_after_kill"] = unasked.into();
        record["down_after_kill_ms"] = down.into();
        record["rehomed_ms"] = rehomed.into();
        record["first_ack_after_kill_ms"] = first_ack.into();
        record["downing"] = reports[0]["downing"].clone();
    }
    let ok = acks == expected && unexplained == 0;
    Ok((record, ok))
}

/// One node process: joins, serves, drives its share, reports.
pub(super) fn child(index: usize, args: &Args, in_flight: usize) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    match runtime.block_on(run_child(index, args, in_flight)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("shard-bench node {index}: {error}");
            ExitCode::from(2)
        }
    }
}

/// The parent's words, read from stdin on a thread of their own.
struct Words(tokio::sync::mpsc::UnboundedReceiver<String>);

impl Words {
    fn start() -> Words {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Words(rx)
    }

    /// The rest of the next line that starts with `word`.
    async fn wait_for(&mut self, word: &str) -> Result<String, Box<dyn std::error::Error>> {
        while let Some(line) = self.0.recv().await {
            if let Some(rest) = line.trim().strip_prefix(word) {
                return Ok(rest.trim().to_owned());
            }
        }
        Err(format!("stdin closed before `{word}`").into())
    }
}

async fn run_child(
    index: usize,
    args: &Args,
    in_flight: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use datum_cluster_sharding::cluster::ClusterConfig;
    let mut words = Words::start();
    let mut config = ClusterConfig::builder()
        .cluster_name("shard-bench-multi")
        .secret("demo-secret")
        .seed_nodes(args.seed.into_iter().collect())
        .build();
    if args.downing == Downing::Timeout {
        config.split_brain = None;
    }
    let cluster = ClusterNode::start(config).await?;
    println!("ADDR {}", cluster.bound_addr());
    cluster
        .wait_until(|s| s.up_members().count() == 3, Duration::from_secs(60))
        .await?;
    let checks = Arc::new(Checks::default());
    let builder = ShardedSystem::builder()
        .config(sharding_config())
        .node(cluster.clone());
    match args.store.as_str() {
        "memory" => {
            let system = builder.store(InMemoryStore::new()).start().await?;
            system
                .entity_type::<PingEntity>()
                .remembered()
                .register(ping_factory(checks.clone()))
                .await?;
            serve(index, args, in_flight, &cluster, system, checks, &mut words).await
        }
        "file" => {
            let dir = tempfile::Builder::new()
                .prefix("shard-bench-w3-")
                .tempdir()?;
            let store = Arc::new(FileStore::open(dir.path(), FileStoreFsyncPolicy::Always)?);
            let system = builder.store(store).start().await?;
            system
                .entity_type::<PingEntity>()
                .remembered()
                .register(ping_factory(checks.clone()))
                .await?;
            serve(index, args, in_flight, &cluster, system, checks, &mut words).await
        }
        _ => {
            let system = builder.start().await?;
            system
                .entity_type::<PingEntity>()
                .register(ping_factory(checks.clone()))
                .await?;
            serve(index, args, in_flight, &cluster, system, checks, &mut words).await
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve<S: Send + Sync + 'static>(
    index: usize,
    args: &Args,
    in_flight: usize,
    cluster: &ClusterNode,
    system: ShardedSystem<S>,
    checks: Arc<Checks>,
    words: &mut Words,
) -> Result<(), Box<dyn std::error::Error>> {
    let w2 = args.workload == Workload::W2;
    println!("READY");
    words.wait_for("WARM").await?;
    for k in 0..ENTITIES {
        let ping = ping::Ping {
            driver: 90 + index as u32,
            seq: k,
        };
        system
            .entity_ref::<Pinger>(entity_id(k))
            .ask(ping, harness::ASK_TIMEOUT)
            .await?;
    }
    println!("WARMED");
    let hosted: Vec<u64> = (0..ENTITIES)
        .filter(|k| {
            let shard = system.entity_ref::<Pinger>(entity_id(*k)).shard_id();
            system.live_entities::<Pinger>(shard) > 0
        })
        .collect();
    println!("HOSTED {}", json!(hosted));
    words.wait_for("GO").await?;
    let cpu_before = cpu_time();
    let answered = Arc::new(Mutex::new(Answered::default()));
    let (share, stride) = if w2 {
        // W2's drivers run on the two survivors only.
        (if index < 2 { args.messages / 2 } else { 0 }, 2)
    } else {
        (shares(args.messages)[index], 3)
    };
    let driver = tokio::spawn(drive(
        system.clone(),
        index as u32,
        stride,
        share,
        in_flight,
        w2.then(|| answered.clone()),
    ));
    let progress = tokio::spawn({
        let checks = checks.clone();
        async move {
            loop {
                println!("PROCESSED {}", checks.processed());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    let mut down_after = None;
    if w2 && index < 2 {
        let victim: SocketAddr = words.wait_for("KILLED").await?.parse()?;
        let killed = Instant::now();
        let mut events = cluster.subscribe();
        answered.lock().await.since = Some(killed);
        let seen_down = |s: &datum_cluster_sharding::membership::MembershipState| {
            s.members.iter().any(|m| {
                m.address.addr == victim
                    && !matches!(m.status, MemberStatus::Up | MemberStatus::Joining)
            }) || !s.members.iter().any(|m| m.address.addr == victim)
        };
        let downed = seen_down(&cluster.current_state())
            || tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    match events.recv().await {
                        Ok(MembershipEvent::MemberDowned(m)) if m.addr == victim => return true,
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                            if seen_down(&cluster.current_state()) {
                                return true;
                            }
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return false,
                    }
                }
            })
            .await
            .unwrap_or(false);
        // Null in the record when the Down never came.
        down_after = downed.then(|| killed.elapsed());
    }
    let report = driver.await?;
    progress.abort();
    let answered = answered.lock().await;
    let first_ms: serde_json::Map<String, serde_json::Value> = answered
        .first
        .iter()
        .map(|(k, at)| (k.to_string(), (at.as_secs_f64() * 1e3).into()))
        .collect();
    let downing = args.downing.label();
    println!(
        "DONE {}",
        json!({
            "acks": report.acks,
            "retries": report.retries,
            "p50_us": report.latency.value_at_quantile(0.50),
            "p99_us": report.latency.value_at_quantile(0.99),
            "max_us": report.latency.max(),
            "down_after_kill_ms": down_after.map(|d| d.as_secs_f64() * 1e3),
            "retried": report.retried,
            "p999_us": report.latency.value_at_quantile(0.999),
            "first_ms": first_ms,
            "downing": downing,
        })
    );
    words.wait_for("STOP").await?;
    let cpu = cpu_time().saturating_sub(cpu_before);
    println!(
        "FIGURES {}",
        json!({
            "cpu_ms": cpu.as_secs_f64() * 1e3,
            "peak_rss_kib": peak_rss_kib(),
            "duplicate_processings": checks.duplicate_processings.load(Ordering::Relaxed),
            "order_violations": checks.order_violations.load(Ordering::Relaxed),
            "flagged": *checks.flagged.lock().unwrap_or_else(|e| e.into_inner()),
        })
    );
    system.shutdown().await;
    let _ = cluster.shutdown().await;
    Ok(())
}
