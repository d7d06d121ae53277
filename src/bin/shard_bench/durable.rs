//! W4 (BENCHMARK.md): W1 where every ask journals one event before its
//! ack — on the embedded store (one redb file per node) or on PostgreSQL
//! (one database the three nodes share) — interleaved with the same
//! store's raw batched appends at the same concurrency, no sharding; and
//! the durable checks of W2: after the kill, every acked event is in the
//! journal and every entity answers with the count its journal holds.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use datum_cluster_sharding::persistence::{
    AtomicWrite, EventRecord, Journal, Payload, PersistenceId, PersistenceResult, RedbPersistence,
    Writer,
};
use datum_cluster_sharding::prelude::*;
use hdrhistogram::Histogram;
use serde_json::json;

use super::harness::{self, ASK_TIMEOUT, ENTITIES, Node, entity_id, form_cluster, sharding_config};
use super::ping::{Checks, Count, DurablePingEntity, Ping, PingEntity, Pinger};
use super::{Run, cpu_time, peak_rss_kib, run_drivers, stop};

/// Which store W4 journals to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum JournalKind {
    /// The embedded store: a redb file per node (in W2, one file the three
    /// in-process nodes share, as a shared disk would be).
    Embedded,
    /// The log-structured embedded store: a fjall database per node
    /// (build with `--features fjall`).
    Fjall,
    /// PostgreSQL: a throwaway server with `fsync=on`, one database the
    /// three nodes share, a pool of 4 connections per node (build with
    /// `--features postgres`).
    Postgres,
}

impl JournalKind {
    pub fn name(self) -> &'static str {
        match self {
            JournalKind::Embedded => "embedded",
            JournalKind::Fjall => "fjall",
            JournalKind::Postgres => "postgres",
        }
    }
}

/// A journal that counts its commits (`append` calls) and the writes in
/// them; clones share the store and the counts.
#[derive(Clone)]
pub struct Counted {
    inner: Arc<dyn Journal>,
    commits: Arc<AtomicU64>,
    writes: Arc<AtomicU64>,
}

impl Counted {
    fn new(inner: impl Journal) -> Self {
        Counted {
            inner: Arc::new(inner),
            commits: Arc::default(),
            writes: Arc::default(),
        }
    }

    /// Commits and writes so far.
    fn counts(&self) -> (u64, u64) {
        (
            self.commits.load(Ordering::Relaxed),
            self.writes.load(Ordering::Relaxed),
        )
    }
}

impl Journal for Counted {
    fn append(&self, writes: &[AtomicWrite]) -> Vec<PersistenceResult<()>> {
        self.commits.fetch_add(1, Ordering::Relaxed);
        self.writes
            .fetch_add(writes.len() as u64, Ordering::Relaxed);
        self.inner.append(writes)
    }
    fn replay(
        &self,
        persistence_id: &PersistenceId,
        from: u64,
        to: u64,
        max: usize,
    ) -> PersistenceResult<Vec<EventRecord>> {
        self.inner.replay(persistence_id, from, to, max)
    }
    fn highest_sequence_nr(&self, persistence_id: &PersistenceId) -> PersistenceResult<u64> {
        self.inner.highest_sequence_nr(persistence_id)
    }
    fn delete_to(&self, persistence_id: &PersistenceId, to: u64) -> PersistenceResult<()> {
        self.inner.delete_to(persistence_id, to)
    }
    fn commit_lanes(&self) -> usize {
        self.inner.commit_lanes()
    }
    fn batching(&self) -> datum_cluster_sharding::persistence::Batching {
        self.inner.batching()
    }
}

/// Where a run's journals come from: a temporary directory for redb
/// files, or a throwaway PostgreSQL server (one fresh database a run).
pub struct Stores {
    kind: JournalKind,
    /// Commit lanes per node: redb files per node (1: the one-file
    /// layout), or PostgreSQL connections per node.
    lanes: usize,
    dir: tempfile::TempDir,
    files: AtomicU64,
    #[cfg(feature = "postgres")]
    server: Option<super::pg_server::Server>,
}

impl Stores {
    /// `lanes`: commit lanes per node, by default one redb file, or a pool
    /// of 4 PostgreSQL connections.
    pub fn new(
        kind: JournalKind,
        lanes: Option<usize>,
    ) -> Result<Stores, Box<dyn std::error::Error>> {
        let lanes = lanes.unwrap_or(match kind {
            JournalKind::Embedded | JournalKind::Fjall => 1,
            JournalKind::Postgres => 4,
        });
        let dir = tempfile::Builder::new()
            .prefix("shard-bench-w4-")
            .tempdir()?;
        #[cfg(feature = "postgres")]
        let server = server_for(kind)?;
        #[cfg(not(feature = "postgres"))]
        if kind == JournalKind::Postgres {
            return Err("--journal postgres needs a build with `--features postgres`".into());
        }
        #[cfg(not(feature = "fjall"))]
        if kind == JournalKind::Fjall {
            return Err("--journal fjall needs a build with `--features fjall`".into());
        }
        Ok(Stores {
            kind,
            lanes,
            dir,
            files: AtomicU64::new(0),
            #[cfg(feature = "postgres")]
            server,
        })
    }

    /// Fresh, empty journals for three nodes: three redb stores (one file
    /// each, or a directory of `lanes` files), or three pools on one new
    /// database. `shared`: one embedded store for all three.
    pub fn fresh(&self, shared: bool) -> Result<Vec<Counted>, Box<dyn std::error::Error>> {
        #[cfg(feature = "postgres")]
        if self.kind == JournalKind::Postgres {
            let server = self.server.as_ref().ok_or("no server")?;
            let url = server.database();
            return (0..3)
                .map(|_| {
                    let store = datum_cluster_sharding::persistence::PgPersistence::connect(
                        &url,
                        self.lanes as u32,
                    )?;
                    Ok(Counted::new(store))
                })
                .collect();
        }
        // An embedded store of its own, in the run's directory.
        let open = || -> Result<Counted, Box<dyn std::error::Error>> {
            let n = self.files.fetch_add(1, Ordering::Relaxed);
            let name = format!("journal-{n}");
            Ok(match self.kind {
                JournalKind::Embedded => {
                    Counted::new(open_redb(self.dir.path(), &name, self.lanes)?)
                }
                #[cfg(feature = "fjall")]
                JournalKind::Fjall => {
                    Counted::new(datum_cluster_sharding::persistence::FjallPersistence::open(
                        self.dir.path().join(name),
                    )?)
                }
                kind => return Err(format!("built without the {} feature", kind.name()).into()),
            })
        };
        if shared {
            let one = open()?;
            return Ok(vec![one.clone(), one.clone(), one]);
        }
        (0..3).map(|_| open()).collect()
    }
}

/// A throwaway PostgreSQL server (`fsync` on) when `kind` is PostgreSQL.
#[cfg(feature = "postgres")]
pub fn server_for(kind: JournalKind) -> Result<Option<super::pg_server::Server>, String> {
    match kind {
        JournalKind::Postgres => {
            super::pg_server::Server::start(super::pg_server::Durability::Fsync)
                .map(Some)
                .ok_or_else(|| "PostgreSQL's binaries are needed for --journal postgres".into())
        }
        JournalKind::Embedded | JournalKind::Fjall => Ok(None),
    }
}

/// The redb store named `name` in `dir`: one file `<name>.redb`, or with
/// more than one lane the directory `<name>` of `lanes` files.
pub fn open_redb(
    dir: &std::path::Path,
    name: &str,
    lanes: usize,
) -> datum_cluster_sharding::persistence::PersistenceResult<RedbPersistence> {
    if lanes == 1 {
        RedbPersistence::open(dir.join(format!("{name}.redb")))
    } else {
        RedbPersistence::open_lanes(dir.join(name), lanes)
    }
}

/// Three nodes, node `i` journaling to `journals[i]`, the durable ping
/// entity registered, warmed up (which journals three events per entity).
pub async fn durable_cluster(
    name: &str,
    checks: &Arc<Checks>,
    timeout_downing: bool,
    journals: Vec<Counted>,
) -> Result<Vec<Node<NoStore, Counted>>, Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster(name, timeout_downing).await?;
    let mut nodes = Vec::new();
    for (cluster, journal) in clusters.into_iter().zip(journals) {
        let system = ShardedSystem::builder()
            .config(sharding_config())
            .node(cluster.clone())
            .journal(journal)
            .start()
            .await?;
        let checks = checks.clone();
        system
            .entity_type::<DurablePingEntity>()
            .event_sourced()
            .register(move |_| DurablePingEntity(PingEntity::checked(checks.clone())))
            .await?;
        nodes.push(Node { cluster, system });
    }
    harness::warm_up(&nodes).await?;
    Ok(nodes)
}

/// Commits and writes over the three nodes' journals (a shared journal
/// counted once).
fn commits(journals: &[Counted], shared: bool) -> (u64, u64) {
    let journals = if shared { &journals[..1] } else { journals };
    journals.iter().fold((0, 0), |(c, w), j| {
        let (jc, jw) = j.counts();
        (c + jc, w + jw)
    })
}

/// One W4 run and one raw run, on fresh journals each.
async fn pair(
    stores: &Stores,
    messages: u64,
    in_flight: usize,
    round: usize,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let checks = Arc::new(Checks::default());
    let journals = stores.fresh(false)?;
    let nodes = durable_cluster(
        &format!("shard-bench-w4-{round}"),
        &checks,
        false,
        journals.clone(),
    )
    .await?;
    let before = commits(&journals, false);
    let run: Run = run_drivers(&nodes, messages, in_flight, checks, false).await?;
    let after = commits(&journals, false);
    stop(nodes).await;
    run.print("w4");
    let mut sharded = run.json();
    let (batches, events) = (after.0 - before.0, after.1 - before.1);
    sharded["commits"] = batches.into();
    sharded["events_per_commit"] = (events as f64 / batches.max(1) as f64).into();
    sharded["cpu_us_per_event"] = sharded["cpu_us_per_msg"].clone();

    let journals = stores.fresh(false)?;
    let raw = tokio::task::spawn_blocking(move || raw_appends(&journals, messages, in_flight))
        .await?
        .map_err(|e| -> Box<dyn std::error::Error> { e })?;
    let ratio = run.acks as f64
        / run.wall.as_secs_f64()
        / raw["events_per_sec"].as_f64().unwrap_or(f64::NAN);
    println!(
        "raw appends    {:>9} events · {:>8.0} events/s · {:.2} µs CPU/event · p50 {} p99 {} µs · {:.1} events/commit · W4/raw {ratio:.3}",
        raw["events"],
        raw["events_per_sec"].as_f64().unwrap_or(0.0),
        raw["cpu_us_per_event"].as_f64().unwrap_or(0.0),
        raw["p50_us"],
        raw["p99_us"],
        raw["events_per_commit"].as_f64().unwrap_or(0.0),
    );
    let correct = run.correct();
    Ok((
        json!({ "w4": sharded, "raw": raw, "ratio": ratio }),
        correct,
    ))
}

/// W4: `rounds` pairs of (W4, raw appends), each on fresh journals, and
/// the median of their ratios.
pub async fn run_w4(
    kind: JournalKind,
    lanes: Option<usize>,
    messages: u64,
    in_flight: usize,
    rounds: usize,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let stores = Stores::new(kind, lanes)?;
    let mut results = Vec::new();
    let mut correct = true;
    for round in 0..rounds.max(1) {
        let (result, ok) = pair(&stores, messages, in_flight, round).await?;
        correct &= ok;
        results.push(result);
    }
    let mut ratios: Vec<f64> = results.iter().filter_map(|r| r["ratio"].as_f64()).collect();
    ratios.sort_by(f64::total_cmp);
    let median = ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "w4 ({}): W4/raw per round {ratios:.3?}, median {median:.3}",
        kind.name()
    );
    // The first round's W4 figures at the top, for the smoke test and for
    // a reader who ran one round.
    let mut json = results[0]["w4"].clone();
    json["workload"] = "w4".into();
    json["journal"] = kind.name().into();
    json["commit_lanes"] = match kind {
        JournalKind::Embedded => stores.lanes,
        JournalKind::Fjall | JournalKind::Postgres => 1,
    }
    .into();
    json["in_flight_per_driver"] = in_flight.into();
    json["median_ratio_to_raw"] = median.into();
    json["rounds"] = results.into();
    json["peak_rss_kib"] = peak_rss_kib().into();
    Ok((json, correct))
}

/// The baseline: on a thread per commit lane of each node's journal,
/// batches of `in_flight` appends of one event each, to the persistence
/// ids of that lane that take turns over the node's share of the
/// workload's 1,000 entities, one batch after the other — the store's raw
/// group-commit rate, for its layout, at W4's concurrency per lane.
fn raw_appends(
    journals: &[Counted],
    messages: u64,
    in_flight: usize,
) -> Result<serde_json::Value, Box<dyn std::error::Error + Send + Sync>> {
    let shares = super::shares(messages);
    let before = commits(journals, false);
    let cpu_before = cpu_time();
    let start = Instant::now();
    let mut threads = Vec::new();
    for (node, (journal, share)) in journals.iter().zip(shares).enumerate() {
        let lanes = journal.commit_lanes();
        for lane in 0..lanes {
            let journal = journal.clone();
            // The node's share, split evenly over its lanes.
            let part = share / lanes as u64 + u64::from((lane as u64) < share % lanes as u64);
            let on = Lane { lane, lanes };
            threads.push(std::thread::spawn(move || {
                raw_thread(&journal, node as u32, on, part, in_flight)
            }));
        }
    }
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut events = 0;
    for thread in threads {
        let (histogram, written) = thread.join().map_err(|_| "a raw thread panicked")??;
        latency.add(&histogram)?;
        events += written;
    }
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    let after = commits(journals, false);
    let batches = after.0 - before.0;
    Ok(json!({
        "events": events,
        "wall_ms": wall.as_secs_f64() * 1e3,
        "events_per_sec": events as f64 / wall.as_secs_f64(),
        "p50_us": latency.value_at_quantile(0.50),
        "p99_us": latency.value_at_quantile(0.99),
        "cpu_us_per_event": cpu.as_secs_f64() * 1e6 / events.max(1) as f64,
        "commits": batches,
        "events_per_commit": (after.1 - before.1) as f64 / batches.max(1) as f64,
    }))
}

type RawResult = Result<(Histogram<u64>, u64), Box<dyn std::error::Error + Send + Sync>>;

/// Which commit lane of how many a raw thread appends to.
#[derive(Clone, Copy)]
struct Lane {
    lane: usize,
    lanes: usize,
}

/// One lane's part of a node's share of the raw appends; every write's
/// latency is its batch's commit time.
fn raw_thread(journal: &Counted, node: u32, on: Lane, share: u64, in_flight: usize) -> RawResult {
    let writer = Writer {
        node_id: u64::from(node),
        incarnation: 1,
        generation: 1,
    };
    let ids: Vec<PersistenceId> = (0..ENTITIES)
        .filter(|k| k % 3 == u64::from(node))
        .map(|k| PersistenceId::new("pinger", entity_id(k)))
        .filter(|id| id.lane(on.lanes) == on.lane)
        .collect();
    if ids.is_empty() {
        return Err(format!("no entity of node {node} falls in lane {}", on.lane).into());
    }
    let mut highest = vec![0u64; ids.len()];
    let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let mut next = 0usize;
    let mut seq = 0u64;
    while seq < share {
        let n = in_flight.min((share - seq) as usize);
        let mut batch = Vec::with_capacity(n);
        let mut slots = Vec::with_capacity(n);
        for _ in 0..n {
            let slot = next % ids.len();
            next += 1;
            let mut bytes = Vec::new();
            ciborium::into_writer(&Ping { driver: node, seq }, &mut bytes)?;
            seq += 1;
            batch.push(AtomicWrite {
                persistence_id: ids[slot].clone(),
                expected: highest[slot],
                events: vec![Payload {
                    manifest: "pinger".into(),
                    version: 1,
                    bytes,
                }],
                writer,
            });
            slots.push(slot);
        }
        let began = Instant::now();
        let results = journal.append(&batch);
        let micros = (began.elapsed().as_micros() as u64).max(1);
        for (result, slot) in results.into_iter().zip(slots) {
            result?;
            highest[slot] += 1;
            latency.saturating_record(micros);
        }
    }
    Ok((latency, share))
}

/// W2's durable checks, after the run: every ping of the run (all acked,
/// or the run failed already) and of the warm-up is in some entity's
/// journal, no event twice for a ping that was not retried, and every
/// entity — those the killed node hosted included — answers `Count` with
/// its journal's length: its whole state, recovered.
pub async fn check_w2(
    node: &Node<NoStore, Counted>,
    drivers: u32,
    share: u64,
    retried: &HashSet<(u32, u64)>,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let journal = node.system.journal().clone();
    let mut seen: HashSet<(u32, u64)> = HashSet::new();
    let mut twice = 0u64;
    let mut wrong_count = 0u64;
    for k in 0..ENTITIES {
        let id = PersistenceId::new("pinger", entity_id(k));
        let journal = journal.clone();
        let events =
            tokio::task::spawn_blocking(move || journal.replay(&id, 1, u64::MAX, usize::MAX))
                .await??;
        for event in &events {
            let ping: Ping = ciborium::from_reader(event.payload.bytes.as_slice())?;
            if !seen.insert((ping.driver, ping.seq)) && !retried.contains(&(ping.driver, ping.seq))
            {
                twice += 1;
            }
        }
        let count = node
            .system
            .entity_ref::<Pinger>(entity_id(k))
            .ask(Count, ASK_TIMEOUT)
            .await?;
        wrong_count += u64::from(count != events.len() as u64);
    }
    let run_missing = (0..drivers)
        .flat_map(|d| (0..share).map(move |seq| (d, seq)))
        .filter(|p| !seen.contains(p))
        .count();
    // The warm-up's pings: drivers 90.. , one per entity from each node.
    let warm_missing = (90..93u32)
        .flat_map(|d| (0..ENTITIES).map(move |seq| (d, seq)))
        .filter(|p| !seen.contains(p))
        .count();
    let correct = run_missing == 0 && warm_missing == 0 && twice == 0 && wrong_count == 0;
    println!(
        "w2 durable: {} distinct events in the journal · acked but not journaled {} (+{warm_missing} of the warm-up) · journaled twice (not retried) {twice} · entities whose count is not their journal's {wrong_count}",
        seen.len(),
        run_missing
    );
    Ok((
        json!({
            "journaled_events": seen.len(),
            "acked_not_journaled": run_missing + warm_missing,
            "journaled_twice_unretried": twice,
            "count_not_journal": wrong_count,
        }),
        correct,
    ))
}
