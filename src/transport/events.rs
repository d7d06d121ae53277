//! Connection-level events for the membership driver.

use crate::model::identity::UniqueAddress;
use crate::wire::RejectReason;

/// A change in the set of peers this node has a pipe to.
///
/// `Connected` is emitted when a peer identity gains its pipe;
/// `Disconnected` when it loses it without a replacement. Swapping one pipe
/// for another between the same two identities (simultaneous connect, a
/// redial) emits nothing. A new incarnation at an address emits
/// `Disconnected` for the old identity, then `Connected` for the new.
/// These are hints for the failure detector, not verdicts: a peer may flap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransportEvent {
    /// A pipe to `peer` is established and authenticated.
    Connected {
        /// The peer's identity.
        peer: UniqueAddress,
    },
    /// The pipe to `peer` is gone; its pending requests have failed.
    Disconnected {
        /// The peer's identity.
        peer: UniqueAddress,
        /// Why.
        reason: DisconnectReason,
    },
}

/// Why a connection ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DisconnectReason {
    /// The peer closed the connection (end of stream).
    PeerClosed,
    /// Reading or writing the socket failed.
    Io(String),
    /// The peer sent a frame that does not decode or is too large.
    Malformed(String),
    /// The peer sent a frame that does not fit the protocol state.
    ProtocolViolation,
    /// The peer sent `Reject` on the established connection.
    RejectedByPeer(RejectReason),
    /// [`Transport::mark_down`](super::Transport::mark_down) was called for the peer.
    MarkedDown,
    /// Another connection to the peer (or to a newer incarnation at its
    /// address) took this one's place.
    Replaced,
    /// The local transport shut down.
    ShutDown,
}
