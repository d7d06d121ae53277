//! What regions tell the coordinator, and its direct answers: a region's
//! registration (answered with the type's table), a request for a shard's
//! home, a graceful leave, a region that stopped, and a shard stopped for
//! a handoff.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::model::identity::UniqueAddress;
use crate::sharding::wire::{ControlMsg, TypeRegistration};

use super::{
    Command, CoordinatorCore, HandOff, RebalanceReason, ShardHome, TypeTable, is_departed, left_msg,
};

impl CoordinatorCore {
    /// Seeds the table from this node's own replica (before acting as the
    /// coordinator for the first time): known homes, highest generation wins.
    pub(crate) fn seed(&mut self, reg: &TypeRegistration, homes: &[(u32, ShardHome)]) {
        let num_shards = reg.num_shards;
        let table = self
            .types
            .entry(reg.type_name.clone())
            .or_insert_with(|| TypeTable::new(reg.fingerprint, &reg.lines, num_shards));
        if table
            .admit(None, reg.fingerprint, &reg.lines, num_shards)
            .is_err()
        {
            return;
        }
        for &(shard, home) in homes {
            if shard < num_shards {
                table.learn(shard, home);
            }
        }
    }

    /// The application version `from` runs, as its registration says
    /// (absent: `"0"`); placement prefers the newest (SPEC §13.2). Set
    /// before its `register`.
    pub(crate) fn set_app_version(&mut self, from: UniqueAddress, version: crate::AppVersion) {
        if version.is_zero() {
            self.app_versions.remove(&from);
        } else {
            self.app_versions.insert(from, version);
        }
    }

    /// The application version of every member registered with this core,
    /// as its table says them (SPEC §13.2).
    fn registered_app_versions(&self) -> Vec<(UniqueAddress, String)> {
        (self.registered.iter())
            .map(|m| {
                let version = self.app_versions.get(m).map(|v| v.to_string());
                (*m, version.unwrap_or_else(|| "0".to_owned()))
            })
            .collect()
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
        let mut ended = Vec::new();
        let mut stale = Vec::new();
        self.registered.insert(from);
        for reg in types {
            if reg.num_shards == 0 || reg.num_shards > crate::model::config::MAX_SHARDS {
                if self.active {
                    out.push(Command::Send {
                        to: from,
                        msg: ControlMsg::Refused {
                            type_name: reg.type_name.clone(),
                            reason: format!(
                                "num_shards {} is outside 1..={}",
                                reg.num_shards,
                                crate::model::config::MAX_SHARDS
                            ),
                            cluster_fingerprint: None,
                            cluster_num_shards: None,
                            differing_line: None,
                        },
                    });
                }
                continue;
            }
            let table = self
                .types
                .entry(reg.type_name.clone())
                .or_insert_with(|| TypeTable::new(reg.fingerprint, &reg.lines, reg.num_shards));
            let mut admitted = table.admit(Some(from), reg.fingerprint, &reg.lines, reg.num_shards);
            if admitted.is_err() && table.regions.is_empty() && table.owners().next().is_none() {
                // Nobody holds this type's table yet: the first region decides
                // it (generations seen so far are kept where shards remain).
                let mut fresh = TypeTable::new(reg.fingerprint, &reg.lines, reg.num_shards);
                for (g, old) in fresh.generations.iter_mut().zip(&table.generations) {
                    *g = *old;
                }
                ended.extend(std::mem::take(&mut table.handoffs).into_values());
                *table = fresh;
                admitted = table.admit(Some(from), reg.fingerprint, &reg.lines, reg.num_shards);
            }
            if let Err(differing_line) = admitted {
                if self.active {
                    // (The version it was compared with.)
                    let cluster = table.newest(Some(&from)).0;
                    let reason = match differing_line {
                        Some(line) => format!(
                            "type `{}`'s protocol differs from the cluster's at line {line}, and neither version extends the other (only lines appended at the end are compatible); the cluster has fingerprint {:016x}, this region {:016x}",
                            reg.type_name, cluster, reg.fingerprint
                        ),
                        None => format!(
                            "type `{}` is registered with fingerprint {:016x} and {} shards in this cluster; this region has {:016x} and {}",
                            reg.type_name,
                            cluster,
                            table.num_shards,
                            reg.fingerprint,
                            reg.num_shards
                        ),
                    };
                    out.push(Command::Send {
                        to: from,
                        msg: ControlMsg::Refused {
                            type_name: reg.type_name.clone(),
                            reason,
                            cluster_fingerprint: Some(cluster),
                            cluster_num_shards: Some(table.num_shards),
                            differing_line,
                        },
                    });
                }
                continue;
            }
            table.regions.insert(from);
            if reg.leaving {
                table.leaving.insert(from);
            } else {
                table.leaving.remove(&from);
            }
            if reg.proxy {
                table.proxies.insert(from);
            } else {
                table.proxies.remove(&from);
            }
            if let Some(departed) = self.departed.get_mut(&reg.type_name) {
                departed.remove(&from);
            }
            // A registration says all the region hosts now: its earlier
            // claims are replaced by this one's.
            table.claims.retain(|_, claimants| {
                claimants.remove(&from);
                !claimants.is_empty()
            });
            let hosting: BTreeMap<u32, u64> = reg
                .homes
                .iter()
                .filter(|(shard, owner, _)| {
                    *owner == from && *shard < table.num_shards && !reg.stopped.contains(shard)
                })
                .map(|&(shard, _, generation)| (shard, generation))
                .collect();
            if reg.proxy || hosting.is_empty() {
                table.hosting.remove(&from);
            } else {
                table.hosting.insert(from, hosting);
            }
            // A route to a region that has stopped (its owner departed):
            // the region would forward there, be refused, and never ask.
            // Answered after the merge as that region's `GetHome` would be
            // (the shard's live home, or one allocated, or a wait for one).
            for &(shard, owner, generation) in &reg.homes {
                if self.active
                    && owner != from
                    && shard < table.num_shards
                    && is_departed(&self.departed, &reg.type_name, &owner)
                {
                    stale.push((reg.type_name.clone(), shard, generation));
                }
            }
            for &(shard, owner, generation) in &reg.homes {
                if shard < table.num_shards
                    && !table.learn(shard, ShardHome { owner, generation })
                    && owner == from
                    && !reg.proxy
                    && !reg.stopped.contains(&shard)
                    && self.active
                    && table.home(shard).is_none()
                {
                    // Settled in `act` (`settle_claims`). Only the active
                    // core takes claims: regions register anew with each
                    // new coordinator, so a standby core's would go stale.
                    table.claims.entry(shard).or_default().insert(from);
                }
            }
            if self.active {
                // Only homes on live members: a shard whose owner has left
                // the view is reallocated, and a region that joined after
                // the owner left would route to a node it never knew.
                let members = &self.members;
                let homes = table
                    .homes()
                    .iter()
                    .enumerate()
                    .filter_map(|(shard, home)| home.map(|h| (shard as u32, h.owner, h.generation)))
                    .filter(|(_, owner, _)| members.contains_key(owner))
                    .collect();
                out.push(Command::Send {
                    to: from,
                    msg: ControlMsg::Table {
                        type_name: reg.type_name.clone(),
                        homes,
                        epoch: self.epoch,
                        // What this core knows of a quiet period: its own,
                        // and a margin after a member it saw downed (a
                        // successor that never saw it keeps to it). Always
                        // said, 0 when none: a table without it is an
                        // older build's, which says nothing.
                        quiet_ms: Some(self.known_quiet(now).map_or(0, |left| {
                            u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
                        })),
                        app_versions: self.registered_app_versions(),
                    },
                });
            }
        }
        for handoff in ended {
            self.end_handoff(handoff, None);
        }
        out.extend(self.act(now));
        for (type_name, shard, generation) in stale {
            out.extend(self.get_home(now, from, &type_name, shard, generation));
        }
        out
    }

    /// A region's types stop on `from` (its system shut down): it is no
    /// longer a region of them, and the shards it still owns (a graceful
    /// leave hands them off first) are reallocated at once, as dead-owner
    /// moves.
    pub(crate) fn unregister(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        types: &[String],
    ) -> Vec<Command> {
        for type_name in types {
            if let Some(table) = self.types.get_mut(type_name) {
                table.regions.remove(&from);
                table.versions.remove(&from);
                table.settle_version();
                table.proxies.remove(&from);
                table.leaving.remove(&from);
                table.hosting.remove(&from);
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

    /// The table of `type_name` while this core is active, if `shard` is in
    /// its range (what a region's request may act on at all).
    fn active_table(&mut self, type_name: &str, shard: u32) -> Option<&mut TypeTable> {
        if !self.active {
            return None;
        }
        self.types
            .get_mut(type_name)
            .filter(|table| shard < table.num_shards)
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
        let Some(table) = self.active_table(type_name, shard) else {
            return Vec::new();
        };
        if !table.regions.contains(&from) {
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
            table.set_home(shard, None);
            if let Some(handoff) = table.handoffs.remove(&shard) {
                self.end_handoff(handoff, None);
            }
        }
        let Some(table) = self.types.get_mut(type_name) else {
            return Vec::new();
        };
        if let Some(home) = table.home(shard)
            && self.members.contains_key(&home.owner)
            && !is_departed(&self.departed, type_name, &home.owner)
        {
            return vec![Command::Send {
                to: from,
                msg: table.home_msg(type_name, shard, home, self.epoch),
            }];
        }
        table.waiting.entry(shard).or_default().insert(from);
        self.act(now)
    }

    /// `from` leaves gracefully (its system is shutting down): its shards
    /// of `types` are handed off, uncapped, and it is given nothing new.
    /// Each `Leave` (the leaver repeats it while it waits) is answered, per
    /// type, with `Left` once nothing more of the type will move off the
    /// leaver: it owns no shard of it, or no other region can take them.
    pub(crate) fn leave(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        types: &[String],
    ) -> Vec<Command> {
        for type_name in types {
            if let Some(table) = self.types.get_mut(type_name) {
                table.leaving.insert(from);
            }
        }
        let mut out = self.act(now);
        if self.active && self.settling_until.is_none() {
            for type_name in types {
                if let Some(nowhere) = self.left(type_name, &from) {
                    out.push(left_msg(from, type_name, nowhere, self.epoch));
                }
            }
        }
        out
    }

    /// Whether nothing more of `type_name` will move off `leaver`: `None`
    /// while something will; `Some(true)` when no other member has a region
    /// that could host the type (reachable now or not: a peer that is
    /// unreachable for a moment is still a home to wait for), `Some(false)`
    /// when the leaver owns nothing now and waits for nothing.
    pub(super) fn left(&self, type_name: &str, leaver: &UniqueAddress) -> Option<bool> {
        let Some(table) = self.types.get(type_name) else {
            return Some(false);
        };
        if !self.has_host_besides(type_name, leaver) {
            return Some(true);
        }
        let owns = table.owned_by(leaver) > 0;
        // A stopped shard waiting for its next home (or one whose handoff
        // timed out before a home was found) is still with it.
        let moving = table.handoffs.values().any(|h| h.from == *leaver);
        let waiting = table.waiting.values().any(|askers| askers.contains(leaver));
        if !owns && !moving && !waiting {
            Some(false)
        } else {
            None
        }
    }

    /// Whether a member other than `leaver`, reachable or not, has a region
    /// of `type_name` that may host (not proxy-only, leaving or stopped).
    pub(crate) fn has_host_besides(&self, type_name: &str, leaver: &UniqueAddress) -> bool {
        self.hosts(type_name).any(|(m, _)| m != leaver)
    }

    /// `from`, the owner of `shard` under `generation`, has stopped it (the
    /// answer to `HandOff`, sent again until a newer home comes). The shard
    /// is allocated anew. A report about an older allocation is answered
    /// with the current home, or, when the shard has none now, with the
    /// next one, so the reporter stops repeating it.
    pub(crate) fn shard_stopped(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        type_name: &str,
        shard: u32,
        generation: u64,
    ) -> Vec<Command> {
        let epoch = self.epoch;
        let Some(table) = self.active_table(type_name, shard) else {
            return Vec::new();
        };
        let i = shard as usize;
        match table.home(shard) {
            Some(home) if home.owner == from && home.generation == generation => {
                let reason = match table.handoffs.get(&shard) {
                    Some(handoff) => handoff.reason,
                    // A handoff a previous coordinator started: for a leave
                    // when the region leaves, or is no longer registered (it
                    // left, and the stop report outlived the coordinator
                    // that asked for it).
                    None if table.leaving.contains(&from) || !table.regions.contains(&from) => {
                        RebalanceReason::GracefulLeave
                    }
                    None => RebalanceReason::GracefulSpread,
                };
                table.set_home(shard, None);
                match table.handoffs.get_mut(&shard) {
                    Some(handoff) => handoff.stopped = true,
                    None => {
                        let handoff = HandOff {
                            from,
                            generation,
                            reason,
                            started: now,
                            sent: now,
                            stopped: true,
                            round: None,
                            to: None,
                        };
                        table.handoffs.insert(shard, handoff);
                    }
                }
                table.waiting.entry(shard).or_default();
            }
            Some(home) if home.generation > generation => {
                return vec![Command::Send {
                    to: from,
                    msg: table.home_msg(type_name, shard, home, epoch),
                }];
            }
            Some(home) if home.owner != from => {
                // The reporter held the shard under a generation this
                // table's home does not pass (another coordinator's, placed
                // while this one could not see): it would ignore that home
                // and wait for ever. The home is issued again above the
                // report, to the reporter and to the owner.
                let Some(home) = table.place(shard, home.owner, generation) else {
                    return Vec::new();
                };
                return [from, home.owner]
                    .into_iter()
                    .map(|to| Command::Send {
                        to,
                        msg: table.home_msg(type_name, shard, home, epoch),
                    })
                    .collect();
            }
            None => {
                // Stopped and not yet allocated anew (a report repeated, one
                // this core had not heard of, or one about an older home):
                // the reporter hears the next home.
                table.generations[i] = table.generations[i].max(generation);
                table.waiting.entry(shard).or_default().insert(from);
            }
            Some(_) => return Vec::new(),
        }
        self.act(now)
    }
}
