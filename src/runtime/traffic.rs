//! Which shards talk to which (SPEC §13.11, Placement by traffic): while
//! an entity handles a message, its type and shard are known to its task;
//! a tell or an ask it sends from there is one message from its shard to
//! the target's. A node with placement by traffic on counts a sample of
//! them in a bounded table, which its control task takes once a second
//! and reports to the coordinator.

use std::cell::Cell;
use std::future::Future;
use std::sync::Mutex;

use crate::util::fast_hash::FastMap;

/// One message in this many is counted (each counted one weighs this
/// much): the table's lock is taken for one send in `SAMPLE_EVERY`.
pub(crate) const SAMPLE_EVERY: u64 = 8;

/// The most pairs counted between two reports; a pair first seen after
/// that is not counted until the next.
pub(crate) const MAX_PAIRS: usize = 4_096;

/// A shard of a type.
pub(crate) type ShardKey = (&'static str, u32);

tokio::task_local! {
    /// The entity whose message this task handles: its type and shard.
    static HANDLING: ShardKey;
}

thread_local! {
    /// Sends seen on this thread, for the sampling.
    static SEEN: Cell<u64> = const { Cell::new(0) };
}

/// Runs `handling`, an entity's handling of one message, as the sender of
/// what it sends: an entity of `key`.
pub(crate) fn handled_by<F: Future>(key: ShardKey, handling: F) -> impl Future<Output = F::Output> {
    HANDLING.scope(key, handling)
}

/// The sampled counts of one node, from a shard of a type to another.
#[derive(Default)]
pub(crate) struct TrafficCounts {
    /// Placement by traffic is on: count.
    on: bool,
    pairs: Mutex<FastMap<(ShardKey, ShardKey), u64>>,
}

impl TrafficCounts {
    /// Counts that count when `on`.
    pub(crate) fn new(on: bool) -> Self {
        TrafficCounts {
            on,
            pairs: Mutex::default(),
        }
    }

    /// A message to shard `to`: counted (sampled) when it is sent from an
    /// entity's handling, of another shard.
    pub(crate) fn sent(&self, to: ShardKey) {
        if !self.on {
            return;
        }
        let Ok(from) = HANDLING.try_with(|key| *key) else {
            return;
        };
        if from == to {
            return;
        }
        let sampled = SEEN.with(|seen| {
            let n = seen.get().wrapping_add(1);
            seen.set(n);
            n.is_multiple_of(SAMPLE_EVERY)
        });
        if !sampled {
            return;
        }
        let mut pairs = self.pairs.lock().unwrap_or_else(|p| p.into_inner());
        let room = pairs.len() < MAX_PAIRS;
        match pairs.get_mut(&(from, to)) {
            Some(count) => *count = count.saturating_add(SAMPLE_EVERY),
            None if room => {
                pairs.insert((from, to), SAMPLE_EVERY);
            }
            None => {}
        }
    }

    /// The counts since the last call, and a fresh start.
    pub(crate) fn take(&self) -> Vec<(ShardKey, ShardKey, u64)> {
        let taken = std::mem::take(&mut *self.pairs.lock().unwrap_or_else(|p| p.into_inner()));
        let mut pairs: Vec<_> = taken.into_iter().map(|((a, b), n)| (a, b, n)).collect();
        pairs.sort_unstable();
        pairs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `n` messages to `to` as an entity of `from`.
    async fn send_from(counts: &TrafficCounts, from: ShardKey, to: ShardKey, n: u64) {
        handled_by(from, async {
            for _ in 0..n {
                counts.sent(to);
            }
        })
        .await;
    }

    #[tokio::test]
    async fn sends_from_a_handling_are_counted_by_pair_and_sampled() {
        let counts = TrafficCounts::new(true);
        send_from(&counts, ("a", 1), ("b", 7), 800).await;
        send_from(&counts, ("a", 2), ("b", 7), 80).await;
        // Outside any handling: not counted.
        for _ in 0..800 {
            counts.sent(("b", 7));
        }
        // To its own shard: not counted.
        send_from(&counts, ("a", 1), ("a", 1), 800).await;
        assert_eq!(
            counts.take(),
            vec![(("a", 1), ("b", 7), 800), (("a", 2), ("b", 7), 80)]
        );
        assert_eq!(counts.take(), vec![], "taken once");
    }

    #[tokio::test]
    async fn counts_that_are_off_count_nothing() {
        let counts = TrafficCounts::new(false);
        send_from(&counts, ("a", 1), ("b", 7), 800).await;
        assert_eq!(counts.take(), vec![]);
    }

    #[tokio::test]
    async fn a_full_table_counts_the_pairs_it_has_and_no_new_one() {
        let counts = TrafficCounts::new(true);
        for shard in 0..MAX_PAIRS as u32 {
            send_from(&counts, ("a", shard), ("b", 0), SAMPLE_EVERY).await;
        }
        send_from(&counts, ("a", 0), ("b", 1), 80).await;
        send_from(&counts, ("a", 0), ("b", 0), 80).await;
        let pairs = counts.take();
        assert_eq!(pairs.len(), MAX_PAIRS);
        assert_eq!(pairs[0], (("a", 0), ("b", 0), 88));
        assert!(!pairs.iter().any(|(_, to, _)| *to == ("b", 1)));
    }
}
