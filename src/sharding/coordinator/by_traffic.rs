//! Placement by traffic at the coordinator (SPEC §13.11): the traffic
//! regions report, kept per pair of shards and halved every round, and
//! the round that moves shards by it, through the rule in `affinity`.

use std::collections::BTreeMap;
use std::time::Instant;

use super::affinity::{self, Traffic};
use super::{Command, CoordinatorCore, RebalanceReason};
use crate::model::config::TRAFFIC_SAMPLE_WEIGHT;

/// The most pairs of shards kept; a pair first reported past it is left
/// out until the halving makes room.
pub(super) const MAX_PAIRS: usize = 65_536;

/// The traffic between shards, as reported since the rounds last halved
/// it (each pair once, whichever way its messages went).
#[derive(Default)]
pub(super) struct TrafficTable {
    /// The type names the pairs name, by index.
    names: Vec<String>,
    pairs: Traffic<u16, u32>,
}

impl TrafficTable {
    fn index(&mut self, name: &str) -> u16 {
        match self.names.iter().position(|n| n == name) {
            Some(i) => i as u16,
            None => {
                self.names.push(name.to_owned());
                (self.names.len() - 1) as u16
            }
        }
    }

    fn add(&mut self, (a, b): ((&str, u32), (&str, u32)), count: u64) {
        let (a, b) = ((self.index(a.0), a.1), (self.index(b.0), b.1));
        if a == b || count == 0 {
            return;
        }
        let pair = if a < b { (a, b) } else { (b, a) };
        let room = self.pairs.len() < MAX_PAIRS;
        match self.pairs.get_mut(&pair) {
            Some(kept) => *kept = kept.saturating_add(count),
            None if room => {
                self.pairs.insert(pair, count);
            }
            None => {}
        }
    }

    /// The pairs kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.pairs.len()
    }

    /// Halves every count: what was reported a round ago weighs half as
    /// much as what comes now.
    fn halve(&mut self) {
        self.pairs.retain(|_, count| {
            *count /= 2;
            *count > 0
        });
    }
}

impl CoordinatorCore {
    /// A region node's report of what its entities sent to which shards
    /// (sampled counts, SPEC §13.11). Kept while this core acts and places
    /// by traffic; a pair naming a type it does not know, or a shard past
    /// the type's count, is left out.
    pub(crate) fn traffic(&mut self, pairs: &[(String, u32, String, u32, u64)]) {
        if self.config.placement_by_traffic.is_none() || !self.active {
            return;
        }
        let types = &self.types;
        let known = |name: &str, shard: u32| types.get(name).is_some_and(|t| shard < t.num_shards);
        for (a, sa, b, sb, count) in pairs {
            if known(a, *sa) && known(b, *sb) {
                self.traffic.add(((a, *sa), (b, *sb)), *count);
            }
        }
    }

    /// A round of placement by traffic, after the count rebalance of
    /// every type: when nothing is moving (the count rebalance comes
    /// first) and no type's hosts run two versions, the shards the rule
    /// picks start moving, each by a handoff to the node it named. Then
    /// the counts are halved.
    pub(super) fn rebalance_by_traffic(&mut self, now: Instant, out: &mut Vec<Command>) {
        let Some(rule) = self.config.placement_by_traffic else {
            return;
        };
        let moving = self.types.values().any(|t| !t.handoffs.is_empty());
        if !moving && self.held.is_empty() && !self.traffic.pairs.is_empty() {
            let mut homes = BTreeMap::new();
            let mut nodes = BTreeMap::new();
            for (index, name) in self.traffic.names.iter().enumerate() {
                let Some(table) = self.types.get(name) else {
                    continue;
                };
                // Every home pulls; a type with one candidate moves nowhere.
                for (shard, home) in table.homes().iter().enumerate() {
                    if let Some(home) = home {
                        homes.insert((index as u16, shard as u32), home.owner);
                    }
                }
                let candidates = self.candidates(name);
                if candidates.len() >= 2 {
                    nodes.insert(index as u16, candidates);
                }
            }
            let weight = TRAFFIC_SAMPLE_WEIGHT;
            let moves = affinity::plan(&homes, &self.traffic.pairs, &nodes, &rule, weight);
            let round = (RebalanceReason::Traffic, self.next_round);
            let epoch = self.epoch;
            let mut started = 0;
            for ((index, shard), to) in moves {
                let name = &self.traffic.names[usize::from(index)];
                let Some(table) = self.types.get_mut(name) else {
                    continue;
                };
                if table.start_handoff(name, shard, round, (now, epoch), out) {
                    if let Some(handoff) = table.handoffs.get_mut(&shard) {
                        handoff.to = Some(to);
                    }
                    started += 1;
                }
            }
            self.open_round(round.1, round.0, now, started);
        }
        self.traffic.halve();
    }
}
