//! Rolling upgrades of real `datum-node` processes on 127.0.0.1: a
//! cluster of one build of the service is rolled to the next one node at
//! a time — a node of the new build is started and registered, then an old
//! node is sent SIGTERM and hands its shards off — while a client in this
//! process adds to counters through a reliable producer and asks them, as
//! a user's service would. Two rolls: to a build whose counter protocol
//! gained `ask Reset -> u64` and moves its state in a new shape
//! (`--counter-version 2`, application version 2.0), and to a build with
//! the same protocol and a new application version (1.4 to 1.5).
//!
//! What must hold: no ask is lost (the only error an ask may meet is
//! `ShuttingDown`, sent again); every reliable addition takes effect once
//! and every counter's total survives every move (a total that fell back to
//! the factory's 0 on a move shows as a short total); `Reset`, a message
//! version 1 does not know, is refused with `UnknownMessage` while no
//! version-2 node is up and answered once one is (its shard moved there);
//! at the end every shard is hosted by a node of the new build, whose
//! application version the members report. Each node prints a line for
//! every shard that moves to it, with its entities' states or without
//! them: none may come without, no shard may go to a node of the old
//! build, and none may leave the old build twice; the moves are printed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::ClusterNode;
use datum_cluster_sharding::{ProducerConfig, ShardedSystem, ShardingError};

mod common;
mod node_process;
use common::{field, number};
use node_process::{LONG, NodeProcess, proxy_client, runtime};

#[path = "../protocols/counter.rs"]
mod counter;
#[path = "../protocols/counter_v2.rs"]
mod counter_v2;
#[cfg(feature = "postgres")]
#[path = "../protocols/journaled.rs"]
mod journaled;
#[cfg(feature = "postgres")]
#[path = "../protocols/journaled_v2.rs"]
mod journaled_v2;
#[cfg(feature = "postgres")]
#[path = "../protocols/pg_server.rs"]
mod pg_server;

use counter::{Add, Get};
use counter_v2::{CounterV2, Reset};

/// The client's ask timeout: generous, since a busy machine may answer
/// seconds late during a handoff, and below [`LONG`].
const ASK_TIMEOUT: Duration = Duration::from_secs(20);
/// Counters the producer adds to and the asks read.
const COUNTERS: usize = 64;
/// Counters that are reset (kept apart, so that the totals stay checkable).
const RESET: usize = 8;

/// One build of the service: the counter's version and the application
/// version.
#[derive(Clone, Copy, Debug)]
struct Build {
    counter: &'static str,
    app: &'static str,
}

/// The flags of a node of `build`. `UPGRADE_APP=none` leaves out the
/// application version (every node `"0"`), to measure a roll without it.
fn flags(build: Build) -> [&'static str; 9] {
    let app = if std::env::var("UPGRADE_APP").as_deref() == Ok("none") {
        "0"
    } else {
        build.app
    };
    [
        "--counter",
        "--counter-version",
        build.counter,
        "--app-version",
        app,
        "--shards",
        "32",
        "--stats-ms",
        "100",
    ]
}

/// Every shard move the nodes printed: when, the shard, the node id it
/// came from, and the name of the node it went to (a node prints `shard_received` for each shard that comes
/// to it from another). Panics on a `shard_fell_back` or a
/// `state_refused` line: a state that did not come.
fn shard_moves(nodes: &[&NodeProcess]) -> Vec<(Instant, u64, String, &'static str)> {
    let mut moves = Vec::new();
    for node in nodes {
        let history = node.history.lock().unwrap_or_else(|p| p.into_inner());
        for (at, line) in history.iter() {
            match field(line, "event") {
                Some("shard_received") => moves.push((
                    *at,
                    number(line, "shard").expect("shard"),
                    field(line, "from").expect("from").to_owned(),
                    node.name,
                )),
                Some("shard_fell_back" | "state_refused" | "migration_events_lost") => {
                    panic!("{}: a state did not come: {line}", node.name)
                }
                _ => {}
            }
        }
    }
    moves
}

/// Starts a node with `flags` joining through `through` and waits until
/// `up` members are Up (the client included) and its region is
/// registered with the coordinator, so that shards can go to it.
async fn join(
    name: &'static str,
    flags: &[&str],
    through: &str,
    up: usize,
    client: &ClusterNode,
) -> NodeProcess {
    let mut joined = NodeProcess::start_with(name, Some(through), flags);
    joined.expect_members_up(up);
    joined.expect_line(|l| {
        field(l, "event") == Some("region_state") && l.contains(r#""registered":true"#)
    });
    client
        .wait_until(|s| s.up_members().count() == up, LONG)
        .await
        .expect("the client sees the new node Up");
    joined
}

/// SIGTERM to `leaving`: it hands its shards off, exits 0, and the client
/// sees it removed.
async fn leave(leaving: &mut NodeProcess, client: &ClusterNode) {
    leaving.signal(libc::SIGTERM);
    let (_, done) = leaving.expect_line(|l| field(l, "event") == Some("handed_off"));
    assert_eq!(number(&done, "shards"), Some(0), "{done}");
    let (status, _) = leaving.expect_exit();
    assert!(status.success(), "{} exited with {status}", leaving.name);
    let gone: std::net::SocketAddr = leaving.addr.parse().expect("addr");
    client
        .wait_until(|s| s.members.iter().all(|m| m.address.addr != gone), LONG)
        .await
        .expect("the client sees the old node removed");
}

/// Asks `Reset` of counter `id` until it is answered, as a caller does
/// while its shard moves to a node that knows the message: every refusal
/// meanwhile must be `UnknownMessage`.
async fn reset_until_answered(system: &ShardedSystem, id: &str) {
    let counter = system.entity_ref::<CounterV2>(id);
    let deadline = Instant::now() + LONG;
    loop {
        match counter.ask(Reset, ASK_TIMEOUT).await {
            Ok(n) => {
                assert_eq!(n, 1, "{id}: reset once");
                return;
            }
            Err(ShardingError::UnknownMessage { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{id}: Reset with a version-2 node up: {e:?}"),
        }
    }
}

/// Rolls a cluster of `from` to `to` under traffic, checks that nothing
/// was lost and that each shard left the old build once (with a successor
/// started before each leave), and prints what moved.
fn roll(from: Build, to: Build) {
    let nodes: usize = std::env::var("UPGRADE_NODES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    const OLD: [&str; 5] = ["old-a", "old-b", "old-c", "old-d", "old-e"];
    const NEW: [&str; 5] = ["new-a", "new-b", "new-c", "new-d", "new-e"];
    assert!((2..=5).contains(&nodes), "UPGRADE_NODES: 2 to 5");
    // `UPGRADE_ORDER=in-place` stops each old node before its successor
    // starts (as a fixed set of hosts must): the first leavers' shards then
    // go to old nodes, which move them again. By default a successor starts
    // first (a surge of one node).
    let in_place = std::env::var("UPGRADE_ORDER").as_deref() == Ok("in-place");
    // Whether the protocol gains `Reset`.
    let reset = from.counter == "1" && to.counter == "2";
    let first = NodeProcess::start_with(OLD[0], None, &flags(from));
    let seed = first.addr.clone();
    let mut old = vec![first];
    for name in &OLD[1..nodes] {
        old.push(NodeProcess::start_with(name, Some(&seed), &flags(from)));
    }
    let mut new: Vec<NodeProcess> = Vec::new();
    let rolled = runtime().block_on(async {
        let (client, system) = proxy_client::<CounterV2>(&seed, nodes + 1).await;
        let ids: Vec<String> = (0..COUNTERS).map(|k| format!("c-{k}")).collect();
        let resets: Vec<String> = (0..RESET).map(|k| format!("r-{k}")).collect();

        // Version 1 does not know `Reset`: refused, typed, unprocessed.
        if reset {
            match system
                .entity_ref::<CounterV2>(resets[0].as_str())
                .ask(Reset, ASK_TIMEOUT)
                .await
            {
                Err(ShardingError::UnknownMessage {
                    type_name: "counter",
                    line: 3,
                    lines: 2,
                    ..
                }) => {}
                other => panic!("a Reset before any version-2 node: {other:?}"),
            }
        }

        // Every counter answers once, so that every shard has a home on
        // the old build before the roll begins.
        for id in ids.iter().chain(&resets) {
            let counter = system.entity_ref::<CounterV2>(id.as_str());
            assert_eq!(counter.ask(Get, ASK_TIMEOUT).await.expect("warm-up"), 0);
        }

        // Traffic: one reliable addition after another to every counter,
        // and asks of every counter, until the roll is done.
        let stop = Arc::new(AtomicBool::new(false));
        let producer = system
            .reliable_producer::<CounterV2>("roll", ProducerConfig::default())
            .expect("producer");
        let adding = {
            let (producer, ids, stop) = (producer.clone(), ids.clone(), stop.clone());
            tokio::spawn(async move {
                let mut sent = vec![0u64; ids.len()];
                while !stop.load(Ordering::Relaxed) {
                    for (k, id) in ids.iter().enumerate() {
                        producer.send(id.as_str(), Add(1)).await.expect("send");
                        sent[k] += 1;
                    }
                }
                sent
            })
        };
        let asking = {
            let (system, ids, stop) = (system.clone(), ids.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut answered, mut retried) = (0u64, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    for id in &ids {
                        let counter = system.entity_ref::<CounterV2>(id.as_str());
                        loop {
                            match counter.ask(Get, ASK_TIMEOUT).await {
                                Ok(_) => break,
                                Err(e @ ShardingError::ShuttingDown) => {
                                    retried.push(e);
                                    tokio::time::sleep(Duration::from_millis(10)).await;
                                }
                                Err(e) => panic!("{id}: an ask failed with {e:?}"),
                            }
                        }
                        answered += 1;
                    }
                }
                (answered, retried)
            })
        };

        // The roll: a version-2 node joins, then a version-1 node leaves.
        // Until the last old node is told to leave, rebalance rounds are
        // held (its hosts run two versions).
        let mut rolled = Instant::now();
        for step in 0..nodes {
            let through = new.last().map_or(old[1].addr.clone(), |n| n.addr.clone());
            if step + 1 == nodes {
                rolled = Instant::now();
            }
            if in_place {
                leave(&mut old[step], &client).await;
            }
            let up = if in_place { nodes + 1 } else { nodes + 2 };
            new.push(join(NEW[step], &flags(to), &through, up, &client).await);
            if step == 0 && reset {
                // `Reset` now moves its shard to the version-2 node, and
                // is answered there once sent again.
                for id in &resets {
                    reset_until_answered(&system, id).await;
                }
            }
            if !in_place {
                leave(&mut old[step], &client).await;
            }
        }

        stop.store(true, Ordering::Relaxed);
        let sent = adding.await.expect("adding");
        let (answered, retried) = asking.await.expect("asking");
        producer.flush(LONG).await.expect("every addition confirmed");
        let stats = producer.stats();
        let added: u64 = sent.iter().sum();
        assert_eq!(stats.failed, 0, "{stats:?}");
        assert_eq!(stats.confirmed, added, "{stats:?}");
        // Every addition counted once, on totals that moved with their
        // shards at every step.
        for (k, id) in ids.iter().enumerate() {
            let total = system
                .entity_ref::<CounterV2>(id.as_str())
                .ask(Get, ASK_TIMEOUT)
                .await
                .expect("get");
            assert_eq!(total, sent[k], "{id}: its total");
        }
        // Every reset counter kept its state too, and only the new build
        // hosts, as the members' answers say.
        for id in resets.iter().filter(|_| reset) {
            let counter = system.entity_ref::<CounterV2>(id.as_str());
            assert_eq!(counter.ask(Reset, ASK_TIMEOUT).await.expect("reset"), 2);
        }
        // Every member reports its application version.
        let stats = system
            .cluster_sharding_stats::<CounterV2>(LONG)
            .await
            .expect("stats");
        assert!(stats.failed.is_empty(), "{stats:?}");
        for n in &new {
            let addr: std::net::SocketAddr = n.addr.parse().expect("addr");
            let reported = (stats.app_versions.iter()).find(|(m, _)| m.addr == addr);
            assert_eq!(
                reported.map(|(_, v)| v.as_str()),
                Some(flags(to)[4]),
                "{}: {stats:?}",
                n.name
            );
        }
        eprintln!(
            "{nodes} nodes rolled: {added} additions confirmed, {answered} asks answered ({} sent again after ShuttingDown), 0 lost",
            retried.len()
        );
        system.shutdown().await;
        let _ = client.shutdown().await;
        rolled
    });
    // The nodes' lines are complete once they have exited.
    for n in &mut new {
        n.signal(libc::SIGTERM);
        let (status, _) = n.expect_exit();
        assert!(status.success(), "{} exited with {status}", n.name);
    }
    // Each shard the old build hosted left it once (with a successor up
    // first; in place, at most once per old node), and no shard moved
    // between nodes of the new build before the last old node was told to
    // leave (after it, rebalance rounds may spread them).
    let everyone: Vec<&NodeProcess> = old.iter().chain(new.iter()).collect();
    let old_ids: Vec<&str> = old.iter().map(|n| n.node_id.as_str()).collect();
    let mut from_old: BTreeMap<u64, usize> = BTreeMap::new();
    for (at, shard, from, to) in shard_moves(&everyone) {
        // With a successor up first, no shard ever goes to an old node.
        assert!(
            in_place || NEW.contains(&to),
            "shard {shard} moved to {to}, of the old build"
        );
        if old_ids.contains(&from.as_str()) {
            *from_old.entry(shard).or_default() += 1;
        } else {
            assert!(
                at > rolled,
                "shard {shard} moved again mid-roll, from {from}"
            );
        }
    }
    let mut histogram: BTreeMap<usize, usize> = BTreeMap::new();
    for n in from_old.values() {
        *histogram.entry(*n).or_default() += 1;
    }
    eprintln!("shards by moves off the old build (moves: shards): {histogram:?}");
    let hosted_by_old = hosted_shards(&old);
    assert!(!hosted_by_old.is_empty(), "the old build hosted nothing");
    let most = if in_place { nodes } else { 1 };
    for shard in &hosted_by_old {
        let moves = from_old.get(shard).copied().unwrap_or(0);
        assert!(
            (1..=most).contains(&moves),
            "shard {shard}, hosted by the old build, left it {moves} times: {from_old:?}"
        );
    }
}

/// Every shard `nodes` printed in a region line while they ran.
fn hosted_shards(nodes: &[NodeProcess]) -> std::collections::BTreeSet<u64> {
    let mut hosted = std::collections::BTreeSet::new();
    for node in nodes {
        let history = node.history.lock().unwrap_or_else(|p| p.into_inner());
        for (_, line) in history.iter() {
            if matches!(
                field(line, "event"),
                Some("region_state" | "handoff_started")
            ) {
                hosted.extend(
                    common::numbers(line, "shard_ids")
                        .into_iter()
                        .map(u64::from),
                );
            }
        }
    }
    hosted
}

#[test]
fn a_cluster_rolls_to_a_protocol_that_gained_a_message_and_loses_nothing() {
    roll(
        Build {
            counter: "1",
            app: "1.0",
        },
        Build {
            counter: "2",
            app: "2.0",
        },
    );
}

#[test]
fn a_new_build_with_the_same_protocol_moves_each_shard_once() {
    roll(
        Build {
            counter: "1",
            app: "1.4",
        },
        Build {
            counter: "1",
            app: "1.5",
        },
    );
}

/// A roll back from version 2 to version 1 of the counter (its build given
/// a higher application version, as a re-release of the old code would
/// be): version 2 nodes keep every shard while one is up, since only they
/// know `Reset`; when the last leaves, its shards go to version 1 nodes,
/// which cannot read version 2's state. That state is refused, by name
/// (`state_refused`: "version 2, above this build's 1"), and its counters
/// start again from 0 — never misread; asks go on being answered, and a
/// `Reset` is refused with `UnknownMessage` once no node knows it.
#[test]
fn a_roll_back_to_a_version_that_cannot_read_the_state_refuses_it_by_name() {
    let v2 = Build {
        counter: "2",
        app: "2.0",
    };
    let v1_again = Build {
        counter: "1",
        app: "2.1",
    };
    let first = NodeProcess::start_with("v2-a", None, &flags(v2));
    let seed = first.addr.clone();
    let mut old = [
        first,
        NodeProcess::start_with("v2-b", Some(&seed), &flags(v2)),
    ];
    let mut back: Vec<NodeProcess> = Vec::new();
    runtime().block_on(async {
        let (client, system) = proxy_client::<CounterV2>(&seed, 3).await;
        let ids: Vec<String> = (0..16).map(|k| format!("c-{k}")).collect();
        for id in &ids {
            let counter = system.entity_ref::<CounterV2>(id.as_str());
            counter.tell(Add(5)).await.expect("add");
            assert_eq!(counter.ask(Get, ASK_TIMEOUT).await.expect("get"), 5);
        }
        for (step, name) in ["v1-a", "v1-b"].into_iter().enumerate() {
            let through = back.last().map_or(old[1].addr.clone(), |n| n.addr.clone());
            back.push(join(name, &flags(v1_again), &through, 4, &client).await);
            leave(&mut old[step], &client).await;
            // Every counter still answers, whatever state it was given.
            for id in &ids {
                let counter = system.entity_ref::<CounterV2>(id.as_str());
                let total = counter.ask(Get, ASK_TIMEOUT).await.expect("get");
                assert!(total == 5 || (step == 1 && total == 0), "{id}: {total}");
            }
        }
        // Version 2 is gone: its state was refused, so the counters start
        // from the factory; `Reset` is refused, typed, unprocessed.
        for id in &ids {
            let counter = system.entity_ref::<CounterV2>(id.as_str());
            assert_eq!(counter.ask(Get, ASK_TIMEOUT).await.expect("get"), 0);
        }
        match (system.entity_ref::<CounterV2>("c-0"))
            .ask(Reset, ASK_TIMEOUT)
            .await
        {
            Err(ShardingError::UnknownMessage {
                line: 3, lines: 2, ..
            }) => {}
            other => panic!("a Reset with only version 1 up: {other:?}"),
        }
        system.shutdown().await;
        let _ = client.shutdown().await;
    });
    // The refusals say why, on the version 1 nodes that took the shards
    // (their lines are complete once they have exited).
    for n in &mut back {
        n.signal(libc::SIGTERM);
        let (status, _) = n.expect_exit();
        assert!(status.success(), "{} exited with {status}", n.name);
    }
    let refused: Vec<String> = back
        .iter()
        .flat_map(|n| {
            let history = n.history.lock().unwrap_or_else(|p| p.into_inner());
            (history.iter())
                .filter(|(_, l)| field(l, "event") == Some("state_refused"))
                .map(|(_, l)| l.clone())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(refused.len(), 16, "one refusal per counter: {refused:?}");
    for line in &refused {
        assert!(
            line.contains("the state has version 2, above this build's 1"),
            "{line}"
        );
    }
}

/// A journal version 1 of the journaled counter wrote, recovered by
/// version 2 through its upcaster, in a roll of real processes sharing one
/// PostgreSQL (the test starts its own; without the package it says so and
/// passes): version 1's totals are there after the roll, version 2
/// journals its own events beside them, and a node started afterwards
/// recovers the mixed journal.
#[cfg(feature = "postgres")]
#[test]
fn a_journal_written_by_version_1_recovers_under_version_2_in_a_roll() {
    use journaled_v2::{JournaledCounterV2, Reset};

    let Some(server) = pg_server::Server::start(pg_server::Durability::NoFsync) else {
        return;
    };
    let url = server.database();
    let journaled = |build: Build| -> Vec<&str> {
        let mut all = flags(build).to_vec();
        all.extend(["--journal-url", url.as_str()]);
        all
    };
    let (v1, v2) = (
        Build {
            counter: "1",
            app: "1",
        },
        Build {
            counter: "2",
            app: "2",
        },
    );
    let first = NodeProcess::start_with("j1-a", None, &journaled(v1));
    let seed = first.addr.clone();
    let mut old = [
        first,
        NodeProcess::start_with("j1-b", Some(&seed), &journaled(v1)),
    ];
    let mut new: Vec<NodeProcess> = Vec::new();
    let ids: Vec<String> = (0..16).map(|k| format!("j-{k}")).collect();
    runtime().block_on(async {
        let (client, system) = proxy_client::<JournaledCounterV2>(&seed, 3).await;
        for (k, id) in ids.iter().enumerate() {
            let counter = system.entity_ref::<JournaledCounterV2>(id.as_str());
            for n in 1..=3 {
                counter.ask(Add(n), ASK_TIMEOUT).await.expect("v1 add");
            }
            let k = k as u64;
            assert_eq!(
                counter.ask(Add(k), ASK_TIMEOUT).await.expect("v1 add"),
                6 + k
            );
        }
        for (name, step) in ["j2-a", "j2-b"].into_iter().zip(0..) {
            let through = new
                .last()
                .map_or(old[1].addr.clone(), |n: &NodeProcess| n.addr.clone());
            new.push(join(name, &journaled(v2), &through, 4, &client).await);
            leave(&mut old[step], &client).await;
        }
        // Version 2 recovered version 1's events, and journals its own.
        for (k, id) in ids.iter().enumerate() {
            let counter = system.entity_ref::<JournaledCounterV2>(id.as_str());
            assert_eq!(
                counter.ask(Get, ASK_TIMEOUT).await.expect("v2 get"),
                6 + k as u64
            );
            assert_eq!(counter.ask(Reset, ASK_TIMEOUT).await.expect("v2 reset"), 1);
            assert_eq!(counter.ask(Add(2), ASK_TIMEOUT).await.expect("v2 add"), 2);
        }
        system.shutdown().await;
        let _ = client.shutdown().await;
    });
    // A node started on the mixed journal alone recovers it.
    for n in &mut new {
        n.signal(libc::SIGTERM);
        let (status, _) = n.expect_exit();
        assert!(status.success(), "{} exited with {status}", n.name);
    }
    let mut last = NodeProcess::start_with("j2-c", None, &journaled(v2));
    runtime().block_on(async {
        let (client, system) = proxy_client::<JournaledCounterV2>(&last.addr, 2).await;
        for id in &ids {
            let counter = system.entity_ref::<JournaledCounterV2>(id.as_str());
            assert_eq!(counter.ask(Get, ASK_TIMEOUT).await.expect("recovered"), 2);
            assert_eq!(counter.ask(Reset, ASK_TIMEOUT).await.expect("reset"), 2);
        }
        system.shutdown().await;
        let _ = client.shutdown().await;
    });
    let versions = server.psql(&url, "SELECT DISTINCT version FROM datum_events ORDER BY 1");
    assert_eq!(
        versions.split_whitespace().collect::<Vec<_>>(),
        ["1", "2"],
        "{versions}"
    );
    last.signal(libc::SIGTERM);
    let (status, _) = last.expect_exit();
    assert!(status.success(), "the last node exited with {status}");
}
