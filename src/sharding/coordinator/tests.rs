//! The coordinator core as stories with exact commands, and as random
//! histories checked against its invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use quickcheck::{Arbitrary, Gen, QuickCheck};

use super::*;
use crate::membership::{Member, MemberStatus, MembershipState};
use crate::model::identity::NodeId;
use crate::sharding::wire::{ControlMsg, TypeRegistration};

const TYPE: &str = "counter";
const FP: u64 = 0xfeed;

fn node(i: u16) -> UniqueAddress {
    UniqueAddress {
        addr: SocketAddr::from(([127, 0, 0, 1], 7000 + i)),
        node_id: NodeId(u64::from(i)),
        incarnation: u64::from(i),
    }
}

/// A view in which `up` are Up, `down` are Down, and the oldest reachable Up
/// member is the coordinator.
fn view(
    me: UniqueAddress,
    up: &[UniqueAddress],
    down: &[UniqueAddress],
    unreachable: &[UniqueAddress],
) -> MembershipState {
    let mut members: Vec<Member> = up
        .iter()
        .map(|a| Member {
            address: *a,
            status: MemberStatus::Up,
        })
        .chain(down.iter().map(|a| Member {
            address: *a,
            status: MemberStatus::Down,
        }))
        .collect();
    members.sort_by_key(|m| m.address.age_key());
    let coordinator = members
        .iter()
        .filter(|m| m.status == MemberStatus::Up && !unreachable.contains(&m.address))
        .map(|m| m.address)
        .min_by_key(|a| a.age_key());
    MembershipState {
        self_member: me,
        members,
        unreachable: unreachable.to_vec(),
        leader: coordinator,
        coordinator,
        beyond: Vec::new(),
    }
}

/// [`view`] for a node that sees `beyond` past a partition (flagged too).
fn split_view(
    me: UniqueAddress,
    up: &[UniqueAddress],
    beyond: &[UniqueAddress],
) -> MembershipState {
    let mut state = view(me, up, &[], beyond);
    state.beyond = beyond.to_vec();
    state
}

fn reg(num_shards: u32, homes: Vec<(u32, UniqueAddress, u64)>) -> Vec<TypeRegistration> {
    reg_as(num_shards, homes, false)
}

/// A registration of a region that may be leaving.
fn reg_as(
    num_shards: u32,
    homes: Vec<(u32, UniqueAddress, u64)>,
    leaving: bool,
) -> Vec<TypeRegistration> {
    vec![TypeRegistration {
        type_name: TYPE.into(),
        fingerprint: FP,
        lines: Vec::new(),
        num_shards,
        homes,
        proxy: false,
        leaving,
        stopped: Vec::new(),
    }]
}

/// A registration of a region whose protocol has `lines` (its fingerprint
/// up to each line, SPEC §13.6).
fn versioned(num_shards: u32, lines: &[u64]) -> Vec<TypeRegistration> {
    let mut r = reg(num_shards, vec![]);
    r[0].fingerprint = *lines.last().expect("a line");
    r[0].lines = lines.to_vec();
    r
}

fn home(to: UniqueAddress, shard: u32, owner: UniqueAddress, generation: u64) -> Command {
    Command::Send {
        to,
        msg: ControlMsg::Home {
            type_name: TYPE.into(),
            shard,
            owner,
            generation,
            epoch: 1,
            from: None,
        },
    }
}

/// Whether `out` tells some region the home of `shard`.
fn tells_home(out: &[Command], shard: u32) -> bool {
    out.iter().any(|cmd| {
        matches!(cmd, Command::Send { msg: ControlMsg::Home { shard: s, .. }, .. } if *s == shard)
    })
}

fn core(me: UniqueAddress) -> CoordinatorCore {
    CoordinatorCore::new(
        me,
        CoordinatorConfig::default(),
        Box::new(LeastShardAllocation),
    )
}

/// A coordinator at node 1 with nodes 1..=n Up and registered, settled.
fn settled(n: u16, num_shards: u32) -> (CoordinatorCore, Instant, Vec<UniqueAddress>) {
    let t0 = Instant::now();
    let nodes: Vec<UniqueAddress> = (1..=n).map(node).collect();
    let mut c = core(nodes[0]);
    c.set_membership(t0, &view(nodes[0], &nodes, &[], &[]));
    assert!(c.is_active());
    for a in &nodes {
        c.register(t0, *a, &reg(num_shards, vec![]));
    }
    assert!(!c.is_settling(), "settled: every member registered");
    (c, t0, nodes)
}

#[test]
fn first_request_allocates_to_least_loaded_and_tells_every_region() {
    let (mut c, t0, n) = settled(3, 8);
    let out = c.get_home(t0, n[1], TYPE, 5, 0);
    // All counts are 0: the oldest member wins the tie.
    assert_eq!(
        out,
        vec![
            home(n[0], 5, n[0], 1),
            home(n[1], 5, n[0], 1),
            home(n[2], 5, n[0], 1)
        ]
    );
    // Known now: only the asker hears it again.
    assert_eq!(
        c.get_home(t0, n[2], TYPE, 5, 0),
        vec![home(n[2], 5, n[0], 1)]
    );
    // The next shard goes to a member with fewer shards.
    let out = c.get_home(t0, n[2], TYPE, 6, 0);
    assert_eq!(out[0], home(n[0], 6, n[1], 1));
}

#[test]
fn least_shards_keeps_counts_within_one() {
    let (mut c, t0, n) = settled(3, 64);
    for shard in 0..64 {
        c.get_home(t0, n[shard as usize % 3], TYPE, shard, 0);
    }
    let mut counts = BTreeMap::new();
    for shard in 0..64 {
        *counts
            .entry(c.home(TYPE, shard).unwrap().owner)
            .or_insert(0) += 1;
    }
    let (min, max) = (
        counts.values().min().unwrap(),
        counts.values().max().unwrap(),
    );
    assert!(max - min <= 1, "{counts:?}");
}

#[test]
fn a_downed_owner_loses_all_its_shards_at_once_as_dead_owner_moves() {
    let (mut c, t0, n) = settled(3, 30);
    for shard in 0..30 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    let owned_by_2: Vec<u32> = (0..30)
        .filter(|s| c.home(TYPE, *s).unwrap().owner == n[2])
        .collect();
    assert_eq!(owned_by_2.len(), 10);
    let t1 = t0 + Duration::from_millis(5);
    let out = c.set_membership(t1, &view(n[0], &n[..2], &n[2..], &[]));
    // One Home per moved shard to each of the two surviving regions.
    assert_eq!(out.len(), 2 * owned_by_2.len());
    for shard in &owned_by_2 {
        let h = c.home(TYPE, *shard).unwrap();
        assert_ne!(h.owner, n[2]);
        assert_eq!(h.generation, 2);
    }
    let round = c.rounds().last().unwrap();
    assert_eq!(round.reason, RebalanceReason::DeadOwner);
    assert_eq!(round.at, t1);
    assert_eq!(round.moves.len(), 10, "dead-owner moves are never capped");
    assert!(round.moves.iter().all(|m| m.from == n[2]));
}

#[test]
fn an_unreachable_owner_keeps_its_shards_but_gets_no_new_ones() {
    let (mut c, t0, n) = settled(2, 4);
    c.get_home(t0, n[0], TYPE, 0, 0);
    c.get_home(t0, n[0], TYPE, 1, 0);
    assert_eq!(c.home(TYPE, 1).unwrap().owner, n[1]);
    assert!(
        c.set_membership(t0, &view(n[0], &n, &[], &n[1..]))
            .is_empty()
    );
    assert_eq!(c.home(TYPE, 1).unwrap().owner, n[1]);
    c.get_home(t0, n[0], TYPE, 2, 0);
    c.get_home(t0, n[0], TYPE, 3, 0);
    assert_eq!(c.home(TYPE, 2).unwrap().owner, n[0]);
    assert_eq!(c.home(TYPE, 3).unwrap().owner, n[0]);
}

#[test]
fn only_members_with_a_region_of_the_type_get_its_shards() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    c.register(t0, n[1], &reg(4, vec![]));
    c.register(t0, n[0], &[]);
    c.register(t0, n[2], &[]);
    for shard in 0..4 {
        // A node without a region of the type gets no answer.
        assert!(c.get_home(t0, n[0], TYPE, shard, 0).is_empty());
        c.get_home(t0, n[1], TYPE, shard, 0);
        assert_eq!(c.home(TYPE, shard).unwrap().owner, n[1]);
    }
}

#[test]
fn a_request_without_any_candidate_waits_for_one() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=2).map(node).collect();
    let mut c = core(n[0]);
    // Only node 2 has a region of the type, and it is unreachable.
    c.set_membership(t0, &view(n[0], &n, &[], &n[1..]));
    c.register(t0, n[0], &[]);
    c.register(t0, n[1], &reg(4, vec![]));
    assert!(c.get_home(t0, n[1], TYPE, 0, 0).is_empty());
    // Reachable again: the waiting shard goes there, and its region hears.
    let out = c.set_membership(t0, &view(n[0], &n, &[], &[]));
    assert_eq!(out, vec![home(n[1], 0, n[1], 1)]);
}

#[test]
fn regression_unreachable_coordinator_then_owner_crash() {
    use Op::*;
    let ops = vec![
        Join(1),
        Unreachable(0),
        Join(3),
        Register(1),
        Join(2),
        Ask(0, 11),
        Register(3),
        Unreachable(2),
        Crash(1),
        Ask(2, 11),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn mismatched_fingerprint_or_shard_count_is_refused() {
    let (mut c, t0, n) = settled(2, 8);
    let mut bad = reg(8, vec![]);
    bad[0].fingerprint = 1;
    let out = c.register(t0, n[1], &bad);
    assert!(
        matches!(&out[..], [Command::Send { to, msg: ControlMsg::Refused { .. } }] if *to == n[1]),
        "{out:?}"
    );
    let out = c.register(t0, n[1], &reg(16, vec![]));
    assert!(
        matches!(
            &out[..],
            [Command::Send {
                msg: ControlMsg::Refused { .. },
                ..
            }]
        ),
        "{out:?}"
    );
}

/// A rolling upgrade: a version that appends a line registers beside the
/// one it extends (whichever comes first), is given shards, and older
/// nodes go on registering; a version that changes a line is refused,
/// named at its first differing line.
#[test]
fn compatible_protocol_versions_share_one_table_and_an_incompatible_one_is_refused_at_its_first_differing_line()
 {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let version = |lines: &[u64]| versioned(8, lines);
    let (v1, v2, other) = (
        version(&[11, 12]),
        version(&[11, 12, 13]),
        version(&[11, 22]),
    );
    let refused_at = |out: &[Command]| {
        out.iter().find_map(|c| match c {
            Command::Send {
                msg: ControlMsg::Refused { differing_line, .. },
                ..
            } => Some(*differing_line),
            _ => None,
        })
    };
    for order in [[&v1, &v2], [&v2, &v1]] {
        let mut c = core(n[0]);
        c.set_membership(t0, &view(n[0], &n, &[], &[]));
        for (a, reg) in n.iter().zip(order.iter().chain(order.iter())) {
            let out = c.register(t0, *a, reg);
            assert_eq!(refused_at(&out), None, "{out:?}");
        }
        assert!(!c.is_settling(), "every version registered");
        // Shards are placed with both versions registered.
        let out = c.get_home(t0, n[1], TYPE, 0, 0);
        assert!(tells_home(&out, 0), "{out:?}");
        let out = c.register(t0, n[2], &other);
        assert_eq!(refused_at(&out), Some(Some(2)), "{out:?}");
    }
    // A roll back: the regions of the newer version are gone, and the
    // table's version is the newest left, so a fixed new version that
    // extends the old one otherwise registers.
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    c.register(t0, n[0], &v1);
    c.register(t0, n[1], &v2);
    let fixed = version(&[11, 12, 14]);
    assert_eq!(refused_at(&c.register(t0, n[2], &fixed)), Some(Some(3)));
    c.unregister(t0, n[1], &[TYPE.to_owned()]);
    let out = c.register(t0, n[2], &fixed);
    assert_eq!(refused_at(&out), None, "{out:?}");
}

/// In a rolling upgrade new shards go to the nodes of the type's newest
/// protocol version, and so do the shards of an older node that leaves:
/// each moves once, onto a node that knows every message; with no node of
/// the newest version eligible, any node is.
#[test]
fn shards_go_to_nodes_of_the_newest_protocol_version() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let version = |lines: &[u64]| versioned(4, lines);
    let (v1, v2) = (version(&[11, 12]), version(&[11, 12, 13]));
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    c.register(t0, n[0], &v1);
    c.register(t0, n[1], &v1);
    c.register(t0, n[2], &v1);
    // Shards 0 and 1 placed while every node runs the first version.
    for shard in 0..2 {
        assert!(tells_home(&c.get_home(t0, n[0], TYPE, shard, 0), shard));
    }
    let first: Vec<UniqueAddress> = (0..2)
        .map(|s| c.home(TYPE, s).expect("placed").owner)
        .collect();
    // Node 2 now runs the new version (it registers the new lines); node 3
    // routes only, with a still newer one: it hosts nothing, so counts for
    // nothing.
    c.register(t0, n[1], &v2);
    let mut v3_proxy = version(&[11, 12, 13, 14]);
    v3_proxy[0].proxy = true;
    c.register(t0, n[2], &v3_proxy);
    for shard in 2..4 {
        c.get_home(t0, n[0], TYPE, shard, 0);
        assert_eq!(
            c.home(TYPE, shard).map(|h| h.owner),
            Some(n[1]),
            "shard {shard}"
        );
    }
    // The shards placed before stay where they are.
    for shard in 0..2 {
        assert_eq!(
            c.home(TYPE, shard).map(|h| h.owner),
            Some(first[shard as usize])
        );
    }
    // With the new version's node out of reach, any node is given shards.
    let mut c2 = core(n[0]);
    c2.set_membership(t0, &view(n[0], &n, &[], &n[1..2]));
    c2.register(t0, n[0], &v1);
    c2.register(t0, n[1], &v2);
    c2.register(t0, n[2], &v1);
    assert!(tells_home(&c2.get_home(t0, n[0], TYPE, 0, 0), 0));
    assert_ne!(c2.home(TYPE, 0).map(|h| h.owner), Some(n[1]));
}

/// Shards go to the nodes of the newest application version among those
/// of the newest protocol version: the protocol version comes first, and
/// a node of an older application version gets nothing while a newer one
/// can take it; absent is `"0"`; nor is a type rebalanced while its hosts
/// run two application versions.
#[test]
fn shards_go_to_nodes_of_the_newest_app_version() {
    let t0 = Instant::now();
    let app = |s: &str| s.parse::<crate::AppVersion>().expect("a version");
    let n: Vec<UniqueAddress> = (1..=4).map(node).collect();
    let (v1, v2) = (versioned(12, &[11, 12]), versioned(12, &[11, 12, 13]));
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    // n0: app 1.0 (absent: "0" counts as older); n1 and n2: app 1.1 (n2's
    // protocol older); n3: app 2.0 with the older protocol.
    c.set_app_version(n[1], app("1.1"));
    c.set_app_version(n[2], app("1.1"));
    c.set_app_version(n[3], app("2.0"));
    c.register(t0, n[0], &v2);
    c.register(t0, n[1], &v2);
    c.register(t0, n[2], &v1);
    c.register(t0, n[3], &v1);
    for shard in 0..6 {
        c.get_home(t0, n[0], TYPE, shard, 0);
        assert_eq!(
            c.home(TYPE, shard).map(|h| h.owner),
            Some(n[1]),
            "shard {shard}: the newest protocol, then the newest app version"
        );
    }
    // n0 upgraded in place to 1.1: both take shards, and rounds run.
    c.set_app_version(n[0], app("1.1.0"));
    c.unregister(t0, n[2], &[TYPE.to_owned()]);
    c.unregister(t0, n[3], &[TYPE.to_owned()]);
    let asked = handoffs_in(&c.tick(t0 + first_rebalance()));
    assert!(!asked.is_empty(), "one version: rounds spread the shards");
    // A 1.2 joins: while two application versions host, no round.
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n[..2], &[], &[]));
    c.set_app_version(n[0], app("1.1"));
    c.set_app_version(n[1], app("1.2"));
    c.register(t0, n[0], &v2);
    for shard in 0..6 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    c.set_membership(t0, &view(n[0], &n[..3], &[], &[]));
    c.set_app_version(n[2], app("1.2"));
    c.register(t0, n[1], &v2);
    c.register(t0, n[2], &v2);
    let mut now = t0 + first_rebalance();
    for _ in 0..3 {
        assert!(handoffs_in(&c.tick(now)).is_empty(), "a round mid-roll");
        now += CoordinatorConfig::default().rebalance_interval;
    }
}

/// The hold lasts while an old host is only unreachable: it may come back
/// and still hosts its shards, so the roll is not over.
#[test]
fn the_rebalance_hold_lasts_while_an_old_host_is_unreachable() {
    let t0 = Instant::now();
    let app = |s: &str| s.parse::<crate::AppVersion>().expect("a version");
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let v = versioned(12, &[11, 12]);
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n[..1], &[], &[]));
    c.set_app_version(n[0], app("1.2"));
    c.register(t0, n[0], &v);
    for shard in 0..12 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    // n1 (1.2) and n2 (1.1) join; n2 is then flagged unreachable.
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    c.set_app_version(n[1], app("1.2"));
    c.set_app_version(n[2], app("1.1"));
    c.register(t0, n[1], &v);
    c.register(t0, n[2], &v);
    c.set_membership(t0, &view(n[0], &n, &[], &n[2..]));
    let mut now = t0 + first_rebalance();
    for _ in 0..3 {
        assert!(handoffs_in(&c.tick(now)).is_empty(), "a round mid-roll");
        now += CoordinatorConfig::default().rebalance_interval;
    }
    // Its region gone, one version hosts: rounds spread the shards.
    let asked = handoffs_in(&c.unregister(now, n[2], &[TYPE.to_owned()]));
    assert!(!asked.is_empty(), "no round after the roll");
}

/// A region's table names the application version of every member
/// registered with the coordinator, `"0"` for one that named none.
#[test]
fn a_table_names_every_registered_members_app_version() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=2).map(node).collect();
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    c.set_app_version(n[1], "2.1".parse().expect("a version"));
    c.register(t0, n[1], &reg(4, vec![]));
    let out = c.register(t0, n[0], &reg(4, vec![]));
    let versions = out.iter().find_map(|command| match command {
        Command::Send {
            msg: ControlMsg::Table { app_versions, .. },
            ..
        } => Some(app_versions.clone()),
        _ => None,
    });
    let mut versions = versions.expect("a table");
    versions.sort();
    let mut expected = vec![(n[0], "0".to_owned()), (n[1], "2.1".to_owned())];
    expected.sort();
    assert_eq!(versions, expected);
}

/// While the eligible hosts run two versions of the type's protocol no
/// rebalance round starts — not even between the nodes of the newest
/// version, which would move a shard a second time during the roll — and
/// once they all run one, rounds spread the shards again.
#[test]
fn no_rebalance_round_starts_while_hosts_run_two_versions() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let version = |lines: &[u64]| versioned(12, lines);
    let (v1, v2) = (version(&[11, 12]), version(&[11, 12, 13]));
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n[..2], &[], &[]));
    c.register(t0, n[0], &v1);
    c.register(t0, n[1], &v2);
    // Every shard goes to the only node of the newest version.
    for shard in 0..12 {
        c.get_home(t0, n[0], TYPE, shard, 0);
        assert_eq!(c.home(TYPE, shard).map(|h| h.owner), Some(n[1]));
    }
    // A second node of the newest version joins: nothing is spread to it
    // while the first version still has an eligible host.
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    c.register(t0, n[2], &v2);
    let mut now = t0 + first_rebalance();
    for _ in 0..3 {
        assert!(handoffs_in(&c.tick(now)).is_empty(), "a round mid-roll");
        now += CoordinatorConfig::default().rebalance_interval;
    }
    // The first version's node leaves the type: rounds spread again.
    let asked = handoffs_in(&c.unregister(now, n[0], &[TYPE.to_owned()]));
    assert!(!asked.is_empty(), "no round after the roll");
    assert!(
        asked.iter().all(|(owner, _, _)| *owner == n[1]),
        "{asked:?}"
    );
}

/// A message of a line its owner's version lacks moves the shard, by a
/// handoff, to a node of the newest version; an owner of the newest
/// version, or one with no newer node eligible, keeps it.
#[test]
fn a_shard_whose_owner_lacks_a_line_moves_to_a_node_of_the_newest_version() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let version = |lines: &[u64]| versioned(4, lines);
    let (v1, v2) = (version(&[11, 12]), version(&[11, 12, 13]));
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    for a in &n {
        c.register(t0, *a, &v1);
    }
    assert!(tells_home(&c.get_home(t0, n[0], TYPE, 0, 0), 0));
    let owner = c.home(TYPE, 0).expect("placed");
    // No newer node: nothing moves.
    assert!(c.needs_newer(t0, owner.owner, TYPE, 0).is_empty());
    // Nor where the only newer one is proxy-only.
    let other = *n.iter().find(|a| **a != owner.owner).expect("another node");
    let mut proxy = v2.clone();
    proxy[0].proxy = true;
    c.register(t0, other, &proxy);
    assert!(c.needs_newer(t0, owner.owner, TYPE, 0).is_empty());
    let newer = *n.iter().find(|a| **a != owner.owner).expect("another node");
    c.register(t0, newer, &v2);
    // Only the owner's word counts.
    assert!(c.needs_newer(t0, newer, TYPE, 0).is_empty());
    let out = c.needs_newer(t0, owner.owner, TYPE, 0);
    assert!(
        matches!(&out[..], [Command::Send { to, msg: ControlMsg::HandOff { shard: 0, .. } }] if *to == owner.owner),
        "{out:?}"
    );
    // Asked again while it moves: once.
    assert!(c.needs_newer(t0, owner.owner, TYPE, 0).is_empty());
    let out = c.shard_stopped(t0, owner.owner, TYPE, 0, owner.generation);
    assert!(tells_home(&out, 0), "{out:?}");
    assert_eq!(c.home(TYPE, 0).map(|h| h.owner), Some(newer));
    let rounds = c.rounds();
    assert!(
        rounds
            .iter()
            .any(|r| r.reason == RebalanceReason::NewerVersion),
        "{rounds:?}"
    );
}

#[test]
fn takeover_keeps_the_highest_generation_and_waits_to_settle() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=4).map(node).collect();
    // Node 2 takes over after node 1 died; node 3 hosted shard 0 (gen 4),
    // node 2's replica believed shard 0 at node 4 under gen 3 and shard 1
    // at the dead node 1.
    let mut c = core(n[1]);
    c.seed(
        &reg(4, vec![])[0],
        &[
            (
                0,
                ShardHome {
                    owner: n[3],
                    generation: 3,
                },
            ),
            (
                1,
                ShardHome {
                    owner: n[0],
                    generation: 7,
                },
            ),
        ],
    );
    c.register(t0, n[1], &reg(4, vec![]));
    let alive = [n[1], n[2], n[3]];
    let out = c.set_membership(t0, &view(n[1], &alive, &n[..1], &[]));
    assert!(out.is_empty(), "settling: nothing reallocated yet: {out:?}");
    // A request for an unknown shard waits while settling.
    assert!(c.get_home(t0, n[1], TYPE, 2, 0).is_empty());
    // Node 3 registers its shard 0 with the higher generation.
    let out = c.register(t0, n[2], &reg(4, vec![(0, n[2], 4)]));
    assert!(matches!(
        &out[0],
        Command::Send {
            msg: ControlMsg::Table { .. },
            ..
        }
    ));
    assert_eq!(
        c.home(TYPE, 0),
        Some(ShardHome {
            owner: n[2],
            generation: 4
        })
    );
    // The last eligible member registers: settled, so shard 1 (dead owner)
    // moves with a higher generation and shard 2 is allocated.
    let out = c.register(t0, n[3], &reg(4, vec![]));
    let h1 = c.home(TYPE, 1).unwrap();
    assert_eq!(h1.generation, 8);
    assert_ne!(h1.owner, n[0]);
    assert!(c.home(TYPE, 2).is_some());
    assert!(tells_home(&out, 1));
    assert_eq!(c.rounds().last().unwrap().moves.len(), 1);
}

#[test]
fn settle_ends_after_the_timeout_without_every_registration() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=2).map(node).collect();
    let mut c = core(n[0]);
    c.register(t0, n[0], &reg(2, vec![]));
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    assert!(c.get_home(t0, n[0], TYPE, 0, 0).is_empty());
    let deadline = c.poll_timeout().expect("settling");
    assert_eq!(deadline, t0 + CoordinatorConfig::default().settle);
    assert!(c.tick(deadline - Duration::from_millis(1)).is_empty());
    let out = c.tick(deadline);
    assert_eq!(out, vec![home(n[0], 0, n[0], 1)]);
    assert!(!c.is_settling());
    // Next: the first rebalance round.
    assert!(c.poll_timeout().is_some_and(|t| t > deadline));
}

#[test]
fn an_inactive_core_records_but_answers_nothing() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=2).map(node).collect();
    let mut c = core(n[1]);
    c.set_membership(t0, &view(n[1], &n, &[], &[]));
    assert!(!c.is_active());
    assert!(c.register(t0, n[0], &reg(2, vec![(0, n[0], 1)])).is_empty());
    assert!(c.get_home(t0, n[0], TYPE, 1, 0).is_empty());
    assert_eq!(
        c.home(TYPE, 0),
        Some(ShardHome {
            owner: n[0],
            generation: 1
        })
    );
}

// ---- handoff and rebalance ----

fn handoff(to: UniqueAddress, shard: u32, generation: u64) -> Command {
    Command::Send {
        to,
        msg: ControlMsg::HandOff {
            type_name: TYPE.into(),
            shard,
            generation,
            epoch: 1,
        },
    }
}

/// The shards the `HandOff` commands in `out` ask for, with their owner.
fn handoffs_in(out: &[Command]) -> Vec<(UniqueAddress, u32, u64)> {
    out.iter()
        .filter_map(|Command::Send { to, msg }| match msg {
            ControlMsg::HandOff {
                shard, generation, ..
            } => Some((*to, *shard, *generation)),
            _ => None,
        })
        .collect()
}

fn counts(c: &CoordinatorCore, shards: u32) -> BTreeMap<UniqueAddress, usize> {
    let mut counts = BTreeMap::new();
    for shard in 0..shards {
        if let Some(h) = c.home(TYPE, shard) {
            *counts.entry(h.owner).or_insert(0) += 1;
        }
    }
    counts
}

/// The first rebalance round is due this long after a core becomes active.
fn first_rebalance() -> Duration {
    let config = CoordinatorConfig::default();
    config.settle + config.rebalance_interval
}

#[test]
fn a_joining_member_gets_its_share_by_capped_handoffs() {
    let (mut c, t0, n) = settled(2, 12);
    for shard in 0..12 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    // A third member joins and registers.
    let third = node(3);
    let all = vec![n[0], n[1], third];
    c.set_membership(t0, &view(n[0], &all, &[], &[]));
    c.register(t0, third, &reg(12, vec![]));
    // Nothing moves before the round is due.
    assert!(handoffs_in(&c.tick(t0 + Duration::from_millis(10))).is_empty());
    let mut now = t0 + first_rebalance();
    let cap = CoordinatorConfig::default().rebalance_per_round;
    let mut rounds = 0;
    loop {
        let asked = handoffs_in(&c.tick(now));
        if asked.is_empty() {
            break;
        }
        rounds += 1;
        assert!(asked.len() <= cap, "round of {} moves", asked.len());
        // Until the owners report, the shards keep their homes.
        for (owner, shard, generation) in &asked {
            assert_eq!(
                c.home(TYPE, *shard),
                Some(ShardHome {
                    owner: *owner,
                    generation: *generation
                })
            );
        }
        // No second round starts while handoffs are in progress (what the
        // owners are asked again is what they were asked).
        now += CoordinatorConfig::default().rebalance_interval;
        let again: BTreeSet<_> = handoffs_in(&c.tick(now)).into_iter().collect();
        assert_eq!(again, asked.iter().copied().collect());
        for (owner, shard, generation) in asked {
            let out = c.shard_stopped(now, owner, TYPE, shard, generation);
            // The new home goes to every region, one generation up.
            let h = c.home(TYPE, shard).unwrap();
            assert_eq!(h.generation, generation + 1);
            assert_eq!(h.owner, third, "the least loaded member gets it");
            assert_eq!(out.len(), 3);
        }
        let round = c.rounds().last().unwrap();
        assert_eq!(round.reason, RebalanceReason::GracefulSpread);
        now += CoordinatorConfig::default().rebalance_interval;
        assert!(rounds < 10, "rebalance does not converge");
    }
    let counts = counts(&c, 12);
    assert_eq!(counts.values().copied().collect::<Vec<_>>(), vec![4, 4, 4]);
    assert_eq!(rounds, 2, "4 moves at 3 per round");
}

#[test]
fn a_leaving_member_hands_off_every_shard_at_once() {
    let (mut c, t0, n) = settled(3, 30);
    for shard in 0..30 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    let out = c.leave(t0, n[2], &[TYPE.to_owned()]);
    let asked = handoffs_in(&out);
    assert_eq!(asked.len(), 10, "graceful leave is not capped");
    assert!(asked.iter().all(|(to, _, _)| *to == n[2]));
    for (owner, shard, generation) in asked {
        c.shard_stopped(t0, owner, TYPE, shard, generation);
        assert_ne!(c.home(TYPE, shard).unwrap().owner, n[2]);
    }
    let round = c.rounds().last().unwrap();
    assert_eq!(round.reason, RebalanceReason::GracefulLeave);
    // A leaving region gets nothing new, and nothing by rebalance.
    assert!(c.has_host_besides(TYPE, &n[2]));
    let counts = counts(&c, 30);
    assert_eq!(counts.get(&n[2]), None);
    assert_eq!(counts.values().sum::<usize>(), 30);
    assert!(handoffs_in(&c.tick(t0 + first_rebalance())).is_empty());
}

#[test]
fn a_handoff_that_times_out_completes_as_a_dead_owner_move() {
    let (mut c, t0, n) = settled(2, 2);
    c.get_home(t0, n[0], TYPE, 0, 0);
    c.get_home(t0, n[0], TYPE, 1, 0);
    let out = c.leave(t0, n[1], &[TYPE.to_owned()]);
    assert_eq!(out, vec![handoff(n[1], 1, 1)]);
    // Asked again every second while there is no answer.
    let later = t0 + Duration::from_millis(1_500);
    assert_eq!(handoffs_in(&c.tick(later)), vec![(n[1], 1, 1)]);
    let timeout = CoordinatorConfig::default().handoff_timeout;
    c.tick(t0 + timeout);
    assert_eq!(
        c.home(TYPE, 1),
        Some(ShardHome {
            owner: n[0],
            generation: 2
        })
    );
    let round = c.rounds().last().unwrap();
    assert_eq!(round.reason, RebalanceReason::DeadOwner);
    // The old owner's late report is answered with the shard's home.
    let out = c.shard_stopped(t0 + timeout, n[1], TYPE, 1, 1);
    assert_eq!(out, vec![home(n[1], 1, n[0], 2)]);
}

/// Driven by `poll_timeout` alone, a handoff with no answer is sent again
/// every second and times out on time.
#[test]
fn a_core_woken_only_at_its_poll_timeout_resends_and_times_out_a_handoff() {
    let (mut c, t0, n) = settled(2, 2);
    c.get_home(t0, n[0], TYPE, 0, 0);
    c.get_home(t0, n[0], TYPE, 1, 0);
    assert_eq!(
        c.leave(t0, n[1], &[TYPE.to_owned()]),
        vec![handoff(n[1], 1, 1)]
    );
    let timeout = CoordinatorConfig::default().handoff_timeout;
    let mut resent = Vec::new();
    let mut now = t0;
    while c.home(TYPE, 1).is_some_and(|h| h.owner == n[1]) {
        let due = c
            .poll_timeout()
            .expect("a handoff in progress has a deadline");
        assert!(due > now, "a deadline in the past");
        now = due;
        if !handoffs_in(&c.tick(now)).is_empty() {
            resent.push(now - t0);
        }
        assert!(now <= t0 + timeout, "the handoff outlived its timeout");
    }
    let every_second: Vec<Duration> = (1..10).map(Duration::from_secs).collect();
    assert_eq!(resent, every_second);
    assert_eq!(now, t0 + timeout, "moved at the timeout");
    assert_eq!(c.home(TYPE, 1).map(|h| h.owner), Some(n[0]));
}

#[test]
fn an_owner_that_dies_mid_handoff_loses_the_shard_as_a_dead_owner() {
    let (mut c, t0, n) = settled(3, 3);
    for shard in 0..3 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    assert_eq!(handoffs_in(&c.leave(t0, n[2], &[TYPE.to_owned()])).len(), 1);
    c.set_membership(t0, &view(n[0], &n[..2], &n[2..], &[]));
    let round = c.rounds().last().unwrap();
    assert_eq!(round.reason, RebalanceReason::DeadOwner);
    assert_eq!(round.moves[0].from, n[2]);
    assert_eq!(c.home(TYPE, 2).unwrap().generation, 2);
    assert!(handoffs_in(&c.tick(t0 + Duration::from_secs(30))).is_empty());
}

#[test]
fn a_new_coordinator_finishes_a_handoff_it_did_not_start() {
    let (mut c, t0, n) = settled(3, 3);
    for shard in 0..3 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    let asked = handoffs_in(&c.leave(t0, n[2], &[TYPE.to_owned()]));
    assert_eq!(asked, vec![(n[2], 2, 1)]);
    // The coordinator's node crashes; node 2 takes over, with every
    // region's replica; the owner reports the stop to it.
    let mut c2 = core(n[1]);
    let survivors = vec![n[1], n[2]];
    c2.set_membership(t0, &view(n[1], &survivors, &[n[0]], &[]));
    let replica = vec![(0, n[0], 1), (1, n[1], 1), (2, n[2], 1)];
    c2.register(t0, n[1], &reg(3, replica.clone()));
    c2.register(t0, n[2], &reg(3, replica));
    c2.leave(t0, n[2], &[TYPE.to_owned()]);
    c2.shard_stopped(t0, n[2], TYPE, 2, 1);
    let h = c2.home(TYPE, 2).unwrap();
    assert_eq!((h.owner, h.generation), (n[1], 2));
    let h = c2.home(TYPE, 0).unwrap();
    assert_eq!(h.owner, n[1], "the dead coordinator's shard moved too");
}

#[test]
fn proxy_only_regions_route_but_are_given_nothing() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=2).map(node).collect();
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    let mut proxy = reg(4, vec![]);
    proxy[0].proxy = true;
    c.register(t0, n[0], &proxy);
    c.register(t0, n[1], &reg(4, vec![]));
    for shard in 0..4 {
        // The proxy asks, and hears the home.
        let out = c.get_home(t0, n[0], TYPE, shard, 0);
        assert!(out.contains(&home(n[0], shard, n[1], 1)));
    }
    assert!(handoffs_in(&c.tick(t0 + first_rebalance())).is_empty());
}

// ---- random histories ----

#[derive(Clone, Debug)]
enum Op {
    Join(u8),
    Crash(u8),
    Unreachable(u8),
    Heal(u8),
    Register(u8),
    Unregister(u8),
    Ask(u8, u8),
    Advance(u16),
    /// The node's system begins a graceful leave.
    Leave(u8),
    /// The node reports stopped every shard it was asked to hand off.
    Stopped(u8),
    /// The coordinator hears that shards `a` and `b` talk (placement by
    /// traffic); not drawn by `Arbitrary`, mixed in by its own test.
    Traffic(u8, u8),
}

impl Arbitrary for Op {
    fn arbitrary(g: &mut Gen) -> Self {
        let n = |g: &mut Gen| u8::arbitrary(g) % 6;
        match u8::arbitrary(g) % 15 {
            10 => Op::Unregister(n(g)),
            11 => Op::Leave(n(g)),
            12 | 13 => Op::Stopped(n(g)),
            0 => Op::Join(n(g)),
            1 => Op::Crash(n(g)),
            2 => Op::Unreachable(n(g)),
            3 => Op::Heal(n(g)),
            4 => Op::Register(n(g)),
            5 => Op::Advance(u16::arbitrary(g) % 1500),
            // Now and then long enough for a handoff to time out.
            14 => Op::Advance(10_000 + u16::arbitrary(g) % 3_000),
            _ => Op::Ask(n(g), u8::arbitrary(g) % 12),
        }
    }
}

thread_local! {
    /// Shards the histories run on this thread moved for traffic.
    static TRAFFIC_MOVES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Drives the cores of a whole cluster through a history (the core of the
/// oldest eligible member acts; a node that becomes coordinator for the
/// first time starts a fresh core; every region registers with a new
/// coordinator, carrying its replica) and checks: a new home never reuses
/// or lowers a generation that a live region knows for the shard (so no two
/// owners share a generation, and generations only grow, as far as anyone
/// alive can tell); cores that are not the coordinator say nothing; once a
/// settled coordinator has processed a change, no shard points at a downed
/// member while a candidate exists; a shard whose owner is alive with its
/// region moves only after the owner reported it stopped, or its handoff
/// timed out (so no two nodes host it at once); a GracefulSpread round
/// moves at most `rebalance_per_round` shards; and once membership stops
/// changing and owners answer handoffs, the counts end within one.
fn history_holds(ops: Vec<Op>) -> bool {
    check_history(ops).map_err(|e| eprintln!("{e}")).is_ok()
}

fn check_history(ops: Vec<Op>) -> Result<(), String> {
    check_history_with(ops, CoordinatorConfig::default())
}

/// [`check_history`] under `config`.
fn check_history_with(ops: Vec<Op>, config: CoordinatorConfig) -> Result<(), String> {
    const SHARDS: u32 = 12;
    let t0 = Instant::now();
    let mut now = t0;
    let nodes: Vec<UniqueAddress> = (0..6).map(node).collect();
    let mut alive: BTreeSet<usize> = BTreeSet::from([0]);
    let mut dead: BTreeSet<usize> = BTreeSet::new();
    let mut unreachable: BTreeSet<usize> = BTreeSet::new();
    let mut registered: BTreeSet<usize> = BTreeSet::new();
    let mut departed: BTreeSet<usize> = BTreeSet::new();
    // What each node's region knows, as it would report it: the homes it
    // was sent.
    let mut known: BTreeMap<usize, BTreeMap<u32, (UniqueAddress, u64)>> = BTreeMap::new();
    let mut cores: BTreeMap<usize, CoordinatorCore> = BTreeMap::new();
    let index_of = |a: &UniqueAddress| nodes.iter().position(|n| n == a).unwrap();
    let mut last_coordinator: Option<usize> = None;
    let mut leaving: BTreeSet<usize> = BTreeSet::new();
    // Handoffs asked of each owner: (owner, shard) → (generation, first asked).
    let mut asked: BTreeMap<(usize, u32), (u64, Instant)> = BTreeMap::new();
    let mut reported: BTreeSet<(u32, u64)> = BTreeSet::new();
    let mut reported_at: BTreeMap<(u32, u64), Instant> = BTreeMap::new();
    // The newest home given out for each shard, by any core.
    let mut latest: BTreeMap<u32, (UniqueAddress, u64)> = BTreeMap::new();
    let mut rounds_checked: BTreeMap<usize, usize> = BTreeMap::new();
    let settle_ops = (0..(SHARDS as usize + 8)).flat_map(|_| {
        let mut step: Vec<Op> = (0..SHARDS as u8).map(|s| Op::Ask(u8::MAX, s)).collect();
        step.push(Op::Stopped(u8::MAX));
        step.push(Op::Advance(1_000));
        step
    });
    let history_len = ops.len();
    let ops: Vec<Op> = ops.into_iter().chain(settle_ops).collect();

    for (step, op) in ops.into_iter().enumerate() {
        if step == history_len {
            // Membership stops changing: every partition heals.
            unreachable.clear();
        }
        match op {
            Op::Join(i) => {
                let i = i as usize;
                if !dead.contains(&i) {
                    alive.insert(i);
                }
            }
            Op::Crash(i) => {
                let i = i as usize;
                if alive.len() > 1 && alive.remove(&i) {
                    dead.insert(i);
                    leaving.remove(&i);
                    registered.remove(&i);
                    known.remove(&i);
                    cores.remove(&i);
                    unreachable.remove(&i);
                }
            }
            Op::Unreachable(i) => {
                if alive.contains(&(i as usize)) {
                    unreachable.insert(i as usize);
                }
            }
            Op::Heal(i) => {
                unreachable.remove(&(i as usize));
            }
            Op::Register(i) => {
                if alive.contains(&(i as usize)) {
                    registered.insert(i as usize);
                    leaving.remove(&(i as usize));
                    departed.remove(&(i as usize));
                }
            }
            Op::Unregister(i) => {
                // Its system stops: it forgets what it knew, as a new system
                // on that node would.
                if registered.remove(&(i as usize)) {
                    departed.insert(i as usize);
                    leaving.remove(&(i as usize));
                    known.remove(&(i as usize));
                    // What it hosted stopped with it: no handoff to wait for.
                    let gone = nodes[i as usize];
                    latest.retain(|_, (owner, _)| *owner != gone);
                }
                // Its coordinator core goes on (a stopped system still
                // coordinates), and it tells every coordinator it sees.
            }
            Op::Leave(i) => {
                if registered.contains(&(i as usize)) {
                    leaving.insert(i as usize);
                }
            }
            Op::Ask(_, _) | Op::Advance(_) | Op::Stopped(_) | Op::Traffic(_, _) => {}
        }
        if let Op::Advance(ms) = op {
            now += Duration::from_millis(u64::from(ms));
        }
        let up: Vec<UniqueAddress> = alive.iter().map(|i| nodes[*i]).collect();
        let down: Vec<UniqueAddress> = dead.iter().map(|i| nodes[*i]).collect();
        let unr: Vec<UniqueAddress> = unreachable.iter().map(|i| nodes[*i]).collect();
        let probe = view(nodes[0], &up, &down, &unr);
        let Some(coord) = probe.coordinator else {
            // No coordinator: the next one is a change for every node, and
            // every core hears it is not the coordinator now.
            last_coordinator = None;
            for (j, other) in cores.iter_mut() {
                let v = view(nodes[*j], &up, &down, &unr);
                if !other.set_membership(now, &v).is_empty() {
                    return Err(format!("core {j} spoke without being coordinator"));
                }
            }
            continue;
        };
        let ci = index_of(&coord);
        let mut commands = Vec::new();
        let changed = last_coordinator != Some(ci);
        last_coordinator = Some(ci);
        let c = cores
            .entry(ci)
            .or_insert_with(|| CoordinatorCore::new(coord, config, Box::new(LeastShardAllocation)));
        let was_active = c.is_active();
        if changed {
            // A stopped region tells every new coordinator.
            for d in &departed {
                if alive.contains(d) {
                    commands.extend(c.unregister(now, nodes[*d], &[TYPE.to_owned()]));
                }
            }
            // Every region registers with a new coordinator (a leaving one
            // says so, and again with `Leave`); handoffs not reported yet
            // are called off, and owners repeat their stop reports.
            asked.retain(|(_, shard), (generation, _)| reported.contains(&(*shard, *generation)));
            for r in &registered {
                let registration = reg_as(SHARDS, replica(&known, *r), leaving.contains(r));
                commands.extend(c.register(now, nodes[*r], &registration));
            }
            for l in &leaving {
                commands.extend(c.leave(now, nodes[*l], &[TYPE.to_owned()]));
            }
            for ((owner, shard), (generation, _)) in &asked {
                if reported.contains(&(*shard, *generation)) && alive.contains(owner) {
                    commands.extend(c.shard_stopped(now, nodes[*owner], TYPE, *shard, *generation));
                }
            }
        }
        commands.extend(c.set_membership(now, &view(coord, &up, &down, &unr)));
        if changed && !was_active && c.is_active() {
            // Registrations a standby core took were not answered: the
            // regions send them again (real ones after `REREGISTER_AFTER`).
            for r in &registered {
                let registration = reg_as(SHARDS, replica(&known, *r), leaving.contains(r));
                commands.extend(c.register(now, nodes[*r], &registration));
            }
            // So were the stop reports repeated above: a standby core drops
            // `ShardStopped`. An owner still waiting for the shard's next
            // home repeats its report (a real one at once after the new
            // coordinator's table, and every 300 ms: SPEC §13.2, §13.11),
            // so the new coordinator finishes the handoff rather than
            // starting it afresh and timing it out as a dead-owner move.
            for ((owner, shard), (generation, _)) in &asked {
                if reported.contains(&(*shard, *generation))
                    && alive.contains(owner)
                    && known.get(owner).and_then(|k| k.get(shard))
                        == Some(&(nodes[*owner], *generation))
                {
                    commands.extend(c.shard_stopped(now, nodes[*owner], TYPE, *shard, *generation));
                }
            }
        }
        match op {
            Op::Register(i) if alive.contains(&(i as usize)) => {
                let i = i as usize;
                let registration = reg_as(SHARDS, replica(&known, i), leaving.contains(&i));
                commands.extend(c.register(now, nodes[i], &registration));
            }
            Op::Unregister(i) if departed.contains(&(i as usize)) => {
                commands.extend(c.unregister(now, nodes[i as usize], &[TYPE.to_owned()]));
            }
            Op::Leave(i) if leaving.contains(&(i as usize)) => {
                commands.extend(c.leave(now, nodes[i as usize], &[TYPE.to_owned()]));
            }
            Op::Stopped(i) => {
                // An owner reports the handoffs it was asked for, of shards
                // it still hosts (`u8::MAX`: every owner).
                let due: Vec<(usize, u32, u64)> = asked
                    .iter()
                    .filter(|((owner, shard), (generation, _))| {
                        (i == u8::MAX || *owner == i as usize)
                            && alive.contains(owner)
                            && known.get(owner).and_then(|k| k.get(shard))
                                == Some(&(nodes[*owner], *generation))
                    })
                    .map(|((owner, shard), (generation, _))| (*owner, *shard, *generation))
                    .collect();
                for (owner, shard, generation) in due {
                    reported.insert((shard, generation));
                    reported_at.entry((shard, generation)).or_insert(now);
                    commands.extend(c.shard_stopped(now, nodes[owner], TYPE, shard, generation));
                }
            }
            // After the history, every shard is asked for by some region.
            Op::Ask(u8::MAX, shard) => {
                // A region asks only while it knows no live home for the
                // shard (an owner in a handoff never asks: it hosts it).
                let lost = |r: &usize| {
                    known
                        .get(r)
                        .and_then(|k| k.get(&u32::from(shard)))
                        .is_none_or(|(o, _)| {
                            let o = index_of(o);
                            !alive.contains(&o) || !registered.contains(&o)
                        })
                };
                if let Some(r) = registered.iter().find(|r| alive.contains(r) && lost(r)) {
                    let seen = known
                        .get(r)
                        .and_then(|k| k.get(&u32::from(shard)))
                        .map_or(0, |(_, g)| *g);
                    commands.extend(c.get_home(now, nodes[*r], TYPE, u32::from(shard), seen));
                }
            }
            // Only a node with a region of the type asks for its shards.
            Op::Ask(i, shard)
                if alive.contains(&(i as usize)) && registered.contains(&(i as usize)) =>
            {
                let seen = known
                    .get(&(i as usize))
                    .and_then(|k| k.get(&u32::from(shard)))
                    .map_or(0, |(_, g)| *g);
                commands.extend(c.get_home(now, nodes[i as usize], TYPE, u32::from(shard), seen));
            }
            Op::Traffic(a, b) => {
                let (a, b) = (u32::from(a) % SHARDS, u32::from(b) % SHARDS);
                c.traffic(&[(TYPE.into(), a, TYPE.into(), b, 1_000)]);
                commands.extend(c.tick(now));
            }
            _ => commands.extend(c.tick(now)),
        }
        // Other cores are not active: they must say nothing.
        for (j, other) in cores.iter_mut() {
            if *j != ci && other.is_active() {
                let v = view(other.me, &up, &down, &unr);
                if !other.set_membership(now, &v).is_empty() {
                    return Err(format!("inactive core {j} spoke"));
                }
            }
        }
        for command in commands {
            let Command::Send { to, msg } = command;
            let r = index_of(&to);
            match msg {
                ControlMsg::Home {
                    shard,
                    owner,
                    generation,
                    ..
                } => {
                    // What the live regions know of the shard: a new home
                    // must not reuse or go below that generation.
                    let best = alive
                        .iter()
                        .filter_map(|a| known.get(a).and_then(|k| k.get(&shard)))
                        .max_by_key(|(_, g)| *g)
                        .copied();
                    if let Some((o, g)) = best
                        && (generation < g || (generation == g && o != owner))
                    {
                        return Err(format!(
                            "shard {shard}: home {owner} gen {generation} while a live region knows {o} gen {g}"
                        ));
                    }
                    if let Some(&(previous, g)) = latest.get(&shard)
                        && generation > g
                        && previous != owner
                    {
                        // A move away from an owner that is alive with its
                        // region needs its stop report, or a timed-out handoff.
                        let p = index_of(&previous);
                        let owner_alive = alive.contains(&p) && registered.contains(&p);
                        let timed_out = asked.get(&(p, shard)).is_some_and(|(ag, at)| {
                            *ag == g && now.duration_since(*at) >= config.handoff_timeout
                        });
                        if owner_alive && !reported.contains(&(shard, g)) && !timed_out {
                            return Err(format!(
                                "shard {shard} moved from live {previous} gen {g} to {owner} gen {generation} without a stop report"
                            ));
                        }
                    }
                    if latest.get(&shard).is_none_or(|(_, g)| generation >= *g) {
                        latest.insert(shard, (owner, generation));
                    }
                    if registered.contains(&r) {
                        learn(&mut known, &alive, r, shard, owner, generation);
                    }
                }
                ControlMsg::Table { homes, .. } => {
                    for (shard, owner, generation) in homes {
                        learn(&mut known, &alive, r, shard, owner, generation);
                    }
                }
                ControlMsg::HandOff {
                    shard, generation, ..
                } => {
                    asked
                        .entry((r, shard))
                        .and_modify(|e| {
                            if e.0 != generation {
                                *e = (generation, now);
                            }
                        })
                        .or_insert((generation, now));
                }
                _ => {}
            }
        }
        let c = &cores[&ci];
        if let Some(name) = c
            .types
            .iter()
            .find(|(_, t)| !t.owned_agrees())
            .map(|(n, _)| n)
        {
            return Err(format!(
                "{name}: the per-owner counts disagree with the homes"
            ));
        }
        // Every input ends with the core acting at `now`: what it waits
        // for is later, or time alone would never give it its turn.
        if let Some(due) = c.poll_timeout().filter(|due| *due <= now) {
            return Err(format!(
                "a deadline left in the past: {:?} before now",
                now - due
            ));
        }
        let seen = rounds_checked.entry(ci).or_insert(0);
        for round in c.rounds().iter().skip(*seen) {
            if round.reason == RebalanceReason::Traffic {
                TRAFFIC_MOVES.with(|moved| moved.set(moved.get() + round.moves.len()));
            }
            if round.reason == RebalanceReason::GracefulSpread
                && round.moves.len() > config.rebalance_per_round
            {
                return Err(format!("a spread round of {} moves", round.moves.len()));
            }
            // A live owner with its region loses a shard as a dead owner
            // only by a handoff it did not report within the timeout.
            if round.reason == RebalanceReason::DeadOwner {
                for m in &round.moves {
                    let p = index_of(&m.from);
                    if !alive.contains(&p) || !registered.contains(&p) {
                        continue;
                    }
                    let excused = asked.get(&(p, m.shard.0)).is_some_and(|(g, at)| {
                        now.duration_since(*at) >= config.handoff_timeout
                            && reported_at
                                .get(&(m.shard.0, *g))
                                .is_none_or(|r| r.duration_since(*at) >= config.handoff_timeout)
                    });
                    if !excused {
                        return Err(format!("a dead-owner move from live {}: {m:?}", m.from));
                    }
                }
            }
        }
        *seen = c.rounds().len();
        let c = &cores[&ci];
        // (With a margin, a gone owner's shards wait it out: checked from
        // the first second of the settle phase.)
        let margin_over =
            config.dead_owner_margin.is_zero() || step > history_len + SHARDS as usize + 1;
        if c.is_active() && !c.is_settling() && margin_over {
            let candidates = alive
                .iter()
                .any(|i| registered.contains(i) && !unreachable.contains(i));
            for shard in 0..SHARDS {
                if let Some(h) = c.home(TYPE, shard)
                    && (dead.contains(&index_of(&h.owner))
                        || (departed.contains(&index_of(&h.owner))
                            && !unreachable.contains(&index_of(&h.owner))))
                    && candidates
                {
                    return Err(format!(
                        "shard {shard} still at dead or departed {}",
                        h.owner
                    ));
                }
            }
        }
    }
    // Membership has not changed for the settle steps: balanced.
    let c = last_coordinator.and_then(|ci| cores.get(&ci));
    let candidates: Vec<UniqueAddress> = alive
        .iter()
        .filter(|i| registered.contains(i) && !leaving.contains(i))
        .map(|i| nodes[*i])
        .collect();
    // (With no candidate, nothing can move: leavers keep what they own.)
    if let Some(c) = c.filter(|c| c.is_active() && !candidates.is_empty()) {
        let mut counts: BTreeMap<UniqueAddress, usize> =
            candidates.iter().map(|m| (*m, 0)).collect();
        for shard in 0..SHARDS {
            match c.home(TYPE, shard) {
                Some(h) => *counts.entry(h.owner).or_insert(0) += 1,
                None if !candidates.is_empty() => {
                    return Err(format!("shard {shard} has no home after settling"));
                }
                None => {}
            }
        }
        // (Placement by traffic may leave counts its slack apart.)
        let allowed = config.placement_by_traffic.map_or(1, |p| p.slack.max(1));
        let (min, max) = (counts.values().min(), counts.values().max());
        if let (Some(min), Some(max)) = (min, max)
            && max - min > allowed
        {
            return Err(format!("not balanced after settling: {counts:?}"));
        }
        if !candidates.is_empty() && c.in_progress() != (0, 0) {
            return Err(format!(
                "handoffs and open rounds left after settling: {:?}",
                c.in_progress()
            ));
        }
    }
    Ok(())
}

fn learn(
    known: &mut BTreeMap<usize, BTreeMap<u32, (UniqueAddress, u64)>>,
    alive: &BTreeSet<usize>,
    node: usize,
    shard: u32,
    owner: UniqueAddress,
    generation: u64,
) {
    if alive.contains(&node) {
        let entry = known
            .entry(node)
            .or_default()
            .entry(shard)
            .or_insert((owner, generation));
        if generation >= entry.1 {
            *entry = (owner, generation);
        }
    }
}

fn replica(
    known: &BTreeMap<usize, BTreeMap<u32, (UniqueAddress, u64)>>,
    node: usize,
) -> Vec<(u32, UniqueAddress, u64)> {
    known
        .get(&node)
        .map(|m| m.iter().map(|(s, (o, g))| (*s, *o, *g)).collect())
        .unwrap_or_default()
}

#[test]
fn regression_takeover_after_the_only_registered_owner_crashed() {
    use Op::*;
    let ops = vec![
        Register(0),
        Join(4),
        Join(3),
        Ask(3, 2),
        Register(4),
        Crash(0),
        Advance(103),
        Ask(3, 2),
        Advance(542),
        Advance(440),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_regions_reregister_with_a_returning_coordinator() {
    use Op::*;
    let ops = vec![
        Unreachable(0),
        Join(3),
        Register(3),
        Heal(0),
        Ask(3, 10),
        Register(0),
        Unreachable(0),
        Ask(0, 10),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_only_regions_ask_and_remember() {
    use Op::*;
    let ops = vec![
        Join(4),
        Join(3),
        Advance(1312),
        Join(5),
        Register(3),
        Ask(4, 7),
        Crash(3),
        Register(5),
        Crash(0),
        Ask(5, 7),
        Advance(1471),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn a_region_that_saw_a_newer_generation_gets_a_home_above_it() {
    let (mut c, t0, n) = settled(2, 4);
    c.get_home(t0, n[0], TYPE, 0, 0);
    assert_eq!(c.home(TYPE, 0).unwrap().generation, 1);
    // Node 2 saw generation 5 (from a coordinator whose knowledge is lost).
    let out = c.get_home(t0, n[1], TYPE, 0, 5);
    let h = c.home(TYPE, 0).unwrap();
    assert_eq!(h.generation, 6);
    assert!(out.contains(&home(n[1], 0, h.owner, 6)), "{out:?}");
}

#[test]
fn a_returning_coordinator_settles_on_fresh_registrations() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    for a in &n {
        c.register(t0, *a, &reg(4, vec![]));
    }
    assert!(!c.is_settling(), "everyone registered: settled");
    // Node 1 is unreachable for a while (node 2 coordinates), then returns.
    c.set_membership(t0, &view(n[0], &n, &[], &n[..1]));
    assert!(!c.is_active());
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    assert!(c.is_active());
    // Registrations from the earlier term do not count: node 2 is not a
    // region here until it registers again.
    assert!(c.get_home(t0, n[1], TYPE, 0, 0).is_empty());
    c.register(t0, n[1], &reg(4, vec![]));
    assert!(
        c.get_home(t0, n[1], TYPE, 0, 0).is_empty(),
        "settling again"
    );
    let out = c.register(t0, n[2], &reg(4, vec![]));
    assert!(tells_home(&out, 0), "{out:?}");
}

#[test]
fn an_absurd_shard_count_is_refused_without_allocating_it() {
    let (mut c, t0, n) = settled(2, 4);
    let mut bad = reg(4, vec![]);
    bad[0].type_name = "huge".into();
    bad[0].num_shards = u32::MAX;
    let out = c.register(t0, n[1], &bad);
    assert!(
        matches!(
            &out[..],
            [Command::Send {
                msg: ControlMsg::Refused { .. },
                ..
            }]
        ),
        "{out:?}"
    );
}

#[test]
fn an_unregistered_region_loses_its_shards_and_gets_no_new_ones() {
    let (mut c, t0, n) = settled(3, 9);
    for shard in 0..9 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    let owned: Vec<u32> = (0..9)
        .filter(|s| c.home(TYPE, *s).unwrap().owner == n[2])
        .collect();
    assert_eq!(owned.len(), 3);
    let out = c.unregister(t0, n[2], &[TYPE.to_owned()]);
    // Each moved shard is told to the two remaining regions.
    assert_eq!(out.len(), 2 * owned.len(), "{out:?}");
    for shard in &owned {
        assert_ne!(c.home(TYPE, *shard).unwrap().owner, n[2]);
    }
    assert_eq!(c.rounds().last().unwrap().moves.len(), 3);
    // Registering again makes it a region (and a candidate) once more.
    c.register(t0, n[2], &reg(9, vec![]));
    assert!(c.get_home(t0, n[2], TYPE, 0, 0).len() == 1);
}

#[test]
fn regression_a_stopped_region_unknown_to_the_next_coordinator() {
    use Op::*;
    let ops = vec![
        Join(1),
        Register(0),
        Register(1),
        Unreachable(1),
        Ask(1, 3),
        Unregister(0),
        Unreachable(0),
        Heal(1),
        Heal(0),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_a_stopped_system_takes_its_core_along() {
    use Op::*;
    let ops = vec![
        Join(2),
        Register(0),
        Unreachable(0),
        Unregister(0),
        Heal(0),
        Register(2),
        Ask(2, 6),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_settle_by_timeout_reallocates_a_stopped_coordinators_shards() {
    use Op::*;
    let ops = vec![
        Register(0),
        Join(3),
        Register(3),
        Unreachable(0),
        Ask(0, 4),
        Unregister(3),
        Heal(0),
        Advance(907),
        Advance(183),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_an_unregistration_that_reached_no_coordinator() {
    use Op::*;
    let ops = vec![
        Register(0),
        Unreachable(0),
        Unregister(0),
        Heal(0),
        Join(5),
        Register(5),
        Ask(5, 1),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_a_coordinator_that_unregistered_itself_hands_over() {
    use Op::*;
    let ops = vec![
        Join(1),
        Unreachable(0),
        Register(1),
        Ask(1, 5),
        Register(0),
        Unregister(1),
        Heal(0),
        Advance(1067),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn random_histories_keep_the_invariants() {
    QuickCheck::new()
        .tests(2000)
        .quickcheck(history_holds as fn(Vec<Op>) -> bool);
}

/// The same, with a dead-owner margin: quiet periods come and go, and
/// the core's deadlines follow them.
#[test]
fn random_histories_with_a_dead_owner_margin_keep_the_invariants() {
    fn holds(ops: Vec<Op>) -> bool {
        let config = CoordinatorConfig {
            dead_owner_margin: Duration::from_millis(700),
            ..CoordinatorConfig::default()
        };
        check_history_with(ops, config)
            .map_err(|e| eprintln!("{e}"))
            .is_ok()
    }
    QuickCheck::new()
        .tests(1000)
        .quickcheck(holds as fn(Vec<Op>) -> bool);
}

/// [`check_history`] placing by traffic, with a report that shards `k`
/// and `k + 6` talk (`k` = the step mod 6) after every step of `ops`.
fn check_history_placing_by_traffic(ops: Vec<Op>) -> Result<(), String> {
    let config = CoordinatorConfig {
        placement_by_traffic: Some(crate::model::config::PlacementByTraffic::default()),
        ..CoordinatorConfig::default()
    };
    let ops = ops
        .into_iter()
        .enumerate()
        .flat_map(|(i, op)| {
            let pair = (i % 6) as u8;
            [op, Op::Traffic(pair, pair + 6)]
        })
        .collect();
    check_history_with(ops, config)
}

/// The same, placing by traffic: shards 0–5 talk to shards 6–11 (a
/// report after every step of the history), so rounds move shards
/// for traffic among the joins, crashes, leaves and partitions. The
/// handoffs they start keep every invariant, and the counts end within
/// the slack.
#[test]
fn random_histories_placing_by_traffic_keep_the_invariants() {
    fn holds(ops: Vec<Op>) -> bool {
        check_history_placing_by_traffic(ops)
            .map_err(|e| eprintln!("{e}"))
            .is_ok()
    }
    TRAFFIC_MOVES.with(|moved| moved.set(0));
    QuickCheck::new()
        .tests(1000)
        .quickcheck(holds as fn(Vec<Op>) -> bool);
    let moved = TRAFFIC_MOVES.with(std::cell::Cell::get);
    assert!(moved > 0, "no shard moved for traffic in any history");
}

#[test]
fn regression_a_region_that_left_and_registered_again() {
    use Op::*;
    let ops = vec![
        Register(0),
        Leave(0),
        Unreachable(0),
        Unregister(0),
        Register(0),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

/// Node 0 coordinates and places shard 8 on node 4 (generation 1), then
/// becomes unreachable; node 4 dies, so nobody reachable knows generation
/// 1 was given out, and node 5's new core gives shard 8 generation 1 again,
/// on node 5. When node 0 is reachable again it coordinates with its old
/// table: shard 8 at the dead node 4. It must stay on node 5, which hosts
/// it, rather than move to a new home while node 5 still runs it.
#[test]
fn regression_a_generation_given_out_twice_across_a_partition() {
    use Op::*;
    let ops = vec![
        Join(4),
        Register(4),
        Ask(4, 8),
        Advance(1206),
        Unreachable(0),
        Crash(4),
        Register(0),
        Join(5),
        Register(5),
        Ask(5, 8),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_a_stopped_and_restarted_region_with_an_unreachable_peer() {
    use Op::*;
    let ops = vec![
        Register(0),
        Join(2),
        Register(2),
        Ask(0, 1),
        Unreachable(2),
        Unregister(0),
        Register(0),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_long_partitions_after_the_coordinator_crashed() {
    use Op::*;
    let ops = vec![
        Crash(5),
        Advance(564),
        Advance(152),
        Join(4),
        Advance(373),
        Register(4),
        Ask(4, 5),
        Ask(4, 4),
        Join(1),
        Register(1),
        Crash(0),
        Advance(11254),
        Unreachable(4),
        Unreachable(1),
        Advance(10278),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_two_leave_while_one_is_unreachable() {
    use Op::*;
    let ops = vec![
        Join(2),
        Crash(0),
        Join(4),
        Advance(1077),
        Register(2),
        Ask(2, 0),
        Ask(2, 7),
        Ask(2, 10),
        Register(4),
        Ask(4, 2),
        Unreachable(2),
        Leave(2),
        Leave(4),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

#[test]
fn regression_a_crashed_coordinator_then_an_unreachable_stopped_region() {
    use Op::*;
    let ops = vec![
        Join(1),
        Register(1),
        Register(0),
        Join(2),
        Ask(1, 4),
        Unregister(0),
        Crash(1),
        Register(2),
        Unreachable(0),
        Ask(2, 4),
    ];
    assert_eq!(check_history(ops), Ok(()));
}

/// Shard home `owner` at `generation`, as `CoordinatorCore::home` gives it.
fn at(owner: UniqueAddress, generation: u64) -> Option<ShardHome> {
    Some(ShardHome { owner, generation })
}

/// A core that lost shard 4: it was at n[0] (generation 1), moved to n[1]
/// when n[0]'s system stopped (generation 2), and n[1] died with nowhere
/// for it to go. Returns the core and the time after all that.
fn a_core_that_lost_shard_4(n: &[UniqueAddress]) -> (CoordinatorCore, Instant) {
    let start = Instant::now();
    let mut c = core(n[0]);
    c.set_membership(start, &view(n[0], n, &[], &[]));
    // Past the settle period (n[2] and n[3] have no region yet).
    let t0 = start + Duration::from_secs(2);
    c.register(t0, n[0], &reg(8, vec![]));
    c.get_home(t0, n[0], TYPE, 4, 0);
    assert_eq!(c.home(TYPE, 4).map(|h| h.owner), Some(n[0]));
    c.register(t0, n[1], &reg(8, vec![]));
    c.unregister(t0, n[0], &[TYPE.to_owned()]);
    assert_eq!(c.home(TYPE, 4), at(n[1], 2));
    let t1 = t0 + Duration::from_secs(1);
    c.set_membership(t1, &view(n[0], &[n[0], n[2], n[3]], &n[1..2], &[]));
    let t2 = t1 + Duration::from_secs(60);
    c.tick(t2);
    assert_eq!(c.home(TYPE, 4), None, "nowhere to go");
    (c, t2)
}

#[test]
fn a_region_hosting_a_shard_the_table_lost_is_its_home_again_under_a_fresh_generation() {
    let n: Vec<UniqueAddress> = (1..=4).map(node).collect();
    let (mut c, t) = a_core_that_lost_shard_4(&n);
    // Placed on n[2] at generation 1 by a coordinator this one did not see.
    let out = c.register(t, n[2], &reg(8, vec![(4, n[2], 1)]));
    assert_eq!(c.home(TYPE, 4), at(n[2], 3));
    assert!(out.contains(&home(n[2], 4, n[2], 3)), "{out:?}");
}

#[test]
fn a_leaving_region_that_hosts_a_lost_shard_keeps_it_until_it_is_handed_off() {
    let n: Vec<UniqueAddress> = (1..=4).map(node).collect();
    let (mut c, t) = a_core_that_lost_shard_4(&n);
    // A leaver is the shard's home as any owner is (it does host it), and
    // the usual rule moves it on: by a handoff, once there is somewhere to
    // go.
    let out = c.register(t, n[2], &reg_as(8, vec![(4, n[2], 1)], true));
    assert_eq!(c.home(TYPE, 4), at(n[2], 3));
    assert!(out.contains(&home(n[2], 4, n[2], 3)), "{out:?}");
    let out = c.register(t, n[3], &reg(8, vec![]));
    assert!(
        out.iter().any(|Command::Send { to, msg }| *to == n[2]
            && matches!(
                msg,
                ControlMsg::HandOff {
                    shard: 4,
                    generation: 3,
                    ..
                }
            )),
        "{out:?}"
    );
}

#[test]
fn two_regions_claiming_one_lost_shard_both_hear_its_one_home() {
    let n: Vec<UniqueAddress> = (1..=5).map(node).collect();
    let (mut c, t) = a_core_that_lost_shard_4(&n[..4]);
    let t = t + Duration::from_secs(1);
    c.set_membership(t, &view(n[0], &[n[0], n[2], n[3], n[4]], &n[1..2], &[]));
    let mut out = c.register(t, n[2], &reg(8, vec![(4, n[2], 1)]));
    out.extend(c.register(t, n[4], &reg(8, vec![(4, n[4], 2)])));
    out.extend(c.tick(t + Duration::from_secs(60)));
    let h = c.home(TYPE, 4).expect("a home");
    assert!([n[2], n[4]].contains(&h.owner), "{h:?}");
    // Each claimant hears the one home, in a `Home` or its `Table`.
    for claimant in [n[2], n[4]] {
        let hears = out.iter().any(|Command::Send { to, msg }| {
            *to == claimant
                && match msg {
                    ControlMsg::Home {
                        shard: 4,
                        owner,
                        generation,
                        ..
                    } => (*owner, *generation) == (h.owner, h.generation),
                    ControlMsg::Table { homes, .. } => homes.contains(&(4, h.owner, h.generation)),
                    _ => false,
                }
        });
        assert!(hears, "{claimant} hears {h:?}: {out:?}");
    }
}

#[test]
fn a_higher_home_known_when_a_claim_is_settled_wins_over_the_claim() {
    let n: Vec<UniqueAddress> = (1..=4).map(node).collect();
    let (mut c, t) = a_core_that_lost_shard_4(&n);
    // Both regions were placed by coordinators this one did not see; the
    // higher generation is the shard's home, the other region hears it.
    let out = c.register(t, n[3], &reg(8, vec![(4, n[3], 5)]));
    assert!(out.iter().all(|Command::Send { to, .. }| *to == n[3]));
    let out = c.register(t, n[2], &reg(8, vec![(4, n[2], 1)]));
    assert_eq!(c.home(TYPE, 4), at(n[3], 5));
    assert!(
        out.iter().any(|Command::Send { to, msg }| *to == n[2]
            && matches!(msg, ControlMsg::Table { homes, .. } if homes.contains(&(4, n[3], 5)))),
        "{out:?}"
    );
}

#[test]
fn a_stop_report_above_the_tables_home_gets_that_home_issued_again_above_it() {
    let t0 = Instant::now() + Duration::from_secs(2);
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    for a in &n {
        c.register(t0, *a, &reg(4, vec![]));
    }
    c.get_home(t0, n[1], TYPE, 2, 0);
    let h = c.home(TYPE, 2).expect("allocated");
    // Another coordinator had placed shard 2 on a third node at generation
    // 5, and moved it away: that node reports it stopped. The home here is
    // older than what it holds, so it is issued again above it.
    let other = *n.iter().find(|a| **a != h.owner).expect("another node");
    let out = c.shard_stopped(t0, other, TYPE, 2, 5);
    assert_eq!(c.home(TYPE, 2), at(h.owner, 6));
    assert!(out.contains(&home(other, 2, h.owner, 6)), "{out:?}");
    assert!(out.contains(&home(h.owner, 2, h.owner, 6)), "{out:?}");
}

#[test]
fn a_gone_owners_shards_wait_out_the_margin() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let config = CoordinatorConfig {
        dead_owner_margin: Duration::from_secs(1),
        ..CoordinatorConfig::default()
    };
    let mut c = founder(n[0], config, t0);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    for a in &n {
        c.register(t0, *a, &reg(3, vec![]));
    }
    for shard in 0..3 {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    assert_eq!(c.home(TYPE, 2).unwrap().owner, n[2]);
    // Node 3 is downed: its shard keeps its home for the margin (a region
    // asking meanwhile waits), then moves as a dead-owner move.
    c.set_membership(t0, &view(n[0], &n[..2], &n[2..], &[]));
    assert_eq!(c.home(TYPE, 2).unwrap().owner, n[2]);
    assert!(c.get_home(t0, n[1], TYPE, 2, 1).is_empty());
    c.tick(t0 + Duration::from_millis(900));
    assert_eq!(c.home(TYPE, 2).unwrap().owner, n[2]);
    let out = c.tick(t0 + Duration::from_secs(1));
    let moved = c.home(TYPE, 2).unwrap();
    assert_ne!(moved.owner, n[2]);
    assert!(out.contains(&home(n[1], 2, moved.owner, 2)), "{out:?}");
    assert_eq!(
        c.rounds().last().unwrap().reason,
        RebalanceReason::DeadOwner
    );
}

/// A view of `up` (Up), `down` (Down) and `exiting` (Exiting) members.
fn view_with_exiting(
    me: UniqueAddress,
    up: &[UniqueAddress],
    down: &[UniqueAddress],
    exiting: &[UniqueAddress],
) -> MembershipState {
    let all: Vec<UniqueAddress> = up.iter().chain(exiting).copied().collect();
    let mut state = view(me, &all, down, &[]);
    for m in &mut state.members {
        if exiting.contains(&m.address) {
            m.status = MemberStatus::Exiting;
        }
    }
    state
}

/// A core with a 1 s margin and 0.1 s per ring cascade step, one watcher
/// per member, the `n` registered and `shards` shards placed at `t0`.
/// A core that founded the cluster: its first view had it alone (a core
/// whose first view has other members knows nothing of their past and
/// keeps a margin before it allocates).
fn founder(me: UniqueAddress, config: CoordinatorConfig, t0: Instant) -> CoordinatorCore {
    let mut c = CoordinatorCore::new(me, config, Box::new(LeastShardAllocation));
    c.set_membership(t0, &view(me, &[me], &[], &[]));
    c
}

fn margin_core(
    t0: Instant,
    n: &[UniqueAddress],
    exiting: &[UniqueAddress],
    shards: u32,
) -> CoordinatorCore {
    let config = CoordinatorConfig {
        dead_owner_margin: Duration::from_secs(1),
        margin_per_ring_step: Duration::from_millis(100),
        ring_watchers: 1,
        ..CoordinatorConfig::default()
    };
    let mut c = founder(n[0], config, t0);
    let up: Vec<UniqueAddress> = n.iter().filter(|a| !exiting.contains(a)).copied().collect();
    c.set_membership(t0, &view_with_exiting(n[0], &up, &[], exiting));
    for a in n {
        c.register(t0, *a, &reg(shards, vec![]));
    }
    for shard in 0..shards {
        c.get_home(t0, n[0], TYPE, shard, 0);
    }
    c
}

/// Ticks `c` 1 ms before `at` (the shard still on `owner`), then at `at`
/// (moved off it).
fn moves_off_at(c: &mut CoordinatorCore, shard: u32, owner: UniqueAddress, at: Instant) {
    c.tick(at - Duration::from_millis(1));
    assert_eq!(c.home(TYPE, shard).unwrap().owner, owner, "before {at:?}");
    c.tick(at);
    assert_ne!(c.home(TYPE, shard).unwrap().owner, owner, "at {at:?}");
}

fn shard_on(c: &CoordinatorCore, owner: UniqueAddress, shards: u32) -> u32 {
    (0..shards)
        .find(|s| c.home(TYPE, *s).is_some_and(|h| h.owner == owner))
        .expect("a shard on that node")
}

#[test]
fn the_margin_counts_the_ring_from_before_the_loss_exiting_members_included() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=5).map(node).collect();
    let mut c = margin_core(t0, &n, &n[3..4], 5);
    let shard = shard_on(&c, n[4], 5);
    // Node 5 is downed while node 4 is Exiting. The losing side's ring
    // still held node 5 (and node 4): 5 members, 4 cascade steps, so the
    // margin is 1 s + 2 × 4 × 0.1 s — though this side's ring is 4 now,
    // and node 5 soon Removed.
    c.set_membership(t0, &view_with_exiting(n[0], &n[..3], &n[4..], &n[3..4]));
    c.tick(t0 + Duration::from_millis(500));
    c.set_membership(
        t0 + Duration::from_millis(500),
        &view_with_exiting(n[0], &n[..3], &[], &n[3..4]),
    );
    moves_off_at(&mut c, shard, n[4], t0 + Duration::from_millis(1_800));
}

#[test]
fn the_margins_ring_shrinks_back_once_no_loss_can_wait_on_the_larger_one() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=4).map(node).collect();
    let mut c = margin_core(t0, &n, &[], 4);
    let (fourth, third) = (shard_on(&c, n[3], 4), shard_on(&c, n[2], 4));
    // Long after the last view, node 4 is downed: the ring before it was
    // 4 members (3 steps), so its shard waits 1.6 s.
    let t1 = t0 + Duration::from_secs(100);
    c.set_membership(t1, &view(n[0], &n[..3], &n[3..], &[]));
    moves_off_at(&mut c, fourth, n[3], t1 + Duration::from_millis(1_600));
    // Long after that, node 3 is downed: the ring before it was 3 (2
    // steps), not the 4 of a loss long settled, so its shard waits 1.4 s.
    let t2 = t0 + Duration::from_secs(200);
    c.set_membership(t2, &view(n[0], &n[..2], &n[2..3], &[]));
    moves_off_at(&mut c, third, n[2], t2 + Duration::from_millis(1_400));
}

#[test]
fn a_second_loss_within_the_first_ones_window_keeps_its_own_ring() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=5).map(node).collect();
    let mut c = margin_core(t0, &n, &[], 5);
    let fourth = shard_on(&c, n[3], 5);
    // Node 5 is lost (ring 5: its views count for 0.8 s of hold plus 1.8 s
    // of margin), then node 4 late in that window: node 4's loss must wait
    // the margin of the ring that held it, 4 members (1.6 s), even after
    // the first window is over.
    c.set_membership(t0, &view(n[0], &n[..4], &n[4..], &[]));
    c.set_membership(
        t0 + Duration::from_millis(100),
        &view(n[0], &n[..4], &[], &[]),
    );
    let t1 = t0 + Duration::from_millis(2_500);
    c.set_membership(t1, &view(n[0], &n[..3], &n[3..4], &[]));
    c.set_membership(
        t1 + Duration::from_millis(200),
        &view(n[0], &n[..3], &[], &[]),
    );
    moves_off_at(&mut c, fourth, n[3], t1 + Duration::from_millis(1_600));
}

// ---- fencing by epoch (SPEC §13.15) ----

fn epochs_in(out: &[Command]) -> Vec<u64> {
    out.iter()
        .filter_map(|Command::Send { msg, .. }| msg.coordinator_epoch())
        .collect()
}

#[test]
fn every_term_takes_an_epoch_above_all_it_has_seen_and_stamps_it() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let mut c = core(n[0]);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    let mut out = Vec::new();
    for a in &n {
        out.extend(c.register(t0, *a, &reg(4, vec![])));
    }
    out.extend(c.get_home(t0, n[1], TYPE, 0, 0));
    assert!(!out.is_empty());
    assert!(
        epochs_in(&out).iter().all(|e| *e == 1),
        "first term: {out:?}"
    );
    // Node 1 is unreachable a while; node 2 coordinates (this core is
    // inactive) and a region registers with the epoch it accepted there.
    c.set_membership(t0, &view(n[0], &n, &[], &n[..1]));
    assert!(!c.is_active());
    c.observe_epoch(5);
    assert_eq!(c.highest_epoch(), 5);
    // Back in charge: above every epoch seen, on every message.
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    let out = c.register(t0, n[1], &reg(4, vec![]));
    assert_eq!(epochs_in(&out), vec![6], "{out:?}");
    // A region that heard an even later coordinator meanwhile: the active
    // core moves above it, so that region accepts it again.
    let mut out = Vec::new();
    c.observe_epoch(9);
    out.extend(c.register(t0, n[2], &reg(4, vec![])));
    assert!(epochs_in(&out).iter().all(|e| *e == 10), "{out:?}");
    // Registrations that carry the core's own epoch do not move it.
    c.observe_epoch(10);
    assert_eq!(c.highest_epoch(), 10);
}

#[test]
fn a_node_ignores_coordinator_messages_from_an_older_epoch() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=2).map(node).collect();
    let mut region = core(n[1]);
    let home_at = |epoch| ControlMsg::Home {
        type_name: TYPE.into(),
        shard: 0,
        owner: n[0],
        generation: 1,
        epoch,
        from: None,
    };
    assert!(region.accept_epoch(&home_at(3)));
    assert_eq!(region.highest_epoch(), 3);
    assert!(region.accept_epoch(&home_at(3)), "the same term again");
    assert!(!region.accept_epoch(&home_at(2)), "an older term is fenced");
    let handoff = ControlMsg::HandOff {
        type_name: TYPE.into(),
        shard: 0,
        generation: 1,
        epoch: 2,
    };
    assert!(!region.accept_epoch(&handoff), "so is its handoff");
    // Messages regions send carry no epoch and always pass.
    let get_home = ControlMsg::GetHome {
        type_name: TYPE.into(),
        shard: 0,
        generation: 0,
    };
    assert!(region.accept_epoch(&get_home));
    // Becoming coordinator itself: above everything accepted.
    region.set_membership(t0, &view(n[1], &n[1..], &n[..1], &[]));
    assert!(region.is_active());
    assert_eq!(region.highest_epoch(), 4);
}

#[test]
fn with_a_resolver_the_role_stays_with_an_oldest_member_beyond_a_partition() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let hold_for = Duration::from_secs(4);
    let config = CoordinatorConfig {
        hold_through_unreachability: true,
        hold_for,
        ..CoordinatorConfig::default()
    };
    let cut_off = split_view(n[1], &n, &n[..1]);
    let mut plain = core(n[1]);
    assert_eq!(
        plain.acting(t0, &cut_off),
        Some(n[1]),
        "timeout downing: moves"
    );
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    assert_eq!(c.acting(t0, &cut_off), Some(n[0]), "resolver: stays");
    let later = t0 + hold_for * 3;
    assert_eq!(
        c.acting(later, &cut_off),
        Some(n[0]),
        "beyond the side: for good"
    );
    let downed = view(n[1], &n[1..], &n[..1], &[]);
    assert_eq!(c.acting(later, &downed), Some(n[1]), "moves once downed");
    // Flagged but on this side (one bad link that a third member bridges,
    // or a partition whose members are not all flagged yet): the role
    // stays for `hold_for`, then moves, so that the member that cannot
    // hear the oldest reaches a coordinator.
    let bad_link = view(n[1], &n, &[], &n[..2]);
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    assert_eq!(c.acting(t0, &bad_link), Some(n[0]));
    assert!(c.holding());
    assert_eq!(
        c.poll_timeout(),
        Some(t0 + hold_for),
        "the driver looks again when the hold runs out"
    );
    assert_eq!(
        c.acting(t0 + hold_for - Duration::from_millis(1), &bad_link),
        Some(n[0])
    );
    assert_eq!(c.acting(t0 + hold_for, &bad_link), Some(n[2]));
    assert_eq!(c.poll_timeout(), None, "no deadline left behind");
    // Beyond the side, only a view ends the hold: no deadline.
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    c.acting(t0, &cut_off);
    assert_eq!(c.poll_timeout(), None);
    // So a core on the side without the oldest stays inactive meanwhile.
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    c.set_membership(t0, &cut_off);
    assert!(!c.is_active());
    c.set_membership(t0, &downed);
    assert!(c.is_active());
}

#[test]
fn the_hold_grows_with_the_ring_cascade() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let hold_for = Duration::from_secs(4);
    let step = Duration::from_secs(1);
    let margin_step = Duration::from_millis(100);
    // One watcher per member: 3 live members are 2 cascade steps, so the
    // hold is 4 s + 2 × (1 s + 2 × 0.1 s).
    let config = CoordinatorConfig {
        hold_through_unreachability: true,
        hold_for,
        detection_step: step,
        margin_per_ring_step: margin_step,
        ring_watchers: 1,
        ..CoordinatorConfig::default()
    };
    // A Down member is not in the resolver's ring: it adds no step.
    let gone = node(9);
    let bad_link = view(n[1], &n, &[gone], &n[..2]);
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    assert_eq!(c.acting(t0, &bad_link), Some(n[0]));
    let held = hold_for + (step + margin_step * 2) * 2;
    assert_eq!(
        c.acting(t0 + held - Duration::from_millis(1), &bad_link),
        Some(n[0])
    );
    assert_eq!(c.acting(t0 + held, &bad_link), Some(n[2]));
}

#[test]
fn a_takeover_from_a_downed_coordinator_allocates_nothing_within_the_margin() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let margin = Duration::from_millis(1_400);
    let config = CoordinatorConfig {
        dead_owner_margin: margin,
        hold_through_unreachability: true,
        ..CoordinatorConfig::default()
    };
    // Node 1 (the coordinator, beyond a partition) is downed; node 2 takes
    // over and knows no home of shard 0 (node 1's side may have placed it).
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    c.set_membership(t0, &split_view(n[1], &n, &n[..1]));
    assert!(!c.is_active(), "node 1 holds the role beyond the partition");
    c.set_membership(t0, &view(n[1], &n[1..], &n[..1], &[]));
    assert!(c.is_active());
    for a in &n[1..] {
        c.register(t0, *a, &reg(4, vec![]));
    }
    assert!(
        c.get_home(t0, n[2], TYPE, 0, 0).is_empty(),
        "within the margin: waits"
    );
    assert!(c.tick(t0 + margin - Duration::from_millis(1)).is_empty());
    let out = c.tick(t0 + margin);
    assert!(
        tells_home(&out, 0),
        "allocated once the margin is over: {out:?}"
    );
    // A coordinator that stays in charge has placed everything there is:
    // a member downed starts no quiet period.
    let mut c = founder(n[0], config, t0);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    for a in &n {
        c.register(t0, *a, &reg(4, vec![]));
    }
    c.set_membership(t0, &view(n[0], &n[..2], &n[2..], &[]));
    assert!(
        !c.get_home(t0, n[1], TYPE, 0, 0).is_empty(),
        "allocated at once"
    );
    // Nor does a takeover after the old coordinator's graceful leave (the
    // role moves when it is Leaving; it handed its shards off, and its
    // stopped system unregistered: the settle does not wait for it).
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    c.set_membership(t0, &view(n[1], &n, &[], &[]));
    c.register(t0, n[0], &reg(4, vec![]));
    c.unregister(t0, n[0], &[TYPE.to_owned()]);
    // (Its last table said it was not quiet.)
    c.heard_table(t0, n[0], Some(Duration::ZERO));
    let mut leaving = view(n[1], &n, &[], &[]);
    leaving.members[0].status = MemberStatus::Leaving;
    leaving.coordinator = Some(n[1]);
    c.set_membership(t0, &leaving);
    assert!(c.is_active());
    for a in &n[1..] {
        c.register(t0, *a, &reg(4, vec![]));
    }
    assert!(
        !c.is_settling(),
        "a leaver that unregistered is not waited for"
    );
    assert!(
        !c.get_home(t0, n[2], TYPE, 1, 0).is_empty(),
        "allocated at once"
    );
}

/// A member downed within the margin may still act as the coordinator of
/// its own side until it hears it is down (as the oldest Up member of its
/// view it holds the role there): whichever core takes over next — from a
/// successor that left gracefully in between, or with no predecessor in
/// its first view — allocates nothing until a margin after it saw that
/// member down.
#[test]
fn regression_a_takeover_allocates_nothing_within_the_margin_of_a_member_downed_before_it() {
    let t0 = Instant::now();
    let margin = Duration::from_millis(1_400);
    let n: Vec<UniqueAddress> = (1..=4).map(node).collect();
    let config = CoordinatorConfig {
        dead_owner_margin: margin,
        hold_through_unreachability: true,
        ..CoordinatorConfig::default()
    };
    // `c` became active at `now`; a member it saw downed at `downed`.
    let allocates_after_the_margin =
        |mut c: CoordinatorCore, now: Instant, downed: Instant, hosts: &[UniqueAddress]| {
            assert!(c.is_active());
            for a in hosts {
                c.register(now, *a, &reg(4, vec![]));
            }
            assert!(
                c.get_home(now, hosts[0], TYPE, 0, 0).is_empty(),
                "within the margin of the downed member: waits"
            );
            assert!(
                c.tick(downed + margin - Duration::from_millis(1))
                    .is_empty()
            );
            let out = c.tick(downed + margin);
            assert!(
                tells_home(&out, 0),
                "allocated once the margin is over: {out:?}"
            );
        };
    // Node 1 was downed (it may still act on its side); node 2 took over,
    // then left gracefully: node 3 takes over from a leaver.
    let mut c = CoordinatorCore::new(n[2], config, Box::new(LeastShardAllocation));
    c.set_membership(t0, &view(n[2], &n[1..], &n[..1], &[]));
    assert!(!c.is_active(), "node 2 acts");
    let t1 = t0 + Duration::from_millis(300);
    // (Node 2's last table said it was not quiet: what holds node 3 back
    // is node 1's down alone.)
    c.heard_table(t0, n[1], Some(Duration::ZERO));
    let mut leaving = view(n[2], &n[1..], &n[..1], &[]);
    leaving.members[1].status = MemberStatus::Leaving;
    leaving.coordinator = Some(n[2]);
    c.set_membership(t1, &leaving);
    c.unregister(t1, n[1], &[TYPE.to_owned()]);
    allocates_after_the_margin(c, t1, t0, &n[2..]);
    // Node 4 joins after node 1 was downed and node 2 left: its first
    // view has node 1 down and itself the coordinator.
    let mut c = CoordinatorCore::new(n[3], config, Box::new(LeastShardAllocation));
    c.set_membership(t1, &view(n[3], &n[3..], &n[..1], &[]));
    allocates_after_the_margin(c, t1, t1, &n[3..]);
}

/// What a core knows of its predecessor's quiet period: a leaver hands
/// over what its last table said (quiet or not); a takeover from a leaver
/// whose table never came keeps a margin; a first view among other
/// members keeps what their registrations say; a member downed and then
/// removed from the view (as the leader does soon after) still counts for
/// a margin after it was seen down.
#[test]
fn a_takeover_keeps_what_it_knows_of_its_predecessors_quiet_and_a_margin_for_what_it_does_not() {
    let t0 = Instant::now();
    let margin = Duration::from_millis(1_400);
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let config = CoordinatorConfig {
        dead_owner_margin: margin,
        ..CoordinatorConfig::default()
    };
    let leaving = |me| {
        let mut v = view(me, &n, &[], &[]);
        v.members[0].status = MemberStatus::Leaving;
        v.coordinator = Some(n[1]);
        v
    };
    // Node 2 takes over from node 1's graceful leave at t0.
    let takeover = |heard: Option<Option<Duration>>| {
        let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
        c.set_membership(t0, &view(n[1], &n, &[], &[]));
        if let Some(left) = heard {
            c.heard_table(t0, n[0], left);
        }
        c.register(t0, n[0], &reg(4, vec![]));
        c.unregister(t0, n[0], &[TYPE.to_owned()]);
        c.set_membership(t0, &leaving(n[1]));
        for a in &n[1..] {
            c.register(t0, *a, &reg(4, vec![]));
        }
        c
    };
    let allocates_at = |mut c: CoordinatorCore, at: Instant| {
        assert!(c.is_active());
        if at > t0 {
            assert!(c.get_home(t0, n[2], TYPE, 0, 0).is_empty(), "quiet");
            assert!(c.tick(at - Duration::from_millis(1)).is_empty());
        }
        let out = c.tick(at);
        let out = if tells_home(&out, 0) {
            out
        } else {
            c.get_home(at, n[2], TYPE, 0, 0)
        };
        assert!(tells_home(&out, 0), "allocates at {:?}: {out:?}", at - t0);
    };
    // Its last table said it was not quiet: at once.
    allocates_at(takeover(Some(Some(Duration::ZERO))), t0);
    // It said it was quiet for 500 ms more: that long.
    let left = Duration::from_millis(500);
    allocates_at(takeover(Some(Some(left))), t0 + left);
    // More than a margin: a margin (a node's word is bounded).
    allocates_at(takeover(Some(Some(Duration::MAX))), t0 + margin);
    // No table from it, or one of an older build (no word on it): a margin.
    allocates_at(takeover(None), t0 + margin);
    allocates_at(takeover(Some(None)), t0 + margin);
    // A first view with other members (a system started after its node
    // joined): what the members' registrations say — nothing, then a
    // quiet period one of them knows of.
    for quiet in [None, Some(Duration::from_millis(700))] {
        let mut c = CoordinatorCore::new(n[0], config, Box::new(LeastShardAllocation));
        c.set_membership(t0, &view(n[0], &n, &[], &[]));
        for a in &n {
            if let (Some(left), true) = (quiet, *a == n[1]) {
                c.registrant_quiet(t0, left);
            }
            c.register(t0, *a, &reg(4, vec![]));
        }
        allocates_at(c, t0 + quiet.unwrap_or_default());
    }
    // A core long in charge is not held back by what a registration says.
    let mut c = founder(n[0], config, t0);
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    for a in &n {
        c.register(t0, *a, &reg(4, vec![]));
    }
    c.registrant_quiet(t0, margin);
    allocates_at(c, t0);
    // Node 3 is downed at t0 and removed 200 ms later; node 1 leaves at
    // t1, its last table saying it was not quiet: node 2 still waits a
    // margin from t0.
    let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
    c.set_membership(t0, &view(n[1], &n, &[], &[]));
    c.set_membership(t0, &view(n[1], &n[..2], &n[2..], &[]));
    let t1 = t0 + Duration::from_millis(200);
    c.set_membership(t1, &view(n[1], &n[..2], &[], &[]));
    c.heard_table(t0, n[0], Some(Duration::ZERO));
    c.register(t1, n[0], &reg(4, vec![]));
    c.unregister(t1, n[0], &[TYPE.to_owned()]);
    let mut leaving = view(n[1], &n[..2], &[], &[]);
    leaving.members[0].status = MemberStatus::Leaving;
    leaving.coordinator = Some(n[1]);
    c.set_membership(t1, &leaving);
    c.register(t1, n[1], &reg(4, vec![]));
    assert!(c.is_active());
    assert!(c.get_home(t1, n[1], TYPE, 0, 0).is_empty(), "quiet");
    assert!(c.tick(t0 + margin - Duration::from_millis(1)).is_empty());
    assert!(tells_home(&c.tick(t0 + margin), 0));
}

#[test]
fn a_takeover_moves_the_old_coordinators_shards_one_margin_after_its_down() {
    let t0 = Instant::now();
    let m = Duration::from_millis(1_400);
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let config = CoordinatorConfig {
        dead_owner_margin: m,
        hold_through_unreachability: true,
        ..CoordinatorConfig::default()
    };
    // The driver seeds the table from this node's replica before the
    // takeover: shard 0 lives on the old coordinator, shard 1 on node 3.
    // Node 1 is downed: node 2 takes over at that view (t1).
    let t1 = t0 + Duration::from_millis(500);
    let taken_over = || {
        let mut c = CoordinatorCore::new(n[1], config, Box::new(LeastShardAllocation));
        c.set_membership(t0, &split_view(n[1], &n, &n[..1]));
        assert!(
            !c.is_active(),
            "node 1 holds the role while only unreachable"
        );
        let home = |owner| ShardHome {
            owner,
            generation: 1,
        };
        c.seed(&reg(4, vec![])[0], &[(0, home(n[0])), (1, home(n[2]))]);
        c.set_membership(t1, &view(n[1], &n[1..], &n[..1], &[]));
        assert!(c.is_active());
        for a in &n[1..] {
            c.register(t1, *a, &reg(4, vec![(1, n[2], 1)]));
        }
        c
    };
    let mut c = taken_over();
    // The old coordinator's shard moves one margin after its Down (once the
    // quiet period ends), not a margin after that; a fresh shard is placed
    // at the same instant.
    moves_off_at(&mut c, 0, n[0], t1 + m);
    assert!(tells_home(&c.get_home(t1 + m, n[2], TYPE, 2, 0), 2));
    // A member downed during the quiet period: its shards move one margin
    // after its own Down.
    let mut c = taken_over();
    let t2 = t1 + Duration::from_millis(500);
    c.set_membership(t2, &view(n[1], &n[1..2], &[n[0], n[2]], &[]));
    moves_off_at(&mut c, 1, n[2], t2 + m);
}

/// Node 3's leaving region reports shard 6 stopped to coordinator 3, then
/// node 1 joins and takes over: the regions re-register with it, but the
/// repeated stop report reached it while it was still a standby core,
/// which drops it. Node 3 still waits for the shard's next home, so it
/// repeats the report to the active coordinator, which allocates the shard
/// as a GracefulLeave move of one. (Without that repeat, the new core
/// started the leave's handoff afresh and timed it out as a dead-owner
/// move from live node 3.)
#[test]
fn regression_a_stop_report_repeated_to_a_coordinator_that_took_over() {
    use Op::*;
    let ops = vec![
        Join(3),
        Join(5),
        Register(3),
        Advance(10881),
        Ask(3, 6),
        Unreachable(0),
        Join(2),
        Leave(3),
        Register(5),
        Crash(2),
        Stopped(3),
        Join(1),
        Advance(11273),
        Advance(12991),
    ];
    let config = CoordinatorConfig {
        dead_owner_margin: Duration::from_millis(700),
        ..CoordinatorConfig::default()
    };
    assert_eq!(check_history_with(ops, config), Ok(()));
}

#[test]
fn a_region_routing_a_shard_to_a_stopped_region_is_given_its_home_when_it_registers() {
    let (mut c, t0, n) = settled(3, 4);
    c.get_home(t0, n[2], TYPE, 1, 0);
    assert_eq!(
        c.home(TYPE, 1),
        Some(ShardHome {
            owner: n[0],
            generation: 1
        })
    );
    // Region 3 stops; region 1 stops and the shard moves to region 2 ...
    c.unregister(t0, n[2], &[TYPE.to_owned()]);
    c.unregister(t0, n[0], &[TYPE.to_owned()]);
    assert_eq!(
        c.home(TYPE, 1),
        Some(ShardHome {
            owner: n[1],
            generation: 2
        })
    );
    // ... which stops too: the shard has nowhere to go, and no home.
    c.unregister(t0, n[1], &[TYPE.to_owned()]);
    assert_eq!(c.home(TYPE, 1), None);
    // Region 3 comes back still routing shard 1 to region 1, under the
    // first generation: it would forward there and be refused, and never
    // ask. It is given the shard's home at once, as its `GetHome` would be.
    let out = c.register(t0, n[2], &reg(4, vec![(1, n[0], 1)]));
    assert!(out.contains(&home(n[2], 1, n[2], 3)), "{out:?}");
    assert_eq!(c.home(TYPE, 1).map(|h| h.owner), Some(n[2]));
    // Left with no home under the generation the route names (the shard
    // never moved on): the route is taken back into the table by the merge,
    // and still answered — here by a wait, until a region can host.
    let (mut c, t0, n) = settled(3, 4);
    c.get_home(t0, n[2], TYPE, 1, 0);
    c.unregister(t0, n[1], &[TYPE.to_owned()]);
    c.unregister(t0, n[2], &[TYPE.to_owned()]);
    c.unregister(t0, n[0], &[TYPE.to_owned()]);
    assert_eq!(c.home(TYPE, 1), None);
    let mut proxy = reg(4, vec![(1, n[0], 1)]);
    proxy[0].proxy = true;
    let out = c.register(t0, n[2], &proxy);
    assert!(!tells_home(&out, 1), "nowhere to place it yet: {out:?}");
    let out = c.register(t0, n[1], &reg(4, vec![]));
    assert!(out.contains(&home(n[2], 1, n[1], 2)), "{out:?}");
    // A route to a region that did not stop is left alone: the coordinator
    // does not place a shard it does not know is free.
    let (mut c, t0, n) = settled(3, 4);
    let out = c.register(t0, n[1], &reg(4, vec![(2, n[2], 1)]));
    assert!(!tells_home(&out, 2), "{out:?}");
}

/// Found by the cluster simulator: the coordinator crashed, and its
/// successor could not reach node 3, which hosted shard 0 (placed by the
/// crashed coordinator) and whose own messages still came through. The
/// successor settled without waiting for node 3's registration, placed
/// shard 0 on itself under generation 1, and two nodes hosted it under
/// one generation. The settle waits for every member that may host,
/// reachable or not.
#[test]
fn regression_a_takeover_waits_for_an_unreachable_owner_before_it_allocates() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let mut c = core(n[1]);
    c.set_membership(t0, &view(n[1], &n[1..], &n[..1], &n[2..]));
    assert!(c.is_active(), "node 2 takes over from the downed node 1");
    c.register(t0, n[1], &reg(4, vec![]));
    assert!(c.is_settling(), "node 3 may host: it is waited for");
    assert!(
        c.get_home(t0, n[1], TYPE, 0, 0).is_empty(),
        "nothing is allocated before node 3 registers"
    );
    // Node 3's registration comes through: shard 0 stays with it, and the
    // asker hears that home.
    let out = c.register(t0, n[2], &reg(4, vec![(0, n[2], 1)]));
    assert!(!c.is_settling());
    assert_eq!(
        c.home(TYPE, 0).map(|h| (h.owner, h.generation)),
        Some((n[2], 1))
    );
    assert!(out.contains(&home(n[1], 0, n[2], 1)), "{out:?}");
    // A joining member hosts nothing: it is not waited for.
    let mut c = core(n[1]);
    let mut state = view(n[1], &n[1..], &n[..1], &[]);
    state
        .members
        .iter_mut()
        .find(|m| m.address == n[2])
        .expect("a member")
        .status = MemberStatus::Joining;
    c.set_membership(t0, &state);
    c.register(t0, n[1], &reg(4, vec![]));
    assert!(!c.is_settling(), "a joining member is not waited for");
}

/// Found by the cluster simulator: node 1 left and was removed while its
/// successor was still settling; a node that joined then registered and
/// was sent a table that still placed shard 0 on node 1, a node it never
/// knew, and sent an ask there. A table names homes on live members only.
#[test]
fn regression_a_table_names_no_home_on_a_member_gone_from_the_view() {
    let t0 = Instant::now();
    let n: Vec<UniqueAddress> = (1..=3).map(node).collect();
    let mut c = core(n[1]);
    c.set_membership(t0, &view(n[1], &n[..2], &[], &[]));
    c.register(t0, n[0], &reg(4, vec![(0, n[0], 1)]));
    c.register(t0, n[1], &reg(4, vec![(0, n[0], 1)]));
    // Node 1 is gone from the view (it left and was removed); node 3
    // joined.
    c.set_membership(t0, &view(n[1], &n[1..], &[], &[]));
    assert!(c.is_active());
    let out = c.register(t0, n[2], &reg(4, vec![]));
    let tables: Vec<_> = out
        .iter()
        .filter_map(|cmd| match cmd {
            Command::Send {
                to,
                msg: ControlMsg::Table { homes, .. },
            } if *to == n[2] => Some(homes.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(tables.len(), 1, "{out:?}");
    assert!(
        tables[0].iter().all(|(_, owner, _)| *owner != n[0]),
        "a home on the departed node 1: {tables:?}"
    );
}

#[path = "by_traffic_tests.rs"]
mod by_traffic;

/// Node 0 begins to leave; its two handoffs time out and its shards are
/// placed anew as dead-owner moves, in the step in which a traffic round
/// would move one of them again (shard 10 talks to shard 4, on node 1).
/// Shards placed in a step settle for a round before traffic moves them.
#[test]
fn regression_shards_placed_anew_are_not_moved_for_traffic_in_the_same_step() {
    use Op::*;
    let ops = vec![
        Join(1),
        Register(0),
        Ask(0, 2),
        Ask(0, 10),
        Advance(10051),
        Register(1),
        Leave(0),
        Register(0),
        Ask(1, 4),
        Advance(11100),
    ];
    assert_eq!(check_history_placing_by_traffic(ops), Ok(()));
}
