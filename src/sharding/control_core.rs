//! What a node's sharding control task decides, as a state machine.
//!
//! [`ControlCore`] holds the two cores of the allocation protocol — the
//! coordinator core (acting when this node is the coordinator) and the
//! region side (`RegionCore`: this node's regions asking for homes,
//! registering, reporting, leaving) — and runs them in the order the
//! protocol needs: a membership view goes to the region side and the
//! coordinator core in turn, a control message to the one it is for, time
//! to both. A message one core sends to this node itself is handled at
//! once, before the next step looks (a registration with this node as
//! coordinator is answered, and its table applied, before the open requests
//! are told to it), so only messages to other members, asks to fail and the
//! fence come out as [`ControlCommand`]s.
//!
//! It takes `now` with every input and tells when time alone has work for
//! it ([`poll_timeout`](ControlCore::poll_timeout)). The control task in
//! `driver` feeds it from its channels and timers and carries its commands
//! out; the simulator (`sim_tests`) feeds it a scripted cluster.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::AppVersion;
use crate::membership::MembershipState;
use crate::model::identity::UniqueAddress;
use crate::runtime::slot::ShardHome;
use crate::sharding::coordinator::{Command, CoordinatorCore};
use crate::sharding::region_core::{LocalRegions, RegionCommand, RegionCore};
use crate::sharding::wire::ControlMsg;

/// What the control core asks its driver to do.
#[derive(Debug, PartialEq)]
pub(crate) enum ControlCommand {
    /// Send a control message to another member.
    Send { to: UniqueAddress, msg: ControlMsg },
    /// Fail the asks waiting on a member that is gone and may not answer.
    FailAsks(UniqueAddress),
    /// The view puts this node out of the cluster (downed or removed): its
    /// regions must stop.
    Fence,
}

/// The members' application versions as a table named them: shared, so
/// that the control task publishes one by a pointer's copy.
pub(crate) type AppVersions = Arc<BTreeMap<UniqueAddress, AppVersion>>;

/// The control task's decisions (see the module docs).
pub(crate) struct ControlCore {
    me: UniqueAddress,
    coordinator: CoordinatorCore,
    side: RegionCore,
    /// This node's application version as its registrations carry it
    /// (`None` for `"0"`).
    app_version: Option<String>,
    /// The members' application versions, as the coordinator this node
    /// follows last sent them with a table.
    app_versions: AppVersions,
    /// Members whose registration named an application version that does
    /// not parse, warned of once.
    warned_versions: std::collections::BTreeSet<UniqueAddress>,
}

impl ControlCore {
    pub(crate) fn new(me: UniqueAddress, coordinator: CoordinatorCore) -> Self {
        ControlCore {
            me,
            coordinator,
            side: RegionCore::new(me),
            app_version: None,
            app_versions: AppVersions::default(),
            warned_versions: std::collections::BTreeSet::new(),
        }
    }

    /// This node runs application version `version` (sent with its
    /// registrations; `"0"` is sent as nothing).
    pub(crate) fn with_app_version(mut self, version: &AppVersion) -> Self {
        self.app_version = (!version.is_zero()).then(|| version.to_string());
        self
    }

    /// The members' application versions, as the coordinator this node
    /// follows last sent them with a table.
    pub(crate) fn member_app_versions(&self) -> &AppVersions {
        &self.app_versions
    }

    /// This node's application version as its registrations carry it
    /// (`None` for `"0"`).
    pub(crate) fn app_version(&self) -> Option<&str> {
        self.app_version.as_deref()
    }

    /// The coordinator core, for what the control task publishes.
    pub(crate) fn coordinator(&self) -> &CoordinatorCore {
        &self.coordinator
    }

    /// The coordinator core, to take its closed rounds.
    pub(crate) fn coordinator_mut(&mut self) -> &mut CoordinatorCore {
        &mut self.coordinator
    }

    /// The region side.
    pub(crate) fn side(&self) -> &RegionCore {
        &self.side
    }

    /// When [`handle_timeout`](Self::handle_timeout) has something to do,
    /// if nothing else happens first.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        match (self.coordinator.poll_timeout(), self.side.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// A new membership view. The acting coordinator is decided first
    /// (SPEC §13.15), and a view that puts this node out of the cluster
    /// gives `Fence` first (a driver fences before handing such a view
    /// over: the moves below reach the regions during this call); a node
    /// that takes the role over seeds the coordinator
    /// core from its own replica and registration before the gone
    /// members' homes leave it below (their shards are then known as
    /// theirs, and move as dead-owner moves); then the region side lets go
    /// of the gone members, the coordinator core sees the view, and the
    /// region side follows the coordinator and catches a new one up.
    pub(crate) fn membership(
        &mut self,
        now: Instant,
        mut state: MembershipState,
        regions: &dyn LocalRegions,
    ) -> Vec<ControlCommand> {
        let mut out = Vec::new();
        let acting = self.coordinator.acting(now, &state);
        state.coordinator = acting;
        if RegionCore::is_out(&state) {
            out.push(ControlCommand::Fence);
        }
        if state.coordinator == Some(self.me) && !self.coordinator.is_active() {
            let own = self.side.registrations(regions);
            for reg in &own {
                let homes: Vec<(u32, ShardHome)> = reg
                    .homes
                    .iter()
                    .map(|&(shard, owner, generation)| (shard, ShardHome { owner, generation }))
                    .collect();
                self.coordinator.seed(reg, &homes);
            }
            let commands = self.coordinator.register(now, self.me, &own);
            self.coordinator_out(now, regions, commands, &mut out);
        }
        let commands = self.side.members(&state);
        self.side_out(now, regions, commands, &mut out);
        let commands = self.coordinator.apply_membership(now, &state, acting);
        self.coordinator_out(now, regions, commands, &mut out);
        let epoch = self.coordinator.highest_epoch();
        let commands = self.side.follow(now, state.coordinator, regions, epoch);
        self.side_out(now, regions, commands, &mut out);
        let commands = self.side.catch_up(now, regions);
        self.side_out(now, regions, commands, &mut out);
        out
    }

    /// A control message from `from` (this node itself included). The
    /// stats exchange (`GetStats`, `Stats`) is the driver's, not this
    /// core's: it is ignored here.
    pub(crate) fn control(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        msg: ControlMsg,
        regions: &dyn LocalRegions,
    ) -> Vec<ControlCommand> {
        let mut out = Vec::new();
        self.handle_queue(now, regions, VecDeque::from([(from, msg)]), &mut out);
        out
    }

    /// A shard has messages and no home.
    pub(crate) fn allocate(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        type_name: &'static str,
        shard: u32,
    ) -> Vec<ControlCommand> {
        let commands = self.side.allocate(now, regions, type_name, shard);
        self.run_side(now, regions, commands)
    }

    /// A message of a protocol line this node's version lacks reached
    /// `shard`, hosted here (SPEC §13.6).
    pub(crate) fn needs_newer(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        type_name: &'static str,
        shard: u32,
    ) -> Vec<ControlCommand> {
        let commands = self.side.needs_newer(type_name, shard);
        self.run_side(now, regions, commands)
    }

    /// What this node's entities sent to which shards (sampled, SPEC
    /// §13.11): reported to the coordinator.
    pub(crate) fn traffic(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        pairs: Vec<(String, u32, String, u32, u64)>,
    ) -> Vec<ControlCommand> {
        let commands = self.side.traffic(pairs);
        self.run_side(now, regions, commands)
    }

    /// An entity type was registered here.
    pub(crate) fn type_registered(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
    ) -> Vec<ControlCommand> {
        let epoch = self.coordinator.highest_epoch();
        let commands = self.side.register(now, regions, epoch);
        self.run_side(now, regions, commands)
    }

    /// A handed-off shard stopped and what its entities recorded is in the
    /// store.
    pub(crate) fn shard_stopped(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        type_name: &'static str,
        shard: u32,
        generation: u64,
    ) -> Vec<ControlCommand> {
        let commands = self.side.shard_stopped(now, type_name, shard, generation);
        self.run_side(now, regions, commands)
    }

    /// The system shut down: its regions (of `types`) are gone.
    pub(crate) fn retire(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        types: Vec<String>,
    ) -> Vec<ControlCommand> {
        let commands = self.side.retire(now, types);
        self.run_side(now, regions, commands)
    }

    /// Starts a graceful leave. The flag says whether handoffs are worth
    /// waiting for: not when there is no coordinator, nor when this node
    /// coordinates and no other region can take a shard.
    pub(crate) fn begin_leave(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
    ) -> (bool, Vec<ControlCommand>) {
        let (me, core) = (self.me, &self.coordinator);
        let (wait, commands) = self.side.begin_leave(now, regions, |types| {
            core.is_active() && !types.iter().any(|t| core.has_host_besides(t, &me))
        });
        (wait, self.run_side(now, regions, commands))
    }

    /// Time alone has work: the view (`state`, as the membership publishes
    /// it) is looked at again when a hold on a flagged coordinator may have
    /// run out; then the coordinator core acts, and the region side's
    /// timers run step by step, each step's messages to this node landing
    /// before the next step looks.
    pub(crate) fn handle_timeout(
        &mut self,
        now: Instant,
        state: &MembershipState,
        regions: &dyn LocalRegions,
    ) -> Vec<ControlCommand> {
        let mut out = Vec::new();
        if self.coordinator.holding()
            && self.coordinator.acting(now, state) != self.coordinator.acting_now()
        {
            out.extend(self.membership(now, state.clone(), regions));
        }
        let commands = self.coordinator.tick(now);
        self.coordinator_out(now, regions, commands, &mut out);
        let commands = self.side.retry_requests(now, regions);
        self.side_out(now, regions, commands, &mut out);
        let epoch = self.coordinator.highest_epoch();
        let commands = self.side.reregister(now, regions, epoch);
        self.side_out(now, regions, commands, &mut out);
        let commands = self.side.repeat_reports(now, regions);
        self.side_out(now, regions, commands, &mut out);
        out
    }

    /// The coordinator core's commands: each message to this node is
    /// handled (with what it leads to) before the next command.
    fn coordinator_out(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        commands: Vec<Command>,
        out: &mut Vec<ControlCommand>,
    ) {
        for command in commands {
            match command {
                Command::Send { to, msg } => self.send(now, regions, to, msg, out),
            }
        }
    }

    /// [`side_out`](Self::side_out) into a list of its own.
    fn run_side(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        commands: Vec<RegionCommand>,
    ) -> Vec<ControlCommand> {
        let mut out = Vec::new();
        self.side_out(now, regions, commands, &mut out);
        out
    }

    /// The region side's commands, in order: messages as
    /// [`coordinator_out`](Self::coordinator_out) sends them, and the moves
    /// of this node's regions, each done before the next command (what a
    /// home did goes back to the region side at once).
    fn side_out(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        commands: Vec<RegionCommand>,
        out: &mut Vec<ControlCommand>,
    ) {
        for command in commands {
            match command {
                RegionCommand::Send { to, msg } => self.send(now, regions, to, msg, out),
                RegionCommand::LetGo {
                    node,
                    asks_may_wait,
                } => {
                    let routed = regions.node_lost(&node);
                    if asks_may_wait && routed == 0 {
                        tracing::debug!(node = %self.me, left = %node, "member left: its asks wait for their replies");
                    } else {
                        out.push(ControlCommand::FailAsks(node));
                    }
                }
                RegionCommand::SetHome {
                    type_name,
                    shard,
                    home,
                    from,
                } => {
                    if let Some((name, change)) = regions.set_home(&type_name, shard, home, from) {
                        self.side.home_applied(name, shard, change);
                    }
                }
                RegionCommand::CallOffHandoffs => regions.call_off_handoffs(),
                RegionCommand::HandOff {
                    type_name,
                    shard,
                    generation,
                } => regions.hand_off(&type_name, shard, generation),
                RegionCommand::MarkLeft { type_name, nowhere } => {
                    regions.mark_left(&type_name, nowhere)
                }
                RegionCommand::Accepted { type_name, by } => regions.accepted(&type_name, by),
                RegionCommand::Refused {
                    type_name,
                    reason,
                    cluster_fingerprint,
                    cluster_num_shards,
                    differing_line,
                } => regions.refused(
                    &type_name,
                    reason,
                    cluster_fingerprint,
                    cluster_num_shards,
                    differing_line,
                ),
            }
        }
    }

    fn send(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        to: UniqueAddress,
        msg: ControlMsg,
        out: &mut Vec<ControlCommand>,
    ) {
        // A registration tells the coordinator what this node knows of
        // a quiet period (SPEC §13.15 rule 3).
        let quiet_ms = || {
            (self.coordinator.known_quiet(now))
                .map(|left| u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
        };
        let msg = match msg {
            ControlMsg::Register { types, epoch, .. } => ControlMsg::Register {
                types,
                epoch,
                quiet_ms: quiet_ms(),
                app_version: self.app_version.clone(),
            },
            ControlMsg::Unregister { types, .. } => ControlMsg::Unregister {
                types,
                quiet_ms: quiet_ms(),
            },
            msg => msg,
        };
        if to == self.me {
            self.handle_queue(now, regions, VecDeque::from([(to, msg)]), out);
        } else {
            out.push(ControlCommand::Send { to, msg });
        }
    }

    /// Handles `queue` in order; the coordinator core's messages to this
    /// node join its end.
    fn handle_queue(
        &mut self,
        now: Instant,
        regions: &dyn LocalRegions,
        mut queue: VecDeque<(UniqueAddress, ControlMsg)>,
        out: &mut Vec<ControlCommand>,
    ) {
        while let Some((from, msg)) = queue.pop_front() {
            let commands = match msg {
                ControlMsg::Register {
                    types,
                    epoch,
                    quiet_ms,
                    app_version,
                } => {
                    let version = app_version.as_deref().map_or(Ok(AppVersion::zero()), |v| {
                        v.parse().inspect_err(|error| {
                            // (Once per member: registrations repeat.)
                            if self.warned_versions.insert(from) {
                                tracing::warn!(%from, %error, "a registration's application version counts as 0");
                            }
                        })
                    });
                    (self.coordinator).set_app_version(from, version.unwrap_or_default());
                    self.coordinator.observe_epoch(epoch);
                    if let Some(ms) = quiet_ms {
                        (self.coordinator).registrant_quiet(now, Duration::from_millis(ms));
                    }
                    self.coordinator.register(now, from, &types)
                }
                ControlMsg::Unregister { types, quiet_ms } => {
                    if let Some(ms) = quiet_ms {
                        (self.coordinator).registrant_quiet(now, Duration::from_millis(ms));
                    }
                    self.coordinator.unregister(now, from, &types)
                }
                ControlMsg::NeedsNewer { type_name, shard } => {
                    (self.coordinator).needs_newer(now, from, &type_name, shard)
                }
                ControlMsg::Traffic { pairs } => {
                    self.coordinator.traffic(&pairs);
                    Vec::new()
                }
                ControlMsg::GetHome {
                    type_name,
                    shard,
                    generation,
                } => self
                    .coordinator
                    .get_home(now, from, &type_name, shard, generation),
                ControlMsg::ShardStopped {
                    type_name,
                    shard,
                    generation,
                } => self
                    .coordinator
                    .shard_stopped(now, from, &type_name, shard, generation),
                ControlMsg::Leave { types } => self.coordinator.leave(now, from, &types),
                msg @ (ControlMsg::Home { .. }
                | ControlMsg::Table { .. }
                | ControlMsg::HandOff { .. }
                | ControlMsg::Left { .. }
                | ControlMsg::Refused { .. }) => {
                    if !self.side.hears(from) {
                        tracing::debug!(node = %self.me, %from, "a home from a node that is not the coordinator here: ignored");
                    } else if !self.coordinator.accept_epoch(&msg) {
                        // Fencing (SPEC §13.15): a coordinator of an older
                        // term. Register again, carrying the higher epoch,
                        // so that it takes one above it if it is still in
                        // charge.
                        tracing::debug!(node = %self.me, %from, epoch = ?msg.coordinator_epoch(), highest = self.coordinator.highest_epoch(), "a coordinator message from an older epoch: ignored");
                        self.side.older_epoch();
                    } else {
                        if let ControlMsg::Table {
                            quiet_ms,
                            app_versions,
                            ..
                        } = &msg
                        {
                            let left = quiet_ms.map(Duration::from_millis);
                            self.coordinator.heard_table(now, from, left);
                            self.app_versions = Arc::new(
                                (app_versions.iter())
                                    .filter_map(|(m, v)| Some((*m, v.parse().ok()?)))
                                    .collect(),
                            );
                        }
                        let commands = self.side.coordinator_said(from, msg);
                        self.side_out(now, regions, commands, out);
                    }
                    Vec::new()
                }
                ControlMsg::GetStats { .. } | ControlMsg::Stats { .. } => Vec::new(),
            };
            for command in commands {
                match command {
                    Command::Send { to, msg } if to == self.me => queue.push_back((to, msg)),
                    Command::Send { to, msg } => out.push(ControlCommand::Send { to, msg }),
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "control_core_tests.rs"]
mod tests;
