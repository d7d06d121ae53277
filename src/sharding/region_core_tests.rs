//! The region side against fake regions: each test feeds events with a
//! made-up clock and asserts the exact messages out.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use super::*;
use crate::membership::Member;
use crate::model::identity::NodeId;

/// Regions of one type, `t`, that record what is done to them.
pub(crate) struct Fake {
    calls: RefCell<Vec<String>>,
    types: Vec<String>,
    /// What applying a home does.
    pub(crate) change: RefCell<HomeChange>,
    /// Shards routed to a lost member.
    pub(crate) routed: usize,
    handed_off: RefCell<bool>,
}

impl Fake {
    pub(crate) fn new() -> Self {
        Fake {
            calls: RefCell::new(Vec::new()),
            types: vec!["t".into()],
            change: RefCell::new(HomeChange::Remote),
            routed: 0,
            handed_off: RefCell::new(true),
        }
    }

    pub(crate) fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.calls.borrow_mut())
    }
}

impl RegionsView for Fake {
    fn registrations(&self, leaving: bool) -> Vec<TypeRegistration> {
        self.types
            .iter()
            .map(|t| TypeRegistration {
                type_name: t.clone(),
                fingerprint: 1,
                lines: Vec::new(),
                num_shards: 8,
                homes: Vec::new(),
                proxy: false,
                leaving,
                stopped: Vec::new(),
            })
            .collect()
    }

    fn type_names(&self) -> Vec<String> {
        self.types.clone()
    }

    fn generation_of(&self, _type_name: &str, _shard: u32) -> u64 {
        4
    }

    fn is_handed_off(&self, _type_name: &str, _shard: u32, _generation: u64) -> bool {
        *self.handed_off.borrow()
    }
}

impl LocalRegions for Fake {
    fn set_home(
        &self,
        type_name: &str,
        shard: u32,
        home: ShardHome,
        _from: Option<UniqueAddress>,
    ) -> Option<(&'static str, HomeChange)> {
        self.calls
            .borrow_mut()
            .push(format!("set_home {type_name} {shard} {}", home.generation));
        Some(("t", *self.change.borrow()))
    }

    fn node_lost(&self, node: &UniqueAddress) -> usize {
        self.calls
            .borrow_mut()
            .push(format!("node_lost {}", node.node_id.0));
        self.routed
    }

    fn call_off_handoffs(&self) {
        self.calls.borrow_mut().push("call_off_handoffs".into());
    }

    fn hand_off(&self, type_name: &str, shard: u32, generation: u64) {
        self.calls
            .borrow_mut()
            .push(format!("hand_off {type_name} {shard} {generation}"));
    }

    fn mark_left(&self, type_name: &str, nowhere: bool) {
        self.calls
            .borrow_mut()
            .push(format!("mark_left {type_name} {nowhere}"));
    }

    fn accepted(&self, type_name: &str, _by: UniqueAddress) {
        self.calls
            .borrow_mut()
            .push(format!("accepted {type_name}"));
    }

    fn refused(
        &self,
        type_name: &str,
        _reason: String,
        _cluster_fingerprint: Option<u64>,
        _cluster_num_shards: Option<u32>,
        _differing_line: Option<u32>,
    ) {
        self.calls.borrow_mut().push(format!("refused {type_name}"));
    }
}

pub(crate) fn node(n: u64) -> UniqueAddress {
    UniqueAddress {
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], 7000 + n as u16)),
        node_id: NodeId(n),
        incarnation: n,
    }
}

const ME: u64 = 1;
const C: u64 = 2;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The commands as short lines: messages with their destinations, and
/// the moves of the regions in the words of [`Fake`]'s calls.
fn sent(commands: &[RegionCommand]) -> Vec<String> {
    commands
        .iter()
        .map(|c| match c {
            RegionCommand::Send { to, msg } => {
                let what = match msg {
                    ControlMsg::Register { .. } => "Register".to_owned(),
                    ControlMsg::Unregister { .. } => "Unregister".to_owned(),
                    ControlMsg::GetHome {
                        shard, generation, ..
                    } => format!("GetHome {shard} {generation}"),
                    ControlMsg::ShardStopped { shard, .. } => format!("ShardStopped {shard}"),
                    ControlMsg::Leave { .. } => "Leave".to_owned(),
                    other => format!("{other:?}"),
                };
                format!("{what} to {}", to.node_id.0)
            }
            RegionCommand::LetGo {
                node,
                asks_may_wait: false,
            } => format!("let_go {}", node.node_id.0),
            RegionCommand::LetGo {
                node,
                asks_may_wait: true,
            } => format!("let_go {} (asks may wait)", node.node_id.0),
            RegionCommand::SetHome {
                type_name,
                shard,
                home,
                ..
            } => format!("set_home {type_name} {shard} {}", home.generation),
            RegionCommand::CallOffHandoffs => "call_off_handoffs".to_owned(),
            RegionCommand::HandOff {
                type_name,
                shard,
                generation,
            } => format!("hand_off {type_name} {shard} {generation}"),
            RegionCommand::MarkLeft { type_name, nowhere } => {
                format!("mark_left {type_name} {nowhere}")
            }
            RegionCommand::Accepted { type_name, .. } => format!("accepted {type_name}"),
            RegionCommand::Refused { type_name, .. } => format!("refused {type_name}"),
        })
        .collect()
}

/// Node 1's view of `members`, following coordinator 2.
fn view(members: &[(u64, MemberStatus)]) -> MembershipState {
    view_with(members, Some(node(C)))
}

/// Node 1's view of `members`, `coordinator` coordinating (and leading).
pub(crate) fn view_with(
    members: &[(u64, MemberStatus)],
    coordinator: Option<UniqueAddress>,
) -> MembershipState {
    MembershipState {
        self_member: node(ME),
        members: members
            .iter()
            .map(|(n, status)| Member {
                address: node(*n),
                status: *status,
            })
            .collect(),
        unreachable: Vec::new(),
        leader: coordinator,
        coordinator,
        beyond: Vec::new(),
    }
}

/// The three timed steps, in the order the control core runs them.
fn tick(
    core: &mut RegionCore,
    now: Instant,
    regions: &dyn RegionsView,
    epoch: u64,
) -> Vec<RegionCommand> {
    let mut out = core.retry_requests(now, regions);
    out.extend(core.reregister(now, regions, epoch));
    out.extend(core.repeat_reports(now, regions));
    out
}

/// A core following coordinator 2, which has not sent its table yet.
fn following(t0: Instant, regions: &Fake) -> RegionCore {
    let mut core = RegionCore::new(node(ME));
    let state = view(&[(ME, MemberStatus::Up), (C, MemberStatus::Up)]);
    assert!(core.members(&state).is_empty());
    let out = core.follow(t0, Some(node(C)), regions, 7);
    assert_eq!(sent(&out), ["Register to 2"]);
    core
}

fn table() -> ControlMsg {
    ControlMsg::Table {
        type_name: "t".into(),
        homes: Vec::new(),
        epoch: 1,
        quiet_ms: None,
        app_versions: Vec::new(),
    }
}

#[test]
fn a_request_is_asked_again_until_its_home_comes() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    assert_eq!(
        sent(&core.coordinator_said(node(C), table())),
        ["accepted t"]
    );
    let out = core.allocate(t0, &regions, "t", 3);
    assert_eq!(
        sent(&out),
        ["GetHome 3 4 to 2"],
        "with the region's generation"
    );
    assert_eq!(core.poll_timeout(), Some(t0 + RETRY_GET_HOME));
    assert!(tick(&mut core, t0 + ms(299), &regions, 7).is_empty());
    let out = tick(&mut core, t0 + ms(300), &regions, 7);
    assert_eq!(sent(&out), ["GetHome 3 4 to 2"]);
    // A stale home keeps it asking; a newer one ends the request.
    let home = |generation| ControlMsg::Home {
        type_name: "t".into(),
        shard: 3,
        owner: node(C),
        generation,
        epoch: 1,
        from: None,
    };
    assert_eq!(
        sent(&core.coordinator_said(node(C), home(3))),
        ["set_home t 3 3"]
    );
    core.home_applied("t", 3, HomeChange::Stale);
    assert_eq!(
        sent(&tick(&mut core, t0 + ms(600), &regions, 7)),
        ["GetHome 3 4 to 2"]
    );
    assert_eq!(
        sent(&core.coordinator_said(node(C), home(5))),
        ["set_home t 3 5"]
    );
    core.home_applied("t", 3, HomeChange::Remote);
    assert!(tick(&mut core, t0 + ms(900), &regions, 7).is_empty());
}

#[test]
fn the_registration_is_repeated_until_the_table_comes_then_refreshed() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    assert_eq!(core.poll_timeout(), Some(t0 + REREGISTER_AFTER));
    let out = tick(&mut core, t0 + REREGISTER_AFTER, &regions, 7);
    assert_eq!(sent(&out), ["Register to 2"]);
    core.coordinator_said(node(C), table());
    let t1 = t0 + REREGISTER_AFTER;
    assert_eq!(core.poll_timeout(), Some(t1 + REFRESH_EVERY));
    assert!(tick(&mut core, t1 + ms(5_000), &regions, 7).is_empty());
    assert_eq!(
        sent(&tick(&mut core, t1 + REFRESH_EVERY, &regions, 7)),
        ["Register to 2"]
    );
    // An older epoch's message makes it register again soon.
    core.older_epoch();
    assert_eq!(
        core.poll_timeout(),
        Some(t1 + REFRESH_EVERY + REREGISTER_AFTER)
    );
}

#[test]
fn a_new_coordinator_hears_the_registration_the_leave_the_requests_and_the_reports() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    core.allocate(t0, &regions, "t", 3);
    core.shard_stopped(t0, "t", 5, 9);
    let (wait, out) = core.begin_leave(t0, &regions, |_| false);
    assert!(wait);
    assert_eq!(sent(&out), ["Leave to 2"]);
    // Coordinator 2 is gone from the view; 3 takes over.
    let state = view(&[(ME, MemberStatus::Up), (3, MemberStatus::Up)]);
    assert_eq!(sent(&core.members(&state)), ["let_go 2"]);
    let out = core.follow(t0 + ms(10), Some(node(3)), &regions, 7);
    assert_eq!(
        sent(&out),
        ["call_off_handoffs", "Register to 3", "Leave to 3"],
        "the gone coordinator's handoffs are called off first"
    );
    let out = core.catch_up(t0 + ms(10), &regions);
    assert_eq!(sent(&out), ["GetHome 3 4 to 3", "ShardStopped 5 to 3"]);
    // A later view with the same coordinator tells it nothing again.
    assert!(
        core.follow(t0 + ms(20), Some(node(3)), &regions, 7)
            .is_empty()
    );
    assert!(core.catch_up(t0 + ms(20), &regions).is_empty());
    assert!(!core.hears(node(2)));
    assert!(core.hears(node(3)) && core.hears(node(ME)));
}

#[test]
fn a_member_that_left_gracefully_is_let_go_with_its_asks_waiting() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    let up = |n| (n, MemberStatus::Up);
    core.members(&view(&[
        up(ME),
        up(C),
        (4, MemberStatus::Leaving),
        up(5),
        (6, MemberStatus::Exiting),
    ]));
    // 4 and 6 left (removed, out of the view): their asks may wait for
    // their replies (if nothing is routed to them). 5 is gone without
    // leaving: its asks fail.
    let out = core.members(&view(&[up(ME), up(C)]));
    assert_eq!(
        sent(&out),
        [
            "let_go 4 (asks may wait)",
            "let_go 5",
            "let_go 6 (asks may wait)"
        ]
    );
    // A home on a lost member is not applied.
    let home = ControlMsg::Home {
        type_name: "t".into(),
        shard: 1,
        owner: node(6),
        generation: 9,
        epoch: 1,
        from: None,
    };
    assert!(core.coordinator_said(node(C), home).is_empty());
    assert!(RegionCore::is_out(&view(&[(ME, MemberStatus::Down)])));
    assert!(!RegionCore::is_out(&view(&[(ME, MemberStatus::Up)])));
}

#[test]
fn reports_and_the_leave_are_repeated_until_answered() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    core.coordinator_said(node(C), table());
    assert_eq!(
        sent(&core.shard_stopped(t0, "t", 5, 9)),
        ["ShardStopped 5 to 2"]
    );
    let (_, out) = core.begin_leave(t0, &regions, |_| false);
    assert_eq!(sent(&out), ["Leave to 2"]);
    assert_eq!(core.poll_timeout(), Some(t0 + RETRY_GET_HOME));
    let out = tick(&mut core, t0 + RETRY_GET_HOME, &regions, 7);
    assert_eq!(sent(&out), ["ShardStopped 5 to 2"]);
    let out = tick(&mut core, t0 + REREGISTER_AFTER * 2, &regions, 7);
    assert_eq!(sent(&out), ["ShardStopped 5 to 2", "Leave to 2"]);
    // Its next home came (the shard is no longer handed off): no more reports.
    *regions.handed_off.borrow_mut() = false;
    let out = tick(&mut core, t0 + ms(2_000), &regions, 7);
    assert_eq!(sent(&out), ["Leave to 2"]);
    // Nowhere to move the shards: nothing to wait for, nothing sent.
    let mut alone = following(t0, &regions);
    let (wait, out) = alone.begin_leave(t0, &regions, |types| types == ["t"]);
    assert!(!wait && out.is_empty());
}

#[test]
fn a_retired_node_unregisters_again_now_and_then() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    assert_eq!(
        sent(&core.retire(t0, vec!["t".into()])),
        ["Unregister to 2"]
    );
    assert_eq!(sent(&core.register(t0, &regions, 7)), ["Unregister to 2"]);
    assert!(tick(&mut core, t0 + ms(1_999), &regions, 7).is_empty());
    assert_eq!(
        sent(&tick(&mut core, t0 + REREGISTER_AFTER * 4, &regions, 7)),
        ["Unregister to 2"]
    );
    let (_, out) = core.begin_leave(t0, &regions, |_| false);
    assert!(out.is_empty(), "a retired node sends no Leave");
}

#[test]
fn the_coordinators_other_words_reach_the_regions() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    let msgs = [
        ControlMsg::HandOff {
            type_name: "t".into(),
            shard: 2,
            generation: 6,
            epoch: 1,
        },
        ControlMsg::Left {
            type_name: "t".into(),
            nowhere: true,
            epoch: 1,
        },
        ControlMsg::Refused {
            type_name: "t".into(),
            reason: "another fingerprint".into(),
            cluster_fingerprint: Some(2),
            cluster_num_shards: Some(8),
            differing_line: None,
        },
    ];
    let out: Vec<RegionCommand> = msgs
        .into_iter()
        .flat_map(|msg| core.coordinator_said(node(C), msg))
        .collect();
    assert_eq!(
        sent(&out),
        ["hand_off t 2 6", "mark_left t true", "refused t"]
    );
    // Refused counts as heard: no re-registration storm.
    assert_eq!(core.poll_timeout(), Some(t0 + REFRESH_EVERY));
    // What is for the coordinator is not this core's.
    let register = ControlMsg::Register {
        types: Vec::new(),
        epoch: 1,
        quiet_ms: None,
        app_version: None,
    };
    assert!(core.coordinator_said(node(C), register).is_empty());
}

/// After the timed steps at `now`, the next deadline is later than `now`
/// (or there is none): a driver that sleeps until it never spins.
fn assert_no_spin(core: &mut RegionCore, now: Instant, regions: &Fake) {
    tick(core, now, regions, 7);
    if let Some(due) = core.poll_timeout() {
        assert!(
            due > now,
            "a deadline {:?} in the past after a tick",
            now - due
        );
    }
}

#[test]
fn a_tick_leaves_no_deadline_in_the_past() {
    let t0 = Instant::now();
    // A coordinator, and no regions yet.
    let mut regions = Fake::new();
    regions.types.clear();
    let mut core = following(t0, &regions);
    for k in 1..5 {
        assert_no_spin(&mut core, t0 + ms(700 * k), &regions);
    }
    // A graceful leave, then the system stops.
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    let (_, out) = core.begin_leave(t0, &regions, |_| false);
    assert_eq!(sent(&out), ["Leave to 2"]);
    core.retire(t0 + ms(10), vec!["t".into()]);
    for k in 1..5 {
        assert_no_spin(&mut core, t0 + ms(1_100 * k), &regions);
    }
    // Requests and reports with no coordinator: nothing is due.
    let mut core = RegionCore::new(node(ME));
    core.allocate(t0, &regions, "t", 1);
    core.shard_stopped(t0, "t", 2, 3);
    assert_eq!(core.poll_timeout(), None);
    assert!(core.follow(t0, None, &regions, 7).is_empty());
    assert!(core.catch_up(t0, &regions).is_empty());
}

#[test]
fn a_previous_coordinator_still_in_view_keeps_its_handoffs_and_a_downed_leaver_fails_its_asks() {
    let t0 = Instant::now();
    let regions = Fake::new();
    let mut core = following(t0, &regions);
    let up = |n| (n, MemberStatus::Up);
    core.members(&view(&[up(ME), up(C), up(3), (4, MemberStatus::Leaving)]));
    // The role moves to 3 while 2 is still in the view: nothing called off.
    let out = core.follow(t0, Some(node(3)), &regions, 7);
    assert_eq!(sent(&out), ["Register to 3"]);
    // 4 was leaving, then is downed: its asks fail.
    let out = core.members(&view(&[up(ME), up(C), up(3), (4, MemberStatus::Down)]));
    assert_eq!(sent(&out), ["let_go 4"]);
    assert!(RegionCore::is_out(&view(&[(ME, MemberStatus::Removed)])));
}
