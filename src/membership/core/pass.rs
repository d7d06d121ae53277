//! The common tail of every input: the full pass (normalise, leader
//! decisions, detector and ring resync, published changes) and the push of
//! the state or the digest that follows a change.

use std::time::Instant;

use tracing::info;

use super::{MembershipCore, Phase};
use crate::membership::error::MembershipError;
use crate::membership::status::MemberStatus;

impl MembershipCore {
    /// Normalises, takes leader decisions, resyncs the detector and the
    /// ring, publishes what changed, and pushes the state (a change of this
    /// node's own) or its digest (a change learnt by merge) to a few
    /// members. The full pass runs only when something it reads changed or
    /// a timed decision is due, so an input that changes nothing (the
    /// common heartbeat) costs O(log N), not O(N).
    pub(super) fn after_input(&mut self, now: Instant) -> Result<(), MembershipError> {
        if !matches!(self.phase, Phase::Member) {
            return Ok(());
        }
        let downing_due = self.leader == Some(self.key)
            && self.config.split_brain.is_none()
            && self.config.downing_timeout.is_some_and(|d| {
                self.unreachable_since
                    .values()
                    .any(|since| since.checked_add(d).is_some_and(|t| now >= t))
            });
        let resolving = self.deciding && self.partition.is_some();
        if self.dirty || self.seen_changed || downing_due || resolving {
            self.full_pass(now)?;
        }
        if self.push_pending {
            self.push_pending = false;
            self.spread_pending = false;
            for k in self.spread_targets() {
                self.send_state(k, now);
            }
        } else if self.spread_pending {
            self.spread_pending = false;
            for k in self.spread_targets() {
                self.send_digest(k);
            }
        }
        if self.self_status().is_some_and(|s| !s.is_live()) {
            info!(me = %self.me, status = ?self.self_status(), "this node is out of the cluster");
            self.phase = Phase::Terminated;
        }
        self.expected_wake = self.poll_timeout();
        Ok(())
    }

    fn full_pass(&mut self, now: Instant) -> Result<(), MembershipError> {
        self.gossip.normalize();
        // Each pass moves a member at most one step; a lone node (for which
        // convergence is immediate) may need several passes.
        // Events are published after each pass, so subscribers see every
        // step this node takes itself (Down, then Removed).
        for _ in 0..8 {
            self.refresh_unreachable_since(now);
            self.publish_changes();
            if !self.leader_actions(now)? {
                break;
            }
        }
        self.refresh_unreachable_since(now);
        self.publish_changes();
        let Some(my_status) = self.self_status() else {
            return Err(MembershipError::Bug(
                "member phase without an own entry".into(),
            ));
        };
        if my_status == MemberStatus::Exiting && self.exit_deadline.is_none() {
            self.exit_deadline = now.checked_add(self.config.exit_timeout);
        }
        self.digest = self.gossip.digest();
        self.refresh_ring(now);
        self.dirty = false;
        self.seen_changed = false;
        Ok(())
    }
}
