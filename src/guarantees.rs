//! What the compiler rejects, each proven by a compile-fail test.
//!
//! Every section below holds a program that must not compile, with the error
//! code rustdoc checks (`compile_fail,E0277`), and its twin that differs only
//! in the mistake and compiles. `cargo test --doc` runs all of them. The error
//! text quoted is what rustc 1.95 prints; it was checked by hand.

/// The guarantees of the typed façade.
///
/// ## Telling an ask message
///
/// `EntityRef::tell` takes only `Tell<P>` messages; `Get` is an ask. Error: ``the trait bound `Get: Tell<Counter>` is not satisfied``.
///
/// Rejected (`E0277`):
///
/// ```compile_fail,E0277
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_ref::<Counter>("cart-42").tell(Get).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_ref::<Counter>("cart-42").tell(Add(1)).await
/// }
/// ```
///
/// ## Asking a tell message
///
/// `EntityRef::ask` takes only `Ask<P>` messages; `Add` is a tell. Error: ``the trait bound `Add: Ask<Counter>` is not satisfied``.
///
/// Rejected (`E0277`):
///
/// ```compile_fail,E0277
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_ref::<Counter>("cart-42").ask(Add(1), Duration::from_secs(1)).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo(system: ShardedSystem) -> ShardingResult<u64> {
///     system.entity_ref::<Counter>("cart-42").ask(Get, Duration::from_secs(1)).await
/// }
/// ```
///
/// ## Expecting the wrong reply type
///
/// An ask returns its message's `Reply`, declared in the protocol (`ask Get -> u64`). Error: ``E0308: `?` operator has incompatible types`` (expected `String`, found `u64`).
///
/// Rejected (`E0308`):
///
/// ```compile_fail,E0308
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     let total: String = system.entity_ref::<Counter>("cart-42").ask(Get, Duration::from_secs(1)).await?;
///     Ok(())
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     let total: u64 = system.entity_ref::<Counter>("cart-42").ask(Get, Duration::from_secs(1)).await?;
///     Ok(())
/// }
/// ```
///
/// ## Sending a message of another protocol
///
/// An `EntityRef<Counter>` takes only `Counter`'s messages. Error: ``the trait bound `Ping: Tell<Counter>` is not satisfied``.
///
/// Rejected (`E0277`):
///
/// ```compile_fail,E0277
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// # #[derive(Serialize, Deserialize)] pub struct Ping;
/// # protocol! { pub protocol Pinger = "pinger" { tell Ping; } }
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_ref::<Counter>("cart-42").tell(Ping).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// # #[derive(Serialize, Deserialize)] pub struct Ping;
/// # protocol! { pub protocol Pinger = "pinger" { tell Ping; } }
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_ref::<Pinger>("cart-42").tell(Ping).await
/// }
/// ```
///
/// ## Registering an entity that lacks a handler
///
/// Registration requires the protocol to dispatch to the entity, which holds only when it handles every message. Error: ``the trait bound `HalfCounter: Handler<Get>` is not satisfied``.
///
/// Rejected (`E0277`):
///
/// ```compile_fail,E0277
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// struct HalfCounter;
/// impl Entity for HalfCounter { type Protocol = Counter; }
/// impl Handler<Add> for HalfCounter {
///     async fn handle(&mut self, _: Add, _: &EntityContext) -> ShardingResult<()> { Ok(()) }
/// }
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_type::<HalfCounter>().register(|_| HalfCounter).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_type::<CounterEntity>().register(|_| CounterEntity::default()).await
/// }
/// ```
///
/// ## Answering a `defer` line without a `ReplyPort`
///
/// A `defer` line is answered through a [`ReplyPort`](crate::ReplyPort), so the entity must implement `DeferredHandler` for it; a plain `Handler` does not count. Error: ``the trait bound `Waiter: DeferredHandler<Slow>` is not satisfied``.
///
/// Rejected (`E0277`):
///
/// ```compile_fail,E0277
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Slow;
/// # protocol! { pub protocol Later = "later" { defer Slow -> u64; } }
/// # fn main() {}
/// struct Waiter;
/// impl Entity for Waiter { type Protocol = Later; }
/// impl Handler<Slow> for Waiter {
///     async fn handle(&mut self, _: Slow, _: &EntityContext) -> ShardingResult<u64> { Ok(1) }
/// }
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_type::<Waiter>().register(|_| Waiter).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Slow;
/// # protocol! { pub protocol Later = "later" { defer Slow -> u64; } }
/// # fn main() {}
/// struct Waiter;
/// impl Entity for Waiter { type Protocol = Later; }
/// impl DeferredHandler<Slow> for Waiter {
///     async fn handle(&mut self, _: Slow, reply: ReplyPort<u64>, _: &EntityContext) -> ShardingResult<()> {
///         reply.send(1);
///         Ok(())
///     }
/// }
/// async fn demo(system: ShardedSystem) -> ShardingResult<()> {
///     system.entity_type::<Waiter>().register(|_| Waiter).await
/// }
/// ```
///
/// ## Implementing `Tell` or `Ask` by hand
///
/// The family is sealed by hidden supertraits that only `protocol!` implements: making the tell `Add` an ask by hand is refused. Error: ``the trait bound `Add: SealedAsk<Counter>` is not satisfied``. (Code that names the hidden `__private` module can still forge the seal; see `SPEC.md`.)
///
/// Rejected (`E0277`):
///
/// ```compile_fail,E0277
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// impl Ask<Counter> for Add {}
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// fn is_ask<M: Ask<Counter>>() {}
/// fn check() { is_ask::<Get>() }
/// ```
///
/// ## Registering a remembered entity type without a store
///
/// `Registration::remembered` exists only on a registration of a `ShardedSystem<S>` whose `S` is a `RememberEntitiesStore`; a system built without `.store(..)` is a `ShardedSystem<NoStore>`. Error: ``the method `remembered` exists for struct `Registration<'_, NoStore, NoJournal, CounterEntity>`, but its trait bounds were not satisfied``.
///
/// Rejected (`E0599`):
///
/// ```compile_fail,E0599
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let system = ShardedSystem::builder().start().await?;
///     system.entity_type::<CounterEntity>().remembered().register(|_| CounterEntity::default()).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use std::time::Duration;
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let system = ShardedSystem::builder().store(InMemoryStore::new()).start().await?;
///     system.entity_type::<CounterEntity>().remembered().register(|_| CounterEntity::default()).await
/// }
/// ```
///
/// ## Registering an event-sourced entity type without a journal
///
/// `Registration::event_sourced` exists only on a registration of a `ShardedSystem<S, J>` whose `J` is a `Journal`; a system built without `.journal(..)` is a `ShardedSystem<_, NoJournal>`. Error: ``the method `event_sourced` exists for struct `Registration<'_, NoStore, NoJournal, TallyEntity>`, but its trait bounds were not satisfied``.
///
/// Rejected (`E0599`):
///
/// ```compile_fail,E0599
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Tally = "tally" { ask Add -> u64; } }
/// # #[derive(Serialize, Deserialize)] pub struct Added(pub u64);
/// # #[derive(Default)] pub struct TallyEntity { total: u64 }
/// # impl Entity for TallyEntity { type Protocol = Tally; }
/// # impl EventSourced for TallyEntity {
/// #     type Event = Added;
/// #     fn apply(&mut self, e: &Added) { self.total += e.0 }
/// # }
/// # impl Handler<Add> for TallyEntity {
/// #     async fn handle(&mut self, m: Add, ctx: &EntityContext) -> ShardingResult<u64> {
/// #         self.persist(ctx, Added(m.0)).await?; Ok(self.total)
/// #     }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let system = ShardedSystem::builder().start().await?;
///     system.entity_type::<TallyEntity>().event_sourced().register(|_| TallyEntity::default()).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Tally = "tally" { ask Add -> u64; } }
/// # #[derive(Serialize, Deserialize)] pub struct Added(pub u64);
/// # #[derive(Default)] pub struct TallyEntity { total: u64 }
/// # impl Entity for TallyEntity { type Protocol = Tally; }
/// # impl EventSourced for TallyEntity {
/// #     type Event = Added;
/// #     fn apply(&mut self, e: &Added) { self.total += e.0 }
/// # }
/// # impl Handler<Add> for TallyEntity {
/// #     async fn handle(&mut self, m: Add, ctx: &EntityContext) -> ShardingResult<u64> {
/// #         self.persist(ctx, Added(m.0)).await?; Ok(self.total)
/// #     }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let journal = datum_cluster_sharding::persistence::InMemoryPersistence::new();
///     let system = ShardedSystem::builder().journal(journal).start().await?;
///     system.entity_type::<TallyEntity>().event_sourced().register(|_| TallyEntity::default()).await
/// }
/// ```
///
/// ## Moving the state of an entity that cannot give it
///
/// `Registration::migratable` on an in-memory type exists only when the entity is [`Migratable`](crate::Migratable): it must say how its state leaves and comes back. Error: ``the method `migratable` exists for struct `Registration<'_, NoStore, NoJournal, CounterEntity>`, but its trait bounds were not satisfied``.
///
/// Rejected (`E0599`):
///
/// ```compile_fail,E0599
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let system = ShardedSystem::builder().start().await?;
///     system.entity_type::<CounterEntity>().migratable().register(|_| CounterEntity::default()).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// # impl Handler<Get> for CounterEntity {
/// #     async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> { Ok(self.total) }
/// # }
/// impl Migratable for CounterEntity {
///     type Dehydrated = u64;
///     fn dehydrate(&mut self) -> u64 { self.total }
///     fn rehydrate(&mut self, total: u64) { self.total = total; }
/// }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let system = ShardedSystem::builder().start().await?;
///     system.entity_type::<CounterEntity>().migratable().register(|_| CounterEntity::default()).await
/// }
/// ```
///
/// ## Registering a durable-state entity type without a state store
///
/// `Registration::durable_state` exists only on a registration of a `ShardedSystem<S, J>` whose `J` is a `DurableStateStore`; a system built without `.journal(..)` is a `ShardedSystem<_, NoJournal>`. Error: ``the method `durable_state` exists for struct `Registration<'_, NoStore, NoJournal, Locker>`, but its trait bounds were not satisfied``.
///
/// Rejected (`E0599`):
///
/// ```compile_fail,E0599
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Put(pub u64);
/// # protocol! { pub protocol Lockers = "locker" { ask Put -> u64; } }
/// # #[derive(Default)] pub struct Locker { value: u64 }
/// # impl Entity for Locker { type Protocol = Lockers; }
/// # impl DurableState for Locker {
/// #     type State = u64;
/// #     fn state(&self) -> &u64 { &self.value }
/// #     fn set_state(&mut self, value: u64) { self.value = value }
/// # }
/// # impl Handler<Put> for Locker {
/// #     async fn handle(&mut self, m: Put, ctx: &EntityContext) -> ShardingResult<u64> {
/// #         self.value = m.0; self.save_state(ctx).await?; Ok(self.value)
/// #     }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let system = ShardedSystem::builder().start().await?;
///     system.entity_type::<Locker>().durable_state().register(|_| Locker::default()).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Put(pub u64);
/// # protocol! { pub protocol Lockers = "locker" { ask Put -> u64; } }
/// # #[derive(Default)] pub struct Locker { value: u64 }
/// # impl Entity for Locker { type Protocol = Lockers; }
/// # impl DurableState for Locker {
/// #     type State = u64;
/// #     fn state(&self) -> &u64 { &self.value }
/// #     fn set_state(&mut self, value: u64) { self.value = value }
/// # }
/// # impl Handler<Put> for Locker {
/// #     async fn handle(&mut self, m: Put, ctx: &EntityContext) -> ShardingResult<u64> {
/// #         self.value = m.0; self.save_state(ctx).await?; Ok(self.value)
/// #     }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let journal = datum_cluster_sharding::persistence::InMemoryPersistence::new();
///     let system = ShardedSystem::builder().journal(journal).start().await?;
///     system.entity_type::<Locker>().durable_state().register(|_| Locker::default()).await
/// }
/// ```
///
/// ## Remembering an entity type that keeps its state in a store
///
/// `Registration::remembered` exists only for a type that keeps its state in memory: an event-sourced, snapshotted or durable-state entity whose recovery or write failed is passivated, which would forget a remembered one. Error: ``the method `remembered` exists for struct `Registration<'_, InMemoryStore, InMemoryPersistence, TallyEntity, Events>`, but its trait bounds were not satisfied``.
///
/// Rejected (`E0599`):
///
/// ```compile_fail,E0599
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Tally = "tally" { ask Add -> u64; } }
/// # #[derive(Serialize, Deserialize)] pub struct Added(pub u64);
/// # #[derive(Default)] pub struct TallyEntity { total: u64 }
/// # impl Entity for TallyEntity { type Protocol = Tally; }
/// # impl EventSourced for TallyEntity {
/// #     type Event = Added;
/// #     fn apply(&mut self, e: &Added) { self.total += e.0 }
/// # }
/// # impl Handler<Add> for TallyEntity {
/// #     async fn handle(&mut self, m: Add, ctx: &EntityContext) -> ShardingResult<u64> {
/// #         self.persist(ctx, Added(m.0)).await?; Ok(self.total)
/// #     }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let journal = datum_cluster_sharding::persistence::InMemoryPersistence::new();
///     let system = ShardedSystem::builder().store(InMemoryStore::new()).journal(journal).start().await?;
///     system.entity_type::<TallyEntity>().event_sourced().remembered().register(|_| TallyEntity::default()).await
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Tally = "tally" { ask Add -> u64; } }
/// # #[derive(Serialize, Deserialize)] pub struct Added(pub u64);
/// # #[derive(Default)] pub struct TallyEntity { total: u64 }
/// # impl Entity for TallyEntity { type Protocol = Tally; }
/// # impl EventSourced for TallyEntity {
/// #     type Event = Added;
/// #     fn apply(&mut self, e: &Added) { self.total += e.0 }
/// # }
/// # impl Handler<Add> for TallyEntity {
/// #     async fn handle(&mut self, m: Add, ctx: &EntityContext) -> ShardingResult<u64> {
/// #         self.persist(ctx, Added(m.0)).await?; Ok(self.total)
/// #     }
/// # }
/// # fn main() {}
/// async fn demo() -> ShardingResult<()> {
///     let journal = datum_cluster_sharding::persistence::InMemoryPersistence::new();
///     let system = ShardedSystem::builder().store(InMemoryStore::new()).journal(journal).start().await?;
///     system.entity_type::<TallyEntity>().event_sourced().register(|_| TallyEntity::default()).await
/// }
/// ```
///
/// ## Persisting an event of another entity type
///
/// `EventSourced::persist` takes only the entity's own `Event`. Error: `mismatched types: expected Added, found Reset`.
///
/// Rejected (`E0308`):
///
/// ```compile_fail,E0308
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Tally = "tally" { ask Add -> u64; } }
/// # #[derive(Serialize, Deserialize)] pub struct Added(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Reset;
/// # #[derive(Default)] pub struct TallyEntity { total: u64 }
/// # impl Entity for TallyEntity { type Protocol = Tally; }
/// # impl EventSourced for TallyEntity {
/// #     type Event = Added;
/// #     fn apply(&mut self, e: &Added) { self.total += e.0 }
/// # }
/// # fn main() {}
/// impl Handler<Add> for TallyEntity {
///     async fn handle(&mut self, m: Add, ctx: &EntityContext) -> ShardingResult<u64> {
///         self.persist(ctx, Reset).await?; // another type's event
///         Ok(self.total)
///     }
/// }
/// ```
///
/// Its twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Tally = "tally" { ask Add -> u64; } }
/// # #[derive(Serialize, Deserialize)] pub struct Added(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Reset;
/// # #[derive(Default)] pub struct TallyEntity { total: u64 }
/// # impl Entity for TallyEntity { type Protocol = Tally; }
/// # impl EventSourced for TallyEntity {
/// #     type Event = Added;
/// #     fn apply(&mut self, e: &Added) { self.total += e.0 }
/// # }
/// # fn main() {}
/// impl Handler<Add> for TallyEntity {
///     async fn handle(&mut self, m: Add, ctx: &EntityContext) -> ShardingResult<u64> {
///         self.persist(ctx, Added(m.0)).await?;
///         Ok(self.total)
///     }
/// }
/// ```
///
/// ## Malformed protocol lines
///
/// A tell has no reply, an ask needs one, and a message type appears once per
/// protocol. Errors: `a tell message has no reply` and `an ask message needs
/// its reply type` (the macro's own `compile_error!`), and E0119
/// (conflicting implementations) for a type listed twice.
///
/// ```compile_fail
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// protocol! { pub protocol Bad = "bad" { tell Add -> u64; } }
/// # fn main() {}
/// ```
///
/// ```compile_fail
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// protocol! { pub protocol Bad = "bad" { ask Get; } }
/// # fn main() {}
/// ```
///
/// ```compile_fail,E0119
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// protocol! { pub protocol Bad = "bad" { tell Add; tell Add; } }
/// # fn main() {}
/// ```
///
/// Their twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// protocol! { pub protocol Good = "good" { tell Add; ask Get -> u64; } }
/// # fn main() {}
/// ```
///
/// ## Calling the macro's internal arms
///
/// `protocol!` has one public arm; its internal steps live in the hidden
/// `__protocol_impl!`. A caller cannot reach them through `protocol!` to
/// forge messages of a protocol declared normally (here: make `Stray` a tell
/// and `Peek` an ask of `Counter` without them being in its protocol, so
/// without a decoder, fingerprint line or `Dispatch` arm). Error: ``no rules
/// expected `@` `` (a macro error, which has no code). Code that
/// names `__protocol_impl!` itself can still forge; see `SPEC.md`.
///
/// ```compile_fail
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// #[derive(Serialize, Deserialize)] pub struct Stray;
/// #[derive(Serialize, Deserialize)] pub struct Peek;
/// datum_cluster_sharding::protocol!(@messages Counter, 0u16, tell Stray; ask Peek -> String;);
/// # fn main() {}
/// ```
///
/// Its twin, which compiles: the same messages, declared in a protocol.
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// protocol! { pub protocol Counter = "counter" { tell Add; ask Get -> u64; } }
/// #[derive(Serialize, Deserialize)] pub struct Stray;
/// #[derive(Serialize, Deserialize)] pub struct Peek;
/// protocol! { pub protocol Other = "other" { tell Stray; ask Peek -> String; } }
/// # fn main() {}
/// ```
///
/// ## A wire name that is empty or malformed
///
/// A protocol's wire name must be 1 to 64 characters of `A-Z a-z 0-9 . _ -`,
/// checked at compile time by a constant assertion. Error: E0080,
/// ``evaluation panicked: a protocol's wire name must be 1 to 64 characters
/// of A-Z, a-z, 0-9, `.`, `_` and `-` `` (rustc 1.95's wording for a failed
/// constant evaluation).
///
/// Rejected (`E0080`), empty:
///
/// ```compile_fail,E0080
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// protocol! { pub protocol Bad = "" { tell Add; } }
/// # fn main() {}
/// ```
///
/// Rejected (`E0080`), a space:
///
/// ```compile_fail,E0080
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// protocol! { pub protocol Bad = "has space" { tell Add; } }
/// # fn main() {}
/// ```
///
/// Their twin, which compiles:
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// protocol! { pub protocol Good = "has-no.space_1" { tell Add; } }
/// # fn main() {}
/// ```
///
/// ## A protocol version that does not extend the one it replaces
///
/// Two versions of a protocol run side by side in a rolling upgrade only
/// when the newer one appends lines and changes none (SPEC §13.6).
/// `extends::<New, Old>()` checks that at compile time. Error: E0080,
/// ``evaluation panicked: assertion failed: extends::<CounterV2, CounterV1>()``.
///
/// Rejected (`E0080`), a version that reorders two lines:
///
/// ```compile_fail,E0080
/// # use datum_cluster_sharding::prelude::*;
/// # use datum_cluster_sharding::extends;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # #[derive(Serialize, Deserialize)] pub struct Reset;
/// protocol! { pub protocol CounterV1 = "counter" { tell Add; ask Get -> u64; } }
/// protocol! { pub protocol CounterV2 = "counter" { ask Get -> u64; tell Add; ask Reset -> u64; } }
/// const _: () = assert!(extends::<CounterV2, CounterV1>());
/// # fn main() {}
/// ```
///
/// Its twin, which compiles: the new line appended at the end.
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # use datum_cluster_sharding::extends;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # #[derive(Serialize, Deserialize)] pub struct Get;
/// # #[derive(Serialize, Deserialize)] pub struct Reset;
/// protocol! { pub protocol CounterV1 = "counter" { tell Add; ask Get -> u64; } }
/// protocol! { pub protocol CounterV2 = "counter" { tell Add; ask Get -> u64; ask Reset -> u64; } }
/// const _: () = assert!(extends::<CounterV2, CounterV1>());
/// # fn main() {}
/// ```
///
/// ## A migratable entity whose state is not serde
///
/// A [`Migratable`](crate::Migratable) entity's `Dehydrated` state crosses
/// the wire when its shard moves, so it must be `Serialize` and
/// `DeserializeOwned`. Errors: ``the trait bound `Unserializable:
/// serde::Serialize` is not satisfied`` (and the same for
/// `serde::Deserialize<'de>`).
///
/// Rejected (`E0277`):
///
/// ```compile_fail,E0277
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Counter = "counter" { tell Add; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// pub struct Unserializable(u64);
/// impl Migratable for CounterEntity {
///     type Dehydrated = Unserializable;
///     fn dehydrate(&mut self) -> Unserializable { Unserializable(self.total) }
///     fn rehydrate(&mut self, state: Unserializable) { self.total = state.0; }
/// }
/// # fn main() {}
/// ```
///
/// Its twin, which compiles: the same state, deriving serde's traits.
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Counter = "counter" { tell Add; } }
/// # #[derive(Default)] pub struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, _: &EntityContext) -> ShardingResult<()> { self.total += m.0; Ok(()) }
/// # }
/// #[derive(Serialize, Deserialize)]
/// pub struct Unserializable(u64);
/// impl Migratable for CounterEntity {
///     type Dehydrated = Unserializable;
///     fn dehydrate(&mut self) -> Unserializable { Unserializable(self.total) }
///     fn rehydrate(&mut self, state: Unserializable) { self.total = state.0; }
/// }
/// # fn main() {}
/// ```
pub enum Guarantees {}
