//! Cluster-wide stats requests: every live member asked for its region of
//! a type, the answers gathered, and the request answered when all came or
//! its deadline passed (the silent members listed as failed).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::membership::MemberStatus;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::region::Region;
use crate::sharding::stats::{ClusterShardingStats, CoordinatorStatus};
use crate::sharding::wire::{ActiveCoordinator, AskCountsWire, ControlMsg};
use crate::telemetry::AskCounts;

use super::Control;

/// A cluster-wide stats request in progress.
pub(super) struct PendingStats {
    pub(super) deadline: Instant,
    waiting: BTreeSet<UniqueAddress>,
    stats: ClusterShardingStats,
    reply: tokio::sync::oneshot::Sender<ClusterShardingStats>,
}

/// The hosted shards of a region, with their live entities, as `Stats` carries them.
pub(super) fn hosted_shards(region: &Region) -> Vec<(u32, u32)> {
    region
        .state()
        .shards
        .into_iter()
        .map(|(shard, live)| (shard.0, u32::try_from(live).unwrap_or(u32::MAX)))
        .collect()
}

/// A region's ask counts, as `Stats` carries them.
pub(super) fn ask_counts(region: &Region) -> AskCountsWire {
    let counts = region.metrics.ask_counts();
    AskCountsWire {
        answered: counts.answered,
        failed: counts.failed.into_iter().collect(),
    }
}

/// A member's `Stats` answer, decoded.
pub(super) struct StatsAnswer {
    pub(super) region: bool,
    pub(super) shards: Vec<(u32, u32)>,
    pub(super) coordinator: Option<ActiveCoordinator>,
    pub(super) app_version: crate::AppVersion,
    /// `None` from a build that does not count asks.
    pub(super) asks: Option<AskCounts>,
    pub(super) roles: BTreeSet<String>,
}

/// A member answered that it acts as the coordinator: the highest epoch
/// among such answers wins (two only around a partition's healing).
fn note_coordinator(
    stats: &mut ClusterShardingStats,
    from: UniqueAddress,
    active: ActiveCoordinator,
) {
    if stats
        .coordinator
        .as_ref()
        .is_none_or(|c| c.epoch < active.epoch)
    {
        stats.coordinator = Some(CoordinatorStatus {
            acting: Some(from),
            epoch: active.epoch,
            allocating: Some(active.allocating),
            registered: false,
        });
    }
}

impl Control {
    /// Asks every live member (this one answered at once) for its region
    /// of `type_name`.
    pub(super) fn gather_stats(
        &mut self,
        type_name: &'static str,
        timeout: Duration,
        reply: tokio::sync::oneshot::Sender<ClusterShardingStats>,
    ) {
        let mut stats = ClusterShardingStats::default();
        if let Some(region) = self.region(type_name) {
            let shards = region.state().shards;
            stats.regions.insert(self.me, shards);
            stats.asks.insert(self.me, region.metrics.ask_counts());
        }
        (stats.app_versions).insert(self.me, self.node.config().app_version.clone());
        (stats.roles).insert(self.me, self.node.config().roles.clone());
        if let Some((epoch, allocating)) = self.core.coordinator().activity(Instant::now()) {
            note_coordinator(&mut stats, self.me, ActiveCoordinator { epoch, allocating });
        }
        let state = self.state.borrow().clone();
        let waiting: BTreeSet<UniqueAddress> = state
            .members
            .iter()
            .filter(|m| {
                matches!(
                    m.status,
                    MemberStatus::Joining | MemberStatus::Up | MemberStatus::Leaving
                )
            })
            .map(|m| m.address)
            .filter(|a| *a != self.me)
            .collect();
        if waiting.is_empty() {
            let _ = reply.send(stats);
            return;
        }
        let id = self.next_stats;
        self.next_stats += 1;
        for member in &waiting {
            let msg = ControlMsg::GetStats {
                id,
                type_name: type_name.to_owned(),
            };
            self.send_remote(*member, &msg);
        }
        self.stats.insert(
            id,
            PendingStats {
                deadline: Instant::now() + timeout,
                waiting,
                stats,
                reply,
            },
        );
    }

    pub(super) fn stats_answer(&mut self, from: UniqueAddress, id: u64, answer: StatsAnswer) {
        let Some(pending) = self.stats.get_mut(&id) else {
            return;
        };
        if !pending.waiting.remove(&from) {
            return;
        }
        let StatsAnswer {
            region,
            shards,
            coordinator,
            app_version,
            asks,
            roles,
        } = answer;
        pending.stats.app_versions.insert(from, app_version);
        pending.stats.roles.insert(from, roles);
        if let Some(asks) = asks {
            pending.stats.asks.insert(from, asks);
        }
        if let Some(active) = coordinator {
            note_coordinator(&mut pending.stats, from, active);
        }
        if region {
            let shards = shards
                .into_iter()
                .map(|(shard, live)| (ShardId(shard), live as usize))
                .collect();
            pending.stats.regions.insert(from, shards);
        }
        if pending.waiting.is_empty()
            && let Some(done) = self.stats.remove(&id)
        {
            let _ = done.reply.send(done.stats);
        }
    }

    /// Answers the stats requests whose time is up, with the silent members
    /// as failed.
    pub(super) fn expire_stats(&mut self, now: Instant) {
        let due: Vec<u64> = self
            .stats
            .iter()
            .filter(|(_, p)| now >= p.deadline)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            if let Some(mut done) = self.stats.remove(&id) {
                done.stats.failed = std::mem::take(&mut done.waiting);
                let _ = done.reply.send(done.stats);
            }
        }
    }
}
