//! # datum-cluster-sharding
//!
//! Cluster sharding for Rust over [`ractor`]: many stateful entities spread
//! across the nodes of a cluster, each reached by its id wherever it lives.
//! The counterpart of Akka / Apache Pekko Cluster Sharding, with a typed
//! protocol DSL: the compiler checks which messages are tells and which are
//! asks, what each ask replies, that an entity handles its whole protocol,
//! and which store a system was built with.
//!
//! ```
//! use std::time::Duration;
//! use datum_cluster_sharding::prelude::*;
//!
//! #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
//! #[derive(Serialize, Deserialize)] pub struct Get;
//!
//! protocol! {
//!     /// A counter.
//!     pub protocol Counter = "counter" {
//!         tell Add;
//!         ask Get -> u64;
//!     }
//! }
//!
//! #[derive(Default)]
//! struct CounterEntity { total: u64 }
//! impl Entity for CounterEntity { type Protocol = Counter; }
//! impl Handler<Add> for CounterEntity {
//!     async fn handle(&mut self, msg: Add, _ctx: &EntityContext) -> ShardingResult<()> {
//!         self.total += msg.0;
//!         Ok(())
//!     }
//! }
//! impl Handler<Get> for CounterEntity {
//!     async fn handle(&mut self, _msg: Get, _ctx: &EntityContext) -> ShardingResult<u64> {
//!         Ok(self.total)
//!     }
//! }
//!
//! # #[tokio::main] async fn main() -> ShardingResult<()> {
//! let system = ShardedSystem::builder().num_shards(64).start().await?;
//! system
//!     .entity_type::<CounterEntity>()
//!     .register(|_ctx| CounterEntity::default())
//!     .await?;
//! let cart = system.entity_ref::<Counter>("cart-42");
//! cart.tell(Add(3)).await?;
//! let total: u64 = cart.ask(Get, Duration::from_secs(5)).await?;
//! assert_eq!(total, 3);
//! system.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! The [`guide`] walks from a protocol to a durable, migrating, monitored
//! cluster, chapter by chapter. `SPEC.md` states the semantics, the wire
//! format and the public API; [`guarantees`] shows what the compiler
//! rejects.
#![deny(missing_docs)]
#![forbid(unsafe_code)]
// Every type a public signature shows is reachable at a public path
// (SPEC §0.2 lists them).
#![warn(unnameable_types)]

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;
pub mod cluster;
mod entity;
pub mod guarantees;
pub mod guide;

pub mod membership;
mod model;
mod ops;
pub mod persistence;
mod reliable;
mod runtime;
pub mod sharding;
mod system;
pub mod transport;
mod util;
pub mod wire;

pub use model::identity;
pub use ops::history;
#[cfg(feature = "management")]
pub use ops::management;
pub use ops::telemetry;

pub use entity::{
    DeferredHandler, DurableState, Entity, EntityContext, EventSourced, Handler, Migratable,
    MigrationEvent, ReplyPort, Snapshotted, Stored, Unreadable,
};
pub use model::app_version::{AppVersion, AppVersionError};
pub use model::config::{
    EntityLimit, MAX_SHARDS, PassivationPolicy, PlacementByTraffic, RememberEntitiesConfig,
    RememberEntitiesFailurePolicy, RememberEntitiesQueueFull, ShardingConfig,
};
pub use model::error::{Processed, RegionRefusal, ShardingError, ShardingResult};
pub use model::extractor::{DefaultShardExtractor, ShardExtractor, ShardId, fnv1a_64};
pub use model::protocol::{Ask, Message, MessageInfo, MessageKind, Protocol, Tell, extends};
pub use persistence::remember::{
    FILE_STORE_VERSION, FileStore, FileStoreFsyncPolicy, InMemoryStore, LOCK_FILE, MAX_ENTITY_ID,
    MAX_TYPE_NAME, NoStore, RememberEntitiesEvent, RememberEntitiesOperation,
    RememberEntitiesStore, RememberRecord, StoreError, StoreRepair,
};
pub use reliable::{DurableProducer, ProducerConfig, ProducerStats, ReliableProducer};
pub use system::registration::{self, Registration};
pub use system::{EntityRef, ShardedSystem, ShardedSystemBuilder};

/// Everything a user of the typed façade needs, plus serde's derives.
pub mod prelude {
    pub use crate::{
        Ask, DefaultShardExtractor, DeferredHandler, DurableState, Entity, EntityContext,
        EntityLimit, EntityRef, EventSourced, Handler, InMemoryStore, Message, Migratable, NoStore,
        PassivationPolicy, Processed, Protocol, RememberEntitiesStore, ReplyPort, ShardExtractor,
        ShardId, ShardedSystem, ShardingConfig, ShardingError, ShardingResult, Snapshotted, Stored,
        Tell, Unreadable, protocol,
    };
    pub use serde::{Deserialize, Serialize};
}

/// README's code, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
