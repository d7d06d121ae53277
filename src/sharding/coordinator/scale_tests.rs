//! The probe the benchmark runner drives: it places, and a join starts a
//! round.

use super::*;

#[test]
fn a_probe_places_every_shard_and_a_join_starts_a_round() {
    let t0 = Instant::now();
    let mut probe = ScaleProbe::new(t0, 3, 64);
    assert!(probe.ready(t0));
    for shard in 0..64 {
        // Each new home is told to every region.
        assert_eq!(probe.get_home(t0, shard), 3);
    }
    // Known now: only the asker hears it again.
    assert_eq!(probe.get_home(t0, 7), 1);
    probe.join(t0);
    probe.tick(t0);
    // The next round is what the core waits for next.
    let due = probe.poll_timeout().expect("a round to come");
    assert_eq!(
        probe.tick(due),
        CoordinatorConfig::default().rebalance_per_round
    );
}
