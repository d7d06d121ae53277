//! Errors returned by the membership core.

use super::status::MemberStatus;
use crate::model::identity::UniqueAddress;

/// Why a call into [`MembershipCore`](super::MembershipCore) was refused.
///
/// Every variant except [`Bug`](MembershipError::Bug) leaves the core's state
/// unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    /// The configuration is unusable. Returned by `new`; no core was built.
    #[error("invalid membership config: {reason}")]
    InvalidConfig {
        /// Which setting is wrong.
        reason: String,
    },
    /// `join` was called twice. No state changed.
    #[error("join was already called on this node")]
    AlreadyJoining,
    /// `leave` or `down` was called before this node became a member. No
    /// state changed; a node that never joined can simply stop.
    #[error("this node is not a cluster member yet")]
    NotAMember,
    /// The node has been Downed or Removed (or left) and takes no more
    /// requests. No state changed.
    #[error("this node is no longer a cluster member")]
    Terminated,
    /// `down` named a member the table does not know. No state changed.
    #[error("unknown member {0}")]
    UnknownMember(UniqueAddress),
    /// The requested transition is not legal from the member's current
    /// status (for instance `down` of a Removed member). No state changed.
    #[error("illegal transition of {member} from {from:?} to {to:?}")]
    IllegalTransition {
        /// The member concerned.
        member: UniqueAddress,
        /// Its current status.
        from: MemberStatus,
        /// The status that was asked for.
        to: MemberStatus,
    },
    /// BUG: an internal invariant was broken. The state may be partly
    /// updated; the node should leave the cluster and restart.
    #[error("BUG: membership invariant broken: {0}")]
    Bug(String),
}
