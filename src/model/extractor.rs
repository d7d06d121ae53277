//! Which shard an entity lives in.
//!
//! The shard count is a fixed partition of the id space, chosen at start
//! ([`ShardingConfig::num_shards`](crate::ShardingConfig)). Shards are numbered
//! `0..num_shards` ([`ShardId`]), which keeps the allocation table a dense
//! array and a shard reference four bytes on the wire.
//!
//! [`DefaultShardExtractor`] hashes the entity id with FNV-1a 64 and takes it
//! modulo the shard count: stable across runs, platforms and versions, so every
//! node of a cluster — and every future version of this crate — agrees on where
//! an id lives. A protocol can name its own extractor (`protocol!`'s
//! `extractor = T` clause) when ids carry their own shard key; since it is part
//! of the protocol's type, a sender and a host cannot disagree about it.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A shard number in `0..num_shards`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ShardId(pub u32);

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Maps an entity id to its shard.
///
/// Must be a pure function of its inputs: every node must compute the same
/// shard for the same id. Results outside `0..num_shards` are refused with
/// [`ShardingError::InvalidShard`](crate::ShardingError::InvalidShard).
pub trait ShardExtractor: Default + Send + Sync + 'static {
    /// The shard of `entity_id` when there are `num_shards` shards.
    fn shard_id(&self, entity_id: &str, num_shards: u32) -> ShardId;
}

/// FNV-1a 64-bit of the entity id's UTF-8 bytes, modulo the shard count.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultShardExtractor;

impl ShardExtractor for DefaultShardExtractor {
    fn shard_id(&self, entity_id: &str, num_shards: u32) -> ShardId {
        ShardId((fnv1a_64(entity_id.as_bytes()) % u64::from(num_shards.max(1))) as u32)
    }
}

/// The FNV-1a 64-bit hash (offset basis `0xcbf29ce484222325`, prime `0x100000001b3`).
pub fn fnv1a_64(bytes: &[u8]) -> u64 {
    fnv1a_64_of(bytes.iter().copied())
}

/// [`fnv1a_64`] of bytes as they come, for a key made of parts that need
/// not be copied together first.
pub(crate) fn fnv1a_64_of(bytes: impl Iterator<Item = u8>) -> u64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes.fold(OFFSET_BASIS, |hash, b| {
        (hash ^ u64::from(b)).wrapping_mul(PRIME)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use quickcheck_macros::quickcheck;

    /// Vectors from the FNV reference test suite (Landon Curt Noll's `test_fnv.c`, FNV-1a 64).
    #[test]
    fn fnv1a_64_matches_published_vectors() {
        let vectors: &[(&str, u64)] = &[
            ("", 0xcbf29ce484222325),
            ("a", 0xaf63dc4c8601ec8c),
            ("b", 0xaf63df4c8601f1a5),
            ("c", 0xaf63de4c8601eff2),
            ("foo", 0xdcb27518fed9d577),
            ("foob", 0xdd120e790c2512af),
            ("fooba", 0xcac165afa2fef40a),
            ("foobar", 0x85944171f73967e8),
        ];
        for (input, expected) in vectors {
            assert_eq!(
                fnv1a_64(input.as_bytes()),
                *expected,
                "FNV-1a 64 of {input:?}"
            );
        }
    }

    /// Pinned shard numbers, computed once by an independent FNV-1a
    /// implementation: if these change, entities move between versions, which
    /// the default extractor promises never to do.
    #[test]
    fn default_extractor_is_stable() {
        let e = DefaultShardExtractor;
        let pinned: Vec<(&str, u32)> = vec![
            ("cart-42", 76),
            ("entity-0", 31),
            ("entity-999", 122),
            ("", 37),
        ];
        for (id, shard) in pinned {
            assert_eq!(e.shard_id(id, 128), ShardId(shard), "shard of {id:?}");
        }
        assert_eq!(e.shard_id("cart-42", 64), ShardId(12));
        assert_eq!(
            e.shard_id("foobar", 1000).0,
            (0x85944171f73967e8u64 % 1000) as u32
        );
    }

    #[quickcheck]
    fn default_extractor_in_range_and_deterministic(id: String, shards: u32) -> bool {
        let n = shards % 100_000 + 1;
        let e = DefaultShardExtractor;
        let s = e.shard_id(&id, n);
        s.0 < n && s == DefaultShardExtractor.shard_id(&id.clone(), n)
    }
}
