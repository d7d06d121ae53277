//! Membership tests: single-handler command lists, cluster stories on the
//! simulated network, and random-history properties.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::gossip::MemberKey;
use super::sim::Sim;
use super::*;
use crate::model::identity::{NodeId, UniqueAddress};

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
    // Settle past the first-heartbeat grace: every watcher has heard every
    // member it watches (gossip forms a cluster of a few nodes in a few
    // ms, before the first heartbeat round).
    sim.run_for(ms(1_100));
    sim.expect_converged(ms(1_000));
    sim.expect_no_errors();
    sim
}

/// Drives `core` as an on-time driver would: wakes it at every
/// `poll_timeout()` before `until`, then at `until`. (Jumping straight to
/// `until` is a starved driver, which the detector compensates; see
/// `a_starved_watcher_does_not_flag_the_members_it_watches`.)
fn tick_until(core: &mut MembershipCore, until: Instant) {
    while let Some(t) = core.poll_timeout()
        && t < until
    {
        core.handle_timeout(t).unwrap();
    }
    core.handle_timeout(until).unwrap();
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
fn aligned_ticks_fall_on_the_wall_clocks_grid() {
    let t0 = Instant::now();
    let me = ua(7000, 1, 10);
    // An interval that does not divide a minute: the grid is the epoch's.
    let config = MembershipConfig {
        heartbeat_interval: ms(70),
        ..MembershipConfig::default()
    };
    let mut core = MembershipCore::new(me, config.clone(), t0).unwrap();
    // The wall clock showed 61.005 s past the epoch at t0: heartbeat ticks
    // fall 35 ms past t0 (61.040 s = 872 × 70 ms) and every 70 ms after,
    // gossip rounds 995 ms past t0 and every second after.
    core.align_ticks(t0, Duration::from_millis(61_005));
    core.join(t0, &[me.addr]).unwrap();
    let mut wakes = Vec::new();
    while let Some(t) = core.poll_timeout()
        && t < t0 + Duration::from_secs(3)
    {
        core.handle_timeout(t).unwrap();
        wakes.push(t.duration_since(t0));
    }
    let on = |d: &Duration, every_us: u128| (61_005_000 + d.as_micros()).is_multiple_of(every_us);
    let off_grid: Vec<&Duration> = wakes
        .iter()
        .filter(|d| !on(d, 70_000) && !on(d, 1_000_000))
        .collect();
    // The first wake is the tick due at once after the join.
    assert!(
        off_grid.len() <= 1 && off_grid.iter().all(|d| d.is_zero()),
        "{wakes:?}"
    );
    assert!(
        wakes.contains(&ms(35)) && wakes.contains(&ms(105)),
        "{wakes:?}"
    );
    assert!(
        wakes.contains(&ms(995)) && wakes.contains(&ms(1_995)),
        "{wakes:?}"
    );
    // A lone member wakes for nothing but its ticks: one per 70 ms, and
    // the gossip rounds.
    assert!(
        wakes.len() <= 3_000 / 70 + 4,
        "{} wakes in 3 s: {wakes:?}",
        wakes.len()
    );
}

#[test]
fn a_new_watcher_sends_its_state_and_waits_the_pause_before_counting() {
    // Five members, each watched by 2 (the ring walks forwards by age).
    // Member 3 watches 4 and 0. Once 4 is flagged (by 0, learnt by gossip)
    // it no longer counts, so 3 watches 0 and 1: 1 is new. 3 sends 1 its
    // whole state at once (1 may not know yet that it must heartbeat 3)
    // and flags a silent 1 only after the pause plus the failure timeout.
    let t0 = Instant::now();
    let ids: Vec<UniqueAddress> = (0..5)
        .map(|i| ua(7000 + i, u64::from(i) + 1, 10 + u64::from(i)))
        .collect();
    let config = MembershipConfig {
        monitored_by: 2,
        ..MembershipConfig::default()
    };
    let formed = Gossip::formed_for_tests(&ids);
    let mut core = MembershipCore::formed_for_tests(ids[3], config.clone(), t0, formed.clone());
    let now = t0 + Duration::from_secs(5); // long past the first-heartbeat grace
    for m in [ids[4], ids[0]] {
        core.handle_message(now, m, MembershipMsg::Heartbeat { digest: 0 })
            .unwrap();
    }
    core.drain_commands();
    let mut flagged = formed;
    flagged.observe(MemberKey(ids[0]), MemberKey(ids[4]), true);
    core.handle_message(now, ids[0], MembershipMsg::Gossip { gossip: flagged })
        .unwrap();
    let cmds = core.drain_commands();
    assert!(
        cmds.iter().any(|c| matches!(c,
            Command::Send { to: Target::Member(m), msg: MembershipMsg::Gossip { .. } } if *m == ids[1])),
        "the new watched member gets the whole state: {cmds:?}"
    );
    let flags_1 = |core: &MembershipCore| {
        core.gossip()
            .observes_unreachable(&MemberKey(ids[3]), &MemberKey(ids[1]))
    };
    let deadline = now + config.acceptable_heartbeat_pause + config.failure_timeout();
    // Keep 0 heard, so that only 1 is silent.
    let mut t = now;
    while t + ms(50) < deadline {
        t += ms(50);
        core.handle_message(t, ids[0], MembershipMsg::Heartbeat { digest: 0 })
            .unwrap();
        core.handle_timeout(t).unwrap();
    }
    core.handle_timeout(deadline - MS).unwrap();
    assert!(!flags_1(&core), "flagged before the pause and the timeout");
    core.handle_timeout(deadline).unwrap();
    assert!(
        flags_1(&core),
        "a silent new member is flagged at the deadline"
    );
}

#[test]
fn a_member_that_drops_a_watcher_keeps_heartbeating_it_for_the_grace() {
    // A ring of 4, each member watched by 2: a 5th member joins, and some
    // old member's watchers change. The watcher it dropped is heartbeated
    // for `first_heartbeat_grace`, then no more.
    let config = MembershipConfig {
        monitored_by: 2,
        gossip_fanout: 1,
        ..MembershipConfig::default()
    };
    let mut sim = cluster(4, 7, config.clone());
    let before: Vec<Vec<UniqueAddress>> = (0..4).map(|i| sim.core(i).targets_for_tests()).collect();
    let s = sim.add_node();
    sim.join(s, &[0]);
    let joined = sim.id(s);
    sim.expect_all_see(joined, MemberStatus::Up, ms(2_000));
    let changed: Vec<usize> = (0..4)
        .filter(|i| sim.core(*i).targets_for_tests() != before[*i])
        .collect();
    assert!(!changed.is_empty(), "a join moves some watchers");
    let mut lingered = 0;
    for i in &changed {
        let now_targets = sim.core(*i).targets_for_tests();
        let dropped: Vec<UniqueAddress> = before[*i]
            .iter()
            .filter(|t| !now_targets.contains(t))
            .copied()
            .collect();
        let lingering: Vec<UniqueAddress> = sim
            .core(*i)
            .lingering_for_tests()
            .iter()
            .map(|(m, _)| *m)
            .collect();
        for d in &dropped {
            assert!(
                lingering.contains(d),
                "node {i} dropped {d} without lingering: {lingering:?}"
            );
            lingered += 1;
        }
    }
    assert!(lingered > 0, "some old member dropped a watcher");
    sim.run_for(config.first_heartbeat_grace + config.heartbeat_interval * 2);
    for i in 0..4 {
        assert!(
            sim.core(i).lingering_for_tests().is_empty(),
            "node {i} still lingers: {:?}",
            sim.core(i).lingering_for_tests()
        );
    }
    sim.expect_no_errors();
    sim.reject_event("a false down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
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
fn discovered_seeds_are_asked_as_they_appear_and_only_a_lowest_forms() {
    let now = Instant::now();
    let me = ua(7000, 1, 10);
    let a: SocketAddr = "127.0.0.1:7001".parse().unwrap();
    let b: SocketAddr = "127.0.0.1:7002".parse().unwrap();
    let join = |to| Command::Send {
        to: Target::Seed(to),
        msg: MembershipMsg::Join,
    };
    let mut core = MembershipCore::new(me, MembershipConfig::default(), now).unwrap();
    core.join_discovered(now).unwrap();
    // Nothing discovered yet: nobody asked, never formed alone.
    core.handle_timeout(now + ms(10_000)).unwrap();
    assert_eq!(core.drain_commands(), vec![]);
    assert_eq!(core.self_status(), None);
    // A seed appears: asked at once, and again at every retry.
    let t = now + ms(10_000);
    core.set_seeds(t, &[a, me.addr], false).unwrap();
    assert_eq!(core.drain_commands(), vec![join(a)]);
    // The same set again asks no one early; a new seed is asked at once.
    core.set_seeds(t, &[me.addr, a], false).unwrap();
    assert_eq!(core.drain_commands(), vec![]);
    core.set_seeds(t, &[a, b], false).unwrap();
    assert_eq!(core.drain_commands(), vec![join(a), join(b)]);
    core.handle_timeout(t + ms(60_000)).unwrap();
    assert_eq!(core.self_status(), None, "not the lowest: never forms");
    // Told it may form (the lowest of enough): forms after the seed
    // timeout, counted from then; a set that takes it back stops that.
    let t = t + ms(60_000);
    core.drain_commands();
    core.set_seeds(t, &[me.addr, a], true).unwrap();
    core.set_seeds(t + ms(100), &[me.addr, a], false).unwrap();
    core.handle_timeout(t + ms(600)).unwrap();
    assert_eq!(core.self_status(), None);
    core.set_seeds(t + ms(700), &[me.addr, a], true).unwrap();
    core.handle_timeout(t + ms(1_199)).unwrap();
    assert_eq!(core.self_status(), None);
    core.handle_timeout(t + ms(1_200)).unwrap();
    assert_eq!(core.self_status(), Some(MemberStatus::Up));
    // A member ignores discovery.
    core.set_seeds(t + ms(1_300), &[b], false).unwrap();
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
    // (Not within three heartbeat intervals of the push that told b of its
    // admission: b may well hold that state already.)
    let later = now + ms(500);
    tick_until(&mut core, later);
    core.drain_commands();
    core.handle_message(later, b, MembershipMsg::Heartbeat { digest: 42 })
        .unwrap();
    let g = core.gossip().clone();
    assert_eq!(
        core.drain_commands(),
        vec![Command::Send {
            to: Target::Member(b),
            msg: MembershipMsg::Gossip { gossip: g }
        }]
    );
    // From an unknown node: answered with the state too (it may be a
    // member this node has not heard of yet), but not taken in: it is not
    // in the table, and a state of its that does not list this node is
    // ignored.
    let stranger = ua(7002, 9, 12);
    core.handle_message(later, stranger, MembershipMsg::Heartbeat { digest: 42 })
        .unwrap();
    let g = core.gossip().clone();
    assert_eq!(
        core.drain_commands(),
        vec![Command::Send {
            to: Target::Member(stranger),
            msg: MembershipMsg::Gossip { gossip: g.clone() }
        }]
    );
    let mut theirs = Gossip::default().merge(&g);
    theirs = theirs.merge(&{
        let mut c = MembershipCore::new(stranger, MembershipConfig::default(), now).unwrap();
        c.join(now, &[stranger.addr]).unwrap();
        c.gossip().clone()
    });
    let without_me = {
        let mut c = MembershipCore::new(stranger, MembershipConfig::default(), now).unwrap();
        c.join(now, &[stranger.addr]).unwrap();
        c.gossip().clone()
    };
    core.handle_message(
        later,
        stranger,
        MembershipMsg::Gossip { gossip: without_me },
    )
    .unwrap();
    assert_eq!(core.gossip().status_of(&stranger), None);
    core.handle_message(later, stranger, MembershipMsg::Gossip { gossip: theirs })
        .unwrap();
    assert_eq!(core.gossip().status_of(&stranger), Some(MemberStatus::Up));
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
    tick_until(&mut core, heard + ms(399));
    assert!(!publishes(&core.drain_commands()).contains(&MembershipEvent::Unreachable(b)));
    tick_until(&mut core, heard + ms(400));
    let cmds = core.drain_commands();
    assert!(
        publishes(&cmds).contains(&MembershipEvent::Unreachable(b)),
        "{cmds:?}"
    );
    assert_eq!(core.state().unreachable, vec![b]);
    // The leader (a, the oldest) downs it downing_timeout later, not before.
    tick_until(&mut core, heard + ms(599));
    assert_eq!(core.gossip().status_of(&b), Some(MemberStatus::Up));
    assert!(core.poll_timeout().is_some_and(|t| t <= heard + ms(600)));
    core.drain_commands();
    tick_until(&mut core, heard + ms(600));
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

// ---- cluster stories on the simulated network ------------------------------

fn status_events_for(sim: &Sim, observer: usize, member: UniqueAddress) -> Vec<MembershipEvent> {
    sim.events_of(observer)
        .into_iter()
        .filter(|e| match e {
            MembershipEvent::MemberJoined(m)
            | MembershipEvent::MemberUp(m)
            | MembershipEvent::MemberLeft(m)
            | MembershipEvent::MemberExited(m)
            | MembershipEvent::MemberDowned(m) => *m == member,
            MembershipEvent::MemberRemoved { member: m, .. } => *m == member,
            _ => false,
        })
        .collect()
}

#[test]
fn three_nodes_form_a_cluster_through_a_seed() {
    let sim = cluster(3, 1, MembershipConfig::default());
    let (a, b, c) = (sim.id(0), sim.id(1), sim.id(2));
    // The oldest (first started) is the coordinator everywhere.
    sim.expect_coordinator_everywhere(a);
    for s in 0..3 {
        assert_eq!(sim.core(s).state().members.len(), 3);
        assert!(sim.core(s).state().unreachable.is_empty());
    }
    // c saw everybody come Up, and itself.
    let ev = sim.events_of(2);
    for m in [a, b, c] {
        assert!(ev.contains(&MembershipEvent::MemberUp(m)), "{ev:?}");
    }
    sim.reject_event("unreachable", |l| {
        matches!(l.event, MembershipEvent::Unreachable(_))
    });
}

#[test]
fn a_fourth_node_joins_a_running_cluster() {
    let mut sim = cluster(3, 2, MembershipConfig::default());
    let d = sim.add_node();
    sim.join(d, &[1, 2]);
    let took = sim.expect_all_see(sim.id(d), MemberStatus::Up, ms(2_000));
    assert!(took < ms(500), "join took {took:?}");
    sim.expect_converged(ms(500));
    sim.expect_coordinator_everywhere(sim.id(0));
    assert_eq!(
        status_events_for(&sim, 0, sim.id(d)),
        vec![
            MembershipEvent::MemberJoined(sim.id(d)),
            MembershipEvent::MemberUp(sim.id(d))
        ]
    );
    sim.expect_no_errors();
}

#[test]
fn a_node_leaves_gracefully_and_is_removed_everywhere() {
    let mut sim = cluster(3, 3, MembershipConfig::default());
    let b = sim.id(1);
    sim.leave(1);
    sim.expect_all_see(b, MemberStatus::Removed, ms(2_000));
    // The leader's last gossip tells the leaver, one hop later.
    sim.run_until(ms(50), |s| s.core(1).is_terminated())
        .unwrap_or_else(|| panic!("{}", sim.dump()));
    let leaving = [
        MembershipEvent::MemberLeft(b),
        MembershipEvent::MemberExited(b),
        MembershipEvent::MemberRemoved {
            member: b,
            previous: MemberStatus::Exiting,
        },
    ];
    // a admitted b; c arrived when b was already Up.
    let seen_by_a = status_events_for(&sim, 0, b);
    assert_eq!(
        seen_by_a[..2],
        [
            MembershipEvent::MemberJoined(b),
            MembershipEvent::MemberUp(b)
        ]
    );
    assert_eq!(seen_by_a[2..], leaving);
    let seen_by_c = status_events_for(&sim, 2, b);
    assert_eq!(seen_by_c[..1], [MembershipEvent::MemberUp(b)]);
    assert_eq!(seen_by_c[1..], leaving);
    // The leaver itself learns it is Removed: its shutdown may proceed.
    assert!(sim.events_of(1).contains(&MembershipEvent::MemberRemoved {
        member: b,
        previous: MemberStatus::Exiting
    }));
    sim.reject_event("a down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
    sim.reject_event("unreachable", |l| {
        matches!(l.event, MembershipEvent::Unreachable(_))
    });
    sim.expect_converged(ms(500));
    sim.expect_no_errors();
}

#[test]
fn the_oldest_node_leaves_and_the_coordinator_moves_on_at_leaving() {
    let mut sim = cluster(3, 4, MembershipConfig::default());
    let (a, b) = (sim.id(0), sim.id(1));
    sim.leave(0);
    sim.expect_all_see(a, MemberStatus::Removed, ms(2_000));
    sim.expect_coordinator_everywhere(b);
    sim.run_until(ms(50), |s| s.core(0).is_terminated())
        .unwrap_or_else(|| panic!("{}", sim.dump()));
    sim.expect_no_errors();
}

#[test]
fn a_lone_node_can_leave() {
    let mut sim = cluster(1, 5, MembershipConfig::default());
    sim.leave(0);
    sim.run_for(ms(100));
    assert!(sim.core(0).is_terminated(), "{}", sim.dump());
    assert_eq!(
        status_events_for(&sim, 0, sim.id(0)).last(),
        Some(&MembershipEvent::MemberRemoved {
            member: sim.id(0),
            previous: MemberStatus::Exiting
        })
    );
}

#[test]
fn a_crashed_node_is_unreachable_then_down_then_removed_in_time_everywhere() {
    let config = MembershipConfig::default();
    let budget = config.detect_and_down_time().unwrap();
    let mut sim = cluster(4, 6, config);
    let c = sim.id(2);
    sim.run_for(ms(37)); // crash at an arbitrary phase of the heartbeat cycle
    sim.crash(2);
    let crashed_at = sim.elapsed();
    let down_after = sim.expect_all_see(c, MemberStatus::Down, ms(3_000));
    // No earlier than the pause allows, and within the budget plus a hop.
    assert!(down_after >= ms(450), "downed too early: {down_after:?}");
    assert!(
        down_after <= budget + ms(20),
        "downed too late: {down_after:?} > {budget:?}"
    );
    sim.expect_all_see(c, MemberStatus::Removed, ms(1_000));
    for observer in [0, 1, 3] {
        let ev = sim.events_of(observer);
        let unreachable_at = ev
            .iter()
            .position(|e| *e == MembershipEvent::Unreachable(c));
        let down_at = ev
            .iter()
            .position(|e| *e == MembershipEvent::MemberDowned(c));
        assert!(
            unreachable_at.is_some() && unreachable_at < down_at,
            "{ev:?}"
        );
        assert!(sim.nodes[observer].marked_down.contains(&c));
    }
    let first_unreachable = sim
        .log
        .iter()
        .find(|l| l.event == MembershipEvent::Unreachable(c))
        .map(|l| l.at - crashed_at)
        .unwrap();
    assert!(first_unreachable <= ms(400), "{first_unreachable:?}");
    sim.expect_coordinator_everywhere(sim.id(0));
    sim.expect_converged(ms(500));
    sim.expect_no_errors();
}

#[test]
fn the_coordinator_moves_to_the_next_oldest_when_the_oldest_dies() {
    let mut sim = cluster(3, 7, MembershipConfig::default());
    let (a, b) = (sim.id(0), sim.id(1));
    sim.expect_coordinator_everywhere(a);
    sim.crash(0);
    sim.expect_all_see(a, MemberStatus::Down, ms(1_000));
    sim.expect_coordinator_everywhere(b);
    assert!(
        sim.events_of(2)
            .contains(&MembershipEvent::CoordinatorChanged(Some(b)))
    );
    // b leads now: it removes a.
    sim.expect_all_see(a, MemberStatus::Removed, ms(1_000));
    assert_eq!(sim.core(2).state().leader, Some(b));
    sim.expect_no_errors();
}

#[test]
fn a_restarted_node_joins_as_a_new_member_and_the_old_incarnation_is_downed() {
    let mut sim = cluster(3, 8, MembershipConfig::default());
    let old = sim.id(2);
    sim.crash(2);
    sim.run_for(ms(50));
    sim.restart(2, &[0, 1]);
    let new = sim.id(2);
    assert_ne!(old, new);
    assert_eq!(old.addr, new.addr);
    // The admitting member downs the old incarnation at once, well before
    // the failure detector would.
    let t = sim.expect_all_see(old, MemberStatus::Down, ms(1_000));
    assert!(t < ms(200), "old incarnation downed after {t:?}");
    sim.expect_all_see(new, MemberStatus::Up, ms(1_000));
    sim.expect_all_see(old, MemberStatus::Removed, ms(1_000));
    sim.expect_converged(ms(500));
    sim.expect_no_errors();
}

#[test]
fn heartbeats_delayed_up_to_the_acceptable_pause_cause_no_unreachable_and_no_down() {
    let config = MembershipConfig::default();
    let mut sim = cluster(3, 9, config.clone());
    // Heavy load: every message waits 0..290 ms behind others (FIFO per
    // link, like a batched TCP pipe), for 30 s.
    sim.min_delay = Duration::ZERO;
    sim.max_delay = config.acceptable_heartbeat_pause - ms(10);
    sim.run_for(ms(30_000));
    sim.reject_event("unreachable", |l| {
        matches!(l.event, MembershipEvent::Unreachable(_))
    });
    sim.reject_event("a down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
    sim.expect_no_errors();
}

#[test]
fn stalled_tasks_within_the_pause_cause_no_unreachable() {
    let mut sim = cluster(3, 10, MembershipConfig::default());
    for round in 0..20 {
        let slot = round % 3;
        sim.stall(slot, ms(250));
        sim.run_for(ms(700));
    }
    sim.reject_event("unreachable", |l| {
        matches!(l.event, MembershipEvent::Unreachable(_))
    });
    sim.reject_event("a down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
    sim.expect_no_errors();
}

#[test]
fn a_stall_past_the_pause_flags_unreachable_but_heartbeats_resume_before_down() {
    // A 450 ms stall: longer than the 300 ms pause, shorter than the
    // 400 + 200 ms it takes to down. The node is flagged, then cleared.
    let mut sim = cluster(3, 11, MembershipConfig::default());
    let c = sim.id(2);
    sim.stall(2, ms(450));
    sim.run_for(ms(3_000));
    assert!(
        sim.events_of(0).contains(&MembershipEvent::Unreachable(c)),
        "{:?}",
        sim.events_of(0)
    );
    assert!(sim.events_of(0).contains(&MembershipEvent::Reachable(c)));
    sim.reject_event("a down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
    sim.expect_converged(ms(500));
    sim.expect_no_errors();
}

#[test]
fn a_member_is_reachable_again_when_heartbeats_resume_before_downing() {
    let config = MembershipConfig {
        downing_timeout: Some(ms(1_000)),
        ..MembershipConfig::default()
    };
    let mut sim = cluster(3, 12, config);
    let c = sim.id(2);
    sim.isolate(2);
    sim.run_until(ms(1_000), |s| s.core(0).state().unreachable.contains(&c))
        .expect("unreachable");
    sim.heal_all();
    sim.run_until(ms(1_000), |s| s.core(0).state().unreachable.is_empty())
        .expect("reachable again");
    assert!(sim.events_of(0).contains(&MembershipEvent::Reachable(c)));
    sim.run_for(ms(3_000));
    sim.reject_event("a down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
    sim.expect_converged(ms(500));
    sim.expect_no_errors();
}

#[test]
fn without_a_downing_timeout_only_a_manual_down_downs() {
    let config = MembershipConfig {
        downing_timeout: None,
        ..MembershipConfig::default()
    };
    let mut sim = cluster(3, 13, config);
    let c = sim.id(2);
    sim.crash(2);
    sim.run_for(ms(5_000));
    assert!(sim.core(0).state().unreachable.contains(&c));
    assert!(sim.all_see(c, MemberStatus::Up));
    // A new node cannot become Up while an unreachable member blocks
    // convergence: documented behaviour, resolved by downing.
    let d = sim.add_node();
    sim.join(d, &[0]);
    sim.run_for(ms(1_000));
    assert_eq!(sim.status_at(0, sim.id(d)), Some(MemberStatus::Joining));
    sim.down(1, c);
    sim.expect_all_see(c, MemberStatus::Removed, ms(1_000));
    sim.expect_all_see(sim.id(d), MemberStatus::Up, ms(1_000));
    sim.expect_no_errors();
}

#[test]
fn a_partition_with_timeout_downing_splits_the_cluster_for_good() {
    // The honest limit: no split-brain resolver. Both sides down the other
    // and, once healed, stay apart (quarantine) instead of merging back.
    let mut sim = cluster(3, 14, MembershipConfig::default());
    let (a, b, c) = (sim.id(0), sim.id(1), sim.id(2));
    sim.isolate(2);
    sim.run_for(ms(2_000));
    assert_eq!(sim.status_at(0, c), Some(MemberStatus::Removed));
    assert_eq!(sim.status_at(2, a), Some(MemberStatus::Removed));
    assert_eq!(sim.status_at(2, b), Some(MemberStatus::Removed));
    // Two coordinators: a on one side, c on the other.
    assert_eq!(sim.core(0).state().placement_coordinator(), Some(a));
    assert_eq!(sim.core(2).state().placement_coordinator(), Some(c));
    sim.heal_all();
    sim.run_for(ms(3_000));
    assert_eq!(sim.status_at(0, c), Some(MemberStatus::Removed));
    assert_eq!(sim.status_at(2, a), Some(MemberStatus::Removed));
    sim.expect_no_errors();
}

#[test]
fn lost_welcomes_and_gossip_are_recovered_by_retries_and_digests() {
    let mut sim = Sim::new(15, MembershipConfig::default());
    sim.drop_per_mille = 300;
    for _ in 0..4 {
        sim.add_node();
    }
    for s in 0..4 {
        sim.join(s, &[0, 1]);
    }
    let ids: Vec<UniqueAddress> = (0..4).map(|s| sim.id(s)).collect();
    let all_up =
        |s: &Sim| ids.iter().all(|m| s.all_see(*m, MemberStatus::Up)) && s.live_slots().len() == 4;
    sim.run_until(ms(20_000), all_up)
        .unwrap_or_else(|| panic!("{}", sim.dump()));
    sim.drop_per_mille = 0;
    sim.expect_converged(ms(1_000));
    sim.expect_no_errors();
}

// ---- API misuse ------------------------------------------------------------

#[test]
fn misuse_is_refused_without_changing_state() {
    let now = Instant::now();
    let me = ua(7000, 1, 10);
    let zero = MembershipConfig {
        heartbeat_interval: Duration::ZERO,
        ..MembershipConfig::default()
    };
    assert!(matches!(
        MembershipCore::new(me, zero, now),
        Err(MembershipError::InvalidConfig { .. })
    ));
    let mut core = MembershipCore::new(me, MembershipConfig::default(), now).unwrap();
    assert_eq!(core.leave(now), Err(MembershipError::NotAMember));
    assert_eq!(core.down(now, me), Err(MembershipError::NotAMember));
    core.join(now, &[me.addr]).unwrap();
    assert_eq!(
        core.join(now, &[me.addr]),
        Err(MembershipError::AlreadyJoining)
    );
    let stranger = ua(7009, 9, 9);
    assert_eq!(
        core.down(now, stranger),
        Err(MembershipError::UnknownMember(stranger))
    );
    core.leave(now).unwrap();
    assert!(core.is_terminated());
    assert_eq!(core.leave(now), Err(MembershipError::Terminated));
    assert_eq!(core.poll_timeout(), None);
}

#[test]
fn a_member_never_heard_from_gets_the_first_heartbeat_grace() {
    let now = Instant::now();
    let a = ua(7000, 1, 10);
    let b = ua(7001, 2, 11);
    let mut core = MembershipCore::new(a, MembershipConfig::default(), now).unwrap();
    core.join(now, &[a.addr]).unwrap();
    core.handle_message(now, b, MembershipMsg::Join).unwrap();
    core.drain_commands();
    // b was first seen at `now`: 1 s grace + 400 ms before it is flagged.
    tick_until(&mut core, now + ms(1_399));
    assert!(core.state().unreachable.is_empty());
    tick_until(&mut core, now + ms(1_400));
    assert_eq!(core.state().unreachable, vec![b]);
    assert!(publishes(&core.drain_commands()).contains(&MembershipEvent::Unreachable(b)));
}

#[test]
fn a_leaver_cut_off_after_exiting_completes_through_the_exit_timeout() {
    let mut sim = cluster(3, 16, MembershipConfig::default());
    let c = sim.id(2);
    sim.leave(2);
    sim.run_until(ms(2_000), |s| {
        s.core(2).self_status() == Some(MemberStatus::Exiting)
    })
    .unwrap_or_else(|| panic!("{}", sim.dump()));
    sim.isolate(2);
    let t = sim
        .run_until(ms(5_000), |s| s.core(2).is_terminated())
        .unwrap_or_else(|| panic!("{}", sim.dump()));
    assert!(t <= ms(2_000) + MS, "terminated after {t:?}");
    assert_eq!(
        sim.events_of(2).last(),
        Some(&MembershipEvent::MemberRemoved {
            member: c,
            previous: MemberStatus::Exiting
        })
    );
    // The others remove it too (an unreachable Exiting member does not block).
    sim.expect_all_see(c, MemberStatus::Removed, ms(2_000));
    sim.expect_no_errors();
}

#[test]
fn a_wrongly_downed_live_node_learns_it_and_stops() {
    let mut sim = cluster(3, 17, MembershipConfig::default());
    let c = sim.id(2);
    sim.down(0, c);
    sim.run_until(ms(100), |s| s.core(2).is_terminated())
        .unwrap_or_else(|| panic!("{}", sim.dump()));
    assert!(sim.events_of(2).contains(&MembershipEvent::MemberDowned(c)));
    sim.expect_all_see(c, MemberStatus::Removed, ms(1_000));
    // Quarantined: its identity is never readmitted.
    assert_eq!(sim.core(2).poll_timeout(), None);
    sim.run_for(ms(2_000));
    assert_eq!(sim.status_at(0, c), Some(MemberStatus::Removed));
    sim.expect_no_errors();
}

#[test]
fn every_message_survives_a_cbor_round_trip() {
    let mut sim = cluster(3, 18, MembershipConfig::default());
    sim.crash(2);
    sim.run_for(ms(450)); // some reachability rows in the state
    let gossip = sim.core(0).gossip().clone();
    assert!(!gossip.unreachable().is_empty());
    let msgs = [
        MembershipMsg::Join,
        MembershipMsg::Welcome {
            gossip: gossip.clone(),
        },
        MembershipMsg::Gossip {
            gossip: gossip.clone(),
        },
        MembershipMsg::Heartbeat {
            digest: gossip.digest(),
        },
    ];
    for msg in msgs {
        let mut bytes = Vec::new();
        ciborium::into_writer(&msg, &mut bytes).unwrap();
        let back: MembershipMsg = ciborium::from_reader(bytes.as_slice()).unwrap();
        assert_eq!(back, msg);
        if let MembershipMsg::Gossip { gossip: g } = back {
            assert_eq!(g.digest(), gossip.digest());
        }
    }
}

#[test]
fn under_load_a_crash_is_still_downed_within_the_budget_plus_the_network_delay() {
    let config = MembershipConfig::default();
    let budget = config.detect_and_down_time().unwrap();
    let mut sim = cluster(5, 19, config);
    // Loaded pipes: every message waits 0..100 ms (FIFO per link).
    sim.min_delay = Duration::ZERO;
    sim.max_delay = ms(100);
    sim.run_for(ms(5_000));
    let d = sim.id(3);
    sim.crash(3);
    let t = sim.expect_all_see(d, MemberStatus::Down, ms(3_000));
    // The observer's flag and the leader's Down each cross one loaded hop.
    assert!(t <= budget + ms(200), "downed after {t:?}");
    sim.expect_all_see(d, MemberStatus::Removed, ms(2_000));
    let live: Vec<UniqueAddress> = [0, 1, 2, 4].iter().map(|s| sim.id(*s)).collect();
    sim.reject_event(
        "a live node downed",
        |l| matches!(&l.event, MembershipEvent::MemberDowned(m) if live.contains(m)),
    );
    sim.expect_no_errors();
}

// ---- the split-brain resolver --------------------------------------------

fn resolver(strategy: SplitBrainStrategy) -> MembershipConfig {
    MembershipConfig {
        split_brain: Some(strategy),
        ..MembershipConfig::default()
    }
}

/// Runs until the slots in `losers` have stopped (downed themselves) and
/// every other live slot sees them Down; then checks that no one else was
/// downed and that the winners still run.
fn expect_resolution(sim: &mut Sim, losers: &[usize], winners: &[usize]) -> Duration {
    let lost: Vec<UniqueAddress> = losers.iter().map(|i| sim.id(*i)).collect();
    let took = sim
        .run_until(ms(10_000), |s| {
            losers.iter().all(|i| s.core(*i).is_terminated())
                && winners.iter().all(|w| {
                    lost.iter()
                        .all(|l| !s.status_at(*w, *l).is_some_and(|st| st.is_live()))
                })
        })
        .unwrap_or_else(|| panic!("no resolution: {}", sim.dump()));
    for w in winners {
        assert!(
            !sim.core(*w).is_terminated(),
            "winner {w} stopped: {}",
            sim.dump()
        );
    }
    sim.reject_event(
        "a member of the winning side downed",
        |l| matches!(l.event, MembershipEvent::MemberDowned(m) if !lost.contains(&m)),
    );
    took
}

#[test]
fn keep_majority_downs_a_node_cut_off_alone_and_it_stops() {
    let mut sim = cluster(3, 41, resolver(SplitBrainStrategy::KeepMajority));
    sim.isolate(2);
    let took = expect_resolution(&mut sim, &[2], &[0, 1]);
    // Detection (400 ms) + stable_after (1 s), give or take a heartbeat.
    assert!(took >= ms(1_000) && took < ms(3_000), "{took:?}");
    // Counted where they were taken: the majority's leader stayed, the
    // cut-off node went down; the other member of the majority decided
    // nothing.
    let decisions: Vec<(u64, u64)> = (0..3)
        .map(|i| sim.core(i).split_brain_decisions())
        .collect();
    let leader = sim.core(0).state().leader.expect("a leader");
    let leader = (0..2)
        .find(|i| sim.id(*i) == leader)
        .expect("on the majority");
    assert_eq!(decisions[leader], (1, 0), "{decisions:?}");
    assert_eq!(decisions[1 - leader], (0, 0), "{decisions:?}");
    assert_eq!(decisions[2], (0, 1), "{decisions:?}");
}

#[test]
fn keep_majority_on_an_even_split_keeps_the_side_of_the_lowest_address() {
    let mut sim = cluster(4, 42, resolver(SplitBrainStrategy::KeepMajority));
    for a in [0, 1] {
        for b in [2, 3] {
            sim.cut(a, b);
        }
    }
    let lowest = (0..4).min_by_key(|i| sim.addr(*i)).expect("nodes");
    let (winners, losers) = if lowest < 2 {
        (vec![0, 1], vec![2, 3])
    } else {
        (vec![2, 3], vec![0, 1])
    };
    expect_resolution(&mut sim, &losers, &winners);
}

#[test]
fn one_bad_link_between_two_members_downs_no_one() {
    let mut sim = cluster(3, 43, resolver(SplitBrainStrategy::KeepMajority));
    sim.cut(0, 1);
    sim.run_for(ms(8_000));
    sim.reject_event("a down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
    for i in 0..3 {
        assert!(!sim.core(i).is_terminated());
    }
}

#[test]
fn keep_oldest_keeps_the_oldest_side_unless_it_is_alone_and_told_to_go() {
    // Slot 0 joined first: the oldest.
    let mut sim = cluster(
        3,
        44,
        resolver(SplitBrainStrategy::KeepOldest {
            down_if_alone: false,
        }),
    );
    sim.isolate(0);
    expect_resolution(&mut sim, &[1, 2], &[0]);
    let config = resolver(SplitBrainStrategy::KeepOldest {
        down_if_alone: true,
    });
    let mut sim = cluster(3, 45, config);
    sim.isolate(0);
    expect_resolution(&mut sim, &[0], &[1, 2]);
}

#[test]
fn static_quorum_and_down_all() {
    let mut sim = cluster(3, 46, resolver(SplitBrainStrategy::StaticQuorum(2)));
    sim.isolate(1);
    expect_resolution(&mut sim, &[1], &[0, 2]);
    let mut sim = cluster(3, 47, resolver(SplitBrainStrategy::DownAll));
    sim.isolate(2);
    expect_resolution(&mut sim, &[0, 1, 2], &[]);
}

#[test]
fn without_a_resolver_both_sides_of_a_partition_go_on() {
    // What the resolver is for: timeout downing lets each side down the other.
    let mut sim = cluster(3, 48, MembershipConfig::default());
    sim.isolate(2);
    let (a, c) = (sim.id(0), sim.id(2));
    // (Down, or already Removed: each side's leader removes the other
    // side as soon as its own side has seen the Down.)
    sim.run_until(ms(5_000), |s| {
        s.status_at(0, c).is_some_and(|st| !st.is_live())
            && s.status_at(2, a).is_some_and(|st| !st.is_live())
    })
    .unwrap_or_else(|| panic!("each side downs the other\n{}", sim.dump()));
    assert!(!sim.core(0).is_terminated() && !sim.core(2).is_terminated());
}

/// Random clean partitions of 3–5 members under each strategy: at most one
/// side keeps running (every member of the other side has stopped).
#[test]
fn random_partitions_leave_at_most_one_side_running() {
    fn holds(seed: u64, n: u8, split: u8, which: u8) -> bool {
        let n = 3 + (n % 3) as usize;
        // A non-trivial split: bit i of `mask` puts slot i in group A.
        let mask = (u32::from(split) % ((1 << n) - 2)) + 1;
        let strategy = match which % 4 {
            0 => SplitBrainStrategy::KeepMajority,
            1 => SplitBrainStrategy::StaticQuorum(n / 2 + 1),
            2 => SplitBrainStrategy::KeepOldest {
                down_if_alone: false,
            },
            _ => SplitBrainStrategy::KeepOldest {
                down_if_alone: true,
            },
        };
        let mut sim = cluster(n, seed, resolver(strategy));
        let in_a = |i: usize| mask & (1 << i) != 0;
        for a in 0..n {
            for b in 0..n {
                if a < b && in_a(a) != in_a(b) {
                    sim.cut(a, b);
                }
            }
        }
        sim.run_for(ms(6_000));
        let running =
            |group: bool| (0..n).any(|i| in_a(i) == group && !sim.core(i).is_terminated());
        let both = running(true) && running(false);
        if both {
            eprintln!("{strategy:?} mask {mask:b}: both sides run\n{}", sim.dump());
        }
        // Keep-majority and keep-oldest always keep exactly one side.
        let none = !running(true) && !running(false);
        let must_keep_one = matches!(
            strategy,
            SplitBrainStrategy::KeepMajority | SplitBrainStrategy::KeepOldest { .. }
        );
        let lost_all_wrongly = must_keep_one && none;
        !(both || lost_all_wrongly)
    }
    quickcheck::QuickCheck::new()
        .tests(200)
        .quickcheck(holds as fn(u64, u8, u8, u8) -> bool);
}

#[test]
fn a_link_that_flaps_faster_than_stable_after_downs_no_one() {
    let mut sim = cluster(3, 49, resolver(SplitBrainStrategy::KeepMajority));
    // Node 2 is cut off for 700 ms (long enough to be flagged), back for
    // 300 ms, again and again: the resolver's view never holds still for
    // stable_after (1 s), so it decides nothing.
    for _ in 0..8 {
        sim.isolate(2);
        sim.run_for(ms(700));
        sim.heal_all();
        sim.run_for(ms(300));
    }
    sim.run_for(ms(3_000));
    sim.reject_event("a down", |l| {
        matches!(l.event, MembershipEvent::MemberDowned(_))
    });
    for i in 0..3 {
        assert!(!sim.core(i).is_terminated(), "{i} stopped: {}", sim.dump());
    }
    sim.expect_converged(ms(2_000));
}

#[test]
fn a_partition_during_a_join_leaves_one_side() {
    let mut sim = cluster(3, 50, resolver(SplitBrainStrategy::KeepMajority));
    // Node 2 is cut off while a fourth node joins through node 0: the side
    // of nodes 0, 1 and the newcomer is the majority of four.
    sim.isolate(2);
    let newcomer = sim.add_node();
    // The newcomer is on the side of 0 and 1: cut off from 2 as well.
    // (Isolating 2 cut only the links that existed; before members took
    // in the state of a member they did not know yet, 2 ignored the
    // newcomer anyway.)
    sim.cut(2, newcomer);
    sim.join(newcomer, &[0]);
    expect_resolution(&mut sim, &[2], &[0, 1, newcomer]);
    let id = sim.id(newcomer);
    sim.expect_all_see(id, MemberStatus::Up, ms(5_000));
}

#[test]
fn asymmetric_links_leave_at_most_one_side_running() {
    // X (0) and Y (1) cannot hear each other; Z (2) hears nobody, though
    // both hear Z. Sides extend only over links neither end flags, so no
    // two members that cannot hear each other both stay.
    let mut sim = cluster(3, 51, resolver(SplitBrainStrategy::KeepMajority));
    sim.cut(0, 1);
    sim.cut_one_way(0, 2);
    sim.cut_one_way(1, 2);
    sim.run_for(ms(8_000));
    let running: Vec<usize> = (0..3).filter(|i| !sim.core(*i).is_terminated()).collect();
    // Whoever runs must hear each other: not both 0 and 1, and not 2 with
    // anyone (2 hears nobody).
    assert!(
        !(running.contains(&0) && running.contains(&1)),
        "{running:?}\n{}",
        sim.dump()
    );
    assert!(running.len() <= 1, "{running:?}\n{}", sim.dump());
}

/// MemberDowned events published by the first `n` slots.
fn downs(sim: &Sim, n: usize) -> usize {
    (0..n)
        .flat_map(|i| sim.events_of(i))
        .filter(|e| matches!(e, MembershipEvent::MemberDowned(_)))
        .count()
}

#[test]
fn a_single_bad_link_never_downs_a_member_that_others_reach() {
    fn holds(seed: u64, n: u8, a: u8, b: u8) -> bool {
        let n = 3 + (n % 3) as usize;
        let a = a as usize % n;
        let b = (a + 1 + b as usize % (n - 1)) % n;
        let mut sim = cluster(n, seed, resolver(SplitBrainStrategy::KeepMajority));
        sim.cut(a, b);
        sim.run_for(ms(6_000));
        let downed = downs(&sim, n) > 0;
        if downed {
            eprintln!(
                "bad link {a}–{b} of {n}: a member was downed\n{}",
                sim.dump()
            );
        }
        !downed && (0..n).all(|i| !sim.core(i).is_terminated())
    }
    quickcheck::QuickCheck::new()
        .tests(100)
        .quickcheck(holds as fn(u64, u8, u8, u8) -> bool);
}

#[test]
fn after_a_partition_heals_nobody_else_is_downed() {
    fn holds(seed: u64, n: u8, split: u8) -> bool {
        let n = 3 + (n % 3) as usize;
        let mask = (u32::from(split) % ((1 << n) - 2)) + 1;
        let in_a = |i: usize| mask & (1 << i) != 0;
        let mut sim = cluster(n, seed, resolver(SplitBrainStrategy::KeepMajority));
        for a in 0..n {
            for b in 0..n {
                if a < b && in_a(a) != in_a(b) {
                    sim.cut(a, b);
                }
            }
        }
        sim.run_for(ms(6_000));
        let survivors: Vec<usize> = (0..n).filter(|i| !sim.core(*i).is_terminated()).collect();
        let downs_before = downs(&sim, n);
        sim.heal_all();
        sim.run_for(ms(4_000));
        let ok = !survivors.is_empty()
            && survivors.iter().all(|i| !sim.core(*i).is_terminated())
            && downs(&sim, n) == downs_before;
        if !ok {
            eprintln!("mask {mask:b} of {n}: after the heal\n{}", sim.dump());
        }
        ok
    }
    quickcheck::QuickCheck::new()
        .tests(100)
        .quickcheck(holds as fn(u64, u8, u8) -> bool);
}

#[test]
fn a_clean_three_two_split_under_each_strategy() {
    // Slots 0 and 1 (0 the oldest) against 2, 3 and 4.
    let split = |sim: &mut Sim| {
        for a in [0, 1] {
            for b in [2, 3, 4] {
                sim.cut(a, b);
            }
        }
    };
    let cases: [(SplitBrainStrategy, &[usize], &[usize]); 5] = [
        (SplitBrainStrategy::KeepMajority, &[0, 1], &[2, 3, 4]),
        (SplitBrainStrategy::StaticQuorum(3), &[0, 1], &[2, 3, 4]),
        (
            SplitBrainStrategy::KeepOldest {
                down_if_alone: false,
            },
            &[2, 3, 4],
            &[0, 1],
        ),
        (
            SplitBrainStrategy::KeepOldest {
                down_if_alone: true,
            },
            &[2, 3, 4],
            &[0, 1],
        ),
        (SplitBrainStrategy::DownAll, &[0, 1, 2, 3, 4], &[]),
    ];
    for (seed, (strategy, losers, winners)) in cases.into_iter().enumerate() {
        let mut sim = cluster(5, 60 + seed as u64, resolver(strategy));
        split(&mut sim);
        expect_resolution(&mut sim, losers, winners);
    }
}

// ---- at scale: the monitoring ring and digest-first gossip ---------------

/// What one run of the scale story measured.
#[derive(Debug)]
struct ScaleReport {
    members: usize,
    idle_messages_per_member_s: f64,
    idle_bytes_per_member_s: f64,
    crash_flagged_after: Duration,
    crash_downed_everywhere_after: Duration,
    join_up_everywhere_after: Duration,
}

/// A formed cluster of `n`: idle traffic over 2 s, then a crash (time until
/// every survivor sees it Down or Removed), then a join (time until every
/// member sees the joiner Up). No live member is ever flagged.
fn scale_story(n: usize, seed: u64) -> ScaleReport {
    let config = MembershipConfig::default();
    let gossip_interval = config.gossip_interval;
    let mut sim = Sim::formed(seed, config, n);
    sim.run_for(ms(1_500)); // past the first-heartbeat grace
    sim.count_bytes = true;
    let before = sim.total_sent();
    let idle = ms(2_000);
    sim.run_for(idle);
    let after = sim.total_sent();
    sim.count_bytes = false;
    assert_eq!(
        after.states, before.states,
        "an idle cluster sends digests only, never a whole state"
    );
    let per = |x: u64| x as f64 / n as f64 / idle.as_secs_f64();
    let idle_messages = per(after.messages - before.messages);
    let idle_bytes = per(after.bytes - before.bytes);

    let victim = n / 2;
    let dead = sim.id(victim);
    sim.crash(victim);
    let flagged = sim
        .run_until_every(ms(3_000), ms(5), |s| {
            s.live_slots()
                .iter()
                .any(|p| s.core(*p).gossip().unreachable().contains(&dead))
        })
        .unwrap_or_else(|| panic!("nobody flagged the crashed member"));
    let downed = flagged
        + sim
            .run_until_every(ms(5_000), ms(5), |s| {
                s.live_slots()
                    .iter()
                    .all(|p| s.status_at(*p, dead).is_some_and(|st| !st.is_live()))
            })
            .unwrap_or_else(|| panic!("the crash was not known everywhere"));

    let joiner = sim.add_node();
    sim.join(joiner, &[0]);
    let jid = sim.id(joiner);
    let joined = sim
        .run_until_every(ms(10_000), ms(10), |s| s.all_see(jid, MemberStatus::Up))
        .unwrap_or_else(|| panic!("the joiner was not Up everywhere"));
    sim.run_for(ms(1_500));

    sim.expect_only_crashed_flagged();
    sim.expect_no_errors();
    let report = ScaleReport {
        members: n,
        idle_messages_per_member_s: idle_messages,
        idle_bytes_per_member_s: idle_bytes,
        crash_flagged_after: flagged,
        crash_downed_everywhere_after: downed,
        join_up_everywhere_after: joined,
    };
    eprintln!(
        "{report:?} (join in {:.1} gossip rounds)",
        joined.as_secs_f64() / gossip_interval.as_secs_f64()
    );
    report
}

#[test]
fn at_100_members_idle_traffic_is_bounded_and_a_crash_is_known_everywhere_quickly() {
    let r = scale_story(100, 61);
    assert_eq!(r.members, 100);
    // 5 watchers × 10 heartbeats/s + about 2 digests × 5 rounds/s.
    assert!(r.idle_messages_per_member_s < 65.0, "{r:?}");
    assert!(r.idle_bytes_per_member_s < 2_048.0, "{r:?}");
    assert!(r.crash_flagged_after <= ms(410), "{r:?}");
    assert!(r.crash_downed_everywhere_after < ms(2_000), "{r:?}");
    assert!(r.join_up_everywhere_after < ms(3_000), "{r:?}");
}

#[test]
fn at_1000_members_an_idle_member_sends_under_2_kib_s_and_a_crash_is_known_within_2_s() {
    let r = scale_story(1_000, 62);
    assert_eq!(r.members, 1_000);
    // The same as at 100 members: the cost per member does not grow with N.
    assert!(r.idle_messages_per_member_s < 65.0, "{r:?}");
    assert!(r.idle_bytes_per_member_s < 2_048.0, "{r:?}");
    assert!(r.crash_flagged_after <= ms(410), "{r:?}");
    assert!(r.crash_downed_everywhere_after < ms(2_000), "{r:?}");
    assert!(r.join_up_everywhere_after < ms(5_000), "{r:?}");
}

/// Links delayed by up to half the acceptable pause (0–150 ms, FIFO per
/// link) flag no one, at 100 members for 10 s and 1,000 for 3 s.
#[test]
fn at_scale_links_delayed_up_to_half_the_pause_flag_no_one() {
    for (n, run) in [(100, ms(10_000)), (1_000, ms(3_000))] {
        let config = MembershipConfig::default();
        let half = config.acceptable_heartbeat_pause / 2;
        let mut sim = Sim::formed(63, config, n);
        sim.min_delay = Duration::ZERO;
        sim.max_delay = half;
        sim.run_for(run);
        sim.reject_event("a member flagged", |l| {
            matches!(l.event, MembershipEvent::Unreachable(_))
        });
        sim.expect_no_errors();
    }
}

/// The starved-watcher correction: a watcher whose process stalls past the
/// pause (450 ms), and whose pipes are still behind when its task resumes (the
/// heartbeats that came meanwhile arrive 50 ms after its timer), flags
/// none of the members it watches. Without the correction it flagged all
/// of them at its first wake-up.
#[test]
fn a_starved_watcher_does_not_flag_the_members_it_watches() {
    let mut sim = cluster(8, 64, MembershipConfig::default());
    sim.io_lag = ms(50);
    for round in 0..5 {
        sim.stall(3, ms(450));
        sim.run_for(ms(2_000));
        let watcher = sim.id(3);
        sim.reject_event("a member flagged by the starved watcher", |l| {
            // (It does publish its own Unreachable: its watchers flagged it.)
            l.observer == watcher
                && matches!(l.event, MembershipEvent::Unreachable(m) if m != watcher)
        });
        assert!(
            !sim.core(3).is_terminated(),
            "round {round}: {}",
            sim.dump()
        );
    }
    // Its watchers did flag it (it was silent for 450 ms), then cleared it.
    let stalled = sim.id(3);
    assert!(
        sim.log
            .iter()
            .any(|l| l.event == MembershipEvent::Unreachable(stalled))
    );
    sim.expect_converged(ms(2_000));
}

/// The resolver on a ring that is not all-to-all: 30 members, each watched
/// by 5, split 18/12 into two groups, once as two arcs of the ring and
/// once at random. Keep-majority keeps the 18 and downs the 12, nobody
/// else.
#[test]
fn keep_majority_on_a_ring_of_30_keeps_the_larger_side_of_a_split() {
    let config = resolver(SplitBrainStrategy::KeepMajority);
    for (seed, scattered) in [(65, false), (66, true)] {
        let n = 30;
        let mut sim = Sim::formed(seed, config.clone(), n);
        sim.run_for(ms(1_500));
        let mut slots: Vec<usize> = (0..n).collect();
        if scattered {
            for i in (1..n).rev() {
                let j = sim.rng.below(i as u64 + 1) as usize;
                slots.swap(i, j);
            }
        }
        let (minority, majority) = slots.split_at(12);
        for a in minority {
            for b in majority {
                sim.cut(*a, *b);
            }
        }
        let took = expect_resolution(&mut sim, minority, majority);
        eprintln!("30 members, 18/12 split (scattered: {scattered}): resolved in {took:?}");
    }
}

/// At 100 members with keep-majority (the default to be), a crash is
/// resolved by the resolver: Down everywhere within detection +
/// stable_after + a few hops, and nobody else is flagged.
#[test]
fn at_100_members_keep_majority_downs_a_crash_and_no_one_else() {
    let mut sim = Sim::formed(67, resolver(SplitBrainStrategy::KeepMajority), 100);
    sim.run_for(ms(1_500));
    let dead = sim.id(37);
    sim.crash(37);
    let took = sim
        .run_until_every(ms(5_000), ms(5), |s| {
            s.live_slots()
                .iter()
                .all(|p| s.status_at(*p, dead).is_some_and(|st| !st.is_live()))
        })
        .unwrap_or_else(|| panic!("the crash was not resolved\n{}", sim.dump()));
    eprintln!("100 members, keep-majority: crash Down everywhere after {took:?}");
    assert!(took < ms(2_000), "{took:?}");
    sim.run_for(ms(2_000));
    sim.expect_only_crashed_flagged();
    sim.expect_no_errors();
}

/// 50 nodes started at once through one seed (the burst that tore the
/// all-to-all cluster apart): they form within 2 s, flag no one, and once
/// formed an idle period sends digests only.
#[test]
fn fifty_nodes_joining_at_once_through_one_seed_form_quickly_and_go_quiet() {
    let mut sim = Sim::new(68, MembershipConfig::default());
    sim.min_delay = Duration::ZERO;
    sim.max_delay = ms(20);
    for _ in 0..50 {
        let s = sim.add_node();
        sim.join(s, &[0]);
    }
    let ids: Vec<UniqueAddress> = (0..50).map(|s| sim.id(s)).collect();
    let formed = sim
        .run_until_every(ms(10_000), ms(10), |s| {
            ids.iter().all(|m| s.all_see(*m, MemberStatus::Up))
        })
        .unwrap_or_else(|| panic!("50 nodes did not form\n{}", sim.dump()));
    eprintln!("50 nodes formed in {formed:?}, {:?} sent", sim.total_sent());
    assert!(formed < ms(2_000), "{formed:?}");
    sim.run_for(ms(2_000));
    let before = sim.total_sent();
    sim.run_for(ms(2_000));
    let after = sim.total_sent();
    eprintln!(
        "idle: {} messages/member/s, {} states",
        (after.messages - before.messages) as f64 / 100.0,
        after.states - before.states
    );
    assert_eq!(after.states, before.states, "states sent while idle");
    sim.reject_event("a member flagged", |l| {
        matches!(l.event, MembershipEvent::Unreachable(_))
    });
    sim.expect_no_errors();
}
