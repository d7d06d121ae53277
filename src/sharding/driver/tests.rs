//! The driver's unit tests.

use crate::sharding::coordinator::RebalanceReason;

use super::publish::reason_label;

/// The reasons registered at 0 when a node starts are the labels its
/// rounds are counted under, so no zero series sits beside a real one.
#[test]
fn the_reasons_registered_at_start_are_those_rounds_count_under() {
    let all = [
        RebalanceReason::DeadOwner,
        RebalanceReason::GracefulSpread,
        RebalanceReason::GracefulLeave,
        RebalanceReason::NewerVersion,
        RebalanceReason::Traffic,
    ];
    // A reason added later must be listed above: this match, with no
    // catch-all, stops the build until its arm is written here too.
    for reason in all {
        match reason {
            RebalanceReason::DeadOwner
            | RebalanceReason::GracefulSpread
            | RebalanceReason::GracefulLeave
            | RebalanceReason::NewerVersion
            | RebalanceReason::Traffic => {}
        }
    }
    assert_eq!(
        all.map(reason_label),
        crate::ops::telemetry::REBALANCE_REASONS
    );
}
