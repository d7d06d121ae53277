//! The control loop: one task that waits on the inbox, the control channel,
//! the membership watch and its timers; runs each membership view into the
//! coordinator core and the region side; and fences this node's regions
//! when it is out of the cluster.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::time::sleep_until;

use crate::membership::MembershipState;
use crate::runtime::region::Region;
use crate::sharding::region_core::{LocalRegions, RegionCore};
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
                self.side.poll_timeout(),
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
                        let types = self.hosted().type_names();
                        let commands = self.side.retire(Instant::now(), types);
                        self.run_side(commands);
                    }
                    Some(DriverMsg::Barrier(done)) => {
                        let _ = done.send(());
                    }
                    Some(DriverMsg::Allocate { type_name, shard }) => {
                        let commands = self.side.allocate(Instant::now(), &self.hosted(), type_name, shard.0);
                        self.run_side(commands);
                    }
                    Some(DriverMsg::TypeRegistered) => {
                        let epoch = self.core.highest_epoch();
                        let commands = self.side.register(Instant::now(), &self.hosted(), epoch);
                        self.run_side(commands);
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
                        let commands = self.side.shard_stopped(Instant::now(), type_name, shard.0, generation);
                        self.run_side(commands);
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

    /// Time alone has work for a core: the view is looked at again when
    /// a hold on a flagged coordinator may have run out, then the
    /// coordinator core and the region side act, and stats requests whose
    /// time is up are answered.
    fn wake(&mut self, now: Instant) {
        if self.core.holding() {
            // The role may move when a hold runs out: the view is handled
            // again only then.
            let state = self.state.borrow().clone();
            if self.core.acting(now, &state) != self.core.acting_now() {
                self.membership(state);
            }
        }
        let commands = self.core.tick(now);
        self.execute(commands);
        self.tick_side(now);
        self.expire_stats(now);
    }

    /// This node is out of the cluster (downed — by the split-brain
    /// resolver on the losing side, by another member, or removed — or its
    /// cluster node stopped): its regions stop accepting and stop their
    /// entities, so that what the rest of the cluster reallocates does not
    /// also run here. Done once.
    fn fence(&mut self, why: &str) {
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

    fn membership(&mut self, mut state: MembershipState) {
        let now = Instant::now();
        // The coordinator this layer follows (the placement coordinator, or
        // with a resolver an oldest member beyond a partition: SPEC §13.15).
        let acting = self.core.acting(now, &state);
        state.coordinator = acting;
        if RegionCore::is_out(&state) {
            self.fence("this node was downed or removed");
        }
        let hosted = self.hosted();
        if state.coordinator == Some(self.me) && !self.core.is_active() {
            // Taking over: start from this node's replica and registration,
            // before the gone members' homes leave it below (their shards are
            // then known as theirs, and move as dead-owner moves).
            for region in &hosted.0 {
                self.core.seed(
                    region.type_name,
                    region.fingerprint,
                    region.num_shards(),
                    &region.replica(),
                );
            }
            let own = self.side.registrations(&hosted);
            let commands = self.core.register(now, self.me, &own);
            self.execute(commands);
        }
        let commands = self.side.members(&state, &hosted);
        self.run_side(commands);
        let commands = self.core.apply_membership(now, &state, acting);
        self.execute(commands);
        let epoch = self.core.highest_epoch();
        let commands = self.side.follow(now, state.coordinator, &hosted, epoch);
        self.run_side(commands);
        let commands = self.side.catch_up(now, &hosted);
        self.run_side(commands);
    }
}
