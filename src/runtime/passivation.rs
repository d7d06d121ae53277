//! Passivation by an active-entity limit: which live entity of a shard
//! makes room when a new one starts and the shard is at its share of the
//! region's limit (SPEC §6.1).
//!
//! A [`Passivator`] tracks the ids of a hosted shard's live entities — the
//! slot tells it of every start, every message delivered and every entity
//! that stops being live — and, when an id starts with the shard at its
//! share, names the entity to passivate: never the one starting. It is
//! plain data, called under the shard's lock, with no IO.
//!
//! * **Least recently used**: the entity whose last message is oldest.
//! * **Segmented LRU**: a probation segment takes new entities; a second
//!   message promotes one to the protected segment (80 % of the share),
//!   whose overflow goes back to probation. Victims come from probation
//!   first, so entities seen once do not push out the ones seen again.
//! * **W-TinyLFU** (Einziger, Friedman and Manes): a small admission
//!   window (1 % of the share, at least one) in front of a segmented LRU
//!   main area, and a count-min sketch of recent access frequencies (aged
//!   by halving every ten accesses per entity of the share). The window's
//!   oldest entity competes with the main area's victim; the one accessed
//!   less often is passivated. Scans and one-off ids stay in the window;
//!   a popular id that was passivated wins a main-area place back as soon
//!   as it reaches the window's end, since the sketch remembers it.
//!
//! The lists are the `lru` crate's (O(1) promote, pop and remove by key);
//! the sketch is the `count-min-sketch` crate's (8-bit counters,
//! conservative update, `reset` halves them).

use std::sync::Arc;

use count_min_sketch::CountMinSketch8;
use lru::LruCache;

use crate::model::config::PassivationPolicy;

/// Ids in recency order (least recent first out).
type Recency = LruCache<Arc<str>, ()>;

fn recency() -> Recency {
    LruCache::unbounded()
}

/// One shard's live entities, ordered by its policy.
pub(crate) struct Passivator {
    /// How many live entities the shard may hold (at least one).
    share: usize,
    kind: Kind,
}

enum Kind {
    Lru(Recency),
    Slru(Segmented),
    WTinyLfu(Box<TinyLfu>),
}

impl Passivator {
    pub(crate) fn new(policy: PassivationPolicy, share: usize) -> Self {
        let share = share.max(1);
        let kind = match policy {
            PassivationPolicy::LeastRecentlyUsed => Kind::Lru(recency()),
            PassivationPolicy::SegmentedLru => Kind::Slru(Segmented::new(protected_share(share))),
            PassivationPolicy::WTinyLfu => Kind::WTinyLfu(Box::new(TinyLfu::new(share))),
        };
        Passivator { share, kind }
    }

    /// How many live entities the shard may hold.
    pub(crate) fn share(&self) -> usize {
        self.share
    }

    /// How many ids it tracks.
    pub(crate) fn len(&self) -> usize {
        match &self.kind {
            Kind::Lru(list) => list.len(),
            Kind::Slru(segments) => segments.len(),
            Kind::WTinyLfu(lfu) => lfu.len(),
        }
    }

    /// Whether `id` is tracked (live).
    pub(crate) fn contains(&self, id: &str) -> bool {
        match &self.kind {
            Kind::Lru(list) => list.contains(id),
            Kind::Slru(segments) => segments.contains(id),
            Kind::WTinyLfu(lfu) => lfu.window.contains(id) || lfu.main.contains(id),
        }
    }

    /// A live entity got a message.
    pub(crate) fn access(&mut self, id: &str) {
        match &mut self.kind {
            Kind::Lru(list) => {
                list.promote(id);
            }
            Kind::Slru(segments) => segments.access(id),
            Kind::WTinyLfu(lfu) => lfu.access(id),
        }
    }

    /// `id` (not tracked) starts; the entity to passivate to make room for
    /// it, if the shard is at its share. Never `id` itself.
    pub(crate) fn admit(&mut self, id: &Arc<str>) -> Option<Arc<str>> {
        debug_assert!(!self.contains(id), "admitted twice: {id}");
        let full = self.len() >= self.share;
        match &mut self.kind {
            Kind::Lru(list) => {
                let victim = full.then(|| list.pop_lru().map(|(v, ())| v)).flatten();
                list.push(id.clone(), ());
                victim
            }
            Kind::Slru(segments) => {
                let victim = full.then(|| segments.pop_victim()).flatten();
                segments.insert(id.clone());
                victim
            }
            Kind::WTinyLfu(lfu) => lfu.admit(id, full),
        }
    }

    /// `id` is no longer live (passivated for another reason, stopped).
    pub(crate) fn remove(&mut self, id: &str) {
        match &mut self.kind {
            Kind::Lru(list) => {
                list.pop(id);
            }
            Kind::Slru(segments) => segments.remove(id),
            Kind::WTinyLfu(lfu) => {
                if lfu.window.pop(id).is_none() {
                    lfu.main.remove(id);
                }
            }
        }
    }

    /// Forgets every id (the shard's entities all stop).
    pub(crate) fn clear(&mut self) {
        let policy = match &self.kind {
            Kind::Lru(_) => PassivationPolicy::LeastRecentlyUsed,
            Kind::Slru(_) => PassivationPolicy::SegmentedLru,
            Kind::WTinyLfu(_) => PassivationPolicy::WTinyLfu,
        };
        *self = Passivator::new(policy, self.share);
    }

    /// A new share (the region's shards changed): the entities to
    /// passivate to fit in it, in the policy's order.
    pub(crate) fn resize(&mut self, share: usize) -> Vec<Arc<str>> {
        if share.max(1) == self.share {
            return Vec::new(); // (every start asks: the common case)
        }
        self.share = share.max(1);
        let mut victims = Vec::new();
        match &mut self.kind {
            Kind::Lru(list) => {
                while list.len() > self.share {
                    victims.extend(list.pop_lru().map(|(v, ())| v));
                }
            }
            Kind::Slru(segments) => {
                segments.protected_cap = protected_share(self.share);
                segments.fit_protected();
                while segments.len() > self.share {
                    victims.extend(segments.pop_victim());
                }
            }
            Kind::WTinyLfu(lfu) => {
                lfu.set_share(self.share);
                while lfu.len() > self.share {
                    victims.extend(lfu.pop_victim());
                }
            }
        }
        victims
    }
}

/// The protected segment's part of a segmented LRU of `share` entries.
fn protected_share(share: usize) -> usize {
    // 4/5 of it, rounded down, without overflowing on a huge share.
    share / 5 * 4 + share % 5 * 4 / 5
}

/// A segmented LRU: probation (new entries, victims first) and protected
/// (entries seen again, up to `protected_cap`).
struct Segmented {
    probation: Recency,
    protected: Recency,
    protected_cap: usize,
}

impl Segmented {
    fn new(protected_cap: usize) -> Self {
        Segmented {
            probation: recency(),
            protected: recency(),
            protected_cap,
        }
    }

    fn len(&self) -> usize {
        self.probation.len() + self.protected.len()
    }

    fn contains(&self, id: &str) -> bool {
        self.probation.contains(id) || self.protected.contains(id)
    }

    fn insert(&mut self, id: Arc<str>) {
        self.probation.push(id, ());
    }

    fn access(&mut self, id: &str) {
        if let Some((id, ())) = self.probation.pop_entry(id) {
            self.protected.push(id, ());
            self.fit_protected();
        } else {
            self.protected.promote(id);
        }
    }

    /// Demotes the protected segment's oldest entries past its cap.
    fn fit_protected(&mut self) {
        while self.protected.len() > self.protected_cap {
            let Some((id, ())) = self.protected.pop_lru() else {
                break;
            };
            self.probation.push(id, ());
        }
    }

    /// The entry that goes first, without taking it.
    fn peek_victim(&self) -> Option<&Arc<str>> {
        self.probation
            .peek_lru()
            .or_else(|| self.protected.peek_lru())
            .map(|(id, ())| id)
    }

    fn pop_victim(&mut self) -> Option<Arc<str>> {
        self.probation
            .pop_lru()
            .or_else(|| self.protected.pop_lru())
            .map(|(id, ())| id)
    }

    fn remove(&mut self, id: &str) {
        if self.probation.pop(id).is_none() {
            self.protected.pop(id);
        }
    }
}

/// W-TinyLFU: an admission window, a segmented main area, and a
/// frequency sketch deciding between the window's oldest and the main
/// area's victim.
struct TinyLfu {
    window: Recency,
    window_cap: usize,
    main: Segmented,
    sketch: CountMinSketch8<Arc<str>>,
    /// The share the sketch was sized for (rebuilt when the share moves
    /// away from it by more than a factor of two).
    sketch_for: usize,
    /// Accesses counted since the sketch was last halved.
    counted: usize,
    /// Halve the sketch after this many.
    sample: usize,
}

/// The window's part of `share` (1 %, at least one).
fn window_share(share: usize) -> usize {
    (share / 100).max(1)
}

/// The largest share a sketch is sized for: 4 Mi entries (four rows of
/// 16 Mi 8-bit counters, 64 MiB). A larger share shares its counters.
const MAX_SKETCH_SHARE: usize = 1 << 22;

/// About four 8-bit counters per entry of `share`, four rows: an estimate
/// off by more than a few accesses is rare.
fn sketch(share: usize) -> CountMinSketch8<Arc<str>> {
    CountMinSketch8::new(share.clamp(16, MAX_SKETCH_SHARE), 0.95, 0.5)
        .expect("the sketch's capacity is bounded and its other parameters are constants")
}

impl TinyLfu {
    fn new(share: usize) -> Self {
        let window_cap = window_share(share);
        TinyLfu {
            window: recency(),
            window_cap,
            main: Segmented::new(protected_share(share - window_cap)),
            sketch: sketch(share),
            sketch_for: share,
            counted: 0,
            sample: share.saturating_mul(10).max(16),
        }
    }

    fn set_share(&mut self, share: usize) {
        self.window_cap = window_share(share);
        self.main.protected_cap = protected_share(share - self.window_cap);
        self.main.fit_protected();
        // A window left over its cap by a smaller share hands its oldest
        // to the main area, so it stays 1 % of the share.
        while self.window.len() > self.window_cap {
            let (id, ()) = self.window.pop_lru().expect("the window is over its cap");
            self.main.insert(id);
        }
        self.sample = share.saturating_mul(10).max(16);
        // A sketch sized for another share is either wasted memory or too
        // small to tell ids apart: size it anew (its counts start again).
        let sized = |s: usize| s.clamp(16, MAX_SKETCH_SHARE);
        let (now, before) = (sized(share), sized(self.sketch_for));
        if now > before.saturating_mul(2) || now.saturating_mul(2) < before {
            self.sketch = sketch(share);
            self.sketch_for = share;
            self.counted = 0;
        }
    }

    fn len(&self) -> usize {
        self.window.len() + self.main.len()
    }

    fn count(&mut self, id: &str) {
        self.sketch.increment(id);
        self.counted += 1;
        if self.counted >= self.sample {
            self.sketch.reset();
            self.counted /= 2;
        }
    }

    fn access(&mut self, id: &str) {
        self.count(id);
        if self.window.promote(id) {
            return;
        }
        self.main.access(id);
    }

    fn admit(&mut self, id: &Arc<str>, full: bool) -> Option<Arc<str>> {
        self.count(id);
        self.window.push(id.clone(), ());
        if self.window.len() <= self.window_cap {
            // The window had room: a victim, if one is needed, comes from
            // the main area (only after a share change leaves it large).
            return if full { self.main.pop_victim() } else { None };
        }
        let (candidate, ()) = self.window.pop_lru().expect("the window is over its cap");
        if !full {
            self.main.insert(candidate);
            return None;
        }
        let Some(victim) = self.main.peek_victim() else {
            return Some(candidate);
        };
        if self.sketch.estimate(&*candidate) > self.sketch.estimate(&**victim) {
            let victim = self.main.pop_victim();
            self.main.insert(candidate);
            victim
        } else {
            Some(candidate)
        }
    }

    /// The next entry to go when shrinking: the window's past its cap,
    /// then the main area's.
    fn pop_victim(&mut self) -> Option<Arc<str>> {
        if self.window.len() > self.window_cap || self.main.len() == 0 {
            self.window.pop_lru().map(|(id, ())| id)
        } else {
            self.main.pop_victim()
        }
    }
}

#[cfg(test)]
#[path = "passivation_tests.rs"]
mod tests;
