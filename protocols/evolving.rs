//! Two builds of two durable counter types, for the stores' upcasting
//! tests (included with `#[path]`): version 1, and version 2, whose
//! protocol extends version 1's with `Reset` and whose event, snapshot and
//! state have new shapes, read from version 1's by upcasters. The
//! journaled counter is snapshotted; the other keeps a durable state.

#![allow(dead_code)] // each test file uses the builds it needs

use std::time::Duration;

use datum_cluster_sharding::extends;
use datum_cluster_sharding::persistence::{
    DurableStateStore, Journal, PersistenceError, SnapshotStore,
};
use datum_cluster_sharding::prelude::*;

/// Adds to a counter; answered with the new total.
#[derive(Debug, Serialize, Deserialize)]
pub struct Add(pub u64);
/// Reads a counter.
#[derive(Debug, Serialize, Deserialize)]
pub struct Get;
/// Sets a counter back to 0 (version 2 only); answered with the number of
/// resets so far.
#[derive(Debug, Serialize, Deserialize)]
pub struct Reset;

protocol! {
    /// The journaled counter, version 1.
    pub protocol JournaledV1 = "evolving-journaled" {
        ask Add -> u64;
        ask Get -> u64;
    }
}

protocol! {
    /// The journaled counter, version 2: version 1 and `Reset`.
    pub protocol JournaledV2 = "evolving-journaled" {
        ask Add -> u64;
        ask Get -> u64;
        ask Reset -> u64;
    }
}

protocol! {
    /// The durable-state counter, version 1.
    pub protocol StateV1 = "evolving-state" {
        ask Add -> u64;
        ask Get -> u64;
    }
}

protocol! {
    /// The durable-state counter, version 2: version 1 and `Reset`.
    pub protocol StateV2 = "evolving-state" {
        ask Add -> u64;
        ask Get -> u64;
        ask Reset -> u64;
    }
}

const _: () = assert!(extends::<JournaledV2, JournaledV1>());
const _: () = assert!(extends::<StateV2, StateV1>());

/// Version 2's event.
#[derive(Debug, Serialize, Deserialize)]
pub enum Change {
    Added { by: u64 },
    Reset,
}

/// Version 2's snapshot and state; version 1's were the bare total.
#[derive(Debug, Default, Clone, Serialize, Deserialize)]
pub struct Totals {
    pub total: u64,
    pub resets: u64,
}

impl From<u64> for Totals {
    fn from(total: u64) -> Totals {
        Totals { total, resets: 0 }
    }
}

/// Version 1 of the journaled counter: its event is the amount added, its
/// snapshot the total.
#[derive(Default)]
pub struct JournaledCounterV1 {
    total: u64,
}

impl Entity for JournaledCounterV1 {
    type Protocol = JournaledV1;
}

impl EventSourced for JournaledCounterV1 {
    type Event = u64;
    fn apply(&mut self, by: &u64) {
        self.total += by;
    }
}

impl Snapshotted for JournaledCounterV1 {
    type Snapshot = u64;
    const SNAPSHOT_EVERY: u64 = 4;
    fn snapshot(&self) -> u64 {
        self.total
    }
    fn restore(&mut self, total: u64) {
        self.total = total;
    }
}

impl Handler<Add> for JournaledCounterV1 {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, msg.0).await?;
        Ok(self.total)
    }
}

impl Handler<Get> for JournaledCounterV1 {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

/// Version 2 of the journaled counter: events are `Change`s, snapshots
/// `Totals`, and version 1's are read by its upcasters.
#[derive(Default)]
pub struct JournaledCounterV2 {
    totals: Totals,
}

impl Entity for JournaledCounterV2 {
    type Protocol = JournaledV2;
}

impl EventSourced for JournaledCounterV2 {
    type Event = Change;
    const EVENT_VERSION: u32 = 2;
    fn apply(&mut self, change: &Change) {
        match change {
            Change::Added { by } => self.totals.total += by,
            Change::Reset => {
                self.totals.total = 0;
                self.totals.resets += 1;
            }
        }
    }
    fn read_event(stored: Stored<'_>) -> Result<Change, Unreadable> {
        match stored.version() {
            1 => stored.decode::<u64>().map(|by| Change::Added { by }),
            _ => stored.decode(),
        }
    }
}

impl Snapshotted for JournaledCounterV2 {
    type Snapshot = Totals;
    // (Not after events 11 and 12, which version 2 writes after version
    // 1's snapshot at 8: its first recovery reads a mixed journal.)
    const SNAPSHOT_EVERY: u64 = 5;
    const SNAPSHOT_VERSION: u32 = 2;
    fn snapshot(&self) -> Totals {
        self.totals.clone()
    }
    fn restore(&mut self, totals: Totals) {
        self.totals = totals;
    }
    fn read_snapshot(stored: Stored<'_>) -> Result<Totals, Unreadable> {
        match stored.version() {
            1 => stored.decode::<u64>().map(Totals::from),
            _ => stored.decode(),
        }
    }
}

impl Handler<Add> for JournaledCounterV2 {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, Change::Added { by: msg.0 }).await?;
        Ok(self.totals.total)
    }
}

impl Handler<Get> for JournaledCounterV2 {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.totals.total)
    }
}

impl Handler<Reset> for JournaledCounterV2 {
    async fn handle(&mut self, _: Reset, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, Change::Reset).await?;
        Ok(self.totals.resets)
    }
}

/// Version 1 of the durable-state counter: its state is the total.
#[derive(Default)]
pub struct StateCounterV1 {
    total: u64,
}

impl Entity for StateCounterV1 {
    type Protocol = StateV1;
}

impl DurableState for StateCounterV1 {
    type State = u64;
    fn state(&self) -> &u64 {
        &self.total
    }
    fn set_state(&mut self, total: u64) {
        self.total = total;
    }
}

impl Handler<Add> for StateCounterV1 {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.total += msg.0;
        self.save_state(ctx).await?;
        Ok(self.total)
    }
}

impl Handler<Get> for StateCounterV1 {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

/// Version 2 of the durable-state counter: its state is `Totals`, and a
/// version 1 state is read by its upcaster.
#[derive(Default)]
pub struct StateCounterV2 {
    totals: Totals,
}

impl Entity for StateCounterV2 {
    type Protocol = StateV2;
}

impl DurableState for StateCounterV2 {
    type State = Totals;
    const STATE_VERSION: u32 = 2;
    fn state(&self) -> &Totals {
        &self.totals
    }
    fn set_state(&mut self, totals: Totals) {
        self.totals = totals;
    }
    fn read_state(stored: Stored<'_>) -> Result<Totals, Unreadable> {
        match stored.version() {
            1 => stored.decode::<u64>().map(Totals::from),
            _ => stored.decode(),
        }
    }
}

impl Handler<Add> for StateCounterV2 {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.totals.total += msg.0;
        self.save_state(ctx).await?;
        Ok(self.totals.total)
    }
}

impl Handler<Get> for StateCounterV2 {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.totals.total)
    }
}

impl Handler<Reset> for StateCounterV2 {
    async fn handle(&mut self, _: Reset, ctx: &EntityContext) -> ShardingResult<u64> {
        self.totals = Totals {
            total: 0,
            resets: self.totals.resets + 1,
        };
        self.save_state(ctx).await?;
        Ok(self.totals.resets)
    }
}

const T: Duration = Duration::from_secs(10);

/// Which build a system runs.
#[derive(Clone, Copy, Debug)]
enum Build {
    V1,
    V2,
}

async fn system_of<J>(build: Build, store: J) -> ShardedSystem<NoStore, J>
where
    J: Journal + SnapshotStore + DurableStateStore,
{
    let system = ShardedSystem::builder()
        .num_shards(4)
        .journal(store)
        .start()
        .await
        .expect("start");
    let registered = match build {
        Build::V1 => {
            let journaled = system
                .entity_type::<JournaledCounterV1>()
                .snapshotted()
                .register(|_| Default::default())
                .await;
            let state = system
                .entity_type::<StateCounterV1>()
                .durable_state()
                .register(|_| Default::default())
                .await;
            journaled.and(state)
        }
        Build::V2 => {
            let journaled = system
                .entity_type::<JournaledCounterV2>()
                .snapshotted()
                .register(|_| Default::default())
                .await;
            let state = system
                .entity_type::<StateCounterV2>()
                .durable_state()
                .register(|_| Default::default())
                .await;
            journaled.and(state)
        }
    };
    registered.expect("register");
    system
}

/// Whether `answer` is recovery's refusal of a record stored at version 2
/// by a build whose version is 1.
fn refused_as_newer(answer: ShardingResult<u64>) -> bool {
    match answer {
        Err(ShardingError::Persistence { error, .. }) => {
            let text = error.to_string();
            matches!(*error, PersistenceError::Corrupt { .. })
                && text.contains("version 2, above this build's 1")
        }
        _ => false,
    }
}

/// The upcasting contract on a store `open` opens (each call a new handle
/// on the same data): what version 1 journaled, snapshotted and saved,
/// version 2 reads through its upcasters and extends, with its records
/// beside version 1's; and a roll back to version 1 refuses version 2's
/// records with a typed error, applying nothing.
pub async fn version_1_records_read_under_version_2<J>(open: impl Fn() -> J)
where
    J: Journal + SnapshotStore + DurableStateStore,
{
    // Version 1 journals ten additions (snapshots after the 4th and the
    // 8th, two events after the last) and saves a state. (Each step is a
    // block: its entity refs hold its system, and the system the store.)
    {
        let system = system_of(Build::V1, open()).await;
        let journaled = system.entity_ref::<JournaledV1>("a");
        for n in 1..=10 {
            journaled.ask(Add(n), T).await.expect("v1 add");
        }
        let state = system.entity_ref::<StateV1>("a");
        assert_eq!(state.ask(Add(15), T).await.expect("v1 save"), 15);
        system.shutdown().await;
    }
    // Version 2 recovers from version 1's snapshot and events, and state.
    {
        let system = system_of(Build::V2, open()).await;
        let journaled = system.entity_ref::<JournaledV2>("a");
        assert_eq!(journaled.ask(Get, T).await.expect("v2 recovers"), 55);
        assert_eq!(journaled.ask(Reset, T).await.expect("v2 reset"), 1);
        assert_eq!(journaled.ask(Add(3), T).await.expect("v2 add"), 3);
        let state = system.entity_ref::<StateV2>("a");
        assert_eq!(state.ask(Get, T).await.expect("v2 loads"), 15);
        assert_eq!(state.ask(Reset, T).await.expect("v2 state reset"), 1);
        // A fresh entity of version 2 is all version 2.
        let fresh = system.entity_ref::<JournaledV2>("b");
        for n in 1..=5 {
            fresh.ask(Add(n), T).await.expect("v2 add");
        }
        system.shutdown().await;
    }
    // A roll back to version 1 refuses version 2's records, typed.
    {
        let system = system_of(Build::V1, open()).await;
        let journaled = system.entity_ref::<JournaledV1>("a");
        assert!(refused_as_newer(journaled.ask(Get, T).await));
        let state = system.entity_ref::<StateV1>("a");
        assert!(refused_as_newer(state.ask(Get, T).await));
        system.shutdown().await;
    }
    // And version 2 reads its own records beside version 1's.
    let system = system_of(Build::V2, open()).await;
    let journaled = system.entity_ref::<JournaledV2>("a");
    assert_eq!(journaled.ask(Get, T).await.expect("v2 recovers again"), 3);
    assert_eq!(journaled.ask(Reset, T).await.expect("v2 reset again"), 2);
    let fresh = system.entity_ref::<JournaledV2>("b");
    assert_eq!(fresh.ask(Get, T).await.expect("v2 fresh"), 15);
    let state = system.entity_ref::<StateV2>("a");
    assert_eq!(state.ask(Get, T).await.expect("v2 loads again"), 0);
    assert_eq!(state.ask(Add(2), T).await.expect("v2 state add"), 2);
    system.shutdown().await;
}
