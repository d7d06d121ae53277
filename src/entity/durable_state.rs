//! Durable-state entities: the `DurableState` trait, an incarnation's link
//! to its state store (`StateHandle`), saving the state as the next
//! revision, and encoding, loading and checking it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{
    Entity, EntityContext, Recovered, StateWriter, Stored, Unreadable, blocking_by, corrupt,
};
use crate::model::error::ShardingResult;
use crate::persistence::{DurableStateStore, Payload, PersistenceError, PersistenceId, StateWrite};

/// An entity whose whole state is saved, with a revision (Akka's durable
/// state, Orleans' grain storage): a handler changes the state and calls
/// [`save_state`](Self::save_state), which stores it as the next revision
/// only if no other incarnation saved since this one loaded; every
/// incarnation loads the stored state before its first message. Register
/// it with [`Registration::durable_state`](crate::Registration::durable_state), which needs a system
/// whose journal is also a [`DurableStateStore`]. A save refused as stale,
/// or whose outcome is unknown, retires the incarnation as a stale
/// [`EventSourced`](crate::EventSourced) one is.
pub trait DurableState: Entity {
    /// The state as it is saved.
    type State: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static;
    /// The version of the state's encoding, stored with it.
    const STATE_VERSION: u32 = 1;
    /// The state to save.
    fn state(&self) -> &Self::State;
    /// Takes the stored state (into an incarnation fresh from the factory;
    /// not called when nothing is stored).
    fn set_state(&mut self, state: Self::State);

    /// Reads a saved state, of a version at most
    /// [`STATE_VERSION`](Self::STATE_VERSION), into the current `State`:
    /// the default decodes the current shape. Override it to read the
    /// shapes earlier versions saved ([`Stored`] shows how); an error is
    /// reported as a corrupt state, and nothing is applied.
    fn read_state(stored: Stored<'_>) -> Result<Self::State, Unreadable>
    where
        Self: Sized,
    {
        stored.decode()
    }

    /// Saves [`state`](Self::state) as the next revision; on error nothing
    /// was saved unless the error is a store's (outcome unknown: the next
    /// incarnation loads what is there).
    fn save_state(&mut self, ctx: &EntityContext) -> impl Future<Output = ShardingResult<()>> + Send
    where
        Self: Sized,
    {
        let payload = encode_state::<Self>(ctx, self.state());
        async move { ctx.save_state(payload?).await }
    }
}

/// Encodes a durable-state entity's state (with the deliveries table of its
/// context) as it is saved.
pub(crate) type StateEncoder = fn(&dyn std::any::Any, &EntityContext) -> ShardingResult<Payload>;

/// A durable-state incarnation's link to its store.
pub(super) struct StateHandle {
    store: std::sync::Weak<dyn DurableStateStore>,
    /// The system's batched writer of saves.
    writer: Arc<StateWriter>,
    pub(super) encode: StateEncoder,
    pub(super) id: PersistenceId,
    /// The revision this incarnation knows.
    pub(super) revision: AtomicU64,
    /// Why this incarnation must handle nothing more.
    pub(super) retired: std::sync::Mutex<Option<PersistenceError>>,
    /// Whether the reason it was retired is a conflict.
    pub(super) conflicted: AtomicBool,
}

impl StateHandle {
    /// Marks the incarnation as done (the first reason stays).
    pub(super) fn retire(&self, why: PersistenceError) {
        let mut retired = self.retired.lock().unwrap_or_else(|p| p.into_inner());
        retired.get_or_insert(why);
    }
}

impl std::fmt::Debug for StateHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateHandle")
            .field("id", &self.id)
            .field("revision", &self.revision)
            .finish_non_exhaustive()
    }
}

/// Retires the incarnation if a save is dropped before its outcome is known.
struct StateInFlight<'a> {
    handle: &'a StateHandle,
    done: bool,
}

impl Drop for StateInFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.handle.retire(PersistenceError::Store(
                "a save was abandoned before its outcome was known".into(),
            ));
        }
    }
}

impl EntityContext {
    /// Links this incarnation to `store` (a durable-state type, whose
    /// state `encode` takes).
    pub(crate) fn attach_state(
        &mut self,
        store: std::sync::Weak<dyn DurableStateStore>,
        writer: Arc<StateWriter>,
        encode: StateEncoder,
    ) {
        self.state = Some(StateHandle {
            store,
            writer,
            encode,
            id: PersistenceId::new(self.type_name, &*self.entity_id),
            revision: AtomicU64::new(0),
            retired: std::sync::Mutex::new(None),
            conflicted: AtomicBool::new(false),
        });
    }

    pub(super) fn state_store(
        &self,
        handle: &StateHandle,
    ) -> ShardingResult<Arc<dyn DurableStateStore>> {
        handle.store.upgrade().ok_or_else(|| {
            self.persistence_error(PersistenceError::Store(
                "the system's state store is gone".into(),
            ))
        })
    }

    pub(super) async fn recover_state(&self, handle: &StateHandle) -> ShardingResult<Recovered> {
        let store = self.state_store(handle)?;
        let id = handle.id.clone();
        let by = self.call_deadline().map(|d| d.store);
        let read = blocking_by(by, move || Ok((store.revision(&id)?, store.load(&id)?))).await;
        let (revision, state) = read.map_err(|e| self.persistence_error(e))?;
        handle.revision.store(revision, Ordering::Release);
        Ok(Recovered {
            snapshot: None,
            events: Vec::new(),
            state,
        })
    }

    /// Saves `payload` as the next revision after the one this incarnation
    /// knows. A conflict (another incarnation saved since) or an outcome
    /// that is not known retires this incarnation, as for an append; a
    /// save withdrawn unwritten leaves it running.
    pub(super) async fn save_state(&self, payload: Payload) -> ShardingResult<()> {
        let Some(handle) = &self.state else {
            return Err(crate::ShardingError::Bug(format!(
                "`{}` saved a state without a state store",
                self.type_name
            )));
        };
        if let Some(why) = handle
            .retired
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(self.persistence_error(why));
        }
        let expected = handle.revision.load(Ordering::Acquire);
        let write = StateWrite {
            persistence_id: handle.id.clone(),
            expected,
            payload,
            writer: self.writer(),
        };
        let mut guard = StateInFlight {
            handle,
            done: false,
        };
        let saved = handle.writer.save(write, self.call_deadline()).await;
        guard.done = true;
        match saved {
            Ok(()) => {
                handle.revision.store(expected + 1, Ordering::Release);
                self.accepted();
                // The message being handled, if a reliable one, is recorded.
                if let Some((_, saved)) = &mut self.deliveries().current {
                    *saved = true;
                }
                Ok(())
            }
            Err(error @ PersistenceError::Invalid(_)) => Err(self.persistence_error(error)),
            // Not written, but the handler changed the state in memory
            // before it saved: this incarnation is retired, so the next
            // one loads what is stored (and "not processed" holds).
            Err(error) => {
                handle.retire(error.clone());
                if matches!(error, PersistenceError::RevisionConflict { .. }) {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "another incarnation saved this entity's state: this one loads it anew");
                    handle.conflicted.store(true, Ordering::Release);
                } else if matches!(error, PersistenceError::Unavailable(_)) {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "a state save was not sent in time: this incarnation stops, the next loads what is stored");
                } else {
                    tracing::warn!(type_name = self.type_name, entity_id = %self.entity_id, %error, "a state save's outcome is unknown: this incarnation stops");
                }
                Err(self.persistence_error(error))
            }
        }
    }
}

pub(super) fn state_manifest(type_name: &str) -> String {
    format!("{type_name}#state")
}

/// The manifest of a state saved with its deliveries table (SPEC §13.17):
/// its bytes are the CBOR array `[state, [[producer, epoch, seq], …]]`.
fn state_with_deliveries_manifest(type_name: &str) -> String {
    format!("{type_name}#state+deliveries")
}

fn encode_state<E: DurableState>(ctx: &EntityContext, state: &E::State) -> ShardingResult<Payload> {
    let rows = ctx.delivery_rows();
    let mut bytes = Vec::new();
    let (manifest, encoded) = if rows.is_empty() {
        let encoded = ciborium::into_writer(state, &mut bytes);
        (state_manifest(ctx.type_name), encoded)
    } else {
        let encoded = ciborium::into_writer(&(state, rows), &mut bytes);
        (state_with_deliveries_manifest(ctx.type_name), encoded)
    };
    encoded.map_err(|e| {
        ctx.persistence_error(PersistenceError::Invalid(format!(
            "a state does not encode: {e}"
        )))
    })?;
    Ok(Payload {
        manifest,
        version: E::STATE_VERSION,
        bytes,
    })
}

/// [`encode_state`] of the entity behind `entity` (a `E`).
pub(crate) fn encode_state_of<E: DurableState>(
    entity: &dyn std::any::Any,
    ctx: &EntityContext,
) -> ShardingResult<Payload> {
    let entity = entity
        .downcast_ref::<E>()
        .ok_or_else(|| crate::ShardingError::Bug("a state of another entity type".into()))?;
    encode_state::<E>(ctx, entity.state())
}

/// Loads a durable-state entity's stored state, checked and decoded first.
pub(crate) fn recover_state<E: DurableState>(
    entity: &mut E,
    ctx: &EntityContext,
    recovered: Recovered,
) -> ShardingResult<()> {
    let Some(record) = recovered.state else {
        return Ok(());
    };
    let payload = record.payload;
    let with_deliveries = payload.manifest == state_with_deliveries_manifest(ctx.type_name);
    if payload.manifest != state_manifest(ctx.type_name) && !with_deliveries {
        return Err(corrupt(
            ctx,
            format!("the state is a `{}`", payload.manifest),
        ));
    }
    if payload.version > E::STATE_VERSION {
        return Err(corrupt(
            ctx,
            format!(
                "the state has version {}, above this build's {}",
                payload.version,
                E::STATE_VERSION
            ),
        ));
    }
    let unreadable = |e: Unreadable| {
        corrupt(
            ctx,
            format!(
                "the state (version {}) cannot be read: {e}",
                payload.version
            ),
        )
    };
    if with_deliveries {
        let stored = Stored::paired(payload.version, &payload.bytes);
        let state = E::read_state(stored).map_err(unreadable)?;
        ctx.restore_deliveries(stored.deliveries().map_err(unreadable)?);
        entity.set_state(state);
    } else {
        let stored = Stored::new(payload.version, &payload.bytes);
        entity.set_state(E::read_state(stored).map_err(unreadable)?);
    }
    Ok(())
}
