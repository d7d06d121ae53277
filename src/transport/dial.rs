//! Dialing a peer: one task per address, with backoff, deferring to an
//! inbound handshake from the same peer, and the frames queued meanwhile
//! flushed into the pipe once it exists.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::TcpStream;
use tokio::time::Instant;

use super::connection::{Conn, lock};
use super::error::ConnectError;
use super::handshake::{self};
use super::pipe::{handshake_framed, socket_addrs};
use super::stream::PipeIo;
use super::table::{Dial, Shared, State, after, log_refusal};
use crate::model::identity::UniqueAddress;
use crate::wire::{MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RejectReason};

/// What a dial attempt led to.
pub(crate) enum Dialed {
    /// A new pipe, installed.
    Connected(Arc<Conn>),
    /// A pipe to the same identity already exists and wins; use it.
    Existing(Arc<Conn>),
}

/// Whether a dial to `addr` has nothing left to do: the transport closed, or
/// a pipe to `addr` exists (then the dial is finished with it). Checked
/// before and again after each wait, since either can change meanwhile.
pub(crate) fn dial_settled(st: &mut State, addr: SocketAddr) -> bool {
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
pub(crate) async fn dial_loop(shared: Arc<Shared>, addr: SocketAddr) {
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
pub(crate) fn deferral_over(d: &Dial) -> bool {
    d.deferred_until.is_some_and(|u| Instant::now() >= u)
}

/// Ends a dial task: flush into the pipe that exists now.
pub(crate) fn finish_dial(st: &mut State, addr: SocketAddr, conn: &Conn) {
    if let Some(d) = st.dials.get_mut(&addr) {
        d.task = false;
        d.connecting = false;
    }
    Shared::flush_dial(st, addr, conn);
}

impl Shared {
    pub(crate) fn ensure_dial_task(self: &Arc<Self>, dial: &mut Dial, addr: SocketAddr) {
        if !dial.task {
            dial.task = true;
            self.runtime.spawn(dial_loop(self.clone(), addr));
        }
    }

    /// One dial attempt: TCP connect, TLS (when configured), handshake,
    /// install. A node that refuses this build's protocol version but
    /// names one this build still speaks (an older node, during a rolling
    /// upgrade) is dialed once more announcing that one: its pipe then
    /// carries only what that version reads (SPEC §9.1).
    pub(crate) async fn dial_once(
        self: &Arc<Self>,
        addr: SocketAddr,
    ) -> Result<Dialed, ConnectError> {
        match self.dial_announcing(addr, PROTOCOL_VERSION).await {
            Err(ConnectError::Rejected(RejectReason::UnsupportedVersion { ours, .. }))
                if (MIN_PROTOCOL_VERSION..PROTOCOL_VERSION).contains(&ours) =>
            {
                tracing::debug!(%addr, version = ours, "an older peer: dialing again at its version");
                self.dial_announcing(addr, ours).await
            }
            other => other,
        }
    }

    /// [`dial_once`](Self::dial_once)'s attempt, announcing `announce`.
    async fn dial_announcing(
        self: &Arc<Self>,
        addr: SocketAddr,
        announce: u16,
    ) -> Result<Dialed, ConnectError> {
        let stream = TcpStream::connect(addr).await?;
        let _ = stream.set_nodelay(true);
        let sockets = socket_addrs(&stream);
        match &self.config.tls {
            None => {
                self.handshake_outbound(stream, addr, sockets, announce)
                    .await
            }
            #[cfg(feature = "tls")]
            Some(tls) => {
                let stream = tls.connect(stream, addr).await?;
                self.handshake_outbound(stream, addr, sockets, announce)
                    .await
                    .map_err(super::tls::inside_tls)
            }
            #[cfg(not(feature = "tls"))]
            Some(tls) => match *tls {},
        }
    }

    /// The initiator's handshake on a (TLS or TCP) stream, then the pipe.
    async fn handshake_outbound<S: PipeIo>(
        self: &Arc<Self>,
        stream: S,
        addr: SocketAddr,
        sockets: (SocketAddr, SocketAddr),
        announce: u16,
    ) -> Result<Dialed, ConnectError> {
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
        let result = handshake::initiate(&mut framed, &local, addr, announce, admit).await;
        let existing = lock(&existing).take();
        match result {
            Ok((peer, version)) => match self
                .start_conn(framed, sockets, (peer, version), self.local.node_id, None)
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
}
