//! The untyped runtime under the typed façade, on one node.
//!
//! ```text
//!  EntityRef<P>::tell/ask ──► Region (one per entity type, region/)
//!                               slots[shard] : Mutex<Slot>     (slot/: the
//!                                 Unallocated { buffer }          state machine,
//!                                 Local { entities, handoff }     no IO; the region
//!                                 Remote(home) / Stopped          is its host)
//!                 fast path: lock, entity found   ──► entity mailbox
//!                 slow path: same lock: spawn / buffer / overflow / forward
//!
//!  EntityActor<E> (one ractor actor per live entity) ── Passivate, Stopped ──► RegionActor
//!  RegionActor (one per region): starts hosted shards (store read off the lock),
//!                                relays entities' requests and stop notices
//! ```
//!
//! Every routing decision for a shard is made by its [`slot::Slot`] under
//! that shard's lock, and every send into an entity mailbox happens while
//! holding it. So a message never overtakes an earlier one from the same
//! awaiting sender: a spawn, a buffer flush and a passivation each complete
//! under the lock before any later send can see their result.
//!
//! Passivation: the entity is sent a stop marker under the lock and marked
//! passivating; what is already in its mailbox is still handled by it, and
//! what arrives afterwards is buffered. When its stop notice reaches the
//! region (through the region actor, which lives as long as the region),
//! the slot spawns the next incarnation with the buffer, if any. Nothing
//! is dropped, and two incarnations of an entity never run at once on a
//! node, also when its shard moved away and came back meanwhile.
//!
//! `dispatch` is how a type-erased envelope reaches a typed handler; it
//! sits one layer below the rest of the runtime (SPEC §0.1).

pub(crate) mod ask_waits;
pub(crate) mod dispatch;
pub(crate) mod entity_actor;
pub(crate) mod mailbox;
pub(crate) mod passivation;
pub(crate) mod region;
pub(crate) mod region_actor;
pub(crate) mod slot;
pub(crate) mod traffic;
