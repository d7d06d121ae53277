//! The region side of the allocation protocol, as a state machine.
//!
//! This node's regions ask the coordinator for homes, register and
//! re-register, report handed-off shards stopped, announce a graceful
//! leave, follow the coordinator as it changes, and let go of members that
//! are gone. [`RegionCore`] keeps what that takes — which shards wait for a
//! home and since when, which coordinator was heard, which reports are
//! unanswered, which members left gracefully — and decides, given `now`:
//! events in, [`RegionCommand`]s out, and [`poll_timeout`](RegionCore::poll_timeout)
//! for when time alone has something to do. It reads this node's regions
//! and applies homes to them through [`LocalRegions`]; the control core
//! (`control_core`) feeds it and runs its commands with the coordinator
//! core's.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::membership::{MemberStatus, MembershipState};
use crate::model::identity::UniqueAddress;
use crate::runtime::slot::{HomeChange, ShardHome};
use crate::sharding::wire::{ControlMsg, TypeRegistration};

/// An unanswered allocation request is sent again after this long.
pub(crate) const RETRY_GET_HOME: Duration = Duration::from_millis(300);
/// A registration the coordinator has not answered with its table is sent
/// again after this long.
pub(crate) const REREGISTER_AFTER: Duration = Duration::from_millis(500);
/// A region re-registers this often, and so hears the whole table again
/// (anti-entropy for broadcasts lost with a connection).
pub(crate) const REFRESH_EVERY: Duration = Duration::from_secs(10);

/// This node's regions, as the region side reads them.
pub(crate) trait RegionsView {
    /// Every region's registration (`leaving`: a graceful leave is under way).
    fn registrations(&self, leaving: bool) -> Vec<TypeRegistration>;
    /// The entity types with a region here.
    fn type_names(&self) -> Vec<String>;
    /// The highest generation the region has seen for a shard (0 if none).
    fn generation_of(&self, type_name: &str, shard: u32) -> u64;
    /// Whether a shard is hosted here under `generation`, handed off and
    /// empty: its report still needs an answer.
    fn is_handed_off(&self, type_name: &str, shard: u32, generation: u64) -> bool;
}

/// This node's regions, as the region side's commands move them (run by
/// the control core, `control_core`, in the order they are given).
pub(crate) trait LocalRegions: RegionsView {
    /// Applies a home from the coordinator (`from`: the old owner that
    /// handed the shard off, §13.16); `None` for no such region or shard,
    /// else the type's name as the region holds it and what changed.
    fn set_home(
        &self,
        type_name: &str,
        shard: u32,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> Option<(&'static str, HomeChange)>;
    /// A member is gone: shards routed to it wait for a new home. How many
    /// were routed there.
    fn node_lost(&self, node: &UniqueAddress) -> usize;
    /// A coordinator that asked for handoffs is gone: call off those not
    /// reported stopped yet.
    fn call_off_handoffs(&self);
    /// The coordinator moves a shard hosted here under `generation`.
    fn hand_off(&self, type_name: &str, shard: u32, generation: u64);
    /// The coordinator says nothing more of the type will move off here.
    fn mark_left(&self, type_name: &str, nowhere: bool);
    /// A coordinator accepted the type's region (sent its table).
    fn accepted(&self, type_name: &str, by: UniqueAddress);
    /// The coordinator refused the type's region.
    fn refused(
        &self,
        type_name: &str,
        reason: String,
        cluster_fingerprint: Option<u64>,
        cluster_num_shards: Option<u32>,
        differing_line: Option<u32>,
    );
}

/// What the region side asks to be done: messages to the coordinator, and
/// every move of this node's regions ([`LocalRegions`]). What a home did
/// to a region comes back through [`home_applied`](RegionCore::home_applied).
#[derive(Debug, PartialEq)]
pub(crate) enum RegionCommand {
    /// Send a control message (to this node itself, when it coordinates).
    Send { to: UniqueAddress, msg: ControlMsg },
    /// A member is gone: routing to it stops (`LocalRegions::node_lost`),
    /// then the asks waiting on it fail — unless `asks_may_wait` (it left
    /// gracefully and was not downed) and nothing was routed to it.
    LetGo {
        node: UniqueAddress,
        asks_may_wait: bool,
    },
    /// Apply a home from the coordinator (`LocalRegions::set_home`), then
    /// report what changed to [`RegionCore::home_applied`].
    SetHome {
        type_name: String,
        shard: u32,
        home: ShardHome,
        from: Option<UniqueAddress>,
    },
    /// Call off the handoffs of a coordinator that is gone.
    CallOffHandoffs,
    /// Hand off a shard hosted here under `generation`.
    HandOff {
        type_name: String,
        shard: u32,
        generation: u64,
    },
    /// Nothing more of the type will move off here.
    MarkLeft { type_name: String, nowhere: bool },
    /// A coordinator accepted the type's region (sent its table).
    Accepted {
        type_name: String,
        by: UniqueAddress,
    },
    /// The coordinator refused the type's region.
    Refused {
        type_name: String,
        reason: String,
        cluster_fingerprint: Option<u64>,
        cluster_num_shards: Option<u32>,
        differing_line: Option<u32>,
    },
}

/// The region side's state (see the module docs).
pub(crate) struct RegionCore {
    me: UniqueAddress,
    /// Members already handled as gone.
    lost: BTreeSet<UniqueAddress>,
    /// Every member seen in a view.
    seen: BTreeSet<UniqueAddress>,
    /// Members seen Leaving or Exiting, until they are gone: their asks are
    /// not failed when they go (they left gracefully).
    departing: BTreeSet<UniqueAddress>,
    /// The coordinator this node follows.
    coordinator: Option<UniqueAddress>,
    /// The coordinator whose table this node has heard since registering.
    heard_from: Option<UniqueAddress>,
    /// When this node last sent a registration (or an unregistration).
    registered_at: Option<Instant>,
    /// The types this node hosted before its system shut down (empty while
    /// it runs).
    retired: Vec<String>,
    /// The types whose shards this node is handing off in a graceful leave
    /// (empty until it begins), and when `Leave` was last sent.
    leaving: Vec<String>,
    left_at: Option<Instant>,
    /// Handed-off shards reported stopped and not yet given a new home:
    /// the generation reported, and when it was last sent.
    stopped: BTreeMap<(&'static str, u32), (u64, Instant)>,
    /// Shards asked for and not yet given a home, with when they were asked.
    waiting: BTreeMap<(&'static str, u32), Instant>,
    /// A new coordinator was followed: `catch_up` has what to tell it.
    new_coordinator: bool,
}

impl RegionCore {
    pub(crate) fn new(me: UniqueAddress) -> Self {
        RegionCore {
            me,
            lost: BTreeSet::new(),
            seen: BTreeSet::new(),
            departing: BTreeSet::new(),
            coordinator: None,
            heard_from: None,
            registered_at: None,
            retired: Vec::new(),
            leaving: Vec::new(),
            left_at: None,
            stopped: BTreeMap::new(),
            waiting: BTreeMap::new(),
            new_coordinator: false,
        }
    }

    /// The coordinator this node follows.
    pub(crate) fn coordinator(&self) -> Option<UniqueAddress> {
        self.coordinator
    }

    /// Every region's registration, as sent.
    pub(crate) fn registrations(&self, regions: &dyn RegionsView) -> Vec<TypeRegistration> {
        regions.registrations(!self.leaving.is_empty())
    }

    /// An entity type was registered here (or the table is to be heard
    /// again): register with the coordinator, `epoch` being the highest
    /// coordinator epoch this node knows.
    pub(crate) fn register(
        &mut self,
        now: Instant,
        regions: &dyn RegionsView,
        epoch: u64,
    ) -> Vec<RegionCommand> {
        if !self.retired.is_empty() {
            return self.unregister(now);
        }
        if self.coordinator.is_none() {
            return Vec::new();
        }
        self.heard_from = None;
        self.registered_at = Some(now);
        self.to_coordinator(ControlMsg::Register {
            types: self.registrations(regions),
            epoch,
            // (Filled in by the control core, which knows.)
            quiet_ms: None,
            app_version: None,
        })
    }

    /// A message of a protocol line this node's version lacks reached
    /// `shard` of `type_name`, hosted here: ask the coordinator to move it
    /// to a node of the newest version.
    pub(crate) fn needs_newer(&self, type_name: &str, shard: u32) -> Vec<RegionCommand> {
        self.to_coordinator(ControlMsg::NeedsNewer {
            type_name: type_name.to_owned(),
            shard,
        })
    }

    /// What this node's entities sent to which shards: to the
    /// coordinator (nothing to say, nothing sent).
    pub(crate) fn traffic(
        &self,
        pairs: Vec<(String, u32, String, u32, u64)>,
    ) -> Vec<RegionCommand> {
        if pairs.is_empty() {
            return Vec::new();
        }
        self.to_coordinator(ControlMsg::Traffic { pairs })
    }

    /// `msg` to the coordinator this node follows (nothing without one).
    fn to_coordinator(&self, msg: ControlMsg) -> Vec<RegionCommand> {
        self.coordinator
            .map(|to| RegionCommand::Send { to, msg })
            .into_iter()
            .collect()
    }

    /// Tells the coordinator this node's regions stopped. Sent at shutdown,
    /// to every new coordinator, and again every `REREGISTER_AFTER` × 4 (it
    /// is idempotent; a lost one would leave peers routing to regions that
    /// no longer exist).
    fn unregister(&mut self, now: Instant) -> Vec<RegionCommand> {
        if self.coordinator.is_none() || self.retired.is_empty() {
            return Vec::new();
        }
        self.registered_at = Some(now);
        let types = self.retired.clone();
        self.to_coordinator(ControlMsg::Unregister {
            types,
            // (Filled in by the control core, which knows.)
            quiet_ms: None,
        })
    }

    /// The system shut down: its regions are gone.
    pub(crate) fn retire(&mut self, now: Instant, types: Vec<String>) -> Vec<RegionCommand> {
        self.retired = types;
        // A stopped system sends no more `Leave`.
        self.left_at = None;
        self.unregister(now)
    }

    /// A shard has messages and no home: ask the coordinator (and again
    /// until a home comes).
    pub(crate) fn allocate(
        &mut self,
        now: Instant,
        regions: &dyn RegionsView,
        type_name: &'static str,
        shard: u32,
    ) -> Vec<RegionCommand> {
        self.waiting.insert((type_name, shard), now);
        self.get_home(regions, type_name, shard)
    }

    fn get_home(
        &self,
        regions: &dyn RegionsView,
        type_name: &'static str,
        shard: u32,
    ) -> Vec<RegionCommand> {
        self.to_coordinator(ControlMsg::GetHome {
            type_name: type_name.to_owned(),
            shard,
            generation: regions.generation_of(type_name, shard),
        })
    }

    /// Starts a graceful leave: `Leave` to the coordinator (and to every
    /// later one, and again now and then until the system stops). Returns
    /// whether handoffs are worth waiting for; `nowhere_else` says whether
    /// this node coordinates and no other region can take a shard of these
    /// types.
    pub(crate) fn begin_leave(
        &mut self,
        now: Instant,
        regions: &dyn RegionsView,
        nowhere_else: impl FnOnce(&[String]) -> bool,
    ) -> (bool, Vec<RegionCommand>) {
        self.leaving = regions.type_names();
        if self.leaving.is_empty() || self.coordinator.is_none() || nowhere_else(&self.leaving) {
            return (false, Vec::new());
        }
        (true, self.send_leave(now))
    }

    fn send_leave(&mut self, now: Instant) -> Vec<RegionCommand> {
        if self.coordinator.is_none() || self.leaving.is_empty() || !self.retired.is_empty() {
            return Vec::new();
        }
        self.left_at = Some(now);
        let types = self.leaving.clone();
        self.to_coordinator(ControlMsg::Leave { types })
    }

    /// A handed-off shard stopped and what its entities recorded is in the
    /// store: tell the coordinator (and again until its next home comes).
    pub(crate) fn shard_stopped(
        &mut self,
        now: Instant,
        type_name: &'static str,
        shard: u32,
        generation: u64,
    ) -> Vec<RegionCommand> {
        self.stopped.insert((type_name, shard), (generation, now));
        self.report_stopped(type_name, shard, generation)
    }

    fn report_stopped(
        &self,
        type_name: &'static str,
        shard: u32,
        generation: u64,
    ) -> Vec<RegionCommand> {
        self.to_coordinator(ControlMsg::ShardStopped {
            type_name: type_name.to_owned(),
            shard,
            generation,
        })
    }

    /// Whether the view puts this node out of the cluster (downed or
    /// removed): its regions must stop.
    pub(crate) fn is_out(state: &MembershipState) -> bool {
        matches!(
            state.self_status(),
            Some(MemberStatus::Down | MemberStatus::Removed)
        )
    }

    /// A new membership view: lets go of members that are gone — routing
    /// to them stops, and their asks fail unless they left gracefully with
    /// nothing routed to them. (A takeover seeds the coordinator core
    /// before this, while the replica still names their homes; call
    /// [`follow`](Self::follow) once the coordinator core has seen the
    /// view too.)
    pub(crate) fn members(&mut self, state: &MembershipState) -> Vec<RegionCommand> {
        let mut out = Vec::new();
        // Members that are gone (downed or removed — a removed member drops
        // out of the view, and a watch may skip the states in between):
        // their asks fail now, their shards wait. An Exiting member still
        // serves until it is removed.
        for m in &state.members {
            if matches!(m.status, MemberStatus::Leaving | MemberStatus::Exiting) {
                self.departing.insert(m.address);
            }
        }
        let present: BTreeSet<UniqueAddress> = state.members.iter().map(|m| m.address).collect();
        let mut gone: Vec<UniqueAddress> = state
            .members
            .iter()
            .filter(|m| matches!(m.status, MemberStatus::Down | MemberStatus::Removed))
            .map(|m| m.address)
            .collect();
        gone.extend(self.seen.difference(&present).copied());
        gone.retain(|a| *a != self.me && !self.lost.contains(a));
        // `seen` stays as small as the view (a member that left it never
        // comes back: a restarted node is a new identity); `lost` keeps
        // every gone identity, so a late home naming one is still ignored.
        self.seen = present;
        for node in gone {
            self.lost.insert(node);
            // Routing stops first: once every slot has let go of the node
            // (each under its lock), no new ask can start waiting on it, so
            // failing the waiting asks next misses none (`LetGo` does both,
            // in that order).
            // A member that left gracefully handed its shards off before it
            // began to leave (its system's shutdown comes first, SPEC
            // §13.12): every ask it was the first hop of was answered, or
            // sent on to the shard's next home, which replies to this node
            // directly. Failing those asks now would make a caller's retry
            // process them twice; they wait for their reply or their own
            // timeout. Unless it still hosted shards as far as this node
            // knows (its handoff did not finish, or it was no sharded
            // system that shut down), or it was downed rather than removed
            // (it crashed while leaving, or outlasted the exit timeout):
            // then nothing may answer them.
            let departed = self.departing.remove(&node);
            let downed = state.status_of(&node) == Some(MemberStatus::Down);
            out.push(RegionCommand::LetGo {
                node,
                asks_may_wait: departed && !downed,
            });
        }
        out
    }

    /// Follows the view's acting coordinator. When it changed: handoffs of
    /// a previous coordinator that is gone are called off (the new one
    /// knows nothing of them; one only out of sight for a moment may still
    /// complete them), and the new one hears this node's registration and
    /// its leave (then, from [`catch_up`](Self::catch_up), its open
    /// requests and its unanswered reports).
    pub(crate) fn follow(
        &mut self,
        now: Instant,
        coordinator: Option<UniqueAddress>,
        regions: &dyn RegionsView,
        epoch: u64,
    ) -> Vec<RegionCommand> {
        if coordinator == self.coordinator {
            return Vec::new();
        }
        let mut out = Vec::new();
        let previous = std::mem::replace(&mut self.coordinator, coordinator);
        if previous.is_some_and(|c| self.lost.contains(&c) || !self.seen.contains(&c)) {
            // Run before the registration below is sent, though that is
            // built now: a call-off changes no home in the replica (the
            // slot stays Local under its generation) and no stopped shard
            // (a stopped handoff has reported, and is not called off).
            out.push(RegionCommand::CallOffHandoffs);
        }
        if self.coordinator.is_none() {
            return out;
        }
        self.new_coordinator = true;
        out.extend(self.register(now, regions, epoch));
        out.extend(self.send_leave(now));
        out
    }

    /// After [`follow`](Self::follow)'s commands have run (a registration
    /// with this node itself is answered at once, and its table applied):
    /// a new coordinator hears the open requests and the unanswered
    /// reports. Nothing when the view did not change the coordinator.
    pub(crate) fn catch_up(
        &mut self,
        now: Instant,
        regions: &dyn RegionsView,
    ) -> Vec<RegionCommand> {
        let mut out = Vec::new();
        if !std::mem::take(&mut self.new_coordinator) || self.coordinator.is_none() {
            return out;
        }
        let asked: Vec<(&'static str, u32)> = self.waiting.keys().copied().collect();
        for (type_name, shard) in asked {
            out.extend(self.allocate(now, regions, type_name, shard));
        }
        for ((type_name, shard), (generation, _)) in &self.stopped {
            out.extend(self.report_stopped(type_name, *shard, *generation));
        }
        out
    }

    /// Whether a coordinator's message from `from` is to be heard: from the
    /// coordinator this node follows, or from itself.
    pub(crate) fn hears(&self, from: UniqueAddress) -> bool {
        from == self.me || Some(from) == self.coordinator
    }

    /// A message from a coordinator of an older epoch was ignored:
    /// register again, carrying the higher epoch, so that it takes one
    /// above it if it is still in charge.
    pub(crate) fn older_epoch(&mut self) {
        self.heard_from = None;
    }

    /// A coordinator's message this node [`hears`](Self::hears), of a
    /// current epoch: what it asks of the regions. Messages for the
    /// coordinator are not for this core.
    pub(crate) fn coordinator_said(
        &mut self,
        from: UniqueAddress,
        msg: ControlMsg,
    ) -> Vec<RegionCommand> {
        match msg {
            ControlMsg::Home {
                type_name,
                shard,
                owner,
                generation,
                from,
                ..
            } => {
                let home = ShardHome { owner, generation };
                self.set_home(type_name, shard, home, from)
                    .into_iter()
                    .collect()
            }
            ControlMsg::Table {
                type_name, homes, ..
            } => {
                self.heard_from = Some(from);
                let mut out = vec![RegionCommand::Accepted {
                    type_name: type_name.clone(),
                    by: from,
                }];
                for (shard, owner, generation) in homes {
                    let home = ShardHome { owner, generation };
                    out.extend(self.set_home(type_name.clone(), shard, home, None));
                }
                out
            }
            ControlMsg::HandOff {
                type_name,
                shard,
                generation,
                ..
            } => vec![RegionCommand::HandOff {
                type_name,
                shard,
                generation,
            }],
            ControlMsg::Left {
                type_name, nowhere, ..
            } => vec![RegionCommand::MarkLeft { type_name, nowhere }],
            ControlMsg::Refused {
                type_name,
                reason,
                cluster_fingerprint,
                cluster_num_shards,
                differing_line,
            } => {
                tracing::error!(node = %self.me, %type_name, %reason, "the coordinator refused this node's region");
                // Heard: registering again would be refused again.
                self.heard_from = Some(from);
                vec![RegionCommand::Refused {
                    type_name,
                    reason,
                    cluster_fingerprint,
                    cluster_num_shards,
                    differing_line,
                }]
            }
            // For the coordinator, and stats: not this core's.
            ControlMsg::Register { .. }
            | ControlMsg::NeedsNewer { .. }
            | ControlMsg::Traffic { .. }
            | ControlMsg::Unregister { .. }
            | ControlMsg::GetHome { .. }
            | ControlMsg::ShardStopped { .. }
            | ControlMsg::Leave { .. }
            | ControlMsg::GetStats { .. }
            | ControlMsg::Stats { .. } => Vec::new(),
        }
    }

    /// A home to apply, unless it names a member that is gone.
    fn set_home(
        &self,
        type_name: String,
        shard: u32,
        home: ShardHome,
        from: Option<UniqueAddress>,
    ) -> Option<RegionCommand> {
        (!self.lost.contains(&home.owner)).then_some(RegionCommand::SetHome {
            type_name,
            shard,
            home,
            from,
        })
    }

    /// What a [`RegionCommand::SetHome`] did: `name` is the type's name as
    /// the region holds it. A shard with a home no longer waits for one;
    /// one older than what the region holds still does (it is asked again,
    /// with the region's generation, so the coordinator allocates above it).
    pub(crate) fn home_applied(&mut self, name: &'static str, shard: u32, change: HomeChange) {
        match change {
            HomeChange::HostHere | HomeChange::Remote | HomeChange::Unchanged => {
                self.waiting.remove(&(name, shard));
            }
            HomeChange::Stale => {}
        }
    }

    // Time passes: requests without a home are asked again, the
    // registration is sent again while no table came (and now and then
    // after), reports of stopped shards are repeated until their next home
    // comes, and so is a graceful leave's `Leave`. Three steps, which the
    // control core's `handle_timeout` runs in this order, each one's
    // commands before the next (a message to this node itself, when it
    // coordinates, is answered at once, and the next step sees the answer).

    /// Asks again for the homes that have not come.
    pub(crate) fn retry_requests(
        &mut self,
        now: Instant,
        regions: &dyn RegionsView,
    ) -> Vec<RegionCommand> {
        let mut out = Vec::new();
        if self.coordinator.is_some() {
            let due: Vec<(&'static str, u32)> = self
                .waiting
                .iter()
                .filter(|(_, asked)| now.duration_since(**asked) >= RETRY_GET_HOME)
                .map(|(key, _)| *key)
                .collect();
            for (type_name, shard) in due {
                out.extend(self.allocate(now, regions, type_name, shard));
            }
        }
        out
    }

    /// Repeats `ShardStopped` for shards still waiting for their next home
    /// (a report lost, or sent to a coordinator that has since changed),
    /// and `Leave` during a graceful leave.
    pub(crate) fn repeat_reports(
        &mut self,
        now: Instant,
        regions: &dyn RegionsView,
    ) -> Vec<RegionCommand> {
        let mut out = Vec::new();
        let mut due = Vec::new();
        self.stopped
            .retain(|(type_name, shard), (generation, sent)| {
                let waiting = regions.is_handed_off(type_name, *shard, *generation);
                if waiting && now.duration_since(*sent) >= RETRY_GET_HOME {
                    *sent = now;
                    due.push((*type_name, *shard, *generation));
                }
                waiting
            });
        for (type_name, shard, generation) in due {
            out.extend(self.report_stopped(type_name, shard, generation));
        }
        if self
            .left_at
            .is_some_and(|at| now.duration_since(at) >= REREGISTER_AFTER * 2)
        {
            out.extend(self.send_leave(now));
        }
        out
    }

    /// Registers again while the coordinator's table has not come (a lost
    /// message, or a coordinator that did not know this node yet).
    pub(crate) fn reregister(
        &mut self,
        now: Instant,
        regions: &dyn RegionsView,
        epoch: u64,
    ) -> Vec<RegionCommand> {
        if !self.retired.is_empty() {
            if self
                .registered_at
                .is_none_or(|at| now.duration_since(at) >= REREGISTER_AFTER * 4)
            {
                return self.unregister(now);
            }
            return Vec::new();
        }
        if self.coordinator.is_none() {
            return Vec::new();
        }
        if regions.type_names().is_empty() {
            // Nothing to register (a type's registration registers at
            // once): the next look is a period from now.
            self.registered_at = Some(now);
            return Vec::new();
        }
        if self
            .registered_at
            .is_none_or(|at| now.duration_since(at) >= self.register_every())
        {
            return self.register(now, regions, epoch);
        }
        Vec::new()
    }

    /// Until the table comes, every `REREGISTER_AFTER`; then every
    /// `REFRESH_EVERY`, so that a home lost with a broken connection (a
    /// broadcast is sent once) is learned again from the table.
    fn register_every(&self) -> Duration {
        if !self.retired.is_empty() {
            REREGISTER_AFTER * 4
        } else if self.heard_from == self.coordinator {
            REFRESH_EVERY
        } else {
            REREGISTER_AFTER
        }
    }

    /// When one of the timed steps ([`retry_requests`](Self::retry_requests),
    /// [`reregister`](Self::reregister), [`repeat_reports`](Self::repeat_reports))
    /// has something to do, if nothing else
    /// happens first (`None`: only an event can give it work).
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if self.coordinator.is_some() {
            if let Some(asked) = self.waiting.values().min() {
                at(*asked + RETRY_GET_HOME);
            }
            if let Some(registered) = self.registered_at {
                at(registered + self.register_every());
            }
            if let Some(sent) = self.stopped.values().map(|(_, sent)| sent).min() {
                at(*sent + RETRY_GET_HOME);
            }
            if let Some(left) = self.left_at.filter(|_| self.retired.is_empty()) {
                at(left + REREGISTER_AFTER * 2);
            }
        }
        next
    }
}

#[cfg(test)]
#[path = "region_core_tests.rs"]
pub(crate) mod tests;
