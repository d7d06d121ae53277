//! The monitoring ring: who heartbeats whom.
//!
//! The live members, sorted by age ([`MemberKey`] order), form a ring. A
//! member is *watched by* the members that precede it on the ring, walking
//! backwards and taking every member met until `k` reachable ones have been
//! taken (unreachable ones are taken too, but do not count): so every member
//! keeps `k` reachable watchers while some of its nearer ones are flagged,
//! and a flagged watcher keeps its duty (it may come back). Walking forwards
//! with the same rule gives the members a node *watches*; the two walks are
//! inverse relations: `w` watches `m` exactly when fewer than `k` reachable
//! members lie strictly between `w` and `m` on the ring, going forwards from
//! `w`. A cluster of at most `k + 1` members is watched all-to-all.
//!
//! A join inserts one member: its `k` predecessors start watching it and
//! each drops its farthest member, which the newcomer watches instead;
//! nothing else moves.

use std::collections::BTreeSet;

use super::gossip::MemberKey;

/// The members `ring[from]` watches (forwards walk).
pub(crate) fn watched_by(
    ring: &[MemberKey],
    from: usize,
    unreachable: &BTreeSet<MemberKey>,
    k: usize,
) -> Vec<MemberKey> {
    walk(ring, from, unreachable, k, true)
}

/// The members that watch `ring[of]` (backwards walk): where its heartbeats go.
pub(crate) fn watchers_of(
    ring: &[MemberKey],
    of: usize,
    unreachable: &BTreeSet<MemberKey>,
    k: usize,
) -> Vec<MemberKey> {
    walk(ring, of, unreachable, k, false)
}

fn walk(
    ring: &[MemberKey],
    start: usize,
    unreachable: &BTreeSet<MemberKey>,
    k: usize,
    forwards: bool,
) -> Vec<MemberKey> {
    let n = ring.len();
    let mut out = Vec::new();
    let mut reachable = 0;
    for step in 1..n {
        if reachable >= k {
            break;
        }
        let i = if forwards {
            (start + step) % n
        } else {
            (start + n - step) % n
        };
        let m = ring[i];
        out.push(m);
        if !unreachable.contains(&m) {
            reachable += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::identity::{NodeId, UniqueAddress};
    use quickcheck_macros::quickcheck;
    use std::net::SocketAddr;

    fn key(i: u64) -> MemberKey {
        MemberKey(UniqueAddress {
            addr: SocketAddr::from(([127, 0, 0, 1], 7000 + i as u16)),
            node_id: NodeId(i),
            incarnation: i,
        })
    }

    fn ring(n: u64) -> Vec<MemberKey> {
        (0..n).map(key).collect()
    }

    #[quickcheck]
    fn the_two_walks_are_inverse_and_everyone_keeps_k_reachable_watchers(
        n: u8,
        k: u8,
        flagged: Vec<u8>,
    ) -> bool {
        let n = u64::from(n % 40) + 1;
        let k = usize::from(k % 9) + 1;
        let r = ring(n);
        let unreachable: BTreeSet<MemberKey> =
            flagged.iter().map(|f| key(u64::from(*f) % n)).collect();
        let reachable_total = r.iter().filter(|m| !unreachable.contains(m)).count();
        for (i, m) in r.iter().enumerate() {
            let watchers = watchers_of(&r, i, &unreachable, k);
            for (j, w) in r.iter().enumerate() {
                let forwards = watched_by(&r, j, &unreachable, k).contains(m);
                if forwards != watchers.contains(w) {
                    return false;
                }
            }
            let reachable_watchers = watchers.iter().filter(|w| !unreachable.contains(w)).count();
            let others_reachable = reachable_total - usize::from(!unreachable.contains(m));
            if reachable_watchers != k.min(others_reachable) {
                return false;
            }
        }
        true
    }

    #[test]
    fn a_join_moves_k_watch_relations_and_small_clusters_are_all_to_all() {
        let none = BTreeSet::new();
        let r = ring(4);
        for i in 0..4 {
            assert_eq!(watchers_of(&r, i, &none, 5).len(), 3);
        }
        let before = ring(20);
        let mut after = before.clone();
        after.insert(10, key(100)); // a newcomer sorted between 9 and 10
        let pairs = |r: &[MemberKey]| -> BTreeSet<(MemberKey, MemberKey)> {
            (0..r.len())
                .flat_map(|i| {
                    watched_by(r, i, &none, 5)
                        .into_iter()
                        .map(move |m| (r[i], m))
                })
                .collect()
        };
        let (b, a) = (pairs(&before), pairs(&after));
        // Its 5 predecessors each drop their farthest member, which the
        // newcomer watches instead; nothing else moves.
        assert_eq!(b.difference(&a).count(), 5, "dropped");
        assert_eq!(a.difference(&b).count(), 10, "added");
        assert!(
            a.difference(&b)
                .all(|(w, m)| *w == key(100) || *m == key(100))
        );
    }
}
