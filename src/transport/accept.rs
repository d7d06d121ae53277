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
use super::stream::PipeIo;
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

/// Under TLS, what checks the accepted peer's name, and the certificate it
/// presented.
#[cfg(feature = "tls")]
pub(crate) type PeerCert<'a> = (&'a super::Tls, rustls::pki_types::CertificateDer<'static>);
/// Without the `tls` feature there is never a certificate.
#[cfg(not(feature = "tls"))]
pub(crate) type PeerCert<'a> = (&'a super::Tls, ());

/// Whether the certificate (if any) names the identity the peer claims.
fn check_certificate(cert: Option<&PeerCert<'_>>, peer: &UniqueAddress) -> Result<(), String> {
    match cert {
        None => Ok(()),
        #[cfg(feature = "tls")]
        Some((tls, cert)) => tls
            .check_peer_name(cert, peer.addr)
            .map_err(|why| format!("the certificate of {} does not name it: {why}", peer.addr)),
        #[cfg(not(feature = "tls"))]
        Some((tls, ())) => {
            let _ = peer;
            match **tls {}
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

    /// Serves one inbound TCP connection: TLS (when configured), the
    /// handshake, then the pipe. `permit` (one of `max_inbound_handshakes`)
    /// is held until the peer is authenticated or the handshake ends; both
    /// handshakes together must end within `handshake_timeout`.
    pub(crate) async fn serve_inbound(
        self: Arc<Self>,
        stream: TcpStream,
        remote: SocketAddr,
        permit: OwnedSemaphorePermit,
    ) {
        let _ = stream.set_nodelay(true);
        let sockets = socket_addrs(&stream);
        let deadline = tokio::time::Instant::now() + self.config.handshake_timeout;
        let peer = match &self.config.tls {
            None => {
                self.handshake_inbound(stream, sockets, None, deadline, permit)
                    .await
            }
            #[cfg(feature = "tls")]
            Some(tls) => match tokio::time::timeout_at(deadline, tls.accept(stream)).await {
                Ok(Ok((stream, cert))) => self
                    .handshake_inbound(stream, sockets, Some((tls, cert)), deadline, permit)
                    .await
                    .map_err(super::tls::inside_tls),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(ConnectError::Timeout),
            },
            #[cfg(not(feature = "tls"))]
            Some(tls) => match *tls {},
        };
        if let Err(e) = peer {
            self.refusals.log(self.local, remote, &e);
        }
    }

    /// The acceptor's handshake on a (TLS or TCP) stream, then the pipe.
    /// Under TLS, the certificate the peer presented must name the address
    /// its `Hello` claims. `permit` is released once the handshake ends.
    async fn handshake_inbound<S: PipeIo>(
        self: &Arc<Self>,
        stream: S,
        sockets: (SocketAddr, SocketAddr),
        cert: Option<PeerCert<'_>>,
        deadline: tokio::time::Instant,
        permit: OwnedSemaphorePermit,
    ) -> Result<(), ConnectError> {
        let mut framed = handshake_framed(stream);
        let local = self.local_handshake();
        let slot = InboundSlot {
            shared: self.clone(),
            addr: Mutex::new(None),
        };
        let mismatch = Mutex::new(None);
        let admit = |p: &UniqueAddress| {
            if let Err(why) = check_certificate(cert.as_ref(), p) {
                *lock(&mismatch) = Some(why);
                return Err(RejectReason::CertificateMismatch);
            }
            self.admit_inbound(p, &slot)
        };
        let handshake = handshake::accept(&mut framed, &local, admit);
        let peer = match tokio::time::timeout_at(deadline, handshake).await {
            Err(_) => return Err(ConnectError::Timeout),
            Ok(Err(e)) => return Err(lock(&mismatch).take().map_or(e, ConnectError::Tls)),
            Ok(Ok(found)) => found,
        };
        drop(permit); // authenticated
        let (peer, version) = peer;
        self.start_conn(
            framed,
            sockets,
            (peer, version),
            peer.node_id,
            Some(Frame::Accepted),
        )
        .await
        .map(drop)
        .map_err(ConnectError::Refused)
    }
}
