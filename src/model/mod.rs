//! What every layer shares: the typed protocol and its messages, the
//! envelope a message travels in, the shard extractor and ids, node
//! identities, the errors, and the configuration.
//!
//! Nothing here runs: these are the words the rest of the crate speaks.
//! The sans-IO cores (membership, coordinator, region side, slot) import
//! from here and from the data their own protocol speaks, and nothing that
//! runs (tests/layering.rs holds them to it).

pub(crate) mod app_version;
pub(crate) mod config;
pub(crate) mod envelope;
pub(crate) mod error;
pub(crate) mod extractor;
pub mod identity;
pub(crate) mod protocol;
