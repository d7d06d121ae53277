//! The policies' choices on scripted access sequences (exact victims), and
//! their invariants over random ones.

use std::collections::HashSet;
use std::sync::Arc;

use quickcheck::quickcheck;

use super::Passivator;
use crate::model::config::PassivationPolicy::{self, LeastRecentlyUsed, SegmentedLru, WTinyLfu};

/// Runs `script` (`+id`: start, `id`: a message, `-id`: no longer live)
/// and gives the victims in order.
fn run(p: &mut Passivator, script: &str) -> Vec<String> {
    let mut victims = Vec::new();
    for step in script.split_whitespace() {
        if let Some(id) = step.strip_prefix('+') {
            victims.extend(p.admit(&Arc::from(id)).map(|v| v.to_string()));
        } else if let Some(id) = step.strip_prefix('-') {
            p.remove(id);
        } else {
            p.access(step);
        }
    }
    victims
}

#[test]
fn lru_passivates_the_least_recently_used() {
    let mut p = Passivator::new(LeastRecentlyUsed, 3);
    assert_eq!(run(&mut p, "+a +b +c a +d"), ["b"]);
    assert_eq!(run(&mut p, "c +e"), ["a"]);
    // A removed id makes room without a victim.
    assert_eq!(run(&mut p, "-d +f"), Vec::<String>::new());
    assert_eq!(run(&mut p, "+g"), ["c"]);
}

#[test]
fn segmented_lru_keeps_entities_seen_twice_over_ones_seen_once() {
    // Share 5: protected holds 4.
    let mut p = Passivator::new(SegmentedLru, 5);
    // a, b seen twice (protected); c, d, e once (probation).
    assert_eq!(run(&mut p, "+a a +b b +c +d +e"), Vec::<String>::new());
    // New ones push out probation's oldest, never a or b, though older.
    assert_eq!(run(&mut p, "+f +g +h"), ["c", "d", "e"]);
    // Protected overflow demotes its oldest to probation: a, b, f, g, h
    // seen again fill protected (4) and push a back to probation...
    assert_eq!(run(&mut p, "f g h"), Vec::<String>::new());
    // ...where it is the next victim.
    assert_eq!(run(&mut p, "+i"), ["a"]);
}

#[test]
fn w_tiny_lfu_admits_by_frequency() {
    // Share 100: window 1, main 99.
    let mut p = Passivator::new(WTinyLfu, 100);
    let mut hot = String::new();
    for i in 0..99 {
        hot.push_str(&format!("+h{i} h{i} h{i} "));
    }
    assert_eq!(run(&mut p, &hot), Vec::<String>::new());
    // The window holds h98's successor: a scan of one-off ids passes
    // through the window, each one losing to main's victim.
    assert_eq!(
        run(&mut p, "+s0"),
        Vec::<String>::new(),
        "room for one more"
    );
    assert_eq!(run(&mut p, "+s1 +s2 +s3"), ["s0", "s1", "s2"]);
    // An id accessed more than main's victim is admitted, and the victim
    // (probation's oldest: the first hot id demoted there) goes.
    let victims = run(&mut p, "s3 s3 s3 s3 s3 s3 +s4");
    assert_eq!(victims.len(), 1);
    assert!(victims[0].starts_with('h'), "{victims:?}");
    assert!(p.contains("s3") && p.contains("s4"));
}

#[test]
fn a_smaller_share_passivates_the_excess_in_policy_order() {
    for policy in [LeastRecentlyUsed, SegmentedLru, WTinyLfu] {
        let mut p = Passivator::new(policy, 10);
        run(&mut p, "+a +b +c +d +e a b");
        let victims = p.resize(3);
        assert_eq!(victims.len(), 2, "{policy:?}");
        assert_eq!(p.len(), 3);
        for v in &victims {
            assert!(!p.contains(v));
        }
        // The two seen again stay under every policy.
        assert!(
            p.contains("a") && p.contains("b"),
            "{policy:?}: {victims:?}"
        );
    }
}

#[test]
fn a_new_share_resizes_w_tiny_lfus_window_and_sketch() {
    use super::Kind;
    let lfu = |p: &Passivator| match &p.kind {
        Kind::WTinyLfu(lfu) => (lfu.window.len(), lfu.window_cap, lfu.sketch_for),
        _ => unreachable!(),
    };
    // Share 1000: window 10, filled while the shard is below its share.
    let mut p = Passivator::new(WTinyLfu, 1000);
    for i in 0..10 {
        run(&mut p, &format!("+w{i}"));
    }
    assert_eq!(lfu(&p), (10, 10, 1000));
    // Share 50 (well above the 10 live): the window hands its overflow to
    // the main area (it was stuck at 10 before), the sketch is sized anew.
    assert!(p.resize(50).is_empty());
    assert_eq!(lfu(&p), (1, 1, 50));
    assert_eq!(
        p.len(),
        10,
        "no entity passivated: the share is not exceeded"
    );
    // A share within a factor of two keeps the sketch and its counts.
    p.resize(80);
    assert_eq!(lfu(&p).2, 50);
    // A share of every entry there could be neither panics nor allocates
    // for it: the sketch stops growing at 4 Mi entries.
    let mut huge = Passivator::new(WTinyLfu, usize::MAX);
    assert!(run(&mut huge, "+a +b a").is_empty());
}

#[derive(Clone, Debug)]
enum Op {
    Start(u8),
    Touch(u8),
    Gone(u8),
    Resize(u8),
}

impl quickcheck::Arbitrary for Op {
    fn arbitrary(g: &mut quickcheck::Gen) -> Self {
        let id = u8::arbitrary(g) % 40;
        match u8::arbitrary(g) % 10 {
            0..=3 => Op::Start(id),
            4..=7 => Op::Touch(id),
            8 => Op::Gone(id),
            _ => Op::Resize(id % 20),
        }
    }
}

/// Against a model set: the tracked ids are exactly the live ones, never
/// more than the share; a victim was live and is not the id starting.
fn keeps_its_invariants(policy: PassivationPolicy, share: u8, ops: Vec<Op>) -> bool {
    let mut p = Passivator::new(policy, usize::from(share % 20));
    let mut live: HashSet<String> = HashSet::new();
    for op in ops {
        match op {
            Op::Start(i) => {
                let id = format!("e{i}");
                if live.contains(&id) {
                    p.access(&id);
                    continue;
                }
                if let Some(victim) = p.admit(&Arc::from(id.as_str()))
                    && (*victim == *id || !live.remove(&*victim))
                {
                    return false;
                }
                live.insert(id);
            }
            Op::Touch(i) => {
                let id = format!("e{i}");
                if live.contains(&id) {
                    p.access(&id);
                }
            }
            Op::Gone(i) => {
                let id = format!("e{i}");
                live.remove(&id);
                p.remove(&id);
            }
            Op::Resize(n) => {
                for victim in p.resize(usize::from(n)) {
                    if !live.remove(&*victim) {
                        return false;
                    }
                }
            }
        }
        if p.len() != live.len() || p.len() > p.share() || !live.iter().all(|id| p.contains(id)) {
            return false;
        }
    }
    true
}

quickcheck! {
    fn lru_keeps_its_invariants(share: u8, ops: Vec<Op>) -> bool {
        keeps_its_invariants(LeastRecentlyUsed, share, ops)
    }
    fn segmented_lru_keeps_its_invariants(share: u8, ops: Vec<Op>) -> bool {
        keeps_its_invariants(SegmentedLru, share, ops)
    }
    fn w_tiny_lfu_keeps_its_invariants(share: u8, ops: Vec<Op>) -> bool {
        keeps_its_invariants(WTinyLfu, share, ops)
    }
}
