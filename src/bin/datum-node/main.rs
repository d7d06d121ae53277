//! `datum-node`: one cluster node as an OS process.
//!
//! Joins (or forms) a cluster from command-line flags or `DATUM_*`
//! environment variables and prints one JSON object per line on stdout for
//! every membership event this node publishes. Logs go to stderr. SIGTERM or
//! Ctrl-C makes the node leave gracefully and exit 0. With `--counter` it
//! also hosts the guide's counter entity type in a sharded system (its
//! shards handed off before the node leaves) and can print that region's
//! state now and then (`--stats-ms`); with `--journal-url` that counter is
//! durable, journaled to a PostgreSQL the nodes share. See `SPEC.md` §10c.
//!
//! The node runs on a current-thread runtime: the event subscription is taken
//! before the membership driver first runs, so no event is missed, and one
//! thread is plenty for heartbeats and gossip.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use datum_cluster_sharding::cluster::ClusterNode;
use datum_cluster_sharding::membership::{MembershipEvent, MembershipState};

use self::certs::certs;
use self::config::cluster_config;
#[cfg(feature = "embedded")]
use self::copy_store::copy_store;
use self::drive::{Drive, start_drive};
#[cfg(feature = "embedded")]
use self::flags::CopyStoreArgs;
use self::flags::{Args, CertsArgs};
use self::hosted::{Hosted, connect_journal, host_counter};
use self::management::recorder;
#[cfg(feature = "management")]
use self::management::{bind_management, start_management};
use self::output::{Line, emit, init_logging};
use self::shutdown::StopSignals;

mod certs;
mod config;
#[cfg(feature = "embedded")]
mod copy_store;
mod drive;
mod flags;
mod hosted;
mod management;
mod output;
mod shutdown;
#[cfg(test)]
mod tests;

/// Exit code when the node could not start (bind failure, refused config).
const EXIT_START_FAILED: u8 = 1;
/// Exit code when the cluster downed or removed this node without it asking.
const EXIT_STOPPED_BY_CLUSTER: u8 = 3;
/// Exit code when the graceful leave did not complete in time.
const EXIT_LEAVE_TIMED_OUT: u8 = 4;
/// Exit code when the seeds refused this node's join (another cluster
/// name or secret, an unsupported protocol version) and it gave up.
const EXIT_JOIN_REFUSED: u8 = 5;

#[path = "../../../protocols/counter.rs"]
mod counter;
/// `--counter-version 2`: the counter's next version.
#[path = "../../../protocols/counter_v2.rs"]
mod counter_v2;

/// The `--journal-url` counter: event-sourced, its total recovered from
/// the journal wherever it starts.
#[cfg(feature = "postgres")]
#[path = "../../../protocols/journaled.rs"]
mod journaled;
/// `--journal-url --counter-version 2`: the journaled counter's next
/// version, reading version 1's journal.
#[cfg(feature = "postgres")]
#[path = "../../../protocols/journaled_v2.rs"]
mod journaled_v2;

fn main() -> ExitCode {
    if std::env::args_os().nth(1).is_some_and(|a| a == "certs") {
        return certs(CertsArgs::parse_from(std::env::args_os().skip(1)));
    }
    #[cfg(feature = "embedded")]
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "copy-store")
    {
        return copy_store(CopyStoreArgs::parse_from(std::env::args_os().skip(1)));
    }
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

/// Runs the node and gives the process's exit code: starts it (with what
/// the flags add to it), prints its events until a stop signal or the
/// cluster stops it, then leaves gracefully or says how it was stopped.
async fn run(mut args: Args) -> ExitCode {
    let mut running = match start(&mut args).await {
        Ok(running) => running,
        Err(code) => return code,
    };
    let mut stopped_by_cluster = running.print_events_until_stopped().await;
    // A graceful leave waits for reliable credits to be confirmed first;
    // should the cluster down or remove the node meanwhile, it stops at
    // once, as it would have without the wait.
    if !stopped_by_cluster {
        stopped_by_cluster = running.settle_drive().await;
    }
    if stopped_by_cluster {
        return running.exit_stopped_by_cluster(args.drive_timeout_ms).await;
    }
    // Graceful leave: (reliable credits confirmed, above) the shards (the
    // node still routes meanwhile), then the membership; events keep being
    // printed throughout.
    running.leave_gracefully().await
}

/// The started node and what the flags added to it, kept until it stops.
/// Fields drop in declaration order: the driving loops first, the signal
/// handlers last.
struct Running {
    /// When start-up began: every line's `t_ms` counts from it.
    started: Instant,
    /// `--drive`'s loops.
    drive: Option<Drive>,
    /// Ticks every `--stats-ms` (every millisecond when 0, unused then).
    stats: tokio::time::Interval,
    /// Whether the ticks print the region and `drive` lines.
    print_stats: bool,
    /// Kept until the node has left: `/ready` answers 503 while it leaves.
    #[cfg(feature = "management")]
    _management: Option<datum_cluster_sharding::management::ManagementServer>,
    /// `--counter`'s sharded system.
    system: Option<Hosted>,
    /// What became of the states that moved with its shards.
    migrations: Option<self::hosted::Migrations>,
    state: tokio::sync::watch::Receiver<MembershipState>,
    events: tokio::sync::broadcast::Receiver<MembershipEvent>,
    node: ClusterNode,
    stop: StopSignals,
}

/// Starts the node and what the flags add to it, in this order: the
/// metrics recorder, the configuration, the signal handlers, the journal,
/// the management listener, the node (its `started` line), the hosted
/// system, the management endpoint and the driving loops. On a failure,
/// says why on stderr and gives exit code 1 (crashing the node first once
/// it has started).
async fn start(args: &mut Args) -> Result<Running, ExitCode> {
    let started = Instant::now();
    let recorder = match recorder(args) {
        Ok(recorder) => recorder,
        Err(error) => {
            eprintln!("datum-node: cannot serve the management endpoint: {error}");
            return Err(ExitCode::from(EXIT_START_FAILED));
        }
    };
    let config = cluster_config(args)?;
    let stop = match StopSignals::install() {
        Ok(stop) => stop,
        Err(error) => {
            eprintln!("datum-node: cannot install signal handlers: {error}");
            return Err(ExitCode::from(EXIT_START_FAILED));
        }
    };
    let journal = connect_journal(args).await?;
    // The management address is bound before the node joins: a taken port
    // fails the start with no member left to down.
    #[cfg(feature = "management")]
    let management_listener = bind_management(args.management_addr).await?;
    let node = match ClusterNode::start(config).await {
        Ok(node) => node,
        Err(error) => {
            eprintln!("datum-node: cannot start: {error}");
            return Err(ExitCode::from(EXIT_START_FAILED));
        }
    };
    // Subscribe before the first await: on this single-threaded runtime the
    // driver has not run yet, so the stream holds every event.
    let events = node.subscribe();
    let state = node.watch_state();
    let me = node.self_address();
    let app_version = &node.config().app_version;
    emit(&Line {
        app_version: (!app_version.is_zero()).then(|| app_version.to_string()),
        ..Line::member("started", &me, 0)
    });
    let (system, migrations) = host_counter(args, &node, journal).await?.unzip();
    #[cfg(feature = "management")]
    let management = start_management(
        args,
        management_listener,
        recorder,
        &node,
        system.as_ref(),
        started,
    )
    .await?;
    #[cfg(not(feature = "management"))]
    if let Some(never) = recorder {
        match never {}
    }
    let stats = tokio::time::interval(Duration::from_millis(args.stats_ms.max(1)));
    let print_stats = system.is_some() && args.stats_ms > 0;
    let drive = start_drive(args, &node, system.as_ref(), &me).await?;
    Ok(Running {
        started,
        drive,
        stats,
        print_stats,
        #[cfg(feature = "management")]
        _management: management,
        system,
        migrations,
        state,
        events,
        node,
        stop,
    })
}
