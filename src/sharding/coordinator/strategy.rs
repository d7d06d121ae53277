//! Where shards go: the strategy the coordinator asks for the new home of
//! a shard and for the shards to move to spread load, and the default,
//! [`LeastShardAllocation`].

use std::collections::BTreeMap;

use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;

/// Decides where a shard goes. The coordinator calls it only with at least
/// one candidate.
pub trait ShardAllocationStrategy: Send + 'static {
    /// Picks the new home of `shard` of `type_name` among the keys of
    /// `counts`, which maps every eligible member to the number of shards of
    /// this type it owns now. Not asked for a shard moved for traffic
    /// (`ShardingConfig::placement_by_traffic`), whose round named its
    /// target, while that target is still eligible. Returning a member that is not a key, or
    /// `None`, leaves the shard unallocated for now (it is asked again at the
    /// next change).
    fn allocate(
        &mut self,
        type_name: &str,
        shard: ShardId,
        counts: &BTreeMap<UniqueAddress, usize>,
    ) -> Option<UniqueAddress>;

    /// Names live shards of `type_name` to move to spread load. `owned` maps
    /// every eligible member to the shards of the type it owns; the
    /// coordinator moves at most `limit` of the shards named (those owned
    /// by a key of `owned`), each by a handoff, after which the shard is
    /// allocated anew through [`allocate`](Self::allocate). It is asked
    /// once per `rebalance_interval` for each type with no handoff in
    /// progress and at least two eligible members — with placement by
    /// traffic on, only when the type's counts are more than its `slack`
    /// apart. The default moves nothing.
    fn rebalance(
        &mut self,
        type_name: &str,
        owned: &BTreeMap<UniqueAddress, Vec<ShardId>>,
        limit: usize,
    ) -> Vec<ShardId> {
        let _ = (type_name, owned, limit);
        Vec::new()
    }
}

/// The default strategy: the eligible member owning the fewest shards of the
/// type, the oldest among equals. Allocating one shard at a time this way
/// keeps the per-member counts within one of each other over a stable set
/// of members; rebalancing moves shards from the most loaded members while
/// counts differ by more than one (so a member that joins gets its share).
#[derive(Clone, Copy, Debug, Default)]
pub struct LeastShardAllocation;

impl ShardAllocationStrategy for LeastShardAllocation {
    fn allocate(
        &mut self,
        _type_name: &str,
        _shard: ShardId,
        counts: &BTreeMap<UniqueAddress, usize>,
    ) -> Option<UniqueAddress> {
        counts
            .iter()
            .min_by_key(|(member, count)| (**count, member.age_key()))
            .map(|(member, _)| *member)
    }

    fn rebalance(
        &mut self,
        _type_name: &str,
        owned: &BTreeMap<UniqueAddress, Vec<ShardId>>,
        limit: usize,
    ) -> Vec<ShardId> {
        // Plays the moves out on a copy: each takes the highest shard of the
        // most loaded member (the youngest among equals) to the least loaded.
        let mut owned: Vec<(UniqueAddress, Vec<ShardId>)> = owned
            .iter()
            .map(|(member, shards)| (*member, shards.clone()))
            .collect();
        let mut moves = Vec::new();
        while moves.len() < limit {
            let load =
                |(member, shards): &(UniqueAddress, Vec<ShardId>)| (shards.len(), member.age_key());
            let (Some(most), Some(least)) = (
                (0..owned.len()).max_by_key(|i| load(&owned[*i])),
                (0..owned.len()).min_by_key(|i| load(&owned[*i])),
            ) else {
                break;
            };
            if owned[most].1.len() <= owned[least].1.len() + 1 {
                break;
            }
            owned[most].1.sort_unstable();
            let Some(shard) = owned[most].1.pop() else {
                break;
            };
            owned[least].1.push(shard);
            moves.push(shard);
        }
        moves
    }
}
