//! The [`Transport`]: the public face of the pipes — bind, register a
//! channel's handler, connect, send, request, mark down, shut down. It holds
//! the connection table (`table.rs`) and starts the accept loop
//! (`accept.rs`); dials run in `dial.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use super::accept::accept_loop;
use super::config::TransportConfig;
use super::connection::{Incoming, PendingGuard, Refused, lock, payload_of};
use super::error::{ConnectError, RegisterError, RequestError, SendError, SendFailure};
use super::events::{DisconnectReason, TransportEvent};
use super::table::{Dial, Handler, RefusalLog, Shared, State, Stats, after};
use crate::model::identity::UniqueAddress;
use crate::util::fast_hash::{FastMap, FastSet};
use crate::util::warn_limit::WarnLimit;
use crate::wire::{Channel, Frame, FrameCodec, MIN_PROTOCOL_VERSION};

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

/// Where one established pipe runs: its two TCP ends, and its protocol
/// version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ConnectionInfo {
    /// The peer at the other end.
    pub peer: UniqueAddress,
    /// This side's socket address.
    pub local_socket: SocketAddr,
    /// The peer side's socket address.
    pub remote_socket: SocketAddr,
    /// Whether this node dialed the connection.
    pub dialed_by_us: bool,
    /// The pipe's protocol version: the lower of the two the handshake
    /// announced (SPEC §9.1).
    pub version: u16,
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
        #[cfg(feature = "tls")]
        if let Some(tls) = &config.tls {
            // Every peer would refuse a certificate that does not name us.
            tls.check_own_name(local.addr).map_err(|why| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("TLS: {why}"))
            })?;
        }
        if config.tls.is_none() && !(bound.ip().is_loopback() && local.addr.ip().is_loopback()) {
            tracing::warn!(%bound, advertised = %local.addr, "PLAINTEXT pipes on a non-loopback address: frames after the handshake travel unencrypted and unauthenticated; set TransportConfig::tls (feature `tls`)");
        }
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
                conns: FastMap::default(),
                dials: HashMap::new(),
                inbound: HashMap::new(),
                down: FastSet::default(),
                subscribers: Vec::new(),
                closed: false,
            }),
            handlers: RwLock::new(HashMap::new()),
            handlers_version: AtomicU64::new(0),
            shutdown: CancellationToken::new(),
            next_conn_id: AtomicU64::new(1),
            stats: Stats::new(local.addr.to_string()),
            accept_task: Mutex::new(None),
            handshakes: Arc::new(Semaphore::new(config.max_inbound_handshakes.max(1))),
            sources: Mutex::new(HashMap::new()),
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
    /// [`RemoteFailure::Overloaded`](crate::wire::RemoteFailure::Overloaded), so one slow layer never stalls a
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
            version: c.version,
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
        match self.send_slice_if(to, channel, payload, MIN_PROTOCOL_VERSION) {
            Some(sent) => sent,
            // No pipe to `to` yet, or another identity at its address.
            None => self
                .send(to, channel, Bytes::copy_from_slice(payload))
                .map_err(|e| e.reason),
        }
    }

    /// [`send_slice`](Self::send_slice) of a payload in a form protocol
    /// version `needs` introduced: sent only over an established pipe to
    /// `to` whose version is at least `needs`. `None`, with nothing sent,
    /// when there is no such pipe (none yet, or an older one): the caller
    /// sends the message again in a form every version reads. One lookup
    /// under the transport's lock, as `send_slice`'s.
    pub(crate) fn send_slice_if(
        &self,
        to: &UniqueAddress,
        channel: Channel,
        payload: &[u8],
        needs: u16,
    ) -> Option<Result<(), SendFailure>> {
        if payload.len() > self.shared.max_payload {
            let (len, max) = (payload.len(), self.shared.max_payload);
            return Some(Err(SendFailure::TooLarge { len, max }));
        }
        let conn = {
            let st = lock(&self.shared.state);
            if let Err(failure) = self.shared.check_target(&st, to) {
                return Some(Err(failure));
            }
            match st
                .conns
                .get(&to.addr)
                .filter(|c| c.peer == *to && c.version >= needs)
            {
                // A small payload is copied in under the transport's lock
                // (cheaper than taking a reference to the pipe); a large one
                // outside it, so it does not hold up every other send.
                Some(c) if payload.len() <= COPY_UNDER_LOCK => {
                    return Some(c.push_oneway(channel, payload));
                }
                found => found.cloned(),
            }
        };
        conn.map(|c| c.push_oneway(channel, payload))
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
                self.shared.stats.metrics.pipes.decrement(1.0);
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

/// `send_slice` copies payloads up to this size into a pipe's outbox under
/// the transport's lock; larger ones after it is released.
const COPY_UNDER_LOCK: usize = 16 * 1024;

fn queue_error((reason, frame): Refused) -> SendError {
    SendError::new(reason, payload_of(frame))
}
