//! The benchmark workload's protocol (BENCHMARK.md, W1): every message is an
//! ask carrying `(driver, seq)`, answered with the same pair as a logical ack.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
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

/// How many pings the entity has handled (its incarnation's count; for a
/// durable entity, its whole journal's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Count;

protocol! {
    /// The benchmark entity.
    pub protocol Pinger = "pinger" {
        ask Ping -> Ack;
        ask Count -> u64;
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

    /// Counts a ping `last` (the driver's highest seq seen) says is a
    /// duplicate or out of order.
    fn check(&self, msg: Ping, last: Option<u64>) {
        self.processed.fetch_add(1, Ordering::Relaxed);
        match last {
            Some(last) if last == msg.seq => {
                self.duplicate_processings.fetch_add(1, Ordering::Relaxed);
                self.flag(msg.driver, msg.seq);
            }
            Some(last) if last > msg.seq => {
                self.order_violations.fetch_add(1, Ordering::Relaxed);
                self.flag(msg.driver, msg.seq);
            }
            _ => {}
        }
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
    /// The highest seq seen from each driver (foldhash: the runner names
    /// the drivers, and SipHash here was about 2 % of W1-sat's
    /// instructions, the library's cost it is there to measure diluted).
    last_seq: HashMap<u32, u64, foldhash::fast::RandomState>,
    checks: Option<Arc<Checks>>,
}

impl PingEntity {
    /// An entity that reports into `checks`.
    pub fn checked(checks: Arc<Checks>) -> Self {
        PingEntity {
            handled: 0,
            last_seq: HashMap::default(),
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
        // An open-loop ask is a sender of its own (ids from 2³¹): no order
        // to keep, and no entry per ask. Otherwise one lookup finds the
        // highest seq seen and raises it.
        let last = if msg.driver >= 1 << 31 {
            None
        } else {
            match self.last_seq.entry(msg.driver) {
                Entry::Occupied(mut seen) => {
                    let last = *seen.get();
                    if last < msg.seq {
                        seen.insert(msg.seq);
                    }
                    Some(last)
                }
                Entry::Vacant(seen) => {
                    seen.insert(msg.seq);
                    None
                }
            }
        };
        if let Some(checks) = &self.checks {
            checks.check(msg, last);
        }
        Ok(Ack {
            driver: msg.driver,
            seq: msg.seq,
        })
    }
}

impl Handler<Count> for PingEntity {
    async fn handle(&mut self, _: Count, _ctx: &EntityContext) -> ShardingResult<u64> {
        Ok(self.handled)
    }
}

/// W4's entity (BENCHMARK.md): the ping entity, event-sourced. Each ping
/// is journaled as an event before its ack; a new incarnation recovers the
/// count and each driver's highest seq from the journal, so its checks see
/// a duplicate of a ping an earlier incarnation handled.
#[allow(dead_code)] // not every program that includes this file runs W4
#[derive(Debug, Default)]
pub struct DurablePingEntity(pub PingEntity);

impl Entity for DurablePingEntity {
    type Protocol = Pinger;
}

impl EventSourced for DurablePingEntity {
    type Event = Ping;
    fn apply(&mut self, event: &Ping) {
        let entity = &mut self.0;
        entity.handled += 1;
        let last = entity.last_seq.entry(event.driver).or_insert(event.seq);
        *last = (*last).max(event.seq);
    }
}

impl Handler<Ping> for DurablePingEntity {
    async fn handle(&mut self, msg: Ping, ctx: &EntityContext) -> ShardingResult<Ack> {
        if let Some(checks) = &self.0.checks {
            checks.check(msg, self.0.last_seq.get(&msg.driver).copied());
        }
        self.persist(ctx, msg).await?; // durable, then applied
        Ok(Ack {
            driver: msg.driver,
            seq: msg.seq,
        })
    }
}

impl Handler<Count> for DurablePingEntity {
    async fn handle(&mut self, _: Count, _ctx: &EntityContext) -> ShardingResult<u64> {
        Ok(self.0.handled)
    }
}
