//! No false Down under load: three nodes in one process keep both cores busy
//! with request/reply traffic to each other, on the same pipes that carry
//! their heartbeats, and none of them may see another as unreachable.
//!
//! The only test in this binary, so that no other test competes for the
//! cores. Knobs for checking by hand that it can fail (see
//! BENCHMARKS.md, failure detection section): `LOAD_PAUSE_MS` overrides the acceptable
//! heartbeat pause (default 300 ms), `LOAD_SECS` the duration (default 5),
//! `LOAD_IN_FLIGHT` the requests each node keeps in flight (default 256).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::membership::MembershipEvent;
use tokio::sync::broadcast::error::TryRecvError;
use tokio::task::JoinSet;

const ECHO: u16 = 100;
/// Requests each node keeps in flight by default, split over its two peers.
const IN_FLIGHT_PER_NODE: u64 = 256;
/// Inbound capacity of the echo channel: above the 512 requests that two
/// peers can have in flight at one node, so none is refused as overloaded.
const ECHO_CAPACITY: usize = 1_024;
const PAYLOAD: &[u8] = &[0x5a; 64];
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const LONG: Duration = Duration::from_secs(15);
/// The floor that shows the load really ran.
const MIN_REQUESTS: u64 = 50_000;

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v} is not a number")),
        Err(_) => default,
    }
}

fn config(seeds: Vec<std::net::SocketAddr>, pause: Duration) -> ClusterConfig {
    ClusterConfig::builder()
        .cluster_name("load-test")
        .secret("load-secret")
        .seed_nodes(seeds)
        .acceptable_heartbeat_pause(pause)
        .build()
}

/// Answers every request on the echo channel with its own payload.
fn serve_echo(node: &ClusterNode) -> tokio::task::JoinHandle<()> {
    let mut inbox = node
        .transport()
        .register(ECHO, ECHO_CAPACITY)
        .expect("register echo");
    tokio::spawn(async move {
        while let Some(msg) = inbox.recv().await {
            if let Some(reply) = msg.reply {
                let _ = reply.reply(msg.payload);
            }
        }
    })
}

/// CPU time (user + system) this process has used so far.
fn process_cpu_time() -> Duration {
    // SAFETY: getrusage only writes into the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1_000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_false_unreachable_while_both_cores_carry_request_load() {
    let pause = Duration::from_millis(env_u64("LOAD_PAUSE_MS", 300));
    let duration = Duration::from_secs(env_u64("LOAD_SECS", 5));
    let in_flight = env_u64("LOAD_IN_FLIGHT", IN_FLIGHT_PER_NODE) as usize;

    let a = ClusterNode::start(config(vec![], pause))
        .await
        .expect("start a");
    let b = ClusterNode::start(config(vec![a.bound_addr()], pause))
        .await
        .expect("start b");
    let c = ClusterNode::start(config(vec![a.bound_addr()], pause))
        .await
        .expect("start c");
    let nodes = [a, b, c];
    for n in &nodes {
        n.wait_until(|s| s.up_members().count() == 3, LONG)
            .await
            .expect("three nodes Up");
    }
    let mut events: Vec<_> = nodes.iter().map(|n| n.subscribe()).collect();
    let _echo: Vec<_> = nodes.iter().map(serve_echo).collect();

    let replies = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(AtomicU64::new(0));
    let cpu_before = process_cpu_time();
    let started = Instant::now();
    let end = started + duration;
    let mut drivers = JoinSet::new();
    for (i, from) in nodes.iter().enumerate() {
        let peers: Vec<_> = (0..nodes.len())
            .filter(|&j| j != i)
            .map(|j| nodes[j].self_address())
            .collect();
        for k in 0..in_flight {
            let transport = from.transport().clone();
            let to = peers[k % peers.len()];
            let (replies, failures) = (replies.clone(), failures.clone());
            drivers.spawn(async move {
                let payload = Bytes::from_static(PAYLOAD);
                while Instant::now() < end {
                    match transport
                        .request(&to, ECHO, payload.clone(), REQUEST_TIMEOUT)
                        .await
                    {
                        Ok(reply) if reply == payload => replies.fetch_add(1, Ordering::Relaxed),
                        _ => failures.fetch_add(1, Ordering::Relaxed),
                    };
                }
            });
        }
    }
    while let Some(done) = drivers.join_next().await {
        done.expect("driver task");
    }
    let elapsed = started.elapsed();
    let cores_busy = (process_cpu_time() - cpu_before).as_secs_f64() / elapsed.as_secs_f64();
    let replies = replies.load(Ordering::Relaxed);
    let failures = failures.load(Ordering::Relaxed);

    let mut false_alarms = Vec::new();
    for (i, rx) in events.iter_mut().enumerate() {
        loop {
            match rx.try_recv() {
                Ok(e @ (MembershipEvent::Unreachable(_) | MembershipEvent::MemberDowned(_))) => {
                    false_alarms.push(format!("node {i}: {e:?}"))
                }
                Ok(_) => {}
                Err(TryRecvError::Empty) => break,
                Err(e) => panic!("node {i}: cannot read every event: {e}"),
            }
        }
    }
    eprintln!(
        "load: {replies} requests in {elapsed:.2?} = {:.0} req/s, {failures} failed, \
         {cores_busy:.2} cores busy, {in_flight} in flight per node, pause {pause:?}, false Unreachable/Down: {}",
        replies as f64 / elapsed.as_secs_f64(),
        false_alarms.len()
    );
    assert!(
        false_alarms.is_empty(),
        "false alarms under load: {false_alarms:#?}"
    );
    assert!(
        replies > MIN_REQUESTS,
        "the load did not run: {replies} requests"
    );
    assert_eq!(failures, 0, "requests failed under load");
    for n in &nodes {
        let s = n.current_state();
        assert_eq!(s.up_members().count(), 3, "{s:?}");
        assert!(s.unreachable.is_empty(), "{s:?}");
    }
    for n in &nodes {
        n.shutdown().await.ok();
    }
}
