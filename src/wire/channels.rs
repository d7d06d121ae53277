//! The transport channel numbers of the layers above the pipes, in one place.
//!
//! | channel | layer | lane |
//! |---|---|---|
//! | 1 | membership (gossip, heartbeats, joins) | priority |
//! | 2 | sharding data: entity envelopes, passivations, replies | bulk |
//! | 3 | sharding control: the coordinator's protocol | priority |
//! | 4 | sharding migration: entity states moving with their shard | bulk |

use super::Channel;

/// Membership's messages.
pub const MEMBERSHIP: Channel = 1;
/// Sharding's data: entity envelopes, passivation requests, ask replies.
pub const SHARDING_DATA: Channel = 2;
/// Sharding's control: registration, allocation requests, homes.
pub const SHARDING_CONTROL: Channel = 3;
/// Sharding's migration: a new owner's pulls of the states a handoff took
/// from its shard's entities, and their chunks.
pub const SHARDING_MIGRATION: Channel = 4;

/// The channels whose frames take the pipes' priority lane.
pub const PRIORITY: [Channel; 2] = [MEMBERSHIP, SHARDING_CONTROL];
