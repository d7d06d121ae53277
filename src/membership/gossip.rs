//! The gossiped cluster state and its merge.
//!
//! A [`Gossip`] holds two things:
//!
//! * the **member table**: one status per member, keyed by the member's full
//!   identity. Statuses only grow (see [`MemberStatus`]), so two tables merge
//!   by taking the higher status per member — a join-semilattice.
//! * the **reachability table**: one row per *observer*, written only by that
//!   observer, holding a version and the set of members it currently cannot
//!   hear. Rows merge by keeping the higher version. An honest observer never
//!   writes two different rows at one version; should that happen anyway,
//!   equal versions merge by set union, which keeps the merge a semilattice.
//!
//! After every merge the state is *normalised*: rows of observers that are
//! Down or Removed are dropped, and Down or Removed subjects are dropped from
//! every row. Normalisation depends only on the (monotone) member table, so
//! `merge` is commutative, associative and idempotent; the property tests in
//! this module check those laws on random states.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use super::status::MemberStatus;
use crate::model::identity::UniqueAddress;

/// A member identity ordered by age: `(incarnation, node_id)`, then address.
///
/// `UniqueAddress` itself has no total order; this wrapper gives the maps
/// their order, so iterating a table visits members oldest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MemberKey(pub(crate) UniqueAddress);

impl MemberKey {
    fn sort_key(&self) -> (u64, crate::model::identity::NodeId, SocketAddr) {
        (self.0.incarnation, self.0.node_id, self.0.addr)
    }
}

impl Ord for MemberKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.sort_key().cmp(&other.sort_key())
    }
}

impl PartialOrd for MemberKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// One observer's reachability row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct ObserverRow {
    pub(crate) version: u64,
    pub(crate) unreachable: BTreeSet<MemberKey>,
}

impl ObserverRow {
    /// Folds `other` into `self`: the higher version wins; equal versions
    /// take the union (only reachable through a misbehaving writer).
    fn absorb(&mut self, other: &ObserverRow) {
        match other.version.cmp(&self.version) {
            Ordering::Greater => *self = other.clone(),
            Ordering::Equal => self.unreachable.extend(other.unreachable.iter().copied()),
            Ordering::Less => {}
        }
    }
}

/// The cluster state every member gossips: member statuses and reachability.
///
/// Opaque on purpose: the driver only carries it inside a
/// [`MembershipMsg`](super::MembershipMsg). Read it through
/// [`Gossip::members`] and [`Gossip::unreachable`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "GossipWire", into = "GossipWire")]
pub struct Gossip {
    members: BTreeMap<MemberKey, MemberStatus>,
    rows: BTreeMap<MemberKey, ObserverRow>,
}

/// The wire form: plain lists, so any serde format can carry it.
#[derive(Serialize, Deserialize)]
struct GossipWire {
    members: Vec<(UniqueAddress, MemberStatus)>,
    reachability: Vec<(UniqueAddress, u64, Vec<UniqueAddress>)>,
}

impl From<Gossip> for GossipWire {
    fn from(g: Gossip) -> Self {
        GossipWire {
            members: g.members.iter().map(|(k, s)| (k.0, *s)).collect(),
            reachability: g
                .rows
                .iter()
                .map(|(o, r)| (o.0, r.version, r.unreachable.iter().map(|k| k.0).collect()))
                .collect(),
        }
    }
}

impl From<GossipWire> for Gossip {
    /// Duplicates in the input are folded with the merge rules, so decoding
    /// never fails and never depends on the order of the lists.
    fn from(w: GossipWire) -> Self {
        let mut g = Gossip::default();
        for (addr, status) in w.members {
            let slot = g.members.entry(MemberKey(addr)).or_insert(status);
            *slot = (*slot).max(status);
        }
        for (observer, version, subjects) in w.reachability {
            let row = ObserverRow {
                version,
                unreachable: subjects
                    .into_iter()
                    .map(MemberKey)
                    .filter(|s| s.0 != observer)
                    .collect(),
            };
            g.rows.entry(MemberKey(observer)).or_default().absorb(&row);
        }
        g.normalize();
        g
    }
}

impl Gossip {
    /// The status of `member`, if the table knows it (Removed members are
    /// kept as tombstones and still answer `Some(Removed)`).
    pub fn status_of(&self, member: &UniqueAddress) -> Option<MemberStatus> {
        self.members.get(&MemberKey(*member)).copied()
    }

    /// Every member with its status, oldest first.
    pub fn members(&self) -> impl Iterator<Item = (UniqueAddress, MemberStatus)> + '_ {
        self.members.iter().map(|(k, s)| (k.0, *s))
    }

    /// Live members that at least one live observer cannot hear, oldest first.
    pub fn unreachable(&self) -> Vec<UniqueAddress> {
        self.unreachable_keys().into_iter().map(|k| k.0).collect()
    }

    pub(crate) fn unreachable_keys(&self) -> BTreeSet<MemberKey> {
        self.rows
            .values()
            .flat_map(|r| r.unreachable.iter().copied())
            .collect()
    }

    pub(crate) fn status(&self, key: &MemberKey) -> Option<MemberStatus> {
        self.members.get(key).copied()
    }

    pub(crate) fn member_keys(&self) -> impl Iterator<Item = (MemberKey, MemberStatus)> + '_ {
        self.members.iter().map(|(k, s)| (*k, *s))
    }

    /// Writes a status without checking the transition; callers check it.
    pub(crate) fn put_status(&mut self, key: MemberKey, status: MemberStatus) {
        self.members.insert(key, status);
    }

    /// Whether `observer`'s own row lists `subject` as unreachable.
    pub(crate) fn observes_unreachable(&self, observer: &MemberKey, subject: &MemberKey) -> bool {
        self.rows
            .get(observer)
            .is_some_and(|r| r.unreachable.contains(subject))
    }

    /// The members `observer`'s own row flags.
    pub(crate) fn row_subjects(
        &self,
        observer: &MemberKey,
    ) -> impl Iterator<Item = MemberKey> + '_ {
        self.rows
            .get(observer)
            .into_iter()
            .flat_map(|r| r.unreachable.iter().copied())
    }

    /// The observers whose rows flag `subject`.
    pub(crate) fn observers_of<'a>(
        &'a self,
        subject: &'a MemberKey,
    ) -> impl Iterator<Item = MemberKey> + 'a {
        self.rows
            .iter()
            .filter(|(_, r)| r.unreachable.contains(subject))
            .map(|(o, _)| *o)
    }

    /// Records in `observer`'s row whether `subject` is unreachable, bumping
    /// the row version on a change. Returns whether anything changed.
    pub(crate) fn observe(
        &mut self,
        observer: MemberKey,
        subject: MemberKey,
        unreachable: bool,
    ) -> bool {
        if observer == subject {
            return false;
        }
        let row = self.rows.entry(observer).or_default();
        let changed = if unreachable {
            row.unreachable.insert(subject)
        } else {
            row.unreachable.remove(&subject)
        };
        if changed {
            row.version = row.version.saturating_add(1);
        }
        changed
    }

    /// A state in which every one of `members` is Up (simulations).
    #[cfg(test)]
    pub(crate) fn formed_for_tests(members: &[UniqueAddress]) -> Gossip {
        let mut g = Gossip::default();
        for m in members {
            g.put_status(MemberKey(*m), MemberStatus::Up);
        }
        g
    }

    /// The least upper bound of two states (commutative, associative,
    /// idempotent).
    pub fn merge(&self, other: &Gossip) -> Gossip {
        let mut out = self.clone();
        for (k, s) in &other.members {
            let slot = out.members.entry(*k).or_insert(*s);
            *slot = (*slot).max(*s);
        }
        for (o, row) in &other.rows {
            out.rows.entry(*o).or_default().absorb(row);
        }
        out.normalize();
        out
    }

    /// Drops what the member table has made meaningless: rows of observers
    /// that are not live members, and non-live subjects in every row.
    pub(crate) fn normalize(&mut self) {
        let members = &self.members;
        let live = |k: &MemberKey| members.get(k).is_some_and(|s| s.is_live());
        self.rows.retain(|o, _| live(o));
        for row in self.rows.values_mut() {
            row.unreachable.retain(|s| live(s));
        }
        // An empty row at version 0 carries nothing; drop it so that a row
        // created and never written does not make two equal states differ.
        self.rows
            .retain(|_, r| r.version > 0 || !r.unreachable.is_empty());
    }

    /// A 64-bit FNV-1a digest of the whole state, stable across builds and
    /// platforms. Members compare digests to learn whether they have seen the
    /// same state (the leader's convergence check).
    pub fn digest(&self) -> u64 {
        let mut h = Fnv::new();
        h.u64(self.members.len() as u64);
        for (k, s) in &self.members {
            h.member(&k.0);
            h.u64(u64::from(s.rank()));
        }
        h.u64(self.rows.len() as u64);
        for (o, r) in &self.rows {
            h.member(&o.0);
            h.u64(r.version);
            h.u64(r.unreachable.len() as u64);
            for s in &r.unreachable {
                h.member(&s.0);
            }
        }
        h.0
    }
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn bytes(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    fn member(&mut self, m: &UniqueAddress) {
        self.u64(m.incarnation);
        self.u64(m.node_id.0);
        match m.addr {
            SocketAddr::V4(a) => {
                self.bytes(&[4]);
                self.bytes(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                self.bytes(&[6]);
                self.bytes(&a.ip().octets());
            }
        }
        self.bytes(&m.addr.port().to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::identity::NodeId;
    use quickcheck::{Arbitrary, Gen};
    use quickcheck_macros::quickcheck;

    fn member(i: u8) -> UniqueAddress {
        UniqueAddress {
            addr: SocketAddr::from(([127, 0, 0, 1], 7000 + u16::from(i % 3))),
            node_id: NodeId(u64::from(i) * 7919),
            incarnation: u64::from(i / 2),
        }
    }

    const STATUSES: [MemberStatus; 6] = [
        MemberStatus::Joining,
        MemberStatus::Up,
        MemberStatus::Leaving,
        MemberStatus::Exiting,
        MemberStatus::Down,
        MemberStatus::Removed,
    ];

    impl Arbitrary for Gossip {
        fn arbitrary(g: &mut Gen) -> Self {
            let mut out = Gossip::default();
            for _ in 0..(u8::arbitrary(g) % 6) {
                let m = u8::arbitrary(g) % 6;
                let s = STATUSES[usize::from(u8::arbitrary(g) % 6)];
                out.put_status(MemberKey(member(m)), s);
            }
            for _ in 0..(u8::arbitrary(g) % 6) {
                let o = MemberKey(member(u8::arbitrary(g) % 6));
                let row = out.rows.entry(o).or_default();
                row.version = u64::from(u8::arbitrary(g) % 4);
                let subject = MemberKey(member(u8::arbitrary(g) % 6));
                if subject != o {
                    row.unreachable.insert(subject);
                }
            }
            out.normalize();
            out
        }
    }

    #[quickcheck]
    fn merge_is_commutative(a: Gossip, b: Gossip) -> bool {
        a.merge(&b) == b.merge(&a)
    }

    #[quickcheck]
    fn merge_is_associative(a: Gossip, b: Gossip, c: Gossip) -> bool {
        a.merge(&b).merge(&c) == a.merge(&b.merge(&c))
    }

    #[quickcheck]
    fn merge_is_idempotent_and_an_upper_bound(a: Gossip, b: Gossip) -> bool {
        let m = a.merge(&b);
        a.merge(&a) == a && m.merge(&a) == m && m.merge(&b) == m
    }

    #[quickcheck]
    fn wire_round_trip_is_identity(a: Gossip) -> bool {
        let wire: GossipWire = a.clone().into();
        Gossip::from(wire) == a
    }

    #[test]
    fn status_merge_takes_the_higher_status() {
        let mut a = Gossip::default();
        let mut b = Gossip::default();
        a.put_status(MemberKey(member(1)), MemberStatus::Up);
        b.put_status(MemberKey(member(1)), MemberStatus::Leaving);
        b.put_status(MemberKey(member(2)), MemberStatus::Joining);
        let m = a.merge(&b);
        assert_eq!(m.status_of(&member(1)), Some(MemberStatus::Leaving));
        assert_eq!(m.status_of(&member(2)), Some(MemberStatus::Joining));
    }

    #[test]
    fn downed_subject_leaves_every_row_and_downed_observer_row_goes() {
        let (a, b, c) = (
            MemberKey(member(1)),
            MemberKey(member(2)),
            MemberKey(member(3)),
        );
        let mut g = Gossip::default();
        for k in [a, b, c] {
            g.put_status(k, MemberStatus::Up);
        }
        assert!(g.observe(a, c, true));
        assert!(g.observe(c, b, true));
        assert_eq!(g.unreachable_keys(), BTreeSet::from([b, c]));
        g.put_status(c, MemberStatus::Down);
        g.normalize();
        assert!(g.unreachable_keys().is_empty(), "{g:?}");
    }

    #[test]
    fn digest_differs_when_state_differs() {
        let mut a = Gossip::default();
        a.put_status(MemberKey(member(1)), MemberStatus::Up);
        let mut b = a.clone();
        assert_eq!(a.digest(), b.digest());
        b.put_status(MemberKey(member(1)), MemberStatus::Leaving);
        assert_ne!(a.digest(), b.digest());
    }
}
