//! A test protocol whose entities report what happens to them: each message
//! handled, each incarnation started and dropped. Tests wait on these events
//! instead of sleeping.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use datum_cluster_sharding::prelude::*;
use tokio::sync::{Semaphore, mpsc};

/// Appends `seq` to the entity's log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record(pub u64);
/// How many messages this incarnation handled.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Total;
/// The entity's context: (type name, entity id, shard).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Where;
/// Panics in an ask handler.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Boom;
/// Panics in a tell handler.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BoomTell;
/// Waits for one permit of the probes' gate, then replies.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hold;
/// Returns a handler error.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fail;
/// Asks to be passivated after this message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PassivateAfter;
/// Panics in `handle` itself, before a future exists.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EarlyBoom;

protocol! {
    /// The probe entity's protocol.
    pub protocol Probe = "probe" {
        tell Record;
        ask Total -> u64;
        ask Where -> (String, String, u32);
        ask Boom -> ();
        tell BoomTell;
        ask Hold -> ();
        ask Fail -> u64;
        tell PassivateAfter;
        ask EarlyBoom -> ();
    }
}

/// A lifecycle event of one incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Incarnation `n` of the entity was built.
    Started(String, u64),
    /// Incarnation `n` of the entity was dropped (passivated, restarted, or shut down).
    Stopped(String, u64),
    /// Incarnation `n` is inside a `Hold` handler, waiting for the gate.
    Holding(String, u64),
}

/// What all probe entities share with the test.
pub struct Probes {
    /// Per entity: (incarnation, seq) of every `Record` handled, in order.
    pub log: Mutex<HashMap<String, Vec<(u64, u64)>>>,
    incarnations: AtomicU64,
    /// Factory calls whose number is listed here panic (1 = the first call).
    pub panicking_builds: Mutex<Vec<u64>>,
    events: mpsc::UnboundedSender<Event>,
    /// `Hold` waits for a permit here.
    pub gate: Semaphore,
}

impl Probes {
    /// New probes and the receiver of their events.
    pub fn new() -> (Arc<Probes>, mpsc::UnboundedReceiver<Event>) {
        let (events, rx) = mpsc::unbounded_channel();
        let probes = Probes {
            log: Mutex::new(HashMap::new()),
            incarnations: AtomicU64::new(0),
            panicking_builds: Mutex::new(Vec::new()),
            events,
            gate: Semaphore::new(0),
        };
        (Arc::new(probes), rx)
    }

    /// A factory building probe entities.
    pub fn factory(
        self: &Arc<Self>,
    ) -> impl Fn(&EntityContext) -> ProbeEntity + Send + Sync + 'static {
        let probes = self.clone();
        move |ctx| {
            let incarnation = probes.incarnations.fetch_add(1, Ordering::SeqCst) + 1;
            if probes
                .panicking_builds
                .lock()
                .unwrap()
                .contains(&incarnation)
            {
                panic!("factory refuses build {incarnation}");
            }
            let _ = probes
                .events
                .send(Event::Started(ctx.entity_id().to_owned(), incarnation));
            ProbeEntity {
                probes: probes.clone(),
                id: ctx.entity_id().to_owned(),
                incarnation,
                handled: 0,
            }
        }
    }

    /// The log of one entity.
    pub fn log_of(&self, id: &str) -> Vec<(u64, u64)> {
        self.log
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .unwrap_or_default()
    }
}

/// Waits for the next event, failing the test after `within`.
pub async fn next_event(rx: &mut mpsc::UnboundedReceiver<Event>, within: Duration) -> Event {
    tokio::time::timeout(within, rx.recv())
        .await
        .expect("timed out waiting for an entity event")
        .expect("event channel closed")
}

/// Waits until `wanted` is seen, skipping others; fails after `within`.
pub async fn expect_event(
    rx: &mut mpsc::UnboundedReceiver<Event>,
    wanted: Event,
    within: Duration,
) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let event = next_event(rx, left).await;
        if event == wanted {
            return;
        }
    }
}

/// An entity that reports to its probes.
pub struct ProbeEntity {
    probes: Arc<Probes>,
    id: String,
    incarnation: u64,
    handled: u64,
}

impl Drop for ProbeEntity {
    fn drop(&mut self) {
        let _ = self
            .probes
            .events
            .send(Event::Stopped(self.id.clone(), self.incarnation));
    }
}

impl Entity for ProbeEntity {
    type Protocol = Probe;
}

impl Handler<Record> for ProbeEntity {
    async fn handle(&mut self, msg: Record, _ctx: &EntityContext) -> ShardingResult<()> {
        self.handled += 1;
        self.probes
            .log
            .lock()
            .unwrap()
            .entry(self.id.clone())
            .or_default()
            .push((self.incarnation, msg.0));
        Ok(())
    }
}

impl Handler<Total> for ProbeEntity {
    async fn handle(&mut self, _msg: Total, _ctx: &EntityContext) -> ShardingResult<u64> {
        self.handled += 1;
        Ok(self.handled)
    }
}

impl Handler<Where> for ProbeEntity {
    async fn handle(
        &mut self,
        _msg: Where,
        ctx: &EntityContext,
    ) -> ShardingResult<(String, String, u32)> {
        Ok((
            ctx.type_name().to_owned(),
            ctx.entity_id().to_owned(),
            ctx.shard_id().0,
        ))
    }
}

impl Handler<Boom> for ProbeEntity {
    async fn handle(&mut self, _msg: Boom, _ctx: &EntityContext) -> ShardingResult<()> {
        panic!("boom in {}", self.id);
    }
}

impl Handler<BoomTell> for ProbeEntity {
    async fn handle(&mut self, _msg: BoomTell, _ctx: &EntityContext) -> ShardingResult<()> {
        panic!("boom (tell) in {}", self.id);
    }
}

impl Handler<Hold> for ProbeEntity {
    async fn handle(&mut self, _msg: Hold, _ctx: &EntityContext) -> ShardingResult<()> {
        self.handled += 1;
        let _ = self
            .probes
            .events
            .send(Event::Holding(self.id.clone(), self.incarnation));
        let permit = self
            .probes
            .gate
            .acquire()
            .await
            .map_err(|e| ShardingError::Handler(e.to_string()))?;
        permit.forget();
        Ok(())
    }
}

impl Handler<Fail> for ProbeEntity {
    async fn handle(&mut self, _msg: Fail, _ctx: &EntityContext) -> ShardingResult<u64> {
        Err(ShardingError::Handler("refused by the entity".into()))
    }
}

impl Handler<PassivateAfter> for ProbeEntity {
    async fn handle(&mut self, _msg: PassivateAfter, ctx: &EntityContext) -> ShardingResult<()> {
        ctx.passivate();
        Ok(())
    }
}

impl Handler<EarlyBoom> for ProbeEntity {
    #[allow(unreachable_code, clippy::diverging_sub_expression)]
    fn handle(
        &mut self,
        _msg: EarlyBoom,
        _ctx: &EntityContext,
    ) -> impl std::future::Future<Output = ShardingResult<()>> + Send {
        panic!("early boom in {}", self.id);
        async { Ok(()) }
    }
}
