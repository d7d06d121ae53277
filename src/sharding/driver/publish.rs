//! What the control task publishes: this node's view of the sharding
//! coordinator, and the rebalance rounds (with their metrics).

use std::time::Instant;

use crate::sharding::coordinator::RebalanceReason;
use crate::sharding::stats::CoordinatorStatus;

use super::{Control, lock};

impl Control {
    /// This node's view of the sharding coordinator.
    pub(super) fn coordinator_status(&self) -> CoordinatorStatus {
        let mut status = CoordinatorStatus {
            acting: self.core.side().coordinator(),
            epoch: self.core.coordinator().highest_epoch(),
            allocating: None,
            registered: self.core.side().coordinator().is_some_and(|c| {
                self.regions()
                    .iter()
                    .all(|region| region.accepted_by() == Some(c))
            }),
        };
        if let Some((epoch, allocating)) = self.core.coordinator().activity(Instant::now()) {
            status.acting = Some(self.me);
            status.epoch = epoch;
            status.allocating = Some(allocating);
        }
        status
    }

    pub(super) fn publish_rounds(&mut self) {
        let closed = self.core.coordinator_mut().take_closed();
        if !closed.is_empty() {
            let node = self.me.addr.to_string();
            let now = Instant::now();
            for (reason, moves, at) in closed {
                let reason = reason_label(reason);
                let seconds = now.saturating_duration_since(at).as_secs_f64();
                crate::ops::telemetry::rebalance_round(&node, reason, moves, seconds);
                self.node.history().record(
                    crate::ops::history::ClusterEventKind::RebalanceRound,
                    format!(
                        "rebalance round ({reason}): {moves} shard{} moved in {seconds:.2} s",
                        if moves == 1 { "" } else { "s" }
                    ),
                );
            }
        }
        let rounds = self.core.coordinator().rounds();
        let mut published = lock(&self.rounds);
        if published.len() != rounds.len() || published.last() != rounds.last() {
            *published = rounds.to_vec();
        }
    }
}

/// A rebalance round's reason as the metrics label it (SPEC §14).
pub(super) fn reason_label(reason: RebalanceReason) -> &'static str {
    match reason {
        RebalanceReason::DeadOwner => "dead_owner",
        RebalanceReason::GracefulSpread => "graceful_spread",
        RebalanceReason::GracefulLeave => "graceful_leave",
        RebalanceReason::NewerVersion => "newer_version",
        RebalanceReason::Traffic => "traffic",
    }
}
