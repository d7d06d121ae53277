//! The sharded system: its builder, entity registration and entity refs.
//!
//! ```
//! # use std::time::Duration;
//! # use datum_cluster_sharding::prelude::*;
//! # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
//! # #[derive(Serialize, Deserialize)] pub struct Get;
//! # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
//! # #[derive(Default)] struct CounterEntity { total: u64 }
//! # impl Entity for CounterEntity { type Protocol = Counter; }
//! # impl Handler<Add> for CounterEntity {
//! #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
//! # }
//! # impl Handler<Get> for CounterEntity {
//! #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
//! # }
//! # #[tokio::main] async fn main() -> ShardingResult<()> {
//! let system = ShardedSystem::builder().num_shards(64).start().await?;
//! system.register::<CounterEntity>(|_ctx| CounterEntity::default()).await?;
//! let cart = system.entity_ref::<Counter>("cart-42");
//! cart.tell(Add(3)).await?;
//! assert_eq!(cart.ask(Get, Duration::from_secs(5)).await?, 3);
//! system.shutdown().await;
//! # Ok(()) }
//! ```

use std::any::TypeId;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use ractor::Actor;
use tokio::sync::oneshot;

use crate::config::ShardingConfig;
use crate::entity::{Entity, EntityContext};
use crate::error::{ShardingError, ShardingResult};
use crate::extractor::{ShardExtractor, ShardId};
use crate::private::{Dispatch, LocalEnvelope};
use crate::protocol::{Ask, Protocol, Tell};
use crate::runtime::entity_actor::{EntityActor, EntityArgs, Factory, StopNotice};
use crate::runtime::region::{Region, Spawner};
use crate::runtime::region_actor::RegionActor;
use crate::store::{NoStore, RememberEntitiesStore};

/// A running sharded system on this node. `S` is its remember-entities store
/// ([`NoStore`] when built without one).
///
/// Cheap to clone; clones share the system.
#[derive(Clone)]
pub struct ShardedSystem<S = NoStore> {
    shared: Arc<Shared>,
    store: Arc<S>,
}

struct Shared {
    config: ShardingConfig,
    regions: RwLock<HashMap<&'static str, Arc<Region>>>,
    stopped: AtomicBool,
}

impl Shared {
    fn is_shut_down(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }
}

/// Builds a [`ShardedSystem`]; the store given (if any) becomes part of the system's type.
#[must_use = "a builder does nothing until `start` is awaited"]
#[derive(Debug, Clone)]
pub struct ShardedSystemBuilder<S = NoStore> {
    config: ShardingConfig,
    store: S,
}

impl ShardedSystem<NoStore> {
    /// A builder with the default [`ShardingConfig`] and no store.
    pub fn builder() -> ShardedSystemBuilder<NoStore> {
        ShardedSystemBuilder {
            config: ShardingConfig::default(),
            store: NoStore,
        }
    }
}

impl<S> ShardedSystemBuilder<S> {
    /// Replaces the whole configuration.
    pub fn config(mut self, config: ShardingConfig) -> Self {
        self.config = config;
        self
    }

    /// Sets [`ShardingConfig::num_shards`].
    pub fn num_shards(mut self, num_shards: u32) -> Self {
        self.config.num_shards = num_shards;
        self
    }

    /// Sets [`ShardingConfig::allocation_buffer`].
    pub fn allocation_buffer(mut self, allocation_buffer: usize) -> Self {
        self.config.allocation_buffer = allocation_buffer;
        self
    }

    /// Sets [`ShardingConfig::passivation_idle_timeout`].
    pub fn passivation_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.config.passivation_idle_timeout = timeout;
        self
    }

    /// Uses `store` for remember-entities; enables `register_remembered`.
    pub fn store<T: RememberEntitiesStore>(self, store: T) -> ShardedSystemBuilder<T> {
        ShardedSystemBuilder {
            config: self.config,
            store,
        }
    }

    /// Validates the configuration and starts the system.
    pub async fn start(self) -> ShardingResult<ShardedSystem<S>> {
        self.config.validate()?;
        Ok(ShardedSystem {
            shared: Arc::new(Shared {
                config: self.config,
                regions: RwLock::new(HashMap::new()),
                stopped: AtomicBool::new(false),
            }),
            store: Arc::new(self.store),
        })
    }
}

impl<S> ShardedSystem<S> {
    /// The configuration the system runs with.
    pub fn config(&self) -> &ShardingConfig {
        &self.shared.config
    }

    /// Registers entity type `E`: from now on messages to its protocol are
    /// routed to entities built by `factory`. The compiler checks that `E`
    /// handles every message of its protocol.
    pub async fn register<E>(
        &self,
        factory: impl Fn(&EntityContext) -> E + Send + Sync + 'static,
    ) -> ShardingResult<()>
    where
        E: Entity,
        E::Protocol: Dispatch<E>,
    {
        self.register_with::<E>(Arc::new(factory), None).await
    }

    async fn register_with<E>(
        &self,
        factory: Factory<E>,
        remember: Option<Arc<dyn RememberEntitiesStore>>,
    ) -> ShardingResult<()>
    where
        E: Entity,
        E::Protocol: Dispatch<E>,
    {
        let type_name = <E::Protocol as Protocol>::TYPE_NAME;
        if self.is_shut_down() {
            return Err(ShardingError::ShuttingDown);
        }
        if self.regions().contains_key(type_name) {
            return Err(ShardingError::AlreadyRegistered { type_name });
        }
        let config = &self.shared.config;
        // Akka's rule: remembered entities are not passivated when idle (a
        // passivated id would be forgotten).
        let idle_timeout = if remember.is_some() {
            None
        } else {
            config.passivation_idle_timeout
        };
        let spawner: Spawner = Box::new(move |ctx, incarnation, shard| {
            let notice = StopNotice {
                shard,
                entity_id: ctx.entity_id_arc(),
                incarnation,
            };
            let args = EntityArgs {
                factory: factory.clone(),
                ctx,
                idle_timeout,
                notice,
            };
            ractor::ActorRuntime::<EntityActor<E>>::spawn_instant(None, EntityActor::new(), args)
                .map(|(actor, _)| actor)
                .map_err(|e| ShardingError::Spawn(e.to_string()))
        });
        let region = Arc::new(Region::new(
            type_name,
            TypeId::of::<E::Protocol>(),
            config.num_shards,
            config.allocation_buffer,
            spawner,
            remember,
            config.shutdown_timeout,
        ));
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
            if self.is_shut_down() || regions.contains_key(type_name) {
                drop(regions);
                actor.stop(None);
                return Err(if self.is_shut_down() {
                    ShardingError::ShuttingDown
                } else {
                    ShardingError::AlreadyRegistered { type_name }
                });
            }
            regions.insert(type_name, region.clone());
        }
        region.start_remembered_shards();
        Ok(())
    }

    /// A reference to entity `entity_id` of protocol `P`. Cheap; no message is sent.
    pub fn entity_ref<P: Protocol>(&self, entity_id: impl Into<Arc<str>>) -> EntityRef<P> {
        let entity_id = entity_id.into();
        let shard = P::Extractor::default().shard_id(&entity_id, self.shared.config.num_shards);
        EntityRef {
            shared: self.shared.clone(),
            region: OnceLock::new(),
            entity_id,
            shard,
            _protocol: PhantomData,
        }
    }

    /// Stops every entity, fails buffered and pending messages with
    /// [`ShardingError::ShuttingDown`], and waits for the actors to stop.
    pub async fn shutdown(&self) {
        self.shared.stopped.store(true, Ordering::Release);
        let regions: Vec<Arc<Region>> = self.regions().values().cloned().collect();
        futures_util::future::join_all(regions.iter().map(|r| r.shutdown())).await;
    }

    /// Whether `shutdown` has been called.
    pub fn is_shut_down(&self) -> bool {
        self.shared.is_shut_down()
    }

    fn regions(&self) -> std::sync::RwLockReadGuard<'_, HashMap<&'static str, Arc<Region>>> {
        self.shared
            .regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// How many entities of protocol `P` are live in `shard` on this node.
    pub fn live_entities<P: Protocol>(&self, shard: ShardId) -> usize {
        match self.regions().get(P::TYPE_NAME) {
            Some(region) if shard.0 < region.num_shards() => region.live_entities(shard),
            _ => 0,
        }
    }
}

impl<S: RememberEntitiesStore> ShardedSystem<S> {
    /// Registers `E` as a remembered entity type: its started entity ids are
    /// recorded in the system's store and respawned when their shard starts.
    pub async fn register_remembered<E>(
        &self,
        factory: impl Fn(&EntityContext) -> E + Send + Sync + 'static,
    ) -> ShardingResult<()>
    where
        E: Entity,
        E::Protocol: Dispatch<E>,
    {
        let store: Arc<dyn RememberEntitiesStore> = self.store.clone();
        self.register_with::<E>(Arc::new(factory), Some(store))
            .await
    }

    /// The system's store.
    pub fn store(&self) -> &S {
        &self.store
    }
}

/// A reference to one entity of protocol `P`: send it tells and asks.
///
/// Cheap to clone. Messages from one sender that awaits each call on the same
/// ref are processed in send order.
pub struct EntityRef<P: Protocol> {
    shared: Arc<Shared>,
    region: OnceLock<Arc<Region>>,
    entity_id: Arc<str>,
    shard: ShardId,
    _protocol: PhantomData<fn() -> P>,
}

impl<P: Protocol> Clone for EntityRef<P> {
    fn clone(&self) -> Self {
        EntityRef {
            shared: self.shared.clone(),
            region: self.region.clone(),
            entity_id: self.entity_id.clone(),
            shard: self.shard,
            _protocol: PhantomData,
        }
    }
}

impl<P: Protocol> std::fmt::Debug for EntityRef<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EntityRef")
            .field("type_name", &P::TYPE_NAME)
            .field("entity_id", &self.entity_id)
            .field("shard", &self.shard)
            .finish()
    }
}

impl<P: Protocol> EntityRef<P> {
    /// The entity's id.
    pub fn entity_id(&self) -> &str {
        &self.entity_id
    }

    /// The entity's shard, as the protocol's extractor computed it.
    pub fn shard_id(&self) -> ShardId {
        self.shard
    }

    fn region(&self) -> ShardingResult<&Arc<Region>> {
        if let Some(region) = self.region.get() {
            return Ok(region);
        }
        if self.shared.is_shut_down() {
            return Err(ShardingError::ShuttingDown);
        }
        let region = {
            let regions = self
                .shared
                .regions
                .read()
                .unwrap_or_else(|p| p.into_inner());
            match regions.get(P::TYPE_NAME) {
                Some(region) if region.protocol == TypeId::of::<P>() => region.clone(),
                _ => {
                    return Err(ShardingError::NotRegistered {
                        type_name: P::TYPE_NAME,
                    });
                }
            }
        };
        if self.shard.0 >= region.num_shards() {
            return Err(ShardingError::InvalidShard {
                entity_id: self.entity_id.to_string(),
                shard_id: self.shard,
                num_shards: region.num_shards(),
            });
        }
        Ok(self.region.get_or_init(|| region))
    }

    fn live_region(&self) -> ShardingResult<&Arc<Region>> {
        let region = self.region()?;
        if region.is_stopped() {
            Err(ShardingError::ShuttingDown)
        } else {
            Ok(region)
        }
    }

    /// Sends a tell message. Returns once the message is accepted (enqueued or
    /// buffered), not when it is processed.
    pub async fn tell<M: Tell<P>>(&self, msg: M) -> ShardingResult<()> {
        let region = self.live_region()?;
        region.deliver(
            self.shard,
            &self.entity_id,
            LocalEnvelope::new::<P, M>(msg, None),
        )
    }

    /// Sends an ask message and waits up to `timeout` for its reply.
    ///
    /// On [`ShardingError::AskTimeout`] the message may still be processed.
    pub async fn ask<M: Ask<P>>(&self, msg: M, timeout: Duration) -> ShardingResult<M::Reply> {
        let region = self.live_region()?;
        let (reply, replied) = oneshot::channel();
        region.deliver(
            self.shard,
            &self.entity_id,
            LocalEnvelope::new::<P, M>(msg, Some(reply)),
        )?;
        match tokio::time::timeout(timeout, replied).await {
            Ok(Ok(result)) => result,
            Ok(Err(_closed)) if region.is_stopped() => Err(ShardingError::ShuttingDown),
            Ok(Err(_closed)) => Err(ShardingError::EntityStopped {
                type_name: P::TYPE_NAME,
                entity_id: self.entity_id.to_string(),
            }),
            Err(_elapsed) => Err(ShardingError::AskTimeout {
                type_name: P::TYPE_NAME,
                entity_id: self.entity_id.to_string(),
                timeout,
            }),
        }
    }

    /// Passivates the entity now: messages already sent to it are still
    /// handled by the current incarnation; messages sent after this returns
    /// go to a fresh one. Does nothing if the entity is not live.
    pub async fn passivate(&self) -> ShardingResult<()> {
        let region = self.live_region()?;
        region.passivate(self.shard, &self.entity_id, None)
    }
}
