//! Messages to and from entities on other nodes.
//!
//! ```text
//!  node A (asks)                                   node B (hosts the shard)
//!  EntityRef::ask ─► Region: slot Remote(B)
//!     encode M once, ask id n ─► pending[n]
//!     DataMsg::Envelope{.., reply_to: (A, n)} ──pipe──► inbound: decode M by index,
//!                                                      region.deliver ─► entity
//!  pending[n] ◄── DataMsg::Reply{n, Ok(bytes)} ◄────── RemoteReply: encode R, send
//!  decode R, complete the asker's oneshot              to A (the origin, not the hop)
//! ```
//!
//! A reply goes to the node that asked, whichever node forwarded the message
//! on the way. Asks waiting on a node that is lost fail at once with
//! [`ShardingError::PeerLost`]; asks whose caller stopped waiting (timed out)
//! are swept.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;

use crate::model::envelope::{
    LocalEnvelope, PendingReply, ReplySink, ReplyTarget, Route, with_frame, with_scratch,
};
use crate::model::error::{ShardingError, ShardingResult};
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::ask_waits::Deadlines;
use crate::runtime::region::Region;
use crate::sharding::coordinator::ShardHome;
use crate::sharding::fast::{self, DeliveryRef, EnvelopeRef};
use crate::sharding::pending;
use crate::sharding::wire::{DataMsgOut, RemoteError, ReplyBodyOut};
use crate::transport::{SendFailure, Transport};
use crate::wire::channels::SHARDING_DATA;
use crate::wire::{COMPACT_DATA_VERSION, LINE_FINGERPRINT_VERSION};

/// How many times an envelope may be forwarded between nodes before it is
/// refused with [`ShardingError::TooManyHops`].
pub(crate) const MAX_HOPS: u8 = 4;

/// Refuses an envelope forwarded [`MAX_HOPS`] times already: two tables
/// that disagree cannot bounce it between them for ever.
pub(crate) fn check_hops(type_name: &'static str, entity_id: &str, hops: u8) -> ShardingResult<()> {
    if hops >= MAX_HOPS {
        return Err(ShardingError::TooManyHops {
            type_name,
            entity_id: entity_id.to_owned(),
            hops,
        });
    }
    Ok(())
}

/// The pending-ask table is split into this many locks.
const PENDING_STRIPES: usize = 16;

/// An ask of this node's, waiting for its reply.
type Pending = pending::Pending<PendingReply>;
/// One lock's share of the pending asks.
type PendingStripe = pending::PendingStripe<PendingReply>;

impl pending::Pending<PendingReply> {
    /// Answers `ShutDownInFlight`: this node stopped waiting for a reply
    /// to a message it had sent.
    fn fail_in_flight(self) {
        let error = self.in_flight();
        self.reply.complete(Err(error));
    }
}

/// An ask's deadline and the timeout it came from.
pub(crate) type Deadline = (Instant, Duration);

/// The sharding layer's side of the pipes: sends envelopes, routes replies.
pub(crate) struct Remote {
    transport: Transport,
    me: UniqueAddress,
    next_ask: AtomicU64,
    pending: [Mutex<PendingStripe>; PENDING_STRIPES],
    /// The expiry task runs: only then does this table keep deadlines
    /// (read under a stripe's lock when an entry is inserted).
    expiring: AtomicBool,
    /// This system stopped waiting for replies (`stop_waiting`): an ask
    /// sent after it is refused before it leaves (read under a stripe's
    /// lock, as `expiring` is, so none slips in behind the drain).
    closed: AtomicBool,
    /// Wakes the expiry task when a deadline is kept.
    deadlines: Arc<tokio::sync::Notify>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Remote {
    pub(crate) fn new(transport: Transport) -> Arc<Self> {
        let me = transport.local();
        Arc::new(Remote {
            transport,
            me,
            // A random start, so a reply meant for an earlier system on the
            // same node (a restart) does not complete a new ask.
            next_ask: AtomicU64::new(random_start()),
            pending: Default::default(),
            expiring: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            deadlines: Arc::new(tokio::sync::Notify::new()),
        })
    }

    /// This node.
    pub(crate) fn me(&self) -> UniqueAddress {
        self.me
    }

    /// The pipes.
    pub(crate) fn transport(&self) -> &Transport {
        &self.transport
    }

    fn stripe(&self, ask_id: u64) -> &Mutex<PendingStripe> {
        &self.pending[(ask_id % PENDING_STRIPES as u64) as usize]
    }

    /// Encodes `envelope` and sends it to `owner`. On error the envelope's
    /// asker has been answered with the same error. With `deadline`, an
    /// ask of this node's keeps it in its pending entry: `Ok(true)` says
    /// this table will answer `AskTimeout` at it.
    pub(crate) fn forward(
        self: &Arc<Self>,
        home: ShardHome,
        region: &Region,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
        deadline: Option<Deadline>,
    ) -> ShardingResult<bool> {
        if let Err(error) = check_hops(region.type_name, entity_id, envelope.hops()) {
            envelope.fail(error.clone());
            return Err(error);
        }
        with_scratch(|payload| {
            self.forward_encoded(
                home,
                region,
                (shard, entity_id),
                envelope,
                deadline,
                payload,
            )
        })
    }

    fn forward_encoded(
        self: &Arc<Self>,
        home: ShardHome,
        region: &Region,
        (shard, entity_id): (ShardId, &Arc<str>),
        envelope: LocalEnvelope,
        deadline: Option<Deadline>,
        payload: &mut Vec<u8>,
    ) -> ShardingResult<bool> {
        let owner = home.owner;
        let parts = match envelope.into_remote(payload) {
            Ok(parts) => parts,
            Err((error, envelope)) => {
                envelope.fail(error.clone());
                return Err(error);
            }
        };
        // The sender's span as a trace context (tracing on).
        let span = parts.extras.as_ref().and_then(|e| e.trace.as_ref());
        let trace = match (region.tracing(), span) {
            (Some(tracing), Some(span)) => tracing
                .propagation()
                .context_of(span)
                .map(|context| context.to_bytes()),
            _ => None,
        };
        let mut kept = false;
        let (reply_to, ask) = match parts.route {
            Route::Nobody => (None, None),
            Route::Remote(reply) => (Some(reply.forwarded()), None),
            Route::Local(reply) => {
                let ask_id = self.next_ask.fetch_add(1, Ordering::Relaxed);
                let mut table = lock(self.stripe(ask_id));
                if self.closed.load(Ordering::Acquire) {
                    // Not sent: it was not processed, and says so.
                    drop(table);
                    reply.complete(Err(ShardingError::ShuttingDown));
                    return Err(ShardingError::ShuttingDown);
                }
                // (Read under the lock: see `stop_keeping`.)
                let deadline = deadline.filter(|_| self.expiring.load(Ordering::Acquire));
                kept = deadline.is_some();
                table.insert(
                    ask_id,
                    Pending {
                        node: owner,
                        type_name: region.type_name,
                        entity_id: entity_id.clone(),
                        reply,
                        deadline,
                    },
                );
                drop(table);
                if kept {
                    self.deadlines.notify_one();
                }
                let target = ReplyTarget {
                    origin: self.me,
                    ask_id,
                };
                (Some(target), Some(ask_id))
            }
        };
        let mut envelope = EnvelopeRef {
            type_name: region.type_name,
            // (Its own line's, where the pipe reads it: a node of an older
            // version of the protocol that has the line decodes it, SPEC
            // §13.6.)
            fingerprint: region.line_fingerprint(parts.index),
            shard: shard.0,
            generation: home.generation,
            entity_id,
            index: parts.index,
            hops: parts.hops,
            reply_to,
            payload,
            trace,
            delivery: parts
                .extras
                .as_ref()
                .and_then(|e| e.delivery.as_ref())
                .map(|d| DeliveryRef(&d.producer, d.epoch, d.seq)),
            line: None,
        };
        let sent = self.send_envelope(&owner, &mut envelope, region.fingerprint);
        match sent {
            Ok(()) => Ok(kept),
            Err(reason) => {
                let error = send_error(region.type_name, shard, entity_id, &owner, &reason);
                match (ask, reply_to) {
                    (Some(ask_id), _) => {
                        if let Some(pending) = lock(self.stripe(ask_id)).remove(ask_id) {
                            pending.reply.complete(Err(error.clone()));
                        }
                    }
                    (None, Some(target)) => self.send_reply(target, Err(RemoteError::from(&error))),
                    (None, None) => {}
                }
                Err(error)
            }
        }
    }

    /// Sends `to` an envelope: with its own line's fingerprint where the
    /// pipe to it is at protocol version 4, else with the protocol's
    /// `whole` fingerprint, which every version compares (SPEC §13.6); in
    /// the compact form where the pipe reads it (version 3) and the
    /// envelope has one, else in the long form.
    fn send_envelope(
        &self,
        to: &UniqueAddress,
        envelope: &mut EnvelopeRef<'_>,
        whole: u64,
    ) -> Result<(), SendFailure> {
        let compact = envelope.is_compact_from(&self.me);
        let encode = |frame: &mut Vec<u8>, envelope: &EnvelopeRef<'_>| {
            if compact {
                fast::encode_envelope_compact(frame, envelope);
            } else {
                fast::encode_envelope(frame, envelope);
            }
        };
        if envelope.fingerprint != whole {
            let sent = with_frame(|frame| {
                encode(frame, envelope);
                (self.transport).send_slice_if(to, SHARDING_DATA, frame, LINE_FINGERPRINT_VERSION)
            });
            if let Some(sent) = sent {
                return sent;
            }
            // A pipe of an older build, or none yet (the peer's version
            // unknown): the whole fingerprint, which every build compares,
            // and in the long form the line's beside it, which a build
            // that reads it checks instead.
            envelope.line = Some(envelope.fingerprint);
            envelope.fingerprint = whole;
        }
        let envelope = &*envelope;
        self.send_data(
            to,
            compact.then_some(|frame: &mut Vec<u8>| encode(frame, envelope)),
            |frame| fast::encode_envelope(frame, envelope),
        )
    }

    /// Sends `to` a data message in the form `compact` writes (protocol
    /// version 3) where the pipe to it is at that version, else in the
    /// form `long` writes — also while no pipe is up yet, and whenever
    /// `compact` is `None`. Built in this thread's frame buffer.
    fn send_data(
        &self,
        to: &UniqueAddress,
        compact: Option<impl FnOnce(&mut Vec<u8>)>,
        long: impl FnOnce(&mut Vec<u8>),
    ) -> Result<(), SendFailure> {
        with_frame(|frame| {
            if let Some(compact) = compact {
                compact(frame);
                let sent =
                    self.transport
                        .send_slice_if(to, SHARDING_DATA, frame, COMPACT_DATA_VERSION);
                if let Some(sent) = sent {
                    return sent;
                }
                frame.clear();
            }
            long(frame);
            self.transport.send_slice(to, SHARDING_DATA, frame)
        })
    }

    /// Asks `owner` to passivate an entity of a shard it hosts.
    pub(crate) fn passivate(
        &self,
        owner: UniqueAddress,
        type_name: &'static str,
        shard: ShardId,
        entity_id: &Arc<str>,
    ) -> ShardingResult<()> {
        let msg = DataMsgOut::Passivate {
            type_name,
            shard: shard.0,
            entity_id,
        };
        self.transport
            .send(&owner, SHARDING_DATA, Bytes::from(msg.encode()))
            .map_err(|e| send_error(type_name, shard, entity_id, &owner, &e.reason))
    }

    /// A reply arrived from `from` for ask `ask_id`: the encoded value, or
    /// the remote error.
    pub(crate) fn complete(
        &self,
        from: &UniqueAddress,
        ask_id: u64,
        result: Result<&[u8], RemoteError>,
    ) {
        let Some(pending) = lock(self.stripe(ask_id)).remove(ask_id) else {
            // The asker gave up and was swept, or its node was lost meanwhile.
            return;
        };
        match result {
            Ok(bytes) => pending.reply.complete(Ok(bytes)),
            Err(error) => {
                let error = error.into_error(pending.type_name, &pending.entity_id, from);
                pending.reply.complete(Err(error));
            }
        }
    }

    /// `node` is gone: every ask waiting on it fails now with `PeerLost`.
    pub(crate) fn node_lost(&self, node: &UniqueAddress) -> usize {
        let mut failed = Vec::new();
        for stripe in &self.pending {
            failed.extend(lock(stripe).take(|p| p.node == *node));
        }
        let count = failed.len();
        for pending in failed {
            let error = pending.peer_lost();
            pending.reply.complete(Err(error));
        }
        count
    }

    /// Forgets asks whose caller stopped waiting. Returns how many.
    pub(crate) fn sweep(&self) -> usize {
        let mut swept = 0;
        for stripe in &self.pending {
            // (Dropped outside the lock.)
            let gone = lock(stripe).take(|p| p.reply.is_abandoned());
            swept += gone.len();
        }
        swept
    }

    /// This system stops waiting (it shuts down, or its node fenced
    /// itself): every pending ask fails now with `ShutDownInFlight`. Each
    /// was handed to a pipe towards its owner, so it may have been
    /// processed there — never `ShuttingDown`, which says it was not.
    pub(crate) fn stop_waiting(&self) {
        // (Each stripe's lock is taken after this: an ask is either drained
        // below or sees it and is refused unsent.)
        self.closed.store(true, Ordering::Release);
        for stripe in &self.pending {
            let drained = lock(stripe).take(|_| true);
            for pending in drained {
                pending.fail_in_flight();
            }
        }
    }

    /// Asks waiting for a reply now.
    pub(crate) fn pending_asks(&self) -> usize {
        self.pending.iter().map(|s| lock(s).asks.len()).sum()
    }
}

impl ReplySink for Remote {
    fn send_reply(&self, target: ReplyTarget, result: Result<&[u8], RemoteError>) {
        if target.origin == self.me {
            // Forwarded away and back: the asker is here.
            self.complete(&self.me, target.ask_id, result);
            return;
        }
        let sent = match &result {
            Ok(bytes) => self.send_data(
                &target.origin,
                Some(|frame: &mut Vec<u8>| {
                    fast::encode_reply_ok_compact(frame, target.ask_id, bytes);
                }),
                |frame| fast::encode_reply_ok(frame, target.ask_id, bytes),
            ),
            Err(error) => {
                let msg = DataMsgOut::Reply {
                    ask_id: target.ask_id,
                    result: ReplyBodyOut::Err(error),
                };
                self.transport
                    .send_slice(&target.origin, SHARDING_DATA, &msg.encode())
            }
        };
        if let Err(reason) = sent {
            tracing::debug!(origin = %target.origin, %reason, "reply to a remote ask not sent");
        }
    }
}

/// The pending asks' deadlines, checked by the node's task for them.
impl Deadlines for Remote {
    /// Answers `AskTimeout` to every ask whose deadline this table keeps
    /// and that is past it at `now`. Returns how many deadlines it still
    /// keeps.
    fn expire(&self, now: Instant) -> usize {
        let mut expired = Vec::new();
        let mut kept = 0;
        for stripe in &self.pending {
            let mut table = lock(stripe);
            expired.extend(table.expire(now));
            kept += table.kept;
        }
        for pending in expired {
            let error = pending.timed_out();
            pending.reply.complete(Err(error));
        }
        kept
    }

    /// The expiry task starts: from now on deadlines are kept, and this
    /// wakes it when one is.
    fn start_keeping(&self) -> Arc<tokio::sync::Notify> {
        self.expiring.store(true, Ordering::Release);
        self.deadlines.clone()
    }

    /// The expiry task stopped (its runtime went away): no deadline is
    /// kept any more, and the asks whose deadline was kept fail now with
    /// `ShutDownInFlight` rather than wait for ever. (An insert reads
    /// `expiring` under its stripe's lock, which this takes after clearing
    /// it: each insert is either seen here or sees the flag cleared.)
    fn stop_keeping(&self) {
        self.expiring.store(false, Ordering::Release);
        let mut failed = Vec::new();
        for stripe in &self.pending {
            failed.extend(lock(stripe).take(|p| p.deadline.is_some()));
        }
        for pending in failed {
            pending.fail_in_flight();
        }
    }
}

/// A random ask id in the lower half of `u64` (room to count up), or 1 when
/// the operating system's generator fails.
fn random_start() -> u64 {
    let mut bytes = [0u8; 8];
    match getrandom::fill(&mut bytes) {
        Ok(()) => (u64::from_le_bytes(bytes) >> 1).max(1),
        Err(_) => 1,
    }
}

/// The error a caller sees when the pipe to `owner` refused a message.
fn send_error(
    type_name: &'static str,
    shard: ShardId,
    entity_id: &str,
    owner: &UniqueAddress,
    reason: &SendFailure,
) -> ShardingError {
    match reason {
        SendFailure::QueueFull => ShardingError::BufferOverflow {
            type_name,
            shard_id: shard,
        },
        SendFailure::TooLarge { len, max } => ShardingError::Remote(format!(
            "message of {len} bytes exceeds the frame limit of {max}"
        )),
        SendFailure::ShutDown => ShardingError::ShuttingDown,
        _ => ShardingError::PeerLost {
            type_name,
            entity_id: entity_id.to_owned(),
            node: owner.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio::sync::oneshot;

    use super::*;
    use crate::model::identity::NodeId;

    /// A pending ask as `forward_encoded` makes one, its deadline `at`
    /// kept by the table or not.
    fn pending(at: Option<Instant>) -> Pending {
        let (reply, _replied) = oneshot::channel::<ShardingResult<u32>>();
        pending_to(reply, at)
    }

    /// [`pending`], answering `reply`.
    fn pending_to(reply: oneshot::Sender<ShardingResult<u32>>, at: Option<Instant>) -> Pending {
        let envelope = LocalEnvelope::local::<u32, u32>(0, 7, Some(reply));
        let parts = envelope.into_remote(&mut Vec::new()).expect("encodes");
        let Route::Local(reply) = parts.route else {
            panic!("an ask's route is its asker here");
        };
        Pending {
            node: UniqueAddress {
                addr: SocketAddr::from(([127, 0, 0, 1], 7000)),
                node_id: NodeId(1),
                incarnation: 1,
            },
            type_name: "t",
            entity_id: Arc::from("e"),
            reply,
            deadline: at.map(|at| (at, Duration::from_secs(1))),
        }
    }

    /// An ask this node stops waiting for (it shuts down, or fences
    /// itself) had been handed to a pipe: its asker hears it may have been
    /// processed, never `ShuttingDown`'s "not processed".
    #[test]
    fn an_ask_whose_node_stops_waiting_may_have_been_processed() {
        let (reply, mut replied) = oneshot::channel::<ShardingResult<u32>>();
        let mut stripe = PendingStripe::default();
        stripe.insert(1, pending_to(reply, None));
        for pending in stripe.take(|_| true) {
            pending.fail_in_flight();
        }
        let error = replied.try_recv().expect("answered").expect_err("an error");
        assert_eq!(
            error,
            ShardingError::ShutDownInFlight {
                type_name: "t",
                entity_id: "e".into()
            }
        );
        assert_eq!(error.processed(), crate::Processed::Maybe);
    }

    #[test]
    fn a_stripe_is_due_from_its_earliest_kept_deadline_and_from_none_once_none_is_kept() {
        let now = Instant::now();
        let (soon, later) = (now + Duration::from_secs(1), now + Duration::from_secs(9));
        let mut stripe = PendingStripe::default();
        stripe.insert(1, pending(Some(later)));
        stripe.insert(2, pending(None));
        stripe.insert(3, pending(Some(soon)));
        assert_eq!((stripe.kept, stripe.due_from), (2, Some(soon)));
        // An ask that leaves while another is kept leaves the bound early
        // (the next check makes it exact)...
        assert!(stripe.remove(3).is_some());
        assert_eq!((stripe.kept, stripe.due_from), (1, Some(soon)));
        // ...and the last kept one clears it, so the checking task may
        // sleep although an ask whose deadline is not kept still waits.
        assert!(stripe.remove(1).is_some());
        assert_eq!((stripe.kept, stripe.due_from), (0, None));
        assert_eq!(stripe.asks.len(), 1);
        let taken = stripe.take(|_| true);
        assert_eq!((taken.len(), stripe.kept, stripe.due_from), (1, 0, None));
    }

    /// A build at protocol version 3 compares an envelope's fingerprint
    /// with the protocol's whole one: over its pipe an envelope carries
    /// that, over a version-4 pipe its own line's, and before any pipe is
    /// up the whole one with its line's beside it (SPEC §13.6).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_envelope_carries_its_lines_fingerprint_only_over_a_pipe_that_reads_it() {
        use futures_util::{SinkExt, StreamExt};
        use tokio_util::codec::Framed;

        use crate::transport::handshake::{self, Local};
        use crate::transport::{Secret, TransportConfig};
        use crate::wire::{Frame, FrameCodec, PROTOCOL_VERSION, RejectReason};

        const LINE: u64 = 0xbcac_9f54_39be_15f0;
        const WHOLE: u64 = 0x10f4_3ecc_488b_4809;
        let patience = Duration::from_secs(10);
        let cases = [
            (3u16, true, (WHOLE, None)),
            (PROTOCOL_VERSION, true, (LINE, None)),
            (PROTOCOL_VERSION, false, (WHOLE, Some(LINE))),
        ];
        for (speaks, piped, expected) in cases {
            let transport = Transport::bind(TransportConfig::new("unit", "sesame"))
                .await
                .expect("bind");
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let addr = listener.local_addr().expect("addr");
            let identity = UniqueAddress::new_at(addr);
            // A build that speaks up to `speaks`: a later Hello is refused
            // (the dialer dials again at `speaks`), then a pipe is made.
            let peer = tokio::spawn(async move {
                let secret = Secret::from("sesame");
                let local = Local {
                    me: identity,
                    cluster: "unit",
                    secret: &secret,
                };
                let (stream, _) = listener.accept().await.expect("accept");
                let mut framed = Framed::new(stream, FrameCodec::default());
                if speaks < PROTOCOL_VERSION {
                    let hello = framed.next().await;
                    assert!(matches!(hello, Some(Ok(Frame::Hello { .. }))), "{hello:?}");
                    let reason = RejectReason::UnsupportedVersion {
                        ours: speaks,
                        min: 2,
                    };
                    framed.send(Frame::Reject { reason }).await.expect("reject");
                    let (stream, _) = listener.accept().await.expect("accept again");
                    framed = Framed::new(stream, FrameCodec::default());
                }
                let (_, version) = handshake::accept(&mut framed, &local, |_| Ok(()))
                    .await
                    .expect("handshake");
                assert_eq!(version, speaks);
                framed.send(Frame::Accepted).await.expect("accepted");
                loop {
                    match framed.next().await {
                        Some(Ok(Frame::Oneway { payload, .. })) => break payload,
                        Some(Ok(_)) => {}
                        other => panic!("pipe ended: {other:?}"),
                    }
                }
            });
            let to = if piped {
                tokio::time::timeout(patience, transport.connect(addr))
                    .await
                    .expect("in time")
                    .expect("connects")
            } else {
                identity
            };
            let remote = Remote::new(transport.clone());
            let mut envelope = EnvelopeRef {
                type_name: "tally",
                fingerprint: LINE,
                shard: 5,
                generation: 3,
                entity_id: "tally-1",
                index: 0,
                hops: 0,
                reply_to: None,
                payload: &[0xf6],
                trace: None,
                delivery: None,
                line: None,
            };
            remote
                .send_envelope(&to, &mut envelope, WHOLE)
                .expect("sent");
            let payload = tokio::time::timeout(patience, peer)
                .await
                .expect("in time")
                .expect("the peer's task");
            let Some(fast::DataRef::Envelope(got)) = fast::decode(&payload, &to) else {
                panic!("not an envelope: {payload:?}");
            };
            assert_eq!(
                (got.fingerprint, got.line),
                expected,
                "a pipe at version {speaks} (up before: {piped})"
            );
        }
    }
}
