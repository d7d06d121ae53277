//! One established connection: its state, its writer and reader tasks, and
//! the handles given to upper layers for inbound traffic.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{Decoder, Encoder};
use tokio_util::sync::CancellationToken;

use super::error::{RequestError, SendError, SendFailure};
use super::events::DisconnectReason;
use super::pipes::Shared;
use crate::identity::{NodeId, UniqueAddress};
use crate::wire::{Channel, Frame, FrameCodec, RemoteFailure, ReplyResult};

/// Most frames one writer batch takes from the queue.
const MAX_BATCH: usize = 1024;

/// A writer buffer grown past this is dropped after the write, so one huge
/// frame does not pin its memory for the connection's life.
const KEEP_BUF: usize = 1 << 20;

/// Read buffer of a connection's reader.
pub(crate) const READ_BUF: usize = 64 * 1024;

type Waiter = oneshot::Sender<Result<Bytes, RequestError>>;

/// Requests sent on a connection and not yet answered.
struct Pending {
    /// False once the connection is gone: no new request may register.
    open: bool,
    waiters: HashMap<u64, Waiter>,
}

/// Locks a mutex, ignoring poisoning (the data stay consistent: every
/// critical section here is a few map operations that cannot panic midway).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An established, authenticated connection to one peer.
pub(crate) struct Conn {
    /// Unique among this transport's connections.
    pub(crate) id: u64,
    /// The peer's identity, proven in the handshake.
    pub(crate) peer: UniqueAddress,
    /// The node id of the side that dialed this connection.
    pub(crate) initiator: NodeId,
    /// Local end of the TCP connection.
    pub(crate) local_socket: SocketAddr,
    /// Remote end of the TCP connection.
    pub(crate) remote_socket: SocketAddr,
    /// The writer's queue.
    pub(crate) out: mpsc::Sender<Frame>,
    pending: Mutex<Pending>,
    next_corr: AtomicU64,
    cancel: CancellationToken,
    /// Stop reading now, flush what is queued, then close (see `close_after_flush`).
    closing: CancellationToken,
    reason: OnceLock<DisconnectReason>,
}

impl Conn {
    pub(crate) fn new(
        id: u64,
        peer: UniqueAddress,
        initiator: NodeId,
        sockets: (SocketAddr, SocketAddr),
        out: mpsc::Sender<Frame>,
    ) -> Self {
        Conn {
            id,
            peer,
            initiator,
            local_socket: sockets.0,
            remote_socket: sockets.1,
            out,
            pending: Mutex::new(Pending {
                open: true,
                waiters: HashMap::new(),
            }),
            next_corr: AtomicU64::new(1),
            cancel: CancellationToken::new(),
            closing: CancellationToken::new(),
            reason: OnceLock::new(),
        }
    }

    /// Closes the connection now: both tasks stop, the socket is dropped,
    /// pending requests fail. The first reason given wins.
    pub(crate) fn close(&self, reason: DisconnectReason) {
        let _ = self.reason.set(reason);
        self.cancel.cancel();
    }

    /// Closes the connection after writing what is already queued: the
    /// reader stops dispatching at once (nothing more is accepted from the
    /// peer), the writer drains its queue into one last write — bounded by
    /// `FLUSH_LIMIT`, so a peer that stopped reading cannot hold the task —
    /// then the socket closes. `mark_down` uses it, so that the last gossip
    /// membership queued for a member it removes still reaches it.
    pub(crate) fn close_after_flush(&self, reason: DisconnectReason) {
        let _ = self.reason.set(reason);
        self.closing.cancel();
    }

    /// Why the connection closed (`PeerClosed` if nobody said otherwise).
    pub(crate) fn reason(&self) -> DisconnectReason {
        self.reason
            .get()
            .cloned()
            .unwrap_or(DisconnectReason::PeerClosed)
    }

    /// Registers a pending request; `None` if the connection is gone.
    pub(crate) fn register(&self) -> Option<(u64, oneshot::Receiver<Result<Bytes, RequestError>>)> {
        let mut p = lock(&self.pending);
        if !p.open {
            return None;
        }
        let corr = self.next_corr.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        p.waiters.insert(corr, tx);
        Some((corr, rx))
    }

    /// Forgets a pending request (timeout, cancellation, send failure).
    pub(crate) fn unregister(&self, corr: u64) {
        lock(&self.pending).waiters.remove(&corr);
    }

    /// Completes a pending request with `result`, if it is still pending.
    pub(crate) fn complete(&self, corr: u64, result: Result<Bytes, RequestError>) {
        let waiter = lock(&self.pending).waiters.remove(&corr);
        match waiter {
            Some(w) => {
                let _ = w.send(result);
            }
            None => {
                tracing::debug!(peer = %self.peer, corr, "reply for no pending request (timed out?)")
            }
        }
    }

    /// Fails every pending request with `ConnectionLost` and refuses new ones.
    pub(crate) fn fail_pending(&self) {
        let waiters = {
            let mut p = lock(&self.pending);
            p.open = false;
            std::mem::take(&mut p.waiters)
        };
        for (_, w) in waiters {
            let _ = w.send(Err(RequestError::ConnectionLost));
        }
    }

    /// Requests waiting for a reply on this connection.
    pub(crate) fn pending_len(&self) -> usize {
        lock(&self.pending).waiters.len()
    }
}

/// Removes a pending entry when the waiting request future ends early
/// (timeout or the caller dropping it).
pub(crate) struct PendingGuard<'a> {
    pub(crate) conn: &'a Conn,
    pub(crate) corr: u64,
    pub(crate) armed: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.unregister(self.corr);
        }
    }
}

/// The payload inside a data frame (empty for other frames).
pub(crate) fn payload_of(frame: Frame) -> Bytes {
    match frame {
        Frame::Oneway { payload, .. } | Frame::Request { payload, .. } => payload,
        Frame::Reply {
            result: ReplyResult::Ok(payload),
            ..
        } => payload,
        _ => Bytes::new(),
    }
}

/// One inbound upper-layer message, as delivered to a channel's receiver.
#[derive(Debug)]
pub struct Incoming {
    /// The authenticated sender.
    pub from: UniqueAddress,
    /// The channel it was sent on.
    pub channel: Channel,
    /// The sender's payload, untouched.
    pub payload: Bytes,
    /// `Some` for a request: answer through it. Dropping it unanswered sends
    /// [`RemoteFailure::Dropped`] back.
    pub reply: Option<ReplyHandle>,
}

/// Answers one inbound request. Consumed by [`reply`](Self::reply) or
/// [`fail`](Self::fail); dropped unanswered it replies
/// [`RemoteFailure::Dropped`], so the requester never waits for nothing.
#[derive(Debug)]
#[must_use = "dropping a ReplyHandle answers the request with RemoteFailure::Dropped"]
pub struct ReplyHandle {
    corr: u64,
    out: Option<mpsc::Sender<Frame>>,
    max_payload: usize,
}

impl ReplyHandle {
    pub(crate) fn new(corr: u64, out: mpsc::Sender<Frame>, max_payload: usize) -> Self {
        ReplyHandle {
            corr,
            out: Some(out),
            max_payload,
        }
    }

    /// Sends `payload` as the reply (non-blocking enqueue on the connection
    /// the request came in on). On error the payload is given back; a reply
    /// too large for a frame is answered with [`RemoteFailure::Failed`].
    pub fn reply(mut self, payload: Bytes) -> Result<(), SendError> {
        if payload.len() > self.max_payload {
            let len = payload.len();
            let _ = self.answer(ReplyResult::Err(RemoteFailure::Failed(format!(
                "reply of {len} bytes exceeds the frame limit"
            ))));
            let reason = SendFailure::TooLarge {
                len,
                max: self.max_payload,
            };
            return Err(SendError::new(reason, payload));
        }
        self.answer(ReplyResult::Ok(payload))
            .map_err(|(reason, payload)| SendError::new(reason, payload))
    }

    /// Answers with [`RemoteFailure::Failed`] carrying `message`.
    pub fn fail(mut self, message: impl Into<String>) -> Result<(), SendFailure> {
        self.answer(ReplyResult::Err(RemoteFailure::Failed(message.into())))
            .map_err(|(r, _)| r)
    }

    pub(crate) fn fail_with(mut self, failure: RemoteFailure) {
        let _ = self.answer(ReplyResult::Err(failure));
    }

    fn answer(&mut self, result: ReplyResult) -> Result<(), (SendFailure, Bytes)> {
        let Some(out) = self.out.take() else {
            return Err((SendFailure::ConnectionClosed, Bytes::new()));
        };
        out.try_send(Frame::Reply {
            corr: self.corr,
            result,
        })
        .map_err(|e| match e {
            mpsc::error::TrySendError::Full(f) => (SendFailure::QueueFull, payload_of(f)),
            mpsc::error::TrySendError::Closed(f) => (SendFailure::ConnectionClosed, payload_of(f)),
        })
    }
}

impl Drop for ReplyHandle {
    fn drop(&mut self) {
        if self.out.is_some() {
            let _ = self.answer(ReplyResult::Err(RemoteFailure::Dropped));
        }
    }
}

/// How long a closing connection may spend writing its last frames.
const FLUSH_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The batching writer: waits for queued frames, yields once so producers
/// that are already runnable can add theirs, drains the queue again, encodes
/// the whole batch into one buffer and writes it with one `write_all`.
pub(crate) async fn write_loop(
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    mut rx: mpsc::Receiver<Frame>,
    mut io: OwnedWriteHalf,
) {
    let mut codec = FrameCodec::new(shared.codec.max_frame_len());
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut buf = BytesMut::with_capacity(64 * 1024);
    loop {
        let n = tokio::select! {
            biased;
            _ = conn.cancel.cancelled() => return,
            _ = conn.closing.cancelled() => {
                while let Ok(frame) = rx.try_recv() {
                    if codec.encode(&frame, &mut buf).is_err() {
                        tracing::debug!(peer = %conn.peer, "dropping an unencodable frame at close");
                    }
                }
                let flushed = tokio::time::timeout(FLUSH_LIMIT, io.write_all(&buf)).await;
                if !matches!(flushed, Ok(Ok(()))) {
                    tracing::debug!(peer = %conn.peer, "last frames not flushed before close");
                }
                let _ = tokio::time::timeout(FLUSH_LIMIT, io.shutdown()).await;
                conn.cancel.cancel();
                return;
            }
            n = rx.recv_many(&mut batch, MAX_BATCH) => n,
        };
        if n == 0 {
            let _ = io.shutdown().await;
            return;
        }
        // The writer yield (see the limits anchor): ~50 frames per write
        // under load instead of ~2.
        tokio::task::yield_now().await;
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(f) => batch.push(f),
                Err(_) => break,
            }
        }
        shared.stats.record_batch(batch.len());
        for frame in batch.drain(..) {
            if let Err(e) = codec.encode(&frame, &mut buf) {
                tracing::warn!(peer = %conn.peer, error = %e, "dropping a frame that cannot be encoded");
                if let Frame::Request { corr, .. } = frame {
                    conn.complete(corr, Err(RequestError::Encode(e.to_string())));
                }
            }
        }
        let written = tokio::select! {
            biased;
            _ = conn.cancel.cancelled() => return,
            r = io.write_all(&buf) => r,
        };
        if buf.capacity() > KEEP_BUF {
            buf = BytesMut::with_capacity(64 * 1024);
        } else {
            buf.clear();
        }
        if let Err(e) = written {
            conn.close(DisconnectReason::Io(e.to_string()));
            return;
        }
    }
}

/// The reader: decodes every complete frame it holds, dispatches them, then
/// reads more, until the connection ends; then tears it down (events,
/// pending requests).
///
/// `buf` starts with whatever arrived together with the handshake's last
/// frame; those bytes are decoded before the first read (tokio-util's
/// `FramedRead` would wait for new bytes first, stranding them).
pub(crate) async fn read_loop(
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    mut io: OwnedReadHalf,
    mut buf: BytesMut,
) {
    let mut codec = shared.codec;
    let reason = 'conn: loop {
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(frame)) => {
                    if let Err(reason) = dispatch(&shared, &conn, frame) {
                        break 'conn Some(reason);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(peer = %conn.peer, error = %e, "bad frame; closing this connection");
                    break 'conn Some(DisconnectReason::Malformed(e.to_string()));
                }
            }
        }
        if buf.capacity() - buf.len() < READ_BUF / 4 {
            buf.reserve(READ_BUF);
        }
        let read = tokio::select! {
            biased;
            _ = conn.cancel.cancelled() => break None,
            _ = conn.closing.cancelled() => break None,
            read = io.read_buf(&mut buf) => read,
        };
        match read {
            Ok(0) => break Some(DisconnectReason::PeerClosed),
            Ok(_) => {}
            Err(e) => break Some(DisconnectReason::Io(e.to_string())),
        }
    };
    if let Some(reason) = reason {
        conn.close(reason);
    }
    shared.connection_ended(&conn);
}

/// Handles one inbound frame on an established connection.
fn dispatch(shared: &Shared, conn: &Conn, frame: Frame) -> Result<(), DisconnectReason> {
    match frame {
        Frame::Oneway { channel, payload } => {
            shared.deliver(Incoming {
                from: conn.peer,
                channel,
                payload,
                reply: None,
            });
            Ok(())
        }
        Frame::Request {
            corr,
            channel,
            payload,
        } => {
            let reply = ReplyHandle::new(corr, conn.out.clone(), shared.max_payload);
            shared.deliver(Incoming {
                from: conn.peer,
                channel,
                payload,
                reply: Some(reply),
            });
            Ok(())
        }
        Frame::Reply { corr, result } => {
            let result = match result {
                ReplyResult::Ok(bytes) => Ok(bytes),
                ReplyResult::Err(failure) => Err(RequestError::Remote(failure)),
            };
            conn.complete(corr, result);
            Ok(())
        }
        Frame::Reject { reason } => {
            tracing::warn!(peer = %conn.peer, ?reason, "peer rejected the connection");
            Err(DisconnectReason::RejectedByPeer(reason))
        }
        Frame::Hello { .. } | Frame::Welcome { .. } | Frame::Proof { .. } | Frame::Accepted => {
            tracing::warn!(peer = %conn.peer, "handshake frame on an established connection");
            Err(DisconnectReason::ProtocolViolation)
        }
    }
}
