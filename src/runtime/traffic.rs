//! Which shards talk to which (SPEC §13.11, Placement by traffic): while
//! an entity handles a message, its type and shard are known to its task;
//! a tell or an ask it sends from there is one message from its shard to
//! the target's. A node with placement by traffic on counts a random
//! sample of them in a bounded table, which its control task takes once
//! a second and reports to the coordinator.

use std::cell::Cell;
use std::future::Future;
use std::sync::Mutex;

use crate::model::config::TRAFFIC_SAMPLE_WEIGHT;
use crate::util::fast_hash::FastMap;

/// The most pairs counted between two reports; a pair first seen after
/// that is not counted until the next.
pub(crate) const MAX_PAIRS: usize = 4_096;

/// The most pairs one report carries: the heaviest.
pub(crate) const MAX_REPORTED: usize = 1_024;

/// A shard of a type.
pub(crate) type ShardKey = (&'static str, u32);

tokio::task_local! {
    /// The entity whose message this task handles: its type and shard.
    static HANDLING: ShardKey;
}

thread_local! {
    /// This thread's sampling draws (xorshift64; never zero).
    static DRAWS: Cell<u64> = const { Cell::new(0x9e37_79b9_7f4a_7c15) };
}

/// Runs `handling`, an entity's handling of one message, as the sender of
/// what it sends: an entity of `key`.
pub(crate) fn handled_by<F: Future>(key: ShardKey, handling: F) -> impl Future<Output = F::Output> {
    HANDLING.scope(key, handling)
}

/// The sampled counts of one node, from a shard of a type to another.
pub(crate) struct TrafficCounts {
    /// Placement by traffic is on: count.
    on: bool,
    /// One send in this many is counted, weighing this much.
    every: u64,
    pairs: Mutex<FastMap<(ShardKey, ShardKey), u64>>,
}

impl TrafficCounts {
    /// Counts that count when `on`, one send in [`TRAFFIC_SAMPLE_WEIGHT`].
    pub(crate) fn new(on: bool) -> Self {
        Self::sampling(on, TRAFFIC_SAMPLE_WEIGHT)
    }

    /// Counts that count one send in `every` (at least 1).
    fn sampling(on: bool, every: u64) -> Self {
        TrafficCounts {
            on,
            every: every.max(1),
            pairs: Mutex::default(),
        }
    }

    /// A message to shard `to`: counted (sampled) when it is sent from an
    /// entity's handling, of another shard.
    #[inline]
    pub(crate) fn sent(&self, to: ShardKey) {
        if self.on {
            self.count(to);
        }
    }

    #[inline(never)]
    fn count(&self, to: ShardKey) {
        let Ok(from) = HANDLING.try_with(|key| *key) else {
            return;
        };
        if from == to {
            return;
        }
        // A random draw, not every n-th send: a handler that sends to two
        // shards in turn has both counted.
        let sampled = DRAWS.with(|draws| {
            let mut x = draws.get();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            draws.set(x);
            x.is_multiple_of(self.every)
        });
        if !sampled {
            return;
        }
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let room = pairs.len() < MAX_PAIRS;
        match pairs.get_mut(&(from, to)) {
            Some(count) => *count = count.saturating_add(self.every),
            None if room => {
                pairs.insert((from, to), self.every);
            }
            None => {}
        }
    }

    /// The counts since the last call (the heaviest [`MAX_REPORTED`]),
    /// and a fresh start.
    pub(crate) fn take(&self) -> Vec<(ShardKey, ShardKey, u64)> {
        let taken = std::mem::take(&mut *self.pairs.lock().unwrap_or_else(|p| p.into_inner()));
        let mut pairs: Vec<_> = taken.into_iter().map(|((a, b), n)| (a, b, n)).collect();
        pairs.sort_unstable_by(|x, y| y.2.cmp(&x.2).then(x.0.cmp(&y.0)).then(x.1.cmp(&y.1)));
        pairs.truncate(MAX_REPORTED);
        pairs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `n` messages to each of `to` in turn as an entity of `from`.
    async fn send_from(counts: &TrafficCounts, from: ShardKey, to: &[ShardKey], n: u64) {
        handled_by(from, async {
            for _ in 0..n {
                for to in to {
                    counts.sent(*to);
                }
            }
        })
        .await;
    }

    #[tokio::test]
    async fn sends_from_a_handling_are_counted_by_pair() {
        let counts = TrafficCounts::sampling(true, 1);
        send_from(&counts, ("a", 1), &[("b", 7)], 800).await;
        send_from(&counts, ("a", 2), &[("b", 7)], 80).await;
        // Outside any handling: not counted.
        for _ in 0..800 {
            counts.sent(("b", 7));
        }
        // To its own shard: not counted.
        send_from(&counts, ("a", 1), &[("a", 1)], 800).await;
        assert_eq!(
            counts.take(),
            vec![(("a", 1), ("b", 7), 800), (("a", 2), ("b", 7), 80)]
        );
        assert_eq!(counts.take(), vec![], "taken once");
    }

    #[tokio::test]
    async fn a_sample_weighs_what_it_stands_for_and_misses_no_partner() {
        // A handler that sends to two shards in turn: each is counted
        // about as often as it is sent to, though every second send goes
        // to the same one (one in every 8th would count only one of them).
        let counts = TrafficCounts::new(true);
        send_from(&counts, ("a", 1), &[("b", 1), ("b", 2)], 40_000).await;
        let taken = counts.take();
        assert_eq!(taken.len(), 2, "{taken:?}");
        for (_, to, count) in taken {
            assert!((36_000..=44_000).contains(&count), "{to:?}: {count}");
            assert!(count.is_multiple_of(TRAFFIC_SAMPLE_WEIGHT));
        }
    }

    #[tokio::test]
    async fn counts_that_are_off_count_nothing() {
        let counts = TrafficCounts::new(false);
        send_from(&counts, ("a", 1), &[("b", 7)], 800).await;
        assert_eq!(counts.take(), vec![]);
    }

    #[tokio::test]
    async fn a_full_table_counts_the_pairs_it_has_and_no_new_one() {
        let counts = TrafficCounts::sampling(true, 1);
        for shard in 0..MAX_PAIRS as u32 {
            send_from(&counts, ("a", shard), &[("b", 0)], 1).await;
        }
        send_from(&counts, ("a", 0), &[("b", 1)], 80).await;
        send_from(&counts, ("a", 0), &[("b", 0)], 80).await;
        let pairs = {
            let pairs = counts.pairs.lock().unwrap();
            pairs.clone()
        };
        assert_eq!(pairs.len(), MAX_PAIRS);
        assert_eq!(pairs[&(("a", 0), ("b", 0))], 81);
        assert!(!pairs.keys().any(|(_, to)| *to == ("b", 1)));
        // A report carries the heaviest first, at most MAX_REPORTED.
        let taken = counts.take();
        assert_eq!(taken.len(), MAX_REPORTED);
        assert_eq!(taken[0], (("a", 0), ("b", 0), 81));
        assert!(taken[1..].iter().all(|(_, _, n)| *n == 1));
    }
}
