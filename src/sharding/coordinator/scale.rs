//! A coordinator core of a chosen size, driven directly, so that the
//! benchmark runner can measure how its costs grow with shards and regions
//! (`shard-bench coordinator`, SPEC §13b). Not part of the API: hidden from
//! the docs and free to change. Like the core, it reads no clock: the
//! caller gives every `now` and times the calls itself.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Instant;

use super::{Command, CoordinatorConfig, CoordinatorCore, LeastShardAllocation};
use crate::membership::{Member, MemberStatus, MembershipState};
use crate::model::identity::{NodeId, UniqueAddress};
use crate::sharding::wire::{ControlMsg, TypeRegistration};

const TYPE: &str = "scale";

/// An active, settled coordinator core with `regions` members, each
/// hosting a region of one type of `num_shards` shards.
#[doc(hidden)]
pub struct ScaleProbe {
    core: CoordinatorCore,
    members: Vec<UniqueAddress>,
    num_shards: u32,
    asks: usize,
}

/// Member `i`: 10.x.y.z, so that a thousand of them have addresses of
/// their own; older for a lower `i`.
fn member(i: u32) -> UniqueAddress {
    let [_, a, b, c] = i.to_be_bytes();
    UniqueAddress {
        addr: SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, a, b, c), 7355)),
        node_id: NodeId(u64::from(i) + 1),
        incarnation: u64::from(i) + 1,
    }
}

fn registration(num_shards: u32) -> Vec<TypeRegistration> {
    vec![TypeRegistration {
        type_name: TYPE.into(),
        fingerprint: 1,
        lines: vec![1],
        num_shards,
        homes: Vec::new(),
        proxy: false,
        leaving: false,
        stopped: Vec::new(),
    }]
}

impl ScaleProbe {
    /// The core of member 0 with members `0..regions` Up and registered,
    /// at `now`; no shard placed yet.
    pub fn new(now: Instant, regions: u32, num_shards: u32) -> Self {
        let members: Vec<UniqueAddress> = (0..regions.max(1)).map(member).collect();
        let mut core = CoordinatorCore::new(
            members[0],
            CoordinatorConfig::default(),
            Box::new(LeastShardAllocation),
        );
        core.set_membership(now, &Self::view(&members));
        let registration = registration(num_shards);
        for m in &members {
            core.register(now, *m, &registration);
        }
        ScaleProbe {
            core,
            members,
            num_shards,
            asks: 0,
        }
    }

    fn view(members: &[UniqueAddress]) -> MembershipState {
        MembershipState {
            self_member: members[0],
            members: members
                .iter()
                .map(|a| Member {
                    address: *a,
                    status: MemberStatus::Up,
                })
                .collect(),
            unreachable: Vec::new(),
            leader: Some(members[0]),
            coordinator: Some(members[0]),
            beyond: Vec::new(),
        }
    }

    /// Whether the core allocates at `now`: active, settled and not quiet.
    pub fn ready(&self, now: Instant) -> bool {
        self.core
            .activity(now)
            .is_some_and(|(_, allocates)| allocates)
    }

    /// The shard count.
    pub fn num_shards(&self) -> u32 {
        self.num_shards
    }

    /// The bytes of the core's per-shard vectors and per-owner counts
    /// (homes, generations), which grow with shards and hosts; the sets of
    /// regions and their versions are small beside them.
    pub fn table_bytes(&self) -> usize {
        self.core.types.values().map(|t| t.size_bytes()).sum()
    }

    /// A region (the members take turns) asks where `shard` lives; returns
    /// how many messages the core sends for it.
    pub fn get_home(&mut self, now: Instant, shard: u32) -> usize {
        let from = self.members[self.asks % self.members.len()];
        self.asks += 1;
        self.core.get_home(now, from, TYPE, shard, 0).len()
    }

    /// When the core next wants to act, as its driver asks after every
    /// event.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.core.poll_timeout()
    }

    /// One more member joins (Up) and registers its region at `now`;
    /// returns how many messages the core sends for it.
    pub fn join(&mut self, now: Instant) -> usize {
        let newcomer = member(self.members.len() as u32);
        self.members.push(newcomer);
        let mut sent = self
            .core
            .set_membership(now, &Self::view(&self.members))
            .len();
        sent += self
            .core
            .register(now, newcomer, &registration(self.num_shards))
            .len();
        sent
    }

    /// Time passes to `now`: a rebalance round runs if one is due. Returns
    /// how many handoffs the core asked for.
    pub fn tick(&mut self, now: Instant) -> usize {
        self.core
            .tick(now)
            .iter()
            .filter(|c| {
                matches!(
                    c,
                    Command::Send {
                        msg: ControlMsg::HandOff { .. },
                        ..
                    }
                )
            })
            .count()
    }
}

#[cfg(test)]
#[path = "scale_tests.rs"]
mod tests;
