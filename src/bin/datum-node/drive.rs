//! The load driver (`--drive`, `--drive-rate`, `--drive-timeout-ms`,
//! `--drive-tags`, `--drive-fresh`, `--drive-reliable`): loops that ask
//! the hosted counters (or send them reliable credits) and count what
//! happens, for the `drive` line.

use std::process::ExitCode;
use std::sync::Arc;
#[cfg(feature = "postgres")]
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use datum_cluster_sharding::cluster::ClusterNode;
use datum_cluster_sharding::identity::UniqueAddress;
use datum_cluster_sharding::{
    Ask, EntityRef, NoStore, Processed, Protocol, ShardedSystem, ShardingError,
};

use super::EXIT_START_FAILED;
use super::counter;
use super::flags::Args;
use super::hosted::Hosted;
#[cfg(feature = "postgres")]
use super::journaled;
use super::output::{DriveLine, ms_since};

/// With `--drive` (and a hosted system): starts the driving loops (none
/// otherwise); on a failure, says why on stderr, crashes the node and
/// gives exit code 1.
pub(super) async fn start_drive(
    args: &Args,
    node: &ClusterNode,
    system: Option<&Hosted>,
    me: &UniqueAddress,
) -> Result<Option<Drive>, ExitCode> {
    match system {
        Some(system) if args.drive > 0 => {
            let options = DriveOptions {
                loops: args.drive,
                fresh: args.drive_fresh,
                rate: args.drive_rate,
                reliable: args.drive_reliable,
                timeout: Duration::from_millis(args.drive_timeout_ms),
                tags: args.drive_tags.then_some(tag_base(me)),
            };
            match system.drive(&options, me) {
                Ok(drive) => Ok(Some(drive)),
                Err(error) => {
                    eprintln!("datum-node: cannot drive traffic: {error}");
                    node.crash().await;
                    Err(ExitCode::from(EXIT_START_FAILED))
                }
            }
        }
        _ => Ok(None),
    }
}

impl Hosted {
    /// `--drive`: asks `Get` of counters, `Add(1)` of journaled counters;
    /// `reliable`: credits to journaled counters through a producer of
    /// `me`'s; `rate` of them per second from each loop (0: unpaced).
    fn drive(&self, options: &DriveOptions, me: &UniqueAddress) -> Result<Drive, ShardingError> {
        let counts = Arc::new(DriveCounts {
            next_tag: AtomicU64::new(options.tags.unwrap_or(0)),
            refused: options.tags.map(|_| Default::default()),
            ..DriveCounts::default()
        });
        match self {
            Hosted::Counter(system) => {
                drive_counters::<counter::Counter, _, _>(system, |_| counter::Get, options, &counts)
            }
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) if options.reliable => {
                let producer = system.reliable_producer(
                    format!("drive-{}", me.node_id),
                    datum_cluster_sharding::ProducerConfig::default(),
                )?;
                let stop = Arc::new(AtomicBool::new(false));
                drive_credits(&producer, options.loops, options.rate, &stop);
                return Ok(Drive::Reliable { producer, stop });
            }
            #[cfg(feature = "postgres")]
            Hosted::Journaled(system) => {
                let tagged = options.tags.is_some();
                drive_counters::<journaled::JournaledCounter, _, _>(
                    system,
                    move |tag| counter::Add(if tagged { tag } else { 1 }),
                    options,
                    &counts,
                )
            }
        }
        // (Without the `postgres` feature, credits have no counter to go to.)
        #[cfg(not(feature = "postgres"))]
        let _ = (me, options.reliable);
        Ok(Drive::Asks(counts))
    }
}

/// The first number of this node's `--drive-tags` attempts: its node id's
/// low 20 bits shifted left by 28 (room for 2^28 attempts each).
fn tag_base(me: &UniqueAddress) -> u64 {
    (me.node_id.0 & 0xf_ffff) << 28
}

/// How `--drive` drives.
struct DriveOptions {
    loops: u32,
    fresh: bool,
    /// Logical asks a second per loop (0: unpaced).
    rate: u32,
    reliable: bool,
    /// Each attempt's ask timeout.
    timeout: Duration,
    /// `--drive-tags`: the first attempt's number (later ones count up).
    tags: Option<u64>,
}

/// What `--drive` counts: logical asks answered, retries of failed asks,
/// asks given up after 30 s of retries, failed attempts whose error said
/// they may have been processed, and (`--drive-tags`) the numbers of
/// those whose error said they were not.
#[derive(Debug, Default)]
pub(super) struct DriveCounts {
    acked: AtomicU64,
    retries: AtomicU64,
    missing: AtomicU64,
    maybe: AtomicU64,
    /// The next attempt's number.
    next_tag: AtomicU64,
    /// `--drive-tags` only: the refused attempts' numbers.
    refused: Option<std::sync::Mutex<Vec<u64>>>,
    /// Loops still asking: each ends when its system stops.
    running: AtomicU64,
}

impl DriveCounts {
    /// Counts a failed attempt (numbered `tag`) by what its error says
    /// of its processing.
    fn failed(&self, tag: u64, error: &ShardingError) {
        match error.processed() {
            Processed::Maybe => {
                self.maybe.fetch_add(1, Ordering::Relaxed);
            }
            Processed::No => {
                if let Some(refused) = &self.refused {
                    refused.lock().unwrap_or_else(|p| p.into_inner()).push(tag);
                }
            }
            // (Not a failure of delivery: the handler answered an error.)
            _ => {}
        }
    }

    /// Until every loop has ended, `patience` at most.
    async fn ended(&self, patience: Duration) {
        let deadline = tokio::time::Instant::now() + patience;
        while self.running.load(Ordering::Acquire) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `--drive N`: N asking loops, loop `i` asking `msg(number)` of entity
/// `drive-i` (with `--drive-fresh`, `drive-R-i` in its round R) forever,
/// at most `rate` logical asks per second (0: unpaced), each ask retried
/// until answered or given up after 30 s.
fn drive_counters<P, M, J>(
    system: &ShardedSystem<NoStore, J>,
    msg: impl Fn(u64) -> M + Clone + Send + Sync + 'static,
    options: &DriveOptions,
    counts: &Arc<DriveCounts>,
) where
    P: Protocol,
    M: Ask<P> + Send + 'static,
    J: Send + Sync + 'static,
{
    for i in 0..options.loops {
        let system = system.clone();
        let counts = counts.clone();
        let msg = msg.clone();
        let (fresh, rate, timeout) = (options.fresh, options.rate, options.timeout);
        counts.running.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(async move {
            let fixed = system.entity_ref::<P>(format!("drive-{i}"));
            let mut pace = Pace::new(rate);
            for round in 0u64.. {
                pace.wait().await;
                let entity = if fresh {
                    system.entity_ref::<P>(format!("drive-{round}-{i}"))
                } else {
                    fixed.clone()
                };
                if !ask_until_answered(&entity, &msg, timeout, &counts).await {
                    break;
                }
            }
            counts.running.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// One logical ask, retried; false once the system has stopped.
async fn ask_until_answered<P: Protocol, M: Ask<P>>(
    entity: &EntityRef<P>,
    msg: impl Fn(u64) -> M,
    timeout: Duration,
    counts: &DriveCounts,
) -> bool {
    const GIVE_UP: Duration = Duration::from_secs(30);
    let first = Instant::now();
    loop {
        let tag = counts.next_tag.fetch_add(1, Ordering::Relaxed);
        match entity.ask(msg(tag), timeout).await {
            Ok(_) => {
                counts.acked.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            Err(error) => {
                counts.failed(tag, &error);
                if matches!(
                    error,
                    ShardingError::ShuttingDown | ShardingError::ShutDownInFlight { .. }
                ) {
                    return false;
                }
                if first.elapsed() >= GIVE_UP {
                    counts.missing.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
                counts.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// `--drive-rate`: one drive loop's pace, at most `rate` a second.
pub(super) struct Pace(Option<tokio::time::Interval>);

impl Pace {
    /// `rate` a second; 0 for no pace at all.
    pub(super) fn new(rate: u32) -> Pace {
        Pace((rate > 0).then(|| {
            let mut every = tokio::time::interval(Duration::from_secs(1) / rate);
            // A slow answer delays the next ask; it does not earn a burst.
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every
        }))
    }

    /// Until the next one may go.
    pub(super) async fn wait(&mut self) {
        if let Some(every) = &mut self.0 {
            every.tick().await;
        }
    }
}

/// What `--drive` runs.
pub(super) enum Drive {
    /// Asks, each retried until answered (or given up).
    Asks(Arc<DriveCounts>),
    /// `--drive-reliable`: credits through a reliable producer; the loops
    /// stop sending once `stop` is set.
    #[cfg(feature = "postgres")]
    Reliable {
        producer: datum_cluster_sharding::ReliableProducer<journaled::JournaledCounter>,
        stop: Arc<AtomicBool>,
    },
}

impl Drive {
    /// The `drive` line now.
    pub(super) fn line(&self, started: Instant) -> DriveLine {
        let t_ms = ms_since(started);
        match self {
            Drive::Asks(counts) => DriveLine {
                event: "drive",
                acked: counts.acked.load(Ordering::Relaxed),
                retries: counts.retries.load(Ordering::Relaxed),
                missing: counts.missing.load(Ordering::Relaxed),
                maybe: Some(counts.maybe.load(Ordering::Relaxed)),
                refused: (counts.refused.as_ref())
                    .map(|refused| refused.lock().unwrap_or_else(|p| p.into_inner()).clone()),
                unconfirmed: None,
                t_ms,
            },
            #[cfg(feature = "postgres")]
            Drive::Reliable { producer, .. } => {
                let stats = producer.stats();
                DriveLine {
                    event: "drive",
                    acked: stats.confirmed,
                    retries: stats.resent,
                    missing: stats.failed,
                    maybe: None,
                    refused: None,
                    unconfirmed: Some(stats.unconfirmed as u64),
                    t_ms,
                }
            }
        }
    }

    /// Once the system stopped (fenced): until the asking loops, whose
    /// last attempts failed then, have counted them (`patience` at most).
    pub(super) async fn ended(&self, patience: Duration) {
        match self {
            Drive::Asks(counts) => counts.ended(patience).await,
            #[cfg(feature = "postgres")]
            Drive::Reliable { .. } => {}
        }
    }

    /// Before a graceful leave: reliable credits stop, and those sent are
    /// waited for (up to 30 s; what is left shows as `unconfirmed`).
    pub(super) async fn settle(&self) {
        #[cfg(feature = "postgres")]
        if let Drive::Reliable { producer, stop } = self {
            stop.store(true, Ordering::Relaxed);
            if let Err(error) = producer.flush(Duration::from_secs(30)).await {
                eprintln!("datum-node: credits left unconfirmed: {error}");
            }
        }
    }
}

/// `--drive-reliable`: `loops` loops, loop `i` sending `Credit(1)` to
/// journaled counter `drive-i` through `producer`, at most `rate` a second
/// (0: as fast as its window lets it), until `stop` is set (or the system
/// shuts down).
#[cfg(feature = "postgres")]
fn drive_credits(
    producer: &datum_cluster_sharding::ReliableProducer<journaled::JournaledCounter>,
    loops: u32,
    rate: u32,
    stop: &Arc<AtomicBool>,
) {
    for i in 0..loops {
        let (producer, stop) = (producer.clone(), stop.clone());
        tokio::spawn(async move {
            let id: Arc<str> = format!("drive-{i}").into();
            let mut pace = Pace::new(rate);
            while !stop.load(Ordering::Relaxed) {
                pace.wait().await;
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                if producer
                    .send(id.clone(), journaled::Credit(1))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }
}
