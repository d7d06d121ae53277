//! `datum-node`'s journaled counter (`--counter --journal-url`): an
//! event-sourced counter whose additions are journaled before they are
//! answered. Included with `#[path]` beside `counter.rs` (as the sibling
//! module `counter`) by the node binary and by the tests that talk to it,
//! so that both hold one protocol, with one fingerprint.

#![allow(dead_code)] // the tests use the protocol, the node binary the entity

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use datum_cluster_sharding::prelude::*;

use super::counter::{Add, Get};

/// How long each `Add` handler waits before it journals (`datum-node
/// --handle-ms`), in milliseconds: a slow handler, so that asks are in
/// flight when a test cuts the network.
pub static ADD_DELAY_MS: AtomicU64 = AtomicU64::new(0);

/// Adds to the counter without a reply: what a reliable producer sends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Credit(pub u64);

protocol! {
    /// A counter whose additions are journaled before they are answered.
    pub protocol JournaledCounter = "journaled-counter" {
        ask Add -> u64;
        ask Get -> u64;
        tell Credit;
    }
}

/// One journaled addition, with the total it was added to: a journal
/// whose every event was written by an incarnation that had applied
/// all the events before it has `onto` equal to the sum of their `by`
/// (so a fork shows in the rows alone).
#[derive(Debug, Serialize, Deserialize)]
pub struct Added {
    pub by: u64,
    pub onto: u64,
}

/// The total of the journaled additions.
#[derive(Debug, Default)]
pub struct JournaledCounterEntity {
    total: u64,
}

impl Entity for JournaledCounterEntity {
    type Protocol = JournaledCounter;
}

impl EventSourced for JournaledCounterEntity {
    type Event = Added;
    fn apply(&mut self, event: &Added) {
        // (Wrapping: `--drive-tags` adds large numbers.)
        self.total = self.total.wrapping_add(event.by);
    }
}

impl JournaledCounterEntity {
    /// Journals an addition of `by`, then applies it.
    async fn add(&mut self, by: u64, ctx: &EntityContext) -> ShardingResult<()> {
        let event = Added {
            by,
            onto: self.total,
        };
        self.persist(ctx, event).await
    }
}

/// Waits `--handle-ms`, as each `Add` handler does first.
pub async fn add_delay() {
    let delay = ADD_DELAY_MS.load(Ordering::Relaxed);
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
}

impl Handler<Add> for JournaledCounterEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        add_delay().await;
        self.add(msg.0, ctx).await?;
        Ok(self.total)
    }
}

impl Handler<Credit> for JournaledCounterEntity {
    async fn handle(&mut self, msg: Credit, ctx: &EntityContext) -> ShardingResult<()> {
        self.add(msg.0, ctx).await
    }
}

impl Handler<Get> for JournaledCounterEntity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}
