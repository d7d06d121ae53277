//! The listener's side: accept TCP connections, bound the unauthenticated
//! handshakes, run the acceptor's handshake and install the pipe.
//!
//! Two bounds hold an unauthenticated handshake, both taken at accept,
//! before anything is read: one of `max_inbound_handshakes` permits, and
//! one of `max_inbound_handshakes_per_source` for its source (an IPv4
//! address, an IPv6 /64). A connection that finds either exhausted is
//! closed at once. Without the second, one client could hold every permit
//! with handshakes it never finishes (a `ClientHello` or a `Hello` it
//! stalls) and lock every node out, a handshake timeout at a time; with
//! it, that takes `max_inbound_handshakes / max_inbound_handshakes_per_source`
//! sources (32 by default).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
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
use crate::model::identity::UniqueAddress;
use crate::wire::{Frame, RejectReason};

pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let accepted = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, remote)) => match shared.admit_handshake(remote.ip()) {
                Ok(permit) => {
                    shared
                        .runtime
                        .spawn(shared.clone().serve_inbound(stream, remote, permit));
                }
                Err(e) => {
                    // Too many unauthenticated handshakes at once: close
                    // this one now, before reading anything from it.
                    drop(stream);
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

/// The source an inbound connection counts under: its IPv4 address (an
/// IPv4-mapped IPv6 one as that IPv4 address), or the /64 prefix of an IPv6
/// address — a host is commonly given a whole /64, so one IPv6 address
/// each would bound nothing.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        v4 => v4,
    }
}

/// An inbound handshake's hold on both bounds: a permit of
/// `max_inbound_handshakes`, and a place among its source's
/// `max_inbound_handshakes_per_source`. Dropped once the peer is
/// authenticated, or when the handshake ends however it ends.
pub(crate) struct HandshakePermit {
    _permit: OwnedSemaphorePermit,
    source: IpAddr,
    shared: Arc<Shared>,
}

impl Drop for HandshakePermit {
    fn drop(&mut self) {
        let mut sources = lock(&self.shared.sources);
        if let Some(n) = sources.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                sources.remove(&self.source);
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
    /// Admission of a connection just accepted from `remote` to a handshake:
    /// a place among its source's, then a permit. Refused (the connection is
    /// to be closed) when either bound is reached.
    fn admit_handshake(self: &Arc<Self>, remote: IpAddr) -> Result<HandshakePermit, ConnectError> {
        let source = source_of(remote);
        let per_source = self.config.max_inbound_handshakes_per_source.max(1);
        let mut sources = lock(&self.sources);
        let held = sources.get(&source).copied().unwrap_or(0);
        if held >= per_source {
            return Err(ConnectError::Protocol(format!(
                "more than {per_source} inbound handshakes at once from {source}; connection closed"
            )));
        }
        let permit = self.handshakes.clone().try_acquire_owned().map_err(|_| {
            ConnectError::Protocol(format!(
                "more than {} inbound handshakes at once; connection closed",
                self.config.max_inbound_handshakes
            ))
        })?;
        sources.insert(source, held + 1);
        Ok(HandshakePermit {
            _permit: permit,
            source,
            shared: self.clone(),
        })
    }

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
    /// handshake, then the pipe. `permit` is held until the peer is
    /// authenticated or the handshake ends; both handshakes together must
    /// end within `handshake_timeout`.
    pub(crate) async fn serve_inbound(
        self: Arc<Self>,
        stream: TcpStream,
        remote: SocketAddr,
        permit: HandshakePermit,
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
        permit: HandshakePermit,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// IPv4 sources are single addresses (IPv4-mapped ones included); IPv6
    /// ones are /64 prefixes.
    #[test]
    fn sources_are_ipv4_addresses_and_ipv6_prefixes() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("literal");
        assert_eq!(source_of(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_ne!(source_of(ip("10.1.2.3")), source_of(ip("10.1.2.4")));
        assert_eq!(source_of(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(source_of(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(
            source_of(ip("2001:db8:1:2:ffff:ffff:ffff:ffff")),
            source_of(ip("2001:db8:1:2::7"))
        );
        assert_ne!(
            source_of(ip("2001:db8:1:2::1")),
            source_of(ip("2001:db8:1:3::1"))
        );
        assert_eq!(source_of(ip("::1")), ip("::"));
    }
}
