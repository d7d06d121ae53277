//! What the node writes: one JSON object per line on stdout (membership
//! events, the region and `drive` lines, `management_listening`, the last
//! `stopped` line) and its logs on stderr.

use std::io::Write;
#[cfg(feature = "management")]
use std::net::SocketAddr;
use std::time::Instant;

use datum_cluster_sharding::identity::UniqueAddress;
use datum_cluster_sharding::membership::MembershipEvent;
use datum_cluster_sharding::{MigrationEvent, NoStore, Protocol, ShardedSystem};
use serde::Serialize;

pub(super) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Runs `work` to its end, printing membership events meanwhile.
pub(super) async fn printing_events<F: std::future::Future>(
    events: &mut tokio::sync::broadcast::Receiver<MembershipEvent>,
    started: Instant,
    work: F,
) -> F::Output {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            event = events.recv() => if let Ok(event) = event {
                emit_event(&event, started);
            },
            done = &mut work => break done,
        }
    }
}

/// The `drive` line (SPEC §10c.2).
#[derive(Debug, Serialize)]
pub(super) struct DriveLine {
    pub(super) event: &'static str,
    pub(super) acked: u64,
    pub(super) retries: u64,
    pub(super) missing: u64,
    /// Asks only: failed attempts whose error said they may have been
    /// processed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) maybe: Option<u64>,
    /// With `--drive-tags`: the numbers of the attempts whose error said
    /// they were not processed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) refused: Option<Vec<u64>>,
    /// With `--drive-reliable` only: credits sent and not yet confirmed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) unconfirmed: Option<u64>,
    pub(super) t_ms: u64,
}

/// A line about the counter region on this node (SPEC §10c.2).
#[derive(Debug, Serialize)]
pub(super) struct RegionLine<'a> {
    pub(super) event: &'a str,
    pub(super) type_name: &'a str,
    /// Shards hosted here.
    pub(super) shards: usize,
    /// Their ids, ascending.
    pub(super) shard_ids: Vec<u32>,
    /// Live entities in them.
    pub(super) entities: usize,
    /// Shards being handed off.
    pub(super) handing_off: usize,
    /// Messages waiting in buffers.
    pub(super) buffered: usize,
    /// The acting coordinator has registered this node's region (it has
    /// sent the region its table).
    pub(super) registered: bool,
    pub(super) t_ms: u64,
}

impl<'a> RegionLine<'a> {
    pub(super) fn of<P: Protocol, J>(
        system: &ShardedSystem<NoStore, J>,
        event: &'a str,
        started: Instant,
    ) -> Self {
        let state = system.shard_region_state::<P>();
        RegionLine {
            event,
            type_name: P::TYPE_NAME,
            shards: state.as_ref().map_or(0, |s| s.shards.len()),
            shard_ids: state
                .as_ref()
                .map(|s| s.shards.keys().map(|id| id.0).collect())
                .unwrap_or_default(),
            entities: state.as_ref().map_or(0, |s| s.shards.values().sum()),
            handing_off: state.as_ref().map_or(0, |s| s.handing_off.len()),
            buffered: state.as_ref().map_or(0, |s| s.buffered),
            registered: system.sharding_coordinator().is_some_and(|c| c.registered),
            t_ms: ms_since(started),
        }
    }
}

/// A line about a shard that moved here, or an entity's state that did
/// not come with it (SPEC §10c.2).
#[derive(Debug, Serialize)]
pub(super) struct MigrationLine<'a> {
    pub(super) event: &'static str,
    pub(super) type_name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) shard: Option<u32>,
    /// The old owner's node id, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) from: Option<String>,
    /// `shard_received`: the entities whose states came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) entities: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) entity_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reason: Option<&'a str>,
    pub(super) t_ms: u64,
}

impl<'a> MigrationLine<'a> {
    /// The line for `event` (none for a kind this build does not know).
    pub(super) fn of(event: &'a MigrationEvent, started: Instant) -> Option<Self> {
        let line = |event, type_name| MigrationLine {
            event,
            type_name,
            shard: None,
            from: None,
            entities: None,
            entity_id: None,
            reason: None,
            t_ms: ms_since(started),
        };
        Some(match event {
            MigrationEvent::Received {
                type_name,
                shard,
                from,
                entities,
                ..
            } => MigrationLine {
                shard: Some(shard.0),
                from: Some(from.node_id.to_string()),
                entities: Some(*entities),
                ..line("shard_received", type_name)
            },
            MigrationEvent::FellBack {
                type_name,
                shard,
                from,
                reason,
            } => MigrationLine {
                shard: Some(shard.0),
                from: from.map(|f| f.node_id.to_string()),
                reason: Some(reason),
                ..line("shard_fell_back", type_name)
            },
            MigrationEvent::StateRefused {
                type_name,
                entity_id,
                reason,
            } => MigrationLine {
                entity_id: Some(entity_id),
                reason: Some(reason),
                ..line("state_refused", type_name)
            },
            _ => return None,
        })
    }
}

/// The line saying that migration lines were lost: more came than the
/// subscription holds (1,024) before they were printed.
#[derive(Debug, Serialize)]
pub(super) struct EventsLost {
    event: &'static str,
    missed: u64,
    t_ms: u64,
}

impl EventsLost {
    pub(super) fn new(missed: u64, started: Instant) -> Self {
        EventsLost {
            event: "migration_events_lost",
            missed,
            t_ms: ms_since(started),
        }
    }
}

/// Prints the events still queued for this subscriber.
pub(super) fn drain(
    events: &mut tokio::sync::broadcast::Receiver<MembershipEvent>,
    started: Instant,
) {
    while let Ok(event) = events.try_recv() {
        emit_event(&event, started);
    }
}

pub(super) fn emit_event(event: &MembershipEvent, started: Instant) {
    emit(&event_line(event, ms_since(started)));
}

/// The line printed for one membership event, `t_ms` after start.
pub(super) fn event_line(event: &MembershipEvent, t: u64) -> Line<'_> {
    match event {
        MembershipEvent::MemberJoined(m) => Line::member("member_joined", m, t),
        MembershipEvent::MemberUp(m) => Line::member("member_up", m, t),
        MembershipEvent::MemberLeft(m) => Line::member("member_left", m, t),
        MembershipEvent::MemberExited(m) => Line::member("member_exited", m, t),
        MembershipEvent::MemberDowned(m) => Line::member("member_downed", m, t),
        MembershipEvent::Unreachable(m) => Line::member("unreachable", m, t),
        MembershipEvent::Reachable(m) => Line::member("reachable", m, t),
        MembershipEvent::MemberRemoved { member, previous } => Line {
            previous: Some(format!("{previous:?}")),
            ..Line::member("member_removed", member, t)
        },
        MembershipEvent::CoordinatorChanged(Some(m)) => Line::member("coordinator_changed", m, t),
        MembershipEvent::CoordinatorChanged(None) => Line {
            event: "coordinator_changed",
            addr: None,
            node_id: None,
            incarnation: None,
            previous: None,
            reason: None,
            app_version: None,
            t_ms: t,
        },
        MembershipEvent::JoinRefused {
            seed,
            reason,
            by_seed,
        } => Line {
            event: "join_refused",
            addr: Some(seed.to_string()),
            node_id: None,
            incarnation: None,
            previous: None,
            reason: Some(format!(
                "{reason:?} ({})",
                if *by_seed {
                    "by the seed"
                } else {
                    "by this node"
                }
            )),
            app_version: None,
            t_ms: t,
        },
        // A kind of event this binary does not know yet: its name only.
        _ => Line {
            event: "other",
            addr: None,
            node_id: None,
            incarnation: None,
            previous: None,
            reason: None,
            app_version: None,
            t_ms: t,
        },
    }
}

/// One event line about a member (or about none: `null` fields). Fields are
/// written in declaration order, as SPEC §10c.2 shows them.
#[derive(Debug, Serialize)]
pub(super) struct Line<'a> {
    pub(super) event: &'a str,
    /// The socket address as text (`127.0.0.1:7355`).
    pub(super) addr: Option<String>,
    /// 16 hex digits.
    pub(super) node_id: Option<String>,
    pub(super) incarnation: Option<u64>,
    /// Only on `member_removed`: the status before removal.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) previous: Option<String>,
    /// Only on `join_refused`: the `Reject` reason and which side refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) reason: Option<String>,
    /// Only on `started`, with `--app-version`: this node's application
    /// version.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) app_version: Option<String>,
    pub(super) t_ms: u64,
}

impl<'a> Line<'a> {
    pub(super) fn member(event: &'a str, member: &UniqueAddress, t_ms: u64) -> Self {
        Line {
            event,
            addr: Some(member.addr.to_string()),
            node_id: Some(member.node_id.to_string()),
            incarnation: Some(member.incarnation),
            previous: None,
            reason: None,
            app_version: None,
            t_ms,
        }
    }
}

/// The line saying where the management endpoint listens.
#[cfg(feature = "management")]
#[derive(Debug, Serialize)]
pub(super) struct Listening {
    event: &'static str,
    addr: String,
    t_ms: u64,
}

#[cfg(feature = "management")]
impl Listening {
    pub(super) fn new(addr: SocketAddr, started: Instant) -> Self {
        Listening {
            event: "management_listening",
            addr: addr.to_string(),
            t_ms: ms_since(started),
        }
    }
}

/// The last line, when the node stops other than by a kill.
#[derive(Debug, Serialize)]
pub(super) struct Stopped<'a> {
    pub(super) event: &'a str,
    pub(super) reason: &'a str,
    pub(super) t_ms: u64,
}

impl<'a> Stopped<'a> {
    pub(super) fn new(reason: &'a str, started: Instant) -> Self {
        Stopped {
            event: "stopped",
            reason,
            t_ms: ms_since(started),
        }
    }
}

/// `value` as one line of JSON: serde_json escapes every string, so no value
/// can break the line or the object.
pub(super) fn json_line(value: &impl Serialize) -> serde_json::Result<String> {
    serde_json::to_string(value)
}

/// Writes one JSON line to stdout and flushes it. A closed stdout is not
/// fatal (`println!` would panic): the node keeps running, its output is lost.
pub(super) fn emit(value: &impl Serialize) {
    let line = match json_line(value) {
        Ok(line) => line,
        Err(error) => {
            // Not reachable: the line types hold only strings and integers.
            tracing::error!(%error, "BUG: event line not serialisable");
            return;
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

pub(super) fn ms_since(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}
