//! The metrics a two-node cluster records through the `metrics` facade,
//! read off a recorder installed before the nodes start (process-wide, so
//! installed by one test only), against what the nodes' own APIs say; and
//! the ask latency as Prometheus gets it, from a recorder of the other
//! test's own thread.

use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::telemetry;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

#[path = "../protocols/counter.rs"]
mod counter;
use counter::{Add, Counter, CounterEntity, Get};

const LONG: Duration = Duration::from_secs(20);

/// Naps longer than the asks to it wait.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Nap;

protocol! {
    /// Never answers in time.
    pub protocol Sleepy = "sleepy" {
        ask Nap -> ();
    }
}

struct SleepyEntity;
impl Entity for SleepyEntity {
    type Protocol = Sleepy;
}
impl Handler<Nap> for SleepyEntity {
    async fn handle(&mut self, _: Nap, _: &EntityContext) -> ShardingResult<()> {
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(())
    }
}

/// How long a [`Doze`] takes.
const DOZE: Duration = Duration::from_millis(2);

/// Answered after [`DOZE`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Doze;

protocol! {
    /// Answers in a known time.
    pub protocol Dozy = "dozy" {
        ask Doze -> ();
    }
}

struct DozyEntity;
impl Entity for DozyEntity {
    type Protocol = Dozy;
}
impl Handler<Doze> for DozyEntity {
    async fn handle(&mut self, _: Doze, _: &EntityContext) -> ShardingResult<()> {
        tokio::time::sleep(DOZE).await;
        Ok(())
    }
}

/// Every metric's name, labels and value, at one instant. (Taking a
/// snapshot resets what it read: counters and gauges to 0, histograms
/// emptied; so one snapshot is read for everything, and a gauge counted up
/// and down is the sum of its snapshots.)
struct Taken(Vec<(String, Labels, DebugValue)>);

/// A metric's labels, as (key, value) pairs.
type Labels = Vec<(String, String)>;

fn take(snapshotter: &Snapshotter) -> Taken {
    Taken(
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                let labels = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                (key.name().to_owned(), labels, value)
            })
            .collect(),
    )
}

/// The values of `name` whose labels include every one of `labels`.
fn values<'a>(taken: &'a Taken, name: &str, labels: &[(&str, &str)]) -> Vec<&'a DebugValue> {
    taken
        .0
        .iter()
        .filter(|(n, have, _)| n == name && has_labels(have, labels))
        .map(|(_, _, value)| value)
        .collect()
}

/// Whether `have` includes every one of `labels`.
fn has_labels(have: &Labels, labels: &[(&str, &str)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| have.iter().any(|(hk, hv)| hk == k && hv == v))
}

fn counter_sum(snapshotter: &Taken, name: &str, labels: &[(&str, &str)]) -> u64 {
    values(snapshotter, name, labels)
        .into_iter()
        .map(|v| match v {
            DebugValue::Counter(n) => *n,
            other => panic!("{name}: {other:?} is not a counter"),
        })
        .sum()
}

fn gauge_sum(snapshotter: &Taken, name: &str, labels: &[(&str, &str)]) -> f64 {
    values(snapshotter, name, labels)
        .into_iter()
        .map(|v| match v {
            DebugValue::Gauge(g) => g.into_inner(),
            other => panic!("{name}: {other:?} is not a gauge"),
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clusters_metrics_agree_with_what_its_nodes_say() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this process");

    let config = |seeds| {
        ClusterConfig::builder()
            .cluster_name("metrics-test")
            .secret("metrics-secret")
            .seed_nodes(seeds)
            .build()
    };
    let first = ClusterNode::start(config(vec![])).await.expect("starts");
    let second = ClusterNode::start(config(vec![first.bound_addr()]))
        .await
        .expect("starts");
    let mut systems = Vec::new();
    for node in [&first, &second] {
        node.wait_until(|s| s.up_members().count() == 2, LONG)
            .await
            .expect("two Up");
        let system = ShardedSystem::builder()
            .num_shards(16)
            .passivation_idle_timeout(None)
            .node(node.clone())
            .start()
            .await
            .expect("system");
        system
            .entity_type::<CounterEntity>()
            .register(|_| CounterEntity::default())
            .await
            .expect("registered");
        system
            .entity_type::<SleepyEntity>()
            .register(|_| SleepyEntity)
            .await
            .expect("registered");
        systems.push(system);
    }
    let me = first.bound_addr().to_string();
    let node0 = [("node", me.as_str())];

    // 40 counters, each added to and read from the first node.
    let ids: Vec<String> = (0..40).map(|k| format!("m{k}")).collect();
    for id in &ids {
        let counter = systems[0].entity_ref::<Counter>(id.as_str());
        counter.tell(Add(1)).await.expect("tell");
        assert_eq!(counter.ask(Get, LONG).await, Ok(1));
    }
    let timed_out = systems[0]
        .entity_ref::<Sleepy>("nap")
        .ask(Nap, Duration::from_millis(50))
        .await;
    assert!(
        matches!(timed_out, Err(ShardingError::AskTimeout { .. })),
        "{timed_out:?}"
    );
    systems[0]
        .entity_ref::<Counter>(ids[0].as_str())
        .passivate()
        .await
        .expect("passivate");

    let counter_type = [("entity_type", "counter")];
    let taken = take(&snapshotter);
    let answered = values(&taken, telemetry::ASK_SECONDS, &[counter_type[0], node0[0]]);
    let samples: usize = answered
        .iter()
        .map(|v| match v {
            DebugValue::Histogram(samples) => {
                assert!(
                    samples
                        .iter()
                        .all(|s| s.into_inner() > 0.0 && s.into_inner() < 20.0)
                );
                samples.len()
            }
            other => panic!("{other:?} is not a histogram"),
        })
        .sum();
    assert_eq!(samples, 40, "one latency per answered ask");
    // Registered when the nodes and regions started, by every label value
    // known then, before anything counted them.
    let registered = |name: &str, labels: &[(&str, &str)]| {
        let found = values(&taken, name, labels);
        assert!(!found.is_empty(), "{name} {labels:?} not registered");
    };
    let (stay, down) = (
        [node0[0], ("decision", "stay")],
        [node0[0], ("decision", "down")],
    );
    let leave = [node0[0], ("reason", "graceful_leave")];
    registered(
        telemetry::ASK_FAILURES,
        &[counter_type[0], node0[0], ("kind", "peer_lost")],
    );
    registered(telemetry::REMEMBER_QUEUE, &[]);
    registered(telemetry::REMEMBER_FAILURES, &[]);
    registered(telemetry::SPLIT_BRAIN_DECISIONS, &stay);
    registered(telemetry::SPLIT_BRAIN_DECISIONS, &down);
    registered(telemetry::REBALANCE_ROUNDS, &leave);
    registered(telemetry::SHARD_MOVES, &leave);
    registered(telemetry::REBALANCE_ROUND_SECONDS, &leave);
    let asks = counter_sum(&taken, telemetry::ASKS, &[counter_type[0], node0[0]]);
    assert_eq!(asks, 40, "asks from the first node to counters");
    let timeouts = counter_sum(
        &taken,
        telemetry::ASK_FAILURES,
        &[("entity_type", "sleepy"), ("kind", "ask_timeout")],
    );
    assert_eq!(timeouts, 1);
    let explicit = counter_sum(
        &taken,
        telemetry::PASSIVATIONS,
        &[counter_type[0], ("cause", "explicit")],
    );
    assert_eq!(explicit, 1);
    // Shards: the gauges, summed over both nodes, are what the regions say.
    let hosted: usize = systems.iter().map(|s| s.hosted_shards::<Counter>()).sum();
    assert!(hosted > 0);
    assert_eq!(
        gauge_sum(&taken, telemetry::SHARDS, &counter_type),
        hosted as f64
    );
    // Membership and pipes, in the first node's view.
    let up = gauge_sum(&taken, telemetry::MEMBERS, &[node0[0], ("status", "up")]);
    assert_eq!(up, 2.0);
    assert_eq!(gauge_sum(&taken, telemetry::UNREACHABLE, &node0), 0.0);
    assert_eq!(gauge_sum(&taken, telemetry::PIPES, &node0), 1.0);
    let frames = counter_sum(&taken, telemetry::PIPE_FRAMES, &node0);
    let writes = counter_sum(&taken, telemetry::PIPE_WRITES, &node0);
    assert!(
        writes > 0 && frames >= writes,
        "{frames} frames in {writes} writes"
    );
    // The same frames, by peer (the one pipe), and their bytes.
    let peer = second.bound_addr().to_string();
    let to_second = [node0[0], ("peer", peer.as_str())];
    let peer_frames = counter_sum(&taken, telemetry::PIPE_PEER_FRAMES, &to_second);
    let peer_bytes = counter_sum(&taken, telemetry::PIPE_PEER_BYTES, &to_second);
    assert_eq!(peer_frames, frames);
    assert!(
        peer_bytes > 8 * peer_frames,
        "{peer_bytes} bytes in {peer_frames} frames"
    );

    // From here on, gauges counted up and down are read as the sum of
    // their snapshots (each snapshot resets them).
    let mut sums = Sums::default();
    sums.add(&taken);
    // Live entities: 40 started, one passivated; the gauge reaches 39 once
    // that one stopped.
    let entities = |sums: &Sums| sums.of(telemetry::ENTITIES, &counter_type);
    let deadline = Instant::now() + LONG;
    while entities(&sums) != 39.0 {
        assert!(
            Instant::now() < deadline,
            "{} live entities counted",
            entities(&sums)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        sums.add(&take(&snapshotter));
    }
    let live: usize = systems
        .iter()
        .filter_map(|s| s.shard_region_state::<Counter>())
        .map(|state| state.shards.values().sum::<usize>())
        .sum();
    assert_eq!(live, 39);
    // The buffered gauges are registered with the region (and sampled
    // every 5 s by the control task): nothing waits in the buffers now.
    let deadline = Instant::now() + LONG;
    let buffered = loop {
        let taken = take(&snapshotter);
        sums.add(&taken);
        let found = values(&taken, telemetry::BUFFERED, &[counter_type[0], node0[0]]);
        if !found.is_empty() {
            break gauge_sum(&taken, telemetry::BUFFERED, &[counter_type[0], node0[0]]);
        }
        assert!(Instant::now() < deadline, "no buffered gauge sampled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(buffered, 0.0);

    // The first node downs the second (alive: their pipe is up until the
    // first marks it down), and the pipe is gone.
    let second_system = systems.pop().expect("two");
    let on_second =
        second_system.hosted_shards::<Counter>() + second_system.hosted_shards::<Sleepy>();
    assert!(on_second > 0, "the second node hosts shards");
    first.down(second.self_address()).await.expect("downed");
    let deadline = Instant::now() + LONG;
    while sums.of(telemetry::PIPES, &node0) != 0.0 {
        assert!(
            Instant::now() < deadline,
            "{} pipes counted",
            sums.of(telemetry::PIPES, &node0)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        sums.add(&take(&snapshotter));
    }
    // The coordinator (the first node, the oldest) moved the second's
    // shards, counted as dead-owner rounds.
    let dead_owner = [node0[0], ("reason", "dead_owner")];
    let (mut rounds, mut moves) = (0, 0);
    let deadline = Instant::now() + LONG;
    while moves < on_second as u64 {
        assert!(
            Instant::now() < deadline,
            "{moves} of {on_second} moves counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        let taken = take(&snapshotter);
        sums.add(&taken);
        rounds += counter_sum(&taken, telemetry::REBALANCE_ROUNDS, &dead_owner);
        moves += counter_sum(&taken, telemetry::SHARD_MOVES, &dead_owner);
    }
    assert_eq!(moves, on_second as u64);
    assert!(rounds >= 1);
    // The first node's system shuts down: what its region held leaves the
    // gauges, which end at 0 for it.
    systems[0].shutdown().await;
    sums.add(&take(&snapshotter));
    let here = [counter_type[0], node0[0]];
    assert_eq!(sums.of(telemetry::SHARDS, &here), 0.0);
    assert_eq!(sums.of(telemetry::ENTITIES, &here), 0.0);
    second_system.shutdown().await;
    let _ = first.shutdown().await;
    let _ = second.shutdown().await;
}

/// Gauges counted up and down, as the sums of every snapshot taken.
#[derive(Default)]
struct Sums(Vec<(String, Labels, f64)>);

impl Sums {
    fn add(&mut self, taken: &Taken) {
        for (name, labels, value) in &taken.0 {
            let DebugValue::Gauge(g) = value else {
                continue;
            };
            match self.0.iter_mut().find(|(n, l, _)| n == name && l == labels) {
                Some((_, _, sum)) => *sum += g.into_inner(),
                None => self.0.push((name.clone(), labels.clone(), g.into_inner())),
            }
        }
    }

    fn of(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(n, have, _)| n == name && has_labels(have, labels))
            .map(|(_, _, sum)| sum)
            .sum()
    }
}

/// The ask latency as metrics-exporter-prometheus exports it with the
/// crate's builder: a histogram in seconds whose buckets, sum and count
/// agree with asks that each take [`DOZE`]. The recorder is this thread's,
/// where a current-thread runtime runs every task (the other test's is the
/// process's).
#[tokio::test(flavor = "current_thread")]
async fn the_ask_latency_is_a_histogram_of_seconds_that_agrees_with_the_asks() {
    let recorder = telemetry::prometheus_builder().build_recorder();
    let prometheus = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let system = ShardedSystem::builder().start().await.expect("system");
    system
        .entity_type::<DozyEntity>()
        .register(|_| DozyEntity)
        .await
        .expect("registered");
    let here = [("entity_type", "dozy"), ("node", "local")];
    let seconds = telemetry::ASK_SECONDS;

    // Before any ask: the region's metrics are there, its counters at 0,
    // its latency an empty histogram.
    let before = exported(&prometheus.render());
    for name in [
        telemetry::ASKS,
        telemetry::ASK_FAILURES,
        telemetry::PASSIVATIONS,
    ] {
        let found = of(&before, name, &here);
        assert!(
            !found.is_empty() && found.iter().all(|v| *v == 0.0),
            "{name}: {found:?}"
        );
    }
    for name in [
        telemetry::SHARDS,
        telemetry::ENTITIES,
        telemetry::BUFFERED,
        telemetry::HANDOFF_BUFFERED,
    ] {
        assert!(!of(&before, name, &here).is_empty(), "{name} not exported");
    }
    for name in [telemetry::REMEMBER_QUEUE, telemetry::REMEMBER_FAILURES] {
        assert_eq!(of(&before, name, &[]), [0.0], "{name}");
    }
    assert_eq!(of(&before, &format!("{seconds}_count"), &here), [0.0]);

    const ASKED: usize = 25;
    for i in 0..ASKED {
        let entity = system.entity_ref::<Dozy>(format!("d{}", i % 5));
        entity.ask(Doze, LONG).await.expect("answered");
    }
    let text = prometheus.render();
    assert!(
        text.contains(&format!("# TYPE {seconds} histogram\n")),
        "{text}"
    );
    let after = exported(&text);
    let sum = of(&after, &format!("{seconds}_sum"), &here);
    let count = of(&after, &format!("{seconds}_count"), &here);
    assert_eq!(count, [ASKED as f64], "one sample per answered ask");
    let (sum, count) = (sum[0], count[0]);
    // The buckets, cumulative, by bound: the crate's bounds and +Inf.
    let mut buckets: Vec<(f64, f64)> = after
        .iter()
        .filter(|(n, labels, _)| *n == format!("{seconds}_bucket") && has_labels(labels, &here))
        .map(|(_, labels, value)| {
            let le = labels.iter().find(|(k, _)| k == "le").expect("le");
            (le.1.parse::<f64>().expect("a bound"), *value)
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let bounds: Vec<f64> = buckets.iter().map(|b| b.0).collect();
    assert_eq!(bounds[..bounds.len() - 1], telemetry::SECONDS_BUCKETS);
    assert_eq!(bounds.last(), Some(&f64::INFINITY));
    assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{buckets:?}");
    assert_eq!(buckets.last().unwrap().1, count);
    // Every ask took DOZE at least: none below it; all below 10 s.
    let doze = DOZE.as_secs_f64();
    for (le, n) in &buckets {
        if *le < doze {
            assert_eq!(*n, 0.0, "an ask under {le} s: {buckets:?}");
        }
    }
    let under_10_s = buckets.iter().find(|(le, _)| *le == 10.0).unwrap().1;
    assert_eq!(under_10_s, count, "{buckets:?}");
    // The sum lies between the samples' buckets' bounds.
    let (mut low, mut high, mut below) = (0.0, 0.0, (0.0, 0.0));
    for &(le, n) in &buckets {
        let samples = n - below.1;
        if samples > 0.0 {
            low += below.0 * samples;
            high += le * samples;
        }
        below = (le, n);
    }
    assert!(
        low <= sum && sum <= high,
        "sum {sum} s outside {low}..{high}"
    );
    let mean = sum / count;
    assert!(
        mean >= doze && mean < 0.5,
        "mean {mean} s for asks of {doze} s"
    );
    system.shutdown().await;
}

/// A Prometheus text's samples: name, labels, value.
fn exported(text: &str) -> Vec<(String, Labels, f64)> {
    text.lines()
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("a value");
            let (name, labels) = match series.split_once('{') {
                Some((name, labels)) => (name, labels.trim_end_matches('}')),
                None => (series, ""),
            };
            let labels = labels
                .split(',')
                .filter(|label| !label.is_empty())
                .map(|label| {
                    let (k, v) = label.split_once('=').expect("key=value");
                    (k.to_owned(), v.trim_matches('"').to_owned())
                })
                .collect();
            (name.to_owned(), labels, value.parse().expect("a number"))
        })
        .collect()
}

/// The values of the samples of `name` whose labels include `labels`.
fn of(samples: &[(String, Labels, f64)], name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    samples
        .iter()
        .filter(|(n, have, _)| n == name && has_labels(have, labels))
        .map(|(_, _, value)| *value)
        .collect()
}
