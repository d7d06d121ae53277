//! Live migration: the `Migratable` trait, the encoded state a graceful
//! shard move carries (`MigratedState`), each kind of entity's conversions
//! of it (`Migration`), and the `MigrationEvent`s that tell what became of
//! the states.

use std::sync::atomic::Ordering;

use super::{DeliveryRow, DurableState, Entity, EntityContext, Snapshotted, Stored, Unreadable};
use crate::model::extractor::ShardId;

/// An entity whose in-memory state moves with it when its shard moves
/// gracefully (live migration, Orleans' dehydrate / rehydrate): a
/// rebalance, a graceful leave, a rolling restart, a system's `shutdown()`.
/// The old owner lets each live entity finish its mailbox, takes its state
/// with [`dehydrate`](Self::dehydrate) and sends it to the new owner, which
/// builds the next incarnation with the factory and hands it the state with
/// [`rehydrate`](Self::rehydrate) before any message. Register it with
/// [`Registration::migratable`](crate::Registration::migratable).
///
/// When the state cannot come — the old owner died, the move timed out,
/// [`read_dehydrated`](Self::read_dehydrated) cannot read the state, or its
/// version is above this build's [`STATE_VERSION`](Self::STATE_VERSION) —
/// the incarnation starts as the factory made it, and a
/// [`MigrationEvent`](crate::MigrationEvent) says so. A state is applied at
/// most once, to one incarnation.
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Counter = "counter" { tell Add; } }
/// #[derive(Default)]
/// struct CounterEntity { total: u64 }
/// impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// impl Migratable for CounterEntity {
///     type Dehydrated = u64;
///     fn dehydrate(&mut self) -> u64 { self.total }
///     fn rehydrate(&mut self, total: u64) { self.total = total; }
/// }
/// # fn main() {}
/// ```
pub trait Migratable: Entity {
    /// The state as it travels (CBOR).
    type Dehydrated: serde::Serialize + serde::de::DeserializeOwned + Send + 'static;
    /// The version of the state's encoding, sent with it: a receiver
    /// refuses a state of a version above its own.
    const STATE_VERSION: u32 = 1;
    /// Takes the state out of an incarnation that has handled its last
    /// message here (it is dropped next).
    fn dehydrate(&mut self) -> Self::Dehydrated;
    /// Puts a migrated state into an incarnation fresh from the factory,
    /// before its first message.
    fn rehydrate(&mut self, state: Self::Dehydrated);

    /// Reads a migrated state, of a version at most
    /// [`STATE_VERSION`](Self::STATE_VERSION), into the current
    /// `Dehydrated`: the default decodes the current shape. Override it to
    /// read the shapes an earlier build sends during a rolling upgrade
    /// ([`Stored`] shows how); on an error the incarnation starts as the
    /// factory made it, and a [`MigrationEvent`] says why.
    fn read_dehydrated(stored: Stored<'_>) -> Result<Self::Dehydrated, Unreadable>
    where
        Self: Sized,
    {
        stored.decode()
    }
}

/// One entity's dehydrated state, encoded: what a move carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MigratedState {
    /// The version of its encoding when it was taken
    /// (`Migratable::STATE_VERSION`, `Snapshotted::SNAPSHOT_VERSION` or
    /// `DurableState::STATE_VERSION`).
    pub(crate) version: u32,
    /// Its CBOR.
    pub(crate) bytes: bytes::Bytes,
    /// Of a durable type: where the state stands in its store (the
    /// journal's sequence number it includes, or the state's revision); 0
    /// otherwise.
    pub(crate) position: u64,
    /// The entity's deliveries table (SPEC §13.17), empty if it has none.
    pub(crate) deliveries: Vec<DeliveryRow>,
}

/// A migratable type's two conversions, type-erased for its spawner.
pub(crate) struct Migration<E> {
    /// Dehydrates and encodes; `Err` says why it could not.
    pub(crate) take: fn(&mut E, &EntityContext) -> Result<MigratedState, String>,
    /// Decodes and rehydrates; `Err` (nothing applied) says why not. `None`
    /// for a durable type, whose state goes into its recovery instead.
    pub(crate) put: Option<Rehydrate<E>>,
}

/// Decodes a migrated state into a fresh incarnation.
pub(crate) type Rehydrate<E> = fn(&mut E, &MigratedState) -> Result<(), String>;

impl<E> Clone for Migration<E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for Migration<E> {}

impl<E: Migratable> Migration<E> {
    pub(crate) fn of() -> Self {
        Migration {
            take: |entity, _| {
                let mut bytes = Vec::new();
                ciborium::into_writer(&entity.dehydrate(), &mut bytes)
                    .map_err(|e| format!("the state does not encode: {e}"))?;
                Ok(MigratedState {
                    version: E::STATE_VERSION,
                    bytes: bytes.into(),
                    position: 0,
                    deliveries: Vec::new(),
                })
            },
            put: Some(|entity, state| {
                if state.version > E::STATE_VERSION {
                    return Err(format!(
                        "the state has version {}, above this build's {}",
                        state.version,
                        E::STATE_VERSION
                    ));
                }
                let decoded = E::read_dehydrated(Stored::new(state.version, &state.bytes))
                    .map_err(|e| {
                        format!("the state (version {}) cannot be read: {e}", state.version)
                    })?;
                entity.rehydrate(decoded);
                Ok(())
            }),
        }
    }
}

impl<E: Snapshotted> Migration<E> {
    /// A snapshotted type's: its snapshot, at the journal's sequence
    /// number this incarnation knows.
    pub(crate) fn snapshotted() -> Self {
        Migration {
            take: |entity, ctx| {
                let mut bytes = Vec::new();
                ciborium::into_writer(&entity.snapshot(), &mut bytes)
                    .map_err(|e| format!("the snapshot does not encode: {e}"))?;
                let position = ctx
                    .journal
                    .as_ref()
                    .map_or(0, |j| j.highest.load(Ordering::Acquire));
                Ok(MigratedState {
                    version: E::SNAPSHOT_VERSION,
                    bytes: bytes.into(),
                    position,
                    deliveries: Vec::new(),
                })
            },
            put: None,
        }
    }
}

impl<E: DurableState> Migration<E> {
    /// A durable-state type's: its state, at the revision this incarnation
    /// knows.
    pub(crate) fn durable_state() -> Self {
        Migration {
            take: |entity, ctx| {
                let mut bytes = Vec::new();
                ciborium::into_writer(entity.state(), &mut bytes)
                    .map_err(|e| format!("the state does not encode: {e}"))?;
                let position = ctx
                    .state
                    .as_ref()
                    .map_or(0, |h| h.revision.load(Ordering::Acquire));
                Ok(MigratedState {
                    version: E::STATE_VERSION,
                    bytes: bytes.into(),
                    position,
                    deliveries: Vec::new(),
                })
            },
            put: None,
        }
    }
}

/// What became of migrated states on this node
/// (`ShardedSystem::subscribe_migration_events`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MigrationEvent {
    /// A shard moved here with the states of `entities` entities
    /// (`bytes` of them, encoded), each given to its next incarnation.
    Received {
        /// The entity type.
        type_name: &'static str,
        /// The shard.
        shard: ShardId,
        /// Its old owner.
        from: crate::model::identity::UniqueAddress,
        /// How many states came.
        entities: usize,
        /// Their encoded size.
        bytes: usize,
    },
    /// A shard started here without its entities' states: they start from
    /// the factory (a durable type's, from its store).
    FellBack {
        /// The entity type.
        type_name: &'static str,
        /// The shard.
        shard: ShardId,
        /// Its old owner, when the move was a handoff; `None` for a shard
        /// that moved without one (its owner was lost, or its handoff
        /// timed out), which moves no state.
        from: Option<crate::model::identity::UniqueAddress>,
        /// Why: the old owner is gone, had none for this node, the
        /// migration timed out, or the move was not a handoff.
        reason: String,
    },
    /// One entity's state came but was refused (it cannot be read, or its
    /// version is above this build's): that entity starts from the factory.
    StateRefused {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
        /// Why.
        reason: String,
    },
}
