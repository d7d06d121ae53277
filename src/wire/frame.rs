//! The node-to-node message enum carried in every frame body.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::payload;
use crate::model::identity::UniqueAddress;

/// The wire protocol version this build speaks. Bumped on any change of
/// [`Frame`], of the handshake or of what a channel may carry.
/// Version 2 put both announced versions into the handshake transcript;
/// version 3 added the compact data forms (SPEC §13.4), sent only over a
/// pipe both of whose ends announced at least 3; version 4 lets an
/// envelope carry its own line's fingerprint (SPEC §13.6).
pub const PROTOCOL_VERSION: u16 = 4;

/// The first protocol version whose pipes carry the compact data forms
/// `E` and `R` on the sharding data channel (SPEC §13.4).
pub const COMPACT_DATA_VERSION: u16 = 3;

/// The first protocol version whose envelopes may carry the fingerprint
/// of their own message's line rather than the protocol's whole one
/// (SPEC §13.6): a node of an older build compares the whole one only.
pub const LINE_FINGERPRINT_VERSION: u16 = 4;

/// The oldest protocol version this build still accepts from a peer.
pub const MIN_PROTOCOL_VERSION: u16 = 2;

/// A small namespace number that says which upper layer a payload belongs to
/// (for example membership or sharding). Each layer registers its channel
/// with the transport and encodes its own messages.
pub type Channel = u16;

/// One node-to-node message: the body of one frame.
///
/// The first five variants belong to the handshake (see
/// `transport::handshake`); the last three carry upper-layer traffic over an
/// established connection. A handshake frame after the handshake, or a data
/// frame before it, is a protocol violation and closes the connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Frame {
    /// Handshake step 1, initiator → acceptor: who I am, which cluster and
    /// protocol version I speak, and a fresh challenge for the acceptor.
    Hello {
        /// The version the initiator announces: its [`PROTOCOL_VERSION`],
        /// or an older one it still speaks when the acceptor refused that
        /// (SPEC §9.1).
        version: u16,
        /// The cluster the initiator belongs to; must equal the acceptor's.
        cluster: String,
        /// The initiator's identity.
        from: UniqueAddress,
        /// 32 random bytes the acceptor must prove the secret over.
        #[serde(with = "payload")]
        nonce: Bytes,
    },
    /// Handshake step 2, acceptor → initiator: the acceptor's identity, its
    /// proof of the shared secret, and a fresh challenge for the initiator.
    Welcome {
        /// The lower of `Hello`'s version and the acceptor's
        /// [`PROTOCOL_VERSION`]: the pipe's version.
        version: u16,
        /// The acceptor's identity.
        from: UniqueAddress,
        /// 32 random bytes the initiator must prove the secret over.
        #[serde(with = "payload")]
        nonce: Bytes,
        /// HMAC-SHA256 over the handshake transcript, acceptor role.
        #[serde(with = "payload")]
        proof: Bytes,
    },
    /// Handshake step 3, initiator → acceptor: the initiator's proof.
    Proof {
        /// HMAC-SHA256 over the handshake transcript, initiator role.
        #[serde(with = "payload")]
        proof: Bytes,
    },
    /// Handshake step 4, acceptor → initiator: the connection is established
    /// and is the one pipe between the two nodes.
    Accepted,
    /// Either side refuses the handshake (or, later, the connection); the
    /// sender closes the connection right after it.
    Reject {
        /// Why.
        reason: RejectReason,
    },
    /// A one-way upper-layer message.
    Oneway {
        /// The upper layer the payload belongs to.
        channel: Channel,
        /// The upper layer's own encoding of its message.
        #[serde(with = "payload")]
        payload: Bytes,
    },
    /// An upper-layer request; the receiver answers with a [`Frame::Reply`]
    /// carrying the same `corr` on the same connection.
    Request {
        /// Correlation id, unique among the sender's pending requests on this
        /// connection.
        corr: u64,
        /// The upper layer the payload belongs to.
        channel: Channel,
        /// The upper layer's own encoding of its request.
        #[serde(with = "payload")]
        payload: Bytes,
    },
    /// The answer to the [`Frame::Request`] with the same `corr`.
    Reply {
        /// Correlation id of the request answered.
        corr: u64,
        /// The reply payload, or why there is none.
        result: ReplyResult,
    },
}

/// Why a handshake (or a connection) was refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RejectReason {
    /// The peer's protocol version is outside the range this node accepts.
    UnsupportedVersion {
        /// The version the refusing node speaks.
        ours: u16,
        /// The oldest version the refusing node accepts.
        min: u16,
    },
    /// The peer belongs to another cluster (the name is not echoed back).
    WrongCluster,
    /// The peer's proof of the shared secret did not verify.
    BadProof,
    /// A connection between the two nodes already exists and wins the
    /// simultaneous-connect tie-break; this one is redundant.
    Duplicate,
    /// The peer's identity was marked down here; it may never reconnect
    /// (a restarted node comes back with a new identity).
    Quarantined,
    /// The peer sent a frame that does not fit the protocol state.
    ProtocolViolation,
    /// The refusing node is shutting down.
    ShuttingDown,
    /// The peer's TLS certificate does not name the address it claims
    /// (only under TLS).
    CertificateMismatch,
}

/// The outcome of a request, as carried in [`Frame::Reply`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplyResult {
    /// The handler's reply payload.
    Ok(#[serde(with = "payload")] Bytes),
    /// No reply payload, and why.
    Err(RemoteFailure),
}

/// Why a remote node produced no reply payload for a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RemoteFailure {
    /// No handler is registered for the request's channel on the remote node.
    #[error("no handler registered for channel {0} on the remote node")]
    NoHandler(Channel),
    /// The remote handler's inbound queue was full; the request was dropped
    /// without being handled.
    #[error("the remote handler's queue is full")]
    Overloaded,
    /// The remote handler dropped the reply handle without replying.
    #[error("the remote handler dropped the request without replying")]
    Dropped,
    /// The remote handler reported a failure.
    #[error("the remote handler failed: {0}")]
    Failed(String),
}
