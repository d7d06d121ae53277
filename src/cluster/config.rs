//! How a cluster node is started.

use std::net::SocketAddr;
use std::time::Duration;

use typed_builder::TypedBuilder;

use crate::membership::MembershipConfig;
use crate::transport::{Secret, TransportConfig};

/// Settings of one cluster node. Only `cluster_name` is required.
///
/// ```
/// use std::time::Duration;
/// use datum_cluster_sharding::cluster::ClusterConfig;
/// let config = ClusterConfig::builder()
///     .cluster_name("orders-1")
///     .secret("s3cret")
///     .seed_nodes(vec!["127.0.0.1:7355".parse().unwrap()])
///     .build();
/// // Keep-majority split-brain resolution by default: an unreachable member
/// // is downed once the view has held still for `stable_after` (1 s).
/// assert_eq!(config.detect_and_down_time(), Some(Duration::from_millis(1_400)));
/// // Timeout downing, for a single zone or tests: the leader downs an
/// // unreachable member 200 ms after it is flagged (both sides of a
/// // partition go on).
/// let timeout = ClusterConfig::builder().cluster_name("orders-1").split_brain(None).build();
/// assert_eq!(timeout.detect_and_down_time(), Some(Duration::from_millis(600)));
/// ```
#[derive(Clone, Debug, TypedBuilder)]
#[non_exhaustive]
pub struct ClusterConfig {
    /// Nodes join only clusters of the same name; a peer with another name is refused.
    #[builder(setter(into))]
    pub cluster_name: String,
    /// Where to listen. Port 0 picks a free port; `ClusterNode::bound_addr` tells which.
    #[builder(default = SocketAddr::from(([127, 0, 0, 1], 0)))]
    pub bind_addr: SocketAddr,
    /// The address peers dial, when it differs from the bound one (binding to 0.0.0.0).
    #[builder(default, setter(strip_option))]
    pub advertised_addr: Option<SocketAddr>,
    /// Addresses of nodes to join through. Empty: form a new cluster alone.
    /// When this node's own address is the first seed and no other seed
    /// answers within the seed timeout, it forms the cluster.
    #[builder(default)]
    pub seed_nodes: Vec<SocketAddr>,
    /// The shared secret every node proves it knows (HMAC-SHA256
    /// challenge–response; it never crosses the wire). Default: empty — set
    /// one outside tests.
    #[builder(default = Secret::from(""), setter(into))]
    pub secret: Secret,
    /// How often each node heartbeats its watchers (`monitored_by`).
    #[builder(default = Duration::from_millis(100))]
    pub heartbeat_interval: Duration,
    /// The failure detector's threshold: how long past a missed heartbeat a
    /// peer may stay silent before it is marked unreachable.
    #[builder(default = Duration::from_millis(300))]
    pub acceptable_heartbeat_pause: Duration,
    /// How long a member stays unreachable before the leader downs it;
    /// `None` for manual downing only (`ClusterNode::down`).
    #[builder(default = Some(Duration::from_millis(200)))]
    pub downing_timeout: Option<Duration>,
    /// How many members watch each member (heartbeat it and detect its
    /// failure): its predecessors on the ring of members sorted by age
    /// (SPEC §10.5). The default, 5, needs no tuning up to 100 nodes (and
    /// beyond: the cost per member does not grow with the cluster).
    #[builder(default = 5)]
    pub monitored_by: usize,
    /// How many random members each gossip round and each change of the
    /// state goes to.
    #[builder(default = 2)]
    pub gossip_fanout: usize,
    /// How often a gossip round sends this node's state digest to
    /// `gossip_fanout` random members (changes spread at once; rounds only
    /// repair what was lost).
    #[builder(default = MembershipConfig::default().gossip_interval)]
    pub gossip_interval: Duration,
    /// The largest frame accepted on a pipe, checked before any allocation.
    #[builder(default = crate::wire::DEFAULT_MAX_FRAME_LEN)]
    pub max_frame_size: usize,
    /// How long a handshake may take before the connection is dropped.
    #[builder(default = Duration::from_secs(5))]
    pub handshake_timeout: Duration,
    /// The split-brain resolver (SPEC §10.5). Default: keep-majority. `None`
    /// keeps timeout downing instead (`downing_timeout`): faster to down a
    /// crashed node, but under a partition both sides down each other and
    /// go on — a choice for one zone, or for tests.
    #[builder(default = Some(crate::membership::SplitBrainStrategy::KeepMajority))]
    pub split_brain: Option<crate::membership::SplitBrainStrategy>,
    /// How long the resolver's view of a partition must stay the same
    /// before it decides.
    #[builder(default = Duration::from_secs(1))]
    pub stable_after: Duration,
    /// This node's roles. An entity type registered with
    /// `.on_role(..)` (`Registration::on_role`) is hosted only on nodes that have
    /// its role (elsewhere its region is proxy-only).
    #[builder(default, setter(transform = |roles: impl IntoIterator<Item = impl Into<String>>| roles.into_iter().map(Into::into).collect()))]
    pub roles: std::collections::BTreeSet<String>,
    /// The application version this node runs (default `"0"`): in a
    /// rolling upgrade of the application, shards go to the nodes of the
    /// newest one (after the newest protocol version, SPEC §13.2), so each
    /// moves once, onto a node of the new build. Sent to the sharding
    /// coordinator with the node's registrations; shown by
    /// `cluster_sharding_stats` and the management endpoint.
    #[builder(default)]
    pub app_version: crate::AppVersion,
    /// How many refusals from *each* seed a joining node takes before it
    /// gives up and stops: it gives up once every seed it asks has refused
    /// it this often (a seed that does not answer may still be starting, so
    /// one misconfigured seed among good ones stops nothing). Only refusals
    /// retrying cannot cure count: another cluster name, another secret, an
    /// unsupported protocol version, and under TLS a certificate refused by
    /// either side (another CA, expired, not naming its node) or TLS on one
    /// of the two nodes only (`MembershipEvent::JoinRefused`). Joins
    /// are retried every 250 ms, so the default, 5, gives up about a second
    /// after the first refusals; `ClusterNode::wait_until` then fails with
    /// `ClusterError::JoinRefused`. 0 never gives up (each refusal is still
    /// published).
    #[builder(default = 5)]
    pub join_refusal_limit: u32,
    /// TLS 1.3 on every pipe, mutually authenticated (feature `tls`; see
    /// [`Tls`](crate::transport::Tls) and [`TransportConfig::tls`]).
    /// Default `None`: plaintext.
    #[builder(default, setter(strip_option))]
    pub tls: Option<crate::transport::Tls>,
    /// Find the seeds while joining instead of `seed_nodes` (which must
    /// then be empty): from a file, or from DNS with feature `discovery`
    /// ([`SeedDiscovery`](crate::cluster::SeedDiscovery), SPEC §10b.1).
    #[builder(default, setter(strip_option))]
    pub discovery: Option<crate::cluster::SeedDiscovery>,
}

impl ClusterConfig {
    /// The membership settings this configuration implies.
    pub fn membership(&self) -> MembershipConfig {
        MembershipConfig {
            heartbeat_interval: self.heartbeat_interval,
            acceptable_heartbeat_pause: self.acceptable_heartbeat_pause,
            downing_timeout: self.downing_timeout,
            monitored_by: self.monitored_by,
            gossip_fanout: self.gossip_fanout,
            gossip_interval: self.gossip_interval,
            split_brain: self.split_brain,
            stable_after: self.stable_after,
            ..MembershipConfig::default()
        }
    }

    /// The transport settings this configuration implies.
    pub fn transport(&self) -> TransportConfig {
        let mut t = TransportConfig::new(self.cluster_name.clone(), self.secret.clone());
        t.bind_addr = self.bind_addr;
        t.advertised_addr = self.advertised_addr;
        t.max_frame_len = self.max_frame_size;
        t.handshake_timeout = self.handshake_timeout;
        t.tls = self.tls.clone();
        // A seed that is not up yet is retried by membership every 250 ms;
        // a long dial backoff would swallow those joins for seconds.
        t.backoff_max = Duration::from_secs(1);
        t
    }

    /// The longest time from a node's last heartbeat until it is Down
    /// (`None` with manual downing): heartbeat interval + pause + downing timeout.
    pub fn detect_and_down_time(&self) -> Option<Duration> {
        self.membership().detect_and_down_time()
    }
}
