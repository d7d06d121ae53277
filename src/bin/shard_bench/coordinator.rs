//! How the coordinator's costs grow with shards and regions: the real
//! coordinator core, driven directly (no pipes, no actors) through the
//! library's hidden `ScaleProbe`, on a grid of shard counts × regions.
//!
//! Per point: the time of a first placement decision (a region's `GetHome`
//! for a shard with no home; the core places it and tells every region),
//! of an answer for a shard already placed, of `poll_timeout` (the driver
//! asks it after every event), of one more region joining, and of the
//! rebalance round that follows; the bytes of the core's table of the
//! type (its per-shard vectors and per-owner counts). SPEC §13b.

use std::path::Path;
use std::time::{Duration, Instant};

use datum_cluster_sharding::sharding::coordinator::scale::ScaleProbe;
use serde_json::{Value, json};

use super::curve_chart::{Panel, Series, draw};

/// One point of the grid.
struct Point {
    shards: u32,
    regions: u32,
    place_us: f64,
    messages_per_place: f64,
    known_us: f64,
    messages_per_known: f64,
    poll_us: f64,
    join_us: f64,
    round_us: f64,
    round_moves: usize,
    table_kib: f64,
}

fn measure(shards: u32, regions: u32) -> Result<Point, String> {
    let t0 = Instant::now();
    let mut probe = ScaleProbe::new(t0, regions, shards);
    if !probe.ready(t0) {
        return Err(format!("the core does not allocate ({shards} × {regions})"));
    }
    let started = Instant::now();
    let mut sent = 0usize;
    for shard in 0..shards {
        sent += probe.get_home(t0, shard);
    }
    let place = started.elapsed();
    let table_kib = probe.table_bytes() as f64 / 1024.0;

    let samples = shards.min(10_000);
    let step = (shards / samples).max(1);
    let started = Instant::now();
    let mut answers = 0usize;
    for i in 0..samples {
        answers += probe.get_home(t0, i * step);
    }
    let known = started.elapsed();

    let polls = 200;
    let started = Instant::now();
    for _ in 0..polls {
        std::hint::black_box(probe.poll_timeout());
    }
    let poll = started.elapsed();

    let started = Instant::now();
    std::hint::black_box(probe.join(t0));
    let join = started.elapsed();

    probe.tick(t0);
    // The next rebalance round is the next thing the core waits for.
    let at = probe
        .poll_timeout()
        .ok_or("the core waits for no rebalance round")?;
    let started = Instant::now();
    let round_moves = probe.tick(at);
    let round = started.elapsed();

    let per = |d: Duration, n: u32| d.as_secs_f64() * 1e6 / f64::from(n.max(1));
    Ok(Point {
        shards,
        regions,
        place_us: per(place, shards),
        messages_per_place: sent as f64 / f64::from(shards.max(1)),
        known_us: per(known, samples),
        messages_per_known: answers as f64 / f64::from(samples.max(1)),
        poll_us: per(poll, polls),
        join_us: per(join, 1),
        round_us: per(round, 1),
        round_moves,
        table_kib,
    })
}

/// Runs the grid, prints a table, draws the chart at `chart` if given, and
/// returns the JSON record.
pub fn run(shards: &[u32], regions: &[u32], chart: Option<&Path>) -> Result<(Value, bool), String> {
    let mut points = Vec::new();
    println!(
        "{:>7} {:>7} {:>11} {:>9} {:>10} {:>10} {:>10} {:>12} {:>6} {:>10}",
        "shards",
        "regions",
        "place µs",
        "msgs",
        "known µs",
        "poll µs",
        "join µs",
        "round µs",
        "moves",
        "table KiB"
    );
    for &s in shards {
        for &r in regions {
            let p = measure(s, r)?;
            println!(
                "{:>7} {:>7} {:>11.2} {:>9.0} {:>10.3} {:>10.1} {:>10.1} {:>12.1} {:>6} {:>10.0}",
                p.shards,
                p.regions,
                p.place_us,
                p.messages_per_place,
                p.known_us,
                p.poll_us,
                p.join_us,
                p.round_us,
                p.round_moves,
                p.table_kib
            );
            points.push(p);
        }
    }
    if let Some(path) = chart {
        let series = |value: fn(&Point) -> f64| -> Vec<Series> {
            regions
                .iter()
                .map(|&r| Series {
                    label: format!("{r} regions"),
                    points: points
                        .iter()
                        .filter(|p| p.regions == r)
                        .map(|p| (f64::from(p.shards), value(p)))
                        .collect(),
                })
                .collect()
        };
        let panel = |title: &str, y: &str, value: fn(&Point) -> f64| Panel {
            title: title.into(),
            x_label: "shards".into(),
            y_label: y.into(),
            series: series(value),
        };
        draw(
            path,
            &[
                panel("A first placement", "µs per decision", |p| p.place_us),
                panel("poll_timeout, after every event", "µs per call", |p| {
                    p.poll_us
                }),
                panel("A rebalance round after a join", "µs per round", |p| {
                    p.round_us
                }),
            ],
        )
        .map_err(|e| format!("drawing {}: {e}", path.display()))?;
        eprintln!("shard-bench: chart written to {}", path.display());
    }
    let json = json!({
        "workload": "coordinator",
        "points": points.iter().map(|p| json!({
            "shards": p.shards,
            "regions": p.regions,
            "place_us": p.place_us,
            "messages_per_place": p.messages_per_place,
            "known_us": p.known_us,
            "messages_per_known": p.messages_per_known,
            "poll_us": p.poll_us,
            "join_us": p.join_us,
            "round_us": p.round_us,
            "round_moves": p.round_moves,
            "table_kib": p.table_kib,
        })).collect::<Vec<_>>(),
    });
    // Every placement told at least the region that asked, and every
    // answer for a placed shard told it alone.
    let correct = points
        .iter()
        .all(|p| p.messages_per_place >= 1.0 && p.messages_per_known == 1.0);
    Ok((json, correct))
}
