//! Version 2 of the guide's counter (`datum-node --counter-version 2`): its
//! protocol extends version 1's with `ask Reset -> u64`, and the state that
//! moves with a shard is `Totals`, read from version 1's bare total by an
//! upcaster. Included with `#[path]` beside `counter.rs` (as the sibling
//! module `counter`) by the node binary and the tests that roll a cluster
//! from version 1 to version 2.

#![allow(dead_code)] // the tests use the protocol, the node binary the entity

use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{Stored, Unreadable, extends};

use super::counter::{Add, Counter, Get};

/// Sets the counter back to 0; answered with how many resets it has had.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reset;

protocol! {
    /// The counter, version 2: version 1's lines, then `Reset`.
    pub protocol CounterV2 = "counter" {
        tell Add;
        ask Get -> u64;
        ask Reset -> u64;
    }
}

const _: () = assert!(extends::<CounterV2, Counter>());

/// Version 2's state, as it moves with its shard (version 1's is the bare
/// total).
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Totals {
    /// The sum of everything added since the last reset.
    pub total: u64,
    /// How many resets there were.
    pub resets: u64,
}

/// The counter, version 2.
#[derive(Debug, Default)]
pub struct CounterV2Entity {
    totals: Totals,
}

impl Entity for CounterV2Entity {
    type Protocol = CounterV2;
}

impl Migratable for CounterV2Entity {
    type Dehydrated = Totals;
    const STATE_VERSION: u32 = 2;
    fn dehydrate(&mut self) -> Totals {
        std::mem::take(&mut self.totals)
    }
    fn rehydrate(&mut self, totals: Totals) {
        self.totals = totals;
    }
    /// A version 1 node sends its bare total.
    fn read_dehydrated(stored: Stored<'_>) -> Result<Totals, Unreadable> {
        match stored.version() {
            1 => stored
                .decode::<u64>()
                .map(|total| Totals { total, resets: 0 }),
            _ => stored.decode(),
        }
    }
}

impl Handler<Add> for CounterV2Entity {
    async fn handle(&mut self, msg: Add, _: &EntityContext) -> ShardingResult<()> {
        self.totals.total += msg.0;
        Ok(())
    }
}

impl Handler<Get> for CounterV2Entity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.totals.total)
    }
}

impl Handler<Reset> for CounterV2Entity {
    async fn handle(&mut self, _: Reset, _: &EntityContext) -> ShardingResult<u64> {
        self.totals.total = 0;
        self.totals.resets += 1;
        Ok(self.totals.resets)
    }
}
