//! The region side of the allocation protocol, as the control task runs it:
//! this node's regions as the region core reads and moves them, a graceful
//! leave, and handed-off shards reported once their records are flushed.

use std::sync::Arc;
use std::time::Instant;

use crate::model::error::{RegionRefusal, ShardingError};
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::region::Region;
use crate::runtime::slot::HomeChange;
use crate::sharding::coordinator::ShardHome;
use crate::sharding::region_core::{LocalRegions, RegionsView};
use crate::sharding::wire::TypeRegistration;

use super::Control;
use super::inbox::DriverMsg;

impl Control {
    /// This node's regions, for the region side.
    pub(super) fn hosted(&self) -> Hosted {
        Hosted(self.regions())
    }

    /// Starts a graceful leave. Returns whether handoffs are worth waiting
    /// for: not when there is no coordinator, nor when this node
    /// coordinates and no other region can take a shard.
    pub(super) fn begin_leave(&mut self) -> bool {
        let (wait, commands) = self.core.begin_leave(Instant::now(), &self.hosted());
        self.execute(commands);
        wait
    }

    /// A handed-off shard stopped: once what its entities recorded is in
    /// the store (the next home reads it to respawn them), tell the
    /// coordinator.
    pub(super) fn flush_then_report(
        &mut self,
        type_name: &'static str,
        shard: ShardId,
        generation: u64,
    ) {
        let report = DriverMsg::ReportStopped {
            type_name,
            shard,
            generation,
        };
        let remember = self.region(type_name).and_then(|r| r.remember().cloned());
        match (remember, self.self_tx.upgrade()) {
            (Some(remember), Some(tx)) => {
                tokio::spawn(async move {
                    if let Err(error) = remember.barrier().await {
                        tracing::warn!(type_name, %shard, %error, "remember-entities records of a handed-off shard not flushed");
                    }
                    let _ = tx.send(report);
                });
            }
            _ => {
                let commands = self.core.shard_stopped(
                    Instant::now(),
                    &self.hosted(),
                    type_name,
                    shard.0,
                    generation,
                );
                self.execute(commands);
            }
        }
    }
}

/// One type's region as the region side reads and moves it: the
/// runtime's [`Region`], or the cluster simulator's (around the same
/// [`ShardTable`](crate::runtime::region::ShardTable)).
pub(crate) trait TypeRegion {
    fn type_name(&self) -> &'static str;
    /// Its protocol's fingerprint.
    fn fingerprint(&self) -> u64;
    /// Its protocol's fingerprint up to each line (`Protocol::LINES`).
    fn lines(&self) -> &'static [u64];
    fn num_shards(&self) -> u32;
    /// It routes only (registered proxy-only).
    fn is_proxy(&self) -> bool;
    /// Every home it knows (its replica of the table).
    fn replica(&self) -> Vec<(u32, ShardHome)>;
    /// Its hosted shards whose handoff has stopped every entity.
    fn stopped_shards(&self) -> Vec<u32>;
    fn generation_of(&self, shard: ShardId) -> u64;
    fn is_handed_off(&self, shard: ShardId, generation: u64) -> bool;
    fn set_home(&self, shard: ShardId, home: ShardHome, from: Option<UniqueAddress>) -> HomeChange;
    fn node_lost(&self, node: &UniqueAddress) -> usize;
    fn call_off_handoffs(&self);
    fn hand_off(&self, shard: ShardId, generation: u64);
    fn mark_left(&self, nowhere: bool);
    fn accepted(&self, by: UniqueAddress);
    fn refuse(&self, error: ShardingError);
}

impl TypeRegion for Arc<Region> {
    fn type_name(&self) -> &'static str {
        self.type_name
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    fn lines(&self) -> &'static [u64] {
        self.lines
    }
    fn num_shards(&self) -> u32 {
        Region::num_shards(self)
    }
    fn is_proxy(&self) -> bool {
        Region::is_proxy(self)
    }
    fn replica(&self) -> Vec<(u32, ShardHome)> {
        self.table().replica()
    }
    fn stopped_shards(&self) -> Vec<u32> {
        self.table().stopped_shards()
    }
    fn generation_of(&self, shard: ShardId) -> u64 {
        self.table().generation_of(shard)
    }
    fn is_handed_off(&self, shard: ShardId, generation: u64) -> bool {
        self.table().is_handed_off(shard, generation)
    }
    fn set_home(&self, shard: ShardId, home: ShardHome, from: Option<UniqueAddress>) -> HomeChange {
        Region::set_home(self, shard, home, from)
    }
    fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.table().node_lost(node)
    }
    fn call_off_handoffs(&self) {
        Region::call_off_handoffs(self)
    }
    fn hand_off(&self, shard: ShardId, generation: u64) {
        Region::hand_off(self, shard, generation)
    }
    fn mark_left(&self, nowhere: bool) {
        self.table().mark_left(nowhere)
    }
    fn accepted(&self, by: UniqueAddress) {
        Region::accepted(self, by)
    }
    fn refuse(&self, error: ShardingError) {
        Region::refuse(self, error)
    }
}

/// This node's regions, as the region side reads and moves them.
pub(crate) struct Hosted<R = Arc<Region>>(pub(crate) Vec<R>);

impl<R: TypeRegion> Hosted<R> {
    fn get(&self, type_name: &str) -> Option<&R> {
        self.0.iter().find(|r| r.type_name() == type_name)
    }

    /// The region of `type_name`, if `shard` is one of its shards.
    fn with_shard(&self, type_name: &str, shard: u32) -> Option<&R> {
        self.get(type_name).filter(|r| shard < r.num_shards())
    }
}

impl<R: TypeRegion> RegionsView for Hosted<R> {
    fn registrations(&self, leaving: bool) -> Vec<TypeRegistration> {
        self.0
            .iter()
            .map(|r| TypeRegistration {
                type_name: r.type_name().to_owned(),
                fingerprint: r.fingerprint(),
                lines: r.lines().to_vec(),
                num_shards: r.num_shards(),
                proxy: r.is_proxy(),
                leaving,
                homes: r
                    .replica()
                    .into_iter()
                    .map(|(shard, home)| (shard, home.owner, home.generation))
                    .collect(),
                stopped: r.stopped_shards(),
            })
            .collect()
    }

    fn type_names(&self) -> Vec<String> {
        self.0.iter().map(|r| r.type_name().to_owned()).collect()
    }

    fn generation_of(&self, type_name: &str, shard: u32) -> u64 {
        self.get(type_name)
            .map_or(0, |r| r.generation_of(ShardId(shard)))
    }

    fn is_handed_off(&self, type_name: &str, shard: u32, generation: u64) -> bool {
        self.get(type_name)
            .is_some_and(|r| r.is_handed_off(ShardId(shard), generation))
    }
}

impl<R: TypeRegion> LocalRegions for Hosted<R> {
    fn set_home(
        &self,
        type_name: &str,
        shard: u32,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> Option<(&'static str, HomeChange)> {
        let region = self.with_shard(type_name, shard)?;
        Some((
            region.type_name(),
            region.set_home(ShardId(shard), home, from),
        ))
    }

    fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.0.iter().map(|r| r.node_lost(node)).sum()
    }

    fn call_off_handoffs(&self) {
        for region in &self.0 {
            region.call_off_handoffs();
        }
    }

    fn hand_off(&self, type_name: &str, shard: u32, generation: u64) {
        if let Some(region) = self.with_shard(type_name, shard) {
            region.hand_off(ShardId(shard), generation);
        }
    }

    fn mark_left(&self, type_name: &str, nowhere: bool) {
        if let Some(region) = self.get(type_name) {
            region.mark_left(nowhere);
        }
    }

    fn accepted(&self, type_name: &str, by: UniqueAddress) {
        if let Some(region) = self.get(type_name) {
            region.accepted(by);
        }
    }

    fn refused(
        &self,
        type_name: &str,
        reason: String,
        cluster_fingerprint: Option<u64>,
        cluster_num_shards: Option<u32>,
        differing_line: Option<u32>,
    ) {
        if let Some(region) = self.get(type_name) {
            region.refuse(ShardingError::RegionRefused(Box::new(RegionRefusal {
                type_name: region.type_name(),
                fingerprint: region.fingerprint(),
                num_shards: region.num_shards(),
                cluster_fingerprint,
                cluster_num_shards,
                differing_line,
                reason,
            })));
        }
    }
}
