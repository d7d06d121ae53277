//! The control core against fake regions: each test feeds events with a
//! made-up clock and asserts the exact commands out and what was done to
//! the regions.

use std::time::{Duration, Instant};

use super::*;
use crate::membership::MemberStatus;
use crate::runtime::slot::HomeChange;
use crate::sharding::coordinator::{CoordinatorConfig, LeastShardAllocation};
use crate::sharding::region_core::tests::{Fake, node, view_with};

const ME: u64 = 1;

fn core() -> ControlCore {
    let coordinator = CoordinatorCore::new(
        node(ME),
        CoordinatorConfig::default(),
        Box::new(LeastShardAllocation),
    );
    ControlCore::new(node(ME), coordinator)
}

/// A view from node 1 of `members`, the oldest Up one coordinating.
fn view(members: &[(u64, MemberStatus)]) -> MembershipState {
    let coordinator = members
        .iter()
        .filter(|(_, s)| *s == MemberStatus::Up)
        .map(|(n, _)| node(*n))
        .min_by_key(|a| a.age_key());
    view_with(members, coordinator)
}

/// The commands as short lines: message kinds and destinations.
fn lines(commands: &[ControlCommand]) -> Vec<String> {
    commands
        .iter()
        .map(|c| match c {
            ControlCommand::Send { to, msg } => {
                let what = match msg {
                    ControlMsg::Register { .. } => "Register".to_owned(),
                    ControlMsg::GetHome { shard, .. } => format!("GetHome {shard}"),
                    ControlMsg::Leave { .. } => "Leave".to_owned(),
                    ControlMsg::Unregister { .. } => "Unregister".to_owned(),
                    other => format!("{other:?}"),
                };
                format!("{what} to {}", to.node_id.0)
            }
            ControlCommand::FailAsks(n) => format!("FailAsks {}", n.node_id.0),
            ControlCommand::Fence => "Fence".to_owned(),
        })
        .collect()
}

fn up(nodes: &[u64]) -> Vec<(u64, MemberStatus)> {
    nodes.iter().map(|n| (*n, MemberStatus::Up)).collect()
}

#[test]
fn a_follower_registers_with_the_coordinator_and_asks_it_for_homes() {
    let t0 = Instant::now();
    let regions = Fake::new();
    // Node 0 is older than node 1: it coordinates.
    let mut core = core();
    let out = core.membership(t0, view(&up(&[0, ME])), &regions);
    assert_eq!(lines(&out), ["Register to 0"]);
    let out = core.allocate(t0, &regions, "t", 3);
    assert_eq!(lines(&out), ["GetHome 3 to 0"]);
    assert_eq!(regions.calls(), Vec::<String>::new());
}

#[test]
fn a_lone_node_answers_itself_and_sends_nothing_out() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = core();
    let out = core.membership(t0, view(&up(&[ME])), &regions);
    assert_eq!(lines(&out), Vec::<String>::new());
    // Its registration with itself was answered with the table at once.
    assert_eq!(regions.calls(), ["accepted t"]);
    assert!(core.coordinator().is_active());
    let out = core.allocate(t0, &regions, "t", 3);
    assert_eq!(lines(&out), Vec::<String>::new());
    assert_eq!(regions.calls(), ["set_home t 3 5"]);
}

#[test]
fn a_node_downed_in_its_own_view_is_fenced_first() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = core();
    core.membership(t0, view(&up(&[0, ME])), &regions);
    let out = core.membership(
        t0,
        view(&[(0, MemberStatus::Up), (ME, MemberStatus::Down)]),
        &regions,
    );
    assert_eq!(lines(&out)[0], "Fence");
}

#[test]
fn a_member_gone_fails_its_asks_and_its_shards_wait() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = core();
    core.membership(t0, view(&up(&[0, ME, 3])), &regions);
    regions.calls();
    let out = core.membership(
        t0,
        view(&[
            (0, MemberStatus::Up),
            (ME, MemberStatus::Up),
            (3, MemberStatus::Down),
        ]),
        &regions,
    );
    assert_eq!(lines(&out), ["FailAsks 3"]);
    assert_eq!(regions.calls(), ["node_lost 3"]);
}

#[test]
fn a_home_from_a_node_that_is_not_the_coordinator_is_ignored() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = core();
    core.membership(t0, view(&up(&[0, ME, 3])), &regions);
    regions.calls();
    let home = |epoch| ControlMsg::Home {
        type_name: "t".into(),
        shard: 3,
        owner: node(3),
        generation: 9,
        from: None,
        epoch,
    };
    let out = core.control(t0, node(3), home(1), &regions);
    assert_eq!(lines(&out), Vec::<String>::new());
    assert_eq!(regions.calls(), Vec::<String>::new());
    // From the coordinator it is applied.
    core.control(t0, node(0), home(1), &regions);
    assert_eq!(regions.calls(), ["set_home t 3 9"]);
}

#[test]
fn time_alone_asks_again_for_a_home_that_did_not_come() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = core();
    core.membership(t0, view(&up(&[0, ME])), &regions);
    core.allocate(t0, &regions, "t", 3);
    let due = core.poll_timeout().expect("a retry is due");
    assert!(due > t0 && due <= t0 + Duration::from_secs(1), "{due:?}");
    let state = view(&up(&[0, ME]));
    let out = core.handle_timeout(due, &state, &regions);
    assert!(
        lines(&out).contains(&"GetHome 3 to 0".to_owned()),
        "{:?}",
        lines(&out)
    );
    assert!(core.poll_timeout().is_some_and(|next| next > due));
}

#[test]
fn a_member_that_left_gracefully_keeps_its_asks_unless_shards_were_routed_to_it() {
    let t0 = Instant::now();
    let mut regions = Fake::new();
    let mut core = core();
    let leaving = [
        (0, MemberStatus::Up),
        (ME, MemberStatus::Up),
        (4, MemberStatus::Leaving),
        (5, MemberStatus::Up),
    ];
    core.membership(t0, view(&leaving), &regions);
    regions.calls();
    // 4 left with nothing routed to it: its asks wait for their replies;
    // 5 is gone without leaving: its asks fail.
    let out = core.membership(t0, view(&up(&[0, ME])), &regions);
    assert_eq!(lines(&out), ["FailAsks 5"]);
    assert_eq!(regions.calls(), ["node_lost 4", "node_lost 5"]);
    // 6 leaves with a shard still routed to it: its asks fail.
    regions.routed = 1;
    core.membership(
        t0,
        view(&[
            (0, MemberStatus::Up),
            (ME, MemberStatus::Up),
            (6, MemberStatus::Exiting),
        ]),
        &regions,
    );
    let out = core.membership(t0, view(&up(&[0, ME])), &regions);
    assert_eq!(lines(&out), ["FailAsks 6"]);
}

#[test]
fn a_stale_home_leaves_the_request_open_and_a_newer_one_closes_it() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = core();
    core.membership(t0, view(&up(&[0, ME])), &regions);
    core.allocate(t0, &regions, "t", 3);
    let home = |generation| ControlMsg::Home {
        type_name: "t".into(),
        shard: 3,
        owner: node(0),
        generation,
        from: None,
        epoch: 1,
    };
    *regions.change.borrow_mut() = HomeChange::Stale;
    core.control(t0, node(0), home(3), &regions);
    let due = core.poll_timeout().expect("due");
    let state = view(&up(&[0, ME]));
    let out = core.handle_timeout(due, &state, &regions);
    assert!(lines(&out).contains(&"GetHome 3 to 0".to_owned()));
    *regions.change.borrow_mut() = HomeChange::Remote;
    core.control(t0, node(0), home(5), &regions);
    assert_eq!(regions.calls(), ["set_home t 3 3", "set_home t 3 5"]);
    let later = due + Duration::from_secs(1);
    let out = core.handle_timeout(later, &state, &regions);
    assert!(
        !lines(&out).iter().any(|l| l.starts_with("GetHome")),
        "{:?}",
        lines(&out)
    );
}
