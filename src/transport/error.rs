//! Errors of the transport. Each variant says whether anything was sent.

use bytes::Bytes;

use crate::wire::{RejectReason, RemoteFailure};

/// Why a connection could not be established (dial, handshake).
///
/// Nothing was delivered to the peer in any of these cases.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConnectError {
    /// TCP connect, read or write failed.
    #[error("i/o error ({kind:?}): {message}")]
    Io {
        /// The I/O error's kind.
        kind: std::io::ErrorKind,
        /// Its message.
        message: String,
    },
    /// The handshake did not finish within the handshake timeout.
    #[error("handshake timed out")]
    Timeout,
    /// The peer closed the connection during the handshake.
    #[error("peer closed the connection during the handshake")]
    Closed,
    /// The peer refused us with this reason.
    #[error("rejected by the peer: {0:?}")]
    Rejected(RejectReason),
    /// We refused the peer with this reason (and told it so).
    #[error("refused the peer: {0:?}")]
    Refused(RejectReason),
    /// The peer broke the protocol (unexpected or undecodable frame).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The operating system's random generator failed; no nonce could be drawn.
    #[error("random generator failed: {0}")]
    Rng(String),
    /// TLS refused the connection: a certificate not from the CA roots,
    /// expired, or not naming its node — the peer's, refused here, or this
    /// node's, refused by the peer (told by its alert): rustls's reason. Or
    /// one side speaks TLS and the other does not (either side says so,
    /// with or without the feature `tls`). A refusal retrying cannot cure
    /// while the configuration stays; a connection that merely fails under
    /// TLS (closed, reset) is `Closed` or `Io`.
    #[error("TLS: {0}")]
    Tls(String),
    /// The local transport is shut down.
    #[error("the transport is shut down")]
    ShutDown,
}

impl From<std::io::Error> for ConnectError {
    fn from(e: std::io::Error) -> Self {
        ConnectError::Io {
            kind: e.kind(),
            message: e.to_string(),
        }
    }
}

/// Why a payload was not sent. The payload is given back in
/// [`SendError::payload`] so the caller can buffer, retry or drop it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not sent: {reason}")]
pub struct SendError {
    /// Why it was not sent.
    pub reason: SendFailure,
    /// The payload, untouched.
    pub payload: Bytes,
}

impl SendError {
    pub(crate) fn new(reason: SendFailure, payload: Bytes) -> Self {
        SendError { reason, payload }
    }

    /// The undelivered payload.
    pub fn into_payload(self) -> Bytes {
        self.payload
    }
}

/// The reason inside a [`SendError`]. In every case nothing was enqueued.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendFailure {
    /// The target was marked down ([`Transport::mark_down`](super::Transport::mark_down)).
    #[error("the peer is marked down")]
    MarkedDown,
    /// The target's outbound queue (or dial queue) is full.
    #[error("the peer's send queue is full")]
    QueueFull,
    /// The payload cannot fit in one frame.
    #[error("payload of {len} bytes exceeds the largest sendable payload of {max} bytes")]
    TooLarge {
        /// Payload length.
        len: usize,
        /// Largest payload that fits in a frame.
        max: usize,
    },
    /// A newer incarnation of the target's address is connected; the target
    /// identity is gone.
    #[error("the target is an older incarnation than the node now at its address")]
    Stale,
    /// The connection was closed between lookup and enqueue, or (for a
    /// reply) the request's connection is gone.
    #[error("the connection is closed")]
    ConnectionClosed,
    /// The local transport is shut down.
    #[error("the transport is shut down")]
    ShutDown,
}

/// Why a request produced no reply payload.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The request was not sent (payload given back).
    #[error(transparent)]
    NotSent(#[from] SendError),
    /// No connection to the target could be established.
    #[error("could not connect: {0}")]
    Connect(#[from] ConnectError),
    /// The node reached at the target's address is not the target identity
    /// (the target restarted as a new incarnation). Nothing was sent.
    #[error("the node at the target's address is now {found}")]
    WrongPeer {
        /// The identity found at the address.
        found: crate::model::identity::UniqueAddress,
    },
    /// No reply within the timeout; the pending entry was removed. The
    /// request may or may not have been handled remotely.
    #[error("no reply within the timeout")]
    Timeout,
    /// The connection dropped (or was marked down or replaced) while the
    /// request was pending. It may or may not have been handled remotely.
    #[error("the connection was lost while the request was pending")]
    ConnectionLost,
    /// The remote node answered without a payload.
    #[error("remote failure: {0}")]
    Remote(#[from] RemoteFailure),
    /// The request frame could not be encoded; it was not sent. Not produced
    /// by this version (a request too large for a frame is `NotSent` with
    /// [`SendFailure::TooLarge`]); kept for callers that match on it.
    #[error("the request could not be encoded: {0}")]
    Encode(String),
}

/// Error of [`Transport::register`](super::Transport::register).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// A live receiver is already registered for the channel.
    #[error("channel {0} already has a handler")]
    AlreadyRegistered(u16),
}
