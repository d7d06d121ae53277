//! Dissemination: gossip rounds, digests and whole states sent to a few
//! members, and the random choice of whom.

use std::collections::BTreeSet;
use std::time::Instant;

use super::MembershipCore;
use crate::membership::gossip::MemberKey;
use crate::membership::protocol::MembershipMsg;

impl MembershipCore {
    /// One gossip round: the digest to `gossip_fanout` random members, and
    /// to the leader when it has not had this node's current digest (or,
    /// against loss, every tenth round).
    pub(super) fn gossip_round(&mut self) {
        self.gossip_rounds = self.gossip_rounds.wrapping_add(1);
        let mut to: BTreeSet<MemberKey> = self
            .random_others(self.config.gossip_fanout)
            .into_iter()
            .collect();
        if let Some(l) = self.leader
            && l != self.key
            && (self.reported != Some((l, self.digest)) || self.gossip_rounds.is_multiple_of(10))
        {
            to.insert(l);
        }
        for k in to {
            self.send_digest(k);
        }
    }

    /// Sends this node's digest (a `Heartbeat`) to `k`.
    pub(super) fn send_digest(&mut self, k: MemberKey) {
        if self.leader == Some(k) {
            self.reported = Some((k, self.digest));
        }
        self.send(
            k.0,
            MembershipMsg::Heartbeat {
                digest: self.digest,
            },
        );
    }

    /// Sends this node's whole state to `k`.
    pub(super) fn send_state(&mut self, k: MemberKey, now: Instant) {
        if self.leader == Some(k) {
            self.reported = Some((k, self.digest));
        }
        self.sent_state.insert(k, (self.digest, now));
        self.send(
            k.0,
            MembershipMsg::Gossip {
                gossip: self.gossip.clone(),
            },
        );
    }

    /// Up to `n` distinct random live members other than this node.
    /// Where a change spreads: `gossip_fanout` random live members and the
    /// leader.
    pub(super) fn spread_targets(&mut self) -> BTreeSet<MemberKey> {
        let mut to: BTreeSet<MemberKey> = self
            .random_others(self.config.gossip_fanout)
            .into_iter()
            .collect();
        to.extend(self.leader.filter(|l| *l != self.key));
        to
    }

    fn random_others(&mut self, n: usize) -> Vec<MemberKey> {
        let others: Vec<MemberKey> = self
            .ring
            .iter()
            .copied()
            .filter(|k| *k != self.key)
            .collect();
        if others.len() <= n {
            return others;
        }
        let mut picked: Vec<MemberKey> = Vec::with_capacity(n);
        while picked.len() < n {
            let k = others[(self.next_random() % others.len() as u64) as usize];
            if !picked.contains(&k) {
                picked.push(k);
            }
        }
        picked
    }

    fn next_random(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}
