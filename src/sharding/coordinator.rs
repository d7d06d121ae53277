//! The shard coordinator: where each shard of each entity type lives.
//!
//! A sans-IO core, like [`MembershipCore`](crate::membership::MembershipCore):
//! events go in with the current time, [`Command`]s come out, and
//! [`poll_timeout`](CoordinatorCore::poll_timeout) says when to call
//! [`tick`](CoordinatorCore::tick). It holds no socket, spawns nothing and
//! reads no clock, so tests drive it through joins, crashes and takeovers
//! deterministically.
//!
//! ```text
//!  membership state ─┐                      ┌─► Home  to every region of the type
//!  Register (region) ─┤   CoordinatorCore    ├─► Table to a registering region
//!  GetHome  (region) ─┤  table[type][shard]  ├─► Refused (fingerprint / shard count)
//!  tick(now)        ─┘  = (owner, generation)└─► RebalanceRound records (DeadOwner)
//! ```
//!
//! Every node runs one core; it acts only while its node is the placement
//! coordinator (the oldest reachable Up member). The rules:
//!
//! * **Eligible owners** of a type are members that are Up, reachable, and
//!   have registered a region of that type. Down, Exiting and Removed
//!   members (and members gone from the view) are *gone*: their shards are
//!   reallocated at once, as [`RebalanceReason::DeadOwner`] moves, never
//!   capped; so are the shards of a member whose region of the type stopped
//!   (`Unregister`). Other members (Joining, Leaving, unreachable) keep what
//!   they own but get nothing new.
//! * **Allocation** goes through a [`ShardAllocationStrategy`];
//!   [`LeastShardAllocation`] is the default.
//! * **Generations.** Every allocation of a shard gets a generation one
//!   above the highest this core has seen for it; regions accept a home only
//!   with a generation at least as high as the one they hold.
//! * **Takeover.** A core that becomes active starts from what it knows —
//!   the local region's replica of the table and every registration it has
//!   received (each carries the registering region's replica, its own
//!   shards included) — keeping the highest generation per shard. For a settle
//!   period (until every eligible member has registered with it, or
//!   `settle` has passed) it answers only with known homes of live owners
//!   and reallocates nothing, so a shard whose owner has not re-registered
//!   yet is not given a second home.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::extractor::ShardId;
use crate::identity::UniqueAddress;
use crate::membership::{MemberStatus, MembershipState};
use crate::sharding::wire::{ControlMsg, TypeRegistration};

/// Where a shard lives, and which allocation of it this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardHome {
    /// The node that hosts the shard.
    pub owner: UniqueAddress,
    /// The allocation generation: grows with every allocation of the shard.
    pub generation: u64,
}

/// Why a shard moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RebalanceReason {
    /// Its owner is no longer an eligible member (downed, exited, removed),
    /// or its owner's sharded system stopped. Never throttled.
    DeadOwner,
    /// Moved to spread load after a node joined (capped per round). Not
    /// produced yet: graceful rebalance comes with the handoff protocol.
    GracefulSpread,
}

/// One shard moved by the coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMovement {
    /// The entity type.
    pub type_name: String,
    /// The shard.
    pub shard: ShardId,
    /// The previous owner.
    pub from: UniqueAddress,
    /// The new owner.
    pub to: UniqueAddress,
    /// The new allocation's generation.
    pub generation: u64,
}

/// The moves the coordinator made for one reason at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebalanceRound {
    /// When (the `now` the core was given).
    pub at: Instant,
    /// Why.
    pub reason: RebalanceReason,
    /// What moved.
    pub moves: Vec<ShardMovement>,
}

/// Decides where a shard goes. The coordinator calls it only with at least
/// one candidate.
pub trait ShardAllocationStrategy: Send + 'static {
    /// Picks the new home of `shard` of `type_name` among the keys of
    /// `counts`, which maps every eligible member to the number of shards of
    /// this type it owns now. Returning a member that is not a key, or
    /// `None`, leaves the shard unallocated for now (it is asked again at the
    /// next change).
    fn allocate(
        &mut self,
        type_name: &str,
        shard: ShardId,
        counts: &BTreeMap<UniqueAddress, usize>,
    ) -> Option<UniqueAddress>;
}

/// The default strategy: the eligible member owning the fewest shards of the
/// type, the oldest among equals. Allocating one shard at a time this way
/// keeps the per-member counts within one of each other over a stable set
/// of members.
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
}

/// What the core asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// Send `msg` to `to` on the control channel (to this node itself: hand
    /// it to the local regions).
    Send { to: UniqueAddress, msg: ControlMsg },
}

/// How a member counts for shard ownership.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Standing {
    /// Up and reachable: may receive shards.
    Eligible,
    /// Alive but not to receive shards now (joining, leaving, unreachable).
    Keep,
}

struct TypeTable {
    fingerprint: u64,
    num_shards: u32,
    homes: Vec<Option<ShardHome>>,
    /// The highest generation seen per shard, even when it has no home now.
    generations: Vec<u64>,
    regions: BTreeSet<UniqueAddress>,
    /// Shards asked for that have no home yet, and who asked.
    waiting: BTreeMap<u32, BTreeSet<UniqueAddress>>,
}

impl TypeTable {
    fn new(fingerprint: u64, num_shards: u32) -> Self {
        TypeTable {
            fingerprint,
            num_shards,
            homes: vec![None; num_shards as usize],
            generations: vec![0; num_shards as usize],
            regions: BTreeSet::new(),
            waiting: BTreeMap::new(),
        }
    }

    /// Takes `home` for `shard` if its generation is higher than what is known.
    fn learn(&mut self, shard: u32, home: ShardHome) -> bool {
        let i = shard as usize;
        if home.generation <= self.generations[i] && self.homes[i].is_some() {
            return false;
        }
        if home.generation < self.generations[i] {
            return false;
        }
        self.generations[i] = home.generation;
        self.homes[i] = Some(home);
        true
    }

    fn home_msg(&self, type_name: &str, shard: u32, home: ShardHome) -> ControlMsg {
        debug_assert!(shard < self.num_shards);
        ControlMsg::Home {
            type_name: type_name.to_owned(),
            shard,
            owner: home.owner,
            generation: home.generation,
        }
    }
}

fn is_departed(
    departed: &BTreeMap<String, BTreeSet<UniqueAddress>>,
    type_name: &str,
    member: &UniqueAddress,
) -> bool {
    departed.get(type_name).is_some_and(|d| d.contains(member))
}

/// Settings of the coordinator core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// After becoming coordinator, how long at most to wait for the
    /// eligible members to register before reallocating or allocating new
    /// shards.
    pub settle: Duration,
    /// How many rebalance rounds to keep in the history.
    pub history: usize,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            settle: Duration::from_secs(1),
            history: 1_000,
        }
    }
}

/// The coordinator's state machine. See the module docs.
pub(crate) struct CoordinatorCore {
    me: UniqueAddress,
    config: CoordinatorConfig,
    strategy: Box<dyn ShardAllocationStrategy>,
    active: bool,
    /// While active and settling: until when.
    settling_until: Option<Instant>,
    members: BTreeMap<UniqueAddress, Standing>,
    /// Members that registered with this core (any type).
    registered: BTreeSet<UniqueAddress>,
    types: BTreeMap<String, TypeTable>,
    /// Per type, members whose region of it stopped (unregistered) and has
    /// not registered again: their shards are orphans, though they are
    /// members.
    departed: BTreeMap<String, BTreeSet<UniqueAddress>>,
    rounds: Vec<RebalanceRound>,
}

impl CoordinatorCore {
    pub(crate) fn new(
        me: UniqueAddress,
        config: CoordinatorConfig,
        strategy: Box<dyn ShardAllocationStrategy>,
    ) -> Self {
        CoordinatorCore {
            me,
            config,
            strategy,
            active: false,
            settling_until: None,
            members: BTreeMap::new(),
            registered: BTreeSet::new(),
            types: BTreeMap::new(),
            departed: BTreeMap::new(),
            rounds: Vec::new(),
        }
    }

    /// Whether this core is the acting coordinator.
    pub(crate) fn is_active(&self) -> bool {
        self.active
    }

    /// The rebalance rounds made while this node was coordinator, oldest first.
    pub(crate) fn rounds(&self) -> &[RebalanceRound] {
        &self.rounds
    }

    /// The home of `shard` of `type_name` as this core knows it.
    #[cfg(test)]
    pub(crate) fn home(&self, type_name: &str, shard: u32) -> Option<ShardHome> {
        self.types
            .get(type_name)
            .and_then(|t| t.homes.get(shard as usize).copied().flatten())
    }

    /// When [`tick`](Self::tick) should be called next (the driver ticks
    /// every 100 ms, which is fine enough for the settle deadline).
    #[cfg(test)]
    pub(crate) fn poll_timeout(&self) -> Option<Instant> {
        self.settling_until
    }

    /// A new membership view. Becoming the coordinator starts the settle
    /// period; while active, shards of members that are gone are reallocated.
    pub(crate) fn set_membership(&mut self, now: Instant, state: &MembershipState) -> Vec<Command> {
        let unreachable: BTreeSet<UniqueAddress> = state.unreachable.iter().copied().collect();
        self.members = state
            .members
            .iter()
            .filter_map(|m| {
                let standing = match m.status {
                    MemberStatus::Up if !unreachable.contains(&m.address) => Standing::Eligible,
                    MemberStatus::Joining | MemberStatus::Up | MemberStatus::Leaving => {
                        Standing::Keep
                    }
                    MemberStatus::Exiting | MemberStatus::Down | MemberStatus::Removed => {
                        return None;
                    }
                };
                Some((m.address, standing))
            })
            .collect();
        let members = &self.members;
        self.registered.retain(|m| members.contains_key(m));
        for table in self.types.values_mut() {
            table.regions.retain(|m| members.contains_key(m));
            for askers in table.waiting.values_mut() {
                askers.retain(|m| members.contains_key(m));
            }
        }
        let should_be_active = state.coordinator == Some(self.me);
        if should_be_active && !self.active {
            self.active = true;
            self.settling_until = Some(now + self.config.settle);
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
            self.settling_until = None;
            for table in self.types.values_mut() {
                table.waiting.clear();
            }
        }
        self.act(now)
    }

    /// Seeds the table from this node's own replica (before acting as the
    /// coordinator for the first time): known homes, highest generation wins.
    pub(crate) fn seed(
        &mut self,
        type_name: &str,
        fingerprint: u64,
        num_shards: u32,
        homes: &[(u32, ShardHome)],
    ) {
        let table = self
            .types
            .entry(type_name.to_owned())
            .or_insert_with(|| TypeTable::new(fingerprint, num_shards));
        if table.fingerprint != fingerprint || table.num_shards != num_shards {
            return;
        }
        for &(shard, home) in homes {
            if shard < num_shards {
                table.learn(shard, home);
            }
        }
    }

    /// A region registered its types (idempotent). Recorded whether or not
    /// this core is active; answered only while it is.
    pub(crate) fn register(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        types: &[TypeRegistration],
    ) -> Vec<Command> {
        let mut out = Vec::new();
        self.registered.insert(from);
        for reg in types {
            if reg.num_shards == 0 || reg.num_shards > crate::config::MAX_SHARDS {
                if self.active {
                    out.push(Command::Send {
                        to: from,
                        msg: ControlMsg::Refused {
                            type_name: reg.type_name.clone(),
                            reason: format!(
                                "num_shards {} is outside 1..={}",
                                reg.num_shards,
                                crate::config::MAX_SHARDS
                            ),
                        },
                    });
                }
                continue;
            }
            let table = self
                .types
                .entry(reg.type_name.clone())
                .or_insert_with(|| TypeTable::new(reg.fingerprint, reg.num_shards));
            if table.regions.is_empty()
                && table.homes.iter().all(Option::is_none)
                && (table.fingerprint, table.num_shards) != (reg.fingerprint, reg.num_shards)
            {
                // Nobody holds this type's table yet: the first region decides
                // it (generations seen so far are kept where shards remain).
                let mut fresh = TypeTable::new(reg.fingerprint, reg.num_shards);
                for (g, old) in fresh.generations.iter_mut().zip(&table.generations) {
                    *g = *old;
                }
                *table = fresh;
            }
            if table.fingerprint != reg.fingerprint || table.num_shards != reg.num_shards {
                if self.active {
                    let reason = format!(
                        "type `{}` is registered with fingerprint {:016x} and {} shards in this cluster; this region has {:016x} and {}",
                        reg.type_name,
                        table.fingerprint,
                        table.num_shards,
                        reg.fingerprint,
                        reg.num_shards
                    );
                    out.push(Command::Send {
                        to: from,
                        msg: ControlMsg::Refused {
                            type_name: reg.type_name.clone(),
                            reason,
                        },
                    });
                }
                continue;
            }
            table.regions.insert(from);
            if let Some(departed) = self.departed.get_mut(&reg.type_name) {
                departed.remove(&from);
            }
            for &(shard, owner, generation) in &reg.homes {
                if shard < table.num_shards {
                    table.learn(shard, ShardHome { owner, generation });
                }
            }
            if self.active {
                let homes = table
                    .homes
                    .iter()
                    .enumerate()
                    .filter_map(|(shard, home)| home.map(|h| (shard as u32, h.owner, h.generation)))
                    .collect();
                out.push(Command::Send {
                    to: from,
                    msg: ControlMsg::Table {
                        type_name: reg.type_name.clone(),
                        homes,
                    },
                });
            }
        }
        out.extend(self.act(now));
        out
    }

    /// A region's types stop on `from` (its system shuts down): it is no
    /// longer a region of them, and the shards it owns are reallocated at
    /// once, as dead-owner moves (there is no handoff yet).
    pub(crate) fn unregister(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        types: &[String],
    ) -> Vec<Command> {
        for type_name in types {
            if let Some(table) = self.types.get_mut(type_name) {
                table.regions.remove(&from);
            }
            // Kept also for a type this core has no table of yet: a later
            // registration may bring homes on `from`.
            self.departed
                .entry(type_name.clone())
                .or_default()
                .insert(from);
        }
        self.act(now)
    }

    /// A region asks where `shard` of `type_name` lives; it has seen the
    /// shard under `generation` at most.
    pub(crate) fn get_home(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        type_name: &str,
        shard: u32,
        generation: u64,
    ) -> Vec<Command> {
        if !self.active {
            return Vec::new();
        }
        let Some(table) = self.types.get_mut(type_name) else {
            return Vec::new();
        };
        if shard >= table.num_shards || !table.regions.contains(&from) {
            // Unknown shard, or a region that has not registered (its
            // registration was lost or refused): no answer; a region
            // registers again until it hears this coordinator's table.
            return Vec::new();
        }
        let i = shard as usize;
        if generation > table.generations[i] && generation.checked_add(1).is_some() {
            // The asker saw an allocation this core does not know of (its
            // knowledge was lost with an earlier coordinator): what this
            // core holds is older, so the shard is allocated anew above it.
            table.generations[i] = generation;
            table.homes[i] = None;
        }
        if let Some(home) = table.homes[shard as usize]
            && self.members.contains_key(&home.owner)
            && !is_departed(&self.departed, type_name, &home.owner)
        {
            return vec![Command::Send {
                to: from,
                msg: table.home_msg(type_name, shard, home),
            }];
        }
        table.waiting.entry(shard).or_default().insert(from);
        self.act(now)
    }

    /// Time passes: the settle period may end.
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Command> {
        self.act(now)
    }

    fn settled(&mut self, now: Instant) -> bool {
        let Some(until) = self.settling_until else {
            return true;
        };
        let everyone = self
            .members
            .iter()
            .filter(|(_, s)| **s == Standing::Eligible)
            .all(|(m, _)| self.registered.contains(m));
        if everyone || now >= until {
            self.settling_until = None;
            true
        } else {
            false
        }
    }

    /// While active and settled: reallocate the shards of gone owners, then
    /// allocate the shards asked for.
    fn act(&mut self, now: Instant) -> Vec<Command> {
        if !self.active || !self.settled(now) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut moves = Vec::new();
        let type_names: Vec<String> = self.types.keys().cloned().collect();
        for type_name in &type_names {
            let table = &self.types[type_name];
            let orphaned: Vec<(u32, UniqueAddress)> = table
                .homes
                .iter()
                .enumerate()
                .filter_map(|(shard, home)| {
                    home.filter(|h| {
                        // Gone from the cluster, or its region stopped.
                        !self.members.contains_key(&h.owner)
                            || is_departed(&self.departed, type_name, &h.owner)
                    })
                    .map(|h| (shard as u32, h.owner))
                })
                .collect();
            for (shard, previous) in orphaned {
                if let Some(table) = self.types.get_mut(type_name) {
                    table.homes[shard as usize] = None;
                }
                if let Some(home) = self.allocate(type_name, shard, &mut out) {
                    moves.push(ShardMovement {
                        type_name: type_name.clone(),
                        shard: ShardId(shard),
                        from: previous,
                        to: home.owner,
                        generation: home.generation,
                    });
                }
            }
            let waiting: Vec<(u32, BTreeSet<UniqueAddress>)> = self
                .types
                .get_mut(type_name)
                .map(|t| std::mem::take(&mut t.waiting).into_iter().collect())
                .unwrap_or_default();
            for (shard, askers) in waiting {
                let known = self.types[type_name].homes[shard as usize];
                match known {
                    Some(home) => {
                        // Known meanwhile (allocated by the loop above, or
                        // learned from a registration, which is not
                        // broadcast): every asker hears it.
                        let table = &self.types[type_name];
                        for asker in &askers {
                            out.push(Command::Send {
                                to: *asker,
                                msg: table.home_msg(type_name, shard, home),
                            });
                        }
                    }
                    None => {
                        if self.allocate(type_name, shard, &mut out).is_none() {
                            // No candidate yet: keep waiting for one.
                            if let Some(table) = self.types.get_mut(type_name) {
                                table.waiting.insert(shard, askers);
                            }
                        } else {
                            let table = &self.types[type_name];
                            let home = table.homes[shard as usize];
                            for asker in askers.iter().filter(|a| !table.regions.contains(a)) {
                                if let Some(home) = home {
                                    out.push(Command::Send {
                                        to: *asker,
                                        msg: table.home_msg(type_name, shard, home),
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        if !moves.is_empty() {
            self.rounds.push(RebalanceRound {
                at: now,
                reason: RebalanceReason::DeadOwner,
                moves,
            });
            if self.rounds.len() > self.config.history {
                let excess = self.rounds.len() - self.config.history;
                self.rounds.drain(..excess);
            }
        }
        out
    }

    /// Allocates `shard` through the strategy and broadcasts its new home to
    /// every region of the type. `None` when there is no eligible candidate.
    fn allocate(
        &mut self,
        type_name: &str,
        shard: u32,
        out: &mut Vec<Command>,
    ) -> Option<ShardHome> {
        let table = self.types.get(type_name)?;
        let mut counts: BTreeMap<UniqueAddress, usize> = table
            .regions
            .iter()
            .filter(|m| self.members.get(m) == Some(&Standing::Eligible))
            .map(|m| (*m, 0))
            .collect();
        if counts.is_empty() {
            return None;
        }
        for home in table.homes.iter().flatten() {
            if let Some(count) = counts.get_mut(&home.owner) {
                *count += 1;
            }
        }
        let owner = self.strategy.allocate(type_name, ShardId(shard), &counts);
        let Some(owner) = owner.filter(|o| counts.contains_key(o)) else {
            tracing::warn!(
                type_name,
                shard,
                "allocation strategy chose no eligible member; shard stays unallocated"
            );
            return None;
        };
        let table = self.types.get_mut(type_name)?;
        let Some(generation) = table.generations[shard as usize].checked_add(1) else {
            tracing::error!(
                type_name,
                shard,
                "shard generation exhausted; shard stays unallocated"
            );
            return None;
        };
        let home = ShardHome { owner, generation };
        table.generations[shard as usize] = generation;
        table.homes[shard as usize] = Some(home);
        for region in &table.regions {
            out.push(Command::Send {
                to: *region,
                msg: table.home_msg(type_name, shard, home),
            });
        }
        Some(home)
    }
}

#[cfg(test)]
#[path = "coordinator_tests.rs"]
mod tests;
