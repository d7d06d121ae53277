//! How the node stops: the stop signals (SIGTERM, Ctrl-C), the wait for
//! one while events are printed, the wait for `--drive-reliable` credits,
//! and the two ways out: stopped by the cluster (or refused by the seeds),
//! or a graceful leave after the shards are handed off.

use std::process::ExitCode;
use std::time::Duration;

use datum_cluster_sharding::MigrationEvent;
use datum_cluster_sharding::membership::MemberStatus;
use tokio::sync::broadcast::{self, error::RecvError};

use super::output::{EventsLost, MigrationLine, Stopped, drain, emit, emit_event, printing_events};
use super::{EXIT_JOIN_REFUSED, EXIT_LEAVE_TIMED_OUT, EXIT_STOPPED_BY_CLUSTER, Running};

/// SIGTERM and Ctrl-C (SIGINT), listened for from start-up on.
pub(super) struct StopSignals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers; from now on these signals no longer kill the
    /// process but are reported by [`StopSignals::recv`].
    pub(super) fn install() -> std::io::Result<StopSignals> {
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

/// The next migration event (`None` when some were missed, said in a
/// `migration_events_lost` line, or the system is gone); never, without a
/// hosted system.
async fn next_migration(
    events: &mut Option<broadcast::Receiver<MigrationEvent>>,
    started: std::time::Instant,
) -> Option<MigrationEvent> {
    match events {
        Some(events) => match events.recv().await {
            Ok(event) => Some(event),
            Err(RecvError::Lagged(missed)) => {
                emit(&EventsLost::new(missed, started));
                None
            }
            Err(RecvError::Closed) => {
                std::future::pending::<()>().await;
                None
            }
        },
        None => std::future::pending().await,
    }
}

impl Running {
    /// Prints membership events, and with `--stats-ms` the region and
    /// `drive` lines, until a stop signal arrives or the cluster stops this
    /// node on its own; true in the latter case.
    pub(super) async fn print_events_until_stopped(&mut self) -> bool {
        let started = self.started;
        let mut stopped_by_cluster = false;
        loop {
            tokio::select! {
                () = self.stop.recv() => break,
                _ = self.stats.tick(), if self.print_stats => {
                    if let Some(system) = &self.system {
                        emit(&system.region_line("region_state", started));
                    }
                    if let Some(drive) = &self.drive {
                        emit(&drive.line(started));
                    }
                }
                Some(moved) = next_migration(&mut self.migrations, started) => {
                    if let Some(line) = MigrationLine::of(&moved, started) {
                        emit(&line);
                    }
                }
                event = self.events.recv() => match event {
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
                changed = self.state.changed() => if changed.is_err() {
                    stopped_by_cluster = true;
                    break;
                },
            }
        }
        stopped_by_cluster
    }

    /// With `--drive`, before a graceful leave: stops the reliable credits
    /// and waits for those sent to be confirmed (printing events
    /// meanwhile), then prints the `drive` line; true if the cluster downed
    /// or removed the node meanwhile. Without `--drive`: false at once.
    pub(super) async fn settle_drive(&mut self) -> bool {
        let started = self.started;
        let Running {
            events,
            state,
            node,
            drive: Some(drive),
            ..
        } = self
        else {
            return false;
        };
        let stopped = async { while state.changed().await.is_ok() {} };
        let settled = async {
            tokio::select! {
                () = drive.settle() => false,
                () = stopped => true,
            }
        };
        // (A node downed meanwhile may see its system stop, and the wait
        // end, before its state watch closes: its status says.)
        let stopped_by_cluster = printing_events(events, started, settled).await
            || state.has_changed().is_err()
            || node.current_state().self_status() == Some(MemberStatus::Down);
        emit(&drive.line(started));
        stopped_by_cluster
    }

    /// The cluster downed or removed this node, or its seeds refused it:
    /// prints the last lines, closes the node and gives the exit code (3,
    /// or 5 for a refused join).
    pub(super) async fn exit_stopped_by_cluster(mut self, drive_timeout_ms: u64) -> ExitCode {
        let started = self.started;
        // The asks waiting when the system fenced have failed: their
        // loops count them before the last `drive` line.
        if let Some(drive) = &self.drive {
            // (Bounded past the longest an attempt may still wait.)
            let patience = Duration::from_millis(drive_timeout_ms) + Duration::from_secs(5);
            drive.ended(patience).await;
            emit(&drive.line(started));
        }
        drain(&mut self.events, started);
        if let Some(refusal) = self.node.join_refusal() {
            self.node.crash().await;
            emit(&Stopped::new("join_refused", started));
            eprintln!("datum-node: gave up joining: {refusal}");
            return ExitCode::from(EXIT_JOIN_REFUSED);
        }
        let reason = match self.node.current_state().self_status() {
            Some(MemberStatus::Down) => "downed",
            _ => "removed",
        };
        self.node.crash().await; // the driver is gone already; this closes the pipes
        emit(&Stopped::new(reason, started));
        eprintln!("datum-node: the cluster {reason} this node; it has stopped");
        ExitCode::from(EXIT_STOPPED_BY_CLUSTER)
    }

    /// Leaves gracefully: hands the hosted system's shards off, then leaves
    /// the membership, printing events throughout; gives the exit code (0,
    /// or 4 when the leave did not complete in time).
    pub(super) async fn leave_gracefully(mut self) -> ExitCode {
        let started = self.started;
        if let Some(system) = &self.system {
            emit(&system.region_line("handoff_started", started));
            printing_events(&mut self.events, started, system.shutdown()).await;
            emit(&system.region_line("handed_off", started));
        }
        let leave = tokio::spawn({
            let node = self.node.clone();
            async move { node.shutdown().await }
        });
        let result = printing_events(&mut self.events, started, leave).await;
        drain(&mut self.events, started);
        match result {
            Ok(Ok(())) => {
                emit(&Stopped::new("left", started));
                ExitCode::SUCCESS
            }
            Ok(Err(error)) => {
                emit(&Stopped::new("leave_timed_out", started));
                eprintln!("datum-node: the graceful leave did not complete: {error}");
                ExitCode::from(EXIT_LEAVE_TIMED_OUT)
            }
            Err(error) => {
                eprintln!("datum-node: the leave task failed: {error}");
                ExitCode::from(EXIT_LEAVE_TIMED_OUT)
            }
        }
    }
}
