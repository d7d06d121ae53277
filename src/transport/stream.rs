//! What a pipe runs over: any stream that reads, writes and splits into a
//! read half and a write half, each owned by its own task. TCP today; a TLS
//! stream over TCP implements it the same way (its halves through
//! `tokio::io::split`), and nothing above this file changes.

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// A pipe's byte stream, handshaken in one piece, then split for its reader
/// and writer tasks.
pub(crate) trait PipeIo: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The reader task's half.
    type Read: AsyncRead + Unpin + Send + 'static;
    /// The writer task's half.
    type Write: AsyncWrite + Unpin + Send + 'static;
    /// Whether the stream is a TLS session. Over plain TCP, a handshake
    /// frame whose length prefix is a TLS record's header means that the
    /// peer speaks TLS (see `handshake::tls_record`).
    const TLS: bool = false;
    /// Splits the stream for the two tasks.
    fn into_halves(self) -> (Self::Read, Self::Write);
}

impl PipeIo for TcpStream {
    type Read = OwnedReadHalf;
    type Write = OwnedWriteHalf;

    /// TCP's own split: no lock between the halves.
    fn into_halves(self) -> (OwnedReadHalf, OwnedWriteHalf) {
        self.into_split()
    }
}
