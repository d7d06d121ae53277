//! How an event-sourced entity's recovery grows with its journal: for each
//! length, a fresh store (redb, or fjall with `--journal fjall`, in a
//! temporary directory; or with `--journal postgres` a fresh database on a
//! throwaway server, `fsync` on) gets that
//! many events for one entity through the store's SPI, written as the
//! library writes them (SPEC §8b: the type's wire name as manifest, its
//! event version, CBOR), in batches; then a one-node system on that store
//! is asked for the entity's count, and the ask's time is its recovery.
//! Twice per length: a plain event-sourced type, which replays every event,
//! and a snapshotted one, whose journal also holds a snapshot 50 events
//! before its end, as `SNAPSHOT_EVERY` leaves it. SPEC §13b.

use std::path::Path;
use std::time::{Duration, Instant};

use datum_cluster_sharding::persistence::{
    AtomicWrite, Journal, Payload, PersistenceId, RedbPersistence, SnapshotRecord, SnapshotStore,
    Writer,
};

use super::durable::JournalKind;
use datum_cluster_sharding::prelude::*;
use serde_json::{Value, json};

use super::curve_chart::{Panel, Series, draw};

const ASK: Duration = Duration::from_secs(600);
/// Events per append while filling the journal.
const BATCH: u64 = 10_000;
const ENTITY: &str = "recovering";
/// Added to the count a snapshot holds, so that an answer shows whether the
/// recovery started from the snapshot (the events after it add the rest).
const SNAPSHOT_OFFSET: u64 = 1_000_000_000;

#[derive(Serialize, Deserialize)]
pub struct Count;
#[derive(Serialize, Deserialize)]
pub enum Added {
    By(u64),
}

protocol! {
    /// An event-sourced counter that replays its whole journal.
    pub protocol Replayed = "recovery-replay" {
        ask Count -> u64;
    }
}
protocol! {
    /// The same counter, snapshotted.
    pub protocol Snapshotted = "recovery-snapshot" {
        ask Count -> u64;
    }
}

/// A counter of `Added` events, answering `Count`, for protocol `$protocol`.
macro_rules! counter_entity {
    ($name:ident, $protocol:ty) => {
        #[derive(Default)]
        pub struct $name {
            total: u64,
        }
        impl Entity for $name {
            type Protocol = $protocol;
        }
        impl EventSourced for $name {
            type Event = Added;
            fn apply(&mut self, Added::By(n): &Added) {
                self.total += n;
            }
        }
        impl Handler<Count> for $name {
            async fn handle(&mut self, _: Count, _: &EntityContext) -> ShardingResult<u64> {
                Ok(self.total)
            }
        }
    };
}

counter_entity!(ReplayedEntity, Replayed);
counter_entity!(SnapshottedEntity, Snapshotted);

impl datum_cluster_sharding::Snapshotted for SnapshottedEntity {
    type Snapshot = u64;
    fn snapshot(&self) -> u64 {
        self.total
    }
    fn restore(&mut self, total: u64) {
        self.total = total;
    }
}
fn cbor<T: Serialize>(value: &T) -> Vec<u8> {
    let mut bytes = Vec::new();
    ciborium::into_writer(value, &mut bytes).expect("CBOR of a plain value");
    bytes
}

/// Writes `length` events `Added::By(1)` to `type_name`'s entity, and with
/// `snapshot` a snapshot of the count 50 events before the end.
fn fill(
    store: &(impl Journal + SnapshotStore),
    type_name: &str,
    length: u64,
    snapshot: bool,
) -> Result<(), String> {
    let id = PersistenceId::new(type_name, ENTITY);
    let event = Payload {
        manifest: type_name.into(),
        version: 1,
        bytes: cbor(&Added::By(1)),
    };
    let mut written = 0;
    while written < length {
        let n = BATCH.min(length - written);
        let write = AtomicWrite {
            persistence_id: id.clone(),
            expected: written,
            events: vec![event.clone(); n as usize],
            writer: Writer::default(),
        };
        store
            .append(&[write])
            .remove(0)
            .map_err(|e| e.to_string())?;
        written += n;
    }
    if snapshot && length > 50 {
        let at = length - 50;
        let record = SnapshotRecord {
            sequence_nr: at,
            payload: Payload {
                manifest: format!("{type_name}#snapshot"),
                version: 1,
                bytes: cbor(&(at + SNAPSHOT_OFFSET)),
            },
            writer: Writer::default(),
        };
        store.save(&id, record).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Where a run's stores come from: a temporary directory each, or one
/// throwaway PostgreSQL server (a fresh database each).
struct Stores {
    kind: JournalKind,
    #[cfg(feature = "postgres")]
    server: Option<super::pg_server::Server>,
}

impl Stores {
    fn new(kind: JournalKind) -> Result<Stores, String> {
        #[cfg(feature = "postgres")]
        let server = super::durable::server_for(kind)?;
        Ok(Stores {
            kind,
            #[cfg(feature = "postgres")]
            server,
        })
    }

    /// One point on a fresh store: see [`point_on`].
    async fn point(&self, length: u64, snapshot: bool) -> Result<(f64, f64, bool), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        match self.kind {
            JournalKind::Embedded => {
                let path = dir.path().join("journal.redb");
                let store = RedbPersistence::open(path).map_err(|e| e.to_string())?;
                point_on(store, length, snapshot).await
            }
            #[cfg(feature = "fjall")]
            JournalKind::Fjall => {
                let path = dir.path().join("journal");
                let store = datum_cluster_sharding::persistence::FjallPersistence::open(path)
                    .map_err(|e| e.to_string())?;
                point_on(store, length, snapshot).await
            }
            #[cfg(feature = "postgres")]
            JournalKind::Postgres => {
                let server = self.server.as_ref().ok_or("no server")?;
                let store = tokio::task::block_in_place(|| {
                    datum_cluster_sharding::persistence::PgPersistence::connect(
                        &server.database(),
                        4,
                    )
                })
                .map_err(|e| e.to_string())?;
                point_on(store, length, snapshot).await
            }
            #[allow(unreachable_patterns)] // with every store's feature on
            kind => Err(format!("built without the {} feature", kind.name())),
        }
    }
}

/// One point: `store` gets `length` events (and a snapshot), then the ask
/// that recovers the entity; its time, and whether it counted them all.
async fn point_on<J: Journal + SnapshotStore>(
    store: J,
    length: u64,
    snapshot: bool,
) -> Result<(f64, f64, bool), String> {
    let type_name = if snapshot {
        Snapshotted::TYPE_NAME
    } else {
        Replayed::TYPE_NAME
    };
    let started = Instant::now();
    // The store's calls block (PostgreSQL's client runs a runtime of its
    // own): off the async worker, as the system's writers make them.
    tokio::task::block_in_place(|| fill(&store, type_name, length, snapshot))?;
    let fill_ms = started.elapsed().as_secs_f64() * 1e3;
    let system = ShardedSystem::builder()
        .num_shards(8)
        .journal(store)
        .start()
        .await
        .map_err(|e| e.to_string())?;
    let (count, asked) = if snapshot {
        system
            .entity_type::<SnapshottedEntity>()
            .snapshotted()
            .register(|_| SnapshottedEntity::default())
            .await
            .map_err(|e| e.to_string())?;
        let started_ask = Instant::now();
        let count = system
            .entity_ref::<Snapshotted>(ENTITY)
            .ask(Count, ASK)
            .await;
        (count, started_ask)
    } else {
        system
            .entity_type::<ReplayedEntity>()
            .event_sourced()
            .register(|_| ReplayedEntity::default())
            .await
            .map_err(|e| e.to_string())?;
        let started_ask = Instant::now();
        let count = system.entity_ref::<Replayed>(ENTITY).ask(Count, ASK).await;
        (count, started_ask)
    };
    let recovery_ms = asked.elapsed().as_secs_f64() * 1e3;
    system.shutdown().await;
    let expected = if snapshot && length > 50 {
        length + SNAPSHOT_OFFSET
    } else {
        length
    };
    if let Err(error) = &count {
        eprintln!("shard-bench: recovering {length} events: {error}");
    }
    Ok((recovery_ms, fill_ms, count.ok() == Some(expected)))
}

/// Every length, replayed and snapshotted: a table, the chart at `chart`
/// if given, and the JSON record.
pub async fn run(
    lengths: &[u64],
    chart: Option<&Path>,
    kind: JournalKind,
) -> Result<(Value, bool), String> {
    println!(
        "{:>9} {:>14} {:>14} {:>16} {:>10}",
        "events", "replay ms", "µs per event", "snapshotted ms", "fill ms"
    );
    let stores = Stores::new(kind)?;
    let mut points = Vec::new();
    let mut correct = true;
    for &length in lengths {
        let (replay_ms, fill_ms, replay_ok) = stores.point(length, false).await?;
        let (snapshot_ms, _, snapshot_ok) = stores.point(length, true).await?;
        correct &= replay_ok && snapshot_ok;
        println!(
            "{:>9} {:>14.1} {:>14.2} {:>16.1} {:>10.0}",
            length,
            replay_ms,
            replay_ms * 1e3 / length as f64,
            snapshot_ms,
            fill_ms
        );
        points.push((length, replay_ms, snapshot_ms, replay_ok && snapshot_ok));
    }
    if let Some(path) = chart {
        let line = |label: &str, value: fn(&(u64, f64, f64, bool)) -> f64| Series {
            label: label.into(),
            points: points.iter().map(|p| (p.0 as f64, value(p))).collect(),
        };
        draw(
            path,
            &[Panel {
                title: format!("Recovering an event-sourced entity ({})", kind.name()),
                x_label: "events in its journal".into(),
                y_label: "ms until its first answer".into(),
                series: vec![
                    line("every event replayed", |p| p.1),
                    line("from a snapshot 50 events back", |p| p.2),
                ],
            }],
        )
        .map_err(|e| format!("drawing {}: {e}", path.display()))?;
        eprintln!("shard-bench: chart written to {}", path.display());
    }
    let json = json!({
        "workload": "recovery",
        "store": kind.name(),
        "points": points.iter().map(|(length, replay, snapshot, ok)| json!({
            "events": length,
            "replay_ms": replay,
            "snapshotted_ms": snapshot,
            "counted_all": ok,
        })).collect::<Vec<_>>(),
    });
    Ok((json, correct))
}
