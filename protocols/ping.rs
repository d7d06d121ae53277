//! The benchmark workload's protocol (BENCHMARK.md, W1): every message is an
//! ask carrying `(driver, seq)`, answered with the same pair as a logical ack.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use datum_cluster_sharding::prelude::*;

/// One W1 request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {
    /// The driver that sent it.
    pub driver: u32,
    /// The driver's sequence number.
    pub seq: u64,
}

/// The logical ack: the request's `(driver, seq)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// The driver echoed.
    pub driver: u32,
    /// The sequence number echoed.
    pub seq: u64,
}

protocol! {
    /// The benchmark entity.
    pub protocol Pinger = "pinger" {
        ask Ping -> Ack;
    }
}

/// W1's entity-side correctness counters, shared by every entity of a run.
#[derive(Debug, Default)]
pub struct Checks {
    /// Messages handled.
    pub processed: AtomicU64,
    /// A `(driver, seq)` handled a second time.
    pub duplicate_processings: AtomicU64,
    /// A lower `seq` from a driver after a higher one.
    pub order_violations: AtomicU64,
    /// The `(driver, seq)` of every duplicate or order violation, to tell
    /// those of retried messages (expected) from the others.
    pub flagged: std::sync::Mutex<Vec<(u32, u64)>>,
}

impl Checks {
    /// Duplicates and order violations of messages not in `retried`.
    #[allow(dead_code)] // not every program that includes this file checks
    pub fn unexplained(&self, retried: &std::collections::HashSet<(u32, u64)>) -> usize {
        let flagged = self.flagged.lock().unwrap_or_else(|e| e.into_inner());
        flagged.iter().filter(|p| !retried.contains(p)).count()
    }

    fn flag(&self, driver: u32, seq: u64) {
        let mut flagged = self.flagged.lock().unwrap_or_else(|e| e.into_inner());
        flagged.push((driver, seq));
    }
}

/// Counts what it handled and checks per-driver order.
#[derive(Debug, Default)]
pub struct PingEntity {
    /// Messages handled by this incarnation.
    pub handled: u64,
    /// The highest seq seen from each driver.
    last_seq: HashMap<u32, u64>,
    checks: Option<Arc<Checks>>,
}

impl PingEntity {
    /// An entity that reports into `checks`.
    pub fn checked(checks: Arc<Checks>) -> Self {
        PingEntity {
            handled: 0,
            last_seq: HashMap::new(),
            checks: Some(checks),
        }
    }
}

impl Entity for PingEntity {
    type Protocol = Pinger;
}

impl Handler<Ping> for PingEntity {
    async fn handle(&mut self, msg: Ping, _ctx: &EntityContext) -> ShardingResult<Ack> {
        self.handled += 1;
        if let Some(checks) = &self.checks {
            checks.processed.fetch_add(1, Ordering::Relaxed);
            match self.last_seq.insert(msg.driver, msg.seq) {
                Some(last) if last == msg.seq => {
                    checks.duplicate_processings.fetch_add(1, Ordering::Relaxed);
                    checks.flag(msg.driver, msg.seq);
                }
                Some(last) if last > msg.seq => {
                    checks.order_violations.fetch_add(1, Ordering::Relaxed);
                    checks.flag(msg.driver, msg.seq);
                    self.last_seq.insert(msg.driver, last);
                }
                _ => {}
            }
        }
        Ok(Ack {
            driver: msg.driver,
            seq: msg.seq,
        })
    }
}
