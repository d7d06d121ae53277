//! A pipe's reader task: reads the stream, hands each frame to its channel
//! (a borrowed handler's oneway in place), and tears the pipe down when the
//! stream ends. Generic over the stream's read half.

use std::sync::Arc;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::codec::Decoder;

use super::connection::{Conn, Incoming, READ_BUF, ReplyHandle};
use super::error::RequestError;
use super::events::DisconnectReason;
use super::table::{BorrowedHandler, Shared};
use crate::util::warn_limit::warn_limited;
use crate::wire::{Channel, Frame, FrameCodec, ReplyResult};

/// The reader: handles every complete frame it holds (a canonical `Oneway`
/// on a borrowed channel in place, see `Borrowed`; others decoded and
/// dispatched), then
/// reads more, until the connection ends; then tears it down (events,
/// pending requests).
///
/// `buf` starts with whatever arrived together with the handshake's last
/// frame; those bytes are decoded before the first read (tokio-util's
/// `FramedRead` would wait for new bytes first, stranding them).
pub(crate) async fn read_loop<R: AsyncRead + Unpin>(
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    mut io: R,
    mut buf: BytesMut,
) {
    let mut codec = shared.codec;
    let mut borrowed = Borrowed::default();
    // Made once, not per read: a cancellation future registers with its
    // token when first polled, and unregisters when dropped.
    let cancelled = conn.cancel.cancelled();
    let closing = conn.closing.cancelled();
    tokio::pin!(cancelled, closing);
    let reason = 'conn: loop {
        loop {
            if conn.is_closing() {
                break 'conn discard_until_closed(&conn, &mut io, buf).await;
            }
            if let Some(total) = borrowed.deliver(&shared, &conn, &codec, &buf) {
                buf.advance(total);
                continue;
            }
            match codec.decode(&mut buf) {
                Ok(Some(frame)) => {
                    if let Err(reason) = dispatch(&shared, &conn, frame) {
                        break 'conn Some(reason);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    warn_limited!(shared.bad_input, "bad frame; closing this connection"; peer = %conn.peer, error = %e);
                    break 'conn Some(DisconnectReason::Malformed(e.to_string()));
                }
            }
        }
        if buf.capacity() - buf.len() < READ_BUF / 4 {
            buf.reserve(READ_BUF);
        }
        let read = tokio::select! {
            biased;
            _ = &mut cancelled => break None,
            // (`is_closing` is true once this fires.)
            _ = &mut closing => continue,
            read = io.read_buf(&mut buf) => read,
        };
        match read {
            Ok(0) => break Some(DisconnectReason::PeerClosed),
            Ok(_) => {}
            // A TLS peer that closed without a close_notify (it crashed, or
            // dropped the pipe): closed, as a TCP peer's end of stream is.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                break Some(DisconnectReason::PeerClosed);
            }
            Err(e) => break Some(DisconnectReason::Io(e.to_string())),
        }
    };
    if let Some(reason) = reason {
        conn.close(reason);
    }
    conn.reader_done.cancel();
    shared.connection_ended(&conn);
}

/// A reader's copy of the transport's borrowed handlers (channels whose
/// oneway payloads are handed over in place), refreshed when they change.
#[derive(Default)]
pub(crate) struct Borrowed {
    version: Option<u64>,
    handlers: Vec<(Channel, BorrowedHandler)>,
}

impl Borrowed {
    /// If the complete frame at the start of `buf` is a canonical `Oneway`
    /// on a channel with a borrowed handler, calls it with the payload in
    /// place and returns the frame's length (to be consumed); otherwise
    /// `None`, and the frame takes the general way.
    pub(crate) fn deliver(
        &mut self,
        shared: &Shared,
        conn: &Conn,
        codec: &FrameCodec,
        buf: &[u8],
    ) -> Option<usize> {
        if self.version != Some(shared.handlers_version()) {
            let (version, handlers) = shared.borrowed_handlers();
            (self.version, self.handlers) = (Some(version), handlers);
        }
        if self.handlers.is_empty() {
            return None;
        }
        let (channel, payload, total) = codec.peek_oneway(buf)?;
        let (_, handler) = self.handlers.iter().find(|(c, _)| *c == channel)?;
        shared.call_borrowed(handler, &conn.peer, channel, payload);
        Some(total)
    }
}

/// The reader of a closing connection: nothing more is dispatched, but the
/// socket is read (and the bytes dropped) until the peer closes, the read
/// fails, or the connection is cancelled.
pub(crate) async fn discard_until_closed<R: AsyncRead + Unpin>(
    conn: &Conn,
    io: &mut R,
    mut buf: BytesMut,
) -> Option<DisconnectReason> {
    loop {
        buf.clear();
        if buf.capacity() < READ_BUF {
            buf.reserve(READ_BUF);
        }
        tokio::select! {
            biased;
            _ = conn.cancel.cancelled() => return None,
            read = io.read_buf(&mut buf) => match read {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            },
        }
    }
}

/// Handles one inbound frame on an established connection.
pub(crate) fn dispatch(
    shared: &Shared,
    conn: &Arc<Conn>,
    frame: Frame,
) -> Result<(), DisconnectReason> {
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
            let urgent = conn.is_urgent(channel);
            let reply = ReplyHandle::new(corr, conn.clone(), urgent, shared.max_payload);
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
            warn_limited!(shared.bad_input, "handshake frame on an established connection"; peer = %conn.peer);
            Err(DisconnectReason::ProtocolViolation)
        }
    }
}
