//! A warning that comes once per message in a burst: a connection lost with
//! hundreds of acks pending, an ownership ended with its offsets waiting.
//! The first is logged; the rest within the quiet period are counted, and
//! the next one logged after it says how many were left out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a burst's repeats stay out of the log.
pub const QUIET: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
pub struct BurstLog {
    last: Mutex<Option<Instant>>,
    left_out: AtomicU64,
}

impl BurstLog {
    /// At `now`: `Some(left_out)` if this one is to be logged, with how
    /// many were left out since the last logged; `None` to leave it out.
    pub fn admit(&self, now: Instant) -> Option<u64> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match *last {
            Some(at) if now.saturating_duration_since(at) < QUIET => {
                self.left_out.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => {
                *last = Some(now);
                Some(self.left_out.swap(0, Ordering::Relaxed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_logged_once_then_counted_until_the_quiet_period_is_over() {
        let log = BurstLog::default();
        let t = Instant::now();
        assert_eq!(log.admit(t), Some(0));
        for i in 1..=300 {
            assert_eq!(log.admit(t + Duration::from_millis(i)), None);
        }
        assert_eq!(log.admit(t + QUIET), Some(300));
        assert_eq!(log.admit(t + QUIET + Duration::from_millis(1)), None);
        assert_eq!(log.admit(t + QUIET * 3), Some(1));
    }
}
