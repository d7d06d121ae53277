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

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
#[cfg(feature = "postgres")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::identity::UniqueAddress;
use datum_cluster_sharding::membership::{MemberStatus, MembershipEvent, SplitBrainStrategy};
#[cfg(feature = "postgres")]
use datum_cluster_sharding::persistence::PgPersistence;
use datum_cluster_sharding::{
    Ask, EntityRef, NoStore, Processed, Protocol, ShardedSystem, ShardingError,
};
use serde::Serialize;
use tokio::sync::broadcast::error::RecvError;

/// Exit code when the node could not start (bind failure, refused config).
const EXIT_START_FAILED: u8 = 1;
/// Exit code when the cluster downed or removed this node without it asking.
const EXIT_STOPPED_BY_CLUSTER: u8 = 3;
/// Exit code when the graceful leave did not complete in time.
const EXIT_LEAVE_TIMED_OUT: u8 = 4;
/// Exit code when the seeds refused this node's join (another cluster
/// name or secret, an unsupported protocol version) and it gave up.
const EXIT_JOIN_REFUSED: u8 = 5;

/// Longest accepted duration flag (one hour), so no clock arithmetic overflows.
const MAX_MS: u64 = 3_600_000;

/// Smallest accepted `--max-frame`: a membership gossip must fit.
const MIN_FRAME: usize = 4 * 1024;

#[path = "../../protocols/counter.rs"]
mod counter;

/// Runs one cluster node and prints its membership events as JSON lines.
#[derive(Debug, Parser)]
#[command(
    name = "datum-node",
    version,
    about = "Runs one datum cluster node and prints its membership events as JSON lines on stdout.",
    after_help = "Every flag can also be set by the environment variable shown. Logs go to stderr \
(RUST_LOG, default `warn`). SIGTERM or Ctrl-C: leave gracefully, exit 0.\n\
Exit codes: 0 left gracefully; 1 could not start (bind failure, refused configuration); \
2 bad flags; 3 downed or removed by the cluster; 4 the graceful leave did not complete in time; \
5 gave up joining: the seeds refused this node (another cluster name or secret, an unsupported protocol version, TLS refusing the connection).\n\
`datum-node certs --out DIR --nodes IP,IP,...` writes a test CA and node certificates for --tls-* (see `datum-node certs --help`)."
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

    /// How many members watch each member: heartbeat it every heartbeat
    /// interval and detect its failure (its predecessors on the ring of
    /// members by age). The cost per node grows with this, not with the
    /// cluster's size.
    #[arg(long, env = "DATUM_MONITORED_BY", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    monitored_by: u64,

    /// How many random members each gossip round and each change of the
    /// membership state goes to.
    #[arg(long, env = "DATUM_GOSSIP_FANOUT", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    gossip_fanout: u64,

    /// How often a gossip round sends this node's state digest to
    /// --gossip-fanout random members, in milliseconds (changes spread at
    /// once; rounds repair what was lost).
    #[arg(long, env = "DATUM_GOSSIP_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    gossip_ms: u64,

    /// How long an unreachable member stays so before the leader downs it,
    /// in milliseconds; `off` for manual downing only.
    #[arg(long, env = "DATUM_DOWNING_MS", default_value = "200", value_parser = downing)]
    downing_ms: Downing,

    /// Largest frame accepted on a pipe, in bytes.
    #[arg(long, env = "DATUM_MAX_FRAME", default_value_t = datum_cluster_sharding::wire::DEFAULT_MAX_FRAME_LEN,
          value_parser = max_frame)]
    max_frame: usize,

    /// The split-brain resolver: `keep-majority` (the default),
    /// `static-quorum:N`, `keep-oldest`, `keep-oldest-down-if-alone`,
    /// `down-all`, or `off` (timeout downing: faster, but under a partition
    /// each side downs the other). The losing side downs itself and its
    /// nodes exit with code 3.
    #[arg(long, env = "DATUM_SPLIT_BRAIN", default_value = "keep-majority", value_parser = split_brain)]
    split_brain: SplitBrain,

    /// How long the resolver waits for a partition to stay the same before
    /// it decides, in milliseconds.
    #[arg(long, env = "DATUM_STABLE_AFTER_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    stable_after_ms: u64,

    /// Host the counter entity type (protocol `counter`: `tell Add`,
    /// `ask Get -> u64`) in a sharded system on this node. SIGTERM then
    /// hands its shards off to the other nodes before the node leaves.
    #[arg(long, env = "DATUM_COUNTER")]
    counter: bool,

    /// The counter type's shard count (every node of the cluster must agree).
    #[arg(long, env = "DATUM_SHARDS", default_value_t = 128,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(datum_cluster_sharding::MAX_SHARDS)))]
    shards: u32,

    /// With --counter: print the counter region's state every this many
    /// milliseconds (0: never).
    #[arg(long, env = "DATUM_STATS_MS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    stats_ms: u64,

    /// With --counter: also drive traffic — N loops, loop `i` asking `Get`
    /// of counter `drive-i` forever, each ask retried until it is answered
    /// (for at most 30 s) — and print a `drive` line with the counts at
    /// every `--stats-ms` tick (0: none).
    #[arg(long, env = "DATUM_DRIVE", default_value_t = 0, requires = "counter")]
    drive: u32,

    /// With --drive: at most this many asks (or credits) per second from
    /// each loop, so that driving leaves the node's core to the node; 0 for
    /// as fast as the answers come.
    #[arg(long, env = "DATUM_DRIVE_RATE", default_value_t = 100, requires = "drive",
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    drive_rate: u32,

    /// With --drive: how long each attempt of an ask waits for its answer
    /// before it counts as failed and is tried again.
    #[arg(long, env = "DATUM_DRIVE_TIMEOUT_MS", default_value_t = 1_000, requires = "drive",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    drive_timeout_ms: u64,

    /// With --drive and --journal-url: each attempt of an ask adds a number
    /// of its own (unique to this node: its node id's low 20 bits above the
    /// attempt's count) instead of 1, and the `drive` line lists as
    /// `refused` the numbers of the attempts that failed with an error
    /// saying they were not processed — so a journal can be checked
    /// against what each failure said.
    #[arg(long, env = "DATUM_DRIVE_TAGS", requires_all = ["drive", "journal_url"],
          conflicts_with = "drive_reliable")]
    drive_tags: bool,

    /// With --journal-url: each `Add` handler waits this long before it
    /// journals, so that asks are in flight for a while (a slow handler).
    #[arg(long, env = "DATUM_HANDLE_MS", default_value_t = 0, requires = "journal_url",
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    handle_ms: u64,

    /// With --drive: each loop asks a counter never asked before every time
    /// (loop `i`'s R-th ask goes to `drive-R-i`), so new entities, and new
    /// shards, keep being placed.
    #[arg(long, env = "DATUM_DRIVE_FRESH", requires = "drive")]
    drive_fresh: bool,

    /// With --drive and --journal-url: loop `i` sends `Credit(1)` to
    /// journaled counter `drive-i` through one reliable producer,
    /// `drive-<node id>`, each credit handled once; the `drive` line counts
    /// confirmed credits. On SIGTERM the loops stop and the node waits (up
    /// to 30 s) for every credit to be confirmed before it leaves.
    #[arg(
        long,
        env = "DATUM_DRIVE_RELIABLE",
        requires_all = ["drive", "journal_url"],
        conflicts_with = "drive_fresh"
    )]
    drive_reliable: bool,

    /// With --counter: host the durable `journaled-counter` type instead
    /// (`ask Add -> u64`, journaled before it is answered; `tell Credit`,
    /// journaled the same way; `ask Get -> u64`), its events in the PostgreSQL database at this connection
    /// string (libpq `key=value` form), which every node may share; then
    /// --drive asks `Add(1)` (with --drive-reliable it sends `tell
    /// Credit(1)`). Needs a build with `--features postgres`.
    #[arg(
        long,
        env = "DATUM_JOURNAL_URL",
        requires = "counter",
        hide_env_values = true
    )]
    journal_url: Option<String>,

    /// TLS 1.3 on every pipe (needs a build with `--features tls`): this
    /// node's certificate chain, PEM. With --tls-key and --tls-ca.
    #[arg(long, env = "DATUM_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<std::path::PathBuf>,

    /// The certificate's private key, PEM.
    #[arg(long, env = "DATUM_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,

    /// The CA certificates peers' certificates must chain to, PEM.
    #[arg(long, env = "DATUM_TLS_CA", requires = "tls_cert")]
    tls_ca: Option<std::path::PathBuf>,

    /// The name every peer's certificate must carry (default: the peer's
    /// node address, as an IP subject alternative name).
    #[arg(long, env = "DATUM_TLS_PEER_NAME", requires = "tls_cert")]
    tls_peer_name: Option<String>,

    /// Serve the management endpoint on this address (needs a build with
    /// `--features management`): `/alive` and `/ready` probes,
    /// `/cluster/members`, `/cluster/shards/{type}` and `/metrics`
    /// (Prometheus text). Port 0 picks a free port; the
    /// `management_listening` line tells which.
    #[arg(long, env = "DATUM_MANAGEMENT_ADDR")]
    management_addr: Option<SocketAddr>,

    /// With --management-addr: the most connections the endpoint holds at
    /// once; one more is closed as soon as it is accepted. Default 256, or
    /// a quarter of the process's open-file limit when that is lower, so
    /// that the cluster's pipes keep the rest.
    #[arg(long, env = "DATUM_MANAGEMENT_MAX_CONNECTIONS", requires = "management_addr",
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    #[cfg_attr(not(feature = "management"), allow(dead_code))]
    management_max_connections: Option<u32>,

    /// With --management-addr: how long a connection may take to send a
    /// request's head, in milliseconds, timed from when it opens and, kept
    /// alive, from each answer: a connection that sends nothing is closed
    /// after it.
    #[arg(long, env = "DATUM_MANAGEMENT_HEADER_TIMEOUT_MS", default_value_t = 10_000,
          requires = "management_addr",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    #[cfg_attr(not(feature = "management"), allow(dead_code))]
    management_header_timeout_ms: u64,

    /// With --management-addr: how long a connection may move no byte
    /// either way (say, a client that stops reading its answer) before it
    /// is closed, in milliseconds.
    #[arg(long, env = "DATUM_MANAGEMENT_IDLE_TIMEOUT_MS", default_value_t = 30_000,
          requires = "management_addr",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    #[cfg_attr(not(feature = "management"), allow(dead_code))]
    management_idle_timeout_ms: u64,

    /// Find the seeds while joining instead of --seeds: `file:PATH` (one
    /// `IP:port` per line, read again every second), `dns:NAME:PORT` (the
    /// name's A/AAAA records, each with PORT) or `dns-srv:NAME` (its SRV
    /// records); DNS needs a build with `--features discovery`.
    #[arg(long, env = "DATUM_DISCOVERY", value_parser = discovery, conflicts_with = "seeds")]
    discovery: Option<Discovery>,

    /// With --discovery dns: ask these name servers (`IP:port`, comma
    /// separated) instead of the system's.
    #[arg(long, env = "DATUM_DISCOVERY_NAMESERVERS", value_parser = seed_list, requires = "discovery")]
    discovery_nameservers: Option<SeedList>,

    /// With --discovery: how many addresses must be found, this node's
    /// among them, before the lowest may form a new cluster (set it to the
    /// number of nodes that start together).
    #[arg(long, env = "DATUM_DISCOVERY_REQUIRED", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1_000))]
    discovery_required: u32,
}

/// A `--discovery` source, as given.
#[derive(Clone, Debug)]
enum Discovery {
    File(std::path::PathBuf),
    #[cfg_attr(not(feature = "discovery"), allow(dead_code))]
    Dns {
        name: String,
        port: u16,
    },
    DnsSrv(String),
}

fn discovery(s: &str) -> Result<Discovery, String> {
    if let Some(path) = s.strip_prefix("file:").filter(|p| !p.is_empty()) {
        return Ok(Discovery::File(path.into()));
    }
    if let Some(name) = s.strip_prefix("dns-srv:").filter(|n| !n.is_empty()) {
        return Ok(Discovery::DnsSrv(name.to_owned()));
    }
    if let Some((name, port)) = s.strip_prefix("dns:").and_then(|r| r.rsplit_once(':'))
        && !name.is_empty()
    {
        let port = port
            .parse()
            .map_err(|_| format!("not a port: {port:?} (dns:NAME:PORT)"))?;
        return Ok(Discovery::Dns {
            name: name.to_owned(),
            port,
        });
    }
    Err("expected file:PATH, dns:NAME:PORT or dns-srv:NAME".into())
}

/// The seed discovery `--discovery` asks for.
fn seed_discovery(
    args: &Args,
) -> Result<Option<datum_cluster_sharding::cluster::SeedDiscovery>, String> {
    use datum_cluster_sharding::cluster::SeedDiscovery;
    let Some(source) = &args.discovery else {
        return Ok(None);
    };
    let found = match source {
        Discovery::File(path) => SeedDiscovery::file(path),
        #[cfg(feature = "discovery")]
        Discovery::Dns { name, port } => SeedDiscovery::dns(name, *port),
        #[cfg(feature = "discovery")]
        Discovery::DnsSrv(name) => SeedDiscovery::dns_srv(name),
        #[cfg(not(feature = "discovery"))]
        Discovery::Dns { name, .. } | Discovery::DnsSrv(name) => {
            return Err(format!(
                "--discovery dns ({name}) needs a build with `--features discovery`"
            ));
        }
    };
    #[cfg(feature = "discovery")]
    let found = match &args.discovery_nameservers {
        Some(servers) => found.name_servers(servers.0.clone()),
        None => found,
    };
    Ok(Some(found.required(args.discovery_required as usize)))
}

/// `datum-node certs`: a test CA and node certificates.
#[derive(Debug, Parser)]
#[command(
    name = "datum-node certs",
    about = "Writes a test CA and one certificate per node (PEM) into a directory, for a TLS \
cluster: ca.pem, node-<i>.pem, node-<i>-key.pem (new files; the CA's key is not kept). Needs a build with `--features tls`."
)]
struct CertsArgs {
    /// The directory to write into (created if missing).
    #[arg(long)]
    out: std::path::PathBuf,

    /// The nodes' names, comma-separated: IP addresses (each node's
    /// advertised IP) or DNS names (with --tls-peer-name).
    #[arg(long, value_delimiter = ',', required = true)]
    nodes: Vec<String>,

    /// How long the certificates are valid, in days.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3650))]
    days: u64,
}

/// Runs `datum-node certs`.
fn certs(args: CertsArgs) -> ExitCode {
    match write_certificates(&args) {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("datum-node certs: {error}");
            ExitCode::from(EXIT_START_FAILED)
        }
    }
}

/// Writes the test CA and certificates `args` asks for; gives, per name,
/// the `--tls-*` flags that use them.
fn write_certificates(args: &CertsArgs) -> Result<Vec<String>, String> {
    #[cfg(feature = "tls")]
    {
        // Only new files are written: name the first that exists before any
        // is written (the writer refuses one too, but with only the OS's
        // "File exists", and after writing those before it).
        if let Some(path) = existing_certificate_file(&args.out, args.nodes.len()) {
            return Err(format!(
                "refusing to overwrite {}, which exists (remove it or choose another --out)",
                path.display()
            ));
        }
        let names: Vec<&str> = args.nodes.iter().map(String::as_str).collect();
        let valid_for = Duration::from_secs(args.days * 86_400);
        let configs = datum_cluster_sharding::transport::generate_test_certificates(
            &args.out, &names, valid_for,
        )
        .map_err(|e| e.to_string())?;
        Ok(names
            .iter()
            .zip(&configs)
            .map(|(name, c)| {
                format!(
                    "{name}: --tls-cert {} --tls-key {} --tls-ca {}",
                    c.cert_chain.display(),
                    c.private_key.display(),
                    c.ca_roots.display()
                )
            })
            .collect())
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = args;
        Err("needs a build with `--features tls`".into())
    }
}

/// The first of the files `datum-node certs` writes into `dir` for `nodes`
/// names that exists already (a link counts, whatever it points to).
#[cfg(feature = "tls")]
fn existing_certificate_file(dir: &std::path::Path, nodes: usize) -> Option<std::path::PathBuf> {
    let per_node = (0..nodes).flat_map(|i| [format!("node-{i}.pem"), format!("node-{i}-key.pem")]);
    std::iter::once("ca.pem".to_owned())
        .chain(per_node)
        .map(|name| dir.join(name))
        .find(|path| path.symlink_metadata().is_ok())
}

/// The TLS material the --tls-* flags name (none without them).
fn tls(args: &Args) -> Result<Option<datum_cluster_sharding::transport::Tls>, String> {
    let (Some(cert), Some(key), Some(ca)) = (&args.tls_cert, &args.tls_key, &args.tls_ca) else {
        return Ok(None);
    };
    #[cfg(feature = "tls")]
    {
        use datum_cluster_sharding::transport::{Tls, TlsConfig};
        let mut config = TlsConfig::new(cert, key, ca);
        config.peer_name = args.tls_peer_name.clone();
        Tls::load(config).map(Some).map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = (cert, key, ca);
        Err("--tls-cert needs a build with `--features tls`".into())
    }
}

/// With `--management-addr`: the Prometheus recorder, installed before the
/// node starts so that every metric of the node registers with it.
#[cfg(feature = "management")]
type Recorder = metrics_exporter_prometheus::PrometheusHandle;
/// Without the `management` feature there is none.
#[cfg(not(feature = "management"))]
type Recorder = std::convert::Infallible;

/// Installs the process's Prometheus recorder when `--management-addr` asks
/// for the endpoint.
fn recorder(args: &Args) -> Result<Option<Recorder>, String> {
    if args.management_addr.is_none() {
        return Ok(None);
    }
    #[cfg(feature = "management")]
    {
        datum_cluster_sharding::telemetry::prometheus_builder()
            .install_recorder()
            .map(Some)
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "management"))]
    Err("--management-addr needs a build with `--features management`".into())
}

/// The `--management-*` limits.
#[cfg(feature = "management")]
struct ManagementLimits {
    max_connections: Option<u32>,
    header_timeout_ms: u64,
    idle_timeout_ms: u64,
}

/// Serves the management endpoint on `listener` for `node` (and its system).
#[cfg(feature = "management")]
fn serve_management(
    listener: tokio::net::TcpListener,
    limits: ManagementLimits,
    node: &ClusterNode,
    system: Option<&Hosted>,
    recorder: Recorder,
) -> std::io::Result<datum_cluster_sharding::management::ManagementServer> {
    use datum_cluster_sharding::management::Management;
    let mut management = Management::new(node.clone())
        .prometheus(recorder)
        .header_read_timeout(Duration::from_millis(limits.header_timeout_ms))
        .idle_timeout(Duration::from_millis(limits.idle_timeout_ms));
    if let Some(n) = limits.max_connections {
        management = management.max_connections(n as usize);
    }
    match system {
        Some(Hosted::Counter(system)) => management = management.system(system),
        #[cfg(feature = "postgres")]
        Some(Hosted::Journaled(system)) => management = management.system(system),
        None => {}
    }
    management.serve_on(listener)
}

/// The seed addresses (a newtype so clap takes the whole list as one value).
#[derive(Clone, Debug)]
struct SeedList(Vec<SocketAddr>);

/// The split-brain strategy, or `None` for timeout downing.
#[derive(Clone, Copy, Debug)]
struct SplitBrain(Option<SplitBrainStrategy>);

fn split_brain(s: &str) -> Result<SplitBrain, String> {
    let s = s.trim();
    let strategy = match s {
        "off" => None,
        "keep-majority" => Some(SplitBrainStrategy::KeepMajority),
        "keep-oldest" => Some(SplitBrainStrategy::KeepOldest {
            down_if_alone: false,
        }),
        "keep-oldest-down-if-alone" => Some(SplitBrainStrategy::KeepOldest {
            down_if_alone: true,
        }),
        "down-all" => Some(SplitBrainStrategy::DownAll),
        other => match other
            .strip_prefix("static-quorum:")
            .map(str::parse::<usize>)
        {
            Some(Ok(n)) if n >= 1 => Some(SplitBrainStrategy::StaticQuorum(n)),
            _ => {
                return Err(format!(
                    "`{s}` is not one of off, keep-majority, static-quorum:N (N ≥ 1), keep-oldest, keep-oldest-down-if-alone, down-all"
                ));
            }
        },
    };
    Ok(SplitBrain(strategy))
}

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
    if std::env::args_os().nth(1).is_some_and(|a| a == "certs") {
        return certs(CertsArgs::parse_from(std::env::args_os().skip(1)));
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
    let recorder = match recorder(&args) {
        Ok(recorder) => recorder,
        Err(error) => {
            eprintln!("datum-node: cannot serve the management endpoint: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    let discovery = match seed_discovery(&args) {
        Ok(discovery) => discovery,
        Err(error) => {
            eprintln!("datum-node: cannot discover seeds: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    let tls = match tls(&args) {
        Ok(tls) => tls,
        Err(error) => {
            eprintln!("datum-node: cannot load the TLS files: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    let mut config = ClusterConfig::builder()
        .cluster_name(args.cluster_name)
        .secret(args.secret)
        .bind_addr(args.bind)
        .seed_nodes(args.seeds.0)
        .heartbeat_interval(Duration::from_millis(args.heartbeat_ms))
        .acceptable_heartbeat_pause(Duration::from_millis(args.pause_ms))
        .monitored_by(args.monitored_by as usize)
        .gossip_fanout(args.gossip_fanout as usize)
        .gossip_interval(Duration::from_millis(args.gossip_ms))
        .downing_timeout(args.downing_ms.0)
        .max_frame_size(args.max_frame)
        .stable_after(Duration::from_millis(args.stable_after_ms))
        .build();
    config.split_brain = args.split_brain.0;
    config.advertised_addr = args.advertise;
    config.tls = tls;
    config.discovery = discovery;
    let mut stop = match StopSignals::install() {
        Ok(stop) => stop,
        Err(error) => {
            eprintln!("datum-node: cannot install signal handlers: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    #[cfg(feature = "postgres")]
    journaled::ADD_DELAY_MS.store(args.handle_ms, Ordering::Relaxed);
    // The journal is connected before the node joins: a bad URL or an
    // unreachable database fails the start without a member to down.
    let journal = match open_journal(args.journal_url.as_deref().filter(|_| args.counter)).await {
        Ok(journal) => journal,
        Err(error) => {
            eprintln!("datum-node: cannot open the journal: {error}");
            return ExitCode::from(EXIT_START_FAILED);
        }
    };
    // The management address is bound before the node joins: a taken port
    // fails the start with no member left to down.
    #[cfg(feature = "management")]
    let management_listener = match args.management_addr {
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => Some(listener),
            Err(error) => {
                eprintln!("datum-node: cannot serve the management endpoint on {addr}: {error}");
                return ExitCode::from(EXIT_START_FAILED);
            }
        },
        None => None,
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
    emit(&Line::member("started", &me, 0));
    let system = if args.counter {
        match Hosted::start(&node, args.shards, journal).await {
            Ok(system) => Some(system),
            Err(error) => {
                eprintln!("datum-node: cannot start the counter's sharded system: {error}");
                node.crash().await;
                return ExitCode::from(EXIT_START_FAILED);
            }
        }
    } else {
        None
    };
    // Kept until the node has left: `/ready` answers 503 while it leaves.
    #[cfg(feature = "management")]
    let _management = match (management_listener, recorder) {
        (Some(listener), Some(recorder)) => {
            let limits = ManagementLimits {
                max_connections: args.management_max_connections,
                header_timeout_ms: args.management_header_timeout_ms,
                idle_timeout_ms: args.management_idle_timeout_ms,
            };
            match serve_management(listener, limits, &node, system.as_ref(), recorder) {
                Ok(server) => {
                    emit(&Listening::new(server.local_addr(), started));
                    Some(server)
                }
                Err(error) => {
                    eprintln!("datum-node: cannot serve the management endpoint: {error}");
                    node.crash().await;
                    return ExitCode::from(EXIT_START_FAILED);
                }
            }
        }
        _ => None,
    };
    #[cfg(not(feature = "management"))]
    if let Some(never) = recorder {
        match never {}
    }
    let mut stats = tokio::time::interval(Duration::from_millis(args.stats_ms.max(1)));
    let print_stats = system.is_some() && args.stats_ms > 0;
    let drive = match &system {
        Some(system) if args.drive > 0 => {
            let options = DriveOptions {
                loops: args.drive,
                fresh: args.drive_fresh,
                rate: args.drive_rate,
                reliable: args.drive_reliable,
                timeout: Duration::from_millis(args.drive_timeout_ms),
                tags: args.drive_tags.then_some(tag_base(&me)),
            };
            match system.drive(&options, &me) {
                Ok(drive) => Some(drive),
                Err(error) => {
                    eprintln!("datum-node: cannot drive traffic: {error}");
                    node.crash().await;
                    return ExitCode::from(EXIT_START_FAILED);
                }
            }
        }
        _ => None,
    };

    let mut stopped_by_cluster = false;
    loop {
        tokio::select! {
            () = stop.recv() => break,
            _ = stats.tick(), if print_stats => {
                if let Some(system) = &system {
                    emit(&system.region_line("region_state", started));
                }
                if let Some(drive) = &drive {
                    emit(&drive.line(started));
                }
            }
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
    // A graceful leave waits for reliable credits to be confirmed first;
    // should the cluster down or remove the node meanwhile, it stops at
    // once, as it would have without the wait.
    if !stopped_by_cluster && let Some(drive) = &drive {
        let stopped = async { while state.changed().await.is_ok() {} };
        let settled = async {
            tokio::select! {
                () = drive.settle() => false,
                () = stopped => true,
            }
        };
        // (A node downed meanwhile may see its system stop, and the wait
        // end, before its state watch closes: its status says.)
        stopped_by_cluster = printing_events(&mut events, started, settled).await
            || state.has_changed().is_err()
            || node.current_state().self_status() == Some(MemberStatus::Down);
        emit(&drive.line(started));
    }

    if stopped_by_cluster {
        // The asks waiting when the system fenced have failed: their
        // loops count them before the last `drive` line.
        if let Some(drive) = &drive {
            // (Bounded past the longest an attempt may still wait.)
            let patience = Duration::from_millis(args.drive_timeout_ms) + Duration::from_secs(5);
            drive.ended(patience).await;
            emit(&drive.line(started));
        }
        drain(&mut events, started);
        if let Some(refusal) = node.join_refusal() {
            node.crash().await;
            emit(&Stopped::new("join_refused", started));
            eprintln!("datum-node: gave up joining: {refusal}");
            return ExitCode::from(EXIT_JOIN_REFUSED);
        }
        let reason = match node.current_state().self_status() {
            Some(MemberStatus::Down) => "downed",
            _ => "removed",
        };
        node.crash().await; // the driver is gone already; this closes the pipes
        emit(&Stopped::new(reason, started));
        eprintln!("datum-node: the cluster {reason} this node; it has stopped");
        return ExitCode::from(EXIT_STOPPED_BY_CLUSTER);
    }

    // Graceful leave: (reliable credits confirmed, above) the shards (the
    // node still routes meanwhile), then the membership; events keep being
    // printed throughout.
    if let Some(system) = &system {
        emit(&system.region_line("handoff_started", started));
        printing_events(&mut events, started, system.shutdown()).await;
        emit(&system.region_line("handed_off", started));
    }
    let leave = tokio::spawn({
        let node = node.clone();
        async move { node.shutdown().await }
    });
    let result = printing_events(&mut events, started, leave).await;
    drain(&mut events, started);
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

/// Runs `work` to its end, printing membership events meanwhile.
async fn printing_events<F: std::future::Future>(
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

/// The sharded system `--counter` runs: the counter, or with
/// `--journal-url` the journaled counter (its system typed by its journal).
enum Hosted {
    Counter(ShardedSystem),
    #[cfg(feature = "postgres")]
    Journaled(ShardedSystem<NoStore, PgPersistence>),
}

/// The `--journal-url` store.
#[cfg(feature = "postgres")]
type Journal = PgPersistence;
/// Without the `postgres` feature there is none.
#[cfg(not(feature = "postgres"))]
type Journal = std::convert::Infallible;

/// Connects the journal `url` names (none without a URL).
async fn open_journal(url: Option<&str>) -> Result<Option<Journal>, Box<dyn std::error::Error>> {
    let Some(url) = url else {
        return Ok(None);
    };
    #[cfg(feature = "postgres")]
    {
        // Connecting blocks (up to the store's connection timeout).
        let url = url.to_owned();
        let journal =
            tokio::task::spawn_blocking(move || PgPersistence::connect(&url, 4)).await??;
        Ok(Some(journal))
    }
    #[cfg(not(feature = "postgres"))]
    {
        let _ = url;
        Err("--journal-url needs a build with `--features postgres`".into())
    }
}

impl Hosted {
    /// Starts the system on `node` and registers its entity type.
    async fn start(
        node: &ClusterNode,
        shards: u32,
        journal: Option<Journal>,
    ) -> Result<Hosted, Box<dyn std::error::Error>> {
        let builder = ShardedSystem::builder()
            .num_shards(shards)
            .node(node.clone());
        let Some(journal) = journal else {
            let system = builder.start().await?;
            system
                .register::<counter::CounterEntity>(|_| counter::CounterEntity::default())
                .await?;
            return Ok(Hosted::Counter(system));
        };
        #[cfg(feature = "postgres")]
        {
            let system = builder.journal(journal).start().await?;
            system
                .register_event_sourced::<journaled::JournaledCounterEntity>(|_| Default::default())
                .await?;
            Ok(Hosted::Journaled(system))
        }
        #[cfg(not(feature = "postgres"))]
        match journal {}
    }

    /// A line about the hosted type's region on this node.
    fn region_line<'a>(&self, event: &'a str, started: Instant) -> RegionLine<'a> {
        match self {
            Hosted::Counter(system) => {
                RegionLine::of::<counter::Counter, _>(system, event, started)
            }
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) => {
                RegionLine::of::<journaled::JournaledCounter, _>(system, event, started)
            }
        }
    }

    /// `--drive`: asks `Get` of counters, `Add(1)` of journaled counters;
    /// `reliable`: credits to journaled counters through a producer of
    /// `me`'s; `rate` of them per second from each loop (0: unpaced).
    fn drive(&self, options: &DriveOptions, me: &UniqueAddress) -> Result<Drive, ShardingError> {
        let counts = Arc::new(DriveCounts {
            next_tag: AtomicU64::new(options.tags.unwrap_or(0)),
            refused: options.tags.map(|_| Default::default()),
            ..DriveCounts::default()
        });
        match self {
            Hosted::Counter(system) => {
                drive_counters::<counter::Counter, _, _>(system, |_| counter::Get, options, &counts)
            }
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) if options.reliable => {
                let producer = system.reliable_producer(
                    format!("drive-{}", me.node_id),
                    datum_cluster_sharding::ProducerConfig::default(),
                )?;
                let stop = Arc::new(AtomicBool::new(false));
                drive_credits(&producer, options.loops, options.rate, &stop);
                return Ok(Drive::Reliable { producer, stop });
            }
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) => {
                let tagged = options.tags.is_some();
                drive_counters::<journaled::JournaledCounter, _, _>(
                    system,
                    move |tag| counter::Add(if tagged { tag } else { 1 }),
                    options,
                    &counts,
                )
            }
        }
        // (Without the `postgres` feature, credits have no counter to go to.)
        #[cfg(not(feature = "postgres"))]
        let _ = (me, options.reliable);
        Ok(Drive::Asks(counts))
    }

    async fn shutdown(&self) {
        match self {
            Hosted::Counter(system) => system.shutdown().await,
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) => system.shutdown().await,
        }
    }
}

/// The `--journal-url` counter: event-sourced, its total recovered from
/// the journal wherever it starts.
#[cfg(feature = "postgres")]
#[path = "../../protocols/journaled.rs"]
mod journaled;

/// The first number of this node's `--drive-tags` attempts: its node id's
/// low 20 bits shifted left by 28 (room for 2^28 attempts each).
fn tag_base(me: &UniqueAddress) -> u64 {
    (me.node_id.0 & 0xf_ffff) << 28
}

/// How `--drive` drives.
struct DriveOptions {
    loops: u32,
    fresh: bool,
    /// Logical asks a second per loop (0: unpaced).
    rate: u32,
    reliable: bool,
    /// Each attempt's ask timeout.
    timeout: Duration,
    /// `--drive-tags`: the first attempt's number (later ones count up).
    tags: Option<u64>,
}

/// What `--drive` counts: logical asks answered, retries of failed asks,
/// asks given up after 30 s of retries, failed attempts whose error said
/// they may have been processed, and (`--drive-tags`) the numbers of
/// those whose error said they were not.
#[derive(Debug, Default)]
struct DriveCounts {
    acked: AtomicU64,
    retries: AtomicU64,
    missing: AtomicU64,
    maybe: AtomicU64,
    /// The next attempt's number.
    next_tag: AtomicU64,
    /// `--drive-tags` only: the refused attempts' numbers.
    refused: Option<std::sync::Mutex<Vec<u64>>>,
    /// Loops still asking: each ends when its system stops.
    running: AtomicU64,
}

impl DriveCounts {
    /// Counts a failed attempt (numbered `tag`) by what its error says
    /// of its processing.
    fn failed(&self, tag: u64, error: &ShardingError) {
        match error.processed() {
            Processed::Maybe => {
                self.maybe.fetch_add(1, Ordering::Relaxed);
            }
            Processed::No => {
                if let Some(refused) = &self.refused {
                    refused.lock().unwrap_or_else(|p| p.into_inner()).push(tag);
                }
            }
            // (Not a failure of delivery: the handler answered an error.)
            _ => {}
        }
    }

    /// Until every loop has ended, `patience` at most.
    async fn ended(&self, patience: Duration) {
        let deadline = tokio::time::Instant::now() + patience;
        while self.running.load(Ordering::Acquire) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `--drive N`: N asking loops, loop `i` asking `msg(number)` of entity
/// `drive-i` (with `--drive-fresh`, `drive-R-i` in its round R) forever,
/// at most `rate` logical asks per second (0: unpaced), each ask retried
/// until answered or given up after 30 s.
fn drive_counters<P, M, J>(
    system: &ShardedSystem<NoStore, J>,
    msg: impl Fn(u64) -> M + Clone + Send + Sync + 'static,
    options: &DriveOptions,
    counts: &Arc<DriveCounts>,
) where
    P: Protocol,
    M: Ask<P> + Send + 'static,
    J: Send + Sync + 'static,
{
    for i in 0..options.loops {
        let system = system.clone();
        let counts = counts.clone();
        let msg = msg.clone();
        let (fresh, rate, timeout) = (options.fresh, options.rate, options.timeout);
        counts.running.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(async move {
            let fixed = system.entity_ref::<P>(format!("drive-{i}"));
            let mut pace = Pace::new(rate);
            for round in 0u64.. {
                pace.wait().await;
                let entity = if fresh {
                    system.entity_ref::<P>(format!("drive-{round}-{i}"))
                } else {
                    fixed.clone()
                };
                if !ask_until_answered(&entity, &msg, timeout, &counts).await {
                    break;
                }
            }
            counts.running.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// One logical ask, retried; false once the system has stopped.
async fn ask_until_answered<P: Protocol, M: Ask<P>>(
    entity: &EntityRef<P>,
    msg: impl Fn(u64) -> M,
    timeout: Duration,
    counts: &DriveCounts,
) -> bool {
    const GIVE_UP: Duration = Duration::from_secs(30);
    let first = Instant::now();
    loop {
        let tag = counts.next_tag.fetch_add(1, Ordering::Relaxed);
        match entity.ask(msg(tag), timeout).await {
            Ok(_) => {
                counts.acked.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            Err(error) => {
                counts.failed(tag, &error);
                if matches!(
                    error,
                    ShardingError::ShuttingDown | ShardingError::ShutDownInFlight { .. }
                ) {
                    return false;
                }
                if first.elapsed() >= GIVE_UP {
                    counts.missing.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
                counts.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// `--drive-rate`: one drive loop's pace, at most `rate` a second.
struct Pace(Option<tokio::time::Interval>);

impl Pace {
    /// `rate` a second; 0 for no pace at all.
    fn new(rate: u32) -> Pace {
        Pace((rate > 0).then(|| {
            let mut every = tokio::time::interval(Duration::from_secs(1) / rate);
            // A slow answer delays the next ask; it does not earn a burst.
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every
        }))
    }

    /// Until the next one may go.
    async fn wait(&mut self) {
        if let Some(every) = &mut self.0 {
            every.tick().await;
        }
    }
}

/// What `--drive` runs.
enum Drive {
    /// Asks, each retried until answered (or given up).
    Asks(Arc<DriveCounts>),
    /// `--drive-reliable`: credits through a reliable producer; the loops
    /// stop sending once `stop` is set.
    #[cfg(feature = "postgres")]
    Reliable {
        producer: datum_cluster_sharding::ReliableProducer<journaled::JournaledCounter>,
        stop: Arc<AtomicBool>,
    },
}

impl Drive {
    /// The `drive` line now.
    fn line(&self, started: Instant) -> DriveLine {
        let t_ms = ms_since(started);
        match self {
            Drive::Asks(counts) => DriveLine {
                event: "drive",
                acked: counts.acked.load(Ordering::Relaxed),
                retries: counts.retries.load(Ordering::Relaxed),
                missing: counts.missing.load(Ordering::Relaxed),
                maybe: Some(counts.maybe.load(Ordering::Relaxed)),
                refused: (counts.refused.as_ref())
                    .map(|refused| refused.lock().unwrap_or_else(|p| p.into_inner()).clone()),
                unconfirmed: None,
                t_ms,
            },
            #[cfg(feature = "postgres")]
            Drive::Reliable { producer, .. } => {
                let stats = producer.stats();
                DriveLine {
                    event: "drive",
                    acked: stats.confirmed,
                    retries: stats.resent,
                    missing: stats.failed,
                    maybe: None,
                    refused: None,
                    unconfirmed: Some(stats.unconfirmed as u64),
                    t_ms,
                }
            }
        }
    }

    /// Once the system stopped (fenced): until the asking loops, whose
    /// last attempts failed then, have counted them (`patience` at most).
    async fn ended(&self, patience: Duration) {
        match self {
            Drive::Asks(counts) => counts.ended(patience).await,
            #[cfg(feature = "postgres")]
            Drive::Reliable { .. } => {}
        }
    }

    /// Before a graceful leave: reliable credits stop, and those sent are
    /// waited for (up to 30 s; what is left shows as `unconfirmed`).
    async fn settle(&self) {
        #[cfg(feature = "postgres")]
        if let Drive::Reliable { producer, stop } = self {
            stop.store(true, Ordering::Relaxed);
            if let Err(error) = producer.flush(Duration::from_secs(30)).await {
                eprintln!("datum-node: credits left unconfirmed: {error}");
            }
        }
    }
}

/// `--drive-reliable`: `loops` loops, loop `i` sending `Credit(1)` to
/// journaled counter `drive-i` through `producer`, at most `rate` a second
/// (0: as fast as its window lets it), until `stop` is set (or the system
/// shuts down).
#[cfg(feature = "postgres")]
fn drive_credits(
    producer: &datum_cluster_sharding::ReliableProducer<journaled::JournaledCounter>,
    loops: u32,
    rate: u32,
    stop: &Arc<AtomicBool>,
) {
    for i in 0..loops {
        let (producer, stop) = (producer.clone(), stop.clone());
        tokio::spawn(async move {
            let id: Arc<str> = format!("drive-{i}").into();
            let mut pace = Pace::new(rate);
            while !stop.load(Ordering::Relaxed) {
                pace.wait().await;
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                if producer
                    .send(id.clone(), journaled::Credit(1))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }
}

/// The `drive` line (SPEC §10c.2).
#[derive(Debug, Serialize)]
struct DriveLine {
    event: &'static str,
    acked: u64,
    retries: u64,
    missing: u64,
    /// Asks only: failed attempts whose error said they may have been
    /// processed.
    #[serde(skip_serializing_if = "Option::is_none")]
    maybe: Option<u64>,
    /// With `--drive-tags`: the numbers of the attempts whose error said
    /// they were not processed.
    #[serde(skip_serializing_if = "Option::is_none")]
    refused: Option<Vec<u64>>,
    /// With `--drive-reliable` only: credits sent and not yet confirmed.
    #[serde(skip_serializing_if = "Option::is_none")]
    unconfirmed: Option<u64>,
    t_ms: u64,
}

/// A line about the counter region on this node (SPEC §10c.2).
#[derive(Debug, Serialize)]
struct RegionLine<'a> {
    event: &'a str,
    type_name: &'a str,
    /// Shards hosted here.
    shards: usize,
    /// Their ids, ascending.
    shard_ids: Vec<u32>,
    /// Live entities in them.
    entities: usize,
    /// Shards being handed off.
    handing_off: usize,
    /// Messages waiting in buffers.
    buffered: usize,
    t_ms: u64,
}

impl<'a> RegionLine<'a> {
    fn of<P: Protocol, J>(
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
            t_ms: ms_since(started),
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
    emit(&event_line(event, ms_since(started)));
}

/// The line printed for one membership event, `t_ms` after start.
fn event_line(event: &MembershipEvent, t: u64) -> Line<'_> {
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
            t_ms: t,
        },
    }
}

/// One event line about a member (or about none: `null` fields). Fields are
/// written in declaration order, as SPEC §10c.2 shows them.
#[derive(Debug, Serialize)]
struct Line<'a> {
    event: &'a str,
    /// The socket address as text (`127.0.0.1:7355`).
    addr: Option<String>,
    /// 16 hex digits.
    node_id: Option<String>,
    incarnation: Option<u64>,
    /// Only on `member_removed`: the status before removal.
    #[serde(skip_serializing_if = "Option::is_none")]
    previous: Option<String>,
    /// Only on `join_refused`: the `Reject` reason and which side refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    t_ms: u64,
}

impl<'a> Line<'a> {
    fn member(event: &'a str, member: &UniqueAddress, t_ms: u64) -> Self {
        Line {
            event,
            addr: Some(member.addr.to_string()),
            node_id: Some(member.node_id.to_string()),
            incarnation: Some(member.incarnation),
            previous: None,
            reason: None,
            t_ms,
        }
    }
}

/// The line saying where the management endpoint listens.
#[cfg(feature = "management")]
#[derive(Debug, Serialize)]
struct Listening {
    event: &'static str,
    addr: String,
    t_ms: u64,
}

#[cfg(feature = "management")]
impl Listening {
    fn new(addr: SocketAddr, started: Instant) -> Self {
        Listening {
            event: "management_listening",
            addr: addr.to_string(),
            t_ms: ms_since(started),
        }
    }
}

/// The last line, when the node stops other than by a kill.
#[derive(Debug, Serialize)]
struct Stopped<'a> {
    event: &'a str,
    reason: &'a str,
    t_ms: u64,
}

impl<'a> Stopped<'a> {
    fn new(reason: &'a str, started: Instant) -> Self {
        Stopped {
            event: "stopped",
            reason,
            t_ms: ms_since(started),
        }
    }
}

/// `value` as one line of JSON: serde_json escapes every string, so no value
/// can break the line or the object.
fn json_line(value: &impl Serialize) -> serde_json::Result<String> {
    serde_json::to_string(value)
}

/// Writes one JSON line to stdout and flushes it. A closed stdout is not
/// fatal (`println!` would panic): the node keeps running, its output is lost.
fn emit(value: &impl Serialize) {
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

fn ms_since(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use datum_cluster_sharding::identity::NodeId;

    use super::*;

    fn member() -> UniqueAddress {
        UniqueAddress {
            addr: "127.0.0.1:44767".parse().expect("literal"),
            node_id: NodeId(0x93b3_0568_2c1a_07ee),
            incarnation: 1_796_042_329_732_518,
        }
    }

    /// `--help` names every exit code the binary has, each once.
    #[test]
    fn help_lists_every_exit_code() {
        use clap::CommandFactory;
        let help = Args::command().render_long_help().to_string();
        // The list as one line: clap wraps long help to the terminal.
        let after = help
            .split_once("Exit codes: ")
            .expect("an exit code list")
            .1;
        let codes = after.split("\n\n").next().unwrap_or_default();
        let codes = codes.split_whitespace().collect::<Vec<_>>().join(" ");
        let listed: Vec<u8> = codes
            .trim_end_matches('.')
            .split("; ")
            .map(|each| {
                let code = each.split(' ').next().unwrap_or_default();
                code.parse()
                    .unwrap_or_else(|_| panic!("{each:?} in {codes:?}"))
            })
            .collect();
        let every = [
            0,
            EXIT_START_FAILED,
            2,
            EXIT_STOPPED_BY_CLUSTER,
            EXIT_LEAVE_TIMED_OUT,
            EXIT_JOIN_REFUSED,
        ];
        assert_eq!(listed, every, "{codes}");
    }

    /// `datum-node certs` into a directory that holds them already refuses,
    /// naming the file, and writes nothing.
    #[cfg(feature = "tls")]
    #[test]
    fn certs_refuse_to_overwrite_naming_the_file() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let args = |nodes: &str| {
            CertsArgs::parse_from([
                "datum-node certs",
                "--out",
                dir.path().to_str().unwrap(),
                "--nodes",
                nodes,
            ])
        };
        let lines = write_certificates(&args("127.0.0.1,127.0.0.2")).expect("written");
        assert_eq!(lines.len(), 2, "{lines:?}");
        let error = write_certificates(&args("127.0.0.1")).expect_err("refused");
        let ca = dir.path().join("ca.pem");
        assert_eq!(
            error,
            format!(
                "refusing to overwrite {}, which exists (remove it or choose another --out)",
                ca.display()
            )
        );
        // Only a node's file there: named too, and no CA is written.
        let other = tempfile::tempdir().expect("a temporary directory");
        let key = other.path().join("node-1-key.pem");
        std::fs::write(&key, "").expect("written");
        let out = other.path().to_str().unwrap();
        let refused = CertsArgs::parse_from([
            "datum-node certs",
            "--out",
            out,
            "--nodes",
            "127.0.0.1,127.0.0.2",
        ]);
        let error = write_certificates(&refused).expect_err("refused");
        assert!(error.contains(&key.display().to_string()), "{error}");
        assert!(!other.path().join("ca.pem").exists());
    }

    /// `--drive-rate` paces a loop: 0 not at all, 50 a second 20 ms apart
    /// (never faster); 100 unless told.
    #[tokio::test]
    async fn drive_rate_paces_each_loop() {
        let started = Instant::now();
        let mut unpaced = Pace::new(0);
        for _ in 0..1_000 {
            unpaced.wait().await;
        }
        assert!(started.elapsed() < Duration::from_secs(1));
        let started = Instant::now();
        let mut paced = Pace::new(50);
        for _ in 0..11 {
            paced.wait().await;
        }
        // The first goes at once, the ten after it 20 ms apart.
        assert!(started.elapsed() >= Duration::from_millis(200));
        let flags = [
            "--cluster-name",
            "c",
            "--secret",
            "s",
            "--counter",
            "--drive",
            "2",
        ];
        let args =
            Args::try_parse_from(std::iter::once("datum-node").chain(flags)).expect("parses");
        assert_eq!(args.drive_rate, 100);
    }

    #[test]
    fn split_brain_flag_values() {
        assert_eq!(split_brain("off").expect("off").0, None);
        assert_eq!(
            split_brain("keep-majority").expect("parses").0,
            Some(SplitBrainStrategy::KeepMajority)
        );
        assert_eq!(
            split_brain("static-quorum:3").expect("parses").0,
            Some(SplitBrainStrategy::StaticQuorum(3))
        );
        assert_eq!(
            split_brain("keep-oldest-down-if-alone").expect("parses").0,
            Some(SplitBrainStrategy::KeepOldest {
                down_if_alone: true
            })
        );
        for bad in ["", "static-quorum:0", "static-quorum:x", "majority"] {
            assert!(split_brain(bad).is_err(), "{bad}");
        }
    }

    /// The lines keep the field names, order and number formatting SPEC
    /// §10c.2 shows.
    #[test]
    fn lines_are_as_spec_shows_them() {
        let m = member();
        let cases = [
            (
                json_line(&Line::member("started", &m, 0)),
                r#"{"event":"started","addr":"127.0.0.1:44767","node_id":"93b305682c1a07ee","incarnation":1796042329732518,"t_ms":0}"#,
            ),
            (
                json_line(&event_line(
                    &MembershipEvent::MemberRemoved {
                        member: m,
                        previous: MemberStatus::Down,
                    },
                    3059,
                )),
                r#"{"event":"member_removed","addr":"127.0.0.1:44767","node_id":"93b305682c1a07ee","incarnation":1796042329732518,"previous":"Down","t_ms":3059}"#,
            ),
            (
                json_line(&event_line(&MembershipEvent::CoordinatorChanged(None), 7)),
                r#"{"event":"coordinator_changed","addr":null,"node_id":null,"incarnation":null,"t_ms":7}"#,
            ),
            (
                json_line(&Stopped {
                    event: "stopped",
                    reason: "left",
                    t_ms: 12,
                }),
                r#"{"event":"stopped","reason":"left","t_ms":12}"#,
            ),
            (
                json_line(&RegionLine {
                    event: "handed_off",
                    type_name: "counter",
                    shards: 0,
                    shard_ids: Vec::new(),
                    entities: 0,
                    handing_off: 0,
                    buffered: 0,
                    t_ms: 214,
                }),
                r#"{"event":"handed_off","type_name":"counter","shards":0,"shard_ids":[],"entities":0,"handing_off":0,"buffered":0,"t_ms":214}"#,
            ),
            (
                json_line(&RegionLine {
                    event: "region_state",
                    type_name: "counter",
                    shards: 2,
                    shard_ids: vec![3, 17],
                    entities: 5,
                    handing_off: 0,
                    buffered: 0,
                    t_ms: 1_050,
                }),
                r#"{"event":"region_state","type_name":"counter","shards":2,"shard_ids":[3,17],"entities":5,"handing_off":0,"buffered":0,"t_ms":1050}"#,
            ),
            (
                json_line(&DriveLine {
                    event: "drive",
                    acked: 2_048,
                    retries: 3,
                    missing: 0,
                    maybe: Some(2),
                    refused: None,
                    unconfirmed: None,
                    t_ms: 1_050,
                }),
                r#"{"event":"drive","acked":2048,"retries":3,"missing":0,"maybe":2,"t_ms":1050}"#,
            ),
            (
                json_line(&DriveLine {
                    event: "drive",
                    acked: 2_048,
                    retries: 3,
                    missing: 0,
                    maybe: Some(2),
                    refused: Some(vec![0x1f2e_0000_0009]),
                    unconfirmed: None,
                    t_ms: 1_050,
                }),
                r#"{"event":"drive","acked":2048,"retries":3,"missing":0,"maybe":2,"refused":[34282428956681],"t_ms":1050}"#,
            ),
            (
                json_line(&DriveLine {
                    event: "drive",
                    acked: 9_120,
                    retries: 41,
                    missing: 0,
                    maybe: None,
                    refused: None,
                    unconfirmed: Some(0),
                    t_ms: 8_412,
                }),
                r#"{"event":"drive","acked":9120,"retries":41,"missing":0,"unconfirmed":0,"t_ms":8412}"#,
            ),
        ];
        for (line, expected) in cases {
            assert_eq!(line.expect("serialises"), expected);
        }
    }

    /// A string value with a quote, a backslash, a newline and a NUL stays
    /// on one line and parses back as exactly that value.
    #[test]
    fn hostile_text_is_escaped() {
        let hostile = "a\"b\\c\nd\0e";
        let line = json_line(&Line {
            previous: Some(hostile.to_owned()),
            ..Line::member(hostile, &member(), 1)
        })
        .expect("serialises");
        assert!(!line.contains('\n') && !line.contains('\0'), "{line}");
        let parsed: serde_json::Value = serde_json::from_str(&line).expect("valid JSON");
        assert_eq!(parsed["event"], hostile);
        assert_eq!(parsed["previous"], hostile);
        assert_eq!(parsed["incarnation"], 1_796_042_329_732_518_u64);
    }
}
