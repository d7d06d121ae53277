//! W3: W1 without a store, then remembered in the in-memory store and in
//! the file store (`Always`), with what each store cost: CPU per message,
//! the failures it reported, and the flush after the run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{FileStore, FileStoreFsyncPolicy};
use serde_json::json;

use super::harness::{Node, peak_rss_kib};
use super::nodes::{cluster, remembered_cluster, stop};
use super::ping::Checks;
use super::report::Run;
use super::w1::run_drivers;

/// What a remembered run cost its store.
struct StoreCost {
    /// Failure events (records dropped by a full queue, or failed).
    failures: usize,
    /// How long the flush after the run took (the writer catching up).
    flush: Duration,
}

/// W1 (or its spawning variant) on remembered nodes, counting the store's
/// failure events and timing the flush after it.
async fn remembered_run<S: RememberEntitiesStore>(
    nodes: &[Node<S>],
    messages: u64,
    spawn: bool,
    checks: Arc<Checks>,
) -> Result<(Run, StoreCost), Box<dyn std::error::Error>> {
    let mut events = Vec::new();
    for n in nodes {
        events.push(n.system.subscribe_remember_entities_events()?);
    }
    let run = run_drivers(nodes, messages, 16, checks, spawn).await?;
    let flushed = Instant::now();
    for n in nodes {
        // A flush that reports failures still waited for the writer.
        let _ = n.system.flush_remember_entities().await;
    }
    let flush = flushed.elapsed();
    let mut failures = 0;
    for e in &mut events {
        loop {
            match e.try_recv() {
                Ok(_) => failures += 1,
                // Events this subscriber missed were failures too.
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(n)) => {
                    failures += n as usize;
                }
                Err(_) => break,
            }
        }
    }
    Ok((run, StoreCost { failures, flush }))
}

pub(super) async fn run_w3(
    messages: u64,
    spawn: bool,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let mut results = Vec::new();
    let mut ok = true;
    // What a remembered run's records cost the store: failures reported (a
    // full queue drops records) and, for the file store, whether the writer
    // kept up by the end (the flush after the run).
    let mut dropped: Vec<(&str, usize)> = Vec::new();
    let mut flushes: Vec<(&str, Duration)> = Vec::new();
    {
        let checks = Arc::new(Checks::default());
        let nodes = cluster("shard-bench-w3a", &checks, false, &[]).await?;
        let run = run_drivers(&nodes, messages, 16, checks, spawn).await?;
        run.print("no store");
        ok &= run.correct();
        results.push(("none", run));
        stop(nodes).await;
    }
    {
        let checks = Arc::new(Checks::default());
        let nodes = remembered_cluster("shard-bench-w3b", InMemoryStore::new(), &checks).await?;
        let (run, store) = remembered_run(&nodes, messages, spawn, checks).await?;
        dropped.push(("in_memory", store.failures));
        flushes.push(("in_memory", store.flush));
        run.print("in-memory");
        ok &= run.correct();
        results.push(("in_memory", run));
        stop(nodes).await;
    }
    {
        let checks = Arc::new(Checks::default());
        // Removed when dropped, on every path out.
        let dir = tempfile::Builder::new()
            .prefix("shard-bench-w3-")
            .tempdir()?;
        let store = Arc::new(FileStore::open(dir.path(), FileStoreFsyncPolicy::Always)?);
        let nodes = remembered_cluster("shard-bench-w3c", store, &checks).await?;
        let (run, store) = remembered_run(&nodes, messages, spawn, checks).await?;
        dropped.push(("file_always", store.failures));
        flushes.push(("file_always", store.flush));
        run.print("file (Always)");
        ok &= run.correct();
        results.push(("file_always", run));
        stop(nodes).await;
    }
    let base = results[0].1.cpu.as_secs_f64() / results[0].1.acks.max(1) as f64;
    let workload = if spawn { "w3-spawning" } else { "w3" };
    let mut json = json!({ "workload": workload, "peak_rss_kib": peak_rss_kib() });
    for (name, run) in &results {
        let per = run.cpu.as_secs_f64() / run.acks.max(1) as f64;
        let mut r = run.json();
        r["cpu_increase_pct"] = ((per / base - 1.0) * 100.0).into();
        if let Some((_, n)) = dropped.iter().find(|(d, _)| d == name) {
            r["store_failures"] = (*n).into();
        }
        if let Some((_, f)) = flushes.iter().find(|(d, _)| d == name) {
            r["flush_after_ms"] = (f.as_secs_f64() * 1e3).into();
        }
        json[*name] = r;
    }
    Ok((json, ok))
}
