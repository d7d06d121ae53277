//! Who a cluster member is.
//!
//! A member is named by the address it listens on, a random [`NodeId`] drawn
//! when its process starts, and an `incarnation` (microseconds since the UNIX
//! epoch at that start). A node restarted at the same address therefore comes
//! back as a *new* member: its node id and incarnation differ. Age orders
//! members: the lower `(incarnation, node_id)` is the older member, and the
//! oldest reachable Up member is the placement coordinator.

use std::fmt;
use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// A node's random 64-bit id, drawn once per process start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub u64);

impl NodeId {
    /// Draws a fresh random id from the operating system's generator.
    pub fn random() -> Self {
        let mut bytes = [0u8; 8];
        // A failing OS RNG leaves no safe way to name the node; fall back to
        // the clock mixed with the process id rather than refusing to start.
        if getrandom::fill(&mut bytes).is_err() {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            bytes = (nanos ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
        }
        NodeId(u64::from_le_bytes(bytes))
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The full identity of one member: address, node id and incarnation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct UniqueAddress {
    /// The address the node's listener is bound to.
    pub addr: SocketAddr,
    /// The node's random id.
    pub node_id: NodeId,
    /// Microseconds since the UNIX epoch when the node started.
    pub incarnation: u64,
}

impl UniqueAddress {
    /// A new identity for a node starting now at `addr`.
    pub fn new_at(addr: SocketAddr) -> Self {
        let incarnation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        UniqueAddress {
            addr,
            node_id: NodeId::random(),
            incarnation,
        }
    }

    /// The key that orders members by age: lower is older.
    pub fn age_key(&self) -> (u64, NodeId) {
        (self.incarnation, self.node_id)
    }

    /// Whether `self` is older than `other` (joined the cluster's history first).
    pub fn is_older_than(&self, other: &UniqueAddress) -> bool {
        self.age_key() < other.age_key()
    }
}

impl fmt::Display for UniqueAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}@{}", self.addr, self.node_id, self.incarnation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn older_is_lower_incarnation_then_lower_id() {
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let a = UniqueAddress {
            addr,
            node_id: NodeId(9),
            incarnation: 10,
        };
        let b = UniqueAddress {
            addr,
            node_id: NodeId(1),
            incarnation: 11,
        };
        let c = UniqueAddress {
            addr,
            node_id: NodeId(2),
            incarnation: 11,
        };
        assert!(a.is_older_than(&b));
        assert!(b.is_older_than(&c));
        assert!(!c.is_older_than(&b));
    }
}
