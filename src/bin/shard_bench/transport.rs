//! Baseline (a) of the runner: this project's own transport with no
//! sharding on top. Three cluster nodes, as in W1; each node's driver sends
//! its share of the requests over the same authenticated pipes, alternating
//! between the two other nodes, with `in_flight` outstanding; a request
//! carries W1's entity id and a counter (CBOR `[entity, counter]`), and the
//! receiver answers it inline, on the pipe's reader task, with the same
//! bytes. The sender checks the counter in the reply. What W1 adds on top of
//! this is sharding itself: routing, the entity actor, serde of the
//! protocol's messages, the ask machinery.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use datum_cluster_sharding::cluster::ClusterNode;
use hdrhistogram::Histogram;

use super::harness::windowed;

/// A channel no layer of the library uses.
const BASELINE: u16 = 100;

/// What the baseline measured.
pub struct Figures {
    pub acks: u64,
    pub wrong: u64,
    pub failed: u64,
    pub wall: Duration,
    pub latency: Histogram<u64>,
}

/// Runs `shares[d]` requests from node `d`, `in_flight` at a time each.
pub async fn run(
    clusters: &[ClusterNode],
    shares: &[u64],
    in_flight: usize,
) -> Result<Figures, Box<dyn std::error::Error>> {
    for cluster in clusters {
        cluster.transport().register_inline(BASELINE, |incoming| {
            if let Some(reply) = incoming.reply {
                let _ = reply.reply(incoming.payload);
            }
        })?;
    }
    let peers: Arc<Vec<_>> = Arc::new(clusters.iter().map(|c| c.self_address()).collect());
    let start = Instant::now();
    let drivers: Vec<_> = clusters
        .iter()
        .zip(shares)
        .enumerate()
        .map(|(d, (cluster, &share))| {
            let transport = cluster.transport().clone();
            let peers = peers.clone();
            tokio::spawn(async move {
                let mut latency =
                    Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
                let (mut acks, mut wrong, mut failed) = (0u64, 0u64, 0u64);
                // W1's drivers' workers (`harness::windowed`), so that the
                // two runs' drivers have the same shape.
                let (transport, peers) = (&transport, &peers);
                let one = |k: u64| {
                    let to = peers[(d + 1 + (k % 2) as usize) % peers.len()];
                    async move {
                        let entity = format!("entity-{}", k % 1_000);
                        let mut payload = Vec::with_capacity(24);
                        ciborium::into_writer(&(entity.as_str(), k), &mut payload)
                            .expect("encodes");
                        let began = Instant::now();
                        let reply = transport
                            .request(&to, BASELINE, Bytes::from(payload), Duration::from_secs(5))
                            .await;
                        let took = began.elapsed();
                        let answer = reply.ok().map(|bytes| {
                            ciborium::from_reader::<(String, u64), _>(&bytes[..])
                                .is_ok_and(|(e, n)| n == k && e == entity)
                        });
                        (answer, took)
                    }
                };
                let done = |(answer, took): (Option<bool>, Duration)| {
                    latency.saturating_record((took.as_micros() as u64).max(1));
                    match answer {
                        Some(true) => acks += 1,
                        Some(false) => wrong += 1,
                        None => failed += 1,
                    }
                };
                windowed(share, in_flight, one, done).await;
                (latency, acks, wrong, failed)
            })
        })
        .collect();
    let mut figures = Figures {
        acks: 0,
        wrong: 0,
        failed: 0,
        wall: Duration::ZERO,
        latency: Histogram::new_with_bounds(1, 60_000_000, 3)?,
    };
    for driver in drivers {
        let (latency, acks, wrong, failed) = driver.await?;
        figures.latency.add(&latency)?;
        figures.acks += acks;
        figures.wrong += wrong;
        figures.failed += failed;
    }
    figures.wall = start.elapsed();
    for cluster in clusters {
        cluster.transport().unregister(BASELINE);
    }
    Ok(figures)
}
