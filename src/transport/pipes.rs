//! The [`Transport`]: listener, connection table, dialing, sends.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::SinkExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::codec::Framed;
use tokio_util::sync::CancellationToken;

use super::config::TransportConfig;
use super::connection::{
    Conn, Incoming, OutboxGuard, PendingGuard, READ_BUF, Refused, lock, payload_of, read_loop,
    write_loop,
};
use super::error::{ConnectError, RegisterError, RequestError, SendError, SendFailure};
use super::events::{DisconnectReason, TransportEvent};
use super::handshake::{self, HandshakeStream, Local};
use crate::identity::{NodeId, UniqueAddress};
use crate::warn_limit::{WarnLimit, warn_limited};
use crate::wire::{
    Channel, Frame, FrameCodec, HANDSHAKE_MAX_FRAME_LEN, RejectReason, RemoteFailure,
};

/// Upper bound on the CBOR envelope around a payload (map headers, variant
/// and field names, a u64 correlation id, the byte-string header).
pub const FRAME_OVERHEAD: usize = 64;

/// Counters of the batching writers, for benchmarks and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Frames the writers took out of their outboxes into batches.
    pub frames_written: u64,
    /// Batches taken (each written with one `write_all`). Neither counter
    /// includes the `Accepted` frame an acceptor writes first, nor what a
    /// closing pipe flushes.
    pub writes: u64,
    /// Inbound messages not delivered because their channel's receiver was
    /// full (oneway dropped, request answered `Overloaded`).
    pub inbound_overflow: u64,
}

#[derive(Default)]
pub(crate) struct Stats {
    frames: AtomicU64,
    writes: AtomicU64,
    overflow: AtomicU64,
}

impl Stats {
    pub(crate) fn record_batch(&self, frames: usize) {
        self.frames.fetch_add(frames as u64, Ordering::Relaxed);
        self.writes.fetch_add(1, Ordering::Relaxed);
    }
}

/// A function called on the reader task with a oneway message's sender and
/// payload, borrowed from the read buffer.
pub(crate) type BorrowedHandler = Arc<dyn Fn(&UniqueAddress, &[u8]) + Send + Sync>;

/// Who takes a channel's inbound messages.
enum Handler {
    /// A receiver, fed through a bounded queue.
    Queue(mpsc::Sender<Incoming>),
    /// A function called on the reader task.
    Inline(Arc<dyn Fn(Incoming) + Send + Sync>),
    /// A function called on the reader task with the payload in place.
    Borrowed(BorrowedHandler),
}

impl Handler {
    fn is_closed(&self) -> bool {
        match self {
            Handler::Queue(tx) => tx.is_closed(),
            Handler::Inline(_) | Handler::Borrowed(_) => false,
        }
    }
}

/// Where one established pipe runs: its two TCP ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// The peer at the other end.
    pub peer: UniqueAddress,
    /// This side's socket address.
    pub local_socket: SocketAddr,
    /// The peer side's socket address.
    pub remote_socket: SocketAddr,
    /// Whether this node dialed the connection.
    pub dialed_by_us: bool,
}

/// A dial to one address: frames and callers waiting for it, and backoff.
struct Dial {
    queued: Vec<(UniqueAddress, Frame)>,
    waiters: Vec<oneshot::Sender<Result<UniqueAddress, ConnectError>>>,
    /// A dial task exists for this address (sleeping or connecting).
    task: bool,
    /// The task is connecting or handshaking right now.
    connecting: bool,
    failures: u32,
    next_attempt: Instant,
    /// Why the last attempt failed (answered at once during backoff).
    last_error: Option<ConnectError>,
    /// Set when an inbound handshake claiming this address first deferred
    /// the dial: past it, the dial goes ahead anyway (see `dial_loop`).
    deferred_until: Option<Instant>,
}

impl Dial {
    fn new() -> Self {
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
    fn backing_off(&self) -> Option<&ConnectError> {
        if self.connecting || Instant::now() >= self.next_attempt {
            return None;
        }
        self.last_error.as_ref()
    }
}

struct State {
    /// Established pipes, by the peer identity's address.
    conns: HashMap<SocketAddr, Arc<Conn>>,
    /// Dials in progress or backing off, by dialed address.
    dials: HashMap<SocketAddr, Dial>,
    /// Inbound handshakes past `Hello`, by the peer's claimed address. While
    /// one is under way a dial to that address waits, at most one handshake
    /// timeout (the claim is not proven yet): it is normally the pipe to be.
    inbound: HashMap<SocketAddr, usize>,
    /// Identities marked down: refused for good.
    down: HashSet<UniqueAddress>,
    subscribers: Vec<mpsc::UnboundedSender<TransportEvent>>,
    closed: bool,
}

impl State {
    fn emit(&mut self, event: TransportEvent) {
        self.subscribers.retain(|s| s.send(event.clone()).is_ok());
    }
}

/// State shared by the transport handle and its tasks.
pub(crate) struct Shared {
    config: TransportConfig,
    local: UniqueAddress,
    bound: SocketAddr,
    pub(crate) codec: FrameCodec,
    pub(crate) max_payload: usize,
    /// `config.control_channels`, deduplicated: their frames take the
    /// writers' priority lane.
    control: Arc<[Channel]>,
    runtime: tokio::runtime::Handle,
    state: Mutex<State>,
    handlers: RwLock<HashMap<Channel, Handler>>,
    /// Bumped (under `handlers`' write lock) at every change of `handlers`,
    /// so readers can cache the borrowed handlers and check them with one
    /// load per frame.
    handlers_version: AtomicU64,
    shutdown: CancellationToken,
    next_conn_id: AtomicU64,
    pub(crate) stats: Stats,
    accept_task: Mutex<Option<JoinHandle<()>>>,
    /// Permits for inbound handshakes not yet authenticated.
    handshakes: Arc<Semaphore>,
    /// Woken whenever an inbound handshake releases its address's slot.
    slots: Notify,
    /// Rate limit of warnings about refused inbound connections.
    refusals: RefusalLog,
    /// Rate limit of warnings about bad input on established pipes (a frame
    /// that does not decode, a handshake frame): a buggy peer that redials
    /// must not flood the log.
    pub(crate) bad_input: WarnLimit,
}

/// Shuts the transport down when the last user handle is dropped (tasks
/// hold `Shared`, not this).
struct Owner(Arc<Shared>);

impl Drop for Owner {
    fn drop(&mut self) {
        self.0.close_all();
    }
}

/// One node's end of the node-to-node pipes. Cheap to clone; the transport
/// shuts down when [`shutdown`](Self::shutdown) is called or the last clone
/// is dropped.
#[derive(Clone)]
pub struct Transport {
    shared: Arc<Shared>,
    _owner: Arc<Owner>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("local", &self.shared.local)
            .finish_non_exhaustive()
    }
}

impl Transport {
    /// Binds the listener and starts accepting peers. Must be called inside a
    /// tokio runtime, which the transport's tasks then run on.
    pub async fn bind(config: TransportConfig) -> std::io::Result<Transport> {
        let listener = TcpListener::bind(config.bind_addr).await?;
        let bound = listener.local_addr()?;
        if config.advertised_addr.is_none() && bound.ip().is_unspecified() {
            tracing::warn!(%bound, "listening on an unspecified address without advertised_addr: peers cannot dial this identity");
        }
        let local = UniqueAddress::new_at(config.advertised_addr.unwrap_or(bound));
        let codec = FrameCodec::new(config.max_frame_len);
        let mut control = config.control_channels.clone();
        control.sort_unstable();
        control.dedup();
        let shared = Arc::new(Shared {
            control: control.into(),
            max_payload: codec.max_frame_len().saturating_sub(FRAME_OVERHEAD),
            codec,
            local,
            bound,
            runtime: tokio::runtime::Handle::current(),
            state: Mutex::new(State {
                conns: HashMap::new(),
                dials: HashMap::new(),
                inbound: HashMap::new(),
                down: HashSet::new(),
                subscribers: Vec::new(),
                closed: false,
            }),
            handlers: RwLock::new(HashMap::new()),
            handlers_version: AtomicU64::new(0),
            shutdown: CancellationToken::new(),
            next_conn_id: AtomicU64::new(1),
            stats: Stats::default(),
            accept_task: Mutex::new(None),
            handshakes: Arc::new(Semaphore::new(config.max_inbound_handshakes.max(1))),
            slots: Notify::new(),
            refusals: RefusalLog::default(),
            bad_input: WarnLimit::default(),
            config,
        });
        let task = tokio::spawn(accept_loop(shared.clone(), listener));
        *lock(&shared.accept_task) = Some(task);
        tracing::info!(local = %local, "transport listening");
        Ok(Transport {
            _owner: Arc::new(Owner(shared.clone())),
            shared,
        })
    }

    /// This node's identity (address, node id, incarnation).
    pub fn local(&self) -> UniqueAddress {
        self.shared.local
    }

    /// The address the listener is bound to (useful with port 0).
    pub fn bound_addr(&self) -> SocketAddr {
        self.shared.bound
    }

    /// The largest payload a [`send`](Self::send), request or reply accepts.
    pub fn max_payload(&self) -> usize {
        self.shared.max_payload
    }

    /// Registers the receiver of `channel`'s inbound traffic. Oneway
    /// messages and requests for the channel arrive as [`Incoming`] on the
    /// returned receiver, which holds up to `capacity` of them; when it is
    /// full, further oneway messages are dropped and requests answered
    /// [`RemoteFailure::Overloaded`], so one slow layer never stalls a
    /// connection. Dropping the receiver unregisters the channel.
    pub fn register(
        &self,
        channel: Channel,
        capacity: usize,
    ) -> Result<mpsc::Receiver<Incoming>, RegisterError> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        self.install(channel, Handler::Queue(tx))?;
        Ok(rx)
    }

    /// Registers `handler` to be called for each inbound message of
    /// `channel`, on the reader task of the connection it arrived on, in
    /// arrival order — no queue and no task hop in between. The handler must
    /// not block: it runs between two reads of that connection. Remove it
    /// with [`unregister`](Self::unregister).
    pub fn register_inline(
        &self,
        channel: Channel,
        handler: impl Fn(Incoming) + Send + Sync + 'static,
    ) -> Result<(), RegisterError> {
        self.install(channel, Handler::Inline(Arc::new(handler)))
    }

    /// Like [`register_inline`](Self::register_inline), for oneway traffic
    /// only: `handler` gets the sender and the payload borrowed from the
    /// pipe's read buffer, with no copy or allocation per message. (A
    /// request on the channel is given to it too, and answered
    /// `RemoteFailure::Dropped`.) Each pipe's reader keeps a copy of the
    /// handler, dropped at that pipe's next frame after `unregister`: the
    /// handler must not own what it would keep alive (the transport
    /// itself, say), and may see one racing frame after `unregister`.
    pub(crate) fn register_inline_borrowed(
        &self,
        channel: Channel,
        handler: impl Fn(&UniqueAddress, &[u8]) + Send + Sync + 'static,
    ) -> Result<(), RegisterError> {
        self.install(channel, Handler::Borrowed(Arc::new(handler)))
    }

    /// Makes `handler` the one of `channel`, unless a live one is there;
    /// bumps the handlers' version, so readers refresh their copies.
    fn install(&self, channel: Channel, handler: Handler) -> Result<(), RegisterError> {
        self.change_handlers(|handlers| {
            if handlers.get(&channel).is_some_and(|h| !h.is_closed()) {
                return Err(RegisterError::AlreadyRegistered(channel));
            }
            handlers.insert(channel, handler);
            Ok(())
        })
    }

    /// Changes the handlers under their write lock, and bumps their version.
    fn change_handlers<T>(&self, change: impl FnOnce(&mut HashMap<Channel, Handler>) -> T) -> T {
        let mut handlers = self
            .shared
            .handlers
            .write()
            .unwrap_or_else(|e| e.into_inner());
        let out = change(&mut handlers);
        self.shared.handlers_version.fetch_add(1, Ordering::Release);
        out
    }

    /// Removes the receiver or handler of `channel`, if any.
    pub fn unregister(&self, channel: Channel) {
        self.change_handlers(|handlers| handlers.remove(&channel));
    }

    /// A new subscription to connection events, starting now. See
    /// [`connected_peers`](Self::connected_peers) for the current state.
    pub fn events(&self) -> mpsc::UnboundedReceiver<TransportEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.shared.state).subscribers.push(tx);
        rx
    }

    /// Peers with an established pipe now.
    pub fn connected_peers(&self) -> Vec<UniqueAddress> {
        lock(&self.shared.state)
            .conns
            .values()
            .map(|c| c.peer)
            .collect()
    }

    /// The established pipe to `peer`, if any.
    pub fn connection(&self, peer: &UniqueAddress) -> Option<ConnectionInfo> {
        let st = lock(&self.shared.state);
        let c = st.conns.get(&peer.addr).filter(|c| c.peer == *peer)?;
        Some(ConnectionInfo {
            peer: c.peer,
            local_socket: c.local_socket,
            remote_socket: c.remote_socket,
            dialed_by_us: c.initiator == self.shared.local.node_id,
        })
    }

    /// Requests sent and still waiting for a reply, over all pipes (a
    /// diagnostic: it returns to zero after timeouts and disconnects).
    pub fn pending_requests(&self) -> usize {
        lock(&self.shared.state)
            .conns
            .values()
            .map(|c| c.pending_len())
            .sum()
    }

    /// Writer counters since start.
    pub fn stats(&self) -> TransportStats {
        TransportStats {
            frames_written: self.shared.stats.frames.load(Ordering::Relaxed),
            writes: self.shared.stats.writes.load(Ordering::Relaxed),
            inbound_overflow: self.shared.stats.overflow.load(Ordering::Relaxed),
        }
    }

    /// Establishes (or reuses) the pipe to the node listening at `addr` and
    /// returns its identity. While the address is backing off after a failed
    /// dial, fails at once with that dial's error (the next attempt stays
    /// scheduled); otherwise waits for the dial under way, which the
    /// handshake timeout bounds.
    pub async fn connect(&self, addr: SocketAddr) -> Result<UniqueAddress, ConnectError> {
        let rx = {
            let mut st = lock(&self.shared.state);
            if st.closed {
                return Err(ConnectError::ShutDown);
            }
            if let Some(c) = st.conns.get(&addr) {
                return Ok(c.peer);
            }
            let dial = st.dials.entry(addr).or_insert_with(Dial::new);
            if let Some(last) = dial.backing_off() {
                // Fail fast; the next attempt stays scheduled, so the pipe
                // comes back on its own once the peer does.
                let last = last.clone();
                self.shared.ensure_dial_task(dial, addr);
                return Err(last);
            }
            let (tx, rx) = oneshot::channel();
            dial.waiters.push(tx);
            self.shared.ensure_dial_task(dial, addr);
            rx
        };
        rx.await.unwrap_or(Err(ConnectError::ShutDown))
    }

    /// Sends a oneway message to `to` on `channel`: a non-blocking enqueue.
    ///
    /// With a pipe to `to` up, the frame is encoded into its outbox. Without
    /// one, it waits in a dial queue while the transport connects (with
    /// backoff after failures); if that dial fails, queued frames are dropped
    /// (logged), as for any message to an unreachable node. Delivery is
    /// at most once. On error nothing was enqueued and the payload is given
    /// back.
    pub fn send(
        &self,
        to: &UniqueAddress,
        channel: Channel,
        payload: Bytes,
    ) -> Result<(), SendError> {
        if payload.len() > self.shared.max_payload {
            let reason = SendFailure::TooLarge {
                len: payload.len(),
                max: self.shared.max_payload,
            };
            return Err(SendError::new(reason, payload));
        }
        let mut st = lock(&self.shared.state);
        if let Err(reason) = self.shared.check_target(&st, to) {
            return Err(SendError::new(reason, payload));
        }
        let frame = Frame::Oneway { channel, payload };
        if let Some(c) = st.conns.get(&to.addr) {
            if c.peer == *to {
                // Encoded outside the transport's lock.
                let c = c.clone();
                drop(st);
                return c.enqueue(frame).map_err(queue_error);
            }
            if to.is_older_than(&c.peer) {
                return Err(SendError::new(SendFailure::Stale, payload_of(frame)));
            }
        }
        let cap = self.shared.config.dial_queue_capacity;
        let dial = st.dials.entry(to.addr).or_insert_with(Dial::new);
        if dial.queued.len() >= cap {
            return Err(SendError::new(SendFailure::QueueFull, payload_of(frame)));
        }
        dial.queued.push((*to, frame));
        self.shared.ensure_dial_task(dial, to.addr);
        Ok(())
    }

    /// [`send`](Self::send) of a copy of `payload`: with the pipe up, the
    /// frame is encoded straight into its outbox, with no
    /// allocation of its own.
    pub(crate) fn send_slice(
        &self,
        to: &UniqueAddress,
        channel: Channel,
        payload: &[u8],
    ) -> Result<(), SendFailure> {
        if payload.len() > self.shared.max_payload {
            let (len, max) = (payload.len(), self.shared.max_payload);
            return Err(SendFailure::TooLarge { len, max });
        }
        let conn = {
            let st = lock(&self.shared.state);
            self.shared.check_target(&st, to)?;
            match st.conns.get(&to.addr).filter(|c| c.peer == *to) {
                // A small payload is copied in under the transport's lock
                // (cheaper than taking a reference to the pipe); a large one
                // outside it, so it does not hold up every other send.
                Some(c) if payload.len() <= COPY_UNDER_LOCK => {
                    return c.push_oneway(channel, payload);
                }
                found => found.cloned(),
            }
        };
        if let Some(c) = conn {
            return c.push_oneway(channel, payload);
        }
        // No pipe to `to` yet, or another identity at its address.
        self.send(to, channel, Bytes::copy_from_slice(payload))
            .map_err(|e| e.reason)
    }

    /// Sends a request to `to` on `channel` and waits for its reply, at most
    /// `timeout` in all (connecting included).
    ///
    /// On timeout, or when the future is dropped, the pending entry is
    /// removed. If the connection drops while the request is pending, it
    /// fails at once with [`RequestError::ConnectionLost`].
    pub async fn request(
        &self,
        to: &UniqueAddress,
        channel: Channel,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Bytes, RequestError> {
        let deadline = after(timeout);
        if payload.len() > self.shared.max_payload {
            let reason = SendFailure::TooLarge {
                len: payload.len(),
                max: self.shared.max_payload,
            };
            return Err(SendError::new(reason, payload).into());
        }
        let conn = match self.shared.current_conn(to) {
            Err(reason) => return Err(SendError::new(reason, payload).into()),
            Ok(Some(conn)) => conn,
            Ok(None) => {
                let found = match tokio::time::timeout_at(deadline, self.connect(to.addr)).await {
                    Err(_) => return Err(RequestError::Timeout),
                    Ok(result) => result?,
                };
                if found != *to {
                    return Err(RequestError::WrongPeer { found });
                }
                match self.shared.current_conn(to) {
                    Err(reason) => return Err(SendError::new(reason, payload).into()),
                    Ok(Some(conn)) => conn,
                    Ok(None) => return Err(RequestError::ConnectionLost),
                }
            }
        };
        let Some((corr, rx)) = conn.register() else {
            return Err(RequestError::ConnectionLost);
        };
        let mut guard = PendingGuard {
            conn: &conn,
            corr,
            armed: true,
        };
        conn.enqueue(Frame::Request {
            corr,
            channel,
            payload,
        })
        .map_err(queue_error)?;
        let outcome = tokio::time::timeout_at(deadline, rx).await;
        guard.armed = outcome.is_err();
        match outcome {
            Err(_) => Err(RequestError::Timeout),
            Ok(Err(_)) => Err(RequestError::ConnectionLost),
            Ok(Ok(result)) => result,
        }
    }

    /// Marks `peer` down: its pipe stops dispatching and closes after
    /// writing out what its outbox holds, within a second (pending requests
    /// fail, [`TransportEvent::Disconnected`] with
    /// [`DisconnectReason::MarkedDown`]), frames waiting in a dial queue for
    /// it are dropped, every later send or request to it
    /// fails at once with [`SendFailure::MarkedDown`], and its handshakes are
    /// refused with `Reject{Quarantined}`. It is final for that identity; a
    /// restarted node has a new one.
    pub fn mark_down(&self, peer: &UniqueAddress) {
        let closing = {
            let mut st = lock(&self.shared.state);
            st.down.insert(*peer);
            if let Some(dial) = st.dials.get_mut(&peer.addr) {
                dial.queued.retain(|(to, _)| to != peer);
            }
            let current = st.conns.get(&peer.addr).is_some_and(|c| c.peer == *peer);
            let conn = if current {
                st.conns.remove(&peer.addr)
            } else {
                None
            };
            if conn.is_some() {
                st.emit(TransportEvent::Disconnected {
                    peer: *peer,
                    reason: DisconnectReason::MarkedDown,
                });
            }
            conn
        };
        tracing::info!(peer = %peer, "marked down");
        if let Some(conn) = closing {
            // Frames already queued (the last gossip telling the member it
            // is out) are still written; nothing more is read from it.
            conn.close_after_flush(DisconnectReason::MarkedDown);
            conn.fail_pending();
        }
    }

    /// Whether `peer` was marked down.
    pub fn is_marked_down(&self, peer: &UniqueAddress) -> bool {
        lock(&self.shared.state).down.contains(peer)
    }

    /// Stops accepting, closes every pipe (pending requests fail), fails
    /// waiting connects, and waits until the listener is released.
    pub async fn shutdown(&self) {
        self.shared.close_all();
        let task = lock(&self.shared.accept_task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

/// `now + d`, saturating at a year from now instead of overflowing.
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d.min(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(now)
}

/// `send_slice` copies payloads up to this size into a pipe's outbox under
/// the transport's lock; larger ones after it is released.
const COPY_UNDER_LOCK: usize = 16 * 1024;

fn queue_error((reason, frame): Refused) -> SendError {
    SendError::new(reason, payload_of(frame))
}

/// What a dial attempt led to.
enum Dialed {
    /// A new pipe, installed.
    Connected(Arc<Conn>),
    /// A pipe to the same identity already exists and wins; use it.
    Existing(Arc<Conn>),
}

impl Shared {
    fn local_handshake(&self) -> Local<'_> {
        Local {
            me: self.local,
            cluster: &self.config.cluster_name,
            secret: &self.config.secret,
        }
    }

    fn check_target(&self, st: &State, to: &UniqueAddress) -> Result<(), SendFailure> {
        if st.closed {
            Err(SendFailure::ShutDown)
        } else if st.down.contains(to) {
            Err(SendFailure::MarkedDown)
        } else {
            Ok(())
        }
    }

    /// The established pipe to exactly `to`, `None` if there is none yet.
    fn current_conn(&self, to: &UniqueAddress) -> Result<Option<Arc<Conn>>, SendFailure> {
        let st = lock(&self.state);
        self.check_target(&st, to)?;
        match st.conns.get(&to.addr) {
            Some(c) if c.peer == *to => Ok(Some(c.clone())),
            Some(c) if to.is_older_than(&c.peer) => Err(SendFailure::Stale),
            _ => Ok(None),
        }
    }

    fn ensure_dial_task(self: &Arc<Self>, dial: &mut Dial, addr: SocketAddr) {
        if !dial.task {
            dial.task = true;
            self.runtime.spawn(dial_loop(self.clone(), addr));
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

    /// Admission of an inbound handshake right after its `Hello`. When
    /// admitted, the handshake holds the peer address's slot until `slot` is
    /// dropped, so no dial to that address starts meanwhile.
    fn admit_inbound(&self, peer: &UniqueAddress, slot: &InboundSlot) -> Result<(), RejectReason> {
        let mut st = lock(&self.state);
        if st.closed {
            return Err(RejectReason::ShuttingDown);
        }
        if st.down.contains(peer) {
            return Err(RejectReason::Quarantined);
        }
        // Simultaneous connect: while our own dial to that node is under way,
        // the connection dialed by the lower node id wins.
        let dialing = st.dials.get(&peer.addr).is_some_and(|d| d.connecting);
        if dialing && self.local.node_id < peer.node_id {
            return Err(RejectReason::Duplicate);
        }
        *st.inbound.entry(peer.addr).or_insert(0) += 1;
        *lock(&slot.addr) = Some(peer.addr);
        Ok(())
    }

    /// Admission of the acceptor, on the dialing side, at its `Welcome`.
    fn admit_outbound(&self, peer: &UniqueAddress) -> Result<(), RejectReason> {
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
    fn install(&self, st: &mut State, conn: &Arc<Conn>) -> Result<(), RejectReason> {
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
            None => st.emit(TransportEvent::Connected { peer: conn.peer }),
        }
        Self::flush_dial(st, addr, conn);
        Ok(())
    }

    /// Moves frames waiting in `addr`'s dial queue into `conn` (those meant
    /// for its identity; others are dropped) and answers waiting connects.
    fn flush_dial(st: &mut State, addr: SocketAddr, conn: &Conn) {
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

    /// Installs a handshaken stream as a pipe and starts its tasks. On
    /// refusal, tells the peer `Reject{reason}`.
    async fn start_conn(
        self: &Arc<Self>,
        mut stream: HandshakeStream,
        peer: UniqueAddress,
        initiator: NodeId,
        first: Option<Frame>,
    ) -> Result<Arc<Conn>, RejectReason> {
        let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
        let sockets = (
            stream.get_ref().local_addr().unwrap_or(unspecified),
            stream.get_ref().peer_addr().unwrap_or(unspecified),
        );
        let id = self.next_conn_id.fetch_add(1, Ordering::Relaxed);
        let conn = Conn::new(
            id,
            peer,
            initiator,
            sockets,
            (self.config.send_queue_capacity, self.codec),
            self.control.clone(),
        );
        let conn = Arc::new(conn);
        let installed = {
            let mut st = lock(&self.state);
            self.install(&mut st, &conn)
        };
        if let Err(reason) = installed {
            let reject = stream.send(Frame::Reject {
                reason: reason.clone(),
            });
            let _ = tokio::time::timeout(self.config.handshake_timeout, reject).await;
            return Err(reason);
        }
        let parts = stream.into_parts();
        let (read_half, write_half) = parts.io.into_split();
        let mut leftover = BytesMut::with_capacity(READ_BUF.max(parts.read_buf.len()));
        leftover.extend_from_slice(&parts.read_buf);
        let (shared, writer) = (self.clone(), OutboxGuard(conn.clone()));
        self.runtime
            .spawn(write_loop(shared, writer, first, write_half));
        let (shared, reader) = (self.clone(), conn.clone());
        self.runtime
            .spawn(read_loop(shared, reader, read_half, leftover));
        tracing::debug!(peer = %peer, local = %sockets.0, remote = %sockets.1, "pipe established");
        Ok(conn)
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

    /// Serves one inbound TCP connection: handshake, then the pipe.
    /// `permit` (one of `max_inbound_handshakes`) is held until the peer is
    /// authenticated or the handshake ends.
    async fn serve_inbound(
        self: Arc<Self>,
        stream: TcpStream,
        remote: SocketAddr,
        permit: OwnedSemaphorePermit,
    ) {
        let _ = stream.set_nodelay(true);
        let mut framed = handshake_framed(stream);
        let local = self.local_handshake();
        let slot = InboundSlot {
            shared: self.clone(),
            addr: Mutex::new(None),
        };
        let handshake = handshake::accept(&mut framed, &local, |p| self.admit_inbound(p, &slot));
        let outcome = tokio::time::timeout(self.config.handshake_timeout, handshake).await;
        drop(permit);
        let peer = match outcome {
            Err(_) => {
                self.refusals
                    .log(self.local, remote, &ConnectError::Timeout);
                return;
            }
            Ok(Err(e)) => {
                self.refusals.log(self.local, remote, &e);
                return;
            }
            Ok(Ok(peer)) => peer,
        };
        if let Err(reason) = self
            .start_conn(framed, peer, peer.node_id, Some(Frame::Accepted))
            .await
        {
            let e = ConnectError::Refused(reason);
            self.refusals.log(self.local, remote, &e);
        }
    }

    /// One dial attempt: TCP connect, handshake, install.
    async fn dial_once(self: &Arc<Self>, addr: SocketAddr) -> Result<Dialed, ConnectError> {
        let stream = TcpStream::connect(addr).await?;
        let _ = stream.set_nodelay(true);
        let mut framed = handshake_framed(stream);
        let local = self.local_handshake();
        let existing = Mutex::new(None);
        let admit = |peer: &UniqueAddress| {
            let verdict = self.admit_outbound(peer);
            if verdict == Err(RejectReason::Duplicate) {
                *lock(&existing) = lock(&self.state).conns.get(&peer.addr).cloned();
            }
            verdict
        };
        let result = handshake::initiate(&mut framed, &local, addr, admit).await;
        let existing = lock(&existing).take();
        match result {
            Ok(peer) => match self
                .start_conn(framed, peer, self.local.node_id, None)
                .await
            {
                Ok(conn) => Ok(Dialed::Connected(conn)),
                Err(RejectReason::Duplicate) => match lock(&self.state).conns.get(&peer.addr) {
                    Some(c) if c.peer == peer => Ok(Dialed::Existing(c.clone())),
                    _ => Err(ConnectError::Refused(RejectReason::Duplicate)),
                },
                Err(reason) => Err(ConnectError::Refused(reason)),
            },
            Err(ConnectError::Refused(RejectReason::Duplicate)) if existing.is_some() => existing
                .map(Dialed::Existing)
                .ok_or(ConnectError::Refused(RejectReason::Duplicate)),
            Err(e) => Err(e),
        }
    }

    /// Stops everything: listener, pipes, dials.
    fn close_all(&self) {
        let (conns, waiters) = {
            let mut st = lock(&self.state);
            if st.closed {
                return;
            }
            st.closed = true;
            let conns: Vec<_> = st.conns.drain().map(|(_, c)| c).collect();
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

/// A handshake's framed stream: its codec accepts at most
/// `HANDSHAKE_MAX_FRAME_LEN`, so an unauthenticated peer cannot make this
/// node buffer more than that (plus one read) per connection.
fn handshake_framed(stream: TcpStream) -> HandshakeStream {
    Framed::with_capacity(stream, FrameCodec::new(HANDSHAKE_MAX_FRAME_LEN), 4096)
}

/// Rate-limited warnings about refused inbound handshakes: anyone who can
/// reach the port can cause one, so they must not flood the log.
#[derive(Default)]
struct RefusalLog {
    limit: WarnLimit,
}

impl RefusalLog {
    /// Logs the end of an inbound connection refused or failed before it
    /// became a pipe: expected outcomes at debug, the rest as rate-limited
    /// warnings.
    fn log(&self, local: UniqueAddress, remote: SocketAddr, e: &ConnectError) {
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

fn log_refusal(remote: SocketAddr, direction: &str, e: &ConnectError) {
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

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, remote)) => match shared.handshakes.clone().try_acquire_owned() {
                Ok(permit) => {
                    shared
                        .runtime
                        .spawn(shared.clone().serve_inbound(stream, remote, permit));
                }
                Err(_) => {
                    // Too many unauthenticated handshakes at once: close
                    // this one now, before reading anything from it.
                    drop(stream);
                    let e = ConnectError::Protocol(format!(
                        "more than {} inbound handshakes at once; connection closed",
                        shared.config.max_inbound_handshakes
                    ));
                    shared.refusals.log(shared.local, remote, &e);
                }
            },
            Err(e) => {
                // Typically out of file descriptors: pause instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::select! {
                    _ = shared.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        }
    }
}

/// Whether a dial to `addr` has nothing left to do: the transport closed, or
/// a pipe to `addr` exists (then the dial is finished with it). Checked
/// before and again after each wait, since either can change meanwhile.
fn dial_settled(st: &mut State, addr: SocketAddr) -> bool {
    if st.closed {
        return true;
    }
    match st.conns.get(&addr).cloned() {
        Some(conn) => {
            finish_dial(st, addr, &conn);
            true
        }
        None => false,
    }
}

/// Dials `addr` until a pipe exists or an attempt fails, honouring backoff.
async fn dial_loop(shared: Arc<Shared>, addr: SocketAddr) {
    loop {
        // Wait for the attempt time, unless a pipe appears meanwhile.
        let (at, slot_released) = {
            let mut st = lock(&shared.state);
            if dial_settled(&mut st, addr) {
                return;
            }
            let inbound = st.inbound.contains_key(&addr);
            match st.dials.get_mut(&addr) {
                Some(d) if inbound && !deferral_over(d) => {
                    // Someone dialing us claims that address: normally the
                    // peer itself, whose pipe is the one to be. The claim is
                    // not proven yet, so wait for that handshake to end, but
                    // at most one handshake timeout from the first deferral:
                    // a genuine handshake has ended by then.
                    let timeout = shared.config.handshake_timeout;
                    let until = *d.deferred_until.get_or_insert_with(|| after(timeout));
                    tracing::trace!(%addr, "dial deferred to an inbound handshake");
                    (until, Some(shared.slots.notified()))
                }
                Some(d) => (d.next_attempt, None),
                None => return,
            }
        };
        if let Some(released) = slot_released {
            tokio::select! {
                _ = shared.shutdown.cancelled() => return,
                _ = released => {}
                _ = tokio::time::sleep_until(at) => {}
            }
            continue;
        }
        tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(at) => {}
        }
        {
            let mut st = lock(&shared.state);
            if dial_settled(&mut st, addr) {
                return;
            }
            let inbound = st.inbound.contains_key(&addr);
            match st.dials.get_mut(&addr) {
                Some(d) if inbound && !deferral_over(d) => continue,
                Some(d) => {
                    d.connecting = true;
                    d.deferred_until = None;
                }
                None => return,
            }
        }
        let attempt = tokio::time::timeout(shared.config.handshake_timeout, shared.dial_once(addr));
        let result = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            r = attempt => r.unwrap_or(Err(ConnectError::Timeout)),
        };
        let mut st = lock(&shared.state);
        if let Some(d) = st.dials.get_mut(&addr) {
            d.connecting = false;
        }
        match result {
            Ok(Dialed::Connected(conn) | Dialed::Existing(conn)) => {
                finish_dial(&mut st, addr, &conn);
                return;
            }
            Err(
                ConnectError::Refused(RejectReason::Duplicate)
                | ConnectError::Rejected(RejectReason::Duplicate),
            ) => {
                // The peer's own dial wins; its pipe is on the way. Look
                // again shortly, keeping the queue.
                if let Some(d) = st.dials.get_mut(&addr) {
                    d.next_attempt = after(shared.config.backoff_min);
                    d.last_error = None;
                }
            }
            Err(e) => {
                log_refusal(addr, "outbound", &e);
                let Some(d) = st.dials.get_mut(&addr) else {
                    return;
                };
                d.failures = d.failures.saturating_add(1);
                d.next_attempt = after(shared.config.backoff(d.failures));
                d.last_error = Some(e.clone());
                if !d.queued.is_empty() {
                    tracing::debug!(%addr, dropped = d.queued.len(), error = %e, "dial failed; queued frames dropped");
                    d.queued.clear();
                }
                for w in d.waiters.drain(..) {
                    let _ = w.send(Err(e.clone()));
                }
                d.task = false;
                return;
            }
        }
    }
}

/// Whether a dial deferred to an inbound handshake has waited long enough.
fn deferral_over(d: &Dial) -> bool {
    d.deferred_until.is_some_and(|u| Instant::now() >= u)
}

/// An inbound handshake's hold on its peer's address (see `State::inbound`).
/// Released when the handshake task ends, however it ends; if no pipe came
/// of it, whatever queued meanwhile gets a dial of its own.
struct InboundSlot {
    shared: Arc<Shared>,
    addr: Mutex<Option<SocketAddr>>,
}

impl Drop for InboundSlot {
    fn drop(&mut self) {
        let Some(addr) = lock(&self.addr).take() else {
            return;
        };
        let mut st = lock(&self.shared.state);
        if let Some(n) = st.inbound.get_mut(&addr) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.inbound.remove(&addr);
            }
        }
        self.shared.slots.notify_waiters();
        if st.closed || st.inbound.contains_key(&addr) {
            return;
        }
        if let Some(conn) = st.conns.get(&addr).cloned() {
            Shared::flush_dial(&mut st, addr, &conn);
            return;
        }
        if let Some(d) = st.dials.get_mut(&addr)
            && (!d.queued.is_empty() || !d.waiters.is_empty())
        {
            self.shared.ensure_dial_task(d, addr);
        }
    }
}

/// Ends a dial task: flush into the pipe that exists now.
fn finish_dial(st: &mut State, addr: SocketAddr, conn: &Conn) {
    if let Some(d) = st.dials.get_mut(&addr) {
        d.task = false;
        d.connecting = false;
    }
    Shared::flush_dial(st, addr, conn);
}
