//! Placement by traffic through the real core: reports in, handoffs to
//! the named node out, by exact commands; and rounds played to the end.

use super::*;
use crate::model::config::PlacementByTraffic;

/// A coordinator at node 1 with nodes 1..=n Up and registered, settled,
/// placing by traffic under `rule` (`None`: by count alone), its
/// `shards` shards allocated in order (least-shards: shard `s` on node
/// `s mod n`).
fn placed(
    n: u16,
    shards: u32,
    rule: Option<PlacementByTraffic>,
) -> (CoordinatorCore, Instant, Vec<UniqueAddress>) {
    let t0 = Instant::now();
    let nodes: Vec<UniqueAddress> = (1..=n).map(node).collect();
    let config = CoordinatorConfig {
        placement_by_traffic: rule,
        ..CoordinatorConfig::default()
    };
    let mut c = CoordinatorCore::new(nodes[0], config, Box::new(LeastShardAllocation));
    c.set_membership(t0, &view(nodes[0], &nodes, &[], &[]));
    for a in &nodes {
        c.register(t0, *a, &reg(shards, vec![]));
    }
    for shard in 0..shards {
        c.get_home(t0, nodes[0], TYPE, shard, 0);
        let owner = c.home(TYPE, shard).expect("allocated").owner;
        assert_eq!(owner, nodes[shard as usize % nodes.len()]);
    }
    (c, t0, nodes)
}

/// `count` messages between shards `a` and `b` of the type.
fn report(a: u32, b: u32, count: u64) -> Vec<(String, u32, String, u32, u64)> {
    vec![(TYPE.into(), a, TYPE.into(), b, count)]
}

fn on() -> Option<PlacementByTraffic> {
    Some(PlacementByTraffic::default())
}

#[test]
fn a_shard_moves_to_the_node_it_talks_to_and_the_counts_stay_within_the_slack() {
    let (mut c, t0, n) = placed(3, 6, on());
    c.traffic(&report(0, 1, 800));
    let now = t0 + first_rebalance();
    // Both ends would gain 800: the lower goes, from node 1 to node 2.
    assert_eq!(handoffs_in(&c.tick(now)), vec![(n[0], 0, 1)]);
    let out = c.shard_stopped(now, n[0], TYPE, 0, 1);
    // To the node the round named, though node 1 now has fewest (with
    // the old owner named, for the states its entities handed over).
    let moved = |to| {
        let mut msg = home(to, 0, n[1], 2);
        if let Command::Send {
            msg: ControlMsg::Home { from, .. },
            ..
        } = &mut msg
        {
            *from = Some(n[0]);
        }
        msg
    };
    assert_eq!(out, vec![moved(n[0]), moved(n[1]), moved(n[2])]);
    let round = c.rounds().last().expect("a round");
    assert_eq!(round.reason, RebalanceReason::Traffic);
    assert_eq!(round.moves.len(), 1);
    // Together now: more of the same moves nothing, and counts of 1, 3
    // and 2 are within the slack of 2, so the count rebalance keeps away.
    let mut now = now;
    for _ in 0..5 {
        c.traffic(&report(1, 0, 800));
        now += CoordinatorConfig::default().rebalance_interval;
        assert_eq!(handoffs_in(&c.tick(now)), vec![]);
    }
    assert_eq!(
        counts(&c, 6).values().copied().collect::<Vec<_>>(),
        vec![1, 3, 2]
    );
}

#[test]
fn without_placement_by_traffic_reports_move_nothing() {
    let (mut c, t0, _) = placed(3, 6, None);
    c.traffic(&report(0, 1, 800));
    assert_eq!(handoffs_in(&c.tick(t0 + first_rebalance())), vec![]);
}

#[test]
fn a_report_naming_an_unknown_type_or_shard_is_left_out() {
    let (mut c, t0, _) = placed(3, 6, on());
    c.traffic(&[
        (TYPE.into(), 0, "other".into(), 1, 800),
        (TYPE.into(), 0, TYPE.into(), 6, 800),
    ]);
    assert_eq!(c.traffic.len(), 0, "nothing kept");
    assert_eq!(handoffs_in(&c.tick(t0 + first_rebalance())), vec![]);
    c.traffic(&report(0, 1, 800));
    assert_eq!(c.traffic.len(), 1);
}

#[test]
fn a_core_that_does_not_act_keeps_no_traffic_and_forgets_it_when_it_stops() {
    let (mut c, t0, n) = placed(3, 6, on());
    c.traffic(&report(0, 1, 800));
    assert_eq!(c.traffic.len(), 1);
    // Node 1 is seen unreachable: node 2 acts; this core stops, forgets,
    // and keeps nothing while it does not act.
    c.set_membership(t0, &view(n[0], &n, &[], &[n[0]]));
    assert!(!c.is_active());
    assert_eq!(c.traffic.len(), 0, "forgotten");
    c.traffic(&report(0, 1, 800));
    assert_eq!(c.traffic.len(), 0, "not kept while inactive");
    // Acting again, it starts with nothing: no move for old traffic.
    c.set_membership(t0, &view(n[0], &n, &[], &[]));
    assert!(c.is_active());
    for a in &n {
        c.register(t0, *a, &reg(6, vec![]));
    }
    let later = t0 + first_rebalance() + CoordinatorConfig::default().settle;
    assert_eq!(handoffs_in(&c.tick(later)), vec![]);
}

#[test]
fn every_round_halves_what_was_reported() {
    // min_gain 500: 300 moves nothing; 300 more a round later makes 450,
    // not 600, so nothing still; 600 at once would.
    let rule = Some(PlacementByTraffic::default().with_min_gain(500));
    let (mut c, t0, _) = placed(3, 6, rule);
    c.traffic(&report(0, 1, 300));
    let mut now = t0 + first_rebalance();
    assert_eq!(handoffs_in(&c.tick(now)), vec![]);
    c.traffic(&report(0, 1, 300));
    now += CoordinatorConfig::default().rebalance_interval;
    assert_eq!(handoffs_in(&c.tick(now)), vec![]);
    let (mut c, t0, n) = placed(3, 6, rule);
    c.traffic(&report(0, 1, 600));
    assert_eq!(
        handoffs_in(&c.tick(t0 + first_rebalance())),
        vec![(n[0], 0, 1)]
    );
}

#[test]
fn a_target_no_longer_a_candidate_leaves_the_choice_to_the_strategy() {
    let (mut c, t0, n) = placed(3, 6, on());
    c.traffic(&report(0, 1, 800));
    let now = t0 + first_rebalance();
    assert_eq!(handoffs_in(&c.tick(now)), vec![(n[0], 0, 1)]);
    // Node 2, the target, is unreachable when the shard has stopped: the
    // strategy places it, on the member with fewest among the others
    // (node 1, which has one shard left against node 3's two).
    c.set_membership(now, &view(n[0], &n, &[], &[n[1]]));
    c.shard_stopped(now, n[0], TYPE, 0, 1);
    assert_eq!(c.home(TYPE, 0).map(|h| h.owner), Some(n[0]));
}

#[test]
fn counts_further_apart_than_the_slack_are_spread_by_the_strategy() {
    // Twelve shards on two nodes; a third joins: 6, 6 and 0 are more than
    // the slack apart, and the count rounds run as without traffic.
    let (mut c, t0, n) = placed(2, 12, on());
    let third = node(3);
    let all = vec![n[0], n[1], third];
    c.set_membership(t0, &view(n[0], &all, &[], &[]));
    c.register(t0, third, &reg(12, vec![]));
    let now = t0 + first_rebalance();
    let asked = handoffs_in(&c.tick(now));
    assert_eq!(
        asked.len(),
        CoordinatorConfig::default().rebalance_per_round
    );
    for (owner, shard, generation) in asked {
        c.shard_stopped(now, owner, TYPE, shard, generation);
        assert_eq!(c.home(TYPE, shard).map(|h| h.owner), Some(third));
    }
    let round = c.rounds().last().expect("a round");
    assert_eq!(round.reason, RebalanceReason::GracefulSpread);
}

/// W6's shape on one type: shard `s` talks to shard `s + 32` of 64, each
/// round the same. The rounds, with every handoff finished at once,
/// bring every pair onto one node within the slack, move at most
/// `max_moves` shards a round and each pair's shards at most twice, and
/// then move nothing more.
#[test]
fn rounds_bring_talking_shards_together_and_then_stay() {
    let rule = PlacementByTraffic::default();
    let (mut c, t0, _) = placed(3, 64, Some(rule));
    let pairs: Vec<(u32, u32)> = (0..32).map(|s| (s, s + 32)).collect();
    let together = |c: &CoordinatorCore| {
        pairs
            .iter()
            .filter(|(a, b)| c.home(TYPE, *a).map(|h| h.owner) == c.home(TYPE, *b).map(|h| h.owner))
            .count()
    };
    let before = together(&c);
    let mut moved: BTreeMap<u32, usize> = BTreeMap::new();
    let mut now = t0 + first_rebalance();
    let mut quiet_rounds = 0;
    for _ in 0..60 {
        for (a, b) in &pairs {
            c.traffic(&report(*a, *b, 400));
        }
        let asked = handoffs_in(&c.tick(now));
        assert!(
            asked.len() <= rule.max_moves,
            "{} moves in a round",
            asked.len()
        );
        for (owner, shard, generation) in &asked {
            *moved.entry(*shard).or_default() += 1;
            c.shard_stopped(now, *owner, TYPE, *shard, *generation);
        }
        quiet_rounds = if asked.is_empty() {
            quiet_rounds + 1
        } else {
            0
        };
        let counts = counts(&c, 64);
        let spread = counts.values().max().unwrap() - counts.values().min().unwrap();
        assert!(spread <= rule.slack, "counts {counts:?}");
        now += CoordinatorConfig::default().rebalance_interval;
    }
    assert!(quiet_rounds >= 20, "still moving: {moved:?}");
    // Least-shards dealt every pair apart (shard s on node s mod 3, its
    // partner on node s + 2 mod 3); the rounds bring every one together.
    assert_eq!(before, 0);
    assert_eq!(together(&c), 32, "moves {moved:?}");
    assert!(moved.values().all(|m| *m <= 2), "{moved:?}");
}
