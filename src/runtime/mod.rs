//! The untyped runtime under the typed façade, on one node.
//!
//! ```text
//!  EntityRef<P>::tell/ask ──► Region (one per entity type)
//!                               slots[shard] : Mutex<Slot>
//!                                 Unallocated { buffer }  ── Allocate ──► RegionActor
//!                                 Local { entities, passivating, shard }      │ spawns
//!                                 Stopped                                     ▼
//!                 fast path: lock, entity found   ──► entity mailbox    ShardActor
//!                 slow path: same lock: spawn / buffer / overflow          (lifecycle:
//!                                                                            passivation,
//!  EntityActor<E> (one ractor actor per live entity) ── Passivate, Stopped ──► respawn)
//! ```
//!
//! Every routing decision for a shard is made under that shard's lock, and
//! every send into an entity mailbox happens while holding it. So a message
//! never overtakes an earlier one from the same awaiting sender: a spawn, a
//! buffer flush and a passivation each complete under the lock before
//! any later send can see their result.
//!
//! Passivation: the entity is removed from the table and sent a stop marker
//! under the lock; what is already in its mailbox is still handled by it, and what
//! arrives afterwards is buffered. When the entity has stopped, its shard
//! actor spawns the next incarnation with the buffer, if any. Nothing is dropped.

pub(crate) mod entity_actor;
pub(crate) mod region;
pub(crate) mod region_actor;
pub(crate) mod shard_actor;
