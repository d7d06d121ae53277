//! The hash maps of the per-message path whose keys no caller chooses.
//!
//! A message looks up its pipe (and the marked-down set), its region and,
//! for a remote ask, its pending entry. With std's SipHash-1-3 those
//! lookups were about 6 % of the instructions of a W1-sat message
//! (BENCHMARKS.md, session 23). These maps use foldhash instead, the
//! default hasher of hashbrown (the table behind std's `HashMap`), seeded
//! at random per map: a few times fewer instructions for short keys.
//!
//! foldhash is only minimally resistant to hash flooding, so it keys only
//! tables whose keys this node makes or admits itself: peers' addresses
//! (authenticated members), ask ids (a counter of its own) and the type
//! names registered on it. A table keyed by what a caller or a remote
//! message names — entity ids above all — keeps std's SipHash (SPEC §12).

/// A `HashMap` hashed with a randomly seeded foldhash.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A `HashSet` hashed with a randomly seeded foldhash.
pub(crate) type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
