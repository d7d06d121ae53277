//! Wire and pipe benchmarks (divan).
//!
//! * `codec`: encode and decode of a typical small request frame
//!   (a 32-byte payload, like a routed entity message).
//! * `round_trip`: one request and its reply at a time over loopback, through
//!   two `Transport`s, beside a bare tokio TCP echo of a same-sized
//!   length-prefixed frame (no CBOR, no handshake, no correlation).
//! * `pipelined`: 10 000 requests with 256 in flight through one pipe; the
//!   per-item time is the inverse of the throughput. `pipe_256_in_flight`
//!   uses channel 1, a control channel (the writer's priority lane);
//!   `pipe_256_in_flight_bulk` the same on channel 2 (the bulk lane).
//!
//! Run: `cargo bench --bench wire`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use datum_cluster_sharding::identity::UniqueAddress;
use datum_cluster_sharding::transport::{Transport, TransportConfig};
use datum_cluster_sharding::wire::{Frame, FrameCodec};
use divan::counter::ItemsCount;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio_util::codec::{Decoder, Encoder};

const CH: u16 = 1;
const BULK_CH: u16 = 2;
const PAYLOAD: [u8; 32] = [0x5a; 32];

fn main() {
    divan::main();
}

fn small_request() -> Frame {
    Frame::Request {
        corr: 123_456,
        channel: CH,
        payload: Bytes::from_static(&PAYLOAD),
    }
}

mod codec {
    use super::*;

    #[divan::bench]
    fn encode_small_request(bencher: divan::Bencher) {
        let frame = small_request();
        let mut codec = FrameCodec::default();
        let mut buf = BytesMut::with_capacity(4096);
        bencher.bench_local(|| {
            buf.clear();
            codec
                .encode(divan::black_box(&frame), &mut buf)
                .expect("encodes");
            divan::black_box(buf.len())
        });
    }

    #[divan::bench]
    fn decode_small_request(bencher: divan::Bencher) {
        let mut codec = FrameCodec::default();
        let mut encoded = BytesMut::new();
        codec
            .encode(&small_request(), &mut encoded)
            .expect("encodes");
        bencher
            .with_inputs(|| encoded.clone())
            .bench_local_values(|mut buf| {
                divan::black_box(codec.decode(&mut buf).expect("decodes"))
            });
    }
}

/// Two connected transports with an echo handler on the second, on a
/// 2-worker runtime (as the limits anchor uses).
struct Pipe {
    rt: Runtime,
    client: Transport,
    server: UniqueAddress,
    _server: Transport,
}

fn pipe() -> &'static Pipe {
    static PIPE: OnceLock<Pipe> = OnceLock::new();
    PIPE.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let (client, server_t) = rt.block_on(async {
            let config = TransportConfig::new("bench", "secret");
            let server = Transport::bind(config.clone()).await.expect("bind");
            let client = Transport::bind(config).await.expect("bind");
            for ch in [CH, BULK_CH] {
                let mut inbox = server.register(ch, 65_536).expect("register");
                tokio::spawn(async move {
                    while let Some(msg) = inbox.recv().await {
                        if let Some(reply) = msg.reply {
                            let _ = reply.reply(msg.payload);
                        }
                    }
                });
            }
            client.connect(server.bound_addr()).await.expect("connect");
            (client, server)
        });
        Pipe {
            rt,
            client,
            server: server_t.local(),
            _server: server_t,
        }
    })
}

/// A bare TCP echo: length-prefixed frames, echoed by the server task.
struct Echo {
    rt: Runtime,
    stream: tokio::sync::Mutex<TcpStream>,
}

fn echo() -> &'static Echo {
    static ECHO: OnceLock<Echo> = OnceLock::new();
    ECHO.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let stream = rt.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.expect("accept");
                s.set_nodelay(true).expect("nodelay");
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let Ok(len) = s.read_u32().await else { return };
                    let body = &mut buf[..len as usize];
                    if s.read_exact(body).await.is_err() {
                        return;
                    }
                    let mut out = Vec::with_capacity(4 + body.len());
                    out.extend_from_slice(&len.to_be_bytes());
                    out.extend_from_slice(body);
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
            let s = TcpStream::connect(addr).await.expect("connect");
            s.set_nodelay(true).expect("nodelay");
            s
        });
        Echo {
            rt,
            stream: tokio::sync::Mutex::new(stream),
        }
    })
}

mod round_trip {
    use super::*;

    #[divan::bench]
    fn pipe_request_reply(bencher: divan::Bencher) {
        let p = pipe();
        bencher.bench_local(|| {
            p.rt.block_on(p.client.request(
                &p.server,
                CH,
                Bytes::from_static(&PAYLOAD),
                Duration::from_secs(5),
            ))
            .expect("reply")
        });
    }

    #[divan::bench]
    fn bare_tcp_echo(bencher: divan::Bencher) {
        let e = echo();
        // As many bytes as the pipe's encoded request frame.
        let mut encoded = BytesMut::new();
        FrameCodec::default()
            .encode(&small_request(), &mut encoded)
            .expect("encodes");
        let body = vec![0x5au8; encoded.len() - 4];
        let mut frame = Vec::new();
        frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        let mut reply = vec![0u8; frame.len()];
        bencher.bench_local(|| {
            e.rt.block_on(async {
                let mut s = e.stream.lock().await;
                s.write_all(&frame).await.expect("write");
                s.read_exact(&mut reply).await.expect("read");
            })
        });
    }
}

mod pipelined {
    use super::*;

    const N: usize = 10_000;
    const IN_FLIGHT: usize = 256;

    #[divan::bench(sample_count = 20, sample_size = 1)]
    fn pipe_256_in_flight(bencher: divan::Bencher) {
        run(bencher, CH);
    }

    #[divan::bench(sample_count = 20, sample_size = 1)]
    fn pipe_256_in_flight_bulk(bencher: divan::Bencher) {
        run(bencher, BULK_CH);
    }

    fn run(bencher: divan::Bencher, channel: u16) {
        let p = pipe();
        bencher.counter(ItemsCount::new(N)).bench_local(|| {
            p.rt.block_on(async {
                let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let tasks: Vec<_> = (0..IN_FLIGHT)
                    .map(|_| {
                        let (client, server, next) = (p.client.clone(), p.server, next.clone());
                        tokio::spawn(async move {
                            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < N {
                                client
                                    .request(
                                        &server,
                                        channel,
                                        Bytes::from_static(&PAYLOAD),
                                        Duration::from_secs(10),
                                    )
                                    .await
                                    .expect("reply");
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.expect("task");
                }
            })
        });
        let s = p.client.stats();
        eprintln!(
            "pipe client writer (cumulative): {} frames in {} writes ({:.1} frames/write)",
            s.frames_written,
            s.writes,
            s.frames_written as f64 / s.writes.max(1) as f64
        );
    }
}
