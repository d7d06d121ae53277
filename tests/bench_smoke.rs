//! The benchmark runner at a small size, so a regression in delivery or in
//! the harness fails CI: every workload exits 0 and its JSON record shows
//! no missing ack. No timing is asserted.

use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A run that takes longer than this is a hang (a 20,000-message run takes
/// seconds; a message is given up after 60 s of retries).
const HANG: Duration = Duration::from_secs(300);

/// One run at a time: each is three nodes on two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn run(workload: &str) -> serde_json::Value {
    run_with(workload, &[])
}

fn run_with(workload: &str, extra: &[&str]) -> serde_json::Value {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (out_path, err_path) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_shard-bench"))
        .args([workload, "--messages", "20000"])
        .args(extra)
        .stdout(Stdio::from(
            std::fs::File::create(&out_path).expect("a file"),
        ))
        .stderr(Stdio::from(
            std::fs::File::create(&err_path).expect("a file"),
        ))
        .spawn()
        .expect("shard-bench runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{workload} {extra:?} still running after {HANG:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    assert!(
        status.success(),
        "{workload} failed: {stdout}\n{}",
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
    let last = stdout.lines().last().expect("a JSON line");
    serde_json::from_str(last).expect("the last line is JSON")
}

fn no_missing(record: &serde_json::Value) {
    assert_eq!(record["missing_acks"], 0, "{record}");
    assert_eq!(record["unique_acks"], record["expected_acks"], "{record}");
}

#[test]
fn w1_and_w1_sat_deliver_every_ack_in_order() {
    for workload in ["w1", "w1-sat"] {
        let record = run(workload);
        no_missing(&record);
        // Only a retried message may be handled twice or late.
        assert_eq!(record["unexplained_violations"], 0, "{record}");
        if record["retries"] == 0 {
            assert_eq!(record["order_violations"], 0, "{record}");
            assert_eq!(record["duplicate_processings"], 0, "{record}");
        }
    }
}

#[test]
fn w2_rehomes_every_affected_entity_with_no_missing_ack() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    for downing in ["keep-majority", "timeout"] {
        let chart = dir.path().join(format!("w2-{downing}.svg"));
        let chart_arg = chart.to_str().expect("a UTF-8 path");
        let record = run_with("w2", &["--downing", downing, "--chart", chart_arg]);
        no_missing(&record);
        assert!(
            record["affected_entities"].as_u64().unwrap() > 0,
            "{record}"
        );
        assert_eq!(record["affected_not_asked_after_kill"], 0, "{record}");
        assert!(record["rehomed_ms"].is_number(), "{record}");
        // The chart: an SVG with the three latency series, and the
        // intervals it was drawn from in the record.
        let svg = std::fs::read_to_string(&chart).expect("the chart was written");
        assert!(svg.starts_with("<svg") && svg.contains("p99"), "{downing}");
        let intervals = record["intervals"].as_array().expect("intervals");
        let acked: u64 = intervals.iter().map(|i| i[1].as_u64().unwrap()).sum();
        assert_eq!(acked, record["unique_acks"].as_u64().unwrap(), "{record}");
    }
}

#[test]
fn w2_open_loop_splits_the_acks_between_the_killed_nodes_entities_and_the_rest() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let chart = dir.path().join("w2-open.svg");
    let chart_arg = chart.to_str().expect("a UTF-8 path");
    let extra = [
        "--downing",
        "timeout",
        "--offered-rate",
        "10000",
        "--chart",
        chart_arg,
    ];
    let record = run_with("w2", &extra);
    no_missing(&record);
    assert_eq!(record["unexplained_violations"], 0, "{record}");
    assert_eq!(record["offered_rate"], 10000.0, "{record}");
    // The others kept being answered through the outage.
    let during = record["unaffected_acks_per_s_during_outage"]
        .as_f64()
        .unwrap();
    assert!(during > 0.0, "{record}");
    assert!(
        record["affected_longest_wait_ms"].as_f64().unwrap() > 0.0,
        "{record}"
    );
    let svg = std::fs::read_to_string(&chart).expect("the chart was written");
    assert!(svg.contains("entities on the killed node") && svg.contains("the other entities"));
}

#[test]
fn w3_runs_without_store_and_with_both_stores() {
    let record = run("w3");
    for store in ["none", "in_memory", "file_always"] {
        no_missing(&record[store]);
    }
}

#[test]
fn w4_reports_a_ratio_to_raw_appends_on_every_journal() {
    for journal in ["embedded", "fjall", "postgres"] {
        let record = run_with("w4", &["--journal", journal, "--rounds", "1"]);
        no_missing(&record);
        assert_eq!(record["journal"], journal, "{record}");
        assert_eq!(record["unexplained_violations"], 0, "{record}");
        let ratio = record["median_ratio_to_raw"].as_f64().expect("a ratio");
        assert!(ratio > 0.0 && ratio.is_finite(), "{record}");
        // Every acknowledged ping was one event, and group commit put
        // them into fewer commits than events.
        let round = &record["rounds"][0];
        assert_eq!(round["raw"]["events"], 20000, "{record}");
        let commits = record["commits"].as_u64().expect("commits");
        assert!(commits > 0 && commits < 20000, "{record}");
    }
}

#[test]
fn w2_on_a_journal_loses_no_acknowledged_event() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let chart = dir.path().join("w2.svg");
    let chart_arg = chart.to_str().expect("a UTF-8 path");
    let record = run_with("w2", &["--journal", "embedded", "--chart", chart_arg]);
    no_missing(&record);
    assert!(
        record["affected_entities"].as_u64().unwrap() > 0,
        "{record}"
    );
    let durable = &record["durable"];
    assert_eq!(durable["acked_not_journaled"], 0, "{record}");
    assert_eq!(durable["journaled_twice_unretried"], 0, "{record}");
    assert_eq!(durable["count_not_journal"], 0, "{record}");
    assert!(
        durable["journaled_events"].as_u64().unwrap() >= 20000,
        "{record}"
    );
}

#[test]
fn w1_in_three_processes_reports_every_node() {
    let record = run_with("w1", &["--mode", "multi-process"]);
    no_missing(&record);
    assert_eq!(record["mode"], "multi-process", "{record}");
    let nodes = record["nodes"].as_array().expect("per-node figures");
    assert_eq!(nodes.len(), 3, "{record}");
    for node in nodes {
        assert!(
            node["process"]["peak_rss_kib"].as_u64().unwrap() > 0,
            "{record}"
        );
    }
}

#[test]
fn the_transport_baseline_and_interleaved_pairs_report_ratios() {
    let record = run("transport");
    no_missing(&record);
    assert_eq!(record["wrong_replies"], 0, "{record}");
    // One round of W1 and baseline (a), each its own process (no --limits
    // here: the anchor is built apart from this crate).
    let pairs = run_with("w1", &["--pairs", "1"]);
    let ratio = pairs["median_ratio_to_transport"]
        .as_f64()
        .expect("a ratio");
    assert!(ratio > 0.0, "{pairs}");
    let round = &pairs["rounds"][0];
    assert_eq!(round["sharded"]["missing_acks"], 0, "{pairs}");
    assert_eq!(round["transport"]["missing_acks"], 0, "{pairs}");
}

#[test]
fn w2_and_w3_run_in_three_processes() {
    // W2: node 2's process is SIGKILLed at 30%; the two others rehome its
    // entities and miss no ack.
    let record = run_with("w2", &["--mode", "multi-process", "--downing", "timeout"]);
    no_missing(&record);
    assert_eq!(record["mode"], "multi-process", "{record}");
    assert!(
        record["affected_entities"].as_u64().unwrap() > 0,
        "{record}"
    );
    assert_eq!(record["affected_not_asked_after_kill"], 0, "{record}");
    assert!(record["rehomed_ms"].is_number(), "{record}");
    assert_eq!(
        record["nodes"].as_array().map(Vec::len),
        Some(2),
        "{record}"
    );
    // W3: three clusters of three processes, one per store.
    let record = run_with("w3", &["--mode", "multi-process"]);
    for store in ["none", "in_memory", "file_always"] {
        no_missing(&record[store]);
        assert_eq!(
            record[store]["nodes"].as_array().map(Vec::len),
            Some(3),
            "{record}"
        );
    }
}

#[test]
fn w5_runs_under_a_limit_and_idle_only() {
    // One child per (policy, mix) would be eight runs; one of each kind
    // keeps CI short: the limit's default policy on the scan mix, and
    // idle-only on the Zipf mix.
    for (passivation, mix) in [("w-tiny-lfu", "scan"), ("idle", "zipf")] {
        let record = run_with("w5", &["--passivation", passivation, "--mix", mix]);
        assert_eq!(record["failed_asks"], 0, "{record}");
        let (hit, asks) = (record["hit_rate"].as_f64(), record["asks"].as_u64());
        assert!(hit.is_some_and(|h| (0.0..1.0).contains(&h)), "{record}");
        assert!(asks > Some(19_000), "{record}");
        if passivation != "idle" {
            // Three regions, each under its limit.
            let (live, limit) = (
                record["live_at_end"].as_u64(),
                record["limit_per_region"].as_u64(),
            );
            assert!(
                live.zip(limit).is_some_and(|(l, m)| l > 0 && l <= 3 * m),
                "{record}"
            );
        }
    }
}

/// The handoff measure at 3,000 entities: every moved entity answers with
/// its state under migration (the run exits 1 otherwise), and without it
/// they answer too.
#[test]
fn handoff_moves_every_state_with_migration_and_none_without() {
    let record = run_with("handoff", &["--entities", "3000"]);
    let migrated = &record["migration"];
    assert!(migrated["entities_moved"].as_u64() > Some(0), "{record}");
    assert_eq!(
        migrated["answered_with_state"], migrated["entities_moved"],
        "{record}"
    );
    assert!(migrated["bytes_moved"].as_u64() > Some(0), "{record}");
    assert_eq!(record["factory"]["bytes_moved"], 0, "{record}");
}

#[test]
fn reliable_w1_and_w2_take_effect_once_per_message() {
    // W1 through reliable producers, the table in memory and on the
    // embedded store, and durable producers (plain W1 runs first in the
    // same process).
    for extra in [
        &["--reliable"][..],
        &["--reliable", "--journal", "embedded"],
        &["--reliable", "--journal", "embedded", "--durable-producer"],
    ] {
        let record = run_with("w1", extra);
        assert_eq!(record["handled"], record["messages"], "{record}");
        assert_eq!(record["duplicate_processings"], 0, "{record}");
        assert_eq!(record["order_violations"], 0, "{record}");
        assert!(record["ratio_to_plain"].as_f64().unwrap() > 0.0, "{record}");
    }
    // W2's kill under reliable producers and durable-state entities.
    let record = run_with("w2", &["--reliable"]);
    assert_eq!(record["missing_effects"], 0, "{record}");
    assert_eq!(record["extra_effects"], 0, "{record}");
    assert_eq!(record["duplicate_processings"], 0, "{record}");
    assert_eq!(record["effects"], 20_000, "{record}");
}

#[test]
fn the_coordinator_grid_places_every_shard_and_draws_its_curves() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let chart = dir.path().join("coordinator.svg");
    let chart = chart.to_str().expect("a UTF-8 path");
    let record = run_with(
        "coordinator",
        &[
            "--shards",
            "256,1024",
            "--regions",
            "3,10",
            "--curve-chart",
            chart,
        ],
    );
    let points = record["points"].as_array().expect("points");
    assert_eq!(points.len(), 4, "{record}");
    for point in points {
        // Each placement tells every region (the asker included).
        assert_eq!(
            point["messages_per_place"].as_f64(),
            point["regions"].as_f64(),
            "{record}"
        );
        assert!(point["place_us"].as_f64() > Some(0.0), "{record}");
        // A placed shard's answer goes to the asker alone.
        assert_eq!(point["messages_per_known"].as_f64(), Some(1.0), "{record}");
        // A newcomer with no shard is given some in the round after it.
        assert!(point["round_moves"].as_u64() > Some(0), "{record}");
    }
    let svg = std::fs::read_to_string(chart).expect("the chart was written");
    assert!(
        svg.contains("<svg") && svg.contains("10 regions"),
        "{svg:.200}"
    );
}

#[test]
fn the_entities_curve_makes_every_entity_live_and_measures_it_and_a_bare_actor() {
    let record = run_with("entities", &["--counts", "200,1000"]);
    let points = record["points"].as_array().expect("points");
    assert_eq!(points.len(), 2, "{record}");
    for point in points {
        let sharded = &point["sharded"];
        assert_eq!(sharded["live"], point["entities"], "{record}");
        assert_eq!(sharded["missing"], 0, "{record}");
        assert!(sharded["asks_per_sec"].as_f64() > Some(0.0), "{record}");
        assert!(sharded["bytes_per_entity"].as_f64() > Some(0.0), "{record}");
        assert!(
            point["bare"]["bytes_per_actor"].as_f64() > Some(0.0),
            "{record}"
        );
    }
}

#[test]
fn the_recovery_curve_recovers_every_event_replayed_and_from_a_snapshot() {
    let record = run_with("recovery", &["--lengths", "100,2000"]);
    let points = record["points"].as_array().expect("points");
    assert_eq!(points.len(), 2, "{record}");
    for point in points {
        // The snapshotted count includes the offset its snapshot holds: the
        // recovery started from the snapshot, not from the first event.
        assert_eq!(point["counted_all"], true, "{record}");
        assert!(point["replay_ms"].as_f64() > Some(0.0), "{record}");
    }
}

/// W1 with node 0's cluster page open in a headless Chromium: every ask
/// answered, and the record says how many requests the page made.
#[test]
fn w1_runs_with_the_cluster_page_open_in_a_browser() {
    let found = Command::new("sh")
        .args(["-c", "command -v chromium"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: --page needs chromium (Debian: apt-get install chromium)");
        return;
    }
    let record = run_with("w1", &["--page"]);
    assert_eq!(record["missing_acks"], 0, "{record}");
    assert!(record["page_requests"].as_u64().is_some(), "{record}");
}

#[test]
fn the_handoff_curve_moves_every_entity_of_the_shard_with_its_state() {
    let record = run_with("handoff", &["--per-shard", "50,300"]);
    let points = record["points"].as_array().expect("points");
    assert_eq!(points.len(), 2, "{record}");
    for point in points {
        assert!(point["entities_moved"].as_u64() > Some(0), "{record}");
        assert_eq!(
            point["answered_with_state"], point["entities_moved"],
            "{record}"
        );
        assert!(point["bytes_moved"].as_u64() > Some(0), "{record}");
        assert!(point["timer_late_max_ms"].as_f64() >= Some(0.0), "{record}");
    }
}

#[test]
fn w6_counts_the_front_to_back_asks_that_stay_on_one_node() {
    for uniform in [false, true] {
        let extra: &[&str] = if uniform { &["--uniform"] } else { &[] };
        let record = run_with("w6", extra);
        assert_eq!(record["asks"], 20000, "{record}");
        assert_eq!(record["failed_asks"], 0, "{record}");
        let on_node = record["on_node_fraction"].as_f64().expect("a fraction");
        assert!(on_node > 0.0 && on_node < 1.0, "{record}");
        // Random backs over three nodes' even shares of the shards: about
        // a third stay on one node.
        if uniform {
            assert!((0.25..0.42).contains(&on_node), "{record}");
        }
        assert_eq!(record["shards_moved"], 0, "{record}");
        let series = record["on_node_over_time"].as_array().expect("a series");
        let asks: u64 = series.iter().map(|i| i["asks"].as_u64().unwrap()).sum();
        assert_eq!(asks, 20000, "every answered ask in one interval: {record}");
    }
}

#[test]
fn w6_with_a_chart_runs_both_placements_and_draws_them() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let chart = dir.path().join("w6.svg");
    let chart_arg = chart.to_str().expect("a UTF-8 path");
    let records = run_with("w6", &["--curve-chart", chart_arg]);
    let records = records.as_array().expect("one record per placement");
    let placements: Vec<&str> = records
        .iter()
        .map(|r| r["placement"].as_str().expect("a placement"))
        .collect();
    assert_eq!(placements, ["least-shards", "traffic"]);
    for record in records {
        assert_eq!(record["asks"], 20000, "{record}");
        assert_eq!(record["failed_asks"], 0, "{record}");
        let series = record["on_node_over_time"].as_array().expect("a series");
        assert!(
            series.iter().all(|i| i["asks_per_sec"].as_f64().is_some()),
            "{record}"
        );
    }
    let svg = std::fs::read_to_string(&chart).expect("the chart is written");
    assert!(svg.contains("<svg") && svg.contains("traffic"), "{svg}");
}
