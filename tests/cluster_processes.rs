//! Three `datum-node` OS processes on 127.0.0.1: they form a cluster, a
//! SIGKILLed one is downed by the others, a SIGTERMed one leaves gracefully,
//! a frozen (SIGSTOP) one that was downed meanwhile stops once thawed, and
//! a SIGTERMed one hosting counter shards hands them off under traffic.
//!
//! The processes are [`node_process::NodeProcess`]es.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;
mod node_process;
use common::{field, number};
use node_process::{BIN, LONG, NodeProcess, is_event_about, proxy_client, runtime};
/// The client's ask timeout. An ask that times out counts as lost (only
/// ShuttingDown may be retried), so this is generous too: a busy machine
/// may answer seconds late during a handoff. Below `LONG`, so that a lost
/// ask fails the test as a timeout.
const ASK_TIMEOUT: Duration = Duration::from_secs(20);

/// Three nodes, the second and third seeded by the first, all seeing 3 Up.
fn three_nodes() -> [NodeProcess; 3] {
    let n1 = NodeProcess::start("n1", None);
    let seed = n1.addr.clone();
    let n2 = NodeProcess::start("n2", Some(&seed));
    let n3 = NodeProcess::start("n3", Some(&seed));
    let mut nodes = [n1, n2, n3];
    for n in &mut nodes {
        n.expect_members_up(3);
    }
    nodes
}

#[test]
fn a_sigkilled_node_is_downed_by_the_other_two() {
    let [mut n1, mut n2, mut n3] = three_nodes();
    let victim = n3.node_id.clone();
    let killed_at = Instant::now();
    n3.kill();
    for observer in [&mut n1, &mut n2] {
        let name = observer.name;
        let no_live_node_downed = |l: &str| {
            let other = field(l, "event") == Some("member_downed")
                && field(l, "node_id") != Some(victim.as_str());
            assert!(!other, "{}: a live node was downed: {l}", name);
        };
        let (first_at, first) = observer.expect_line(|l| {
            no_live_node_downed(l);
            is_event_about(l, "unreachable", &victim) || is_event_about(l, "member_downed", &victim)
        });
        assert_eq!(
            field(&first, "event"),
            Some("unreachable"),
            "Unreachable comes before Down"
        );
        let (down_at, _) = observer.expect_line(|l| {
            no_live_node_downed(l);
            is_event_about(l, "member_downed", &victim)
        });
        let (unreachable, down) = (first_at - killed_at, down_at - killed_at);
        eprintln!(
            "{}: kill → unreachable {unreachable:?}, → down {down:?}",
            observer.name
        );
        // Budget: 1.4 s (detection, then the view holding still for the
        // resolver's `stable_after`). The bound leaves room for a machine
        // whose cores are all busy; a Down an order of magnitude later than
        // configured still fails it.
        assert!(down < Duration::from_secs(10), "downed only after {down:?}");
    }
}

#[test]
fn a_sigtermed_node_leaves_gracefully_and_exits_0() {
    let [mut n1, mut n2, mut n3] = three_nodes();
    let leaver = n3.node_id.clone();
    n3.signal(libc::SIGTERM);
    for observer in [&mut n1, &mut n2] {
        let (_, removed) = observer.expect_line(|l| {
            assert!(
                !is_event_about(l, "member_downed", &leaver),
                "the leaver was downed, not removed: {l}"
            );
            is_event_about(l, "member_removed", &leaver)
        });
        assert_eq!(field(&removed, "previous"), Some("Exiting"), "{removed}");
    }
    let (status, rest) = n3.expect_exit();
    assert!(status.success(), "n3 exited with {status}");
    // It heard it was removed (the survivors flush their last gossip before
    // closing its pipes), so it never suspected the healthy nodes it left.
    let suspicions: Vec<&String> = rest
        .iter()
        .filter(|l| matches!(field(l, "event"), Some("member_downed" | "unreachable")))
        .collect();
    assert!(
        suspicions.is_empty(),
        "the leaver suspected healthy peers: {suspicions:?}"
    );
    let last = rest.last().map(String::as_str).unwrap_or_default();
    assert_eq!(field(last, "event"), Some("stopped"), "last line: {last}");
    assert_eq!(field(last, "reason"), Some("left"), "last line: {last}");
}

#[test]
fn a_frozen_node_that_was_downed_stops_with_exit_code_3_when_thawed() {
    let [mut n1, mut n2, mut n3] = three_nodes();
    let victim = n3.node_id.clone();
    n3.signal(libc::SIGSTOP);
    for observer in [&mut n1, &mut n2] {
        observer.expect_line(|l| is_event_about(l, "member_downed", &victim));
    }
    n3.signal(libc::SIGCONT);
    let (status, lines) = n3.expect_exit();
    assert_eq!(status.code(), Some(3), "n3 exited with {status}");
    let last = lines.last().map(String::as_str).unwrap_or_default();
    assert_eq!(field(last, "event"), Some("stopped"), "last line: {last}");
    assert_eq!(field(last, "reason"), Some("downed"), "last line: {last}");
}

/// A node started with another secret is refused, prints `join_refused`
/// lines naming the seed and gives up with exit code 5; the seed never
/// admits it. (Another cluster name is refused the same way: tests/cluster.rs.)
#[test]
fn a_node_whose_join_is_refused_exits_5_and_says_why() {
    let mut seed_node = NodeProcess::start("seed", None);
    let seed = seed_node.addr.clone();
    {
        let (name, flags, reason) = ("wrong-secret", ["--secret", "not-the-secret"], "BadProof");
        let mut bad = NodeProcess::start_with(name, Some(&seed), &flags);
        let (status, lines) = bad.expect_exit();
        assert_eq!(status.code(), Some(5), "{name} exited with {status}");
        let refusals: Vec<&String> = lines
            .iter()
            .filter(|l| field(l, "event") == Some("join_refused"))
            .collect();
        assert!(!refusals.is_empty(), "{name} printed no refusal: {lines:?}");
        for line in &refusals {
            assert_eq!(field(line, "addr"), Some(seed.as_str()), "{line}");
            assert!(
                field(line, "reason").is_some_and(|r| r.contains(reason)),
                "{line}"
            );
        }
        let last = lines.last().map(String::as_str).unwrap_or_default();
        assert_eq!(
            field(last, "reason"),
            Some("join_refused"),
            "last line: {last}"
        );
        let stderr = bad.stderr.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert!(
            stderr.contains("gave up joining") && stderr.contains(&seed),
            "{stderr}"
        );
    }
    // The seed saw nobody join but itself.
    seed_node.signal(libc::SIGTERM);
    let (status, lines) = seed_node.expect_exit();
    assert!(status.success(), "the seed exited with {status}");
    assert!(
        lines
            .iter()
            .filter(|l| field(l, "event") == Some("member_joined"))
            .all(|l| field(l, "node_id") == Some(seed_node.node_id.as_str())),
        "{lines:?}"
    );
}

#[test]
fn bad_flags_exit_2_and_a_taken_port_exits_1() {
    let bad = Command::new(BIN)
        .args([
            "--cluster-name",
            "c",
            "--secret",
            "s",
            "--heartbeat-ms",
            "0",
        ])
        .output()
        .expect("run datum-node");
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(stderr.contains("--heartbeat-ms"), "{stderr}");
    assert!(bad.stdout.is_empty());

    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let clash = Command::new(BIN)
        .args(["--cluster-name", "c", "--secret", "s", "--bind", &addr])
        .output()
        .expect("run datum-node");
    assert_eq!(clash.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&clash.stderr);
    assert!(stderr.contains("could not bind"), "{stderr}");
    assert!(clash.stdout.is_empty());
}

#[allow(dead_code)]
#[path = "../protocols/counter.rs"]
mod counter;
#[path = "../protocols/journaled.rs"]
mod journaled;
#[path = "../protocols/pg_server.rs"]
mod pg_server;

#[test]
fn a_sigtermed_counter_node_hands_its_shards_off_under_traffic() {
    use datum_cluster_sharding::ShardingError;

    let flags = ["--counter", "--shards", "32", "--stats-ms", "100"];
    let mut n1 = NodeProcess::start_with("n1", None, &flags);
    let seed = n1.addr.clone();
    let mut n2 = NodeProcess::start_with("n2", Some(&seed), &flags);
    let mut n3 = NodeProcess::start_with("n3", Some(&seed), &flags);
    runtime().block_on(async {
        let (client, system) = proxy_client::<counter::Counter>(&seed, 4).await;
        let ids: Vec<String> = (0..200).map(|k| format!("c-{k}")).collect();
        let traffic = |rounds: usize| {
            let system = system.clone();
            let ids = ids.clone();
            tokio::spawn(async move {
                let mut answered = 0;
                let mut retried = Vec::new();
                for _ in 0..rounds {
                    for id in &ids {
                        let counter = system.entity_ref::<counter::Counter>(id.as_str());
                        let deadline = Instant::now() + LONG;
                        loop {
                            match counter.ask(counter::Get, ASK_TIMEOUT).await {
                                Ok(_) => break,
                                Err(e) => {
                                    assert!(Instant::now() < deadline, "{id}: {e}");
                                    retried.push(e);
                                    tokio::time::sleep(Duration::from_millis(10)).await;
                                }
                            }
                        }
                        answered += 1;
                    }
                }
                (answered, retried)
            })
        };
        // Every counter answers once (so every shard has a home), then
        // traffic goes on while n3 leaves.
        let (warm, _) = traffic(1).await.expect("warm-up");
        assert_eq!(warm, ids.len());
        let running = traffic(20);
        let (_, before) = n3.expect_line(|l| {
            field(l, "event") == Some("region_state")
                && number(l, "entities").is_some_and(|n| n > 0)
        });
        eprintln!("n3 before: {before}");
        n3.signal(libc::SIGTERM);
        let (_, started) = n3.expect_line(|l| field(l, "event") == Some("handoff_started"));
        let (_, done) = n3.expect_line(|l| field(l, "event") == Some("handed_off"));
        eprintln!("{started}\n{done}");
        assert!(
            number(&started, "shards").is_some_and(|n| n > 0),
            "{started}"
        );
        assert_eq!(number(&done, "shards"), Some(0), "{done}");
        let (status, rest) = n3.expect_exit();
        assert!(status.success(), "n3 exited with {status}");
        let last = rest.last().map(String::as_str).unwrap_or_default();
        assert_eq!(field(last, "reason"), Some("left"), "{last}");
        let (answered, retried) = running.await.expect("traffic");
        assert_eq!(answered, 20 * ids.len());
        for e in &retried {
            assert!(matches!(e, ShardingError::ShuttingDown), "{e:?}");
        }
        eprintln!(
            "{answered} asks answered, {} retried after ShuttingDown",
            retried.len()
        );
        // The two that stay host every shard that had a home. The stats ask
        // every member the client sees Joining, Up or Leaving, and n3 exited
        // once it knew it was removed, which the client may hear later:
        // first wait until the client has removed it too.
        let gone: std::net::SocketAddr = n3.addr.parse().expect("n3's addr");
        client
            .wait_until(|s| s.members.iter().all(|m| m.address.addr != gone), LONG)
            .await
            .expect("the client sees n3 removed");
        let stats = system
            .cluster_sharding_stats::<counter::Counter>(LONG)
            .await
            .expect("stats");
        assert!(stats.failed.is_empty(), "{stats:?}");
        let hosting: Vec<usize> = stats
            .shards_per_member()
            .into_values()
            .filter(|n| *n > 0)
            .collect();
        assert_eq!(hosting.len(), 2, "{stats:?}");
        system.shutdown().await;
        let _ = client.shutdown().await;
    });
    for n in [&mut n1, &mut n2] {
        n.signal(libc::SIGTERM);
        let (status, _) = n.expect_exit();
        assert!(status.success(), "{} exited with {status}", n.name);
    }
}

/// A reliable producer on a client node in this process, sending
/// `Credit(1)` round after round to 64 journaled counters hosted by three
/// `datum-node` processes that share one PostgreSQL journal, while a test
/// disturbs the hosts; [`finish`](Self::finish) checks that every credit
/// was confirmed and journaled exactly once.
struct CreditRun {
    server: pg_server::Server,
    db: String,
    flags: Vec<String>,
    nodes: Vec<NodeProcess>,
    client: datum_cluster_sharding::cluster::ClusterNode,
    system: datum_cluster_sharding::ShardedSystem,
    producer: datum_cluster_sharding::ReliableProducer<journaled::JournaledCounter>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    sending: tokio::task::JoinHandle<BTreeMap<String, u64>>,
}

impl CreditRun {
    /// Starts the server, the three hosts, the client and the producer
    /// (none without PostgreSQL's binaries: the test then passes, saying so).
    async fn start() -> Option<CreditRun> {
        use datum_cluster_sharding::ProducerConfig;

        let server = pg_server::Server::start(pg_server::Durability::NoFsync)?;
        let db = server.database();
        let flags: Vec<String> = ["--counter", "--shards", "32", "--stats-ms", "100"]
            .into_iter()
            .map(str::to_owned)
            .chain(["--journal-url".to_owned(), db.clone()])
            .collect();
        let mut nodes = vec![Self::host("n1", None, &flags)];
        let seed = nodes[0].addr.clone();
        nodes.push(Self::host("n2", Some(&seed), &flags));
        nodes.push(Self::host("n3", Some(&seed), &flags));
        let (client, system) = proxy_client::<journaled::JournaledCounter>(&seed, 4).await;
        let config = ProducerConfig::builder()
            .attempt_timeout(Duration::from_secs(2))
            .min_backoff(Duration::from_millis(20))
            .max_backoff(Duration::from_secs(1))
            .build();
        let producer = system
            .reliable_producer("proc-credits", config)
            .expect("producer");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sending = {
            let (producer, stop) = (producer.clone(), stop.clone());
            tokio::spawn(async move {
                let mut sent = BTreeMap::<String, u64>::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for k in 0..64 {
                        let id = format!("acct-{k}");
                        let credit = journaled::Credit(1);
                        producer.send(id.as_str(), credit).await.expect("send");
                        *sent.entry(id).or_default() += 1;
                    }
                }
                sent
            })
        };
        Some(CreditRun {
            server,
            db,
            flags,
            nodes,
            client,
            system,
            producer,
            stop,
            sending,
        })
    }

    /// A host process with the run's flags.
    fn host(name: &'static str, seed: Option<&str>, flags: &[String]) -> NodeProcess {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        NodeProcess::start_with(name, seed, &flags)
    }

    /// Waits until 300 more credits are confirmed than now.
    async fn more_confirmed(&self) {
        let target = self.producer.stats().confirmed + 300;
        let deadline = Instant::now() + LONG;
        while self.producer.stats().confirmed < target {
            assert!(Instant::now() < deadline, "{:?}", self.producer.stats());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the client sees `n` members Up.
    async fn members_up(&self, n: usize) {
        self.client
            .wait_until(|s| s.up_members().count() == n, LONG)
            .await
            .expect("members Up");
    }

    /// Stops sending, waits for every confirmation and checks the journal;
    /// returns the producer's stats.
    async fn finish(self) -> datum_cluster_sharding::ProducerStats {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let sent = self.sending.await.expect("sender");
        self.producer
            .flush(LONG)
            .await
            .expect("every credit confirmed");
        let stats = self.producer.stats();
        eprintln!("{stats:?}");
        assert_eq!(stats.unconfirmed, 0, "{stats:?}");
        assert_eq!(stats.failed, 0, "{stats:?}");
        assert_eq!(stats.confirmed, sent.values().sum::<u64>(), "{stats:?}");
        let totals = journaled_totals(&self.server, &self.db);
        let wrong: Vec<_> = sent
            .iter()
            .filter(|(id, n)| totals.get(*id) != Some(n))
            .map(|(id, n)| format!("{id}: sent {n}, journaled {:?}", totals.get(id)))
            .collect();
        assert!(wrong.is_empty(), "{wrong:?}");
        assert_eq!(totals.len(), sent.len(), "{totals:?}");
        self.system.shutdown().await;
        let _ = self.client.shutdown().await;
        for mut n in self.nodes.into_iter().filter(|n| !n.reaped) {
            n.signal(libc::SIGTERM);
            let (status, _) = n.expect_exit();
            assert!(status.success(), "{} exited with {status}", n.name);
        }
        stats
    }
}

/// Waits for a line, printed from now on, saying `node` hosts live
/// entities.
fn expect_hosting(node: &mut NodeProcess) {
    node.skip_printed();
    node.expect_line(|l| {
        field(l, "event") == Some("region_state") && number(l, "entities").is_some_and(|n| n > 0)
    });
}

/// A host that is not the coordinator is SIGKILLed under a reliable
/// producer's credits, then the coordinator is. Attempts the kills cut off
/// are sent again; those journaled before their host died are recognised
/// as duplicates by the next incarnation, from the delivery records in the
/// same journal.
#[test]
fn reliable_credits_survive_two_sigkills_each_journaled_once() {
    runtime().block_on(async {
        let Some(mut run) = CreditRun::start().await else {
            return;
        };
        // Each kill lands while credits flow to the victim, and more are
        // confirmed after it.
        for (victim, members_left) in [(2, 3), (0, 2)] {
            expect_hosting(&mut run.nodes[victim]);
            run.more_confirmed().await;
            run.nodes[victim].kill();
            run.members_up(members_left).await;
            run.more_confirmed().await;
        }
        let stats = run.finish().await;
        // The kills cut attempts off: those were sent again.
        assert!(stats.resent > 0, "{stats:?}");
    });
}

/// Every host in turn leaves gracefully (SIGTERM: its shards are handed
/// off) and a new process takes its place, under a reliable producer's
/// credits: each is journaled once, and none is lost.
#[test]
fn reliable_credits_survive_a_rolling_restart_each_journaled_once() {
    runtime().block_on(async {
        let Some(mut run) = CreditRun::start().await else {
            return;
        };
        for (i, name) in ["n1'", "n2'", "n3'"].into_iter().enumerate() {
            expect_hosting(&mut run.nodes[i]);
            run.more_confirmed().await;
            run.nodes[i].signal(libc::SIGTERM);
            let (status, _) = run.nodes[i].expect_exit();
            assert!(
                status.success(),
                "{} exited with {status}",
                run.nodes[i].name
            );
            run.members_up(3).await;
            let seed = run.nodes[(i + 1) % 3].addr.clone();
            run.nodes[i] = CreditRun::host(name, Some(&seed), &run.flags);
            run.members_up(4).await;
            run.more_confirmed().await;
        }
        run.finish().await;
    });
}

/// Each journaled counter's total, from its journal, after checking it
/// ([`common::walk_counter_journals`]: no gap, no fork).
fn journaled_totals(server: &pg_server::Server, db: &str) -> BTreeMap<String, u64> {
    let mut totals = BTreeMap::new();
    common::walk_counter_journals(
        &server.psql(db, common::COUNTER_JOURNALS),
        |entity, _, event| {
            let total = totals.entry(entity.to_owned()).or_default();
            if let common::CounterRow::Added(by) = event {
                *total += by;
            }
        },
    );
    totals
}
