//! The management endpoint (feature `management`): a node's health probes,
//! its view of the members and of the shards, and its metrics, over HTTP,
//! with the routes of Akka Management (SPEC §14.1).
//!
//! ```no_run
//! # async fn run(node: datum_cluster_sharding::cluster::ClusterNode,
//! #              system: datum_cluster_sharding::ShardedSystem) -> std::io::Result<()> {
//! use datum_cluster_sharding::management::Management;
//!
//! let server = Management::new(node)
//!     .system(&system)
//!     .serve("127.0.0.1:8558".parse().unwrap())
//!     .await?;
//! println!("probes at http://{}/ready", server.local_addr());
//! # server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! | route | answer |
//! |---|---|
//! | `GET /` | the live cluster page for a person: members, shards by node, load, events (its script and style at `/page.js` and `/page.css`, compiled into the binary) |
//! | `GET /alive` | 200 while the node runs; 503 once it stopped (downed, removed, shut down) |
//! | `GET /ready` | 200 once the node is Up and its regions are registered; 503 before, and while leaving or fenced |
//! | `GET /cluster/members` | this node's view of the membership, JSON |
//! | `GET /cluster/shards` | the entity types registered here, JSON |
//! | `GET /cluster/shards/{type}` | where each shard of a type lives, its generation, what waits in buffers, JSON |
//! | `GET /cluster/shards/{type}?ids=N` | the same, with the ids of each hosted shard's live entities (at most `N` a shard) |
//! | `GET /cluster/events` | what happened to the cluster as this node saw it, newest first (`?after=N`: only those whose change number is above `N`), JSON |
//! | `GET /cluster/load/{type}` | every member's asks of a type, their failures by kind and latency buckets, counted since it started, with its live entities and roles, JSON |
//! | `GET /metrics` | the Prometheus recorder's text, when one was given |
//!
//! `HEAD` answers as `GET` does, without the body (as HTTP expects of a
//! server that answers `GET`); any other method gets 405. With a
//! [`token`](Management::token), every route but `/alive`, `/ready` and
//! the page's three files answers 401 without `Authorization: Bearer`.
//!
//! The endpoint reads what the node and system already publish; serving it
//! takes no lock a message path holds for longer than a shard's summary.
//! Listing ids walks each hosted shard's entities once more under its
//! lock (as counting them does), and the ids are bounded per shard
//! ([`MAX_IDS_PER_SHARD`]) and in all ([`MAX_IDS_IN_ALL`]), so that no
//! query can make an answer grow with the entities hosted.
//!
//! It holds at most [`DEFAULT_MAX_CONNECTIONS`] connections at once (or a
//! quarter of the process's open-file limit, when that is lower), closes one
//! more as soon as it is accepted, and closes a connection that takes longer
//! than [`DEFAULT_HEADER_READ_TIMEOUT`] to send a request's head (an idle
//! one among them) or moves no byte for [`DEFAULT_IDLE_TIMEOUT`]: however
//! many connections reach it, it never takes the descriptors the cluster's
//! pipes need. Each is configurable ([`Management::max_connections`],
//! [`Management::header_read_timeout`], [`Management::idle_timeout`]).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::cluster::ClusterNode;
use crate::membership::MemberStatus;
use crate::model::identity::UniqueAddress;
use crate::system::{ShardedSystem, Shared};
use crate::util::warn_limit::{WarnLimit, warn_limited};

/// How often the Prometheus recorder's upkeep runs (it drains histogram
/// samples into their buckets).
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// The content type of Prometheus's text exposition format.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The most connections the endpoint holds at once when no limit is given,
/// unless the process's open-file limit calls for fewer
/// ([`Management::max_connections`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// How long a connection may take to send a request's head, by default
/// ([`Management::header_read_timeout`]).
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection may move no byte either way, by default
/// ([`Management::idle_timeout`]).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How many ids of each hosted shard's live entities
/// `/cluster/shards/{type}?ids` lists when no number is given.
pub const DEFAULT_IDS_PER_SHARD: usize = 100;

/// The longest header-read or idle timeout taken (a longer one, say
/// `Duration::MAX` for "never", is taken as this): a deadline past it would
/// overflow the clock.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// The most ids of one shard `/cluster/shards/{type}?ids=N` lists: a
/// greater `N` is refused (400).
pub const MAX_IDS_PER_SHARD: usize = 10_000;

/// The most ids one answer of `/cluster/shards/{type}` lists over all its
/// shards, whatever `N` (the shards take from it in ascending order; those
/// past it list none and are marked cut); their bytes are bounded too, at
/// 8 MiB, so that an answer stays a few megabytes on a node hosting many
/// shards, however long its ids.
pub const MAX_IDS_IN_ALL: usize = 100_000;

/// The highest connection limit taken (far past any open-file limit; the
/// permits of the limit are counted in `u32`).
const MAX_CONNECTIONS_CAP: usize = 1 << 20;

/// How long the accept loop waits after a failed accept other than a
/// connection reset before it tries again: out of descriptors, most likely,
/// and retrying at once would only spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// How many connections the endpoint holds, and for how long.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// `None`: [`default_max_connections`], read when serving starts.
    max_connections: Option<usize>,
    header_read_timeout: Duration,
    idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: None,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

/// What the endpoint serves: a cluster node, and optionally the sharded
/// system on it and a Prometheus recorder's handle. Build it, then
/// [`serve`](Self::serve) it.
#[derive(Clone)]
pub struct Management {
    node: ClusterNode,
    /// Held weakly: the endpoint does not keep a dropped system alive.
    system: Option<Weak<Shared>>,
    prometheus: Option<PrometheusHandle>,
    limits: Limits,
    /// The bearer token every data route asks for, if any.
    token: Option<Arc<str>>,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Management")
            .field("node", &self.node.self_address())
            .field("system", &self.system.is_some())
            .field("prometheus", &self.prometheus.is_some())
            .field("limits", &self.limits)
            .field("token", &self.token.as_ref().map(|_| "…"))
            .finish()
    }
}

/// Whether a node should take traffic, as `/ready` answers.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Readiness {
    /// Up, and every region registered with the coordinator.
    Ready,
    /// Not ready, for this reason (the text `/ready` returns).
    NotReady(String),
}

impl Readiness {
    /// Whether the node is ready.
    pub fn is_ready(&self) -> bool {
        matches!(self, Readiness::Ready)
    }
}

impl Management {
    /// The endpoint of `node`: probes and members.
    pub fn new(node: ClusterNode) -> Self {
        Management {
            node,
            system: None,
            prometheus: None,
            limits: Limits::default(),
            token: None,
        }
    }

    /// Also the sharded system on the node: `/cluster/shards`, and `/ready`
    /// waits for its regions to be registered.
    pub fn system<S, J>(mut self, system: &ShardedSystem<S, J>) -> Self {
        self.system = Some(system.downgrade());
        self
    }

    /// Also `/metrics`: the text of the Prometheus recorder this handle
    /// belongs to (the application installs the recorder, before it starts
    /// the node, so the node's metrics register with it; SPEC §14). Build
    /// it with [`telemetry::prometheus_builder`](crate::ops::telemetry::prometheus_builder),
    /// which exports the latencies as histograms with buckets.
    pub fn prometheus(mut self, handle: PrometheusHandle) -> Self {
        self.prometheus = Some(handle);
        self
    }

    /// Asks every route but the probes (`/alive`, `/ready`) and the page's
    /// three static files (`/`, `/page.js`, `/page.css`, which hold no
    /// data) for `Authorization: Bearer <token>`; a request without it, or
    /// with another, is answered 401 with `WWW-Authenticate: Bearer`. The
    /// scheme is matched without regard to case (RFC 7235); the token is
    /// compared in constant time, apart from its length. An empty token
    /// would let anyone in who sends `Bearer ` with nothing after it, so it
    /// is taken as none, with a warning.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        let token: String = token.into();
        if token.is_empty() {
            tracing::warn!(
                "the management endpoint was given an empty token: it takes none, and its routes stay open"
            );
        }
        self.token = (!token.is_empty()).then(|| Arc::from(token));
        self
    }

    /// Holds at most `n` connections at once (at least 1); a connection
    /// past the limit is closed as soon as it is accepted, so the endpoint
    /// never holds more descriptors than this. Without it the limit is
    /// [`DEFAULT_MAX_CONNECTIONS`], or a quarter of the process's open-file
    /// limit when that is lower (read on Linux), leaving the rest to the
    /// cluster's pipes; give a limit well below that file limit too.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.limits.max_connections = Some(n.clamp(1, MAX_CONNECTIONS_CAP));
        self
    }

    /// How long a connection may take to send a request's head, timed from
    /// when it starts waiting for one: when it opens, and on a kept-alive
    /// connection after each answer. So a connection that sends nothing,
    /// or trickles its head, is closed after it, and so is one kept alive
    /// that sends no next request. Default [`DEFAULT_HEADER_READ_TIMEOUT`].
    /// Taken between 1 ms and [`MAX_TIMEOUT`].
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.limits.header_read_timeout = timeout.clamp(Duration::from_millis(1), MAX_TIMEOUT);
        self
    }

    /// How long a connection may go without a byte moving either way before
    /// it is closed, whatever it is doing: a client that stops reading its
    /// answer holds its connection no longer than this. Default
    /// [`DEFAULT_IDLE_TIMEOUT`].
    /// Taken between 1 ms and [`MAX_TIMEOUT`].
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.limits.idle_timeout = timeout.clamp(Duration::from_millis(1), MAX_TIMEOUT);
        self
    }

    /// Whether the node should take traffic now:
    /// - its cluster node runs and is `Up` (not joining, leaving, downed);
    /// - its system (if given) is not shutting down, stopped or fenced, no
    ///   region was refused by the coordinator, and the coordinator's table
    ///   has come since the regions registered.
    pub fn readiness(&self) -> Readiness {
        let not = |why: &str| Readiness::NotReady(why.to_owned());
        // A seed's refusal (another secret, TLS keeping the node out) is
        // what an operator needs to read first.
        let refused = |why: &str| match self.node.join_refusal() {
            Some(refusal) => Readiness::NotReady(format!("{why}: {refusal}")),
            None => not(why),
        };
        if !self.node.is_running() {
            return match self.node.join_refusal() {
                Some(refusal) => Readiness::NotReady(format!(
                    "the node has stopped: it gave up joining: {refusal}"
                )),
                None => not("the node has stopped"),
            };
        }
        match self.node.current_state().self_status() {
            Some(MemberStatus::Up) => {}
            None => return refused("not a member yet"),
            Some(MemberStatus::Joining) => return not("joining"),
            Some(MemberStatus::Leaving | MemberStatus::Exiting) => return not("leaving"),
            Some(MemberStatus::Down | MemberStatus::Removed) => return not("out of the cluster"),
        }
        let Some(system) = &self.system else {
            return Readiness::Ready;
        };
        let Some(system) = system.upgrade() else {
            return not("the sharded system was dropped");
        };
        if system.is_shut_down() {
            return not("the sharded system stopped (shut down or fenced)");
        }
        if system.is_leaving() {
            return not("leaving: handing its shards off");
        }
        // With a cluster node: the coordinator this node follows.
        let following = system.coordinator_status().map(|c| c.acting);
        for region in system.all_regions() {
            if let Some(refused) = region.refusal() {
                return Readiness::NotReady(format!("entity type {}: {refused}", region.type_name));
            }
            if let Some(coordinator) = following
                && (coordinator.is_none() || region.accepted_by() != coordinator)
            {
                return Readiness::NotReady(format!(
                    "entity type {}: not registered with the coordinator yet",
                    region.type_name
                ));
            }
        }
        Readiness::Ready
    }

    /// Binds `addr` and serves the routes on a task of its own, until the
    /// returned server is shut down or dropped.
    pub async fn serve(self, addr: SocketAddr) -> std::io::Result<ManagementServer> {
        self.serve_on(TcpListener::bind(addr).await?)
    }

    /// Serves the routes on `listener` (bound beforehand, say before the
    /// node joins, so that a taken port fails before there is a member to
    /// down). With a Prometheus handle, its upkeep runs every 5 s while the
    /// endpoint serves, so histogram samples do not pile up unscraped.
    pub fn serve_on(self, listener: TcpListener) -> std::io::Result<ManagementServer> {
        let local_addr = listener.local_addr()?;
        if self.token.is_none() && !local_addr.ip().is_loopback() {
            tracing::warn!(addr = %local_addr, "the management endpoint listens beyond this host with no token: anyone who reaches it can read the cluster's members, placement and metrics (give it a token)");
        }
        let token = self.token.clone();
        let upkeep = self.prometheus.clone();
        let limits = self.limits;
        let max_connections = limits
            .max_connections
            .unwrap_or_else(default_max_connections);
        let router = axum::Router::new()
            .route("/", get(page))
            .route("/page.js", get(page_script))
            .route("/page.css", get(page_style))
            .route("/alive", get(alive))
            .route("/ready", get(ready))
            .route("/cluster/members", get(members))
            .route("/cluster/shards", get(entity_types))
            .route("/cluster/shards/{type_name}", get(shards))
            .route("/cluster/events", get(events))
            .route("/cluster/load/{type_name}", get(load))
            .route("/metrics", get(metrics))
            .with_state(Arc::new(self));
        // Every request is counted, then let through or refused for want
        // of the token (unknown paths too: the layer wraps the fallback).
        let requests = Arc::new(AtomicU64::new(0));
        let counted = requests.clone();
        let router = router.layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                counted.fetch_add(1, Ordering::Relaxed);
                let allowed = authorized(token.as_deref(), &request);
                async move {
                    if allowed {
                        next.run(request).await
                    } else {
                        unauthorized()
                    }
                }
            },
        ));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let upkeep = async move {
                let Some(handle) = upkeep else {
                    return std::future::pending().await;
                };
                let mut every = tokio::time::interval(UPKEEP_EVERY);
                loop {
                    every.tick().await;
                    handle.run_upkeep();
                }
            };
            let accepting = accept(listener, router, max_connections, limits, stopped);
            tokio::select! {
                () = accepting => {}
                () = upkeep => {}
            }
        });
        Ok(ManagementServer {
            local_addr,
            max_connections,
            requests,
            stop: Some(stop),
            task: Some(task),
        })
    }
}

/// The connection limit when none is given: [`DEFAULT_MAX_CONNECTIONS`],
/// or a quarter of the process's open-file limit when that is lower, so
/// that management traffic cannot take the descriptors the cluster's pipes
/// need.
fn default_max_connections() -> usize {
    let files = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| open_file_limit(&limits));
    files.map_or(DEFAULT_MAX_CONNECTIONS, |files| {
        (files / 4).clamp(1, DEFAULT_MAX_CONNECTIONS)
    })
}

/// The soft open-file limit in the text of Linux's `/proc/self/limits`;
/// `None` when it is unlimited or not there.
fn open_file_limit(limits: &str) -> Option<usize> {
    let line = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))?;
    line.split_whitespace().next()?.parse().ok()
}

/// Accepts connections until `stopped` (sent or dropped), each served on a
/// task of its own under one of `max_connections` permits; then lets the
/// connections finish the requests under way and waits for them.
async fn accept(
    listener: TcpListener,
    router: axum::Router,
    max_connections: usize,
    limits: Limits,
    mut stopped: oneshot::Receiver<()>,
) {
    let permits = Arc::new(Semaphore::new(max_connections));
    let (stopping, stop) = watch::channel(());
    let refused = WarnLimit::default();
    let failed = WarnLimit::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stopped => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
                if !matches!(
                    error.kind(),
                    ConnectionAborted | ConnectionRefused | ConnectionReset
                ) {
                    warn_limited!(failed, "the management endpoint cannot accept a connection"; %error);
                    tokio::time::sleep(ACCEPT_RETRY).await;
                }
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Closed at once: past the limit a connection costs a
            // descriptor only for as long as it takes to close it.
            drop(stream);
            warn_limited!(
                refused,
                "management connection closed: the endpoint holds its limit of connections";
                %peer, limit = max_connections
            );
            continue;
        };
        tokio::spawn(connection(
            stream,
            router.clone(),
            limits,
            stop.clone(),
            permit,
        ));
    }
    drop(listener);
    drop(stopping);
    // Each connection holds its permit until it has ended.
    let _ = permits.acquire_many(max_connections as u32).await;
}

/// Serves one connection, HTTP/1.1, until it ends, moves no byte for the
/// idle timeout, or the endpoint stops (`stop`'s sender dropped: requests
/// under way are answered first). `_permit` is its place under the limit.
async fn connection(
    stream: TcpStream,
    router: axum::Router,
    limits: Limits,
    mut stop: watch::Receiver<()>,
    _permit: OwnedSemaphorePermit,
) {
    let opened = Instant::now();
    let moved = Arc::new(AtomicU64::new(0));
    let io = Watched {
        io: stream,
        opened,
        moved: moved.clone(),
    };
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let served = http.serve_connection(TokioIo::new(io), TowerToHyperService::new(router));
    tokio::pin!(served);
    let last_moved = || opened + Duration::from_millis(moved.load(Ordering::Relaxed));
    let mut stopping = false;
    loop {
        tokio::select! {
            ended = served.as_mut() => {
                if let Err(error) = ended {
                    tracing::debug!(%error, "management connection ended");
                }
                return;
            }
            // (Bytes may have moved while it slept: only a deadline still
            // past closes the connection.)
            () = tokio::time::sleep_until(last_moved() + limits.idle_timeout) => {
                if last_moved() + limits.idle_timeout <= Instant::now() {
                    tracing::debug!("management connection closed: idle");
                    return;
                }
            }
            _ = stop.changed(), if !stopping => {
                stopping = true;
                served.as_mut().graceful_shutdown();
            }
        }
    }
}

/// A connection's stream that notes when a byte last moved either way, for
/// the idle timeout.
struct Watched {
    io: TcpStream,
    opened: Instant,
    /// When a byte last moved, in milliseconds since `opened`.
    moved: Arc<AtomicU64>,
}

impl Watched {
    fn moved_now(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.moved.store(ms, Ordering::Relaxed);
    }

    /// Notes a write that took bytes.
    fn wrote(&self, polled: &Poll<std::io::Result<usize>>) {
        if matches!(polled, Poll::Ready(Ok(n)) if *n > 0) {
            self.moved_now();
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.moved_now();
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.wrote(&polled);
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.wrote(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A running management endpoint. Dropping it stops it too (without
/// waiting).
#[derive(Debug)]
pub struct ManagementServer {
    local_addr: SocketAddr,
    max_connections: usize,
    requests: Arc<AtomicU64>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ManagementServer {
    /// The address it listens on (the port chosen, for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The most connections it holds at once (the limit given, or the
    /// default the process's open-file limit allowed).
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// How many requests it has answered (or is answering) since it
    /// started, every route counted.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Stops listening and waits for the requests under way.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for ManagementServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// The routes open without a token: the probes, and the page's static
/// files (they hold no data; the page asks for the token it needs).
const OPEN_ROUTES: [&str; 5] = ["/alive", "/ready", "/", "/page.js", "/page.css"];

/// Whether `request` may go on: no token is set, it asks for an open
/// route, or it carries `Authorization: Bearer <token>`.
fn authorized(token: Option<&str>, request: &axum::extract::Request) -> bool {
    use subtle::ConstantTimeEq;
    let Some(token) = token else {
        return true;
    };
    if OPEN_ROUTES.contains(&request.uri().path()) {
        return true;
    }
    request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("Bearer"))
        .is_some_and(|(_, given)| {
            bool::from(
                given
                    .trim_start_matches(' ')
                    .as_bytes()
                    .ct_eq(token.as_bytes()),
            )
        })
}

/// The answer to a request without the token.
fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(json!({ "error": "this endpoint needs a bearer token (Authorization: Bearer <token>)" })),
    )
        .into_response()
}

/// What every route handler is given.
type Endpoint = State<Arc<Management>>;

/// A JSON answer with `status`.
fn answer(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
}

/// The page's policy: its own script, style and JSON routes only.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One of the page's files, never cached (a new build serves its own).
fn page_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_SECURITY_POLICY, PAGE_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

/// `GET /`: the live cluster page. It reads the JSON routes below every
/// second, so every figure on it is one they serve.
async fn page() -> Response {
    page_file("text/html; charset=utf-8", include_str!("page/index.html"))
}

async fn page_script() -> Response {
    page_file(
        "text/javascript; charset=utf-8",
        include_str!("page/page.js"),
    )
}

async fn page_style() -> Response {
    page_file("text/css; charset=utf-8", include_str!("page/page.css"))
}

async fn alive(State(m): Endpoint) -> Response {
    if m.node.is_running() {
        answer(StatusCode::OK, json!({ "alive": true }))
    } else {
        answer(StatusCode::SERVICE_UNAVAILABLE, json!({ "alive": false }))
    }
}

async fn ready(State(m): Endpoint) -> Response {
    match m.readiness() {
        Readiness::Ready => answer(StatusCode::OK, json!({ "ready": true })),
        Readiness::NotReady(reason) => answer(
            StatusCode::SERVICE_UNAVAILABLE,
            json!({ "ready": false, "reason": reason }),
        ),
    }
}

/// A member as the JSON answers name it.
fn member(address: &UniqueAddress) -> Value {
    json!({
        "node": address.to_string(),
        "addr": address.addr.to_string(),
        "node_id": address.node_id.to_string(),
        "incarnation": address.incarnation,
    })
}

fn status_name(status: MemberStatus) -> &'static str {
    match status {
        MemberStatus::Joining => "Joining",
        MemberStatus::Up => "Up",
        MemberStatus::Leaving => "Leaving",
        MemberStatus::Exiting => "Exiting",
        MemberStatus::Down => "Down",
        MemberStatus::Removed => "Removed",
    }
}

async fn members(State(m): Endpoint) -> Response {
    let state = m.node.current_state();
    // Each member's application version: this node's own, the others' as
    // the sharding coordinator last told this node (none without a
    // sharded system, or before its table came).
    let told = (m.system.as_ref().and_then(Weak::upgrade))
        .map(|system| system.member_app_versions())
        .unwrap_or_default();
    let own = &m.node.config().app_version;
    let members: Vec<Value> = state
        .members
        .iter()
        .map(|each| {
            let mut entry = member(&each.address);
            entry["status"] = json!(status_name(each.status));
            entry["reachable"] = json!(!state.unreachable.contains(&each.address));
            let version = if each.address == state.self_member {
                Some(own)
            } else {
                told.get(&each.address)
            };
            entry["app_version"] = json!(version.map(|v| v.to_string()));
            entry
        })
        .collect();
    let node = |a: Option<UniqueAddress>| a.map_or(Value::Null, |a| json!(a.to_string()));
    answer(
        StatusCode::OK,
        json!({
            "self_node": state.self_member.to_string(),
            "app_version": m.node.config().app_version.to_string(),
            "leader": node(state.leader),
            "oldest": node(state.coordinator),
            "members": members,
            "unreachable": state.unreachable.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        }),
    )
}

/// The system and its region of `type_name`, or the 404 that says which
/// is missing.
fn registered(
    m: &Management,
    type_name: &str,
) -> Result<(Arc<Shared>, Arc<crate::runtime::region::Region>), Box<Response>> {
    let Some(system) = m.system.as_ref().and_then(Weak::upgrade) else {
        return Err(Box::new(no_system()));
    };
    let Some(region) = system.region(type_name) else {
        return Err(Box::new(answer(
            StatusCode::NOT_FOUND,
            json!({ "error": format!("no entity type {type_name:?} registered on this node") }),
        )));
    };
    Ok((system, region))
}

/// The 404 of a route that needs the sharded system, on a node without one.
fn no_system() -> Response {
    answer(
        StatusCode::NOT_FOUND,
        json!({ "error": "no sharded system on this node" }),
    )
}

async fn entity_types(State(m): Endpoint) -> Response {
    let Some(system) = m.system.as_ref().and_then(Weak::upgrade) else {
        return no_system();
    };
    let mut types: Vec<&str> = system.all_regions().iter().map(|r| r.type_name).collect();
    types.sort_unstable();
    answer(StatusCode::OK, json!({ "types": types }))
}

/// The ids per hosted shard that `/cluster/shards/{type}`'s query asks
/// for: `None` without `ids`; `ids` alone (or `ids=`) asks for
/// [`DEFAULT_IDS_PER_SHARD`]. Refused, with the 400's text: another
/// parameter (a misspelt one would otherwise go unnoticed), `ids` twice,
/// or a value that is not a decimal number from 0 to [`MAX_IDS_PER_SHARD`].
fn ids_per_shard(query: Option<&str>) -> Result<Option<usize>, String> {
    let parse = |value: &str| {
        if value.is_empty() {
            return Ok(DEFAULT_IDS_PER_SHARD);
        }
        // (`parse` alone would take a leading `+`.)
        (value.parse::<usize>().ok())
            .filter(|n| *n <= MAX_IDS_PER_SHARD && !value.starts_with('+'))
            .ok_or_else(|| {
                format!("ids must be a number from 0 to {MAX_IDS_PER_SHARD}, not {value:?}")
            })
    };
    query_value(query, "ids")?.map(parse).transpose()
}

/// The value of a route's one query parameter `name`, if given (`""` for
/// `name` alone or `name=`). Refused, with the 400's text: another
/// parameter (a misspelt one would otherwise go unnoticed), or `name`
/// twice.
fn query_value<'q>(query: Option<&'q str>, name: &str) -> Result<Option<&'q str>, String> {
    let mut given = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != name {
            return Err(format!(
                "unknown query parameter {key:?} (this route takes {name}=N)"
            ));
        }
        if given.replace(value).is_some() {
            return Err(format!("{name} is given more than once"));
        }
    }
    Ok(given)
}

async fn shards(
    State(m): Endpoint,
    Path(type_name): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let ids = match ids_per_shard(query.as_deref()) {
        Ok(ids) => ids,
        Err(error) => return answer(StatusCode::BAD_REQUEST, json!({ "error": error })),
    };
    let (system, region) = match registered(&m, &type_name) {
        Ok(found) => found,
        Err(answer) => return *answer,
    };
    // Counting the entities (and listing their ids) locks every slot in
    // turn: off the runtime's threads (a node's runtime may have only one).
    let state = match tokio::task::spawn_blocking({
        let region = region.clone();
        move || match ids {
            Some(per_shard) => region.state_with_ids(per_shard, MAX_IDS_IN_ALL),
            None => region.state(),
        }
    })
    .await
    {
        Ok(state) => state,
        Err(_) => {
            return answer(
                StatusCode::INTERNAL_SERVER_ERROR,
                json!({ "error": "reading the region's state failed" }),
            );
        }
    };
    let me = m.node.self_address();
    let shards: Vec<Value> = state
        .placements
        .iter()
        .map(|(shard, placement)| {
            let here = placement.owner.is_none();
            let mut entry = json!({
                "shard": shard.0,
                "owner": placement.owner.unwrap_or(me).to_string(),
                "here": here,
                "generation": placement.generation,
                "entities": state.shards.get(shard),
                "handing_off": state.handing_off.contains(shard),
            });
            // Asked for: a hosted shard's ids, null for one elsewhere.
            if ids.is_some() {
                let listed = state.entity_ids.get(shard);
                entry["ids"] = json!(listed);
                entry["ids_truncated"] =
                    json!(listed.map(|_| state.entity_ids_truncated.contains(shard)));
            }
            entry
        })
        .collect();
    let coordinator = system.coordinator_status().map(|c| {
        json!({
            "acting": c.acting.map(|a| a.to_string()),
            "epoch": c.epoch,
            "registered": c.registered,
        })
    });
    let shard_ids = |set: &std::collections::BTreeSet<crate::ShardId>| {
        set.iter().map(|s| s.0).collect::<Vec<_>>()
    };
    let mut body = json!({
        "type": state.type_name,
        "node": me.to_string(),
        "num_shards": region.num_shards(),
        "proxy": state.proxy,
        "refused": state.refused.as_ref().map(|e| e.to_string()),
        "hosted_shards": state.shards.len(),
        "entities": state.shards.values().sum::<usize>(),
        "entity_limit": state.entity_limit,
        "buffered": state.buffered,
        "handing_off": shard_ids(&state.handing_off),
        "respawning": shard_ids(&state.respawning),
        "failed": shard_ids(&state.failed),
        "passivations": {
            "idle": state.passivations.idle,
            "limit": state.passivations.limit,
            "explicit": state.passivations.explicit,
        },
        "coordinator": coordinator,
        "shards": shards,
    });
    if let Some(per_shard) = ids {
        body["ids_per_shard"] = json!(per_shard);
    }
    answer(StatusCode::OK, body)
}

/// The events after `after=N` that `/cluster/events`'s query asks for:
/// 0 (every event kept) without it. Refused, with the 400's text: another
/// parameter, `after` twice, or a value that is not a decimal number.
fn events_after(query: Option<&str>) -> Result<u64, String> {
    match query_value(query, "after")? {
        None => Ok(0),
        Some(value) => (value.parse::<u64>().ok())
            .filter(|_| !value.starts_with('+'))
            .ok_or_else(|| format!("after must be a number, not {value:?}")),
    }
}

async fn events(State(m): Endpoint, RawQuery(query): RawQuery) -> Response {
    let after = match events_after(query.as_deref()) {
        Ok(after) => after,
        Err(error) => return answer(StatusCode::BAD_REQUEST, json!({ "error": error })),
    };
    let events: Vec<Value> = (m.node.history().changed_after(after).into_iter())
        .map(|e| {
            json!({
                "seq": e.seq,
                "changed": e.changed,
                "at_ms": unix_ms(e.at),
                "kind": e.kind.name(),
                "text": e.text,
                "count": e.count,
                "shards": e.shards,
            })
        })
        .collect();
    answer(
        StatusCode::OK,
        json!({
            "node": m.node.self_address().to_string(),
            "capacity": crate::ops::history::HISTORY_CAPACITY,
            "events": events,
        }),
    )
}

/// A wall-clock time as the JSON answers give it: milliseconds since the
/// UNIX epoch.
fn unix_ms(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How long `/cluster/load/{type}` waits for the other members' counts.
const LOAD_TIMEOUT: Duration = Duration::from_secs(2);

async fn load(State(m): Endpoint, Path(type_name): Path<String>) -> Response {
    let (system, region) = match registered(&m, &type_name) {
        Ok(found) => found,
        Err(answer) => return *answer,
    };
    let type_name = region.type_name;
    drop(region);
    // Stamped before the counts are asked for (this node's are read at
    // once, the others' as they answer): a slow member does not make the
    // span between two reads look longer than the counts' span.
    let read_at_ms = unix_ms(std::time::SystemTime::now());
    let stats = match system.cluster_stats(type_name, LOAD_TIMEOUT).await {
        Ok(stats) => stats,
        Err(error) => {
            return answer(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({ "error": error.to_string() }),
            );
        }
    };
    let members: Vec<Value> = (stats.app_versions.keys())
        .map(|node| {
            let hosted = stats.regions.get(node);
            let asks = stats.asks.get(node);
            let mut entry = member(node);
            entry["app_version"] = json!(stats.app_versions.get(node).map(|v| v.to_string()));
            entry["roles"] = json!(stats.roles.get(node));
            entry["hosted_shards"] = json!(hosted.map(|h| h.len()));
            entry["live_entities"] = json!(hosted.map(|h| h.values().sum::<usize>()));
            entry["answered"] = json!(asks.map(|a| &a.answered));
            entry["failed"] = json!(asks.map(|a| &a.failed));
            entry
        })
        .collect();
    answer(
        StatusCode::OK,
        json!({
            "type": type_name,
            "node": m.node.self_address().to_string(),
            "read_at_ms": read_at_ms,
            "bounds": crate::ops::telemetry::SECONDS_BUCKETS,
            "members": members,
            "no_answer": stats.failed.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        }),
    )
}

async fn metrics(State(m): Endpoint) -> Response {
    match &m.prometheus {
        Some(handle) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            handle.render(),
        )
            .into_response(),
        None => answer(
            StatusCode::NOT_FOUND,
            json!({ "error": "no Prometheus recorder on this node" }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_open_file_limit_is_read_from_proc_limits() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max cpu time              unlimited            unlimited            seconds   \n\
                      Max open files            1024                 524288               files     \n\
                      Max locked memory         8388608              8388608              bytes     \n";
        assert_eq!(open_file_limit(limits), Some(1024));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(open_file_limit(unlimited), None);
        assert_eq!(open_file_limit("Max processes 10 10 processes\n"), None);
    }

    #[test]
    fn the_after_query_is_read_strictly() {
        assert_eq!(events_after(None), Ok(0));
        assert_eq!(events_after(Some("after=17")), Ok(17));
        assert!(events_after(Some("after=")).is_err());
        assert!(events_after(Some("after=+3")).is_err());
        assert!(events_after(Some("after=1&after=2")).is_err());
        assert!(events_after(Some("since=1")).is_err());
    }

    #[test]
    fn the_ids_query_is_read_strictly() {
        assert_eq!(ids_per_shard(None), Ok(None));
        assert_eq!(ids_per_shard(Some("")), Ok(None));
        assert_eq!(ids_per_shard(Some("ids")), Ok(Some(DEFAULT_IDS_PER_SHARD)));
        assert_eq!(ids_per_shard(Some("ids=")), Ok(Some(DEFAULT_IDS_PER_SHARD)));
        assert_eq!(ids_per_shard(Some("ids=0")), Ok(Some(0)));
        assert_eq!(ids_per_shard(Some("ids=7&")), Ok(Some(7)));
        assert_eq!(
            ids_per_shard(Some("ids=10000")),
            Ok(Some(MAX_IDS_PER_SHARD))
        );
        for bad in [
            "ids=10001",
            "ids=99999999999999999999999",
            "ids=-1",
            "ids=+5",
            "ids=5x",
            "ids=%35",
            "ids=1&ids=2",
            "id=5",
            "ids=5&pretty",
        ] {
            assert!(ids_per_shard(Some(bad)).is_err(), "{bad} was taken");
        }
    }

    #[test]
    fn the_default_limit_leaves_most_descriptors_to_the_pipes() {
        let limit = default_max_connections();
        assert!((1..=DEFAULT_MAX_CONNECTIONS).contains(&limit), "{limit}");
        let files = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| open_file_limit(&l));
        if let Some(files) = files {
            assert!(limit <= files.div_ceil(4), "{limit} of {files}");
        }
    }
}
