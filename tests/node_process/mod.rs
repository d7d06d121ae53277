//! `datum-node` OS processes on 127.0.0.1, for the tests that run them
//! (included as a module): a [`NodeProcess`] per child, and a client node
//! in the test's own process.
//!
//! Each child's stdout is read line by line on its own thread and forwarded,
//! stamped with the time it was read, over a channel; every wait is a
//! `recv_timeout` on that channel under a generous deadline, never a sleep.
//! Its stderr is gathered by another thread, whose end is waited for
//! before anything reads it.
//! A [`NodeProcess`] kills and reaps its child when dropped, so a failing
//! test leaves no process behind.
#![allow(dead_code)] // not every test uses every helper

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::common::field;

pub const BIN: &str = env!("CARGO_BIN_EXE_datum-node");
/// Generous bound on any one wait: these processes share 2 cores with others.
pub const LONG: Duration = Duration::from_secs(30);

/// One line of a child's stdout, or its end.
pub enum Output {
    Line { at: Instant, line: String },
    Eof,
}

/// A running `datum-node` child with its stdout as a channel of lines.
pub struct NodeProcess {
    pub name: &'static str,
    pub child: Child,
    pub lines: Receiver<Output>,
    pub stderr: Arc<Mutex<String>>,
    /// Disconnected once the stderr thread has read the pipe to its end.
    pub stderr_ended: Receiver<()>,
    pub addr: String,
    pub node_id: String,
    pub reaped: bool,
    /// Every stdout line so far, with the time it was read (whether or
    /// not a wait consumed it).
    pub history: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl NodeProcess {
    /// Starts a node (joining through `seed` if given) and waits for its
    /// `started` line.
    pub fn start(name: &'static str, seed: Option<&str>) -> NodeProcess {
        Self::start_with(name, seed, &[])
    }

    /// [`start`](Self::start) with more flags.
    pub fn start_with(name: &'static str, seed: Option<&str>, extra: &[&str]) -> NodeProcess {
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
        let history = Arc::new(Mutex::new(Vec::new()));
        let log = history.clone();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let at = Instant::now();
                log.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((at, line.clone()));
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
            history,
        };
        let (_, started) = node.expect_line(|l| field(l, "event") == Some("started"));
        node.addr = field(&started, "addr").expect("addr").to_owned();
        node.node_id = field(&started, "node_id").expect("node_id").to_owned();
        node
    }

    /// Reads lines until one satisfies `matches`; returns it with the time
    /// it was read. Panics (with the child's stderr) on timeout or EOF.
    pub fn expect_line(&mut self, mut matches: impl FnMut(&str) -> bool) -> (Instant, String) {
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
    pub fn skip_printed(&mut self) {
        while let Ok(Output::Line { .. }) = self.lines.try_recv() {}
    }

    /// Waits until this node has reported `n` distinct members Up.
    pub fn expect_members_up(&mut self, n: usize) {
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
    pub fn expect_exit(&mut self) -> (ExitStatus, Vec<String>) {
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
    pub fn wait_for_stderr_end(&self) -> bool {
        matches!(
            self.stderr_ended.recv_timeout(LONG),
            Err(RecvTimeoutError::Disconnected)
        )
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }

    /// Sends `signal` (SIGTERM: leave gracefully; SIGSTOP/SIGCONT: freeze, thaw).
    pub fn signal(&self, signal: libc::c_int) {
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

pub fn is_event_about(line: &str, event: &str, node_id: &str) -> bool {
    field(line, "event") == Some(event) && field(line, "node_id") == Some(node_id)
}

/// A runtime for a test's client node.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The client: a node in this process, seeded by `seed`, with a
/// proxy-only region of `P` (its fingerprint must match the nodes', or be
/// a compatible version of theirs) of 32 shards, once it sees `members`
/// members Up (itself included).
pub async fn proxy_client<P: datum_cluster_sharding::Protocol>(
    seed: &str,
    members: usize,
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
        .wait_until(|s| s.up_members().count() == members, LONG)
        .await
        .expect("every member Up");
    let system = ShardedSystem::builder()
        .num_shards(32)
        .node(client.clone())
        .start()
        .await
        .expect("system");
    system.register_proxy::<P>().await.expect("proxy");
    (client, system)
}
