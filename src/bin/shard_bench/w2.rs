//! W2: one node killed at 30 % of the acks while the two others drive
//! (closed loops, or an open loop at an offered rate), on the ping entity
//! or a durable one: the Down, the rehoming, and the latency chart.

use std::sync::Arc;
use std::time::{Duration, Instant};

use datum_cluster_sharding::membership::MembershipEvent;
use datum_cluster_sharding::prelude::*;
use serde_json::json;
use tokio::sync::Mutex;

use super::args::Downing;
use super::harness::{
    Answered, ENTITIES, Node, cpu_time, drive, drive_open, entities_hosted_on, join_reports,
    peak_rss_kib, shards_moved_since,
};
use super::nodes::{cluster, stop};
use super::ping::Checks;
use super::report::{Progress, Run};
use super::{chart, durable};

/// The chart's interval.
const W2_INTERVAL: Duration = Duration::from_millis(20);

/// How a W2 run goes: the downing, the node killed, the chart, and the
/// open loop's rate (closed loops without one).
#[derive(Clone, Copy)]
pub(super) struct W2Shape<'a> {
    pub(super) downing: Downing,
    pub(super) victim_index: usize,
    pub(super) chart_path: &'a std::path::Path,
    pub(super) offered_rate: Option<f64>,
}

/// W2 on the ping entity, or with `journal` on the durable one (and its
/// checks after the run: `durable::check_w2`).
pub(super) async fn run_w2(
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
    let stores = durable::Stores::new(kind, None)?;
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
