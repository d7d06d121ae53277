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
use datum_cluster_sharding::telemetry;
use metrics_exporter_prometheus::PrometheusHandle;
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
            telemetry::prometheus_builder()
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
/// Checks that a `/metrics` text has every metric of SPEC §14 but those
/// in `but`, and the two latencies as histograms.
fn lists_every_metric(body: &str, but: &[&str]) {
    let names = [
        telemetry::MEMBERS,
        telemetry::UNREACHABLE,
        telemetry::SHARDS,
        telemetry::ENTITIES,
        telemetry::PASSIVATIONS,
        telemetry::ASKS,
        telemetry::ASK_FAILURES,
        telemetry::REMEMBER_QUEUE,
        telemetry::REMEMBER_FAILURES,
        telemetry::PIPE_FRAMES,
        telemetry::PIPE_WRITES,
        telemetry::PIPES,
        telemetry::PIPE_PEER_FRAMES,
        telemetry::PIPE_PEER_BYTES,
        telemetry::BUFFERED,
        telemetry::HANDOFF_BUFFERED,
        telemetry::REBALANCE_ROUNDS,
        telemetry::SHARD_MOVES,
        telemetry::SPLIT_BRAIN_DECISIONS,
    ];
    for name in names.into_iter().filter(|n| !but.contains(n)) {
        assert!(
            body.contains(&format!("# TYPE {name} ")),
            "no {name} in\n{body}"
        );
    }
    for name in [telemetry::ASK_SECONDS, telemetry::REBALANCE_ROUND_SECONDS] {
        assert!(
            body.contains(&format!("# TYPE {name} histogram\n")),
            "{name} is not a histogram in\n{body}"
        );
    }
}

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

/// A GET with `Authorization: Bearer <token>` when given: its status, its
/// `WWW-Authenticate` header and its body.
async fn get_with(
    server: SocketAddr,
    path: &str,
    token: Option<&str>,
) -> (u16, Option<String>, String) {
    let client = reqwest::Client::new();
    let mut request = client.get(format!("http://{server}{path}"));
    if let Some(token) = token {
        request = request.header("Authorization", format!("Bearer {token}"));
    }
    let response = request
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let challenge = response
        .headers()
        .get("www-authenticate")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (
        response.status().as_u16(),
        challenge,
        response.text().await.unwrap_or_default(),
    )
}

/// With a token, every data route asks for it; the probes and the page's
/// static files do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_guards_every_data_route_but_not_the_probes_or_the_pages_files() {
    let node = cluster_node("management-token", vec![]).await;
    let system = counters_on(&node, 8).await;
    let server = Management::new(node.clone())
        .system(&system)
        .prometheus(recorder())
        .token("s3cret-token")
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds");
    let at = server.local_addr();
    until(at, "/ready", |a| a.status == 200).await;
    for open in ["/alive", "/ready", "/", "/page.js", "/page.css"] {
        let (status, _, body) = get_with(at, open, None).await;
        assert_eq!(status, 200, "{open}: {body}");
    }
    for guarded in [
        "/cluster/members",
        "/cluster/shards",
        "/cluster/shards/counter",
        "/metrics",
        "/cluster/shards/counter?ids=3",
    ] {
        for token in [None, Some("s3cret-toke"), Some("s3cret-token2"), Some("")] {
            let (status, challenge, body) = get_with(at, guarded, token).await;
            assert_eq!(status, 401, "{guarded} with {token:?}: {body}");
            assert_eq!(challenge.as_deref(), Some("Bearer"), "{guarded}");
            assert!(body.contains("bearer token"), "{body}");
        }
        let (status, _, body) = get_with(at, guarded, Some("s3cret-token")).await;
        assert_eq!(status, 200, "{guarded}: {body}");
    }
    // Paths that are no route, or another spelling of one, are refused
    // too until the token is given; then they are not found.
    for other in [
        "/nothing-here",
        "/cluster/members/",
        "//cluster/members",
        "/Cluster/members",
    ] {
        let (status, _, body) = get_with(at, other, None).await;
        assert_eq!(status, 401, "{other}: {body}");
        let (status, _, body) = get_with(at, other, Some("s3cret-token")).await;
        assert_eq!(status, 404, "{other}: {body}");
    }
    // The scheme is matched without regard to case, past extra spaces;
    // HEAD is guarded as GET is.
    let client = reqwest::Client::new();
    for header in ["bearer s3cret-token", "BEARER  s3cret-token"] {
        let status = client
            .get(format!("http://{at}/cluster/members"))
            .header("Authorization", header)
            .send()
            .await
            .expect("GET")
            .status();
        assert_eq!(status.as_u16(), 200, "{header}");
    }
    let head = client
        .head(format!("http://{at}/cluster/members"))
        .send()
        .await
        .expect("HEAD")
        .status();
    assert_eq!(head.as_u16(), 401);
    server.shutdown().await;
    system.shutdown().await;
    let _ = node.shutdown().await;
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
        // (Each member's application version comes with the coordinator's
        // table, which a node hears again at least every 10 s.)
        let members = until(*server, "/cluster/members", |a| {
            let json = a.json();
            let members = json["members"].as_array().unwrap();
            members.len() == 3
                && members
                    .iter()
                    .all(|m| m["status"] == "Up" && m["app_version"] == "0")
        })
        .await
        .json();
        assert_eq!(members["self_node"], nodes[i].self_address().to_string());
        assert_eq!(members["app_version"], "0");
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
    // Every metric of SPEC §14 is there, whether or not it counted
    // anything yet; the latencies as histograms.
    lists_every_metric(&metrics.body, &[]);
    let answered = format!(
        "{}_bucket{{entity_type=\"counter\",node=\"{}\",le=\"+Inf\"}} ",
        telemetry::ASK_SECONDS,
        nodes[0].bound_addr()
    );
    assert!(
        metrics.body.lines().any(|l| l
            .strip_prefix(&answered)
            .and_then(|n| n.trim().parse::<f64>().ok())
            .is_some_and(|n| n >= 60.0)),
        "no {answered}(60 or more) in\n{}",
        metrics.body
    );

    // Every member's asks, as node 1 gathers them: node 0 answered 60
    // asks, the others asked nothing; the live entities add up.
    let load = get(at[1], "/cluster/load/counter").await;
    assert_eq!(load.status, 200, "{}", load.body);
    let load = load.json();
    assert_eq!(load["bounds"].as_array().map(Vec::len), Some(22));
    assert!(load["no_answer"].as_array().unwrap().is_empty(), "{load}");
    let mut live = 0;
    for member in load["members"].as_array().unwrap() {
        let answered: Vec<u64> = (member["answered"].as_array().unwrap().iter())
            .map(|n| n.as_u64().unwrap())
            .collect();
        assert_eq!(answered.len(), 23, "{member}");
        let asked = if member["node"] == nodes[0].self_address().to_string() {
            60
        } else {
            0
        };
        assert_eq!(answered.iter().sum::<u64>(), asked, "{member}");
        assert_eq!(member["failed"], serde_json::json!({}), "{member}");
        assert_eq!(member["roles"], serde_json::json!([]), "{member}");
        live += member["live_entities"].as_u64().unwrap();
    }
    assert_eq!(live, 60);
    assert_eq!(get(at[1], "/cluster/load/nope").await.status, 404);

    // What node 0 saw happen: the other two came up; `after` keeps the
    // later events only.
    let events = get(at[0], "/cluster/events").await.json();
    let events = events["events"].as_array().unwrap().clone();
    for other in &nodes[1..] {
        let me = other.self_address().to_string();
        assert!(
            events
                .iter()
                .any(|e| e["kind"] == "member_up" && e["text"].as_str().unwrap().contains(&me)),
            "no member_up of {me} in {events:?}"
        );
    }
    let newest = (events.iter())
        .map(|e| e["changed"].as_u64().unwrap())
        .max()
        .unwrap();
    let later = get(at[0], &format!("/cluster/events?after={}", newest - 1))
        .await
        .json();
    let later = later["events"].as_array().unwrap();
    assert_eq!(later.len(), 1, "{later:?}");
    assert_eq!(later[0]["changed"], newest);
    assert_eq!(get(at[0], "/cluster/events?after=x").await.status, 400);

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
    let had = get(at[2], "/cluster/shards/counter").await.json()["hosted_shards"]
        .as_u64()
        .unwrap();
    systems[2].shutdown().await;
    // Its history has the handoffs, folded into one event listing the
    // shards.
    let events = get(at[2], "/cluster/events").await.json();
    let handed: Vec<&Value> = (events["events"].as_array().unwrap().iter())
        .filter(|e| e["kind"] == "handed_off")
        .collect();
    let listed: usize = handed
        .iter()
        .map(|e| e["shards"].as_array().unwrap().len())
        .sum();
    assert!(
        had > 0 && listed as u64 == had && handed.len() == 1,
        "{had} hosted: {events}"
    );
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
    let gone = nodes[2].self_address().to_string();
    until(at[0], "/cluster/events", |a| {
        a.json()["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "member_removed" && e["text"].as_str().unwrap().contains(&gone))
    })
    .await;
    for server in servers {
        server.shutdown().await;
    }
}

/// A node its seed refuses (another cluster name: a misconfiguration a
/// retry cannot cure) says why on `/ready` while it tries, and once it
/// gave up is no longer alive, so an orchestrator restarts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_node_names_the_refusal_on_ready_and_gives_up_not_alive() {
    let seed = cluster_node("management-right", vec![]).await;
    let node = cluster_node("management-wrong", vec![seed.bound_addr()]).await;
    let server = Management::new(node.clone())
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds");
    let at = server.local_addr();
    // Refused, then given up (after `join_refusal_limit` refusals): alive
    // no more, and `/ready` says why.
    until(at, "/alive", |a| a.status == 503).await;
    let ready = get(at, "/ready").await;
    assert_eq!(ready.status, 503);
    let reason = ready.json()["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        reason.starts_with("the node has stopped: it gave up joining: ")
            && reason.contains(&seed.bound_addr().to_string())
            && reason.contains("WrongCluster"),
        "{reason}"
    );
    server.shutdown().await;
    let _ = seed.shutdown().await;
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

/// Each hosted shard's live entity ids, as `?ids=N` lists them.
fn listed_ids(view: &Value) -> BTreeMap<u64, (Vec<String>, bool)> {
    view["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|shard| shard["here"] == true)
        .map(|shard| {
            let ids = shard["ids"]
                .as_array()
                .unwrap_or_else(|| panic!("a hosted shard without ids: {shard}"))
                .iter()
                .map(|id| id.as_str().unwrap().to_owned())
                .collect();
            let cut = shard["ids_truncated"].as_bool().expect("a flag");
            (shard["shard"].as_u64().unwrap(), (ids, cut))
        })
        .collect()
}

/// `?ids=N` lists the ids of each shard a node hosts (ascending, at most
/// N a shard, the cut lists flagged; `null` for a shard elsewhere), and
/// a passivated entity leaves its list; without the query the answer has
/// no ids; a bad query gets 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ids_of_each_hosted_shard_are_listed_when_asked() {
    let _ = recorder();
    let first = cluster_node("management-ids", vec![]).await;
    let second = cluster_node("management-ids", vec![first.bound_addr()]).await;
    let nodes = [first, second];
    for node in &nodes {
        node.wait_until(|s| s.up_members().count() == 2, LONG)
            .await
            .expect("both Up");
    }
    let mut systems = Vec::new();
    let mut servers = Vec::new();
    for node in &nodes {
        let system = counters_on(node, 8).await;
        servers.push(serve(node, &system).await);
        systems.push(system);
    }
    let at: Vec<SocketAddr> = servers.iter().map(|s| s.local_addr()).collect();
    for server in &at {
        until(*server, "/ready", |a| a.status == 200).await;
    }

    // Entities on both nodes, through node 0.
    let mut expected: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for i in 0..40 {
        let id = format!("m{i:02}");
        let entity = systems[0].entity_ref::<Counter>(id.clone());
        entity.tell(Add(1)).await.expect("told");
        assert_eq!(entity.ask(Get, LONG).await.expect("answered"), 1);
        expected
            .entry(entity.shard_id().0 as u64)
            .or_default()
            .push(id);
    }
    for ids in expected.values_mut() {
        ids.sort();
    }

    // Room for all: between them the nodes list every id once, each list
    // as long as its shard's count; a shard elsewhere has none.
    let mut all = BTreeMap::new();
    let mut hosting = BTreeMap::new();
    for (n, server) in at.iter().enumerate() {
        let view = get(*server, "/cluster/shards/counter?ids=1000").await;
        assert_eq!(view.status, 200, "{}", view.body);
        let view = view.json();
        assert_eq!(view["ids_per_shard"], 1000);
        for shard in view["shards"].as_array().unwrap() {
            if shard["here"] == true {
                let count = shard["entities"].as_u64().unwrap() as usize;
                assert_eq!(shard["ids"].as_array().unwrap().len(), count, "{shard}");
            } else {
                assert!(
                    shard["ids"].is_null() && shard["ids_truncated"].is_null(),
                    "{shard}"
                );
            }
        }
        for (shard, (ids, cut)) in listed_ids(&view) {
            assert!(!cut, "shard {shard} cut at 1000");
            assert!(
                all.insert(shard, ids).is_none(),
                "shard {shard} listed twice"
            );
            hosting.insert(shard, n);
        }
    }
    assert_eq!(all, expected);
    assert_eq!(
        hosting.values().collect::<BTreeSet<_>>().len(),
        2,
        "both nodes host: {hosting:?}"
    );

    // Two a shard: the two least ids, the longer lists flagged as cut.
    let mut cut_any = false;
    for server in &at {
        let view = get(*server, "/cluster/shards/counter?ids=2").await.json();
        for (shard, (ids, cut)) in listed_ids(&view) {
            let whole = &expected[&shard];
            assert_eq!(ids, whole[..whole.len().min(2)].to_vec(), "shard {shard}");
            assert_eq!(cut, whole.len() > 2, "shard {shard}");
            cut_any |= cut;
        }
    }
    assert!(cut_any, "40 ids on 8 shards: some shard has more than 2");

    // `ids` alone: the default cap. No query: no ids at all.
    let view = get(at[0], "/cluster/shards/counter?ids").await.json();
    assert_eq!(
        view["ids_per_shard"].as_u64(),
        Some(datum_cluster_sharding::management::DEFAULT_IDS_PER_SHARD as u64)
    );
    let view = get(at[0], "/cluster/shards/counter").await.json();
    assert!(view.get("ids_per_shard").is_none(), "{view}");
    assert!(
        view["shards"]
            .as_array()
            .unwrap()
            .iter()
            .all(|shard| shard.get("ids").is_none() && shard.get("ids_truncated").is_none()),
        "{view}"
    );

    // A passivated entity leaves its shard's list on the node hosting it.
    let gone = systems[0].entity_ref::<Counter>("m07");
    let shard = gone.shard_id().0 as u64;
    gone.passivate().await.expect("passivated");
    let host = at[hosting[&shard]];
    let view = until(host, "/cluster/shards/counter?ids=1000", |a| {
        listed_ids(&a.json())
            .get(&shard)
            .is_some_and(|(ids, _)| !ids.iter().any(|id| id == "m07"))
    })
    .await
    .json();
    let mut rest = expected[&shard].clone();
    rest.retain(|id| id != "m07");
    assert_eq!(listed_ids(&view)[&shard].0, rest);

    // Bad queries: 400 with the reason.
    let over = format!(
        "ids={}",
        datum_cluster_sharding::management::MAX_IDS_PER_SHARD + 1
    );
    for query in ["ids=many", over.as_str(), "ids=-1", "ids=1&ids=2", "idz=3"] {
        let bad = get(at[0], &format!("/cluster/shards/counter?{query}")).await;
        assert_eq!(bad.status, 400, "{query}: {}", bad.body);
        let error = bad.json()["error"].as_str().unwrap_or_default().to_owned();
        assert!(
            error.contains("ids") || error.contains("idz"),
            "{query}: {error}"
        );
    }

    for server in servers {
        server.shutdown().await;
    }
    for system in &systems {
        system.shutdown().await;
    }
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
    let (at, _stdout) = endpoint_of(&mut child);
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
        // A fresh node, before any ask: every metric of SPEC §14 but the
        // per-peer ones (it has no peer), the latencies as histograms.
        let per_peer = [telemetry::PIPE_PEER_FRAMES, telemetry::PIPE_PEER_BYTES];
        lists_every_metric(&metrics.body, &per_peer);
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

/// The address of a `datum-node`'s endpoint, from its
/// `management_listening` line, and its stdout past that line (kept open
/// by the caller: the node still writes to it).
fn endpoint_of(child: &mut KillOnDrop) -> (SocketAddr, impl Iterator + use<>) {
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    loop {
        let line = lines
            .next()
            .expect("a management_listening line")
            .expect("stdout");
        let event: Value = serde_json::from_str(&line).expect("a JSON line");
        if event["event"] == "management_listening" {
            return (event["addr"].as_str().unwrap().parse().unwrap(), lines);
        }
    }
}

/// What `datum-node` writes to stderr when its endpoint listens on every
/// address of a network namespace of its own (`unshare -rn`: only its own
/// loopback device is in it, so nothing beyond this test can reach the
/// endpoint), with or without a token. `None` where such a namespace
/// cannot be made here.
fn stderr_of_an_endpoint_on_every_address(token: Option<&str>) -> Option<String> {
    let usable = Command::new("unshare")
        .args(["-rn", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !usable {
        return None;
    }
    let mut command = Command::new("unshare");
    command
        .args(["-rn", BIN])
        .args(["--cluster-name", "exposed", "--bind", "127.0.0.1:0"])
        .args(["--management-addr", "0.0.0.0:0"])
        .env("DATUM_SECRET", "exposed-secret")
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(token) = token {
        command.env("DATUM_MANAGEMENT_TOKEN", token);
    }
    let mut child = KillOnDrop(command.spawn().expect("spawn datum-node"));
    let (listening, _stdout) = endpoint_of(&mut child);
    assert!(listening.ip().is_unspecified(), "{listening}");
    // The warning, if any, is written before the endpoint listens.
    // SAFETY: a plain kill(2) of our own child.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    child.0.wait().expect("exit");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut stderr)
        .expect("stderr");
    Some(stderr)
}

#[test]
fn an_endpoint_beyond_loopback_without_a_token_warns() {
    let warning = "listens beyond this host with no token";
    let Some(open) = stderr_of_an_endpoint_on_every_address(None) else {
        eprintln!("skipped: no network namespace can be made here (unshare -rn)");
        return;
    };
    assert!(open.contains(warning), "no warning in: {open}");
    let guarded = stderr_of_an_endpoint_on_every_address(Some("exposed-token"))
        .expect("a namespace, as before");
    assert!(
        !guarded.contains(warning),
        "a warning with a token: {guarded}"
    );
}

/// A status code and a body, or `None` when the connection failed (as one
/// past the endpoint's limit does: closed as soon as it is accepted).
async fn try_get(server: SocketAddr, path: &str) -> Option<Answer> {
    let response = reqwest::get(format!("http://{server}{path}")).await.ok()?;
    Some(Answer {
        status: response.status().as_u16(),
        body: response.text().await.ok()?,
    })
}

/// Asks `path` until an answer comes and `check` holds of it (at most
/// `LONG`); failed connections are tried again.
async fn until_answered(server: SocketAddr, path: &str, check: impl Fn(&Answer) -> bool) -> Answer {
    let deadline = Instant::now() + LONG;
    loop {
        if let Some(answer) = try_get(server, path).await
            && check(&answer)
        {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path} never answered as expected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A TCP connection to `server` that sends nothing, non-blocking, so that
/// [`closed`] can ask whether the server closed it.
fn idle_connection(server: SocketAddr) -> std::net::TcpStream {
    let stream = std::net::TcpStream::connect(server).expect("connects");
    stream.set_nonblocking(true).expect("non-blocking");
    stream
}

/// Whether the server closed `stream` (end of stream or reset), without
/// waiting; `stream` is non-blocking.
fn closed(stream: &mut std::net::TcpStream) -> bool {
    use std::io::Read;
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// Marks in `gone` which of `streams` the server has closed by now; whether
/// at least `n` are. Fails once `deadline` has passed with fewer: one poll
/// of [`until_closed`] and [`until_closed_async`].
fn closed_enough(
    streams: &mut [std::net::TcpStream],
    gone: &mut [bool],
    n: usize,
    deadline: Instant,
) -> bool {
    for (stream, gone) in streams.iter_mut().zip(gone.iter_mut()) {
        *gone = *gone || closed(stream);
    }
    let count = gone.iter().filter(|g| **g).count();
    if count >= n {
        return true;
    }
    assert!(
        Instant::now() < deadline,
        "{count} connections closed by the server, not {n}"
    );
    false
}

/// Waits (at most `LONG`) until at least `n` of `streams` are closed by the
/// server; gives which are.
fn until_closed(streams: &mut [std::net::TcpStream], n: usize) -> Vec<bool> {
    let deadline = Instant::now() + LONG;
    let mut gone = vec![false; streams.len()];
    while !closed_enough(streams, &mut gone, n, deadline) {
        std::thread::sleep(Duration::from_millis(20));
    }
    gone
}

/// [`until_closed`] in an async test, pausing on the runtime's timer.
async fn until_closed_async(streams: &mut [std::net::TcpStream], n: usize) -> Vec<bool> {
    let deadline = Instant::now() + LONG;
    let mut gone = vec![false; streams.len()];
    while !closed_enough(streams, &mut gone, n, deadline) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gone
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_answers_as_get_does_and_other_methods_get_405() {
    let node = cluster_node("management-methods", vec![]).await;
    let server = Management::new(node.clone())
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds");
    let at = server.local_addr();
    let client = reqwest::Client::new();
    let head = client
        .head(format!("http://{at}/alive"))
        .send()
        .await
        .expect("HEAD");
    assert_eq!(head.status().as_u16(), 200);
    assert_eq!(
        head.headers()[reqwest::header::CONTENT_TYPE],
        "application/json"
    );
    assert!(head.bytes().await.expect("an empty body").is_empty());
    let missing = client
        .head(format!("http://{at}/nope"))
        .send()
        .await
        .expect("HEAD");
    assert_eq!(missing.status().as_u16(), 404);
    for method in [
        reqwest::Method::POST,
        reqwest::Method::PUT,
        reqwest::Method::DELETE,
        reqwest::Method::PATCH,
        reqwest::Method::OPTIONS,
    ] {
        let answer = client
            .request(method.clone(), format!("http://{at}/alive"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method}: {e}"));
        assert_eq!(answer.status().as_u16(), 405, "{method}");
        let allow = answer.headers()[reqwest::header::ALLOW]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(
            allow.contains("GET") && allow.contains("HEAD"),
            "{method}: {allow}"
        );
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_closed_at_once() {
    let node = cluster_node("management-limit", vec![]).await;
    let server = Management::new(node.clone())
        .max_connections(4)
        .header_read_timeout(Duration::from_secs(600))
        .idle_timeout(Duration::from_secs(600))
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds");
    assert_eq!(server.max_connections(), 4);
    let at = server.local_addr();
    // Twelve connections that send nothing: the first four are held (their
    // timeouts are long), the eight after them closed as they come.
    let mut idle: Vec<_> = (0..12).map(|_| idle_connection(at)).collect();
    let gone = until_closed_async(&mut idle, 8).await;
    assert_eq!(gone.iter().filter(|g| !**g).count(), 4, "{gone:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held: Vec<usize> = (0..idle.len()).filter(|i| !gone[*i]).collect();
    for i in &held {
        assert!(
            !closed(&mut idle[*i]),
            "connection {i} was held, then closed"
        );
    }
    // The limit is full: a probe is closed too.
    assert!(try_get(at, "/alive").await.is_none());
    // The held ones go: the endpoint answers again.
    drop(idle);
    let alive = until_answered(at, "/alive", |a| a.status == 200).await;
    assert_eq!(alive.json()["alive"], true);
    server.shutdown().await;
}

/// Reads `stream` (blocking, at most `LONG`) until what was read holds
/// `needle`.
fn read_until(stream: &mut std::net::TcpStream, needle: &str) -> String {
    use std::io::Read;
    stream.set_read_timeout(Some(LONG)).expect("a read timeout");
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&read).contains(needle) {
        let n = stream.read(&mut buf).expect("an answer");
        assert!(
            n > 0,
            "closed before {needle:?}: {}",
            String::from_utf8_lossy(&read)
        );
        read.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&read).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_connections_are_closed_after_the_header_timeout() {
    use std::io::Write;
    let node = cluster_node("management-header-timeout", vec![]).await;
    let server = Management::new(node.clone())
        .max_connections(4)
        .header_read_timeout(Duration::from_secs(1))
        .idle_timeout(Duration::from_secs(600))
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds");
    let at = server.local_addr();
    // One kept alive after an answer, one that sends half a head, two
    // that send nothing: the limit is full. (Each one's timeout starts
    // after `started`.)
    let started = Instant::now();
    let mut kept = std::net::TcpStream::connect(at).expect("connects");
    kept.write_all(b"GET /alive HTTP/1.1\r\nhost: test\r\n\r\n")
        .expect("sent");
    let kept_answer = tokio::task::spawn_blocking(move || {
        let answer = read_until(&mut kept, r#"{"alive":true}"#);
        (kept, answer)
    });
    let (kept, answer) = kept_answer.await.expect("read");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    kept.set_nonblocking(true).expect("non-blocking");
    let mut slow = idle_connection(at);
    slow.write_all(b"GET /alive HTTP/1.1\r\nhost: te")
        .expect("sent");
    let mut held = vec![kept, slow, idle_connection(at), idle_connection(at)];
    // /alive answers again once they have timed out, all four.
    let alive = until_answered(at, "/alive", |a| a.status == 200).await;
    assert_eq!(alive.json()["alive"], true);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "answered after {:?}, before the held connections timed out",
        started.elapsed()
    );
    until_closed_async(&mut held, 4).await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_its_answers_is_cut_off_by_the_idle_timeout() {
    use std::io::{Read, Write};
    let node = cluster_node("management-stall", vec![]).await;
    // A recorder of this test's own (not installed) whose text is long.
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        for i in 0..2_000 {
            metrics::counter!(format!(
                "management_test_filler_{i:04}_named_at_length_to_make_a_long_text"
            ))
            .increment(1);
        }
    });
    assert!(handle.render().len() > 100_000);
    let server = Management::new(node.clone())
        .prometheus(handle)
        .max_connections(1)
        .header_read_timeout(Duration::from_secs(600))
        .idle_timeout(Duration::from_secs(1))
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("endpoint binds");
    let at = server.local_addr();
    // 128 long answers asked for at once and none read: once the socket
    // buffers are full, no byte moves.
    const ASKED: usize = 128;
    let mut stalled = std::net::TcpStream::connect(at).expect("connects");
    stalled
        .write_all(
            "GET /metrics HTTP/1.1\r\nhost: test\r\n\r\n"
                .repeat(ASKED)
                .as_bytes(),
        )
        .expect("sent");
    // It holds the only connection until the idle timeout closes it.
    let alive = until_answered(at, "/alive", |a| a.status == 200).await;
    assert_eq!(alive.json()["alive"], true);
    // What it had been sent ends early: the server closed it.
    let answers = tokio::task::spawn_blocking(move || {
        stalled
            .set_read_timeout(Some(LONG))
            .expect("a read timeout");
        let mut read = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match stalled.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => read.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("still open after {} bytes: {e}", read.len()),
            }
        }
        read.windows(15)
            .filter(|w| *w == b"HTTP/1.1 200 OK")
            .count()
    })
    .await
    .expect("read");
    assert!(answers < ASKED, "all {answers} answers came");
    server.shutdown().await;
}

/// Raises this process's soft open-file limit to `want` if it is lower
/// and the hard limit allows; whether it is at least `want` now.
fn raise_file_limit(want: libc::rlim_t) -> bool {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit with a valid rlimit of ours.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return false;
        }
        if limit.rlim_cur < want {
            limit.rlim_cur = want.min(limit.rlim_max);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return false;
            }
        }
    }
    limit.rlim_cur >= want
}

/// A `datum-node` process with `flags`, its open-file limit lowered to
/// `files` when given, and its stdout lines.
fn node_process(
    flags: &[&str],
    files: Option<libc::rlim_t>,
) -> (KillOnDrop, std::sync::mpsc::Receiver<String>) {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(BIN);
    command
        .args(flags)
        .env("DATUM_SECRET", "management-secret")
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(files) = files {
        // SAFETY: only getrlimit and setrlimit between fork and exec.
        unsafe {
            command.pre_exec(move || {
                let mut limit = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                limit.rlim_cur = files.min(limit.rlim_max);
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = KillOnDrop(command.spawn().expect("spawn datum-node"));
    let stdout = child.0.stdout.take().unwrap();
    let (lines, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

/// The first line (at most `LONG` away) that `check` holds of, parsed.
fn expect_line(lines: &std::sync::mpsc::Receiver<String>, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + LONG;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("no such line within {LONG:?}: {e}"));
        let event: Value = serde_json::from_str(&line).expect("a JSON line");
        if check(&event) {
            return event;
        }
    }
}

/// A node whose process may hold 256 files: 400 connections to its
/// endpoint that never send a request are more than its file limit, but
/// the endpoint holds at most a quarter of it (the default limit) and
/// closes the rest as they come, so the cluster port still accepts (a
/// second node joins through it) and, once the held ones go, `/alive`
/// answers.
#[test]
fn connections_to_the_endpoint_cannot_take_the_cluster_ports_files() {
    const FILES: libc::rlim_t = 256;
    const CONNECTIONS: usize = 400;
    if !raise_file_limit(2_048) {
        eprintln!("skipped: this process cannot hold 2048 open files");
        return;
    }
    let (_first, first_lines) = node_process(
        &[
            "--cluster-name",
            "management-files",
            "--bind",
            "127.0.0.1:0",
            "--management-addr",
            "127.0.0.1:0",
            "--management-header-timeout-ms",
            "600000",
            "--management-idle-timeout-ms",
            "600000",
        ],
        Some(FILES),
    );
    let started = expect_line(&first_lines, |e| e["event"] == "started");
    let cluster_addr = started["addr"].as_str().unwrap().to_owned();
    let listening = expect_line(&first_lines, |e| e["event"] == "management_listening");
    let at: SocketAddr = listening["addr"].as_str().unwrap().parse().unwrap();

    let mut idle: Vec<_> = (0..CONNECTIONS).map(|_| idle_connection(at)).collect();
    // All but a quarter of the file limit are closed as they come.
    let limit = (FILES / 4) as usize;
    let gone = until_closed(&mut idle, CONNECTIONS - limit);
    let open = gone.iter().filter(|g| !**g).count();
    assert_eq!(open, limit);

    // The cluster port still accepts: a second node joins through it while
    // the endpoint holds its limit.
    let (_second, second_lines) = node_process(
        &[
            "--cluster-name",
            "management-files",
            "--bind",
            "127.0.0.1:0",
            "--seeds",
            &cluster_addr,
        ],
        None,
    );
    let second = expect_line(&second_lines, |e| e["event"] == "started");
    let second_id = second["node_id"].clone();
    expect_line(&first_lines, |e| {
        e["event"] == "member_up" && e["node_id"] == second_id
    });

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        // Full: a probe is closed too; once the held connections go, it is
        // answered.
        assert!(try_get(at, "/alive").await.is_none());
        drop(idle);
        let alive = until_answered(at, "/alive", |a| a.status == 200).await;
        assert_eq!(alive.json()["alive"], true);
    });
}

/// `datum-node` refuses a management token that is empty (a variable set
/// but empty: the endpoint would be open) or that a header cannot carry
/// as written (a secret read from a file with its line break), before it
/// starts.
#[test]
fn datum_node_refuses_an_empty_or_malformed_management_token() {
    for token in ["", "s3cret\n", "two words"] {
        let out = Command::new(BIN)
            .args([
                "--cluster-name",
                "management-token",
                "--bind",
                "127.0.0.1:0",
            ])
            .args(["--management-addr", "127.0.0.1:0"])
            .env("DATUM_SECRET", "management-secret")
            .env("DATUM_MANAGEMENT_TOKEN", token)
            .stdin(Stdio::null())
            .output()
            .expect("run datum-node");
        assert_eq!(out.status.code(), Some(2), "{token:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("management-token"), "{token:?}: {stderr}");
    }
}
