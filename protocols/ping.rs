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
    /// Messages handled: [`processed`](Self::processed) sums it.
    processed: Tally,
    /// A `(driver, seq)` handled a second time.
    pub duplicate_processings: AtomicU64,
    /// A lower `seq` from a driver after a higher one.
    pub order_violations: AtomicU64,
    /// The `(driver, seq)` of every duplicate or order violation, to tell
    /// those of retried messages (expected) from the others.
    pub flagged: std::sync::Mutex<Vec<(u32, u64)>>,
}

impl Checks {
    /// Messages handled so far, by every entity that reports here.
    #[allow(dead_code)] // not every program that includes this file reads it
    pub fn processed(&self) -> u64 {
        self.processed.sum()
    }

    /// Counts one message handled (for entities outside this file).
    #[allow(dead_code)] // not every program that includes this file has one
    pub fn count_processed(&self) {
        self.processed.add_one();
    }

    /// Duplicates and order violations of messages not in `retried`.
    #[allow(dead_code)] // not every program that includes this file checks
    pub fn unexplained(&self, retried: &std::collections::HashSet<(u32, u64)>) -> usize {
        let flagged = self.flagged.lock().unwrap_or_else(|e| e.into_inner());
        flagged.iter().filter(|p| !retried.contains(p)).count()
    }

    /// Counts a ping `last` (the driver's highest seq seen) says is a
    /// duplicate or out of order.
    fn check(&self, msg: Ping, last: Option<u64>) {
        self.processed.add_one();
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

/// A count that every thread adds to on a cache line of its own (a thread
/// picks one of [`TALLY_LINES`] at its first add), summed when read. One
/// shared counter would be a line written by both cores of the machine on
/// every message: about a sixth of the handler's samples in a W1-sat
/// profile (BENCHMARKS.md, "Handling futures"), the runner's cost, not the
/// library's.
#[derive(Debug, Default)]
struct Tally([TallyLine; TALLY_LINES]);

/// How many lines a [`Tally`] spreads over.
const TALLY_LINES: usize = 8;

/// One counter alone on its (128-byte, a prefetched pair of 64) line.
#[derive(Debug, Default)]
#[repr(align(128))]
struct TallyLine(AtomicU64);

impl Tally {
    fn add_one(&self) {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        thread_local! {
            static LINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) as usize % TALLY_LINES;
        }
        let line = LINE.with(|line| *line);
        self.0[line].0.fetch_add(1, Ordering::Relaxed);
    }

    #[allow(dead_code)] // read through `Checks::processed` only
    fn sum(&self) -> u64 {
        self.0
            .iter()
            .map(|line| line.0.load(Ordering::Relaxed))
            .sum()
    }
}

/// The highest seq seen from each driver: the first [`INLINE_DRIVERS`] in
/// the entity itself, beside its count, the rest in a map. A run has a
/// driver per node, so a message touches no memory of the entity's but
/// its own few lines (a map's table was two more cache misses a message,
/// about two fifths of the handler's samples in the same profile).
#[derive(Debug, Default)]
struct SeqTable {
    inline: [(u32, u64); INLINE_DRIVERS],
    /// How many of `inline` are in use.
    len: usize,
    more: HashMap<u32, u64, foldhash::fast::RandomState>,
}

/// How many drivers a [`SeqTable`] keeps inline.
const INLINE_DRIVERS: usize = 4;

impl SeqTable {
    /// The highest seq seen from `driver`.
    fn get(&self, driver: u32) -> Option<u64> {
        match self.inline[..self.len].iter().find(|(d, _)| *d == driver) {
            Some((_, seq)) => Some(*seq),
            None => self.more.get(&driver).copied(),
        }
    }

    /// Records `seq` from `driver`, keeping the highest; returns the
    /// highest seen before it.
    fn raise(&mut self, driver: u32, seq: u64) -> Option<u64> {
        let slot = match self.inline[..self.len]
            .iter_mut()
            .find(|(d, _)| *d == driver)
        {
            Some((_, slot)) => slot,
            // `more` is used only once `inline` is full.
            None if self.len < INLINE_DRIVERS => {
                self.inline[self.len] = (driver, seq);
                self.len += 1;
                return None;
            }
            None => match self.more.get_mut(&driver) {
                Some(slot) => slot,
                None => {
                    self.more.insert(driver, seq);
                    return None;
                }
            },
        };
        let last = *slot;
        *slot = last.max(seq);
        Some(last)
    }
}

/// Counts what it handled and checks per-driver order.
#[derive(Debug, Default)]
pub struct PingEntity {
    /// Messages handled by this incarnation.
    pub handled: u64,
    /// The highest seq seen from each driver.
    last_seq: SeqTable,
    checks: Option<Arc<Checks>>,
}

impl PingEntity {
    /// An entity that reports into `checks`.
    pub fn checked(checks: Arc<Checks>) -> Self {
        PingEntity {
            handled: 0,
            last_seq: SeqTable::default(),
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
        // to keep, and no entry per ask.
        let last = if msg.driver >= 1 << 31 {
            None
        } else {
            self.last_seq.raise(msg.driver, msg.seq)
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
        entity.last_seq.raise(event.driver, event.seq);
    }
}

impl Handler<Ping> for DurablePingEntity {
    async fn handle(&mut self, msg: Ping, ctx: &EntityContext) -> ShardingResult<Ack> {
        if let Some(checks) = &self.0.checks {
            checks.check(msg, self.0.last_seq.get(msg.driver));
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
