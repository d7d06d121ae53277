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
//! | `GET /alive` | 200 while the node runs; 503 once it stopped (downed, removed, shut down) |
//! | `GET /ready` | 200 once the node is Up and its regions are registered; 503 before, and while leaving or fenced |
//! | `GET /cluster/members` | this node's view of the membership, JSON |
//! | `GET /cluster/shards` | the entity types registered here, JSON |
//! | `GET /cluster/shards/{type}` | where each shard of a type lives, its generation, what waits in buffers, JSON |
//! | `GET /metrics` | the Prometheus recorder's text, when one was given |
//!
//! The endpoint reads what the node and system already publish; serving it
//! takes no lock a message path holds for longer than a shard's summary.

use std::net::SocketAddr;
use std::sync::{Arc, Weak};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::cluster::ClusterNode;
use crate::identity::UniqueAddress;
use crate::membership::MemberStatus;
use crate::system::{ShardedSystem, Shared};

/// How often the Prometheus recorder's upkeep runs (it drains histogram
/// samples into their summaries).
const UPKEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// The content type of Prometheus's text exposition format.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the endpoint serves: a cluster node, and optionally the sharded
/// system on it and a Prometheus recorder's handle. Build it, then
/// [`serve`](Self::serve) it.
#[derive(Clone)]
pub struct Management {
    node: ClusterNode,
    /// Held weakly: the endpoint does not keep a dropped system alive.
    system: Option<Weak<Shared>>,
    prometheus: Option<PrometheusHandle>,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Management")
            .field("node", &self.node.self_address())
            .field("system", &self.system.is_some())
            .field("prometheus", &self.prometheus.is_some())
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
    /// the node, so the node's metrics register with it; SPEC §14).
    pub fn prometheus(mut self, handle: PrometheusHandle) -> Self {
        self.prometheus = Some(handle);
        self
    }

    /// Whether the node should take traffic now:
    /// - its cluster node runs and is `Up` (not joining, leaving, downed);
    /// - its system (if given) is not shutting down, stopped or fenced, no
    ///   region was refused by the coordinator, and the coordinator's table
    ///   has come since the regions registered.
    pub fn readiness(&self) -> Readiness {
        let not = |why: &str| Readiness::NotReady(why.to_owned());
        if !self.node.is_running() {
            return not("the node has stopped");
        }
        match self.node.current_state().self_status() {
            Some(MemberStatus::Up) => {}
            None => return not("not a member yet"),
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
        self.serve_on(tokio::net::TcpListener::bind(addr).await?)
    }

    /// Serves the routes on `listener` (bound beforehand, say before the
    /// node joins, so that a taken port fails before there is a member to
    /// down). With a Prometheus handle, its upkeep runs every 5 s while the
    /// endpoint serves, so histogram samples do not pile up unscraped.
    pub fn serve_on(self, listener: tokio::net::TcpListener) -> std::io::Result<ManagementServer> {
        let local_addr = listener.local_addr()?;
        let upkeep = self.prometheus.clone();
        let router = axum::Router::new()
            .route("/alive", get(alive))
            .route("/ready", get(ready))
            .route("/cluster/members", get(members))
            .route("/cluster/shards", get(entity_types))
            .route("/cluster/shards/{type_name}", get(shards))
            .route("/metrics", get(metrics))
            .with_state(Arc::new(self));
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
            let served = axum::serve(listener, router).with_graceful_shutdown(async move {
                tokio::select! {
                    _ = stopped => {}
                    () = upkeep => {}
                }
            });
            let served = served.await;
            if let Err(error) = served {
                tracing::warn!(%error, "the management endpoint stopped");
            }
        });
        Ok(ManagementServer {
            local_addr,
            stop: Some(stop),
            task: Some(task),
        })
    }
}

/// A running management endpoint. Dropping it stops it too (without
/// waiting).
#[derive(Debug)]
pub struct ManagementServer {
    local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ManagementServer {
    /// The address it listens on (the port chosen, for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
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

/// What every route handler is given.
type Endpoint = State<Arc<Management>>;

/// A JSON answer with `status`.
fn answer(status: StatusCode, body: Value) -> Response {
    (status, Json(body)).into_response()
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
    let members: Vec<Value> = state
        .members
        .iter()
        .map(|each| {
            let mut entry = member(&each.address);
            entry["status"] = json!(status_name(each.status));
            entry["reachable"] = json!(!state.unreachable.contains(&each.address));
            entry
        })
        .collect();
    let node = |a: Option<UniqueAddress>| a.map_or(Value::Null, |a| json!(a.to_string()));
    answer(
        StatusCode::OK,
        json!({
            "self_node": state.self_member.to_string(),
            "leader": node(state.leader),
            "oldest": node(state.coordinator),
            "members": members,
            "unreachable": state.unreachable.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        }),
    )
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

async fn shards(State(m): Endpoint, Path(type_name): Path<String>) -> Response {
    let Some(system) = m.system.as_ref().and_then(Weak::upgrade) else {
        return no_system();
    };
    let Some(region) = system.region(&type_name) else {
        return answer(
            StatusCode::NOT_FOUND,
            json!({ "error": format!("no entity type {type_name:?} registered on this node") }),
        );
    };
    // Counting the entities locks every slot in turn: off the runtime's
    // threads (a node's runtime may have only one).
    let state = match tokio::task::spawn_blocking({
        let region = region.clone();
        move || region.state()
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
            json!({
                "shard": shard.0,
                "owner": placement.owner.unwrap_or(me).to_string(),
                "here": here,
                "generation": placement.generation,
                "entities": state.shards.get(shard),
                "handing_off": state.handing_off.contains(shard),
            })
        })
        .collect();
    let coordinator = system.coordinator_status().map(|c| {
        json!({
            "acting": c.acting.map(|a| a.to_string()),
            "epoch": c.epoch,
            "registered": c.registered,
        })
    });
    let ids = |set: &std::collections::BTreeSet<crate::ShardId>| {
        set.iter().map(|s| s.0).collect::<Vec<_>>()
    };
    answer(
        StatusCode::OK,
        json!({
            "type": state.type_name,
            "node": me.to_string(),
            "num_shards": region.num_shards(),
            "proxy": state.proxy,
            "refused": state.refused.as_ref().map(|e| e.to_string()),
            "hosted_shards": state.shards.len(),
            "entities": state.shards.values().sum::<usize>(),
            "entity_limit": state.entity_limit,
            "buffered": state.buffered,
            "handing_off": ids(&state.handing_off),
            "respawning": ids(&state.respawning),
            "failed": ids(&state.failed),
            "passivations": {
                "idle": state.passivations.idle,
                "limit": state.passivations.limit,
                "explicit": state.passivations.explicit,
            },
            "coordinator": coordinator,
            "shards": shards,
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
