//! The benchmark workload's protocol (BENCHMARK.md, W1): every message is an
//! ask carrying `(driver, seq)`, answered with the same pair as a logical ack.

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

/// Counts what it handled.
#[derive(Debug, Default)]
pub struct PingEntity {
    /// Messages handled by this incarnation.
    pub handled: u64,
}

impl Entity for PingEntity {
    type Protocol = Pinger;
}

impl Handler<Ping> for PingEntity {
    async fn handle(&mut self, msg: Ping, _ctx: &EntityContext) -> ShardingResult<Ack> {
        self.handled += 1;
        Ok(Ack {
            driver: msg.driver,
            seq: msg.seq,
        })
    }
}
