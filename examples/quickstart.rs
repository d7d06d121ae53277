//! The guide's quickstart on one node: register a counter, tell it, ask it.
//!
//! Run: `cargo run --example quickstart`

use std::time::Duration;

use datum_cluster_sharding::prelude::*;

#[path = "../protocols/counter.rs"]
mod counter;
use counter::{Add, Counter, CounterEntity, Get};

#[tokio::main]
async fn main() -> ShardingResult<()> {
    let system = ShardedSystem::builder().num_shards(64).start().await?;
    system
        .entity_type::<CounterEntity>()
        .register(|_ctx| CounterEntity::default())
        .await?;

    let cart = system.entity_ref::<Counter>("cart-42");
    cart.tell(Add(3)).await?;
    cart.tell(Add(4)).await?;
    let total = cart.ask(Get, Duration::from_secs(5)).await?;
    println!("cart-42 (shard {}) total = {total}", cart.shard_id());
    assert_eq!(total, 7);

    system.shutdown().await;
    Ok(())
}
