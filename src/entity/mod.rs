//! Entities: the stateful actors that sharding places, and their handlers.
//!
//! An entity type names its protocol and implements [`Handler<M>`] for each
//! message `M` of it. A tell handler returns `ShardingResult<()>`; an ask
//! handler returns the reply itself, so there is no reply port to forget.
//! Handlers are `async` and run one message at a time, in mailbox order.
//!
//! ```
//! # use datum_cluster_sharding::prelude::*;
//! # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
//! # #[derive(Serialize, Deserialize)] pub struct Get;
//! # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
//! #[derive(Default)]
//! struct CounterEntity { total: u64 }
//!
//! impl Entity for CounterEntity { type Protocol = Counter; }
//!
//! impl Handler<Add> for CounterEntity {
//!     async fn handle(&mut self, msg: Add, _ctx: &EntityContext) -> ShardingResult<()> {
//!         self.total += msg.0;
//!         Ok(())
//!     }
//! }
//!
//! impl Handler<Get> for CounterEntity {
//!     async fn handle(&mut self, _msg: Get, _ctx: &EntityContext) -> ShardingResult<u64> {
//!         Ok(self.total)
//!     }
//! }
//! # fn main() {}
//! ```
//!
//! Every incarnation of an entity is built by the factory given at
//! registration: on the first message, after a handler panic (the entity
//! restarts in place, its mailbox kept), and after passivation.

mod context;
mod dedup;
mod durable_state;
mod event_sourced;
mod journal;
mod migration;
mod persistence;
mod recovery;
mod snapshots;
mod stored;
mod traits;
mod writer;

pub use context::EntityContext;
pub use durable_state::DurableState;
pub use event_sourced::EventSourced;
pub use migration::{Migratable, MigrationEvent};
pub use snapshots::Snapshotted;
pub use stored::{Stored, Unreadable};
pub use traits::{DeferredHandler, Entity, Handler, ReplyPort};

pub(crate) use dedup::{Admission, Deliveries, DeliveryRow};
pub(crate) use durable_state::{StateEncoder, encode_state_of, recover_state};
pub(crate) use event_sourced::recover;
pub(crate) use journal::JournalHandle;
pub(crate) use migration::{MigratedState, Migration};
pub(crate) use persistence::CallDeadline;
pub(crate) use recovery::Recovered;
pub(crate) use snapshots::{Snapshots, recover_snapshotted};
pub(crate) use writer::{JournalWriter, StateWriter};

// Shared by the files of this module only.
use dedup::delivery_manifest;
use durable_state::{StateHandle, state_manifest};
use event_sourced::decode_events;
use persistence::blocking_by;
use recovery::corrupt;
use snapshots::snapshot_manifest;
