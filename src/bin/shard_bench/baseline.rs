//! Baseline (a) as a run of the runner: the three nodes' transport alone
//! (`transport.rs`), measured, printed and recorded as the workloads are.

use serde_json::json;

use super::harness::{cpu_time, form_cluster, peak_rss_kib, shares};
use super::transport;

/// Baseline (a): the transport alone (`transport.rs`).
pub(super) async fn run_transport(
    messages: u64,
    in_flight: usize,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster("shard-bench-transport", false).await?;
    let cpu_before = cpu_time();
    let figures = transport::run(&clusters, &shares(messages), in_flight).await?;
    let cpu = cpu_time().saturating_sub(cpu_before);
    let per_sec = figures.acks as f64 / figures.wall.as_secs_f64();
    let cpu_us = cpu.as_secs_f64() * 1e6 / figures.acks.max(1) as f64;
    println!(
        "transport {:>9} acks · missing {} · wrong {} · {per_sec:>8.0} msg/s · {cpu_us:.2} µs CPU/msg · p50 {} p99 {} p99.9 {} max {} µs",
        figures.acks,
        messages - figures.acks,
        figures.wrong,
        figures.latency.value_at_quantile(0.5),
        figures.latency.value_at_quantile(0.99),
        figures.latency.value_at_quantile(0.999),
        figures.latency.max(),
    );
    let json = json!({
        "workload": "transport",
        "in_flight": in_flight,
        "expected_acks": messages,
        "unique_acks": figures.acks,
        "missing_acks": messages - figures.acks,
        "wrong_replies": figures.wrong,
        "failed_requests": figures.failed,
        "wall_ms": figures.wall.as_secs_f64() * 1e3,
        "msgs_per_sec": per_sec,
        "cpu_ms": cpu.as_secs_f64() * 1e3,
        "cpu_us_per_msg": cpu_us,
        "p50_us": figures.latency.value_at_quantile(0.5),
        "p99_us": figures.latency.value_at_quantile(0.99),
        "p999_us": figures.latency.value_at_quantile(0.999),
        "max_us": figures.latency.max(),
        "peak_rss_kib": peak_rss_kib(),
    });
    for cluster in clusters {
        let _ = cluster.shutdown().await;
    }
    Ok((json, figures.acks == messages && figures.wrong == 0))
}
