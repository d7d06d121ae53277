//! What the core shows its driver: its identity, status and configuration,
//! the state snapshot and the commands taken, and the views it derives from
//! the gossip (leader, placement coordinator, live members).

use std::collections::BTreeSet;

use super::{MembershipCore, Phase};
use crate::membership::config::MembershipConfig;
use crate::membership::gossip::{Gossip, MemberKey};
use crate::membership::protocol::Command;
use crate::membership::state::{Member, MembershipState};
use crate::membership::status::MemberStatus;
use crate::model::identity::UniqueAddress;

impl MembershipCore {
    /// This node's identity.
    pub fn self_address(&self) -> UniqueAddress {
        self.me
    }

    /// The configuration the core runs with.
    pub fn config(&self) -> &MembershipConfig {
        &self.config
    }

    /// This node's own status, `None` until it is admitted.
    pub fn self_status(&self) -> Option<MemberStatus> {
        self.gossip.status(&self.key)
    }

    /// Whether the node is out of the cluster for good (Down, Removed, or
    /// its exit timed out). It then ignores every input and emits nothing.
    pub fn is_terminated(&self) -> bool {
        matches!(self.phase, Phase::Terminated)
    }

    /// The gossiped state as this node holds it.
    pub fn gossip(&self) -> &Gossip {
        &self.gossip
    }

    /// A snapshot of this node's view.
    pub fn state(&self) -> MembershipState {
        let unreachable = self.gossip.unreachable_keys();
        MembershipState {
            self_member: self.me,
            members: self
                .gossip
                .member_keys()
                .filter(|(_, s)| *s != MemberStatus::Removed)
                .map(|(k, status)| Member {
                    address: k.0,
                    status,
                })
                .collect(),
            unreachable: unreachable.iter().map(|k| k.0).collect(),
            leader: self.leader_key(&unreachable).map(|k| k.0),
            coordinator: self.coordinator_key(&unreachable).map(|k| k.0),
            beyond: self
                .partition
                .iter()
                .flat_map(|(beyond, _)| beyond.iter().map(|k| k.0))
                .collect(),
        }
    }

    /// Whether [`MembershipState::beyond`] changed since the last call (the
    /// driver publishes a new state then, though no event came with it).
    pub fn take_partition_changed(&mut self) -> bool {
        std::mem::take(&mut self.partition_changed)
    }

    /// Takes the commands produced so far, oldest first.
    pub fn drain_commands(&mut self) -> Vec<Command> {
        std::mem::take(&mut self.commands)
    }

    /// The split-brain resolver's decisions on this node that downed
    /// someone so far: `(stayed, went_down)` — its side stayed and it downed
    /// the members beyond it, or its side (or this node alone) went down.
    pub fn split_brain_decisions(&self) -> (u64, u64) {
        (self.resolver_decisions[0], self.resolver_decisions[1])
    }

    /// The oldest reachable member among Up and Leaving ones; failing that,
    /// the oldest reachable live member. This node always counts itself
    /// reachable here: otherwise a node that others flagged before they
    /// became unreachable to it would find no leader and never down them.
    pub(super) fn leader_key(&self, unreachable: &BTreeSet<MemberKey>) -> Option<MemberKey> {
        let candidates: Vec<(MemberKey, MemberStatus)> = self
            .gossip
            .member_keys()
            .filter(|(k, s)| s.is_live() && (*k == self.key || !unreachable.contains(k)))
            .collect();
        candidates
            .iter()
            .find(|(_, s)| matches!(s, MemberStatus::Up | MemberStatus::Leaving))
            .or(candidates.first())
            .map(|(k, _)| *k)
    }

    /// The oldest reachable Up member.
    pub(super) fn coordinator_key(&self, unreachable: &BTreeSet<MemberKey>) -> Option<MemberKey> {
        self.gossip
            .member_keys()
            .find(|(k, s)| *s == MemberStatus::Up && !unreachable.contains(k))
            .map(|(k, _)| k)
    }

    /// Every live member, this node included.
    pub(super) fn live_keys(&self) -> BTreeSet<MemberKey> {
        self.gossip
            .member_keys()
            .filter(|(_, s)| s.is_live())
            .map(|(k, _)| k)
            .collect()
    }
}
