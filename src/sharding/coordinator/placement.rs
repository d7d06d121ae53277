//! The active core's work: at each event or tick it settles claims,
//! reallocates the shards of gone owners, moves handoffs along, and
//! allocates the shards asked for through the strategy; and it tells its
//! driver when it next has work.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::model::protocol::{Versions, compare_versions};

use super::{
    Command, CoordinatorCore, HANDOFF_RESEND, RebalanceReason, ShardHome, ShardMovement, Standing,
    handoff_msg, is_departed, left_msg, movement,
};

impl CoordinatorCore {
    /// When [`tick`](Self::tick) has something to do, if nothing else
    /// happens first (`None`: only an event can give it work): the end of
    /// the settle period or of a quiet margin, the next rebalance round, a
    /// handoff to send again or that times out, a gone owner's shards at
    /// the end of their margin, and a hold on a flagged oldest member that
    /// runs out (the driver then looks at the view again). After the core
    /// has acted at `now`, never `now` or earlier.
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if let Some(until) = self.hold_until {
            at(until);
        }
        if !self.active {
            return next;
        }
        if let Some(until) = self.settling_until {
            // Nothing acts before the settle period ends.
            at(until);
            return next;
        }
        match self.quiet_until {
            // Quiet: nothing is allocated, moved or completed before it ends
            // (handoffs already asked for are still sent again).
            Some(until) => at(until),
            None => {
                if let Some(rebalance) = self.next_rebalance {
                    at(rebalance);
                }
            }
        }
        let margin = self.margin();
        for table in self.types.values() {
            for handoff in table.handoffs.values().filter(|h| !h.stopped) {
                if !self.members.contains_key(&handoff.from) {
                    continue;
                }
                at(handoff.sent + HANDOFF_RESEND);
                if self.quiet_until.is_none() {
                    // (A timeout too long to add to an instant never comes.)
                    if let Some(t) = handoff.started.checked_add(self.config.handoff_timeout) {
                        at(t);
                    }
                }
            }
            if self.quiet_until.is_none() {
                for owner in table.owners() {
                    if !self.members.contains_key(owner)
                        && let Some(gone) = self.gone_at.get(owner)
                        && let Some(t) = gone.checked_add(margin)
                    {
                        at(t);
                    }
                }
            }
        }
        next
    }

    /// Time passes: the settle period may end, handoffs time out, a
    /// rebalance round may be due.
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Command> {
        self.act(now)
    }

    fn settled(&mut self, now: Instant) -> bool {
        let Some(until) = self.settling_until else {
            return true;
        };
        // Every member that may host a shard is waited for, reachable or
        // not: an unreachable or leaving owner still hosts its shards, and
        // a shard not heard of would be given a second home under the
        // generation it has (whoever's link to this node works registers
        // within the period; one beyond a partition does not, and the
        // period runs out). A member whose regions all stopped (it said
        // so: a leaving system unregisters before its member leaves) hosts
        // nothing and registers no more.
        let stopped = |m: &UniqueAddress| {
            self.departed.values().any(|d| d.contains(m))
                && !self.types.values().any(|t| t.regions.contains(m))
        };
        let everyone = self
            .members
            .iter()
            .filter(|(m, s)| **s != Standing::Joining && !stopped(m))
            .all(|(m, _)| self.registered.contains(m));
        if everyone || now >= until {
            self.settling_until = None;
            if !everyone {
                self.settles_timed_out += 1;
            }
            true
        } else {
            false
        }
    }

    /// The members that may be given shards of `type_name`: Up and
    /// reachable, with a region of the type that is not proxy-only,
    /// leaving or stopped — and of those, the ones that run the newest
    /// version of the type's protocol among them, and of those the ones
    /// of the newest application version (SPEC §13.2, §13.6: in a rolling
    /// upgrade new shards, rebalance moves and the shards of leaving
    /// nodes go to nodes of the new build, and a shard moves at most once;
    /// the shards older nodes host stay there until they leave).
    pub(super) fn candidates(&self, type_name: &str) -> BTreeSet<UniqueAddress> {
        let eligible = self.eligible(type_name);
        let Some(table) = self.types.get(type_name) else {
            return eligible;
        };
        // The newest version among the eligible hosts' own (a proxy or an
        // unreachable member may run a newer one, and hosts nothing).
        let version = |m: &UniqueAddress| table.version_of(m);
        let newest = (eligible.iter().filter_map(version)).reduce(|n, v| {
            if compare_versions(n, v) == Versions::Newer {
                v
            } else {
                n
            }
        });
        let newest_protocol: BTreeSet<UniqueAddress> = match newest {
            Some((newest, _)) => (eligible.iter())
                .filter(|m| version(m).is_none_or(|(f, _)| f == newest))
                .copied()
                .collect(),
            None => eligible,
        };
        // And of those, the ones of the newest application version (none
        // recorded: "0", older than any other).
        if self.app_versions.is_empty() {
            return newest_protocol;
        }
        let app = |m: &UniqueAddress| self.app_versions.get(m);
        let Some(newest_app) = newest_protocol.iter().map(app).max() else {
            return newest_protocol;
        };
        (newest_protocol.iter())
            .filter(|m| app(m) == newest_app)
            .copied()
            .collect()
    }

    /// Whether the hosts of `type_name` — every member with a region of it
    /// that may host, reachable or not — run more than one protocol or
    /// application version: a rolling upgrade is under way (SPEC §13.2).
    /// A member that owns shards of the type and has not registered with
    /// this core (after a takeover) runs a version it does not know: the
    /// answer is yes until it registers or goes.
    pub(super) fn versions_mixed(&self, type_name: &str) -> bool {
        let Some(table) = self.types.get(type_name) else {
            return false;
        };
        let unknown = (table.owners())
            .any(|owner| self.members.contains_key(owner) && !table.regions.contains(owner));
        if unknown {
            return true;
        }
        let mut seen = None;
        for (member, _) in self.hosts(type_name) {
            let version = (
                table.version_of(member).map(|(fingerprint, _)| fingerprint),
                self.app_versions.get(member),
            );
            match seen {
                None => seen = Some(version),
                Some(first) if first != version => return true,
                Some(_) => {}
            }
        }
        false
    }

    /// The members that may be given shards of `type_name`, whatever
    /// version of its protocol they run: Up and reachable, with a region
    /// of the type that is not proxy-only, leaving or stopped.
    pub(super) fn eligible(&self, type_name: &str) -> BTreeSet<UniqueAddress> {
        (self.hosts(type_name))
            .filter(|(_, standing)| *standing == Standing::Eligible)
            .map(|(m, _)| *m)
            .collect()
    }

    /// The members with a region of `type_name` that may host (not
    /// proxy-only, leaving or stopped), with how they stand now.
    pub(super) fn hosts<'a>(
        &'a self,
        type_name: &'a str,
    ) -> impl Iterator<Item = (&'a UniqueAddress, Standing)> + 'a {
        self.types
            .get(type_name)
            .into_iter()
            .flat_map(move |table| {
                table.regions.iter().filter_map(move |m| {
                    let standing = *self.members.get(m)?;
                    let hosts = !table.proxies.contains(m)
                        && !table.leaving.contains(m)
                        && !is_departed(&self.departed, type_name, m);
                    hosts.then_some((m, standing))
                })
            })
    }

    /// While active and settled: reallocate the shards of gone owners, move
    /// handoffs along, allocate the shards asked for, and rebalance when due.
    pub(super) fn act(&mut self, now: Instant) -> Vec<Command> {
        if !self.active || !self.settled(now) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut moves: Vec<(RebalanceReason, ShardMovement)> = Vec::new();
        let type_names: Vec<String> = self.types.keys().cloned().collect();
        // While quiet nothing is allocated, moved or completed: known homes
        // are still answered, handoffs already asked for still resent.
        self.quiet = self.quiet_until.is_some_and(|until| now < until);
        if !self.quiet {
            // Over: no deadline left behind in the past.
            self.quiet_until = None;
        }
        for type_name in &type_names {
            self.settle_claims(type_name, &mut out);
            if !self.quiet {
                self.reallocate_orphans(type_name, now, &mut out, &mut moves);
            }
            self.drive_handoffs(type_name, now, &mut out, &mut moves);
            self.answer_waiting(type_name, &mut out, &mut moves);
        }
        if !self.quiet && self.next_rebalance.is_none_or(|at| now >= at) {
            self.next_rebalance = Some(now + self.config.rebalance_interval);
            for type_name in &type_names {
                self.rebalance(type_name, now, &mut out);
            }
            // Not in a step that just placed shards anew (a timed-out
            // handoff, a gone owner's): they settle a round first.
            if moves.is_empty() {
                self.rebalance_by_traffic(now, &mut out);
            }
        }
        self.record(now, moves);
        self.tell_left(&type_names, &mut out);
        let types = &self.types;
        self.gone_at
            .retain(|m, _| types.values().any(|t| t.owned_by(m) > 0));
        out
    }

    /// Settles the claims of regions that say they host a shard under a
    /// generation this table has passed while it has no home for it:
    /// another coordinator placed the shard there while this one could not
    /// see (SPEC §13.3). Left alone, such a region would go on hosting a
    /// shard this table could give to a second node. Runs once the core is
    /// settled (every region has registered, so a higher home would be
    /// known by now):
    /// * the shard got a home meanwhile: every claimant hears it (and stops
    ///   hosting, if it is another node);
    /// * nothing is quiet or moving the shard: its home is the first
    ///   claimant that is still a member with a region able to host
    ///   (reachable or not, leaving or not: the usual rules then move it
    ///   on, as for any owner), under a fresh generation, and every
    ///   claimant hears it;
    /// * otherwise the claims wait (claimants no longer regions of the type
    ///   are dropped).
    fn settle_claims(&mut self, type_name: &str, out: &mut Vec<Command>) {
        let (quiet, epoch) = (self.quiet, self.epoch);
        let Some(table) = self.types.get_mut(type_name) else {
            return;
        };
        let claims = std::mem::take(&mut table.claims);
        for (shard, mut claimants) in claims {
            claimants.retain(|c| {
                table.regions.contains(c)
                    && !table.proxies.contains(c)
                    && self.members.contains_key(c)
                    && !is_departed(&self.departed, type_name, c)
            });
            if let Some(home) = table.home(shard) {
                // Placed meanwhile: the claimants hear where.
                for claimant in claimants {
                    out.push(Command::Send {
                        to: claimant,
                        msg: table.home_msg(type_name, shard, home, epoch),
                    });
                }
                continue;
            }
            let free = !quiet && !table.handoffs.contains_key(&shard);
            let placed = match claimants.first() {
                Some(&owner) if free => table.place(shard, owner, 0),
                Some(_) | None => None,
            };
            match placed {
                // A new home, as an allocation's: every region hears it.
                Some(home) => table.tell_regions(type_name, shard, (home, None), epoch, out),
                None if !claimants.is_empty() => {
                    table.claims.insert(shard, claimants);
                }
                None => {}
            }
        }
    }

    /// Tells each leaving region, once, when nothing more of a type will
    /// move off it (it also hears so in answer to every `Leave`).
    fn tell_left(&mut self, type_names: &[String], out: &mut Vec<Command>) {
        let mut leaving = BTreeSet::new();
        for type_name in type_names {
            for leaver in &self.types[type_name].leaving {
                leaving.insert((type_name.clone(), *leaver));
                if !self.told_left.contains(&(type_name.clone(), *leaver))
                    && let Some(nowhere) = self.left(type_name, leaver)
                {
                    self.told_left.insert((type_name.clone(), *leaver));
                    out.push(left_msg(*leaver, type_name, nowhere, self.epoch));
                }
            }
        }
        self.told_left.retain(|key| leaving.contains(key));
    }

    /// Shards whose owner is gone from the cluster, or whose owner's region
    /// stopped, get new homes at once (DeadOwner), handoffs or not.
    fn reallocate_orphans(
        &mut self,
        type_name: &str,
        now: Instant,
        out: &mut Vec<Command>,
        moves: &mut Vec<(RebalanceReason, ShardMovement)>,
    ) {
        let table = &self.types[type_name];
        let margin = self.margin();
        let members = &self.members;
        let gone_at = &mut self.gone_at;
        // A gone member's shards wait out the margin; a stopped region's
        // (departed) and a proxy's do not.
        let mut gone_long_enough = |owner: &UniqueAddress| {
            let at = *gone_at.entry(*owner).or_insert(now);
            now.duration_since(at) >= margin
        };
        // Whose shards are orphans, owner by owner; then (only if any) which
        // shards are theirs.
        let orphaning: BTreeSet<UniqueAddress> = table
            .owners()
            .filter(|owner| {
                (!members.contains_key(*owner) && gone_long_enough(owner))
                    || is_departed(&self.departed, type_name, owner)
                    || table.proxies.contains(*owner)
            })
            .copied()
            .collect();
        let orphaned: Vec<(u32, ShardHome)> = if orphaning.is_empty() {
            Vec::new()
        } else {
            table
                .homes()
                .iter()
                .enumerate()
                .filter_map(|(shard, home)| {
                    home.filter(|h| orphaning.contains(&h.owner))
                        .map(|h| (shard as u32, h))
                })
                .collect()
        };
        // (A region that hosts an orphan keeps it whatever its version:
        // no two hosts at once; a newer node may take it later.)
        let eligible = self.eligible(type_name);
        for (shard, old) in orphaned {
            let Some(table) = self.types.get_mut(type_name) else {
                return;
            };
            table.set_home(shard, None);
            if let Some(handoff) = table.handoffs.remove(&shard) {
                self.end_handoff(handoff, None);
            }
            let previous = old.owner;
            let home = self
                .rehome_with_host(type_name, shard, old, &eligible, out)
                .or_else(|| self.allocate(type_name, shard, out));
            if let Some(home) = home {
                moves.push((
                    RebalanceReason::DeadOwner,
                    movement(type_name, shard, previous, home),
                ));
            }
        }
    }

    /// Gives an orphaned `shard` (its home `old` lost its owner) to an
    /// eligible region that said, registering with this core in its
    /// current term, that it hosts the shard under `old`'s generation or a
    /// later one, under a generation above both. Two coordinators on either side of a
    /// partition can give out the same generation (the one that placed it
    /// first may be gone before anyone else hears of it); the region
    /// already hosts the shard, so it keeps it, under a fresh generation,
    /// instead of hearing of a new home elsewhere and stopping its entities
    /// while the new home starts them: no two hosts at once.
    fn rehome_with_host(
        &mut self,
        type_name: &str,
        shard: u32,
        old: ShardHome,
        candidates: &BTreeSet<UniqueAddress>,
        out: &mut Vec<Command>,
    ) -> Option<ShardHome> {
        let epoch = self.epoch;
        let registered = &self.registered;
        let table = self.types.get_mut(type_name)?;
        // Only a registration this term (regions register with each new
        // coordinator) says what a region hosts now.
        let host = table.hosting.iter().find_map(|(region, shards)| {
            let hosts = shards.get(&shard).is_some_and(|g| *g >= old.generation);
            let eligible = candidates.contains(region) && registered.contains(region);
            (hosts && *region != old.owner && eligible).then_some(*region)
        })?;
        let home = table.place(shard, host, old.generation)?;
        table.tell_regions(type_name, shard, (home, None), epoch, out);
        Some(home)
    }

    /// Sends `HandOff` again to owners that have not reported, completes
    /// the handoffs that timed out as DeadOwner moves, and starts handing
    /// off the shards of leaving owners.
    fn drive_handoffs(
        &mut self,
        type_name: &str,
        now: Instant,
        out: &mut Vec<Command>,
        moves: &mut Vec<(RebalanceReason, ShardMovement)>,
    ) {
        let timeout = self.config.handoff_timeout;
        let epoch = self.epoch;
        let quiet = self.quiet;
        // A leaving owner's shards move only when they have somewhere to go
        // (asked only while a leaver owns some).
        let leavers_own = self
            .types
            .get(type_name)
            .is_some_and(|t| t.leaving.iter().any(|l| t.owned_by(l) > 0))
            && !self.candidates(type_name).is_empty();
        let Some(table) = self.types.get_mut(type_name) else {
            return;
        };
        let mut timed_out = Vec::new();
        let members = &self.members;
        for (shard, handoff) in table.handoffs.iter_mut().filter(|(_, h)| !h.stopped) {
            if !members.contains_key(&handoff.from) {
                // Its owner is gone: the shard is an orphan, reallocated
                // with the owner's others once the dead-owner margin is over.
                continue;
            }
            if !quiet && now.duration_since(handoff.started) >= timeout {
                timed_out.push((*shard, handoff.from));
            } else if now.duration_since(handoff.sent) >= HANDOFF_RESEND {
                handoff.sent = now;
                let home = ShardHome {
                    owner: handoff.from,
                    generation: handoff.generation,
                };
                out.push(handoff_msg(type_name, *shard, home, self.epoch));
            }
        }
        let leaving: Vec<u32> = if leavers_own {
            (0..table.num_shards)
                .filter(|s| {
                    table
                        .home(*s)
                        .is_some_and(|h| table.leaving.contains(&h.owner))
                })
                .collect()
        } else {
            Vec::new()
        };
        if !leaving.is_empty() {
            let round = self.next_round;
            let reason = RebalanceReason::GracefulLeave;
            let started = leaving
                .into_iter()
                .filter(|shard| {
                    table.start_handoff(type_name, *shard, (reason, round), (now, epoch), out)
                })
                .count();
            self.open_round(round, reason, now, started);
        }
        for (shard, from) in timed_out {
            tracing::warn!(type_name, shard, %from, ?timeout, "handoff timed out; the shard is reallocated as a dead-owner move");
            let ended = self.types.get_mut(type_name).and_then(|table| {
                table.set_home(shard, None);
                table.handoffs.remove(&shard)
            });
            if let Some(handoff) = ended {
                self.end_handoff(handoff, None);
            }
            match self.allocate(type_name, shard, out) {
                Some(home) => {
                    moves.push((
                        RebalanceReason::DeadOwner,
                        movement(type_name, shard, from, home),
                    ));
                }
                None => {
                    // The old owner does not ask (it still hosts the shard):
                    // it hears the home found later.
                    if let Some(table) = self.types.get_mut(type_name) {
                        table.waiting.entry(shard).or_default().insert(from);
                    }
                }
            }
        }
    }

    /// Allocates the shards asked for (and the stopped shards of
    /// handoffs), and tells the askers.
    fn answer_waiting(
        &mut self,
        type_name: &str,
        out: &mut Vec<Command>,
        moves: &mut Vec<(RebalanceReason, ShardMovement)>,
    ) {
        let waiting: Vec<(u32, BTreeSet<UniqueAddress>)> = self
            .types
            .get_mut(type_name)
            .map(|t| std::mem::take(&mut t.waiting).into_iter().collect())
            .unwrap_or_default();
        for (shard, askers) in waiting {
            let known = self.types[type_name].home(shard);
            if let Some(home) = known
                && !self.members.contains_key(&home.owner)
            {
                // Its owner is gone and the margin not over: keep waiting.
                if let Some(table) = self.types.get_mut(type_name) {
                    table.waiting.insert(shard, askers);
                }
                continue;
            }
            if let Some(home) = known {
                // Known meanwhile (allocated by an earlier step, or learned
                // from a registration, which is not broadcast): every asker
                // hears it, and a stopped handoff of it is over.
                let ended = self.types.get_mut(type_name).and_then(|t| {
                    let stopped = t.handoffs.get(&shard).is_some_and(|h| h.stopped);
                    if stopped {
                        t.handoffs.remove(&shard)
                    } else {
                        None
                    }
                });
                if let Some(handoff) = ended {
                    self.end_handoff(handoff, None);
                }
                let table = &self.types[type_name];
                for asker in &askers {
                    out.push(Command::Send {
                        to: *asker,
                        msg: table.home_msg(type_name, shard, home, self.epoch),
                    });
                }
                continue;
            }
            let Some(home) = self.allocate(type_name, shard, out) else {
                // No candidate yet, or a member was gone too recently:
                // keep waiting.
                if let Some(table) = self.types.get_mut(type_name) {
                    table.waiting.insert(shard, askers);
                }
                continue;
            };
            let ended = self
                .types
                .get_mut(type_name)
                .and_then(|t| t.handoffs.remove(&shard));
            if let Some(handoff) = ended {
                let moved = movement(type_name, shard, handoff.from, home);
                if handoff
                    .round
                    .is_some_and(|r| self.open_rounds.contains_key(&r))
                {
                    self.end_handoff(handoff, Some(moved));
                } else {
                    moves.push((handoff.reason, moved));
                }
            }
            let Some(table) = self.types.get(type_name) else {
                continue;
            };
            // Regions heard the broadcast; other askers hear it now.
            for asker in askers.iter().filter(|a| !table.regions.contains(a)) {
                out.push(Command::Send {
                    to: *asker,
                    msg: table.home_msg(type_name, shard, home, self.epoch),
                });
            }
        }
    }

    /// Allocates `shard` through the strategy and broadcasts its new home to
    /// every region of the type. `None` when there is no eligible candidate.
    fn allocate(
        &mut self,
        type_name: &str,
        shard: u32,
        out: &mut Vec<Command>,
    ) -> Option<ShardHome> {
        if self.quiet {
            return None;
        }
        let candidates = self.candidates(type_name);
        let table = self.types.get(type_name)?;
        let counts: BTreeMap<UniqueAddress, usize> = candidates
            .into_iter()
            .map(|m| (m, table.owned_by(&m)))
            .collect();
        if counts.is_empty() {
            return None;
        }
        // A move for traffic names its target; a target no longer a
        // candidate gives the choice back to the strategy.
        let target = (table.handoffs.get(&shard))
            .filter(|h| h.stopped)
            .and_then(|h| h.to)
            .filter(|to| counts.contains_key(to));
        let owner = match target {
            Some(to) => Some(to),
            None => self.strategy.allocate(type_name, ShardId(shard), &counts),
        };
        let Some(owner) = owner.filter(|o| counts.contains_key(o)) else {
            tracing::warn!(
                type_name,
                shard,
                "allocation strategy chose no eligible member; shard stays unallocated"
            );
            return None;
        };
        let table = self.types.get_mut(type_name)?;
        let Some(home) = table.place(shard, owner, 0) else {
            tracing::error!(
                type_name,
                shard,
                "shard generation exhausted; shard stays unallocated"
            );
            return None;
        };
        // After a handoff that stopped the shard, its old owner holds the
        // states its entities handed over (none after a timeout: no stop).
        let from = table
            .handoffs
            .get(&shard)
            .filter(|h| h.stopped)
            .map(|h| h.from);
        table.tell_regions(type_name, shard, (home, from), self.epoch, out);
        Some(home)
    }
}
