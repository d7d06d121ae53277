//! W1 and W1-sat: three drivers, one per node, each with its asks in
//! flight (the drivers W3 and W4 run too); W1 under TLS or with a
//! Prometheus recorder; and plain W1 before the reliable run.

use std::sync::Arc;
#[cfg(feature = "tls")]
use std::time::Duration;
use std::time::Instant;

use datum_cluster_sharding::transport::Tls;

use super::harness::{
    self, Node, cpu_time, drive, drive_fresh, join_reports, peak_rss_kib, shards_moved_since,
    shares,
};
use super::nodes::{cluster, stop};
use super::ping::Checks;
use super::reliable;
use super::report::{Progress, Run};

/// W1's drivers on every node.
async fn w1<S: Send + Sync + 'static>(
    nodes: &[Node<S>],
    messages: u64,
    in_flight: usize,
    checks: Arc<Checks>,
) -> Result<Run, Box<dyn std::error::Error>> {
    run_drivers(nodes, messages, in_flight, checks, false).await
}

/// Three drivers, one per node, `in_flight` asks each: W1's, or with
/// `fresh` W3's spawning variant (a new entity per message).
pub(super) async fn run_drivers<S: Send + Sync + 'static, J: Send + Sync + 'static>(
    nodes: &[Node<S, J>],
    messages: u64,
    in_flight: usize,
    checks: Arc<Checks>,
    fresh: bool,
) -> Result<Run, Box<dyn std::error::Error>> {
    let shares = shares(messages);
    let label = if fresh { "w3-spawning" } else { "w1" };
    let _progress = Progress::start(label, checks.clone());
    let cpu_before = cpu_time();
    let start = Instant::now();
    let drivers: Vec<_> = (0..3)
        .map(|d| {
            let system = nodes[d].system.clone();
            if fresh {
                tokio::spawn(drive_fresh(system, d as u32, shares[d], in_flight))
            } else {
                tokio::spawn(drive(system, d as u32, 3, shares[d], in_flight, None))
            }
        })
        .collect();
    let joined = join_reports(drivers).await?;
    let times = (start.elapsed(), cpu_time().saturating_sub(cpu_before));
    let moved = shards_moved_since(nodes, start);
    Ok(Run::from_joined(joined, messages, times, checks, moved))
}

/// What runs beside W1 in its process.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Beside {
    /// Every pipe under TLS 1.3.
    pub(super) tls: bool,
    /// A Prometheus recorder installed.
    pub(super) prometheus: bool,
    /// Node 0's live cluster page open in a headless Chromium.
    pub(super) page: bool,
}

pub(super) async fn run_w1(
    messages: u64,
    in_flight: usize,
    label: &str,
    beside: Beside,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    let Beside {
        tls,
        prometheus,
        page,
    } = beside;
    let recorder = if prometheus {
        // Histograms as buckets (1 µs to 10 s), as the management
        // endpoint exports them.
        let builder = datum_cluster_sharding::telemetry::prometheus_builder();
        Some(builder.install_recorder()?)
    } else {
        None
    };
    let checks = Arc::new(Checks::default());
    let (_certificates, tls) = bench_tls(tls)?;
    let nodes = cluster("shard-bench", &checks, false, &tls).await?;
    let open = open_page(page, &nodes).await?;
    let read_before = open.as_ref().map(|p| p.requests());
    let before = pipe_writes(&nodes);
    let run = w1(&nodes, messages, in_flight, checks).await?;
    let (frames, writes) = pipe_writes(&nodes);
    let page_reads = open
        .as_ref()
        .zip(read_before)
        .map(|(p, before)| p.requests() - before);
    run.print(label);
    if let Some(open) = open {
        open.close().await;
    }
    stop(nodes).await;
    let mut json = run.json();
    // Frames per `write_all` on the pipes during the run (the anchors
    // report the same figure).
    json["frames_per_write"] =
        ((frames - before.0) as f64 / (writes - before.1).max(1) as f64).into();
    json["workload"] = label.into();
    json["in_flight_per_driver"] = in_flight.into();
    json["peak_rss_kib"] = peak_rss_kib().into();
    json["tls"] = (!tls.is_empty()).into();
    if let Some(reads) = page_reads {
        // Requests the endpoint answered during the measured phase.
        json["page_requests"] = reads.into();
    }
    if let Some(recorder) = recorder {
        // One scrape, so the run shows the recorder saw the metrics.
        let text = recorder.render();
        let asks = text
            .lines()
            .filter(|l| l.starts_with("datum_asks_total"))
            .count();
        json["prometheus_bytes"] = text.len().into();
        json["prometheus_ask_series"] = asks.into();
    }
    Ok((json, run.correct()))
}

/// Node 0's page opened in a browser, when `page` asks for it.
#[cfg(feature = "management")]
async fn open_page(
    page: bool,
    nodes: &[Node],
) -> Result<Option<super::page::OpenPage>, Box<dyn std::error::Error>> {
    if !page {
        return Ok(None);
    }
    Ok(Some(super::page::open(&nodes[0]).await?))
}

/// Without the endpoint built in there is no page to open.
#[cfg(not(feature = "management"))]
async fn open_page(
    page: bool,
    _nodes: &[Node],
) -> Result<Option<NoPage>, Box<dyn std::error::Error>> {
    if page {
        return Err("--page needs a build with --features management".into());
    }
    Ok(None)
}

/// The page that a build without the endpoint never opens.
#[cfg(not(feature = "management"))]
pub(super) enum NoPage {}

#[cfg(not(feature = "management"))]
impl NoPage {
    fn requests(&self) -> u64 {
        match *self {}
    }

    async fn close(self) {}
}

/// Plain W1 (300,000 asks), then the reliable run (SPEC §13.17).
pub(super) async fn run_w1_reliable(
    messages: u64,
    in_flight: usize,
    journal: reliable::Store,
) -> Result<(serde_json::Value, bool), Box<dyn std::error::Error>> {
    const PLAIN: u64 = 300_000;
    let checks = Arc::new(Checks::default());
    let nodes = cluster("shard-bench", &checks, false, &[]).await?;
    let plain = w1(&nodes, PLAIN, in_flight, checks).await?;
    plain.print("w1");
    stop(nodes).await;
    let plain_correct = plain.correct();
    let (json, correct) = reliable::run((PLAIN, plain), messages, in_flight, journal).await?;
    Ok((json, correct && plain_correct))
}

/// With `tls`, a throwaway CA's certificates for the three nodes (in a
/// temporary directory, kept while the run reads them) and each node's
/// loaded material; else none.
fn bench_tls(
    tls: bool,
) -> Result<(Option<tempfile::TempDir>, Vec<Tls>), Box<dyn std::error::Error>> {
    if !tls {
        return Ok((None, Vec::new()));
    }
    #[cfg(feature = "tls")]
    {
        use datum_cluster_sharding::transport::generate_test_certificates;
        let dir = tempfile::tempdir()?;
        let day = Duration::from_secs(86_400);
        let configs = generate_test_certificates(dir.path(), &["127.0.0.1"; 3], day)?;
        let tls = configs
            .into_iter()
            .map(Tls::load)
            .collect::<Result<_, _>>()?;
        Ok((Some(dir), tls))
    }
    #[cfg(not(feature = "tls"))]
    Err("--tls needs a build with `--features tls`".into())
}

/// Frames written and `write_all` calls so far, over every node's pipes.
fn pipe_writes<S>(nodes: &[harness::Node<S>]) -> (u64, u64) {
    nodes.iter().fold((0, 0), |(f, w), n| {
        let stats = n.cluster.transport().stats();
        (f + stats.frames_written, w + stats.writes)
    })
}
