//! Local tell and ask through an `EntityRef`, beside a bare ractor actor doing
//! the same work (a `u64` counter) on the same runtime.
//!
//! Each iteration sends `BATCH` messages one after another from one sender
//! (each awaited), so the figures are per-message latency at concurrency 1,
//! cross-thread wake-ups included. The tell benches end each batch with one
//! ask so that the batch's tells are processed inside the measurement.
//!
//! Run: `cargo bench --bench local`

use std::sync::OnceLock;
use std::time::Duration;

use datum_cluster_sharding::prelude::*;
use divan::Bencher;
use divan::counter::ItemsCount;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::runtime::Runtime;

#[path = "../protocols/counter.rs"]
mod counter;
use counter::{Add, Counter, CounterEntity, Get};

const BATCH: usize = 1_000;
const TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    divan::main();
}

/// The bare ractor counter: the same work as `CounterEntity`.
struct BareCounter;

enum BareMsg {
    Add(u64),
    Get(RpcReplyPort<u64>),
}

impl Actor for BareCounter {
    type Msg = BareMsg;
    type State = u64;
    type Arguments = ();

    async fn pre_start(&self, _: ActorRef<BareMsg>, _: ()) -> Result<u64, ActorProcessingErr> {
        Ok(0)
    }

    async fn handle(
        &self,
        _: ActorRef<BareMsg>,
        msg: BareMsg,
        total: &mut u64,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BareMsg::Add(n) => *total += n,
            BareMsg::Get(reply) => {
                let _ = reply.send(*total);
            }
        }
        Ok(())
    }
}

struct Fixture {
    runtime: Runtime,
    sharded: EntityRef<Counter>,
    bare: ActorRef<BareMsg>,
}

/// `current_thread`: sender and actors share one thread, so a figure is the
/// CPU cost of a message with no wake-ups. `multi_thread`: two workers, the
/// sender a task on one of them; wake-ups across threads included.
const FLAVORS: [&str; 2] = ["current_thread", "multi_thread"];

fn fixture(flavor: &str) -> &'static Fixture {
    static SINGLE: OnceLock<Fixture> = OnceLock::new();
    static MULTI: OnceLock<Fixture> = OnceLock::new();
    let (cell, runtime): (_, fn() -> Runtime) = match flavor {
        "current_thread" => (&SINGLE, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        }),
        _ => (&MULTI, || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap()
        }),
    };
    cell.get_or_init(|| {
        let runtime = runtime();
        let (sharded, bare) = runtime.block_on(async {
            let config = ShardingConfig::builder()
                .passivation_idle_timeout(None)
                .build();
            let system = ShardedSystem::builder()
                .config(config)
                .start()
                .await
                .unwrap();
            system
                .entity_type::<CounterEntity>()
                .register(|_| CounterEntity::default())
                .await
                .unwrap();
            let sharded = system.entity_ref::<Counter>("bench-entity");
            sharded.ask(Get, TIMEOUT).await.unwrap(); // spawn it before measuring
            let (bare, _) = Actor::spawn(None, BareCounter, ()).await.unwrap();
            // Keep the system alive for the whole process.
            std::mem::forget(system);
            (sharded, bare)
        });
        Fixture {
            runtime,
            sharded,
            bare,
        }
    })
}

/// Runs one batch as a task on the runtime (on a worker when multi-threaded).
fn run<F: std::future::Future<Output = ()> + Send + 'static>(f: &Fixture, batch: F) {
    f.runtime
        .block_on(async { f.runtime.spawn(batch).await.unwrap() })
}

#[divan::bench(args = FLAVORS)]
fn ask_sharded(b: Bencher, flavor: &str) {
    let f = fixture(flavor);
    b.counter(ItemsCount::new(BATCH)).bench(|| {
        let r = f.sharded.clone();
        run(f, async move {
            for _ in 0..BATCH {
                divan::black_box(r.ask(Get, TIMEOUT).await.unwrap());
            }
        })
    });
}

#[divan::bench(args = FLAVORS)]
fn ask_bare_ractor(b: Bencher, flavor: &str) {
    let f = fixture(flavor);
    b.counter(ItemsCount::new(BATCH)).bench(|| {
        let a = f.bare.clone();
        run(f, async move {
            for _ in 0..BATCH {
                divan::black_box(
                    a.call(BareMsg::Get, Some(TIMEOUT))
                        .await
                        .unwrap()
                        .success_or("timed out")
                        .unwrap(),
                );
            }
        })
    });
}

#[divan::bench(args = FLAVORS)]
fn tell_sharded(b: Bencher, flavor: &str) {
    let f = fixture(flavor);
    b.counter(ItemsCount::new(BATCH)).bench(|| {
        let r = f.sharded.clone();
        run(f, async move {
            for _ in 0..BATCH - 1 {
                r.tell(Add(1)).await.unwrap();
            }
            divan::black_box(r.ask(Get, TIMEOUT).await.unwrap());
        })
    });
}

#[divan::bench(args = FLAVORS)]
fn tell_bare_ractor(b: Bencher, flavor: &str) {
    let f = fixture(flavor);
    b.counter(ItemsCount::new(BATCH)).bench(|| {
        let a = f.bare.clone();
        run(f, async move {
            for _ in 0..BATCH - 1 {
                a.cast(BareMsg::Add(1)).unwrap();
            }
            divan::black_box(
                a.call(BareMsg::Get, Some(TIMEOUT))
                    .await
                    .unwrap()
                    .success_or("timed out")
                    .unwrap(),
            );
        })
    });
}
