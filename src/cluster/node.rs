//! The running node: a handle and the driver task behind it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Mutex, broadcast, mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use super::config::ClusterConfig;
use super::discovery::SeedDiscovery;
use crate::membership::{
    Command, MemberStatus, MembershipCore, MembershipError, MembershipEvent, MembershipMsg,
    MembershipState, Target,
};
use crate::model::identity::{NodeId, UniqueAddress};
use crate::ops::history::{ClusterEvent, ClusterEventKind, History};
use crate::transport::{ConnectError, Incoming, Transport};
use crate::util::warn_limit::{WarnLimit, warn_limited};
use crate::wire::RejectReason;

/// The transport channel membership messages travel on.
pub const MEMBERSHIP_CHANNEL: u16 = crate::wire::channels::MEMBERSHIP;

/// How many inbound membership messages may wait for the driver.
const INBOUND_CAPACITY: usize = 4_096;

/// How many events a slow subscriber may lag behind before it misses some.
const EVENT_CAPACITY: usize = 1_024;

/// What can go wrong starting or stopping a node.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// The listener could not be bound; nothing was started.
    #[error("could not bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The configuration was refused; nothing was started.
    #[error("invalid cluster configuration: {0}")]
    Config(String),
    /// The membership core refused an input.
    #[error(transparent)]
    Membership(#[from] MembershipError),
    /// A wait ran out before its condition held.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The node has stopped (left, was downed, or shut down).
    #[error("the cluster node has stopped")]
    Stopped,
    /// The node never became a member: a seed refused its handshake for a
    /// reason retrying cannot cure (another cluster name or secret, an
    /// unsupported protocol version, TLS refusing the connection). Returned
    /// by `wait_until` once the node has given up
    /// (`ClusterConfig::join_refusal_limit`), or when its wait ran out while
    /// the node was still joining and a seed had refused it.
    #[error("{refusal}")]
    JoinRefused {
        /// The latest refusal.
        refusal: JoinRefusal,
    },
}

/// A seed's refusal of this node's join (see [`ClusterError::JoinRefused`]).
/// Its `Display` names the seed and the cause, for an operator.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JoinRefusal {
    /// The seed address dialed.
    pub seed: SocketAddr,
    /// The reason in the `Reject` frame. A refusal by TLS itself, before
    /// any frame (see `tls`), is `CertificateMismatch`.
    pub reason: RejectReason,
    /// True when the seed refused this node; false when this node refused
    /// the seed (it could not verify the seed's proof of the secret), and
    /// when TLS refused the connection (its reason, in `tls`, says whose
    /// check failed).
    pub by_seed: bool,
    /// How many such refusals this node has taken so far, from every seed.
    pub refusals: u32,
    /// When TLS refused the connection (`ConnectError::Tls`): its reason —
    /// a certificate from another CA, expired or not naming its node, as
    /// this node's check or the seed's alert says; or TLS configured on one
    /// of the two nodes only. `None` for a `Reject` frame.
    pub tls: Option<String>,
}

impl std::fmt::Display for JoinRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(tls) = &self.tls {
            return write!(
                f,
                "join refused by seed {}: TLS refused the connection ({tls}; {} refusal(s))",
                self.seed, self.refusals
            );
        }
        let what = match self.reason {
            RejectReason::WrongCluster => "another cluster name",
            RejectReason::BadProof => "another cluster secret",
            RejectReason::UnsupportedVersion { .. } => "an unsupported protocol version",
            RejectReason::CertificateMismatch => {
                "a TLS certificate that does not name the address its node claims"
            }
            _ => "an incompatible handshake",
        };
        let who = if self.by_seed {
            "the seed refused this node"
        } else {
            "this node refused the seed"
        };
        write!(
            f,
            "join refused by seed {}: {who} ({what}: {:?}; {} refusal(s))",
            self.seed, self.reason, self.refusals
        )
    }
}

/// A seed dial's refusal that retrying cannot cure (see [`JoinRefusal`]).
struct Refused {
    reason: RejectReason,
    by_seed: bool,
    tls: Option<String>,
}

/// The refusals of a handshake that retrying cannot cure, from a seed dial.
/// Under TLS, every `ConnectError::Tls` is one: the transport reports a
/// connection that merely failed under TLS (closed, reset, as by a seed
/// over its handshake bounds) as `Closed` or `Io`, which are retried.
fn incurable(error: &ConnectError) -> Option<Refused> {
    let (reason, by_seed) = match error {
        ConnectError::Rejected(reason) => (reason, true),
        ConnectError::Refused(reason) => (reason, false),
        ConnectError::Tls(why) => {
            return Some(Refused {
                reason: RejectReason::CertificateMismatch,
                by_seed: false,
                tls: Some(why.clone()),
            });
        }
        _ => return None,
    };
    matches!(
        reason,
        RejectReason::WrongCluster
            | RejectReason::BadProof
            | RejectReason::UnsupportedVersion { .. }
            | RejectReason::CertificateMismatch
    )
    .then(|| Refused {
        reason: reason.clone(),
        by_seed,
        tls: None,
    })
}

/// This node's view as `datum_cluster_members` (by status) and
/// `datum_cluster_unreachable` gauges.
fn publish_members(state: &MembershipState) {
    use MemberStatus::*;
    let statuses = [
        (Joining, "joining"),
        (Up, "up"),
        (Leaving, "leaving"),
        (Exiting, "exiting"),
        (Down, "down"),
    ];
    let by_status = statuses.map(|(status, name)| {
        (
            name,
            state.members.iter().filter(|m| m.status == status).count(),
        )
    });
    let node = state.self_member.addr.to_string();
    crate::ops::telemetry::members(&node, &by_status, state.unreachable.len());
}

/// Requests from handles to the driver.
enum Control {
    Leave,
    Down(UniqueAddress, oneshot::Sender<Result<(), MembershipError>>),
}

/// A running cluster node. Cheap to clone; clones share the node.
#[derive(Clone)]
pub struct ClusterNode {
    inner: Arc<Inner>,
}

struct Inner {
    config: ClusterConfig,
    transport: Transport,
    me: UniqueAddress,
    control: mpsc::UnboundedSender<Control>,
    state: watch::Receiver<MembershipState>,
    events: broadcast::Sender<MembershipEvent>,
    /// What happened, as this node saw it (shared with the sharding layer).
    history: Arc<History>,
    /// The driver task; taken by the first `shutdown` or `crash`, which later
    /// callers wait behind.
    driver: Mutex<Option<JoinHandle<()>>>,
    /// The latest incurable refusal of a join, while the node was joining.
    refusal: Arc<std::sync::Mutex<Option<JoinRefusal>>>,
    /// What `shutdown` runs before the membership leave: the graceful stop
    /// of the sharded system attached to this node (its shards handed off).
    before_leave: std::sync::Mutex<Option<BeforeLeave>>,
}

/// The graceful stop of a layer attached to a node (a sharded system),
/// run by [`ClusterNode::shutdown`] before the node leaves.
pub(crate) type BeforeLeave =
    Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

impl Drop for Inner {
    /// The last handle dropped without `shutdown`: stop as a crash would (no
    /// goodbye); the driver's end closes the pipes.
    fn drop(&mut self) {
        if let Some(driver) = self.driver.get_mut().take() {
            driver.abort();
        }
    }
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode")
            .field("me", &self.inner.me)
            .finish_non_exhaustive()
    }
}

impl ClusterNode {
    /// Binds the listener, starts the driver and joins through the seed
    /// nodes (or forms a cluster alone when there are none).
    pub async fn start(config: ClusterConfig) -> Result<ClusterNode, ClusterError> {
        let membership = config.membership();
        membership.validate()?;
        if config.cluster_name.is_empty() {
            return Err(ClusterError::Config(
                "cluster_name must not be empty".into(),
            ));
        }
        if config.discovery.is_some() && !config.seed_nodes.is_empty() {
            return Err(ClusterError::Config(
                "give seed_nodes or discovery, not both".into(),
            ));
        }
        if config.secret.expose().is_empty() {
            tracing::warn!(cluster = %config.cluster_name, "no cluster secret set: any process that knows the cluster name can join");
        }
        let transport = Transport::bind(config.transport())
            .await
            .map_err(|source| ClusterError::Bind {
                addr: config.bind_addr,
                source,
            })?;
        let me = transport.local();
        let inbound = match transport.register(MEMBERSHIP_CHANNEL, INBOUND_CAPACITY) {
            Ok(rx) => rx,
            Err(e) => {
                transport.shutdown().await;
                return Err(ClusterError::Config(e.to_string()));
            }
        };
        let mut core = MembershipCore::new(me, membership, Instant::now())?;
        if let Ok(since_epoch) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)
        {
            core.align_ticks(Instant::now(), since_epoch);
        }
        let (discovered, discovery) = match &config.discovery {
            None => {
                core.join(Instant::now(), &config.seed_nodes)?;
                (None, None)
            }
            Some(discovery) => {
                core.join_discovered(Instant::now())?;
                let (tx, rx) = mpsc::channel(1);
                let task = tokio::spawn(discover(discovery.clone(), me, tx));
                (Some(rx), Some((discovery.clone(), AbortOnDrop(task))))
            }
        };
        let (state_tx, state) = watch::channel(core.state());
        // The node's metrics read from its start, before the view changes.
        publish_members(&state.borrow());
        crate::ops::telemetry::node_started(&me.addr.to_string());
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let (control, control_rx) = mpsc::unbounded_channel();
        let (refusals_tx, refusals) = mpsc::unbounded_channel();
        let refusal = Arc::new(std::sync::Mutex::new(None));
        let history = Arc::new(History::default());
        let driver = Driver {
            core,
            transport: transport.clone(),
            inbound,
            control: control_rx,
            state: state_tx,
            events: events.clone(),
            history: history.clone(),
            undecodable: WarnLimit::default(),
            unlisted: WarnLimit::default(),
            refusals_tx,
            refusals,
            refusal: refusal.clone(),
            refusal_limit: config.join_refusal_limit,
            refused_by: std::collections::HashMap::new(),
            seeds: config
                .seed_nodes
                .iter()
                .copied()
                .filter(|s| *s != me.addr)
                .collect(),
            discovered,
            discovery,
            decisions_counted: (0, 0),
        };
        let handle = tokio::spawn(driver.run());
        tracing::info!(node = %me, cluster = %config.cluster_name, "cluster node started");
        Ok(ClusterNode {
            inner: Arc::new(Inner {
                config,
                transport,
                me,
                control,
                state,
                events,
                history,
                driver: Mutex::new(Some(handle)),
                refusal,
                before_leave: std::sync::Mutex::new(None),
            }),
        })
    }

    /// This node's identity.
    pub fn self_address(&self) -> UniqueAddress {
        self.inner.me
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.inner.me.node_id
    }

    /// The address the listener is bound to (with port 0 resolved).
    pub fn bound_addr(&self) -> SocketAddr {
        self.inner.transport.bound_addr()
    }

    /// The configuration the node runs with.
    pub fn config(&self) -> &ClusterConfig {
        &self.inner.config
    }

    /// The node's pipes, for layers above membership (sharding).
    pub fn transport(&self) -> &Transport {
        &self.inner.transport
    }

    /// A snapshot of the membership as this node sees it now.
    pub fn current_state(&self) -> MembershipState {
        self.inner.state.borrow().clone()
    }

    /// Whether the node's driver still runs: false once it has stopped —
    /// downed, removed, shut down or crashed.
    pub fn is_running(&self) -> bool {
        self.inner.state.has_changed().is_ok()
    }

    /// A watch of the membership state, updated after every change.
    pub fn watch_state(&self) -> watch::Receiver<MembershipState> {
        self.inner.state.clone()
    }

    /// Membership events from now on. A subscriber that falls more than
    /// 1,024 events behind misses the oldest (`RecvError::Lagged`); the state
    /// watch never lags.
    pub fn subscribe(&self) -> broadcast::Receiver<MembershipEvent> {
        self.inner.events.subscribe()
    }

    /// What happened to the cluster as this node saw it, newest first: the
    /// last [`HISTORY_CAPACITY`](crate::history::HISTORY_CAPACITY) events of
    /// its membership and of the sharded system on it (SPEC §14.1).
    pub fn recent_events(&self) -> Vec<ClusterEvent> {
        self.inner.history.changed_after(0)
    }

    /// The history the sharding layer on this node records into.
    pub(crate) fn history(&self) -> &Arc<History> {
        &self.inner.history
    }

    /// Waits until `condition` holds for this node's membership state.
    pub async fn wait_until(
        &self,
        mut condition: impl FnMut(&MembershipState) -> bool,
        timeout: Duration,
    ) -> Result<MembershipState, ClusterError> {
        let mut watch = self.inner.state.clone();
        let waited = tokio::time::timeout(timeout, watch.wait_for(|s| condition(s))).await;
        let refused = || {
            self.join_refusal()
                .map(|refusal| ClusterError::JoinRefused { refusal })
        };
        match waited {
            Ok(Ok(state)) => Ok(state.clone()),
            Ok(Err(_closed)) => Err(refused().unwrap_or(ClusterError::Stopped)),
            Err(_elapsed) => Err(refused().unwrap_or(ClusterError::Timeout(timeout))),
        }
    }

    /// The latest refusal of this node's join by a seed, for a reason
    /// retrying cannot cure (another cluster name or secret, an unsupported
    /// protocol version, TLS refusing the connection), while the node has
    /// not become a member (`None` once it has), also after it gave up and
    /// stopped. Its `Display` names the seed and the cause, as a readiness
    /// probe may report it. See [`ClusterConfig::join_refusal_limit`].
    pub fn join_refusal(&self) -> Option<JoinRefusal> {
        if self.inner.state.borrow().self_status().is_some() {
            return None;
        }
        self.inner
            .refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Downs `member` by hand (needed when the downing timeout is `None`).
    /// Fails if this node is not a member yet, or `member` is unknown or
    /// already removed.
    pub async fn down(&self, member: UniqueAddress) -> Result<(), ClusterError> {
        let (reply, answer) = oneshot::channel();
        self.inner
            .control
            .send(Control::Down(member, reply))
            .map_err(|_| ClusterError::Stopped)?;
        answer
            .await
            .map_err(|_| ClusterError::Stopped)?
            .map_err(ClusterError::from)
    }

    /// Leaves the cluster gracefully, then closes the pipes. First, the
    /// sharded system running on this node (if any) shuts down as
    /// [`ShardedSystem::shutdown`](crate::ShardedSystem::shutdown) does: its
    /// shards are handed off to other members while this node still routes
    /// (at most the system's `handoff_timeout` + 1 s, then its
    /// `shutdown_timeout` for its entities). Then the membership leave —
    /// Leaving, Exiting, Removed — waiting at most the exit timeout plus two
    /// seconds; the node stops either way. A node that has not joined yet skips the leave:
    /// it stops at once after the system. Concurrent calls wait for the same outcome, and so
    /// does a system shutdown already under way. Do not await it inside an
    /// entity's handler (that entity's shard waits for the handler): spawn
    /// a task.
    pub async fn shutdown(&self) -> Result<(), ClusterError> {
        let before_leave = self
            .inner
            .before_leave
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(before_leave) = before_leave {
            before_leave().await;
        }
        let mut driver = self.inner.driver.lock().await;
        let Some(mut handle) = driver.take() else {
            return Ok(());
        };
        let _ = self.inner.control.send(Control::Leave);
        let limit = self.inner.config.membership().exit_timeout + Duration::from_secs(2);
        let result = match tokio::time::timeout(limit, &mut handle).await {
            Ok(_) => Ok(()),
            Err(_) => {
                handle.abort();
                let _ = handle.await;
                Err(ClusterError::Timeout(limit))
            }
        };
        self.inner.transport.shutdown().await;
        tracing::info!(node = %self.inner.me, "cluster node stopped");
        result
    }

    /// Waits for SIGTERM or SIGINT (Ctrl-C; elsewhere than Unix, Ctrl-C
    /// only), then stops gracefully with [`shutdown`](Self::shutdown): the
    /// attached sharded system's shards handed off first, then the leave.
    /// Returns early with [`ClusterError::Stopped`] (or
    /// [`ClusterError::JoinRefused`]) if the node stops by itself meanwhile
    /// — downed, removed, or refused by its seeds — and with
    /// [`ClusterError::Config`] if the signal handlers cannot be installed.
    ///
    /// ```no_run
    /// # async fn run(node: datum_cluster_sharding::cluster::ClusterNode) {
    /// // ... start a ShardedSystem on `node`, serve ...
    /// if let Err(error) = node.shutdown_on_signal().await {
    ///     eprintln!("stopped: {error}");
    /// }
    /// # }
    /// ```
    pub async fn shutdown_on_signal(&self) -> Result<(), ClusterError> {
        let signal = stop_signal().map_err(|e| {
            ClusterError::Config(format!("cannot install the signal handlers: {e}"))
        })?;
        let mut state = self.inner.state.clone();
        tokio::select! {
            () = signal => self.shutdown().await,
            _ = state.wait_for(|_| false) => {
                // The driver dropped the watch: the node stopped by itself.
                let refused = self.join_refusal();
                self.crash().await;
                Err(refused.map_or(ClusterError::Stopped, |refusal| ClusterError::JoinRefused { refusal }))
            }
        }
    }

    /// Sets (or clears) the graceful stop run before the leave.
    pub(crate) fn set_before_leave(&self, hook: Option<BeforeLeave>) {
        *self
            .inner
            .before_leave
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = hook;
    }

    /// Stops the node abruptly, as a crash would: the driver is aborted with
    /// no goodbye and the sockets are closed. For fault-injection tests; the
    /// other members must detect the loss.
    pub async fn crash(&self) {
        if let Some(handle) = self.inner.driver.lock().await.take() {
            handle.abort();
            let _ = handle.await;
        }
        self.inner.transport.shutdown().await;
    }
}

struct Driver {
    core: MembershipCore,
    transport: Transport,
    inbound: mpsc::Receiver<Incoming>,
    control: mpsc::UnboundedReceiver<Control>,
    state: watch::Sender<MembershipState>,
    events: broadcast::Sender<MembershipEvent>,
    history: Arc<History>,
    /// Rate limit of warnings about undecodable membership messages: a
    /// buggy peer sends them at gossip rate.
    undecodable: WarnLimit,
    /// Rate limit of the warning that discovery does not list this node.
    unlisted: WarnLimit,
    /// Seed dials report incurable refusals here.
    refusals_tx: mpsc::UnboundedSender<(SocketAddr, Refused)>,
    refusals: mpsc::UnboundedReceiver<(SocketAddr, Refused)>,
    /// The latest refusal, shared with the handles.
    refusal: Arc<std::sync::Mutex<Option<JoinRefusal>>>,
    refusal_limit: u32,
    /// Refusals so far, per seed; the node gives up once every seed it
    /// asks has refused `refusal_limit` times (one that does not answer at
    /// all may still be starting).
    refused_by: std::collections::HashMap<SocketAddr, u32>,
    /// The seeds this node asks (its own address left out).
    seeds: Vec<SocketAddr>,
    /// With discovery, while joining: each resolution's addresses.
    discovered: Option<mpsc::Receiver<Vec<SocketAddr>>>,
    /// The discovery settings and the task resolving them (stopped when
    /// this is dropped).
    discovery: Option<(SeedDiscovery, AbortOnDrop)>,
    /// The core's split-brain decisions the metrics have counted.
    decisions_counted: (u64, u64),
}

/// Resolves `discovery` every interval and sends what it finds, until the
/// driver stops listening (the node is a member, or gone). A failed
/// resolution is logged when its error changes; the seeds already found
/// stay.
async fn discover(
    discovery: SeedDiscovery,
    me: UniqueAddress,
    found: mpsc::Sender<Vec<SocketAddr>>,
) {
    let mut last_error = None;
    loop {
        match discovery.resolve().await {
            Ok(addrs) => {
                last_error = None;
                if found.send(addrs).await.is_err() {
                    return;
                }
            }
            Err(error) => {
                let text = error.to_string();
                if last_error.as_ref() != Some(&text) {
                    tracing::warn!(node = %me, %error, "seed discovery failed; trying again");
                    last_error = Some(text);
                }
                if found.is_closed() {
                    return;
                }
            }
        }
        tokio::time::sleep(discovery.interval.max(super::discovery::MIN_INTERVAL)).await;
    }
}

/// A task aborted when its handle is dropped (the driver's end, or its
/// abort on a crash).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The next resolution, or never without discovery.
async fn next_found(rx: &mut Option<mpsc::Receiver<Vec<SocketAddr>>>) -> Option<Vec<SocketAddr>> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

impl Driver {
    async fn run(mut self) {
        let me = self.core.self_address();
        loop {
            if self.execute() {
                break;
            }
            if self.discovered.is_some() && self.core.self_status().is_some() {
                // A member: discovery has done its part.
                self.discovered = None;
                self.discovery = None;
            }
            let deadline = self.core.poll_timeout();
            let result = tokio::select! {
                biased;
                incoming = self.inbound.recv() => match incoming {
                    Some(incoming) => {
                        // Serve what is queued, then a timer that fell due
                        // meanwhile: inbound first (heartbeats that arrived
                        // during a stall count), yet the timer cannot starve.
                        let mut result = self.on_incoming(incoming);
                        while let Ok(more) = self.inbound.try_recv() {
                            result = result.and(self.on_incoming(more));
                        }
                        if deadline.is_some_and(|d| d <= Instant::now()) {
                            result = result.and(self.core.handle_timeout(Instant::now()));
                        }
                        result
                    }
                    None => break,
                },
                control = self.control.recv() => match control {
                    Some(Control::Leave) => match self.core.leave(Instant::now()) {
                        // Not a member yet (or already out): nothing to leave.
                        Err(MembershipError::NotAMember | MembershipError::Terminated) => break,
                        other => other,
                    },
                    Some(Control::Down(member, reply)) => {
                        let result = self.core.down(Instant::now(), member);
                        let _ = reply.send(result.clone());
                        result
                    }
                    // Every handle is gone.
                    None => break,
                },
                Some(found) = next_found(&mut self.discovered) => self.on_discovered(found),
                Some((seed, refused)) = self.refusals.recv() => {
                    if self.on_refusal(seed, refused) {
                        break;
                    }
                    Ok(())
                }
                _ = sleep_until(deadline.map(tokio::time::Instant::from_std)) => self.core.handle_timeout(Instant::now()),
            };
            if let Err(error) = result {
                match error {
                    MembershipError::Bug(_) => {
                        tracing::error!(node = %me, %error, "membership core")
                    }
                    _ => tracing::debug!(node = %me, %error, "membership input refused"),
                }
            }
        }
        self.discovery = None;
        // Out of the cluster (removed, downed, or never joined): close the pipes.
        self.transport.shutdown().await;
        tracing::debug!(node = %me, "membership driver stopped");
    }

    /// Discovery found `found` (sorted): the seeds to ask now, and whether
    /// this node may form the cluster. A member stops listening.
    fn on_discovered(&mut self, found: Vec<SocketAddr>) -> Result<(), MembershipError> {
        if self.core.self_status().is_some() {
            self.discovered = None;
            return Ok(());
        }
        let me = self.core.self_address().addr;
        // A dual-stack name lists each node twice: only the addresses of
        // this node's own family count (for `required` and the lowest).
        let found: Vec<SocketAddr> = found
            .into_iter()
            .filter(|a| a.is_ipv4() == me.is_ipv4())
            .collect();
        let may_form = self
            .discovery
            .as_ref()
            .is_some_and(|(d, _)| d.may_form(me, &found));
        if found.len() >= self.discovery.as_ref().map_or(1, |(d, _)| d.required)
            && !found.contains(&me)
        {
            warn_limited!(self.unlisted, "seed discovery does not list this node's own address: it will never form a cluster by itself"; node = %self.core.self_address(), listed = found.len());
        }
        self.seeds = found.iter().copied().filter(|s| *s != me).collect();
        self.core.set_seeds(Instant::now(), &found, may_form)
    }

    /// `event` to the node's subscribers and its history.
    fn publish(&self, event: MembershipEvent) {
        self.history.membership(&event);
        let _ = self.events.send(event);
    }

    /// A seed refused this node's handshake (or this node the seed's, or TLS
    /// the connection) for a reason retrying cannot cure. While still
    /// joining: publish it, keep it for the handles, and true once the node
    /// should give up.
    fn on_refusal(&mut self, seed: SocketAddr, refused: Refused) -> bool {
        if self.core.self_status().is_some() {
            return false; // a member already: a stale dial's news
        }
        let Refused {
            reason,
            by_seed,
            tls,
        } = refused;
        let refusals = {
            let mut slot = self.refusal.lock().unwrap_or_else(|p| p.into_inner());
            let refusal = JoinRefusal {
                seed,
                reason: reason.clone(),
                by_seed,
                refusals: slot.as_ref().map_or(0, |r| r.refusals) + 1,
                tls,
            };
            tracing::error!(node = %self.core.self_address(), %refusal, "join refused");
            let refusals = refusal.refusals;
            *slot = Some(refusal);
            refusals
        };
        self.publish(MembershipEvent::JoinRefused {
            seed,
            reason,
            by_seed,
        });
        *self.refused_by.entry(seed).or_insert(0) += 1;
        let limit = self.refusal_limit;
        // (Discovery may list no seed at the moment: that is no reason.)
        let give_up = limit > 0
            && !self.seeds.is_empty()
            && self
                .seeds
                .iter()
                .all(|s| self.refused_by.get(s).is_some_and(|n| *n >= limit));
        if give_up {
            tracing::error!(node = %self.core.self_address(), refusals, "giving up joining: the seeds refuse this node's configuration");
        }
        give_up
    }

    fn on_incoming(&mut self, incoming: Incoming) -> Result<(), MembershipError> {
        match ciborium::from_reader::<MembershipMsg, _>(&incoming.payload[..]) {
            Ok(msg) => self.core.handle_message(Instant::now(), incoming.from, msg),
            Err(error) => {
                warn_limited!(self.undecodable, "undecodable membership message dropped"; from = %incoming.from, %error);
                Ok(())
            }
        }
    }

    /// Carries out the core's commands in order; true once the node is done.
    fn execute(&mut self) -> bool {
        let mut changed = false;
        for command in self.core.drain_commands() {
            match command {
                Command::Send { to, msg } => {
                    let mut payload = Vec::with_capacity(64);
                    if let Err(error) = ciborium::into_writer(&msg, &mut payload) {
                        tracing::error!(%error, "BUG: membership message not encodable");
                        continue;
                    }
                    let payload = Bytes::from(payload);
                    match to {
                        Target::Member(member) => {
                            // Failures are the failure detector's business.
                            let _ = self.transport.send(&member, MEMBERSHIP_CHANNEL, payload);
                        }
                        Target::Seed(addr) => {
                            // Dialing a seed may take a while: never block the driver on it.
                            let transport = self.transport.clone();
                            let refusals = self.refusals_tx.clone();
                            tokio::spawn(async move {
                                match transport.connect(addr).await {
                                    Ok(peer) => {
                                        let _ = transport.send(&peer, MEMBERSHIP_CHANNEL, payload);
                                    }
                                    Err(error) => {
                                        if let Some(refused) = incurable(&error) {
                                            let _ = refusals.send((addr, refused));
                                        }
                                        tracing::debug!(seed = %addr, %error, "seed not reachable")
                                    }
                                }
                            });
                        }
                    }
                }
                Command::Publish(event) => {
                    changed = true;
                    tracing::info!(node = %self.core.self_address(), ?event, "membership");
                    self.publish(event);
                }
                Command::MarkDown(member) => self.transport.mark_down(&member),
            }
        }
        if self.core.take_partition_changed()
            || changed
            || self.state.borrow().self_status() != self.core.self_status()
        {
            let state = self.core.state();
            publish_members(&state);
            self.state.send_replace(state);
        }
        let decisions = self.core.split_brain_decisions();
        if decisions != self.decisions_counted {
            let node = self.core.self_address().addr.to_string();
            let stayed = decisions.0 - self.decisions_counted.0;
            let went_down = decisions.1 - self.decisions_counted.1;
            for (decision, n) in [("stay", stayed), ("down", went_down)] {
                if n > 0 {
                    crate::ops::telemetry::split_brain_decisions(&node, decision, n);
                    self.history.record(
                        ClusterEventKind::SplitBrainDecision,
                        if decision == "stay" {
                            "the split-brain resolver kept this side: it downs the members it cannot reach"
                        } else {
                            "the split-brain resolver downed this side"
                        },
                    );
                }
            }
            self.decisions_counted = decisions;
        }
        self.core.is_terminated()
            || matches!(
                self.core.self_status(),
                Some(MemberStatus::Removed) | Some(MemberStatus::Down)
            )
    }
}

/// A future that completes at the first SIGTERM or SIGINT.
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
