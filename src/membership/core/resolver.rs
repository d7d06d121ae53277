//! The split-brain resolver: this node's side of a partition, how long the
//! members beyond it have been the same, and the strategy's verdict.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::MembershipCore;
use crate::membership::config::SplitBrainStrategy;
use crate::membership::error::MembershipError;
use crate::membership::gossip::MemberKey;
use crate::membership::ring;
use crate::membership::status::MemberStatus;

impl MembershipCore {
    /// This node's side: the closure, from this node, over *watch links*
    /// that neither end flags. A watch link goes from a member of the side
    /// to a member it watches in this node's view of the ring (or flags);
    /// only the watcher's row is evidence that it hears the member, and
    /// that row is fresh because the watcher is on this side. A member that
    /// flags the watcher (it cannot hear it) does not join through that
    /// link. One bad link between two members that others watch leaves all
    /// of them on one side. With at most `monitored_by + 1` members every
    /// pair is linked both ways: the closure over all links neither end
    /// flags, as before rings.
    fn side(&self) -> BTreeSet<MemberKey> {
        let ring: Vec<MemberKey> = self.live_keys().into_iter().collect();
        let unreachable = self.gossip.unreachable_keys();
        let k = self.config.monitored_by;
        let mut side = BTreeSet::from([self.key]);
        let mut frontier = vec![self.key];
        while let Some(observer) = frontier.pop() {
            let Ok(at) = ring.binary_search(&observer) else {
                continue;
            };
            for m in ring::watched_by(&ring, at, &unreachable, k) {
                if !side.contains(&m)
                    && !self.gossip.observes_unreachable(&observer, &m)
                    && !self.gossip.observes_unreachable(&m, &observer)
                {
                    side.insert(m);
                    frontier.push(m);
                }
            }
        }
        side
    }

    /// Follows the members beyond this node's side: the set, and since when
    /// it has been the same (any change, an empty set included, starts the
    /// wait over).
    pub(super) fn track_partition(&mut self, now: Instant, unreachable: &BTreeSet<MemberKey>) {
        // Nobody flagged: everyone is on this side (the common case, at
        // every input; the closure below is quadratic).
        let beyond: BTreeSet<MemberKey> = if unreachable.is_empty() {
            BTreeSet::new()
        } else {
            let side = self.side();
            self.live_keys().difference(&side).copied().collect()
        };
        if beyond.is_empty() {
            self.partition_changed |= self.partition.is_some();
            self.partition = None;
            self.partitioned_since = None;
            self.judged = false;
        } else {
            self.partitioned_since.get_or_insert(now);
            if self
                .partition
                .as_ref()
                .is_none_or(|(seen, _)| *seen != beyond)
            {
                self.partition = Some((beyond, now));
                self.partition_changed = true;
                self.judged = false;
            }
        }
    }

    /// How long a side may stay partitioned without its view ever holding
    /// still for `stable_after` before it gives up and downs itself.
    ///
    /// On a ring that is not all-to-all, a partition is seen whole only
    /// step by step: the watchers at its edge flag the members they watch
    /// beyond it, then watch the next ones (which get a grace before the
    /// detector counts), and so on — about one [detection
    /// step](crate::membership::MembershipConfig::detection_step) per
    /// `monitored_by` members beyond. The limit allows one such step per
    /// `monitored_by` live members beyond the first (none up to
    /// `monitored_by` members; one at `monitored_by + 1`, which is still
    /// watched all-to-all: a step too many, on the safe side).
    pub(super) fn unstable_limit(&self) -> Duration {
        self.config.unstable_limit(self.ring.len())
    }

    /// Whether this side stays under `strategy`. Joining members count in
    /// the cluster's size but not for a side, nor as the oldest or the
    /// lowest address (one side may not have heard of a joiner at all).
    fn side_stays(
        &self,
        strategy: SplitBrainStrategy,
        side: &BTreeSet<MemberKey>,
        live: &BTreeSet<MemberKey>,
    ) -> bool {
        let settled = |k: &&MemberKey| self.gossip.status(k) != Some(MemberStatus::Joining);
        let s = side.iter().filter(settled).count();
        let n = live.len();
        let beyond: Vec<&MemberKey> = live.iter().filter(|k| !side.contains(k)).collect();
        match strategy {
            SplitBrainStrategy::KeepMajority => {
                if 2 * s != n {
                    2 * s > n
                } else {
                    live.iter()
                        .filter(settled)
                        .map(|k| k.0.addr)
                        .min()
                        .is_some_and(|lowest| side.iter().any(|k| k.0.addr == lowest))
                }
            }
            // A cluster of 2q or more could hold two quorums: nobody stays.
            SplitBrainStrategy::StaticQuorum(quorum) => s >= quorum && n < 2 * quorum,
            SplitBrainStrategy::KeepOldest { down_if_alone } => {
                let oldest = live.iter().filter(settled).min_by_key(|k| k.0.age_key());
                match oldest {
                    Some(o) if side.contains(o) => !(down_if_alone && s == 1 && !beyond.is_empty()),
                    Some(_) => down_if_alone && beyond.len() == 1,
                    None => true,
                }
            }
            SplitBrainStrategy::DownAll => false,
        }
    }

    /// The split-brain resolver, at a timer: once the members beyond this
    /// side have been the same for `stable_after`, the strategy says whether
    /// this side stays. Its leader then marks the members beyond it Down, or
    /// its whole side when it loses; any other member of a losing side marks
    /// itself Down. A side whose view never holds still that long within
    /// `unstable_limit` loses.
    pub(super) fn resolve(
        &mut self,
        now: Instant,
        strategy: SplitBrainStrategy,
        leader: bool,
    ) -> Result<bool, MembershipError> {
        let Some((beyond, since)) = self.partition.clone() else {
            return Ok(false);
        };
        if self.judged && !leader {
            return Ok(false);
        }
        let stable = now.duration_since(since) >= self.config.stable_after;
        let unstable = self
            .partitioned_since
            .is_some_and(|at| now.duration_since(at) >= self.unstable_limit());
        if !stable && !unstable {
            return Ok(false);
        }
        let live = self.live_keys();
        let side = self.side();
        let stays = stable && self.side_stays(strategy, &side, &live);
        let doomed: Vec<MemberKey> = match (stays, leader) {
            (true, true) => beyond.iter().copied().collect(),
            (false, true) => side.iter().copied().collect(),
            (false, false) => vec![self.key],
            (true, false) => {
                // Nothing for a member to do: its leader downs the others.
                self.judged = true;
                return Ok(false);
            }
        };
        tracing::warn!(
            node = %self.me,
            leader,
            ?strategy,
            side = side.len(),
            live = live.len(),
            stays,
            unstable = !stable,
            "split-brain resolver: {}",
            if stays { "this side stays; downing the members beyond it" } else { "this side loses; downing itself" }
        );
        let mut changed = false;
        for k in doomed {
            if self.gossip.status(&k).is_some_and(|st| st.is_live()) {
                self.decide(k, MemberStatus::Down)?;
                changed = true;
            }
        }
        if changed {
            self.resolver_decisions[usize::from(!stays)] += 1;
        }
        self.partition = None;
        self.partitioned_since = None;
        self.judged = false;
        Ok(changed)
    }
}
