//! Rebalance rounds: asking the strategy to spread load, the handoffs a
//! round starts, and the history of finished rounds (each with why its
//! shards moved).

use std::collections::BTreeMap;
use std::time::Instant;

use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::model::protocol::{Versions, compare_versions};

use super::{Command, CoordinatorCore, HandOff, RebalanceReason, RebalanceRound, ShardMovement};

/// A rebalance round whose handoffs are not all finished: it enters the
/// history when the last one ends, with the moves that completed.
pub(super) struct OpenRound {
    pub(super) round: RebalanceRound,
    pending: usize,
}

impl CoordinatorCore {
    /// The rebalance rounds made while this node was coordinator, oldest first.
    pub(crate) fn rounds(&self) -> &[RebalanceRound] {
        &self.rounds
    }

    /// The rounds closed since the last call (reason, moves, decided at),
    /// whatever the history keeps: for the metrics.
    pub(crate) fn take_closed(&mut self) -> Vec<(RebalanceReason, usize, Instant)> {
        std::mem::take(&mut self.closed_since)
    }

    /// Asks the strategy which shards of `type_name` to move to spread
    /// load, and starts at most `rebalance_per_round` handoffs. Not while
    /// the type's hosts run more than one protocol or application version
    /// (a rolling upgrade, SPEC §13.2, §13.11): then a shard moves only
    /// when its older host leaves, onto a node of the newest version, and
    /// once. The hold is logged when it begins and ends: a cluster left
    /// mixed (a forgotten node, a canary) is not rebalanced meanwhile.
    pub(super) fn rebalance(&mut self, type_name: &str, now: Instant, out: &mut Vec<Command>) {
        let mixed = self.versions_mixed(type_name);
        if mixed != self.held.contains(type_name) {
            if mixed {
                tracing::info!(
                    type_name,
                    "no rebalance rounds while this type's hosts run two protocol or application versions, or one has not registered (a rolling upgrade?)"
                );
                self.held.insert(type_name.to_owned());
            } else {
                tracing::info!(
                    type_name,
                    "this type's hosts run one version again: rebalance rounds resume"
                );
                self.held.remove(type_name);
            }
        }
        let candidates = self.candidates(type_name);
        let Some(table) = self.types.get_mut(type_name) else {
            return;
        };
        if candidates.len() < 2 || mixed || !table.handoffs.is_empty() {
            return;
        }
        let mut owned: BTreeMap<UniqueAddress, Vec<ShardId>> =
            candidates.iter().map(|m| (*m, Vec::new())).collect();
        for (shard, home) in table.homes().iter().enumerate() {
            if let Some(shards) = home.and_then(|h| owned.get_mut(&h.owner)) {
                shards.push(ShardId(shard as u32));
            }
        }
        // Placement by traffic may leave counts up to its slack apart:
        // the strategy spreads only what is further apart than that.
        if let Some(by_traffic) = self.config.placement_by_traffic {
            let most = owned.values().map(Vec::len).max().unwrap_or(0);
            let least = owned.values().map(Vec::len).min().unwrap_or(0);
            if most - least <= by_traffic.slack {
                return;
            }
        }
        let limit = self.config.rebalance_per_round;
        let epoch = self.epoch;
        let chosen = self.strategy.rebalance(type_name, &owned, limit);
        let round = (RebalanceReason::GracefulSpread, self.next_round);
        let mut started = 0;
        for ShardId(shard) in chosen {
            if started == limit {
                break;
            }
            let owned_by_candidate = table
                .home(shard)
                .is_some_and(|h| candidates.contains(&h.owner));
            if owned_by_candidate && table.start_handoff(type_name, shard, round, (now, epoch), out)
            {
                started += 1;
            }
        }
        self.open_round(round.1, round.0, now, started);
    }

    /// Region `from` says a message of a protocol line its version lacks
    /// reached `shard`, which it hosts: the shard moves, by a handoff, to a
    /// node of the type's newest version, when one is eligible and `from`
    /// is not of it (SPEC §13.6). Not while this core does not allocate.
    pub(crate) fn needs_newer(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        type_name: &str,
        shard: u32,
    ) -> Vec<Command> {
        let mut out = Vec::new();
        let Some((epoch, true)) = self.activity(now) else {
            return out;
        };
        let candidates = self.candidates(type_name);
        let Some(table) = self.types.get_mut(type_name) else {
            return out;
        };
        let owner = table.home(shard);
        // Somewhere newer: a candidate whose version extends the owner's.
        let version = |m: &UniqueAddress| table.version_of(m);
        let newer = (version(&from), candidates.iter().find_map(version));
        let newer = matches!(newer, (Some(old), Some(new)) if compare_versions(old, new) == Versions::Newer);
        if owner.is_none_or(|home| home.owner != from) || !newer {
            return out;
        }
        let round = (RebalanceReason::NewerVersion, self.next_round);
        if table.start_handoff(type_name, shard, round, (now, epoch), &mut out) {
            self.open_round(round.1, round.0, now, 1);
        }
        out
    }

    /// Opens round `number` (the next one) with `started` handoffs.
    pub(super) fn open_round(
        &mut self,
        number: u64,
        reason: RebalanceReason,
        at: Instant,
        started: usize,
    ) {
        if started == 0 {
            return;
        }
        debug_assert_eq!(number, self.next_round);
        self.next_round += 1;
        let round = RebalanceRound {
            at,
            reason,
            moves: Vec::new(),
        };
        self.open_rounds.insert(
            number,
            OpenRound {
                round,
                pending: started,
            },
        );
    }

    /// A handoff ended: with the move it completed, or without one (its
    /// shard was reallocated another way). Its round closes with its last.
    pub(super) fn end_handoff(&mut self, handoff: HandOff, moved: Option<ShardMovement>) {
        let Some(number) = handoff.round else {
            return;
        };
        let Some(open) = self.open_rounds.get_mut(&number) else {
            return;
        };
        open.round.moves.extend(moved);
        open.pending -= 1;
        if open.pending == 0
            && let Some(open) = self.open_rounds.remove(&number)
        {
            self.close(open.round);
        }
    }

    /// Adds a finished round to the history (if it moved anything).
    pub(super) fn close(&mut self, round: RebalanceRound) {
        if round.moves.is_empty() {
            return;
        }
        self.closed_since
            .push((round.reason, round.moves.len(), round.at));
        self.rounds.push(round);
        if self.rounds.len() > self.config.history {
            let excess = self.rounds.len() - self.config.history;
            self.rounds.drain(..excess);
        }
    }

    /// Adds moves made now outside any open round to the history, a round
    /// per reason.
    pub(super) fn record(&mut self, now: Instant, moves: Vec<(RebalanceReason, ShardMovement)>) {
        for reason in [
            RebalanceReason::DeadOwner,
            RebalanceReason::GracefulLeave,
            RebalanceReason::GracefulSpread,
            RebalanceReason::NewerVersion,
            RebalanceReason::Traffic,
        ] {
            let these: Vec<ShardMovement> = moves
                .iter()
                .filter(|(r, _)| *r == reason)
                .map(|(_, m)| m.clone())
                .collect();
            self.close(RebalanceRound {
                at: now,
                reason,
                moves: these,
            });
        }
    }
}
