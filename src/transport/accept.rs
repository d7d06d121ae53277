//! The listener's side: accept TCP connections, bound the unauthenticated
//! handshakes, run the acceptor's handshake and install the pipe.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OwnedSemaphorePermit;

use super::connection::lock;
use super::error::ConnectError;
use super::handshake::{self};
use super::pipe::{handshake_framed, socket_addrs};
use super::table::Shared;
use crate::identity::UniqueAddress;
use crate::wire::{Frame, RejectReason};

pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
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

/// An inbound handshake's hold on its peer's address (see `State::inbound`).
/// Released when the handshake task ends, however it ends; if no pipe came
/// of it, whatever queued meanwhile gets a dial of its own.
pub(crate) struct InboundSlot {
    pub(crate) shared: Arc<Shared>,
    pub(crate) addr: Mutex<Option<SocketAddr>>,
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

impl Shared {
    /// Admission of an inbound handshake right after its `Hello`. When
    /// admitted, the handshake holds the peer address's slot until `slot` is
    /// dropped, so no dial to that address starts meanwhile.
    pub(crate) fn admit_inbound(
        &self,
        peer: &UniqueAddress,
        slot: &InboundSlot,
    ) -> Result<(), RejectReason> {
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

    /// Serves one inbound TCP connection: handshake, then the pipe.
    /// `permit` (one of `max_inbound_handshakes`) is held until the peer is
    /// authenticated or the handshake ends.
    pub(crate) async fn serve_inbound(
        self: Arc<Self>,
        stream: TcpStream,
        remote: SocketAddr,
        permit: OwnedSemaphorePermit,
    ) {
        let _ = stream.set_nodelay(true);
        let sockets = socket_addrs(&stream);
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
            .start_conn(framed, sockets, peer, peer.node_id, Some(Frame::Accepted))
            .await
        {
            let e = ConnectError::Refused(reason);
            self.refusals.log(self.local, remote, &e);
        }
    }
}
