//! [`TransportConfig`] and the shared [`Secret`].

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use crate::wire::DEFAULT_MAX_FRAME_LEN;

/// The cluster's shared secret. Both sides of a handshake prove they know it;
/// it is never sent. Its `Debug` output is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret made of these bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Secret(bytes.into())
    }

    pub(crate) fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret(s.as_bytes().to_vec())
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s.into_bytes())
    }
}

impl From<Vec<u8>> for Secret {
    fn from(v: Vec<u8>) -> Self {
        Secret(v)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes redacted>)", self.0.len())
    }
}

/// Settings of one node's [`Transport`](super::Transport).
///
/// [`TransportConfig::new`] fills every field with its default; change the
/// public fields as needed before [`Transport::bind`](super::Transport::bind).
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// Where the listener binds. Default `127.0.0.1:0` (any free port).
    pub bind_addr: SocketAddr,
    /// The address peers dial to reach this node, and the `addr` of its
    /// identity. Default: the listener's bound address (set this when binding
    /// to `0.0.0.0`).
    pub advertised_addr: Option<SocketAddr>,
    /// The cluster's name; a peer with another name is refused.
    pub cluster_name: String,
    /// The shared secret proven in the handshake.
    pub secret: Secret,
    /// Largest frame body sent or accepted, in bytes. Default 4 MiB.
    pub max_frame_len: usize,
    /// Time allowed for the whole handshake (TCP connect included on the
    /// dialing side). Default 5 s.
    pub handshake_timeout: Duration,
    /// First delay before redialing a peer after a failed attempt. Default
    /// 100 ms; doubles per consecutive failure.
    pub backoff_min: Duration,
    /// Cap on the redial delay. Default 5 s.
    pub backoff_max: Duration,
    /// Frames that may wait in each lane of a connection's outbox (not yet
    /// taken by its writer) before a send on that lane fails with
    /// `QueueFull`. Default 65 536; 0 is taken as 1.
    pub send_queue_capacity: usize,
    /// Frames that may wait for a connection being dialed. Default 4 096.
    pub dial_queue_capacity: usize,
    /// Channels whose frames (and the replies to requests on them) take each
    /// pipe's priority lane: the writer puts them into every batch before
    /// bulk traffic, so heartbeats do not wait behind large payloads.
    /// Default `[1, 3]` (membership, sharding control; see
    /// [`wire::channels`](crate::wire::channels)). Each lane holds `send_queue_capacity`
    /// frames; order is kept per channel, not across lanes.
    pub control_channels: Vec<crate::wire::Channel>,
    /// Inbound handshakes that may be under way (not yet authenticated) at
    /// once; a connection accepted beyond it is closed at once. Default 256.
    pub max_inbound_handshakes: usize,
    /// Of those, how many may come from one source at once: one IPv4
    /// address, or one IPv6 /64 prefix. A connection beyond it is closed at
    /// once, before anything is read, so that a client who stalls its
    /// handshakes holds this many permits, not all of them. A node dials
    /// another at most once at a time, so this is also how many nodes
    /// sharing one address (on one host) may handshake with this one at the
    /// same moment; the others' dials fail (`Closed` or `Io`) and are
    /// retried after the backoff. Default 8; 0 is taken as 1.
    pub max_inbound_handshakes_per_source: usize,
    /// TLS 1.3 on every pipe, mutually authenticated (feature `tls`; see
    /// [`Tls`](super::Tls)): the handshake then runs inside the TLS
    /// session, and a peer must present a certificate from the CA roots
    /// that names it. Default `None`: plaintext, logged as a warning at
    /// bind on a non-loopback address.
    pub tls: Option<super::Tls>,
}

impl TransportConfig {
    /// The defaults, for a cluster `cluster_name` sharing `secret`.
    pub fn new(cluster_name: impl Into<String>, secret: impl Into<Secret>) -> Self {
        TransportConfig {
            bind_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertised_addr: None,
            cluster_name: cluster_name.into(),
            secret: secret.into(),
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            handshake_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            send_queue_capacity: 65_536,
            dial_queue_capacity: 4_096,
            control_channels: crate::wire::channels::PRIORITY.to_vec(),
            max_inbound_handshakes: 256,
            max_inbound_handshakes_per_source: 8,
            tls: None,
        }
    }

    /// The redial delay after `failures` consecutive failed attempts.
    pub(crate) fn backoff(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(16);
        self.backoff_min
            .saturating_mul(1u32 << exp)
            .min(self.backoff_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_min_and_caps_at_max() {
        let mut c = TransportConfig::new("c", "s");
        c.backoff_min = Duration::from_millis(100);
        c.backoff_max = Duration::from_millis(1000);
        let delays: Vec<_> = (1..=6).map(|n| c.backoff(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(c.backoff(u32::MAX), Duration::from_millis(1000));
    }

    #[test]
    fn secret_is_redacted_in_debug_output() {
        let c = TransportConfig::new("c", "hunter2");
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
