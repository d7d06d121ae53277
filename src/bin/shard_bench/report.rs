//! What a run reports: one run's figures with their table line and JSON
//! record, the live progress line on stderr, and the exit code of a parent
//! run.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::json;

use super::harness;
use super::ping::Checks;

/// One run's figures.
pub(super) struct Run {
    pub(super) acks: u64,
    pub(super) expected: u64,
    pub(super) retries: u64,
    pub(super) wall: Duration,
    pub(super) cpu: Duration,
    pub(super) latency: Histogram<u64>,
    pub(super) checks: Arc<Checks>,
    /// The messages that took more than one attempt.
    pub(super) retried: std::collections::HashSet<(u32, u64)>,
    /// Shards the coordinator moved while the clock ran.
    pub(super) moved: usize,
}

impl Run {
    pub(super) fn from_joined(
        joined: harness::Joined,
        expected: u64,
        times: (Duration, Duration),
        checks: Arc<Checks>,
        moved: usize,
    ) -> Run {
        Run {
            acks: joined.acks,
            expected,
            retries: joined.retries,
            wall: times.0,
            cpu: times.1,
            latency: joined.latency,
            checks,
            retried: joined.retried,
            moved,
        }
    }

    pub(super) fn json(&self) -> serde_json::Value {
        json!({
            "expected_acks": self.expected,
            "unique_acks": self.acks,
            "missing_acks": self.expected - self.acks,
            "duplicate_processings": self.checks.duplicate_processings.load(Ordering::Relaxed),
            "order_violations": self.checks.order_violations.load(Ordering::Relaxed),
            "unexplained_violations": self.checks.unexplained(&self.retried),
            "retries": self.retries,
            "shards_moved": self.moved,
            "wall_ms": self.wall.as_secs_f64() * 1e3,
            "msgs_per_sec": self.acks as f64 / self.wall.as_secs_f64(),
            "p50_us": self.latency.value_at_quantile(0.50),
            "p99_us": self.latency.value_at_quantile(0.99),
            "p999_us": self.latency.value_at_quantile(0.999),
            "max_us": self.latency.max(),
            "cpu_ms": self.cpu.as_secs_f64() * 1e3,
            "cpu_us_per_msg": self.cpu.as_secs_f64() * 1e6 / self.acks.max(1) as f64,
        })
    }

    pub(super) fn print(&self, label: &str) {
        println!(
            "{label:<14} {:>9} acks · missing {} · dup {} · order {} · retries {} · {:>8.0} msg/s · {:.2} µs CPU/msg · p50 {} p99 {} p99.9 {} max {} µs",
            self.acks,
            self.expected - self.acks,
            self.checks.duplicate_processings.load(Ordering::Relaxed),
            self.checks.order_violations.load(Ordering::Relaxed),
            self.retries,
            self.acks as f64 / self.wall.as_secs_f64(),
            self.cpu.as_secs_f64() * 1e6 / self.acks.max(1) as f64,
            self.latency.value_at_quantile(0.50),
            self.latency.value_at_quantile(0.99),
            self.latency.value_at_quantile(0.999),
            self.latency.max(),
        );
    }

    /// Whether the correctness counters hold: every ack came, and no
    /// message that was not retried was handled twice or out of order
    /// (BENCHMARK.md counts those of retried messages apart).
    pub(super) fn correct(&self) -> bool {
        self.acks == self.expected && self.checks.unexplained(&self.retried) == 0
    }
}

/// A live line on stderr while a run goes: messages the entities have
/// handled so far and the rate over the last second. Stops when dropped.
pub(super) struct Progress(tokio::task::JoinHandle<()>);

impl Progress {
    pub(super) fn start(label: &'static str, checks: Arc<Checks>) -> Self {
        Progress(tokio::spawn(async move {
            let mut last = checks.processed();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.tick().await;
            loop {
                tick.tick().await;
                let now = checks.processed();
                eprint!("\r{label}: {now:>9} handled · {:>8} msg/s   ", now - last);
                last = now;
            }
        }))
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.abort();
        eprintln!();
    }
}

/// Prints a parent run's JSON record and exits 0, 1 if a run was not
/// correct, 2 if one could not run.
pub(super) fn exit_with(result: Result<(serde_json::Value, bool), String>) -> ExitCode {
    match result {
        Ok((json, correct)) => {
            println!("{json}");
            ExitCode::from(if correct { 0 } else { 1 })
        }
        Err(error) => {
            eprintln!("shard-bench: {error}");
            ExitCode::from(2)
        }
    }
}
