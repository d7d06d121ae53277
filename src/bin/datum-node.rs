//! `datum-node`: one cluster node as an OS process.
//!
//! Joins (or forms) a cluster from command-line flags or `DATUM_*`
//! environment variables and prints one JSON object per line on stdout for
//! every membership event this node publishes. Logs go to stderr. SIGTERM or
//! Ctrl-C makes the node leave gracefully and exit 0. See `SPEC.md` §10c.
//!
//! The node runs on a current-thread runtime: the event subscription is taken
//! before the membership driver first runs, so no event is missed, and one
//! thread is plenty for heartbeats and gossip.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::identity::UniqueAddress;
use datum_cluster_sharding::membership::{MemberStatus, MembershipEvent};
use tokio::sync::broadcast::error::RecvError;

/// Exit code when the node could not start (bind failure, refused config).
const EXIT_START_FAILED: u8 = 1;
/// Exit code when the cluster downed or removed this node without it asking.
const EXIT_STOPPED_BY_CLUSTER: u8 = 3;
/// Exit code when the graceful leave did not complete in time.
const EXIT_LEAVE_TIMED_OUT: u8 = 4;

/// Longest accepted duration flag (one hour), so no clock arithmetic overflows.
const MAX_MS: u64 = 3_600_000;

/// Smallest accepted `--max-frame`: a membership gossip must fit.
const MIN_FRAME: usize = 4 * 1024;

/// Runs one cluster node and prints its membership events as JSON lines.
#[derive(Debug, Parser)]
#[command(
    name = "datum-node",
    version,
    about = "Runs one datum cluster node and prints its membership events as JSON lines on stdout.",
    after_help = "Every flag can also be set by the environment variable shown. Logs go to stderr \
(RUST_LOG, default `warn`). SIGTERM or Ctrl-C: leave gracefully, exit 0.\n\
Exit codes: 0 left gracefully; 1 could not start (bind failure, refused configuration); \
2 bad flags; 3 downed or removed by the cluster; 4 the graceful leave did not complete in time."
)]
struct Args {
    /// Name of the cluster; nodes with another name are refused.
    #[arg(long, env = "DATUM_CLUSTER_NAME", value_parser = non_empty)]
    cluster_name: String,

    /// Address to listen on. Port 0 picks a free port (printed in the
    /// `started` line).
    #[arg(long, env = "DATUM_BIND", default_value = "127.0.0.1:0")]
    bind: SocketAddr,

    /// Address peers dial to reach this node, when it differs from --bind
    /// (needed when binding 0.0.0.0).
    #[arg(long, env = "DATUM_ADVERTISE")]
    advertise: Option<SocketAddr>,

    /// Comma-separated addresses of nodes to join through. None: form a new
    /// cluster alone.
    #[arg(long, env = "DATUM_SEEDS", value_parser = seed_list, default_value = "")]
    seeds: SeedList,

    /// Shared secret every node of the cluster must know (never sent).
    #[arg(long, env = "DATUM_SECRET", hide_env_values = true, value_parser = non_empty)]
    secret: String,

    /// Heartbeat interval, in milliseconds.
    #[arg(long, env = "DATUM_HEARTBEAT_MS", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    heartbeat_ms: u64,

    /// How long past a missed heartbeat a peer may stay silent before it is
    /// marked unreachable, in milliseconds.
    #[arg(long, env = "DATUM_PAUSE_MS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    pause_ms: u64,

    /// How long an unreachable member stays so before the leader downs it,
    /// in milliseconds; `off` for manual downing only.
    #[arg(long, env = "DATUM_DOWNING_MS", default_value = "200", value_parser = downing)]
    downing_ms: Downing,

    /// Largest frame accepted on a pipe, in bytes.
    #[arg(long, env = "DATUM_MAX_FRAME", default_value_t = datum_cluster_sharding::wire::DEFAULT_MAX_FRAME_LEN,
          value_parser = max_frame)]
    max_frame: usize,
}

/// The seed addresses (a newtype so clap takes the whole list as one value).
#[derive(Clone, Debug)]
struct SeedList(Vec<SocketAddr>);

/// The downing timeout, or `None` for manual downing.
#[derive(Clone, Copy, Debug)]
struct Downing(Option<Duration>);

fn non_empty(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        Err("must not be empty".into())
    } else {
        Ok(s.to_owned())
    }
}

fn seed_list(s: &str) -> Result<SeedList, String> {
    let mut seeds = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let addr = part
            .parse()
            .map_err(|e| format!("`{part}` is not an IP:port address ({e})"))?;
        seeds.push(addr);
    }
    Ok(SeedList(seeds))
}

fn downing(s: &str) -> Result<Downing, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(Downing(None));
    }
    let ms: u64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is neither a number of milliseconds nor `off`"))?;
    if ms > MAX_MS {
        return Err(format!("must be at most {MAX_MS} ms (or `off`)"));
    }
    Ok(Downing(Some(Duration::from_millis(ms))))
}

fn max_frame(s: &str) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of bytes"))?;
    let max = u32::MAX as usize;
    if !(MIN_FRAME..=max).contains(&n) {
        return Err(format!("must be between {MIN_FRAME} and {max} bytes"));
    }
    Ok(n)
}

fn main() -> ExitCode {
    // Exits 2 with clap's message on bad flags; `--help` and `--version` exit 0.
    let args = Args::parse();
    init_logging();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("datum-node: cannot start the async runtime: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    runtime.block_on(run(args))
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

async fn run(args: Args) -> ExitCode {
    let started = Instant::now();
    let mut config = ClusterConfig::builder()
        .cluster_name(args.cluster_name)
        .secret(args.secret)
        .bind_addr(args.bind)
        .seed_nodes(args.seeds.0)
        .heartbeat_interval(Duration::from_millis(args.heartbeat_ms))
        .acceptable_heartbeat_pause(Duration::from_millis(args.pause_ms))
        .downing_timeout(args.downing_ms.0)
        .max_frame_size(args.max_frame)
        .build();
    config.advertised_addr = args.advertise;
    let mut stop = match StopSignals::install() {
        Ok(stop) => stop,
        Err(error) => {
            eprintln!("datum-node: cannot install signal handlers: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    let node = match ClusterNode::start(config).await {
        Ok(node) => node,
        Err(error) => {
            eprintln!("datum-node: cannot start: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    // Subscribe before the first await: on this single-threaded runtime the
    // driver has not run yet, so the stream holds every event.
    let mut events = node.subscribe();
    let mut state = node.watch_state();
    let me = node.self_address();
    emit(&format!(
        r#"{{"event":"started",{},"t_ms":0}}"#,
        member_fields(&me)
    ));

    let mut stopped_by_cluster = false;
    loop {
        tokio::select! {
            () = stop.recv() => break,
            event = events.recv() => match event {
                Ok(event) => emit_event(&event, started),
                Err(RecvError::Lagged(missed)) => {
                    tracing::warn!(missed, "event subscriber lagged; events were lost")
                }
                Err(RecvError::Closed) => {
                    stopped_by_cluster = true;
                    break;
                }
            },
            // The driver drops the state watch when the node stops on its
            // own: downed, or removed without having asked to leave.
            changed = state.changed() => if changed.is_err() {
                stopped_by_cluster = true;
                break;
            },
        }
    }

    if stopped_by_cluster {
        drain(&mut events, started);
        let reason = match node.current_state().self_status() {
            Some(MemberStatus::Down) => "downed",
            _ => "removed",
        };
        node.crash().await; // the driver is gone already; this closes the pipes
        emit(&format!(
            r#"{{"event":"stopped","reason":"{reason}","t_ms":{}}}"#,
            ms_since(started)
        ));
        eprintln!("datum-node: the cluster {reason} this node; it has stopped");
        return ExitCode::from(EXIT_STOPPED_BY_CLUSTER);
    }

    // Graceful leave: keep printing events while the leave goes on.
    let leave = tokio::spawn({
        let node = node.clone();
        async move { node.shutdown().await }
    });
    tokio::pin!(leave);
    let result = loop {
        tokio::select! {
            biased;
            event = events.recv() => if let Ok(event) = event {
                emit_event(&event, started);
            },
            done = &mut leave => break done,
        }
    };
    drain(&mut events, started);
    match result {
        Ok(Ok(())) => {
            emit(&format!(
                r#"{{"event":"stopped","reason":"left","t_ms":{}}}"#,
                ms_since(started)
            ));
            ExitCode::SUCCESS
        }
        Ok(Err(error)) => {
            emit(&format!(
                r#"{{"event":"stopped","reason":"leave_timed_out","t_ms":{}}}"#,
                ms_since(started)
            ));
            eprintln!("datum-node: the graceful leave did not complete: {error}");
            ExitCode::from(EXIT_LEAVE_TIMED_OUT)
        }
        Err(error) => {
            eprintln!("datum-node: the leave task failed: {error}");
            ExitCode::from(EXIT_LEAVE_TIMED_OUT)
        }
    }
}

/// SIGTERM and Ctrl-C (SIGINT), listened for from start-up on.
struct StopSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers; from now on these signals no longer kill the
    /// process but are reported by [`StopSignals::recv`].
    fn install() -> std::io::Result<StopSignals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(StopSignals {
                term: signal(SignalKind::terminate())?,
                int: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        Ok(StopSignals {})
    }

    /// Resolves when a stop signal arrives. Cancel-safe.
    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Prints the events still queued for this subscriber.
fn drain(events: &mut tokio::sync::broadcast::Receiver<MembershipEvent>, started: Instant) {
    while let Ok(event) = events.try_recv() {
        emit_event(&event, started);
    }
}

fn emit_event(event: &MembershipEvent, started: Instant) {
    let t = ms_since(started);
    let line = match event {
        MembershipEvent::MemberJoined(m) => member_line("member_joined", m, t),
        MembershipEvent::MemberUp(m) => member_line("member_up", m, t),
        MembershipEvent::MemberLeft(m) => member_line("member_left", m, t),
        MembershipEvent::MemberExited(m) => member_line("member_exited", m, t),
        MembershipEvent::MemberDowned(m) => member_line("member_downed", m, t),
        MembershipEvent::Unreachable(m) => member_line("unreachable", m, t),
        MembershipEvent::Reachable(m) => member_line("reachable", m, t),
        MembershipEvent::MemberRemoved { member, previous } => format!(
            r#"{{"event":"member_removed",{},"previous":"{previous:?}","t_ms":{t}}}"#,
            member_fields(member)
        ),
        MembershipEvent::CoordinatorChanged(Some(m)) => member_line("coordinator_changed", m, t),
        MembershipEvent::CoordinatorChanged(None) => format!(
            r#"{{"event":"coordinator_changed","addr":null,"node_id":null,"incarnation":null,"t_ms":{t}}}"#
        ),
    };
    emit(&line);
}

fn member_line(event: &str, member: &UniqueAddress, t_ms: u128) -> String {
    format!(
        r#"{{"event":"{event}",{},"t_ms":{t_ms}}}"#,
        member_fields(member)
    )
}

/// `"addr":…,"node_id":…,"incarnation":…` — no value needs JSON escaping:
/// a socket address, a hex id and a number.
fn member_fields(member: &UniqueAddress) -> String {
    format!(
        r#""addr":"{}","node_id":"{}","incarnation":{}"#,
        member.addr, member.node_id, member.incarnation
    )
}

/// Writes one line to stdout and flushes it. A closed stdout is not fatal
/// (`println!` would panic): the node keeps running, its output is lost.
fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

fn ms_since(started: Instant) -> u128 {
    started.elapsed().as_millis()
}
