//! A user's guide, chapter by chapter: from a protocol to a durable,
//! migrating, reliably fed, TLS-protected and monitored cluster.
//!
//! Every code block in these chapters is compiled by `cargo test --doc`, so
//! what a chapter shows is what the crate accepts. Each chapter names the
//! runnable example that goes with it.
//!
//! 1. [Protocols and entities](ch01_protocols_and_entities): the typed
//!    protocol, tells and asks, handlers, what the compiler checks.
//! 2. [One node](ch02_one_node): a `ShardedSystem` in one process.
//! 3. [A cluster](ch03_a_cluster): nodes, seeds, discovery, TLS.
//! 4. [Sharding](ch04_sharding): shards, placement, rebalancing,
//!    passivation and remembered entities.
//! 5. [Durable entities](ch05_durable_entities): event-sourced and
//!    durable-state entities on redb or PostgreSQL.
//! 6. [Live migration](ch06_live_migration): entities that carry their
//!    state when their shard moves.
//! 7. [Reliable delivery](ch07_reliable_delivery): producers that resend
//!    until the entity confirms.
//! 8. [Operating](ch08_operating): probes, metrics, traces, Kubernetes.
//! 9. [Upgrading a running cluster](ch09_upgrading): protocol versions and
//!    rolling upgrades.
//! 10. [Tuning](ch10_tuning): the knobs, and what the benchmarks show.
//! 11. [Failure semantics](ch11_failure_semantics): what holds through
//!     kills, partitions and store outages, and what does not.

#[doc = include_str!("../docs/guide/01-protocols-and-entities.md")]
pub mod ch01_protocols_and_entities {}
#[doc = include_str!("../docs/guide/02-one-node.md")]
pub mod ch02_one_node {}
#[doc = include_str!("../docs/guide/03-a-cluster.md")]
pub mod ch03_a_cluster {}
#[doc = include_str!("../docs/guide/04-sharding.md")]
pub mod ch04_sharding {}
#[doc = include_str!("../docs/guide/05-durable-entities.md")]
pub mod ch05_durable_entities {}
#[doc = include_str!("../docs/guide/06-live-migration.md")]
pub mod ch06_live_migration {}
#[doc = include_str!("../docs/guide/07-reliable-delivery.md")]
pub mod ch07_reliable_delivery {}
#[doc = include_str!("../docs/guide/08-operating.md")]
pub mod ch08_operating {}
#[doc = include_str!("../docs/guide/09-upgrading.md")]
pub mod ch09_upgrading {}
#[doc = include_str!("../docs/guide/10-tuning.md")]
pub mod ch10_tuning {}
#[doc = include_str!("../docs/guide/11-failure-semantics.md")]
pub mod ch11_failure_semantics {}
