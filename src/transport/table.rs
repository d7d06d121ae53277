//! The transport's shared state: the connection table (one pipe per peer
//! identity), the dials in progress, the channels' handlers, the identities
//! marked down, and the rules that install a handshaken pipe or refuse it.
//! Below the accept and dial loops and the pipes' readers and writers, which
//! all work on it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::TransportConfig;
use super::connection::{Conn, Incoming, lock};
use super::error::{ConnectError, SendFailure};
use super::events::{DisconnectReason, TransportEvent};
use super::handshake::Local;
use crate::model::identity::UniqueAddress;
use crate::util::fast_hash::{FastMap, FastSet};
use crate::util::warn_limit::{WarnLimit, warn_limited};
use crate::wire::{Channel, Frame, FrameCodec, RejectReason, RemoteFailure};

pub(crate) struct Stats {
    pub(crate) frames: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) overflow: AtomicU64,
    /// The same, and the pipes up, for the `metrics` facade.
    pub(crate) metrics: crate::ops::telemetry::PipeMetrics,
}

impl Stats {
    /// `node`: the transport's address, the metrics' `node` label.
    pub(crate) fn new(node: String) -> Self {
        Stats {
            frames: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            overflow: AtomicU64::new(0),
            metrics: crate::ops::telemetry::PipeMetrics::new(node),
        }
    }

    pub(crate) fn record_batch(&self, frames: usize) {
        self.frames.fetch_add(frames as u64, Ordering::Relaxed);
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.metrics.frames.increment(frames as u64);
        self.metrics.writes.increment(1);
    }
}

/// A function called on the reader task with a oneway message's sender and
/// payload, borrowed from the read buffer.
pub(crate) type BorrowedHandler = Arc<dyn Fn(&UniqueAddress, &[u8]) + Send + Sync>;

/// Who takes a channel's inbound messages.
pub(crate) enum Handler {
    /// A receiver, fed through a bounded queue.
    Queue(mpsc::Sender<Incoming>),
    /// A function called on the reader task.
    Inline(Arc<dyn Fn(Incoming) + Send + Sync>),
    /// A function called on the reader task with the payload in place.
    Borrowed(BorrowedHandler),
}

impl Handler {
    pub(crate) fn is_closed(&self) -> bool {
        match self {
            Handler::Queue(tx) => tx.is_closed(),
            Handler::Inline(_) | Handler::Borrowed(_) => false,
        }
    }
}

/// A dial to one address: frames and callers waiting for it, and backoff.
pub(crate) struct Dial {
    pub(crate) queued: Vec<(UniqueAddress, Frame)>,
    pub(crate) waiters: Vec<oneshot::Sender<Result<UniqueAddress, ConnectError>>>,
    /// A dial task exists for this address (sleeping or connecting).
    pub(crate) task: bool,
    /// The task is connecting or handshaking right now.
    pub(crate) connecting: bool,
    pub(crate) failures: u32,
    pub(crate) next_attempt: Instant,
    /// Why the last attempt failed (answered at once during backoff).
    pub(crate) last_error: Option<ConnectError>,
    /// Set when an inbound handshake claiming this address first deferred
    /// the dial: past it, the dial goes ahead anyway (see `dial_loop`).
    pub(crate) deferred_until: Option<Instant>,
}

impl Dial {
    pub(crate) fn new() -> Self {
        Dial {
            queued: Vec::new(),
            waiters: Vec::new(),
            task: false,
            connecting: false,
            failures: 0,
            next_attempt: Instant::now(),
            last_error: None,
            deferred_until: None,
        }
    }

    /// Backing off after a failure: no attempt is due yet.
    pub(crate) fn backing_off(&self) -> Option<&ConnectError> {
        if self.connecting || Instant::now() >= self.next_attempt {
            return None;
        }
        self.last_error.as_ref()
    }
}

pub(crate) struct State {
    /// Established pipes, by the peer identity's address.
    pub(crate) conns: FastMap<SocketAddr, Arc<Conn>>,
    /// Dials in progress or backing off, by dialed address.
    pub(crate) dials: HashMap<SocketAddr, Dial>,
    /// Inbound handshakes past `Hello`, by the peer's claimed address. While
    /// one is under way a dial to that address waits, at most one handshake
    /// timeout (the claim is not proven yet): it is normally the pipe to be.
    pub(crate) inbound: HashMap<SocketAddr, usize>,
    /// Identities marked down: refused for good.
    pub(crate) down: FastSet<UniqueAddress>,
    pub(crate) subscribers: Vec<mpsc::UnboundedSender<TransportEvent>>,
    pub(crate) closed: bool,
}

impl State {
    pub(crate) fn emit(&mut self, event: TransportEvent) {
        self.subscribers.retain(|s| s.send(event.clone()).is_ok());
    }
}

/// State shared by the transport handle and its tasks.
pub(crate) struct Shared {
    pub(crate) config: TransportConfig,
    pub(crate) local: UniqueAddress,
    pub(crate) bound: SocketAddr,
    pub(crate) codec: FrameCodec,
    pub(crate) max_payload: usize,
    /// `config.control_channels`, deduplicated: their frames take the
    /// writers' priority lane.
    pub(crate) control: Arc<[Channel]>,
    pub(crate) runtime: tokio::runtime::Handle,
    pub(crate) state: Mutex<State>,
    pub(crate) handlers: RwLock<HashMap<Channel, Handler>>,
    /// Bumped (under `handlers`' write lock) at every change of `handlers`,
    /// so readers can cache the borrowed handlers and check them with one
    /// load per frame.
    pub(crate) handlers_version: AtomicU64,
    pub(crate) shutdown: CancellationToken,
    pub(crate) next_conn_id: AtomicU64,
    pub(crate) stats: Stats,
    pub(crate) accept_task: Mutex<Option<JoinHandle<()>>>,
    /// Permits for inbound handshakes not yet authenticated.
    pub(crate) handshakes: Arc<Semaphore>,
    /// Inbound handshakes not yet authenticated, per source (see
    /// `accept::source_of`); a source with none is absent.
    pub(crate) sources: Mutex<HashMap<IpAddr, usize>>,
    /// Woken whenever an inbound handshake releases its address's slot.
    pub(crate) slots: Notify,
    /// Rate limit of warnings about refused inbound connections.
    pub(crate) refusals: RefusalLog,
    /// Rate limit of warnings about bad input on established pipes (a frame
    /// that does not decode, a handshake frame): a buggy peer that redials
    /// must not flood the log.
    pub(crate) bad_input: WarnLimit,
}

/// `now + d`, saturating at a year from now instead of overflowing.
pub(crate) fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d.min(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

/// Rate-limited warnings about refused inbound handshakes: anyone who can
/// reach the port can cause one, so they must not flood the log.
#[derive(Default)]
pub(crate) struct RefusalLog {
    pub(crate) limit: WarnLimit,
}

impl RefusalLog {
    /// Logs the end of an inbound connection refused or failed before it
    /// became a pipe: expected outcomes at debug, the rest as rate-limited
    /// warnings.
    pub(crate) fn log(&self, local: UniqueAddress, remote: SocketAddr, e: &ConnectError) {
        let quiet = matches!(
            e,
            ConnectError::Refused(RejectReason::Duplicate)
                | ConnectError::Rejected(RejectReason::Duplicate)
                | ConnectError::Io { .. }
                | ConnectError::Closed
        );
        if quiet {
            log_refusal(remote, "inbound", e);
            return;
        }
        warn_limited!(self.limit, "handshake refused"; %local, %remote, direction = "inbound", error = %e);
    }
}

pub(crate) fn log_refusal(remote: SocketAddr, direction: &str, e: &ConnectError) {
    match e {
        ConnectError::Refused(RejectReason::Duplicate)
        | ConnectError::Rejected(RejectReason::Duplicate) => {
            tracing::debug!(%remote, direction, "redundant connection dropped (simultaneous connect)");
        }
        ConnectError::Io { .. } | ConnectError::Closed => {
            tracing::debug!(%remote, direction, error = %e, "handshake failed");
        }
        _ => tracing::warn!(%remote, direction, error = %e, "handshake refused"),
    }
}

impl Shared {
    pub(crate) fn local_handshake(&self) -> Local<'_> {
        Local {
            me: self.local,
            cluster: &self.config.cluster_name,
            secret: &self.config.secret,
        }
    }

    pub(crate) fn check_target(&self, st: &State, to: &UniqueAddress) -> Result<(), SendFailure> {
        if st.closed {
            Err(SendFailure::ShutDown)
        } else if st.down.contains(to) {
            Err(SendFailure::MarkedDown)
        } else {
            Ok(())
        }
    }

    /// The established pipe to exactly `to`, `None` if there is none yet.
    pub(crate) fn current_conn(
        &self,
        to: &UniqueAddress,
    ) -> Result<Option<Arc<Conn>>, SendFailure> {
        let st = lock(&self.state);
        self.check_target(&st, to)?;
        match st.conns.get(&to.addr) {
            Some(c) if c.peer == *to => Ok(Some(c.clone())),
            Some(c) if to.is_older_than(&c.peer) => Err(SendFailure::Stale),
            _ => Ok(None),
        }
    }

    /// Hands an inbound message to its channel's receiver.
    pub(crate) fn deliver(&self, incoming: Incoming) {
        let handlers = self.handlers.read().unwrap_or_else(|e| e.into_inner());
        let channel = incoming.channel;
        let refused = match handlers.get(&channel) {
            None => Some((incoming, RemoteFailure::NoHandler(channel))),
            Some(Handler::Inline(handler)) => {
                let handler = handler.clone();
                drop(handlers);
                // A panic in an upper layer's handler must not end this
                // pipe's reader (nothing more would be read from the peer).
                let from = incoming.from;
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(incoming)))
                    .is_err()
                {
                    warn_limited!(self.bad_input, "an inline channel handler panicked; the message was dropped"; %from, channel);
                }
                return;
            }
            Some(Handler::Borrowed(handler)) => {
                let handler = handler.clone();
                drop(handlers);
                let Incoming { from, payload, .. } = incoming;
                self.call_borrowed(&handler, &from, channel, &payload);
                return;
            }
            Some(Handler::Queue(tx)) => match tx.try_send(incoming) {
                Ok(()) => None,
                Err(mpsc::error::TrySendError::Full(inc)) => {
                    self.stats.overflow.fetch_add(1, Ordering::Relaxed);
                    Some((inc, RemoteFailure::Overloaded))
                }
                Err(mpsc::error::TrySendError::Closed(inc)) => {
                    Some((inc, RemoteFailure::NoHandler(channel)))
                }
            },
        };
        drop(handlers);
        if let Some((incoming, failure)) = refused {
            tracing::debug!(from = %incoming.from, channel, ?failure, "inbound message not delivered");
            if let Some(reply) = incoming.reply {
                reply.fail_with(failure);
            }
        }
    }

    /// Calls a borrowed handler; a panic in it is caught (and logged), as an
    /// inline handler's is.
    pub(crate) fn call_borrowed(
        &self,
        handler: &BorrowedHandler,
        from: &UniqueAddress,
        channel: Channel,
        payload: &[u8],
    ) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(from, payload)))
            .is_err()
        {
            warn_limited!(self.bad_input, "an inline channel handler panicked; the message was dropped"; %from, channel);
        }
    }

    /// The borrowed handlers now, and the version they are of.
    pub(crate) fn borrowed_handlers(&self) -> (u64, Vec<(Channel, BorrowedHandler)>) {
        let handlers = self.handlers.read().unwrap_or_else(|e| e.into_inner());
        let version = self.handlers_version.load(Ordering::Acquire);
        let borrowed = handlers
            .iter()
            .filter_map(|(channel, h)| match h {
                Handler::Borrowed(f) => Some((*channel, f.clone())),
                _ => None,
            })
            .collect();
        (version, borrowed)
    }

    /// The current version of the channel handlers.
    pub(crate) fn handlers_version(&self) -> u64 {
        self.handlers_version.load(Ordering::Acquire)
    }

    /// Admission of the acceptor, on the dialing side, at its `Welcome`.
    pub(crate) fn admit_outbound(&self, peer: &UniqueAddress) -> Result<(), RejectReason> {
        let st = lock(&self.state);
        if st.closed {
            return Err(RejectReason::ShuttingDown);
        }
        if st.down.contains(peer) {
            return Err(RejectReason::Quarantined);
        }
        if st.conns.get(&peer.addr).is_some_and(|c| c.peer == *peer) {
            return Err(RejectReason::Duplicate);
        }
        Ok(())
    }

    /// Puts `conn` in the table, replacing an older pipe to its address.
    pub(crate) fn install(&self, st: &mut State, conn: &Arc<Conn>) -> Result<(), RejectReason> {
        if st.closed {
            return Err(RejectReason::ShuttingDown);
        }
        if st.down.contains(&conn.peer) {
            return Err(RejectReason::Quarantined);
        }
        // A pipe already in the table means its peer (or we) redialed after
        // losing it: the newer one replaces it. Two simultaneous dials never
        // both get this far (see `admit_inbound` and `dial_loop`).
        let addr = conn.peer.addr;
        if st
            .conns
            .get(&addr)
            .is_some_and(|old| conn.peer.is_older_than(&old.peer))
        {
            // An older incarnation than the one connected at that address is
            // superseded: it must not push the newer one out.
            return Err(RejectReason::Quarantined);
        }
        let old = st.conns.insert(addr, conn.clone());
        match old {
            Some(old) if old.peer == conn.peer => {
                tracing::debug!(peer = %conn.peer, "pipe replaced by a newer one");
                old.close(DisconnectReason::Replaced);
            }
            Some(old) => {
                old.close(DisconnectReason::Replaced);
                st.emit(TransportEvent::Disconnected {
                    peer: old.peer,
                    reason: DisconnectReason::Replaced,
                });
                st.emit(TransportEvent::Connected { peer: conn.peer });
            }
            None => {
                self.stats.metrics.pipes.increment(1.0);
                st.emit(TransportEvent::Connected { peer: conn.peer })
            }
        }
        Self::flush_dial(st, addr, conn);
        Ok(())
    }

    /// Moves frames waiting in `addr`'s dial queue into `conn` (those meant
    /// for its identity; others are dropped) and answers waiting connects.
    pub(crate) fn flush_dial(st: &mut State, addr: SocketAddr, conn: &Conn) {
        let Some(dial) = st.dials.get_mut(&addr) else {
            return;
        };
        let (mut moved, mut dropped) = (0usize, 0usize);
        for (to, frame) in dial.queued.drain(..) {
            if to != conn.peer || conn.enqueue(frame).is_err() {
                dropped += 1;
            } else {
                moved += 1;
            }
        }
        tracing::trace!(peer = %conn.peer, moved, waiters = dial.waiters.len(), "dial queue flushed");
        if dropped > 0 {
            tracing::debug!(peer = %conn.peer, dropped, "queued frames for another identity or a full queue dropped");
        }
        for w in dial.waiters.drain(..) {
            let _ = w.send(Ok(conn.peer));
        }
        dial.failures = 0;
        dial.last_error = None;
        dial.deferred_until = None;
        if !dial.task {
            st.dials.remove(&addr);
        }
    }

    /// Called by a connection's reader when it ends.
    pub(crate) fn connection_ended(&self, conn: &Arc<Conn>) {
        {
            let mut st = lock(&self.state);
            if st
                .conns
                .get(&conn.peer.addr)
                .is_some_and(|c| c.id == conn.id)
            {
                st.conns.remove(&conn.peer.addr);
                self.stats.metrics.pipes.decrement(1.0);
                let reason = conn.reason();
                tracing::info!(peer = %conn.peer, ?reason, "pipe closed");
                st.emit(TransportEvent::Disconnected {
                    peer: conn.peer,
                    reason,
                });
            }
        }
        // A closing connection's writer ends it once flushed (bounded).
        if !conn.is_closing() {
            conn.close(DisconnectReason::PeerClosed);
        }
        conn.fail_pending();
    }

    /// Stops everything: listener, pipes, dials.
    pub(crate) fn close_all(&self) {
        let (conns, waiters) = {
            let mut st = lock(&self.state);
            if st.closed {
                return;
            }
            st.closed = true;
            let conns: Vec<_> = st.conns.drain().map(|(_, c)| c).collect();
            self.stats.metrics.pipes.decrement(conns.len() as f64);
            for c in &conns {
                st.emit(TransportEvent::Disconnected {
                    peer: c.peer,
                    reason: DisconnectReason::ShutDown,
                });
            }
            let waiters: Vec<_> = st.dials.drain().flat_map(|(_, d)| d.waiters).collect();
            (conns, waiters)
        };
        self.shutdown.cancel();
        for c in conns {
            c.close(DisconnectReason::ShutDown);
            c.fail_pending();
        }
        for w in waiters {
            let _ = w.send(Err(ConnectError::ShutDown));
        }
        tracing::info!(local = %self.local, "transport shut down");
    }
}
