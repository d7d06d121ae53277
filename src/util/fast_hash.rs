//! The hash maps of the per-message path whose keys no unauthenticated
//! party and no sender of messages chooses.
//!
//! A message looks up its pipe (and the marked-down set), its region and,
//! for a remote ask, its pending entry. With std's SipHash-1-3 those
//! lookups were about 6 % of the instructions of a W1-sat message
//! (BENCHMARKS.md, "Instructions per message, counted"). These maps use foldhash instead, the
//! default hasher of hashbrown (the table behind std's `HashMap`), seeded
//! at random per map: a few times fewer instructions for short keys.
//!
//! foldhash resists hash flooding only minimally, so it keys only tables
//! whose keys are made by this node (ask ids, from a counter of its own),
//! registered by the application (type names), or named by the
//! application or by peers that proved the cluster secret (the pipe
//! table, by the listen address in a peer's proven identity; the
//! marked-down set, from `Transport::mark_down` and the members' gossip).
//! Those peers are trusted with far more than a table's speed. A table
//! keyed by what a sender of messages names — entity ids above all — or by
//! an unauthenticated address keeps std's SipHash (SPEC §12).

/// A `HashMap` hashed with a randomly seeded foldhash.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A `HashSet` hashed with a randomly seeded foldhash.
pub(crate) type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
