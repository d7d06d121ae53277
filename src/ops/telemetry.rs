//! Metrics through the [`metrics`] facade (SPEC §14): the names and labels
//! this crate records, and the handles each part resolves once.
//!
//! The application installs a recorder (its exporter: Prometheus, StatsD,
//! …) before it starts nodes and systems; without one, every call is a
//! no-op. Handles are resolved when a region, node or transport starts, so
//! a recorder installed later sees only what starts after it.
//!
//! Every metric is registered when the part that records it starts, at 0
//! with every label value known then (a region's entity type and node; a
//! rebalance's reasons; a split-brain decision; the usual ask failures), so
//! an exporter shows 0 from the start rather than nothing until the first
//! event, and a rate over it starts from that 0. Only a pipe's peer is
//! known no sooner than its pipe.
//!
//! The two histograms hold seconds from about a microsecond (a local ask)
//! to seconds. With metrics-exporter-prometheus they are exported as
//! Prometheus histograms with [`SECONDS_BUCKETS`] (`prometheus_builder`):
//! the exporter's default, a summary, estimates its quantiles with a sketch
//! of 32,768 bins at 0.01 % relative error, which spans a ratio of about 700
//! between its smallest and largest sample; below the largest sample / 700,
//! every sample is folded into the lowest bin, so one ask of 100 ms in the
//! window makes the median of a thousand 2 µs asks read 140 µs. Buckets
//! are exact to their bounds and, unlike quantiles, add up across nodes.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

/// Members of the cluster in this node's view, by `status`.
pub const MEMBERS: &str = "datum_cluster_members";
/// Members this node's view holds unreachable.
pub const UNREACHABLE: &str = "datum_cluster_unreachable";
/// Shards an entity type's region hosts on this node.
pub const SHARDS: &str = "datum_sharding_shards";
/// Live entities started by this node's region (counted up at a start,
/// down when an entity stops, however it stops).
pub const ENTITIES: &str = "datum_sharding_entities";
/// Passivations of live entities, by `cause` (idle, limit, explicit).
pub const PASSIVATIONS: &str = "datum_sharding_passivations_total";
/// Asks sent through an `EntityRef` of this node.
pub const ASKS: &str = "datum_asks_total";
/// Asks that failed, by `kind` (the `ShardingError` variant, snake case).
pub const ASK_FAILURES: &str = "datum_ask_failures_total";
/// Seconds from an ask's send to its answer (answered asks only).
pub const ASK_SECONDS: &str = "datum_ask_duration_seconds";
/// Remember-entities records queued and not yet written.
pub const REMEMBER_QUEUE: &str = "datum_remember_queue_depth";
/// Remember-entities records that failed (or were dropped by a full queue).
pub const REMEMBER_FAILURES: &str = "datum_remember_failures_total";
/// Frames the pipes' writers took out of their outboxes.
pub const PIPE_FRAMES: &str = "datum_pipe_frames_total";
/// Batches the pipes' writers wrote (one write each): frames / writes is
/// the frames per write.
pub const PIPE_WRITES: &str = "datum_pipe_writes_total";
/// Pipes established now.
pub const PIPES: &str = "datum_pipes";
/// Frames written to one peer (label `peer`: its address), all channels.
pub const PIPE_PEER_FRAMES: &str = "datum_pipe_peer_frames_total";
/// Bytes written to one peer (label `peer`), frame headers included.
pub const PIPE_PEER_BYTES: &str = "datum_pipe_peer_bytes_total";
/// Messages waiting in a region's buffers (shards without a home yet,
/// behind passivating entities, handoffs), sampled every 5 s.
pub const BUFFERED: &str = "datum_sharding_buffered";
/// The part of [`BUFFERED`] waiting behind handoffs.
pub const HANDOFF_BUFFERED: &str = "datum_sharding_handoff_buffered";
/// Rebalance rounds the coordinator on this node completed, by `reason`
/// (`dead_owner`, `graceful_spread`, `graceful_leave`, `newer_version`,
/// `traffic`).
pub const REBALANCE_ROUNDS: &str = "datum_rebalance_rounds_total";
/// Shards those rounds moved, by `reason`.
pub const SHARD_MOVES: &str = "datum_shard_moves_total";
/// Seconds from a round's decision to the end of its last move (its
/// handoffs), by `reason`.
pub const REBALANCE_ROUND_SECONDS: &str = "datum_rebalance_round_duration_seconds";
/// Split-brain resolver decisions this node took, by `decision`
/// (`stay`: its side stays and it downs the others; `down`: its side, or
/// itself, goes down).
pub const SPLIT_BRAIN_DECISIONS: &str = "datum_split_brain_decisions_total";

/// Bucket bounds, in seconds, of [`ASK_SECONDS`] and
/// [`REBALANCE_ROUND_SECONDS`] with an exporter of fixed buckets: 1, 2.5
/// and 5 in each decade from 1 µs to 10 s (Prometheus's own default
/// buckets, 5 ms to 10 s, carried down to a local ask's microseconds).
pub const SECONDS_BUCKETS: [f64; 22] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A builder of metrics-exporter-prometheus's recorder that exports this
/// crate's histograms as Prometheus histograms with [`SECONDS_BUCKETS`]
/// (the exporter's default would make them summaries, whose quantiles are
/// wrong over this range: see the module's documentation). The
/// application adds its own settings and installs it:
/// `prometheus_builder().install_recorder()`.
#[cfg(any(feature = "management", feature = "cli"))]
pub fn prometheus_builder() -> metrics_exporter_prometheus::PrometheusBuilder {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    [ASK_SECONDS, REBALANCE_ROUND_SECONDS].into_iter().fold(
        PrometheusBuilder::new(),
        |builder, name| {
            builder
                .set_buckets_for_metric(Matcher::Full(name.to_owned()), &SECONDS_BUCKETS)
                .expect("the buckets are not empty")
        },
    )
}

/// The `kind`s of [`ASK_FAILURES`] a region registers at 0 when it starts:
/// how asks fail in a working cluster (as `ShardingError::kind` names
/// them). The others, signs of a bug or a misconfiguration, appear at
/// their first occurrence.
pub(crate) const USUAL_ASK_FAILURES: [&str; 10] = [
    "ask_timeout",
    "peer_lost",
    "entity_stopped",
    "entity_panicked",
    "handler",
    "shutting_down",
    "shut_down_in_flight",
    "handler_interrupted",
    "buffer_overflow",
    "persistence",
];

/// The `reason`s of the rebalance metrics (as the coordinator names its
/// rounds' reasons).
pub(crate) const REBALANCE_REASONS: [&str; 5] = [
    "dead_owner",
    "graceful_spread",
    "graceful_leave",
    "newer_version",
    "traffic",
];

/// One entity type's region's handles (labels `entity_type`, `node`).
/// Its gauges move by what this region adds and takes away, so two regions
/// with the same labels (two systems of one node) add up; what a region
/// still holds when it stops is taken away then ([`RegionMetrics::release`]).
pub(crate) struct RegionMetrics {
    entity_type: &'static str,
    node: String,
    shards: Gauge,
    entities: Gauge,
    /// This region's part of the two gauges, and whether it has stopped.
    held: [AtomicI64; 2],
    released: AtomicBool,
    /// By `PassivationCause` (idle, limit, explicit).
    pub(crate) passivations: [Counter; 3],
    pub(crate) asks: Counter,
    ask_seconds: Histogram,
    /// The asks as counted for the load figures.
    load: AskLoad,
    /// Sampled every 5 s (`BUFFERED`, `HANDOFF_BUFFERED`).
    pub(crate) buffered: Gauge,
    pub(crate) handoff_buffered: Gauge,
}

impl RegionMetrics {
    /// `node`: the node's address, or `local` for a system without one.
    pub(crate) fn new(entity_type: &'static str, node: String) -> Self {
        let labels = |more: Option<(&'static str, &'static str)>| {
            let mut labels = vec![
                metrics::Label::new("entity_type", entity_type),
                metrics::Label::new("node", node.clone()),
            ];
            labels.extend(more.map(|(k, v)| metrics::Label::new(k, v)));
            labels
        };
        let passivation = |cause| counter!(PASSIVATIONS, labels(Some(("cause", cause))));
        for kind in USUAL_ASK_FAILURES {
            counter!(ASK_FAILURES, labels(Some(("kind", kind)))).increment(0);
        }
        // Per process (the sum over the systems' write-behind queues), so
        // registered by every region, remembered or not.
        gauge!(REMEMBER_QUEUE).increment(0.0);
        counter!(REMEMBER_FAILURES).increment(0);
        RegionMetrics {
            entity_type,
            shards: gauge!(SHARDS, labels(None)),
            entities: gauge!(ENTITIES, labels(None)),
            held: Default::default(),
            released: AtomicBool::new(false),
            passivations: [
                passivation("idle"),
                passivation("limit"),
                passivation("explicit"),
            ],
            asks: counter!(ASKS, labels(None)),
            ask_seconds: histogram!(ASK_SECONDS, labels(None)),
            buffered: gauge!(BUFFERED, labels(None)),
            handoff_buffered: gauge!(HANDOFF_BUFFERED, labels(None)),
            load: AskLoad::default(),
            node,
        }
    }

    /// `n` (±) shards hosted here.
    pub(crate) fn shards(&self, n: i64) {
        self.held_by(0, n);
    }

    /// `n` (±) entity actors running here.
    pub(crate) fn entities(&self, n: i64) {
        self.held_by(1, n);
    }

    fn held_by(&self, which: usize, n: i64) {
        if self.released.load(Ordering::Acquire) {
            return; // (a stop notice after the region stopped)
        }
        self.held[which].fetch_add(n, Ordering::AcqRel);
        [&self.shards, &self.entities][which].increment(n as f64);
    }

    /// The region stopped: what it still counted in leaves the gauges, and
    /// nothing it does later counts.
    pub(crate) fn release(&self) {
        if self.released.swap(true, Ordering::AcqRel) {
            return;
        }
        for (held, gauge) in self.held.iter().zip([&self.shards, &self.entities]) {
            gauge.decrement(held.swap(0, Ordering::AcqRel) as f64);
        }
        self.buffered.set(0.0);
        self.handoff_buffered.set(0.0);
    }

    /// An ask sent at `sent` was answered: counts it in its latency bucket
    /// and records its latency (one clock read for both).
    pub(crate) fn ask_answered(&self, sent: tokio::time::Instant) {
        let took = sent.elapsed();
        self.load.answered(took);
        self.ask_seconds.record(took.as_secs_f64());
    }

    /// An ask failed with `kind` (rare: looked up each time).
    pub(crate) fn ask_failed(&self, kind: &'static str) {
        self.load.failed(kind);
        counter!(ASK_FAILURES, "entity_type" => self.entity_type, "node" => self.node.clone(), "kind" => kind)
            .increment(1);
    }

    /// The asks sent through this region since it started, as counted.
    pub(crate) fn ask_counts(&self) -> AskCounts {
        self.load.counts()
    }
}

/// [`SECONDS_BUCKETS`] in nanoseconds.
const BUCKET_NANOS: [u64; 22] = {
    let mut nanos = [0; 22];
    let mut i = 0;
    while i < 22 {
        // (Rounded: 2.5e-6 * 1e9 is not exactly 2,500 in binary.)
        nanos[i] = (SECONDS_BUCKETS[i] * 1e9 + 0.5) as u64;
        i += 1;
    }
    nanos
};

/// One region's asks, counted where the `metrics` hooks record them:
/// whatever recorder is installed, or none. What the load figures of
/// `cluster_sharding_stats` and the live page come from.
#[derive(Default)]
struct AskLoad {
    /// Answered asks by latency: `answered[i]` those above bucket `i - 1`
    /// and at most bucket `i` of [`SECONDS_BUCKETS`]; the last, those above
    /// its last bound.
    answered: [AtomicU64; SECONDS_BUCKETS.len() + 1],
    /// Failed asks by kind (rare: under a lock).
    failed: std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl AskLoad {
    fn answered(&self, took: std::time::Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let bucket = BUCKET_NANOS.partition_point(|bound| *bound < nanos);
        self.answered[bucket].fetch_add(1, Ordering::Relaxed);
    }

    fn failed(&self, kind: &'static str) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        *failed.entry(kind).or_insert(0) += 1;
    }

    fn counts(&self) -> AskCounts {
        AskCounts {
            answered: (self.answered.iter())
                .map(|n| n.load(Ordering::Relaxed))
                .collect(),
            failed: (self.failed.lock().unwrap_or_else(|p| p.into_inner()).iter())
                .map(|(kind, n)| ((*kind).to_owned(), *n))
                .collect(),
        }
    }
}

/// The asks one node sent to an entity type since its region started
/// (through its `EntityRef`s, wherever the entities live), as
/// [`ClusterShardingStats::asks`](crate::sharding::ClusterShardingStats::asks)
/// gathers them: the same asks `datum_ask_duration_seconds` and
/// `datum_ask_failures_total` count on that node (SPEC §14.1).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AskCounts {
    /// Answered asks by latency: `answered[i]`, for `i` below
    /// [`SECONDS_BUCKETS`]`.len()`, counts those that took more than bucket
    /// `i - 1` and at most `SECONDS_BUCKETS[i]` seconds; the last entry,
    /// those above 10 s.
    pub answered: Vec<u64>,
    /// Failed asks by kind (`ShardingError::kind`).
    pub failed: std::collections::BTreeMap<String, u64>,
}

impl AskCounts {
    /// Every answered ask.
    pub fn answered_total(&self) -> u64 {
        self.answered.iter().sum()
    }

    /// Every failed ask.
    pub fn failed_total(&self) -> u64 {
        self.failed.values().sum()
    }
}

/// The transport's handles (label `node`: its address).
pub(crate) struct PipeMetrics {
    node: String,
    pub(crate) frames: Counter,
    pub(crate) writes: Counter,
    pub(crate) pipes: Gauge,
}

impl PipeMetrics {
    pub(crate) fn new(node: String) -> Self {
        PipeMetrics {
            frames: counter!(PIPE_FRAMES, "node" => node.clone()),
            writes: counter!(PIPE_WRITES, "node" => node.clone()),
            pipes: gauge!(PIPES, "node" => node.clone()),
            node,
        }
    }

    /// One pipe's handles: frames and bytes written to `peer`.
    pub(crate) fn peer(&self, peer: std::net::SocketAddr) -> PeerMetrics {
        let labels = || {
            [
                metrics::Label::new("node", self.node.clone()),
                metrics::Label::new("peer", peer.to_string()),
            ]
        };
        PeerMetrics {
            frames: counter!(PIPE_PEER_FRAMES, labels().to_vec()),
            bytes: counter!(PIPE_PEER_BYTES, labels().to_vec()),
        }
    }
}

/// One pipe's handles, counted once per batch written.
pub(crate) struct PeerMetrics {
    pub(crate) frames: Counter,
    pub(crate) bytes: Counter,
}

/// Registers node `node`'s metrics of rare events at 0, by every label
/// value: the rebalance rounds of the coordinator it may come to run, and
/// its split-brain decisions.
pub(crate) fn node_started(node: &str) {
    for reason in REBALANCE_REASONS {
        let labels = || [("node", node.to_owned()), ("reason", reason.to_owned())];
        counter!(REBALANCE_ROUNDS, &labels()).increment(0);
        counter!(SHARD_MOVES, &labels()).increment(0);
        // (A histogram without samples: exported with its count at 0.)
        let _ = histogram!(REBALANCE_ROUND_SECONDS, &labels());
    }
    for decision in ["stay", "down"] {
        split_brain_decisions(node, decision, 0);
    }
}

/// Records the rounds the coordinator on node `node` completed.
pub(crate) fn rebalance_round(node: &str, reason: &'static str, moves: usize, seconds: f64) {
    let labels = || [("node", node.to_owned()), ("reason", reason.to_owned())];
    counter!(REBALANCE_ROUNDS, &labels()).increment(1);
    counter!(SHARD_MOVES, &labels()).increment(moves as u64);
    histogram!(REBALANCE_ROUND_SECONDS, &labels()).record(seconds);
}

/// Records `n` split-brain resolver decisions (`decision`: `stay` or
/// `down`) taken on node `node`.
pub(crate) fn split_brain_decisions(node: &str, decision: &'static str, n: u64) {
    counter!(SPLIT_BRAIN_DECISIONS, "node" => node.to_owned(), "decision" => decision).increment(n);
}

/// Sets node `node`'s members-by-status gauges (every status, so one that
/// empties reads 0) and its unreachable count.
pub(crate) fn members(node: &str, by_status: &[(&'static str, usize)], unreachable: usize) {
    for (status, n) in by_status {
        gauge!(MEMBERS, "node" => node.to_owned(), "status" => *status).set(*n as f64);
    }
    gauge!(UNREACHABLE, "node" => node.to_owned()).set(unreachable as f64);
}

/// A W3C trace context (`traceparent`'s fields): what a traced message
/// carries to another node (SPEC §14.2), 26 bytes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The trace, shared by every span of it.
    pub trace_id: [u8; 16],
    /// The span the message was sent in: the receiver's span's parent.
    pub span_id: [u8; 8],
    /// W3C trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TraceContext {
    /// The length of [`to_bytes`](Self::to_bytes).
    pub const WIRE_LEN: usize = 26;

    /// The wire form: version 0, the trace id, the span id, the flags
    /// (W3C `traceparent`'s binary order).
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut out = [0u8; Self::WIRE_LEN];
        out[1..17].copy_from_slice(&self.trace_id);
        out[17..25].copy_from_slice(&self.span_id);
        out[25] = self.flags;
        out
    }

    /// Reads the wire form; `None` for another length or version, or the
    /// all-zero ids W3C calls invalid.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != Self::WIRE_LEN || bytes[0] != 0 {
            return None;
        }
        let context = TraceContext {
            trace_id: bytes[1..17].try_into().ok()?,
            span_id: bytes[17..25].try_into().ok()?,
            flags: bytes[25],
        };
        let valid = context.trace_id != [0; 16] && context.span_id != [0; 8];
        valid.then_some(context)
    }
}

/// How this crate's spans join the application's traces: the application
/// implements it over its tracing system (with `tracing-opentelemetry`:
/// `examples/tracing_otel.rs`) and sets it in
/// [`ShardingConfig::tracing`](crate::ShardingConfig::tracing).
pub trait TracePropagation: Send + Sync + 'static {
    /// The context of `span` (an ask's or tell's span on the sender's
    /// node), to send with the message; `None` sends none.
    fn context_of(&self, span: &tracing::Span) -> Option<TraceContext>;

    /// Makes `parent`, received with a message, the parent of `span` (the
    /// receiving node's span of that message).
    fn set_parent(&self, span: &tracing::Span, parent: TraceContext);
}

/// Tracing across nodes, on (SPEC §14.2): the propagation that turns spans
/// into trace contexts and back.
#[derive(Clone)]
pub struct Tracing(pub(crate) std::sync::Arc<dyn TracePropagation>);

impl Tracing {
    /// Tracing through `propagation`.
    pub fn new(propagation: impl TracePropagation) -> Self {
        Tracing(std::sync::Arc::new(propagation))
    }

    pub(crate) fn propagation(&self) -> &dyn TracePropagation {
        &*self.0
    }
}

impl std::fmt::Debug for Tracing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tracing(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn an_answered_ask_falls_in_the_bucket_of_its_upper_bound() {
        assert_eq!(BUCKET_NANOS[..4], [1_000, 2_500, 5_000, 10_000]);
        assert_eq!(BUCKET_NANOS[21], 10_000_000_000);
        let load = AskLoad::default();
        for took in [
            Duration::ZERO,
            Duration::from_nanos(1_000),
            Duration::from_nanos(2_500),
            Duration::from_nanos(2_501),
            Duration::from_secs(10),
            Duration::from_secs(11),
        ] {
            load.answered(took);
        }
        load.failed("ask_timeout");
        load.failed("ask_timeout");
        let counts = load.counts();
        let mut expected = vec![0; 23];
        expected[0] = 2; // 0 and 1 µs: at most the first bound
        expected[1] = 1; // 2.5 µs exactly
        expected[2] = 1; // just above it
        expected[21] = 1; // 10 s exactly
        expected[22] = 1; // above the last bound
        assert_eq!(counts.answered, expected);
        assert_eq!(counts.answered_total(), 6);
        assert_eq!(counts.failed.get("ask_timeout"), Some(&2));
        assert_eq!(counts.failed_total(), 2);
    }
}
