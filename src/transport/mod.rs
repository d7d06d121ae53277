//! Node-to-node pipes: one authenticated, long-lived TCP connection per pair
//! of nodes, carrying oneway messages and request/reply for upper layers.
//!
//! # Model
//!
//! ```text
//!   upper layers (membership, sharding)           upper layers
//!      | send / request        ^ Incoming            ^
//!      v                       | per channel         |
//!   +---------------- Transport (node A) ---+   +-- Transport (node B) --+
//!   | conns: peer addr -> Conn              |   |                        |
//!   |   outbox -> writer task -> TCP ---------->  reader task -> channel |
//!   |   reader task <- TCP <------------------------ writer task          |
//!   | dials: addr -> queue + backoff        |   |                        |
//!   | listener -> handshake -> install      |   |                        |
//!   +---------------------------------------+   +------------------------+
//! ```
//!
//! * **One pipe per pair.** Either node may dial. When both dial at once,
//!   the connection dialed by the lower [`NodeId`](crate::model::identity::NodeId)
//!   survives; the other is refused (`Reject{Duplicate}`) or closed, and
//!   whatever waited for it is moved to the survivor.
//! * **Authenticated.** Every connection opens with the handshake in
//!   [`handshake`]: protocol version, cluster name, and a mutual
//!   HMAC-SHA256 challenge–response over the shared secret. Until a peer is
//!   authenticated it costs bounded resources: 4 KiB handshake frames, at
//!   most `max_inbound_handshakes` such handshakes at once and
//!   `max_inbound_handshakes_per_source` from one source address,
//!   rate-limited refusal warnings, and a dial it defers proceeds after one
//!   handshake timeout.
//! * **Batched writes.** A send encodes its frame straight into the pipe's
//!   outbox, a byte buffer per lane; one writer task per pipe takes it out
//!   a batch at a time, one `write_all` each (after yielding once, so
//!   concurrent producers join the batch): first the priority lane (frames
//!   on `control_channels`, default membership's and sharding control's),
//!   then bulk traffic, up to 1 MiB per batch, so heartbeats never wait
//!   behind more than one batch. `TCP_NODELAY` is on; reads go through a
//!   64 KiB buffer.
//! * **Tell-like sends.** [`Transport::send`] never waits: it enqueues, or
//!   fails at once with a [`SendError`] that gives the payload back.
//! * **Request/reply** ([`Transport::request`]) matches replies by a
//!   per-connection correlation id, under a timeout; a pending request fails
//!   at once when its connection drops, and never outlives its timeout.
//! * **Reconnect on demand, with backoff.** A send to a peer without a pipe
//!   dials it; after a failed dial the next attempt waits `backoff_min`,
//!   doubling up to `backoff_max`.
//! * **Down is final.** [`Transport::mark_down`] closes the pipe to that
//!   identity and refuses it for good.
//! * **Faults stay local.** A malformed or oversized frame closes the one
//!   connection it arrived on.
//!
//! # Files, each importing only those below it
//!
//! ```text
//!   api.rs         Transport: bind, register, connect, send, request, mark_down, shutdown
//!   accept.rs      the listener: accept, bound the handshakes, acceptor's handshake
//!   dial.rs        one dial task per address: backoff, deferral, queued frames
//!   pipe.rs        a handshaken stream becomes a pipe: install, start reader + writer
//!   reader.rs      a pipe's reader task (borrowed handlers in place, dispatch)
//!   writer.rs      a pipe's writer task (outbox batches, bounded close flush)
//!   table.rs       shared state: connection table, dials, handlers, marked-down ids
//!   connection.rs  one pipe's state: outbox lanes, pending requests, ReplyHandle
//!   handshake.rs   the handshake frames and checks
//!   tls.rs         TLS 1.3 under the handshake (feature `tls`), reloaded when its files change
//!   stream.rs      PipeIo: the stream a pipe runs over (TCP, or TLS over TCP)
//!   config.rs, error.rs, events.rs
//! ```
//!
//! The handshake, the reader and the writer are generic over the stream
//! (`PipeIo`: read, write, split into owned halves): with
//! [`TransportConfig::tls`] set, `accept.rs` and `dial.rs` wrap each TCP
//! stream in TLS before the handshake, and nothing above them changes.
//!
//! # Usage
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use bytes::Bytes;
//! use datum_cluster_sharding::transport::{Transport, TransportConfig, TransportEvent};
//!
//! const MEMBERSHIP: u16 = 1;
//! let transport = Transport::bind(TransportConfig::new("orders", "s3cret")).await?;
//! let mut inbox = transport.register(MEMBERSHIP, 1024)?;
//! let mut events = transport.events();
//!
//! let seed = transport.connect("127.0.0.1:2552".parse()?).await?;
//! transport.send(&seed, MEMBERSHIP, Bytes::from_static(b"hello"))?;
//! let answer = transport.request(&seed, MEMBERSHIP, Bytes::from_static(b"join?"), Duration::from_secs(5)).await?;
//!
//! while let Some(msg) = inbox.recv().await {
//!     if let Some(reply) = msg.reply {
//!         let _ = reply.reply(Bytes::from_static(b"ok"));
//!     }
//! }
//! if let Some(TransportEvent::Disconnected { peer, .. }) = events.recv().await {
//!     transport.mark_down(&peer);
//! }
//! # let _ = answer; Ok(()) }
//! ```

mod accept;
mod api;
mod config;
mod connection;
mod dial;
mod error;
mod events;
pub mod handshake;
mod pipe;
mod reader;
mod stream;
mod table;
#[cfg(feature = "tls")]
mod tls;
mod writer;

pub use api::{ConnectionInfo, FRAME_OVERHEAD, Transport, TransportStats};
pub use config::{Secret, TransportConfig};
pub use connection::{Incoming, ReplyHandle};
pub use error::{ConnectError, RegisterError, RequestError, SendError, SendFailure};
pub use events::{DisconnectReason, TransportEvent};
#[cfg(feature = "tls")]
pub use tls::{Tls, TlsConfig, TlsError, generate_test_certificates};

/// TLS material, which needs the crate's `tls` feature: without it this type
/// has no values, so [`TransportConfig::tls`] is always `None`.
#[cfg(not(feature = "tls"))]
#[derive(Clone, Debug)]
pub enum Tls {}

#[cfg(test)]
mod tests;
#[cfg(all(test, feature = "tls"))]
mod tls_tests;
