//! # datum-cluster-sharding
//!
//! Cluster sharding for Rust over [`ractor`]: many stateful entities spread
//! across the nodes of a cluster, each reached by its id wherever it lives.
//! See `SPEC.md` for the semantics, the wire format and the public API.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

// Module declarations (one line per concept, kept sorted).
pub mod identity;
pub mod transport;
pub mod wire;
