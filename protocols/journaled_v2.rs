//! Version 2 of `datum-node`'s journaled counter (`--counter
//! --journal-url … --counter-version 2`): its protocol extends version 1's
//! with `ask Reset -> u64`, and its events are `Change`s, version 2, read
//! from version 1's `Added` by an upcaster, so a journal version 1 wrote
//! recovers here. Included with `#[path]` beside `counter.rs` and
//! `journaled.rs` (as the sibling modules `counter` and `journaled`).

#![allow(dead_code)] // the tests use the protocol, the node binary the entity

use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::{Stored, Unreadable, extends};

use super::counter::{Add, Get};
use super::journaled::{Added, Credit, JournaledCounter, add_delay};

/// Sets the counter back to 0, journaled; answered with how many resets
/// it has had.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reset;

protocol! {
    /// The journaled counter, version 2: version 1's lines, then `Reset`.
    pub protocol JournaledCounterV2 = "journaled-counter" {
        ask Add -> u64;
        ask Get -> u64;
        tell Credit;
        ask Reset -> u64;
    }
}

const _: () = assert!(extends::<JournaledCounterV2, JournaledCounter>());

/// Version 2's event.
#[derive(Debug, Serialize, Deserialize)]
pub enum Change {
    /// `by` added to the total `onto`.
    Added { by: u64, onto: u64 },
    /// The total set back to 0.
    Reset,
}

/// The counter, version 2.
#[derive(Debug, Default)]
pub struct JournaledCounterV2Entity {
    total: u64,
    resets: u64,
}

impl Entity for JournaledCounterV2Entity {
    type Protocol = JournaledCounterV2;
}

impl EventSourced for JournaledCounterV2Entity {
    type Event = Change;
    const EVENT_VERSION: u32 = 2;
    fn apply(&mut self, change: &Change) {
        match change {
            Change::Added { by, .. } => self.total = self.total.wrapping_add(*by),
            Change::Reset => {
                self.total = 0;
                self.resets += 1;
            }
        }
    }
    /// Version 1 journaled `Added { by, onto }`.
    fn read_event(stored: Stored<'_>) -> Result<Change, Unreadable> {
        match stored.version() {
            1 => stored
                .decode::<Added>()
                .map(|Added { by, onto }| Change::Added { by, onto }),
            _ => stored.decode(),
        }
    }
}

impl JournaledCounterV2Entity {
    async fn add(&mut self, by: u64, ctx: &EntityContext) -> ShardingResult<()> {
        let change = Change::Added {
            by,
            onto: self.total,
        };
        self.persist(ctx, change).await
    }
}

impl Handler<Add> for JournaledCounterV2Entity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        add_delay().await;
        self.add(msg.0, ctx).await?;
        Ok(self.total)
    }
}

impl Handler<Credit> for JournaledCounterV2Entity {
    async fn handle(&mut self, msg: Credit, ctx: &EntityContext) -> ShardingResult<()> {
        self.add(msg.0, ctx).await
    }
}

impl Handler<Get> for JournaledCounterV2Entity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

impl Handler<Reset> for JournaledCounterV2Entity {
    async fn handle(&mut self, _: Reset, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, Change::Reset).await?;
        Ok(self.resets)
    }
}
