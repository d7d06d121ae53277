//! The limit in the same sitting: the workload and its baselines run
//! interleaved, each as a fresh child process (A B C D E, A B C D E, …), at
//! the same in-flight count, and reported pair by pair as ratios with their
//! median. The baselines: (a) this project's transport with no sharding
//! (`shard-bench transport`), (b) `limits tcp-mux`, the ceiling of a pipe
//! here, (c) `limits tcp-echo`, a plain careful batched-CBOR pipe, (d)
//! `limits ractor-ask`, ractor's own ask round trip — (b) to (d) only when
//! `--limits` names the anchor's binary (`../shared/anchors/limits`, built
//! on its own). (b) and (d) together are BENCHMARK.md's measure of a
//! message's parts: one pipe and one actor hop; the sharded run's CPU per
//! message over their sum is reported per round.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

/// One run's figures as its JSON record gives them.
#[derive(Clone, Debug)]
struct Figures {
    msgs_per_sec: f64,
    cpu_us_per_msg: f64,
    p99_us: f64,
}

fn figures(record: &Value) -> Option<Figures> {
    Some(Figures {
        msgs_per_sec: record["msgs_per_sec"].as_f64()?,
        cpu_us_per_msg: record["cpu_us_per_msg"].as_f64()?,
        p99_us: record["p99_us"].as_f64().unwrap_or(f64::NAN),
    })
}

/// Runs `program args`, returning the JSON record on its last stdout line.
pub fn run(program: &Path, args: &[String]) -> Result<Value, String> {
    let out = Command::new(program)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", program.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().rev().find(|l| l.starts_with('{'));
    let record: Value = last
        .and_then(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| format!("{} {args:?}: no JSON record", program.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {args:?} failed ({}): {record}",
            program.display(),
            out.status
        ));
    }
    Ok(record)
}

/// One round: the sharded run, then the baselines in `interleave`'s order
/// (transport, tcp-mux, tcp-echo, ractor-ask); `None` where a run did not
/// happen or failed.
type Row = [Option<Figures>; 5];

/// The sharded run's CPU per message over the sum of `tcp-mux`'s and
/// `ractor-ask`'s in the same round (NaN without all three).
fn cpu_over_parts(row: &Row) -> f64 {
    match (&row[0], &row[2], &row[4]) {
        (Some(ours), Some(pipe), Some(actor)) => {
            ours.cpu_us_per_msg / (pipe.cpu_us_per_msg + actor.cpu_us_per_msg)
        }
        _ => f64::NAN,
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// A child run's arguments: `workload` with its message and in-flight
/// counts.
fn workload_args(workload: &str, messages: u64, in_flight: usize) -> Vec<String> {
    vec![
        workload.to_owned(),
        "--messages".into(),
        messages.to_string(),
        "--in-flight".into(),
        in_flight.to_string(),
    ]
}

/// `rounds` interleaved rounds of `workload` and its baselines; prints a
/// table and returns the JSON record and whether every run was correct.
pub fn interleave(
    workload: &str,
    messages: u64,
    in_flight: usize,
    rounds: usize,
    limits: Option<&Path>,
) -> Result<(Value, bool), String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let ours_args = workload_args(workload, messages, in_flight);
    let mut transport_args = ours_args.clone();
    transport_args[0] = "transport".into();
    let limit_args = |which: &str| {
        vec![
            which.to_owned(),
            "--messages".into(),
            messages.to_string(),
            "--concurrency".into(),
            in_flight.to_string(),
        ]
    };
    let names = ["sharded", "transport", "tcp-mux", "tcp-echo", "ractor-ask"];
    let mut table: Vec<Row> = Vec::new();
    let mut records = Vec::new();
    let mut correct = true;
    for round in 1..=rounds {
        eprintln!(
            "round {round}/{rounds}: {workload}, transport{}",
            if limits.is_some() {
                ", tcp-mux, tcp-echo, ractor-ask"
            } else {
                ""
            }
        );
        let mut row: Row = [None, None, None, None, None];
        let mut row_records = serde_json::Map::new();
        for (i, name) in names.iter().enumerate() {
            let result = match (i, limits) {
                (0, _) => run(&me, &ours_args),
                (1, _) => run(&me, &transport_args),
                (_, Some(limits)) => run(limits, &limit_args(name)),
                (_, None) => continue,
            };
            match result {
                Ok(record) => {
                    if i < 2 && record["missing_acks"].as_u64() != Some(0) {
                        correct = false;
                    }
                    row[i] = figures(&record);
                    if row[i].is_none() {
                        eprintln!("{name}: a record without its figures: {record}");
                        correct = false;
                    }
                    row_records.insert((*name).into(), record);
                }
                Err(error) => {
                    eprintln!("{error}");
                    correct = false;
                }
            }
        }
        records.push(Value::Object(row_records));
        table.push(row);
    }
    let ratio = |row: &Row, j: usize| match (&row[0], &row[j]) {
        (Some(a), Some(b)) => a.msgs_per_sec / b.msgs_per_sec,
        _ => f64::NAN,
    };
    let cpu_ratio = |row: &Row, j: usize| match (&row[0], &row[j]) {
        (Some(a), Some(b)) => a.cpu_us_per_msg / b.cpu_us_per_msg,
        _ => f64::NAN,
    };
    let show = |f: &Option<Figures>| {
        f.as_ref().map_or("—".to_owned(), |f| {
            format!("{:>8.0} {:>5.2}", f.msgs_per_sec, f.cpu_us_per_msg)
        })
    };
    println!(
        "{workload} at {in_flight} in flight, {messages} messages; msg/s and CPU µs/msg per run, then the sharded run's throughput as a fraction of each baseline"
    );
    println!(
        "round | {:>14} | {:>14} | {:>14} | {:>14} | {:>14} | ÷ transport | ÷ tcp-mux | ÷ tcp-echo | CPU ÷ tcp-mux | CPU ÷ (tcp-mux + ractor-ask)",
        names[0], names[1], names[2], names[3], names[4]
    );
    for (r, row) in table.iter().enumerate() {
        println!(
            "{:>5} | {:>14} | {:>14} | {:>14} | {:>14} | {:>14} | {:>11.2} | {:>9.2} | {:>10.2} | {:>13.2} | {:>28.2}",
            r + 1,
            show(&row[0]),
            show(&row[1]),
            show(&row[2]),
            show(&row[3]),
            show(&row[4]),
            ratio(row, 1),
            ratio(row, 2),
            ratio(row, 3),
            cpu_ratio(row, 2),
            cpu_over_parts(row),
        );
    }
    let medians = [1, 2, 3].map(|j| median(table.iter().map(|row| ratio(row, j)).collect()));
    let cpu_median = median(table.iter().map(|row| cpu_ratio(row, 2)).collect());
    let parts_median = median(table.iter().map(cpu_over_parts).collect());
    let p99_median = median(
        table
            .iter()
            .filter_map(|row| row[0].as_ref().map(|f| f.p99_us))
            .collect(),
    );
    println!(
        "median |{:>83}| {:>11.2} | {:>9.2} | {:>10.2} | {:>13.2} | {:>28.2}   (sharded p99 median {p99_median:.0} µs)",
        "", medians[0], medians[1], medians[2], cpu_median, parts_median
    );
    let json = json!({
        "workload": format!("{workload}-pairs"),
        "in_flight": in_flight,
        "messages": messages,
        "rounds": records,
        "median_ratio_to_transport": medians[0],
        "median_ratio_to_tcp_mux": medians[1],
        "median_ratio_to_tcp_echo": medians[2],
        "median_cpu_ratio_to_tcp_mux": cpu_median,
        "median_cpu_ratio_to_tcp_mux_plus_ractor_ask": parts_median,
        "median_p99_us": p99_median,
    });
    Ok((json, correct))
}

/// `rounds` pairs of `workload` run with `flag` and plain, each a fresh
/// child process, at the same in-flight count, in alternating order (A B,
/// B A, …); the A run's throughput and CPU per message over the B run's,
/// pair by pair, with their medians over the pairs whose runs both gave
/// figures. `proof` names a figure of the A run's record that must be
/// above zero (what the flag adds did happen during it). Correct when every
/// run answered every ask and every A run shows its proof.
pub fn against_plain(
    workload: &str,
    (flag, proof): (&str, &str),
    messages: u64,
    in_flight: usize,
    rounds: usize,
) -> Result<(Value, bool), String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let plain = workload_args(workload, messages, in_flight);
    let mut with = plain.clone();
    with.push(flag.to_owned());
    let mut correct = true;
    let mut pairs = Vec::new();
    let mut records = Vec::new();
    for round in 1..=rounds {
        let order = if round % 2 == 1 { [0, 1] } else { [1, 0] };
        eprintln!(
            "pair {round}/{rounds}: {workload} {}",
            if order[0] == 0 {
                format!("{flag}, then plain")
            } else {
                format!("plain, then {flag}")
            }
        );
        let mut pair = [None, None];
        let mut both = Vec::new();
        for i in order {
            let args = if i == 0 { &with } else { &plain };
            match run(&me, args) {
                Ok(record) => {
                    if record["missing_acks"].as_u64() != Some(0) {
                        correct = false;
                    }
                    if i == 0 && record[proof].as_u64().is_none_or(|n| n == 0) {
                        eprintln!("{workload} {flag}: no {proof} during the run: {record}");
                        correct = false;
                    } else {
                        pair[i] = figures(&record);
                    }
                    both.push(record);
                }
                Err(error) => {
                    eprintln!("{error}");
                    correct = false;
                }
            }
        }
        records.push(Value::Array(both));
        pairs.push(pair);
    }
    let ratios = |f: fn(&Figures) -> f64| -> Vec<f64> {
        pairs
            .iter()
            .map(|[a, b]| match (a, b) {
                (Some(a), Some(b)) => f(a) / f(b),
                _ => f64::NAN,
            })
            .collect()
    };
    let throughput = ratios(|f| f.msgs_per_sec);
    let cpu = ratios(|f| f.cpu_us_per_msg);
    println!(
        "{workload} at {in_flight} in flight, {messages} messages: {flag} over plain, pair by pair"
    );
    println!("pair | msg/s {flag} | msg/s plain | throughput ratio | CPU/msg ratio");
    for (i, [a, b]) in pairs.iter().enumerate() {
        let rate = |f: &Option<Figures>| f.as_ref().map_or(f64::NAN, |f| f.msgs_per_sec);
        println!(
            "{:>4} | {:>11.0} | {:>11.0} | {:>16.3} | {:>13.3}",
            i + 1,
            rate(a),
            rate(b),
            throughput[i],
            cpu[i]
        );
    }
    let (median_throughput, median_cpu) = (median(throughput.clone()), median(cpu.clone()));
    let valid = throughput.iter().filter(|r| r.is_finite()).count();
    println!(
        "median throughput ratio {median_throughput:.3}, CPU per message ratio {median_cpu:.3} ({valid} of {rounds} pairs)"
    );
    let json = json!({
        "workload": format!("{workload}-{}-pairs", flag.trim_start_matches('-')),
        "in_flight": in_flight,
        "messages": messages,
        "rounds": records,
        "throughput_ratios": throughput,
        "cpu_ratios": cpu,
        "median_throughput_ratio": median_throughput,
        "median_cpu_ratio": median_cpu,
        "valid_pairs": valid,
    });
    Ok((json, correct))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_gappy_lists() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(vec![f64::NAN, 5.0]), 5.0);
        assert!(median(Vec::new()).is_nan());
    }

    fn ran(cpu_us_per_msg: f64) -> Option<Figures> {
        Some(Figures {
            msgs_per_sec: 1.0,
            cpu_us_per_msg,
            p99_us: f64::NAN,
        })
    }

    #[test]
    fn cpu_over_the_parts_needs_all_three_runs() {
        let row: Row = [ran(5.2), ran(4.0), ran(2.4), None, ran(1.6)];
        assert!((cpu_over_parts(&row) - 1.3).abs() < 1e-9);
        let without_actor: Row = [ran(5.2), ran(4.0), ran(2.4), None, None];
        assert!(cpu_over_parts(&without_actor).is_nan());
        let without_ours: Row = [None, ran(4.0), ran(2.4), None, ran(1.6)];
        assert!(cpu_over_parts(&without_ours).is_nan());
        let without_pipe: Row = [ran(5.2), ran(4.0), None, ran(3.0), ran(1.6)];
        assert!(cpu_over_parts(&without_pipe).is_nan());
    }
}
