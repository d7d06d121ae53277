//! One established connection: its state and outbox (the lanes senders
//! encode frames into), its pending requests, and the handles given to upper
//! layers for inbound traffic. Its reader and writer tasks are in
//! `reader.rs` and `writer.rs`; this file knows nothing of the table.

use std::collections::HashMap;

use std::net::SocketAddr;

use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};

use tokio::sync::{Notify, oneshot};

use tokio::time::Instant;

use tokio_util::codec::Encoder;

use tokio_util::sync::CancellationToken;

use super::error::{RequestError, SendError, SendFailure};

use super::events::DisconnectReason;

use crate::model::identity::{NodeId, UniqueAddress};

use crate::wire::{Channel, Frame, FrameCodec, LEN_PREFIX, RemoteFailure, ReplyResult, WireError};

/// Most bytes one writer batch holds, its urgent frames included: the whole
/// urgent lane goes in first, then bulk frames while the batch stays within
/// this (a bulk frame that would push a non-empty batch past it waits for
/// the next batch). So a control frame queued behind bulk data waits for at
/// most one batch of 1 MiB (or one single larger frame) to be written.
pub(crate) const MAX_BATCH_BYTES: usize = 1 << 20;

/// A writer batch or outbox lane whose allocation grew past this is given
/// back once empty, so one burst does not pin its memory for the
/// connection's life.
const KEEP_BUF: usize = 1 << 20;

/// Empties `buf`, and gives its allocation back if it grew past `KEEP_BUF`
/// (`try_reclaim` sees the whole allocation, which `capacity` does not
/// after `advance`).
pub(crate) fn clear_and_shrink(buf: &mut BytesMut) {
    buf.clear();
    if buf.try_reclaim(KEEP_BUF + 1) {
        *buf = BytesMut::new();
    }
}

/// Read buffer of a connection's reader.
pub(crate) const READ_BUF: usize = 64 * 1024;

type Waiter = oneshot::Sender<Result<Bytes, RequestError>>;

/// Requests sent on a connection and not yet answered.
pub(crate) struct Pending {
    /// False once the connection is gone: no new request may register.
    open: bool,
    waiters: HashMap<u64, Waiter>,
}

/// Locks a mutex, ignoring poisoning (the data stay consistent: every
/// critical section here is a few map operations, or the encoding of one of
/// our own frame types into a buffer, none of which panic midway).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An established, authenticated connection to one peer.
pub(crate) struct Conn {
    /// Unique among this transport's connections.
    pub(crate) id: u64,
    /// The peer's identity, proven in the handshake.
    pub(crate) peer: UniqueAddress,
    /// The pipe's protocol version: the lower of the two announced in the
    /// handshake. A payload in a form a later version introduced goes
    /// only over a pipe at least that version (`Transport::send_slice_if`).
    pub(crate) version: u16,
    /// The node id of the side that dialed this connection.
    pub(crate) initiator: NodeId,
    /// Local end of the TCP connection.
    pub(crate) local_socket: SocketAddr,
    /// Remote end of the TCP connection.
    pub(crate) remote_socket: SocketAddr,
    /// Frames waiting for the writer, already encoded.
    pub(crate) outbox: Mutex<Outbox>,
    /// Woken when the outbox goes from empty to not empty.
    pub(crate) ready: Notify,
    /// Most frames each lane of the outbox holds.
    pub(crate) capacity: usize,
    pub(crate) codec: FrameCodec,
    /// The control channels (`TransportConfig::control_channels`).
    pub(crate) control: Arc<[Channel]>,
    pub(crate) pending: Mutex<Pending>,
    pub(crate) next_corr: AtomicU64,
    pub(crate) cancel: CancellationToken,
    /// Stop dispatching, flush what is queued, then close (see `close_after_flush`).
    pub(crate) closing: CancellationToken,
    /// When `closing` was first asked for; set before `closing` is
    /// cancelled, and only then.
    pub(crate) closing_at: OnceLock<Instant>,
    /// The reader task has ended.
    pub(crate) reader_done: CancellationToken,
    pub(crate) reason: OnceLock<DisconnectReason>,
}

/// A connection's outbound frames, encoded as they go on the wire. Senders
/// append under the lock; the writer takes whole runs of frames. The two
/// lanes: `urgent` for the control channels (and replies to requests on
/// them), written first; `bulk` for everything else.
#[derive(Default)]
pub(crate) struct Outbox {
    urgent: BytesMut,
    urgent_frames: usize,
    bulk: BytesMut,
    bulk_frames: usize,
    /// The writer has ended: nothing more is accepted.
    closed: bool,
}

impl Outbox {
    fn is_empty(&self) -> bool {
        self.urgent_frames == 0 && self.bulk_frames == 0
    }
}

/// Why a frame was not queued.
pub(crate) type Refused = (SendFailure, Frame);

impl Conn {
    /// A connection whose outbox holds `capacity` frames in each lane.
    pub(crate) fn new(
        id: u64,
        (peer, version): (UniqueAddress, u16),
        initiator: NodeId,
        sockets: (SocketAddr, SocketAddr),
        (capacity, codec): (usize, FrameCodec),
        control: Arc<[Channel]>,
    ) -> Self {
        Conn {
            id,
            peer,
            version,
            initiator,
            local_socket: sockets.0,
            remote_socket: sockets.1,
            outbox: Mutex::new(Outbox::default()),
            ready: Notify::new(),
            capacity: capacity.max(1),
            codec,
            control,
            pending: Mutex::new(Pending {
                open: true,
                waiters: HashMap::new(),
            }),
            next_corr: AtomicU64::new(1),
            cancel: CancellationToken::new(),
            closing: CancellationToken::new(),
            closing_at: OnceLock::new(),
            reader_done: CancellationToken::new(),
            reason: OnceLock::new(),
        }
    }

    /// Whether traffic on `channel` takes the urgent lane.
    pub(crate) fn is_urgent(&self, channel: Channel) -> bool {
        self.control.contains(&channel)
    }

    /// Queues `frame` on its lane without waiting.
    #[allow(clippy::result_large_err)] // gives the frame back
    pub(crate) fn enqueue(&self, frame: Frame) -> Result<(), Refused> {
        let urgent = match &frame {
            Frame::Oneway { channel, .. } | Frame::Request { channel, .. } => {
                self.is_urgent(*channel)
            }
            _ => false,
        };
        self.push(urgent, frame)
    }

    /// Encodes `frame` at the end of a lane of the outbox (see `queue`).
    #[allow(clippy::result_large_err)] // gives the frame back
    pub(crate) fn push(&self, urgent: bool, frame: Frame) -> Result<(), Refused> {
        self.queue(urgent, |codec, buf| codec.encode(&frame, buf))
            .map_err(|reason| (reason, frame))
    }

    /// Queues a `Oneway` frame carrying a copy of `payload`.
    pub(crate) fn push_oneway(&self, channel: Channel, payload: &[u8]) -> Result<(), SendFailure> {
        self.queue(self.is_urgent(channel), |codec, buf| {
            codec.encode_oneway(channel, payload, buf)
        })
    }

    /// Appends one frame, written by `encode`, to a lane of the outbox, and
    /// wakes the writer if the outbox was empty. A full lane (`capacity`
    /// frames not yet taken by the writer) refuses with `QueueFull`, a
    /// closed one with `ConnectionClosed`.
    pub(crate) fn queue(
        &self,
        urgent: bool,
        encode: impl FnOnce(&mut FrameCodec, &mut BytesMut) -> Result<(), WireError>,
    ) -> Result<(), SendFailure> {
        let mut out = lock(&self.outbox);
        if out.closed {
            return Err(SendFailure::ConnectionClosed);
        }
        let was_empty = out.is_empty();
        let out = &mut *out;
        let (buf, frames) = if urgent {
            (&mut out.urgent, &mut out.urgent_frames)
        } else {
            (&mut out.bulk, &mut out.bulk_frames)
        };
        if *frames >= self.capacity {
            return Err(SendFailure::QueueFull);
        }
        let mut codec = self.codec;
        match encode(&mut codec, buf) {
            Ok(()) => *frames += 1,
            Err(WireError::FrameTooLarge { len, max }) => {
                let len = usize::try_from(len).unwrap_or(usize::MAX);
                return Err(SendFailure::TooLarge { len, max });
            }
            Err(e) => {
                // Only frames serde writes can get here (replies with an
                // error, rejections; never `Oneway`, `Request` or an `Ok`
                // reply, which are written by hand), and those encode.
                // Dropped and logged all the same, as a lost frame.
                tracing::warn!(peer = %self.peer, error = %e, "dropping a frame that cannot be encoded");
                return Ok(());
            }
        }
        if was_empty {
            self.ready.notify_one();
        }
        Ok(())
    }

    /// Moves the next run of queued frames into the empty `batch`: all the
    /// urgent ones, then bulk ones while the batch stays within
    /// `MAX_BATCH_BYTES` (at least one frame). Returns how many.
    pub(crate) fn take(&self, batch: &mut BytesMut) -> usize {
        debug_assert!(batch.is_empty());
        let mut out = lock(&self.outbox);
        let out = &mut *out;
        let mut n = std::mem::take(&mut out.urgent_frames);
        if n > 0 {
            std::mem::swap(batch, &mut out.urgent);
        }
        if out.bulk_frames == 0 {
            return n;
        }
        let room = MAX_BATCH_BYTES.saturating_sub(batch.len());
        if out.bulk.len() <= room {
            n += std::mem::take(&mut out.bulk_frames);
            if batch.is_empty() {
                std::mem::swap(batch, &mut out.bulk);
            } else {
                batch.extend_from_slice(&out.bulk);
                clear_and_shrink(&mut out.bulk);
            }
            return n;
        }
        // Only part of the bulk lane fits: whole frames, by their length
        // prefixes, and at least one into an empty batch.
        let (mut end, mut frames) = (0, 0);
        while end < out.bulk.len() {
            let len = u32::from_be_bytes(
                out.bulk[end..end + LEN_PREFIX]
                    .try_into()
                    .expect("a length prefix"),
            ) as usize;
            let next = end + LEN_PREFIX + len;
            if next > room && (end > 0 || !batch.is_empty()) {
                break;
            }
            (end, frames) = (next, frames + 1);
        }
        batch.extend_from_slice(&out.bulk[..end]);
        out.bulk.advance(end);
        out.bulk_frames -= frames;
        n + frames
    }

    /// The writer ended: refuse new frames and drop those queued.
    pub(crate) fn close_outbox(&self) {
        let mut out = lock(&self.outbox);
        *out = Outbox {
            closed: true,
            ..Outbox::default()
        };
    }

    /// Whether `close_after_flush` was called. An atomic load (the
    /// token's own `is_cancelled` takes a lock), so the read and write loops
    /// can check it for every frame and batch.
    pub(crate) fn is_closing(&self) -> bool {
        self.closing_at.get().is_some()
    }

    /// By when a closing connection must have written its queued frames and
    /// shut down its write half.
    pub(crate) fn flush_deadline(&self) -> Instant {
        *self.closing_at.get_or_init(Instant::now) + FLUSH_LIMIT
    }

    /// Closes the connection now: both tasks stop, the socket is dropped,
    /// pending requests fail. The first reason given wins.
    pub(crate) fn close(&self, reason: DisconnectReason) {
        let _ = self.reason.set(reason);
        self.cancel.cancel();
    }

    /// Closes the connection after writing what is already queued: the
    /// reader stops dispatching at once (nothing more is accepted from the
    /// peer) but keeps reading and discarding, so that no unread input makes
    /// the kernel answer our close with a reset (which would discard the
    /// frames we just flushed); the writer writes both lanes out and shuts
    /// down its half — within `FLUSH_LIMIT`, so a peer that stopped reading
    /// cannot hold the task — then waits (at most `FLUSH_LIMIT` more) for
    /// the reader to see the peer close, then closes the socket. `mark_down`
    /// uses it, so that the last gossip membership queued for a member it
    /// removes still reaches it.
    pub(crate) fn close_after_flush(&self, reason: DisconnectReason) {
        let _ = self.reason.set(reason);
        let _ = self.closing_at.set(Instant::now());
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
    /// The connection the request came in on; `None` once answered.
    conn: Option<Arc<Conn>>,
    /// The reply takes the urgent lane (a request on a control channel).
    urgent: bool,
    max_payload: usize,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("id", &self.id)
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl ReplyHandle {
    pub(crate) fn new(corr: u64, conn: Arc<Conn>, urgent: bool, max_payload: usize) -> Self {
        ReplyHandle {
            corr,
            conn: Some(conn),
            urgent,
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
        let Some(conn) = self.conn.take() else {
            return Err((SendFailure::ConnectionClosed, Bytes::new()));
        };
        let reply = Frame::Reply {
            corr: self.corr,
            result,
        };
        conn.push(self.urgent, reply)
            .map_err(|(reason, frame)| (reason, payload_of(frame)))
    }
}

impl Drop for ReplyHandle {
    fn drop(&mut self) {
        if self.conn.is_some() {
            let _ = self.answer(ReplyResult::Err(RemoteFailure::Dropped));
        }
    }
}

/// How long a closing connection may spend writing its last frames; it then
/// waits at most as long again for the peer to close its side.
pub(crate) const FLUSH_LIMIT: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_util::codec::Decoder;

    fn conn(capacity: usize) -> Conn {
        let addr: SocketAddr = "127.0.0.1:1".parse().expect("literal");
        let peer = UniqueAddress::new_at(addr);
        let codec = FrameCodec::new(crate::wire::DEFAULT_MAX_FRAME_LEN);
        let control: Arc<[Channel]> = Arc::from(vec![1]);
        Conn::new(
            1,
            (peer, crate::wire::PROTOCOL_VERSION),
            peer.node_id,
            (addr, addr),
            (capacity, codec),
            control,
        )
    }

    /// The frames of one batch: (channel, payload length) of each `Oneway`,
    /// (`u16::MAX`, corr) of each `Reply`.
    fn frames_of(mut batch: BytesMut) -> Vec<(Channel, usize)> {
        let mut codec = FrameCodec::new(crate::wire::DEFAULT_MAX_FRAME_LEN);
        let mut out = Vec::new();
        while let Some(frame) = codec.decode(&mut batch).expect("a valid batch") {
            match frame {
                Frame::Oneway { channel, payload } => out.push((channel, payload.len())),
                Frame::Reply { corr, .. } => out.push((u16::MAX, corr as usize)),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(batch.is_empty(), "a batch ends on a frame boundary");
        out
    }

    /// Takes one batch: its frame count and frames.
    fn take(c: &Conn) -> (usize, Vec<(Channel, usize)>) {
        let mut batch = BytesMut::new();
        let n = c.take(&mut batch);
        (n, frames_of(batch))
    }

    const K400: usize = 400 * 1024;

    #[test]
    fn bulk_frames_are_taken_whole_up_to_a_mebibyte_and_a_larger_one_alone() {
        let c = conn(16);
        for _ in 0..3 {
            c.push_oneway(2, &[7u8; K400]).expect("room");
        }
        c.push_oneway(2, &vec![1u8; 2 << 20]).expect("room");
        assert_eq!(take(&c), (2, vec![(2, K400), (2, K400)]));
        assert_eq!(take(&c), (1, vec![(2, K400)]));
        assert_eq!(take(&c), (1, vec![(2, 2 << 20)]), "alone");
        assert_eq!(take(&c), (0, vec![]));
        // A few small frames: the whole lane at once.
        for i in 0..5 {
            c.push_oneway(2, &[0u8; 10][..i]).expect("room");
        }
        assert_eq!(take(&c).1, (0..5).map(|i| (2, i)).collect::<Vec<_>>());
    }

    #[test]
    fn the_urgent_lane_goes_first_and_counts_against_the_batch() {
        let c = conn(16);
        for _ in 0..3 {
            c.push_oneway(2, &[7u8; K400]).expect("room");
        }
        c.push_oneway(1, b"heartbeat").expect("room");
        assert_eq!(take(&c), (3, vec![(1, 9), (2, K400), (2, K400)]));
        assert_eq!(take(&c), (1, vec![(2, K400)]));
        // A bulk frame that does not fit behind the urgent ones waits for
        // the next batch, whether it is larger than a batch or not.
        c.push_oneway(2, &vec![1u8; 2 << 20]).expect("room");
        c.push_oneway(1, b"gossip").expect("room");
        assert_eq!(take(&c), (1, vec![(1, 6)]));
        assert_eq!(take(&c), (1, vec![(2, 2 << 20)]));
        c.push_oneway(2, &[2u8; 200 * 1024]).expect("room");
        c.push_oneway(1, &[3u8; 900 * 1024]).expect("room");
        assert_eq!(take(&c), (1, vec![(1, 900 * 1024)]));
        assert_eq!(take(&c), (1, vec![(2, 200 * 1024)]));
    }

    #[test]
    fn a_reply_to_a_request_on_a_control_channel_takes_the_urgent_lane() {
        let c = Arc::new(conn(16));
        c.push_oneway(2, b"bulk").expect("room");
        ReplyHandle::new(41, c.clone(), true, 1024)
            .reply(Bytes::from_static(b"ok"))
            .expect("queued");
        ReplyHandle::new(42, c.clone(), false, 1024)
            .reply(Bytes::from_static(b"ok"))
            .expect("queued");
        // Dropped unanswered: answers `Dropped`, on its lane.
        drop(ReplyHandle::new(43, c.clone(), true, 1024));
        assert_eq!(
            take(&c),
            (
                4,
                vec![(u16::MAX, 41), (u16::MAX, 43), (2, 4), (u16::MAX, 42)]
            )
        );
    }

    #[test]
    fn a_buffer_that_grew_past_the_limit_is_given_back_once_empty() {
        let mut buf = BytesMut::with_capacity(3 << 20);
        buf.extend_from_slice(&vec![0u8; 3 << 20]);
        buf.advance(2 << 20);
        assert!(buf.capacity() <= KEEP_BUF, "capacity hides the allocation");
        clear_and_shrink(&mut buf);
        assert_eq!(buf.capacity(), 0);
        let mut small = BytesMut::with_capacity(64 * 1024);
        small.extend_from_slice(b"frame");
        clear_and_shrink(&mut small);
        assert!(small.capacity() >= 64 * 1024, "a small buffer is kept");
    }

    #[test]
    fn a_full_lane_refuses_and_a_closed_outbox_refuses_everything() {
        let c = conn(2);
        c.push_oneway(2, b"a").expect("room");
        c.push_oneway(2, b"b").expect("room");
        assert_eq!(c.push_oneway(2, b"c"), Err(SendFailure::QueueFull));
        // Each lane has its own room.
        c.push_oneway(1, b"control")
            .expect("room in the urgent lane");
        let mut batch = BytesMut::new();
        assert_eq!(c.take(&mut batch), 3);
        c.push_oneway(2, b"c").expect("room again once taken");
        c.close_outbox();
        assert_eq!(c.push_oneway(2, b"d"), Err(SendFailure::ConnectionClosed));
        batch.clear();
        assert_eq!(c.take(&mut batch), 0, "what was queued is dropped");
    }
}
