//! The W1 harness (BENCHMARK.md) shared by the main job and the benchmark
//! runner: three in-process nodes, the ping entity, drivers that issue
//! `(driver, seq)` asks in seq order with a window, and process figures.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::persistence::NoJournal;
use datum_cluster_sharding::prelude::*;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use hdrhistogram::Histogram;
use tokio::sync::Mutex;

use super::ping::{Ack, Checks, Ping, PingEntity, Pinger};

/// W1's entity count.
pub const ENTITIES: u64 = 1_000;
/// W1's shard count.
pub const SHARDS: u32 = 128;
/// W1's ask timeout.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// One node: its cluster membership and its sharded system.
pub struct Node<S = NoStore, J = NoJournal> {
    pub cluster: ClusterNode,
    pub system: ShardedSystem<S, J>,
}

/// `entity-{k}`.
pub fn entity_id(k: u64) -> String {
    format!("entity-{k}")
}

/// Three cluster nodes on 127.0.0.1, all Up; returns them with the time it
/// took. `timeout_downing`: timeout downing (the single-zone choice) instead
/// of the project's default keep-majority resolver, which downs a crashed
/// node `stable_after` later and moves its shards after the dead-owner
/// margin (SPEC §13.15).
pub async fn form_cluster(
    name: &str,
    timeout_downing: bool,
) -> Result<(Vec<ClusterNode>, Duration), Box<dyn std::error::Error>> {
    form_cluster_with(name, timeout_downing, &[]).await
}

/// [`form_cluster`], node `i`'s pipes under TLS with `tls[i]` when `tls`
/// is not empty (one per node).
pub async fn form_cluster_with(
    name: &str,
    timeout_downing: bool,
    tls: &[datum_cluster_sharding::transport::Tls],
) -> Result<(Vec<ClusterNode>, Duration), Box<dyn std::error::Error>> {
    let config = |i: usize, seeds| {
        let mut config = ClusterConfig::builder()
            .cluster_name(name)
            .secret("demo-secret")
            .seed_nodes(seeds)
            .build();
        if timeout_downing {
            config.split_brain = None;
        }
        config.tls = tls.get(i).cloned();
        config
    };
    let formed = Instant::now();
    let first = ClusterNode::start(config(0, vec![])).await?;
    let mut clusters = vec![first.clone()];
    for i in 1..3 {
        clusters.push(ClusterNode::start(config(i, vec![first.bound_addr()])).await?);
    }
    for c in &clusters {
        c.wait_until(|s| s.up_members().count() == 3, Duration::from_secs(30))
            .await?;
    }
    Ok((clusters, formed.elapsed()))
}

/// W1's sharding settings: 128 shards, no idle passivation.
pub fn sharding_config() -> ShardingConfig {
    ShardingConfig::builder()
        .num_shards(SHARDS)
        .passivation_idle_timeout(None)
        .build()
}

/// Waits until every node's regions are registered with the coordinator,
/// so that the first allocations see all of them: a region that registers
/// late gets no shard until rebalance rounds move some to it, which would
/// then happen while the clock runs.
pub async fn wait_registered<S, J>(nodes: &[Node<S, J>]) -> Result<(), Box<dyn std::error::Error>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, n) in nodes.iter().enumerate() {
        while !n
            .system
            .sharding_coordinator()
            .is_some_and(|c| c.registered)
        {
            if Instant::now() > deadline {
                return Err(format!("node {i}'s regions not registered after 30 s").into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(())
}

/// How many shards the coordinator moved since `since`, as the rounds kept
/// on every node (whichever was coordinator) record them.
pub fn shards_moved_since<S, J>(nodes: &[Node<S, J>], since: Instant) -> usize {
    nodes
        .iter()
        .flat_map(|n| n.system.rebalance_rounds())
        .filter(|round| round.at >= since)
        .map(|round| round.moves.len())
        .sum()
}

/// Every region registered ([`wait_registered`]), then one ask per entity
/// from each node: every shard allocated and every entity spawned before
/// the clock starts. Driver ids 90.. are used.
pub async fn warm_up<S, J>(nodes: &[Node<S, J>]) -> Result<Duration, Box<dyn std::error::Error>> {
    let warm = Instant::now();
    wait_registered(nodes).await?;
    for (i, n) in nodes.iter().enumerate() {
        for k in 0..ENTITIES {
            let ping = Ping {
                driver: 90 + i as u32,
                seq: k,
            };
            n.system
                .entity_ref::<Pinger>(entity_id(k))
                .ask(ping, ASK_TIMEOUT)
                .await?;
        }
    }
    Ok(warm.elapsed())
}

/// The entities (by number) whose shard node `index` hosts now.
pub fn entities_hosted_on<S, J>(nodes: &[Node<S, J>], index: usize) -> Vec<u64> {
    (0..ENTITIES)
        .filter(|k| {
            let shard = nodes[0]
                .system
                .entity_ref::<Pinger>(entity_id(*k))
                .shard_id();
            nodes[index].system.live_entities::<Pinger>(shard) > 0
        })
        .collect()
}

/// The factory of the checked ping entity.
pub fn ping_factory(
    checks: Arc<Checks>,
) -> impl Fn(&EntityContext) -> PingEntity + Send + Sync + 'static {
    move |_| PingEntity::checked(checks.clone())
}

/// When each entity (by number) first answered after `since`, and every
/// logical ask's completion for a timeline.
#[derive(Default)]
pub struct Answered {
    pub since: Option<Instant>,
    pub first: HashMap<u64, Duration>,
    /// When the run started (the timeline's zero); no timeline without it.
    pub started: Option<Instant>,
    /// Per logical ask: when it was acked (µs since `started`) and how long
    /// it took from its first attempt (µs, retries included).
    pub timeline: Vec<(u64, u64)>,
    /// The entity of each `timeline` point.
    pub timeline_ids: Vec<u64>,
}

impl Answered {
    /// For the entities `affected`: when the last of them first answered
    /// after `since`, how many never did, and the first answer of any entity.
    pub fn rehomed(&self, affected: &[u64]) -> (Option<Duration>, usize, Option<Duration>) {
        let last = affected
            .iter()
            .filter_map(|k| self.first.get(k))
            .max()
            .copied();
        let unasked = affected
            .iter()
            .filter(|k| !self.first.contains_key(*k))
            .count();
        (last, unasked, self.first.values().min().copied())
    }
}

/// What one driver saw.
pub struct DriverReport {
    pub latency: Histogram<u64>,
    pub acks: u64,
    pub retries: u64,
    /// The `(driver, seq)` of every message that took more than one
    /// attempt (a retried message may be handled twice, or after a later
    /// one: BENCHMARK.md does not count those as violations).
    pub retried: Vec<(u32, u64)>,
}

/// How long a driver retries one message before it counts it missing.
pub const GIVE_UP: Duration = Duration::from_secs(60);

/// Driver `d` on `system`: its share of the messages, issued in `seq` order
/// with at most `in_flight` asks outstanding (so an entity sees one driver's
/// seqs in order); a failed ask is retried with the same `(driver, seq)`.
/// Entity `k`'s ask goes to `entity-{(stride * k + d) mod 1000}`.
pub async fn drive<S, J>(
    system: ShardedSystem<S, J>,
    d: u32,
    stride: u64,
    count: u64,
    in_flight: usize,
    answered: Option<Arc<Mutex<Answered>>>,
) -> DriverReport {
    // A user holds its refs: one per entity, made once.
    let refs: Vec<EntityRef<Pinger>> = (0..ENTITIES)
        .map(|k| system.entity_ref::<Pinger>(entity_id(k)))
        .collect();
    let mut report = DriverReport::new();
    let one = |k| {
        let (refs, answered) = (&refs, answered.as_deref());
        async move {
            let id = (stride * k + u64::from(d)) % ENTITIES;
            let attempts = ask_until_acked(&refs[id as usize], d, k).await;
            if let Some(answered) = answered.filter(|_| attempts.acked) {
                note_answer(answered, id, &attempts).await;
            }
            attempts
        }
    };
    windowed(count, in_flight, one, |attempts| report.add(attempts)).await;
    report
}

/// Runs `one(k)` for every `k` in `0..count` with at most `in_flight` of
/// them running (one when `in_flight` is 0), and hands each output to
/// `done`: a window of long-lived workers in the caller's one task, each
/// taking the next `k` as its last one is done. Every `one(k)` is first
/// polled before `k + 1` is taken; when that poll sends an ask (as `ask`'s
/// does, unless the region makes it wait for room), the asks leave in `k`
/// order. A worker lives for the whole run: no future is boxed or
/// allocated per `k`, as one would be in a `buffer_unordered` stream.
pub async fn windowed<T, F, Fut>(count: u64, in_flight: usize, one: F, done: impl FnMut(T))
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = T>,
{
    // Relaxed: the workers take turns in one task; the atomic only lets
    // them share the counter. The lock is never contended, for the same
    // reason; one recorder (the driver's one histogram) rather than one
    // per worker.
    let next = AtomicU64::new(0);
    let done = std::sync::Mutex::new(done);
    let worker = || async {
        loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= count {
                return;
            }
            let output = one(k).await;
            (*done.lock().expect("no worker panics"))(output);
        }
    };
    let mut workers: FuturesUnordered<_> = (0..in_flight.max(1)).map(|_| worker()).collect();
    while workers.next().await.is_some() {}
}

/// The first sender id of the open-loop drivers' asks.
const OPEN_LOOP_SENDERS: u64 = 1 << 31;

/// Open-loop driver `d` (W2 `--offered-rate`): `count` asks issued at
/// `per_second`, each on a schedule of its own whatever the others do (as
/// requests reach a real service), each retried until acked. Ask `k` goes
/// to `entity-{(stride * k + d) mod 1000}` as a sender of its own (driver
/// id `2³¹ + d * 10⁹ + k`): independent asks have no order to keep.
#[allow(dead_code)] // not every program that includes this file drives open loops
pub async fn drive_open<S: Send + Sync + 'static, J: Send + Sync + 'static>(
    system: ShardedSystem<S, J>,
    d: u32,
    stride: u64,
    count: u64,
    per_second: f64,
    answered: Arc<Mutex<Answered>>,
) -> DriverReport {
    assert!(
        count < 1_000_000_000,
        "open-loop sender ids hold 10⁹ asks per driver"
    );
    assert!(d < 2, "open-loop sender ids hold two drivers");
    let refs: Arc<Vec<EntityRef<Pinger>>> = Arc::new(
        (0..ENTITIES)
            .map(|k| system.entity_ref::<Pinger>(entity_id(k)))
            .collect(),
    );
    let start = tokio::time::Instant::now();
    let mut asks = tokio::task::JoinSet::new();
    let mut report = DriverReport::new();
    for k in 0..count {
        let due = start + Duration::from_secs_f64(k as f64 / per_second);
        if due > tokio::time::Instant::now() {
            tokio::time::sleep_until(due).await;
        }
        let (refs, answered) = (refs.clone(), answered.clone());
        asks.spawn(async move {
            let id = (stride * k + u64::from(d)) % ENTITIES;
            // Above 2³¹: no closed-loop or warm-up driver id.
            let sender = u32::try_from(OPEN_LOOP_SENDERS + u64::from(d) * 1_000_000_000 + k)
                .expect("checked above");
            let attempts = ask_until_acked(&refs[id as usize], sender, k).await;
            if attempts.acked {
                note_answer(&answered, id, &attempts).await;
            }
            attempts
        });
        while let Some(done) = asks.try_join_next() {
            report.add(done.expect("an ask task"));
        }
    }
    while let Some(done) = asks.join_next().await {
        report.add(done.expect("an ask task"));
    }
    report
}

/// Records, for W2, when entity `id` answered and the ask's timeline point.
async fn note_answer(answered: &Mutex<Answered>, id: u64, attempts: &Attempts) {
    let took = attempts.began.elapsed().as_micros() as u64;
    let mut answered = answered.lock().await;
    // Only an ask begun after the kill counts: a reply already
    // in flight then says nothing about where the entity lives.
    if let Some(since) = answered.since.filter(|since| attempts.began >= *since) {
        let at = since.elapsed();
        answered.first.entry(id).or_insert(at);
    }
    if let Some(started) = answered.started {
        let at = started.elapsed().as_micros() as u64;
        answered.timeline.push((at, took));
        answered.timeline_ids.push(id);
    }
}

/// W1's shape with a fresh entity per message (W3's spawning variant):
/// driver `d`'s message `k` goes to entity `spawn-d-k`, which it starts.
pub async fn drive_fresh<S, J>(
    system: ShardedSystem<S, J>,
    d: u32,
    count: u64,
    in_flight: usize,
) -> DriverReport {
    let mut report = DriverReport::new();
    let one = |k| {
        let entity = system.entity_ref::<Pinger>(format!("spawn-{d}-{k}"));
        async move { ask_until_acked(&entity, d, k).await }
    };
    windowed(count, in_flight, one, |attempts| report.add(attempts)).await;
    report
}

/// The attempts at one message.
struct Attempts {
    seq: (u32, u64),
    /// When the first attempt began.
    began: Instant,
    /// The first attempt's latency, µs.
    first: u64,
    /// The latency of every later attempt, µs (empty, and unallocated,
    /// unless the message was retried).
    retries: Vec<u64>,
    /// Whether the right ack came (false: given up after [`GIVE_UP`]).
    acked: bool,
}

/// Asks `(d, k)` until the right ack comes, or [`GIVE_UP`] has passed.
/// One clock read per attempt: each attempt's end is the next one's start.
async fn ask_until_acked(entity: &EntityRef<Pinger>, d: u32, k: u64) -> Attempts {
    let ping = Ping { driver: d, seq: k };
    let began = Instant::now();
    let mut attempts = Attempts {
        seq: (d, k),
        began,
        first: 0,
        retries: Vec::new(),
        acked: false,
    };
    let mut start = began;
    loop {
        let result = entity.ask(ping, ASK_TIMEOUT).await;
        let now = Instant::now();
        let micros = (now.duration_since(start).as_micros() as u64).max(1);
        if attempts.first == 0 {
            attempts.first = micros;
        } else {
            attempts.retries.push(micros);
        }
        match result {
            Ok(ack) if ack == Ack { driver: d, seq: k } => attempts.acked = true,
            Ok(ack) => panic!("wrong ack {ack:?} for {ping:?}"),
            Err(_) if now.duration_since(began) >= GIVE_UP => {}
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(1)).await;
                start = Instant::now();
                continue;
            }
        }
        return attempts;
    }
}

impl DriverReport {
    fn new() -> Self {
        DriverReport {
            latency: Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram"),
            acks: 0,
            retries: 0,
            retried: Vec::new(),
        }
    }

    /// Counts the attempts at one message.
    fn add(&mut self, attempts: Attempts) {
        let extra = attempts.retries.len() as u64;
        self.retries += extra;
        if extra > 0 {
            self.retried.push(attempts.seq);
        }
        self.latency.saturating_record(attempts.first);
        for micros in attempts.retries {
            self.latency.saturating_record(micros);
        }
        self.acks += u64::from(attempts.acked);
    }
}

/// The drivers' reports merged.
pub struct Joined {
    pub latency: Histogram<u64>,
    pub acks: u64,
    pub retries: u64,
    pub retried: HashSet<(u32, u64)>,
}

/// Waits for the drivers and merges their reports.
pub async fn join_reports(
    drivers: Vec<tokio::task::JoinHandle<DriverReport>>,
) -> Result<Joined, Box<dyn std::error::Error>> {
    let mut joined = Joined {
        latency: Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?,
        acks: 0,
        retries: 0,
        retried: HashSet::new(),
    };
    for driver in drivers {
        let report = driver.await?;
        joined.latency.add(&report.latency)?;
        joined.acks += report.acks;
        joined.retries += report.retries;
        joined.retried.extend(report.retried);
    }
    Ok(joined)
}

/// W1's split of `messages` over three drivers.
pub fn shares(messages: u64) -> Vec<u64> {
    (0..3u64)
        .map(|d| messages / 3 + u64::from(d < messages % 3))
        .collect()
}

/// User + system CPU of this process, from /proc (Linux).
pub fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum())
        .unwrap_or(0);
    Duration::from_millis(ticks * 10) // USER_HZ is 100 on Linux
}

/// The process's peak resident set, from /proc (Linux).
pub fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
