//! The management endpoint (feature `management`, SPEC §14.1), queried with
//! a real HTTP client (reqwest) against real nodes on 127.0.0.1: in-process
//! nodes through the library, and a `datum-node` process through its flag.
//! The process-wide Prometheus recorder is installed once, before any node
//! of this binary starts.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::management::{Management, ManagementServer};
use datum_cluster_sharding::prelude::*;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::Value;

mod common;
use common::KillOnDrop;

#[path = "../protocols/counter.rs"]
mod counter;
use counter::{Add, Counter, Get};

const LONG: Duration = Duration::from_secs(30);
const BIN: &str = env!("CARGO_BIN_EXE_datum-node");

/// The process's recorder, installed by the first test that needs it.
fn recorder() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .install_recorder()
                .expect("the only recorder of this process")
        })
        .clone()
}

/// A status code and a body.
struct Answer {
    status: u16,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

async fn get(server: SocketAddr, path: &str) -> Answer {
    let response = reqwest::get(format!("http://{server}{path}"))
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    Answer {
        status: response.status().as_u16(),
        body: response.text().await.expect("a body"),
    }
}

/// Asks `path` until `check` holds of the answer (at most `LONG`).
async fn until(server: SocketAddr, path: &str, check: impl Fn(&Answer) -> bool) -> Answer {
    let deadline = Instant::now() + LONG;
    loop {
        let answer = get(server, path).await;
        if check(&answer) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path} never turned as expected; last: {} {}",
            answer.status,
            answer.body
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn cluster_node(name: &str, seeds: Vec<SocketAddr>) -> ClusterNode {
    let config = ClusterConfig::builder()
        .cluster_name(name)
        .secret("management-secret")
        .seed_nodes(seeds)
        .build();
    ClusterNode::start(config).await.expect("node starts")
}

async fn counters_on(node: &ClusterNode, shards: u32) -> ShardedSystem {
    let config = ShardingConfig::builder().num_shards(shards).build();
    counter::counters_on(node, config)
        .await
        .expect("counters hosted")
}

async fn serve(node: &ClusterNode, system: &ShardedSystem) -> ManagementServer {
    Management::new(node.clone())
        .system(system)
        .prometheus(recorder())
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_answer_probes_members_placement_and_metrics() {
    let _ = recorder();
    let first = cluster_node("management", vec![]).await;
    let mut nodes = vec![first.clone()];
    for _ in 1..3 {
        nodes.push(cluster_node("management", vec![first.bound_addr()]).await);
    }
    let mut systems = Vec::new();
    let mut servers = Vec::new();
    for node in &nodes {
        let system = counters_on(node, 24).await;
        servers.push(serve(node, &system).await);
        systems.push(system);
    }
    let at: Vec<SocketAddr> = servers.iter().map(|s| s.local_addr()).collect();

    for (i, server) in at.iter().enumerate() {
        assert_eq!(get(*server, "/alive").await.status, 200);
        until(*server, "/ready", |a| a.status == 200).await;
        let members = until(*server, "/cluster/members", |a| {
            let json = a.json();
            let members = json["members"].as_array().unwrap();
            members.len() == 3 && members.iter().all(|m| m["status"] == "Up")
        })
        .await
        .json();
        assert_eq!(members["self_node"], nodes[i].self_address().to_string());
        let listed: BTreeSet<String> = members["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["node"].as_str().unwrap().to_owned())
            .collect();
        let expected: BTreeSet<String> =
            nodes.iter().map(|n| n.self_address().to_string()).collect();
        assert_eq!(listed, expected);
        assert!(members["unreachable"].as_array().unwrap().is_empty());
    }

    // Entities on every node, through node 0.
    let ids: Vec<String> = (0..60).map(|i| format!("c-{i}")).collect();
    let mut their_shards = BTreeSet::new();
    for id in &ids {
        let entity = systems[0].entity_ref::<Counter>(id.clone());
        their_shards.insert(entity.shard_id().0 as u64);
        entity.tell(Add(1)).await.expect("told");
        assert_eq!(entity.ask(Get, LONG).await.expect("answered"), 1);
    }

    // Each shard is hosted by exactly one node, where node 0 says it is.
    let mut hosted: BTreeMap<u64, String> = BTreeMap::new();
    let mut entities = 0;
    for (i, server) in at.iter().enumerate() {
        let view = get(*server, "/cluster/shards/counter").await;
        assert_eq!(view.status, 200, "{}", view.body);
        let view = view.json();
        assert_eq!(view["type"], "counter");
        assert_eq!(view["num_shards"], 24);
        assert_eq!(view["coordinator"]["registered"], true);
        let me = nodes[i].self_address().to_string();
        for shard in view["shards"].as_array().unwrap() {
            if shard["here"] == true {
                assert_eq!(shard["owner"], me);
                assert!(shard["generation"].as_u64().unwrap() > 0);
                let id = shard["shard"].as_u64().unwrap();
                let other = hosted.insert(id, me.clone());
                assert!(
                    other.is_none(),
                    "shard {id} hosted twice: {other:?} and {me}"
                );
                entities += shard["entities"].as_u64().unwrap();
            }
        }
    }
    assert_eq!(
        hosted.keys().copied().collect::<BTreeSet<_>>(),
        their_shards
    );
    assert_eq!(entities, 60);
    assert!(
        hosted.values().collect::<BTreeSet<_>>().len() > 1,
        "{hosted:?}"
    );
    let from_0 = get(at[0], "/cluster/shards/counter").await.json();
    for shard in from_0["shards"].as_array().unwrap() {
        let id = shard["shard"].as_u64().unwrap();
        assert_eq!(shard["owner"].as_str(), hosted.get(&id).map(String::as_str));
    }

    // The metrics of node 0, with its asks among them.
    let metrics = get(at[0], "/metrics").await;
    assert_eq!(metrics.status, 200);
    let asks = format!(
        "datum_asks_total{{entity_type=\"counter\",node=\"{}\"}} ",
        nodes[0].bound_addr()
    );
    let line = metrics
        .body
        .lines()
        .find(|l| l.starts_with(&asks))
        .unwrap_or_else(|| panic!("no {asks} in\n{}", metrics.body));
    let count: f64 = line[asks.len()..].trim().parse().expect("a number");
    assert!(count >= 60.0, "{line}");

    // What is not there.
    let missing = get(at[0], "/cluster/shards/nope").await;
    assert_eq!(missing.status, 404);
    assert!(missing.json()["error"].as_str().unwrap().contains("nope"));
    assert_eq!(get(at[0], "/nope").await.status, 404);
    let post = reqwest::Client::new()
        .post(format!("http://{}/ready", at[0]))
        .send()
        .await
        .expect("POST");
    assert_eq!(post.status().as_u16(), 405);

    // Node 2's system leaves: not ready while its node is still alive and Up.
    systems[2].shutdown().await;
    let ready = get(at[2], "/ready").await;
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(ready.json()["ready"], false);
    assert_eq!(get(at[2], "/alive").await.status, 200);
    // Then its node leaves: no longer alive; the others see two members.
    nodes[2].shutdown().await.expect("left");
    assert_eq!(get(at[2], "/alive").await.status, 503);
    assert_eq!(get(at[2], "/ready").await.status, 503);
    until(at[0], "/cluster/members", |a| {
        a.json()["members"].as_array().unwrap().len() == 2
    })
    .await;
    assert_eq!(get(at[0], "/ready").await.status, 200);
    for server in servers {
        server.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_has_not_joined_is_alive_but_not_ready() {
    // A seed that accepts connections and never answers a handshake.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let node = cluster_node("management-lonely", vec![silent.local_addr().unwrap()]).await;
    // No system and no recorder: the routes that need them say so.
    let server = Management::new(node.clone())
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds");
    let at = server.local_addr();
    assert_eq!(get(at, "/alive").await.status, 200);
    let ready = get(at, "/ready").await;
    assert_eq!(ready.status, 503);
    assert_eq!(ready.json()["reason"], "not a member yet");
    let shards = get(at, "/cluster/shards/counter").await;
    assert_eq!(shards.status, 404);
    assert!(shards.body.contains("no sharded system"), "{}", shards.body);
    assert_eq!(get(at, "/metrics").await.status, 404);
    node.crash().await;
    assert_eq!(get(at, "/alive").await.status, 503);
    assert_eq!(get(at, "/ready").await.status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_the_coordinator_refused_keeps_its_node_unready() {
    let _ = recorder();
    let first = cluster_node("management-refused", vec![]).await;
    let second = cluster_node("management-refused", vec![first.bound_addr()]).await;
    for node in [&first, &second] {
        node.wait_until(|s| s.up_members().count() == 2, LONG)
            .await
            .expect("both Up");
    }
    let agreed = counters_on(&first, 16).await;
    let agreed_at = serve(&first, &agreed).await;
    until(agreed_at.local_addr(), "/ready", |a| a.status == 200).await;
    // Another shard count than the cluster's: the coordinator refuses it.
    let odd = counters_on(&second, 32).await;
    let odd_at = serve(&second, &odd).await;
    // (Before the coordinator answers, the reason is that the region is
    // not registered yet: wait past it, for the refusal.)
    let refused = until(odd_at.local_addr(), "/ready", |a| {
        a.status == 503
            && a.body.contains("entity type counter")
            && !a.body.contains("not registered with the coordinator yet")
    })
    .await;
    assert_eq!(refused.json()["ready"], false);
    let view = get(odd_at.local_addr(), "/cluster/shards/counter")
        .await
        .json();
    assert!(view["refused"].is_string(), "{view}");
    assert_eq!(get(agreed_at.local_addr(), "/ready").await.status, 200);
}

#[test]
fn datum_node_serves_the_endpoint_on_its_flag() {
    let mut child = KillOnDrop(
        Command::new(BIN)
            .args(["--cluster-name", "management-proc", "--bind", "127.0.0.1:0"])
            .args(["--counter", "--management-addr", "127.0.0.1:0"])
            .env("DATUM_SECRET", "management-secret")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn datum-node"),
    );
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let at: SocketAddr = loop {
        let line = lines
            .next()
            .expect("a management_listening line")
            .expect("stdout");
        let event: Value = serde_json::from_str(&line).expect("a JSON line");
        if event["event"] == "management_listening" {
            break event["addr"].as_str().unwrap().parse().unwrap();
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        until(at, "/ready", |a| a.status == 200).await;
        let metrics = get(at, "/metrics").await;
        assert_eq!(metrics.status, 200);
        assert!(
            metrics.body.contains("datum_cluster_members{"),
            "{}",
            metrics.body
        );
        let shards = get(at, "/cluster/shards/counter").await;
        assert_eq!(shards.status, 200, "{}", shards.body);
        assert_eq!(shards.json()["num_shards"], 128);
    });
    // SIGTERM: the node leaves gracefully and exits 0.
    // SAFETY: a plain kill(2) of our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let status = child.0.wait().expect("exit");
    assert_eq!(status.code(), Some(0));
}
