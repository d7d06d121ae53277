//! Small tools with no knowledge of sharding: a fast hash for the hot
//! maps, and a rate limit for repeated warnings.

pub(crate) mod fast_hash;
pub(crate) mod warn_limit;
