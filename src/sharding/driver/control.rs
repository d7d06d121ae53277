//! The control loop: one task that waits on the inbox, the control channel,
//! the membership watch and its timers; runs each membership view into the
//! coordinator core and the region side; and fences this node's regions
//! when it is out of the cluster.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::time::sleep_until;

use crate::membership::MembershipState;
use crate::runtime::region::Region;
use crate::sharding::region_core::{RegionCore, RegionsView};
use crate::sharding::stats::CoordinatorStatus;
use crate::sharding::wire::ControlMsg;

use super::inbox::DriverMsg;
use super::{Control, lock};

/// The least time between two of the control task's timed wakes.
const MIN_WAKE: Duration = Duration::from_millis(5);
/// How often asks whose caller gave up are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// The buffered-message gauges are sampled every this many sweeps.
const SAMPLE_BUFFERS_EVERY: u32 = 5;

impl Control {
    pub(super) async fn run(mut self) {
        let state = self.state.borrow_and_update().clone();
        self.membership(state);
        let mut next_sweep = Instant::now() + SWEEP_EVERY;
        let mut woke = Instant::now();
        loop {
            // Wake when a core has something to do with time alone, when a
            // stats request runs out, and for the sweep of given-up asks.
            // (Never sooner than `MIN_WAKE` after the last wake: a deadline
            // left in the past, a core's bug, must not spin the task.)
            let due = [
                self.core.poll_timeout(),
                self.stats.values().map(|p| p.deadline).min(),
                Some(next_sweep),
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(next_sweep)
            .max(woke + MIN_WAKE);
            tokio::select! {
                msg = self.rx.recv() => match msg {
                    None => break,
                    Some(DriverMsg::Retire) => {
                        let hosted = self.hosted();
                        let commands = self.core.retire(Instant::now(), &hosted, hosted.type_names());
                        self.execute(commands);
                    }
                    Some(DriverMsg::Barrier(done)) => {
                        let _ = done.send(());
                    }
                    Some(DriverMsg::Allocate { type_name, shard }) => {
                        let commands = self.core.allocate(Instant::now(), &self.hosted(), type_name, shard.0);
                        self.execute(commands);
                    }
                    Some(DriverMsg::NeedsNewer { type_name, shard }) => {
                        let commands = self.core.needs_newer(Instant::now(), &self.hosted(), type_name, shard.0);
                        self.execute(commands);
                    }
                    Some(DriverMsg::TypeRegistered) => {
                        let commands = self.core.type_registered(Instant::now(), &self.hosted());
                        self.execute(commands);
                    }
                    Some(DriverMsg::Leave(done)) => {
                        let wait = self.begin_leave();
                        let _ = done.send(wait);
                    }
                    Some(DriverMsg::ShardStopped { type_name, shard, generation }) => {
                        self.flush_then_report(type_name, shard, generation);
                    }
                    Some(DriverMsg::Stats { type_name, timeout, reply }) => {
                        self.gather_stats(type_name, timeout, reply);
                    }
                    Some(DriverMsg::ReportStopped { type_name, shard, generation }) => {
                        let commands = self.core.shard_stopped(Instant::now(), &self.hosted(), type_name, shard.0, generation);
                        self.execute(commands);
                    }
                },
                incoming = self.control.recv() => match incoming {
                    Some(incoming) => match ciborium::from_reader::<ControlMsg, _>(&incoming.payload[..]) {
                        Ok(msg) => self.handle(incoming.from, msg),
                        Err(error) => tracing::debug!(from = %incoming.from, %error, "undecodable sharding control message dropped"),
                    },
                    None => break,
                },
                changed = self.state.changed() => {
                    if changed.is_err() {
                        // The cluster node stopped (downed, or shut down):
                        // what this node hosts must stop too.
                        self.fence("the cluster node stopped");
                        break;
                    }
                    let state = self.state.borrow_and_update().clone();
                    self.membership(state);
                }
                _ = sleep_until(due.into()) => {
                    let now = Instant::now();
                    woke = now;
                    self.wake(now);
                    if now >= next_sweep {
                        next_sweep = now + SWEEP_EVERY;
                        self.remote.sweep();
                        self.report_traffic(now);
                        // Every fifth sweep (5 s): sampling counts every
                        // hosted entity under its slot's lock.
                        self.sweeps = self.sweeps.wrapping_add(1);
                        if self.sweeps.is_multiple_of(SAMPLE_BUFFERS_EVERY) {
                            for region in self.regions() {
                                region.sample_buffers();
                            }
                        }
                    }
                }
            }
            let status = self.coordinator_status();
            let mut published = lock(&self.status);
            if *published != status {
                *published = status;
            }
            drop(published);
            let versions = self.core.member_app_versions();
            let mut published = lock(&self.app_versions);
            if !Arc::ptr_eq(&published, versions) {
                *published = versions.clone();
            }
        }
        // Stopped (fenced, or the system is gone): this node follows no
        // coordinator any more, and is none.
        *lock(&self.status) = CoordinatorStatus::default();
        tracing::debug!(node = %self.me, "sharding control task stopped");
    }

    pub(super) fn regions(&self) -> Vec<Arc<Region>> {
        match self.shared.upgrade() {
            Some(shared) => shared.all_regions(),
            None => Vec::new(),
        }
    }

    pub(super) fn region(&self, type_name: &str) -> Option<Arc<Region>> {
        self.shared.upgrade()?.region(type_name)
    }

    /// Time alone has work for the control core (with the view as the
    /// membership publishes it), and stats requests whose time is up are
    /// answered.
    fn wake(&mut self, now: Instant) {
        let state = self.state.borrow().clone();
        let commands = self.core.handle_timeout(now, &state, &self.hosted());
        self.execute(commands);
        self.expire_stats(now);
    }

    /// What this node's entities sent to which shards since the last
    /// sweep, to the coordinator (SPEC §13.11; nothing unless placement by
    /// traffic is on).
    fn report_traffic(&mut self, now: Instant) {
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        let pairs: Vec<_> = shared
            .take_traffic()
            .into_iter()
            .map(|((a, sa), (b, sb), n)| (a.to_owned(), sa, b.to_owned(), sb, n))
            .collect();
        if pairs.is_empty() {
            return;
        }
        let commands = self.core.traffic(now, &self.hosted(), pairs);
        self.execute(commands);
    }

    /// This node is out of the cluster (downed — by the split-brain
    /// resolver on the losing side, by another member, or removed — or its
    /// cluster node stopped): its regions stop accepting and stop their
    /// entities, so that what the rest of the cluster reallocates does not
    /// also run here. Done once.
    pub(super) fn fence(&mut self, why: &str) {
        if self.fenced {
            return;
        }
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        if shared.is_shut_down() {
            return;
        }
        self.fenced = true;
        if !shared.all_regions().is_empty() {
            tracing::warn!(node = %self.me, why, "this node is out of the cluster: its regions stop");
        }
        shared.fence();
    }

    fn membership(&mut self, state: MembershipState) {
        // Out of the cluster: fenced before the control core applies the
        // view's moves to the regions (it does so as it decides), so that
        // nothing they replay is accepted first. Its own `Fence` then
        // finds the work done.
        if RegionCore::is_out(&state) {
            self.fence("this node was downed or removed");
        }
        let commands = self.core.membership(Instant::now(), state, &self.hosted());
        self.execute(commands);
    }
}
