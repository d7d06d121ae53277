//! Three `datum-node` OS processes on 127.0.0.1: they form a cluster, a
//! SIGKILLed one is downed by the others, a SIGTERMed one leaves gracefully,
//! a frozen (SIGSTOP) one that was downed meanwhile stops once thawed, and
//! a SIGTERMed one hosting counter shards hands them off under traffic.
//!
//! Each child's stdout is read line by line on its own thread and forwarded,
//! stamped with the time it was read, over a channel; every wait is a
//! `recv_timeout` on that channel under a generous deadline, never a sleep.
//! Its stderr is gathered by another thread, whose end is waited for
//! before anything reads it.
//! A [`NodeProcess`] kills and reaps its child when dropped, so a failing
//! test leaves no process behind.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod common;
use common::{field, number};

const BIN: &str = env!("CARGO_BIN_EXE_datum-node");
/// Generous bound on any one wait: these processes share 2 cores with others.
const LONG: Duration = Duration::from_secs(30);
/// The client's ask timeout. An ask that times out counts as lost (only
/// ShuttingDown may be retried), so this is generous too: a busy machine
/// may answer seconds late during a handoff. Below `LONG`, so that a lost
/// ask fails the test as a timeout.
const ASK_TIMEOUT: Duration = Duration::from_secs(20);

/// One line of a child's stdout, or its end.
enum Output {
    Line { at: Instant, line: String },
    Eof,
}

/// A running `datum-node` child with its stdout as a channel of lines.
struct NodeProcess {
    name: &'static str,
    child: Child,
    lines: Receiver<Output>,
    stderr: Arc<Mutex<String>>,
    /// Disconnected once the stderr thread has read the pipe to its end.
    stderr_ended: Receiver<()>,
    addr: String,
    node_id: String,
    reaped: bool,
}

impl NodeProcess {
    /// Starts a node (joining through `seed` if given) and waits for its
    /// `started` line.
    fn start(name: &'static str, seed: Option<&str>) -> NodeProcess {
        Self::start_with(name, seed, &[])
    }

    /// [`start`](Self::start) with more flags.
    fn start_with(name: &'static str, seed: Option<&str>, extra: &[&str]) -> NodeProcess {
        let mut cmd = Command::new(BIN);
        cmd.args(["--cluster-name", "proc-test", "--bind", "127.0.0.1:0"])
            .args(extra)
            .env("DATUM_SECRET", "proc-secret") // one flag from the environment
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(seed) = seed {
            cmd.args(["--seeds", seed]);
        }
        let mut child = cmd.spawn().expect("spawn datum-node");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr_pipe = child.stderr.take().expect("piped stderr");
        let (tx, lines) = channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let at = Instant::now();
                if tx.send(Output::Line { at, line }).is_err() {
                    return;
                }
            }
            let _ = tx.send(Output::Eof);
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        let (ended, stderr_ended) = channel::<()>();
        thread::spawn(move || {
            let _ended = ended; // dropped when the pipe has been read out
            let mut buf = [0u8; 4096];
            let mut pipe = stderr_pipe;
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]);
                sink.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_str(&text);
            }
        });
        let mut node = NodeProcess {
            name,
            child,
            lines,
            stderr,
            stderr_ended,
            addr: String::new(),
            node_id: String::new(),
            reaped: false,
        };
        let (_, started) = node.expect_line(|l| field(l, "event") == Some("started"));
        node.addr = field(&started, "addr").expect("addr").to_owned();
        node.node_id = field(&started, "node_id").expect("node_id").to_owned();
        node
    }

    /// Reads lines until one satisfies `matches`; returns it with the time
    /// it was read. Panics (with the child's stderr) on timeout or EOF.
    fn expect_line(&mut self, mut matches: impl FnMut(&str) -> bool) -> (Instant, String) {
        let deadline = Instant::now() + LONG;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Output::Line { at, line }) => {
                    if matches(&line) {
                        return (at, line);
                    }
                }
                Ok(Output::Eof) | Err(RecvTimeoutError::Disconnected) => {
                    panic!("{}: stdout ended before the expected line", self.name)
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("{}: no expected line within {LONG:?}", self.name)
                }
            }
        }
    }

    /// Drops the lines printed so far (not the end of its output).
    fn skip_printed(&mut self) {
        while let Ok(Output::Line { .. }) = self.lines.try_recv() {}
    }

    /// Waits until this node has reported `n` distinct members Up.
    fn expect_members_up(&mut self, n: usize) {
        let mut up = HashSet::new();
        self.expect_line(|l| {
            if field(l, "event") == Some("member_up") {
                up.insert(field(l, "node_id").unwrap_or_default().to_owned());
            }
            up.len() == n
        });
    }

    /// Waits for this node's stdout to end, then reaps it and waits for its
    /// stderr to be read out; returns its exit status and the lines it
    /// printed meanwhile.
    fn expect_exit(&mut self) -> (ExitStatus, Vec<String>) {
        let deadline = Instant::now() + LONG;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Output::Line { line, .. }) => seen.push(line),
                Ok(Output::Eof) | Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    panic!("{}: did not exit within {LONG:?}", self.name)
                }
            }
        }
        let status = self.child.wait().expect("wait for child");
        self.reaped = true;
        // A node says why it stopped on stderr after its last stdout line,
        // and that pipe has a reader of its own that a loaded machine may
        // not have run yet: whoever reads `stderr` next must see it all.
        assert!(
            self.wait_for_stderr_end(),
            "{}: stderr still open {LONG:?} after it exited",
            self.name
        );
        (status, seen)
    }

    /// Waits (at most [`LONG`]) until the stderr thread has read the pipe
    /// to its end; whether it has.
    fn wait_for_stderr_end(&self) -> bool {
        matches!(
            self.stderr_ended.recv_timeout(LONG),
            Err(RecvTimeoutError::Disconnected)
        )
    }

    /// SIGKILL, then reap.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }

    /// Sends `signal` (SIGTERM: leave gracefully; SIGSTOP/SIGCONT: freeze, thaw).
    fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits pid_t");
        // SAFETY: sending a signal to our own, not yet reaped, child.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({signal}) failed");
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if thread::panicking() {
            // Reaped by now, so its last words are on their way.
            self.wait_for_stderr_end();
            let stderr = self.stderr.lock().unwrap_or_else(|p| p.into_inner());
            eprintln!("--- {} ({}) stderr ---\n{stderr}", self.name, self.addr);
        }
    }
}

fn is_event_about(line: &str, event: &str, node_id: &str) -> bool {
    field(line, "event") == Some(event) && field(line, "node_id") == Some(node_id)
}

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

/// A runtime for a test's client node.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The client: a fourth node in this process, seeded by `seed`, with a
/// proxy-only region of `P` (its fingerprint must match the nodes'), once
/// it sees four members Up.
async fn proxy_client<P: datum_cluster_sharding::Protocol>(
    seed: &str,
) -> (
    datum_cluster_sharding::cluster::ClusterNode,
    datum_cluster_sharding::ShardedSystem,
) {
    use datum_cluster_sharding::ShardedSystem;
    use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};

    let config = ClusterConfig::builder()
        .cluster_name("proc-test")
        .secret("proc-secret")
        .seed_nodes(vec![seed.parse().expect("addr")])
        .build();
    let client = ClusterNode::start(config).await.expect("client node");
    client
        .wait_until(|s| s.up_members().count() == 4, LONG)
        .await
        .expect("four Up");
    let system = ShardedSystem::builder()
        .num_shards(32)
        .node(client.clone())
        .start()
        .await
        .expect("system");
    system.register_proxy::<P>().await.expect("proxy");
    (client, system)
}

#[test]
fn a_sigtermed_counter_node_hands_its_shards_off_under_traffic() {
    use datum_cluster_sharding::ShardingError;

    let flags = ["--counter", "--shards", "32", "--stats-ms", "100"];
    let mut n1 = NodeProcess::start_with("n1", None, &flags);
    let seed = n1.addr.clone();
    let mut n2 = NodeProcess::start_with("n2", Some(&seed), &flags);
    let mut n3 = NodeProcess::start_with("n3", Some(&seed), &flags);
    runtime().block_on(async {
        let (client, system) = proxy_client::<counter::Counter>(&seed).await;
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
        let (client, system) = proxy_client::<journaled::JournaledCounter>(&seed).await;
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
