//! Who acts as coordinator, and what a membership view changes: the acting
//! member (and the hold on a flagged oldest member), this core's term
//! (epoch) and the fencing of older ones, how members stand for shard
//! ownership, and the ring that sizes holds and the dead-owner margin.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::membership::{MemberStatus, MembershipState};
use crate::model::identity::UniqueAddress;
use crate::sharding::wire::ControlMsg;

use super::{Command, CoordinatorCore, TrafficTable};

/// How a member counts for shard ownership.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Standing {
    /// Up and reachable: may receive shards.
    Eligible,
    /// Alive and may host shards, but not to receive any now: Up and
    /// flagged unreachable, or leaving.
    Keep,
    /// Joining: alive, hosts no shard yet, and receives none.
    Joining,
}

/// The rings of the recent views, for the margin (SPEC §13.15 rule 3).
#[derive(Debug, Default)]
pub(super) struct RecentRing {
    /// The last view's ring.
    last: usize,
    /// The largest ring of `recent` (at the last view).
    high: usize,
    /// Each recent view's ring (the larger of its own and the one before
    /// it), when it was seen and how long it counts.
    recent: Vec<(usize, Instant, Duration)>,
}

impl CoordinatorCore {
    /// An epoch seen elsewhere: a region's registration, or a coordinator
    /// this node accepted. An active core whose own epoch is not above it
    /// takes the next one, so that regions which heard a later coordinator
    /// (the view flapped) accept this one again.
    pub(crate) fn observe_epoch(&mut self, epoch: u64) {
        self.highest_epoch = self.highest_epoch.max(epoch);
        if self.active && epoch > self.epoch {
            self.highest_epoch = self.highest_epoch.saturating_add(1);
            self.epoch = self.highest_epoch;
        }
    }

    /// Fencing (SPEC §13.15): whether a message from the coordinator this
    /// node's view names may be acted on — false for a coordinator message
    /// from an epoch below the highest seen (an older term). An accepted
    /// epoch is observed.
    pub(crate) fn accept_epoch(&mut self, msg: &ControlMsg) -> bool {
        match msg.coordinator_epoch() {
            Some(epoch) if epoch < self.highest_epoch => false,
            Some(epoch) => {
                self.observe_epoch(epoch);
                true
            }
            None => true,
        }
    }

    /// The highest epoch this node has seen (what its registrations carry,
    /// and below which its driver ignores coordinator messages).
    pub(crate) fn highest_epoch(&self) -> u64 {
        self.highest_epoch
    }

    /// The member that acts as shard coordinator in `state` at `now`: the
    /// membership's placement coordinator (the oldest reachable Up member),
    /// except that with a split-brain resolver the role stays with the
    /// oldest Up member while it is beyond this node's side of a partition
    /// (this side then has no coordinator until the resolver has downed it
    /// or the partition heals), and while it is flagged unreachable at all,
    /// for at most `hold_for` (SPEC §13.15).
    pub(crate) fn acting(
        &mut self,
        now: Instant,
        state: &MembershipState,
    ) -> Option<UniqueAddress> {
        if !self.config.hold_through_unreachability {
            return state.coordinator;
        }
        let oldest = state
            .members
            .iter()
            .filter(|m| m.status == MemberStatus::Up)
            .min_by_key(|m| m.address.age_key())
            .map(|m| m.address);
        let Some(oldest) = oldest.filter(|o| state.unreachable.contains(o)) else {
            self.oldest_flagged = None;
            self.hold_until = None;
            return state.coordinator;
        };
        let since = match self.oldest_flagged {
            Some((member, since)) if member == oldest => since,
            Some(_) | None => {
                self.oldest_flagged = Some((oldest, now));
                now
            }
        };
        // (A hold too long to add to an instant never runs out.)
        let until = since.checked_add(self.hold_for(state));
        let beyond = state.beyond.contains(&oldest);
        let holding = until.is_none_or(|until| now < until);
        self.hold_until = until.filter(|_| !beyond && holding);
        if beyond || holding {
            Some(oldest)
        } else {
            state.coordinator
        }
    }

    /// Whether a hold on a flagged oldest member is running, so that the
    /// role may move at a tick without a new membership view.
    pub(crate) fn holding(&self) -> bool {
        self.oldest_flagged.is_some()
    }

    /// The acting coordinator of the latest view.
    pub(crate) fn acting_now(&self) -> Option<UniqueAddress> {
        self.acting
    }

    /// Ring cascade steps of a ring of `members` (SPEC §13.15).
    fn cascade_steps(&self, members: usize) -> u32 {
        let steps = members.saturating_sub(1) / self.config.ring_watchers.max(1);
        u32::try_from(steps).unwrap_or(u32::MAX)
    }

    /// The members of `state`'s monitoring ring: every live one (Down and
    /// Removed members are out of it, Exiting ones still in), as the
    /// membership core builds it.
    fn ring_members(state: &MembershipState) -> usize {
        state.members.iter().filter(|m| m.status.is_live()).count()
    }

    /// The hold for a ring of `members`: `hold_for`, plus per cascade step
    /// one detection step and two margin steps.
    fn hold_for_ring(&self, members: usize) -> Duration {
        let per_step = self
            .config
            .detection_step
            .saturating_add(self.config.margin_per_ring_step.saturating_mul(2));
        self.config
            .hold_for
            .saturating_add(per_step.saturating_mul(self.cascade_steps(members)))
    }

    /// The dead-owner margin for a ring of `members`: two margin steps per
    /// cascade step on top of `dead_owner_margin`.
    fn margin_for_ring(&self, members: usize) -> Duration {
        let steps = self.cascade_steps(members).saturating_mul(2);
        self.config
            .dead_owner_margin
            .saturating_add(self.config.margin_per_ring_step.saturating_mul(steps))
    }

    /// Takes in the ring of a new view. A member the winning side has just
    /// downed is out of this side's ring, but the losing side gives up on
    /// the cascade of the ring from before the cut, which still held it:
    /// so each view counts the larger of its ring and the one before it
    /// (the ring from before a loss), for as long as a loss it showed
    /// could still be waiting out its margin (a hold and a margin of that
    /// ring), and the margin takes the largest of the views that count.
    fn note_ring(&mut self, now: Instant, members: usize) {
        let before = std::mem::replace(&mut self.ring.last, members);
        let ring = before.max(members);
        let keep = self
            .hold_for_ring(ring)
            .saturating_add(self.margin_for_ring(ring));
        let recent = &mut self.ring.recent;
        // (An entry of a ring no larger than this one ends no later.)
        recent
            .retain(|(r, since, keep)| *r > ring && now.saturating_duration_since(*since) < *keep);
        recent.push((ring, now, keep));
        self.ring.high = recent.iter().map(|(ring, ..)| *ring).max().unwrap_or(ring);
    }

    /// How long the role stays with a flagged oldest member on this side,
    /// for the membership of `state`: `hold_for`, plus per ring cascade
    /// step of its live members (the resolver's ring) one detection step,
    /// by which the unstable limit grows (SPEC §10.5), and two margin
    /// steps, by which the margin after it grows.
    fn hold_for(&self, state: &MembershipState) -> Duration {
        self.hold_for_ring(Self::ring_members(state))
    }

    /// The dead-owner margin, over the recent views' largest ring (it
    /// shrinks back at the first view after their time is up).
    pub(super) fn margin(&self) -> Duration {
        self.margin_for_ring(self.ring.high)
    }

    /// What this node knows of a quiet period, as time left at `now`: a
    /// member it saw downed within a margin, the quiet period its
    /// coordinator's last table named, and its own while it coordinates.
    /// A registration carries it to a coordinator that is taking over.
    pub(crate) fn known_quiet(&self, now: Instant) -> Option<Duration> {
        let margin = self.margin();
        let downed = self.downed_at.values().map(|at| *at + margin);
        let heard = self.heard_table.and_then(|(_, quiet)| quiet);
        (downed.chain(heard).chain(self.quiet_until))
            .max()
            .and_then(|until| until.checked_duration_since(now))
            .filter(|left| !left.is_zero())
    }

    /// A region registering with this core knows of a quiet period until
    /// `until`: kept to while this core settles a takeover (it is what the
    /// members know of the past that this core may not: a member downed
    /// before it joined, a predecessor's quiet). A core long in charge has
    /// seen the same itself, and allocated all along.
    pub(crate) fn registrant_quiet(&mut self, now: Instant, left: Duration) {
        if self.active && self.settling_until.is_some() {
            let Some(until) = self.quiet_from(now, left) else {
                return;
            };
            self.quiet_until = Some(self.quiet_until.map_or(until, |q| q.max(until)));
        }
    }

    /// When a quiet period another node named, `left` from `now`, ends:
    /// at most a margin from now (what a node says cannot hold this core
    /// back longer), none without a margin.
    fn quiet_from(&self, now: Instant, left: Duration) -> Option<Instant> {
        let margin = self.margin();
        (!margin.is_zero() && !left.is_zero())
            .then(|| now.checked_add(left.min(margin)))
            .flatten()
    }

    /// This node accepted a table from coordinator `from`, which said it
    /// allocates nothing for `left` more (zero: it is not quiet), or said
    /// nothing of it (`None`: an older build; a takeover from it keeps a
    /// margin).
    pub(crate) fn heard_table(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        left: Option<Duration>,
    ) {
        self.heard_table = left.map(|left| (from, self.quiet_from(now, left)));
    }

    /// Whether this core is the acting coordinator.
    pub(crate) fn is_active(&self) -> bool {
        self.active
    }

    /// While active: this core's epoch, and whether it allocates at `now`
    /// (settled, and past the quiet period of a takeover).
    pub(crate) fn activity(&self, now: Instant) -> Option<(u64, bool)> {
        self.active.then(|| {
            let settled = self.settling_until.is_none_or(|until| now >= until);
            let loud = self.quiet_until.is_none_or(|until| now >= until);
            (self.epoch, settled && loud)
        })
    }

    /// Whether the core is active and still in its settle period.
    #[cfg(test)]
    pub(crate) fn is_settling(&self) -> bool {
        self.settling_until.is_some()
    }

    /// [`acting`](Self::acting), then [`apply_membership`](Self::apply_membership),
    /// for the tests and the scale probe: the driver seeds a takeover
    /// between the two, so it calls them itself.
    pub(crate) fn set_membership(&mut self, now: Instant, state: &MembershipState) -> Vec<Command> {
        let acting = self.acting(now, state);
        self.apply_membership(now, state, acting)
    }

    /// A new membership view, with the acting coordinator already found by
    /// [`acting`](Self::acting) for it (the driver needs it first, to seed
    /// a takeover). Becoming the coordinator starts the settle period;
    /// while active, shards of members that are gone are reallocated.
    pub(crate) fn apply_membership(
        &mut self,
        now: Instant,
        state: &MembershipState,
        acting: Option<UniqueAddress>,
    ) -> Vec<Command> {
        let unreachable: BTreeSet<UniqueAddress> = state.unreachable.iter().copied().collect();
        self.note_ring(now, Self::ring_members(state));
        let before = std::mem::take(&mut self.members);
        self.members = state
            .members
            .iter()
            .filter_map(|m| {
                let standing = match m.status {
                    MemberStatus::Up if !unreachable.contains(&m.address) => Standing::Eligible,
                    MemberStatus::Up | MemberStatus::Leaving => Standing::Keep,
                    MemberStatus::Joining => Standing::Joining,
                    MemberStatus::Exiting | MemberStatus::Down | MemberStatus::Removed => {
                        return None;
                    }
                };
                Some((m.address, standing))
            })
            .collect();
        self.note_gone(now, state, &before);
        let members = &self.members;
        self.registered.retain(|m| members.contains_key(m));
        self.app_versions.retain(|m, _| members.contains_key(m));
        for table in self.types.values_mut() {
            table.regions.retain(|m| members.contains_key(m));
            let registered = table.versions.len();
            table.versions.retain(|m, _| members.contains_key(m));
            if table.versions.len() != registered {
                table.settle_version();
            }
            table.proxies.retain(|m| members.contains_key(m));
            table.leaving.retain(|m| members.contains_key(m));
            table.hosting.retain(|m, _| members.contains_key(m));
            for askers in table.waiting.values_mut() {
                askers.retain(|m| members.contains_key(m));
            }
        }
        let previous = std::mem::replace(&mut self.acting, acting);
        let should_be_active = acting == Some(self.me);
        if acting != previous && !should_be_active {
            // A table heard from an earlier acting coordinator says
            // nothing of the next one's term, nor of a later term of its own.
            self.heard_table = None;
        }
        if should_be_active && !self.active {
            self.active = true;
            self.highest_epoch = self.highest_epoch.saturating_add(1);
            self.epoch = self.highest_epoch;
            // Taking over from a coordinator that did not hand the role
            // over by leaving: it may have placed shards this core never
            // heard of, on members beyond a partition, and may still act
            // for a moment. Allocate nothing until those have fenced
            // (SPEC §13.15). One that left hands over its own quiet
            // period, as its last table to this node said (not heard:
            // a margin, to be safe).
            let margin = self.margin();
            let handed_over = |p: &UniqueAddress| {
                matches!(
                    state.status_of(p),
                    Some(MemberStatus::Leaving | MemberStatus::Exiting)
                )
            };
            let told = self.heard_table.take();
            let predecessor = match previous.filter(|p| *p != self.me) {
                Some(p) if handed_over(&p) => match told {
                    Some((from, quiet)) if from == p => quiet,
                    _ => Some(now + margin),
                },
                Some(_) => Some(now + margin),
                // No predecessor in this core's views (it founds the
                // cluster, or its system started after the node joined):
                // what the members know of a quiet period comes with
                // their registrations, which the settle waits for — but
                // not an Exiting member's, which registers no more.
                None => (state.members.iter())
                    .any(|m| m.address != self.me && m.status == MemberStatus::Exiting)
                    .then_some(now + margin),
            };
            // So may a member downed within the margin, whatever this
            // core's predecessor was: cut off, it can be the oldest Up
            // member of its own view and act there until it hears it is
            // down (a successor that left in between handed over only
            // its own term; a core whose first view already had it down
            // has no predecessor at all).
            let downed_lately = (self.downed_at.values()).map(|at| *at + margin).max();
            let quiet = [predecessor, downed_lately].into_iter().flatten().max();
            self.quiet_until = quiet.filter(|until| *until > now && !margin.is_zero());
            self.settling_until = Some(now + self.config.settle);
            self.next_rebalance = Some(now + self.config.settle + self.config.rebalance_interval);
            // Registrations from an earlier term, or sent before this node
            // saw itself coordinator, may miss what moved since: settle on
            // fresh ones (regions register with every new coordinator and
            // again until they hear its table), or on the timeout for
            // regions whose view never saw the coordinator change. Which
            // members are regions is kept: a region that stopped tells
            // every coordinator it sees (`Unregister`).
            let me = self.me;
            self.registered.retain(|m| *m == me);
        } else if !should_be_active && self.active {
            self.active = false;
            self.epoch = 0;
            // Traffic heard in this term weighs nothing in a later one.
            self.traffic = TrafficTable::default();
            self.settling_until = None;
            self.next_rebalance = None;
            // Owners report stopped shards to whichever coordinator they
            // see, again until a new home comes: the next one finishes.
            for table in self.types.values_mut() {
                table.waiting.clear();
                table.handoffs.clear();
                table.claims.clear();
            }
            for (_, open) in std::mem::take(&mut self.open_rounds) {
                self.close(open.round);
            }
        }
        self.act(now)
    }

    /// Notes when this core first saw each member gone (Exiting, Down,
    /// Removed, or out of the view): a gone owner's shards move one margin
    /// after that (SPEC §13.15 rule 3). Noted at the view, active or not,
    /// quiet or not: the losing side's fence is bound to the Down, which
    /// this view shows, so a core that takes over at that view (the old
    /// coordinator's own shards) or is quiet meanwhile must not start the
    /// margin again at its first act. Entries are kept while the member is
    /// in the view or owns a home here.
    fn note_gone(
        &mut self,
        now: Instant,
        state: &MembershipState,
        before: &BTreeMap<UniqueAddress, Standing>,
    ) {
        let gone_now = state
            .members
            .iter()
            .filter(|m| {
                matches!(
                    m.status,
                    MemberStatus::Exiting | MemberStatus::Down | MemberStatus::Removed
                )
            })
            .map(|m| m.address);
        let out_of_view = before
            .keys()
            .filter(|a| !self.members.contains_key(a))
            .copied();
        for gone in gone_now.chain(out_of_view).collect::<Vec<_>>() {
            self.gone_at.entry(gone).or_insert(now);
        }
        // Downed: seen Down, or gone from the view unseen Leaving or
        // Exiting — and never while only Joining (such a member never
        // coordinated). The views a core is given may skip some, so what
        // was seen leaving is remembered until the member is gone.
        for m in &state.members {
            if matches!(m.status, MemberStatus::Leaving | MemberStatus::Exiting) {
                self.seen_leaving.insert(m.address);
            }
        }
        let downed = (state.members.iter())
            .filter(|m| {
                m.status == MemberStatus::Down && before.get(&m.address) != Some(&Standing::Joining)
            })
            .map(|m| m.address)
            .chain(before.iter().filter_map(|(a, standing)| {
                let vanished = !self.members.contains_key(a) && state.status_of(a).is_none();
                (vanished && *standing != Standing::Joining && !self.seen_leaving.contains(a))
                    .then_some(*a)
            }))
            .collect::<Vec<_>>();
        for member in downed {
            self.downed_at.entry(member).or_insert(now);
        }
        // (An entry stays while the view lists its member Down, so a later
        // view does not restart its margin.)
        let margin = self.margin();
        self.downed_at
            .retain(|a, at| now < *at + margin || state.status_of(a) == Some(MemberStatus::Down));
        self.seen_leaving
            .retain(|a| state.status_of(a).is_some() || self.members.contains_key(a));
        let types = &self.types;
        self.gone_at.retain(|a, _| {
            state.members.iter().any(|m| m.address == *a)
                || types.values().any(|t| t.owned_by(a) > 0)
        });
    }
}
