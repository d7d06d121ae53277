//! The typed façade: trait facts checked at compile time, and a quickcheck
//! property for per-entity order under random interleavings.

use std::sync::Arc;
use std::time::Duration;

use datum_cluster_sharding::MessageKind;
use datum_cluster_sharding::prelude::*;
use quickcheck::{Arbitrary, Gen, QuickCheck, TestResult};
use static_assertions::{assert_impl_all, assert_not_impl_any};

#[allow(dead_code)]
#[path = "../protocols/counter.rs"]
mod counter;
#[allow(dead_code)]
#[path = "../protocols/ping.rs"]
mod ping;
#[allow(dead_code)]
#[path = "../protocols/probe.rs"]
mod probe;

use counter::{Add, Counter, CounterEntity, Get};
use ping::{Ping, Pinger};
use probe::*;

assert_impl_all!(Add: Tell<Counter>, Message<Counter>);
assert_impl_all!(Get: Ask<Counter>, Message<Counter>);
assert_not_impl_any!(Add: Ask<Counter>);
assert_not_impl_any!(Get: Tell<Counter>);
assert_not_impl_any!(Ping: Message<Counter>, Tell<Counter>, Ask<Counter>);
assert_impl_all!(Ping: Ask<Pinger>);
assert_impl_all!(EntityRef<Counter>: Send, Sync, Clone);
assert_impl_all!(ShardedSystem: Send, Sync, Clone);
assert_impl_all!(ShardedSystem<InMemoryStore>: Send, Sync, Clone);
assert_impl_all!(ShardingError: Send, Sync, std::error::Error);
assert_impl_all!(CounterEntity: Entity);

#[test]
fn protocol_describes_its_messages_in_order() {
    assert_eq!(Counter::TYPE_NAME, "counter");
    let names: Vec<_> = Counter::MESSAGES.iter().map(|m| (m.name, m.kind)).collect();
    assert_eq!(
        names,
        vec![("Add", MessageKind::Tell), ("Get", MessageKind::Ask)]
    );
    assert_eq!(
        (
            <Add as Message<Counter>>::INDEX,
            <Get as Message<Counter>>::INDEX
        ),
        (0, 1)
    );
}

/// One step of one sender.
#[derive(Clone, Debug)]
enum Op {
    Tell(u8),
    Ask(u8),
    Passivate(u8),
}

impl Arbitrary for Op {
    fn arbitrary(g: &mut Gen) -> Self {
        let entity = u8::arbitrary(g) % 4;
        match u8::arbitrary(g) % 10 {
            0 => Op::Passivate(entity),
            1..=2 => Op::Ask(entity),
            _ => Op::Tell(entity),
        }
    }

    fn shrink(&self) -> Box<dyn Iterator<Item = Self>> {
        match self {
            Op::Tell(_) => quickcheck::empty_shrinker(),
            Op::Ask(e) | Op::Passivate(e) => quickcheck::single_shrinker(Op::Tell(*e)),
        }
    }
}

const SENDER_STRIDE: u64 = 1_000_000;

/// Several senders run their op lists concurrently; each awaits every call.
/// Every entity must see each sender's records exactly once, in send order,
/// and incarnations only move forward.
fn order_holds(senders: Vec<Vec<Op>>) -> TestResult {
    if senders.len() > 3 || senders.iter().any(|ops| ops.len() > 80) {
        return TestResult::discard();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let config = ShardingConfig::builder()
            .num_shards(8)
            .passivation_idle_timeout(None)
            .build();
        let system = ShardedSystem::builder()
            .config(config)
            .start()
            .await
            .unwrap();
        let (probes, _events) = Probes::new();
        system
            .entity_type::<ProbeEntity>()
            .register(probes.factory())
            .await
            .unwrap();
        let ids = ["q-0", "q-1", "q-2", "q-3"];
        let long = Duration::from_secs(10);
        let tasks: Vec<_> = senders
            .iter()
            .cloned()
            .enumerate()
            .map(|(sender, ops)| {
                let refs: Arc<Vec<EntityRef<Probe>>> = Arc::new(
                    ids.iter()
                        .map(|id| system.entity_ref::<Probe>(*id))
                        .collect(),
                );
                tokio::spawn(async move {
                    for (k, op) in ops.into_iter().enumerate() {
                        let seq = sender as u64 * SENDER_STRIDE + k as u64;
                        match op {
                            Op::Tell(e) => refs[e as usize].tell(Record(seq)).await.unwrap(),
                            Op::Ask(e) => {
                                refs[e as usize].ask(Total, long).await.unwrap();
                            }
                            Op::Passivate(e) => refs[e as usize].passivate().await.unwrap(),
                        }
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        // An ask answered by an entity means everything sent to it before was handled.
        for id in ids {
            system
                .entity_ref::<Probe>(id)
                .ask(Total, long)
                .await
                .unwrap();
        }
        for (e, id) in ids.iter().enumerate() {
            let log = probes.log_of(id);
            for (sender, ops) in senders.iter().enumerate() {
                let sent: Vec<u64> = ops
                    .iter()
                    .enumerate()
                    .filter(|(_, op)| matches!(op, Op::Tell(t) if *t as usize == e))
                    .map(|(k, _)| sender as u64 * SENDER_STRIDE + k as u64)
                    .collect();
                let seen: Vec<u64> = log
                    .iter()
                    .map(|(_, s)| *s)
                    .filter(|s| s / SENDER_STRIDE == sender as u64)
                    .collect();
                if seen != sent {
                    system.shutdown().await;
                    return TestResult::error(format!(
                        "entity {id}, sender {sender}: sent {sent:?}, seen {seen:?}"
                    ));
                }
            }
            if log.windows(2).any(|w| w[0].0 > w[1].0) {
                system.shutdown().await;
                return TestResult::error(format!(
                    "entity {id}: incarnations went backwards: {log:?}"
                ));
            }
        }
        system.shutdown().await;
        TestResult::passed()
    })
}

#[test]
fn per_entity_order_holds_under_random_interleavings() {
    QuickCheck::new()
        .tests(60)
        .quickcheck(order_holds as fn(Vec<Vec<Op>>) -> TestResult);
}
