//! A read-only snapshot of one node's view of the cluster.

use super::status::MemberStatus;
use crate::model::identity::{NodeId, UniqueAddress};

/// One member and its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Who it is.
    pub address: UniqueAddress,
    /// Its status in this view.
    pub status: MemberStatus,
}

/// This node's view of the cluster at one instant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipState {
    /// This node's identity.
    pub self_member: UniqueAddress,
    /// Every known member except Removed tombstones, oldest first.
    pub members: Vec<Member>,
    /// Live members that some live observer cannot hear, oldest first.
    pub unreachable: Vec<UniqueAddress>,
    /// The leader in this node's view: the oldest reachable member among Up
    /// and Leaving ones (or, when there is none, among all live ones), where
    /// this node always counts itself reachable. It moves members Up,
    /// removes them, and takes timeout-downing decisions.
    pub leader: Option<UniqueAddress>,
    /// The oldest reachable Up member, by `(incarnation, node_id)`.
    pub coordinator: Option<UniqueAddress>,
    /// Live members beyond this node's side of a partition, as the
    /// split-brain resolver sees it (§10.5: not reached directly or through
    /// a member of the side); empty without a resolver.
    pub beyond: Vec<UniqueAddress>,
}

impl MembershipState {
    /// The placement coordinator: the oldest reachable Up member.
    pub fn placement_coordinator(&self) -> Option<UniqueAddress> {
        self.coordinator
    }

    /// Whether the node with this id is the placement coordinator in this view.
    pub fn is_placement_coordinator(&self, node_id: NodeId) -> bool {
        self.coordinator.is_some_and(|c| c.node_id == node_id)
    }

    /// The status of `member` in this view (`None` if unknown or Removed).
    pub fn status_of(&self, member: &UniqueAddress) -> Option<MemberStatus> {
        self.members
            .iter()
            .find(|m| m.address == *member)
            .map(|m| m.status)
    }

    /// This node's own status (`None` before it has joined).
    pub fn self_status(&self) -> Option<MemberStatus> {
        self.status_of(&self.self_member)
    }

    /// Up members, oldest first: the nodes eligible to own shards.
    pub fn up_members(&self) -> impl Iterator<Item = UniqueAddress> + '_ {
        self.members
            .iter()
            .filter(|m| m.status == MemberStatus::Up)
            .map(|m| m.address)
    }

    /// Whether `member` is known, live and not unreachable.
    pub fn is_reachable_live(&self, member: &UniqueAddress) -> bool {
        self.status_of(member).is_some_and(|s| s.is_live()) && !self.unreachable.contains(member)
    }
}
