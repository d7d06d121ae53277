//! Heap allocations per message (divan's `AllocProfiler`): one ask to an
//! entity on this node, and one to an entity on the other node of a
//! two-node cluster on 127.0.0.1, each awaited before the next.
//!
//! Everything runs on one `current_thread` runtime driven by the bench
//! thread, so every allocation of a message's round trip — the asker, the
//! pipes' reader and writer tasks on both nodes, the entity's actor — is
//! made on that thread and counted (the profiler counts per thread). The
//! nodes' own background work (gossip, heartbeats) lands in the counts too;
//! at a few messages a second it is far below one allocation per ask.
//!
//! Run: `cargo bench --bench allocs`

use std::sync::OnceLock;
use std::time::Duration;

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;
use divan::{AllocProfiler, Bencher};
use tokio::runtime::Runtime;

#[path = "../protocols/counter.rs"]
mod counter;
use counter::{Add, Counter, Get, counters_on};

#[global_allocator]
static ALLOC: AllocProfiler = AllocProfiler::system();

const TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    divan::main();
}

/// Two nodes, and a counter hosted on each side of node `a`.
struct Pair {
    runtime: Runtime,
    /// Hosted on node `a`, asked from `a`.
    here: EntityRef<Counter>,
    /// Hosted on node `b`, asked from `a`.
    there: EntityRef<Counter>,
    _systems: (ShardedSystem, ShardedSystem),
}

fn config(seeds: Vec<std::net::SocketAddr>) -> ClusterConfig {
    ClusterConfig::builder()
        .cluster_name("allocs")
        .secret("allocs-secret")
        .seed_nodes(seeds)
        .build()
}

fn pair() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let (here, there, systems) = runtime.block_on(async {
            let a = ClusterNode::start(config(vec![])).await.expect("node a");
            let b = ClusterNode::start(config(vec![a.bound_addr()]))
                .await
                .expect("node b");
            for node in [&a, &b] {
                node.wait_until(|s| s.up_members().count() == 2, TIMEOUT * 4)
                    .await
                    .expect("two Up");
            }
            let on_a = counters_on(&a, ShardingConfig::default())
                .await
                .expect("system a");
            let on_b = counters_on(&b, ShardingConfig::default())
                .await
                .expect("system b");
            // Ask entities until one lives on each node.
            let (mut here, mut there) = (None, None);
            for i in 0..10_000 {
                let entity = on_a.entity_ref::<Counter>(format!("entity-{i}"));
                entity.ask(Get, TIMEOUT).await.expect("warm-up ask");
                let shard = entity.shard_id();
                if on_a.live_entities::<Counter>(shard) > 0 {
                    here.get_or_insert(entity);
                } else if on_b.live_entities::<Counter>(shard) > 0 {
                    there.get_or_insert(entity);
                }
                if here.is_some() && there.is_some() {
                    break;
                }
            }
            (
                here.expect("no entity among 10,000 lives on node a"),
                there.expect("no entity among 10,000 lives on node b"),
                (on_a, on_b),
            )
        });
        Pair {
            runtime,
            here,
            there,
            _systems: systems,
        }
    })
}

/// One ask to `entity` per iteration, from node `a`.
fn ask_each(bencher: Bencher, runtime: &Runtime, entity: &EntityRef<Counter>) {
    bencher.bench_local(|| {
        let total = runtime.block_on(entity.ask(Get, TIMEOUT));
        total.expect("ask answered")
    });
}

/// One ask to an entity on the asking node.
#[divan::bench]
fn ask_local(bencher: Bencher) {
    let pair = pair();
    ask_each(bencher, &pair.runtime, &pair.here);
}

/// One ask to an entity on the other node: the envelope crosses a pipe,
/// the reply comes back through the pending-ask table.
#[divan::bench]
fn ask_remote(bencher: Bencher) {
    let pair = pair();
    ask_each(bencher, &pair.runtime, &pair.there);
}

/// One tell to an entity on the other node, then one ask behind it so the
/// tell has been handled when the iteration ends (the figure is for both).
#[divan::bench]
fn tell_then_ask_remote(bencher: Bencher) {
    let pair = pair();
    bencher.bench_local(|| {
        pair.runtime.block_on(async {
            pair.there.tell(Add(1)).await.expect("tell");
            pair.there.ask(Get, TIMEOUT).await.expect("ask answered")
        })
    });
}
