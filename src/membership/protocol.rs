//! What goes in and out of the core: wire messages, commands, events.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::gossip::Gossip;
use super::status::MemberStatus;
use crate::model::identity::UniqueAddress;

/// A membership message between two nodes. The driver encodes it as an
/// opaque payload on the membership channel of the pipe to the peer and
/// hands it back to the peer's core with the sender's identity (known from
/// the pipe's handshake).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MembershipMsg {
    /// A node asks to be admitted. Sent to seed addresses, retried until a
    /// [`Welcome`](MembershipMsg::Welcome) arrives. The sender's identity is
    /// the joiner.
    Join,
    /// The receiver of a `Join` admitted the sender as Joining; the gossip is
    /// the admitting member's state, which contains the joiner.
    Welcome {
        /// The admitting member's state.
        gossip: Gossip,
    },
    /// The sender's full state, to be merged.
    Gossip {
        /// The sender's state.
        gossip: Gossip,
    },
    /// "I am alive", sent every heartbeat interval to the sender's ring
    /// watchers (and to every observer that flags it), carrying the digest
    /// of the sender's state so that members with different states exchange
    /// gossip and the leader can check convergence. The same message is the
    /// gossip's digest (rounds, news learnt by merge, reports to the
    /// leader); a receiver that does not watch the sender uses only the
    /// digest.
    Heartbeat {
        /// [`Gossip::digest`] of the sender's state when it sent this.
        digest: u64,
    },
}

/// Where a message goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// A known member, by its full identity. The transport must not deliver
    /// it to a different incarnation at the same address.
    Member(UniqueAddress),
    /// A seed node whose identity is not known yet: whatever node listens at
    /// that address.
    Seed(SocketAddr),
}

/// A notification for subscribers, emitted when this node's view changes.
///
/// Per member, the status events a node publishes follow the status order
/// (Joined, Up, Left, Exited, Downed, Removed); a node that missed gossip may
/// skip some of them, never go back.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MembershipEvent {
    /// The member was admitted (status Joining).
    MemberJoined(UniqueAddress),
    /// The member is Up.
    MemberUp(UniqueAddress),
    /// The member is Leaving.
    MemberLeft(UniqueAddress),
    /// The member is Exiting.
    MemberExited(UniqueAddress),
    /// The member is Down. If it is this node, this node must stop: it is
    /// out of the cluster for good and must restart under a new identity.
    MemberDowned(UniqueAddress),
    /// The member is Removed. If it is this node, its graceful leave (or its
    /// removal) is complete and it may shut down.
    MemberRemoved {
        /// The removed member.
        member: UniqueAddress,
        /// Its status before removal, as this node last saw it.
        previous: MemberStatus,
    },
    /// At least one live observer cannot hear the member.
    Unreachable(UniqueAddress),
    /// Every observer hears the member again.
    Reachable(UniqueAddress),
    /// The placement coordinator (oldest reachable Up member) changed; `None`
    /// while no member qualifies.
    CoordinatorChanged(Option<UniqueAddress>),
    /// While this node was still joining, a seed's handshake ended in a
    /// refusal that retrying cannot cure: another cluster name, another
    /// secret, an unsupported protocol version, or TLS refusing the
    /// connection. Published by the node's driver (the core never sees a
    /// handshake); after `ClusterConfig::join_refusal_limit` of them the
    /// node gives up and stops (`ClusterError::JoinRefused`, whose
    /// `JoinRefusal` also carries TLS's reason).
    JoinRefused {
        /// The seed address dialed.
        seed: SocketAddr,
        /// The reason in the `Reject` frame; `CertificateMismatch` when TLS
        /// refused the connection, before any frame.
        reason: crate::wire::RejectReason,
        /// True when the seed refused this node; false when this node
        /// refused the seed (it could not verify the seed's proof), and
        /// when TLS refused the connection.
        by_seed: bool,
    },
}

/// An instruction from the core to its driver. Carry them out in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Send `msg` to `to`, best effort (loss is tolerated).
    Send {
        /// The destination.
        to: Target,
        /// The message.
        msg: MembershipMsg,
    },
    /// Deliver this event to subscribers.
    Publish(MembershipEvent),
    /// The member is Down or Removed. Frames already handed to the transport
    /// for it may still be flushed (the core sends it a last gossip just
    /// before, so it can learn its fate), but from now on sends to it should
    /// fail at once and its inbound traffic be refused. The core never sends
    /// to it again.
    MarkDown(UniqueAddress),
}
