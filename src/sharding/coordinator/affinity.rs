//! Placement that follows the traffic: which shards to move so that
//! shards that talk to each other share a node, within the count balance.
//! A pure function of the homes and the traffic between shards (SPEC
//! §13.11, Placement by traffic): no clock, no IO, the same answer for
//! the same input.
//!
//! The rule, one round: a shard's *pull* toward a node is the traffic it
//! exchanges with shards living there. A shard whose strongest pull is
//! toward another node than its own, by at least `min_gain` and by
//! `margin_pct` percent more than its pull toward home (the hysteresis),
//! and by more than the noise of sampled counts (four standard
//! deviations), is a candidate; candidates go strongest gain first, each re-weighed
//! against the homes as the round's earlier moves left them (so the two
//! ends of one edge never swap past each other), and a move is taken only
//! if its type's counts per node stay within `slack` of each other, or
//! come no further apart than they were. A move changes only the moving
//! shard's own pairs, so its gain is exactly what the traffic kept on one
//! node rises by: every move raises it by at least `min_gain`, and over
//! fixed traffic the rounds end (after at most the total traffic ÷
//! `min_gain` moves). A shard may still move more than once on the way,
//! when a partner's later move pulls it again.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::config::PlacementByTraffic;

/// The knobs of one round: `max_moves`, `slack`, `min_gain` and
/// `margin_pct`, as the user sets them.
pub(crate) type Affinity = PlacementByTraffic;

/// A shard of a type: `(type, shard)`.
pub(crate) type Key<T, S> = (T, S);

/// The traffic between two shards.
pub(crate) type Traffic<T, S> = BTreeMap<(Key<T, S>, Key<T, S>), u64>;

/// Each shard's partners, with the traffic it exchanges with each.
type Partners<T, S> = BTreeMap<Key<T, S>, Vec<(Key<T, S>, u64)>>;

/// The moves of one round, in the order taken: each shard once, to the
/// node named. `homes`: where every shard lives; `traffic`: the traffic
/// between two shards, counted once per pair whichever way it went (a
/// pair's two orders add up); `nodes`: where the shards of each type may
/// go (a type not named moves nowhere, and still pulls its partners);
/// `sample_weight`: what one sample in the counts weighs (0: the counts
/// are exact).
pub(crate) fn plan<T, S, N>(
    homes: &BTreeMap<Key<T, S>, N>,
    traffic: &Traffic<T, S>,
    nodes: &BTreeMap<T, BTreeSet<N>>,
    rule: &Affinity,
    sample_weight: u64,
) -> Vec<(Key<T, S>, N)>
where
    T: Ord + Copy,
    S: Ord + Copy,
    N: Ord + Copy,
{
    let mut partners: Partners<T, S> = BTreeMap::new();
    for (&(a, b), &weight) in traffic {
        if a != b && weight > 0 {
            partners.entry(a).or_default().push((b, weight));
            partners.entry(b).or_default().push((a, weight));
        }
    }
    let mut homes = homes.clone();
    let mut counts: BTreeMap<T, BTreeMap<N, usize>> = BTreeMap::new();
    for (&(kind, _), node) in &homes {
        if let Some(theirs) = nodes.get(&kind).filter(|n| n.contains(node)) {
            let per_node = counts
                .entry(kind)
                .or_insert_with(|| theirs.iter().map(|n| (*n, 0)).collect());
            *per_node.entry(*node).or_default() += 1;
        }
    }
    // The candidates against the round's first homes, strongest first.
    let mut candidates: Vec<(u64, Key<T, S>)> = partners
        .iter()
        .filter_map(|(&key, theirs)| {
            let (_, gain) = best_move(key, theirs, &homes, nodes, (rule, sample_weight))?;
            Some((gain, key))
        })
        .collect();
    candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut moves = Vec::new();
    for (_, key) in candidates {
        if moves.len() >= rule.max_moves {
            break;
        }
        // Weighed again: an earlier move may have taken its partner away.
        let weighed = best_move(key, &partners[&key], &homes, nodes, (rule, sample_weight));
        let Some((to, _)) = weighed else {
            continue;
        };
        let from = homes[&key];
        let Some(per_node) = counts.get_mut(&key.0) else {
            continue;
        };
        let Some(after) = moved_one(per_node, from, to) else {
            continue;
        };
        if !keeps_balance(per_node, &after, rule.slack) {
            continue;
        }
        *per_node = after;
        homes.insert(key, to);
        moves.push((key, to));
    }
    moves
}

/// Where `key` pulls hardest, if a move there passes the rule, and the
/// gain: that pull less its pull toward home.
fn best_move<T: Ord + Copy, S: Ord + Copy, N: Ord + Copy>(
    key: Key<T, S>,
    partners: &[(Key<T, S>, u64)],
    homes: &BTreeMap<Key<T, S>, N>,
    nodes: &BTreeMap<T, BTreeSet<N>>,
    (rule, sample_weight): (&Affinity, u64),
) -> Option<(N, u64)> {
    let nodes = nodes.get(&key.0)?;
    let home = *homes.get(&key)?;
    if !nodes.contains(&home) {
        return None;
    }
    let mut pull: BTreeMap<N, u64> = BTreeMap::new();
    for (partner, weight) in partners {
        if let Some(node) = homes.get(partner).filter(|n| nodes.contains(n)) {
            let pulled = pull.entry(*node).or_default();
            *pulled = pulled.saturating_add(*weight);
        }
    }
    let at_home = pull.get(&home).copied().unwrap_or(0);
    // The strongest pull, the lowest node among equals.
    let (to, away) = pull
        .iter()
        .filter(|(node, _)| **node != home)
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
    let gain = away.checked_sub(at_home)?;
    let margin_met =
        u128::from(*away) * 100 >= u128::from(at_home) * u128::from(100 + rule.margin_pct);
    // Counts made of samples that weigh `w` each vary by about √(w·c):
    // the gain, a difference of two, must stand four such deviations
    // clear of nothing, or shards under even traffic would move on the
    // sampling's noise alone.
    let noise = 4.0 * (sample_weight as f64 * (*away as f64 + at_home as f64)).sqrt();
    let clear = gain as f64 > noise;
    (gain >= rule.min_gain.max(1) && margin_met && clear).then_some((*to, gain))
}

/// The counts after one shard of the type moved from `from` to `to`;
/// `None` if `from` holds none (never, for a shard counted at its home).
fn moved_one<N: Ord + Copy>(
    counts: &BTreeMap<N, usize>,
    from: N,
    to: N,
) -> Option<BTreeMap<N, usize>> {
    let mut after = counts.clone();
    let left = after.get_mut(&from)?;
    *left = left.checked_sub(1)?;
    *after.entry(to).or_default() += 1;
    Some(after)
}

/// Whether counts `after` a move are within `slack` of each other, or no
/// further apart than `before` it.
fn keeps_balance<N: Ord>(
    before: &BTreeMap<N, usize>,
    after: &BTreeMap<N, usize>,
    slack: usize,
) -> bool {
    let spread = |counts: &BTreeMap<N, usize>| {
        let max = counts.values().max().copied().unwrap_or(0);
        let min = counts.values().min().copied().unwrap_or(0);
        max - min
    };
    let after = spread(after);
    after <= slack || after <= spread(before)
}

#[cfg(test)]
#[path = "affinity_tests.rs"]
mod tests;
