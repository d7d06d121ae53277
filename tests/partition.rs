//! A real network partition: three `datum-node` processes, each in its own
//! network namespace, joined through a bridge in a fourth namespace that
//! this test makes (and removes) itself; addresses live only on those veth
//! interfaces. One node's link is cut: with `--split-brain keep-majority`
//! the two that still reach each other down it, it downs itself and exits
//! with code 3, and nobody else is downed. Needs root (`ip netns`); skips
//! with a message otherwise.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::thread;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_datum-node");
const LONG: Duration = Duration::from_secs(30);
const NODES: usize = 3;

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
}

impl Net {
    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    fn node_addr(i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// A switch namespace with a bridge, and one namespace per node with a
    /// veth to the bridge.
    fn make() -> Result<Net, String> {
        let net = Net {
            prefix: format!("dcs{}", std::process::id()),
        };
        let sw = net.ns("sw");
        ip(&["netns", "add", &sw])?;
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        for i in 0..NODES {
            let ns = net.ns(&format!("n{i}"));
            let (here, there) = (format!("{}v{i}", net.prefix), format!("s{i}"));
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &here,
            ])?;
            ip(&["-n", &ns, "link", "set", &here, "netns", &sw])?;
            ip(&["-n", &sw, "link", "set", &here, "name", &there])?;
            ip(&["-n", &sw, "link", "set", &there, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &there, "up"])?;
            let cidr = format!("{}/24", Net::node_addr(i));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(net)
    }

    /// Cuts (or restores) node `i`'s link to the bridge.
    fn link(&self, i: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.ns("sw"), "link", "set", &format!("s{i}"), state]).expect("link");
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for i in 0..NODES {
            let _ = ip(&["netns", "del", &self.ns(&format!("n{i}"))]);
        }
        let _ = ip(&["netns", "del", &self.ns("sw")]);
    }
}

/// A `datum-node` in node `i`'s namespace, with its stdout as lines.
struct Node {
    child: Child,
    lines: Receiver<Option<String>>,
    node_id: String,
    reaped: bool,
}

impl Node {
    fn start(net: &Net, i: usize) -> Node {
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
            .args(["--split-brain", "keep-majority"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn datum-node");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(Some(line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(None);
        });
        let mut node = Node {
            child,
            lines,
            node_id: String::new(),
            reaped: false,
        };
        let started = node.expect(|l| field(l, "event") == Some("started"));
        node.node_id = field(&started, "node_id").expect("node id").to_owned();
        node
    }

    /// The next line that satisfies `pred`; every line seen meanwhile goes
    /// through `seen` first.
    fn expect(&mut self, mut pred: impl FnMut(&str) -> bool) -> String {
        let deadline = Instant::now() + LONG;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Some(line)) if pred(&line) => return line,
                Ok(Some(_)) => {}
                Ok(None) | Err(RecvTimeoutError::Disconnected) => panic!("stdout ended"),
                Err(RecvTimeoutError::Timeout) => panic!("no expected line within {LONG:?}"),
            }
        }
    }

    /// Lines printed within `d`, without waiting for any in particular.
    fn drain(&mut self, d: Duration) -> Vec<String> {
        let deadline = Instant::now() + d;
        let mut out = Vec::new();
        while let Ok(Some(line)) = self
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

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pattern = format!("\"{key}\":\"");
    let start = line.find(&pattern)? + pattern.len();
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

#[test]
fn a_node_cut_off_by_a_real_partition_downs_itself_and_the_majority_goes_on() {
    let net = match Net::make().and_then(|net| {
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
    }) {
        Ok(net) => net,
        Err(error) => {
            eprintln!("SKIPPED: network namespaces are not available here ({error})");
            return;
        }
    };
    let mut nodes: Vec<Node> = (0..NODES).map(|i| Node::start(&net, i)).collect();
    for n in &mut nodes {
        let mut up = std::collections::BTreeSet::new();
        n.expect(|l| {
            if field(l, "event") == Some("member_up") {
                up.insert(field(l, "node_id").unwrap_or_default().to_owned());
            }
            up.len() == NODES
        });
    }
    let victim = nodes[2].node_id.clone();
    let cut = Instant::now();
    net.link(2, false);
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
    net.link(2, true);
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
    for n in &mut nodes[..2] {
        let pid = n.child.id() as libc::pid_t;
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    for n in &mut nodes[..2] {
        let status = n.wait();
        assert!(status.success(), "{status}");
    }
}
