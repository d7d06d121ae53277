//! Timer arithmetic: ticks aligned on the wall clock's grid, and instants
//! that saturate instead of overflowing.

use std::time::{Duration, Instant};

use super::MembershipCore;

impl MembershipCore {
    /// Puts this node's heartbeat and gossip ticks on the wall clock's
    /// grid: from now on each falls where the clock shows a whole multiple
    /// of its interval since the Unix epoch. The driver reads its clock
    /// once: `since_epoch` is what it showed at `anchor`. So the nodes of a
    /// cluster (clocks within a few ms of each other) tick together, for
    /// any interval: a member's heartbeats then arrive together with its
    /// own tick, and it wakes about once per interval instead of once per
    /// watcher (SPEC §10.4). Nothing depends on it for correctness; without
    /// it each node ticks one interval after its last tick.
    pub fn align_ticks(&mut self, anchor: Instant, since_epoch: Duration) {
        self.tick_anchor = Some((anchor, since_epoch));
    }

    /// The next tick after `now` for a timer every `every`.
    pub(super) fn next_tick(&self, now: Instant, every: Duration) -> Instant {
        let Some((anchor, since_epoch)) = self
            .tick_anchor
            .filter(|(a, _)| *a <= now && !every.is_zero())
        else {
            return later(now, every);
        };
        let every_ns = every.as_nanos();
        let wall_ns = since_epoch.as_nanos() + now.duration_since(anchor).as_nanos();
        let into_tick = wall_ns % every_ns;
        u64::try_from(every_ns - into_tick)
            .ok()
            .and_then(|left| now.checked_add(Duration::from_nanos(left)))
            .unwrap_or_else(|| later(now, every))
    }
}

/// `now + d`, saturating far in the future instead of panicking.
pub(super) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(3_600)))
        .unwrap_or(now)
}
