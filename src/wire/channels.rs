//! The transport channel numbers of the layers above the pipes, in one place.
//!
//! | channel | layer | lane |
//! |---|---|---|
//! | 1 | membership (gossip, heartbeats, joins) | priority |
//! | 2 | sharding data: entity envelopes, passivations, replies | bulk |
//! | 3 | sharding control: the coordinator's protocol | priority |

use super::Channel;

/// Membership's messages.
pub const MEMBERSHIP: Channel = 1;
/// Sharding's data: entity envelopes, passivation requests, ask replies.
pub const SHARDING_DATA: Channel = 2;
/// Sharding's control: registration, allocation requests, homes.
pub const SHARDING_CONTROL: Channel = 3;

/// The channels whose frames take the pipes' priority lane.
pub const PRIORITY: [Channel; 2] = [MEMBERSHIP, SHARDING_CONTROL];
