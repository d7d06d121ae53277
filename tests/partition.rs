//! Real network partitions: `datum-node` processes, each in its own network
//! namespace, joined through two bridges (side A, side B) in a switch
//! namespace, the bridges linked by one veth pair; this test makes (and
//! removes) every namespace itself, and addresses live only on those veth
//! interfaces. Setting the bridges' link down partitions the cluster
//! cleanly: each side still reaches itself. A third bridge, on its own
//! subnet, joins every node to the switch namespace itself, where a shared
//! PostgreSQL journal can run: a cut leaves it reachable from both sides. Under the default
//! keep-majority resolver the minority downs itself and exits with code 3,
//! the majority downs it and nobody else. Needs root (`ip netns`); skips
//! with a message otherwise.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod common;
use common::{field, number, numbers};
#[path = "../protocols/pg_server.rs"]
mod pg_server;

const BIN: &str = env!("CARGO_BIN_EXE_datum-node");
const LONG: Duration = Duration::from_secs(30);

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The namespaces of one run; removed (with their links) when dropped.
struct Net {
    prefix: String,
    nodes: usize,
}

impl Net {
    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    fn node_addr(i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// The switch namespace's address on the database bridge.
    const DB_ADDR: &str = "10.78.0.254";

    /// A switch namespace with two bridges joined by a veth pair, and one
    /// namespace per node with a veth to its side's bridge: nodes
    /// `0..side_a` on side A, the others on side B.
    fn make(nodes: usize, side_a: usize) -> Result<Net, String> {
        let net = Net {
            // Unique per test of this run (interface names stay ≤ 15 bytes).
            prefix: format!("d{}{nodes}{side_a}", std::process::id()),
            nodes,
        };
        let sw = net.ns("sw");
        ip(&["netns", "add", &sw])?;
        for br in ["br0", "br1"] {
            ip(&["-n", &sw, "link", "add", br, "type", "bridge"])?;
            ip(&["-n", &sw, "link", "set", br, "up"])?;
        }
        ip(&[
            "-n", &sw, "link", "add", "ab0", "type", "veth", "peer", "name", "ab1",
        ])?;
        for (end, br) in [("ab0", "br0"), ("ab1", "br1")] {
            ip(&["-n", &sw, "link", "set", end, "master", br])?;
            ip(&["-n", &sw, "link", "set", end, "up"])?;
        }
        ip(&["-n", &sw, "link", "add", "br2", "type", "bridge"])?;
        let db_cidr = format!("{}/24", Net::DB_ADDR);
        ip(&["-n", &sw, "addr", "add", &db_cidr, "dev", "br2"])?;
        ip(&["-n", &sw, "link", "set", "br2", "up"])?;
        for i in 0..nodes {
            let ns = net.ns(&format!("n{i}"));
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let side = if i < side_a { "br0" } else { "br1" };
            net.plug(i, ("eth0", &Net::node_addr(i)), (side, "s"))?;
            net.plug(i, ("eth1", &format!("10.78.0.{}", i + 1)), ("br2", "t"))?;
        }
        Ok(net)
    }

    /// A veth from node `i`'s namespace (`dev` with address `addr`/24) to
    /// `bridge` in the switch namespace (its end there named `tag` + `i`).
    fn plug(
        &self,
        i: usize,
        (dev, addr): (&str, &str),
        (bridge, tag): (&str, &str),
    ) -> Result<(), String> {
        let (ns, sw) = (self.ns(&format!("n{i}")), self.ns("sw"));
        let (here, there) = (format!("{}{tag}{i}", self.prefix), format!("{tag}{i}"));
        ip(&[
            "-n", &ns, "link", "add", dev, "type", "veth", "peer", "name", &here,
        ])?;
        ip(&["-n", &ns, "link", "set", &here, "netns", &sw])?;
        ip(&["-n", &sw, "link", "set", &here, "name", &there])?;
        ip(&["-n", &sw, "link", "set", &there, "master", bridge])?;
        ip(&["-n", &sw, "link", "set", &there, "up"])?;
        ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
        ip(&["-n", &ns, "link", "set", dev, "up"])
    }

    /// Cuts (or heals) the link between the two sides.
    fn sides_linked(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.ns("sw"), "link", "set", "ab0", state]).expect("link");
    }

    /// Makes the namespaces, or says why they cannot be made here.
    fn try_make(nodes: usize, side_a: usize) -> Option<Net> {
        let made = Net::make(nodes, side_a).and_then(|net| {
            // Running a process inside one is needed too (it remounts /sys).
            let probe = Command::new("ip")
                .args(["netns", "exec", &net.ns("n0"), "true"])
                .status()
                .map_err(|e| e.to_string())?;
            if probe.success() {
                Ok(net)
            } else {
                Err(format!("`ip netns exec` failed: {probe}"))
            }
        });
        match made {
            Ok(net) => Some(net),
            Err(error) => {
                eprintln!("SKIPPED: network namespaces are not available here ({error})");
                None
            }
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.ns(&format!("n{i}"))]);
        }
        let _ = ip(&["netns", "del", &self.ns("sw")]);
    }
}

/// A `datum-node` in node `i`'s namespace, with its stdout as lines.
struct Node {
    child: Child,
    /// Each line with when this test read it.
    lines: Receiver<Option<(Instant, String)>>,
    /// The last lines of its stderr.
    last_logged: Arc<Mutex<VecDeque<String>>>,
    node_id: String,
    reaped: bool,
}

impl Node {
    fn start(net: &Net, i: usize, extra: &[&str]) -> Node {
        let bind = format!("{}:7355", Net::node_addr(i));
        let seed = format!("{}:7355", Net::node_addr(0));
        let mut child = Command::new("ip")
            .args(["netns", "exec", &net.ns(&format!("n{i}")), BIN])
            .args([
                "--cluster-name",
                "partition",
                "--secret",
                "partition-secret",
            ])
            .args(["--bind", &bind, "--seeds", &seed])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn datum-node");
        let stdout = child.stdout.take().expect("stdout");
        // The last lines it logged, for the panic if it exits unexpectedly.
        let stderr = child.stderr.take().expect("stderr");
        let last_logged = Arc::new(Mutex::new(VecDeque::new()));
        let logged = last_logged.clone();
        thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut last = logged.lock().unwrap_or_else(|e| e.into_inner());
                if last.len() == 20 {
                    last.pop_front();
                }
                last.push_back(line);
            }
        });
        let (tx, lines) = channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(Some((Instant::now(), line))).is_err() {
                    return;
                }
            }
            let _ = tx.send(None);
        });
        let mut node = Node {
            child,
            lines,
            last_logged,
            node_id: String::new(),
            reaped: false,
        };
        let started = node.expect(|l| field(l, "event") == Some("started"));
        node.node_id = field(&started, "node_id").expect("node id").to_owned();
        node
    }

    /// The next line that satisfies `pred`; every line seen meanwhile goes
    /// through `seen` first.
    fn expect(&mut self, pred: impl FnMut(&str) -> bool) -> String {
        self.expect_at(pred).1
    }

    /// [`expect`](Self::expect), with when the line was read.
    fn expect_at(&mut self, mut pred: impl FnMut(&str) -> bool) -> (Instant, String) {
        let deadline = Instant::now() + LONG;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Some((at, line))) if pred(&line) => return (at, line),
                Ok(Some(_)) => {}
                Ok(None) | Err(RecvTimeoutError::Disconnected) => {
                    let logged = self.last_logged.lock().unwrap_or_else(|e| e.into_inner());
                    let logged: Vec<&str> = logged.iter().map(String::as_str).collect();
                    panic!("stdout ended; its last log lines:\n{}", logged.join("\n"))
                }
                Err(RecvTimeoutError::Timeout) => panic!("no expected line within {LONG:?}"),
            }
        }
    }

    /// The newest `event` line: every line queued now is read, and if none
    /// of them is one, the next one that is.
    fn newest(&mut self, event: &str) -> String {
        let mut newest = None;
        while let Ok(Some((_, line))) = self.lines.try_recv() {
            if field(&line, "event") == Some(event) {
                newest = Some(line);
            }
        }
        newest.unwrap_or_else(|| self.expect(|l| field(l, "event") == Some(event)))
    }

    /// Lines printed within `d`, without waiting for any in particular.
    fn drain(&mut self, d: Duration) -> Vec<String> {
        let deadline = Instant::now() + d;
        let mut out = Vec::new();
        while let Ok(Some((_, line))) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            out.push(line);
        }
        out
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + LONG;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                self.reaped = true;
                return status;
            }
            assert!(Instant::now() < deadline, "did not exit");
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One partition test at a time: they time failure detection, which two
/// clusters of processes side by side on two cores would slow.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// SIGTERMs the nodes (a graceful leave) and checks that each exits 0.
fn leave_gracefully(nodes: &mut [Node]) {
    for n in nodes.iter_mut() {
        let pid = n.child.id() as libc::pid_t;
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    for n in nodes {
        let status = n.wait();
        assert!(status.success(), "{status}");
    }
}

/// Waits until every node has seen every node Up.
/// Starts a node in each of `net`'s namespaces with `flags` (which make it
/// drive traffic), waits until all are Up everywhere and every driver has
/// `acked` asks answered.
fn start_driving(net: &Net, flags: &[&str], acked: u64) -> Vec<Node> {
    let mut nodes: Vec<Node> = (0..net.nodes).map(|i| Node::start(net, i, flags)).collect();
    all_up(&mut nodes);
    for n in &mut nodes {
        n.expect(|l| field(l, "event") == Some("drive") && number(l, "acked") >= Some(acked));
    }
    nodes
}

/// Side B's nodes joined last and get their share by rebalance: waits
/// until the per-node counts are within one (least-shards then moves
/// nothing more) with no handoff under way, in two snapshots in a row of
/// every node's newest line, so that nothing moves at a cut. Gives each
/// node's shard ids.
fn wait_balanced(nodes: &mut [Node]) -> Vec<Vec<u32>> {
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); nodes.len()];
    let mut previous = Vec::new();
    let deadline = Instant::now() + LONG;
    loop {
        let mut idle = true;
        for (i, n) in nodes.iter_mut().enumerate() {
            let line = n.newest("region_state");
            ids[i] = numbers(&line, "shard_ids");
            idle &= number(&line, "handing_off") == Some(0);
        }
        let counts: Vec<usize> = ids.iter().map(Vec::len).collect();
        let (min, max) = (counts.iter().min(), counts.iter().max());
        let balanced = min > Some(&0) && max.zip(min).is_some_and(|(a, b)| a - b <= 1);
        if balanced && idle && ids == previous {
            return ids;
        }
        previous = ids.clone();
        assert!(Instant::now() < deadline, "never balanced: {counts:?}");
        thread::sleep(Duration::from_millis(100));
    }
}

fn all_up(nodes: &mut [Node]) {
    let n = nodes.len();
    for node in nodes {
        let mut up = std::collections::BTreeSet::new();
        node.expect(|l| {
            if field(l, "event") == Some("member_up") {
                up.insert(field(l, "node_id").unwrap_or_default().to_owned());
            }
            up.len() == n
        });
    }
}

#[test]
fn a_node_cut_off_by_a_real_partition_downs_itself_and_the_majority_goes_on() {
    let _serial = one_at_a_time();
    let Some(net) = Net::try_make(3, 2) else {
        return;
    };
    // The default resolver: keep-majority.
    let mut nodes: Vec<Node> = (0..3).map(|i| Node::start(&net, i, &[])).collect();
    all_up(&mut nodes);
    let victim = nodes[2].node_id.clone();
    let cut = Instant::now();
    net.sides_linked(false);
    // The cut-off node is the minority: it downs itself and exits 3.
    let stopped = nodes[2].expect(|l| field(l, "event") == Some("stopped"));
    assert_eq!(field(&stopped, "reason"), Some("downed"), "{stopped}");
    let status = nodes[2].wait();
    assert_eq!(status.code(), Some(3), "{status}");
    let exited = cut.elapsed();
    // The majority downs it, and nobody else.
    for n in &mut nodes[..2] {
        let line = n.expect(|l| {
            let downed = field(l, "event") == Some("member_downed");
            assert!(
                !downed || field(l, "node_id") == Some(victim.as_str()),
                "a healthy member was downed: {l}"
            );
            downed
        });
        assert_eq!(field(&line, "node_id"), Some(victim.as_str()));
    }
    net.sides_linked(true);
    for n in &mut nodes[..2] {
        for l in n.drain(Duration::from_secs(2)) {
            assert_ne!(
                field(&l, "event"),
                Some("member_downed"),
                "after the heal: {l}"
            );
            assert_ne!(
                field(&l, "event"),
                Some("stopped"),
                "a majority node stopped: {l}"
            );
        }
    }
    eprintln!(
        "cut at 0 ms; the minority node exited {} ms later",
        exited.as_millis()
    );
    leave_gracefully(&mut nodes[..2]);
}

/// Five nodes hosting the counter and driving asks at it (`--drive`), split
/// 3/2 by a real partition: the two on side B down themselves; their shards
/// are hosted on side A only after side B stopped hosting them (the
/// dead-owner margin); side A's drivers, retrying, lose no ask; after the
/// heal nothing more is downed.
#[test]
fn a_three_two_split_under_sharding_traffic_keeps_one_owner_per_shard() {
    let _serial = one_at_a_time();
    const SHARDS: u32 = 32;
    let Some(net) = Net::try_make(5, 3) else {
        return;
    };
    let shards = SHARDS.to_string();
    let flags = [
        "--counter",
        "--shards",
        &shards,
        "--stats-ms",
        "50",
        "--drive",
        "128",
    ];
    // Every node's driver has reached every counter once (retrying while
    // the coordinator placed the shards), and every shard has a home.
    let mut nodes = start_driving(&net, &flags, 256);
    let ids = wait_balanced(&mut nodes);
    let hosted: std::collections::BTreeSet<u32> = ids.iter().flatten().copied().collect();
    let minority_shards: Vec<(usize, Vec<u32>)> = (3..5).map(|i| (i, ids[i].clone())).collect();
    // (128 counters need not touch all 32 shards: the ones hosted count.)
    assert!(
        hosted.len() > SHARDS as usize / 2,
        "hosted before the cut: {hosted:?}"
    );
    let minority_ids: Vec<String> = nodes[3..].iter().map(|n| n.node_id.clone()).collect();
    let cut = Instant::now();
    net.sides_linked(false);
    // Side B: each node hosts its shards until it downs itself, then exits 3.
    let mut stopped_at = Vec::new();
    for n in &mut nodes[3..] {
        let (at, stopped) = n.expect_at(|l| field(l, "event") == Some("stopped"));
        assert_eq!(field(&stopped, "reason"), Some("downed"), "{stopped}");
        assert_eq!(n.wait().code(), Some(3));
        stopped_at.push(at);
    }
    let minority_stopped = stopped_at.iter().max().copied().expect("two nodes");
    // Side A: the minority's shards come back here, and only after side B
    // printed that it stopped (it fences first: SPEC §13.15).
    let mut first_hosted: std::collections::BTreeMap<u32, Instant> = Default::default();
    let wanted: std::collections::BTreeSet<u32> = minority_shards
        .iter()
        .flat_map(|(_, ids)| ids.iter().copied())
        .collect();
    assert!(
        !wanted.is_empty(),
        "side B hosted nothing: {minority_shards:?}"
    );
    let deadline = Instant::now() + LONG;
    while first_hosted.len() < wanted.len() {
        assert!(
            Instant::now() < deadline,
            "not rehomed: {first_hosted:?} of {wanted:?}"
        );
        for n in &mut nodes[..3] {
            while let Ok(Some((at, line))) = n.lines.recv_timeout(Duration::from_millis(10)) {
                if at < cut {
                    continue; // printed before the cut
                }
                let event = field(&line, "event");
                assert_ne!(event, Some("stopped"), "a majority node stopped: {line}");
                if event == Some("member_downed") {
                    let downed = field(&line, "node_id").unwrap_or_default();
                    assert!(
                        minority_ids.iter().any(|m| m == downed),
                        "a healthy member was downed: {line}"
                    );
                }
                if event == Some("region_state") {
                    for s in numbers(&line, "shard_ids") {
                        if wanted.contains(&s) {
                            first_hosted.entry(s).or_insert(at);
                        }
                    }
                }
            }
        }
    }
    let earliest = first_hosted.values().min().copied().expect("some");
    let latest = first_hosted.values().max().copied().expect("some");
    assert!(
        earliest > minority_stopped,
        "a shard was hosted on side A {:?} before side B stopped",
        minority_stopped.duration_since(earliest)
    );
    // Side A's drivers go on answering; with retries nothing is missing.
    for n in &mut nodes[..3] {
        let line = n.expect(|l| field(l, "event") == Some("drive"));
        let acked = number(&line, "acked").expect("acked");
        n.expect(|l| field(l, "event") == Some("drive") && number(l, "acked") >= Some(acked + 256));
    }
    net.sides_linked(true);
    for n in &mut nodes[..3] {
        for l in n.drain(Duration::from_secs(2)) {
            let event = field(&l, "event");
            assert_ne!(event, Some("member_downed"), "after the heal: {l}");
            assert_ne!(event, Some("stopped"), "a majority node stopped: {l}");
        }
    }
    let mut finals = Vec::new();
    for n in &mut nodes[..3] {
        let line = n.expect(|l| field(l, "event") == Some("drive"));
        assert_eq!(number(&line, "missing"), Some(0), "{line}");
        finals.push(line);
    }
    eprintln!(
        "cut at 0; side B stopped by {} ms; its {} shards hosted on side A from {} to {} ms; drive: {finals:?}",
        minority_stopped.duration_since(cut).as_millis(),
        wanted.len(),
        earliest.duration_since(cut).as_millis(),
        latest.duration_since(cut).as_millis(),
    );
    leave_gracefully(&mut nodes[..3]);
}

/// A 3/2 split with the coordinator (node 0, the oldest) on the minority,
/// and every driver asking counters never asked before, so that new shards
/// keep being placed on both sides: side A's coordinator places shards on
/// side A until it downs itself; side B has no coordinator until it has
/// downed side A, then takes over (a new epoch) and places nothing within
/// the margin. No shard is hosted on both sides at once: every shard that
/// side A listed after the cut is listed on side B only later than side A
/// last listed it.
#[test]
fn a_split_with_the_coordinator_on_the_minority_places_no_shard_twice() {
    let _serial = one_at_a_time();
    use std::collections::{BTreeMap, BTreeSet};
    let Some(net) = Net::try_make(5, 2) else {
        return;
    };
    let flags = [
        "--counter",
        "--shards",
        "16384",
        "--stats-ms",
        "100",
        "--drive",
        "32",
        "--drive-fresh",
    ];
    let mut nodes = start_driving(&net, &flags, 200);
    // What each side hosts at the cut.
    let before: Vec<BTreeSet<u32>> = nodes
        .iter_mut()
        .map(|n| {
            numbers(&n.newest("region_state"), "shard_ids")
                .into_iter()
                .collect()
        })
        .collect();
    let side_b_before: BTreeSet<u32> = before[2..].iter().flatten().copied().collect();
    let side_a_ids: Vec<String> = nodes[..2].iter().map(|n| n.node_id.clone()).collect();
    let cut = Instant::now();
    net.sides_linked(false);
    // Read every node's lines until side A has stopped and side B has
    // hosted new shards for a while.
    let mut last_on_a: BTreeMap<u32, Instant> = BTreeMap::new();
    let mut first_on_b: BTreeMap<u32, Instant> = BTreeMap::new();
    let mut a_stopped: Vec<Option<Instant>> = vec![None, None];
    let deadline = Instant::now() + LONG;
    let mut enough = None;
    while enough.is_none_or(|t| Instant::now() < t) {
        assert!(Instant::now() < deadline, "side B never placed new shards");
        for (i, n) in nodes.iter_mut().enumerate() {
            while let Ok(Some((at, line))) = n.lines.recv_timeout(Duration::from_millis(5)) {
                let event = field(&line, "event");
                if i < 2 && event == Some("stopped") {
                    assert_eq!(field(&line, "reason"), Some("downed"), "{line}");
                    a_stopped[i] = Some(at);
                }
                if i >= 2 {
                    assert_ne!(event, Some("stopped"), "a majority node stopped: {line}");
                    if event == Some("member_downed") {
                        let downed = field(&line, "node_id").unwrap_or_default();
                        assert!(
                            side_a_ids.iter().any(|m| m == downed),
                            "a healthy member was downed: {line}"
                        );
                    }
                }
                if at < cut || event != Some("region_state") {
                    continue;
                }
                for shard in numbers(&line, "shard_ids") {
                    if i < 2 {
                        assert!(
                            !side_b_before.contains(&shard),
                            "side A hosts shard {shard}, which side B held at the cut"
                        );
                        last_on_a.insert(shard, at);
                    } else if !side_b_before.contains(&shard) {
                        first_on_b.entry(shard).or_insert(at);
                    }
                }
            }
        }
        // Enough once side A has stopped and side B has listed a new shard
        // since (at the latest, side A's own shards once the dead-owner
        // margin after its Down is over: a fixed wait after the stop could
        // end before that margin while every driver on side B waits on one
        // of them).
        let b_placed_since_a_stopped = a_stopped.iter().all(Option::is_some)
            && a_stopped
                .iter()
                .flatten()
                .max()
                .is_some_and(|stopped| first_on_b.values().any(|at| at > stopped));
        if enough.is_none() && b_placed_since_a_stopped && first_on_b.len() > 100 {
            enough = Some(Instant::now() + Duration::from_secs(1));
        }
    }
    for n in &mut nodes[..2] {
        assert_eq!(n.wait().code(), Some(3));
    }
    let a_stopped = a_stopped.iter().flatten().max().copied().expect("stopped");
    // Side A's coordinator went on placing fresh shards on side A after the
    // cut, and some of them were placed again by side B's.
    let placed_on_a: BTreeSet<u32> = last_on_a
        .keys()
        .filter(|s| !before[0].contains(s) && !before[1].contains(s))
        .copied()
        .collect();
    assert!(
        !placed_on_a.is_empty(),
        "side A placed nothing after the cut"
    );
    let both: Vec<u32> = last_on_a
        .keys()
        .filter(|s| first_on_b.contains_key(s))
        .copied()
        .collect();
    for shard in &both {
        assert!(
            first_on_b[shard] > last_on_a[shard],
            "shard {shard} listed on side B {:?} before side A last listed it",
            last_on_a[shard].duration_since(first_on_b[shard])
        );
    }
    // Side B took over once side A was downed and, after the margin,
    // placed new shards of its own. (Its lines list a few new shards
    // earlier too: placed before the cut and reported up to one
    // `--stats-ms` late, or placed by side A's coordinator just before
    // the cut cut it off; none of those is ever hosted on side A after the
    // cut, as the loop above checked for every shard.)
    let after_a: Vec<Instant> = first_on_b
        .values()
        .filter(|at| **at > a_stopped)
        .copied()
        .collect();
    let first_b = after_a
        .iter()
        .min()
        .copied()
        .expect("side B placed shards after side A stopped");
    eprintln!(
        "cut at 0; side A (with the coordinator) placed {} new shards and stopped by {} ms; \
         side B placed {} new shards after that, the first at {} ms; {} shards were hosted on \
         both sides, one after the other",
        placed_on_a.len(),
        a_stopped.duration_since(cut).as_millis(),
        after_a.len(),
        first_b.duration_since(cut).as_millis(),
        both.len(),
    );
    // Side B's drivers, retrying, missed nothing.
    for n in &mut nodes[2..] {
        let line = n.newest("drive");
        assert_eq!(number(&line, "missing"), Some(0), "{line}");
    }
    leave_gracefully(&mut nodes[2..]);
}

/// Five nodes in [`Net`]'s namespaces, 3/2, journaling to one PostgreSQL
/// in the switch namespace (reachable from both sides throughout), every
/// driver loop asking `Add(1)` of a counter shared by all five nodes, each
/// side hosting some of them; `extra` flags go to every node.
fn journaling(extra: &[&str]) -> Option<(Net, pg_server::Server, String, Vec<Node>)> {
    let net = Net::try_make(5, 3)?;
    let server =
        pg_server::Server::start_in(pg_server::Durability::NoFsync, &net.ns("sw"), Net::DB_ADDR)?;
    let db = server.database();
    let mut flags = vec![
        "--counter",
        "--shards",
        "32",
        "--stats-ms",
        "50",
        "--drive",
        "64",
    ];
    flags.extend(["--journal-url", &db]);
    flags.extend(extra);
    let mut nodes = start_driving(&net, &flags, 256);
    let ids = wait_balanced(&mut nodes);
    assert!(
        ids[3..].iter().all(|s| !s.is_empty()),
        "side B hosts nothing: {ids:?}"
    );
    Some((net, server, db, nodes))
}

/// Each counter's journal as its writers in sequence-number order — one
/// entry per run of events by one writer (`node/incarnation/generation`) —
/// after checking it holds exactly `1..=n` and that each event was added
/// onto the sum of those before it (its writer had applied them all: no
/// fork); and how many events they hold.
fn journal_writers(server: &pg_server::Server, db: &str) -> (BTreeMap<String, Vec<String>>, u64) {
    let mut runs = BTreeMap::<String, Vec<String>>::new();
    let mut events = 0;
    common::walk_counter_journals(
        &server.psql(db, common::COUNTER_JOURNALS),
        |entity, writer, _| {
            events += 1;
            let writers = runs.entry(entity.to_owned()).or_default();
            if writers.last() != Some(&writer) {
                writers.push(writer);
            }
        },
    );
    assert_eq!(runs.len(), 64, "one journal per driven counter");
    (runs, events)
}

/// Each journaled counter's highest sequence number now.
fn highest_per_counter(server: &pg_server::Server, db: &str) -> BTreeMap<String, u64> {
    let rows = server.psql(
        db,
        "SELECT entity_id, max(sequence_nr) FROM datum_events \
         WHERE type_name = 'journaled-counter' GROUP BY entity_id",
    );
    rows.lines()
        .map(|row| {
            let (entity, seq) = row.split_once('|').expect("two columns");
            (entity.to_owned(), seq.parse().expect("a sequence number"))
        })
        .collect()
}

/// Per counter, the node ids (16 hex digits) that appended to its journal
/// after `cut` (its highest sequence number then; a counter not in `cut`
/// had none).
fn writers_after(
    server: &pg_server::Server,
    db: &str,
    cut: &BTreeMap<String, u64>,
) -> BTreeMap<String, BTreeSet<String>> {
    let rows = server.psql(
        db,
        "SELECT entity_id, sequence_nr, writer_node FROM datum_events \
         WHERE type_name = 'journaled-counter'",
    );
    let mut after = BTreeMap::<String, BTreeSet<String>>::new();
    for row in rows.lines() {
        let cols: Vec<&str> = row.split('|').collect();
        let [entity, seq, node] = cols[..] else {
            panic!("a row of three columns: {row}");
        };
        let writers = after.entry(entity.to_owned()).or_default();
        if seq.parse::<u64>().expect("a sequence number") > cut.get(entity).copied().unwrap_or(0) {
            let node = node.parse::<i64>().expect("a node id") as u64;
            writers.insert(format!("{node:016x}"));
        }
    }
    after
}

/// The node ids of `nodes`.
fn node_ids(nodes: &[Node]) -> Vec<String> {
    nodes.iter().map(|n| n.node_id.clone()).collect()
}

/// Whether `writer` (as [`journal_writers`] names them) is one of `ids`.
fn written_by(writer: &str, ids: &[String]) -> bool {
    ids.iter().any(|id| writer.starts_with(id.as_str()))
}

/// A 3/2 split over a shared journal (see [`journaling`]): side B writes
/// until it downs itself, side A takes its shards over and writes on.
/// After the heal every counter's journal is `1..=n` without a gap, and it
/// was written by one writer at a time: once another writer (node,
/// incarnation, shard generation) has appended to a counter, no earlier one
/// appends to it again. Every answered ask is in the journal.
#[test]
fn a_split_over_a_shared_postgres_journal_never_forks_it() {
    let _serial = one_at_a_time();
    let Some((net, server, db, mut nodes)) = journaling(&[]) else {
        return;
    };
    let side_b = node_ids(&nodes[3..]);
    net.sides_linked(false);
    let mut acked = 0;
    for n in &mut nodes[3..] {
        let mut last_drive = 0;
        let stopped = n.expect(|l| {
            if field(l, "event") == Some("drive") {
                last_drive = number(l, "acked").unwrap_or(0);
            }
            field(l, "event") == Some("stopped")
        });
        assert_eq!(field(&stopped, "reason"), Some("downed"), "{stopped}");
        assert_eq!(n.wait().code(), Some(3));
        acked += last_drive;
    }
    // Side A takes side B's shards over and its drivers go on answering.
    for n in &mut nodes[..3] {
        let line = n.expect(|l| field(l, "event") == Some("drive"));
        let before = number(&line, "acked").expect("acked");
        n.expect(|l| {
            field(l, "event") == Some("drive") && number(l, "acked") >= Some(before + 512)
        });
    }
    net.sides_linked(true);
    for n in &mut nodes[..3] {
        n.drain(Duration::from_secs(1));
        let line = n.newest("drive");
        assert_eq!(number(&line, "missing"), Some(0), "{line}");
        acked += number(&line, "acked").expect("acked");
    }
    leave_gracefully(&mut nodes[..3]);

    let (journals, events) = journal_writers(&server, &db);
    let mut taken_over = 0;
    for (entity, writers) in &journals {
        for (i, w) in writers.iter().enumerate() {
            assert!(
                !writers[..i].contains(w),
                "{entity}: {w} wrote again after another: {writers:?}"
            );
        }
        let from_b = |w: &String| written_by(w, &side_b);
        if writers.windows(2).any(|w| from_b(&w[0]) && !from_b(&w[1])) {
            taken_over += 1;
        }
    }
    assert!(
        taken_over > 0,
        "no counter was written on side B, then on side A"
    );
    assert!(
        events >= acked,
        "{acked} asks answered, {events} events journaled"
    );
    eprintln!(
        "{events} events in 64 journals, {acked} asks answered; {taken_over} counters moved from side B to side A"
    );
}

/// The numbers listed under `key` in a JSON line.
fn tags(line: &str, key: &str) -> Vec<u64> {
    let value: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
    let listed = value[key].as_array().cloned().unwrap_or_default();
    listed
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .collect()
}

/// The 3/2 split of [`journaling`] with asks that a cut leaves in flight:
/// each `Add` handler waits 40 ms before it journals (`--handle-ms`), each
/// attempt waits up to 10 s for its answer (`--drive-timeout-ms`, past the
/// resolver's decision), and each attempt adds a number of its own
/// (`--drive-tags`). At the cut side B's asks to side A's counters are
/// being handled there; side A journals them and their answers are lost;
/// side B downs itself, and its fence fails the asks still waiting. No
/// attempt whose error said it was not processed is in any journal —
/// `ShuttingDown` said so of such asks before — and some of side B's
/// attempts did fail saying they may have been.
#[test]
fn asks_in_flight_when_their_side_is_cut_off_fail_as_maybe_processed() {
    let _serial = one_at_a_time();
    let flags = [
        "--handle-ms",
        "40",
        "--drive-timeout-ms",
        "10000",
        "--drive-tags",
    ];
    let Some((net, server, db, mut nodes)) = journaling(&flags) else {
        return;
    };
    // Each node numbers its attempts from its node id's low 20 bits: two
    // nodes alike there (about 1 run in 100,000) would share numbers.
    let bases: BTreeSet<u64> = nodes
        .iter()
        .map(|n| u64::from_str_radix(&n.node_id, 16).expect("a hex node id") & 0xf_ffff)
        .collect();
    if bases.len() < nodes.len() {
        eprintln!("two nodes would number their attempts alike; skipped");
        leave_gracefully(&mut nodes);
        return;
    }
    let maybe_before: u64 = nodes[3..]
        .iter_mut()
        .filter_map(|n| number(&n.newest("drive"), "maybe"))
        .sum();
    net.sides_linked(false);
    let mut lines = Vec::new();
    for n in &mut nodes[3..] {
        let mut last_drive = String::new();
        let stopped = n.expect(|l| {
            if field(l, "event") == Some("drive") {
                last_drive = l.to_owned();
            }
            field(l, "event") == Some("stopped")
        });
        assert_eq!(field(&stopped, "reason"), Some("downed"), "{stopped}");
        assert_eq!(n.wait().code(), Some(3));
        lines.push(last_drive);
    }
    // Side B downs nobody: what failed there as maybe since the cut
    // failed when it fenced itself.
    let maybe_after: u64 = lines.iter().filter_map(|l| number(l, "maybe")).sum();
    let side_b_maybe = maybe_after - maybe_before;
    for n in &mut nodes[..3] {
        let line = n.expect(|l| field(l, "event") == Some("drive"));
        let before = number(&line, "acked").expect("acked");
        n.expect(|l| {
            field(l, "event") == Some("drive") && number(l, "acked") >= Some(before + 256)
        });
    }
    net.sides_linked(true);
    for n in &mut nodes[..3] {
        n.drain(Duration::from_secs(1));
        lines.push(n.newest("drive"));
    }
    leave_gracefully(&mut nodes[..3]);

    let refused: BTreeSet<u64> = lines.iter().flat_map(|l| tags(l, "refused")).collect();
    let mut journaled = 0;
    common::walk_counter_journals(
        &server.psql(&db, common::COUNTER_JOURNALS),
        |entity, _, row| {
            if let common::CounterRow::Added(tag) = row {
                journaled += 1;
                assert!(
                    !refused.contains(&tag),
                    "{entity}: attempt {tag:#x} was applied, but its asker was told it was not processed"
                );
            }
        },
    );
    let acked: u64 = lines.iter().filter_map(|l| number(l, "acked")).sum();
    assert!(
        journaled >= acked,
        "{acked} answered, {journaled} journaled"
    );
    assert!(
        side_b_maybe > 0,
        "no attempt of side B failed as maybe processed at its fence: {lines:?}"
    );
    eprintln!(
        "{journaled} additions journaled, {acked} answered; side B's fence failed {side_b_maybe} attempts as maybe processed; {} attempts refused unprocessed, none journaled",
        refused.len()
    );
}

/// The 3/2 split of [`a_split_over_a_shared_postgres_journal_never_forks_it`]
/// with every driver sending `Credit(1)` through a reliable producer of its
/// node's (`--drive-reliable`). Side B's nodes are asked to leave (SIGTERM)
/// right after the cut: each waits for its credits, which side A's
/// counters cannot confirm, until it is downed, and then stops at once
/// (exit 3), as a node not leaving would. Side B downs itself, its producers with it;
/// side A takes its counters over, and its producers resend what the cut
/// left unconfirmed. In the journal, each credit is an `Added` followed by
/// its delivery record, and each producer's records for a counter number
/// 1, 2, 3, … once each: no credit handled twice, none skipped. Each of
/// side A's producers, flushed before its node leaves, has exactly as many
/// credits journaled as it had confirmed.
#[test]
fn a_split_under_reliable_credits_journals_each_credit_once() {
    let _serial = one_at_a_time();
    let Some((net, server, db, mut nodes)) = journaling(&["--drive-reliable"]) else {
        return;
    };
    net.sides_linked(false);
    for n in &nodes[3..] {
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(n.child.id() as libc::pid_t, libc::SIGTERM) };
    }
    for n in &mut nodes[3..] {
        let stopped = n.expect(|l| field(l, "event") == Some("stopped"));
        assert_eq!(field(&stopped, "reason"), Some("downed"), "{stopped}");
        assert_eq!(n.wait().code(), Some(3));
    }
    for n in &mut nodes[..3] {
        let line = n.newest("drive");
        let before = number(&line, "acked").expect("acked");
        n.expect(|l| {
            field(l, "event") == Some("drive") && number(l, "acked") >= Some(before + 512)
        });
    }
    net.sides_linked(true);
    // Each of side A's nodes stops sending, waits for its confirmations,
    // says so in a last `drive` line, then leaves.
    let mut confirmed = BTreeMap::new();
    for n in &mut nodes[..3] {
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(n.child.id() as libc::pid_t, libc::SIGTERM) };
        let mut last = String::new();
        n.expect(|l| {
            if field(l, "event") == Some("drive") {
                last = l.to_owned();
            }
            field(l, "event") == Some("handoff_started")
        });
        assert_eq!(number(&last, "unconfirmed"), Some(0), "{last}");
        assert_eq!(number(&last, "missing"), Some(0), "{last}");
        let producer = format!("drive-{}", n.node_id);
        confirmed.insert(producer, number(&last, "acked").expect("acked"));
        assert!(n.wait().success());
    }
    let journaled = credits_per_producer(&server, &db);
    for (producer, n) in &confirmed {
        assert_eq!(
            journaled.get(producer),
            Some(n),
            "{producer}: {journaled:?}"
        );
    }
    assert_eq!(journaled.len(), 5, "five producers: {journaled:?}");
    eprintln!("credits journaled per producer: {journaled:?}; side A confirmed {confirmed:?}");
}

/// The credits journaled per producer, after checking every journaled
/// counter's journal ([`common::walk_counter_journals`]: no gap, no fork),
/// each `Added` followed by its delivery record (written with it), and
/// each producer's records for the counter numbered 1, 2, 3, … (one epoch
/// per producer here).
fn credits_per_producer(server: &pg_server::Server, db: &str) -> BTreeMap<String, u64> {
    // Per counter: whether an `Added` awaits its record.
    let mut pending = BTreeMap::<String, bool>::new();
    // Per (counter, producer): the last record's number.
    let mut last = BTreeMap::<(String, String), u64>::new();
    common::walk_counter_journals(
        &server.psql(db, common::COUNTER_JOURNALS),
        |entity, _, event| {
            let pending = pending.entry(entity.to_owned()).or_default();
            match event {
                common::CounterRow::Added(_) => {
                    assert!(!*pending, "{entity}: an Added without its record");
                    *pending = true;
                }
                common::CounterRow::Delivery(producer, seq) => {
                    assert!(*pending, "{entity}: record {seq} without its Added");
                    *pending = false;
                    let previous = last.entry((entity.to_owned(), producer)).or_default();
                    assert_eq!(seq, *previous + 1, "{entity}: handled twice or skipped");
                    *previous = seq;
                }
            }
        },
    );
    let mut per_producer = BTreeMap::<String, u64>::new();
    for ((_, producer), n) in last {
        *per_producer.entry(producer).or_default() += n;
    }
    per_producer
}

/// The same split with no resolver (`--split-brain off`: each side downs
/// the other and goes on): both sides host every counter and write the
/// journal at once, the worst a cluster can do to it. The store refuses
/// every stale append, so the journals still hold `1..=n` without a gap or
/// a fork, though both sides appended to the same counters after the cut
/// (each counter's highest sequence number once every node has downed the
/// other side). (Side A, with more
/// drivers per counter, mostly wins: a refused incarnation must recover
/// before it appends again, and the other side writes meanwhile. SPEC §8
/// says so.)
#[test]
fn a_split_brain_writing_one_journal_from_both_sides_never_forks_it() {
    let _serial = one_at_a_time();
    let Some((net, server, db, mut nodes)) = journaling(&["--split-brain", "off"]) else {
        return;
    };
    let drive = |n: &mut Node, key| number(&n.newest("drive"), key).expect(key);
    let retries_before: Vec<u64> = nodes[3..].iter_mut().map(|n| drive(n, "retries")).collect();
    net.sides_linked(false);
    for n in &mut nodes {
        n.expect(|l| field(l, "event") == Some("member_downed"));
    }
    // Each side now holds every counter: what was journaled up to here is
    // the shared past; what comes after, each side writes on its own.
    let cut = highest_per_counter(&server, &db);
    // Side A's drivers answer on; side B's, starved by the refusals (SPEC
    // §8), may not (what B did append after the cut is checked below).
    for n in &mut nodes[..3] {
        let before = drive(n, "acked");
        n.expect(|l| {
            field(l, "event") == Some("drive") && number(l, "acked") >= Some(before + 512)
        });
    }
    let retries: Vec<u64> = nodes[3..].iter_mut().map(|n| drive(n, "retries")).collect();
    let retried = retries
        .iter()
        .zip(&retries_before)
        .map(|(a, b)| a - b)
        .sum::<u64>();
    let side_b = node_ids(&nodes[3..]);
    drop(nodes); // killed: the two clusters cannot merge again anyway
    net.sides_linked(true);

    let (journals, events) = journal_writers(&server, &db);
    // Counters that both sides appended to after the cut: the two sides
    // raced for the same journal, and it is still one history.
    let mut raced = 0;
    for (entity, nodes) in writers_after(&server, &db, &cut) {
        let on_b = nodes.iter().filter(|n| side_b.contains(n)).count();
        if on_b > 0 && on_b < nodes.len() {
            raced += 1;
        } else if nodes.is_empty() {
            eprintln!("{entity}: not written after the cut");
        }
    }
    assert!(
        raced > 0,
        "no counter was appended to by both sides after the cut"
    );
    let (mut both, mut alternating) = (0, 0);
    for writers in journals.values() {
        let side_b = |w: &String| written_by(w, &side_b);
        both += usize::from(writers.iter().any(side_b) && !writers.iter().all(side_b));
        alternating += usize::from(
            writers
                .iter()
                .enumerate()
                .any(|(i, w)| writers[..i].contains(w)),
        );
    }
    eprintln!(
        "{events} events in 64 journals, none forked; {raced} counters appended to by both sides after the cut, {both} written by both sides, {alternating} by one writer again after another; side B retried {retried} asks after the split (refused appends, and asks timed out across the cut)"
    );
}
