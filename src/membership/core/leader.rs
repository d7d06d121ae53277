//! The leader's duties: timeout downing, the moves it makes once the state
//! has converged, and the checked application of every decision.

use std::collections::BTreeSet;
use std::time::Instant;

use tracing::{debug, info};

use super::MembershipCore;
use crate::membership::error::MembershipError;
use crate::membership::gossip::MemberKey;
use crate::membership::status::MemberStatus;

impl MembershipCore {
    /// The leader's duties. Returns whether it changed anything.
    pub(super) fn leader_actions(&mut self, now: Instant) -> Result<bool, MembershipError> {
        let unreachable = self.gossip.unreachable_keys();
        let leader = self.leader_key(&unreachable) == Some(self.key);
        let mut changed = false;
        if let Some(strategy) = self.config.split_brain {
            // Every node follows the partition and judges its side (a member
            // of a losing side downs itself even if its leader's word never
            // reaches it); the leader also downs the others.
            self.track_partition(now, &unreachable);
            if self.deciding {
                changed = self.resolve(now, strategy, leader)?;
            }
        }
        if !leader {
            return Ok(changed);
        }
        if let (None, Some(downing)) = (self.config.split_brain, self.config.downing_timeout) {
            let due: Vec<MemberKey> = self
                .unreachable_since
                .iter()
                .filter(|(_, since)| since.checked_add(downing).is_some_and(|t| now >= t))
                .map(|(k, _)| *k)
                .collect();
            for k in due {
                if self.gossip.status(&k).is_some_and(|s| s.is_live()) {
                    info!(leader = %self.me, member = %k.0, "unreachable past the downing timeout: down");
                    self.decide(k, MemberStatus::Down)?;
                    changed = true;
                }
            }
        }
        if changed || !self.converged(&unreachable) {
            return Ok(changed);
        }
        let snapshot: Vec<(MemberKey, MemberStatus)> = self.gossip.member_keys().collect();
        for (k, status) in snapshot {
            let next = match status {
                MemberStatus::Joining => MemberStatus::Up,
                MemberStatus::Leaving => MemberStatus::Exiting,
                MemberStatus::Exiting | MemberStatus::Down => MemberStatus::Removed,
                MemberStatus::Up | MemberStatus::Removed => continue,
            };
            debug!(leader = %self.me, member = %k.0, from = ?status, to = ?next, "leader action");
            self.decide(k, next)?;
            changed = true;
        }
        Ok(changed)
    }

    /// Whether every live member this node must wait for has reported the
    /// very state this node holds. Unreachable members block convergence,
    /// except Exiting ones (they are on their way out anyway).
    fn converged(&self, unreachable: &BTreeSet<MemberKey>) -> bool {
        let digest = self.gossip.digest();
        self.gossip.member_keys().all(|(k, s)| {
            if k == self.key || !s.is_live() {
                return true;
            }
            if unreachable.contains(&k) {
                return s == MemberStatus::Exiting;
            }
            self.seen.get(&k) == Some(&digest)
        })
    }

    /// Applies one decision taken by this node, refusing illegal steps.
    pub(super) fn decide(
        &mut self,
        key: MemberKey,
        to: MemberStatus,
    ) -> Result<(), MembershipError> {
        let Some(from) = self.gossip.status(&key) else {
            return Err(MembershipError::Bug(format!(
                "decision about unknown member {}",
                key.0
            )));
        };
        if !from.can_transition_to(to) {
            return Err(MembershipError::Bug(format!(
                "illegal decision {from:?}->{to:?} for {}",
                key.0
            )));
        }
        self.gossip.put_status(key, to);
        self.gossip.normalize();
        self.dirty = true;
        self.push_pending = true;
        Ok(())
    }
}
