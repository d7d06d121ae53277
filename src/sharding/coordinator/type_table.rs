//! The coordinator's table of one entity type: each shard's home and
//! highest generation, the regions of the type, and the shards waiting
//! for a home, being handed off, or claimed by a region.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::model::identity::UniqueAddress;
use crate::model::protocol::{Versions, compare_versions};
use crate::sharding::wire::ControlMsg;

use super::{Command, RebalanceReason, ShardHome, handoff_msg};

/// A live shard on its way from its owner to a new home.
#[derive(Clone, Copy, Debug)]
pub(super) struct HandOff {
    /// The owner that stops the shard.
    pub(super) from: UniqueAddress,
    /// The generation it hosts the shard under.
    pub(super) generation: u64,
    pub(super) reason: RebalanceReason,
    pub(super) started: Instant,
    /// When `HandOff` was last sent to the owner.
    pub(super) sent: Instant,
    /// The owner reported the shard stopped: it has no home, and is
    /// allocated as soon as there is a candidate.
    pub(super) stopped: bool,
    /// The rebalance round that started it (none for a handoff that an
    /// earlier coordinator started).
    pub(super) round: Option<u64>,
    /// Where the shard goes once stopped, when the round chose (a move for
    /// traffic, SPEC §13.11) and that member is still a candidate then;
    /// otherwise the strategy chooses.
    pub(super) to: Option<UniqueAddress>,
}

/// `HandOff` is sent again this often until the owner reports.
pub(super) const HANDOFF_RESEND: Duration = Duration::from_secs(1);

pub(super) struct TypeTable {
    /// The type's protocol version: the newest of its registered
    /// regions' (its whole fingerprint and its fingerprint up to each
    /// line), kept as it was while none is registered. A version whose
    /// lines extend it, or are extended by it, registers too (SPEC §13.6).
    pub(super) fingerprint: u64,
    pub(super) lines: Vec<u64>,
    /// Each registered region's version.
    pub(super) versions: BTreeMap<UniqueAddress, (u64, Vec<u64>)>,
    pub(super) num_shards: u32,
    /// Each shard's home; changed only through [`set_home`](Self::set_home),
    /// [`learn`](Self::learn) and [`place`](Self::place), which keep `owned`.
    homes: Vec<Option<ShardHome>>,
    /// How many shards each owner in `homes` has (no zero entries): what
    /// allocation counts, and who owns anything, without a walk over every
    /// shard.
    owned: BTreeMap<UniqueAddress, usize>,
    /// The highest generation seen per shard, even when it has no home now.
    pub(super) generations: Vec<u64>,
    pub(super) regions: BTreeSet<UniqueAddress>,
    /// Regions registered proxy-only: they route and are given nothing.
    pub(super) proxies: BTreeSet<UniqueAddress>,
    /// Regions leaving gracefully: their shards are handed off, and they
    /// are given nothing new.
    pub(super) leaving: BTreeSet<UniqueAddress>,
    /// Shards asked for that have no home yet, and who asked.
    pub(super) waiting: BTreeMap<u32, BTreeSet<UniqueAddress>>,
    pub(super) handoffs: BTreeMap<u32, HandOff>,
    /// Shards a region says it hosts under a generation this table has
    /// passed, while the table has no home for them (see `settle_claims`).
    pub(super) claims: BTreeMap<u32, BTreeSet<UniqueAddress>>,
    /// What each region said it hosts in its latest registration: its own
    /// homes that it has not stopped, shard → generation (see
    /// `reallocate_orphans`).
    pub(super) hosting: BTreeMap<UniqueAddress, BTreeMap<u32, u64>>,
}

impl TypeTable {
    pub(super) fn new(fingerprint: u64, lines: &[u64], num_shards: u32) -> Self {
        TypeTable {
            fingerprint,
            lines: lines.to_vec(),
            versions: BTreeMap::new(),
            num_shards,
            homes: vec![None; num_shards as usize],
            owned: BTreeMap::new(),
            generations: vec![0; num_shards as usize],
            regions: BTreeSet::new(),
            proxies: BTreeSet::new(),
            leaving: BTreeSet::new(),
            waiting: BTreeMap::new(),
            handoffs: BTreeMap::new(),
            claims: BTreeMap::new(),
            hosting: BTreeMap::new(),
        }
    }

    /// Whether a registrant (`from`; `None`: this node's own replica,
    /// seeding a takeover) may register with its version of the protocol
    /// (whole fingerprint and lines) and shard count: `Ok` when its version
    /// is the same as the newest of the other registered regions', older
    /// (a prefix of its lines) or newer (extending it), which is recorded;
    /// else the first line they differ at, if known.
    pub(super) fn admit(
        &mut self,
        from: Option<UniqueAddress>,
        fingerprint: u64,
        lines: &[u64],
        num_shards: u32,
    ) -> Result<(), Option<u32>> {
        if num_shards != self.num_shards {
            return Err(None);
        }
        let versions = compare_versions(self.newest(from.as_ref()), (fingerprint, lines));
        if let Versions::Differ { line } = versions {
            return Err(line);
        }
        match from {
            Some(from) => {
                self.versions.insert(from, (fingerprint, lines.to_vec()));
                self.settle_version();
            }
            None if self.versions.is_empty() && versions == Versions::Newer => {
                self.fingerprint = fingerprint;
                self.lines = lines.to_vec();
            }
            None => {}
        }
        Ok(())
    }

    /// The newest version among the registered regions but `except` (the
    /// table's own while there is none).
    pub(super) fn newest(&self, except: Option<&UniqueAddress>) -> (u64, &[u64]) {
        let mut newest: Option<(u64, &[u64])> = None;
        for (member, (fingerprint, lines)) in &self.versions {
            if Some(member) == except {
                continue;
            }
            let version = (*fingerprint, lines.as_slice());
            newest = match newest {
                Some(n) if compare_versions(n, version) != Versions::Newer => Some(n),
                _ => Some(version),
            };
        }
        newest.unwrap_or((self.fingerprint, &self.lines))
    }

    /// The version region `member` registered with (whole fingerprint,
    /// lines), if it registered.
    pub(super) fn version_of(&self, member: &UniqueAddress) -> Option<(u64, &[u64])> {
        (self.versions.get(member)).map(|(fingerprint, lines)| (*fingerprint, lines.as_slice()))
    }

    /// The table's version once its registered regions changed: the newest
    /// of theirs (as it was, while none is registered).
    pub(super) fn settle_version(&mut self) {
        let (fingerprint, lines) = self.newest(None);
        let lines = lines.to_vec();
        (self.fingerprint, self.lines) = (fingerprint, lines);
    }

    /// Starts moving `shard` away from its owner as part of `round`; false
    /// (nothing done) for a shard with no home or already moving.
    pub(super) fn start_handoff(
        &mut self,
        type_name: &str,
        shard: u32,
        (reason, round): (RebalanceReason, u64),
        (now, epoch): (Instant, u64),
        out: &mut Vec<Command>,
    ) -> bool {
        let Some(home) = self.homes[shard as usize] else {
            return false;
        };
        if self.handoffs.contains_key(&shard) {
            return false;
        }
        self.handoffs.insert(
            shard,
            HandOff {
                from: home.owner,
                generation: home.generation,
                reason,
                started: now,
                sent: now,
                stopped: false,
                round: Some(round),
                to: None,
            },
        );
        out.push(handoff_msg(type_name, shard, home, epoch));
        true
    }

    /// Takes `home` for `shard` if its generation is higher than what is
    /// known (an equal one only when the shard has no home, and was not
    /// stopped under it by a handoff: a replica sent before the stop must
    /// not bring the old home back).
    pub(super) fn learn(&mut self, shard: u32, home: ShardHome) -> bool {
        let i = shard as usize;
        if self
            .handoffs
            .get(&shard)
            .is_some_and(|h| h.stopped && home.generation <= h.generation)
        {
            return false;
        }
        if home.generation <= self.generations[i] && self.homes[i].is_some() {
            return false;
        }
        if home.generation < self.generations[i] {
            return false;
        }
        self.generations[i] = home.generation;
        self.set_home(shard, Some(home));
        true
    }

    /// Makes `owner` the home of `shard` under a new generation, above every
    /// one seen and above `above`; `None` (nothing changed) once the
    /// generations are exhausted.
    pub(super) fn place(
        &mut self,
        shard: u32,
        owner: UniqueAddress,
        above: u64,
    ) -> Option<ShardHome> {
        let i = shard as usize;
        let generation = self.generations[i].max(above).checked_add(1)?;
        let home = ShardHome { owner, generation };
        self.generations[i] = generation;
        self.set_home(shard, Some(home));
        Some(home)
    }

    /// The home of `shard` (`None`: none, or no such shard).
    pub(super) fn home(&self, shard: u32) -> Option<ShardHome> {
        self.homes.get(shard as usize).copied().flatten()
    }

    /// Every shard's home, by shard.
    pub(super) fn homes(&self) -> &[Option<ShardHome>] {
        &self.homes
    }

    /// Sets or clears the home of `shard` (generations are the caller's),
    /// keeping the per-owner counts.
    pub(super) fn set_home(&mut self, shard: u32, home: Option<ShardHome>) {
        let slot = &mut self.homes[shard as usize];
        if let Some(old) = slot.take() {
            let count = self.owned.get_mut(&old.owner);
            debug_assert!(count.is_some(), "an owner in homes is counted");
            if let Some(count) = count {
                *count -= 1;
                if *count == 0 {
                    self.owned.remove(&old.owner);
                }
            }
        }
        if let Some(new) = home {
            *self.owned.entry(new.owner).or_insert(0) += 1;
        }
        *slot = home;
    }

    /// How many shards `owner` is the home of.
    pub(super) fn owned_by(&self, owner: &UniqueAddress) -> usize {
        self.owned.get(owner).copied().unwrap_or(0)
    }

    /// The members that are the home of some shard.
    pub(super) fn owners(&self) -> impl Iterator<Item = &UniqueAddress> {
        self.owned.keys()
    }

    /// The bytes of the per-shard vectors (homes and generations) and the
    /// per-owner counts: what grows with shards and hosts.
    pub(super) fn size_bytes(&self) -> usize {
        use std::mem::size_of;
        self.homes.capacity() * size_of::<Option<ShardHome>>()
            + self.generations.capacity() * size_of::<u64>()
            + self.owned.len() * (size_of::<UniqueAddress>() + size_of::<usize>())
    }

    /// Whether `owned` agrees with `homes` (for the tests' invariants).
    #[cfg(test)]
    pub(super) fn owned_agrees(&self) -> bool {
        let mut counted: BTreeMap<UniqueAddress, usize> = BTreeMap::new();
        for home in self.homes.iter().flatten() {
            *counted.entry(home.owner).or_insert(0) += 1;
        }
        counted == self.owned
    }

    /// Tells every region of the type the new `home` of `shard`; `from`:
    /// the old owner, whose handoff of the shard this allocation follows.
    pub(super) fn tell_regions(
        &self,
        type_name: &str,
        shard: u32,
        (home, from): (ShardHome, Option<UniqueAddress>),
        epoch: u64,
        out: &mut Vec<Command>,
    ) {
        for region in &self.regions {
            let mut msg = self.home_msg(type_name, shard, home, epoch);
            if let ControlMsg::Home { from: f, .. } = &mut msg {
                *f = from;
            }
            out.push(Command::Send { to: *region, msg });
        }
    }

    pub(super) fn home_msg(
        &self,
        type_name: &str,
        shard: u32,
        home: ShardHome,
        epoch: u64,
    ) -> ControlMsg {
        debug_assert!(shard < self.num_shards);
        ControlMsg::Home {
            type_name: type_name.to_owned(),
            shard,
            owner: home.owner,
            generation: home.generation,
            epoch,
            from: None,
        }
    }
}

pub(super) fn is_departed(
    departed: &BTreeMap<String, BTreeSet<UniqueAddress>>,
    type_name: &str,
    member: &UniqueAddress,
) -> bool {
    departed.get(type_name).is_some_and(|d| d.contains(member))
}
