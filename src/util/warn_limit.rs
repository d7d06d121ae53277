//! A rate limit for warnings that other nodes can cause.
//!
//! A refused handshake (anyone who reaches the port) or an undecodable
//! message from an authenticated but buggy peer must not flood the log: per
//! limiter, at most `max` warnings are logged per `window`; the rest go to
//! `debug` and are counted, and the next warning logged reports how many were
//! suppressed before it.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Default number of warnings per window.
pub(crate) const WARNINGS_PER_WINDOW: u32 = 10;
/// Default window.
pub(crate) const WINDOW: Duration = Duration::from_secs(10);

/// Counts warnings of one kind in fixed windows (see the module docs).
pub(crate) struct WarnLimit {
    max: u32,
    window: Duration,
    state: Mutex<Window>,
}

struct Window {
    started: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl Default for WarnLimit {
    /// [`WARNINGS_PER_WINDOW`] per [`WINDOW`].
    fn default() -> Self {
        WarnLimit::new(WARNINGS_PER_WINDOW, WINDOW)
    }
}

impl WarnLimit {
    /// At most `max` warnings per `window`.
    pub(crate) const fn new(max: u32, window: Duration) -> Self {
        WarnLimit {
            max,
            window,
            state: Mutex::new(Window {
                started: None,
                logged: 0,
                suppressed: 0,
            }),
        }
    }

    /// Whether a warning may be logged now: `Some(n)` if so, `n` being how
    /// many were suppressed since the last one logged; `None` if this one is
    /// to be logged at debug only (it is counted).
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut w = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if w.started.is_none_or(|s| now >= s + self.window) {
            w.started = Some(now);
            w.logged = 0;
        }
        if w.logged < self.max {
            w.logged += 1;
            Some(std::mem::take(&mut w.suppressed))
        } else {
            w.suppressed += 1;
            None
        }
    }
}

/// `warn_limited!(limit, "message"; fields…)`: a `tracing::warn!` with these
/// fields if `limit` admits it (with `suppressed = n` and a note in the
/// message when earlier ones were suppressed), else a `tracing::debug!`.
macro_rules! warn_limited {
    ($limit:expr, $msg:literal; $($field:tt)*) => {
        match $limit.admit() {
            Some(0) => tracing::warn!($($field)*, $msg),
            Some(suppressed) => tracing::warn!(
                $($field)*, suppressed,
                concat!($msg, " ({} similar warnings suppressed before this one)"),
                suppressed
            ),
            None => tracing::debug!($($field)*, concat!($msg, " (warning rate-limited)")),
        }
    };
}
pub(crate) use warn_limited;

/// A subscriber layer that records events, for tests of what is logged.
#[cfg(test)]
pub(crate) mod capture {
    use std::sync::{Arc, Mutex};

    /// Every event seen: its level and its fields rendered as `name=value `.
    #[derive(Clone, Default)]
    pub(crate) struct Captured(pub(crate) Arc<Mutex<Vec<(tracing::Level, String)>>>);

    impl Captured {
        /// The events recorded so far.
        pub(crate) fn events(&self) -> Vec<(tracing::Level, String)> {
            self.0.lock().expect("lock").clone()
        }
    }

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Captured {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            struct Fields(String);
            impl tracing::field::Visit for Fields {
                fn record_debug(
                    &mut self,
                    field: &tracing::field::Field,
                    value: &dyn std::fmt::Debug,
                ) {
                    self.0.push_str(&format!("{}={:?} ", field.name(), value));
                }
            }
            let mut fields = Fields(String::new());
            event.record(&mut fields);
            let level = *event.metadata().level();
            self.0.lock().expect("lock").push((level, fields.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::capture::Captured;
    use super::*;

    #[test]
    fn at_most_max_per_window_then_the_count_of_suppressed_ones() {
        let limit = WarnLimit::new(3, Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        // A window opens with the first warning: three are logged...
        assert_eq!(limit.admit_at(at(0)), Some(0));
        assert_eq!(limit.admit_at(at(1)), Some(0));
        assert_eq!(limit.admit_at(at(2)), Some(0));
        // ...the rest of the window is suppressed and counted...
        for ms in 3..8 {
            assert_eq!(limit.admit_at(at(ms)), None);
        }
        assert_eq!(limit.admit_at(at(9_999)), None);
        // ...and the first warning of the next window reports them, once.
        assert_eq!(limit.admit_at(at(10_000)), Some(6));
        assert_eq!(limit.admit_at(at(10_001)), Some(0));
        assert_eq!(limit.admit_at(at(10_002)), Some(0));
        assert_eq!(limit.admit_at(at(10_003)), None);
        // A quiet stretch longer than a window starts afresh.
        assert_eq!(limit.admit_at(at(60_000)), Some(1));
        assert_eq!(limit.admit_at(at(60_001)), Some(0));
    }

    #[test]
    fn the_macro_warns_then_debugs_then_reports_the_suppressed() {
        use tracing_subscriber::layer::SubscriberExt;
        let captured = Captured::default();
        let subscriber = tracing_subscriber::registry().with(captured.clone());
        let limit = WarnLimit::new(1, Duration::from_millis(200));
        tracing::subscriber::with_default(subscriber, || {
            let peer = "127.0.0.1:1";
            for _ in 0..3 {
                warn_limited!(limit, "bad input"; %peer, error = "x");
            }
            std::thread::sleep(Duration::from_millis(250));
            warn_limited!(limit, "bad input"; %peer, error = "x");
        });
        let logged = captured.events();
        let levels: Vec<_> = logged.iter().map(|(level, _)| *level).collect();
        use tracing::Level;
        assert_eq!(
            levels,
            [Level::WARN, Level::DEBUG, Level::DEBUG, Level::WARN]
        );
        assert!(logged[0].1.contains("peer=127.0.0.1:1"), "{logged:?}");
        assert!(!logged[0].1.contains("suppressed"), "{logged:?}");
        assert!(logged[1].1.contains("(warning rate-limited)"), "{logged:?}");
        assert!(logged[3].1.contains("suppressed=2"), "{logged:?}");
        assert!(
            logged[3]
                .1
                .contains("(2 similar warnings suppressed before this one)"),
            "{logged:?}"
        );
    }
}
