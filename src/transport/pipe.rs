//! A handshaken stream becomes a pipe: installed in the connection table,
//! then its reader and writer started on their own tasks. Generic over the
//! stream ([`PipeIo`]): TCP today, a TLS stream over TCP once that lands.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::BytesMut;
use futures_util::SinkExt;
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use super::connection::{Conn, READ_BUF, lock};
use super::handshake::HandshakeStream;
use super::reader::read_loop;
use super::stream::PipeIo;
use super::table::Shared;
use super::writer::{OutboxGuard, write_loop};
use crate::model::identity::{NodeId, UniqueAddress};
use crate::wire::{Frame, FrameCodec, HANDSHAKE_MAX_FRAME_LEN, RejectReason};

/// A handshake's framed stream: its codec accepts at most
/// `HANDSHAKE_MAX_FRAME_LEN`, so an unauthenticated peer cannot make this
/// node buffer more than that (plus one read) per connection.
pub(crate) fn handshake_framed<S: PipeIo>(stream: S) -> HandshakeStream<S> {
    Framed::with_capacity(stream, FrameCodec::new(HANDSHAKE_MAX_FRAME_LEN), 4096)
}

/// This side's and the peer's socket addresses (unspecified if the socket
/// cannot say).
pub(crate) fn socket_addrs(stream: &TcpStream) -> (SocketAddr, SocketAddr) {
    let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
    (
        stream.local_addr().unwrap_or(unspecified),
        stream.peer_addr().unwrap_or(unspecified),
    )
}

impl Shared {
    /// Installs a handshaken stream as a pipe and starts its tasks. On
    /// refusal, tells the peer `Reject{reason}`.
    ///
    /// `sockets` are this side's and the peer's socket addresses (for
    /// `ConnectionInfo`), read off the TCP stream before it was wrapped;
    /// `peer` the peer's identity and the pipe's protocol version (the
    /// lower of the two the handshake announced).
    pub(crate) async fn start_conn<S: PipeIo>(
        self: &Arc<Self>,
        mut stream: HandshakeStream<S>,
        sockets: (SocketAddr, SocketAddr),
        (peer, version): (UniqueAddress, u16),
        initiator: NodeId,
        first: Option<Frame>,
    ) -> Result<Arc<Conn>, RejectReason> {
        let id = self.next_conn_id.fetch_add(1, Ordering::Relaxed);
        let conn = Conn::new(
            id,
            (peer, version),
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
        let (read_half, write_half) = parts.io.into_halves();
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
}
