//! The runner's flags, parsed by clap: the workload, how the three nodes
//! run, and each workload's options.

use clap::{Parser, ValueEnum};

use super::{durable, limit};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Workload {
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
    /// How the coordinator's costs grow: the real coordinator core driven
    /// directly over a grid of shard counts (`--shards`) × regions
    /// (`--regions`); no nodes, no pipes.
    Coordinator,
    /// How memory and the ask rate grow with the live entities on one node
    /// (`--counts`), each count in a child process, against as many bare
    /// ractor actors; `--messages` asks spread over them.
    Entities,
    /// How an event-sourced entity's recovery grows with its journal
    /// (`--lengths`), replayed whole and from a snapshot, on redb, fjall or
    /// PostgreSQL (`--journal`).
    Recovery,
    /// Baseline (a): the same three nodes and pipes, request/reply answered
    /// inline by the receiver, no sharding (16 in flight per node unless
    /// `--in-flight`).
    Transport,
    /// Entities that talk to each other: drivers ask 10,000 fronts, each
    /// of which asks a back, 90 % of the time one of three partners in
    /// another shard (`--uniform`: always a random back); the fraction of
    /// front-to-back asks that stay on one node.
    W6,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Mode {
    /// Three nodes in this process.
    InProcess,
    /// Three OS processes (this binary, started by itself), W1, W1-sat, W2
    /// and W3: CPU and RSS per node as well as in total.
    MultiProcess,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum Downing {
    KeepMajority,
    Timeout,
}

impl Downing {
    /// What the run's output says of it (the defaults of ClusterConfig).
    pub(super) fn label(self) -> &'static str {
        match self {
            Downing::Timeout => "timeout downing 200 ms",
            Downing::KeepMajority => "keep-majority, stable_after 1 s, margin 1.9 s",
        }
    }
}

#[derive(Parser, Debug)]
#[command(about = "The sharding workloads W1, W1-sat, W2, W3, W4, W5 and W6 (BENCHMARK.md)")]
pub(super) struct Args {
    /// Which workload.
    pub(super) workload: Workload,
    /// Messages in all (BENCHMARK.md: 1,000,000).
    #[arg(long, default_value_t = 1_000_000)]
    pub(super) messages: u64,
    /// Asks in flight per driver (default: 256 for w1-sat, 16 otherwise).
    #[arg(long)]
    pub(super) in_flight: Option<usize>,
    /// How the three nodes run.
    #[arg(long, value_enum, default_value_t = Mode::InProcess)]
    pub(super) mode: Mode,
    /// W3 only: every message goes to a fresh entity, so the measured phase
    /// spawns (and records) one entity per message — the store's cost on
    /// the message path, which plain W3 (entities spawned in the warm-up)
    /// does not show.
    #[arg(long)]
    pub(super) spawning: bool,
    /// Run the workload this many times interleaved with its baselines,
    /// each run a fresh child process, and report the ratios pair by pair
    /// with their median (w1 and w1-sat).
    #[arg(long)]
    pub(super) pairs: Option<usize>,
    /// With --pairs: the `limits` anchor's binary, to interleave
    /// `tcp-mux`, `tcp-echo` and `ractor-ask` as well.
    #[arg(long)]
    pub(super) limits: Option<std::path::PathBuf>,
    /// W2 only: how a crashed node is downed — `keep-majority`, the
    /// project's default resolver (Down after the failure timeout plus
    /// `stable_after`, its shards moved after the dead-owner margin), or
    /// `timeout` (timeout downing: Down after the failure timeout plus the
    /// downing timeout, shards moved at once).
    #[arg(long, value_enum, default_value_t = Downing::KeepMajority)]
    pub(super) downing: Downing,
    /// W2 only: which of the three nodes is killed — 2 (the default: not
    /// the coordinator) or 0 (the oldest, the sharding coordinator: its
    /// shards move after a takeover). The two others drive.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub(super) victim: u8,
    /// W4, W2 on durable entities, `w1 --reliable` and `recovery`: the
    /// journal — `embedded` (redb), `fjall` (build with `--features
    /// fjall`, on by default) or `postgres` (a throwaway server; build with
    /// `--features postgres`; W4, W2 and `recovery`). W2 without it runs
    /// the plain ping entity; `recovery` without it runs on redb.
    #[arg(long, value_enum)]
    pub(super) journal: Option<durable::JournalKind>,
    /// With `--journal embedded` (W4, `w1 --reliable`): commit lanes per
    /// node, redb files per node (default 1, the one-file layout); with
    /// `--journal postgres` (W4): the pool's connections per node (default
    /// 4; it commits through one lane); fjall takes no lanes.
    #[arg(long, requires = "journal", value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(super) lanes: Option<u64>,
    /// W4 only: how many (W4, raw appends) pairs to run.
    #[arg(long, default_value_t = 3)]
    pub(super) rounds: usize,
    /// W6 only: the uniform control — every front asks a random back.
    #[arg(long)]
    pub(super) uniform: bool,
    /// W6 only: place shards by traffic (SPEC §13.11) rather than by
    /// count alone.
    #[arg(long)]
    pub(super) by_traffic: bool,
    /// W5 only: run this passivation alone, in this process (with --mix).
    #[arg(long, value_enum, requires = "mix")]
    pub(super) passivation: Option<limit::Passivation>,
    /// W5 only: run this mix alone, in this process (with --passivation).
    #[arg(long, value_enum, requires = "passivation")]
    pub(super) mix: Option<limit::Mix>,
    /// W1 and W1-sat in one process: every pipe under TLS 1.3 (a build with
    /// `--features tls`), the three nodes' certificates from a throwaway CA.
    #[arg(long)]
    pub(super) tls: bool,
    /// W1 and W1-sat in one process: a Prometheus recorder
    /// (metrics-exporter-prometheus, histograms as buckets from 1 µs to
    /// 10 s) installed, so every metric of SPEC §14 is recorded; the run
    /// renders it once at the end.
    #[arg(long)]
    pub(super) prometheus: bool,
    /// W1 and W1-sat in one process: node 0 serves the management endpoint
    /// (a build with `--features management`) and a headless Chromium keeps
    /// its live cluster page open, reading the routes every second, for
    /// the whole run. With --pairs: each round runs the workload with the
    /// page open and without, each a fresh process, and reports the ratios.
    #[arg(long)]
    pub(super) page: bool,
    /// Handoff only: entities in all (node 2 hosts about a third, which
    /// move).
    #[arg(long, default_value_t = 30_000)]
    pub(super) entities: u64,
    /// W2 only: where to write the latency-over-time chart (SVG).
    #[arg(long, default_value = "w2-latency.svg")]
    pub(super) chart: std::path::PathBuf,
    /// W2 only: an open loop instead of closed ones — the two drivers issue
    /// this many asks per second in all, each on its own schedule (as
    /// requests reach a service), whatever the earlier ones are waiting
    /// for; the chart splits the acks between the entities that lived on
    /// the killed node and the rest.
    #[arg(long, value_parser = positive_rate, conflicts_with = "journal")]
    pub(super) offered_rate: Option<f64>,
    /// W1 in one process: plain W1 (300,000 asks), then W1's load
    /// through reliable producers (SPEC §13.17) on a cluster of its own —
    /// `--messages` tells, the window W1's in-flight count — and the ratio
    /// of their rates; with `--journal embedded` the entities are
    /// durable-state ones saving with every message. W2 in one process:
    /// reliable producers on nodes 0 and 1, durable-state entities on a
    /// store the nodes share, node 2 crashed at 30 %; every note's effect
    /// counted.
    #[arg(long)]
    pub(super) reliable: bool,
    /// With `w1 --reliable --journal embedded`: the producers are durable
    /// ones (each send journaled on the node's store before it returns),
    /// each sent to by W1's in-flight count of concurrent callers.
    #[arg(long, requires = "reliable", requires = "journal")]
    pub(super) durable_producer: bool,
    /// Coordinator only: the shard counts of the grid.
    #[arg(long, value_delimiter = ',', default_values_t = [1_024, 4_096, 16_384, 65_536])]
    pub(super) shards: Vec<u32>,
    /// Coordinator only: the region counts of the grid.
    #[arg(long, value_delimiter = ',', default_values_t = [3, 30, 300, 1_000])]
    pub(super) regions: Vec<u32>,
    /// Entities only: the live-entity counts.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000, 10_000, 100_000, 300_000])]
    pub(super) counts: Vec<u64>,
    /// Handoff: instead of the 128-shard measure, one point per count of
    /// entities in the moved shard (three shards, three nodes).
    #[arg(long, value_delimiter = ',')]
    pub(super) per_shard: Vec<u64>,
    /// Recovery only: the journal lengths, in events.
    #[arg(long, value_delimiter = ',', default_values_t = [100, 1_000, 10_000, 100_000, 1_000_000])]
    pub(super) lengths: Vec<u64>,
    /// (entities, internal) measure this one count in this process.
    #[arg(long, hide = true)]
    pub(super) entity_count: Option<u64>,
    /// (entities, internal) with --entity-count: bare ractor actors.
    #[arg(long, hide = true)]
    pub(super) bare: bool,
    /// Coordinator, entities, recovery and `handoff --per-shard`: where to
    /// draw the curves (SVG); none by default. W6: run least-shards and
    /// then placement by traffic, and draw both over time here.
    #[arg(long)]
    pub(super) curve_chart: Option<std::path::PathBuf>,
    /// (multi-process, internal) run as node N of the three.
    #[arg(long, hide = true)]
    pub(super) child: Option<usize>,
    /// (multi-process, internal) the first node's address.
    #[arg(long, hide = true)]
    pub(super) seed: Option<std::net::SocketAddr>,
    /// (multi-process, internal) W3's store for this cluster: none,
    /// memory or file.
    #[arg(long, hide = true, default_value = "none")]
    pub(super) store: String,
}

/// `--offered-rate`: a positive number of asks per second.
fn positive_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate >= 1.0 => Ok(rate),
        _ => Err(format!("not a rate of at least 1 ask per second: {s:?}")),
    }
}
