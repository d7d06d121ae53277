//! Registering an entity type: one builder, [`Registration`], whose type
//! parameters carry what the compiler checks. An event-sourced,
//! durable-state or snapshotted type needs a system built with a journal
//! that is such a store; `remembered()` needs a system built with a
//! remember-entities store; `migratable()` needs an entity whose state can
//! move (SPEC §13.16).
//!
//! ```text
//! system.entity_type::<E>()        Plain, Stays
//!     .event_sourced()             Events     (J: Journal, E: EventSourced)
//!     .durable_state()             State      (J: DurableStateStore, E: DurableState)
//!     .snapshotted()               Snapshots  (J: Journal + SnapshotStore, E: Snapshotted)
//!     .migratable()                Moves      (Plain: E: Migratable; State; Snapshots)
//!     .remembered()                Remembers  (Plain; S: RememberEntitiesStore)
//!     .on_role("r")
//!     .register(factory).await
//! ```
//!
//! How the type keeps its state is chosen first, then whether it moves.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ractor::Actor;

use super::{RegionLink, ShardedSystem, region_protocol};
use crate::entity::{
    DurableState, Entity, EntityContext, EventSourced, JournalWriter, Migratable, Migration,
    Snapshots as SnapshotSettings, Snapshotted, StateEncoder, StateWriter,
};
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::protocol::Protocol;
use crate::persistence::remember::RememberEntitiesStore;
use crate::persistence::remember::writer::Remember;
use crate::persistence::{DurableStateStore, Journal, SnapshotStore};
use crate::runtime::dispatch::Dispatch;
use crate::runtime::entity_actor::{EntityActor, EntityArgs, Factory, Recover, StopNotice};
use crate::runtime::region::{MigrationSettings, Region, RegionCluster, RegionProtocol, Spawner};
use crate::runtime::region_actor::RegionActor;
use crate::sharding::driver::DriverMsg;

/// The type keeps its state in memory only (the default).
#[derive(Debug)]
pub enum Plain {}
/// The type is event-sourced: recovered from the system's journal.
#[derive(Debug)]
pub enum Events {}
/// The type keeps a durable state in the system's store.
#[derive(Debug)]
pub enum State {}
/// The type is event-sourced with snapshots.
#[derive(Debug)]
pub enum Snapshots {}
/// Its entities' state stays where they ran: a moved shard's entities
/// start afresh (or recover from their store) on the new owner.
#[derive(Debug)]
pub enum Stays {}
/// Its entities' state moves with their shard on a graceful move.
#[derive(Debug)]
pub enum Moves {}
/// Its entities are not remembered (the default).
#[derive(Debug)]
pub enum Forgets {}
/// Its entities are remembered: respawned when their shard starts.
#[derive(Debug)]
pub enum Remembers {}

/// The registration of entity type `E` on a [`ShardedSystem<S, J>`]:
/// made by [`ShardedSystem::entity_type`], done by
/// [`register`](Self::register). `K` is how the type keeps its state
/// ([`Plain`], [`Events`], [`State`], [`Snapshots`]), `M` whether that
/// state moves with its shard ([`Stays`], [`Moves`]) and `R` whether its
/// entities are remembered ([`Forgets`], [`Remembers`]); each option
/// exists only where the compiler can prove it is sound.
#[must_use = "nothing is registered until `register` is awaited"]
pub struct Registration<'a, S, J, E, K = Plain, M = Stays, R = Forgets> {
    system: &'a ShardedSystem<S, J>,
    role: Option<String>,
    remember: Option<StartRemember<S, J>>,
    durable: Option<MakeDurable<S, J, E>>,
    migration: Option<Migration<E>>,
    _marks: Marks<K, M, R>,
}

/// The registration's type-state (no value: only the type).
type Marks<K, M, R> = PhantomData<fn() -> (K, M, R)>;

/// Starts (or finds) the system's remember-entities queue.
type StartRemember<S, J> = fn(&ShardedSystem<S, J>) -> ShardingResult<Arc<Remember>>;
/// What each incarnation of a type with a store is given.
type MakeDurable<S, J, E> = fn(&ShardedSystem<S, J>) -> Durable<E>;

impl<S, J, E, K, M, R> std::fmt::Debug for Registration<'_, S, J, E, K, M, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("entity", &std::any::type_name::<E>())
            .field("role", &self.role)
            .field("remembered", &self.remember.is_some())
            .field("durable", &std::any::type_name::<K>())
            .field("migratable", &self.migration.is_some())
            .finish()
    }
}

impl<S, J> ShardedSystem<S, J> {
    /// Begins registering entity type `E`: say how it keeps its state,
    /// whether it moves, is remembered or lives on a role, then
    /// [`register`](Registration::register) it with a factory. The
    /// compiler checks that `E` handles every message of its protocol.
    pub fn entity_type<E>(&self) -> Registration<'_, S, J, E>
    where
        E: Entity,
        E::Protocol: Dispatch<E>,
    {
        Registration {
            system: self,
            role: None,
            remember: None,
            durable: None,
            migration: None,
            _marks: PhantomData,
        }
    }
}

impl<'a, S, J, E: Entity, K, M, R> Registration<'a, S, J, E, K, M, R> {
    fn mark<K2, M2, R2>(self) -> Registration<'a, S, J, E, K2, M2, R2> {
        Registration {
            system: self.system,
            role: self.role,
            remember: self.remember,
            durable: self.durable,
            migration: self.migration,
            _marks: PhantomData,
        }
    }

    /// Hosts the type only on nodes whose cluster configuration has `role`
    /// (`ClusterConfig::roles`); on other nodes its region is proxy-only:
    /// it routes to the hosting nodes and hosts nothing. On a system
    /// without a cluster node the role is ignored and the type is hosted
    /// here. Called twice, the last role counts.
    pub fn on_role(mut self, role: impl Into<String>) -> Self {
        self.role = Some(role.into());
        self
    }

    /// Registers the type: from now on messages to its protocol are routed
    /// to entities built by `factory`. Fails with `AlreadyRegistered` when
    /// the protocol already has a region here, `ShuttingDown` once the
    /// system stops, and `Spawn` when the region's actor (or a remembered
    /// type's write-behind queue) cannot start.
    pub async fn register(
        self,
        factory: impl Fn(&EntityContext) -> E + Send + Sync + 'static,
    ) -> ShardingResult<()>
    where
        E::Protocol: Dispatch<E>,
    {
        let system = self.system;
        if let (Some(role), Some(link)) = (&self.role, &system.shared.cluster)
            && !link.node.config().roles.contains(role.as_str())
        {
            return system.register_proxy::<E::Protocol>().await;
        }
        let remember = self.remember.map(|start| start(system)).transpose()?;
        let durable = self.durable.map(|make| make(system));
        system
            .register_spawned::<E>(Arc::new(factory), remember, durable, self.migration)
            .await
    }
}

impl<'a, S: RememberEntitiesStore, J, E: Entity, M> Registration<'a, S, J, E, Plain, M, Forgets> {
    /// Remembers the type's entities: their ids are recorded in the
    /// system's store when they start, and they are started again when
    /// their shard starts (here after a restart, or on the shard's next
    /// owner). A remembered entity is not passivated when idle nor by the
    /// entity limit (it would be forgotten). For a type that keeps its
    /// state in memory: an entity with a store whose recovery or write
    /// failed is passivated, which would forget it.
    pub fn remembered(mut self) -> Registration<'a, S, J, E, Plain, M, Remembers> {
        self.remember = Some(ShardedSystem::<S, J>::remember);
        self.mark()
    }
}

impl<'a, S, J: Journal, E: EventSourced> Registration<'a, S, J, E, Plain, Stays, Forgets> {
    /// The type is event-sourced: its incarnations recover from the
    /// system's journal before their first message, and its handlers
    /// persist events with [`EventSourced::persist`].
    pub fn event_sourced(mut self) -> Registration<'a, S, J, E, Events, Stays, Forgets> {
        self.durable = Some(event_sourced::<S, J, E>);
        self.mark()
    }
}

impl<'a, S, J: DurableStateStore, E: DurableState>
    Registration<'a, S, J, E, Plain, Stays, Forgets>
{
    /// The type keeps a durable state: its incarnations load their state
    /// from the system's store before their first message, and its
    /// handlers save it with [`DurableState::save_state`].
    pub fn durable_state(mut self) -> Registration<'a, S, J, E, State, Stays, Forgets> {
        self.durable = Some(durable_state::<S, J, E>);
        self.mark()
    }
}

impl<'a, S, J: Journal + SnapshotStore, E: Snapshotted>
    Registration<'a, S, J, E, Plain, Stays, Forgets>
{
    /// The type is event-sourced with snapshots: its incarnations save a
    /// snapshot every `E::SNAPSHOT_EVERY` events (keeping
    /// `E::SNAPSHOTS_KEPT`) and recover from the latest one and the events
    /// after it.
    pub fn snapshotted(mut self) -> Registration<'a, S, J, E, Snapshots, Stays, Forgets> {
        self.durable = Some(snapshotted::<S, J, E>);
        self.mark()
    }
}

impl<'a, S, J, E: Migratable, R> Registration<'a, S, J, E, Plain, Stays, R> {
    /// When a shard moves gracefully (a rebalance, a graceful leave, a
    /// rolling restart) each live entity's state moves with it
    /// ([`Migratable`], SPEC §13.16): the next incarnation, on the new
    /// owner, starts from it before any message. A remembered type's
    /// entities whose state came start from it at once; the others are
    /// started as usual. On a single node there is nowhere to move.
    pub fn migratable(mut self) -> Registration<'a, S, J, E, Plain, Moves, R> {
        self.migration = Some(Migration::of());
        self.mark()
    }
}

impl<'a, S, J, E: DurableState> Registration<'a, S, J, E, State, Stays, Forgets> {
    /// A durable state moves with its shard on a graceful move (SPEC
    /// §13.16): the next incarnation takes it with its revision instead of
    /// loading it, when the store's revision is still that one.
    pub fn migratable(mut self) -> Registration<'a, S, J, E, State, Moves, Forgets> {
        self.migration = Some(Migration::durable_state());
        self.mark()
    }
}

impl<'a, S, J, E: Snapshotted> Registration<'a, S, J, E, Snapshots, Stays, Forgets> {
    /// The state moves with its shard on a graceful move (SPEC §13.16):
    /// the next incarnation starts from it as from a snapshot at its
    /// sequence number, reading only the journal's events after it (none,
    /// when no other writer appended), instead of the latest stored
    /// snapshot and the events after that.
    pub fn migratable(mut self) -> Registration<'a, S, J, E, Snapshots, Moves, Forgets> {
        self.migration = Some(Migration::snapshotted());
        self.mark()
    }
}

/// An event-sourced type's incarnations: the system's journal writer.
fn event_sourced<S, J: Journal, E: EventSourced>(system: &ShardedSystem<S, J>) -> Durable<E> {
    Durable {
        writer: Some(system.journal_writer()),
        snapshots: None,
        state: None,
        recover: crate::entity::recover::<E>,
    }
}

/// A durable-state type's incarnations: the system's store and its writer.
fn durable_state<S, J: DurableStateStore, E: DurableState>(
    system: &ShardedSystem<S, J>,
) -> Durable<E> {
    let store: Arc<dyn DurableStateStore> = system.journal.clone();
    let store = system.shared.state_store.get_or_init(|| store).clone();
    let writer = system
        .shared
        .state_writer
        .get_or_init(|| StateWriter::start(&store))
        .clone();
    Durable {
        writer: None,
        snapshots: None,
        state: Some((
            Arc::downgrade(&store),
            writer,
            crate::entity::encode_state_of::<E>,
        )),
        recover: crate::entity::recover_state::<E>,
    }
}

/// A snapshotted type's incarnations: the journal writer and the snapshot
/// store.
fn snapshotted<S, J: Journal + SnapshotStore, E: Snapshotted>(
    system: &ShardedSystem<S, J>,
) -> Durable<E> {
    let writer = system.journal_writer();
    let store: Arc<dyn SnapshotStore> = system.journal.clone();
    let store = system.shared.snapshot_store.get_or_init(|| store).clone();
    Durable {
        writer: Some(writer),
        snapshots: Some(SnapshotSettings::of::<E>(&store)),
        state: None,
        recover: crate::entity::recover_snapshotted::<E>,
    }
}

impl<S, J: Journal> ShardedSystem<S, J> {
    /// The system's journal writer, started on first use. The system holds
    /// its journal while it lives (an entity ref alone may keep it
    /// running); the writer and the entities hold it weakly.
    fn journal_writer(&self) -> Arc<JournalWriter> {
        let journal: Arc<dyn Journal> = self.journal.clone();
        let journal = self.shared.journal.get_or_init(|| journal).clone();
        self.shared
            .journal_writer
            .get_or_init(|| JournalWriter::start(&journal))
            .clone()
    }
}

impl<S, J> ShardedSystem<S, J> {
    /// Registers protocol `P` proxy-only on this node: its messages are
    /// routed to the nodes that host its entities, and no entity of it ever
    /// runs here (the coordinator gives a proxy-only region no shard). Needs
    /// a system built with a cluster node.
    pub async fn register_proxy<P: Protocol>(&self) -> ShardingResult<()> {
        if self.shared.cluster.is_none() {
            return Err(ShardingError::InvalidConfig(format!(
                "`{}` cannot be proxy-only on a system without a cluster node: nothing would host it",
                P::TYPE_NAME
            )));
        }
        let spawner: Spawner = Box::new(|ctx, _, _, _| {
            Err(ShardingError::Bug(format!(
                "an entity of `{}` was spawned in a proxy-only region",
                ctx.type_name()
            )))
        });
        let kind = RegionKind {
            proxy: true,
            migratable: false,
            durable: false,
        };
        self.install_region(region_protocol::<P>(), spawner, None, kind)
            .await
    }

    /// Registers `E` with what each incarnation is given: the factory, the
    /// store it is remembered in, its durable store, its migration.
    async fn register_spawned<E>(
        &self,
        factory: Factory<E>,
        remember: Option<Arc<Remember>>,
        durable: Option<Durable<E>>,
        migration: Option<Migration<E>>,
    ) -> ShardingResult<()>
    where
        E: Entity,
        E::Protocol: Dispatch<E>,
    {
        let config = &self.shared.config;
        // Akka's rule: remembered entities are not passivated when idle (a
        // passivated id would be forgotten).
        let idle_timeout = if remember.is_some() {
            None
        } else {
            config.passivation_idle_timeout
        };
        let migration = migration.map(|m| (m, self.shared.migration_events.clone()));
        let migratable = migration.is_some();
        let stores = durable.is_some();
        let spawner: Spawner = Box::new(move |mut ctx, incarnation, region, migrated| {
            let recover = durable.as_ref().map(|d| {
                if let Some(writer) = &d.writer {
                    ctx.attach_journal(writer.clone(), d.snapshots.clone());
                }
                if let Some((store, writer, encode)) = &d.state {
                    ctx.attach_state(store.clone(), writer.clone(), *encode);
                }
                d.recover
            });
            let notice = StopNotice {
                region,
                shard: ctx.shard_id(),
                entity_id: ctx.entity_id_arc(),
                incarnation,
                state: None,
            };
            let args = EntityArgs {
                factory: factory.clone(),
                ctx,
                idle_timeout,
                notice,
                recover,
                migration: migration.clone(),
                migrated,
            };
            ractor::ActorRuntime::<EntityActor<E>>::spawn_instant(None, EntityActor::new(), args)
                .map(|(actor, _)| actor)
                .map_err(|e| ShardingError::Spawn(e.to_string()))
        });
        let kind = RegionKind {
            proxy: false,
            migratable,
            durable: stores,
        };
        self.install_region(region_protocol::<E::Protocol>(), spawner, remember, kind)
            .await
    }

    /// Starts a region (and its actor) for `protocol` and makes it visible.
    async fn install_region(
        &self,
        protocol: RegionProtocol,
        spawner: Spawner,
        remember: Option<Arc<Remember>>,
        RegionKind {
            proxy,
            migratable,
            durable,
        }: RegionKind,
    ) -> ShardingResult<()> {
        let type_name = protocol.type_name;
        if self.is_shut_down() || self.shared.leaving.load(Ordering::Acquire) {
            return Err(ShardingError::ShuttingDown);
        }
        if self.regions().contains_key(type_name) {
            return Err(ShardingError::AlreadyRegistered { type_name });
        }
        let config = &self.shared.config;
        let remembers = remember.is_some();
        // A state travels in a chunk of its own at most: the frame's payload
        // less room for the chunk's framing and the entity's id.
        let migration_settings = match &self.shared.cluster {
            Some(link) if migratable => Some(MigrationSettings {
                timeout: config.migration_timeout,
                max_state: link.remote.transport().max_payload().saturating_sub(1_024),
                events: self.shared.migration_events.clone(),
            }),
            _ => None,
        };
        let cluster = self.shared.cluster.as_ref().map(|link| RegionCluster {
            me: link.remote.me(),
            port: Arc::new(RegionLink {
                remote: link.remote.clone(),
                driver: link.driver.clone(),
                history: link.node.history().clone(),
            }),
            proxy,
        });
        let region = Arc::new(
            Region::new(
                protocol,
                config.num_shards,
                config.allocation_buffer,
                spawner,
                remember,
                config.shutdown_timeout,
                cluster,
            )
            // (Akka's rule: remembered entities are not passivated by a limit,
            // which would forget them.)
            .with_entity_limit(config.entity_limit.filter(|_| !remembers))
            .with_migration(migration_settings)
            .with_tracing(config.tracing.clone())
            .with_durable(durable),
        );
        if remembers && config.entity_limit.is_some() {
            tracing::warn!(
                entity_type = type_name,
                "entity_limit ignored: a remembered type is not passivated by a limit"
            );
        }
        // The region actor exists before any sender can see the region, so
        // every allocation request has somewhere to go.
        let (actor, _) = RegionActor::spawn(None, RegionActor, region.clone())
            .await
            .map_err(|e| ShardingError::Spawn(e.to_string()))?;
        let _ = region.region_actor.set(actor.clone());
        {
            let mut regions = self
                .shared
                .regions
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let leaving = self.shared.leaving.load(Ordering::Acquire);
            if self.is_shut_down() || leaving || regions.contains_key(type_name) {
                drop(regions);
                actor.stop(None);
                return Err(if self.is_shut_down() || leaving {
                    ShardingError::ShuttingDown
                } else {
                    ShardingError::AlreadyRegistered { type_name }
                });
            }
            regions.insert(type_name, region.clone());
        }
        if let Some(link) = &self.shared.cluster {
            let _ = link.driver.send(DriverMsg::TypeRegistered);
        }
        if !proxy {
            // (The store's calls block: off the async worker.)
            let reader = region.clone();
            let shards = tokio::task::spawn_blocking(move || reader.remembered_shards())
                .await
                .unwrap_or_default();
            region.start_shards(shards);
        }
        Ok(())
    }
}

/// What kind of region a registration installs.
struct RegionKind {
    /// Hosts nothing here: routes only.
    proxy: bool,
    /// Its entities' state moves with their shard (§13.16).
    migratable: bool,
    /// Its entities keep their state in a store: asks carry their
    /// deadline to the store calls (§8b).
    durable: bool,
}

/// What a type with a store gives each incarnation.
pub(super) struct Durable<E> {
    writer: Option<Arc<JournalWriter>>,
    snapshots: Option<Arc<SnapshotSettings>>,
    state: Option<(
        std::sync::Weak<dyn DurableStateStore>,
        Arc<StateWriter>,
        StateEncoder,
    )>,
    recover: Recover<E>,
}
