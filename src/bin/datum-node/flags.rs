//! The command-line flags: `datum-node`'s own (each also read from a
//! `DATUM_*` environment variable) and those of `datum-node certs`, with
//! the parsers that check their values.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use datum_cluster_sharding::membership::SplitBrainStrategy;

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
2 bad flags; 3 downed or removed by the cluster; 4 the graceful leave did not complete in time; \
5 gave up joining: the seeds refused this node (another cluster name or secret, an unsupported protocol version, TLS refusing the connection).\n\
`datum-node certs --out DIR --nodes IP,IP,...` writes a test CA and node certificates for --tls-* (see `datum-node certs --help`).\n\
`datum-node copy-store --from SPEC --to SPEC` copies one embedded store into another (see `datum-node copy-store --help`)."
)]
pub(super) struct Args {
    /// Name of the cluster; nodes with another name are refused.
    #[arg(long, env = "DATUM_CLUSTER_NAME", value_parser = non_empty)]
    pub(super) cluster_name: String,

    /// Address to listen on. Port 0 picks a free port (printed in the
    /// `started` line).
    #[arg(long, env = "DATUM_BIND", default_value = "127.0.0.1:0")]
    pub(super) bind: SocketAddr,

    /// Address peers dial to reach this node, when it differs from --bind
    /// (needed when binding 0.0.0.0).
    #[arg(long, env = "DATUM_ADVERTISE")]
    pub(super) advertise: Option<SocketAddr>,

    /// Comma-separated addresses of nodes to join through. None: form a new
    /// cluster alone.
    #[arg(long, env = "DATUM_SEEDS", value_parser = seed_list, default_value = "")]
    pub(super) seeds: SeedList,

    /// Shared secret every node of the cluster must know (never sent).
    #[arg(long, env = "DATUM_SECRET", hide_env_values = true, value_parser = non_empty)]
    pub(super) secret: String,

    /// Heartbeat interval, in milliseconds.
    #[arg(long, env = "DATUM_HEARTBEAT_MS", default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    pub(super) heartbeat_ms: u64,

    /// How long past a missed heartbeat a peer may stay silent before it is
    /// marked unreachable, in milliseconds.
    #[arg(long, env = "DATUM_PAUSE_MS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    pub(super) pause_ms: u64,

    /// How many members watch each member: heartbeat it every heartbeat
    /// interval and detect its failure (its predecessors on the ring of
    /// members by age). The cost per node grows with this, not with the
    /// cluster's size.
    #[arg(long, env = "DATUM_MONITORED_BY", default_value_t = 5,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(super) monitored_by: u64,

    /// How many random members each gossip round and each change of the
    /// membership state goes to.
    #[arg(long, env = "DATUM_GOSSIP_FANOUT", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub(super) gossip_fanout: u64,

    /// How often a gossip round sends this node's state digest to
    /// --gossip-fanout random members, in milliseconds (changes spread at
    /// once; rounds repair what was lost).
    #[arg(long, env = "DATUM_GOSSIP_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    pub(super) gossip_ms: u64,

    /// How long an unreachable member stays so before the leader downs it,
    /// in milliseconds; `off` for manual downing only.
    #[arg(long, env = "DATUM_DOWNING_MS", default_value = "200", value_parser = downing)]
    pub(super) downing_ms: Downing,

    /// Largest frame accepted on a pipe, in bytes.
    #[arg(long, env = "DATUM_MAX_FRAME", default_value_t = datum_cluster_sharding::wire::DEFAULT_MAX_FRAME_LEN,
          value_parser = max_frame)]
    pub(super) max_frame: usize,

    /// The split-brain resolver: `keep-majority` (the default),
    /// `static-quorum:N`, `keep-oldest`, `keep-oldest-down-if-alone`,
    /// `down-all`, or `off` (timeout downing: faster, but under a partition
    /// each side downs the other). The losing side downs itself and its
    /// nodes exit with code 3.
    #[arg(long, env = "DATUM_SPLIT_BRAIN", default_value = "keep-majority", value_parser = split_brain)]
    pub(super) split_brain: SplitBrain,

    /// How long the resolver waits for a partition to stay the same before
    /// it decides, in milliseconds.
    #[arg(long, env = "DATUM_STABLE_AFTER_MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    pub(super) stable_after_ms: u64,

    /// Host the counter entity type (protocol `counter`: `tell Add`,
    /// `ask Get -> u64`) in a sharded system on this node. SIGTERM then
    /// hands its shards off to the other nodes, each counter's total with
    /// it, before the node leaves.
    #[arg(long, env = "DATUM_COUNTER")]
    pub(super) counter: bool,

    /// With --counter: which version of the counter to host. 1: protocol
    /// `counter` as above, its total moving with its shard; 2: the same
    /// lines and then `ask Reset -> u64` (sets the total to 0, answers the
    /// number of resets), its moving state a new shape that it reads from
    /// version 1's. Both run in one cluster: a rolling upgrade. With
    /// --journal-url, of the journaled counter: version 2 appends the same
    /// `Reset` and journals events of a new shape, reading version 1's.
    #[arg(long, env = "DATUM_COUNTER_VERSION", default_value_t = 1, requires = "counter",
          value_parser = clap::value_parser!(u8).range(1..=2))]
    pub(super) counter_version: u8,

    /// This node's application version (dot-separated numbers, such as
    /// `2.14.1`): in a rolling upgrade shards go to the nodes of the newest
    /// one, so each moves once (SPEC §13.2).
    #[arg(long, env = "DATUM_APP_VERSION", default_value = "0")]
    pub(super) app_version: datum_cluster_sharding::AppVersion,

    /// This node's roles, comma separated (`ClusterConfig::roles`): shown
    /// with its members on the management endpoint and its page.
    #[arg(long, env = "DATUM_ROLES", default_value = "", value_parser = role_list)]
    pub(super) roles: RoleList,

    /// The counter type's shard count (every node of the cluster must agree).
    #[arg(long, env = "DATUM_SHARDS", default_value_t = 128,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(datum_cluster_sharding::MAX_SHARDS)))]
    pub(super) shards: u32,

    /// With --counter: print the counter region's state every this many
    /// milliseconds (0: never).
    #[arg(long, env = "DATUM_STATS_MS", default_value_t = 0,
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    pub(super) stats_ms: u64,

    /// With --counter: also drive traffic — N loops, loop `i` asking `Get`
    /// of counter `drive-i` forever, each ask retried until it is answered
    /// (for at most 30 s) — and print a `drive` line with the counts at
    /// every `--stats-ms` tick (0: none).
    #[arg(long, env = "DATUM_DRIVE", default_value_t = 0, requires = "counter")]
    pub(super) drive: u32,

    /// With --drive: at most this many asks (or credits) per second from
    /// each loop, so that driving leaves the node's core to the node; 0 for
    /// as fast as the answers come.
    #[arg(long, env = "DATUM_DRIVE_RATE", default_value_t = 100, requires = "drive",
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub(super) drive_rate: u32,

    /// With --drive: how long each attempt of an ask waits for its answer
    /// before it counts as failed and is tried again.
    #[arg(long, env = "DATUM_DRIVE_TIMEOUT_MS", default_value_t = 1_000, requires = "drive",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    pub(super) drive_timeout_ms: u64,

    /// With --drive and --journal-url: each attempt of an ask adds a number
    /// of its own (unique to this node: its node id's low 20 bits above the
    /// attempt's count) instead of 1, and the `drive` line lists as
    /// `refused` the numbers of the attempts that failed with an error
    /// saying they were not processed — so a journal can be checked
    /// against what each failure said.
    #[arg(long, env = "DATUM_DRIVE_TAGS", requires_all = ["drive", "journal_url"],
          conflicts_with = "drive_reliable")]
    pub(super) drive_tags: bool,

    /// With --journal-url: each `Add` handler waits this long before it
    /// journals, so that asks are in flight for a while (a slow handler).
    #[arg(long, env = "DATUM_HANDLE_MS", default_value_t = 0, requires = "journal_url",
          value_parser = clap::value_parser!(u64).range(0..=MAX_MS))]
    pub(super) handle_ms: u64,

    /// With --drive: each loop asks a counter never asked before every time
    /// (loop `i`'s R-th ask goes to `drive-R-i`), so new entities, and new
    /// shards, keep being placed.
    #[arg(long, env = "DATUM_DRIVE_FRESH", requires = "drive")]
    pub(super) drive_fresh: bool,

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
    pub(super) drive_reliable: bool,

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
    pub(super) journal_url: Option<String>,

    /// TLS 1.3 on every pipe (needs a build with `--features tls`): this
    /// node's certificate chain, PEM. With --tls-key and --tls-ca.
    #[arg(long, env = "DATUM_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub(super) tls_cert: Option<std::path::PathBuf>,

    /// The certificate's private key, PEM.
    #[arg(long, env = "DATUM_TLS_KEY", requires = "tls_cert")]
    pub(super) tls_key: Option<std::path::PathBuf>,

    /// The CA certificates peers' certificates must chain to, PEM.
    #[arg(long, env = "DATUM_TLS_CA", requires = "tls_cert")]
    pub(super) tls_ca: Option<std::path::PathBuf>,

    /// The name every peer's certificate must carry (default: the peer's
    /// node address, as an IP subject alternative name).
    #[arg(long, env = "DATUM_TLS_PEER_NAME", requires = "tls_cert")]
    pub(super) tls_peer_name: Option<String>,

    /// Serve the management endpoint on this address (needs a build with
    /// `--features management`): `/alive` and `/ready` probes,
    /// `/cluster/members`, `/cluster/shards/{type}` and `/metrics`
    /// (Prometheus text). Port 0 picks a free port; the
    /// `management_listening` line tells which.
    #[arg(long, env = "DATUM_MANAGEMENT_ADDR")]
    pub(super) management_addr: Option<SocketAddr>,

    /// With --management-addr: the most connections the endpoint holds at
    /// once; one more is closed as soon as it is accepted. Default 256, or
    /// a quarter of the process's open-file limit when that is lower, so
    /// that the cluster's pipes keep the rest.
    #[arg(long, env = "DATUM_MANAGEMENT_MAX_CONNECTIONS", requires = "management_addr",
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    #[cfg_attr(not(feature = "management"), allow(dead_code))]
    pub(super) management_max_connections: Option<u32>,

    /// With --management-addr: how long a connection may take to send a
    /// request's head, in milliseconds, timed from when it opens and, kept
    /// alive, from each answer: a connection that sends nothing is closed
    /// after it.
    #[arg(long, env = "DATUM_MANAGEMENT_HEADER_TIMEOUT_MS", default_value_t = 10_000,
          requires = "management_addr",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    #[cfg_attr(not(feature = "management"), allow(dead_code))]
    pub(super) management_header_timeout_ms: u64,

    /// With --management-addr: how long a connection may move no byte
    /// either way (say, a client that stops reading its answer) before it
    /// is closed, in milliseconds.
    #[arg(long, env = "DATUM_MANAGEMENT_IDLE_TIMEOUT_MS", default_value_t = 30_000,
          requires = "management_addr",
          value_parser = clap::value_parser!(u64).range(1..=MAX_MS))]
    #[cfg_attr(not(feature = "management"), allow(dead_code))]
    pub(super) management_idle_timeout_ms: u64,

    /// With --management-addr: a bearer token every route but `/alive`,
    /// `/ready` and the page's static files asks for (`Authorization:
    /// Bearer TOKEN`; the page takes it from `#token=TOKEN` in its address,
    /// or asks for it). Without one, an endpoint on a non-loopback address
    /// logs a warning. Prefer the environment variable: a flag shows in the
    /// process list.
    #[arg(
        long,
        env = "DATUM_MANAGEMENT_TOKEN",
        requires = "management_addr",
        hide_env_values = true,
        value_parser = bearer_token
    )]
    #[cfg_attr(not(feature = "management"), allow(dead_code))]
    pub(super) management_token: Option<String>,

    /// Find the seeds while joining instead of --seeds: `file:PATH` (one
    /// `IP:port` per line, read again every second), `dns:NAME:PORT` (the
    /// name's A/AAAA records, each with PORT) or `dns-srv:NAME` (its SRV
    /// records); DNS needs a build with `--features discovery`.
    #[arg(long, env = "DATUM_DISCOVERY", value_parser = discovery, conflicts_with = "seeds")]
    pub(super) discovery: Option<Discovery>,

    /// With --discovery dns: ask these name servers (`IP:port`, comma
    /// separated) instead of the system's.
    #[arg(long, env = "DATUM_DISCOVERY_NAMESERVERS", value_parser = seed_list, requires = "discovery")]
    pub(super) discovery_nameservers: Option<SeedList>,

    /// With --discovery: how many addresses must be found, this node's
    /// among them, before the lowest may form a new cluster (set it to the
    /// number of nodes that start together).
    #[arg(long, env = "DATUM_DISCOVERY_REQUIRED", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=1_000))]
    pub(super) discovery_required: u32,
}

/// A `--discovery` source, as given.
#[derive(Clone, Debug)]
pub(super) enum Discovery {
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

/// `datum-node certs`: a test CA and node certificates.
#[derive(Debug, Parser)]
#[command(
    name = "datum-node certs",
    about = "Writes a test CA and one certificate per node (PEM) into a directory, for a TLS \
cluster: ca.pem, node-<i>.pem, node-<i>-key.pem (new files; the CA's key is not kept). Needs a build with `--features tls`."
)]
pub(super) struct CertsArgs {
    /// The directory to write into (created if missing).
    #[arg(long)]
    pub(super) out: std::path::PathBuf,

    /// The nodes' names, comma-separated: IP addresses (each node's
    /// advertised IP) or DNS names (with --tls-peer-name).
    #[arg(long, value_delimiter = ',', required = true)]
    pub(super) nodes: Vec<String>,

    /// How long the certificates are valid, in days.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3650))]
    pub(super) days: u64,
}

/// `datum-node copy-store`: one embedded store copied into another.
#[cfg(feature = "embedded")]
#[derive(Debug, Parser)]
#[command(
    name = "datum-node copy-store",
    about = "Copies every record of one embedded store into another, empty one, of either kind \
and any layout: the one-shot move from a redb file to redb lanes or to fjall. Stop every node \
that uses either store first. A store is named redb:FILE (one redb file), redb-lanes=N:DIR (N \
redb files in DIR) or fjall:DIR (needs a build with `--features fjall`)."
)]
pub(super) struct CopyStoreArgs {
    /// The store to read: redb:FILE, redb-lanes=N:DIR or fjall:DIR.
    #[arg(long, value_parser = super::copy_store::store_spec)]
    pub(super) from: super::copy_store::StoreSpec,

    /// The store to write (created if missing; refused unless empty).
    #[arg(long, value_parser = super::copy_store::store_spec)]
    pub(super) to: super::copy_store::StoreSpec,
}

/// The seed addresses (a newtype so clap takes the whole list as one value).
#[derive(Clone, Debug)]
pub(super) struct SeedList(pub(super) Vec<SocketAddr>);

/// The split-brain strategy, or `None` for timeout downing.
#[derive(Clone, Copy, Debug)]
pub(super) struct SplitBrain(pub(super) Option<SplitBrainStrategy>);

pub(super) fn split_brain(s: &str) -> Result<SplitBrain, String> {
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
pub(super) struct Downing(pub(super) Option<Duration>);

/// `--roles`: names without spaces, comma separated.
#[derive(Clone, Debug, Default)]
pub(super) struct RoleList(pub(super) Vec<String>);

fn role_list(s: &str) -> Result<RoleList, String> {
    let roles: Vec<String> = (s.split(',').map(str::trim))
        .filter(|r| !r.is_empty())
        .map(str::to_owned)
        .collect();
    match roles
        .iter()
        .find(|r| r.chars().any(|c| c.is_whitespace() || c.is_control()))
    {
        Some(bad) => Err(format!("a role is a name without spaces, not {bad:?}")),
        None => Ok(RoleList(roles)),
    }
}

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

/// A bearer token as RFC 6750 writes one (letters, digits, `-._~+/`, then
/// any `=`): an empty one (a variable set but empty, say a missing secret)
/// would leave the endpoint open, and one with a space or a line break (a
/// secret read from a file) could never be sent.
fn bearer_token(text: &str) -> Result<String, String> {
    let body = text.trim_end_matches('=');
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._~+/".contains(c);
    if body.is_empty() || !body.chars().all(allowed) {
        return Err("a token of letters, digits and -._~+/ (then any =), not empty".into());
    }
    Ok(text.to_owned())
}
