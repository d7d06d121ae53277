//! Membership tests: single-handler command lists, cluster stories on the
//! simulated network, and random-history properties.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::sim::Sim;
use super::*;
use crate::identity::{NodeId, UniqueAddress};

const MS: Duration = Duration::from_millis(1);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn ua(port: u16, id: u64, incarnation: u64) -> UniqueAddress {
    UniqueAddress {
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        node_id: NodeId(id),
        incarnation,
    }
}

/// A simulated cluster of `n` nodes, all joined through node 0 and Up
/// everywhere.
fn cluster(n: usize, seed: u64, config: MembershipConfig) -> Sim {
    let mut sim = Sim::new(seed, config);
    for i in 0..n {
        let slot = sim.add_node();
        sim.join(slot, &[0]);
        // Start the nodes a few ms apart so their ages differ by incarnation.
        sim.run_for(ms(5));
        assert_eq!(slot, i);
    }
    for i in 0..n {
        let id = sim.id(i);
        sim.expect_all_see(id, MemberStatus::Up, ms(2_000));
    }
    sim.expect_converged(ms(1_000));
    sim.expect_no_errors();
    sim
}

fn publishes(cmds: &[Command]) -> Vec<MembershipEvent> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Publish(e) => Some(e.clone()),
            _ => None,
        })
        .collect()
}

// ---- single handlers, exact command lists --------------------------------

#[test]
fn lone_seed_forms_a_cluster_and_becomes_up_and_coordinator() {
    let now = Instant::now();
    let me = ua(7000, 1, 10);
    let mut core = MembershipCore::new(me, MembershipConfig::default(), now).unwrap();
    core.join(now, &[me.addr]).unwrap();
    assert_eq!(
        core.drain_commands(),
        vec![
            Command::Publish(MembershipEvent::MemberJoined(me)),
            Command::Publish(MembershipEvent::MemberUp(me)),
            Command::Publish(MembershipEvent::CoordinatorChanged(Some(me))),
        ]
    );
    assert_eq!(core.self_status(), Some(MemberStatus::Up));
    let st = core.state();
    assert_eq!(st.leader, Some(me));
    assert!(st.is_placement_coordinator(NodeId(1)));
    assert!(!st.is_placement_coordinator(NodeId(2)));
}

#[test]
fn a_non_first_seed_only_asks_and_retries() {
    let now = Instant::now();
    let me = ua(7001, 2, 10);
    let seed: SocketAddr = "127.0.0.1:7000".parse().unwrap();
    let mut core = MembershipCore::new(me, MembershipConfig::default(), now).unwrap();
    core.join(now, &[seed, me.addr]).unwrap();
    let join = Command::Send {
        to: Target::Seed(seed),
        msg: MembershipMsg::Join,
    };
    assert_eq!(core.drain_commands(), vec![join.clone()]);
    assert_eq!(core.poll_timeout(), Some(now + ms(250)));
    core.handle_timeout(now + ms(249)).unwrap();
    assert_eq!(core.drain_commands(), vec![]);
    core.handle_timeout(now + ms(250)).unwrap();
    assert_eq!(core.drain_commands(), vec![join]);
    // Never forms a cluster by itself, however long it waits.
    core.handle_timeout(now + ms(60_000)).unwrap();
    assert_eq!(core.self_status(), None);
}

#[test]
fn the_first_seed_forms_a_cluster_after_the_seed_timeout() {
    let now = Instant::now();
    let me = ua(7000, 1, 10);
    let other: SocketAddr = "127.0.0.1:7001".parse().unwrap();
    let mut core = MembershipCore::new(me, MembershipConfig::default(), now).unwrap();
    core.join(now, &[me.addr, other]).unwrap();
    assert_eq!(
        core.drain_commands(),
        vec![Command::Send {
            to: Target::Seed(other),
            msg: MembershipMsg::Join
        }]
    );
    core.handle_timeout(now + ms(499)).unwrap();
    assert_eq!(core.self_status(), None);
    core.handle_timeout(now + ms(500)).unwrap();
    assert_eq!(core.self_status(), Some(MemberStatus::Up));
}

#[test]
fn a_join_is_admitted_as_joining_and_welcomed() {
    let now = Instant::now();
    let a = ua(7000, 1, 10);
    let b = ua(7001, 2, 11);
    let mut core = MembershipCore::new(a, MembershipConfig::default(), now).unwrap();
    core.join(now, &[a.addr]).unwrap();
    core.drain_commands();
    core.handle_message(now, b, MembershipMsg::Join).unwrap();
    let g = core.gossip().clone();
    assert_eq!(g.status_of(&b), Some(MemberStatus::Joining));
    assert_eq!(
        core.drain_commands(),
        vec![
            Command::Publish(MembershipEvent::MemberJoined(b)),
            Command::Send {
                to: Target::Member(b),
                msg: MembershipMsg::Gossip { gossip: g.clone() }
            },
            Command::Send {
                to: Target::Member(b),
                msg: MembershipMsg::Welcome { gossip: g }
            },
        ]
    );
    // Not Up before b has reported the state (convergence).
    assert_eq!(core.gossip().status_of(&b), Some(MemberStatus::Joining));
    let digest = core.gossip().digest();
    core.handle_message(now + MS, b, MembershipMsg::Heartbeat { digest })
        .unwrap();
    assert_eq!(core.gossip().status_of(&b), Some(MemberStatus::Up));
    let g = core.gossip().clone();
    assert_eq!(
        core.drain_commands(),
        vec![
            Command::Publish(MembershipEvent::MemberUp(b)),
            Command::Send {
                to: Target::Member(b),
                msg: MembershipMsg::Gossip { gossip: g }
            },
        ]
    );
}

#[test]
fn a_join_from_a_new_incarnation_downs_the_old_one() {
    let now = Instant::now();
    let a = ua(7000, 1, 10);
    let old = ua(7001, 2, 11);
    let new = ua(7001, 3, 50);
    let mut core = MembershipCore::new(a, MembershipConfig::default(), now).unwrap();
    core.join(now, &[a.addr]).unwrap();
    core.handle_message(now, old, MembershipMsg::Join).unwrap();
    core.drain_commands();
    core.handle_message(now + MS, new, MembershipMsg::Join)
        .unwrap();
    assert_eq!(core.gossip().status_of(&old), Some(MemberStatus::Down));
    assert_eq!(core.gossip().status_of(&new), Some(MemberStatus::Joining));
    let cmds = core.drain_commands();
    assert!(cmds.contains(&Command::MarkDown(old)), "{cmds:?}");
    assert!(publishes(&cmds).contains(&MembershipEvent::MemberDowned(old)));
    // An older incarnation asking again is refused: the address has moved on.
    let stale = ua(7001, 4, 5);
    core.handle_message(now + ms(2), stale, MembershipMsg::Join)
        .unwrap();
    assert_eq!(core.gossip().status_of(&stale), None);
    assert_eq!(core.drain_commands(), vec![]);
}

#[test]
fn heartbeat_with_another_digest_is_answered_with_gossip() {
    let now = Instant::now();
    let a = ua(7000, 1, 10);
    let b = ua(7001, 2, 11);
    let mut core = MembershipCore::new(a, MembershipConfig::default(), now).unwrap();
    core.join(now, &[a.addr]).unwrap();
    core.handle_message(now, b, MembershipMsg::Join).unwrap();
    core.drain_commands();
    core.handle_message(now, b, MembershipMsg::Heartbeat { digest: 42 })
        .unwrap();
    let g = core.gossip().clone();
    assert_eq!(
        core.drain_commands(),
        vec![Command::Send {
            to: Target::Member(b),
            msg: MembershipMsg::Gossip { gossip: g }
        }]
    );
    // From an unknown node: ignored.
    core.handle_message(
        now,
        ua(7002, 9, 12),
        MembershipMsg::Heartbeat { digest: 42 },
    )
    .unwrap();
    assert_eq!(core.drain_commands(), vec![]);
}

#[test]
fn a_silent_member_is_unreachable_exactly_at_the_deadline_and_downed_after_the_timeout() {
    let sim = cluster(2, 7, MembershipConfig::default());
    let b = sim.id(1);
    let mut core = sim.core(0).clone();
    core.drain_commands();
    // b's last heartbeat reaches a at `heard`; then silence.
    let heard = sim.now;
    let digest = core.gossip().digest();
    core.handle_message(heard, b, MembershipMsg::Heartbeat { digest })
        .unwrap();
    core.drain_commands();
    assert_eq!(
        core.poll_timeout().map(|t| t <= heard + ms(400)),
        Some(true)
    );
    core.handle_timeout(heard + ms(399)).unwrap();
    assert!(!publishes(&core.drain_commands()).contains(&MembershipEvent::Unreachable(b)));
    core.handle_timeout(heard + ms(400)).unwrap();
    let cmds = core.drain_commands();
    assert!(
        publishes(&cmds).contains(&MembershipEvent::Unreachable(b)),
        "{cmds:?}"
    );
    assert_eq!(core.state().unreachable, vec![b]);
    // The leader (a, the oldest) downs it downing_timeout later, not before.
    core.handle_timeout(heard + ms(599)).unwrap();
    assert_eq!(core.gossip().status_of(&b), Some(MemberStatus::Up));
    assert!(core.poll_timeout().is_some_and(|t| t <= heard + ms(600)));
    core.drain_commands();
    core.handle_timeout(heard + ms(600)).unwrap();
    let cmds = core.drain_commands();
    let ev = publishes(&cmds);
    assert!(ev.contains(&MembershipEvent::MemberDowned(b)), "{cmds:?}");
    assert!(cmds.contains(&Command::MarkDown(b)));
    // Two-member cluster: nobody else must see the Down, so it is removed at once.
    assert!(
        ev.contains(&MembershipEvent::MemberRemoved {
            member: b,
            previous: MemberStatus::Down
        }),
        "{cmds:?}"
    );
}
