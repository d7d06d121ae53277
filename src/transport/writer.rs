//! A pipe's writer task: takes the outbox's frames in batches and writes
//! them to the stream; on close, flushes what is left within a bound.
//! Generic over the stream's write half.

use std::sync::Arc;

use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio_util::codec::Encoder;

use super::connection::{Conn, FLUSH_LIMIT, clear_and_shrink};
use super::events::DisconnectReason;
use super::table::Shared;
use crate::wire::Frame;

/// Closes a connection's outbox when dropped: however `write_loop` ends,
/// or if its task is dropped before it first runs (it is made before the
/// task is spawned and moved into it).
pub(crate) struct OutboxGuard(pub(crate) Arc<Conn>);

impl Drop for OutboxGuard {
    fn drop(&mut self) {
        self.0.close_outbox();
    }
}

/// The batching writer: waits until frames are queued, yields once so
/// producers that are already runnable can add theirs, then writes the
/// outbox out in batches (`Conn::take`: the whole urgent lane, then bulk
/// frames up to `MAX_BATCH_BYTES` or one larger frame), one `write_all` per
/// batch, until it is empty. `first` (the acceptor's `Accepted`) is written before
/// anything queued.
pub(crate) async fn write_loop<W: AsyncWrite + Unpin>(
    shared: Arc<Shared>,
    closed_at_end: OutboxGuard,
    first: Option<Frame>,
    mut io: W,
) {
    let conn = &closed_at_end.0;
    let peer_metrics = shared.stats.metrics.peer(conn.peer.addr);
    let mut batch = BytesMut::with_capacity(64 * 1024);
    if let Some(frame) = first {
        let mut codec = conn.codec;
        if codec.encode(&frame, &mut batch).is_err() {
            tracing::warn!(peer = %conn.peer, "first frame cannot be encoded");
        }
    }
    // Made once, not per batch: a cancellation future registers with its
    // token when first polled, and unregisters when dropped.
    let cancelled = conn.cancel.cancelled();
    let closing = conn.closing.cancelled();
    tokio::pin!(cancelled, closing);
    loop {
        if conn.is_closing() {
            return close_flush(conn, batch, io).await;
        }
        if batch.is_empty() {
            tokio::select! {
                biased;
                _ = &mut cancelled => return,
                // (`is_closing` is true once this fires.)
                _ = &mut closing => continue,
                _ = conn.ready.notified() => {}
            }
            // The writer yield (see the limits anchor): ~50 frames per write
            // under load instead of ~2.
            tokio::task::yield_now().await;
        }
        loop {
            if batch.is_empty() {
                let n = conn.take(&mut batch);
                if n == 0 {
                    break;
                }
                shared.stats.record_batch(n);
                peer_metrics.frames.increment(n as u64);
                peer_metrics.bytes.increment(batch.len() as u64);
            }
            let written = tokio::select! {
                biased;
                _ = &mut cancelled => return,
                // A TLS stream holds records until flushed; TCP's flush is
                // a no-op.
                r = async { io.write_all(&batch).await?; io.flush().await } => r,
                _ = async {
                    closing.as_mut().await;
                    tokio::time::sleep_until(conn.flush_deadline()).await;
                } => {
                    tracing::debug!(peer = %conn.peer, "closing: frames not flushed in time");
                    conn.cancel.cancel();
                    return;
                }
            };
            clear_and_shrink(&mut batch);
            if let Err(e) = written {
                conn.close(DisconnectReason::Io(e.to_string()));
                return;
            }
            if conn.is_closing() {
                break;
            }
        }
    }
}

/// The end of a connection closed by `close_after_flush`: writes what is
/// still queued (in batches) and shuts the write half down, by
/// `flush_deadline`; then waits, at most `FLUSH_LIMIT` more, for the reader
/// to see the peer close (it reads and discards meanwhile), so the socket is
/// not dropped with unread input — which would make the kernel send a reset
/// and throw away what we just wrote; then ends both tasks.
pub(crate) async fn close_flush<W: AsyncWrite + Unpin>(
    conn: &Conn,
    mut batch: BytesMut,
    mut io: W,
) {
    let deadline = conn.flush_deadline();
    let flushed = tokio::time::timeout_at(deadline, async {
        loop {
            if batch.is_empty() && conn.take(&mut batch) == 0 {
                return Ok::<(), std::io::Error>(());
            }
            io.write_all(&batch).await?;
            clear_and_shrink(&mut batch);
        }
    })
    .await;
    if !matches!(flushed, Ok(Ok(()))) {
        tracing::debug!(peer = %conn.peer, "last frames not flushed before close");
    }
    let _ = tokio::time::timeout_at(deadline, io.shutdown()).await;
    let _ = tokio::time::timeout_at(deadline + FLUSH_LIMIT, conn.reader_done.cancelled()).await;
    conn.cancel.cancel();
}
